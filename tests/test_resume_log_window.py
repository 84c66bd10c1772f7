"""A run resumed from a checkpoint written at the update that ends a log window (train.ckpt_every_steps at the
epoch's last update) logs that window once, as a run never stopped does, and under torchrun the resumed ranks meet in
the same collectives (TWEO's window sums) instead of hanging. The run is killed in update 5: the write of update 4 is
held back until update 5's loss has measured its weights (engine/loop.py TrainLoop.checkpoint), so a kill before that
(in the validation of update 4, as these tests killed it first) leaves no checkpoint of update 4 to resume from."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import train
from dist_utils import free_port, init_gloo, leave_and_exit, spawn_within
from tests.conftest import DEBUG_CONFIG, ROOT
from tests.test_resume_kills import logged_series

# an epoch of the tiny config is 4 updates: the checkpoint of update 4 (ckpt_every_steps) is the epoch's last update,
# which ends the window 4-4 (log_every_steps=3); the run is killed in the optimizer step of update 5
RUN = ("cd.enabled=false", "log.tensorboard=false", "tweo.enabled=true", "train.log_every_steps=3",
       "train.ckpt_every_steps=4")


class Killed(BaseException):
    """A kill where no handler of train.py runs (a BaseException its `except Exception` lets through)."""


def test_a_resume_from_the_checkpoint_of_the_update_that_ends_a_window_logs_it_once(tmp_path, debug_config):
    """The checkpoint of update 4 carried the window of update 4, logged right after at the epoch's end; the run
    resumed there logged it a second time, with train/lr 0.0 (no update trained). Reference: the same run straight
    through, one record per log step."""
    import torch.optim.optimizer as optimizer_module

    train.main(debug_config(*RUN, name="straight"))
    straight = logged_series(tmp_path / "straight")
    assert [r["step"] for r in straight] == [3, 4, 6, 8]

    steps = []

    def killed_in_update_5(*_):
        steps.append(1)
        if len(steps) == 5:
            raise Killed()

    handle = optimizer_module.register_optimizer_step_post_hook(killed_in_update_5)
    try:
        with pytest.raises(Killed):
            train.main(debug_config(*RUN, name="killed"))
    finally:
        handle.remove()
    resumed = train.main(debug_config(*RUN, name="killed"))
    assert logged_series(tmp_path / "killed") == straight and resumed.state.step == 8


# train.py under torchrun, every rank exiting at once (no handler runs) in the optimizer step of update 5 with KILLVAL
DRIVER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, os.getcwd())
    import torch.optim.optimizer as optimizer_module
    import train
    if os.environ.get("KILLVAL"):
        steps = []
        def killed(*_):
            steps.append(1)
            if len(steps) == 5:
                os._exit(9)
        optimizer_module.register_optimizer_step_post_hook(killed)
    train.main(train.parse_args(sys.argv[1:]))
""")


def torchrun(tmp_path, out_dir, kill: bool) -> int:
    """Two gloo ranks of DRIVER; a hang fails the test after 240 s: SIGTERM to torchrun, which ends its ranks (they
    run in sessions of their own), then SIGKILL. The output goes to a file, which no rank left over holds open."""
    driver, log_path = tmp_path / "driver.py", tmp_path / f"torchrun_{out_dir.name}_{kill}.log"
    driver.write_text(DRIVER)
    env = {**{k: v for k, v in os.environ.items() if k != "KILLVAL"}, "OMP_NUM_THREADS": "1",
           **({"KILLVAL": "1"} if kill else {})}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                 "--master_port", str(free_port()), str(driver), "--config", DEBUG_CONFIG,
                                 "train.device=cpu", *RUN, f"out_dir={out_dir}"], cwd=ROOT, env=env,
                                stdout=log_file, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            pytest.fail(f"torchrun hung (stopped after 240 s):\n{log_path.read_text()[-3000:]}")
    if not kill:
        assert proc.returncode == 0, log_path.read_text()[-3000:]
    return proc.returncode


@pytest.mark.slow  # three torchruns of 2 ranks (about 90 s on a 2-core VM)
def test_a_resume_under_torchrun_from_the_checkpoint_of_a_window_end_neither_hangs_nor_logs_it_twice(tmp_path):
    """load_window_state gave the carried TWEO sums to rank 0 only, and TWEO's metrics() all-reduced only where
    its own count was not 0: the resumed run's first log (before any forward) had rank 0 in an all_reduce rank 1
    never joined, a hang. Every rank now joins. Reference: the same 2-rank run straight through."""
    torchrun(tmp_path, tmp_path / "straight", kill=False)
    straight = logged_series(tmp_path / "straight")
    assert [r["step"] for r in straight] == [3, 4, 6, 8]
    assert torchrun(tmp_path, tmp_path / "killed", kill=True) != 0
    torchrun(tmp_path, tmp_path / "killed", kill=False)
    assert logged_series(tmp_path / "killed") == straight


