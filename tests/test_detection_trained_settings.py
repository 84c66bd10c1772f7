"""A detector checkpoint scored under other model settings than it was trained with: its weights fit the --config's
model (same shapes), but a setting that changes what the model computes (the data preprocessor's mean / std, the
attention's qk_scale, a test threshold) differs from the training config MMEngine keeps in the checkpoint. The
evaluation scores it as asked (the --config's model) and says so in one `warning:` line naming the settings.

Marked `detection`: they need MMDetection with full mmcv (scripts/install_mmcv.sh).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from detection_runs import SAMPLE_CONFIG

pytestmark = pytest.mark.detection


def _checkpoint(path, **trained):
    """The sample detector as built, saved with the training config of SAMPLE_CONFIG with the model settings
    `trained` (dotted keys under model) in its meta["cfg"], as MMEngine's Runner saves it (pretty_text)."""
    from engine.detection import load_config
    from mmdet.registry import MODELS
    cfg = load_config([SAMPLE_CONFIG])
    torch.manual_seed(0)
    state = MODELS.build(copy.deepcopy(cfg.model)).state_dict()  # as the Runner builds it: from a copy of the config
    for key, value in trained.items():
        *parents, name = f"model.{key}".split(".")
        part = cfg
        for parent in parents:
            part = part[parent]
        part[name] = value
    torch.save({"state_dict": state, "meta": {"cfg": cfg.pretty_text, "dataset_meta": {"classes": ("box", "disc")}}},
               path)
    return str(path)


@pytest.mark.parametrize("trained, named", [
    ({"data_preprocessor.mean": [0.0, 0.0, 0.0]}, "model.data_preprocessor.mean [123.675, 116.28, 103.53] (trained "
                                                  "[0.0, 0.0, 0.0])"),
    ({"backbone.qk_scale": 0.5}, "model.backbone.qk_scale None (trained 0.5)"),
    ({"test_cfg.rcnn.score_thr": 0.05, "data_preprocessor.std": [1.0, 1.0, 1.0]},
     "model.data_preprocessor.std [58.395, 57.12, 57.375] (trained [1.0, 1.0, 1.0]); model.test_cfg.rcnn.score_thr 0.0 "
     "(trained 0.05)"),
])
def test_other_model_settings_than_the_training_configs_are_named(sample, tmp_path, trained, named):
    from engine.detection import build_detector, load_config
    model = build_detector(load_config([SAMPLE_CONFIG]), _checkpoint(tmp_path / "w.pth", **trained),
                           torch.device("cpu"))
    assert model.settings_warning is not None and named in model.settings_warning, model.settings_warning
    # scored as asked: with the --config's preprocessing, not the training config's
    assert model.data_preprocessor.mean.flatten().tolist() == pytest.approx([123.675, 116.28, 103.53])


@pytest.mark.parametrize("trained", [
    {},
    # read in training only: the same detector in evaluation
    {"backbone.drop_path_rate": 0.3, "backbone.with_cp": True, "train_cfg.rcnn.sampler.num": 256,
     "backbone.init_cfg": dict(type="Pretrained", checkpoint="/weights/swin.pth"),
     "roi_head.bbox_head.loss_bbox.loss_weight": 2.0},
    {"type": "mmdet.MaskRCNN"},  # the same class, named with its scope
])
def test_a_checkpoint_of_the_same_model_settings_is_scored_without_a_warning(sample, tmp_path, trained):
    from engine.detection import build_detector, load_config
    model = build_detector(load_config([SAMPLE_CONFIG]), _checkpoint(tmp_path / "w.pth", **trained),
                           torch.device("cpu"))
    assert model.settings_warning is None, model.settings_warning
    # a checkpoint that keeps no training config (converted elsewhere) is not checked
    payload = torch.load(tmp_path / "w.pth", weights_only=False)
    torch.save({"state_dict": payload["state_dict"]}, tmp_path / "bare.pth")
    assert build_detector(load_config([SAMPLE_CONFIG]), str(tmp_path / "bare.pth"),
                          torch.device("cpu")).settings_warning is None


def test_the_evaluation_says_so_in_one_warning_line_and_scores(sample, tmp_path, capsys):
    """One warning line names the setting; the detector is scored."""
    from tests.conftest import run_entry
    other = _checkpoint(tmp_path / "other.pth", **{"data_preprocessor.mean": [0.0, 0.0, 0.0]})
    code, _, err = run_entry("evaluate_detection.py", ["--config", SAMPLE_CONFIG, "--data-root", sample, "--quant",
                                                       "--device", "cpu", "--checkpoint", other,
                                                       "--out", str(tmp_path / "other.json")], capsys)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert code == 0 and len(warnings) == 1, err[-2000:]
    assert warnings[0].startswith(f"warning: --checkpoint {other} was trained with other model settings than --config "
                                  "gives: model.data_preprocessor.mean"), warnings[0]
    assert "bbox_mAP" in json.load(open(tmp_path / "other.json"))["fp"]
