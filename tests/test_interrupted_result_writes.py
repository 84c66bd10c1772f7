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
