r"""Train a ViT / DeiT / Swin image classifier or a GPT-2 language model (data.dataset=tokens|kjv), optionally
with Colinearity Decay (CD) or TWEO.

    python train.py                                     # demo: tiny ViT on the embedded digits, CPU, minutes
    python train.py --config configs/debug/tiny.yaml    # seconds: a two-block model on synthetic data
    torchrun --nproc_per_node=8 train.py --config configs/pretrain/vit_b.yaml data.root=/datasets/imagenet
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_HOST:29500 train.py --config configs/pretrain/vit_b.yaml data.root=...
    python train.py --config configs/pretrain/vit_b.yaml --config configs/method/cd.yaml   # + CD

Config: dataclass defaults (configs/schema.py) < each --config YAML in order < key=value overrides.
Training reads no quant.* setting: given here, they are checked before training and recorded with the run
(config.yaml and its checkpoints) as the defaults of `evaluate.py --checkpoint OUT_DIR/best.pt`.
Outputs in out_dir: config.yaml, metrics.jsonl, tb/, train.log, checkpoint.pt (latest), best.pt,
snapshots/ (train.keep_every_epochs); a resume from an earlier point or with changed settings keeps the
earlier config.yaml / metrics.jsonl / best.pt (a roll-back also the checkpoint.pt it leaves; a finished run
extended by a longer schedule its checkpoint.pt and best.pt) as *.until_step<N>.*. Re-running the same command
with the same out_dir resumes from checkpoint.pt (train.resume=PATH: from another checkpoint file); SIGTERM /
SIGINT save and exit with code 75 (docs/operations.md).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

from engine.startup_signals import record_sigterm

if __name__ == "__main__":  # before the imports below (seconds): a SIGTERM in them is a stop request, not fatal
    record_sigterm()

import torch  # noqa: E402 - after record_sigterm
import torch.nn as nn
from timm.utils import ModelEmaV3

from cd import TWEO, ColinearityDecay, budget_weight_decay, pair_energy_source
from cd.decay import config_change
from cd.update import check_tf32_device
from configs import DEFAULT_CONFIG, Config, ConfigError, config_from_dict, config_to_dict, load_config
from configs.cli import OneLineParser, add_config_arguments, parse_known, print_config
from configs.loader import IgnoredOverrideError, device_of_overrides, get_key
from data import (DataError, build_loaders, build_token_loaders, calibration_window_count,
                  check_same_data_on_every_rank)
from data.loader import check_data_files, same_split_data, split_location, split_reading
from engine.act_max import ActivationProbe, check_extra_modules, check_has_blocks
from engine.best_checkpoint import BestCheckpoint, BestMatch
from engine.checkpoint import (CheckpointError, CheckpointFile, check_ema_entry, class_differences,
                               record_quant_settings, restore_training, run_checkpoint_config, save_on_main_rank,
                               training_payload)
from engine.distributed import (DistInfo, OtherRankError, all_reduce, fail_on_every_rank_at_start,
                                failure_on_every_rank, process_group, ranks_apart, whole_number)
from engine.divergence import (DivergenceError, DivergenceGuard, best_withheld_line, withheld_max_steps_line,
                               withheld_stop_line, write_withheld)
from engine.ema import build_ema
from engine.held_log import ClaimNotes, hold_log_file, release_log_file
from engine.rank_agreement import check_same_settings_on_every_rank
from engine.loop import NonFiniteLossError, NothingScoredError, TrainLoop, TrainState, progress_kept_on_error
from engine.metrics import METRICS_FINGERPRINT, MetricLogger, duration, progress_line
from engine.optim import (build_optimizer, build_scheduler, check_layer_decay, lr_rule, peak_lr, schedule_length,
                          use_fused)
from engine.precision import describe_precision, grad_scaler, set_tf32
from engine.exit_codes import EXIT_INTERRUPTED
from engine.preemption import EXIT_PREEMPTED, Preemption, SecondInterrupt, ignore_sigterm_until_exit, preempted_line
from engine.resume import (check_schedule_holds, continue_sample_order, epoch_layout, epoch_position,
                           note_moved_ties, optimizer_param_names, restore_optimizer, resume_position,
                           same_val_windows)
from engine.snapshots import (STARTED_AT_STEP, ReadAhead, check_same_start_on_every_rank,
                              check_same_weights_on_every_rank, file_identity, keep_abandoned_checkpoint,
                              keep_finished_run, keep_missing_snapshot, keep_snapshot, planned_resume, resume_source,
                              started_at_step)
from engine.run_dir import (RunDirError, check_claim, claim_on_main_rank, config_changes, is_inside, recorded_setting,
                            resumes_in, save_config_history, start_only_changes, training_changes, validation_changes)
from engine.running_stats import average_running_stats
from engine.start_weights import (START_WEIGHTS, ancestors_data, classifier_keys, resumed_record, start_lineage,
                                   start_record)
from engine.runinfo import (SAME_ON_EVERY_RANK, exit_with_error, foreign_log, log_environment, setup_logging,
                            trained_software)
from engine.tasks import ClassificationTask, check_model_fits_task, task_for
from engine.training_checks import check_poly_power, check_schedule_on_resume, check_training_settings
from models import ModelError, build_model, describe, input_size, model_label
from models.factory import (MODEL_DROP_SITES, OWN_MODELS, check_recorded_architecture, own_img_size,
                            without_dropout_rates)
from models.hub import check_hub_variant, hub_data_mismatch
from models.kwargs_change import check_kwargs_kept
from models.pretrained import NEW_CLASSIFIER, ConversionError, load_pretrained, mapped_payload
from models.gpt import GPT_SIZES
from quant.plan import (RECORDED_FOR_EVALUATION, check_model_converts, check_quant_plan, evaluation_pipelines,
                        reads_calibration_batch, too_few_for_a_batch, too_many_train_images, train_image_demands)

MAX_STEPS_HINT = ("stopped at update %d (train.max_steps); checkpoint saved; raise train.max_steps (or drop it) "
                  "and re-run the same command to continue")
log = logging.getLogger("train")


def max_steps_line(step: int, kept_step: Optional[int]) -> str:
    """The line of a stop at train.max_steps: checkpoint.pt written at `step`, or, the divergence guard having
    withheld that write (engine/divergence.py), the one kept (`kept_step`)."""
    return MAX_STEPS_HINT % step if kept_step == step else withheld_max_steps_line(step, kept_step)


@dataclass
class RunResult:
    model: nn.Module  # the trained (unwrapped) model
    metrics: dict  # the last validation metrics (val/top1, ... or val/loss, val/ppl, ...)
    state: TrainState
    reason: str = "finished"  # or "preempted" (a stop request: checkpoint written) or "max_steps"


def main(cfg: Config) -> RunResult:
    """Train as `cfg` says (resuming from out_dir when a checkpoint is there)."""
    try:  # before the ranks meet: an error on one node's rank (its wandb install) reaches the others there
        check_before_start(cfg)
        model = check_model_builds(cfg)  # on the meta device: the start weights' checks load into it too
        # data.root's splits as a listing and a token file's head tell them, each rank its node's: a typo leaves no
        # folder (the loaders, built once the folder is held, read them again)
        check_data_files(cfg.data, cfg.model.num_classes)
        # the main rank (RANK 0 or unset) writes train.log: a file of the user's there is refused before the claim
        # of out_dir changes anything in it and before the first log line
        check_train_log(cfg.out_dir, cfg.train.resume, whole_number(os.environ.get("RANK", "0")) == 0)
        read_ahead = check_start_data(cfg, whole_number(os.environ.get("RANK", "0")) == 0, model)
    except Exception as e:  # noqa: BLE001 - raised on this rank after the others know (under torchrun)
        fail_on_every_rank_at_start(e, cfg.train.device)
    with process_group(cfg.train.device) as dist:
        check_same_settings_on_every_rank(config_to_dict(cfg), dist.device)
        check_device_settings(cfg, dist.device)
        # out_dir belongs to this run until it ends (engine/run_dir.py); from here on SIGTERM / SIGINT
        # request a checkpoint at the next update boundary (engine/preemption.py).
        # the claim's notes on the folder's files (moved to the archive, partial writes removed or kept) come before
        # train.log is opened: on stderr, and kept to be written into train.log too (setup_process)
        with ClaimNotes() as notes, \
                claim_on_main_rank(cfg.out_dir, config_to_dict(cfg), cfg.train.archive_existing, dist), \
                Preemption(dist.device, distributed=dist.distributed,
                           saves_at=os.path.join(cfg.out_dir, "checkpoint.pt")) as preemption:
            return run_training(cfg, dist, preemption, notes, read_ahead)


def check_before_start(cfg: Config, packages: bool = True) -> None:
    """What can be refused before any folder is made: the logger's package, the quant.* settings (the defaults of
    this run's evaluation, evaluate.py --checkpoint), now rather than after training, and CD's settings and
    optim.name (engine/training_checks.py), now rather than once the model and the data are built, and a val split
    that is the train split (data.dataset=tokens or folder). packages=False leaves out what this machine has
    installed (log.wandb's package): scripts/sweep.py's printed commands may run on another machine."""
    if cfg.log.wandb and packages:  # engine/metrics.py imports it when logging
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("log.wandb=true but the wandb package is not installed: pip install wandb, or "
                              "set log.wandb=false (metrics.jsonl and TensorBoard are written either way)"
                              ) from None
    check_quant_plan(cfg)
    check_training_settings(cfg)  # CD's settings and optim.name, before the model, the data and the optimizer
    # a val split that reads the training file or folder (by name, path, symbolic or hard link), one of its class
    # folders (val/n2 a link to ../train/n2) or a copy of the training token file would score, and pick best.pt on,
    # the data the model trains on: evaluate.py refuses such a score, so training on it is refused here
    how = same_split_data(cfg.data, "val", cfg.data, "train")  # None for the embedded data sets and a missing split
    if how is not None:
        trained_on, val_at = split_location(cfg.data, "train"), split_location(cfg.data, "val")
        raise ConfigError(f"data.train_split={cfg.data.train_split} and data.val_split={cfg.data.val_split} "
                          f"{split_reading(how, trained_on, val_at)}, so validation (and best.pt) would score the "
                          f"{'text' if cfg.data.dataset == 'tokens' else 'images'} the model trains on; give "
                          f"data.val_split a split held out from training")


def check_model_builds(cfg: Config) -> Optional[nn.Module]:
    """The run's build's refusals of model.name, model.kwargs and model.pretrained=hub (check_model: build_model's
    ModelError) and check_model_fits_run's (the model against the task, log.act_max, optim.layer_decay), asked before
    out_dir is claimed, so that a typo leaves no train.log in a folder the run would make (for the corrected command
    to archive). An error other than the build's refusal is left to the run's build, which meets it and says so.
    Returns the model built on the meta device (meta_model's, which check_start_data's checks of the start weights
    load into: one build serves both), or None where the meta device could not build it."""
    try:
        model = check_model(cfg.model)
    except ModelError:
        raise
    except Exception:  # noqa: BLE001 - no refusal of the settings (check_model's CPU build failed otherwise)
        return None
    check_model_fits_run(cfg, model)
    return model if all(p.is_meta for p in model.parameters()) else None


def check_train_log(out_dir: str, resume: str, writes_log: bool) -> None:
    """Refuse, on the process that writes the log (`writes_log`), a train.log in `out_dir` that a resume there
    would append to and that is no log (engine/runinfo.py foreign_log: notes of the user's, which a run's lines
    would bury): a resume there (engine/run_dir.py resumes_in, as claim_run_dir judges it); a fresh start moves
    such a train.log to the archive with the rest of a start that failed, never appending to it."""
    if not writes_log or not resumes_in(out_dir, resume):
        return
    path = os.path.join(out_dir, "train.log")
    if why := foreign_log(path):
        raise RunDirError(f"out_dir '{out_dir}': the resume appends its log to {path}, which is not train.py's log "
                          f"({why}); move that file out of the folder and run the command again")


def check_start_data(cfg: Config, is_main: bool, model: Optional[nn.Module] = None) -> Optional[ReadAhead]:
    """What the weights a run starts from refuse of its data, asked before out_dir is claimed, so that a refused
    start leaves no file in a folder it would make (train.log) and moves none of an earlier run's (a claim archives
    a failed start's logs, or with train.archive_existing=true a run's files): a fresh start's model.pretrained
    checkpoint of this code base (check_pretrained_data: a val split that reads its training data, another kind of
    text), and a resume into another folder than its run's, train.resume=PATH: resume_source's refusals of the file
    (missing, unreadable, no training checkpoint), check_resume's (with the model.pretrained of rank 0 on the other
    ranks: with_main_rank_paths) and check_checkpoint_fits'. A resume of out_dir's own run is checked once the
    folder is held: a refusal leaves its files as they were (its train.log lines are held until the run goes on,
    engine/held_log.py). Both are asked again once the folder is held, of the files as the run reads them then
    (build_run, run_training); the train.resume file read here is returned (a ReadAhead, None where none was read),
    for run_training to read it no second time where it is unchanged. `model`: cfg.model built on the meta device
    (check_model_builds), into which the start weights are loaded; None: built here (meta_model)."""
    resumes, _ = planned_resume(cfg.out_dir, cfg.train.resume)
    if not resumes:
        check_pretrained_data(cfg)
        check_start_weights(cfg, model)
        return None
    if resumes_in(cfg.out_dir, cfg.train.resume):
        return None
    # before the read: a file rewritten while it is read is read again by the run
    identity = file_identity(cfg.train.resume) if os.path.isfile(cfg.train.resume) else None
    path, payload = resume_source(cfg.out_dir, cfg.train.resume)  # its refusal of a missing or broken file too
    check_resume(cfg if is_main else with_main_rank_paths(cfg, payload), path, payload, warn=False)
    check_checkpoint_fits(cfg, path, payload, model)
    return ReadAhead(path, identity, payload) if identity is not None and path == cfg.train.resume else None


def check_start_weights(cfg: Config, model: Optional[nn.Module] = None) -> None:
    """A fresh start's refusals of its model.pretrained file (a local one: missing, unreadable, NaN weights, keys or
    shapes of another model, models/pretrained.py load_pretrained; a train.py checkpoint of another architecture,
    check_pretrained_architecture), asked before out_dir is claimed: the file loaded into the model built on the
    meta device (no memory, no init time for the model's own weights), logging nothing (the run's own load logs its
    lines). A model the meta device cannot build, or a conversion of timm's that fails on it, is left to the run's
    build once the folder is held, which makes every check again. `model`: that meta build where the caller has
    made it (None: made here)."""
    path = cfg.model.pretrained
    if not path or path == "hub":  # the hub's weights: fetched by the run's build, checked there
        return
    if model is None and (model := meta_model(cfg.model)) is None:
        return
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with meta_copies():
            # strict as build_model loads it: a GPT's file always (its LM head is the tied embedding)
            load_pretrained(model, path, strict=cfg.model.pretrained_strict or cfg.model.name in GPT_SIZES)
        if (recorded := pretrained_run_config(cfg.model)) is not None:
            check_pretrained_architecture(cfg.model, model, recorded)
    except ConversionError:
        return
    finally:
        logging.disable(previous)


def check_device_settings(cfg: Config, device: torch.device) -> None:
    """What only a CUDA device acts on, refused on the device the run resolved to (train.device, auto: cuda when
    visible) before any folder is made: cd.matmul_precision=tf32 elsewhere would run the update in fp32 while the
    run's config.yaml records tf32 (CPUs have no TF32; cd/update.py `_products_in`). Its default, auto, is tf32 on
    CUDA and fp32 elsewhere. The check is ColinearityDecay's at its first update, made here before the run starts."""
    if cfg.cd.enabled:
        try:
            check_tf32_device(cfg.cd.matmul_precision, device.type, "cd.matmul_precision", "the run is",
                              "set cd.matmul_precision=fp32 or auto there, or train on a GPU (train.device=cuda)")
        except ValueError as e:
            raise ConfigError(str(e)) from None


