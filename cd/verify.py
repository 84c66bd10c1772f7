"""Check found matrix pairs against the model's actual computation: one forward on the `meta` device.

`find_pairs` proposes pairs from the module structure; this module confirms them by running the model
once, with every parameter and buffer replaced by a `meta` tensor of the same shape (no memory, no
arithmetic, the model's own weights untouched), while a dispatch mode follows where each tensor comes
from:

- composable pair (norm scale g, W2): every input of W2's layer is the norm's output, moved only by
  data-movement ops (views, permutes, rolls, padding, window partitioning, slicing, concatenation), so
  that W2 diag(g) is exactly the composed map. A res-post-norm block (Swin V2: `norm1` applied to the
  attention output) fails here: its qkv input never went through `norm1`.
- functional pair (W1, W2): every input of W2's layer depends on the output of W1's layer of the same
  forward, i.e. W1 runs first and feeds W2 through the branch's attention mixing or activation. No norm module
  inside the MLP or the attention may stand between them (`_hook_inner_norms`: a sub-LN, an RMSNorm; DiffAttention's
  sub_norm before proj), save a QK-norm, whose output reaches proj only through the softmax.
- storage: each matrix of a pair is multiplied as the storage CD reads it with says (`Pair.transposed`,
  `Pair.upstream_transposed`): one stored (out, in) is contracted over its second axis (`F.linear(x, W)`,
  `x @ W.T`), one stored (in, out) over its first (`x @ W`, Conv1D's addmm). The mode follows the two axes of
  every 2-D parameter through the ops that move them (transposes, permutes, views that add or drop axes of
  size 1, expands, slices, casts) to the matrix products (mm, addmm, bmm, baddbmm, matmul, linear) that take
  it; a product the axes cannot be followed to is not judged. A square layer of one's own computing `x @ W`,
  read as (out, in), fails here: CD would decay the transpose of the matrix it applies (paper Eq. (12)).

A pair that fails is an error naming the block and its type (`UnsupportedModelError`).
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# the refusal of a matrix the forward never multiplies (cd/integrations names `module=` after it)
UNUSED = "is not used in the forward pass"

# aten ops that only move, copy or select values (the output holds input values, none computed).
_MOVES = frozenset("""
    view _unsafe_view reshape permute transpose t expand contiguous clone slice select index unbind split
    split_with_sizes chunk squeeze unsqueeze flatten roll constant_pad_nd pad cat stack narrow alias detach
    _to_copy as_strided unfold movedim copy lift_fresh
""".split())


# aten ops after which a QK-norm's output no longer reaches proj by V's way (`_Provenance.softmax_ends`)
_SOFTMAX = frozenset("_softmax _safe_softmax softmax".split())

# aten ops that move a matrix keeping the position of each of its axes (their outputs have its number of dims)
_SAME_AXES = frozenset("""
    contiguous clone _to_copy detach alias lift_fresh slice narrow roll constant_pad_nd split split_with_sizes
    chunk copy
