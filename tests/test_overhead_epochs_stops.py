"""A stop request (Ctrl-C, a scheduler's SIGTERM) to scripts/overhead_epochs.py reaches the train.py it runs, and the
protocol waits while that run writes its checkpoint: it then ends with one `error:` line and exit status 75 (the same
command continues it), as scripts/sweep.py does. subprocess.run killed the run 0.25 s after the KeyboardInterrupt,
before its checkpoint was written."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from tests.conftest import ROOT, load_script

# A train.py stand-in: on SIGINT / SIGTERM it takes a while to write its checkpoint, then exits 75 (EXIT_PREEMPTED)
STAND_IN = """
import os, signal, sys, time
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
def stop(signum, frame):
    time.sleep(1.0)  # longer than subprocess.run's 0.25 s grace
    open(os.path.join(out, "checkpoint.pt"), "w").write("saved")
    sys.exit(75)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(out, "started"), "w").close()
time.sleep(30)
sys.exit(0)
"""


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_stop_request_lets_the_running_training_write_its_checkpoint(name, tmp_path, monkeypatch, capsys):
    epochs = load_script("overhead_epochs")
    monkeypatch.setattr(epochs, "train_command",
                        lambda args, method, model, batch, run, out_dir: [sys.executable, "-c", STAND_IN, out_dir])
    monkeypatch.chdir(ROOT)
    out = tmp_path / "ep"
    run = out / "runs" / "vit_nano_bs8_baseline_run0"
    signum = getattr(signal, name)

    def interrupted(signum, frame):  # as SIGINT's default; SIGTERM's would end pytest on a regression
        raise KeyboardInterrupt

    before = signal.signal(signum, interrupted)
    try:
        stopped_run(epochs, signum, run, out)
        assert signal.getsignal(signum) is interrupted  # the handler in place before the protocol is back
    finally:
        signal.signal(signum, before)
    assert (run / "checkpoint.pt").read_text() == "saved"  # the run wrote its checkpoint before it ended
    assert not (out / "runs" / "vit_nano_bs8_baseline_run1").exists()  # no further run started
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(run) in errors[0] and "continues" in errors[0], errors


def stopped_run(epochs, signum, run, out) -> None:
    """Run the protocol (two runs) and send `signum` to this process once the first run has started: the protocol
    must end with exit status 75, not with the KeyboardInterrupt."""

    def stop_when_started():
        deadline = time.monotonic() + 20
        while not (run / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signum)  # to the protocol's process only: it must pass the request on

    assert protocol_exit_while(stop_when_started, epochs, out) == 75


def protocol_exit_while(signaller, epochs, out) -> int:
    """The protocol's exit status (two runs) while `signaller` runs in a thread and sends its signals to this
    process; a KeyboardInterrupt out of the protocol itself fails the test."""
    stopper = threading.Thread(target=signaller, daemon=True)
    stopper.start()
    try:
        with pytest.raises(SystemExit) as done:
            epochs.main(["--recipe", "configs/debug/tiny.yaml", "--global-batch", "16", "--batches", "8",
                         "--models", "--methods", "baseline", "--runs", "2", "--out", str(out)])
    except KeyboardInterrupt:
        pytest.fail("the stop request ended the protocol itself instead of reaching its training")
    finally:
        stopper.join()
    return done.value.code


# A train.py stand-in for a second Ctrl-C: the first SIGINT starts a checkpoint write that takes a while, and a second
# one ends it at once (engine/preemption.py raises KeyboardInterrupt), before the checkpoint is written; it then
# exits 1, or as Python ends on an uncaught KeyboardInterrupt (killed by SIGINT)
TWICE = """
import os, signal, sys, time
out, ending = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
def now(signum, frame):
    if ending == "exit1":
        sys.exit(1)
    raise KeyboardInterrupt
def stop(signum, frame):
    signal.signal(signal.SIGINT, now)
    open(os.path.join(out, "writing"), "w").close()
    time.sleep(20)
    open(os.path.join(out, "checkpoint.pt"), "w").write("saved")
    sys.exit(75)
signal.signal(signal.SIGINT, stop)
open(os.path.join(out, "started"), "w").close()
time.sleep(30)
sys.exit(0)
"""


@pytest.mark.parametrize("ending, code, says", [
    ("exit1", 1, "interrupted by a signal and ended without writing a checkpoint.pt on the stop (train.py exit "
                 "status 1)"),
    ("uncaught", 128 + signal.SIGINT, "was killed by SIGINT"),
])
def test_a_second_ctrl_c_that_ends_the_training_before_its_checkpoint_is_not_reported_as_a_stop(
        ending, code, says, tmp_path, monkeypatch, capsys):
    """Only the run's own exit 75 (or its train.log's record of the stop) says its checkpoint.pt was written: a
    stop request the protocol received does not. The run ended with its own code, and so does the protocol."""
    epochs = load_script("overhead_epochs")
    monkeypatch.setattr(epochs, "train_command", lambda args, method, model, batch, run, out_dir:
                        [sys.executable, "-c", TWICE, out_dir, ending])
    monkeypatch.chdir(ROOT)
    out = tmp_path / "ep"
    run = out / "runs" / "vit_nano_bs8_baseline_run0"

    def twice():
        deadline = time.monotonic() + 20
        while not (run / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)
        while not (run / "writing").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, while the checkpoint is being written

    assert protocol_exit_while(twice, epochs, out) == code
    assert not (run / "checkpoint.pt").exists()
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(run) in errors[0] and says in errors[0], errors
    assert "after writing its checkpoint" not in errors[0]
    assert not (out / "runs" / "vit_nano_bs8_baseline_run1").exists()  # no further run started
