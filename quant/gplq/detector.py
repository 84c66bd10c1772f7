"""GPLQ on an MMDetection detector: activation QAT with the detection loss, then weight PTQ + QwT.

The GPLQ paper (arXiv 2506.11784) gives for COCO only what differs from ImageNet: one epoch at batch 1 per
GPU, no PCA loss. Everything else is the classification procedure (pipeline.py), with these choices:

1. Layout: GPLQ's (pipeline.py) over the whole detector in the official RepQ-ViT / APHQ detection scope
   (quant/spec.py `DETECTOR_HEADS`): LSQ activations, symmetric per channel (conv inputs: per input
   channel), matmul operands per head; the stem's image input at 8 bits (FirstLastOptions).
2. LSQ initialisation: one pass over the caller's calibration batch (`evaluate_detection.py --calib-images`,
   so `init_images` is that count), min/max per channel, percentiles for the matmul operands, each quantizer
   on its first call (quant/calibrate.py): a layer called once per FPN level (the shared RPN head's rpn_conv,
   rpn_cls, rpn_reg) starts from P2's range alone.
3. Stage 1 (W32A4): every float weight and every LSQ scale trained on the detector's own loss
   (RPN + RoI box + mask) by MMEngine's runner (`PipelineData.train_detector`, engine/detection/qat.py): AdamW at a
   constant lr (default as the paper's GPU table for the global batch), one epoch by default, batch 1 per
   GPU, resumable from the checkpoints in `<work prefix>_gplq_<bits>_stage1/`. Under torchrun every rank
   trains its shard in DDP (the paper: 8 GPUs at batch 1); the steps are per rank.
4. Stage 2 (W4A4): activation quantizers frozen, weights per output channel (symmetric, percentile-MSE),
   then QwT on every Swin block of the backbone in order, fitted on `stage2_images` training images with the
   test pipeline (drawn before stage 1, so that a count the data cannot give is refused before its training), one
   per batch, streamed (`fit_block_compensation_streamed`); kept where R^2 > 0. On rank 0,
   which hands the model to the other ranks (engine.distributed.run_on_main).
"""
from __future__ import annotations

import copy
import json
import logging
from dataclasses import fields, replace
from typing import Any, Optional

import torch
from torch import nn

from configs.quant import GPLQOptions
from engine.checkpoint import weights_fingerprint
from engine.distributed import failure_on_every_rank, run_on_main, runs_on_main, world_size

from ..calibrate import calibrate
from ..convert import quantize_model
from ..modes import named_quantizers, set_quant_state
from ..pipeline_base import PTQResult, StageTimer, pipeline_report
from ..pipeline_data import PipelineData
from ..spec import Bits, QuantSpec
from ..units import SampleFeed
from .qat import param_groups
from .qwt import fit_block_compensation_streamed
from .stage2 import quantize_weights_and_compensate

log = logging.getLogger("quant.gplq")

# the options a resumed stage 1 must share with the run that wrote its checkpoints
STAGE1_OPTIONS = ("steps", "batch_size_per_gpu", "lr", "scale_lr", "weight_decay", "act_granularity",
                  "matmul_operands", "matmul_percentile", "amp", "seed", "init_images", "stem_w_bits",
                  "stem_a_bits", "head_w_bits", "head_a_bits")


def check_detector_options(options: GPLQOptions, calib_count: Optional[int] = None) -> None:
    """Refuse the GPLQ options that have no detector form here (before any work)."""
    if options.pca_weight != 0:
        raise ValueError(f"pca_weight={options.pca_weight}: GPLQ trains a detector without the PCA loss (the "
                         "paper's COCO setting); set pca_weight=0")
    unused = [f"{key}={getattr(options, key)}" for key in ("pca_variance", "pca_multiple", "pca_images")
              if getattr(options, key) != getattr(GPLQOptions(), key)]
    if unused:
        raise ValueError(f"{', '.join(unused)}: a detector is trained without the PCA loss, so the PCA settings "
                         "do not apply; leave them at their defaults")
    # read only for QwT's images (configs/loader.py READ_ONLY_WHEN): at qwt=false the class default (True) comes
    # back, evaluate_detection.py's detection_defaults leaving the recipe's False out there, and nothing reads it
    if options.qwt and options.stage2_train_transform:
        raise ValueError("stage2_train_transform=True: a detector's QwT images get the test pipeline; set it False")
    if calib_count is not None and options.init_images != calib_count:
        raise ValueError(f"init_images={options.init_images} but the calibration batch holds {calib_count} "
                         "images: a detector's LSQ initialisation is that batch (evaluate_detection.py "
                         "--calib-images)")


def stage1_folder(data: PipelineData, bits: Bits) -> Optional[str]:
    """Where stage 1 at `bits` keeps its resumable checkpoints, `<work prefix>_gplq_<bits>_stage1/` (None: no
    work prefix); the caller checks it before any work."""
    return data.work_path(f"_gplq_{bits}_stage1")