""".split())
# aten ops that only add or drop axes of size 1 (a view that merges or splits an axis loses the matrix's axes)
_RESHAPES = frozenset("view _unsafe_view reshape squeeze unsqueeze flatten".split())
# matrix products: {argument index: the axis of that operand the product contracts}
_PRODUCTS = {"mm": {0: 1, 1: 0}, "addmm": {1: 1, 2: 0}, "_addmm_activation": {1: 1, 2: 0}, "bmm": {0: 2, 1: 1},
             "baddbmm": {1: 2, 2: 1}, "matmul": {0: -1, 1: -2}, "mv": {0: 1}, "addmv": {1: 1}, "linear": {1: 1}}
# how a matrix stored (in, out) (True) or (out, in) (False) is multiplied, and its storage, for messages
_HOW = {True: "x @ W", False: "F.linear(x, W) or x @ W.T"}
_STORED = {True: "(in, out)", False: "(out, in)"}


def _moved_axes(name: str, args: tuple, src: Tensor, out: Tensor, axes: tuple[int, int]) -> Optional[tuple[int, int]]:
    """Where the two axes of a stored matrix (at positions `axes` of `src`) are in `out`, the output of the move
    op `name` (args: its arguments), or None where the op mixes or drops them."""
    if name in _SAME_AXES:
        return axes if out.dim() == src.dim() else None
    if name == "t":
        return (1 - axes[0], 1 - axes[1]) if src.dim() == 2 else None
    if name == "transpose":
        d0, d1 = (d % src.dim() for d in args[1:3])
        return tuple(d1 if a == d0 else d0 if a == d1 else a for a in axes)
    if name == "permute":
        dims = [d % src.dim() for d in args[1]]
        return tuple(dims.index(a) for a in axes)
    if name == "expand":
        return tuple(a + out.dim() - src.dim() for a in axes)
    if name in ("select", "unbind"):
        d = (args[1] if len(args) > 1 else 0) % src.dim()
        return None if d in axes else tuple(a - (a > d) for a in axes)
    if name in _RESHAPES:  # the axes of size > 1 keep their order: map them one to one
        before = [i for i, n in enumerate(src.shape) if n != 1]
        after = [i for i, n in enumerate(out.shape) if n != 1]
        if [src.shape[i] for i in before] == [out.shape[i] for i in after] and all(a in before for a in axes):
            return tuple(after[before.index(a)] for a in axes)
    return None


class UnsupportedModelError(ValueError):
    """The model has no CD pair, or a block whose computation does not match the pairs CD defines."""


class _Provenance(TorchDispatchMode):
    """Follows labels through aten ops. `moved`: value-preserving descendants of a tensor (parameters carry
    'p:<name>' this way through transposes and casts); `dep`: any descendant. A non-move op taking a pair's
    upstream parameter labels its outputs with the pair (moved too for a norm scale); a non-move op
    taking a pair's W2 is a use of the pair, whose other operand must carry the label."""

    def __init__(self, sources: dict[str, list[tuple[str, bool]]], sinks: dict[str, list[tuple[int, bool]]]):
        super().__init__()
        self.moved: dict[int, frozenset] = {}
        self.dep: dict[int, frozenset] = {}
        self.sources, self.sinks = sources, sinks
        self.uses: dict[int, int] = {}  # pair index -> ops that used W2
        self.bad: dict[int, int] = {}  # pair index -> uses whose operand lacked the label
        # composable pair index -> bad uses whose operand depends on the norm's output all the same (its scale
        # reached W2's input through another computation than x_hat * weight: (1 + weight), a further factor)
        self.computed: dict[int, int] = {}
        # pair index -> the norm (name, type) found between its W1 and W2 (`_hook_inner_norms`)
        self.normed: dict[int, tuple[str, str]] = {}
        # the 'norm:<k>' labels of attention pairs: a softmax ends them, as a norm there that reaches proj only
        # through the attention weights (a QK-norm) leaves W_O W_V proj's path
        self.softmax_ends: set[str] = set()
        self.norm_of: dict[str, tuple[str, str]] = {}  # 'norm:<k>' label -> the norm module that set it
        self._keep: list[Tensor] = []  # keeps labelled tensors alive, so that ids are not reused
        # a 2-D parameter and its moves: id -> positions of the stored matrix's first and second axes
        self.axes: dict[int, tuple[int, int]] = {}
        # parameter name -> how products multiplied it: True for over its first stored axis (x @ W: (in, out))
        self.reads: dict[str, set[bool]] = {}

    def track(self, t: Tensor) -> None:
        """Follow the axes of `t`, a parameter's meta copy, if it is a matrix."""
        if t.dim() == 2:
            self.axes[id(t)] = (0, 1)

    def _follow_axes(self, name: str, args: tuple, ins: list[Tensor], outs: list[Tensor], moves: bool) -> None:
        """Carry a matrix's axes through a move op, or record how a product contracts it (`reads`)."""
        if name.endswith("_"):  # an in-place op changes the tensor it returns
            for t in outs:
                self.axes.pop(id(t), None)
            return
        if moves:
            axes = self.axes.get(id(ins[0])) if ins and ins[0] is (args[0] if args else None) else None
            for t in outs if axes is not None else ():
                moved = _moved_axes(name, args, ins[0], t, axes)
                if moved is not None:
                    self.axes[id(t)] = moved
            return
        for i, axis in _PRODUCTS.get(name, {}).items():
            t = args[i] if i < len(args) else None
            axes = self.axes.get(id(t)) if isinstance(t, Tensor) else None
            if axes is None:
                continue
            axis %= t.dim()
            if axis in axes:
                for label in self.moved.get(id(t), ()):
                    if label.startswith("p:"):
                        self.reads.setdefault(label[2:], set()).add(axes.index(axis) == 0)

    def mark(self, t: Tensor, moved: frozenset, dep: frozenset = frozenset()) -> None:
        self._keep.append(t)
        if moved:
            self.moved[id(t)] = self.moved.get(id(t), frozenset()) | moved
        if dep:
            self.dep[id(t)] = self.dep.get(id(t), frozenset()) | dep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        moved_in = [self.moved.get(id(t), frozenset()) for t in ins]
        dep = frozenset().union(*(self.dep.get(id(t), frozenset()) for t in ins))
        name = func.overloadpacket.__name__
        if name in _SOFTMAX:
            dep = frozenset(label for label in dep if label not in self.softmax_ends)
        self._follow_axes(name, args, ins, outs, name.rstrip("_") in _MOVES)
        if name.rstrip("_") in _MOVES:
            moved = frozenset().union(*moved_in)
        else:
            moved = frozenset()
            for t in outs:  # an in-place op that computes (x.mul_(s)) ends the "only moved" history
                self.moved.pop(id(t), None)
            params = {label[2:] for labels in moved_in for label in labels if label.startswith("p:")}
            for name in params:
                for label, is_scale in self.sources.get(name, ()):
                    dep |= {label}
                    if is_scale:
                        moved |= {label}
                for k, composable in self.sinks.get(name, ()):
                    others = [t for t, m in zip(ins, moved_in) if f"p:{name}" not in m]
                    table = self.moved if composable else self.dep
                    self.uses[k] = self.uses.get(k, 0) + 1
                    normed = f"norm:{k}"
                    if not composable and any(normed in self.dep.get(id(t), frozenset()) for t in others):
                        self.normed.setdefault(k, self.norm_of[normed])
                    if not any(str(k) in table.get(id(t), frozenset()) for t in others):
                        self.bad[k] = self.bad.get(k, 0) + 1
                        if composable and any(str(k) in self.dep.get(id(t), frozenset()) for t in others):
                            self.computed[k] = self.computed.get(k, 0) + 1
        if dep or moved:
            for t in outs:
                self.mark(t, moved, dep)
        return out


