"""checkpoint.pt never holds weights that no loss has passed the divergence guard on.

Each update's loss is computed before its step, so the weights a write holds are measured first by the next update's
loss. A write where the run goes on (train.ckpt_every_steps, an epoch's end) is held back in a file of its own and
replaces checkpoint.pt only once that loss is finite and under the guard's threshold (engine/loop.py
TrainLoop.checkpoint, engine/checkpoint.CheckpointFile); weights that hold a NaN or an inf are never written.

The runs resume from a normal checkpoint of update 4 with a learning rate that breaks the next update: the reference is
that checkpoint's own file, copied before the resume."""
import errno
import logging
import math
import os
import shutil

import pytest
import torch

import train
import engine.checkpoint
from engine.checkpoint import CheckpointError, CheckpointFile, load_checkpoint
from engine.divergence import DivergenceError
from engine.loop import NonFiniteLossError, TrainLoop, TrainState
from engine.run_dir import partial_path, partial_writes_of, remove_partial_writes

# configs/debug/tiny.yaml: 4 updates per epoch; a log window and a checkpoint every update
EVERY_UPDATE = ("model.drop_path=0.0", "data.mixup=0", "data.cutmix=0", "sched.epochs=6", "sched.warmup_epochs=0",
                "train.log_every_steps=1", "train.ckpt_every_steps=1")


def good_checkpoint_of_update_4(debug_config, tmp_path) -> str:
    """Train updates 1-4 at the recipe's lr (checkpoint.pt of update 4, its losses normal); return a copy of it."""
    result = train.main(debug_config(*EVERY_UPDATE, "train.max_steps=4"))
    assert result.reason == "max_steps" and result.state.step == 4
    copy = str(tmp_path / "update4.pt")
    shutil.copyfile(debug_config().out_dir + "/checkpoint.pt", copy)
    return copy


def assert_kept(out_dir: str, reference: str) -> None:
    """checkpoint.pt is the reference file's update and weights, bit for bit, and no held write is left beside it."""
    kept, ref = load_checkpoint(os.path.join(out_dir, "checkpoint.pt")), load_checkpoint(reference)
    assert kept["state"]["step"] == ref["state"]["step"] == 4
    assert kept["model"].keys() == ref["model"].keys()
    assert all(torch.equal(kept["model"][k], ref["model"][k]) for k in ref["model"])
    assert partial_writes_of(os.path.join(out_dir, "checkpoint.pt")) == []


def test_the_write_of_an_update_whose_weights_diverge_does_not_replace_the_last_good_checkpoint(debug_config,
                                                                                               tmp_path, caplog):
    """Resumed at update 4 with optim.lr=3.0: update 5's loss (on update 4's weights) is normal, so update 5 is
    written; its weights give a loss far above 3x the first update's at update 6. Before, update 5's write replaced
    update 4's and the guard's error named it as the checkpoint to lower optim.lr from (diverged weights); now it is
    deleted, checkpoint.pt stays update 4's and the error names update 4."""
    reference = good_checkpoint_of_update_4(debug_config, tmp_path)
    cfg = debug_config(*EVERY_UPDATE, "optim.lr=3.0", "train.allow_changed_config=true")
    with caplog.at_level(logging.WARNING), pytest.raises(DivergenceError, match="the last one, of update 4, is kept"):
        train.main(cfg)
    assert_kept(cfg.out_dir, reference)
    assert "checkpoint.pt of update 5 not kept: the training loss of its weights, measured at update 6" in caplog.text


def test_weights_that_give_a_nan_loss_are_never_kept(debug_config, tmp_path, caplog):
    """Resumed at update 4 with optim.lr=3e37 (under the lr whose first Adam step overflows float32, refused by
    training_checks.check_peak_lr): update 5 makes huge (finite) weights whose loss at update 6 is NaN. Before,
    checkpoint.pt was update 5's (weights up to ~1e38) and the NaN error named it as kept."""
    reference = good_checkpoint_of_update_4(debug_config, tmp_path)
    cfg = debug_config(*EVERY_UPDATE, "optim.lr=3e37", "train.allow_changed_config=true")
    kept = "the last one, of update 4, is kept"
    with caplog.at_level(logging.WARNING), pytest.raises(NonFiniteLossError, match=kept):
        train.main(cfg)
    assert_kept(cfg.out_dir, reference)
    assert "checkpoint.pt of update 5 not kept" in caplog.text


