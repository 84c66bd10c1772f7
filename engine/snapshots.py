"""Where a run resumes from, retained snapshots, and what to do about a corrupt latest checkpoint.

* Resume source: `out_dir/checkpoint.pt` (the same command continues), or `train.resume=PATH`, an explicit
  training checkpoint (a snapshot, another run's checkpoint.pt). A requeued job repeats its command, so
  `train.resume` must not throw away the progress made since: out_dir's own checkpoint.pt wins when it
  descends from PATH (every checkpoint records the file its run started from, `resumed_from`).
  Otherwise PATH wins: resuming from an earlier snapshot of the same folder rolls the run back to it.
  The checkpoint.pt it leaves is kept as checkpoint.until_step<N>.pt (`keep_abandoned_checkpoint`).
* Extending a finished run (the same out_dir, a longer sched.epochs / sched.steps): its checkpoint.pt and best.pt,
  the finished run's results, are kept as checkpoint.until_step<N>.pt and best.until_step<N>.pt before the longer
  run replaces them (`keep_finished_run`).
* Snapshots: with `train.keep_every_epochs=N`, checkpoint.pt of every N-th epoch end is kept as
  `out_dir/snapshots/epoch<E>.pt`, a hard link to the file just written (no copy, no extra disk time;
  a copy where the file system has no hard links). The run never deletes or replaces one. A run killed between
  the write and the link keeps the snapshot when it resumes at that epoch's end (`keep_missing_snapshot`): one its
  own settings kept and this folder's run trained to (every checkpoint records the update it began at,
  `STARTED_AT_STEP`).
* Every rank finds its resume source itself (out_dir may be a node's own disk by mistake):
  `check_same_start_on_every_rank` refuses ranks that would start from other points.
* A latest checkpoint that cannot be resumed (zero bytes, truncated, a best.pt copied over it) is a
  CheckpointError naming the file, its size, what is wrong and the command that continues from the last
  snapshot.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import shlex
import sys
from typing import Optional

import torch

from models.modules import nonfinite_tensors
from models.pretrained import mapped_payload

from .checkpoint import CheckpointError, foreign_objects, not_a_torch_file, weights_fingerprint
from .distributed import all_reduce, raise_on_every_rank
from .rank_agreement import differing_between_ranks
from .run_dir import SNAPSHOTS, checkpoint_path_problem, is_inside, keep_as_until_step, link_or_copy

log = logging.getLogger(__name__)

TRAINING_KEYS = ("model", "optimizer", "state", "config")  # what training_payload always writes
CONFIG_SECTIONS = ("model", "data", "optim", "sched", "train")  # of its config, which a resume compares
# the checkpoints' record of the update this folder's run began at: 0 afresh, train.resume's update (carried by a
# resume from out_dir's checkpoint.pt, as `resumed_from` is); a checkpoint at that update trained nothing here
STARTED_AT_STEP = "started_at_step"


def read_training_checkpoint(path: str) -> tuple[Optional[dict], str]:
    """(payload, "") for a resumable training checkpoint; (None, what is wrong with it) otherwise."""
    if os.path.getsize(path) == 0:
        return None, "it is empty (0 bytes: an interrupted copy, or a full disk)"
    not_torch = not_a_torch_file(path)
    if not_torch:  # a JSON or log copied over it: torch's unpickler error would advise weights_only=False
        return None, not_torch
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's reader raises RuntimeError, pickle and zip errors alike
        foreign = foreign_objects(e)
        if foreign:
            return None, foreign
        return None, (f"it cannot be read ({str(e).strip() or type(e).__name__}): a truncated or "
                      f"partly written file reads so")
    missing = [k for k in TRAINING_KEYS if not isinstance(payload, dict) or k not in payload]
    if missing:
        kind = ("weights only (a best.pt or a weights file copied over it?)"
                if isinstance(payload, dict) and "model" in payload else "no training state")
        return None, f"it holds {kind}: no {', '.join(repr(k) for k in missing)} entries"
    if not all(isinstance(payload[k], dict) for k in ("model", "optimizer", "state", "config")):
        return None, "its 'model', 'optimizer', 'state' or 'config' entry is not a mapping"
    sections = [k for k in CONFIG_SECTIONS if not isinstance(payload["config"].get(k), dict)]
    if sections:  # train.py writes the whole config; the checks of a resume read these sections
        return None, f"its config has no {', '.join(repr(k) for k in sections)} section: not a train.py checkpoint"
    bad = nonfinite_tensors(payload["model"]) + nonfinite_tensors(payload.get("model_ema") or {})
    if bad:
        return None, (f"its weights hold NaN or inf values ({len(bad)} tensors, e.g. {'; '.join(bad[:2])}), "
                      f"a run that diverged cannot continue from them")
    return payload, ""


def last_good_snapshot(out_dir: str, broken: str) -> Optional[str]:
    """The snapshot in out_dir/snapshots written last that can be resumed and is not `broken` itself (None if
    there is none). Written last: after a roll-back to an earlier snapshot, the run's current branch, not the
    abandoned one's later epochs (epoch0005.pt of the old branch beside epoch0003-1.pt of the new); the epoch
    breaks ties of equal times. Not `broken`: the newest snapshot is a hard link to checkpoint.pt, so a file
    copied over checkpoint.pt (`cp best.pt checkpoint.pt`) changed it too."""
    def order(path: str) -> tuple:
        found = re.match(r"epoch(\d+)", os.path.basename(path))
        return os.path.getmtime(path), int(found.group(1)) if found else -1

    paths = sorted(glob.glob(os.path.join(glob.escape(out_dir), SNAPSHOTS, "epoch*.pt")), key=order)
    for path in reversed(paths):
        if os.path.exists(broken) and os.path.samefile(path, broken):
            continue
        if read_training_checkpoint(path)[0] is not None:
            return path
    return None


def rerun_command(resume: str) -> str:
    """This process's command line with train.resume=`resume` (under torchrun, with its launcher)."""
    argv = [a for a in sys.argv if not a.startswith("train.resume=")]
    if not argv or not argv[0].endswith("train.py"):
        return f"your train.py command with train.resume={shlex.quote(resume)}"
    launcher = "torchrun [your options]" if "TORCHELASTIC_RUN_ID" in os.environ else "python"
    return f"{launcher} {shlex.join([*argv, f'train.resume={resume}'])}"


