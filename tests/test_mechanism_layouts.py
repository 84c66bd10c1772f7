"""scripts/mechanism.py on models beyond timm's names: the weight-only tools (alignment, energies, removing
directions) read FC1 / FC2 and every pair from `cd.find_pairs`, so that transformers' GPT-2 (Conv1D weights stored
(in, out)) and a language-model checkpoint of train.py give the numbers of a direct computation written here, a
block CD refuses (a gated MLP) is left out, and `surrogate` / `remove` refuse a language model in one line.

References: App. A.1, Eq. (13) (alpha_ij); Sec. 3.1, Eq. (2) with App. A.2, Eq. (23) (pair energies).
"""
import copy
import csv
import logging
import os

import pytest
import timm.layers
import torch
from torch import nn

from cd_models import normalized, tiny_vit
from tests.conftest import ROOT

transformers = pytest.importorskip("transformers")

import mechanism  # noqa: E402

LM_CONFIG = os.path.join(ROOT, "configs", "lm", "kjv_nano.yaml")


def direct_alpha(w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """alpha_ij = |w2_j / ||w2_j|| . u_i| (App. A.1, Eq. (13)), u_i the left singular vectors of W_F1 (hidden x dim),
    w2_j the rows of W_F2 (dim x hidden), element by element."""
    w1, w2 = w1.detach().double(), w2.detach().double()
    u, _, _ = torch.linalg.svd(w1, full_matrices=False)
    alpha = torch.empty(u.shape[1], w2.shape[0], dtype=torch.float64)
    for i in range(u.shape[1]):
        for j in range(w2.shape[0]):
            alpha[i, j] = abs(torch.dot(w2[j] / torch.linalg.vector_norm(w2[j]), u[:, i]))
    return alpha


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """transformers' GPT-2 (Conv1D layers), width 32, hidden 128, 2 blocks, with random norm scales (all ones
    would hide a dropped diag(g))."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=65, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
    return model


def linear_copy(model: nn.Module) -> nn.Module:
    """`model` with every Conv1D (weight (in, out), x @ W) replaced by an nn.Linear (weight (out, in), x @ W.T)
    holding the transposed weight: the same function, nanoGPT's storage."""
    model = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "Conv1D":
            linear = nn.Linear(*module.weight.shape)
            with torch.no_grad():
                linear.weight.copy_(module.weight.T)
                linear.bias.copy_(module.bias)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, linear)
    return model


def test_alignment_of_transformers_gpt2_reads_its_conv1d_weights_transposed():
    model = tiny_gpt2()
    blocks = mechanism.ffn_pairs(model)
    assert [name for name, _ in blocks] == ["transformer.h.0", "transformer.h.1"]
    rows, alphas = mechanism.rank_directions(blocks)
    assert len(rows) == 2 * 32
    sd = model.state_dict()
    for b in ("transformer.h.0", "transformer.h.1"):
        # Conv1D stores (in, out): W_F1 = c_fc.weight^T (128 x 32), W_F2 = c_proj.weight^T (32 x 128)
        expected = direct_alpha(sd[f"{b}.mlp.c_fc.weight"].T, sd[f"{b}.mlp.c_proj.weight"].T)
        assert alphas[b].shape == expected.shape == (32, 32)
        torch.testing.assert_close(alphas[b], expected, rtol=1e-9, atol=1e-12)
    # the nn.Linear copy (weights transposed in storage, the same maps) has the same alpha, direction by direction
    _, linear_alphas = mechanism.rank_directions(mechanism.ffn_pairs(linear_copy(model)))
    for b, alpha in alphas.items():
        torch.testing.assert_close(linear_alphas[b], alpha, rtol=1e-9, atol=1e-12)


def direct_gpt2_energies(model: nn.Module) -> dict:
    """(role, block) -> (||W2 W1n||_F^2, ||W2 W1||_F^2) from transformers' GPT-2 names, Conv1D weights transposed
    to the (out, in) maps they apply."""
    P = {k: v.detach().double() for k, v in model.state_dict().items()}
    out = {}
    for b in ("transformer.h.0", "transformer.h.1"):
        qkv = P[f"{b}.attn.c_attn.weight"].T  # (96, 32): [Q; K; V]
        fc1 = P[f"{b}.mlp.c_fc.weight"].T
        for role, w2, w1 in (("qkv", qkv, torch.diag(P[f"{b}.ln_1.weight"])),
                             ("proj", P[f"{b}.attn.c_proj.weight"].T, qkv[64:]),
                             ("fc1", fc1, torch.diag(P[f"{b}.ln_2.weight"])),
                             ("fc2", P[f"{b}.mlp.c_proj.weight"].T, fc1)):
            out[(role, b)] = (float(torch.linalg.matrix_norm(w2 @ normalized(w1)) ** 2),
                              float(torch.linalg.matrix_norm(w2 @ w1) ** 2))
    return out


