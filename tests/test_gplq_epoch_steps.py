"""GPLQ's stage 1 at quant.gplq.steps=null runs one epoch of the training loader: the report's options record the
number of updates that epoch held (the split's size is known only once the loader is built), not the null; a
detector's likewise (its loader's length)."""
import pytest
import torch

from configs.quant import GPLQOptions
from device_utils import cpu_pipeline_data
from quant import PIPELINES
from quant.pipeline_data import PipelineData
from quant_models import images, tiny_vit
from test_aphq_detector_parts import CalibFeed
from test_gplq_detector_parts import _detector_options, _quantize_toy

pytestmark = pytest.mark.usefixtures("one_thread")


def test_one_epoch_records_the_updates_it_ran():
    options = GPLQOptions(steps=None, batch_size_per_gpu=4, init_images=4, qwt=False, pca_weight=0)
    _, report = PIPELINES["gplq"](tiny_vit(), images(4), "w4a4", options, data=cpu_pipeline_data(num_images=14))
    epoch = 14 // 4  # the reference: one epoch of full batches (the loader drops the last partial one)
    assert report["stage1"]["steps"] == epoch
    assert report["options"]["steps"] == epoch


def test_steps_given_stay_as_given():
    options = GPLQOptions(steps=2, batch_size_per_gpu=4, init_images=4, qwt=False, pca_weight=0)
    _, report = PIPELINES["gplq"](tiny_vit(), images(4), "w4a4", options, data=cpu_pipeline_data(num_images=14))
    assert report["options"]["steps"] == 2 == report["stage1"]["steps"]


def test_a_detector_records_the_iterations_its_epoch_ran():
    """The detector's stage 1 (engine/detection/qat.py) runs the loader's length at steps null and reports it."""
    data = PipelineData(train_detector=lambda student, settings, work_dir: {"steps": 7})  # an epoch of 7 images
    _, report = _quantize_toy(_detector_options(init_images=1, steps=None, qwt=False),
                              CalibFeed([torch.randn(1, 4, 2, 2)]), data)
    assert report["options"]["steps"] == 7 == report["stage1"]["steps"]
