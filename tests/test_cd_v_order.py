"""The order in which proj reads V's channels: `find_pairs` refuses an attention that merges its heads in another
order, permutes V's channels on the way, or mixes them (XCiT's channel attention), and passes timm's order.

CD pairs row i of W_V with column i of W_O (paper Sec. 3.2). A toy timm-style attention of one's own (fused qkv or
separate q, k, v) merges its heads in timm's order, reversed, or reverses the channels within each head: only the
first pairs V's channel i with proj's input column i. The references are written here, independently of cd/: the
toy's own merge, and for XCiT a perturbation of one V channel that reaches another channel's proj input column.
"""
from __future__ import annotations

import itertools

import pytest
import timm
import torch
from torch import nn

import cd_models  # noqa: F401  (one CPU thread for tiny models)
from cd import UnsupportedModelError, find_pairs
from cd.families import FAMILIES
from cd.values import order_patterns

D, HEADS, TOKENS = 12, 2, 5


class _Attn(nn.Module):
    """`merge`: how the heads are merged ('timm', 'reversed_heads', 'reversed_within_heads'), with '+left' proj
    applied as W_O @ x^T, with '+masked' every key of every query masked (softmax of -inf: NaN)."""

    def __init__(self, merge: str, separate: bool):
        super().__init__()
        self.merge = merge
        if separate:
            self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        else:
            self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).view(b, n, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        else:
            q, k, v = (layer(x).view(b, n, HEADS, D // HEADS).transpose(1, 2) for layer in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2)
        if "+masked" in self.merge:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool), float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # (b, heads, n, head_dim)
        if self.merge.startswith("reversed_heads"):
            out = out.flip(1)
        elif self.merge.startswith("reversed_within_heads"):
            out = out.flip(-1)
        merged = out.transpose(1, 2).reshape(b, n, D)
        if "+left" in self.merge:  # channels along dim -2 of the factor: (W_O @ x^T)^T = x @ W_O^T
            return (self.proj.weight @ merged.transpose(-1, -2)).transpose(-1, -2) + self.proj.bias
        return self.proj(merged)


class _Block(nn.Module):
    def __init__(self, attn: nn.Module):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(D), attn, nn.LayerNorm(D), nn.Module()
        self.mlp.fc1, self.mlp.act, self.mlp.fc2 = nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        if isinstance(self.attn, nn.MultiheadAttention):
            x = x + self.attn(y, y, y, need_weights=False)[0]
        else:
            x = x + self.attn(y)
        return x + self.mlp.fc2(self.mlp.act(self.mlp.fc1(self.norm2(x))))


class _Net(nn.Module):
    def __init__(self, merge: str = "timm", separate: bool = False, mha: bool = False):
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.blocks = nn.Sequential(*(_Block(
            nn.MultiheadAttention(D, HEADS, batch_first=True, add_bias_kv=True) if mha else
            _Attn(merge if i == 1 else "timm", separate)) for i in range(2)))

    def example_input(self) -> torch.Tensor:
        return torch.empty(1, TOKENS, 3, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.embed(x))


@pytest.mark.parametrize("separate", [False, True])
def test_heads_merged_in_timms_order_pass(separate):
    torch.manual_seed(0)
    pairs = find_pairs(_Net("timm", separate))
    assert [p.name for p in pairs if p.role == "proj"] == [f"blocks.{i}.attn.proj.weight" for i in range(2)]


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("merge", ["reversed_heads", "reversed_within_heads"])
def test_heads_merged_in_another_order_are_refused_naming_the_block(merge, separate):
    # the permutation moves V's zeroed channels to other proj columns: some of theirs stay nonzero, others are zero
    torch.manual_seed(0)
    v = "the rows of blocks\\.1\\.attn\\.v" if separate else "rows 24:36 of blocks\\.1\\.attn\\.qkv"
    with pytest.raises(UnsupportedModelError, match=rf"block 'blocks\.1' \(_Block\) is not supported by CD: "
                       r"blocks\.1\.attn\.proj reads V's channels in another order \(heads merged in another "
                       rf"order.*\): with channels [\d, ]+ of V \({v}'s output\) set to zero, columns [\d, ]+ of "
                       r"blocks\.1\.attn\.proj's input are not zero, and its columns [\d, ]+, of channels not set to "
                       r"zero, are zero instead.*verify=False"):
        find_pairs(_Net(merge, separate))
    assert len(find_pairs(_Net(merge, separate), verify=False)) == (12 if separate else 8)


def test_an_nn_multiheadattention_block_passes():
    # F.multi_head_attention_forward merges heads in V's order: the order forward zeroes the same channels of
    # in_proj_weight's V rows (and of bias_v, an extra value) and finds them zero at out_proj's input
    torch.manual_seed(0)
    pairs = find_pairs(_Net(mha=True))
    assert [p.name for p in pairs if p.role == "proj"] == [f"blocks.{i}.attn.out_proj.weight" for i in range(2)]


def _xcit() -> nn.Module:
    name, config = FAMILIES["xcit"]
    return timm.create_model(name, **config).eval()


def test_xcits_channel_attention_mixes_v_channels_and_is_refused():
    torch.manual_seed(0)
    model = _xcit()
    attn = model.blocks[0].attn
    seen = []
    h = attn.proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        model(x)
        # V channel 1 (row 2D + 1 of qkv) moved by a constant: proj's input column 0 changes (the same head)
        attn.qkv.bias = nn.Parameter(torch.zeros(3 * 32)) if attn.qkv.bias is None else attn.qkv.bias
        attn.qkv.bias[2 * 32 + 1] += 1.0
        model(x)
    h.remove()
    assert (seen[0][..., 0] - seen[1][..., 0]).abs().max() > 1e-4
    with pytest.raises(UnsupportedModelError, match=r"block 'blocks\.0' \(XCABlock\) is not supported by CD: its "
                       r"attention mixes V's channels on the way to blocks\.0\.attn\.proj \(.*XCiT's XCA.*\): with "
                       r"channels .* of V \(rows 64:96 of blocks\.0\.attn\.qkv's output\) set to zero.*and no other "
                       r"column is zero instead.*verify=False"):
        find_pairs(_xcit())


@pytest.mark.parametrize("heads, head_dim", [(2, 6), (2, 16), (4, 16), (12, 64), (16, 64), (3, 32)])
def test_the_order_patterns_move_under_every_head_permutation_and_common_channel_permutations(heads, head_dim):
    # proj's column j reads V's channel perm[j]: some pattern must hold a j whose perm[j] lies outside it (that
    # column is then not zero)
    width = heads * head_dim
    patterns = [set(chosen) for chosen in order_patterns(width)]

    def caught(perm):
        return any(perm[j] not in chosen for chosen in patterns for j in chosen)

    channels = [(h, c) for h in range(heads) for c in range(head_dim)]
    for order in itertools.islice(itertools.permutations(range(heads)), 1, 200):  # every head order but timm's
        assert caught([order[h] * head_dim + c for h, c in channels])
    assert caught([h * head_dim + head_dim - 1 - c for h, c in channels])  # each head's channels reversed
    assert caught([c * heads + h for h, c in channels])  # (heads, head_dim) read transposed
    assert not caught(list(range(width)))


@pytest.mark.parametrize("separate", [False, True])
def test_proj_applied_with_its_weight_on_the_left_is_read_along_its_channels(separate):
    # W_O @ x^T: proj's input channels lie along dim -2 of the factor; timm's merge passes, reversed heads do not
    torch.manual_seed(0)
    assert len(find_pairs(_Net("timm+left", separate))) == (12 if separate else 8)
    with pytest.raises(UnsupportedModelError, match=r"block 'blocks\.1'.*reads V's channels in another order"):
        find_pairs(_Net("reversed_heads+left", separate))


def test_a_separate_v_whose_proj_input_has_no_finite_value_is_refused_as_unchecked():
    # separate q, k, v have no row forward: the order forward alone must tell that NaN everywhere checked nothing
    torch.manual_seed(0)
    with pytest.raises(UnsupportedModelError, match=r"cannot check in which order blocks\.1\.attn\.proj reads V's "
                       r"channels.*no finite value.*verify=False"):
        find_pairs(_Net("timm+masked", separate=True))


def test_a_multiheadattention_with_nonzero_in_proj_bias_passes():
    # nn.MultiheadAttention starts with in_proj_bias = 0; a trained one has V biases that enter V's channels, so the
    # forwards must set V's part of in_proj_bias to zero with V's rows of in_proj_weight
    torch.manual_seed(0)
    model = _Net(mha=True)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.in_proj_bias.normal_()
            block.attn.out_proj.bias.normal_()
    assert all(b.attn.in_proj_bias[2 * D:].abs().min() > 0 for b in model.blocks)
    pairs = find_pairs(model)
    assert [p.name for p in pairs if p.role == "proj"] == [f"blocks.{i}.attn.out_proj.weight" for i in range(2)]