def _meta_like(x):
    """A meta tensor of x's shape and dtype (x itself if it is no tensor: a flag such as use_cache)."""
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, Tensor) else x


def example_input(model: nn.Module) -> Union[Tensor, dict]:
    """A meta batch of the size and dtype the model expects: the model's own `example_input()` when it has
    one (a language model's token ids), else, for a transformers model, token ids or an image batch from its
    `main_input_name` and config, else an image batch (1, C, H, W) from timm's `patch_embed.img_size` and
    input channels (its first convolution's: a hybrid's CNN stem), or torchvision ViT's `image_size` and
    `conv_proj`, or timm Hiera's `tokens_spatial_shape` times its `patch_stride`, else from
    `pretrained_cfg['input_size']`.
    Raises UnsupportedModelError if none exists."""
    own = getattr(model, "example_input", None)
    if callable(own):
        x = own()
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    # transformers models name their input and describe it in their config
    main, cfg = getattr(model, "main_input_name", None), getattr(model, "config", None)
    if main == "input_ids":  # with a cache: without one (and no mask), transformers looks for packed
        # sequences in the position ids, which needs their values
        return {"input_ids": torch.empty(1, 8, dtype=torch.long, device="meta"), "use_cache": True}
    if main == "pixel_values" and isinstance(getattr(cfg, "image_size", None), int):
        return torch.empty(1, getattr(cfg, "num_channels", 3), cfg.image_size, cfg.image_size, dtype=dtype,
                           device="meta")
    pe = getattr(model, "patch_embed", None)
    size = getattr(pe, "img_size", None)
    # the image enters the first convolution: `proj` in timm's PatchEmbed, the CNN backbone's stem (registered
    # before `proj`, which sees its feature channels) in the hybrids' HybridEmbed
    first_conv = (next((m for m in pe.modules() if isinstance(m, nn.Conv2d)), None)
                  if isinstance(pe, nn.Module) else None)
    chans = getattr(first_conv or getattr(pe, "proj", None), "in_channels", None)
    if size is not None and chans is not None:
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        return torch.empty(1, chans, h, w, dtype=dtype, device="meta")
    # torchvision's VisionTransformer: its forward takes images of exactly `image_size`, patchified by `conv_proj`
    size, conv = getattr(model, "image_size", None), getattr(model, "conv_proj", None)
    # a conv stem (conv_stem_configs) makes conv_proj an nn.Sequential: the input is its first convolution's
    conv = next((m for m in conv.modules() if isinstance(m, nn.Conv2d)), None) if isinstance(conv, nn.Module) else None
    if isinstance(size, int) and conv is not None:
        return torch.empty(1, conv.in_channels, size, size, dtype=dtype, device="meta")
    # timm's Hiera keeps no img_size: its token grid times its patch stride is the image it was built for (its
    # pretrained_cfg's 224 px below would fail a Hiera built for another size, refused with a fix train.py lacks)
    grid, stride = getattr(model, "tokens_spatial_shape", None), getattr(model, "patch_stride", None)
    if isinstance(grid, (list, tuple)) and isinstance(stride, (list, tuple)) and len(grid) == len(stride) == 2 \
            and chans is not None:
        return torch.empty(1, chans, *(g * s for g, s in zip(grid, stride)), dtype=dtype, device="meta")
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if "input_size" in cfg:
        return torch.empty(1, *cfg["input_size"], dtype=dtype, device="meta")
    raise UnsupportedModelError(
        f"cannot tell the input size of {type(model).__name__} to check its CD pairs against a forward "
        "pass; pass example_input= (a tensor the model accepts; a meta tensor of its shape will do), or "
        "verify=False to trust the structure alone")


