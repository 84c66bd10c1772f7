"""A quantized result on synthetic data is of the calibration (or training) images its pipeline drew from the train
split, a seeded permutation of the whole split: another data.synthetic_train_size gives other images, checked here
on the images themselves (data.loader.calibration_images), so a stored entry of the other size is no result of this
call and is refused (--recompute replaces it), while one of the same size is reused."""
import os

import pytest
import torch

from configs import load_config
from data import calibration_images
from engine.eval_results import EvalResults, ResultsError
from engine.quant_settings import quant_settings
from tests.conftest import ROOT

TINY = os.path.join(ROOT, "configs", "debug", "tiny.yaml")


def tiny(*overrides: str):
    """The tiny synthetic config (train split of 64 images) with `overrides`."""
    return load_config([TINY], list(overrides))


def stored(tmp_path, pipeline: str, settings: dict) -> EvalResults:
    """A result file holding one w4a4 entry of `pipeline` computed with `settings`."""
    results = EvalResults.open(str(tmp_path / "syn.json"), {"model": "vit_nano"})
    results.add(pipeline, "w4a4", {"top1": 50.0}, settings)
    results.save()
    return EvalResults.open(str(tmp_path / "syn.json"), {"model": "vit_nano"})


def test_another_synthetic_train_size_draws_another_calibration_batch():
    """The premise, on the images: the batch of 32 images at seed 0 differs between train splits of 64 and 40."""
    a = calibration_images(tiny().data, 32, 4, 32, 0)
    b = calibration_images(tiny("data.synthetic_train_size=40").data, 32, 4, 32, 0)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("pipeline", ["percentile", "repq", "aphq", "gplq"])
def test_an_entry_of_another_synthetic_train_size_is_refused_and_one_of_the_same_reused(tmp_path, pipeline):
    results = stored(tmp_path, pipeline, quant_settings(tiny(), pipeline))
    assert results.plan(pipeline, "w4a4", quant_settings(tiny(), pipeline), recompute=False) is False
    with pytest.raises(ResultsError, match=r"computed with other settings \(.*synthetic_train_size 64 -> 40"):
        results.plan(pipeline, "w4a4", quant_settings(tiny("data.synthetic_train_size=40"), pipeline),
                     recompute=False)
    assert results.plan(pipeline, "w4a4", quant_settings(tiny("data.synthetic_train_size=40"), pipeline),
                        recompute=True) is True


def test_an_older_entry_without_the_size_is_no_result_of_a_known_size(tmp_path):
    """An entry that did not record the train split's size may be of any size: reusing it could score another
    batch's result, so it reads as computed with other settings, as any setting it lacks."""
    settings = quant_settings(tiny(), "percentile")
    older = {**settings, "calibration": {k: v for k, v in settings["calibration"].items()
                                         if k != "synthetic_train_size"}}
    results = stored(tmp_path, "percentile", older)
    with pytest.raises(ResultsError, match=r"synthetic_train_size None -> 64"):
        results.plan("percentile", "w4a4", settings, recompute=False)
