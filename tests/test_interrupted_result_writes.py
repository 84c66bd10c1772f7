"""A result write cut short by an interrupt (Ctrl-C mid-dump) leaves the file as it was and no temporary file in
the user's folder: evaluate.py's result file and the scripts' JSON outputs are written to a temporary name and
renamed, and that temporary is removed on any exception, not only on an OSError (a full disk)."""
from __future__ import annotations

import json
import os

import pytest

import engine.eval_results as er

IDENTITY = {"model": "m", "data": {}, "weights": "w", "eval_amp": "none", "images": 1}


def cut_dump(obj, f, **kw):
    """json.dump that is interrupted half-way, as Ctrl-C during the write."""
    f.write('{"model": "m", "da')
    f.flush()
    raise KeyboardInterrupt


def test_interrupted_eval_results_save_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "eval.json"
    results = er.EvalResults.open(str(path), IDENTITY)
    results.update(fp={"top1": 1.0})
    results.save()
    before = path.read_text()
    monkeypatch.setattr(er.json, "dump", cut_dump)
    results.update(fp={"top1": 2.0})
    with pytest.raises(KeyboardInterrupt):  # the interrupt goes on as it came
        results.save()
    assert sorted(os.listdir(tmp_path)) == ["eval.json"]  # the lock file is removed after, the temp too
    assert path.read_text() == before and json.loads(before)["fp"] == {"top1": 1.0}


def test_eval_results_save_is_on_disk_before_it_replaces_the_file(tmp_path, monkeypatch):
    """docs/operations.md: files are written through a temporary file, fsync and a rename. Without the fsync a
    machine that goes down after the rename may leave an empty eval.json (XFS): every result written so far gone.
    The written file (by its inode) is fsynced, and only then renamed over the result file; a full disk that shows
    at the fsync leaves the file as it was and no temporary."""
    path = tmp_path / "eval.json"
    events, fsync, replace = [], os.fsync, os.replace

    def record_fsync(fd):  # the file by its inode: the descriptor has no name on every system
        events.append(("fsync", os.fstat(fd).st_ino))
        fsync(fd)

    def record_replace(src, dst):
        events.append(("replace", os.stat(src).st_ino))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    results = er.EvalResults.open(str(path), IDENTITY)
    results.update(fp={"top1": 1.0})
    results.save()
    assert [e[0] for e in events] == ["fsync", "replace"] and events[0][1] == events[1][1], events
    assert json.loads(path.read_text())["fp"] == {"top1": 1.0}

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    before = path.read_text()
    results.update(fp={"top1": 2.0})
    with pytest.raises(er.ResultsError, match="No space left on device; the file is unchanged"):
        results.save()
    assert path.read_text() == before and sorted(os.listdir(tmp_path)) == ["eval.json"]


def script_writers():
    """The scripts' JSON writers, as (name, write(path, data))."""
    import bench_quant
    import crosscheck_aphq
    import gpu_check
    return [("bench_quant", lambda path, data: bench_quant.write_json(path, data, True)),
            ("crosscheck_aphq", lambda path, data: crosscheck_aphq.write_json(path, data, True)),
            ("gpu_check", gpu_check.write_whole)]


@pytest.mark.parametrize("index", range(3))
def test_script_json_write_keeps_a_users_tmp_file(index, tmp_path):
    """`<out>.tmp` was the temporary name: a user's res.json.tmp was overwritten, then renamed over res.json."""
    name, write = script_writers()[index]
    out, users = tmp_path / "res.json", tmp_path / "res.json.tmp"
    users.write_text("the user's own file")
    write(str(out), {"a": 1})
    assert json.loads(out.read_text()) == {"a": 1}, name
    assert users.read_text() == "the user's own file", name
    assert sorted(os.listdir(tmp_path)) == ["res.json", "res.json.tmp"], name


@pytest.mark.parametrize("index", range(3))
def test_interrupted_script_json_write_leaves_the_last_version(index, tmp_path, monkeypatch):
    name, write = script_writers()[index]
    out = tmp_path / "res.json"
    write(str(out), {"a": 1})
    monkeypatch.setattr(json, "dump", cut_dump)
    with pytest.raises(KeyboardInterrupt):
        write(str(out), {"a": 2})
    assert sorted(os.listdir(tmp_path)) == ["res.json"], name
    assert json.loads(out.read_text()) == {"a": 1}, name


def test_gpu_check_drops_the_temporary_of_a_killed_stage(tmp_path):
    """A stage killed (SIGKILL) mid-write leaves its temporary: the driver reads the last whole version and
    removes the temporary."""
    import gpu_check
    from engine.run_dir import partial_path
    figures = tmp_path / "quant.figures.json"
    figures.write_text(json.dumps({"done": 1}))
    cut = partial_path(str(figures))
    with open(cut, "w") as f:
        f.write('{"done": 1, "mo')
    assert gpu_check.collect_figures(str(figures)) == ({"done": 1}, None)
    assert os.listdir(tmp_path) == []
