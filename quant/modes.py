"""Switching the quantizers of a converted model: enumerate, enable/disable, calibration mode, summary.

Quantizers are found as modules (`named_quantizers`), so these helpers work for any layout a spec
produces. Weight quantizers are the ones named `*.weight_quantizer`; every other quantizer acts on
activations (Linear/Conv inputs and attention matmul operands).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

from torch import nn

from .attention import OPERANDS, QuantAttentionBase
from .layers import QuantConv2d, QuantLinear
from .quantizers import DynamicQuantizer, LogSqrt2Quantizer, Quantizer, UniformQuantizer


def named_quantizers(model: nn.Module, kind: str = "all") -> Iterator[Tuple[str, Quantizer]]:
    """(FQN, quantizer) pairs in module order.

    Args:
        kind: "all", "weight" (weight quantizers) or "activation" (all others).
    """
    if kind not in ("all", "weight", "activation"):
        raise ValueError(f"kind must be all|weight|activation, got {kind!r}")
    for name, module in model.named_modules():
        if not isinstance(module, Quantizer):
            continue
        is_weight = name.endswith("weight_quantizer")
        if kind == "all" or (kind == "weight") == is_weight:
            yield name, module


def set_quant_state(model: nn.Module, weights: Optional[bool] = None,
                    activations: Optional[bool] = None) -> None:
    """Enable (True) or bypass (False) weight and/or activation quantizers; None leaves them as they are."""
    for name, q in named_quantizers(model):
        on = weights if name.endswith("weight_quantizer") else activations
        if on is not None:
            q.enabled = on


@contextmanager
def quant_state(model: nn.Module, weights: Optional[bool] = None,
                activations: Optional[bool] = None) -> Iterator[nn.Module]:
    """`set_quant_state` for the duration of a with-block; restores every quantizer's flag on exit.

    Example: `with quant_state(qmodel, weights=False, activations=False): float_out = qmodel(x)`.
    """
    saved = [(q, q.enabled) for _, q in named_quantizers(model)]
    try:
        set_quant_state(model, weights=weights, activations=activations)
        yield model
    finally:
        for q, on in saved:
            q.enabled = on


def set_calibration(model: nn.Module, on: bool) -> None:
    """Calibration mode on/off for every quantizer (uncalibrated ones fit themselves on their next input)."""
    for _, q in named_quantizers(model):
        q.calibrating = on


def uncalibrated(model: nn.Module) -> List[str]:
    """FQNs of enabled quantizers that still lack parameters."""
    return [n for n, q in named_quantizers(model) if q.enabled and not q.calibrated]


def _describe_quantizer(q: Optional[Quantizer]) -> str:
    if q is None or not q.enabled:
        return "float"
    if isinstance(q, LogSqrt2Quantizer):
        return f"{q.bits}b log-sqrt2"
    if isinstance(q, DynamicQuantizer):
        return f"{q.bits}b sym per-{'tensor' if q.reduce_dims is None else 'token'} (dynamic max-abs)"
    if isinstance(q, UniformQuantizer):
        gran = {None: "tensor", 0: "channel", -1: "channel", 1: "head/channel"}.get(q.channel_dim, "channel")
        # a kind whose groups are not its channel dim's says so (SmoothQuant's per-projection scales of a fused qkv)
        gran = getattr(q, "granularity_label", "") or gran
        if getattr(q, "group_size", None):
            gran = f"group of {q.group_size}"
        # pipelines whose ranges come from elsewhere (output-MSE search, LSQ) label them via `search_label`
        how = getattr(q, "search_label", "") or q.search.method
        return f"{q.bits}b {'sym' if q.symmetric else 'asym'} per-{gran} ({how})"
    return f"{q.bits}b {type(q).__name__}"


def describe(model: nn.Module) -> List[Dict[str, str]]:
    """One row per quantized layer / attention: what is quantized how (for reports and logs)."""
    rows = []
    for name, module in model.named_modules():
        if isinstance(module, (QuantLinear, QuantConv2d)):
            rows.append({"module": name, "role": module.quant_role, "type": type(module).__name__,
                         "weight": _describe_quantizer(module.weight_quantizer),
                         "input": _describe_quantizer(module.input_quantizer)})
        elif isinstance(module, QuantAttentionBase):
            rows.append({"module": name, "role": "attention", "type": type(module).__name__,
                         **{op: _describe_quantizer(getattr(module, f"{op}_quant")) for op in OPERANDS}})
    return rows


def summarize(rows: List[Dict[str, str]]) -> Dict[str, Dict[str, str]]:
    """Collapse `describe` rows into {role: {operand: description}} (distinct values joined by " | ")."""
    out: Dict[str, Dict[str, List[str]]] = {}
    for row in rows:
        fields = out.setdefault(row["role"] or "other", {})
        for key, value in row.items():
            if key not in ("module", "role", "type") and value not in fields.setdefault(key, []):
                fields[key].append(value)
    return {role: {k: " | ".join(v) for k, v in fields.items()} for role, fields in out.items()}