def test_a_run_that_diverges_at_its_second_update_keeps_no_checkpoint(debug_config):
    """optim.lr=3.0 from the start: losses 1.38, then ~125. Before, update 1's write (whose weights give ~125) was
    kept and named as the point to resume from; now none is, and the error says so."""
    cfg = debug_config(*EVERY_UPDATE, "optim.lr=3.0")
    with pytest.raises(DivergenceError, match="none was written yet"):
        train.main(cfg)
    assert not os.path.exists(os.path.join(cfg.out_dir, "checkpoint.pt"))
    assert partial_writes_of(os.path.join(cfg.out_dir, "checkpoint.pt")) == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["model", "ema"])
def test_weights_with_a_nan_or_an_inf_are_never_written_not_even_at_the_runs_end(where, bad, caplog):
    """The write that ends the schedule is made during a streak, but never of weights (or EMA weights) with a NaN,
    nor with an inf of either sign (a max-norm of inf is as unusable as one of NaN)."""
    model = torch.nn.Linear(3, 2)
    ema = torch.nn.Linear(3, 2)
    with torch.no_grad():
        (model if where == "model" else ema).weight[0, 1] = bad
    saves = []
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), compute_loss=None,
                     device=torch.device("cpu"), ema=ema, save=lambda: saves.append(1), saved_step=3)
    with caplog.at_level(logging.WARNING):
        assert not loop.checkpoint(TrainState(step=5), final=True)
    assert saves == [] and loop.saved_step == 3
    assert "checkpoint.pt not written at update 5: the weights hold a NaN or an inf" in caplog.text
    assert "the last one, of update 3, is kept" in caplog.text


def test_a_held_write_is_never_checkpoint_pt_until_published_and_a_left_one_is_a_partial_write(tmp_path):
    """A held write lies under a partial_path name (never resumed from; one a killed run leaves is removed by the
    next run's claim of out_dir), replaces checkpoint.pt when published, and a discarded one leaves nothing."""
    path = str(tmp_path / "checkpoint.pt")
    writes = CheckpointFile(path, is_main=True, device=torch.device("cpu"))
    writes.save(lambda: {"step": 1})
    writes.save(lambda: {"step": 2}, held_step=2)
    assert torch.load(path)["step"] == 1 and len(partial_writes_of(path)) == 1 and writes.held_step == 2
    assert writes.publish() == 2
    assert torch.load(path)["step"] == 2 and partial_writes_of(path) == [] and writes.held_step is None
    writes.save(lambda: {"step": 3}, held_step=3)
    assert writes.discard() == 3
    assert torch.load(path)["step"] == 2 and partial_writes_of(path) == []
    writes.save(lambda: {"step": 4}, held_step=4)
    writes.save(lambda: {"step": 4, "final": True})  # a write at once supersedes the held one
    assert torch.load(path) == {"step": 4, "final": True} and partial_writes_of(path) == []


@pytest.mark.parametrize("second", ["held", "at_once"])
def test_a_write_that_fails_leaves_the_write_it_supersedes_as_checkpoint_pt(second, tmp_path, monkeypatch):
    """A second write of update 4 (the one after its validation, held; or a stop's, at once) on a full disk. Before,
    the held write of update 4 was deleted before the new one was tried, so the failure left the checkpoint before
    (or none at all) while its error advised resuming from the last checkpoint; now the held file is deleted only
    once the new one is written, and a failed write makes it checkpoint.pt, as any error does."""
    path = str(tmp_path / "checkpoint.pt")
    writes = CheckpointFile(path, is_main=True, device=torch.device("cpu"))
    writes.save(lambda: {"step": 2})
    writes.save(lambda: {"step": 4, "validated": False}, held_step=4)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", full_disk)
        with pytest.raises(CheckpointError, match="the disk is full.*checkpoint.pt is now the write of update 4") as e:
            writes.save(lambda: {"step": 4, "validated": True}, held_step=4 if second == "held" else None)
    # one word on checkpoint.pt: not also 'the previous file is unchanged' (update 2's), which it no longer is
    assert "unchanged" not in str(e.value) and "no earlier file" not in str(e.value), e.value
    assert torch.load(path) == {"step": 4, "validated": False}
    assert partial_writes_of(path) == [] and writes.held_step is None


