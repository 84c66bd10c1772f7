"""A sweep with --run stopped by SIGTERM / SIGINT while it checks its runs, before any command started, exits with
EXIT_PREEMPTED (75), as a stop during a run does, so that a job script that requeues on 75 runs it again.

The checks read every run's checkpoint.pt and best.pt (minutes for a large sweep); a stop then ended the sweep by the
signal itself (exit 143 for SIGTERM, a KeyboardInterrupt traceback for SIGINT), which such a script took for a
failure and dropped the sweep. The reference: the process's own exit status, seen from outside."""
import signal
import subprocess
import sys

import pytest

from engine.exit_codes import EXIT_PREEMPTED
from tests.conftest import ROOT

import sweep  # noqa: E402  (scripts/, on the path of the tests)

# the sweep's reading of its runs sends the signal to the sweep itself, as a scheduler would (before torch is imported:
# a check later on would be stopped alike, within the same handlers)
SCRIPT = """
import os, signal, sys
sys.path.insert(0, os.path.join({root!r}, "scripts"))
import sweep

def stopped(*args, **kwargs):
    os.kill(os.getpid(), signal.{name})
    signal.pause()  # never reached where the handler raises

sweep.expand = stopped
sweep.run_one = lambda *args: sys.exit("a run started")
sys.exit(sweep.main([{spec!r}, "--run"]))
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_stop_while_the_sweep_checks_its_runs_exits_75_and_starts_nothing(tmp_path, name):
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path / 'runs'}\nruns:\n  a: []\n")
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(root=ROOT, name=name, spec=str(spec))],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == EXIT_PREEMPTED, (done.returncode, done.stderr[-2000:])
    assert done.stderr.strip().splitlines()[-1] == (f"sweep: {name} came before any run started; none started: run "
                                                    "the same command again")
    assert not (tmp_path / "runs").exists()


def test_the_handlers_before_are_restored_once_the_checks_end():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with sweep.stops_before_start(True):
        assert all(signal.getsignal(s) is not handler for s, handler in before.items())
    assert {s: signal.getsignal(s) for s in before} == before
