"""Training settings refused before a run builds anything: the checks that need the cd package or timm, which the
config loader (configs/, which imports no other package of the project) cannot make.

    check_training_settings(cfg)   # ConfigError naming the config key

train.py runs them before its processes meet and before out_dir is claimed, and scripts/sweep.py for every run
before the first one trains: otherwise cd.lam_per_role.fc3 or optim.name=sgdd would be refused only once that run's
model, data loaders and optimizer are built, after a sweep's earlier runs trained. The checks themselves stay where
the settings are used (cd.decay.check_settings, timm's optimizer registry); only the messages name the config keys.
"""
from __future__ import annotations

import contextlib
import difflib
import logging
import os
from types import SimpleNamespace
from typing import Any, Optional

import torch

from cd.decay import budget_weight_decay, check_settings
from cd.pairs import ROLES
from configs import ConfigError
from configs.schema import FLOAT32_MAX
from engine.optim import POLY_POWER, build_optimizer, check_optimizer_settings, lr_rule, peak_lr

log = logging.getLogger(__name__)


def check_training_settings(cfg: Any) -> None:
    """Refuse (ConfigError, one line naming the key and the fix) a CD setting ColinearityDecay would refuse before
    it looks at the model, an optim.name timm's registry does not have, optim.* settings the optimizer would not be
    built with as written (engine/optim.py `check_optimizer_settings`: optim.name in upper case, optim.fused=true
    for an optimizer torch has no fused kernel of), the budget rule (cd.budget) beside an optimizer whose weight
    decay is not decoupled (`check_budget_optimizer`) or with cd.lam above optim.weight_decay (`check_budget`), a
    peak lr the optimizer's first step overflows float32 with (`check_peak_lr`), and a schedule whose ends lie above
    its peak (`check_schedule_ends`) unless the run may continue a checkpoint, which train.py judges once it has
    read it (`check_schedule_on_resume`)."""
    if cfg.cd.enabled:
        check_cd_settings(cfg.cd)
    check_optimizer_name(cfg.optim.name)
    try:  # the name's case, betas beside an optimizer that reads none, sgd at momentum 0, a fused kernel torch lacks
        check_optimizer_settings(cfg.optim)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.cd.enabled and cfg.cd.budget:
        check_budget_optimizer(cfg.optim.name, cfg.optim.momentum)
        check_budget(cfg.optim.weight_decay, cfg.cd.lam)
    check_peak_lr(cfg)
    if not may_resume(cfg):
        check_schedule_ends(cfg)


def check_peak_lr(cfg: Any) -> None:
    """Refuse a peak learning rate that the optimizer's first step overflows float32 with (a traceback from inside
    torch at the first update past warmup, after the model and data were built). The schema bounds optim.lr and
    optim.lr_base each by float32's range (configs/schema.py FLOAT32_MAX); the scaled peak can pass it, and an
    optimizer may step with a multiple of the lr: Adam's first step is lr / (1 - beta1), 10 x the lr, so an lr
    from 3.4e37 overflowed. Which multiple an optimizer takes is its own, so the check is one real step of it, at
    the peak, on one float32 parameter (`_first_step_overflows`)."""
    peak = peak_lr(cfg.optim, cfg.train.batch_size)
    if peak < FLOAT32_MAX and not _first_step_overflows(cfg.optim, peak):
        return
    key, value = ("optim.lr", cfg.optim.lr) if cfg.optim.lr is not None else ("optim.lr_base", cfg.optim.lr_base)
    rule = lr_rule(cfg.optim, cfg.train.batch_size)
    raise ConfigError(f"{key}={value:g}: the first step of optim.name={cfg.optim.name} at the peak learning rate "
                      f"({rule}) overflows float32, whose largest number is {FLOAT32_MAX:g}; give a smaller {key}")


def _first_step_overflows(optim: Any, lr: float) -> bool:
    """Whether one step of the optimizer `optim` names, at `lr` (its weight decay, betas, momentum), overflows
    float32 on a parameter and gradient of ones: torch's "value cannot be converted to type float without overflow".
    Another failure of the step says nothing about the lr (the run reports it where it comes)."""
    # unseen: a global step hook of the user's (or a test's) counts the run's steps, and the CPU generator (the probe's
    # init draws) is the run's
    with _without_global_optimizer_hooks(), torch.random.fork_rng(devices=[]):
        return _probe_step_overflows(optim, lr)


