"""best.pt under the divergence guard, and what a run that wrote no checkpoint tells its re-run.

best.pt follows checkpoint.pt's rule (engine/divergence.py): a validation during a streak of high log windows writes
none, so best.pt never holds weights the guard refused to save; at the schedule's end both are written. A run stopped
before its first checkpoint leaves only its logs: its lines say the same command starts afresh, and one with other
settings needs train.archive_existing=true or another out_dir. Those claims are checked by re-running as they say.

The losses are set by hand (tests/test_divergence_checkpoints.py's `loss_raised_after`), and the validation scores
rise with every validation, so that every validation would beat the best so far: which best.pt is written is the
guard's decision alone."""
import itertools
import logging
import os

import pytest
import torch

import train
from engine.checkpoint import load_checkpoint
from engine.divergence import DivergenceError, withheld_stop_line
from engine.run_dir import RunDirError
from engine.tasks import ClassificationTask
from tests.test_divergence_checkpoints import EPOCH_2_HIGH, MICRO_PER_EPOCH, TINY, loss_raised_after

# 2 micro-batches per update: the first update's loss is normal, every later one HIGH above it, so the first log
# window (updates 1-2) is high already: no checkpoint is ever written before the streak
AFTER_FIRST_UPDATE = 2


@pytest.fixture
def rising_scores(monkeypatch):
    """Every validation scores higher than the one before (val/top1 1, 2, 3, ...), the rest as measured."""
    real, scores = ClassificationTask.evaluate, itertools.count(1)

    def evaluate(self, *args, **kwargs):
        metrics = real(self, *args, **kwargs)
        return None if metrics is None else {**metrics, "top1": float(next(scores))}
    monkeypatch.setattr(ClassificationTask, "evaluate", evaluate)


def best_path(cfg) -> str:
    return os.path.join(cfg.out_dir, "best.pt")


def same_weights(a: str, b: str) -> bool:
    one, other = load_checkpoint(a)["model"], load_checkpoint(b)["model"]
    return one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


def test_a_stop_at_max_steps_inside_a_streak_before_any_checkpoint_writes_no_best_pt_and_restarts(
        debug_config, monkeypatch, caplog, rising_scores):
    """The reviewer's case: the first window is high, train.max_steps stops the run there, and the validation at
    train.max_steps is the run's first. Neither checkpoint.pt nor best.pt is written; the lines say so, and that the
    same command starts afresh, which it does; a lower optim.lr is refused beside the run's logs, and runs with
    train.archive_existing=true, as the line says."""
    first, second = loss_raised_after(AFTER_FIRST_UPDATE), loss_raised_after(AFTER_FIRST_UPDATE)  # each on the task's
    monkeypatch.setattr(ClassificationTask, "criterion", first)
    cfg = debug_config(*TINY, "train.max_steps=2")
    with caplog.at_level(logging.INFO):
        result = train.main(cfg)
    assert result.reason == "max_steps" and result.state.step == 2 and result.metrics  # validated, not kept
    assert not os.path.exists(os.path.join(cfg.out_dir, "checkpoint.pt"))
    assert not os.path.exists(best_path(cfg))
    assert ("best.pt not written at update 2: the training loss was above the divergence guard's threshold in the "
            "last 1 log window(s), and checkpoint.pt is not written from these weights either; no best.pt is written "
            "yet") in caplog.text
    assert ("stopped at update 2 (train.max_steps); no checkpoint written, the training loss being above the "
            "divergence guard's threshold: none was written yet, so the same command starts afresh (moving this "
            "run's logs aside); to change a setting (a lower optim.lr), re-run with train.archive_existing=true") \
        in caplog.text

    monkeypatch.setattr(ClassificationTask, "criterion", second)  # its count of losses from 0 again
    again = train.main(debug_config(*TINY, "train.max_steps=2"))  # the same command
    assert again.reason == "max_steps" and again.state.step == 2  # from update 0, not refused
    assert not os.path.exists(os.path.join(cfg.out_dir, "checkpoint.pt"))  # diverged again: nothing written
    assert os.path.isdir(os.path.join(cfg.out_dir, "archive"))  # the first run's logs, moved aside

    lower = ("optim.lr=1e-5", "sched.warmup_epochs=0")
    with pytest.raises(RunDirError, match="holds files of an earlier run"):
        train.main(debug_config(*TINY, "train.max_steps=2", *lower))
    monkeypatch.undo()
    fixed = train.main(debug_config(*TINY, "train.max_steps=2", *lower, "train.archive_existing=true"))
    assert fixed.reason == "max_steps" and os.path.exists(os.path.join(cfg.out_dir, "checkpoint.pt"))


