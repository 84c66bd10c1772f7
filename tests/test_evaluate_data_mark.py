"""A checkpoint scored on other data or through another eval transform than its run's is marked † in every table,
with a note naming the setting and both values (engine/result_table.data_changed): another data.dataset, a
data.crop_pct / mean / interpolation (or a language model's data.val_windows) override, a data.root whose val split
holds other files than the run validated on (the same files under a moved root are the same data). A checkpoint
that records its classes is refused on synthetic images (no classes: noise with random labels). Was: a plain row,
e.g. a digits ViT's 12.3 % top-1 on synthetic noise, or its top-1 at data.crop_pct=0.5 beside the recipe's."""
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

import evaluate
import train
from configs import load_config
from data import DataError
from engine import result_table
from tests.conftest import DEBUG_CONFIG, load_script, make_folder


def _evaluate(checkpoint, out, *overrides):
    evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "--out", str(out), *overrides]))
    with open(out) as f:
        saved = json.load(f)
    return saved, result_table.markdown_table([saved]).splitlines()[2:]


def test_a_digits_checkpoint_scored_at_another_crop_is_marked_and_as_trained_is_not(checkpoint, tmp_path):
    trained = torch.load(checkpoint, map_location="cpu", weights_only=False)["config"]["data"]["crop_pct"]
    _, lines = _evaluate(checkpoint, tmp_path / "plain.json")
    assert lines[0].startswith("| vit_nano | Baseline |") and len(lines) == 1  # no mark, no note
    saved, lines = _evaluate(checkpoint, tmp_path / "crop.json", "data.crop_pct=0.5")
    assert saved["data"]["eval_transform"]["crop_pct"] == 0.5  # the override ran
    assert lines[0].startswith("| vit_nano† | Baseline |")
    assert lines[-1] == f"† vit_nano Baseline: evaluated with data.crop_pct=0.5 (trained with {trained})"


def test_a_checkpoint_that_records_its_classes_is_refused_on_synthetic_images(checkpoint, tmp_path):
    classes = torch.load(checkpoint, map_location="cpu", weights_only=False)["classes"]
    assert classes == [str(i) for i in range(10)]
    out = tmp_path / "r.json"
    with pytest.raises(DataError, match=r"best.pt was trained on 10 classes \(0, 1, 2, \.\.\.\), "
                                        r"data.dataset=synthetic has none"):
        evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "--out", str(out),
                                           "data.dataset=synthetic"]))
    assert not out.exists()


@pytest.mark.parametrize("name", ["checkpoint.pt", "best.pt"])
def test_a_val_folder_of_other_images_is_marked_and_the_same_folder_moved_is_not(tmp_path, name):
    """data.root may move between machines: the same val images under another root are the run's data; a root
    whose val split holds other images (as many, other names) is other data. checkpoint.pt and best.pt record the
    run's data fingerprint (was: best.pt none, so its results were not compared)."""
    make_folder(tmp_path / "data", {"train": {"a": 8, "b": 8}, "val": {"a": 3, "b": 3}})
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / 'run'}", "model.num_classes=2",
                                            "data.dataset=folder", f"data.root={tmp_path / 'data'}",
                                            "train.max_steps=1", "sched.epochs=1", "sched.warmup_epochs=0",
                                            "log.tensorboard=false"]))
    checkpoint = str(tmp_path / "run" / name)
    shutil.copytree(tmp_path / "data", tmp_path / "moved")
    _, lines = _evaluate(checkpoint, tmp_path / "moved.json", f"data.root={tmp_path / 'moved'}")
    assert len(lines) == 1 and lines[0].startswith("| vit_nano | Baseline |"), lines
    make_folder(tmp_path / "other", {"val": {"a": 3, "b": 3}})
    for name in ("a", "b"):  # as many images, by other names
        for i in range(3):
            folder = tmp_path / "other" / "val" / name
            os.rename(folder / f"{i}.png", folder / f"x{i}.png")
    _, lines = _evaluate(checkpoint, tmp_path / "other.json", f"data.root={tmp_path / 'other'}")
    assert lines[0].startswith("| vit_nano† | Baseline |")
    assert lines[-1] == (f"† vit_nano Baseline: evaluated with data.root={tmp_path / 'other'} (its val split: "
                         f"6 images of other names than the 6 the run validated on under {tmp_path / 'data'})")


