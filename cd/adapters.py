"""Refuse a pair whose layer carries adapters (LoRA and the like), recognised by structure rather than by package.

An adapter layer computes its weight plus a term of its own (loralib's `lora.Linear`: W x + B A x, with `lora_A`,
`lora_B` Parameters beside `weight`; PEFT's `lora.Linear` and look-alikes of one's own: a `base_layer` child plus
`lora_A` / `lora_B` layers, the base weight perhaps exposed as a `weight` property). CD would decay W alone while
the layer applies another matrix, so such a pair is refused wherever the adapter class comes from. A plain layer
(nn.Linear and its subclasses, transformers' Conv1D, torchvision's NonDynamicallyQuantizableLinear) owns `weight` and
`bias` only, and no child holds a matrix.
"""
from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from .verify import ADAPTER_FIX, UnsupportedModelError


def adapter_parameters(layer: nn.Module) -> list[str]:
    """The parameters of `layer` that are no part of a plain layer: its own matrices other than `weight` (loralib's
    `lora_A`, `lora_B`), and those of a child holding a matrix (a `base_layer`, a `lora_A` layer). Vectors are no
    adapter: a pruned bias's `bias_orig` (torch.nn.utils.prune), a quantizer's scales in a child."""
    extra = [n for n, p in layer.named_parameters(recurse=False) if n not in ("weight", "bias") and p.dim() >= 2]
    for child_name, child in layer.named_children():
        params = list(child.named_parameters())
        if any(p.dim() >= 2 for _, p in params):
            extra += [f"{child_name}.{n}" for n, _ in params]
    return extra


def _layer_of(root: nn.Module, name: str) -> Optional[nn.Module]:
    """The module whose `weight` the parameter `name` is, or None (a parameter of another name, such as an
    nn.MultiheadAttention's `in_proj_weight`, whose module is no layer to look at)."""
    path, _, leaf = name.rpartition(".")
    if leaf != "weight":
        return None
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        return None


def refuse_adapters(root: nn.Module, pairs: Sequence, block_types: dict[str, str]) -> None:
    """Refuse the first pair (in model order) of which a matrix's layer carries adapters (`adapter_parameters`).

    Raises:
        UnsupportedModelError: naming the block and its type, the layer and its type, and the adapters'
            parameters.
    """
    for p in pairs:
        names = [p.name] + ([] if p.diagonal else [p.upstream_name])
        for name in names:
            layer = _layer_of(root, name)
            extra = adapter_parameters(layer) if layer is not None else []
            if extra:
                cls = type(layer)  # named with its module outside torch: PEFT's adapter layer is called Linear too
                kind = cls.__name__ if cls.__module__.startswith("torch.") else f"{cls.__module__}.{cls.__qualname__}"
                shown = ", ".join(extra[:4]) + (", ..." if len(extra) > 4 else "")
                raise UnsupportedModelError(
                    f"block '{p.block}' ({block_types.get(p.block, '?')}) is not supported by CD: the layer "
                    f"{name.rpartition('.')[0]} ({kind}) of its {p.role} pair holds adapters "
                    f"({shown}) beside its weight, so the matrix it applies is not the weight CD would decay; "
                    + ADAPTER_FIX)
