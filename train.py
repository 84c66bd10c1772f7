r"""Train a ViT / DeiT / Swin image classifier, optionally with Colinearity Decay (CD) or TWEO.

    python train.py                                     # demo: tiny ViT on the embedded digits, CPU, minutes
    python train.py --config configs/debug/tiny.yaml    # seconds: a two-block model on synthetic data
    torchrun --nproc_per_node=8 train.py --config configs/pretrain/vit_b.yaml data.root=/datasets/imagenet
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_HOST:29500 train.py --config configs/pretrain/vit_b.yaml data.root=...
    python train.py --config configs/pretrain/vit_b.yaml --config configs/method/cd.yaml   # + CD

Config: dataclass defaults (configs/schema.py) < each --config YAML in order < key=value overrides.
Outputs in out_dir: config.yaml, metrics.jsonl, tb/, train.log, checkpoint.pt (latest), best.pt,
snapshots/ (train.keep_every_epochs). Re-running the same command with the same out_dir resumes from
checkpoint.pt (train.resume=PATH: from another checkpoint file); SIGTERM / SIGINT save and exit with code
75 (docs/operations.md).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.utils import ModelEmaV3

from cd import TWEO, ColinearityDecay, budget_weight_decay, pair_energy_source
from configs import Config, ConfigError, config_to_dict, load_config
from configs.cli import add_config_arguments, parse_known, print_config
from configs.loader import IgnoredOverrideError
from data import DataError, build_loaders
from engine.act_max import ActivationProbe
from engine.best_checkpoint import BestCheckpoint
from engine.checkpoint import CheckpointError, restore_training, save_on_main_rank, training_payload
from engine.distributed import DistInfo, all_reduce, cleanup_distributed, init_distributed
from engine.divergence import DivergenceError, DivergenceGuard
from engine.loop import NonFiniteLossError, TrainLoop, TrainState, evaluate, progress_kept_on_error
from engine.metrics import MetricLogger, duration, progress_line
from engine.optim import build_optimizer, build_scheduler, lr_rule, peak_lr, use_fused
from engine.precision import describe_precision, grad_scaler
from engine.preemption import EXIT_PREEMPTED, Preemption
from engine.resume import epoch_position, optimizer_param_names, restore_optimizer, resume_position
from engine.snapshots import keep_snapshot, resume_source
from engine.run_dir import (RunDirError, claim_on_main_rank, config_changes, save_config_history,
                            start_only_changes)
from engine.runinfo import describe_environment, setup_logging
from models import ModelError, build_model, describe, input_size, model_label

DEFAULT_CONFIG = "configs/demo/vit_digits.yaml"
MAX_STEPS_HINT = ("stopped at update %d (train.max_steps); checkpoint saved; raise train.max_steps (or drop it) "
                  "and re-run the same command to continue")
log = logging.getLogger("train")


@dataclass
class RunResult:
    model: nn.Module  # the trained (unwrapped) model
    metrics: dict  # the last validation metrics (val/top1, ...)
    state: TrainState
    reason: str = "finished"  # or "preempted" (a stop request: checkpoint written) or "max_steps"


def main(cfg: Config) -> RunResult:
    """Train as `cfg` says (resuming from out_dir when a checkpoint is there)."""
    if cfg.log.wandb:  # checked before any folder is made (engine/metrics.py imports it when logging)
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("log.wandb=true but the wandb package is not installed: pip install wandb, or "
                              "set log.wandb=false (metrics.jsonl and TensorBoard are written either way)"
                              ) from None
    dist = init_distributed(cfg.train.device)
    try:
        # out_dir belongs to this run until it ends (engine/run_dir.py); from here on SIGTERM / SIGINT
        # request a checkpoint at the next update boundary (engine/preemption.py).
        with claim_on_main_rank(cfg.out_dir, config_to_dict(cfg), cfg.train.archive_existing, dist), \
                Preemption(dist.device, distributed=dist.distributed) as preemption:
            result = run_training(cfg, dist, preemption)
    except BaseException:
        cleanup_distributed(wait_for_all=False)
        raise
    cleanup_distributed()
    return result


def run_training(cfg: Config, dist: DistInfo, preemption: Preemption) -> RunResult:
    """The run itself: build everything, resume if possible, train epoch by epoch, validate, checkpoint."""
    device = dist.device
    run_started = time.perf_counter()
    setup_process(cfg, dist)
    per_gpu = cfg.train.batch_size_per_gpu
    accum_steps = accumulation_steps(cfg, dist.world_size)

    # -- Model (same initial weights on every rank) and data. A resumed run takes its weights from the
    # checkpoint, so pretrained weights are not loaded (nor fetched) again.
    ckpt_path = os.path.join(cfg.out_dir, "checkpoint.pt")
    resume_path, payload = resume_source(cfg.out_dir, cfg.train.resume)  # out_dir's, or train.resume=PATH
    resumed = resume_path is not None
    torch.manual_seed(cfg.train.seed)
    model = build_model(dataclasses.replace(cfg.model, pretrained="") if resumed else cfg.model).to(device)
    log.info("model %s: %s", model_label(cfg.model), describe(model))
    loaders = build_loaders(cfg.data, img_size=input_size(model), batch_size_per_gpu=per_gpu,
                            eval_batch_size_per_gpu=cfg.train.eval_batch_size_per_gpu,
                            rank=dist.rank, world_size=dist.world_size, seed=cfg.train.seed,
                            num_classes=cfg.model.num_classes)
    updates_per_epoch = len(loaders.train) // accum_steps
    if updates_per_epoch == 0:
        raise ConfigError(f"an epoch has {len(loaders.train)} batches per process, fewer than the "
                          f"{accum_steps} accumulation steps of one update: lower train.batch_size")

    # -- Optimizer, schedule, precision, EMA. With CD, the paper's budget rule moves lam from wd to CD.
    lr = peak_lr(cfg.optim, cfg.train.batch_size)
    weight_decay = cfg.optim.weight_decay
    if cfg.cd.enabled and cfg.cd.budget:
        weight_decay = as_config_error("cd.budget", budget_weight_decay, weight_decay, cfg.cd.lam)
        log.info("CD budget rule: weight decay %g -> %g (cd.lam %g)",
                 cfg.optim.weight_decay, weight_decay, cfg.cd.lam)
    optimizer = as_config_error("optim", build_optimizer, model, cfg.optim, lr, weight_decay, device)
    scheduler = build_scheduler(optimizer, cfg.sched, updates_per_epoch)
    scaler = grad_scaler(cfg.train.amp, device)
    log.info("%s", describe_precision(cfg.train.amp, device))
    ema = (ModelEmaV3(model, decay=cfg.train.ema_decay, use_warmup=cfg.train.ema_warmup)
           if cfg.train.ema else None)
    log.info("global batch %d = %d per process x %d processes x %d accumulation steps; %s %s; %s; wd %g; "
             "%d updates per epoch, %d epochs", cfg.train.batch_size, per_gpu, dist.world_size, accum_steps,
             cfg.optim.name, "fused kernel" if use_fused(cfg.optim, device) else "default kernels",
             lr_rule(cfg.optim, cfg.train.batch_size), weight_decay, updates_per_epoch, cfg.sched.epochs)

    # -- Regularizers. CD acts on the weights as an optimizer step pre-hook: it runs inside
    # optimizer.step(), after clipping, once per update, only when the step really runs, with each
    # group's lr. TWEO (and CD's loss-form ablation) add a term to the loss in compute_loss below.
    decay = (as_config_error("cd", ColinearityDecay.from_config, cfg.cd, model,
                             norms_every=cfg.train.log_every_steps) if cfg.cd.enabled else None)
    if decay is not None:
        decay.attach(optimizer)
        log.info("%r", decay)
    tweo = (as_config_error("tweo", TWEO.from_config, cfg.tweo, model,
                            total_steps=cfg.sched.epochs * updates_per_epoch)
            if cfg.tweo.enabled else None)
    # Pair energies are logged for every run, so that baselines can be compared with CD runs.
    metric_sources = [decay.metrics if decay is not None else pair_energy_source(model, cfg.cd.gated_mlp)]
    if tweo is not None:
        metric_sources.append(tweo.metrics)

    # -- Resume: the same command in the same out_dir continues from checkpoint.pt, or train.resume=PATH
    # starts from a given checkpoint file (engine/snapshots.py). The checkpoint gives the state, this
    # config every setting (engine/resume.py): optimizer moments by parameter name under the new groups'
    # lr / weight decay / betas, the fresh schedule (the loop sets the lr of the current update), the
    # position within the epoch in samples of any process count.
    state = TrainState()
    position = dict(world_size=dist.world_size, batch_size_per_gpu=per_gpu, accum_steps=accum_steps,
                    updates_per_epoch=updates_per_epoch, train_images=len(loaders.train.loader.dataset),
                    seed=cfg.train.seed, repeated_aug=max(cfg.data.repeated_aug, 1))
    started_from = None  # the train.resume file this run descends from (checkpoints record it)
    wandb_id = uuid.uuid4().hex[:16]  # one wandb run per run: kept in checkpoints, new after archiving
    if resumed:
        check_resumable(payload["config"], cfg, resume_path)
        restore_training(payload, model=model, optimizer=None, state=state, ema=ema, scaler=scaler)
        restore_optimizer(optimizer, payload["optimizer"], payload.get("optimizer_param_names"),
                          optimizer_param_names(model, optimizer))
        state.epoch_batches = resume_position(
            payload.get("epoch_position"), epoch_position(epoch_batches=0, **position),
            epoch_batches=state.epoch_batches, step=state.step, checkpoint=resume_path)
        if decay is not None and "cd" in payload:
            decay.load_state_dict(payload["cd"])
        wandb_id = payload.get("wandb_id") or wandb_id
        own = resume_path == ckpt_path
        started_from = payload.get("resumed_from") if own else os.path.abspath(resume_path)
        del payload
        log.info("resumed from %s at epoch %d, update %d", resume_path, state.epoch, state.step)
    if dist.is_main and (kept := save_config_history(cfg.out_dir, config_to_dict(cfg), state.step)):
        log.info("config.yaml of the run so far kept as %s", kept)
    logger = MetricLogger(cfg.out_dir, dist.is_main, cfg.log.tensorboard, cfg.log.wandb,
                          cfg.log.wandb_project, cfg.log.wandb_mode, config_to_dict(cfg),
                          resume_step=state.step if resumed else None, wandb_id=wandb_id)

    # -- Checkpoints: checkpoint.pt (the whole training state) and best.pt (best val top-1), main rank.
    def save_on_main(payload_fn, path: str) -> None:
        save_on_main_rank(payload_fn, path, dist.is_main, device)

    def save_checkpoint() -> None:
        extra = {"classes": loaders.classes, "optimizer_param_names": optimizer_param_names(model, optimizer),
                 "epoch_position": epoch_position(epoch_batches=state.epoch_batches, **position),
                 "resumed_from": started_from, "wandb_id": wandb_id,
                 **({"cd": decay.state_dict()} if decay is not None else {})}
        save_on_main(lambda: training_payload(model=model, optimizer=optimizer, state=state,
                                              config=config_to_dict(cfg), ema=ema, scaler=scaler,
                                              scheduler=scheduler, extra=extra), ckpt_path)

    best = BestCheckpoint(os.path.join(cfg.out_dir, "best.pt"), model=model, ema=ema,
                          config=config_to_dict(cfg), classes=loaders.classes, save=save_on_main)

    def validate_and_keep_best() -> Optional[dict]:
        """Validate, log, update best.pt; None (nothing logged or written) when a stop request ended it."""
        with progress_kept_on_error(save_checkpoint, model, state.step, dist.distributed, "validation"):
            metrics = validate(model, ema, loaders.val, device, cfg.train.amp, cfg.log.act_max,
                               should_stop=preemption.should_stop)
        if metrics is not None:
            logger.log(state.step, metrics)
            best.offer(state, metrics)
        return metrics

    # -- The loop. Wrap for training: DDP (gradient all-reduce), then torch.compile (PyTorch's order).
    train_model: nn.Module = model
    if dist.distributed:
        train_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.train.compile:
        train_model = torch.compile(train_model)
    criterion = build_criterion(cfg, mixup=loaders.mixup is not None)

    def compute_loss(m: nn.Module, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = criterion(m(images), targets)
        aux = 0.0  # regularizers' loss terms (both scale with the task loss when rescaled)
        if tweo is not None:
            aux = aux + tweo.aux_loss(loss, state.step)
        if decay is not None and cfg.cd.mode == "loss":
            aux = aux + decay.aux_loss(loss)
        return loss + aux

    total_steps = min(cfg.sched.epochs * updates_per_epoch, cfg.train.max_steps or sys.maxsize)

    def log_step(step: int, metrics: dict) -> None:
        """metrics.jsonl / TensorBoard / wandb, and one line in train.log and stdout per log step."""
        logger.log(step, metrics)
        if "train/loss" in metrics:
            log.info("%s", progress_line(step, metrics, total_steps=total_steps, epochs=cfg.sched.epochs,
                                         updates_per_epoch=updates_per_epoch,
                                         batch_size=cfg.train.batch_size))

    loop = TrainLoop(
        model=train_model, optimizer=optimizer, compute_loss=compute_loss, device=device, amp=cfg.train.amp,
        scaler=scaler, scheduler=scheduler, per_step_schedule=cfg.sched.per_step, accum_steps=accum_steps,
        clip_grad=cfg.optim.clip_grad, ema=ema, mixup=loaders.mixup, seed=cfg.train.seed, rank=dist.rank,
        world_size=dist.world_size, max_steps=cfg.train.max_steps, log_every=cfg.train.log_every_steps,
        ckpt_every=cfg.train.ckpt_every_steps, save=save_checkpoint, log=log_step,
        metric_sources=metric_sources, should_stop=preemption.should_stop,
        divergence=(DivergenceGuard(cfg.train.divergence_factor, cfg.train.divergence_windows)
                    if cfg.train.divergence_factor else None),
        progress=cfg.log.progress and dist.is_main, log_epoch_costs=True)

    # -- The epochs: train, validate, checkpoint; stop early on preemption or train.max_steps. A stop
    # request ends a validation (train.py writes checkpoint.pt first; the resumed run validates then).
    val = {}
    reason = "finished"
    start_step, train_seconds = state.step, 0.0
    while state.validation_due or (state.epoch < cfg.sched.epochs
                                   and not reached(state.step, cfg.train.max_steps)):
        epoch_ended = False
        if not state.validation_due:
            started = time.perf_counter()
            reason = loop.run_epoch(loaders.train, state, per_gpu)
            train_seconds += time.perf_counter() - started
            epoch_ended = state.epoch_batches == 0
            if epoch_ended and reason == "epoch_end" and preemption.should_stop(state.step, boundary=True):
                reason = "preempted"  # the signal came at the epoch's last update
            state.validation_due = reason == "max_steps" or (epoch_ended and (
                state.epoch % cfg.train.eval_every_epochs == 0 or state.epoch == cfg.sched.epochs))
        if state.validation_due and reason != "preempted":
            val = validate_and_keep_best() or {}
            if val:
                state.validation_due = False
                log.info("epoch %d/%d  update %d  val top-1 %.2f%%", state.epoch, cfg.sched.epochs,
                         state.step, val["val/top1"])
            else:
                reason = "preempted"  # the signal came during validation
        save_checkpoint()
        if epoch_ended and cfg.train.keep_every_epochs and state.epoch % cfg.train.keep_every_epochs == 0:
            kept = keep_snapshot(ckpt_path, state.epoch, dist.is_main, device)
            log.info("epoch %d kept as %s", state.epoch, kept)
        if reason != "preempted" and preemption.should_stop(state.step, boundary=True):
            reason = "preempted"  # the signal came during the writes: do not start another epoch
        if reason == "preempted":
            log.info("preempted at update %d; checkpoint saved, re-run the same command to resume "
                     "(exit code %d)", state.step, EXIT_PREEMPTED)
            break
        if reason == "max_steps":
            log.info(MAX_STEPS_HINT, state.step)
            break

    # -- The end: report the current weights (not after preemption: no time, and no fresh numbers).
    if reason in ("epoch_end", "finished") and state.epoch < cfg.sched.epochs:  # max_steps at an epoch's end,
        reason = "max_steps"  # or a re-run of a run that stopped there: not finished, say how to go on
        log.info(MAX_STEPS_HINT, state.step)
    reason = "finished" if reason == "epoch_end" else reason
    if reason == "preempted":
        val = {}
    elif not val:  # a finished run re-run
        val = validate(model, ema, loaders.val, device, cfg.train.amp, cfg.log.act_max,
                       should_stop=preemption.should_stop) or {}
        reason = reason if val else "preempted"
    logger.close()
    if tweo is not None:
        tweo.remove()
    if val:
        log.info("val top-1 %.2f%% (top-5 %.2f%%) on %d images after %d updates; files in %s",
                 val["val/top1"], val["val/top5"], val["val/count"], state.step, os.path.abspath(cfg.out_dir))
        warn_if_at_chance(val["val/top1"], cfg.model.num_classes)
    log.info("%s", run_summary(state, reason, cfg.sched.epochs, time.perf_counter() - run_started,
                               (state.step - start_step) * cfg.train.batch_size, train_seconds))
    return RunResult(model=model, metrics=val, state=state, reason=reason)


def run_summary(state: TrainState, reason: str, epochs: int, wall_seconds: float, images: int,
                train_seconds: float) -> str:
    """The last line of every run: how it ended, its best validation, and this process's time and speed."""
    ended = {"finished": "finished", "preempted": "stopped by a signal (resumable)",
             "max_steps": "stopped at train.max_steps"}.get(reason, reason)
    best = (f"best val top-1 {state.best_top1:.2f}% at epoch {state.best_epoch} (update {state.best_step})"
            if state.best_top1 >= 0 else "no validation yet")
    speed = f"{images / train_seconds:.0f} img/s" if train_seconds > 0 else "no updates trained"
    return (f"run summary: {ended} at update {state.step}, epoch {state.epoch}/{epochs}; {best}; wall time "
            f"{duration(wall_seconds)}; this process trained {images} images in {duration(train_seconds)} "
            f"({speed})")


