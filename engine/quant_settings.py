"""What a quantized result depends on besides the float model and the val set: the settings evaluate.py records
with every entry of a result file (engine/eval_results.py compares them before it skips or adds a result) and a
table compares with the defaults (engine/result_table.nondefault_settings).

    settings = quant_settings(cfg, "repq")  # {"options": {...}, "calibration": {...}, ...}

The options are those the pipeline reads: one that the config's rules (configs/loader.py READ_ONLY_WHEN) say is
unread under the others (quant.aphq.recon_images at iters=0) is left out (engine/eval_results.py `read_options`),
as the result does not depend on it. A scheme that changed while its options stayed is recorded beside them
(the pipeline's `scheme_settings`, quant/pipeline_base.py), so that an entry of the older scheme reads as computed
with other settings. The training split a folder data set's calibration batch (or APHQ's and GPLQ's own images) is
drawn from is named by its files too (`train_folder_fingerprint`), as a token data set's by its file's content: the
split exported again under the same name is another batch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os

from configs import Config
from data.folder import find_split, read_extensions
from data.text import FINGERPRINT_HEAD_BYTES, token_file_fingerprint
from data.transforms import train_transform_settings
from quant import PIPELINES, run_settings
from quant.plan import pipeline_options, reads_calibration_batch

from .eval_results import read_options
from .tasks import task_for


def quant_settings(cfg: Config, pipeline: str, files: bool = True) -> dict:
    """Everything a quantized result depends on besides the float model and the val set: the options, the
    calibration batch where the pipeline reads it (RTN reads no data; APHQ and GPLQ draw their own images on
    a classifier), and the training transform where it sees training-transform images. `files` False leaves out
    what is read from the data's files (a folder's train split, a token train file): a default config's settings
    (result_table.nondefault_settings), which name no files."""
    options = pipeline_options(cfg, pipeline)
    # the values used where a null option means a default (percentile's levels): a later default is another setting
    recorded = PIPELINES[pipeline].recorded_options(options) if options is not None else None
    settings = {"options": read_options(pipeline, dataclasses.asdict(recorded)) if options is not None else {},
                **(PIPELINES[pipeline].scheme_settings(options) if options is not None else {})}
    reads_batch = reads_calibration_batch(pipeline, task_for(cfg.data.dataset).language)
    if reads_batch:
        settings["calibration"] = {"images": cfg.quant.calib_images, "seed": cfg.quant.calib_seed,
                                   **train_split(cfg), "transform": cfg.quant.calib_transform}
        if cfg.data.dataset == "tokens" and files:  # the windows are read from the train file: its content
            settings["calibration"]["train_file"] = token_file_fingerprint(cfg.data, "train")
    if sees_training_transform(cfg, pipeline):
        settings["train_transform"] = training_data(cfg)
    # the images drawn from the train split: its files (a config without a data.root names none: nothing can read it,
    # evaluate.py refuses it, and a default Config()'s settings are compared by the tables)
    if cfg.data.dataset == "folder" and files and cfg.data.root:
        for part in ("calibration", "train_transform"):
            if part in settings:
                settings[part]["train_files"] = train_folder_fingerprint(cfg.data.root, cfg.data.train_split)
    if PIPELINES[pipeline].trains_model:  # dropout and stochastic depth act in its training
        settings["model_training"] = train_mode_settings(cfg)
    return {**settings, **run_settings(pipeline)}  # GPLQ: the number of ranks its stage 1 trained on


def sees_training_transform(cfg: Config, pipeline: str) -> bool:
    """Whether `pipeline` calibrates or trains on training-transform images (of an image classifier)."""
    if task_for(cfg.data.dataset).language:
        return False
    return PIPELINES[pipeline].draws_training_images or (
        reads_calibration_batch(pipeline, False) and cfg.quant.calib_transform == "train")


def train_mode_settings(cfg: Config) -> dict:
    """The model's settings that act in training mode only (configs.schema.TRAIN_MODE_MODEL_KEYS)."""
    return {"drop": cfg.model.drop, "drop_path": cfg.model.drop_path}


def training_data(cfg: Config) -> dict:
    """The training split and its transform: what training-transform images depend on besides their seed."""
    return {**train_split(cfg), **train_transform_settings(cfg.data)}


# (split path, what tells a change of its listing) -> train_folder_fingerprint's value: evaluate.py asks for it at
# each planned and each written result, and walking ImageNet's training split takes a while
_FOLDER_PRINTS: dict = {}


def train_folder_fingerprint(root: str, split: str) -> dict:
    """What tells a folder data set's training split from one exported again under its name, read cheaply (file
    names and sizes, no pixels): the number of image files (timm's extensions) and the SHA-256 of their sorted paths
    relative to the split, each with its size in bytes (hidden folders aside); a .tar split: its size and the SHA-256
    of its first MiB, as a token file's (data/text.py). Remembered in this process while the split's folder and its
    class folders keep their modification times (which adding, removing or renaming a file in them changes)."""
    path = find_split(root, split)
    if not os.path.isdir(path):
        with open(path, "rb") as f:
            head = f.read(FINGERPRINT_HEAD_BYTES)
        return {"bytes": os.path.getsize(path), "head_sha256": hashlib.sha256(head).hexdigest()}
    with os.scandir(path) as entries:
        listing = (os.path.realpath(path), os.stat(path).st_mtime_ns,  # a relative root read from another folder
                   tuple(sorted((e.name, e.stat().st_mtime_ns) for e in entries if e.is_dir())))
    if listing in _FOLDER_PRINTS:
        return dict(_FOLDER_PRINTS[listing])
    extensions, prefix, rows = read_extensions(), os.path.join(path, ""), []
    for folder, dirs, names in os.walk(path, followlinks=True):  # as timm's folder reader walks it
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if name.lower().endswith(extensions):
                full = os.path.join(folder, name)
                rows.append(f"{full[len(prefix):]}\t{os.path.getsize(full)}")  # sliced: relpath is slow
    # surrogateescape: a name the locale cannot decode is hashed as its bytes on disk, under any locale
    text = "\n".join(sorted(rows)).encode("utf-8", "surrogateescape")
    _FOLDER_PRINTS[listing] = {"images": len(rows), "files_sha256": hashlib.sha256(text).hexdigest()}
    return dict(_FOLDER_PRINTS[listing])


def train_split(cfg: Config) -> dict:
    """The training split images are drawn from: its name and, for synthetic data, its size. The calibration batch
    and APHQ's and GPLQ's images are a seeded permutation of the whole split (data.loader.calibration_images), so
    another data.synthetic_train_size is another batch. An entry written before the size was recorded lacks it
    and reads as computed with other settings (--recompute), as one without the token train file's content."""
    size = {"synthetic_train_size": cfg.data.synthetic_train_size} if cfg.data.dataset == "synthetic" else {}
    return {"split": cfg.data.train_split, **size}

