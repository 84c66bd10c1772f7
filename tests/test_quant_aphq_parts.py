"""APHQ building blocks: AdaRound rounding, the rounding schedule, the APH weights, the calibration search."""
import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

from quant.aphq.adaround import AdaRoundQuantizer, RoundingSchedule
from quant.aphq.hessian import perturbation_hessian
from quant import PIPELINES
from quant.layers import QuantConv2d, QuantLinear
from quant.quantizers import Quantizer, UniformQuantizer
from quant.aphq.search import range_grid, search_linear, search_matmul, search_stem
from quant.units import find_units, model_logits
from quant_models import images, perturb_norms, tiny_swin, tiny_vit


pytestmark = pytest.mark.usefixtures("one_thread")


def adaround_layer(bits=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(24, 8)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(8, 24, generator=g))
    q = AdaRoundQuantizer(bits, channel_dim=0, num_channels=8)
    layer = QuantLinear.from_float(linear, q, None)
    q.calibrating = True
    q(layer.weight)
    q.calibrating = False
    return layer, q


def test_adaround_starts_at_the_float_weight_and_bakes_onto_the_grid():
    layer, q = adaround_layer()
    w0 = layer.weight.detach().clone()
    s, z = q.scale[:, None], q.zero_point[:, None]
    alpha = q.start_rounding(layer.weight)
    assert alpha.shape == w0.shape and alpha.requires_grad
    inside = (torch.floor(w0 / s) + z >= q.qmin) & (torch.floor(w0 / s) + 1 + z <= q.qmax)
    soft = q(layer.weight)  # h(alpha) = frac(w / s): the soft weight is the float weight inside the range
    assert torch.allclose(soft[inside], w0[inside], atol=1e-5)

    with torch.no_grad():
        alpha.copy_(torch.randn(alpha.shape, generator=torch.Generator().manual_seed(1)) * 3)  # "learned"
    hard = (alpha >= 0).float()
    q.bake(layer)
    assert q.alpha is None
    codes = layer.weight / s + z
    assert torch.allclose(codes, codes.round(), atol=1e-4)  # on the grid
    assert codes.min() >= q.qmin - 1e-4 and codes.max() <= q.qmax + 1e-4
    expected = torch.clamp(torch.floor(w0 / s) + hard + z, q.qmin, q.qmax)  # floor or ceil as alpha chose
    assert torch.equal(codes.round(), expected)
    assert torch.equal(q(layer.weight), layer.weight)  # nearest rounding leaves baked weights unchanged


def test_adaround_hard_rounding_takes_ceil_at_alpha_zero():
    # official quantizers/adaround.py: x_floor + (alpha >= 0); alpha = 0 (h = 0.5) is a tie that rounds up
    layer, q = adaround_layer()
    w0 = layer.weight.detach().clone()
    s, z = q.scale[:, None], q.zero_point[:, None]
    q.start_rounding(layer.weight)
    with torch.no_grad():
        q.alpha.zero_()
    q.bake(layer)
    assert torch.equal((layer.weight / s + z).round(), torch.clamp(torch.floor(w0 / s) + 1 + z, q.qmin, q.qmax))


def test_adaround_refuses_a_per_tensor_spec_and_a_weight_of_another_shape():
    from quant.spec import QuantizerSpec
    with pytest.raises(ValueError, match="per-output-channel WEIGHT quantizer"):
        AdaRoundQuantizer.from_spec(QuantizerSpec(4, kind=AdaRoundQuantizer), None)
    layer, q = adaround_layer()
    q.start_rounding(layer.weight)
    with pytest.raises(ValueError, match=r"alpha \(8, 24\) does not match \(8, 12\)"):
        q(layer.weight[:, :12])  # named shapes, not a broadcasting error from inside the forward
    # before the search has set the scale, frac(w / s) would be taken on the placeholder scale 1
    fresh = AdaRoundQuantizer(4, channel_dim=0, num_channels=8)
    with pytest.raises(RuntimeError, match="set the weight scale before starting AdaRound"):
        fresh.start_rounding(layer.weight)
    assert fresh.alpha is None


def test_adaround_regularizer_and_gradients():
    layer, q = adaround_layer()
    q.start_rounding(layer.weight)
    out = layer(torch.randn(5, 24))
    (out.pow(2).mean() + q.regularizer(20.0)).backward()
    assert q.alpha.grad is not None and torch.isfinite(q.alpha.grad).all() and q.alpha.grad.abs().sum() > 0


def official_beta(count, iters, warmup, start_b=20.0, end_b=2.0):
    """GoatWu/APHQ-ViT utils/block_recon.py: LossFunction.__call__ counts from 1 (count += 1 first), the
    round loss is off while count < iters * warmup, beta = LinearTempDecay(iters, warmup)(count)."""
    if count < iters * warmup:
        return None
    start_decay = warmup * iters
    rel_t = (count - start_decay) / (iters - start_decay)
    return end_b + (start_b - end_b) * max(0.0, 1 - rel_t)


@pytest.mark.parametrize("iters, warmup", [(100, 0.2), (4, 0.2), (7, 0.3), (20000, 0.2)])
def test_rounding_schedule_is_the_official_one_counted_from_one(iters, warmup):
    sched = RoundingSchedule(iters=iters, warmup=warmup, beta_start=20, beta_end=2)
    for it in range(iters):
        want = official_beta(it + 1, iters, warmup)
        got = sched.beta(it)
        assert (got is None) == (want is None), it
        if want is not None:
            assert got == pytest.approx(want, rel=1e-12), it
    assert sched.beta(iters - 1) == pytest.approx(2.0)  # the last iteration ends at beta_end
    betas = [b for b in map(sched.beta, range(iters)) if b is not None]
    assert betas[0] <= 20.0 and all(a >= b for a, b in zip(betas, betas[1:]))


def test_rounding_schedule_hand_values():
    sched = RoundingSchedule(iters=100)  # the defaults are configs/4bit/best.py's: 20% warm-up, beta 20 -> 2
    assert sched.weight == 0.01
    # the official count 20 = 0.2 * 100 is the first with the round loss, at beta 20; count 100 ends at 2
    assert sched.beta(18) is None and sched.beta(19) == 20.0 and sched.beta(99) == 2.0
    assert sched.beta(59) == pytest.approx(2 + 18 * (1 - 40 / 80))
    assert all(RoundingSchedule(iters=10, warmup=1.0).beta(i) is None for i in range(10))  # never on


@pytest.mark.parametrize("probe", ["ones", "rademacher"])
def test_hessian_weights_are_nonnegative_with_the_output_shape(probe):
    vit, swin = tiny_vit(), tiny_swin()
    x = images(6)
    for model, unit, shape in ((vit, "blocks.1", (1, 17, 48)), (vit, "patch_embed", (1, 16, 48)),
                               (swin, "layers.0.blocks.1", (1, 16, 16, 32)),
                               (swin, "layers.1.downsample", (1, 8, 8, 64))):
        h = perturbation_hessian(model, unit, x, model_logits(model, x, 3), batch_size=3, probe=probe,
                                 eps=1e-6 if probe == "ones" else 1e-4)
        assert h.shape == shape and h.dtype == torch.float32
        assert torch.isfinite(h).all() and (h >= 0).all()
    assert all(p.grad is None for p in vit.parameters())  # gradients only w.r.t. the perturbed output


def test_all_ones_aph_equals_the_exact_hessian_row_sums():
    # a unit whose consumer is not shift-invariant (tanh -> head), so the official probe sees the
    # Hessian: |J+ - J-| = 2 eps |H_i 1| per sample (H_i of the batch-mean KL), averaged over samples.
    # Reference: the exact Hessian from torch.autograd.functional.hessian.
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(unit=nn.Linear(5, 4), act=nn.Tanh(), head=nn.Linear(4, 3))).double()
    # logits go through float32: eps >> 1e-7
    x, batch, eps, temp = torch.randn(6, 5, dtype=torch.float64), 3, 1e-3, 2.0
    logits = model_logits(model, x, batch)
    h = perturbation_hessian(model, "unit", x, logits, batch, temperature=temp, eps=eps, probe="ones")
    expected = torch.zeros(4, dtype=torch.float64)
    with torch.no_grad():
        outs = model.unit(x)
    for o, target_logits in zip(outs, logits):
        target = (target_logits / temp).softmax(-1)

        def kl(u, target=target):
            log_q = (model.head(torch.tanh(u)) / temp).log_softmax(-1)
            return (target * (target.log() - log_q)).sum() / batch  # batchmean over a chunk of `batch`

        hess = torch.autograd.functional.hessian(kl, o)
        expected += (2 * eps * hess.sum(dim=1)).abs()
    torch.testing.assert_close(h[0].double(), expected / x.shape[0], rtol=1e-3, atol=0)


