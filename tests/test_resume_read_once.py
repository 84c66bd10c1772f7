"""A train.resume into another folder reads the checkpoint file once: the run takes the payload that the check
before the claim of out_dir read (train.py check_start_data), unless the file was replaced or rewritten since,
when it reads the file again (engine/snapshots.py ReadAhead)."""
import os

import torch

import engine.snapshots
import train
from engine.snapshots import ReadAhead, file_identity, resume_source


def test_a_resume_into_a_new_folder_reads_its_checkpoint_once(debug_config, monkeypatch):
    first = debug_config("train.max_steps=2", name="a")
    train.main(first)
    start = os.path.join(first.out_dir, "checkpoint.pt")
    real, reads = engine.snapshots.read_training_checkpoint, []

    def counted(path):
        reads.append(os.path.realpath(path))
        return real(path)

    monkeypatch.setattr(engine.snapshots, "read_training_checkpoint", counted)
    result = train.main(debug_config("train.max_steps=3", f"train.resume={start}", name="b"))
    assert result.state.step == 3
    assert reads.count(os.path.realpath(start)) == 1


def test_a_checkpoint_rewritten_after_the_check_is_read_again(tmp_path):
    from tests.test_train import _training_checkpoint

    path = tmp_path / "start.pt"
    _training_checkpoint(path, 1.0)

    def read_ahead():  # its weight 5.0 tells the payload read ahead from the file's (1.0, then 2.0)
        payload = torch.load(path, weights_only=True)
        return ReadAhead(str(path), file_identity(str(path)), {**payload, "model": {"w": torch.tensor([5.0])}})

    ahead = read_ahead()
    assert resume_source(str(tmp_path / "new"), str(path), ahead)[1]["model"]["w"].item() == 5.0
    assert ahead.payload is None  # taken: the run frees it
    stale = read_ahead()
    _training_checkpoint(path, 2.0)  # rewritten between the check and the run's read
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))  # a later time even on a coarse clock
    assert resume_source(str(tmp_path / "new"), str(path), stale)[1]["model"]["w"].item() == 2.0
