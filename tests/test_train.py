"""train.py end to end on CPU: outputs, exact resume, DDP (2 gloo processes), non-finite loss (preemption:
test_preemption.py)."""
import io
import json
import re
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import train
from configs import ConfigError, load_config
from engine.checkpoint import CheckpointError
from engine.loop import NonFiniteLossError, TrainLoop, TrainState
from dist_utils import as_torchrun_rank, free_port, leave_and_exit, spawn_ranks
from tests.conftest import DEBUG_CONFIG, DEMO_CONFIG, ROOT, run_entry


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_debug_run_writes_the_documented_files(debug_config):
    cfg = debug_config()
    result = train.main(cfg)
    assert result.state.step == 8 and result.state.epoch == 2  # 2 epochs x 4 updates of 2 micro-batches
    for name in ("config.yaml", "metrics.jsonl", "checkpoint.pt", "best.pt", "train.log", "tb"):
        assert os.path.exists(os.path.join(cfg.out_dir, name)), name
    records = read_metrics(cfg.out_dir)
    train_records = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train_records] == [2, 4, 6, 8]
    assert all(k in train_records[0] for k in ("train/lr", "train/img_per_s", "train/epoch"))
    assert any("val/top1" in r for r in records)
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in train_records)


def test_an_ema_run_says_so_in_train_log_and_prints_its_score_beside_the_raw_one(debug_config):
    """With train.ema=true, train.log never mentioned the EMA: its decay, and its score (val_ema/top1, in
    metrics.jsonl only) beside the raw weights' at each validation."""
    cfg = debug_config("train.ema=true", "train.ema_decay=0.9")
    train.main(cfg)
    with open(os.path.join(cfg.out_dir, "train.log")) as f:
        text = f.read()
    assert "EMA of the weights: decay 0.9 per update; scored as val_ema/* at each validation" in text
    scored = [r for r in read_metrics(cfg.out_dir) if "val_ema/top1" in r]
    lines = re.findall(r"epoch \d+/\d+  update (\d+)  val top-1 ([\d.]+)%  \(EMA: val top-1 ([\d.]+)%\)", text)
    assert scored and [(int(u), float(raw), float(ema)) for u, raw, ema in lines] == [
        (r["step"], round(r["val/top1"], 2), round(r["val_ema/top1"], 2)) for r in scored]


@pytest.mark.slow  # trains the Swin demo 40 updates (about 30 s)
def test_demo_config_trains_on_digits(tmp_path):
    # the Swin demo: ViTs with a cls token sit on a loss plateau for their first ~100 updates. Batches of 32, not
    # the demo's 64: 40 updates take a third of the time of the 60 updates of 64 this test ran before (20.0 %)
    cfg = load_config([os.path.join(ROOT, "configs", "demo", "swin_digits.yaml")],
                      [f"out_dir={tmp_path}", "train.max_steps=40", "train.batch_size=32",
                       "train.batch_size_per_gpu=32", "sched.epochs=3", "sched.warmup_epochs=0"])
    result = train.main(cfg)
    assert result.state.step == 40
    assert result.metrics["val/count"] == 360
    assert result.metrics["val/top1"] > 15.0  # chance is 10%; 20.3% measured (deterministic on CPU)


def checkpoint_tensors(path):
    ckpt = torch.load(path, weights_only=True)
    flat = {f"model.{k}": v for k, v in ckpt["model"].items()}
    flat.update({f"ema.{k}": v for k, v in ckpt["model_ema"].items()})
    for pid, pstate in ckpt["optimizer"]["state"].items():
        flat.update({f"opt.{pid}.{k}": torch.as_tensor(v) for k, v in pstate.items()})
    return flat, ckpt["state"], ckpt["scheduler"]


@pytest.mark.parametrize("regularizers",
                         [(), ("cd.enabled=true", "tweo.enabled=true", "tweo.schedule=cosine"),
                          ("cd.enabled=true", "cd.mode=loss"),
                          ("cd.enabled=true", "train.amp=fp16", "optim.fused=true"),
                          # timm's Lookahead counts its updates in the groups (lookahead_step) and pulls the weights
                          # back every 6th: from update 6 on a counter restarted at the resume (update 3) shows
                          ("optim.name=lookahead_adamw", "optim.lr=1e-3")],
                         ids=["plain", "cd+tweo", "cd_loss", "cd+fp16+fused", "lookahead"])
def test_exact_resume_mid_epoch(debug_config, regularizers):
    # mixup/cutmix (DeiT defaults), drop path 0.1, 2 accumulation steps and EMA all draw randomness or state
    common = ("train.ema=true", "train.ema_decay=0.9", "sched.per_step=true", *regularizers)
    straight = debug_config(*common, name="straight")
    train.main(straight)
    split = debug_config(*common, "train.max_steps=3", name="split")  # stops inside epoch 0 (4 updates)
    first = train.main(split)
    assert first.state.step == 3 and first.state.epoch == 0 and first.state.epoch_batches == 6
    split_rest = debug_config(*common, name="split")
    train.main(split_rest)
    a, state_a, sched_a = checkpoint_tensors(os.path.join(straight.out_dir, "checkpoint.pt"))
    b, state_b, sched_b = checkpoint_tensors(os.path.join(split.out_dir, "checkpoint.pt"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # the split run also validated at its stop (update 3): where its best validation was may differ
    where_best = ("best_epoch", "best_step", "best_fingerprint")
    assert ({k: v for k, v in state_a.items() if k not in where_best}
            == {k: v for k, v in state_b.items() if k not in where_best}) and sched_a == sched_b
    # the groups' settings and the counters some optimizers keep in them (Lookahead's lookahead_step)
    ckpt_a, ckpt_b = (torch.load(os.path.join(cfg.out_dir, "checkpoint.pt"), weights_only=True)
                      for cfg in (straight, split))
    assert ckpt_a["optimizer"]["param_groups"] == ckpt_b["optimizer"]["param_groups"]
    # fp16's loss scale and the updates since it last grew (a scaler restarted at the resume counts 5, not 8)
    assert ckpt_a.get("scaler") == ckpt_b.get("scaler")
    assert ("scaler" in ckpt_a) == ("train.amp=fp16" in regularizers)


def test_a_resumed_run_counts_the_cd_updates_made_before_its_checkpoint(debug_config):
    """cd/updates is the number of CD updates of the whole run: one per optimizer update (no fp16 skips here),
    so at every logged update it equals that update's number, also after a resume at update 3 (hand count:
    3 before the checkpoint + the updates after it; a counter restarted at 0 would log step - 3)."""
    train.main(debug_config("cd.enabled=true", "train.max_steps=3", name="cd_count"))
    cfg = debug_config("cd.enabled=true", name="cd_count")
    train.main(cfg)
    logged = [(r["step"], r["cd/updates"]) for r in read_metrics(cfg.out_dir) if "cd/updates" in r]
    assert [step for step, _ in logged if step > 3], logged  # records written after the resume
    assert all(updates == step for step, updates in logged), logged


def test_resuming_with_another_model_is_refused(debug_config):
    train.main(debug_config("train.max_steps=1", name="r"))
    with pytest.raises(CheckpointError, match="written for model"):
        train.main(debug_config("model.name=vit_micro", name="r"))


def test_rerunning_a_finished_run_trains_nothing(debug_config):
    cfg = debug_config(name="done")
    train.main(cfg)
    before = os.path.getmtime(os.path.join(cfg.out_dir, "best.pt"))
    again = train.main(debug_config(name="done"))
    assert again.state.step == 8 and "val/top1" in again.metrics
    assert os.path.getmtime(os.path.join(cfg.out_dir, "best.pt")) == before


def test_non_finite_loss_stops_without_writing_a_checkpoint(debug_config):
    from data import build_loaders

    cfg = debug_config()
    loaders = build_loaders(cfg.data, img_size=32, batch_size_per_gpu=8, eval_batch_size_per_gpu=8, rank=0,
                            world_size=1, seed=0, num_classes=4)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))
    calls, saves = [0], []

    def compute_loss(m, x, y):
        calls[0] += 1
        loss = torch.nn.functional.cross_entropy(m(x), y.argmax(1) if y.ndim == 2 else y)
        return loss * float("nan") if calls[0] > 4 else loss  # updates 1-2 fine, update 3 diverges

    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     compute_loss=compute_loss, device=torch.device("cpu"), accum_steps=2, ckpt_every=1,
                     save=lambda: saves.append(1), log_every=100)
    with pytest.raises(NonFiniteLossError, match="nan"):
        loop.run_epoch(loaders.train, TrainState(), batch_size_per_gpu=8)
    assert len(saves) == 2  # written after the two good updates, never after the bad one


def _ddp_worker(rank, world, port, overrides, out_file):
    # train.py joins the group itself, from the variables torchrun would set
    as_torchrun_rank(rank, world, port)
    cfg = load_config([DEBUG_CONFIG], overrides)
    result = train.main(cfg)
    torch.save(result.model.state_dict(), out_file.format(rank=rank))
    leave_and_exit()


# No per-sample randomness, so one process on the same global batch must compute the same updates. SGD,
# because Adam turns the rounding noise of exactly-zero gradients (the K bias of attention) into lr-sized
# steps that differ with the reduction order.
DETERMINISTIC = ("data.mixup=0", "data.cutmix=0", "model.drop_path=0", "data.label_smoothing=0",
                 "optim.name=sgd", "optim.lr=0.05")


@pytest.mark.slow
@pytest.mark.parametrize("per_gpu", [8, 4], ids=["no_accumulation", "two_accumulation_steps"])
def test_ddp_ranks_agree_and_match_one_process(tmp_path, per_gpu):
    # per_gpu 4: each rank accumulates 2 micro-batches of 4 (no_sync on the first), 2 x 2 x 4 = 16 images
    out = str(tmp_path / "weights_{rank}.pt")
    overrides = [*DETERMINISTIC, f"out_dir={tmp_path / 'ddp'}", f"train.batch_size_per_gpu={per_gpu}"]
    spawn_ranks(_ddp_worker, (2, free_port(), overrides, out), 2)
    rank0, rank1 = torch.load(out.format(rank=0)), torch.load(out.format(rank=1))
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    # one process, 2 accumulation steps of 8: the same 16 images per update as the two ranks together
    single = train.main(load_config([DEBUG_CONFIG], [*DETERMINISTIC, f"out_dir={tmp_path / 'single'}"])).model
    initial = train.build_model(load_config([DEBUG_CONFIG]).model).state_dict()
    for key, value in single.state_dict().items():
        assert torch.allclose(rank0[key], value, atol=1e-6, rtol=1e-5), key
        if key.endswith("weight") and value.ndim == 2:
            assert not torch.allclose(value, initial[key])  # training did move the weights


@pytest.mark.slow
def test_torchrun_two_processes_from_the_command_line(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_port", str(free_port()),
           "train.py", "--config", DEBUG_CONFIG, f"out_dir={tmp_path}", "train.batch_size_per_gpu=8",
           "data.synthetic_val_size=17", "train.eval_batch_size_per_gpu=8"]  # val shards: 2 and 1 batches
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 process(es)" in run.stdout and "val top-1" in run.stdout
    assert torch.load(os.path.join(tmp_path, "checkpoint.pt"), weights_only=True)["state"]["step"] == 8


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_gradscaler_skipped_updates_are_counted_and_leave_weights_unchanged(debug_config, fused):
    from data import build_loaders

    cfg = debug_config("data.mixup=0", "data.cutmix=0")
    loaders = build_loaders(cfg.data, img_size=32, batch_size_per_gpu=8, eval_batch_size_per_gpu=8, rank=0,
                            world_size=1, seed=0, num_classes=4)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))
    weight = model[1].weight
    poison = {"update": 2}
    weights_before = []

    def compute_loss(m, x, y):
        weights_before.append(weight.detach().clone())  # at every micro-batch
        return torch.nn.functional.cross_entropy(m(x), y)

    # an inf gradient during update 2 (micro-batches 3 and 4), with a finite loss
    calls = [0]

    def grad_hook(g):
        calls[0] += 1
        return g * float("inf") if (calls[0] + 1) // 2 == poison["update"] else g

    weight.register_hook(grad_hook)
    # fused: GradScaler always calls step() and the skip happens on the device (counted there, no sync)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    assert getattr(optimizer, "_step_supports_amp_scaling", False) == fused
    state = TrainState()
    loop = TrainLoop(model=model, optimizer=optimizer, compute_loss=compute_loss, device=torch.device("cpu"),
                     scaler=torch.amp.GradScaler("cpu"), accum_steps=2, max_steps=3, log_every=100)
    loop.run_epoch(loaders.train, state, batch_size_per_gpu=8)
    assert state.step == 3 and state.skipped_steps == 1
    # micro-batches 1-2 are update 1, 3-4 update 2 (skipped), 5-6 update 3
    assert not torch.equal(weights_before[2], weights_before[0])  # update 1 moved the weights
    assert torch.equal(weights_before[4], weights_before[2])  # the skipped update 2 changed nothing


def test_rerunning_a_run_stopped_by_max_steps_trains_no_further(debug_config):
    first = train.main(debug_config("train.max_steps=3", name="ms"))
    again = train.main(debug_config("train.max_steps=3", name="ms"))
    assert first.state.step == again.state.step == 3
    assert train.main(debug_config("train.max_steps=5", name="ms")).state.step == 5  # raising it continues