def run_training(cfg: Config, dist: DistInfo, preemption: Preemption,
                 notes: Optional[ClaimNotes] = None, read_ahead: Optional[ReadAhead] = None) -> RunResult:
    """The run itself: build everything, resume if possible, train epoch by epoch, validate, checkpoint. `notes`:
    what the claim of out_dir said of its files, for train.log; `read_ahead`: the train.resume file as
    check_start_data read it."""
    run_started = time.perf_counter()
    setup_process(cfg, dist, notes)
    with failure_on_every_rank(dist.device, "finding the checkpoint to resume from"):  # on each node's disk
        # out_dir's, or train.resume=PATH
        resume_path, payload = resume_source(cfg.out_dir, cfg.train.resume, read_ahead)
    if dist.distributed:  # each rank looked on its own node
        check_same_start_on_every_rank(cfg.out_dir, resume_path, payload, dist.device, dist.rank,
                                       cfg.train.resume)
    # settings the checkpoint cannot continue with: before the model and data; the changed settings it continues
    # with are said once the run's length is known to leave them updates to act on (check_something_to_train). On
    # every rank together: a node's own path (model.pretrained) may be refused on some ranks only, which left the
    # others in their next collective (gloo: a "Connection closed by peer" traceback)
    with failure_on_every_rank(dist.device, "checking the settings the checkpoint is resumed with"):
        check_resume(cfg if dist.is_main else with_main_rank_paths(cfg, payload if resume_path else None),
                     resume_path, payload, warn=False)
        if resume_path is not None:
            check_checkpoint_fits(cfg, resume_path, payload)
    # the weights the run started from: a resumed run's are its checkpoint's (None for one written before the record),
    # with the checkpoint's data first where the run goes on with other data (the weights learned both)
    run = build_run(cfg, dist, resumed=resume_path is not None,
                    start_weights=resumed_record(payload, cfg.data) if resume_path is not None else None,
                    checkpoint=(resume_path, payload) if resume_path is not None else None)
    if resume_path is not None:
        resume_run(run, resume_path, payload)
        release_log_file()  # the run goes on: its lines so far go to train.log (HeldLog), the next ones as they come
        other_validation = validation_changes(payload["config"], as_scored(payload["config"], cfg))
        # of out_dir's metrics.jsonl only: another folder's checkpoint describes that folder's records
        metrics_fingerprint = payload.get(METRICS_FINGERPRINT) if is_inside(resume_path, cfg.out_dir) else None
        if kept := keep_abandoned_checkpoint(cfg.out_dir, resume_path, run.state.step, dist.is_main, dist.device):
            log.warning("checkpoint.pt of the branch this run leaves kept as %s", kept)
        # at an epoch's end of out_dir's own checkpoint.pt, its snapshot maybe not kept: whether one was owed is the
        # writing run's train.keep_every_epochs (snapshot_owed), not this run's, which may have changed it
        state = run.state
        if not run.resumed_elsewhere and state.epoch_batches == 0 and state.epoch:  # out_dir's own, by any name
            if kept := keep_missing_snapshot(run.ckpt_path, payload, state.epoch, dist.is_main, dist.device):
                log.warning("epoch %d kept as %s: the run that wrote checkpoint.pt at its end stopped before it "
                            "kept it", state.epoch, kept)
        # the finished run's checkpoint.pt and best.pt, which a longer schedule goes on from (from out_dir's own
        # checkpoint.pt, or one of its snapshots): kept below, once best.pt is the resumed state's (match_file)
        extends = (is_inside(resume_path, cfg.out_dir) and more_to_train(run, state)
                   and finished_before(payload, run.updates_per_epoch))
        del payload
        # a best score measured on another validation set compares with no new score: best.pt starts afresh
        run.validation_changed = bool(other_validation)
        best = run.best.match_file(run.state, dist.is_main, dist.device, other_validation=bool(other_validation))
        if other_validation:
            log.warning("resuming with another validation set (%s): best.pt's score does not carry over%s; the "
                        "next validation writes best.pt", "; ".join(other_validation),
                        f", best.pt kept as {best.kept}" if best.kept else "")
        elif best.kept or best.restored:
            log.warning("%s", best_match_line(best, run.state.step, cfg.out_dir))
        # before record_quant_in_checkpoints rewrites them: kept as the finished run left them
        if extends and (kept := keep_finished_run(cfg.out_dir, state.step, dist.is_main, dist.device)):
            log.warning("extending the run finished at update %d: the finished run's files kept as %s, which the "
                        "longer schedule's writes do not replace", state.step, " and ".join(kept))
        if recorded := record_quant_in_checkpoints(run):
            log.info("quant.* settings changed: recorded in %s, the defaults of evaluate.py --checkpoint",
                     " and ".join(recorded))
    kept = None
    with failure_on_every_rank(dist.device, "writing config.yaml"):  # rank 0's write (a full disk): not left waiting
        if dist.is_main:
            kept = save_config_history(cfg.out_dir, config_to_dict(cfg), run.state.step)
    if kept:
        log.info("config.yaml of the run so far kept as %s", kept)
    run.logger = MetricLogger(cfg.out_dir, dist.is_main, cfg.log.tensorboard, cfg.log.wandb,
                              cfg.log.wandb_project, cfg.log.wandb_mode, config_to_dict(cfg),
                              resume_step=run.state.step if resume_path is not None else None,
                              wandb_id=run.wandb_id,
                              resume_fingerprint=metrics_fingerprint if resume_path is not None else None)
    run.wandb_id = run.logger.wandb_id  # another after a roll-back (engine/metrics.py), which checkpoints record
    start_step = run.state.step
    loop = build_loop(run, preemption)
    loop.saved_step = start_step if resume_path is not None else None  # what a withheld checkpoint keeps
    ranks_apart()  # the checks every rank runs alike are done: a rank's own error from here is printed at once
    try:
        reason, val, train_seconds = train_epochs(run, loop, preemption)
    except Exception as error:
        loop.keep_held(error)  # a write held for an update that will not come (engine/loop.py TrainLoop.checkpoint)
        raise
    except SecondInterrupt as interrupt:
        # the user's "now": the stop's write is not waited for, but a write held back (a whole checkpoint of an update
        # the run completed, which the stop's write of the same update was to replace) becomes checkpoint.pt, as at
        # any stop; the line, made when the signal came, is made again of the files as they are now
        loop.keep_held(interrupt)
        raise SecondInterrupt(preemption.interrupt_line()) from None
    except BaseException:  # no stop of the user's: the held write is this run's file, never resumed
        run.checkpoint_file.discard()
        raise
    loop.keep_held()  # none is left held where the run ends (its last write is made at once), but never lose one
    return finish(run, preemption, reason, val, start_step, time.perf_counter() - run_started, train_seconds,
                  loop.saved_step)


def with_main_rank_paths(cfg: Config, payload: Optional[dict]) -> Config:
    """`cfg` with the model.pretrained that the checkpoint `payload` records (None: a fresh start, `cfg` as it is),
    for the resume checks of a rank other than rank 0. That path is where each node reaches its copy of the weights
    (engine/rank_agreement.py PATH_SETTINGS; the ranks compared what they loaded when the run started), and the
    checkpoint records rank 0's: another node's path to its copy is no new value (a resumed run reads no weights
    from it), and rank 0 refuses a new one for every rank (check_resumable's start-only settings)."""
    recorded = recorded_setting(payload["config"], "model.pretrained") if payload is not None else None
    if not isinstance(recorded, str):
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pretrained=recorded))


def best_match_line(best: BestMatch, step: int, out_dir: str) -> str:
    """The log line of a resume whose best.pt was not the resumed state's (`BestCheckpoint.match_file`): where it
    was kept, and whether the state's own best.pt is back, or its weights are gone (evaluate.py must not score
    another branch's best.pt as this one's)."""
    kept = (f"best.pt was not the best validation of the run up to update {step} (a roll-back to an earlier "
            f"snapshot, a return to the branch one left, or validations after the last checkpoint): kept as "
            f"{best.kept}; " if best.kept else "")
    if best.restored:
        return f"{kept}the run's own best.pt is back, linked from {best.restored}"
    if best.lost is not None:
        return (f"{kept}the weights of the run's best validation (update {best.lost}) are no longer in {out_dir}: "
                f"the next validation writes best.pt")
    return f"{kept}the next validation writes best.pt"


def record_quant_in_checkpoints(run: "Run") -> list[str]:
    """A resume may change quant.* (no training setting reads them): record the run's quant settings in best.pt,
    and in checkpoint.pt when the run resumed from it (another resume point's leaves it as the branch it left), now
    rather than at their next write, which a finished run re-run never makes (evaluate.py --checkpoint reads its
    defaults from the file it is given). The names of the files rewritten (main rank)."""
    quant = config_to_dict(run.cfg)["quant"]
    files = [run.best.path] + ([] if run.resumed_elsewhere else [run.ckpt_path])
    return [os.path.basename(path) for path in files
            if record_quant_settings(path, quant, run.dist.is_main, run.dist.device)]


