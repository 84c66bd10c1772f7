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
