"""Quantiles of large tensors, bit for bit as `torch.quantile` computes them, except the sign of a zero result.

The reference implementations this package reproduces call `torch.quantile` for every calibration
quantile (RepQ-ViT's `UniformQuantizer` / `LogSqrt2Quantizer`, APHQ-ViT's candidate grids), so its
arithmetic is the one to follow: the level is rounded to the input's dtype, the rank `level * (n - 1)` is
taken in float64, the interpolation weight (the rank's fractional part) is rounded to the input's dtype,
and the two neighbouring order statistics are combined by `torch.lerp` (a fused multiply-add where the
device has one). numpy's linear method keeps the level in float64 and interpolates in two separately rounded
steps, which moves a 0.99999 quantile of 98,304 normal values by 4e-5 relative.

torch releases that refuse a reduced dimension above 2^24 elements ("quantile() input tensor is too large";
older ones, and CUDA builds by public reports) send the RepQ-ViT code to its `np.percentile` fallback for such
tensors (a ViT-B fc2 input of 32 calibration images has 19.4 M elements). torch 2.14.1 on CPU accepts any size
with the same arithmetic (tests/test_quant_quantile.py at 2^24 + 1 elements), so the official code never falls
back there, and `quantile` follows torch.quantile at every size: where the running torch refuses (not checked on
torch 2.11 or on CUDA), the official code's quantiles of tensors above 2^24 elements follow numpy's arithmetic
and ours do not, a difference in the last bits of those levels.

Calibration only ever needs quantiles in the tails (p = 0.999 ... 0.99999 and 1 - p), so we read the
two neighbouring order statistics of each requested quantile from one `topk` per tail instead of a full
sort. Order statistics do not depend on how they are found, so this is exact, works on any size and
device, needs no host round trip, and is much cheaper than a sort. The one exception is -0.0 and +0.0,
which compare equal: which of them stands at a rank depends on how a sort or topk orders tied values
(torch's CPU sort keeps the input's order, CUDA's small-size sorts need not), so a zero quantile may have
the other sign than torch.quantile's (its value, 0, is the same). A row holding NaN gives a NaN of that
row, lerped as torch.quantile lerps its last sorted value: torch's NaN where the row's NaNs share their bits
(one NaN, or the NaNs of one computation); which of NaNs of different bits (-NaN and NaN) torch's sort puts
last is not defined, and neither is our result then.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

# torch.quantile takes float32 and float64 inputs only; other floating inputs are computed as their float32
# copy would be (the gathered order statistics are exact in float32) and the result cast back.
QUANTILE_DTYPES = (torch.float32, torch.float64)


def level_in(q: float, dtype: torch.dtype) -> float:
    """The level `q` as torch.quantile uses it on a `dtype` input (q rounded to dtype), as a Python float."""
    return float(torch.tensor(q, dtype=dtype, device="cpu"))  # a host number: on the CPU, whatever the default device


def quantile(x: torch.Tensor, qs: Sequence[float], dim: Optional[int] = None) -> torch.Tensor:
    """`torch.stack([torch.quantile(x, q, dim=dim) for q in qs])`, bit for bit (but for the sign of a zero
    result: see the module docstring), from two `topk` tails.

    For each level q (see the module docstring): `rank = float64(dtype(q)) * (n - 1)`, `i = floor(rank)`,
    `j = ceil(rank)`, `w = dtype(rank - i)` and the value is `torch.lerp(x_(i), x_(j), w)` where x_(k) is
    the k-th smallest value (0-based) along `dim`. A row holding NaN gives NaN, as torch.quantile: the row's
    first NaN lerped with itself at weight 0.

    Args:
        x: floating tensor, any number of elements (a 0-d tensor is one, as torch.quantile takes it);
            float16 / bfloat16 are computed as `x.float()` would be and returned in x's dtype. An integer,
            bool or complex tensor is refused with a RuntimeError, as torch.quantile refuses it.
        qs: quantile levels in [0, 1] (Python floats; each is rounded to the computation dtype, as
            torch.quantile rounds its `q`).
        dim: reduce over this dimension; None reduces over all elements.

    Returns:
        Tensor of shape `[len(qs), *rest]` in x's dtype, where rest is x's shape without `dim` (empty if dim
        is None).
    """
    if not x.is_floating_point():  # torch.quantile's refusal (its error type): the levels would be truncated
        raise RuntimeError(f"quantile() input tensor must be a floating dtype, not {x.dtype}: give x.float() "
                           f"(or x.double())")
    if x.dim() == 0 and dim is not None:  # torch.quantile takes a 0-d tensor along dim 0 (or -1) as one element
        if dim not in (0, -1):
            raise IndexError(f"Dimension out of range (expected to be in range of [-1, 0], but got {dim})")
        dim = None
    if dim is None:
        x = x.reshape(-1)
        dim = 0
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    if n == 0:
        raise ValueError("quantile of an empty tensor")
    for q in qs:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile level {q} is outside [0, 1]")
    dtype = x.dtype if x.dtype in QUANTILE_DTYPES else torch.float32

    # Ranks (0-based, ascending) and weights of each level, in torch.quantile's arithmetic.
    plan = []
    for q in qs:
        rank = level_in(q, dtype) * (n - 1)  # float64, exact level of the dtype times an exact integer
        i = int(math.floor(rank))
        plan.append((i, int(math.ceil(rank)), rank - i))
    ranks = sorted({r for i, j, _ in plan for r in (i, j)})
    lower = [r for r in ranks if r < n // 2]
    upper = [r for r in ranks if r >= n // 2]

    # One topk per tail: smallest values ascending, largest values descending.
    values = {}
    if lower:
        k = max(lower) + 1
        low_vals = torch.topk(x, k, dim=-1, largest=False, sorted=True).values
        for r in lower:
            values[r] = low_vals[..., r]
    if upper:
        k = n - min(upper)
        up_vals = torch.topk(x, k, dim=-1, largest=True, sorted=True).values
        for r in upper:
            values[r] = up_vals[..., n - 1 - r]

    # torch.quantile lerps [*rest, len(qs)] tensors with a full weight tensor of that shape; the same call on
    # the same layout runs the same kernel path, so the fused rounding matches element for element.
    below = torch.stack([values[i] for i, _, _ in plan], dim=-1).to(dtype)
    above = torch.stack([values[j] for _, j, _ in plan], dim=-1).to(dtype)
    weights = torch.tensor([w for _, _, w in plan], dtype=dtype, device=x.device).expand_as(below).contiguous()
    # topk ranks NaN as the largest value instead of poisoning the row; torch.quantile takes every level of a row
    # holding NaN at its last sorted value (a NaN: its sort puts them last) at weight 0, and so keeps that NaN's
    # sign (a -NaN in, a -NaN out on the CPU), which a NaN of our own would not
    nans = x.isnan()
    has_nan = nans.any(dim=-1, keepdim=True)
    first = nans.to(torch.uint8).argmax(dim=-1, keepdim=True)  # argmax gives the first of equal maxima
    nan = x.gather(-1, first).to(dtype).expand_as(below)
    below, above = torch.where(has_nan, nan, below), torch.where(has_nan, nan, above)
    weights = torch.where(has_nan, torch.zeros_like(weights), weights)
    out = torch.lerp(below, above, weights)
    return out.movedim(-1, 0).to(x.dtype)