def unusable(path: str, problem: str) -> CheckpointError:
    """The one error line for a checkpoint that cannot be resumed: file, size, problem, the way on."""
    out_dir = os.path.dirname(path)
    snapshot = last_good_snapshot(out_dir, path)
    way_on = (f"continue from the last good snapshot with: {rerun_command(snapshot)}" if snapshot else
              f"there is no snapshot in {os.path.join(out_dir, SNAPSHOTS)} (train.keep_every_epochs keeps "
              f"them); move {path} away and start afresh with train.archive_existing=true, or continue "
              f"from another checkpoint with train.resume=PATH")
    return CheckpointError(f"cannot resume from {path} ({os.path.getsize(path)} bytes): {problem}; {way_on}")


def start_point(payload: dict) -> dict:
    """Where a training checkpoint (`training_payload`) resumes: its update and its weights' fingerprint, what
    ranks that each read their node's copy must agree on (here, and GPLQ's stage 1)."""
    return {"step": payload["state"]["step"], "weights": weights_fingerprint(payload["model"])}


def check_same_start_on_every_rank(out_dir: str, path: Optional[str], payload: Optional[dict],
                                   device: torch.device, rank: int, resume: str) -> None:
    """A CheckpointError on every rank when the ranks found other resume sources (`resume_source` on each):
    an out_dir on each node's own disk holds checkpoint.pt on rank 0's node only, and the other nodes' ranks would
    start afresh beside ranks that resume (other optimizer state, schedule and sample order under one set of
    weights, without a word). Compared: the update and the weights' fingerprint; one all-reduce.

    resume: train.resume. Given, it cannot be the way out: a node's out_dir/checkpoint.pt continued from it wins
    over it there (a requeued job keeps its progress), and each node reads its own copy of it."""
    start = None if payload is None else start_point(payload)
    if not differing_between_ranks({"start": start}, device):
        return
    found = (f"resumes from {path} at update {start['step']} (weights {start['weights']})" if start is not None
             else f"finds no checkpoint.pt in out_dir={out_dir} and would start afresh")
    way_out = ("or train.resume=PATH the same checkpoint on every node" if not resume else
               f"with train.resume={resume} each node resumes from its own out_dir/checkpoint.pt where that file "
               f"continued from it, else from its own copy of {resume}: give every node the same files")
    raise CheckpointError(f"the processes would start from other points: rank {rank} {found}, another rank "
                          f"otherwise; out_dir must be one folder that every node reads (a shared file system), "
                          f"{way_out}")


