"""The console output of the entry points where the console is hostile: an encoding without the characters of a
table or a path (an ASCII or Latin-1 locale, PYTHONIOENCODING=ascii), or a reader that went away (`| head -1`,
an ended ssh session). The run goes on, its log file keeps every line, and no traceback is printed."""
import contextlib
import ast
import io
import logging
import os
import sys

import pytest

from conftest import DEBUG_CONFIG, ROOT, load_script, run_entry
from configs.cli import OneLineParser
from engine.console import console_print
from engine.runinfo import setup_logging


def ascii_console() -> tuple[io.BytesIO, io.TextIOWrapper]:
    """A console as Python opens stdout under LC_ALL=C with PYTHONUTF8=0: ASCII, strict."""
    raw = io.BytesIO()
    return raw, io.TextIOWrapper(raw, encoding="ascii", errors="strict", write_through=True)


@pytest.fixture
def closed_pipe():
    """A text stream on a real pipe whose reader has closed its end: a write raises BrokenPipeError (Python
    ignores SIGPIPE), as stdout does under `cmd | head -1` once head has exited."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    stream = open(write_fd, "w", encoding="utf-8")
    yield stream
    with contextlib.suppress(OSError):  # a failing test may leave text buffered for the closed pipe
        stream.close()


def test_log_lines_an_ascii_console_cannot_show_are_escaped_there_and_kept_whole_in_the_log_file(
        tmp_path, monkeypatch, capsys):
    raw, console = ascii_console()
    monkeypatch.setattr(sys, "stdout", console)
    setup_logging(str(tmp_path), is_main=True)
    logging.getLogger("t").info("gap 0.64 \u00b1 0.03 in /data/\u00fc")
    assert raw.getvalue().decode("ascii").endswith(" t INFO gap 0.64 \\xb1 0.03 in /data/\\xfc\n")
    with open(tmp_path / "train.log", "rb") as f:
        assert f.read().endswith(" t INFO gap 0.64 \u00b1 0.03 in /data/\u00fc\n".encode("utf-8"))
    assert capsys.readouterr().err == ""  # no "--- Logging error ---" report


def test_a_closed_console_ends_the_console_log_quietly_and_the_log_file_keeps_every_line(
        tmp_path, monkeypatch, capsys, closed_pipe):
    monkeypatch.setattr(sys, "stdout", closed_pipe)
    setup_logging(str(tmp_path), is_main=True)
    for i in range(3):
        logging.getLogger("t").info("line %d", i)
    with open(tmp_path / "train.log", encoding="utf-8") as f:
        lines = [line.split(" ", 1)[1] for line in f.read().splitlines()]  # without the time
    assert lines == ["engine.console WARNING the console cannot be written any more (Broken pipe); the log goes "
                     "on in the log file only", "t INFO line 0", "t INFO line 1", "t INFO line 2"]
    assert capsys.readouterr().err == ""
    closed_pipe.write("later\n")  # the descriptor now leads to /dev/null: no BrokenPipeError at exit either
    closed_pipe.flush()


def test_console_print_says_whether_the_text_was_shown(closed_pipe):
    raw, console = ascii_console()
    assert console_print("a \u2020 b", console) and raw.getvalue() == b"a \\u2020 b\n"
    assert not console_print("table", closed_pipe)


def test_evaluate_prints_its_marked_table_on_an_ascii_console(tmp_path, monkeypatch, capsys):
    """An evaluation under bf16 autocast marks its row with a dagger: an ASCII console gets it escaped, after
    the result file is written, and the command exits 0 (it ended in a UnicodeEncodeError traceback)."""
    run = tmp_path / "run"
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={run}", "train.max_steps=1",
                                          "log.tensorboard=false"], capsys)
    assert code == 0, err
    raw, console = ascii_console()
    monkeypatch.setattr(sys, "stdout", console)
    code, _, err = run_entry("evaluate.py", ["--checkpoint", str(run / "best.pt"), "--amp", "bf16",
                                             "quant.pipelines=[]"], capsys)
    assert code == 0, err
    shown = raw.getvalue().decode("ascii")
    assert "| vit_nano\\u2020 | Baseline |" in shown
    assert "\\u2020 vit_nano Baseline: evaluated with --amp bf16" in shown

    # paper_table.py on the same console: the table escaped there, its --out file UTF-8 as written
    raw.seek(0)
    raw.truncate()
    table = load_script("paper_table").main([str(run / "eval_best.json"), "--out", str(tmp_path / "t.md")])
    # the run stopped at its train.max_steps=1 of 8 updates: paper_table marks it § (under 99 % of its schedule)
    assert "| vit_nano\\u2020 | Baseline\\xa7 |" in raw.getvalue().decode("ascii")
    written = (tmp_path / "t.md").read_bytes()
    assert written.startswith((table + "\n").encode("utf-8")) and "\u2020" in table


def test_help_with_characters_an_ascii_console_lacks_is_printed_escaped():
    """--help of paper_table.py (its ± in a flag's help) ended in a UnicodeEncodeError on an ASCII console."""
    raw, console = ascii_console()
    parser = OneLineParser(prog="p", description="mean \u00b1 std")
    parser.print_help(console)
    assert "mean \\xb1 std" in raw.getvalue().decode("ascii")


# The scripts that write reports with ±, † or × (or rewrite a README holding them): each text file they open
# names its encoding, so that the file is UTF-8 under any locale (ASCII: a UnicodeEncodeError after the work;
# Latin-1: a report that reads as mojibake elsewhere).
REPORT_WRITERS = ["paper_table", "dose_report", "lm_study", "compare_act_max", "readme_tables"]


def opens_without_encoding(path: str) -> list[int]:
    """Lines of `path` that open a file for writing in text mode without encoding= (open() or Path.write_text)."""
    lines = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        keywords = {k.arg for k in node.keywords}
        modes = [a.value for a in node.args[:2] + [k.value for k in node.keywords if k.arg == "mode"]
                 if isinstance(a, ast.Constant) and isinstance(a.value, str) and set(a.value) <= set("rwaxbt+")]
        mode = modes[0] if modes else "r"  # open(path, mode) or path.open(mode)
        # Path.write_text; a bare write_text(...) is engine/outputs.py's, which names UTF-8 (checked below)
        path_write_text = name == "write_text" and isinstance(node.func, ast.Attribute)
        writes = (name == "open" and any(c in mode for c in "wax") and "b" not in mode) or path_write_text
        if writes and "encoding" not in keywords:
            lines.append(node.lineno)
    return lines


def test_report_writers_write_utf8_whatever_the_locale(tmp_path):
    found = {name: lines for name in REPORT_WRITERS
             if (lines := opens_without_encoding(os.path.join(ROOT, "scripts", f"{name}.py")))}
    assert found == {}
    # the scripts write their tables through engine/outputs.py's write_text / write_csv
    assert opens_without_encoding(os.path.join(ROOT, "engine", "outputs.py")) == []
    check = tmp_path / "s.py"  # the check is not blind
    check.write_text('open(p, "w")\nopen(p, "wb")\nopen(p, "w", encoding="utf-8")\nP.write_text(t)\nopen(p)\n'
                     'P.open("a")\nopen(p, mode="w", newline="")\nwrite_text(p, t, True)\n')
    assert opens_without_encoding(str(check)) == [1, 4, 6, 7]


def test_python_m_cd_into_a_closed_pipe_ends_quietly(monkeypatch, closed_pipe):
    """`python -m cd ... | head -1` ended in a BrokenPipeError traceback (cd/__main__.py prints without
    engine/, which `pip install .` does not install)."""
    from cd.__main__ import main

    monkeypatch.setattr(sys, "stdout", closed_pipe)
    main(["--model", "vit_tiny_patch16_224"])
    closed_pipe.write("later\n")  # as the interpreter's flush at exit: the descriptor leads to /dev/null now
    closed_pipe.flush()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_console_redirected_to_a_full_disk_ends_the_console_log_quietly(tmp_path, monkeypatch, capsys):
    """`train.py > /dev/full` (stdout to a file on a full disk): ENOSPC ends the console log as a closed pipe
    does; the log file keeps the record."""
    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        setup_logging(str(tmp_path), is_main=True)
        logging.getLogger("t").info("line")
        monkeypatch.undo()
    log = (tmp_path / "train.log").read_text(encoding="utf-8")
    assert "the console cannot be written any more (No space left on device)" in log and log.endswith("t INFO line\n")
    assert capsys.readouterr().err == ""


def test_a_stream_closed_by_its_owner_is_logging_s_usual_report_not_an_error_of_the_run(capsys):
    """A console stream closed under the handler (ValueError, not OSError: e.g. a capture a test or a notebook
    closed) gets logging's '--- Logging error ---' report on stderr, as StreamHandler gives; the call that
    logged goes on."""
    from engine.console import ConsoleHandler
    stream, log = io.StringIO(), logging.getLogger("test_console.closed")
    handler = ConsoleHandler(stream)
    log.addHandler(handler)
    try:
        log.warning("shown")
        assert stream.getvalue() == "shown\n"
        stream.close()
        log.warning("not shown")  # raised ValueError out of the logging call
    finally:
        log.removeHandler(handler)
    assert "--- Logging error ---" in capsys.readouterr().err and not handler.gone


def test_a_momentarily_full_non_blocking_console_misses_text_but_is_not_given_up():
    """EAGAIN (a non-blocking pipe or tty that is full for the moment) is no reader gone: the text is not shown,
    and once the reader has drained the pipe the console shows text again; it was pointed at /dev/null for good."""
    import fcntl
    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, fcntl.F_SETFL, fcntl.fcntl(write_fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    fcntl.fcntl(read_fd, fcntl.F_SETFL, fcntl.fcntl(read_fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    stream = open(write_fd, "w", encoding="utf-8")
    try:
        shown = [console_print("x" * 1000, stream) for _ in range(200)]  # 200 kB into a pipe of 64 kB
        assert True in shown and False in shown
        with contextlib.suppress(BlockingIOError):
            while os.read(read_fd, 1 << 16):
                pass
        assert console_print("after", stream)
        assert os.readlink(f"/proc/self/fd/{write_fd}").startswith("pipe:")  # not /dev/null
        received = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(read_fd, 1 << 16):
                received += chunk
        assert received.endswith(b"after\n")
    finally:
        with contextlib.suppress(OSError):
            stream.close()
        os.close(read_fd)


class _Terminal:
    """stdout and stderr of one terminal: what each writes goes to one screen, where a carriage return moves back
    to the line's start and later characters overwrite the line (what a progress bar's redraw relies on)."""

    def __init__(self):
        self.written = []

    def stream(self):
        terminal = self

        class Stream(io.StringIO):
            def write(self, text):
                terminal.written.append(text)
                return len(text)

            def isatty(self):
                return True

        return Stream()

    def lines(self) -> list:
        shown = []
        for raw in "".join(self.written).split("\n"):
            line = ""
            for part in raw.split("\r"):
                line = part + line[len(part):]  # written from column 0 over what was there
            shown.append(line.rstrip())
        return shown


def test_log_lines_written_while_the_epoch_bar_is_open_get_lines_of_their_own_and_the_bar_counts_epochs_from_1(
        monkeypatch):
    """On a terminal, the training loop's bar (stderr) and the console's log lines (stdout) share the screen: each
    log line is shown on a line of its own, not appended to the bar's, and the bar labels the epoch as the log
    lines count it ("epoch 1/2", not "epoch 0")."""
    import torch
    from engine.console import ConsoleHandler
    from engine.loop import TrainBatches, TrainLoop, TrainState

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal.stream())
    monkeypatch.setattr(sys, "stderr", terminal.stream())
    log = logging.getLogger("test_console.bar")
    handler = ConsoleHandler(sys.stdout)
    log.addHandler(handler)
    monkeypatch.setattr(log, "propagate", False)

    class Order:
        def set_epoch(self, epoch, start=0):
            pass

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     compute_loss=lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y),
                     device=torch.device("cpu"), log_every=1, progress=True, epochs=2,
                     log=lambda step, metrics: log.warning("logged update %d", step))
    batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(3)]
    try:
        loop.run_epoch(TrainBatches(batches, Order()), TrainState(), batch_size_per_gpu=2)
    finally:
        log.removeHandler(handler)
    lines = terminal.lines()
    assert [f"logged update {n}" for n in (1, 2, 3)] == [line for line in lines if "logged" in line], lines
    assert "epoch 1/2" in "".join(terminal.written) and "epoch 0" not in "".join(terminal.written)


def test_a_python_warning_of_the_run_is_kept_in_train_log(tmp_path, capsys):
    """cd's warning for a model it finds no pair in (warnings.warn, as a library warns) is a line of train.log, as
    the run's own warnings are, not stderr's alone."""
    run = tmp_path / "run"
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={run}", "train.max_steps=1",
                                          "model.name=resnet10t", "model.drop_path=0.0", "log.tensorboard=false",
                                          "quant.pipelines=[]"], capsys)
    assert code == 0, err
    lines = [line for line in (run / "train.log").read_text().splitlines() if "no matrix pair found in ResNet" in line]
    assert len(lines) == 1 and " WARNING " in lines[0] and lines[0].endswith(
        "no cd/pair_energy metrics are logged for this model"), lines
