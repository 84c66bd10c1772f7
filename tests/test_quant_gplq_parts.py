"""GPLQ building blocks: LSQ gradients and scale floor, QwT compensation on its fitting data and what it keeps,
the PCA component rule and subset, and what stage 1 trains (groups, loss, lr rule, resume identity)."""
import copy
import dataclasses
import logging

import pytest
import torch
from torch import nn

from quant import PIPELINES
from quant.convert import quantized_layers
from quant.gplq.lsq import LSQQuantizer
import quant.gplq.pipeline as gplq_pipeline
from quant.gplq.pca import PCAProjection, components_from_moments, fit_pca, pca_loss
from quant.gplq.pipeline import default_lr, fit_on_images, stage1_identity
from quant.gplq.qat import Stage1Settings, param_groups, run_stage1
from quant.gplq.qwt import CompensationFit, add_compensation, fit_block_compensation
from quant.gplq.stage2 import block_reference, compensate_blocks, quantize_weights_and_compensate
from quant.modes import named_quantizers, set_quant_state
from quant.pipeline_base import StageTimer
from quant.quantizers import MIN_SCALE
from quant.ranges import RangeSearch
from quant.spec import parse_bits
from quant.units import capture_unit, find_units
from device_utils import cpu_pipeline_data
from quant_models import images, tiny_swin, tiny_vit


pytestmark = pytest.mark.usefixtures("one_thread")


def test_lsq_scale_gradient_matches_the_lsq_formula():
    g = torch.Generator().manual_seed(0)
    q = LSQQuantizer(4, symmetric=True, channel_dim=-1, num_channels=6, search=RangeSearch("minmax"))
    x = torch.randn(4, 10, 6, generator=g) * torch.arange(1, 7)
    q.calibrating = True
    q(x)
    q.calibrating = False
    assert torch.allclose(q.scale, x.abs().amax(dim=(0, 1)) / 7)  # symmetric min/max init, codes [-8, 7]
    q.make_learnable(scale=True)
    with torch.no_grad():
        q.scale.mul_(0.6)  # a narrower range, so that some elements clip at both ends
    upstream = torch.randn(x.shape, generator=g)
    x.requires_grad_(True)
    y = q(x)
    (y * upstream).sum().backward()

    # LSQ (Esser et al. 2020, eq. 3 and the gradient scale of section 2.2), written out in float64:
    # dy/ds = round(v) - v inside the code range, qmin / qmax below / above it; v = x / s.
    xd, s = x.detach().double(), q.scale.detach().double()
    v = xd / s
    inside = (v >= q.qmin) & (v <= q.qmax)
    dy_ds = torch.where(inside, torch.round(v) - v, torch.where(v < q.qmin, float(q.qmin), float(q.qmax)))
    g_scale = 1.0 / (x.numel() / 6 * q.qmax) ** 0.5
    expected = g_scale * (dy_ds * upstream.double()).sum(dim=(0, 1))
    assert (~inside).any() and inside.any()
    torch.testing.assert_close(q.scale.grad.double(), expected, rtol=1e-4, atol=1e-6)
    # straight-through input gradient: the upstream gradient inside the range, 0 where clipped
    torch.testing.assert_close(x.grad, torch.where(inside, upstream.double(), 0.0).float())
    with torch.no_grad():  # the inference kernel path gives the training path's values
        torch.testing.assert_close(q(x), y.detach(), rtol=0, atol=1e-6)


def test_lsq_a_learned_scale_below_the_floor_quantizes_with_the_floor_in_training_and_evaluation():
    q = LSQQuantizer(4, symmetric=True, channel_dim=-1, num_channels=3, search=RangeSearch("minmax"))
    x = torch.tensor([[0.3, -2.0, 5e-8], [1.0, 0.5, -3e-8]])
    q.calibrating = True
    q(x)
    q.calibrating = False
    q.make_learnable(scale=True)
    with torch.no_grad():
        q.scale.copy_(torch.tensor([-0.5, 0.0, 0.25]))  # an LSQ step may overshoot zero
    # reference written out: step max(s, MIN_SCALE), codes clamp(round(x / step), -8, 7)
    step = torch.tensor([MIN_SCALE, MIN_SCALE, 0.25])
    want = torch.clamp(torch.round(x / step), -8, 7) * step
    torch.testing.assert_close(q(x), want)  # training path (learnable scale, grad on)
    with torch.no_grad():
        torch.testing.assert_close(q(x), want)  # evaluation path
    q.scale.requires_grad_(False)
    torch.testing.assert_close(q(x), want)  # frozen (stage 2)


def block_error(x, block, reference, batch_size):
    """Sum of squared differences between the two blocks' outputs on x, computed directly in float64."""
    with torch.no_grad():
        return sum(float((reference(c) - block(c)).double().pow(2).sum()) for c in x.split(batch_size))


def test_compensation_adds_x_w_plus_b_in_fp16_in_eval_and_keeps_every_name():
    """QwT's CompensationBlock.forward: in eval `(x.half() @ W.half()).float() + b`, in training fp32. The
    reference rounds x and W to fp16 by hand and the exact product (small integers times multiples of 2^-10, exact
    in fp32) to fp16 once: x carries 2^-12 more than its fp16 value, which only the fp32 form keeps."""
    block = tiny_vit().blocks[0].eval()
    c = block.norm1.normalized_shape[0]
    g = torch.Generator().manual_seed(1)
    w = torch.randint(-3, 4, (c, c), generator=g).float()
    b = torch.randn(c, generator=g)
    signs = torch.randint(0, 2, (2, 5, c), generator=g) * 2 - 1
    halves = torch.randint(1024, 2048, (2, 5, c), generator=g) / 1024 * signs
    x = halves + halves.sign() * 2.0 ** -12  # rounds to `halves` in fp16 (their spacing is 2^-10)
    assert torch.equal(x.half().float(), halves)
    with torch.no_grad():
        plain = block(x)
        expected = plain + ((halves @ w.t()).half().float() + b)
        expected_train = plain + x @ w.t() + b
    keys = set(block.state_dict())
    add_compensation(block, w, b)
    assert set(block.state_dict()) == keys | {"qwt_compensation.weight", "qwt_compensation.bias"}
    with torch.no_grad():
        torch.testing.assert_close(block(x), expected)
        torch.testing.assert_close(copy.deepcopy(block)(x), expected)  # the hook travels with a copy
        torch.testing.assert_close(block.train()(x), expected_train)
    with pytest.raises(ValueError, match="already"):
        add_compensation(block, w, b)


