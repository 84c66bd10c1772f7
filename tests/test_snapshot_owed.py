"""Snapshots a resume keeps (train.keep_every_epochs): the ones a run never stopped keeps, no more, no fewer.

A run killed between writing checkpoint.pt at a kept epoch's end and linking it as snapshots/epoch<E>.pt owes that
snapshot; its resume keeps it (engine/snapshots.py keep_missing_snapshot). References: a straight run of the same
settings, or the fixed file list such a run keeps."""
from __future__ import annotations

import pytest
import torch

import train
from tests.test_resume_kills import Killed, killed_at_the_snapshot, snapshots_of


def same_snapshot(a, b) -> bool:
    """Whether two training checkpoints hold the same training state and the same weights."""
    x, y = (torch.load(path, weights_only=True) for path in (a, b))
    return x["state"] == y["state"] and x["model"].keys() == y["model"].keys() and all(
        torch.equal(x["model"][k], y["model"][k]) for k in y["model"])


def test_a_resume_with_another_keep_every_epochs_keeps_the_snapshot_the_killed_run_owed(tmp_path, debug_config,
                                                                                         monkeypatch):
    """A run with keep_every_epochs=1 killed before linking epoch0001.pt owes that snapshot. The resume with
    keep_every_epochs=2 decided by its own setting (1 % 2 != 0) and lost epoch 1's snapshot for good: whether one
    is owed is the writing run's setting. Reference: the epoch 1 snapshot of a straight keep_every_epochs=1 run."""
    from engine import snapshots

    train.main(debug_config("train.keep_every_epochs=1", name="straight"))
    link = snapshots.link_or_copy
    monkeypatch.setattr(snapshots, "link_or_copy", killed_at_the_snapshot("epoch0001.pt"))
    with pytest.raises(Killed):
        train.main(debug_config("train.keep_every_epochs=1", name="killed"))
    assert snapshots_of(tmp_path / "killed") == []
    monkeypatch.setattr(snapshots, "link_or_copy", link)
    train.main(debug_config("train.keep_every_epochs=2", name="killed"))
    assert snapshots_of(tmp_path / "killed") == ["epoch0001.pt", "epoch0002.pt"]
    assert same_snapshot(tmp_path / "killed/snapshots/epoch0001.pt", tmp_path / "straight/snapshots/epoch0001.pt")


@pytest.mark.parametrize("every, owed, kept", [(1, "epoch0001.pt", ["epoch0001.pt", "epoch0002.pt"]),
                                               (2, "epoch0002.pt", ["epoch0002.pt"])])
def test_a_kill_between_an_epochs_checkpoint_and_its_snapshot_keeps_the_snapshot_on_resume(tmp_path, debug_config,
                                                                                         monkeypatch, every, owed,
                                                                                         kept):
    """train.keep_every_epochs links checkpoint.pt as snapshots/epoch<E>.pt just after writing it at the epoch's
    end: killed in between, the resumed run began the next epoch and that snapshot was never kept. The resume at
    that end keeps it. keep_every_epochs=2 guards the epoch test of snapshot_owed beyond 1 (every epoch divides by
    1, so an epoch off by one there passed): epoch 2 is owed, epoch 1 is not. Reference: a straight run's
    snapshots, state and weights."""
    from engine import snapshots

    run = (f"train.keep_every_epochs={every}",)
    train.main(debug_config(*run, name="straight"))
    link = snapshots.link_or_copy
    monkeypatch.setattr(snapshots, "link_or_copy", killed_at_the_snapshot(owed))
    with pytest.raises(Killed):
        train.main(debug_config(*run, name="killed"))
    assert snapshots_of(tmp_path / "killed") == []
    monkeypatch.setattr(snapshots, "link_or_copy", link)
    train.main(debug_config(*run, name="killed"))
    assert snapshots_of(tmp_path / "killed") == snapshots_of(tmp_path / "straight") == kept
    for epoch in kept:
        assert same_snapshot(tmp_path / "killed/snapshots" / epoch, tmp_path / "straight/snapshots" / epoch), epoch


def test_a_stop_mid_epoch_and_its_resume_keep_the_snapshots_of_a_straight_run(tmp_path, debug_config):
    """A run stopped in the middle of epoch 2 (train.max_steps=6) resumes from a checkpoint.pt written mid-epoch:
    no snapshot is owed there (only at an epoch's end). Kept anyway, it would add a mid-epoch state beside
    epoch0001.pt (as epoch0001-1.pt). Reference: a straight run's snapshots, each one's state and weights."""
    run = ("sched.epochs=3", "train.keep_every_epochs=1")
    train.main(debug_config(*run, name="straight"))
    train.main(debug_config(*run, "train.max_steps=6", name="stopped"))
    train.main(debug_config(*run, name="stopped"))
    assert snapshots_of(tmp_path / "straight") == ["epoch0001.pt", "epoch0002.pt", "epoch0003.pt"]
    assert snapshots_of(tmp_path / "stopped") == snapshots_of(tmp_path / "straight")
    for name in snapshots_of(tmp_path / "straight"):
        assert same_snapshot(tmp_path / "stopped/snapshots" / name, tmp_path / "straight/snapshots" / name), name


