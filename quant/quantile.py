"""Exact quantiles of large tensors, bit-compatible with numpy's default ("linear") method.

`torch.quantile` refuses inputs above 2^24 elements on some torch versions (the RepQ-ViT code falls
back to a numpy round trip there; a ViT-B fc2 input for 32 images already has 19.4 M elements).
Calibration only ever needs quantiles in the tails (p = 0.999 ... 0.99999 and 1 - p), so we read the
two neighbouring order statistics of each requested quantile from one `topk` per tail. That is exact,
works on any size and device, needs no host round trip, and is much cheaper than a full sort.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def quantile(x: torch.Tensor, qs: Sequence[float], dim: Optional[int] = None) -> torch.Tensor:
    """Quantiles with numpy's linear interpolation (`np.quantile(x, q, axis=dim)` for scalar q).

    For each q the virtual index is `pos = q * (n - 1)`; with `i = floor(pos)`, `g = pos - i` the value
    is `a + (b - a) * g` (or `b - (b - a) * (1 - g)` when `g >= 0.5`, exactly like numpy's `_lerp`)
    where a, b are the i-th and (i+1)-th smallest values. The arithmetic runs in x's dtype with a
    Python-float weight, which is what numpy does for a scalar q on a float32 array.

    Args:
        x: any floating tensor, any number of elements.
        qs: quantile levels in [0, 1].
        dim: reduce over this dimension; None reduces over all elements.

    Returns:
        Tensor of shape `[len(qs), *rest]`, where rest is x's shape without `dim` (empty if dim is None).
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

    # Ranks (0-based, ascending) needed by each q: floor(pos) and its right neighbour.
    plan = []
    for q in qs:
        pos = q * (n - 1)  # float64, as numpy
        i = min(int(math.floor(pos)), n - 1)
        plan.append((i, min(i + 1, n - 1), pos - i))
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

    out = []
    for i, j, g in plan:
        a, b = values[i], values[j]
        diff = b - a
        out.append(b - diff * (1.0 - g) if g >= 0.5 else a + diff * g)
    return torch.stack(out, dim=0)