def test_normalized_aph_weight_has_mean_one():
    from quant.aphq.hessian import normalized_weight
    h = torch.tensor([[1.0, 3.0, 0.0, 4.0]])
    assert torch.equal(normalized_weight(h), torch.tensor([[0.5, 1.5, 0.0, 2.0]]))  # h / mean(h), mean 2
    assert torch.equal(normalized_weight(torch.zeros(1, 3)), torch.zeros(1, 3))  # no 0 / 0


def test_hessian_refuses_logits_of_another_length():
    model = tiny_vit()
    x = images(4)
    with pytest.raises(ValueError, match=r"fp_logits has 2 rows for 4 images"):
        perturbation_hessian(model, "blocks.0", x, model_logits(model, x[:2], 2), batch_size=2)


def test_all_ones_perturbation_is_invisible_to_a_pre_layernorm_transformer():
    """Why the official APH is rounding noise (hessian.py docstring): in float64 it vanishes."""
    model = tiny_vit().double()
    x = images(4).double()
    logits = model_logits(model, x, 4)
    ones = perturbation_hessian(model, "blocks.0", x, logits, 4, eps=1e-6, probe="ones")
    diag = perturbation_hessian(model, "blocks.0", x, logits, 4, eps=1e-4, probe="rademacher")
    assert ones.max() < 1e-9 * diag.max()


def test_units_in_module_order():
    assert [u.name for u in find_units(tiny_vit())] == ["patch_embed", "blocks.0", "blocks.1", "head"]
    names = [(u.name, u.kind) for u in find_units(tiny_swin())]
    assert names == [("patch_embed", "stem"), ("layers.0.blocks.0", "block"), ("layers.0.blocks.1", "block"),
                     ("layers.1.downsample", "merge"), ("layers.1.blocks.0", "block"),
                     ("layers.1.blocks.1", "block"), ("head.fc", "head")]


def test_output_mse_search_is_no_worse_than_the_percentile_init():
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(32, 16)
    layer = QuantLinear.from_float(linear, UniformQuantizer(4, channel_dim=0, num_channels=16),
                                   UniformQuantizer(4))
    x = torch.randn(64, 32, generator=g) * torch.linspace(0.1, 3, 32)
    grid = dict(weight_pct=(0.9, 1.0), act_pct=(0.9, 1.0), eq_n=128)
    searched = search_linear(layer, x, rounds=3, **grid)["output_mse"]
    naive = copy.deepcopy(layer)
    for q, t in ((naive.weight_quantizer, naive.weight), (naive.input_quantizer, x)):
        q.reset()
        q.calibrating = True
        q(t)  # RepQ percentile init
        q.calibrating = False
    with torch.no_grad():
        ref = x @ linear.weight.t()
        naive_mse = (naive.input_quantizer(x) @ naive.quantized_weight().t() - ref).pow(2).mean().item()
    assert searched <= naive_mse

    qa, qb = (UniformQuantizer(4, channel_dim=1, num_channels=3),
              UniformQuantizer(4, channel_dim=1, num_channels=3))
    a, b = torch.randn(4, 3, 10, 8, generator=g), torch.randn(4, 3, 10, 8, generator=g)
    out = search_matmul(qa, qb, a, b, lambda u, v: u @ v.transpose(-2, -1), pct=(0.99, 0.99999),
                        steps=9, rounds=1)
    assert qa.calibrated and qb.calibrated and qa.scale.shape == (3,)
    assert out["output_mse"] < (a @ b.transpose(-2, -1)).pow(2).mean().item()


def test_gram_and_direct_weight_errors_choose_the_same_parameters():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 16, generator=g) * torch.linspace(0.2, 4, 16)
    grid = dict(rounds=2, weight_pct=(0.9, 1.0), act_pct=(0.9, 1.0), eq_n=128)
    picked = []
    for gram in (True, False):
        torch.manual_seed(0)
        layer = QuantLinear.from_float(nn.Linear(16, 12), UniformQuantizer(4, channel_dim=0, num_channels=12),
                                       UniformQuantizer(4))
        mse = search_linear(layer, x, gram=gram, **grid)["output_mse"]
        picked.append((layer.weight_quantizer.scale.clone(), layer.weight_quantizer.zero_point.clone(), mse))
    assert torch.equal(picked[0][0], picked[1][0]) and torch.equal(picked[0][1], picked[1][1])
    assert picked[0][2] == pytest.approx(picked[1][2], rel=1e-5)


