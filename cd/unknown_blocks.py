"""Transformer blocks under names no layout knows, so that they are refused rather than silently left out.

`cd.pairs` finds blocks by their layout's names (`cd.layouts`). A model that mixes blocks of a known layout with
blocks of its own names would otherwise have only the known ones paired by CD and hooked by TWEO, while the paper
applies both to every block. This module tells such a block by its structure: a module, outside every block and
patch-merging layer found by name and holding none of them, whose direct children include

- an attention: an `nn.MultiheadAttention`, or a module holding a fused qkv layer (a child named `*qkv*`, or
  GPT-2's `c_attn`) or separate q, k and v layers, and an output layer (`proj`, `out`, `o_proj`, ...);
- a norm: a module with a 1-D affine `weight` (LayerNorm, RMSNorm);
- an MLP: another module holding at least two matrix layers and no attention.

Only the direct children are read, so a container of blocks (a Sequential, a Swin stage) is not taken for one.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

from torch import nn

# the names the attention layers go by across libraries (timm, transformers, lucidrains' vit-pytorch, Llama's
# original code); a fused qkv is any name containing 'qkv'
_Q, _K, _V = ("q", "q_proj", "query", "to_q", "wq"), ("k", "k_proj", "key", "to_k", "wk"), \
    ("v", "v_proj", "value", "to_v", "wv")
_FUSED = ("c_attn",)
_OUT = ("proj", "out", "out_proj", "o_proj", "c_proj", "to_out", "wo", "o", "dense")


def _is_matrix_layer(module: nn.Module) -> bool:
    """A Linear-like layer: a 2-D `weight` Parameter, or a container whose first child is one (an output layer
    kept as Sequential(Linear, Dropout))."""
    w = getattr(module, "weight", None)
    if isinstance(w, nn.Parameter) and w.dim() == 2:
        return True
    first = next(module.children(), None)
    return first is not None and _is_matrix_layer(first)


def _is_attention(module: nn.Module) -> bool:
    if isinstance(module, nn.MultiheadAttention):
        return True
    layers = {name for name, child in module.named_children() if _is_matrix_layer(child)}
    fused = any("qkv" in name.lower() or name in _FUSED for name in layers)
    separate = all(layers.intersection(names) for names in (_Q, _K, _V))
    return (fused or separate) and bool(layers.intersection(_OUT))


def _is_norm(module: nn.Module) -> bool:
    """A norm with an affine scale: a 1-D `weight` Parameter on a module without children."""
    w = getattr(module, "weight", None)
    return isinstance(w, nn.Parameter) and w.dim() == 1 and next(module.children(), None) is None


def _is_mlp(module: nn.Module) -> bool:
    """At least two matrix layers and no attention anywhere inside (so an attention is not read as an MLP)."""
    modules = list(module.modules())
    if any(_is_attention(m) for m in modules):
        return False
    weights = [m for m in modules if isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.dim() == 2]
    return len(weights) >= 2


def block_parts(module: nn.Module) -> Optional[str]:
    """'attention mix (Attention), norm ln_a (LayerNorm), MLP ffn (Mlp)' when the direct children of `module` are
    those of a Transformer block, else None."""
    children = list(module.named_children())

    def first(test: Callable[[nn.Module], bool], taken: tuple[str, ...]) -> Optional[tuple[str, nn.Module]]:
        return next(((n, c) for n, c in children if n not in taken and test(c)), None)

    attn = first(_is_attention, ())
    norm = first(_is_norm, (attn[0],)) if attn else None
    mlp = first(_is_mlp, (attn[0], norm[0])) if norm else None
    if mlp is None:
        return None
    return ", ".join(f"{role} {name} ({type(child).__name__})"
                     for role, (name, child) in (("attention", attn), ("norm", norm), ("MLP", mlp)))


def unknown_blocks(root: nn.Module, known: Callable[[nn.Module], bool]) -> Iterator[tuple[str, nn.Module, str]]:
    """(name, module, `block_parts`) of every module of `root`, in model order, that is a Transformer block by its
    structure but is neither inside nor around a module `known` accepts (a block of a layout, a patch-merging
    layer)."""
    modules = list(root.named_modules())
    found = [name for name, module in modules if known(module)]

    def related(name: str, other: str) -> bool:  # one is the other, or holds it
        return name == other or not other or name.startswith(other + ".") or not name or other.startswith(name + ".")

    for name, module in modules:
        if any(related(name, k) for k in found):
            continue
        parts = block_parts(module)
        if parts is not None:
            yield name, module, parts
