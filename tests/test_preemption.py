"""Preemption: SIGTERM / SIGINT to the main process, to the whole process group (DataLoader workers
included) and through torchrun all stop at an update boundary, write checkpoint.pt, exit 0 and resume."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dist_utils import free_port
from tests.conftest import DEBUG_CONFIG, ROOT

LONG_RUN = ("sched.epochs=1000", "train.log_every_steps=1", "data.synthetic_train_size=256")


def start(cmd, out_dir):
    """Start `cmd` in a new session (its own process group) and wait until it has logged an update."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = os.path.join(out_dir, "metrics.jsonl")
    deadline = time.time() + 180
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"training did not start:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.2)
    return proc


def saved_step(out_dir) -> int:
    return torch.load(os.path.join(out_dir, "checkpoint.pt"), weights_only=True)["state"]["step"]


def resume_two_more_updates(cmd, out_dir, step):
    resumed = subprocess.run([*cmd, f"train.max_steps={step + 2}"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert saved_step(out_dir) == step + 2


def train_cmd(out_dir, *overrides):
    return [sys.executable, "train.py", "--config", DEBUG_CONFIG, f"out_dir={out_dir}", *LONG_RUN, *overrides]


@pytest.mark.parametrize("signum, target, workers", [
    (signal.SIGTERM, "main", 0),
    (signal.SIGTERM, "group", 2),  # what SLURM, scancel, timeout and `kill -TERM -- -PGID` do
    (signal.SIGINT, "group", 2),   # Ctrl-C in a terminal
], ids=["sigterm-main", "sigterm-group-workers", "sigint-group-workers"])
def test_signal_saves_a_checkpoint_exits_0_and_resumes(tmp_path, signum, target, workers):
    cmd = train_cmd(tmp_path, f"data.num_workers={workers}")
    proc = start(cmd, tmp_path)
    if target == "group":
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    assert "preempted at update" in output and "Traceback" not in output
    assert "val top-1" not in output.split("preempted at update")[1]  # no validation pass after the signal
    step = saved_step(tmp_path)
    assert 1 <= step < 16000  # 16 updates per epoch x 1000 epochs: stopped early
    resume_two_more_updates(cmd, tmp_path, step)


@pytest.mark.slow
def test_process_group_sigterm_through_torchrun_stops_every_rank_at_one_update(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_port", str(free_port()),
           "train.py", "--config", DEBUG_CONFIG, f"out_dir={tmp_path}", *LONG_RUN,
           "train.batch_size_per_gpu=8", "data.num_workers=1"]
    proc = start(cmd, tmp_path)
    os.killpg(proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=180)
    # torchrun forwards SIGTERM to the ranks and then ends with its own SignalException report (not ours);
    # the ranks stop at the same update, write checkpoint.pt and return normally:
    # no traceback through our code
    assert "preempted at update" in output, output[-3000:]
    assert "DataLoader worker" not in output and 'train.py", line' not in output, output[-3000:]
    step = saved_step(tmp_path)
    assert step % 10 == 0 or step % 16 == 0  # ranks agree every 10 updates and at epoch ends (16 updates)
    resume_two_more_updates(cmd, tmp_path, step)


def test_a_second_interrupt_after_the_grace_window_stops_at_once():
    from engine.preemption import Preemption

    with Preemption(torch.device("cpu"), repeat_window_s=0.0) as preemption:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # let the handler run
        assert preemption.requested and preemption.should_stop(step=3)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_repeated_signals_in_the_window_are_one_request():
    from engine.preemption import Preemption

    with Preemption(torch.device("cpu"), repeat_window_s=60.0) as preemption:
        for _ in range(3):  # e.g. torchrun forwarding the signal the worker already got
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert preemption.requested
