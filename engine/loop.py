"""The optimizer-update loop (one epoch at a time) and the accuracy evaluation, shared by train.py and
by pipelines that train (GPLQ stage 1), so there is one copy of the step logic.

One update = `accum_steps` micro-batches: forward under autocast, loss / accum_steps, backward (DDP
`no_sync` on all but the last micro-batch), optional unscale + clip, `scaler.step(optimizer)` or
`optimizer.step()`, scaler update, zero_grad, EMA update, per-step lr schedule. Regularizers that act on
the weights (Colinearity Decay) are optimizer step pre-hooks: they run inside `optimizer.step()`, only
when the step really runs (an fp16 step skipped by the GradScaler applies none), once per update.
Regularizers that add a loss term (TWEO) live in `compute_loss`.

Randomness in the main process (mixup, drop path, dropout) is reseeded from (seed, rank, update) at
every update, and the data pipeline is seeded per sample (data/samplers.py), so a run resumed from a
checkpoint continues exactly as the uninterrupted run would have, without storing RNG states.
"""
from __future__ import annotations

import logging
import math
import resource
import sys
import time
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Protocol, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from cd.wrappers import unwrap_model
from models.modules import nonfinite_tensors

from .distributed import OtherRankError, all_reduce, raise_on_every_rank, raise_where_failed
from .divergence import (DivergenceError, DivergenceGuard, held_dropped_line, kept_text, nonfinite_weights_line,
                         withheld_line, write_withheld)
from .precision import autocast
from .rng import mix_seed, seed_all

if TYPE_CHECKING:
    from .checkpoint import CheckpointFile

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """A loss or logits that are NaN or inf: the training loss (the last good checkpoint is kept), or the
    logits / loss of an evaluation (nothing is written)."""

    # found on every rank after the same all-reduce: under torchrun each rank waits for rank 0's error, so the job
    # prints it once (engine.distributed.process_group)
    in_step = True


class NothingScoredError(ValueError):
    """An evaluation that scored nothing (an empty loader, or every image unreadable): a top-1 of 0 % or a
    perplexity of 1 made of no data is no result."""

    in_step = True  # every rank scored the same all-reduced counts: one line (as NonFiniteLossError)


# Errors that end a run on purpose, each saying itself what was kept: no emergency checkpoint after them.
_DELIBERATE = (NonFiniteLossError, DivergenceError)


class EpochSampler(Protocol):
    """What engine.loop.TrainLoop needs from a sampler (data.samplers.SeededSampler has it)."""

    def set_epoch(self, epoch: int, start: int = 0) -> None: ...


@dataclass
class TrainBatches:
    """A rank's training loader (train transform, shuffled, drop_last) and its resumable sampler.

    loader: yields (images [B, 3, H, W], labels [B]), or a language model's (ids [B, T], next ids [B, T]),
    with B = the requested batch size per process.
    sampler: `set_epoch(epoch, start)` fixes order and augmentation of an epoch, skipping `start` samples.
    """

    loader: Iterable[Tuple[torch.Tensor, torch.Tensor]]
    sampler: EpochSampler
    # (images, targets) -> (images, targets, names): replaces the samples a data set marked unreadable
    # (negative targets, data/folder.py) and names them; None when the data set cannot have any
    unreadable: Optional[Callable[[torch.Tensor, torch.Tensor], tuple]] = None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def readable(self) -> Iterable[Tuple[torch.Tensor, torch.Tensor]]:
        """The loader's batches with unreadable samples replaced (for code that reads a loader directly)."""
        for images, targets in self.loader:
            if self.unreadable is not None:
                images, targets, _ = self.unreadable(images, targets)
            yield images, targets


