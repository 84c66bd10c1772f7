"""`ColinearityDecay`: the CD regularizer object (paper Sec. 3.3) around the pure math in `cd/update.py`.

    decay = ColinearityDecay(model, lam=0.005)  # pairs found once, targets A+B
    handle = decay.attach(optimizer)            # W2 <- W2 - lr*lam*W2 W1n W1n^T before each real step
    ...
    log(decay.metrics())                        # cd/pair_energy/<role>, cd/update_norm/<role>

The object holds the selected pairs, the per-pair strengths and a cached batching plan. It has no state
that changes the update: everything is fixed by the constructor arguments (i.e. the config), so resuming
needs only the config; `state_dict()` carries a logging counter and the config echo for a consistency check.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import warnings
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .layouts import LAYOUTS, Layout, check_layouts
from .pairs import ROLES, Pair, check_switches, find_pairs
from .sharded import any_sharded, block_plans, register_shards, sharded_colinearity_decay_, sharded_pair_energy
from .update import (PRECISIONS, align_to_task_loss, build_plan, check_tf32_device, check_tf32_dtype,
                     colinearity_decay_, is_sharded, known_zero, onto, pair_energy, pair_penalty, plan_key, refuse_meta,
                     resolve_precision)
from .verify import UnsupportedModelError, refuse_split_devices
from .wrappers import (check_model, closure_then, in_outer_step, refuse_deepspeed, refuse_backward_steps,
                       steps_without_hooks, torch_optimizer, unhooked_step_text, unwrap_model)

TARGETS = ("A", "B", "C", "A+B")
MODES = ("decoupled", "loss")
DEFAULT_LAM, DEFAULT_LOSS_COEF, DEFAULT_MATMUL_PRECISION = 0.005, 0.01, "auto"
# optimizer -> the objects whose CD update runs in its step (`ColinearityDecay.attach`, the integrations'
# `OptimizerBinding`), weakly held both ways: a matrix that two of them decay would be decayed twice per step
_HOOKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def make_step_hooks_run(optimizer: torch.optim.Optimizer) -> None:
    """Make torch call `optimizer`'s step hooks from its next step on. torch wraps an optimizer class's `step`
    so that it calls them in Optimizer.__init__, or lazily at the first zero_grad(); an optimizer that skips
    Optimizer.__init__ (timm's Lookahead) takes hooks without error but calls none of them before its first
    zero_grad(): CD would miss the first update, and every update in a trainer that only zeroes the model's
    gradients (Hugging Face's). This is torch's own wrapping (the one zero_grad() does), done now."""
    if not getattr(type(optimizer).step, "hooked", False):
        optimizer._patch_step_function()


def register_step_update(owner: Any, decay: "ColinearityDecay", optimizer: torch.optim.Optimizer, who: str) -> None:
    """Record that `owner` runs `decay`'s update in `optimizer`'s step, after checking that no other live
    owner there decays one of the same matrices. An owner says which decay it still runs in a step with
    `_hooked_decay(optimizer)` (None once its hook is removed).

    Raises:
        RuntimeError: another owner hooked into `optimizer` decays one of `decay`'s matrices, or `optimizer` steps
            the weights inside the backward, outside its step (`refuse_backward_steps`).
    """
    refuse_backward_steps(optimizer, who)
    mine = {id(t): name for name, t in decay._decayed_named()}
    for other in list(_HOOKED.get(optimizer, ())):
        theirs = other._hooked_decay(optimizer) if other is not owner else None
        shared = [mine[id(t)] for t in theirs._decayed() if id(t) in mine] if theirs is not None else []
        if shared and "loss" in (theirs.mode, decay.mode):  # the loss form makes no update in the step: its penalty
            second = ("this object's aux_loss penalty (mode='loss')" if decay.mode == "loss"
                      else "this object's update in the optimizer's step")
            first = (f"another CD object (mode='loss') attached to an optimizer decays {shared[0]} by its aux_loss "
                     f"penalty" if theirs.mode == "loss" else "another CD update runs in this optimizer's step "
                     f"already (a ColinearityDecay.attach or a cd.integrations callback) and decays {shared[0]}")
            raise RuntimeError(f"{who}: {first}; {second} would decay it a second time. Use one per model (remove "
                               f"the other first)")
        if shared:
            raise RuntimeError(f"{who}: another CD update runs in this optimizer's step already (a "
                               f"ColinearityDecay.attach or a cd.integrations callback) and decays {shared[0]} too; "
                               f"each step would decay it twice. Use one per model (remove the other first)")
    _HOOKED.setdefault(optimizer, weakref.WeakSet()).add(owner)
    make_step_hooks_run(optimizer)  # the owner's hooks are registered next: they must run from the first step


def _parameter_at(root: nn.Module, name: str) -> Optional[Tensor]:
    """The parameter `root` holds under `name` now (None if there is none): a walk down the module path,
    as named_parameters() would name it, without enumerating every parameter (this runs at every step)."""
    *path, attr = name.split(".")
    module: Optional[nn.Module] = root
    for part in path:  # a submodule removed or renamed since ends the walk
        module = module._modules.get(part)
        if module is None:
            return None
    return module._parameters.get(attr)


def _gathered_by_fsdp2(found: Tensor, now: Optional[Tensor]) -> bool:
    """Whether `now` is FSDP2's whole (unsharded) parameter of the shard `found`: fully_shard registers it from a
    forward until the reshard, and the root module's (reshard_after_forward does not apply to it) stays so after a
    forward without a backward (an evaluation). The shard holds the same values then."""
    return is_sharded(found) and now is not None and not is_sharded(now) and now.shape == found.shape


def check_parameters_current(root: Optional[nn.Module], named: list[tuple[str, Tensor]], who: str,
                             reads_only: bool = False) -> None:
    """Refuse when `root`'s parameters under those names are no longer the tensors found there (`root` None: the
    model is gone, nothing to check): load_state_dict(assign=True), to_empty() or fully_shard replaced them since,
    and what reads or writes the old tensors would act on tensors the model does not use, without an error.
    `reads_only`: the caller only reads the tensors, and an FSDP2 shard whose whole parameter the model holds for
    now (`_gathered_by_fsdp2`) is current.

    Raises:
        ValueError: naming the first replaced parameter, the usual causes and the fix (FSDP2's whole parameter of
            a shard, held after a forward until the reshard, has its own cause and fix).
    """
    if root is None:
        return
    moved = [(name, t, now) for name, t in named if (now := _parameter_at(root, name)) is not t]  # one walk each
    stale = [name for name, t, now in moved if not (reads_only and _gathered_by_fsdp2(t, now))]
    if stale:
        more = f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""
        gathered = [name for name, t, now in moved if _gathered_by_fsdp2(t, now)]
        if gathered:  # not replaced: FSDP2 holds the whole parameter of the shard, which building later cannot fix
            raise ValueError(f"{who}: the model's parameter {gathered[0]} is FSDP2's whole (unsharded) parameter "
                             f"for now, not the shard its pairs were found on: FSDP2 keeps a unit's whole "
                             f"parameters from a forward until its reshard, the root unit's until the next backward "
                             f"(after an evaluation forward, too), and computes with it, not with the shard an update "
                             f"writes. Call reshard() on the fully_shard-ed module that holds it (e.g. the root "
                             f"model) or run the backward first, or give {who} the fully_shard-ed root model")
        raise ValueError(f"{who}: the model's parameter {stale[0]}{more} is no longer the "
                         f"tensor its pairs were found on: the parameters were replaced since "
                         f"(load_state_dict(assign=True), to_empty(), a new module, FSDP2's fully_shard, FSDP1). "
                         f"Build {who} after the model's parameters are final (after fully_shard; FSDP1 is not "
                         f"supported)")


def _role_order(key: str) -> tuple[int, str]:
    return (ROLES.index(key.split("_")[0]), key)


def block_types(root: nn.Module, pairs: Sequence[Pair]) -> dict[str, str]:
    """Block name -> its class's name, for `refuse_split_devices`'s message about a pair split after construction."""
    blocks = {p.block for p in pairs}
    return {name: type(m).__name__ for name, m in root.named_modules() if name in blocks}


def energy_metrics(pairs: list[Pair], plan=None, block_plans_=None) -> dict[str, float]:
    """cd/pair_energy/<role>: mean over the role's blocks of ||W2 W1n||_F^2 (`pair_energy`: separate q, k, v layers
    count as one stacked [W_Q; W_K; W_V]); a diagnostic for any run, with or without CD, that syncs with the
    device, so call it at log steps only. `block_plans_`: the pairs are sharded by FSDP2 (`cd.sharded`; a
    collective then, called on every rank)."""
    energy = pair_energy(pairs, plan) if block_plans_ is None else sharded_pair_energy(pairs, block_plans_)
    return {f"cd/pair_energy/{role}": float(energy[role]) for role in ROLES if role in energy}


def pair_energy_source(model: nn.Module, gated_mlp: bool = False, verify: bool = True,
                       example_input: Optional[Tensor] = None,
                       layouts: Sequence[Layout] = LAYOUTS) -> Callable[[], dict[str, float]]:
    """A metric source for runs without CD: `energy_metrics` of every pair of `model`, found once here,
    so that baselines log the same cd/pair_energy/<role> curves as CD runs (whose `metrics` include them).

    `verify`, `example_input` and `layouts` are `find_pairs`'s (as for `ColinearityDecay`). A model sharded by FSDP2
    (`fully_shard`) takes verify=False (the check's meta forward would run FSDP's hooks); build the source after
    fully_shard, as ColinearityDecay. Its energies are then those of the unsharded model (each block's matrices
    gathered whole, `cd.sharded`), and the source is a collective: call it on every rank at the same steps (a call
    on one rank alone waits for the others forever), and log its result from one. It may be called after a forward
    without a backward (an evaluation), when the root module's parameters are whole: the shards hold the same values.

    A model CD does not support (no pairs, e.g. a ConvNeXt, or a refused block such as Swin V2's) trains
    without CD all the same: its source logs nothing, with one warning saying why. A model whose parameters are on
    the meta device (no values to measure) is a ValueError here (`refuse_meta`), and so is gated_mlp=True on a
    model without a gated MLP (`find_pairs`: the switch would change no pair). A source whose model's
    parameters were replaced since (made before fully_shard, load_state_dict(assign=True)) raises a ValueError when
    called, rather than log the old tensors' energies. A `model` that is no nn.Module (None, a state_dict) is a
    TypeError (`cd.wrappers.check_model`), not a model without pairs.
    """
    check_model(model, "pair_energy_source")  # before register_shards walks it
    try:
        register_shards(model)  # FSDP2: the pairs are found on the shards, also after a forward
        pairs = find_pairs(model, example_input, verify=verify, gated_mlp=gated_mlp, layouts=layouts)
    except UnsupportedModelError as e:
        warnings.warn(f"{str(e).rstrip('.')}; no cd/pair_energy metrics are logged for this model", stacklevel=2)
        return dict
    refuse_meta(pairs, "pair_energy_source")
    plan, plans = (None, block_plans(pairs)) if any_sharded(pairs) else (build_plan(pairs), None)  # FSDP2: by block
    key = plan_key(pairs)
    types = block_types(unwrap_model(model), pairs)
    root = weakref.ref(unwrap_model(model))
    named = [(p.name, p.downstream) for p in pairs] + [(p.upstream_name, p.upstream) for p in pairs]

    def source() -> dict[str, float]:
        nonlocal plan, key
        # a source made before fully_shard (or load_state_dict(assign=True)) would log the replaced tensors' energies:
        # constant curves that look like data
        check_parameters_current(root(), named, "pair_energy_source", reads_only=True)
        if plans is None and plan_key(pairs) != key:  # some blocks moved to another device since (`plan_key`)
            refuse_split_devices(pairs, types)  # a pair's two matrices moved apart failed inside torch.mm
            plan, key = build_plan(pairs), plan_key(pairs)
        return energy_metrics(pairs, plan, plans)

    return source


def _finite_nonnegative(value: object) -> bool:
    """A real number (not a bool: lam=True is a slip, not 1.0), finite and >= 0."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value >= 0)


def _ran_on_device(live: list, gate: Optional[Tensor]) -> Optional[Tensor]:
    """Whether an update with these lrs (of nonzero strengths, none a Python zero) moves its matrices, as a 0-dim
    bool tensor where only the device knows (None: it does): a fused step's GradScaler gate, and lrs that are all
    0-dim tensors, 0 in a warmup from lr 0. Reading either would wait for the device at every step, so such an
    update runs (its deltas are zero when skipped) and `_count_gated` takes it out of cd/updates lazily."""
    if not all(isinstance(lr, Tensor) for lr in live):
        return gate
    # on one device: a split model's param groups may hold their lrs on their own blocks' devices (`onto`); an
    # accelerator's where there is one: a CPU flag stays where it is and enters the op as a scalar, whereas an
    # accelerator's flag moved to the CPU would wait for the device
    flags = [lr != 0 for lr in {id(lr): lr for lr in live}.values()]
    device = next((f.device for f in flags if f.device.type != "cpu"), flags[0].device)
    moves = functools.reduce(torch.logical_or, [onto(f, device) for f in flags])
    return moves if gate is None else gate & onto(moves, gate.device)


def _kept_unless(ran: Tensor, new: Tensor, old: Tensor) -> Tensor:
    """`new` where `ran`, else `old`, by arithmetic: a 0-dim `ran` on the CPU (a CPU lr tensor's verdict) enters a
    CUDA product as a scalar, with no copy to the device and no wait for it."""
    r = onto(ran, new.device).to(new.dtype)  # a split model's verdict may be on another GPU than the norms
    return new * r + old * (1 - r)


def _seen_flags(ran: Optional[Tensor], result: Mapping[str, Tensor], last: Mapping[str, Tensor],
                seen: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The flags of the norms that `result`, a part of an update that ran only where the 0-dim `ran` says (None: it
    ran), gives beside `last` (flagged in `seen`): key -> 0-dim 1 once an update that ran gave the key's norm, 0 while
    only skipped ones did (a norm of zero deltas, no update's, which `metrics` leaves out). A norm known to be an
    update's needs no flag; a key new here takes `ran`, a flagged one keeps its 1 or takes `ran`. Arithmetic
    (`_kept_unless`) on the norm's device: no copy of a CPU verdict to it and no wait for the device."""
    if ran is None:
        return {}
    return {k: _kept_unless(ran, torch.ones_like(v), seen[k] if k in last else torch.zeros_like(v))
            for k, v in result.items() if k not in last or k in seen}


def decays_nothing(lam: object, lam_per_role: object) -> bool:
    """Whether CD at strength `lam` with the per-role strengths `lam_per_role` (a mapping or None; a role without an
    entry takes lam) changes no weight: every strength is 0. Its decoupled update is then skipped in every step, its
    loss form's term is 0 (`ColinearityDecay.apply`, `aux_loss`) and the budget rule's wd - lam leaves the weight decay
    as given, so the run trains bit for bit as without CD: configs/debug/tiny.yaml trained with cd.lam=0 (decoupled or
    loss form, with or without the budget rule, lam_per_role entries of 0 or none) ends with the baseline's weights
    (tests/test_method_of_a_training_that_changes_nothing.py). A value that is no number counts as a strength."""
    per_role = {} if lam_per_role is None else lam_per_role
    if not isinstance(per_role, Mapping):
        return False
    return all(isinstance(v, numbers.Real) and not isinstance(v, bool) and v == 0 for v in (lam, *per_role.values()))


def config_decays_nothing(cfg_cd: Any) -> bool:
    """Whether train.py's CD settings `cfg_cd` (a CDConfig: lam, lam_per_role, mode, loss_coef, budget) train as
    without CD, bit for bit: every strength 0 (`decays_nothing`), or the loss form at loss_coef 0 (its term 0 x a
    finite penalty) with the weight decay as given (budget false, or lam 0). The loss form's budget rule at a lam
    above 0 lowers the weight decay: that run is no baseline."""
    return decays_nothing(cfg_cd.lam, cfg_cd.lam_per_role) or (
        cfg_cd.mode == "loss" and cfg_cd.loss_coef == 0 and (not cfg_cd.budget or cfg_cd.lam == 0))


def budget_weight_decay(weight_decay: float, lam: float) -> float:
    """The paper's regularization-budget rule: wd -> wd - lam_cd
    (App. A.2 ("Normalized CD and regularization budget")).

    E.g. 0.05 -> 0.045 for lam 0.005. The rule assumes decoupled weight decay, W -= lr * wd * W per step apart from
    the gradient (AdamW's, and the form of CD's own step), so that the lam it takes from the decay is the lam CD
    adds. Under L2 decay added to the gradient (torch.optim.Adam, SGD) it is not: Adam normalizes the L2 term
    away, so lowering wd removes almost no decay while CD comes on top, and SGD's momentum amplifies it by up to
    1 / (1 - momentum); keep such an optimizer's weight decay and leave the rule out (train.py refuses cd.budget
    beside one). Raises ValueError if the result would be negative, or if either
    value is not a finite number >= 0 (a NaN would reach AdamW as its weight decay and a negative lam raise it).
    """
    for name, value in (("weight_decay", weight_decay), ("cd.lam", lam)):
        if not _finite_nonnegative(value):
            raise ValueError(f"CD weight-decay budget: {name} must be a finite number >= 0, got {value!r}")
    wd = weight_decay - lam
    if wd < -1e-12:  # {wd:g}: 0.05 - 0.06 is shown as -0.01, not as -0.009999999999999995
        raise ValueError(f"CD weight-decay budget: weight_decay {weight_decay} - cd.lam {lam} = {wd:g} < 0; "
                         "lower cd.lam, or leave the budget rule out (train.py: cd.budget=false; your own code: keep "
                         "the optimizer's weight decay and do not call budget_weight_decay)")
    return max(wd, 0.0)


def check_settings(lam, lam_per_role, targets, mode, loss_coef, matmul_precision, norms_every, gated_mlp=False,
                   verify=True) -> dict:
    """The checks of ColinearityDecay's settings that need no model (the framework integrations run them when a
    callback or hook is made, not at the train start); returns lam_per_role as a dict. Raises ValueError."""
    check_switches("cd", gated_mlp=gated_mlp, verify=verify)
    if targets not in TARGETS:
        raise ValueError(f"cd targets must be one of {TARGETS}, got {targets!r}")
    if mode not in MODES:
        raise ValueError(f"cd mode must be one of {MODES}, got {mode!r}")
    if lam_per_role is not None and not isinstance(lam_per_role, Mapping):  # e.g. a dict's text from a command line
        raise ValueError(f"cd lam_per_role must be a mapping of role to strength, e.g. {{'fc2': 0.02}}, got "
                         f"{lam_per_role!r} ({type(lam_per_role).__name__})")
    lam_per_role = dict(lam_per_role or {})
    unknown = sorted(set(lam_per_role) - set(ROLES))
    if unknown:
        raise ValueError(f"cd lam_per_role: unknown role(s) {unknown}; roles are {list(ROLES)}")
    for role, value in {"lam": lam, **lam_per_role}.items():
        if not _finite_nonnegative(value):
            raise ValueError(f"cd {role} must be a finite number >= 0, got {value!r}")
    if not _finite_nonnegative(loss_coef):
        raise ValueError(f"cd loss_coef must be a finite number >= 0, got {loss_coef!r}")
    if matmul_precision not in ("auto",) + PRECISIONS:
        raise ValueError(f"cd matmul_precision must be one of {('auto',) + PRECISIONS}, "
                         f"got {matmul_precision!r}")
    # a bool is an int in Python: norms_every=True would be 1; numpy's integers are integers (numbers.Integral)
    if not (isinstance(norms_every, numbers.Integral) and not isinstance(norms_every, bool) and norms_every >= 1):
        raise ValueError(f"cd norms_every must be an integer >= 1, got {norms_every!r}")
    # a setting of the other form would be silently unused (values compared with the defaults: a default given
    # explicitly changes nothing either way)
    if mode == "loss" and matmul_precision != DEFAULT_MATMUL_PRECISION:
        raise ValueError(f"cd matmul_precision={matmul_precision!r} sets the decoupled update's products; mode='loss' "
                         "computes its penalty in fp32 under autograd: drop matmul_precision, or use "
                         "mode='decoupled'")
    if mode == "decoupled" and loss_coef != DEFAULT_LOSS_COEF:
        raise ValueError(f"cd loss_coef={loss_coef!r} scales the loss form's term; mode='decoupled' adds no term: drop "
                         "loss_coef, or use mode='loss'")
    return lam_per_role


# config keys that a state dict of an earlier release lacks: compared only where the saved config has them
_RECORDED_LATER = ("matmul_precision", "decayed")


def config_change(saved: Mapping[str, Any], now: Mapping[str, Any]) -> Optional[str]:
    """The warning for resuming from a CD state dict whose config `saved` differs from this run's `now`, or None.
    The decayed matrices' names are summarised (counts and one name only on one side) rather than listed."""
    now = {k: v for k, v in now.items() if k in saved or k not in _RECORDED_LATER}
    if dict(saved) == now:
        return None

    def shown(config: Mapping[str, Any]) -> dict:
        return {k: v for k, v in config.items() if k != "decayed"}

    text = "ColinearityDecay: resuming with a different CD config: "
    # settings shown only where they differ: a state dict of another model has the same ones twice
    differ = [f"saved {shown(saved)}, now {shown(now)}"] if shown(saved) != shown(now) else []
    old, new = list(saved.get("decayed", [])), list(now.get("decayed", []))
    if old != new:
        differ.append(f"decayed matrices: {len(old)} saved, {len(new)} now")
        only_now, only_saved = [n for n in new if n not in set(old)], [n for n in old if n not in set(new)]
        if only_now:
            differ[-1] += f" ({len(only_now)} only now, e.g. {only_now[0]})"
        if only_saved:
            differ[-1] += f" ({len(only_saved)} only saved, e.g. {only_saved[0]})"
    return text + "; ".join(differ)


# the keys `ColinearityDecay.state_dict` writes; `steps` only since it was kept (a state saved before has none), and
# `config` None in the HF callback's restore of a checkpoint of an earlier version (it saved no config)
_STATE_KEYS, _STATE_KEYS_LATER = ("num_updates", "config"), ("steps",)


def _check_state(state: Any) -> None:
    """Refuse a `state` that `ColinearityDecay.state_dict` did not write: a model's state_dict or another object's
    would otherwise load as 0 updates without a word, and a negative or non-integer counter be logged as given.

    Raises:
        TypeError: `state` is no mapping, a counter no integer, `config` no mapping (or None).
        ValueError: a key it writes is missing or one it does not write is there, a counter is negative.
    """
    what = "pass the mapping ColinearityDecay.state_dict() returned"
    if not isinstance(state, Mapping):
        raise TypeError(f"ColinearityDecay.load_state_dict: got {type(state).__name__}; {what}")
    unknown = [k for k in state if k not in _STATE_KEYS + _STATE_KEYS_LATER]
    missing = [k for k in _STATE_KEYS if k not in state]
    if unknown or missing:
        found = f"unknown key(s) {unknown[:3]}{' ...' if len(unknown) > 3 else ''}" if unknown else ""
        found += ("; " if unknown and missing else "") + (f"no key(s) {missing}" if missing else "")
        raise ValueError(f"ColinearityDecay.load_state_dict: {found} (it reads {list(_STATE_KEYS + _STATE_KEYS_LATER)}"
                         f"); {what}")
    for key in ("num_updates", "steps"):
        value = state.get(key, 0)
        # a bool is an int to Python, and a string such as '7' would be taken by int(): neither is a counter
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"ColinearityDecay.load_state_dict: {key} must be an integer, got {value!r}; {what}")
        if value < 0:
            raise ValueError(f"ColinearityDecay.load_state_dict: {key} must be >= 0, got {value}; {what}")
    if state["config"] is not None and not isinstance(state["config"], Mapping):
        raise TypeError(f"ColinearityDecay.load_state_dict: config must be a mapping, got "
                        f"{type(state['config']).__name__}; {what}")


class ColinearityDecay:
    """Colinearity Decay on the matrix pairs of a pre-norm vision Transformer.

    Args:
        model: the model (possibly DDP/torch.compile-wrapped); pairs are found once, here.
        lam: CD strength lambda_cd; the decoupled step of every pair is lr * lam (lr of W2's param group).
        lam_per_role: per-role override of `lam`, e.g. {'fc2': 0.02}; roles: qkv, proj, fc1, fc2, reduction.
        targets: which matrices are decayed (paper Table 5 ("which matrices receive CD")):
            'A' the W2 of composable pairs (qkv, fc1, reduction); 'B' the W2 of functional pairs (proj, fc2);
            'C' both matrices of functional pairs (also qkv V rows and fc1, see `cd.update`); 'A+B' (default).
        mode: 'decoupled' (the paper's update, via `attach`/`apply`) or 'loss' (ablation: a penalty from
            `aux_loss`; `apply` is refused then, and an attached optimizer's step checks that `aux_loss` was taken).
        loss_coef: loss mode only: coefficient of the penalty after aligning it to the task-loss magnitude.
        matmul_precision: of the update's products: 'fp32' (exact), 'tf32', 'bf16', or 'auto' (tf32 while
            the pairs are on CUDA, else fp32: resolved at each update, so a model moved by model.cuda() after CD is
            built gets tf32 there). The error of each against float64 is in cd/README.md. An explicit
            'tf32' with the decayed matrices off CUDA (which has no TF32: fp32 products) is refused at the first
            update, so that a model moved to a GPU after CD is built takes it (the integrations refuse it when
            they bind the framework's optimizers, the model on its device by then); so is 'tf32' with float64
            decayed matrices (TF32 leaves float64 products in float64; 'auto' and 'fp32' run them so).
        norms_every: compute the update norms (`metrics`) on every n-th update only (lr-0 ones counted); they
            cost a materialised delta per pair (and one more product per functional pair), so the trainer passes
            its log interval. The weights are the same (bitwise) whatever it is.
        example_input: a tensor of the model's input shape (a tuple of positional inputs, a dict of keyword
            inputs) for checking the pairs against a forward pass (see `find_pairs`); timm models need none.
        verify: check the pairs against that forward pass (`find_pairs`); False trusts the structure alone,
            for models whose forward cannot run on the `meta` device.
        gated_mlp: also pair gated MLPs (SwiGLU: norm2 -> W_gate, W_up; W_up -> W_down), beyond the
            paper (cd/README.md, "Gated MLPs"); off: a gated MLP is refused.
        layouts: the block layouts tried (`find_pairs`): default the built-in `cd.LAYOUTS`; a model with names of
            its own gives its own `cd.Layout`s (cd/README.md, "Blocks with names of your own").

    Raises:
        UnsupportedModelError (a ValueError): the model has no pair, or a block CD does not support
            (the message names the block and its type), or is wrapped by FSDP1.
        ValueError: mode='loss' on a model sharded by FSDP2 (the decoupled update is exact there, `cd.sharded`); a
            model whose parameters are on the meta device (`refuse_meta`: no values to update); a setting of the
            wrong type or out of range (`check_settings`), naming it.
        TypeError: `model` is no nn.Module (None, a state_dict, a list of blocks: `cd.wrappers.check_model`).
    """

    def __init__(
        self,
        model: nn.Module,
        lam: float = DEFAULT_LAM,
        lam_per_role: Optional[Mapping[str, float]] = None,
        targets: str = "A+B",
        mode: str = "decoupled",
        loss_coef: float = DEFAULT_LOSS_COEF,
        matmul_precision: str = DEFAULT_MATMUL_PRECISION,
        norms_every: int = 1,
        example_input: Optional[Tensor] = None,
        gated_mlp: bool = False,
        verify: bool = True,
        layouts: Sequence[Layout] = LAYOUTS,
    ) -> None:
        lam_per_role = check_settings(lam, lam_per_role, targets, mode, loss_coef, matmul_precision, norms_every,
                                      gated_mlp, verify)
        layouts = check_layouts(layouts)
        self.lam = float(lam)
        self.lam_per_role = {k: float(v) for k, v in lam_per_role.items()}
        self.targets = targets
        self.mode = mode
        self.loss_coef = float(loss_coef)
        self.norms_every = int(norms_every)
        self.gated_mlp = gated_mlp
        self.layouts = layouts

        # diagnostics cover every pair
        check_model(model, "ColinearityDecay")  # before register_shards walks it
        register_shards(model)  # FSDP2: the pairs are found on the shards, also after a forward
        self.all_pairs: list[Pair] = find_pairs(model, example_input, verify=verify, gated_mlp=gated_mlp,
                                                layouts=layouts)
        refuse_meta(self.all_pairs, "ColinearityDecay")
        kinds = {"A": ("composable",), "B": ("functional",), "C": ("functional",),
                 "A+B": ("composable", "functional")}[targets]
        self.pairs: list[Pair] = [p for p in self.all_pairs if p.kind in kinds]
        if not self.pairs:
            raise ValueError(f"cd targets {targets!r} select no pair in this model")
        unused = sorted(set(self.lam_per_role) - {p.role for p in self.pairs})
        if unused:  # a strength that would change nothing: refused, not silently ignored
            roles = sorted({p.role for p in self.pairs}, key=ROLES.index)
            raise ValueError(f"cd lam_per_role: {unused} decay(s) no matrix of this model with targets "
                             f"{targets!r}, which decay the roles {roles}; drop it or change the targets")
        if (mode == "decoupled" and matmul_precision != DEFAULT_MATMUL_PRECISION
                and all(p.diagonal for p in self.pairs)):
            # a composable pair's update is a column scaling by g^2 / mean(g^2), computed in fp32 (`cd.update`):
            # no product that the setting could make in another precision
            raise ValueError(f"cd matmul_precision={matmul_precision!r} sets the precision of the functional pairs' "
                             f"products; targets {targets!r} decay only composable pairs, whose update is a column "
                             f"scaling (no product): drop matmul_precision, or use targets that decay functional "
                             f"pairs ('B', 'C', 'A+B')")
        self._lams = [self.lam_per_role.get(p.role, self.lam) for p in self.pairs]
        # Target C: the upstream matrix of every (functional) pair is decayed with the pair's strength.
        self._upstream = targets == "C"
        self._up_lams = [lam if self._upstream else 0.0 for lam in self._lams]
        self._active = any(v != 0 for v in self._lams)
        self._plan = build_plan(self.pairs, [u != 0 for u in self._up_lams])
        # an explicit tf32 is checked against the matrices' device at the first update, not here: the model may be
        # moved to a GPU (model.cuda()) after CD is built
        self._tf32_to_check = matmul_precision == "tf32"
        # 'auto' likewise is resolved at each update (`matmul_precision`), not here: fixed at construction it kept a
        # CPU-built CD's fp32 products after model.cuda()
        self._precision_setting = matmul_precision
        self._all_plan = build_plan(self.all_pairs)
        self._plan_key = plan_key(self.all_pairs)  # the devices and dtypes the plans were made for (`_current_plans`)
        self._block_types = block_types(unwrap_model(model), self.all_pairs)  # a pair split later: `_current_plans`
        # FSDP2 (fully_shard): the pairs' matrices are DTensor shards, updated block by block whole (`cd.sharded`)
        self._sharded = any_sharded(self.all_pairs)
        self._block_plans = block_plans(self.pairs, [u != 0 for u in self._up_lams]) if self._sharded else None
        self._all_block_plans = block_plans(self.all_pairs) if self._sharded else None
        if self._sharded and mode == "loss":
            raise ValueError("cd mode 'loss' with a model sharded by FSDP2 (fully_shard) is not supported: its "
                             "penalty's gradient to sharded matrices is not checked against an unsharded run; "
                             "use mode='decoupled' (the paper's update, exact under FSDP2) or DDP")

        self._model = weakref.ref(unwrap_model(model))  # to tell a replaced parameter from a missing one
        self._handle: Optional[RemovableHandle] = None  # the live optimizer hook, if attached
        # optimizer steps on which CD ran (logging only); this includes the steps skipped on the device (a fused
        # optimizer's that GradScaler skipped, a tensor lr of 0), which metrics()['cd/updates'] and state_dict()
        # subtract
        self.num_updates = 0
        # optimizer updates this object was called for, one with lr 0 (a warmup from 0) or without a gradient to a
        # decayed matrix too: the update number that `norms_every` counts, so that the norms fall on the caller's
        # log steps (counted among the updates CD ran, a warmup's lr-0 first step put them one update late)
        self._steps = 0
        self._round_live = False  # whether a part of the update begun last (`_begin_update`) has run
        # steps skipped on the device (a fused step's gate, a tensor lr of 0), counted lazily
        self._gated_skips: Optional[Tensor] = None
        self._round_skip: Optional[Tensor] = None  # whether the last counted update was skipped so far
        self._last_update_norms: dict[str, Tensor] = {}
        # key -> 0-dim flag of a norm in `_last_update_norms` that only the device knows to be of an update that ran
        # (a skipped fused step's, a tensor lr of 0's, and none ran before: 0), read by `metrics` (`_seen_flags`)
        self._norms_seen: dict[str, Tensor] = {}
        self._last_penalty: Optional[Tensor] = None
        # loss mode: whether aux_loss was taken (with gradients on) since the attached optimizer's last step (`attach`)
        self._aux_taken = False
        # id(optimizer) -> (param-group signature, id(param) -> group index): one entry per optimizer, since several
        # (cd.integrations' bindings) step the same object in turn
        self._gi_cache: dict[int, tuple] = {}
        self._warned_dtype = False  # `_warn_low_precision_weights` said it once

    # ----------------------------------------------------------------------------------- construction
    @classmethod
    def from_config(cls, cfg_cd: Any, model: nn.Module, norms_every: int = 1) -> "ColinearityDecay":
        """Build from a `CDConfig` (lam, lam_per_role, targets, mode, loss_coef, matmul_precision, gated_mlp).
        `enabled` and `budget` are the trainer's switches (see `budget_weight_decay`); `budget` is read here only
        to tell whether anything reads cd.lam: a cd.lam other than its default that neither the budget rule nor a
        pair reads (cd.lam_per_role gives every decayed role its own strength) is refused, naming it."""
        decay = cls(model, lam=cfg_cd.lam, lam_per_role=cfg_cd.lam_per_role, targets=cfg_cd.targets,
                    mode=cfg_cd.mode, loss_coef=cfg_cd.loss_coef, matmul_precision=cfg_cd.matmul_precision,
                    norms_every=norms_every, gated_mlp=cfg_cd.gated_mlp)
        if not cfg_cd.budget and not decay.reads_lam and cfg_cd.lam != DEFAULT_LAM:
            # the config path alone: a library caller may pass its lam on to budget_weight_decay itself
            roles = sorted({p.role for p in decay.pairs}, key=ROLES.index)
            raise ValueError(f"cd.lam={cfg_cd.lam} would be ignored: cd.lam_per_role gives every role this model's "
                             f"CD decays ({', '.join(roles)}) its own strength, and with cd.budget=false the weight "
                             f"decay does not read it either; drop cd.lam (or give it its default {DEFAULT_LAM}), or "
                             f"drop a role's cd.lam_per_role entry to give that role cd.lam")
        return decay

    @property
    def reads_lam(self) -> bool:
        """Whether `lam` acts on the run: some decayed pair's role has no `lam_per_role` entry and falls back to it.
        In loss mode too: there the strengths weigh the penalty relative to `lam`, and a factor common to every
        weight cancels in its alignment to the task loss."""
        return any(p.role not in self.lam_per_role for p in self.pairs)

    # ----------------------------------------------------------------------------------- decoupled update
    def apply(self, lr: Union[float, Tensor]) -> None:
        """One decoupled CD update of every target with step lr * lam (lam_per_role overrides per role).

        Uses one lr for all pairs; `attach` instead reads each param group's lr. No-op
        when every strength is 0 (bit-identical, no work) or when lr == 0: no work, not counted in cd/updates,
        and the update norms stay those of the last update. Frozen matrices (requires_grad=False) are left alone,
        as an optimizer leaves them. `lr` is a real number (numpy's too) or a 0-dim tensor. A CPU tensor's value
        is checked as a number's (reading it costs nothing); an accelerator's is not, since reading it would wait
        for the device at every step. A tensor lr of 0 is a no-op too, but known on the device only: the update
        runs, writes zero deltas, and is taken out of cd/updates and the update norms there, as a fused
        optimizer's step that GradScaler skips.

        Raises:
            RuntimeError: the object is attached to an optimizer (`attach`, a `cd.integrations` binding), whose
                steps apply the update already; mode='loss', whose CD is the penalty `aux_loss` gives.
            ValueError: lr is negative, NaN or inf (a number, or a tensor on the CPU), or a bool, or a tensor on
                the meta device (no value), or the model's
                parameters were replaced after this object found its pairs (the update would write tensors the
                model no longer uses), or matmul_precision='tf32' was given and a decayed matrix is not on CUDA, or
                is float64, at the first update.
        """
        if isinstance(lr, Tensor):
            if lr.dim() != 0 or not lr.is_floating_point():
                raise ValueError(f"ColinearityDecay.apply: a tensor lr must be a 0-dim float tensor, got "
                                 f"shape {tuple(lr.shape)} {lr.dtype}")
            if lr.is_meta:  # no value: torch's bare NotImplementedError from inside the update otherwise
                raise ValueError("ColinearityDecay.apply: lr is a tensor on the meta device, which has no value to "
                                 "step by; pass the lr as a number or a tensor on the CPU or the model's device")
            # a CPU tensor's value is on the host already: a negative one would grow the energy and a NaN one would
            # make every decayed weight NaN, as a number's would; an accelerator's is left unread (a host sync)
            if lr.device.type == "cpu" and not _finite_nonnegative(lr.item()):
                raise ValueError(f"ColinearityDecay.apply: lr must be a finite number >= 0, got {lr!r}")
        elif not _finite_nonnegative(lr):  # a bool too: apply(True) would be a step with lr 1.0
            raise ValueError(f"ColinearityDecay.apply: lr must be a finite number >= 0, got {lr!r}")
        if self.mode == "loss":  # a no-op here once trained the loss form without its penalty, and without a word
            raise RuntimeError("ColinearityDecay.apply is for mode='decoupled'; mode='loss' acts through "
                               "aux_loss(task_loss), the term to add to the loss before backward()")
        if not self._active:
            return
        # its `attach`, or a cd.integrations binding (a callback's, a hook's), whose steps make the update
        if any(owner._hooked_decay(opt) is self for opt, owners in list(_HOOKED.items()) for owner in list(owners)):
            raise RuntimeError("ColinearityDecay.apply: this object is attached to an optimizer (by attach() or a "
                               "cd.integrations callback), whose step() applies the update already; calling apply() "
                               "too would decay twice per step. Use one of them (handle.remove() detaches)")
        self._refuse_matrices_decayed_by_a_step()
        self._check_parameters_current()
        self._begin_update()
        lr2 = [lr if p.downstream.requires_grad else 0.0 for p in self.pairs]
        lr1 = [lr if p.upstream.requires_grad else 0.0 for p in self.pairs]
        self._apply(lr2, lr1, gate=None)

    def _decayed_in_steps(self) -> list[tuple["ColinearityDecay", str]]:
        """(other object, the first of this object's matrices it decays) for every other object (attached, or a
        cd.integrations binding) whose optimizer's step decays one of them, held by that optimizer (rule 1: one
        outside it, which another optimizer updates, is this object's alone). Free when nothing is attached."""
        others = [(opt, decay) for opt, owners in list(_HOOKED.items()) for owner in list(owners)
                  for decay in [owner._hooked_decay(opt)] if decay is not None and decay is not self]
        if not others:
            return []
        mine = {id(t): name for name, t in self._decayed_named()}
        found = []
        for opt, other in others:
            held = {id(t) for group in opt.param_groups for t in group["params"]}
            shared = [mine[id(t)] for t in other._decayed() if id(t) in mine and id(t) in held]
            if shared:
                found.append((other, shared[0]))
        return found

    def _refuse_matrices_decayed_by_a_step(self) -> None:
        """Refuse `apply` on a matrix that another object (attached, or a cd.integrations binding) decays in an
        optimizer's step already: each step would decay it twice."""
        for other, shared in self._decayed_in_steps():
            if other.mode == "loss":  # its CD is its penalty, not an update in the step
                raise RuntimeError(f"ColinearityDecay.apply: another CD object (mode='loss') attached to an optimizer "
                                   f"decays {shared} by its aux_loss penalty; apply() would decay it a second "
                                   "time, by the decoupled update. Use one per model: the other's handle.remove() "
                                   "frees them")
            raise RuntimeError(f"ColinearityDecay.apply: another CD object decays {shared} in an optimizer's step "
                               "already (its attach() or a cd.integrations callback); apply() too would decay it "
                               "twice per step. Use one per model: the other's handle.remove(), or the end of the "
                               "framework run whose callback or hook holds it, frees them")

    @property
    def matmul_precision(self) -> str:
        """The precision of the update's products now: the setting as given, 'auto' resolved from the device of the
        decayed matrices as they are at this call (`resolve_precision`: tf32 on CUDA, fp32 elsewhere), so that a model
        moved to a GPU after CD is built gets tf32 there. A model split between the CPU and CUDA gets tf32 (the first
        block offloaded to the CPU made it fp32 on the GPU): the switch is cuBLAS's, the CPU's products stay fp32."""
        devices = [p.downstream.device for p in self.pairs]
        return resolve_precision(self._precision_setting, next((d for d in devices if d.type == "cuda"), devices[0]))

    def _apply(self, lr2: list, lr1: list, gate: Optional[Tensor],
               reads: Optional[Mapping[int, Tensor]] = None) -> bool:
        """The update with these per-pair lrs, within the update begun last (`_begin_update`); returns whether it
        ran (not when every step is a Python zero). `reads`: id(matrix) -> the value to read it as (a matrix another
        optimizer stepped since this update's weights; this update writes none of them). The first part that runs
        is counted in cd/updates; a later one (another optimizer's) joins its update norms."""
        lrs, lams = lr2 + lr1, self._lams + self._up_lams
        live = [lr for lr, lam in zip(lrs, lams) if lam != 0 and not known_zero(lr)]
        if not live:  # apply(0), a warmup from lr 0: no update, not counted, the last update's norms stand
            return False
        count = not self._round_live
        if self._tf32_to_check:
            self._refuse_tf32_off_cuda()
        # here, where every update runs (apply, a step): the weights' dtype may change after attach (model.half())
        self._warn_low_precision_weights()
        # a zero strength gives a Python 0.0 whatever the lr's type: the update skips only Python zeros
        # (`known_zero`), and a tensor 0 would compute and write target C's term without target C
        steps = [lr * lam if lam != 0 else 0.0 for lr, lam in zip(lr2, self._lams)]
        up_steps = [lr * lam if lam != 0 else 0.0 for lr, lam in zip(lr1, self._up_lams)]
        ran = _ran_on_device(live, gate)
        pairs = self.pairs
        if reads:
            pairs = [dataclasses.replace(p, upstream=reads.get(id(p.upstream), p.upstream),
                                         downstream=reads.get(id(p.downstream), p.downstream)) for p in pairs]
        norms = self._steps % self.norms_every == 0  # the optimizer's update number, lr-0 updates included
        precision = self.matmul_precision  # 'auto' from where the matrices are at this update
        self._current_plans()
        if self._sharded:
            result = sharded_colinearity_decay_(pairs, steps, up_steps, self._block_plans, gate=gate,
                                                precision=precision, norms=norms)
        else:
            result = colinearity_decay_(pairs, steps, up_steps, gate=gate, plan=self._plan, precision=precision,
                                        norms=norms)
        if norms:
            # a norm of an update the device skipped is no update's: before any that ran, it stays out of
            # `metrics` by its flag (`_seen_flags`) rather than showing as 0.0, without a sync here
            last, seen = self._last_update_norms, self._norms_seen
            flags = _seen_flags(ran, result, last, seen)
        if norms and count:
            if ran is not None:  # an update the device skipped keeps the last one's norms (`_kept_unless`)
                result = {k: _kept_unless(ran, v, last[k]) if k in last else v for k, v in result.items()}
            self._last_update_norms = result
            self._norms_seen = flags
        elif norms:  # one role's update over several optimizers: the root of the summed squares (a part the
            # device skipped adds a zero norm, which keeps `last`)
            self._last_update_norms = {**last, **{k: v if k not in last else torch.hypot(last[k], v)
                                                  for k, v in result.items()}}
            self._norms_seen = {**{k: f for k, f in seen.items() if k not in result}, **flags}
        self.num_updates += int(count)
        self._count_gated(ran, count)
        self._round_live = True
        return True

    def _current_plans(self) -> None:
        """Build the cached batching plans again when the pairs' matrices changed device or dtype since they were made
        (`plan_key`): the plans group pairs by device, and blocks moved to another GPU after this object was built
        (model.blocks[6:].to("cuda:1")) left a group over two devices, which failed inside torch.stack. A whole
        model moved (model.cuda()) is grouped as before. FSDP2's block plans stay (its shards do not move).

        Raises:
            UnsupportedModelError: a pair's two matrices are on different devices now (part of a block moved), as
                construction refuses it (`refuse_split_devices`): torch.mm failed on them, naming neither.
        """
        if self._sharded:
            return
        key = plan_key(self.all_pairs)
        if key != self._plan_key:
            refuse_split_devices(self.all_pairs, self._block_types)
            self._plan = build_plan(self.pairs, [u != 0 for u in self._up_lams])
            self._all_plan = build_plan(self.all_pairs)
            self._plan_key = key

    def _begin_update(self) -> None:
        """A new optimizer update (`apply`, a step of the attached optimizer, the first part of a `cd.integrations`
        update over several optimizers), whatever its lr: the number the update norms' `norms_every` counts."""
        self._steps += 1
        self._round_live = False

    def _refuse_tf32_off_cuda(self) -> None:
        """Refuse an explicit matmul_precision='tf32' at the first update when a decayed matrix is not on CUDA: its
        products would run in fp32 (CPUs have no TF32) while the setting says tf32 (`check_tf32_device`), or one is
        float64, whose products TF32 leaves in float64 (`check_tf32_dtype`)."""
        check_tf32_dtype("tf32", self._decayed_named(), "ColinearityDecay: matmul_precision")
        for t in self._decayed():
            check_tf32_device("tf32", t.device.type, "ColinearityDecay: matmul_precision", "the decayed matrices are",
                              "pass matmul_precision='fp32', or 'auto' (tf32 on CUDA, fp32 elsewhere), or move the "
                              "model to a GPU (model.cuda()) before its first update")
        self._tf32_to_check = False

    def attach(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Register the update as a step pre-hook of `optimizer` and return its removable handle.

        The hook runs inside `optimizer.step()`, i.e. once per optimizer update (after clipping, before
        the AdamW step), and only when the step really runs: GradScaler skips `optimizer.step()` on
        inf/NaN gradients for non-fused optimizers. Fused optimizers (`fused=True`) are stepped even on
        overflow; there the update is multiplied on device by (found_inf == 0), which GradScaler attaches
        to the optimizer, so a skipped step leaves the weights bit-identical without a host sync.
        Each pair uses the current `lr` of the param group holding its decayed matrix (schedulers,
        warmup and layer-wise lr decay are respected). A step given a closure (`optimizer.step(closure)`,
        whose backward runs inside the step) gets the update right after the closure's first call, when
        the gradient exists and before the optimizer reads the weights. A framework's wrapper (accelerate's
        `AcceleratedOptimizer`, Lightning's `LightningOptimizer`) is looked through to the torch optimizer.

        CD changes exactly the matrices the optimizer changes: a decayed matrix that is not in `optimizer`,
        or has no gradient at this step (requires_grad=False, a frozen block), is left alone, as torch's
        optimizers leave such parameters; and at most once per real step: one object attaches to one
        optimizer at a time, and two objects (or an object and a `cd.integrations` callback) may not decay
        one matrix through the same optimizer. A step in which no decayed matrix has a gradient, or whose lrs are
        0 (a warmup from 0), is not counted in `cd/updates` and leaves the update norms as they were (a tensor lr
        of 0 as `apply` says).

        In mode='loss' CD is the penalty `aux_loss` gives, and the hook makes no update: it refuses a step of
        `optimizer` (before the step changes anything) when no `aux_loss` was taken with gradients on since its last
        step (or this attach), which would train without CD (unless every strength is 0).

        Raises:
            TypeError: `optimizer` is not (and does not wrap) a torch.optim.Optimizer.
            RuntimeError: `optimizer` is DeepSpeed's (accelerate's DeepSpeedOptimizerWrapper or DummyOptim, a
                ZeRO optimizer) or the model's parameters are ZeRO-3's (`cd.wrappers.refuse_deepspeed`), this object
                is attached already, or another CD update in `optimizer`'s step
                decays one of these matrices (the update would run twice per step), or `optimizer` (or its wrapper)
                keeps a `step` of the torch optimizer that calls no step hooks (`cd.wrappers.steps_without_hooks`),
                or steps the weights inside the backward (ZeroRedundancyOptimizer(overlap_with_ddp=True), LOMO:
                `cd.wrappers.refuse_backward_steps`);
                at a step, when the optimizer no longer holds any of the decayed matrices it held here (DeepSpeed
                replaced them by flat copies at `prepare`), or in mode='loss' when no `aux_loss` was taken since
                the last step.
            ValueError: no decayed matrix is in `optimizer` and some are trainable (CD would never act), naming
                the matrices (all of them frozen is a warning: a stage added with add_param_group once unfrozen), the
                model's parameters were replaced after this object found its pairs, or a param group holding a
                decayed matrix has no lr to follow (None; Adafactor's relative_step=True).
        """
        # before the torch optimizer is looked for: accelerate's DummyOptim holds none, and under ZeRO the one it
        # finds holds flat partitions of the weights ("not in the optimizer", a misleading fix)
        refuse_deepspeed("ColinearityDecay.attach", "train without DeepSpeed (drop accelerate's DeepSpeed plugin or "
                         "config): DDP, or FSDP2 (fully_shard) with verify=False", (optimizer,), self._model())
        given, optimizer = optimizer, torch_optimizer(optimizer)
        unhooked = steps_without_hooks(given)
        if unhooked:  # its steps would silently run without CD
            raise RuntimeError(f"ColinearityDecay.attach: {unhooked_step_text(unhooked[0], optimizer)}), and the "
                               f"steps taken through it would run without CD (accelerate "
                               f"keeps it from prepare on with a GradScaler, i.e. fp16; an lr scheduler or "
                               f"torch.compile from when it wraps it). Attach before wrapping the optimizer (before "
                               f"accelerator.prepare or building an lr scheduler on it), or call its zero_grad() once "
                               f"before that")
        attached = self._attached()
        if attached is not None:
            same = "this optimizer" if attached is optimizer else "another optimizer"
            raise RuntimeError(f"ColinearityDecay.attach: this object is attached to {same} already; a second "
                               f"hook would apply the update twice per step. Call remove() on the handle of "
                               f"the first attach() before attaching again")
        self._check_parameters_current()
        index = self._group_index(optimizer)  # validate now, not at the first step
        decayed = self._decayed_named()
        outside = [name for name, t in decayed if id(t) not in index]
        if len(outside) == len(decayed):
            self._refuse_none_held(decayed)
        register_step_update(self, self, optimizer, "ColinearityDecay.attach")
        self._warn_if_all_frozen(index, "ColinearityDecay.attach")
        if outside and len(outside) < len(decayed):  # all of them outside: said by _refuse_none_held
            warnings.warn(f"ColinearityDecay.attach: {len(outside)} decayed matrices are not in the optimizer "
                          f"(e.g. {outside[:3]}); the optimizer never changes them, so CD leaves them alone too",
                          stacklevel=2)

        held_some = len(outside) < len(decayed)
        self._aux_taken = False  # loss mode: a penalty taken before this attach is no step's of this optimizer

        def update(opt: torch.optim.Optimizer, kwargs: dict) -> None:
            if self.mode == "loss":
                self._refuse_step_without_aux_loss(opt)
            elif not self._pre_step(opt, kwargs) and held_some:  # (the index is cached: nothing more per step)
                self._refuse_all_taken_out(opt)

        def hook(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Optional[tuple]:
            if in_outer_step(opt):  # the outer step's hook has made (or will make, in its closure) the update
                return None
            replaced = closure_then(args, kwargs, lambda: update(opt, kwargs))
            if replaced is None:  # no closure: the gradient exists now
                update(opt, kwargs)
            return replaced

        self._handle = optimizer.register_step_pre_hook(hook)
        self._handle_optimizer = weakref.ref(optimizer)
        return self._handle

    def _refuse_step_without_aux_loss(self, optimizer: torch.optim.Optimizer) -> None:
        """Loss mode: refuse a step of the attached `optimizer` when no `aux_loss` was taken with gradients on since
        its last step (or attach): the hook makes no update in this mode, and such a step trained without CD and
        without a word. A step that GradScaler skips (no step() call) keeps what was taken for the next."""
        taken, self._aux_taken = self._aux_taken, False
        if self._active and not taken:
            raise RuntimeError(f"ColinearityDecay.attach: the attached {type(optimizer).__name__} steps, but no "
                               "aux_loss(task_loss) was taken since its last step; in mode='loss' CD is that "
                               "term, added to the loss before backward() (the hook makes no update), so this step "
                               "would train without CD. Add decay.aux_loss(loss) to the loss of each step, or use "
                               "mode='decoupled'")

    def _refuse_all_taken_out(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse a step of the attached `optimizer` whose param groups no longer hold any of the decayed matrices
        that some of them held at attach: their parameters were replaced since, as DeepSpeed does at
        `accelerator.prepare` / `deepspeed.initialize` of an optimizer attached before it (ZeRO and its fp16 / bf16
        optimizers step flat copies of the weights), where every step went on without CD and without a word."""
        index = self._group_index(optimizer)
        if self._active and not any(id(t) in index for t in self._decayed()):
            raise RuntimeError(f"ColinearityDecay.attach: the attached {type(optimizer).__name__} no longer holds "
                               "any of the decayed matrices it held at attach (its param groups' parameters were "
                               "replaced, as DeepSpeed's ZeRO and fp16/bf16 optimizers replace them by flat copies at "
                               "accelerator.prepare or deepspeed.initialize; CD does not support DeepSpeed), so its "
                               "steps would run without CD; train without DeepSpeed, or call remove() on attach's "
                               "handle if the matrices left the optimizer on purpose")

    def _hooked_decay(self, optimizer: torch.optim.Optimizer) -> Optional["ColinearityDecay"]:
        """This object, while its update runs in `optimizer`'s step (`register_step_update`)."""
        return self if self._attached() is optimizer else None

    def _attached(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer whose step pre-hook this object still is (None if never attached or removed)."""
        if self._handle is None:
            return None
        hooks = self._handle.hooks_dict_ref()
        optimizer = self._handle_optimizer()
        if hooks is None or self._handle.id not in hooks or optimizer is None:
            self._handle = None
            return None
        return optimizer

    def _decayed_named(self) -> list[tuple[str, Tensor]]:
        """(name, tensor) of every matrix this object writes: the W2 of its pairs (and W1 for target C)."""
        named = [(p.name, p.downstream) for p in self.pairs]
        if self._upstream:
            named += [(p.upstream_name, p.upstream) for p in self.pairs]
        return named

    def _decayed(self) -> list[Tensor]:
        return [t for _, t in self._decayed_named()]

    @staticmethod
    def _refuse_none_held(decayed: list[tuple[str, Tensor]]) -> None:
        """An optimizer that holds none of the decayed matrices (`decayed`: name, tensor): CD would never act, an
        error while some of them are trainable. All of them frozen (a stage left out of the optimizer, to be added
        with add_param_group when it is unfrozen, as Lightning's BaseFinetuning does) is a warning, as in
        `cd.integrations.bind_optimizers`: the hook reads the param groups at each step, so CD follows them.

        Raises:
            ValueError: naming the matrices and the fix.
        """
        if any(t.requires_grad for _, t in decayed):
            raise ValueError(f"ColinearityDecay.attach: none of the {len(decayed)} decayed matrices is in the "
                             f"optimizer (not in the optimizer: e.g. {[n for n, _ in decayed[:3]]}), so CD would "
                             f"never act; give the optimizer the model's parameters")
        warnings.warn(f"ColinearityDecay.attach: all {len(decayed)} decayed matrices are frozen (requires_grad=False, "
                      f"e.g. {decayed[0][0]}) and not in the optimizer: CD acts on each once it is unfrozen into "
                      f"the optimizer (add_param_group)", stacklevel=3)

    def _warn_if_all_frozen(self, held: Mapping[int, Any], who: str) -> None:
        """Warn when every decayed matrix in the optimizer is frozen (requires_grad=False): CD changes only what
        the optimizer changes, so it would act on none of them (until they are unfrozen: not an error)."""
        inside = [(name, t) for name, t in self._decayed_named() if id(t) in held]
        if inside and not any(t.requires_grad for _, t in inside):
            warnings.warn(f"{who}: all {len(inside)} decayed matrices in the optimizer are frozen "
                          f"(requires_grad=False, e.g. {inside[0][0]}): CD acts on none of them until they are "
                          f"unfrozen", stacklevel=3)

    def _check_parameters_current(self) -> None:
        """Refuse when the model's parameters are no longer the tensors the pairs hold (the update would
        write tensors the model does not use): e.g. load_state_dict(assign=True) or to_empty() since. FSDP2 units
        holding their whole parameters (after an evaluation forward) are resharded first, as at construction."""
        model, named = self._model(), self._decayed_named()
        if (self._sharded and model is not None  # (unsharded pairs: no FSDP2 unit to reshard, no walk per step)
                and any(_gathered_by_fsdp2(t, _parameter_at(model, name)) for name, t in named)):
            # FSDP2 holds whole parameters after a forward without a backward (an evaluation): an all-gather of
            # the shards, never written back to them, so registering the shards again now (as FSDP2's own reshard
            # after the next backward would) loses nothing, and the next forward gathers the updated shards
            register_shards(model)
        check_parameters_current(model, named, "ColinearityDecay")

    def apply_for(self, optimizer: torch.optim.Optimizer, step_kwargs: Optional[dict] = None,
                  reads: Optional[Mapping[int, Tensor]] = None, count: bool = True) -> bool:
        """The update that `attach`'s hook makes, for code that owns the moment of the step (`cd.integrations`):
        each pair with the current lr of its param group in `optimizer`, gated on the device by a fused
        optimizer's `found_inf`. Call it once per real update, right before `optimizer` reads the weights.
        Several optimizers over the decayed matrices make one update together: `reads` gives the matrices that
        another of them stepped already (id -> their value before), and `count=False` says that this is
        another optimizer's part of the update begun already, by an earlier call whether it ran or not (see
        `_apply`; an update is counted toward `norms_every` once, and in cd/updates once if a part ran).

        Returns:
            whether the update ran (not when no decayed matrix has a gradient, or every lr is a Python 0).
        """
        return self._pre_step(optimizer, step_kwargs or {}, reads, count)

    def _group_index(self, optimizer: torch.optim.Optimizer) -> dict[int, int]:
        """id(param) -> index of its param group; cached until the groups change. The key is which parameter
        sits in which group, not the groups' lengths alone: params exchanged between groups, or a new optimizer of
        the same shape at a freed one's id, would otherwise read the old index (another group's lr). Building it
        costs one id per parameter tensor on each step (10 us for a ViT-B's 152 on a 2-core AMD EPYC VM)."""
        sig = tuple(tuple(map(id, g["params"])) for g in optimizer.param_groups)  # the cache is per optimizer id
        cached = self._gi_cache.get(id(optimizer))
        if cached is not None and cached[0] == sig:
            return cached[1]
        index = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._check_group_lrs(optimizer, index)
        if len(self._gi_cache) >= 16:  # optimizers made again and again (a fit() per stage): forget the old ones
            self._gi_cache.clear()
        self._gi_cache[id(optimizer)] = (sig, index)
        return index

    def _warn_low_precision_weights(self) -> None:
        """Warn (once per object) when decayed matrices are stored in bf16 / fp16 ("bf16-true" training, a model
        loaded in half precision): CD's step changes a weight by about lr * lam of itself (5e-6 at lr 1e-3 and
        the paper's lam 0.005), far below bf16's resolution (2^-8) and fp16's (2^-11), so it rounds away,
        as decoupled weight decay does there. Mixed precision keeps fp32 weights and is not affected."""
        if self._warned_dtype or not self._active or self.mode != "decoupled":
            return
        low = sorted({str(p.downstream.dtype) for p in self.pairs} & {"torch.bfloat16", "torch.float16"})
        if low:
            self._warned_dtype = True
            warnings.warn(f"ColinearityDecay: decayed matrices are stored in {', '.join(low)}; CD's per-step change "
                          f"(about lr * lam of each weight) is below that format's resolution and mostly rounds "
                          f"away, as decoupled weight decay does. Keep fp32 weights (mixed precision: AMP, "
                          f"Lightning's 'bf16-mixed') for CD to act.", stacklevel=4)

    def _check_group_lrs(self, optimizer: torch.optim.Optimizer, index: dict[int, int]) -> None:
        """Refuse a param group holding a decayed matrix whose `lr` is not the step size: CD's step is
        lr * lam, and `lr * lam` with None would fail mid-step, while Adafactor's relative step keeps in
        `lr` a proxy that AdafactorSchedule writes (0 at first, then another parameter's scaled step).

        Raises:
            ValueError: naming the group, the matrix, its lr and what to do.
        """
        for name, t in self._decayed_named():
            if id(t) not in index:
                continue
            gi = index[id(t)]
            group = optimizer.param_groups[gi]
            lr = group.get("lr")
            number = isinstance(lr, numbers.Real) and not isinstance(lr, bool)
            tensor = isinstance(lr, Tensor) and lr.dim() == 0 and lr.is_floating_point()
            if group.get("relative_step") or not (number or tensor):
                own = " and relative_step=True" if group.get("relative_step") else ""
                raise ValueError(f"ColinearityDecay: param group {gi} of {type(optimizer).__name__} holds {name} "
                                 f"with lr {lr!r}{own}; CD's step is lr * lam with that group's lr, and an "
                                 f"optimizer that sets its own step size has none to follow. Give it an lr "
                                 f"(e.g. Adafactor(lr=1e-3, relative_step=False)), or call "
                                 f"ColinearityDecay.apply(lr) in your own loop")

    def _pre_step(self, optimizer: torch.optim.Optimizer, kwargs: dict,
                  reads: Optional[Mapping[int, Tensor]] = None, count: bool = True) -> bool:
        if self.mode != "decoupled" or not self._active:
            return False
        if "grad_scaler" in kwargs:
            raise RuntimeError("ColinearityDecay: the optimizer receives `grad_scaler` in step() (legacy "
                               "custom AMP contract); CD cannot tell whether this step will be skipped")
        self._check_parameters_current()
        index = self._group_index(optimizer)
        if count:  # an update of the optimizer's, with a gradient to a decayed matrix or not (`norms_every`)
            self._begin_update()
        # the optimizer leaves them all alone: so does CD (a decayed matrix it does not hold, e.g. another
        # optimizer's that accumulates, does not make this step an update)
        if all(t.grad is None or id(t) not in index for t in self._decayed()):
            return False
        groups = optimizer.param_groups

        def lr(t: Tensor):  # the optimizer changes only its parameters that have a gradient (torch.optim)
            return groups[index[id(t)]]["lr"] if t.grad is not None and id(t) in index else 0.0

        lr2 = [lr(p.downstream) for p in self.pairs]
        lr1 = [lr(p.upstream) for p in self.pairs] if self._upstream else lr2
        # Fused optimizers + GradScaler: step() runs even on overflow; GradScaler exposes the verdict as
        # `optimizer.found_inf` (a device tensor) for the duration of step().
        found_inf = getattr(optimizer, "found_inf", None)
        gate = (found_inf == 0) if isinstance(found_inf, Tensor) else None
        with torch.no_grad():  # step pre-hooks run outside the optimizer's own no_grad
            return self._apply(lr2, lr1, gate, reads)

    def _count_gated(self, ran: Optional[Tensor], count: bool) -> None:
        """Keep `cd/updates` to the updates that ran: a counted part that the device skipped (`_ran_on_device`) is
        subtracted, unless another optimizer's part of the same update (`count=False`) ran: a step of its own
        (`ran` None: a skipped non-fused step never reaches here) or one the device lets through. Lazy: no sync."""
        skip = None if ran is None else (~ran).to(torch.int64).reshape(())
        if skip is not None and self._gated_skips is not None:  # one device for the sums: a scaler per optimizer
            skip = skip.to(self._gated_skips.device)              # may put their gates on different ones
        if count:
            self._round_skip = skip
            if skip is not None:
                self._gated_skips = skip if self._gated_skips is None else self._gated_skips + skip
        elif self._round_skip is not None:  # skipped so far: skipped still only if this part is skipped too
            still = None if skip is None else self._round_skip * skip
            self._gated_skips = self._gated_skips - self._round_skip + (0 if still is None else still)
            self._round_skip = still

    # ----------------------------------------------------------------------------------- loss-form ablation
    def aux_loss(self, task_loss: Tensor) -> Tensor:
        """Loss mode: the stabilized CD penalty to add to the task loss (paper Table 4b ("update form")).

        penalty = sum_pairs lam_role/lam-weighted ||W2 W1n||_F^2 (fp32, gradients to the decayed matrices
        only); returned term = loss_coef * penalty * (task_loss / penalty).detach(), whose value is
        loss_coef * task_loss: the penalty is aligned to the task-loss magnitude, then scaled down. The sum is over
        the pairs with a decayed matrix that trains (requires_grad, read at each call): a frozen pair is left out,
        as `apply` leaves it alone.

        Args:
            task_loss: 0-dim task loss of this (micro-)batch.

        Returns:
            0-dim fp32 tensor to add to `task_loss` (zero if every strength is 0).

        Raises:
            RuntimeError: mode='decoupled'; with gradients on, another object's decoupled update in an optimizer's
                step (its attach, a cd.integrations binding) decays one of these matrices (both forms of CD).
            ValueError: the model's parameters were replaced after this object found its pairs (the penalty's
                gradient would reach tensors the model no longer uses).
            TypeError: `task_loss` is no 0-dim tensor (a number has no device for the term; a per-sample loss gave
                a term per sample, each aligned to its own sample's loss).
        """
        if self.mode != "loss":
            raise RuntimeError("ColinearityDecay.aux_loss is for mode='loss'; the decoupled mode acts "
                               "through attach()/apply()")
        if not isinstance(task_loss, Tensor) or task_loss.dim() != 0:
            got = f"shape {tuple(task_loss.shape)}" if isinstance(task_loss, Tensor) else type(task_loss).__name__
            raise TypeError(f"ColinearityDecay.aux_loss: task_loss must be the 0-dim tensor of this batch's task loss "
                            f"(reduced, e.g. its mean), got {got}; reduce the loss first, and pass it as the tensor "
                            f"it is")
        if torch.is_grad_enabled():  # a term taken without gradients (a no_grad evaluation) trains nothing
            self._refuse_beside_a_decoupled_step()
            self._aux_taken = True  # what the attached optimizer's next step checks (`attach`)
        if not self._active:
            return torch.zeros((), dtype=torch.float32, device=task_loss.device)
        # Per-role strengths act as relative weights: the overall scale is fixed by loss_coef. A pair none of whose
        # decayed matrices trains is left out, as `apply` leaves it alone: a frozen stage's energies, constants to the
        # optimizer, were aligned with the rest and weakened the trained pairs' term (and showed in cd/penalty)
        weights = [(lam / self.lam if self.lam > 0 else lam) if self._trains(p) else 0.0
                   for lam, p in zip(self._lams, self.pairs)]
        # as apply's: a penalty of replaced tensors (load_state_dict(assign=True)) sent its gradient to tensors the
        # model no longer uses, and the model trained without CD
        self._check_parameters_current()
        self._current_plans()
        penalty = pair_penalty(self.pairs, weights, upstream_grad=self._upstream, plan=self._plan)
        self._last_penalty = penalty.detach()
        return self.loss_coef * align_to_task_loss(penalty, task_loss)

    def _refuse_beside_a_decoupled_step(self) -> None:
        """Refuse a penalty on a matrix that a decoupled object (attached, or a cd.integrations binding) decays in an
        optimizer's step: the matrix would get both forms of CD. An attached loss-mode object is refused at attach;
        an unattached one is seen here, at each aux_loss, since the other may be attached after this object."""
        for other, shared in self._decayed_in_steps():
            if other.mode == "decoupled":
                raise RuntimeError(f"ColinearityDecay.aux_loss: another CD object decays {shared} by its decoupled "
                                   "update in an optimizer's step (its attach() or a cd.integrations callback); this "
                                   "object's aux_loss penalty (mode='loss') would decay it a second time. Use one per "
                                   "model: the other's handle.remove(), or the end of the framework run whose "
                                   "callback or hook holds it, frees them")

    def _trains(self, pair: Pair) -> bool:
        """Whether a matrix this object decays in `pair` trains (requires_grad): its W2, or target C's W1."""
        return pair.downstream.requires_grad or (self._upstream and pair.upstream.requires_grad)

    # ----------------------------------------------------------------------------------- logging, resume
    def metrics(self) -> dict[str, float]:
        """Flat dict for logging (syncs with the device; call at log steps only).

        cd/pair_energy/<role>: mean over the role's blocks (all pairs of the model, targeted or not) of the
            normalized energy ||W2 W1n||_F^2 of the current weights, separate q, k, v layers (or a gated MLP's
            W_gate and W_up) as their stacked matrix [W_Q; W_K; W_V] (the sum of their pairs' energies).
        cd/update_norm/<role>: Frobenius norm of the role's update, all blocks together (also
            <role>_upstream for target C), from the last update whose number is a multiple of
            `norms_every`; absent before that, and while only updates the device skipped (a fused step that
            GradScaler skips, a tensor lr of 0) gave it. The number counts every update CD is called for (`apply`, the
            attached optimizer's steps), one with lr 0 too (a warmup from 0), so that norms_every = the caller's
            log interval gives the norm of the update at each log step; an optimizer step that GradScaler skips
            without calling step() (non-fused) is not seen. Between those updates the value is held: a call after
            another update (train.py's record at an epoch's end, a train.eval_every_steps update or the stop at
            train.max_steps, when that is no multiple of its log interval) gives the norm of the last multiple's.
        cd/penalty: loss mode, the last unweighted-by-coef penalty. cd/updates: CD updates applied so far
            (a step with lr 0 or skipped by GradScaler is none).

        On a model sharded by FSDP2 this is a collective (it gathers each block's matrices for the energies):
        call it on every rank at the same steps, and log the result from one.

        Raises:
            ValueError: the model's parameters were replaced after this object found its pairs (their energies would
                be those of tensors the model no longer uses: constant curves that look like data).
        """
        named = [(p.name, p.downstream) for p in self.all_pairs] + [(p.upstream_name, p.upstream)
                                                                    for p in self.all_pairs]
        check_parameters_current(self._model(), named, "ColinearityDecay", reads_only=True)  # as pair_energy_source's
        self._current_plans()
        out = energy_metrics(self.all_pairs, self._all_plan, self._all_block_plans)
        norms, seen = self._last_update_norms, self._norms_seen
        out.update({f"cd/update_norm/{key}": float(norms[key]) for key in sorted(norms, key=_role_order)
                    if key not in seen or bool(seen[key])})
        if self._last_penalty is not None:
            out["cd/penalty"] = float(self._last_penalty)
        out["cd/updates"] = float(self._updates_done())
        return out

    def _updates_done(self) -> int:
        skipped = int(self._gated_skips) if self._gated_skips is not None else 0
        return self.num_updates - skipped

    def _config(self) -> dict:
        config = {"lam": self.lam, "lam_per_role": dict(self.lam_per_role), "targets": self.targets,
                  "mode": self.mode, "loss_coef": self.loss_coef}
        if self.gated_mlp:  # only when on, so that checkpoints of the paper's setting compare equal
            config["gated_mlp"] = True
        # the setting as given ('auto' stays 'auto': resolved at each update, it may differ between runs by device)
        config["matmul_precision"] = self._precision_setting
        config["decayed"] = [p.name for p in self.pairs]  # other layouts= or targets pair other matrices
        return config

    def state_dict(self) -> dict:
        """CD has no state that affects the update (it is fixed by the config); this holds the counters for
        logging (`num_updates`: cd/updates; `steps`: the updates `norms_every` counts, lr-0 ones too) and the config
        (the settings and the names of the decayed matrices), checked on load."""
        return {"num_updates": self._updates_done(), "steps": self._steps, "config": self._config()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counters; warn if the saved config differs from this object's. `steps` (the updates
        `norms_every` counts, lr-0 ones too) is that of a state saved before it was kept: `num_updates`.

        Raises:
            TypeError, ValueError: `state` is not what `state_dict` writes (`_check_state`).
        """
        _check_state(state)
        self.num_updates = int(state["num_updates"])
        self._steps = int(state.get("steps", self.num_updates))
        self._gated_skips = self._round_skip = None
        saved = state["config"]
        change = config_change(saved, self._config()) if saved is not None else None
        if change is not None:
            warnings.warn(change, stacklevel=2)

    def __repr__(self) -> str:
        roles = sorted({p.role for p in self.pairs}, key=ROLES.index)
        return (f"ColinearityDecay(pairs={len(self.pairs)} {roles}, lam={self.lam}, "
                f"lam_per_role={self.lam_per_role}, targets={self.targets!r}, mode={self.mode!r})")
