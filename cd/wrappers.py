"""The model behind DDP / torch.compile wrappers and the torch optimizer behind a framework's optimizer wrapper
(CD, TWEO, the integrations and the training code share these definitions)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP/DataParallel-style wrappers (`.module`) and torch.compile (`._orig_mod`), in any order.

    A wrapper is recognised by its only child being called `module` (DDP, DataParallel, FSDP-style
    wrappers) or by an `_orig_mod` attribute (torch.compile's OptimizedModule).
    """
    while True:
        orig = getattr(model, "_orig_mod", None)
        if isinstance(orig, nn.Module):
            model = orig
            continue
        children = dict(model.named_children())
        if list(children) == ["module"]:
            model = children["module"]
            continue
        return model


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (accelerate's `AcceleratedOptimizer`, Lightning's
    `LightningOptimizer`, MMEngine's `OptimWrapper`): the object whose `step()` really updates the weights.
    accelerate's wrapper subclasses `torch.optim.Optimizer` without its state, so it is looked through too.

    Raises:
        TypeError: no torch.optim.Optimizer is found.
    """
    if isinstance(optimizer, torch.optim.lr_scheduler.LRScheduler):  # it holds an optimizer too: a likely mix-up
        raise TypeError(f"CD needs a torch.optim.Optimizer, got {type(optimizer).__name__} (an lr scheduler); "
                        "pass the optimizer")
    seen = 0
    while seen < 8:
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer, seen = inner, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"CD needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer
