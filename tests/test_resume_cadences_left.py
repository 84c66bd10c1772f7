"""A resume is checked against what is left of the run after its checkpoint, the schedule first: a schedule that
ends before the checkpoint's update is named before any cadence (whose fix would be followed by that refusal), a
train.max_steps below the checkpoint's update trains nothing and is refused, and a train.eval_every_steps /
train.ckpt_every_steps / train.keep_every_epochs that the resume changes and whose next multiple lies past the run's
end is refused in one line naming each (rc 0 before: no validation, checkpoint or snapshot, config.yaml recording
them). A value the resume leaves as it was is not refused: a requeue past its last multiple must resume. The
numbers expected are counted here from the debug config (64 images, global batch 16: 4 updates an epoch)."""
import os

import pytest
import yaml

import train
from configs import ConfigError
from engine.checkpoint import CheckpointError

LONG = ["sched.epochs=4"]  # 16 updates, 4 epochs


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_new_cadences_past_the_end_of_what_is_left_are_refused_in_one_line(debug_config):
    """The reviewer's command: a checkpoint at update 12 (epoch 3) of 16; eval / ckpt every 10 next act at 20,
    a snapshot every 3 epochs at epoch 6: all past the run's end (update 16, epoch 4), all named; nothing trains.
    Values whose next multiple is within the run are accepted and act there."""
    train.main(debug_config(*LONG, "train.max_steps=12"))
    out_dir = debug_config().out_dir
    ckpt = os.path.join(out_dir, "checkpoint.pt")
    before = _bytes(ckpt)
    new = ["train.keep_every_epochs=3", "train.eval_every_steps=10", "train.ckpt_every_steps=10"]
    with pytest.raises(ConfigError) as e:
        train.main(debug_config(*LONG, *new))
    message = str(e.value)
    assert "\n" not in message and "is at update 12" in message
    assert "train.eval_every_steps=10 would next validate at update 20, past the run's last update 16" in message
    assert "train.ckpt_every_steps=10 would next write checkpoint.pt at update 20" in message
    assert "train.keep_every_epochs=3 would next keep a snapshot at epoch 6, past the run's last epoch 4" in message
    assert _bytes(ckpt) == before and not os.path.exists(os.path.join(out_dir, "snapshots"))
    # 16 is the next multiple of 4 after 12 (and of 8, and 16 itself); epoch 4 of 2 and of 4
    result = train.main(debug_config(*LONG, "train.keep_every_epochs=2", "train.eval_every_steps=8",
                                     "train.ckpt_every_steps=16"))
    assert result.state.step == 16
    assert sorted(os.listdir(os.path.join(out_dir, "snapshots"))) == ["epoch0004.pt"]


def test_an_unchanged_cadence_with_no_multiple_left_resumes(debug_config):
    """A requeue of a run past its last multiple of each cadence (10 at update 12 of 16, a snapshot every 3 epochs
    at epoch 3 of 4) resumes with the same settings and finishes."""
    same = [*LONG, "train.keep_every_epochs=3", "train.eval_every_steps=10", "train.ckpt_every_steps=10"]
    train.main(debug_config(*same, "train.max_steps=12"))
    assert train.main(debug_config(*same)).state.step == 16


def test_a_schedule_shorter_than_the_checkpoint_is_named_before_the_cadences(debug_config):
    """A checkpoint at update 6 resumed with sched.steps=4 and train.eval_every_steps=6 (the saved value): the
    schedule is the fix to tell, not the cadence, whose fix (4) a second refusal would follow."""
    train.main(debug_config("train.eval_every_steps=6", "train.max_steps=6"))
    with pytest.raises(CheckpointError, match=r"is at update 6, beyond the 4 updates of this run's schedule "
                                              r"\(sched.steps=4\)"):
        train.main(debug_config("train.eval_every_steps=6", "sched.steps=4", "sched.warmup_steps=1",
                                "train.allow_changed_config=true"))


def test_a_max_steps_below_the_checkpoint_is_refused(debug_config):
    """train.max_steps=3 with a checkpoint at update 6: nothing to train, refused, config.yaml and the checkpoint
    left as they were; train.max_steps=6 itself (a re-run of a run stopped there) still runs."""
    train.main(debug_config("train.max_steps=6"))
    out_dir = debug_config().out_dir
    ckpt = os.path.join(out_dir, "checkpoint.pt")
    before = _bytes(ckpt)
    with pytest.raises(ConfigError, match=r"^train.max_steps=3 is below the update 6 of .*checkpoint.pt: nothing "
                                          r"to train; give a larger value or none$"):
        train.main(debug_config("train.max_steps=3"))
    assert _bytes(ckpt) == before
    with open(os.path.join(out_dir, "config.yaml")) as f:
        assert yaml.safe_load(f)["train"]["max_steps"] == 6
    result = train.main(debug_config("train.max_steps=6"))
    assert (result.state.step, result.reason) == (6, "max_steps")
