"""CD on other libraries' Transformers (cd/pairs.py LAYOUTS): one update of transformers' ViT and Llama (gated
MLP, opt-in) against the float64 reference written out by hand (GPT-2's Conv1D and MMDetection's Swin are
checked in training, tests/test_cd_integration_*.py)."""
from __future__ import annotations

import copy

import pytest
import torch

from cd import ColinearityDecay
from cd.families import build_family
from cd_integration_refs import RefPair, max_diff, reference_cd_
from cd_models import randomize_norms

pytest.importorskip("transformers")


def _pairs(block: str, norm1: str, attn: str, o: str, norm2: str, ups: list, down: str, n: int = 2) -> list:
    """The pairs of `n` blocks named `block.format(i)`: q, k, v (`attn.format(x)`) after norm1, o after v, the
    MLP's input layers `ups` after norm2 (gate and up when gated), the MLP's output after the last of `ups`."""
    out = []
    for i in range(n):
        b = block.format(i)
        out += [RefPair(f"{b}.{attn.format(x)}.weight", f"{b}.{norm1}.weight", True) for x in "qkv"]
        out.append(RefPair(f"{b}.{o}.weight", f"{b}.{attn.format('v')}.weight", False))
        out += [RefPair(f"{b}.{up}.weight", f"{b}.{norm2}.weight", True) for up in ups]
        out.append(RefPair(f"{b}.{down}.weight", f"{b}.{ups[-1]}.weight", False))
    return out


@pytest.mark.parametrize("family,pairs,gated", [
    ("ViT (transformers)", _pairs("vit.layers.{}", "layernorm_before", "attention.{}_proj", "attention.o_proj",
                                  "layernorm_after", ["mlp.fc1"], "mlp.fc2"), False),
    ("Llama, multi-head attention (transformers)",
     _pairs("model.layers.{}", "input_layernorm", "self_attn.{}_proj", "self_attn.o_proj", "post_attention_layernorm",
            ["mlp.gate_proj", "mlp.up_proj"], "mlp.down_proj"), True),
])
def test_one_update_matches_the_float64_reference(family, pairs, gated):
    torch.manual_seed(0)
    model = build_family(family)
    with torch.no_grad():  # RMSNorm scales start at one: random scales, so that a wrong norm shows
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(0.5 + torch.rand_like(p))
    randomize_norms(model)
    want = copy.deepcopy(model).double()
    decay = ColinearityDecay(model, lam=0.5, gated_mlp=gated, matmul_precision="fp32")
    assert sorted(p.name for p in decay.pairs) == sorted(p.w2 for p in pairs)
    decay.apply(lr=0.1)
    reference_cd_(want, pairs, 0.5, {p.w2: 0.1 for p in pairs})
    got = {n: p.double() for n, p in model.named_parameters()}
    assert max_diff(got, dict(want.named_parameters())) < 1e-6  # fp32 update against float64


@pytest.mark.parametrize("family", ["vit", "ViT (transformers)"])
def test_a_family_model_is_built_in_eval_mode(family):
    """cd.families.build_family returns its model in eval mode (its docstring): timm's and other libraries'."""
    assert not any(m.training for m in build_family(family).modules())
