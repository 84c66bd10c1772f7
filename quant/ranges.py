"""Range estimation at calibration: which clipping ranges a quantizer considers, per row.

A quantizer flattens its calibration tensor into rows (`to_rows`: one row per channel / head, or a
single row per tensor) and asks its `RangeSearch` for candidate (lo, hi) ranges per row:

* ``percentile_mse`` (default, RepQ-ViT's `UniformQuantizer`): for each p in `percentiles`,
  hi = quantile(p), lo = quantile(1 - p) as torch.quantile computes them (`quantile.py`); the quantizer then keeps,
  per row, the candidate with the smallest mean squared fake-quantization error. The raw min/max is
  never a candidate.
* ``percentile``: one fixed p (e.g. 0.9999 -> [q(0.0001), q(0.9999)]), no MSE selection.
* ``minmax``: the raw row min and max (GPLQ's per-channel initialisation, LSQ warm starts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Literal, Optional, Tuple

import torch

from .quantile import quantile

Method = Literal["percentile_mse", "percentile", "minmax"]
REPQ_PERCENTILES = (0.999, 0.9999, 0.99999)


def to_rows(x: torch.Tensor, channel_dim: Optional[int]) -> torch.Tensor:
    """Reshape a tensor so that each quantization group is one row.

    Args:
        x: tensor of any shape.
        channel_dim: None for one group (per tensor); otherwise the dimension that indexes groups
            (0 for weights' output channels, -1 for activation channels, 1 for heads of [B,H,N,D]).

    Returns:
        `[G, M]` float32 tensor: G groups, all other dimensions pooled into M samples.
    """
    x = x.detach().float()
    if channel_dim is None:
        return x.reshape(1, -1)
    return x.movedim(channel_dim, 0).reshape(x.shape[channel_dim], -1)


@dataclass(frozen=True)
class RangeSearch:
    """Calibration range rule (see module docstring)."""

    method: Method = "percentile_mse"
    percentiles: Tuple[float, ...] = REPQ_PERCENTILES  # upper levels; lower levels are 1 - p

    def __post_init__(self) -> None:
        if self.method not in ("percentile_mse", "percentile", "minmax"):
            raise ValueError(f"unknown range search method {self.method!r}")
        if self.method == "percentile" and len(self.percentiles) != 1:
            raise ValueError(f"method 'percentile' takes exactly one level, got {self.percentiles}")
        if self.method == "percentile_mse" and not self.percentiles:  # no candidate range for a quantizer to fit
            raise ValueError(f"method 'percentile_mse' needs at least one percentile level, got {self.percentiles}")
        if self.method != "minmax" and not all(0.5 < p <= 1.0 for p in self.percentiles):
            raise ValueError(f"percentile levels must lie in (0.5, 1], got {self.percentiles}")

    @property
    def selects_by_mse(self) -> bool:
        return self.method == "percentile_mse" and len(self.percentiles) > 1

    def candidates(self, rows: torch.Tensor,
                   lower: bool = True) -> List[Tuple[Optional[torch.Tensor], torch.Tensor]]:
        """Candidate ranges for each row.

        Args:
            rows: `[G, M]` calibration values (see `to_rows`).
            lower: also compute the lower ends (False for one-sided quantizers such as log-sqrt2).

        Returns:
            List of (lo, hi) pairs of `[G]` tensors (lo is None when `lower` is False), in the order of
            `percentiles`; ties in the MSE selection go to the earlier candidate, as in RepQ-ViT.
        """
        if self.method == "minmax":
            return [(rows.amin(dim=1) if lower else None, rows.amax(dim=1))]
        levels = list(self.percentiles)
        if lower:
            levels += [1.0 - p for p in self.percentiles]
        q = quantile(rows, levels, dim=1)  # [L, G]
        k = len(self.percentiles)
        return [(q[k + i] if lower else None, q[i]) for i in range(k)]


@torch.no_grad()
def best_per_group(errors: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], first: torch.Tensor,
                   second: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Among K candidate parameter pairs, keep per group the one with the smallest error.

    The single selection rule of every range search here (RepQ-ViT's percentile MSE, APHQ's grids):
    candidates are visited in order and a later one wins only if strictly better, as RepQ-ViT's `<`.

    Args:
        errors: (first [G], second [G]) -> error [G] of that candidate for every group.
        first, second: [K, G] candidates, e.g. scales and zero points, or range bounds lo and hi.

    Returns:
        (best first [G], best second [G], best error [G]).
    """
    best_a, best_b = first[0].clone(), second[0].clone()
    best_e = errors(best_a, best_b)
    for k in range(1, first.shape[0]):
        e = errors(first[k], second[k])
        better = e < best_e
        best_e = torch.where(better, e, best_e)
        best_a = torch.where(better, first[k], best_a)
        best_b = torch.where(better, second[k], best_b)
    return best_a, best_b, best_e


def range_search(method: str, levels: Optional[Tuple[float, ...]]) -> RangeSearch:
    """The RangeSearch of a percentile-style option pair
    (None levels: RepQ set, or 0.9999 for 'percentile')."""
    if levels is None:
        levels = (0.9999,) if method == "percentile" else REPQ_PERCENTILES
    return RangeSearch(method, tuple(levels))
