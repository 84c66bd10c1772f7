"""Detection configs: MMDetection config files merged in order (method fragments add their hooks), `key=value`
overrides parsed as MMEngine's --cfg-options, and the checks that refuse an override or a custom hook that
would be stored and then ignored or fail far away."""
from __future__ import annotations

import argparse
import ast
import copy
import difflib
import inspect
import os
import re
import textwrap
from typing import Any, Dict, FrozenSet, List, Mapping, NamedTuple, Optional, Sequence

import torch
from mmengine.config import Config, DictAction
from mmengine.hooks import CheckpointHook, Hook
from mmengine.registry import init_default_scope
from mmengine.runner import Runner

from cd.integrations.mmengine import (CD_HOOK, TweoHook, WeightNoiseHook, apply_weight_decay_budget,  # imports mmengine
                                      type_name)
from engine.detection.data_checks import LOADERS, set_data_root
from engine.detection.errors import DetectionError

class CommandReads(NamedTuple):
    """What a command reads of a config (evaluate_detection.py's evaluation; train_detection.py's training, which
    leaves out the test loop's keys): its top-level `keys`, what it `does` with them (for the message),
    `instead`: keys it does not read (a top-level one, or a dotted one under a key it reads) with what to give in
    their place ('' : nothing, drop it), `flags`: the keys of SCRIPT_FLAGS it sets from a flag of its own (an
    override of another one is a key it does not read: the flag the message would name is not the command's),
    and `wrapped`: dataset keys whose wrapped
    datasets (`.dataset` of a RepeatDataset, ..., `.datasets.N` of a ConcatDataset, at any depth) the command
    reads as it reads the dataset itself, so that `instead`'s entries for the dataset cover them too."""
    keys: FrozenSet[str]
    does: str
    instead: Mapping[str, str]
    flags: FrozenSet[str] = frozenset()
    wrapped: FrozenSet[str] = frozenset()

    def unread(self, key: str) -> Optional[str]:
        """The part of the dotted override `key` that the command does not read, or None."""
        parts = key.split(".")
        for end in range(1, len(parts) + 1):
            part = ".".join(parts[:end])
            if self._unwrapped(part) in self.instead:
                return part
        return parts[0] if parts[0] not in self.keys else None

    def instead_of(self, part: str) -> str:
        """What to give in place of the unread `part` ('' : nothing)."""
        return self.instead.get(self._unwrapped(part), "")

    def _unwrapped(self, key: str) -> str:
        """`key` with the wrapper steps under a `wrapped` dataset left out (train_dataloader.dataset.datasets.1.
        dataset.pipeline -> train_dataloader.dataset.pipeline)."""
        for base in self.wrapped:
            if key.startswith(base + "."):
                rest = key[len(base) + 1:].split(".")
                while rest:
                    if rest[0] == "dataset" and len(rest) > 1:
                        rest = rest[1:]
                    elif rest[0] == "datasets" and len(rest) > 2 and rest[1].isdigit():
                        rest = rest[2:]
                    else:
                        break
                return ".".join([base] + rest)
        return key


def load_config(paths: Sequence[str], overrides: Optional[Dict[str, Any]] = None,
                data_root: Optional[str] = None, reads: Optional[CommandReads] = None) -> Config:
    """The MMDetection config of `paths` merged in order (later files update earlier ones: dicts merge, lists
    are replaced, except that each file's `custom_hooks` are added to the earlier ones and its
    `custom_imports.imports` joined with theirs, so that two method fragments both apply), then `overrides`
    (dotted keys, as MMEngine's --cfg-options), then `data_root`. `reads`: the keys the command reads
    (check_override_keys, check_file_keys; None: all a Runner reads). The files' keys are checked as overrides
    are: MMDetection 2.x's top-level settings (check_legacy_keys) and an argument the class its dict builds does
    not take (check_file_keys) are refused. Where the command runs the config's custom_hooks (`reads` None or
    holding them), a method's hook given twice is refused (check_method_hooks)."""
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
    files = [(paths[0], cfg.to_dict())]  # each file's own settings, for the --config that check_file_keys names
    # which --config brought each hook, for check_method_hooks: the first file's (its _base_ files' included),
    # then each fragment's, which merge_fragment adds after them
    sources = [f"--config {paths[0]}"] * len(cfg.get("custom_hooks") or [])
    for path in paths[1:]:
        fragment = read_config(path).to_dict()
        files.append((path, fragment))
        sources += [f"--config {path}"] * len(fragment.get("custom_hooks") or [])
        merge_fragment(cfg, fragment)
    model = cfg.get("model")
    if not isinstance(model, dict) or "type" not in model:  # a method fragment alone, a train.py YAML recipe
        raise DetectionError(f"--config {' '.join(paths)}: no MMDetection detector in it (a `model` dict with a "
                             "`type`): give a detector config first, e.g. configs/detection/mask_rcnn_swin_t_1x.py, "
                             "and a method fragment (configs/detection/method/) after it")
    check_legacy_keys(cfg, files)
    if overrides:
        check_override_keys(cfg, overrides, reads)
        try:
            cfg.merge_from_dict(dict(overrides))
        except TypeError as e:  # a dict given where the config has another value (MMEngine's message says how)
            raise DetectionError(f"overrides {' '.join(overrides)}: {e}") from None
    # the files' own keys, which the override checks above do not see (an override of a type is checked with them)
    check_file_keys(cfg, files, overrides or {}, reads)
    if data_root is not None:
        set_data_root(cfg, data_root, keep=overrides or {})
    if reads is None or "custom_hooks" in reads.keys:
        if "custom_hooks" in (overrides or {}):  # the whole list, replaced
            sources = ["the custom_hooks override"] * len(cfg.get("custom_hooks") or [])
        check_method_hooks(cfg, sources)  # before the budget, which counts CD's hooks without naming their files
    try:
        apply_weight_decay_budget(cfg)  # after the overrides, so that a lam or weight decay given moves it
    except ValueError as e:
        raise DetectionError(str(e)) from None
    init_default_scope(cfg.get("default_scope", "mmdet"))
    return cfg


