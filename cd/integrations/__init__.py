"""CD in training frameworks that own the loop: transformers' Trainer, Lightning, MMEngine (MMDetection).

    from cd.integrations.hf import ColinearityDecayCallback          # pip install .[hf]
    from cd.integrations.lightning import ColinearityDecayCallback   # pip install .[lightning]
    custom_hooks = [dict(type="ColinearityDecayHook", lam=0.005)]    # MMEngine config; pip install .[mmengine]

Each takes the arguments of `ColinearityDecay` (`lam`, `lam_per_role`, `targets`, `gated_mlp`, ...), finds the
model and the optimizer itself, and gives the paper's update (Sec. 3.3) exactly where `attach` gives it in a
plain loop: after the task gradient and clipping, right before the optimizer reads the weights, once per real
update, not on a step that AMP skips, with the lr of W2's param group. This module holds what the three share,
`OptimizerBinding`, `SharedUpdate` (one update over several optimizers), and `select_module` (which part of the
model a regularizer acts on); it needs torch alone, and each framework module imports its framework.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any, Container, Optional

import torch

from ..decay import ColinearityDecay, check_settings, make_step_hooks_run, register_step_update
from ..layouts import check_layouts
from ..pairs import check_example_use
from ..update import check_tf32_device, check_tf32_dtype
from ..verify import UNUSED
from ..wrappers import (closure_then, in_outer_step, steps_without_hooks, torch_optimizer, unhooked_step_text,
                        unwrap_model)

# ColinearityDecay's arguments of the loss form, which the integrations refuse (they give the decoupled update:
# `mode` is taken as "decoupled" alone).
_LOSS_ONLY = ("mode", "loss_coef")
# The update norms (`cd/update_norm/<role>` in `metrics()`, a metric only) cost about as much again as the update
# (cd/README.md, "Cost and precision of the update"), so, as in train.py, they are not computed on every update:
# by default on every 50th, train.py's default log interval (`train.log_every_steps`, which it passes).
NORMS_EVERY = 50


def check_cd_arguments(kwargs: dict[str, Any], takes_module: bool = False) -> dict[str, Any]:
    """`kwargs` for `ColinearityDecay(model, **kwargs)`, checked now: the names, and the values that need no model
    (`check_settings`; the rest when the model is there, before the first step), with `norms_every` NORMS_EVERY
    unless given, and `layouts` as a tuple of `Layout` (a config file's mappings of its fields made Layouts).
    `takes_module`: whether the caller names a part of the model with `module=` (named in the refusal of model=).
    Raises TypeError for a name `ColinearityDecay` does not take, ValueError for a value it refuses."""
    if "model" in kwargs:  # the signature's own first argument: binding would say "multiple values for 'model'"
        part = "; name the part of it to decay with module=" if takes_module else ""
        raise TypeError("model= is not an argument of cd.integrations: the model is the framework's own (the "
                        f"Trainer's, the LightningModule, runner.model), found at the train start{part}")
    # mode='decoupled' is the update they give (a config written out in full names it): taken
    bad = [f"{name}={kwargs[name]!r}" for name in _LOSS_ONLY
           if name in kwargs and (name, kwargs[name]) != ("mode", "decoupled")]
    if bad:
        raise TypeError(f"{', '.join(bad)}: the integrations apply CD's decoupled update (mode='decoupled', the "
                        "default); the loss form is not run by them: drop mode= and loss_coef=, or train without the "
                        "integration, with ColinearityDecay(model, mode='loss') and loss + cd.aux_loss(loss) in your "
                        "training step")
    kwargs = {"norms_every": NORMS_EVERY, **kwargs}
    try:
        bound = inspect.signature(ColinearityDecay).bind(None, **kwargs)
    except TypeError as e:
        raise TypeError(f"ColinearityDecay arguments: {e}") from None
    bound.apply_defaults()  # the values that need no model now (lam=nan, an unknown role), not at the train start
    check_settings(**{name: bound.arguments[name] for name in inspect.signature(check_settings).parameters})
    check_example_use(bound.arguments["example_input"], bound.arguments["verify"], "cd.integrations")
    if "layouts" in kwargs:  # a malformed one now, not at the train start; a config file's mappings made Layouts
        kwargs["layouts"] = check_layouts(kwargs["layouts"])
    return dict(kwargs)


def check_module_name(module: Optional[str], who: str, backbone: bool = True) -> Optional[str]:
    """`module=` as the integrations take it (see select_module), checked when the callback or hook is made: a
    number there (e.g. lam given by position) would otherwise fail inside the framework's train start.
    `backbone`: whether None (the `backbone`, MMEngine's convention) is taken; where it is not (Lightning, whose
    default is "" the whole module), None is refused rather than silently decaying another part."""
    if module is None and backbone:
        return module
    if not isinstance(module, str):
        allowed = ("a dotted submodule name (str) or None" if backbone
                   else '"" (the whole module) or a dotted submodule name (str)')
        raise TypeError(f"{who}: module must be {allowed}, got {module!r}; CD's arguments go by name (lam=...)")
    return module


def select_module(model: torch.nn.Module, module: Optional[str]) -> torch.nn.Module:
    """The part of `model` (wrappers looked through, also those around its parts) that a regularizer acts on: for
    `module` None, the `backbone` if the model has one (a detector's, as the paper regularizes the backbone), else
    the whole model; "" the whole model; otherwise the dotted submodule name, as in the unwrapped model.

    Raises:
        ValueError: `module` names no submodule of the model (naming the model's own submodules).
    """
    model = unwrap_model(model)
    if module is None:
        backbone = getattr(model, "backbone", None)
        return unwrap_model(backbone) if isinstance(backbone, torch.nn.Module) else model
    # each part unwrapped on the way: MMEngine's MMSeparateDistributedDataParallel wraps every child of the model in
    # a DDP of its own, so "backbone.blocks.1" would otherwise meet that wrapper (no `blocks`), and a part returned
    # in it would hide its own input size from the pair check
    part = model
    for name in module.split(".") if module else ():
        try:
            if not name:
                raise AttributeError("an empty name between dots")
            part = unwrap_model(part.get_submodule(name))
        except AttributeError as e:
            children = [child for child, _ in model.named_children()]
            raise ValueError(f"module={module!r} names no submodule of the {type(model).__name__} ({e}); give a "
                             f"dotted submodule name (its own: {children[:8]}) or '' for the whole model") from None
    return part


def name_the_part(message: str, model: torch.nn.Module, argument: str) -> str:
    """The pair check's refusal `message` of a whole model (a LightningModule's, an MMEngine model's) with the fix
    where a matrix it holds is not used in the forward (a copy beside the network, e.g. an EMA or a teacher, which
    the forward never runs): name the part to decay with `argument` (e.g. "ColinearityDecayCallback(module=...)"),
    among the model's children. Other refusals are returned as they are."""
    if UNUSED not in message:
        return message
    children = [name for name, _ in unwrap_model(model).named_children()]
    return (f"{message}; CD decays the whole {type(unwrap_model(model)).__name__} here, also a part that its forward "
            f"does not run (an EMA copy, a teacher): name the part to decay with {argument} (its children: "
            f"{children[:8]})")


def warn_unrestored(who: str, key: str, others: dict[str, Optional[str]], step: int,
                    no_state: str = "saved by a run without CD", counter: str = "starts from 0") -> None:
    """Warn that a run resumed at `step` (> 0) restored no CD state under `key`, this callback's or hook's key in the
    checkpoint, while `others` are the keys of the same class's state it holds (saved with another `module=`, whose
    key differs), each with the `module=` that writes it (None: no module=, the class's default key): CD's counter
    is not restored (it starts as `counter` says) and there is no saved config to compare, which the warning on a
    resume with another CD config (`ColinearityDecay.load_state_dict`) would otherwise not tell. `no_state`: what
    saves a checkpoint that holds none (the Trainer's callback names an earlier version of itself too)."""
    # each key with its module=: the default key is written with no module=, which "give that module=" must say
    named = ", ".join(f"{k!r} ({'no module=' if m is None else f'module={m!r}'})" for k, m in others.items())
    held = (f"it holds CD state under {named} (saved by a {who} with another module=, whose key differs): give the "
            f"{who} that module= to continue its counter") if others else \
        f"it holds no CD state ({no_state})"
    warnings.warn(f"{who}: resuming at step {step} with no CD state under {key!r} in the checkpoint; {held}. The "
                  f"update counter (cd/updates) {counter} and the saved CD config, if any, is not compared with "
                  "this one", stacklevel=2)


def holds_pairs(decay: ColinearityDecay, optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` holds any matrix that `decay` writes."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return any(id(t) in held for t in decay._decayed())


class OptimizerBinding:
    """CD bound to the torch optimizer that a framework steps.

    The framework's event says that a real update comes, after backward, accumulation and clipping: `arm()`.
    The update then runs in the optimizer's step pre-hook, so only if the step really runs (GradScaler skips
    `optimizer.step()` on inf/NaN gradients; a fused optimizer's step is gated on the device instead, see
    `ColinearityDecay.attach`), once, and before the optimizer reads the weights. A step given a closure
    (Lightning runs forward, backward, its `on_before_optimizer_step` hooks and the gradient clipping inside
    `optimizer.step(closure)`, and the optimizer calls the closure before it reads the weights) has its update
    right after the closure returns, if the event came by then: after all that the closure does, as in a step
    without one (`cd.wrappers.closure_then`).
    Nothing runs when no decayed matrix has a gradient: the optimizer would leave them alone (Lightning skips
    backward when `training_step` returns None). A second CD update in the same optimizer's step that decays
    one of the same matrices (an `attach` of the model's own, another binding) is refused.

    Args:
        decay: the CD object of the model.
        optimizer: the framework's optimizer (wrappers are looked through, `torch_optimizer`).

    Decayed matrices the optimizer does not hold are left alone, with a warning (as `attach` does).

    A step that should have had CD and did not is an error, never a silent no-op: `missed()` says that the
    framework's event came and no step of the optimizer ran since (a framework that knows whether its step ran
    raises then), and with `strict_steps` a step that runs with decayed matrices' gradients but without the
    framework's event (the optimizer stepped around the framework) raises once it has run.
    """

    def __init__(self, decay: ColinearityDecay, optimizer: Any, strict_steps: bool = False,
                 warn_outside: bool = True, shared: Optional["SharedUpdate"] = None) -> None:
        self.decay = decay
        self.shared = shared
        self.strict_steps = strict_steps
        self.optimizer = torch_optimizer(optimizer)
        held = decay._group_index(self.optimizer)
        if warn_outside:  # bind_optimizers warns once, about the matrices outside all of its optimizers
            _warn_outside(decay, held)
        register_step_update(self, decay, self.optimizer, "cd.integrations")
        decay._warn_if_all_frozen(held, "cd.integrations")
        self._armed = False
        self._held = False  # armed for every update until disarm() (arm(until_disarmed=True))
        self._stepping = False
        self._in_closure = False  # in the step's closure, until its first call returns
        self._applied = False
        self._kwargs: dict = {}
        self._handles = [self.optimizer.register_step_pre_hook(self._pre),
                         self.optimizer.register_step_post_hook(self._post)]

    def _hooked_decay(self, optimizer: torch.optim.Optimizer) -> Optional[ColinearityDecay]:
        """The decay this binding runs in `optimizer`'s step, until `remove` (`register_step_update`)."""
        return self.decay if self._handles and optimizer is self.optimizer else None

    def arm(self, until_disarmed: bool = False) -> None:
        """The framework's event: the update that follows (or is under way, in a closure) is a real one; with
        `until_disarmed`, every update until `disarm()` is (MMEngine's iteration, whose train_step may update
        more than once: a step the GradScaler skips never reaches the optimizer there)."""
        self._held = until_disarmed
        if self._stepping and not self._in_closure:  # a step under way that has no closure: now, or never
            if not self._applied:
                self._run()
        else:  # before the step, or inside its closure: the update comes once the closure has returned
            self._armed = True

    def disarm(self) -> None:
        """The framework's step is over (taken or skipped): nothing is pending."""
        self._armed = self._held = False
        if self.shared is not None:  # the framework's iteration is over: so is its update
            self.shared.new_round()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.shared is not None:
            self.shared.remove()

    def _pre(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Optional[tuple]:
        if in_outer_step(optimizer):  # a subclass's step calling super().step(): the outer step's hooks act
            return None
        self._stepping, self._applied, self._kwargs = True, False, kwargs
        self._in_closure = True
        replaced = closure_then(args, kwargs, self._after_closure)
        if replaced is None:  # no closure: the gradient exists now
            self._in_closure = False
            if self._armed:
                self._run()
        return replaced

    def _after_closure(self) -> None:
        self._in_closure = False
        if self._armed and not self._applied:
            self._run()

    def missed(self) -> bool:
        """Armed for one update, and no step of the optimizer has run since: if the framework says its step ran,
        the step went around this binding's pre-hook (e.g. a step method saved before the hook existed)."""
        return self._armed and not self._held

    def _post(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if in_outer_step(optimizer):
            return
        bypassed = self.strict_steps and not self._applied and self._holds_gradients()
        self._stepping, self._in_closure, self._armed = False, False, self._held
        if bypassed:
            raise RuntimeError("cd.integrations: the optimizer took a step without the framework's step event, so "
                               "CD did not run in it (e.g. Lightning's raw optimizer, "
                               "self.optimizers(use_pl_optimizer=False)): step through the framework's optimizer")

    def _holds_gradients(self) -> bool:
        """Whether a decayed matrix that this optimizer holds has a gradient (its step changed it): a step of an
        optimizer that holds none (a head's) has no CD part to miss."""
        held = self.decay._group_index(self.optimizer)
        return any(t.grad is not None and id(t) in held for t in self.decay._decayed())

    def _run(self) -> None:
        self._armed, self._applied = self._held, True
        if self.shared is None:
            self.decay.apply_for(self.optimizer, self._kwargs)
        else:
            self.shared.apply_for(self.optimizer, self._kwargs)


class SharedUpdate:
    """One CD update made by the bindings of several optimizers over one model (an OptimWrapperDict's, a
    LightningModule's), each writing the decayed matrices that its optimizer holds, in its step.

    As in one optimizer's step (cd/update.py), every pair reads the weights of before the update's steps: where a
    pair's two matrices are held by different optimizers (a model split over them), the one whose optimizer steps
    first would otherwise be read stepped by the other's part. So the step pre-hook of each optimizer keeps a copy
    of the matrices it holds that the part of an optimizer still to step reads (none unless a pair is split),
    until the update is over; who holds what follows the optimizers' param groups (a group added later, as when a
    stage is unfrozen, may split a pair). The update is one framework iteration (`new_round`, at `disarm`), or a
    round in it where a train_step steps its optimizers several times: an optimizer that steps a second time
    starts the next update. Every optimizer is followed, also one that holds no decayed matrix yet: a param group
    that adds some later (add_param_group) gets their update from its next step on. The update is counted once in
    `cd/updates`, and each role's update norm covers all of its matrices.

    Args:
        decay: the CD object of the model.
        optimizers: the framework's torch optimizers (all of them: one that holds only W1s steps them too).
    """

    def __init__(self, decay: ColinearityDecay, optimizers: list) -> None:
        self.decay = decay
        # all of them: one that holds no decayed matrix now may get some (add_param_group), and copies with them
        self.optimizers = list(dict.fromkeys(optimizers))
        self._map()
        self._stepped: set[int] = set()
        self._kept: dict[int, torch.Tensor] = {}
        self._counted = False
        self._handles = []
        for opt in self.optimizers:  # before the bindings' hooks: the copies are of the weights before CD too
            make_step_hooks_run(opt)
            self._handles.append(opt.register_step_pre_hook(self._pre))

    def _signature(self) -> tuple:
        # which parameter sits where, not the groups' lengths alone (as ColinearityDecay._group_index keys it)
        return tuple(tuple(map(id, g["params"])) for opt in self.optimizers for g in opt.param_groups)

    def _map(self) -> None:
        """Which optimizer holds each parameter, and the matrices that another optimizer's part reads (by the id
        of their holder), for the optimizers' param groups as they are now (`_signature`)."""
        self._sig = self._signature()
        self._holder: dict[int, torch.optim.Optimizer] = {}
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    self._holder.setdefault(id(p), opt)
        read: dict[int, torch.Tensor] = {}  # matrices that another optimizer's part of the update reads
        self._readers: dict[int, set[int]] = {}  # their id -> the ids of the optimizers whose parts read them
        for pair in self.decay.pairs:
            w1, w2 = self._holder.get(id(pair.upstream)), self._holder.get(id(pair.downstream))
            if w1 is not None and w2 is not None and w1 is not w2:
                read[id(pair.upstream)] = pair.upstream  # W2's update reads W1
                self._readers.setdefault(id(pair.upstream), set()).add(id(w2))
                if self.decay._upstream:  # target C: W1's update reads W2
                    read[id(pair.downstream)] = pair.downstream
                    self._readers.setdefault(id(pair.downstream), set()).add(id(w1))
        self._kept_of: dict[int, list] = {}
        for t in read.values():
            self._kept_of.setdefault(id(self._holder[id(t)]), []).append(t)
        # the optimizers whose steps are parts of the update: another's steps (a head's) change no matrix CD reads
        # or writes, so a second one of them starts no next update
        self._parts = {id(opt) for opt in self.optimizers if holds_pairs(self.decay, opt) or id(opt) in self._kept_of}

    def _pre(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if in_outer_step(optimizer):  # a subclass's step calling super().step(): one step, not a second one
            return
        if self._signature() != self._sig:  # a param group added since (e.g. a stage unfrozen): a pair may be split
            self._map()
        if id(optimizer) not in self._parts:
            return
        if id(optimizer) in self._stepped:  # a second step of this optimizer: the next update
            self.new_round()
        self._stepped.add(id(optimizer))
        for t in self._kept_of.get(id(optimizer), ()):
            if not self._readers[id(t)] <= self._stepped:  # a part that reads it is still to come: a copy
                self._kept[id(t)] = t.detach().clone()

    def apply_for(self, optimizer: torch.optim.Optimizer, kwargs: dict) -> None:
        """`optimizer`'s part of the update (in its step), on the weights of before the update's steps."""
        reads = {i: t for i, t in self._kept.items() if self._holder[i] is not optimizer}
        # the first part begins the update, whether or not it runs (an lr of 0): `norms_every` counts updates
        self.decay.apply_for(optimizer, kwargs, reads, count=not self._counted)
        self._counted = True

    def new_round(self) -> None:
        """The update is over: the next step of any optimizer belongs to the next one."""
        self._stepped.clear()
        self._kept.clear()
        self._counted = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.new_round()


def bind_optimizers(decay: ColinearityDecay, optimizers: list, strict_steps: bool = False
                    ) -> dict[int, OptimizerBinding]:
    """A binding for each optimizer of `optimizers`, by id of its torch optimizer (`strict_steps`: see
    OptimizerBinding); with several optimizers, their steps make one update together (`SharedUpdate`). An
    optimizer that holds no decayed matrix now is bound too: a param group that adds some later (add_param_group,
    as when a stage is unfrozen) gets their update from its next step on, as if they had been there from the start.

    Raises:
        ValueError: no optimizer holds any of them now and some are trainable (an error early, not a run without
            CD). All of them frozen and in no optimizer (a stage to unfreeze later, Lightning's BaseFinetuning) is
            a warning: their update starts once a param group adds them.
        RuntimeError: an optimizer's `step` calls no step hooks (`cd.wrappers.steps_without_hooks`): an lr scheduler
            built on timm's Lookahead before torch wrapped its class's step (CD would silently never run).
        ValueError: matmul_precision='tf32' was given and a decayed matrix is not on CUDA (`check_tf32_device`).
    """
    _refuse_tf32_off_cuda(decay)
    opts = {}
    for optimizer in optimizers:
        opt = torch_optimizer(optimizer)
        opts.setdefault(id(opt), opt)
        unhooked = steps_without_hooks(opt)
        if unhooked:  # a framework builds the scheduler (configure_optimizers) before the callback binds
            raise RuntimeError(f"cd.integrations: {unhooked_step_text(unhooked[0], opt)}; an lr scheduler built on it "
                               f"keeps that step), so CD would never run in its "
                               f"steps: call the optimizer's zero_grad() once before building its lr scheduler (in a "
                               f"LightningModule's configure_optimizers; before Trainer(optimizers=...) in Hugging "
                               f"Face's)")
    if not any(holds_pairs(decay, opt) for opt in opts.values()):
        named = decay._decayed_named()
        if any(t.requires_grad for _, t in named):
            raise ValueError(f"no optimizer holds the {len(named)} matrices CD decays (e.g. {named[0][0]}), so CD "
                             "would never act: build the optimizer on the parameters of the part CD decays")
        # all frozen, and left out of the optimizer as frozen parameters are (Lightning's BaseFinetuning): a stage
        # unfrozen later with add_param_group gets CD from its next step on, as the bindings follow param groups
        warnings.warn(f"all {len(named)} matrices CD decays are frozen (requires_grad=False, e.g. {named[0][0]}) and "
                      "in no optimizer: CD acts on each once it is unfrozen into an optimizer (add_param_group)",
                      stacklevel=3)
    else:
        # the matrices that none of them holds: one held by another of the optimizers (an OptimWrapperDict's, a
        # Lightning module's several) gets CD in that optimizer's step, so it is not left alone
        _warn_outside(decay, {i for opt in opts.values() for i in decay._group_index(opt)})
    # one optimizer's step is the whole update
    shared = SharedUpdate(decay, list(opts.values())) if len(opts) > 1 else None
    bindings: dict[int, OptimizerBinding] = {}
    try:
        for key, opt in opts.items():
            bindings[key] = OptimizerBinding(decay, opt, strict_steps, warn_outside=False, shared=shared)
    except BaseException:
        # an optimizer refused (another CD update in its step) after others were bound: the caller gets no
        # bindings to remove, so the hooks made so far go now; left on, they would refuse the retry that the
        # refusal asks for (the other update removed) as a second CD update in the first optimizers' steps
        for binding in bindings.values():
            binding.remove()
        if shared is not None:
            shared.remove()
        raise
    return bindings


def _refuse_tf32_off_cuda(decay: ColinearityDecay) -> None:
    """An explicit matmul_precision='tf32' with a decayed matrix off CUDA, refused when the framework's optimizers
    are bound: the framework has put the model on its device by then, so this is the device of the run, and the
    error comes before the first forward and backward, not inside the first optimizer step (where ColinearityDecay
    checks it, for a model that may still move after CD is built)."""
    if not decay._tf32_to_check:
        return
    check_tf32_dtype("tf32", decay._decayed_named(), "cd.integrations: matmul_precision")
    for t in decay._decayed():
        check_tf32_device("tf32", t.device.type, "cd.integrations: matmul_precision", "the decayed matrices are",
                          "pass matmul_precision='fp32', or 'auto' (tf32 on CUDA, fp32 elsewhere), or train on a "
                          "GPU (the framework's device or accelerator setting)")


def _warn_outside(decay: ColinearityDecay, held: Container[int]) -> None:
    """The rule of ColinearityDecay.attach (cd/README.md, "The API's rules"): CD changes exactly the matrices the
    optimizer changes, so decayed matrices outside it (`held`: ids of the parameters it holds) are left alone,
    with one warning."""
    outside = [name for name, t in decay._decayed_named() if id(t) not in held]
    if outside:
        warnings.warn(f"{len(outside)} decayed matrices are not in the optimizer (e.g. {outside[:3]}); the "
                      "optimizer never changes them, so CD leaves them alone too", stacklevel=3)
