"""The notes the claim of out_dir gives on its files (an earlier run's files moved to the archive) come before
train.log is opened: they are said on stderr, and written into the new train.log too, once each."""
import os
import subprocess
import sys

import pytest

from configs import config_to_dict
from engine.run_dir import save_config_history
from tests.conftest import DEBUG_CONFIG, ROOT

NOTE = "moved the earlier run's"


@pytest.mark.slow
def test_the_archive_note_is_in_the_new_train_log_and_on_stderr_once_each(debug_config):
    """A restart of the same run before its first checkpoint archives its logs (docs/operations.md): run as a
    process, so that stderr is what a job's stderr would be (no test handlers on the root logger)."""
    cfg = debug_config("train.max_steps=2", name="restart")
    os.makedirs(cfg.out_dir)
    save_config_history(cfg.out_dir, config_to_dict(cfg), 0)  # what a run killed in its first epoch leaves
    with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w") as f:
        f.write('{"step": 2, "train/loss": 1.0}\n')
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", DEBUG_CONFIG,
                           f"out_dir={cfg.out_dir}", "train.max_steps=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert os.listdir(os.path.join(cfg.out_dir, "archive"))  # the earlier files were moved aside
    with open(os.path.join(cfg.out_dir, "train.log"), encoding="utf-8") as f:
        log_lines = [line for line in f if NOTE in line]
    assert len(log_lines) == 1 and " WARNING " in log_lines[0], log_lines
    assert sum(NOTE in line for line in done.stderr.splitlines()) == 1, done.stderr[-2000:]
    assert NOTE not in done.stdout  # said on stderr, as before: not a second time on stdout
