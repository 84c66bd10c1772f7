"""AdaRound weight quantizer (Nagel et al., ICML 2020) as APHQ-ViT's block reconstruction uses it.

A uniform per-channel weight quantizer that, once `start_rounding(weight)` is called, replaces
round-to-nearest by a learned choice between floor and ceil for every weight element:

    soft:  w~ = (clamp(floor(w / s) + h(alpha) + z, qmin, qmax) - z) * s,
           h(alpha) = clamp(sigmoid(alpha) * (zeta - gamma) + gamma, 0, 1),  gamma = -0.1, zeta = 1.1
    hard:  h = 1[alpha >= 0]                     (h(alpha) >= 0.5  <=>  alpha >= 0)

alpha starts so that h(alpha) equals the fractional part of w / s (GoatWu/APHQ-ViT `utils/block_recon.py`),
i.e. the soft weight is the float weight inside the clipping range. Scale and zero point stay fixed (in the
official code only alpha and activation scales are learned). `bake()` writes the hard-rounded weight into the
layer and drops alpha, after which the quantizer is an ordinary round-to-nearest quantizer whose output on the
baked weight is the baked weight itself (every element already lies on the grid).

The rounding regulariser 0.01 * sum(1 - |2h - 1|^beta) with beta decaying linearly from 20 to 2 after a
20% warm-up without it (`RoundingSchedule`) is the one in GoatWu/APHQ-ViT `configs/4bit/best.py`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..quantizers import UniformQuantizer, _broadcast

GAMMA, ZETA = -0.1, 1.1  # the stretch of the rectified sigmoid (AdaRound paper, Sec. 4)


class AdaRoundQuantizer(UniformQuantizer):
    """Per-output-channel uniform weight quantizer with optional learned rounding (see module docstring).

    Until `start_rounding` it behaves exactly like `UniformQuantizer` (round to nearest), so the
    calibration search can set its scale and zero point like any other weight quantizer.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.alpha: Optional[nn.Parameter] = None

    @classmethod
    def from_spec(cls, spec, channel_dim: Optional[int], num_channels: Optional[int] = None,
                  device: Optional[torch.device] = None) -> "AdaRoundQuantizer":
        if channel_dim != 0:
            raise ValueError("AdaRound is a per-output-channel WEIGHT quantizer (granularity='channel')")
        return super().from_spec(spec, channel_dim, num_channels, device)

    def _grid(self, w: torch.Tensor) -> tuple:
        scale = _broadcast(self.scale, w.ndim, self.channel_dim)
        zp = _broadcast(self.zero_point, w.ndim, self.channel_dim)
        return scale, zp

    @torch.no_grad()
    def start_rounding(self, weight: torch.Tensor) -> nn.Parameter:
        """Create alpha for `weight` (the layer's weight, same shape), initialised at frac(w / s).

        Returns:
            The new alpha parameter (requires grad), same shape as `weight`.
        """
        if not self.calibrated:
            raise RuntimeError(f"{self.name}: set the weight scale before starting AdaRound")
        scale, _ = self._grid(weight)
        rest = weight / scale - torch.floor(weight / scale)  # in [0, 1)
        # invert h: sigmoid(alpha) = (rest - gamma) / (zeta - gamma), strictly inside (0, 1)
        alpha = -torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1.0)
        self.alpha = nn.Parameter(alpha.float())
        return self.alpha

    def rounding(self, hard: bool = False) -> torch.Tensor:
        """h(alpha) in [0, 1] (soft, while learning) or the hard choice 1[alpha >= 0],
        shaped like the weight."""
        if self.alpha is None:
            raise RuntimeError(f"{self.name}: AdaRound was not started")
        if hard:
            return (self.alpha >= 0).to(self.alpha.dtype)
        return torch.clamp(torch.sigmoid(self.alpha) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)

    def regularizer(self, beta: float) -> torch.Tensor:
        """sum(1 - |2 h(alpha) - 1|^beta): pushes every h towards 0 or 1 (scalar tensor)."""
        return (1.0 - (2.0 * self.rounding() - 1.0).abs().pow(beta)).sum()

    def quantize(self, x: torch.Tensor, hard: bool = False) -> torch.Tensor:
        if self.alpha is None:
            return super().quantize(x)
        if x.shape != self.alpha.shape:
            raise ValueError(f"{self.name}: AdaRound alpha {tuple(self.alpha.shape)} "
                             f"does not match {tuple(x.shape)}")
        scale, zp = self._grid(x)
        codes = torch.clamp(torch.floor(x / scale) + self.rounding(hard) + zp, self.qmin, self.qmax)
        return (codes - zp) * scale

    @torch.no_grad()
    def bake(self, layer: nn.Module) -> None:
        """Write the hard-rounded weight into `layer.weight` in place and drop alpha (back to nearest)."""
        layer.weight.copy_(self.quantize(layer.weight, hard=True).to(layer.weight.dtype))
        self.alpha = None
        if hasattr(layer, "invalidate_weight_cache"):
            layer.invalidate_weight_cache()

    def extra_repr(self) -> str:
        state = "" if self.alpha is None else ", adaround=learning"
        return super().extra_repr() + state


@dataclass(frozen=True)
class RoundingSchedule:
    """When and how strongly the rounding regulariser acts (APHQ-ViT / BRECQ defaults).

    iters: total iterations of the unit; warmup: fraction with no regulariser; beta decays linearly
    from beta_start to beta_end over the remaining iterations; weight multiplies the summed term.
    """

    iters: int
    warmup: float = 0.2
    beta_start: float = 20.0
    beta_end: float = 2.0
    weight: float = 0.01

    def beta(self, it: int) -> Optional[float]:
        """beta at 0-based iteration `it`, or None during warm-up (regulariser off).

        As GoatWu/APHQ-ViT `LossFunction` / `LinearTempDecay`, which count iterations from 1: with
        t = it + 1 and t0 = warmup * iters (not rounded), off while t < t0, then
        beta_end + (beta_start - beta_end) * max(0, 1 - (t - t0) / (iters - t0)), so beta_start at t = t0
        and exactly beta_end at the last iteration.
        """
        t, t0 = it + 1, self.warmup * self.iters
        if t < t0 or t0 >= self.iters:  # warmup = 1: no regulariser at all (the official code divides by 0)
            return None
        rel = (t - t0) / (self.iters - t0)
        return self.beta_end + (self.beta_start - self.beta_end) * max(0.0, 1.0 - rel)
