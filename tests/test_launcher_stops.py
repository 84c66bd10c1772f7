"""A command stopped on a stop request under a launcher that does not pass its exit code 75 on (torchrun exits 1 when
its processes exit 75) is a stopped run, not a failed one, for scripts/sweep.py and scripts/overhead_epochs.py: the
lines the command itself logged (train.log, eval.log) say so. Only lines this command wrote count: an earlier job's
stop in the same log does not turn a later failure into a stop.

The launcher here stands in for torchrun: it appends to the command's log what train.py (or evaluate.py's GPLQ stage
1) logs when a stop request ends it, made by the code that logs it (engine.runinfo.setup_logging's format,
train.run_summary, engine.preemption.preempted_line), and exits 1."""
from __future__ import annotations

import logging
import os

import pytest

from tests.conftest import load_script

STAND_IN = """#!/bin/sh
# stands in for torchrun: appends $LINES/<log> (what the processes logged as they stopped) to the command's log
# when that file exists, and exits 1, as torchrun does when its processes exit 75
script=$(basename "$1"); dir=""
for a in "$@"; do
  case "$a" in out_dir=*) dir="${a#out_dir=}";; */best.pt) dir=$(dirname "$a");; esac
done
log=train.log; [ "$script" = evaluate.py ] && log=eval.log
if [ -f "$LINES/$log" ]; then mkdir -p "$dir"; cat "$LINES/$log" >> "$dir/$log"; fi
exit 1
"""


def logged_lines(folder, logger: str, *messages: str) -> str:
    """The lines `messages` make in a run's log, written by the runs' own logging setup (engine/runinfo.py)."""
    from engine.runinfo import setup_logging
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "made.log").exists():
        (folder / "made.log").unlink()
    setup_logging(str(folder), is_main=True, filename="made.log")
    try:
        for message in messages:
            logging.getLogger(logger).info("%s", message)
    finally:
        for handler in [h for h in logging.getLogger().handlers if getattr(h, "_cd_run", False)]:
            logging.getLogger().removeHandler(handler)
            handler.close()
    return (folder / "made.log").read_text()


def training_stop_lines(folder) -> str:
    """What train.py's main rank logs as a stop request ends its run (train_epochs, then finish's run summary)."""
    import train
    from engine.loop import TrainState
    from engine.preemption import preempted_line
    state = TrainState(epoch=7, step=31, epoch_batches=3)
    return logged_lines(folder, "train", preempted_line(31, "checkpoint"),
                        train.run_summary(state, "preempted", 400, 1.0, 496, 1.0))


def evaluation_stop_lines(folder) -> str:
    """What evaluate.py logs as a stop request ends GPLQ's stage 1 (quant/gplq/qat.py)."""
    from engine.preemption import preempted_line
    stage1 = "/r/eval_best_gplq_w4a4_stage1.pt"
    return logged_lines(folder, "quant.gplq.qat", "GPLQ stage 1 " + preempted_line(12, stage1))


@pytest.fixture
def launcher(tmp_path, monkeypatch):
    """(the stand-in launcher, the folder of the lines it appends)."""
    lines = tmp_path / "lines"
    lines.mkdir()
    path = tmp_path / "fake_torchrun"
    path.write_text(STAND_IN)
    path.chmod(0o755)
    monkeypatch.setenv("LINES", str(lines))
    return str(path), lines


def sweep_file(tmp_path) -> str:
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\nruns:\n  a: []\n  b: []\n")
    return str(spec)


def summary(out: str) -> list[str]:
    return out.split("sweep summary:\n")[1].splitlines()


def test_a_sweep_run_its_launcher_reports_failed_after_a_stop_is_stopped_and_the_sweep_exits_75(tmp_path, launcher,
                                                                                               capsys):
    import sweep

    path, lines = launcher
    (lines / "train.log").write_text(training_stop_lines(tmp_path / "made"))
    spec = sweep_file(tmp_path)
    assert sweep.main([spec, "--run", "--launcher", path]) == 75
    assert summary(capsys.readouterr().out) == ["  a: stopped during training (resumable)", "  b: not started"]
    # the same sweep again: the launcher fails (exit 1) without a stop, and the stop the log holds from the job
    # before is not this command's
    (lines / "train.log").unlink()
    assert sweep.main([spec, "--run", "--launcher", path]) == 1
    assert summary(capsys.readouterr().out) == ["  a: failed during training (exit code 1)", "  b: not started"]


def test_a_sweep_evaluation_its_launcher_reports_failed_after_gplq_stage_1_stopped_is_stopped(tmp_path, launcher,
                                                                                            capsys):
    import sweep

    path, lines = launcher
    trains = tmp_path / "trains"  # training exits 0, its checkpoint.pt written; evaluate.py under the stand-in
    trains.write_text('#!/bin/sh\ncase "$1" in train.py)\n'
                      '  for a; do case "$a" in out_dir=*) mkdir -p "${a#out_dir=}"; '
                      ': > "${a#out_dir=}/checkpoint.pt";; '
                      f'esac; done; exit 0;;\nesac\nexec {path} "$@"\n')
    trains.chmod(0o755)
    (lines / "eval.log").write_text(evaluation_stop_lines(tmp_path / "made"))
    spec = sweep_file(tmp_path)
    assert sweep.main([spec, "--run", "--evaluate", "--launcher", str(trains)]) == 75
    assert summary(capsys.readouterr().out) == ["  a: stopped during evaluation (resumable)", "  b: not started"]
    (lines / "eval.log").unlink()
    assert sweep.main([spec, "--run", "--evaluate", "--launcher", str(trains)]) == 1
    assert summary(capsys.readouterr().out)[0] == "  a: failed during evaluation (exit code 1)"