@pytest.mark.parametrize("make, ridge", [(tiny_vit, 0.0), (tiny_vit, 10.0), (tiny_swin, 0.0)])
def test_qwt_compensation_never_increases_block_error_on_its_fitting_data(make, ridge):
    fp = make()
    qmodel, _ = PIPELINES["percentile"](fp, images(8), "w4a4")
    x_all = images(12, seed=5)
    for unit in find_units(qmodel, kinds=("block",)):
        x, _ = capture_unit(qmodel, unit.name, x_all, 6)
        block, ref = qmodel.get_submodule(unit.name), fp.get_submodule(unit.name)
        fit = fit_block_compensation(x, block, ref, 6, ridge=ridge)
        before = block_error(x, block, ref, 6)
        compensated = copy.deepcopy(block)
        add_compensation(compensated, fit.weight, fit.bias)
        after = block_error(x, compensated, ref, 6)
        assert after <= before * (1 + 1e-5)
        assert fit.sse_after == pytest.approx(after, rel=1e-3)  # the closed form matches the real error
        assert fit.sse_before == pytest.approx(before, rel=1e-4)
        if ridge == 0.0:
            assert fit.r2 >= 0.0 and fit.keep


def test_qwt_fit_and_pooled_r2_match_a_direct_least_squares():
    """QwT's `lienar_regression`: [X 1] solved by least squares, R^2 = 1 - SSE / SST pooled over all
    output channels, each centred on its own mean; recomputed here with torch.linalg.lstsq."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 30, 6, generator=g, dtype=torch.float64)
    mix = torch.randn(6, 5, generator=g, dtype=torch.float64)
    scale = torch.tensor([1.0, 10.0, 0.1, 3.0, 0.5], dtype=torch.float64)  # unequal channel variances
    d = (x @ mix + 0.3 * torch.randn(4, 30, 5, generator=g, dtype=torch.float64)) * scale
    # one chunk of all 4 samples: quantized output 0, reference output d, so the target is d itself
    fit = fit_block_compensation(x.float(), lambda t: torch.zeros(*t.shape[:-1], 5), lambda t: d.float(), 4)
    X, D = x.reshape(-1, 6), d.reshape(-1, 5)
    A = torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype)], 1)
    sol = torch.linalg.lstsq(A, D).solution
    torch.testing.assert_close(fit.weight.double(), sol[:-1].t(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fit.bias.double(), sol[-1], rtol=1e-4, atol=1e-5)
    res = D - A @ sol
    pooled = 1 - res.pow(2).sum() / (D - D.mean(0)).pow(2).sum()
    per_channel = (1 - res.pow(2).sum(0) / (D - D.mean(0)).pow(2).sum(0)).mean()
    assert fit.r2 == pytest.approx(float(pooled), rel=1e-4)
    assert abs(float(pooled) - float(per_channel)) > 1e-3  # the two definitions differ on this data


def test_pca_keeps_the_smallest_multiple_of_32_reaching_the_variance():
    g = torch.Generator().manual_seed(0)
    d, n = 192, 4000
    spectrum = torch.logspace(0, -2, d, dtype=torch.float64)  # known decaying variances
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    f = (torch.randn(n, d, generator=g, dtype=torch.float64) * spectrum.sqrt()) @ basis.t() + 3.0
    pca = components_from_moments(f.sum(0), f.t() @ f, torch.tensor(float(n), dtype=torch.float64), 0.6, 32)
    ratio = torch.cumsum(spectrum, 0) / spectrum.sum()
    reach = int((ratio < 0.6).sum()) + 1
    assert pca.dims % 32 == 0 and pca.dims - 32 < reach <= pca.dims
    assert pca.explained >= 0.6
    assert torch.allclose(pca.mean.double(), f.mean(0), atol=1e-4)
    # the teacher mean cancels: L_PCA only sees the projected feature difference
    fs, ft = torch.randn(5, d, generator=g), torch.randn(5, d, generator=g)
    moved = PCAProjection(pca.mean + 1.0, pca.components, pca.explained, pca.samples)
    assert torch.allclose(pca_loss(fs, ft, pca), pca_loss(fs, ft, moved), rtol=1e-4)
    full = components_from_moments(f.sum(0), f.t() @ f, torch.tensor(float(n), dtype=torch.float64),
                                   0.999, 32)
    assert full.dims == d  # capped at the feature width


@pytest.mark.parametrize("target", ["float", "teacher"])
def test_qwt_fits_the_first_block_towards_its_reference(target):
    """QwT's code fits towards the same block with every quantizer off ("float", the default); "teacher"
    uses the original model's block. The first block's input does not depend on any compensation, so
    its compensation must be the plain least squares of [X 1] onto reference(X) - quantized(X), with
    the reference computed here from the float modules themselves."""
    fp = tiny_vit()
    teacher = copy.deepcopy(fp)  # stands for the pre-stage-1 model: its weights differ from the student's
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in teacher.blocks[0].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    qmodel, _ = PIPELINES["percentile"](fp, images(8), "w4a4")  # W4A4, the student's float weights = fp's
    x_all = images(12, seed=5)
    seen = []
    hook = qmodel.blocks[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        qmodel(x_all)
        hook.remove()
        x = torch.cat(seen)
        d = {"float": fp.blocks[0](x), "teacher": teacher.blocks[0](x)}
        d = {k: (v - qmodel.blocks[0](x)).double().reshape(-1, v.shape[-1]) for k, v in d.items()}
    a = torch.cat([x.double().reshape(-1, x.shape[-1]), torch.ones(d[target].shape[0], 1, dtype=torch.float64)], 1)
    expected = {k: torch.linalg.lstsq(a, v).solution for k, v in d.items()}

    options = PIPELINES["gplq"].Options(qwt_target=target)
    stats = compensate_blocks(qmodel, teacher, options, fit_on_images(qmodel, x_all, 6, options.qwt_ridge))
    assert stats[0]["unit"] == "blocks.0" and stats[0]["kept"]
    comp = qmodel.blocks[0].qwt_compensation
    got = torch.cat([comp.weight.t(), comp.bias[None]]).double()
    other = "teacher" if target == "float" else "float"
    scale = expected[target].abs().max()
    assert (got - expected[target]).abs().max() < 1e-4 * scale
    assert (got - expected[other]).abs().max() > 1e-2 * scale  # the two references are told apart


def test_pca_components_span_the_top_eigenvectors_and_the_loss_is_the_batch_mean():
    # reference: numpy's eigendecomposition of the (biased) covariance, and the loss written out per sample
    import numpy as np
    g = torch.Generator().manual_seed(1)
    d, n = 64, 3000
    spectrum = torch.logspace(0, -3, d, dtype=torch.float64)
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    f = (torch.randn(n, d, generator=g, dtype=torch.float64) * spectrum.sqrt()) @ basis.t() + 5.0
    pca = components_from_moments(f.sum(0), f.t() @ f, torch.tensor(float(n), dtype=torch.float64), 0.5, 8)
    evals, evecs = np.linalg.eigh(np.cov(f.numpy(), rowvar=False, bias=True))
    top = evecs[:, ::-1][:, :pca.dims]
    np.testing.assert_allclose(pca.components.double().numpy() @ pca.components.double().numpy().T,
                               top @ top.T, atol=1e-4)  # same subspace (eigenvector signs are free)
    assert pca.explained == pytest.approx(evals[::-1][:pca.dims].sum() / evals.sum(), rel=1e-5)
    # a target between the explained fractions of 32 and 33 components needs 33, i.e. the next multiple, 64
    cum = np.cumsum(evals[::-1]) / evals.sum()
    moments = (f.sum(0), f.t() @ f, torch.tensor(float(n), dtype=torch.float64))
    assert components_from_moments(*moments, float(cum[31] + cum[32]) / 2, 32).dims == 64
    fs, ft = torch.randn(6, d, generator=g), torch.randn(6, d, generator=g)
    V, mu = pca.components, pca.mean
    want = sum(float((((fs[i] - mu) @ V - (ft[i] - mu) @ V) ** 2).sum()) for i in range(6)) / 6
    assert float(pca_loss(fs, ft, pca)) == pytest.approx(want, rel=1e-5)


def test_qwt_ridge_penalises_the_weight_and_not_the_bias():
    # ridge with a free intercept: W = (Xc^T Xc + ridge I)^-1 Xc^T Dc on data centred per column, and
    # bias = mean(D) - mean(X) W (reference written out here; a penalised bias would shrink towards 0)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 25, 4, generator=g, dtype=torch.float64) + 3.0  # far from 0: the bias matters
    d = x @ torch.randn(4, 3, generator=g, dtype=torch.float64) + 5.0
    fit = fit_block_compensation(x.float(), lambda t: torch.zeros(*t.shape[:-1], 3), lambda t: d.float(), 2,
                                 ridge=20.0)
    X, D = x.reshape(-1, 4), d.reshape(-1, 3)
    Xc, Dc = X - X.mean(0), D - D.mean(0)
    W = torch.linalg.solve(Xc.t() @ Xc + 20.0 * torch.eye(4, dtype=X.dtype), Xc.t() @ Dc)
    torch.testing.assert_close(fit.weight.double(), W.t(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fit.bias.double(), D.mean(0) - X.mean(0) @ W, rtol=1e-4, atol=1e-4)


def test_stage1_param_groups_give_lsq_scales_their_lr_and_no_decay():
    model = tiny_vit(depth=1)
    qmodel, _ = PIPELINES["percentile"](model, images(4), "w4a4")
    qmodel.requires_grad_(True)
    scales = [q for _, q in named_quantizers(qmodel, "activation")][:2]
    for q in scales:
        q.make_learnable(scale=True)
    groups = param_groups(qmodel, lr=1e-3, scale_lr=7e-2, weight_decay=0.05)
    assert len(groups) == 2
    weights, learned = groups
    assert {id(p) for p in learned["params"]} == {id(q.scale) for q in scales}
    assert learned["lr"] == 7e-2 and learned["weight_decay"] == 0.0
    assert weights["lr"] == 1e-3 and weights["weight_decay"] == 0.05
    assert {id(p) for p in weights["params"]} == {id(p) for n, p in qmodel.named_parameters()
                                                  if not n.endswith("quantizer.scale")}


@pytest.mark.parametrize("batch, lr", [(1, 1e-6), (63, 1e-6), (64, 2.5e-6), (127, 2.5e-6), (128, 5e-6), (1024, 5e-6)])
def test_default_stage1_lr_is_the_papers_gpu_table(batch, lr):
    assert default_lr(batch) == lr


def test_stage1_identity_changes_with_stage1_options_only(monkeypatch):
    model, data = tiny_vit(depth=1), cpu_pipeline_data()
    opts = PIPELINES["gplq"].Options
    bits = parse_bits("w4a4")
    base = stage1_identity(model, bits, opts(), data)
    for key, value in [("lr", 1e-5), ("scale_lr", 1e-4), ("pca_weight", 0.5), ("steps", 7), ("seed", 3)]:
        assert stage1_identity(model, bits, opts(**{key: value}), data) != base, key
    for key, value in [("qwt_ridge", 1.0), ("stage2_images", 8), ("qwt", False), ("log_every", 3)]:
        assert stage1_identity(model, bits, opts(**{key: value}), data) == base, key
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.head.bias.add_(1.0)
    assert stage1_identity(other, bits, opts(), data) != base  # other float weights
    monkeypatch.setattr(gplq_pipeline, "world_size", lambda: 2)
    assert stage1_identity(model, bits, opts(), data) != base  # other ranks: another global batch and shards


def test_stage1_identity_holds_the_lr_used_and_reads_a_checkpoints_null_lr_as_then(monkeypatch):
    """The identity a stage-1 checkpoint must match holds the lr and scale_lr used, not null: the paper's lr of the
    global batch (16 images on one process: 1e-6, written out here) typed explicitly resumes the checkpoint of its
    null (it was refused), a checkpoint written with null before (its config) resumes under that lr and is refused
    under another, and once the default changes a null-lr checkpoint is refused, not resumed at the new lr."""
    from engine.checkpoint import CheckpointError
    from quant.gplq.qat import refuse_other_run
    model, data = tiny_vit(depth=1), cpu_pipeline_data()
    opts, bits = PIPELINES["gplq"].Options, parse_bits("w4a4")
    assert opts().batch_size_per_gpu == 16
    now = stage1_identity(model, bits, opts(), data)
    assert (now["stage1"]["lr"], now["stage1"]["scale_lr"]) == (1e-6, 1e-6)
    typed = stage1_identity(model, bits, opts(lr=1e-6), data)
    assert typed == now
    older = {**now, "stage1": {**now["stage1"], "lr": None, "scale_lr": None}}  # a checkpoint's config until now
    for config in (now, typed, stage1_identity(model, bits, opts(lr=1e-6, scale_lr=1e-6), data)):
        refuse_other_run("stage1.pt", older, config)  # the same lr: resumed
    with pytest.raises(CheckpointError, match=r"stage1\.lr: 1e-06 then, 2e-06 now"):
        refuse_other_run("stage1.pt", older, stage1_identity(model, bits, opts(lr=2e-6), data))
    monkeypatch.setattr(gplq_pipeline, "default_lr", lambda batch: 7e-6)  # a later default
    for saved in (older, now):
        with pytest.raises(CheckpointError, match=r"stage1\.lr: 1e-06 then, 7e-06 now"):
            refuse_other_run("stage1.pt", saved, stage1_identity(model, bits, opts(), data))


def test_pca_fit_uses_exactly_max_images_across_batches():
    model = tiny_vit(depth=1)
    x = images(12, seed=4)
    batches = [(x[i:i + 4], None) for i in range(0, 12, 4)]
    pca = fit_pca(model, batches, max_images=6, variance=0.6, multiple=8)
    assert pca.samples == 6
    with torch.no_grad():
        f = model.forward_head(model.forward_features(x[:6]), pre_logits=True).double()
    torch.testing.assert_close(pca.mean.double(), f.mean(0), rtol=1e-5, atol=1e-5)


def test_stage1_loss_is_ce_plus_pca_weight_times_pca(caplog):
    model, data = tiny_vit(depth=1), cpu_pipeline_data(num_images=16)
    opts = dict(steps=2, batch_size_per_gpu=4, init_images=8, pca_images=8, qwt=False,
                log_every=2, pca_weight=2.5, lr=1e-3)
    with caplog.at_level(logging.INFO, logger="quant.gplq"):
        PIPELINES["gplq"](model, None, "w4a4", opts, data=data)
    lines = [r for r in caplog.records if r.msg.startswith("GPLQ stage 1 update")]
    assert lines
    for r in lines:
        _, _, loss, ce, lp = r.args[:5]
        assert lp > 0 and loss == pytest.approx(ce + 2.5 * lp, rel=1e-5)


def _fit(r2, before, after, c):
    return CompensationFit(weight=torch.full((c, c), 0.1), bias=torch.zeros(c), r2=r2, sse_before=before,
                           sse_after=after)


def test_qwt_keeps_only_fits_that_raise_r2_above_0_and_lower_the_error():
    model = tiny_vit(depth=3)
    qmodel, _ = PIPELINES["percentile"](model, images(4), "w4a4")
    c = model.embed_dim
    fits = {"blocks.0": _fit(-0.2, 1.0, 0.5, c), "blocks.1": _fit(0.3, 1.0, 2.0, c), "blocks.2": _fit(0.3, 2.0, 1.0, c)}
    stats = compensate_blocks(qmodel, None, PIPELINES["gplq"].Options(), lambda unit, ref: fits[unit])
    assert [(s["unit"], s["kept"]) for s in stats] == [("blocks.0", False), ("blocks.1", False), ("blocks.2", True)]
    assert [hasattr(qmodel.blocks[i], "qwt_compensation") for i in range(3)] == [False, False, True]


def test_qwt_w32a4_reference_is_the_block_with_float_weights_and_quantized_activations():
    model = tiny_vit(depth=1)
    qmodel, _ = PIPELINES["percentile"](model, images(4), "w4a4")
    x = torch.randn(2, 17, model.embed_dim, generator=torch.Generator().manual_seed(0))
    block = qmodel.blocks[0]
    with torch.no_grad():
        quantized = block(x)
        float_ = model.blocks[0](x)
        weights = [q for n, q in block.named_modules() if n.endswith("weight_quantizer")]
        for q in weights:  # by hand: bypass only the weight quantizers
            q.enabled = False
        want = block(x)
        for q in weights:
            q.enabled = True
        opts = PIPELINES["gplq"].Options
        got = block_reference(qmodel, None, "blocks.0", opts(qwt_target="w32a4"))(x)
        got_float = block_reference(qmodel, None, "blocks.0", opts(qwt_target="float"))(x)
        assert torch.equal(block(x), quantized)  # every quantizer back as it was
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_float, float_)
    assert (want - float_).abs().max() > 1e-3 and (want - quantized).abs().max() > 1e-3  # three different outputs


def test_stage1_trains_float_weights_and_lsq_scales_from_training_transform_images(monkeypatch):
    data = cpu_pipeline_data(num_images=8)
    drawn = []
    real_images = data.train_images
    data.train_images = lambda count, seed, train_transform: drawn.append((count, seed, train_transform)) \
        or real_images(count, seed, train_transform)
    seen = {}
    real_stage1 = gplq_pipeline.run_stage1

    def spy(student, teacher, fit_pca, batches, settings, checkpoint, config, preemption=None):
        seen["weights_on"] = [q.enabled for _, q in named_quantizers(student, "weight")]
        acts = [q for _, q in named_quantizers(student, "activation")]
        seen["acts"] = [(q.enabled, isinstance(q.scale, torch.nn.Parameter) and q.scale.requires_grad) for q in acts]
        seen["float_trainable"] = all(p.requires_grad for p in student.parameters())
        seen["settings"] = settings
        return real_stage1(student, teacher, fit_pca, batches, settings, checkpoint, config)

    monkeypatch.setattr(gplq_pipeline, "run_stage1", spy)
    opts = dict(steps=1, batch_size_per_gpu=4, init_images=4, pca_images=4, stage2_images=4, lr=1e-4,
                scale_lr=3e-3, seed=5, stage2_train_transform=False)
    frozen = tiny_vit(depth=2).requires_grad_(False)  # as an evaluated model comes: stage 1 must unfreeze it
    PIPELINES["gplq"](frozen, None, "w4a4", opts, data=data)
    assert seen["weights_on"] and not any(seen["weights_on"])  # W32 in stage 1
    assert seen["acts"] and all(on and learnable for on, learnable in seen["acts"])
    assert seen["float_trainable"]
    assert (seen["settings"].lr, seen["settings"].scale_lr) == (1e-4, 3e-3)
    # LSQ start: training transform; QwT: the option's (False), drawn once for both blocks
    assert drawn == [(4, 5, True), (4, 5, False)]


def test_stage1_one_update_is_adamw_on_ce_plus_weighted_pca():
    """run_stage1 with steps=1 on a float student: the logged CE and L_PCA and the one AdamW update, recomputed
    here with autograd on the loss written out (CE without smoothing + pca_weight * per-sample squared norm of the
    projected feature difference). AdamW's first step moves each weight by lr * g / (|g| + eps) (bias
    correction cancels the betas), so the update checks the loss, the trainable parameters and the lr at once."""
    # a teacher with dropout, handed over in training mode: stage 1 must run it in eval mode (deterministic)
    student, teacher = tiny_vit(depth=1), tiny_vit(seed=1, depth=1, drop_rate=0.5).train()
    start = copy.deepcopy(student)
    teacher.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(48, 48, generator=g))
    pca = PCAProjection(torch.randn(48, generator=g), basis[:, :8].contiguous(), 0.6, 10)
    batches = cpu_pipeline_data(num_images=8).train_loader(4, 0)  # 2 batches: steps=1 must stop after one
    x, y = next(iter(batches.loader))
    lr, weight = 1e-3, 0.7
    settings = Stage1Settings(steps=1, batch_size_per_gpu=4, lr=lr, scale_lr=lr, weight_decay=0.0, pca_weight=weight,
                              amp="none", log_every=1, ckpt_every=0, seed=0)
    out = run_stage1(student, teacher, lambda: pca, batches, settings, None, {})

    ref = copy.deepcopy(start).train()
    feats = ref.forward_head(ref.forward_features(x), pre_logits=True)
    logits = ref.head(feats)
    with torch.no_grad():
        t_feats = teacher.eval().forward_head(teacher.forward_features(x), pre_logits=True)
    ce = -torch.log_softmax(logits, dim=1)[torch.arange(4), y].mean()
    lp = (((feats - t_feats) @ pca.components) ** 2).sum(dim=1).mean()
    (ce + weight * lp).backward()
    assert out["steps"] == 1 and not student.training  # returned ready for stage 2
    assert out["ce"] == pytest.approx(ce.item(), rel=1e-5)
    assert out["pca"] == pytest.approx(lp.item(), rel=1e-5)
    for (name, p0), p1 in zip(ref.named_parameters(), student.parameters()):
        # |g| near 0 (the key bias, which softmax ignores) leaves the step's size to rounding: only its bound
        clear = p0.grad.abs() > 1e-5
        want = p0.detach() - lr * p0.grad / (p0.grad.abs() + 1e-8)
        torch.testing.assert_close(p1.detach()[clear], want[clear], rtol=0, atol=lr * 1e-2, msg=name)
        assert ((p1.detach() - p0.detach()).abs() <= lr * 1.001).all(), name


def test_pca_fit_draws_no_batch_beyond_max_images():
    # a loader is one epoch of the training set: the PCA must stop reading it once it has its images
    model = tiny_vit(depth=1)
    x = images(16, seed=4)
    drawn = []

    def batches():
        for i in range(0, 16, 4):
            drawn.append(i)
            yield x[i:i + 4], None

    fit_pca(model, batches(), max_images=8, variance=0.6, multiple=8)
    assert drawn == [0, 4]


@pytest.mark.parametrize("max_images", [0, -3])
def test_pca_fit_of_no_images_is_refused(max_images):
    """Was: a NaN projection (the teacher ran on an empty slice of the first batch and its 0 images were divided
    by), returned without a word."""
    with pytest.raises(ValueError, match=rf"max_images={max_images}: the PCA needs at least one image"):
        fit_pca(tiny_vit(depth=1), [(images(4, seed=4), None)], max_images=max_images, variance=0.6, multiple=8)


class _RowFeatures(torch.nn.Module):
    """A "teacher" whose penultimate() returns the rows of `f` that its "images" (row indices) name."""

    def __init__(self, f):
        super().__init__()
        self.f = f
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward_features(self, i):
        return self.f[i]

    def forward_head(self, h, pre_logits):
        return h


def test_pca_sums_the_moments_of_every_rank(monkeypatch):
    # two ranks with the same features: the summed mean and covariance equal one rank's, written out here
    import quant.gplq.pca as pca_module
    # sums double; a maximum (the feature width) is the same on both ranks
    monkeypatch.setattr(pca_module, "all_reduce", lambda t, op="sum": t.mul_(2) if op == "sum" else t)
    g = torch.Generator().manual_seed(0)
    f = torch.randn(50, 6, generator=g, dtype=torch.float64) * torch.arange(1, 7) + 2.0
    pca = fit_pca(_RowFeatures(f), [(torch.arange(50), None)], max_images=50, variance=0.8, multiple=1)
    mean = f.mean(0)
    cov = (f - mean).t() @ (f - mean) / 50
    evals, evecs = torch.linalg.eigh(cov)
    torch.testing.assert_close(pca.mean.double(), mean, rtol=1e-6, atol=1e-6)
    k = pca.dims
    assert pca.samples == 100 and k < 6
    top = evecs.flip(1)[:, :k]
    torch.testing.assert_close(pca.components.double() @ pca.components.double().t(), top @ top.t(), atol=1e-5,
                               rtol=0)
    assert pca.explained == pytest.approx(float(evals.flip(0)[:k].sum() / evals.sum()), rel=1e-5)


class _StopAfterStage1Settings(Exception):
    pass


def test_default_stage1_lr_follows_the_global_batch_over_all_ranks(monkeypatch):
    # 8 ranks x 16: the paper's 8-GPU lr 5e-6, not the 1-GPU 1e-6 of the per-rank batch
    monkeypatch.setattr(gplq_pipeline, "world_size", lambda: 8)
    seen = {}

    def stop(student, teacher, fit_pca, batches, settings, checkpoint, config, preemption=None):
        seen["settings"] = settings
        raise _StopAfterStage1Settings

    monkeypatch.setattr(gplq_pipeline, "run_stage1", stop)
    with pytest.raises(_StopAfterStage1Settings):
        PIPELINES["gplq"](tiny_vit(depth=1), None, "w4a4", dict(batch_size_per_gpu=16, init_images=4),
                          data=cpu_pipeline_data(num_images=16))
    assert seen["settings"].lr == 5e-6 and seen["settings"].scale_lr == 5e-6


def test_stage1_pca_honours_its_variance_multiple_and_image_count():
    data = cpu_pipeline_data(num_images=24)
    opts = dict(steps=1, batch_size_per_gpu=4, init_images=4, pca_images=20, pca_variance=0.97, pca_multiple=5,
                qwt=False)
    _, report = PIPELINES["gplq"](tiny_vit(depth=1), None, "w4a4", opts, data=data)
    stage1 = report["stage1"]
    assert stage1["pca_samples"] == 20 and stage1["pca_dims"] % 5 == 0 and stage1["pca_explained"] >= 0.97


class _StopAtStage1(Exception):
    pass


def _stage1_start(monkeypatch, options, watched):
    """Run GPLQ on a one-block ViT up to the start of stage 1; {FQN: (quantizer, the input its calibration saw)}
    for every quantizer whose last name segment is in `watched`."""
    seen = {}
    real_quantize = gplq_pipeline.quantize_model

    def quantize_and_hook(model, spec):  # capture what each watched quantizer sees at calibration
        qmodel = real_quantize(model, spec)
        for name, mod in qmodel.named_modules():
            if name.rsplit(".", 1)[-1] in watched:
                mod.register_forward_pre_hook(
                    lambda m, args, name=name: None if name in seen else seen.update({name: (m, args[0].clone())}))
        return qmodel

    def stop(student, *args):
        raise _StopAtStage1

    monkeypatch.setattr(gplq_pipeline, "quantize_model", quantize_and_hook)
    monkeypatch.setattr(gplq_pipeline, "run_stage1", stop)
    with pytest.raises(_StopAtStage1):
        PIPELINES["gplq"](tiny_vit(depth=1), None, "w4a4", dict(init_images=4, **options),
                          data=cpu_pipeline_data(num_images=8))
    return seen


def test_stage1_matmul_operands_start_from_the_matmul_percentile_range_per_head(monkeypatch):
    """After the init calibration, q, k, the softmax output and v each start at the symmetric per-head range of
    [q(1 - p), q(p)] of the operand the calibration pass fed them (p = matmul_percentile): scale =
    max(|q(1 - p)|, |q(p)|) / 7 at 4 bits, zero point 0, with torch.quantile on the captured operand."""
    p = 0.95
    seen = _stage1_start(monkeypatch, dict(matmul_percentile=p), ("q_quant", "k_quant", "attn_quant", "v_quant"))
    assert sorted(n.rsplit(".", 1)[-1] for n in seen) == ["attn_quant", "k_quant", "q_quant", "v_quant"]
    for name, (q, x) in seen.items():
        rows = x.movedim(1, 0).reshape(x.shape[1], -1)  # [B, H, N, D] -> one row per head
        lo, hi = torch.quantile(rows, 1 - p, dim=1), torch.quantile(rows, p, dim=1)
        want = torch.maximum(lo.abs(), hi.abs()) / 7
        assert (hi < rows.amax(dim=1)).all(), name  # the percentile clips: min-max would give another scale
        torch.testing.assert_close(q.scale.detach(), want, rtol=1e-5, atol=0, msg=name)
        assert (q.zero_point == 0).all(), name


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_stage1_block_linear_inputs_start_from_their_min_max_at_act_granularity(monkeypatch, granularity):
    """qkv, proj, fc1 and fc2 inputs start at the symmetric min-max range of what calibration fed them: scale
    max|x| / 7 per input channel (the paper) or over the whole tensor (act_granularity=tensor)."""
    seen = _stage1_start(monkeypatch, dict(act_granularity=granularity), ("input_quantizer",))
    inside = {n: v for n, v in seen.items() if n.startswith("blocks.")}
    assert len(inside) == 4
    for name, (q, x) in inside.items():
        flat = x.reshape(-1, x.shape[-1]).abs()
        want = (flat.amax(dim=0) if granularity == "channel" else flat.amax().reshape(1)) / 7
        torch.testing.assert_close(q.scale.detach(), want, rtol=1e-6, atol=0, msg=name)


def test_lsq_asymmetric_codes_keep_their_zero_point_and_a_frozen_scale_passes_gradients_straight_through():
    """Asymmetric codes [0, 15] with a nonzero zero point: (clamp(round(x / s) + z, 0, 15) - z) * s written out in
    float64, on the training path; with the scale frozen (stage 2) but autograd on, the input gradient is the
    upstream one for codes strictly inside the range and 0 for codes beyond it (straight-through rounding)."""
    g = torch.Generator().manual_seed(4)
    q = LSQQuantizer(4, symmetric=False, channel_dim=-1, num_channels=3, search=RangeSearch("minmax"))
    x = torch.randn(5, 8, 3, generator=g) + torch.tensor([2.0, -1.0, 0.5])
    q.calibrating = True
    q(x)
    q.calibrating = False
    q.make_learnable(scale=True)
    with torch.no_grad():
        q.scale.mul_(0.7)  # some codes beyond both ends
    s, z = q.scale.detach().double(), q.zero_point.double()
    assert (z != 0).all()
    codes = torch.round(x.double() / s) + z
    want = (codes.clamp(0, 15) - z) * s
    torch.testing.assert_close(q(x).double(), want, rtol=0, atol=1e-6)
    q.scale.requires_grad_(False)
    x.requires_grad_(True)
    upstream = torch.randn(x.shape, generator=g)
    (q(x) * upstream).sum().backward()
    inside, beyond = (codes > 0) & (codes < 15), (codes < 0) | (codes > 15)
    assert inside.any() and beyond.any()
    torch.testing.assert_close(x.grad[inside], upstream[inside])
    assert (x.grad[beyond] == 0).all()


def test_pca_component_rule_at_its_edges():
    """On a known diagonal covariance (eigenvalues exact): a fraction that equals the target reaches it (the
    smallest k with ratio >= variance), and a count rounded up past the feature width is capped at the width."""
    def moments(evals):  # zero mean, covariance diag(evals), from one "sample" per unit of n
        cov = torch.diag(torch.tensor(evals, dtype=torch.float64))
        return torch.zeros(len(evals), dtype=torch.float64), cov, torch.tensor(1.0, dtype=torch.float64)

    exact = components_from_moments(*moments([2.0, 1.0, 1.0]), 0.5, 1)  # ratios 0.5, 0.75, 1
    assert exact.dims == 1 and exact.explained == 0.5
    width = 40  # not a multiple of 32: the rule's 64 exceeds it
    capped = components_from_moments(*moments([float(width - i) for i in range(width)]), 0.99, 32)
    assert capped.dims == width and capped.explained == pytest.approx(1.0)


def test_pca_fit_pools_the_covariance_of_every_batch():
    """Batches of 7, 20 and 33 rows, 50 images used: mean, top subspace and explained fraction equal the
    eigendecomposition (float64, torch.linalg.eigh) of the biased covariance of the first 50 rows, by hand."""
    g = torch.Generator().manual_seed(6)
    f = torch.randn(60, 6, generator=g, dtype=torch.float64) * torch.tensor([6.0, 5, 4, 3, 2, 1]) - 1.0
    rows = torch.arange(60)
    batches = [(rows[:7], None), (rows[7:27], None), (rows[27:], None)]
    pca = fit_pca(_RowFeatures(f), batches, max_images=50, variance=0.7, multiple=1)
    used = f[:50]
    mean = used.mean(0)
    evals, evecs = torch.linalg.eigh((used - mean).t() @ (used - mean) / 50)
    evals, evecs = evals.flip(0), evecs.flip(1)
    k = int((torch.cumsum(evals, 0) / evals.sum() < 0.7).sum()) + 1
    assert pca.samples == 50 and pca.dims == k
    torch.testing.assert_close(pca.mean.double(), mean, rtol=1e-6, atol=1e-6)
    top = evecs[:, :k]  # signs are free: compare projectors
    torch.testing.assert_close(pca.components.double() @ pca.components.double().t(), top @ top.t(), rtol=0,
                               atol=1e-5)
    assert pca.explained == pytest.approx(float(evals[:k].sum() / evals.sum()), rel=1e-5)


def test_pca_projection_loads_onto_the_asked_device_and_of_no_images_is_refused():
    pca = PCAProjection(torch.randn(4), torch.randn(4, 2), 0.6, 9)
    moved = PCAProjection.from_state_dict(pca.state_dict(), torch.device("meta"))
    assert moved.mean.device.type == "meta" and moved.components.device.type == "meta"
    assert (moved.dims, moved.explained, moved.samples) == (2, 0.6, 9)
    with pytest.raises(ValueError, match="no images for the PCA"):  # an empty loader
        fit_pca(tiny_vit(depth=1), [], max_images=4, variance=0.6, multiple=8)


def test_qwt_drops_a_fit_whose_r2_is_undefined():
    """A constant difference has no variance (SST = 0): R^2 is undefined, as 1 - SSE / 0 is in QwT's code, so
    it counts as not above 0 and the compensation is not kept."""
    x = torch.randn(2, 10, 4, generator=torch.Generator().manual_seed(3))
    fit = fit_block_compensation(x, lambda t: torch.zeros(*t.shape[:-1], 3),
                                 lambda t: torch.full((*t.shape[:-1], 3), 2.0), 2)
    assert fit.r2 == 0.0 and not fit.keep


@pytest.mark.parametrize("qwt", [True, False])
def test_stage2_freezes_the_model_turns_on_every_weight_quantizer_and_reports_what_it_kept(qwt):
    """From stage 1's state (W32, training mode, every parameter trainable): afterwards no parameter trains, the
    model is in eval mode, every weight quantizer is on and puts its layer's weight on its per-output-channel
    grid (codes w_q / s + z are integers in [qmin, qmax], checked by hand), and the report counts the kept
    fits; without QwT no block is fitted nor compensated."""
    qmodel, _ = PIPELINES["percentile"](tiny_vit(depth=3), images(4), "w4a4")
    set_quant_state(qmodel, weights=False)
    qmodel.train().requires_grad_(True)
    c = qmodel.embed_dim
    fits = {"blocks.0": _fit(-0.2, 1.0, 0.5, c), "blocks.1": _fit(0.3, 1.0, 2.0, c),
            "blocks.2": _fit(0.3, 2.0, 1.0, c)}
    asked = []
    options = PIPELINES["gplq"].Options(qwt=qwt)
    report = quantize_weights_and_compensate(qmodel, None, options,
                                             lambda unit, ref: asked.append(unit) or fits[unit], StageTimer(),
                                             torch.device("cpu"))
    assert not any(p.requires_grad for p in qmodel.parameters()) and not qmodel.training
    layers = quantized_layers(qmodel)
    assert report["weights_refit"] == len(layers)
    for name, layer in layers:
        q = layer.weight_quantizer
        assert q.enabled, name
        with torch.no_grad():
            shape = (-1, *[1] * (layer.weight.dim() - 1))
            codes = (q(layer.weight).double() / q.scale.double().reshape(shape)
                     + q.zero_point.double().reshape(shape))
        torch.testing.assert_close(codes, codes.round().clamp(q.qmin, q.qmax), rtol=0, atol=1e-4, msg=name)
    compensated = [hasattr(b, "qwt_compensation") for b in qmodel.blocks]
    if qwt:
        assert asked == ["blocks.0", "blocks.1", "blocks.2"] and compensated == [False, False, True]
        assert report["qwt"]["kept"] == 1 and report["qwt"]["images"] == options.stage2_images
    else:
        assert asked == [] and not any(compensated)
        assert report["qwt"] == {"blocks": [], "kept": 0, "images": 0, "target": options.qwt_target}


def test_stage1_refuses_an_empty_loader_and_a_stop_it_could_not_save():
    """Both refusals come before any work: fit_pca is never called, and each names what to change."""
    settings = Stage1Settings(steps=1, batch_size_per_gpu=4, lr=1e-3, scale_lr=1e-3, weight_decay=0.0, pca_weight=1.0,
                              amp="none", log_every=1, ckpt_every=0, seed=0)

    def no_pca():
        raise AssertionError("the PCA was fitted")

    student, teacher = tiny_vit(depth=1), tiny_vit(seed=1, depth=1)
    with pytest.raises(ValueError, match="the stage-1 training loader is empty"):
        run_stage1(student, teacher, no_pca, [], settings, None, {})
    batches = cpu_pipeline_data(num_images=8).train_loader(4, 0)
    with pytest.raises(ValueError, match="pass checkpoint"):
        run_stage1(student, teacher, no_pca, batches, settings, None, {}, preemption=object())


def test_gplq_layout_is_lsq_symmetric_activations_per_channel_and_head_and_weights_per_output_channel(monkeypatch):
    """The paper's layout, read off the quantized model: every block activation quantizer is an LSQQuantizer with
    symmetric codes [-8, 7] and zero point 0, per input channel (Linear inputs) or per head (q, k, softmax
    output, v); every block weight quantizer per output channel. The caller's float model (training mode,
    trainable) comes back as it went in: the teacher is a copy, and the PCA is the float teacher's (no quantizer)."""
    model = tiny_vit(depth=1).train()
    before = copy.deepcopy(model.state_dict())
    pca_of = []
    real_fit_pca = gplq_pipeline.fit_pca
    monkeypatch.setattr(gplq_pipeline, "fit_pca",
                        lambda teacher, *a, **kw: pca_of.append(teacher) or real_fit_pca(teacher, *a, **kw))
    opts = dict(steps=1, batch_size_per_gpu=4, init_images=4, pca_images=4, qwt=False)
    qmodel, _ = PIPELINES["gplq"](model, None, "w4a4", opts, data=cpu_pipeline_data(num_images=8))
    assert model.training and all(p.requires_grad for p in model.parameters())
    assert len(pca_of) == 1 and pca_of[0] is not model and not list(named_quantizers(pca_of[0]))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    acts = [(n, q) for n, q in named_quantizers(qmodel, "activation") if n.startswith("blocks.")]
    heads = [n.rsplit(".", 1)[-1] for n, _ in acts if n.rsplit(".", 1)[-1].endswith("_quant")]
    assert sorted(heads) == ["attn_quant", "k_quant", "q_quant", "v_quant"] and len(acts) == 8
    for name, q in acts:
        assert isinstance(q, LSQQuantizer) and (q.qmin, q.qmax) == (-8, 7) and (q.zero_point == 0).all(), name
        per_head = name.endswith("_quant")
        assert q.scale.numel() == (3 if per_head else qmodel.get_submodule(name.rsplit(".", 1)[0]).in_features)
    weights = [(n, q) for n, q in named_quantizers(qmodel, "weight") if n.startswith("blocks.")]
    assert len(weights) == 4
    for name, q in weights:
        layer = qmodel.get_submodule(name.rsplit(".", 1)[0])
        assert q.channel_dim == 0 and q.scale.numel() == layer.out_features, name


