"""Mixed precision from one setting: `none`, `fp16` (autocast + GradScaler) or `bf16` (autocast only).

timm and DeiT create a GradScaler only for float16; bf16 has fp32's range and needs none.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def autocast(mode: str, device: torch.device):
    """The forward-pass context for `mode` on `device`."""
    if mode == "none":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[mode])


def grad_scaler(mode: str, device: torch.device):
    """A GradScaler for fp16, None otherwise."""
    if mode != "fp16":
        return None
    return torch.amp.GradScaler(device.type)