@dataclass
class TrainState:
    """The counters a checkpoint restores (with model, optimizer, scaler, scheduler, EMA)."""

    epoch: int = 0  # current epoch, 0-based
    step: int = 0  # optimizer updates done
    epoch_batches: int = 0  # micro-batches of `epoch` already consumed (resume mid-epoch)
    skipped_steps: int = 0  # fp16 updates the GradScaler skipped (inf/NaN gradients)
    best_value: Optional[float] = None  # the best validation score so far (the task's score_key)
    best_epoch: int = 0  # the epoch (1-based; the one in progress for a mid-epoch validation) of best_value
    best_step: int = 0  # ... and its update
    # weights_fingerprint of the weights best.pt holds for best_value: which write of best.pt the score describes
    # (two branches of a run may validate at the same update); None before the first, or in older checkpoints
    best_fingerprint: Optional[str] = None
    # this update's validation is not done (a stop request ended it, an error, or a write made before it: set from the
    # update's step on, TrainLoop.validates): do it on resume
    validation_due: bool = False
    initial_loss: Optional[float] = None  # mean loss of the first update over all ranks (divergence guard)
    divergence_streak: int = 0  # the divergence guard's high log windows in a row, kept across a resume
    unreadable_images: int = 0  # training samples that could not be read, replaced in their batch (all ranks)
    # the sums of the log window a checkpoint cuts (written between two log steps: train.ckpt_every_steps, a stop
    # request), all ranks' (`TrainLoop.checkpoint`): the resumed run goes on with them, so that the window ends, and
    # is logged, where a run never stopped logs it, with the same numbers (the same bits where the sums are exact:
    # float64 sums of float32 losses and TWEO penalties, `_Window._reset`); None where no window is open
    log_window: Optional[dict] = None

    @property
    def current_epoch(self) -> int:
        """The epoch, 1-based: the one in progress, or the one just completed (best_epoch counts the same way)."""
        return self.epoch + (self.epoch_batches > 0)

    def state_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainLoop:
    model: nn.Module  # what the forward calls (possibly DDP / compiled)
    optimizer: torch.optim.Optimizer
    compute_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # (model, x, y) -> loss
    device: torch.device
    amp: str = "none"
    scaler: Optional[torch.amp.GradScaler] = None
    scheduler: Optional[object] = None  # timm scheduler
    per_step_schedule: bool = False
    accum_steps: int = 1
    clip_grad: Optional[float] = None
    ema: Optional[nn.Module] = None  # timm ModelEmaV3
    mixup: Optional[Callable] = None
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    max_steps: Optional[int] = None
    log_every: int = 50
    ckpt_every: int = 0
    eval_every: int = 0  # end run_epoch with 'validate' every N updates (0: at epoch ends only)
    # (update, the epoch it completes (1-based) or None) -> whether the caller validates after that update (train.py
    # validation_follows): such an update is recorded as due (TrainState.validation_due) from its step on, so that a
    # write of it made before its validation is done (train.ckpt_every_steps, held, made checkpoint.pt by an error in
    # the validation: keep_held) makes the resumed run validate first; None: the caller records it
    validates: Optional[Callable[[int, Optional[int]], bool]] = None
    save: Optional[Callable[[], None]] = None  # writes checkpoint.pt from the current state
    log: Optional[Callable[[int, dict], None]] = None  # (step, metrics)
    metric_sources: list = field(default_factory=list)  # callables returning dicts, read at log steps
    should_stop: Optional[Callable[[int], bool]] = None  # (step) -> preemption requested
    # raises this rank's stop flag, the one `should_stop` agrees on (Preemption.request_stop): called when this
    # rank cannot load a batch under DDP, so that every rank stops within two updates instead of at the next log
    # step, checkpoint or epoch end (the loop then raises there, see run_epoch); None: no per-update agreement
    request_stop: Optional[Callable[[], None]] = None
    divergence: Optional[DivergenceGuard] = None  # stops a run whose loss stays far above its initial value
    # the update of the last checkpoint `checkpoint` wrote, or of the one the run resumed from (the caller sets it):
    # what a divergence stop or a withheld write names as kept; None while there is none
    saved_step: Optional[int] = None
    # checkpoint.pt's file: where `save(held=True)` holds a write back (`checkpoint(goes_on=True)`) until the next
    # update's loss, measured on the weights it holds, has passed the guard (`_settle_held`); None: `save()` only,
    # every write made at once
    checkpoint_file: Optional["CheckpointFile"] = None
    progress: bool = False  # a tqdm bar per epoch (on a terminal only)
    epochs: int = 0  # the run's length in epochs, for the bar's label "epoch N/epochs" as the log lines (0: "epoch N")
    sample_tokens: int = 0  # tokens per sample (a language model's context): also log train/tok_per_s
    # also log epoch/train_seconds, epoch/first_in_process and epoch/max_mem_mib per whole epoch
    log_epoch_costs: bool = False
    # name -> (state, load): a metric source's own sums over the log window (TWEO's penalty), which go with the
    # window's into a checkpoint written inside it (TrainState.log_window): `state()` returns all ranks' sums (a
    # collective, called on every rank), `load(sums, main, forwards)` takes them back, on the main rank (`main` True)
    # only, the others starting from 0 (their sum over the ranks is the window's); `forwards`: the micro-batches of
    # all ranks this run makes in the carried updates, for a sum per micro-batch to weigh each update alike
    # (`_Window.carry_on`) where the checkpoint was written with the global batch in other micro-batches
    window_sources: dict = field(default_factory=dict)

    def __post_init__(self):
        # Which updates the GradScaler skipped (inf/NaN gradients). An ordinary optimizer's step() is not
        # called at all then (its post-hooks do not run); a fused one is always called, with the verdict left
        # on the optimizer as the device tensor `found_inf` for the duration of step(): counted on the device,
        # so that the fp16 step never waits for the GPU, and read at log steps and checkpoints.
        self._real_steps = 0
        # the epoch/* costs of the epoch in progress, summed over the run_epoch calls that its mid-epoch validations
        # (eval_every) split it into: (epoch, micro-batches done, seconds, peak MiB), or None when the epoch in
        # progress did not start in this process (a resume mid-way: not run in one go)
        self._epoch_costs_so_far: Optional[Tuple[int, int, float, float]] = None
        # the epoch this process began training in: its costs hold the job's start (data-loader workers, cuDNN
        # autotuning, the allocator's growth), so its record says so (epoch/first_in_process), also in a resumed job
        self._first_epoch: Optional[int] = None
        self._skipped_on_device: Optional[torch.Tensor] = None
        self._first_loss: Optional[torch.Tensor] = None  # the first update's loss, read at the next log step
        self._first_update_done = False  # whether _first_loss holds all the first update's micro-batches
        self._update_lr = 0.0  # the largest group lr of the last update (train/lr), set before each log step
        # this rank's last good (images, targets), kept across epochs: what it trains on after a failed batch
        self._stand_in: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._window: Optional[_Window] = None  # the log window of the last run_epoch, open where a stop cut it
        self._on_kept: Optional[Callable[[], None]] = None  # what the held write does once it is checkpoint.pt
        # The optimizer holds the hook through a weak reference to the loop. A bound method made loop and
        # optimizer a reference cycle that kept the loop and its DDP wrapper alive after the run, and the
        # wrapper's Reducer kept the process group: destroy_process_group then left gloo's worker threads
        # running into interpreter finalization, where one that drops its last collective's tensors needs the
        # GIL and aborts the process ("terminate called without an active exception", a few % of two-process
        # CPU torchrun runs on a loaded machine). A gc.collect() at cleanup would free it too, but it also
        # collects the loaders' persistent worker iterators from other cycles, whose queues are closed before
        # the iterator can tell its workers to stop: a 5 s join timeout per worker.
        loop = weakref.ref(self)

        def count_step(optimizer, *args):
            me = loop()
            if me is not None:
                me._count_step(optimizer, *args)
        self.optimizer.register_step_post_hook(count_step)

    def _count_step(self, optimizer, *_):
        self._real_steps += 1
        found_inf = getattr(optimizer, "found_inf", None)
        if isinstance(found_inf, torch.Tensor):
            skipped = (found_inf > 0).to(torch.int64).reshape(())
            self._skipped_on_device = (skipped if self._skipped_on_device is None
                                       else self._skipped_on_device + skipped)

    def _settle_skipped_steps(self, state: TrainState) -> None:
        """Add the skips counted on the device to `state` (one host sync; at log steps and checkpoints)."""
        if self._skipped_on_device is not None:
            state.skipped_steps += int(self._skipped_on_device)
            self._skipped_on_device = None

    def updates_per_epoch(self, loader_len: int) -> int:
        return loader_len // self.accum_steps

    def run_epoch(self, batches: TrainBatches, state: TrainState, batch_size_per_gpu: int) -> str:
        """Train on `batches` from `state` to the end of `state.epoch` (or an earlier stop).

        Returns:
            'epoch_end' (the epoch is complete), 'max_steps' (stopped inside it), 'validate' (stopped inside
            it for a validation, `eval_every`) or 'preempted'.
        """
        batches.sampler.set_epoch(state.epoch, start=state.epoch_batches * batch_size_per_gpu)
        if self.divergence is None:
            state.divergence_streak = 0  # no guard, no streak: one resumed from a run that had it withholds nothing
        total = self.updates_per_epoch(len(batches) + state.epoch_batches)
        if self.scheduler is not None:
            if self.per_step_schedule:
                self.scheduler.step_update(state.step)
            else:
                self.scheduler.step(state.epoch)
        self.model.train()
        if self._first_epoch is None:
            self._first_epoch = state.epoch
        # epoch/* costs only for epochs run in one go: begun here, or continued after this loop's own validation
        # (the time between the parts, validating, is left out)
        so_far = self._epoch_costs_so_far
        if state.epoch_batches == 0:
            so_far = (state.epoch, 0, 0.0, 0.0)
        elif so_far is not None and so_far[:2] != (state.epoch, state.epoch_batches):
            so_far = None
        self._epoch_costs_so_far = None  # until this part ends: an error or a stop inside it ends the sums
        # at every part's start, a resumed epoch's too: its train/peak_mem_mib is the training's, not the start-up's
        # (the model, the checkpoint read) nor a validation's
        if _measures_cuda(self.device):
            torch.cuda.reset_peak_memory_stats(self.device)
        epoch_t0 = time.perf_counter()
        bar = _progress_bar(total, state.epoch_batches // self.accum_steps, state.epoch, self.epochs, self.progress)
        window = self._window = _Window(self.device)
        if state.log_window is not None:  # the window the resumed checkpoint cut: go on with its sums
            micro_per_update = self.accum_steps * self.world_size
            window.carry_on(state.log_window["loop"], main=self.rank == 0, micro_per_update=micro_per_update)
            for name, (_, load) in self.window_sources.items():
                if name in state.log_window:
                    load(state.log_window[name], self.rank == 0,
                         state.log_window["loop"]["updates"] * micro_per_update)
            state.log_window = None
        images_per_update = batch_size_per_gpu * self.accum_steps * self.world_size
        reason = "epoch_end"
        micro = 0
        held_loss: Optional[torch.Tensor] = None  # this update's loss sum while a held write waits for it
        stage = "data"  # what the loop is doing, for an error: data, step (weights half written) or save
        waiting_since = time.perf_counter()  # the time spent waiting for the loader (train/data_wait)
        try:
            for images, targets in self._rank_batches(batches, window, state):
                window.data_wait += time.perf_counter() - waiting_since
                if state.epoch_batches >= total * self.accum_steps:
                    break  # the tail that does not fill a whole update
                if micro == 0:
                    seed_all(mix_seed(self.seed, self.rank, state.step))
                    # a held checkpoint.pt write holds the weights this update's loss is computed on: its verdict
                    held_loss = None if self._held_step() is None else torch.zeros((), dtype=torch.float64,
                                                                                    device=self.device)
                images = images.to(self.device, non_blocking=True)
                targets = targets.to(self.device, non_blocking=True)
                if self.mixup is not None:
                    images, targets = self.mixup(images, targets)
                micro += 1
                state.epoch_batches += 1
                last = micro == self.accum_steps
                sync = nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
                with sync:
                    with autocast(self.amp, self.device):
                        loss = self.compute_loss(self.model, images, targets)
                    scaled = loss / self.accum_steps
                    (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                window.add_loss(loss.detach())
                if held_loss is not None:
                    held_loss += loss.detach().double()
                if state.initial_loss is None and not self._first_update_done:
                    # the guard's reference: the first update's loss, the mean over its micro-batches
                    part = loss.detach().float().reshape(1) / self.accum_steps
                    self._first_loss = part if self._first_loss is None else self._first_loss + part
                    self._first_update_done = last
                if not last:
                    waiting_since = time.perf_counter()
                    continue
                if held_loss is not None:  # the update's loss is complete: the held write's verdict, before its step
                    stage = "save"
                    self._settle_held(held_loss, state)
                    held_loss = None
                micro = 0
                stage = "step"
                steps_before = self._real_steps
                grad_norm = self._optimizer_step()
                state.step += 1
                state.skipped_steps += self._real_steps == steps_before
                if self.ema is not None:
                    self.ema.update(unwrap_model(self.model), step=state.step)
                # the lr this update used, logged as train/lr: read before the scheduler moves to the next one's
                self._update_lr = max(g["lr"] for g in self.optimizer.param_groups)
                if self.scheduler is not None and self.per_step_schedule:
                    self.scheduler.step_update(state.step)
                epoch_done = state.epoch + 1 if state.epoch_batches >= total * self.accum_steps else None
                if self.validates is not None and self.validates(state.step, epoch_done):
                    state.validation_due = True  # in every write of this update until the caller validates
                stage = "data"
                window.add_update(images_per_update, grad_norm)
                if bar is not None:
                    bar.update(1)
                # The update that ends the window (a log step, the epoch's last update, a validation's, max_steps)
                # logs it at once, before a checkpoint of the same update (train.ckpt_every_steps, or one written
                # after an error) could carry it: a checkpoint carries exactly the updates not yet logged. Logged
                # after the epoch, that window was in the checkpoint too, and a run resumed there logged it again.
                if state.step % self.log_every == 0 or self._window_ends(state, total):
                    self._log(state, window, bar, total)
                if self.ckpt_every and state.step % self.ckpt_every == 0:
                    stage = "save"
                    self._save(window, state)
                    stage = "data"
                if self.max_steps is not None and state.step >= self.max_steps:
                    reason = "max_steps"
                    break
                if self.should_stop is not None and self.should_stop(state.step):
                    reason = "preempted"
                    break
                if self.eval_every and state.step % self.eval_every == 0:
                    reason = "validate"
                    break
                waiting_since = time.perf_counter()
        except Exception as error:
            if bar is not None:
                bar.close()
            self._keep_progress(error, stage, state, micro, window)
            raise
        if bar is not None:
            bar.close()
        # Both read the window's sums (a collective): a batch that a rank could not load raises here on every
        # rank, also when it ended the loop through `request_stop` (reason 'preempted'), so the caller never
        # takes that stop for a preemption (no checkpoint of the updates since, no 'preempted' message).
        # The window ends where a run never stopped ends it: at the epoch's end, a validation's update
        # (eval_every) or train.max_steps. A stop request between log steps ends none: the window stays open, its
        # sums go into the checkpoint the caller writes now (`checkpoint`) and the resumed run goes on with them;
        # logged here, it was an extra record, and the resumed run's next one the mean of its own updates only.
        epoch_done = state.epoch_batches >= total * self.accum_steps
        validated = bool(self.eval_every and state.step % self.eval_every == 0)
        cut = reason == "preempted" and not epoch_done and not validated
        if window.updates and not cut:
            self._log(state, window, None, total)
        window.check_finite(state.step, self.saved_step)  # a host sync: the epoch's kernels have finished
        self._settle_skipped_steps(state)  # the caller may checkpoint `state` now
        if so_far is not None:
            so_far = self._epoch_costs(so_far, epoch_t0, state)
        if state.epoch_batches >= total * self.accum_steps and so_far is not None and self.log_epoch_costs \
                and self.log is not None:
            self.log(state.step, {"epoch/train_seconds": so_far[2],
                                  "epoch/first_in_process": state.epoch == self._first_epoch,
                                  **({"epoch/max_mem_mib": so_far[3]} if _measures_cuda(self.device) else {})})
        if reason == "validate":  # continued by the next call, after the validation
            self._epoch_costs_so_far = so_far
        if state.epoch_batches >= total * self.accum_steps:  # the epoch is complete, also when a stop came
            state.epoch += 1  # at its last update: a resumed run starts the next epoch, not an empty one
            state.epoch_batches = 0
            if reason in ("max_steps", "validate"):
                reason = "epoch_end"  # the caller validates by the step (eval_every, max_steps) and the epoch
        return reason

    def _rank_batches(self, batches: TrainBatches, window: "_Window",
                      state: TrainState) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches, unreadable samples replaced. Under DDP a batch this rank cannot load (the loader
        raises, or a batch has no readable image) does not end this rank at once: the others would wait for it
        in the gradient all-reduce of the update, and no per-update collective exists to tell them. The error
        goes into the window's sums instead (the loop's next collective: a log step, before a checkpoint, the
        epoch's end), where every rank raises (the others OtherRankError), and until then this rank trains on
        its last good batch again, so that the ranks keep meeting in the same collectives; the weights updated
        meanwhile are never saved (every checkpoint is written after those sums). With `request_stop` (a
        Preemption's per-update stop agreement) the rank also raises its stop flag: every rank leaves the
        loop within two updates, and run_epoch reads the sums at once. The last good batch is kept
        across epochs: one of the previous epoch stands in as well (same loader, so the same shape; its
        content does not matter, as nothing trained on it is kept). Before this loop's first batch (the run's,
        also a resumed one's) there is none: that first fetch ends in one agreement (a single all-reduce per
        run), where a failure on any rank ends every rank."""
        agree = self.world_size > 1 and self._stand_in is None  # the same on every rank (see the end)
        loader = None
        while True:
            if window.data_error is None:
                try:
                    loader = iter(batches.loader) if loader is None else loader  # a worker may fail to start
                    images, targets = next(loader)
                    if batches.unreadable is not None:
                        images, targets = self._replace_unreadable(batches, images, targets, window)
                except StopIteration:
                    if agree:  # the others wait in the agreement for this rank's first batch
                        self._agree_on_first_batch(None, state)
                    return
                except Exception as error:
                    if self.world_size == 1:
                        raise
                    if agree:
                        self._agree_on_first_batch(error, state)  # raises on every rank
                    if self._stand_in is None:  # only after a loader that was empty at the agreement
                        raise
                    window.data_error = error
                    if self.request_stop is not None:
                        self.request_stop()
                    log.error("rank %d could not load a batch of update %d (%s: %s); the other ranks learn it %s, "
                              "where every rank stops", self.rank, state.step + 1, type(error).__name__, error,
                              "within two updates (the stop agreement)" if self.request_stop is not None
                              else "at the next log step, checkpoint or epoch end")
                else:
                    self._stand_in = images, targets
                    if agree:
                        agree = False
                        self._agree_on_first_batch(None, state)
            # after the agreement every rank holds a batch (or its loader was empty on every rank: the same
            # lengths under DistributedSampler), so the next run_epoch agrees again on all ranks or on none
            yield self._stand_in

    def _agree_on_first_batch(self, error: Optional[Exception], state: TrainState) -> None:
        """One all-reduce of whether any rank failed to load its first batch of this loop: then every rank
        raises (this rank its own error, the others OtherRankError), before any gradient all-reduce."""
        if error is not None:
            log.error("rank %d could not load its first training batch (update %d, %s: %s); every rank stops",
                      self.rank, state.step + 1, type(error).__name__, error)
        raise_on_every_rank(error, self.device, lambda: OtherRankError(
            "another rank could not load its first training batch; its output says why"))

    def _replace_unreadable(self, batches: TrainBatches, images: torch.Tensor, targets: torch.Tensor,
                            window: "_Window") -> tuple[torch.Tensor, torch.Tensor]:
        """Replace the samples the data set marked unreadable (`batches.unreadable`); name and count them."""
        images, targets, names = batches.unreadable(images, targets)
        if names:
            window.unreadable += len(names)
            log.warning("%d unreadable training image(s) replaced by others of their batch: %s%s", len(names),
                        ", ".join(names[:10]), " ..." if len(names) > 10 else "")
        return images, targets

    def _keep_progress(self, error: Exception, stage: str, state: TrainState, micro: int,
                       window: "_Window") -> None:
        """After an exception inside the epoch: keep what was trained since the last checkpoint, or say
        where the run resumes from. One process writes checkpoint.pt at the last completed update (the
        micro-batches of the unfinished one are read again on resume); under DDP the other ranks may be
        waiting in a collective, so the last checkpoint stays the resume point."""
        # a write held for this update's loss: made as a write at once would have left checkpoint.pt
        self.keep_held(error)
        if isinstance(error, _DELIBERATE) or self.save is None:
            return  # these say themselves what was kept
        last = "re-run the same command to resume from the last checkpoint.pt"
        if stage == "save" and (error is window.data_error or isinstance(error, OtherRankError)):
            stage = "data"  # a rank's failed batch, learnt before the checkpoint was written: nothing was written
        if stage == "save":
            log.error("writing the checkpoint at update %d failed; %s", state.step, last)
            return
        if stage == "step":
            log.error("%s inside the optimizer step of update %d (weights partly updated, not saved); %s",
                      type(error).__name__, state.step + 1, last)
            return
        state.epoch_batches -= micro
        self.optimizer.zero_grad(set_to_none=True)
        if self.world_size > 1 or state.step == 0:
            log.error("%s at update %d; %s", type(error).__name__, state.step + 1,
                      last if state.step else "nothing was trained yet: fix the cause and re-run the command")
            return
        try:
            window_loss = window.check_finite(state.step, self.saved_step)  # never a checkpoint of a diverged run
            self._settle_skipped_steps(state)
            self._settle_initial_loss(state)
            # the window is carried as at the last completed update (`_Window.record`: the unfinished update's
            # micro-batches are read again on resume); the sources' sums hold this update's forwards too, once it
            # has begun, and cannot leave them out: not carried then (their next record is the resumed run's own)
            written = self.checkpoint(state, window_loss if window.micro else None, carry_sources=micro == 0)
        except Exception as save_error:  # noqa: BLE001 - the first error is the one to raise
            log.error("%s at update %d, and checkpoint.pt could not be written (%s); %s", type(error).__name__,
                      state.step + 1, save_error, last)
            return
        if not written:  # the loss is high: the last good checkpoint stays the resume point (the warning above)
            log.error("%s at update %d: %s; fix the cause and re-run the same command", type(error).__name__,
                      state.step + 1, kept_text(self.saved_step))
            return
        log.error("%s at update %d: checkpoint.pt written at update %d, the last one completed; fix the cause "
                  "and re-run the same command to resume from there", type(error).__name__, state.step + 1,
                  state.step)

    def _epoch_costs(self, so_far: Tuple[int, int, float, float], t0: float,
                     state: TrainState) -> Tuple[int, int, float, float]:
        """`so_far` with the part of the epoch run since `t0` added. epoch/train_seconds: wall time of the epoch's
        updates (no validation, no checkpoint; rank 0's clock, the ranks having just synchronised), summed over
        the parts that mid-epoch validations split it into; epoch/max_mem_mib: this rank's peak
        torch.cuda.max_memory_allocated during them (CUDA only). The paper's efficiency protocol (Sec. 4.3)
        reads these, scripts/bench_overhead.py --protocol epochs."""
        peak = torch.cuda.max_memory_allocated(self.device) / 2 ** 20 if _measures_cuda(self.device) else 0.0
        return state.epoch, state.epoch_batches, so_far[2] + time.perf_counter() - t0, max(so_far[3], peak)

    def _optimizer_step(self) -> Optional[torch.Tensor]:
        grad_norm = None
        if self.clip_grad is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            grad_norm = nn.utils.clip_grad_norm_(params, self.clip_grad)
        # Step pre-hooks (the CD update) run inside here, after clipping and only if the step runs.
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _settle_initial_loss(self, state: TrainState) -> None:
        """Set the divergence guard's reference once the first update is complete (one collective): at log
        steps and before every checkpoint, so that a checkpoint written before the first log step carries it and
        a run resumed from it keeps the first update's loss, not that of the first update after the resume."""
        if state.initial_loss is None and self._first_update_done:
            state.initial_loss = all_reduce(self._first_loss).item() / self.world_size

    def _window_ends(self, state: TrainState, updates_in_epoch: int) -> bool:
        """Whether the update just made ends the log window besides a log step: the epoch's last, a validation's
        (train.eval_every_steps) or the run's last (train.max_steps), as a run never stopped ends it."""
        return (state.epoch_batches >= updates_in_epoch * self.accum_steps
                or bool(self.eval_every and state.step % self.eval_every == 0)
                or (self.max_steps is not None and state.step >= self.max_steps))

    def _save(self, window: "_Window", state: TrainState) -> None:
        window_loss = window.check_finite(state.step, self.saved_step)  # never write a checkpoint from a diverged run
        self._settle_skipped_steps(state)
        self._settle_initial_loss(state)
        # the run goes on after it: held for the next update's loss (a stop at this update writes at once, over it)
        self.checkpoint(state, window_loss if window.micro else None, goes_on=True)

    def checkpoint(self, state: TrainState, window_loss: Optional[float] = None, final: bool = False,
                   carry_sources: bool = True, goes_on: bool = False,
                   on_kept: Optional[Callable[[], None]] = None) -> bool:
        """Write checkpoint.pt from `state` (`save`), unless the divergence guard sees a high loss: a streak of
        high log windows (`state.divergence_streak` > 0), or `window_loss` (the mean loss of the updates since the
        last log step, all ranks; None: the open log window's, one a stop request cut) above its threshold. Then
        nothing is written and a warning names the checkpoint kept (`saved_step`): a run the guard stops later, or
        one stopped by a signal meanwhile, resumes from weights written while the loss was under the threshold, not
        from diverged ones. `final`: the write that ends the run's schedule, made all the same (the guard has not
        stopped the run, so it finished: its checkpoint.pt is its last weights, with the streak, not an earlier
        point a re-run would train from again).
        Weights (or EMA weights) that hold a NaN or an inf are never written, `final` or not.
        Those losses were all computed before the update that made the weights written, so `goes_on` (the run
        trains on after this write: train.ckpt_every_steps, an epoch's end, a validation's update) holds the write
        back (`checkpoint_file`) until the next update has measured its weights (`_settle_held`): only then does it
        replace checkpoint.pt and become `saved_step`, and `on_kept` (at once for a write made at once) runs.
        The log window open since the last log step goes into the checkpoint (TrainState.log_window), as it was at
        the last completed update; `carry_sources`: with the window sources' sums (False after an error inside an
        update, whose forwards they hold and cannot leave out). Returns whether checkpoint.pt was written
        (or held back). The same decision on every rank (the streak and the loss are all-reduced values)."""
        if self.save is None:
            return False
        self._settle_initial_loss(state)  # a stop request before the first log step: the checkpoint carries it too
        if window_loss is None and self._window is not None and self._window.updates:
            # a window a stop request cut (every other window that ends is logged, the guard's check made): the
            # updates since the last log step are judged as at a periodic write (`updates`: alike on every rank)
            window_loss = self._window.check_finite(state.step, self.saved_step)
        window_high = (state.divergence_streak == 0 and window_loss is not None and self.divergence is not None
                       and self.divergence.high(window_loss, state.initial_loss))
        why = None
        if state.divergence_streak > 0:
            why = (f"the training loss was above the threshold in the last {state.divergence_streak} log "
                   f"window(s)")
        elif window_high:
            why = f"the training loss since the last log step ({window_loss:.4g}) is above the threshold"
        if write_withheld(state.divergence_streak, final, window_high):
            log.warning("%s", withheld_line(state.step, why, self.saved_step))
            return False
        if self._weights_not_finite():
            log.warning("%s", nonfinite_weights_line(state.step, self.saved_step))
            return False
        if why is not None:  # the final write, made all the same
            log.warning("the run ends at update %d; %s (the divergence guard, train.divergence_factor): "
                        "checkpoint.pt is written all the same, the run's last weights", state.step, why)
        # a window open since the last log step (this write comes between two, or a stop cut it): its sums over
        # every rank go into the checkpoint, the resumed run goes on with them (TrainState.log_window)
        if self._window is not None and self._window.updates:
            state.log_window = {"loop": self._window.record(),
                                **{name: get() for name, (get, _) in self.window_sources.items() if carry_sources}}
        held = goes_on and self.checkpoint_file is not None
        try:
            if held:
                self.save(held=True)
            else:
                self.save()
        finally:
            state.log_window = None  # only the checkpoint carries it (not best.pt, written from `state` later)
        self._on_kept = on_kept if held else None  # a write held before at this update is superseded by this one
        if held:
            return True
        self.saved_step = state.step
        if on_kept is not None:
            on_kept()
        return True

    def _held_step(self) -> Optional[int]:
        """The update of the checkpoint.pt write held back (`checkpoint(goes_on=True)`), None when none is."""
        return None if self.checkpoint_file is None else self.checkpoint_file.held_step

    def _settle_held(self, update_loss: torch.Tensor, state: TrainState) -> None:
        """The update in progress (its step not yet made) computed its loss (`update_loss`: this rank's sum over its
        micro-batches) on the weights of the held write: publish it (checkpoint.pt, `saved_step`) when that loss,
        the mean over all ranks (one collective), is finite and not above the divergence guard's threshold; delete
        it otherwise, with a warning naming the checkpoint kept. The same verdict on every rank."""
        mean = all_reduce(update_loss.reshape(1)).item() / (self.accum_steps * self.world_size)
        self._settle_initial_loss(state)
        high = not math.isfinite(mean) or (self.divergence is not None
                                           and self.divergence.high(mean, state.initial_loss))
        on_kept, self._on_kept = self._on_kept, None
        if high:
            step = self.checkpoint_file.discard()
            threshold = (self.divergence.factor * state.initial_loss
                         if self.divergence is not None and state.initial_loss else None)
            log.warning("%s", held_dropped_line(step, state.step + 1, mean, threshold, self.saved_step))
            return
        self.saved_step = self.checkpoint_file.publish()
        if on_kept is not None:
            on_kept()

    def keep_held(self, error: Optional[BaseException] = None) -> None:
        """The run stops (`error`: fails, or a second interrupt stops it at once) before an update measures the held
        write's weights: no loss will come, so the write is made as the run's last writes are, renamed over
        checkpoint.pt (after an error this process alone: checkpoint.pt of the last completed update, as a write at
        once would have left it), unless the error is one that stops a run on purpose (a NaN, the divergence guard):
        then it is deleted."""
        if self._held_step() is None:
            return
        on_kept, self._on_kept = self._on_kept, None
        if isinstance(error, _DELIBERATE):
            self.checkpoint_file.discard()
            return
        if error is None:
            self.saved_step = self.checkpoint_file.publish()
            if on_kept is not None:
                on_kept()
            return
        try:
            self.saved_step = self.checkpoint_file.publish(collective=False)
        except Exception as publish_error:  # noqa: BLE001 - the first error is the one to raise
            log.error("%s", publish_error)

    def _weights_not_finite(self) -> bool:
        """Whether the model's parameters or the EMA's hold a NaN or an inf on any rank: one max-norm per tensor
        (foreach, per device and dtype, no host sync) and one all-reduced flag."""
        tensors = [p for p in unwrap_model(self.model).parameters()]
        if isinstance(self.ema, nn.Module):  # timm's ModelEmaV3 (a stand-in with only update() holds no weights)
            tensors += list(self.ema.parameters())
        groups: dict = {}
        for t in tensors:
            if t.is_floating_point() and t.numel():
                groups.setdefault((t.device, t.dtype), []).append(t.detach())
        bad = torch.zeros(1, device=self.device)
        for group in groups.values():
            norms = torch.stack(torch._foreach_norm(group, math.inf)).float()
            bad += (~torch.isfinite(norms)).any().to(self.device, torch.float32)
        return all_reduce(bad).item() > 0

    def _log(self, state: TrainState, window: "_Window", bar, updates_in_epoch: int) -> None:
        metrics = window.flush(state.step, self.saved_step)
        if self.sample_tokens:
            metrics["train/tok_per_s"] = metrics["train/img_per_s"] * self.sample_tokens
        state.unreadable_images += metrics.get("train/unreadable_images", 0)
        self._settle_initial_loss(state)
        metrics["train/lr"] = self._update_lr
        metrics["train/epoch"] = (state.epoch
                                  + state.epoch_batches / max(1, updates_in_epoch * self.accum_steps))
        self._settle_skipped_steps(state)
        metrics["train/skipped_steps"] = state.skipped_steps
        if self.scaler is not None:
            metrics["train/loss_scale"] = self.scaler.get_scale()
        for source in self.metric_sources:
            metrics.update(source())
        if bar is not None:
            bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", lr=f"{metrics['train/lr']:.2e}",
                            img_s=f"{metrics['train/img_per_s']:.0f}")
        if self.log is not None:
            self.log(state.step, metrics)
        # after the window is logged, so that the window that stops the run is in metrics.jsonl and the log
        # (a NaN window is not: `flush` raises before, its loss being in the error line)
        if self.divergence is not None:  # the streak so far, also of the run before a resume (0 in older checkpoints)
            self.divergence.streak = state.divergence_streak
            self.divergence.check(state.step, metrics["train/loss"], state.initial_loss, kept_step=self.saved_step)
            state.divergence_streak = self.divergence.streak


class _Window:
    """Running sums between two log steps, kept on the device (one host sync per log step)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.data_error: Optional[Exception] = None  # this rank's batch that failed to load (TrainLoop._rank_batches)
        self._reset()

    def _reset(self):
        # in float64, where a sum of float32 losses is exact (while the largest is under 2^(29 - log2 n) times the
        # smallest nonzero one, n the micro-batches summed), so that it does not depend on the order of the
        # additions, which a resume under DDP changes (the sum every rank carried, then this rank's own; `carry_on`):
        # the resumed run logs the window with the bits of a run never stopped. train.device is cpu or cuda, which
        # both have float64 (MPS has not)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.micro = 0
        self.updates = 0
        self.images = 0
        self.grad_norm = None
        self.data_wait = 0.0  # seconds the main process waited for the next batch
        self.unreadable = 0  # training samples replaced because they could not be read
        self.t0 = time.perf_counter()
        self._close_update()

    def add_loss(self, loss: torch.Tensor) -> None:
        # a new tensor, not a sum in place: `_completed` keeps the one of the last update's step
        self.loss_sum = self.loss_sum + loss.double()
        self.micro += 1

    def add_update(self, images: int, grad_norm: Optional[torch.Tensor]) -> None:
        self.updates += 1
        self.images += images
        if grad_norm is not None:
            self.grad_norm = grad_norm
        self._close_update()

    def _close_update(self) -> None:
        """Keep the sums as they are now, at an update's step (or the window's start): what `record` carries into a
        checkpoint. The micro-batches (losses, unreadable samples, waits) of the update in progress stay apart from
        them: after an error inside that update the resumed run reads its micro-batches again, which carried as well
        would count twice in the window's train/loss."""
        self._completed = (self.loss_sum, self.micro, self.unreadable, self.data_wait, time.perf_counter())

    def _global_sums(self, completed: bool = False) -> tuple[float, float, float]:
        """(sum of losses, micro-batches, unreadable samples) over all ranks: a NaN on any rank stops every
        rank (the NaN gradient was averaged into all of them), and train/loss is the global mean. One
        collective, which also carries whether a rank failed to load a batch: then every rank raises (that
        rank its own error, the others OtherRankError). `completed`: those of the completed updates only, the
        update in progress left out (`_close_update`)."""
        loss_sum, micro, unreadable = self._completed[:3] if completed else (self.loss_sum, self.micro,
                                                                             self.unreadable)
        counts = [micro, unreadable, self.data_error is not None]
        totals = torch.cat([loss_sum.reshape(1), torch.tensor(counts, dtype=torch.float64, device=self.device)])
        loss_sum, micro, unreadable, failed = all_reduce(totals).tolist()
        raise_where_failed(self.data_error, bool(failed), lambda: OtherRankError(
            f"another rank could not load its training batches ({int(failed)} rank(s)); its output says why"))
        return loss_sum, micro, unreadable

    def record(self) -> dict:
        """The window's sums at its last completed update, over every rank (one collective, as `flush`): what a
        checkpoint written inside it carries (`TrainLoop.checkpoint`) for the resumed run to go on with (`carry_on`).
        The checkpoint holds that update's state, so the update in progress, if any, is left out: the resumed run
        reads its micro-batches again."""
        loss_sum, micro, unreadable = self._global_sums(completed=True)
        data_wait, closed_at = self._completed[3:]
        return {"loss_sum": loss_sum, "micro": micro, "unreadable": unreadable, "updates": self.updates,
                "images": self.images, "grad_norm": None if self.grad_norm is None else float(self.grad_norm),
                "data_wait": data_wait, "seconds": closed_at - self.t0}

    def carry_on(self, record: dict, main: bool, micro_per_update: Optional[int] = None) -> None:
        """Go on with the window a checkpoint cut (`record`): the sums over all ranks on the main rank only (`main`;
        `flush` adds every rank's), the counts every rank keeps alike on every rank; its time (the seconds before the
        stop) counts in train/img_per_s and train/data_wait, the resume's start-up does not. `micro_per_update`: the
        micro-batches of one update over all ranks in this run (accumulation steps x processes)."""
        loss_sum, micro, updates = record["loss_sum"], record["micro"], record["updates"]
        if micro_per_update and updates and micro and micro != updates * micro_per_update:
            # written with the global batch in other micro-batches (another train.batch_size_per_gpu, e.g. with
            # another process count): train/loss, the mean of the micro-batches' means, would weigh each update by
            # its number of micro-batches; the carried updates count as many as this run's do (their mean loss kept)
            loss_sum, micro = loss_sum * (updates * micro_per_update) / micro, updates * micro_per_update
        if main:
            self.loss_sum = self.loss_sum + loss_sum
            self.micro += int(micro)
            self.unreadable += int(record["unreadable"])
        self.updates += record["updates"]
        self.images += record["images"]
        self.grad_norm = record["grad_norm"]
        self.data_wait += record["data_wait"]
        self.t0 -= record["seconds"]
        self._close_update()  # the carried updates are completed ones

    def check_finite(self, step: Optional[int], kept_step: Optional[int], sums: Optional[tuple] = None) -> float:
        """Raise NonFiniteLossError if the window's loss is NaN/inf on any rank, naming the checkpoint kept
        (`kept_step`: TrainLoop.saved_step, None when none was written); return the global mean loss. `sums`:
        `_global_sums()` if already taken."""
        loss_sum, micro, _ = sums or self._global_sums()
        if not math.isfinite(loss_sum):
            raise NonFiniteLossError(f"the training loss is {loss_sum} at or before update {step}; stopping "
                                     f"without writing a checkpoint: {kept_text(kept_step)}")
        return loss_sum / max(micro, 1.0)

    def flush(self, step: int, kept_step: Optional[int]) -> dict:
        sums = self._global_sums()
        mean_loss, unreadable = self.check_finite(step, kept_step, sums), sums[2]
        elapsed = time.perf_counter() - self.t0
        metrics = {"train/loss": mean_loss, "train/img_per_s": self.images / max(elapsed, 1e-9),
                   "train/data_wait": self.data_wait / max(elapsed, 1e-9),  # share of the window's time
                   "train/peak_mem_mib": _peak_mem_mib(self.device)}
        if self.grad_norm is not None:
            metrics["train/grad_norm"] = float(self.grad_norm)  # the last update's (clipping on)
        if unreadable:
            metrics["train/unreadable_images"] = int(unreadable)  # all ranks, this window
        self._reset()
        return metrics


@contextmanager
def progress_kept_on_error(save: Callable[[], None], model: nn.Module, step: int, distributed: bool,
                           what: str, diverging: bool = False) -> Iterator[None]:
    """Around work between an epoch's last update and its checkpoint (the validation): an exception first
    writes checkpoint.pt (one process; finite weights only), so that the epoch's updates are kept and the
    resumed run repeats the work (`save` must record that it is due); under DDP another rank may wait in a
    collective, so the last checkpoint stays the resume point, as it does while the divergence guard counts
    high log windows (`diverging`: TrainLoop.checkpoint writes nothing then either). The log says which,
    before the error."""
    try:
        yield
    except Exception as error:
        last = "re-run the same command to resume from the last checkpoint.pt"
        bad = [] if distributed or diverging else nonfinite_tensors(unwrap_model(model).state_dict())
        if distributed or diverging or bad or isinstance(error, DivergenceError):
            why = (f": the weights are not finite ({bad[0]}), not saved" if bad else
                   ": the training loss is above the divergence guard's threshold, not saved" if diverging else "")
            log.error("%s failed at update %d (%s)%s; %s", what, step, type(error).__name__, why, last)
            raise
        try:
            save()
        except Exception as save_error:  # noqa: BLE001 - the first error is the one to raise
            log.error("%s failed at update %d (%s) and checkpoint.pt could not be written (%s); %s", what, step,
                      type(error).__name__, save_error, last)
            raise error from None
        log.error("%s failed at update %d (%s): checkpoint.pt written; fix the cause and re-run the same command "
                  "to resume (the %s is done first)", what, step, type(error).__name__, what)
        raise


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, amp: str = "none", progress: str = "",
             should_stop: Optional[Callable[[], bool]] = None) -> Optional[dict]:
    """Top-1 / top-5 (percent) and mean cross-entropy over the whole loader, summed over all ranks. Top-5 only
    for a model of more than 5 classes: with 5 or fewer every label is among the 5 best, 100 % whatever the model.

    With `ShardedEvalSampler` every image is counted exactly once across ranks. A negative target marks
    a sample the data set could not read (data/folder.py: -1 - index): it is excluded from every count,
    and its file is named in a warning. `progress`: a label for a progress bar (shown on a terminal
    only); "" for none. `should_stop` (a preemption request, the same answer on every rank): asked before
    every batch that all ranks have (shards may differ by one batch); when it says stop, the evaluation
    ends at once and returns None.

    Returns:
        {"top1", "top5" (more than 5 classes), "loss", "count" (images scored), "excluded" (unreadable images left
        out)}.
    Raises NothingScoredError when no image was scored.
    """
    model.eval()
    dataset = getattr(loader, "dataset", None)
    # correct@1, correct@5, loss, count, excluded, ranks whose loader failed, batches of more than 5 classes (a rank
    # without a batch learns the class count from the others)
    sums = torch.zeros(7, device=device, dtype=torch.float64)
    # the first batch with a NaN / inf logit, as -(batch * world + rank) (max-reduced), kept on the device
    none_bad = -float(2 ** 62)
    first_bad = torch.full((), none_bad, device=device, dtype=torch.float64)
    world, rank = _world_and_rank()
    batch_size = getattr(loader, "batch_size", None) or 1
    unreadable: list[int] = []
    batches = EvalBatches(loader, device, progress, should_stop)
    for index, (images, targets) in batches:
        bad = targets < 0  # on the host, before the copy: no device sync
        if bad.any():
            unreadable += (-1 - targets[bad]).tolist()
            images, targets = images[~bad], targets[~bad]
            if len(targets) == 0:
                continue
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast(amp, device):
            logits = model(images)
        logits = logits.float()
        first_bad = torch.where(torch.isfinite(logits).all() | (first_bad > none_bad), first_bad,
                                -float(index * world + rank))  # a scalar argument: no host-to-device copy
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hits = top5 == targets[:, None]
        # the count as a fill on the device: torch.tensor(..., device=cuda) is a blocking copy (a host sync)
        sums[:4] += torch.stack([hits[:, 0].sum(), hits.any(1).sum(),
                                 F.cross_entropy(logits, targets, reduction="sum"),
                                 torch.full((), len(targets), device=device)]).double()
        sums[6] += int(logits.shape[1] > 5)
    if batches.stopped:
        return None
    sums[4] = len(unreadable)
    sums[5] = float(batches.error is not None)
    if unreadable:
        names = [dataset.filename(i) if hasattr(dataset, "filename") else f"sample {i}" for i in unreadable]
        log.warning("%d unreadable image(s) left out of the evaluation: %s%s", len(names),
                    ", ".join(names[:10]), " ..." if len(names) > 10 else "")
    all_reduce(sums)
    batches.raise_if_failed(sums[5].item())
    bad = -all_reduce(first_bad, op="max").item()
    if bad < -none_bad or not math.isfinite(sums[2].item()):
        raise NonFiniteLossError(_nonfinite_message(progress, bad, -none_bad, world, batch_size, dataset))
    correct1, correct5, loss, count, excluded, _, top5_batches = sums.tolist()
    if count == 0:  # the same sums on every rank: every rank raises
        raise NothingScoredError(f"{progress or 'evaluation'}: no image was scored: " + (
            f"all {int(excluded)} image(s) are unreadable (named in the warning above); replace or remove them"
            if excluded else "the data loader yielded no image; check the split's folder and the data settings"))
    return {"top1": 100.0 * correct1 / count, **({"top5": 100.0 * correct5 / count} if top5_batches else {}),
            "loss": loss / count, "count": int(count), "excluded": int(excluded)}


