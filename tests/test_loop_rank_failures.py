"""engine.loop under 2 gloo processes when one rank cannot load a batch: in TrainLoop (DDP) every rank ends at
the loop's next collective (the failing rank with its own error, the other with OtherRankError), none left
waiting in the gradient all-reduce, and no checkpoint is written after the failed batch; also when the batch is
the run's first (one agreement at the run's first batch), the first of a later epoch (the last batch of the
previous one stands in) or a micro-batch inside an accumulated update; with a Preemption, the failing rank
raises its stop flag and every rank ends within two updates, with no checkpoint and no preemption; in
`evaluate` every rank ends at the all-reduce of the sums, also when a stop agreement is taken before every
batch, and a stop agreed after the failure ends it on every rank, each saying how far it got."""
from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

from dist_utils import free_port, init_gloo, spawn_within, stay_until_all_recorded

DEADLINE_S = 90  # far above a passing run (seconds), below the group's timeout (a rank left waiting)


class ListHandler(logging.Handler):
    """Keeps each record's message in `lines` (a spawned rank has no caplog)."""

    def __init__(self, lines: list) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Sampler:
    def set_epoch(self, epoch: int, start: int = 0) -> None:
        pass


class FailsAt:
    """Six batches of 4; the one at `index` raises (a worker that cannot decode an image), when set."""

    def __init__(self, rank: int, index) -> None:
        self.x = torch.randn(24, 3, generator=torch.Generator().manual_seed(rank))
        self.index = index

    def __len__(self) -> int:
        return 6

    def __iter__(self):
        for i in range(6):
            if i == self.index:
                raise OSError("cannot identify image file 'train/3/x.jpg'")
            yield self.x[4 * i:4 * i + 4], torch.zeros(4, dtype=torch.long)


def _worker(rank: int, world: int, port: int, work: str) -> None:
    init_gloo(rank, world, port, timeout_s=300)
    from engine.loop import TrainBatches, TrainLoop, TrainState

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
    saved = []
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     compute_loss=lambda m, x, y: nn.functional.cross_entropy(m(x), y), device=torch.device("cpu"),
                     rank=rank, world_size=world, log_every=4, ckpt_every=4, save=lambda: saved.append(state.step))
    state = TrainState()
    try:  # rank 1's third batch (update 3) fails; the next collective is update 4's log step
        loop.run_epoch(TrainBatches(FailsAt(rank, 2 if rank == 1 else None), Sampler()), state, 4)
        outcome = ("ok", "")
    except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
        outcome = (type(e).__name__, str(e))
    torch.save({"outcome": outcome, "saved": saved}, os.path.join(work, f"rank{rank}.pt"))
    stay_until_all_recorded(work, world)


def test_a_batch_that_fails_on_one_rank_ends_every_rank_at_the_next_collective(tmp_path):
    spawn_within(_worker, (2, free_port(), str(tmp_path)), 2, DEADLINE_S)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert rank1["outcome"] == ("OSError", "cannot identify image file 'train/3/x.jpg'")
    assert rank0["outcome"][0] == "OtherRankError" and "could not load its training batches" in rank0["outcome"][1]
    assert rank0["saved"] == rank1["saved"] == []  # the checkpoint of update 4 would hold the replayed update


class LongFailsAt(FailsAt):
    """FailsAt over 20 batches: room for many updates after the failed one."""

    def __init__(self, rank: int, index) -> None:
        super().__init__(rank, index)
        self.x = torch.randn(80, 3, generator=torch.Generator().manual_seed(rank))

    def __len__(self) -> int:
        return 20

    def __iter__(self):
        for i in range(20):
            if i == self.index:
                raise OSError("cannot identify image file 'train/3/x.jpg'")
            yield self.x[4 * i:4 * i + 4], torch.zeros(4, dtype=torch.long)


def _stop_flag_worker(rank: int, world: int, port: int, work: str, stop_flag: bool) -> None:
    init_gloo(rank, world, port, timeout_s=300)
    from engine.loop import TrainBatches, TrainLoop, TrainState
    from engine.preemption import Preemption

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    updates = []  # the optimizer's real steps, counted apart from the loop's own step count
    optimizer.register_step_post_hook(lambda *_: updates.append(1))
    state, saved = TrainState(), []
    with Preemption(torch.device("cpu"), distributed=True) as preemption:
        loop = TrainLoop(model=model, optimizer=optimizer, device=torch.device("cpu"),
                         compute_loss=lambda m, x, y: nn.functional.cross_entropy(m(x), y),
                         rank=rank, world_size=world, log_every=1000, ckpt_every=1000,
                         save=lambda: saved.append(state.step), should_stop=preemption.should_stop,
                         request_stop=preemption.request_stop if stop_flag else None)
        try:  # rank 1's third batch (update 3) fails; log and checkpoint steps are far away
            reason = loop.run_epoch(TrainBatches(LongFailsAt(rank, 2 if rank == 1 else None), Sampler()), state, 4)
            if reason == "preempted":  # as train.py: a stop request writes checkpoint.pt
                saved.append(("preempted", state.step))
            outcome = ("ok", reason)
        except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
            outcome = (type(e).__name__, str(e))
    torch.save({"outcome": outcome, "saved": saved, "updates": len(updates)}, os.path.join(work, f"rank{rank}.pt"))
    stay_until_all_recorded(work, world)


