"""The random-number state of a detection training run, kept in its MMEngine checkpoints so that a resumed
run continues exactly (scripts/train_detection.py registers the hook)."""
from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch
from mmengine.hooks import Hook
from mmengine.runner import IterBasedTrainLoop


def inexact_resume(world_size: int, train_loader, saved_ranks: int = 1, saved_world: Optional[int] = None,
                   iteration_loop: bool = False) -> list[str]:
    """Why a resumed run of `world_size` processes reading `train_loader`, from a checkpoint holding the
    random-number states of `saved_ranks` ranks and written by a run of `saved_world` ranks (None: not recorded,
    a checkpoint of an older version), does not continue as the uninterrupted run would; empty where it does.
    `iteration_loop`: the run trains in MMEngine's IterBasedTrainLoop (GPLQ's stage 1 on a detector), not by epoch."""
    limits = []
    if saved_world is not None and saved_world != world_size:
        per_rank = getattr(train_loader.batch_sampler, "batch_size", None) or train_loader.batch_size or 1
        limits.append(f"the checkpoint was written by a run of {saved_world} rank(s) and this one has {world_size}: "
                      f"the global batch is {per_rank * world_size} images instead of {per_rank * saved_world} "
                      f"({per_rank} per rank) and an epoch {len(train_loader)} iterations, while the learning rate "
                      "and its schedule continue from the checkpoint (as set for the run's batch) and a schedule "
                      f"counted in iterations (the warmup) ends at another point of the data; resume on {saved_world} "
                      "rank(s) to continue the run as it was")
    if world_size > 1 and saved_ranks != world_size:
        held = ("rank 0's only" if saved_ranks <= 1 else f"those of a run of {saved_ranks} ranks")
        limits.append(f"ranks 1 to {world_size - 1} continue from the run's seed, not from their random-number "
                      f"state at the checkpoint (it holds {held}), so their RoI samples and dropout differ, and "
                      "through the averaged gradients every rank's weights")
    workers = getattr(train_loader, "num_workers", 0)
    # an iteration loop fetches the batches trained before the checkpoint again before its first new one, through
    # new workers started from the same seeds: they reach the checkpoint with the uninterrupted run's draws
    # (tests/test_gplq_detector_resume.py, past an epoch's end too); an epoch loop starts its epoch with them
    if workers > 0 and getattr(train_loader, "persistent_workers", False) and not iteration_loop:
        limits.append(f"the train loader's {workers} persistent worker(s) start over from their first seeds, so "
                      "their augmentation draws (flips, crops) differ; with train_dataloader.persistent_workers=False "
                      "every epoch's workers start from the same seeds in both runs")
    return limits