# the methods' hooks (cd.integrations.mmengine): two of one method on the same part of the model apply it twice
# in each step (TWEO's term doubled without a word) or fail inside training with a RuntimeError traceback (CD's
# second update in the optimizer's step, WeightNoise's second hooks on the same layers); on parts that do not
# overlap (CD on the backbone and on the neck) both run as asked
METHOD_HOOKS = (CD_HOOK, TweoHook.__name__, WeightNoiseHook.__name__)


def check_method_hooks(cfg: Config, sources: Sequence[str]) -> None:
    """Refuse two hooks of one method on overlapping parts of the model in the merged `cfg` (a method fragment
    given as a --config and also in the first config's _base_ list), naming where each came from: `sources`, the
    origin of each of cfg.custom_hooks in order (load_config)."""
    hooks = list(cfg.get("custom_hooks") or [])
    backbone = "backbone" if isinstance(cfg.get("model"), dict) and "backbone" in cfg.model else ""

    def part(hook) -> str:  # the hooks' `module`: None is the backbone where the model has one
        module = hook.get("module")
        return backbone if module is None else str(module)

    def layers(hook) -> set:  # WeightNoiseHook's layer types (its default: Linear); the others take every layer
        if _hook_name(hook) != WeightNoiseHook.__name__:
            return {""}
        types = hook.get("layer_types", ("Linear",))
        return {types} if isinstance(types, str) else set(types)

    def overlap(a: str, b: str) -> bool:
        return a == b or not a or not b or a.startswith(b + ".") or b.startswith(a + ".")

    for j, later in enumerate(hooks):
        for i, earlier in enumerate(hooks[:j]):
            kind = _hook_name(later)
            if (kind in METHOD_HOOKS and _hook_name(earlier) == kind and overlap(part(earlier), part(later))
                    and layers(earlier) & layers(later)):
                where = [sources[k] if len(sources) == len(hooks) else f"custom_hooks.{k}" for k in (i, j)]
                origin = f"{where[0]} adds both" if where[0] == where[1] else f"{where[0]} adds one, {where[1]} another"
                parts = " and ".join(dict.fromkeys(p or "the whole model" for p in (part(earlier), part(later))))
                raise DetectionError(f"custom_hooks.{i} and custom_hooks.{j} are both {kind}s on {parts} ({origin}): "
                                     "the method would apply twice in each step; give its fragment once (drop the "
                                     "repeated --config, or the fragment from the _base_ list)")


def _hook_name(hook: Any) -> Optional[str]:
    """The class name a custom_hooks entry builds (`type` as a name, with or without a registry scope, or a
    class), read as the budget rule reads it (type_name)."""
    return type_name(hook.get("type")) if isinstance(hook, dict) else None


def read_config(path: str) -> Config:
    """The config file `path`, or one error line naming it."""
    loop = base_loop(path)
    if loop:  # MMEngine follows it to Python's recursion limit (12-26 s for two files here), then says only that
        raise DetectionError(f"--config {path}: _base_ chain loops: {' -> '.join(loop)}; remove one _base_")
    try:
        return Config.fromfile(path)
    except Exception as e:  # noqa: BLE001 - MMEngine executes the file: any error in it (syntax, a missing
        # _base_, not Python at all) is the same one-line error about that file
        raise DetectionError(f"--config {path}: cannot be read ({type(e).__name__}: {e})") from None


