"""A weights file of integer (or bool) tensors where the model's are floating point, e.g. the int8 codes of a
quantized model saved without their scales, is one error line naming a key and its dtype, under fine-tuning and
evaluation alike: torch's load_state_dict would cast the codes to weights (57 -> 57.0) without a word. Weights at a
lower floating-point precision load, and integer buffers the model rebuilds are no such tensors."""
import re

import pytest
import torch
from safetensors.torch import save_file

from configs.schema import ModelConfig
from models import ModelError, build_model

from test_pretrained_other_architecture import official_layout


def vit_state() -> dict:
    """vit_nano's own weights (4 classes), as a file of it holds them."""
    return build_model(ModelConfig(name="vit_nano", num_classes=4)).state_dict()


def assert_refused_as_codes(path, name: str, file_dtype: dict, own: dict, **cfg) -> None:
    """Loading `path` into the model `name` is refused in one line naming one of the file's non-floating tensors,
    with its dtype (the file's, `file_dtype`) and the model's (`own`), and saying what to do."""
    for strict in (False, True):
        with pytest.raises(ModelError) as refused:
            build_model(ModelConfig(name=name, num_classes=4, pretrained=str(path), pretrained_strict=strict, **cfg))
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"model.pretrained={path}: "), message
        key = re.search(r": '([^']+)' is ", message).group(1)
        assert key in file_dtype and not file_dtype[key].is_floating_point, message
        assert f"'{key}' is {file_dtype[key]}, the model's {own[key].dtype}" in message, message
        assert "quantized codes without their scales are not weights: dequantize first" in message, message


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("suffix", ["safetensors", "pt"])
def test_an_integer_weights_file_is_refused_naming_a_key_and_its_dtype(tmp_path, dtype, suffix):
    """The reviewer's file: every tensor as int8 codes (round(100 w), clamped); other integer dtypes and bool too,
    safetensors and torch files alike. Before, it loaded as integer-valued weights, rc 0, even under strict."""
    own = vit_state()
    lo, hi = (0, 255) if dtype == torch.uint8 else (-128, 127)
    codes = {k: (v * 100).round().clamp(lo, hi).to(dtype) for k, v in own.items()}
    path = tmp_path / f"int.{suffix}"
    if suffix == "safetensors":
        save_file(codes, str(path))
    else:
        torch.save({"model": codes}, path)
    assert_refused_as_codes(path, "vit_nano", {k: v.dtype for k, v in codes.items()}, own)


def test_one_integer_tensor_among_float_weights_is_refused(tmp_path):
    """A single tensor of codes is enough: the model would be scored with that one layer's weights off by the
    scale, no better than all of them."""
    state = vit_state()
    state["blocks.1.mlp.fc2.weight"] = (state["blocks.1.mlp.fc2.weight"] * 100).round().to(torch.int8)
    path = tmp_path / "one.pth"
    torch.save(state, path)
    assert_refused_as_codes(path, "vit_nano", {k: v.dtype for k, v in state.items()}, vit_state())


def test_codes_under_an_official_key_layout_are_refused_under_the_models_name(tmp_path):
    """microsoft/Swin-Transformer's layout names the classifier `head`, which timm's conversion renames to the
    model's `head.fc`: the codes are found after the conversion too."""
    own = build_model(ModelConfig(name="swin_nano", num_classes=4)).state_dict()
    state = official_layout(own)
    assert "head.weight" in state and "head.weight" not in own
    state["head.weight"] = (state["head.weight"] * 100).round().to(torch.int8)
    path = tmp_path / "swin.pth"
    torch.save({"model": state}, path)
    assert_refused_as_codes(path, "swin_nano", {"head.fc.weight": torch.int8}, own)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_weights_of_another_floating_point_precision_load_as_their_values(tmp_path, dtype):
    """float16 / bfloat16 (and float64) files are weights: they load, each parameter the file's value in the
    model's float32 (the exact widening of the file's numbers)."""
    state = {k: v.to(dtype) for k, v in vit_state().items()}
    path = tmp_path / "half.safetensors"
    save_file(state, str(path))
    for strict in (False, True):
        model = build_model(ModelConfig(name="vit_nano", num_classes=4, pretrained=str(path),
                                        pretrained_strict=strict))
        for key, value in model.state_dict().items():
            assert value.dtype == torch.float32 and torch.equal(value, state[key].float()), key


def test_the_models_integer_buffers_in_a_file_load(tmp_path):
    """A Swin file that holds its relative_position_index buffers (int64, as older files do): integers where the
    model's buffer is an integer one, which the model rebuilds; the weights load as they are."""
    model = build_model(ModelConfig(name="swin_nano", num_classes=4))
    state = model.state_dict()
    indices = {k: v for k, v in model.named_buffers() if k.endswith("relative_position_index")}
    assert indices and all(v.dtype == torch.int64 for v in indices.values())
    path = tmp_path / "swin.pth"
    torch.save({**state, **indices}, path)
    loaded = build_model(ModelConfig(name="swin_nano", num_classes=4, pretrained=str(path), pretrained_strict=True))
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in state.items())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_float8_weights_file_loads_as_its_values_and_one_holding_nan_is_refused(tmp_path, dtype):
    """float8 tensors are floating point, weights at a lower precision as float16's are: they load as their exact
    values. Before, the check for NaN / inf values before loading (models/modules.py's nonfinite_tensors) called
    torch.isfinite, which torch has not for float8: a NotImplementedError traceback, not loaded nor refused. A
    float8 file holding a NaN is refused in one line as any other."""
    state = {k: v.to(dtype) for k, v in vit_state().items()}
    path = tmp_path / "fp8.safetensors"
    save_file(state, str(path))
    model = build_model(ModelConfig(name="vit_nano", num_classes=4, pretrained=str(path), pretrained_strict=True))
    for key, value in model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, state[key].float()), key
    state["head.bias"] = torch.full_like(state["head.bias"], float("nan"))
    save_file(state, str(path))
    with pytest.raises(ModelError, match=r"hold NaN or inf values, e\.g\. head\.bias \(4 NaN, 0 inf of 4 values\)"):
        build_model(ModelConfig(name="vit_nano", num_classes=4, pretrained=str(path)))
