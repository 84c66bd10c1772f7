"""GPLQ stage 1: activation-only QAT through engine.loop.TrainLoop (AMP, DDP, resumable checkpoints).

The student is the converted model with its weight quantizers bypassed (W32A4), LSQ activation scales
and all float weights trainable; the teacher is the untouched float model, run online for every batch.

    loss = CE(student logits, labels) + pca_weight * L_PCA(student features, teacher features)

At pca_weight 0 the loss is the CE alone: neither the teacher PCA nor the teacher's forward is computed. At steps 0
(no update, the LSQ initialisation alone) no loss is computed, and no teacher PCA for it.

`FeatureTap` makes one forward of the (possibly DDP-wrapped) student return logits AND penultimate
features, so gradients are synchronised by DDP as in train.py. The optimizer-update loop is the
shared `TrainLoop` (one copy of AMP / accumulation / clipping / reseeding / checkpoint logic); this
file only builds the loss, the optimizer and the checkpoint callback. The checkpoint is a
`training_payload` (model = the FeatureTap, i.e. keys "model.*"; optimizer; counters; scaler) plus
the PCA projection and a `config` dict that a resume must match exactly.

With a `Preemption` (evaluate.py opens one around stage 1) a SIGTERM / SIGINT stops training at the next update
boundary that every rank agrees on, as in train.py: the checkpoint is written at that update and `Preempted`
is raised, so that the entry point exits with EXIT_PREEMPTED and the same command resumes from there.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint import CheckpointError, load_checkpoint, restore_training, save_on_main_rank, training_payload
from engine.distributed import OtherRankError, failure_on_every_rank, raise_on_every_rank, run_on_main, world_size
from engine.loop import TrainBatches, TrainLoop, TrainState
from engine.preemption import Preempted, Preemption, preempted_line
from engine.precision import grad_scaler
from engine.rank_agreement import differing_between_ranks
from engine.snapshots import start_point

from .pca import PCAProjection, pca_loss, penultimate
from ..quantizers import Quantizer

log = logging.getLogger("quant.gplq")


class FeatureTap(nn.Module):
    """Wraps a timm classifier: forward(x) -> (logits [B, classes], penultimate features [B, D]).

    The logits are the model's own head on the features (model(x) exactly); the features are timm's pre-logits
    (pca.penultimate, what the teacher PCA is fitted on). A distilled DeiT has two classifiers, on the class and
    the distillation token, and averages their logits: its pre-logits are the mean of the two tokens, so the PCA
    loss mimics that mean, as the teacher's features are that mean too.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple:
        # the head, not get_classifier()(pre): a distilled DeiT's get_classifier() is a tuple, and no one classifier
        # of the two tokens' mean gives its logits. The body runs once; its two heads are a pooling and a Linear.
        # timm's pre-logits come after its head dropout (model.drop): with drop > 0 each call draws its own mask,
        # and the squared PCA loss then holds the mask's variance too (the teacher's features, in eval mode, none),
        # as a student trained in train mode sees it; the recipes' drop 0 has no head dropout
        feats = self.model.forward_features(x)
        return self.model.forward_head(feats), self.model.forward_head(feats, pre_logits=True)


@dataclass(frozen=True)
class Stage1Settings:
    """Stage-1 hyper-parameters (GPLQOptions carries the user-facing defaults)."""

    steps: Optional[int]  # optimizer updates; None: one epoch of the loader
    batch_size_per_gpu: int
    lr: float
    scale_lr: float
    weight_decay: float
    pca_weight: float
    amp: str
    log_every: int
    ckpt_every: int
    seed: int


def param_groups(student: nn.Module, lr: float, scale_lr: float, weight_decay: float) -> list:
    """Weights (all float parameters) and LSQ scales (parameters inside quantizers), no decay on scales."""
    scale_ids = {id(p) for m in student.modules() if isinstance(m, Quantizer)
                 for p in m.parameters(recurse=False)}
    params = [p for p in student.parameters() if p.requires_grad]
    weights = [p for p in params if id(p) not in scale_ids]
    scales = [p for p in params if id(p) in scale_ids]
    groups = [{"params": weights, "lr": lr, "weight_decay": weight_decay}]
    if scales:
        groups.append({"params": scales, "lr": scale_lr, "weight_decay": 0.0})
    return groups


