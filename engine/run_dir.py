"""Run folders: one run owns its out_dir, and nothing an earlier run wrote is overwritten or appended to.

    with claim_run_dir(out_dir, config_dict, archive_existing=False) as run_dir:   # main rank only
        ...                                                                        # train
    check_claim(out_dir, config_dict)   # its refusals of the folder's files, with nothing moved (--print-config)

What claiming checks, before any training (so a bad folder costs seconds, not an epoch):
* no other run holds it: an exclusive `flock` on `out_dir/.run.lock`, held until the run ends (the
  kernel drops it when the process dies, so a killed run never leaves a stale lock). flock is local to
  one machine and may not be enforced on some network file systems. It is taken first, with nothing but the
  folder and the lock file made before: a run refused here has written nothing into the holder's folder;
* the folder can be created and written (a file in the way, a read-only mount, a missing permission);
* partial writes of an interrupted checkpoint write (`checkpoint.pt.partial-<host>-<pid>-<hex>`, gigabytes at
  ViT-B) whose writer, a process of this machine, is gone are removed: they are never the only copy of
  anything, since writes are atomic renames. Only the temporary names (`partial_path`) of the files this program
  writes in a run folder are removed (`_OWN_NAMES`: not a user's `notes.txt.partial-...`), and never another
  machine's (its writer may live, e.g. an evaluate.py on another node); a pid held now by a process started after
  the file was written is no longer its writer's (a container reuses pids);
* what the folder holds. `checkpoint.pt`: the run resumes (see `config_changes` for what may change); a
  checkpoint.pt, or a train.resume, that is a folder (a device, a pipe) is refused before anything moves
  (`checkpoint_path_problem`), as is a `snapshots` that is no folder when train.keep_every_epochs > 0.
  No checkpoint but files of an earlier run (best.pt, metrics.jsonl, ...): the run is refused, unless
  `train.archive_existing=true` moves them to `out_dir/archive/<time>/` first. `train.resume=` one of the
  folder's own snapshots or kept checkpoint.until_step<N>.pt continues its run (a roll-back), with or without
  checkpoint.pt. One case is archived without asking, with a warning: the folder holds only the logs of a run of
  the SAME config that stopped before its first checkpoint (no best.pt, or the best.pt of its first validation
  where a partial write of checkpoint.pt shows that it was killed writing its first checkpoint), i.e. the same
  command restarting; and a folder that holds only what a start that failed before its first logged update leaves
  (train.log, config.yaml, tb/, no metrics: a typo in the model name, the data path or a value), whatever the
  config. Both include
  the wandb/ folder a run makes when its config.yaml enables wandb. A config.yaml that is not a run's whole
  config (other top-level keys than the schema's sections: a recipe of the user's) is no run's, and the folder
  is refused naming it, unless `train.archive_existing=true` asks for everything to be moved. Nothing is moved
  when a file the run reads lies among those files (model.pretrained or train.resume naming out_dir/best.pt,
  data.root in the folder or the folder itself, a link in the folder, a file through a link to it): the folder is
  refused naming the setting (`check_inputs_stay`).
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import glob
import hashlib
import logging
import os
import re
import secrets
import socket
import shutil
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import yaml

from configs.loader import dump_yaml, unread_by_rules

from .distributed import raise_on_every_rank

log = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"
PROBE_PREFIX = ".write_test."  # prepare_folder's probe, there for an instant (evaluate.py makes one in a run folder)
ARCHIVE = "archive"
SNAPSHOTS = "snapshots"  # train.keep_every_epochs (engine/snapshots.py)
# Settings that describe where and how a run executes, not what it computes: they may change on resume.
# The cadences of validation, logging and checkpoint.pt (train.eval_every_*, log_every_steps,
# ckpt_every_steps) are among them: a stop for any of them is an exact resume point (engine/loop.py
# reseeds every update; the sampler starts from the position), so the weights are those of any other
# cadence. best.pt is chosen among the validations made, so which weights it holds depends on the
# validation cadence, as checkpoint.pt's moment depends on ckpt_every_steps. train.batch_size_per_gpu is the
# layout of the global batch (train.batch_size, compared) over the processes and accumulation steps, as the process
# count is (recorded by no setting): a run moved to other GPUs may need another to split the same global batch, and
# engine/resume.py resume_position refuses a position within the epoch that is no whole update of the new layout.
ENVIRONMENT_KEYS = (
    "out_dir", "data.root", "data.num_workers", "data.pin_memory", "data.timeout", "model.pretrained",
    "model.pretrained_strict", "train.batch_size_per_gpu", "train.eval_batch_size_per_gpu", "train.max_steps",
    "train.log_every_steps",
    "train.ckpt_every_steps", "train.eval_every_epochs", "train.eval_every_steps", "train.device", "train.compile",
    "train.archive_existing", "train.allow_changed_config", "train.divergence_factor", "train.resume",
    "train.keep_every_epochs",
    "train.divergence_windows", "log.*", "quant.*")


# Environment settings that act only when a run starts (weights to start from, what to do with an earlier
# run's files): a resumed run never reads them, so a changed value is refused on resume, not ignored.
START_ONLY_KEYS = ("model.pretrained", "model.pretrained_strict", "train.archive_existing")


# Settings that choose the validation set or how its images are prepared: a score measured under other values
# is not comparable, so best.pt's score does not carry over a resume that changes one (train.py, best_checkpoint).
VALIDATION_KEYS = ("data.val_split", "data.val_windows", "data.kjv_val_fraction", "data.digits_val_fraction",
                   "data.digits_img_size", "data.synthetic_val_size", "data.mean", "data.std", "data.interpolation",
                   "data.crop_pct", "data.crop_mode")


# Settings added since runs were first written, with the value that a run whose config lacks the key ran with (its
# config.yaml and checkpoints predate the key): compared as that value on resume, not as a change from none.
# train.tf32: train.py turned TF32 on, for every run, before the key existed; model.attn: every model had timm's
# softmax attention before the attention-sink variants (907cb62f).
SETTINGS_BEFORE_THEIR_KEY = {"train.tf32": True, "model.attn": "softmax"}


def recorded_setting(config: dict, key: str) -> Any:
    """`key` ('section.name') as a run of `config` (a nested dict: a checkpoint's) ran with it: its value, or the one
    of SETTINGS_BEFORE_THEIR_KEY where the config predates the key; None where neither gives one."""
    section, name = key.split(".", 1)
    values = config.get(section) or {}
    return values[name] if name in values else SETTINGS_BEFORE_THEIR_KEY.get(key)


class RunDirError(ValueError):
    """An out_dir that cannot be used: not writable, in use, or holding an earlier run's results."""


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and key not in ("kwargs", "lam_per_role"):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _is_environment(key: str) -> bool:
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in ENVIRONMENT_KEYS)


