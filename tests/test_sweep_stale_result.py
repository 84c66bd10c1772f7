"""Which eval_best.json a sweep moves aside before a run's evaluation (scripts/sweep.py move_stale_result): one that
evaluate.py would not add to for the run's best.pt, told by the weights fingerprint the file records, not by file
times. A copy that dropped the times (cp -r, rsync without -t) left a valid result older than its best.pt, which was
moved aside and evaluated again; a file newer than best.pt but of earlier weights was kept, and evaluate.py refused
it at that run's turn."""
import json
import os

import pytest
import torch

from engine.checkpoint import weights_fingerprint
from engine.eval_results import EvalResults, ResultsError

import sweep


def weights(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=generator), "b": torch.randn(4, generator=generator)}


def evaluated_run(folder, trained: dict, scored: dict, recorded_checkpoint=None) -> tuple[str, str]:
    """A run folder whose best.pt holds `trained` and whose eval_best.json (with its _act_max files) scored
    `scored`, recording the fingerprint and checkpoint path as evaluate.py does; (the JSON, best.pt)."""
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint, result = folder / "best.pt", folder / "eval_best.json"
    torch.save({"model": trained, "config": {"model": {"name": "tiny"}}}, checkpoint)
    result.write_text(json.dumps({"model": "tiny", "checkpoint": str(recorded_checkpoint or checkpoint),
                                  "checkpoint_kind": "best", "weights": "raw",
                                  "fingerprint": weights_fingerprint(scored), "quant": {}}))
    for end in ("_act_max.csv", "_act_max.png"):
        (folder / f"eval_best{end}").write_text("maxima")
    return str(result), str(checkpoint)


def set_order(result: str, checkpoint: str, result_older: bool) -> None:
    """The file times: the result written a minute before best.pt (a copy that dropped the times) or after it."""
    now = os.path.getmtime(checkpoint)
    os.utime(result, (now + (-60 if result_older else 60),) * 2)


def evaluate_py_adds_to(result: str, checkpoint: str, trained: dict) -> bool:
    """The reference: whether evaluate.py's result file (engine/eval_results.EvalResults) takes `result` for an
    evaluation of `checkpoint` holding `trained`."""
    identity = {"model": "tiny", "checkpoint": checkpoint, "checkpoint_kind": "best", "weights": "raw",
                "fingerprint": weights_fingerprint(trained)}
    try:
        EvalResults.open(result, identity)
    except ResultsError:
        return False
    return True


@pytest.mark.parametrize("result_older", [True, False])
def test_a_result_of_the_weights_best_pt_holds_is_kept_whatever_the_file_times(tmp_path, capsys, result_older):
    trained = weights(0)
    result, checkpoint = evaluated_run(tmp_path / "runs" / "a", trained, trained)
    set_order(result, checkpoint, result_older)
    assert evaluate_py_adds_to(result, checkpoint, trained)
    before = sorted(os.listdir(tmp_path / "runs" / "a"))
    sweep.move_stale_result(result, checkpoint)
    assert sorted(os.listdir(tmp_path / "runs" / "a")) == before and capsys.readouterr().err == ""
    assert not sweep.is_stale_result(result, checkpoint)


@pytest.mark.parametrize("result_older", [True, False])
def test_a_result_of_earlier_weights_is_moved_aside_whatever_the_file_times(tmp_path, capsys, result_older):
    trained, earlier = weights(0), weights(1)
    folder = tmp_path / "runs" / "a"
    result, checkpoint = evaluated_run(folder, trained, earlier)
    set_order(result, checkpoint, result_older)
    text = (folder / "eval_best.json").read_text()
    assert not evaluate_py_adds_to(result, checkpoint, trained)
    sweep.move_stale_result(result, checkpoint)
    (moved,) = [p for p in folder.iterdir() if p.name.startswith("eval_best.") and p.name.endswith(".json")]
    assert not os.path.exists(result) and moved.read_text() == text  # nothing lost
    stem = moved.name[:-len(".json")]
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["best.pt", moved.name, f"{stem}_act_max.csv", f"{stem}_act_max.png"])
    message = capsys.readouterr().err
    assert message.startswith(f"sweep: {result} scored other weights than best.pt holds now") and str(moved) in message


