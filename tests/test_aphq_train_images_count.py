"""A PipelineData.train_images provider that returns fewer images than asked (a fixed pool sliced `pool[:count]`)
is refused where the images are drawn (PipelineData.draw_train_images), naming the option that asked and what came
back: APHQ ran its reconstruction on those few while its report recorded recon_images. GPLQ draws its
initialisation and QwT images through the same check."""
import pytest

import quant.aphq.pipeline as aphq_pipeline
import quant.gplq.pipeline as gplq_pipeline
from device_utils import cpu_pipeline_data
from quant import PIPELINES
from quant.pipeline_data import PipelineData
from quant_models import images, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")

APHQ = dict(iters=2, recon_images=8, calib_images=4, batch_size=4, matmul_steps=5, search_rounds=0, eq_n=32,
            log_every=0)
POOL = images(8, seed=7)


def sliced_pool(count, seed, train_transform):
    return POOL[:count]


@pytest.mark.parametrize("given, named", [
    ({"recon_images": 100}, r"recon_images=100 \(its first calib_images=4 the calibration set\): "
                            r"PipelineData.train_images\(100, ...\) returned a tensor of shape \[8, 3, 32, 32\], "
                            r"not 100 images \[100, C, H, W\]"),
    ({"iters": 0, "recon_images": None, "log_every": None, "calib_images": 12},  # calibration only: that set alone
     r"calib_images=12: PipelineData.train_images\(12, ...\) returned a tensor of shape \[8, 3, 32, 32\], "
     r"not 12 images \[12, C, H, W\]"),
])
def test_aphq_refuses_a_provider_with_fewer_images_before_any_work(monkeypatch, given, named):
    monkeypatch.setattr(aphq_pipeline, "calibrate_aphq", lambda *a, **k: pytest.fail("calibration reached"))
    options = {k: v for k, v in {**APHQ, **given}.items() if v is not None}
    with pytest.raises(ValueError, match=f"^{named}; give a count the data holds, or data that holds"):
        PIPELINES["aphq"](tiny_vit(), None, "w4a4", options, data=PipelineData(train_images=sliced_pool))


def test_aphq_refuses_a_provider_that_returns_no_tensor():
    with pytest.raises(ValueError, match=r"^recon_images=8 .*returned a NoneType, not 8 images"):
        PIPELINES["aphq"](tiny_vit(), None, "w4a4", APHQ, data=PipelineData(train_images=lambda *args: None))


def test_aphq_takes_a_provider_with_exactly_the_images_asked():
    _, report = PIPELINES["aphq"](tiny_vit(), None, "w4a4", APHQ, data=PipelineData(train_images=sliced_pool))
    assert (report["data"]["reconstruction_images"], report["data"]["calibration_images"]) == (8, 4)


@pytest.mark.parametrize("given, named", [({"init_images": 16}, "init_images=16"),
                                          ({"init_images": 8, "stage2_images": 16}, "stage2_images=16")])
def test_gplq_draws_through_the_same_check(monkeypatch, given, named):
    # both draws come before stage 1's training (tests/test_gplq_stage2_images_early.py)
    monkeypatch.setattr(gplq_pipeline, "run_stage1", lambda *a, **k: pytest.fail("GPLQ stage 1 reached"))
    data = cpu_pipeline_data()
    data.train_images = sliced_pool
    options = {"steps": 2, "batch_size_per_gpu": 8, "init_images": 8, "stage2_images": 8, **given}
    with pytest.raises(ValueError, match=rf"^{named}: PipelineData.train_images\(16, ...\) returned a tensor of "
                                         r"shape \[8, 3, 32, 32\]"):
        PIPELINES["gplq"](tiny_vit(), images(8), "w4a4", options, data=data)
