"""Runs killed (SIGKILL: no handler runs) at the worst moments of their writes, then re-run with the same command:
the re-run goes on, and nothing the killed run wrote is lost."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import train
from tests.conftest import DEBUG_CONFIG, ROOT

# train.py, killed inside the write of the first file whose name contains KILL_AT (written through a temporary
# file: save_atomic's `<path>.partial-...`), after half of it is written
KILLING_DRIVER = textwrap.dedent("""
    import os, runpy, signal, sys
    import torch
    at, save = os.environ["KILL_AT"], torch.save
    def cut(obj, f, *args, **kwargs):
        name = getattr(f, "name", f)
        if at in os.path.basename(str(name)):
            f.write(b"PK\\x03\\x04half a checkpoint" * 100)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return save(obj, f, *args, **kwargs)
    torch.save = cut
    sys.argv = ["train.py"] + sys.argv[1:]
    sys.path.insert(0, os.getcwd())
    runpy.run_path("train.py", run_name="__main__")
""")


def killed_run(tmp_path, kill_at: str, *overrides: str) -> subprocess.CompletedProcess:
    driver = tmp_path / "killing_driver.py"
    driver.write_text(KILLING_DRIVER)
    return subprocess.run([sys.executable, str(driver), "--config", DEBUG_CONFIG, *overrides], cwd=ROOT,
                          env={**os.environ, "KILL_AT": kill_at}, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_kill_inside_the_first_checkpoint_write_restarts_with_the_same_command(tmp_path, debug_config):
    """The first validation writes best.pt just before the first checkpoint.pt: a kill inside that write left
    best.pt and no checkpoint.pt, a folder the same command refused (best.pt is a result, moved only with
    train.archive_existing=true), so every requeue of the job failed. The partial checkpoint.pt write shows that the
    run was killed there: the same command archives its files (best.pt too, unchanged) and trains afresh."""
    out = tmp_path / "run"
    killed = killed_run(tmp_path, "checkpoint.pt.partial", f"out_dir={out}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    left = sorted(os.listdir(out))
    assert "best.pt" in left and "checkpoint.pt" not in left, left
    assert any(name.startswith("checkpoint.pt.partial-") for name in left), left
    best = (out / "best.pt").read_bytes()

    run = train.main(debug_config(name="run"))  # the same command
    assert run.state.step == 8  # the whole schedule, from the start
    (stamp,) = os.listdir(out / "archive")
    assert (out / "archive" / stamp / "best.pt").read_bytes() == best  # moved, not deleted or changed
    assert not [name for name in os.listdir(out) if ".partial-" in name]
    assert os.path.isfile(out / "checkpoint.pt") and os.path.isfile(out / "best.pt")


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs, no handler sees it (not an Exception)."""


def killed_at_the_snapshot(name):
    """engine.snapshots.link_or_copy killed (Killed) as it is about to link snapshots/<name>; others linked."""
    from engine import snapshots
    link = snapshots.link_or_copy

    def link_or_die(source, target):
        if target.endswith(name):
            raise Killed
        return link(source, target)
    return link_or_die


def test_a_kill_while_metrics_jsonl_is_cut_back_keeps_the_records_before_the_resume_point(tmp_path, monkeypatch):
    """A resume cuts metrics.jsonl back to its checkpoint's update (the records after it kept in
    metrics.until_step<N>.jsonl). The file was moved aside before the cut one was renamed into place: a kill in
    between left no metrics.jsonl, and the next resume's file began after update N, the records up to N only in
    the kept file. Now metrics.jsonl stays whole until the rename."""
    from engine.metrics import MetricLogger

    records = [{"step": step, "train/loss": 1.0 / step} for step in range(1, 7)]  # a run killed after update 6
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    replace = os.replace

    def killed_at_the_rename(source, target, *args, **kwargs):
        if str(target).endswith("metrics.jsonl") and ".partial-" in str(source):
            raise Killed
        return replace(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "replace", killed_at_the_rename)
    with pytest.raises(Killed):  # resumed from its checkpoint of update 4, and killed in the cut
        MetricLogger(str(tmp_path), enabled=True, tensorboard=False, resume_step=4)
    monkeypatch.setattr(os, "replace", replace)
    MetricLogger(str(tmp_path), enabled=True, tensorboard=False, resume_step=4).close()  # the same resume again

    def read(name):
        return [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]

    assert read("metrics.jsonl") == records[:4]
    kept = sorted(name for name in os.listdir(tmp_path) if name.startswith("metrics.until_step4"))
    assert kept and all(read(name) == records for name in kept)


TIMINGS = ("_per_s", "data_wait", "peak_mem", "seconds")  # of the machine's speed, not of the run's numbers


def logged_series(out_dir) -> list[dict]:
    """metrics.jsonl's train/ and tweo/ records (the window's numbers), timings left out."""
    series = []
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if any(key.startswith(("train/", "tweo/")) for key in record):
            series.append({k: v for k, v in record.items() if not any(t in k for t in TIMINGS)})
    return series


