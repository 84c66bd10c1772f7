"""Helpers for the multi-process tests: starting ranks, a free loopback port and joining a gloo process group."""
from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.forkserver
import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_torchrun_rank(rank: int, world: int, port: int) -> None:
    """Set the variables torchrun gives a rank on loopback (the entry points join the group from them) and one
    torch thread per process (2-core machines)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)


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


# What every rank imports, loaded once per test process by the fork server the ranks start from. A spawned rank
# imported torch, timm and the engine itself: about 7 s of CPU per rank on a 2-core VM, most of a two-rank test's
# time (docs/measurements.md, the suite's time).
RANK_PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "timm", "train", "evaluate"]
# The environment as the test session started: the fork server keeps the one it starts with (its ranks get the
# current one from _rank_main), so it starts from this one, not from whatever the first test that needs it set.
_SESSION_ENVIRON = dict(os.environ)
_fork_server_started = False


def _ensure_fork_server() -> None:
    """Start this process's fork server once, preloaded and in the session's environment (torch's start_processes
    then finds it running)."""
    global _fork_server_started
    if _fork_server_started:
        return
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    current = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SESSION_ENVIRON)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(current)
    _fork_server_started = True


def _rank_main(rank: int, fn, args: tuple, environ: dict) -> None:
    # as a spawned process would: the starting test's environment (a forked rank has the fork server's)
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)


def start_ranks(fn, args: tuple, nprocs: int):
    """Start fn(rank, *args) in `nprocs` processes, as torch.multiprocessing.spawn(join=False) does, but forked
    from a server that has imported RANK_PRELOAD once: each starts in a fraction of a second instead of importing
    torch and timm again. Each sees the environment and working directory of the test that starts it, as a
    spawned process does; its stdout and stderr are the test process's at the server's start (the ranks of these
    tests report through files and the exception that join() raises, which holds the rank's traceback)."""
    import torch.multiprocessing as mp

    _ensure_fork_server()
    return mp.start_processes(_rank_main, args=(fn, args, dict(os.environ)), nprocs=nprocs, join=False,
                              start_method="forkserver")


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs, join=True), the ranks started by start_ranks: raises a rank's
    exception (with its traceback) or its exit code when one fails."""
    context = start_ranks(fn, args, nprocs)
    while not context.join():
        pass


def save_outcome_and_exit(work: str, rank: int, outcome: tuple) -> None:
    """End a rank of run_for_outcomes: write its (kind, value) outcome for the test to read, then leave the group
    together when it succeeded, or exit at once when it failed (the other rank may have left already: no group
    teardown together)."""
    torch.save(outcome, os.path.join(work, f"outcome_rank{rank}.pt"))
    if outcome[0] == "ok":
        leave_and_exit()
    os._exit(0)


def run_for_outcomes(worker, world: int, work, argv: list) -> list:
    """Each rank's outcome (as save_outcome_and_exit wrote it) of `worker(rank, world, port, argv, work)` run on
    `world` ranks."""
    os.makedirs(work, exist_ok=True)
    spawn_ranks(worker, (world, free_port(), argv, str(work)), world)
    return [torch.load(os.path.join(work, f"outcome_rank{r}.pt"), weights_only=False) for r in range(world)]


def spawn_within(fn, args: tuple, nprocs: int, seconds: float) -> None:
    """spawn_ranks that fails the test when the ranks have not all ended after `seconds` (a rank left waiting in
    a collective), killing them, instead of stalling the suite until the group's timeout."""
    import time

    import pytest

    context = start_ranks(fn, args, nprocs)
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
