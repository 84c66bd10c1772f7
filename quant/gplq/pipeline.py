"""GPLQ (Liang, Liu, Wu; NeurIPS 2025): activation-only QAT first (stage 1),
weight PTQ + QwT second (stage 2).

After the GPLQ paper (arXiv 2506.11784), Sec. 3, and wujx2001/QwT `QwT-cls-RepQ-ViT`.

Stage 1, Act-QAT (W32A4), qat.py:
* activations 4-bit uniform SYMMETRIC PER CHANNEL ([-8, 7] s), LSQ scales (lsq.py), initialised by one
  calibration pass on `init_images` training images: min/max per channel for Linear inputs, the
  1st / 99th percentiles for the matmul operands;
* all float weights trainable, weight quantizers bypassed;
* loss CE + 1.0 * L_PCA (pca.py: penultimate features, teacher mean, ~60% variance rounded up to a
  multiple of 32, components from `pca_images` training images per rank: the default, 10,000, capped at one
  epoch; a count the caller gives above one epoch refused), the float teacher online;
* AdamW, constant lr (5e-6 at global batch 128; 2.5e-6 at 64; 1e-6 below, the paper's GPU table),
  one epoch by default (`steps` updates otherwise), batch 16 per GPU;
* run by engine.loop.TrainLoop (AMP, DDP under torchrun, resumable `<work_prefix>_gplq_<bits>_stage1.pt`);
  with `PipelineData.preemption` (evaluate.py) a SIGTERM / SIGINT during stage 1 writes that checkpoint at the
  next update boundary and raises engine.preemption.Preempted (exit code 75, the same command resumes).
  Under torchrun stage 1 uses every rank (data parallel); stage 2 runs once, on rank 0, and every rank
  receives its model (engine.distributed.run_on_main).

Stage 2, Weight-PTQ (W32A4 -> W4A4):
* activation quantizers frozen; weights per output channel, symmetric (paper), RepQ-ViT percentile
  candidates with MSE selection ("MSE-based initialisation", the 79.5 row);
* QwT (qwt.py): per Transformer block in order, least-squares linear compensation fitted on
  `stage2_images` (512) images from the quantized + compensated prefix, kept only where it helps. The images
  are drawn before stage 1, so that a count the data cannot give is refused before any training.

A detector (`PipelineData.detector_samples`) goes through detector.py: the detection loss instead of CE + PCA,
MMDetection's runner for stage 1, QwT on the backbone's blocks.

Details the paper leaves open, our choices (all options; see quant/README.md):
* matmul operands q, k, v and the softmax output are quantized per HEAD with LSQ (symmetric, so the
  non-negative softmax uses codes 0..7); `matmul_operands=False` keeps both matmuls float;
* patch-embed input 8 bit and head input at a_bits, as in the other pipelines (FirstLastOptions);
* LSQ scale lr = weight lr; weight decay 0 (at lr 5e-6 for one epoch any usual value is negligible);
  no mixup / cutmix, plain CE; the model's own drop-path / dropout rates apply in training mode;
* QwT as its code runs (XJ19023/QwT-LLM `QwT-cls-RepQ-ViT/qwt_vit_and_deit.py`, a copy of
  wujx2001/QwT): the reference is the same block with every quantizer off (`qwt_target="float"`), the
  stage-2 images carry one training augmentation each (QwT draws them from its training loader), R^2
  is pooled over channels. Our training transform is the recipe's, random erasing included (QwT's
  loader turns it off).
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from dataclasses import fields, replace
from typing import Collection, Mapping, Optional

import torch
from torch import nn

from configs.loader import check_options_read
from configs.quant import GPLQOptions
from engine.checkpoint import load_checkpoint, weights_fingerprint
from engine.distributed import OtherRankError, raise_on_every_rank, run_on_main, runs_on_main, world_size

from ..calibrate import Images, calibrate
from ..convert import quantize_model
from ..layout import standard_layout
from ..modes import named_quantizers, set_quant_state
from ..pipeline_base import Pipeline, PTQResult, StageTimer, isolated_rng, parse_options, pipeline_report
from ..pipeline_data import PipelineData, require_data
from ..ranges import RangeSearch, range_search
from ..spec import Bits, QuantizerSpec, QuantSpec
from ..units import capture_unit
from .detector import quantize_detector
from .lsq import LSQQuantizer
from .pca import fit_pca
from .pca_images import given_for_this_call, pca_images_exact, pca_images_given
from .pca_width import pca_settings_unread
from .qat import STAGE1_UNREADABLE, Stage1Settings, refuse_other_run, run_stage1
from .qwt import CompensationFit, fit_block_compensation
from .stage2 import FitBlock, quantize_weights_and_compensate

log = logging.getLogger("quant.gplq")


# options that do not change what stage 1 computes (a resume may change them)
_NOT_STAGE1 = {"log_every", "ckpt_every", "weight_symmetric", "weight_range", "stage2_images",
               "stage2_train_transform", "qwt", "qwt_ridge", "qwt_target"}


def stage1_checkpoint(data: PipelineData, bits: Bits) -> Optional[str]:
    """Where stage 1 at `bits` keeps its resumable checkpoint, `<work prefix>_gplq_<bits>_stage1.pt` (None: no
    work prefix, no checkpoint)."""
    return data.work_path(f"_gplq_{bits}_stage1.pt")


def stage1_identity(fp_model: nn.Module, bits: Bits, options: GPLQOptions, data: PipelineData) -> dict:
    """What a resumed stage 1 must share with the run that wrote its checkpoint: the bits, the training data,
    the float weights, the number of ranks (the global batch, each rank's shard) and the stage-1 options, the lr and
    scale_lr as used (`GPLQPipeline.recorded_options`: null read as the default of the global batch), so that the lr
    typed out resumes a checkpoint of its null and a later default does not; plain JSON types, comparable with the
    copy a checkpoint holds (one written with null compares as the lr null meant then: qat.refuse_other_run)."""
    used = GPLQPipeline().recorded_options(options)
    return json.loads(json.dumps({
        "pipeline": GPLQPipeline.name, "bits": str(bits), "data": data.identity,
        "fp_model": weights_fingerprint(fp_model.state_dict()), "world_size": world_size(),
        "stage1": {f.name: getattr(used, f.name) for f in fields(used) if f.name not in _NOT_STAGE1}}))


def check_stage1_checkpoint(fp_model: nn.Module, bits: Bits, options: GPLQOptions, data: PipelineData) -> None:
    """Refuse, before any work, a stage-1 checkpoint at this evaluation's path that another run wrote (other
    weights, bits, data or stage-1 options): stage 1 would refuse it only when it starts, after the FP pass,
    the activation maxima and every pipeline planned before GPLQ. Call it on the main rank (the one that decides
    whether stage 1 resumes)."""
    path = stage1_checkpoint(data, bits)
    if path is not None and os.path.exists(path):
        saved = load_checkpoint(path, unreadable=STAGE1_UNREADABLE)["config"]
        refuse_other_run(path, saved, stage1_identity(fp_model, bits, options, data))


def default_lr(global_batch: int) -> float:
    """The paper's stage-1 lr for its GPU counts at 16 per GPU (8: 5e-6, 4: 2.5e-6, 2 or 1: 1e-6)."""
    return 5e-6 if global_batch >= 128 else 2.5e-6 if global_batch >= 64 else 1e-6