def test_a_rerun_of_a_finished_run_without_hard_links_keeps_no_second_copy(tmp_path, debug_config, monkeypatch):
    """On a file system without hard links each snapshot is a copy, never the same file as checkpoint.pt. The same
    command run again (a requeue of a finished job) resumes at the last epoch's end: the copy of that epoch holds
    checkpoint.pt's update and weights, so nothing is owed. Without that comparison it added epoch0002-1.pt.
    Reference: the fixed list a run keeps once."""
    from engine import snapshots

    def no_links(source, target):
        """os.link of a file system without hard links."""
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(snapshots.os, "link", no_links)
    train.main(debug_config("train.keep_every_epochs=1"))
    assert snapshots_of(tmp_path / "run") == ["epoch0001.pt", "epoch0002.pt"]
    train.main(debug_config("train.keep_every_epochs=1"))  # the same command again
    assert snapshots_of(tmp_path / "run") == ["epoch0001.pt", "epoch0002.pt"]


def test_a_rerun_after_a_roll_back_keeps_no_second_snapshot_of_an_epoch_passed_again(tmp_path, debug_config):
    """A roll-back to snapshots/epoch0001.pt (another optim.lr: other weights) passes epoch 2 again and keeps it as
    epoch0002-1.pt beside the old branch's epoch0002.pt. The same command again (a requeue of the finished run)
    resumes at that end, whose snapshot is epoch0002-1.pt: nothing is owed. A search of epoch0002.pt alone found
    the old branch's only and added epoch0002-2.pt. Reference: the fixed list the roll-back keeps."""
    train.main(debug_config("train.keep_every_epochs=1"))
    back = ("train.keep_every_epochs=1", f"train.resume={tmp_path / 'run/snapshots/epoch0001.pt'}", "optim.lr=1e-4",
            "train.allow_changed_config=true")
    assert train.main(debug_config(*back)).state.step == 8
    kept = ["epoch0001.pt", "epoch0002-1.pt", "epoch0002.pt"]
    assert snapshots_of(tmp_path / "run") == kept
    assert not same_snapshot(tmp_path / "run/snapshots/epoch0002.pt", tmp_path / "run/snapshots/epoch0002-1.pt")
    train.main(debug_config(*back))  # the same command again
    assert snapshots_of(tmp_path / "run") == kept


def test_its_own_checkpoint_named_through_a_link_resumes_as_its_own(tmp_path, debug_config, monkeypatch, caplog):
    """train.resume naming out_dir's own checkpoint.pt through a link to a folder above it (a scratch path and its
    link in the home folder) was compared by os.path.abspath and taken for another run's start: the owed snapshot
    was not kept (lost at the next write of checkpoint.pt), the checkpoints recorded the run as started from its own
    file at the resumed update, and the resume warned that checkpoint.pt was of another start. Reference: a straight
    run's snapshot, and the record of a run started afresh (no train.resume file, update 0)."""
    import logging

    from engine import snapshots

    run = ("train.keep_every_epochs=1",)
    train.main(debug_config(*run, name="straight"))
    link = snapshots.link_or_copy
    monkeypatch.setattr(snapshots, "link_or_copy", killed_at_the_snapshot("epoch0001.pt"))
    with pytest.raises(Killed):
        train.main(debug_config(*run, name="killed"))
    monkeypatch.setattr(snapshots, "link_or_copy", link)
    (tmp_path / "alias").symlink_to(tmp_path, target_is_directory=True)
    with caplog.at_level(logging.WARNING):
        train.main(debug_config(*run, f"train.resume={tmp_path / 'alias' / 'killed' / 'checkpoint.pt'}",
                                name="killed"))
    assert snapshots_of(tmp_path / "killed") == snapshots_of(tmp_path / "straight") == ["epoch0001.pt", "epoch0002.pt"]
    assert same_snapshot(tmp_path / "killed/snapshots/epoch0001.pt", tmp_path / "straight/snapshots/epoch0001.pt")
    final = torch.load(tmp_path / "killed/checkpoint.pt", weights_only=True)
    assert (final["resumed_from"], final[snapshots.STARTED_AT_STEP]) == (None, 0)
    assert not [r for r in caplog.records if "another start than train.resume" in r.getMessage()]
