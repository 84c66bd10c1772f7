"""A result file records its checkpoint's absolute path; the same checkpoint reached through a link or another
name, or moved with its run folder (nothing left at the recorded path, the same weights and kind of file), adds to
it; a moved one's file takes the new path. Another file at the recorded path (a copy of the run beside the
original), other weights, or another kind of file (checkpoint.pt for best.pt) stays another evaluation."""
import json
import os
import shutil

import pytest

import evaluate
from engine.eval_results import EvalResults, ResultsError


def identity(checkpoint, fingerprint="f1", kind="best") -> dict:
    return {"model": "vit_nano", "checkpoint": os.path.abspath(checkpoint), "checkpoint_kind": kind,
            "weights": "raw", "fingerprint": fingerprint}


def written(path, ident) -> None:
    results = EvalResults.open(str(path), ident)
    results.update(fp={"top1": 90.0})
    results.save()


def test_a_linked_or_moved_checkpoint_is_the_one_recorded_and_another_is_not(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "best.pt").write_bytes(b"weights")
    out = tmp_path / "eval.json"
    written(out, identity(run / "best.pt"))

    os.symlink(run, tmp_path / "link")  # the run's folder through a link: the file keeps the path it records
    EvalResults.open(str(out), identity(tmp_path / "link" / "best.pt")).save()
    assert json.loads(out.read_text())["checkpoint"] == str(run / "best.pt")

    shutil.copytree(run, tmp_path / "copy")  # a copy beside the original: another checkpoint file
    with pytest.raises(ResultsError, match=r"holds results of another evaluation \(checkpoint: "):
        EvalResults.open(str(out), identity(tmp_path / "copy" / "best.pt"))

    os.rename(run, tmp_path / "moved")
    moved = tmp_path / "moved" / "best.pt"
    for other in (identity(moved, fingerprint="f2"), identity(tmp_path / "copy" / "checkpoint.pt", kind="latest")):
        if not os.path.exists(other["checkpoint"]):
            shutil.copy(moved, other["checkpoint"])
        with pytest.raises(ResultsError, match=r"holds results of another evaluation \((checkpoint|fingerprint)"):
            EvalResults.open(str(out), other)
    results = EvalResults.open(str(out), identity(moved))
    results.save()
    saved = json.loads(out.read_text())
    assert saved["checkpoint"] == str(moved) and saved["fp"] == {"top1": 90.0}


def evaluate_into(checkpoint, out) -> dict:
    evaluate.main(evaluate.parse_args(["--checkpoint", str(checkpoint), "--quant", "--out", str(out)]))
    return json.loads(out.read_text())


def test_evaluate_adds_to_the_file_of_a_checkpoint_reached_through_a_link_or_moved(checkpoint, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(checkpoint, run / "best.pt")
    out = tmp_path / "eval.json"
    first = evaluate_into(run / "best.pt", out)
    os.symlink(run, tmp_path / "link")
    assert evaluate_into(tmp_path / "link" / "best.pt", out)["checkpoint"] == first["checkpoint"]
    os.rename(run, tmp_path / "moved")
    again = evaluate_into(tmp_path / "moved" / "best.pt", out)
    assert again["checkpoint"] == str(tmp_path / "moved" / "best.pt") and again["fp"]["top1"] == first["fp"]["top1"]
