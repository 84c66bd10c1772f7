"""Checkpoint I/O: atomic writes, unwrapped state dicts, clear errors on bad files.

A checkpoint is a dict of tensors and plain Python data (loadable with `weights_only=True`). It is
first written to a temporary file in the same folder, flushed to disk, then renamed over the old one,
so a crash or preemption mid-write never destroys the previous checkpoint.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import pickle
import re
import shutil

from typing import Callable, Optional

import torch

from cd.wrappers import unwrap_model
from models.pretrained import mapped_payload

from .distributed import raise_on_every_rank
from .run_dir import ARCHIVE, partial_path

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "save_atomic", "load_checkpoint", "foreign_objects", "training_payload",
           "restore_training", "check_ema_entry", "save_on_main_rank", "weights_fingerprint", "record_quant_settings",
           "CheckpointFile"]


class CheckpointError(ValueError):
    """A missing, unreadable or incompatible checkpoint."""


def save_atomic(payload: dict, path: str, held_of: Optional[str] = None) -> None:
    """Write `payload` to `path` through a temporary file and a rename.

    On any failure (a full disk, a vanished mount, an interrupt) the temporary file is removed and the
    previous file at `path` is untouched; write errors become a CheckpointError that says so. `held_of`: `path` is
    itself the temporary name of a write of that file held back (`CheckpointFile`), written there directly (a write
    cut short leaves that name, which says what it was written to become: engine/run_dir.remove_partial_writes).
    """
    tmp = path if held_of is not None else partial_path(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        if held_of is None:
            os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, (OSError, RuntimeError)):
            raise CheckpointError(_write_failure(held_of or path, e)) from e
        raise


def save_on_main_rank(payload_fn: Callable[[], dict], path: str, is_main: bool, device: torch.device,
                      held_of: Optional[str] = None) -> None:
    """The main rank writes `payload_fn()` to `path` (atomically; `held_of`: see save_atomic); if that fails (a full
    disk), every rank stops with a CheckpointError instead of the others waiting at the next collective."""
    error = None
    if is_main:
        try:
            save_atomic(payload_fn(), path, held_of)
        except CheckpointError as e:
            error = e
    raise_on_every_rank(error, device,
                        lambda: CheckpointError(f"rank 0 could not write {held_of or path} (its error says why)"))


class CheckpointFile:
    """A run's checkpoint.pt, written at once or held back. Each update's loss is computed before its step, so the
    weights a write holds have had no loss measured on them yet: one made where the run goes on (engine/loop.py
    TrainLoop.checkpoint) is held, written to a file of its own beside checkpoint.pt, and renamed over it once the
    next update's loss, measured on those weights, has passed the divergence guard (`publish`), or deleted if it
    has not (`discard`): a diverged update never replaces the last good checkpoint. The held file has a
    `partial_path` name: never resumed from, and one that a killed run leaves is removed by the next run's claim
    of out_dir on the same machine once its writer's pid is gone (engine/run_dir.remove_partial_writes, which names
    one it keeps). A later write, held or made at once, supersedes a held one, deleted only once the new file is
    written (`save`). Every rank keeps the same `held_step` (the same calls on each); the main rank writes the
    files."""

    def __init__(self, path: str, is_main: bool, device: torch.device) -> None:
        self.path, self.is_main, self.device = path, is_main, device
        self.held_step: Optional[int] = None  # the update of the write held back; None when none is
        self._held: Optional[str] = None  # its file (the main rank's)

    def save(self, payload_fn: Callable[[], dict], held_step: Optional[int] = None) -> None:
        """Write `payload_fn()` to checkpoint.pt (`held_step` None), or hold it back as the write of update
        `held_step`; either way a write held before is superseded, deleted only once this one is written: if this
        write fails (a full disk), the held one is renamed over checkpoint.pt before the CheckpointError is raised,
        as after any error (TrainLoop.keep_held), so that the re-run the error advises has the last write made."""
        held = None if held_step is None else partial_path(self.path)  # a name of its own beside a held one
        try:
            save_on_main_rank(payload_fn, held or self.path, self.is_main, self.device,
                              held_of=None if held is None else self.path)
        except CheckpointError as error:
            try:
                kept = self.publish(collective=False)  # every rank is here (save_on_main_rank raised on each)
            except CheckpointError as publish_error:  # its advice is the one that holds now
                raise CheckpointError(f"{str(error).replace('. ' + _RERUN, '')}; {publish_error}") from error
            if kept is None:
                if os.path.isfile(self.path):
                    raise
                # the first write failed: _write_failure's re-run of the same command is refused
                raise CheckpointError(str(error).replace(_RERUN, f"Free space (or fix the folder); "
                                                                  f"{rerun_advice(self.path)}")) from error
            now = f"checkpoint.pt is now the write of update {kept} held back before this one"
            text = str(error)
            for before in _PREVIOUS_STATES:  # _write_failure's word on checkpoint.pt, no longer true
                text = text.replace(before, now)
            raise CheckpointError(text if now in text else f"{text}; {now}, which the re-run resumes from") from error
        self.discard()
        if held is not None:
            self._held, self.held_step = held, held_step

    def publish(self, collective: bool = True) -> Optional[int]:
        """Rename the held write over checkpoint.pt; returns its update (None: none was held). `collective`: a
        failed rename stops every rank (False on an error path, where the other ranks may be anywhere)."""
        step, held = self.held_step, self._held
        self._held = self.held_step = None
        if step is None:
            return None
        error = None
        if self.is_main:
            try:
                os.replace(held, self.path)
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.remove(held)
                error = CheckpointError(f"could not rename {held} to {self.path}: {e}; {rerun_advice(self.path)}")
        if collective:
            raise_on_every_rank(error, self.device,
                                lambda: CheckpointError(f"rank 0 could not write {self.path} (its error says why)"))
        elif error is not None:
            raise error
        return step

    def discard(self) -> Optional[int]:
        """Delete the held write; returns its update (None: none was held)."""
        step, held = self.held_step, self._held
        self._held = self.held_step = None
        if step is not None and self.is_main:
            with contextlib.suppress(FileNotFoundError):
                os.remove(held)
        return step


def rerun_advice(checkpoint: str) -> str:
    """What a failed write of a train.py run's `checkpoint` (out_dir/checkpoint.pt, as it is now) leaves, and the
    re-run that goes on: the same command resumes from an earlier checkpoint.pt. Without one the run cannot resume,
    and that command is refused where its first validation, before its first checkpoint, wrote best.pt (an earlier
    run's result to engine/run_dir.check_fresh_start): the re-runs claim_run_dir accepts are named instead."""
    if os.path.isfile(checkpoint):
        return "the previous checkpoint.pt is unchanged: re-run the same command to resume from it"
    out_dir = os.path.dirname(checkpoint)
    return (f"no checkpoint.pt was written yet, so the run cannot resume: re-run with train.archive_existing=true, "
            f"which moves this run's files to {os.path.join(out_dir, ARCHIVE)}/<time>/ and starts the run over, "
            f"or use another out_dir")


_PREVIOUS_STATES = ("the previous file is unchanged", "no earlier file existed")  # _write_failure's, of `path`
# _write_failure's advice, right for a file that existed before (CheckpointFile.save words it for one that did not)
_RERUN = "Free space (or fix the folder) and re-run the same command to resume from the last checkpoint"


def _write_failure(path: str, error: BaseException) -> str:
    """The error line of a failed write of `path` (`error`): why, what is left, and what to do."""
    folder = os.path.dirname(os.path.abspath(path))
    # torch's zip writer reports ENOSPC as "unexpected pos"; an OSError carries its errno
    full = getattr(error, "errno", None) == errno.ENOSPC or "unexpected pos" in str(error)
    reason = f"the disk is full ({_free_space(folder)})" if full else f"{error}"
    previous = _PREVIOUS_STATES[0] if os.path.exists(path) else _PREVIOUS_STATES[1]
    return f"could not write {path}: {reason}; {previous} and no partial file was left. {_RERUN}"


def _free_space(folder: str) -> str:
    """The free space in `folder`, in words. Probed only for a full disk: the folder of a failed write may itself
    be gone (a deleted out_dir, a vanished mount), and the probe's own error must not hide the write's."""
    try:
        return f"{shutil.disk_usage(folder).free / 2 ** 20:.0f} MB free in {folder}"
    except OSError as e:
        return f"the free space in {folder} cannot be read: {e}"


def not_a_torch_file(path: str) -> Optional[str]:
    """What the file is when its first bytes show it is no torch.save output (a zip archive, or a pickle
    in the legacy format); None when it may be one (an empty or cut-short file is left to torch.load)."""
    with open(path, "rb") as f:
        head = f.read(16)
    if not head or head.startswith((b"PK", b"\x80")):
        return None
    if len(head) > 9 and head[8:10] == b'{"':  # 8-byte header length, then the JSON header
        return f"it is a safetensors weights file; for weights files use model.pretrained={path}"
    kind = "a JSON file (an evaluation result?)" if head.lstrip()[:1] in (b"{", b"[") else "not a PyTorch file"
    return f"it is {kind}, starting with {head[:8]!r}"


def foreign_objects(error: Exception) -> Optional[str]:
    """Why `torch.load(weights_only=True)` refused a file that holds objects of other code (another tool's
    checkpoint: MMEngine's keeps its logger's buffers), with what to do; None for any other error (a file cut
    short). train.py saves tensors and plain Python data only."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
    if not isinstance(error, pickle.UnpicklingError) or found is None:
        return None
    return f"it holds pickled {found.group(1)} objects, which train.py never saves{_other_tool(found.group(1))}"


def _other_tool(pickled: str) -> str:
    """The hint for a checkpoint of another tool, by the module of what it holds."""
    if pickled.split(".")[0] in ("mmengine", "mmdet", "mmcv"):
        return ("; it is an MMEngine checkpoint (a detector's: evaluate it with evaluate_detection.py "
                "--checkpoint)")
    return "; give a best.pt or checkpoint.pt written by train.py, or plain weights as model.pretrained=FILE"


# nanoGPT's train.py saves its ckpt.pt with `model` and `config` entries too (its own config: out_dir,
# eval_interval, ...), beside these, which this code base never writes
NANOGPT_KEYS = frozenset({"model_args", "iter_num"})


def is_nanogpt_checkpoint(payload: object) -> bool:
    """Whether a loaded `payload` is nanoGPT's ckpt.pt: weights for `model.pretrained`, not a run of train.py."""
    return isinstance(payload, dict) and NANOGPT_KEYS <= set(payload)


# what to do about a checkpoint torch cannot read that the user named (evaluate.py and scripts/mechanism.py
# --checkpoint); a caller that reads a file of its own, where no other file can be given, passes its own fix
READ_ANOTHER = "copy it again from the run, or give the run's other checkpoint (checkpoint.pt / best.pt)"


def torch_reason(error: Exception) -> str:
    """The first sentence of why torch could not read a file: its zip reader's errors go on for some 300
    characters of generic advice, its weights_only refusal over several lines; the error's type where it says
    nothing (EOFError of an empty file)."""
    lines = str(error).strip().splitlines()
    return (lines[0].split(". ", 1)[0].rstrip(".") if lines else "") or type(error).__name__


def load_checkpoint(path: str, unreadable: str = READ_ANOTHER) -> dict:
    """Read a checkpoint written by this code base (with its `config` and `model` entries). `unreadable`: what
    to do, named in the error, when torch cannot read the file (cut short or corrupted)."""
    if os.path.isdir(path):  # e.g. a run's out_dir: which of its files is meant is not ours to guess
        raise CheckpointError(f"{path} is a folder, not a checkpoint file: give a file in it, e.g. "
                              f"{os.path.join(path, 'best.pt')} or {os.path.join(path, 'checkpoint.pt')}")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}; give a best.pt or checkpoint.pt that train.py wrote "
                              f"(in the run's out_dir)")
    not_torch = not_a_torch_file(path)
    if not_torch:  # else torch's unpickler error, which advises weights_only=False: no help for a JSON
        raise CheckpointError(f"{path} is not a checkpoint of this code base: {not_torch}; give a best.pt or "
                              f"checkpoint.pt written by train.py")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        foreign = foreign_objects(e)
        if foreign:
            raise CheckpointError(f"{path} is not a checkpoint of this code base: {foreign}") from None
        raise CheckpointError(f"cannot read checkpoint {path} ({os.path.getsize(path)} bytes): {torch_reason(e)}; "
                              f"a file cut short (a copy or a save that did not finish) or corrupted reads so; "
                              f"{unreadable}") from e
    if is_nanogpt_checkpoint(payload):
        raise CheckpointError(f"{path} is nanoGPT's checkpoint (its model_args and iter_num), not one of train.py: "
                              f"give it as model.pretrained={path}, with a config of its model (e.g. "
                              f"configs/lm/gpt2.yaml)")
    if not isinstance(payload, dict) or "model" not in payload or "config" not in payload:
        mmengine = isinstance(payload, dict) and {"meta", "state_dict"} <= set(payload)
        raise CheckpointError(f"{path} is not a checkpoint of this code base (no 'model'/'config' entries)"
                              f"{_other_tool('mmengine') if mmengine else ''}; for plain weights files use "
                              f"model.pretrained={path}")
    # mappings (a state dict may hold a module's non-tensor extra state); loaders check what is in them
    if not all(isinstance(payload.get(k, {}), dict) for k in ("config", "model", "model_ema")):
        raise CheckpointError(f"{path} is not a checkpoint of this code base: its 'model' entry is not a "
                              f"state dict (parameter name -> tensor) or its 'config' not a mapping")
    return payload


