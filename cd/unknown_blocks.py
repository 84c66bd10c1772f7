"""Transformer blocks that no layout finds, so that they are refused rather than silently left out.

`cd.pairs` finds blocks by their layout's names (`cd.layouts`). A model that mixes blocks of a known layout with
blocks of its own names would otherwise have only the known ones paired by CD and hooked by TWEO, while the paper
applies both to every block. This module tells such a block by its structure, whatever its layers are called: a
module, outside every block and patch-merging layer found and holding none of them, that holds, at any depth,

- an attention: an `nn.MultiheadAttention`, or a module whose own matrix layers are, by their shapes, a fused
  [Q; K; V] layer (D -> 3E) and an output layer (E -> D), or three input layers (D -> E, D -> E', D -> E') and an
  output layer (E -> D) (also by the names of libraries: a `*qkv*` or `c_attn` layer, q, k and v layers, beside an
  output layer `proj`, `out`, `o_proj`, ...), also with q, k and v the matrices of one child and the output layer
  the one other matrix, in a sibling (transformers' BERT, RoBERTa, Data2VecVision: attention.self.query, key,
  value beside attention.output.dense);
- a norm: a module with a 1-D affine `weight` (LayerNorm, RMSNorm);
- an MLP: at least two more matrix layers, outside the attentions;

or a block whose one input layer feeds both its attention and its MLP (D -> 3E + H, beside E -> D and H -> D, as
timm's `ParallelScalingBlock`), which no layout can pair. The innermost such module is the block, so a container of
blocks (a Sequential, a decoder) is not taken for one, and an attention-pooling head (a latent query, a fused kv:
no [Q; K; V] of the stream) or a classifier is not taken for a block.

Half a block on its own (`half_block_parts`: a norm with only attentions, as CrossViT's fusion CrossAttentionBlock,
or only MLPs) beside the blocks found is left out as well: no layout describes one, and its structure does not tell a
residual half block from a head, so `cd.pairs` names it in a warning rather than refuse the model
(`unknown_half_blocks`).
"""
from __future__ import annotations

import itertools
from typing import Collection, Iterator, Optional

import torch
from torch import nn

# the names the attention layers go by across libraries (timm, transformers, lucidrains' vit-pytorch, Llama's
# original code); a fused qkv is any name containing 'qkv'
_Q, _K, _V = ("q", "q_proj", "query", "to_q", "wq"), ("k", "k_proj", "key", "to_k", "wk"), \
    ("v", "v_proj", "value", "to_v", "wv")
_FUSED = ("c_attn",)
_OUT = ("proj", "out", "out_proj", "o_proj", "c_proj", "to_out", "wo", "o", "dense")
# at most this many matrices of one module are tried as the four of an attention, or the three of a fused block (the
# search is over their orders); more are a stack of layers, not one attention
_MAX_FOUR, _MAX_THREE = 8, 16


def _layer_weight(module: nn.Module) -> Optional[torch.Tensor]:
    """The matrix a Linear-like layer applies: its 2-D `weight` Parameter (a 1x1 Conv1d/Conv2d's, (out, in, 1...)
    read as (out, in)), or that of the first child of a container
    holding no other matrix layer (an output layer kept as Sequential(Linear, Dropout)); None otherwise. An
    embedding table is looked up, not applied: None."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return None
    w = getattr(module, "weight", None)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):  # a 1x1 convolution is a matrix (out, in) applied per position
        pointwise = isinstance(w, nn.Parameter) and module.groups == 1 and all(k == 1 for k in module.kernel_size)
        return w if pointwise else None
    if isinstance(w, nn.Parameter):
        return w if w.dim() == 2 else None
    children = list(module.children())
    # an attention is not one layer: nn.MultiheadAttention (or a module like it) applies matrices of its own
    # (in_proj_weight) besides its out_proj child, so a block holding one does not own that out_proj for the shape tests
    if isinstance(module, nn.MultiheadAttention) or any(p.dim() == 2 for p in module.parameters(recurse=False)):
        return None
    if not children or any(_layer_weight(c) is not None for c in children[1:]):
        return None
    return _layer_weight(children[0])


def _own_matrices(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, matrix) of the matrices `module` applies itself: its direct children's (`_layer_weight`) and the 2-D
    weight Parameters it holds itself (nn.MultiheadAttention's `in_proj_weight`)."""
    out = [(name, w) for name, child in module.named_children() if (w := _layer_weight(child)) is not None]
    return out + [(name, p) for name, p in module.named_parameters(recurse=False)
                  if p.dim() == 2 and name.endswith("weight") and not isinstance(module, (nn.Embedding,
                                                                                           nn.EmbeddingBag))]


def _shapes(mats: list[tuple[str, torch.Tensor]], transposed: bool) -> list[tuple[int, int]]:
    """(out, in) of each matrix, as an (out, in) layer stores it, or as an (in, out) one (transformers' Conv1D)."""
    return [(w.shape[1], w.shape[0]) if transposed else (w.shape[0], w.shape[1]) for _, w in mats]


def _attention_by_shape(mats: list[tuple[str, torch.Tensor]]) -> Optional[list[int]]:
    """Indices of the matrices that make an attention by their shapes (module docstring), or None."""
    for transposed in (False, True):
        shape = _shapes(mats, transposed)
        for a, b in itertools.permutations(range(len(mats)), 2):  # fused [Q; K; V] (3E, D), output (D, E)
            if shape[a][0] == 3 * shape[b][1] and shape[a][1] == shape[b][0]:
                return [a, b]
        if len(mats) <= _MAX_FOUR:
            for q, k, v, o in itertools.permutations(range(len(mats)), 4):  # q (E, D), k and v (E', D), o (D, E)
                d, e = shape[o]
                if shape[q] == (e, d) and shape[k] == shape[v] and shape[k][1] == d:
                    return [q, k, v, o]
    return None


def _attention_by_name(mats: list[tuple[str, torch.Tensor]]) -> Optional[list[int]]:
    names = {name for name, _ in mats}
    fused = any("qkv" in name.lower() or name in _FUSED for name in names)
    separate = all(names.intersection(n) for n in (_Q, _K, _V))
    return list(range(len(mats))) if (fused or separate) and names.intersection(_OUT) else None


def _leaf_name(module: nn.Module, w: torch.Tensor) -> str:
    """The name of the layer inside `module` whose weight is `w` ('dense' for a BertSelfOutput's), '' if none."""
    return next((name.rsplit(".", 1)[-1] for name, sub in module.named_modules()
                 if getattr(sub, "weight", None) is w), "")


def _split_attention(module: nn.Module) -> Optional[list[tuple[str, torch.Tensor]]]:
    """(name, matrix) of q, k, v and the output layer of an attention whose q, k and v are the only matrices of one
    child and whose output layer is the one other matrix of `module`, in a sibling's subtree (transformers' BERT,
    RoBERTa, Data2VecVision: attention.self.{query, key, value} beside attention.output.dense, the output's norm
    beside it), else None. The names are the layers' own, for `_attention_by_name`."""
    if any(p.dim() == 2 for p in module.parameters(recurse=False)):
        return None
    for name, child in module.named_children():
        qkv = _own_matrices(child)
        if len(qkv) != 3 or len(_matrices(child)) != 3:
            continue
        rest = [(n, w) for n, sib in module.named_children() if n != name for _, w in _matrices(sib)]
        if len(rest) == 1:
            out = module.get_submodule(rest[0][0])
            return qkv + [(_leaf_name(out, rest[0][1]), rest[0][1])]
    return None


