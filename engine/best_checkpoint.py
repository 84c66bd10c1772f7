"""best.pt: the weights with the best validation top-1 so far, written when a validation improves on it.

The best top-1 lives in `TrainState.best_top1`, which checkpoint.pt carries, so a resumed run only
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
    """Keeps `path` at the best validation top-1; `save(payload_fn, path)` writes (on the main rank)."""

    def __init__(self, path: str, *, model: nn.Module, ema: Optional[nn.Module], config: dict,
                 classes: Optional[list], save: Callable[[Callable[[], dict], str], None]):
        self.path, self.model, self.ema, self.config, self.classes, self.save = \
            path, model, ema, config, classes, save

    def offer(self, state: TrainState, metrics: dict) -> bool:
        """Write best.pt if metrics['val/top1'] beats state.best_top1 (then raised to it); True if written."""
        if metrics["val/top1"] <= state.best_top1:
            return False
        state.best_top1 = metrics["val/top1"]
        state.best_epoch = state.epoch + (state.epoch_batches > 0)  # 1-based: just completed, or in progress
        state.best_step = state.step
        self.save(lambda: {"model": self.model.state_dict(), "config": self.config,
                           "state": state.state_dict(), "metrics": metrics, "classes": self.classes,
                           **({"model_ema": self.ema.module.state_dict()} if self.ema is not None else {})},
                  self.path)
        return True
