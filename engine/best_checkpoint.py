"""best.pt: the weights with the best validation score so far, written when a validation improves on it.

The score is the task's (engine/tasks.py): the highest val top-1 of a classifier, the lowest val loss of a
language model. The best score lives in `TrainState.best_value`, which checkpoint.pt carries, so a resumed run only
overwrites best.pt when it beats every validation of the run before it. The payload is what evaluate.py
reads: the (unwrapped) model, its EMA if any, the run's config, the training state, the metrics of that
validation and the class names of the data set, and the caller's `extra` entries (train.py: the weights the run
started from, engine/start_weights.py, and the fingerprint of the data it trained on, `data_fingerprint`, which
evaluate.py compares with the data.root it scores under). train.py offers no validation of weights that the
divergence guard refuses to save as checkpoint.pt (Run.best_held_back: inside a streak of high losses, but at the
schedule's end).

On resume the checkpoint's best score must describe the best.pt in out_dir (`match_file`). Which write of best.pt
a score describes is told by the fingerprint of its weights (`TrainState.best_fingerprint`, recorded in the
checkpoint and in best.pt's own state), not by its update alone: two branches of a run (a roll-back to a snapshot
and a return to the branch it left) may both validate at the same update. After a roll-back to an earlier
snapshot (or a crash after a validation the last checkpoint does not know of) best.pt holds weights from beyond
the resume point, which the next improvement would overwrite; it is kept aside as best.until_step<N>.pt. The
resumed state's own best.pt, if an earlier move kept it so (a return to the branch a roll-back left), becomes
best.pt again (a hard link); otherwise the score is cleared and best.pt is written afresh by the resumed run's
first validation. So is a best.pt chosen on another validation set (a resume with train.allow_changed_config=true
and a new data.val_windows, data.val_split, eval crop, ...: engine/run_dir.VALIDATION_KEYS), whose score no new
validation can be compared with. A checkpoint or best.pt written before the fingerprint was recorded is matched
by the update at which best.pt was written. One best.pt the state does not know of stays: that of the validation of
the very weights the run resumes with (the write of update N held back before its validation, made checkpoint.pt
by a failed write after it: engine/checkpoint.CheckpointFile), whose score the resumed state takes on.
"""
from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from .checkpoint import weights_fingerprint
from .distributed import all_reduce, raise_on_every_rank
from .loop import TrainState
from .run_dir import RunDirError, keep_as_until_step
from .run_dir import link_or_copy

log = logging.getLogger(__name__)

__all__ = ["BestCheckpoint", "BestMatch"]


@dataclass(frozen=True)
class BestMatch:
    """What `BestCheckpoint.match_file` did (on the main rank; None everywhere on the others).

    kept: where a best.pt that was not the resumed state's was moved (best.until_step<N>.pt).
    restored: the kept file of the resumed state's own best validation, linked back as best.pt.
    lost: the update of the resumed state's best validation when no file in the folder holds its weights (the
        score is cleared; the next validation writes best.pt)."""

    kept: Optional[str] = None
    restored: Optional[str] = None
    lost: Optional[int] = None


