"""APHQ's detector parts (quant/aphq/detector.py and what it uses) against independent transcriptions of
GoatWu/APHQ-ViT `Object-Detection/tools`, on a toy detector in plain torch (no MMDetection needed):

* the APH weight of a backbone unit (`detector_hessians`) against the official mechanism: a block forward
  that adds +-1e-3, a full backward hook reading grad_output, the RPN loss written out as the official code;
* the convolution search (`search_conv_self`) against the official candidate grid and self-MSE, by loops;
* per-image reconstruction (`reconstruct_unit_calls`): its first loss is the official formula, and a
  batch above 1 is refused;
* per-image captures (`capture_unit_calls`) keep each image's shape, the unit's extra arguments and every tensor
  of a structured output; a unit that some image never reaches is refused;
* `quantize_detector` hands each unit the options' reconstruction settings and the float RPN references, and
  switches the calibrated-only heads on at the end; it refuses a calibration batch it cannot use; at iters=0 it
  calibrates only, into the detector that 0 reconstruction iterations give.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quant.aphq.adaround import RoundingSchedule
from quant.aphq.hessian import binary_kl, detector_hessians, rpn_output_loss
from quant.aphq.reconstruct import ReconSettings, reconstruct_unit_calls
from quant.aphq.search import search_conv_self
from quant.convert import quantize_model
from quant.spec import LinearRule, QuantizerSpec, QuantSpec
from quant.units import capture_unit_calls
from quant_models import ImageFeed

EPS = 1e-3


class Block(nn.Module):
    """A Swin-like unit: forward(x [B, L, C], hw_shape) -> [B, L, C]."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c, c)
        self.sign = 0.0  # the official perturb_u / perturb_d, for the reference only

    def forward(self, x, hw_shape):
        out = x + torch.tanh(self.fc(x))
        return out + self.sign * EPS * torch.ones_like(out)


