"""A guard for runs that diverge without a NaN: the loss stays far above its value at the start.

A NaN or inf loss already stops a run (engine/loop.py). A run with too high a learning rate can instead
blow up to a large finite loss and settle at chance level (digits at lr 1.0: loss 126, then 14, val
10%), which would otherwise end with exit code 0. The rule: the mean training loss of a log window
above `factor` x the loss of the run's first update, for `windows` consecutive log windows, stops the
run like a NaN does (no checkpoint is written over the last good one). A healthy run's loss falls
below its starting value (ln(classes) for a fresh classifier, with or without label smoothing, mixup,
TWEO or CD's loss form) and a spike recovers within a window or two, so the default (3x for 3
windows) acts only on diverged runs; `train.divergence_factor=null` turns it off.
The streak is part of the checkpointed TrainState (engine/loop.py), so a run resumed between log windows
counts on where it stopped (older checkpoints, without it, resume with 0).
"""
from __future__ import annotations

from typing import Optional


class DivergenceError(RuntimeError):
    """The training loss stayed far above its initial value; the last good checkpoint is kept."""


class DivergenceGuard:
    """Counts consecutive log windows whose mean loss exceeds `factor` x the initial loss."""

    def __init__(self, factor: float, windows: int) -> None:
        self.factor, self.windows = factor, windows
        self.streak = 0

    def check(self, step: int, mean_loss: float, initial_loss: Optional[float]) -> None:
        """Raise DivergenceError after `windows` high windows in a row (the same verdict on every rank,
        given the all-reduced `mean_loss`)."""
        if initial_loss is None or initial_loss <= 0:
            return
        self.streak = self.streak + 1 if mean_loss > self.factor * initial_loss else 0
        if self.streak >= self.windows:
            raise DivergenceError(
                f"the training loss stayed above {self.factor:g}x its initial value {initial_loss:.4g} for "
                f"{self.streak} log windows (now {mean_loss:.4g} at update {step}): the run diverged. "
                f"Stopping without writing a checkpoint (the last one written is kept). Lower optim.lr, "
                f"or set train.divergence_factor=null to turn this check off")