def run_checkpoint_config(path: str) -> Optional[dict]:
    """The run config stored in `path` if it is a checkpoint of this code base (its `config` and `model` entries),
    read without loading its tensors (memory-mapped; a file of torch's legacy format is read whole); None for any
    other file (nanoGPT's ckpt.pt too), a safetensors file or one torch cannot read."""
    payload = mapped_payload(path)  # None: a safetensors file, or one torch cannot read (a broken file)
    if (isinstance(payload, dict) and "model" in payload and isinstance(payload.get("config"), dict)
            and not is_nanogpt_checkpoint(payload)):
        return payload["config"]
    return None


def is_run_checkpoint(path: str) -> bool:
    """Whether `path` is a checkpoint of this code base (see run_checkpoint_config)."""
    return run_checkpoint_config(path) is not None


def training_payload(*, model, optimizer, state, config: dict, ema=None, scaler=None, scheduler=None,
                     extra: dict | None = None) -> dict:
    """Everything an exact resume needs; the model's state dict is taken from the unwrapped module."""
    payload = {
        "model": unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "state": state.state_dict(),
        "config": config,
    }
    if ema is not None:
        payload["model_ema"] = ema.module.state_dict()
    if scaler is not None:
        payload["scaler"] = scaler.state_dict()
    if scheduler is not None:
        payload["scheduler"] = scheduler.state_dict()
    payload.update(extra or {})
    return payload


