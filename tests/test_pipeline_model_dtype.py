"""APHQ and GPLQ train float32 state on the model's weights and draw float32 images of their own: a model whose
weights are another dtype is refused before any work, naming the dtype and the fix, on a classifier and on a
detector alike. percentile / repq quantize such a model on its own calibration batch, in its dtype."""
import pytest
import torch

from device_utils import cpu_pipeline_data
from quant import PIPELINES, PipelineData
from quant_models import images, tiny_vit

APHQ = dict(iters=2, recon_images=32, calib_images=16, batch_size=16, matmul_steps=2, eq_n=32, search_rounds=1,
            log_every=1)
GPLQ = dict(steps=2, batch_size_per_gpu=8, init_images=16, pca_images=16, stage2_images=16, log_every=1,
            ckpt_every=0)


def untouched_data(detector: bool) -> tuple:
    """PipelineData whose every callable records that it was called (a refusal must come before any draw)."""
    calls = []

    def record(name):
        def call(*args):
            calls.append(name)
            raise AssertionError(f"{name} was called")
        return call

    if detector:
        data = PipelineData(detector_samples=record("detector_samples"), train_detector=record("train_detector"))
    else:
        data = PipelineData(train_images=record("train_images"), train_loader=record("train_loader"))
    return data, calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("detector", [False, True], ids=["classifier", "detector"])
@pytest.mark.parametrize("name,options", [("aphq", APHQ), ("gplq", GPLQ)])
def test_training_pipelines_refuse_weights_that_are_not_float32(name, options, detector, dtype):
    model, calib = tiny_vit().to(dtype), images(16).to(dtype)
    data, calls = untouched_data(detector)
    with pytest.raises(ValueError) as raised:
        PIPELINES[name](model, calib, "w4a4", options, data=data)
    message = str(raised.value)
    assert "\n" not in message
    assert str(dtype).removeprefix("torch.") in message and "model.float()" in message and name in message
    assert calls == []
    assert all(p.dtype == dtype for p in model.parameters())  # the caller's model is left as it was


@pytest.mark.parametrize("name", ["aphq", "gplq"])
def test_training_pipelines_name_every_dtype_of_a_mixed_model(name):
    model = tiny_vit()
    model.head.half()  # the rest stays float32, which is not named
    data, _ = untouched_data(False)
    with pytest.raises(ValueError, match=r"the model's weights are float16: ") as raised:
        PIPELINES[name](model, images(16), "w4a4", APHQ if name == "aphq" else GPLQ, data=data)
    assert "float32:" not in str(raised.value)


@pytest.mark.parametrize("name", ["percentile", "repq"])
def test_calibration_only_pipelines_quantize_a_bfloat16_model_in_its_dtype(name):
    model, calib = tiny_vit().bfloat16(), images(16).bfloat16()
    quantized, _ = PIPELINES[name](model, calib, "w4a4", None, data=cpu_pipeline_data())
    out = quantized(calib)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert all(p.dtype == torch.bfloat16 for p in quantized.parameters() if p.is_floating_point())