def check_same_weights_on_every_rank(model: Optional[torch.nn.Module], weights: str, device: torch.device,
                                     rank: int) -> None:
    """A CheckpointError on every rank when the ranks loaded other weights from their nodes' copies of `weights` (a
    copy of another update, or half copied; `model` None: this rank loaded none, a random start): evaluate.py's
    ranks would score their shards of the val set with other models under rank 0's name, and train.py's EMA would
    start from each rank's own weights (DDP copies rank 0's into the model, not into the EMA made before it). One
    all-reduce of the weights' fingerprint."""
    fingerprint = None if model is None else weights_fingerprint(model.state_dict())
    if not differing_between_ranks({"weights": fingerprint}, device):
        return
    if fingerprint is None:
        raise CheckpointError(f"the processes start from other weights: rank {rank} loads none ({weights} unset: "
                              f"random ones), another rank loads a file; give every node the same {weights}")
    raise CheckpointError(f"the processes loaded other weights from {weights}: rank {rank} holds weights "
                          f"{fingerprint}, another rank other weights or none; give every node the same file")


class ReadAhead:
    """A train.resume file that resume_source read and accepted before out_dir was claimed (train.py
    check_start_data), with the file's identity then (device, inode, size, modification time): the run's own
    resume_source takes its payload instead of reading the file a second time (seconds for a ViT-B's 1 GB), once,
    and only while the file is unchanged. Taken, it holds the payload no more, so that the run frees it when done."""

    def __init__(self, path: str, identity: tuple, payload: dict):
        self.path, self.identity, self.payload = path, identity, payload

    def take(self, path: str) -> Optional[dict]:
        """The payload read ahead if `path` is that file, unchanged; None (read it again) otherwise."""
        payload, self.payload = self.payload, None
        same = payload is not None and os.path.realpath(path) == os.path.realpath(self.path)
        return payload if same and file_identity(path) == self.identity else None


