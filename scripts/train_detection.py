"""Train an MMDetection detector (the paper's COCO study): MMDetection's own Runner on merged config files,
with this repository's guards (data root, backbone checkpoint and load_from, nothing overwritten).

    python scripts/train_detection.py --config configs/detection/mask_rcnn_swin_t_1x.py \
        --config configs/detection/method/cd.py --data-root /datasets/coco --work-dir runs/det_t1x_cd \
        model.backbone.init_cfg.checkpoint=/weights/swin_tiny_patch4_window7_224.pth
    torchrun --nproc_per_node=8 scripts/train_detection.py --launcher pytorch ...   # the paper's 8 GPUs (MMEngine
                                                                                   # trains distributed on GPUs only)
    python scripts/train_detection.py ... --resume                                 # continue the same run

Overrides are `key=value` words anywhere on the line, or after `--cfg-options` as MMDetection's tools take them;
those of the test loop (test_dataloader, test_evaluator, test_cfg), which training never builds, are refused (they
are evaluate_detection.py's), and so is a method's hook given twice (a fragment in a _base_ list and as a --config).
A key of a --config file that the class its dict builds does not take (`optim_wrapper.optimizer.betas_`,
`train_cfg.max_epoch`; the model is checked down to its parts: backbone, neck, heads) is refused as the same
override is, naming the file, before the Runner is built; so is a top-level setting of MMDetection 2.x's configs
(`lr_config`, `runner`, `evaluation`, `checkpoint_config`, ...), which MMEngine's Runner does not read, naming the
key that replaced it. A file's own variables (`size`, `dims` of the sample config; a number under a 2.x name that
the file copies into a setting, `total_epochs` into train_cfg.max_epochs) are not settings and pass.

A work dir that already holds checkpoints is refused unless --resume continues the run in it (MMEngine's
`last_checkpoint`), so no run overwrites another's epoch_N.pth, and so is one holding a file named as the config dump
MMEngine writes there (the first --config's name), and a new run's work dir that holds files no run of this script
writes (another program's run, such as train.py's checkpoint.pt and metrics.jsonl; as train.py refuses an out_dir of
this script's files); so is a second command while a run holds the work dir (`<work-dir>/.run.lock`, as train.py's
out_dir), before it writes anything there. A new run records its merged settings, once its runner is built, in
`<work-dir>/train_detection_config.json` (a start that fails before its first checkpoint, by an exception or Ctrl-C,
removes that file and the config dump again, so the corrected command may use the same work dir; a SIGTERM, or any
signal that ends the process without an exception, leaves both: move them away, or give a new work dir, to start it with
other settings); --resume refuses other settings than those (only train_cfg.max_epochs may change, to extend the
schedule), `load_from` (it resumes the work dir's own last checkpoint), and a last_checkpoint that points outside the
work dir or to a missing file. Checkpoints keep the random-number state (engine.detection.RngStateHook), so a resumed
run in one process without persistent loader workers ends bit for bit where the uninterrupted one does, and so does one
under torchrun (every rank's state is kept) on the same number of ranks; in an epoch loop persistent workers start over
from their first seeds (an iteration loop fetches its trained batches again through them: exact), and a resume on
another number of ranks trains at another global batch: such a resume is not exact, and says so in a warning
(docs/operations.md, "Detection runs"). A resume takes every weight from the checkpoint and reads no backbone file
(model.backbone.init_cfg's may have moved). Under torchrun every rank checks the data and the work dir as it sees them,
and one rank's refusal ends every rank. The batch per GPU is the config's (2 images, 16 in all on 8 GPUs, the official
setting); with fewer GPUs add `auto_scale_lr.enable=True` to scale the lr. The shipped Swin configs train with fp16 AMP
(AmpOptimWrapper), which MMEngine runs on a GPU only: on the CPU add `optim_wrapper.type=OptimWrapper` (fp32).
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import sys
import warnings
import zipfile

# MMEngine 0.10 imports pkg_resources, of which setuptools 80 warns at each import: two warnings (four lines) on
# stderr before this command's own output, a one-line refusal too; not this command's to act on
warnings.filterwarnings("ignore", message="pkg_resources is deprecated as an API", category=UserWarning)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs.cli import OneLineParser, first_line  # noqa: E402


def parse_args(argv):
    parser = OneLineParser(description=first_line(__doc__))  # one paragraph, wrapped to the terminal
    parser.add_argument("--config", action="append", required=True,
                        help="MMDetection config; repeat to merge fragments in order (a method: "
                             "configs/detection/method/*.py)")
    parser.add_argument("--work-dir", required=True, help="where checkpoints and logs go")
    parser.add_argument("--data-root", help="COCO folder (annotations/, train2017/, val2017/)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --work-dir from its last checkpoint")
    parser.add_argument("--launcher", choices=("none", "pytorch", "slurm"), default="none",
                        help="pytorch under torchrun, slurm under srun (default: %(default)s, one process)")
    parser.add_argument("--local-rank", "--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value (MMEngine's --cfg-options)")
    parser.add_argument("--cfg-options", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="config overrides as MMDetection's tools take them (the same as bare key=value)")
    args = parser.parse_intermixed_args(argv)  # overrides before, between and after the flags, as evaluate.py
    args.overrides += args.cfg_options
    return args


@contextlib.contextmanager
def owning_work_dir(work_dir: str, launcher: str):
    """Hold the work dir's lock (engine/run_dir.py: `<work-dir>/.run.lock`, released when the process ends) on
    global rank 0 for the duration of the block, or raise RunDirError: a second command in the same work dir
    (two new runs started at the same moment, or a --resume beside the running run) is refused before it writes
    anything there, so it neither trains into the other's checkpoints nor removes its config dump
    (`removing_failed_start_files`). The other ranks belong to rank 0's run and leave the lock to it."""
    if launcher_rank(launcher) != "0":
        yield
        return
    from engine.run_dir import lock_folder, make_folder
    make_folder(work_dir, "--work-dir")
    with lock_folder(work_dir, "--work-dir"):
        yield