class RngStateHook(Hook):
    """Make a resumed training continue exactly: MMEngine 0.10's checkpoints hold no random-number state, so a
    resumed run drew other flips, RoI samples and dropout than the uninterrupted one (110 of the sample
    detector's 115 tensors differed after a resumed epoch). The torch (and CUDA), numpy and python states go
    into each checkpoint and are restored when training starts from one; a validation inside training puts them
    back as they were before it, because it runs after the epoch's checkpoint is saved and would otherwise move
    the training stream on only in the run that was not interrupted.

    Under torchrun MMEngine calls `before_save_checkpoint` on rank 0 only (its save_checkpoint is master_only), so
    the other ranks' states reach the checkpoint through `gatherer` (`RankRngStates`, registered beside this hook),
    which collects every rank's state just before MMEngine's CheckpointHook saves; each rank restores its own.
    Each checkpoint also records the number of ranks that wrote it: a resume on another number trains at another
    global batch, which the warning below names. Without the ranks' states (a checkpoint of another number of
    ranks, or one written before they were kept) ranks 1 to N-1 continue from the state MMEngine's seeding gave
    them at the start of the process: their RoI samples, dropout and drop-path draws differ from the uninterrupted
    run's, and through the averaged gradients so do every rank's weights after the first resumed update (the data
    order is the same: MMEngine's sampler shuffles from the seed and the epoch).

    Where a resume is not exact (`inexact_resume`, logged as a warning when such a run resumes): another number of
    ranks than the checkpoint's (another global batch, in one process too), ranks without their state (above),
    and in an epoch loop persistent loader workers (`persistent_workers=True` and `num_workers` > 0, the
    MMDetection COCO configs' setting): MMEngine's `worker_init_fn` seeds each worker once, from (seed, rank,
    worker index), and the augmentation draws in the workers (random flips, crops) go on from there over the
    epochs of an uninterrupted run, while a resumed run's new workers start over from those seeds. Workers that
    are not persistent start from the same seeds every epoch in both runs; with `num_workers=0` the draws are the
    main process's, whose state is restored (exact: tests/test_detection.py in one process,
    tests/test_detection_distributed_resume.py on 2 ranks).

    MMEngine's iteration loop (IterBasedTrainLoop: GPLQ's stage 1 on a detector, engine/detection/qat.py) reaches
    the checkpoint's position by fetching the batches trained before it again, which draws in this process: their
    augmentations at `num_workers=0`, and a new iterator's seed at each end of the loader (workers that are not
    persistent). Restored before that fetch, as in an epoch loop, the state moved on: of the sample detector's 115
    tensors 111 differed after a stage 1 resumed past an epoch's end at `num_workers=0`, 93 with a worker that is
    not persistent. There the state is restored after it, right before the first new batch is fetched
    (`_RestoreAfterSkip`); the workers, persistent or not, fetch the trained batches again from their first seeds
    and go on as in the uninterrupted run (tests/test_gplq_detector_resume.py)."""

    priority = "LOWEST"  # restores after every other hook's before_train, saves after theirs

    def __init__(self) -> None:
        self._loaded: Optional[dict] = None
        self._loaded_ranks: Optional[list] = None
        self._loaded_world: Optional[int] = None  # the ranks of the run that wrote the checkpoint, where recorded
        self._gathered: Optional[list] = None  # every rank's state at the checkpoint about to be saved
        self._before_val: Optional[dict] = None
        self.gatherer = RankRngStates(self)

    @staticmethod
    def _state() -> dict:
        # torch's generator states as numpy arrays, not tensors: MMEngine's resume loads a checkpoint with
        # map_location=get_device(), which puts every tensor on the GPU, where torch.set_rng_state refuses it
        # ("RNG state must be a torch.ByteTensor", a traceback at the start of every resume on a GPU)
        state = {"torch": torch.get_rng_state().numpy(), "numpy": np.random.get_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state().numpy()
        return state

    @staticmethod
    def _restore(state: dict) -> None:
        torch.set_rng_state(_host_bytes(state["torch"]))
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(_host_bytes(state["cuda"]))

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        checkpoint["rng_state"] = self._state()
        # the ranks that trained to it (with the per-rank batch of the run's settings: the global batch), for a
        # resume on another number of ranks to say that it changes them
        checkpoint["world_size"] = runner.world_size
        if self._gathered is not None:
            checkpoint["rng_state_ranks"] = self._gathered
            self._gathered = None

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        self._loaded = checkpoint.get("rng_state")
        self._loaded_ranks = checkpoint.get("rng_state_ranks")
        # one written before the world size was recorded: that of the ranks' states it holds, where it holds them
        self._loaded_world = checkpoint.get("world_size", len(self._loaded_ranks) if self._loaded_ranks else None)

    def before_train(self, runner) -> None:
        if runner.iter == 0:  # a new run, seeded by MMEngine
            return
        loop = getattr(runner, "train_loop", None)
        iterations = isinstance(loop, IterBasedTrainLoop)
        if runner.rank == 0 and (limits := inexact_resume(runner.world_size, runner.train_dataloader, self._saved_ranks,
                                                          self._loaded_world, iteration_loop=iterations)):
            runner.logger.warning("this resumed run does not continue exactly as the uninterrupted one would: "
                                  f"{'; '.join(limits)} (docs/operations.md, detection runs)")
        if iterations:  # after the loop fetched the trained batches again (class docstring)
            loop.dataloader_iterator = _RestoreAfterSkip(loop.dataloader_iterator, runner.iter,
                                                         lambda: self._restore_loaded(runner))
        else:
            self._restore_loaded(runner)

    @property
    def _saved_ranks(self) -> int:
        """How many ranks' states the checkpoint resumed from holds (1: rank 0's alone, or none)."""
        return len(self._loaded_ranks) if self._loaded_ranks else 1

    def _restore_loaded(self, runner) -> None:
        """Put back this rank's state at the checkpoint resumed from."""
        if runner.rank != 0:  # its own state where the checkpoint holds one for this number of ranks
            if self._saved_ranks == runner.world_size:
                self._restore(self._loaded_ranks[runner.rank])
            return
        if self._loaded is None:
            runner.logger.warning("the checkpoint resumed from holds no random-number state (written without "
                                  "RngStateHook): training continues from the run's seed, not exactly")
            return
        self._restore(self._loaded)
        self._loaded = None

    def before_val(self, runner) -> None:
        self._before_val = self._state()

    def after_val(self, runner) -> None:
        if self._before_val is not None:
            self._restore(self._before_val)
            self._before_val = None


def _host_bytes(state) -> torch.Tensor:
    """A generator state as the CPU ByteTensor torch's set_rng_state takes: from the numpy array `_state` keeps, or
    from the tensor a checkpoint written before kept (loaded onto the GPU by MMEngine's resume: copied back)."""
    return state.cpu() if isinstance(state, torch.Tensor) else torch.from_numpy(np.array(state, dtype=np.uint8))


class _RestoreAfterSkip:
    """MMEngine's iteration loop's data iterator (`iterator`), which calls `restore` once it has handed out `skip`
    batches (those the loop fetches again to reach the checkpoint's position), right before it fetches the next."""

    def __init__(self, iterator, skip: int, restore) -> None:
        self.iterator, self.skip, self.restore = iterator, skip, restore

    def __iter__(self):
        return self

    def __next__(self):
        if self.skip == 0 and self.restore is not None:
            restore, self.restore = self.restore, None
            restore()
        self.skip -= 1
        return next(self.iterator)


class RankRngStates(Hook):
    """Every rank's random-number state, collected (one all-gather, on every rank) right before MMEngine's
    CheckpointHook saves a checkpoint, for `RngStateHook` to write into it on rank 0. Register it beside its
    RngStateHook (`runner.register_hook(hook.gatherer)`); in one process it does nothing."""

    priority = "LOW"  # after_train_epoch / after_train_iter before CheckpointHook's (VERY_LOW), which saves

    def __init__(self, keeper: RngStateHook) -> None:
        self.keeper = keeper

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        self._gather_if_saving(runner, by_epoch=False)

    def after_train_epoch(self, runner) -> None:
        self._gather_if_saving(runner, by_epoch=True)

    def _gather_if_saving(self, runner, by_epoch: bool) -> None:
        from mmengine.dist import all_gather_object
        from mmengine.hooks import CheckpointHook
        if runner.world_size <= 1:
            return
        saver = next((h for h in runner.hooks if isinstance(h, CheckpointHook)), None)
        if saver is None or saver.by_epoch != by_epoch:
            return
        # CheckpointHook's own test of whether it saves now (mmengine 0.10 after_train_epoch / after_train_iter)
        if by_epoch:
            saves = saver.every_n_epochs(runner, saver.interval, saver.save_begin) or (
                saver.save_last and saver.is_last_train_epoch(runner))
        else:
            saves = saver.every_n_train_iters(runner, saver.interval, saver.save_begin) or (
                saver.save_last and saver.is_last_train_iter(runner))
        if saves:
            self.keeper._gathered = all_gather_object(RngStateHook._state())