def base_loop(path: str) -> List[str]:
    """The files of a `_base_` chain from `path` that comes back to a file already in it (a.py -> b.py -> a.py),
    shown relative to `path`'s folder; [] where there is none. The bases are read as MMEngine reads them
    (Config._get_base_files: the `_base_` assignment alone, not the file run). Only local bases are followed: an
    installed package's (`mmdet::...`) cannot name the user's files, and resolving one reads the package's
    metafiles (about 0.3 s), which every load would pay. A base that cannot be read ends the walk there:
    Config.fromfile names that problem."""
    folder = os.path.dirname(os.path.abspath(path))
    finished = set()  # files whose bases were all followed without a loop (a base two files share: read once)

    def visit(file: str, chain: List[str]) -> List[str]:  # chain: the files from `path` down to `file`
        file = os.path.abspath(file)  # as MMEngine's _file2dict: a base is beside the file as named (a link's)
        real = os.path.realpath(file)
        chain = chain + [file]
        if real in map(os.path.realpath, chain[:-1]):
            return [os.path.relpath(f, folder) for f in chain]
        if real in finished:
            return []
        try:
            bases = Config._get_base_files(file)
        except Exception:  # noqa: BLE001 - not Python/YAML/JSON, a syntax error: Config.fromfile says which
            bases = []
        for base in bases:
            if isinstance(base, str) and "::" not in base:  # MMEngine's _get_cfg_path for a local base
                found = visit(os.path.join(os.path.dirname(file), base), chain)
                if found:
                    return found
        finished.add(real)
        return []

    return visit(path, [])


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
    """`key=value` items as MMEngine's --cfg-options parses them (numbers, bools, None, lists, tuples). A key given
    twice with two values is refused: the entry points take bare words and --cfg-options' items apart, so which
    came last on the command line is not known."""
    namespace = argparse.Namespace()
    given: Dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise DetectionError(f"{item!r}: config overrides are key=value")
        key, value = item.split("=", 1)
        if given.setdefault(key, value) != value:
            raise DetectionError(f"{key} is given twice ({key}={given[key]} and {key}={value}): give it once")
    for item in items:
        # DictAction asserts on unbalanced brackets and recurses without end on a call such as dict(...): parsed
        # one item at a time (DictAction adds to what the namespace holds) so the entry points print one error
        # line naming the item, not a traceback
        try:
            DictAction(option_strings=[], dest="options")(None, namespace, [item])
        except (AssertionError, RecursionError):
            syntax = ("a dict key by key (key.sub=value items), a number, True/False/None, a string, or a "
                      "list/tuple literal with balanced brackets such as key=[1,2] or key=\"(1,2)\"")
            raise DetectionError(f"{item!r}: the value cannot be parsed: give MMEngine's override syntax: "
                                 f"{syntax}") from None
    return getattr(namespace, "options", {})


# keys the entry points set from their own flags: an override of them would be overwritten or never read
SCRIPT_FLAGS = {"work_dir": "--work-dir", "launcher": "--launcher", "resume": "--resume", "data_root": "--data-root"}
# top-level keys MMEngine's Runner reads from the config besides its arguments (Runner.wrap_model, .train)
READ_BY_RUNNER = ("model_wrapper_cfg", "sync_bn", "find_unused_parameters", "activation_checkpointing",
                  "efficient_conv_bn_eval", "compile")
READ_BY_LOAD_CONFIG = ("cd_budget",)  # apply_weight_decay_budget reads it after the overrides
LOOP_KEYS = ("train_cfg", "val_cfg", "test_cfg")  # MMEngine's loops: epoch, iteration and interval counts
POSITIVE_LOOP_COUNTS = ("max_epochs", "max_iters", "val_interval")  # counts MMEngine's loops need >= 1
# dicts whose keys their readers take as they come (hook names, environment settings); default_hooks' entries are
# checked whole once merged (check_default_hooks)
OPEN_DICTS = ("default_hooks", "env_cfg")
# keys a builder takes out of a module's dict before calling its class (MMEngine's hooks and optim wrapper; the
# loaders' num_batch_per_epoch, which Runner.build_dataloader pops to train or evaluate on a slice of the dataset)
BUILDER_KEYS = {"*": ("priority",), "optim_wrapper": ("constructor", "paramwise_cfg"),
                **{loader: ("num_batch_per_epoch",) for loader in LOADERS}}


def runner_keys() -> set:
    """The top-level keys MMEngine's Runner reads (its arguments, READ_BY_RUNNER) and load_config's own."""
    return (set(inspect.signature(Runner.__init__).parameters) - {"self"}) | set(READ_BY_RUNNER + READ_BY_LOAD_CONFIG)


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
    read = runner_keys()
    known = set(cfg.keys()) | read
    for key in overrides:
        top = key.split(".")[0]
        if top in SCRIPT_FLAGS and (reads is None or top in reads.flags):
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
            instead = reads.instead_of(unread)
            raise DetectionError(f"override {key}: {reads.does} and does not read {unread}, so it would change "
                                 f"nothing; {f'give {instead} instead' if instead else 'drop it'}")
        _check_nested_key(cfg, key, overrides[key])


