"""A layer called several times in one forward (a detector's shared RPN head: rpn_conv, rpn_cls and rpn_reg run
once per FPN level, P2 first) is calibrated on its first call, as quant/README.md and quant/gplq/detector.py
state: each quantizer fits on the first input it sees (RepQ-ViT's first-call initialisation), for percentile,
RepQ-ViT and GPLQ's LSQ start alike. Plain torch: a one-conv "RPN head" applied to two levels, the second ten
times the first, so that a range pooled over both calls would show."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from quant import PIPELINES
from quant.modes import named_quantizers
from quant.spec import parse_bits

INPUT = "rpn_head.rpn_conv.input_quantizer"


class SharedHead(nn.Module):
    """A detector's RPN head in shape: one conv run on every FPN level in turn (MMDetection's multi_apply)."""

    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.rpn_head = nn.Module()
        self.rpn_head.rpn_conv = nn.Conv2d(channels, channels, 1)

    def forward(self, levels):
        return [self.rpn_head.rpn_conv(level) for level in levels]


class LevelFeed:
    """One calibration forward on the FPN levels (a `calibrate.ModelFeed` and a one-batch `units.SampleFeed`)."""

    def __init__(self, levels) -> None:
        self.levels = levels

    def __len__(self) -> int:
        return 1

    def run(self, model, index):
        return model(self.levels)

    def feed(self, model) -> int:
        self.run(model, 0)
        return 1


def levels():
    torch.manual_seed(0)
    p2 = torch.randn(1, 3, 4, 4)
    return [p2, 10 * torch.randn(1, 3, 2, 2)]  # P3 far wider: a pooled range would be about ten times P2's


class _Started(Exception):
    pass


def test_gplqs_lsq_start_of_a_shared_conv_is_its_first_calls_per_channel_absolute_maximum():
    """GPLQ on a detector: a conv input is symmetric per input channel at 4 bits, so its LSQ start is
    max |P2| per channel / 7, by hand; P3's ten-times-wider values do not enter it."""
    import quant.gplq.detector as gplq_detector
    from configs.quant import GPLQ_DETECTION, GPLQOptions
    from quant.gplq.pipeline import default_lr
    from quant.pipeline_data import PipelineData
    from quant_models import unread_samples
    options = dataclasses.replace(GPLQOptions(), **{**GPLQ_DETECTION, "init_images": 1})
    feed, seen = LevelFeed(levels()), {}

    def stage1(student, settings, work_dir):
        seen.update(named_quantizers(student, "activation"))
        raise _Started
    bits = parse_bits("w4a4")
    with pytest.raises(_Started):
        gplq_detector.quantize_detector(PIPELINES["gplq"].layout(bits, options), SharedHead(), feed, bits, options,
                                        PipelineData(train_detector=stage1, detector_samples=unread_samples),
                                        default_lr)
    p2, p3 = feed.levels
    first = p2.double().abs().amax(dim=(0, 2, 3))
    scale = seen[INPUT].scale.detach().double().flatten()
    torch.testing.assert_close(scale, first / 7, rtol=1e-6, atol=0)
    pooled = torch.maximum(first, p3.double().abs().amax(dim=(0, 2, 3)))
    assert (pooled > 2 * first).all()  # else the check could not tell the first call from the pooled calls


@pytest.mark.parametrize("pipeline", ["percentile", "repq"])
def test_percentile_and_repq_fit_a_shared_conv_on_its_first_call(pipeline):
    """A detector head's input is per tensor (asymmetric, percentile candidates): its range lies within P2's, so
    P3's values ten times wider are clipped at P2's maximum (one quantization step of slack)."""
    feed = LevelFeed(levels())
    model, _ = PIPELINES[pipeline](SharedHead(), feed, "w4a4")
    q = dict(named_quantizers(model))[INPUT]
    p2, p3 = feed.levels
    step = float(q.scale.max())
    top = float(q(torch.full((1, 3, 1, 1), float(p3.max()))).max())
    bottom = float(q(torch.full((1, 3, 1, 1), float(p3.min()))).min())
    assert top <= float(p2.max()) + step and bottom >= float(p2.min()) - step
    assert float(p3.max()) > 2 * float(p2.max()) and float(p3.min()) < 2 * float(p2.min())  # the check can tell


def test_the_docs_state_that_a_shared_layer_is_calibrated_on_its_first_call():
    """What the tests above pin is what the detector docs say (they said "min/max per channel" of the calibration
    batch, which a layer run once per FPN level does not get)."""
    import os
    import quant.gplq.detector as gplq_detector
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "quant", "README.md")) as f:
        readme = " ".join(f.read().split())
    assert "Each quantizer fits on the first call it sees" in readme
    assert "is calibrated on P2 alone" in readme and "first call (the shared RPN head's on P2" in readme
    assert "each quantizer on its first call" in " ".join(gplq_detector.__doc__.split())
