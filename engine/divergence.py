"""A guard for runs that diverge without a NaN: the loss stays far above its value at the start.

A NaN or inf loss already stops a run (engine/loop.py). A run with too high a learning rate can instead
blow up to a large finite loss and settle at chance level (digits at lr 1.0: loss 126, then 14, val
10%), which would otherwise end with exit code 0. The rule: the mean training loss of a log window
above `factor` x the loss of the run's first update, for `windows` consecutive log windows, stops the
run like a NaN does. A healthy run's loss falls below its starting value (ln(classes) for a fresh
classifier, with or without label smoothing, mixup, TWEO or CD's loss form) and a spike recovers within
a window or two, so the default (3x for 3 windows) acts only on diverged runs; `train.divergence_factor=null`
turns it off.

No checkpoint is written over the last good one: while the guard counts high windows (a streak above 0),
or while the updates since the last log step average above the threshold, checkpoint.pt is not replaced
(engine/loop.py: TrainLoop.checkpoint for the periodic, epoch-end, error and stop-request writes,
progress_kept_on_error for a failed validation's), so the checkpoint a stop keeps, and the one a stop request
during a streak leaves to resume from (that stop exits 1, not 75: a requeue would count the streak from 0 again
and could repeat for ever), was written while the loss was under the threshold; the lines say which update it is
of. The write that ends the schedule is made all the same (the run finished). best.pt follows the same rule (train.py
Run.validate): a validation during a streak writes none, so no file of the run holds weights the guard refused to
save, and a run stopped before its first checkpoint leaves only its logs, which the same command moves aside to start
afresh (engine/run_dir.check_fresh_start; a command with other settings needs train.archive_existing=true or another
out_dir, `kept_text`). The streak is part of the checkpointed TrainState
(engine/loop.py), but a checkpoint is written only at a streak of 0, so a resumed run counts from 0 at the
point it resumes from (a checkpoint of older versions may hold a streak above 0: it is counted on; with the
guard off there is no streak).

Every loss the guard reads was computed before its update's step, so the losses that allow a write never measured the
weights it holds: where the run goes on, the write of update k is held back (engine/checkpoint.py CheckpointFile,
engine/loop.py TrainLoop.checkpoint) until update k+1's loss, computed on those weights, is finite and not above the
threshold, and deleted otherwise (`held_dropped_line`); weights with a NaN or an inf are never written
(`nonfinite_weights_line`).
"""
from __future__ import annotations

import math
from typing import Optional

from .exit_codes import EXIT_PREEMPTED


class DivergenceError(RuntimeError):
    """The training loss stayed far above its initial value; the last good checkpoint is kept."""

    in_step = True  # the verdict on the all-reduced loss, the same on every rank: one line under torchrun


class DivergenceGuard:
    """Counts consecutive log windows whose mean loss exceeds `factor` x the initial loss."""

    def __init__(self, factor: float, windows: int) -> None:
        self.factor, self.windows = factor, windows
        self.streak = 0

    def high(self, mean_loss: float, initial_loss: Optional[float]) -> bool:
        """Whether `mean_loss` is above the threshold (never before the reference is known)."""
        return initial_loss is not None and initial_loss > 0 and mean_loss > self.factor * initial_loss

    def check(self, step: int, mean_loss: float, initial_loss: Optional[float],
              kept_step: Optional[int] = None) -> None:
        """Raise DivergenceError after `windows` high windows in a row (the same verdict on every rank,
        given the all-reduced `mean_loss`). `kept_step`: the update of the last checkpoint written (or resumed
        from), which the error names as the one kept; None when there is none."""
        if initial_loss is None or initial_loss <= 0:
            return
        self.streak = self.streak + 1 if self.high(mean_loss, initial_loss) else 0
        if self.streak >= self.windows:
            # a lower optim.lr is a changed setting: resumed from the kept checkpoint with allow_changed_config, or,
            # with none kept, refused beside this run's files unless they are archived (engine/run_dir.py)
            kept = (f"{kept_text(kept_step)}. Lower optim.lr (with train.allow_changed_config=true to resume from it)"
                    if kept_step is not None else f"none was written yet. Lower optim.lr and {CHANGED_RESTART}")
            raise DivergenceError(
                f"the training loss stayed above {self.factor:g}x its initial value {initial_loss:.4g} for "
                f"{self.streak} log windows (now {mean_loss:.4g} at update {step}): the run diverged. "
                f"Stopping without writing a checkpoint: {kept}, "
                f"or set train.divergence_factor=null to turn this check off")


# What a re-run with other settings (a lower optim.lr) needs when no checkpoint was written: out_dir holds this run's
# logs (config.yaml, train.log, metrics.jsonl), which only a re-run of the same settings moves aside by itself
# (engine/run_dir.check_fresh_start); best.pt is never among them (Run.validate holds it back during a streak).
CHANGED_RESTART = "re-run with train.archive_existing=true (this run's files are moved aside) or another out_dir"