def second_checkpoint_write_fails(cfg, monkeypatch):
    """train.main(cfg) with its second write of checkpoint.pt failing on a full disk (update 4's write after the held
    one of train.ckpt_every_steps=4), which ends the run with the error naming the held write as checkpoint.pt."""
    real, writes = engine.checkpoint.save_atomic, []

    def second_fails(payload, path, held_of=None):
        if os.path.basename(held_of or path) == "checkpoint.pt":
            writes.append(path)
            if len(writes) == 2:
                raise CheckpointError(engine.checkpoint._write_failure(held_of or path, OSError(errno.ENOSPC, "full")))
        return real(payload, path, held_of)

    with monkeypatch.context() as patch:
        patch.setattr(engine.checkpoint, "save_atomic", second_fails)
        with pytest.raises(CheckpointError, match="now the write of update 4"):
            train.main(cfg)


def test_a_full_disk_at_the_write_after_a_validation_keeps_the_one_before_it(debug_config, monkeypatch, caplog):
    """train.ckpt_every_steps=4: update 4's write is held, its validation runs, and the epoch's write of update 4
    fails on a full disk. Before, the held write was already deleted: no checkpoint.pt, and the same command, which
    the error advised, was refused ('holds files of an earlier run but no checkpoint.pt'); now update 4's held write
    is checkpoint.pt, and the same command resumes from it and trains the schedule's end."""
    cfg = debug_config("train.ckpt_every_steps=4")
    second_checkpoint_write_fails(cfg, monkeypatch)
    assert load_checkpoint(os.path.join(cfg.out_dir, "checkpoint.pt"))["state"]["step"] == 4
    assert partial_writes_of(os.path.join(cfg.out_dir, "checkpoint.pt")) == []
    with caplog.at_level(logging.INFO):
        result = train.main(debug_config("train.ckpt_every_steps=4"))  # the same command
    assert result.reason == "finished" and result.state.step == 8
    assert "checkpoint.pt at epoch 0, update 4" in caplog.text  # 'resumed from <out_dir>/checkpoint.pt at ...'


def test_the_best_pt_of_the_validation_after_a_held_write_made_checkpoint_pt_stays_best_pt(debug_config, monkeypatch,
                                                                                            caplog):
    """As above: update 4's validation writes best.pt after update 4's held write, which the failed write after it
    makes checkpoint.pt, whose best record predates that validation. Before, the re-run moved that best.pt (of the
    very weights it resumes with) aside as best.until_step4.pt, warning 'best.pt was not the best validation of the
    run up to update 4'; now it stays, its score the resumed run's. The reference: the same run uninterrupted."""
    reference = train.main(debug_config("train.ckpt_every_steps=4", name="reference"))
    cfg = debug_config("train.ckpt_every_steps=4")
    second_checkpoint_write_fails(cfg, monkeypatch)
    held = load_checkpoint(os.path.join(cfg.out_dir, "checkpoint.pt"))["state"]
    best = load_checkpoint(os.path.join(cfg.out_dir, "best.pt"))["state"]
    assert held["step"] == best["best_step"] == 4 and held["best_fingerprint"] != best["best_fingerprint"]
    with caplog.at_level(logging.INFO):
        result = train.main(debug_config("train.ckpt_every_steps=4"))  # the same command
    assert result.reason == "finished" and result.state.step == 8
    assert "not the best validation" not in caplog.text
    assert sorted(n for n in os.listdir(cfg.out_dir) if n.startswith("best")) == ["best.pt"]
    ours, theirs = (load_checkpoint(os.path.join(folder, "best.pt"))
                    for folder in (cfg.out_dir, debug_config(name="reference").out_dir))
    fields = ("best_value", "best_step", "best_epoch", "best_fingerprint")
    assert [ours["state"][k] for k in fields] == [theirs["state"][k] for k in fields]
    assert [getattr(result.state, k) for k in fields] == [getattr(reference.state, k) for k in fields]
    assert all(torch.equal(ours["model"][k], theirs["model"][k]) for k in theirs["model"])


