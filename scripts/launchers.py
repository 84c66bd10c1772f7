"""What the scripts that start train.py and evaluate.py commands (sweep.py, overhead_epochs.py) know of a launcher:
how many processes it starts, whether a command it ran stopped on a stop request, and the passing on of a stop
request to the running command (`ForwardedSignals`).

A command stopped by SIGTERM / SIGINT writes its checkpoint and exits with EXIT_PREEMPTED (75), and the same command
resumes it. A launcher does not pass that code on: torchrun reports a worker's 75 as a failure and exits 1. What the
command itself records says it: the line its job log ends with (`log_mark` before the command starts,
`stopped_on_signal` after it ends; only lines written in between count, so an earlier job's stop is not taken for
this one's). `stopped_after_checkpoint` decides it from the exit code and that line: a stop request the script
itself received does not say that the command wrote its checkpoint. Imports nothing heavy: sweep.py expands a sweep
without torch (torchrun's parser, which imports it, is imported where a torchrun launcher's processes are counted).
"""
from __future__ import annotations

if __name__ == "__main__":  # a library: its command line is that of the scripts built on it (before its imports,
    import sys              # which need the repository root on the path: a traceback run as a script)
    print("error: scripts/launchers.py is a library used by "
          "sweep.py and overhead_epochs.py; run one of those (--help says how)", file=sys.stderr)
    sys.exit(2)

import contextlib
import importlib
import io
import os
import re
import shlex
import signal
import subprocess
import unittest.mock
from typing import Optional

from engine.exit_codes import EXIT_PREEMPTED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The lines a job logs when a stop request ended it (after setup_logging's "time logger level" prefix): train.py's
# run summary (train.run_summary of a run that ended "preempted", after its checkpoint.pt was written, or after a
# validation the stop ended), and GPLQ stage 1's under evaluate.py (engine.preemption.preempted_line, after its
# stage-1 checkpoint was written).
STOPPED_LINES = {
    "train.log": re.compile(r"^\S+ \S+ INFO run summary: stopped by a signal \(resumable\) at update \d+"),
    "eval.log": re.compile(r"^\S+ \S+ INFO GPLQ stage 1 preempted at update \d+; .+ saved, re-run the same command "
                           rf"to resume \(exit code {EXIT_PREEMPTED}\)$"),
}


# the modules that run torchrun under a python (`python -m torch.distributed.run ...`): torchrun's own, and its
# deprecated predecessor, whose parser is torchrun's with --use-env added; each is read by its own parse_args
TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def launcher_world_size(launcher: str) -> Optional[int]:
    """Processes a torchrun launcher starts (--nnodes x --nproc-per-node); 1 without one; None when the launcher
    does not say: not torchrun (srun: the job's allocation decides), a number only its start tells
    (--nproc-per-node=gpu or auto, an elastic --nnodes=1:4), or options torchrun refuses (its own usage error at the
    start says which). torchrun is the program of that name or `python -m torch.distributed.run` (or .launch),
    and its options are read by its own parser: every spelling and abbreviation it takes (--nproc_per=3), and its
    PET_NNODES / PET_NPROC_PER_NODE environment defaults (the commands inherit this environment)."""
    if not launcher:
        return 1
    parsed = torchrun_options(launcher)
    if parsed is None:
        return None
    args = parsed[1]
    nodes, per_node = args.nnodes.split(":"), args.nproc_per_node  # nnodes MIN:MAX (torch's parse_min_max_nnodes)
    if len(set(nodes)) != 1 or not nodes[0].isdigit() or not per_node.isdigit():
        return None  # an elastic range, gpu, auto: not a number known before the start
    world = int(nodes[0]) * int(per_node)
    return world if world > 0 else None  # 0 processes: torchrun's own refusal at the start


def launcher_refusal(launcher: str) -> Optional[str]:
    """Why `launcher` cannot start train.py and evaluate.py, or None where nothing known here says so:
    `python -m torch.distributed.launch` without --use-env passes each process its rank as `--local-rank=N`, which
    their command lines do not take (they read LOCAL_RANK from the environment, as torchrun and .launch --use-env
    set it): every process ended on a usage error, the launcher on a ChildFailedError traceback, the run as
    failed. Its options are read by its own parser (--use_env, an abbreviation)."""
    parsed = torchrun_options(launcher)
    if parsed is None or parsed[0] != "torch.distributed.launch" or parsed[1].use_env:
        return None
    return ("python -m torch.distributed.launch without --use-env passes each process --local-rank=N, which "
            "train.py and evaluate.py do not take (they read LOCAL_RANK from the environment): add --use-env to its "
            "options, or launch with torchrun")


def torchrun_options(launcher: str) -> Optional[tuple[str, object]]:
    """(the module, the options its own parse_args reads) of a torchrun launcher, with a script after the options,
    as the commands give it; None for another launcher, or options torchrun refuses (an unknown or ambiguous one,
    --n=2: its usage error, kept from the output here, ends the first command at its start). torchrun is the
    program of that name or `python -m` one of TORCHRUN_MODULES, after an `env [-u NAME] NAME=value ...` prefix
    (the environment its options read: env_words). Raises ValueError for an unclosed quote."""
    words = shlex.split(launcher)
    environment, clear = dict(os.environ), False
    if words and os.path.basename(words[0]) == "env":  # `env NAME=value ... torchrun ...`: torchrun reads them
        words = env_words(words[1:], environment)
        if words is None:
            return None  # an option of env's not read here (-C DIR, -S): the count is not known before the start
        clear = True
    if not words:
        return None
    if os.path.basename(words[0]) == "torchrun":
        module, options = TORCHRUN_MODULES[0], words[1:]
    elif re.fullmatch(r"python[0-9.]*", os.path.basename(words[0])):
        module, options = python_module(words[1:]) or ("", [])
        if module not in TORCHRUN_MODULES:
            return None
    else:
        return None
    parse_args = importlib.import_module(module).parse_args  # torch: only for a torchrun launcher
    try:  # its options' defaults read the environment (PET_NPROC_PER_NODE): the launcher's own, env's included
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()), \
                unittest.mock.patch.dict(os.environ, environment, clear=clear):
            return module, parse_args([*options, "train.py"])
    except SystemExit:
        return None


