"""Mixed precision from one setting: `none`, `fp16` (autocast + GradScaler) or `bf16` (autocast only).

timm and DeiT create a GradScaler only for float16; bf16 has fp32's range and needs none.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

log = logging.getLogger(__name__)

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


def describe_precision(mode: str, device: torch.device, key: str = "train.amp", scaler: bool = True) -> str:
    """The precision a run uses, in words, for its log; warns when `mode` is fp16 on a CPU, where autocast
    runs several times slower than fp32 (CPUs have no fast fp16 matrix units), e.g. a GPU recipe's fp16
    inherited by a CPU run. Applied as asked (the CPU tests check the fp16 path), never switched silently.
    scaler: whether fp16 comes with a GradScaler (training does; an evaluation computes no gradients)."""
    if mode == "fp16" and device.type == "cpu":
        log.warning("%s=fp16 on the CPU: fp16 autocast runs several times slower than fp32 there; set "
                    "%s=none (fp32) or bf16 unless you are testing the fp16 path", key, key)
    what = {"none": "fp32 (no autocast)", "fp16": "fp16 autocast" + (" with a GradScaler" if scaler else ""),
            "bf16": "bf16 autocast"}[mode]
    return f"precision: {what} on {device.type} ({key}={mode})"