class ToyDetector(nn.Module):
    """backbone.block then an RPN of two levels (the map and its 2x average pool): 3 anchors, 12 deltas."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.backbone = nn.Module()
        self.backbone.block = Block(c)
        self.rpn_cls = nn.Conv2d(c, 3, 1)
        self.rpn_reg = nn.Conv2d(c, 12, 1)
        with torch.no_grad():
            self.rpn_cls.bias.copy_(torch.tensor([2.5, -2.0, 0.0]))  # anchor 0 mostly above 0.7

    def forward_image(self, image):
        b, c, h, w = image.shape
        x = self.backbone.block(image.flatten(2).transpose(1, 2), (h, w))
        fmap = x.transpose(1, 2).reshape(b, c, h, w)
        levels = [fmap, F.avg_pool2d(fmap, 2)]
        return [self.rpn_cls(f) for f in levels], [self.rpn_reg(f) for f in levels]


def images(sizes=((6, 8), (4, 6), (8, 4))):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 4, h, w, generator=g) for h, w in sizes]


def official_hessians(model, feed):
    """The official init_block_raw_grad, transcribed: perturbed forward, full backward hook, loss.backward()."""
    block = model.backbone.block
    with torch.no_grad():
        raw = [model.forward_image(img) for img in feed.images]
    raw_cls = [[torch.sigmoid(c) for c in cls] for cls, _ in raw]
    raw_box = [box for _, box in raw]
    got = {1.0: [], -1.0: []}
    sign_now = {"s": 1.0}
    handle = block.register_full_backward_hook(lambda m, gi, go: got[sign_now["s"]].append(go[0].clone()))
    try:
        for sign in (1.0, -1.0):
            sign_now["s"] = sign
            block.sign = sign
            for i, img in enumerate(feed.images):
                model.zero_grad()
                cls, box = model.forward_image(img)
                loss_cls, loss_box = [], []
                for j in range(len(cls)):
                    loss_cls.append(binary_kl(torch.sigmoid(cls[j]), raw_cls[i][j]))
                    mask = (raw_cls[i][j] > 0.7).repeat_interleave(4, dim=1).contiguous()
                    loss_box.append(F.smooth_l1_loss(box[j] * mask, raw_box[i][j] * mask, reduction="mean"))
                loss_cls, loss_box = sum(loss_cls), sum(loss_box)
                (loss_cls / loss_cls.detach() + loss_box / loss_box.detach()).backward()
    finally:
        handle.remove()
        block.sign = 0.0
    out = []
    for up, down in zip(got[1.0], got[-1.0]):
        grad = (up - down).abs()
        out.append(grad * grad.numel() / grad.sum())
    return out, (raw_cls, raw_box)


def test_detector_aph_weight_equals_the_official_perturbed_backward_hook():
    torch.manual_seed(0)
    model = ToyDetector().double()
    feed = ImageFeed([img.double() for img in images()])
    expected, (raw_cls, raw_box) = official_hessians(model, feed)
    model.requires_grad_(False)
    refs = list(zip(raw_cls, raw_box))
    got = detector_hessians(model, "backbone.block", feed, feed.rpn_outputs, refs, eps=EPS)
    assert len(got) == 3
    for (h,), e in zip(got, expected):
        assert h.shape == e.shape  # per image, its own size: not averaged over images
        assert h.dtype == torch.float32
        assert torch.allclose(h.double(), e, rtol=1e-5, atol=1e-8)
        assert abs(float(h.double().mean()) - 1.0) < 1e-5


def test_rpn_loss_leaves_out_a_zero_box_term_instead_of_dividing_by_it():
    cls = [torch.tensor([[[[-3.0]], [[-3.0]], [[-3.0]]]], requires_grad=True)]  # nothing above 0.7
    box = [torch.zeros(1, 12, 1, 1, requires_grad=True)]
    ref = ([torch.sigmoid(torch.tensor([[[[-2.0]], [[-3.0]], [[-3.0]]]]))], [torch.ones(1, 12, 1, 1)])
    loss = rpn_output_loss((cls, box), ref)
    assert torch.isfinite(loss) and abs(float(loss) - 1.0) < 1e-6  # the KL term alone, divided by itself


def official_conv_candidates(values, n_bits, eq_n, rows, l=0.999, r=1.0, clamp=None):
    """calculate_percentile_*_candidates of the official detection conv: per row of `values` [rows, M]."""
    n_levels = 2 ** (n_bits - 1)
    num_zp, num_scale = n_levels, int(eq_n / n_levels)
    pct = torch.tensor([l, r], dtype=values.dtype)
    up = torch.quantile(values, pct, dim=-1).unsqueeze(-1)
    lo = torch.quantile(values, 1 - pct, dim=-1).unsqueeze(-1)
    d_min, d_max = up[0:1] - lo[0:1], up[1:] - lo[1:]
    splits = torch.linspace(0, 1, num_scale, dtype=values.dtype)[:, None, None] * (d_max - d_min)
    scales = (d_min + splits).repeat(num_zp, 1, 1) / (2 * n_levels - 1)
    if clamp is not None:
        scales = scales.clamp(min=clamp)
    zps = torch.arange(n_levels - num_zp // 2, n_levels + num_zp // 2, dtype=values.dtype)
    zps = zps.repeat_interleave(num_scale)[:, None, None].repeat(1, rows, 1)
    return scales, zps  # [K, rows, 1]


def fq(x, s, z, n_bits):
    return ((x / s).round() + z).clamp(0, 2 ** n_bits - 1).sub(z).mul(s)


def test_conv_search_finds_the_official_grid_minimum_for_weights_and_multi_call_inputs():
    torch.manual_seed(1)
    layer = nn.Conv2d(6, 5, 3, padding=1)
    spec = QuantSpec(linears=(LinearRule(("conv",), QuantizerSpec(4, granularity="channel"), QuantizerSpec(4)),),
                     strict=False)
    model = quantize_model(_Wrap(layer), spec)
    qconv = model.conv
    calls = [torch.randn(1, 6, 9, 7) * 2 + 0.3, torch.randn(1, 6, 5, 4) * 2 + 0.3]  # two FPN levels
    # percentiles from 0.9 (the detection recipe's 0.999 barely moves the range of a 54-weight row)
    search_conv_self(qconv, calls, weight_pct=(0.9, 1.0), act_pct=(0.9, 1.0), eq_n=128)

    W = layer.weight.detach().reshape(5, -1).double()
    ws, wz = official_conv_candidates(W, 4, 128, 5, l=0.9)
    errors = torch.stack([(fq(W, ws[k], wz[k], 4) - W).pow(2).mean(1) for k in range(ws.shape[0])])  # [K, 5]
    got_s = qconv.weight_quantizer.scale.reshape(5, 1).double()
    got_z = qconv.weight_quantizer.zero_point.reshape(5, 1).double()
    got_err = (fq(W, got_s, got_z, 4) - W).pow(2).mean(1)
    assert torch.allclose(got_err, errors.min(0).values, rtol=1e-5)

    pooled = torch.cat([c.reshape(-1) for c in calls]).double().reshape(1, -1)
    a_s, a_z = official_conv_candidates(pooled, 4, 128, 1, l=0.9, clamp=1e-4)
    xs = [c.double() for c in calls]
    a_err = torch.stack([sum((fq(x, a_s[k, 0, 0], a_z[k, 0, 0], 4) - x).pow(2).mean() for x in xs)
                         for k in range(a_s.shape[0])])
    aq = qconv.input_quantizer
    mine = sum((fq(x, aq.scale.double().reshape(()), aq.zero_point.double().reshape(()), 4) - x).pow(2).mean()
               for x in xs)
    assert abs(float(mine) - float(a_err.min())) <= 1e-5 * float(a_err.min())


class _Wrap(nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv


def recon_settings(iters=1, batch_size=1, mix=1.0):  # QDrop off (1: the quantized element always)
    return ReconSettings(iters=iters, batch_size=batch_size, weight_lr=1e-3, act_lr=4e-5, drop_prob=1.0,
                         input_mix_prob=mix, rounding=RoundingSchedule(iters, 0.2, 20.0, 2.0, 0.01),
                         normalize_loss=True, log_every=0)


def quantized_toy_block():
    """(float ToyDetector, its ImageFeed, the model with backbone.block.fc quantized to W4A4, the float unit's
    calls with their outputs)."""
    torch.manual_seed(0)
    model = ToyDetector()
    feed = ImageFeed(images())
    spec = QuantSpec(linears=(LinearRule(("backbone.block.fc",), QuantizerSpec(4, granularity="channel"),
                                         QuantizerSpec(4)),), strict=False)
    q = quantize_model(model, spec)
    return model, feed, q, capture_unit_calls(model, "backbone.block", feed, outputs=True)


def test_per_image_reconstruction_loss_is_the_official_weighted_sum_and_batches_are_refused():
    model, feed, q, fp_calls = quantized_toy_block()
    assert [c.args[0].shape[1] for c in fp_calls] == [48, 24, 32]  # each image keeps its size
    assert [c.args[1] for c in fp_calls] == [(6, 8), (4, 6), (8, 4)]  # hw_shape passed on as it was
    from quant.calibrate import calibrate
    calibrate(q.backbone.block.fc, torch.cat([c.args[0] for c in fp_calls], dim=1))
    q_calls = capture_unit_calls(q, "backbone.block", feed)
    hessians = [[torch.rand_like(c.outputs[0]) + 0.5] for c in fp_calls]
    unit = q.backbone.block
    with torch.no_grad():
        expected = float(((unit(q_calls[0].args[0], (6, 8)) - fp_calls[0].outputs[0]).pow(2) * hessians[0][0]).sum())
    stats = reconstruct_unit_calls(unit, fp_calls, q_calls, hessians, recon_settings())
    assert abs(stats["rec_first"] - expected) <= 1e-5 * expected
    with pytest.raises(ValueError, match="batch_size=2"):
        reconstruct_unit_calls(unit, fp_calls, q_calls, hessians, recon_settings(batch_size=2))



@pytest.mark.parametrize("key, value", [("mlp_iters", 5), ("mlp_lr", 0.1), ("mlp_clip_percentile", 0.9),
                                        ("mlp_clip_weight", 1.0)])
def test_detector_options_refuse_mlp_reconstruction_settings_it_never_applies(key, value):
    """A detector is reconstructed without MLP reconstruction: its settings would be recorded but do nothing."""
    import dataclasses
    from configs.quant import APHQ_DETECTION, APHQOptions
    from quant.aphq.detector import check_detector_options
    detection = dataclasses.replace(APHQOptions(), **APHQ_DETECTION)
    check_detector_options(detection)  # the detection recipe passes
    with pytest.raises(ValueError, match=f"{key}={value}: .*MLP settings do not apply"):
        check_detector_options(dataclasses.replace(detection, **{key: value}))


@pytest.mark.parametrize("key, value, message", [
    ("batch_size", 2, "batch_size=2: .*one image per batch"), ("hessian_probe", "rademacher", "all-ones probe"),
    ("temperature", 2.0, "temperature=2.0: "), ("mlp_reconstruct", True, "mlp_reconstruct=True: ")])
def test_detector_options_refuse_what_the_detector_reconstruction_cannot_honour(key, value, message):
    import dataclasses
    from configs.quant import APHQ_DETECTION, APHQOptions
    from quant.aphq.detector import check_detector_options
    with pytest.raises(ValueError, match=message):
        check_detector_options(dataclasses.replace(APHQOptions(), **{**APHQ_DETECTION, key: value}))


class StagedDetector(nn.Module):
    """ToyDetector with MMDetection's unit names: backbone.stages.0.blocks.0, then a 1x1-conv neck and rpn_head."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.backbone = nn.Module()
        stage = nn.Module()
        stage.blocks = nn.ModuleList([Block(c)])
        self.backbone.stages = nn.ModuleList([stage])
        self.neck = nn.Conv2d(c, c, 1)
        self.rpn_head = nn.Module()
        self.rpn_head.cls = nn.Conv2d(c, 3, 1)
        self.rpn_head.reg = nn.Conv2d(c, 12, 1)

    def forward_image(self, image):
        b, c, h, w = image.shape
        x = self.backbone.stages[0].blocks[0](image.flatten(2).transpose(1, 2), (h, w))
        fmap = self.neck(x.transpose(1, 2).reshape(b, c, h, w))
        return [self.rpn_head.cls(fmap)], [self.rpn_head.reg(fmap)]


