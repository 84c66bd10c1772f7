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
ViT/DeiT/BEiT/CaiT/XCiT `blocks.N` (XCiT's XCA blocks then fail the V-order check below), Swin
`layers.N.blocks.M` and `layers.N.downsample`, and attention variants that keep the `qkv`/`proj` names (extra
parameters in `attn`, e.g. attention-sink biases, are ignored). Other libraries name the same layers
differently: `LAYOUTS` (`cd/layouts.py`) maps their names onto these roles (GPT-2, as transformers and nanoGPT
name it; transformers' ViT and Llama; MMDetection's Swin;
torchvision's ViT, whose `nn.MultiheadAttention` holds the fused qkv as its own Parameter `in_proj_weight`, and
Swin), and a model with names of its own passes its own `Layout`s as `layouts=`, checked as the built-in ones. Each
layer's storage is read off the layer itself: `nn.Linear` stores (out, in), transformers' `Conv1D` (in, out),
so that nanoGPT's `c_attn` (nn.Linear) and transformers' (Conv1D) pair alike, and each matrix of a pair is read
with its own storage; a layer whose type and shape do not tell it takes its layout's `transposed`
(`_Block.functional`).
Every pair is then checked against a forward pass on the `meta` device (`cd/verify.py`), so
that a block with the same names but another computation (res-post-norm, as in Swin V2), or a matrix the forward
multiplies the other way round from the storage read (`x @ W` for one read as (out, in)), is refused,
not matched wrongly; a fused qkv's V rows are checked by one real forward with them set to zero, and the
order in which proj reads V's channels by one more with some of them set to zero (`cd/values.py`), so that a qkv
laid out per head or in another order, heads merged in another order, or channels mixed (XCiT's XCA) are
refused. A block that does not fit (gated MLP unless `gated_mlp`, no affine norm, no qkv, grouped-query
attention) is refused too: `UnsupportedModelError` names the block and its type; so does a block that no layout
finds beside blocks that one does (told by its structure, `cd/unknown_blocks.py`), which would otherwise be left
out. Half a block beside them (a norm with only an attention or only an MLP: a residual half block or a head, which
the structure does not tell apart) is named in one warning per model instead, and left out.

Print the pairs of any timm model (built on the `meta` device, no weights; a small CPU copy runs the checks on
real numbers, `cd/__main__.py`):

    python -m cd --model vit_base_patch16_224
    python -m cd --model swin_tiny_patch4_window7_224
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings
import weakref
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .adapters import adapter_parameters, refuse_adapters
from .layouts import LAYOUTS, Layout, check_layouts
from .unknown_blocks import (_is_norm, _matrices, _own_matrices, _Reader, block_note, unknown_blocks,
                             unknown_half_blocks, unpaired_part)
from .values import check_channel_order
from .verify import (_MOVES, ADAPTER_FIX, UnsupportedModelError, _fully_sharded, _meta_like, _meta_slots,
                     _Provenance, _transformers_lm, example_input as default_example, refuse_fsdp1, refuse_shared,
                     refuse_split_devices, verify_pairs)
from .wrappers import check_model, unwrap_model

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
        upstream_rows: (start, stop) rows of W1 as the layer applies it, or None for all rows
            (the V rows [2D:3D] of the fused qkv weight for the 'proj' pair).
        transposed: W2 is stored (in, out), as transformers' `Conv1D` (GPT-2) stores it; `w2()` is then a
            transposed view, so the update is the same (out, in) math.
        upstream_transposed: the same for a functional pair's W1 (`w1()`); None (the default) reads it as
            `transposed` says, and is replaced by that value, so the field is always a bool once made.
    """

    name: str
    role: str
    kind: str
    block: str
    upstream_name: str
    downstream: nn.Parameter
    upstream: nn.Parameter
    upstream_rows: Optional[tuple[int, int]] = None
    transposed: bool = False
    upstream_transposed: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.upstream_transposed is None:  # one storage for both matrices unless told otherwise
            object.__setattr__(self, "upstream_transposed", self.transposed)

    @property
    def diagonal(self) -> bool:
        """True when W1 = diag(upstream) (composable pairs: a norm scale)."""
        return self.kind == "composable"

    @staticmethod
    def _as_used(w: torch.Tensor, transposed: bool) -> torch.Tensor:
        """A stored weight as the (out, in) matrix the layer applies: a transposed view for (in, out) storage."""
        return w.t() if transposed else w

    def w1(self) -> torch.Tensor:
        """W1: the scale vector (mid,) if diagonal, else the (mid, in) matrix (a view of the parameter)."""
        if self.diagonal:
            return self.upstream
        w = self._as_used(self.upstream, self.upstream_transposed)
        if self.upstream_rows is None:
            return w
        start, stop = self.upstream_rows
        return w[start:stop]

    def w2(self) -> torch.Tensor:
        """W2, shape (out, mid) (a view of the parameter)."""
        return self._as_used(self.downstream, self.transposed)

    @property
    def w1_shape(self) -> tuple[int, int]:
        """Shape of W1 as a matrix ((mid, mid) for a diagonal W1)."""
        if self.diagonal:
            n = self.upstream.shape[0]
            return (n, n)
        return tuple(self.w1().shape)

    @property
    def w2_shape(self) -> tuple[int, int]:
        return tuple(self.w2().shape)

    @property
    def upstream_label(self) -> str:
        """Human-readable W1: 'diag(x.norm1.weight)', 'x.attn.qkv.weight[1536:2304]', or with `^T` for a weight
        stored (in, out): 'x.attn.c_attn.weight^T[1536:2304]'."""
        if self.diagonal:
            return f"diag({self.upstream_name})"
        name = self.upstream_name + ("^T" if self.upstream_transposed else "")
        if self.upstream_rows is not None:
            return f"{name}[{self.upstream_rows[0]}:{self.upstream_rows[1]}]"
        return name


def _child(module: nn.Module, name: str) -> Optional[nn.Module]:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Module) else None


def _module(block: nn.Module, path: Optional[str]) -> Optional[nn.Module]:
    """The submodule at dotted `path` of `block`, or None (no path, or no such module)."""
    for part in path.split(".") if path else [None]:
        block = _child(block, part) if part is not None and block is not None else None
    return block


def _matrix_weight(module: Optional[nn.Module]) -> Optional[nn.Parameter]:
    """The 2-D weight of a Linear-like module (duck-typed so Linear subclasses also count)."""
    w = getattr(module, "weight", None) if module is not None else None
    return w if isinstance(w, nn.Parameter) and w.dim() == 2 else None


def _scale_weight(module: Optional[nn.Module]) -> Optional[nn.Parameter]:
    """The 1-D affine scale of a LayerNorm/RMSNorm-like module, or None (no affine scale)."""
    w = getattr(module, "weight", None) if module is not None else None
    return w if isinstance(w, nn.Parameter) and w.dim() == 1 else None


def _resolves(module: nn.Module, path: str) -> bool:
    """Whether `path` names a submodule of `module`, or a Parameter a submodule holds itself (`in_proj_weight`)."""
    if _module(module, path) is not None:
        return True
    parent, _, attr = path.rpartition(".")
    owner = _module(module, parent) if parent else module
    return owner is not None and isinstance(owner._parameters.get(attr), nn.Parameter)


def _fitted(module: nn.Module, lay: Layout) -> Layout:
    """`lay` as it reads `module`: with an nn.MultiheadAttention as its attention, that module's own qkv and output
    layer."""
    attn = lay.proj.rpartition(".")[0]
    if attn and isinstance(_module(module, attn), nn.MultiheadAttention):
        # an nn.MultiheadAttention where the layout has its attention (torchvision's ViT, or a block of one's own
        # under timm's names): its fused [Q; K; V] is its own Parameter `in_proj_weight`, its output layer `out_proj`
        return dataclasses.replace(lay, qkv=f"{attn}.in_proj_weight", proj=f"{attn}.out_proj", q_k_v=None)
    return lay


def _complete(module: nn.Module, lay: Layout) -> bool:
    """Whether the layers every block of `lay` has (norm1, norm2, proj, fc2) are all there in `module`."""
    return all(_resolves(module, path) for path in (lay.norm1, lay.norm2, lay.proj, lay.fc2))


def layouts_of(module: nn.Module, layouts: tuple[Layout, ...] = LAYOUTS) -> list[Layout]:
    """The layouts of `layouts` whose block `module` is, in their order (`_fitted`): of the layouts whose top-level
    children it has, every one whose norm1, norm2, proj and fc2 are all there (several describe one parallel branch
    or expert each: `_collect` pairs them all); when none is, the first of them whose MLP output layer (`fc2`) is
    there (timm's `mlp.fc2`, torchvision's `mlp.3`), else the first (which then names what is missing); [] when no
    layout's children are there."""
    fits = [_fitted(module, lay) for lay in layouts if all(_child(module, c) is not None for c in lay.children)]
    complete = [lay for lay in fits if _complete(module, lay)]
    if complete:
        return complete
    lay = next((lay for lay in fits if _matrix_weight(_module(module, lay.fc2)) is not None), next(iter(fits), None))
    return [] if lay is None else [lay]


def layout_of(module: nn.Module, layouts: tuple[Layout, ...] = LAYOUTS) -> Optional[Layout]:
    """The first of `layouts_of`, or None."""
    return next(iter(layouts_of(module, layouts)), None)


def _is_patch_merging(module: nn.Module) -> bool:
    return _child(module, "norm") is not None and _matrix_weight(_child(module, "reduction")) is not None


def _matches(root: nn.Module, layouts: tuple[Layout, ...], merging: bool) -> list[tuple[str, nn.Module]]:
    """(name, module) of the blocks of `layouts` in `root` (and, with `merging`, its patch-merging layers), in model
    order; nested matches inside one are not searched.

    A module with a layout's top-level children but not all its layers (`_complete`) is a block only when no
    module inside it has them all: otherwise it is a container whose children happen to carry the names (a
    ModuleList of blocks [attention, MLP], for a layout '0.to_qkv', '1.net.0', ...), and its children are searched.
    """
    modules = list(root.named_modules())
    complete = [name for name, module in modules if any(_complete(module, lay) for lay in layouts_of(module, layouts))]

    def is_match(name: str, module: nn.Module) -> bool:
        if not layouts_of(module, layouts):
            return merging and _is_patch_merging(module)
        return name in complete or not any(c.startswith(name + ".") or (not name and c) for c in complete)

    out: list[tuple[str, nn.Module]] = []
    for name, module in modules:
        if out and (name == out[-1][0] or name.startswith(out[-1][0] + ".") or not out[-1][0]):
            continue
        if is_match(name, module):
            out.append((name, module))
    return out


def find_blocks(model: nn.Module, layouts: Sequence[Layout] = LAYOUTS) -> list[tuple[str, nn.Module]]:
    """The pre-norm Transformer blocks of `model` in model order, with unwrapped-model names: the blocks of every
    layout of `layouts` (`cd.layouts`; by default `LAYOUTS`: timm's `blocks.N` and `layers.N.blocks.M`, GPT-2's
    `h.N` as transformers and nanoGPT name it, transformers' ViT and Llama layers, MMDetection's Swin blocks,
    torchvision's ViT and Swin blocks).

    Used by TWEO (block outputs A_l, read with `residual_stream`) and scripts/mechanism.py. Whether a block's output
    is the residual stream is decided per forward, by `residual_stream`, not per library. Nested matches inside a
    block are not searched.

    Raises:
        UnsupportedModelError: beside the blocks found, a Transformer block under names no layout has
            (`refuse_unknown_blocks`), which TWEO would otherwise leave out.
        TypeError: `model` is no nn.Module (`cd.wrappers.check_model`).

    Warns (once per model): naming the half blocks beside the blocks found (a norm with only an attention or only
    an MLP: `_warn_half_blocks`), which TWEO leaves out.
    """
    layouts = check_layouts(layouts)
    root = unwrap_model(model, "TWEO (find_blocks)")  # TWEO's first use of its model
    blocks = _matches(root, layouts, merging=False)
    if blocks:  # a model with no known block is refused by the caller, naming what it looked for
        refuse_unknown_blocks(root, layouts)
    return blocks


def residual_stream(name: str, block: nn.Module, args: tuple, output: object,
                    kwargs: Optional[dict] = None) -> torch.Tensor:
    """The residual stream after `block` (TWEO's A_l, App. A.3) from what its forward returned.

    The rule: a tensor is the stream itself (timm, torchvision, MMDetection's Swin, nanoGPT, and transformers'
    GPT2Block, ViTLayer and LlamaDecoderLayer in transformers 5.24). A tuple or list is read as transformers 4.x
    layers return theirs, `(hidden_states, present, attentions)`, where `hidden_states` is the stream after the
    block; its first element is taken only when it has the shape of the block's input, its forward's first
    parameter passed by position or by keyword (`args`, `kwargs`: a block maps the stream to a stream of the same
    shape), so that a block returning `(weights, x)` or `(x_cls, ...)` is refused, not penalized on the wrong
    tensor. Anything else raises TypeError naming the block and what it returned.
    """
    if isinstance(output, torch.Tensor):
        return output
    what = type(output).__name__
    if isinstance(output, (tuple, list)) and output:
        first = output[0]
        input_name, stream_in = _first_input(block, args, kwargs or {})
        what = f"a {what} whose first element is {_describe(first)}"
        if isinstance(first, torch.Tensor) and isinstance(stream_in, torch.Tensor) and first.shape == stream_in.shape:
            return first
        what += f", the block's first input{input_name} {_describe(stream_in)}"
    raise TypeError(f"TWEO: block '{name}' ({type(block).__name__}) returned {what}; TWEO penalizes the residual "
                    "stream after the block (App. A.3): return it as a tensor, or first in a tuple with the shape of "
                    "the block's input")


def _first_input(block: nn.Module, args: tuple, kwargs: dict) -> tuple[str, object]:
    """(" 'name'" or '', value) of the first parameter of the block's forward in this call (None when not given).

    The class's forward is read, not the instance's: wrappers that replace `block.forward` (accelerate's hooks,
    MMEngine's activation checkpointing) take `*args, **kwargs` and hand them on to it unchanged."""
    if args:
        return "", args[0]
    try:
        params = list(inspect.signature(type(block).forward).parameters.values())[1:]  # after self
    except (TypeError, ValueError):  # a forward without a readable signature
        params = []
    first = params[0] if params else None
    if first is None or first.kind in (first.VAR_POSITIONAL, first.VAR_KEYWORD):
        return "", None
    return f" '{first.name}'", kwargs.get(first.name)


def _describe(x: object) -> str:
    return f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _join(prefix: str, *parts: str) -> str:
    return ".".join(p for p in (prefix, *parts) if p)


def _refuse(name: str, block: nn.Module, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"block '{name}' ({type(block).__name__}) is not supported by CD: {why}")


def _stored_in_out(module: Optional[nn.Module], w: Optional[nn.Parameter]) -> Optional[bool]:
    """True when `module` stores its weight `w` (in, out) and computes x @ w, as transformers' `Conv1D` (weight
    (nx, nf), attribute `nf`); False for `nn.Linear` (out, in), x @ w.T; None for a layer that is neither (a
    wrapper holding the weight: `_Block._shape_storage` reads it off the shape). Read per layer because the shape
    alone cannot tell a square (D x D) projection apart."""
    if isinstance(module, nn.Linear):
        return False
    nf = getattr(module, "nf", None)
    if isinstance(nf, int) and w is not None and w.shape[1] == nf:
        return True
    return None


# the names of the built-in layouts (`LAYOUTS`), which tell a layout given as layouts= apart from them
_BUILT_IN = frozenset(lay.library for lay in LAYOUTS)


class _Block:
    """One block being paired: its name, module and layout, and the Pair constructors."""

    def __init__(self, name: str, module: nn.Module, layout: Layout) -> None:
        self.name, self.module, self.lay = name, module, layout
        self.read_transposed = False  # whether a layer took its storage from the layout's `transposed`

    def matrix(self, path: Optional[str]) -> Optional[nn.Parameter]:
        """The 2-D weight at `path`: a Linear-like module's `weight`, or a matrix Parameter its parent module holds
        itself (nn.MultiheadAttention's `in_proj_weight`)."""
        if not path or _module(self.module, path) is not None:
            return _matrix_weight(_module(self.module, path))
        parent, _, attr = path.rpartition(".")
        owner = _module(self.module, parent) if parent else self.module
        w = owner._parameters.get(attr) if owner is not None else None
        return w if w is not None and w.dim() == 2 else None

    def weight_name(self, path: str) -> str:
        """Full name of the weight at `path`: '<path>.weight' for a layer, '<path>' for a Parameter held itself."""
        return _join(self.name, path) if _module(self.module, path) is None else _join(self.name, path, "weight")

    def storage(self, path: str) -> Optional[bool]:
        """Whether the layer at `path` stores its weight (in, out): as its type tells (`_stored_in_out`), else as its
        shape does (`_shape_storage`), else as the shapes of the block's other layers of its type tell theirs (one
        wrapper class stores its weight one way: a square fc1 reads as the wrapped qkv does); None when none tells
        or they disagree."""
        told = self._shape_storage(path)
        module = _module(self.module, path)
        if told is not None or module is None or self.matrix(path) is None:
            return told
        paths = (self.lay.qkv, *(self.lay.q_k_v or ()), self.lay.proj, self.lay.fc1, self.lay.gate, self.lay.up,
                 self.lay.fc2)
        kin = {self._shape_storage(p) for p in paths if p and p != path and type(_module(self.module, p)) is
               type(module)} - {None}
        return kin.pop() if len(kin) == 1 else None

    def _shape_storage(self, path: str) -> Optional[bool]:
        """Whether the layer at `path` stores its weight (in, out), as its type tells (`_stored_in_out`), else as its
        shape does against the block's width D, the length of the norms' scale (qkv, q, k, v, fc1, W_gate and W_up
        read D; proj and fc2 write it); None when neither tells (a square weight of a layer of another type)."""
        w = self.matrix(path)
        told = _stored_in_out(_module(self.module, path), w)
        if told is not None or w is None:
            return told
        d = next((g.shape[0] for g in (_scale_weight(_module(self.module, n)) for n in (self.lay.norm1, self.lay.norm2))
                  if g is not None), None)
        d_dim = 0 if path in (self.lay.proj, self.lay.fc2) else 1  # where D is in an (out, in) weight
        fits = [t for t in (False, True) if w.shape[1 - d_dim if t else d_dim] == d]
        return fits[0] if len(fits) == 1 else None

    def transposed(self, path: str) -> bool:
        """Whether the layer at `path` stores its weight (in, out) (`storage`; the layout's default if untold)."""
        told = self.storage(path)
        self.read_transposed = self.read_transposed or told is None
        return self.lay.transposed if told is None else told

    def width(self, path: str, dim: int) -> int:
        """Output (dim 0) or input (dim 1) width of the layer at `path` as it applies its weight."""
        w = self.matrix(path)
        return w.shape[1 - dim] if self.transposed(path) else w.shape[dim]

    def part(self, path: str) -> nn.Module:
        """The top-level child holding `path` (the attention or MLP module), for messages."""
        return _child(self.module, path.split(".")[0])

    def refuse(self, why: str) -> UnsupportedModelError:
        return _refuse(self.name, self.module, why)

    def refuse_missing(self, paths: str, what: str) -> UnsupportedModelError:
        """A layer of the layout is absent: name the paths looked for and the layout its children matched, since a
        block of one's own whose children happen to be another library's (an MLP named `ffn` reads as
        MMDetection's Swin) would otherwise be told about the wrong part. A layer that is there but whose weight is
        computed at each forward (a parametrization, weight_norm) is named as such, with the way to remove it, and
        one that is there without a 2-D weight Parameter (a wrapper holding the layer and adapters) too."""
        for path in paths.replace(" or ", " and ").split(" and "):
            layer = _module(self.module, path)
            computed = self.refuse_computed(path, "update")
            if computed is not None:
                return computed
            if layer is not None and _matrix_weight(layer) is None:  # there: not "found no", but no matrix to pair
                extra = adapter_parameters(layer)  # what a wrapper (PEFT-style adapters) holds
                held = (f" (it holds {', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''}; for a layer with "
                        f"adapters, {ADAPTER_FIX})") if extra else ""
                return self.refuse(f"{path} is a {type(layer).__name__} with no 2-D weight Parameter{held}")
        if self.lay.library not in {lay.library for lay in LAYOUTS}:  # a layout given as layouts=
            return self.refuse(f"found no {paths} ({what}); its children {', '.join(self.lay.children)} are those of "
                               f"the layout {self.lay.library!r} given as layouts=: check its paths against the "
                               "block's module names")
        own = "" if self.lay.library == "timm" else (
            "; a block of your own is found under timm's names: norm1, attn.qkv (or attn.q, attn.k, attn.v), "
            "attn.proj, norm2, mlp.fc1, mlp.fc2, or under its own names given as layouts=[cd.Layout(...)]")
        return self.refuse(f"found no {paths} ({what}); its children {', '.join(self.lay.children)} are those of "
                           f"the {self.lay.library} block layout{own}")

    def refuse_computed(self, path: str, use: str) -> Optional[UnsupportedModelError]:
        """The refusal of the module at `path` when its `weight` is there but computed at each forward (a
        parametrization, weight_norm), naming that cause and the way to remove it; None otherwise. A pair holds
        Parameters: a computed weight is a new tensor at each forward, nothing CD can `use` ("update" for a layer,
        "read as W1" for a norm's scale, which an affine norm under a parametrization has)."""
        from .noise import weight_source  # here: noise -> update -> pairs
        module = _module(self.module, path)
        weight = getattr(module, "weight", None) if module is not None else None
        if not isinstance(weight, torch.Tensor) or isinstance(weight, nn.Parameter):
            return None
        how, fix = weight_source(module)
        if fix.startswith("give WeightNoise"):
            fix = "give the layer a weight Parameter of its own"
        return self.refuse(f"the weight of {path} is {how}, not a Parameter CD can {use}; {fix}")

    def refuse_inner_norm(self, layer: str, pair: str) -> None:
        """Refuse a norm between a functional pair's matrices (timm's `norm` child of the attention or MLP,
        set by scale_attn_norm / scale_mlp_norm): it rescales what W1 writes before W2 reads it, so the pair's
        product no longer describes the path. An Identity `norm` (timm's default) is no norm, and the layout's own
        norm1 or norm2 kept there (vit-pytorch's Attention holds the norm before its qkv as `norm`) is the block's
        pre-norm, whose place the meta forward checks (`cd/verify.py`)."""
        part = self.part(layer)
        norm = _child(part, "norm")
        if any(norm is _module(self.module, path) for path in (self.lay.norm1, self.lay.norm2)):
            return
        if not isinstance(norm, (nn.Identity, type(None))):
            raise self.refuse(f"{type(part).__name__} has a norm before {layer} (timm scale_attn_norm / "
                              f"scale_mlp_norm); the {pair} pair is defined for W2 reading W1's output directly")

    def composable(self, norm: str, layer: str, role: str) -> Pair:
        """(diag(<norm>.weight), <layer>.weight), refused unless the norm has an affine scale of the layer's
        input width."""
        g = _scale_weight(_module(self.module, norm))
        w = self.matrix(layer)
        computed = self.refuse_computed(norm, "read as W1") if g is None else None
        if computed is not None:  # an affine norm all the same: "needs an affine norm" would name a wrong cause
            raise computed
        if g is None or w is None or g.shape[0] != self.width(layer, 1):
            raise self.refuse(f"{role} needs an affine {norm} (1-D weight) of {layer}'s input width")
        return Pair(self.weight_name(layer), role, "composable", self.name,
                    _join(self.name, norm, "weight"), w, g, transposed=self.transposed(layer))

    def functional(self, upstream: str, layer: str, role: str, rows: Optional[tuple[int, int]] = None) -> Pair:
        """(<upstream>.weight[rows], <layer>.weight): W1 feeds W2 through the attention or activation, each read
        with its own storage (`Pair.transposed`, `Pair.upstream_transposed`)."""
        up, down = self.storage(upstream), self.storage(layer)
        if self.lay.library in _BUILT_IN:
            # a layer whose storage nothing of its own tells (a square proj or fc2 in a wrapper) is read as the one
            # it pairs with: a built-in layout names the layers of libraries that store them differently (GPT-2's
            # names: transformers' Conv1D, nanoGPT's nn.Linear), so its `transposed` is a guess the partner beats.
            # A layout given as layouts= states its model's storage, and comes first.
            up, down = (down if up is None else up), (up if down is None else down)
        self.read_transposed = self.read_transposed or up is None or down is None
        up = self.lay.transposed if up is None else up
        down = self.lay.transposed if down is None else down
        return Pair(self.weight_name(layer), role, "functional", self.name, self.weight_name(upstream),
                    self.matrix(layer), self.matrix(upstream), rows, transposed=down, upstream_transposed=up)


def _attention_pairs(b: _Block) -> list[Pair]:
    """qkv and proj pairs of a fused-qkv attention, or of separate q, k, v layers (class attention: CaiT /
    XCiT `ClassAttn`; transformers' ViT and Llama), where q, k and v each pair with norm1 and proj with v.
    A `norm` child is read as one between V and proj only once V is found: PVT-v2's and Twins' `norm` normalises
    the spatially reduced tokens that feed their fused `kv`, an attention refused for having no qkv and no v."""
    lay = b.lay
    attn = _module(b.module, lay.proj.rpartition(".")[0])  # the module holding proj (an nn.MultiheadAttention's)
    if getattr(attn, "_qkv_same_embed_dim", True) is False:
        raise b.refuse(f"{type(attn).__name__} has kdim or vdim other than embed_dim (separate "
                       "q_proj_weight, k_proj_weight, v_proj_weight): self-attention reads keys and values from "
                       "the block's input, of embed_dim width; build it with kdim=vdim=embed_dim (or None)")
    proj, qkv = b.matrix(lay.proj), b.matrix(lay.qkv)
    if qkv is not None and proj is not None:
        # Fused qkv rows are [Q; K; V] in equal thirds (timm reshapes the output to (3, heads, head_dim)).
        rows = b.width(lay.qkv, 0)
        if rows % 3 or b.width(lay.proj, 1) != rows // 3:
            raise b.refuse(f"{lay.qkv} is not 3x {lay.proj}'s input width")
        d = rows // 3
        b.refuse_inner_norm(lay.proj, "V -> proj")
        return [b.composable(lay.norm1, lay.qkv, "qkv"), b.functional(lay.qkv, lay.proj, "proj", (2 * d, 3 * d))]
    q_k_v = lay.q_k_v or ()
    if q_k_v and proj is not None and all(b.matrix(p) is not None for p in q_k_v):
        if b.width(lay.proj, 1) != b.width(q_k_v[2], 0):
            raise b.refuse(f"{q_k_v[2]}'s output width is not {lay.proj}'s input width (grouped-query "
                           "attention, where V heads are shared, has no V -> proj pair of the paper's form); give "
                           "the attention as many key/value heads as query heads (transformers: "
                           "num_key_value_heads=num_attention_heads), or train this model without CD")
        b.refuse_inner_norm(lay.proj, "V -> proj")
        return [*(b.composable(lay.norm1, p, "qkv") for p in q_k_v), b.functional(q_k_v[2], lay.proj, "proj")]
    if proj is None:
        raise b.refuse_missing(lay.proj, "the attention's output layer")
    # the layout's forms of the attention's input layers, each by the layers it lacks (q and k of separate
    # layers that are there are not named)
    missing = [p for p in q_k_v if b.matrix(p) is None]
    looked = ([lay.qkv] if lay.qkv else []) + ([", ".join(missing)] if missing else [])
    forms = (["a fused qkv"] if lay.qkv else []) + (["separate q, k, v Linear layers"] if q_k_v else [])
    raise b.refuse_missing(" or ".join(looked), f"{' or '.join(forms)} before {lay.proj}")


def _has_gated_mlp(b: _Block) -> bool:
    """Whether the block's MLP is gated: the layout's gate layer is there, or fc1 is twice as wide as fc2's input (the
    packed [W_gate; W_up] of timm's GluMlp)."""
    lay = b.lay
    fc1, fc2 = b.matrix(lay.fc1), b.matrix(lay.fc2)
    return _module(b.module, lay.gate) is not None or (
        fc1 is not None and fc2 is not None and b.width(lay.fc1, 0) == 2 * b.width(lay.fc2, 1))


def _mlp_pairs(b: _Block, gated_mlp: bool) -> list[Pair]:
    """fc1 and fc2 pairs of a plain MLP fc2(act(fc1(x))); gated MLPs with `gated_mlp` (`_gated_pairs`)."""
    lay = b.lay
    mlp = b.part(lay.fc2)
    b.refuse_inner_norm(lay.fc2, "fc1 -> fc2")
    fc1, fc2 = b.matrix(lay.fc1), b.matrix(lay.fc2)
    gated = _has_gated_mlp(b)
    if gated and gated_mlp:
        return _gated_pairs(b)
    if gated:
        raise b.refuse(f"gated MLP {type(mlp).__name__} (fc2(act(W_gate x) * W_up x), such as "
                       "SwiGLU); the paper's pairs are defined for fc2(act(fc1(x))); gated_mlp=True "
                       "(cd.gated_mlp=true) adds gated pairs, beyond the paper")
    if fc1 is None or fc2 is None:
        # a layout without a plain MLP (transformers' Llama) names the layers of its gated one, the gate among
        # them (its absence is what brought the block here); only the absent layers are named
        looked = ((lay.fc1, fc1), (lay.fc2, fc2)) if lay.fc1 else ((lay.gate, None), (lay.up, b.matrix(lay.up)),
                                                                   (lay.fc2, fc2))
        form = "an MLP fc2(act(fc1(x)))" if lay.fc1 else "the layout's gated MLP fc2(act(W_gate x) * W_up x)"
        raise b.refuse_missing(" and ".join(path for path, weight in looked if weight is None),
                               f"the Linear layers of {form}; the MLP is a {type(mlp).__name__}")
    if b.width(lay.fc2, 1) != b.width(lay.fc1, 0):
        raise b.refuse(f"MLP {type(mlp).__name__} is not fc1 -> act -> fc2 with matching widths")
    return [b.composable(lay.norm2, lay.fc1, "fc1"), b.functional(lay.fc1, lay.fc2, "fc2")]


def _gated_pairs(b: _Block) -> list[Pair]:
    """Pairs of a gated MLP W_down (act(W_gate x) * (W_up x)) (opt-in; cd/README.md, "Gated MLPs").

    fc1 (composable): norm2 with each matrix it feeds, W_gate and W_up (timm `SwiGLU`: fc1_g, fc1_x;
    transformers Llama: gate_proj, up_proj), or the packed [W_gate; W_up] (timm `GluMlp`: one fc1, halves
    split by `chunk`).
    fc2 (functional): W_up -> W_down, the route that is linear in x for a fixed gate, as fc1 -> fc2 is
    through GELU; W_gate gets no pair with W_down (it enters through the nonlinearity only).
    A norm between the product and W_down (timm `scale_mlp`) is refused before (`_mlp_pairs`).
    """
    lay = b.lay
    mlp = b.part(lay.fc2)
    down = b.matrix(lay.fc2)
    if _module(b.module, lay.gate) is not None:
        up = b.matrix(lay.up)
        if up is None or down is None or b.width(lay.fc2, 1) != b.width(lay.up, 0):
            raise b.refuse(f"gated MLP: {lay.up}'s output width is not {lay.fc2}'s input width")
        return [b.composable(lay.norm2, lay.gate, "fc1"), b.composable(lay.norm2, lay.up, "fc1"),
                b.functional(lay.up, lay.fc2, "fc2")]
    if getattr(mlp, "chunk_dim", -1) != -1 or not isinstance(getattr(mlp, "gate_last", None), bool):
        raise b.refuse(f"gated MLP {type(mlp).__name__}: cannot tell which half of fc1 is W_up "
                       "(expected timm GluMlp's gate_last and a chunk over the last dim)")
    h = b.width(lay.fc2, 1)
    rows = (0, h) if mlp.gate_last else (h, 2 * h)  # GluMlp: x1, x2 = chunk(2); x1 * act(x2) if gate_last
    return [b.composable(lay.norm2, lay.fc1, "fc1"), b.functional(lay.fc1, lay.fc2, "fc2", rows)]


def _same_pair(p: Pair, q: Pair) -> bool:
    return (p.role, p.kind, p.upstream_rows, p.transposed, p.upstream_transposed) == \
        (q.role, q.kind, q.upstream_rows, q.transposed, q.upstream_transposed) and p.upstream is q.upstream


def _block_pairs(name: str, module: nn.Module, lays: list[Layout], gated_mlp: bool,
                 read: dict[Layout, bool]) -> tuple[list[Pair], bool]:
    """The pairs of one block under each of its layouts `lays` (`layouts_of`), merged, and whether its MLP is gated.

    Layouts that describe further layers (one per branch of a parallel block, one per expert of an MoE MLP) add
    their pairs; a pair two of them give alike is kept once (the shared attention of two experts' layouts). A later
    layout that reads a matrix an earlier one pairs otherwise (another norm, another role), or that fails on layers
    an earlier one paired, is another reading of the same layers: the first in the order given wins (cd/README.md,
    "Blocks with names of your own"). One that fails on layers of its own is refused. `read`: whether each layout's
    `transposed` was read by a layer (`_Block.read_transposed`), for `_refuse_unread_transposed`."""
    out: list[Pair] = []
    by_w2: dict[int, Pair] = {}
    gated = False
    for k, lay in enumerate(lays):
        block = _Block(name, module, lay)
        try:
            new = _attention_pairs(block) + _mlp_pairs(block, gated_mlp)
        except UnsupportedModelError:
            layers = {id(w) for w in map(block.matrix, _layer_paths(lay)) if w is not None}
            if k and layers & (set(by_w2) | {id(p.upstream) for p in out}):
                continue
            raise
        if any(id(p.downstream) in by_w2 and not _same_pair(p, by_w2[id(p.downstream)]) for p in new):
            continue
        for p in new:
            if by_w2.setdefault(id(p.downstream), p) is p:
                out.append(p)
        gated = gated or _has_gated_mlp(block)
        read[lay] = read.get(lay, False) or block.read_transposed
    return out, gated


def _layer_paths(lay: Layout) -> list[str]:
    """The paths of the layout's matrix layers (not its norms)."""
    return [path for field, path in lay.paths() if field not in ("norm1", "norm2")]


def _refuse_unread_transposed(read: dict[Layout, bool]) -> None:
    """Refuse a layout given as layouts= with transposed=True that no layer of its blocks read: every layer told its
    storage by its type or shape (nn.Linear: (out, in)), so the field would be silently ignored. Raises ValueError
    naming the layout and the field. The built-in GPT-2 layout's `transposed` is a guess for layers of other types
    (transformers' Conv1D or nanoGPT's nn.Linear tell theirs), not a statement: not refused."""
    for lay, was_read in read.items():
        if lay.transposed and not was_read and lay.library not in _BUILT_IN:
            raise ValueError(f"cd.Layout(library={lay.library!r}): field 'transposed' is True, but every layer of "
                             "its blocks tells its storage by its type or shape (nn.Linear stores (out, in), "
                             "transformers' Conv1D (in, out)), so no layer reads it; drop transposed=True (it is for "
                             "a layer of another type whose square weight does not tell)")


def _refuse_unpaired_part(name: str, module: nn.Module, lays: list[Layout], found: list[Pair],
                          layouts: tuple[Layout, ...]) -> None:
    """Refuse a block with an attention or an MLP inside that none of its pairs reads (`cd.unknown_blocks.
    unpaired_part`): the layouts that match it (a parallel block's first branch only; a later layout skipped as
    another reading of layers an earlier one paired, or with paths copied from another branch) would leave it out
    of CD while the paper applies CD to every attention and MLP."""
    read = {id(w) for p in found for w in (p.upstream, p.downstream)}
    widths = {p.upstream.shape[0] for p in found if p.kind == "composable"}
    # a module inside that is itself laid out as a block is left as before: matches are outermost (`_matches`)
    nested = [n for n, sub in module.named_modules() if n and layouts_of(sub, layouts)]
    part = unpaired_part(module, read, widths, nested)
    if part is not None:
        matching = "; ".join(lay.describe() for lay in lays)
        branch = ("give one cd.Layout per branch (attention with its norm and MLP), all of them together, with paths "
                  "that name each branch's own layers (cd/README.md, \"Blocks with names of your own\")")
        # an unpaired attention may be a cross-attention (its k and v read another stream, such as an encoder's
        # output), which no Layout fixes: its k/v do not read its norm. Without a forward the two are not told apart
        if part.startswith("attention"):
            branch = ("CD pairs an attention only with the norm that feeds its q, k and v, so an attention whose k "
                      "and v read another stream (a decoder's cross-attention) is not supported; if it is a branch "
                      "of a parallel block instead, " + branch)
        raise _refuse(name, module, f"no pair of the layouts that match it ({matching}) reads its {part}, so CD "
                      f"would leave it out while pairing the rest of the block: {branch}")


def _collect(root: nn.Module, pairs: list[Pair], types: dict[str, str], gated_mlp: bool,
             layouts: tuple[Layout, ...]) -> bool:
    """Append the pairs of every block (of a layout of `layouts`) and patch-merging layer of `root`, in model order
    (into `pairs`, so that the caller sees those found before a refusal); `types`: block name -> class name.
    Returns whether a block has a gated MLP."""
    gated = False
    read: dict[Layout, bool] = {}
    for name, module in _matches(root, layouts, merging=True):
        types[name] = type(module).__name__
        lays = layouts_of(module, layouts)
        if lays:
            found, has_gate = _block_pairs(name, module, lays, gated_mlp, read)
            _refuse_unpaired_part(name, module, lays, found, layouts)
            pairs += found
            gated = gated or has_gate
        elif _scale_weight(module.norm) is not None and _scale_weight(module.norm).shape[0] == \
                module.reduction.weight.shape[0] != module.reduction.weight.shape[1]:
            raise _refuse(name, module, "its norm follows the reduction (post-norm, as in Swin V2); CD pairs "
                          "a norm with the layer it feeds")
        else:
            # patch merging is found by its own names (norm, reduction) whatever the layouts
            pairs.append(_Block(name, module, LAYOUTS[0]).composable("norm", "reduction", "reduction"))
    _refuse_unread_transposed(read)
    return gated


def _looked_for(layouts: tuple[Layout, ...]) -> str:
    """What CD looks for with `layouts`: the built-in layouts' names, or the layouts given."""
    if layouts is LAYOUTS:
        return ("CD looks for pre-norm Transformer blocks (children norm1, attn.qkv or attn.q/k/v, attn.proj, norm2, "
                "mlp.fc1, mlp.fc2, as in timm ViT/DeiT/Swin, or the same parts under the names of GPT-2, transformers' "
                "ViT / GPT-2 / Llama and MMDetection's Swin) and patch-merging layers (norm, reduction); `python -m "
                "cd --families` lists the families and what CD finds in each")
    return "the layouts given (layouts=): " + "; ".join(lay.describe() for lay in layouts)


# how a model trains when CD cannot pair it
_WITHOUT_CD = ("Without CD (train.py: cd.enabled=false; a framework: no CD callback or hook) the model trains as "
               "usual.")


def _names_advice(layouts: tuple[Layout, ...], what: str) -> str:
    """How to have `what` (blocks under names of their own) paired, for each way CD is called: train.py and
    `python -m cd` try the built-in `LAYOUTS` and take no layouts, the API takes them as layouts=."""
    if layouts is not LAYOUTS:
        return "Add a cd.Layout with its names to layouts="
    return (f"To pair {what}: called directly, find_pairs, ColinearityDecay, TWEO and the integrations take the "
            "names as layouts=[cd.Layout(...), *cd.LAYOUTS] (cd/README.md, \"Blocks with names of your own\"); "
            "train.py and `python -m cd` take no layouts= and try the built-in cd.LAYOUTS, so a fork training such a "
            "model with train.py adds a cd.Layout to LAYOUTS in cd/layouts.py (docs/extending.md)")


# aten ops that normalize: inside a block they are its norms, with an affine scale or without one
# (nn.LayerNorm(elementwise_affine=False)), as modules or in a forward (F.layer_norm, F.rms_norm, F.normalize)
_NORM_OPS = frozenset({"native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
                       "_native_batch_norm_legit_no_training", "_fused_rms_norm", "rms_norm", "rsqrt", "sqrt",
                       "linalg_vector_norm", "norm", "var", "std", "var_mean", "std_mean"})


class _BlockNorms(_Provenance):
    """`_Provenance` that tells whether a block's attention reads a norm of the block. The attention's matrices
    (`attention`: their names) label 'a' what they compute. A product of one of them whose other operands carry no
    'a' reads the attention's input (the matrices qkv, or q, k and v): `inputs` counts those, `normed` those whose
    operand depends on a norm of the block (label '0'). A product on what the attention computed (proj on its values)
    is no such read, so what the attention computes inside (a score scale torch.sqrt(torch.tensor(head_dim)), QK-norm,
    cosine attention) tells nothing of the block's norms; its outputs carry `after`, the labels of the norms that
    read the attention's output. Label '0' also marks the outputs of every normalizing op (`_NORM_OPS`) that a module
    of the block's scope runs (`depth`: how many of them are running), whether or not the norm has a weight for its
    label to follow."""

    def __init__(self, sources: dict[str, list[tuple[str, bool]]], sinks: dict[str, list[tuple[int, bool]]],
                 attention: Sequence[str], after: frozenset):
        super().__init__(sources, sinks)
        self.depth = 0
        self.attention, self.after = frozenset(f"p:{n}" for n in attention), after
        self.inputs = self.normed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        ins = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        held = [bool(self.moved.get(id(t), frozenset()) & self.attention) for t in ins]
        # read before the op runs: an in-place op's output is its input, which the op labels
        reads = frozenset().union(*(self.dep.get(id(t), frozenset()) for t, h in zip(ins, held) if not h))
        out = super().__torch_dispatch__(func, types, args, kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if any(held) and name.rstrip("_") not in _MOVES:
            if "a" in reads:  # a product on the attention's own results: its output is the attention's
                for t in outs:
                    self.mark(t, frozenset(), self.after)
            else:
                self.inputs += 1
                self.normed += "0" in reads
        if self.depth and name in _NORM_OPS:
            for t in outs:
                self.mark(t, frozenset(), frozenset({"0"}))
        return out

    def watch(self, scope: nn.Module) -> list:
        """Count the forwards of `scope`'s modules in `depth` (all of them: a container's forward may not run);
        the hooks' handles, to remove."""
        def enter(*_):
            self.depth += 1

        def leave(*_):
            self.depth -= 1

        return [h for m in scope.modules() for h in (m.register_forward_pre_hook(enter),
                                                     m.register_forward_hook(leave, always_call=True))]


def _block_scope(root: nn.Module, name: str) -> str:
    """The name of the highest module of `root` holding block `name` whose other parts hold no matrix: a block's
    norm may sit beside the module holding its other parts (x + body.attn(norm1(x)) in a module of norm1 and body,
    whose norm2 and MLP are body's). A module beside it that holds a matrix (a sibling block, an embedding, a head)
    ends the climb: the module holding that is not the block's. A layer's matrix, that is (`_own_matrices`), or an
    embedding's table: a LayerScale kept as (1, 1, D) or a learned position parameter beside the norm is none."""
    while name:
        parent, _, child = name.rpartition(".")
        module = root.get_submodule(parent)
        own = [n for n, _ in _own_matrices(module) if n != child]
        beside = [c for n, c in module.named_children() if n != child]
        if own or any(_matrices(c) or any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in c.modules())
                      for c in beside):
            return name
        name = parent
    return name


def _post_norm(root: nn.Module, name: str, block: nn.Module, example: object) -> Optional[str]:
    """The norm of `block` (module `name` of `root`, a Transformer block by its structure) that reads the output of
    its attention where the block is post-norm, as BERT's layers are (attention.output.LayerNorm after
    attention.output.dense), else None. Told by one forward on the meta device, as `verify_pairs` runs it
    (`example`: its input, None for `cd.verify.example_input`): no input matrix of the block's attentions (qkv, or
    q, k and v) depends on the output of a norm of the block (the attention reads the block's input, not a norm of
    it), and that norm's input depends on the attention's output. The block's norms are those of its scope
    (`_block_scope`: a norm its parent holds beside it is one), with an affine scale or without one, or computed in
    a forward (`_BlockNorms`); a normalizing op that only products past the input matrices read (a score scale,
    QK-norm) does not count. The norm named has a scale. A forward that fails tells nothing: None."""
    if _fully_sharded(root):  # its forward would run FSDP's hooks and leave them broken (verify_pairs)
        return None
    prefix = f"{name}." if name else ""
    scope_name = _block_scope(root, name)
    scope = root.get_submodule(scope_name)
    reader = _Reader()
    attention = set().union(*(ids for m in block.modules() if (ids := reader.attention(m)) is not None))
    norms = [f"{scope_name}.{n}" if scope_name else n for n, m in scope.named_modules() if n and _is_norm(m)]
    matrices = [f"{prefix}{n}" for n, w in block.named_parameters() if id(w) in attention]
    # label 0: the block's norms, read by the attention's input matrices (`_BlockNorms`); label a: what the attention
    # computes; label k > 0: the attention's output, whose use is norm k - 1 (dependence, not moves only: a
    # computation between a norm and the layer reading it still reads the norm)
    sources = {f"{n}.weight": [("0", False)] for n in norms}
    sources.update({n: [("a", False)] for n in matrices})
    sinks = {f"{n}.weight": [(k, False)] for k, n in enumerate(norms, 1)}
    if example is None:
        try:
            example = default_example(root)
        except UnsupportedModelError:
            return None
    if isinstance(example, Mapping):  # as verify_pairs passes it
        args, kwargs = (), {k: _meta_like(v) for k, v in example.items()
                            if not (k == "attention_mask" and _transformers_lm(root))}
    else:
        args, kwargs = tuple(map(_meta_like, example if isinstance(example, (tuple, list)) else (example,))), {}
    mode = _BlockNorms(sources, sinks, matrices, frozenset(str(k) for k in range(1, len(norms) + 1)))
    meta = _meta_slots(root, mode)
    hooks = mode.watch(scope)
    try:
        with torch.no_grad(), mode:
            torch.func.functional_call(root, meta, args, kwargs, tie_weights=False)
    except Exception:  # the block's structure alone tells no post-norm: the message says what a layout can do
        return None
    finally:
        for hook in hooks:
            hook.remove()
    if not mode.inputs or mode.normed:  # the attention ran on a norm's output
        return None
    found = next((n for k, n in enumerate(norms, 1) if mode.bad.get(k, 0) < mode.uses.get(k, 0)), None)
    return found[len(prefix):] if found is not None and found.startswith(prefix) else found


def _no_pair_message(root: nn.Module, layouts: tuple[Layout, ...], example: object = None,
                     verify: bool = True) -> str:
    """Why `root` has no pair: the layouts that were tried (the built-in ones, or those given), and the first module
    that is a Transformer block by its structure (`cd.unknown_blocks`), with what a layout can do for it: nothing
    for a post-norm block (`_post_norm`, with `verify`: its forward on `example`)."""
    block = next(unknown_blocks(root, ()), None)
    seen, helps = "", True
    if block is not None:
        name, module, parts = block
        note, helps = block_note(module)
        norm = _post_norm(root, name, module, example) if verify and helps else None
        if norm is not None:
            note, helps = (f"it is a post-norm block: its attention reads no norm of the block, and its norm {norm} "
                           "reads the attention's output (the norm follows the layer, as in BERT), where CD pairs "
                           "pre-norm blocks, whose norms feed the attention and the MLP: no cd.Layout can pair it "
                           "(one written for it is refused when its pairs are checked); train this model without "
                           "CD"), False
        seen = (f" Its module '{name}' ({type(module).__name__}) holds a Transformer block's parts ({parts})"
                f"{': ' + note if note else ''}.")
    if layouts is LAYOUTS:
        advice = f" {_names_advice(layouts, 'blocks that name these layers otherwise')}." if helps else ""
        return f"no matrix pair found in {type(root).__name__}. {_looked_for(layouts)}.{seen}{advice} {_WITHOUT_CD}"
    built_in = "" if set(LAYOUTS) <= set(layouts) else ", or add the built-in layouts, layouts=[..., *cd.LAYOUTS]"
    return (f"no matrix pair found in {type(root).__name__} with {_looked_for(layouts)}. No module "
            "of the model has all the top-level children of one of them, nor is a patch-merging layer (norm, "
            f"reduction): check the paths against the model's module names (print(model)){built_in}.{seen}")


def refuse_unknown_blocks(root: nn.Module, layouts: tuple[Layout, ...]) -> None:
    """Refuse a Transformer block of `root` that no layout names (`cd.unknown_blocks`) beside blocks that one does:
    CD and TWEO would act on the known blocks only, where the paper applies them to every block. Blocks of the
    built-in layouts that `layouts` leaves out are not refused: what layouts= leaves out is left out as asked.

    Raises:
        UnsupportedModelError: naming the first such block, its type and parts, and the layouts= that adds it.
            With none, half blocks beside the blocks found (a norm with only an attention or only an MLP, which no
            layout describes) are named in one warning (`_warn_half_blocks`), not refused: the structure cannot
            tell a residual half block from a head.
    """
    known = [name for name, _ in _matches(root, layouts, merging=True)]
    if layouts is not LAYOUTS:
        known += [name for name, _ in _matches(root, LAYOUTS, merging=True)]
    found = list(unknown_blocks(root, known))
    if not found:
        _warn_half_blocks(root, known)
        return
    name, module, parts = found[0]
    more = f" (and {len(found) - 1} more: {', '.join(n for n, _, _ in found[1:4])}{', ...' if len(found) > 4 else ''})"
    note, helps = block_note(module)
    raise _refuse(name, module, f"its parts ({parts}) make a Transformer block that none of the layouts tried "
                  f"finds{more if len(found) > 1 else ''}, so CD and TWEO would leave it out while acting on the "
                  f"model's other blocks. {_looked_for(layouts)}. {note[:1].upper() + note[1:] + '. ' if note else ''}"
                  f"{_names_advice(layouts, 'it') + '. ' if helps else ''}{_WITHOUT_CD}")


# the warnings given, per model (root module): `_warn_half_blocks` and `_warn_left_out_layers` run at each
# find_pairs / find_blocks, and a run calls those for CD, its metrics and TWEO alike
_WARNED: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def _warn_once(root: nn.Module, message: str, stacklevel: int) -> None:
    """warnings.warn `message` unless it was given for `root` already (`stacklevel` counted from the caller)."""
    warned = _WARNED.setdefault(root, set())
    if message not in warned:
        warned.add(message)
        warnings.warn(message, stacklevel=stacklevel + 1)


def _warn_half_blocks(root: nn.Module, known: list[str]) -> None:
    """Warn, once per model and message, naming every module beside the blocks found that holds a norm with only an
    attention or only an MLP (`cd.unknown_blocks.unknown_half_blocks`): a residual half block (CrossViT's fusion
    blocks) or a head (a projection head norm -> Mlp, an attention-pooling head), which the structure cannot tell
    apart, so it is not refused. No cd.Layout describes half a block (a Layout names an attention and an MLP
    together), so CD and TWEO leave it out."""
    found = list(unknown_half_blocks(root, known))
    if not found:
        return
    listed = "; ".join(f"{name} ({type(module).__name__}: {parts})" for name, module, parts in found)
    message = (f"CD and TWEO leave out {len(found)} module{'s' if len(found) > 1 else ''} of {type(root).__name__}: "
               f"{listed}. Each is a norm with only an attention or only an MLP beside the blocks CD pairs: a "
               "residual half block or a head (its structure does not tell which); CD and TWEO leave it out, as a "
               "cd.Layout cannot describe half a block (a Layout names a block's attention and its MLP together)")
    _warn_once(root, message, stacklevel=4)  # find_pairs' or find_blocks' caller


LEFT_OUT_LAYERS = "CD leaves out "  # how the warning begins (`python -m cd` names the full-size model's only)


def _warn_left_out_layers(root: nn.Module, pairs: Sequence[Pair], layouts: tuple[Layout, ...]) -> None:
    """Warn, once per model and message, naming every matrix that a block found applies outside its attention and
    MLP (the top-level children its layouts name) and that no pair reads: Hiera's stage-transition `proj`, which maps
    norm1's output to the next stage's width on the residual path. The paper's pairs (Sec. 3.2) are a block's
    attention and MLP, and Swin's patch merging; such a layer holds none of them, so CD leaves it out (a norm -> Linear
    pair like Swin's reduction by Eq. (4), but no Layout names it), as it did before without a word."""
    read = {id(w) for p in pairs for w in (p.upstream, p.downstream)}
    left = []
    for name, module in _matches(root, layouts, merging=False):
        parts = {child for lay in layouts_of(module, layouts) for child in lay.children}
        left += [(_join(name, path), w) for path, w in _matrices(module)
                 if path.split(".")[0] not in parts and id(w) not in read]
    if not left:
        return
    listed = ", ".join(f"{name} ({tuple(w.shape)[0]}x{tuple(w.shape)[1]})" for name, w in left[:6])
    more = f" and {len(left) - 6} more" if len(left) > 6 else ""
    message = (f"{LEFT_OUT_LAYERS}{len(left)} matri{'ces' if len(left) > 1 else 'x'} of {type(root).__name__} that "
               f"its blocks apply outside their attention and MLP: {listed}{more}. No pair of the paper's (Sec. 3.2: "
               "a block's qkv, proj, fc1 and fc2, Swin's patch-merging reduction) holds such a layer (e.g. Hiera's "
               "stage-transition proj from norm1's output to the next stage's width), so CD does not decay it")
    _warn_once(root, message, stacklevel=3)  # find_pairs' caller


def check_example_use(example_input: object, verify: bool, who: str) -> None:
    """Refuse an `example_input` given with verify=False: the example serves the pair checks only, which that
    skips, so one of the two settings would be silently ignored. Raises ValueError."""
    if example_input is not None and not verify:
        raise ValueError(f"{who}: example_input serves the pair checks only, and verify=False skips them: drop "
                         "example_input, or drop verify=False to run the checks on it")


def check_switches(who: str, **switches: object) -> None:
    """Refuse a switch (`verify`, `gated_mlp`) that is not a bool: a string from a config or a command line such as
    'false' is true in Python and would silently turn the switch on. Raises ValueError naming the switch."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise ValueError(f"{who} {name} must be True or False, got {value!r} ({type(value).__name__}; a "
                             f"string such as 'false' would count as true)")


def find_pairs(model: nn.Module, example_input: Optional[Union[torch.Tensor, tuple, dict]] = None,
               verify: bool = True, gated_mlp: bool = False, layouts: Sequence[Layout] = LAYOUTS) -> list[Pair]:
    """All CD matrix pairs of `model`, in model order (paper Sec. 3.2), checked against its forward pass.

    Args:
        model: a timm ViT/DeiT/Swin (or any model built from pre-norm blocks), possibly wrapped in
            DDP/DataParallel (`.module`) and/or torch.compile (`._orig_mod`) (`cd.wrappers.unwrap_model`).
        example_input: a tensor of the shape the model takes, a tuple of positional inputs, or a dict of
            keyword inputs, for the checks: the meta forward (`cd.verify`) uses shapes and dtypes, the V-row check
            (`cd.values`) the first sample's values of a real (non-meta) tensor. Default:
            `cd.verify.example_input` (timm's `patch_embed.img_size` / `pretrained_cfg`, a transformers
            model's config).
        verify: run the checks: one forward on the `meta` device (no memory, weights untouched), then, for a
            fused qkv, one real forward of the example with the claimed V rows set to zero, and one with some
            channels of every pair set to zero (V's, fc1's output, a norm's scale), which must reach W2's input
            columns of the same numbers (`cd.values`: weights, buffers, training flags and random streams
            untouched; skipped for a model on the `meta` device).
        gated_mlp: pair gated MLPs (SwiGLU) as `_gated_pairs` defines (beyond the paper); otherwise
            they are refused. A model without one refuses it: it would pair nothing more.
        layouts: the block layouts tried, in order, and no others (`cd.layouts`): default `LAYOUTS`, the built-in
            ones; a model with names of its own gives its own `Layout`s (add `*LAYOUTS` to try those too).
            Patch-merging layers (`norm`, `reduction`) are found whatever the layouts.

    Returns:
        list of Pair; names are those of the unwrapped model. ViT-T/S/B: 4 pairs per block (48 for
        depth 12); Swin-T: 48 block pairs + 3 patch-merging pairs = 51.

    Raises:
        TypeError, ValueError: `layouts` is not a non-empty sequence of Layout (`check_layouts`).
        TypeError: `model` is no nn.Module (None, a state_dict, a list of blocks: `cd.wrappers.check_model`).
        ValueError: `example_input` given with verify=False (`check_example_use`); `verify` or `gated_mlp` is not a
            bool (`check_switches`); gated_mlp=True on a model none of whose blocks has a gated MLP (the switch
            would change no pair).
        UnsupportedModelError (a ValueError): no pair was found (naming the first block found by its structure,
            and, with `verify`, whether it is post-norm, which no layout pairs), a block under names no layout has
            sits beside those found (`refuse_unknown_blocks`), a block does not fit the pairs (gated MLP, no affine
            norm, no qkv), the model is wrapped by FSDP1 (`refuse_fsdp1`), the forward pass
            contradicts a pair (res-post-norm blocks such as Swin V2), the rows of a fused qkv paired with proj
            are not V (a per-head interleaved or reordered layout), or W2 does not read W1's channel i at its
            column i (heads merged in another order; XCiT's channel attention; a sub-LN, a Linear or a permutation
            inside the MLP; channels rolled between a norm and its layer); the message names the block and its
            type.

    Warns (once per model): naming the half blocks beside the blocks found (a norm with only an attention or only
    an MLP: `_warn_half_blocks`), which CD leaves out; and naming the matrices a block applies outside its attention
    and MLP (Hiera's stage-transition proj: `_warn_left_out_layers`), which no pair holds.
    """
    check_switches("find_pairs:", verify=verify, gated_mlp=gated_mlp)
    layouts = check_layouts(layouts)
    check_example_use(example_input, verify, "find_pairs")
    check_model(model, "find_pairs")  # before refuse_fsdp1 walks it
    refuse_fsdp1(model)
    root = unwrap_model(model)
    pairs: list[Pair] = []
    types: dict[str, str] = {}
    try:
        gated = _collect(root, pairs, types, gated_mlp, layouts)
    except UnsupportedModelError as refusal:
        if verify and pairs:  # report the first block in model order whose pairs the forward contradicts
            try:
                verify_pairs(root, pairs, types, example_input)
            except UnsupportedModelError as earlier:
                if earlier.__cause__ is None:  # a contradicted pair, not a forward that failed to run
                    raise earlier from None
        raise refusal
    if not pairs:
        raise UnsupportedModelError(_no_pair_message(root, layouts, example_input, verify))
    refuse_unknown_blocks(root, layouts)
    refuse_adapters(root, pairs, types)  # before the checks: they would blame the forward, not the adapters
    if gated_mlp and not gated:  # a plain ValueError: pair_energy_source warns on UnsupportedModelError and goes on
        raise ValueError(f"gated_mlp=True (cd.gated_mlp=true): {type(root).__name__} has no gated MLP "
                         "(W_down (act(W_gate x) * W_up x), such as SwiGLU), so the switch adds no pair; drop it")
    refuse_shared(pairs, types)
    refuse_split_devices(pairs, types)
    if verify:
        verify_pairs(root, pairs, types, example_input)
        check_channel_order(root, pairs, types, example_input)
    _warn_left_out_layers(root, pairs, layouts)
    return pairs
