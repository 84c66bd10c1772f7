"""CD in transformers' `Trainer`: a `TrainerCallback` (`pip install .[hf]`).

    from cd.integrations.hf import ColinearityDecayCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[ColinearityDecayCallback(lam=0.005)])
    trainer.train()

Where it runs in the Trainer's step (transformers 5.x `_run_epoch`, which `_inner_training_loop` calls; read in
5.25): backward of every micro-batch, then on the last one of an update (`do_sync_step`) the gradient clipping,
`on_pre_optimizer_step` (which arms CD here), `optimizer.step()`, `on_optimizer_step`, the scheduler step. The
update itself runs in a step pre-hook of the torch optimizer inside accelerate's `AcceleratedOptimizer`, so it runs
only if that step really runs: with fp16 the GradScaler skips `optimizer.step()` on inf/NaN gradients, and CD with
it. It uses the lr of each decayed matrix's param group at that moment (before the scheduler steps), as the
optimizer does.

The model and the optimizer come from the Trainer (`on_train_begin`); `module=` names the part of the model that CD
decays (a dotted submodule name, e.g. "encoder" of a VisionEncoderDecoderModel; "" the whole model, the default), as
Lightning's callback and MMEngine's hook take it. The update has no state, so a resumed run
gives the same weights as an uninterrupted one, with the callback as it is given to the resumed Trainer. The
callback is deliberately not one of the Trainer's stateful callbacks: `restore_callback_states_from_checkpoint=True`
would replace it by a new instance built from the arguments saved in the checkpoint, dropping changed
arguments and leaving the caller's object (and its `decay`) unused. The logging counter `cd/updates` (which also
sets the steps whose update norms are computed, `norms_every`) and CD's config are saved in the checkpoint's
`trainer_state.json` instead, as a plain entry of its `stateful_callbacks` under `COUNTER_KEY`
(`COUNTER_KEY:<module>` for a callback given `module=`, so that callbacks on two parts keep their own; not a
callback's class name, so the Trainer rebuilds nothing from it; with `restore_callback_states_from_checkpoint=True`
it logs that entry as a callback "not included in current configuration", and it is restored all the same). A
resumed run whose callback has another config (lam, lam_per_role, targets, gated_mlp) warns, as Lightning's callback
and MMEngine's hook do ("ColinearityDecay: resuming with a different CD config"), and runs with the one given now. A
checkpoint without any such entry, saved by an earlier version of this callback or by a run without CD (which cannot
be told apart), starts the counter at the restored `global_step`, as that version did, with a warning (as
Lightning's callback and MMEngine's hook give on a checkpoint without CD state, where they count from 0):
`global_step` also counts the steps of lr 0 (a warmup's first), those fp16 skipped and those of a run without CD, so
the counter is too high by those steps; one whose entry has no config (an earlier version's too) compares none. A
checkpoint that holds CD state under other keys than the callback's alone (saved with another `module=`) warns,
naming those keys, and counts from 0. An entry saved at an earlier step than the restored `global_step` was carried
forward by the Trainer through steps run without this callback (a resume without it), which made no CD update: the
counter continues from the saved count, with a warning naming those steps.

The Trainer has no event for a `train()` that raises (Lightning has `on_exception`): the binding of a failed run
stays on its optimizer, armed if the run stopped between `on_pre_optimizer_step` and the step. Each `train()`
has a `TrainerState` of its own, so a binding made for another state belongs to a run that is over, and the next
`on_train_begin` on that optimizer removes it: a new callback (and Trainer) on the optimizer of a failed run is
not refused as a second CD update, and the failed run's pending update never runs. Two callbacks in one Trainer
share the state: two that decay the same matrices are still refused (two on different parts, by `module=`, each
make their part's update in the step).
"""
from __future__ import annotations

import importlib.util
import os
import re
import warnings
from typing import Any, Optional

from transformers import TrainerCallback