class GPLQPipeline(Pipeline):
    name = "gplq"
    Options = GPLQOptions
    tasks = ("classification", "detection")  # detection: detector.py (data.detector_samples)
    draws_training_images = True
    float32_weights = True  # the LSQ step sizes and the weights train in float32 (amp autocasts)
    trains_model = True  # stage 1: QAT of the student in training mode
    data_parallel = True  # stage 1 trains on every rank; run_on_main hands stage 2 to rank 0

    def recorded_options(self, options: GPLQOptions, ranks: Optional[int] = None) -> GPLQOptions:
        """`options` with the stage-1 learning rates used in place of null: lr by the paper's rule for the global
        batch (`default_lr`: batch_size_per_gpu x `ranks`, None: this run's world size), scale_lr as lr. Result
        files compare these (engine/eval_results.py reads an older entry's null as the default of then)."""
        lr = options.lr if options.lr is not None else default_lr(
            options.batch_size_per_gpu * (ranks if ranks is not None else world_size()))
        return replace(options, lr=lr, scale_lr=options.scale_lr if options.scale_lr is not None else lr)

    def layout(self, bits: Bits, options: GPLQOptions) -> QuantSpec:
        """LSQ symmetric activations (per channel / per head for matmuls) and stage-2 weight quantizers."""
        act = QuantizerSpec(bits.a, kind=LSQQuantizer, symmetric=True, granularity=options.act_granularity,
                            search=RangeSearch("minmax"))
        mm = QuantizerSpec(bits.a, kind=LSQQuantizer, symmetric=True, granularity="head",
                           search=RangeSearch("percentile", (options.matmul_percentile,))) \
            if options.matmul_operands else None
        weight = QuantizerSpec(bits.w, symmetric=options.weight_symmetric, granularity="channel",
                               search=range_search(options.weight_range, None))
        return standard_layout(weight=weight, post_norm_input=act, block_input=act, q=mm, k=mm, attn=mm, v=mm,
                               first_last=options.resolved(bits))

    def __call__(self, fp_model, calib_images, bits="w4a4", options=None, data=None) -> PTQResult:
        # on a classifier (no data.detector_samples) the mapping obeys the classifier's own rules too
        # (configs/loader.py CLASSIFIER_ONLY: batch_size_per_gpu at steps 0 and qwt=false), as APHQ's __call__
        if isinstance(options, Mapping) and (data is None or data.detector_samples is None):
            check_options_read(parse_options(self.Options, options), options, classifier=True)
        # the options become a dataclass before `run`: whether the caller chose pca_images is read here (pca_images.py)
        with given_for_this_call(options):
            return super().__call__(fp_model, calib_images, bits, options, data)

    def check_model_options(self, fp_model: nn.Module, bits: Bits, options: GPLQOptions) -> None:
        # a PCA target the feature width leaves nothing to choose (pca_width.py), refused before stage 1's passes
        problem = pca_settings_unread(fp_model, options)
        if problem:
            raise ValueError(problem)

    def train_image_counts(self, options: GPLQOptions) -> dict:
        # QwT's images are drawn only with it on; the PCA's come from the loader (train_loader_images: one check
        # against one epoch's full batches, which the split's size bounds too)
        return {"init_images": options.init_images, **({"stage2_images": options.stage2_images} if options.qwt else {})}

    def train_loader_images(self, options: GPLQOptions, given: Collection[str] = ()) -> dict:
        # the teacher PCA's images, read for a PCA loss that some update reads; only a count the user chose is one
        # to check (the default is capped at one epoch of the loader)
        read = options.pca_weight != 0 and options.steps != 0
        chosen = "pca_images" in given or pca_images_given(options)
        return {"pca_images": options.pca_images} if read and chosen else {}

    def train_batch_sizes(self, options: GPLQOptions) -> dict:
        # stage 1's and the teacher PCA's loader, built only for updates to make: at steps 0 a split smaller than
        # the default batch was refused, and at qwt=false the batch to fix it with is refused as unread
        return {"batch_size_per_gpu": options.batch_size_per_gpu} if options.steps != 0 else {}

    def run(self, fp_model: nn.Module, calib_images: Images, bits: Bits, options: GPLQOptions,
            data: Optional[PipelineData] = None) -> PTQResult:
        data = require_data(self.name, data, loader=data is None or data.detector_samples is None)
        if data.detector_samples is not None:
            return quantize_detector(self.layout(bits, options), fp_model, calib_images, bits, options, data,
                                     default_lr)
        del calib_images  # GPLQ draws its own training images from `data`
        timer = StageTimer()
        device = next(fp_model.parameters()).device
        with isolated_rng(options.seed, device):
            model, report = self._quantize(fp_model, bits, options, data, timer, device)
        return PTQResult(model, report)

    def _quantize(self, fp_model: nn.Module, bits: Bits, options: GPLQOptions, data: PipelineData,
                  timer: StageTimer, device: torch.device) -> tuple:
        world = world_size()
        teacher = copy.deepcopy(fp_model).eval().requires_grad_(False)
        bs = options.batch_size_per_gpu

        # -- stage 1: W32A4 activation QAT --
        with timer("init", device):
            error = None
            try:  # this rank's own images and loader: a failure here ends every rank, not this one alone
                model = quantize_model(fp_model, self.layout(bits, options))
                model.requires_grad_(True)
                set_quant_state(model, weights=False)  # W32 in stage 1
                init = data.draw_train_images(options.init_images, options.seed, True,
                                              f"init_images={options.init_images}")
                calibrate(model, init)
                for _, q in named_quantizers(model, "activation"):
                    q.make_learnable(scale=True)
                    q.search_label = "LSQ"
                # no update at steps 0 reads a batch (train_batch_sizes)
                train_batches = data.train_loader(bs, options.seed) if options.steps != 0 else None
                # QwT's images, drawn now on the rank that runs stage 2 (run_on_main: rank 0), so that a draw the
                # data refuses (draw_train_images) ends the run before stage 1's training (hours), not after it.
                # They depend on (count, seed, transform) alone (PipelineData: a seeded pure function, leaving the
                # global RNG as it was), so stage 1 and the fits are those of a draw after stage 1. Kept on the CPU
                # (capture_unit moves them batch by batch): 512 images at 224 px are 308 MB that stage 1 does not
                # take from the accelerator.
                stage2_images = (data.draw_train_images(options.stage2_images, options.seed,
                                                        options.stage2_train_transform,
                                                        f"stage2_images={options.stage2_images}").cpu()
                                 if options.qwt and runs_on_main() else None)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                error = e
            raise_on_every_rank(error, device, lambda: OtherRankError(
                "another rank failed preparing GPLQ stage 1 (its initialisation images, QwT images or training "
                "loader); its output says why"))
        used = self.recorded_options(options, world)  # the lr and scale_lr of a null (the report records them)
        lr = used.lr
        settings = Stage1Settings(steps=options.steps, batch_size_per_gpu=bs, lr=lr, scale_lr=used.scale_lr,
                                  weight_decay=options.weight_decay, pca_weight=options.pca_weight,
                                  amp=options.amp, log_every=options.log_every,
                                  ckpt_every=options.ckpt_every, seed=options.seed)
        config = stage1_identity(fp_model, bits, options, data)

        def pca_batches():  # the loader is made inside fit_pca, which ends every rank if it fails on one
            yield from data.train_loader(bs, options.seed + 1).readable()

        def pca():
            with timer("pca", device):
                return fit_pca(teacher, pca_batches(), options.pca_images, options.pca_variance, options.pca_multiple,
                               options.amp, exact=pca_images_exact(options))

        checkpoint = stage1_checkpoint(data, bits)
        # stop signals become a checkpoint at an update boundary only in stage 1 (where a stop can be saved)
        stops = (data.preemption(checkpoint) if data.preemption is not None and checkpoint
                 else contextlib.nullcontext())
        with timer("stage1", device), stops as preemption:
            stage1 = run_stage1(model, teacher, pca, train_batches, settings, checkpoint, config, preemption)
        pca_part = (f"PCA {stage1['pca_dims']} dims ({100 * stage1['pca_explained']:.1f}% variance)"
                    if stage1["pca_dims"] is not None else "no PCA loss")
        log.info("GPLQ stage 1: %d updates, lr %.2e, %s [%.1fs]", stage1["steps"], lr, pca_part, stage1["seconds"])

        return run_on_main(lambda: self._stage2(model, teacher, bits, options, stage2_images, timer, device, stage1),
                           f"quantizing gplq {bits} (stage 2)", device)

    def _stage2(self, model: nn.Module, teacher: nn.Module, bits: Bits, options: GPLQOptions,
                stage2_images: Optional[torch.Tensor], timer: StageTimer, device: torch.device, stage1: dict) -> tuple:
        """Freeze the activation quantizers, quantize the weights, QwT (stage2.py) on `stage2_images` (drawn
        before stage 1; None without QwT); (model, report with the seconds of every stage)."""
        fit_block = fit_on_images(model, stage2_images, options.batch_size_per_gpu, options.qwt_ridge)
        stage2 = quantize_weights_and_compensate(model, teacher, options, fit_block, timer, device)
        # steps null (one epoch) recorded as the updates that epoch held: the split's size is known only here
        used = self.recorded_options(options)
        used = replace(used, steps=stage1["steps"]) if options.steps is None else used
        report = pipeline_report(self.name, model, bits, used, stage1=stage1, **stage2)
        report["seconds"] = timer.seconds
        return model, report


def fit_on_images(model: nn.Module, images: torch.Tensor, batch_size: int, ridge: float) -> FitBlock:
    """QwT fits of a classifier's blocks on `images`: each block's input captured from the (compensated)
    prefix as one tensor, `batch_size` images per pass."""
    def fit_block(unit: str, reference) -> CompensationFit:
        x, _ = capture_unit(model, unit, images, batch_size)
        return fit_block_compensation(x, model.get_submodule(unit), reference, batch_size, ridge)
    return fit_block
