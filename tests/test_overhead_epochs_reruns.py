"""Re-runs of the epochs protocol (scripts/bench_overhead.py --protocol epochs): a run folder is reused only by a
job that trains it as it was trained, with as many processes (the launcher, which no config records) and the same
settings; anything else is refused before the first run starts, in one error line. A run that train.py refuses or
that fails adds no second error line, and no claim that the same command resumes it."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import cd_models  # noqa: F401  (one torch thread)
import pytest
import torch

from tests.conftest import ROOT, load_script
from tests.test_bench_overhead import run_commands_with, train_in_this_process

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def protocol(out, *extra, method: str = "baseline") -> list[str]:
    return ["--protocol", "epochs", "--recipe", "configs/debug/tiny.yaml", "--global-batch", "16", "--batches", "8",
            "--models", "--methods", method, "--runs", "1", "--out", str(out), "data.synthetic_train_size=32",
            "data.synthetic_val_size=8", *extra]


def timed_seconds(run_dir) -> list[float]:
    return [r["epoch/train_seconds"] for r in map(json.loads, open(run_dir / "metrics.jsonl"))
            if "epoch/train_seconds" in r]


@pytest.fixture
def finished(tmp_path, monkeypatch):
    """The protocol's folder after one job without a launcher (one process): its run finished, 2 epochs timed."""
    run_commands_with(monkeypatch, train_in_this_process(subprocess.run))
    monkeypatch.chdir(ROOT)  # where the protocol starts its runs
    out = tmp_path / "ep"
    load_script("bench_overhead").main(protocol(out, "--epochs", "2"))
    return out


def recorded_runs(monkeypatch) -> list:
    """The commands the protocol starts from now on, each standing in for a run that finishes at once."""
    started = []

    def stand_in(cmd, **_):
        started.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    run_commands_with(monkeypatch, stand_in)
    return started


def one_process_launcher(folder) -> str:
    """A launcher that, as srun, starts the command without saying how many processes it runs (one, here)."""
    path = folder / "launch"
    path.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


def refusal_under(finished, launcher: str, monkeypatch) -> tuple:
    """(the error message, the runs started) of the protocol re-run over `finished` under `launcher`, which must
    refuse it (SystemExit)."""
    started = recorded_runs(monkeypatch)
    with pytest.raises(SystemExit) as refused:
        load_script("bench_overhead").main(protocol(finished, "--epochs", "2", "--launcher", launcher,
                                                    "--overwrite"))
    return str(refused.value.code), started


@pytest.mark.parametrize("launcher", ["torchrun", "unstated"])
def test_a_run_timed_under_another_launcher_is_refused_before_any_run(finished, tmp_path, monkeypatch, launcher):
    """The same protocol under a launcher of 2 processes (or of a number it does not state) resumed the finished
    1-process run (training nothing) and wrote its 1-process epoch times as the new launcher's in epochs.json."""
    launcher = f"{TORCHRUN} --nproc_per_node=2" if launcher == "torchrun" else one_process_launcher(tmp_path)
    run_dir = finished / "runs" / "vit_nano_bs8_baseline_run0"
    before, report = timed_seconds(run_dir), (finished / "epochs.json").read_text()
    message, started = refusal_under(finished, launcher, monkeypatch)
    assert message.startswith(f"error: {run_dir} holds a run timed under --launcher '' (1 process), not "
                              f"{launcher!r} (") and "\n" not in message, message
    assert "give --launcher '' to reuse it, or another --out" in message
    assert started == [] and timed_seconds(run_dir) == before and (finished / "epochs.json").read_text() == report


