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

Discovery is structural, then checked: a block is any module with children `norm1`, `attn` (holding
`qkv` and `proj`, or class attention's `q`, `k`, `v` and `proj`), `norm2` and `mlp` (holding `fc1` and
`fc2`); a patch-merging layer is any module with children `norm` and `reduction`. This finds timm
ViT/DeiT/BEiT/CaiT/XCiT `blocks.N`, Swin `layers.N.blocks.M` and `layers.N.downsample`, and attention
variants that keep the `qkv`/`proj` names (extra parameters in `attn`, e.g. attention-sink biases, are
ignored). Every pair is then checked against a forward pass on the `meta` device (`cd/verify.py`), so
that a block with the same names but another computation (res-post-norm, as in Swin V2) is refused,
not matched wrongly. A block that does not fit (gated MLP unless `gated_mlp`, no affine norm, no qkv)
is refused too: `UnsupportedModelError` names the block and its type.

Print the pairs of any timm model (built on the `meta` device, no weights, no memory):

    python -m cd --model vit_base_patch16_224
    python -m cd --model swin_tiny_patch4_window7_224
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from .verify import UnsupportedModelError, refuse_shared, verify_pairs
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
    """A Transformer block by its children norm1, attn, norm2, mlp (timm ViT/DeiT/Swin `Block`). Whether it
    really is pre-norm is checked against a forward pass (`cd.verify`)."""
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
    """The Transformer blocks of `model` in model order, with unwrapped-model names.

    Used by CD (pairs) and TWEO (block outputs). Nested matches inside a block are not searched.
    """
    return list(_outermost(unwrap_model(model), is_prenorm_block))


def _join(prefix: str, *parts: str) -> str:
    return ".".join(p for p in (prefix, *parts) if p)


def _refuse(name: str, block: nn.Module, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"block '{name}' ({type(block).__name__}) is not supported by CD: {why}")


def _composable(name: str, block: nn.Module, norm: str, layer: str, role: str) -> Pair:
    """(diag(<norm>.weight), <layer>.weight), refused unless the norm has an affine scale of the layer's width."""
    g = _scale_weight(block.get_submodule(norm))
    w = _matrix_weight(block.get_submodule(layer))
    if g is None or w is None or g.shape[0] != w.shape[1]:
        raise _refuse(name, block, f"{role} needs an affine {norm} (1-D weight) of {layer}'s input width")
    return Pair(_join(name, layer, "weight"), role, "composable", name, _join(name, norm, "weight"), w, g)


def _attention_pairs(name: str, block: nn.Module) -> list[Pair]:
    """qkv and proj pairs of a fused-qkv attention, or of a class attention (separate q, k, v layers:
    CaiT / XCiT `ClassAttn`), where q, k and v each pair with norm1 and proj pairs with v."""
    attn = block.attn
    proj = _matrix_weight(_child(attn, "proj"))
    qkv = _matrix_weight(_child(attn, "qkv"))
    if qkv is not None and proj is not None:
        # Fused qkv rows are [Q; K; V] in equal thirds (timm reshapes the output to (3, heads, head_dim)).
        if qkv.shape[0] % 3 or proj.shape[1] != qkv.shape[0] // 3:
            raise _refuse(name, block, "attn.qkv is not 3x attn.proj's input width")
        d = qkv.shape[0] // 3
        return [_composable(name, block, "norm1", "attn.qkv", "qkv"),
                Pair(_join(name, "attn.proj.weight"), "proj", "functional", name, _join(name, "attn.qkv.weight"),
                     proj, qkv, (2 * d, 3 * d))]
    q, k, v = (_matrix_weight(_child(attn, n)) for n in ("q", "k", "v"))
    if q is not None and k is not None and v is not None and proj is not None:
        if proj.shape[1] != v.shape[0]:
            raise _refuse(name, block, "attn.v's output width is not attn.proj's input width")
        return [*(_composable(name, block, "norm1", f"attn.{n}", "qkv") for n in ("q", "k", "v")),
                Pair(_join(name, "attn.proj.weight"), "proj", "functional", name, _join(name, "attn.v.weight"),
                     proj, v)]
    raise _refuse(name, block, f"attention {type(attn).__name__} has neither a fused qkv nor q, k, v "
                  "Linear layers with a proj")


