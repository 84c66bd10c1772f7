"""APHQ-ViT on an MMDetection detector, as GoatWu/APHQ-ViT `Object-Detection/tools` does it (MLP reconstruction
off, as in the CD paper).

The classification steps (pipeline.py) with the detection code's differences:

1. Data: the calibration batch is the entry point's (`evaluate_detection.py --calib-images`, officially one
   image); the reconstruction set is `recon_images` (officially 256) training images, one per batch
   (`PipelineData.detector_samples`). The official code takes the first 256 images of its training loader
   with the training pipeline; ours are drawn with `data_seed` and get the test pipeline (engine/detection/feeds.py).
2. Layout: APHQ's (pipeline.py), the whole detector in scope: the backbone, the FPN neck and the RPN and
   RoI heads (quant/spec.py `DETECTOR_HEADS`); the stem's image input float.
3. Calibration (calibration.py with `conv_search="self"`): fold, then every layer on float inputs; the
   detection defaults (`configs.quant.APHQ_DETECTION`) give percentiles [0.999, 1.0] and no output-MSE
   rounds, and every convolution gets the weight-only / input-only search.
4. Reconstruction, unit by unit: the Swin stem, blocks and patch mergings and the FPN neck, one image per
   iteration in order (reconstruct.py `reconstruct_unit_calls`). The backbone units use the APH weight of
   hessian.py `detector_hessians` (the RPN outputs' binary KL and smooth-L1 under +-1e-3 on the unit output,
   per image), the neck plain MSE and no QDrop inside its quantizers (the official `set_qdrop` reaches
   Linear and matmul quantizers only, and the neck has convolutions only). The RPN and RoI heads are
   calibrated only: their reconstruction is commented out in the official code, so they are switched on, as
   calibrated, at the end.

`iters=0` is calibration only, as on a classifier: steps 1-3, then every unit and head switched on, without the
float RPN outputs, captures or APH weights; it draws no reconstruction images, so `recon_images` and `data_seed`
go unread (evaluate_detection.py refuses them there, and the report's data seed is null).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, List, Protocol, runtime_checkable

import torch
from torch import nn

from configs.quant import APHQOptions

from ..convert import quantize_model
from ..modes import set_quant_state
from ..pipeline_base import PTQResult, StageTimer, isolated_rng, pipeline_report
from ..pipeline_data import PipelineData
from ..spec import Bits, QuantSpec
from ..units import SampleFeed, Unit, capture_unit_calls, check_unit_coverage, find_units
from .calibration import SearchSettings, calibrate_aphq
from .hessian import RPNOutputs, detector_hessians
from .reconstruct import ReconSettings, RoundingSchedule, reconstruct_unit_calls

log = logging.getLogger("quant.aphq")
DETECTOR_UNIT_KINDS = ("stem", "block", "merge", "neck")
CALIBRATED_ONLY = ("rpn_head", "roi_head")  # official: their reconstruction is commented out
DETECTION_EPS = 1e-3  # the official detection perturbation (classification: 1e-6)
MLP_OPTIONS = ("mlp_iters", "mlp_lr", "mlp_clip_percentile", "mlp_clip_weight")  # of MR, off on detectors


@runtime_checkable
class DetectorSamples(SampleFeed, Protocol):
    """A detector's reconstruction images, one per batch, that also give the raw RPN outputs of an image
    (with gradients) for the APH weight: engine/detection/feeds.py's `DetectorSamples`."""

    def rpn_outputs(self, model: nn.Module, index: int) -> RPNOutputs: ...


def detection_eps(options: APHQOptions) -> float:
    """A detector's APH perturbation: hessian_eps, or where it is None the official DETECTION_EPS."""
    return options.hessian_eps if options.hessian_eps is not None else DETECTION_EPS