class EvalBatches:
    """(index, batch) over `loader` for an evaluation that runs on every rank, behind a progress bar when
    `progress` is a label. `should_stop` (a preemption request, the same answer on every rank) is asked before
    every batch that all ranks have (shards may differ by one batch; their minimum length is one collective,
    taken first); when it says stop, the iteration ends with a line saying after how many batches, and `stopped`
    is True, so the caller returns None."""

    def __init__(self, loader, device: torch.device, progress: str = "",
                 should_stop: Optional[Callable[[], bool]] = None) -> None:
        self.loader, self.progress, self.should_stop, self.stopped = loader, progress, should_stop, False
        self.common = 0
        self.error: Optional[Exception] = None  # a batch this rank could not load (several ranks only)
        if should_stop is not None:  # the batches every rank has: -max(-len) = min over ranks
            self.common = -int(all_reduce(torch.tensor([-float(len(loader))], device=device), op="max").item())

    def __iter__(self) -> Iterator[tuple]:
        """Under several ranks a batch that fails to load ends the iteration with `error` set instead of
        raising: the caller adds it to the sums it all-reduces at the end, where every rank raises (the
        others would wait there for this rank). The stop agreements of the batches left are still taken, so
        that the ranks meet in the same collectives."""
        batches = iter(progress_iter(self.loader, self.progress) if self.progress else self.loader)
        index = 0
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as error:
                if _world_and_rank()[0] == 1:
                    raise
                self.error = error
                log.error("rank %d could not load evaluation batch %d (%s: %s); every rank stops after the "
                          "evaluation", _world_and_rank()[1], index, type(error).__name__, error)
                for agreed in range(index, self.common):
                    if self.should_stop():
                        self._cut_short(agreed)
                        return
                return
            if index < self.common and self.should_stop():
                self._cut_short(index)
                return
            yield index, batch
            index += 1

    def _cut_short(self, index: int) -> None:
        """Marks the evaluation stopped at batch `index` (the same on every rank: the stop is agreed) and says
        that the stop cut it short (not that it came before or after one), and how far."""
        self.stopped = True
        log.info("%s stopped by the stop request after %d of %d batches", self.progress or "evaluation",
                 index, len(self.loader))

    def raise_if_failed(self, failed_ranks: float) -> None:
        """After the all-reduce of the sums that carried `error is not None`: this rank's error, or
        OtherRankError when `failed_ranks` (the sum) says another rank could not load a batch."""
        raise_where_failed(self.error, bool(failed_ranks), lambda: OtherRankError(
            f"{self.progress or 'evaluation'}: another rank could not load its batches ({int(failed_ranks)} "
            f"rank(s)); its output says why"))