def _unread_in_both(saved: dict, current: dict, keys: list[str]) -> set[str]:
    """The `keys` that the config rules (configs/loader.py READ_ONLY_WHEN) leave unread in `saved` and in
    `current` alike, e.g. train.ema_decay while train.ema is false in both: no run reads them, so their value
    changes nothing computed. A rule whose deciding key a config lacks (an older run's) decides nothing there."""
    def unread(config: dict) -> set[str]:
        return {key for key, *_ in unread_by_rules(config, keys, undecided=True)}
    return unread(saved) & unread(current) if keys else set()


def config_changes(saved: dict, current: dict) -> list[str]:
    """'key: old -> new' for every setting that differs and changes what the run computes. A key that both
    configs leave unread is no change: a run saved with train.ema=false beside train.ema_decay=0.5 resumes with
    train.ema_decay left out (the loader refuses an option given beside a switch that leaves it unread). A key a
    config lacks that was added since it was written is compared as the value such a run ran with
    (SETTINGS_BEFORE_THEIR_KEY)."""
    old, new = ({**SETTINGS_BEFORE_THEIR_KEY, **_flat(config)} for config in (saved, current))
    differ = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k) and not _is_environment(k)]
    moot = _unread_in_both(saved, current, differ)
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in differ if k not in moot]


def training_changes(saved: dict, current: dict) -> list[str]:
    """`config_changes` but those of VALIDATION_KEYS: the changes that act on the updates a run trains, which a
    run with none left to train (finished, or at its train.max_steps) could not apply (train.py
    check_something_to_train). A new validation set acts on the validation such a run makes again."""
    validation = set(VALIDATION_KEYS)
    return [change for change in config_changes(saved, current) if change.split(":", 1)[0] not in validation]


def recipe(config: dict) -> dict:
    """The settings of a run that change what it computes, but its seed: what the seeds of one experiment share
    (a flat dict; `config_changes` leaves out the same environment keys). model.pretrained is a path, left out; the
    weights a run loaded from it are recorded in its checkpoints, and evaluate.py adds them to the recipe it writes
    (engine/start_weights.py recipe_entries)."""
    return {k: v for k, v in _flat(config).items() if not _is_environment(k) and k != "train.seed"}


def start_only_changes(saved: dict, current: dict) -> list[str]:
    """'key: old -> new' for every START_ONLY_KEYS setting that differs: a resumed run would not use it."""
    old, new = _flat(saved), _flat(current)
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in START_ONLY_KEYS if old.get(k) != new.get(k)]


def validation_changes(saved: dict, current: dict) -> list[str]:
    """'key: old -> new' for every VALIDATION_KEYS setting that differs: the validation set is another."""
    old, new = _flat(saved), _flat(current)
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in VALIDATION_KEYS if old.get(k) != new.get(k)]


def _unusable(out_dir: str, e: OSError, setting: str = "out_dir") -> RunDirError:
    """The one error line for an out_dir (the folder of `setting`) that cannot be created or written; a full disk
    is named as such (the folder itself is fine)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(out_dir).free / 2 ** 20 if os.path.isdir(out_dir) else 0.0
        return RunDirError(f"{setting} '{out_dir}': the disk is full ({e.strerror}; {free:.0f} MB free): free "
                           f"space there, or choose a {setting} on another disk")
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):  # makedirs says only "File exists"
        what = "a file" if os.path.isfile(out_dir) else "a device, a pipe or a broken link"
        return RunDirError(f"{setting} '{out_dir}' is {what}, not a folder; choose another {setting}")
    return RunDirError(f"{setting} '{out_dir}' cannot be used: {e.strerror or e}; choose a writable {setting}")


def make_folder(out_dir: str, setting: str = "out_dir") -> None:
    """Create `out_dir` (and its parents), or raise RunDirError naming `setting`."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise _unusable(out_dir, e, setting) from None