from ..decay import _HOOKED, ColinearityDecay, make_step_hooks_run
from ..verify import UnsupportedModelError
from ..wrappers import refuse_deepspeed, wrapper_chain
from . import (OptimizerBinding, bind_optimizers, check_cd_arguments, check_module_name, name_the_part, select_module,
               torch_optimizer, warn_unrestored)

# the entry of TrainerState.stateful_callbacks that holds the counter and the config:
# {"num_updates": n, "global_step": step, "config": ColinearityDecay.state_dict()["config"]} (JSON values); a
# callback given module= keeps its own under COUNTER_KEY:<module>
COUNTER_KEY = "cd.integrations.hf.ColinearityDecayCallback"


def check_datasets_not_shadowed() -> None:
    """Refuse a plain folder named `datasets` that Python would import as Hugging Face's `datasets` package (a
    namespace package: a data folder of that name on sys.path, e.g. under a checkout's root, without the package
    installed). transformers then takes it for the package and its Trainer fails inside `train()` with
    "module 'datasets' has no attribute 'Dataset'", which names neither the folder nor the fix."""
    spec = importlib.util.find_spec("datasets")
    if spec is None or spec.origin not in (None, "namespace") or not spec.submodule_search_locations:
        return  # not importable, or a real module / package
    folder = list(spec.submodule_search_locations)[0]
    # the folder that holds it is on sys.path as the script's own folder, the working folder (python -c, -m,
    # pytest) or a PYTHONPATH entry: name it, since which one is not known here
    raise RuntimeError(f"ColinearityDecayCallback: the folder {folder} is importable as the package `datasets` "
                       f"({os.path.dirname(folder)} is on sys.path, and Hugging Face's `datasets` is not "
                       f"installed): transformers' Trainer would take it for that package and fail (\"module "
                       f"'datasets' has no attribute 'Dataset'\"); rename or move {folder}, or pip install datasets")


