"""APHQ with a float end and the time estimates of its two long stages.

A fully float stem (`stem_w_bits=0`) or head (`head_w_bits=0`, `head_a_bits=0`) has nothing to reconstruct: the run
completes, that unit keeps the float model's weights and its output, and it is recorded with 0 iterations. The
calibration search's time-left estimate weighs each unit by its Linear and convolution weights (a ViT's patch
embedding searches in a small fraction of a block's time), and the reconstruction's leaves a skipped unit's 0 s out;
both are checked with injected timings, so they hold on any machine's speed."""
import logging
import re

import pytest
import torch
from torch import nn

from engine.metrics import duration
from device_utils import cpu_pipeline_data
from quant import PIPELINES
from quant.aphq import calibration, pipeline
from quant.aphq.adaround import RoundingSchedule
from quant.aphq.reconstruct import ReconSettings, reconstruct_unit_calls
from quant.units import UnitCall
from quant_models import images, perturb_norms, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")

SEARCH = dict(calib_images=4, batch_size=4, eq_n=32, matmul_steps=5, search_rounds=0)  # a short search
SMALL = dict(SEARCH, iters=2, recon_images=8, log_every=0)
FLOAT_END = {"patch_embed": {"stem_w_bits": 0}, "head": {"head_w_bits": 0, "head_a_bits": 0}}


def run_aphq(model: nn.Module, options: dict):
    """APHQ W4A4 of `model` with `options`: (quantized model, report)."""
    return PIPELINES["aphq"](model, None, "w4a4", options, data=cpu_pipeline_data(num_images=8))


@pytest.mark.parametrize("end", sorted(FLOAT_END))
def test_a_float_end_is_skipped_and_keeps_the_float_weights(end, caplog):
    fp = perturb_norms(tiny_vit(depth=1))
    with caplog.at_level(logging.INFO, logger="quant"):
        qmodel, report = run_aphq(fp, {**SMALL, **FLOAT_END[end]})
    iters = {u["unit"]: u["iters"] for u in report["units"]}
    assert iters == {"patch_embed": 2, "blocks.0": 2, "head": 2, end: 0}
    assert re.search(rf"unit \d/3 {end} \(\w+\): float, nothing to reconstruct: skipped", caplog.text)
    got, want = dict(qmodel.get_submodule(end).named_parameters()), dict(fp.get_submodule(end).named_parameters())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    x = images(2) if end == "patch_embed" else torch.randn(2, fp.head.in_features)
    with torch.no_grad():  # no quantizer acts there either
        assert torch.equal(qmodel.get_submodule(end)(x), fp.get_submodule(end)(x))


def test_a_detector_unit_with_nothing_to_learn_is_skipped():
    """A frozen float unit (a detector's float stem) reaches the shared optimisation directly: it is skipped, with
    its input never read, rather than failing at the first backward."""
    unit = nn.Linear(4, 4).requires_grad_(False)
    before = {k: v.clone() for k, v in unit.state_dict().items()}
    calls = [UnitCall((torch.randn(1, 5, 4),), [torch.randn(1, 5, 4)])]
    settings = ReconSettings(iters=3, batch_size=1, weight_lr=1e-3, act_lr=4e-5, drop_prob=1.0, input_mix_prob=0.5,
                             rounding=RoundingSchedule(3, 0.2, 20.0, 2.0, 0.01), normalize_loss=True, log_every=0)
    stats = reconstruct_unit_calls(unit, calls, calls, None, settings, name="backbone.patch_embed")
    assert stats["iters"] == 0
    assert all(torch.equal(v, before[k]) for k, v in unit.state_dict().items())


def test_the_calibration_estimate_weighs_each_unit_by_its_weights(monkeypatch, caplog):
    """Search times injected in proportion to each unit's weights (a fake clock that the searches advance): every
    estimate is then the time the remaining units took, the first one (after the stem) included."""
    fp = tiny_vit(depth=3)
    weights = {name: sum(m.weight.numel() for m in fp.get_submodule(name).modules()
                         if isinstance(m, (nn.Linear, nn.Conv2d)))
               for name in ("patch_embed", "blocks.0", "blocks.1", "blocks.2", "head")}
    assert weights["blocks.0"] > 2 * weights["patch_embed"]  # else the check is void
    seconds = {name: n / 1000 for name, n in weights.items()}  # 1 ms per weight
    clock = [0.0]
    real_capture = calibration.capture_module_calls

    def capture_and_take_time(model, watch, unit_name, *args):
        clock[0] += seconds[unit_name]
        return real_capture(model, watch, unit_name, *args)

    monkeypatch.setattr(calibration, "capture_module_calls", capture_and_take_time)
    monkeypatch.setattr(calibration, "time", type("FakeTime", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    with caplog.at_level(logging.INFO, logger="quant.aphq"):
        run_aphq(fp, {**SEARCH, "iters": 0})  # calibration only
    got = re.findall(r"APHQ calibration: unit (\d)/5 \S+ searched \[[\d.]+s\]; about (\S+) left for the other (\d)",
                     caplog.text)
    names = list(seconds)
    want = [(str(i + 1), duration(sum(seconds[n] for n in names[i + 1:])), str(4 - i)) for i in range(4)]
    assert got == want


def test_the_reconstruction_estimate_leaves_a_skipped_unit_out(monkeypatch, caplog):
    """Each reconstructed unit takes 100 s (injected): after the first block, a float stem's 0 s must not halve the
    time per unit."""
    real = pipeline.reconstruct_unit
    monkeypatch.setattr(pipeline, "reconstruct_unit", lambda *a, **k: {**real(*a, **k), "seconds": 100.0})
    with caplog.at_level(logging.INFO, logger="quant.aphq"):
        # loss=mse: no APH, whose seconds would add to the 100
        run_aphq(tiny_vit(depth=2), {**SMALL, "stem_w_bits": 0, "loss": "mse"})
    assert re.findall(r"APHQ reconstruction: about (\S+) left for the other (\d) units", caplog.text) == [
        ("0:03:20", "2"), ("0:01:40", "1")]  # after blocks.0, blocks.1: 100 s for each unit left
