"""Tiny timm models for the cd/ tests (CPU, built in milliseconds), with randomized norm scales.

Also the plain float64 reference of the CD update (written independently of cd/).
Imported by the `test_cd_*` / `test_tweo*` files (pytest puts `tests/` on sys.path).
"""
from __future__ import annotations

import math

import timm
import torch
from torch import nn

# Tiny models: OpenMP worker threads cost far more than they save (x100 on a busy 2-core machine).
torch.set_num_threads(1)

VIT_DEPTH = 2
SWIN_DEPTHS = (2, 2)


def tiny_vit(seed: int = 0, randomize: bool = True) -> nn.Module:
    """ViT with embed dim 32, 2 blocks, 2 heads, 32px input, 10 classes."""
    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32,
                              depth=VIT_DEPTH, num_heads=2, num_classes=10)
    return randomize_norms(model, seed) if randomize else model


def tiny_swin(seed: int = 0, randomize: bool = True) -> nn.Module:
    """Swin with embed dim 32, stages (2, 2), window 4, 32px input, 10 classes (one patch merging)."""
    torch.manual_seed(seed)
    model = timm.create_model("swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4,
                              embed_dim=32, depths=SWIN_DEPTHS, num_heads=(2, 4), num_classes=10)
    return randomize_norms(model, seed) if randomize else model


def vit_table_rows(depth: int, dim: int, hidden: int, packed_fc1: bool = False) -> list[list[str]]:
    """The rows `python -m cd --model M` prints for a timm ViT of `depth` blocks, width `dim` and MLP hidden size
    `hidden`, written by hand from Sec. 3's pairs: index, role, kind, W2 and its shape, W1 and its shape. With
    `packed_fc1` (a GluMlp, gate_last=False) fc1 holds [W_gate; W_up] of 2 x hidden rows, and fc2's W1 is W_up."""
    fc1_rows = 2 * hidden if packed_fc1 else hidden
    rows = []
    for i in range(depth):
        b = f"blocks.{i}"
        up = f"{b}.mlp.fc1.weight[{hidden}:{2 * hidden}]" if packed_fc1 else f"{b}.mlp.fc1.weight"
        rows += [["qkv", "composable", f"{b}.attn.qkv.weight", f"{3 * dim}x{dim}", f"diag({b}.norm1.weight)",
                  f"{dim}x{dim}"],
                 ["proj", "functional", f"{b}.attn.proj.weight", f"{dim}x{dim}",
                  f"{b}.attn.qkv.weight[{2 * dim}:{3 * dim}]", f"{dim}x{dim}"],
                 ["fc1", "composable", f"{b}.mlp.fc1.weight", f"{fc1_rows}x{dim}", f"diag({b}.norm2.weight)",
                  f"{dim}x{dim}"],
                 ["fc2", "functional", f"{b}.mlp.fc2.weight", f"{dim}x{hidden}", up, f"{hidden}x{dim}"]]
    return [[str(k)] + cells for k, cells in enumerate(rows)]


def randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every LayerNorm a non-trivial scale (default init is all ones, which would hide bugs)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm) and m.weight is not None:
                m.weight.copy_(0.5 + 1.5 * torch.rand(m.weight.shape, generator=gen))
    return model


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(model: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]


# --- independent float64 reference of the CD update (paper Sec. 3.3, Eq. (12), App. A.2, Eq. (24)) ---
def normalized(w1: torch.Tensor) -> torch.Tensor:
    """W1 / (||W1||_F / sqrt(rows(W1))), float64."""
    return w1 / (torch.linalg.matrix_norm(w1) / math.sqrt(w1.shape[0]))


def ref_w2(w2: torch.Tensor, w1: torch.Tensor, step: float) -> torch.Tensor:
    """W2 - step * W2 @ W1n @ W1n.T in float64."""
    w1n = normalized(w1.double())
    return w2.double() - step * w2.double() @ w1n @ w1n.T


def ref_block_update(P: dict, b: str, step: float, out: dict) -> None:
    """Expected new qkv/proj/fc1/fc2 of block `b` from pre-step parameters `P`."""
    qkv = P[f"{b}.attn.qkv.weight"]
    d = qkv.shape[0] // 3
    out[f"{b}.attn.qkv.weight"] = ref_w2(qkv, torch.diag(P[f"{b}.norm1.weight"]), step)
    out[f"{b}.attn.proj.weight"] = ref_w2(P[f"{b}.attn.proj.weight"], qkv[2 * d:3 * d], step)
    out[f"{b}.mlp.fc1.weight"] = ref_w2(P[f"{b}.mlp.fc1.weight"], torch.diag(P[f"{b}.norm2.weight"]), step)
    out[f"{b}.mlp.fc2.weight"] = ref_w2(P[f"{b}.mlp.fc2.weight"], P[f"{b}.mlp.fc1.weight"], step)