def test_a_stop_or_a_kill_between_two_log_steps_logs_the_windows_of_a_run_never_stopped(tmp_path, debug_config,
                                                                                         monkeypatch):
    """train/loss (and tweo/penalty) is the mean over the updates since the last log step. A stop request between
    two log steps logged the window so far as an extra record, and the resumed run's next record was the mean of
    its own updates only; a kill after a checkpoint written inside a window (train.ckpt_every_steps) likewise
    started the window afresh. The checkpoint now carries the open window's sums and the resumed run goes on
    with them: metrics.jsonl reads as that of the run never stopped (reference: one run straight through)."""
    import torch.optim.optimizer as optimizer_module

    run = ("cd.enabled=true", "tweo.enabled=true", "train.log_every_steps=2", "train.ckpt_every_steps=3")
    train.main(debug_config(*run, name="straight"))
    straight = logged_series(tmp_path / "straight")
    assert [r["step"] for r in straight] == [2, 4, 6, 8]

    def interrupt(at, how):
        updates = [0]

        def hook(*_):
            updates[0] += 1
            if updates[0] == at:
                how()
        return optimizer_module.register_optimizer_step_post_hook(hook)

    # SIGTERM after update 3 (the checkpoint of the stop is written inside the window 3-4)
    handle = interrupt(3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        assert train.main(debug_config(*run, name="stopped")).reason == "preempted"
    finally:
        handle.remove()
    train.main(debug_config(*run, name="stopped"))
    assert logged_series(tmp_path / "stopped") == straight

    # killed in update 4: resumed from the checkpoint of update 3 (train.ckpt_every_steps), inside a window
    handle = interrupt(4, lambda: (_ for _ in ()).throw(Killed()))
    try:
        with pytest.raises(Killed):
            train.main(debug_config(*run, name="killed"))
    finally:
        handle.remove()
    train.main(debug_config(*run, name="killed"))
    assert logged_series(tmp_path / "killed") == straight


def snapshots_of(out_dir) -> list[str]:
    folder = out_dir / "snapshots"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def said_missing(out_dir) -> bool:
    return "stopped before it kept it" in (out_dir / "train.log").read_text()


def test_a_resume_that_adds_keep_every_epochs_at_an_epochs_end_keeps_no_snapshot_of_the_epoch_before(tmp_path,
                                                                                                      debug_config):
    """Epoch 1 ended under train.keep_every_epochs=0 (none owed); the resume at its end with keep_every_epochs=1
    kept it as snapshots/epoch0001.pt anyway, saying the run that wrote checkpoint.pt stopped before keeping it.
    Snapshots are kept at the ends of epochs the setting was on for: epoch 2's only, and no such warning."""
    train.main(debug_config("train.max_steps=4"))
    train.main(debug_config("train.keep_every_epochs=1"))
    assert snapshots_of(tmp_path / "run") == ["epoch0002.pt"]
    assert not said_missing(tmp_path / "run")


def test_a_run_started_from_another_folders_checkpoint_keeps_no_snapshot_of_the_epoch_it_did_not_train(tmp_path,
                                                                                                        debug_config,
                                                                                                        monkeypatch):
    """Y, started from X's checkpoint.pt at epoch 1's end (train.resume) and stopped there (train.max_steps=4, no
    update trained), wrote Y/checkpoint.pt at that end; its resume linked it as Y/snapshots/epoch0001.pt, X's epoch.
    A Y never stopped keeps epoch 2's only. A run started from another folder that trained to a kept epoch's end and
    was killed before its link still keeps it on resume."""
    from engine import snapshots

    every = "train.keep_every_epochs=1"
    train.main(debug_config(every, "train.max_steps=4", name="X"))
    start = f"train.resume={tmp_path / 'X' / 'checkpoint.pt'}"
    train.main(debug_config(every, start, name="straight"))  # the reference: Y never stopped
    train.main(debug_config(every, start, "train.max_steps=4", name="Y"))
    train.main(debug_config(every, start, name="Y"))
    assert snapshots_of(tmp_path / "Y") == snapshots_of(tmp_path / "straight") == ["epoch0002.pt"]
    assert not said_missing(tmp_path / "Y")

    link = snapshots.link_or_copy
    monkeypatch.setattr(snapshots, "link_or_copy", killed_at_the_snapshot("epoch0002.pt"))
    with pytest.raises(Killed):
        train.main(debug_config(every, start, name="killed"))
    assert snapshots_of(tmp_path / "killed") == []
    monkeypatch.setattr(snapshots, "link_or_copy", link)
    train.main(debug_config(every, start, name="killed"))
    assert snapshots_of(tmp_path / "killed") == ["epoch0002.pt"]
    assert said_missing(tmp_path / "killed")