def _tweo_rank(rank: int, world: int, port: int) -> None:
    from cd import TWEO
    from cd_models import tiny_vit
    from engine.distributed import all_reduce

    init_gloo(rank, world, port, timeout_s=30)
    tweo = TWEO(tiny_vit())
    # the resumed run: the carried window (3 forwards over both ranks) goes to rank 0, rank 1 starts from 0
    tweo.load_window_state({"penalty_sum": 0.6, "count": 3.0, "last_penalty": 0.1, "last_lam": 0.01},
                           keep_sums=rank == 0)
    state = tweo.window_state(sum_fn=all_reduce)  # a checkpoint before any forward: every rank calls it
    assert (state["penalty_sum"], state["count"]) == pytest.approx((0.6, 3.0))
    assert tweo.metrics(sum_fn=all_reduce)["tweo/penalty"] == pytest.approx(0.2)  # a log before any forward
    assert tweo.metrics(sum_fn=all_reduce)["tweo/penalty"] == pytest.approx(0.2)  # none since: the last mean
    leave_and_exit()


@pytest.mark.slow  # 2 gloo ranks
def test_tweo_window_sums_carried_to_one_rank_are_reduced_by_every_rank():
    """TWEO's metrics() and window_state() all-reduced only on a rank whose own window count was not 0; after a
    resume only rank 0 holds the carried sums, so rank 0 waited in an all_reduce rank 1 skipped (a hang).
    Reference: the carried sums, 0.6 over 3 forwards."""
    spawn_within(_tweo_rank, (2, free_port()), 2, seconds=90)


def test_a_window_carried_over_a_resume_sums_to_the_bits_of_its_exact_mean():
    """Under DDP a resumed rank 0 adds its own losses after the sum every rank carried, an order of additions other
    than that of a run never stopped (each rank its own losses, then the ranks' sums). Summed in float32, that moved
    the logged train/loss in its last bits (2.4032766342163088 resumed against 2.4032764434814453 never stopped,
    vit_digits on 2 ranks, stopped inside a window). The window now sums in float64, where float32 losses add up
    exactly, in any order. Here one process takes the ranks' order: losses 0, 2 carried, then 1 and 3. Reference: the
    exact mean (math.fsum) of the float32 losses, which both windows log."""
    import math

    import torch

    from engine.loop import _Window

    torch.manual_seed(0)
    losses = list(torch.rand(4) * 3)  # float32, as a float32 model's loss
    cpu = torch.device("cpu")
    straight, carried, resumed = _Window(cpu), _Window(cpu), _Window(cpu)
    for window, part in ((straight, losses), (carried, losses[0::2])):
        for loss in part:
            window.add_loss(loss)
            window.add_update(2, None)
    resumed.carry_on(carried.record(), main=True)
    for loss in losses[1::2]:
        resumed.add_loss(loss)
        resumed.add_update(2, None)
    exact = math.fsum(float(loss) for loss in losses) / 4
    assert straight.flush(4, None)["train/loss"] == resumed.flush(4, None)["train/loss"] == exact


def test_tweo_window_carried_over_a_resume_sums_to_the_bits_of_its_exact_mean():
    """TWEO's tweo/penalty as train/loss above: `load_window_state` rounded the carried float64 sum to float32 and
    the forwards added to it in float32, in another order than a run never stopped. Reference: the exact mean
    (math.fsum) of the forwards' penalties, each as a window of that forward alone logs it."""
    import math

    import torch

    from cd import TWEO
    from cd_models import tiny_vit

    model = tiny_vit()
    torch.manual_seed(0)
    xs = [torch.randn(2, 3, 32, 32) for _ in range(4)]

    def forwards(tweo, part):
        for x in part:
            tweo.aux_loss(model(x).sum())

    with TWEO(model) as tweo:
        penalties = []
        for x in xs:
            forwards(tweo, [x])
            penalties.append(tweo.metrics()["tweo/penalty"])
        forwards(tweo, xs)
        straight = tweo.metrics()["tweo/penalty"]
        forwards(tweo, xs[0::2])  # the checkpoint's window: every rank's first forwards
        state = tweo.window_state()
    with TWEO(model) as tweo:  # the resumed run
        tweo.load_window_state(state)
        forwards(tweo, xs[1::2])
        resumed = tweo.metrics()["tweo/penalty"]
    assert straight == resumed == math.fsum(penalties) / 4