def test_tensorboard_keeps_the_records_up_to_the_resumed_step(debug_config):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train.main(debug_config("train.max_steps=4", name="tb"))  # epoch 0 ends at update 4: validated there
    # TensorBoard reads a folder's event files in name order, events.out.tfevents.<second>.<host>.<pid>.<n>: two
    # writers of one process in one second are ordered by <n> as text (10 before 9, whichever pytest-xdist ran
    # before), so the resumed run's file starts in a later second, as any resume after a real stop does
    time.sleep(1.01 - time.time() % 1)
    cfg = debug_config(name="tb")
    train.main(cfg)
    events = EventAccumulator(os.path.join(cfg.out_dir, "tb")).Reload()
    assert [e.step for e in events.Scalars("val/top1")] == [4, 8]
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8]
    assert "step" not in events.Tags()["scalars"]  # the x axis of every scalar, not a scalar of its own
    assert [r["step"] for r in read_metrics(cfg.out_dir) if "val/top1" in r] == [4, 8]


@pytest.mark.parametrize("override, message", [
    ("cd.lam_per_role.fc3=0.1", r"^cd.lam_per_role.fc3: unknown role; the roles are qkv, proj, fc1, fc2, reduction"),
    ("cd.lam=0.1", "cd.budget: .*< 0"),  # wd 0.05 - lam 0.1 would be negative
    ("tweo.p=0.5", "'tweo.p' must be >= 1"),
    ("train.eval_every_epochs=0", "eval_every_epochs"),
])
def test_bad_regularizer_and_loop_settings_are_config_errors(debug_config, override, message):
    extra = (("cd.enabled=true",) if override.startswith("cd.")
             else ("tweo.enabled=true",) if "tweo" in override else ())
    with pytest.raises(ConfigError, match=message):
        train.main(debug_config(*extra, override))


def _nan_worker(rank, world, port, out_file):
    from data import build_loaders
    from dist_utils import init_gloo

    init_gloo(rank, world, port)
    cfg = load_config([DEBUG_CONFIG], ["data.mixup=0", "data.cutmix=0"])
    loaders = build_loaders(cfg.data, img_size=32, batch_size_per_gpu=8, eval_batch_size_per_gpu=8, rank=rank,
                            world_size=world, seed=0, num_classes=4)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Flatten(),
                                                                          torch.nn.Linear(3 * 32 * 32, 4)))
    calls = [0]

    def compute_loss(m, x, y):
        calls[0] += 1
        loss = torch.nn.functional.cross_entropy(m(x), y)
        return loss * float("nan") if rank == 1 and calls[0] == 3 else loss  # only rank 1 diverges

    saves = []
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     compute_loss=compute_loss, device=torch.device("cpu"), rank=rank, world_size=world,
                     log_every=100, ckpt_every=2, save=lambda: saves.append(1))
    try:
        loop.run_epoch(loaders.train, TrainState(), batch_size_per_gpu=8)
        outcome = "finished"
    except NonFiniteLossError:
        outcome = "stopped"
    with open(out_file.format(rank=rank), "w") as f:
        f.write(f"{outcome} {len(saves)}")
    leave_and_exit()


@pytest.mark.slow
def test_a_nan_on_one_rank_stops_every_rank_before_any_checkpoint(tmp_path):
    out = str(tmp_path / "rank{rank}.txt")
    spawn_ranks(_nan_worker, (2, free_port(), out), 2)
    # the NaN (update 3) is seen at the checkpoint check of update 4: no rank writes from NaN weights
    assert [open(out.format(rank=r)).read() for r in (0, 1)] == ["stopped 1", "stopped 1"]


@pytest.mark.slow  # two digits runs and a split one
def test_exact_resume_on_digits_with_augmentation_and_repeated_sampling(tmp_path):
    """The real data path: seeded transforms (RandAugment, random erasing), repeated augmentation,
    mixup/cutmix, the per-epoch schedule, resumed in the middle of an epoch."""
    common = [f"--config={DEMO_CONFIG}", "model.name=vit_nano", "data.repeated_aug=2",
              "data.auto_augment=rand-m9-mstd0.5-inc1", "data.reprob=0.25", "data.mixup=0.8",
              "data.cutmix=1.0", "train.batch_size=64", "train.batch_size_per_gpu=32", "sched.epochs=2",
              "sched.warmup_epochs=1", "train.log_every_steps=10", "log.tensorboard=false"]
    straight = train.parse_args([*common, f"out_dir={tmp_path / 'straight'}"])
    train.main(straight)
    first = train.main(train.parse_args([*common, f"out_dir={tmp_path / 'split'}", "train.max_steps=27"]))
    assert first.state.epoch == 1 and first.state.epoch_batches > 0  # stopped inside the second epoch
    train.main(train.parse_args([*common, f"out_dir={tmp_path / 'split'}"]))
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert a["state"] == b["state"]


