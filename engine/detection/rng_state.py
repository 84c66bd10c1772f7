"""The random-number state of a detection training run, kept in its MMEngine checkpoints so that a resumed
run continues exactly (scripts/train_detection.py registers the hook)."""
from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch
from mmengine.hooks import Hook

class RngStateHook(Hook):
    """Make a resumed training continue exactly: MMEngine 0.10's checkpoints hold no random-number state, so a
    resumed run drew other flips, RoI samples and dropout than the uninterrupted one (110 of the sample
    detector's 115 tensors differed after a resumed epoch). The torch (and CUDA), numpy and python states go
    into each checkpoint and are restored when training starts from one; a validation inside training puts them
    back as they were before it, because it runs after the epoch's checkpoint is saved and would otherwise move
    the training stream on only in the run that was not interrupted.

    MMEngine saves checkpoints on rank 0 only, so under torchrun rank 0's state is kept and restored on rank 0;
    the other ranks continue from the run's seed."""

    priority = "LOWEST"  # restores after every other hook's before_train, saves after theirs

    def __init__(self) -> None:
        self._loaded: Optional[dict] = None
        self._before_val: Optional[dict] = None

    @staticmethod
    def _state() -> dict:
        state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    @staticmethod
    def _restore(state: dict) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        checkpoint["rng_state"] = self._state()

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        self._loaded = checkpoint.get("rng_state")

    def before_train(self, runner) -> None:
        if runner.iter == 0 or runner.rank != 0:  # a new run, seeded by MMEngine; see the class docstring
            return
        if self._loaded is None:
            runner.logger.warning("the checkpoint resumed from holds no random-number state (written without "
                                  "RngStateHook): training continues from the run's seed, not exactly")
            return
        self._restore(self._loaded)
        self._loaded = None

    def before_val(self, runner) -> None:
        self._before_val = self._state()

    def after_val(self, runner) -> None:
        if self._before_val is not None:
            self._restore(self._before_val)
            self._before_val = None
