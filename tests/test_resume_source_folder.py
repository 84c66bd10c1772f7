"""train.resume names one checkpoint file (engine/snapshots.py, resume_source): a folder is refused in one line that
names the files in it that could be meant, not reported as missing."""
import os
import subprocess
import sys

import pytest

from engine.checkpoint import CheckpointError
from engine.snapshots import resume_source
from tests.conftest import DEBUG_CONFIG, ROOT


def test_a_folder_as_train_resume_is_refused_naming_the_checkpoint_files_in_it(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    with pytest.raises(CheckpointError) as refused:
        resume_source(str(tmp_path / "new"), str(folder))
    assert str(refused.value) == (f"train.resume={folder} is a folder, not a checkpoint file: give a file in it, "
                                  f"e.g. {folder / 'checkpoint.pt'} or a snapshot "
                                  f"({folder / 'snapshots' / 'epoch<E>.pt'})")
    missing = tmp_path / "missing.pt"
    with pytest.raises(CheckpointError, match=r": no such file; "):  # a missing file stays 'no such file'
        resume_source(str(tmp_path / "new"), str(missing))


@pytest.mark.slow
def test_train_py_with_a_folder_as_train_resume_ends_with_one_error_line(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    run = subprocess.run([sys.executable, "train.py", "--config", DEBUG_CONFIG, f"out_dir={tmp_path / 'new'}",
                          "log.tensorboard=false", f"train.resume={folder}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == (f"error: train.resume={folder} is a folder, not a checkpoint "
                                                   f"file: give a file in it, e.g. {folder / 'checkpoint.pt'} or "
                                                   f"a snapshot ({folder / 'snapshots' / 'epoch<E>.pt'})")