class CalibFeed(ImageFeed):
    """A calibration set that is also a quant.calibrate.ModelFeed: one forward per image."""

    def feed(self, model):
        for i in range(len(self)):
            self.run(model, i)
        return len(self)


@pytest.mark.parametrize("given", [
    dict(iters=3, weight_lr=0.011, act_lr=0.022, drop_prob=0.3, input_mix_prob=0.4, warmup=0.3, beta_start=19.0,
         beta_end=3.0, round_weight=0.05, normalize_loss=False, log_every=7, hessian_eps=2e-3, data_seed=5, seed=9,
         eq_n=96, weight_pct=(0.99, 1.0), act_pct=(0.98, 0.999), matmul_pct=(0.9, 0.95), matmul_steps=33,
         search_max_rows=7, round_zero_point=False, calib_images=2),
    dict(hessian_eps=None), dict(loss="mse")])
def test_every_reconstruction_option_of_the_detection_recipe_reaches_each_unit(monkeypatch, given):
    """What quantize_detector hands each unit's reconstruction is what the options say (a user's setting is never
    replaced by the recipe's): lrs, QDrop, rounding schedule, normalisation, the APH eps (None: the official
    detection 1e-3) and the loss (mse: no APH weight for any unit). So do the calibration search (the convolution
    self-search, one image per batch) and the drawn images (recon_images with data_seed, recorded in the report);
    each unit is reconstructed with all its quantizers on, against the FLOAT detector's outputs from the inputs
    of the quantized prefix."""
    import dataclasses
    import quant.aphq.detector as aphq_detector
    from configs.quant import APHQ_DETECTION, APHQOptions
    from quant.calibrate import calibrate
    from quant.pipeline_data import PipelineData
    from quant.modes import named_quantizers, set_quant_state
    from quant.spec import parse_bits
    options = dataclasses.replace(APHQOptions(), **{**APHQ_DETECTION, "calib_images": 1, "recon_images": 2,
                                                    "iters": 1, **given})
    seen_eps, seen = [], []
    seen_refs = []
    monkeypatch.setattr(aphq_detector, "detector_hessians", lambda frozen, unit, samples, rpn, refs, eps: (
        seen_eps.append(eps) or seen_refs.append(refs) or [[torch.ones(1)] for _ in refs]))
    calls, states, searches, draws = {}, {}, [], []
    monkeypatch.setattr(aphq_detector, "reconstruct_unit_calls", lambda module, fp, q, weights, settings, name="": (
        calls.update({name: (fp, q)}) or states.update({name: {n: qz.enabled for n, qz in
                                                                named_quantizers(module)}})
        or seen.append((name, weights is not None, settings)) or {"rec_first": 0.0, "rec_last": 0.0, "seconds": 0.0}))
    # min/max instead of APHQ's search, every quantizer left off afterwards as calibrate_aphq leaves them
    monkeypatch.setattr(aphq_detector, "calibrate_aphq", lambda model, units, calib, search, generator: (
        searches.append(search), calibrate(model, calib), set_quant_state(model, weights=False, activations=False)))
    torch.manual_seed(0)
    spec = QuantSpec(linears=(LinearRule(("backbone.stages.*.blocks.*.fc", "neck", "rpn_head.*"),
                                         QuantizerSpec(4, granularity="channel"), QuantizerSpec(4)),), strict=False)
    feed = ImageFeed(images()[:2])
    detector = StagedDetector()
    result = aphq_detector.quantize_detector(
        spec, detector, CalibFeed(images()[:1]), parse_bits("w4a4"), options,
        PipelineData(detector_samples=lambda count, seed: draws.append((count, seed)) or feed))
    assert [(name, aph) for name, aph, _ in seen] == [("backbone.stages.0.blocks.0", options.loss == "aph"),
                                                      ("neck", False)]  # the RPN head: calibrated only
    assert result.report["calibrated_only"] == ["rpn_head"]
    for refs in seen_refs:  # the float RPN's objectness as probabilities (official raw_cls) and its box deltas
        with torch.no_grad():
            for i, ((cls, box), (logits, deltas)) in enumerate(zip(refs, [feed.rpn_outputs(detector, j)
                                                                        for j in range(len(feed))])):
                assert torch.allclose(cls[0], torch.sigmoid(logits[0])) and torch.allclose(box[0], deltas[0]), i
    heads = [q for name, q in named_quantizers(result.model) if name.startswith("rpn_head.")]
    assert len(heads) == 4 and all(q.enabled and q.calibrated for q in heads)  # switched on at the end
    assert seen_eps == ([] if options.loss == "mse" else [given.get("hessian_eps", 1e-3) or 1e-3])
    for name, _, s in seen:
        assert (s.iters, s.batch_size, s.weight_lr, s.act_lr) == (options.iters, 1, options.weight_lr, options.act_lr)
        assert s.drop_prob == (1.0 if name == "neck" else options.drop_prob)  # QDrop never inside the neck's convs
        assert (s.input_mix_prob, s.normalize_loss, s.log_every) == (options.input_mix_prob, options.normalize_loss,
                                                                      options.log_every)
        assert s.rounding == RoundingSchedule(options.iters, options.warmup, options.beta_start, options.beta_end,
                                              options.round_weight)
    assert draws == [(options.recon_images, options.data_seed)]
    assert {k: result.report["data"][k] for k in ("reconstruction_images", "seed", "transform")} == {
        "reconstruction_images": 2, "seed": options.data_seed, "transform": "test"}
    search, = searches
    assert (search.conv_search, search.batch_size, search.rounds, search.eq_n, search.max_rows) == (
        "self", 1, options.search_rounds, options.eq_n, options.search_max_rows)
    assert (search.weight_pct, search.act_pct, search.matmul_pct, search.matmul_steps, search.round_zero_point) == (
        tuple(options.weight_pct), tuple(options.act_pct), tuple(options.matmul_pct), options.matmul_steps,
        options.round_zero_point)
    assert states == {"backbone.stages.0.blocks.0": {"fc.weight_quantizer": True, "fc.input_quantizer": True},
                      "neck": {"weight_quantizer": True, "input_quantizer": True}}  # W4A4, not W4A16
    # the float targets and the quantized-prefix inputs, by hand: the float block, and the block of the result
    # (its quantizers on; the spy changed nothing after the neck's capture)
    block, q_block = detector.backbone.stages[0].blocks[0], result.model.backbone.stages[0].blocks[0]
    for i, image in enumerate(feed.images):
        tokens, (b, c, h, w) = image.flatten(2).transpose(1, 2), image.shape
        with torch.no_grad():
            fp_out, q_out = block(tokens, (h, w)), q_block(tokens, (h, w))
        fp_calls, q_calls = calls["neck"]
        assert torch.allclose(fp_calls[i].args[0], fp_out.transpose(1, 2).reshape(b, c, h, w)), i
        assert torch.allclose(q_calls[i].args[0], q_out.transpose(1, 2).reshape(b, c, h, w)), i
        assert not torch.allclose(q_calls[i].args[0], fp_calls[i].args[0], atol=1e-3), i  # else the check is void
        with torch.no_grad():
            assert torch.allclose(fp_calls[i].outputs[0], detector.neck(fp_calls[i].args[0])), i


def test_quantize_detector_at_zero_iterations_calibrates_only_and_equals_zero_iterations_of_reconstruction(
        monkeypatch):
    """iters=0 draws no reconstruction images, computes no float RPN references, APH weights or unit captures,
    and its detector is the one that reconstructing every unit for 0 iterations gives: APHQ's calibration, then
    the units switched on in order, each through `reconstruct_unit_calls` with 0 iterations, then the
    calibrated-only heads."""
    import dataclasses
    import quant.aphq.detector as aphq_detector
    from configs.quant import APHQ_DETECTION, APHQOptions
    from quant.calibrate import calibrate
    from quant.modes import set_quant_state
    from quant.pipeline_data import PipelineData
    from quant.spec import parse_bits
    from quant.units import find_units
    options = dataclasses.replace(APHQOptions(), **{**APHQ_DETECTION, "calib_images": 1, "recon_images": 2,
                                                    "iters": 0, "log_every": 0})
    spec = QuantSpec(linears=(LinearRule(("backbone.stages.*.blocks.*.fc", "neck", "rpn_head.*"),
                                         QuantizerSpec(4, granularity="channel"), QuantizerSpec(4)),), strict=False)
    torch.manual_seed(0)
    detector = StagedDetector()
    skipped = []

    class NoReferences(ImageFeed):
        def rpn_outputs(self, model, i):
            skipped.append("rpn_outputs")
            return super().rpn_outputs(model, i)

    for name in ("detector_hessians", "capture_unit_calls", "reconstruct_unit_calls"):
        monkeypatch.setattr(aphq_detector, name, lambda *a, _name=name, **k: skipped.append(_name))

    def calibrate_then_off(model, units, calib, search=None, generator=None):
        """min/max instead of APHQ's search (which folds ViT LayerNorms the toy lacks), every quantizer left off
        as calibrate_aphq leaves them"""
        calibrate(model, calib)
        set_quant_state(model, weights=False, activations=False)
    monkeypatch.setattr(aphq_detector, "calibrate_aphq", calibrate_then_off)
    draws = []
    result = aphq_detector.quantize_detector(spec, detector, CalibFeed(images()[:1]), parse_bits("w4a4"), options,
                                             PipelineData(detector_samples=lambda n, seed: draws.append(n)
                                                          or NoReferences(images()[:n])))
    assert skipped == [] and draws == []  # no reconstruction images are drawn (a COCO read for nothing)
    assert result.report["data"]["reconstruction_images"] == 0
    assert result.report["data"]["seed"] is None  # data_seed is not read: no image is drawn with it
    assert [(u["unit"], u["iters"]) for u in result.report["units"]] == [("backbone.stages.0.blocks.0", 0),
                                                                        ("neck", 0)]
    # the reference: the same calibration, then 0 iterations of reconstruct_unit_calls on each unit in order
    ref = quantize_model(detector, spec).eval().requires_grad_(False)
    units = find_units(ref, aphq_detector.DETECTOR_UNIT_KINDS)
    calibrate_then_off(ref, units, CalibFeed(images()[:1]))
    for unit in units:
        module = ref.get_submodule(unit.name)
        set_quant_state(module, weights=True, activations=True)
        reconstruct_unit_calls(module, [], [], None, recon_settings(iters=0))
    set_quant_state(ref.rpn_head, weights=True, activations=True)
    with torch.no_grad():
        for image in images():
            got, want = result.model.forward_image(image), ref.forward_image(image)
            assert all(torch.equal(g, w) for g, w in zip(got[0] + got[1], want[0] + want[1]))
            assert not torch.allclose(want[0][0], detector.forward_image(image)[0][0])  # else the check is void


