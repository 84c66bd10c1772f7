"""Where a resumed detection run cannot continue exactly (engine/detection/rng_state.py), it says so when it
resumes: under torchrun from a checkpoint without every rank's random-number state (one of another number of ranks,
or written by rank 0 alone) and with persistent loader workers (seeded once, when they start). Needs mmengine only,
not full mmcv."""
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


@pytest.mark.parametrize("world, saved, named", [
    (2, 2, None),  # every rank's state is in the checkpoint (RankRngStates)
    (8, 8, None),
    (4, 2, "ranks 1 to 3 continue from the run's seed, not from their random-number state at the checkpoint (it "
           "holds those of a run of 2 ranks)"),
    (2, 1, "(it holds rank 0's only)"),
])
def test_a_checkpoint_with_every_rank_s_state_resumes_exactly_on_as_many_ranks(world, saved, named):
    limits = inexact_resume(world, loader(0, False), saved)
    assert limits == [] if named is None else (len(limits) == 1 and named in limits[0]), limits


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


def _draws():
    """One number from each generator the hook keeps: torch, numpy, python."""
    import random
    import numpy as np
    import torch
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_a_resume_draws_what_the_uninterrupted_run_draws_after_its_checkpoint():
    """The numbers drawn after a checkpoint, by torch, numpy and python (flips, RoI samples, dropout), are the
    same in the run that goes on and in a process that resumes from that checkpoint after drawing others."""
    import random
    import numpy as np
    import torch
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    checkpoint: dict = {}
    RngStateHook().before_save_checkpoint(runner(10, 0, 1), checkpoint)
    expected = _draws()  # the uninterrupted run's next draws
    torch.manual_seed(2), np.random.seed(2), random.seed(2)  # a new process, seeded from the run's seed
    _draws()
    hook = RngStateHook()
    hook.after_load_checkpoint(None, checkpoint)
    hook.before_train(SimpleNamespace(iter=10, rank=0, world_size=1, logger=None, train_dataloader=loader(0, False)))
    assert _draws() == expected


@pytest.mark.parametrize("rank", [0, 1])
def test_a_checkpoint_loaded_onto_another_device_than_the_cpu_resumes_the_draws(tmp_path, rank):
    """MMEngine's resume loads the checkpoint with map_location=get_device(): on a GPU machine every tensor in it
    goes to the GPU, where torch.set_rng_state refuses a state ("RNG state must be a torch.ByteTensor": every
    resume on a GPU, train_detection.py's and GPLQ's stage 1, was a traceback). The "meta" device stands for the GPU
    here; rank 1's state (rng_state_ranks) as rank 0's. The draws after the resume are those of the run that went
    on (the reference: drawn right after the state was saved)."""
    import random
    import numpy as np
    import torch
    states = [_seeded_state(20), _seeded_state(21)]  # rank 0's and rank 1's at the checkpoint
    expected = {1: _draws()}
    _seeded_state(20)
    expected[0] = _draws()
    hook = RngStateHook()
    hook._gathered = states
    checkpoint: dict = {}
    _seeded_state(20)  # rank 0 saves its own state
    hook.before_save_checkpoint(runner(10, 0, 2), checkpoint)
    torch.save(checkpoint, tmp_path / "iter_10.pth")
    loaded = torch.load(tmp_path / "iter_10.pth", map_location="meta", weights_only=False)
    torch.manual_seed(5), np.random.seed(5), random.seed(5)  # a new process
    resumed = RngStateHook()
    resumed.after_load_checkpoint(None, loaded)
    resumed.before_train(runner(10, rank, 2))
    assert _draws() == expected[rank]


def test_a_validation_inside_training_leaves_the_training_draws_as_they_were():
    """The validation runs after the epoch's checkpoint in the uninterrupted run only: the draws after it are
    those a run without it makes."""
    import random
    import numpy as np
    import torch
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    state = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    expected = _draws()
    torch.set_rng_state(state[0]), np.random.set_state(state[1]), random.setstate(state[2])
    hook = RngStateHook()
    hook.before_val(None)
    _draws()  # the validation's own draws
    hook.after_val(None)
    assert _draws() == expected


@pytest.mark.parametrize("world, saved, named", [
    (1, 2, "written by a run of 2 rank(s) and this one has 1: the global batch is 1 images instead of 2 (1 per "
           "rank) and an epoch 4 iterations"),
    (2, 1, "written by a run of 1 rank(s) and this one has 2: the global batch is 2 images instead of 1"),
    (4, 8, "the global batch is 4 images instead of 8")])
def test_a_resume_on_another_number_of_ranks_than_the_checkpoint_s_names_the_global_batch(world, saved, named):
    """A run trained on 2 ranks and resumed in one process said nothing (rank 0's random state was all it needed),
    though the global batch halved and an epoch took twice the iterations: the warmup ended elsewhere."""
    limits = inexact_resume(world, loader(0, False), saved_ranks=saved, saved_world=saved)
    assert named in limits[0] and f"resume on {saved} rank(s) to continue the run as it was" in limits[0], limits
    assert inexact_resume(world, loader(0, False), saved_ranks=world, saved_world=world) == []


