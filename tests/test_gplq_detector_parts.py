"""GPLQ's detector parts in plain torch (no MMDetection needed): QwT fitted by streaming a model through a
`SampleFeed` (images of different sizes, blocks called as block(x, hw_shape)) equals the least-squares fit
computed directly on the pooled tokens, and a reference that calls the block itself inside the stream is not
counted as another call; stage 1 on a detector gets the options it was asked for and the paper's lr for the
global batch, and its resume identity holds them."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from quant import PIPELINES
from quant.gplq.detector import stage1_identity as detector_identity
from quant.gplq.qwt import fit_block_compensation_streamed
from quant.modes import named_quantizers
from quant.pipeline_data import PipelineData
from quant.spec import parse_bits
from quant_models import ImageFeed, tiny_vit, unread_samples


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c, c)

    def forward(self, x, hw_shape):
        assert x.shape[1] == hw_shape[0] * hw_shape[1]
        return x + torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self, c: int = 5) -> None:
        super().__init__()
        self.stem = nn.Linear(3, c)
        self.blocks = nn.ModuleList([Block(c), Block(c)])

    def forward(self, image):
        b, _, h, w = image.shape
        x = self.stem(image.flatten(2).transpose(1, 2))
        for block in self.blocks:
            x = block(x, (h, w))
        return x


@pytest.mark.parametrize("own_block", [False, True], ids=["other-block", "same-block"])
def test_streamed_compensation_is_the_least_squares_fit_on_the_pooled_tokens(own_block):
    # same-block: the reference runs the fitted block itself (GPLQ's W32A4 / float reference is the block with
    # its quantizers off), and that inner call must be neither handed on nor counted
    torch.manual_seed(0)
    net = Net().double()
    other = Block(5).double()  # the "float" block the compensation moves towards
    reference_block = (lambda x, hw: 0.5 * net.blocks[1](x, hw) + x.cos()) if own_block else other
    images = [torch.randn(1, 3, h, w, dtype=torch.float64) for h, w in ((3, 4), (5, 2), (2, 2))]
    calls = []

    def reference(x, hw):
        calls.append(hw)
        return reference_block(x, hw)

    fit = fit_block_compensation_streamed(net, "blocks.1", ImageFeed(images), reference)
    assert calls == [(3, 4), (5, 2), (2, 2)]

    xs, ds = [], []
    with torch.no_grad():
        for image in images:
            _, _, h, w = image.shape
            x = net.blocks[0](net.stem(image.flatten(2).transpose(1, 2)), (h, w))[0]
            xs.append(x)
            ds.append(reference_block(x[None], (h, w))[0] - net.blocks[1](x[None], (h, w))[0])
    X, D = torch.cat(xs), torch.cat(ds)
    A = torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype)], dim=1)
    solution = torch.linalg.lstsq(A, D).solution
    assert torch.allclose(fit.weight.double(), solution[:-1].t(), atol=1e-4)
    assert torch.allclose(fit.bias.double(), solution[-1], atol=1e-4)
    sse = float((A @ solution - D).pow(2).sum())
    sst = float((D - D.mean(0)).pow(2).sum())
    assert abs(fit.r2 - (1 - sse / sst)) < 1e-6


def test_detector_options_refuse_the_pca_loss_and_an_lsq_start_of_another_batch():
    """GPLQ on a detector trains without the PCA loss and initialises LSQ on the --calib-images batch."""
    import dataclasses
    from configs.quant import GPLQ_DETECTION, GPLQOptions
    from quant.gplq.detector import check_detector_options
    detection = dataclasses.replace(GPLQOptions(), **GPLQ_DETECTION, init_images=2)
    check_detector_options(detection, calib_count=2)
    with pytest.raises(ValueError, match="init_images=2 but the calibration batch holds 1 images"):
        check_detector_options(detection, calib_count=1)
    with pytest.raises(ValueError, match="init_images=2 but the calibration batch holds 3 images"):
        check_detector_options(detection, calib_count=3)  # a larger batch is refused too, not cut to init_images
    with pytest.raises(ValueError, match="pca_weight=0.5"):
        check_detector_options(dataclasses.replace(detection, pca_weight=0.5), calib_count=2)
    with pytest.raises(ValueError, match="stage2_train_transform=True"):
        check_detector_options(dataclasses.replace(detection, stage2_train_transform=True), calib_count=2)
    # read only for QwT's images: at qwt=false it is the class default (evaluate_detection.py leaves the recipe's
    # False out there), which was refused too, so GPLQ without QwT ran on no detector
    check_detector_options(dataclasses.replace(detection, qwt=False, stage2_train_transform=True), calib_count=2)


@pytest.mark.parametrize("given", [{"steps": 0}, {"steps": 0, "qwt": False}, {"qwt": False}])
def test_the_detection_recipe_passes_the_options_rules_with_stage1_or_qwt_off(given):
    """The recipe's batch_size_per_gpu=1 (GPLQ_DETECTION) is handed to a detector whatever the steps, where the
    user's batch is refused at steps 0 (configs/loader.py DETECTOR_ONLY): the options' own rules must not refuse
    the recipe's (a classifier's rule, CLASSIFIER_ONLY, reads it for QwT at steps 0)."""
    from types import SimpleNamespace

    from evaluate_detection import detection_defaults
    from quant.pipeline_base import parse_options
    handed = {**detection_defaults("gplq", SimpleNamespace(calib_images=1), given), **given}
    assert handed["batch_size_per_gpu"] == 1
    parse_options(PIPELINES["gplq"].Options, handed)


def test_detector_stage1_identity_holds_every_stage1_option():
    model, opts = tiny_vit(depth=1), PIPELINES["gplq"].Options
    base = detector_identity(model, parse_bits("w4a4"), opts(pca_weight=0.0), None, PipelineData())
    for key, value in [("init_images", 7), ("lr", 1e-5), ("seed", 2), ("steps", 3), ("head_a_bits", 8),
                       ("batch_size_per_gpu", 2), ("scale_lr", 1e-4), ("weight_decay", 0.1), ("amp", "bf16"),
                       ("matmul_percentile", 0.999)]:
        assert detector_identity(model, parse_bits("w4a4"), opts(pca_weight=0.0, **{key: value}), None,
                                 PipelineData()) != base, key
    # the training data it was trained on (evaluate_detection.py: the training annotations by content)
    assert detector_identity(model, parse_bits("w4a4"), opts(pca_weight=0.0), None,
                             PipelineData(identity={"train_annotations_sha256": "ab"})) != base


@pytest.mark.parametrize("key, value", [("pca_variance", 0.5), ("pca_multiple", 8), ("pca_images", 64)])
def test_detector_options_refuse_pca_settings_it_never_applies(key, value):
    import dataclasses
    from configs.quant import GPLQ_DETECTION, GPLQOptions
    from quant.gplq.detector import check_detector_options
    detection = dataclasses.replace(GPLQOptions(), **GPLQ_DETECTION)
    with pytest.raises(ValueError, match=f"{key}={value}: .*PCA settings do not apply"):
        check_detector_options(dataclasses.replace(detection, **{key: value}))


class SwinBlock(nn.Module):
    """MMDetection's name of a Swin block's fc2 (ffn.layers.1): forward(x, hw_shape)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.ffn = nn.Module()
        self.ffn.layers = nn.ModuleList([nn.Identity(), nn.Linear(c, c)])

    def forward(self, x, hw_shape):
        return x + self.ffn.layers[1](x)


