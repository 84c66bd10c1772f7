"""best.pt: the weights with the best validation score so far, written when a validation improves on it.

The score is the task's (engine/tasks.py): the highest val top-1 of a classifier, the lowest val loss of a
language model. The best score lives in `TrainState.best_value`, which checkpoint.pt carries, so a resumed run only
overwrites best.pt when it beats every validation of the run before it. The payload is what evaluate.py
reads: the (unwrapped) model, its EMA if any, the run's config, the training state, the metrics of that
validation and the class names of the data set.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch.nn as nn

from .loop import TrainState

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

    def offer(self, state: TrainState, metrics: dict) -> bool:
        """Write best.pt if metrics[key] beats state.best_value (which then becomes it); True if written.
        A tie is not better: the earlier weights stay."""
        value = metrics[self.key]
        if state.best_value is not None and (value <= state.best_value if self.higher_is_better
                                             else value >= state.best_value):
            return False
        state.best_value = value
        state.best_epoch = state.epoch + (state.epoch_batches > 0)  # 1-based: just completed, or in progress
        state.best_step = state.step
        self.save(lambda: {"model": self.model.state_dict(), "config": self.config,
                           "state": state.state_dict(), "metrics": metrics, "classes": self.classes,
                           **({"model_ema": self.ema.module.state_dict()} if self.ema is not None else {})},
                  self.path)
        return True
