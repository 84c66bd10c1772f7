"""A run whose first checkpoint.pt cannot be written (a full disk): there is no checkpoint to resume from, and the
validation before that write has left best.pt, so out_dir holds an earlier run's files without a checkpoint.pt
and the same command is refused (engine/run_dir.check_fresh_start). The error must not advise that command: it
names a re-run that the claim of out_dir accepts, and that re-run trains the run to its end."""
import errno
import os
import re

import pytest
import torch

import train
from configs import config_to_dict
from engine.checkpoint import CheckpointError
from engine.run_dir import RunDirError, check_claim

SHORT = ("sched.epochs=1", "sched.warmup_epochs=0")  # 4 updates, one validation (at the end) before the write
FULL = OSError(errno.ENOSPC, "No space left on device")


def advised_override(message: str) -> str:
    """The key=value setting the error line advises re-running with."""
    found = re.search(r"re-run with ([\w.]+=\w+)", message)
    assert found, message
    return found.group(1)


def check_advice_works(debug_config, message: str, settings: tuple) -> None:
    """The same command is refused (the files of the failed run, no checkpoint.pt); the advised re-run is accepted
    and trains the schedule (4 updates) into a checkpoint.pt."""
    out_dir = debug_config(*settings).out_dir
    assert "best.pt" in os.listdir(out_dir) and "checkpoint.pt" not in os.listdir(out_dir)
    same = debug_config(*settings)
    with pytest.raises(RunDirError, match="no checkpoint.pt to resume from"):
        check_claim(same.out_dir, config_to_dict(same), same.train.archive_existing)
    advised = debug_config(*settings, advised_override(message))
    result = train.main(advised)
    assert result.reason == "finished" and result.state.step == 4
    assert os.path.isfile(os.path.join(out_dir, "checkpoint.pt"))
    archived, = os.listdir(os.path.join(out_dir, "archive"))  # the failed run's files, moved aside, not deleted
    assert "best.pt" in os.listdir(os.path.join(out_dir, "archive", archived))


def first_write_error(debug_config, settings: tuple, target, name: str, failing, match: str) -> str:
    """The CheckpointError line of a run of `settings` with `target.name` replaced by `failing`; it must say that no
    checkpoint exists and not advise the same command."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(target, name, failing)
        with pytest.raises(CheckpointError, match=match) as error:
            train.main(debug_config(*settings))
    message = str(error.value)
    assert "no checkpoint.pt was written yet, so the run cannot resume" in message, message
    assert "re-run the same command" not in message and "another out_dir" in message, message
    return message


def test_a_full_disk_at_the_first_checkpoint_write_advises_a_rerun_that_is_accepted(debug_config):
    """Before, the error said 'no earlier file existed ... re-run the same command to resume from the last
    checkpoint', a command refused for want of a checkpoint."""
    real = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if "checkpoint.pt" in str(getattr(f, "name", f)):
            raise FULL
        return real(obj, f, *args, **kwargs)

    message = first_write_error(debug_config, SHORT, torch, "save", full_disk, r"the disk is full")
    check_advice_works(debug_config, message, SHORT)


def test_a_failed_rename_of_a_held_first_checkpoint_advises_a_rerun_that_is_accepted(debug_config):
    """train.ckpt_every_steps=2: update 2's write is held and validated (best.pt), and its rename over
    checkpoint.pt fails at update 3. Before, the error said 'the previous checkpoint.pt is unchanged: re-run the
    same command to resume from it', of a checkpoint.pt that never existed."""
    settings = (*SHORT, "train.ckpt_every_steps=2", "train.eval_every_steps=2")
    real = os.replace

    def full_disk(src, dst, *args, **kwargs):
        if os.path.basename(dst) == "checkpoint.pt":
            raise FULL
        return real(src, dst, *args, **kwargs)

    message = first_write_error(debug_config, settings, os, "replace", full_disk,
                                r"could not rename .* to .*checkpoint.pt: \[Errno 28\]")
    assert "unchanged" not in message, message
    check_advice_works(debug_config, message, settings)