def check_writable(out_dir: str, setting: str = "out_dir") -> None:
    """Check that files can be written in the existing folder `out_dir`, or raise RunDirError naming `setting`.
    The probe file (`PROBE_PREFIX<pid>`) is removed whatever happens."""
    probe = os.path.join(out_dir, f"{PROBE_PREFIX}{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
            f.flush()
            os.fsync(f.fileno())  # a full disk shows here, not at some later write
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(probe)
        raise _unusable(out_dir, e, setting) from None
    os.remove(probe)


def prepare_folder(out_dir: str, setting: str = "out_dir") -> None:
    """Create `out_dir` and check that files can be written there, or raise RunDirError naming `setting`, the
    option that chose the folder (see `check_writable`). A run's folder is claimed with `claim_run_dir` instead,
    which writes nothing there before holding its lock."""
    make_folder(out_dir, setting)
    check_writable(out_dir, setting)


# Temporary files of atomic writes: `<name>.partial-<host>-<pid>-<8 hex digits>` (<host>: 8 hex digits of the
# host name's hash, since a pid means something on its own machine only), a name no user file has by chance.
# `<name>.partial-<pid>-<8 hex>` and `<checkpoint.pt|best.pt|config.yaml|metrics.jsonl>.tmp.<pid>` are the
# names of earlier versions, which named no host.
_PARTIAL = re.compile(r"\.partial-(?:([0-9a-f]{8})-)?(\d+)-[0-9a-f]{8}$")
_LEGACY_PARTIAL = re.compile(r"^(checkpoint\.pt|best\.pt|config\.yaml|metrics\.jsonl)\.tmp\.(\d+)$")
_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
# The files this program writes through such a temporary file in a run folder or its snapshots folder: checkpoint.pt,
# best.pt, config.yaml, metrics.jsonl, checkpoint.until_step<N>[.<k>].pt (a copy of engine/snapshots.py
# keep_abandoned_checkpoint), metrics.until_step<N>[.<k>].jsonl (a copy of engine/metrics.py _keep_copy),
# snapshots/epoch<E>[-<k>].pt (a copy of keep_snapshot) and evaluate.py's result files beside a checkpoint
# (eval_<checkpoint>.json, eval_<checkpoint>_act_max.csv / .png). A temporary name of another file (a user's
# `notes.txt.partial-...`) is no proof that this program wrote it: remove_partial_writes leaves it.
_OWN_NAMES = re.compile(r"checkpoint\.pt|best\.pt|config\.yaml|metrics\.jsonl|checkpoint\.until_step\d+(?:\.\d+)?\.pt"
                        r"|metrics\.until_step\d+(?:\.\d+)?\.jsonl"
                        r"|epoch\d+(?:-\d+)?\.pt|eval_.+(?:\.json|_act_max\.csv|_act_max\.png)")
# How much older than the process now holding its writer's pid a temporary file must be to be of another process:
# the file's time is the file system's clock, which on a network file system may run behind this machine's
PID_REUSE_SLACK_S = 60.0


def is_inside(path: str, folder: str) -> bool:
    """Whether `path` lies in `folder` or below it, links resolved (a run's own snapshots, its own checkpoint)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def partial_path(path: str) -> str:
    """The temporary name under which `path` is written before the rename that makes it appear whole."""
    return f"{path}.partial-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"


def sync_file(path: str) -> None:
    """fsync the written file at `path` before a rename publishes it: without it a machine that goes down just after
    the rename may leave the new name empty (XFS; ext4 without auto_da_alloc), the previous file gone too (docs/
    operations.md: a temporary file, fsync and a rename). A full disk may show only here (an OSError)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_or_copy(source: str, target: str) -> None:
    """`target` becomes a hard link to `source` (no copy, no extra write time), or a copy written through a
    temporary file and a rename where the file system has no hard links (some network or FUSE ones)."""
    try:
        os.link(source, target)
    except FileExistsError:  # a name taken (a link of the user's that leads nowhere) is never written over
        raise
    except OSError:
        tmp = partial_path(target)
        try:
            shutil.copyfile(source, tmp)
            sync_file(tmp)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)


def _partial_writer(name: str) -> Optional[int]:
    """The pid that wrote `name` if it is one of this program's temporary files written on this machine (or
    named by an earlier version, without a host), else None: another machine's pid cannot be checked here."""
    match = _PARTIAL.search(name)
    if match:
        host, pid = match.groups()
        return int(pid) if host in (None, _HOST) else None
    match = _LEGACY_PARTIAL.match(name)
    return int(match.group(2)) if match else None


def _is_own_temporary(name: str) -> bool:
    """Whether `name` is the temporary name (`partial_path`, or an earlier version's) of one of the files this program
    writes in a run folder (`_OWN_NAMES`), on any machine."""
    temporary = _PARTIAL.search(name) or _LEGACY_PARTIAL.match(name)
    return bool(temporary and _OWN_NAMES.fullmatch(_written_name(name)))


def partial_writes_of(path: str) -> list[str]:
    """The temporaries `partial_path(path)` names (or an earlier version's, without the host) left beside `path` by
    writes cut short: nothing else, whatever its name."""
    base = os.path.basename(path)
    return [cut for cut in glob.glob(glob.escape(path) + ".partial-*")
            if _PARTIAL.search(os.path.basename(cut)) and _written_name(os.path.basename(cut)) == base]


def _written_name(name: str) -> str:
    """The file a temporary file `name` (`partial_path`, or an earlier version's name) was written to become."""
    match = _LEGACY_PARTIAL.match(name)
    return match.group(1) if match else _PARTIAL.sub("", name)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start(pid: int) -> Optional[float]:
    """When the process `pid` of this machine started (seconds since the epoch, to about a second), from Linux's
    /proc; None where that cannot be read (no /proc, as on macOS; a process gone or hidden)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime: clock ticks after boot
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _writer_may_run(pid: int, path: str) -> bool:
    """Whether the writer of the temporary file `path`, a process of this machine with the pid `pid`, may still run:
    a process holds that pid (this one too), and it started before the file was last written. One started after
    (by PID_REUSE_SLACK_S) is not its writer but a reuse of its pid, e.g. the pid of a container's first process,
    the same in every container, which an earlier run's killed train.py had."""
    if not _running(pid):
        return False
    started = process_start(pid)
    return started is None or os.path.getmtime(path) >= started - PID_REUSE_SLACK_S


def remove_partial_writes(out_dir: str, dry_run: bool = False) -> list[str]:
    """Delete leftovers of interrupted atomic writes in `out_dir` and its snapshots folder (the `partial_path` names
    of this program's files, `_OWN_NAMES`, whose writer is no longer running; nothing else, whatever its name);
    returns their paths relative to out_dir. A pid held now by a process started after the file was written is no
    longer its writer's (`_writer_may_run`: a container reuses pids). One whose writer may still run is kept, named in
    one warning: another machine's (its pid cannot be checked here), or one of a pid running on this machine since
    before it was written (this process's own too: an earlier call in it; or where start times cannot be read).
    `dry_run`: only the paths it would delete, nothing deleted or logged (`check_claim`)."""
    removed, kept = [], []
    for folder in (out_dir, os.path.join(out_dir, SNAPSHOTS)):
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            path = os.path.join(folder, name)
            if not _is_own_temporary(name) or not os.path.isfile(path):
                continue  # not one of this program's temporary files
            pid = _partial_writer(name)  # None: another machine's
            try:
                if pid is None or _writer_may_run(pid, path):
                    why = "another machine's" if pid is None else f"pid {pid}, running since before it was written"
                    kept.append(f"{os.path.relpath(path, out_dir)} ({why})")
                    continue
                if dry_run:
                    removed.append(os.path.relpath(path, out_dir))
                    continue
                size = os.path.getsize(path)
                os.remove(path)
            except FileNotFoundError:  # gone since the listing: its running writer renamed it into place (an
                continue  # evaluate.py finishing its JSON); nothing is left to keep or remove
            removed.append(os.path.relpath(path, out_dir))
            log.warning("removed %s (%.1f MB), a partial write of an interrupted run", path, size / 2 ** 20)
    if kept and not dry_run:
        log.warning("kept in %s: %s: partial write(s) whose writer may still run; delete them once no process writes "
                    "them", out_dir, ", ".join(kept))
    return removed