def _transformers_lm(root: nn.Module) -> bool:
    """A transformers model of token ids. Its `attention_mask` is left out of the meta forward: transformers
    reads the mask's values to choose the mask's form (`.item()`, which a meta tensor has no value for), and the
    mask weighs attention scores only, so where each layer's input comes from is the same without it; the
    V-row check (`cd/values.py`) runs with it."""
    return getattr(root, "main_input_name", None) == "input_ids"


def _ids_hint(root: nn.Module, example) -> str:
    """For a transformers model given 1-D token ids (one sequence without its batch dim, which its LM head
    cannot index), the form to pass instead; else ''."""
    ids = example.get("input_ids") if isinstance(example, Mapping) else example
    if _transformers_lm(root) and isinstance(ids, Tensor) and ids.dim() == 1:
        return (" (token ids of shape (batch, sequence), not a 1-D sequence: ids[None], or a dict "
                "{'input_ids': ids[None], 'attention_mask': mask[None]})")
    return ""


def _meta_slots(root: nn.Module, mode: _Provenance) -> dict[str, Tensor]:
    """{name: meta tensor} with one name per (module, attribute) slot and one meta tensor per tensor,
    labelled with every name the tensor has. A module shared by two blocks is one slot (functional_call
    with tied names would swap it twice and restore the meta tensor: the model's weights lost); a
    parameter tied between two modules is two slots holding one meta tensor (both names' labels), so a
    norm scale that is the W1 of two pairs is followed from either block."""
    slots: dict[str, Tensor] = {}
    seen: set[tuple[int, str]] = set()
    copies: dict[int, Tensor] = {}
    for prefix, module in root.named_modules(remove_duplicate=False):
        for attr, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is None:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            if id(t) not in copies:
                copies[id(t)] = torch.empty_like(t, device="meta")
            mode.mark(copies[id(t)], frozenset({f"p:{name}"}))
            mode.track(copies[id(t)])
            if (id(module), attr) not in seen:
                seen.add((id(module), attr))
                slots[name] = copies[id(t)]
    return slots


