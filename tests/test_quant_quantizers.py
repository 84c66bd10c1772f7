"""Quantizers: error bounds, idempotence, granularity, the RepQ range search and the log-sqrt2 quantizer."""
import math

import numpy as np
import pytest
import torch

from quant.functional import fake_quant_log_sqrt2, log_sqrt2_codes
from quant.quantizers import LogSqrt2Quantizer, UniformQuantizer
from quant.ranges import RangeSearch


def fitted(q, x):
    q.calibrating = True
    q(x)
    q.calibrating = False
    return q


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_error_bound_inside_range_and_idempotence(bits, symmetric):
    x = torch.randn(64, 50, generator=gen(bits)) * 3
    q = fitted(UniformQuantizer(bits, symmetric=symmetric, channel_dim=-1, num_channels=50), x)
    xq = q(x)
    scale, zp = q.scale[None, :], q.zero_point[None, :]
    lo, hi = (q.qmin - zp) * scale, (q.qmax - zp) * scale  # representable range per channel
    inside = (x >= lo) & (x <= hi)
    err = (x - xq).abs()
    assert torch.all(err[inside] <= (scale / 2).expand_as(x)[inside] * (1 + 1e-5))
    assert torch.all(xq >= lo - 1e-5) and torch.all(xq <= hi + 1e-5)  # clipped outside
    assert torch.equal(q(xq), xq)  # idempotent: quantized values are fixed points
    levels = torch.round(xq / scale + zp)
    assert torch.allclose(xq / scale + zp, levels, atol=1e-3)  # on the grid


def test_round_half_to_even():
    q = UniformQuantizer(8)
    q.set_params(torch.ones(1), torch.zeros(1))
    out = q(torch.tensor([0.5, 1.5, 2.5, -0.5]))
    assert out.tolist() == [0.0, 2.0, 2.0, 0.0]  # -0.5 -> 0 (and 0 is the lowest code)


def test_zero_point_not_clamped():
    # all-positive data: lo > 0 gives a negative zero point, kept as in RepQ-ViT
    x = torch.linspace(10.0, 20.0, 1000)
    q = fitted(UniformQuantizer(4), x)
    assert q.zero_point.item() < 0
    assert (q(x) - x).abs().max() <= q.scale.item() / 2 + 1e-5


@pytest.mark.parametrize("value", [3.7, -0.25, 0.0])
def test_constant_group_is_represented_exactly_with_a_zero_point_in_range(value):
    # channel 1 is constant: its range is widened to include 0, so the constant is a grid end point;
    # channel 0 (ordinary width, away from 0) keeps the plain percentile range and its negative zero point
    x = torch.stack([torch.linspace(10.0, 20.0, 500), torch.full((500,), value)], dim=1)
    q = fitted(UniformQuantizer(4, channel_dim=-1), x)
    assert q.qmin <= q.zero_point[1].item() <= q.qmax
    assert torch.equal(q(x)[:, 1], x[:, 1]) or value == 0.0 and q(x)[:, 1].abs().max() == 0
    assert q.zero_point[0].item() < 0



@pytest.mark.parametrize("value", [3.7, -0.25])
def test_near_constant_group_keeps_a_zero_point_in_range_and_its_values(value):
    """A channel that varies by ~1e-7 around `value` (a LayerNorm channel with gamma ~ 1e-6, not exactly 0):
    its range is widened to include 0 as an exactly constant one is, so the zero point is a code of the grid
    and the values come back to within a step's rounding of the constant. With no widening the range's width is
    ~1e-6 and the zero point |value| / scale, of order 1e7, which a LayerNorm fold turns into huge biases."""
    wobble = 1e-7 * torch.randn(500, generator=gen(5))
    x = torch.stack([torch.linspace(10.0, 20.0, 500), value + wobble], dim=1)
    q = fitted(UniformQuantizer(4, channel_dim=-1), x)
    assert q.qmin <= q.zero_point[1].item() <= q.qmax, q.zero_point
    # the widened range [min(value, 0), max(value, 0)] has a step of |value| / 15: the constant is its end point
    assert q.scale[1].item() == pytest.approx(abs(value) / (2 ** 4 - 1), rel=1e-5)
    assert (q(x)[:, 1] - x[:, 1]).abs().max() <= 1e-6

def brute_force_pick(row, bits, levels):
    """Independent numpy reference of RepQ-ViT's per-row search (first candidate wins ties)."""
    best, best_err = None, np.inf
    for p in levels:
        hi, lo = np.quantile(row, p), np.quantile(row, 1 - p)
        scale = max((hi - lo) / (2 ** bits - 1), 1e-8)
        zp = np.round(-lo / scale)
        xq = (np.clip(np.round(row / scale) + zp, 0, 2 ** bits - 1) - zp) * scale
        err = np.mean((xq - row) ** 2)
        if err < best_err:
            best, best_err = (scale, zp), err
    return best