def launcher_rank(launcher: str) -> str:
    """This process's global rank before MMEngine's Runner starts: torchrun sets RANK, while srun sets only
    SLURM_PROCID, which MMEngine copies into RANK inside the Runner (init_dist), too late for the work dir's lock."""
    if "RANK" in os.environ or launcher != "slurm":
        return os.environ.get("RANK", "0")
    return os.environ.get("SLURM_PROCID", "0")


def launcher_world(launcher: str) -> int:
    """The number of ranks the launcher started, before MMEngine's init_dist reads it: torchrun's WORLD_SIZE, or
    srun's SLURM_NTASKS under --launcher slurm (MMEngine sets WORLD_SIZE from it); 1 without either."""
    from engine.distributed import launched_world_size

    return launched_world_size("SLURM_NTASKS" if launcher == "slurm" and "WORLD_SIZE" not in os.environ
                               else "WORLD_SIZE")


def checkpoint_files(work_dir: str) -> list:
    """The checkpoints MMEngine wrote into `work_dir` (epoch_N.pth, iter_N.pth, its last_checkpoint pointer)."""
    return glob.glob(os.path.join(work_dir, "*.pth")) + glob.glob(os.path.join(work_dir, "last_checkpoint"))


def check_checkpointing(cfg, work_dir: str) -> None:
    """Refuse checkpoint settings this script's guarantees do not hold for: checkpoints written outside --work-dir
    (MMEngine's CheckpointHook out_dir puts them into <out_dir>/<name of the work dir>, where another run of that
    name writes over them and which --resume refuses to read), and iteration checkpoints of an epoch loop
    (MMEngine 0.10 resumes those at the start of their epoch: the part already trained is trained again). The hook
    saves by iteration for any false by_epoch (0, None), as MMEngine's loop builder takes any false by_epoch of a
    train_cfg without a type for an IterBasedTrainLoop."""
    from engine.detection import DetectionError
    hook = (cfg.get("default_hooks") or {}).get("checkpoint") or {}
    out_dir = hook.get("out_dir")
    if out_dir and os.path.abspath(os.path.join(out_dir, os.path.basename(os.path.normpath(work_dir)))) != \
            os.path.abspath(work_dir):
        raise DetectionError(f"default_hooks.checkpoint.out_dir={out_dir}: the checkpoints would go to "
                             f"{os.path.join(out_dir, os.path.basename(os.path.normpath(work_dir)))}, outside "
                             f"--work-dir {work_dir}, where a run of another work dir of that name writes over them "
                             "and which --resume does not read: drop it (the checkpoints go into --work-dir)")
    by_epoch = hook.get("by_epoch", True)
    if not by_epoch and epoch_loop(cfg.get("train_cfg") or {}):
        raise DetectionError(f"default_hooks.checkpoint.by_epoch={by_epoch!r} with an EpochBasedTrainLoop: the hook "
                             "saves by iteration, and MMEngine resumes an iteration checkpoint at the start of its "
                             "epoch and trains that epoch's first iterations again; keep checkpoints by epoch "
                             "(by_epoch=True), or train with an IterBasedTrainLoop")


