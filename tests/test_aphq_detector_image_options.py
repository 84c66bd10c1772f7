"""APHQ's image options on a detector (quant/aphq/detector.py, evaluate_detection.py): its calibration batch
(--calib-images, --calib-seed) and its reconstruction images (recon_images, data_seed) are drawn apart, so neither
count bounds the other there (on a classifier the calibration set is the reconstruction set's first images); at
iters=0 no reconstruction image is drawn, so recon_images is not checked against the training split, and
recon_images / data_seed given by the user are refused as unread."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from configs.quant import APHQ_DETECTION, APHQOptions
from quant import PIPELINES
from quant.pipeline_data import PipelineData
from quant.spec import parse_bits

SAMPLE_CONFIG = "configs/detection/debug/mask_rcnn_swin_sample.py"
PREFIX = "calib_images=8 exceeds recon_images=4 (the calibration set is a prefix of the reconstruction set)"


class _Reached(Exception):
    """Raised by a stand-in for the first piece of work: every check before it passed."""


def _checks_of_main(monkeypatch, argv):
    """evaluate_detection.main up to its first piece of work (loading the config): None where every check before
    it passed, else the error."""
    pytest.importorskip("mmdet")
    import engine.detection
    from evaluate_detection import main

    def loaded(*args, **kwargs):
        raise _Reached
    monkeypatch.setattr(engine.detection, "load_config", loaded)
    try:
        main(["--config", SAMPLE_CONFIG, "--checkpoint", "unused.pth", "--quant", "aphq", "--device", "cpu", *argv])
    except _Reached:
        return None
    except ValueError as e:
        return str(e)
    raise AssertionError("main returned without loading the config")


def test_a_detectors_calibration_batch_may_exceed_its_reconstruction_set(monkeypatch):
    """`--calib-images 8` with `aphq.recon_images=4` was refused with the classifier's prefix rule, which names
    calib_images, an option evaluate_detection.py does not take."""
    assert _checks_of_main(monkeypatch, ["--calib-images", "8", "--quant-options", "aphq.recon_images=4",
                                         "aphq.iters=1"]) is None


def test_the_prefix_rule_holds_on_a_classifier_and_not_on_a_detector(monkeypatch):
    """validate: refused without `detection` (evaluate.py, the API with a classifier's data or none), passed with it;
    the API takes the task from PipelineData.detector_samples."""
    import quant.aphq.pipeline as aphq_pipeline
    options = dataclasses.replace(APHQOptions(), **{**APHQ_DETECTION, "calib_images": 8, "recon_images": 4, "iters": 1})
    aphq = PIPELINES["aphq"]
    with pytest.raises(ValueError) as error:
        aphq.validate(parse_bits("w4a4"), options)
    assert str(error.value) == PREFIX
    aphq.validate(parse_bits("w4a4"), options, detection=True)
    for data in (None, PipelineData(train_images=lambda count, seed, train: torch.zeros(count, 3, 4, 4))):
        with pytest.raises(ValueError) as error:
            aphq(nn.Linear(2, 2), None, "w4a4", options, data=data)
        assert str(error.value) == PREFIX

    def quantized(*args, **kwargs):
        raise _Reached
    monkeypatch.setattr(aphq_pipeline, "quantize_detector", quantized)
    with pytest.raises(_Reached):
        aphq(nn.Linear(2, 2), None, "w4a4", options, data=PipelineData(detector_samples=lambda count, seed: None))


class _Split:
    """A training split of `size` images that records the counts checked against it (engine/detection/feeds.py
    TrainingImages.check)."""

    def __init__(self, size: int) -> None:
        self.size, self.checked = size, []

    def check(self, count: int, flag: str) -> None:
        self.checked.append(flag)
        if count > self.size:
            raise ValueError(f"{flag} {count}: the training split has only {self.size} images")


@pytest.mark.parametrize("iters, checked", [(0, ["--calib-images"]),
                                            (1, ["--calib-images", "--quant-options aphq.recon_images"])])
def test_recon_images_is_checked_against_the_split_only_where_it_is_drawn(iters, checked):
    """aphq.iters=0 draws no reconstruction image (quant/aphq/detector.py): the default 256 against a 16-image
    split was refused though nothing would be drawn."""
    from evaluate_detection import check_image_counts, detection_defaults
    split = _Split(16)
    # as main hands them over: at iters=0 without the recipe's recon_images, which nothing reads there
    options = {"aphq": {**detection_defaults("aphq", SimpleNamespace(calib_images=1), {"iters": iters}),
                        "iters": iters}}
    if iters:
        with pytest.raises(ValueError, match=r"^--quant-options aphq.recon_images 256: the training split has only"):
            check_image_counts(split, [("aphq", "w4a4")], options, 1)
    else:
        check_image_counts(split, [("aphq", "w4a4")], options, 1)
    assert split.checked == checked


@pytest.mark.parametrize("given, named", [
    (["aphq.data_seed=7"], "aphq.data_seed=7 with aphq.iters=0: read only by the reconstruction, which iters=0 "
                           "skips (the calibration batch is --calib-images, --calib-seed); drop it")])
def test_reconstruction_image_options_given_with_zero_iterations_are_refused(monkeypatch, given, named):
    """They were recorded in the result's settings.options though iters=0 reads neither; the detection defaults
    (recon_images 256, data_seed 0) are not the user's and pass. (recon_images is refused by the config rule: the
    next test.)"""
    assert _checks_of_main(monkeypatch, ["--quant-options", *given, "aphq.iters=0"]) == (
        f"--quant-options {named}, or give aphq.iters>0")
    assert _checks_of_main(monkeypatch, ["--quant-options", "aphq.iters=0"]) is None
    assert _checks_of_main(monkeypatch, ["--quant-options", "aphq.iters=1", *given]) is None


@pytest.mark.parametrize("given", [["aphq.iters=0", "aphq.recon_images=16"],
                                   ["aphq.recon_images=16", "aphq.data_seed=7", "aphq.iters=0"]])
def test_recon_images_given_with_zero_iterations_is_refused_by_the_config_rule(monkeypatch, given):
    """--quant-options are read together by the config's rules (configs/loader.py READ_ONLY_WHEN): a recon_images
    beside aphq.iters=0, before or after it, is refused there, naming the flag, as evaluate.py refuses the
    override."""
    assert _checks_of_main(monkeypatch, ["--quant-options", *given]).startswith(
        "--quant-options aphq.recon_images=16: quant.aphq.recon_images=16 would be ignored: quant.aphq.recon_images "
        "is read only when quant.aphq.iters is above 0")
