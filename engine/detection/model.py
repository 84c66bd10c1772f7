"""Detector weights: the backbone's pretrained checkpoint and a training's `load_from` checked against the model
before training, a detector built from an evaluation checkpoint (refused where its weights or classes do not fit),
and the training method a checkpoint's config names."""
from __future__ import annotations

import copy
import os
import re
import tempfile
from typing import Dict, List, Optional

import torch
from torch import nn
from mmengine.config import Config
from mmdet.registry import MODELS

from cd.decay import DEFAULT_LAM, decays_nothing
from cd.integrations.mmengine import type_name
from cd.tweo import EPS, TAU, adds_nothing
from engine.checkpoint import is_run_checkpoint
from engine.detection.errors import DetectionError
from models.modules import nonfinite_tensors

def check_checkpoint_classes(model: nn.Module, loader, checkpoint: str) -> None:
    """Refuse a checkpoint trained on other classes, or on the same ones in another label order, than the data set
    `loader` scores (its labels are the config's classes, check_annotations): the metric would score each of its
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


def check_checkpoint_file(path: str, what: str) -> None:
    """Refuse, naming it as `what` (`--checkpoint X`, `load_from=X`), a checkpoint path that is a folder, no
    file, or a checkpoint of train.py: before a detector is built to load it into."""
    if os.path.isdir(path):  # a work dir: MMEngine names its latest checkpoint in last_checkpoint
        raise DetectionError(f"{what} is a folder: give a checkpoint file in it (epoch_<N>.pth, or the one its "
                             "last_checkpoint names)")
    if not os.path.isfile(path):
        raise DetectionError(f"{what}: no such file")
    if is_run_checkpoint(path):  # train.py's checkpoint.pt / best.pt: a classifier's or language model's
        raise DetectionError(f"{what} is a checkpoint of train.py (an image classifier or language model), not of "
                             "a detector: give the .pth scripts/train_detection.py wrote")


def read_state(path: str, what: str) -> tuple:
    """(payload, state dict without DDP's `module.` prefixes) of the MMEngine checkpoint at `path`, or one error
    line naming it as `what`: check_checkpoint_file's cases, an unreadable file, a file holding no state dict."""
    check_checkpoint_file(path, what)
    # An MMEngine checkpoint pickles its message hub (mmengine / numpy objects) beside the weights, which
    # torch >= 2.6's weights_only loader refuses; the file is the one the user names.
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same one-line error
        raise DetectionError(f"{what}: cannot be read ({type(e).__name__}: {e})") from None
    state = payload.get("state_dict", payload) if isinstance(payload, dict) else None
    if not isinstance(state, dict) or not state:
        raise DetectionError(f"{what}: holds no state_dict")
    return payload, {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}


def _bare_detector(cfg: Config) -> nn.Module:
    """The detector of `cfg` without its backbone's init_cfg (the weights come from a checkpoint)."""
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.get("backbone", {}).pop("init_cfg", None)
    return MODELS.build(model_cfg)


def build_detector(cfg: Config, checkpoint: str, device: torch.device) -> nn.Module:
    """The detector of `cfg` with the weights of `checkpoint` (an MMEngine checkpoint: `state_dict` and
    `meta`), in eval mode. Weights of another model are refused with their mismatched keys named."""
    what = f"--checkpoint {checkpoint}"
    check_checkpoint_file(checkpoint, what)  # before the model is built
    model = _bare_detector(cfg)
    payload, state = read_state(checkpoint, what)
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
    trained = training_config(meta)
    model.training_method = None if trained is None else method_of(trained)
    model.settings_warning = None if trained is None else settings_warning(trained, cfg, checkpoint)
    return model.to(device).eval()


# model settings read only in training (the weights' start, the losses and samplers, dropout and stochastic depth,
# activation checkpointing, frozen stages, batch augments): a checkpoint trained with other values is the same
# detector in evaluation. `_scope_` is the registry MMEngine adds to every dict it merges
TRAINING_ONLY = re.compile(r"^(_scope_|init_cfg|pretrained|convert_weights|train_cfg|with_cp|frozen_stages|"
                           r"(drop|attn_drop|drop_path)_rate|batch_augments|loss_\w+)$")


def setting_differences(trained, given, prefix: str = "model") -> List[str]:
    """'KEY GIVEN (trained TRAINED)' for each setting under `prefix` whose value in the config `given` differs from
    that in the training config `trained` (dicts compared key by key, a missing key as 'unset'; a registry type
    with or without its scope alike), leaving out the TRAINING_ONLY ones."""
    if isinstance(trained, dict) and isinstance(given, dict):
        return [line for key in sorted(set(trained) | set(given), key=str) if not TRAINING_ONLY.match(str(key))
                for line in setting_differences(trained.get(key, _UNSET), given.get(key, _UNSET), f"{prefix}.{key}")]
    if prefix.endswith(".type") and isinstance(trained, str) and isinstance(given, str):
        trained, given = type_name(trained), type_name(given)
    if trained == given:
        return []
    return [f"{prefix} {'unset' if given is _UNSET else given} (trained {'unset' if trained is _UNSET else trained})"]


_UNSET = object()  # a key one config has and the other has not


def settings_warning(trained: Config, cfg: Config, checkpoint: str) -> Optional[str]:
    """The warning for a --checkpoint whose training config `trained` built its model with other settings than the
    evaluation's `cfg` gives (setting_differences: a data preprocessor's mean / std, a qk_scale, a test threshold),
    or None: its weights fit (the same shapes), so it is scored as asked, with `cfg`'s model, which computes other
    outputs from them than the model that was trained."""
    differences = setting_differences(trained.get("model") or {}, cfg.model.to_dict())
    if not differences:
        return None
    return (f"--checkpoint {checkpoint} was trained with other model settings than --config gives: "
            f"{'; '.join(differences[:3])}{f' and {len(differences) - 3} more' if len(differences) > 3 else ''}; "
            "scored with --config's (evaluate with the training config to score the detector as it was trained)")


# the layers whose shapes follow the number of classes: a detector fine-tuned on another data set from a COCO
# checkpoint (load_from) starts them anew, as MMEngine does when it skips weights of another shape
CLASS_LAYERS = re.compile(r"(^|\.)(bbox_head|mask_head)(\.\d+)?\.(fc_cls|fc_reg|conv_logits)\.")


def check_load_from(cfg: Config) -> None:
    """Refuse a `load_from` of a new training run that MMEngine would load with a traceback inside runner.train()
    (a missing file, a folder), download (a URL: nothing is downloaded here), or load without a word though it
    does not fit the detector: MMEngine loads with strict=False and only logs the weights it leaves, so another
    model's checkpoint trained from random weights. Weights of another shape are allowed only in the layers that
    predict the classes (CLASS_LAYERS: fine-tuning a COCO detector on other classes)."""
    path = cfg.get("load_from")
    if not path:
        return
    what = f"load_from={path}"
    if "://" in str(path):
        raise DetectionError(f"{what} is a URL and nothing is downloaded here: download it and give the local path")
    _, state = read_state(str(path), what)
    own = _bare_detector(cfg).state_dict()
    refit = {k for k in set(own) & set(state) if CLASS_LAYERS.search(k) and own[k].shape != state[k].shape}
    misfit = mismatch(own, {k: v for k, v in state.items() if k not in refit}, needed=set(own) - refit)
    if misfit:
        raise DetectionError(f"{what} does not fit the model of --config: {misfit} weights; give a checkpoint of "
                             "this detector (or None to train from the backbone's init_cfg)")


# the hooks of configs/detection/method/ and the method each stands for (Table 2's rows)
METHOD_HOOKS = {"ColinearityDecayHook": "CD", "TweoHook": "TWEO", "WeightNoiseHook": "Noise"}
# each hook's settings that the label names where they differ from the values of configs/detection/method/*.py (the
# hooks' defaults too): runs of a sweep or an ablation are told apart, as result_table.method_name names a
# classifier's. A setting's note is made from its value by the function beside it; TWEO's `form` (the same term,
# computed with less memory) and `layouts` (where the blocks' parts are found) are no other method
LABELLED_SETTINGS = {
    "ColinearityDecayHook": {"lam": (DEFAULT_LAM, lambda v: f"lam {_shown(v)}"),
                             "targets": ("A+B", lambda v: f"targets {v}")},
    "TweoHook": {"lam": (1e-4, lambda v: f"lam {_shown(v)}"), "rescale": (True, lambda v: "no rescale"),
                 # tau and eps: the values TWEO takes for their null (cd.tweo), so that null and those alike are one
                 "p": (4.0, lambda v: f"p {_shown(v)}"), "tau": (TAU, lambda v: f"tau {_shown(v)}"),
                 "eps": (EPS, lambda v: f"eps {_shown(v)}"), "schedule": ("constant", str),
                 "total_steps": (None, lambda v: f"{_shown(v)} steps")},
    "WeightNoiseHook": {"bits": (4, lambda v: f"bits {_shown(v)}"),
                        # a set: the order the layer types are listed in does not change which layers get noise
                        "layer_types": ({"Linear"}, lambda v: f"layers {'+'.join(sorted(v))}"),
                        "seed": (0, lambda v: f"seed {_shown(v)}")},
}


def _shown(value) -> str:
    """A number as result_table.method_name writes it; anything else as it is."""
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def training_config(meta: dict) -> Optional[Config]:
    """The training config an MMEngine checkpoint keeps (meta["cfg"], its text), or None where it keeps no readable
    one (a file converted or written elsewhere)."""
    text = meta.get("cfg") if isinstance(meta, dict) else None
    if not isinstance(text, str):
        return None
    with tempfile.TemporaryDirectory() as folder:  # Config.fromstring leaves its file behind on an error
        path = os.path.join(folder, "training_config.py")
        with open(path, "w") as f:
            f.write(text)
        try:  # read, not built: the modules of its custom_imports need not be importable here
            return Config.fromfile(path, import_custom_modules=False)
        except Exception:  # noqa: BLE001 - MMEngine executes the text: any failure means "not known"
            return None


def method_of(cfg: Config) -> str:
    """"CD", "TWEO", "Noise" (joined by " + " in that order when several, as result_table.method_name joins a
    classifier's: one method in both panels of Fig. 1), each with the settings that differ from
    configs/detection/method/*.py (`method_label`: "CD (lam 0.01)"), from the custom_hooks of the training config
    `cfg`; "Baseline" when it ran none of their hooks, or only CD or TWEO hooks that change nothing (`changes_nothing`:
    custom_hooks.0.lam=0 made no update in any step, so Fig. 1 would have plotted a baseline as CD or TWEO)."""
    hooks = [hook for hook in cfg.get("custom_hooks") or [] if isinstance(hook, dict) and not changes_nothing(hook)
             and type_name(hook.get("type")) in METHOD_HOOKS]  # mmdet.X too
    # in METHOD_HOOKS' order whatever the config's: the order the fragments were given in (cd.py, then tweo.py, or
    # the other way round) trains the same detector, bit for bit
    order = list(METHOD_HOOKS)
    # no cd_budget key: written before it existed, when configs/detection/method/cd.py set the budgeted weight decay
    # itself (0.045), so nothing is said of the budget (None), as the label before it read
    labels = sorted((order.index(type_name(hook.get("type"))), method_label(hook, cfg.get("cd_budget")))
                    for hook in hooks)
    return " + ".join(label for _, label in labels) or "Baseline"


def method_label(hook: dict, budget) -> str:
    """The method of the custom_hooks entry `hook` (a METHOD_HOOKS type) with the settings that differ from
    configs/detection/method/*.py (LABELLED_SETTINGS; the part of the model it acts on where that is not the
    backbone; a CD hook's lam_per_role, and "no budget" where the config's `budget` (its cd_budget) is False, the
    weight decay left as given, at a lam above 0 (at lam 0 the rule leaves it as given too); None, no cd_budget, says
    nothing), e.g. "CD (lam 0.01)", "TWEO (no rescale)",
    "Noise (seed 1)": without them two runs of a sweep were one method, drawn in one colour at one place of Fig. 1."""
    kind = type_name(hook.get("type"))
    notes = []
    for key, (default, note) in LABELLED_SETTINGS[kind].items():
        value = hook.get(key)
        value = default if value is None else value  # a hook's null setting is its default
        if isinstance(default, set) and isinstance(value, (list, tuple)):
            value = set(value)
        if value != default:
            notes.append(note(value))
    module = hook.get("module")  # None: the backbone, as "backbone" names it (cd.integrations.select_module)
    if module not in (None, "backbone"):
        notes.append(f"on {module or 'the whole model'}")
    if kind == "ColinearityDecayHook":
        per_role = hook.get("lam_per_role") or {}
        notes += [f"{role} {_shown(lam)}" for role, lam in sorted(per_role.items(), key=lambda item: str(item[0]))] \
            if isinstance(per_role, dict) else []
        # the rule lowers the weight decay by lam: at lam 0 a run without it trains as one with it
        strength = DEFAULT_LAM if hook.get("lam") is None else hook.get("lam")
        notes += ["no budget"] if budget is False and strength != 0 else []
    return f"{METHOD_HOOKS[kind]} ({', '.join(notes)})" if notes else METHOD_HOOKS[kind]


def changes_nothing(hook: dict) -> bool:
    """Whether the custom_hooks entry `hook` trains as the baseline does: a TweoHook at lam 0 (cd.tweo.adds_nothing:
    its term is 0 x L_TWEO at every step, whatever the schedule, a gradient of zeros), or a ColinearityDecayHook whose
    every strength is 0 (cd.decay.decays_nothing: lam 0, its default ColinearityDecay's, and no lam_per_role entry
    above 0, since a role without one takes lam), whose decoupled update is skipped in every step (cd/decay.py) and
    whose budget leaves the weight decay as given. The rule of engine.result_table.method_name for a classifier's
    tweo.lam=0 and cd.lam=0, whose trainings end with the baseline's weights
    (tests/test_method_of_a_training_that_changes_nothing.py)."""
    if type_name(hook.get("type")) == "TweoHook":
        return adds_nothing(hook.get("lam"))
    if type_name(hook.get("type")) != "ColinearityDecayHook":
        return False
    return decays_nothing(hook.get("lam", DEFAULT_LAM), hook.get("lam_per_role"))
