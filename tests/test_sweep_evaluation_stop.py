"""A sweep stopped by SIGTERM / SIGINT during an evaluation exits 75 (EXIT_PREEMPTED), so that a job script that
requeues on 75 runs the same command again, which evaluates the run again (evaluate.py skips what its JSON holds).

Outside GPLQ's stage 1, evaluate.py writes no checkpoint on a stop: the signal ends it at once (exit 143 for
SIGTERM). The sweep reported that as 'interrupted during evaluation, no checkpoint written on the stop' and exited
143, which a job script reads as a failure, dropping the rest of the sweep."""
import pathlib

import torch

from configs import config_to_dict, load_config
from tests.conftest import DEBUG_CONFIG

import sweep  # noqa: E402  (scripts/, on the path of the tests)

# stands in for `python`: train.py exits 0 (the test leaves a finished checkpoint.pt); evaluate.py sends SIGTERM to its
# parent, the sweep (as a scheduler does), which passes it on to this process while it waits
STAND_IN = """#!/bin/sh
echo "$1" >> "$CALLS"
if [ "$1" = evaluate.py ]; then
  kill -TERM $PPID
  exec sleep 20
fi
exit 0
"""


def test_a_sigterm_during_an_evaluation_stops_the_sweep_with_exit_75(tmp_path, monkeypatch, capsys):
    launcher, calls = tmp_path / "launcher", tmp_path / "calls"
    launcher.write_text(STAND_IN)
    launcher.chmod(0o755)
    monkeypatch.setenv("CALLS", str(calls))
    runs = pathlib.Path(tmp_path) / "runs"
    (runs / "a").mkdir(parents=True)
    # a finished run of tiny.yaml (2 epochs of 4 updates): the sweep reads its update from checkpoint.pt
    torch.save({"state": {"step": 8, "epoch": 2}, "config": config_to_dict(load_config([DEBUG_CONFIG], [])),
                "epoch_position": {"updates_per_epoch": 4}}, runs / "a" / "checkpoint.pt")
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {runs}\nruns:\n  a: []\n  b: []\n")
    code = sweep.main([str(spec), "--run", "--evaluate", "--launcher", str(launcher)])
    out = capsys.readouterr()
    assert code == 75, out
    assert calls.read_text().splitlines() == ["train.py", "evaluate.py"]  # b never starts
    assert out.out.split("sweep summary:\n")[1].splitlines() == [
        "  a: evaluation stopped (re-run to continue)", "  b: not started"]
    assert "run the same command again to continue" in out.err and "no checkpoint written" not in out.err