def _official_grid(rows, bits, pct, eq_n):
    """GoatWu/APHQ-ViT `calculate_percentile_weight_candidates`, restated with torch.quantile."""
    n_levels = 2 ** (bits - 1)
    num_zp = min(16, n_levels * 2)
    num_scale = eq_n // num_zp
    p = torch.tensor(pct)  # float32 there, and 1 - p taken in float32; cast only because these rows are float64
    uppers = torch.quantile(rows, p.to(rows.dtype), dim=-1)  # [2, G]
    lowers = torch.quantile(rows, (1 - p).to(rows.dtype), dim=-1)
    delta_min, delta_max = uppers[0] - lowers[0], uppers[1] - lowers[1]
    splits = torch.linspace(0, 1, num_scale, dtype=rows.dtype)[:, None] * (delta_max - delta_min)
    scales = (delta_min + splits).repeat(num_zp, 1) / (2 * n_levels - 1)
    zps = torch.arange(n_levels - num_zp // 2, n_levels + num_zp // 2).repeat_interleave(num_scale)
    return scales, zps[:, None].expand_as(scales).to(rows.dtype)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_candidate_grid_is_the_official_one(bits):
    rows = torch.randn(5, 300, generator=torch.Generator().manual_seed(bits), dtype=torch.float64) * 2 + 0.3
    q = UniformQuantizer(bits, channel_dim=0, num_channels=5)
    scales, zps = range_grid(rows, q, (0.9, 1.0), 128)
    want_s, want_z = _official_grid(rows, bits, (0.9, 1.0), 128)
    torch.testing.assert_close(scales, want_s, rtol=1e-12, atol=0)
    assert torch.equal(zps, want_z)
    assert zps.min() >= 0 and zps.max() <= 2 ** bits - 1  # 0..15 at 4 bits, 0..7 at 3, 120..135 at 8


@pytest.mark.parametrize("rounds", [0, 1, 2])
def test_linear_search_follows_the_official_order(rounds):
    """Weight-only MSE, input-only MSE, then rounds of [weights, input] by the output MSE, recomputed
    here candidate by candidate with a fake quantizer written out in the test."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 6, generator=g) * torch.linspace(0.5, 3, 6) + 0.2
    layer = QuantLinear.from_float(nn.Linear(6, 4, bias=False),
                                   UniformQuantizer(4, channel_dim=0, num_channels=4), UniformQuantizer(4))
    W = layer.weight.detach().clone()
    search_linear(layer, x, rounds=rounds, weight_pct=(0.9, 1.0), act_pct=(0.9, 1.0), eq_n=32)

    def fq(t, s, z):
        return (torch.clamp(torch.round(t / s) + z, 0, 15) - z) * s

    w_s, w_z = range_grid(W, layer.weight_quantizer, (0.9, 1.0), 32)
    a_s, a_z = range_grid(x.reshape(1, -1), layer.input_quantizer, (0.9, 1.0), 32)
    target = x @ W.t()
    K = w_s.shape[0]
    wi = [min(range(K), key=lambda k: float((fq(W[c], w_s[k, c], w_z[k, c]) - W[c]).pow(2).mean()))
          for c in range(4)]
    ai = min(range(K), key=lambda k: float((fq(x, a_s[k, 0], a_z[k, 0]) - x).pow(2).mean()))
    for _ in range(rounds):
        xq = fq(x, a_s[ai, 0], a_z[ai, 0])
        wi = [min(range(K), key=lambda k: float((xq @ fq(W[c], w_s[k, c], w_z[k, c]) - target[:, c])
                                                .pow(2).mean())) for c in range(4)]
        wq = torch.stack([fq(W[c], w_s[wi[c], c], w_z[wi[c], c]) for c in range(4)])
        ai = min(range(K), key=lambda k: float((fq(x, a_s[k, 0], a_z[k, 0]) @ wq.t() - target).pow(2).mean()))
    torch.testing.assert_close(layer.weight_quantizer.scale, torch.stack([w_s[wi[c], c] for c in range(4)]))
    assert torch.equal(layer.weight_quantizer.zero_point, torch.stack([w_z[wi[c], c] for c in range(4)]))
    torch.testing.assert_close(layer.input_quantizer.scale, a_s[ai])
    assert torch.equal(layer.input_quantizer.zero_point, a_z[ai])


def test_stem_search_is_the_official_conv_grid():
    """GoatWu/APHQ-ViT quant_layers/conv.py with a float input: 129 mirrored percentile ranges (0.99 to
    0.9999, power-0.5 spacing, plus 1.0) by the output MSE per output channel, then the lower bound with
    the upper fixed, then the upper with the lower fixed; recomputed here with torch.quantile, conv2d
    and a fake quantizer written out in the test."""
    torch.manual_seed(2)
    conv = nn.Conv2d(3, 5, kernel_size=4, stride=4, bias=False)
    x = torch.randn(6, 3, 16, 16)
    layer = QuantConv2d.from_float(conv, UniformQuantizer(4, channel_dim=0, num_channels=5), None)
    eq_n = 16
    result = search_stem(layer, x, eq_n)

    pct = torch.tensor([0.99 + (0.9999 - 0.99) * (i / (eq_n - 1)) ** 0.5 for i in range(eq_n)] + [1.0],
                       dtype=torch.float64)
    w = conv.weight.detach().reshape(5, -1).double()
    ups, los = torch.quantile(w, pct, dim=1), torch.quantile(w, 1 - pct, dim=1)  # [L, 5]
    target = nn.functional.conv2d(x.double(), conv.weight.detach().double(), stride=4)

    def err(c, lo, hi):
        s = (hi - lo) / 15
        z = -torch.round(lo / s)
        wq = (torch.clamp(torch.round(w[c] / s) + z, 0, 15) - z) * s
        out = nn.functional.conv2d(x.double(), wq.reshape(1, 3, 4, 4), stride=4)
        return float((out[:, 0] - target[:, c]).pow(2).mean())

    L = len(pct)
    for c in range(5):
        k = min(range(L), key=lambda k: err(c, los[k, c], ups[k, c]))
        lo, hi = los[k, c], ups[k, c]
        lo = los[min(range(L), key=lambda j: err(c, los[j, c], hi)), c]
        hi = ups[min(range(L), key=lambda j: err(c, lo, ups[j, c])), c]
        s = (hi - lo) / 15
        assert float(layer.weight_quantizer.scale[c]) == pytest.approx(float(s), rel=1e-5)
        assert float(layer.weight_quantizer.zero_point[c]) == float(-torch.round(lo / s))
    # the reported error is the MSE of the whole output with the chosen weights
    s, z = layer.weight_quantizer.scale.double()[:, None], layer.weight_quantizer.zero_point.double()[:, None]
    wq = (torch.clamp(torch.round(w / s) + z, 0, 15) - z) * s
    out = nn.functional.conv2d(x.double(), wq.reshape(5, 3, 4, 4), stride=4)
    assert result["output_mse"] == pytest.approx(float((out - target).pow(2).mean()), rel=1e-4)


@pytest.mark.parametrize("rounds", [0, 1, 2])
def test_matmul_search_is_the_official_procedure(rounds):
    """GoatWu/APHQ-ViT quant_layers/matmul.py, per head, recomputed with torch.quantile and loops:
    candidates linear in value (uppers q(0.99) -> q(0.99999), lowers q(0.00001) -> q(0.01)), both
    operands start at the second-to-last pair, A then B over the pairs, then per round A's lower, A's
    upper, B's lower, B's upper bound."""
    g = torch.Generator().manual_seed(4)
    a = torch.randn(2, 2, 6, 5, generator=g).double().exp()  # skewed, like softmax outputs
    b = torch.randn(2, 2, 7, 5, generator=g).double() * 2
    qa = UniformQuantizer(4, channel_dim=1, num_channels=2)
    qb = UniformQuantizer(4, channel_dim=1, num_channels=2)
    steps = 9
    search_matmul(qa, qb, a.float(), b.float(), lambda u, v: u @ v.transpose(-2, -1), pct=(0.99, 0.99999),
                  steps=steps, rounds=rounds)

    def grid(x, h):
        v = x[:, h].reshape(-1)
        up = torch.quantile(v, torch.tensor([0.99, 0.99999], dtype=v.dtype))
        lo = torch.quantile(v, torch.tensor([0.01, 0.00001], dtype=v.dtype))
        t = torch.linspace(0, 1, steps, dtype=v.dtype)
        return lo[1] + t * (lo[0] - lo[1]), up[0] + t * (up[1] - up[0])

    def fq(x, lo, hi):
        s = (hi - lo) / 15
        z = -torch.round(lo / s)
        return (torch.clamp(torch.round(x / s) + z, 0, 15) - z) * s

    for h in range(2):
        A, B = a[:, h], b[:, h]
        target = A @ B.transpose(-2, -1)
        (alo, ahi), (blo, bhi) = grid(a, h), grid(b, h)

        def err(xa, xb):
            return float((xa @ xb.transpose(-2, -1) - target).pow(2).mean())

        cur = {"a": (alo[-2], ahi[-2]), "b": (blo[-2], bhi[-2])}

        def pick(which, los, his):
            other = fq(B, *cur["b"]) if which == "a" else fq(A, *cur["a"])
            x = A if which == "a" else B

            def e(k):
                xq = fq(x, los[k], his[k])
                return err(xq, other) if which == "a" else err(other, xq)
            k = min(range(steps), key=e)
            cur[which] = (los[k], his[k])

        pick("a", alo, ahi)
        pick("b", blo, bhi)
        for _ in range(rounds):
            for which, (los, his) in (("a", (alo, ahi)), ("b", (blo, bhi))):
                pick(which, los, cur[which][1].expand(steps))
                pick(which, cur[which][0].expand(steps), his)
        for q, which in ((qa, "a"), (qb, "b")):
            lo, hi = cur[which]
            assert float(q.scale[h]) == pytest.approx(float((hi - lo) / 15), rel=1e-4)
            assert float(q.zero_point[h]) == float(-torch.round(lo / ((hi - lo) / 15)))


def test_adaround_regularizer_is_the_summed_closed_form():
    # 0.01-free term of AdaRound's eq. 24: sum over all weights of 1 - |2 h(alpha) - 1|^beta,
    # h = clamp(sigmoid(alpha) (zeta - gamma) + gamma, 0, 1) with gamma = -0.1, zeta = 1.1
    layer, q = adaround_layer()
    q.start_rounding(layer.weight)
    with torch.no_grad():
        q.alpha.copy_(torch.linspace(-4, 4, q.alpha.numel()).reshape(q.alpha.shape))
    a = q.alpha.detach().double()
    h = (torch.sigmoid(a) * 1.2 - 0.1).clamp(0, 1)
    for beta in (2.0, 20.0):
        want = float((1 - (2 * h - 1).abs() ** beta).sum())
        assert float(q.regularizer(beta).detach()) == pytest.approx(want, rel=1e-5)


def test_rademacher_aph_is_hutchinsons_estimate_with_one_probe_per_sample_and_batch():
    # H ~ clamp(mean_i z_i * (H_i z_i), 0) with a fresh +-1 probe z_i per sample (drawn per batch, in order
    # from the generator); reference: the same probes times the exact Hessian of the batch-mean KL (autograd)
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(unit=nn.Linear(5, 4), act=nn.Tanh(), head=nn.Linear(4, 3))).double()
    x, batch, eps, temp = torch.randn(6, 5, dtype=torch.float64), 3, 1e-4, 2.0
    logits = model_logits(model, x, batch)
    h = perturbation_hessian(model, "unit", x, logits, batch, temperature=temp, eps=eps, probe="rademacher",
                             generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    probes = torch.cat([torch.randint(0, 2, (batch, 4), generator=g).double() * 2 - 1 for _ in range(2)])
    assert not torch.equal(probes[:batch], probes[batch:])
    expected = sum(z * hz for z, hz in _sample_hessian_products(model, x, logits, probes, temp, batch))
    torch.testing.assert_close(h[0].double(), (expected / x.shape[0]).clamp(min=0), rtol=1e-3, atol=1e-9)


def _sample_hessian_products(model, x, logits, probes, temp, batch):
    """(z, H z) per sample: H the exact Hessian (autograd) at the sample's `unit` output of its KL(target || q) / batch,
    target the softmax of its `logits` / temp, q the head's on tanh of the output; z its probe row."""
    with torch.no_grad():
        outs = model.unit(x)
    products = []
    for o, target_logits, z in zip(outs, logits, probes):
        target = (target_logits / temp).softmax(-1)

        def kl(u, target=target):
            log_q = (model.head(torch.tanh(u)) / temp).log_softmax(-1)
            return (target * (target.log() - log_q)).sum() / batch

        products.append((z, torch.autograd.functional.hessian(kl, o) @ z))
    return products


@pytest.mark.parametrize("probe", ["ones", "rademacher"])
def test_aph_weighs_every_sample_alike_when_the_last_batch_is_shorter(probe):
    # 5 samples in batches of 3: chunks of 3 and 2. The batch-mean KL of the short chunk gives its samples a
    # gradient factor 1/2 instead of 1/3; the sample mean must still weigh each sample at the 1 / batch of a full
    # chunk (it weighed the last two 1.5 times). Reference: the exact Hessian of each sample's KL / batch (autograd)
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(unit=nn.Linear(5, 4), act=nn.Tanh(), head=nn.Linear(4, 3))).double()
    x, batch, eps, temp = torch.randn(5, 5, dtype=torch.float64), 3, 1e-3 if probe == "ones" else 1e-4, 2.0
    logits = model_logits(model, x, batch)
    h = perturbation_hessian(model, "unit", x, logits, batch, temperature=temp, eps=eps, probe=probe,
                             generator=torch.Generator().manual_seed(5))
    if probe == "ones":
        probes = torch.ones(5, 4, dtype=torch.float64)
    else:  # drawn per chunk, in order, from the generator (3 rows, then 2)
        g = torch.Generator().manual_seed(5)
        probes = torch.cat([torch.randint(0, 2, (n, 4), generator=g).double() * 2 - 1 for n in (3, 2)])
    # 1 / batch for every sample, the short chunk's too
    expected = sum((2 * eps * hz).abs() if probe == "ones" else z * hz
                   for z, hz in _sample_hessian_products(model, x, logits, probes, temp, batch))
    expected = expected / x.shape[0]
    # the logits pass through float32 (perturbation_hessian's .float()): the Rademacher central difference carries
    # ~1e-3 of its terms' size (~5e-3 here), far below the 1.5x the short chunk's samples had
    torch.testing.assert_close(h[0].double(), expected if probe == "ones" else expected.clamp(min=0), rtol=1e-3,
                               atol=1e-9 if probe == "ones" else 2e-5)