def test_range_search_picks_min_mse_candidate_per_channel():
    g = gen(3)
    x = torch.randn(4, 300, 16, generator=g, dtype=torch.float64).float()
    x[..., :5] = x[..., :5] * torch.rand(5, generator=g) * 10  # heavy tails in some channels
    x[0, :3, 7] = 80.0
    levels = (0.9, 0.99, 0.999)  # spread out so that different channels pick different candidates
    q = fitted(UniformQuantizer(4, channel_dim=-1, num_channels=16,
                                search=RangeSearch("percentile_mse", levels)), x)
    rows = x.reshape(-1, 16).T.double().numpy()
    picks = set()
    for c in range(16):
        scale, zp = brute_force_pick(rows[c], 4, levels)
        assert q.scale[c].item() == pytest.approx(scale, rel=1e-5)
        assert q.zero_point[c].item() == zp
        picks.add(round(scale, 6))
    assert len(picks) > 1


def test_raw_minmax_is_not_a_candidate():
    # n = 10^5: even the 0.99999 candidate lies between the 2nd and 3rd largest values, so the one
    # huge outlier is clipped; with min/max as a candidate it would be represented exactly.
    x = torch.randn(100_000, generator=gen(4))
    x[0] = 1000.0
    q = fitted(UniformQuantizer(8), x)
    assert q(x)[0].item() < 10


def test_fixed_percentile_and_minmax_modes():
    x = torch.randn(5000, generator=gen(5))
    q = fitted(UniformQuantizer(8, search=RangeSearch("percentile", (0.99,))), x)
    lo, hi = np.quantile(x.numpy(), 0.01), np.quantile(x.numpy(), 0.99)
    assert q.scale.item() == pytest.approx((hi - lo) / 255, rel=1e-5)
    q = fitted(UniformQuantizer(8, search=RangeSearch("minmax")), x)
    assert q.scale.item() == pytest.approx((x.max() - x.min()).item() / 255, rel=1e-5)


def test_a_percentile_search_without_levels_is_refused_when_built():
    # no candidate range: refused where it is made, not by "stack expects a non-empty TensorList" from the fit of
    # the first quantizer that calibrates with it (a custom QuantizerSpec's search, quant/README.md)
    with pytest.raises(ValueError, match=r"method 'percentile_mse' needs at least one percentile level, got \(\)"):
        RangeSearch("percentile_mse", ())


def test_activation_channel_is_last_dim_for_nhwc():
    x = torch.randn(2, 4, 4, 6, generator=gen(6))
    x[..., 2] *= 50  # Swin NHWC: one loud channel in the last dim
    q = fitted(UniformQuantizer(8, channel_dim=-1, num_channels=6), x)
    assert q.scale.shape == (6,)
    assert q.scale[2] > 10 * q.scale[0]
    q3 = fitted(UniformQuantizer(8, channel_dim=-1, num_channels=6), x.reshape(2, 16, 6))
    assert torch.allclose(q.scale, q3.scale)


def test_per_head_quantizer_on_bhnd():
    x = torch.randn(2, 3, 5, 4, generator=gen(7))
    x[:, 1] *= 20
    q = fitted(UniformQuantizer(4, channel_dim=1, num_channels=3), x)
    assert q.scale[1] > 5 * q.scale[0]
    assert torch.equal(q(q(x)), q(x))


def test_frozen_after_calibration_and_error_before():
    q = UniformQuantizer(4)
    with pytest.raises(RuntimeError, match="before calibration"):
        q(torch.randn(10))
    fitted(q, torch.randn(100))
    scale = q.scale.clone()
    q(torch.randn(100) * 100)  # an eval batch with a very different range
    assert torch.equal(q.scale, scale)
    q.calibrating = True
    q(torch.randn(100) * 100)  # calibration mode does not re-fit a calibrated quantizer either
    assert torch.equal(q.scale, scale)
    q.reset()
    q(torch.randn(100) * 100)
    assert not torch.equal(q.scale, scale)


def test_state_dict_round_trip_keeps_calibration_and_lazy_shapes():
    q = fitted(UniformQuantizer(4, channel_dim=-1), torch.randn(10, 7))  # groups sized lazily
    fresh = UniformQuantizer(4, channel_dim=-1)
    fresh.load_state_dict(q.state_dict())
    assert fresh.calibrated and torch.equal(fresh.scale, q.scale)


def test_loading_an_uncalibrated_state_makes_the_quantizer_refuse_to_run_again():
    # a checkpoint saved before calibration holds the placeholder scale 1 / zero point 0: loading it must not
    # leave the receiving quantizer marked calibrated (it would quantize silently on that placeholder grid)
    q = fitted(UniformQuantizer(4), torch.randn(100, generator=gen(3)))
    q.load_state_dict(UniformQuantizer(4).state_dict())
    assert not q.calibrated
    with pytest.raises(RuntimeError, match="before calibration"):
        q(torch.randn(10))