# MMDetection 2.x's top-level settings, which MMDetection 3.x's Runner (MMEngine) reads none of: a 2.x file's
# schedule, checkpoints or evaluation were stored and ignored without a word; each with the key that replaced it
LEGACY_KEYS = {
    "lr_config": "param_scheduler (a list of schedulers, e.g. [dict(type='MultiStepLR', milestones=[8, 11], "
                 "by_epoch=True)])",
    "optimizer_config": "optim_wrapper (its grad_clip is optim_wrapper.clip_grad, its cumulative_iters "
                        "optim_wrapper.accumulative_counts)",
    "runner": "train_cfg (e.g. dict(type='EpochBasedTrainLoop', max_epochs=12, val_interval=1))",
    "evaluation": "val_evaluator (the metric) and train_cfg.val_interval (how often it runs)",
    "checkpoint_config": "default_hooks.checkpoint (e.g. dict(type='CheckpointHook', interval=1))",
    "log_config": "default_hooks.logger (its interval) and visualizer.vis_backends (where the logs go)",
    "total_epochs": "train_cfg.max_epochs",
    "workflow": "train_cfg and val_cfg (the loops; validation every train_cfg.val_interval epochs)",
}
# dicts with checks of their own that build or look up each entry whole (check_hooks, check_default_hooks), and
# those whose readers take any key (OPEN_DICTS)
FILE_KEYS_CHECKED_ELSEWHERE = ("custom_hooks",) + OPEN_DICTS
# the model's dicts whose classes are built with all their keys: the detector (the Runner builds it) and its
# parts (backbone, neck, heads: the detector builds each whole). A part's own dicts are its code's to read, and
# some read a key out before building the rest (DETRHead takes loss_cls.bg_cls_weight, FCNMaskHead
# upsample_cfg.scale_factor): their classes' arguments do not tell what is read
MODEL_DEPTH_CHECKED = 2


def check_legacy_keys(cfg: Config, files: Sequence[tuple]) -> None:
    """Refuse a top-level key of MMDetection 2.x's configs in the merged files (LEGACY_KEYS: `lr_config`, ...),
    naming the --config that sets it and the key that replaced it. `files`: (path, its settings) in order. A
    number or text under such a name that the files copy into a setting the Runner reads (`total_epochs = 3`,
    `train_cfg = dict(max_epochs=total_epochs)`) is a variable of theirs, and passes; a dict or list (lr_config,
    workflow) is 2.x's own setting, refused wherever its value is found."""
    read = runner_keys()
    for key, successor in LEGACY_KEYS.items():
        if key in cfg and not isinstance(cfg[key], (dict, list, tuple)) and _uses(cfg, key, read):
            continue
        if key in cfg:
            raise DetectionError(f"{_file_origin(key, files)}: {key} is a setting of MMDetection 2.x configs, which "
                                 f"MMDetection 3.x (MMEngine's Runner) does not read, so it would change nothing: "
                                 f"give {successor} instead")


def check_file_keys(cfg: Config, files: Sequence[tuple], overrides: Mapping[str, Any],
                    reads: Optional[CommandReads] = None) -> None:
    """Refuse a key of the merged config that the class its dict builds does not take, as check_override_keys
    refuses an override's new key: a typo in a config file (`optim_wrapper.optimizer.betas_`,
    `train_cfg.max_epoch`) failed with a TypeError traceback inside runner.train(), or was blamed on the loaders.
    Checked are the dicts with a `type`, the loop dicts (train_cfg, ...) and the loaders' dicts, under the
    top-level keys the command reads (`reads`; None: all a Runner reads), of the model down to its parts only
    (MODEL_DEPTH_CHECKED); the error names the --config (or the override) that gave the key, and the later one
    that changed the dict's type where one did (_later_type). `files`: (path, its settings) in order, as
    load_config merged them."""
    read = set(reads.keys) if reads is not None else runner_keys()
    for parent, node in _config_dicts({k: v for k, v in cfg.items() if k in read}):
        parts = parent.split(".")
        if parts[0] in FILE_KEYS_CHECKED_ELSEWHERE or parts[0] == "model" and len(parts) > MODEL_DEPTH_CHECKED:
            continue
        for part in node:
            key = f"{parent}.{part}"
            if part == "type" or _builder_key(str(part), parent, node):
                continue
            if reads is not None and reads.unread(key) is not None:  # the command does not read it: not its to judge
                continue
            try:
                problem = _unknown_argument(node, str(part), parent)
            except ImportError:  # a registry that cannot be imported (mmcv without its ops): the Runner's to say
                continue
            if problem:
                typed = next((o for o in overrides if _under(f"{parent}.type", o)), None)
                given = next((o for o in overrides if _under(key, o)), None)
                origin = f"override {given}" if given else _file_origin(key, files)
                after = f" (its type set by the override {typed})" if typed and not given else ""
                retyped = None if typed or given else _later_type(key, f"{parent}.type", files)
                if retyped is not None:
                    after = f" (its type set by --config {retyped}; give _delete_=True there to replace the dict)"
                text, close = problem
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise DetectionError(f"{origin}: {key}{after}: {text}{hint}: fix the key, or drop it")