@dataclass
class Run:
    """Everything a run builds (`build_run`), what its stages share, and its two writes: checkpoint.pt
    (`save_checkpoint`, the whole training state) and best.pt (`validate`, the best validation's weights)."""

    cfg: Config
    dist: DistInfo
    task: object  # engine.tasks.ClassificationTask or CausalLMTask
    model: nn.Module
    loaders: object  # data.Loaders
    accum_steps: int
    updates_per_epoch: int
    epochs: int  # the run's length in epochs (sched.epochs, or those holding sched.steps)
    total_steps: int  # ... and in updates (train.max_steps may stop it earlier)
    per_step_schedule: bool
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: Optional[torch.amp.GradScaler]
    ema: Optional[ModelEmaV3]
    decay: Optional[ColinearityDecay]
    tweo: Optional[TWEO]
    pair_energies: Callable[[], dict]  # cd/pair_energy/<role>: CD's metrics, or a baseline's pair_energy_source
    position: dict  # what engine.resume.epoch_position needs besides the batches consumed
    state: TrainState = dataclasses.field(default_factory=TrainState)
    started_from: Optional[str] = None  # the train.resume file this run descends from (checkpoints record it)
    started_at: Optional[int] = 0  # the update it began at in out_dir (STARTED_AT_STEP); None: unknown (older file)
    start_weights: Optional[dict] = None  # engine/start_weights.py's record; None: a checkpoint written before it
    # the software that trained the weights, part by part (engine/runinfo.py trained_software; checkpoints record it)
    software: list = dataclasses.field(default_factory=list)
    resumed_elsewhere: bool = False  # from another file than out_dir/checkpoint.pt (train.resume=PATH)
    validation_changed: bool = False  # resumed with other validation settings than its checkpoint's run validated with
    wandb_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:16])  # kept by a resume in out_dir
    logger: Optional[MetricLogger] = None
    best: Optional[BestCheckpoint] = None
    # checkpoint.pt, written at once or held back until the next update's loss (engine/loop.py TrainLoop.checkpoint)
    checkpoint_file: Optional[CheckpointFile] = None

    def __post_init__(self) -> None:
        self.checkpoint_file = CheckpointFile(self.ckpt_path, self.dist.is_main, self.dist.device)

    @property
    def ckpt_path(self) -> str:
        return os.path.join(self.cfg.out_dir, "checkpoint.pt")

    def save_on_main(self, payload_fn, path: str) -> None:
        save_on_main_rank(payload_fn, path, self.dist.is_main, self.dist.device)

    def start_entry(self) -> dict:
        """The checkpoints' record of the weights the run started from ({} where unknown: an older checkpoint's)."""
        return {START_WEIGHTS: self.start_weights} if self.start_weights is not None else {}

    def save_checkpoint(self, held: bool = False) -> None:
        """Write checkpoint.pt from the run's state, or (`held`) hold the write back (`checkpoint_file`)."""
        model, optimizer, state = self.model, self.optimizer, self.state
        extra = {**self.start_entry(), "classes": self.loaders.classes, "data_fingerprint": self.loaders.fingerprint,
                 "optimizer_param_names": optimizer_param_names(model, optimizer),
                 "epoch_position": epoch_position(epoch_batches=state.epoch_batches, **self.position),
                 "resumed_from": self.started_from, STARTED_AT_STEP: self.started_at,
                 "wandb_id": self.wandb_id, "model_drop_sites": MODEL_DROP_SITES, "software": self.software,
                 # which history of metrics.jsonl leads here: a return to this branch takes its records back
                 METRICS_FINGERPRINT: self.logger.fingerprint(state.step) if self.logger is not None else None,
                 **({"cd": self.decay.state_dict()} if self.decay is not None else {})}
        self.checkpoint_file.save(lambda: training_payload(model=model, optimizer=optimizer, state=state,
                                                           config=config_to_dict(self.cfg), ema=self.ema,
                                                           scaler=self.scaler, scheduler=self.scheduler, extra=extra),
                                  held_step=state.step if held else None)

    def validate(self, should_stop, keep_best: bool = True, log_result: bool = True) -> Optional[dict]:
        """Validate (a line says so as it starts); with `keep_best`, log the result (unless not `log_result`) and
        update best.pt. None (no result logged, nothing written) when a stop request ended it."""
        # a large validation set takes long with nothing else logged: say what the pause in the log is
        log.info("validation at update %d: %d %s", self.state.step, len(self.loaders.val.dataset),
                 "windows" if self.task.language else "images")
        with progress_kept_on_error(self.save_checkpoint, self.model, self.state.step, self.dist.distributed,
                                    "validation", diverging=self.state.divergence_streak > 0):
            # under DDP each rank holds its own BatchNorm statistics: the same ones on every rank before scoring, and
            # before best.pt and checkpoint.pt are written from this model, so the weights saved are those scored
            average_running_stats(self.model, self.ema)
            metrics = validate(self.task, self.model, self.ema, self.loaders.val, self.dist.device,
                               self.cfg.train.amp, self.cfg.log.act_max, should_stop=should_stop)
        if metrics is not None and keep_best:
            if log_result:
                self.logger.log(self.state.step, metrics)
            if (held := self.best_held_back()) is not None:
                log.warning("%s", held)
            else:
                self.best.offer(self.state, metrics)
        return metrics

    def best_held_back(self) -> Optional[str]:
        """Why best.pt is not written from the weights just validated (the warning), or None. The divergence guard's
        rule for checkpoint.pt (TrainLoop.checkpoint; both call engine/divergence.py write_withheld): nothing during
        a streak of high log windows, but the write that ends the schedule. A diverged model may still score best (a
        first validation always does): written, it would be the run's result beside a withheld checkpoint, and files
        a re-run must archive before it starts afresh."""
        state = self.state
        if not write_withheld(state.divergence_streak, final=not more_to_train(self, state)):
            return None
        return best_withheld_line(state.step, state.divergence_streak,
                                  state.best_step if state.best_value is not None else None)


def check_snapshots_fit(cfg: Config, ended_epochs: int) -> None:
    """Refuse a train.keep_every_epochs longer than the run: snapshots are kept at the ends of epochs
    N, 2N, ..., and a run that ends fewer than N epochs would keep none (the setting would be ignored)."""
    every = cfg.train.keep_every_epochs
    if every > ended_epochs:
        schedule = (f"sched.steps={cfg.sched.steps}" if cfg.sched.steps is not None
                    else f"sched.epochs={cfg.sched.epochs}")
        fix = f"set it to {ended_epochs} or fewer, or 0 for none" if ended_epochs else "set it to 0"
        raise ConfigError(f"train.keep_every_epochs={every}: the run ends {ended_epochs} whole epoch(s) "
                          f"({schedule}), so it would keep no snapshot; {fix}, or lengthen the run")


def check_cadences_fit(cfg: Config, total_steps: int, updates_per_epoch: int) -> None:
    """Refuse a train.eval_every_steps or train.ckpt_every_steps longer than the run: they act at the updates N,
    2N, ... of the run (counted from its start, a resumed run's too), and a run of fewer than N updates would never
    act on it (the setting ignored, while config.yaml records it). A resume may change either within the run.
    A train.max_steps beyond the run's updates is refused alike: the schedule ends the run first, so it would never
    stop it (the run's length equal to it is taken: the stop and the end fall together)."""
    schedule = (f"sched.steps={cfg.sched.steps}" if cfg.sched.steps is not None
                else f"sched.epochs={cfg.sched.epochs} x {updates_per_epoch} updates")
    if cfg.train.max_steps is not None and cfg.train.max_steps > total_steps:
        raise ConfigError(f"train.max_steps={cfg.train.max_steps}: the run has {total_steps} updates ({schedule}), "
                          f"so its schedule ends it before it would stop at it; set it to {total_steps} or fewer, "
                          f"or drop it (null: the whole schedule), or lengthen the run")
    for key, every, what in (("train.eval_every_steps", cfg.train.eval_every_steps, "validate"),
                             ("train.ckpt_every_steps", cfg.train.ckpt_every_steps, "write checkpoint.pt")):
        if every > total_steps:
            raise ConfigError(f"{key}={every}: the run has {total_steps} updates ({schedule}), so it would never "
                              f"{what} at one; set it to {total_steps} or fewer (0: at epoch ends only), or lengthen "
                              f"the run")


def schedule_text(cfg: Config, updates_per_epoch: int) -> str:
    """The run's schedule as a resume refusal names it, e.g. "sched.epochs=2, 4 updates each"."""
    return (f"sched.steps={cfg.sched.steps}" if cfg.sched.steps is not None
            else f"sched.epochs={cfg.sched.epochs}, {updates_per_epoch} updates each")


def check_resume_point(cfg: Config, payload: dict, checkpoint: str, total_steps: int, updates_per_epoch: int) -> None:
    """What a resume from `checkpoint` (its `payload`) needs of this run's length, refused before the cadences are
    weighed against it (their fix would otherwise be told first, and a second refusal follow it): the schedule
    reaches the checkpoint's update (engine/resume.py check_schedule_holds), and train.max_steps is not below it
    (`check_max_steps_reach`, which the run has made already in check_resume; scripts/sweep.py asks for both
    here)."""
    check_schedule_holds(payload["state"]["step"], total_steps, schedule_text(cfg, updates_per_epoch), checkpoint)
    check_max_steps_reach(cfg, payload, checkpoint)
    check_something_to_train(cfg, payload, checkpoint, total_steps, updates_per_epoch)


def check_something_to_train(cfg: Config, payload: dict, checkpoint: str, total_steps: int,
                             updates_per_epoch: int) -> None:
    """Refuse changed training settings (train.allow_changed_config=true) on a resume with no update left to train:
    `checkpoint` (its `payload`) at the end of the run's schedule (a finished run re-run) or at its train.max_steps.
    The run would validate again and record the new settings in config.yaml while its weights, checkpoint.pt and
    best.pt had none of them. A new validation set (engine/run_dir.py VALIDATION_KEYS) acts on that validation and
    stays allowed, as do the settings that may always change (ENVIRONMENT_KEYS: train.max_steps, quant.*, ...).
    Epochs of another number of updates than the checkpoint's are left to engine/resume.py resume_position, whose
    refusal names the batch and data to resume with (this run's end is then counted in other updates)."""
    step = payload["state"]["step"]
    at_end, at_max = step >= total_steps, bool(cfg.train.max_steps) and step >= cfg.train.max_steps
    recorded = payload.get("epoch_position")
    other_layout = isinstance(recorded, dict) and recorded.get("updates_per_epoch") != updates_per_epoch
    if not (at_end or at_max) or other_layout:
        return
    changed = training_changes(payload["config"], compared_config(payload["config"], cfg))
    if not changed:
        return
    schedule = "sched.steps" if cfg.sched.steps is not None else "sched.epochs"
    end, longer = ((f"the end of the run's schedule ({schedule_text(cfg, updates_per_epoch)})", f"a longer {schedule}")
                   if at_end else (f"train.max_steps={cfg.train.max_steps}", "a larger train.max_steps"))
    raise ConfigError(f"{checkpoint} is at update {step}, {end}: nothing is left to train, so the changed "
                      f"settings ({'; '.join(changed)}) would act on no update while config.yaml recorded them; "
                      f"give {longer} to train on with them, re-run with the checkpoint's settings, or train them in "
                      f"another out_dir (model.pretrained={checkpoint} starts from its weights)")


def check_max_steps_reach(cfg: Config, payload: dict, checkpoint: str) -> None:
    """Refuse a train.max_steps below the update of `checkpoint` (its `payload`): nothing would train, while
    config.yaml recorded it and the summary said the run stopped there; at it, a re-run of a run stopped at
    train.max_steps, is allowed: it validates again. Needs no run length, so check_resume makes it (--print-config
    too)."""
    step = payload["state"]["step"]
    if cfg.train.max_steps and cfg.train.max_steps < step:
        raise ConfigError(f"train.max_steps={cfg.train.max_steps} is below the update {step} of {checkpoint}: "
                          f"nothing to train; give a larger value or none")