class ColinearityDecayCallback(TrainerCallback):
    """Colinearity Decay for `transformers.Trainer`.

    Args:
        module: the part of the Trainer's model that CD decays: "" (default) the whole model, or a dotted
            submodule name (e.g. "encoder"); None (MMEngine's `backbone`) is refused. `example_input`, if given, is
            that part's input.
        **cd_kwargs: the arguments of `ColinearityDecay` (`lam=0.005`, `lam_per_role`, `targets`, `gated_mlp`,
            `matmul_precision`, `norms_every`, `verify`, `example_input`); the decoupled update only. The update
            norms in `decay.metrics()` are computed on every `norms_every`-th update, 50 unless given
            (`cd.integrations.NORMS_EVERY`): give your log interval, or 1 for every update.

    Attributes:
        decay: the `ColinearityDecay` of the model, from `on_train_begin` on (`decay.metrics()` for logging).
    """

    def __init__(self, module: str = "", **cd_kwargs: Any) -> None:
        # None would be select_module's `backbone` (MMEngine's default), not the whole model that "" is here
        self.module = check_module_name(module, "ColinearityDecayCallback", backbone=False)
        self.cd_kwargs = check_cd_arguments(cd_kwargs, takes_module=True)
        check_datasets_not_shadowed()
        self.decay: Optional[ColinearityDecay] = None
        self._binding: Optional[OptimizerBinding] = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None or optimizer is None:
            raise RuntimeError("ColinearityDecayCallback: the Trainer passed no model or optimizer to "
                               "on_train_begin")
        self._refuse_unbindable(optimizer, model)
        self._unbind()
        for owner in list(_HOOKED.get(torch_optimizer(optimizer), ())):  # a failed train()'s (module doc)
            if getattr(owner, "trainer_state", state) is not state:
                owner.remove()
        part = select_module(model, self.module)
        try:
            self.decay = ColinearityDecay(part, **self.cd_kwargs)
        except UnsupportedModelError as e:
            message = self._named(str(e))
            if not self.module:  # the whole model: a copy beside the network names module= as the fix
                message = name_the_part(message, model, "ColinearityDecayCallback(module=...)")
            if message == str(e):
                raise
            raise UnsupportedModelError(message) from e
        self._restore_counter(state)
        try:
            (self._binding,) = bind_optimizers(self.decay, [optimizer]).values()
        except (ValueError, RuntimeError) as e:  # of matrices named relative to the part: the part named in it
            if self.module:
                e.args = (self._named(str(e)),)
            raise
        self._binding.trainer_state = state  # the train() it serves

    def _named(self, message: str) -> str:
        """A refusal of CD on a part (`module=`), whose matrices it names relative to the part, with the part
        named, and its fix `pass example_input=` as a Trainer user gives it: the part's own input to the callback
        (the Trainer's batches are the whole model's). The whole model's is returned as it is."""
        if not self.module:
            return message
        where = f"give the part's own input as ColinearityDecayCallback(module={self.module!r}, example_input=...)"
        # a sentence's first word keeps its capital ("Pass example_input= with the masks ..." in cd/values.py)
        message = re.sub(r"([Pp])ass example_input=",
                         lambda m: where[0].upper() + where[1:] if m[1] == "P" else where, message)
        return f"ColinearityDecayCallback(module={self.module!r}): {message}"

    @property
    def state_key(self) -> str:
        """The entry of the Trainer's `stateful_callbacks` that holds this callback's counter: one per part."""
        return f"{COUNTER_KEY}:{self.module}" if self.module else COUNTER_KEY

    def on_init_end(self, args, state, control, optimizer=None, **kwargs):
        # An optimizer given to the Trainer that skips Optimizer.__init__ (timm's Lookahead) calls step hooks only
        # once torch has wrapped its class's step; with fp16, accelerate keeps the bound `step` it finds at
        # `prepare`, before on_train_begin, so the wrapping must come first (on_optimizer_step checks it did)
        if optimizer is not None:
            self._refuse_unbindable(optimizer)
            make_step_hooks_run(torch_optimizer(optimizer))

    def _refuse_unbindable(self, optimizer: Any, model: Any = None) -> None:
        """Refuse the Trainer's optimizers that take no step CD can run in, each naming what it is and the fix:
        DeepSpeed's (`refuse_deepspeed`; accelerate's DummyOptim, given in Trainer(optimizers=...), was "not a
        torch.optim.Optimizer"), and transformers' layer-wise one (optim="galore_adamw_layerwise" and the other
        "_layerwise" optims), whose step() does nothing: an optimizer per parameter steps it in a gradient hook
        inside the backward, and its own param group holds one dummy tensor ("no optimizer holds the matrices")."""
        refuse_deepspeed(type(self).__name__, "train without DeepSpeed (drop TrainingArguments(deepspeed=...) and "
                         "accelerate's DeepSpeed config, and pass a torch optimizer, not accelerate's DummyOptim): "
                         "DDP, or FSDP2 (fsdp_version 2) with verify=False", (optimizer,), model)
        layerwise = next((type(o).__name__ for o in wrapper_chain(optimizer)
                          if any(c.__name__ == "LayerWiseDummyOptimizer" for c in type(o).__mro__)), None)
        if layerwise is not None:
            raise RuntimeError(f"{type(self).__name__}: CD cannot run in transformers' layer-wise optimizer "
                               f"({layerwise}, from TrainingArguments(optim='..._layerwise')): its step() does "
                               "nothing, and an optimizer of each parameter steps it in a gradient hook inside the "
                               "backward, where no step holds all of a pair's matrices; use the optim without "
                               "'_layerwise' (e.g. optim='galore_adamw')")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._binding.arm()

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        missed = self._binding.missed() and not getattr(optimizer, "step_was_skipped", False)
        self._binding.disarm()
        if missed:
            raise RuntimeError("ColinearityDecayCallback: the optimizer stepped but CD's step hook did not run (a "
                               "step method saved before the callback bound it, e.g. timm's Lookahead with fp16 "
                               "when the callback was added after the Trainer was made): pass the callback in "
                               "Trainer(callbacks=[...])")

    def on_step_end(self, args, state, control, **kwargs):
        # every step, since a save may come after it (by step, by epoch, at the best eval, a callback's request)
        # and the Trainer calls no callback before writing trainer_state.json; the count reads the device only
        # where it counts there (a fused optimizer's steps under GradScaler, whose scale accelerate reads at
        # every step anyway)
        if state.stateful_callbacks is not None:
            saved = self.decay.state_dict()
            state.stateful_callbacks[self.state_key] = {"num_updates": saved["num_updates"],
                                                     "global_step": state.global_step, "config": saved["config"]}

    def on_train_end(self, args, state, control, **kwargs):
        self._unbind()

    def _restore_counter(self, state) -> None:
        """The counter of a resumed run: the saved one (saved at an earlier step than the Trainer restored, the
        steps between ran without this callback: warned about); else 0 where the checkpoint holds CD state under
        another key (another module=: this version saved it, and this part had no CD update), warned about; else
        (a checkpoint without any) the restored global_step, where CD updates at all (lam=0 counts none).
        The updates that `norms_every` counts are the restored global_step (the Trainer's update number, which
        its logging_steps count too). A saved config that differs from this decay's is warned about
        (`ColinearityDecay.load_state_dict`)."""
        entries = state.stateful_callbacks or {}
        saved = entries.get(self.state_key)
        saved = saved if isinstance(saved, dict) else {}
        # the CD state under other keys, each with the module= that writes it (None: the default key, no module=)
        others = {key: None if key == COUNTER_KEY else key[len(COUNTER_KEY) + 1:] for key in entries
                  if key != self.state_key and isinstance(key, str)
                  and (key == COUNTER_KEY or key.startswith(COUNTER_KEY + ":"))}
        if "num_updates" in saved:
            count = saved["num_updates"]
            at = saved.get("global_step")
            if at != state.global_step:
                # the Trainer carries the entry forward through steps run without this callback (a resume
                # without it), which made no CD update: the saved count is exact, and those steps are named
                steps = ("the steps after it" if not isinstance(at, int) else f"step {state.global_step}"
                         if at + 1 == state.global_step else f"steps {at + 1} to {state.global_step}")
                warnings.warn(f"{type(self).__name__}: resuming at step {state.global_step} with the CD state "
                              f"under {self.state_key!r} saved at step {at}: {steps} ran without this callback and "
                              f"made no CD update. The update counter (cd/updates) continues from the saved {count}",
                              stacklevel=2)
        elif others:  # saved by this version (earlier ones wrote no module's key) with CD on another part
            count = self.decay.num_updates
            if state.global_step > 0:
                warn_unrestored(type(self).__name__, self.state_key, others, state.global_step)
        else:
            count = state.global_step if self.decay._active else self.decay.num_updates
        if state.global_step > 0 and not saved and not others:
            # a run without CD leaves no entry either, and the two cannot be told apart: the counter starts where
            # an earlier version's resume started it (module doc), with the warning Lightning and MMEngine give
            warn_unrestored(type(self).__name__, self.state_key, {}, state.global_step,
                            no_state="saved by a run without CD, or by a version of this callback that saved none",
                            counter=(f"starts at the restored global_step, {count}, as that version's did (too high "
                                     "by the steps saved without CD, at lr 0 or skipped by fp16),")
                            if self.decay._active else "starts from 0 (lam=0: no step makes a CD update)")
        config = saved.get("config")  # a checkpoint of an earlier version has none: None compares nothing
        if isinstance(config, dict):  # trainer_state.json sorts its keys: the decay's order, so that the warning
            own = self.decay.state_dict()["config"]  # reads as Lightning's and MMEngine's (dicts compare equal anyway)
            config = {**{k: config[k] for k in own if k in config}, **config}
        self.decay.load_state_dict({"num_updates": count, "steps": state.global_step, "config": config})

    def _unbind(self) -> None:
        if self._binding is not None:
            self._binding.remove()
            self._binding = None