def test_a_validation_inside_a_streak_keeps_the_best_pt_of_the_last_good_checkpoint(debug_config, monkeypatch,
                                                                                   caplog, rising_scores):
    """Epoch 1 (updates 1-4) normal: validated and checkpointed at update 4. The loss is high from update 6 on, so
    epoch 2 ends at update 8 with a streak of 2, where train.max_steps stops the run: that validation scores higher,
    yet best.pt stays update 4's, the weights of checkpoint.pt, which the guard kept."""
    monkeypatch.setattr(ClassificationTask, "criterion", loss_raised_after(EPOCH_2_HIGH))
    cfg = debug_config(*TINY, "train.max_steps=8")
    with caplog.at_level(logging.WARNING):
        result = train.main(cfg)
    assert result.reason == "max_steps" and result.metrics["val/top1"] == 2.0  # the second validation scored best
    best = load_checkpoint(best_path(cfg))
    assert best["state"]["step"] == 4 and best["metrics"]["val/top1"] == 1.0
    assert load_checkpoint(os.path.join(cfg.out_dir, "checkpoint.pt"))["state"]["step"] == 4
    assert same_weights(best_path(cfg), os.path.join(cfg.out_dir, "checkpoint.pt"))
    assert "best.pt not written at update 8: " in caplog.text and "; best.pt of update 4 is kept" in caplog.text


def test_at_the_schedules_end_best_pt_is_written_with_the_last_checkpoint(debug_config, monkeypatch, caplog,
                                                                          rising_scores):
    """Only the last window (updates 11-12) is high: the schedule ends in a streak of 1, and its last checkpoint is
    written all the same (the run finished); best.pt follows it: the last validation, the best, is written, with
    the checkpoint's weights."""
    monkeypatch.setattr(ClassificationTask, "criterion", loss_raised_after(MICRO_PER_EPOCH * 2 + 4))
    cfg = debug_config(*TINY)
    with caplog.at_level(logging.WARNING):
        result = train.main(cfg)
    assert result.reason == "finished" and result.state.divergence_streak == 1
    assert load_checkpoint(best_path(cfg))["state"]["step"] == 12
    assert same_weights(best_path(cfg), os.path.join(cfg.out_dir, "checkpoint.pt"))
    assert "best.pt not written" not in caplog.text


def test_a_divergence_stop_before_any_checkpoint_says_what_a_lower_learning_rate_needs(debug_config, monkeypatch):
    """Windows 2, 4 and 6 high from the first: the guard stops the run at update 6 with no checkpoint written. Its
    error tells the re-run with a lower optim.lr to add train.archive_existing=true (not
    train.allow_changed_config=true: there is nothing to resume), and that re-run starts."""
    monkeypatch.setattr(ClassificationTask, "criterion", loss_raised_after(AFTER_FIRST_UPDATE))
    cfg = debug_config(*TINY)
    with pytest.raises(DivergenceError) as stop:
        train.main(cfg)
    message = str(stop.value)
    assert ("Stopping without writing a checkpoint: none was written yet. Lower optim.lr and re-run with "
            "train.archive_existing=true (this run's files are moved aside) or another out_dir") in message, message
    assert "allow_changed_config" not in message and "the same command starts afresh" not in message
    assert not os.path.exists(best_path(cfg))
    monkeypatch.undo()
    lower = ("optim.lr=1e-5", "sched.warmup_epochs=0", "train.max_steps=2")
    with pytest.raises(RunDirError, match="train.archive_existing=true"):
        train.main(debug_config(*TINY, *lower))
    assert train.main(debug_config(*TINY, *lower, "train.archive_existing=true")).state.step == 2


@pytest.mark.parametrize("kept_step, says, not_said", [
    (4, "(with train.allow_changed_config=true), and re-run", "archive_existing"),
    (None, "and re-run with train.archive_existing=true (this run's files are moved aside) or another out_dir",
     "allow_changed_config"),
])
def test_a_stop_request_inside_a_streak_says_what_a_lower_learning_rate_needs(kept_step, says, not_said):
    """With a checkpoint kept, a lower optim.lr resumes from it with train.allow_changed_config=true; with none, there
    is nothing to resume, and a changed setting needs the run's files archived (or another out_dir)."""
    line = withheld_stop_line(9, kept_step)
    assert line.endswith(says) and not_said not in line, line
