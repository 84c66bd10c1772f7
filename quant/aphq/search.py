"""APHQ-ViT's calibration search: scales and zero points chosen by the MSE of each layer's OUTPUT.

As GoatWu/APHQ-ViT `quantizers/*.py` and `quant_layers/*.py` search. Every search runs on float inputs
of the layer (the caller captures them with every quantizer bypassed), candidate by candidate,
vectorised over channels / heads:

* `range_grid`: GoatWu/APHQ-ViT `quant_layers/linear.py` (`calculate_percentile_*_candidates`):
  `num_zp = min(16, 2^b)` absolute zero points, the integers in [2^(b-1) - num_zp/2, 2^(b-1) + num_zp/2)
  (0..15 at 4 bits, 0..7 at 3 bits), each with `eq_n // num_zp` scales whose ranges run linearly from
  [q(1 - p_lo), q(p_lo)] to [q(1 - p_hi), q(p_hi)] of the row, scale = range / (2^b - 1) (officially
  p in [0.9, 1.0] for weights and for every input grid; eq_n = 128 gives 8 scales x 16 zero points);
  an input grid's scales are at least 1e-4 (`ACT_MIN_SCALE`, the official clamp), a weight grid's are not.
* `search_linear`: the official order (`AsymmetricallyBatchingQuantLinear.hyperparameter_searching`):
  weights per output channel by the weight-only MSE, the per-tensor input by the input-only MSE, then
  `rounds` (3) rounds of [weights by the output MSE per output channel, the input by the output MSE
  over the layer], each search with the other quantizer at its current value.
* `search_stem`: the patch-embedding convolution with a float image input, as the official
  `AsymmetricallyBatchingQuantConv2d` (`quant_layers/conv.py`): per output channel, the ranges
  [q(1 - p), q(p)] for eq_n levels p = 0.99 + (0.9999 - 0.99) * (i / (eq_n - 1))^0.5 plus p = 1.0,
  zero point -round(lo / scale), by the output MSE; then the lower bound with the upper one fixed, then
  the upper bound with the lower one fixed (one round: the official loop stops there at 8-bit inputs).
* `search_conv_self`: every convolution of a detector, as the official detection code
  (`Object-Detection/tools/quant_layers/conv.py`): the weight per output channel by the weight-only MSE and
  the per-tensor input by the input-only MSE, both on the grid of `range_grid` with 2^(b-1) zero points and
  percentiles [0.999, 1.0]; the input of a convolution that runs on several FPN levels is one list of calls.
* `fit_per_channel`: RepQ-style per-channel post-LayerNorm quantizer on the activation MSE alone (the
  fold then turns it into a per-tensor one, which `search_linear` searches again).
* `search_matmul`: per-head asymmetric operands of q @ k^T and attn @ v, the official matmul search
  (`quant_layers/matmul.py`, see the function).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..functional import fake_quant_uniform
from ..quantile import quantile
from ..quantizers import MIN_SCALE, UniformQuantizer
from ..ranges import best_per_group, to_rows

# The official input (activation) candidate scales are floored at 1e-4: GoatWu/APHQ-ViT quant_layers/linear.py
# `calculate_percentile_activation_candidates` (`.clamp(min=1e-4)`), and the same in the detection code's
# Object-Detection/tools/quant_layers/{linear,conv}.py. A near-constant or all-but-zero input channel thus gets a
# step of 1e-4, not a narrower one. Weight candidates and the matmul operands' are not clamped there (MIN_SCALE
# only guards a constant row against a zero step).
ACT_MIN_SCALE = 1e-4


def official_levels(uppers: Sequence[float]) -> Tuple[List[float], List[float]]:
    """The quantile levels of the official candidate grids for upper percentiles `uppers`, as Python floats.

    The official code builds `pct = torch.tensor([...])` (float32) and asks torch.quantile for `pct` and
    `1 - pct`, the lower levels computed on that float32 tensor. 1 - float32(p) is not float32(1 - p) (p = 0.9:
    0.100000024 against 0.100000001), and the rank (n - 1) * level moves with it; the floats returned here are
    those float32 values exactly, which `quantile` keeps as they are.

    Returns:
        (upper levels, lower levels), in the order of `uppers`.
    """
    pct = torch.tensor(list(uppers), dtype=torch.float32, device="cpu")  # host numbers, whatever the default device
    return pct.tolist(), (1 - pct).tolist()


def range_grid(rows: torch.Tensor, q: UniformQuantizer, pct: Tuple[float, float],
               eq_n: int, num_zp: Optional[int] = None,
               min_scale: float = MIN_SCALE) -> Tuple[torch.Tensor, torch.Tensor]:
    """Candidate (scale, zero point) per row, the official grid (see module docstring).

    Args:
        rows: [G, M] values, one row per quantization group.
        q: an asymmetric uniform quantizer (its bits fix the zero points).
        pct: (p_lo, p_hi) upper percentile levels of the narrowest and widest range, e.g. (0.9, 1.0).
        eq_n: candidates in all (official `eq_n`): min(16, 2^b) zero points x eq_n // that many scales.
        num_zp: zero points instead of min(16, 2^b) (the official detection convolutions take 2^(b-1)).
        min_scale: the smallest candidate scale: MIN_SCALE for weights, ACT_MIN_SCALE for inputs (as officially).

    Returns:
        (scales, zero_points), each [K, G], zero-point-major (all scales of the first zero point first).
    """
    if q.symmetric:
        raise ValueError(f"{q.name}: the APHQ grid is for asymmetric quantizers")
    levels = 2 ** q.bits
    num_zp = num_zp or min(16, levels)
    num_scales = eq_n // num_zp
    if num_scales < 1:
        raise ValueError(f"eq_n={eq_n} is below the {num_zp} zero points of a {q.bits}-bit grid")
    (up_lo, up_hi), (low_lo, low_hi) = official_levels(pct)
    qs = quantile(rows, [up_lo, low_lo, up_hi, low_hi], dim=1)  # [4, G]: q(p_lo), q(1 - p_lo), q(p_hi), q(1 - p_hi)
    t = torch.linspace(0.0, 1.0, num_scales, device=rows.device, dtype=rows.dtype)[:, None]
    width = (qs[0] - qs[1]) + t * ((qs[2] - qs[3]) - (qs[0] - qs[1]))  # [S, G], linear in the range
    scale = (width / (levels - 1)).clamp_min(min_scale)
    zero_points = torch.arange(levels // 2 - num_zp // 2, levels // 2 + num_zp // 2, device=rows.device,
                               dtype=rows.dtype)
    scales = scale.repeat(num_zp, 1)  # [num_zp * S, G]
    zps = zero_points.repeat_interleave(num_scales)[:, None].expand_as(scales)
    return scales, zps


def _official_params(q: UniformQuantizer, lo: torch.Tensor, hi: torch.Tensor
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The official conv / matmul candidates' scale (hi - lo) / (2^b - 1) and zero point -round(lo / scale).

    Unlike `UniformQuantizer.params_from_range`, narrow ranges are not widened to include 0 (the official
    code does not); the MIN_SCALE floor only guards a constant channel or head.
    """
    scale = ((hi - lo) / (q.qmax - q.qmin)).clamp_min(MIN_SCALE)
    return scale, -torch.round(lo / scale)


