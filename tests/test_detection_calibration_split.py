"""evaluate_detection.py's quantized entries are of the training split they drew their images from: the calibration
batch (and APHQ's and GPLQ's own images) are drawn by index from train_dataloader's annotation file, so a file of
other contents at the same path (another export, another subset) draws other images. An entry computed on the old
contents is no result of the new ones: a later call refuses it, as it refuses other calibration settings, and GPLQ's
stage-1 folder trained on them is not resumed.

Marked `detection`: they need MMDetection with full mmcv (scripts/install_mmcv.sh).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from detection_runs import SAMPLE_CONFIG  # its fixture (sample) comes through conftest.py

pytestmark = pytest.mark.detection


def _random_detector(tmp_path):
    """A checkpoint of the sample detector at its initial weights (the scores are stubbed below)."""
    from engine.detection import load_config
    from mmdet.registry import MODELS
    torch.manual_seed(0)
    path = tmp_path / "random.pth"
    torch.save({"state_dict": MODELS.build(load_config([SAMPLE_CONFIG]).model).state_dict(),
                "meta": {"dataset_meta": {"classes": ("box", "disc")}}}, path)
    return str(path)


def _stub_scores(monkeypatch, calls: list) -> None:
    """evaluate_detector replaced by a fast stand-in that records whether each call probed the maxima."""
    import engine.detection

    def scored(model, cfg, loader, probe_maxima=False, progress=True):
        calls.append(probe_maxima)
        return {"bbox_mAP": 0.1, "segm_mAP": 0.1, "seconds": 0.0,
                **({"max_act": {"backbone": 1.0, "head": 2.0}} if probe_maxima else {})}

    monkeypatch.setattr(engine.detection, "evaluate_detector", scored)


def test_a_quant_entry_of_other_training_annotations_is_not_taken_as_computed(sample, tmp_path, monkeypatch):
    from engine.eval_results import ResultsError
    from evaluate_detection import main
    calls = []
    _stub_scores(monkeypatch, calls)
    root = tmp_path / "coco"
    shutil.copytree(sample, root)
    out = tmp_path / "eval.json"
    argv = ["--config", SAMPLE_CONFIG, "--checkpoint", _random_detector(tmp_path), "--data-root", str(root),
            "--out", str(out), "--quant", "percentile", "--bits", "w4a4"]
    main(argv)
    assert calls == [True, False]
    main(argv)  # the same split: the entry is the result asked for, not computed again
    assert calls == [True, False]

    train = root / "annotations" / "instances_train2017.json"
    contents = json.loads(train.read_text())
    contents["images"] = contents["images"][::-1]  # image 0 of the split, drawn by index, is another file now
    train.write_text(json.dumps(contents))
    with pytest.raises(ResultsError, match="computed with other settings .*train_annotations_sha256"):
        main(argv)
    assert calls == [True, False]

    # an entry written before the contents were recorded is taken as of the split there now (as a classifier's
    # entry without its train_files): refusing it would refuse every detector entry written until then
    data = json.loads(out.read_text())
    del data["quant"]["percentile"]["w4a4"]["settings"]["train_annotations_sha256"]
    out.write_text(json.dumps(data))
    main(argv)
    assert calls == [True, False]
    assert os.path.exists(out)


@pytest.mark.slow  # GPLQ's stage 1 and QwT on the sample detector: 32 s under load
def test_a_gplq_stage1_folder_of_other_training_annotations_is_not_resumed(sample, tmp_path, monkeypatch):
    """The stage-1 folder's identity held the calibration images' indices but not the file they index: a stage 1
    cut off before its result was written resumed (or, once finished, was taken as it was) on a training split
    exported again at the same path (here each object's class swapped: other targets, the same images). It is
    refused before the full-precision score, the folder left as it is."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    _stub_scores(monkeypatch, [])
    root = tmp_path / "coco"
    shutil.copytree(sample, root)
    out = tmp_path / "eval.json"
    argv = ["--config", SAMPLE_CONFIG, "--checkpoint", _random_detector(tmp_path), "--data-root", str(root),
            "--out", str(out), "--quant", "gplq", "--quant-options", "gplq.steps=1", "gplq.stage2_images=1",
            "gplq.lr=0.001"]
    assert main(argv)["quant"]["gplq"]["w4a4"]["stage1"]["resumed"] is False
    data = json.loads(out.read_text())
    del data["quant"]["gplq"]  # as if the run stopped after stage 1, before its result was written
    out.write_text(json.dumps(data))
    train = root / "annotations" / "instances_train2017.json"
    contents = json.loads(train.read_text())
    for box in contents["annotations"]:
        box["category_id"] = 3 - box["category_id"]  # box (1) <-> disc (2)
    train.write_text(json.dumps(contents))
    folder = tmp_path / "eval_gplq_w4a4_stage1"
    before = sorted((p, p.read_bytes()) for p in folder.rglob("*") if p.is_file())  # MMEngine's log folders too
    with pytest.raises(DetectionError, match=rf"^{folder} holds GPLQ stage 1 of another run"):
        main(argv)
    assert sorted((p, p.read_bytes()) for p in folder.rglob("*") if p.is_file()) == before