def test_linear_search_reports_the_output_mse_of_its_final_quantizers():
    # data on which the output-MSE round moves the input range away from the input-only choice, so a stale
    # quantized input would show; reference: the final quantizers' output error, computed here directly
    g = torch.Generator().manual_seed(13)
    x = torch.randn(40, 6, generator=g) * torch.linspace(0.5, 3, 6) + 0.2
    torch.manual_seed(13)
    layer = QuantLinear.from_float(nn.Linear(6, 4, bias=False),
                                   UniformQuantizer(4, channel_dim=0, num_channels=4), UniformQuantizer(4))
    W = layer.weight.detach().clone()

    def fq(t, s, z):
        return (torch.clamp(torch.round(t / s) + z, 0, 15) - z) * s

    a_s, a_z = range_grid(x.reshape(1, -1), layer.input_quantizer, (0.9, 1.0), 32)
    input_only = min(range(a_s.shape[0]), key=lambda k: float((fq(x, a_s[k, 0], a_z[k, 0]) - x).pow(2).mean()))
    result = search_linear(layer, x, rounds=1, weight_pct=(0.9, 1.0), act_pct=(0.9, 1.0), eq_n=32)
    iq, wq = layer.input_quantizer, layer.weight_quantizer
    # the output-MSE round did move the input range
    assert not (torch.equal(iq.scale, a_s[input_only]) and torch.equal(iq.zero_point, a_z[input_only]))
    out = fq(x, iq.scale, iq.zero_point) @ fq(W, wq.scale[:, None], wq.zero_point[:, None]).t()
    assert result["output_mse"] == pytest.approx(float((out - x @ W.t()).pow(2).mean()), rel=1e-5)


def test_unit_coverage_names_the_enabled_quantizers_outside_every_unit():
    # APHQ reconstructs unit by unit: an enabled quantizer outside every unit would never be reconstructed
    from quant.units import check_unit_coverage
    model, _ = PIPELINES["percentile"](tiny_vit(), images(2), "w4a4")
    blocks = find_units(model, ("block",))
    outside = [n for n, m in model.named_modules() if isinstance(m, Quantizer) and not n.startswith("blocks.")]
    assert outside  # the stem's and the head's quantizers
    with pytest.raises(ValueError, match=rf"{len(outside)} quantizers lie outside every reconstruction unit"):
        check_unit_coverage(model, blocks)
    check_unit_coverage(model, find_units(model))  # stem, blocks and head cover all of them
    for name in outside:
        model.get_submodule(name).enabled = False
    check_unit_coverage(model, blocks)  # a disabled (float) quantizer needs no unit


def test_for_each_call_refuses_a_feed_whose_batch_never_reaches_the_unit():
    # one call of the unit per batch of the feed, or the per-sample statistics would be silently short
    from quant.units import for_each_call

    class Feed:
        def __len__(self):
            return 2

        def run(self, model, index):
            if index == 0:  # the second batch never runs the model
                model(images(1))

    seen = []
    with pytest.raises(RuntimeError, match=r"unit blocks.0 ran 1 times over 2 batches"):
        for_each_call(tiny_vit(), "blocks.0", Feed(), lambda args, out: seen.append(out))
    assert len(seen) == 1


@pytest.mark.parametrize("batch_size, layer_scale", [(8, None), (3, 0.5)])
def test_mlp_reconstruction_loss_clip_and_step_follow_the_recipe(batch_size, layer_scale):
    # reference written out here: x = the fc1 input of the MR model (earlier blocks already tuned), target = the
    # ORIGINAL GELU MLP on it (official utils/mlp_recon.py: block.mlp on fc1's raw input, so LayerScale's gamma
    # and norm2 lie outside), loss = mean(H (relu - t)^2) + w * mean(H (clamp(relu, 0, c) - t)^2) on the batch
    # randperm(N)[:batch_size] (one draw per block from the caller's generator), with H scaled to mean 1 and c the
    # p-th percentile (torch.quantile) of the positive GELU fc2 inputs of the first calib_count images; one Adam
    # step moves every fc1 / fc2 parameter by about lr, and norm2 (listed officially, without a gradient) not
    import torch.nn.functional as F
    from quant.aphq.mlp_recon import MLPReconSettings, reconstruct_mlps
    fp = perturb_norms(tiny_vit(init_values=layer_scale))
    mr = copy.deepcopy(fp)
    x_img, calib_count, p, lr, w_clip = images(8), 3, 0.9, 1e-2, 1.5
    g = torch.Generator().manual_seed(3)
    h_weights = {f"blocks.{i}.mlp": torch.rand(1, 17, 48, generator=g) + 0.5 for i in range(2)}
    settings = MLPReconSettings(iters=1, batch_size=batch_size, lr=lr, clip_percentile=p, clip_weight=w_clip,
                                log_every=0)
    draws = torch.Generator().manual_seed(0)
    stats = reconstruct_mlps(fp, mr, x_img, calib_count, h_weights.__getitem__, settings,
                             torch.Generator().manual_seed(0))

    def fc1_input(model, i):
        seen = []
        handle = model.blocks[i].mlp.fc1.register_forward_hook(lambda m, a, o: seen.append(a[0].detach()))
        with torch.no_grad():
            model(x_img)
        handle.remove()
        return seen[0]

    for i, row in enumerate(stats):
        block = fp.blocks[i]  # the MR block's weights before its one step are the original ones
        x = fc1_input(mr, i)  # block i's own tuning does not change its fc1 input (norm2 is not tuned)
        batch = torch.randperm(8, generator=draws)[:batch_size]
        with torch.no_grad():
            pre = F.linear(x, block.mlp.fc1.weight, block.mlp.fc1.bias)
            gelu_calib = F.gelu(pre[:calib_count])
            c = torch.quantile(gelu_calib[gelu_calib > 0].double(), p).float()
            pre = pre[batch]
            target = F.linear(F.gelu(pre), block.mlp.fc2.weight, block.mlp.fc2.bias)
            relu = F.linear(pre.clamp(min=0), block.mlp.fc2.weight, block.mlp.fc2.bias)
            clamped = F.linear(pre.clamp(min=0).clamp(max=c), block.mlp.fc2.weight, block.mlp.fc2.bias)
            h = h_weights[f"{row['unit']}.mlp"] / h_weights[f"{row['unit']}.mlp"].mean()  # the MLP output's APH
            want = (h * (relu - target) ** 2).mean() + w_clip * (h * (clamped - target) ** 2).mean()
        assert row["unit"] == f"blocks.{i}"
        assert row["clip"] == pytest.approx(float(c), rel=1e-5)
        assert row["loss_first"] == pytest.approx(float(want), rel=1e-4)
        for name in ("mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias"):
            step = (mr.blocks[i].get_parameter(name) - block.get_parameter(name)).abs().detach()
            assert float(step.max()) == pytest.approx(lr, rel=0.05), name  # Adam's first step: lr * sign(grad)
        for name in ("norm2.weight", "norm2.bias", "attn.qkv.weight"):  # only fc1 and fc2 are tuned
            assert torch.equal(mr.blocks[i].get_parameter(name), block.get_parameter(name)), name


