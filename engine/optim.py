"""Optimizer, lr scaling rule and lr schedule from `OptimConfig` / `SchedConfig`, through timm.

The peak lr is `optim.lr` when given, else `optim.lr_base * (global_batch / optim.lr_base_batch)`
(linear, DeiT: 5e-4 x 1024/512 = 1e-3) or its square root (`optim.lr_scaling=sqrt`). Weight decay skips
1-D parameters, biases and the model's `no_weight_decay()` names (pos_embed, cls_token, Swin's relative
position tables), as in DeiT/Swin/timm. Layer-wise lr decay uses timm's param groups, whose `lr_scale`
the timm scheduler multiplies into each group's lr.
"""
from __future__ import annotations

import inspect
import math

import torch
from timm.optim import create_optimizer_v2, get_optimizer_info
from timm.scheduler import create_scheduler_v2

from cd.decay import make_step_hooks_run
from configs.schema import ADAM_OPTIMIZERS, OptimConfig, SchedConfig


def peak_lr(cfg: OptimConfig, global_batch: int) -> float:
    if cfg.lr is not None:
        return cfg.lr
    ratio = global_batch / cfg.lr_base_batch
    return cfg.lr_base * (ratio if cfg.lr_scaling == "linear" else math.sqrt(ratio))


def lr_rule(cfg: OptimConfig, global_batch: int) -> str:
    """The lr rule in words, for the run log."""
    if cfg.lr is not None:
        return f"lr {cfg.lr:g} (given)"
    return (f"lr {peak_lr(cfg, global_batch):g} = {cfg.lr_base:g} x {cfg.lr_scaling}({global_batch}/"
            f"{cfg.lr_base_batch})")


# timm's poly schedule is min_lr + (lr - min_lr) x (1 - t/T)^power, the power its `decay_rate` (default 0.1: the
# lr would fall to 0.79 x the peak in a 10-epoch run, 0.57 x in 300, then jump to min_lr after the last one).
# Power 1: linear to min_lr over the run, as sched.name's help says. Of the offered names only poly reads it.
POLY_POWER = 1.0

FUSED = ("adamw", "adam", "sgd", "momentum")  # timm names of torch optimizers with a fused implementation


def use_fused(cfg: OptimConfig, device: torch.device) -> bool:
    """`optim.fused`, or when it is None (auto): fused on CUDA for optimizers torch implements fused.

    Why fused by default on GPUs: with fp16 the GradScaler must know whether the gradients overflowed
    before stepping. For an ordinary optimizer it reads that verdict on the host, a sync that stalls the
    CPU until the backward pass is done every update; a fused optimizer takes the verdict as a device
    tensor and skips the update inside its kernel, so nothing waits (the CD hook is gated the same way,
    cd/decay.py). Same algorithm, different float rounding order than the default foreach kernels.
    """
    if cfg.fused is not None:
        return cfg.fused
    return device.type == "cuda" and cfg.name in FUSED


def check_optimizer_settings(cfg: OptimConfig) -> None:
    """Refuse (ValueError, one line naming the key) optim.* settings the optimizer would not be built as written
    with, whatever the model and the device: train.py asks before the run makes anything
    (engine/training_checks.py), `build_optimizer` again for its other callers."""
    if cfg.name != cfg.name.lower():
        # timm lower-cases the name itself, but betas / eps / momentum, the fused kernel and the resume
        # check go by the name as written: AdamW would train with timm's default betas, not the recipe's
        raise ValueError(f"optim.name={cfg.name}: optimizer names are timm's, in lower case; use "
                         f"optim.name={cfg.name.lower()}")
    default = OptimConfig()
    if cfg.name not in ADAM_OPTIMIZERS and (tuple(cfg.betas) != default.betas or cfg.eps != default.eps):
        # a recipe's betas (nanoGPT's 0.95) beside another optimizer: timm's would train with its own (here, at
        # training time: evaluate.py still reads the configs of runs trained that way)
        raise ValueError(f"optim.betas={list(cfg.betas)} / optim.eps={cfg.eps:g} are read for "
                         f"{', '.join(ADAM_OPTIMIZERS)} only, and optim.name={cfg.name} would train with its own; "
                         f"use one of those, or a recipe without optim.betas / optim.eps")
    if cfg.name == "sgd" and cfg.momentum == 0:
        # torch refuses it only once the model and the data are built, naming no key ("Nesterov momentum requires a
        # momentum and zero dampening"); optim.name=nesterov reads no optim.momentum (timm's 0.9, configs/loader.py)
        raise ValueError("optim.momentum=0: timm's sgd is Nesterov, which needs momentum > 0; use optim.name=momentum "
                         "for plain SGD")
    own = own_clip_norm(cfg.name)
    if own is not None and cfg.clip_grad is not None and cfg.clip_grad > own:
        # clip_grad_norm_ to a larger norm, then the optimizer's own clip to `own`: the setting would never act
        raise ValueError(f"optim.clip_grad={cfg.clip_grad:g}: optim.name={cfg.name} clips the gradients to a "
                         f"global norm of {own:g} itself (timm's max_grad_norm), so a larger bound never acts; give "
                         f"optim.clip_grad <= {own:g}, or drop it")
    if cfg.fused and cfg.name not in FUSED:  # auto (None) picks a fused kernel only where torch has one
        raise ValueError(f"optim.fused=true: torch has no fused '{cfg.name}'; use one of {', '.join(FUSED)}")


