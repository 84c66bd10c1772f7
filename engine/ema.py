"""The EMA of the weights (`train.ema`): timm's ModelEmaV3, averaging each parameter once per update.

timm's default walks `state_dict()`, which lists a tied parameter under each of its names (GPT's `wte.weight`
and `head.weight`, models/gpt.py): the tied matrix was then averaged twice per update, at decay**2, half the
horizon `train.ema_decay` asks for. `exclude_buffers=True` walks the de-duplicated `parameters()` instead and
copies the buffers (a ViT's or GPT's are constants, so averaging them changed nothing).
"""
from __future__ import annotations

from typing import Optional

from timm.utils import ModelEmaV3
from torch import nn

from configs.schema import TrainConfig


def build_ema(model: nn.Module, cfg: TrainConfig) -> Optional[ModelEmaV3]:
    """The EMA of `model` (not wrapped) that `cfg.ema` asks for, or None."""
    if not cfg.ema:
        return None
    return ModelEmaV3(model, decay=cfg.ema_decay, use_warmup=cfg.ema_warmup, exclude_buffers=True)