def _flat(entries: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a nested dict."""
    out = {}
    for key, value in entries.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# a stage-1 file is this evaluation's own, resumed at its path: no other copy of it to give instead
STAGE1_UNREADABLE = "move the file away to start stage 1 anew"


def lr_meant_then(identity: dict, section: str) -> dict:
    """A stage-1 `identity` (a checkpoint's config, a detector folder's identity file) with the learning rates of its
    options (its `section`) that one written before identities recorded the values used holds as null read as what
    null meant then: lr the paper's lr of its global batch (its batch_size_per_gpu x world_size: the rule of then,
    engine/eval_results.null_gplq_lr, not today's default_lr), scale_lr the lr. A checkpoint of a null lr then resumes
    under that lr typed out, and not under a later default."""
    from engine.eval_results import null_gplq_lr
    options = identity.get(section) if isinstance(identity, dict) else None
    if not isinstance(options, dict):
        return identity
    meant, lr = {}, options.get("lr")
    batch, ranks = options.get("batch_size_per_gpu"), identity.get("world_size")
    if "lr" in options and lr is None and isinstance(batch, int) and isinstance(ranks, int):
        lr = meant["lr"] = null_gplq_lr(batch * ranks)
    if "scale_lr" in options and options["scale_lr"] is None and lr is not None:
        meant["scale_lr"] = lr
    return {**identity, section: {**options, **meant}} if meant else identity


def refuse_other_run(checkpoint: str, saved: dict, config: dict) -> None:
    """A CheckpointError (the entry point's one `error:` line) when the stage-1 checkpoint at `checkpoint` was
    written with another identity than `config` (a null lr or scale_lr it holds read as then, `lr_meant_then`); the
    file is kept, it is another run's. One written before the identity held the training split's files (`data`'s
    `train_files`) is taken as of the files the split holds now, as a result entry without them is
    (engine/eval_results.py LATER_SETTINGS)."""
    saved = lr_meant_then(saved, "stage1")
    data = config.get("data")
    if isinstance(data, dict) and "train_files" in data and "train_files" not in (saved.get("data") or {}):
        config = {**config, "data": {k: v for k, v in data.items() if k != "train_files"}}
    if saved != config:  # only what differs: the identities are long (every option, the data's fingerprints)
        then, now = _flat(saved), _flat(config)
        keys = [k for k in {**then, **now} if then.get(k, "(none)") != now.get(k, "(none)")]
        said = "; ".join(f"{k}: {then.get(k, '(none)')!r} then, {now.get(k, '(none)')!r} now" for k in keys)
        world = (" (world_size: run it under as many processes as then)"
                 if any(k.rpartition(".")[2] == "world_size" for k in keys) else "")
        raise CheckpointError(f"{checkpoint} was written by a different GPLQ stage-1 run ({said}){world}; restore "
                              "those settings, or move the file away to start stage 1 anew")


def run_stage1(student: nn.Module, teacher: nn.Module, fit_pca: Callable[[], PCAProjection],
               batches: Optional[TrainBatches], settings: Stage1Settings, checkpoint: Optional[str],
               config: Dict[str, object], preemption: Optional[Preemption] = None) -> Dict[str, object]:
    """Train `student` in place (see module docstring); resume from / write `checkpoint` if given.

    Args:
        student: converted model, LSQ scales learnable, weight quantizers bypassed, on its device.
        teacher: float model (eval, no grad) on the same device.
        fit_pca: computes the teacher PCA projection (called only when not resuming, with updates to make and
            pca_weight not 0: a resumed run uses the projection stored in the checkpoint).
        batches: this rank's training loader and sampler; None at `settings.steps` 0 (no update reads it).
        settings: steps, batch, learning rates, loss weight, AMP, logging and checkpoint intervals.
        checkpoint: path of the resumable stage-1 checkpoint (None: none written, no resume).
        config: identity of the run (bits, stage-1 options, float-model fingerprint); a checkpoint
            written with another config is refused.
        preemption: stop requests (signals) to honour at update boundaries; needs `checkpoint`, where the
            stop is saved.

    Returns:
        {"steps", "seconds", "resumed_from", "lr", "scale_lr", "world_size", "ddp", "ce", "pca", "pca_dims",
        "pca_explained", "pca_samples"}; the pca_* entries None at pca_weight 0 or steps 0.

    Raises:
        Preempted: `preemption` asked to stop, on every rank; `checkpoint` holds the updates done so far.
    """
    if preemption is not None and not checkpoint:
        raise ValueError("run_stage1: a preemption stop is saved in the stage-1 checkpoint; pass checkpoint")
    config = json.loads(json.dumps(config))  # plain types, comparable with a reloaded checkpoint
    device = next(student.parameters()).device
    # every rank learns it, before the DDP wrapper's first collective (where the others would wait for this rank)
    empty = batches is not None and len(batches) == 0
    raise_on_every_rank(ValueError("the stage-1 training loader is empty") if empty else None, device,
                        lambda: OtherRankError("the stage-1 training loader of another rank is empty"))
    world = world_size()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    tap = FeatureTap(student)
    train_model: nn.Module = tap
    if world > 1:
        train_model = nn.parallel.DistributedDataParallel(
            tap, device_ids=[device.index] if device.type == "cuda" else None)
    # fused on CUDA, as train.py's (engine.optim.use_fused): with fp16 the GradScaler then hands the overflow verdict
    # to the kernel as a device tensor instead of reading it on the host at every update
    optimizer = torch.optim.AdamW(param_groups(student, settings.lr, settings.scale_lr, settings.weight_decay),
                                  lr=settings.lr, weight_decay=settings.weight_decay,
                                  fused=True if device.type == "cuda" else None)
    scaler = grad_scaler(settings.amp, device)
    state = TrainState()
    resumed_from = None
    # rank 0 decides whether to resume: ranks that each looked (a folder that is not shared between nodes)
    # could take both branches, fit_pca's all-reduce facing restore_training; a rank that cannot read the
    # file rank 0 sees fails on it, naming it
    # else no PCA loss: no teacher PCA, no teacher forward (at steps 0 no loss at all, so no PCA for it either)
    aligned = settings.pca_weight != 0 and settings.steps != 0
    resume = run_on_main(lambda: bool(checkpoint and os.path.exists(checkpoint)),
                         "looking for the GPLQ stage-1 checkpoint", device)
    if resume:
        # each rank reads the file at its own path (an --out on each node's disk: rank 0's alone, or a stale copy)
        with failure_on_every_rank(device, "reading the GPLQ stage-1 checkpoint"):
            if not os.path.exists(checkpoint):  # rank 0 found it: this rank's node has another --out folder
                raise CheckpointError(f"the GPLQ stage-1 checkpoint {checkpoint} that rank 0 resumes from is not on "
                                      f"this rank's node: give --out a folder every node sees (a shared file "
                                      f"system)")
            payload = load_checkpoint(checkpoint, unreadable=STAGE1_UNREADABLE)
            refuse_other_run(checkpoint, payload["config"], config)
            restore_training(payload, model=train_model, optimizer=optimizer, state=state, scaler=scaler)
            pca = PCAProjection.from_state_dict(payload["pca"], device) if aligned else None
            # hashed under torchrun only (ViT-B: 0.7 s on a CPU core, docs/measurements.md "Training"); one process
            # compares with nothing
            start = start_point(payload) if world_size() > 1 else {}
            del payload
        if differing_between_ranks({"start": start}, device):  # the loops would run other lengths
            raise CheckpointError(f"the ranks read other GPLQ stage-1 checkpoints at {checkpoint} (this rank's: update "
                                  f"{start['step']}, weights {start['weights']}): give --out a folder every node "
                                  "sees (a shared file system)")
        resumed_from = state.step
        log.info("GPLQ stage 1: resumed from %s at update %d", checkpoint, state.step)
    else:
        pca = fit_pca() if aligned else None
    total = settings.steps if settings.steps is not None else len(batches)

    sums = torch.zeros(3, device=device)  # ce, pca, micro-batches since the last log (no per-step sync)

    def compute_loss(model: nn.Module, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, feats = model(images)
        loss = ce = F.cross_entropy(logits.float(), targets)
        lp = torch.zeros((), device=device)
        if aligned:
            with torch.no_grad():
                t_feats = penultimate(teacher, images)
            lp = pca_loss(feats, t_feats, pca)
            loss = ce + settings.pca_weight * lp
        sums.add_(torch.stack([ce.detach(), lp.detach(), torch.ones((), device=device)]))
        return loss

    last: Dict[str, float] = {}

    def parts() -> Dict[str, float]:
        ce, lp, n = sums.tolist()
        sums.zero_()
        last.update({"gplq/ce": ce / max(n, 1.0), **({"gplq/pca": lp / max(n, 1.0)} if aligned else {})})
        return dict(last)

    def save() -> None:
        if checkpoint:
            save_on_main_rank(lambda: training_payload(model=train_model, optimizer=optimizer, state=state,
                                                       config=config, scaler=scaler,
                                                       extra={"pca": pca.state_dict() if aligned else None}),
                              checkpoint, rank == 0, device)

    def report(step: int, metrics: Dict[str, float]) -> None:
        losses = (metrics["train/loss"], metrics.get("gplq/ce", float("nan")))
        if aligned:
            losses += (metrics.get("gplq/pca", float("nan")),)
        log.info("GPLQ stage 1 update %d/%d  loss %.4f  ce %.4f" + ("  pca %.4f" if aligned else "") +
                 "  lr %.2e  %.1f img/s", step, total, *losses, metrics["train/lr"], metrics["train/img_per_s"])

    loop = TrainLoop(model=train_model, optimizer=optimizer, compute_loss=compute_loss, device=device,
                     amp=settings.amp, scaler=scaler, seed=settings.seed, rank=rank, world_size=world,
                     max_steps=total, log_every=max(1, settings.log_every), ckpt_every=settings.ckpt_every,
                     save=save if checkpoint else None, log=report, metric_sources=[parts],
                     should_stop=preemption.should_stop if preemption is not None else None,
                     request_stop=preemption.request_stop if preemption is not None else None)
    start = time.perf_counter()
    teacher.eval()
    stopped = False
    while state.step < total and not stopped:  # one epoch by default; `steps` may span several
        stopped = loop.run_epoch(batches, state, settings.batch_size_per_gpu) == "preempted"
    if checkpoint and resumed_from != state.step:
        save()
    # a request the loop did not act on (it came in the last update, where the loop stops for max_steps before
    # asking, or during the write) still stops before stage 2: the checkpoint holds the finished stage 1
    if preemption is not None and not stopped:
        stopped = preemption.should_stop(state.step, boundary=True)
    if stopped:
        log.info("GPLQ stage 1 %s", preempted_line(state.step, checkpoint))
        # the DDP wrapper must not outlive the stage in this frame, which the exception's traceback keeps
        train_model = loop = None
        raise Preempted(f"GPLQ stage 1 stopped at update {state.step}; {checkpoint} saved")
    student.eval()
    return {"steps": state.step, "seconds": round(time.perf_counter() - start, 3),
            "resumed_from": resumed_from, "lr": settings.lr, "scale_lr": settings.scale_lr,
            "world_size": world, "ddp": isinstance(train_model, nn.parallel.DistributedDataParallel),
            "ce": last.get("gplq/ce"), "pca": last.get("gplq/pca"), "pca_dims": pca.dims if aligned else None,
            "pca_explained": round(pca.explained, 4) if aligned else None,
            "pca_samples": pca.samples if aligned else None}
