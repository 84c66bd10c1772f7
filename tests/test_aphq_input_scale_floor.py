"""APHQ's input candidate scales are floored at 1e-4, its weight candidates are not, as in the official code.

GoatWu/APHQ-ViT quant_layers/linear.py `calculate_percentile_activation_candidates` (and the detection code's
linear.py / conv.py) clamps the activation candidates with `.clamp(min=1e-4)`; `calculate_percentile_weight_candidates`
does not clamp. The references below transcribe those formulas (closed form) and pick by the self MSE by loops.
"""
import pytest
import torch
from torch import nn

from quant.aphq.search import fit_per_channel, search_conv_self, search_linear
from quant.layers import QuantConv2d, QuantLinear
from quant.quantizers import UniformQuantizer

pytestmark = pytest.mark.usefixtures("one_thread")

BITS, EQ_N = 4, 128


def official_act_candidates(rows: torch.Tensor, l: float = 0.9, r: float = 1.0):
    """The official per-channel activation candidates ([C, K] scales and zero points), as linear.py writes them."""
    n_levels = 2 ** (BITS - 1)
    num_zp = min(16, n_levels * 2)
    num_scale = EQ_N // num_zp
    pct = torch.tensor([l, r], dtype=rows.dtype)
    up = torch.quantile(rows, pct, dim=1).t()  # [C, 2]
    lo = torch.quantile(rows, 1 - pct, dim=1).t()
    d_min, d_max = up[:, 0:1] - lo[:, 0:1], up[:, 1:] - lo[:, 1:]
    splits = torch.linspace(0, 1, num_scale, dtype=rows.dtype)[None, :] * (d_max - d_min)
    scales = ((d_min + splits).repeat(1, num_zp) / (2 * n_levels - 1)).clamp(min=1e-4)
    zps = torch.arange(n_levels - num_zp // 2, n_levels + num_zp // 2,
                       dtype=rows.dtype).repeat_interleave(num_scale)[None, :].expand_as(scales)
    return scales, zps


def fq(x, s, z):
    return (torch.clamp(torch.round(x / s) + z, 0, 2 ** BITS - 1) - z) * s


def near_constant_input(seed: int = 0) -> torch.Tensor:
    """[4, 50, 8] inputs whose channel 0 is near-constant (a LayerNorm channel with gamma ~ 0) and channel 1 is
    narrow around 0: both ranges are far below 15 * 1e-4."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 50, 8, generator=g)
    x[..., 0] = 0.3 + 1e-4 * torch.randn(4, 50, generator=g)
    x[..., 1] = 1e-3 * torch.randn(4, 50, generator=g)
    return x


def test_per_channel_fit_picks_the_official_candidate_on_near_constant_channels():
    x = near_constant_input()
    q = UniformQuantizer(BITS, channel_dim=-1, num_channels=8)
    q.name = "x"
    fit_per_channel(q, x, (0.9, 1.0), EQ_N)
    rows = x.reshape(-1, 8).t().double()
    scales, zps = official_act_candidates(rows)
    for c in range(8):
        errors = [float((fq(rows[c], scales[c, k], zps[c, k]) - rows[c]).pow(2).mean()) for k in range(scales.shape[1])]
        best = min(range(len(errors)), key=errors.__getitem__)
        assert float(q.scale[c]) == pytest.approx(float(scales[c, best]), rel=1e-5), c
        assert float(q.zero_point[c]) == float(zps[c, best]), c
    assert float(q.scale[0]) == pytest.approx(1e-4)  # the near-constant channel sits on the floor


def test_linear_input_grid_is_floored_and_its_weight_grid_is_not():
    """A per-tensor input of range ~1e-4 and a weight row of range ~1e-5: the input scale stops at 1e-4 (every
    official input candidate is at least that), the weight scale goes below it (no clamp on weights)."""
    g = torch.Generator().manual_seed(1)
    x = 0.3 + 1e-4 * torch.randn(64, 6, generator=g)
    layer = QuantLinear.from_float(nn.Linear(6, 4, bias=False),
                                   UniformQuantizer(BITS, channel_dim=0, num_channels=4), UniformQuantizer(BITS))
    with torch.no_grad():
        layer.weight[0] = 0.2 + 1e-5 * torch.randn(6, generator=g)
    search_linear(layer, x, rounds=1, weight_pct=(0.9, 1.0), act_pct=(0.9, 1.0), eq_n=EQ_N)
    assert float(layer.input_quantizer.scale) == pytest.approx(1e-4)
    row = layer.weight[0].detach().double()
    assert float(layer.weight_quantizer.scale[0]) <= float((row.max() - row.min()) / 15) + 1e-12 < 1e-4


def test_detection_conv_input_grid_is_floored():
    g = torch.Generator().manual_seed(2)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    layer = QuantConv2d.from_float(conv, UniformQuantizer(BITS, channel_dim=0, num_channels=4),
                                   UniformQuantizer(BITS))
    calls = [0.5 + 1e-5 * torch.randn(1, 3, 6, 6, generator=g), 0.5 + 1e-5 * torch.randn(1, 3, 4, 4, generator=g)]
    search_conv_self(layer, calls, weight_pct=(0.999, 1.0), act_pct=(0.999, 1.0), eq_n=EQ_N)
    assert float(layer.input_quantizer.scale) == pytest.approx(1e-4)