def check_detector_options(options: APHQOptions) -> None:
    """Refuse the APHQ options that have no detector form here (before any work)."""
    if options.mlp_reconstruct:
        raise ValueError("mlp_reconstruct=True: MLP reconstruction is not built for detectors (the CD paper's APHQ "
                         "column turns it off); leave it False")
    unused = [f"{key}={getattr(options, key)}" for key in MLP_OPTIONS
              if getattr(options, key) != getattr(APHQOptions(), key)]
    if unused:
        raise ValueError(f"{', '.join(unused)}: a detector is reconstructed without MLP reconstruction, so the MLP "
                         "settings do not apply; leave them at their defaults")
    if options.hessian_probe != "ones":
        raise ValueError(f"hessian_probe={options.hessian_probe!r}: a detector's APH uses the official all-ones "
                         "probe; leave hessian_probe='ones'")
    if options.temperature != APHQOptions().temperature:
        raise ValueError(f"temperature={options.temperature}: the KL temperature is for a classifier's logits; a "
                         "detector's APH comes from its RPN outputs (hessian.py rpn_output_loss) and has none")
    if options.batch_size != 1:
        raise ValueError(f"batch_size={options.batch_size}: a detector's images differ in size, so APHQ takes "
                         "one image per batch (batch_size=1, as officially)")


def quantize_detector(layout: QuantSpec, fp_model: nn.Module, calib: Any, bits: Bits, options: APHQOptions,
                      data: PipelineData) -> PTQResult:
    """APHQ on a detector (module docstring); `layout` is APHQPipeline.layout(bits, options)."""
    check_detector_options(options)
    if not isinstance(calib, SampleFeed):
        raise ValueError("APHQ on a detector calibrates on a units.SampleFeed (evaluate_detection.py's "
                         "DetectorFeed), not on an image tensor")
    if getattr(calib, "count", options.calib_images) != options.calib_images:
        raise ValueError(f"calib_images={options.calib_images} but the calibration batch holds {calib.count} "
                         "images: give the count with evaluate_detection.py --calib-images")
    timer = StageTimer()
    device = next(fp_model.parameters()).device
    cache = torch.device(options.cache_device) if options.cache_device else device
    samples = None  # iters=0 reconstructs nothing, so it draws no reconstruction images (the calibration is calib's)
    if options.iters > 0:
        with timer("data", device):
            samples = data.draw_detector_samples(options.recon_images, options.data_seed,
                                                 f"recon_images={options.recon_images}")
        if not isinstance(samples, DetectorSamples):
            raise TypeError("PipelineData.detector_samples must give a quant.aphq.detector.DetectorSamples")
    with isolated_rng(options.seed, device):
        model, report = _quantize(layout, fp_model, calib, samples, bits, options, timer, device, cache)
    report["seconds"] = timer.seconds
    return PTQResult(model, report)


def _quantize(layout: QuantSpec, fp_model: nn.Module, calib: SampleFeed, samples: DetectorSamples | None, bits: Bits,
              options: APHQOptions, timer: StageTimer, device: torch.device, cache: torch.device):
    frozen = copy.deepcopy(fp_model).eval().requires_grad_(False)  # the float reference; never modified
    with timer("convert", device):
        model = quantize_model(frozen, layout).eval().requires_grad_(False)
        units = find_units(model, DETECTOR_UNIT_KINDS)
        present = dict(model.named_modules())
        heads = [Unit(name, "head") for name in CALIBRATED_ONLY if name in present]
        check_unit_coverage(model, units + heads)
    with timer("calibrate", device):
        calib_report = calibrate_aphq(model, units + heads, calib, SearchSettings(
            rounds=options.search_rounds, weight_pct=tuple(options.weight_pct), act_pct=tuple(options.act_pct),
            eq_n=options.eq_n, matmul_pct=tuple(options.matmul_pct), matmul_steps=options.matmul_steps,
            max_rows=options.search_max_rows, round_zero_point=options.round_zero_point, batch_size=1,
            conv_search="self"), generator=torch.Generator().manual_seed(options.seed))
    # every quantizer is float now; units are switched on as they are reconstructed
    if options.iters == 0:  # calibration only: 0 iterations change no output, so no RPN references, no APH
        for unit in units:
            set_quant_state(model.get_submodule(unit.name), weights=True, activations=True)
        unit_stats = [{"unit": unit.name, "kind": unit.kind, "iters": 0} for unit in units]
    else:
        unit_stats = _reconstruct(model, frozen, units, samples, options, timer, device, cache)
    for head in heads:
        set_quant_state(model.get_submodule(head.name), weights=True, activations=True)
    model.eval()
    report = pipeline_report(
        "aphq", model, bits, dataclasses.replace(options, hessian_eps=detection_eps(options)),
        data={"calibration_images": getattr(calib, "count", None),
              # iters=0 draws no reconstruction images: their seed went unread
              "reconstruction_images": 0 if samples is None else len(samples),
              "seed": None if samples is None else options.data_seed,
              "transform": "test"},
        calibration=calib_report, units=unit_stats, calibrated_only=[h.name for h in heads])
    return model, report