def test_per_channel_post_norm_fit_minimises_each_channels_activation_mse():
    # reference: for every channel separately, the grid candidate with the smallest mean squared
    # fake-quantization error of that channel's values (a plain loop over the candidates)
    from quant.aphq.search import fit_per_channel
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 150, 5, generator=g) * torch.tensor([0.3, 1.0, 4.0, 0.1, 2.0]) + torch.tensor(
        [0.0, 1.0, -2.0, 0.5, 0.0])
    x[0, :2] *= 6.0  # a few outliers per channel: the MSE clips them, the widest range is not the best
    q = UniformQuantizer(4, channel_dim=-1, num_channels=5)
    fit_per_channel(q, x, (0.9, 1.0), 64)
    rows = x.reshape(-1, 5).t()
    scales, zps = range_grid(rows, q, (0.9, 1.0), 64)

    def mse(c, s, z):
        return float(((torch.clamp(torch.round(rows[c] / s) + z, 0, 15) - z) * s - rows[c]).pow(2).mean())

    for c in range(5):
        best = min(mse(c, scales[k, c], zps[k, c]) for k in range(scales.shape[0]))
        assert mse(c, q.scale[c], q.zero_point[c]) == pytest.approx(best, rel=1e-6, abs=1e-12), c


def aphq_converted(model, bits="w4a4", **options):
    """A model converted to the APHQ layout (post-LN inputs per channel), its units and the options."""
    from configs.quant import APHQOptions
    from quant.convert import quantize_model
    from quant.spec import parse_bits
    opts = APHQOptions(**options)
    qmodel = quantize_model(model, PIPELINES["aphq"].layout(parse_bits(bits), opts))
    return qmodel, find_units(qmodel), opts


def search_settings(**kw):
    from quant.aphq.calibration import SearchSettings
    base = dict(rounds=2, weight_pct=(0.91, 0.99), act_pct=(0.93, 0.98), eq_n=48, matmul_pct=(0.97, 0.995),
                matmul_steps=7, max_rows=50, round_zero_point=True, batch_size=4)
    return SearchSettings(**{**base, **kw})


def spied_calibration(monkeypatch, model, units, x, settings, generator=None):
    """calibrate_aphq(model, units, x, settings) with the arguments of every search it calls recorded:
    ({kind: [(args, kwargs)]}, its report)."""
    import quant.aphq.calibration as cal
    calls = {"linear": [], "matmul": [], "fit": [], "fold": [], "stem": [], "conv_self": []}

    def spy(kind, fn):
        def wrapped(*args, **kwargs):
            calls[kind].append((args, kwargs))
            return fn(*args, **kwargs)
        return wrapped

    for kind, name in (("linear", "search_linear"), ("matmul", "search_matmul"), ("fit", "fit_per_channel"),
                       ("fold", "fold_layernorm"), ("stem", "search_stem"), ("conv_self", "search_conv_self")):
        monkeypatch.setattr(cal, name, spy(kind, getattr(cal, name)))
    return calls, cal.calibrate_aphq(model, units, x, settings, generator=generator)


def test_calibration_passes_every_search_setting_to_every_search(monkeypatch):
    # each search of calibrate_aphq must run with the settings it was given (asked is what runs)
    model, units, _ = aphq_converted(tiny_vit())
    settings = search_settings(round_zero_point=False)  # RepQ-ViT's choice, not the default
    gen = torch.Generator().manual_seed(0)
    calls, _ = spied_calibration(monkeypatch, model, units, images(4), settings, gen)
    assert all(kw["generator"] is gen for _, kw in calls["linear"])  # max_rows draws from the caller's generator
    assert len(calls["linear"]) == 2 * 4 + 1 and len(calls["matmul"]) == 2 * 2 and len(calls["stem"]) == 1
    for _, kw in calls["linear"]:
        assert (kw["rounds"], kw["weight_pct"], kw["act_pct"], kw["eq_n"], kw["max_rows"]) == (
            2, (0.91, 0.99), (0.93, 0.98), 48, 50)
    for _, kw in calls["matmul"]:
        assert (kw["pct"], kw["steps"], kw["rounds"]) == ((0.97, 0.995), 7, 2)
    assert len(calls["fit"]) == 2 * 2 and all(a[2] == (0.93, 0.98) and kw["eq_n"] == 48 for a, kw in calls["fit"])
    assert [kw["round_zero_point"] for _, kw in calls["fold"]] == [False] * 4
    assert all(a[2] == 48 for a, _ in calls["stem"])
    # q @ k^T pairs q with k, attn @ v pairs attn with v
    for (qa, qb, *_), _ in calls["matmul"]:
        assert (qa.name.rsplit(".", 1)[-1], qb.name.rsplit(".", 1)[-1]) in (("q_quant", "k_quant"),
                                                                            ("attn_quant", "v_quant"))


def test_calibration_searches_every_batch_and_each_matmul_on_its_own_product(monkeypatch):
    # images in batches of 2: every search sees the operands of all 4 images (reference: the float model's own
    # q, k, attn, v and layer inputs, hooked here); q @ k^T and attn @ v are the products scored; a quantized
    # stem input (stem_a_bits=4) makes the stem an ordinary output-MSE search (search_stem is for a float input)
    from quant.modes import set_quant_state
    model, units, _ = aphq_converted(tiny_vit(), stem_a_bits=4)
    x = images(4)
    seen = {}

    def keep(name):
        return lambda m, args: seen.setdefault(name, []).append(args[0].detach())

    targets = {"blocks.0.attn.q_quant": "q", "blocks.0.attn.k_quant": "k", "blocks.0.attn.attn_quant": "attn",
               "blocks.0.attn.v_quant": "v", "blocks.0.mlp.fc2": "fc2"}
    float_copy = copy.deepcopy(model)
    set_quant_state(float_copy, weights=False, activations=False)  # the float operands
    handles = [float_copy.get_submodule(n).register_forward_pre_hook(keep(k)) for n, k in targets.items()]
    with torch.no_grad():
        float_copy(x)
    for h in handles:
        h.remove()
    calls, report = spied_calibration(monkeypatch, model, units, x, search_settings(batch_size=2))
    assert len(calls["stem"]) == 0 and len(calls["linear"]) == 2 * 4 + 2 and report["layers"] == 10
    (qa, qb, a, b, fn), _ = calls["matmul"][0]  # blocks.0: q @ k^T first, then attn @ v
    torch.testing.assert_close((a, b), (seen["q"][0], seen["k"][0]))
    torch.testing.assert_close(fn(a, b), a @ b.transpose(-2, -1))
    (qa, qb, a, b, fn), _ = calls["matmul"][1]
    torch.testing.assert_close((a, b), (seen["attn"][0], seen["v"][0]))
    torch.testing.assert_close(fn(a, b), a @ b)
    fc2 = [args for args, _ in calls["linear"] if args[0] is model.blocks[0].mlp.fc2]
    assert len(fc2) == 1
    torch.testing.assert_close(fc2[0][1], seen["fc2"][0])
    fits = [args for args, _ in calls["fit"]]
    assert all(args[1].shape[0] == 4 for args in fits)  # the per-channel post-LayerNorm fits too


