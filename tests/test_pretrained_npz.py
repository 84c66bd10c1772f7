"""A numpy .npz archive given as model.pretrained (JAX ViT weights, or arrays by parameter name) was refused with
torch's zip-reader error; it is named as such with a conversion to follow, and the conversion, run as the line
words it (timm's API for the JAX layout), gives a file that loads as the archive's weights."""
import re

import numpy as np
import pytest
import timm
import torch

from configs.schema import ModelConfig
from models import VARIANTS, ModelError, build_model

ARCH = VARIANTS["vit_nano"]["arch"]
ARGS = {**{k: v for k, v in VARIANTS["vit_nano"].items() if k != "arch"}, "num_classes": 10}


def jax_layout(model) -> dict:
    """The weights of a timm ViT in the layout of Google's JAX ViT .npz files (the inverse of timm's
    vision_transformer._load_weights): kernels HWIO / in-out, attention split into heads."""
    s = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    width = s["cls_token"].shape[-1]
    w = {"embedding/kernel": s["patch_embed.proj.weight"].transpose(2, 3, 1, 0),
         "embedding/bias": s["patch_embed.proj.bias"], "cls": s["cls_token"],
         "Transformer/posembed_input/pos_embedding": s["pos_embed"],
         "Transformer/encoder_norm/scale": s["norm.weight"], "Transformer/encoder_norm/bias": s["norm.bias"],
         "head/kernel": s["head.weight"].T, "head/bias": s["head.bias"]}
    for i, block in enumerate(model.blocks):
        heads, b, p = block.attn.num_heads, f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
        for norm, ours in (("LayerNorm_0", "norm1"), ("LayerNorm_2", "norm2")):
            w[f"{p}{norm}/scale"], w[f"{p}{norm}/bias"] = s[f"{b}{ours}.weight"], s[f"{b}{ours}.bias"]
        qkv_w, qkv_b = s[b + "attn.qkv.weight"].reshape(3, width, width), s[b + "attn.qkv.bias"].reshape(3, width)
        attn = p + "MultiHeadDotProductAttention_1/"
        for j, name in enumerate(("query", "key", "value")):
            w[f"{attn}{name}/kernel"] = qkv_w[j].T.reshape(width, heads, -1)
            w[f"{attn}{name}/bias"] = qkv_b[j].reshape(heads, -1)
        w[attn + "out/kernel"] = s[b + "attn.proj.weight"].reshape(width, heads, -1).transpose(1, 2, 0)
        w[attn + "out/bias"] = s[b + "attn.proj.bias"]
        for r in range(2):
            w[f"{p}MlpBlock_3/Dense_{r}/kernel"] = s[f"{b}mlp.fc{r + 1}.weight"].T
            w[f"{p}MlpBlock_3/Dense_{r}/bias"] = s[f"{b}mlp.fc{r + 1}.bias"]
    return w


def source():
    torch.manual_seed(0)
    return timm.create_model(ARCH, **ARGS)


def refusal(path) -> str:
    with pytest.raises(ModelError) as refused:
        build_model(ModelConfig(name="vit_nano", num_classes=10, pretrained=str(path)))
    message = str(refused.value)
    assert message.startswith(f"model.pretrained={path} is a numpy .npz archive") and "\n" not in message, message
    return message


def loads_as(path, weights: dict) -> None:
    loaded = build_model(ModelConfig(name="vit_nano", num_classes=10, pretrained=str(path),
                                     pretrained_strict=True)).state_dict()
    assert loaded.keys() == weights.keys()
    for key, value in weights.items():
        assert torch.allclose(loaded[key], value, atol=1e-6), key


def test_jax_vit_weights_are_named_with_timms_conversion_which_loads_them(tmp_path, monkeypatch):
    model = source()
    path = tmp_path / "ViT-nano.npz"
    np.savez(path, **jax_layout(model))
    message = refusal(path)
    call = re.search(r"model = (timm\.create_model\(NAME, .*?\*\*ARGS\)) with", message)
    assert call, message
    converted = eval(call.group(1), {"timm": timm, "NAME": ARCH, "ARGS": ARGS})  # the advice, as worded
    monkeypatch.chdir(tmp_path)
    assert "torch.save(model.state_dict(), 'x.pth')" in message and message.endswith("model.pretrained=x.pth")
    torch.save(converted.state_dict(), "x.pth")
    loads_as(tmp_path / "x.pth", model.state_dict())


def test_arrays_by_parameter_name_are_named_with_a_conversion_to_torch_tensors(tmp_path, monkeypatch):
    model = source()
    path = tmp_path / "w.npz"
    np.savez(path, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
    message = refusal(path)
    save = re.search(r"(torch\.save\(\{.*?'x\.pth'\))", message)
    assert save and message.endswith("give model.pretrained=x.pth"), message
    monkeypatch.chdir(tmp_path)
    exec(save.group(1), {"torch": torch, "numpy": np})  # the advice, as worded
    loads_as(tmp_path / "x.pth", model.state_dict())


def test_a_torch_file_is_no_npz_archive(tmp_path):
    """torch's own files are zip archives too (of pickles and storages): they load as before."""
    model = source()
    torch.save(model.state_dict(), tmp_path / "w.pth")
    loads_as(tmp_path / "w.pth", model.state_dict())