def kept_text(kept_step: Optional[int]) -> str:
    """Which checkpoint stays the resume point when one is not written (a stop, a withheld write); with none, what a
    re-run does: the same command starts afresh, one with other settings needs CHANGED_RESTART."""
    if kept_step is None:
        return ("none was written yet, so the same command starts afresh (moving this run's logs aside); to change "
                f"a setting (a lower optim.lr), {CHANGED_RESTART}")
    return f"the last one, of update {kept_step}, is kept"


def write_withheld(streak: int, final: bool, window_high: bool = False) -> bool:
    """The divergence guard's rule for the files written from the training weights, checkpoint.pt
    (TrainLoop.checkpoint) and best.pt (train.py Run.best_held_back), so that the two cannot drift apart: nothing
    is written while the loss is high, a streak of `streak` > 0 high log windows or (checkpoint.pt's own check)
    the mean loss since the last log step (`window_high`), but the write that ends the run's schedule (`final`)."""
    return (streak > 0 or window_high) and not final


def withheld_line(step: int, why: str, kept_step: Optional[int]) -> str:
    """The warning of a checkpoint not written at update `step` because the loss is high (`why`)."""
    return (f"checkpoint.pt not written at update {step}: {why} (the divergence guard, train.divergence_factor); "
            f"{kept_text(kept_step)}, and the next checkpoint is written once the loss is back under it")


def nonfinite_weights_line(step: int, kept_step: Optional[int]) -> str:
    """The warning of a checkpoint not written at update `step` because the weights (or the EMA's) hold a NaN or an
    inf: never written, whatever the guard says (with it off, and at the run's end too)."""
    return (f"checkpoint.pt not written at update {step}: the weights hold a NaN or an inf (the update diverged; "
            f"lower optim.lr); {kept_text(kept_step)}")


def held_dropped_line(step: int, measured_at: int, loss: float, threshold: Optional[float],
                      kept_step: Optional[int]) -> str:
    """The warning of the checkpoint of update `step`, held back (engine/checkpoint.CheckpointFile) until a loss was
    measured on its weights, deleted: that loss, the mean of update `measured_at` over all ranks, is not finite or
    above the guard's `threshold` (None: the guard is off)."""
    why = (f"is {loss:.4g}, above the divergence guard's threshold {threshold:.4g} (train.divergence_factor)"
           if math.isfinite(loss) and threshold is not None else f"is {loss}")
    return (f"checkpoint.pt of update {step} not kept: the training loss of its weights, measured at update "
            f"{measured_at}, {why}; {kept_text(kept_step)}")


def withheld_stop_line(step: int, kept_step: Optional[int]) -> str:
    """The error of a stop request (a signal) during a divergence streak: the weights of update `step` are not
    written over the last good checkpoint, which the same command resumes from. An error (exit code 1), not a
    preemption (EXIT_PREEMPTED): a requeued run would resume from the kept checkpoint with its streak back at 0 and,
    stopped inside the streak again, be requeued for ever without progress."""
    where = (f"the last checkpoint, of update {kept_step}, is kept and the same command resumes from it"
             if kept_step is not None else "no checkpoint was written yet, so the same command starts afresh")
    how = ("(with train.allow_changed_config=true), and re-run" if kept_step is not None
           else f"and {CHANGED_RESTART}")
    return (f"stopped by a signal at update {step} while the training loss was above the divergence guard's "
            f"threshold: no checkpoint written, {where}; this exits 1, not {EXIT_PREEMPTED}, so that a requeue does "
            f"not repeat the same updates without end: check the loss in metrics.jsonl, lower optim.lr if it diverges "
            f"{how}")


def withheld_max_steps_line(step: int, kept_step: Optional[int]) -> str:
    """The line of a run stopped at train.max_steps at update `step` whose checkpoint the guard withheld."""
    then = ("; raise train.max_steps (or drop it) and re-run the same command to continue from it"
            if kept_step is not None else "")
    return (f"stopped at update {step} (train.max_steps); no checkpoint written, the training loss being above the "
            f"divergence guard's threshold: {kept_text(kept_step)}{then}")


def best_withheld_line(step: int, streak: int, best_step: Optional[int]) -> str:
    """The warning of a validation at update `step`, during a streak of `streak` high log windows, that writes no
    best.pt: checkpoint.pt is not written from these weights either (TrainLoop.checkpoint). `best_step`: the update
    of the best.pt kept, None when there is none."""
    kept = f"best.pt of update {best_step} is kept" if best_step is not None else "no best.pt is written yet"
    return (f"best.pt not written at update {step}: the training loss was above the divergence guard's threshold in "
            f"the last {streak} log window(s), and checkpoint.pt is not written from these weights either; {kept}")
