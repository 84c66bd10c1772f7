"""Nothing lost: a second evaluate.py call into one result file that measures the activation maxima over other
quant.act_max_extra_modules (another maximum, not the same one again) is refused before any pass, the file and its
CSV and plot untouched; with --recompute the old maxima move to the file's history with their CSV and plot, moved
aside and named there, as a recomputed quantized entry moves to history. The same modules in another order are the
same measurement."""
import csv
import json

import pytest

import evaluate
import train
from configs import load_config
from engine.eval_results import EvalResults, ResultsError
from tests.conftest import DEBUG_CONFIG

EXTRA = "quant.act_max_extra_modules=[patch_embed.proj,norm]"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={out}", "train.max_steps=1", "sched.warmup_epochs=0",
                                            "log.tensorboard=false"]))
    return str(out / "best.pt")


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


def test_without_the_files_a_recompute_keeps_the_old_files_where_they_are(checkpoint, tmp_path):
    out = tmp_path / "e.json"
    first = evaluate_into(checkpoint, out)
    csv_text = (tmp_path / "e_act_max.csv").read_text()
    with pytest.raises(ResultsError, match="--recompute to replace them"):
        evaluate_into(checkpoint, out, EXTRA, "quant.act_max_csv=false")
    second = evaluate_into(checkpoint, out, EXTRA, "quant.act_max_csv=false", "--recompute")
    # the new maxima list no files (those there are of the old ones), which history names where they still lie
    assert "csv" not in second["max_act"] and second["max_act"]["extra_modules"] == ["patch_embed.proj", "norm"]
    assert second["history"][0]["max_act"] == first["max_act"]
    assert (tmp_path / "e_act_max.csv").read_text() == csv_text


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