def test_the_epochs_protocol_run_its_launcher_reports_failed_after_a_stop_ends_with_the_stop(tmp_path, launcher,
                                                                                           capsys, monkeypatch):
    from tests.conftest import ROOT

    path, lines = launcher
    monkeypatch.chdir(ROOT)
    (lines / "train.log").write_text(training_stop_lines(tmp_path / "made"))
    args = ["--protocol", "epochs", "--recipe", "configs/debug/tiny.yaml", "--global-batch", "16", "--batches", "8",
            "--models", "--methods", "baseline", "--runs", "1", "--epochs", "2", "--out", str(tmp_path / "ep"),
            "--launcher", path]
    run_dir = tmp_path / "ep" / "runs" / "vit_nano_bs8_baseline_run0"
    with pytest.raises(SystemExit) as stopped:
        load_script("bench_overhead").main(args)
    assert stopped.value.code == 75
    assert capsys.readouterr().err.splitlines()[-1] == (f"error: the run in {run_dir} stopped on a signal after "
                                                        "writing its checkpoint.pt; re-running the same command "
                                                        "continues it")
    (lines / "train.log").unlink()  # again: a failure, whatever the log holds from the job before
    with pytest.raises(SystemExit) as failed:
        load_script("bench_overhead").main(args)
    assert failed.value.code == 1
    assert "failed (train.py exit status 1)" in capsys.readouterr().err.splitlines()[-1]


def test_only_the_lines_written_after_the_mark_count_and_a_new_log_counts_whole(tmp_path):
    from launchers import log_mark, stopped_on_signal

    run = tmp_path / "run"
    stop = training_stop_lines(tmp_path / "made")
    log = run / "train.log"
    assert log_mark(str(log)) is None and not stopped_on_signal(str(log), None)  # no log: the command opened none
    run.mkdir()
    log.write_text(stop)
    mark = log_mark(str(log))
    assert not stopped_on_signal(str(log), mark)  # an earlier job's stop
    with open(log, "a") as f:
        f.write("12:00:00 train INFO update 32/1600  epoch 8/400\n")
    assert not stopped_on_signal(str(log), mark)
    with open(log, "a") as f:
        f.write(stop)
    assert stopped_on_signal(str(log), mark)
    # the run moved its logs to archive/ and began a new train.log: read whole
    mark = log_mark(str(log))
    os.rename(log, run / "archived.log")
    log.write_text(stop)
    assert stopped_on_signal(str(log), mark)
    # a job that ended otherwise
    log.write_text(logged_lines(tmp_path / "other", "train", "run summary: finished at update 8, epoch 2/2; ..."))
    assert not stopped_on_signal(str(log), None)


def test_a_run_counts_as_stopped_after_its_checkpoint_only_on_its_75_or_its_logs_record(tmp_path):
    """stopped_after_checkpoint: exit 75, or another non-zero code with the stop in the lines logged since the
    mark; exit 0 (finished) never, whatever the log holds."""
    from launchers import log_mark, stopped_after_checkpoint

    log = tmp_path / "run" / "train.log"
    mark = log_mark(str(log))
    assert stopped_after_checkpoint(75, str(log), mark)
    assert not stopped_after_checkpoint(1, str(log), mark)  # no log: e.g. a second Ctrl-C before any was written
    assert not stopped_after_checkpoint(-2, str(log), mark)  # killed by SIGINT
    (tmp_path / "run").mkdir()
    log.write_text(training_stop_lines(tmp_path / "made"))
    assert stopped_after_checkpoint(1, str(log), mark)  # torchrun's 1 after its processes exited 75
    assert not stopped_after_checkpoint(0, str(log), mark)
    assert not stopped_after_checkpoint(1, str(log), log_mark(str(log)))  # the stop is an earlier job's


def test_a_sweep_run_a_signal_ended_without_a_record_of_its_stop_is_interrupted_not_stopped(tmp_path, launcher,
                                                                                          capsys, monkeypatch):
    """A stop request the sweep received does not make a launcher's 1 a stop: without the log's record (a second
    Ctrl-C ends train.py without a new checkpoint) the run is interrupted, and the sweep exits with its code."""
    import signal

    import sweep

    path, lines = launcher

    def run_after_a_stop(self, cmd):
        self.received.append(signal.SIGINT)
        return subprocess_run(cmd, self.cwd)

    monkeypatch.setattr(sweep.ForwardedSignals, "run", run_after_a_stop)
    spec = sweep_file(tmp_path)
    assert sweep.main([spec, "--run", "--launcher", path]) == 1
    assert summary(capsys.readouterr().out) == [
        "  a: interrupted during training, no checkpoint written on the stop (exit code 1)", "  b: not started"]
    (lines / "train.log").write_text(training_stop_lines(tmp_path / "made"))  # its log records the stop: stopped
    assert sweep.main([spec, "--run", "--launcher", path]) == 75
    assert summary(capsys.readouterr().out) == ["  a: stopped during training (resumable)", "  b: not started"]


def subprocess_run(cmd: list[str], cwd: str) -> int:
    import subprocess
    return subprocess.run(cmd, cwd=cwd).returncode