class ToyDetector(nn.Module):
    """A detector's module names (backbone.stages.0.blocks.0, neck) in plain torch."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.backbone = nn.Module()
        stage = nn.Module()
        stage.blocks = nn.ModuleList([SwinBlock(c)])
        self.backbone.stages = nn.ModuleList([stage])
        self.neck = nn.Sequential(nn.Conv2d(c, c, 1))

    def forward_image(self, image):
        b, c, h, w = image.shape
        x = self.backbone.stages[0].blocks[0](image.flatten(2).transpose(1, 2), (h, w))
        return self.neck(x.transpose(1, 2).reshape(b, c, h, w))


class CalibFeed(ImageFeed):
    def feed(self, model):
        for i in range(len(self)):
            self.run(model, i)
        return len(self)


class _Started(Exception):
    pass


@pytest.mark.parametrize("given, world, lr, scale_lr", [
    (dict(batch_size_per_gpu=16), 4, 2.5e-6, 2.5e-6),  # the paper's lr for a global batch of 64 (16 x 4 ranks)
    (dict(batch_size_per_gpu=1, steps=5, lr=3e-4, scale_lr=2e-3, weight_decay=0.05, amp="bf16", seed=9,
          log_every=3, ckpt_every=4), 2, 3e-4, 2e-3)])
def test_detector_stage1_gets_the_asked_settings_and_the_papers_lr_for_the_global_batch(monkeypatch, given, world,
                                                                                        lr, scale_lr):
    import dataclasses
    import quant.gplq.detector as gplq_detector
    from configs.quant import GPLQ_DETECTION, GPLQOptions
    from quant.gplq.pipeline import default_lr
    from quant.pipeline_data import PipelineData
    monkeypatch.setattr(gplq_detector, "world_size", lambda: world)
    options = dataclasses.replace(GPLQOptions(), **{**GPLQ_DETECTION, "init_images": 1, **given})
    seen = {}

    def stage1(student, settings, work_dir):
        seen.update(settings)
        seen["weights_on"] = [q.enabled for _, q in named_quantizers(student, "weight")]
        seen["acts_learnable"] = [q.enabled and q.scale.requires_grad
                                  for _, q in named_quantizers(student, "activation")]
        seen["float_trainable"] = all(p.requires_grad for p in student.parameters())
        raise _Started
    torch.manual_seed(0)
    feed = CalibFeed([torch.randn(1, 4, 3, 2)])
    frozen = ToyDetector().requires_grad_(False)  # as an evaluated model comes: stage 1 must unfreeze it
    with pytest.raises(_Started):
        gplq_detector.quantize_detector(PIPELINES["gplq"].layout(parse_bits("w4a4"), options), frozen, feed,
                                        parse_bits("w4a4"), options, PipelineData(train_detector=stage1,
                                                                                  detector_samples=unread_samples),
                                        default_lr)
    assert seen["lr"] == pytest.approx(lr) and seen["scale_lr"] == pytest.approx(scale_lr)
    for key in ("steps", "batch_size_per_gpu", "weight_decay", "amp", "seed", "log_every", "ckpt_every"):
        assert seen[key] == getattr(options, key), key
    assert seen["identity"]["world_size"] == world
    # W32A4 in stage 1: weight quantizers bypassed, LSQ activation scales and every float weight trained
    assert seen["weights_on"] and not any(seen["weights_on"])
    assert seen["acts_learnable"] and all(seen["acts_learnable"]) and seen["float_trainable"]
    weights, scales = seen["param_groups"]
    assert (weights["lr"], scales["lr"]) == pytest.approx((lr, scale_lr))


def _quantize_toy(options, feed, data, model=None):
    """quantize_detector at W4A4 on a ToyDetector (or `model`) with GPLQ's layout and the paper's lr rule."""
    import quant.gplq.detector as gplq_detector
    from quant.gplq.pipeline import default_lr
    bits = parse_bits("w4a4")
    return gplq_detector.quantize_detector(PIPELINES["gplq"].layout(bits, options), model or ToyDetector(), feed,
                                           bits, options, data, default_lr)


def _detector_options(**given):
    import dataclasses
    from configs.quant import GPLQ_DETECTION, GPLQOptions
    return dataclasses.replace(GPLQOptions(), **{**GPLQ_DETECTION, **given})


def test_detector_stage1_identity_names_the_calibration_images():
    """A resume with another LSQ-start batch is another run: the batch's dataset indices are in the identity."""
    from types import SimpleNamespace
    model, options = tiny_vit(depth=1), PIPELINES["gplq"].Options(pca_weight=0.0)
    first, other = (detector_identity(model, parse_bits("w4a4"), options, SimpleNamespace(indices=indices),
                                      PipelineData())
                    for indices in ([0, 1], [0, 2]))
    assert first["init_batch"] == [0, 1] and first != other