def env_words(words: list[str], environment: dict) -> Optional[list[str]]:
    """The command that `env` with arguments `words` runs, after applying its options and NAME=value words to
    `environment` as env does (-u NAME / --unset=NAME: removed, -i / --ignore-environment / -: emptied: torchrun's
    PET_* defaults are read from what is left); None for another option of env's (-C DIR, -S: not read here)."""
    while words and words[0].startswith("-") and words[0] != "--":
        word = words.pop(0)
        if word in ("-i", "--ignore-environment", "-"):
            environment.clear()
        elif word in ("-u", "--unset") and words:
            environment.pop(words.pop(0), None)
        elif word.startswith("--unset="):
            environment.pop(word.split("=", 1)[1], None)
        elif word.startswith("-u") and not word.startswith("--"):
            environment.pop(word[2:], None)
        else:
            return None
    if words and words[0] == "--":
        words = words[1:]
    while words and "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        environment[name] = value
    return words


def python_module(arguments: list[str]) -> Optional[tuple[str, list[str]]]:
    """(the module, its arguments) that a python command line with `arguments` (after the interpreter) runs with -m,
    or None where it runs a script or -c: python's own options are read as it reads them, short ones alone or
    joined (-u -m mod, -um mod, -mmod), -W / -X and --check-hash-based-pycs with their values."""
    i = 0
    while i < len(arguments):
        word = arguments[i]
        if word == "--check-hash-based-pycs":
            i += 2
            continue
        if word.startswith("--") and word != "--":  # --help, --version, ...: flags
            i += 1
            continue
        if not word.startswith("-") or word in ("-", "--"):
            return None  # a script, stdin, or the end of python's options before one
        i += 1
        for j, letter in enumerate(word[1:], 2):
            if letter in "mcWX":  # takes a value: the rest of the word, or the next word
                value = word[j:]
                if not value:
                    value, i = (arguments[i] if i < len(arguments) else ""), i + 1
                if letter == "m":
                    return value, arguments[i:]
                if letter == "c":
                    return None
                break
    return None


def log_mark(log_path: str) -> Optional[tuple[int, int, int]]:
    """Where the log `log_path` (a run's train.log, an evaluation's eval.log) ends before a command starts: (device,
    inode, size), or None while there is none."""
    try:
        st = os.stat(log_path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size


def stopped_on_signal(log_path: str, mark: Optional[tuple[int, int, int]]) -> bool:
    """Whether the lines written to `log_path` since `mark` (`log_mark` before the command started) say that a stop
    request ended the job, its checkpoint written: the same command resumes it, whatever exit code the launcher
    gave. A log that is another file than the marked one (the run moved the earlier logs to archive/, or made the
    first) is read whole; an appended one only past the mark."""
    pattern = STOPPED_LINES[os.path.basename(log_path)]
    try:
        with open(log_path, "rb") as f:
            st = os.fstat(f.fileno())
            if mark is not None and (st.st_dev, st.st_ino) == mark[:2] and st.st_size >= mark[2]:
                f.seek(mark[2])
            # train.py writes UTF-8 (backslashreplace); a damaged byte elsewhere must not hide the line
            written = f.read().decode("utf-8", errors="replace")
    except OSError:  # no log: the command ended before it opened one
        return False
    return any(pattern.match(line) for line in written.splitlines())


def stopped_after_checkpoint(code: int, log_path: str, mark: Optional[tuple[int, int, int]]) -> bool:
    """Whether a command that ended with `code` was ended by a stop request after writing its checkpoint, so that
    the same command resumes it: its own EXIT_PREEMPTED, or another non-zero code (a launcher's: torchrun exits 1)
    where `stopped_on_signal(log_path, mark)` finds the stop in its log. A signal this script received is not
    enough: a second Ctrl-C ends train.py at once, without a new checkpoint, and so does a signal that came before
    the command set up its handlers."""
    return code == EXIT_PREEMPTED or (code != 0 and stopped_on_signal(log_path, mark))


class ForwardedSignals:
    """While active, SIGTERM / SIGINT to this script (sweep.py, overhead_epochs.py) are passed on to the running
    command, and the script waits for it (train.py writes its checkpoint, then exits with EXIT_PREEMPTED); no
    further command starts. (subprocess.run would kill the command 0.25 s after a KeyboardInterrupt, mid-write.)"""

    def __init__(self, cwd: str = ROOT) -> None:
        self.cwd = cwd  # where the commands run (the repository: their paths are relative to it)
        self.received: list[int] = []
        self.child: "subprocess.Popen | None" = None

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)  # a child in our process group may have it already: train.py
            # takes a repeat within 2 s as the same request

    def run(self, cmd: list[str]) -> int:
        self.child = subprocess.Popen(cmd, cwd=self.cwd)
        if self.received:  # a signal just before the start: the command must hear of it too
            self.child.send_signal(self.received[-1])
        try:
            return self.child.wait()
        finally:
            self.child = None

    def __enter__(self) -> "ForwardedSignals":
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