def earlier_run_files(out_dir: str) -> list[str]:
    """Everything in `out_dir` except the lock, the archive and another process's write probe (sorted names)."""
    return sorted(n for n in os.listdir(out_dir)
                  if n not in (LOCK_NAME, ARCHIVE) and not re.fullmatch(rf"{re.escape(PROBE_PREFIX)}\d+", n))


def archive(out_dir: str, names: list[str], move: bool = True) -> str:
    """Move `names` into `out_dir/archive/<time>/` (nothing is deleted); returns that folder. `move` False: only
    the refusal of an archive that is no folder, nothing made or moved ('' returned)."""
    folder = os.path.join(out_dir, ARCHIVE)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise RunDirError(f"{folder} is a file, where earlier runs' files would be archived: move it away, or "
                          f"choose another out_dir")
    if not move:
        return ""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    target = os.path.join(out_dir, ARCHIVE, stamp)
    suffix = 1
    while os.path.exists(target):
        target = os.path.join(out_dir, ARCHIVE, f"{stamp}-{suffix}")
        suffix += 1
    os.makedirs(target)
    for name in names:
        shutil.move(os.path.join(out_dir, name), os.path.join(target, name))
    log.warning("moved the earlier run's %s to %s", ", ".join(names), target)
    return target


# Files a run reads that may lie in its out_dir (an earlier run's best.pt as the weights to start from, a data set
# kept beside the runs): archiving the folder's files must not move them away before they are read. These are the
# schema's path settings besides out_dir itself (configs/schema.py, UserPath). (setting, what it is, for the advice)
INPUT_FILES = (("model.pretrained", "the weights"), ("train.resume", "the checkpoint"), ("data.root", "the data set"))


def _read_paths(setting: str, value: str, settings: dict) -> list[str]:
    """The paths the run reads through `setting`=`value` (a flat config, `settings`): the path itself, and for
    data.root the splits in it as data/ looks them up (<split>, <split>.tar; tokens: <split>.bin), since data.root
    may be out_dir itself, its split folders among the files moved. data.root of a data set that has none (digits,
    synthetic, kjv) is read by nothing."""
    if setting != "data.root":
        return [value]
    dataset = settings.get("data.dataset", "folder")  # the schema's default
    if dataset not in ("folder", "tokens"):
        return []
    suffixes = ("", ".tar") if dataset == "folder" else (".bin",)
    splits = [str(settings.get(f"data.{key}", "") or "") for key in ("train_split", "val_split")]
    return [value, *(os.path.join(value, split + suffix) for split in splits for suffix in suffixes)]


def check_inputs_stay(out_dir: str, names: list[str], config: dict, mover: str) -> None:
    """Raise RunDirError before anything is moved when a file the run reads (INPUT_FILES) lies among the `names` of
    `out_dir` that archiving would move to out_dir/archive/<time>/ (`mover` says who): the run would then fail on a
    path that no longer exists, its weights archived. Paths are compared as the file system resolves them (relative
    paths, links to or in the folder: `_lookup_path`)."""
    settings = _flat(config)
    folder = os.path.realpath(out_dir)
    for setting, what in INPUT_FILES:
        value = settings.get(setting)
        if not value or not isinstance(value, str):
            continue
        passed = [p for read in _read_paths(setting, value, settings) for p in _lookup_path(read)]
        moved = [n for n in names if any(_under(p, os.path.join(folder, n)) for p in passed)]
        if moved:
            raise RunDirError(f"{setting}={value} lies in out_dir '{out_dir}' among the files {mover} to "
                              f"{out_dir}/{ARCHIVE}/<time>/ ({moved[0]}): use another out_dir, or move {what} out "
                              f"of it first")


def _under(path: str, folder: str) -> bool:
    """Whether the resolved path `path` is `folder` or lies below it (neither is resolved again)."""
    return os.path.commonpath([path, folder]) == folder


def _lookup_path(path: str, max_links: int = 40) -> list[str]:
    """Every place the lookup of `path` passes through, component by component as the kernel resolves it: each
    symbolic link met (its own location, its folder resolved) and the resolved file at the end. Archiving a link
    breaks the path as moving its target does, so both count (os.path.realpath gives only the end)."""
    passed = []
    current, pending, links = os.sep, os.path.join(os.getcwd(), path).split(os.sep), 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":  # after the links before it are resolved, as the kernel does (not lexically)
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, part)
        if os.path.islink(candidate) and links < max_links:
            links += 1
            passed.append(candidate)
            target = os.readlink(candidate)
            current = os.sep if os.path.isabs(target) else current
            pending = target.split(os.sep) + pending
        else:
            current = candidate
    return passed + [current]


def saved_config(out_dir: str) -> Optional[dict]:
    """The run's config.yaml as a dict, or None without a readable one (a damaged file, or another program's that is
    no UTF-8 text: train.py writes it so)."""
    try:
        with open(os.path.join(out_dir, "config.yaml")) as f:
            saved = yaml.safe_load(f)
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    return saved if isinstance(saved, dict) else None


def saved_train_setting(out_dir: str, key: str) -> Any:
    """train.<key> as the run's config.yaml records it (what its latest command set), None without a readable one."""
    config = saved_config(out_dir)
    train = config.get("train") if config else None
    return train.get(key) if isinstance(train, dict) else None


