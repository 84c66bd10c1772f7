"""CD in MMEngine and the OpenMMLab trainers on it (MMDetection, MMSegmentation, ...): a hook
(`pip install .[mmengine]`), enabled by configuration alone:

    custom_imports = dict(imports=["cd.integrations.mmengine"], allow_failed_imports=False)
    custom_hooks = [dict(type="ColinearityDecayHook", lam=0.005)]

Importing this module also registers the baselines' hooks, `TweoHook` (cd/integrations/mmengine_tweo.py) and
`WeightNoiseHook` (UNIQ weight noise, cd/integrations/mmengine_noise.py).

Where it runs in MMEngine's step (0.10): no hook event sits between backward and the optimizer step
(`run_iter` calls `before_train_iter`, `train_step`, `after_train_iter`, and `OptimWrapper.update_params` does
backward, clipping and the step inside). So the update runs in a step pre-hook of the torch optimizer inside the
OptimWrapper, armed from `before_train` to `after_train`: after backward and clipping, right before the optimizer
reads the weights, once per real update (each of them where a train_step updates more than once, and a step that
another hook makes, before or after this hook's events; with `accumulative_counts` the wrapper steps only on the
last micro-batch, and CD with it), and not when
`AmpOptimWrapper`'s GradScaler skips the step (inf/NaN gradients). Any OptimWrapper type works, since none is
replaced: OptimWrapper, AmpOptimWrapper, an OptimWrapperDict (each optimizer holding decayed matrices is bound),
or your own. Each matrix gets the lr of its
param group at that moment, which MMEngine's param schedulers set. With an OptimWrapperDict the optimizers' steps
of one iteration make one update (`cd.integrations.SharedUpdate`): every pair reads the weights of before the
iteration's steps, also a pair whose two matrices are in different optimizers, and `cd/updates` counts it once.
The optimizers are bound at `before_train`, and bound again at an iteration's start when `runner.optim_wrapper` no
longer holds the ones bound: a wrapper replaced during training (a hook that sets `runner.optim_wrapper` to a second
stage's optimizer at `before_train_epoch`) gets CD as the first did, with the same counter. A step of another
optimizer that changes decayed matrices (a wrapper set after the iteration's start, by a hook of lower priority at
`before_train_iter`; an optimizer of one's own) would have no CD, and is refused before it changes them. A
train() that raises gets no `after_train` from MMEngine: its bindings stay until the next `before_train` of a CD
hook, the same runner's or another's (a sweep, a notebook: the new runner's steps of the same model are its own),
takes them off. A training loop of one's own on such a model would still have its steps refused as an unbound
optimizer's: call the failed run's `hook.after_train(runner)` first, which takes them off.

The model: `runner.model` without its (MM)DistributedDataParallel wrapper, and of it the `backbone` when it has
one (a detector's, as the paper decays the backbone; `module=` names another part, `module=""` the whole
model). The pair check runs one forward of that part on the `meta` device (and, in eval mode, 1 + ceil(log2 of the
widest pair's channel count) real forwards of one sample for the V rows of a fused qkv and the channel order,
`cd/values.py`); where CD cannot tell the input size (MMDetection's Swin has none), an image batch (1, 3, 224, 224)
serves; `input_shape` gives another (and is then used whatever the model says). The hook's state (the update
counter, plain values) is saved in MMEngine's checkpoints under "colinearity_decay" ("colinearity_decay:<module>"
for a hook given `module=`) and restored by `resume`; a run that starts from a checkpoint with `load_from`
(fine-tuning) counts from 0.
"""
from __future__ import annotations

import collections.abc
import inspect
import math
import re
import weakref
from typing import Any, Optional, Sequence

import torch
from mmengine.hooks import Hook
from mmengine.registry import HOOKS
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..decay import ColinearityDecay, budget_weight_decay
from ..verify import UnsupportedModelError, example_input
from ..wrappers import refuse_deepspeed, steps_under_way, unwrap_model
from . import (bind_optimizers, check_cd_arguments, check_module_name, name_the_part, select_module,
               torch_optimizer, warn_unrestored)