def test_learnable_scale_gets_gradient_with_ste():
    q = fitted(UniformQuantizer(4), torch.randn(200, generator=gen(8)))
    q.make_learnable(scale=True)
    assert isinstance(q.scale, torch.nn.Parameter) and "scale" in q.state_dict()
    x = torch.randn(50, generator=gen(9), requires_grad=True)
    q(x).pow(2).sum().backward()
    assert q.scale.grad is not None and q.scale.grad.abs().sum() > 0
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_qdrop_mixes_float_and_quantized_in_training_only():
    x = torch.randn(4000, generator=gen(10))
    q = fitted(UniformQuantizer(2), x)
    q.drop_prob = 0.5
    q.train()
    out = q(x)
    kept = (out == x).float().mean().item()
    assert 0.4 < kept < 0.6
    q.eval()
    assert torch.equal(q(x), fake_or(q, x))


def fake_or(q, x):
    q.drop_prob = 1.0  # QDrop off
    return q(x)


class TestLogSqrt2:
    delta = 0.5

    def test_codes_and_values_on_hand_made_inputs(self):
        d, s2 = self.delta, math.sqrt(2)
        smallest = d * 2 ** (-15 / 2)  # 4-bit: codes 0..15
        x = torch.tensor([0.0, d, d / s2, d / 2, 2 * d, smallest, smallest * 0.99, d * 2 ** -8.4, 1e-12])
        codes, zero = log_sqrt2_codes(x, torch.tensor(d), 4)
        assert zero.tolist() == [True, False, False, False, False, False, False, True, True]
        assert codes[1:6].tolist() == [0, 1, 2, 0, 15]
        values = fake_quant_log_sqrt2(x, torch.tensor(d), 4)
        want = [0.0, d, d / s2, d / 2, d, smallest, smallest, 0.0, 0.0]
        assert values.tolist() == pytest.approx(want, rel=1e-6, abs=0)

    def test_codes_of_underflowing_inputs_stay_in_the_code_range(self):
        # the zero mask marks them; their codes are still clamped to the last one (documented: [0, 2^bits - 1])
        x = torch.tensor([0.0, 1e-12, self.delta * 2 ** -8.4])
        codes, zero = log_sqrt2_codes(x, torch.tensor(self.delta), 4)
        assert zero.tolist() == [True, True, True] and codes.tolist() == [15.0, 15.0, 15.0]

    def test_quantizer_idempotent_and_bounded(self):
        x = torch.softmax(torch.randn(2, 3, 17, 17, generator=gen(11)) * 3, dim=-1)
        q = fitted(LogSqrt2Quantizer(4), x)
        xq = q(x)
        assert torch.all(xq <= q.delta) and torch.all(xq >= 0)
        assert torch.allclose(q(xq), xq, rtol=1e-6, atol=0)
        # relative error of non-zero, non-saturated values is at most half a sqrt2 step
        mask = (xq > 0) & (x <= q.delta)
        ratio = (x[mask] / xq[mask]).log2().abs()
        assert torch.all(ratio <= 0.25 + 1e-5)

    def test_delta_search_picks_min_mse(self):
        x = torch.softmax(torch.randn(4, 2, 20, 20, generator=gen(12)) * 4, dim=-1)
        q = fitted(LogSqrt2Quantizer(3), x)
        xn = x.double().numpy().ravel()
        errs = []
        for p in (0.999, 0.9999, 0.99999):
            d = np.quantile(xn, p)
            errs.append((np.mean((fake_quant_log_sqrt2(x.double(), torch.tensor(d), 3).numpy().ravel()
                                  - xn) ** 2), d))
        assert q.delta.item() == pytest.approx(min(errs)[1], rel=1e-5)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_symmetric_grid_is_the_closed_form(bits):
    # codes -2^(b-1) .. 2^(b-1) - 1, zero point 0, scale = max|x| / (2^(b-1) - 1) with min/max ranges
    x = torch.randn(300, 5, generator=gen(20 + bits)) * torch.tensor([0.1, 1.0, 3.0, 0.5, 7.0])
    q = fitted(UniformQuantizer(bits, symmetric=True, channel_dim=-1, search=RangeSearch("minmax")), x)
    half = 2 ** (bits - 1)
    want = x.abs().amax(dim=0) / (half - 1)
    torch.testing.assert_close(q.scale, want, rtol=1e-6, atol=0)
    assert torch.equal(q.zero_point, torch.zeros(5))
    unit = UniformQuantizer(bits, symmetric=True)
    unit.set_params(torch.ones(1), torch.zeros(1))
    ramp = torch.arange(-half - 3, half + 3, dtype=torch.float32)  # integers: their own codes, then clipped
    assert unit(ramp).tolist() == ramp.clamp(-half, half - 1).tolist()


def test_qdrop_keeps_the_quantized_element_with_probability_drop_prob_as_officially():
    # drop_prob is the probability of an element's QUANTIZED value, as the official QDrop / APHQ-ViT
    # `torch.where(torch.rand_like(x) < self.drop_prob, x_dequant, x_orig)` has it (1: QDrop off); 0.5 cannot
    # tell it from 1 - p
    x = torch.randn(20000, generator=gen(13))
    q = fitted(UniformQuantizer(2), x)
    quantized = fake_or(q, x)
    assert not torch.isclose(quantized, x).any()  # 2 bits: no element is its own quantized value
    q.train()
    for p in (0.2, 0.9):
        q.drop_prob = p
        torch.manual_seed(0)
        out = q(x)
        assert torch.equal(out == quantized, out != x)  # each element is one or the other
        assert abs((out == quantized).float().mean().item() - p) < 0.02, p
    q.drop_prob = 1.0
    assert torch.equal(q(x), quantized)  # off in training too


