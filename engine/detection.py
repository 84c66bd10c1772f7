"""The detection task on MMDetection 3.x: its configs, detectors, COCO loaders and metric, for
scripts/train_detection.py and evaluate_detection.py.

MMDetection does the detection work (models, data pipelines, training loop, pycocotools mAP); this module
only adds what this repository promises around it: configs merged from several files with `key=value`
overrides, one `--data-root` for every loader and evaluator, clear errors before any work (a missing data
set, an unset or remote backbone checkpoint, weights of another model), and an evaluation loop with
activation probes and the quantization seam (`DetectorFeed`, a `quant.calibrate.ModelFeed`).

Importing this module imports mmdet (an optional dependency: requirements-detection.txt), which needs full
mmcv with its compiled ops (scripts/install_mmcv.sh).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import importlib
import inspect
import io
import json
import os
import random
import re
import tempfile
import time
from typing import Any, Dict, FrozenSet, List, Mapping, NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import nn

from engine.act_max import ActivationProbe
from engine.distributed import all_reduce, run_on_main
from models.modules import nonfinite_tensors

try:
    importlib.import_module("mmdet")  # registers MMDetection's modules, transforms and metrics
    from mmengine.config import Config, DictAction
    from mmengine.evaluator import Evaluator
    from mmengine.hooks import Hook
    from mmengine.dataset import pseudo_collate
    from mmengine.registry import init_default_scope
    from mmengine.optim import AmpOptimWrapper, OptimWrapper
    from mmengine.runner import Runner
    from mmdet.registry import DATASETS, METRICS, MODELS

    from cd.integrations.mmengine import apply_weight_decay_budget  # imports mmengine
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(f"the detection task needs MMDetection and full mmcv ({e}): "
                      "pip install -r requirements-detection.txt && bash scripts/install_mmcv.sh") from e

BACKBONE = ("backbone",)
HEADS = ("neck", "rpn_head", "roi_head")
METRIC_KEYS = ("bbox_mAP", "bbox_mAP_50", "bbox_mAP_75", "segm_mAP", "segm_mAP_50", "segm_mAP_75")
LOADERS = ("train_dataloader", "val_dataloader", "test_dataloader")
EVALUATORS = ("val_evaluator", "test_evaluator")


class DetectionError(ValueError):
    """Bad detection input (config, data root, checkpoint), reported as one line before any work."""


# -- configs -------------------------------------------------------------------------------------------

class CommandReads(NamedTuple):
    """What a command other than a Runner's training reads of a config (evaluate_detection.py): its top-level
    `keys`, what it `does` with them (for the message), and `instead`: keys it does not read (a top-level one,
    or a dotted one under a key it reads) with what to give in their place ('' : nothing, drop it)."""
    keys: FrozenSet[str]
    does: str
    instead: Mapping[str, str]

    def unread(self, key: str) -> Optional[str]:
        """The part of the dotted override `key` that the command does not read, or None."""
        top = key.split(".")[0]
        named = next((k for k in self.instead if key == k or key.startswith(k + ".")), None)
        return named or (top if top not in self.keys else None)


def load_config(paths: Sequence[str], overrides: Optional[Dict[str, Any]] = None,
                data_root: Optional[str] = None, reads: Optional[CommandReads] = None) -> Config:
    """The MMDetection config of `paths` merged in order (later files update earlier ones: dicts merge, lists
    are replaced, except that each file's `custom_hooks` are added to the earlier ones and its
    `custom_imports.imports` joined with theirs, so that two method fragments both apply), then `overrides`
    (dotted keys, as MMEngine's --cfg-options), then `data_root`. `reads`: the keys the command reads, where
    it is not a Runner's training (check_override_keys)."""
    if not paths:
        raise DetectionError("no --config given: name an MMDetection config, e.g. configs/detection/"
                             "mask_rcnn_swin_t_1x.py")
    for path in paths:
        if not os.path.isfile(path):
            raise DetectionError(f"--config {path}: no such file")
    from configs.cli import named_twice
    # a method fragment given twice adds its hook twice (merge_fragment): CD failed at the first step, after the
    # run's config dump and settings file were written
    problem = named_twice("--config", [os.path.realpath(p) for p in paths])
    if problem:
        raise DetectionError(problem)
    cfg = read_config(paths[0])
    for path in paths[1:]:
        merge_fragment(cfg, read_config(path).to_dict())
    model = cfg.get("model")
    if not isinstance(model, dict) or "type" not in model:  # a method fragment alone, a train.py YAML recipe
        raise DetectionError(f"--config {' '.join(paths)}: no MMDetection detector in it (a `model` dict with a "
                             "`type`): give a detector config first, e.g. configs/detection/mask_rcnn_swin_t_1x.py, "
                             "and a method fragment (configs/detection/method/) after it")
    if overrides:
        check_override_keys(cfg, overrides, reads)
        try:
            cfg.merge_from_dict(dict(overrides))
        except TypeError as e:  # a dict given where the config has another value (MMEngine's message says how)
            raise DetectionError(f"overrides {' '.join(overrides)}: {e}") from None
    if data_root is not None:
        set_data_root(cfg, data_root, keep=overrides or {})
    try:
        apply_weight_decay_budget(cfg)  # after the overrides, so that a lam or weight decay given moves it
    except ValueError as e:
        raise DetectionError(str(e)) from None
    init_default_scope(cfg.get("default_scope", "mmdet"))
    return cfg


def read_config(path: str) -> Config:
    """The config file `path`, or one error line naming it."""
    try:
        return Config.fromfile(path)
    except Exception as e:  # noqa: BLE001 - MMEngine executes the file: any error in it (syntax, a missing
        # _base_, not Python at all) is the same one-line error about that file
        raise DetectionError(f"--config {path}: cannot be read ({type(e).__name__}: {e})") from None


def merge_fragment(cfg: Config, fragment: Dict[str, Any]) -> None:
    """Merge a later --config file into `cfg` as MMEngine does, but add its `custom_hooks` to those `cfg` has
    and join its `custom_imports.imports` with them: MMEngine replaces lists, so the second method fragment
    (each is a hook) would drop the first one's hook while keeping its other settings."""
    fragment = copy.deepcopy(fragment)
    hooks = fragment.pop("custom_hooks", None)
    imports = fragment.get("custom_imports", {}).get("imports")
    earlier = (cfg.get("custom_imports") or {}).get("imports") or []
    if imports is not None:
        imports = [imports] if isinstance(imports, str) else list(imports)
        fragment["custom_imports"]["imports"] = list(earlier) + [i for i in imports if i not in earlier]
    cfg.merge_from_dict(fragment)
    if hooks:
        cfg.custom_hooks = list(cfg.get("custom_hooks") or []) + list(hooks)


def parse_overrides(items):
    """`key=value` items as MMEngine's --cfg-options parses them (numbers, bools, None, lists, tuples)."""
    namespace = argparse.Namespace()
    for item in items:
        if "=" not in item:
            raise DetectionError(f"{item!r}: config overrides are key=value")
    DictAction(option_strings=[], dest="options")(None, namespace, items)
    return getattr(namespace, "options", {})


# keys the entry points set from their own flags: an override of them would be overwritten or never read
SCRIPT_FLAGS = {"work_dir": "--work-dir", "launcher": "--launcher", "resume": "--resume", "data_root": "--data-root"}
# top-level keys MMEngine's Runner reads from the config besides its arguments (Runner.wrap_model, .train)
READ_BY_RUNNER = ("model_wrapper_cfg", "sync_bn", "find_unused_parameters", "activation_checkpointing",
                  "efficient_conv_bn_eval", "compile")
READ_BY_LOAD_CONFIG = ("cd_budget",)  # apply_weight_decay_budget reads it after the overrides
LOOP_KEYS = ("train_cfg", "val_cfg", "test_cfg")  # MMEngine's loops: epoch, iteration and interval counts
POSITIVE_LOOP_COUNTS = ("max_epochs", "max_iters", "val_interval")  # counts MMEngine's loops need >= 1
# dicts whose keys their readers take as they come (hook names, environment settings)
OPEN_DICTS = ("default_hooks", "env_cfg")
# keys a builder takes out of a module's dict before calling its class (MMEngine's hooks and optim wrapper)
BUILDER_KEYS = {"*": ("priority",), "optim_wrapper": ("constructor", "paramwise_cfg")}


def check_override_keys(cfg: Config, overrides: Dict[str, Any], reads: Optional[CommandReads] = None) -> None:
    """Refuse an override that would be stored and then ignored, each with what to do instead: a key the entry
    point sets from a flag (work_dir, launcher, resume, data_root); a top-level key neither the config nor
    MMEngine's Runner knows (a typo such as `max_epoch=3`); a top-level variable of the config files
    (`max_epochs=3`: already copied into train_cfg when the files were parsed); a top-level key that a command
    other than a Runner's training does not read (`reads`: load_from or train_cfg in an evaluation); and a
    deeper key the config does not have, unless what reads its dict takes it: a dict with a `type` builds a
    registered class, whose __init__ must take the key (or **kwargs); a loader's dict is torch's DataLoader
    arguments; a dict without either reads only the keys it has (`model.test_cfg.rcnn.max_per_imgg=5` would
    do nothing)."""
    read = (set(inspect.signature(Runner.__init__).parameters) - {"self"}) | set(READ_BY_RUNNER + READ_BY_LOAD_CONFIG)
    known = set(cfg.keys()) | read
    for key in overrides:
        top = key.split(".")[0]
        if top in SCRIPT_FLAGS:
            raise DetectionError(f"override {key}: {top} is set from the command's {SCRIPT_FLAGS[top]} flag (an "
                                 f"override of it would be ignored): give {SCRIPT_FLAGS[top]} instead")
        if top not in known:
            close = difflib.get_close_matches(top, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise DetectionError(f"override {key}: '{top}' is not a key of the config or of MMEngine's Runner{hint}")
        if top not in read:  # a variable of the config files (max_epochs, train_pipeline, ...), or custom_imports
            # the Swin recipes' `pretrained` URL, which our configs replace by a local backbone file
            uses = _uses(cfg, top, read) or (["model.backbone.init_cfg.checkpoint"] if top == "pretrained" else [])
            hint = f" (e.g. {', '.join(uses[:3])})" if uses else ""
            raise DetectionError(f"override {key}: '{top}' is read only while the config files are parsed (a variable "
                                 f"they copy into the keys that use it), so the override would change nothing: "
                                 f"override the keys that use it{hint}")
        unread = reads.unread(key) if reads is not None else None
        if unread is not None:
            instead = reads.instead.get(unread)
            raise DetectionError(f"override {key}: {reads.does} and does not read {unread}, so it would change "
                                 f"nothing; {f'give {instead} instead' if instead else 'drop it'}")
        _check_nested_key(cfg, key, overrides[key])


def check_hooks(cfg: Config) -> None:
    """Refuse a custom hook of `cfg` that cannot be built with its arguments (a typo of the config file or of an
    override such as `custom_hooks.0.lamm=0.01`), naming it: a hook taking **kwargs (CD's passes them on to
    ColinearityDecay) checks them only when MMEngine's Runner builds it, with a TypeError. Each is built here
    once, as the Runner would, and dropped (a hook's constructor only stores and checks its arguments)."""
    from mmdet.registry import HOOKS
    for index, hook in enumerate(cfg.get("custom_hooks") or []):
        hook = copy.deepcopy(hook)
        hook.pop("priority", None)  # the Runner's, not the hook's
        try:
            HOOKS.build(hook)
        except (TypeError, ValueError, KeyError) as e:
            raise DetectionError(f"custom_hooks.{index} ({hook.get('type')}) cannot be built with its arguments "
                                 f"({type(e).__name__}: {e}); fix them in the config file or the override") from None


def _uses(cfg: Config, variable: str, read: set) -> List[str]:
    """Dotted keys under the `read` top-level keys of `cfg` that hold the value of its top-level `variable`: where
    it was copied to (train_pipeline -> train_dataloader.dataset.pipeline, pretrained ->
    model.backbone.init_cfg.checkpoint); a number or flag only under a name like the variable's (max_epochs ->
    train_cfg.max_epochs: another 12 is no copy). MMDetection's base files tag their own dicts with a `_scope_`
    that the copies lack: it is not compared."""
    value, found = _unscoped(cfg[variable]), []
    any_name = isinstance(value, (str, list, dict)) and bool(value)

    def walk(prefix, node):
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for name, inner in items:
            path, name = f"{prefix}.{name}" if prefix else str(name), str(name)
            if _unscoped(inner) == value and (any_name or variable.endswith(name) or name.endswith(variable)):
                found.append(path)
            else:
                walk(path, inner)
    walk("", {k: v for k, v in cfg.items() if k in read})
    return found


def _unscoped(value: Any) -> Any:
    """`value` (config dicts and lists, nested) without MMEngine's `_scope_` keys."""
    if isinstance(value, dict):
        return {k: _unscoped(v) for k, v in value.items() if k != "_scope_"}
    if isinstance(value, (list, tuple)):
        return [_unscoped(v) for v in value]
    return value


def _check_nested_key(cfg: Config, key: str, value: Any) -> None:
    """Walk the dotted `key` through `cfg` (list items by index) and check the first part it does not find; a
    key it finds holding a number or flag refuses a `value` that is text (`train_cfg.max_epochs=abc`: MMEngine
    would store it and fail far away, e.g. in a dataset's int())."""
    parts = key.split(".")
    node: Any = dict(cfg.items())  # a Config is no dict; its values are ConfigDicts
    for depth, part in enumerate(parts):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, list) and part.isdigit():  # MMEngine's merge would fail with a KeyError
            parent = ".".join(parts[:depth])
            raise DetectionError(f"override {key}: {parent} has {len(node)} item{'s' if len(node) != 1 else ''} "
                                 f"(indices from 0), so there is no {parent}.{part}; to add one, give a config file "
                                 "as a later --config")
        elif isinstance(node, dict) and depth > 0:
            _check_new_key(node, part, ".".join(parts[:depth]), key)
            return
        else:  # a top-level key of the Runner, or a value (None, a number) that the override replaces whole
            return
    if isinstance(node, (bool, int, float)) and isinstance(value, str):
        kind = "true or false" if isinstance(node, bool) else "a number"
        raise DetectionError(f"override {key}={value}: the config holds {kind} there ({node!r}); give {kind}")
    if parts[0] in LOOP_KEYS and type(node) is int and isinstance(value, float) and not value.is_integer():
        # MMEngine's loops assert whole counts (max_epochs, val_interval, ...), with a traceback
        raise DetectionError(f"override {key}={value}: {parts[0]} counts in whole numbers; give one")
    if (parts[0] in LOOP_KEYS and parts[-1] in POSITIVE_LOOP_COUNTS and isinstance(value, (int, float))
            and not isinstance(value, bool) and value < 1):
        # 0 trains nothing (max_epochs) or fails after a whole epoch (val_interval: a modulo by zero)
        raise DetectionError(f"override {key}={value}: give at least 1")


def _check_new_key(node: dict, part: str, parent: str, key: str) -> None:
    """Refuse the new key `part` of the dict `parent` (`node`) when nothing would read it (check_override_keys)."""
    top = parent.split(".")[0]
    if part.startswith("_") or part in BUILDER_KEYS["*"] + BUILDER_KEYS.get(parent, ()) or top in OPEN_DICTS:
        return
    if parent in LOADERS:
        takes, what = set(inspect.signature(torch.utils.data.DataLoader.__init__).parameters), "torch's DataLoader"
    elif node.get("type") is None:
        close = difflib.get_close_matches(part, [str(k) for k in node], n=3)
        hint = f" (did you mean {', '.join(parent + '.' + c for c in close)}?)" if close else ""
        raise DetectionError(f"override {key}: the config has no such key{hint}, and {parent} (a dict without a "
                             f"`type`) is read for the keys it has only; to add a key its code reads, set it in a "
                             "config file given as a later --config")
    else:
        takes, what = _init_parameters(node["type"]), f"{node['type']} ({parent})"
    if takes is not None and part not in takes:
        close = difflib.get_close_matches(part, sorted(takes - {"self"}), n=3)
        hint = f"; did you mean {', '.join(parent + '.' + c for c in close)}?" if close else ""
        raise DetectionError(f"override {key}: {what} takes no argument '{part}'{hint}")


def _init_parameters(kind: Any) -> Optional[set]:
    """The keyword arguments the class registered as `kind` takes (in MMDetection's or MMEngine's registries),
    or None where that is not known: no registered class, a **kwargs, a signature that cannot be read."""
    from mmengine.registry import Registry
    import mmdet.registry as registries
    found = [kind] if callable(kind) else [c for r in vars(registries).values() if isinstance(r, Registry)
                                           for c in [r.get(kind)] if c is not None]
    taken: set = set()
    for builder in found:
        try:
            parameters = inspect.signature(builder.__init__ if inspect.isclass(builder) else builder).parameters
        except (TypeError, ValueError):
            return None
        if not found or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return None
        taken |= set(parameters)
    return taken or None


def _datasets(dataset: dict) -> List[dict]:
    """A loader's dataset dict and those it wraps (RepeatDataset, ConcatDataset, ...)."""
    inner = dataset.get("dataset") or []
    inner = inner if isinstance(inner, list) else [inner]
    return [dataset] + [d for sub in inner + list(dataset.get("datasets") or []) for d in _datasets(sub)]


def loader_datasets(cfg: Config) -> List[tuple]:
    """(loader key, dataset dict) of every dataset the loaders of `cfg` read, wrapped ones included."""
    return [(key, dataset) for key in LOADERS if cfg.get(key) for dataset in _datasets(cfg[key]["dataset"])]


def set_data_root(cfg: Config, root: str, keep: Sequence[str] = ()) -> None:
    """Point every loader and COCO evaluator of `cfg` at `root` (COCO's layout: annotations/, train2017/,
    val2017/); the command checks the annotation files of those it reads (check_annotation_files). An
    evaluator's `ann_file` named in `keep` (the user's overrides) stays as given; a loader's data_root there is
    refused."""
    root = os.path.join(os.path.abspath(root), "")
    # a loader's own data_root would be replaced below: the user asked for two roots of one loader
    loader_roots = [k for k in keep if k.split(".")[0] in LOADERS and k.split(".")[-1] == "data_root"]
    if loader_roots:
        raise DetectionError(f"override {loader_roots[0]}: --data-root sets the data_root of every loader and "
                             "would replace it; give one of them (a file of another root: the loader's "
                             "dataset.ann_file / dataset.data_prefix.img as an absolute path)")
    if not os.path.isdir(root):
        raise DetectionError(f"--data-root {root}: no such folder (COCO's layout: annotations/, train2017/, "
                             "val2017/)")
    old = cfg.get("data_root")
    for _, dataset in loader_datasets(cfg):
        if "data_root" in dataset:
            dataset["data_root"] = root
    for key in EVALUATORS:
        evaluators = cfg.get(key)
        for evaluator in evaluators if isinstance(evaluators, list) else [evaluators] if evaluators else []:
            ann = evaluator.get("ann_file")
            if ann and f"{key}.ann_file" not in keep:
                rel = ann[len(old):] if old and ann.startswith(old) else os.path.join(
                    "annotations", os.path.basename(ann))
                evaluator["ann_file"] = os.path.join(root, rel)
    cfg["data_root"] = root


def annotation_files(cfg: Config) -> List[tuple]:
    """(config key, absolute path) of every annotation file the loaders and evaluators of `cfg` read."""
    files = []
    for key, dataset in loader_datasets(cfg):
        if dataset.get("ann_file"):  # MMDetection's datasets join it with their data_root
            files.append((key, os.path.abspath(os.path.join(dataset.get("data_root") or "", dataset["ann_file"]))))
    for key in EVALUATORS:
        evaluators = cfg.get(key)
        for evaluator in evaluators if isinstance(evaluators, list) else [evaluators] if evaluators else []:
            if evaluator.get("ann_file"):
                files.append((key, os.path.abspath(evaluator["ann_file"])))
    return files


def image_folders(cfg: Config) -> List[tuple]:
    """(config key, absolute path) of every image folder the loaders of `cfg` read (`data_prefix`, which
    MMEngine's datasets join with their data_root)."""
    return [(key, os.path.abspath(os.path.join(dataset.get("data_root") or "", folder)))
            for key, dataset in loader_datasets(cfg) for folder in (dataset.get("data_prefix") or {}).values()
            if isinstance(folder, str) and folder]


def annotation_paths(cfg: Config, *keys: str) -> List[str]:
    """The paths of `annotation_files` read by the loaders / evaluators `keys` (all of them without keys)."""
    return [path for key, path in annotation_files(cfg) if not keys or key in keys]


def check_annotation_files(cfg: Config, source: Optional[str] = None, keys: Optional[Sequence[str]] = None) -> None:
    """Refuse a missing annotation file of `cfg`, or one that is not a JSON object (a truncated or corrupt file),
    naming it; `source` is where its path came from (`--data-root X`; None: the config's own paths); `keys`: the
    loaders and evaluators the command reads (None: all), so that a root with only the val split serves a
    full-precision evaluation. Only the first and last bytes are read: COCO's files are hundreds of MB."""
    for key, path in annotation_files(cfg):
        if keys is not None and key not in keys:
            continue
        if not os.path.isfile(path):
            where = f"{source}: " if source else ""
            fix = "" if source else " (give --data-root: COCO's layout, annotations/, train2017/, val2017/)"
            raise DetectionError(f"{where}{key} reads {path}, which does not exist{fix}")
        with open(path, "rb") as f:
            head = f.read(64).lstrip()
            f.seek(max(0, os.path.getsize(path) - 64))
            tail = f.read().rstrip()
        if not (head.startswith(b"{") and tail.endswith(b"}")):
            raise DetectionError(f"{key} reads {path}, which is not a JSON object (a truncated or corrupt "
                                 "annotation file?)")


def check_image_folders(cfg: Config, loaders: Sequence[str], source: Optional[str] = None) -> None:
    """Refuse a missing image folder of the `loaders` a command reads (train_dataloader, val_dataloader,
    test_dataloader), naming it: the images are read only when a batch is drawn, so a missing val2017/ failed
    after a training epoch. `source` as for `check_annotation_files`."""
    for key, path in image_folders(cfg):
        if key in loaders and not os.path.isdir(path):
            where = f"{source}: " if source else ""
            fix = "" if source else " (give --data-root: COCO's layout, annotations/, train2017/, val2017/)"
            raise DetectionError(f"{where}{key} reads its images from {path}, which is no folder{fix}")


@contextlib.contextmanager
def reading_annotations(files: Sequence[str], built: Optional[str] = None):
    """Report an error MMDetection or pycocotools raise while reading the annotation `files` (a file without
    COCO's keys, invalid JSON) as one line naming them: their messages ('categories', 'Expecting value')
    name no file. `built`: the config's parts built inside besides reading the files (where the files have
    been read whole before, by check_categories), which the line names first: a setting there (a batch size of
    0, an unknown metric) fails with the same kinds of error."""
    try:
        yield
    except DetectionError:
        raise
    except (KeyError, ValueError, TypeError, IndexError) as e:
        named = ", ".join(dict.fromkeys(files))  # a file read by several loaders and evaluators is named once
        if built:
            raise DetectionError(f"{built} could not be built from the config ({type(e).__name__}: {e}): check "
                                 f"its settings, and the annotation files it reads ({named})") from None
        raise DetectionError(f"{named}: cannot be read as a COCO annotation file ({type(e).__name__}: {e})") from None


def _built_datasets(dataset: Any, key: str) -> List[tuple]:
    """(config key, dataset) of a built dataset and those it wraps (RepeatDataset, ConcatDataset, ...), keyed as
    `_datasets` walks their config dicts."""
    found = [(key, dataset)]
    inner = getattr(dataset, "dataset", None)
    if inner is not None:
        found += _built_datasets(inner, f"{key}.dataset")
    for i, sub in enumerate(getattr(dataset, "datasets", None) or []):
        found += _built_datasets(sub, f"{key}.datasets.{i}")
    return found


def check_pipeline(dataset: Any, key: str) -> None:
    """Refuse a transform of the built loader `key`'s dataset that fails on its first image, naming the transform
    and the image: a transform is built from a setting of the wrong type without a word (Resize keeps
    scale="abc") and failed with a traceback only on an image, in the first training step or the first
    evaluation batch, or for the val loader after a training epoch. The image runs through the pipeline one
    transform at a time, as the dataset's Compose runs it, and the random-number state is put back after, so
    that training draws what it would have."""
    for prefix, inner in _built_datasets(dataset, f"{key}.dataset"):
        transforms = getattr(getattr(inner, "pipeline", None), "transforms", None)
        if not transforms or not hasattr(inner, "get_data_info") or not len(inner):
            continue  # a wrapper (its inner dataset has the pipeline), or no image to run
        state = RngStateHook._state()
        try:
            results = inner.get_data_info(0)
            image = results.get("img_path", "its first image") if isinstance(results, dict) else "its first image"
            for i, transform in enumerate(transforms):
                try:
                    results = transform(results)
                except (OSError, KeyError, ValueError, TypeError, IndexError, AssertionError, AttributeError) as e:
                    raise DetectionError(f"{prefix}.pipeline.{i} ({type(transform).__name__}) fails on {image} "
                                         f"({type(e).__name__}: {e}): check its settings") from None
                if results is None:  # a transform that drops the image (Compose stops there too)
                    break
        finally:
            RngStateHook._restore(state)


def dataset_classes(dataset: dict) -> Optional[tuple]:
    """The class names a loader's COCO dataset dict trains or scores, in label order as the config gives them
    (its metainfo, else its class's default: COCO's 80), or None for a dataset that is not a CocoDataset."""
    from mmdet.datasets import CocoDataset
    kind = DATASETS.get(dataset.get("type")) if isinstance(dataset.get("type"), str) else dataset.get("type")
    if not (inspect.isclass(kind) and issubclass(kind, CocoDataset)):
        return None
    classes = (dataset.get("metainfo") or {}).get("classes") or kind.METAINFO.get("classes")
    return tuple(classes) if classes else None


def label_names(categories: Sequence[dict], classes: Sequence[str]) -> List[str]:
    """The class each label means where MMDetection's CocoDataset and CocoMetric read a file with `categories`
    for the config's `classes`: label i is the i-th of the FILE's categories whose name is a class (pycocotools'
    getCatIds keeps the file's order), which is classes[i] only where the file lists them in that order."""
    return [str(c.get("name")) for c in categories if c.get("name") in classes]


def check_categories(cfg: Config, keys: Sequence[str]) -> None:
    """Refuse an annotation file of the loaders `keys` whose categories do not give label i to the config's class
    i (`label_names`): a file without the classes (other names) has no object to train on or score, one with some
    of them or with them in another order would train or score each class against another's objects. Each file
    is read once, whole, before any dataset is built, so COCO's train2017 file (about 450 MB) is read twice in
    all, here and by the dataset: json.load of a 317 MB file of train2017's counts (118,287 images, 860,001
    polygons) took 12.4 s and 1.9 GB on a 2-core Intel Xeon VM, per process (every rank of a torchrun reads it)."""
    seen = set()
    for key, dataset in loader_datasets(cfg):
        path = os.path.abspath(os.path.join(dataset.get("data_root") or "", dataset.get("ann_file") or ""))
        classes = dataset_classes(dataset) if key in keys and dataset.get("ann_file") else None
        if not classes or path in seen:
            continue
        seen.add(path)
        with reading_annotations([path]), open(path) as f:
            categories = json.load(f)["categories"]
            names = label_names(categories, classes)
        if names == list(classes):
            continue
        listed = ", ".join(str(c.get("name")) for c in categories[:6]) + (" ..." if len(categories) > 6 else "")
        what = (f"has none of the config's classes ({', '.join(classes)}); its categories are {listed}"
                if not names else
                f"numbers its categories {', '.join(names)} (MMDetection keeps the file's order), but the config's "
                f"classes are {', '.join(classes)}")
        raise DetectionError(f"{key} reads {path}, which {what}: give the data set the detector is configured for, "
                             f"or set {key}.dataset.metainfo.classes to its categories in the file's order")


CLASS_HEADS = ("bbox_head", "mask_head")  # the heads that predict the data set's classes


def check_head_classes(cfg: Config, key: str = "train_dataloader") -> None:
    """Refuse a box or mask head of `cfg.model` (CLASS_HEADS: one-stage, two-stage and cascade) whose num_classes
    is not the number of classes the loader `key` trains: a box head of 5 classes on the sample's 2 trained an
    epoch and failed with an IndexError traceback in the validation after it. Other heads keep their own counts
    (the RPN's is class-agnostic, an HTC semantic head's counts stuff classes)."""
    classes = next((c for k, d in loader_datasets(cfg) if k == key for c in [dataset_classes(d)] if c), None)
    if not classes:
        return

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            count = node.get("num_classes")
            named = [part for part in prefix.split(".") if not part.isdigit()][-1]  # a cascade's list index skipped
            if (isinstance(count, int) and not isinstance(count, bool) and count != len(classes)
                    and named in CLASS_HEADS):
                raise DetectionError(f"{prefix}.num_classes={count}, but {key} has {len(classes)} classes "
                                     f"({', '.join(classes[:6])}{' ...' if len(classes) > 6 else ''}): set "
                                     f"{prefix}.num_classes={len(classes)}, or the data set's classes "
                                     f"({key}.dataset.metainfo.classes)")
            for inner, value in node.items():
                walk(f"{prefix}.{inner}", value)
        elif isinstance(node, (list, tuple)):  # a cascade's box heads
            for index, value in enumerate(node):
                walk(f"{prefix}.{index}", value)
    walk("model", cfg.get("model"))


def check_checkpoint_classes(model: nn.Module, loader, checkpoint: str) -> None:
    """Refuse a checkpoint trained on other classes, or on the same ones in another label order, than the data set
    `loader` scores (its labels are the config's classes, check_categories): the metric would score each of its
    predicted labels as another class. A checkpoint that keeps no classes (written elsewhere) is not checked."""
    trained = (model.dataset_meta or {}).get("classes")
    scored = tuple(loader.dataset.metainfo.get("classes") or ())
    if trained and tuple(trained) != scored:
        raise DetectionError(f"--checkpoint {checkpoint} was trained on the classes {', '.join(trained)} (label "
                             f"order), but the evaluated data set has {', '.join(scored)}: evaluate it on the data "
                             "set it was trained for, with that config's classes")


def check_backbone_init(cfg: Config) -> None:
    """The backbone starts from a local checkpoint file when the config says it is pretrained (the paper
    starts from the official Swin ImageNet checkpoints); nothing is downloaded."""
    init = (cfg.model.get("backbone") or {}).get("init_cfg") or {}
    if init.get("type") != "Pretrained":
        return
    key = "model.backbone.init_cfg.checkpoint"
    path = init.get("checkpoint")
    if not path:
        raise DetectionError(f"{key} is not set: give the official Swin ImageNet checkpoint, e.g. "
                             f"{key}=/weights/swin_tiny_patch4_window7_224.pth (or {key.rsplit('.', 1)[0]}"
                             "=None to start from random weights)")
    if "://" in str(path):
        raise DetectionError(f"{key}={path} is a URL and nothing is downloaded here: download it and give "
                             "the local path")
    if not os.path.isfile(path):
        raise DetectionError(f"{key}={path}: no such file")
    check_backbone_checkpoint(cfg, path)


# keys an ImageNet Swin checkpoint lacks or has beyond the detection backbone, which MMDetection's official
# recipe leaves so: the norms of the detection outputs (new), the classifier's final norm and the attention
# masks and indices (buffers, rebuilt by the model)
NEW_IN_DETECTION = re.compile(r"^norm\d+\.")
LEFT_BY_DETECTION = re.compile(r"^norm\.|attn_mask$|relative_position_index$")


def check_backbone_checkpoint(cfg: Config, path: str) -> None:
    """Refuse a backbone checkpoint that does not fit the config's backbone, naming the mismatched weights.
    MMDetection's Swin loads it with `load_state_dict(strict=False)` and says nothing, so weights of another
    model (a ResNet's: none load, the run trains from random; a Swin-S's into a Swin-T: part of it) would train
    as if pretrained. The backbone's own loading code runs here (key conversion, bias-table interpolation) and
    what it would load is compared with the backbone's parameters."""
    key = "model.backbone.init_cfg.checkpoint"
    backbone = MODELS.build(copy.deepcopy(cfg.model.backbone))
    loaded: Dict[str, torch.Tensor] = {}
    called = []

    def record(state_dict, strict=True):  # instead of loading: what would be loaded is all that matters here
        loaded.update(state_dict)
        called.append(True)
        return nn.modules.module._IncompatibleKeys([], [])

    backbone.load_state_dict = record
    try:
        backbone.init_weights()
    except IndexError:  # MMDetection's Swin reads the first backbone weight it found in the file: there is none
        raise DetectionError(f"{key}={path} holds no weights of model.backbone "
                             f"({cfg.model.backbone.get('type')}): give the official checkpoint of this backbone") \
            from None
    except Exception as e:  # noqa: BLE001 - not a checkpoint, or one the loading code cannot convert
        raise DetectionError(f"{key}={path}: cannot be loaded into model.backbone ({type(e).__name__}: {e})") \
            from None
    if not called:  # a backbone that loads otherwise (MMEngine's PretrainedInit, which logs its mismatches)
        return
    misfit = mismatch(backbone.state_dict(), loaded, needed=[name for name, _ in backbone.named_parameters()],
                      may_lack=NEW_IN_DETECTION, may_add=LEFT_BY_DETECTION)
    if misfit:
        raise DetectionError(f"{key}={path} does not fit model.backbone ({cfg.model.backbone.get('type')}): "
                             f"{misfit} weights; give the official checkpoint of this backbone")


def mismatch(own: Dict[str, torch.Tensor], given: Dict[str, torch.Tensor], needed: Optional[List[str]] = None,
             may_lack: Optional[re.Pattern] = None, may_add: Optional[re.Pattern] = None) -> str:
    """'3 missing (e.g. a, b, c); 1 of another shape (e.g. d)': the keys of `given` that do not fit the state
    dict `own`, or '' where it fits. `needed`: the keys `given` must hold (all of `own` if None); keys matching
    `may_lack` may be missing from it, keys matching `may_add` may be in it beyond `own`."""
    needed = set(own) if needed is None else set(needed)
    missing = sorted(k for k in needed - set(given) if not (may_lack and may_lack.search(k)))
    unexpected = sorted(k for k in set(given) - set(own) if not (may_add and may_add.search(k)))
    shapes = sorted(k for k in set(own) & set(given) if tuple(own[k].shape) != tuple(given[k].shape))
    return "; ".join(f"{len(v)} {what} (e.g. {', '.join(v[:3])})" for what, v in
                     (("missing", missing), ("unexpected", unexpected), ("of another shape", shapes)) if v)


# -- training ------------------------------------------------------------------------------------------

class RngStateHook(Hook):
    """Make a resumed training continue exactly: MMEngine 0.10's checkpoints hold no random-number state, so a
    resumed run drew other flips, RoI samples and dropout than the uninterrupted one (110 of the sample
    detector's 115 tensors differed after a resumed epoch). The torch (and CUDA), numpy and python states go
    into each checkpoint and are restored when training starts from one; a validation inside training puts them
    back as they were before it, because it runs after the epoch's checkpoint is saved and would otherwise move
    the training stream on only in the run that was not interrupted.

    MMEngine saves checkpoints on rank 0 only, so under torchrun rank 0's state is kept and restored on rank 0;
    the other ranks continue from the run's seed."""

    priority = "LOWEST"  # restores after every other hook's before_train, saves after theirs

    def __init__(self) -> None:
        self._loaded: Optional[dict] = None
        self._before_val: Optional[dict] = None

    @staticmethod
    def _state() -> dict:
        state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    @staticmethod
    def _restore(state: dict) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        checkpoint["rng_state"] = self._state()

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        self._loaded = checkpoint.get("rng_state")

    def before_train(self, runner) -> None:
        if runner.iter == 0 or runner.rank != 0:  # a new run, seeded by MMEngine; see the class docstring
            return
        if self._loaded is None:
            runner.logger.warning("the checkpoint resumed from holds no random-number state (written without "
                                  "RngStateHook): training continues from the run's seed, not exactly")
            return
        self._restore(self._loaded)
        self._loaded = None

    def before_val(self, runner) -> None:
        self._before_val = self._state()

    def after_val(self, runner) -> None:
        if self._before_val is not None:
            self._restore(self._before_val)
            self._before_val = None


# -- models --------------------------------------------------------------------------------------------

def build_detector(cfg: Config, checkpoint: str, device: torch.device) -> nn.Module:
    """The detector of `cfg` with the weights of `checkpoint` (an MMEngine checkpoint: `state_dict` and
    `meta`), in eval mode. Weights of another model are refused with their mismatched keys named."""
    if not os.path.isfile(checkpoint):
        raise DetectionError(f"--checkpoint {checkpoint}: no such file")
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.get("backbone", {}).pop("init_cfg", None)  # the checkpoint holds every weight
    model = MODELS.build(model_cfg)
    # An MMEngine checkpoint pickles its message hub (mmengine / numpy objects) beside the weights, which
    # torch >= 2.6's weights_only loader refuses; the file is the one the user names for evaluation.
    try:
        payload = torch.load(checkpoint, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same one-line error
        raise DetectionError(f"--checkpoint {checkpoint}: cannot be read ({type(e).__name__}: {e})") from None
    state = payload.get("state_dict", payload) if isinstance(payload, dict) else None
    if not isinstance(state, dict) or not state:
        raise DetectionError(f"--checkpoint {checkpoint}: holds no state_dict")
    state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
    misfit = mismatch(model.state_dict(), state)
    if misfit:
        raise DetectionError(f"--checkpoint {checkpoint} does not fit the model of --config: {misfit} weights")
    bad = nonfinite_tensors(state)
    if bad:  # every score would be a chance-level number of broken weights
        raise DetectionError(f"--checkpoint {checkpoint} holds non-finite weights: {'; '.join(bad[:3])}"
                             f"{' ...' if len(bad) > 3 else ''}")
    model.load_state_dict(state, strict=True)
    meta = payload.get("meta") or {}
    classes = (meta.get("dataset_meta") or {}).get("classes")
    model.dataset_meta = {"classes": tuple(classes)} if classes else None
    model.training_method = training_method(meta)
    return model.to(device).eval()


# the hooks of configs/detection/method/ and the method each stands for (Table 2's rows)
METHOD_HOOKS = {"ColinearityDecayHook": "CD", "TweoHook": "TWEO", "WeightNoiseHook": "Noise"}


def training_method(meta: dict) -> Optional[str]:
    """The method a detector was trained with, from the training config its MMEngine checkpoint keeps
    (meta["cfg"]): "CD", "TWEO", "Noise" (joined by "+" when several), "Baseline" when it ran none of their
    hooks; None when the checkpoint keeps no readable config (a file converted or written elsewhere)."""
    text = meta.get("cfg") if isinstance(meta, dict) else None
    if not isinstance(text, str):
        return None
    with tempfile.TemporaryDirectory() as folder:  # Config.fromstring leaves its file behind on an error
        path = os.path.join(folder, "training_config.py")
        with open(path, "w") as f:
            f.write(text)
        try:  # the hooks are read, not built: their modules (custom_imports) need not be importable here
            hooks = Config.fromfile(path, import_custom_modules=False).get("custom_hooks") or []
        except Exception:  # noqa: BLE001 - MMEngine executes the text: any failure means "not known"
            return None
    types = [str(hook.get("type")).rsplit(".", 1)[-1] for hook in hooks if isinstance(hook, dict)]  # mmdet.X
    return "+".join(METHOD_HOOKS[t] for t in types if t in METHOD_HOOKS) or "Baseline"


# -- data ----------------------------------------------------------------------------------------------

def build_loader(cfg: Config, split: str = "test", max_images: Optional[int] = None) -> torch.utils.data.DataLoader:
    """The `split` loader of `cfg` ("test" or "val"); `max_images` keeps the first N images (a partial result,
    marked as such by the caller)."""
    loader_cfg = copy.deepcopy(cfg[f"{split}_dataloader"])
    if max_images is not None:
        if max_images < 1:
            raise DetectionError(f"--max-images {max_images}: give at least 1")
        loader_cfg["dataset"]["indices"] = max_images
    with reading_annotations(annotation_paths(cfg, f"{split}_dataloader")):
        loader = Runner.build_dataloader(loader_cfg)
    if max_images is not None and len(loader.dataset) < max_images:  # MMEngine keeps what there is, silently
        raise DetectionError(f"--max-images {max_images}: the {split} split has only {len(loader.dataset)} images "
                             "(drop --max-images to score them all)")
    return loader


class TrainingImages:
    """The training split with the TEST pipeline (resize, no flip), so that no validation image is seen before
    scoring: built once (COCO's train2017 annotations take a while) for the counts to be checked before any work
    and for every pipeline that draws calibration or reconstruction images from it."""

    def __init__(self, cfg: Config) -> None:
        dataset_cfg = copy.deepcopy(cfg.train_dataloader["dataset"])
        test_pipeline = copy.deepcopy(cfg.test_dataloader["dataset"]["pipeline"])
        for dataset in _datasets(dataset_cfg):
            if "pipeline" in dataset:  # not on wrappers (RepeatDataset, ...), which take none
                dataset["pipeline"] = test_pipeline
        dataset_cfg.pop("indices", None)
        with reading_annotations(annotation_paths(cfg, "train_dataloader")):
            self.dataset = DATASETS.build(dataset_cfg)

    def __len__(self) -> int:
        return len(self.dataset)

    def check(self, count: int, flag: str) -> None:
        """Refuse drawing `count` images, `flag` naming the option that asked for them."""
        if count < 1:
            raise DetectionError(f"{flag} {count}: give at least 1")
        if len(self.dataset) < count:
            raise DetectionError(f"{flag} {count}: the training split has only {len(self.dataset)} images")

    def draw(self, count: int, seed: int, flag: str) -> tuple:
        """(indices, samples): `count` distinct images drawn with `seed`."""
        self.check(count, flag)
        indices = sorted(random.Random(seed).sample(range(len(self.dataset)), count))
        return indices, [self.dataset[i] for i in indices]


def train_images_with_test_pipeline(cfg: Config, count: int, seed: int, flag: str,
                                    images: Optional[TrainingImages] = None) -> tuple:
    """(indices, samples): `count` distinct images of the training split drawn with `seed`, each given the TEST
    pipeline (`TrainingImages`; `images`: one already built). `flag` names the option that asked for them in
    errors."""
    if count < 1:  # before the split is read
        raise DetectionError(f"{flag} {count}: give at least 1")
    return (images or TrainingImages(cfg)).draw(count, seed, flag)


class DetectorFeed:
    """A detector's calibration set as a `quant.calibrate.ModelFeed` and a one-batch `quant.units.SampleFeed`:
    `count` images of the training split, drawn with `seed` and given the TEST pipeline (resize, no flip),
    collated into ONE padded batch, so that a single test step of the detector calibrates every quantizer on
    all of them at once.

    The official RepQ-ViT and APHQ detection code calibrates on one image at batch 1 (RepQ-ViT: its test
    loader's first; APHQ: its training loader's first); here the images come from the training split with the
    test pipeline.
    """

    def __init__(self, cfg: Config, count: int, seed: int = 0, images: Optional[TrainingImages] = None) -> None:
        self.indices, images = train_images_with_test_pipeline(cfg, count, seed, "--calib-images", images)
        self.batch = pseudo_collate(images)
        self.count = count

    @torch.no_grad()
    def feed(self, model: nn.Module) -> int:
        model.test_step(self.batch)
        return self.count

    def __len__(self) -> int:
        return 1

    @torch.no_grad()
    def run(self, model: nn.Module, index: int) -> Any:
        return model.test_step(self.batch)


class DetectorSamples:
    """APHQ's reconstruction images of a detector (`quant.aphq.detector.DetectorSamples`), and GPLQ's QwT images:
    `count` training images drawn with `seed`, test pipeline, one image per batch (the official optimisation
    loader has batch 1 and takes the first 256 images with the training pipeline). `flag`: the option that set
    `count`, for errors."""

    def __init__(self, cfg: Config, count: int, seed: int = 0, flag: str = "--quant-options aphq.recon_images",
                 images: Optional[TrainingImages] = None) -> None:
        self.indices, images = train_images_with_test_pipeline(cfg, count, seed, flag, images)
        self.batches = [pseudo_collate([image]) for image in images]

    def __len__(self) -> int:
        return len(self.batches)

    @torch.no_grad()
    def run(self, model: nn.Module, index: int) -> Any:
        return model.test_step(self.batches[index])

    def rpn_outputs(self, model: nn.Module, index: int) -> tuple:
        """The raw RPN outputs (objectness logits, box deltas per FPN level) of image `index`, with gradients."""
        data = model.data_preprocessor(self.batches[index], False)
        return model.rpn_head(model.extract_feat(data["inputs"]))


# -- GPLQ stage 1 ---------------------------------------------------------------------------------------

STAGE1_IDENTITY = "gplq_stage1.json"


def train_activation_qat(student: nn.Module, cfg: Config, settings: Dict[str, Any],
                         work_dir: Optional[str]) -> Dict[str, Any]:
    """GPLQ stage 1 on a detector (quant/gplq/detector.py): train `student` in place on its own detection loss
    with MMEngine's runner over the config's training loader at `batch_size_per_gpu`, AdamW with the given
    param groups at a constant lr, one epoch (or `steps` iterations), AMP as asked; checkpoints every
    `ckpt_every` iterations into `work_dir`, and a later call with the same identity resumes from them at the
    iteration they reached (one whose stage 1 had finished loads its last checkpoint and trains no more).

    The folder holds `gplq_stage1.json` (the run's identity: bits, options, float weights, world size); a folder
    written by another run, or one that is not a GPLQ stage-1 folder, is refused and left as it is. Under
    torchrun every rank calls this: rank 0 checks the folder, and the runner trains in DDP, each rank on its
    shard of the training loader (the global batch is `batch_size_per_gpu` x world size).
    """
    if work_dir is None:
        raise DetectionError("GPLQ stage 1 on a detector writes resumable checkpoints: give it a work folder")
    identity = json.loads(json.dumps(settings["identity"]))  # plain types, comparable with the stored file
    device = next(student.parameters()).device
    check_stage1_device(device)
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


def _claim_stage1_folder(work_dir: str, identity: Dict[str, Any]) -> tuple:
    """(checkpoint to resume from or None, run name): refuse a folder of another run, or one that is not a GPLQ
    stage-1 folder (left as it is); write the identity file into a new or empty one. The name is unique, so
    that MMEngine's logger and visualizer instances of two stage-1 runs in one process never meet."""
    identity_path = os.path.join(work_dir, STAGE1_IDENTITY)
    if os.path.isdir(work_dir) and os.listdir(work_dir):
        if not os.path.isfile(identity_path):
            raise DetectionError(f"{work_dir} exists and is not a GPLQ stage-1 folder ({STAGE1_IDENTITY} is "
                                 "missing): move it away")
        with open(identity_path) as f:
            stored = json.load(f)
        if stored != identity:
            raise DetectionError(f"{work_dir} holds GPLQ stage 1 of another run ({stored}); restore those "
                                 f"settings, or move the folder away to start stage 1 anew (now: {identity})")
    else:
        os.makedirs(work_dir, exist_ok=True)
        with open(identity_path, "w") as f:
            json.dump(identity, f, indent=1)
    last = os.path.join(work_dir, "last_checkpoint")  # MMEngine's pointer to its latest checkpoint
    checkpoint = None
    if os.path.isfile(last):
        with open(last) as f:
            checkpoint = f.read().strip()
        if not os.path.isfile(checkpoint):
            raise DetectionError(f"{last} points to {checkpoint}, which does not exist: restore it, or move "
                                 f"{work_dir} away to start stage 1 anew")
    return checkpoint, f"gplq_stage1_{time.time_ns() % 10 ** 9}"


# -- evaluation ----------------------------------------------------------------------------------------

def check_evaluator_annotations(cfg: Config, split: str = "test") -> None:
    """Refuse a `split` evaluator that reads another annotation file than the `split` loader: it would score
    the loader's predictions against the ground truth of other images."""
    metrics = cfg.get(f"{split}_evaluator")
    if not metrics:  # a training config without validation
        return
    read = annotation_paths(cfg, f"{split}_dataloader")  # one file, unless it concatenates data sets
    loader_ann = read[0] if len(read) == 1 else None
    for metric in metrics if isinstance(metrics, list) else [metrics]:
        ann = metric.get("ann_file")
        if ann and loader_ann and os.path.abspath(ann) != loader_ann:
            raise DetectionError(f"{split}_evaluator.ann_file={ann} but {split}_dataloader reads {loader_ann}: "
                                 f"give both the same file ({split}_dataloader.dataset.ann_file is relative to "
                                 "its data_root)")


def _image_ids(dataset) -> List[int]:
    """The COCO image ids of the images `dataset` holds (only the first N under --max-images)."""
    return [dataset.get_data_info(i)["img_id"] for i in range(len(dataset))]


def _evaluator(cfg: Config, loader) -> Any:
    """The config's test metrics, scoring the images of `loader` only: MMDetection's CocoMetric scores every
    image of its annotation file unless its `img_ids` are set, so a partial set (--max-images) would count the
    images it never saw as missed. Under torchrun they gather the ranks' predictions through the process group
    (collect_device "gpu": all_gather_object, on gloo too) unless the config sets collect_device: MMEngine's
    default, "cpu", writes them into a `.dist_test` folder it leaves in the working directory, which every
    node must share."""
    check_evaluator_annotations(cfg)
    metrics = cfg.test_evaluator if isinstance(cfg.test_evaluator, list) else [cfg.test_evaluator]
    metrics = [copy.deepcopy(m) for m in metrics]
    if torch.distributed.is_initialized():
        for metric in metrics:
            metric.setdefault("collect_device", "gpu")
    with reading_annotations(annotation_paths(cfg, "test_evaluator")):
        built = [METRICS.build(m) for m in metrics]
    ids = _image_ids(loader.dataset)
    for metric in built:
        if getattr(metric, "img_ids", False) is None:  # CocoMetric: None means every image of its ann_file
            metric.img_ids = ids
    evaluator = Evaluator(built)
    evaluator.dataset_meta = loader.dataset.metainfo
    return evaluator


@torch.no_grad()
def evaluate_detector(model: nn.Module, cfg: Config, loader, probe_maxima: bool = False,
                      progress: bool = True) -> Dict[str, Any]:
    """COCO box / mask mAP of `model` on `loader` (pycocotools, through MMDetection's CocoMetric), and with
    `probe_maxima` the activation maxima of the backbone and of the heads (module outputs, see
    `activation_maxima`). Returns {"bbox_mAP": .., "segm_mAP": .., ..., "images": N, "seconds": ..}.

    Under torchrun each rank scores its shard of `loader` (MMEngine's DefaultSampler); the evaluator gathers
    the predictions on rank 0, which computes the metrics for every rank, and the maxima are all-reduced."""
    evaluator = _evaluator(cfg, loader)
    model.eval()
    device = next(model.parameters()).device
    probe = ActivationProbe(model, blocks=BACKBONE + HEADS) if probe_maxima else None
    start, images = time.perf_counter(), 0
    with probe if probe is not None else contextlib.nullcontext():
        for i, batch in enumerate(loader):
            outputs = model.test_step(batch)
            evaluator.process(data_samples=outputs, data_batch=batch)
            images += len(outputs)
            if progress and (i + 1) % 50 == 0:  # under torchrun: of this rank's shard
                print(f"  {images}/{len(loader.sampler)} images", flush=True)
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its whole summary table
        metrics = evaluator.evaluate(len(loader.dataset))
    result = {k.split("/")[-1]: float(v) for k, v in metrics.items() if k.split("/")[-1] in METRIC_KEYS}
    # the sampler pads the last shards with repeated images, which the evaluator drops: count each image once
    scored = int(all_reduce(torch.tensor([images], device=device)).item())
    result.update(images=min(scored, len(loader.dataset)), seconds=time.perf_counter() - start)
    if probe is not None:
        result["max_act"] = activation_maxima(probe, device)
    return result


def activation_maxima(probe: ActivationProbe, device: torch.device) -> Dict[str, Any]:
    """The paper's detection "Max. Act. (backbone / head)": max |value| over the outputs of every module in
    the backbone (blocks and everything in them, patch merging, the output norms), and over those of every
    module of the neck, RPN and RoI heads, on the evaluated images. (The paper does not define the sets
    further; this is our reading of "aggregated ... over the backbone and detector head outputs".)"""
    records = probe.result(reduce_fn=lambda t: all_reduce(t, op="max"), device=device).per_layer
    def largest(prefixes):
        return max((r["max"] for r in records if r["name"].split(".")[0] in prefixes), default=0.0)
    return {"backbone": largest(BACKBONE), "head": largest(HEADS)}