def own_clip_norm(name: str) -> float | None:
    """The global gradient norm the timm optimizer `name` clips to inside its step (its `max_grad_norm`: timm's
    Lamb and its variants, 1.0), on top of optim.clip_grad; None for one that does not clip (or a name timm lacks:
    create_optimizer_v2 refuses it)."""
    try:
        info = get_optimizer_info(name.removeprefix("lookahead_"))
    except ValueError:
        return None
    if isinstance(info.opt_class, str):  # a class of another package (apex's fused Lamb), not imported here
        return None
    parameter = inspect.signature(info.opt_class).parameters.get("max_grad_norm")
    norm = (info.defaults or {}).get("max_grad_norm", parameter.default if parameter is not None else None)
    return float(norm) if isinstance(norm, (int, float)) and not isinstance(norm, bool) else None


def check_layer_decay(model: torch.nn.Module, cfg: OptimConfig) -> None:
    """optim.layer_decay needs a model with timm's layer grouping (group_matcher): timm would put every parameter in
    one layer and only log a warning, and no decay would happen. Raises ValueError. train.check_model_fits_run makes
    it before the data are read (and scripts/sweep.py before its first run), build_optimizer again."""
    if cfg.layer_decay is not None and not hasattr(model, "group_matcher"):
        raise ValueError(f"optim.layer_decay={cfg.layer_decay:g} would have no effect: {type(model).__name__} has no "
                         f"layer grouping (timm's group_matcher), so every parameter would get "
                         f"the same lr; drop optim.layer_decay")


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float, weight_decay: float,
                    device: torch.device = torch.device("cpu")) -> torch.optim.Optimizer:
    check_optimizer_settings(cfg)
    kwargs = dict(eps=cfg.eps, betas=tuple(cfg.betas)) if cfg.name in ADAM_OPTIMIZERS else {}
    if cfg.name in ("sgd", "momentum"):
        kwargs["momentum"] = cfg.momentum
    if use_fused(cfg, device):
        kwargs["fused"] = True
    check_layer_decay(model, cfg)
    try:
        optimizer = create_optimizer_v2(model, opt=cfg.name, lr=lr, weight_decay=weight_decay,
                                        layer_decay=cfg.layer_decay, **kwargs)
    except (AssertionError, ImportError) as e:  # timm's APEX / bitsandbytes optimizers: CUDA and the package
        raise ValueError(f"optim.name={cfg.name} cannot be built here ({e}); use another optimizer, "
                         f"e.g. optim.name=adamw") from e
    # the loop counts real updates (and CD, TWEO act) in step hooks: from the first step, lookahead_* included
    make_step_hooks_run(optimizer)
    return optimizer


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedConfig, updates_per_epoch: int):
    """A timm scheduler; `sched.epochs` is the whole run, warmup included (also with warmup_prefix). With
    `sched.steps` the schedule is in updates: `steps` updates, `warmup_steps` of them warmup, the lr
    set every update (timm counts one "epoch" per update then), the decay after the warmup (nanoGPT)."""
    if cfg.steps is not None:
        if cfg.warmup_steps >= cfg.steps:
            raise ValueError(f"sched.warmup_steps={cfg.warmup_steps} is not below sched.steps={cfg.steps}: "
                             "the run would never leave its warmup")
        # nanoGPT's shape: warmup to the peak lr at update warmup_steps, then the decay over the rest. The
        # warmup is timm's, counted from update 1 at warmup_lr (lr 0 with the LM recipes' warmup_lr 0: that
        # update moves no weight), warmup_lr + (t-1)/W * (lr - warmup_lr) at update t; nanoGPT's get_lr gives
        # lr * t/(W+1) there. From update W+1 on the two schedules agree.
        scheduler, _ = create_scheduler_v2(optimizer, sched=cfg.name, num_epochs=cfg.steps - cfg.warmup_steps,
                                           warmup_epochs=cfg.warmup_steps, warmup_lr=cfg.warmup_lr,
                                           min_lr=cfg.min_lr, warmup_prefix=True, step_on_epochs=False,
                                           updates_per_epoch=1, decay_rate=POLY_POWER)
        return scheduler
    cosine_epochs = cfg.epochs - cfg.warmup_epochs if cfg.warmup_prefix else cfg.epochs
    scheduler, _ = create_scheduler_v2(optimizer, sched=cfg.name, num_epochs=cosine_epochs,
                                       warmup_epochs=cfg.warmup_epochs, warmup_lr=cfg.warmup_lr,
                                       min_lr=cfg.min_lr, warmup_prefix=cfg.warmup_prefix,
                                       step_on_epochs=not cfg.per_step, updates_per_epoch=updates_per_epoch,
                                       decay_rate=POLY_POWER)
    return scheduler


def schedule_length(cfg: SchedConfig, updates_per_epoch: int) -> tuple[int, int, bool]:
    """(epochs, updates, per_step): how long the run is and whether the lr changes every update. With
    `sched.steps`, the epochs are those needed to hold `steps` updates (the last one partial)."""
    if cfg.steps is not None:
        return -(-cfg.steps // updates_per_epoch), cfg.steps, True
    return cfg.epochs, cfg.epochs * updates_per_epoch, cfg.per_step
