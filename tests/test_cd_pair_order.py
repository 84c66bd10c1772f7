"""The order in which a composable pair's W reads its norm's channels, and fc2 reads fc1's: `find_pairs` refuses a
block that permutes, rolls or mixes the channels between a pair's two matrices, and passes the paper's paths.

CD decays W diag(g) (paper Eqs. (4)-(5): g's entry i scales W's column i) and W_F2 W_F1 (Eq. (8): fc1's output
channel i reaches fc2's column i through an elementwise activation). A toy pre-norm block of one's own puts one of
these maps between the matrices: a channel permutation or roll after norm1 or norm2, or inside the MLP a LayerNorm
over the hidden channels (a sub-LN under a name of its own), a Linear, a permutation. Each makes the composed map
W M diag(g) or W_F2 M act(W_F1 x), not the pair's product. What must pass is written here independently of cd/:
an elementwise activation with act(0) != 0 (sigmoid), a per-channel scale and a depthwise conv along the tokens
inside the MLP, which keep fc1's channel i at fc2's column i.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cd_models  # noqa: F401  (one CPU thread for tiny models)
from cd import UnsupportedModelError, find_pairs

D, HIDDEN, HEADS, TOKENS = 12, 24, 2, 6


class _Mlp(nn.Module):
    """fc2(inner(act(fc1(x)))); `inner` names the map between the matrices."""

    def __init__(self, inner: str):
        super().__init__()
        self.fc1, self.fc2, self.inner = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D), inner
        self.act = nn.Sigmoid() if inner == "sigmoid" else nn.GELU()
        if inner == "sub_ln":
            self.ffn_layernorm = nn.LayerNorm(HIDDEN)
        elif inner == "sub_rms":  # maps zeros to zeros, as act(0) = 0 does: the zeroed channels read alike
            self.ffn_rmsnorm = nn.RMSNorm(HIDDEN)
        elif inner == "out_ln":  # after fc2: the pair's path is untouched
            self.out_norm = nn.LayerNorm(D)
        elif inner == "linear":
            self.mid = nn.Linear(HIDDEN, HIDDEN)
        elif inner == "scale":
            self.gamma = nn.Parameter(torch.linspace(0.5, 2.0, HIDDEN))
        elif inner == "dwconv":
            self.dwconv = nn.Conv1d(HIDDEN, HIDDEN, 3, padding=1, groups=HIDDEN)
        self.register_buffer("perm", torch.randperm(HIDDEN, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        if self.inner == "sub_ln":
            h = self.ffn_layernorm(h)
        elif self.inner == "sub_rms":
            h = self.ffn_rmsnorm(h)
        elif self.inner == "linear":
            h = self.mid(h)
        elif self.inner == "perm":
            h = h[..., self.perm]
        elif self.inner == "scale":
            h = h * self.gamma
        elif self.inner == "dwconv":
            h = self.dwconv(h.transpose(1, 2)).transpose(1, 2)
        return self.out_norm(self.fc2(h)) if self.inner == "out_ln" else self.fc2(h)


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        out = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, D))


class _Block(nn.Module):
    """A timm-named pre-norm block; `before` maps the norm's output before the layer that reads it ('perm1', 'roll1'
    after norm1; 'perm2', 'roll2' after norm2)."""

    def __init__(self, inner: str, before: str):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(D), _Attn(), nn.LayerNorm(D), _Mlp(inner)
        self.before = before
        self.register_buffer("perm", torch.randperm(D, generator=torch.Generator().manual_seed(1)))

    def _map(self, h: torch.Tensor, which: str) -> torch.Tensor:
        if self.before == f"perm{which}":
            return h[..., self.perm]
        if self.before == f"roll{which}":
            return torch.roll(h, 3, dims=-1)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self._map(self.norm1(x), "1"))
        return x + self.mlp(self._map(self.norm2(x), "2"))


class _Net(nn.Module):
    """Two blocks; the second carries the map under test (the first is the paper's block)."""

    def __init__(self, inner: str = "none", before: str = "none"):
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.blocks = nn.Sequential(_Block("none", "none"), _Block(inner, before))
        with torch.no_grad():  # norms with scales and biases of their own, as a trained model's
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.5, 0.5)

    def example_input(self) -> torch.Tensor:
        return torch.randn(2, TOKENS, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.embed(x))


@pytest.mark.parametrize("inner", ["none", "sigmoid", "scale", "dwconv", "out_ln"])
def test_an_mlp_that_keeps_each_hidden_channel_apart_is_paired(inner):
    pairs = find_pairs(_Net(inner=inner))
    assert [(p.role, p.upstream_name) for p in pairs if p.block == "blocks.1" and p.role == "fc2"] == \
        [("fc2", "blocks.1.mlp.fc1.weight")]


@pytest.mark.parametrize("inner", ["linear", "perm"])
def test_an_mlp_that_mixes_or_reorders_fc1s_channels_before_fc2_is_refused(inner):
    with pytest.raises(UnsupportedModelError) as refused:
        find_pairs(_Net(inner=inner))
    said = str(refused.value)
    assert "block 'blocks.1'" in said and "blocks.1.mlp.fc2" in said and "vary from token to token" in said
    assert "verify=False" in said


