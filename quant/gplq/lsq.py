"""LSQ activation quantizer (Esser et al., ICLR 2020) for GPLQ's stage-1 activation QAT.

A `UniformQuantizer` whose scale, once `make_learnable(scale=True)` is called, is trained with the
straight-through estimator and LSQ's gradient scaling g = 1 / sqrt(Q_P * elements per scale), where
Q_P = 2^(b-1) - 1 for GPLQ's symmetric signed codes [-2^(b-1), 2^(b-1) - 1] (GPLQ paper, arXiv 2506.11784,
Sec. 3). The forward value is `round(clamp(x / s, qmin, qmax)) * s` (= clamp(round(x / s)) * s for integer
bounds); the gradient w.r.t. s is LSQ's eq. 3 (round(x/s) - x/s strictly inside the range, qmin or qmax
outside it), multiplied by g.

Initialisation is the ordinary calibrate-once protocol: the quantizer fits its range with its
`RangeSearch` on the first calibration input (min/max per channel for Linear inputs, percentiles for
matmul operands, chosen by the pipeline), and the pipeline then makes the scale learnable.
"""
from __future__ import annotations

import math

import torch

from ..functional import fake_quant_uniform, grad_scale, round_ste
from ..quantizers import MIN_SCALE, UniformQuantizer, _broadcast


class LSQQuantizer(UniformQuantizer):
    """Uniform quantizer with an LSQ-trainable scale (zero point fixed, 0 for symmetric codes)."""

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale
        learning = torch.is_grad_enabled() and scale.requires_grad
        if learning:
            # elements that share one scale: all of x over the number of groups (Python ints, no sync)
            per_group = max(1, x.numel() // scale.numel())
            scale = grad_scale(scale, 1.0 / math.sqrt(per_group * max(1, self.qmax)))
        # a learned scale may not cross zero, in training nor after it: a scale that an LSQ step took to or past
        # zero gives the values it was trained with, not a sign-flipped grid (or 0 / 0)
        s = _broadcast(scale.clamp(min=MIN_SCALE), x.ndim, self.channel_dim)
        zp = _broadcast(self.zero_point, x.ndim, self.channel_dim)
        if not learning:
            return fake_quant_uniform(x, s, zp, self.qmin, self.qmax, ste=self._use_ste(x))
        # clamp, then round (LSQ's order): an element in the last half step beyond qmax (or qmin) is
        # clipped, so its scale gradient is qmax (qmin) and its input gradient 0, as in LSQ eq. 3;
        # rounding first would give it round(v) - v and pass its input gradient. Same forward value.
        return (round_ste((x / s + zp).clamp(self.qmin, self.qmax)) - zp) * s
