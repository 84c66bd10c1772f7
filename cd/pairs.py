"""Matrix-pair discovery for Colinearity Decay (paper Sec. 3.2, "Matrix Pairs in Transformer Blocks").

A pair is an ordered (W1 upstream, W2 downstream) couple along the data flow, so that W2 @ W1 is the
(exact or surrogate) composed map; the CD update only ever writes W2 (paper Sec. 3.3, Eq. (12)),
except for the ablation target set C. In torch `nn.Linear` layout (weight = out x in) the pairs of a
pre-norm block are:

    role       kind         W1 (upstream)                    W2 (downstream)
    qkv        composable   diag(norm1.weight)               attn.qkv.weight      (3D x D)
    proj       functional   attn.qkv.weight[2D:3D]  (V rows) attn.proj.weight     (D x D)
    fc1        composable   diag(norm2.weight)               mlp.fc1.weight       (H x D)
    fc2        functional   mlp.fc1.weight                   mlp.fc2.weight       (D x H)
    reduction  composable   diag(downsample.norm.weight)     downsample.reduction.weight (Swin patch merging)

Discovery is structural, not by name matching: a pre-norm block is any module with children `norm1`,
`attn` (holding `qkv` and `proj`), `norm2` and `mlp` (holding `fc1` and `fc2`); a patch-merging layer
is any module with children `norm` and `reduction`. This finds timm ViT/DeiT `blocks.N`, Swin
`layers.N.blocks.M` and `layers.N.downsample`, and attention variants that keep the `qkv`/`proj`
names (extra parameters in `attn`, e.g. attention-sink biases, are ignored). It assumes pre-norm
semantics (norm1 feeds qkv); res-post-norm blocks such as SwinV2 would be matched wrongly, so they
are not supported. Blocks whose sub-layers do not fit (gated MLPs, no affine norm, no fused qkv) lose
only the affected pair, with a warning.

Print the pairs of any timm model (built on the `meta` device, no weights, no memory):

    python -m cd --model vit_base_patch16_224
    python -m cd --model swin_tiny_patch4_window7_224
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from .wrappers import unwrap_model

ROLES = ("qkv", "proj", "fc1", "fc2", "reduction")


@dataclass(frozen=True, eq=False)
class Pair:
    """One ordered matrix pair (W1 upstream, W2 downstream); only W2 receives the CD update.

    Attributes:
        name: full parameter name of the downstream weight W2 in the unwrapped model.
        role: 'qkv' | 'proj' | 'fc1' | 'fc2' | 'reduction' (the downstream layer).
        kind: 'composable' (W1 is a norm scale, W2 @ diag(g) is exact) or 'functional'.
        block: name of the module holding the pair ('blocks.3', 'layers.1.downsample').
        upstream_name: full name of the upstream parameter (norm scale vector or weight matrix).
        downstream: the W2 parameter, shape (out, mid).
        upstream: the upstream parameter: a 1-D scale (mid,) for composable pairs, a weight
            matrix for functional ones (for 'proj' the whole fused qkv weight, see upstream_rows).
        upstream_rows: (start, stop) rows of `upstream` that form W1, or None for all rows
            (the V rows [2D:3D] of the fused qkv weight for the 'proj' pair).
    """

    name: str
    role: str
    kind: str
    block: str
    upstream_name: str
    downstream: nn.Parameter
    upstream: nn.Parameter
    upstream_rows: Optional[tuple[int, int]] = None

    @property
    def diagonal(self) -> bool:
        """True when W1 = diag(upstream) (composable pairs: a norm scale)."""
        return self.kind == "composable"

    def w1(self) -> torch.Tensor:
        """W1 as stored: the scale vector (mid,) if diagonal, else the (mid, in) matrix (a view)."""
        if self.upstream_rows is None:
            return self.upstream
        start, stop = self.upstream_rows
        return self.upstream[start:stop]

    def w2(self) -> torch.Tensor:
        """W2, shape (out, mid)."""
        return self.downstream

    @property
    def w1_shape(self) -> tuple[int, int]:
        """Shape of W1 as a matrix ((mid, mid) for a diagonal W1)."""
        if self.diagonal:
            n = self.upstream.shape[0]
            return (n, n)
        return tuple(self.w1().shape)

    @property
    def w2_shape(self) -> tuple[int, int]:
        return tuple(self.downstream.shape)

    @property
    def upstream_label(self) -> str:
        """Human-readable W1: 'diag(x.norm1.weight)' or 'x.attn.qkv.weight[1536:2304]'."""
        if self.diagonal:
            return f"diag({self.upstream_name})"
        if self.upstream_rows is not None:
            return f"{self.upstream_name}[{self.upstream_rows[0]}:{self.upstream_rows[1]}]"
        return self.upstream_name


def _child(module: nn.Module, name: str) -> Optional[nn.Module]:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Module) else None


def _matrix_weight(module: Optional[nn.Module]) -> Optional[nn.Parameter]:
    """The 2-D weight of a Linear-like module (duck-typed so Linear subclasses also count)."""
    w = getattr(module, "weight", None) if module is not None else None
    return w if isinstance(w, nn.Parameter) and w.dim() == 2 else None


def _scale_weight(module: Optional[nn.Module]) -> Optional[nn.Parameter]:
    """The 1-D affine scale of a LayerNorm/RMSNorm-like module, or None (no affine scale)."""
    w = getattr(module, "weight", None) if module is not None else None
    return w if isinstance(w, nn.Parameter) and w.dim() == 1 else None


def is_prenorm_block(module: nn.Module) -> bool:
    """A pre-norm Transformer block: children norm1, attn, norm2, mlp (timm ViT/DeiT/Swin `Block`)."""
    return all(_child(module, n) is not None for n in ("norm1", "attn", "norm2", "mlp"))


def _is_patch_merging(module: nn.Module) -> bool:
    return _child(module, "norm") is not None and _matrix_weight(_child(module, "reduction")) is not None


def _outermost(root: nn.Module, is_match) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every module matching `is_match` that is not inside an earlier match,
    in model order."""
    inside: Optional[str] = None
    for name, module in root.named_modules():
        if inside is not None and (name == inside or name.startswith(inside + ".")):
            continue
        if is_match(module):
            yield name, module
            inside = name


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The pre-norm Transformer blocks of `model` in model order, with unwrapped-model names.

    Used by CD (pairs) and TWEO (block outputs). Nested matches inside a block are not searched.
    """
    return list(_outermost(unwrap_model(model), is_prenorm_block))


def _join(prefix: str, *parts: str) -> str:
    return ".".join(p for p in (prefix, *parts) if p)


def _block_pairs(name: str, block: nn.Module) -> Iterator[Pair]:
    """The (up to) four pairs of one pre-norm block, in data-flow order qkv, proj, fc1, fc2."""
    attn, mlp = block.attn, block.mlp
    g1, g2 = _scale_weight(block.norm1), _scale_weight(block.norm2)
    qkv, proj = _matrix_weight(_child(attn, "qkv")), _matrix_weight(_child(attn, "proj"))
    fc1, fc2 = _matrix_weight(_child(mlp, "fc1")), _matrix_weight(_child(mlp, "fc2"))
    skipped = []

    if qkv is not None and g1 is not None and g1.shape[0] == qkv.shape[1]:
        yield Pair(_join(name, "attn.qkv.weight"), "qkv", "composable",
                   name, _join(name, "norm1.weight"), qkv, g1)
    else:
        skipped.append("qkv (needs attn.qkv and an affine norm1 of matching width)")

    # Fused qkv rows are [Q; K; V] in equal thirds (timm reshapes the output to (3, heads, head_dim)).
    if qkv is not None and proj is not None and qkv.shape[0] % 3 == 0 and proj.shape[1] == qkv.shape[0] // 3:
        d = qkv.shape[0] // 3
        yield Pair(_join(name, "attn.proj.weight"), "proj", "functional",
                   name, _join(name, "attn.qkv.weight"), proj, qkv, (2 * d, 3 * d))
    else:
        skipped.append("proj (needs a fused attn.qkv of 3x attn.proj's input width)")

    if fc1 is not None and g2 is not None and g2.shape[0] == fc1.shape[1]:
        yield Pair(_join(name, "mlp.fc1.weight"), "fc1", "composable",
                   name, _join(name, "norm2.weight"), fc1, g2)
    else:
        skipped.append("fc1 (needs mlp.fc1 and an affine norm2 of matching width)")

    # A gated MLP has fc1 twice as wide as fc2's input; the paper leaves gated MLPs out.
    if fc1 is not None and fc2 is not None and fc2.shape[1] == fc1.shape[0]:
        yield Pair(_join(name, "mlp.fc2.weight"), "fc2", "functional",
                   name, _join(name, "mlp.fc1.weight"), fc2, fc1)
    else:
        skipped.append("fc2 (needs mlp.fc1 -> mlp.fc2 without a gate)")

    if skipped:
        warnings.warn(f"cd.find_pairs: block '{name}' ({type(block).__name__}) has no pair "
                      + "; ".join(skipped), stacklevel=3)


def find_pairs(model: nn.Module) -> list[Pair]:
    """All CD matrix pairs of `model`, in model order (paper Sec. 3.2).

    Args:
        model: a timm ViT/DeiT/Swin (or any model built from pre-norm blocks), possibly wrapped in
            DDP/DataParallel (`.module`) and/or torch.compile (`._orig_mod`).

    Returns:
        list of Pair; names are those of the unwrapped model. ViT-T/S/B: 4 pairs per block (48 for
        depth 12); Swin-T: 48 block pairs + 3 patch-merging pairs = 51.

    Raises:
        ValueError: no pair was found (the model has no recognisable pre-norm block).
    """
    root = unwrap_model(model)
    pairs: list[Pair] = []
    for name, module in _outermost(root, lambda m: is_prenorm_block(m) or _is_patch_merging(m)):
        if is_prenorm_block(module):
            pairs.extend(_block_pairs(name, module))
            continue
        g, red = _scale_weight(module.norm), _matrix_weight(module.reduction)
        if g is not None and g.shape[0] == red.shape[1]:
            pairs.append(Pair(_join(name, "reduction.weight"), "reduction", "composable", name,
                              _join(name, "norm.weight"), red, g))
    if not pairs:
        raise ValueError(
            f"cd.find_pairs: no matrix pair found in {type(root).__name__}. CD looks for pre-norm blocks "
            "(children norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2, as in timm ViT/DeiT/Swin) and "
            "patch-merging layers (norm, reduction).")
    return pairs