# optimizer group entries that choose an implementation, not a hyperparameter: the resuming run's own are kept
_OPTIMIZER_KERNEL_KEYS = ("fused", "foreach", "capturable")


def restore_training(payload: dict, *, model, optimizer, state, ema=None, scaler=None,
                     source: Optional[str] = None) -> None:
    """Load a `training_payload` into freshly built objects (in place). `optimizer=None` leaves it as built
    (train.py restores the optimizer by parameter name); the scheduler is never restored, the fresh one of the
    config is the right one (engine/resume.py). `source`: the checkpoint's path, for the messages.

    A setting turned on at the resume (train.allow_changed_config=true) whose state the checkpoint lacks:
    train.amp=fp16's GradScaler starts at its initial scale, as a fresh fp16 run's does (the scale is rescaled
    away before each step; a too large one skips the first updates while it backs off, as at a fresh start);
    train.ema=true is refused: an average started now from the checkpoint's weights is not the EMA a run with
    train.ema=true holds at this update, and evaluate.py --ema would score it as that. State of a setting turned
    off (an EMA, a loss scale) is left unread."""
    where = source or "the checkpoint"
    unwrap_model(model).load_state_dict(payload["model"])
    if optimizer is not None:
        # the kernel choices are this run's (fused on CUDA, engine.optim.use_fused), not the writer's:
        # load_state_dict takes every group entry from the file, so a checkpoint of a CPU run resumed on CUDA
        # would step unfused (no sync-free fp16 step). They go into the groups handed to load_state_dict, not
        # onto the loaded ones, because torch places each 'step' by them (on the parameter's device where fused
        # or capturable, which the fused CUDA kernel needs), as engine.resume.restore_optimizer's groups do
        saved = payload["optimizer"]
        groups = [{**group, **{k: own[k] for k in _OPTIMIZER_KERNEL_KEYS if k in own}}
                  for group, own in zip(saved["param_groups"], optimizer.param_groups)]
        optimizer.load_state_dict({**saved, "param_groups": groups})
    for key, value in payload["state"].items():
        if key == "best_top1":  # checkpoints before the task-neutral name; -1 meant "no validation yet"
            key, value = "best_value", (value if value >= 0 else None)
        setattr(state, key, value)
    if ema is not None:
        check_ema_entry(payload, True, source)
        ema.module.load_state_dict(payload["model_ema"])
    if scaler is not None:
        if "scaler" in payload:
            scaler.load_state_dict(payload["scaler"])
        else:
            log.info("%s trained without train.amp=fp16: the fp16 loss scale starts at its initial %g, as a "
                     "fresh fp16 run's", where, scaler.get_scale())