class BestCheckpoint:
    """Keeps `path` at the best validation score; `save(payload_fn, path)` writes (on the main rank).
    `key` names the score in the validation metrics, `higher_is_better` its direction."""

    def __init__(self, path: str, *, model: nn.Module, ema: Optional[nn.Module], config: dict,
                 classes: Optional[list], save: Callable[[Callable[[], dict], str], None],
                 key: str = "val/top1", higher_is_better: bool = True, extra: Optional[dict] = None):
        self.path, self.model, self.ema, self.config, self.classes, self.save = \
            path, model, ema, config, classes, save
        self.extra = extra or {}
        self.key, self.higher_is_better = key, higher_is_better

    def match_file(self, state: TrainState, is_main: bool, device: torch.device,
                   other_validation: bool = False) -> BestMatch:
        """Make `state`'s best score that of the best.pt on disk, on every rank alike. A best.pt that is not the
        one `state`'s best validation wrote (`_describes`: another branch's, one from beyond the resume point,
        another run's when resumed into a new out_dir), or one scored on another validation set
        (`other_validation`), is moved aside as best.until_step<state.step>.pt. The file of `state`'s own best
        validation, found among the kept best.until_step*.pt, is linked back as best.pt; without one the score
        is cleared, so the next validation writes best.pt. A resume point with no validation yet is no
        exception: a best.pt beside it comes from beyond it (a roll-back to a snapshot written before the first
        validation), and that validation would overwrite it. But for one: a best.pt of the validation of the
        weights `state` resumes with (`_validates_resumed_weights`) stays, its score taken into `state`."""
        match, error, clear, adopted = BestMatch(), None, 1.0 if other_validation else 0.0, None
        if is_main:
            try:
                recorded = _recorded_state(self.path)
                stale = other_validation or not _describes(recorded, state)
                if stale and not other_validation:
                    adopted = self._validates_resumed_weights(recorded, state)
                if stale and adopted is None:
                    # lexists: a link of the user's that leads nowhere is moved aside too, not written over
                    kept = keep_as_until_step(self.path, state.step) if os.path.lexists(self.path) else None
                    # a best scored on another validation set is no score to restore
                    restored = None if other_validation else self._restore(state)
                    clear = 0.0 if restored else 1.0
                    lost = None if restored or other_validation or state.best_value is None else state.best_step
                    match = BestMatch(kept=kept, restored=restored, lost=lost)
            except OSError as e:
                error = RunDirError(f"cannot move {self.path} aside before resuming: {e}")
        raise_on_every_rank(error, device, lambda: RunDirError(f"rank 0 could not move {self.path} aside (its "
                                                               f"error says why)"))
        # float64: a score travels exactly; the other ranks add zeros (only rank 0 reads best.pt)
        shared = torch.tensor([clear, float(adopted is not None), *(adopted or (0.0, 0.0))], dtype=torch.float64,
                              device=device)
        clear, adopt, value, epoch = all_reduce(shared).tolist()
        if clear > 0:
            state.best_value, state.best_epoch, state.best_step, state.best_fingerprint = None, 0, 0, None
        elif adopt > 0:  # the weights are the same on every rank: each takes their fingerprint itself, as offer does
            state.best_value, state.best_epoch, state.best_step = value, int(epoch), state.step
            state.best_fingerprint = weights_fingerprint(self.model.state_dict())
            if is_main:
                log.info("best.pt is the validation of update %d, made after checkpoint.pt's write of that update: "
                         "kept, its score (%s %g) the resumed run's best", state.step, self.key, value)
        return match

    def _validates_resumed_weights(self, recorded: Optional[dict], state: TrainState) -> Optional[tuple[float, int]]:
        """(score, epoch) of best.pt (its training state `recorded`) where it is the file of a validation of the
        very weights `state` resumes with, made after the checkpoint was written (a held write of update N, its
        validation, then a failed write that made the held one checkpoint.pt: engine/checkpoint.CheckpointFile),
        and better than `state`'s best, as it was when written: the best of this branch up to `state.step`, which
        `state` does not record yet. None for any other best.pt. Told by the weights' fingerprint at the same
        update: a best.pt of any other weights (an earlier update's, another branch's) is not one of this run's
        validations the state has missed, but one it has left (match_file moves it aside)."""
        if recorded is None or recorded.get("step") != state.step or recorded.get("best_step") != state.step:
            return None
        value, fingerprint = recorded.get("best_value"), recorded.get("best_fingerprint")
        if not isinstance(value, (int, float)) or fingerprint is None:
            return None
        if state.best_value is not None and (value <= state.best_value if self.higher_is_better
                                             else value >= state.best_value):
            return None  # no better than the state's best: never written by the validation that followed it
        if fingerprint != weights_fingerprint(self.model.state_dict()):
            return None
        return float(value), int(recorded.get("best_epoch") or 0)

    def _restore(self, state: TrainState) -> Optional[str]:
        """Link the kept best.until_step*.pt that `state`'s best validation wrote back as best.pt (a return to the
        branch a roll-back left kept it so); its path, or None where no kept file is that write."""
        if state.best_value is None or state.best_fingerprint is None:
            return None
        stem, ext = os.path.splitext(self.path)
        for path in sorted(glob.glob(f"{glob.escape(stem)}.until_step*{ext}")):
            recorded = _recorded_state(path)
            if recorded is not None and recorded.get("best_fingerprint") == state.best_fingerprint:
                link_or_copy(path, self.path)  # a link: best.pt is replaced by new files, the kept one stays
                return path
        return None

    def offer(self, state: TrainState, metrics: dict) -> bool:
        """Write best.pt if metrics[key] beats state.best_value (which then becomes it); True if written.
        A tie is not better: the earlier weights stay."""
        value = metrics[self.key]
        if state.best_value is not None and (value <= state.best_value if self.higher_is_better
                                             else value >= state.best_value):
            return False
        state.best_value = value
        state.best_epoch = state.current_epoch
        state.best_step = state.step
        # which write this is, by its weights: deterministic, so an exact resume keeps the same state
        state.best_fingerprint = weights_fingerprint(self.model.state_dict())
        self.save(lambda: {"model": self.model.state_dict(), "config": self.config,
                           "state": state.state_dict(), "metrics": metrics, "classes": self.classes, **self.extra,
                           **({"model_ema": self.ema.module.state_dict()} if self.ema is not None else {})},
                  self.path)
        return True


def _describes(recorded: Optional[dict], state: TrainState) -> bool:
    """Whether best.pt, whose training state is `recorded` (None: missing or unreadable), is the file that
    `state`'s best validation wrote: by the weights' fingerprint both record; by the update for files of
    before it (where neither records one)."""
    if recorded is None or state.best_value is None:
        return False
    if recorded.get("best_fingerprint") is not None or state.best_fingerprint is not None:
        return recorded.get("best_fingerprint") == state.best_fingerprint
    return recorded.get("step") == state.best_step


def _recorded_state(path: str) -> Optional[dict]:
    """The training state a best.pt was written with, or None: missing or not readable."""
    if not os.path.isfile(path):
        return None
    payload = None
    for mmap in (True, False):  # mmap: only the small state is read; a file system without it reads it all
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            break
        except Exception:  # noqa: BLE001 - a file unreadable both ways is one that no score describes
            continue
    state = payload.get("state") if isinstance(payload, dict) else None
    return state if isinstance(state, dict) else None
