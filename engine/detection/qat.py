"""GPLQ stage 1 on a detector: activation quantization-aware training with MMEngine's runner, in a resumable
work folder that holds the run's identity (quant/gplq/detector.py calls it through PipelineData)."""
from __future__ import annotations

import copy
import json
import os
import time
from typing import Any, Dict, Optional

import torch
from torch import nn
from mmengine.config import Config
from mmengine.optim import AmpOptimWrapper, OptimWrapper
from mmengine.runner import Runner

from engine.detection.data_checks import annotation_paths, reading_annotations
from engine.detection.errors import DetectionError
from engine.detection.rng_state import RngStateHook
from engine.distributed import run_on_main
from engine.run_dir import RunDirError, partial_writes_of, write_whole

STAGE1_IDENTITY = "gplq_stage1.json"


def train_activation_qat(student: nn.Module, cfg: Config, settings: Dict[str, Any],
                         work_dir: Optional[str]) -> Dict[str, Any]:
    """GPLQ stage 1 on a detector (quant/gplq/detector.py): train `student` in place on its own detection loss
    with MMEngine's runner over the config's training loader at `batch_size_per_gpu`, AdamW with the given
    param groups at a constant lr, one epoch (or `steps` iterations), AMP as asked; checkpoints every
    `ckpt_every` iterations into `work_dir`, and a later call with the same identity resumes from them at the
    iteration they reached (one whose stage 1 had finished loads its last checkpoint and trains no more).

    The folder holds `gplq_stage1.json` (the run's identity: bits, options, float weights, world size); a folder
    holding another run's checkpoints, or one that is not a GPLQ stage-1 folder, is refused and left as it is (one
    whose other run stopped before its first checkpoint is taken over: check_stage1_folder). AMP on the CPU is
    refused before the folder is touched (check_stage1_amp). Under
    torchrun every rank calls this: rank 0 checks the folder, and the runner trains in DDP, each rank on its
    shard of the training loader (the global batch is `batch_size_per_gpu` x world size).
    """
    if work_dir is None:
        raise DetectionError("GPLQ stage 1 on a detector writes resumable checkpoints: give it a work folder")
    identity = json.loads(json.dumps(settings["identity"]))  # plain types, comparable with the stored file
    device = next(student.parameters()).device
    check_stage1_device(device)
    check_stage1_amp(settings["amp"], device)
    # rank 0 checks (and claims) the folder; every rank learns the checkpoint to resume from (rank 0's latest:
    # a rank that cannot read that file fails instead of starting over alone) and the run's name
    checkpoint, name = run_on_main(lambda: _claim_stage1_folder(work_dir, identity), f"preparing {work_dir}",
                                   device)
    resume = checkpoint is not None
    if resume:  # the run's own files (identity checked above); MMEngine 0.10 pickles numpy objects
        os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")

    loader = copy.deepcopy(cfg.train_dataloader)
    loader["batch_size"] = settings["batch_size_per_gpu"]
    with reading_annotations(annotation_paths(cfg, "train_dataloader")):  # as the runner builds it, this rank's shard
        loader = Runner.build_dataloader(loader, seed=settings["seed"])
    # Always an iteration loop, one epoch being the loader's length: MMEngine 0.10 resumes an epoch loop
    # checkpointed by iteration at the start of its epoch, so a resumed epoch was trained again from its start.
    steps = settings["steps"] if settings["steps"] is not None else len(loader)
    train_cfg = dict(type="IterBasedTrainLoop", max_iters=steps)
    optimizer = torch.optim.AdamW(settings["param_groups"], lr=settings["lr"],
                                  weight_decay=settings["weight_decay"])
    amp = settings["amp"]
    wrapper = (AmpOptimWrapper(optimizer=optimizer, dtype="float16" if amp == "fp16" else "bfloat16")
               if amp != "none" else OptimWrapper(optimizer=optimizer))
    every = settings["ckpt_every"] or 10 ** 9
    hooks = dict(timer=dict(type="IterTimerHook"), logger=dict(type="LoggerHook", interval=settings["log_every"]),
                 param_scheduler=dict(type="ParamSchedulerHook"), sampler_seed=dict(type="DistSamplerSeedHook"),
                 checkpoint=dict(type="CheckpointHook", by_epoch=False, interval=every, save_last=True))
    distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    # Under torchrun every rank trains its shard of the loader (DefaultSampler) in DDP, which starts from rank
    # 0's parameters; on the CPU (gloo) DDP takes no device ids.
    wrapper_cfg = dict(type="MMDistributedDataParallel", broadcast_buffers=False,
                       device_ids=[device.index] if device.type == "cuda" else None,
                       find_unused_parameters=cfg.get("find_unused_parameters", False)) if distributed else None
    runner = Runner(model=student, work_dir=work_dir, train_dataloader=loader, train_cfg=train_cfg,
                    optim_wrapper=wrapper, default_hooks=hooks, randomness=dict(seed=settings["seed"]),
                    resume=resume, load_from=checkpoint, default_scope=cfg.get("default_scope", "mmdet"),
                    env_cfg=cfg.get("env_cfg"),
                    log_processor=cfg.get("log_processor"), launcher="pytorch" if distributed else "none",
                    cfg=dict(model_wrapper_cfg=wrapper_cfg), experiment_name=name)
    # The detector trains from the weights it has: Runner.train() would call init_weights() (re-initialising it
    # from init_cfg: the backbone from random) and then broadcast every state_dict entry, which fails on the
    # quantizers' non-tensor extra state. Under DDP every rank starts from rank 0's parameters all the same.
    runner._init_model_weights = lambda: None
    # MMEngine's checkpoints hold no random-number state: a resumed stage 1 drew other RoI samples and flips than
    # the uninterrupted one (121 of 295 tensors differed after the resumed iteration). The training runs' hook
    # (and, under torchrun, its gatherer of every rank's state) keeps it, as scripts/train_detection.py registers.
    keeper = RngStateHook()
    runner.register_hook(keeper)
    runner.register_hook(keeper.gatherer)
    start = time.perf_counter()
    if resume and checkpoint_iteration(checkpoint) >= steps:  # a finished stage 1 (a later stage failed): its
        # weights, without another pass (the loop would also draw every batch it skips)
        runner.load_checkpoint(checkpoint)
        return {"steps": checkpoint_iteration(checkpoint), "seconds": round(time.perf_counter() - start, 3),
                "resumed": True, "loss": None, "world_size": runner.world_size, "work_dir": os.path.abspath(work_dir)}
    runner.train()
    loss = runner.message_hub.get_scalar("train/loss").current() if "train/loss" in runner.message_hub.log_scalars \
        else None
    return {"steps": runner.iter, "seconds": round(time.perf_counter() - start, 3), "resumed": resume,
            "loss": None if loss is None else float(loss), "world_size": runner.world_size,
            "work_dir": os.path.abspath(work_dir)}


