"""The divergence guard keeps the last good checkpoint: while its streak of high log windows is above 0 (or the
updates since the last log step average above its threshold) no checkpoint.pt is written over it, at an epoch's
end, every train.ckpt_every_steps, after an error or at a stop request; the window that stops the run is logged.

The losses are set by hand: a constant added to the task's loss (its gradient unchanged) or a fixed sequence,
so which windows are high is known without training to a divergence. The expectations are counted from the rule
of engine/divergence.py (a window counts when its mean is above factor x the first update's loss)."""
import json
import logging
import os

import pytest
import torch

import train
from data import build_loaders
from engine.checkpoint import load_checkpoint
from engine.divergence import DivergenceError, DivergenceGuard
from engine.loop import TrainLoop, TrainState, progress_kept_on_error
from engine.preemption import Preemption
from engine.tasks import ClassificationTask

# configs/debug/tiny.yaml: 64 images, batch 16 in 2 micro-batches of 8: 4 updates (8 micro-batches) per epoch, a log
# window every 2 updates; the guard's defaults, 3x the first update's loss for 3 windows
TINY = ("data.mixup=0", "data.cutmix=0", "sched.epochs=3")
MICRO_PER_EPOCH = 8
HIGH = 100.0  # added to the loss from epoch 2 on: far above 3 x ln(4), the loss of a fresh 4-class model
# the loss raised from update 6 on: update 5's, the first measured on the weights of epoch 1's checkpoint (update 4),
# is normal, so that checkpoint is kept (engine/loop.py holds a write back until the next update's loss has passed the
# guard); the log windows of epoch 2 (updates 5-6, 7-8) are high all the same
EPOCH_2_HIGH = MICRO_PER_EPOCH + 2


def loss_raised_after(micro_batches: int):
    """ClassificationTask.criterion whose training loss gains HIGH after the first `micro_batches` calls."""
    real = ClassificationTask.criterion
    calls = []

    def criterion(label_smoothing, mixup):
        base = real(label_smoothing, mixup)

        def loss(logits, targets):
            calls.append(1)
            return base(logits, targets) + (HIGH if len(calls) > micro_batches else 0.0)
        return loss
    return staticmethod(criterion)


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def saved_state(out_dir) -> dict:
    return load_checkpoint(os.path.join(out_dir, "checkpoint.pt"))["state"]


def test_a_run_that_diverges_keeps_the_checkpoint_of_before_its_high_windows(debug_config, monkeypatch):
    """Windows at updates 2, 4 normal (epoch 1 ends at 4: its checkpoint), 6 and 8 high (epoch 2 ends at 8 with a
    streak of 2: nothing written), 10 high: the third, the stop. checkpoint.pt stays update 4's, streak 0; the error
    names it; the stopping window is in metrics.jsonl with its loss."""
    monkeypatch.setattr(ClassificationTask, "criterion", loss_raised_after(EPOCH_2_HIGH))
    cfg = debug_config(*TINY)
    kept = r"Stopping without writing a checkpoint: the last one, of update 4, is kept"
    with pytest.raises(DivergenceError, match=r"for 3 log windows \(now .* at update 10\): the run diverged\. " + kept):
        train.main(cfg)
    state = saved_state(cfg.out_dir)
    assert state["step"] == 4 and state["divergence_streak"] == 0 and state["epoch"] == 1
    logged = {r["step"]: r["train/loss"] for r in read_metrics(cfg.out_dir) if "train/loss" in r}
    assert sorted(logged) == [2, 4, 6, 8, 10]
    assert logged[10] > HIGH and max(logged[2], logged[4]) < 3 * 1.5  # ln(4) = 1.39 at the start