def check_fresh_start(out_dir: str, config: dict, archive_existing: bool, first_write_cut: bool = False,
                      move: bool = True, removed: Sequence[str] = ()) -> list[str]:
    """Without checkpoint.pt: make sure no earlier result is overwritten (see module docstring); returns the names
    moved to the archive. `first_write_cut`: a partial write of checkpoint.pt was just removed
    (`remove_partial_writes`), the run was killed writing it. `move` False: the same refusals, nothing moved or
    logged, the names that would move returned, and the partial writes a claim removes first (`removed`, which a dry
    run of remove_partial_writes left in place) counted out of the folder's files (`check_claim`)."""
    found = [n for n in earlier_run_files(out_dir) if n not in removed]
    if not found:
        return []
    saved = saved_config(out_dir)
    foreign = _foreign_config(out_dir, found, saved, config)
    # logs only, which the rules below would archive without asking: a config.yaml of the user's is never moved as
    # if a run had written it (beside a result, the refusal below names the files)
    if foreign and not archive_existing and set(found) <= _start_logs(saved) | {"metrics.jsonl"}:
        raise RunDirError(f"out_dir '{out_dir}' holds config.yaml, which is not a config train.py writes "
                          f"({foreign}); a run moves aside only its own files: move config.yaml out of the folder, "
                          f"or use another out_dir")
    if _start_that_failed(out_dir, found, saved):  # e.g. a typo in a model name, a path or a value: any config
        check_inputs_stay(out_dir, found, config, "a fresh start moves (the logs of a start that failed)")
        if move:
            log.warning("%s holds only the logs of a start that stopped before its first logged update", out_dir)
        archive(out_dir, found, move)
        return found
    # killed while writing its first checkpoint.pt, whose partial write is the proof (a checkpoint.pt deleted by
    # hand leaves none): the best.pt the validation before that write wrote is this run's, with no resume point;
    # the restart writes it again (archived with the logs, not deleted). Without that proof best.pt is a result
    # that is never moved without train.archive_existing=true
    results = {"best.pt"} if first_write_cut else set()
    restart = (set(found) <= _start_logs(saved) | {"metrics.jsonl"} | results
               and saved is not None and not config_changes(saved, config))
    if archive_existing or restart:
        check_inputs_stay(out_dir, found, config, "train.archive_existing=true would move" if archive_existing
                          else "a restart of the same run moves (its logs)")
        if restart and move:
            log.warning("%s holds the %s of this same run, stopped before its first checkpoint%s", out_dir,
                        "logs and best.pt" if "best.pt" in found else "logs",
                        " (killed while writing it)" if first_write_cut else "")
        archive(out_dir, found, move)
        return found
    # the refusal below offers train.archive_existing=true: where that would move a file the run reads, the refusal
    # it would meet comes now, not a fix that is refused in turn
    check_inputs_stay(out_dir, found, config, "train.archive_existing=true would move")
    raise RunDirError(f"out_dir '{out_dir}' holds files of an earlier run ({', '.join(found)}) but no "
                      f"checkpoint.pt to resume from: use another out_dir, or re-run with "
                      f"train.archive_existing=true to move them to {out_dir}/{ARCHIVE}/<time>/ "
                      f"and start afresh")


def _foreign_config(out_dir: str, found: list[str], saved: Optional[dict], config: dict) -> str:
    """Why out_dir's config.yaml is not one a run wrote ('' when it is, or there is none): train.py dumps the whole
    config, every section of the schema (`config`'s keys), so a file of other top-level keys (a recipe of the
    user's: a few sections), or no mapping at all, is the user's, and no failed start's to archive."""
    if "config.yaml" not in found or not os.path.isfile(os.path.join(out_dir, "config.yaml")):
        return ""
    if saved is None:
        return "it does not read as a YAML mapping"
    sections = [k for k, v in config.items() if isinstance(v, dict)]
    if set(saved) != set(config) or any(not isinstance(saved[k], dict) for k in sections):
        return (f"its top-level keys {sorted(saved)[:6]}{'...' if len(saved) > 6 else ''} are not those of a run's "
                f"whole config, {sorted(config)[:6]}{'...' if len(config) > 6 else ''}")
    return ""


def _start_logs(saved: Optional[dict]) -> set[str]:
    """What a run writes in out_dir when it starts, before any update: train.log, config.yaml, the TensorBoard
    folder, and wandb/ where its config.yaml (`saved`) enabled wandb (wandb.init(dir=out_dir) makes it)."""
    wandb = isinstance(saved, dict) and isinstance(saved.get("log"), dict) and saved["log"].get("wandb") is True
    return {"train.log", "config.yaml", "tb"} | ({"wandb"} if wandb else set())


def _start_that_failed(out_dir: str, found: list[str], saved: Optional[dict]) -> bool:
    """True when `found` (out_dir's files, no checkpoint) is what a run that stopped before its first
    logged update leaves: what it writes at start-up (`_start_logs` of its config.yaml, `saved`) and no
    metrics. Such a start is archived whatever its config, so that the corrected command runs."""
    metrics = os.path.join(out_dir, "metrics.jsonl")
    return (set(found) <= _start_logs(saved) | {"metrics.jsonl"}
            and (not os.path.exists(metrics) or os.path.getsize(metrics) == 0))


class LockBusy(Exception):
    """`exclusive_lock(wait=False)` found the lock held; `owner` is what its holder wrote into the file."""

    def __init__(self, owner: str):
        super().__init__(owner)
        self.owner = owner


LOCK_MARK = "held by "  # how this program's lock files begin: only such a file is removed on release


