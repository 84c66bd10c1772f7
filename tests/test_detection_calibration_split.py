"""evaluate_detection.py's quantized entries are of the training split they drew their images from: the calibration
batch (and APHQ's and GPLQ's own images) are drawn by index from train_dataloader's annotation file, so a file of
other contents at the same path (another export, another subset) draws other images. An entry computed on the old
contents is no result of the new ones: a later call refuses it, as it refuses other calibration settings.

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


def test_a_quant_entry_of_other_training_annotations_is_not_taken_as_computed(sample, tmp_path, monkeypatch):
    import engine.detection
    from engine.eval_results import ResultsError
    from evaluate_detection import main
    calls = []

    def scored(model, cfg, loader, probe_maxima=False, progress=True):  # stands for evaluate_detector: fast
        calls.append(probe_maxima)
        return {"bbox_mAP": 0.1, "segm_mAP": 0.1, "seconds": 0.0,
                **({"max_act": {"backbone": 1.0, "head": 2.0}} if probe_maxima else {})}

    monkeypatch.setattr(engine.detection, "evaluate_detector", scored)
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
