"""The EMA of the weights (`train.ema`): timm's ModelEmaV3, updating each parameter and buffer once per update.

timm's default walks `state_dict()`, which lists a tied parameter under each of its names (GPT's `wte.weight`
and `head.weight`, models/gpt.py): the tied matrix would be averaged twice per update, at decay**2, half the
horizon `train.ema_decay` asks for. timm's `exclude_buffers=True` walks the de-duplicated `parameters()` but copies
the buffers, so a BatchNorm model's EMA would be scored with the raw model's running statistics. `ModelEma` walks
the de-duplicated `parameters()` and `buffers()` and treats them as timm's default does: floating tensors are
averaged, integer ones (BatchNorm's `num_batches_tracked`) copied. The average is torch's foreach lerp, as timm's own
update makes it for fp32 weights: timm's `_foreach_lerp_` helper (newer releases) is not in timm 1.0.15 to 1.0.28,
which requirements.txt admits.
"""
from __future__ import annotations

from typing import Optional

import torch
from timm.utils import ModelEmaV3
from torch import nn

from configs.schema import TrainConfig


class ModelEma(ModelEmaV3):
    """timm's ModelEmaV3 over each parameter and buffer once; kept on the model's device (no `device`), as the
    single foreach update needs."""

    @torch.no_grad()
    def apply_update_(self, model: nn.Module, decay: float) -> None:
        ema_values = [*self.module.parameters(), *self.module.buffers()]
        model_values = [*model.parameters(), *model.buffers()]
        pairs = list(zip(ema_values, model_values, strict=True))
        for e, m in pairs:
            if not e.is_floating_point():
                e.copy_(m)
        averaged = [(e, m) for e, m in pairs if e.is_floating_point()]
        torch._foreach_lerp_([e for e, _ in averaged], [m for _, m in averaged], weight=1.0 - decay)


def build_ema(model: nn.Module, cfg: TrainConfig) -> Optional[ModelEma]:
    """The EMA of `model` (not wrapped) that `cfg.ema` asks for, or None."""
    if not cfg.ema:
        return None
    return ModelEma(model, decay=cfg.ema_decay, use_warmup=cfg.ema_warmup)