@contextmanager
def exclusive_lock(path: str, wait: bool) -> Iterator[None]:
    """An exclusive `flock` on the file `path` for the duration of the block (`wait`: block until it is
    free, else raise LockBusy), and no file left behind: the holder removes it on release, while still
    holding it. A process that was waiting on the removed file finds that the path no longer names the
    file it locked, and locks the path afresh. A file of the same name that this program did not write
    (not empty, not beginning with LOCK_MARK) is locked as it is, and never changed or removed. A symbolic link at
    `path` is refused (OSError ELOOP): opened through, it had the lock written into a file elsewhere (or made one
    there), and the release removed the link."""
    while True:
        handle = open(path, "a+", opener=lambda name, flags: os.open(name, flags | os.O_NOFOLLOW, 0o666))
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip()
            handle.close()
            raise LockBusy(owner[len(LOCK_MARK):] if owner.startswith(LOCK_MARK) else owner) from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(handle.fileno()).st_ino:
            break
        handle.close()  # the previous holder removed the file this handle locked
    handle.seek(0)
    text = handle.read()
    ours = text == "" or text.startswith(LOCK_MARK)
    try:
        if ours:  # inside the try: a failed write (a full disk) still removes the file and releases the lock
            handle.seek(0)
            handle.truncate()
            handle.write(f"{LOCK_MARK}pid {os.getpid()} on {socket.gethostname()} "
                         f"since {datetime.datetime.now():%Y-%m-%d %H:%M:%S}")
            handle.flush()
        yield
    finally:
        if ours:
            with contextlib.suppress(OSError):
                os.remove(path)
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


@contextmanager
def lock_folder(out_dir: str, setting: str = "out_dir") -> Iterator[None]:
    """Hold an exclusive lock on the existing folder `out_dir` for the duration of the block, or raise
    RunDirError naming `setting` (the option that gave the folder). A refused caller changes nothing in the
    folder (it only opens the holder's lock file)."""
    with ExitStack() as stack:
        try:
            stack.enter_context(exclusive_lock(os.path.join(out_dir, LOCK_NAME), wait=False))
        except LockBusy as busy:
            raise RunDirError(f"{setting} '{out_dir}' is in use by another run ({busy.owner or 'another process'}); "
                              f"wait for it to finish or use another {setting}") from None
        except OSError as e:  # the lock file cannot be made: a read-only folder, a full disk
            if e.errno == errno.ELOOP:
                raise RunDirError(f"{os.path.join(out_dir, LOCK_NAME)} is a symbolic link, where a run keeps its lock "
                                  f"file: remove the link, or choose another {setting}") from None
            raise _unusable(out_dir, e, setting) from None
        yield


@contextmanager
def claim_run_dir(out_dir: str, config: dict, archive_existing: bool = False) -> Iterator[None]:
    """Own `out_dir` for a run (main rank only) for the duration of the block (see module docstring). Nothing is
    written into the folder before its lock is held (beyond creating the folder and the lock file): a run
    started at the same moment in the same folder is refused having changed none of the holder's files, and
    the holder's look at the folder's files (check_fresh_start) sees no file of the refused one."""
    make_folder(out_dir)
    with lock_folder(out_dir):
        check_writable(out_dir)
        _check_files(out_dir, config, archive_existing, remove_partial_writes(out_dir))
        yield