@pytest.mark.slow
def test_job_logs_have_a_line_per_log_step_and_a_summary_off_a_terminal(tmp_path):
    import re

    run = subprocess.run([sys.executable, "train.py", "--config", DEBUG_CONFIG, f"out_dir={tmp_path}",
                          "log.tensorboard=false", "log.progress=true"],  # stdout is a pipe, not a TTY
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    pattern = re.compile(r"update (\d+)/8  epoch (\d)/2 (\d+)%  loss (\S+)  lr (\S+)  (\d+) img/s  "
                         r"data wait (\d+)%  peak mem (\S+) GiB  eta epoch (\d+:\d\d:\d\d) "
                         r"run (\d+:\d\d:\d\d)$")
    lines = [m for m in map(pattern.search, run.stdout.splitlines()) if m]
    records = [r for r in read_metrics(tmp_path) if "train/loss" in r]
    assert [int(m[1]) for m in lines] == [r["step"] for r in records] == [2, 4, 6, 8]
    assert [(int(m[2]), int(m[3])) for m in lines] == [(1, 50), (1, 100), (2, 50), (2, 100)]
    for m, r in zip(lines, records):
        assert float(m[4]) == pytest.approx(r["train/loss"], abs=1e-4)
        assert float(m[5]) == pytest.approx(r["train/lr"], rel=1e-2)
        assert 0 <= int(m[7]) <= 100 and float(m[8]) > 0
    with open(os.path.join(tmp_path, "train.log")) as f:
        log_file = f.read()
    assert all(m[0] in log_file for m in lines)
    validations = [r for r in read_metrics(tmp_path) if "val/top1" in r]
    best = max(validations, key=lambda r: r["val/top1"])  # the first of equals: best.pt keeps the first
    summary = run.stdout.strip().splitlines()[-1]
    assert re.search(rf"run summary: finished at update 8, epoch 2/2; best val top-1 "
                     rf"{best['val/top1']:.2f}% at epoch {best['step'] // 4} \(update {best['step']}\); "
                     rf"wall time \d+:\d\d:\d\d; "
                     rf"this job trained 128 images in \d+:\d\d:\d\d \(\d+ img/s\)", summary), summary
    assert summary.split(" INFO ")[1] in log_file


def test_snapshots_are_kept_and_train_resume_continues_from_one_exactly(debug_config, caplog):
    straight = debug_config("train.keep_every_epochs=1", name="straight")
    train.main(straight)
    snapshots = os.path.join(straight.out_dir, "snapshots")
    assert sorted(os.listdir(snapshots)) == ["epoch0001.pt", "epoch0002.pt"]
    first = os.path.join(snapshots, "epoch0001.pt")
    assert torch.load(first, weights_only=True)["state"]["step"] == 4  # not replaced by the later checkpoint
    # another folder, from the snapshot of epoch 1: the same weights as the run that went straight on
    cfg = debug_config(f"train.resume={first}", name="branch")
    assert train.main(cfg).state.step == 8
    a = torch.load(os.path.join(straight.out_dir, "checkpoint.pt"), weights_only=True)["model"]
    b = torch.load(os.path.join(cfg.out_dir, "checkpoint.pt"), weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the same command again (a requeued job): it continues its own checkpoint, not the snapshot
    caplog.clear()
    assert train.main(debug_config(f"train.resume={first}", name="branch")).state.step == 8
    assert f"resumed from {cfg.out_dir}/checkpoint.pt at epoch 2, update 8" in caplog.text
    # an explicit file that is not a training checkpoint is refused with the file named
    with pytest.raises(CheckpointError,
                       match=r"train.resume=.*best.pt \(\d+ bytes\) cannot be resumed: it holds weights"):
        train.main(debug_config(f"train.resume={straight.out_dir}/best.pt", name="other"))


def test_a_roll_back_to_a_snapshot_keeps_the_abandoned_checkpoint(debug_config):
    """A roll-back used to replace out_dir's checkpoint.pt (update 6, past the last snapshot) at its first
    checkpoint: the progress of the branch it left was lost. It is kept as checkpoint.until_step<N>.pt, and a
    requeue of the same command continues the new branch without keeping anything again."""
    def config(*extra):
        return debug_config("sched.epochs=3", "train.keep_every_epochs=1", *extra, name="r")

    first = config("train.max_steps=6")
    train.main(first)
    own = os.path.join(first.out_dir, "checkpoint.pt")
    abandoned = open(own, "rb").read()
    snapshot = os.path.join(first.out_dir, "snapshots", "epoch0001.pt")
    assert torch.load(own, weights_only=True)["state"]["step"] == 6
    assert train.main(config(f"train.resume={snapshot}", "train.max_steps=5")).state.step == 5
    kept = os.path.join(first.out_dir, "checkpoint.until_step4.pt")
    assert open(kept, "rb").read() == abandoned
    assert torch.load(own, weights_only=True)["state"]["step"] == 5
    assert train.main(config(f"train.resume={snapshot}")).state.step == 12  # the requeue: from update 5
    names = sorted(os.listdir(first.out_dir))
    assert [n for n in names if n.startswith("checkpoint")] == ["checkpoint.pt", "checkpoint.until_step4.pt"]
    assert open(kept, "rb").read() == abandoned


def test_train_resume_never_replaces_the_checkpoint_of_another_run_in_out_dir(debug_config):
    x = debug_config("train.seed=1", name="x")
    train.main(x)
    y = debug_config("train.max_steps=4", name="y")
    train.main(y)
    own = os.path.join(x.out_dir, "checkpoint.pt")
    before = open(own, "rb").read()
    with pytest.raises(CheckpointError, match=r"holds checkpoint.pt of a run that did not start from it .*give a "
                                              r"new out_dir"):
        train.main(debug_config(f"train.resume={y.out_dir}/checkpoint.pt", name="x"))
    assert open(own, "rb").read() == before


@pytest.mark.parametrize("damage, message", [
    ("no_data_section", r"its config has no 'data' section: not a train.py checkpoint"),
    ("no_head", r"its weights do not fit the model of its own config .*head.weight"),
])
def test_a_checkpoint_that_passes_the_format_check_but_is_broken_is_one_error(debug_config, tmp_path, damage,
                                                                                message):
    source = debug_config("train.max_steps=2", name="src")
    train.main(source)
    payload = torch.load(os.path.join(source.out_dir, "checkpoint.pt"), weights_only=True)
    if damage == "no_data_section":
        del payload["config"]["data"]
    else:
        payload["model"] = {k: v for k, v in payload["model"].items() if not k.startswith("head.")}
    broken = tmp_path / f"{damage}.pt"
    torch.save(payload, broken)
    with pytest.raises(CheckpointError, match=message):
        train.main(debug_config(f"train.resume={broken}", name="dst"))


def test_snapshots_every_more_epochs_than_the_run_ends_are_refused_before_training(debug_config):
    """The debug run has 2 epochs of 4 updates; with sched.steps=6 only its first epoch ends (the run stops 2
    updates into the second), so it keeps one snapshot every epoch and none every second epoch."""
    cfg = debug_config("sched.steps=6", "sched.warmup_steps=1", "train.keep_every_epochs=1", name="steps")
    train.main(cfg)
    assert os.listdir(os.path.join(cfg.out_dir, "snapshots")) == ["epoch0001.pt"]
    for overrides, ended, fix in ((["sched.steps=6", "sched.warmup_steps=1"], 1, "1 or fewer, or 0 for none"),
                                  (["sched.steps=3", "sched.warmup_steps=1"], 0, "0"),
                                  ([], 2, "2 or fewer, or 0 for none")):
        every = ended + 1
        cfg = debug_config(*overrides, f"train.keep_every_epochs={every}", name=f"refused{ended}")
        with pytest.raises(ConfigError, match=rf"^train.keep_every_epochs={every}: the run ends {ended} whole "
                                              rf"epoch\(s\) .*; set it to {re.escape(fix)}, or lengthen the run$"):
            train.main(cfg)
        assert not os.path.exists(os.path.join(cfg.out_dir, "checkpoint.pt"))


def test_the_snapshot_suggested_for_an_unusable_checkpoint_is_the_last_good_one_written(debug_config):
    cfg = debug_config("train.keep_every_epochs=1", name="s")  # 2 epochs: snapshots epoch0001.pt, epoch0002.pt
    train.main(cfg)
    snapshots, ckpt = os.path.join(cfg.out_dir, "snapshots"), os.path.join(cfg.out_dir, "checkpoint.pt")
    linked = os.path.samefile(os.path.join(snapshots, "epoch0002.pt"), ckpt)  # a hard link where there are any
    # an abandoned branch's later epoch, written long before (a roll-back to epoch 1 wrote epoch0002.pt since)
    shutil.copy(os.path.join(snapshots, "epoch0001.pt"), os.path.join(snapshots, "epoch0005.pt"))
    os.utime(os.path.join(snapshots, "epoch0005.pt"), (1, 1))
    with open(os.path.join(cfg.out_dir, "best.pt"), "rb") as f:
        best = f.read()
    with open(ckpt, "wb") as f:  # `cp best.pt checkpoint.pt`: into the file the newest snapshot shares
        f.write(best)
    expected = "epoch0001.pt" if linked else "epoch0002.pt"
    with pytest.raises(CheckpointError, match=rf"continue from the last good snapshot with: .*train.resume=\S*"
                                              rf"snapshots/{expected}"):
        train.main(debug_config("train.keep_every_epochs=1", name="s"))


@pytest.mark.slow
def test_a_corrupt_latest_checkpoint_is_one_error_line_with_the_command_that_continues(tmp_path, capsys,
                                                                                         caplog):
    """The first damage is refused by a real train.py process (its exit status and whole stderr); the others,
    the command the error names and the case without a snapshot run in this process (run_entry, train.main),
    where the command line each quotes is the same."""
    args = ["--config", DEBUG_CONFIG, f"out_dir={tmp_path}", "log.tensorboard=false", "train.keep_every_epochs=1",
            "train.max_steps=6"]
    assert train.main(train.parse_args(args)).state.step == 6
    ckpt = tmp_path / "checkpoint.pt"
    good = ckpt.read_bytes()
    damage = {"is empty (0 bytes": b"", "cannot be read": good[: len(good) // 2],
              "holds weights only (a best.pt": (tmp_path / "best.pt").read_bytes()}
    for in_process, (problem, content) in enumerate(damage.items()):
        ckpt.write_bytes(content)
        if in_process:
            code, _, err = run_entry("train.py", args, capsys)
        else:
            run = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                                 timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
            code, err = run.returncode, run.stderr
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 1 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
        assert errors[0].startswith(f"error: cannot resume from {ckpt} ({len(content)} bytes): it")
        assert problem in errors[0]
        snapshot = tmp_path / "snapshots" / "epoch0001.pt"
        assert errors[0].endswith(f"continue from the last good snapshot with: python train.py --config "
                                  f"{DEBUG_CONFIG} out_dir={tmp_path} log.tensorboard=false "
                                  f"train.keep_every_epochs=1 train.max_steps=6 train.resume={snapshot}"
                                  ), errors[0]
    # the command it names continues from the snapshot (update 4) to train.max_steps
    command = errors[0].split("with: python ", 1)[1].split(" ")
    assert command[0] == "train.py"
    with caplog.at_level("INFO"):
        assert train.main(train.parse_args(command[1:])).state.step == 6
    assert f"resumed from {snapshot} at epoch 1, update 4" in caplog.text
    assert torch.load(ckpt, weights_only=True)["state"]["step"] == 6
    shutil.rmtree(tmp_path / "snapshots")  # no snapshot: the error says how to start afresh instead
    ckpt.write_bytes(b"")
    code, _, err = run_entry("train.py", args, capsys)
    assert code == 1 and "there is no snapshot in" in err and "train.archive_existing=true" in err


def test_wandb_missing_is_a_config_error_before_any_folder(debug_config, monkeypatch):
    from configs import ConfigError

    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees where it is not installed
    cfg = debug_config("log.wandb=true")
    with pytest.raises(ConfigError, match="log.wandb=true but the wandb package is not installed"):
        train.main(cfg)
    assert not os.path.exists(cfg.out_dir)


def test_wandb_run_id_is_new_per_run_kept_on_resume_and_not_shared_with_an_archived_run(debug_config,
                                                                                        monkeypatch):
    import types

    inits = []
    fake = types.SimpleNamespace(init=lambda **kw: inits.append(kw) or types.SimpleNamespace(
        log=lambda *a, **k: None, finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = ("log.wandb=true", "log.tensorboard=false")
    train.main(debug_config(*run, "train.max_steps=2", name="w"))
    train.main(debug_config(*run, name="w"))  # resumed: the same wandb run
    os.remove(debug_config(name="w").out_dir + "/checkpoint.pt")  # the next run archives the folder
    train.main(debug_config(*run, "train.archive_existing=true", name="w"))  # a new run, a new wandb run
    ids = [kw["id"] for kw in inits]
    assert ids[0] == ids[1] != ids[2] and all(ids)
    saved = torch.load(debug_config(name="w").out_dir + "/checkpoint.pt", weights_only=True)
    assert saved["wandb_id"] == ids[2]


def test_the_epoch_eta_ends_with_the_run_when_the_run_ends_inside_the_epoch():
    """A language model's sched.steps=12 inside an epoch of 7,272 updates: 'eta epoch' counted the 7,260
    updates the run never trains (3 minutes, beside 'run 0:00:00')."""
    from engine.metrics import progress_line

    metrics = {"train/epoch": 24 / 14544, "train/img_per_s": 16.0, "train/loss": 4.0, "train/lr": 1e-3,
               "train/data_wait": 0.1, "train/peak_mem_mib": 700.0}  # one update per second
    line = progress_line(2, metrics, total_steps=12, epochs=1, updates_per_epoch=7272, batch_size=16)
    assert "eta epoch 0:00:10 run 0:00:10" in line, line
    metrics["train/epoch"] = 0.5  # the run goes past this epoch: its own end counts
    line = progress_line(2, metrics, total_steps=12, epochs=3, updates_per_epoch=4, batch_size=16)
    assert "eta epoch 0:00:02 run 0:00:10" in line, line


def test_progress_line_names_the_epoch_and_its_share_and_duration_counts_hours_and_days():
    from engine.metrics import duration, progress_line

    assert duration(59.6) == "0:01:00" and duration(3725) == "1:02:05"
    assert duration(2 * 86400 + 3 * 3600 + 4 * 60 + 5) == "2d 3:04:05"
    metrics = {"train/img_per_s": 16.0, "train/loss": 4.0, "train/lr": 1e-3, "train/data_wait": 0.1,
               "train/peak_mem_mib": 700.0}
    for epoch, shown in ((2.45, "epoch 3/5 45%"), (2.0, "epoch 2/5 100%"), (0.0, "epoch 1/5 0%")):
        line = progress_line(2, dict(metrics, **{"train/epoch": epoch}), total_steps=100, epochs=5,
                             updates_per_epoch=20, batch_size=16)
        assert f"update 2/100  {shown}  loss 4.0000" in line, line
    # peak memory in GiB of 1024 MiB (10,240 MiB is 10.0 GiB; a division by 1000 would show 10.2)
    line = progress_line(2, dict(metrics, **{"train/epoch": 0.5, "train/peak_mem_mib": 10240.0}), total_steps=100,
                         epochs=5, updates_per_epoch=20, batch_size=16)
    assert "peak mem 10.0 GiB" in line, line


def test_progress_line_etas_count_the_updates_left_and_never_go_below_zero():
    """At 1 s an update (16 img/s, batches of 16): 'eta epoch' is the epoch's updates left, rounded (2.7
    epochs of 10 updates: 3 left, where (3 - 2.7) * 10 is 2.99999... in floats), 'run' the run's; a log step
    past the planned end shows no time left, not a negative duration; a window of 0 img/s still gives a
    line; a language model shows tokens per second. By hand."""
    from engine.metrics import progress_line

    metrics = {"train/img_per_s": 16.0, "train/loss": 4.0, "train/lr": 1e-3, "train/data_wait": 0.1,
               "train/peak_mem_mib": 700.0, "train/epoch": 2.7}
    plan = dict(total_steps=50, epochs=5, updates_per_epoch=10, batch_size=16)
    line = progress_line(27, metrics, **plan)
    assert "eta epoch 0:00:03 run 0:00:23" in line, line
    line = progress_line(52, dict(metrics, **{"train/epoch": 5.2}), **plan)
    assert line.endswith("eta epoch 0:00:00 run 0:00:00"), line
    line = progress_line(27, dict(metrics, **{"train/img_per_s": 0.0}), **plan)
    assert "  0 img/s  " in line, line
    line = progress_line(27, dict(metrics, **{"train/tok_per_s": 2048.0}), **plan)
    assert "  2048 tok/s  " in line and "img/s" not in line, line


def test_a_run_stopped_at_max_steps_is_not_said_to_have_failed_to_learn(debug_config, caplog, monkeypatch):
    """After train.max_steps=1 (inside the warmup) the summary said 'the run did not learn; check the learning
    rate': the warning is for finished runs."""
    with caplog.at_level("WARNING"):
        result = train.main(debug_config("train.max_steps=1"))
    assert result.reason == "max_steps" and "is at chance level" not in caplog.text
    told = []
    monkeypatch.setattr(train, "warn_if_at_chance", lambda *args: told.append(args))
    result = train.main(debug_config())  # the same run, finished: the finished run's score is judged
    assert result.reason == "finished" and told == [(result.metrics["val/top1"], 4, "synthetic")], told


def test_the_synthetic_smoke_test_is_not_said_to_have_failed_to_learn(debug_config, caplog):
    """Its val images are noise unrelated to their labels (data/synthetic.py), so any model scores at chance
    there: 'the run did not learn; check the learning rate' sent its users hunting for a fault that is not one."""
    with caplog.at_level("WARNING"):
        result = train.main(debug_config())
    assert result.reason == "finished" and "is at chance level" not in caplog.text


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_classification_loss_is_label_smoothed_cross_entropy(smoothing):
    """data.label_smoothing=eps (DeiT's 0.1): (1 - eps) * -log p_y + eps * mean_c(-log p_c), written out."""
    from engine.tasks import ClassificationTask

    torch.manual_seed(0)
    logits, y = torch.randn(4, 5, dtype=torch.float64), torch.tensor([0, 3, 1, 4])
    logp = torch.log_softmax(logits, -1)
    want = sum((1 - smoothing) * -logp[i, y[i]] - smoothing * logp[i].mean() for i in range(4)) / 4
    got = ClassificationTask.criterion(smoothing, mixup=False)(logits, y)
    assert float(got) == pytest.approx(float(want), rel=1e-12)


class _FixedOrder:
    """A sampler stand-in: the batches of the test's list, in order, every epoch."""

    def set_epoch(self, epoch, start=0):
        self.epoch, self.start = epoch, start


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "gradscaler"])
def test_the_loop_matches_a_naive_accumulation_clipping_schedule_and_ema_loop(scaled):
    """TrainLoop against plain SGD written out: an update sums the gradients of loss / accum over its micro-
    batches, clips their global norm to clip * norm / max(norm, clip) (clip_grad_norm_'s rule), steps with the lr
    the per-step schedule set for it, then updates the EMA with the new weights and the update count; the tail
    micro-batch that fills no update is not trained on. The logged train/loss is the mean of the window's micro-
    batch losses, train/grad_norm the last update's norm before clipping, train/epoch the share of the epoch; a
    checkpoint is written every ckpt_every updates. With a GradScaler (scale 2^16, no overflow) the gradients
    are unscaled before clipping: the same updates."""
    torch.manual_seed(0)
    accum, clip, base_lr, micro_batches = 2, 0.3, 0.5, 7  # 3 updates; the 7th micro-batch is a tail
    batches = [(torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))) for _ in range(micro_batches)]
    model = torch.nn.Linear(3, 2).double()
    w0 = [p.detach().clone() for p in model.parameters()]
    lr_of = lambda update: base_lr / (1 + update)  # noqa: E731 - the schedule, per update count

    class Schedule:
        def step_update(self, update):
            for group in optimizer.param_groups:
                group["lr"] = lr_of(update)

    class RecordEma:
        def __init__(self):
            self.calls = []

        def update(self, m, step):
            self.calls.append((step, [p.detach().clone() for p in m.parameters()]))

    optimizer = torch.optim.SGD(model.parameters(), lr=123.0)  # the schedule sets the lr before the first update
    ema, logged, saved_at, state = RecordEma(), [], [], TrainState()
    loop = TrainLoop(model=model, optimizer=optimizer, compute_loss=lambda m, x, y: F_ce(m(x), y),
                     device=torch.device("cpu"), scaler=torch.amp.GradScaler("cpu") if scaled else None,
                     scheduler=Schedule(), per_step_schedule=True, accum_steps=accum,
                     clip_grad=clip, ema=ema, log_every=2, log=lambda step, metrics: logged.append((step, metrics)),
                     ckpt_every=2, save=lambda: saved_at.append(state.step))
    from engine.loop import TrainBatches

    reason = loop.run_epoch(TrainBatches(batches, _FixedOrder()), state, batch_size_per_gpu=4)
    assert reason == "epoch_end" and (state.step, state.epoch, state.epoch_batches) == (3, 1, 0)
    assert saved_at == [2]  # every ckpt_every updates (the caller saves at the epoch's end)

    # the reference: plain SGD over the same micro-batches, by autograd on a fresh copy of the start weights
    weights, losses, norms, after = [w.clone() for w in w0], [], [], []
    for update in range(micro_batches // accum):
        grads = [torch.zeros_like(w) for w in weights]
        for x, y in batches[update * accum:(update + 1) * accum]:
            leaves = [w.clone().requires_grad_() for w in weights]
            loss = F_ce(x @ leaves[0].T + leaves[1], y)
            losses.append(float(loss.detach()))
            for g, d in zip(grads, torch.autograd.grad(loss / accum, leaves)):
                g += d
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        norms.append(float(norm))
        scale = min(1.0, clip / (float(norm) + 1e-6))
        weights = [w - lr_of(update) * scale * g for w, g in zip(weights, grads)]
        after.append(weights)
    for got, want in zip(model.parameters(), weights):
        torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=1e-12)
    assert [step for step, _ in ema.calls] == [1, 2, 3]
    for (_, got), want in zip(ema.calls, after):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert [step for step, _ in logged] == [2, 3]  # a log step, then the epoch's last window
    (_, first), (_, last) = logged
    # the window sums its losses in float64 (this model's float64 losses, from another computation than the loop's)
    assert first["train/loss"] == pytest.approx(sum(losses[:4]) / 4, rel=1e-12)
    assert last["train/loss"] == pytest.approx(sum(losses[4:]) / 2, rel=1e-12)
    assert first["train/grad_norm"] == pytest.approx(norms[1], rel=1e-9)
    assert last["train/grad_norm"] == pytest.approx(norms[2], rel=1e-9)
    assert first["train/epoch"] == pytest.approx(4 / 6) and last["train/epoch"] == pytest.approx(1.0)
    assert first["train/img_per_s"] > 0 and first["train/skipped_steps"] == 0


def F_ce(logits, y):
    return torch.nn.functional.cross_entropy(logits, y)


def test_evaluate_scores_as_a_naive_per_image_loop():
    """engine.loop.evaluate against a loop over single images: an image is a top-k hit when fewer than k classes
    have a larger logit than its label's; the loss is the mean of -log softmax at the label over the images
    scored; an unreadable sample (target -1 - index) is in no count but `excluded`."""
    from engine.loop import evaluate

    torch.manual_seed(1)
    model = torch.nn.Linear(5, 8).double()
    batches = [(torch.randn(n, 5, dtype=torch.float64), torch.randint(0, 8, (n,))) for n in (16, 9, 15)]
    batches[1][1][0] = -1 - 17  # sample 17 could not be read
    top1 = top5 = loss = count = 0
    ranks = set()
    for images, targets in batches:
        for x, y in zip(images, targets.tolist()):
            if y < 0:
                continue
            logits = model(x).detach()
            above = int((logits > logits[y]).sum())
            ranks.add(above)
            top1, top5, count = top1 + (above < 1), top5 + (above < 5), count + 1
            loss -= float(torch.log_softmax(logits, 0)[y])
    got = evaluate(model, batches, torch.device("cpu"))
    assert {0, 4, 5} <= ranks and count == 39  # labels at the top, the 5th and the 6th logit
    assert (got["count"], got["excluded"]) == (39, 1)
    assert got["top1"] == pytest.approx(100 * top1 / count) and got["top5"] == pytest.approx(100 * top5 / count)
    assert got["loss"] == pytest.approx(loss / count, rel=1e-6)  # logits are scored in float32



@pytest.mark.parametrize("classes", [2, 5])
def test_evaluate_reports_no_top5_of_five_classes_or_fewer(classes):
    """With 5 classes (or fewer) every label is among the 5 best, also one with the smallest logit: a top-5 of
    100 % whatever the model was reported, printed and logged. It is left out (the run's last line too); top-1 as the
    naive count."""
    from engine.loop import evaluate
    from engine.tasks import ClassificationTask

    torch.manual_seed(3)
    model = torch.nn.Linear(4, classes).double()
    images, targets = torch.randn(30, 4, dtype=torch.float64), torch.randint(0, classes, (30,))
    logits = model(images).detach()
    above = (logits > logits.gather(1, targets[:, None])).sum(1)
    assert int(above.max()) == classes - 1  # some label has the smallest logit
    got = evaluate(model, [(images, targets)], torch.device("cpu"))
    assert "top5" not in got and got["top1"] == pytest.approx(100 * int((above == 0).sum()) / 30)
    val = {f"val/{k}": v for k, v in got.items()}
    assert ClassificationTask.describe(val) == f"val top-1 {got['top1']:.2f}% on 30 images"


def test_a_bf16_evaluation_scores_its_logits_in_float():
    """Under bf16 autocast the logits are bf16; the loss is the NLL of those logits computed in float (a bf16 sum
    keeps 8 bits), against the same logits' NLL in float64 written as a loop."""
    from engine.loop import evaluate

    torch.manual_seed(4)
    model = torch.nn.Linear(6, 10)
    batches = [(torch.randn(n, 6), torch.randint(0, 10, (n,))) for n in (16, 16, 8)]
    nll = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for x, y in batches:
            logits = model(x)
            assert logits.dtype == torch.bfloat16  # what the test is about: bf16 logits
            logp = torch.log_softmax(logits.double(), -1)
            nll += sum(-logp[i, y[i]].item() for i in range(len(y)))
    got = evaluate(model, batches, torch.device("cpu"), amp="bf16")
    assert got["count"] == 40 and got["loss"] == pytest.approx(nll / 40, rel=1e-6)

def test_the_loop_trains_in_training_mode_and_evaluate_scores_in_eval_mode():
    """Dropout and drop path act in training only: run_epoch puts the model in training mode, also after a
    validation left it in eval mode, and evaluate puts it in eval mode, also when called mid-training. Checked by
    the mode each forward saw, and by evaluate's loss against the dropout-free logits computed by hand."""
    from engine.loop import TrainBatches, evaluate

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.dropout, self.modes = torch.nn.Linear(3, 2), torch.nn.Dropout(0.9), []

        def forward(self, x):
            self.modes.append(self.training)
            return self.linear(self.dropout(x))

    torch.manual_seed(0)
    model = Recorder()
    batches = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(2)]
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     compute_loss=lambda m, x, y: F_ce(m(x), y), device=torch.device("cpu"), log_every=100)
    model.eval()  # as a validation leaves it
    loop.run_epoch(TrainBatches(batches, _FixedOrder()), TrainState(), batch_size_per_gpu=4)
    assert model.modes == [True, True]
    model.train()  # as the loop leaves it
    got = evaluate(model, batches, torch.device("cpu"))
    assert model.modes[2:] == [False, False]
    with torch.no_grad():
        want = sum(F_ce(model.linear(x), y) * len(y) for x, y in batches) / 8
    assert got["loss"] == pytest.approx(float(want), rel=1e-6)


def test_an_epoch_schedule_sets_the_lr_of_each_epoch_before_its_updates():
    """sched.per_step=false: the updates of epoch e take the schedule's lr at epoch e (timm's step(e)), checked
    against plain SGD written out over two epochs."""
    from engine.loop import TrainBatches

    torch.manual_seed(0)
    batches = [(torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))) for _ in range(2)]
    model = torch.nn.Linear(3, 2).double()
    weights = [p.detach().clone() for p in model.parameters()]
    lr_of_epoch = {0: 0.5, 1: 0.05}

    class Schedule:
        def step(self, epoch):
            for group in optimizer.param_groups:
                group["lr"] = lr_of_epoch[epoch]

    optimizer = torch.optim.SGD(model.parameters(), lr=123.0)
    loop = TrainLoop(model=model, optimizer=optimizer, compute_loss=lambda m, x, y: F_ce(m(x), y),
                     device=torch.device("cpu"), scheduler=Schedule(), log_every=100)
    state = TrainState()
    for epoch in (0, 1):
        loop.run_epoch(TrainBatches(batches, _FixedOrder()), state, batch_size_per_gpu=4)
        for x, y in batches:
            leaves = [w.clone().requires_grad_() for w in weights]
            grads = torch.autograd.grad(F_ce(x @ leaves[0].T + leaves[1], y), leaves)
            weights = [w - lr_of_epoch[epoch] * g for w, g in zip(weights, grads)]
    assert state.epoch == 2
    for got, want in zip(model.parameters(), weights):
        torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=1e-12)


def test_each_rank_draws_its_own_randomness_at_each_update_and_the_same_again_on_resume():
    """Mixup, drop path and dropout draw from the main process's RNG, reseeded at every update from (seed, rank,
    update): two ranks must not draw the same numbers (every rank would mix its batch with the same lambda and
    drop the same paths), two updates neither, and the same (seed, rank, update) again draws the same."""
    from engine.loop import TrainBatches

    def draws(rank, start_step=0):
        seen = []
        model = torch.nn.Linear(3, 2)

        def compute_loss(m, x, y):
            seen.append(float(torch.rand(())))
            return F_ce(m(x), y)

        loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         compute_loss=compute_loss, device=torch.device("cpu"), seed=7, rank=rank, world_size=2,
                         log_every=100)
        batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(3)]
        loop.run_epoch(TrainBatches(batches, _FixedOrder()), TrainState(step=start_step), batch_size_per_gpu=2)
        return seen

    rank0, rank1 = draws(0), draws(1)
    assert len(set(rank0 + rank1)) == 6  # no draw shared between ranks or updates
    assert draws(1, start_step=1)[:2] == rank1[1:]  # updates 2 and 3 of a run resumed after update 1


def _six_batches_and_first_update_loss():
    """Six micro-batches of 4, a Linear(3, 2), and the reference: the mean loss of update 1's two micro-batches
    (accum_steps 2) at the start weights."""
    torch.manual_seed(0)
    batches = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(6)]
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        first = float(sum(F_ce(model(x), y) for x, y in batches[:2]) / 2)
    return batches, model, first


def test_a_checkpoint_written_before_the_first_log_step_carries_the_divergence_reference():
    """train.ckpt_every_steps below train.log_every_steps: checkpoint.pt held no initial loss, so a run resumed
    from it took the loss of its own first update as the divergence guard's reference (and its state was no
    longer the uninterrupted run's). Every checkpoint holds the first update's mean loss over its micro-batches."""
    from engine.loop import TrainBatches

    batches, model, first = _six_batches_and_first_update_loss()
    state, saved = TrainState(), []
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     compute_loss=lambda m, x, y: F_ce(m(x), y), device=torch.device("cpu"), accum_steps=2,
                     log_every=100, ckpt_every=1, save=lambda: saved.append((state.step, state.initial_loss)))
    loop.run_epoch(TrainBatches(batches, _FixedOrder()), state, batch_size_per_gpu=4)
    assert [step for step, _ in saved] == [1, 2, 3]
    assert all(loss == pytest.approx(first, rel=1e-6) for _, loss in saved), saved


def test_a_stop_request_before_the_first_log_step_writes_the_divergence_reference():
    """A stop request at update 1, before the first log step (the window it cuts is not logged): the checkpoint
    train.py then writes (`TrainLoop.checkpoint`) held no initial loss, so the resumed run's guard measured against
    the loss of its own first update. It holds the first update's mean loss over its micro-batches."""
    from engine.loop import TrainBatches

    batches, model, first = _six_batches_and_first_update_loss()
    state, saved = TrainState(), []
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     compute_loss=lambda m, x, y: F_ce(m(x), y), device=torch.device("cpu"), accum_steps=2,
                     log_every=100, should_stop=lambda step: True, save=lambda: saved.append(state.initial_loss))
    assert loop.run_epoch(TrainBatches(batches, _FixedOrder()), state, batch_size_per_gpu=4) == "preempted"
    assert loop.checkpoint(state) and saved == [pytest.approx(first, rel=1e-6)]


def _reference_worker(rank, world, port, out_file):
    from dist_utils import init_gloo
    from engine.loop import TrainBatches

    init_gloo(rank, world, port)
    model = torch.nn.Linear(3, 2)
    # a loss of (rank + 1) * (micro-batch + 1) on rank `rank`: update 1's mean over ranks and micro-batches is 2.25
    losses = iter(float((rank + 1) * (m + 1)) for m in range(4))
    state = TrainState()
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                     compute_loss=lambda m, x, y: m(x).sum() * 0 + next(losses), device=torch.device("cpu"),
                     rank=rank, world_size=world, accum_steps=2, log_every=1)
    loop.run_epoch(TrainBatches([(torch.randn(2, 3), torch.zeros(2))] * 4, _FixedOrder()), state,
                   batch_size_per_gpu=2)
    with open(out_file.format(rank=rank), "w") as f:
        f.write(repr(state.initial_loss))
    leave_and_exit()


@pytest.mark.slow
def test_the_divergence_reference_is_the_mean_over_ranks_of_the_first_update(tmp_path):
    out = str(tmp_path / "rank{rank}.txt")
    spawn_ranks(_reference_worker, (2, free_port(), out), 2)
    # rank 0: (1 + 2) / 2, rank 1: (2 + 4) / 2; their mean
    assert [float(open(out.format(rank=r)).read()) for r in (0, 1)] == [2.25, 2.25]


def _reductions_worker(rank, world, port, out_file):
    from dist_utils import init_gloo
    from engine.distributed import all_reduce, raise_on_every_rank

    init_gloo(rank, world, port)
    values = [all_reduce(torch.tensor([rank + 1.0, -3.0 * rank])).tolist(),
              all_reduce(torch.tensor([rank + 1.0, -3.0 * rank]), op="max").tolist()]
    try:  # only rank 1 failed: every rank raises, rank 1 its own error
        raise_on_every_rank(OSError("disk full") if rank == 1 else None, torch.device("cpu"),
                            lambda: RuntimeError("elsewhere"))
        values.append("no error")
    except (OSError, RuntimeError) as e:
        values.append(str(e))
    with open(out_file.format(rank=rank), "w") as f:
        f.write(repr(values))
    leave_and_exit()


def test_the_rank_is_torchruns_global_rank_and_the_device_index_its_local_rank(monkeypatch):
    """On the second node of two with two processes each, torchrun gives RANK=3, LOCAL_RANK=1, WORLD_SIZE=4:
    the process joins as rank 3 of 4 (a rank read from LOCAL_RANK would collide with node 0's rank 1). By
    hand."""
    import torch.distributed as dist

    from engine.distributed import DistInfo, init_distributed

    from engine import distributed

    joined, met = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.append((backend, kw)))
    # the rendezvous and the ranks' comparison of devices before the group forms (node0 is no host here)
    monkeypatch.setattr(distributed, "_meet", lambda *args: met.append(args) or dist.HashStore())
    for name, value in (("RANK", "3"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "node0"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    assert init_distributed("cpu") == DistInfo(3, 4, 1, torch.device("cpu"))
    timeout = dist.constants.default_pg_timeout  # torch's own for gloo
    assert met == [(3, 4, timeout, "cpu", "cpu")]
    [(backend, kw)] = joined
    assert (backend, isinstance(kw.pop("store"), dist.PrefixStore)) == ("gloo", True)
    assert kw == {"rank": 3, "world_size": 4, "device_id": None, "timeout": timeout}


def test_a_reduction_other_than_sum_or_max_is_refused_even_in_one_process():
    """Any op but "sum" was a MAX: an all_reduce(..., op="min") would be right in one process and wrong on a
    cluster; it is refused wherever it runs."""
    from engine.distributed import all_reduce

    assert all_reduce(torch.ones(2), op="max").tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"all_reduce op must be one of \['max', 'sum'\], got 'min'"):
        all_reduce(torch.ones(2), op="min")


@pytest.mark.slow
def test_the_reductions_sum_and_take_the_maximum_over_ranks(tmp_path):
    out = str(tmp_path / "rank{rank}.txt")
    spawn_ranks(_reductions_worker, (2, free_port(), out), 2)
    got = [eval(open(out.format(rank=r)).read()) for r in (0, 1)]  # noqa: S307 - the workers' own repr
    assert got == [[[3.0, -3.0], [2.0, 0.0], "elsewhere"], [[3.0, -3.0], [2.0, 0.0], "disk full"]]


def _training_checkpoint(path, value):
    """The smallest file read_training_checkpoint accepts, its weight `value` (nan: one it refuses)."""
    torch.save({"model": {"w": torch.tensor([value])}, "optimizer": {}, "state": {"step": 1},
                "config": {s: {} for s in ("model", "data", "optim", "sched", "train")}}, path)


@pytest.mark.parametrize("links", [True, False])
def test_snapshots_of_one_epoch_are_all_kept_with_or_without_hard_links(tmp_path, monkeypatch, links):
    """Roll-backs that pass one epoch three times keep three snapshots: epoch0002.pt, -1, -2, each the
    checkpoint of its time, where the file system makes hard links and where it only copies."""
    from engine import snapshots

    if not links:
        def no_links(source, target):
            raise OSError(1, "Operation not permitted")
        monkeypatch.setattr(snapshots.os, "link", no_links)
    checkpoint = tmp_path / "checkpoint.pt"
    kept = []
    for value in (1.0, 2.0, 3.0):
        _training_checkpoint(tmp_path / "new.pt", value)
        os.replace(tmp_path / "new.pt", checkpoint)  # as train.py writes checkpoint.pt: a new file, renamed
        kept.append(snapshots.keep_snapshot(str(checkpoint), 2, True, torch.device("cpu")))
    assert [os.path.basename(p) for p in kept] == ["epoch0002.pt", "epoch0002-1.pt", "epoch0002-2.pt"]
    assert sorted(os.listdir(tmp_path / "snapshots")) == ["epoch0002-1.pt", "epoch0002-2.pt", "epoch0002.pt"]
    assert [torch.load(p, weights_only=True)["model"]["w"].item() for p in kept] == [1.0, 2.0, 3.0]


def test_a_snapshot_copy_that_fails_midway_leaves_no_partial_snapshot(tmp_path, monkeypatch):
    """Without hard links a snapshot is a copy: one cut short (a full disk) must leave no file under the snapshot's
    name, since a later roll-back takes the newest readable snapshot and a truncated one would be a trap."""
    from engine import snapshots

    def no_links(source, target):
        raise OSError(1, "Operation not permitted")

    def full_disk(source, target):  # half the bytes reach the disk, then ENOSPC
        data = open(source, "rb").read()
        with open(target, "wb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshots.os, "link", no_links)
    monkeypatch.setattr(shutil, "copyfile", full_disk)
    checkpoint = tmp_path / "checkpoint.pt"
    _training_checkpoint(checkpoint, 1.0)
    with pytest.raises(snapshots.CheckpointError, match="No space left on device"):
        snapshots.keep_snapshot(str(checkpoint), 2, True, torch.device("cpu"))
    assert os.listdir(tmp_path / "snapshots") == []
    assert torch.load(checkpoint, weights_only=True)["model"]["w"].item() == 1.0


def test_the_last_good_snapshot_is_the_newest_readable_one_that_is_not_the_broken_file(tmp_path):
    """Newest by modification time (the epoch only breaks ties), skipping files that cannot be resumed and the
    broken checkpoint.pt itself (a hard link of the newest snapshot)."""
    from engine.snapshots import last_good_snapshot

    folder = tmp_path / "snapshots"
    folder.mkdir()
    written = {"epoch0005.pt": 100, "epoch0002.pt": 300, "epoch0003.pt": 300, "epoch0004.pt": 400,
               "epoch0006.pt": 500}
    for name, mtime in written.items():
        _training_checkpoint(folder / name, float("nan") if name == "epoch0004.pt" else 1.0)
        os.utime(folder / name, (mtime, mtime))
    broken = tmp_path / "checkpoint.pt"
    os.link(folder / "epoch0006.pt", broken)
    # 0006: the broken file itself; 0004: NaN weights; 0003 and 0002 written at one time: the later epoch
    assert os.path.basename(last_good_snapshot(str(tmp_path), str(broken))) == "epoch0003.pt"
    os.remove(folder / "epoch0003.pt")
    assert os.path.basename(last_good_snapshot(str(tmp_path), str(broken))) == "epoch0002.pt"
    for name in ("epoch0002.pt", "epoch0005.pt"):
        os.remove(folder / name)
    assert last_good_snapshot(str(tmp_path), str(broken)) is None


def test_the_command_that_continues_from_a_snapshot_replaces_an_earlier_train_resume(monkeypatch):
    """The way on from an unusable checkpoint is the user's own command with one train.resume=, the
    snapshot's, in place of the one the command gave (by hand: argv without it, then the new one)."""
    from engine.snapshots import rerun_command

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py", "train.resume=old.pt", "optim.lr=0.1"])
    assert rerun_command("runs/a/snapshots/epoch0002.pt") == (
        "python train.py optim.lr=0.1 train.resume=runs/a/snapshots/epoch0002.pt")
    monkeypatch.setattr(sys, "argv", ["-c"])  # not train.py (a script calling train.main)
    assert rerun_command("s.pt") == "your train.py command with train.resume=s.pt"

def test_a_requeued_train_resume_given_as_a_relative_path_continues_from_the_progress_made_since(tmp_path,
                                                                                                 monkeypatch):
    """train.resume=PATH repeated by a requeued job: out_dir's checkpoint.pt, which records the absolute path
    of the file its run started from, wins over PATH also when PATH was given relative to the working folder."""
    from engine.snapshots import resume_source

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    _training_checkpoint(tmp_path / "start.pt", 1.0)
    own = tmp_path / "run" / "checkpoint.pt"
    _training_checkpoint(own, 2.0)
    payload = torch.load(own, weights_only=True)
    torch.save({**payload, "resumed_from": str(tmp_path / "start.pt")}, own)
    path, payload = resume_source(str(tmp_path / "run"), "start.pt")
    assert path == str(own) and payload["model"]["w"].item() == 2.0


def test_ema_follows_train_ema_decay_and_val_ema_scores_the_averaged_weights(debug_config):
    """train.ema_decay=0 makes the average the weights themselves (ema = d * ema + (1 - d) * w); at 0.5 it lags
    them, and val_ema/* is the score of the averaged weights (a naive loop over the val images with the
    checkpoint's model_ema), not of the raw ones."""
    from data import build_eval_loader
    from models import build_model

    def last_validation(cfg):
        return [r for r in read_metrics(cfg.out_dir) if "val_ema/loss" in r][-1]

    common = ("train.ema=true", "train.max_steps=2", "optim.lr=0.01", "sched.warmup_epochs=0",
              "log.tensorboard=false")
    same = debug_config(*common, "train.ema_decay=0", name="same")
    train.main(same)
    ckpt = torch.load(os.path.join(same.out_dir, "checkpoint.pt"), weights_only=True)
    for key, value in ckpt["model"].items():
        assert torch.equal(ckpt["model_ema"][key], value), key
    record = last_validation(same)
    assert record["val_ema/loss"] == pytest.approx(record["val/loss"], rel=1e-6)

    lagging = debug_config(*common, "train.ema_decay=0.5", name="lagging")
    train.main(lagging)
    ckpt = torch.load(os.path.join(lagging.out_dir, "checkpoint.pt"), weights_only=True)
    model = build_model(lagging.model).eval()
    model.load_state_dict(ckpt["model_ema"])
    loader = build_eval_loader(lagging.data, img_size=32, batch_size_per_gpu=16, rank=0, world_size=1, num_classes=4)
    losses = []
    with torch.no_grad():
        for images, targets in loader:
            losses += (-torch.log_softmax(model(images).float(), 1).gather(1, targets[:, None])).flatten().tolist()
    record = last_validation(lagging)
    assert record["val_ema/loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert abs(record["val_ema/loss"] - record["val/loss"]) > 1e-3  # the averaged weights are other weights


def test_train_seed_orders_the_training_data():
    """train.seed seeds the data order as well as the weights: seeds of a sweep see their images in other
    orders, and one seed sees them in the same order again."""
    from engine.distributed import DistInfo
    from engine.tasks import task_for
    from models import build_model

    def first_batches(seed):
        cfg = load_config([DEBUG_CONFIG], [f"train.seed={seed}", "data.mixup=0", "data.cutmix=0"])
        model = build_model(cfg.model)
        dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
        loaders = train.build_data(cfg, model, dist, task_for(cfg.data.dataset))
        return torch.cat([targets for _, targets in loaders.train.loader])

    assert torch.equal(first_batches(1), first_batches(1))
    assert not torch.equal(first_batches(0), first_batches(1))


def _tiny_loop(**settings):
    model = torch.nn.Linear(3, 2)
    return TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     compute_loss=lambda m, x, y: F_ce(m(x), y), device=torch.device("cpu"), **settings)


def test_eval_every_and_max_steps_stop_the_epoch_at_the_documented_updates():
    """eval_every=2 over an epoch of 5 updates: run_epoch stops for a validation after updates 2 and 4 and ends
    the epoch after update 5. max_steps inside the epoch stops there ('max_steps', the epoch unfinished); on the
    epoch's last update it is an epoch end (the epoch advanced, validated by the caller as any epoch end)."""
    from engine.loop import TrainBatches

    torch.manual_seed(0)
    batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(5)]
    loop, state, stops = _tiny_loop(eval_every=2, log_every=100), TrainState(), []
    while state.epoch == 0 and len(stops) < 5:  # a resumed call reads the rest of the epoch, as the sampler skips
        reason = loop.run_epoch(TrainBatches(batches[state.epoch_batches:], _FixedOrder()), state, 2)
        stops.append((reason, state.step))
    assert stops == [("validate", 2), ("validate", 4), ("epoch_end", 5)]
    for max_steps, want in [(3, ("max_steps", 3, 0, 3)), (5, ("epoch_end", 5, 1, 0))]:
        state = TrainState()
        reason = _tiny_loop(max_steps=max_steps, log_every=100).run_epoch(TrainBatches(batches, _FixedOrder()),
                                                                          state, 2)
        assert (reason, state.step, state.epoch, state.epoch_batches) == want


def test_train_lr_is_the_largest_lr_of_the_groups():
    """train/lr is the peak lr (the top layer's under layer-wise lr decay), not that of another group."""
    from engine.loop import TrainBatches

    torch.manual_seed(0)
    first, second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
    model = torch.nn.Sequential(first, second)
    optimizer = torch.optim.SGD([{"params": second.parameters(), "lr": 0.01},
                                 {"params": first.parameters(), "lr": 0.04},
                                 {"params": [], "lr": 0.02}])
    logged = []
    loop = TrainLoop(model=model, optimizer=optimizer, compute_loss=lambda m, x, y: F_ce(m(x), y),
                     device=torch.device("cpu"), log_every=1, log=lambda step, metrics: logged.append(metrics))
    loop.run_epoch(TrainBatches([(torch.randn(2, 3), torch.tensor([0, 1]))], _FixedOrder()), TrainState(), 2)
    assert [m["train/lr"] for m in logged] == [0.04]




def test_train_lr_is_the_lr_the_logged_update_used():
    """With a per-update schedule, train/lr at update N is the lr that update N stepped with (read off plain
    SGD's weight change, -lr * grad), not the one the scheduler has set for update N+1 by the time of the log."""
    from timm.scheduler import CosineLRScheduler
    from engine.loop import TrainBatches

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = CosineLRScheduler(optimizer, t_initial=4, warmup_t=2, warmup_lr_init=0.01, t_in_epochs=False)
    used = []  # the lr of each update, from the weights: (w_before - w_after) / grad

    def measure(opt, args, kwargs):
        w, g = model.weight.detach(), model.weight.grad
        used.append(((measure.before - w) / g).flatten()[0].item())

    model.weight.register_hook(lambda g: setattr(measure, "before", model.weight.detach().clone()))
    optimizer.register_step_post_hook(measure)
    logged = []
    loop = TrainLoop(model=model, optimizer=optimizer, compute_loss=lambda m, x, y: F_ce(m(x), y),
                     device=torch.device("cpu"), scheduler=scheduler, per_step_schedule=True, log_every=1,
                     log=lambda step, metrics: logged.append(metrics["train/lr"]))
    batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(4)]
    loop.run_epoch(TrainBatches(batches, _FixedOrder()), TrainState(), 2)
    assert len(used) == 4 and used[0] == pytest.approx(0.01, rel=1e-5)  # the warmup's first lr
    assert logged == pytest.approx(used, rel=1e-5)


