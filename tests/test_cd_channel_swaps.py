"""Every channel permutation between a pair's two matrices is refused, including those that keep some zeroed set:
`find_pairs` runs one order forward per bit of the channel index (cd/values.py's `order_patterns`).

CD pairs row i of W_V with column i of W_O (paper Sec. 3.2), fc1's output channel i with fc2's column i (Eq. (8)) and
the norm's scale entry i with W's column i (Eqs. (4)-(5)). A toy pre-norm block of one's own (timm's names, fused
[Q; K; V] qkv) puts a channel permutation, built here, between the norm and qkv, between the attention and proj,
or between the MLP's activation and fc2. The reference is the permutation itself: the block passes only when it is
the identity. A swap of two channels keeps any zeroed set that holds both or neither, which one zero/nonzero
pattern cannot see.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import cd_models  # noqa: F401  (one CPU thread for tiny models)
from cd import UnsupportedModelError, find_pairs

D, HEADS, TOKENS = 64, 4, 5


def _swap(width: int, a: int, b: int) -> torch.Tensor:
    perm = torch.arange(width)
    perm[a], perm[b] = b, a
    return perm


class _Block(nn.Module):
    """norm1 -> qkv -> attention -> proj, norm2 -> fc1 -> GELU -> fc2; `where` in ('norm', 'v', 'hidden') reads
    the channels there through `perm` (column j reads channel perm[j])."""

    def __init__(self, where: str = "", perm: torch.Tensor = None):
        super().__init__()
        self.where, self.perm = where, perm
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.mlp = nn.Module(), nn.Module()
        self.attn.qkv, self.attn.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        with torch.no_grad():  # a non-trivial scale and bias: LayerNorm's init (ones, zeros) treats channels alike
            for norm in (self.norm1, self.norm2):
                norm.weight.uniform_(0.5, 2.0)
                norm.bias.uniform_(-0.5, 0.5)

    def _moved(self, where: str, x: torch.Tensor) -> torch.Tensor:
        return x[..., self.perm] if where == self.where else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.attn.qkv(self._moved("norm", self.norm1(x)))
        q, k, v = qkv.reshape(b, n, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, D)
        x = x + self.attn.proj(self._moved("v", y))
        return x + self.mlp.fc2(self._moved("hidden", F.gelu(self.mlp.fc1(self.norm2(x)))))


def _pairs(block: nn.Module) -> list:
    return find_pairs(nn.Sequential(block), torch.randn(1, TOKENS, D))


def test_the_block_without_a_permutation_passes():
    torch.manual_seed(0)
    assert [p.name for p in _pairs(_Block())] == ["0.attn.qkv.weight", "0.attn.proj.weight", "0.mlp.fc1.weight",
                                                   "0.mlp.fc2.weight"]


@pytest.mark.parametrize("where, a, b, refusal", [
    ("v", 0, 1, r"0\.attn\.proj reads V's channels in another order"),
    ("v", 6, 7, r"0\.attn\.proj reads V's channels in another order"),
    ("hidden", 0, 1, r"columns [\d, ]+ of 0\.mlp\.fc2's input still vary from token to token"),
    ("norm", 0, 1, r"0\.attn\.qkv does not read 0\.norm1's channel i at its column i"),
])
def test_a_swap_of_two_channels_is_refused(where, a, b, refusal):
    torch.manual_seed(0)
    width = 4 * D if where == "hidden" else D
    with pytest.raises(UnsupportedModelError, match=rf"block '0' \(_Block\) is not supported by CD: .*{refusal}"):
        _pairs(_Block(where, _swap(width, a, b)))


@pytest.mark.parametrize("where", ["v", "hidden", "norm"])
def test_random_permutations_are_refused(where):
    gen = torch.Generator().manual_seed(1)
    width = 4 * D if where == "hidden" else D
    for _ in range(5):
        perm = torch.randperm(width, generator=gen)
        assert not torch.equal(perm, torch.arange(width))
        torch.manual_seed(0)
        with pytest.raises(UnsupportedModelError, match=r"block '0' \(_Block\) is not supported by CD"):
            _pairs(_Block(where, perm))


def _caught(patterns: list[list[int]], perm: list[int]) -> bool:
    """Some pattern has a channel j whose column reads a channel perm[j] outside it (its column is not zero)."""
    return any(perm[j] not in set(chosen) for chosen in patterns for j in chosen)


@pytest.mark.parametrize("width", range(1, 8))
def test_every_permutation_but_the_identity_moves_a_channel_out_of_some_pattern(width):
    from cd.values import order_patterns
    patterns = order_patterns(width)
    for perm in itertools.permutations(range(width)):
        assert _caught(patterns, list(perm)) == (list(perm) != list(range(width))), perm


@pytest.mark.parametrize("width", [1, 2, 3, 8, 9, 100, 768, 3072])
def test_the_patterns_are_ceil_log2_of_the_width_each_neither_empty_nor_all(width):
    from cd.values import order_patterns
    patterns = order_patterns(width)
    assert len(patterns) == (math.ceil(math.log2(width)) if width > 1 else 0)
    assert all(0 < len(chosen) < width and chosen == sorted(set(chosen)) and chosen[-1] < width
               for chosen in patterns)
    gen = torch.Generator().manual_seed(width)
    for _ in range(20):  # random permutations of a real width, and single swaps (the cheapest to miss)
        perm = torch.randperm(width, generator=gen).tolist()
        assert _caught(patterns, perm) == (perm != list(range(width)))
    if width > 1:
        a, b = sorted(torch.randperm(width, generator=gen)[:2].tolist())
        assert _caught(patterns, _swap(width, a, b).tolist())
