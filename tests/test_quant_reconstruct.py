"""reconstruct_unit on a two-layer unit: lower output error than nearest rounding, normalised loss,
clean exit."""
import pytest
import torch
from torch import nn

from quant.aphq.adaround import AdaRoundQuantizer, RoundingSchedule
from quant.layers import QuantLinear
from quant.modes import named_quantizers, set_calibration
from quant.quantizers import UniformQuantizer
from quant.aphq.reconstruct import ReconSettings, reconstruct_unit
from quant.functional import qdrop_mix

pytestmark = pytest.mark.usefixtures("one_thread")


def two_layer_unit(seed=0):
    """Linear -> GELU -> Linear, 4-bit AdaRound weights and 4-bit per-tensor inputs, calibrated on x."""
    g = torch.Generator().manual_seed(seed)
    fp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    with torch.no_grad():
        for p in fp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    unit = nn.Sequential(
        QuantLinear.from_float(fp[0], AdaRoundQuantizer(4, channel_dim=0, num_channels=32),
                               UniformQuantizer(4)),
        nn.GELU(),
        QuantLinear.from_float(fp[2], AdaRoundQuantizer(4, channel_dim=0, num_channels=8),
                               UniformQuantizer(4)))
    x = torch.randn(256, 16, generator=g)
    set_calibration(unit, True)
    with torch.no_grad():
        unit(x)
    set_calibration(unit, False)
    unit.requires_grad_(False)
    return fp.requires_grad_(False), unit, x


def settings(iters, **kw):
    base = dict(iters=iters, batch_size=32, weight_lr=1e-2, act_lr=4e-4, drop_prob=0.5, input_mix_prob=1.0,
                rounding=RoundingSchedule(iters), normalize_loss=True, log_every=1)
    return ReconSettings(**{**base, **kw})


def output_mse(unit, fp, x):
    with torch.no_grad():
        return (unit(x) - fp(x)).pow(2).mean().item()


def test_reconstruction_beats_nearest_rounding_and_leaves_a_clean_unit():
    fp, unit, x = two_layer_unit()
    nearest = output_mse(unit, fp, x)  # calibrated quantizers, round-to-nearest weights
    float_params = {n: p.clone() for n, p in unit.named_parameters() if not n.endswith("scale")}
    logged = []
    stats = reconstruct_unit(unit, x, x, fp(x), None, "weighted_mse", settings(400),
                             torch.Generator().manual_seed(0), progress=logged.append)
    assert output_mse(unit, fp, x) < 0.8 * nearest
    assert stats["iters"] == 400 and stats["rec_last"] < stats["rec_first"]
    # normalisation: the first iteration's loss is exactly 2 (rounding regulariser off in the warm-up)
    assert logged[0]["iter"] == 1 and logged[0]["loss"] == pytest.approx(2.0, rel=1e-6)
    assert logged[0]["rec"] == pytest.approx(stats["rec_first"], rel=1e-6)
    for layer in (unit[0], unit[2]):  # weights baked onto the (fixed) weight grid
        q = layer.weight_quantizer
        codes = layer.weight / q.scale[:, None] + q.zero_point[:, None]
        assert q.alpha is None and torch.allclose(codes, codes.round(), atol=1e-4)
        assert codes.round().min() >= q.qmin and codes.round().max() <= q.qmax
    for name, q in named_quantizers(unit, "activation"):  # frozen, QDrop off, back in eval mode
        assert not q.scale.requires_grad and q.drop_prob == 1.0 and not q.training, name
    assert torch.equal(unit[0].bias, float_params["0.bias"])  # biases are not trained


def test_hessian_weight_applies_per_output_element():
    # all of the APH weight on output channel 0: the last layer's rounding variables of channels 1..7
    # get exactly zero gradient (regulariser off: warm-up over all iterations), so Adam never moves them
    fp, unit, x = two_layer_unit(seed=1)
    h = torch.zeros(1, 8)
    h[0, 0] = 1.0
    quantizer = unit[2].weight_quantizer
    alphas = []
    reconstruct_unit(unit, x, x, fp(x), h, "weighted_mse",
                     settings(50, rounding=RoundingSchedule(50, warmup=1.0)),
                     torch.Generator().manual_seed(0),
                     progress=lambda _: alphas.append(quantizer.alpha.detach().clone()))
    first, last = alphas[0], alphas[-1]  # after iteration 1 and after the last one (before the bake)
    assert torch.equal(first[1:], last[1:])
    # the weighted channel's variables moved (not saturated)
    assert (first[0] != last[0]).float().mean() > 0.5


def test_kl_head_loss_lowers_the_kl_to_the_float_logits():
    fp, unit, x = two_layer_unit(seed=2)
    target = fp(x)

    def kl(model):
        with torch.no_grad():
            return nn.functional.kl_div(model(x).log_softmax(-1), target.softmax(-1),
                                        reduction="batchmean").item()

    before = kl(unit)
    reconstruct_unit(unit, x, x, target, None, "kl", settings(300), torch.Generator().manual_seed(0))
    assert kl(unit) < before


def test_input_mix_takes_the_quantized_prefix_input_with_probability_input_mix_prob_as_officially():
    """QDrop at a unit's input: an element of the quantized-prefix input with probability input_mix_prob, of the
    float input otherwise, as the official `torch.where(torch.rand_like(q) < drop_prob, q, fp)` (1: the quantized
    input alone, QDrop off); 0.5 cannot tell it from 1 - p."""
    fp, q = torch.zeros(20000), torch.ones(20000)
    for p in (0.2, 0.9):
        torch.manual_seed(0)
        assert abs(qdrop_mix(fp, q, p).mean().item() - p) < 0.02, p
    assert torch.equal(qdrop_mix(fp, q, 1.0), q)
    assert torch.equal(qdrop_mix(fp, q, 0.0), fp)