def stage1_identity(fp_model: nn.Module, bits: Bits, options: GPLQOptions, calib: Any, data: PipelineData) -> dict:
    """What a resumed stage 1 must share with the run that wrote its folder (plain JSON types, as the folder's
    identity file holds them): the bits, the float weights, the calibration images that set the LSQ start, the
    training data (`data.identity`: evaluate_detection.py's training annotations by content, from which those
    images' indices and stage 1's targets are read), the number of ranks (the global batch, each rank's shard) and
    the stage-1 options. evaluate_detection.py compares it with a folder's before the full-precision score. The lr
    and scale_lr as used (GPLQPipeline.recorded_options: null read as the default of the global batch), so that the
    lr typed out resumes a folder of its null and a later default does not (a folder written with null compares as
    the lr null meant then, one written without the training data as of the data given now: check_stage1_folder)."""
    from .pipeline import GPLQPipeline  # imported here: pipeline.py imports this module
    options = GPLQPipeline().recorded_options(options)
    return json.loads(json.dumps({
        "pipeline": "gplq", "bits": str(bits), "fp_model": weights_fingerprint(fp_model.state_dict()),
        "init_batch": getattr(calib, "indices", None),  # which images set the LSQ start
        "data": data.identity,
        "world_size": world_size(),  # the global batch and each rank's shard
        "options": {f.name: getattr(options, f.name) for f in fields(options) if f.name in STAGE1_OPTIONS}}))


def quantize_detector(layout: QuantSpec, fp_model: nn.Module, calib: Any, bits: Bits, options: GPLQOptions,
                      data: PipelineData, default_lr) -> PTQResult:
    """GPLQ on a detector (module docstring); `layout` is GPLQPipeline.layout(bits, options), `default_lr` the
    paper's lr rule for a global batch."""
    if not isinstance(calib, SampleFeed):
        raise ValueError("GPLQ on a detector initialises on a units.SampleFeed (evaluate_detection.py's "
                         "DetectorFeed), not on an image tensor")
    check_detector_options(options, getattr(calib, "count", None))
    if data.train_detector is None:
        raise ValueError("GPLQ on a detector trains it: PipelineData.train_detector is required")
    timer = StageTimer()
    device = next(fp_model.parameters()).device
    world = world_size()
    teacher = copy.deepcopy(fp_model).eval().requires_grad_(False) if options.qwt_target == "teacher" else None
    # QwT's images, drawn now on the rank that runs stage 2 (run_on_main: rank 0), so that a provider that cannot
    # give stage2_images (draw_detector_samples) ends the run before stage 1's training (an epoch), not after it, as
    # the classifier's pipeline draws them. They depend on (count, seed) alone (DetectorSamples: its own
    # random.Random, the test pipeline), so the images, and a resumed stage 1, are those of a draw after stage 1.
    # Rank 0 holds them (CPU tensors) through stage 1.
    samples = None
    with failure_on_every_rank(device, "drawing GPLQ's QwT images (stage2_images)"):
        if options.qwt and runs_on_main():
            samples = data.draw_detector_samples(options.stage2_images, options.seed,
                                                 f"stage2_images={options.stage2_images}")
    with timer("init", device):
        model = quantize_model(fp_model, layout)
        set_quant_state(model, weights=False)  # W32 in stage 1
        calibrate(model, calib)
        for _, q in named_quantizers(model, "activation"):
            q.make_learnable(scale=True)
            q.search_label = "LSQ"
        model.requires_grad_(True)
    lr = options.lr if options.lr is not None else default_lr(options.batch_size_per_gpu * world)
    scale_lr = options.scale_lr if options.scale_lr is not None else lr
    settings = {"steps": options.steps, "batch_size_per_gpu": options.batch_size_per_gpu, "lr": lr,
                "scale_lr": scale_lr, "weight_decay": options.weight_decay,
                "param_groups": param_groups(model, lr, scale_lr, options.weight_decay), "amp": options.amp,
                "log_every": options.log_every, "ckpt_every": options.ckpt_every, "seed": options.seed,
                "identity": stage1_identity(fp_model, bits, options, calib, data)}
    with timer("stage1", device):
        stage1 = data.train_detector(model, settings, stage1_folder(data, bits))
    model.eval().requires_grad_(False)
    return run_on_main(lambda: _stage2(model, teacher, bits, options, samples, timer, device, lr, scale_lr, stage1),
                       f"quantizing gplq {bits} (stage 2)", device)


def _stage2(model: nn.Module, teacher: Optional[nn.Module], bits: Bits, options: GPLQOptions, samples: Any,
            timer: StageTimer, device: torch.device, lr: float, scale_lr: float, stage1: dict) -> PTQResult:
    """Stage 2 on rank 0 (module docstring, step 4): weights, then QwT streamed over the backbone blocks on
    `samples` (drawn before stage 1; None without QwT)."""
    stage2 = quantize_weights_and_compensate(
        model, teacher, options,
        lambda unit, reference: fit_block_compensation_streamed(model, unit, samples, reference, options.qwt_ridge),
        timer, device)
    # steps null (one epoch) recorded as the iterations that epoch held (the loader's length, known only in stage 1)
    steps = stage1["steps"] if options.steps is None else options.steps
    report = pipeline_report("gplq", model, bits, replace(options, lr=lr, scale_lr=scale_lr, steps=steps),
                             stage1={**stage1, "lr": lr, "scale_lr": scale_lr},
                             **stage2)
    report["seconds"] = timer.seconds
    return PTQResult(model, report)
