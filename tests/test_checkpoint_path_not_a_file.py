"""out_dir/checkpoint.pt, or train.resume, that exists but is not a file (a folder, a pipe) is refused with one error
line before anything in out_dir moves or any training runs (engine/run_dir.py, checkpoint_path_problem), by the
claim of the folder and by resume_source alike: a folder at checkpoint.pt was no resume point for resume_source
(isfile) and no fresh start for the claim (exists), so the run trained over the earlier run's best.pt and
metrics.jsonl and failed only at its first checkpoint write."""
import os

import pytest

from engine.checkpoint import CheckpointError
from engine.run_dir import RunDirError, claim_run_dir
from engine.snapshots import resume_source
from tests.conftest import DEBUG_CONFIG, run_entry

EARLIER = {"best.pt": b"earlier weights", "metrics.jsonl": b'{"step": 8}\n', "train.log": b"earlier log\n"}


def tree(folder) -> dict:
    """{relative path: bytes, or 'folder'} of everything under `folder` but the run lock."""
    found = {}
    for root, dirs, names in os.walk(folder):
        for name in dirs:
            found[os.path.relpath(os.path.join(root, name), folder)] = "folder"
        for name in names:
            if name != ".run.lock":
                with open(os.path.join(root, name), "rb") as f:
                    found[os.path.relpath(os.path.join(root, name), folder)] = f.read()
    return found


def earlier_run_with_a_folder_at_checkpoint(out) -> None:
    os.makedirs(out / "checkpoint.pt")
    for name, content in EARLIER.items():
        (out / name).write_bytes(content)


def config(resume: str = "") -> dict:
    return {"model": {"pretrained": ""}, "train": {"resume": resume, "keep_every_epochs": 0}}


@pytest.mark.parametrize("archive_existing", [False, True])
def test_a_folder_at_checkpoint_pt_is_refused_by_the_claim_and_nothing_moves(tmp_path, archive_existing):
    out = tmp_path / "run"
    earlier_run_with_a_folder_at_checkpoint(out)
    before = tree(out)
    with pytest.raises(RunDirError) as refused:
        with claim_run_dir(str(out), config(), archive_existing=archive_existing):
            pytest.fail("claimed a folder whose checkpoint.pt is a folder")
    assert str(refused.value) == (f"{out / 'checkpoint.pt'} is a folder, not a checkpoint file: move it away (a run "
                                  f"resumes from out_dir/checkpoint.pt and writes its checkpoints there), or choose "
                                  f"another out_dir")
    assert tree(out) == before  # nothing archived, nothing written


def test_resume_source_refuses_the_same_folder_on_every_rank(tmp_path):
    """resume_source (each rank's own look) gives the claim's line, not a fresh start (None, None)."""
    out = tmp_path / "run"
    earlier_run_with_a_folder_at_checkpoint(out)
    with pytest.raises(CheckpointError, match=r"checkpoint\.pt is a folder, not a checkpoint file: move it away"):
        resume_source(str(out), "")
    # also beside a train.resume that is a good file: the run would still fail at its first checkpoint write
    (tmp_path / "other.pt").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match=r"checkpoint\.pt is a folder, not a checkpoint file"):
        resume_source(str(out), str(tmp_path / "other.pt"))


def test_a_pipe_as_train_resume_is_refused_before_the_folder_is_archived(tmp_path):
    """A train.resume that exists but is no file (a named pipe) is named as such, not 'no such file', and is
    refused by the claim before train.archive_existing=true moves anything."""
    out = tmp_path / "run"
    out.mkdir()
    for name, content in EARLIER.items():
        (out / name).write_bytes(content)
    pipe = tmp_path / "resume.pt"
    os.mkfifo(pipe)
    before = tree(out)
    expected = (f"train.resume={pipe} is a device, a pipe or a socket, not a checkpoint file: give a checkpoint.pt "
                f"or a snapshot (out_dir/snapshots/epoch<E>.pt) written by train.py")
    with pytest.raises(RunDirError) as refused:
        with claim_run_dir(str(out), config(resume=str(pipe)), archive_existing=True):
            pytest.fail("claimed with a pipe as train.resume")
    assert str(refused.value) == expected
    assert tree(out) == before
    with pytest.raises(CheckpointError) as refused:
        resume_source(str(tmp_path / "new"), str(pipe))
    assert str(refused.value) == expected


def test_a_regular_checkpoint_pt_and_a_broken_link_keep_their_meaning(tmp_path):
    """The check refuses only what exists and is not a file: a link to nothing at checkpoint.pt stays an earlier
    run's file (refused as one without archive_existing, archived with it), as before."""
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(tmp_path / "gone.pt", out / "checkpoint.pt")
    with pytest.raises(RunDirError, match=r"holds files of an earlier run \(checkpoint\.pt\) but no checkpoint\.pt"):
        with claim_run_dir(str(out), config()):
            pass
    with claim_run_dir(str(out), config(), archive_existing=True):
        assert sorted(os.listdir(out)) == [".run.lock", "archive"]


def test_train_py_ends_with_one_error_line_before_training_and_keeps_the_earlier_files(tmp_path, capsys):
    out = tmp_path / "B"
    earlier_run_with_a_folder_at_checkpoint(out)
    before = tree(out)
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={out}", "log.tensorboard=false",
                                          "sched.epochs=3"], capsys)
    assert code != 0 and err.strip().splitlines() == [
        f"error: {out / 'checkpoint.pt'} is a folder, not a checkpoint file: move it away (a run resumes from "
        f"out_dir/checkpoint.pt and writes its checkpoints there), or choose another out_dir"], err
    assert tree(out) == before  # best.pt, metrics.jsonl and train.log as the earlier run left them