@contextlib.contextmanager
def _without_global_optimizer_hooks():
    """torch's global optimizer step hooks (register_optimizer_step_pre_hook / _post_hook) left out while the
    probe steps, put back after; torch keeps them in two module dicts (a torch without them: nothing to leave out)."""
    import torch.optim.optimizer as optimizer_module

    kept = [(d, dict(d)) for d in (getattr(optimizer_module, "_global_optimizer_pre_hooks", None),
                                   getattr(optimizer_module, "_global_optimizer_post_hooks", None)) if d is not None]
    for hooks, _ in kept:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, saved in kept:
            hooks.update(saved)


def _probe_step_overflows(optim: Any, lr: float) -> bool:
    probe = torch.nn.Linear(1, 1, device="cpu")  # no group_matcher: the peak is the largest lr of any layer decay
    settings = SimpleNamespace(**{**vars(optim), "layer_decay": None, "fused": False})
    try:
        optimizer = build_optimizer(probe, settings, lr=lr, weight_decay=optim.weight_decay)
        for p in probe.parameters():
            p.grad = torch.ones_like(p)
        with torch.no_grad():
            for p in probe.parameters():
                p.fill_(1.0)
        optimizer.step()
    except RuntimeError as e:
        return "overflow" in str(e)
    except Exception:  # noqa: BLE001 - not the lr's: left to the run, which names it
        return False
    return False


def may_resume(cfg: Any) -> bool:
    """Whether train.py will look for a checkpoint to continue: train.resume given, or out_dir holding one."""
    return bool(cfg.train.resume) or os.path.isfile(os.path.join(cfg.out_dir, "checkpoint.pt"))


def check_schedule_on_resume(cfg: Any, saved: Optional[dict]) -> None:
    """`check_schedule_ends` for a run that may continue a checkpoint, once train.py has read it: a fresh start
    (`saved`, the checkpoint's config dict, None) is checked as any; a resume only where the checkpoint's own
    settings pass, so that a run written before the check existed (batch 8 at the default lr_base: min_lr above its
    peak) continues as it started, which the resume check (settings unchanged) would otherwise leave no way to do."""
    if saved is not None:
        try:
            check_schedule_ends(SimpleNamespace(**{section: SimpleNamespace(**saved[section])
                                                   for section in ("optim", "sched", "train")}))
        except ConfigError as e:
            log.warning("%s (the checkpoint's own settings: the run continues as it was written)", e)
            return
    check_schedule_ends(cfg)


def check_poly_power(cfg: Any, saved_scheduler: Optional[dict], source: str, updates_left: int) -> None:
    """A poly run resumed from a checkpoint whose scheduler decayed with another power (create_scheduler_v2's 0.1,
    which build_scheduler passed before it set POLY_POWER) would change its lr curve mid-run without a word: refused
    unless train.allow_changed_config=true, then logged. The power is read from the checkpoint's scheduler state
    (timm's PolyLRScheduler.state_dict holds it); other schedules have none. A re-run with no update left to train
    (`updates_left` 0: a finished run validated again, as a sweep re-runs its commands) trains on no curve."""
    power = (saved_scheduler or {}).get("power")
    if cfg.sched.name != "poly" or power is None or power == POLY_POWER or updates_left <= 0:
        return
    change = (f"{source} was written by a poly schedule of power {power:g}, and this code's sched.name=poly decays "
              f"with power {POLY_POWER:g} (linear to sched.min_lr)")
    if not cfg.train.allow_changed_config:
        raise ConfigError(f"{change}: the lr curve would change mid-run; pass train.allow_changed_config=true to "
                          f"continue on the new curve, or start a new run (another out_dir)")
    log.warning("%s: continuing on the new curve (train.allow_changed_config=true)", change)


