"""process_group (engine/distributed.py) ends the process group's threads when its body ends or raises: a
finished TrainLoop does not keep its DDP wrapper (and so the group) alive in a reference cycle with its
optimizer.

Why it matters: gloo's worker threads that outlive destroy_process_group run into interpreter finalization,
where one that drops its last collective's tensors needs the GIL and aborts the process ("terminate called
without an active exception", SIGABRT: 3 of 110 two-process CPU torchrun runs of train.py on a 2-core VM with a
busy process beside them; docs/measurements.md). The abort itself is a race; the threads left running are its
deterministic precondition, counted here. Nor does a run_on_main call whose work left cyclic garbage behind
(matplotlib's mathtext parser does: pyparsing keeps a caught exception whose traceback holds the parser's frame,
and a finished frame object holds its callers' frames) keep the group alive until the next collection."""
from __future__ import annotations

import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_utils import as_torchrun_rank, free_port, spawn_ranks

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")


def gloo_threads() -> int:
    """This process's threads that gloo started (named pt_gloo_runloop, gloo_tcp_loop)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended while listed
            pass
    return sum("gloo" in name for name in names)


def train_a_step(fail: bool, threads: list) -> None:
    """One DDP update through a TrainLoop (whose step hook made a loop <-> optimizer cycle that kept the wrapper
    alive after the run); with `fail`, an error raised from here keeps them in the traceback's frame instead.
    Appends the gloo threads running to `threads`."""
    from engine.loop import TrainLoop
    ddp = DDP(torch.nn.Linear(4, 2))
    loop = TrainLoop(model=ddp, optimizer=torch.optim.SGD(ddp.parameters(), lr=0.1),
                     compute_loss=lambda m, x, y: m(x).sum(), device=torch.device("cpu"))
    ddp(torch.randn(3, 4)).sum().backward()  # a gradient all-reduce, as in training
    loop.optimizer.step()
    threads.append(gloo_threads())
    if fail:
        raise RuntimeError("diverged")


def leave_cyclic_garbage(threads: list) -> int:
    """Work that leaves a reference cycle through its own frame, as pyparsing's MatchFirst does under
    matplotlib: the caught exception is kept in a local, its traceback holds the frame. Once the frame has
    returned, its frame object holds its caller's (f_back), and so on up to run_on_main's."""
    threads.append(gloo_threads())
    try:
        raise ValueError("no match")
    except ValueError as e:
        kept = e  # noqa: F841  the cycle: frame -> kept -> kept.__traceback__ -> frame
    return 1


def _worker(rank: int, world: int, port: int, out_dir: str, fail: bool) -> None:
    """Joins as under torchrun, through the entry points' process_group, which leaves the group at the end."""
    import gc
    from engine.distributed import process_group, run_on_main
    import engine.loop  # noqa: F401  before the group, as the entry points import it
    as_torchrun_rank(rank, world, port)
    gc.disable()  # garbage stays until a collection: none runs here, as none need run before an exit
    started: list = []
    try:
        with process_group("cpu"):
            train_a_step(fail, started)
            # then work on rank 0 alone (an evaluation's plot) that leaves cyclic garbage behind
            run_on_main(lambda: leave_cyclic_garbage(started), "work", torch.device("cpu"))
    except RuntimeError:
        assert fail
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{started[0]} {gloo_threads()}")
    os._exit(0)  # this test's verdict is written; no interpreter finalization (the abort is not tested here)


@pytest.mark.slow
@pytest.mark.parametrize("fail", [False, True], ids=["finished", "failed"])
def test_no_gloo_thread_outlives_the_process_group(tmp_path, fail):
    spawn_ranks(_worker, (2, free_port(), str(tmp_path), fail), 2)
    for rank in range(2):
        started, left = map(int, (tmp_path / f"rank{rank}").read_text().split())
        assert started > 0 and left == 0, (rank, started, left)


def _teardown_worker(rank: int, ports: tuple, out_dir: str) -> None:
    """Two process_group sessions in one process, as a test runner or a notebook would: one that finishes and
    one that stops on an agreed stop request (Preempted). In each, rank 1 is still working for a second after
    rank 0's body ended; the times each rank left its body and left process_group are written down."""
    import time
    from engine.distributed import process_group, run_on_main
    from engine.preemption import Preempted
    torch.set_num_threads(1)
    times, results = {}, []
    for session, port in zip(("finished", "preempted"), ports):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                          LOCAL_RANK=str(rank))
        try:
            with process_group("cpu"):
                # rank 0's work through the wait group: the second session must get a new one
                results.append(run_on_main(lambda: session, session, torch.device("cpu")))
                if rank == 1:
                    time.sleep(1.0)
                times[f"{session} body ended"] = time.monotonic()
                if session == "preempted":
                    raise Preempted("stop request")
        except Preempted:
            pass
        times[f"{session} left"] = time.monotonic()
    torch.save({"times": times, "results": results}, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)


@pytest.mark.slow
def test_process_group_leaves_only_when_every_rank_is_done_and_can_be_entered_again(tmp_path):
    """A finished or preempted body leaves the group after the slowest rank's body ended (a rank tearing its
    group down while another still uses it can abort at exit), and a second process_group in the same process
    runs rank 0's work in a wait group of its own (the first one went with the first group)."""
    from dist_utils import spawn_within
    spawn_within(_teardown_worker, ((free_port(), free_port()), str(tmp_path)), nprocs=2, seconds=60)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for rank in (rank0, rank1):
        assert rank["results"] == ["finished", "preempted"]
    for session in ("finished", "preempted"):
        # rank 1 slept a second after rank 0's body ended: leaving before that end would be no wait at all
        assert rank1["times"][f"{session} body ended"] - rank0["times"][f"{session} body ended"] > 0.5
        assert rank0["times"][f"{session} left"] >= rank1["times"][f"{session} body ended"], session


def _failing_worker(rank: int, port: int, out_dir: str) -> None:
    """Rank 0's body raises at once; rank 1 is still working for two seconds and never reaches process_group's
    end (a rank still busy, or hung, while another failed). Each writes the time it left its body or the
    group, then stays reachable until both wrote (a rank that exits closes its connections, which would end a
    wait on it and hide it)."""
    import time
    from engine.distributed import process_group
    from dist_utils import stay_until_all_recorded
    as_torchrun_rank(rank, 2, port)
    try:
        with process_group("cpu"):
            if rank == 0:
                raise RuntimeError("diverged")
            time.sleep(2.0)
            torch.save({"body ended": time.monotonic()}, os.path.join(out_dir, "rank1.pt"))
            stay_until_all_recorded(out_dir, 2)
    except RuntimeError:
        torch.save({"left": time.monotonic()}, os.path.join(out_dir, "rank0.pt"))
    stay_until_all_recorded(out_dir, 2)


@pytest.mark.slow
def test_a_rank_whose_body_raised_leaves_the_group_without_waiting_for_the_others(tmp_path):
    """process_group's error path: another rank may never arrive at the end, so the failed rank tears its
    group down at once instead of waiting at a barrier (the finished and preempted bodies above wait)."""
    from dist_utils import spawn_within
    spawn_within(_failing_worker, (free_port(), str(tmp_path)), nprocs=2, seconds=60)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert rank0["left"] < rank1["body ended"] - 1.0  # rank 1 worked two seconds after rank 0 raised