def check_ema_entry(payload: dict, keeps_ema: bool, source: Optional[str] = None) -> None:
    """Refuse a `training_payload` without an EMA of the weights to a run that keeps one (`keeps_ema`: train.ema=true
    turned on at the resume): an average begun at its update is not the one a run with train.ema=true from the start
    holds there, and evaluate.py --ema would score it as that. `source`: the checkpoint's path, for the message."""
    if keeps_ema and "model_ema" not in payload:
        raise CheckpointError(f"{source or 'the checkpoint'} was written without an EMA of the weights and this run "
                              f"keeps one (train.ema=true): an average begun at its update {payload['state']['step']} "
                              f"is not the one a run with train.ema=true from the start holds there; resume with "
                              f"train.ema=false, or start a new run from its weights (another out_dir, "
                              f"model.pretrained={source or 'FILE'})")


def record_quant_settings(path: str, quant: dict, is_main: bool, device: torch.device) -> bool:
    """Make the quant section of the config recorded in `path` (a best.pt or checkpoint.pt of this run) `quant`,
    the run's own now: evaluate.py --checkpoint takes its defaults from the file's config, and a resume may change
    quant.* (no training setting reads them). Only that section is replaced; the weights, the training settings and
    the state stay the file's. Rewritten atomically on the main rank (a new file: a hard link to the old one, a
    snapshot or a kept best.until_step<N>.pt, keeps it as it was); True where it was rewritten. A file that is
    missing or no checkpoint of this code base is left alone."""
    error, rewritten = None, False
    if is_main and os.path.isfile(path):
        try:
            config = run_checkpoint_config(path)  # memory-mapped: most resumes change nothing
            if config is not None and config.get("quant") != quant:
                payload = torch.load(path, map_location="cpu", weights_only=True)
                payload["config"] = {**payload["config"], "quant": quant}
                save_atomic(payload, path)
                rewritten = True
        except CheckpointError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - torch.load of a file that changed since: stop on every rank
            error = CheckpointError(f"cannot record the quant.* settings in {path}: {e}; the file is unchanged")
    raise_on_every_rank(error, device,
                        lambda: CheckpointError(f"rank 0 could not record the quant.* settings in {path} (its "
                                                f"error says why)"))
    return rewritten


