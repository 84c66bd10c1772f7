"""Nothing lost: a second evaluate.py call into one result file that measures the activation maxima over other
quant.act_max_extra_modules (another maximum, not the same one again) is refused before any pass, the file and its
CSV and plot untouched; with --recompute the old maxima move to the file's history with their CSV and plot, moved
aside and named there, as a recomputed quantized entry moves to history. The same modules in another order are the
same measurement."""
import csv
import json

import pytest

import evaluate
from engine.eval_results import EvalResults, ResultsError

EXTRA = "quant.act_max_extra_modules=[patch_embed.proj,norm]"


def evaluate_into(checkpoint, out, *argv) -> dict:
    evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "--out", str(out), *argv]))
    return json.loads(out.read_text())


def layers(path) -> set:
    with open(path) as f:
        return {row["name"] for row in csv.DictReader(f)}


def test_other_extra_modules_are_refused_untouched_and_recomputed_into_history(checkpoint, tmp_path):
    out = tmp_path / "e.json"
    first = evaluate_into(checkpoint, out)
    files = {key: tmp_path / f"e_act_max.{ext}" for key, ext in (("csv", "csv"), ("plot", "png"))}
    before = {key: path.read_bytes() for key, path in files.items()}
    text = out.read_text()
    with pytest.raises(ResultsError, match=r"holds activation maxima over quant.act_max_extra_modules=\[\], this call "
                                           r"measures them over \[\"norm\", \"patch_embed.proj\"\]: .*--recompute"):
        evaluate_into(checkpoint, out, EXTRA)
    assert out.read_text() == text and {key: path.read_bytes() for key, path in files.items()} == before

    second = evaluate_into(checkpoint, out, "--recompute", EXTRA)
    assert second["max_act"]["extra_modules"] == ["patch_embed.proj", "norm"]
    assert {"patch_embed.proj", "norm"} <= layers(files["csv"])  # the new measurement's files, in their place
    [old] = second["history"]
    kept = {key: tmp_path / f"e_act_max.replaced1.{ext}" for key, ext in (("csv", "csv"), ("plot", "png"))}
    assert old["max_act"] == {**first["max_act"], "csv": str(kept["csv"]), "plot": str(kept["plot"])}
    assert {key: path.read_bytes() for key, path in kept.items()} == before  # the old files, moved whole
    # the same modules in another order: the same measurement, neither refused nor another history entry
    third = evaluate_into(checkpoint, out, "quant.act_max_extra_modules=[norm,patch_embed.proj]")
    assert third["history"] == second["history"]


def test_without_the_files_a_recompute_moves_the_old_files_aside_and_every_later_call_works(checkpoint, tmp_path):
    """quant.act_max_csv=false writes no files, but the old maxima's files still go aside with them: left in place
    and named only in the history, a later call writing the maxima would refuse them as foreign (or write over
    them). The whole sequence: measure, replace without files, measure over those modules with files, replace
    again; every old file is kept whole and named in the history, each current one in max_act."""
    out = tmp_path / "e.json"
    names = lambda stem: {key: tmp_path / f"{stem}.{ext}" for key, ext in (("csv", "csv"), ("plot", "png"))}
    files, aside1, aside2 = names("e_act_max"), names("e_act_max.replaced1"), names("e_act_max.replaced2")
    contents = lambda paths: {key: path.read_bytes() for key, path in paths.items()}
    first = evaluate_into(checkpoint, out)
    first_files = contents(files)
    with pytest.raises(ResultsError, match="--recompute to replace them"):
        evaluate_into(checkpoint, out, EXTRA, "quant.act_max_csv=false")
    second = evaluate_into(checkpoint, out, EXTRA, "quant.act_max_csv=false", "--recompute")
    assert "csv" not in second["max_act"] and second["max_act"]["extra_modules"] == ["patch_embed.proj", "norm"]
    assert second["history"][0]["max_act"] == {**first["max_act"], **{k: str(p) for k, p in aside1.items()}}
    assert contents(aside1) == first_files and not any(path.exists() for path in files.values())

    third = evaluate_into(checkpoint, out, EXTRA)  # the same modules, now with the files: written, not refused
    assert third["history"] == second["history"] and third["max_act"]["csv"] == str(files["csv"])
    assert {"patch_embed.proj", "norm"} <= layers(files["csv"])
    third_files = contents(files)

    fourth = evaluate_into(checkpoint, out, "--recompute")  # back to the paper's modules
    assert [h["max_act"].get("csv") for h in fourth["history"]] == [str(aside1["csv"]), str(aside2["csv"])]
    assert contents(aside1) == first_files and contents(aside2) == third_files
    assert "norm" not in layers(files["csv"]) and fourth["max_act"]["csv"] == str(files["csv"])


def test_a_file_of_that_name_the_result_does_not_list_is_left_where_it_is(checkpoint, tmp_path):
    """Without the files, a CSV of the maxima's name that the result file does not list is someone else's: not
    moved aside nor named in the history; a later call writing the files still refuses it."""
    out = tmp_path / "e.json"
    evaluate_into(checkpoint, out, "quant.act_max_csv=false")
    (tmp_path / "e_act_max.csv").write_text("mine")
    second = evaluate_into(checkpoint, out, EXTRA, "quant.act_max_csv=false", "--recompute")
    assert "csv" not in second["history"][0]["max_act"] and (tmp_path / "e_act_max.csv").read_text() == "mine"
    assert not (tmp_path / "e_act_max.replaced1.csv").exists()