def epoch_loop(train_cfg) -> bool:
    """Whether MMEngine's Runner builds an EpochBasedTrainLoop from `train_cfg` (Runner.build_train_loop): its
    `type`, by name with or without a registry scope, or where it has none its by_epoch."""
    from cd.integrations.mmengine import type_name
    kind = train_cfg.get("type")
    if kind is None:
        return bool(train_cfg.get("by_epoch", True))
    return type_name(kind) == "EpochBasedTrainLoop"


# the log folder MMEngine's Runner makes in the work dir at each start, named by its timestamp (Runner.timestamp)
LOG_FOLDER = re.compile(r"\d{8}_\d{6}")


def foreign_files(work_dir: str, dump: str) -> list:
    """What `work_dir` holds that no run of this script writes there (engine.run_dir.earlier_run_files, less the
    settings file and its temporary, the config dump `dump`, the Runner's timestamped log folders and the
    checkpoints, which check_work_dir judges on their own): another program's run (train.py's checkpoint.pt,
    best.pt, config.yaml, metrics.jsonl), a data set, anything of the user's. Beside a settings file, every
    top-level *.py file is a config dump too: an earlier start of this script (ended by a SIGTERM before its first
    checkpoint) may have had another first --config, so its dump has another name than `dump`; whether that run's
    settings are this one's is check_settings' question. Sorted names; [] for no folder."""
    from engine.run_dir import earlier_run_files
    if not os.path.isdir(work_dir):
        return []
    ours = {SETTINGS_FILE, dump, "last_checkpoint"}
    dumps = os.path.isfile(os.path.join(work_dir, SETTINGS_FILE))  # a folder of this script's run
    return [name for name in earlier_run_files(work_dir)
            if name not in ours and not name.endswith(".pth")
            and not (dumps and name.endswith(".py") and os.path.isfile(os.path.join(work_dir, name)))
            # record_settings' temporary (write_whole's partial_path; an earlier version's <name>.<pid>.tmp), left by
            # a start that a signal ended mid-write
            and not re.fullmatch(rf"{re.escape(SETTINGS_FILE)}(\.\d+\.tmp|\.partial-[0-9a-f]{{8}}-\d+-[0-9a-f]{{8}})",
                                 name)
            and not (LOG_FOLDER.fullmatch(name) and os.path.isdir(os.path.join(work_dir, name)))]


def check_work_dir(work_dir: str, resume: bool, dump: str) -> None:
    """Refuse to start a new run over an old one's checkpoints or in a folder of files no run of this script wrote
    (`foreign_files`; `dump`: the name of the Runner's config dump), as train.py refuses an out_dir of another
    run's files, and to resume where there is nothing."""
    from engine.detection import DetectionError
    if os.path.exists(work_dir) and not os.path.isdir(work_dir):
        raise DetectionError(f"--work-dir {work_dir} is a file: give a folder")
    checkpoints = checkpoint_files(work_dir)
    if checkpoints and not resume:
        raise DetectionError(f"--work-dir {work_dir} holds checkpoints of an earlier run "
                             f"({os.path.basename(sorted(checkpoints)[0])}, ...): give --resume to continue it, "
                             "or a new --work-dir")
    foreign = [] if resume else foreign_files(work_dir, dump)
    if foreign:  # e.g. train.py's run folder: the detector's checkpoints and logs would be mixed into its files
        shown = ", ".join(foreign[:6]) + (f" and {len(foreign) - 6} more" if len(foreign) > 6 else "")
        raise DetectionError(f"--work-dir {work_dir} holds files no run of this script writes ({shown}): another "
                             "program's run or other data, which a detector's run would mix its checkpoints and "
                             "logs into; give a new --work-dir, or move them away")
    if resume and not os.path.isfile(os.path.join(work_dir, "last_checkpoint")):
        raise DetectionError(f"--resume: --work-dir {work_dir} has no last_checkpoint to continue from")


SETTINGS_FILE = "train_detection_config.json"
SET_BY_SCRIPT = ("work_dir", "launcher", "resume")  # from the flags; not settings of the run
# what load_config did with it is in optim_wrapper.optimizer.weight_decay, which is compared: a run started before
# the CD fragment had the key resumes, and one whose weight decay the key would change does not
NOT_COMPARED = SET_BY_SCRIPT + ("cd_budget",)
MAY_CHANGE_ON_RESUME = ("train_cfg.max_epochs",)


def run_settings(cfg) -> dict:
    """The merged config of a run as flat dotted keys -> repr of the value (dicts flattened, lists whole), the
    keys this script sets from its flags and cd_budget (NOT_COMPARED) left out."""
    flat: dict = {}

    def walk(prefix, value):
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            flat[prefix] = repr(value)
    walk("", {k: v for k, v in cfg.to_dict().items() if k not in NOT_COMPARED})
    return flat


