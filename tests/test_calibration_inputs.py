"""A pipeline called from Python on calibration inputs its model cannot run: one ValueError naming `calib_images` and
what the model takes, before the model is copied or run.

Only N >= 1 was checked: token ids past a GPT's vocabulary met `IndexError: index out of range in self` from torch's
embedding, float ids or an image batch given to a GPT a dtype error from it, and token ids given to a ViT timm's
`ValueError: not enough values to unpack`, each from the forward of the quantized copy. Then images of another
floating dtype than the weights, or of another size than a ViT / Swin fixes, passed the check and met torch's and
timm's errors there, and a hybrid ViT's images were asked to have its CNN backbone's output channels. RTN reads no
data and is left out (quant/README.md).
"""
import pytest
import timm
import torch

from cd_models import tiny_swin, tiny_vit
from models.gpt import build_gpt
from quant import PIPELINES
from quant.pipeline_base import check_calibration_inputs

VOCAB, CONTEXT = 65, 32  # gpt2_nano on the kjv characters
GPT_INPUTS = "calib_images: calibration inputs for a GPT are [N, T] int64 or int32 token ids < vocab_size 65, "\
             "1 <= T <= its context 32; got "


VIT_INPUTS = "calib_images: calibration inputs for a VisionTransformer are [N, 3, 32, 32] float32 (the dtype of its "\
             "weights) images"


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
    assert str(e.value) == f"{VIT_INPUTS}; got {got}"


@pytest.mark.parametrize("pipeline, bits", [("repq", "w8a8"), ("smoothquant", "w8a8"), ("gptq", "w4a16")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_images_of_another_dtype_than_the_weights_are_refused(pipeline, bits, dtype):
    """Images of another floating dtype than the float32 weights met torch's 'Input type (double) and bias type (float)
    should be the same' from the first convolution of the quantized copy."""
    model = never_run(tiny_vit().eval())
    with pytest.raises(ValueError) as e:
        PIPELINES[pipeline](model, torch.rand(4, 3, 32, 32, dtype=dtype), bits)
    assert str(e.value) == f"{VIT_INPUTS}; got {str(dtype).removeprefix('torch.')} [4, 3, 32, 32]"


@pytest.mark.parametrize("make", [tiny_vit, tiny_swin])
@pytest.mark.parametrize("side", [48, 16])
def test_images_of_another_size_than_the_model_fixes_are_refused(make, side):
    """timm asserts a ViT's or Swin's input size (strict_img_size: 'Input height (48) doesn't match model (32)', from
    the forward of the quantized copy); the float model itself refuses them, the reference for what it fixes."""
    model = make().eval()
    with pytest.raises(AssertionError, match="doesn't match model"):
        model(torch.rand(1, 3, side, side))
    with pytest.raises(ValueError) as e:
        PIPELINES["percentile"](never_run(model), torch.rand(4, 3, side, side), "w8a8")
    assert str(e.value) == (f"calib_images: calibration inputs for a {type(model).__name__} are [N, 3, 32, 32] float32 "
                            f"(the dtype of its weights) images; got float32 [4, 3, {side}, {side}]")


def test_a_model_that_takes_any_size_takes_images_of_another_size():
    """dynamic_img_size: the model runs on 48 px at an img_size of 32 (timm resamples its position table), so the
    pipeline calibrates on them as the float model runs on them."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                              num_classes=10, dynamic_img_size=True).eval()
    images = torch.rand(4, 3, 48, 48)
    assert model(images).shape == (4, 10)
    assert PIPELINES["percentile"](model, images, "w8a8").report["calibration_images"] == 4


def test_a_hybrid_vit_takes_images_of_its_backbone_channels():
    """A hybrid ViT's patch_embed.proj takes the CNN backbone's 64 channels, not the images': images of the 3 channels
    the float model runs on were refused as needing 64; they now pass the check, and the pipeline refuses the model for
    its own reason (no quantization rule covers the backbone's conv), as before the check."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_r_s16_p8_224", img_size=64, depth=1, num_classes=10).eval()
    images = torch.rand(2, 3, 64, 64)
    assert model(images).shape == (2, 10)
    assert model.patch_embed.proj.in_channels != 3
    with pytest.raises(ValueError, match=r"match no quantization rule: \['patch_embed\.backbone\.conv'\]"):
        PIPELINES["percentile"](model, images, "w8a8")
    with pytest.raises(ValueError, match=r"are \[N, 3, 64, 64\] float32 .* got float32 \[2, 64, 64, 64\]"):
        PIPELINES["percentile"](model, torch.rand(2, 64, 64, 64), "w8a8")


def test_a_bfloat16_model_takes_bfloat16_images():
    """The dtype asked is the weights', not float32's: a bf16 model's bf16 images pass the check (the reference: the
    float model runs on them)."""
    model = tiny_vit().eval().to(torch.bfloat16)
    images = torch.rand(2, 3, 32, 32, dtype=torch.bfloat16)
    assert model(images).dtype == torch.bfloat16
    check_calibration_inputs(model, images)
    with pytest.raises(ValueError, match=r"\[N, 3, 32, 32\] bfloat16 \(the dtype of its weights\) images; got float32"):
        check_calibration_inputs(model, images.float())


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