def setup_process(cfg: Config, dist: DistInfo) -> None:
    """Logging to out_dir/train.log (main rank), TF32 matmuls, and deterministic kernels if asked."""
    setup_logging(cfg.out_dir, dist.is_main)
    log.info("%s", describe_environment(dist))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def accumulation_steps(cfg: Config, world_size: int) -> int:
    """Gradient accumulation steps per update: the global batch is what the recipe (and the lr rule)
    speaks of, so it is fixed and split into processes x per-process batches x accumulation steps."""
    per_gpu = cfg.train.batch_size_per_gpu
    if cfg.train.batch_size % (per_gpu * world_size):
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} is not a multiple of batch_size_per_gpu="
                          f"{per_gpu} x {world_size} processes")
    return cfg.train.batch_size // (per_gpu * world_size)


def as_config_error(section: str, build, *args, **kwargs):
    """Call `build`; a ValueError about its settings becomes a ConfigError naming the config section."""
    try:
        return build(*args, **kwargs)
    except ValueError as e:
        raise ConfigError(f"{section}: {e}") from e


def reached(step: int, max_steps: int | None) -> bool:
    return max_steps is not None and step >= max_steps


def build_criterion(cfg: Config, mixup: bool) -> nn.Module:
    """DeiT's choice: soft-target CE with mixup (smoothing inside Mixup), else label-smoothing CE."""
    if mixup:
        return SoftTargetCrossEntropy()
    if cfg.data.label_smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=cfg.data.label_smoothing)
    return nn.CrossEntropyLoss()


