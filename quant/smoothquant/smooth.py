"""SmoothQuant's migration of activation outliers into the weights (mit-han-lab/smoothquant `smooth.py`).

For a LayerNorm feeding Linears W (norm1 -> qkv, norm2 -> fc1 in every block), with X_j the j-th input
channel over the calibration set:

    s_j = clamp(max|X_j|^alpha / clamp(max_i |W_ij|, 1e-5)^(1 - alpha), 1e-5)
    LayerNorm weight and bias / s,   W[:, j] * s_j          (the float function is unchanged)

`channel_absmax` is their `get_act_scales` (max |x| per input channel over every token of every sample, on
the float model before smoothing); `smoothing_scales` their `smooth_ln_fcs` formula, in the weight's dtype;
the migration itself is `reparam.migrate_scales`.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from ..reparam import BLOCK_FOLD_SITES, find_fold_sites, migrate_scales
from ..units import stream_module_inputs


@torch.no_grad()
def channel_absmax(model: nn.Module, linears: Dict[str, nn.Module], inputs: torch.Tensor,
                   batch_size: int) -> Dict[str, torch.Tensor]:
    """max |x| per input channel (last dim) of each Linear's input over all `inputs`, in float32."""
    amax: Dict[str, torch.Tensor] = {}

    def observe(name: str, x: torch.Tensor) -> None:
        batch = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        amax[name] = batch if name not in amax else torch.maximum(amax[name], batch)

    stream_module_inputs(model, linears, None, inputs, batch_size, observe)
    return amax


def smoothing_scales(act_absmax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float) -> torch.Tensor:
    """SmoothQuant's per-channel factors s [C] for one LayerNorm and the weights [out, C] it feeds."""
    w = weights[0]
    weight_absmax = torch.cat([v.abs().amax(dim=0, keepdim=True) for v in weights]).amax(dim=0).clamp(min=1e-5)
    act = act_absmax.to(device=w.device, dtype=w.dtype)
    return (act.pow(alpha) / weight_absmax.pow(1 - alpha)).clamp(min=1e-5)


@torch.no_grad()
def smooth_model(model: nn.Module, inputs: torch.Tensor, alpha: float, batch_size: int) -> List[Tuple[str, str]]:
    """Smooth every in-block LayerNorm -> Linear pair of a FLOAT model in place (statistics first, from
    the unsmoothed model, as officially). Returns the (norm, linear) FQNs smoothed."""
    sites = find_fold_sites(model, BLOCK_FOLD_SITES)
    amax = channel_absmax(model, {linear_name: linear for _, _, linear_name, linear in sites}, inputs, batch_size)
    # a NaN / inf max makes that site's scales NaN, and the LayerNorm and every later layer compute NaN: the whole
    # quantized model would be NaN, silently (one host sync for all sites)
    if amax and not bool(torch.stack([torch.isfinite(a).all() for a in amax.values()]).all()):
        bad = next(name for name, a in amax.items() if not bool(torch.isfinite(a).all()))
        raise ValueError(f"SmoothQuant: the calibration activations at the input of {bad} hold NaN or inf (NaN/inf "
                         "in the calibration inputs or the float model's weights), so its smoothing scales would be "
                         "NaN and the quantized model NaN; give finite calibration inputs")
    for _, norm, linear_name, linear in sites:
        migrate_scales(norm, [linear], smoothing_scales(amax[linear_name], [linear.weight], alpha))
    return [(norm_name, linear_name) for norm_name, _, linear_name, _ in sites]