def _world_and_rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _nonfinite_message(what: str, code: float, none: float, world: int, batch_size: int, dataset) -> str:
    """The error of an evaluation whose logits (or loss) are not finite, naming the first such batch."""
    where = "its loss"
    if code < none:
        batch, rank = divmod(int(code), world)
        first = rank + world * batch * batch_size  # ShardedEvalSampler: rank r holds images r, r + world, ...
        name = dataset.filename(first) if hasattr(dataset, "filename") else f"image {first}"
        where = (f"the logits of batch {batch}" + (f" of rank {rank}" if world > 1 else "")
                 + f" (first image {name})")
    return (f"{what or 'evaluation'}: {where} are NaN or inf, so no accuracy can be computed and nothing is "
            f"written; the weights (or the quantized model) produce non-finite numbers on these images "
            f"(with --amp fp16 / train.amp=fp16 an fp16 overflow can: try none or bf16)")


def progress_iter(loader, label: str):
    """`loader` with a progress bar labelled `label` on a terminal; as it is otherwise (log files, CI)."""
    if not sys.stderr.isatty():
        return loader
    from tqdm import tqdm

    return tqdm(loader, desc=label, leave=False, dynamic_ncols=True)


def _measures_cuda(device: torch.device) -> bool:
    """Whether the loop reads this rank's memory from torch.cuda's allocator statistics (on CUDA)."""
    return device.type == "cuda"


def _peak_mem_mib(device: torch.device) -> float:
    """Peak memory of this rank: CUDA memory allocated by tensors since run_epoch began (the epoch, or its part
    after a validation or a resume), else the process's peak resident set size (on the CPU, where tensors live in
    host memory)."""
    if _measures_cuda(device):
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 10  # KiB on Linux


def _progress_bar(total: int, initial: int, epoch: int, epochs: int, enabled: bool):
    """The epoch's bar on a terminal, labelled as the log lines count epochs (from 1, "epoch 1/2"); the console's
    log lines are written above it (engine/console.py)."""
    if not (enabled and sys.stderr.isatty()):  # no bar in log files and CI output
        return None
    from tqdm import tqdm

    label = f"epoch {epoch + 1}/{epochs}" if epochs else f"epoch {epoch + 1}"
    return tqdm(total=total, initial=initial, desc=label, leave=False, dynamic_ncols=True)
