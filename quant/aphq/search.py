"""APHQ-ViT's calibration search: scales and zero points chosen by the MSE of each layer's OUTPUT.

As GoatWu/APHQ-ViT `quantizers/*.py` and `quant_layers/*.py` search. Every search runs on float inputs
of the layer (the caller captures them with every quantizer bypassed), candidate by candidate,
vectorised over channels / heads:

* `range_grid`: candidates between two percentile ranges of each row: `num_scales` ranges linearly
  between [q(1 - p_lo), q(p_lo)] and [q(1 - p_hi), q(p_hi)] (weights: p in [0.9, 1.0]), each with
  `num_zero_points` integer zero points around its own round(-lo / s) (16 x 8 = 128 candidates at the
  official eq_n = 128). At 4 bits the 16 shifts cover every zero point 0..15 like the official grid;
  centring on the range's own zero point keeps the grid meaningful at other bit widths (our choice).
* `search_linear`: weights per output channel, first by the weight-only MSE, then `rounds` (3)
  alternations of the per-tensor input quantizer (output MSE over the layer) and the weights (output
  MSE per output channel, so each channel keeps its own best candidate).
* `fit_per_channel`: RepQ-style per-channel post-LayerNorm quantizer on the activation MSE alone (the
  fold then turns it into a per-tensor one, which `search_linear` searches again).
* `search_matmul`: per-head asymmetric operands of q @ k^T and attn @ v. Candidate ranges are the
  mirrored percentile pairs [q(1 - p), q(p)] for `steps` (129) levels p from 0.99 to 0.99999
  (log-spaced in 1 - p: our choice, it spends the steps evenly over the tail); A then B are searched
  jointly over the pairs, then `rounds` (3) rounds refine the upper then the lower bound of A and B.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..functional import fake_quant_uniform
from ..quantile import quantile
from ..quantizers import UniformQuantizer
from ..ranges import best_per_group, to_rows



def range_grid(rows: torch.Tensor, q: UniformQuantizer, pct: Tuple[float, float], num_scales: int,
               num_zero_points: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Candidate (scale, zero point) per row (see module docstring).

    Args:
        rows: [G, M] values, one row per quantization group.
        q: the quantizer (bits, symmetric or not).
        pct: (p_lo, p_hi) upper percentile levels of the narrowest and widest range, e.g. (0.9, 1.0).
        num_scales: ranges between the two.
        num_zero_points: integer zero-point shifts per range (ignored for symmetric quantizers).

    Returns:
        (scales, zero_points), each [K, G] with K = num_scales * num_zero_points.
    """
    p_lo, p_hi = pct
    qs = quantile(rows, [p_lo, 1.0 - p_lo, p_hi, 1.0 - p_hi], dim=1)  # [4, G]
    t = torch.linspace(0.0, 1.0, num_scales, device=rows.device, dtype=rows.dtype)[:, None]
    hi = qs[0] + t * (qs[2] - qs[0])  # [S, G]
    lo = qs[1] + t * (qs[3] - qs[1])
    scale, zp = q.params_from_range(lo, hi)
    if q.symmetric or num_zero_points <= 1:
        return scale, zp
    shifts = torch.arange(num_zero_points, device=rows.device, dtype=rows.dtype) - num_zero_points // 2
    scales = scale.repeat_interleave(num_zero_points, dim=0)
    zps = (zp[:, None, :] + shifts[None, :, None]).reshape(-1, zp.shape[-1])
    return scales, zps


def _fq(x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, q: UniformQuantizer) -> torch.Tensor:
    return fake_quant_uniform(x, scale, zp, q.qmin, q.qmax)


@torch.no_grad()
def fit_per_channel(q: UniformQuantizer, x: torch.Tensor, pct: Tuple[float, float], num_scales: int,
                    num_zero_points: int) -> None:
    """Per-last-dim (channel) range by the activation-quantization MSE alone; sets q's parameters.

    Args:
        q: a per-channel (channel_dim -1) uniform quantizer.
        x: [..., C] float inputs of the quantizer.
    """
    rows = to_rows(x, -1)  # [C, M]
    scales, zps = range_grid(rows, q, pct, num_scales, num_zero_points)
    s, z, _ = best_per_group(
        lambda s, z: (_fq(rows, s[:, None], z[:, None], q) - rows).pow_(2).mean(dim=1), scales, zps)
    q.set_params(s, z)