def _fq(x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, q: UniformQuantizer) -> torch.Tensor:
    return fake_quant_uniform(x, scale, zp, q.qmin, q.qmax)


@torch.no_grad()
def fit_per_channel(q: UniformQuantizer, x: torch.Tensor, pct: Tuple[float, float], eq_n: int) -> None:
    """Per-last-dim (channel) range by the activation-quantization MSE alone; sets q's parameters.

    Args:
        q: a per-channel (channel_dim -1) uniform quantizer.
        x: [..., C] float inputs of the quantizer.
    """
    rows = to_rows(x, -1)  # [C, M]
    scales, zps = range_grid(rows, q, pct, eq_n, min_scale=ACT_MIN_SCALE)
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
                  act_pct: Tuple[float, float], eq_n: int, max_rows: Optional[int] = None,
                  generator: Optional[torch.Generator] = None,
                  gram: Optional[bool] = None) -> dict:
    """Output-MSE search of a QuantLinear / QuantConv2d's weight and (per-tensor) input quantizers.

    Args:
        layer: the quantized layer (its quantizers are set in place; weights are not modified).
        x: float input of the layer ([..., C_in] for Linear, [B, C, H, W] for Conv2d).
        rounds: rounds of [weight, input] output-MSE searches after the weight-only and input-only ones.
        weight_pct, act_pct: percentile spans of the candidate grids (see `range_grid`).
        eq_n: candidates per grid.
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

    # weight-only MSE, then input-only MSE (GoatWu/APHQ-ViT quant_layers/linear.py, `*_self` searches)
    w_scales, w_zps = range_grid(W, wq, weight_pct, eq_n)  # [K, C_out]
    ws, wz, _ = best_per_group(lambda s, z: (_fq(W, s[:, None], z[:, None], wq) - W).pow_(2).mean(dim=1),
                                w_scales, w_zps)
    Xq = X
    if aq is not None:
        if aq.channel_dim is not None:
            raise ValueError(f"{aq.name}: the output-MSE input search is per tensor")
        a_scales, a_zps = range_grid(X.reshape(1, -1), aq, act_pct, eq_n, min_scale=ACT_MIN_SCALE)  # [K, 1]
        a_s, a_z, _ = best_per_group(lambda s, z: (_fq(X, s, z, aq) - X).pow_(2).mean().reshape(1),
                                     a_scales, a_zps)
        Xq = _fq(X, a_s, a_z, aq)
    for _ in range(rounds):  # then [weights, input] by the layer's output MSE
        ws, wz, _ = best_per_group(_weight_output_errors(X, Xq, W, target, wq, gram), w_scales, w_zps)
        if aq is None:
            break  # with a float input one weight pass is final
        Wq = _fq(W, ws[:, None], wz[:, None], wq)
        a_s, a_z, _ = best_per_group(
            lambda s, z: (_fq(X, s, z, aq) @ Wq.t() - target).pow_(2).mean().reshape(1), a_scales, a_zps)
        Xq = _fq(X, a_s, a_z, aq)
    if aq is not None:
        aq.set_params(a_s, a_z)
    wq.set_params(ws, wz)
    if hasattr(layer, "invalidate_weight_cache"):
        layer.invalidate_weight_cache()
    err = (Xq @ _fq(W, ws[:, None], wz[:, None], wq).t() - target).pow(2).mean()
    return {"output_mse": float(err)}


def stem_levels(eq_n: int) -> list[float]:
    """The official stem weight levels: eq_n levels from 0.99 to 0.9999 with power-0.5 spacing, and 1.0."""
    return [0.99 + (0.9999 - 0.99) * (i / (eq_n - 1)) ** 0.5 for i in range(eq_n)] + [1.0]


@torch.no_grad()
def search_stem(layer: nn.Module, x: torch.Tensor, eq_n: int) -> dict:
    """Official weight search of the patch-embedding convolution (float input; see module docstring).

    Returns:
        {"output_mse": float} after the search (one host sync).
    """
    if layer.input_quantizer is not None:
        raise ValueError("search_stem is for a float stem input (stem_a_bits=0, as officially)")
    wq: UniformQuantizer = layer.weight_quantizer
    X, W = _as_rows(layer, x)
    X, W = X.float(), W.detach().float()
    target = X @ W.t()
    ups, lows = official_levels(stem_levels(eq_n))
    qs = quantile(W, ups + lows, dim=1)  # [2L, C_out]
    uppers, lowers = qs[:len(ups)], qs[len(ups):]
    weight_errors = _weight_output_errors(X, X, W, target, wq, None)  # the cheaper of the two forms

    def errors(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        return weight_errors(*_official_params(wq, lo, hi))

    lo, hi, _ = best_per_group(errors, lowers, uppers)  # the mirrored pairs
    lo, hi, _ = best_per_group(errors, lowers, hi.expand_as(uppers))  # lower bound, upper fixed
    lo, hi, err = best_per_group(errors, lo.expand_as(lowers), uppers)  # upper bound, lower fixed
    wq.set_params(*_official_params(wq, lo, hi))
    if hasattr(layer, "invalidate_weight_cache"):
        layer.invalidate_weight_cache()
    return {"output_mse": float(err.mean())}


def matmul_candidates(x: torch.Tensor, pct: Tuple[float, float], steps: int
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Official per-head bound candidates (`calculate_percentile_candidates`): `steps` uppers linear in
    value from q(p0) to q(p1) and `steps` lowers from q(1 - p1) to q(1 - p0), paired by index, so the
    upper widens while the lower narrows ("anti-mirrored"). x: [B, H, ...]. Returns (lo, hi) [steps, H].
    """
    rows = to_rows(x, 1)  # [H, M]
    ups, lows = official_levels(pct)
    qs = quantile(rows, ups + lows, dim=1)  # [4, H]: q(p0), q(p1), q(1 - p0), q(1 - p1)
    t = torch.linspace(0.0, 1.0, steps, device=x.device, dtype=qs.dtype)[:, None]
    return qs[3] + t * (qs[2] - qs[3]), qs[0] + t * (qs[1] - qs[0])