def check_cadences_left(cfg: Config, payload: dict, checkpoint: str, total_steps: int,
                        updates_per_epoch: int) -> None:
    """At a resume, refuse a train.eval_every_steps, train.ckpt_every_steps or train.keep_every_epochs that the
    resume command changes (from the checkpoint's config) and that cannot act in what is left of the run: its next
    multiple after the checkpoint's update (epoch) lies past the schedule's end, so it would never act, while
    config.yaml recorded it (check_cadences_fit / check_snapshots_fit weigh the whole run only). A value the resume
    leaves as the checkpoint has it is not refused: it acted before, and a run requeued past its last multiple
    near its end must resume. One line names each setting that cannot act."""
    saved, defaults = payload["config"].get("train", {}), Config().train
    step, epoch = payload["state"]["step"], payload["state"]["epoch"]  # epoch: the epochs completed
    ended_epochs = total_steps // updates_per_epoch  # sched.steps: a last part-epoch never ends
    late = []
    for key, every, done, end, unit, what in (
            ("eval_every_steps", cfg.train.eval_every_steps, step, total_steps, "update", "validate"),
            ("ckpt_every_steps", cfg.train.ckpt_every_steps, step, total_steps, "update", "write checkpoint.pt"),
            ("keep_every_epochs", cfg.train.keep_every_epochs, epoch, ended_epochs, "epoch", "keep a snapshot")):
        was = saved.get(key, getattr(defaults, key))
        if every and every != was and (done // every + 1) * every > end:
            acts = (f"e.g. {end - done} or fewer, " if end > done else "") + f"or {was} as the checkpoint has it"
            late.append(f"train.{key}={every} would next {what} at {unit} {(done // every + 1) * every}, past the "
                        f"run's last {unit} {end} ({acts})")
    if late:
        raise ConfigError(f"{checkpoint} is at update {step} (epoch {epoch}) of the run's {total_steps} "
                          f"({schedule_text(cfg, updates_per_epoch)}), "
                          f"so these new settings could not act in what is left: {'; '.join(late)}; give values "
                          f"that act, or lengthen the run")


def build_run(cfg: Config, dist: DistInfo, resumed: bool, start_weights: Optional[dict] = None,
              checkpoint: Optional[tuple[str, dict]] = None) -> Run:
    """Model (the same initial weights on every rank), data, optimizer, schedule, precision, EMA and the
    regularizers. A resumed run takes its weights from the checkpoint: pretrained weights are not loaded, and
    `start_weights` is the record of the weights its run started from (the checkpoint's, None where it has none).
    A fresh run records the weights it loads (engine/start_weights.py). `checkpoint`: (path, payload) of the
    resume, whose update and settings this run's length and cadences are checked against before anything else is
    built from them."""
    device, per_gpu = dist.device, cfg.train.batch_size_per_gpu
    accum_steps = accumulation_steps(cfg, dist.world_size)
    task = task_for(cfg.data.dataset)
    torch.manual_seed(cfg.train.seed)
    with failure_on_every_rank(device, "building the model (model.pretrained)"):
        if not resumed:  # a run checkpoint's record of its data, before its weights are read
            check_pretrained_data(cfg)
        model = build_model(dataclasses.replace(cfg.model, pretrained="") if resumed else cfg.model).to(device)
        recorded = None if resumed else pretrained_run_config(cfg.model)
        if recorded is not None:
            check_pretrained_architecture(cfg.model, model, recorded)
    if dist.distributed and not resumed:  # each rank read model.pretrained on its own node (or none: a path unset)
        check_same_weights_on_every_rank(model if cfg.model.pretrained else None,
                                         f"model.pretrained={cfg.model.pretrained}" if cfg.model.pretrained
                                         else "model.pretrained", device, dist.rank)
    if recorded is not None:
        note_attention_change(cfg.model, recorded)
    if not resumed:  # before any update: what model.pretrained (a path, left out of the recipe) gave the model, and
        # the data a run checkpoint's weights learned (its own run's and its starts'), which later fine-tunes check
        start_weights = start_record(cfg.model.pretrained, model, trained_on=start_lineage(
            mapped_payload(cfg.model.pretrained)) if recorded is not None else None)
    check_model_fits_run(cfg, model)
    log.info("model %s: %s", model_label(cfg.model), describe(model))
    if not resumed and (line := hub_data_mismatch(cfg)):  # hub weights fed other inputs: said once
        log.warning(line)
    with failure_on_every_rank(device, "reading the data under data.root"):
        loaders = build_data(cfg, model, dist, task)
    if recorded is not None and not task.language:  # before the EMA and the optimizer take the classifier
        check_pretrained_classes(cfg, model, loaders.classes)
    check_same_data_on_every_rank(cfg.data, loaders.fingerprint, device, dist.rank)  # a node's copy may differ
    # what the run's evaluation can draw from the training split: its images, or a language model's windows
    check_evaluation_fits(cfg, model, task, calibration_window_count(cfg.data, input_size(model)) if task.language
                          else len(loaders.train.loader.dataset))
    updates_per_epoch = len(loaders.train) // accum_steps
    if updates_per_epoch == 0:
        raise ConfigError(f"an epoch has {len(loaders.train)} batches per process, fewer than the "
                          f"{accum_steps} accumulation steps of one update: lower train.batch_size")
    epochs, total_steps, per_step = schedule_length(cfg.sched, updates_per_epoch)
    if checkpoint is not None:  # first: a schedule too short for the checkpoint is the fix to tell
        check_resume_point(cfg, checkpoint[1], checkpoint[0], total_steps, updates_per_epoch)
    check_snapshots_fit(cfg, total_steps // updates_per_epoch)  # sched.steps: a last part-epoch never ends
    check_cadences_fit(cfg, total_steps, updates_per_epoch)
    if checkpoint is not None:
        check_cadences_left(cfg, checkpoint[1], checkpoint[0], total_steps, updates_per_epoch)

    # Optimizer, schedule, precision, EMA. With CD, the paper's budget rule moves lam from wd to CD.
    lr = peak_lr(cfg.optim, cfg.train.batch_size)
    weight_decay = cfg.optim.weight_decay
    if cfg.cd.enabled and cfg.cd.budget:
        weight_decay = as_config_error("cd.budget", budget_weight_decay, weight_decay, cfg.cd.lam)
        log.info("CD budget rule: weight decay %g -> %g (cd.lam %g)",
                 cfg.optim.weight_decay, weight_decay, cfg.cd.lam)
    optimizer = as_config_error("optim", build_optimizer, model, cfg.optim, lr, weight_decay, device)
    scheduler = as_config_error("sched", build_scheduler, optimizer, cfg.sched, updates_per_epoch)
    log.info("%s", describe_precision(cfg.train.amp, device, tf32=f"train.tf32={str(cfg.train.tf32).lower()}"))
    ema = build_ema(model, cfg.train)
    if ema is not None:  # scored beside the raw weights, which best.pt and the closing lines follow (DeiT's report)
        log.info("EMA of the weights: decay %g per update%s; scored as val_ema/* at each validation, best.pt chosen "
                 "by the raw weights", cfg.train.ema_decay, " with timm's warmup" if cfg.train.ema_warmup else "")
    log.info("global batch %d = %d per process x %d processes x %d accumulation steps; %s %s; %s; wd %g; "
             "%d updates per epoch, %d epochs (%d updates)", cfg.train.batch_size, per_gpu, dist.world_size,
             accum_steps, cfg.optim.name, "fused kernel" if use_fused(cfg.optim, device) else "default kernels",
             lr_rule(cfg.optim, cfg.train.batch_size), weight_decay, updates_per_epoch, epochs, total_steps)

    # Regularizers. CD acts on the weights as an optimizer step pre-hook: it runs inside optimizer.step(),
    # after clipping, once per update, only when the step really runs, with each group's lr. TWEO (and
    # CD's loss-form ablation) add a term to the loss (build_loop's compute_loss).
    decay = (as_config_error("cd", ColinearityDecay.from_config, cfg.cd, model,
                             norms_every=cfg.train.log_every_steps) if cfg.cd.enabled else None)
    if decay is not None:
        decay.attach(optimizer)
        log.info("%r", decay)
    # a baseline finds its pairs here too: a cd.gated_mlp it would not read is refused before the run's files
    pair_energies = (decay.metrics if decay is not None
                     else as_config_error("cd", pair_energy_source, model, cfg.cd.gated_mlp))
    tweo = (as_config_error("tweo", TWEO.from_config, cfg.tweo, model, total_steps=total_steps)
            if cfg.tweo.enabled else None)
    if tweo is not None:
        log.info("%r", tweo)
    position = epoch_layout(cfg, world_size=dist.world_size, accum_steps=accum_steps,
                            updates_per_epoch=updates_per_epoch, train_images=len(loaders.train.loader.dataset),
                            language=task.language)
    run = Run(cfg=cfg, dist=dist, task=task, model=model, loaders=loaders, accum_steps=accum_steps,
              updates_per_epoch=updates_per_epoch, epochs=epochs, total_steps=total_steps,
              per_step_schedule=per_step, optimizer=optimizer, scheduler=scheduler,
              scaler=grad_scaler(cfg.train.amp, device), ema=ema, decay=decay, tweo=tweo,
              pair_energies=pair_energies, position=position, start_weights=start_weights,
              software=trained_software(checkpoint[1] if checkpoint is not None else None))
    run.best = BestCheckpoint(os.path.join(cfg.out_dir, "best.pt"), model=model, ema=ema,
                              config=config_to_dict(cfg), classes=loaders.classes, save=run.save_on_main,
                              key=task.score_key, higher_is_better=task.higher_is_better,
                              # the data it trained on, as checkpoint.pt: evaluate.py compares a data.root's files
                              extra={**run.start_entry(), "data_fingerprint": loaders.fingerprint,
                                     "software": run.software})
    return run


def check_model_fits_run(cfg: Config, model: nn.Module) -> None:
    """What the run refuses of its model once built, before the data are read: a language model on images or an
    image model on text, log.act_max on a model without blocks (measured at every validation: refused now, not
    by the first one after the training), and optim.layer_decay on a model without timm's layer grouping (refused by
    the optimizer's build, after the data were read). scripts/sweep.py makes it on a meta-device build of every run's
    model."""
    check_model_fits_task(model, cfg.model.name, cfg.data.dataset)
    as_config_error("optim", check_layer_decay, model, cfg.optim)
    if cfg.log.act_max:
        check_has_blocks(model, cfg.model.name, "set log.act_max=false to train it without the activation maxima")


# the end of a warning about the run's default evaluation plan, which `evaluate.py --checkpoint` would refuse
DEFAULT_PLAN_REFUSED = ("here, or to `evaluate.py --checkpoint`, which refuses this default of the run's evaluation "
                        "otherwise")


def check_evaluation_fits(cfg: Config, model: nn.Module, task, train_size: int) -> None:
    """What `evaluate.py --checkpoint` checks of the run's quant.* settings against its model and its training
    split (`train_size` samples: images, or a language model's calibration windows), refused before the training
    rather than by the evaluation after it: quant.act_max_extra_modules patterns that name no module, and more
    calibration windows or calibration / APHQ / GPLQ images than the split holds, and a model the planned pipelines
    cannot convert (check_model_converts: a Swin with padded windows under RepQ-ViT's fold) (check_quant_plan at the
    start refuses what needs neither). A count that is the schema's default, or a model the task's default pipelines
    cannot convert, with quant.pipelines unset, was asked for by no one: a warning says what the evaluation will
    need, and the run trains."""
    try:
        check_extra_modules(model, cfg.quant.act_max_extra_modules)
    except ConfigError as e:
        raise ConfigError(f"{e} ({RECORDED_FOR_EVALUATION})") from None
    pipelines = evaluation_pipelines(cfg)
    try:  # as evaluate.py resolves the plan: the task's own pipelines where quant.pipelines is unset
        check_model_converts(model, dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, pipelines=pipelines)))
    except ConfigError as e:
        if cfg.quant.pipelines is not None:
            raise ConfigError(f"{e} ({RECORDED_FOR_EVALUATION})") from None
        # the task's default plan: a model it cannot quantize may still be trained on purpose (for its float score)
        log.warning("%s (%s)", e, DEFAULT_PLAN_REFUSED)
    demands = train_image_demands(cfg, pipelines,
                                  any(reads_calibration_batch(name, task.language) for name in pipelines))
    unit = f"windows of {input_size(model)} tokens" if task.language else "images"
    defaults = Config()
    given = {key: count for key, count in demands.items()
             if cfg.quant.pipelines is not None or get_key(defaults, key) != count}
    # a loader batch above the split fits no number of processes (evaluate.py counts its own)
    if too_many := (too_many_train_images(given, train_size, cfg.data.train_split, unit)
                    or too_few_for_a_batch(cfg, pipelines if cfg.quant.pipelines is not None else [], train_size,
                                           cfg.data.train_split, world_size=1)):
        raise ConfigError(f"{too_many} ({RECORDED_FOR_EVALUATION})")
    if too_many := too_many_train_images(demands, train_size, cfg.data.train_split, unit):
        log.warning("%s (%s)", too_many, DEFAULT_PLAN_REFUSED)