def test_the_result_file_keeps_replaced_maxima_once_however_often_it_is_saved(tmp_path):
    """evaluate.py saves after every pipeline: the replaced maxima are history once, not once per save."""
    path = str(tmp_path / "r.json")
    identity = {"model": "m", "fingerprint": "f"}
    results = EvalResults.open(path, identity)
    results.update(max_act={"module": 3.0, "block": 2.0})
    results.save()
    again = EvalResults.open(path, identity)
    assert again.plan_max_act([], recompute=False) is False  # the same modules (none)
    assert again.plan_max_act(["norm"], recompute=True) is True
    again.retire_max_act({})
    again.update(max_act={"module": 4.0, "block": 2.0, "extra_modules": ["norm"]})
    for _ in range(3):
        again.save()
    saved = json.loads(open(path).read())
    assert saved["max_act"]["module"] == 4.0
    assert [h["max_act"] for h in saved["history"]] == [{"module": 3.0, "block": 2.0}]


@pytest.mark.parametrize("recompute", [False, True])
def test_maxima_over_other_modules_written_meanwhile_are_refused_or_kept_in_history(checkpoint, tmp_path, monkeypatch,
                                                                                    recompute):
    """Two calls started at once both find no maxima when they plan; the one that writes second saw none to refuse.
    Its save checks again: the maxima the other wrote meanwhile (over other modules) stay, its own refused, or with
    --recompute they go to the history with their CSV and plot moved aside, as when they were written before."""
    out = tmp_path / "e.json"
    files = {key: tmp_path / f"e_act_max.{ext}" for key, ext in (("csv", "csv"), ("plot", "png"))}
    real = evaluate.save_naming_act_max_files
    meanwhile: dict = {}

    def another_call_first(*args, **kwargs):  # the other evaluate.py, run to its end between this one's plan and save
        if not meanwhile:
            monkeypatch.setattr(evaluate, "save_naming_act_max_files", real)
            meanwhile.update(evaluate_into(checkpoint, out))
            meanwhile["files"] = {key: path.read_bytes() for key, path in files.items()}
            monkeypatch.setattr(evaluate, "save_naming_act_max_files", another_call_first)
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate, "save_naming_act_max_files", another_call_first)
    if not recompute:
        with pytest.raises(ResultsError, match=r"now holds activation maxima over quant.act_max_extra_modules=\[\], "
                                               r"written by another evaluate.py .*--recompute"):
            evaluate_into(checkpoint, out, EXTRA)
        saved = json.loads(out.read_text())
        assert saved["max_act"] == meanwhile["max_act"] and "history" not in saved
        assert {key: path.read_bytes() for key, path in files.items()} == meanwhile["files"]
        return
    # a pipeline planned: --recompute alone on a file without maxima would change nothing, and is refused
    saved = evaluate_into(checkpoint, out, EXTRA, "--recompute", "--quant", "rtn", "--bits", "w8a16")
    assert saved["max_act"]["extra_modules"] == ["patch_embed.proj", "norm"]
    assert {"patch_embed.proj", "norm"} <= layers(files["csv"])
    kept = {key: tmp_path / f"e_act_max.replaced1.{ext}" for key, ext in (("csv", "csv"), ("plot", "png"))}
    [old] = saved["history"]
    assert old["max_act"] == {**meanwhile["max_act"], "csv": str(kept["csv"]), "plot": str(kept["plot"])}
    assert {key: path.read_bytes() for key, path in kept.items()} == meanwhile["files"]


def test_a_save_refuses_maxima_over_other_modules_another_writer_saved_since_the_plan(tmp_path):
    """EvalResults alone: the check runs at every save, and the maxima a writer retired itself pass."""
    path = str(tmp_path / "r.json")
    identity = {"model": "m", "fingerprint": "f"}
    first, second = EvalResults.open(path, identity), EvalResults.open(path, identity)
    assert first.plan_max_act([], recompute=False) is False and second.plan_max_act(["norm"], recompute=False) is False
    first.update(max_act={"module": 3.0, "block": 2.0})
    first.save()
    second.update(max_act={"module": 4.0, "block": 2.0, "extra_modules": ["norm"]})
    with pytest.raises(ResultsError, match=r"over quant.act_max_extra_modules=\[\], written by another"):
        second.save()
    assert json.loads(open(path).read())["max_act"] == {"module": 3.0, "block": 2.0}

    third = EvalResults.open(path, identity)  # planned after the first wrote: retires its maxima itself
    assert third.plan_max_act(["norm"], recompute=True) is True
    third.retire_max_act({})
    third.update(max_act={"module": 4.0, "block": 2.0, "extra_modules": ["norm"]})
    third.save()
    third.save()
    saved = json.loads(open(path).read())
    assert saved["max_act"]["module"] == 4.0 and [h["max_act"] for h in saved["history"]] == [
        {"module": 3.0, "block": 2.0}]
