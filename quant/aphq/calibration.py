"""APHQ-ViT's calibration of a converted model: fold, then output-MSE searches, unit by unit, on float inputs.

As in GoatWu/APHQ-ViT `test_quant.py` and `utils/calibrator.py`: every layer is calibrated on FLOAT inputs,
with all other modules in float ("raw") mode, and quantization is switched on only at the end. For each unit:

1. post-LayerNorm inputs (qkv, fc1, Swin reduction): per-channel quantizer on the activation MSE,
   folded into the LayerNorm affine and the next Linear (reparam.py, RepQ-ViT), which leaves a
   per-tensor quantizer with the mean scale and the ROUNDED mean zero point (APHQ; RepQ-ViT's own
   code keeps it unrounded) -- `round_zero_point` option;
2. every QuantLinear: weight-only MSE, input-only MSE, then 3 rounds of weight / input output-MSE
   search on the post-fold float inputs; the patch-embedding convolution (float image input) the
   official stem grid (search.py);
3. every attention: per-head ranges of q, k (q @ k^T) and attn, v (attn @ v) by the matmul output MSE.

A detector (`conv_search="self"`, `Object-Detection/tools` of the same repository) differs in the grids its
options give (percentiles [0.999, 1.0], no output-MSE rounds: `search_rounds=0`) and in its convolutions
(the stem's included): weight-only and input-only MSE on grids of 2^(b-1) zero points (`search_conv_self`),
over every call of a convolution that runs once per FPN level.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, List, Literal, Optional, Sequence, Tuple

import torch
from torch import nn

from engine.metrics import duration

from ..attention import QuantAttentionBase
from ..layers import QuantConv2d, QuantLinear
from ..modes import named_quantizers, set_quant_state
from ..reparam import REPQ_FOLD_SITES, find_fold_sites, fold_layernorm
from .search import fit_per_channel, search_conv_self, search_linear, search_matmul, search_stem
from ..units import Inputs, Unit, capture_module_calls, capture_module_inputs

log = logging.getLogger("quant.aphq")


@dataclass(frozen=True)
class SearchSettings:
    """Candidate grids and rounds of the calibration search (APHQOptions carries the defaults)."""

    rounds: int
    weight_pct: Tuple[float, float]
    act_pct: Tuple[float, float]
    eq_n: int
    matmul_pct: Tuple[float, float]
    matmul_steps: int
    max_rows: Optional[int]
    round_zero_point: bool
    batch_size: int
    conv_search: Literal["output", "self"] = "output"  # "self": the official detection convolution search


def _in_unit(fqn: str, unit: Unit) -> bool:
    return fqn == unit.name or fqn.startswith(unit.name + ".")


def unit_weights(model: nn.Module, units: List[Unit]) -> List[int]:
    """Each unit's Linear and convolution weights (element count, at least 1): the measure of its search's work.

    Every candidate of the search runs a layer's weights over all captured rows, so a unit's time grows with its
    weights: a ViT's patch embedding has a small fraction of a block's, and its search takes as small a one."""
    return [max(1, sum(m.weight.numel() for m in model.get_submodule(u.name).modules()
                       if isinstance(m, (nn.Linear, nn.Conv2d))))
            for u in units]


def time_left(spent: float, costs: Sequence[int], done: int) -> float:
    """Seconds the units after the first `done` should take, at the seconds per unit of cost those took (`spent`)."""
    return spent * sum(costs[done:]) / sum(costs[:done])


@torch.no_grad()
def calibrate_aphq(model: nn.Module, units: List[Unit], images: Inputs, settings: SearchSettings,
                   generator: Optional[torch.Generator] = None) -> Dict[str, object]:
    """Fold and search every quantizer of `model` (in place); leaves every quantizer DISABLED (float).

    Args:
        model: converted model (APHQ layout: per-channel post-LN inputs, per-tensor other inputs,
            per-head matmul operands, per-channel weights).
        units: reconstruction units covering every quantizer (units.find_units).
        images: [N, 3, H, W] calibration images (APHQ: the first 128 of the optimisation set), or a
            `units.SampleFeed` (a detector's calibration batch).
        settings: grids, rounds, batch size.
        generator: RNG for row subsampling (max_rows).

    Returns:
        {"folded": [...], "layers": n, "matmuls": n, "seconds": s}.

    Raises:
        RuntimeError: some enabled quantizer was not reached by the search.
    """
    start = time.perf_counter()
    to_fit = [(n, q) for n, q in named_quantizers(model) if q.enabled]
    set_quant_state(model, weights=False, activations=False)  # float ("raw") mode for every capture
    sites = find_fold_sites(model, REPQ_FOLD_SITES)
    folded: List[str] = []
    n_layers = n_matmuls = 0
    grid = dict(eq_n=settings.eq_n)
    costs = unit_weights(model, units)  # an estimate from the units' count would take the cheap stem for a block
    for done, unit in enumerate(units):
        unit_start = time.perf_counter()
        module = model.get_submodule(unit.name)
        # only per-channel post-LN quantizers are folded (the layout makes them per tensor when a != w bits)
        unit_sites = [s for s in sites
                      if _in_unit(s[2], unit) and getattr(s[3].input_quantizer, "channel_dim", None) == -1]
        if unit_sites:
            caps = capture_module_inputs(
                model, {lin: linear.input_quantizer for _, _, lin, linear in unit_sites},
                unit.name, images, settings.batch_size)
            for norm_name, norm, lin_name, linear in unit_sites:
                fit_per_channel(linear.input_quantizer, caps[lin_name], settings.act_pct, **grid)
                fold_layernorm(norm, linear, round_zero_point=settings.round_zero_point)
                folded.append(f"{norm_name} -> {lin_name}")
            del caps
        layers = [(n, m) for n, m in module.named_modules() if isinstance(m, (QuantLinear, QuantConv2d))]
        attns = [(n, m) for n, m in module.named_modules() if isinstance(m, QuantAttentionBase)]
        watch: Dict[str, nn.Module] = {f"layer:{n}": m for n, m in layers}
        for n, attn in attns:
            for op in ("q", "k", "attn", "v"):
                quantizer = getattr(attn, f"{op}_quant")
                if quantizer is not None:
                    watch[f"{n}:{op}"] = quantizer
        calls = capture_module_calls(model, watch, unit.name, images, settings.batch_size)
        caps = {k: v if k.startswith("layer:") else torch.cat(v) for k, v in calls.items()}
        del calls
        for n, layer in layers:
            if layer.weight_quantizer is None:
                continue
            if isinstance(layer, QuantConv2d) and settings.conv_search == "self":
                search_conv_self(layer, caps[f"layer:{n}"], weight_pct=settings.weight_pct,
                                 act_pct=settings.act_pct, eq_n=settings.eq_n)
                n_layers += 1
                continue
            caps[f"layer:{n}"] = torch.cat(caps[f"layer:{n}"])
            if isinstance(layer, QuantConv2d) and layer.input_quantizer is None:  # the official stem grid
                search_stem(layer, caps[f"layer:{n}"], settings.eq_n)
            else:
                search_linear(layer, caps[f"layer:{n}"], rounds=settings.rounds,
                              weight_pct=settings.weight_pct, act_pct=settings.act_pct,
                              max_rows=settings.max_rows, generator=generator, **grid)
            n_layers += 1
        for n, attn in attns:
            pairs = (("q", "k", lambda a, b: a @ b.transpose(-2, -1)), ("attn", "v", lambda a, b: a @ b))
            for op_a, op_b, fn in pairs:
                qa, qb = getattr(attn, f"{op_a}_quant"), getattr(attn, f"{op_b}_quant")
                if qa is None or qb is None:
                    raise ValueError(f"{unit.name}.{n}: APHQ quantizes both operands of both matmuls")
                search_matmul(qa, qb, caps[f"{n}:{op_a}"], caps[f"{n}:{op_b}"], fn, pct=settings.matmul_pct,
                              steps=settings.matmul_steps, rounds=settings.rounds)
                n_matmuls += 1
        del caps
        now = time.perf_counter()
        left = len(units) - done - 1
        log.info("APHQ calibration: unit %d/%d %s searched [%.1fs]%s", done + 1, len(units), unit.name,
                 now - unit_start,
                 f"; about {duration(time_left(now - start, costs, done + 1))} left for the other {left}"
                 if left else "")
    missing = [n for n, q in to_fit if not q.calibrated]
    for _, q in to_fit:
        q.search_label = "output-MSE search"
    if missing:
        raise RuntimeError(f"{len(missing)} quantizers were not reached by the APHQ search: {missing[:6]}")
    return {"folded": folded, "layers": n_layers, "matmuls": n_matmuls,
            "seconds": round(time.perf_counter() - start, 3)}

