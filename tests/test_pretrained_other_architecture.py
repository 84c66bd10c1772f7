"""Weights of another architecture than the model's are one error line naming what differs, not a traceback from
inside timm's conversion: a Swin of other depths or stage counts (timm's and the official key layout), a position
table of another rank."""
import ast
import re

import pytest
import timm
import torch

from configs.schema import ModelConfig
from models import ModelError, build_model


def swin_weights(depths: tuple, heads: tuple) -> dict:
    """A swin_nano-like Swin (32 pixels, patches of 4, windows of 4, width 32) of other depths / stages."""
    return timm.create_model("swin_tiny_patch4_window7_224", img_size=32, patch_size=4, window_size=4, embed_dim=32,
                             depths=depths, num_heads=heads, num_classes=10).state_dict()


def official_layout(state: dict) -> dict:
    """microsoft/Swin-Transformer's key layout: patch merging at the end of a stage, the classifier named `head`."""
    renamed = {}
    for key, value in state.items():
        key = re.sub(r"layers\.(\d+)\.downsample", lambda m: f"layers.{int(m.group(1)) - 1}.downsample", key)
        renamed[key.replace("head.fc.", "head.")] = value
    return renamed


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("layout", ["timm", "official"])
@pytest.mark.parametrize("depths, heads", [((2, 2), (2, 4)), ((1, 1, 1), (2, 4, 8))])
def test_a_swin_file_of_other_depths_or_stages_is_one_error_line_naming_the_keys_the_model_lacks(
        tmp_path, depths, heads, layout, strict):
    """swin_nano has depths (1, 1): a file of (2, 2) (swin_small's weights for swin_tiny) or of three stages ended
    in timm's filter with "AttributeError: Sequential has no attribute '1'". The keys named are keys of the file
    that the model lacks, in timm's layout whatever the file's (the set difference of the two state dicts), not
    renamed downsample or head keys."""
    source = swin_weights(depths, heads)
    own = build_model(ModelConfig(name="swin_nano", num_classes=10)).state_dict()
    extra = set(source) - set(own)
    assert extra and not set(own) - set(source)  # the file holds the whole model, and more
    path = tmp_path / "swin.pth"
    torch.save({"model": source if layout == "timm" else official_layout(source)}, path)
    with pytest.raises(ModelError) as refused:
        build_model(ModelConfig(name="swin_nano", num_classes=10, pretrained=str(path), pretrained_strict=strict))
    message = str(refused.value)
    assert message.startswith(f"{path}: weights of another architecture than SwinTransformer (its [") \
        and "\n" not in message, message
    named = ast.literal_eval(re.search(r"its (\[.*?\])(\.\.\.)? are not in the model", message).group(1))
    assert named and set(named) <= extra, (named, extra)


@pytest.mark.parametrize("shape", [(), (17, 32), (1, 1, 17, 32)])
def test_a_position_table_of_another_rank_is_the_shape_error(tmp_path, shape):
    """A scalar pos_embed ended in an IndexError (its token count read before any rank check); a table of another
    rank reached timm's resample and was named as another token layout."""
    state = build_model(ModelConfig(name="vit_nano", num_classes=10)).state_dict()
    expected = tuple(state["pos_embed"].shape)
    state["pos_embed"] = torch.zeros(shape)
    path = tmp_path / "vit.pth"
    torch.save(state, path)
    with pytest.raises(ModelError) as refused:
        build_model(ModelConfig(name="vit_nano", num_classes=10, pretrained=str(path)))
    assert str(refused.value) == (f"{path}: 'pos_embed' has shape {shape}, the model expects {expected}: a "
                                  f"checkpoint of another model?")