def check_schedule_ends(cfg: Any) -> None:
    """Refuse a schedule whose absolute ends lie above its peak: sched.min_lr (every schedule decays to it) or, with a
    warmup, sched.warmup_lr. Both are absolute while the peak scales with the batch (optim.lr_base), so a small
    batch can put the peak below them: the "decay" would then rise to min_lr (5e-4 x 8/512 = 7.8e-6 < 1e-5), the
    warmup start above the peak (DeiT's main.py would run it so). The model's own layer-decay groups keep their
    scaled peaks, as in timm and BEiT: the check is on the schedule's peak."""
    peak = peak_lr(cfg.optim, cfg.train.batch_size)
    rule = lr_rule(cfg.optim, cfg.train.batch_size)
    warmup = cfg.sched.warmup_steps > 0 if cfg.sched.steps is not None else cfg.sched.warmup_epochs > 0
    for key, value, what in (("sched.min_lr", cfg.sched.min_lr, "the schedule would rise to it, not decay"),
                             ("sched.warmup_lr", cfg.sched.warmup_lr if warmup else None,
                              "the warmup would start above the peak and fall to it")):
        if value is not None and value > peak:
            raise ConfigError(f"{key}={value:g} is above the peak learning rate ({rule}): {what}; give {key} "
                              f"below {peak:g}, or a larger optim.lr")


def check_cd_settings(cd: Any) -> None:
    """cd.decay.check_settings on a CDConfig: cd.lam_per_role is a free-form mapping, so its roles and strengths
    pass the schema."""
    try:
        # norms_every is train.log_every_steps, which the schema checks; 1 passes
        check_settings(cd.lam, cd.lam_per_role, cd.targets, cd.mode, cd.loss_coef, cd.matmul_precision, 1,
                       gated_mlp=cd.gated_mlp)
    except ValueError as e:
        raise ConfigError(cd_key_message(str(e), cd.lam_per_role)) from None


def cd_key_message(message: str, lam_per_role: dict) -> str:
    """`message` of cd.decay.check_settings ("cd <setting> ...", the Python API's names) with the config key in
    place of "cd <setting>": a role's strength is cd.lam_per_role.<role>, and an unknown role is named by its own
    key (cd.lam_per_role.fc3), the entry to drop or rename."""
    head, _, rest = message.partition(" ")
    setting, _, rest = rest.partition(" ")
    if head != "cd" or not setting:
        return message
    name = setting.rstrip(":")
    if name == "lam_per_role" and "unknown role" in rest:
        unknown = sorted(str(role) for role in lam_per_role if role not in ROLES)
        return (f"cd.lam_per_role.{unknown[0]}: unknown role; the roles are {', '.join(ROLES)}: drop the entry or "
                f"give one of those")
    key = f"cd.lam_per_role.{name}" if name in lam_per_role and name != "lam" else f"cd.{name}"
    return f"{key}{setting[len(name):]} {rest}"


LOOKAHEAD = "lookahead_"  # the one prefix timm's create_optimizer_v2 reads: Lookahead around the optimizer


def without_lookahead(name: str) -> str:
    """optim.name in lower case, less a `lookahead_` prefix: the optimizer Lookahead wraps (or the name itself)."""
    lowered = name.lower()
    return lowered[len(LOOKAHEAD):] if lowered.startswith(LOOKAHEAD) else lowered


def check_optimizer_name(name: str) -> None:
    """optim.name resolved as timm's create_optimizer_v2 resolves it (upper case: `check_optimizer_settings`):
    a name of its registry, or `lookahead_` and one. timm builds the optimizer named after the last '_' and of the
    part before it reads only whether it begins with `lookahead`, so any other part (lookahed_adamw, foo_sgd,
    _adamw) would be dropped without a word and plain AdamW / SGD trained; no name in the registry holds a '_'."""
    from timm.optim import list_optimizers

    lowered = name.lower()
    known = list_optimizers()
    prefix, _, opt = lowered.rpartition("_")
    if without_lookahead(lowered) in known:  # a registry name holds no '_': so a name, or lookahead_ and one
        return
    close = difflib.get_close_matches(lowered, known + [LOOKAHEAD + k for k in known], n=3)
    hint = f"did you mean {', '.join(close)}?" if close else "e.g. optim.name=adamw"
    if opt not in known:
        raise ConfigError(f"optim.name={name}: timm has no optimizer '{opt}'; {hint}")
    # timm's own parsing: split on '_', Lookahead where the first part is 'lookahead', the rest ignored
    lookahead = lowered.split("_")[0] == LOOKAHEAD[:-1]
    built = f"{opt} in Lookahead, ignoring the rest of" if lookahead else f"{opt}, ignoring"
    raise ConfigError(f"optim.name={name}: timm would build {built} '{prefix}_' (before an optimizer's name it reads "
                      f"'lookahead_' only); {hint}")


