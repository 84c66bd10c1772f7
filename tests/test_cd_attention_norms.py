"""A norm inside the attention on V's way to proj: `find_pairs` refuses the (V, proj) pair naming the norm, and passes
QK-norms, whose outputs reach proj only through the softmax.

CD decays W_O W_V, proj's path only where proj reads V mixed by attention alone (paper Sec. 3.2). timm's
DiffAttention divides each head's attention output by its RMS (`sub_norm`) before proj: proj reads W_V through a
per-token scaling. An RMSNorm keeps zeros at zero, so the check on values passes it; the fused qkv's label covers Q
and K too, so the norm is told from a QK-norm by where its output goes. The reference below (doubling V leaves proj's
input as it was) is written independently of cd/.
"""
from __future__ import annotations

import pytest
import timm
import torch

import cd_models  # noqa: F401  (one CPU thread for tiny models)
from cd import UnsupportedModelError, find_pairs


def _vit(fused: bool, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                              num_classes=3, **kw)
    for block in model.blocks:
        block.attn.fused_attn = fused  # F.scaled_dot_product_attention, or timm's softmax(q @ k.T) @ v
    return model.eval()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_norm_between_the_attention_and_proj_is_refused_by_name(fused, qk_norm):
    with pytest.raises(UnsupportedModelError) as refused:
        find_pairs(_vit(fused, attn_layer="diff", qk_norm=qk_norm))
    said = str(refused.value)
    assert "block 'blocks.0'" in said and "blocks.0.attn.sub_norm" in said and "blocks.0.attn.proj" in said
    assert "q_norm" not in said and "k_norm" not in said
    assert "verify=False" in said
    assert [p.role for p in find_pairs(_vit(fused, attn_layer="diff"), verify=False) if p.block == "blocks.0"] == \
        ["qkv", "proj", "fc1", "fc2"]


@pytest.mark.parametrize("fused", [True, False])
def test_qk_norms_whose_outputs_reach_proj_through_the_softmax_only_are_paired(fused):
    pairs = find_pairs(_vit(fused, qk_norm=True))
    assert [p.role for p in pairs if p.block == "blocks.1"] == ["qkv", "proj", "fc1", "fc2"]


def test_reference_the_sub_norm_makes_proj_read_v_through_a_per_token_scaling():
    """Doubling V's rows of qkv doubles proj's input in a plain attention (W_O W_V is the path) and leaves it as it was
    behind DiffAttention's RMSNorm (scale-invariant: proj does not read W_V linearly). The input is large enough that
    the norm's eps (1e-5) is small beside the mean square of V."""
    x = 30 * torch.randn(1, 5, 32)
    for kw, factor in (({}, 2.0), ({"attn_layer": "diff"}, 1.0)):
        attn = _vit(False, **kw).blocks[0].attn
        seen = []
        attn.proj.register_forward_hook(lambda module, args, out: seen.append(args[0]))
        with torch.no_grad():
            attn(x)
            attn.qkv.weight[64:] *= 2
            attn.qkv.bias[64:] *= 2
            attn(x)
        torch.testing.assert_close(seen[1], factor * seen[0], rtol=1e-4, atol=1e-5)