@pytest.mark.parametrize("inner, norm", [("sub_ln", "ffn_layernorm"), ("sub_rms", "ffn_rmsnorm")])
def test_a_norm_over_the_hidden_channels_is_refused_by_name_an_rms_norm_too(inner, norm):
    """A norm between fc1 and fc2 divides each token's hidden channels by their RMS (a LayerNorm centres them too):
    fc2 reads diag(g) act(W_F1 x) / rms, not act(W_F1 x). An RMSNorm maps the zeroed channels to zeros in every
    token, as act(0) does, so the check on values cannot see it; the norm is named from the structure."""
    with pytest.raises(UnsupportedModelError) as refused:
        find_pairs(_Net(inner=inner))
    said = str(refused.value)
    assert "block 'blocks.1'" in said and f"blocks.1.mlp.{norm}" in said and "blocks.1.mlp.fc2" in said
    assert "verify=False" in said


def test_mlp_check_reference_a_permutation_really_changes_the_product():
    """The refusal is about the function: with the permutation, fc2(act(fc1 x)) is not what the pair's matrices
    compute in order (an independent check that the toy's 'perm' is not a no-op)."""
    net = _Net(inner="perm")
    mlp, x = net.blocks[1].mlp, torch.randn(1, TOKENS, D)
    in_order = mlp.fc2(mlp.act(mlp.fc1(x)))
    assert not torch.allclose(mlp(x), in_order)


@pytest.mark.parametrize("before", ["perm1", "roll1", "perm2", "roll2"])
def test_channels_moved_between_a_norm_and_the_layer_it_feeds_are_refused(before):
    layer = "blocks.1.attn.qkv" if before.endswith("1") else "blocks.1.mlp.fc1"
    norm = "blocks.1.norm1" if before.endswith("1") else "blocks.1.norm2"
    with pytest.raises(UnsupportedModelError) as refused:
        find_pairs(_Net(before=before))
    said = str(refused.value)
    assert f"of {norm}'s scale (and bias) set to zero" in said and f"of {layer}'s input are not zero" in said


def test_the_check_leaves_weights_buffers_and_modes_as_they_were():
    net = _Net().train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    find_pairs(net)
    assert net.training and all(m.training for m in net.modules())
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_nn_multihead_attention_in_projection_is_checked_as_the_norms_reader():
    """torch's TransformerEncoderLayer-style block: the norm's reader is in_proj_weight inside one
    F.multi_head_attention_forward call; a roll before it is refused, the plain block passes."""

    class Block(nn.Module):
        def __init__(self, roll: bool):
            super().__init__()
            self.norm1, self.norm2, self.roll = nn.LayerNorm(D), nn.LayerNorm(D), roll
            self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
            self.mlp = _Mlp("none")

        def forward(self, x):
            y = self.norm1(x)
            y = torch.roll(y, 2, dims=-1) if self.roll else y
            x = x + self.attn(y, y, y, need_weights=False)[0]
            return x + self.mlp(self.norm2(x))

    class Net(nn.Module):
        def __init__(self, roll: bool):
            super().__init__()
            self.blocks = nn.Sequential(Block(False), Block(roll))

        def example_input(self):
            return torch.randn(2, TOKENS, D)

        def forward(self, x):
            return self.blocks(x)

    assert len(find_pairs(Net(False))) == 8
    with pytest.raises(UnsupportedModelError, match="blocks.1.norm1's scale"):
        find_pairs(Net(True))



class _SdpaAttn(_Attn):
    """_Attn through F.scaled_dot_product_attention (timm's and cd/README.md's attention), whose CPU kernel gives
    zeros, not NaN, for NaN queries and keys: proj's input stays finite when the block's input is NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, D))


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
@pytest.mark.parametrize("before, inner", [("roll1", "none"), ("roll2", "none"), ("none", "perm")])
def test_an_example_without_finite_values_is_refused_as_unchecked_not_passed(fill, before, inner):
    """Each of these blocks is refused with a real example (above); an example of NaN or inf reaches the norm's layer
    (and fc2) without a finite value, which tells no channel from another, so their order would go unchecked:
    refused as such, as a proj whose input has no finite value is, never passed."""
    net = _Net(inner=inner, before=before)
    for block in net.blocks:  # the same weights, through SDPA: proj's input finite (zeros), as in timm's ViT
        sdpa = _SdpaAttn()
        sdpa.load_state_dict(block.attn.state_dict())
        block.attn = sdpa
    with pytest.raises(UnsupportedModelError, match="is not supported by CD"):
        find_pairs(net)
    with pytest.raises(UnsupportedModelError) as refused:
        find_pairs(net, torch.full((2, TOKENS, 3), fill))
    said = str(refused.value)
    assert said.startswith("cannot check in which order blocks.0.") and "has no finite value" in said
    assert "Pass example_input= of finite values" in said and "verify=False" in said