def check_claim(out_dir: str, config: dict, archive_existing: bool = False) -> None:
    """What `claim_run_dir` refuses of `out_dir` and its files, asked with nothing made, written, moved or removed
    (train.py --print-config): a file at out_dir, a folder at checkpoint.pt or train.resume, an earlier run's files
    without a checkpoint.pt to resume from (`check_fresh_start`), a `snapshots` that is no folder. The partial writes
    the claim would remove count as removed. Not asked: whether another run holds the folder now, and whether files
    can be written there, which only the claim tells."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):  # make_folder's refusal
        raise _unusable(out_dir, FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST)))
    if os.path.isdir(out_dir):  # else the claim makes it, empty
        _check_files(out_dir, config, archive_existing, remove_partial_writes(out_dir, dry_run=True), move=False)


def resumes_in(out_dir: str, resume: str) -> bool:
    """Whether a run into `out_dir` with train.resume `resume` continues that folder's run (its files are the run's,
    nothing is archived, its train.log is appended to): out_dir/checkpoint.pt a file, or `resume` one of out_dir's
    own checkpoints (isfile, as resume_source asks, engine/snapshots.py): a snapshot, or a checkpoint.pt the run kept
    as checkpoint.until_step<N>[.<k>].pt (a finished run extended, a roll-back's abandoned branch). Not a file of
    out_dir's archive: an earlier run's, moved aside."""
    own = bool(resume) and os.path.isfile(resume) and own_checkpoint(out_dir, resume)
    return own or os.path.isfile(os.path.join(out_dir, "checkpoint.pt"))


def own_checkpoint(out_dir: str, path: str) -> bool:
    """Whether `path` (links resolved) is one of the checkpoints a run in `out_dir` keeps besides checkpoint.pt: a
    snapshot, or out_dir/checkpoint.until_step<N>[.<k>].pt (keep_as_until_step's names)."""
    if is_inside(path, os.path.join(out_dir, SNAPSHOTS)):
        return True
    path = os.path.realpath(path)
    return (os.path.dirname(path) == os.path.realpath(out_dir)
            and re.fullmatch(r"checkpoint\.until_step\d+(?:\.\d+)?\.pt", os.path.basename(path)) is not None)


def _check_files(out_dir: str, config: dict, archive_existing: bool, removed: list[str], move: bool = True) -> None:
    """claim_run_dir's look at the files of the locked `out_dir` once the partial writes `removed` are gone;
    `move` False: `check_claim`'s, the same refusals with nothing moved."""
    # train.resume=out_dir/snapshots/epoch<E>.pt or out_dir/checkpoint.until_step<N>.pt continues this folder's run
    # (a roll-back, also with its checkpoint.pt moved away): its files are that run's, and archiving them would move
    # the file to resume from too
    resume = str((config.get("train") or {}).get("resume") or "")
    problem = checkpoint_path_problem(out_dir, resume)
    if problem:  # before anything moves: a folder at checkpoint.pt would make this a fresh start over its files
        raise RunDirError(problem)
    moved = []
    if not resumes_in(out_dir, resume):
        moved = check_fresh_start(out_dir, config, archive_existing,
                                  first_write_cut=any(_written_name(name) == "checkpoint.pt" for name in removed),
                                  move=move, removed=removed)
    if SNAPSHOTS not in moved:  # an earlier run's 'snapshots', archived (or to be), is out of the way
        check_snapshots_folder(out_dir, config)


def not_a_checkpoint_file(path: str) -> str:
    """What `path` is where it exists but no checkpoint can be read from it or written over it ('a folder', 'a
    device, a pipe or a socket'); '' for a regular file, a link to one, or nothing there (a broken link included:
    it names no file, as a missing one)."""
    if not os.path.exists(path) or os.path.isfile(path):
        return ""
    return "a folder" if os.path.isdir(path) else "a device, a pipe or a socket"


def checkpoint_path_problem(out_dir: str, resume: str) -> str:
    """The one error line for a train.resume (`resume`) or an out_dir/checkpoint.pt that exists but is not a file
    (`not_a_checkpoint_file`), '' when neither is. Asked by claim_run_dir before anything in the folder moves and
    by resume_source on every rank, so that both take the same path for the resume point: a folder at checkpoint.pt
    is neither a resume nor a fresh start, whose first checkpoint could not be written over it."""
    if resume:
        what = not_a_checkpoint_file(resume)
        if what == "a folder":  # e.g. a run's out_dir: which of its checkpoints is meant is not ours to guess
            return (f"train.resume={resume} is a folder, not a checkpoint file: give a file in it, e.g. "
                    f"{os.path.join(resume, 'checkpoint.pt')} or a snapshot "
                    f"({os.path.join(resume, SNAPSHOTS, 'epoch<E>.pt')})")
        if what:
            return (f"train.resume={resume} is {what}, not a checkpoint file: give a checkpoint.pt or a snapshot "
                    f"(out_dir/{SNAPSHOTS}/epoch<E>.pt) written by train.py")
    own = os.path.join(out_dir, "checkpoint.pt")
    what = not_a_checkpoint_file(own)
    if what:
        return (f"{own} is {what}, not a checkpoint file: move it away (a run resumes from out_dir/checkpoint.pt "
                f"and writes its checkpoints there), or choose another out_dir")
    return ""


def check_snapshots_folder(out_dir: str, config: dict) -> None:
    """With train.keep_every_epochs > 0, out_dir/snapshots must be a folder or nothing: a file (or a broken link)
    of that name would fail the first snapshot, at the end of the first kept epoch, after that much training."""
    every = (config.get("train") or {}).get("keep_every_epochs") or 0
    path = os.path.join(out_dir, SNAPSHOTS)
    if every and os.path.lexists(path) and not os.path.isdir(path):
        what = "a file" if os.path.isfile(path) else "a device, a pipe or a broken link"
        raise RunDirError(f"{path} is {what}, where train.keep_every_epochs={every} keeps its snapshots (a folder): "
                          f"move it away, or set train.keep_every_epochs=0")


@contextmanager
def claim_on_main_rank(out_dir: str, config: dict, archive_existing: bool, dist) -> Iterator[None]:
    """`claim_run_dir` on the main rank; every rank learns whether it succeeded (one collective), so that
    a refused folder stops all ranks with an error instead of leaving them waiting at a collective."""
    with ExitStack() as stack:
        error = None
        if dist.is_main:
            try:
                stack.enter_context(claim_run_dir(out_dir, config, archive_existing))
            except RunDirError as e:
                error = e
        raise_on_every_rank(error, dist.device,
                            lambda: RunDirError(f"rank 0 could not claim out_dir '{out_dir}' "
                                                f"(its error says why)"))
        yield


def keep_as_until_step(path: str, step: int, keep=os.replace) -> str:
    """Move `path` (out_dir/<stem><ext>) aside as <stem>.until_step<step><ext>: the file as it stood until the
    run went on from update `step` with other settings or from an earlier point. Returns the new path.
    `keep(path, kept)` does the move (another function, e.g. a hard link, keeps `path` in place too)."""
    stem, ext = os.path.splitext(path)
    kept, suffix = f"{stem}.until_step{step}{ext}", 1
    while os.path.lexists(kept):  # another change at the same step (or a link leading nowhere): never over it
        suffix += 1
        kept = f"{stem}.until_step{step}.{suffix}{ext}"
    keep(path, kept)
    return kept


def save_config_history(out_dir: str, config: dict, step: int) -> Optional[str]:
    """Write config.yaml; an existing one with other values is kept as config.until_step<step>.yaml. The new file is
    written whole (a temporary, removed on any error) before the old one is moved aside, so that a write that fails (a
    full disk, a folder made read-only) leaves config.yaml as it was and no temporary: a RunDirError naming the file."""
    path = os.path.join(out_dir, "config.yaml")
    kept = None
    tmp = partial_path(path)
    try:
        with open(tmp, "w") as f:
            dump_yaml(config, f, sort_keys=False)  # read back by --config as written (YAML 1.2 numbers: '1e-3' quoted)
        sync_file(tmp)
        if os.path.exists(path) and saved_config(out_dir) != config:
            kept = keep_as_until_step(path, step)
        try:
            os.replace(tmp, path)
        except OSError:
            if kept is not None:  # config.yaml back where it was
                os.replace(kept, path)
            raise
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if not isinstance(e, OSError):
            raise
        reason = (f"the disk is full ({e.strerror})" if e.errno in (errno.ENOSPC, errno.EDQUOT)
                  else e.strerror or str(e))
        raise RunDirError(f"could not write {path}: {reason}; the folder's files are as they were, no partial file "
                          f"left: free space (or fix the folder) and re-run the same command") from None
    return kept


def refuse_existing_outputs(paths: list[str], overwrite: bool, inputs: Sequence[str] = (),
                            folders: Sequence[str] = ()) -> None:
    """The one rule of the scripts that write tables, figures and benchmark files: no existing file (of
    `paths`) or output folder (of `folders`: their files are written again) is replaced without --overwrite (a
    figure or a table is often the only record of how it was made), and none of the command's `inputs` ever
    (--out naming the result file it reads would replace it)."""
    read = {os.path.realpath(i) for i in inputs}
    both = [p for p in paths if os.path.realpath(p) in read]
    if both:
        raise RunDirError(f"{both[0]} is an input of this command and would be replaced by its output; choose "
                          f"another --out")
    wrong = [(p, "a folder", "file") for p in paths if os.path.isdir(p)]
    wrong += [(p, "a file", "folder") for p in folders if os.path.exists(p) and not os.path.isdir(p)]
    if wrong:  # --overwrite replaces a file: opening a folder for writing is an IsADirectoryError traceback
        path, kind, wanted = wrong[0]
        raise RunDirError(f"{path} is {kind}, where this command writes a {wanted}; choose another --out")
    for p in paths:  # a link is written through (output_target): one that leads nowhere writable, refused now
        problem = output_target(p)[1]
        if problem:
            raise RunDirError(problem)
    existing = [p for p in [*paths, *folders] if os.path.exists(p)]  # a link to a file counts as that file
    if existing and not overwrite:
        raise RunDirError(f"{', '.join(existing)} already exist(s); choose another --out or add --overwrite "
                          f"to replace")
    written = [*(output_target(p)[0] for p in paths), *folders]  # a link's file is written where its target is
    for parent in {os.path.dirname(os.path.abspath(p)) for p in written}:
        above = parent
        while not os.path.exists(above):  # the folder is made later; what exists of its path must be folders
            above = os.path.dirname(above)
        if not os.path.isdir(above) or not os.access(above, os.W_OK | os.X_OK):
            raise RunDirError(f"cannot write under {parent}: {above} is "
                              f"{'not a folder' if not os.path.isdir(above) else 'not writable'}; choose another --out")


def output_target(path: str) -> tuple[str, Optional[str]]:
    """(the file an output at `path` is written to, None) or (`path`, why it cannot be). A symbolic link at `path`
    is written through, as open(path, "w") writes: its target (links resolved) is the output, also where none
    exists yet (a dangling link), and the link stays; a link often places an output into another tree, a paper's
    sources. Why not: a link whose target's folder does not exist, or a loop of links (open raised an OSError)."""
    if not os.path.islink(path):
        return path, None
    target = os.path.realpath(path)
    if os.path.islink(target):  # realpath stops where links go round
        return path, f"{path} is a link that never reaches a file (a loop of links); remove it or choose another --out"
    if not os.path.isdir(os.path.dirname(target)):
        return path, (f"{path} is a link to {target}, whose folder does not exist; make that folder or choose "
                      f"another --out")
    return target, None


def write_whole(path: str, write: Callable[[str], None], overwrite: bool = True) -> None:
    """`write(tmp)` writes an output to `tmp` (a `partial_path` of `path`), which then appears at `path` whole: a
    reader never sees a torn file, and on any exception (a full disk, Ctrl-C) the temporary is removed and `path`
    keeps what it held. The temporary name is never a user's file (`<path>.tmp` could be one).

    With `overwrite` it replaces what is at `path`. Without (a script's output without --overwrite), it appears
    only where no file is: a hard link, which fails atomically where one exists, so that of two commands given the
    same output, both past `refuse_existing_outputs` at their start, the later writer is refused (RunDirError
    naming `path` and --overwrite) and the earlier one's file stays. A script that rewrites its output as it goes
    passes `overwrite=True` after its first write: the file is then its own.

    A symbolic link at `path` is written through (`output_target`): its target is published, the temporary beside
    it (a rename stays on one file system), and the link is kept."""
    path, problem = output_target(path)
    if problem:
        raise RunDirError(problem)
    tmp = partial_path(path)
    try:
        write(tmp)
        sync_file(tmp)
        if overwrite:
            os.replace(tmp, path)
        else:
            _publish_new(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_folder_whole(folder: str, write: Callable[[str], None]) -> None:
    """`write(tmp)` fills a new folder `tmp` (a `partial_path` of `folder`), whose files then appear at `folder` at
    once (a data set written file by file): a reader (a run) never finds a part of them, and on any exception (a full
    disk, Ctrl-C) `tmp` and all in it are removed, `folder` as it was. Where there is no `folder`, `tmp` is made beside
    it and renamed to it. An empty one is kept (its permissions, a shell's current folder, a mount point) and `tmp`,
    a hidden folder, is made in it: its entries then move up into `folder` by a rename each, which stays on `folder`'s
    file system (a rename from beside a mount point crosses to another, EXDEV) and needs no right to write beside it.
    A `folder` that files appeared in meanwhile is refused (OSError ENOTEMPTY) and kept as it is. A killed writer
    leaves `tmp`, a name no reader takes for `folder` or a part of the set. A symbolic link at `folder` is written
    through, as `write_whole` writes."""
    target = os.path.realpath(folder)
    if os.path.isdir(target):
        tmp = os.path.join(target, "." + os.path.basename(partial_path(target)))
    else:
        tmp = partial_path(target)
        if not os.path.exists(os.path.dirname(target)):  # a file there: mkdir's NotADirectoryError, as writing into it
            os.makedirs(os.path.dirname(target), exist_ok=True)
    os.mkdir(tmp)  # its random part: never an existing folder, so the one removed below is this call's
    try:
        write(tmp)
        if os.path.dirname(tmp) != target:
            os.rename(tmp, target)
            return
        if set(os.listdir(target)) != {os.path.basename(tmp)}:
            raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), target)
        for name in sorted(os.listdir(tmp)):
            os.rename(os.path.join(tmp, name), os.path.join(target, name))
        os.rmdir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish_new(tmp: str, path: str) -> None:
    """`tmp` becomes `path` where no file is at `path`, else RunDirError; `tmp` is removed either way."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise _written_meanwhile(path) from None
    except OSError:
        # a file system without hard links (some network or FUSE ones): an exclusive create claims the name
        # (refused where a file is, as the link), then the rename fills it. Not atomic for a reader, who may see
        # an empty file for that moment, but of two writers still only one gets the name.
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            raise _written_meanwhile(path) from None
        try:
            os.replace(tmp, path)
        except BaseException:  # the empty placeholder is no output: it would refuse the next command
            with contextlib.suppress(OSError):
                os.remove(path)
            raise
        return
    os.remove(tmp)


def _written_meanwhile(path: str) -> RunDirError:
    return RunDirError(f"{path} was written by another command after this one started (the same output given "
                       f"twice?); that file is kept and this command's output is not written: choose another --out, "
                       f"or add --overwrite to replace it")