def _under(key: str, given: str) -> bool:
    """Whether the dotted `key` is the override key `given` or lies below it."""
    return key == given or key.startswith(given + ".")


def _config_dicts(tree: Any, prefix: str = "") -> List[tuple]:
    """(dotted key, dict) of every dict below `tree` (list items by index), outermost first."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    found = []
    for name, inner in items:
        path = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(inner, dict):
            found.append((path, inner))
        found += _config_dicts(inner, path)
    return found


def _file_origin(key: str, files: Sequence[tuple]) -> str:
    """`--config PATH` of the last of `files` ((path, its settings)) that sets the dotted `key`, or of them all
    where none alone does (a key merged from several)."""
    found = _file_setting(key, files)
    return f"--config {found if found is not None else ' '.join(path for path, _ in files)}"


def _later_type(key: str, type_key: str, files: Sequence[tuple]) -> Optional[str]:
    """The path of the file of `files` that sets `type_key` (a dict's type) where it comes after the last one that
    sets `key` in that dict: the later file changed the class and MMEngine merged the earlier keys into it (SGD's
    type under the Swin recipe's AdamW betas); None otherwise."""
    paths = [path for path, _ in files]
    typed, keyed = _file_setting(type_key, files), _file_setting(key, files)
    if typed is None or keyed is None or paths.index(typed) <= paths.index(keyed):
        return None
    return typed


def _file_setting(key: str, files: Sequence[tuple]) -> Optional[str]:
    """The path of the last of `files` ((path, its settings)) that sets the dotted `key`, or None."""
    for path, tree in reversed(files):
        node: Any = tree
        for part in key.split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                break
        else:
            return path
    return None


def check_hooks(cfg: Config) -> None:
    """Refuse a custom hook of `cfg` that cannot be built with its arguments (a typo of the config file or of an
    override such as `custom_hooks.0.lamm=0.01`), naming it: a hook taking **kwargs (CD's passes them on to
    ColinearityDecay) checks them only when MMEngine's Runner builds it, with a TypeError. Each is built here
    once, as the Runner would, and dropped (a hook's constructor only stores and checks its arguments); a TweoHook's
    clash with activation_checkpointing is refused too (check_tweo_checkpointing), and so is an entry of
    default_hooks the Runner would fail on (check_default_hooks)."""
    from mmdet.registry import HOOKS
    check_default_hooks(cfg)
    for index, hook in enumerate(cfg.get("custom_hooks") or []):
        hook = copy.deepcopy(hook)
        hook.pop("priority", None)  # the Runner's, not the hook's
        try:
            built = HOOKS.build(hook)
        except (TypeError, ValueError, KeyError) as e:
            raise DetectionError(f"custom_hooks.{index} ({hook.get('type')}) cannot be built with its arguments "
                                 f"({type(e).__name__}: {e}); fix them in the config file or the override") from None
        if isinstance(built, TweoHook):
            check_tweo_checkpointing(cfg, built)


# the hooks MMEngine's Runner registers of its own (Runner.register_default_hooks): an entry of default_hooks of
# one of these names replaces it whole, and None leaves it out; an entry of another name adds a hook, None there
# fails the Runner's assertion
RUNNER_DEFAULT_HOOKS = ("runtime_info", "timer", "sampler_seed", "logger", "param_scheduler", "checkpoint")
# what CheckpointHook gives Runner.save_checkpoint itself; its **kwargs go there as well, so only the other
# parameters of save_checkpoint are arguments the hook takes (none in MMEngine 0.10)
CHECKPOINT_HOOK_PASSES = ("out_dir", "filename", "file_client_args", "save_optimizer", "save_param_scheduler", "meta",
                          "by_epoch", "backend_args")


def check_default_hooks(cfg: Config) -> None:
    """Refuse an entry of `cfg.default_hooks` that MMEngine's Runner would fail on, naming it, before the Runner
    is built: a dict without a `type` (a misspelt hook name, `default_hooks.chekpoint.interval=2`: a KeyError
    traceback), a key its hook does not take (`default_hooks.checkpoint.intervall=2`: CheckpointHook stores it
    and Runner.save_checkpoint fails with a TypeError at the first checkpoint, after a whole epoch), an unknown
    hook type, a value that is no hook's dict, and None under a name not among MMEngine's own hooks (the Runner
    asserts; None leaves out one of RUNNER_DEFAULT_HOOKS, as MMEngine documents). The hooks are not built here, as
    custom hooks are (check_hooks): DetVisualizationHook's constructor needs the visualizer the Runner makes."""
    hooks = cfg.get("default_hooks") or {}
    for name, hook in hooks.items():
        where = f"default_hooks.{name}"
        if hook is None:
            if name not in RUNNER_DEFAULT_HOOKS:
                raise DetectionError(f"{where}=None: MMEngine's Runner leaves out only its own default hooks with "
                                     f"None ({', '.join(RUNNER_DEFAULT_HOOKS)}) and fails on another; to train "
                                     f"without {name}, give default_hooks without it in a config file as a later "
                                     "--config (`default_hooks = dict(_delete_=True, ...)`)")
            continue
        if not isinstance(hook, dict):  # a Hook object (from a Python config) is registered as it is
            if not isinstance(hook, Hook):
                raise DetectionError(f"{where}={hook!r}: give a hook's dict (with its `type`)"
                                     f"{', or None to leave it out' if name in RUNNER_DEFAULT_HOOKS else ''}")
            continue
        if hook.get("type") is None:
            named = sorted({str(n) for n, h in hooks.items() if isinstance(h, dict) and h.get("type") is not None}
                           | set(RUNNER_DEFAULT_HOOKS))
            close = [c for c in difflib.get_close_matches(str(name), named, n=3) if c != name]
            hint = f" (did you mean {', '.join('default_hooks.' + c for c in close)}?)" if close else ""
            raise DetectionError(f"{where} has no `type`{hint}: MMEngine's Runner builds each entry of "
                                 "default_hooks as a hook, whole (one named as the Runner's own replaces it); "
                                 "change a key of a hook the config has, or give the new hook's type")
        _check_hook_arguments(hook, where)


def _check_hook_arguments(hook: dict, where: str) -> None:
    """Refuse a key of the hook dict `hook` (at `where`) that its type does not take, or a type no registry
    holds."""
    kind = hook["type"]
    cls = kind if inspect.isclass(kind) else _registered_hook(kind) if isinstance(kind, str) else False
    if cls is False:  # not known here (the Runner, which could not import the registry either, says why)
        return
    if cls is None:
        raise DetectionError(f"{where}.type={kind}: no hook of that name is registered in MMDetection or MMEngine; "
                             "give a registered hook's type (custom_imports imports the module of one of your own)")
    takes = _hook_arguments(cls)
    if takes is None:
        return
    for key in hook:
        if key == "type" or str(key).startswith("_") or key in BUILDER_KEYS["*"]:
            continue
        if key not in takes:
            close = difflib.get_close_matches(str(key), sorted(takes), n=3)
            hint = f" (did you mean {', '.join(where + '.' + c for c in close)}?)" if close else ""
            passed = (", and MMEngine's Runner.save_checkpoint, which it hands the keys it does not take, fails on it"
                      if issubclass(cls, CheckpointHook) else "")
            raise DetectionError(f"{where}.{key}: {cls.__name__} ({where}) takes no argument '{key}'{hint}{passed}: "
                                 "fix it in the config file or the override")


def _registered_hook(kind: str) -> Any:
    """The hook class registered as `kind` (MMDetection's registry, which falls back to MMEngine's), None where
    none is, or False where the registry cannot be imported (mmcv without its compiled ops)."""
    from mmdet.registry import HOOKS
    try:
        return HOOKS.get(kind)
    except ImportError:
        return False


def _hook_arguments(cls: type) -> Optional[set]:
    """The keyword arguments the hook class `cls` takes, or None where that is not known (a **kwargs of a hook
    other than CheckpointHook, a signature that cannot be read). CheckpointHook's **kwargs go to
    Runner.save_checkpoint besides the arguments it gives that itself (CHECKPOINT_HOOK_PASSES)."""
    try:
        parameters = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return None
    takes = {n for n, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self"}
    if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        if not issubclass(cls, CheckpointHook):
            return None
        takes |= set(inspect.signature(Runner.save_checkpoint).parameters) - {"self"} - set(CHECKPOINT_HOOK_PASSES)
    return takes


def check_tweo_checkpointing(cfg: Config, hook: TweoHook) -> None:
    """Refuse an `activation_checkpointing` entry of `cfg` (read by MMEngine's Runner.train) naming a module that
    strictly contains a block the TweoHook `hook` penalizes, as the hook's before_train would once the Runner, the
    data and the work dir are made (cd/integrations/mmengine_tweo.py: reentrant checkpointing leaves those blocks out
    of the term and runs them again in the backward pass). The module names are those of the built detector: it is
    built here for them, on the CPU and only when both settings are given (under a second for Swin-T)."""
    names = cfg.get("activation_checkpointing")
    if not names:
        return
    from mmdet.registry import MODELS
    try:
        model = MODELS.build(copy.deepcopy(cfg.model))
        refusal = hook.checkpointing_refusal(model, names)
    except Exception:  # noqa: BLE001 - a model that cannot be built, or a module= it lacks, is the Runner's error
        return
    if refusal is not None:
        raise DetectionError(refusal)


def _uses(cfg: Config, variable: str, read: set) -> List[str]:
    """Dotted keys under the `read` top-level keys of `cfg` that hold the value of its top-level `variable`: where
    it was copied to (train_pipeline -> train_dataloader.dataset.pipeline, pretrained ->
    model.backbone.init_cfg.checkpoint); a number or flag only under a name like the variable's, one ending as
    it does or in its last word (max_epochs, total_epochs -> train_cfg.max_epochs: another 12 is no copy).
    MMDetection's base files tag their own dicts with a `_scope_` that the copies lack: it is not compared."""
    value, found = _unscoped(cfg[variable]), []
    any_name = isinstance(value, (str, list, dict)) and bool(value)
    word = variable.split("_")[-1]

    def alike(name: str) -> bool:
        return variable.endswith(name) or name.endswith(variable) or name.split("_")[-1] == word

    def walk(prefix, node):
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for name, inner in items:
            path, name = f"{prefix}.{name}" if prefix else str(name), str(name)
            if _unscoped(inner) == value and (any_name or alike(name)):
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
            if depth == 0:
                _check_no_index(key, parts)
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


def _check_no_index(key: str, parts: list) -> None:
    """Refuse a list index below a top-level key the config lacks (`parts[0]`): MMEngine's merge builds dicts
    there, so `custom_hooks.0.lam=0.01` on a config without custom_hooks made custom_hooks {'0': {'lam': 0.01}}, a
    dict keyed '0' that no reader of a list takes (the hooks' check failed on it with an AttributeError traceback).
    Below a None or a number of the config the merge itself refuses a dict (load_config names the override)."""
    index = next((part for part in parts[1:] if part.isdigit()), None)
    if index is None:
        return
    top = parts[0]
    fragments = " (a method's hook: its fragment, e.g. configs/detection/method/cd.py)" if top == "custom_hooks" else ""
    raise DetectionError(f"override {key}: the config has no {top}, so there is no list to index with {index} "
                         f"(MMEngine would make a dict keyed '{index}'); to add {top}, give a config file that sets "
                         f"it as a later --config{fragments}")


def _check_new_key(node: dict, part: str, parent: str, key: str) -> None:
    """Refuse the new key `part` of the dict `parent` (`node`) when nothing would read it (check_override_keys)."""
    if _builder_key(part, parent, node) or parent.split(".")[0] in OPEN_DICTS:
        return
    if parent not in LOADERS and node.get("type") is None and _loop_class(parent, node) is None:
        close = difflib.get_close_matches(part, [str(k) for k in node], n=3)
        hint = f" (did you mean {', '.join(parent + '.' + c for c in close)}?)" if close else ""
        raise DetectionError(f"override {key}: the config has no such key{hint}, and {parent} (a dict without a "
                             f"`type`) is read for the keys it has only; to add a key its code reads, set it in a "
                             "config file given as a later --config")
    problem = _unknown_argument(node, part, parent)
    if problem:
        text, close = problem
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise DetectionError(f"override {key}: {text}{hint}")


def _builder_key(part: str, parent: str, node: dict) -> bool:
    """Whether the key `part` of the dict `parent` (`node`) is taken out by what builds it rather than passed to
    its class (BUILDER_KEYS: a hook's priority, a loader's num_batch_per_epoch, ...; a train loop's by_epoch
    without a type; a scheduler's convert_to_iter_based and epoch_length; a norm layer's requires_grad), or is
    MMEngine's own (`_scope_`, `_delete_`)."""
    if part.startswith("_") or part in BUILDER_KEYS["*"] + BUILDER_KEYS.get(parent, ()):
        return True
    if parent == "train_cfg" and "type" not in node:
        return part == "by_epoch"  # Runner.build_train_loop picks the loop's class by it
    if re.fullmatch(r"param_scheduler(\.\d+)?", parent):  # mmengine build_scheduler_from_cfg
        return part in ("convert_to_iter_based", "epoch_length")
    return parent.split(".")[-1].endswith("norm_cfg") and part == "requires_grad"  # mmcv build_norm_layer


def _loop_class(parent: str, node: dict) -> Optional[type]:
    """The loop class MMEngine's Runner builds from the top-level loop dict `parent` (`node`) that has no `type`
    (Runner.build_train_loop: by_epoch picks an epoch or an iteration loop; build_val_loop, build_test_loop), or
    None for another dict."""
    from mmengine.runner import EpochBasedTrainLoop, IterBasedTrainLoop, TestLoop, ValLoop
    if "type" in node or parent not in LOOP_KEYS:
        return None
    if parent == "train_cfg":
        return EpochBasedTrainLoop if node.get("by_epoch", True) else IterBasedTrainLoop
    return ValLoop if parent == "val_cfg" else TestLoop


def _unknown_argument(node: dict, part: str, parent: str) -> Optional[tuple]:
    """Why the key `part` of the dict `parent` (`node`) is passed to a class that does not take it, with the
    dotted keys of the arguments it may have meant, or None. A loader's dict is torch's DataLoader arguments, a
    dict with a `type` builds that registered class, a loop dict without one the class the Runner builds it as
    (_loop_class); None also where the arguments are not known (a **kwargs, a class no registry holds, a dict of
    another kind)."""
    loop = _loop_class(parent, node)
    if parent in LOADERS:
        takes, what = loader_arguments() | {"dataset"}, "torch's DataLoader"
    elif node.get("type") is not None:
        takes, what = _init_parameters(node["type"]), f"{node['type']} ({parent})"
    elif loop is not None:
        takes, what = _init_parameters(loop), f"{loop.__name__} ({parent}, the loop MMEngine's Runner builds from it)"
    else:
        return None
    if takes is None or part in takes:
        return None
    close = difflib.get_close_matches(part, sorted(takes - {"self"}), n=3)
    return f"{what} takes no argument '{part}'", [f"{parent}.{c}" for c in close]


def loader_arguments() -> set:
    """The arguments of torch's DataLoader that a loader's dict may set besides its dataset (self excluded)."""
    return set(inspect.signature(torch.utils.data.DataLoader.__init__).parameters) - {"self", "dataset"}


def _init_parameters(kind: Any) -> Optional[set]:
    """The keyword arguments the class registered as `kind` takes (in MMDetection's or MMEngine's registries),
    or None where that is not known: no registered class, a **kwargs handed to no parent's __init__
    (_class_arguments), a signature that cannot be read."""
    from mmengine.registry import Registry
    import mmdet.registry as registries
    found = [kind] if callable(kind) else [c for r in vars(registries).values() if isinstance(r, Registry)
                                           for c in [r.get(kind)] if c is not None]
    taken: set = set()
    for builder in found:
        takes = _class_arguments(builder) if inspect.isclass(builder) else _signature_arguments(builder)
        if takes is None:
            return None
        taken |= takes
    return taken or None


def _class_arguments(cls: type) -> Optional[set]:
    """The keyword arguments the class `cls` takes: its __init__'s, and where that takes **kwargs, those of the
    __init__s up its MRO that it hands them to (MMEngine's MultiStepLR: LRSchedulerMixin's **kwargs go to
    MultiStepParamScheduler; CocoDataset's to BaseDataset), up to the first without **kwargs; None where one does
    more with its **kwargs than hand them to its parent (_hands_kwargs_to_parent), where every one takes **kwargs
    (the keys go to no signature read here), or where a signature cannot be read."""
    taken: set = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):  # inherited: its parent's __init__ comes later in the MRO
            continue
        takes = _signature_arguments(klass.__init__)
        if takes is None:
            return None
        taken |= takes - {"**"}
        if "**" not in takes:
            return taken
        if not _hands_kwargs_to_parent(klass.__init__):  # read, dropped or passed elsewhere: not known here
            return None
    return None


def _hands_kwargs_to_parent(init: Any) -> bool:
    """Whether the __init__ `init` does nothing with its **kwargs but hand them on whole to its parent's
    (`super().__init__(..., **kwargs)`): some read a key out of them first (MMCV's MultiheadAttention), pass them
    to another class, or drop them (RPN, BaseBBoxCoder), and what those take is not told by the parents."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    except (OSError, TypeError, SyntaxError):
        return False
    function = tree.body[0] if tree.body and isinstance(tree.body[0], ast.FunctionDef) else None
    if function is None or function.args.kwarg is None:
        return False
    name = function.args.kwarg.arg
    handed = [k for node in ast.walk(function) if isinstance(node, ast.Call) and _is_super_init(node.func)
              for k in node.keywords if k.arg is None and isinstance(k.value, ast.Name) and k.value.id == name]
    uses = [node for node in ast.walk(function) if isinstance(node, ast.Name) and node.id == name]
    return len(handed) == 1 and len(uses) == 1


def _is_super_init(func: ast.expr) -> bool:
    """Whether `func` is `super().__init__` (or `super(Cls, self).__init__`)."""
    return (isinstance(func, ast.Attribute) and func.attr == "__init__" and isinstance(func.value, ast.Call)
            and isinstance(func.value.func, ast.Name) and func.value.func.id == "super")


def _signature_arguments(function: Any) -> Optional[set]:
    """The parameter names of `function`, with "**" where it takes **kwargs; None where its signature cannot be
    read or it takes **kwargs and is no class's __init__ (a builder function's keys go elsewhere)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return None
    names = {n for n, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return names | {"**"} if function.__name__ == "__init__" else None
    return names
