"""A pipeline called from Python on calibration inputs its model cannot run: one ValueError naming `calib_images` and
what the model takes, before the model is copied or run.

Only N >= 1 was checked: token ids past a GPT's vocabulary met `IndexError: index out of range in self` from torch's
embedding, float ids or an image batch given to a GPT a dtype error from it, and token ids given to a ViT timm's
`ValueError: not enough values to unpack`, each from the forward of the quantized copy. RTN reads no data and is
left out (quant/README.md).
"""
import pytest
import torch

from cd_models import tiny_vit
from models.gpt import build_gpt
from quant import PIPELINES

VOCAB, CONTEXT = 65, 32  # gpt2_nano on the kjv characters
GPT_INPUTS = "calib_images: calibration inputs for a GPT are [N, T] int64 token ids < vocab_size 65, 1 <= T <= its "\
             "context 32; got "


def never_run(model):
    """A hook that fails the test if `model` (or a copy of it: deepcopy keeps hooks) runs a forward."""
    def hook(*args):
        raise AssertionError("the model ran on inputs that were to be refused")
    model.register_forward_pre_hook(hook)
    return model


@pytest.mark.parametrize("pipeline, bits", [("gptq", "w4a16"), ("smoothquant", "w8a8")])
@pytest.mark.parametrize("inputs, got", [
    (torch.rand(4, CONTEXT), "float32 [4, 32]"),
    (torch.rand(4, 3, 32, 32), "float32 [4, 3, 32, 32]"),
    (torch.randint(0, VOCAB, (4, CONTEXT + 8)), "int64 [4, 40]"),
    (torch.randint(0, VOCAB, (4, CONTEXT), dtype=torch.int16), "int16 [4, 32]"),  # the embedding takes int32 / int64
    (torch.full((4, CONTEXT), VOCAB), f"ids from {VOCAB} to {VOCAB}"),
    (torch.full((4, CONTEXT), -1), "ids from -1 to -1"),
])
def test_a_gpt_refuses_what_is_no_batch_of_its_token_ids(pipeline, bits, inputs, got):
    model = never_run(build_gpt("gpt2_nano", VOCAB).eval())
    with pytest.raises(ValueError) as e:
        PIPELINES[pipeline](model, inputs, bits)
    assert str(e.value) == GPT_INPUTS + got


@pytest.mark.parametrize("pipeline", ["repq", "percentile"])
@pytest.mark.parametrize("inputs, got", [
    (torch.randint(0, 10, (4, 16)), "int64 [4, 16]"),
    (torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8), "uint8 [4, 3, 32, 32]"),
    (torch.rand(4, 1, 32, 32), "float32 [4, 1, 32, 32]"),
])
def test_an_image_classifier_refuses_what_is_no_batch_of_its_images(pipeline, inputs, got):
    model = never_run(tiny_vit().eval())
    with pytest.raises(ValueError) as e:
        PIPELINES[pipeline](model, inputs, "w8a8")
    assert str(e.value) == ("calib_images: calibration inputs for a VisionTransformer are [N, 3, H, W] floating-point "
                            f"images; got {got}")


def test_batches_are_read_once_and_all_of_them_calibrate():
    """An iterable of batches (here a one-pass generator, of (images, labels) pairs) is read once for the check and
    once only: the calibration counts every image of it, as the one tensor of them does."""
    torch.manual_seed(0)
    images = torch.rand(6, 3, 32, 32)
    batches = ((images[i:i + 2], torch.zeros(2)) for i in range(0, 6, 2))
    model = tiny_vit().eval()
    from_batches = PIPELINES["percentile"](model, batches, "w8a8").report
    from_tensor = PIPELINES["percentile"](model, images, "w8a8").report
    assert from_batches["calibration_images"] == from_tensor["calibration_images"] == 6
    assert from_batches["layers"] == from_tensor["layers"]