def test_the_window_that_stops_the_run_is_logged_before_the_error(debug_config):
    """One update per log window, losses 1 then 50: the guard (3 windows) stops at update 4; the log callback got
    update 4's record, with its loss, before the error (metrics.jsonl and the progress line are written from it)."""
    cfg = debug_config("data.mixup=0", "data.cutmix=0")
    loaders = build_loaders(cfg.data, img_size=32, batch_size_per_gpu=8, eval_batch_size_per_gpu=8, rank=0,
                            world_size=1, seed=0, num_classes=4)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))
    losses = iter([1.0] + [50.0] * 20)
    logged = {}
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                     compute_loss=lambda m, x, y: m(x).sum() * 0 + next(losses), device=torch.device("cpu"),
                     log_every=1, log=lambda step, metrics: logged.update({step: metrics}),
                     divergence=DivergenceGuard(3.0, 3))
    with pytest.raises(DivergenceError, match="at update 4"):
        loop.run_epoch(loaders.train, TrainState(), batch_size_per_gpu=8)
    assert sorted(logged) == [1, 2, 3, 4] and logged[4]["train/loss"] == 50.0 and "train/lr" in logged[4]


def _loop(debug_config, losses, saves, **kwargs):
    cfg = debug_config("data.mixup=0", "data.cutmix=0")
    loaders = build_loaders(cfg.data, img_size=32, batch_size_per_gpu=8, eval_batch_size_per_gpu=8, rank=0,
                            world_size=1, seed=0, num_classes=4)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))
    losses = iter(losses)
    state = TrainState()

    def compute_loss(m, x, y):
        loss = next(losses)
        if isinstance(loss, Exception):
            raise loss
        return m(x).sum() * 0 + loss

    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), compute_loss=compute_loss,
                     device=torch.device("cpu"), save=lambda: saves.append((state.step, state.divergence_streak)),
                     divergence=DivergenceGuard(3.0, 3), **kwargs)
    return loop, loaders.train, state


def test_periodic_checkpoints_are_not_written_during_a_streak(debug_config):
    """A log window and a checkpoint every update; losses 1, 1, 1, then 50: updates 1-3 are written, 4 and 5
    (streak 1, 2) are not, 6 stops the run naming update 3 as the checkpoint kept."""
    saves = []
    loop, batches, state = _loop(debug_config, [1.0] * 3 + [50.0] * 10, saves, log_every=1, ckpt_every=1)
    with pytest.raises(DivergenceError, match="at update 6\\).*the last one, of update 3, is kept"):
        loop.run_epoch(batches, state, batch_size_per_gpu=8)
    assert saves == [(1, 0), (2, 0), (3, 0)]


def test_a_checkpoint_between_log_steps_is_not_written_when_the_loss_since_the_last_one_is_high(debug_config):
    """A log window every 4 updates, a checkpoint every 2: updates 5 and 6 at 50 (against 1 at update 1) average
    above 3x before any window of them is logged, so update 6's checkpoint is not written; 2 and 4 are."""
    saves = []
    loop, batches, state = _loop(debug_config, [1.0] * 4 + [50.0] * 2 + [1.0] * 2, saves, log_every=4, ckpt_every=2,
                                 max_steps=6)
    assert loop.run_epoch(batches, state, batch_size_per_gpu=8) == "max_steps"
    assert saves == [(2, 0), (4, 0)] and loop.saved_step == 4


def test_an_error_during_a_streak_keeps_the_last_good_checkpoint(debug_config, caplog):
    """An error at update 3 after a high window at update 2 (streak 1): one process writes its progress after an
    error, but not these weights; the log names update 1's checkpoint as the one kept."""
    saves = []
    loop, batches, state = _loop(debug_config, [1.0, 50.0, RuntimeError("disk gone")], saves, log_every=1,
                                 ckpt_every=1)
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="disk gone"):
        loop.run_epoch(batches, state, batch_size_per_gpu=8)
    assert saves == [(1, 0)]
    assert "RuntimeError at update 3: the last one, of update 1, is kept" in caplog.text


def test_a_validation_error_during_a_streak_writes_nothing(caplog):
    saves = []
    model = torch.nn.Linear(2, 2)
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError):
        with progress_kept_on_error(lambda: saves.append(1), model, 8, False, "validation", diverging=True):
            raise ValueError("bad image")
    assert saves == [] and "divergence guard's threshold, not saved" in caplog.text