def _digits(**data):
    """A result of a digits run trained with the recipe's eval transform, scored with `data`'s settings."""
    transform = {"img_size": 32, "crop_pct": 1.0, "crop_mode": "center", "interpolation": "bicubic",
                 "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "digits_img_size": 32, "digits_val_fraction": 0.2}
    recipe = {"data.dataset": "digits", **{f"data.{k}": v for k, v in transform.items() if k != "img_size"}}
    scored = {k: data.pop(k) for k in list(data) if k in transform}
    return {"model": "m", "method": "Baseline", "recipe": recipe,
            "data": {"dataset": "digits", "root": "", "val_split": "val", **data,
                     "eval_transform": {**transform, **scored}}}


@pytest.mark.parametrize("setting, value, text, trained", [
    ("mean", [0.485, 0.456, 0.406], "[0.485, 0.456, 0.406]", "[0.5, 0.5, 0.5]"),
    ("std", [0.25, 0.25, 0.25], "[0.25, 0.25, 0.25]", "[0.5, 0.5, 0.5]"),
    ("interpolation", "bilinear", "bilinear", "bicubic"),
    ("digits_img_size", 28, "28", "32"),
    ("crop_mode", "squash", "squash", "center")])
def test_each_eval_transform_setting_is_named_with_both_values(setting, value, text, trained):
    assert result_table.evaluated_otherwise(_digits(**{setting: value})) == \
        f"data.{setting}={text} (trained with {trained})"


def test_another_data_set_is_named_alone_and_results_without_a_recipe_are_not_compared():
    other = _digits(crop_pct=0.5)
    other["data"] = {"dataset": "synthetic", "root": "", "val_split": "val", "eval_transform": {}}
    assert result_table.evaluated_otherwise(other) == "data.dataset=synthetic (trained on digits)"
    assert result_table.evaluated_otherwise(_digits()) is None
    assert result_table.evaluated_otherwise(_digits(crop_pct=1)) is None  # 1 == 1.0: the recipe's crop
    weights_file = _digits(crop_pct=0.5)
    del weights_file["recipe"]  # a model.pretrained file, an older result: what it trained with is not known
    assert result_table.evaluated_otherwise(weights_file) is None


def test_a_language_models_other_val_windows_and_token_file_are_named():
    def result(windows, file, fingerprint):
        return {"model": "gpt", "method": "Baseline", "recipe": {"data.dataset": "tokens", "data.val_windows": 64},
                "trained_data": {"root": "/corpus", "fingerprint": fingerprint},
                "data": {"dataset": "tokens", "val_windows": windows, "root": "/moved", "val_split": "val",
                         "val_file": file}}

    same = {"bytes": 100, "head_sha256": "a"}
    assert result_table.evaluated_otherwise(result(64, same, {"val.bin": dict(same)})) is None  # moved, same file
    assert result_table.evaluated_otherwise(result(64, same, None)) is None  # a checkpoint without the record
    assert result_table.evaluated_otherwise(result(0, {"bytes": 100, "head_sha256": "b"}, {"val.bin": same})) == (
        "data.val_windows=0 (trained with 64); data.root=/moved (its val.bin: other tokens than the file of as many "
        "bytes the run validated on under /corpus)")
    assert result_table.evaluated_otherwise(result(64, {"bytes": 50, "head_sha256": "a"}, {"val.bin": same})) == (
        "data.root=/moved (its val.bin: 50 bytes, not the file of 100 the run validated on under /corpus)")


def test_the_sweep_reports_and_paper_table_mark_it_too():
    crop = dict(_digits(crop_pct=0.5), checkpoint="cd/best.pt", method="CD", fp={"top1": 80.0},
                quant={"repq": {"w4a4": {"top1": 60.0}}})
    labels, notes = load_script("dose_report").evaluated_marks({"1x": [SimpleNamespace(result=crop)]})
    assert labels == {"1x": "1x†"} and notes == ["† 1x: evaluated with data.crop_pct=0.5 (trained with 1.0)"]
    table = load_script("paper_table").finetune_table([crop]).splitlines()
    assert "| digits | 80.00 / 60.00 / -20.00† |" in table
    assert "† digits CD: evaluated with data.crop_pct=0.5 (trained with 1.0)" in table


@pytest.mark.parametrize("dataset", ["synthetic", "digits", "folder", "kjv", "tokens"])
def test_a_result_records_every_validation_setting_its_data_set_reads(dataset, monkeypatch):
    """engine.run_dir.VALIDATION_KEYS are the settings that choose the validation set; those the data set reads (the
    config's rules, configs/loader.py) are what a result's data must hold for the tables to compare it with its run.
    data.synthetic_val_size was not recorded: a run validated on 16 synthetic images scored on 32 got no mark."""
    from configs import Config
    from configs.loader import unread_by_rules
    from engine.run_dir import VALIDATION_KEYS

    monkeypatch.setattr(evaluate, "token_file_fingerprint", lambda data, split: {"bytes": 1, "head_sha256": "a"})
    cfg = Config()
    cfg.data.dataset = dataset
    unread = {key for key, *_ in unread_by_rules(cfg, VALIDATION_KEYS)}
    data = evaluate.data_identity(cfg.data, 32)
    recorded = {**data, **(data.get("eval_transform") or {})}
    for key in VALIDATION_KEYS:
        if key not in unread:
            name = key.split(".", 1)[1]
            assert name in recorded, (dataset, key)
            assert json.dumps(recorded[name]) == json.dumps(getattr(cfg.data, name)), (dataset, key)


def test_a_synthetic_run_scored_on_another_val_size_is_marked(tmp_path):
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / 'run'}", "train.max_steps=1", "sched.epochs=1",
                                            "sched.warmup_epochs=0", "log.tensorboard=false"]))
    checkpoint = str(tmp_path / "run" / "best.pt")
    trained = torch.load(checkpoint, map_location="cpu", weights_only=False)["config"]["data"]["synthetic_val_size"]
    _, lines = _evaluate(checkpoint, tmp_path / "same.json")
    assert len(lines) == 1 and lines[0].startswith("| vit_nano | Baseline |"), lines
    saved, lines = _evaluate(checkpoint, tmp_path / "more.json", f"data.synthetic_val_size={2 * trained}")
    assert saved["images"] == 2 * trained  # the override ran
    assert lines[0].startswith("| vit_nano† | Baseline |")
    assert lines[-1] == f"† vit_nano Baseline: evaluated with data.synthetic_val_size={2 * trained} (trained with " \
                        f"{trained})"