@pytest.mark.parametrize("saved, restored", [(-1.0, None), (0.0, 0.0), (61.5, 61.5)])
def test_a_checkpoint_that_names_its_best_score_best_top1_restores_it(saved, restored):
    """Checkpoints written before the task-neutral `best_value` hold `best_top1`, with -1 for "no validation
    yet": a top-1 of 0 % is a score to beat, -1 none."""
    from engine.checkpoint import restore_training

    model = torch.nn.Linear(2, 2)
    state = TrainState()
    restore_training({"model": model.state_dict(), "state": {"step": 3, "best_top1": saved}}, model=model,
                     optimizer=None, state=state)
    assert (state.step, state.best_value) == (3, restored) and "best_top1" not in vars(state)


def test_a_training_payload_restores_optimizer_scaler_ema_and_counters():
    """training_payload -> restore_training into freshly built objects gives back what an exact resume needs:
    the weights, the EMA weights, Adam's moments and step, the GradScaler's scale and the counters (the
    schedule is built fresh, engine/resume.py); a run that has a GradScaler keeps it at its initial scale where the
    checkpoint has none (fp16 turned on at the resume), as a fresh fp16 run starts."""
    from timm.utils import ModelEmaV3

    from engine.checkpoint import restore_training, training_payload

    def build():
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        return (model, optimizer, torch.amp.GradScaler("cpu"), ModelEmaV3(model, decay=0.5),
                torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))

    torch.manual_seed(0)
    model, optimizer, scaler, ema, scheduler = build()
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()  # lr 0.1 -> 0.05
    ema.update(model, step=1)
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=123.0)
    state = TrainState(epoch=1, step=7, epoch_batches=4, skipped_steps=2, best_value=0.5, initial_loss=1.25)
    payload = training_payload(model=model, optimizer=optimizer, state=state, config={"seed": 1}, ema=ema,
                               scaler=scaler, scheduler=scheduler)
    torch.manual_seed(1)
    model2, optimizer2, scaler2, ema2, _ = build()
    state2 = TrainState()
    restore_training(payload, model=model2, optimizer=optimizer2, state=state2, ema=ema2, scaler=scaler2)
    for got, want in zip([*model2.parameters(), *ema2.module.parameters()], [*model.parameters(),
                                                                              *ema.module.parameters()]):
        assert torch.equal(got, want)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer2.state[p2][key], optimizer.state[p][key])
    assert scaler2.get_scale() == 123.0
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(0.05) and state2 == state
    del payload["scaler"]
    fresh = torch.amp.GradScaler("cpu")
    restore_training(payload, model=model2, optimizer=None, state=TrainState(), scaler=fresh)
    assert fresh.get_scale() == 2.0 ** 16  # torch's initial scale


@pytest.mark.parametrize("written, resumed", [(None, True), (True, None)])
def test_a_restored_optimizer_keeps_the_resuming_runs_kernel_choice(written, resumed):
    """The fused/foreach choice is the resuming run's (train.py: fused on CUDA), not the writer's: torch's
    load_state_dict takes every group entry from the file, so a CPU run's checkpoint resumed on CUDA (GPLQ's
    stage-1 resume) stepped unfused. The moments and the lr still come from the file, and the fused and
    the unfused step then give the same weights (up to rounding), checked against an AdamW that never stopped."""
    from engine.checkpoint import restore_training, training_payload

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=written)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    optimizer.param_groups[0]["lr"] = 0.05
    buffer = io.BytesIO()  # through a file, as a resume reads it (the payload's tensors alias the live ones)
    torch.save(training_payload(model=model, optimizer=optimizer, state=TrainState(step=1), config={}), buffer)
    buffer.seek(0)
    payload = torch.load(buffer, weights_only=False)
    model2 = torch.nn.Linear(3, 2)
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=0.1, fused=resumed)
    restore_training(payload, model=model2, optimizer=optimizer2, state=TrainState())
    assert optimizer2.param_groups[0]["fused"] is resumed and optimizer2.param_groups[0]["lr"] == 0.05
    x = torch.randn(4, 3)
    for m, opt in ((model, optimizer), (model2, optimizer2)):
        opt.zero_grad()
        m(x).square().sum().backward()
        opt.step()
    for got, want in zip(model2.parameters(), model.parameters()):
        torch.testing.assert_close(got, want)


def test_a_training_payload_holds_the_weights_of_the_wrapped_module_by_their_own_names():
    """Under DDP (a wrapper holding the model as `module`) the checkpoint's 'model' holds the names of the model
    itself, 'weight' and 'bias' of a Linear, not 'module.weight': the same file then loads into a one-process run,
    into evaluate.py and into the unwrapped model of a resumed DDP run."""
    from engine.checkpoint import restore_training, training_payload

    class Wrapper(torch.nn.DataParallel):  # a DataParallel on no device: the model as `.module`
        def __init__(self, module):
            torch.nn.Module.__init__(self)  # DataParallel's own would move the model to a GPU where there is one
            self.module, self.device_ids = module, []

    model = torch.nn.Linear(3, 2)
    payload = training_payload(model=Wrapper(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               state=TrainState(step=2), config={})
    assert set(payload["model"]) == {"weight", "bias"}
    fresh = torch.nn.Linear(3, 2)
    restore_training(payload, model=fresh, optimizer=None, state=TrainState())
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_an_abandoned_checkpoint_is_kept_once(tmp_path):
    """A roll-back keeps the checkpoint.pt it leaves as checkpoint.until_step<N>.pt (a hard link: checkpoint.pt
    stays in place until the first new checkpoint), unless a snapshot already holds the same file."""
    from engine import snapshots

    (tmp_path / "snapshots").mkdir()
    own, resume = tmp_path / "checkpoint.pt", tmp_path / "snapshots" / "epoch0001.pt"
    _training_checkpoint(own, 2.0)
    _training_checkpoint(resume, 1.0)
    os.link(own, tmp_path / "snapshots" / "epoch0002.pt")
    cpu = torch.device("cpu")
    assert snapshots.keep_abandoned_checkpoint(str(tmp_path), str(resume), 4, True, cpu) is None
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt", "snapshots"]
    os.remove(tmp_path / "snapshots" / "epoch0002.pt")  # checkpoint.pt is now the only copy of that progress
    kept = snapshots.keep_abandoned_checkpoint(str(tmp_path), str(resume), 4, True, cpu)
    assert kept == str(tmp_path / "checkpoint.until_step4.pt") and os.path.samefile(kept, own)


def built_loop(run):
    """train.build_loop's TrainLoop for a run built by hand, with no stop request."""
    return train.build_loop(run, preemption=type("NoStop", (), {"should_stop": lambda *a, **k: False,
                                                                "request_stop": lambda *a: None})())


def test_each_setting_given_reaches_the_object_it_configures(debug_config):
    """build_run hands every setting to what it configures; read back from the built objects, against the
    values given (the debug recipe: 64 synthetic images, global batch 16 of 8 per process, 2 epochs). The peak
    lr follows the global batch: optim.lr_base at optim.lr_base_batch, scaled linearly to train.batch_size."""
    from engine.distributed import DistInfo

    cfg = debug_config("optim.weight_decay=0.07", "cd.enabled=true", "cd.budget=false", "cd.lam=0.003",
                       "tweo.enabled=true", "tweo.schedule=cosine", "train.ema=true", "train.ema_decay=0.9",
                       "train.ema_warmup=true", "train.eval_batch_size_per_gpu=5", "train.log_every_steps=3",
                       "optim.lr=null", "optim.lr_base=0.002", "optim.lr_base_batch=32", "data.repeated_aug=2",
                       "train.seed=3")
    run = train.build_run(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                          resumed=False)
    assert {g["initial_lr"] for g in run.optimizer.param_groups} == {0.002 * 16 / 32}  # the schedule's peak
    # what each checkpoint records of the epoch's layout, for a resume in another one (engine/resume.py)
    assert run.position == {"world_size": 1, "batch_size_per_gpu": 8, "accum_steps": 2, "updates_per_epoch": 4,
                            "train_images": 64, "seed": 3, "repeated_aug": 2}
    # cd.budget=false: weight decay stays as given (1-D parameters never decay)
    assert {g["weight_decay"] for g in run.optimizer.param_groups} == {0.0, 0.07}
    assert run.decay.lam == 0.003 and run.decay.norms_every == 3
    assert run.accum_steps == 2 and run.updates_per_epoch == 64 // 16
    assert run.tweo.total_steps == run.total_steps == 2 * (64 // 16)  # the cosine's whole length
    assert run.ema.decay == 0.9 and run.ema.use_warmup is True
    assert run.loaders.val.batch_size == 5
    run.tweo.remove()


@pytest.mark.parametrize("cd, want", [(False, 0.07), (True, 0.07 - 0.003)])
def test_the_weight_decay_budget_moves_lam_only_when_cd_runs(debug_config, cd, want):
    """cd.budget is on by default: with CD the decaying groups get wd - lam (0.07 - 0.003), without CD the
    weight decay as given, budget or not (a baseline has no CD to hand the budget to)."""
    from engine.distributed import DistInfo

    cfg = debug_config("optim.weight_decay=0.07", f"cd.enabled={str(cd).lower()}", "cd.lam=0.003")
    assert cfg.cd.budget
    run = train.build_run(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                          resumed=False)
    decays = sorted({g["weight_decay"] for g in run.optimizer.param_groups})
    assert decays[0] == 0.0 and decays[1:] == [pytest.approx(want, rel=1e-12)]


def test_the_global_batch_splits_over_processes_and_accumulation_steps(debug_config):
    cfg = debug_config("train.batch_size=48", "train.batch_size_per_gpu=8")
    assert [train.accumulation_steps(cfg, w) for w in (1, 2, 3, 6)] == [6, 3, 2, 1]  # 48 / (8 x w)
    for world_size in (4, 5):  # 8 x 4 = 32 and 8 x 5 = 40 do not divide 48
        with pytest.raises(train.ConfigError, match="not a multiple"):
            train.accumulation_steps(cfg, world_size)


def test_the_loop_gets_the_clip_max_steps_divergence_and_smoothed_loss_given(debug_config):
    """build_loop's TrainLoop: optim.clip_grad, train.max_steps, train.divergence_factor as given, and a loss
    that is the label-smoothed cross entropy written out here (data.label_smoothing=0.2, no mixing, 4 classes)."""
    from engine.distributed import DistInfo

    cfg = debug_config("optim.clip_grad=0.7", "train.max_steps=3", "train.divergence_factor=50",
                       "data.label_smoothing=0.2", "data.mixup=0", "data.cutmix=0")
    run = train.build_run(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                          resumed=False)
    loop = built_loop(run)
    assert loop.clip_grad == 0.7 and loop.max_steps == 3 and loop.divergence is not None
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5], [0.0, 1.0, 0.0, 3.0]])
    targets = torch.tensor([0, 3])
    logp = torch.log_softmax(logits, dim=1)
    eps = 0.2  # (1 - eps) on the label, eps spread evenly over the 4 classes
    expected = -((1 - eps) * logp[torch.arange(2), targets] + eps * logp.mean(dim=1)).mean()
    loss = loop.compute_loss(lambda x: logits, torch.zeros(2, 3, 32, 32), targets)
    assert torch.allclose(loss, expected, atol=1e-6)


def test_the_loop_gets_the_seed_precision_mixing_and_cadences_given(debug_config):
    """build_loop's TrainLoop: the update-level settings as given, none of them its default: train.seed for
    the per-update randomness, the fp16 autocast and its GradScaler, the global batch 16 as 2 micro-batches of
    8, timm's mixing at data.mixup, the log / checkpoint / validation cadences in updates, and the divergence
    guard's windows."""
    from engine.distributed import DistInfo

    cfg = debug_config("train.seed=5", "train.amp=fp16", "data.mixup=0.3", "train.log_every_steps=3",
                       "train.ckpt_every_steps=5", "train.eval_every_steps=2", "train.divergence_factor=50",
                       "train.divergence_windows=4")
    run = train.build_run(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                          resumed=False)
    loop = built_loop(run)
    assert loop.seed == 5 and loop.amp == "fp16" and loop.accum_steps == 16 // 8
    assert isinstance(loop.scaler, torch.amp.GradScaler)
    assert loop.mixup.mixup_alpha == 0.3
    assert (loop.log_every, loop.ckpt_every, loop.eval_every) == (3, 5, 2)
    assert (loop.divergence.factor, loop.divergence.windows) == (50, 4)