def test_a_copy_beside_its_original_is_moved_aside_and_a_moved_run_kept(tmp_path, capsys):
    """A result recording another best.pt that is still there (the run copied beside the original) is of another
    evaluation for evaluate.py, though its weights are the same; one whose recorded folder is gone (the run moved)
    is of the same checkpoint. The sweep agrees with evaluate.py in both."""
    trained = weights(0)
    original = tmp_path / "original" / "best.pt"
    original.parent.mkdir()
    torch.save({"model": trained, "config": {}}, original)
    result, checkpoint = evaluated_run(tmp_path / "copy", trained, trained, recorded_checkpoint=original)
    assert not evaluate_py_adds_to(result, checkpoint, trained)
    assert sweep.is_stale_result(result, checkpoint)
    original.unlink()  # now the run was moved: nothing at the recorded path
    assert evaluate_py_adds_to(result, checkpoint, trained)
    sweep.move_stale_result(result, checkpoint)
    assert os.path.exists(result) and capsys.readouterr().err == ""


@pytest.mark.parametrize("result_older", [True, False])
def test_a_result_without_a_fingerprint_is_moved_aside_whatever_its_file_time(tmp_path, capsys, result_older):
    """Files of an older evaluate.py record no fingerprint, which evaluate.py refuses to add to (it records one for
    every result): kept when newer than best.pt, it failed that run's evaluation after its training."""
    trained = weights(0)
    result, checkpoint = evaluated_run(tmp_path / "runs" / "a", trained, trained)
    data = json.loads(open(result).read())
    del data["fingerprint"]
    with open(result, "w") as f:
        json.dump(data, f)
    set_order(result, checkpoint, result_older)
    assert not evaluate_py_adds_to(result, checkpoint, trained)
    assert sweep.is_stale_result(result, checkpoint)
    sweep.move_stale_result(result, checkpoint)
    assert not os.path.exists(result) and "records no weights fingerprint" in capsys.readouterr().err


def test_a_result_of_ema_weights_is_moved_aside_as_the_sweep_scores_the_raw_ones(tmp_path, capsys):
    """The sweep's evaluate.py command gives no --ema: a result of the EMA copy is refused by it ('weights: ema in
    the file, raw now') even when the fingerprints agree (an EMA equal to the weights: decay 0, or its first update)."""
    trained = weights(0)
    result, checkpoint = evaluated_run(tmp_path / "runs" / "a", trained, trained)
    data = json.loads(open(result).read())
    data["weights"] = "ema"
    with open(result, "w") as f:
        json.dump(data, f)
    assert not evaluate_py_adds_to(result, checkpoint, trained)
    sweep.move_stale_result(result, checkpoint)
    assert not os.path.exists(result) and "is refused by evaluate.py" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["not json", "[1]", '{"quant": {}}'])
def test_a_file_that_is_no_result_of_evaluate_py_is_moved_aside(tmp_path, capsys, text):
    """A file evaluate.py cannot read as its result is refused by it whatever its time: moved aside, kept as it was."""
    trained = weights(0)
    folder = tmp_path / "runs" / "a"
    result, checkpoint = evaluated_run(folder, trained, trained)
    (folder / "eval_best.json").write_text(text)
    set_order(result, checkpoint, result_older=False)
    assert not evaluate_py_adds_to(result, checkpoint, trained)
    sweep.move_stale_result(result, checkpoint)
    (moved,) = [p for p in folder.iterdir() if p.name.startswith("eval_best.") and p.name.endswith(".json")]
    assert not os.path.exists(result) and moved.read_text() == text
    assert "is refused by evaluate.py" in capsys.readouterr().err


def test_current_result_reads_a_copied_result_of_the_same_weights(tmp_path):
    """The checks before the start (another --eval-amp, other settings) read the result a sweep will add to: one
    older than best.pt but of its weights is read, not skipped as moved aside."""
    trained = weights(0)
    folder = tmp_path / "runs" / "a"
    result, checkpoint = evaluated_run(folder, trained, trained)
    set_order(result, checkpoint, result_older=True)
    run = {"name": "a", "overrides": [f"out_dir={folder}"]}
    found = sweep.current_result(run)
    assert found is not None and found[1]["fingerprint"] == weights_fingerprint(trained)
