"""Where a resumed detection run cannot continue exactly (engine/detection/rng_state.py), it says so when it
resumes: under torchrun (rank 0's random-number state only is in MMEngine's checkpoints) and with persistent loader
workers (seeded once, when they start). Needs mmengine only, not full mmcv."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.utils.data import DataLoader

pytest.importorskip("mmengine")

from engine.detection.rng_state import RngStateHook, inexact_resume  # noqa: E402


def loader(workers: int, persistent: bool) -> DataLoader:
    return DataLoader(list(range(4)), num_workers=workers, persistent_workers=persistent)  # no worker starts


@pytest.mark.parametrize("world, workers, persistent, named", [
    (1, 0, False, []),
    (1, 2, False, []),  # every epoch's workers start from the same seeds, resumed or not
    (2, 0, False, ["ranks 1 to 1 continue from the run's seed"]),
    (8, 0, False, ["ranks 1 to 7 continue from the run's seed"]),
    (1, 2, True, ["2 persistent worker(s) start over"]),
    (4, 2, True, ["ranks 1 to 3", "2 persistent worker(s)"]),
])
def test_the_limits_of_an_exact_resume_are_named(world, workers, persistent, named):
    limits = inexact_resume(world, loader(workers, persistent))
    assert len(limits) == len(named)
    assert all(text in limit for text, limit in zip(named, limits)), limits


class Logger:
    def __init__(self):
        self.warnings = []

    def warning(self, message):
        self.warnings.append(message)


def runner(iteration: int, rank: int, world: int) -> SimpleNamespace:
    return SimpleNamespace(iter=iteration, rank=rank, world_size=world, logger=Logger(),
                           train_dataloader=loader(0, False))


def test_a_resume_under_torchrun_warns_once_on_rank_0_and_a_new_run_does_not():
    resumed = [runner(10, rank, 2) for rank in (0, 1)]
    for r in resumed:  # no checkpoint loaded here: rank 0 also warns that it has no state to restore
        RngStateHook().before_train(r)
    assert [len(r.logger.warnings) for r in resumed] == [2, 0]
    assert "ranks 1 to 1 continue from the run's seed" in resumed[0].logger.warnings[0]
    fresh = runner(0, 0, 2)
    RngStateHook().before_train(fresh)
    assert fresh.logger.warnings == []