def test_the_chance_warning_covers_up_to_one_and_a_half_times_chance(caplog):
    """10 classes: chance is 10%, so 15% still warns and 15.1% does not; one class has no chance level."""
    for top1, warned in ((9.0, True), (15.0, True), (15.1, False), (90.0, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="train"):
            train.warn_if_at_chance(top1, 10, "digits")
        assert ("is at chance level" in caplog.text) == warned, top1
        caplog.clear()
        with caplog.at_level("WARNING", logger="train"):
            train.warn_if_at_chance(top1, 10, "synthetic")  # val labels without signal: chance is all there is
        assert "is at chance level" not in caplog.text, top1
    caplog.clear()
    train.warn_if_at_chance(0.0, 1, "digits")
    assert "chance" not in caplog.text


def test_cd_loss_form_adds_loss_coef_times_the_task_loss(debug_config):
    """cd.mode=loss: the added term's value is cd.loss_coef x the task loss (cd/decay.py aux_loss), so the loss
    build_loop computes is (1 + loss_coef) x the plain cross entropy written here."""
    from engine.distributed import DistInfo

    cfg = debug_config("cd.enabled=true", "cd.budget=false", "cd.mode=loss", "cd.loss_coef=0.25",
                       "data.label_smoothing=0", "data.mixup=0", "data.cutmix=0")
    run = train.build_run(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                          resumed=False)
    loop = built_loop(run)
    logits, targets = torch.tensor([[2.0, 0.0, -1.0, 0.5]]), torch.tensor([2])
    expected = 1.25 * -torch.log_softmax(logits, dim=1)[0, 2]
    assert torch.allclose(loop.compute_loss(lambda x: logits, torch.zeros(1, 3, 32, 32), targets), expected)


@pytest.mark.parametrize("every, steps", [(1, [4, 8, 12]), (2, [8, 12])])
def test_validation_runs_every_eval_every_epochs_and_at_the_last_epoch(debug_config, every, steps):
    """3 epochs of 64 / 16 = 4 updates: validations at every `every`-th epoch's end and at the run's end; with
    train.keep_every_epochs=2 the one snapshot is epoch 2's (not the last epoch's: snapshots have no such rule);
    with log.act_max=true each validation records the activation maxima (a ViT's are above 0)."""
    cfg = debug_config("sched.epochs=3", f"train.eval_every_epochs={every}", "log.tensorboard=false",
                       "train.keep_every_epochs=2", "log.act_max=true")
    train.main(cfg)
    validations = [r for r in read_metrics(cfg.out_dir) if "val/top1" in r]
    assert [r["step"] for r in validations] == steps
    assert all(r["act/max_module"] > 0 and r["act/max_block"] > 0 for r in validations)
    assert os.listdir(os.path.join(cfg.out_dir, "snapshots")) == ["epoch0002.pt"]


def test_clipping_bounds_the_norm_of_every_parameter_group_together():
    """optim.clip_grad clips the global norm over all parameters, whichever group holds them (the no-weight-
    decay and layer-decay groups are other groups): the reference is the norm of every gradient by autograd,
    and each weight moves by lr * clip / norm times its gradient."""
    from engine.loop import TrainBatches

    torch.manual_seed(0)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    model = torch.nn.Linear(3, 2).double()
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}],
                                lr=0.5)
    logged = []
    loop = TrainLoop(model=model, optimizer=optimizer, compute_loss=lambda m, a, b: F_ce(m(a), b),
                     device=torch.device("cpu"), clip_grad=0.01, log_every=1,
                     log=lambda step, metrics: logged.append(metrics))
    loop.run_epoch(TrainBatches([(x, y)], _FixedOrder()), TrainState(), batch_size_per_gpu=4)
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    gw, gb = torch.autograd.grad(F_ce(x @ w.T + b, y), (w, b))
    norm = float(torch.sqrt((gw ** 2).sum() + (gb ** 2).sum()))
    assert norm > 0.01 * 10  # the clip acts
    assert logged[0]["train/grad_norm"] == pytest.approx(norm, rel=1e-9)
    scale = 0.01 / (norm + 1e-6)
    torch.testing.assert_close(model.weight.detach(), w0 - 0.5 * scale * gw, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(model.bias.detach(), b0 - 0.5 * scale * gb, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layer_decay", [None, 0.5])
def test_layer_decay_and_weight_decay_groups_are_beits_rule_and_timms_exclusions(layer_decay):
    """optim.layer_decay=d (BEiT / DeiT-III fine-tuning): a parameter of layer i trains at lr x d^(depth + 1 - i),
    with the embeddings (cls_token, pos_embed, patch_embed) layer 0, block j layer j + 1 and the head layer depth + 1
    (lr x 1); timm's group_matcher puts the final norm with the last block (layer depth, BEiT: depth + 1). Weight
    decay skips every 1-D parameter, the biases and the model's no_weight_decay() names (pos_embed, cls_token).
    Reference: the rule written out over the parameter names, the lr the timm scheduler sets at the warmup's end."""
    from configs.schema import ModelConfig, OptimConfig, SchedConfig
    from engine.optim import build_optimizer, build_scheduler
    from models import build_model

    model = build_model(ModelConfig(name="vit_nano", pretrained="", num_classes=4))
    depth, lr, wd = len(model.blocks), 1e-3, 0.05
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=lr, layer_decay=layer_decay), lr, wd)
    sched = SchedConfig(epochs=3, warmup_epochs=1, warmup_prefix=True, per_step=True)
    scheduler = build_scheduler(optimizer, sched, updates_per_epoch=4)
    scheduler.step_update(4)  # the warmup's end, where the cosine begins: the peak lr
    got = {name: (group["lr"], group["weight_decay"]) for group in optimizer.param_groups
           for name, p in model.named_parameters() for q in group["params"] if p is q}

    def layer(name):
        if name.split(".")[0] in ("cls_token", "pos_embed", "patch_embed"):
            return 0
        if name.startswith("blocks."):
            return int(name.split(".")[1]) + 1
        return depth if name.startswith("norm.") else depth + 1

    want = {name: (lr * (1.0 if layer_decay is None else layer_decay ** (depth + 1 - layer(name))),
                   0.0 if p.ndim <= 1 or name.endswith(".bias") or name in ("pos_embed", "cls_token") else wd)
            for name, p in model.named_parameters()}
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-12), name
    assert want["blocks.0.attn.qkv.weight"][1] == wd and want["pos_embed"][1] == 0.0


def test_the_micro_batches_of_one_update_draw_their_own_randomness():
    """The RNG is reseeded once per update, not per micro-batch: with train.accum_steps=2 the two micro-batches
    of an update must not mix with the same lambda or drop the same paths (their draws differ), and a run
    resumed after update 1 draws again what updates 2 and 3 drew."""
    from engine.loop import TrainBatches

    def draws(start_step=0, micro_batches=6):
        seen = []
        model = torch.nn.Linear(3, 2)

        def compute_loss(m, x, y):
            seen.append(float(torch.rand(())))
            return F_ce(m(x), y)

        loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         compute_loss=compute_loss, device=torch.device("cpu"), seed=3, accum_steps=2,
                         log_every=100)
        batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(micro_batches)]
        loop.run_epoch(TrainBatches(batches, _FixedOrder()), TrainState(step=start_step), batch_size_per_gpu=2)
        return seen

    whole = draws()
    assert len(set(whole)) == 6  # no two micro-batches draw the same
    assert draws(start_step=1, micro_batches=4) == whole[2:]


def test_under_ddp_only_the_last_micro_batch_of_an_update_synchronises_its_gradients():
    """DDP all-reduces the gradients in a backward outside `no_sync()`, and that reduction carries the gradients
    accumulated under `no_sync()` before it: with train.accum_steps=3 micro-batches 1 and 2 of each update run
    inside `no_sync()` and micro-batch 3 outside it, so that every rank steps with the sum over all its micro-
    batches averaged over the ranks (a synchronised first micro-batch and an unsynchronised last one would
    leave each rank its own last gradient)."""
    from contextlib import contextmanager

    from engine.loop import TrainBatches

    class FakeDdp(torch.nn.Linear):
        """A DDP stand-in that records, per forward, whether it runs inside no_sync()."""

        def __init__(self):
            super().__init__(3, 2)
            self.inside, self.seen = False, []

        @contextmanager
        def no_sync(self):
            self.inside = True
            try:
                yield
            finally:
                self.inside = False

        def forward(self, x):
            self.seen.append(self.inside)
            return super().forward(x)

    model = FakeDdp()
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     compute_loss=lambda m, x, y: F_ce(m(x), y), device=torch.device("cpu"), accum_steps=3,
                     log_every=100)
    batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(6)]
    loop.run_epoch(TrainBatches(batches, _FixedOrder()), TrainState(), batch_size_per_gpu=2)
    assert model.seen == [True, True, False, True, True, False]


def test_train_img_per_s_counts_the_images_of_every_process_and_micro_batch(monkeypatch):
    """train/img_per_s is the global throughput: a window's updates x batch_size_per_gpu x accum_steps x
    world_size images over its seconds. The clock is frozen, so the window lasts the loop's floor of 1e-9 s."""
    import engine.loop
    from engine.loop import TrainBatches

    monkeypatch.setattr(engine.loop.time, "perf_counter", lambda: 5.0)
    logged = []
    loop = _tiny_loop(accum_steps=2, world_size=3, log_every=2, log=lambda step, metrics: logged.append(metrics))
    batches = [(torch.randn(4, 3), torch.tensor([0, 1, 1, 0])) for _ in range(4)]  # 2 updates, one window
    loop.run_epoch(TrainBatches(batches, _FixedOrder()), TrainState(), batch_size_per_gpu=4)
    assert [m["train/img_per_s"] for m in logged] == [pytest.approx(2 * 4 * 2 * 3 / 1e-9)]


def test_a_windows_throughput_and_data_wait_are_its_own_images_and_waits_over_its_own_seconds(monkeypatch):
    """train/img_per_s is a window's images over the window's seconds and train/data_wait the share of those
    seconds spent waiting for batches; the next window starts from zero at the previous log step. A hand
    clock: 16 images and 1 s of waiting in 4 s, then 8 images and 0.5 s in 2 s: 4 img/s and 25 % twice."""
    import engine.loop
    from engine.loop import _Window

    clock = [10.0]
    monkeypatch.setattr(engine.loop.time, "perf_counter", lambda: clock[0])
    window = _Window(torch.device("cpu"))
    window.add_loss(torch.tensor(2.0))
    window.add_update(8, None)
    window.add_update(8, None)
    window.data_wait += 1.0
    clock[0] = 14.0
    first = window.flush(step=2, kept_step=None)
    window.add_loss(torch.tensor(1.0))
    window.add_update(8, None)
    window.data_wait += 0.5
    clock[0] = 16.0
    second = window.flush(step=3, kept_step=None)
    assert (first["train/img_per_s"], first["train/data_wait"]) == (4.0, 0.25)
    assert (second["train/img_per_s"], second["train/data_wait"]) == (4.0, 0.25)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_nan_or_infinite_loss_stops_before_the_next_checkpoint(bad):
    """Not only NaN: a loss of +-inf (an fp16 overflow, a log of 0) is no loss either. Updates 1-2 are finite,
    update 3's loss is `bad`: NonFiniteLossError naming the value, and checkpoints only after updates 1 and 2."""
    from engine.loop import TrainBatches

    calls, saves = [0], []

    def compute_loss(m, x, y):
        calls[0] += 1
        loss = F_ce(m(x), y)
        return loss * 0 + bad if calls[0] == 3 else loss

    model = torch.nn.Linear(3, 2)
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), compute_loss=compute_loss,
                     device=torch.device("cpu"), ckpt_every=1, save=lambda: saves.append(1), log_every=100)
    batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(4)]
    with pytest.raises(NonFiniteLossError, match=f"the training loss is {bad}"):
        loop.run_epoch(TrainBatches(batches, _FixedOrder()), TrainState(), batch_size_per_gpu=2)
    assert len(saves) == 2


@pytest.mark.parametrize("ckpt_every, kept", [(1, "the last one, of update 2, is kept"),
                                               (100, "none was written yet, so the same command starts afresh")])
def test_a_nan_loss_stop_names_the_checkpoint_kept_or_that_none_was_written(ckpt_every, kept):
    """The stop's line names what a re-run resumes from: update 2's checkpoint when one was written every update,
    and, with none written before the NaN of update 3, that the same command starts afresh (not 'the last good one
    is kept', which named a file that did not exist)."""
    from engine.loop import TrainBatches

    calls = [0]

    def compute_loss(m, x, y):
        calls[0] += 1
        loss = F_ce(m(x), y)
        return loss * float("nan") if calls[0] == 3 else loss

    model = torch.nn.Linear(3, 2)
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), compute_loss=compute_loss,
                     device=torch.device("cpu"), ckpt_every=ckpt_every, save=lambda: None, log_every=100)
    batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(4)]
    with pytest.raises(NonFiniteLossError, match="without writing a checkpoint: " + kept):
        loop.run_epoch(TrainBatches(batches, _FixedOrder()), TrainState(), batch_size_per_gpu=2)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_train_skipped_steps_is_logged_at_the_update_the_gradscaler_skipped(fused):
    """train/skipped_steps counts the skipped updates up to its log step, also with a fused optimizer, whose
    skips are counted on the device: an inf gradient in update 2 of 3 is logged as 0, 1, 1."""
    from engine.loop import TrainBatches

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    updates = [0]
    model.weight.register_hook(lambda g: g * float("inf") if updates[0] == 1 else g)
    logged = []

    def log(step, metrics):
        logged.append(metrics["train/skipped_steps"])
        updates[0] = step

    loop = TrainLoop(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused),
                     compute_loss=lambda m, x, y: F_ce(m(x), y), device=torch.device("cpu"),
                     scaler=torch.amp.GradScaler("cpu"), log_every=1, log=log)
    batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(3)]
    loop.run_epoch(TrainBatches(batches, _FixedOrder()), TrainState(), batch_size_per_gpu=2)
    assert logged == [0, 1, 1]


