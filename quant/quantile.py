"""Quantiles of large tensors, bit for bit as `torch.quantile` computes them, except the sign of a zero result.

The reference implementations this package reproduces call `torch.quantile` for every calibration
quantile (RepQ-ViT's `UniformQuantizer` / `LogSqrt2Quantizer`, APHQ-ViT's candidate grids), so its
arithmetic is the one to follow: the level is rounded to the input's dtype, the rank `level * (n - 1)` is
taken, the interpolation weight (the rank's fractional part) is rounded to the input's dtype, and the two
neighbouring order statistics are combined by `torch.lerp` (a fused multiply-add where the device has one).
The rank's dtype depends on the torch release (`ranks_in_float64`): torch 2.11 takes a float32 input's rank
in float32 (`q * (n - 1)` rounded to float32), torch 2.14 in float64 (pytorch/pytorch#187574, which lifted
the 2^24 size cap; MPS, which has no float64, keeps float32 ranks there). The two differ in the tail levels
(up to 1.7e-4 at 0.99999 of 98,304 normal values), so which rule the running torch uses is found once by a
tiny CPU probe of torch.quantile and followed on every call; a float64 input's rank is float64 under both.
numpy's linear method keeps the level in float64 and interpolates in two separately rounded steps, which
moves a 0.99999 quantile of 98,304 normal values by 4e-5 relative.

torch releases that refuse a reduced dimension above 2^24 elements ("quantile() input tensor is too large":
torch 2.11 on CPU and CUDA, and older ones) send the RepQ-ViT code to its `np.percentile` fallback for such
tensors (a ViT-B fc2 input of 32 calibration images has 19.4 M elements), APHQ-ViT's to its average over
chunks. torch 2.14.1 on CPU accepts any size with its float64 ranks (tests/test_quant_quantile.py at
2^24 + 1 elements), so the official code never falls back there, and `quantile` follows torch.quantile at
every size. Where the running torch refuses (torch 2.11), `quantile` still computes that torch's arithmetic
without its size check: float32 ranks, which above 2^24 fall on float32's spacing (2 at 2^24 .. 2^25, so a
weight of 0 and a rank up to one element off the exact one; clamped to the last element); the official
code's quantiles of those tensors follow numpy's arithmetic (or the chunk average) and ours do not, a
difference in the last bits of those levels.

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

import functools
import math
from typing import Optional, Sequence

import torch

# torch.quantile takes float32 and float64 inputs only; other floating inputs are computed as their float32
# copy would be (the gathered order statistics are exact in float32) and the result cast back.
QUANTILE_DTYPES = (torch.float32, torch.float64)


def level_in(q: float, dtype: torch.dtype) -> float:
    """The level `q` as torch.quantile uses it on a `dtype` input (q rounded to dtype), as a Python float."""
    return float(torch.tensor(q, dtype=dtype, device="cpu"))  # a host number: on the CPU, whatever the default device


def rank_plan(levels: Sequence[float], n: int, dtype: torch.dtype, float64_ranks: bool) -> list:
    """`(i, j, w)` per level: the order statistics (0-based) torch.quantile lerps and the weight, as a `dtype` input
    of `n` elements along the reduced dimension gives them, with the rank `level * (n - 1)` in float64 or in
    float32 (`float64_ranks`; see the module docstring). i <= j <= n - 1; w is exact in `dtype`."""
    plan = []
    for q in levels:
        if float64_ranks:
            rank = level_in(q, dtype) * (n - 1)  # float64, exact level of the dtype times an exact integer
        else:
            # torch 2.11's `q * last_index`: a float32 tensor times an integer scalar, computed by torch itself (the
            # scalar is cast to float32 first, which is exact below 2^24, the only sizes that torch accepts)
            rank = float(torch.tensor(q, dtype=torch.float32, device="cpu") * (n - 1))
        i = min(int(math.floor(rank)), n - 1)  # above 2^24 a float32 rank can round past the last element
        j = min(int(math.ceil(rank)), n - 1)
        plan.append((i, j, rank - i if j > i else 0.0))  # exact: the rank minus its own floor
    return plan


@functools.lru_cache(maxsize=None)
def ranks_in_float64() -> bool:
    """Whether the running torch.quantile takes a float32 input's rank in float64 (torch 2.14) or in float32
    (torch 2.11), found once from a probe on the CPU where the two rules differ: 1001 values whose order
    statistics 999 and 1000 are 0 and 1, so the 0.999 quantile is the weight itself, 0 under float32 ranks
    (0.999f * 1000 rounds to 999) and 1.3e-5 under float64 ones. A torch that matches neither is refused: its
    quantiles would not be torch.quantile's."""
    x = torch.arange(1001, dtype=torch.float32, device="cpu") - 999  # ascending: order statistic k is x[k]
    got = torch.quantile(x, 0.999)
    rules = []
    for float64_ranks in (True, False):
        ((i, j, w),) = rank_plan([0.999], x.numel(), torch.float32, float64_ranks)
        if torch.equal(torch.lerp(x[i], x[j], torch.tensor(w, dtype=torch.float32, device=x.device)), got):
            rules.append(float64_ranks)
    if len(rules) != 1:
        raise RuntimeError(f"torch {torch.__version__}: torch.quantile's 0.999 quantile of the probe is "
                           f"{got.item()!r}, which neither a float32 nor a float64 rank gives; quant/quantile.py does "
                           f"not know this torch's arithmetic")
    return rules[0]


def quantile(x: torch.Tensor, qs: Sequence[float], dim: Optional[int] = None) -> torch.Tensor:
    """`torch.stack([torch.quantile(x, q, dim=dim) for q in qs])`, bit for bit (but for the sign of a zero
    result: see the module docstring), from two `topk` tails.

    For each level q (see the module docstring): `rank = dtype(q) * (n - 1)` in float64 (torch 2.14) or float32
    (torch 2.11 on a float32 input: `ranks_in_float64`), `i = floor(rank)`, `j = ceil(rank)`, `w = dtype(rank - i)`
    and the value is `torch.lerp(x_(i), x_(j), w)` where x_(k) is the k-th smallest value (0-based) along `dim`.
    A row holding NaN gives NaN, as torch.quantile: the row's first NaN lerped with itself at weight 0.

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

    # Ranks (0-based, ascending) and weights of each level, in the running torch.quantile's arithmetic: a float64
    # input's rank is float64 on every torch; a float32 one's as the probe found, but float32 on MPS (no float64)
    float64_ranks = dtype == torch.float64 or (x.device.type != "mps" and ranks_in_float64())
    plan = rank_plan(qs, n, dtype, float64_ranks)
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