def check_settings(work_dir: str, settings: dict) -> None:
    """Refuse a new run in a `work_dir` whose settings file records another run (started, not yet checkpointed)."""
    from engine.detection import DetectionError
    path = os.path.join(work_dir, SETTINGS_FILE)
    if os.path.exists(path) and stored_settings(path) != settings:
        raise DetectionError(f"--work-dir {work_dir} holds {SETTINGS_FILE} of a run with other settings: give a "
                             "new --work-dir, or move the file away")


def record_settings(work_dir: str, settings: dict) -> None:
    """Write a new run's settings into `work_dir` once its runner has been built (a start that fails by an exception
    before its first checkpoint removes it again, removing_failed_start_files, so the corrected command may use the
    same folder; a SIGTERM leaves it), never over an existing file: one with the
    same settings (the same run started again before its first checkpoint, or another rank of it) is kept,
    another is refused."""
    from engine.run_dir import RunDirError, write_whole
    path = os.path.join(work_dir, SETTINGS_FILE)
    os.makedirs(work_dir, exist_ok=True)
    if not os.path.exists(path):

        def write(temporary: str) -> None:
            with open(temporary, "w") as f:
                json.dump(settings, f, indent=1, sort_keys=True)

        # a temporary file, fsync and a hard link (atomic, and refused where another rank was first): a start that
        # fails or is cut off mid-write leaves no half file under the settings file's name, which check_settings
        # and --resume would read as the run's
        try:
            write_whole(path, write, overwrite=False)
        except RunDirError:
            if not os.path.exists(path):  # not another rank's file: a path write_whole cannot write
                raise
    check_settings(work_dir, settings)


def stored_settings(path: str) -> dict:
    """The settings file at `path`, or one error line naming it."""
    from engine.detection import DetectionError
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise DetectionError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None


def check_resume(work_dir: str, settings: dict, overrides: dict) -> None:
    """Refuse a --resume that would continue under other settings than the run's, or from another run's
    checkpoint: MMEngine restores the weights, optimizer and scheduler and silently keeps the new config."""
    from engine.detection import DetectionError
    path = os.path.join(work_dir, SETTINGS_FILE)
    # the load_from the run started from, given again (the same command with --resume), says nothing new
    if "load_from" in overrides and not (os.path.isfile(path) and
                                         stored_settings(path).get("load_from") == settings.get("load_from")):
        raise DetectionError("load_from with --resume: --resume continues the run in --work-dir from its own "
                             "last checkpoint; start a new --work-dir to train from other weights")
    if not os.path.isfile(path):
        raise DetectionError(f"--resume: --work-dir {work_dir} has no {SETTINGS_FILE}, so it holds no run of this "
                             "script to continue: give a new --work-dir")
    stored = stored_settings(path)
    differ = sorted(k for k in set(stored) | set(settings)
                    if stored.get(k) != settings.get(k) and k not in MAY_CHANGE_ON_RESUME)
    if differ:
        shown = ", ".join(f"{k} ({stored.get(k, 'unset')} in the run, {settings.get(k, 'unset')} now)"
                          for k in differ[:3])
        raise DetectionError(f"--resume: the run in {work_dir} has other settings: {shown}"
                             f"{f' and {len(differ) - 3} more' if len(differ) > 3 else ''}; resume with the same "
                             "--config, overrides and --data-root (train_cfg.max_epochs may change), or start a "
                             "new --work-dir")
    pointer = os.path.join(work_dir, "last_checkpoint")
    with open(pointer) as f:
        target = f.read().strip()
    from engine.run_dir import is_inside
    inside = is_inside(target, work_dir)
    if not inside or not os.path.isfile(target):
        raise DetectionError(f"--resume: {pointer} points to {target}, "
                             f"{'which does not exist' if inside else 'outside the work dir'}: restore the run's "
                             "checkpoint, or start a new --work-dir")
    if not zipfile.is_zipfile(target):  # torch.save's zip archive ends with its directory: a cut-off file lacks it
        raise DetectionError(f"--resume: {target} (the run's last checkpoint) is truncated or corrupt, not a torch "
                             "checkpoint: restore it, point last_checkpoint at an earlier epoch_N.pth of the run, "
                             "or start a new --work-dir")
    done = re.fullmatch(r"epoch_(\d+)\.pth", os.path.basename(target))  # MMEngine's name: the epochs trained
    max_epochs = settings.get("train_cfg.max_epochs", "None")
    # at or below the epochs trained MMEngine trains none and exits 0: a finished run resumed (a requeue of a run
    # that ended) or one asked to be shorter than it is; an unfinished run (fewer epochs trained) resumes
    if done and max_epochs.isdigit() and int(max_epochs) <= int(done.group(1)):
        raise DetectionError(f"--resume: train_cfg.max_epochs={max_epochs}, but the run in {work_dir} has already "
                             f"trained {done.group(1)} epochs ({os.path.basename(target)}), so nothing is left to "
                             f"train: give a larger train_cfg.max_epochs (at least {int(done.group(1)) + 1}) to "
                             "extend the run")
    # an iteration loop's finished run alike (IterBasedTrainLoop: iter_N.pth); its max_iters cannot change on resume
    done = re.fullmatch(r"iter_(\d+)\.pth", os.path.basename(target))
    max_iters = settings.get("train_cfg.max_iters", "None")
    if done and max_iters.isdigit() and int(max_iters) <= int(done.group(1)):
        raise DetectionError(f"--resume: the run in {work_dir} has trained all its train_cfg.max_iters={max_iters} "
                             f"iterations ({os.path.basename(target)}), so nothing is left to train: its weights are "
                             f"{target}; start a new --work-dir to train longer")


