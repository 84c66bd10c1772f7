"""A sweep run whose train.py exits 0 without writing checkpoint.pt is a failure, not a result.

train.py ends so at train.max_steps inside a divergence streak before its first checkpoint (engine/divergence.py):
the guard withheld checkpoint.pt (and best.pt), so there is nothing to resume or to evaluate. The sweep reports it as
failed during training, evaluates nothing, starts no later run and exits 1, as for any failed command."""
from engine.tasks import ClassificationTask
from tests.conftest import ROOT, run_main
from tests.test_divergence_checkpoints import TINY, loss_raised_after

import sweep  # noqa: E402  (scripts/, on the path of the tests)

UNSAVED = "failed during training: stopped at train.max_steps with no checkpoint written (divergence guard"

STAND_IN = """#!/bin/sh
# stands in for `python`: logs "<script> <run>" and exits 0, writing nothing (no checkpoint.pt)
script=$1; name=""
for a in "$@"; do
  case "$a" in out_dir=*) name=$(basename "${a#out_dir=}");; */best.pt) name=$(basename "$(dirname "$a")");; esac
done
echo "$script $name" >> "$CALLS"
exit 0
"""


def summary(out: str) -> list[str]:
    return out.split("sweep summary:\n")[1].splitlines()


def sweep_in_process(tmp_path, monkeypatch, capfd, runs: str, raised_after: int, pipelines: str) -> tuple[int, str]:
    """(exit code, stdout) of `sweep.py --run --evaluate` over tiny.yaml with the run items `runs` (the YAML lines
    under `runs:`), train.py and evaluate.py run in this process, the training loss raised by hand after
    `raised_after` micro-batches (tests/test_divergence_checkpoints.py) and quant.pipelines=`pipelines`."""
    monkeypatch.setattr(ClassificationTask, "criterion", loss_raised_after(raised_after))
    monkeypatch.setattr(sweep.ForwardedSignals, "run", lambda self, cmd: run_main(cmd[1], cmd[2:]))
    monkeypatch.chdir(ROOT)  # where the sweep starts its commands
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\nruns:\n{runs}")
    code = sweep.main([str(spec), "--run", "--evaluate", *TINY, "log.tensorboard=false",
                       f"quant.pipelines={pipelines}"])
    return code, capfd.readouterr().out


def test_a_run_that_exits_0_without_a_checkpoint_is_failed_and_not_evaluated(tmp_path, monkeypatch, capsys):
    launcher, calls = tmp_path / "launcher", tmp_path / "calls"
    launcher.write_text(STAND_IN)
    launcher.chmod(0o755)
    monkeypatch.setenv("CALLS", str(calls))
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\nruns:\n  a: []\n  b: []\n")
    assert sweep.main([str(spec), "--run", "--evaluate", "--launcher", str(launcher)]) == 1
    assert calls.read_text().splitlines() == ["train.py a"]  # no evaluation of a, and b never starts
    out = capsys.readouterr()
    lines = summary(out.out)
    assert lines[0].startswith(f"  a: {UNSAVED}") and lines[1:] == ["  b: not started"], lines
    assert f"move {tmp_path}/runs/a (its logs only) out of the way" in lines[0]
    assert "sweep: run 'a' stopped at train.max_steps with no checkpoint written" in out.err


def test_a_real_run_stopped_at_max_steps_inside_its_first_divergence_streak_fails_the_sweep(tmp_path, monkeypatch,
                                                                                          capfd):
    """The reviewer's case in miniature, train.py and evaluate.py run in this process: the first log window is high
    (the loss raised by hand after the first update) and train.max_steps stops the run there. The sweep exits 1 with
    the run failed, nothing evaluated; before, it evaluated a best.pt of the diverged weights and exited 0."""
    code, out = sweep_in_process(tmp_path, monkeypatch, capfd, "  a: [train.max_steps=2]\n", 2, "[repq]")
    assert code == 1, out[-3000:]
    assert f"  a: {UNSAVED}" in summary(out)[0]
    folder = tmp_path / "runs" / "a"
    assert not (folder / "eval_best.json").exists() and not (folder / "best.pt").exists()