def pretrained_run_config(model_cfg) -> Optional[dict]:
    """The run config recorded in model.pretrained when it is a checkpoint of this code base (read once, memory-
    mapped); None for another file (timm, DeiT, nanoGPT's, safetensors) or none."""
    path = model_cfg.pretrained
    return run_checkpoint_config(path) if path and os.path.isfile(path) else None


def check_pretrained_architecture(model_cfg, model: nn.Module, config: dict) -> None:
    """A checkpoint of this code base given as model.pretrained records the model it was trained as (`config`): its
    weights loaded (their shapes fit), but a 2-head ViT's have the shapes of a 4-head one, which fine-tuning would
    start from as another function without a word (models.factory.check_recorded_architecture), and so would a
    ReLU ViT's in a GELU one (other model.kwargs: models.kwargs_change.check_kwargs_kept)."""
    if not isinstance(config.get("model"), dict):
        return
    try:
        recorded = config_from_dict({"model": config["model"]}).model
    except ConfigError:  # a record of an older schema: nothing to compare it with (its shapes fit)
        return
    check_recorded_architecture(recorded, model, f"model.pretrained={model_cfg.pretrained}")
    check_kwargs_kept(recorded, model_cfg, f"model.pretrained={model_cfg.pretrained}")


def check_pretrained_classes(cfg: Config, model: nn.Module, classes: Optional[list]) -> None:
    """A checkpoint of this code base given as model.pretrained records the class names it was trained on. One of
    other classes, as many as the data set's (digits '0'..'9' for Fashion-MNIST's ten), has a classifier that fits
    the model's shape and was loaded: its outputs would keep naming the file's classes. Fine-tuning replaces it by a
    new classifier, as one of another shape is (the one the model was built with: drawn again with train.seed, the
    draw a file without a fitting classifier leaves), with a log line; model.pretrained_strict=true, which loads the
    weights as they are or not at all, refuses it. A file that records no classes (another file, synthetic data)
    is not compared, nor one whose classifier, of another size, was replaced or refused when loading."""
    path = cfg.model.pretrained
    payload = mapped_payload(path)
    trained = payload.get("classes") if isinstance(payload, dict) else None
    head = sorted(classifier_keys(model))
    if not head or not isinstance(trained, list) or len(trained) != cfg.model.num_classes:
        return
    different = class_differences(trained, classes)
    if different is None:
        return
    if cfg.model.pretrained_strict:
        raise ModelError(f"model.pretrained={path} was trained on other classes than data.root={cfg.data.root} "
                         f"holds (then vs now: {different}): its classifier would name its own classes; "
                         f"{NEW_CLASSIFIER}, or point data.root at the data set it was trained on")
    # the run's own draws (data order, augmentation) go on as without this; manual_seed seeds the GPUs' too
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        torch.manual_seed(cfg.train.seed)
        fresh = build_model(dataclasses.replace(cfg.model, pretrained="")).state_dict()
    model.load_state_dict({k: fresh[k] for k in head}, strict=False)
    log.info("%s was trained on other classes than data.root=%s holds (then vs now: %s): new classifier: %s",
             path, cfg.data.root, different, ", ".join(head))


def check_pretrained_data(cfg: Config) -> None:
    """A checkpoint of this code base given as model.pretrained records the data it was trained on (its config's
    data.*, and its token files' `data_fingerprint`). A fine-tune from it validates, and picks best.pt, on data held
    out from that training (`check_held_out_from`). A language model is fine-tuned on the kind of text it was
    trained on: characters (kjv) or token ids (tokens), else id i would mean another symbol
    (evaluate.check_vocabulary_kind). A file of another kind (timm's, DeiT's, nanoGPT's) records none of this: a
    language model's file that records no characters counts as trained on token ids, as evaluate.py counts it, and is
    refused on data.dataset=kjv, whose id i is the i-th of its own characters (a nanoGPT shakespeare_char file's 65
    ids are 65 other characters in another order), since no setting names the file's vocabulary."""
    config = pretrained_run_config(cfg.model)
    trained = recorded_data(config, f"model.pretrained={cfg.model.pretrained}")
    if trained is None:
        check_recorded_characters(cfg)
        return
    path, data = cfg.model.pretrained, cfg.data
    weights = f"model.pretrained={path}"
    kinds = {"kjv": "characters (data.dataset=kjv)", "tokens": "token ids (data.dataset=tokens)"}
    if trained.dataset in kinds and data.dataset in kinds and trained.dataset != data.dataset:
        raise ConfigError(f"data.dataset={data.dataset}: {weights} was trained on {kinds[trained.dataset]}, this "
                          f"run's text is {kinds[data.dataset]}, so its embedding of id i would be read as another "
                          f"symbol; fine-tune it on data.dataset={trained.dataset}, or train from scratch (without "
                          f"model.pretrained)")
    payload = mapped_payload(path)
    check_digits_held_out(trained, payload, data, weights)
    check_held_out_from(trained, payload.get("data_fingerprint"), data, weights)
    check_held_out_from_ancestors(payload, data, weights)


def check_held_out_from_ancestors(payload: dict, data, weights: str) -> None:
    """`check_held_out_from` for the data of every start the run checkpoint `payload` (named `weights`) descends
    from (engine/start_weights.py ancestors_data: a fine-tune of a fine-tune), where it records them; the check
    evaluate.py --checkpoint makes of the val split it scores (evaluate.check_held_out_from_starts)."""
    import evaluate  # the evaluation stack: here only
    evaluate.check_held_out_from_starts(ancestors_data(payload), data, weights, "validation (and best.pt)")


def check_digits_held_out(trained, payload: dict, data, weights: str) -> None:
    """evaluate.check_digits_held_out_from_all: digits the run checkpoint `payload` (named `weights`; `trained`, its
    own data settings) and its starts learned at other val fractions are refused in one line, before the checks of
    each, whose fixes contradict one another."""
    import evaluate  # the evaluation stack: here only
    evaluate.check_digits_held_out_from_all(trained, ancestors_data(payload), data, weights)


def check_recorded_characters(cfg: Config) -> None:
    """Refuse to fine-tune on data.dataset=kjv from a model.pretrained file that records no characters (`classes`,
    which train.py's checkpoints of a kjv run hold): nanoGPT's ckpt.pt, transformers' or bare weights, a safetensors
    file. Their embedding's id i means a symbol of a vocabulary the file does not name (GPT-2's BPE, or a character
    set of nanoGPT's meta.pkl), which training would silently read as the i-th character of the Bible."""
    path = cfg.model.pretrained
    if cfg.data.dataset != "kjv" or not path or not os.path.isfile(path):
        return
    payload = mapped_payload(path)
    if isinstance(payload, dict) and isinstance(payload.get("classes"), list):
        return
    raise ConfigError(f"data.dataset=kjv: model.pretrained={path} records no vocabulary (not a checkpoint of train.py, "
                      "which records its characters), so its embedding's id i means a symbol this run cannot know "
                      "(GPT-2's token ids, another text's characters) while kjv reads it as its i-th character; "
                      "fine-tune a train.py checkpoint trained on data.dataset=kjv, or train from scratch (without "
                      "model.pretrained)")


def recorded_data(config: Optional[dict], weights: str):
    """The data settings a checkpoint's recorded `config` holds (`weights`: the checkpoint, as errors name it); None
    where it holds none. Of an older schema, the keys that name its data (evaluate.recorded_training_data)."""
    if not isinstance(config, dict) or not isinstance(config.get("data"), dict):
        return None
    import evaluate  # the evaluation stack: here only
    return evaluate.recorded_training_data(config["data"], weights)


def check_held_out_from(trained, fingerprint: Optional[dict], data, weights: str) -> None:
    """Refuse a val split of `data` that reads data the weights `weights` (a run checkpoint, as the error names it)
    were trained on (`trained`, the data settings it recorded; `fingerprint`, its data_fingerprint): by name, link or
    copy, a kjv tail or a digits split reaching into its training, as evaluate.py --checkpoint refuses to score it
    (evaluate.check_held_out_from). Validation, and best.pt chosen by it, would score data the weights learned."""
    import evaluate  # its check of a val split against a checkpoint's training split (the evaluation stack: here only)
    evaluate.check_held_out_from(trained, fingerprint, data, weights)


def note_attention_change(model_cfg, config: dict) -> None:
    """Fine-tuning a checkpoint of this code base (its recorded `config`) with another `model.attn` is allowed (e.g.
    softmax1 -> softmax), but softmax1 has no parameters of its own, so nothing in the weights would show that the
    attention changed: the recorded config is the only witness. model.pretrained_strict=true, which loads the
    weights as they were trained or not at all, refuses the change (the weights would compute another function, as
    under a model.kwargs change); otherwise it is a warning."""
    trained = config.get("model", {}).get("attn", "softmax")
    if trained != model_cfg.attn:
        if model_cfg.pretrained_strict:
            raise ModelError(f"model.pretrained={model_cfg.pretrained} was trained with model.attn={trained}, not "
                             f"model.attn={model_cfg.attn}: the weights would compute another function than the "
                             f"trained one; set model.attn={trained} to start from the trained function, or "
                             f"fine-tune with the change (model.pretrained_strict=false)")
        log.warning("%s was trained with model.attn=%s; fine-tuning it with model.attn=%s as set (set "
                    "model.attn=%s to keep its attention)", model_cfg.pretrained, trained, model_cfg.attn, trained)


def build_data(cfg: Config, model: nn.Module, dist: DistInfo, task):
    """The task's loaders: token windows of the model's context for a language model, images else."""
    common = dict(batch_size_per_gpu=cfg.train.batch_size_per_gpu, rank=dist.rank, world_size=dist.world_size,
                  eval_batch_size_per_gpu=cfg.train.eval_batch_size_per_gpu, seed=cfg.train.seed)
    if task.language:
        return build_token_loaders(cfg.data, context=input_size(model), vocab_size=cfg.model.num_classes,
                                   **common)
    return build_loaders(cfg.data, img_size=input_size(model), num_classes=cfg.model.num_classes, **common)


def check_model_drop_sites(payload: dict, cfg: Config, resume_path: str) -> None:
    """Refuse to continue, under model.drop's present meaning, a timm model's run that trained with model.drop as
    timm's classifier-head dropout (a checkpoint without `model_drop_sites`): it would resume with dropout at
    other layers than it trained with. The GPT's dropout has not changed meaning."""
    if not cfg.model.drop or payload.get("model_drop_sites") == MODEL_DROP_SITES or cfg.model.name in GPT_SIZES:
        return
    trained = payload["config"].get("model", {}).get("drop", 0.0)
    if trained:
        raise CheckpointError(f"{resume_path} trained with model.drop={trained} as timm's classifier-head dropout "
                              f"(drop_rate); model.drop now sets the dropout after the position embedding, attention "
                              f"projection and MLP (DeiT's): to continue as it trained, resume with model.drop=0 "
                              f"model.kwargs.drop_rate={trained} train.allow_changed_config=true, or start a new run")


def check_checkpoint_fits(cfg: Config, resume_path: str, payload: dict,
                          model: Optional[nn.Module] = None) -> None:
    """What a resume refuses of the checkpoint `resume_path` itself (its `payload`) rather than of the settings: a
    model.drop of timm's earlier meaning (check_model_drop_sites), no EMA where this run keeps one
    (engine/checkpoint.py check_ema_entry), and weights (and EMA weights) that do not fit the model of the config (a
    checkpoint hand-edited or of another code base), loaded by name and shape into the model built on the meta
    device (no memory, no init time; a model it cannot build is left to restore_training). Asked before out_dir is
    claimed where the resume goes into another folder (check_start_data: a refusal leaves no folder and no
    train.log), and on every resume once the folder is held, before the model and the data are built. `model`:
    that meta build where the caller has made it (check_model_builds'; None: made here)."""
    check_model_drop_sites(payload, cfg, resume_path)
    check_ema_entry(payload, cfg.train.ema, resume_path)
    if model is None and (model := meta_model(cfg.model)) is None:  # left to restore_training
        return
    # not assign=True, which marks the state dict's own metadata so that restore_training's load of it later
    # assigned its tensors too (the optimizer left holding the model's former parameters)
    try:
        with meta_copies():
            for entry in ("model", "model_ema") if cfg.train.ema else ("model",):
                model.load_state_dict(payload[entry])
    except RuntimeError as e:
        raise weights_misfit(resume_path, e) from None


