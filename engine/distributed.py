"""Process-group setup for `torchrun` (single or multi-node) and plain single-process runs.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_ADDR / MASTER_PORT); without them the run is a
single process. NCCL on CUDA, gloo on CPU (so tests can run two CPU processes).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the process group torchrun describes (if any) and pick this process's device."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                device_id=dev if use_cuda else None)
    return DistInfo(rank, world, local_rank, dev)


def cleanup_distributed(wait_for_all: bool = True) -> None:
    """Leave the process group. `wait_for_all`: first wait until every rank is done (a rank that tears its
    group down while another still talks to it can abort the process at exit: "terminate called without
    an active exception" with gloo); False on error paths, where another rank may never arrive."""
    if dist.is_initialized():
        if wait_for_all:
            barrier()
        dist.destroy_process_group()


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce when a process group exists; identity otherwise."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In-place broadcast from rank `src` when a process group exists; identity otherwise.

    Used to make results that every rank computes redundantly (e.g. a PTQ pipeline run on each rank)
    bit-identical across ranks, whatever non-determinism the kernels have.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tensor, src=src)
    return tensor


def raise_on_every_rank(error: Optional[BaseException], device: torch.device,
                        elsewhere: Callable[[], BaseException]) -> None:
    """After work that only some ranks did (e.g. rank 0 writing a checkpoint): if it failed anywhere, every
    rank raises (the failing rank its own `error`, the others `elsewhere()`), instead of the others waiting
    at the next collective until it times out. One all-reduce; a no-op without a process group."""
    failed = all_reduce(torch.tensor([float(error is not None)], device=device), op="max")
    if error is not None:
        raise error
    if failed.item():
        raise elsewhere()