def test_equal_errors_keep_the_earlier_candidate():
    # RepQ-ViT's `if err < best_err`: a later candidate must be strictly better to replace the earlier one
    from quant.ranges import best_per_group
    first = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 0.5]])  # [K=3, G=2]
    second = -first
    errs = {1.0: 0.2, 3.0: 0.2, 5.0: 0.2, 2.0: 0.3, 4.0: 0.3, 0.5: 0.1}  # group 0 all tied, group 1 last wins
    a, b, e = best_per_group(lambda s, z: torch.tensor([errs[v] for v in s.tolist()]), first, second)
    assert a.tolist() == [1.0, 0.5] and b.tolist() == [-1.0, -0.5]
    assert e.tolist() == pytest.approx([0.2, 0.1])


def test_minmax_range_of_positive_data_does_not_reach_zero():
    # min/max is the raw row range; unlike GPTQ's grid it is not stretched to include 0
    x = torch.rand(1000, generator=gen(14)) * 4 + 3  # all in [3, 7]
    q = fitted(UniformQuantizer(8, search=RangeSearch("minmax")), x)
    scale = (x.max() - x.min()).item() / 255
    assert q.scale.item() == pytest.approx(scale, rel=1e-6)
    assert q.zero_point.item() == round(-x.min().item() / scale)


def test_training_path_rounds_half_to_even_like_the_inference_path():
    # ties must not depend on whether gradients are on (LSQ / APHQ train through round_ste)
    from quant.functional import fake_quant_uniform, round_ste
    v = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 3.0, 20.0, -10.0])  # the last two clip at 15 and 0
    assert round_ste(v).tolist() == [0.0, 2.0, 2.0, -0.0, -2.0, 3.0, 20.0, -10.0]
    scale, zp = torch.tensor([0.25]), torch.tensor([3.0])
    x = v * 0.25
    want = (torch.clamp(torch.tensor([0.0, 2.0, 2.0, 0.0, -2.0, 3.0, 20.0, -10.0]) + 3, 0, 15) - 3) * 0.25
    assert fake_quant_uniform(x, scale, zp, 0, 15, ste=True).tolist() == want.tolist()
    assert fake_quant_uniform(x, scale, zp, 0, 15).tolist() == want.tolist()


def test_log_sqrt2_training_path_matches_inference_and_its_gradient_is_out_over_x():
    # the STE path (straight-through in the log domain) gives the inference values, 0 for underflow, and
    # d out / d x = out / x for codes 1 .. 2^b - 2, 0 where x saturates above delta or underflows (an exact
    # end code sits on the clamp bound, where torch.clamp passes no gradient); x = 0 exactly (a post-softmax
    # entry that underflowed in float32) underflows too: value 0 and gradient 0, not the NaN of log2(0)
    d = torch.tensor(0.5)
    x = torch.tensor([0.6, 0.4, 0.3, 0.1, 0.02, 0.5 * 2 ** -6.6, 0.5 * 2 ** -8.4, 1e-9, 0.0], requires_grad=True)
    out = fake_quant_log_sqrt2(x, d, 4, ste=True)
    with torch.no_grad():
        want = fake_quant_log_sqrt2(x.detach(), d, 4)
    assert out.detach().tolist() == pytest.approx(want.tolist(), rel=1e-6, abs=0)
    assert want[-3:].tolist() == [0.0, 0.0, 0.0]
    out.sum().backward()
    inside = (want > 0) & (x.detach() < d)
    expected = torch.where(inside, want / x.detach(), torch.zeros_like(want))
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=0)
    assert x.grad[-1].item() == 0.0  # by hand: x = 0 underflows, so its gradient is exactly 0 (finite)


def test_log_sqrt2_delta_search_is_by_squared_error_not_absolute_error():
    # data on which the min-MSE and min-MAE candidates differ, so that the criterion itself is pinned down
    x = torch.softmax(torch.randn(4, 2, 20, 20, generator=gen(2)) * 2, dim=-1)
    q = fitted(LogSqrt2Quantizer(4), x)
    xd = x.double()
    deltas = [np.quantile(xd.numpy().ravel(), p) for p in (0.999, 0.9999, 0.99999)]
    errors = [fake_quant_log_sqrt2(xd, torch.tensor(d), 4) - xd for d in deltas]
    mse = [float(e.pow(2).mean()) for e in errors]
    mae = [float(e.abs().mean()) for e in errors]
    assert np.argmin(mse) != np.argmin(mae)
    assert q.delta.item() == pytest.approx(deltas[int(np.argmin(mse))], rel=1e-5)


