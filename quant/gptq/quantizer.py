"""GPTQ's weight grid as a quantizer kind, shared by `rtn` and `gptq`.

IST-DASLab/gptq `quant.py` `Quantizer` with `perchannel=True, mse=False` (their OPT / LLaMA scripts'
setting), for nn.Linear weights [C_out, C_in], per output channel or per output channel and group of
`group_size` input columns:

* range: lo = min(w, 0), hi = max(w, 0), so the grid always contains 0; an all-zero group gets [-1, 1];
* asymmetric (their default): codes 0 .. 2^b - 1, scale = (hi - lo) / (2^b - 1), zero point round(-lo / scale);
* symmetric (their `--sym`): hi = max(|lo|, hi) and, where lo < 0, lo = -hi; the same unsigned codes with
  the fixed zero point 2^(b-1), i.e. levels (-2^(b-1) .. 2^(b-1) - 1) * scale with scale = 2 hi / (2^b - 1).
  This is not UniformQuantizer(symmetric=True)'s grid (scale = hi / (2^(b-1) - 1)), and, as officially, a
  group without negative values keeps lo = 0 (its levels then reach only about half of hi);
* value: scale * (clamp(round(w / scale) + zero, 0, 2^b - 1) - zero).

A Conv2d weight [C_out, C_in, kh, kw] is quantized as GPTQ's `fasterquant` does it, flattened to the matrix
[C_out, C_in * kh * kw] (its input columns then are the unfolded input's, solver.py), and reshaped back.

`group_index` [C_in] names each input column's group: GPTQ with `act_order` forms groups in activation
order, so a group's columns need not be contiguous. A weight that GPTQ already rounded onto this grid is
returned unchanged (the pipeline stores GPTQ's result in the weight and keeps the quantizer, so that the
layer reports and re-applies its grid).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ..functional import fake_quant_uniform
from ..quantizers import UniformQuantizer
from ..ranges import RangeSearch


class GPTQQuantizer(UniformQuantizer):
    """GPTQ's per-channel (or per-group) min/max weight quantizer; see the module docstring."""

    supports_groups = True

    def __init__(self, bits: int, symmetric: bool = False, group_size: Optional[int] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__(bits, symmetric=False, channel_dim=0, num_channels=None, search=RangeSearch("minmax"),
                         device=device)
        self.symmetric = symmetric  # GPTQ's sym: centred zero point on the unsigned codes (see above)
        self.group_size = group_size
        self.register_buffer("group_index", torch.zeros(0, dtype=torch.long, device=device))

    @classmethod
    def from_spec(cls, spec: Any, channel_dim: Optional[int], num_channels: Optional[int] = None,
                  device: Optional[torch.device] = None) -> "GPTQQuantizer":
        if channel_dim != 0:
            raise ValueError("GPTQ's grid quantizes Linear weights per output channel (granularity='channel')")
        return cls(spec.bits, spec.symmetric, spec.group_size, device=device)

    def range_params(self, w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(scale [R], zero point [R]) of the rows of w [R, K] (GPTQ's `find_params(w, weight=True)`), at least in
        float32: theirs compares the rows' min / max with float32 zeros, so a half-precision weight gets float32
        ranges (a bf16 scale would move the grid)."""
        zero = torch.zeros(w.shape[0], dtype=torch.promote_types(w.dtype, torch.float32), device=w.device)
        lo, hi = torch.minimum(w.amin(dim=1), zero), torch.maximum(w.amax(dim=1), zero)
        if self.symmetric:
            hi = torch.maximum(lo.abs(), hi)
            lo = torch.where(lo < 0, -hi, lo)
        empty = (lo == 0) & (hi == 0)
        lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
        scale = (hi - lo) / self.qmax
        if self.symmetric:
            return scale, torch.full_like(scale, (self.qmax + 1) / 2)
        return scale, torch.round(-lo / scale)

    def fit(self, w: torch.Tensor) -> None:
        """Round to nearest: ranges of contiguous column groups of the weight as it is (a conv's flattened)."""
        w = w.flatten(1)
        columns = w.shape[1]
        size = self.group_size or columns
        params = [self.range_params(w[:, i:i + size]) for i in range(0, columns, size)]
        group_index = torch.arange(columns, device=w.device) // size
        self.set_group_params(torch.stack([s for s, _ in params], 1), torch.stack([z for _, z in params], 1),
                              group_index)

    def set_group_params(self, scale: torch.Tensor, zero_point: torch.Tensor, group_index: torch.Tensor) -> None:
        """Scales and zero points [C_out, G] and the group of each input column [C_in]; marks calibrated."""
        self.set_params(scale, zero_point)
        self._buffers["group_index"] = group_index.detach().to(torch.long).clone()

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        scale, zp = self.scale.view(rows, -1), self.zero_point.view(rows, -1)
        if scale.shape[1] > 1:  # per group: each column takes its group's parameters
            scale, zp = scale[:, self.group_index], zp[:, self.group_index]
        # a conv weight [C_out, C_in, kh, kw] as the matrix [C_out, C_in * kh * kw] GPTQ quantizes
        flat = x.flatten(1)
        return fake_quant_uniform(flat, scale, zp, self.qmin, self.qmax, ste=self._use_ste(flat)).view_as(x)

    def get_extra_state(self) -> Dict[str, Any]:
        return {**super().get_extra_state(), "group_size": self.group_size}

    def set_extra_state(self, state: Dict[str, Any]) -> None:
        super().set_extra_state(state)
        self.group_size = state.get("group_size", self.group_size)

    def extra_repr(self) -> str:
        groups = f"groups of {self.group_size}" if self.group_size else "per output channel"
        return (f"bits={self.bits}, GPTQ grid, {'sym' if self.symmetric else 'asym'}, {groups}, "
                f"calibrated={self.calibrated}")