def test_calibration_with_the_detection_convolution_search(monkeypatch):
    # conv_search="self" sends convolutions (only) to search_conv_self with the weight and input percentiles as
    # given; every Linear keeps the output-MSE search; every searched quantizer is labelled in the report
    from quant.modes import named_quantizers
    model, units, _ = aphq_converted(tiny_vit(), stem_a_bits=4)
    settings = search_settings(conv_search="self")
    calls, report = spied_calibration(monkeypatch, model, units, images(4), settings)
    assert [args[0] for args, _ in calls["conv_self"]] == [model.patch_embed.proj]
    (_, inputs), kw = calls["conv_self"][0]
    assert (kw["weight_pct"], kw["act_pct"], kw["eq_n"]) == ((0.91, 0.99), (0.93, 0.98), 48)
    assert len(calls["linear"]) == 2 * 4 + 1 and report["layers"] == 10
    assert all(q.search_label == "output-MSE search" for _, q in named_quantizers(model) if q.calibrated)


def test_calibration_refuses_to_leave_a_quantizer_unsearched():
    from quant.aphq.calibration import calibrate_aphq
    model, units, _ = aphq_converted(tiny_vit())
    blocks = [u for u in units if u.kind == "block"]
    with pytest.raises(RuntimeError, match=r"quantizers were not reached by the APHQ search: \['patch_embed"):
        calibrate_aphq(model, blocks, images(4), search_settings())
    model, units, _ = aphq_converted(tiny_vit())
    model.blocks[1].attn.k_quant = None  # a layout that leaves one matmul operand float
    with pytest.raises(ValueError, match=r"blocks.1.attn: APHQ quantizes both operands of both matmuls"):
        calibrate_aphq(model, units, images(4), search_settings())


def test_a_unit_holds_its_own_modules_not_those_of_a_unit_whose_name_extends_it():
    # blocks.1 must not claim blocks.10 / blocks.11 (ViT-B has 12 blocks): their folds would run too early
    from quant.aphq.calibration import _in_unit
    from quant.units import Unit
    unit = Unit("blocks.1", "block")
    assert _in_unit("blocks.1", unit) and _in_unit("blocks.1.attn.qkv", unit)
    assert not _in_unit("blocks.10.attn.qkv", unit) and not _in_unit("blocks.11", unit)


def run_aphq_spied(monkeypatch, **options):
    """The APHQ pipeline on a tiny ViT with its calibration, Hessian and reconstruction calls recorded."""
    import quant.aphq.pipeline as pipe
    from quant.pipeline_data import PipelineData
    calls = {"calib": [], "hessian": [], "recon": [], "mr": []}

    def spy(kind, fn):
        def wrapped(*args, **kwargs):
            calls[kind].append((args, kwargs))
            return fn(*args, **kwargs)
        return wrapped

    for kind, name in (("calib", "calibrate_aphq"), ("hessian", "perturbation_hessian"),
                       ("recon", "reconstruct_unit"), ("mr", "reconstruct_mlps")):
        monkeypatch.setattr(pipe, name, spy(kind, getattr(pipe, name)))
    pool = images(12, seed=7)
    draws = calls.setdefault("data", [])
    data = PipelineData(train_images=lambda n, seed, train: draws.append((n, seed, train)) or pool[:n])
    model = tiny_vit()
    opts = dict(iters=2, recon_images=8, calib_images=4, batch_size=4, matmul_steps=5, search_rounds=0, eq_n=32,
                log_every=0, **options)
    qmodel, _ = PIPELINES["aphq"](model, None, "w4a4", opts, data=data)
    return model, qmodel, pool, calls


def unit_io(model, unit, x):
    """(input, output) of submodule `unit` of `model` on x (hooks, no grad)."""
    seen = {}

    def hook(_m, args, out):
        seen["in"], seen["out"] = args[0].detach(), out.detach()

    handle = model.get_submodule(unit).register_forward_hook(hook)
    with torch.no_grad():
        model(x)
    handle.remove()
    return seen["in"], seen["out"]


def test_aphq_pipeline_gives_each_stage_what_the_options_ask(monkeypatch):
    fp, qmodel, pool, calls = run_aphq_spied(monkeypatch, warmup=0.3, beta_start=15.0, beta_end=3.0, round_weight=0.02,
                                    drop_prob=0.7, input_mix_prob=0.6, normalize_loss=False, weight_lr=2e-3,
                                    act_lr=3e-5, temperature=7.0)
    from quant.modes import named_quantizers
    (model, units, calib, settings), _ = calls["calib"][0]
    assert torch.equal(calib, pool[:4])  # the calibration set is the first calib_images of the 8
    assert calls["data"] == [(8, 3407, True)]  # recon_images, data_seed, the TRAINING transform
    # every quantizer is on at the end: 12 per block (4 weights, 4 Linear inputs, q, k, attn, v), the stem
    # weight (its image input is float) and the head's weight and input
    assert sorted(q.enabled for _, q in named_quantizers(qmodel)) == [True] * (2 * 12 + 1 + 2)
    names = [u.name for u in units]
    assert names == ["patch_embed", "blocks.0", "blocks.1", "head"]
    recon = [(kw.get("name"), a) for a, kw in calls["recon"]]
    assert [n for n, _ in recon] == names  # module order
    for (name, (module, fp_in, q_in, fp_out, weight, loss, st, gen)), unit in zip(recon, units):
        assert (st.iters, st.batch_size, st.weight_lr, st.act_lr, st.drop_prob, st.input_mix_prob,
                st.normalize_loss) == (2, 4, 2e-3, 3e-5, 0.7, 0.6, False)
        r = st.rounding
        assert (r.iters, r.warmup, r.beta_start, r.beta_end, r.weight) == (2, 0.3, 15.0, 3.0, 0.02)
        assert loss == ("kl" if unit.kind == "head" else "weighted_mse")
        assert (weight is None) == (unit.kind == "head")
    hess = [(a[1], a[4], a[5], a[6], a[7]) for a, kw in calls["hessian"]]  # unit, batch, T, eps, probe
    assert hess == [(n, 4, 7.0, 1e-6, "ones") for n in names[:-1]]
    assert all(torch.equal(a[2], pool[:8]) for a, _ in calls["hessian"])  # over the reconstruction set
    # blocks.1: target = float block on float input; the other input = the quantized prefix's output
    _, fp_in, q_in, fp_out, *_ = calls["recon"][2][0]
    fp_block_in, fp_block_out = unit_io(fp, "blocks.1", pool[:8])
    torch.testing.assert_close(fp_in, fp_block_in)
    torch.testing.assert_close(fp_out, fp_block_out)
    q_block_in, _ = unit_io(qmodel, "blocks.1", pool[:8])
    torch.testing.assert_close(q_in, q_block_in)
    assert not torch.allclose(q_in, fp_block_in, atol=1e-3)


def test_aphq_pipeline_mse_loss_rademacher_eps_and_mlp_options(monkeypatch):
    fp, _, pool, calls = run_aphq_spied(monkeypatch, loss="mse", hessian_probe="rademacher", mlp_reconstruct=True,
                                 mlp_iters=3, mlp_lr=1e-3, mlp_clip_percentile=0.95, mlp_clip_weight=1.5)
    assert all(a[4] is None for a, _ in calls["recon"])  # plain MSE: no APH weight in reconstruction
    # the APH weights MR asks for: Hutchinson probe with its own default eps
    assert [(a[6], a[7]) for a, _ in calls["hessian"]] == [(1e-4, "rademacher")] * 2
    (fp, mr_model, imgs, calib_count, _, st, _), _ = calls["mr"][0]
    assert (calib_count, st.iters, st.lr, st.clip_percentile, st.clip_weight) == (4, 3, 1e-3, 0.95, 1.5)
    _, _, _, fp_out, *_ = calls["recon"][1][0]  # blocks.0: the target stays the ORIGINAL (GELU) block's
    torch.testing.assert_close(fp_out, unit_io(fp, "blocks.0", pool[:8])[1])


def test_aphq_pipeline_mlp_iters_none_follows_iters(monkeypatch):
    _, _, _, calls = run_aphq_spied(monkeypatch, mlp_reconstruct=True)  # run_aphq_spied gives iters=2
    (*_, st, _), _ = calls["mr"][0]
    assert st.iters == 2