def test_detector_refuses_an_image_tensor_and_a_missing_trainer_before_any_work():
    from quant.pipeline_data import PipelineData
    called = []
    trainer = PipelineData(train_detector=lambda *a: called.append(a), detector_samples=lambda c, s: None)
    with pytest.raises(ValueError, match="initialises on a units.SampleFeed"):
        _quantize_toy(_detector_options(init_images=1), torch.randn(1, 4, 2, 2), trainer)
    feed = CalibFeed([torch.randn(1, 4, 2, 2)])
    with pytest.raises(ValueError, match="PipelineData.train_detector is required"):
        _quantize_toy(_detector_options(init_images=1), feed, PipelineData(detector_samples=lambda c, s: None))
    assert not called


def test_detector_lsq_starts_at_the_calibration_batchs_per_channel_absolute_maximum():
    """The LSQ start is the calibration batch's min/max: the first block's fc2 sees the image tokens themselves
    (ToyDetector), so its symmetric 4-bit scale per channel is max |pixel| over both images / 7, by hand. The batch
    runs in one forward, as DetectorFeed's one padded batch (a quantizer fits on its first call: a feed running one
    forward per image would start it from the first image alone, tests/test_shared_layer_calibration.py)."""
    from quant.pipeline_data import PipelineData
    torch.manual_seed(0)
    images = [torch.randn(1, 4, 2, 2), torch.randn(1, 4, 2, 2)]
    seen = {}

    class OneBatch(CalibFeed):
        def feed(self, model):
            model.forward_image(torch.cat(self.images))
            return len(self)

    def stage1(student, settings, work_dir):
        seen.update(named_quantizers(student, "activation"))
        raise _Started
    with pytest.raises(_Started):
        _quantize_toy(_detector_options(init_images=2), OneBatch(images),
                      PipelineData(train_detector=stage1, detector_samples=unread_samples))
    per_image = torch.stack([image.double().abs().amax(dim=(0, 2, 3)) for image in images])
    assert (per_image[1] > per_image[0]).any()  # the second image sets some channel: the pooling shows
    amax = per_image.amax(0)
    scale = seen["backbone.stages.0.blocks.0.ffn.layers.1.input_quantizer"].scale.detach().double().flatten()
    torch.testing.assert_close(scale, amax / 7, rtol=1e-6, atol=0)