def checkpoint_iteration(path: str) -> int:
    """The training iteration an MMEngine checkpoint was saved at (its meta), read without loading its tensors."""
    payload = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    return int((payload.get("meta") or {}).get("iter", 0))


def check_stage1_device(device: torch.device) -> None:
    """Refuse GPLQ stage 1 on the CPU while a GPU is visible: MMEngine's runner moves the model to the GPU
    whenever there is one (mmengine.device.get_device), so stage 1 would train elsewhere than the rest runs."""
    if device.type == "cpu" and torch.cuda.is_available():
        raise DetectionError("GPLQ stage 1 trains in MMEngine's runner, which moves the detector to a visible "
                             "GPU: quantize on the GPU (--device auto), or hide the GPUs (CUDA_VISIBLE_DEVICES=) "
                             "for a CPU run")


def check_stage1_amp(amp: str, device: torch.device, option: str = "amp") -> None:
    """Refuse AMP (`amp` fp16 / bf16) for a stage 1 on the CPU: MMEngine's AmpOptimWrapper asserts a GPU (or another
    accelerator) in its constructor, which was an AssertionError traceback after the full-precision score, with
    the stage-1 folder already claimed. `option` names the setting in the message (evaluate_detection.py:
    `--quant-options gplq.amp`)."""
    if amp != "none" and device.type == "cpu":
        raise DetectionError(f"{option}={amp} on the CPU: MMEngine trains with AMP on a GPU only; drop {option} "
                             "(stage 1 then trains in fp32), or quantize on a GPU")


