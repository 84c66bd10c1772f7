"""Which run folders of the epochs protocol (scripts/overhead_epochs.py) a new job may reuse.

A re-run of the protocol reuses the folders of finished runs and resumes interrupted ones, and reports the epoch
times in their metrics.jsonl. Those times are of the processes that trained the run, which nothing in the folder's
config.yaml records: each run's launcher is recorded beside its folder, in `<folder>.launcher.json` (train.py owns
the folder itself, and would take a file of ours there for an earlier run's). A folder that holds a run to continue
(checkpoint.pt) is reused only when its recorded launcher starts as many processes as this job's, and its
config.yaml holds the settings this job gives the run: otherwise the report would give another job's times under
this job's launcher, or train.py would refuse the run after the runs before it had trained. A folder without that
record (written before the protocol recorded launchers) is reused when every job its train.log holds states as many
processes as this job's launcher starts.
"""
from __future__ import annotations

if __name__ == "__main__":  # a library: its command line is that of the scripts built on it (before its imports,
    import sys              # which need the repository root on the path: a traceback run as a script)
    print("error: scripts/overhead_run_folders.py is a library used by "
          "overhead_epochs.py; run one of those (--help says how)", file=sys.stderr)
    sys.exit(2)

import json
import os
import re
from typing import Optional

from engine.outputs import write_json
from engine.run_dir import config_changes, lock_folder, make_folder, saved_config, start_only_changes

RECORD_SUFFIX = ".launcher.json"

# The environment line train.py writes at the start of each job into the run's train.log (engine/runinfo.py:
# describe_environment after setup_logging's "time logger level" prefix; only rank 0 writes the file). A resumed run
# holds one such line per job, oldest first.
ENVIRONMENT_LINE = re.compile(r"^\S+ \S+ INFO commit \S+, torch \S+, timm \S+, python \S+, (\d+) process\(es\), "
                              r"rank \d+ on ")


def record_path(out_dir: str) -> str:
    """Where the launcher of the run in `out_dir` is recorded: beside the folder, not in it."""
    return os.path.normpath(out_dir) + RECORD_SUFFIX


def write_launcher(out_dir: str, launcher: str, world_size: Optional[int], setting: str = "--out") -> None:
    """Record the launcher that is about to train the run in `out_dir` (before it starts: a job killed while it
    trains leaves its record too), while holding the folder's lock (the one train.py holds while it trains): a
    folder in use by another job (the same --out under another launcher) is refused with RunDirError, its record
    left as it is; otherwise that job's run would be recorded as this job's launcher's."""
    make_folder(out_dir, setting)
    with lock_folder(out_dir, setting):
        write_json(record_path(out_dir), {"launcher": launcher, "processes": world_size}, overwrite=True)


def recorded_launcher(out_dir: str) -> Optional[str]:
    """The launcher recorded for the run in `out_dir`; None without a readable record."""
    try:
        with open(record_path(out_dir)) as f:
            launcher = json.load(f).get("launcher")
    except (OSError, ValueError, AttributeError):  # none, not JSON, not an object
        return None
    return launcher if isinstance(launcher, str) else None


def same_processes(recorded: str, launcher: str, world_size) -> bool:
    """Whether `launcher` trains as the `recorded` one did: by their numbers of processes (`world_size`:
    launchers.launcher_world_size) where both launchers state theirs, else (srun: the allocation decides) only
    when the launcher is the same one."""
    then, now = world_size(recorded), world_size(launcher)
    if then is not None and now is not None:
        return then == now
    return recorded.strip() == launcher.strip()


def processes_text(launcher: str, world_size) -> str:
    n = world_size(launcher)
    return "processes it does not state" if n is None else f"{n} process{'es' if n != 1 else ''}"


def logged_processes(out_dir: str) -> list[int]:
    """The number of processes each job that trained the run in `out_dir` states in its train.log, oldest job first;
    empty without a readable train.log or without such a line."""
    try:
        # train.py writes UTF-8 (backslashreplace); a damaged byte elsewhere in the log must not hide the lines
        with open(os.path.join(out_dir, "train.log"), encoding="utf-8", errors="replace") as f:
            return [int(m.group(1)) for m in map(ENVIRONMENT_LINE.match, f) if m]
    except OSError:
        return []


def unrecorded_problem(out_dir: str, launcher: str, world_size) -> Optional[str]:
    """Why this job may not continue the run in `out_dir`, which has no launcher record (a folder written before the
    protocol recorded them), by the processes its train.log states: None when every job there ran as many as
    `launcher` starts. A log that states none, jobs of different counts (their epoch times mix both) or a launcher
    that does not state its count are refused: nothing then says the times are of this launcher's processes."""
    counts = logged_processes(out_dir)
    if not counts:
        return (f"{out_dir} holds a run whose launcher is not recorded ({record_path(out_dir)} is missing or "
                f"unreadable, and its train.log states no number of processes), so its epoch times may be of another "
                f"number of processes: move the folder away to time the run again, or give another --out")
    if len(set(counts)) > 1:
        return (f"{out_dir} holds a run trained by jobs of {', '.join(map(str, counts))} processes (its train.log; "
                f"its launcher is not recorded), so its epoch times mix them: move the folder away to time the run "
                f"again, or give another --out")
    then, now = counts[-1], world_size(launcher)
    if now == then:
        return None
    then_text = f"{then} process{'es' if then != 1 else ''}"
    return (f"{out_dir} holds a run of {then_text} (its train.log; its launcher is not recorded), not --launcher "
            f"{launcher!r} ({processes_text(launcher, world_size)}): its epoch times would be reported as this "
            f"launcher's; give a launcher of {then_text} to reuse it, or another --out")


def reuse_problem(out_dir: str, launcher: str, config: dict, world_size) -> Optional[str]:
    """Why this job may not continue the run in `out_dir` (None when it may, or when the folder holds no run to
    continue: train.py then starts it, or refuses the folder itself). `config`: the run's whole config as this job
    gives it (config_to_dict); `world_size`: launcher -> its number of processes, or None."""
    if not os.path.isfile(os.path.join(out_dir, "checkpoint.pt")):
        return None
    recorded = recorded_launcher(out_dir)
    if recorded is None:
        problem = unrecorded_problem(out_dir, launcher, world_size)
        if problem:
            return problem
    elif not same_processes(recorded, launcher, world_size):
        return (f"{out_dir} holds a run timed under --launcher {recorded!r} ({processes_text(recorded, world_size)}),"
                f" not {launcher!r} ({processes_text(launcher, world_size)}): its epoch times would be reported as "
                f"this launcher's; give --launcher {recorded!r} to reuse it, or another --out")
    saved = saved_config(out_dir)
    if saved is None:  # no readable config.yaml: train.py compares the checkpoint's own config
        return None
    changes = start_only_changes(saved, config)
    if not config.get("train", {}).get("allow_changed_config"):  # train.py continues a run with new values then
        changes = config_changes(saved, config) + changes
    if changes:
        return (f"{out_dir} holds a run of other settings ({'; '.join(changes)}), which train.py would refuse to "
                f"continue: give the protocol options it ran with, or another --out")
    return None