def _fully_sharded(root: nn.Module) -> bool:
    """Whether FSDP2's fully_shard wrapped a module of `root` (torch >= 2.6 names the class publicly)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # an older torch, or one built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in root.modules())


def _inside_fsdp1(module: nn.Module, fsdp2: bool) -> bool:
    """A module inside an FSDP1 wrapper that is not among the model's own modules (a trainer's callback given the
    inner model), by the mark FSDP1 leaves on it for torch.compile. FSDP2 sets the same mark, with use_orig_params
    True and DTensor parameters: with FSDP2 in the model (`fsdp2`), a plain parameter is one fully_shard ignores."""
    if not getattr(module, "_is_fsdp_managed_module", False):
        return False
    if getattr(module, "_fsdp_use_orig_params", None) is False:
        return True
    return not fsdp2 and any(p is not None for p in module._parameters.values())


def refuse_fsdp1(model: nn.Module) -> None:
    """Refuse a model wrapped (whole or in part) by FSDP1's FullyShardedDataParallel: it flattens each wrapped
    module's parameters into one sharded FlatParameter, so no rank holds a layer's matrix as a 2-D tensor and the
    optimizer may hold no matrix at all (use_orig_params=False). FSDP2's fully_shard keeps one (DTensor)
    parameter per matrix, which `cd.sharded` updates exactly.

    Raises:
        UnsupportedModelError: naming the wrapper and what to use instead.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch built without distributed
        return
    from .update import is_sharded  # here: cd.update imports cd.pairs, which imports this module

    fsdp2 = _fully_sharded(model) or any(is_sharded(p) for p in model.parameters())
    if any(isinstance(m, FullyShardedDataParallel) or _inside_fsdp1(m, fsdp2) for m in model.modules()):
        raise UnsupportedModelError(
            f"CD does not support FSDP1 (FullyShardedDataParallel), which holds {type(model).__name__} or a part of "
            "it: it flattens the parameters into sharded FlatParameters that hold no whole matrix to pair. Use FSDP2 "
            "(torch.distributed.fsdp.fully_shard, then ColinearityDecay(model, verify=False)) or DDP")


def verify_pairs(root: nn.Module, pairs: Sequence, block_types: dict[str, str],
                 example: Optional[Tensor] = None) -> None:
    """Run one meta forward of `root` and check every pair (see the module docstring).

    Args:
        root: the unwrapped model. pairs: `Pair`s of `root`. block_types: block name -> class name.
        example: an input of the right shape (any device; only its shape and dtype are used), a tuple or list
            of positional inputs (as Lightning's `example_input_array` gives a forward of several arguments),
            or a dict of keyword inputs (tensors and flags; a transformers language model's `attention_mask` is
            left out, `_transformers_lm`); default `example_input(root)`.

    Raises:
        UnsupportedModelError: naming the first failing pair, its block and the block's type.
    """
    if _fully_sharded(root):  # its meta forward would run FSDP's own hooks, which it leaves in a broken state
        raise UnsupportedModelError(
            f"cannot check the CD pairs of {type(root).__name__}: it is sharded by FSDP2 (fully_shard), whose "
            "hooks the check's meta forward would run and leave broken; check the unsharded model "
            "(find_pairs(model) before fully_shard) and pass verify=False here")
    example = example_input(root) if example is None else example
    if isinstance(example, Mapping):  # keyword inputs (a transformers model's), tensors made meta
        args, kwargs = (), {k: _meta_like(v) for k, v in example.items()
                            if not (k == "attention_mask" and _transformers_lm(root))}
    elif isinstance(example, (tuple, list)):  # positional inputs, Lightning's convention: forward(*example)
        args, kwargs = tuple(_meta_like(v) for v in example), {}
    else:
        args, kwargs = (_meta_like(example),), {}
    sources: dict[str, list[tuple[str, bool]]] = {}
    sinks: dict[str, list[tuple[int, bool]]] = {}
    for k, p in enumerate(pairs):
        sources.setdefault(p.upstream_name, []).append((str(k), p.kind == "composable"))
        sinks.setdefault(p.name, []).append((k, p.kind == "composable"))
    mode = _Provenance(sources, sinks)
    meta = _meta_slots(root, mode)
    hooks = _hook_inner_norms(root, pairs, mode)
    try:
        with torch.no_grad(), mode:
            torch.func.functional_call(root, meta, args, kwargs, tie_weights=False)
    except Exception as e:  # e.g. data-dependent control flow, or a tensor made on another device
        raise UnsupportedModelError(
            f"cannot check the CD pairs of {type(root).__name__}: its forward pass on the meta device failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); pass example_input= of the "
            f"right shape{_ids_hint(root, example)}, or verify=False to trust the structure alone") from e
    finally:
        for hook in hooks:
            hook.remove()
    failures = []
    for k, p in enumerate(pairs):
        where = f"block '{p.block}' ({block_types.get(p.block, '?')}): the {p.role} pair"
        misread = _misread(mode.reads, p)
        if k not in mode.uses:
            failures.append(f"{where}: {p.name} {UNUSED}")
        elif misread:
            failures.append(f"{where}: {misread}")
        elif k in mode.bad and p.kind == "composable" and mode.computed.get(k) == mode.bad[k]:
            failures.append(f"{where}: the input of {p.name} depends on the output of the norm "
                            f"{p.upstream_name.rpartition('.')[0]}, but the norm's scale reaches it through a "
                            "computation other than a multiplication by its weight (such as x_hat * (1 + weight), "
                            "as Gemma's RMSNorm scales, or a further factor after x_hat * weight); the composable "
                            f"pair W2 diag(g) (paper Eqs. (4)-(5)) needs {p.name} to read x_hat * weight, moved "
                            "only: give the norm a scale it multiplies by directly, or train this model without CD")
        elif k in mode.bad and p.kind == "composable":
            failures.append(f"{where}: the input of {p.name} is not the output of the norm "
                            f"{p.upstream_name.rpartition('.')[0]} (CD supports pre-norm blocks; res-post-norm "
                            "and post-norm blocks, where the norm follows the layer, are refused)")
        elif k in mode.bad:
            failures.append(f"{where}: the input of {p.name} does not come from {p.upstream_name}")
        elif k in mode.normed and p.role == "proj":
            norm, kind = mode.normed[k]
            up, down = p.upstream_name.removesuffix(".weight"), p.name.removesuffix(".weight")
            failures.append(f"{where}: the norm {norm} ({kind}) stands on V's way from {up} to {down} "
                            "(it normalizes each token's channels after the attention, as DiffAttention's sub_norm, "
                            "or V before it), so W_O reads W_V through a per-token scaling and W_O W_V (paper "
                            "Sec. 3.2) is not its path; pass verify=False to pair them unchecked (beyond the paper), "
                            "or train this model without CD")
        elif k in mode.normed:
            norm, kind = mode.normed[k]
            failures.append(f"{where}: the norm {norm} ({kind}) normalizes {p.upstream_name.removesuffix('.weight')}"
                            f"'s output before {p.name.removesuffix('.weight')} reads it (a norm over the hidden "
                            "channels, a sub-LN), so W_F2 reads W_F1 through a per-token scaling and W_F2 W_F1 (paper "
                            "Eq. (8)) is not its path; pass verify=False to pair them unchecked (beyond the paper), "
                            "or train this model without CD")
    if failures:
        raise UnsupportedModelError(f"{type(root).__name__} is not supported by CD: {failures[0]}"
                                    + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else "")
                                    + _adapter_hint(root))


