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


def _stage1(model, cfg, work_dir, steps=2, batch=1):
    """`steps` stage-1 iterations (at `batch`, a checkpoint after each) of `model` in `work_dir`; the runner's
    result."""
    from engine.detection import train_activation_qat
    settings = {"steps": steps, "batch_size_per_gpu": batch, "lr": 1e-3, "weight_decay": 0.0, "amp": "none",
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


@pytest.mark.slow  # 12 to 17 CPU seconds each (47 to 58 s on two cores under load), beside the module's detection mark
@pytest.mark.parametrize("workers, persistent", [(0, False), (1, False), (1, True)])
def test_a_stage1_resumed_past_an_epoch_s_end_ends_where_the_uninterrupted_one_does_and_says_so(
        mmdet_ready, sample, tmp_path, monkeypatch, workers, persistent):
    """MMEngine's iteration loop fetches the batches trained before the checkpoint again to reach its position,
    which drew in this process after the restored state: the augmentations at num_workers=0 (111 of 115 tensors
    differed), a new iterator's seed at the loader's end with a worker that is not persistent (93 of 115). The state
    is put back after that fetch now. Persistent workers (the paper configs') were exact, yet every resume warned
    that they start over from their first seeds: they fetch the trained batches again from those seeds too. Stage 1
    at batch 4 over the 8 sample images (2 iterations an epoch), resumed after iteration 3."""
    import engine.detection.rng_state as rng_state
    from engine.detection import load_config
    from mmdet.registry import MODELS
    limits = []
    monkeypatch.setattr(rng_state, "inexact_resume",
                        lambda *a, _named=rng_state.inexact_resume, **k: limits.append(_named(*a, **k)) or limits[-1])
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    cfg.train_dataloader.num_workers, cfg.train_dataloader.persistent_workers = workers, persistent
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    work = tmp_path / "stage1"
    _stage1(model, cfg, work, steps=4, batch=4)
    whole = _weights(work / "iter_4.pth")
    (work / "iter_4.pth").unlink()
    (work / "last_checkpoint").write_text(str(work / "iter_3.pth"))  # as if killed after iteration 3
    assert _stage1(model, cfg, work, steps=4, batch=4)["resumed"]
    again = _weights(work / "iter_4.pth")
    differ = [name for name in whole if not torch.equal(whole[name], again[name])]
    assert not differ, f"{len(differ)} of {len(whole)} tensors differ, e.g. {differ[:3]}"
    assert limits == [[]]
