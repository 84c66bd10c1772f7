"""The logged pair energy of a model with separate q, k, v layers is the paper's per-block energy.

Eq. (2) (with App. A.2, Eq. (23)) reads one matrix per block and role: for the qkv role that is the stacked
[W_Q; W_K; W_V] after the norm, whether the model stores it as one fused layer (timm) or as three (transformers'
ViT). `cd/pair_energy/<role>` is the mean over blocks of that energy, so a fused and a split model holding the same
weights log the same numbers. References: ||[W_Q; W_K; W_V] D||_F^2 and the other roles' ||W2 W1n||_F^2 written
out in float64 from the model's own parameters.
"""
from __future__ import annotations

import math

import pytest
import timm
import torch
from transformers import ViTConfig, ViTForImageClassification

import mechanism
from cd import ColinearityDecay, find_pairs, pair_energy_source
from cd.sharded import block_plans, sharded_pair_energy
from cd_models import normalized, randomize_norms

D, HEADS, HIDDEN, DEPTH = 32, 4, 64, 2
ROLES = ("qkv", "proj", "fc1", "fc2")


def hf_vit() -> ViTForImageClassification:
    """transformers' ViT (separate q_proj, k_proj, v_proj) with non-trivial norm scales."""
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=D, num_hidden_layers=DEPTH, num_attention_heads=HEADS,
                    intermediate_size=HIDDEN, num_labels=10)
    return randomize_norms(ViTForImageClassification(cfg), 0)


def hand_energies(model: ViTForImageClassification) -> dict[str, float]:
    """Mean over blocks of each role's normalized energy, Eq. (2) on the stacked qkv, in float64."""
    per_role: dict[str, list[float]] = {role: [] for role in ROLES}
    for layer in model.vit.layers:
        a, mlp = layer.attention, layer.mlp
        w = {n: t.detach().double() for n, t in (("q", a.q_proj.weight), ("k", a.k_proj.weight),
                                                   ("v", a.v_proj.weight), ("o", a.o_proj.weight),
                                                   ("fc1", mlp.fc1.weight), ("fc2", mlp.fc2.weight),
                                                   ("g1", layer.layernorm_before.weight),
                                                   ("g2", layer.layernorm_after.weight))}
        stacked = torch.cat([w["q"], w["k"], w["v"]])  # [W_Q; W_K; W_V], (3D, D)
        for role, w2, w1 in (("qkv", stacked, torch.diag(w["g1"])), ("proj", w["o"], w["v"]),
                             ("fc1", w["fc1"], torch.diag(w["g2"])), ("fc2", w["fc2"], w["fc1"])):
            per_role[role].append(float((w2 @ normalized(w1)).square().sum()))
    return {role: sum(v) / len(v) for role, v in per_role.items()}


def fused_copy(model: ViTForImageClassification) -> torch.nn.Module:
    """A timm ViT (fused qkv) holding `model`'s block weights: qkv = [W_Q; W_K; W_V]."""
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=D, depth=DEPTH,
                            num_heads=HEADS, mlp_ratio=HIDDEN / D, num_classes=10)
    with torch.no_grad():
        for block, layer in zip(vit.blocks, model.vit.layers):
            a = layer.attention
            block.norm1.weight.copy_(layer.layernorm_before.weight)
            block.attn.qkv.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            block.attn.proj.weight.copy_(a.o_proj.weight)
            block.norm2.weight.copy_(layer.layernorm_after.weight)
            block.mlp.fc1.weight.copy_(layer.mlp.fc1.weight)
            block.mlp.fc2.weight.copy_(layer.mlp.fc2.weight)
    return vit


def test_separate_q_k_v_log_the_energy_of_the_stacked_matrix():
    model = hf_vit()
    want = hand_energies(model)
    logged = pair_energy_source(model)()
    metrics = ColinearityDecay(model).metrics()
    for role in ROLES:
        assert logged[f"cd/pair_energy/{role}"] == pytest.approx(want[role], rel=1e-5), role
        assert metrics[f"cd/pair_energy/{role}"] == pytest.approx(want[role], rel=1e-5), role


def test_fused_and_separate_qkv_of_the_same_weights_log_the_same_energies():
    split = hf_vit()
    fused = fused_copy(split)
    assert len(find_pairs(split)) == DEPTH * 6 and len(find_pairs(fused)) == DEPTH * 4  # q, k, v apart; one qkv
    got_split, got_fused = pair_energy_source(split)(), pair_energy_source(fused)()
    assert got_split.keys() == got_fused.keys() == {f"cd/pair_energy/{role}" for role in ROLES}
    for key in got_split:
        assert got_split[key] == pytest.approx(got_fused[key], rel=1e-6), key


def test_the_block_by_block_energy_of_separate_q_k_v_is_the_stacked_matrix_energy():
    """`cd.sharded`'s path (run on plain tensors, which it takes as they are) counts blocks as the unsharded one."""
    model = hf_vit()
    pairs = find_pairs(model)
    got = sharded_pair_energy(pairs, block_plans(pairs))
    for role, value in hand_energies(model).items():
        assert math.isclose(float(got[role]), value, rel_tol=1e-5), role


def test_mechanism_energies_have_one_row_per_block_and_role_of_the_stacked_matrix():
    """scripts/mechanism.py `energies`: one row per block and role, whose energy is the stacked matrix's and whose
    raw energy is ||[W_Q; W_K; W_V] diag(g)||_F^2; the mean of a role's rows is the logged metric."""
    model = hf_vit()
    rows = mechanism.pair_energies(model)
    assert sorted((r["block"], r["role"]) for r in rows) == sorted(
        (f"vit.layers.{i}", role) for i in range(DEPTH) for role in ROLES)
    qkv0 = next(r for r in rows if r["block"] == "vit.layers.0" and r["role"] == "qkv")
    a = model.vit.layers[0].attention
    assert qkv0["w2"] == ("[vit.layers.0.attention.q_proj.weight; vit.layers.0.attention.k_proj.weight; "
                          "vit.layers.0.attention.v_proj.weight]")
    stacked = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().double()
    g = model.vit.layers[0].layernorm_before.weight.detach().double()
    assert qkv0["energy_raw"] == pytest.approx(float((stacked * g).square().sum()), rel=1e-9)
    want = hand_energies(model)
    for role in ROLES:
        values = [r["energy"] for r in rows if r["role"] == role]
        assert sum(values) / len(values) == pytest.approx(want[role], rel=1e-5), role
