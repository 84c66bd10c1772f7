"""engine.distributed.run_on_main with 2 real gloo processes: the work runs once, on rank 0; every rank
gets its result (GPU tensors on its own device, CPU tensors on the CPU); an error on rank 0, a wait past
the limit, or ranks that wait for different work, reach the other rank as one OtherRankError naming the
work (and the setting that sets the limit)."""
from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
from torch import nn

from dist_utils import free_port, spawn_ranks


def _join(rank: int, port: int, wait_s: float) -> None:
    """Join through init_distributed, as torchrun's environment would have it (the real path)."""
    from engine.distributed import MainRankWait, init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    init_distributed("cpu", MainRankWait(datetime.timedelta(seconds=wait_s), "quant.main_rank_wait_hours"))


def _result_case(rank: int, work: str) -> None:
    """Two calls of run_on_main; each rank saves what it got in `work`/rank<r>.pt."""
    from engine.distributed import run_on_main

    torch.manual_seed(rank)  # the ranks' own modules differ: only rank 0's may come back
    layer = nn.Linear(3, 2)

    def work_fn():
        open(os.path.join(work, f"ran_on_{rank}"), "w").close()
        return layer, {"note": "from rank 0", "values": torch.arange(4, device="cpu")}

    # CPU tensors for gloo are made with an explicit device: under a meta default device a forgotten one
    # would be a meta tensor that gloo cannot send
    torch.set_default_device("meta")
    try:
        got, report = run_on_main(work_fn, "a test job", torch.device("cpu"))
        on_meta = run_on_main(lambda: layer, "a second test job",
                              torch.device("meta") if rank == 1 else torch.device("cpu"))
    finally:
        torch.set_default_device("cpu")
    torch.save({"weight": got.weight.detach().clone(), "own_weight": layer.weight.detach().clone(),
                "report": report, "device": str(on_meta.weight.device)}, os.path.join(work, f"rank{rank}.pt"))


def test_work_runs_once_on_rank_0_and_every_rank_gets_its_result(shared):
    result = shared / "result"
    assert os.path.exists(result / "ran_on_0") and not os.path.exists(result / "ran_on_1")
    rank0, rank1 = _load(result)
    assert not torch.equal(rank1["own_weight"], rank0["own_weight"])  # the check below can fail
    assert torch.equal(rank1["weight"], rank0["own_weight"])
    assert rank1["report"]["note"] == "from rank 0" and torch.equal(rank1["report"]["values"], torch.arange(4))
    # rank 0 held it on the CPU: it stays there, whatever the receiving rank's device (see the next test)
    assert rank1["device"] == "cpu" and rank0["device"] == "cpu"


def test_what_rank_0_held_on_a_gpu_arrives_on_the_receiving_ranks_device():
    from engine.distributed import onto

    # the map_location run_on_main loads with; meta stands in for the receiving rank's GPU (CI has none)
    storage = torch.arange(4.0).untyped_storage()
    assert onto(torch.device("meta"))(storage, "cuda:0").device.type == "meta"
    assert onto(torch.device("meta"))(storage, "cuda:3").device.type == "meta"
    assert onto(torch.device("meta"))(storage, "cpu") is storage


def _error_case(rank: int, work: str, rank0_sleeps: float, fails: bool) -> None:
    """One call of run_on_main whose work sleeps, fails or returns on rank 0; each rank saves its outcome in
    `work`/rank<r>.pt."""
    from engine.distributed import OtherRankError, run_on_main

    def work_fn():
        if rank0_sleeps:
            time.sleep(rank0_sleeps)
            return "late"
        if fails:
            raise ValueError("the disk is on fire")
        return "written"

    # a rank that took another path through the program waits for other work than rank 0 does
    what = "writing results.json" if fails or rank == 0 else "writing other.json"
    start = time.monotonic()
    try:
        run_on_main(work_fn, what, torch.device("cpu"))
        outcome = ("returned", "")
    except (ValueError, OtherRankError, RuntimeError) as e:
        outcome = (type(e).__name__, str(e))
    torch.save({"outcome": outcome, "seconds": time.monotonic() - start}, os.path.join(work, f"rank{rank}.pt"))


def _error_worker(rank: int, port: int, work: str, wait_s: float, rank0_sleeps: float, fails: bool) -> None:
    _join(rank, port, wait_s)
    _error_case(rank, work, rank0_sleeps, fails)
    os._exit(0)  # a rank may have given up on the other: no group teardown together


def _shared_worker(rank: int, port: int, work: str) -> None:
    """The cases that leave the ranks in step, one after another in one group (a spawn each imports torch
    twice again: seconds): the result, an error on rank 0, ranks waiting for other work."""
    _join(rank, port, wait_s=120)
    _result_case(rank, os.path.join(work, "result"))
    _error_case(rank, os.path.join(work, "error"), rank0_sleeps=0, fails=True)
    _error_case(rank, os.path.join(work, "other work"), rank0_sleeps=0, fails=False)
    os._exit(0)  # rank 1 failed the last case on its own: no group teardown together


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The folder of _shared_worker's cases: result/, error/, other work/."""
    work = tmp_path_factory.mktemp("run_on_main")
    for case in ("result", "error", "other work"):
        os.makedirs(work / case)
    spawn_ranks(_shared_worker, (free_port(), str(work)), 2)
    return work


def _load(folder) -> tuple:
    return tuple(torch.load(folder / f"rank{r}.pt", weights_only=False) for r in (0, 1))


def _outcomes(tmp_path, wait_s: float, rank0_sleeps: float, fails: bool = True) -> tuple:
    spawn_ranks(_error_worker, (free_port(), str(tmp_path), wait_s, rank0_sleeps, fails), 2)
    return _load(tmp_path)


def test_an_error_on_rank_0_reaches_the_other_rank(shared):
    rank0, rank1 = _load(shared / "error")
    assert rank0["outcome"] == ("ValueError", "the disk is on fire")
    kind, message = rank1["outcome"]
    assert kind == "OtherRankError"
    assert message == "rank 0 failed writing results.json: ValueError: the disk is on fire"


def test_a_rank_waiting_for_other_work_fails_instead_of_taking_rank_0s_result(shared):
    rank0, rank1 = _load(shared / "other work")
    assert rank0["outcome"] == ("returned", "")
    kind, message = rank1["outcome"]
    assert kind == "OtherRankError"
    assert message == ("rank 1 waited for rank 0 to finish writing other.json, but rank 0 sent the result of "
                       "writing results.json: the ranks disagree on the work (each must take the same steps)")


@pytest.mark.slow
def test_a_rank_that_waits_past_the_limit_gives_up_naming_the_setting(tmp_path):
    rank0, rank1 = _outcomes(tmp_path, wait_s=1, rank0_sleeps=5)
    kind, message = rank1["outcome"]
    assert kind == "OtherRankError", message
    assert "rank 1 waited 0:00:01 for rank 0 to finish writing results.json" in message
    assert "raise quant.main_rank_wait_hours" in message
    # that message comes only from the wait limit (a rank 0 that had sent in time would have given rank 1
    # its result): no wall-clock bound, which a busy machine could break
    assert rank0["outcome"][0] in ("returned", "RuntimeError")  # nobody left to receive it


def test_without_a_process_group_the_work_just_runs():
    from engine.distributed import run_on_main

    calls = []
    assert run_on_main(lambda: calls.append(1) or "done", "a job", torch.device("cpu")) == "done"
    assert calls == [1]
