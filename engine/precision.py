"""Mixed precision from one setting: `none`, `fp16` (autocast + GradScaler) or `bf16` (autocast only); and TF32 for
the float32 matmuls and convolutions CUDA runs (`set_tf32`, train.tf32).

timm and DeiT create a GradScaler only for float16; bf16 has fp32's range and needs none.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Optional

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


def set_tf32(enabled: bool) -> None:
    """TF32 for CUDA's float32 matmuls (cuBLAS) and cuDNN's convolutions on (timm's training) or off: full float32
    precision (torch.get_float32_matmul_precision() reads 'highest'). Only torch's CUDA switches are written, so a
    CPU computes the same either way: torch.set_float32_matmul_precision('high') would set oneDNN's CPU matmuls to
    TF32 too (torch.backends.mkldnn.matmul.fp32_precision). Through the legacy flags, as train.py always set them
    (torch >= 2.9's fp32_precision API is another view of the same switches; `tf32_state` reads either)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def _reads_tf32(read_legacy, backend) -> bool:
    """Whether a TF32 switch is on: its legacy flag (`read_legacy()`), or, where a caller set torch >= 2.9's
    fp32_precision and the legacy read refuses to answer (RuntimeError), that setting of `backend`."""
    try:
        return bool(read_legacy())
    except RuntimeError:
        return getattr(backend, "fp32_precision", "") == "tf32"


def tf32_state() -> tuple[bool, bool]:
    """(matmuls, convolutions): whether CUDA runs float32 matmuls and cuDNN convolutions at TF32 now."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    return (_reads_tf32(lambda: matmul.allow_tf32, matmul),
            _reads_tf32(lambda: cudnn.allow_tf32, getattr(cudnn, "conv", cudnn)))


def describe_tf32() -> str:
    """What CUDA's float32 math runs at, in words, from torch's switches as they stand (e.g. "fp32 matmuls and
    convolutions at TF32"; torch's own defaults, which evaluate.py leaves, are matmuls at full precision and
    convolutions at TF32)."""
    matmuls, convolutions = tf32_state()
    at = {True: "at TF32", False: "at full fp32 precision"}
    if matmuls == convolutions:
        return f"fp32 matmuls and convolutions {at[matmuls]}"
    return f"fp32 matmuls {at[matmuls]}, convolutions {at[convolutions]}"


def describe_precision(mode: str, device: torch.device, key: str = "train.amp", scaler: bool = True,
                       tf32: Optional[str] = None) -> str:
    """The precision a run uses, in words, for its log; warns when `mode` is fp16 on a CPU, where autocast
    runs several times slower than fp32 (CPUs have no fast fp16 matrix units), e.g. a GPU recipe's fp16
    inherited by a CPU run. Applied as asked (the CPU tests check the fp16 path), never switched silently.
    scaler: whether fp16 comes with a GradScaler (training does; an evaluation computes no gradients).
    tf32: where given, a CUDA device's line also says what its float32 matmuls and convolutions run at
    (`describe_tf32`: autocast leaves the ops it does not cast, and all of them under `none`, in float32), naming
    `tf32` among the settings when it is not '' (train.py: 'train.tf32=true'; evaluate.py sets no switch: '').
    A CPU has no TF32: its line is the same either way."""
    if mode == "fp16" and device.type == "cpu":
        log.warning("%s=fp16 on the CPU: fp16 autocast runs several times slower than fp32 there; set "
                    "%s=none (fp32) or bf16 unless you are testing the fp16 path", key, key)
    what = {"none": "fp32 (no autocast)", "fp16": "fp16 autocast" + (" with a GradScaler" if scaler else ""),
            "bf16": "bf16 autocast"}[mode]
    where, settings = device.type, f"{key}={mode}"
    if tf32 is not None and device.type == "cuda":
        where += f", {describe_tf32()}"
        settings += f", {tf32}" if tf32 else ""
    return f"precision: {what} on {where} ({settings})"
