"""Quantiles of large tensors, bit for bit as `torch.quantile` computes them.

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
device, needs no host round trip, and is much cheaper than a sort.
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
    """`torch.stack([torch.quantile(x, q, dim=dim) for q in qs])`, bit for bit, from two `topk` tails.

    For each level q (see the module docstring): `rank = float64(dtype(q)) * (n - 1)`, `i = floor(rank)`,
    `j = ceil(rank)`, `w = dtype(rank - i)` and the value is `torch.lerp(x_(i), x_(j), w)` where x_(k) is
    the k-th smallest value (0-based) along `dim`. A row holding NaN gives NaN, as torch.quantile.

    Args:
        x: floating tensor, any number of elements; float16 / bfloat16 are computed as `x.float()` would be
            and returned in x's dtype.
        qs: quantile levels in [0, 1] (Python floats; each is rounded to the computation dtype, as
            torch.quantile rounds its `q`).
        dim: reduce over this dimension; None reduces over all elements.

    Returns:
        Tensor of shape `[len(qs), *rest]` in x's dtype, where rest is x's shape without `dim` (empty if dim
        is None).
    """
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
    out = torch.lerp(below, above, weights)
    has_nan = x.isnan().any(dim=-1, keepdim=True)  # topk would rank NaN as the largest value, not poison the row
    out = out.masked_fill(has_nan, float("nan"))
    return out.movedim(-1, 0).to(x.dtype)