CHECKPOINT_KEY = "colinearity_decay"
DEFAULT_INPUT_SHAPE = (1, 3, 224, 224)  # an image batch, for a part that cannot say its input size
# the hooks that hold bindings now, each with the runner it bound for (ColinearityDecayHook._runner): weak, so that a
# run that raised does not keep its hook alive through this set
_BOUND: "weakref.WeakSet[ColinearityDecayHook]" = weakref.WeakSet()


def _optimizers(optim_wrapper: Any) -> list:
    """The torch optimizers of an OptimWrapper or an OptimWrapperDict."""
    if hasattr(optim_wrapper, "optim_wrappers"):  # OptimWrapperDict
        return [w.optimizer for w in optim_wrapper.optim_wrappers.values()]
    return [optim_wrapper.optimizer]


@HOOKS.register_module()
class ColinearityDecayHook(Hook):
    """Colinearity Decay for an MMEngine `Runner`.

    Args:
        module: the part of the model that CD decays: None (default) the `backbone` if the model has one, else
            the whole model; "" the whole model; or a dotted submodule name.
        input_shape: the shape of one input batch of that part, for the pair check (positive ints); default: the
            part's own input size where CD can tell it, else (1, 3, 224, 224), an image batch. Refused beside
            `verify=False` (no check) or `example_input` (another input for it).
        **cd_kwargs: the arguments of `ColinearityDecay` (`lam=0.005`, `lam_per_role`, `targets`, `gated_mlp`,
            `matmul_precision`, `norms_every`, `verify`); the decoupled update only. The update norms in
            `decay.metrics()` are computed on every `norms_every`-th update, 50 unless given
            (`cd.integrations.NORMS_EVERY`): give your log interval, or 1 for every update.

    Attributes:
        decay: the `ColinearityDecay`, from `before_train` on (`decay.metrics()`).
    """

    priority = "NORMAL"

    def __init__(self, module: Optional[str] = None, input_shape: Optional[Sequence[int]] = None,
                 **cd_kwargs: Any) -> None:
        self.module = check_module_name(module, "ColinearityDecayHook")
        # an empty shape passes all(): it would fail only inside runner.train(), at the pair check; a number is not
        # iterable, and a set or a dict iterates in no batch's order (its keys), so only a sequence is read
        if input_shape is not None and (isinstance(input_shape, (str, bytes)) or not isinstance(
                input_shape, collections.abc.Sequence) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in input_shape) or not input_shape):
            raise ValueError(f"ColinearityDecayHook: input_shape must be a sequence of positive ints (one input "
                             f"batch, e.g. (1, 3, 224, 224)), got {input_shape!r}")
        self.input_shape = None if input_shape is None else tuple(input_shape)
        self.cd_kwargs = check_cd_arguments(cd_kwargs, takes_module=True)
        if input_shape is not None and not self.cd_kwargs.get("verify", True):
            raise ValueError("ColinearityDecayHook: input_shape serves the pair check only, and verify=False skips it: "
                             "drop input_shape, or drop verify=False to run the check on it")
        if input_shape is not None and self.cd_kwargs.get("example_input") is not None:
            raise ValueError("ColinearityDecayHook: input_shape and example_input both give the pair check's input: "
                             "give one of them")
        self.decay: Optional[ColinearityDecay] = None
        self._restored: Optional[dict] = None
        # this class's keys in the checkpoint loaded, if any, each with the module= that writes it
        self._checkpoint_keys: Optional[dict[str, Optional[str]]] = None
        self._bindings: dict = {}
        self._foreign = None  # the handle of the global step pre-hook that refuses steps of unbound optimizers
        self._runner = None  # the runner the bindings serve

    def target(self, model: torch.nn.Module) -> torch.nn.Module:
        """The part of `model` that CD decays (see `module`)."""
        return select_module(model, self.module)

    def before_train(self, runner) -> None:
        self._unbind()  # a train() that raised left its bindings (MMEngine calls no after_train then)
        # so did another runner's hooks (a sweep, a notebook): one runner trains at a time, so theirs belong to a
        # run that is over, and left on they would refuse this run's steps of the same model as steps of an
        # optimizer they have not bound (hooks of this runner, on its other parts, stay)
        for other in list(_BOUND):
            if other._runner is not runner:
                other._unbind()
        # FlexibleRunner's DeepSpeedStrategy: its model wrapper is no nn.Module ("CD needs the model as a
        # torch.nn.Module", a wrong fix) and its optimizer wrapper steps the engine
        refuse_deepspeed(type(self).__name__, "train with MMEngine's Runner, or FlexibleRunner with "
                         "strategy=dict(type='DDPStrategy'), and an OptimWrapper (not DeepSpeedOptimWrapper)",
                         (runner.optim_wrapper,), strategy=getattr(runner, "strategy", None))
        target = self.target(runner.model)
        kwargs = dict(self.cd_kwargs)
        shape = None  # the input batch this hook gives the pair check, if it gives one
        tried = origin = None  # the batch shape the pair check runs on, and where it comes from (for its error)
        if kwargs.get("example_input") is None and kwargs.get("verify", True):
            shape, origin = self.input_shape, "input_shape"
            if shape is None:
                try:
                    own = example_input(target)
                except UnsupportedModelError:  # no input size on the model: an image batch
                    shape, origin = DEFAULT_INPUT_SHAPE, "the hook's default: the model states none"
                else:  # ColinearityDecay makes the model's own again; a batch of token ids (a dict) has no shape
                    tried = tuple(own.shape) if isinstance(own, torch.Tensor) else None
                    origin = "the model's own input size"
            if shape is not None:  # given, or needed: the pair check runs on it
                tried = tuple(shape)
                dtype = next((p.dtype for p in target.parameters() if p.is_floating_point()), torch.float32)
                kwargs["example_input"] = torch.empty(shape, dtype=dtype, device="meta")
        try:
            self.decay = ColinearityDecay(target, **kwargs)
        except UnsupportedModelError as e:
            if tried is None or e.__cause__ is None:  # not a forward that failed on an image batch of the hook's
                message = str(e)
                if target is unwrap_model(runner.model):  # the whole model: a copy beside the network names module=
                    message = name_the_part(message, target, 'dict(type="ColinearityDecayHook", module=...)')
                if message == str(e):
                    raise
                raise UnsupportedModelError(message) from e
            # the check's own advice (ColinearityDecay's example_input tensor) is not what a config file gives, also
            # where the model's own input size is the wrong one
            cause = str(e.__cause__).splitlines()[0] if str(e.__cause__) else ""
            raise UnsupportedModelError(
                f"ColinearityDecayHook: a CD pair check's forward pass of {type(target).__name__} (on the meta "
                f"device, or a real one of its V-row and channel-order check) failed on an input batch of shape "
                f"{tried} ({origin}) ({type(e.__cause__).__name__}: {cause}); if that is not the shape of the "
                "part's input, give the hook input_shape= of one input batch of that part (e.g. input_shape=(1, 3, "
                "32, 32)); if it is, the forward fails for another reason (the error named: a hook on the part, or a "
                "step that cannot run on that device), which verify=False passes over by trusting the structure "
                "alone") from e.__cause__
        # `after_load_checkpoint` comes for `load_from` (fine-tuning from a checkpoint: a new run, counted from 0)
        # as for `resume`; only a resumed run stands past iteration 0 here
        if runner.iter > 0 and self._checkpoint_keys is not None:  # a resumed run
            if self._restored is not None:
                self.decay.load_state_dict(self._restored)
            else:
                warn_unrestored(type(self).__name__, self.checkpoint_key, self._checkpoint_keys, runner.iter)
        refusal = budget_refusal(getattr(runner, "cfg", None), runner.model, self.decay,
                                 _optimizers(runner.optim_wrapper))
        if refusal is not None:  # before any update
            raise ValueError(refusal)
        self._bind(runner)

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        # the bindings hold their optimizers, so an id here is of the same object as long as it is bound
        if set(self._bindings) != {id(torch_optimizer(opt)) for opt in _optimizers(runner.optim_wrapper)}:
            self._bind(runner)  # a wrapper replaced since (a second stage's optimizer): bound as the first ones were
        else:
            self._new_round()  # a step another hook made after the last iteration was an update of its own

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        self._new_round()

    def _new_round(self) -> None:
        """The steps made from now on are a new update (SharedUpdate's round), and CD stays armed for every one:
        an optimizer stepped by another hook, before or after this one's events, gets CD as the train_step's
        steps do (armed only from before_train_iter to this hook's after_train_iter, a later hook's step was a
        plain optimizer step, silently)."""
        for binding in self._bindings.values():
            binding.disarm()
            binding.arm(until_disarmed=True)

    def after_train(self, runner) -> None:
        self._unbind()

    def _bind(self, runner) -> None:
        """CD bound to the optimizers of `runner.optim_wrapper` as they are now (and no longer to those bound
        before); the decay, and so its counter, stays."""
        self._unbind()
        self._bindings = bind_optimizers(self.decay, _optimizers(runner.optim_wrapper))
        self._runner = runner
        _BOUND.add(self)
        self._new_round()  # armed until after_train: every step of these optimizers is an update with CD
        # through a weak reference: torch's global hooks live as long as the process, and a run that raised (no
        # after_train) would otherwise keep this hook, its decay and the model alive (GPU memory) after the runner
        hook = weakref.ref(self)
        self._foreign = register_optimizer_step_pre_hook(
            lambda optimizer, args, kwargs: None if hook() is None else hook()._refuse_foreign_step(optimizer))

    def _unbind(self) -> None:
        for binding in self._bindings.values():
            binding.remove()
        self._bindings = {}
        if self._foreign is not None:
            self._foreign.remove()
            self._foreign = None
        self._runner = None
        _BOUND.discard(self)

    def _refuse_foreign_step(self, optimizer: torch.optim.Optimizer) -> None:
        """A step (torch's global pre-hook, before the weights change) of an optimizer that is not bound and changes
        matrices CD decays would have no CD: a wrapper set as runner.optim_wrapper after this iteration's start (a
        hook of lower priority at before_train_iter), or an optimizer of one's own. Refused rather than run
        without it. Steps inside a bound optimizer's step (Lookahead's inner optimizer) are a part of that one."""
        if id(optimizer) in self._bindings or any(id(o) in self._bindings for o in steps_under_way()):
            return
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        named = next((name for name, t in self.decay._decayed_named() if id(t) in held and t.grad is not None), None)
        if named is not None:
            raise RuntimeError(f"ColinearityDecayHook: a {type(optimizer).__name__} that is not runner.optim_wrapper's "
                               f"optimizer at the iteration's start steps {named} and other matrices CD decays, so "
                               "that step would have no CD: set runner.optim_wrapper before the iteration (at "
                               "before_train_epoch, or in a before_train_iter hook of higher priority than "
                               "ColinearityDecayHook's), or step those matrices through runner.optim_wrapper")

    @property
    def checkpoint_key(self) -> str:
        """Where this hook's state goes in a checkpoint: one key per part, so that hooks on two parts (a backbone
        and a neck) keep their own counters."""
        return CHECKPOINT_KEY if self.module is None else f"{CHECKPOINT_KEY}:{self.module}"

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        if self.decay is not None:
            checkpoint[self.checkpoint_key] = self.decay.state_dict()  # plain values: loads with weights_only

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        self._restored = checkpoint.get(self.checkpoint_key)  # applied in before_train, to a resumed run only
        # the keys of hooks of this class in it: one saved with another module= is not read, and before_train warns
        # (checkpoint_key's forms: the key alone for module=None, else "<key>:<module>")
        self._checkpoint_keys = {k: None if k == CHECKPOINT_KEY else k[len(CHECKPOINT_KEY) + 1:] for k in checkpoint
                                 if isinstance(k, str) and (k == CHECKPOINT_KEY or k.startswith(CHECKPOINT_KEY + ":"))}


