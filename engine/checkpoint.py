"""Checkpoint I/O: atomic writes, unwrapped state dicts, clear errors on bad files.

A checkpoint is a dict of tensors and plain Python data (loadable with `weights_only=True`). It is
first written to a temporary file in the same folder, flushed to disk, then renamed over the old one,
so a crash or preemption mid-write never destroys the previous checkpoint.
"""
from __future__ import annotations

import os

import torch

from cd.pairs import unwrap_model  # the one definition; cd/ stays a standalone package

__all__ = ["CheckpointError", "unwrap_model", "save_atomic", "load_checkpoint", "training_payload",
           "restore_training"]


class CheckpointError(ValueError):
    """A missing, unreadable or incompatible checkpoint."""


def save_atomic(payload: dict, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str) -> dict:
    """Read a checkpoint written by this code base (with its `config` and `model` entries)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    if not isinstance(payload, dict) or "model" not in payload or "config" not in payload:
        raise CheckpointError(f"{path} is not a checkpoint of this code base (no 'model'/'config' entries); "
                              f"for plain weights files use model.pretrained={path}")
    return payload


def training_payload(*, model, optimizer, state, config: dict, ema=None, scaler=None, scheduler=None,
                     extra: dict | None = None) -> dict:
    """Everything an exact resume needs; the model's state dict is taken from the unwrapped module."""
    payload = {
        "model": unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "state": state.state_dict(),
        "config": config,
    }
    if ema is not None:
        payload["model_ema"] = ema.module.state_dict()
    if scaler is not None:
        payload["scaler"] = scaler.state_dict()
    if scheduler is not None:
        payload["scheduler"] = scheduler.state_dict()
    payload.update(extra or {})
    return payload


def restore_training(payload: dict, *, model, optimizer, state, ema=None, scaler=None, scheduler=None) -> None:
    """Load a `training_payload` into freshly built objects (in place)."""
    unwrap_model(model).load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    for key, value in payload["state"].items():
        setattr(state, key, value)
    for name, obj in (("model_ema", ema and ema.module), ("scaler", scaler), ("scheduler", scheduler)):
        if obj is None:
            continue
        if name not in payload:
            raise CheckpointError(f"the checkpoint has no '{name}' state but this run uses one; resume with the "
                                  f"settings it was written with (see config.yaml next to it)")
        obj.load_state_dict(payload[name])
