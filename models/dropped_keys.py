"""Which tensors of a weights file a model family's `checkpoint_filter_fn` left out of its conversion.

timm's filters rename keys (official DeiT III, Swin and DINOv2 layouts), transpose or resample some tensors, and
leave out others without a word: buffers the model rebuilds (Swin's relative_position_index and attn_mask, SwinV2's
relative_coords_table, a GPT file's causal-mask attn.bias), DINOv2's mask_token, which no forward pass of an encoder
reads, but also layers the model lacks, such as the pre-logits layer of old in21k ViT files (timm's ViT filter:
`elif 'pre_logits' in k: continue`). A model built without such a layer does not compute what the file's did, so
models/pretrained.py names every such key (`dropped_by_filter`).
"""
from __future__ import annotations

import math
import re

import torch
import torch.nn as nn

# keys a filter leaves out that hold nothing a forward pass of the model needs: buffers it rebuilds from its
# settings (Swin's relative_position_index and attn_mask; the causal mask GPT-2 files store as attn.bias /
# attn.masked_bias) and DINOv2's mask_token (masked-image-modelling pre-training only); any other buffer a model
# rebuilds is named by the model itself (`rebuilt_buffers`)
HARMLESS = re.compile(r"(?:^|\.)(?:mask_token|relative_position_index|attn_mask)$|\.attn\.(?:bias|masked_bias)$")


def rebuilt_buffers(model: nn.Module) -> frozenset[str]:
    """The names of `model`'s non-persistent buffers: buffers it computes from its settings and never saves (not in
    its state_dict), such as SwinV2's relative_coords_table, which official files store and timm's filter skips."""
    return frozenset(name for name, _ in model.named_buffers()) - frozenset(model.state_dict())


def dropped_by_filter(before: dict, after: dict, rebuilt: frozenset[str] = frozenset()) -> list[str]:
    """The keys of `before` (a file's state dict) whose tensors are nowhere in `after` (the filter's conversion of
    it), in the file's order, less the HARMLESS ones and those in `rebuilt` (the model's non-persistent buffers,
    `rebuilt_buffers`). A key is carried when `after` holds it, or holds its tensor under another name (a rename:
    the same memory, e.g. DINOv2's register_tokens as reg_token, or a view such as a transpose), or its values
    under another name (a copy: a Conv1D weight transposed into an nn.Linear's, or another shape or order). Each
    copy in `after` carries one tensor of `before` (tensors `before` ties, one memory under several keys, count
    as one), so two dropped tensors of equal values are not both carried by one copy."""
    candidates = [k for k in before if k not in after and not HARMLESS.search(k) and k not in rebuilt]
    file_memory = {_memory(v) for v in before.values()}
    copies = [u for u in after.values() if _memory(u) not in file_memory]  # no tensor of the file, nor a view of one
    # a tensor in `after` under any name (also one of tied keys the filter kept the other of) is carried as it is
    carried = _carried({k: before[k] for k in candidates}, {_memory(u) for u in after.values()}, copies)
    return [k for k in candidates if k not in carried]


def _memory(tensor: torch.Tensor) -> tuple:
    """What makes two tensors one in memory here: a rename, a tie, or a view of all of it (a transpose)."""
    return tensor.data_ptr(), tensor.dtype, tensor.numel()


def _carried(values: dict, renamed: set, copies: list) -> set:
    """The keys of `values` carried into the conversion: their memory is among `renamed` (the outputs' `_memory`),
    or one of `copies` holds their values in some shape and order, one copy per tensor. A copy is looked for among
    those of the tensor's size and dtype: first those of its shape or its transpose's, compared on one line of
    elements before in full; then any other by fingerprint (float64 sum and absolute sum) before its sorted values.
    So a file of transposed copies (transformers' GPT-2: 4 per layer) costs one or two full comparisons per copy,
    not one per pair of same-size tensors, and no sort."""
    pools: dict = {}  # (numel, dtype) -> the copies not yet matched, each with its fingerprint once computed
    for u in copies:
        pools.setdefault((u.numel(), u.dtype), []).append([u, None])
    carried, by_copy = set(), set()  # by_copy: the _memory of tensors a copy carries (their tied keys go with them)
    for key, value in values.items():
        memory = _memory(value)
        if memory in renamed or memory in by_copy:
            carried.add(key)
            continue
        pool = pools.get((value.numel(), value.dtype), [])
        found = next((i for i, (u, _) in enumerate(pool) if _same_layout(value, u)), None)
        if found is None and pool:
            mine = _fingerprint(value)
            for i, entry in enumerate(pool):
                if entry[1] is None:
                    entry[1] = _fingerprint(entry[0])
                if _close(mine, entry[1], value.numel()) and _same_sorted(value, entry[0]):
                    found = i
                    break
        if found is not None:
            del pool[found]  # one copy carries one tensor: two dropped tensors of equal values need two
            by_copy.add(memory)
            carried.add(key)
    return carried


def _same_layout(value: torch.Tensor, copy: torch.Tensor) -> bool:
    """Whether `copy` is `value` as it is or transposed (a 2-D matrix), checked on one line of elements first."""
    if copy.shape == value.shape:
        line = (0,) * (value.dim() - 1)  # the first line along the last dimension (a view)
        if value.dim() == 0 or torch.equal(copy[line], value[line]):
            if torch.equal(copy, value):
                return True
    return (value.dim() == 2 and copy.shape == value.shape[::-1] and torch.equal(copy[:, 0], value[0])
            and torch.equal(copy.t(), value))


def _fingerprint(tensor: torch.Tensor) -> tuple[float, float]:
    """(sum, sum of absolute values) of `tensor`'s elements in float64: equal, up to rounding, for any order."""
    t = tensor.detach()
    t = t if t.is_floating_point() else t.to(torch.float64)  # bool and integer buffers: small
    return t.sum(dtype=torch.float64).item(), t.abs().sum(dtype=torch.float64).item()


def _close(a: tuple, b: tuple, numel: int) -> bool:
    """Whether fingerprints `a` and `b` of `numel` elements may be of the same values: within the bound on the
    rounding error of two float64 sums of those elements in different orders (numel * 2**-53 * sum |x| each;
    twice that, for the rounding of the absolute sums themselves), so that no copy is missed; a tensor they do not
    tell apart is compared in full (`_same_sorted`). A fingerprint that is not finite (a tensor holding inf or NaN,
    e.g. a -inf attention mask, or sums past float64's range) tells nothing apart: inf - inf is NaN."""
    if not all(math.isfinite(x) for x in (*a, *b)):
        return True
    tolerance = numel * 2.0 ** -51 * max(a[1], b[1])
    return abs(a[0] - b[0]) <= tolerance and abs(a[1] - b[1]) <= tolerance


def _same_sorted(value: torch.Tensor, copy: torch.Tensor) -> bool:
    """Whether `copy` holds `value`'s elements in any shape and order: their sorted values are equal (computed
    for this pair alone, not kept)."""
    return torch.equal(torch.sort(copy.detach().flatten()).values, torch.sort(value.detach().flatten()).values)
