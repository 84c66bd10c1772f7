"""Preemption: SIGTERM / SIGINT become a stop at an update boundary that every rank agrees on.

Cluster schedulers (SLURM preemption, `scancel`, `timeout`, `kill -TERM -- -PGID`) send SIGTERM to every
process of the job, DataLoader workers and torchrun included; Ctrl-C sends SIGINT to the whole
foreground process group. The rule:

* the main process of each rank only records the request (`Preemption`); the training loop asks
  `should_stop(step)` after every optimizer update and at epoch ends, writes checkpoint.pt and returns,
  so the process exits with code 0 and the same command resumes;
* under DDP the ranks agree through one all-reduce of the flag, every `agree_every` updates (a tiny
  collective and a host sync, so not every update) and at every epoch end, so all ranks stop at the
  same update whichever of them got the signal;
* DataLoader workers ignore both signals unless their own main process sends them
  (`ignore_stop_signals`, their `worker_init_fn`): a worker killed by the scheduler's SIGTERM would turn
  the request into a crash of the main process. They end with the loader (and exit by themselves if the
  main process dies);
* repeated signals within `repeat_window_s` of the first are the same request (torchrun forwards the
  signal it received to its workers, which then see it twice); a later SIGINT raises KeyboardInterrupt
  at once (a second Ctrl-C means "now"), a later SIGTERM is ignored.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch

from .distributed import all_reduce

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader `worker_init_fn`: workers leave SIGTERM / SIGINT to the main process.

    SIGINT is ignored outright. SIGTERM cannot be: the main process ends its workers with SIGTERM too
    (multiprocessing's exit handler, DataLoader's shutdown), and a worker deaf to it would hang the main
    process at exit. So SIGTERM is blocked and a watcher thread takes it with `sigwaitinfo`, which names
    the sender: from the parent, the worker exits (as torch's own handler does); from anyone else (a
    scheduler signalling the process group), it is ignored. Threads started later inherit the block.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_exit_on_parents_sigterm, args=(os.getppid(),), name="sigterm-watcher",
                     daemon=True).start()


def _exit_on_parents_sigterm(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent:
            os._exit(0)


class Preemption:
    """Records SIGTERM / SIGINT and decides, the same on every rank, when training stops.

    Args:
        device: the device of this rank's collectives (the flag tensor lives there).
        distributed: whether ranks must agree through an all-reduce.
        agree_every: under DDP, updates between two agreements (0 at epoch ends always).
        repeat_window_s: signals this soon after the first count as the same request.
    """

    def __init__(self, device: torch.device, distributed: bool = False, agree_every: int = 10,
                 repeat_window_s: float = 2.0) -> None:
        self.device, self.distributed = device, distributed
        self.agree_every, self.repeat_window_s = agree_every, repeat_window_s
        self.requested = False
        self.first_signal_at: float | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self.first_signal_at is None:
            self.first_signal_at = now
            self.requested = True
            log.warning("received %s: stopping at the next update boundary and writing checkpoint.pt",
                        signal.Signals(signum).name)
        elif signum == signal.SIGINT and now - self.first_signal_at > self.repeat_window_s:
            self.restore()
            raise KeyboardInterrupt("second interrupt: stopping now, without a new checkpoint")

    def should_stop(self, step: int, boundary: bool = False) -> bool:
        """True once a stop was requested on any rank; the same answer on every rank.

        Args:
            step: optimizer updates done (DDP: ranks agree only every `agree_every` updates).
            boundary: an epoch end (or other point where every rank calls this): always agree here.
        """
        if not self.distributed:
            return self.requested
        if not boundary and step % self.agree_every:
            return False
        flag = torch.tensor([float(self.requested)], device=self.device)
        return bool(all_reduce(flag, op="max").item())

    def restore(self) -> None:
        """Put back the signal handlers that were there before (idempotent)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def __enter__(self) -> "Preemption":
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