def test_a_window_carried_into_other_micro_batches_weighs_each_update_alike():
    """A window written with 2 micro-batches per update (2 ranks x 8, or one process x 2 accumulation steps) and
    continued with 4 (train.batch_size_per_gpu=4, the same global batch: e.g. on 4 processes): train/loss, the sum of
    the micro-batches' mean losses over their number, weighed each resumed update twice as much as a carried one.
    Reference: the mean of the updates' mean losses, by hand."""
    import torch

    from engine.loop import _Window

    cpu = torch.device("cpu")
    carried, resumed = _Window(cpu), _Window(cpu)
    before = [[1.0, 3.0], [2.0, 2.0]]  # two updates of 2 micro-batches: means 2.0, 2.0
    after = [[4.0, 6.0, 5.0, 5.0]]  # one update of 4 micro-batches: mean 5.0
    for update in before:
        for loss in update:
            carried.add_loss(torch.tensor(loss))
        carried.add_update(16, None)
    resumed.carry_on(carried.record(), main=True, micro_per_update=4)
    for update in after:
        for loss in update:
            resumed.add_loss(torch.tensor(loss))
        resumed.add_update(16, None)
    assert resumed.flush(3, None)["train/loss"] == (2.0 + 2.0 + 5.0) / 3


@pytest.mark.parametrize("tweo", [False, True], ids=["plain", "tweo"])
def test_a_run_stopped_inside_a_window_and_resumed_with_another_per_process_batch_logs_the_window_it_trained(
        tmp_path, debug_config, tweo):
    """train.py: stopped by a SIGTERM after update 1 (inside the window 1-2) with 8 images per process x 2
    accumulation steps, resumed with train.batch_size_per_gpu=4 (4 x 4: the same global batch, no changed setting).
    The window logged at update 2 was (2 L1 + 4 L2) / 6, 5e-3 off, and with TWEO its tweo/penalty (2 P1 + 4 P2) / 6.
    Reference: the run never stopped, with 8 per process (a LayerNorm ViT without mixup, drop path or dropout: the
    per-process batch changes the loss and the penalty by rounding alone)."""
    import torch.optim.optimizer as optimizer_module

    run = ("log.tensorboard=false", "cd.enabled=false", f"tweo.enabled={str(tweo).lower()}", "model.drop_path=0",
           "data.mixup=0", "data.cutmix=0", "train.max_steps=2")
    train.main(debug_config(*run, name="straight"))
    straight = logged_series(tmp_path / "straight")
    assert [r["step"] for r in straight] == [2]

    def stop(*_):
        os.kill(os.getpid(), signal.SIGTERM)
        handle.remove()

    handle = optimizer_module.register_optimizer_step_post_hook(stop)
    try:
        assert train.main(debug_config(*run, name="stopped")).reason == "preempted"
    finally:
        handle.remove()
    train.main(debug_config(*run, "train.batch_size_per_gpu=4", name="stopped"))
    resumed = logged_series(tmp_path / "stopped")
    assert [r["step"] for r in resumed] == [2]
    assert resumed[0]["train/loss"] == pytest.approx(straight[0]["train/loss"], abs=1e-6)
    if tweo:
        assert resumed[0]["tweo/penalty"] == pytest.approx(straight[0]["tweo/penalty"], rel=1e-5)
    else:
        assert "tweo/penalty" not in resumed[0]


def test_a_tweo_window_carried_into_other_micro_batches_weighs_each_update_alike():
    """TWEO's tweo/penalty as train/loss in `test_a_window_carried_into_other_micro_batches_weighs_each_update_alike`:
    a window written with 2 forwards per update and continued with 4 (the same global batch in other per-process
    batches) averaged all forwards, weighing each resumed update twice as much as a carried one. Reference: the mean
    of the updates' mean penalties, by hand."""
    from cd import TWEO
    from cd_models import tiny_vit

    model = tiny_vit()
    with TWEO(model) as tweo:  # the resumed run: two carried updates of 2 forwards (mean 2.0), then one of 4
        tweo.load_window_state({"penalty_sum": 8.0, "count": 4.0, "last_penalty": None, "last_lam": 0.01},
                               forwards=2 * 4)
        tweo._window_sum = tweo._window_sum + 4 * 5.0  # one update of 4 forwards, mean penalty 5.0
        tweo._window_count += 4
        assert tweo.metrics()["tweo/penalty"] == (2.0 + 2.0 + 5.0) / 3
