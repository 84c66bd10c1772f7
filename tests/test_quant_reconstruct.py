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


def first_iteration_reference(unit, q_in, target, idx, drop_prob):
    """The unit's output at iteration 1, written out: AdaRound started at its float init on every weight,
    activation quantizers quantizing (drop_prob 1) or passing their float input (drop_prob 0)."""
    import copy
    ref = copy.deepcopy(unit)
    for layer in (ref[0], ref[2]):
        layer.weight_quantizer.start_rounding(layer.weight)
        if drop_prob == 0.0:
            layer.input_quantizer.enabled = False
    with torch.no_grad():
        return ref(q_in[idx]), target[idx]


@pytest.mark.parametrize("loss_kind, drop_prob, normalize", [("weighted_mse", 1.0, True), ("weighted_mse", 0.0, False),
                                                             ("kl", 1.0, True)])
def test_first_iteration_loss_is_the_recipe_on_the_quantized_prefix_input(loss_kind, drop_prob, normalize):
    # reference written out: batch = randperm(n)[:batch_size] of a generator seeded as the caller's; input = the
    # quantized-prefix input (input_mix_prob 1); rec = mean((O^ - O)^2 * H / mean(H)) or KL(softmax(O) || softmax(O^))
    # (batchmean), or unnormalised sum over dim 1 of (O^ - O)^2 * H / mean(H), mean, / 10 (the official loss before
    # its normalisation); round = 0.01 * sum(1 - |2 frac(w / s) - 1|^beta) at AdaRound's initial alpha, beta at
    # iteration 1 with warm-up 0 of 5 iterations = 2 + 18 * (1 - 1 / 5);
    # loss = rec / (rec / 2) + round (normalised) or rec + round
    fp, unit, x = two_layer_unit(seed=3)
    q_in = x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    target = fp(x)
    h = torch.rand(1, 8, generator=torch.Generator().manual_seed(4)) * 3 + 0.1  # mean far from 1
    st = settings(5, drop_prob=drop_prob, rounding=RoundingSchedule(5, warmup=0.0), normalize_loss=normalize)
    idx = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:st.batch_size]
    out, tgt = first_iteration_reference(unit, q_in, target, idx, drop_prob)
    if loss_kind == "kl":
        p, log_p, log_q = tgt.softmax(-1), tgt.log_softmax(-1), out.log_softmax(-1)
        rec = float((p * (log_p - log_q)).sum() / st.batch_size)
    else:
        weighted = (out - tgt) ** 2 * (h / h.mean())
        rec = float(weighted.mean() if normalize else weighted.sum(1).mean() / 10)
    beta, reg = 2 + 18 * (1 - 1 / 5), 0.0
    for layer in (unit[0], unit[2]):
        q = layer.weight_quantizer
        w_s = layer.weight / q.scale[:, None]
        reg += float((1 - (2 * (w_s - torch.floor(w_s)) - 1).abs() ** beta).sum())
    logged = []
    reconstruct_unit(unit, x, q_in, target, None if loss_kind == "kl" else h, loss_kind, st,
                     torch.Generator().manual_seed(0), progress=logged.append)
    assert logged[0]["rec"] == pytest.approx(rec, rel=1e-5)
    assert logged[0]["beta"] == pytest.approx(beta) and logged[0]["round"] == pytest.approx(0.01 * reg, rel=1e-4)
    assert logged[0]["loss"] == pytest.approx((2.0 if normalize else rec) + 0.01 * reg, rel=1e-5)


def test_alphas_train_at_weight_lr_and_activation_scales_at_act_lr_with_cosine_decay(monkeypatch):
    # every optimiser step records its parameter groups' lr; reference: AdaRound alphas at weight_lr throughout,
    # activation scales at act_lr * (1 + cos(pi k / iters)) / 2 at step k (cosine to 0 over all iterations)
    import math
    steps = []
    original = torch.optim.Adam.step

    def recording_step(self, *args, **kwargs):
        steps.append([(tuple(p.shape for p in g["params"]), g["lr"]) for g in self.param_groups])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", recording_step)
    fp, unit, x = two_layer_unit(seed=5)
    iters, w_lr, a_lr = 4, 3e-3, 7e-4
    reconstruct_unit(unit, x, x, fp(x), None, "weighted_mse", settings(iters, weight_lr=w_lr, act_lr=a_lr),
                     torch.Generator().manual_seed(0))
    alpha_shapes = ((32, 16), (8, 32))
    scale_shapes = tuple(tuple(q.scale.shape) for _, q in named_quantizers(unit, "activation"))
    alpha_lrs = [lr for call in steps for shapes, lr in call if shapes == alpha_shapes]
    scale_lrs = [lr for call in steps for shapes, lr in call if shapes == scale_shapes]
    assert alpha_lrs == [w_lr] * iters
    assert scale_lrs == pytest.approx([a_lr * (1 + math.cos(math.pi * k / iters)) / 2 for k in range(iters)])