def _attention(module: nn.Module) -> Optional[set[int]]:
    """The ids of the matrices of `module`'s attention when `module` is one (module docstring), else None."""
    if isinstance(module, nn.MultiheadAttention):
        return {id(p) for p in module.parameters() if p.dim() == 2}
    for mats in (_own_matrices(module), _split_attention(module)):
        found = mats and (_attention_by_shape(mats) or _attention_by_name(mats))
        if found:
            return {id(mats[i][1]) for i in found}
    return None


def _fused_parallel(module: nn.Module) -> Optional[str]:
    """'in_proj (D -> 3E + H) feeds attn_out (E -> D) and mlp_out (H -> D)' when one layer of `module` is the input
    layer of both its attention and its MLP (timm's ParallelScalingBlock), else None."""
    mats = _own_matrices(module)
    for transposed in (False, True) if len(mats) <= _MAX_THREE else ():
        shape = _shapes(mats, transposed)
        for i, a, m in itertools.permutations(range(len(mats)), 3):
            d, e, h = shape[i][1], shape[a][1], shape[m][1]
            if shape[a][0] == shape[m][0] == d and shape[i][0] == 3 * e + h:
                return (f"{mats[i][0]} ({d} -> 3x{e} + {h}) feeds both the attention's output layer {mats[a][0]} "
                        f"and the MLP's {mats[m][0]}")
    return None


def _is_norm(module: nn.Module) -> bool:
    """A norm with an affine scale: a 1-D `weight` Parameter on a module without children."""
    w = getattr(module, "weight", None)
    return isinstance(w, nn.Parameter) and w.dim() == 1 and next(module.children(), None) is None