def test_one_process_resuming_a_checkpoint_of_as_many_is_exact_and_of_more_ranks_says_so():
    """Rank 0's state is all one process draws from: the other ranks' states do not matter, their batch does."""
    assert inexact_resume(1, loader(0, False), saved_ranks=1, saved_world=1) == []
    assert len(inexact_resume(1, loader(0, False), saved_ranks=2, saved_world=2)) == 1


@pytest.mark.parametrize("saved, world", [(2, 1), (1, 2)])
def test_a_checkpoint_records_its_ranks_and_a_resume_on_another_number_warns(saved, world):
    """From 2 ranks to 1 and from 1 to 2: the checkpoint says how many ranks wrote it, and rank 0 of the
    resumed run warns once that the global batch changed."""
    checkpoint: dict = {}
    RngStateHook().before_save_checkpoint(runner(4, 0, saved), checkpoint)
    assert checkpoint["world_size"] == saved
    resumed = RngStateHook()
    resumed.after_load_checkpoint(None, checkpoint)
    run = runner(4, 0, world)
    resumed.before_train(run)
    assert len(run.logger.warnings) == 1
    assert f"written by a run of {saved} rank(s) and this one has {world}" in run.logger.warnings[0]


def _seeded_state(seed: int) -> dict:
    import random
    import numpy as np
    import torch
    torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)
    return RngStateHook._state()


def test_each_rank_resumes_its_own_state_and_a_checkpoint_keeps_the_states_gathered_for_it():
    """Rank 1 of 2 continues with the draws of the state saved for rank 1 (not rank 0's); the states gathered for a
    save go into that checkpoint only."""
    states = [_seeded_state(10), _seeded_state(11)]
    expected = _draws()  # rank 1's draws after its saved state (seed 11)
    hook = RngStateHook()
    hook._gathered = states
    checkpoint: dict = {}
    hook.before_save_checkpoint(runner(10, 0, 2), checkpoint)
    assert checkpoint["rng_state_ranks"] is states
    later: dict = {}
    hook.before_save_checkpoint(runner(12, 0, 2), later)
    assert "rng_state_ranks" not in later
    _seeded_state(99)  # a new process
    resumed = RngStateHook()
    resumed.after_load_checkpoint(None, checkpoint)
    resumed.before_train(runner(10, 1, 2))
    assert _draws() == expected


@pytest.mark.parametrize("by_epoch, interval, saves", [
    # (runner.epoch, runner.iter) at each save: after epochs 2 and 4 (4 and 8 iterations done) and the last (save_last)
    (True, 2, [(1, 4), (3, 8), (4, 10)]),
    (False, 3, [(1, 2), (2, 5), (4, 8), (4, 9)]),  # after iterations 3, 6, 9 (0-based 2, 5, 8) and the last, 10
])
def test_every_rank_s_state_is_gathered_for_each_save_of_mmengine_s_checkpoint_hook_and_at_no_other_step(
        monkeypatch, by_epoch, interval, saves):
    """Under torchrun RankRngStates gathers every rank's state (one all-gather) right before each save of MMEngine's
    own CheckpointHook, by epoch or by iteration as it saves, the last one included, and at no other step: a
    checkpoint without them resumed ranks 1 to N-1 from the run's seed. The run is 5 epochs of 2 iterations driven
    through the hooks as MMEngine's loop calls them (the gatherer before the saver); the saver's decisions are
    MMEngine's own, its writing replaced by the save's before_save_checkpoint call; the saves are listed by hand."""
    import mmengine.dist
    from mmengine.hooks import CheckpointHook
    keeper, saver = RngStateHook(), CheckpointHook(interval=interval, by_epoch=by_epoch, save_last=True)
    run = runner(0, 0, 2)
    run.hooks, run.max_epochs, run.max_iters, run.logger.info = [keeper.gatherer, saver], 5, 10, lambda message: None
    gathers, saved = [], []
    monkeypatch.setattr(mmengine.dist, "all_gather_object", lambda state: gathers.append(state) or [state, state])

    def save(r):  # what Runner.save_checkpoint asks of the hooks before it writes
        checkpoint: dict = {}
        keeper.before_save_checkpoint(r, checkpoint)
        saved.append((r.epoch, r.iter, len(checkpoint.get("rng_state_ranks") or [])))
    monkeypatch.setattr(saver, "_save_checkpoint", save)
    for run.epoch in range(5):
        for batch in range(2):
            run.iter = 2 * run.epoch + batch
            for hook in run.hooks:
                hook.after_train_iter(run, batch)
        run.iter = 2 * run.epoch + 2
        for hook in run.hooks:
            hook.after_train_epoch(run)
    assert saved == [(epoch, iteration, 2) for epoch, iteration in saves]  # each save holds both ranks' states
    assert len(gathers) == len(saves)