# timm's optimizers (1.0) whose weight decay is decoupled in the form of CD's step, W -= lr x wd x W with the
# group's lr at that update, apart from the gradient's step (before it, as AdamW, or after it, as LaProp): lowering
# wd by lam (the budget rule) then moves exactly that decay into CD (tests/test_budget_optimizers.py checks each
# one's steps). Left out: L2 decay added to the gradient (adam, sgd, momentum, lamb, ...: normalized away by Adam,
# amplified ~1/(1-momentum) by SGD), the corrected decays (adamc, sgdc, ...: lr^2 / peak lr), decay inside or beside
# a trust ratio or projection (lamb*, lars, adamp, sgdp: LAMB adapts the step only where weight_decay != 0), Adan's
# proximal form, MADGRAD's averaged one, Kron (its compiled, randomly probed preconditioner is not checked here),
# and the APEX / bitsandbytes builds, which need CUDA and their packages.
DECOUPLED_DECAY = ("adabelief", "adafactor", "adafactorbv", "adamuon", "adamw", "adamwlegacy", "adanw", "cadafactor",
                   "cadafactorbv", "cadamw", "cadanw", "claprop", "clion", "cmars", "cnadamw", "csgdw", "laprop",
                   "lion", "mars", "muon", "nadamuon", "nadamw", "nesterovw", "nmuon", "novogradw", "radabelief",
                   "radamw", "rmsproptfw", "sgdw")


def check_budget(weight_decay: float, lam: float) -> None:
    """train.py's budget rule (budget_weight_decay) on the config's values, now rather than once the model and the
    data are built (and, in a sweep, after the earlier runs trained): the same call on the same values, so what it
    refuses here train.py's call would refuse, in the words train.py gives (its section, cd.budget, first)."""
    try:
        budget_weight_decay(weight_decay, lam)
    except ValueError as e:
        raise ConfigError(f"cd.budget: {e}") from None


def check_budget_optimizer(name: str, momentum: float) -> None:
    """Refuse cd.budget=true (wd -> wd - lam, App. A.2) beside an optimizer whose weight decay is not decoupled:
    the rule assumes AdamW's lr x wd x W per update, the form of CD's own step. Under L2 decay (torch Adam, SGD)
    the lam taken from wd is not the decay CD adds: Adam normalizes the L2 term away (the rule removes no decay
    while CD comes on top), SGD's momentum amplifies it. `lookahead_` and a decoupled one pass: Lookahead pulls
    back the base optimizer's weights, CD's step and the decay alike; so does SGD without momentum
    (optim.name=momentum, optim.momentum=0), whose L2 step lr x (g + wd x W) is the decoupled form."""
    base = without_lookahead(name)
    if base in DECOUPLED_DECAY or (base == "momentum" and momentum == 0):
        return
    alike = f"{base}w" if f"{base}w" in DECOUPLED_DECAY else "adamw"  # sgd -> sgdw, nadam -> nadamw, else adamw
    raise ConfigError(f"optim.name={name} with cd.budget=true: the budget rule (weight decay minus cd.lam) assumes "
                      f"AdamW's decoupled weight decay, lr x wd x W per update apart from the gradient (the form of "
                      f"CD's step), which {base}'s is not; use optim.name={alike}"
                      f"{' or adamw' if alike != 'adamw' else ''}, or set cd.budget=false and optim.weight_decay "
                      f"yourself")
