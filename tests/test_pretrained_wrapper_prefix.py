"""models/pretrained.py names what keeps a file from loading in the file's own terms: the model's weights under a
wrapper's prefix (a Lightning module's `model.`) are refused with that prefix and how to save the file without it,
and a tensor of another shape is named by its shape in the file, not the one timm's conversion resampled it to."""
import re

import pytest
import torch

from configs.schema import ModelConfig
from models import ModelError, build_model

VOCAB = {"gpt2_nano": 64}  # a language model's num_classes is its vocabulary


def model_cfg(name: str, **kw) -> ModelConfig:
    """`name` of 4 classes (a GPT: its vocabulary), without stochastic depth, with the settings `kw`."""
    return ModelConfig(name=name, num_classes=VOCAB.get(name, 4), drop_path=0.0, **kw)


def refusal(cfg: ModelConfig) -> str:
    """The one-line error of building `cfg`."""
    with pytest.raises(ModelError) as refused:
        build_model(cfg)
    message = str(refused.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("name", ["vit_nano", "swin_nano", "gpt2_nano"])
@pytest.mark.parametrize("strict", [False, True])
def test_weights_under_a_wrapper_prefix_are_refused_naming_it_and_the_advice_gives_a_file_that_loads(
        tmp_path, monkeypatch, name, strict):
    """A Lightning checkpoint: its state_dict holds model.<key> (and a loss's buffer beside it). The line names the
    prefix; the torch.save it gives, run as it is, writes a file that loads, tensor for tensor the wrapped model's.
    Without the prefix the keys must be the model's: a file that lacks one (another model) is not sent to a re-save
    that would only be refused next."""
    torch.manual_seed(0)
    wrapped = build_model(model_cfg(name)).state_dict()
    path = tmp_path / "epoch=3.ckpt"
    torch.save({"state_dict": {**{f"model.{k}": v for k, v in wrapped.items()}, "criterion.weight": torch.ones(4)},
                "epoch": 3}, path)
    message = refusal(model_cfg(name, pretrained=str(path), pretrained_strict=strict))
    assert message.startswith(f"{path} does not fit ") and "the prefix 'model.'" in message, message
    assert "'criterion.weight'" in message, message  # the key that is no part of the model, left out
    advice = re.search(r"(torch\.save\(\{.*\}, 'x\.pth'\)), and give model\.pretrained=x\.pth$", message)
    assert advice, message
    monkeypatch.chdir(tmp_path)
    eval(advice.group(1), {"torch": torch})  # noqa: S307 - the line's own advice, as a user would run it
    torch.manual_seed(1)  # another init: every tensor that equals the wrapped model's came from the file
    loaded = build_model(model_cfg(name, pretrained=str(tmp_path / "x.pth"), pretrained_strict=strict)).state_dict()
    assert loaded.keys() == wrapped.keys() and all(torch.equal(loaded[k], wrapped[k]) for k in wrapped)
    lacking = next(k for k in wrapped if "blocks.0." in k)
    torch.save({f"model.{k}": v for k, v in wrapped.items() if k != lacking}, path)
    message = refusal(model_cfg(name, pretrained=str(path), pretrained_strict=strict))
    assert "carry the prefix" not in message, message
    assert "does not fit" in message or "another architecture" in message, message  # named by its keys


def test_a_patch_embedding_of_another_shape_is_named_by_its_shape_in_the_file(tmp_path):
    """swin_nano's weights (embedding width 32, patches of 4) for swin_micro (48, patches of 2): timm's conversion
    resamples the patch embedding to 2x2 before the shapes are compared; the line gives the file's shape."""
    path = tmp_path / "swin.pth"
    torch.save(build_model(model_cfg("swin_nano")).state_dict(), path)
    in_file = tuple(torch.load(path)["patch_embed.proj.weight"].shape)
    expected = tuple(build_model(model_cfg("swin_micro")).state_dict()["patch_embed.proj.weight"].shape)
    assert in_file[0] != expected[0] and in_file[2:] != expected[2:]  # another width and another patch size
    message = refusal(model_cfg("swin_micro", pretrained=str(path)))
    assert f"'patch_embed.proj.weight' has shape {in_file}, the model expects {expected}" in message, message
