"""Metric sinks of a run: `metrics.jsonl` (one JSON object per log step), TensorBoard, optional wandb.

Keys are namespaced (`train/loss`, `train/lr`, `val/top1`, `cd/pair_energy/fc2`, `act/max_block`).
Only the main rank writes. On resume, records past the resumed step are dropped from metrics.jsonl and
TensorBoard purges them too, so a resumed run's logs read as one uninterrupted run. wandb logs no step below
the one its run reached: a resume from before the records' last step (a roll-back, or a crash after the last
checkpoint) logs into a new wandb run, `<id>-r<N>` (`wandb_id`, which the checkpoints then record; one line names
it), whose records start after update N, those up to it staying in the run it leaves; a plain resume (a
preemption's requeue) continues the same wandb run. A checkpoint records a
fingerprint of metrics.jsonl's records before its update (`MetricLogger.fingerprint`): a resume whose
metrics.jsonl holds other records there (a return to a branch one left, whose records a later resume moved into a
kept metrics.until_step<N>.jsonl) takes this branch's records back from the kept file that holds them, as best.pt
takes back its own (engine/best_checkpoint.py), the file it replaces kept under a new name.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
from typing import Optional

from .run_dir import keep_as_until_step, link_or_copy, partial_path, sync_file

log = logging.getLogger(__name__)

METRICS_FINGERPRINT = "metrics_fingerprint"  # a checkpoint's entry: MetricLogger.fingerprint at its update


class MetricLogger:
    def __init__(self, out_dir: str, enabled: bool, tensorboard: bool = True, wandb: bool = False,
                 wandb_project: str = "", wandb_mode: str = "offline", config: Optional[dict] = None,
                 resume_step: Optional[int] = None, wandb_id: str = "", resume_fingerprint: Optional[str] = None):
        """`resume_fingerprint`: the resumed checkpoint's record of the records before `resume_step` (None: an
        older checkpoint, or one of another out_dir, whose records are not this folder's). `wandb_id`: the wandb
        run the resumed checkpoint logged into; `self.wandb_id` is the one this run logs into."""
        self.enabled, self.wandb_id = enabled, wandb_id
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.tb = self.wandb = None
        # the fingerprint of the records of the steps before _step, and _step's own lines (the loop logs in order)
        self._before, self._step, self._pending = hashlib.sha256(), None, []
        if not enabled:
            return
        kept = reached = None  # where the records as they stood were kept; the last step they reached
        if resume_step is not None and os.path.exists(self.path):
            reached = max((json.loads(line).get("step", 0) for line in _record_lines(self.path)[0]), default=None)
            if resume_fingerprint is not None:
                kept = _take_back_branch(self.path, resume_step, resume_fingerprint)
            kept = _truncate_after(self.path, resume_step) or kept
            # a roll-back re-run after it failed before its first record: the records of the branch it leaves are
            # in the file the first try kept at this update (metrics.jsonl was cut already), and reached past it
            earlier, left = _kept_at(out_dir, resume_step)
            if earlier is not None and (reached is None or earlier > reached):
                reached, kept = earlier, kept or left
        if os.path.exists(self.path):  # appended to: the checkpoints' fingerprints count its records
            for line in _record_lines(self.path)[0]:
                self._count(json.loads(line).get("step", 0), line)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge events after the resumed step (metrics.jsonl keeps step <= resume_step likewise). A fresh run
            # writes a purge step too (0): TensorBoard's readers take a folder's first SessionLog.START for the
            # run's start and only a later one for a restart (tensorboard PR #4763), so without it the first
            # resume's START purged nothing and both branches stayed
            self.tb = SummaryWriter(os.path.join(out_dir, "tb"),
                                    purge_step=0 if resume_step is None else resume_step + 1)
        if wandb:
            import wandb as wandb_lib  # optional dependency, imported only when enabled

            if wandb_id and reached is not None and reached > resume_step:
                # the wandb run reached `reached` too and would drop this branch's steps up to it: a run of its own,
                # named after the file that keeps the records left (unique in out_dir: a second roll-back to the
                # same update is metrics.until_step<N>.2.jsonl)
                tag = os.path.basename(kept).split(".until_step", 1)[1].rsplit(".", 1)[0].replace(".", "-")
                self.wandb_id = f"{wandb_id.split('-r', 1)[0]}-r{tag}"
                log.warning("wandb: the records of wandb run %s reached update %d, past update %d this run goes on "
                            "from, which wandb would not log again: this run logs into wandb run %s from update %d "
                            "on (its records up to update %d stay in %s)", wandb_id, reached, resume_step,
                            self.wandb_id, resume_step + 1, resume_step, wandb_id)

            self.wandb = wandb_lib.init(project=wandb_project, dir=out_dir, mode=wandb_mode, config=config,
                                        name=os.path.basename(os.path.normpath(out_dir)), resume="allow",
                                        id=self.wandb_id or None)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled or not metrics:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        line = json.dumps(record) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
        self._count(step, line)
        for key, value in record.items():
            if key != "step" and self.tb is not None and isinstance(value, (int, float)):
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(record, step=step)

    def has_record(self, step: int, prefix: str) -> bool:
        """Whether metrics.jsonl holds a key starting with `prefix` at `step`, the last step logged (e.g. the
        validation a finished run logged, which its re-run validates again); False on the other ranks."""
        return self._step == step and any(key.startswith(prefix) for line in self._pending
                                          for key in json.loads(line))

    def _count(self, step: int, line: str) -> None:
        if self._step is None or step > self._step:
            for pending in self._pending:
                self._before.update(pending.encode())
            self._step, self._pending = step, []
        self._pending.append(line)

    def fingerprint(self, step: int) -> Optional[str]:
        """`records_fingerprint` of metrics.jsonl's records before `step` (a checkpoint's update; those of `step`
        itself may follow its write), kept as they are logged; None on the other ranks, which write none."""
        if not self.enabled or (self._step is not None and step < self._step):
            return None
        digest = self._before.copy()
        if self._step is None or step > self._step:
            for pending in self._pending:
                digest.update(pending.encode())
        return digest.hexdigest()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _kept_at(out_dir: str, step: int) -> tuple[Optional[int], Optional[str]]:
    """(the last step, the file) of the newest metrics.until_step<step>[.N].jsonl in `out_dir`: the records a resume to
    `step` cut from metrics.jsonl; (None, None) without one."""
    kept = glob.glob(os.path.join(glob.escape(out_dir), f"metrics.until_step{step}.jsonl")) + \
        glob.glob(os.path.join(glob.escape(out_dir), f"metrics.until_step{step}.*.jsonl"))
    if not kept:
        return None, None
    newest = max(kept, key=os.path.getmtime)
    last = max((json.loads(line).get("step", 0) for line in _record_lines(newest)[0]), default=None)
    return last, newest


def progress_line(step: int, metrics: dict, *, total_steps: int, epochs: int, updates_per_epoch: int,
                  batch_size: int) -> str:
    """One line per log step for job logs (train.log and stdout, terminal or not), e.g.

        update 120/1600  epoch 3/100 45%  loss 2.3456  lr 1.00e-03  812 img/s  data wait 12%
        peak mem 10.2 GiB  eta epoch 0:00:52 run 0:31:10

    The ETAs count training updates at the window's speed (validations and checkpoints not included).
    """
    epoch = metrics["train/epoch"]  # epochs done, fractional: 2.45 is 45% into the third epoch
    current = max(math.ceil(epoch), 1)  # 1-based, the one in progress (or just completed)
    seconds_per_update = batch_size / max(metrics["train/img_per_s"], 1e-9)
    # the run may end inside the epoch (sched.steps, train.max_steps): the epoch then ends with the run
    left_in_epoch = min(round((current - epoch) * updates_per_epoch), max(total_steps - step, 0))
    speed = (f"{metrics['train/tok_per_s']:.0f} tok/s" if "train/tok_per_s" in metrics  # a language model
             else f"{metrics['train/img_per_s']:.0f} img/s")
    return (f"update {step}/{total_steps}  epoch {current}/{epochs} {epoch - current + 1:.0%}  "
            f"loss {metrics['train/loss']:.4f}  lr {metrics['train/lr']:.2e}  "
            f"{speed}  data wait {metrics['train/data_wait']:.0%}  "
            f"peak mem {metrics['train/peak_mem_mib'] / 1024:.1f} GiB  "
            f"eta epoch {duration(left_in_epoch * seconds_per_update)} "
            f"run {duration(max(total_steps - step, 0) * seconds_per_update)}")


def duration(seconds: float) -> str:
    """H:MM:SS, with a day count in front past 24 hours ("2d 3:04:05")."""
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    return value


def _record_lines(path: str) -> tuple[list[str], int]:
    """metrics.jsonl's record lines (each ending in a newline) and how many lines were not records (an
    interrupted write)."""
    lines, broken = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict):  # not one of this logger's records
                broken += 1
                continue
            lines.append(line if line.endswith("\n") else line + "\n")
    return lines, broken


def records_fingerprint(lines: list[str], step: int) -> str:
    """sha256 of the record lines of the steps before `step`, in order: which run's history a file holds up to a
    checkpoint's update (the lines carry each run's own losses and timings)."""
    digest = hashlib.sha256()
    for line in lines:
        if json.loads(line).get("step", 0) < step:
            digest.update(line.encode())
    return digest.hexdigest()


def _take_back_branch(path: str, step: int, fingerprint: str) -> Optional[str]:
    """A resume at `step` whose checkpoint recorded `fingerprint` for the records before it: where metrics.jsonl
    holds others (another branch of the run continued since, or fewer: a roll-back truncated it), the newest kept
    metrics.until_step<N>.jsonl that holds them replaces it, up to `step` (metrics.jsonl kept as
    metrics.until_step<step>.jsonl first; nothing is deleted or overwritten), with a warning. Where none does, a
    warning says so and the run goes on with metrics.jsonl as it is. A file with no record before `step` (a run
    started from another folder's checkpoint) has nothing to compare. Returns where metrics.jsonl was kept, if
    it was."""
    lines = _record_lines(path)[0]
    if not any(json.loads(line).get("step", 0) < step for line in lines) or \
            records_fingerprint(lines, step) == fingerprint:
        return None
    folder, name = os.path.split(path)
    stem, ext = os.path.splitext(name)
    kept_files = sorted(glob.glob(os.path.join(glob.escape(folder), f"{stem}.until_step*{ext}")),
                        key=os.path.getmtime, reverse=True)
    source = next((kept for kept in kept_files
                   if records_fingerprint(_record_lines(kept)[0], step) == fingerprint), None)
    if source is None:
        log.warning("%s: its records before update %d are not those of the run the checkpoint continues (another "
                    "branch of it), and no kept %s.until_step*%s holds those: the records from update %d on follow "
                    "other ones", path, step, stem, ext, step)
        return None
    branch = [line for line in _record_lines(source)[0] if json.loads(line).get("step", 0) <= step]
    tmp = partial_path(path)
    with open(tmp, "w") as f:
        f.writelines(branch)
    sync_file(tmp)
    kept = keep_as_until_step(path, step, keep=_keep_copy)  # metrics.jsonl stays until the rename replaces it
    os.replace(tmp, path)
    log.warning("%s held another branch's records before update %d: kept as %s; this run's records up to update "
                "%d taken back from %s", path, step, os.path.basename(kept), step, os.path.basename(source))
    return kept


def _truncate_after(path: str, step: int) -> Optional[str]:
    """Keep the records up to `step`; drop lines that are not JSON (a partial last line, as a full disk or
    a kill mid-write leaves), saying how many. Rewritten through a temporary file and a rename. Records after
    `step` (a roll-back to an earlier snapshot, or updates since the last checkpoint before a crash) are
    not lost: the file as it was is kept as metrics.until_step<step>.jsonl, whose path is returned (None: no
    record after `step`)."""
    kept, later, kept_as = [], 0, None
    lines, broken = _record_lines(path)
    for line in lines:
        if json.loads(line).get("step", 0) <= step:
            kept.append(line)
        else:
            later += 1
    if broken:
        log.warning("%s: dropped %d unreadable line(s) (an interrupted write)", path, broken)
    tmp = partial_path(path)
    with open(tmp, "w") as f:
        f.writelines(kept)
    sync_file(tmp)
    if later:
        kept_as = keep_as_until_step(path, step, keep=_keep_copy)  # metrics.jsonl stays until the rename
        log.warning("%s: %d record(s) after update %d, from which this run goes on: the file as it was is "
                    "kept as %s", path, later, step, kept_as)
    os.replace(tmp, path)
    return kept_as


def _keep_copy(path: str, kept: str) -> None:
    """`kept` becomes a hard link to `path` (a copy where the file system has none), `path` staying in place: the
    rename of the rewritten file then replaces it at once. Moved aside first, a kill before that rename left no
    metrics.jsonl, and the resumed run's file began after the resume point, its earlier records only in the kept
    file (a kill between the two now leaves both whole files, and the resume cuts again). The copy is written under a
    temporary name and renamed (run_dir.link_or_copy): a kill or a full disk mid-copy leaves no half file under the
    kept name, which a later resume would take for the records of the branch it kept."""
    link_or_copy(path, kept)