def check_config_dump(work_dir: str, cfg) -> None:
    """Refuse a new run where MMEngine's config dump (`<work-dir>/<name of the first --config>`) would overwrite a
    file this script did not write (the settings file marks a folder of this run)."""
    from engine.detection import DetectionError
    dump = os.path.join(work_dir, os.path.basename(cfg.filename))
    if os.path.exists(dump) and not os.path.isfile(os.path.join(work_dir, SETTINGS_FILE)):
        raise DetectionError(f"--work-dir {work_dir} holds {os.path.basename(dump)}, which MMEngine would overwrite "
                             "with the run's config: give a new --work-dir, or move the file away")


@contextlib.contextmanager
def removing_failed_start_files(work_dir: str, cfg, new_run: bool, launcher: str):
    """A new run that fails before its first checkpoint (while its Runner and loops are built, or inside
    runner.train(): out of memory, a setting that fails in the first iterations; an exception, KeyboardInterrupt
    included, but not a SIGTERM or another signal whose default action ends the process without unwinding this
    block: those leave both files, and the corrected command with other settings is refused until they are moved
    away) removes the files of the work dir that this command wrote and that would refuse the corrected command
    there: MMEngine's config dump (written when the Runner is built; check_config_dump) and the settings file
    (record_settings; check_settings refuses other settings). A file that existed when the command started was not
    written by it and stays, and so does everything once a checkpoint exists: --resume continues that run and reads
    its settings file. The Runner's timestamped log folder stays: it holds the failed start's log and blocks nothing
    (nor does .run.lock: its lock ends with the process). Rank 0 looks before the
    Runner is built (its constructor waits for rank 0 to broadcast the log folder's timestamp, so no rank has
    written either file yet) and removes them."""
    paths = [os.path.join(work_dir, os.path.basename(cfg.filename)), os.path.join(work_dir, SETTINGS_FILE)]
    existed = {path: os.path.exists(path) for path in paths}
    try:
        yield
    except BaseException:
        if new_run and launcher_rank(launcher) == "0" and not checkpoint_files(work_dir):
            for path in paths:
                if not existed[path]:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)
        raise


def check_launcher(launcher: str) -> None:
    """Refuse --launcher none under torchrun: every rank would train its own copy of the model into one work
    dir; and a distributed launcher without a GPU: MMEngine 0.10 trains distributed on GPUs only (its
    init_dist calls torch.cuda.set_device, a traceback on a CPU machine)."""
    from engine.detection import DetectionError
    import torch
    world = os.environ.get("WORLD_SIZE", "1")
    ranks = int(world) if world.isdigit() else 1
    if (launcher != "none" or ranks > 1) and not torch.cuda.is_available():
        asked = f"--launcher {launcher}" if launcher != "none" else f"torchrun (WORLD_SIZE={world})"
        raise DetectionError(f"{asked} but no CUDA device is visible: MMEngine trains distributed on GPUs only; on "
                             "the CPU train in one process (python scripts/train_detection.py, --launcher none)")
    if launcher == "none" and world.isdigit() and int(world) > 1:
        raise DetectionError(f"--launcher none under torchrun (WORLD_SIZE={world}): every rank would train its own "
                             "copy into one --work-dir; add --launcher pytorch")