def test_log_sqrt2_delta_of_an_all_zero_map_is_the_smallest_step():
    # an attention map whose top percentiles are 0 (every entry masked, or underflowed in float32) gets
    # delta = MIN_SCALE = 1e-8, not 0: zero inputs quantize to 0 (not 0 / 0 = NaN), and later inputs are
    # coded against 1e-8 (by hand, 4 bits: 1e-8 -> code 0; 0.5e-8 -> code 2; 1e-9 -> round(2 log2 10) = 7)
    q = fitted(LogSqrt2Quantizer(4), torch.zeros(2, 3, 8, 8))
    assert q.delta.item() == pytest.approx(1e-8, rel=1e-6)
    assert q(torch.zeros(2, 3, 8, 8)).abs().max().item() == 0.0
    got = q(torch.tensor([1e-8, 0.5e-8, 1e-9, 0.0]))
    assert got.tolist() == pytest.approx([1e-8, 0.5e-8, 1e-8 * 2 ** -3.5, 0.0], rel=1e-6, abs=0)


def test_grad_scale_keeps_the_value_and_scales_the_gradient():
    from quant.functional import grad_scale
    x = torch.tensor([0.5, -2.0, 3.0], requires_grad=True)
    y = grad_scale(x, 0.25)
    assert torch.equal(y.detach(), x.detach())
    (g,) = torch.autograd.grad((y * torch.tensor([1.0, 2.0, 3.0])).sum(), x)
    assert torch.equal(g, torch.tensor([0.25, 0.5, 0.75]))  # d/dx of sum(c * x) = c, times the factor



def test_log_sqrt2_training_path_gradient_of_delta_is_one_per_saturated_element():
    # out = delta * 2^(-q / 2) with q = round_ste(-2 log2(x / delta)): inside the range d q / d delta =
    # 2 / (delta ln 2), so the two terms 2^(-q/2) - 2^(-q/2) cancel; above delta q is clamped at 0 and out = delta
    x = torch.tensor([0.3, 0.1, 0.02, 0.8, 0.9])
    delta = torch.tensor(0.5, requires_grad=True)
    (g,) = torch.autograd.grad(fake_quant_log_sqrt2(x, delta, 4, ste=True).sum(), delta)
    assert g.item() == pytest.approx(2.0, abs=1e-5)  # the two saturated elements


@pytest.mark.parametrize("levels", [(0.3,), (0.5,), (0.9999, 0.001)])
def test_percentile_levels_at_or_below_one_half_are_refused(levels):
    # p <= 0.5 would put the upper end q(p) at or below the lower end q(1 - p): an empty or inverted range
    with pytest.raises(ValueError, match=r"must lie in \(0.5, 1\]"):
        RangeSearch("percentile_mse" if len(levels) > 1 else "percentile", levels)


def test_loading_a_folded_per_tensor_state_makes_a_per_channel_quantizer_per_tensor():
    # RepQ-ViT's fold turns a per-channel input quantizer into a per-tensor one; a freshly converted model
    # (per channel) that loads the folded state must become per tensor too, or a later re-fit would fit one
    # range per channel again and a second fold would not be refused
    x = torch.randn(6, 5, 8, generator=gen(15)) * torch.linspace(0.5, 8.0, 8)
    folded = fitted(UniformQuantizer(4, channel_dim=-1), x)
    folded.channel_dim = None
    folded.set_params(folded.scale.mean().reshape(1), folded.zero_point.mean().reshape(1))
    fresh = UniformQuantizer(4, channel_dim=-1)
    fresh.load_state_dict(folded.state_dict())
    assert fresh.channel_dim is None
    fresh.reset()
    fitted(fresh, x)
    reference = fitted(UniformQuantizer(4), x)  # a per-tensor quantizer from scratch
    assert fresh.scale.shape == (1,) and torch.equal(fresh.scale, reference.scale)
    assert torch.equal(fresh(x), reference(x))


@pytest.mark.parametrize("options, channel_dim", [({"granularity": "head"}, 1), ({"symmetric": True}, None)],
                         ids=["per-head", "symmetric"])
def test_log_sqrt2_quantizer_refuses_a_granularity_or_sign_it_cannot_do(options, channel_dim):
    # it has one delta per tensor and non-negative codes: a per-head or symmetric request is refused, not
    # silently run per tensor / one-sided
    from quant.spec import QuantizerSpec
    spec = QuantizerSpec(4, kind=LogSqrt2Quantizer, **options)
    with pytest.raises(ValueError, match="per-tensor and one-sided"):
        LogSqrt2Quantizer.from_spec(spec, channel_dim)


def test_fixed_percentile_takes_exactly_one_level():
    # 'percentile' has no MSE selection: a second level would be silently ignored
    with pytest.raises(ValueError, match="exactly one level"):
        RangeSearch("percentile", (0.999, 0.9999))


def test_a_learnable_scale_is_not_resized_behind_the_optimizers_back():
    # a lazily sized (0-group) scale made learnable, then given 4 groups: replacing the Parameter would leave
    # an optimizer holding the old one, training nothing
    q = UniformQuantizer(4, channel_dim=-1)
    q.make_learnable(scale=True)
    with pytest.raises(ValueError, match="cannot resize learnable scale"):
        q.set_params(torch.ones(4), torch.zeros(4))
    assert isinstance(q.scale, torch.nn.Parameter) and q.scale.shape == (0,)