def check_model(model_cfg):
    """The model build_model builds of `model_cfg`, built on the meta device (no weights: 0.03 s for the demo's ViT,
    0.15 s for Swin-T on a 2-core CPU), so that what it refuses (model.name, model.kwargs the constructor rejects:
    model.kwargs.dpeth=3, model.img_size not a multiple of the patch size, a vision-only setting on a GPT) is refused
    in its own words before out_dir is claimed (main) and before a sweep's first run trains (scripts/sweep.py). No
    weights are read: model.pretrained=hub is checked for a variant without hub weights (build_model's first
    refusal), a local file is the run's (check_start_weights; the sweep's refuse_missing_input_files). The random
    number generator and the default device are left as they were. A build the meta device cannot make (an
    operation without meta kernels in a model's constructor) is made on the CPU, so that only the build's own
    refusal refuses. Returns the model; raises the build's ModelError."""
    hub = model_cfg.pretrained == "hub"
    # GPT-2's builder refuses hub weights before it loads anything; a timm model with them would fetch them
    unloaded = dataclasses.replace(model_cfg, pretrained="hub" if hub and model_cfg.name in GPT_SIZES else "")
    if hub and model_cfg.name not in OWN_MODELS:  # build_model's first refusal: a small variant has no hub weights
        check_hub_variant(model_cfg.name)
    with torch.random.fork_rng(devices=[]):  # the CPU's generator: a model's init draws from it
        try:
            with torch.device("meta"):
                return build_model(unloaded)
        except Exception:  # noqa: BLE001 - the build's refusal, or the meta device's: told apart by the CPU's
            with torch.device("cpu"):
                return build_model(unloaded)


def meta_model(model_cfg) -> Optional[nn.Module]:
    """The model of `model_cfg` built on the meta device without start weights (no memory, no init time), for the
    checks of the weights it is to load before out_dir is claimed; None where the meta device cannot build it (the
    real build's refusal, model.name or model.kwargs, comes in its place). The CPU's random numbers are left as
    they were."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            return build_model(dataclasses.replace(model_cfg, pretrained=""))
    except Exception:  # noqa: BLE001 - the build's own refusal, or the meta device's: either is the real build's
        return None


@contextlib.contextmanager
def meta_copies():
    """Weights loaded into a `meta_model`: each copy is a no-op (the checks are of names and shapes), which torch
    warns of, unsaid here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter", category=UserWarning)
        yield


def weights_misfit(resume_path: str, error: RuntimeError) -> Exception:
    """The refusal of a checkpoint whose weights do not fit the model of its own config (torch's load_state_dict
    `error`, cut to its first 300 characters); `error` itself where it is another one."""
    if "Error(s) in loading state_dict" not in str(error):
        return error
    return CheckpointError(f"{resume_path}: its weights do not fit the model of its own config "
                           f"({' '.join(str(error).split())[:300]}): not a checkpoint train.py wrote for this "
                           f"model; give another one")


def resume_run(run: Run, resume_path: str, payload: dict) -> None:
    """Continue from checkpoint.pt of out_dir, or from train.resume=PATH (engine/snapshots.py). The
    checkpoint gives the state, this config every setting (engine/resume.py): optimizer moments by
    parameter name under the new groups' lr / weight decay / betas, the fresh schedule (the loop sets the lr
    of the current update), the position within the epoch in samples of any process count."""
    # check_resumable, check_checkpoint_fits and check_resume_point passed before the run was built
    cfg, state = run.cfg, run.state
    different = class_differences(payload.get("classes"), run.loaders.classes)
    if different:  # another image data set: each label would name another class
        raise CheckpointError(f"{resume_path} was trained on other classes than data.root={cfg.data.root} holds "
                              f"(then vs now: {different}): point data.root at the data set it was trained on, "
                              f"or start a new run")
    saved, now = payload.get("data_fingerprint"), run.loaders.fingerprint or {}
    # data.root is a path, the files are the data: a token file of the same name must hold the same ids, a split
    # folder of the same name the same image names (after the classes: their message is the clearer). Compared
    # by name: another data.val_split (train.allow_changed_config=true) is a changed setting, not changed files
    changed = sorted(name for name in (saved or {}).keys() & now.keys() if saved[name] != now[name])
    if changed:
        what = "token files" if cfg.data.dataset == "tokens" else "images"
        then, current = ({name: fingerprint[name] for name in changed} for fingerprint in (saved, now))
        raise CheckpointError(f"{resume_path} was trained on other {what} than data.root={cfg.data.root} holds "
                              f"in {', '.join(changed)} ({then} then, {current} now): point data.root at the "
                              f"data it was trained on, or start a new run")
    try:
        restore_training(payload, model=run.model, optimizer=None, state=state, ema=run.ema, scaler=run.scaler,
                         source=resume_path)
    except RuntimeError as e:  # a model the meta device could not build: check_checkpoint_fits left it to here
        raise weights_misfit(resume_path, e) from None
    last = run.total_steps if cfg.train.max_steps is None else min(run.total_steps, cfg.train.max_steps)
    check_poly_power(cfg, payload.get("scheduler"), resume_path, updates_left=last - state.step)
    restore_optimizer(run.optimizer, payload["optimizer"], payload.get("optimizer_param_names"),
                      optimizer_param_names(run.model, run.optimizer))
    state.epoch_batches = resume_position(
        payload.get("epoch_position"), epoch_position(epoch_batches=0, **run.position),
        epoch_batches=state.epoch_batches, step=state.step, checkpoint=resume_path)
    continue_sample_order(payload, run.loaders.train.sampler, run.position, resume_path)
    train_set = getattr(run.loaders.train.loader.dataset, "base", None)  # SeededDataset's
    note_moved_ties(payload.get("epoch_position"), state.epoch_batches, getattr(train_set, "moved_ties", 0),
                    resume_path)
    schedule_at_resume(run)
    # said once the checks above passed (EMA turned on, other updates per epoch, ...): a refused command says no
    # "resuming" before its error line
    if changed := config_changes(payload["config"], compared_config(payload["config"], cfg)):
        log.warning("resuming with changed settings: %s", "; ".join(changed), extra=SAME_ON_EVERY_RANK)
    if run.decay is not None and "cd" in payload:
        # ColinearityDecay warns its library users of a CD config other than its state's (a raw UserWarning with a
        # source line); the "resuming with changed settings" line above names the cd.* settings that
        # changed, so it would say them twice: what they leave unsaid (other decayed matrices under the same
        # settings: another release's pairing) is logged instead, once
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=CD_CONFIG_WARNING, category=UserWarning)
            run.decay.load_state_dict(payload["cd"])
        if line := cd_change_unsaid(payload["config"], cfg, payload["cd"].get("config"),
                                    run.decay.state_dict()["config"]):
            log.warning("%s", line, extra=SAME_ON_EVERY_RANK)
    elif run.decay is not None:  # cd.enabled turned on here (a CD run's checkpoints always hold its state): no CD
        # update ran before, but the update number its norms_every counts is the run's, so that the update norms
        # fall on the log steps (from 0 they were computed at the updates a multiple past the resume instead)
        run.decay.load_state_dict({"num_updates": 0, "steps": state.step, "config": None})
    # out_dir's own checkpoint.pt by any name (train.resume through a link to out_dir or one of its parents, or out_dir
    # given through one): abspath kept the names apart, and the run took its own file for another run's start
    own = os.path.realpath(resume_path) == os.path.realpath(run.ckpt_path)
    # the wandb run goes on where the run does (its checkpoint.pt, or one of its snapshots: MetricLogger derives a
    # new id from it for a roll-back); another run's checkpoint (train.resume into a new out_dir) starts a new one:
    # its id would log into that run, renamed
    if is_inside(resume_path, run.cfg.out_dir):
        run.wandb_id = payload.get("wandb_id") or run.wandb_id
    run.started_from = payload.get("resumed_from") if own else os.path.abspath(resume_path)
    run.started_at = started_at_step(payload) if own else state.step
    run.resumed_elsewhere = not own
    log.info("resumed from %s at epoch %d, update %d", resume_path, state.epoch, state.step)


CD_CONFIG_WARNING = "ColinearityDecay: resuming with a different CD config"  # cd/decay.py config_change's start
# the cd.* settings each entry of ColinearityDecay's recorded config follows (the others: the setting of its name)
CD_RECORD_SOURCES = {"decayed": ("targets", "gated_mlp")}


def cd_change_unsaid(saved_run: dict, cfg: Config, saved_cd: Optional[dict], now_cd: dict) -> Optional[str]:
    """ColinearityDecay's warning of its checkpointed state's config `saved_cd` (None: not recorded) against this
    run's `now_cd` (cd/decay.py config_change), where the run's cd.* settings, as its checkpoint's config `saved_run`
    and `cfg` hold them, do not account for it; None where they do, as the "resuming with changed settings" line
    names them (run_training), or where nothing differs. An entry whose settings changed is taken as now; what
    still differs (e.g. other decayed matrices under the same cd.targets) is left for the warning to tell."""
    if saved_cd is None:
        return None
    then, now = saved_run.get("cd", {}), config_to_dict(cfg)["cd"]
    accounted = dict(saved_cd)
    for key in set(saved_cd) | set(now_cd):
        if any(then.get(setting) != now.get(setting) for setting in CD_RECORD_SOURCES.get(key, (key,))):
            accounted.pop(key, None)
            if key in now_cd:
                accounted[key] = now_cd[key]
    return config_change(saved_cd, now_cd) if config_change(accounted, now_cd) is not None else None


def schedule_at_resume(run: Run) -> None:
    """Set the groups' lr that a run never stopped holds at the resumed point, after restore_optimizer (which
    leaves the fresh schedule's first lr, the warmup's start): the lr of the next update (sched.per_step), or the
    lr of the epoch in progress, of the one just ended at an epoch's end (the loop sets the next epoch's as it
    begins it). A re-run that trains no update (stopped at the schedule's last one) writes its last checkpoint.pt
    with it; before, with the first lr, which the checkpoint of the run never stopped does not hold."""
    scheduler, state = run.scheduler, run.state
    if scheduler is None:
        return
    if run.per_step_schedule:
        scheduler.step_update(state.step)
    elif state.epoch_batches or state.epoch:
        scheduler.step(state.epoch if state.epoch_batches else state.epoch - 1)


