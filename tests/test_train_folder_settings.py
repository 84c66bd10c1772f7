"""A folder data set's calibration batch (and APHQ's and GPLQ's own images) is drawn from its training split, which
the settings of a quantized result named by data.train_split only: the split exported again under that name (other
images, or the same names re-encoded) drew another batch, yet an entry of the old folder was reused. The settings now
name the split's files (engine/quant_settings.py train_folder_fingerprint: image paths and sizes), so such an entry
is refused (--recompute replaces it); an entry written before they were recorded is taken as of the files there now,
as a result file's val_names (refusing it would refuse every quantized entry of a folder data set written until
then). The reference: the files the test wrote and changed."""
import os

import pytest

from configs import load_config
from engine import quant_settings as qs
from engine.eval_results import EvalResults, ResultsError, evaluation_difference
from tests.conftest import DEBUG_CONFIG, make_folder


def folder_cfg(root):
    return load_config([DEBUG_CONFIG], ["data.dataset=folder", f"data.root={root}", "model.num_classes=2"])


def stored(tmp_path, pipeline: str, settings: dict) -> EvalResults:
    results = EvalResults.open(str(tmp_path / "r.json"), {"model": "vit_nano"})
    results.add(pipeline, "w4a4", {"top1": 50.0}, settings)
    results.save()
    return EvalResults.open(str(tmp_path / "r.json"), {"model": "vit_nano"})


@pytest.mark.parametrize("pipeline, part", [("percentile", "calibration"), ("aphq", "train_transform")])
def test_a_training_split_exported_again_under_its_name_is_no_longer_the_recorded_one(tmp_path, pipeline, part):
    root = tmp_path / "data"
    make_folder(root, {"train": {"a": 3, "b": 3}, "val": {"a": 1, "b": 1}})
    cfg = folder_cfg(root)
    settings = qs.quant_settings(cfg, pipeline)
    assert settings[part]["train_files"]["images"] == 6
    results = stored(tmp_path, pipeline, settings)
    assert results.plan(pipeline, "w4a4", qs.quant_settings(cfg, pipeline), recompute=False) is False

    # one image exported again under its name (another encoding, another size), in a new evaluate.py process
    image = root / "train" / "a" / "0.png"
    from PIL import Image
    Image.open(image).convert("L").save(image)
    qs._FOLDER_PRINTS.clear()
    with pytest.raises(ResultsError, match=rf"computed with other settings \({part}\.train_files"):
        results.plan(pipeline, "w4a4", qs.quant_settings(cfg, pipeline), recompute=False)
    # an image more: another count, noticed by the same process too (the class folder's listing changed)
    before = qs.quant_settings(cfg, pipeline)[part]["train_files"]
    make_folder(tmp_path / "more", {"train": {"a": 1}})
    os.replace(tmp_path / "more" / "train" / "a" / "0.png", root / "train" / "b" / "extra.png")
    os.utime(root / "train" / "b", ns=(0, 1))  # a listing time of its own, whatever the clock's resolution
    after = qs.quant_settings(cfg, pipeline)[part]["train_files"]
    assert (before["images"], after["images"]) == (6, 7) and before["files_sha256"] != after["files_sha256"]


def test_an_entry_written_before_the_files_were_recorded_is_taken_as_of_the_files_there_now(tmp_path):
    root = tmp_path / "data"
    make_folder(root, {"train": {"a": 2, "b": 2}, "val": {"a": 1, "b": 1}})
    settings = qs.quant_settings(folder_cfg(root), "percentile")
    older = {**settings, "calibration": {k: v for k, v in settings["calibration"].items() if k != "train_files"}}
    results = stored(tmp_path, "percentile", older)
    assert results.plan("percentile", "w4a4", settings, recompute=False) is False
    a, b = ({"quant": {"percentile": {"w4a4": {"settings": s}}}} for s in (older, settings))
    assert evaluation_difference(a, b) is None
    other = {**settings, "calibration": {**settings["calibration"], "train_files": {"images": 1}}}
    assert evaluation_difference(b, {"quant": {"percentile": {"w4a4": {"settings": other}}}}) is not None


def test_a_relative_root_read_from_another_folder_is_that_folders_split(tmp_path, monkeypatch):
    """The fingerprint is remembered per split listing: keyed by the path as given, `data` read from two working
    folders (scripts/sweep.py reads each command's paths in its root) took the first folder's value wherever the
    listings' times agreed. Reference: the two folders' own image counts."""
    for where, count in (("one", 2), ("two", 3)):
        make_folder(tmp_path / where / "data", {"train": {"a": count}})
        for folder in ("data/train/a", "data/train"):
            os.utime(tmp_path / where / folder, ns=(1, 1))  # the same listing times in both
    counts = []
    for where in ("one", "two"):
        monkeypatch.chdir(tmp_path / where)
        counts.append(qs.train_folder_fingerprint("data", "train")["images"])
    assert counts == [2, 3]


def test_a_result_records_the_train_files_of_its_plan_not_those_there_when_it_is_written(tmp_path, monkeypatch):
    """evaluate.py computed a result's settings again when it wrote it: a train folder changed during a long run
    (an image added after the calibration batch was drawn) made the entries record the new files beside a batch of
    the old ones. They record the settings planned. Reference: the files the test wrote, counted before the change."""
    import json

    import evaluate
    import train
    root = tmp_path / "data"
    make_folder(root, {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}})
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / 'run'}", "model.num_classes=2",
                                            "data.dataset=folder", f"data.root={root}", "train.max_steps=1",
                                            "sched.epochs=1", "sched.warmup_epochs=0", "log.tensorboard=false"]))
    planned = qs.train_folder_fingerprint(str(root), "train")
    assert planned["images"] == 16
    quantize = evaluate.evaluate_quantized

    def changing(*args, **kwargs):  # the folder exported again while the pipelines run: an image more
        if not (root / "train" / "b" / "extra.png").exists():
            make_folder(tmp_path / "more", {"train": {"a": 1}})
            os.replace(tmp_path / "more" / "train" / "a" / "0.png", root / "train" / "b" / "extra.png")
            os.utime(root / "train" / "b", ns=(0, 1))  # a listing time of its own, whatever the clock's resolution
        return quantize(*args, **kwargs)

    monkeypatch.setattr(evaluate, "evaluate_quantized", changing)
    out = tmp_path / "r.json"
    evaluate.main(evaluate.parse_args(["--checkpoint", str(tmp_path / "run" / "checkpoint.pt"), "--quant",
                                       "percentile", "--bits", "w4a4", "w8a8", "--out", str(out), "quant.calib_images=8"]))
    assert qs.train_folder_fingerprint(str(root), "train")["images"] == 17  # the change happened during the run
    entries = json.loads(out.read_text())["quant"]["percentile"]
    assert sorted(entries) == ["w4a4", "w8a8"]
    for entry in entries.values():
        assert entry["settings"]["calibration"]["train_files"] == planned