def test_make_learnable_refuses_a_name_that_is_no_parameter_buffer():
    # a misspelt key would otherwise leave the scale a buffer that no optimizer ever sees
    q = UniformQuantizer(4)
    with pytest.raises(KeyError, match="no parameter buffer 'scael'"):
        q.make_learnable(scael=True)


def test_log_sqrt2_treats_negative_inputs_as_zero():
    # documented contract of log_sqrt2_codes: a negative entry (log2 undefined) is quantized like 0, never NaN
    x = torch.tensor([-0.1, -1e-9, 0.0, 0.3])
    out = fake_quant_log_sqrt2(x, torch.tensor(0.5), 4)
    assert out[:3].tolist() == [0.0, 0.0, 0.0]
    assert out[3].item() == pytest.approx(0.5 * 2 ** (-round(-2 * math.log2(0.3 / 0.5)) / 2))
    codes, zero = log_sqrt2_codes(x, torch.tensor(0.5), 4)
    assert zero.tolist() == [True, True, True, False] and not torch.isnan(codes).any()


@pytest.mark.parametrize("group_size", [0, -4])
def test_a_weight_group_of_no_columns_is_refused(group_size):
    from quant.gptq.quantizer import GPTQQuantizer
    from quant.spec import QuantizerSpec
    with pytest.raises(ValueError, match=f"group_size={group_size}: needs a positive size") as refused:
        QuantizerSpec(4, kind=GPTQQuantizer, group_size=group_size)
    assert "GPTQQuantizer has" not in str(refused.value)  # GPTQ's grid has groups: only the size is wrong
    with pytest.raises(ValueError, match="group_size=8: UniformQuantizer has no groups"):
        QuantizerSpec(4, group_size=8)
    assert QuantizerSpec(4, kind=GPTQQuantizer, group_size=1).group_size == 1


def test_per_token_ranges_of_a_calibrated_quantizer_kind_are_refused():
    # a static kind fits one range at calibration: "token" (a range per row, at run time) cannot be honoured
    from quant.spec import QuantizerSpec
    with pytest.raises(ValueError, match="not a dynamic quantizer kind"):
        QuantizerSpec(8, granularity="token")


@pytest.mark.parametrize("bits", [0, 17, -2, 33, 4.5, True])
def test_a_quantizer_spec_outside_1_to_16_bits_is_refused(bits):
    from quant.spec import QuantizerSpec

    with pytest.raises(ValueError, match=f"bits must be a whole number in \\[1, 16\\], got {bits!r}"):
        QuantizerSpec(bits)


@pytest.mark.parametrize("bits", [0, -2, 17, 33, 4.5, True])
def test_quantizer_constructors_refuse_bits_outside_1_to_16(bits):
    # the constructors are an extension point of their own (quant/README.md), not only reached through QuantizerSpec:
    # unchecked, 0 bits fitted an infinite scale (NaN outputs), -2 a constant, 33 a step below MIN_SCALE
    from quant.quantizers import DynamicQuantizer

    for build in (lambda: UniformQuantizer(bits), lambda: UniformQuantizer(bits, symmetric=True),
                  lambda: LogSqrt2Quantizer(bits), lambda: DynamicQuantizer(bits)):
        with pytest.raises(ValueError, match=f"bits must be a whole number in \\[1, 16\\], got {bits!r}"):
            build()


def test_quantizer_constructors_refuse_one_signed_bit():
    # codes -2^0 .. 2^0 - 1 = {-1, 0}: no positive level, so the max-abs scale max|x| / 0 is infinite (NaN outputs)
    from quant.quantizers import DynamicQuantizer

    for build in (lambda: UniformQuantizer(1, symmetric=True), lambda: DynamicQuantizer(1)):
        with pytest.raises(ValueError, match="bits=1: a symmetric grid needs at least 2 bits \\(give 2..16\\)"):
            build()


def test_quantizers_at_the_edge_bit_widths_give_the_closed_form_grid():
    # min/max ranges, so the grids are known by hand: asymmetric b bits: scale (hi - lo) / (2^b - 1), zero point
    # round(-lo / scale), value (clamp(round(x / s) + z, 0, 2^b - 1) - z) * s; symmetric 2 bits: scale max|x| / 1,
    # codes -2 .. 1; log-sqrt2 1 bit: codes {0, 1}, i.e. values delta and delta / sqrt(2), 0 below
    from quant.quantizers import DynamicQuantizer

    x = torch.randn(400, generator=gen(40), dtype=torch.float64).float() * 3
    xd = x.double().numpy()
    minmax = RangeSearch("minmax")
    for bits in (1, 16):
        s = (xd.max() - xd.min()) / (2 ** bits - 1)
        z = np.round(-xd.min() / s)
        want = (np.clip(np.round(xd / s) + z, 0, 2 ** bits - 1) - z) * s
        got = fitted(UniformQuantizer(bits, search=minmax), x)(x).double().numpy()
        assert np.allclose(got, want, rtol=0, atol=s * 1e-3 + 1e-6), bits
    s = np.abs(xd).max()
    want = np.clip(np.round(xd / s), -2, 1) * s
    assert np.allclose(fitted(UniformQuantizer(2, symmetric=True, search=minmax), x)(x).double().numpy(), want,
                       atol=1e-5)
    assert np.allclose(DynamicQuantizer(2)(x[None]).double().numpy()[0], want, atol=1e-5)
    p = np.abs(xd)
    q = np.round(-2 * np.log2(p / p.max()))
    want = np.where(q >= 2, 0.0, p.max() * 2.0 ** (-q / 2))
    got = fitted(LogSqrt2Quantizer(1, search=minmax), x.abs())(x.abs()).double().numpy()
    assert np.allclose(got, want, atol=1e-5) and 0 < (want > 0).sum() < len(want)
    assert fitted(LogSqrt2Quantizer(16, search=minmax), x.abs()).bits == 16