def _normalizes_channels(module: nn.Module) -> bool:
    """A leaf module that is a norm over its input's channels by its type's name (torch's LayerNorm, RMSNorm,
    GroupNorm, timm's and transformers' norms); a batch or instance norm keeps each channel apart."""
    kind = type(module).__name__.lower()
    return ("norm" in kind and "batchnorm" not in kind and "instancenorm" not in kind
            and next(module.children(), None) is None)


def _hook_inner_norms(root: nn.Module, pairs: Sequence, mode: _Provenance) -> list:
    """Forward hooks on the norms inside each MLP or attention (functional pair k: the module holding W2's layer, less
    the block's own norms) that label a norm's output 'norm:<k>' when its input comes from W1's output: W2 reading
    that label reads W1 through the norm. An RMSNorm maps the channels the values check sets to zero to zeros
    (`cd/values.py`), so only the structure tells it; a norm after W2 gives W2 nothing. A fused qkv's label is on Q
    and K too, so a QK-norm's input comes from it as well: an attention pair's label ends at a softmax
    (`_Provenance.softmax_ends`), and proj reads it only from a norm on V's way (before or after the mixing)."""
    block_norms = {p.upstream_name.rpartition(".")[0] for p in pairs if p.kind == "composable"}
    parts: dict[str, list[int]] = {}
    for k, p in enumerate(pairs):
        if p.kind == "functional":
            parts.setdefault(p.name.rpartition(".")[0].rpartition(".")[0], []).append(k)
            if p.role == "proj":
                mode.softmax_ends.add(f"norm:{k}")
    hooks = []
    for name, module in root.named_modules():
        ks = [k for part, found in parts.items() if name.startswith(f"{part}.") for k in found]
        if not ks or name in block_norms or not _normalizes_channels(module):
            continue

        def label(module: nn.Module, args: tuple, out: object, name: str = name, ks: list[int] = ks) -> None:
            x = args[0] if args else None
            came = mode.dep.get(id(x), frozenset()) if isinstance(x, Tensor) else frozenset()
            for k in ks:
                if str(k) in came and isinstance(out, Tensor):
                    mode.norm_of[f"norm:{k}"] = (name, type(module).__name__)
                    mode.mark(out, frozenset(), frozenset({f"norm:{k}"}))
        hooks.append(module.register_forward_hook(label))
    return hooks


