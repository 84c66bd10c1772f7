"""CD in PyTorch Lightning: a `Callback` (`pip install .[lightning]`).

    from cd.integrations.lightning import ColinearityDecayCallback

    trainer = lightning.Trainer(callbacks=[ColinearityDecayCallback(lam=0.005)])
    trainer.fit(module, train_dataloaders=loader)

Where it runs in Lightning's step (2.x, automatic optimization): Lightning calls `optimizer.step(closure)`, and
the closure runs forward and backward; a step pre-hook of the optimizer would therefore run CD before the
gradient exists, and is not used alone. After the backward (and the GradScaler's unscale) Lightning calls the
callbacks' `on_before_optimizer_step`, which arms CD, then the LightningModule's own (which may still set the
step's lr), then the gradient clipping (which may read the weights, as adaptive clipping does):
- without a GradScaler (fp32, bf16, 64-true) all that runs in the closure, inside `optimizer.step(closure)`: CD
  runs when the closure returns, before the optimizer reads the weights, once per step;
- with a GradScaler (16-mixed) it runs before `scaler.step(optimizer)`: CD runs in the optimizer's step
  pre-hook, only if the scaler really steps (it skips the step on inf/NaN gradients).
Either way CD comes after the module's hook and the clipping, with the lr the step uses. With
`accumulate_grad_batches` Lightning steps once per update, and CD with it; manual optimization (`opt.step()`
in `training_step` on the `LightningOptimizer` that `self.optimizers()` returns) goes through the same path.
A step of the raw torch optimizer (`self.optimizers(use_pl_optimizer=False)`) bypasses Lightning's event: it is
refused (a RuntimeError right after that step), not run without CD. Each matrix gets the lr of its param group
at that moment.

The model is the LightningModule (its `example_input_array` serves the pair check, converted as Lightning
converts batches under a "-true" precision), or the submodule that
`module=` names (e.g. `module="net"` for a module without `forward`, whose own input size the check can tell);
the optimizers are the Trainer's, bound at `on_train_start`, and bound again at the start of a batch when they are no
longer the ones bound: an optimizer set up during fit (`trainer.strategy.setup_optimizers(trainer)` in
`on_train_epoch_start`, Lightning's way to switch to a second stage's optimizer) gets CD as the first one did. One
set up later in a batch and stepped in it (in the LightningModule's `on_train_batch_start`, which runs after the
callbacks', or in `training_step` under manual optimization) is refused at its first step, before the step, not
stepped without CD. Under automatic optimization Lightning steps the optimizer that the batch started with, so one
set up in `training_step` is first stepped in the next batch, bound at that batch's start: every step gets CD.
The callback's state (the update counter) is saved in Lightning checkpoints and restored with
`fit(..., ckpt_path=...)`; the update itself has no state. A resumed fit whose checkpoint holds no state under
this callback's key (saved with another `module=`, or without CD) warns, naming the keys it holds.
"""
from __future__ import annotations

import ast
import re
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback

from ..decay import ColinearityDecay
from ..verify import UnsupportedModelError
from ..wrappers import refuse_deepspeed
from . import (bind_optimizers, check_cd_arguments, check_module_name, name_the_part, select_module, torch_optimizer,
               warn_unrestored)


