"""APHQ's candidate grids from the official quantile levels: `pct = torch.tensor([l, r])` (float32) and `1 - pct`
computed on it, bit for bit against GoatWu/APHQ-ViT's torch.quantile calls restated in float32."""
import pytest
import torch

from quant.aphq.search import ACT_MIN_SCALE, matmul_candidates, official_levels, range_grid, stem_levels
from quant.quantizers import UniformQuantizer


def official_linear_grid(rows, bits, l, r, eq_n, per_tensor):
    """quant_layers/linear.py `calculate_percentile_weight_candidates` (per_tensor: the activation one, a single
    row of x.view(1, -1) whose quantiles are .mean()-ed over that one row, scales clamped at 1e-4)."""
    n_levels = 2 ** (bits - 1)
    num_zp = min(16, n_levels * 2)
    num_scale = int(eq_n / num_zp)
    pct = torch.tensor([l, r])
    ups = torch.quantile(rows, pct, dim=-1)  # [2, G]
    lows = torch.quantile(rows, (1 - pct), dim=-1)
    if per_tensor:
        ups, lows = ups.mean(dim=-1, keepdim=True), lows.mean(dim=-1, keepdim=True)
    delta_min, delta_max = ups[0:1] - lows[0:1], ups[1:] - lows[1:]
    splits = torch.linspace(0, 1, steps=num_scale)[:, None] * (delta_max - delta_min)
    scales = (delta_min + splits).repeat(num_zp, 1) / (2 * n_levels - 1)
    return scales.clamp(min=1e-4) if per_tensor else scales


@pytest.mark.parametrize("pct", [(0.9, 1.0), (0.999, 1.0)])  # classification; the detection code's convolutions
@pytest.mark.parametrize("per_tensor", [False, True])
def test_range_grid_is_the_official_float32_grid_bit_for_bit(pct, per_tensor):
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(6, 30001, generator=g) * torch.linspace(0.2, 3.0, 6)[:, None] + 0.1
    if per_tensor:
        rows = rows.reshape(1, -1)
    q = UniformQuantizer(4, channel_dim=None if per_tensor else 0, num_channels=None if per_tensor else 6)
    scales, _ = range_grid(rows, q, pct, 128, min_scale=ACT_MIN_SCALE if per_tensor else 1e-8)
    assert torch.equal(scales, official_linear_grid(rows, 4, *pct, 128, per_tensor))


def test_matmul_candidates_are_the_official_float32_ones_bit_for_bit():
    # quant_layers/matmul.py `calculate_percentile_candidates`, head_channel_wise: x.transpose(0, 1) viewed as
    # [heads, 1, -1], quantiles along the last dim .mean()-ed over that one row
    x = torch.randn(8, 3, 65, 65, generator=torch.Generator().manual_seed(8)).softmax(-1)
    steps = 129
    pct = torch.tensor([0.99, 0.99999])
    x_ = x.transpose(0, 1).contiguous().view(3, 1, -1)
    ups = torch.quantile(x_, pct, dim=-1).mean(dim=-1)  # [2, heads]
    lows = torch.quantile(x_, (1 - pct), dim=-1).mean(dim=-1)
    t = torch.linspace(0, 1, steps=steps)[:, None]
    want_hi = ups[0][None] + t * (ups[1] - ups[0])[None]
    want_lo = lows[1][None] + t * (lows[0] - lows[1])[None]
    lo, hi = matmul_candidates(x, (0.99, 0.99999), steps)
    assert torch.equal(hi, want_hi) and torch.equal(lo, want_lo)


def test_the_lower_levels_are_one_minus_the_float32_upper_ones():
    # the stem's: pct = torch.tensor([0.99 + (0.9999 - 0.99) * (i / (eq_n - 1)) ** 0.5 ...] + [1.0])
    pct = torch.tensor([0.99 + (0.9999 - 0.99) * (i / 127) ** 0.5 for i in range(128)] + [1.0])
    ups, lows = official_levels(stem_levels(128))
    assert ups == pct.tolist() and lows == (1 - pct).tolist()
    assert lows[-1] == 0.0
    # not the float32 rounding of 1 - p: that is another level, and another rank
    assert official_levels([0.9])[1][0] != torch.tensor(1 - 0.9).item()