def build_loop(run: Run, preemption: Preemption) -> TrainLoop:
    """The update loop on the model wrapped for training: DDP (gradient all-reduce), then torch.compile
    (PyTorch's order); the loss is the task's plus the regularizers' terms."""
    cfg, dist, state = run.cfg, run.dist, run.state
    train_model: nn.Module = run.model
    if dist.distributed:
        train_model = nn.parallel.DistributedDataParallel(
            run.model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)
    if cfg.train.compile:
        train_model = torch.compile(train_model)
    criterion = run.task.criterion(cfg.data.label_smoothing, mixup=run.loaders.mixup is not None)
    tweo, decay = run.tweo, run.decay

    def compute_loss(m: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = criterion(m(inputs), targets)
        aux = 0.0  # regularizers' loss terms (both scale with the task loss when rescaled)
        if tweo is not None:
            aux = aux + tweo.aux_loss(loss, state.step)
        if decay is not None and cfg.cd.mode == "loss":
            aux = aux + decay.aux_loss(loss)
        return loss + aux

    def log_step(step: int, metrics: dict) -> None:
        """metrics.jsonl / TensorBoard / wandb, and one line in train.log and stdout per log step."""
        run.logger.log(step, metrics)
        if "train/loss" in metrics:
            log.info("%s", progress_line(step, metrics, total_steps=min(run.total_steps, cfg.train.max_steps
                                                                        or sys.maxsize),
                                         epochs=run.epochs, updates_per_epoch=run.updates_per_epoch,
                                         batch_size=cfg.train.batch_size))

    # Pair energies are logged for every run, so that baselines can be compared with CD runs.
    metric_sources, window_sources = [run.pair_energies], {}
    if tweo is not None:
        # every rank's micro-batches of the window, as train/loss (the loop calls its sources on every rank); a
        # checkpoint between two log steps keeps its sums, as the loop's own (TrainState.log_window)
        metric_sources.append(lambda: tweo.metrics(sum_fn=all_reduce))
        window_sources["tweo"] = (lambda: tweo.window_state(sum_fn=all_reduce), tweo.load_window_state)
    return TrainLoop(
        model=train_model, optimizer=run.optimizer, compute_loss=compute_loss, device=dist.device,
        amp=cfg.train.amp, scaler=run.scaler, scheduler=run.scheduler, per_step_schedule=run.per_step_schedule,
        accum_steps=run.accum_steps, clip_grad=cfg.optim.clip_grad, ema=run.ema, mixup=run.loaders.mixup,
        seed=cfg.train.seed, rank=dist.rank, world_size=dist.world_size,
        max_steps=min(run.total_steps, cfg.train.max_steps or sys.maxsize), log_every=cfg.train.log_every_steps,
        ckpt_every=cfg.train.ckpt_every_steps, eval_every=cfg.train.eval_every_steps,
        validates=lambda step, epoch_done: validation_follows(run, step, epoch_done), save=run.save_checkpoint,
        checkpoint_file=run.checkpoint_file,
        log=log_step, metric_sources=metric_sources, window_sources=window_sources,
        should_stop=preemption.should_stop, request_stop=preemption.request_stop,
        divergence=(DivergenceGuard(cfg.train.divergence_factor, cfg.train.divergence_windows)
                    if cfg.train.divergence_factor else None),
        progress=cfg.log.progress and dist.is_main, epochs=run.epochs, log_epoch_costs=True,
        sample_tokens=input_size(run.model) if run.task.language else 0)


def train_epochs(run: Run, loop: TrainLoop, preemption: Preemption) -> tuple[str, dict, float]:
    """Train, validate and checkpoint epoch by epoch; stop early on preemption, train.max_steps or the end
    of sched.steps. A stop request ends a validation (checkpoint.pt is written first; the resumed run
    validates then). Returns (how it ended, the last validation, seconds spent in updates)."""
    cfg, state = run.cfg, run.state
    val, reason, train_seconds = {}, "finished", 0.0
    validated_step = None  # the update of this process's last validation
    while state.validation_due or (more_to_train(run, state) and not reached(state.step, cfg.train.max_steps)):
        epoch_ended = False
        if not state.validation_due:
            started, step_before = time.perf_counter(), state.step
            reason = loop.run_epoch(run.loaders.train, state, cfg.train.batch_size_per_gpu)
            train_seconds += time.perf_counter() - started
            if reason == "max_steps" and not reached(state.step, cfg.train.max_steps):
                reason = "epoch_end"  # sched.steps: the last update of the schedule ends the run
            epoch_ended = state.epoch_batches == 0
            if epoch_ended and reason == "epoch_end" and preemption.should_stop(state.step, boundary=True):
                reason = "preempted"  # the signal came at the epoch's last update
            # by the step, not by the loop's reason alone: an epoch that ends at a train.eval_every_steps update or
            # at train.max_steps returns 'epoch_end', and a stop request at such an update 'preempted' (the resumed
            # run then validates first); the epoch's end alone is validated every train.eval_every_epochs. An epoch
            # resumed at its last update (a write of that update made before its validation) makes none: its end's
            # validation, unless the resumed run has just made it (validation_due, TrainLoop.validates)
            ended = state.epoch if epoch_ended else None
            state.validation_due = (validation_follows(run, state.step, ended) if state.step != step_before else
                                    validation_follows(run, None, ended) and validated_step != state.step)
        if state.validation_due and reason != "preempted":
            # logged once: a validation the run logged before a write of its update that it resumes from is not
            # logged again (as in `finish`), unless the resume changed what validation measures
            logged = run.logger.has_record(state.step, "val/") and not run.validation_changed
            val = run.validate(preemption.should_stop, log_result=not logged) or {}
            if val:
                validated_step = state.step
                state.validation_due = False
                ema_key = run.task.score_key.replace("val/", "val_ema/", 1)
                log.info("epoch %d/%d  update %d  %s%s", state.current_epoch, run.epochs, state.step,
                         run.task.score_text(val[run.task.score_key]),
                         f"  (EMA: {run.task.score_text(val[ema_key])})" if ema_key in val else "")
            else:
                reason = "preempted"  # the signal came during validation
        # not while the loss is high (the divergence guard): the last good checkpoint stays the resume point; but
        # the write that ends the schedule is made (the run finished: a re-run must not train its end again). Where
        # the run goes on, the write waits for the next update's loss on its weights (TrainLoop.checkpoint), and so
        # does the epoch's snapshot, kept once the write is checkpoint.pt
        goes_on = (reason != "preempted" and more_to_train(run, state)
                   and not reached(state.step, cfg.train.max_steps))
        snapshot = None
        if epoch_ended and cfg.train.keep_every_epochs and state.epoch % cfg.train.keep_every_epochs == 0:
            snapshot = (lambda epoch=state.epoch: keep_epoch_snapshot(run, epoch))
        saved = loop.checkpoint(state, final=reason != "preempted" and not more_to_train(run, state),
                                goes_on=goes_on, on_kept=snapshot)
        if reason != "preempted" and preemption.should_stop(state.step, boundary=True):
            reason = "preempted"  # the signal came during the writes: do not start another epoch
            loop.keep_held()  # no update will measure the write held back: it is made as a stop's
        if reason == "preempted" and not saved:
            # exit code 1, not 75: the same command would resume from the kept checkpoint, count the streak from
            # 0 again and, stopped again inside it (a job's time limit), be requeued for ever without progress
            raise DivergenceError(withheld_stop_line(state.step, loop.saved_step))
        if reason == "preempted":
            log.info("%s", preempted_line(state.step, "checkpoint"))
            break
        if reason == "max_steps":
            log.info("%s", max_steps_line(state.step, loop.saved_step))
            break
    return reason, val, train_seconds


def keep_epoch_snapshot(run: Run, epoch: int) -> None:
    """Keep checkpoint.pt, just written at the end of `epoch`, as its snapshot (train.keep_every_epochs)."""
    kept = keep_snapshot(run.ckpt_path, epoch, run.dist.is_main, run.dist.device)
    log.info("epoch %d kept as %s", epoch, kept)


def validation_follows(run: Run, step: Optional[int], epoch_done: Optional[int]) -> bool:
    """Whether `train_epochs` validates after update `step` (None: no update was made): at every
    train.eval_every_steps, train.max_steps and the schedule's last update, and where it completes epoch `epoch_done`
    (1-based; None mid-epoch) every train.eval_every_epochs and the last. The loop records it as due from the update's
    step on (engine/loop.py TrainLoop.validates)."""
    cfg, every = run.cfg, run.cfg.train.eval_every_steps
    at_step = step is not None and (reached(step, cfg.train.max_steps) or bool(every and step % every == 0)
                                    or step >= run.total_steps)
    return at_step or (epoch_done is not None and (epoch_done % cfg.train.eval_every_epochs == 0
                                                   or epoch_done == run.epochs))


def finished_before(payload: dict, updates_per_epoch: int) -> bool:
    """Whether the training checkpoint `payload` is at the end of the schedule of the run that wrote it (its config's
    sched.*, counted in `updates_per_epoch`, which a resume keeps: engine/resume.py resume_position): the last state
    of a finished run, which a resume with a longer schedule extends. A sched section of an older schema that no
    longer reads counts as finished: its files are kept rather than replaced."""
    try:
        sched = config_from_dict({"sched": payload["config"]["sched"]}).sched
    except ConfigError:
        return True
    epochs, total_steps, _ = schedule_length(sched, updates_per_epoch)
    return payload["state"]["step"] >= total_steps or payload["state"]["epoch"] >= epochs


def more_to_train(run: Run, state: TrainState) -> bool:
    """Whether the schedule (sched.epochs, sched.steps) has updates left; train.max_steps aside."""
    return state.epoch < run.epochs and state.step < run.total_steps


def finish(run: Run, preemption: Preemption, reason: str, val: dict, start_step: int, wall_seconds: float,
           train_seconds: float, kept_step: Optional[int]) -> RunResult:
    """Report the current weights (not after preemption: no time, and no fresh numbers) and the summary.
    `kept_step`: the update of the last checkpoint written (or resumed from), TrainLoop.saved_step."""
    cfg, state = run.cfg, run.state
    if (reason in ("epoch_end", "validate", "finished") and state.epoch < run.epochs
            and state.step < run.total_steps):  # train.max_steps at an epoch's end, or a re-run of a run that
        reason = "max_steps"  # stopped there: not finished, say how to go on
        if state.step == start_step:  # nothing trained (or written) by this process
            log.info("the run is at update %d, at or beyond train.max_steps=%s: nothing trained; raise "
                     "train.max_steps (or drop it) and re-run the same command to continue", state.step,
                     cfg.train.max_steps)
        else:
            log.info("%s", max_steps_line(state.step, kept_step))
    reason = "finished" if reason in ("epoch_end", "validate") else reason
    if reason == "preempted":
        val = {}
    elif not val:  # a finished run re-run; one whose best.pt is elsewhere or was moved aside (resumed into a new
        # out_dir, a roll-back: best score cleared) writes best.pt from it, as any resumed run's first validation
        cleared = run.state.best_value is None
        # logged once: the update's validation the run logged before (metrics.jsonl's last step) is not logged again,
        # unless the resume changed what validation measures (data.crop_pct, ...): then it is a new number
        logged = run.logger.has_record(state.step, "val/") and not run.validation_changed
        val = run.validate(preemption.should_stop, keep_best=cleared, log_result=not logged) or {}
        if val and (cleared or run.resumed_elsewhere):  # out_dir's checkpoint.pt: this run's point (not another
            run.save_checkpoint()  # branch's, not missing), with the best score that best.pt now holds
        reason = reason if val else "preempted"
    run.logger.close()
    if run.tweo is not None:
        run.tweo.remove()
    if val:
        log.info("%s after %d updates; files in %s", run.task.describe(val), state.step,
                 os.path.abspath(cfg.out_dir))
        if not run.task.language and reason == "finished":  # a stop at train.max_steps may be in its warmup
            warn_if_at_chance(val["val/top1"], cfg.model.num_classes, cfg.data.dataset)
    log.info("%s", run_summary(state, reason, run.epochs, wall_seconds,
                               (state.step - start_step) * cfg.train.batch_size, train_seconds, run.task))
    return RunResult(model=run.model, metrics=val, state=state, reason=reason)


def run_summary(state: TrainState, reason: str, epochs: int, wall_seconds: float, samples: int,
                train_seconds: float, task=ClassificationTask()) -> str:
    """The last line of every run: how it ended, its best validation, and this job's time and speed (since it last
    resumed; images of every process, i.e. updates x the global batch)."""
    ended = {"finished": "finished", "preempted": "stopped by a signal (resumable)",
             "max_steps": "stopped at train.max_steps"}.get(reason, reason)
    best = (f"best {task.score_text(state.best_value)} at epoch {state.best_epoch} (update {state.best_step})"
            if state.best_value is not None else "no validation yet")
    unit, rate = ("windows", "windows/s") if task.language else ("images", "img/s")
    speed = f"{samples / train_seconds:.0f} {rate}" if train_seconds > 0 else "no updates trained"
    return (f"run summary: {ended} at update {state.step}, epoch {state.current_epoch}/{epochs}; {best}; wall time "
            f"{duration(wall_seconds)}; this job trained {samples} {unit} in {duration(train_seconds)} "
            f"({speed})")


def setup_process(cfg: Config, dist: DistInfo, notes: Optional[ClaimNotes] = None) -> None:
    """Logging to out_dir/train.log (main rank; held back while a resume of out_dir's run may yet be refused, where
    the run has a train.log to append to: `HeldLog`) with the claim's `notes` first, TF32 as train.tf32 asks
    (engine/precision.py set_tf32), and deterministic kernels if asked."""
    # after the claim, as it judged the folder; a train.log this command creates is its own, and has every line
    held = (dist.is_main and resumes_in(cfg.out_dir, cfg.train.resume)
            and os.path.isfile(os.path.join(cfg.out_dir, "train.log")))
    if notes is not None:
        notes.stop()  # what engine.run_dir logs from here on reaches train.log as any line
    setup_logging(cfg.out_dir, dist.is_main)
    if held:
        hold_log_file()
    if notes is not None:
        notes.write_to_log_file()
    log_environment(log, dist)
    set_tf32(cfg.train.tf32)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def accumulation_steps(cfg: Config, world_size: int) -> int:
    """Gradient accumulation steps per update: the global batch is what the recipe (and the lr rule)
    speaks of, so it is fixed and split into processes x per-process batches x accumulation steps."""
    per_gpu = cfg.train.batch_size_per_gpu
    if cfg.train.batch_size % (per_gpu * world_size):
        step = per_gpu * world_size
        fits = (largest_divisor_at_most(cfg.train.batch_size // world_size, per_gpu)
                if cfg.train.batch_size % world_size == 0 else None)
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} is not a multiple of train.batch_size_per_gpu="
                          f"{per_gpu} x {world_size} processes: set train.batch_size to a multiple of {step} "
                          f"(e.g. {max(step, cfg.train.batch_size // step * step)})"
                          + (f", or train.batch_size_per_gpu={fits}" if fits else ""))
    return cfg.train.batch_size // (per_gpu * world_size)


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of `n` (>= 1) that is at most `limit` (>= 1), in min(limit, sqrt(n)) trial divisions:
    a typo such as train.batch_size_per_gpu=100000000 is told at once, not after a count down from it."""
    root = math.isqrt(n)
    if limit <= root:
        return next(d for d in range(limit, 0, -1) if n % d == 0)  # ends at 1 at the latest
    small = [i for i in range(1, root + 1) if n % i == 0]  # each divisor is one of these or n // one of them
    return max(d for i in small for d in (i, n // i) if d <= limit)


def as_config_error(section: str, build, *args, **kwargs):
    """Call `build`; a ValueError about its settings becomes a ConfigError naming the config section (once:
    the cd package's own messages begin with "cd ", and one that names a key of the section, "cd.lam=", names it)."""
    try:
        return build(*args, **kwargs)
    except ValueError as e:
        raise ConfigError(str(e) if str(e).startswith((f"{section} ", f"{section}.")) else f"{section}: {e}") from e


def reached(step: int, max_steps: int | None) -> bool:
    return max_steps is not None and step >= max_steps


def validate(task, model: nn.Module, ema, loader, device: torch.device, amp: str, act_max: bool = False,
             should_stop=None) -> Optional[dict]:
    """The task's val/* metrics (and val_ema/*); with `act_max`, the paper's activation maxima
    act/max_module and act/max_block over the validation set (max over all ranks), and the largest
    kurtosis of a module / block output (act/kurtosis_module, act/kurtosis_block). None when `should_stop`
    (a preemption request) ended it."""
    with ActivationProbe(model, moments=True) if act_max else contextlib.nullcontext() as probe:
        raw = task.evaluate(model, loader, device, amp, should_stop=should_stop)
        if raw is None:
            return None
        metrics = {f"val/{k}": v for k, v in raw.items()}
    if act_max:
        metrics.update(probe.result(reduce_fn=lambda t: all_reduce(t, op="max"), device=device,
                                    sum_fn=all_reduce).metrics())
    if ema is not None:
        averaged = task.evaluate(ema.module, loader, device, amp, should_stop=should_stop)
        if averaged is None:
            return None
        metrics.update({f"val_ema/{k}": v for k, v in averaged.items()})
    return metrics


def check_resume(cfg: Config, resume_path: Optional[str], payload: Optional[dict], warn: bool = True) -> None:
    """The settings the checkpoint `resume_path` (resume_source's; None: a fresh start) cannot continue with
    (check_resumable) and a val split that reads data it was trained on (check_held_out_from), the schedule check,
    which check_before_start leaves to here where a checkpoint may be continued (may_resume), and a train.max_steps
    below the checkpoint's update (check_max_steps_reach). The run and --print-config make it alike; `warn` as
    check_resumable's (the run says the changed settings itself, once its length is known to leave them updates:
    check_something_to_train)."""
    if resume_path is not None:
        check_resumable(payload["config"], cfg, resume_path, warn=warn)
        # a val split changed on resume (train.allow_changed_config=true) must not read what the run trained on
        if (trained := recorded_data(payload["config"], resume_path)) is not None:
            check_digits_held_out(trained, payload, cfg.data, resume_path)
            check_held_out_from(trained, payload.get("data_fingerprint"), cfg.data, resume_path)
        check_held_out_from_ancestors(payload, cfg.data, resume_path)
    check_schedule_on_resume(cfg, payload["config"] if resume_path is not None else None)
    if resume_path is not None:
        check_max_steps_reach(cfg, payload, resume_path)


def as_scored(saved: dict, current: Config) -> dict:
    """`current` as a dict, with the data.val_windows of the checkpoint's config `saved` where both score the same
    windows (engine/resume.py same_val_windows: e.g. 0 now, 64 recorded when the text had 38): no change to compare."""
    current_d = config_to_dict(current)
    if "val_windows" in saved.get("data", {}) and same_val_windows(saved, current):
        current_d["data"]["val_windows"] = saved["data"]["val_windows"]
    return current_d


def compared_config(saved: dict, current: Config) -> dict:
    """`current` as a dict to compare with a checkpoint's config `saved`: `as_scored`, and model.img_size null,
    which is the model's own size, taken as that size where the other config names it (vit_nano's 32: one model)."""
    current_d = as_scored(saved, current)
    trained_size, size = saved["model"].get("img_size"), current.model.img_size
    if (trained_size is None) != (size is None) and own_img_size(current.model) == (trained_size or size):
        current_d["model"]["img_size"] = trained_size
    return current_d


def check_resumable(saved: dict, current: Config, source: str, warn: bool = True) -> None:
    """The checkpoint `source` (out_dir's checkpoint.pt or the train.resume file) must be of the same model
    and data set; other settings that change what the run computes may differ only with
    train.allow_changed_config=true (paths, logging and train.max_steps may always change:
    engine/run_dir.py ENVIRONMENT_KEYS), logged as such unless `warn` is False (a sweep's check before its runs
    start: the resume it would announce is the run's own, at its turn)."""
    current_d = compared_config(saved, current)
    own = os.path.realpath(source) == os.path.realpath(os.path.join(current.out_dir, "checkpoint.pt"))
    other = "use another out_dir" if own else "give train.resume a checkpoint of this model and data set"
    # the model's build (not its start weights, nor its drop rates, model.drop(_path)'s or model.kwargs' *drop_rate:
    # they add no parameter, and a change of them is one more changed setting below)
    architecture = [k for k in current_d["model"] if k not in ("pretrained", "pretrained_strict", "drop_path", "drop")]

    def built(config: dict, key: str):  # a key the checkpoint predates: the value its run had (model.attn's softmax)
        value = recorded_setting(config, f"model.{key}")
        return without_dropout_rates(value) if key == "kwargs" and isinstance(value, dict) else value

    differ = [f"model.{k}: {recorded_setting(saved, f'model.{k}')!r} -> {current_d['model'][k]!r}"
              for k in architecture if built(saved, k) != built(current_d, k)]
    if differ:
        raise CheckpointError(f"{source} was written for model {saved['model'].get('name')} with other settings "
                              f"({'; '.join(differ)}): {other}, or use the original model settings")
    if saved["data"]["dataset"] != current.data.dataset:
        raise CheckpointError(f"{source} was trained on data.dataset={saved['data']['dataset']!r}, "
                              f"not {current.data.dataset!r}: {other}")
    if saved["optim"]["name"] != current.optim.name:  # its moments mean nothing to another optimizer
        raise CheckpointError(f"{source} holds the state of optim.name="
                              f"{saved['optim']['name']}, which optim.name={current.optim.name} cannot use: "
                              f"resume with optim.name={saved['optim']['name']}, or start a new run from its "
                              f"weights (another out_dir, model.pretrained={source})")
    unused = start_only_changes(saved, current_d)
    if unused:  # e.g. new pretrained weights: a resumed run takes its weights from the checkpoint
        raise CheckpointError(f"{source} continues a run, and only a run's start reads {'; '.join(unused)}: "
                              f"pass the values it started with to continue it, or start a new run with the "
                              f"new ones (another out_dir)")
    changed = config_changes(saved, current_d)
    if changed and not current.train.allow_changed_config:
        raise CheckpointError(f"{source} was written with other settings "
                              f"({'; '.join(changed)}): re-run with those settings, use another out_dir, or "
                              f"pass train.allow_changed_config=true to continue with the new ones")
    if changed and warn:
        log.warning("resuming with changed settings: %s", "; ".join(changed), extra=SAME_ON_EVERY_RANK)


def warn_if_at_chance(top1: float, num_classes: int, dataset: str) -> None:
    """A finished run whose accuracy is near chance probably diverged or never learned: say so. Not on
    `data.dataset=synthetic`: its val images are noise drawn apart from the train images and labelled by their
    index (data/synthetic.py), so every model scores at chance there, the smoke test's too."""
    chance = 100.0 / num_classes
    if dataset != "synthetic" and num_classes > 1 and top1 <= 1.5 * chance:
        log.warning("val top-1 %.2f%% is at chance level (%.2f%% for %d classes): the run did not learn; "
                    "check the learning rate and the loss in metrics.jsonl", top1, chance, num_classes)


def read_config(paths: list[str], overrides: list[str], default: bool) -> Config:
    """load_config; `default`: `paths` is the default recipe, which an override that no key reads is told of."""
    try:
        return load_config(paths, overrides)
    except IgnoredOverrideError as e:
        if not default:
            raise
        raise IgnoredOverrideError(f"{e}. No --config was given: the default config is {DEFAULT_CONFIG} "
                                   f"(digits); pass --config configs/... for another recipe") from None


# what --print-config checks: check_before_start's refusals, claim_run_dir's of out_dir's files (check_claim, nothing
# moved), a resume's train.log (check_train_log) and, where the run would continue a checkpoint, check_resume's on
# the checkpoint's config; the model, the data and the schedule are not built
PRINT_CONFIG_HELP = ("print the resolved config (YAML) and exit without running, once it passes the checks a run "
                     "makes before it starts (every key and value; quant.*, CD's settings, optim.name, log.wandb's "
                     "package, a val split that is the train split; out_dir's files as the run claims the folder: "
                     "an earlier run's files without checkpoint.pt, a folder at checkpoint.pt, a train.log a "
                     "resume would append to that is no log, with nothing moved; a fine-tune's val split that reads "
                     "the training data of its model.pretrained checkpoint; "
                     "where out_dir holds checkpoint.pt or train.resume is given, the settings, schedule and "
                     "train.max_steps that checkpoint can continue with); what needs the model, the data or the "
                     "run's length built (model.name, model.kwargs the model rejects, data.root's files, "
                     "train.max_steps and the cadences beyond the run's updates, a resume's epoch layout, changed "
                     "settings on a resumed run with nothing left to train), and "
                     "whether another run holds out_dir or it can be written, is checked when a run starts")


def parse_args(argv: list[str]) -> Config:
    parser = OneLineParser(description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=None,
                        help=f"YAML recipe; repeat to layer several (default: {DEFAULT_CONFIG})")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=1e-3 out_dir=runs/x")
    add_config_arguments(parser, "train.py", print_help=PRINT_CONFIG_HELP)
    args = parse_known(parser, argv, "train.py")
    # the default recipe is the checkout's, wherever train.py is started from (runs/ goes to the working folder)
    paths = args.config or [os.path.join(os.path.dirname(os.path.abspath(__file__)), DEFAULT_CONFIG)]
    try:  # this node's --config files, read before the ranks meet
        cfg = read_config(paths, args.overrides, default=not args.config)
    except Exception as e:  # noqa: BLE001 - raised on this rank after the others know (under torchrun)
        fail_on_every_rank_at_start(e, device_of_overrides(args.overrides))
    if not cfg.out_dir:
        cfg.out_dir = os.path.join("runs", "+".join(os.path.splitext(os.path.basename(p))[0] for p in paths))
    if args.print_config:
        check_before_start(cfg)  # a config printed is one a run would start with, as far as that is told unbuilt
        # in the run's order: its claim of out_dir (nothing moved here), then the checkpoint it would continue
        check_claim(cfg.out_dir, config_to_dict(cfg), cfg.train.archive_existing)
        check_train_log(cfg.out_dir, cfg.train.resume, writes_log=True)
        resume_path, payload = resume_source(cfg.out_dir, cfg.train.resume)  # (None, None): a fresh start
        check_resume(cfg, resume_path, payload, warn=False)
        if resume_path is None:  # a fine-tune's val split against its start's training data (check_start_data)
            check_pretrained_data(cfg)
        print_config(cfg)
        sys.exit(0)
    return cfg


if __name__ == "__main__":
    try:
        result = main(parse_args(sys.argv[1:]))
        ignore_sigterm_until_exit()  # torchrun's SIGTERM once another rank exited must not make this rank's code -15
        if result.reason == "preempted":
            sys.exit(EXIT_PREEMPTED)  # checkpoint written; the same command resumes (engine/preemption.py)
    except (ConfigError, CheckpointError, DataError, ModelError, RunDirError, NonFiniteLossError,
            NothingScoredError, DivergenceError) as e:
        exit_with_error(str(e), error=e)  # stderr (once under torchrun: said_by_rank_0) and train.log
    except OtherRankError as e:  # the rank that failed prints its own error (a traceback if it is not the user's)
        exit_with_error(str(e), error=e)
    except SecondInterrupt as e:  # the user's "now": one line (stderr, train.log), not a traceback of where it came
        exit_with_error(str(e), code=EXIT_INTERRUPTED)