def _mlp_pairs(name: str, block: nn.Module, gated_mlp: bool) -> list[Pair]:
    """fc1 and fc2 pairs of a plain MLP fc2(act(fc1(x))); gated MLPs with `gated_mlp` (`_gated_pairs`)."""
    mlp = block.mlp
    fc1, fc2 = _matrix_weight(_child(mlp, "fc1")), _matrix_weight(_child(mlp, "fc2"))
    gated = _child(mlp, "fc1_g") is not None or (fc1 is not None and fc2 is not None
                                                   and fc1.shape[0] == 2 * fc2.shape[1])
    if gated and gated_mlp:
        return _gated_pairs(name, block)
    if gated:
        raise _refuse(name, block, f"gated MLP {type(mlp).__name__} (fc2(act(W_gate x) * W_up x), such as "
                      "SwiGLU); the paper's pairs are defined for fc2(act(fc1(x))); gated_mlp=True "
                      "(cd.gated_mlp=true) adds gated pairs, beyond the paper")
    if fc1 is None or fc2 is None or fc2.shape[1] != fc1.shape[0]:
        raise _refuse(name, block, f"MLP {type(mlp).__name__} is not fc1 -> act -> fc2 with matching widths")
    return [_composable(name, block, "norm2", "mlp.fc1", "fc1"),
            Pair(_join(name, "mlp.fc2.weight"), "fc2", "functional", name, _join(name, "mlp.fc1.weight"),
                 fc2, fc1)]


def _gated_pairs(name: str, block: nn.Module) -> list[Pair]:
    """Pairs of a gated MLP W_down (act(W_gate x) * (W_up x)) (opt-in; cd/README.md, "Gated MLPs").

    fc1 (composable): norm2 with each matrix it feeds, W_gate and W_up (timm `SwiGLU`: fc1_g, fc1_x), or
    the packed [W_gate; W_up] (timm `GluMlp`: one fc1, halves split by `chunk`).
    fc2 (functional): W_up -> W_down, the route that is linear in x for a fixed gate, as fc1 -> fc2 is
    through GELU; W_gate gets no pair with W_down (it enters through the nonlinearity only).
    Refused when a norm sits between the product and W_down (timm `scale_mlp`).
    """
    mlp = block.mlp
    if not isinstance(_child(mlp, "norm"), (nn.Identity, type(None))):
        raise _refuse(name, block, f"gated MLP {type(mlp).__name__} has a norm before fc2 (scale_mlp); the "
                      "gated pairs are defined for fc2(act(W_gate x) * W_up x)")
    down = _matrix_weight(_child(mlp, "fc2"))
    if _child(mlp, "fc1_g") is not None:
        up = _matrix_weight(_child(mlp, "fc1_x"))
        if up is None or down is None or down.shape[1] != up.shape[0]:
            raise _refuse(name, block, "gated MLP: fc1_x's output width is not fc2's input width")
        return [_composable(name, block, "norm2", "mlp.fc1_g", "fc1"),
                _composable(name, block, "norm2", "mlp.fc1_x", "fc1"),
                Pair(_join(name, "mlp.fc2.weight"), "fc2", "functional", name, _join(name, "mlp.fc1_x.weight"),
                     down, up)]
    packed = _matrix_weight(mlp.fc1)
    if getattr(mlp, "chunk_dim", -1) != -1 or not isinstance(getattr(mlp, "gate_last", None), bool):
        raise _refuse(name, block, f"gated MLP {type(mlp).__name__}: cannot tell which half of fc1 is W_up "
                      "(expected timm GluMlp's gate_last and a chunk over the last dim)")
    h = down.shape[1]
    rows = (0, h) if mlp.gate_last else (h, 2 * h)  # GluMlp: x1, x2 = chunk(2); x1 * act(x2) if gate_last
    return [_composable(name, block, "norm2", "mlp.fc1", "fc1"),
            Pair(_join(name, "mlp.fc2.weight"), "fc2", "functional", name, _join(name, "mlp.fc1.weight"),
                 down, packed, rows)]


