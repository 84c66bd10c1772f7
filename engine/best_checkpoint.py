"""best.pt: the weights with the best validation score so far, written when a validation improves on it.

The score is the task's (engine/tasks.py): the highest val top-1 of a classifier, the lowest val loss of a
language model. The best score lives in `TrainState.best_value`, which checkpoint.pt carries, so a resumed run only
overwrites best.pt when it beats every validation of the run before it. The payload is what evaluate.py
reads: the (unwrapped) model, its EMA if any, the run's config, the training state, the metrics of that
validation and the class names of the data set.

On resume the checkpoint's best score must describe the best.pt in out_dir (`match_file`): after a roll-back to
an earlier snapshot (or a crash after a validation the last checkpoint does not know of) best.pt holds weights
from beyond the resume point, which the next improvement would overwrite; it is kept aside as
best.until_step<N>.pt, and best.pt is written afresh by the resumed run's first validation. So is a best.pt
chosen on another validation set (a resume with train.allow_changed_config=true and a new data.val_windows,
data.val_split, eval crop, ...: engine/run_dir.VALIDATION_KEYS), whose score no new validation can be compared with.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.nn as nn

from .distributed import all_reduce, raise_on_every_rank
from .loop import TrainState
from .run_dir import RunDirError, keep_as_until_step

__all__ = ["BestCheckpoint"]


class BestCheckpoint:
    """Keeps `path` at the best validation score; `save(payload_fn, path)` writes (on the main rank).
    `key` names the score in the validation metrics, `higher_is_better` its direction."""

    def __init__(self, path: str, *, model: nn.Module, ema: Optional[nn.Module], config: dict,
                 classes: Optional[list], save: Callable[[Callable[[], dict], str], None],
                 key: str = "val/top1", higher_is_better: bool = True):
        self.path, self.model, self.ema, self.config, self.classes, self.save = \
            path, model, ema, config, classes, save
        self.key, self.higher_is_better = key, higher_is_better

    def match_file(self, state: TrainState, is_main: bool, device: torch.device,
                   other_validation: bool = False) -> Optional[str]:
        """Make `state`'s best score that of the best.pt on disk, on every rank alike. best.pt written at
        another update than `state.best_step` (a later one of an abandoned branch, another run's when resumed
        into a new out_dir), or scored on another validation set (`other_validation`), is moved aside as
        best.until_step<state.step>.pt; a missing or moved one clears the score, so the next validation writes
        best.pt. A resume point with no validation yet is no exception: a best.pt beside it comes from beyond it
        (a roll-back to a snapshot written before the first validation), and that validation would overwrite
        it. Returns the kept path (main rank) or None."""
        kept, error, clear = None, None, 1.0 if other_validation else 0.0
        if is_main:
            try:
                written_at = _written_at_step(self.path)
                if written_at != state.best_step or other_validation:
                    clear = 1.0
                    if os.path.exists(self.path):
                        kept = keep_as_until_step(self.path, state.step)
            except OSError as e:
                error = RunDirError(f"cannot move {self.path} aside before resuming: {e}")
        raise_on_every_rank(error, device, lambda: RunDirError(f"rank 0 could not move {self.path} aside (its "
                                                               f"error says why)"))
        if all_reduce(torch.tensor([clear], device=device)).item() > 0:
            state.best_value, state.best_epoch, state.best_step = None, 0, 0
        return kept

    def offer(self, state: TrainState, metrics: dict) -> bool:
        """Write best.pt if metrics[key] beats state.best_value (which then becomes it); True if written.
        A tie is not better: the earlier weights stay."""
        value = metrics[self.key]
        if state.best_value is not None and (value <= state.best_value if self.higher_is_better
                                             else value >= state.best_value):
            return False
        state.best_value = value
        state.best_epoch = state.current_epoch
        state.best_step = state.step
        self.save(lambda: {"model": self.model.state_dict(), "config": self.config,
                           "state": state.state_dict(), "metrics": metrics, "classes": self.classes,
                           **({"model_ema": self.ema.module.state_dict()} if self.ema is not None else {})},
                  self.path)
        return True


def _written_at_step(path: str) -> Optional[int]:
    """The update at which best.pt was written (its training state), or None: missing or not readable."""
    if not os.path.isfile(path):
        return None
    payload = None
    for mmap in (True, False):  # mmap: only the small state is read; a file system without it reads it all
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            break
        except Exception:  # noqa: BLE001 - a file unreadable both ways is one that no score describes
            continue
    state = payload.get("state") if isinstance(payload, dict) else None
    return state.get("step") if isinstance(state, dict) else None
