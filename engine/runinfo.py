"""Run bookkeeping: logging to the console (main rank) and a log file, and an environment line
(git commit, versions, devices) at the top of every log, for reproducibility.
"""
from __future__ import annotations

import logging
import os
import platform
import re
import subprocess
import sys
from typing import Optional

import timm
import torch

from engine.console import ConsoleHandler
from engine.distributed import launched_world_size, say_once


# `extra` of a warning that every rank logs alike (a resume's changed settings, read from the settings every rank
# checked are the same): the other ranks leave it to the main rank, so that it is one line under torchrun
SAME_ON_EVERY_RANK = {"same_on_every_rank": True}

# the shape of a run log's lines (setup_logging's format): "04:33:16 evaluate INFO commit 6c98089, ..."
LOG_FORMAT, LOG_DATE_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s", "%H:%M:%S"
LOG_LINE = re.compile(r"\d\d:\d\d:\d\d \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


def setup_logging(out_dir: str, is_main: bool, filename: str = "train.log") -> None:
    """INFO to stdout and out_dir/<filename> on the main rank; warnings only on the others, but those logged with
    `extra=SAME_ON_EVERY_RANK`, which the main rank says for all. Python warnings
    (warnings.warn: e.g. cd's "no cd/pair_energy metrics are logged for this model") are log records too
    (logger py.warnings), so that the log file keeps them; Python's default filters still hide the deprecation
    warnings of other packages."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_cd_run", False):
            root.removeHandler(handler)
            handler.close()
    fmt = logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT)
    handlers = [ConsoleHandler(sys.stdout)]  # a closed pipe or an ASCII console ends no run (engine/console.py)
    if is_main:
        # UTF-8 whatever the locale: a path or a value with a character the locale's encoding lacks would
        # otherwise lose its line to a "--- Logging error ---" report
        handlers.append(logging.FileHandler(os.path.join(out_dir, filename), encoding="utf-8",
                                            errors="backslashreplace"))
    for handler in handlers:
        handler.setFormatter(fmt)
        handler._cd_run = True
        if not is_main:  # the main rank's line stands for the others' (SAME_ON_EVERY_RANK)
            handler.addFilter(lambda record: not getattr(record, "same_on_every_rank", False))
        root.addHandler(handler)
    root.setLevel(logging.INFO if is_main else logging.WARNING)
    logging.captureWarnings(True)  # they went to stderr alone: not into train.log / eval.log


def foreign_log(path: str) -> Optional[str]:
    """Why the file `path`, which setup_logging would append to, is not a run log ("its first line '...' is no log
    line"), or None: no file there (a folder there is the opening's error), an empty one (opened by a run killed at
    once), or one whose first line has a log line's shape (LOG_LINE). A run's log starts with a line of
    setup_logging's format (log_environment's), so a file of other text is someone's notes: kept as they are, not
    appended to."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return None
    try:
        with open(path, encoding="utf-8", errors="backslashreplace") as f:
            first = f.readline(200).rstrip("\n")
    except OSError as e:  # unread, it could be anyone's: not appended to unchecked
        return f"it cannot be read to check that it is a log ({e.strerror or e})"
    if LOG_LINE.match(first):
        return None
    return f"its first line {first[:60] + ('...' if len(first) > 60 else '')!r} is no log line"


def exit_with_error(message: str, code=None, error: Optional[BaseException] = None):
    """End the process with `message` as its one `error:` line on stderr, and write it into the run's log file
    too (train.log / eval.log, when setup_logging has opened one), so that a job read through its log says why
    it stopped. `code`: the exit status (default 1). `error`: the exception `message` tells of; where rank 0 prints
    it for this rank (engine/distributed.py say_once: every rank met it), no line on stderr: one per job."""
    line = f"error: {message}"
    for handler in logging.getLogger().handlers:
        if getattr(handler, "_cd_run", False) and isinstance(handler, logging.FileHandler):
            name = os.path.splitext(os.path.basename(sys.argv[0]))[0] or "run"  # train / evaluate
            handler.emit(logging.LogRecord(name, logging.ERROR, __file__, 0, line, None, None))
            handler.flush()
    # One write of line and newline: sys.exit(line) and print() each write the text and its newline apart, so
    # under torchrun two ranks' lines on the shared stderr could run together into one (seen in a test).
    def say() -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    if error is None:
        say()
    else:
        say_once(error, say)
    sys.exit(1 if code is None else code)


def git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5)
        # --no-optional-locks: `status` would otherwise write .git/index.lock to refresh the index, once per rank
        # of a job, beside the user's own git commands in that checkout
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_name() -> str:
    """The processor's model name (for benchmark reports), e.g. 'AMD EPYC'."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def lone_slurm_task() -> Optional[str]:
    """A warning when srun started this command as one of several tasks (SLURM_STEP_NUM_TASKS, which srun sets
    to its step's task count, above 1) without torchrun's variables: each task is then a run of its own, one
    process each, not one run over the tasks (train.py and evaluate.py join a process group from torchrun's
    RANK / WORLD_SIZE only). A warning, not an error: tasks given their own out_dir (a sweep spread over srun's
    tasks) are such runs on purpose. None otherwise."""
    tasks = launched_world_size("SLURM_STEP_NUM_TASKS")
    if tasks < 2 or launched_world_size() > 1:
        return None
    return (f"srun started this command as task {os.environ.get('SLURM_PROCID', '?')} of {tasks}, without "
            "torchrun's RANK / WORLD_SIZE: it runs alone, one process (the tasks do not form one run); for one run "
            "over the tasks launch srun torchrun ... (one task per node), or set RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR and MASTER_PORT for each task (docs/operations.md)")


def log_environment(logger: logging.Logger, dist) -> None:
    """The environment line at the top of a run's log, and the warning of a task srun started alone."""
    logger.info("%s", describe_environment(dist))
    alone = lone_slurm_task()
    if alone:
        logger.warning("%s", alone)


def software() -> dict:
    """The code and the packages that compute a result: {commit, torch, timm, python}, as the environment line of a
    run's log names them (evaluate.py records them with each result, so that a table row can say what scored it)."""
    # str(): torch's version is a TorchVersion, whose pickle a checkpoint read with weights_only=True may not hold
    return {"commit": git_commit(), "torch": str(torch.__version__), "timm": str(timm.__version__),
            "python": platform.python_version()}


def trained_software(payload: Optional[dict]) -> list:
    """What a checkpoint records of the software that trained its weights ("software"): the list of the resumed
    `payload`'s (None for a fresh run), with this process's `software()` appended where it differs from the last
    (a resume under another torch). A checkpoint written before the record stands for its part as null."""
    earlier = payload.get("software", [None]) if payload is not None else []
    earlier = earlier if isinstance(earlier, list) else [None]
    now = software()
    return earlier if earlier and earlier[-1] == now else [*earlier, now]


def describe_environment(dist) -> str:
    device = (torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda"
              else f"cpu ({cpu_name()}, {torch.get_num_threads()} threads)")
    return (f"{', '.join(f'{name} {version}' for name, version in software().items())}, {dist.world_size} "
            f"process(es), rank {dist.rank} on {device}")