def _reconstruct(model: nn.Module, frozen: nn.Module, units: List[Unit], samples: DetectorSamples,
                 options: APHQOptions, timer: StageTimer, device: torch.device, cache: torch.device) -> list:
    """Reconstruct the units of `model` in order, each switched on as it starts; their stats."""
    with timer("fp_rpn_outputs", device), torch.no_grad():
        refs: List[RPNOutputs] = []
        for i in range(len(samples)):
            cls, box = samples.rpn_outputs(frozen, i)
            refs.append(([torch.sigmoid(c).to(cache) for c in cls], [b.to(cache) for b in box]))
    eps = detection_eps(options)
    settings = ReconSettings(
        iters=options.iters, batch_size=1, weight_lr=options.weight_lr, act_lr=options.act_lr,
        drop_prob=options.drop_prob, input_mix_prob=options.input_mix_prob,
        rounding=RoundingSchedule(options.iters, options.warmup, options.beta_start, options.beta_end,
                                  options.round_weight),
        normalize_loss=options.normalize_loss, log_every=options.log_every)
    unit_stats = []
    log.info("APHQ detector reconstruction: %d units x %d iterations over %d images", len(units), options.iters,
             len(samples))
    with timer("reconstruct", device):
        for i, unit in enumerate(units):
            hessian_timer = StageTimer()
            hessians = None
            if options.loss == "aph" and unit.name.startswith("backbone."):
                with hessian_timer("hessian", device):
                    hessians = [[h.to(cache) for h in per_image] for per_image in detector_hessians(
                        frozen, unit.name, samples, samples.rpn_outputs, refs, eps)]
            fp_calls = capture_unit_calls(frozen, unit.name, samples, outputs=True, store_device=cache)
            q_calls = capture_unit_calls(model, unit.name, samples, store_device=cache)
            module = model.get_submodule(unit.name)
            set_quant_state(module, weights=True, activations=True)
            # official set_qdrop reaches Linear and matmul quantizers only: the neck's convolutions get no QDrop
            unit_settings = dataclasses.replace(settings, drop_prob=1.0) if unit.kind == "neck" else settings
            stats = reconstruct_unit_calls(module, fp_calls, q_calls, hessians, unit_settings, name=unit.name)
            stats = {"unit": unit.name, "kind": unit.kind, "loss": "aph" if hessians else "mse", **stats,
                     "hessian_seconds": hessian_timer.seconds.get("hessian", 0.0)}
            log.info("unit %d/%d %s done: rec %.4g -> %.4g [%.1fs + %.1fs Hessian]", i + 1, len(units), unit.name,
                     stats["rec_first"], stats["rec_last"], stats["seconds"], stats["hessian_seconds"])
            unit_stats.append(stats)
            del fp_calls, q_calls, hessians
    return unit_stats
