"""The model behind DDP / torch.compile wrappers (CD, TWEO and the training code share this definition)."""
from __future__ import annotations

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