def test_a_one_bit_symmetric_spec_is_refused_as_its_grid_has_no_positive_level():
    from quant.quantizers import DynamicQuantizer
    from quant.spec import QuantizerSpec

    # the dynamic kind is symmetric whatever the spec says (its max-abs grid), so it is refused without the flag too
    for kwargs in ({"symmetric": True}, {"symmetric": True, "kind": DynamicQuantizer}, {"kind": DynamicQuantizer}):
        with pytest.raises(ValueError, match="bits=1: a symmetric grid needs at least 2 bits"):
            QuantizerSpec(1, **kwargs)
    assert QuantizerSpec(1).bits == 1  # asymmetric 1 bit: codes {0, 1}, a valid grid


def test_a_narrow_but_not_constant_range_keeps_the_repq_percentile_search():
    # values in [10, 10.1]: a width of 1 % of the distance from 0 is an ordinary range (RepQ-ViT's search),
    # only near-constant groups (width <= 1e-3 of it) are stretched to include 0
    x = 10.0 + torch.rand(2000, generator=gen(30), dtype=torch.float64).float() * 0.1
    q = fitted(UniformQuantizer(4), x)
    scale, zp = brute_force_pick(x.double().numpy(), 4, (0.999, 0.9999, 0.99999))
    assert q.scale.item() == pytest.approx(scale, rel=1e-5) and q.zero_point.item() == zp
    assert q.scale.item() < 0.1 / 15 * 1.01  # stretching to 0 would give a step of about 10.1 / 15


def test_half_precision_calibration_data_is_searched_in_float32():
    # to_rows promises float32 rows: a float16 (autocast) calibration tensor must give the float64 reference's
    # parameters to float32 precision, not the float16 rounding of its quantiles and errors
    x = (torch.randn(300, 6, generator=gen(31)) * torch.linspace(0.5, 4.0, 6)).half()
    q = fitted(UniformQuantizer(4, channel_dim=-1), x)
    rows = x.double().numpy().T
    for c in range(6):
        scale, zp = brute_force_pick(rows[c], 4, (0.999, 0.9999, 0.99999))
        assert q.scale[c].item() == pytest.approx(scale, rel=1e-5)
        assert q.zero_point[c].item() == zp


def test_codes_use_a_true_division_so_ties_round_half_to_even():
    # x / s lands exactly on k + 0.5 for these float32 pairs; x * (1 / s) misses the tie in the last bit for
    # some of them (4 of 16 at s = 0.51), which would round the other way. Reference: numpy float32 true
    # division, round half to even.
    from quant.functional import fake_quant_uniform
    s = np.float32(0.51)
    k = np.arange(-8, 8, dtype=np.float32)
    x = ((k + np.float32(0.5)) * s).astype(np.float32)
    x = x[(x / s) == k + np.float32(0.5)]  # keep the exact ties only
    z = np.float32(8.0)
    want = (np.clip(np.round(x / s) + z, 0, 15) - z) * s
    got = fake_quant_uniform(torch.from_numpy(x), torch.tensor([s]), torch.tensor([z]), 0, 15)
    assert len(x) >= 8 and got.numpy().tolist() == want.tolist()


def test_a_learnable_scale_gets_its_straight_through_gradient_when_the_input_needs_none():
    # LSQ on a frozen input (an activation scale trained while the data carries no gradient): d out / d s is
    # round(x/s) - x/s inside the grid, (qmax - z) or (qmin - z) where x is clipped (STE, by hand in float64)
    x = torch.tensor([-2.0, -0.37, 0.0, 0.26, 0.5, 1.13, 9.0])
    q = UniformQuantizer(4)
    q.set_params(torch.tensor([0.25]), torch.tensor([4.0]))
    q.make_learnable(scale=True)
    (g,) = torch.autograd.grad(q(x).sum(), q.scale)
    want = 0.0
    for v in x.double().tolist():
        code = round(v / 0.25) + 4
        want += (15 - 4) if code > 15 else (0 - 4) if code < 0 else round(v / 0.25) - v / 0.25
    assert g.item() == pytest.approx(want, rel=1e-5)


def test_a_disabled_quantizer_stays_disabled_through_its_state_dict():
    # a checkpoint of a model with a float (disabled) quantizer loads as float, it does not quantize again
    x = torch.randn(100, generator=gen(32))
    q = fitted(UniformQuantizer(4), x)
    q.enabled = False
    fresh = UniformQuantizer(4)
    fresh.load_state_dict(q.state_dict())
    assert not fresh.enabled and torch.equal(fresh(x), x)


def test_dynamic_ranges_below_the_official_floor_use_the_floor():
    # SmoothQuant clamps the max-abs at 1e-5 before dividing by 2^(b-1) - 1: an all-zero token stays 0 (not
    # 0 / 0 = NaN), and a token of tiny values is rounded on the 1e-5 / 127 grid (1e-7 * 127 / 1e-5 = 1.27)
    from quant.quantizers import DynamicQuantizer
    q = DynamicQuantizer(8, reduce_dims=(-1,))
    x = torch.tensor([[0.0, 0.0, 0.0], [1e-7, -2e-7, 4e-8]])
    step = 1e-5 / 127
    want = [[0.0, 0.0, 0.0], [1 * step, -3 * step, 1 * step]]  # codes 1.27 -> 1, -2.54 -> -3, 0.508 -> 1
    got = q(x)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=0)


@pytest.mark.filterwarnings("ignore:.*to a meta parameter")  # the values are not copied onto meta
def test_a_lazily_sized_state_is_loaded_onto_the_receiving_quantizers_device():
    # a checkpoint from another device (CPU here) resizes the lazy buffers on the device of the quantizer that
    # loads it (meta stands in for an accelerator), never on the checkpoint's
    saved = fitted(UniformQuantizer(4, channel_dim=-1), torch.randn(10, 7, generator=gen(33))).state_dict()
    fresh = UniformQuantizer(4, channel_dim=-1, device=torch.device("meta"))
    fresh.load_state_dict(saved)
    assert fresh.scale.device.type == fresh.zero_point.device.type == "meta" and fresh.scale.shape == (7,)


def test_log_sqrt2_last_code_and_first_underflow_by_hand_in_both_paths_and_the_quantizer():
    """4 bits: codes 0..15. x = delta 2^-7.5 is code 15 (the last, kept); x = delta 2^-8 is code 16 exactly, the first
    to underflow to 0, in the inference and the straight-through path alike; a fitted LogSqrt2Quantizer(4) codes
    with its own 4 bits (code 14, delta 2^-7, is kept, which 3 bits would zero)."""
    q = fitted(LogSqrt2Quantizer(4), torch.softmax(torch.randn(2, 3, 9, 9, generator=gen(3)), dim=-1))
    d = q.delta.item()
    x = torch.tensor([d, d * 2 ** -3.5, d * 2 ** -7, d * 2 ** -7.5, d * 2 ** -8])
    want = [d, d * 2 ** -3.5, d * 2 ** -7, d * 2 ** -7.5, 0.0]
    for ste in (False, True):
        got = fake_quant_log_sqrt2(x.clone().requires_grad_(ste), torch.tensor(d), 4, ste=ste)
        assert got.tolist() == pytest.approx(want, rel=1e-6, abs=0), ste
    assert q(x).tolist() == pytest.approx(want, rel=1e-6, abs=0)


def naive_log_sqrt2(values, delta, bits):
    """RepQ-ViT's log-sqrt2 values by hand in float64: code round(-2 log2(x / delta)) (half to even, as Python's
    round), clamped below at 0; x <= 0 or a code >= 2^bits gives 0."""
    out = []
    for v in values:
        code = round(-2 * math.log2(v / delta)) if v > 0 else math.inf
        out.append(0.0 if code >= 2 ** bits else delta * 2 ** (-max(code, 0) / 2))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_log_sqrt2_training_path_codes_zero_as_zero_in_every_dtype_and_bit_width(dtype, bits):
    # a probability of exactly 0 (a masked key, or one that underflowed) is 0 with gradient 0 in the straight-through
    # path as in the inference path; clamping x to 1e-30 first rounded to 0 in float16 (log2(0): NaN values and NaN
    # gradients) and, at 8 bits, coded 0 as round(-2 log2 1e-30) = 199 < 256, a nonzero level
    delta = 0.5
    x = torch.tensor([0.0, 0.3, 0.1, 0.02, 0.5 * 2 ** -3.5, 0.0], dtype=dtype, requires_grad=True)
    want = naive_log_sqrt2([float(v) for v in x.detach().double()], delta, bits)
    rel = 1e-6 if dtype == torch.float32 else 1e-2  # a 0-d delta keeps x's dtype: its levels rounded to it
    for ste in (True, False):
        got = fake_quant_log_sqrt2(x if ste else x.detach(), torch.tensor(delta), bits, ste=ste)
        assert got.detach().double().tolist() == pytest.approx(want, rel=rel, abs=0), ste
        assert got[0].item() == got[-1].item() == 0.0
    (grad,) = torch.autograd.grad(fake_quant_log_sqrt2(x, torch.tensor(delta), bits, ste=True).sum(), x)
    assert bool(torch.isfinite(grad).all()) and grad[0].item() == grad[-1].item() == 0.0