@pytest.mark.parametrize("stop_flag", [True, False], ids=["stop flag", "no stop flag"])
def test_a_batch_that_fails_on_one_rank_raises_the_stop_flag_and_every_rank_ends_within_two_updates(
        tmp_path, stop_flag):
    spawn_within(_stop_flag_worker, (2, free_port(), str(tmp_path), stop_flag), 2, DEADLINE_S)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert rank1["outcome"] == ("OSError", "cannot identify image file 'train/3/x.jpg'")
    assert rank0["outcome"][0] == "OtherRankError" and "could not load its training batches" in rank0["outcome"][1]
    assert rank0["saved"] == rank1["saved"] == []  # neither a checkpoint nor a 'preempted' one
    assert rank0["updates"] == rank1["updates"]
    after = rank0["updates"] - 2  # updates 1 and 2 came before the failed batch
    # with the flag: the failed update and the one the agreement needs; without it: the rest of the epoch
    assert 1 <= after <= 2 if stop_flag else after == 18


class FailsInEpoch(FailsAt):
    """FailsAt whose batch `index` raises in epoch `epoch` only (0-based, as `set_epoch` numbers them)."""

    def __init__(self, rank: int, epoch, index) -> None:
        super().__init__(rank, None)
        self.fail_epoch, self.fail_index = epoch, index

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.index = self.fail_index if epoch == self.fail_epoch else None


# name -> (rank 1's failing (epoch, batch), accum_steps); rank 0 never fails
SCENARIOS = {"run's first batch": ((0, 0), 1), "epoch 2's first batch": ((1, 0), 1),
             "second micro-batch of the first update": ((0, 1), 2),
             "first micro-batch of epoch 2's first update": ((1, 0), 2)}


def _epochs_worker(rank: int, world: int, port: int, work: str, scenario: str) -> None:
    init_gloo(rank, world, port, timeout_s=300)
    from engine.loop import TrainBatches, TrainLoop, TrainState

    (fail_epoch, fail_index), accum = SCENARIOS[scenario]
    data = FailsInEpoch(rank, fail_epoch if rank == 1 else None, fail_index)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
    state, saved = TrainState(), []

    def save() -> None:  # what a checkpoint written now would resume from
        saved.append((state.epoch, state.epoch_batches, state.step))

    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     compute_loss=lambda m, x, y: nn.functional.cross_entropy(m(x), y), device=torch.device("cpu"),
                     rank=rank, world_size=world, accum_steps=accum, log_every=100, save=save)
    try:
        for _ in range(2):  # as train.py: an epoch, then its checkpoint
            loop.run_epoch(TrainBatches(data, data), state, 4)
            save()
        outcome = ("ok", "")
    except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
        outcome = (type(e).__name__, str(e))
    torch.save({"outcome": outcome, "saved": saved}, os.path.join(work, f"rank{rank}.pt"))
    stay_until_all_recorded(work, world)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_batch_of_a_first_update_that_fails_on_one_rank_ends_every_rank(tmp_path, scenario):
    spawn_within(_epochs_worker, (2, free_port(), str(tmp_path), scenario), 2, DEADLINE_S)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert rank1["outcome"] == ("OSError", "cannot identify image file 'train/3/x.jpg'")
    assert rank0["outcome"][0] == "OtherRankError" and "could not load" in rank0["outcome"][1]
    (fail_epoch, _), accum = SCENARIOS[scenario]
    # the last checkpoint, the resume point, is the end of the epoch before the failure: none after it
    assert rank0["saved"] == rank1["saved"] == [(e + 1, 0, 6 // accum * (e + 1)) for e in range(fail_epoch)]


def _eval_worker(rank: int, world: int, port: int, work: str) -> None:
    init_gloo(rank, world, port, timeout_s=300)
    import torch.distributed as dist
    from engine.loop import evaluate

    def agree_not_to_stop() -> bool:  # a collective before every batch, as a preemption request's agreement
        dist.all_reduce(torch.zeros(1))
        return False

    agreements = []

    def agree_to_stop_at_the_fourth_batch() -> bool:  # a request that arrives during the evaluation
        dist.all_reduce(torch.zeros(1))
        agreements.append(None)
        return len(agreements) == 4

    lines = []
    logger = logging.getLogger("engine.loop")
    logger.addHandler(ListHandler(lines))
    logger.setLevel(logging.INFO)
    outcomes = {}
    for name, should_stop in (("plain", None), ("agreeing", agree_not_to_stop),
                              ("stopped", agree_to_stop_at_the_fourth_batch)):
        try:
            result = evaluate(nn.Linear(3, 2), FailsAt(rank, 1 if rank == 1 else None), torch.device("cpu"),
                              should_stop=should_stop)
            outcomes[name] = ("ok", repr(result))
        except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
            outcomes[name] = (type(e).__name__, str(e))
    outcomes["stop lines"] = [line for line in lines if "stop request" in line]
    torch.save(outcomes, os.path.join(work, f"rank{rank}.pt"))
    stay_until_all_recorded(work, world)


def test_an_evaluation_batch_that_fails_on_one_rank_ends_every_rank(tmp_path):
    spawn_within(_eval_worker, (2, free_port(), str(tmp_path)), 2, DEADLINE_S)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for name in ("plain", "agreeing"):
        assert rank1[name] == ("OSError", "cannot identify image file 'train/3/x.jpg'"), name
        assert rank0[name][0] == "OtherRankError" and "could not load its batches" in rank0[name][1], name
    # a stop agreed at the fourth batch ends the evaluation on both ranks (no score, no rank left waiting), and
    # each says so, also rank 1, which could not load its second batch and only took the agreements since
    for rank in (rank0, rank1):
        assert rank["stopped"] == ("ok", "None")
        assert rank["stop lines"] == ["evaluation stopped by the stop request after 3 of 6 batches"]