def test_stage1_without_the_pca_loss_fits_no_pca_runs_no_teacher_and_steps_on_the_ce_alone(tmp_path):
    """pca_weight 0: the teacher PCA is never fitted and the teacher never run (in the first run nor on resume);
    the update is AdamW's on the CE written out here, and the report has no PCA."""
    class NoTeacher(nn.Module):
        def forward(self, x):
            raise AssertionError("the teacher ran at pca_weight 0")

    def no_pca():
        raise AssertionError("the teacher PCA was fitted at pca_weight 0")

    student = tiny_vit(depth=1)
    start = copy.deepcopy(student)
    batches = cpu_pipeline_data(num_images=8).train_loader(4, 0)
    x, y = next(iter(batches.loader))
    lr = 1e-3
    settings = Stage1Settings(steps=1, batch_size_per_gpu=4, lr=lr, scale_lr=lr, weight_decay=0.0, pca_weight=0.0,
                              amp="none", log_every=1, ckpt_every=0, seed=0)
    path = str(tmp_path / "stage1.pt")
    out = run_stage1(student, NoTeacher(), no_pca, batches, settings, path, {"run": 1})
    ref = copy.deepcopy(start).train()
    logits = ref(x)
    (-torch.log_softmax(logits, dim=1)[torch.arange(4), y].mean()).backward()
    for (name, p0), p1 in zip(ref.named_parameters(), student.parameters()):
        clear = p0.grad.abs() > 1e-5  # as in the CE + PCA test: AdamW's first step is lr * sign(g)
        want = p0.detach() - lr * p0.grad / (p0.grad.abs() + 1e-8)
        torch.testing.assert_close(p1.detach()[clear], want[clear], rtol=0, atol=lr * 1e-2, msg=name)
    assert (out["pca"], out["pca_dims"], out["pca_explained"], out["pca_samples"]) == (None,) * 4
    resumed = run_stage1(tiny_vit(depth=1), NoTeacher(), no_pca, batches, dataclasses.replace(settings, steps=2),
                         path, {"run": 1})
    assert (resumed["resumed_from"], resumed["steps"], resumed["pca_dims"]) == (1, 2, None)


def test_stage1_resumes_with_the_checkpoints_pca_without_refitting_it(tmp_path):
    settings = Stage1Settings(steps=1, batch_size_per_gpu=4, lr=1e-3, scale_lr=1e-3, weight_decay=0.0, pca_weight=1.0,
                              amp="none", log_every=1, ckpt_every=0, seed=0)
    teacher = tiny_vit(seed=1, depth=1).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    pca = PCAProjection(torch.randn(48, generator=g), torch.linalg.qr(torch.randn(48, 8, generator=g))[0], 0.6, 10)
    batches = cpu_pipeline_data(num_images=8).train_loader(4, 0)
    path = str(tmp_path / "stage1.pt")
    run_stage1(tiny_vit(depth=1), teacher, lambda: pca, batches, settings, path, {"run": 1})

    def refit():
        raise AssertionError("the PCA was fitted again on resume")

    out = run_stage1(tiny_vit(depth=1), teacher, refit, batches, dataclasses.replace(settings, steps=2), path,
                     {"run": 1})
    assert (out["resumed_from"], out["steps"], out["pca_samples"], out["pca_dims"]) == (1, 2, 10, 8)
