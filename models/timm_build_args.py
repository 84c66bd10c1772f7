"""model.kwargs entries that timm's model building consumes itself instead of passing them to the model's
constructor, refused with what to set instead.

timm's `create_model` and `build_model_with_cfg` (timm.models._factory, timm.models._builder) take these by name or
pop them from the keyword arguments: they fetch or look up hub weights, load a checkpoint, place or cast the model,
switch layers for TorchScript / ONNX, or wrap the model as a feature extractor. Given as model.kwargs they would act
outside what build_model builds, loads (models/pretrained.py's checks) and records, or be dropped without a word:
`pretrained_cfg_overlay: {file: ...}` is read only for hub weights, so a run given it would train from random
init. The
arguments with a ModelConfig key of their own (num_classes, pretrained, pretrained_strict, checkpoint_path, ...)
are models/factory.py's FIRST_CLASS_KEYS.

`create_timm_model` is timm's create_model for those arguments, leaving model.drop_path=0 out for a model without
stochastic depth (no drop_path_rate argument).
"""
from __future__ import annotations

import timm
import torch.nn as nn

_HUB_CONFIG = ("timm's configuration of hub weights, read only when it fetches them; give a local weights file as "
               "model.pretrained=FILE{}, or the weights' tag in model.name (e.g. vit_base_patch16_224.augreg_in21k) "
               "with model.pretrained=hub")
_LAYER_CONFIG = ("timm's layer configuration for TorchScript / ONNX export, which training and evaluation here do "
                 "not use; leave it out (train.compile=true compiles the model)")
_FEATURES = ("timm's feature-extraction wrapper (feature maps instead of class scores), which training and "
             "evaluation here cannot use; leave it out")

# name -> why it is refused and what to set instead
TIMM_BUILD_ARGS: dict[str, str] = {
    # create_model's own arguments
    "pretrained_cfg": _HUB_CONFIG.format(""),
    "pretrained_cfg_overlay": _HUB_CONFIG.format(" (and its normalization as data.mean / data.std)"),
    "cache_dir": ("timm's download folder for hub weights, not a model setting; set the HF_HOME (Hugging Face) or "
                  "TORCH_HOME environment variable, or give a local weights file as model.pretrained=FILE"),
    "scriptable": _LAYER_CONFIG,
    "exportable": _LAYER_CONFIG,
    "no_jit": _LAYER_CONFIG,
    # create_model leaves these out of the model's recorded arguments: a placement and a cast of the built model
    "device": "the model is built on the CPU and moved to the run's device; set train.device instead",
    "dtype": ("the model is built in float32 and run under autocast; set the precision with train.amp "
              "(fp16 / bf16) instead"),
    # build_model_with_cfg's own arguments
    "model_cfg": ("timm's architecture config of the model's entry point; give the architecture's arguments as "
                  "model.kwargs entries, or another model.name"),
    "feature_cfg": _FEATURES,
    "pretrained_filter_fn": ("timm's conversion of hub weights; a local file (model.pretrained) goes through the "
                             "model family's own conversion already"),
    "kwargs_filter": "timm's filter of its entry points' constructor arguments; leave it out",
    "pretrained_model_args": ("timm's record of the arguments of a model from the Hugging Face hub; give them as "
                              "model.kwargs entries"),
    # ... and those it pops from the constructor arguments
    "pruned": ("timm adapts a model to its own pruned layouts with it; give a pruned model's timm name as "
               "model.name (e.g. efficientnet_b1_pruned)"),
    "features_only": _FEATURES,
    "out_indices": _FEATURES,
    "feature_cls": _FEATURES,
}


def build_args_problem(kwargs: dict) -> str:
    """The error line for the first (by name) entry of `kwargs` (model.kwargs) that timm's building consumes
    itself; '' for none."""
    given = sorted(set(kwargs) & set(TIMM_BUILD_ARGS))
    if not given:
        return ""
    return f"model.kwargs.{given[0]}: {TIMM_BUILD_ARGS[given[0]]}"


def create_timm_model(arch: str, kwargs: dict, **build) -> nn.Module:
    """timm.create_model(`arch`, **`build`, **`kwargs`) (`kwargs`: models/factory.py's model_kwargs, which always
    hold drop_path_rate, model.drop_path's). At drop_path_rate=0 (no stochastic depth) a model that has none, whose
    constructor takes no such argument (timm's VGG, DenseNet, DLA, HRNet, ...), is built without it: asked is what
    it is. Where the model takes the argument, 0 is passed rather than left out, which would build the entry point's
    own rate (timm's fasternet, nextvit and tiny_vit entry points set one). A rate above 0 for a model without the
    argument raises timm's TypeError (build_model refuses it naming model.drop_path)."""
    try:
        return timm.create_model(arch, **build, **kwargs)
    except TypeError as e:
        # raised where the constructor's arguments are bound, before its body has built (or drawn) anything
        if kwargs.get("drop_path_rate") != 0 or not rejects_argument(e, "drop_path_rate"):
            raise
    return timm.create_model(arch, **build, **{key: value for key, value in kwargs.items() if key != "drop_path_rate"})


def rejects_argument(error: TypeError, name: str) -> bool:
    """Whether `error` refuses the keyword argument `name`: Python's "got an unexpected keyword argument 'NAME'", or
    timm's own "got unexpected keyword argument(s): [...]" of constructors that take **kwargs (HRNet, VoVNet),
    raised before they build anything."""
    message = str(error)
    return (f"unexpected keyword argument '{name}'" in message
            or repr(name) in message.partition("got unexpected keyword argument(s):")[2])
