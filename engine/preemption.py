"""SIGTERM handling: cluster schedulers send SIGTERM before preempting a job.

The handler only sets a flag; the training loop checks it between optimizer updates (all ranks agree
through one all-reduce of a flag), writes a checkpoint and exits cleanly. Re-running the same command
resumes from that checkpoint.
"""
from __future__ import annotations

import signal

import torch

from .distributed import all_reduce


class Preemption:
    def __init__(self, device: torch.device, signals=(signal.SIGTERM,)):
        self.requested = False
        self.device = device
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def should_stop(self) -> bool:
        """True on every rank once any rank has received the signal (a collective call under DDP)."""
        flag = torch.tensor([float(self.requested)], device=self.device)
        return bool(all_reduce(flag, op="max").item())

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