def _old_synthetic(images: int) -> dict:
    """A synthetic result as evaluate.py wrote it before its data recorded data.synthetic_val_size."""
    return {"model": "vit_nano", "method": "Baseline", "images": images, "fp": {"top1": 25.0},
            "max_act": {"module": 1.0, "block": 1.0}, "quant": {},
            "recipe": {"data.dataset": "synthetic", "data.synthetic_val_size": 16},
            "data": {"dataset": "synthetic", "root": "", "val_split": "val", "eval_transform": {}}}


def test_an_older_synthetic_result_is_compared_by_its_image_count(tmp_path):
    """A file without data.synthetic_val_size is read with its image count (the synthetic val split is that many
    images): marked where that is not the run's size only, and taken by evaluate.py as the same data."""
    from engine.eval_results import EvalResults, evaluation_difference, read_result_file

    assert result_table.evaluated_otherwise(_old_synthetic(32)) is None  # read as it is: nothing to compare
    paths = {}
    for images in (16, 32):
        paths[images] = tmp_path / f"{images}.json"
        paths[images].write_text(json.dumps(_old_synthetic(images)))
    assert result_table.evaluated_otherwise(read_result_file(str(paths[16]))) is None
    assert result_table.evaluated_otherwise(read_result_file(str(paths[32]))) == \
        "data.synthetic_val_size=32 (trained with 16)"
    new = {**_old_synthetic(16), "data": {**_old_synthetic(16)["data"], "synthetic_val_size": 16}}
    assert evaluation_difference(read_result_file(str(paths[16])), new) is None
    identity = {k: new[k] for k in ("model", "images", "data")}
    assert EvalResults.open(str(paths[16]), identity).data["data"] == new["data"]
