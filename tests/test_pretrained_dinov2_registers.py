"""DINOv2 files in the official layout with registers (the class token's entry in pos_embed, register_tokens,
mask_token): timm's conversion folds the class entry into cls_token, so at the model's grid the table loads as it
is and nothing is recorded as resampled; at another grid the record names the file's grid, not its entry count."""
import logging

import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed

from configs.schema import ModelConfig
from models import build_model

KW = {"embed_dim": 32, "depth": 2, "num_heads": 2}
NAME = "vit_small_patch14_reg4_dinov2"  # patches of 14: 28 pixels is a 2x2 grid, 56 a 4x4 one


@pytest.fixture
def official(tmp_path):
    """(path, timm's state dict of a 2x2-grid model) of a file in facebookresearch/dinov2's layout of it."""
    torch.manual_seed(0)
    timm_state = {k: torch.randn_like(v) for k, v in
                  timm.create_model(NAME, img_size=28, num_classes=0, **KW).state_dict().items()}
    cls_entry = torch.randn(1, 1, 32)
    state = {k: v for k, v in timm_state.items() if k not in ("reg_token", "pos_embed", "cls_token")}
    state.update(register_tokens=timm_state["reg_token"], mask_token=torch.zeros(1, 32),
                 pos_embed=torch.cat([cls_entry, timm_state["pos_embed"]], 1),
                 cls_token=timm_state["cls_token"] - cls_entry)
    path = tmp_path / "dinov2_reg4.pth"
    torch.save(state, path)
    return str(path), timm_state


def load(path: str, img_size: int):
    return build_model(ModelConfig(name=NAME, img_size=img_size, num_classes=10, kwargs=KW, pretrained=path,
                                   drop_path=0.0, pretrained_strict=False))


def test_at_the_files_grid_nothing_is_resampled_or_recorded(official, caplog):
    path, timm_state = official
    with caplog.at_level(logging.WARNING):
        model = load(path, 28)
    assert model.pretrained_resampled == {} and "resampled" not in caplog.text, caplog.text
    assert torch.equal(model.pos_embed.detach(), timm_state["pos_embed"])  # the file's table, unchanged
    torch.testing.assert_close(model.cls_token.detach(), timm_state["cls_token"])


def test_at_another_grid_the_record_names_the_files_grid(official, caplog):
    path, timm_state = official
    with caplog.at_level(logging.WARNING):
        model = load(path, 56)
    assert model.pretrained_resampled == {"pos_embed_resampled": "2x2->4x4"}
    assert "position table of a 2x2 grid resampled to the model's 4x4" in caplog.text
    expected = resample_abs_pos_embed(timm_state["pos_embed"], (4, 4), num_prefix_tokens=0)  # patches alone
    torch.testing.assert_close(model.pos_embed.detach(), expected, atol=1e-6, rtol=1e-5)
