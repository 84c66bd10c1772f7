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


def _vit_pairs(n):
    out = []
    for i in range(n):
        b = f"vit.layers.{i}"
        out += [RefPair(f"{b}.attention.{x}_proj.weight", f"{b}.layernorm_before.weight", True) for x in "qkv"]
        out += [RefPair(f"{b}.attention.o_proj.weight", f"{b}.attention.v_proj.weight", False),
                RefPair(f"{b}.mlp.fc1.weight", f"{b}.layernorm_after.weight", True),
                RefPair(f"{b}.mlp.fc2.weight", f"{b}.mlp.fc1.weight", False)]
    return out


def _llama_pairs(n):
    out = []
    for i in range(n):
        b = f"model.layers.{i}"
        out += [RefPair(f"{b}.self_attn.{x}_proj.weight", f"{b}.input_layernorm.weight", True) for x in "qkv"]
        out += [RefPair(f"{b}.self_attn.o_proj.weight", f"{b}.self_attn.v_proj.weight", False),
                RefPair(f"{b}.mlp.gate_proj.weight", f"{b}.post_attention_layernorm.weight", True),
                RefPair(f"{b}.mlp.up_proj.weight", f"{b}.post_attention_layernorm.weight", True),
                RefPair(f"{b}.mlp.down_proj.weight", f"{b}.mlp.up_proj.weight", False)]
    return out


@pytest.mark.parametrize("family,pairs,gated", [
    ("ViT (transformers)", _vit_pairs(2), False),
    ("Llama, multi-head attention (transformers)", _llama_pairs(2), True),
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