def test_aphq_at_zero_iterations_calibrates_only_and_equals_zero_iterations_of_reconstruction(monkeypatch):
    """iters=0 computes no float logits, unit captures or APH, and its model is the one that reconstructing
    every unit for 0 iterations gives (the units switched on in order after the calibration)."""
    import quant.aphq.pipeline as pipe
    from configs.quant import APHQOptions
    from quant.aphq.calibration import SearchSettings, calibrate_aphq
    from quant.aphq.reconstruct import ReconSettings, reconstruct_unit
    from quant.convert import quantize_model
    from quant.modes import set_quant_state
    from quant.spec import parse_bits
    from quant.pipeline_data import PipelineData
    skipped = []
    for name in ("model_logits", "capture_unit", "perturbation_hessian", "reconstruct_unit"):
        monkeypatch.setattr(pipe, name, lambda *a, _name=name, **k: skipped.append(_name))
    pool = images(8, seed=7)
    given = dict(iters=0, calib_images=4, batch_size=4, matmul_steps=5, search_rounds=0, eq_n=32)
    fp = tiny_vit()
    qmodel, _ = PIPELINES["aphq"](fp, None, "w4a4", given, data=PipelineData(train_images=lambda n, s, t: pool[:n]))
    assert skipped == []
    # the reference: the same calibration, then 0 iterations of reconstruct_unit on each unit in order
    options = APHQOptions(**given)
    ref = quantize_model(copy.deepcopy(fp), PIPELINES["aphq"].layout(parse_bits("w4a4"), options)).eval()
    ref.requires_grad_(False)
    units = find_units(ref)
    calibrate_aphq(ref, units, pool[:4], SearchSettings(
        rounds=0, weight_pct=options.weight_pct, act_pct=options.act_pct, eq_n=32, matmul_pct=options.matmul_pct,
        matmul_steps=5, max_rows=None, round_zero_point=True, batch_size=4), generator=torch.Generator().manual_seed(0))
    none = torch.empty(0)
    for unit in units:
        module = ref.get_submodule(unit.name)
        set_quant_state(module, weights=True, activations=True)
        reconstruct_unit(module, none, none, none, None, "weighted_mse",
                         ReconSettings(0, 4, 1e-3, 4e-5, 0.5, 0.5, RoundingSchedule(0), True, 0), torch.Generator())
    with torch.no_grad():
        assert torch.equal(qmodel(pool), ref(pool))


def test_aphq_eq_n_limit_counts_the_stem_and_head_bit_widths():
    # by hand: w3a3's grids have 2^3 = 8 zero points, so eq_n = 16 gives each 2 ranges; an 8-bit stem input has
    # min(16, 2^8) = 16 zero points and a 5-bit head weight 16, so either asks for eq_n >= 32 (APHQ's stem input
    # is float by default: 0 bits, no grid)
    from configs.quant import APHQOptions
    from quant.spec import parse_bits
    check = PIPELINES["aphq"].check
    check(parse_bits("w3a3"), APHQOptions(eq_n=16))
    with pytest.raises(ValueError, match=r"eq_n=16 leaves the 8-bit grids at w3a3 fewer than 2 ranges for each of "
                                         r"their 16 zero points \(a degenerate search\): give eq_n >= 32"):
        check(parse_bits("w3a3"), APHQOptions(eq_n=16, stem_a_bits=8))
    with pytest.raises(ValueError, match=r"eq_n=16 leaves the 5-bit grids at w3a3 .* give eq_n >= 32"):
        check(parse_bits("w3a3"), APHQOptions(eq_n=16, head_w_bits=5))


def test_units_of_an_mmdetection_detector_in_module_order():
    """A detector's units by MMDetection's names: its backbone's patch embedding (a stem, as in the official
    APHQ-ViT detection code), blocks, PatchMerging and the FPN neck; its RPN / RoI heads are no unit."""
    def tree(**children):
        module = nn.Module()
        for name, child in children.items():
            module.add_module(name, child)
        return module

    stage = tree(blocks=nn.ModuleList([tree(attn=nn.Linear(4, 4))]), downsample=tree(reduction=nn.Linear(16, 8)))
    detector = tree(backbone=tree(patch_embed=tree(projection=nn.Conv2d(3, 4, 2)), stages=nn.ModuleList([stage])),
                    neck=tree(conv=nn.Conv2d(4, 4, 1)), rpn_head=tree(conv=nn.Conv2d(4, 4, 1)))
    kinds = ("stem", "block", "merge", "head", "neck")
    assert [(u.name, u.kind) for u in find_units(detector, kinds)] == [
        ("backbone.patch_embed", "stem"), ("backbone.stages.0.blocks.0", "block"),
        ("backbone.stages.0.downsample", "merge"), ("neck", "neck")]


def test_a_unit_that_skips_a_batch_of_the_feed_is_refused():
    """for_each_call expects the unit once per batch: a batch whose forward never reaches it would leave that
    sample out of the reconstruction without a word."""
    from quant.units import for_each_call

    class Feed:
        def __len__(self):
            return 2

        def run(self, model, index):
            if index == 0:  # the second batch never reaches the unit
                model.unit(torch.zeros(1, 4))

    model = nn.Module()
    model.unit = nn.Linear(4, 4)
    seen = []
    with pytest.raises(RuntimeError, match="ran 1 times over 2 batches"):
        for_each_call(model, "unit", Feed(), lambda args, out: seen.append(out))
    assert len(seen) == 1


