"""CD in transformers' `Trainer`: a `TrainerCallback` (`pip install .[hf]`).

    from cd.integrations.hf import ColinearityDecayCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[ColinearityDecayCallback(lam=0.005)])
    trainer.train()

Where it runs in the Trainer's step (transformers 5.x `_inner_training_loop`): backward of every micro-batch,
then on the last one of an update (`do_sync_step`) the gradient clipping, `on_pre_optimizer_step` (which arms CD
here), `optimizer.step()`, `on_optimizer_step`, the scheduler step. The update itself runs in a step pre-hook of
the torch optimizer inside accelerate's `AcceleratedOptimizer`, so it runs only if that step really runs: with
fp16 the GradScaler skips `optimizer.step()` on inf/NaN gradients, and CD with it. It uses the lr of each
decayed matrix's param group at that moment (before the scheduler steps), as the optimizer does.

The model and the optimizer come from the Trainer (`on_train_begin`). The callback's state (the update counter)
is written with the Trainer's checkpoints; `TrainingArguments(restore_callback_states_from_checkpoint=True)`
restores it on resume. The update itself has no state: resuming gives the same weights either way.
"""
from __future__ import annotations

from typing import Any, Optional

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..decay import ColinearityDecay
from . import OptimizerBinding, check_cd_arguments


class ColinearityDecayCallback(TrainerCallback, ExportableState):
    """Colinearity Decay for `transformers.Trainer`.

    Args:
        **cd_kwargs: the arguments of `ColinearityDecay` (`lam=0.005`, `lam_per_role`, `targets`, `gated_mlp`,
            `matmul_precision`, `norms_every`, `verify`, `example_input`); the decoupled update only.

    Attributes:
        decay: the `ColinearityDecay` of the model, from `on_train_begin` on (`decay.metrics()` for logging).
    """

    def __init__(self, **cd_kwargs: Any) -> None:
        self.cd_kwargs = check_cd_arguments(cd_kwargs)
        self.decay: Optional[ColinearityDecay] = None
        self.cd_state: Optional[dict] = None  # restored by the Trainer (ExportableState), loaded at train begin
        self._binding: Optional[OptimizerBinding] = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None or optimizer is None:
            raise RuntimeError("ColinearityDecayCallback: the Trainer passed no model or optimizer to "
                               "on_train_begin")
        self._unbind()
        self.decay = ColinearityDecay(model, **self.cd_kwargs)
        if self.cd_state is not None:
            self.decay.load_state_dict(self.cd_state)
        self._binding = OptimizerBinding(self.decay, optimizer)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._binding.arm()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._binding.disarm()

    def on_train_end(self, args, state, control, **kwargs):
        self._unbind()

    def _unbind(self) -> None:
        if self._binding is not None:
            self._binding.remove()
            self._binding = None

    def state(self) -> dict:
        """What the Trainer writes into trainer_state.json (`stateful_callbacks`): the arguments, and CD's
        state (update counter and config) as plain JSON values."""
        saved = self.decay.state_dict() if self.decay is not None else self.cd_state
        args = {k: v for k, v in self.cd_kwargs.items() if k != "example_input"}  # a tensor is not JSON
        return {"args": args, "attributes": {"cd_state": saved}}