def test_a_stop_request_during_a_streak_keeps_the_last_good_checkpoint_and_exits_1(debug_config, monkeypatch):
    """The loss is high from update 6 on (window 6 high: streak 1) and a stop request comes at update 7: checkpoint.pt
    stays update 4's, and the run ends with an error (exit code 1), not as preempted (75): a requeue would resume
    from update 4 with the streak at 0 and, stopped inside the streak again, repeat for ever. The same command then
    resumes at update 4 (the loss normal again) and finishes."""
    monkeypatch.setattr(ClassificationTask, "criterion", loss_raised_after(EPOCH_2_HIGH))
    monkeypatch.setattr(Preemption, "should_stop", lambda self, step=0, boundary=False: step >= 7)
    cfg = debug_config(*TINY)
    with pytest.raises(DivergenceError, match=r"stopped by a signal at update 7 while the training loss was above the "
                       r"divergence guard's threshold: no checkpoint written, the last checkpoint, of update 4, is "
                       r"kept and the same command resumes from it; this exits 1, not 75"):
        train.main(cfg)
    state = saved_state(cfg.out_dir)
    assert state["step"] == 4 and state["divergence_streak"] == 0
    monkeypatch.undo()
    resumed = train.main(debug_config(*TINY))  # the same command
    assert resumed.reason == "finished" and resumed.state.step == 12


def test_a_stop_request_inside_a_high_window_not_yet_logged_keeps_the_last_good_checkpoint(debug_config, monkeypatch):
    """The loss is high from update 7 on and a stop request comes at update 7, before the window of updates 7-8 is
    logged (streak 0): the updates since the last log step average above the threshold, so checkpoint.pt is not
    written over update 4's (as at a periodic write) and the run exits 1. The stop-request write judged the streak
    alone and wrote update 7's weights."""
    monkeypatch.setattr(ClassificationTask, "criterion", loss_raised_after(MICRO_PER_EPOCH + 4))
    monkeypatch.setattr(Preemption, "should_stop", lambda self, step=0, boundary=False: step >= 7)
    cfg = debug_config(*TINY)
    with pytest.raises(DivergenceError, match=r"stopped by a signal at update 7 while the training loss was above the "
                       r"divergence guard's threshold: no checkpoint written, the last checkpoint, of update 4, is "
                       r"kept"):
        train.main(cfg)
    state = saved_state(cfg.out_dir)
    assert state["step"] == 4 and state["divergence_streak"] == 0


def test_a_run_whose_last_window_is_high_finishes_with_its_last_checkpoint(debug_config, monkeypatch, caplog):
    """Only the last log window (updates 11-12) is high: a streak of 1, no stop. The run finishes, and its
    checkpoint.pt is update 12's (with the streak), so a re-run of the same command trains nothing again."""
    monkeypatch.setattr(ClassificationTask, "criterion", loss_raised_after(MICRO_PER_EPOCH * 2 + 4))
    cfg = debug_config(*TINY)
    with caplog.at_level(logging.WARNING):
        result = train.main(cfg)
    assert result.reason == "finished" and result.state.step == 12
    state = saved_state(cfg.out_dir)
    assert state["step"] == 12 and state["divergence_streak"] == 1
    assert ("the run ends at update 12; the training loss was above the threshold in the last 1 log window(s) (the "
            "divergence guard, train.divergence_factor): checkpoint.pt is written all the same") in caplog.text


@pytest.mark.parametrize("max_steps", [6, 8])
def test_a_stop_at_max_steps_during_a_streak_names_the_checkpoint_kept(debug_config, monkeypatch, caplog, max_steps):
    """train.max_steps inside epoch 2 (update 6: streak 1) or at its end (update 8: streak 2): the run stops there
    without writing checkpoint.pt, and its line says that update 4's is kept, not 'checkpoint saved'."""
    monkeypatch.setattr(ClassificationTask, "criterion", loss_raised_after(EPOCH_2_HIGH))
    cfg = debug_config(*TINY, f"train.max_steps={max_steps}")
    with caplog.at_level(logging.INFO):
        result = train.main(cfg)
    assert result.reason == "max_steps" and result.state.step == max_steps
    assert saved_state(cfg.out_dir)["step"] == 4
    assert (f"stopped at update {max_steps} (train.max_steps); no checkpoint written, the training loss being above "
            "the divergence guard's threshold: the last one, of update 4, is kept; "
            "raise train.max_steps") in caplog.text
    assert "checkpoint saved" not in caplog.text