def _matrices(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, matrix) of every matrix applied inside `module`, at any depth, each once."""
    seen: set[int] = set()
    out = []
    for name, sub in module.named_modules():
        for own, w in _own_matrices(sub):
            if id(w) not in seen:
                seen.add(id(w))
                out.append((f"{name}.{own}" if name else own, w))
    return out


def _label(name: str, module: nn.Module) -> str:
    return f"{name or 'itself'} ({type(module).__name__})"


class _Reader:
    """`_attention` and `_fused_parallel` of each module, computed once per search: a module is read again with
    every module around it."""

    def __init__(self) -> None:
        self._attention: dict[int, Optional[set[int]]] = {}
        self._fused: dict[int, Optional[str]] = {}

    def attention(self, module: nn.Module) -> Optional[set[int]]:
        if id(module) not in self._attention:
            self._attention[id(module)] = _attention(module)
        return self._attention[id(module)]

    def fused(self, module: nn.Module) -> Optional[str]:
        """`_fused_parallel`, tested only on a module with no attention inside it: a block with its attentions (self-
        and cross-attention) beside an MLP is one of several attentions, whose MLP input width may happen to read as
        3E + H (nn.TransformerDecoderLayer(64, 2, 256): linear1 is 256 = 3x64 + 64 wide)."""
        if id(module) not in self._fused:
            self._fused[id(module)] = None if any(self.attention(s) is not None for s in module.modules()) \
                else _fused_parallel(module)
        return self._fused[id(module)]


def block_parts(module: nn.Module, reader: Optional[_Reader] = None) -> Optional[str]:
    """'attention mix (Attention), norm ln_a (LayerNorm), MLP ffn (Mlp)' when `module` holds the parts of a
    Transformer block (module docstring), 'norm ..., attention and MLP fused in ...: <how>' for a block whose input
    layer feeds both its attention and its MLP, else None. Paths are relative to `module`."""
    reader = reader or _Reader()
    modules = list(module.named_modules())
    norm = next(((n, m) for n, m in modules if _is_norm(m)), None)
    if norm is None:
        return None
    fused = next(((n, m, how) for n, m in modules if (how := reader.fused(m))), None)
    if fused is not None:
        return f"norm {_label(*norm)}, attention and MLP fused in {_label(*fused[:2])}: {fused[2]}"
    attentions = [(n, m, ids) for n, m in modules if (ids := reader.attention(m)) is not None]
    if not attentions:
        return None
    taken = set().union(*(ids for _, _, ids in attentions))
    matrices = _matrices(module)
    rest = {id(w) for _, w in matrices if id(w) not in taken}
    if len(rest) < 2:
        return None
    # the MLP: the innermost module holding two of the other matrices and no attention (Mlp, a Sequential), or the
    # layers themselves where the block holds them directly
    mlps = [n for n, m in modules if n and all(reader.attention(s) is None for s in m.modules())
            and len({id(w) for _, w in _matrices(m)} & rest) >= 2]
    inner = [n for n in mlps if not any(o.startswith(n + ".") for o in mlps)]
    mlp = _label(inner[0], module.get_submodule(inner[0])) if inner else \
        "layers " + ", ".join(n for n, w in matrices if id(w) in rest)
    count = f" (and {len(attentions) - 1} more)" if len(attentions) > 1 else ""
    return f"attention {_label(*attentions[0][:2])}{count}, norm {_label(*norm)}, MLP {mlp}"


def block_note(module: nn.Module) -> tuple[str, bool]:
    """What a layout can do for the block `module` (`block_parts`): ('', True) for one attention and one MLP; a
    sentence and False for a block whose input layer feeds both its attention and its MLP (no layout can pair it); a
    sentence and True for one holding several attentions (one layout per attention and its MLP)."""
    reader = _Reader()
    if any(reader.fused(m) for m in module.modules()):
        return ("its one input layer feeds both its attention and its MLP (a fused parallel block, as timm's "
                "ParallelScalingBlock), so no cd.Layout can pair it: each CD pair reads a layer of one role (a norm's "
                "scale with qkv, or with fc1); train this model without CD"), False
    count = sum(reader.attention(m) is not None for m in module.modules())
    if count > 1:
        return (f"it holds {count} attentions (parallel branches, as timm's ParallelThingsBlock, or self- and "
                "cross-attention): give one cd.Layout per attention with its norm and MLP, all of them together (a "
                "block that several layouts fit gets the pairs of each)"), True
    return "", True


def unknown_blocks(root: nn.Module, known: Collection[str]) -> Iterator[tuple[str, nn.Module, str]]:
    """(name, module, `block_parts`) of every module of `root`, in model order, that is a Transformer block by its
    structure (the innermost module holding a block's parts) but is neither inside nor around a module named in
    `known` (the blocks and patch-merging layers found)."""

    def related(name: str, other: str) -> bool:  # one is the other, or holds it
        return name == other or not other or name.startswith(other + ".") or not name or other.startswith(name + ".")

    reader = _Reader()
    found = [(name, module, parts) for name, module in root.named_modules()
             if not any(related(name, k) for k in known) and (parts := block_parts(module, reader)) is not None]
    names = [name for name, _, _ in found]
    for name, module, parts in found:
        if not any(other.startswith(name + ".") or (not name and other) for other in names):
            yield name, module, parts


def _under(name: str, prefix: str) -> bool:
    """`name` is the module `prefix` or a module inside it."""
    return name == prefix or name.startswith(prefix + ".")


def _scale_shaped(p: torch.Tensor) -> bool:
    """A parameter of shape (D,) or (1, ..., 1, D): a per-channel scale or shift (a LayerScale gamma kept as
    (1, 1, D)) or a single token (a cls token, a one-token latent query), not a layer's matrix."""
    return all(s == 1 for s in p.shape[:-1])


def _mlp_pieces(module: nn.Module, reader: _Reader) -> tuple[list[tuple[str, tuple[str, ...], set[int]]], bool]:
    """The MLPs of `module`: (label, the names of the modules that make it up, its widths D and H) of each innermost
    module below `module` that holds exactly two matrices, D -> H and H -> D, and no attention (Mlp, a Sequential),
    and False; where there is none and `module` holds exactly two such matrices as its own children (an FFN of
    norm, fc1, act, fc2 as one module's layers), those two as one MLP, and True."""
    def widths(mats: list[tuple[str, torch.Tensor]]) -> Optional[set[int]]:
        if len(mats) != 2 or tuple(mats[0][1].shape[:2]) != tuple(mats[1][1].shape[:2])[::-1]:
            return None  # D -> H and H -> D, in either storage
        return set(mats[0][1].shape[:2])

    found = [(n, m, dh) for n, m in module.named_modules() if n and (dh := widths(_matrices(m))) is not None
             and all(reader.attention(s) is None for s in m.modules())]
    inner = [(n, m, dh) for n, m, dh in found if not any(o.startswith(n + ".") for o, _, _ in found)]
    if inner:
        return [(_label(n, m), (n,), dh) for n, m, dh in inner], False
    own = _own_matrices(module)
    dh = widths(own) if len(_matrices(module)) == 2 else None
    if dh is None:
        return [], False
    return [("of layers " + ", ".join(n for n, _ in own), tuple(n for n, _ in own), dh)], True


def half_block_parts(module: nn.Module, reader: Optional[_Reader] = None) -> Optional[str]:
    """'an attention attn (Attention) after a norm norm1 (LayerNorm) and no MLP' or 'an MLP mlp (Mlp) after a norm
    norm2 (LayerNorm) and no attention' when `module` holds a norm with only attentions or only MLPs: one half of a
    pre-norm Transformer block on its own (a residual sub-block, as timm's CrossViT fusion CrossAttentionBlock,
    norm1 -> attn), or a head; the structure does not tell which. Else None.

    Each attention (`_attention`) and each MLP (`_mlp_pieces`) below `module` counts on its own, so several of one
    kind (norm1 -> attn, norm2 -> attn2) are told together, and an MLP may be two layers that are `module`'s own
    children. A norm outside them has the width of one of their matrices (before such own layers, as a pre-norm).
    Every other weight of `module` is theirs (their matrices, an attention's position tables) or scale-shaped ((D,)
    or (1, ..., 1, D): a LayerScale gamma), so that a convolutional block (MBConv, ConvNeXt: a depthwise convolution
    beside the MLP), an attention-pooling head with its own q, kv and output layers (timm's AttentionPoolLatent, the
    MAP head of SigLIP) or a head with a classifier is not taken for one, nor is a flat attention (`module` itself)
    whose q/k norms are its own children."""
    reader = reader or _Reader()
    modules = list(module.named_modules())
    attentions = [(n, m, ids) for n, m in modules if (ids := reader.attention(m)) is not None]
    own = False
    if attentions:
        outer = [(n, m, ids) for n, m, ids in attentions if not any(a and n.startswith(a + ".")
                                                                   for a, _, _ in attentions)]
        if any(not n for n, _, _ in outer):  # `module` is an attention itself
            return None
        pieces = [(_label(n, m), (n,), {d for _, w in _matrices(m) if id(w) in ids for d in w.shape[:2]})
                  for n, m, ids in outer]
    else:
        pieces, own = _mlp_pieces(module, reader)
        if not pieces:
            return None
    inside = [n for _, names, _ in pieces for n in names]
    if any(not _scale_shaped(p) and not any(_under(n, i) for i in inside) for n, p in module.named_parameters()):
        return None
    widths = set().union(*(w for _, _, w in pieces))
    norms = [(n, m) for n, m in modules if n and _is_norm(m) and m.weight.shape[0] in widths
             and not any(_under(n, i) for i in inside)]
    if own:  # a pre-norm: a child of `module` before both layers (not a norm between them, as Mlp's norm_layer)
        children = [n for n, _ in module.named_children()]
        norms = [(n, m) for n, m in norms if n in children and all(children.index(n) < children.index(i)
                                                                   for i in inside)]
    if not norms:
        return None
    what = "attention" if attentions else "MLP"
    parts = ", ".join(label for label, _, _ in pieces)
    return (f"{'an ' + what if len(pieces) == 1 else what + 's'} {parts} after a norm {_label(*norms[0])} and no "
            f"{'MLP' if attentions else 'attention'}")


def unknown_half_blocks(root: nn.Module, known: Collection[str]) -> Iterator[tuple[str, nn.Module, str]]:
    """(name, module, `half_block_parts`) of every module of `root`, in model order, that is half of a Transformer
    block on its own (the innermost module holding the parts) and is neither inside nor around a module named in
    `known` (the blocks and patch-merging layers found) nor a Transformer block (`block_parts`): a sub-block or a
    head beside the blocks found, which no layout can describe (a `cd.Layout` names an attention and an MLP)."""

    def related(name: str, other: str) -> bool:  # one is the other, or holds it
        return _under(name, other) or _under(other, name) or not name or not other

    reader = _Reader()
    modules = list(root.named_modules())
    # the innermost Transformer blocks by structure: their own halves are parts of them, not sub-blocks
    full = [name for name, module in modules if name and block_parts(module, reader) is not None]
    blocks = [name for name in full if not any(other.startswith(name + ".") for other in full)]
    found = [(name, module, parts) for name, module in modules
             if not any(related(name, k) for k in (*known, *blocks))
             and (parts := half_block_parts(module, reader)) is not None]
    names = [name for name, _, _ in found]
    for name, module, parts in found:
        if not any(other.startswith(name + ".") for other in names):
            yield name, module, parts


def unpaired_part(module: nn.Module, read: Collection[int], widths: Collection[int],
                  skip: Collection[str] = ()) -> Optional[str]:
    """'attention attns.1.attn (Attention)' or 'MLP ffns.1.mlp (Mlp)': the first attention (`_attention`) or MLP
    inside the block `module` none of whose matrices is in `read` (the ids of the matrices its pairs read), else
    None. Both count at the block's width only, D one of `widths` (its norm widths): an attention has a matrix of
    width D, and an MLP is a module with no attention inside whose matrices include a layer D -> H and one H -> D.
    A module with a matrix that a pair reads is not unread (an adapter around a paired layer: LoRA's lora_B, lora_A
    read as a fused qkv and its output layer by their shapes; refused as adapters by `cd.adapters`). Modules inside
    an attention (below the block) are not counted: a relative-position MLP (timm's RelPosMlp, 2 -> D -> heads)
    is a part of its attention, whatever D. Modules in or under `skip` (blocks of a layout nested in this one,
    which CD leaves to the outermost match) are not looked at."""
    reader = _Reader()
    modules = [(n, m) for n, m in module.named_modules() if not any(n == s or n.startswith(s + ".") for s in skip)]
    # the block itself may read as an attention (its layers direct children): only attentions below it hide parts
    inside = [n for n, sub in modules if n and reader.attention(sub) is not None]
    modules = [(n, m) for n, m in modules if not any(n.startswith(a + ".") for a in inside)]
    for name, sub in modules:
        ids = reader.attention(sub)
        if ids is not None and not any(id(w) in read for _, w in _matrices(sub)) and \
                any(d in widths for _, w in _matrices(sub) if id(w) in ids for d in w.shape):
            return f"attention {_label(name, sub)}"

    def mlp(sub: nn.Module) -> bool:
        mats = _matrices(sub)
        if any(id(w) in read for _, w in mats) or any(reader.attention(s) is not None for s in sub.modules()):
            return False
        shapes = [(w.shape[0], w.shape[1]) for _, w in mats]
        return any(a[1] == b[0] == d and a[0] == b[1] for a in shapes for b in shapes for d in widths) or \
            any(a[0] == b[1] == d and a[1] == b[0] for a in shapes for b in shapes for d in widths)

    found = [(name, sub) for name, sub in modules if name and mlp(sub)]
    inner = [(n, s) for n, s in found if not any(o.startswith(n + ".") for o, _ in found)]
    return f"MLP {_label(*inner[0])}" if inner else None