def test_energies_of_transformers_gpt2_match_a_direct_computation():
    model = tiny_gpt2()
    rows = mechanism.pair_energies(model)
    expected = direct_gpt2_energies(model)
    assert sorted((r["role"], r["block"]) for r in rows) == sorted(expected)
    for r in rows:
        energy, raw = expected[(r["role"], r["block"])]
        assert r["energy"] == pytest.approx(energy, rel=1e-5)
        assert r["energy_raw"] == pytest.approx(raw, rel=1e-9)


def test_removing_a_direction_of_gpt2_changes_only_its_conv1d_fc1():
    model = tiny_gpt2()
    without = mechanism.model_without(model, [{"block": "transformer.h.1", "direction": 0}])
    before, after = model.state_dict(), without.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == ["transformer.h.1.mlp.c_fc.weight"]
    w1_before = before["transformer.h.1.mlp.c_fc.weight"].double().T
    w1_after = after["transformer.h.1.mlp.c_fc.weight"].double().T
    u, s, vh = torch.linalg.svd(w1_before, full_matrices=False)
    # App. A.1: U S' V^T with s_0 set to zero, in the (out, in) map the layer applies
    torch.testing.assert_close(w1_after, w1_before - s[0] * torch.outer(u[:, 0], vh[0]), rtol=0, atol=1e-6)


def test_a_gated_block_is_left_out_with_a_warning_and_a_model_of_gated_blocks_is_refused(caplog):
    model = tiny_vit()
    model.blocks[1].mlp = timm.layers.SwiGLU(in_features=32, hidden_features=64)  # W_down (act(W_gate x) * W_up x)
    with caplog.at_level(logging.WARNING, logger="mechanism"):
        blocks = mechanism.ffn_pairs(model)
    assert [name for name, _ in blocks] == ["blocks.0"]
    assert any("blocks.1" in r.getMessage() and "gated MLP" in r.getMessage() for r in caplog.records)
    assert {r["block"] for r in mechanism.pair_energies(model)} == {"blocks.0"}
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=65, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, bos_token_id=0, eos_token_id=0))
    with pytest.raises(mechanism.MechanismError, match=r"^no block of LlamaForCausalLM is one CD pairs; the first: "
                                                       r"block 'model.layers.0' .*gated MLP"):
        mechanism.ffn_pairs(llama)


# --- a language-model checkpoint of train.py, on the command line -------------------------------------------
@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    """A train.py-shaped checkpoint ({"model", "config"}) of the two-block GPT of configs/lm/kjv_nano.yaml."""
    from configs import config_to_dict, load_config
    from models import build_model

    cfg = load_config([LM_CONFIG], [])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
    path = tmp_path_factory.mktemp("lm") / "best.pt"
    torch.save({"model": model.state_dict(), "config": config_to_dict(cfg)}, path)
    return str(path), model


def test_alignment_and_energies_of_an_lm_checkpoint_match_a_direct_computation(lm_checkpoint, tmp_path):
    path, model = lm_checkpoint
    sd = {k: v.double() for k, v in model.state_dict().items()}
    mechanism.main(["alignment", "--checkpoint", path, "--out", str(tmp_path / "a")])
    with open(tmp_path / "a" / "alignment.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 32
    for r in rows:
        b = r["block"]
        alpha = direct_alpha(sd[f"{b}.mlp.fc1.weight"], sd[f"{b}.mlp.fc2.weight"])[int(r["direction"])]
        assert float(r["alpha"]) == pytest.approx(float(alpha.max()), rel=1e-9)
        assert int(r["row"]) == int(alpha.argmax())
    mechanism.main(["energies", "--checkpoint", path, "--out", str(tmp_path / "e")])
    with open(tmp_path / "e" / "energies.csv") as f:
        energies = list(csv.DictReader(f))
    assert len(energies) == 2 * 4
    for r in energies:
        b = r["block"]
        qkv = sd[f"{b}.attn.qkv.weight"]
        w2, w1 = {"qkv": (qkv, torch.diag(sd[f"{b}.norm1.weight"])),
                  "proj": (sd[f"{b}.attn.proj.weight"], qkv[64:]),
                  "fc1": (sd[f"{b}.mlp.fc1.weight"], torch.diag(sd[f"{b}.norm2.weight"])),
                  "fc2": (sd[f"{b}.mlp.fc2.weight"], sd[f"{b}.mlp.fc1.weight"])}[r["role"]]
        assert float(r["energy"]) == pytest.approx(float(torch.linalg.matrix_norm(w2 @ normalized(w1)) ** 2), rel=1e-5)


@pytest.mark.parametrize("command", ["surrogate", "remove"])
def test_surrogate_and_remove_refuse_an_lm_checkpoint_in_one_line(lm_checkpoint, tmp_path, capsys, command):
    assert mechanism.cli([command, "--checkpoint", lm_checkpoint[0], "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: `{command}`: ")
    assert "is a language model (data.dataset=kjv)" in err and "run `alignment` or `energies` on it" in err
    assert not os.path.exists(tmp_path / "o")  # the refusal leaves no folder behind