class ColinearityDecayCallback(Callback):
    """Colinearity Decay for `lightning.Trainer`.

    Args:
        module: the part of the LightningModule that CD decays: "" (default) the whole module, or a dotted
            submodule name; None (MMEngine's `backbone`) is refused.
        **cd_kwargs: the arguments of `ColinearityDecay` (`lam=0.005`, `lam_per_role`, `targets`, `gated_mlp`,
            `matmul_precision`, `norms_every`, `verify`, `example_input`); the decoupled update only. The update
            norms in `decay.metrics()` are computed on every `norms_every`-th update, 50 unless given
            (`cd.integrations.NORMS_EVERY`): give your log interval, or 1 for every update.

    Attributes:
        decay: the `ColinearityDecay` of the LightningModule, from `on_train_start` on (`decay.metrics()`).
    """

    def __init__(self, module: str = "", **cd_kwargs: Any) -> None:
        # None would be select_module's `backbone` (MMEngine's default), not the whole module that "" is here
        self.module = check_module_name(module, "ColinearityDecayCallback", backbone=False)
        self.cd_kwargs = check_cd_arguments(cd_kwargs, takes_module=True)
        self.decay: Optional[ColinearityDecay] = None
        self._restored: Optional[dict] = None
        self._checkpoint_keys: Optional[dict[str, Optional[str]]] = None  # as on_load_checkpoint finds them
        self._bindings: dict = {}

    def setup(self, trainer, pl_module, stage: str) -> None:
        # Lightning calls setup before it restores callbacks from ckpt_path, in fit, validate, test and predict: a
        # counter restored for an earlier call (a resumed fit, a validate(ckpt_path=...)) never reaches a later fit
        # without ckpt_path, which is a new run counted from 0
        self._restored = None
        self._checkpoint_keys = None  # this class's keys in the checkpoint this fit resumes (on_load_checkpoint)

    def on_train_start(self, trainer, pl_module) -> None:
        self._unbind()
        refuse_deepspeed(type(self).__name__, "use strategy='ddp', or FSDP2 (ModelParallelStrategy with fully_shard "
                         "in configure_model) with verify=False", tuple(trainer.optimizers), pl_module,
                         getattr(trainer, "strategy", None))  # (a stand-in Trainer of a test may have none)
        kwargs = dict(self.cd_kwargs)
        part = select_module(pl_module, self.module)
        example = getattr(pl_module, "example_input_array", None)
        checked = kwargs.get("verify", True)  # the example serves the pair check only (none with verify=False)
        # the LightningModule's example is its own input: given to the LightningModule only, never to a part of it
        if kwargs.get("example_input") is None and example is not None and part is pl_module and checked:
            kwargs["example_input"] = example
        if kwargs.get("example_input") is not None:
            # as Lightning hands every batch to the module: "64-true", "bf16-true" and "16-true" convert floating
            # inputs to the module's dtype, so a float32 example (as users write it) serves those runs too
            kwargs["example_input"] = trainer.precision_plugin.convert_input(kwargs["example_input"])
        try:
            self.decay = ColinearityDecay(part, **kwargs)
        except UnsupportedModelError as e:
            message = _lightning_names(str(e), self.module)
            if not self.module:  # the whole LightningModule: a copy beside the network names `module=` as the fix
                message = name_the_part(message, pl_module, "ColinearityDecayCallback(module=...)")
            raise UnsupportedModelError(message) from e
        if self._restored is not None:
            self.decay.load_state_dict(self._restored)
        elif self._checkpoint_keys is not None and trainer.global_step > 0:
            warn_unrestored(type(self).__name__, self.state_key, self._checkpoint_keys, trainer.global_step)
        self._bind(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # the bindings hold their optimizers, so an id here is of the same object as long as it is bound
        if set(self._bindings) != {id(torch_optimizer(opt)) for opt in trainer.optimizers}:
            self._bind(trainer)  # set up again since (a second stage's optimizer): bound as the first ones were

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        binding = self._bindings.get(id(torch_optimizer(optimizer)))
        if binding is None:
            # bound now, it would miss this step: the step has begun (inside optimizer.step(closure), the step
            # pre-hook that runs CD after the closure is past), so a step without CD is refused before it is taken
            raise RuntimeError("cd.integrations: Lightning steps an optimizer that ColinearityDecayCallback has not "
                               "bound, one set up after this batch started (the callback binds the Trainer's "
                               "optimizers at on_train_start and at each batch's on_train_batch_start), so CD could "
                               "not run in its step: set up a new optimizer (trainer.strategy.setup_optimizers) in "
                               "on_train_epoch_start (the LightningModule's or a callback's)")
        binding.arm()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for binding in self._bindings.values():
            binding.disarm()

    def on_train_end(self, trainer, pl_module) -> None:
        self._unbind()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # a run that failed leaves no hook on its optimizers: a later attach (or fit) on them is not refused as a
        # second CD update, and no armed update waits for a step of the user's own
        self._unbind()

    def _bind(self, trainer) -> None:
        """CD bound to the Trainer's optimizers as they are now (and no longer to those bound before)."""
        self._unbind()
        self._bindings = bind_optimizers(self.decay, trainer.optimizers, strict_steps=True)

    def _unbind(self) -> None:
        for binding in self._bindings.values():
            binding.remove()
        self._bindings = {}

    @property
    def state_key(self) -> str:
        """One key per part in Lightning's checkpoint (Lightning refuses two stateful callbacks of one key), the
        class name alone for the whole module."""
        return self._generate_state_key(module=self.module) if self.module else super().state_key

    def state_dict(self) -> dict:
        """CD's state (update counter and config, plain values) for Lightning's checkpoint."""
        return {"cd": self.decay.state_dict() if self.decay is not None else self._restored}

    def load_state_dict(self, state_dict: dict) -> None:
        self._restored = state_dict.get("cd")

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # Lightning hands `load_state_dict` the state under `state_key` alone, which depends on module=: a state
        # saved with another module= would be left unread without a word (on_train_start warns)
        name = type(self).__qualname__  # state_key: the class name, with the module= for a part
        self._checkpoint_keys = {}  # each of this class's keys with the module= that writes it (None: no module=)
        for key in checkpoint.get("callbacks") or {}:
            if key == name:
                self._checkpoint_keys[key] = None
            elif isinstance(key, str) and key.startswith(name + "{") and _module_of(key[len(name):]) is not None:
                self._checkpoint_keys[key] = _module_of(key[len(name):])


def _module_of(kwargs: str) -> Optional[str]:
    """The module= in a state key's kwargs part as `_generate_state_key` writes it (`repr` of a dict:
    "{'module': 'net'}"), or None where it holds none (a key this class does not write)."""
    try:
        module = ast.literal_eval(kwargs).get("module")
    except (ValueError, TypeError, SyntaxError, AttributeError):  # not a dict's repr
        return None
    return module if isinstance(module, str) else None


def _lightning_names(message: str, module: str) -> str:
    """`message` (the pair check's refusal) with its fix `pass example_input=` named as a Lightning user sets it:
    the LightningModule's `example_input_array` (which the callback passes on for the whole module) or the
    callback's `example_input=`; for a part (`module=`), the callback's only, since the module's example is the
    whole module's input, not the part's."""
    if module:  # the LightningModule's example_input_array is the whole module's input, not given to a part
        where = f"give {module}'s own input as ColinearityDecayCallback(module={module!r}, example_input=...)"
    else:
        where = "set the LightningModule's example_input_array or pass ColinearityDecayCallback(example_input=...)"
    # a sentence's first word keeps its capital ("Pass example_input= with the masks ..." in cd/values.py)
    return re.sub(r"([Pp])ass example_input=", lambda m: where[0].upper() + where[1:] if m[1] == "P" else where,
                  message)