def _misread(reads: dict[str, set[bool]], p) -> str:
    """Why the forward's products contradict the storage that pair `p` reads a matrix with, or ''."""
    matrices = [(p.name, p.transposed)] + ([] if p.diagonal else [(p.upstream_name, p.upstream_transposed)])
    for name, assumed in matrices:
        if (not assumed) in reads.get(name, ()):
            return (f"the forward multiplies {name} as {_HOW[not assumed]}, a weight stored {_STORED[not assumed]}, "
                    f"but CD reads it as stored {_STORED[assumed]} and would decay the transpose of the matrix the "
                    "layer applies. A layer whose type and shape do not tell its storage is read with its layout's: "
                    f"give cd.Layout(..., transposed={not assumed}) (an nn.Linear or Conv1D is read by its type: "
                    "multiply its weight as its own forward does)")
    return ""


# how a refusal of adapters ends: what CD applies to and the ways out (here and in cd.adapters)
ADAPTER_FIX = ("CD applies to full fine-tuning or training, not to adapters: merge the adapters into the weight "
               "first (PEFT: merge_and_unload()) and train the merged model, or train without CD")


def _adapter_hint(root: nn.Module) -> str:
    """The likely cause when `root` holds PEFT adapters (LoRA's lora.Linear reads a frozen `base_layer` and adds a
    low-rank term, so the matrix the pair names is not what the forward multiplies): CD decays whole matrices."""
    adapters = sorted({f"{type(m).__module__}.{type(m).__name__}" for m in root.modules()
                       if type(m).__module__.startswith("peft.")})
    if not adapters:
        return ""
    named = ", ".join(adapters[:2]) + (", ..." if len(adapters) > 2 else "")
    return (f"; the model holds PEFT adapters ({named}), which freeze the weights CD decays and train low-rank "
            f"terms beside them: {ADAPTER_FIX}")


def _memory(t: Tensor) -> Optional[tuple[torch.device, int, int, Tensor]]:
    """(device, first byte, end byte, tensor) of the memory `t` spans, the bytes absolute addresses (`data_ptr`, so
    that two storages over one memory, e.g. two `torch.from_numpy` of one array, compare too), or None where there is
    none to compare: a meta tensor's address is 0 for every tensor (no memory at all), so two meta matrices would look
    like one; a tensor whose operations run in Python (`__torch_dispatch__`: a wrapper subclass such as torchao's
    float8 weights or a fake tensor) holds its values in tensors of its own, its storage a placeholder whose address
    is 0 or refused ('invalid python storage'), so it is compared as a tensor only. An FSDP2 shard (DTensor) is
    compared by its local tensor. The span is from the lowest to the highest element (strides are >= 0): two views
    that interleave span overlapping bytes without sharing one (`_share_element` tells)."""
    t = getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank
    if t.is_meta or t.numel() == 0 or torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python):
        return None
    first = t.data_ptr()
    last = first + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) * t.element_size()
    return t.device, first, last + t.element_size(), t


def _element_starts(t: Tensor) -> Tensor:
    """The address of the first byte of each element of `t`, sorted: int64 on the CPU, from its size, strides and
    address alone (its values are not read). Absolute (addresses fit in int64) so that one tensor's are built once
    and compared with every tensor whose span meets it (`refuse_shared`)."""
    # device="cpu": under torch.set_default_device("meta") these would be meta tensors, which searchsorted and the
    # comparison in _share_element cannot read (torch.nonzero on meta is refused)
    offsets = torch.zeros((), dtype=torch.int64, device="cpu")
    for n, s in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64, device="cpu") * s
    return (offsets.flatten() * t.element_size() + t.data_ptr()).sort().values


