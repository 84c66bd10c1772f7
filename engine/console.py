"""Console output that survives the environment a job runs in: a console whose encoding cannot show a
character (an ASCII or Latin-1 locale, PYTHONIOENCODING=ascii) gets that character as a backslash escape
instead of a UnicodeEncodeError, and a console that can no longer be written (a closed pipe: `| head -1` or
a log reader that ended; a terminal that hung up) ends the console output quietly, while the run and its log
file go on.
"""
from __future__ import annotations

import logging
import os
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Optional, TextIO


def _write(stream: TextIO, text: str) -> None:
    """Write `text` to `stream`; characters its encoding cannot show become backslash escapes. The first try
    writes the text as it is, so that the stream's own error handler (surrogateescape on a C-locale console:
    a path's undecodable bytes) still passes through what it can."""
    try:
        stream.write(text)
    except UnicodeEncodeError:
        encoding = getattr(stream, "encoding", None) or "ascii"
        stream.write(text.encode(encoding, "backslashreplace").decode(encoding))


def _silence(stream: TextIO) -> None:
    """Point the file descriptor of a stream whose reader has gone at /dev/null, so that later writes and the
    interpreter's flush at exit do not raise BrokenPipeError ("Exception ignored ..." on stderr)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture): nothing to redirect
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def console_print(text: str, stream: Optional[TextIO] = None) -> bool:
    """print(text) to stdout (or `stream`) that neither fails on characters the console cannot encode nor on a
    console that can no longer be written; False when the text was not shown."""
    return _show(text, stream)[0]


def _show(text: str, stream: Optional[TextIO]) -> tuple[bool, Optional[str]]:
    """console_print's work: (shown, why the console is gone for good, or None). Any OSError but EAGAIN ends
    the console: a closed pipe (EPIPE), a terminal that hung up (EIO), a redirect to a full disk (ENOSPC). A
    non-blocking console that is full for the moment (BlockingIOError, EAGAIN) only misses this text."""
    stream = sys.stdout if stream is None else stream
    if stream is None:  # started with stdout closed (`>&-`): there is no console to show it on
        return False, "no console"
    try:
        with _above_progress_bars(stream):
            _write(stream, text + "\n")
            stream.flush()
    except BlockingIOError:
        return False, None
    except OSError as e:
        _silence(stream)
        return False, e.strerror or type(e).__name__
    return True, None


def _above_progress_bars(stream: TextIO) -> AbstractContextManager:
    """While a tqdm progress bar is open (the training loop's, an evaluation's; on stderr, a terminal), tqdm's
    external_write_mode: the bars are cleared for the text and drawn again below it, as tqdm.write does, instead of
    the text being appended to the bar's line. Nothing otherwise (tqdm not imported: no bar to keep clear of)."""
    tqdm = sys.modules.get("tqdm")
    bars = getattr(getattr(tqdm, "tqdm", None), "_instances", None)
    if not bars:
        return nullcontext()
    return tqdm.tqdm.external_write_mode(file=stream)


class ConsoleHandler(logging.StreamHandler):
    """The console log handler: each record as console_print writes text. When the console can no longer be
    written (its reader has gone), the handler writes nothing more and says so once in the other handlers (the
    run's log file), which keep every record."""

    gone = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.gone:
            return
        try:
            problem = _show(self.format(record), self.stream)[1]
        except Exception:  # noqa: BLE001 - a record whose arguments do not fit its message, a stream closed by
            # its owner (ValueError): logging's usual report, as StreamHandler gives; the record never ends the run
            self.handleError(record)
            return
        if problem is not None:
            # a flag, not removeHandler: the logger is iterating over its handlers, and removing this one
            # would skip the next (the log file) for this record
            self.gone = True
            logging.getLogger(__name__).warning("the console cannot be written any more (%s); the log goes on in "
                                                "the log file only", problem)