def class_differences(trained, now) -> Optional[str]:
    """How the class names a checkpoint was trained on (its `classes` entry) differ from those of the data now,
    e.g. "10 vs 10 classes; 0: cat vs car"; None where they agree or either is unknown (synthetic data)."""
    if not trained or not now or list(trained) == list(now):
        return None
    different = [f"{i}: {a} vs {b}" for i, (a, b) in enumerate(zip(trained, now)) if a != b][:3]
    return f"{len(trained)} vs {len(now)} classes" + (f"; {', '.join(different)}" if different else "")


def weights_fingerprint(state_dict: dict) -> str:
    """A short hash of the floating-point tensors of a state dict (identifies the weights a result is of).

    A function of the names and VALUES only, so that the same weights give the same fingerprint on any
    device, in any memory layout, in fp32 or in an fp64 copy: each tensor is hashed as the bytes of its
    contiguous CPU copy in float32 (float64 where a value needs it), -0.0 written as 0.0. No sum is taken:
    a float sum depends on the order of its terms, which differs between CUDA and the CPU.
    """
    digest = hashlib.sha256()
    for name, t in state_dict.items():
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            continue
        t = t.detach()
        if t.dtype == torch.float64 and not torch.equal(t.float().double(), t):
            canonical = t  # not representable in float32: hashed as float64
        else:
            canonical = t.float()
        canonical = (canonical.cpu().contiguous() + 0.0).reshape(-1)  # + 0.0: -0.0 -> 0.0
        digest.update(f"{name}:{canonical.dtype}:{tuple(t.shape)};".encode())
        digest.update(canonical.numpy().tobytes())
    return digest.hexdigest()[:16]
