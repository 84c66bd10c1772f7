"""A PipelineData.detector_samples provider that returns fewer images than asked (a fixed pool sliced `pool[:count]`)
is refused where a detector's images are drawn (PipelineData.draw_detector_samples), naming the option that asked and
what came back, as PipelineData.draw_train_images refuses an image classifier's: APHQ reconstructed a detector on
those few, and GPLQ fitted its QwT compensation on them, while their reports recorded recon_images / stage2_images.
CPU toys (no MMDetection)."""
import dataclasses

import pytest
import torch

import quant.aphq.detector as aphq_detector
import quant.gplq.detector as gplq_detector
from configs.quant import APHQ_DETECTION, APHQOptions
from quant.pipeline_data import PipelineData
from quant.spec import QuantSpec, parse_bits
from quant_models import ImageFeed
from test_aphq_detector_parts import CalibFeed, StagedDetector, images
from test_gplq_detector_parts import _detector_options, _quantize_toy

POOL = images()  # three images


def sliced_pool(count, seed):
    return ImageFeed(POOL[:count])


def test_a_provider_is_held_to_the_count_it_was_asked_for():
    data = PipelineData(detector_samples=sliced_pool)
    assert len(data.draw_detector_samples(2, 0, "recon_images=2")) == 2
    with pytest.raises(ValueError) as e:
        data.draw_detector_samples(5, 0, "recon_images=5")
    assert str(e.value) == ("recon_images=5: PipelineData.detector_samples(5, ...) returned 3 images, not 5; give a "
                            "count the data holds, or data that holds 5 images")
    with pytest.raises(ValueError) as e:
        PipelineData(detector_samples=lambda count, seed: None).draw_detector_samples(2, 0, "stage2_images=2")
    assert str(e.value) == ("stage2_images=2: PipelineData.detector_samples(2, ...) returned a NoneType, which has no "
                            "len(); give a feed of 2 images, one per batch (a quant.units.SampleFeed: len() and "
                            "run(model, index))")


def test_each_wrong_result_gets_its_own_advice():
    """More images than asked is the provider's fault (the data held the count: asking for fewer, or for data that
    holds 2, is no fix), and an iterator has no len() at all (it holds no fewer images than asked); the advice of a
    short result fits only that."""
    with pytest.raises(ValueError) as e:
        PipelineData(detector_samples=lambda count, seed: ImageFeed(POOL[:count + 1])).draw_detector_samples(
            2, 0, "stage2_images=2")
    assert str(e.value) == ("stage2_images=2: PipelineData.detector_samples(2, ...) returned 3 images, more than the 2 "
                            "asked; the provider must return exactly the count it is given")
    with pytest.raises(ValueError, match=r"^recon_images=2: .* returned a range_iterator, which has no len\(\); give "
                                         r"a feed of 2 images, one per batch"):
        PipelineData(detector_samples=lambda count, seed: iter(range(count))).draw_detector_samples(
            2, 0, "recon_images=2")


def test_aphq_refuses_fewer_reconstruction_images_before_any_work(monkeypatch):
    monkeypatch.setattr(aphq_detector, "_quantize", lambda *a: pytest.fail("the detector was quantized"))
    options = dataclasses.replace(APHQOptions(), **{**APHQ_DETECTION, "calib_images": 1, "recon_images": 5,
                                                    "iters": 1})
    with pytest.raises(ValueError, match=r"^recon_images=5: PipelineData.detector_samples\(5, ...\) returned 3 "
                                         r"images, not 5; "):
        aphq_detector.quantize_detector(QuantSpec(linears=()), StagedDetector(), CalibFeed(POOL[:1]),
                                        parse_bits("w4a4"), options, PipelineData(detector_samples=sliced_pool))


def test_gplq_refuses_fewer_qwt_images_before_stage_1_trains():
    """QwT's images are drawn before stage 1 (an epoch of training on a detector), on the rank that runs stage 2,
    so a provider short of stage2_images ends the run before the training, not after it."""
    trained = []
    data = PipelineData(train_detector=lambda student, settings, work_dir: trained.append(1) or {"steps": 0},
                        detector_samples=sliced_pool)
    with pytest.raises(ValueError, match=r"^stage2_images=5: PipelineData.detector_samples\(5, ...\) returned 3 "
                                         r"images, not 5; "):
        _quantize_toy(_detector_options(init_images=1, stage2_images=5), CalibFeed([torch.randn(1, 4, 2, 2)]), data)
    assert trained == []


def test_gplq_fits_qwt_on_the_images_of_its_seed_drawn_before_stage_1(monkeypatch):
    """The draw moved before stage 1 asks the provider once, for (stage2_images, seed) as before, and stage 2's
    compensation fits on what that draw returned; stage 1 trains after it."""
    events, fitted = [], []

    def provider(count, seed):
        events.append(("drawn", count, seed))
        return ImageFeed(POOL[:count])

    def train(student, settings, work_dir):
        events.append("trained")
        return {"steps": 0}

    real = gplq_detector.fit_block_compensation_streamed

    def fit(model, unit, samples, reference, ridge):
        fitted.append(samples)
        return real(model, unit, samples, reference, ridge)

    monkeypatch.setattr(gplq_detector, "fit_block_compensation_streamed", fit)
    data = PipelineData(train_detector=train, detector_samples=provider)
    _quantize_toy(_detector_options(init_images=1, stage2_images=2, seed=3), CalibFeed([torch.randn(1, 4, 2, 2)]),
                  data)
    assert events == [("drawn", 2, 3), "trained"]
    assert fitted and all(len(samples) == 2 and samples.images is fitted[0].images for samples in fitted)
