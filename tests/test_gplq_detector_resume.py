"""A GPLQ stage 1 on a detector (engine/detection/qat.py, MMEngine's runner) resumed from one of its checkpoints ends
with the weights of the run that was never stopped: the checkpoints keep the random-number state (RoI samples,
flips) as scripts/train_detection.py's do. Without it 121 of 295 tensors differed after the resumed iteration.

Marked `detection`: they need MMDetection with full mmcv (scripts/install_mmcv.sh).
"""
from __future__ import annotations

import pytest
import torch

from detection_runs import SAMPLE_CONFIG

pytestmark = pytest.mark.detection


def _stage1(model, cfg, work_dir):
    """Two stage-1 iterations (batch 1, a checkpoint after each) of `model` in `work_dir`; the runner's result."""
    from engine.detection import train_activation_qat
    settings = {"steps": 2, "batch_size_per_gpu": 1, "lr": 1e-3, "weight_decay": 0.0, "amp": "none",
                "param_groups": [{"params": list(model.parameters())}], "log_every": 100, "ckpt_every": 1,
                "seed": 0, "identity": {"test": "resume"}}
    return train_activation_qat(model, cfg, settings, str(work_dir))


def _weights(path):
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def test_a_stage1_resumed_from_its_first_iteration_ends_bit_for_bit_where_the_uninterrupted_one_does(mmdet_ready,
                                                                                                     sample, tmp_path):
    from engine.detection import load_config
    from mmdet.registry import MODELS
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    work = tmp_path / "stage1"
    assert _stage1(model, cfg, work)["steps"] == 2
    whole = _weights(work / "iter_2.pth")
    (work / "iter_2.pth").unlink()
    (work / "last_checkpoint").write_text(str(work / "iter_1.pth"))  # as if killed after iteration 1
    # the resumed run draws after the first run's draws in this process: only the checkpoint can put them back
    resumed = _stage1(model, cfg, work)
    assert resumed["resumed"] and resumed["steps"] == 2
    again = _weights(work / "iter_2.pth")
    assert whole.keys() == again.keys()
    differ = [name for name in whole if not torch.equal(whole[name], again[name])]
    assert not differ, f"{len(differ)} of {len(whole)} tensors differ, e.g. {differ[:3]}"
