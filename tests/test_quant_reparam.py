"""RepQ-ViT LayerNorm fold: float function unchanged; with an integer mean zero point, codes unchanged."""
import warnings

import pytest
import torch
from torch import nn

from quant import quantize_model
from quant.calibrate import calibrate
from quant.modes import named_quantizers, set_quant_state
from quant.registry import PIPELINES
from configs.quant import RepQOptions
from quant.reparam import find_fold_sites, fold_layernorm
from quant.spec import Bits
from quant_models import images, perturb_norms, tiny_swin, tiny_vit


def calibrated_repq_copy(build, dtype=torch.float32, bits=Bits(4, 4)):
    model = perturb_norms(build()).to(dtype)
    qmodel = quantize_model(model, PIPELINES["repq"].layout(bits, RepQOptions()))
    calibrate(qmodel, images(8).to(dtype))
    return model, qmodel


def only_post_norm_inputs(qmodel):
    """Enable just the quantizers of LayerNorm outputs (the ones the fold acts on)."""
    set_quant_state(qmodel, weights=False, activations=False)
    for _, _, _, linear in find_fold_sites(qmodel):
        linear.input_quantizer.enabled = True


@pytest.mark.parametrize("build", [tiny_vit, tiny_swin])
def test_fold_leaves_float_outputs_unchanged(build):
    model, qmodel = calibrated_repq_copy(build)
    x = images(4, seed=7)
    set_quant_state(qmodel, weights=False, activations=False)
    sites = find_fold_sites(qmodel)
    for _, norm, _, linear in sites:
        fold_layernorm(norm, linear)
    with torch.no_grad():
        torch.testing.assert_close(qmodel(x), model(x), rtol=0, atol=1e-5)
    folded = {name for name, _, _, _ in sites}
    if build is tiny_swin:
        assert "layers.1.downsample.norm" in folded
        assert qmodel.layers[1].downsample.reduction.bias is not None  # created: timm's reduction has none
    assert "norm" not in folded and "patch_embed.norm" not in folded


@pytest.mark.parametrize("build", [tiny_vit, tiny_swin])
def test_integer_mean_zero_point_gives_identical_codes(build):
    # float64 so that exact ties at .5 cannot flip between the two equivalent expressions
    model, qmodel = calibrated_repq_copy(build, torch.float64)
    only_post_norm_inputs(qmodel)
    x = images(4, seed=8).double()
    site = find_fold_sites(qmodel)[0]
    _, norm, _, linear = site
    probe = torch.randn(2, 17 if build is tiny_vit else 256, norm.normalized_shape[0], dtype=torch.float64)
    with torch.no_grad():
        iq = linear.input_quantizer
        y = norm(probe)
        codes_pc = torch.clamp(torch.round(y / iq.scale) + iq.zero_point, iq.qmin, iq.qmax)
        per_channel_out = qmodel(x)
        for _, n, _, lin in find_fold_sites(qmodel):
            fold_layernorm(n, lin, round_zero_point=True)
        y2 = norm(probe)
        codes_pt = torch.clamp(torch.round(y2 / iq.scale) + iq.zero_point, iq.qmin, iq.qmax)
        assert iq.scale.shape == (1,) and iq.zero_point.item() == round(iq.zero_point.item())
        assert torch.equal(codes_pc, codes_pt)
        torch.testing.assert_close(qmodel(x), per_channel_out, rtol=0, atol=1e-9)