CD_HOOK = ColinearityDecayHook.__name__
BUDGET_APPLIED = "applied: "  # cd_budget's value once the weight decay holds the budget (a dumped config)
# torch's optimizers whose weight decay is L2 in the gradient (Adam, NAdam and RAdam unless decoupled_weight_decay),
# not AdamW's lr * wd * W per step, which the budget rule assumes (budget_weight_decay); SGD without momentum (its
# default) is that form: lr * (g + wd * W)
L2_DECAY = ("Adadelta", "Adagrad", "Adam", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "SGD")


def apply_weight_decay_budget(cfg: Any) -> None:
    """The paper's regularization-budget rule (App. A.2) for an MMEngine config with `cd_budget = True` (as
    configs/detection/method/cd.py has): the optimizer's weight decay, as the merged files and overrides leave it,
    lowered by the lam of the config's ColinearityDecayHook (its base lam; lam_per_role does not change it, as
    cd.budget in train.py). Call it once the config is complete (scripts/train_detection.py does, through
    engine.detection.load_config), so that an override of the hook's lam or of the weight decay moves the budget
    with it; MMEngine alone reads `cd_budget` as an unused variable. `cd_budget` then records what was done
    ("applied: 0.05 - lam 0.005 = 0.045"), which MMEngine's config dump keeps. Loading the dump again applies the
    rule to the recorded base (0.05), not to the lowered weight decay, so it is not lowered twice and follows an
    override there too: of the lam (`custom_hooks.0.lam=0.01`: 0.05 - 0.01 = 0.04), or of the weight decay, then
    the new base as in the files (`weight_decay=0.1`: 0.1 - lam; a value equal to the recorded result, 0.045,
    reads as no override). `cd_budget = False` (or none) leaves the weight decay as given. The rule assumes
    decoupled weight decay (AdamW's, the form of CD's step; see budget_weight_decay): a torch optimizer whose decay
    is L2 in the gradient (SGD, Adam) is refused, one this function does not know is taken as given. The rule lowers
    the one weight decay of the optimizer: a paramwise_cfg decay_mult m on a matrix CD decays (whose budget would be
    m * wd - lam, not m * (wd - lam)) is refused by the hook once the optimizer is built (`budget_refusal`); on the
    norms, position tables and biases of the shipped configs, which CD does not decay, it stays as given. So the parts
    the hook does not decay (a detector's neck and heads, beside its backbone) train at the lowered weight decay as
    well, as train.py's cd.budget lowers the one weight decay of a whole network: App. A.2 states the rule for the
    model CD regularizes, and which weight decay the rest of a detector keeps is our choice. To keep theirs, give
    them decay_mult = wd / (wd - lam) in paramwise_cfg.custom_keys (0.05 / 0.045 for "neck", "rpn_head",
    "roi_head"), which the hook takes (test_mmengine_budget_optimizer.py). The hook refuses a cd_budget=True left
    unapplied, too. Raises
    ValueError where the rule cannot apply, or `cd_budget` is a record this function did not write."""
    budget = cfg.get("cd_budget")
    if budget is None or budget is False:
        return
    optimizer = (cfg.get("optim_wrapper") or {}).get("optimizer") or {}
    weight_decay = optimizer.get("weight_decay")
    if isinstance(budget, str) and budget.startswith(BUDGET_APPLIED):
        base, result = _recorded_budget(budget)
        if weight_decay == result:  # the dump's weight decay, lowered already: the rule starts from its base
            weight_decay = base
    elif budget is not True:
        raise ValueError(f"cd_budget={budget!r}: give True (lower the weight decay by CD's lam, the budget rule) "
                         "or False")
    # the hook as MMEngine builds it from any of its forms: the name, a scoped name, the class
    hooks = [h for h in cfg.get("custom_hooks") or [] if type_name(h.get("type")) == CD_HOOK]
    default = inspect.signature(ColinearityDecay).parameters["lam"].default
    lams = {h.get("lam", default) for h in hooks}
    if len(lams) != 1:
        raise ValueError(f"cd_budget=True with {len(hooks)} {CD_HOOK}s{f' of lam {sorted(lams)}' if hooks else ''}: "
                         f"the budget rule lowers the weight decay by one lam; give one {CD_HOOK} "
                         "(configs/detection/method/cd.py) or set cd_budget=False and "
                         "optim_wrapper.optimizer.weight_decay yourself")
    lam = lams.pop()
    kind = _l2_decay(optimizer)
    if kind is not None:
        raise ValueError(f"cd_budget=True with optim_wrapper.optimizer.type={kind}: the budget rule (weight decay "
                         f"minus the hook's lam) assumes decoupled weight decay (lr * wd * W per step, AdamW's and "
                         f"the form of CD's step), and {kind}'s is L2 in the gradient; use type='AdamW', or set "
                         f"cd_budget=False and optim_wrapper.optimizer.weight_decay yourself")
    for name, value in (("optim_wrapper.optimizer.weight_decay", weight_decay), (f"{CD_HOOK} lam", lam)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"cd_budget=True needs a number as {name}, got {value!r}: set it, or set "
                             "cd_budget=False")
        if not math.isfinite(value) or value < 0:  # else the "< 0: lower the hook's lam" below, which it is not
            raise ValueError(f"cd_budget=True needs a finite number >= 0 as {name}, got {value!r}: set it, or "
                             "set cd_budget=False")
    try:
        # 12 significant digits: the config (and its dump) reads 0.045, not 0.045000000000000005
        optimizer["weight_decay"] = float(f"{budget_weight_decay(weight_decay, lam):.12g}")
    except ValueError:
        raise ValueError(f"cd_budget=True: optim_wrapper.optimizer.weight_decay {weight_decay} - {CD_HOOK} lam "
                         f"{lam} < 0; lower the hook's lam, or set cd_budget=False") from None
    cfg["cd_budget"] = f"{BUDGET_APPLIED}{weight_decay} - lam {lam} = {optimizer['weight_decay']}"


