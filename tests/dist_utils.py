"""Helpers for the multi-process tests: a free loopback port and joining a gloo process group."""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: int = 120) -> None:
    """Join a CPU (gloo) process group on loopback, one torch thread per process (2-core machines)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)


def leave_and_exit() -> None:
    """End a spawned test worker that succeeded: leave the group together, then exit without interpreter
    finalization. Why: gloo's worker thread can drop its last reference to a finished collective (whose
    tensors are Python objects) while the interpreter finalizes; taking the GIL then ends the thread
    and C++ aborts the process ("terminate called without an active exception", seen about once in ten
    runs of torch 2.14 on a loaded 2-core machine, with a core dump showing exactly that)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)


def spawn_within(fn, args: tuple, nprocs: int, seconds: float) -> None:
    """mp.spawn(fn, args, nprocs) that fails the test when the ranks have not all ended after `seconds` (a rank
    left waiting in a collective), killing them, instead of stalling the suite until the group's timeout."""
    import time

    import pytest
    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + seconds
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the ranks did not end within {seconds} s: one is left waiting for another")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def stay_until_all_recorded(work: str, world: int, seconds: float = 120.0) -> None:
    """Keep a rank that finished (or failed) alive until every rank wrote `work`/rank<r>.pt, then end it without
    a group teardown: as a failed rank on another node stays reachable while the others wait for it (a rank
    that exits early would end their waits with a closed connection, hiding a wait that never ends)."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(work, f"rank{r}.pt")) for r in range(world)):
        time.sleep(0.1)
    os._exit(0)