def check_amp(cfg) -> None:
    """Refuse an AMP optimizer wrapper (the shipped Swin configs' AmpOptimWrapper: the paper trains with fp16 AMP)
    on a machine without a device MMEngine's AMP runs on: its constructor asserts one when runner.train() builds
    it, after the config dump and the settings file were written, with an AssertionError traceback."""
    from cd.integrations.mmengine import type_name
    from engine.detection import DetectionError
    from mmengine.device import get_device
    from mmengine.optim import AmpOptimWrapper
    # by name (`mmengine.AmpOptimWrapper` too): the registry's look-up imports mmdet.engine, which needs compiled
    # mmcv; a subclass may run elsewhere (a CPU stand-in that skips the assertion) and is left to its constructor
    name = type_name((cfg.get("optim_wrapper") or {}).get("type"))
    # the devices AmpOptimWrapper.__init__ asserts (mps is not among them)
    if name == AmpOptimWrapper.__name__ and get_device() not in ("cuda", "npu", "mlu", "musa"):
        raise DetectionError(f"optim_wrapper.type={name} trains with AMP, which MMEngine runs on a GPU only, "
                             "and no GPU is visible: train on a GPU, or give optim_wrapper.type=OptimWrapper to "
                             "train in fp32 on the CPU")


def check_accumulation(cfg) -> None:
    """Refuse an optim_wrapper.accumulative_counts that is no whole number of at least 1 (0, -1, a bool, 2.0):
    MMEngine's OptimWrapper asserts a positive count when runner.train() builds it, after the config dump and the
    log folder were written, with an AssertionError traceback; a bool or a float it takes, and counts with."""
    from engine.detection import DetectionError
    wrapper = cfg.get("optim_wrapper") or {}
    # one wrapper, or MMEngine's several (an OptimWrapperDict's, one sub-dict per part of the model)
    found = [("optim_wrapper", wrapper)] + [(f"optim_wrapper.{key}", value) for key, value in wrapper.items()
                                            if isinstance(value, dict) and "accumulative_counts" in value]
    for name, part in found:
        counts = part.get("accumulative_counts", 1)
        if isinstance(counts, bool) or not isinstance(counts, int) or counts < 1:
            raise DetectionError(f"{name}.accumulative_counts={counts!r}: give a whole number of at least 1 (the "
                                 "iterations whose gradients add up to one optimizer step; 1 steps every iteration)")


def check_seed(cfg) -> None:
    """Refuse a randomness.seed MMEngine's Runner cannot seed numpy with (text, a negative number, past 2**32 - 1
    after randomness.diff_rank_seed adds the rank): a TypeError or ValueError traceback from inside the Runner,
    naming no setting."""
    from engine.detection import DetectionError
    randomness = cfg.get("randomness") or {}
    seed = randomness.get("seed")
    # with diff_rank_seed each rank seeds with seed + rank (torchrun sets WORLD_SIZE before this runs)
    ranks = int(os.environ.get("WORLD_SIZE", "1")) if randomness.get("diff_rank_seed") else 1
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 2 ** 32 - ranks):
        raise DetectionError(f"randomness.seed={seed!r}: give a whole number from 0 to 2**32 - {ranks}"
                             + (f" (randomness.diff_rank_seed adds each of the {ranks} ranks' index)" if ranks > 1
                                else "") + ", or None (a seed drawn at random)")


def check_log_level(cfg) -> None:
    """Refuse a log_level MMEngine's logger cannot set: a name logging does not know (`LOUD`, or `info`: MMLogger
    looks the name up in logging's table of capitalised names, a KeyError traceback from inside the Runner), or
    something that is neither a name nor a whole number (None, 1.5)."""
    import logging
    from engine.detection import DetectionError
    level = cfg.get("log_level", "INFO")
    names = logging._nameToLevel  # the table MMLogger indexes
    if isinstance(level, str) and level in names or isinstance(level, int) and not isinstance(level, bool):
        return
    shown = ", ".join(sorted(names, key=lambda name: (names[name], name)))
    raise DetectionError(f"log_level={level!r}: give one of logging's level names, in capitals ({shown}), or a "
                         "whole number")


def start_process_group(launcher: str, cfg) -> None:
    """Join the run's process group before the work dir is looked at, as MMEngine's Runner would once built
    (set_multi_processing, then init_dist with the config's env_cfg; the Runner takes a group that exists), so that
    a refusal on one rank ends every rank (`refuse_on_every_rank`) instead of leaving the others waiting in the
    Runner for it."""
    if launcher == "none":
        return
    from mmengine.dist import init_dist, is_distributed
    from mmengine.utils.dl_utils import set_multi_processing
    if is_distributed():  # a group made by the caller (the CPU tests' gloo group)
        return
    env = cfg.get("env_cfg") or {}
    set_multi_processing(**(env.get("mp_cfg") or {}), distributed=True)
    init_dist(launcher, **(env.get("dist_cfg") or {}))