def _as_rows(layer: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs [M, K], weight [C_out, K]) so that the layer output (without bias) is inputs @ weight^T."""
    if isinstance(layer, nn.Conv2d):
        if layer.groups != 1:
            raise ValueError("the output-MSE search supports ungrouped convolutions only")
        cols = F.unfold(x, layer.kernel_size, dilation=layer.dilation, padding=layer.padding,
                        stride=layer.stride)
        return cols.transpose(1, 2).reshape(-1, cols.shape[1]), layer.weight.reshape(layer.out_channels, -1)
    return x.reshape(-1, x.shape[-1]), layer.weight


def _weight_output_errors(X: torch.Tensor, Xq: torch.Tensor, W: torch.Tensor,
                          target: torch.Tensor, wq: UniformQuantizer,
                          gram: Optional[bool]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """errors(scale [C_out], zp [C_out]) -> per-output-channel MSE of Xq @ fq(W)^T against X @ W^T.

    With M rows much larger than C_in the error is computed exactly from C_in x C_in Gram matrices:
    Xq fq(W)^T - X W^T = Xq D^T + E W^T with D = fq(W) - W, E = Xq - X, so per channel
    ||Xq d + E w||^2 = d^T (Xq^T Xq) d + 2 d^T (Xq^T E) w + w^T (E^T E) w: 2 C_out C_in^2 operations per
    candidate instead of M C_in C_out (no cancellation: every term is of the size of the error).
    """
    m, c_in = X.shape
    if gram if gram is not None else m > 2 * c_in:
        xd, xqd = X.double(), Xq.double()
        e = xqd - xd
        g = (xqd.t() @ xqd).float()
        p = (xqd.t() @ e).float()
        const = ((W.double() @ (e.t() @ e)) * W.double()).sum(1).float()

        def errors(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            d = _fq(W, s[:, None], z[:, None], wq) - W
            return (((d @ g) * d).sum(1) + 2.0 * ((d @ p) * W).sum(1) + const) / m
        return errors
    return lambda s, z: (Xq @ _fq(W, s[:, None], z[:, None], wq).t() - target).pow_(2).mean(0)


@torch.no_grad()
def search_linear(layer: nn.Module, x: torch.Tensor, *, rounds: int, weight_pct: Tuple[float, float],
                  act_pct: Tuple[float, float], num_scales: int, num_zero_points: int,
                  max_rows: Optional[int] = None, generator: Optional[torch.Generator] = None,
                  gram: Optional[bool] = None) -> dict:
    """Output-MSE search of a QuantLinear / QuantConv2d's weight and (per-tensor) input quantizers.

    Args:
        layer: the quantized layer (its quantizers are set in place; weights are not modified).
        x: float input of the layer ([..., C_in] for Linear, [B, C, H, W] for Conv2d).
        rounds: alternations of input and weight searches after the weight-only initialisation.
        weight_pct, act_pct: percentile spans of the candidate grids (see `range_grid`).
        num_scales, num_zero_points: grid size.
        max_rows: use at most this many input rows (random, seeded) for the output MSE; None: all.
        generator: RNG for the row subset.
        gram: weight errors from Gram matrices (True), by direct products (False), or whichever is
            cheaper (None; same result up to float rounding).

    Returns:
        {"output_mse": float MSE of the layer output (no bias) after the search} (one host sync).
    """
    wq: UniformQuantizer = layer.weight_quantizer
    aq: Optional[UniformQuantizer] = layer.input_quantizer  # searched even while bypassed (float mode)
    X, W = _as_rows(layer, x)
    if max_rows is not None and X.shape[0] > max_rows:
        X = X[torch.randperm(X.shape[0], generator=generator, device="cpu")[:max_rows].to(X.device)]
    X, W = X.float(), W.detach().float()
    target = X @ W.t()

    # weights: weight-only MSE first (GoatWu/APHQ-ViT `quant_layers/linear.py`)
    w_scales, w_zps = range_grid(W, wq, weight_pct, num_scales, num_zero_points)  # [K, C_out]
    ws, wz, _ = best_per_group(lambda s, z: (_fq(W, s[:, None], z[:, None], wq) - W).pow_(2).mean(dim=1),
                                w_scales, w_zps)
    if aq is not None:
        if aq.channel_dim is not None:
            raise ValueError(f"{aq.name}: the output-MSE input search is per tensor")
        a_scales, a_zps = range_grid(X.reshape(1, -1), aq, act_pct, num_scales, num_zero_points)  # [K, 1]
    Xq = X
    # with a float input one output-MSE pass is final (repeating it cannot change the choice)
    for _ in range(rounds if aq is not None else min(rounds, 1)):
        Wq = _fq(W, ws[:, None], wz[:, None], wq)
        if aq is not None:
            a_s, a_z, _ = best_per_group(
                lambda s, z: (_fq(X, s, z, aq) @ Wq.t() - target).pow_(2).mean().reshape(1), a_scales, a_zps)
            aq.set_params(a_s, a_z)
            Xq = _fq(X, a_s, a_z, aq)
        ws, wz, _ = best_per_group(_weight_output_errors(X, Xq, W, target, wq, gram), w_scales, w_zps)
    wq.set_params(ws, wz)
    if hasattr(layer, "invalidate_weight_cache"):
        layer.invalidate_weight_cache()
    err = (Xq @ _fq(W, ws[:, None], wz[:, None], wq).t() - target).pow(2).mean()
    return {"output_mse": float(err)}


def matmul_levels(pct: Tuple[float, float], steps: int) -> torch.Tensor:
    """`steps` upper percentile levels from pct[0] to pct[1], log-spaced in 1 - p (float64, CPU)."""
    lo, hi = math.log10(1.0 - pct[0]), math.log10(1.0 - pct[1])
    return 1.0 - torch.logspace(lo, hi, steps, dtype=torch.float64, device="cpu")


@torch.no_grad()
def search_matmul(qa: UniformQuantizer, qb: UniformQuantizer, a: torch.Tensor, b: torch.Tensor,
                  op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, pct: Tuple[float, float],
                  steps: int, rounds: int) -> dict:
    """Per-head ranges of both operands of a matmul by the MSE of its output (see module docstring).

    Args:
        qa, qb: per-head (channel_dim 1) uniform quantizers of the operands.
        a, b: float operands [B, H, ...] (q and k, or attn and v).
        op: the matmul, e.g. lambda a, b: a @ b.transpose(-2, -1).
        pct: (first, last) upper percentile level, e.g. (0.99, 0.99999).
        steps: number of levels.
        rounds: refinement rounds of the upper and lower bounds.

    Returns:
        {"output_mse": float} after the search (one host sync).
    """
    a, b = a.float(), b.float()
    target = op(a, b)
    reduce_dims = tuple(d for d in range(target.ndim) if d != 1)
    levels = matmul_levels(pct, steps).tolist()

    def bounds(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        rows = to_rows(x, 1)  # [H, M]
        qs = quantile(rows, levels + [1.0 - p for p in levels], dim=1)  # [2S, H]
        return qs[len(levels):], qs[:len(levels)]  # lo [S, H], hi [S, H]

    def head_view(p: torch.Tensor, ndim: int) -> torch.Tensor:
        return p.view(1, -1, *([1] * (ndim - 2)))

    def quant(x: torch.Tensor, q: UniformQuantizer, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        s, z = q.params_from_range(lo, hi)
        return _fq(x, head_view(s, x.ndim), head_view(z, x.ndim), q)

    los = {"a": None, "b": None}
    his = {"a": None, "b": None}
    grids = {"a": bounds(a), "b": bounds(b)}
    quants = {"a": qa, "b": qb}

    def fixed(which: str) -> torch.Tensor:
        """The operand that is NOT searched, quantized with its current range
        (float before its first search)."""
        x, q = (a, qa) if which == "a" else (b, qb)
        return x if los[which] is None else quant(x, q, los[which], his[which])

    def sweep(which: str, cand_lo: torch.Tensor, cand_hi: torch.Tensor) -> None:
        x, q = (a, qa) if which == "a" else (b, qb)
        other = fixed("b" if which == "a" else "a")  # once per sweep, not per candidate

        def error(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
            xq = quant(x, q, lo, hi)
            out = op(xq, other) if which == "a" else op(other, xq)
            return (out - target).pow_(2).mean(dim=reduce_dims)

        los[which], his[which], _ = best_per_group(error, cand_lo, cand_hi)

    for which in ("a", "b"):  # joint mirrored pairs: A with B float, then B with A quantized
        sweep(which, *grids[which])
    for _ in range(rounds):
        for which in ("a", "b"):
            lo_grid, hi_grid = grids[which]
            sweep(which, los[which].expand_as(hi_grid), hi_grid)  # upper bound, lower fixed
            sweep(which, lo_grid, his[which].expand_as(lo_grid))  # lower bound, upper fixed
    for which in ("a", "b"):
        s, z = quants[which].params_from_range(los[which], his[which])
        quants[which].set_params(s, z)
    err = (op(quant(a, qa, los["a"], his["a"]), quant(b, qb, los["b"], his["b"])) - target).pow(2).mean()
    return {"output_mse": float(err)}
