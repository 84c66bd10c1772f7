"""Helpers that make device bugs visible on a CPU-only machine.

Under `torch.device("meta")` as the default device, every tensor created without an explicit device is
a meta tensor, and the first operation that mixes it with real data fails. Code that passes with a CPU
model under that default creates its tensors on the device of the data they belong to, which is what
keeps it working on CUDA. Data loading is not under test: `OnCPU` and `cpu_pipeline_data` produce their
batches outside the meta default, as a DataLoader's worker processes would.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch.utils.data import DataLoader, TensorDataset

from engine.loop import TrainBatches
from quant import PipelineData


class OnCPU:
    """Iterate `loader` with CPU as the default device, whatever the caller's default is."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        with torch.device("cpu"):
            batches = iter(self.loader)
        while True:
            with torch.device("cpu"):
                try:
                    batch = next(batches)
                except StopIteration:
                    return
            yield batch


class _FixedOrder:
    def set_epoch(self, epoch: int, start: int = 0) -> None:
        pass


def cpu_pipeline_data(num_images: int = 32, img_size: int = 32, num_classes: int = 10) -> PipelineData:
    """A PipelineData of seeded random CPU images (APHQ / GPLQ draw their own training data from it)."""

    def train_images(count: int, seed: int, train_transform: bool) -> torch.Tensor:
        g = torch.Generator(device="cpu").manual_seed(seed)
        return torch.randn(count, 3, img_size, img_size, generator=g, device="cpu")

    x = train_images(num_images, 123, False)
    y = torch.arange(num_images, device="cpu") % num_classes

    def train_loader(batch_size_per_gpu: int, seed: int) -> TrainBatches:
        loader = DataLoader(TensorDataset(x, y), batch_size=batch_size_per_gpu, drop_last=True)
        return TrainBatches(OnCPU(loader), _FixedOrder())

    return PipelineData(train_images=train_images, train_loader=train_loader, work_prefix=None)


def tensors_of(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and buffer of `module`."""
    return list(module.named_parameters()) + list(module.named_buffers())


class HostCopies(torch.overrides.TorchFunctionMode):
    """Counts the tensors made from host data (`torch.tensor`, `torch.as_tensor`, `Tensor.new_tensor`) while
    active. On CUDA each such tensor is a blocking host-to-device copy, which waits for all queued work (a
    host sync); code that should never wait in a loop makes none per iteration."""

    FUNCTIONS = (torch.tensor, torch.as_tensor, torch.Tensor.new_tensor)

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FUNCTIONS:
            self.count += 1
        return func(*args, **(kwargs or {}))


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the reads of tensor values by the host (`item`, `tolist`, `int` / `float` / `bool` / index of a
    tensor) while active. On CUDA each is a host sync: code that should not wait per iteration makes a number
    of them that does not grow with its iterations."""

    NAMES = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            self.count += 1
        return func(*args, **(kwargs or {}))


class HostSyncsRaise(torch.overrides.TorchFunctionMode):
    """The CPU stand-in for `torch.cuda.set_sync_debug_mode("error")`: while armed, a tensor made from host data
    (HostCopies.FUNCTIONS) or a read of a tensor's value by the host (HostReads.NAMES), each a host sync on CUDA,
    raises RuntimeError naming it. What torch does in C++ (a blocking copy inside an op, nonzero) is not seen
    here: the CUDA case's debug mode sees that."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.armed and (func in HostCopies.FUNCTIONS or name in HostReads.NAMES):
            raise RuntimeError(f"a host sync ({name}) where none may happen")
        return func(*args, **(kwargs or {}))


def adam_step_follows_default_device() -> bool:
    """Whether torch's Adam / AdamW create their `step` state on the default device.

    Non-fused, non-capturable Adam keeps `step` on the CPU on purpose. torch 2.11 builds it with
    `torch.tensor(0.0, dtype=...)`, no device given, so under the meta default it is a meta tensor and the
    first `step.item()` fails inside torch; torch 2.14 passes device="cpu". That is torch's tensor, not one of
    this code's, so `adam_step_on_cpu` (tests/conftest.py) builds it on the CPU where torch does not."""
    p = torch.zeros(1, device="cpu", requires_grad=True)
    p.grad = torch.zeros(1, device="cpu")
    opt = torch.optim.Adam([p])
    with torch.device("meta"):
        try:
            opt.step()
        except RuntimeError:
            return True
    return opt.state[p]["step"].device.type != "cpu"