def refuse_on_every_rank(refusal, resumes_from=None) -> None:
    """After checks that every rank makes on its own view of the files (a --work-dir on each node's own disk may
    hold the run on rank 0's node only): raise `refusal` on its rank and, on every other rank, one error naming
    the rank and its reason; and refuse a --resume whose ranks would continue from different checkpoints
    (`resumes_from`: this rank's last checkpoint, name and size). One all-gather; a no-op in one process."""
    import torch.distributed as dist
    from engine.detection import DetectionError
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        if refusal is not None:
            raise refusal
        return
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (None if refusal is None else f"{refusal}", resumes_from))
    if refusal is not None:
        raise refusal
    rank, reason = next(((r, reason) for r, (reason, _) in enumerate(seen) if reason is not None), (None, None))
    if reason is not None:
        raise DetectionError(f"rank {rank} cannot start: {reason}")
    if len({checkpoint for _, checkpoint in seen}) > 1:
        shown = ", ".join(f"rank {r} {name} ({size} bytes)" for r, (_, (name, size)) in enumerate(seen))
        raise DetectionError(f"--resume: the ranks would continue from different checkpoints: {shown}; give every "
                             "rank the same --work-dir (a folder all nodes share)")


def main(argv=None) -> int:
    args = parse_args(argv)
    check_launcher(args.launcher)
    from engine.detection import (check_annotation_files, check_annotations, check_backbone_init,
                                  check_evaluator_annotations, check_evaluator_thresholds, check_head_classes,
                                  check_hooks, check_image_folders,
                                  check_load_from, load_config, parse_overrides)

    overrides = parse_overrides(args.overrides)
    try:  # this node's config files, read before the ranks meet
        cfg = load_config(args.config, overrides, args.data_root, training_reads())
    except Exception as e:  # noqa: BLE001 - raised here after the others know, as a refusal of the checks below
        from engine.distributed import START_FAILURE_WAIT, tell_the_others_at_start
        error = e

        def join_and_tell() -> None:
            # the group as MMEngine makes it without the config's env_cfg (NCCL, its default and the configs'),
            # waiting for the others as long as train.py's and evaluate.py's ranks do
            start_process_group(args.launcher, {"env_cfg": {"dist_cfg": {
                "timeout": START_FAILURE_WAIT.total_seconds()}}})
            refuse_on_every_rank(error)

        tell_the_others_at_start(error, join_and_tell, launcher_rank(args.launcher),
                                 launcher_world(args.launcher) if args.launcher != "none" else 1)
    start_process_group(args.launcher, cfg)
    dump = os.path.basename(cfg.filename)  # the Runner's config dump in the work dir (check_config_dump)
    refusal = None
    data_warnings: list = []  # check_annotations': printed once the last check has passed (train_in_work_dir)
    try:
        check_hooks(cfg)
        check_seed(cfg)
        check_log_level(cfg)
        check_amp(cfg)
        check_accumulation(cfg)
        check_checkpointing(cfg, args.work_dir)
        source = args.data_root and f"--data-root {args.data_root}"
        check_annotation_files(cfg, source, ("train_dataloader", "val_dataloader", "val_evaluator"))
        check_image_folders(cfg, ("train_dataloader", "val_dataloader"), source)
        check_evaluator_annotations(cfg, "val")  # the epoch-end validation scores the val loader's predictions
        check_evaluator_thresholds(cfg, "val")
        data_warnings = check_annotations(cfg, ("train_dataloader", "val_dataloader"), source)
        check_head_classes(cfg)
        if not args.resume:
            check_backbone_init(cfg)
            check_load_from(cfg)
        check_work_dir(args.work_dir, args.resume, dump)  # before the folder is made: a wrong --resume leaves none
    except Exception as e:  # every rank ends, each with one error (a rank's own files may differ from rank 0's)
        refusal = e
    refuse_on_every_rank(refusal)
    with contextlib.ExitStack() as held:
        refusal = settings = resumes_from = None
        try:
            held.enter_context(owning_work_dir(args.work_dir, args.launcher))
            check_work_dir(args.work_dir, args.resume, dump)  # again: another run may have written there meanwhile
            settings, resumes_from = check_work_dir_files(args, cfg, overrides)
        except Exception as e:
            refusal = e
        refuse_on_every_rank(refusal, resumes_from)
        return train_in_work_dir(args, cfg, settings, data_warnings)


# the test loop's keys: Runner.train() builds the train and val loops only
TEST_ONLY = {"test_dataloader": "it to evaluate_detection.py, which scores test_dataloader with test_evaluator,",
             "test_evaluator": "it to evaluate_detection.py, which scores test_dataloader with test_evaluator,",
             "test_cfg": ""}  # evaluate_detection.py scores in its own loop, without MMEngine's TestLoop