def check_stage1_folder(work_dir: str, identity: Optional[Dict[str, Any]] = None) -> tuple:
    """(the identity stored in `work_dir`, None for a new or empty folder; the checkpoint to resume from or None):
    refuse, leaving it as it is, a path that is a file, a folder that is not a GPLQ stage-1 folder, an identity
    file that cannot be read, one of another run than `identity` (None: not compared) whose folder holds a
    checkpoint, and a last_checkpoint pointing at a missing file. A folder of another run that holds no checkpoint
    (that run stopped before its first one: a refused AMP, a failed first iteration) counts as new, (None, None),
    so that the claim writes this run's identity over it: the identity file is the command's own, no training is
    lost, and MMEngine's log folders of that start stay where they are. A folder that holds only temporaries of the
    identity (a claim killed while it wrote) is new too. Without `identity` it needs nothing of the run:
    evaluate_detection.py checks every stage-1 folder it will use so before any scoring, so a bad path costs
    seconds, not the full-precision evaluation."""
    identity_path = os.path.join(work_dir, STAGE1_IDENTITY)
    if os.path.exists(work_dir) and not os.path.isdir(work_dir):  # os.makedirs would be a FileExistsError traceback
        raise DetectionError(f"{work_dir} (GPLQ's stage-1 folder, named after --out) is a file: move it away, or "
                             "give another --out")
    # a claim killed mid-write (no handler runs) leaves only the identity's temporary: no file of a run, so the
    # folder is new (and the temporary stays: it may be a claim under way)
    if not (os.path.isdir(work_dir) and set(os.listdir(work_dir)) - {os.path.basename(t) for t in
                                                                      partial_writes_of(identity_path)}):
        return None, None
    if not os.path.isfile(identity_path):
        raise DetectionError(f"{work_dir} exists and is not a GPLQ stage-1 folder ({STAGE1_IDENTITY} is "
                             "missing): move it away")
    try:
        with open(identity_path) as f:
            stored = json.load(f)
    except ValueError as e:  # json's message names no file
        raise DetectionError(f"{identity_path} cannot be read ({e}): move {work_dir} away to start stage 1 "
                             "anew") from None
    from quant.gplq.qat import lr_meant_then  # here: the quantization package imports engine modules
    if identity is not None and "data" not in stored:  # written before the identity held the training data: taken
        # as of the data given now, as a result entry without its train_annotations_sha256 (eval_results.py)
        identity = {key: value for key, value in identity.items() if key != "data"}
    # a null lr or scale_lr of an identity written before they were recorded as used: the lr null meant then
    if identity is not None and lr_meant_then(stored, "options") != identity:
        if not _holds_checkpoint(work_dir):  # nothing trained to lose: taken over (docstring)
            return None, None
        raise DetectionError(f"{work_dir} holds GPLQ stage 1 of another run ({stored}); restore those "
                             f"settings, or move the folder away to start stage 1 anew (now: {identity})")
    last = os.path.join(work_dir, "last_checkpoint")  # MMEngine's pointer to its latest checkpoint
    checkpoint = None
    if os.path.isfile(last):
        with open(last) as f:
            checkpoint = f.read().strip()
        if not os.path.isfile(checkpoint):
            raise DetectionError(f"{last} points to {checkpoint}, which does not exist: restore it, or move "
                                 f"{work_dir} away to start stage 1 anew")
    return stored, checkpoint


def _holds_checkpoint(work_dir: str) -> bool:
    """Whether MMEngine wrote a checkpoint into `work_dir`: its pointer (last_checkpoint) or a `.pth` file (saved
    before the pointer, when a run stopped between the two)."""
    return any(name == "last_checkpoint" or name.endswith(".pth") for name in os.listdir(work_dir))


def _claim_stage1_folder(work_dir: str, identity: Dict[str, Any]) -> tuple:
    """(checkpoint to resume from or None, run name): refuse a folder of another run, or one that is not a GPLQ
    stage-1 folder (check_stage1_folder); write the identity file into a new or empty one, or over the identity of
    another run that wrote no checkpoint. The name is unique, so
    that MMEngine's logger and visualizer instances of two stage-1 runs in one process never meet. An identity
    that another command wrote after the check (the same --out given twice) is refused and kept."""
    path = os.path.join(work_dir, STAGE1_IDENTITY)
    # looked at before the check: an identity there now is one the check judges (taken over where it writes); one
    # that appears after it is another command's claim, which a second look would take for the one judged
    judged = os.path.isfile(path)
    stored, checkpoint = check_stage1_folder(work_dir, identity)
    if stored is None:
        os.makedirs(work_dir, exist_ok=True)

        def write(temporary: str) -> None:
            with open(temporary, "w") as f:
                json.dump(identity, f, indent=1)

        # a temporary file, fsync and a rename: a claim cut off mid-write leaves no half identity under the name
        # (which check_stage1_folder refuses as unreadable); over an identity only where the folder holds one of
        # another run without a checkpoint (taken over, check_stage1_folder), else only where no file has appeared
        # since the check (a hard link: RunDirError where one has)
        try:
            write_whole(path, write, overwrite=judged)
        except RunDirError:
            if judged or not os.path.isfile(path):  # not the claim's race (a link at the name that leads nowhere)
                raise
            # write_whole's message of the race names --overwrite, which evaluate_detection.py does not have
            raise DetectionError(f"{work_dir} (GPLQ's stage-1 folder, named after --out) was claimed by another "
                                 f"command after this one checked it (the same --out given twice?); that command's "
                                 f"{STAGE1_IDENTITY} is kept and this one stops: let that command finish, or give "
                                 f"another --out") from None
    return checkpoint, f"gplq_stage1_{time.time_ns() % 10 ** 9}"