def test_dropout_inside_the_unit_stays_off_when_the_unit_comes_in_training_mode():
    # only the quantizers run in train mode (QDrop): a unit handed over in train mode still runs its dropout in eval
    # mode; reference: the first iteration's output error of the same unit in eval mode, written out as above
    fp, unit, x = two_layer_unit(seed=6)
    unit[1] = nn.Sequential(nn.GELU(), nn.Dropout(0.5))
    target = fp(x)
    st = settings(1, drop_prob=1.0, normalize_loss=False, rounding=RoundingSchedule(1, warmup=1.0))
    idx = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:st.batch_size]
    unit.eval()
    out, tgt = first_iteration_reference(unit, x, target, idx, 1.0)
    unit.train()
    logged = []
    reconstruct_unit(unit, x, x, target, None, "weighted_mse", st, torch.Generator().manual_seed(0),
                     progress=logged.append)
    assert logged[0]["rec"] == pytest.approx(float((out - tgt).pow(2).sum(1).mean() / 10), rel=1e-5)
    assert not unit[1][1].training


def test_a_disabled_weight_quantizer_keeps_its_float_weight_and_a_log_quantizer_is_refused():
    # a layer left in float (weight quantizer disabled) gets no rounding variable and no bake: its weight is the
    # float weight bit for bit afterwards, while the enabled layer's lies on its grid; a non-uniform activation
    # quantizer (no scale to learn) is refused by name
    from quant.quantizers import LogSqrt2Quantizer
    fp, unit, x = two_layer_unit(seed=7)
    unit[2].weight_quantizer.enabled = False
    w_float = unit[2].weight.detach().clone()
    reconstruct_unit(unit, x, x, fp(x), None, "weighted_mse", settings(3), torch.Generator().manual_seed(0))
    assert torch.equal(unit[2].weight, w_float) and unit[2].weight_quantizer.alpha is None
    q = unit[0].weight_quantizer
    codes = unit[0].weight / q.scale[:, None] + q.zero_point[:, None]
    assert torch.allclose(codes, codes.round(), atol=1e-4)

    fp, unit, x = two_layer_unit(seed=7)
    log_q = LogSqrt2Quantizer(4)
    log_q.name = "blocks.0.attn.attn_quant"
    unit[2].input_quantizer = log_q
    with pytest.raises(TypeError, match=r"scale learning needs uniform activation quantizers: "
                                        r"\['blocks.0.attn.attn_quant'\]"):
        reconstruct_unit(unit, x, x, fp(x), None, "weighted_mse", settings(1), torch.Generator().manual_seed(0))
    log_q.enabled = False  # a disabled (float) quantizer has nothing to learn: the unit reconstructs
    reconstruct_unit(unit, x, x, fp(x), None, "weighted_mse", settings(1), torch.Generator().manual_seed(0))


def test_activation_scales_are_learned_and_zero_points_and_weight_scales_are_not():
    # one iteration: Adam's first step moves every parameter with a nonzero gradient by lr (sign of its gradient), so
    # each activation scale moves by act_lr; zero points and weight scales are not learned and stay as calibrated
    fp, unit, x = two_layer_unit(seed=8)
    acts = [q for _, q in named_quantizers(unit, "activation")]
    before = [(q.scale.detach().clone(), q.zero_point.clone()) for q in acts]
    w_before = [unit[i].weight_quantizer.scale.clone() for i in (0, 2)]
    act_lr = 1e-3
    reconstruct_unit(unit, x, x, fp(x), None, "weighted_mse", settings(1, act_lr=act_lr, drop_prob=1.0),
                     torch.Generator().manual_seed(0))
    for q, (s0, z0) in zip(acts, before):
        assert (q.scale.detach() - s0).abs().tolist() == pytest.approx([act_lr] * s0.numel(), rel=1e-3), q.name
        assert torch.equal(q.zero_point, z0)
    for i, s0 in zip((0, 2), w_before):
        assert torch.equal(unit[i].weight_quantizer.scale, s0)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_block_loss_is_the_official_formula_of_each_setting(weighted, normalize):
    """block_loss on random [B, N, C] outputs against loops over every element: normalize_loss=true, the mean of
    (O^ - O)^2 * H (official since commit 73e78a7, then divided by its first value); false, the official loss before
    it, GoatWu/APHQ-ViT ((pred - tgt).pow(2) * grad).sum(1).mean() / 10 (lp_loss's sum(1).mean() / 10 without H):
    per sample and channel the sum over the N tokens, averaged over B and C, divided by 10."""
    from quant.aphq.reconstruct import block_loss
    g = torch.Generator().manual_seed(7)
    out, tgt = torch.randn(3, 5, 4, generator=g, dtype=torch.float64), torch.randn(3, 5, 4, generator=g,
                                                                                  dtype=torch.float64)
    h = torch.rand(1, 5, 4, generator=g, dtype=torch.float64) + 0.5
    h = h / h.mean()
    total = 0.0
    for b in range(3):
        for n in range(5):
            for c in range(4):
                total += (float(out[b, n, c]) - float(tgt[b, n, c])) ** 2 * (float(h[0, n, c]) if weighted else 1.0)
    expected = total / (3 * 5 * 4) if normalize else total / (3 * 4) / 10
    assert float(block_loss(out, tgt, h if weighted else None, normalize)) == pytest.approx(expected, rel=1e-12)