def validate(model: nn.Module, ema, loader, device: torch.device, amp: str, act_max: bool = False,
             should_stop=None) -> Optional[dict]:
    """val/* (and val_ema/*) accuracy; with `act_max`, the paper's activation maxima act/max_module and
    act/max_block over the validation set (max over all ranks). None when `should_stop` (a preemption
    request) ended it."""
    with ActivationProbe(model) if act_max else contextlib.nullcontext() as probe:
        raw = evaluate(model, loader, device, amp, should_stop=should_stop)
        if raw is None:
            return None
        metrics = {f"val/{k}": v for k, v in raw.items()}
    if act_max:
        metrics.update(probe.result(reduce_fn=lambda t: all_reduce(t, op="max"), device=device).metrics())
    if ema is not None:
        averaged = evaluate(ema.module, loader, device, amp, should_stop=should_stop)
        if averaged is None:
            return None
        metrics.update({f"val_ema/{k}": v for k, v in averaged.items()})
    return metrics


def check_resumable(saved: dict, current: Config, source: str) -> None:
    """The checkpoint `source` (out_dir's checkpoint.pt or the train.resume file) must be of the same model
    and data set; other settings that change what the run computes may differ only with
    train.allow_changed_config=true (paths, logging and train.max_steps may always change:
    engine/run_dir.py ENVIRONMENT_KEYS)."""
    current_d = config_to_dict(current)
    own = os.path.abspath(source) == os.path.abspath(os.path.join(current.out_dir, "checkpoint.pt"))
    other = "use another out_dir" if own else "give train.resume a checkpoint of this model and data set"
    architecture = [k for k in current_d["model"] if k not in ("pretrained", "pretrained_strict")]
    if any(saved["model"].get(k) != current_d["model"][k] for k in architecture):
        raise CheckpointError(f"{source} was written for model {saved['model']}, not "
                              f"{current_d['model']}: {other}, or use the original model settings")
    if saved["data"]["dataset"] != current.data.dataset:
        raise CheckpointError(f"{source} was trained on data.dataset={saved['data']['dataset']!r}, "
                              f"not {current.data.dataset!r}: {other}")
    if saved["optim"]["name"] != current.optim.name:  # its moments mean nothing to another optimizer
        raise CheckpointError(f"{source} holds the state of optim.name="
                              f"{saved['optim']['name']}, which optim.name={current.optim.name} cannot use: "
                              f"resume with optim.name={saved['optim']['name']}, or start a new run from its "
                              f"weights (another out_dir, model.pretrained={source})")
    unused = start_only_changes(saved, current_d)
    if unused:  # e.g. new pretrained weights: a resumed run takes its weights from the checkpoint
        raise CheckpointError(f"{source} continues a run, and only a run's start reads {'; '.join(unused)}: "
                              f"pass the values it started with to continue it, or start a new run with the "
                              f"new ones (another out_dir)")
    changed = config_changes(saved, current_d)
    if changed and not current.train.allow_changed_config:
        raise CheckpointError(f"{source} was written with other settings "
                              f"({'; '.join(changed)}): re-run with those settings, use another out_dir, or "
                              f"pass train.allow_changed_config=true to continue with the new ones")
    if changed:
        log.warning("resuming with changed settings: %s", "; ".join(changed))


