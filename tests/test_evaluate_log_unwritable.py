"""evaluate.py writes its log to eval.log beside the result: a folder of that name there (or a log file it may not
write) is one `error:` line naming eval.log and --out, as an unwritable --out folder is, not an IsADirectoryError
traceback; nothing is written. An eval.log there that is no log (the user's notes) is refused alike, before
anything is written into it: evaluate.py appends only to a log, its own of earlier calls. With --out a symlink,
the log is the one beside the file the link names, where the result is written."""
import logging
import os
import re

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
    log.write_text(EARLIER)
    log.chmod(0o444)
    line = _refusal(checkpoint, tmp_path / "r.json", capsys)
    assert f"writes its log to {log}, which cannot be opened (Permission denied)" in line
    assert log.read_text() == EARLIER


EARLIER = "04:33:16 evaluate INFO commit 6c98089, torch 2.4.0, timm 1.0.9\n"  # an earlier call's log


@pytest.mark.parametrize("notes", ["my notes\n", "my notes, no newline", "\n04:33:16 evaluate INFO after a blank\n"])
@pytest.mark.parametrize("out_given", [True, False])
def test_an_eval_log_that_is_no_log_is_refused_and_left_as_it_was(checkpoint, tmp_path, capsys, notes, out_given):
    """The user's eval.log beside the result (--out's folder, or the checkpoint's for the default --out), found
    before the result file's own refusal (here a JSON that is no result), is one error line; the file is unchanged
    and nothing is made beside it."""
    folder = tmp_path if out_given else os.path.dirname(checkpoint)
    log, out = os.path.join(folder, "eval.log"), os.path.join(folder, "other.json")
    with open(log, "w") as f:
        f.write(notes)
    with open(out, "w") as f:
        f.write('{"a": 1}\n')
    before = sorted(os.listdir(folder))
    args = ["--checkpoint", checkpoint, "--quant"] + (["--out", out] if out_given else [])
    code, stdout, err = run_entry("evaluate.py", args, capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    first = notes.split("\n")[0]
    assert lines[0].startswith("error: --out ") and f"writes its log to {log}, which is not evaluate.py's log " \
        f"(its first line {first!r} is no log line); move that file away, or give --out a file in another folder" \
        in lines[0], lines[0]
    with open(log) as f:
        assert f.read() == notes
    assert sorted(os.listdir(folder)) == before and stdout == ""
    os.remove(log)  # the checkpoint's folder is shared by the module's tests


def test_an_earlier_calls_log_is_one_to_append_to(tmp_path):
    """The lines evaluate.py's logging writes (engine/runinfo.py setup_logging) are a log's: foreign_log passes a
    file that begins with them, and with any of the logging levels; an empty file (a call killed at once) too."""
    from engine.runinfo import foreign_log, setup_logging
    setup_logging(str(tmp_path), is_main=True, filename="eval.log")
    try:
        for level in (logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL):
            logging.getLogger("py.warnings").log(level, "a line")
            assert foreign_log(str(tmp_path / "eval.log")) is None
            (tmp_path / "eval.log").write_text("")
    finally:
        for handler in [h for h in logging.getLogger().handlers if getattr(h, "_cd_run", False)]:
            logging.getLogger().removeHandler(handler)
            handler.close()
    assert foreign_log(str(tmp_path / "eval.log")) is None  # empty
    assert foreign_log(str(tmp_path / "none.log")) is None
    (tmp_path / "eval.log").write_text("my notes\n")
    assert foreign_log(str(tmp_path / "eval.log")) == "its first line 'my notes' is no log line"


def _linked_out(tmp_path, link_name: str = "r.json", target_name: str = "r.json"):
    """links/<link_name> -> real/<target_name> (not there yet): the --out of these tests, and the two folders."""
    links, real = tmp_path / "links", tmp_path / "real"
    links.mkdir()
    real.mkdir()
    link = links / link_name
    link.symlink_to(real / target_name)
    return link, links, real


def test_notes_beside_an_out_link_are_no_file_of_the_command(checkpoint, tmp_path, capsys):
    """--out a symlink: the result and eval.log are written beside the file it names (links/r.json -> real/r.json:
    real/eval.log). An eval.log of the user's beside the link is no file the command writes: it runs, and leaves
    the notes as they were."""
    link, links, real = _linked_out(tmp_path)
    (links / "eval.log").write_text("my notes\n")
    code, _, err = run_entry("evaluate.py", ["--checkpoint", checkpoint, "--quant", "--out", str(link)], capsys)
    assert code == 0, err
    assert (links / "eval.log").read_text() == "my notes\n"
    assert sorted(p.name for p in links.iterdir()) == ["eval.log", "r.json"]
    with open(real / "eval.log") as f:  # the run's own log, "04:33:16 evaluate INFO ...", beside the result
        assert re.match(r"\d\d:\d\d:\d\d evaluate INFO ", f.readline())
    assert (real / "r.json").is_file() and link.is_symlink()


def test_notes_beside_the_file_an_out_link_names_are_refused_before_the_weights_are_read(tmp_path, capsys):
    """The eval.log the command would append to lies beside the file the link names: notes there are one error
    line naming that file, told before the weights are read (the checkpoint does not exist: a later refusal would
    name it), with nothing made in either folder."""
    link, links, real = _linked_out(tmp_path)
    (real / "eval.log").write_text("my notes\n")
    line = _refusal(str(tmp_path / "gone.pt"), link, capsys)
    assert line.startswith(f"error: --out {link}: evaluate.py writes its log to {real / 'eval.log'}, which is not "
                           f"evaluate.py's log (its first line 'my notes' is no log line); move that file away"), line
    assert (real / "eval.log").read_text() == "my notes\n"
    assert sorted(p.name for p in links.iterdir()) == ["r.json"] and sorted(os.listdir(real)) == ["eval.log"]


@pytest.mark.parametrize("link_name, target_name, refused", [("eval.log", "r.json", False),
                                                              ("r.json", "eval.log", True)])
def test_the_log_name_is_judged_on_the_file_an_out_link_names(tmp_path, capsys, link_name, target_name, refused):
    """The result may not be eval.log, the log's own name in its folder: that of the file a link names, where
    both are written. A link named eval.log to real/r.json writes real/r.json and real/eval.log (here it goes on
    to the missing checkpoint); a link to real/eval.log is refused before the weights are read."""
    link, _, _ = _linked_out(tmp_path, link_name, target_name)
    line = _refusal(str(tmp_path / "gone.pt"), link, capsys)
    said = "evaluate.py writes its log to eval.log in the result's folder; give the result another name" in line
    assert said == refused and (refused or "gone.pt" in line), line


@pytest.mark.parametrize("loop", ["self", "pair"])
def test_an_out_link_in_a_loop_is_refused_and_kept(tmp_path, capsys, loop):
    """A loop of links names no file: realpath stops on one of its links, which a write would replace by a file.
    One error line, before the weights are read (the checkpoint does not exist), and the links stay as they were."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.symlink_to(a.name if loop == "self" else b.name)
    if loop == "pair":
        b.symlink_to(a.name)
    line = _refusal(str(tmp_path / "gone.pt"), a, capsys)
    assert line == f"error: --out {a} is a link that never reaches a file (a loop of links); remove it or choose " \
                   "another --out", line
    assert a.is_symlink() and os.readlink(a) == (a.name if loop == "self" else b.name)
    assert loop == "self" or (b.is_symlink() and os.readlink(b) == a.name)