def _share_element(a: Tensor, b: Tensor, starts: Callable[[Tensor], Tensor] = _element_starts) -> bool:
    """Whether tensors `a` and `b`, whose spans overlap (`_memory`), have a byte in common: an element of `a` starting
    at x meets one of `b` iff the last element of `b` starting before x + a's element size ends after x (elements
    of two dtypes may meet without starting at one byte). Built only for overlapping spans, which no layer's weights
    have: views of one buffer interleaved (`big[:, i, :]`) overlap in span and share no element. `starts` gives a
    tensor's `_element_starts` (`refuse_shared` passes one that builds each tensor's once)."""
    xs, ys = starts(a), starts(b)
    below = torch.searchsorted(ys, xs + a.element_size()) - 1  # the last element of b starting before x's end
    met = below >= 0
    return bool((ys[below[met]] + b.element_size() > xs[met]).any())


def refuse_shared(pairs: Sequence, block_types: dict[str, str]) -> None:
    """Refuse pairs whose decayed matrix W2 is one tensor shared by several blocks (tied weights, one
    module in two blocks), or whose memory is shared in part or whole (two Parameters over one memory, e.g.
    `nn.Parameter(other.weight.data)`): CD defines one update per matrix and pair, and a shared W2 would get one per
    block, from each block's W1, the second reading the weights the first already changed. A shared W1 (one norm
    scale feeding two blocks) is fine: it is only read. Views of one buffer without a common element are separate
    matrices. Matrices on the meta device, or whose values live in Python (wrapper tensor subclasses), are compared
    as tensors only (`_memory`).

    Raises:
        UnsupportedModelError: naming the matrix, both blocks and the first block's type.
    """
    first: dict[int, object] = {}
    spans: dict[torch.device, list[tuple[int, int, Tensor, object]]] = {}  # (first byte, end byte, tensor, pair)
    # each tensor's element addresses, built once: views interleaved in one buffer (`big[:, b, :]` per block) all
    # overlap in span, and rebuilding both tensors' for every pair of them was quadratic in the blocks (a ViT-Base
    # layout took a minute). Keyed by id: every tensor stays alive in `spans` for the whole call.
    built: dict[int, Tensor] = {}

    def starts(t: Tensor) -> Tensor:
        if id(t) not in built:
            built[id(t)] = _element_starts(t)
        return built[id(t)]

    for p in pairs:
        other = first.setdefault(id(p.downstream), p)
        how = "is the same tensor as"
        memory = _memory(p.downstream) if other is p else None
        if memory is not None:
            device, start, end, t = memory
            other = next((q for s, e, u, q in spans.get(device, []) if s < end and start < e
                          and _share_element(t, u, starts)),
                         p)
            spans.setdefault(device, []).append((start, end, t, p))
            how = "shares memory with"
        if other is not p:
            raise UnsupportedModelError(
                f"block '{p.block}' ({block_types.get(p.block, '?')}) is not supported by CD: its {p.role} matrix "
                f"{p.name} {how} {other.name} of block '{other.block}' (shared between blocks); "
                "CD decays each matrix as the W2 of one pair. Give each block its own copy, or train without CD")


def refuse_split_devices(pairs: Sequence, block_types: dict[str, str]) -> None:
    """Refuse a pair whose two matrices lie on different devices (a block split across GPUs): its products
    need both on one device, and CD moves no weights between devices. A matrix on the `meta` device is passed over:
    it has no values at all (a model partly materialised), which the callers that need values refuse with that
    cause and its fix (`cd.decay.refuse_meta`: materialise, then build), not with "keep each block on one device".

    Raises:
        UnsupportedModelError: naming the pair, its block and both devices.
    """
    for p in pairs:
        if p.downstream.is_meta or p.upstream.is_meta:
            continue
        if p.downstream.device != p.upstream.device:
            raise UnsupportedModelError(
                f"block '{p.block}' ({block_types.get(p.block, '?')}) is not supported by CD: its {p.role} pair has "
                f"{p.name} on {p.downstream.device} and {p.upstream_name} on {p.upstream.device}; CD multiplies "
                "the two matrices of a pair, which needs them on one device. Keep each block on one device")