def budget_refusal(cfg: Any, model: torch.nn.Module, decay: ColinearityDecay, optimizers: Sequence) -> Optional[str]:
    """The refusal of a weight decay that the budget rule (`apply_weight_decay_budget`, recorded in `cfg`'s
    cd_budget) does not hold for on a matrix `decay` decays, or None. The rule keeps each matrix's decay budget:
    the baseline's weight decay of the matrix, less the lam CD now adds to it (App. A.2, lam_wd + lam_cd = the
    baseline's). For a matrix whose param group scales the weight decay by paramwise_cfg's decay_mult m (or sets a
    weight decay of its own) that budget is m * wd - lam, which the rule's one lowered weight decay times m,
    m * (wd - lam), is not; nor can one weight decay times m give it, and for m < lam / wd it is < 0. So a param
    group of a decayed matrix (in `optimizers`, the torch ones of runner.optim_wrapper) must hold the lowered weight
    decay itself: the shipped configs scale only norms, position tables and biases, which CD does not decay. A
    cd_budget=True that nothing applied (a Runner built from the config as it is) is refused too."""
    budget = cfg.get("cd_budget") if cfg is not None else None
    if budget is True:  # MMEngine alone (its tools/train.py) reads it as an unused variable: the budget silently off
        return ("cd_budget=True, but the optimizer's weight decay was not lowered by the hook's lam: nothing applied "
                "the rule to this config (MMEngine reads cd_budget as an unused variable); call cd.integrations."
                "mmengine.apply_weight_decay_budget(cfg) before the Runner is built (scripts/train_detection.py "
                "does), or set cd_budget=False to train at the weight decay as given")
    if not (isinstance(budget, str) and budget.startswith(BUDGET_APPLIED)):
        return None
    base, lowered = _recorded_budget(budget)
    names = {id(p): name for name, p in unwrap_model(model).named_parameters()}  # as paramwise_cfg's keys read them
    decayed = {id(t) for t in decay._decayed()}
    for optimizer in optimizers:
        for group in torch_optimizer(optimizer).param_groups:
            held = next((p for p in group["params"] if id(p) in decayed), None)
            if held is None:
                continue
            mult, weight_decay = group.get("decay_mult", 1.0), group.get("weight_decay")
            # decay_mult is read from the group too (MMEngine's constructor copies the custom key's settings into
            # it): with a lowered weight decay of 0 (wd = lam) every multiple of it is 0
            if mult == 1 and isinstance(weight_decay, (int, float)) and math.isclose(weight_decay, lowered,
                                                                                      rel_tol=1e-9, abs_tol=1e-15):
                continue
            name = names.get(id(held), "a matrix")
            why = (f"paramwise_cfg decay_mult={mult}, whose budget is {mult} * {base} - lam {decay.lam}, not "
                   f"{mult} * ({base} - lam), and no weight decay times decay_mult gives it" if mult != 1 else
                   f"not the lowered {lowered}: its param group's own, which the rule has not lowered")
            return (f"cd_budget ({budget}) with {name}, a matrix {CD_HOOK} decays, at weight decay {weight_decay} "
                    f"({why}); drop the decay_mult or weight decay of the matrices {CD_HOOK} decays from "
                    "optim_wrapper.paramwise_cfg, or set cd_budget=False and every weight decay yourself")
    return None