def test_the_same_command_again_reuses_the_finished_run_and_reports_its_times(finished, monkeypatch):
    """The same launcher with another spelling of as many processes (torchrun --nproc_per_node=1, one process as
    without a launcher) continues the run: nothing is trained again, the report gives the times of its epochs."""
    run_dir = finished / "runs" / "vit_nano_bs8_baseline_run0"
    seconds = timed_seconds(run_dir)
    report = load_script("bench_overhead").main(protocol(finished, "--epochs", "2", "--overwrite"))
    assert timed_seconds(run_dir) == seconds and report["rows"][0]["epoch_s"] == pytest.approx(sum(seconds) / 2)
    world = load_script("overhead_epochs").launcher_world_size
    same = load_script("overhead_run_folders").same_processes
    assert same("", f"{TORCHRUN} --nproc_per_node=1", world) and same("torchrun --nproc-per-node 2",
                                                                      "/bin/torchrun --nproc_per_node=2", world)
    assert not same("", "torchrun --nproc_per_node=2", world) and not same("srun python", "", world)


def test_a_run_folder_of_other_settings_is_refused_before_any_run_in_one_error_line(finished, monkeypatch):
    """--epochs 1 over a run trained for 2: train.py refused to continue it (sched.epochs changed), after the runs
    before it had run, and the protocol added a second error line saying that the same command resumes it."""
    run_dir = finished / "runs" / "vit_nano_bs8_baseline_run0"
    started = recorded_runs(monkeypatch)
    with pytest.raises(SystemExit) as refused:
        load_script("bench_overhead").main(protocol(finished, "--epochs", "1", "--overwrite"))
    message = str(refused.value.code)
    assert message.startswith(f"error: {run_dir} holds a run of other settings (") and "\n" not in message, message
    assert "sched.epochs: 2 -> 1" in message and "resume" not in message and started == []


def test_a_run_train_py_refuses_at_its_start_ends_with_its_error_alone(finished, monkeypatch, capsys):
    """A finished run's folder without its checkpoint.pt (removed to save space): train.py refuses the folder when
    it starts (an earlier run's files, nothing to resume), and its error line was followed by a second one of the
    protocol's, saying that the same command resumes the run (it is refused again). Now train.py's line is the only
    error; the protocol's names the run and exits with train.py's status."""
    run_dir = finished / "runs" / "vit_nano_bs8_baseline_run0"
    (run_dir / "checkpoint.pt").unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        load_script("bench_overhead").main(protocol(finished, "--epochs", "2", "--overwrite"))
    lines = capsys.readouterr().err.splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert stopped.value.code == 1 and len(errors) == 1 and "no checkpoint.pt to resume from" in errors[0], lines
    assert lines[-1] == (f"overhead_epochs: the run in {run_dir} failed (train.py exit status 1); its output above "
                         f"says why")


def test_a_run_stopped_by_a_signal_or_killed_is_one_error_saying_the_command_continues_it():
    """A run stopped by a signal after its checkpoint (train.py exits 75) or killed (-9: SIGKILL) printed no error:
    the protocol's line is the one, and the status is the one a shell gives (75; 128 + 9)."""
    epochs = load_script("overhead_epochs")
    code, line = epochs.failed_run_line("runs/r", 75)
    assert code == 75 and line.startswith("error: the run in runs/r stopped on a signal") and "continues it" in line
    code, line = epochs.failed_run_line("runs/r", -9)
    assert code == 137 and line.startswith("error: the run in runs/r was killed by SIGKILL; re-running the same "
                                           "command continues it")


def logged_run(folder, *worlds: int):
    """A run folder as train.py leaves it after one job per entry of `worlds` (that many processes each): its
    train.log written by engine/runinfo.py's own logging, and a checkpoint.pt to continue (no launcher record)."""
    from engine.distributed import DistInfo
    from engine.runinfo import log_environment, setup_logging
    folder.mkdir(parents=True)
    (folder / "checkpoint.pt").write_bytes(b"")
    try:
        for world in worlds:
            setup_logging(str(folder), is_main=True)
            log_environment(logging.getLogger("train"), DistInfo(0, world, 0, torch.device("cpu")))
    finally:
        for handler in [h for h in logging.getLogger().handlers if getattr(h, "_cd_run", False)]:
            logging.getLogger().removeHandler(handler)
            handler.close()
    return str(folder)