def warn_if_at_chance(top1: float, num_classes: int) -> None:
    """A finished run whose accuracy is near chance probably diverged or never learned: say so."""
    chance = 100.0 / num_classes
    if num_classes > 1 and top1 <= 1.5 * chance:
        log.warning("val top-1 %.2f%% is at chance level (%.2f%% for %d classes): the run did not learn; "
                    "check the learning rate and the loss in metrics.jsonl", top1, chance, num_classes)


def parse_args(argv: list[str]) -> Config:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=None,
                        help=f"YAML recipe; repeat to layer several (default: {DEFAULT_CONFIG})")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=1e-3 out_dir=runs/x")
    add_config_arguments(parser, "train.py")
    args = parse_known(parser, argv, "train.py")
    paths = args.config or [DEFAULT_CONFIG]
    try:
        cfg = load_config(paths, args.overrides)
    except IgnoredOverrideError as e:
        if args.config:
            raise
        raise IgnoredOverrideError(f"{e}. No --config was given: the default config is {DEFAULT_CONFIG} "
                                   f"(digits); pass --config configs/... for another recipe") from None
    if not cfg.out_dir:
        cfg.out_dir = os.path.join("runs", "+".join(os.path.splitext(os.path.basename(p))[0] for p in paths))
    if args.print_config:
        print_config(cfg)
        sys.exit(0)
    return cfg


if __name__ == "__main__":
    try:
        if main(parse_args(sys.argv[1:])).reason == "preempted":
            sys.exit(EXIT_PREEMPTED)  # checkpoint written; the same command resumes (engine/preemption.py)
    except (ConfigError, CheckpointError, DataError, ModelError, RunDirError, NonFiniteLossError,
            DivergenceError) as e:
        sys.exit(f"error: {e}")
