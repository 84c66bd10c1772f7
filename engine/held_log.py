"""Lines of train.log written later than they are logged, in their order (train.py setup_process):

* `ClaimNotes` keeps the notes engine/run_dir.py logs while out_dir is claimed, before train.log is open, and
  gives them to train.log once it is;
* `HeldLog` holds train.log's lines while a resume of out_dir's run may yet be refused (`hold_log_file`), and
  writes them once the run goes on (`release_log_file`): a refused resume leaves the run's train.log as it was.
"""
from __future__ import annotations

import logging
from typing import Optional


def frozen_copy(record: logging.LogRecord) -> Optional[logging.LogRecord]:
    """A copy of `record` with its message made now (its arguments may change before the copy is written), or
    None where the arguments do not fit the message."""
    copy = logging.makeLogRecord(record.__dict__)
    try:
        copy.msg, copy.args = record.getMessage(), None
    except Exception:  # noqa: BLE001 - any error formatting the message: the caller reports it as logging would
        return None
    return copy


class ClaimNotes(logging.Filter):
    """The notes engine/run_dir.py logs while out_dir is claimed ("moved the earlier run's ... to ...", "removed
    ... a partial write", "kept in out_dir: ..."): they come before train.log is opened, so Python's last-resort
    handler says them on stderr. A filter on that logger (not a handler, which would take that handler's place)
    keeps a copy of each, which `write_to_log_file` gives to train.log once it is open: a job read through its
    train.log sees that the earlier run's files were moved aside."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.logger = logging.getLogger("engine.run_dir")

    def __enter__(self) -> "ClaimNotes":
        """Keep the notes from now on."""
        self.logger.addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        """Keep no more (a command that ends before setup_process)."""
        self.stop()

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep a copy of `record` with its message made now; the record goes on as before."""
        kept = frozen_copy(record)
        if kept is not None:  # None: arguments that do not fit the message, which the handlers report as before
            self.records.append(kept)
        return True

    def stop(self) -> None:
        """Keep no more notes (those logged once train.log is open reach it directly)."""
        self.logger.removeFilter(self)

    def write_to_log_file(self) -> None:
        """Write the notes kept to train.log only (main rank; stderr has said them): to its handler, or to the
        HeldLog in its place, which writes them with its other lines once the run goes on."""
        for handler in list(logging.getLogger().handlers):
            if getattr(handler, "_cd_run", False) and isinstance(handler, (logging.FileHandler, HeldLog)):
                for record in self.records:
                    handler.handle(record)
        self.records = []


class HeldLog(logging.Handler):
    """train.log's handler while a resume of out_dir's run may yet be refused: its records wait here, and go to the
    file (`write_held`) once the run continues. A command that ends before then (a refusal such as "use another
    out_dir", an error) leaves the run's train.log as it was, its lines said on the console only; exit_with_error's
    line goes to the run's FileHandler, which is not among the root logger's handlers while held."""

    def __init__(self, target: logging.FileHandler):
        super().__init__(target.level)
        self.target, self.records = target, []
        self._cd_run = True  # as setup_logging's handlers: a later run in this process (a test) closes it

    def emit(self, record: logging.LogRecord) -> None:
        """Keep a copy of `record` with its message made now (its arguments may change before the release)."""
        held = frozen_copy(record)
        if held is None:  # arguments that do not fit the message: logging's report, as any handler's
            self.handleError(record)
            return
        self.records.append(held)

    def write_held(self) -> None:
        """Put the file's handler back in this one's place and write the records held, in their order (not named
        `release`: that is logging.Handler's lock method, which `handle` calls)."""
        root = logging.getLogger()
        root.removeHandler(self)
        root.addHandler(self.target)
        for record in self.records:
            self.target.handle(record)
        self.records = []

    def close(self) -> None:
        """Close the file's handler too (never written to where the records were not released)."""
        self.target.close()
        super().close()


def hold_log_file() -> None:
    """Put setup_logging's train.log handler behind a HeldLog (main rank)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_cd_run", False) and isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            root.addHandler(HeldLog(handler))


def release_log_file() -> None:
    """Write what a HeldLog holds to train.log, and log there directly from now on (nothing held: nothing to do)."""
    for handler in list(logging.getLogger().handlers):
        if isinstance(handler, HeldLog):
            handler.write_held()