class _RunOnly:
    """A SampleFeed without `rpn_outputs`: no APH weight could be computed from it."""

    def __len__(self):
        return 1

    def run(self, model, i):
        return None


def test_quantize_detector_refuses_a_tensor_batch_a_miscounted_one_and_samples_without_rpn_outputs():
    """Each refusal comes before any work (`detector_samples` is not even called for the first two)."""
    import dataclasses
    from configs.quant import APHQ_DETECTION, APHQOptions
    from quant.aphq.detector import quantize_detector
    from quant.pipeline_data import PipelineData
    from quant.spec import parse_bits
    options = dataclasses.replace(APHQOptions(), **{**APHQ_DETECTION, "calib_images": 1, "recon_images": 1})
    unused = PipelineData(detector_samples=lambda count, seed: pytest.fail("drew samples before a refusal"))
    counted = CalibFeed(images()[:2])
    counted.count = 2
    args = (QuantSpec(linears=()), StagedDetector())
    with pytest.raises(ValueError, match="units.SampleFeed .*not on an image tensor"):
        quantize_detector(*args, images()[0], parse_bits("w4a4"), options, unused)
    with pytest.raises(ValueError, match="calib_images=1 but the calibration batch holds 2 images"):
        quantize_detector(*args, counted, parse_bits("w4a4"), options, unused)
    with pytest.raises(TypeError, match="must give a quant.aphq.detector.DetectorSamples"):
        quantize_detector(*args, CalibFeed(images()[:1]), parse_bits("w4a4"), options,
                          PipelineData(detector_samples=lambda count, seed: _RunOnly()))