def test_a_folder_without_its_launcher_record_is_reused_when_its_train_log_states_as_many_processes(finished):
    """A folder written before the protocol recorded launchers (no runs/<folder>.launcher.json) was refused, so an
    interrupted run could only be trained again from scratch. Its train.log states the processes of each job (1
    here): a launcher of 1 process continues the run, nothing is trained again, and the report gives its times."""
    launcher = ""  # one process (the protocol's default)
    run_dir = finished / "runs" / "vit_nano_bs8_baseline_run0"
    os.remove(f"{run_dir}.launcher.json")
    assert ", 1 process(es), rank 0 on " in (run_dir / "train.log").read_text()
    seconds = timed_seconds(run_dir)
    report = load_script("bench_overhead").main(protocol(finished, "--epochs", "2", "--launcher", launcher,
                                                         "--overwrite"))
    assert timed_seconds(run_dir) == seconds and (run_dir / "train.log").read_text().count(" process(es), ") == 2
    assert report["rows"][0]["epoch_s"] == pytest.approx(sum(seconds) / 2)
    assert json.load(open(f"{run_dir}.launcher.json")) == {"launcher": launcher, "processes": 1}


@pytest.mark.parametrize("launcher", ["torchrun", "unstated"])
def test_a_folder_without_its_launcher_record_is_refused_when_its_train_log_states_other_processes(
        finished, tmp_path, monkeypatch, launcher):
    """The same folder without its record under a launcher of 2 processes, or of a number it does not state: its
    train.log's 1 process is not this launcher's, so the run is refused before any run, in one error line."""
    launcher = f"{TORCHRUN} --nproc_per_node=2" if launcher == "torchrun" else one_process_launcher(tmp_path)
    run_dir = finished / "runs" / "vit_nano_bs8_baseline_run0"
    os.remove(f"{run_dir}.launcher.json")
    message, started = refusal_under(finished, launcher, monkeypatch)
    assert message.startswith(f"error: {run_dir} holds a run of 1 process (its train.log; its launcher is not "
                              f"recorded), not --launcher {launcher!r} (") and "\n" not in message, message
    assert message.endswith("give a launcher of 1 process to reuse it, or another --out") and started == []


def test_an_unrecorded_folder_is_judged_by_every_job_in_its_train_log(tmp_path):
    """A run resumed several times holds one environment line per job: the last job's count decides, and jobs of
    different counts (epoch times of both) or a log that states none are refused."""
    folders = load_script("overhead_run_folders")
    world = load_script("overhead_epochs").launcher_world_size
    two = "torchrun --nproc_per_node=2"
    resumed = logged_run(tmp_path / "resumed", 2, 2, 2)
    assert folders.logged_processes(resumed) == [2, 2, 2]
    assert folders.unrecorded_problem(resumed, two, world) is None
    assert "holds a run of 2 processes" in folders.unrecorded_problem(resumed, "", world)
    mixed = logged_run(tmp_path / "mixed", 2, 1)
    assert folders.logged_processes(mixed) == [2, 1]
    assert "jobs of 2, 1 processes" in folders.unrecorded_problem(mixed, "", world)
    assert "jobs of 2, 1 processes" in folders.unrecorded_problem(mixed, two, world)
    silent = logged_run(tmp_path / "silent")
    (tmp_path / "silent" / "train.log").write_text("12:00:00 train INFO position within epoch: 8 samples, written "
                                                   "by 1 process(es) x 8 per process\n")
    assert folders.logged_processes(silent) == []
    assert "its train.log states no number of processes" in folders.unrecorded_problem(silent, "", world)
    assert "its train.log states no number of processes" in folders.unrecorded_problem(str(tmp_path), "", world)