def training_reads():
    """The config keys the training reads (check_override_keys): all a Runner reads but the test loop's, whose
    overrides were stored and never read."""
    from engine.detection import CommandReads, runner_keys
    from engine.detection.config import SCRIPT_FLAGS
    return CommandReads(frozenset(runner_keys() - set(TEST_ONLY)),
                        "the training trains on train_dataloader and validates on val_dataloader with val_evaluator "
                        "(MMEngine's Runner.train() builds no test loop)",
                        TEST_ONLY, frozenset(SCRIPT_FLAGS))


def check_work_dir_files(args, cfg, overrides) -> tuple:
    """The checks of the work dir's files, with the work dir held (`owning_work_dir`): the run's settings, and
    for --resume the name and size of the checkpoint it continues from (the ranks must agree on it)."""
    settings = run_settings(cfg)
    if args.resume:
        check_resume(args.work_dir, settings, overrides)
        with open(os.path.join(args.work_dir, "last_checkpoint")) as f:
            target = f.read().strip()
        return settings, (os.path.basename(target), os.path.getsize(target))
    check_config_dump(args.work_dir, cfg)
    check_settings(args.work_dir, settings)  # written once the runner is built (record_settings)
    return settings, None


def train_in_work_dir(args, cfg, settings: dict, data_warnings=()) -> int:
    """The training, with the work dir held and its files checked on every rank; check_annotations' `data_warnings`
    printed once the pipelines' check, the last that refuses, has passed."""
    from engine.detection import annotation_paths, check_pipeline, reading_annotations, RngStateHook
    from engine.detection.data_checks import print_warnings
    from engine.distributed import failure_on_every_rank
    from mmengine.dist import get_comm_device
    from mmengine.runner import Runner

    if args.resume:
        cfg.load_from = None  # MMEngine resumes from load_from when it is set, else from last_checkpoint
    cfg.work_dir = args.work_dir
    cfg.launcher = args.launcher
    cfg.resume = args.resume
    if args.resume or cfg.load_from:
        # MMEngine 0.10 checkpoints hold numpy / python objects that torch >= 2.6's weights_only load refuses;
        # these are the run's own files (check_work_dir), or a load_from file that check_load_from has read with
        # the full unpickler already, so it is no less safe here.
        os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with removing_failed_start_files(args.work_dir, cfg, new_run=not args.resume, launcher=args.launcher):
        runner = Runner.from_cfg(cfg)
        if args.resume:
            # Runner.train() initialises the weights before it resumes (the backbone from its Pretrained file, which
            # may have moved since the run started, FileNotFoundError) and then loads every one of them from the
            # run's own checkpoint, a state_dict of the same model (check_resume): no initialised weight is left
            runner._init_model_weights = lambda: None
        keeper = RngStateHook()  # checkpoints keep every rank's random-number state: --resume continues exactly
        runner.register_hook(keeper)
        runner.register_hook(keeper.gatherer)
        # The loops read the annotation files when they are built, which runner.train() does unless the
        # properties did it first: here, so that an unreadable file or a setting that cannot be built is one
        # error line naming it.
        with reading_annotations(annotation_paths(cfg, "train_dataloader", "val_dataloader", "val_evaluator"),
                                 built="train_dataloader, val_dataloader or val_evaluator"):
            runner.train_loop, runner.val_loop  # noqa: B018 - built for their side effect
        # a transform's setting of the wrong type fails only on an image: one now, not a traceback at the first
        # step (or, for the val loader, after an epoch); each rank runs its node's first image, and one that fails
        # ends the others with it (they would wait in the first step's collective for a rank that is gone)
        with failure_on_every_rank(get_comm_device(), "checking the loaders' pipelines on its first images"):
            check_pipeline(runner.train_loop.dataloader.dataset, "train_dataloader")
            check_pipeline(runner.val_loop.dataloader.dataset, "val_dataloader")
        print_warnings(data_warnings)  # on rank 0
        if not args.resume:
            record_settings(args.work_dir, settings)
        runner.train()
    return 0


def run(argv=None) -> None:
    """main() with bad input reported as one `error:` line and exit code 2."""
    from engine.distributed import OtherRankError
    try:
        sys.exit(main(argv))
    except (ValueError, OtherRankError) as e:  # DetectionError (engine/detection/errors.py), a bad override
        # (parse_overrides); under torchrun, another rank's failure (that rank prints why)
        from engine.runinfo import exit_with_error
        exit_with_error(str(e), code=2)  # one write: under torchrun the ranks share stderr


if __name__ == "__main__":
    run()