def test_fold_with_a_constant_layernorm_channel_keeps_float_outputs():
    # gamma_c = 0 makes channel c output the constant beta_c: before ranges were widened, its scale
    # collapsed to 1e-8, its zero point to ~1e8 and the fold's mean zero point broke every folded bias
    model = perturb_norms(tiny_vit())
    with torch.no_grad():
        model.blocks[0].norm1.weight[3] = 0.0
        model.blocks[0].norm1.bias[3] = 1.5
    qmodel = quantize_model(model, PIPELINES["repq"].layout(Bits(4, 4), RepQOptions()))
    calibrate(qmodel, images(8))
    set_quant_state(qmodel, weights=False, activations=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "mean zero point" warning either
        for _, norm, _, linear in find_fold_sites(qmodel):
            zero_points = linear.input_quantizer.zero_point
            assert zero_points.abs().max() < 1e3, "a constant channel gave a ~1e8 zero point before the fix"
            fold_layernorm(norm, linear)
    x = images(4, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(qmodel(x), model(x), rtol=0, atol=1e-5)


def test_unrounded_mean_zero_point_is_close_but_not_identical():
    _, qmodel = calibrated_repq_copy(tiny_vit, torch.float64)
    only_post_norm_inputs(qmodel)
    x = images(4, seed=8).double()
    with torch.no_grad():
        before = qmodel(x)
        for _, n, _, lin in find_fold_sites(qmodel):
            fold_layernorm(n, lin, round_zero_point=False)
        after = qmodel(x)
    assert not torch.allclose(after, before, atol=1e-9)
    assert nn.functional.cosine_similarity(after, before).min() > 0.9


def test_pipeline_refits_only_the_folded_weight_quantizers():
    fp = perturb_norms(tiny_vit())
    unfolded, _ = PIPELINES["repq"](fp, images(8), "w4a4", {"reparam": False})
    folded, report = PIPELINES["repq"](fp, images(8), "w4a4")
    assert len(report["folded"]) == 4
    a = dict(named_quantizers(unfolded))
    b = dict(named_quantizers(folded))
    for name, q in b.items():
        if name.endswith(("attn.qkv.weight_quantizer", "mlp.fc1.weight_quantizer")):
            assert not torch.equal(q.scale, a[name].scale)  # re-fitted on the column-rescaled weights
        elif name.endswith(("attn.qkv.input_quantizer", "mlp.fc1.input_quantizer")):
            assert q.channel_dim is None and a[name].channel_dim == -1
        else:  # everything else keeps its first-pass calibration
            for key, t in q.state_dict().items():
                if isinstance(t, torch.Tensor):
                    assert torch.equal(t, a[name].state_dict()[key]), name


def test_fold_rejects_per_tensor_quantizer():
    _, qmodel = calibrated_repq_copy(tiny_vit)
    _, norm, _, linear = find_fold_sites(qmodel)[0]
    fold_layernorm(norm, linear)
    with pytest.raises(ValueError, match="per-channel"):
        fold_layernorm(norm, linear)


def test_sixteen_bit_fold_does_not_warn_but_an_outlying_zero_point_does():
    # a 16-bit quantizer's zero points are legitimately ~2^15 (codes 0..65535): no precision warning
    _, qmodel = calibrated_repq_copy(tiny_vit, bits=Bits(16, 16))
    set_quant_state(qmodel, weights=False, activations=False)
    sites = find_fold_sites(qmodel)
    assert max(lin.input_quantizer.zero_point.abs().max().item() for _, _, _, lin in sites) > 2 ** 12
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _, norm, _, linear in sites:
            fold_layernorm(norm, linear)
    # at 4 bits a mean zero point 2^13 away from the 16 codes is a collapsed channel: warned
    _, qmodel = calibrated_repq_copy(tiny_vit)
    _, norm, _, linear = find_fold_sites(qmodel)[0]
    with torch.no_grad():
        linear.input_quantizer.zero_point.fill_(2.0 ** 13)
    with pytest.warns(RuntimeWarning, match="mean zero point"):
        fold_layernorm(norm, linear)


def test_fold_is_repq_vits_mean_scale_and_zero_point():
    # zkkli/RepQ-ViT: s~ = mean_c s_c, z~ = mean_c z_c, r_c = s_c / s~; gamma' = gamma / r, W' = W r.
    # (The code-equality test above holds for ANY positive s~, so it cannot pin the mean down.)
    _, qmodel = calibrated_repq_copy(tiny_vit, torch.float64)
    _, norm, _, linear = find_fold_sites(qmodel)[0]
    iq = linear.input_quantizer
    s_c, z_c = iq.scale.double().clone(), iq.zero_point.double().clone()
    gamma, weight = norm.weight.detach().clone(), linear.weight.detach().clone()
    assert s_c.std() > 0.1 * s_c.mean()  # the channels really differ
    fold_layernorm(norm, linear)
    s_t = s_c.mean()
    assert iq.scale.item() == pytest.approx(float(s_t), rel=1e-6)
    assert iq.zero_point.item() == pytest.approx(float(z_c.mean()), rel=1e-6)
    r = s_c / s_t
    torch.testing.assert_close(norm.weight.detach(), gamma / r, rtol=1e-6, atol=0)
    torch.testing.assert_close(linear.weight.detach(), weight * r, rtol=1e-6, atol=0)


@pytest.mark.parametrize("round_zero_point", [True, False])
def test_pipeline_honours_round_zero_point_and_quantizes_weights_per_output_channel(round_zero_point):
    qmodel, report = PIPELINES["repq"](perturb_norms(tiny_vit()), images(8), "w4a4",
                                       {"round_zero_point": round_zero_point})
    folded = [name for name, _ in named_quantizers(qmodel)
              if name.endswith(("attn.qkv.input_quantizer", "mlp.fc1.input_quantizer"))]
    quantizers = dict(named_quantizers(qmodel))
    zero_points = torch.cat([quantizers[name].zero_point for name in folded])
    assert len(folded) == len(report["folded"]) == 4
    assert torch.equal(zero_points, zero_points.round()) == round_zero_point  # RepQ-ViT's own fold: fractional
    for name, q in quantizers.items():
        if name.endswith("weight_quantizer") and not name.startswith(("patch_embed", "head")):
            layer = qmodel.get_submodule(name.rsplit(".", 1)[0])
            assert q.channel_dim == 0 and q.scale.numel() == layer.weight.shape[0], name


@pytest.mark.parametrize("trainable", [False, True])
def test_fold_into_a_bias_free_linear_creates_a_bias_as_trainable_as_the_weight(trainable):
    # Swin's PatchMerging reduction has no bias; the fold creates one (W' b). A frozen model must stay frozen:
    # a new bias that requires grad would be trained by whatever collects the trainable parameters afterwards
    from quant.layers import QuantLinear
    from quant.quantizers import UniformQuantizer
    torch.manual_seed(0)
    norm = perturb_norms(nn.LayerNorm(8)).double()
    linear = QuantLinear(8, 3, bias=False, input_quantizer=UniformQuantizer(4, channel_dim=-1)).double()
    linear.weight.requires_grad_(trainable)
    x = torch.randn(5, 7, 8, dtype=torch.float64) * torch.linspace(0.5, 4.0, 8, dtype=torch.float64)
    with torch.no_grad():
        want = norm(x) @ linear.weight.T  # the float function before the fold
        linear.input_quantizer.calibrating = True
        linear.input_quantizer(norm(x))
        linear.input_quantizer.calibrating = False
        fold_layernorm(norm, linear)
        linear.input_quantizer.enabled = False
        torch.testing.assert_close(linear(norm(x)), want, rtol=1e-9, atol=1e-9)
    assert linear.bias is not None and linear.bias.requires_grad == trainable


@pytest.mark.parametrize("norm", [nn.LayerNorm(8, bias=False), nn.LayerNorm(8, elementwise_affine=False),
                                  nn.RMSNorm(8)], ids=["no-bias", "no-affine", "rmsnorm"])
def test_fold_refuses_a_norm_without_weight_and_bias(norm):
    # the fold's shift b lives in the norm's bias: without one, migrate_scales would scale the weight and
    # silently drop b (a wrong float function), so anything but an affine LayerNorm is refused up front
    from quant.layers import QuantLinear
    from quant.quantizers import UniformQuantizer
    linear = QuantLinear(8, 3, input_quantizer=UniformQuantizer(4, channel_dim=-1))
    linear.input_quantizer.calibrating = True
    linear.input_quantizer(torch.randn(4, 8))
    linear.input_quantizer.calibrating = False
    weight = linear.weight.detach().clone()
    with pytest.raises(TypeError, match="affine LayerNorm"):
        fold_layernorm(norm, linear)
    assert torch.equal(linear.weight.detach(), weight)  # refused before anything changed


def test_fold_refuses_an_uncalibrated_input_quantizer():
    # an uncalibrated quantizer holds placeholder ranges (scale 1, zero point 0): folding them would rescale
    # nothing and freeze a per-tensor range no data ever chose
    from quant.layers import QuantLinear
    from quant.quantizers import UniformQuantizer
    norm = perturb_norms(nn.LayerNorm(8))
    linear = QuantLinear(8, 3, input_quantizer=UniformQuantizer(4, channel_dim=-1, num_channels=8))
    gamma = norm.weight.detach().clone()
    with pytest.raises(ValueError, match="calibrated per-channel"):
        fold_layernorm(norm, linear)
    assert torch.equal(norm.weight.detach(), gamma) and linear.input_quantizer.channel_dim == -1


def test_fold_refuses_a_quantizer_grouped_along_another_dim_than_the_channels():
    # a per-row (channel_dim=0) input quantizer of a [C, C] input has C scales, as many as the LayerNorm's
    # channels, but they belong to tokens: folding them into the channels would be silently wrong
    from quant.layers import QuantLinear
    from quant.quantizers import UniformQuantizer
    norm = perturb_norms(nn.LayerNorm(8))
    linear = QuantLinear(8, 3, input_quantizer=UniformQuantizer(4, channel_dim=0))
    linear.input_quantizer.calibrating = True
    linear.input_quantizer(torch.randn(8, 8) * torch.linspace(0.5, 4.0, 8))
    linear.input_quantizer.calibrating = False
    assert linear.input_quantizer.scale.numel() == 8
    gamma = norm.weight.detach().clone()
    with pytest.raises(ValueError, match="per-channel"):
        fold_layernorm(norm, linear)
    assert torch.equal(norm.weight.detach(), gamma) and linear.input_quantizer.channel_dim == 0


def per_channel_fold_site(seed: int, out_features: int):
    """A float64 LayerNorm(12) (perturbed affine) feeding a QuantLinear whose 4-bit input quantizer is calibrated
    per channel on its output for inputs x of 12 channels of different spreads, not yet folded: (norm, linear, x)."""
    from quant.layers import QuantLinear
    from quant.quantizers import UniformQuantizer
    torch.manual_seed(seed)
    norm = perturb_norms(nn.LayerNorm(12)).double()
    linear = QuantLinear(12, out_features, input_quantizer=UniformQuantizer(4, channel_dim=-1)).double()
    x = torch.randn(6, 7, 12, dtype=torch.float64) * torch.linspace(0.5, 4.0, 12, dtype=torch.float64) + 0.3
    iq = linear.input_quantizer
    with torch.no_grad():
        iq.calibrating = True
        iq(norm(x))
        iq.calibrating = False
    return norm, linear, x


@pytest.mark.parametrize("round_zero_point", [True, False])
def test_fold_is_computed_with_the_scale_and_zero_point_the_quantizer_keeps(round_zero_point):
    # A half-precision quantizer stores s~ and z~ rounded to float16. The fold must use exactly those stored
    # values; with the float64 means instead, gamma', beta' and the bias would miss the stored grid by ~1e-4.
    # 12 channels: a mean of 12 integer zero points is in general no float16 (nor float32) number.
    # Reference: the fold formulas (module docstring) in float64 from the quantizer's stored parameters.
    norm, linear, x = per_channel_fold_site(seed=2, out_features=3)
    iq = linear.input_quantizer
    iq.half()
    s_c, z_c = iq.scale.double(), iq.zero_point.double()
    assert z_c.mean() != z_c.mean().half().double()  # else the unrounded case could not tell the two apart
    gamma, beta = norm.weight.detach().clone(), norm.bias.detach().clone()
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    fold_layernorm(norm, linear, round_zero_point=round_zero_point)
    assert iq.scale.dtype == torch.float16 and iq.scale.shape == (1,)
    s_t, z_t = iq.scale.double(), iq.zero_point.double()  # as stored
    r = s_c / s_t
    b = s_t * (z_t - z_c)
    exact = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(norm.weight.detach(), gamma / r, **exact)
    torch.testing.assert_close(norm.bias.detach(), beta / r - b, **exact)
    torch.testing.assert_close(linear.weight.detach(), weight * r, **exact)
    torch.testing.assert_close(linear.bias.detach(), bias + (weight * r) @ b, **exact)


def test_a_mean_zero_point_far_below_the_codes_warns_too():
    # an all-positive channel far from 0 has a large NEGATIVE zero point (round(-lo / s)); the precision
    # warning is about |z~|, so it must fire on either side
    _, qmodel = calibrated_repq_copy(tiny_vit)
    _, norm, _, linear = find_fold_sites(qmodel)[0]
    with torch.no_grad():
        linear.input_quantizer.zero_point.fill_(-2.0 ** 13)
    with pytest.warns(RuntimeWarning, match="mean zero point"):
        fold_layernorm(norm, linear)


@pytest.mark.parametrize("round_zero_point", [True, False])
def test_folded_layer_equals_the_by_hand_repq_fold_of_a_per_channel_quantized_linear(round_zero_point):
    # Reference by hand in float64 (no quantizer call): LayerNorm y, per-channel 4-bit codes
    # clamp(round(y / s_c) + z_c, 0, 15), and RepQ-ViT's fold (module docstring): y' = y / r - b quantized
    # per tensor with (s~, z~), times W' = W r, plus bias + W' b. With z~ an integer this is exactly the
    # per-channel quantized linear; unrounded, the per-tensor grid is shifted by frac(z~).
    norm, linear, x = per_channel_fold_site(seed=4, out_features=5)
    iq = linear.input_quantizer
    s_c, z_c = iq.scale.detach().double().clone(), iq.zero_point.detach().double().clone()
    gamma, beta = norm.weight.detach().clone(), norm.bias.detach().clone()
    w, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    y = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + norm.eps) * gamma + beta
    per_channel = ((torch.clamp(torch.round(y / s_c) + z_c, 0, 15) - z_c) * s_c) @ w.T + bias

    s_t = s_c.mean()
    z_t = z_c.mean().round() if round_zero_point else z_c.mean()
    r, b = s_c / s_t, s_t * (z_t - z_c)
    y_folded = y / r - b
    by_hand = (((torch.clamp(torch.round(y_folded / s_t) + z_t, 0, 15) - z_t) * s_t) @ (w * r).T
               + bias + (w * r) @ b)

    fold_layernorm(norm, linear, round_zero_point=round_zero_point)
    with torch.no_grad():
        got = linear(norm(x))
        iq.enabled = False
        torch.testing.assert_close(linear(norm(x)), y @ w.T + bias, rtol=0, atol=1e-12)  # float function kept
    torch.testing.assert_close(got, by_hand, rtol=0, atol=1e-10)
    if round_zero_point:
        torch.testing.assert_close(got, per_channel, rtol=0, atol=1e-10)
    else:
        assert (got - per_channel).abs().max() > 1e-3  # a fractional z~ moves the grid: not the same codes
