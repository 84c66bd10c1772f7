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
    with pytest.raises(ValueError, match=r"^stage2_images=2: .*returned a NoneType, which holds no images, not 2; "):
        PipelineData(detector_samples=lambda count, seed: None).draw_detector_samples(2, 0, "stage2_images=2")


def test_aphq_refuses_fewer_reconstruction_images_before_any_work(monkeypatch):
    monkeypatch.setattr(aphq_detector, "_quantize", lambda *a: pytest.fail("the detector was quantized"))
    options = dataclasses.replace(APHQOptions(), **{**APHQ_DETECTION, "calib_images": 1, "recon_images": 5,
                                                    "iters": 1})
    with pytest.raises(ValueError, match=r"^recon_images=5: PipelineData.detector_samples\(5, ...\) returned 3 "
                                         r"images, not 5; "):
        aphq_detector.quantize_detector(QuantSpec(linears=()), StagedDetector(), CalibFeed(POOL[:1]),
                                        parse_bits("w4a4"), options, PipelineData(detector_samples=sliced_pool))


def test_gplq_refuses_fewer_qwt_images_before_its_compensation(monkeypatch):
    monkeypatch.setattr(gplq_detector, "quantize_weights_and_compensate",
                        lambda *a: pytest.fail("stage 2 ran on the images it was given"))
    data = PipelineData(train_detector=lambda student, settings, work_dir: {"steps": 0}, detector_samples=sliced_pool)
    with pytest.raises(ValueError, match=r"^stage2_images=5: PipelineData.detector_samples\(5, ...\) returned 3 "
                                         r"images, not 5; "):
        _quantize_toy(_detector_options(init_images=1, stage2_images=5), CalibFeed([torch.randn(1, 4, 2, 2)]), data)
