"""A fused qkv split as [Q; K; V] whose proj reads more than V is refused naming what was measured, not a layout.

The V-row check (cd/values.py) sets rows [2D:3D] of qkv's output to zero and finds proj's input not zero. That has
two causes it cannot tell apart: the rows are not V (a per-head or reordered layout), or something other than V
reaches proj (MViTv2's residual pooling `x = x + q` after the attention, its `norm_v`, a LayerNorm with a bias, on
V). A toy attention of one's own, whose rows are [Q; K; V] in thirds as timm's are (the reference: its forward
splits them so), adds q before proj or normalizes V: the refusal must name the other input as a possible cause and
not state a layout as the cause. A norm module on V (`norm_v`) is named by the meta check before the values are read
(`cd/verify.py`, as DiffAttention's sub_norm in tests/test_cd_attention_norms.py).
"""
from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

import cd_models  # noqa: F401  (one CPU thread for tiny models)
from cd import UnsupportedModelError, find_pairs

D, HEADS, TOKENS = 12, 2, 5


class _Attn(nn.Module):
    """Rows [Q; K; V] in thirds; `extra`: 'residual_q' adds q to the attention's output (MViTv2's
    residual_pooling), 'norm_v' passes V through a LayerNorm with a bias (MViTv2's norm_v), '' neither."""

    def __init__(self, extra: str):
        super().__init__()
        self.extra = extra
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.norm_v = nn.LayerNorm(D // HEADS)
        with torch.no_grad():  # a trained bias: LayerNorm's init (zero) would map V = 0 to 0
            self.norm_v.bias.uniform_(0.5, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        if self.extra == "norm_v":
            v = self.norm_v(v)
        out = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        if self.extra == "residual_q":
            out = out + q
        return self.proj(out.transpose(1, 2).reshape(b, n, D))


class _Block(nn.Module):
    def __init__(self, extra: str):
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(D), _Attn(extra), nn.LayerNorm(D)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp.fc2(torch.relu(self.mlp.fc1(self.norm2(x))))


def _refusal(model: nn.Module, example=None) -> str:
    with pytest.raises(UnsupportedModelError) as refused:
        find_pairs(model, example)
    return str(refused.value)


def test_the_toy_without_another_input_passes():
    torch.manual_seed(0)
    assert len(find_pairs(nn.Sequential(_Block("")), torch.randn(1, TOKENS, D))) == 4


def test_a_proj_that_reads_more_than_v_is_refused_naming_the_measurement_and_both_causes():
    torch.manual_seed(0)
    message = _refusal(nn.Sequential(_Block("residual_q")), torch.randn(1, TOKENS, D))
    assert "\n" not in message
    assert message.startswith("block '0' (_Block) is not supported by CD: with rows 24:36 of 0.attn.qkv's output "
                              "set to zero, the input of 0.attn.proj is not zero: something other than V reaches "
                              "0.attn.proj (a term added after the attention"), message
    assert "or 0.attn.qkv is laid out otherwise than [Q; K; V]" in message  # a possible cause, not the cause
    assert "so those rows are not (all of) V" not in message and "the fused qkv is laid out otherwise" not in message
    # verify=False is offered with its warning, for the case where the layout is not the cause
    assert message.endswith("otherwise pass verify=False to pair 0.attn.proj with rows 24:36 unchecked (beyond the "
                            "paper: CD then decays that product although 0.attn.proj reads more than V)")


def test_a_norm_module_on_v_is_refused_by_name_not_as_a_layout():
    torch.manual_seed(0)
    message = _refusal(nn.Sequential(_Block("norm_v")), torch.randn(1, TOKENS, D))
    assert "\n" not in message
    assert "block '0' (_Block): the proj pair: the norm 0.attn.norm_v (LayerNorm) stands on V's way from 0.attn.qkv " \
        "to 0.attn.proj" in message, message
    assert "laid out otherwise" not in message and "so those rows are not (all of) V" not in message
    assert "pass verify=False to pair them unchecked (beyond the paper)" in message


def test_mvitv2s_refusal_does_not_state_a_layout_as_the_cause():
    # timm's MultiScaleAttention splits qkv as [Q; K; V] (reshape(B, N, 3, heads, -1).permute(2, 0, 3, 1, 4)) and,
    # with residual_pooling, adds q to the attention's output before proj
    torch.manual_seed(0)
    model = timm.create_model("mvitv2_tiny", img_size=128).eval()
    attn = model.stages[0].blocks[0].attn
    assert attn.residual_pooling and attn.norm_v is not None
    message = _refusal(model, torch.randn(1, 3, 128, 128))
    # its norm_v (a LayerNorm on V's way to proj) is named by the meta check, before the values are read
    assert "block 'stages.0.blocks.0' (MultiScaleBlock): the proj pair: the norm stages.0.blocks.0.attn.norm_v " \
        "(LayerNorm) stands on V's way from stages.0.blocks.0.attn.qkv to stages.0.blocks.0.attn.proj" in message, \
        message
    assert "laid out otherwise" not in message and "so those rows are not (all of) V" not in message