def test_mlp_reconstruction_lr_decays_by_cosine_to_zero_over_its_iterations(monkeypatch):
    # every Adam step records its lr; reference: lr * (1 + cos(pi k / iters)) / 2 at step k, for each block anew
    import math
    from quant.aphq.mlp_recon import MLPReconSettings, reconstruct_mlps
    lrs = []
    original = torch.optim.Adam.step

    def recording_step(self, *args, **kwargs):
        lrs.append(self.param_groups[0]["lr"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", recording_step)
    fp = tiny_vit()
    iters, lr = 3, 1e-3
    settings = MLPReconSettings(iters=iters, batch_size=4, lr=lr, clip_percentile=0.98, clip_weight=2.0, log_every=0)
    reconstruct_mlps(fp, copy.deepcopy(fp), images(4), 2, lambda name: torch.ones(1, 17, 48), settings,
                     torch.Generator().manual_seed(0))
    want = [lr * (1 + math.cos(math.pi * k / iters)) / 2 for k in range(iters)]
    assert lrs == pytest.approx(want * 2)  # two blocks


def test_mlp_reconstruction_two_steps_equal_adam_on_the_loss_written_out_in_float64():
    # reference: the MR loss re-implemented here in float64 on copies of fc1 / fc2 (on fc1's input, as the official
    # utils/mlp_recon.py), two steps of torch.optim.Adam (fresh gradients each step) at the cosine lrs lr, lr / 2;
    # the batch is the whole set, so the random draw only permutes rows and the mean is unchanged
    import math
    import torch.nn.functional as F
    from quant.aphq.mlp_recon import MLPReconSettings, reconstruct_mlps
    fp = perturb_norms(tiny_vit(depth=1))
    mr = copy.deepcopy(fp)
    x_img, calib_count, p, lr, w_clip = images(4), 2, 0.9, 1e-2, 1.5
    h = torch.rand(1, 17, 48, generator=torch.Generator().manual_seed(3)) + 0.5
    settings = MLPReconSettings(iters=2, batch_size=4, lr=lr, clip_percentile=p, clip_weight=w_clip, log_every=0)
    reconstruct_mlps(fp, mr, x_img, calib_count, lambda name: h, settings, torch.Generator().manual_seed(0))

    block, names = fp.blocks[0], ("mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias")
    seen = []
    handle = block.mlp.fc1.register_forward_hook(lambda m, a, o: seen.append(a[0].detach().double()))
    with torch.no_grad():
        fp(x_img)
    handle.remove()
    x, hn = seen[0], (h / h.mean()).double()
    w = {n: block.get_parameter(n).detach().double().clone().requires_grad_(True) for n in names}

    def pre_act(x):  # fc1(x)
        return F.linear(x, w["mlp.fc1.weight"], w["mlp.fc1.bias"])

    with torch.no_grad():
        pre = pre_act(x)
        target = F.linear(F.gelu(pre), w["mlp.fc2.weight"], w["mlp.fc2.bias"])
        gelu_calib = F.gelu(pre[:calib_count])
        c = torch.quantile(gelu_calib[gelu_calib > 0], p)
    opt = torch.optim.Adam(w.values(), lr=lr)
    for k in range(2):
        opt.param_groups[0]["lr"] = lr * (1 + math.cos(math.pi * k / 2)) / 2
        relu = pre_act(x).clamp(min=0)
        out = F.linear(relu, w["mlp.fc2.weight"], w["mlp.fc2.bias"])
        clamped = F.linear(relu.clamp(max=c), w["mlp.fc2.weight"], w["mlp.fc2.bias"])
        loss = (hn * (out - target) ** 2).mean() + w_clip * (hn * (clamped - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    for n in names:
        torch.testing.assert_close(mr.blocks[0].get_parameter(n).detach().double(), w[n].detach(), rtol=0,
                                   atol=lr * 1e-3, msg=n)
    assert torch.equal(mr.blocks[0].norm2.weight, block.norm2.weight)  # no gradient reaches it: not trained
    assert torch.equal(mr.blocks[0].norm2.bias, block.norm2.bias)


def test_linear_search_with_max_rows_searches_that_many_random_rows():
    # reference: the same search given, explicitly, the max_rows rows randperm(n)[:max_rows] of a generator seeded
    # as the caller's; a row more or less changes the chosen input range on this data
    g = torch.Generator().manual_seed(21)
    x = torch.randn(30, 6, generator=g) * torch.linspace(0.5, 3, 6) + 0.2
    grid = dict(rounds=1, weight_pct=(0.9, 1.0), act_pct=(0.9, 1.0), eq_n=32)
    picked = {}
    for rows in (7, 8):
        for subset in (False, True):
            torch.manual_seed(0)
            layer = QuantLinear.from_float(nn.Linear(6, 4, bias=False),
                                           UniformQuantizer(4, channel_dim=0, num_channels=4), UniformQuantizer(4))
            if subset:
                search_linear(layer, x[torch.randperm(30, generator=torch.Generator().manual_seed(1))[:rows]], **grid)
            else:
                search_linear(layer, x, max_rows=rows, generator=torch.Generator().manual_seed(1), **grid)
            q = layer.input_quantizer
            picked[rows, subset] = (q.scale.clone(), q.zero_point.clone())
        assert all(torch.equal(a, b) for a, b in zip(picked[rows, False], picked[rows, True])), rows
    assert not all(torch.equal(a, b) for a, b in zip(picked[7, True], picked[8, True]))  # the test can tell


def test_calibration_folds_no_layernorm_when_activation_and_weight_bits_differ():
    # the layout makes post-LayerNorm inputs per tensor at a_bits != w_bits (official: no RepQ fold there), so
    # the search must leave every LayerNorm as it was and fold nothing
    from quant.aphq.calibration import calibrate_aphq
    model, units, _ = aphq_converted(tiny_vit(), "w4a3")
    norms = {n: (m.weight.clone(), m.bias.clone()) for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}
    report = calibrate_aphq(model, units, images(4), search_settings(), generator=torch.Generator().manual_seed(0))
    assert report["folded"] == []
    for n, m in model.named_modules():
        if n in norms:
            assert torch.equal(m.weight, norms[n][0]) and torch.equal(m.bias, norms[n][1]), n


def test_module_input_captures_pool_every_batch_and_refuse_a_module_off_the_forward_path():
    """capture_module_inputs over 5 images in batches of 2: the inputs of all 5 in order (fc1's input, computed
    here directly from the block); a watched module that the forward never reaches (stopped at blocks.0) is
    named in a RuntimeError."""
    from quant.units import capture_module_inputs
    model, x = tiny_vit(depth=2), images(5)
    block = model.blocks[0]
    got = capture_module_inputs(model, {"fc1": block.mlp.fc1}, "blocks.0", x, batch_size=2)["fc1"]
    with torch.no_grad():
        tokens = model.norm_pre(model._pos_embed(model.patch_embed(x)))
        h = tokens + block.ls1(block.attn(block.norm1(tokens)))
        want = block.norm2(h)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"modules saw no input before blocks.0 finished: \['later'\]"):
        capture_module_inputs(model, {"fc1": block.mlp.fc1, "later": model.blocks[1].mlp.fc1}, "blocks.0", x, 2)


def test_candidate_grid_refuses_a_symmetric_quantizer_and_an_eq_n_below_its_zero_points():
    # the grid's zero points 0..2^b - 1 are those of an asymmetric code; eq_n = 8 at 4 bits would leave no scale
    # per zero point (an empty grid, then an IndexError deep in the search): both refused with the quantity named
    rows = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sym = UniformQuantizer(4, symmetric=True, channel_dim=0, num_channels=3)
    sym.name = "blocks.0.attn.qkv.weight_quantizer"
    with pytest.raises(ValueError, match=r"blocks.0.attn.qkv.weight_quantizer: the APHQ grid is for asymmetric"):
        range_grid(rows, sym, (0.9, 1.0), 128)
    asym = UniformQuantizer(4, channel_dim=0, num_channels=3)
    with pytest.raises(ValueError, match=r"eq_n=8 is below the 16 zero points of a 4-bit grid"):
        range_grid(rows, asym, (0.9, 1.0), 8)
    assert range_grid(rows, asym, (0.9, 1.0), 16)[0].shape == (16, 3)  # one scale per zero point is enough


def test_linear_search_refuses_a_per_channel_input_quantizer_and_leaves_it_as_it_was():
    # the output-MSE input search chooses ONE range for the whole input: a per-channel input quantizer would be
    # silently resized to one group; refused by name before any quantizer is set
    layer = QuantLinear.from_float(nn.Linear(6, 4), UniformQuantizer(4, channel_dim=0, num_channels=4),
                                   UniformQuantizer(4, channel_dim=-1, num_channels=6))
    layer.input_quantizer.name = "blocks.0.mlp.fc1.input_quantizer"
    before = layer.input_quantizer.scale.clone()
    with pytest.raises(ValueError, match=r"blocks.0.mlp.fc1.input_quantizer: the output-MSE input search is per"):
        search_linear(layer, torch.randn(20, 6), rounds=1, weight_pct=(0.9, 1.0), act_pct=(0.9, 1.0), eq_n=32)
    assert layer.input_quantizer.scale.shape == (6,) and torch.equal(layer.input_quantizer.scale, before)
    assert not layer.weight_quantizer.calibrated


def test_hessian_refuses_an_unknown_probe_by_name():
    # any probe other than "ones" would otherwise silently run as Hutchinson's ("rademacher")
    model = tiny_vit()
    x = images(2)
    with pytest.raises(ValueError, match=r"unknown Hessian probe 'hutchinson'"):
        perturbation_hessian(model, "blocks.0", x, model_logits(model, x, 2), batch_size=2, probe="hutchinson")


def test_unit_coverage_does_not_let_blocks_1_cover_blocks_10():
    # a ViT-B has blocks.0 .. blocks.11: with blocks.10 missing from the units, its quantizer lies outside every unit
    # even though its name starts with "blocks.1"
    from quant.units import Unit, check_unit_coverage
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Module() for _ in range(12)])
    for block in model.blocks:
        block.q = UniformQuantizer(4)
    units = [Unit(f"blocks.{i}", "block") for i in range(12) if i != 10]
    with pytest.raises(ValueError, match=r"1 quantizers lie outside every reconstruction unit: \['blocks.10.q'\]"):
        check_unit_coverage(model, units)
    check_unit_coverage(model, units + [Unit("blocks.10", "block")])


def test_map_tensors_keeps_list_and_tuple_types_and_non_tensors():
    # an FPN's list of levels stays a list, (x, hw_shape) a tuple, and non-tensors pass through untouched
    from quant.units import map_tensors
    t = torch.ones(2)
    got = map_tensors([t, (t, (3, 4)), "name"], lambda x: x * 2)
    assert type(got) is list and type(got[1]) is tuple
    assert torch.equal(got[0], torch.full((2,), 2.0)) and torch.equal(got[1][0], torch.full((2,), 2.0))
    assert got[1][1] == (3, 4) and got[2] == "name"


def test_for_each_call_does_not_hand_on_the_consumers_own_calls_of_the_unit():
    # a consumer that runs the unit itself (a reference forward) sees only the feed's calls: one per batch
    from quant.units import for_each_call

    class Feed:
        def __len__(self):
            return 2

        def run(self, model, index):
            model(images(1, seed=index))

    model = tiny_vit()
    seen = []

    def consume(args, out):
        seen.append(out)
        model.blocks[0](args[0])  # the reference forward

    assert for_each_call(model, "blocks.0", Feed(), consume) == 2 and len(seen) == 2
