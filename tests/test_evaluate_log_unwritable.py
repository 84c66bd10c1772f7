"""evaluate.py writes its log to eval.log beside the result: a folder of that name there (or a log file it may not
write) is one `error:` line naming eval.log and --out, as an unwritable --out folder is, not an IsADirectoryError
traceback; nothing is written."""
import os

import pytest

from tests.conftest import run_entry


def _refusal(checkpoint, out, capsys) -> str:
    code, _, err = run_entry("evaluate.py", ["--checkpoint", checkpoint, "--quant", "--out", str(out)], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    return lines[0]


def test_a_folder_named_eval_log_beside_the_result_is_one_error_line(checkpoint, tmp_path, capsys):
    (tmp_path / "eval.log").mkdir()
    out = tmp_path / "r.json"
    line = _refusal(checkpoint, out, capsys)
    assert line.startswith(f"error: --out {out}: evaluate.py writes its log to {tmp_path / 'eval.log'}, which cannot "
                           f"be opened (Is a directory)")
    assert line.endswith("give --out a file in another folder")
    assert not out.exists() and os.listdir(tmp_path / "eval.log") == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a read-only file")
def test_a_read_only_eval_log_is_one_error_line(checkpoint, tmp_path, capsys):
    log = tmp_path / "eval.log"
    log.write_text("an earlier run's log\n")
    log.chmod(0o444)
    line = _refusal(checkpoint, tmp_path / "r.json", capsys)
    assert f"writes its log to {log}, which cannot be opened (Permission denied)" in line
    assert log.read_text() == "an earlier run's log\n"