@torch.no_grad()
def search_matmul(qa: UniformQuantizer, qb: UniformQuantizer, a: torch.Tensor, b: torch.Tensor,
                  op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, pct: Tuple[float, float],
                  steps: int, rounds: int) -> dict:
    """Per-head ranges of both operands of a matmul by the MSE of its output, in the official order
    (GoatWu/APHQ-ViT `AsymmetricallyBatchingQuantMatMul.hyperparameter_searching`):

    1. both operands start at the second-to-last candidate pair;
    2. A over the candidate pairs (B quantized at its start), then B (A at its best);
    3. `rounds` times: A's lower bound (upper fixed), A's upper bound (lower fixed), then B's the same.
    Scale = (hi - lo) / (2^b - 1), zero point = -round(lo / scale).

    Args:
        qa, qb: per-head (channel_dim 1) uniform quantizers of the operands.
        a, b: float operands [B, H, ...] (q and k, or attn and v).
        op: the matmul, e.g. lambda a, b: a @ b.transpose(-2, -1).
        pct: (p0, p1) of the candidate bounds, officially (0.99, 0.99999).
        steps: candidates per bound (officially eq_n + 1 = 129).
        rounds: refinement rounds.

    Returns:
        {"output_mse": float} after the search (one host sync).
    """
    a, b = a.float(), b.float()
    target = op(a, b)
    reduce_dims = tuple(d for d in range(target.ndim) if d != 1)
    operands = {"a": (a, qa), "b": (b, qb)}
    grids = {"a": matmul_candidates(a, pct, steps), "b": matmul_candidates(b, pct, steps)}
    current = {k: (lo[-2], hi[-2]) for k, (lo, hi) in grids.items()}

    def quant(which: str, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        x, q = operands[which]
        s, z = _official_params(q, lo, hi)
        view = (1, -1) + (1,) * (x.ndim - 2)
        return _fq(x, s.view(view), z.view(view), q)

    def sweep(which: str, cand_lo: torch.Tensor, cand_hi: torch.Tensor) -> None:
        other_name = "b" if which == "a" else "a"
        other = quant(other_name, *current[other_name])  # once per sweep, not per candidate

        def error(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
            xq = quant(which, lo, hi)
            out = op(xq, other) if which == "a" else op(other, xq)
            return (out - target).pow_(2).mean(dim=reduce_dims)

        lo, hi, _ = best_per_group(error, cand_lo, cand_hi)
        current[which] = (lo, hi)

    for which in ("a", "b"):
        sweep(which, *grids[which])
    for _ in range(rounds):
        for which in ("a", "b"):
            lo_grid, hi_grid = grids[which]
            sweep(which, lo_grid, current[which][1].expand_as(hi_grid))  # lower bound, upper fixed
            sweep(which, current[which][0].expand_as(lo_grid), hi_grid)  # upper bound, lower fixed
    for which, (_, q) in operands.items():
        q.set_params(*_official_params(q, *current[which]))
    err = (op(quant("a", *current["a"]), quant("b", *current["b"])) - target).pow(2).mean()
    return {"output_mse": float(err)}


@torch.no_grad()
def search_conv_self(layer: nn.Module, inputs: List[torch.Tensor], *, weight_pct: Tuple[float, float],
                     act_pct: Tuple[float, float], eq_n: int) -> dict:
    """The official detection search of a QuantConv2d (see module docstring): no output MSE.

    Args:
        layer: the quantized convolution (its quantizers are set in place).
        inputs: its float input of each call ([B, C, H, W], sizes may differ between calls).
        weight_pct, act_pct: percentile spans of the candidate grids.
        eq_n: candidates per grid.

    Returns:
        {"weight_mse": float, "input_mse": float or None} after the search (one host sync).
    """
    wq: UniformQuantizer = layer.weight_quantizer
    aq: Optional[UniformQuantizer] = layer.input_quantizer
    W = layer.weight.detach().float().reshape(layer.out_channels, -1)
    w_scales, w_zps = range_grid(W, wq, weight_pct, eq_n, num_zp=2 ** (wq.bits - 1))
    ws, wz, w_err = best_per_group(lambda s, z: (_fq(W, s[:, None], z[:, None], wq) - W).pow_(2).mean(dim=1),
                                   w_scales, w_zps)
    wq.set_params(ws, wz)
    if hasattr(layer, "invalidate_weight_cache"):
        layer.invalidate_weight_cache()
    a_err = None
    if aq is not None:
        if aq.channel_dim is not None:
            raise ValueError(f"{aq.name}: the detection convolution input search is per tensor")
        xs = [x.float() for x in inputs]
        # candidates from the percentiles of every value of every call; the error summed over the calls of
        # each call's mean (the official code sums its per-call similarity)
        pooled = torch.cat([x.reshape(-1) for x in xs]).reshape(1, -1)
        a_scales, a_zps = range_grid(pooled, aq, act_pct, eq_n, num_zp=2 ** (aq.bits - 1),
                                     min_scale=ACT_MIN_SCALE)
        a_s, a_z, a_err = best_per_group(
            lambda s, z: sum((_fq(x, s, z, aq) - x).pow_(2).mean() for x in xs).reshape(1), a_scales, a_zps)
        aq.set_params(a_s, a_z)
    return {"weight_mse": float(w_err.mean()), "input_mse": None if a_err is None else float(a_err)}
