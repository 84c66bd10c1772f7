"""A sweep run that train.py stopped at train.max_steps while the divergence guard withheld its checkpoint writes is
a failure, not a stop at the update of the checkpoint it kept.

train.py exits 0 at train.max_steps also when the guard withheld the writes of the high-loss updates before it
(engine/divergence.py): checkpoint.pt and best.pt are then an earlier update's. The sweep compares that update with
the one the run stops at, min(train.max_steps, the schedule's updates) of the config it trained with: smaller means
withheld. The run is reported as failed during training, is not evaluated, no later run starts, and the sweep exits 1
(as for a run with no checkpoint at all, tests/test_sweep_unsaved_run.py)."""
import os

import pytest
import torch

from configs import config_to_dict, load_config
from engine.checkpoint import load_checkpoint
from tests.conftest import DEBUG_CONFIG
from tests.test_divergence_checkpoints import EPOCH_2_HIGH
from tests.test_sweep_unsaved_run import summary, sweep_in_process

import sweep  # noqa: E402  (scripts/, on the path of the tests)

WITHHELD = ("failed during training: stopped at train.max_steps at update 8 with its checkpoint withheld "
            "(divergence guard")


def test_a_real_run_whose_writes_the_guard_withheld_up_to_max_steps_fails_the_sweep(tmp_path, monkeypatch, capfd):
    """tiny.yaml, 4 updates per epoch, a log window every 2: epoch 1 is normal (its checkpoint, update 4), the
    losses of epoch 2 are raised by hand (windows 6 and 8 high: a streak of 2, below the guard's 3), and
    train.max_steps=8 ends the run there with exit 0, update 8's write withheld. The sweep reported it as stopped
    at train.max_steps 'at update 4', evaluated the best.pt of update 4, went on to run b and exited 0."""
    code, out = sweep_in_process(tmp_path, monkeypatch, capfd, "  a: [train.max_steps=8]\n  b: []\n", EPOCH_2_HIGH,
                                 "[]")
    assert code == 1, out[-3000:]
    lines = summary(out)
    assert lines[0].startswith(f"  a: {WITHHELD}") and lines[1:] == ["  b: not started"], lines
    folder = tmp_path / "runs" / "a"
    assert load_checkpoint(str(folder / "checkpoint.pt"))["state"]["step"] == 4  # the guard's kept write
    assert "checkpoint.pt is of update 4" in lines[0]
    assert not (folder / "eval_best.json").exists() and not (tmp_path / "runs" / "b").exists()


def fake_checkpoint(folder, step: int, epoch: int, *saved_overrides: str) -> None:
    """checkpoint.pt with the fields the sweep reads: its update and epoch, its config (tiny.yaml with
    `saved_overrides`: what the run wrote it with) and tiny.yaml's 4 updates per epoch."""
    folder.mkdir(parents=True, exist_ok=True)
    config = config_to_dict(load_config([DEBUG_CONFIG], list(saved_overrides)))
    torch.save({"state": {"step": step, "epoch": epoch}, "config": config,
                "epoch_position": {"updates_per_epoch": 4}}, folder / "checkpoint.pt")


@pytest.mark.parametrize("run_items, step, saved, withheld_at", [
    (["train.max_steps=8", "sched.epochs=3"], 4, ["train.max_steps=8"], 8),  # update 8's write withheld
    # resumed with train.max_steps raised from 4 to 8, every write withheld: the checkpoint's config says 4
    (["train.max_steps=8", "sched.epochs=3"], 4, ["train.max_steps=4"], 8),
    # train.max_steps beyond the schedule (2 epochs of 4 updates): the run stops at 8
    (["train.max_steps=100"], 4, [], 8),
    (["train.max_steps=8", "sched.epochs=3"], 8, ["train.max_steps=8"], None),  # written at the stop
    (["train.max_steps=100"], 8, [], None),  # finished: the last write is always made
    (["train.max_steps=4", "sched.epochs=3"], 6, ["train.max_steps=6"], None),  # already beyond: nothing trained
    (["sched.epochs=3"], 4, [], None),  # no train.max_steps: train.py stops at its schedule's end, written
])
def test_a_checkpoint_of_an_earlier_update_than_the_stop_is_withheld(tmp_path, run_items, step, saved, withheld_at):
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\n"
                    f"runs:\n  a: [{', '.join(run_items)}]\n")
    (run,) = sweep.expand(str(spec), [])
    fake_checkpoint(tmp_path / "runs" / "a", step, step // 4, *saved)
    said = sweep.withheld_at_max_steps(run)
    if withheld_at is None:
        assert said is None
    else:
        assert said.startswith(f"stopped at train.max_steps at update {withheld_at} with its checkpoint withheld")
        assert f"checkpoint.pt is of update {step})" in said and os.path.join(tmp_path, "runs", "a") in said
