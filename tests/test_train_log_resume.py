"""A resume in out_dir appends its log lines to out_dir/train.log: a train.log there that is no log of train.py's
(the user's notes) is refused with one `error:` line naming it and the fix, before anything in the folder changes
(README: no command appends to a file it did not create); a train.log a run wrote is appended to, as before. A
fresh start moves such a file to the archive instead (tests/test_nothing_lost.py)."""
import os
import re
import shutil

import torch

from tests.conftest import DEBUG_CONFIG, run_entry

# a line of a run's log, as train.py writes it: "04:33:16 train INFO ..."
LOG_LINE = re.compile(r"\d\d:\d\d:\d\d train (INFO|WARNING) ")


def _args(out_dir, steps: int, *more: str) -> list[str]:
    """The debug run (8 updates in two epochs) into `out_dir`, stopped at update `steps`."""
    return ["--config", DEBUG_CONFIG, f"out_dir={out_dir}", "log.tensorboard=false", f"train.max_steps={steps}",
            *more]


def _files(folder) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and modification time: what a refusal must leave as it was."""
    found = {}
    for where, _, names in os.walk(folder):
        for name in names:
            stat = os.stat(os.path.join(where, name))
            found[os.path.relpath(os.path.join(where, name), folder)] = (stat.st_size, stat.st_mtime_ns)
    return found


def _refusal(args: list[str], capsys) -> str:
    code, stdout, err = run_entry("train.py", args, capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and stdout == "", err
    return lines[0]


def _expected(out_dir) -> str:
    log = os.path.join(out_dir, "train.log")
    return (f"error: out_dir '{out_dir}': the resume appends its log to {log}, which is not train.py's log (its "
            f"first line 'my notes' is no log line); move that file out of the folder and run the command again")


def test_a_resume_refuses_a_train_log_that_is_no_log_and_leaves_the_folder_as_it_was(tmp_path, capsys):
    """The run, its --print-config too, and a resume from one of out_dir's snapshots (no checkpoint.pt)."""
    code, _, err = run_entry("train.py", _args(tmp_path, 4, "train.keep_every_epochs=1"), capsys)
    assert code == 0, err
    (tmp_path / "train.log").write_text("my notes\n")
    before = _files(tmp_path)
    assert _refusal(_args(tmp_path, 8), capsys) == _expected(tmp_path)
    assert _refusal(_args(tmp_path, 8, "--print-config"), capsys) == _expected(tmp_path)
    assert (tmp_path / "train.log").read_text() == "my notes\n" and _files(tmp_path) == before
    shutil.move(tmp_path / "checkpoint.pt", tmp_path.parent / f"{tmp_path.name}-moved.pt")
    before = _files(tmp_path)
    snapshot = tmp_path / "snapshots" / "epoch0001.pt"
    assert _refusal(_args(tmp_path, 8, f"train.resume={snapshot}"), capsys) == _expected(tmp_path)
    assert (tmp_path / "train.log").read_text() == "my notes\n" and _files(tmp_path) == before


def test_a_resume_appends_to_the_runs_own_train_log(tmp_path, capsys):
    code, _, err = run_entry("train.py", _args(tmp_path, 4), capsys)
    assert code == 0, err
    first = (tmp_path / "train.log").read_text()
    assert LOG_LINE.match(first), first[:200]
    code, _, err = run_entry("train.py", _args(tmp_path, 8), capsys)
    assert code == 0, err
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["state"]["step"] == 8
    both = (tmp_path / "train.log").read_text()
    assert both.startswith(first) and LOG_LINE.match(both[len(first):]), both[len(first):len(first) + 200]
