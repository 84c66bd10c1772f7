"""BatchNorm running statistics under DDP: one set on every rank before a validation scores the model.

DDP copies rank 0's buffers into the other ranks at the start of each forward (`broadcast_buffers`), and each rank
then updates them from its own batch: after the last training forward every rank holds its own running mean and
variance. The EMA of the weights (engine/ema.py) averages each rank's own buffers, so its statistics differ by rank
too. Validated as they are, each rank would score its shard with its own statistics (val/* and val_ema/* a mix of
models), while checkpoint.pt and best.pt keep rank 0's: the saved weights would be none of those scored.
"""
from __future__ import annotations

from typing import Optional

from timm.utils import distribute_bn
from torch import nn

from engine.distributed import world_size


def average_running_stats(model: nn.Module, ema: Optional[object] = None) -> None:
    """Average the running statistics (buffers named running_mean / running_var) of `model` and of `ema.module` (a
    ModelEma, or None) over the ranks, in place; before a validation, so that every rank scores the same weights
    and the checkpoint written after it holds them. A no-op in one process and for a model without such buffers
    (a ViT: no collective either), on every rank alike (the ranks hold the same model).

    The mean (timm train.py's default, `--dist-bn reduce`) rather than rank 0's copy (`broadcast`): the ranks'
    statistics differ only by the batches each saw since DDP last gave them rank 0's, and since each update is a
    linear interpolation, their mean is those statistics updated with the mean of all ranks' batch statistics,
    where rank 0's copy would reflect its own shard alone. The EMA's buffers are linear in the model's,
    so their mean is the EMA of the averaged statistics. timm's `distribute_bn` all-reduces each buffer on the
    default group, in place where it lies: CPU tensors with gloo, the rank's GPU with NCCL."""
    world = world_size()
    if world == 1:
        return
    for module in (model, None if ema is None else ema.module):
        if module is not None:
            distribute_bn(module, world, reduce=True)