def test_detector_stage2_draws_its_images_with_the_seed_and_fits_qwt_to_the_float_teacher():
    """qwt_target=teacher: each block's QwT reference is the float model's block (a copy taken before
    quantization, by hand), and the QwT images are drawn with the options' seed."""
    import copy
    import quant.gplq.detector as gplq_detector
    from quant.pipeline_data import PipelineData
    torch.manual_seed(0)
    fp = ToyDetector()
    float_block = copy.deepcopy(fp.backbone.stages[0].blocks[0])
    options = _detector_options(init_images=1, seed=9, stage2_images=2, qwt_target="teacher")
    drawn, references = [], []

    def samples(count, seed):
        drawn.append((count, seed))
        return CalibFeed([torch.randn(1, 4, 2, 3), torch.randn(1, 4, 3, 3)])

    def fit(model, unit, feed, reference, ridge):
        references.append(reference)
        return streamed(model, unit, feed, reference, ridge)
    streamed = gplq_detector.fit_block_compensation_streamed
    data = PipelineData(train_detector=lambda student, settings, work_dir: {"steps": 0},
                        detector_samples=samples)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gplq_detector, "fit_block_compensation_streamed", fit)
        _quantize_toy(options, CalibFeed([torch.randn(1, 4, 2, 2)]), data, model=fp)
    assert drawn == [(2, 9)] and len(references) == 1
    x = torch.randn(1, 6, 4)
    with torch.no_grad():
        torch.testing.assert_close(references[0](x, (2, 3)), float_block(x, (2, 3)))
