"""A tiny GPT in nanoGPT's shape for the family table (`cd.families`): transformers' GPT-2 names (ln_1,
attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj) on `nn.Linear` layers, stored (out, in) where
transformers' `Conv1D` stores (in, out). Written here so that the row needs torch alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.dim, self.heads = dim, heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.c_attn(x).split(self.dim, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class _Mlp(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), _Attention(dim, heads)
        self.ln_2, self.mlp = nn.LayerNorm(dim), _Mlp(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPTShaped(nn.Module):
    """transformer.{wte, wpe, h.N, ln_f} and an lm_head tied to wte, as nanoGPT's GPT."""

    def __init__(self, vocab: int = 64, context: int = 16, dim: int = 32, depth: int = 2, heads: int = 2):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, dim), wpe=nn.Embedding(context, dim),
            h=nn.ModuleList(Block(dim, heads) for _ in range(depth)), ln_f=nn.LayerNorm(dim)))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def example_input(self) -> torch.Tensor:
        """Token ids (1, 8), for the checks of `find_pairs` (`cd.verify.example_input`)."""
        return torch.zeros(1, 8, dtype=torch.long)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(ids) + self.transformer.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))
