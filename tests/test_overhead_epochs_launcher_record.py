"""scripts/overhead_epochs.py records each run's launcher beside its folder (runs/<folder>.launcher.json) only while
holding that folder's lock, the one train.py holds while it trains: a second job on the same --out under another
launcher is refused with one `error:` line while the first job's run trains, and leaves the first job's record as it
was (it rewrote it, and the first job's own re-run was then refused as of another launcher)."""
from __future__ import annotations

import json

import pytest

from engine.run_dir import lock_folder
from tests.conftest import ROOT, load_script
from tests.test_overhead_epochs_reruns import one_process_launcher, protocol, recorded_runs


def test_a_second_job_leaves_the_record_of_the_run_another_job_trains(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "ep"
    run = out / "runs" / "vit_nano_bs8_baseline_run0"
    record = out / "runs" / "vit_nano_bs8_baseline_run0.launcher.json"
    run.mkdir(parents=True)
    first = {"launcher": "", "processes": 1}  # the first job (no launcher) recorded its run, whose train.py ...
    record.write_text(json.dumps(first))
    (run / "train.log").write_text("")
    started = recorded_runs(monkeypatch)
    with lock_folder(str(run)):  # ... holds the run folder while it trains
        with pytest.raises(SystemExit) as refused:
            load_script("bench_overhead").main(protocol(out, "--epochs", "2", "--launcher",
                                                        one_process_launcher(tmp_path)))
    message = str(refused.value.code)
    assert message.startswith(f"error: --out '{run}' is in use by another run (") and "\n" not in message, message
    assert json.loads(record.read_text()) == first and started == []
    assert sorted(p.name for p in (out / "runs").iterdir()) == [run.name, record.name]  # no temporary left


def test_a_free_run_folder_gets_this_jobs_record(tmp_path, monkeypatch):
    """With no job in the folder the record is written (a JSON object of the launcher and its processes)."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "ep"
    launcher = one_process_launcher(tmp_path)
    started = recorded_runs(monkeypatch)
    with pytest.raises(FileNotFoundError):  # the stand-in run writes no metrics.jsonl: the protocol stops there
        load_script("bench_overhead").main(protocol(out, "--epochs", "2", "--launcher", launcher))
    record = out / "runs" / "vit_nano_bs8_baseline_run0.launcher.json"
    assert json.loads(record.read_text()) == {"launcher": launcher, "processes": None} and len(started) == 1