@pytest.mark.parametrize("case", ["same_weights", "other_weights", "not_better"])
def test_only_a_best_pt_of_the_resumed_weights_and_better_than_the_resumed_best_stays(case, tmp_path):
    """The exception of match_file is narrow: a best.pt recorded at the resume point's update stays (its score taken
    into the state) only where its weights are the ones resumed with, and its score beats the state's best (the
    validation that wrote it followed that state); one of other weights at that update, or no better, is moved
    aside as before."""
    from engine.best_checkpoint import BestCheckpoint
    from engine.checkpoint import weights_fingerprint

    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    written = weights_fingerprint((other if case == "other_weights" else model).state_dict())
    score = 20.0 if case == "not_better" else 40.0
    path = tmp_path / "best.pt"
    torch.save({"model": {}, "config": {}, "state": TrainState(step=4, best_value=score, best_epoch=1, best_step=4,
                                                               best_fingerprint=written).state_dict()}, path)
    best = BestCheckpoint(str(path), model=model, ema=None, config={}, classes=None,
                          save=lambda payload_fn, target: None)
    state = TrainState(step=4, best_value=30.0, best_epoch=1, best_step=2, best_fingerprint="0" * 16)
    match = best.match_file(state, True, torch.device("cpu"))
    if case == "same_weights":
        assert match.kept is None and path.exists()
        assert (state.best_value, state.best_epoch, state.best_step, state.best_fingerprint) == (40.0, 1, 4, written)
    else:
        assert match.kept == str(tmp_path / "best.until_step4.pt") and not path.exists()
        assert state.best_value is None


def test_a_held_write_the_next_run_cannot_tell_dead_is_kept_and_named(tmp_path, caplog):
    """A held write left by a killed run is removed by the next run's claim of out_dir only where its writer is a
    pid of this machine that is gone; one of another machine, or whose pid is the new run's own (a container reuses
    pids), stayed without a word (gigabytes at ViT-B); now one warning names it."""
    own = partial_path(str(tmp_path / "checkpoint.pt"))  # this process's pid and host
    other_machine = str(tmp_path / "checkpoint.pt.partial-00000000-4194999-0123abcd")
    for path in (own, other_machine):
        open(path, "w").close()
    with caplog.at_level(logging.WARNING):
        assert remove_partial_writes(str(tmp_path)) == []
    assert os.path.exists(own) and os.path.exists(other_machine)
    (line,) = [r.getMessage() for r in caplog.records if "kept in" in r.getMessage()]
    assert os.path.basename(own) in line and os.path.basename(other_machine) in line


def test_an_epochs_end_write_the_guard_drops_keeps_no_snapshot_of_that_epoch(debug_config, tmp_path):
    """train.keep_every_epochs=1: epoch 2's snapshot waits for its held write of update 8, which update 9's loss
    (optim.lr=3.0 from update 8 on) drops. Kept anyway, snapshots/epoch0002.pt would be a link to checkpoint.pt of
    update 7 (an earlier update's weights under epoch 2's name, which a roll-back to it would take); now epoch 1's
    is the only one. Reference: checkpoint.pt of a straight run stopped at epoch 1's end (update 4)."""
    every = "train.keep_every_epochs=1"
    train.main(debug_config(*EVERY_UPDATE, every, "train.max_steps=4", name="reference"))
    cfg = debug_config(*EVERY_UPDATE, every, "train.max_steps=7")
    assert train.main(cfg).state.step == 7
    with pytest.raises(DivergenceError, match="the last one, of update 7, is kept"):
        train.main(debug_config(*EVERY_UPDATE, every, "optim.lr=3.0", "train.allow_changed_config=true"))
    assert sorted(os.listdir(os.path.join(cfg.out_dir, "snapshots"))) == ["epoch0001.pt"]
    kept = load_checkpoint(os.path.join(cfg.out_dir, "snapshots", "epoch0001.pt"))
    ref = load_checkpoint(os.path.join(debug_config(name="reference").out_dir, "checkpoint.pt"))
    assert kept["state"]["step"] == ref["state"]["step"] == 4
    assert kept["model"].keys() == ref["model"].keys()
    assert all(torch.equal(kept["model"][k], ref["model"][k]) for k in ref["model"])