def file_identity(path: str) -> tuple:
    """What tells a file replaced or rewritten since it was read: device, inode, size and modification time."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def resume_source(out_dir: str, resume: str, read_ahead: Optional[ReadAhead] = None,
                  ) -> tuple[Optional[str], Optional[dict]]:
    """(path, payload) of the checkpoint this run continues from, or (None, None) for a fresh start. `read_ahead`:
    the train.resume file as an earlier call read it (`ReadAhead`), taken where it is still the same file."""
    own = os.path.join(out_dir, "checkpoint.pt")
    problem = checkpoint_path_problem(out_dir, resume)  # a folder at either: claim_run_dir's refusal, on every rank
    if problem:
        raise CheckpointError(problem)
    if resume:
        if not os.path.isfile(resume):
            raise CheckpointError(f"train.resume={resume}: no such file; give a checkpoint.pt or a snapshot "
                                  f"(out_dir/{SNAPSHOTS}/epoch<E>.pt) written by train.py")
        payload = read_ahead.take(resume) if read_ahead is not None else None
        if payload is None:
            payload, problem = read_training_checkpoint(resume)
        if payload is None:
            raise CheckpointError(f"train.resume={resume} ({os.path.getsize(resume)} bytes) cannot be "
                                  f"resumed: {problem}")
        # compared with links resolved: out_dir's own checkpoint.pt named through a link is no other start, and the
        # file a run recorded it started from is the same by any name (train.py records it as it was given)
        if os.path.isfile(own) and os.path.realpath(own) != os.path.realpath(resume):
            own_payload, problem = read_training_checkpoint(own)
            started_from = own_payload.get("resumed_from") if own_payload is not None else None
            if isinstance(started_from, str) and os.path.realpath(started_from) == os.path.realpath(resume):
                log.info("%s was written by a run started from train.resume=%s: continuing from it",
                         own, resume)
                return own, own_payload
            if not is_inside(resume, out_dir):  # checkpoint.pt would be replaced by another run's progress
                raise CheckpointError(f"train.resume={resume}: out_dir {out_dir} holds checkpoint.pt of a run "
                                      f"that did not start from it ({problem or 'another start'}), which the "
                                      f"next checkpoint would replace: give a new out_dir, or move "
                                      f"{own} away first")
            log.warning("%s: %s; continuing from train.resume=%s as asked (checkpoint.pt is kept as "
                        "checkpoint.until_step<N>.pt unless a snapshot holds it)", own,
                        problem or "another start than train.resume", resume)
        return resume, payload
    if not os.path.isfile(own):
        return None, None
    payload, problem = read_training_checkpoint(own)
    if payload is None:
        raise unusable(own, problem)
    return own, payload


def planned_resume(out_dir: str, resume: str) -> tuple[bool, Optional[str]]:
    """(whether a run into `out_dir` with train.resume=`resume` continues a checkpoint, the file `resume_source` would
    continue from), told before out_dir is claimed from the files' records, memory-mapped and nothing logged: for
    the refusals train.py makes before it claims the folder. The file is None where that takes resume_source's own
    reading (a train.resume or checkpoint.pt that is missing, no file or unreadable), whose refusal is its own:
    before the claim for a train.resume into another folder (train.py check_start_data), else once the folder is
    held; resume_source, once the folder is held, decides and reads the file for the run."""
    own = os.path.join(out_dir, "checkpoint.pt")
    if not resume:
        return os.path.lexists(own), own if os.path.isfile(own) else None
    if not os.path.isfile(resume):
        return True, None
    if os.path.isfile(own) and os.path.realpath(own) != os.path.realpath(resume):
        own_payload = mapped_payload(own)
        started_from = own_payload.get("resumed_from") if isinstance(own_payload, dict) else None
        if isinstance(started_from, str) and os.path.realpath(started_from) == os.path.realpath(resume):
            return True, own
    return True, resume


def keep_abandoned_checkpoint(out_dir: str, resume_path: str, step: int, is_main: bool,
                              device: torch.device) -> Optional[str]:
    """A run that goes on from another file than out_dir's checkpoint.pt (a roll-back to one of its snapshots;
    train.resume=PATH beside a checkpoint.pt it could not read) replaces that checkpoint.pt at its first
    checkpoint: keep it as checkpoint.until_step<step>.pt first (a hard link, so checkpoint.pt stays the
    resume point until then), unless it is already kept under another name (a snapshot's hard link). Returns
    the kept path (main rank) or None."""
    own = os.path.join(out_dir, "checkpoint.pt")
    leaves = is_main and os.path.isfile(own) and not os.path.samefile(own, resume_path)
    return _keep_linked(own if leaves else None, step, "the progress of the branch this run leaves", device)


def keep_finished_run(out_dir: str, step: int, is_main: bool, device: torch.device) -> list[str]:
    """A finished run extended (train.py: resumed from out_dir's own checkpoint.pt at the end of its schedule, with a
    longer sched.epochs / sched.steps) would replace checkpoint.pt, the finished run's final state, at its first
    write, and best.pt, the finished run's best validation, at its first better one: keep both as
    checkpoint.until_step<step>.pt and best.until_step<step>.pt first (hard links, so that both stay in place until
    then), each unless already kept under another name (a snapshot's hard link; a best.pt linked back from a kept
    best.until_step<N>.pt). Returns the kept paths (main rank), [] on the other ranks."""
    kept = []
    for name, what in (("checkpoint.pt", "the finished run's last state"), ("best.pt", "the finished run's best")):
        path = os.path.join(out_dir, name)
        if path := _keep_linked(path if is_main and os.path.isfile(path) else None, step, what, device):
            kept.append(path)
    return kept


def _keep_linked(path: Optional[str], step: int, what: str, device: torch.device) -> Optional[str]:
    """Keep `path` (main rank; None elsewhere and where there is nothing to keep) as <stem>.until_step<step><ext>, a
    hard link (a copy where the file system has none), unless another name links it already (st_nlink > 1); every
    rank takes part, so that an error stops them all. `what` says what the file is in that error. The kept path or
    None."""
    kept, error = None, None
    if path is not None and os.stat(path).st_nlink == 1:
        stem, ext = os.path.splitext(os.path.basename(path))
        try:
            kept = keep_as_until_step(path, step, keep=link_or_copy)
        except OSError as e:
            error = CheckpointError(f"could not keep {path} ({what}) as {stem}.until_step{step}{ext}: {e}; nothing "
                                    f"was changed")
    raise_on_every_rank(error, device, lambda: CheckpointError(f"rank 0 could not keep {what} (its error says "
                                                               f"why)"))
    return kept


def keep_snapshot(checkpoint: str, epoch: int, is_main: bool, device: torch.device) -> str:
    """Keep `checkpoint` (just written) as out_dir/snapshots/epoch<E>.pt on the main rank; returns the
    path. An existing snapshot of that epoch (a run resumed from an earlier one) is kept: the new one
    gets a suffix."""
    folder = os.path.join(os.path.dirname(checkpoint), SNAPSHOTS)
    path = os.path.join(folder, f"epoch{epoch:04d}.pt")
    suffix = 1
    while os.path.lexists(path):  # lexists: a link that leads nowhere holds its name too
        path = os.path.join(folder, f"epoch{epoch:04d}-{suffix}.pt")
        suffix += 1
    error = None
    if is_main:
        try:
            os.makedirs(folder, exist_ok=True)
            link_or_copy(checkpoint, path)
        except OSError as e:
            error = CheckpointError(f"could not keep {checkpoint} as {path}: {e}; checkpoint.pt is written, "
                                    f"re-run the same command to continue")
    raise_on_every_rank(error, device, lambda: CheckpointError(f"rank 0 could not write {path}"))
    return path


def started_at_step(payload: dict) -> Optional[int]:
    """The update the run that wrote `payload` began at in its folder (`STARTED_AT_STEP`): 0 for a checkpoint written
    before the record by a run started afresh (no `resumed_from`), None where unknown (one started from a file)."""
    if STARTED_AT_STEP in payload:
        return payload[STARTED_AT_STEP]
    return 0 if payload.get("resumed_from") is None else None


def snapshot_owed(payload: dict, epoch: int) -> bool:
    """Whether the run that wrote `payload` at the end of epoch `epoch` was to keep it as snapshots/epoch<E>.pt: its
    own train.keep_every_epochs (not the resumed run's, which may have added it) divides the epoch, and it trained
    to that end in this folder (a run started from another folder's checkpoint or a snapshot at that very update
    wrote it without training: that epoch is the other file's, kept there if at all)."""
    every = payload["config"].get("train", {}).get("keep_every_epochs") or 0
    start = started_at_step(payload)
    return bool(every) and epoch % every == 0 and start is not None and start < payload["state"]["step"]


def keep_missing_snapshot(checkpoint: str, payload: dict, epoch: int, is_main: bool,
                          device: torch.device) -> Optional[str]:
    """A run killed between the write of checkpoint.pt at the end of a kept epoch (train.keep_every_epochs) and its
    link as snapshots/epoch<E>.pt lost that snapshot for good: the resumed run begins the next epoch. Resumed from
    `checkpoint` (out_dir's, read as `payload`) at the end of such an epoch `epoch`, keep it now if that run owed it
    (`snapshot_owed`), unless a snapshot of that epoch holds it already: the same file (the link), or its update and
    weights (a copy, or a checkpoint.pt written again at that update: a validation the stop left to the resumed
    run). Returns the path kept, or None. Decided on the main rank, every rank taking part (`keep_snapshot`)."""
    missing = 0.0
    if is_main and snapshot_owed(payload, epoch):
        folder = os.path.join(os.path.dirname(checkpoint), SNAPSHOTS)
        stem = os.path.join(glob.escape(folder), f"epoch{epoch:04d}")
        point = None
        missing = 1.0
        for path in sorted(glob.glob(f"{stem}.pt") + glob.glob(f"{stem}-*.pt")):
            try:
                if os.path.samefile(path, checkpoint):
                    missing = 0.0
                    break
                point = point or start_point(payload)
                other = mapped_payload(path)
                if isinstance(other, dict) and start_point(other) == point:
                    missing = 0.0
                    break
            except Exception:  # noqa: BLE001 - a snapshot that cannot be read is none that holds it
                continue
    if not all_reduce(torch.tensor([missing], device=device)).item():
        return None
    return keep_snapshot(checkpoint, epoch, is_main, device)