def _collect(root: nn.Module, pairs: list[Pair], types: dict[str, str], gated_mlp: bool) -> None:
    """Append the pairs of every block and patch-merging layer of `root`, in model order (into `pairs`, so
    that the caller sees those found before a refusal); `types`: block name -> class name."""
    for name, module in _outermost(root, lambda m: is_prenorm_block(m) or _is_patch_merging(m)):
        types[name] = type(module).__name__
        if is_prenorm_block(module):
            pairs += _attention_pairs(name, module) + _mlp_pairs(name, module, gated_mlp)
        elif _scale_weight(module.norm) is not None and _scale_weight(module.norm).shape[0] == \
                module.reduction.weight.shape[0] != module.reduction.weight.shape[1]:
            raise _refuse(name, module, "its norm follows the reduction (post-norm, as in Swin V2); CD pairs "
                          "a norm with the layer it feeds")
        else:
            pairs.append(_composable(name, module, "norm", "reduction", "reduction"))


def find_pairs(model: nn.Module, example_input: Optional[torch.Tensor] = None,
               verify: bool = True, gated_mlp: bool = False) -> list[Pair]:
    """All CD matrix pairs of `model`, in model order (paper Sec. 3.2), checked against its forward pass.

    Args:
        model: a timm ViT/DeiT/Swin (or any model built from pre-norm blocks), possibly wrapped in
            DDP/DataParallel (`.module`) and/or torch.compile (`._orig_mod`).
        example_input: a tensor of the shape the model takes, for the check (`cd.verify`); only its
            shape is used. Default: from timm's `patch_embed.img_size` / `pretrained_cfg`.
        verify: run the check (one forward on the `meta` device: no memory, weights untouched).
        gated_mlp: pair gated MLPs (SwiGLU) as `_gated_pairs` defines (beyond the paper); otherwise
            they are refused.

    Returns:
        list of Pair; names are those of the unwrapped model. ViT-T/S/B: 4 pairs per block (48 for
        depth 12); Swin-T: 48 block pairs + 3 patch-merging pairs = 51.

    Raises:
        UnsupportedModelError (a ValueError): no pair was found, a block does not fit the pairs (gated
            MLP, no affine norm, no qkv), or the forward pass contradicts a pair (res-post-norm blocks
            such as Swin V2); the message names the block and its type.
    """
    root = unwrap_model(model)
    pairs: list[Pair] = []
    types: dict[str, str] = {}
    try:
        _collect(root, pairs, types, gated_mlp)
    except UnsupportedModelError as refusal:
        if verify and pairs:  # report the first block in model order whose pairs the forward contradicts
            try:
                verify_pairs(root, pairs, types, example_input)
            except UnsupportedModelError as earlier:
                if earlier.__cause__ is None:  # a contradicted pair, not a forward that failed to run
                    raise earlier from None
        raise refusal
    if not pairs:
        raise UnsupportedModelError(
            f"no matrix pair found in {type(root).__name__}. CD looks for pre-norm Transformer blocks "
            "(children norm1, attn.qkv or attn.q/k/v, attn.proj, norm2, mlp.fc1, mlp.fc2, as in timm "
            "ViT/DeiT/Swin) and patch-merging layers (norm, reduction). Without CD (cd.enabled=false) the model "
            "trains as usual.")
    refuse_shared(pairs, types)
    if verify:
        verify_pairs(root, pairs, types, example_input)
    return pairs
