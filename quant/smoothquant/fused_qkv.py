"""Per-tensor weight ranges of a fused q/k/v Linear: one max-abs scale for each of q, k and v.

GPT-2 (models/gpt.py), timm's ViT / Swin and MMDetection's Swin compute q, k and v with one Linear whose
weight rows are [Q; K; V]. SmoothQuant's per-tensor weights (mit-han-lab/smoothquant `fake_quant.py`
`quantize_weight_per_tensor_absmax`, applied by `quantize_opt` to OPT's q_proj, k_proj and v_proj
separately; their real-INT8 `Int8OPTAttention` likewise has one weight scale per projection) give each
projection its own scale max|W_p| / (2^(b-1) - 1). One scale over the fused weight would tie the three
together, so that the projection with the largest weights sets the grid of the other two.

`ProjectionTensorQuantizer` keeps the project's uniform quantizer and stores the three scales per output
row (each repeated over its projection's rows), so fake quantization, checkpoints and reports work as for
a per-channel weight quantizer.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..quantizers import UniformQuantizer
from ..spec import BLOCK_POST_NORM_LINEARS

# The fused q/k/v Linears among the in-block ones (`blocks.*.attn.qkv`, Swin's, MMDetection's `attn.w_msa.qkv`).
FUSED_QKV_LINEARS = tuple(p for p in BLOCK_POST_NORM_LINEARS if p.endswith(".qkv"))
PROJECTIONS = 3  # q, k, v


class ProjectionTensorQuantizer(UniformQuantizer):
    """Symmetric max-abs weight quantizer of a fused q/k/v Linear, one scale per projection.

    Built from a `QuantizerSpec` with granularity "tensor" (per tensor of each projection): the three scales
    are held per output row (channel dim 0), each row carrying its projection's scale.
    """

    granularity_label = "tensor of each of q, k, v"  # read by quant.modes for reports

    @classmethod
    def from_spec(cls, spec: Any, channel_dim: Optional[int], num_channels: Optional[int] = None,
                  device: Optional[torch.device] = None) -> "ProjectionTensorQuantizer":
        if spec.granularity != "tensor" or not spec.symmetric:
            raise ValueError(f"{cls.__name__} is symmetric and per tensor of each projection, got "
                             f"granularity={spec.granularity!r}, symmetric={spec.symmetric}")
        del channel_dim, num_channels  # rows are grouped along dim 0, sized at calibration
        return cls(spec.bits, symmetric=True, channel_dim=0, search=spec.search, device=device)

    def fit(self, x: torch.Tensor) -> None:
        rows = x.shape[0]
        if rows % PROJECTIONS:
            raise ValueError(f"{self.name or 'a fused qkv weight'} has {rows} output rows, not 3 equal "
                             "q / k / v projections: quantize it with weight_granularity=channel")
        amax = x.reshape(PROJECTIONS, -1).abs().amax(dim=1).float()  # [3]
        scale, zero_point = self.params_from_range(-amax, amax)
        per_row = rows // PROJECTIONS
        self.set_params(scale.repeat_interleave(per_row), zero_point.repeat_interleave(per_row))

    def extra_repr(self) -> str:
        return (f"bits={self.bits}, symmetric, per {self.granularity_label}, search={self.search.method}, "
                f"calibrated={self.calibrated}")