def test_per_image_reconstruction_cycles_through_the_images_in_order():
    """Iteration it reconstructs image it % n (official `idx = it % n`): with both lrs 0 nothing moves, so each
    iteration's loss is its image's weighted error, computed here image by image."""
    model, feed, q, fp_calls = quantized_toy_block()
    from quant.calibrate import calibrate
    calibrate(q.backbone.block.fc, torch.cat([c.args[0] for c in fp_calls], dim=1))
    q_calls = capture_unit_calls(q, "backbone.block", feed)
    # the block is the first unit, so its captured quantized-prefix input equals the float one: make it differ, as
    # behind a quantized prefix, so that reading the float input instead (input_mix_prob 1) shows
    g = torch.Generator().manual_seed(1)
    q_calls = [qc._replace(args=(qc.args[0] + 0.3 * torch.randn(qc.args[0].shape, generator=g), *qc.args[1:]))
               for qc in q_calls]
    hessians = [[torch.rand_like(c.outputs[0]) + 0.5] for c in fp_calls]
    unit = q.backbone.block
    with torch.no_grad():
        per_image = [float(((unit(qc.args[0], qc.args[1]) - fc.outputs[0]).pow(2) * h[0]).sum())
                     for qc, fc, h in zip(q_calls, fp_calls, hessians)]
    settings = ReconSettings(iters=5, batch_size=1, weight_lr=0.0, act_lr=0.0, drop_prob=1.0, input_mix_prob=1.0,
                             rounding=RoundingSchedule(5, 0.2, 20.0, 2.0, 0.01), normalize_loss=False, log_every=1)
    seen = []
    reconstruct_unit_calls(unit, fp_calls, q_calls, hessians, settings, progress=lambda m: seen.append(m["rec"]))
    expected = [per_image[i] for i in (0, 1, 2, 0, 1)]
    assert seen == pytest.approx(expected, rel=1e-5)