def test_epoch_costs_are_logged_only_for_an_epoch_run_in_one_go():
    """epoch/train_seconds is the wall time of a whole epoch (the efficiency protocol compares them): an epoch
    resumed mid-way logs none, a whole one logs it once, at its end."""
    from engine.loop import TrainBatches

    batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(4)]
    for start, want in [(0, 1), (2, 0)]:
        logged = []
        loop = _tiny_loop(log_every=100, log_epoch_costs=True, log=lambda step, metrics: logged.append(metrics))
        state = TrainState(step=start, epoch_batches=start)
        loop.run_epoch(TrainBatches(batches[start:], _FixedOrder()), state, batch_size_per_gpu=2)
        assert state.epoch == 1 and sum("epoch/train_seconds" in m for m in logged) == want, start


def test_the_epoch_a_process_began_training_in_is_flagged_cold_also_in_a_resumed_job():
    """The efficiency protocol leaves out cold epochs (data-loader start, cuDNN autotuning): a job resumed at an
    epoch boundary begins cold in its first epoch, which read as warm (only a run's first record was left out).
    A job resumed mid-epoch logs no cost for the epoch it began in, and its next is warm."""
    from engine.loop import TrainBatches

    batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(4)]
    for epoch, start, want in [(0, 0, [True, False]), (1, 0, [True, False]), (0, 2, [False])]:
        logged = []
        loop = _tiny_loop(log_every=100, log_epoch_costs=True, log=lambda step, metrics: logged.append(metrics))
        state = TrainState(step=4 * epoch + start, epoch=epoch, epoch_batches=start)
        for first in (start, 0):
            loop.run_epoch(TrainBatches(batches[first:], _FixedOrder()), state, batch_size_per_gpu=2)
        flags = [m["epoch/first_in_process"] for m in logged if "epoch/train_seconds" in m]
        assert state.epoch == epoch + 2 and flags == want, (epoch, start, flags)


def test_an_epoch_split_by_validations_logs_the_time_of_its_updates_once():
    """eval_every=2 over an epoch of 5 updates: run_epoch returns for a validation after updates 2 and 4 (the
    caller validates, here a 0.3 s sleep) and the epoch is still run in one go: epoch/train_seconds is logged once,
    at its end, the time of its 5 updates (0.05 s each, a sleep in the loss) without the validations'."""
    import time as _time

    from engine.loop import TrainBatches

    def slow_loss(m, x, y):
        _time.sleep(0.05)
        return F_ce(m(x), y)

    batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(5)]
    logged = []
    model = torch.nn.Linear(3, 2)
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), compute_loss=slow_loss,
                     device=torch.device("cpu"), eval_every=2, log_every=100, log_epoch_costs=True,
                     log=lambda step, metrics: logged.append((step, metrics)))
    state, reasons = TrainState(), []
    while state.epoch == 0 and len(reasons) < 5:
        reasons.append(loop.run_epoch(TrainBatches(batches[state.epoch_batches:], _FixedOrder()), state, 2))
        if reasons[-1] == "validate":
            _time.sleep(0.3)
    assert reasons == ["validate", "validate", "epoch_end"]
    seconds = [(step, m["epoch/train_seconds"]) for step, m in logged if "epoch/train_seconds" in m]
    assert len(seconds) == 1 and seconds[0][0] == 5, seconds
    assert 5 * 0.05 <= seconds[0][1] < 5 * 0.05 + 0.3, seconds


def test_resuming_from_out_dirs_own_checkpoint_keeps_no_copy_of_it(tmp_path):
    """keep_abandoned_checkpoint keeps checkpoint.pt only when the run goes on from another file: the same
    command resumed from checkpoint.pt itself leaves no checkpoint.until_step<N>.pt beside it."""
    from engine.snapshots import keep_abandoned_checkpoint

    own = tmp_path / "checkpoint.pt"
    own.write_bytes(b"progress")
    assert keep_abandoned_checkpoint(str(tmp_path), str(own), 5, True, torch.device("cpu")) is None
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt"]
    other = tmp_path / "start.pt"
    other.write_bytes(b"start")
    kept = keep_abandoned_checkpoint(str(tmp_path), str(other), 5, True, torch.device("cpu"))
    assert kept == str(tmp_path / "checkpoint.until_step5.pt") and open(kept, "rb").read() == b"progress"


def test_a_stop_request_ends_the_epoch_after_the_update_that_saw_it():
    """should_stop (a preemption request) is asked after every update with its count: asked 'stop' at update 2 of
    an epoch of 4, run_epoch returns 'preempted' there, with the epoch's position kept for the resume."""
    from engine.loop import TrainBatches

    asked = []

    def should_stop(step):
        asked.append(step)
        return step == 2

    batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(4)]
    state = TrainState()
    reason = _tiny_loop(should_stop=should_stop, log_every=100).run_epoch(TrainBatches(batches, _FixedOrder()),
                                                                          state, 2)
    assert (reason, state.step, state.epoch, state.epoch_batches, asked) == ("preempted", 2, 0, 2, [1, 2])


def test_evaluate_sums_every_ranks_counts_before_the_percentages(monkeypatch):
    """Under DDP each rank scores its own images: top-1 / top-5 / loss are over every rank's images, not this
    rank's alone. The other rank is an all_reduce that adds its sums (3 images: 1 top-1 hit, 2 top-5 hits, loss
    sum 6.0, in one batch of a 7-class model); this rank's are counted by a loop over its images. A rank without a
    batch reports the top-5 of the others' images all the same."""
    import engine.loop
    from engine.loop import evaluate

    torch.manual_seed(2)
    model = torch.nn.Linear(4, 7).double()
    images, targets = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 7, (5,))
    other = torch.tensor([1.0, 2.0, 6.0, 3.0, 0.0, 0.0, 1.0], dtype=torch.float64)  # no failed batch, one batch

    def add_other_rank(t, op="sum"):
        return t.add_(other) if op == "sum" else t

    monkeypatch.setattr(engine.loop, "all_reduce", add_other_rank)
    logits = model(images).detach()
    above = [int((row > row[y]).sum()) for row, y in zip(logits, targets.tolist())]
    loss = -float(torch.log_softmax(logits, 1)[torch.arange(5), targets].sum())
    got = evaluate(model, [(images, targets)], torch.device("cpu"))
    assert got["count"] == 8
    assert got["top1"] == pytest.approx(100 * (sum(a < 1 for a in above) + 1) / 8)
    assert got["top5"] == pytest.approx(100 * (sum(a < 5 for a in above) + 2) / 8)
    assert got["loss"] == pytest.approx((loss + 6.0) / 8, rel=1e-6)
    alone = evaluate(model, [], torch.device("cpu"))
    assert (alone["count"], alone["top1"], alone["top5"]) == (3, pytest.approx(100 / 3), pytest.approx(200 / 3))


def test_a_snapshot_leaves_the_checkpoint_in_place_and_only_the_main_rank_writes_one(tmp_path):
    """The snapshot is a second name of checkpoint.pt (a hard link here), which stays the resume point; a rank
    other than the main one writes nothing but knows the path."""
    from engine import snapshots

    checkpoint = tmp_path / "checkpoint.pt"
    _training_checkpoint(checkpoint, 1.0)
    path = snapshots.keep_snapshot(str(checkpoint), 3, False, torch.device("cpu"))
    assert path == str(tmp_path / "snapshots" / "epoch0003.pt") and not os.path.exists(path)
    assert snapshots.keep_snapshot(str(checkpoint), 3, True, torch.device("cpu")) == path
    assert checkpoint.exists() and os.path.samefile(path, checkpoint)


def _peer_gone_worker(rank, world, port, out_file):
    """Rank 1 ends at once; rank 0, with an error of its own, then reaches raise_on_every_rank's all-reduce."""
    import time

    from dist_utils import init_gloo
    from engine.distributed import raise_on_every_rank

    init_gloo(rank, world, port, timeout_s=60)
    if rank == 1:
        os._exit(0)
    time.sleep(1.0)  # rank 1's process has ended (its sockets are closed)
    try:
        raise_on_every_rank(OSError("disk full"), torch.device("cpu"), lambda: RuntimeError("elsewhere"))
        outcome = "no error"
    except BaseException as e:  # noqa: BLE001 - the test reads which one
        outcome = f"{type(e).__name__}: {e}"
    with open(out_file, "w") as f:
        f.write(outcome)
    os._exit(0)


def test_a_rank_with_its_own_error_raises_it_when_the_other_rank_is_already_gone(tmp_path):
    """The all-reduce that shares a failure fails itself when the other rank's process has ended: the rank printed
    gloo's lost connection instead of its own error."""
    from dist_utils import spawn_within

    out = tmp_path / "rank0.txt"
    spawn_within(_peer_gone_worker, (2, free_port(), str(out)), 2, seconds=90)
    assert out.read_text() == "OSError: disk full"


def batches(debug_config, *overrides: str):
    """The debug config with the batch sizes `overrides` set after loading: a global batch that is no multiple of the
    per-process one is refused as the config loads (configs/constraints.py), and the rest of the check, which needs
    the number of processes, is accumulation_steps'."""
    cfg = debug_config()
    for item in overrides:
        key, _, value = item.partition("=")
        setattr(cfg.train, key.split(".")[1], int(value))
    return cfg


def test_a_global_batch_the_processes_do_not_divide_names_both_fixes(debug_config):
    """It named the numbers only: 12 over per-process batches of 8 on one process; 24 over 8 on 4 processes."""
    with pytest.raises(ConfigError, match=r"^train.batch_size=12 is not a multiple of train.batch_size_per_gpu=8 x "
                                          r"1 processes: set train.batch_size to a multiple of 8 \(e.g. 8\), or "
                                          r"train.batch_size_per_gpu=6$"):
        train.accumulation_steps(batches(debug_config, "train.batch_size=12"), 1)
    with pytest.raises(ConfigError, match=r"a multiple of 32 \(e.g. 32\), or train.batch_size_per_gpu=6$"):
        train.accumulation_steps(batches(debug_config, "train.batch_size=24", "train.batch_size_per_gpu=8"), 4)
    cfg = batches(debug_config, "train.batch_size=12", "train.batch_size_per_gpu=6")
    assert train.accumulation_steps(cfg, 1) == 2


def test_a_huge_batch_size_per_gpu_is_told_at_once_with_the_largest_per_gpu_batch_that_fits(debug_config):
    """The suggested train.batch_size_per_gpu is the largest d <= the given one with d x processes dividing
    train.batch_size (checked by counting down, for small values); a huge per-process batch (a typo) is refused
    without counting down from it."""
    for batch, per_gpu, world in [(12, 8, 1), (24, 8, 4), (36, 5, 1), (36, 40, 1), (49, 48, 1), (97, 96, 1),
                                  (60, 7, 2), (30, 100, 3)]:
        want = next(d for d in range(per_gpu, 0, -1) if batch % (d * world) == 0)
        with pytest.raises(ConfigError, match=rf", or train.batch_size_per_gpu={want}$"):
            cfg = batches(debug_config, f"train.batch_size={batch}", f"train.batch_size_per_gpu={per_gpu}")
            train.accumulation_steps(cfg, world)
    for per_gpu in (10**12, 2**63 - 1):  # the largest the schema takes
        with pytest.raises(ConfigError, match=rf"^train.batch_size=16 is not a multiple of train.batch_size_per_gpu="
                                              rf"{per_gpu} x 1 processes: .*, or train.batch_size_per_gpu=16$"):
            cfg = batches(debug_config, "train.batch_size=16", f"train.batch_size_per_gpu={per_gpu}")
            train.accumulation_steps(cfg, 1)
    big = 6 * 10**11 + 2  # below 10**12: the largest per-process batch that fits is the global batch itself
    with pytest.raises(ConfigError, match=rf", or train.batch_size_per_gpu={big}$"):
        cfg = batches(debug_config, f"train.batch_size={big}", "train.batch_size_per_gpu=1000000000000")
        train.accumulation_steps(cfg, 1)


def test_cd_tf32_products_on_a_cpu_run_are_refused_before_any_folder(debug_config):
    """CPUs have no TF32: cd.matmul_precision=tf32 there would train in fp32 under a config.yaml that says tf32."""
    cfg = debug_config("train.device=cpu", "cd.enabled=true", "cd.matmul_precision=tf32")
    with pytest.raises(ConfigError, match=r"^cd.matmul_precision=tf32 but the run is on the cpu, which has no TF32 "
                                          r".*set cd.matmul_precision=fp32 or auto"):
        train.main(cfg)
    assert not os.path.exists(cfg.out_dir)
    for precision in ("auto", "fp32", "bf16"):  # what a CPU computes as named (auto: fp32 there)
        train.check_device_settings(debug_config("cd.enabled=true", f"cd.matmul_precision={precision}"),
                                    torch.device("cpu"))
    train.check_device_settings(cfg, torch.device("cuda", 0))  # a GPU run's TF32 is real