def type_name(kind: Any) -> Optional[str]:
    """The class name that a config's `type` builds, in each form MMEngine's registries take: a class (its
    `__name__`), its registry name, or that name with a registry scope ("mmengine.SGD", "mmdet.X": the part after the
    last "."); None for anything else."""
    kind = getattr(kind, "__name__", kind)
    return kind.rpartition(".")[2] if isinstance(kind, str) else None


def _l2_decay(optimizer: Any) -> Optional[str]:
    """The type of `optimizer` (optim_wrapper.optimizer) where it is one of torch's L2_DECAY in a form other than the
    decoupled one, else None: AdamW, SGD without momentum, decoupled_weight_decay=True, or a type not known here."""
    kind = optimizer.get("type")
    kind, name = getattr(kind, "__name__", kind), type_name(kind)  # named in a refusal as given, a class by name
    if name not in L2_DECAY or optimizer.get("decoupled_weight_decay") is True:
        return None
    return None if name == "SGD" and not optimizer.get("momentum", 0) else kind


def _recorded_budget(budget: str) -> tuple[float, float]:
    """The base weight decay and the result in the record `budget` that apply_weight_decay_budget wrote (not its
    lam: the hook's lam in the config now is the one that applies). Raises ValueError for another text, which would
    leave unknown what weight decay the budget was taken from."""
    match = re.fullmatch(rf"{BUDGET_APPLIED}(\S+) - lam \S+ = (\S+)", budget)
    try:
        return float(match[1]), float(match[2])
    except (TypeError, ValueError):  # no match (None[1]), or not numbers
        raise ValueError(f"cd_budget={budget!r}: not a record that apply_weight_decay_budget writes (e.g. "
                         f"'{BUDGET_APPLIED}0.05 - lam 0.005 = 0.045'); give True with the weight decay before the "
                         "budget, or False") from None


# The baselines' hooks (TWEO, UNIQ weight noise) register with this module's import, so one custom_imports entry
# enables all three.
from .mmengine_noise import WeightNoiseHook  # noqa: E402
from .mmengine_tweo import TweoHook  # noqa: E402

__all__ = ["CHECKPOINT_KEY", "ColinearityDecayHook", "TweoHook", "WeightNoiseHook"]