def test_binary_kl_clamps_a_saturated_float_objectness():
    # a float32 sigmoid saturates to exactly 0 or 1 (logits beyond ~17): the official binary_kl clamps both
    # probabilities to [1e-7, 1 - 1e-7]; reference: the Bernoulli KL of the clamped values, written out in float64
    pred, target = torch.tensor([0.3, 0.9, 0.5]), torch.sigmoid(torch.tensor([40.0, -120.0, 0.0]))
    assert target[0] == 1.0 and target[1] == 0.0
    t, p = target.double().clamp(1e-7, 1 - 1e-7), pred.double()
    want = (t * (t / p).log() + (1 - t) * ((1 - t) / (1 - p)).log()).mean()
    assert float(binary_kl(pred, target)) == pytest.approx(float(want), rel=1e-4)


class _Levels(nn.Module):
    """A unit with a structured output, as an FPN neck's tuple of levels or MMDetection's (x, out_size)."""

    def forward(self, x, hw_shape):
        return (x, (2 * x, x + 1), hw_shape)


class _Toy(nn.Module):
    def __init__(self, skip_wide: bool = False) -> None:
        super().__init__()
        self.unit = _Levels()
        self.skip_wide = skip_wide

    def forward(self, image):
        x = image.flatten(2).transpose(1, 2)
        if self.skip_wide and image.shape[-1] > 4:  # a path that does not reach the unit
            return x
        return self.unit(x, tuple(image.shape[-2:]))


def test_per_image_captures_keep_every_output_tensor_and_refuse_a_unit_that_some_image_skips():
    images = [torch.randn(1, 3, h, w) for h, w in ((2, 3), (4, 2), (3, 6))]
    calls = capture_unit_calls(_Toy(), "unit", ImageFeed(images), outputs=True)
    assert len(calls) == 3
    for call, image in zip(calls, images):
        x = image.flatten(2).transpose(1, 2)
        assert call.args[1] == tuple(image.shape[-2:])
        assert [t.shape for t in call.outputs] == [x.shape] * 3  # every tensor of the nested tuple, in order
        for got, want in zip(call.outputs, (x, 2 * x, x + 1)):
            assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match=r"unit ran 2 times over 3 batches"):
        capture_unit_calls(_Toy(skip_wide=True), "unit", ImageFeed(images))


def test_binary_kl_clamps_a_saturated_perturbed_prediction():
    # the perturbed model's sigmoid saturates too: the official binary_kl clamps pred as it clamps the target, so
    # the KL stays finite; reference: the Bernoulli KL of the clamped probabilities, written out in float64
    pred, target = torch.sigmoid(torch.tensor([40.0, -120.0, 0.0])), torch.tensor([0.3, 0.6, 0.5])
    assert pred[0] == 1.0 and pred[1] == 0.0
    p, t = pred.clamp(1e-7, 1 - 1e-7).double(), target.double()
    want = (t * (t / p).log() + (1 - t) * ((1 - t) / (1 - p)).log()).mean()
    got = binary_kl(pred, target)
    assert torch.isfinite(got) and float(got) == pytest.approx(float(want), rel=1e-4)


class _SideBlock(Block):
    """A unit with a second output tensor that the RPN never reads (as a Swin stage's extra outputs)."""

    def forward(self, x, hw_shape):
        return super().forward(x, hw_shape), 3 * x


class _SideDetector(ToyDetector):
    def __init__(self) -> None:
        super().__init__()
        self.backbone.block = _SideBlock(4)

    def forward_image(self, image):
        b, c, h, w = image.shape
        x, _ = self.backbone.block(image.flatten(2).transpose(1, 2), (h, w))
        fmap = x.transpose(1, 2).reshape(b, c, h, w)
        levels = [fmap, F.avg_pool2d(fmap, 2)]
        return [self.rpn_cls(f) for f in levels], [self.rpn_reg(f) for f in levels]


def test_detector_aph_weight_of_an_output_the_rpn_never_reads_is_the_plain_mse_weight():
    # no gradient reaches the second output: its weight is 1 everywhere (plain MSE), not 0 (never reconstructed);
    # the read output's weight is the official one, computed by the transcription above on the same detector
    torch.manual_seed(0)
    model = _SideDetector().double()
    feed = ImageFeed([img.double() for img in images()])
    expected, (raw_cls, raw_box) = official_hessians(model, feed)
    model.requires_grad_(False)
    got = detector_hessians(model, "backbone.block", feed, feed.rpn_outputs, list(zip(raw_cls, raw_box)), eps=EPS)
    for (h_read, h_side), e, img in zip(got, expected, feed.images):
        assert torch.allclose(h_read.double(), e, rtol=1e-5, atol=1e-8)
        assert h_side.shape == (1, img.shape[2] * img.shape[3], 4) and torch.equal(h_side, torch.ones_like(h_side))


def test_per_image_input_mix_takes_the_quantized_prefix_element_with_probability_input_mix_prob():
    # float input all 0, quantized-prefix input all 1: the mean of the mixed input is the fraction of quantized
    # elements, which must be input_mix_prob (the official where(rand < drop_prob, quantized, float)); 0.5 could not
    # tell it from 1 - p
    from quant.units import UnitCall
    seen = []

    class Probe(nn.Linear):
        def forward(self, x, hw_shape):
            seen.append(float(x.mean()))
            return super().forward(x)

    fp_calls = [UnitCall((torch.zeros(1, 5000, 4), (50, 100)), [torch.zeros(1, 5000, 4)])]
    q_calls = [UnitCall((torch.ones(1, 5000, 4), (50, 100)), None)]
    for p in (0.2, 0.9):
        torch.manual_seed(0)
        reconstruct_unit_calls(Probe(4, 4), fp_calls, q_calls, None, recon_settings(mix=p))
        assert abs(seen[-1] - p) < 0.02, p
