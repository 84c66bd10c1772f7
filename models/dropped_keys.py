"""Which tensors of a weights file a model family's `checkpoint_filter_fn` left out of its conversion.

timm's filters rename keys (official DeiT III, Swin and DINOv2 layouts), transpose or resample some tensors, and
leave out others without a word: buffers the model rebuilds (Swin's relative_position_index and attn_mask, a GPT
file's causal-mask attn.bias), DINOv2's mask_token, which no forward pass of an encoder reads, but also layers the
model lacks, such as the pre-logits layer of old in21k ViT files (timm's ViT filter: `elif 'pre_logits' in k:
continue`). A model built without such a layer does not compute what the file's did, so models/pretrained.py
names every such key (`dropped_by_filter`).
"""
from __future__ import annotations

import re

import torch

# keys a filter leaves out that hold nothing a forward pass of the model needs: buffers it rebuilds from its
# settings (Swin's relative_position_index and attn_mask; the causal mask GPT-2 files store as attn.bias /
# attn.masked_bias) and DINOv2's mask_token (masked-image-modelling pre-training only)
HARMLESS = re.compile(r"(?:^|\.)(?:mask_token|relative_position_index|attn_mask)$|\.attn\.(?:bias|masked_bias)$")


def dropped_by_filter(before: dict, after: dict) -> list[str]:
    """The keys of `before` (a file's state dict) whose tensors are nowhere in `after` (the filter's conversion of
    it), in the file's order, less the HARMLESS ones. A key is carried when `after` holds it, or holds its tensor
    under another name (a rename: the same memory, e.g. DINOv2's register_tokens as reg_token, a view such as a
    transpose), or its values under another name (a copy: a Conv1D weight transposed into an nn.Linear's)."""
    new = [v for k, v in after.items() if k not in before or v is not before[k]]
    sorted_cache: dict = {}
    return [k for k, v in before.items()
            if k not in after and not HARMLESS.search(k) and not _carried(v, new, sorted_cache)]


def _carried(value: torch.Tensor, outputs: list, sorted_cache: dict) -> bool:
    """Whether one of `outputs` holds `value`'s elements: the same memory (a renamed tensor or a view of it) or
    the same multiset of values (a copy in another shape or order)."""
    same_size = [u for u in outputs if u.numel() == value.numel() and u.dtype == value.dtype]
    if any(u.data_ptr() == value.data_ptr() for u in same_size):
        return True
    return any(torch.equal(_sorted(u, sorted_cache), _sorted(value, sorted_cache)) for u in same_size)


def _sorted(tensor: torch.Tensor, cache: dict) -> torch.Tensor:
    """`tensor`'s values in ascending order (flattened; computed once per tensor)."""
    if id(tensor) not in cache:
        cache[id(tensor)] = (tensor, tensor.detach().flatten().float().sort().values)  # the tensor keeps its id
    return cache[id(tensor)][1]
