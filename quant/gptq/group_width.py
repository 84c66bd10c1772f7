"""Whether a GPTQ / RTN `group_size` makes groups in a model's quantized Linears.

A group holds `group_size` input columns of one output channel (quantizer.py), the last one the columns that remain.
Where `group_size` is at least a layer's in_features, that layer has a single group per output channel: the
per-channel grid of group_size null, bit for bit (static_groups then fixes that one range, as per-channel GPTQ does).
Where that holds for every Linear the layout quantizes, the option changes nothing while the result would record a
grouped run, so it is refused before any work (`RTNPipeline.check_model_options`, which evaluate.py reaches through
quant.plan.check_model_converts).
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from models.modules import fqn_matches

from ..spec import QuantSpec


def quantized_widths(model: nn.Module, spec: QuantSpec) -> dict[str, int]:
    """{FQN: input columns} of the Linears (in_features) and Conv2ds (C_in / groups * kh * kw: the flattened weight's
    columns, which GPTQ groups, quantizer.py) of `model` that `spec`'s linear rules quantize (convert.py matches the
    same names: a converted attention keeps its qkv / proj names)."""
    return {fqn: module.weight[0].numel() for fqn, module in model.named_modules()
            if isinstance(module, (nn.Linear, nn.Conv2d)) and any(fqn_matches(fqn, rule.patterns)
                                                                   for rule in spec.linears)}


def group_size_unread(model: nn.Module, spec: QuantSpec, name: str, options: Any) -> Optional[str]:
    """The refusal of `options.group_size` (quant.<name>.group_size) where it is no narrower than every Linear `spec`
    quantizes in `model` (one group a row: the per-channel default); None where it is unset, some layer is wider, or
    no layer is quantized (nothing to judge)."""
    group_size = options.group_size
    widths = quantized_widths(model, spec)
    if group_size is None or not widths:
        return None
    widest = max(widths, key=widths.get)
    if group_size < widths[widest]:
        return None
    # static_groups needs a group_size (GPTQPipeline.check): dropping one means dropping both
    also = f" and quant.{name}.static_groups" if getattr(options, "static_groups", False) else ""
    return (f"quant.{name}.group_size={group_size} would be ignored: the widest Linear {name} quantizes here "
            f"({widest}) has {widths[widest]} input columns, so each output channel is one group, the per-channel "
            f"grid of the default (group_size null); drop it{also}, or give quant.{name}.group_size below "
            f"{widths[widest]}")
