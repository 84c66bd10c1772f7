"""Build a model from `ModelConfig`: a timm name, a small variant or a GPT-2 size (models/gpt.py), optionally
with an attention-sink variant (`model.attn`, models/attention_sinks.py) and local weights.

    model = build_model(cfg.model)       # nn.Module on the CPU, in train mode

`models/` knows nothing of cd/, quant/ or distributed training: it returns a plain timm module.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import logging
import math
from typing import Callable, Optional

import timm
import torch
import torch.nn as nn
from timm.layers import to_2tuple

from configs.constraints import kwargs_without_value_problem
from configs.schema import ModelConfig

from .attention_sinks import use_sink_attention
from .gpt import GPT, GPT_SIZES, build_gpt
from .hub import (check_hub_variant, check_hub_weights_fit, check_pretrained_tag, hub_load_failure, hub_new_sinks,
                  hub_resampled)
from .pretrained import ModelError, load_pretrained
from .timm_build_args import build_args_problem, create_timm_model, rejects_argument
from .variants import VARIANTS

log = logging.getLogger(__name__)

# timm constructor arguments that ModelConfig sets with keys of its own (model.drop's: DROP_ARGS); timm's
# create_model loads a checkpoint_path itself (timm's load_checkpoint: a train.py checkpoint's EMA weights, none of
# models/pretrained.py's checks), and timm's pretrained_strict applies to its hub weights alone
FIRST_CLASS_KEYS = {"num_classes": "num_classes", "drop_path_rate": "drop_path", "img_size": "img_size",
                    "pretrained": "pretrained", "checkpoint_path": "pretrained",
                    "pretrained_strict": "pretrained_strict"}

# GPT (models/gpt.py) constructor arguments that ModelConfig sets with keys of its own: build_gpt takes its name,
# vocabulary and dropout from model.name, model.num_classes and model.drop (in model.kwargs as well, build_gpt would
# get two values for one argument), and timm's spellings of the same settings (num_classes, a checkpoint_path to
# load) are answered with the key that sets them rather than as unknown arguments
GPT_FIRST_CLASS_KEYS = {"name": "name", "vocab_size": "num_classes", "num_classes": "num_classes", "drop": "drop",
                        "pretrained": "pretrained", "checkpoint_path": "pretrained"}

# model.drop is the dropout of DeiT's `drop_rate`: after the position embedding (pos_drop), the attention's output
# projection and the MLP. timm 1.x split that rate: its `drop_rate` is the classifier head's dropout alone (which
# DeiT never had), so model.drop sets these arguments instead, per module of timm's model entry points.
DROP_ARGS = {"timm.models.vision_transformer": ("pos_drop_rate", "proj_drop_rate"),
             "timm.models.deit": ("pos_drop_rate", "proj_drop_rate"),
             "timm.models.vision_transformer_hybrid": ("pos_drop_rate", "proj_drop_rate")}  # timm's VisionTransformer
# official Swin's drop_rate (microsoft/Swin-Transformer) also acts after the patch embedding (pos_drop), where timm's
# Swin has no dropout: model.drop would build another model than it names there, so it is refused
TIMM_SWIN = "timm.models.swin_transformer"


# recorded in train.py's checkpoints: which dropout model.drop set when they were written (checkpoints without it
# come from code that passed model.drop to timm's drop_rate, the classifier-head dropout; train.py's resume says so)
MODEL_DROP_SITES = "pos_proj_mlp"


def without_dropout_rates(kwargs: dict) -> dict:
    """model.kwargs less timm's dropout rates (drop_rate, pos_drop_rate, proj_drop_rate, attn_drop_rate,
    patch_drop_rate): the entries that change the model's parameters. A rate adds none, so it may move between
    model.drop and model.kwargs (timm's Swin takes its block dropout only as model.kwargs.proj_drop_rate) while the
    weights stay those of the same model."""
    return {key: value for key, value in kwargs.items() if not key.endswith("drop_rate")}


def check_kwargs_given(cfg: ModelConfig) -> None:
    """Refuse a model.kwargs entry without a value (configs.constraints.kwargs_without_value_problem), which
    load_config refuses already: here for a ModelConfig that did not come through it."""
    if (problem := kwargs_without_value_problem(cfg)) is not None:
        raise ModelError(problem)


def shadowed_kwarg_problem(kwargs: dict, own_keys: dict) -> str | None:
    """'model.kwargs.K: set model.X instead' for the first entry of `kwargs` that `own_keys` ({constructor argument:
    ModelConfig key}) gives a key of its own, or None: one of the two values would be ignored, or collide."""
    shadowed = sorted(set(kwargs) & set(own_keys))
    if not shadowed:
        return None
    return f"model.kwargs.{shadowed[0]}: set model.{own_keys[shadowed[0]]} instead (the model's own key for it)"


def model_kwargs(cfg: ModelConfig) -> tuple[str, dict]:
    """Resolve `cfg` into (timm architecture name, constructor kwargs)."""
    check_kwargs_given(cfg)
    kwargs = {}
    if cfg.name in VARIANTS:
        kwargs.update(VARIANTS[cfg.name])
        arch = kwargs.pop("arch")
    else:
        arch = cfg.name
        if not timm.is_model(arch.split(".")[0]):
            # the variants and GPT sizes too: a typo of vit_nano is nearer to it than to any timm name
            close = difflib.get_close_matches(arch, [*VARIANTS, *GPT_SIZES, *timm.list_models()], n=6, cutoff=0.6)
            raise ModelError(f"unknown model '{cfg.name}': not a timm model nor a variant "
                             f"({', '.join(VARIANTS)}) nor a GPT size ({', '.join(GPT_SIZES)})"
                             + (f"; names like it: {', '.join(close)}" if close else ""))
        check_pretrained_tag(cfg.name, arch)
    module = timm.models.model_entrypoint(arch.split(".")[0]).__module__
    if cfg.drop and module == TIMM_SWIN:
        raise ModelError(f"model.drop={cfg.drop}: model '{cfg.name}' ({arch}) is timm's Swin, "
                         f"which has no dropout after the patch embedding, where the official code's drop_rate "
                         f"(model.drop) has one; set model.drop=0, and for the dropout after the attention "
                         f"projection and MLP alone model.kwargs.proj_drop_rate={cfg.drop}")
    drop_args = DROP_ARGS.get(module)
    # model.drop's arguments are its own only where it sets them: at 0 a model.kwargs rate of one is the only one
    own_keys = {**FIRST_CLASS_KEYS, **{name: "drop" for name in (drop_args or ()) if cfg.drop}}
    if problem := shadowed_kwarg_problem(cfg.kwargs, own_keys):  # one of the two would be ignored
        raise ModelError(problem)
    if problem := build_args_problem(cfg.kwargs):  # timm's building would consume it itself
        raise ModelError(problem)
    if cfg.drop and drop_args is None:  # timm's drop_rate means another dropout from model to model
        raise ModelError(f"model.drop={cfg.drop}: model '{cfg.name}' ({arch}) is no ViT / DeiT, whose "
                         f"dropout after the position embedding, attention projection and MLP it sets; set "
                         f"model.drop=0 and give the model's own dropout arguments as model.kwargs (e.g. "
                         f"model.kwargs.drop_rate, timm's classifier dropout)")
    if cfg.img_size is not None:
        kwargs["img_size"] = cfg.img_size
    kwargs.update(cfg.kwargs)
    kwargs.update(num_classes=cfg.num_classes, drop_path_rate=cfg.drop_path)
    kwargs.update({name: cfg.drop for name in drop_args or () if cfg.drop})
    return arch, kwargs


def check_patch_grid(model: nn.Module, cfg: ModelConfig) -> None:
    """The input must be whole patches: timm's patch embedding is a strided conv that rounds the grid down, so
    model.img_size=30 at patch 8 trains on 24 x 24 pixels of every image without a word (and one below the
    patch size fails in the first forward). timm's dynamic_img_pad pads the input to whole patches, but the
    position table (or rotary table) has the rounded-down grid: it fits with dynamic_img_size (resampled per
    input) or a model without either table (model.kwargs.pos_embed=none)."""
    embed = getattr(model, "patch_embed", None)
    size, patch = getattr(embed, "img_size", None), getattr(embed, "patch_size", None)
    pads = getattr(embed, "dynamic_img_pad", False)
    # a table sized by the grid: ViT's pos_embed (None for pos_embed='none'), EVA's rope; a model lacking the
    # attribute counts as having one (refused rather than failing in its first forward)
    grid_table = getattr(model, "pos_embed", True) is not None or getattr(model, "rope", None) is not None
    if size is None or patch is None or (pads and (getattr(model, "dynamic_img_size", False) or not grid_table)):
        return
    # per side: timm's PatchEmbed keeps both as (h, w), others one int for both sides (XCiT's patch_size)
    size, patch = to_2tuple(size), to_2tuple(patch)
    uncovered = [(s, p) for s, p in zip(size, patch) if s % p]
    if uncovered:
        s, p = uncovered[0]
        # model.img_size is one side for both: with patches of two sides (model.kwargs.patch_size=[8, 6]) only a
        # multiple of both fits, and naming the one side refused would lead to the next refusal
        whole = math.lcm(*(int(side) for side in patch))
        if pads:  # no pixel is left out, but the padded grid does not fit the table
            raise ModelError(f"model '{cfg.name}': an input of {s} pixels is not a whole number of patches of {p}: "
                             f"dynamic_img_pad pads it to {-(-s // p)} patches, but the position table is built for "
                             f"{s // p}; set model.img_size to a multiple of {whole}, or "
                             "model.kwargs.dynamic_img_size=true (the table resampled to each input's grid)")
        raise ModelError(f"model '{cfg.name}': an input of {s} pixels is not a whole number of patches of {p}: "
                         f"the patch embedding would leave {s % p} pixel rows / columns of every image unseen"
                         f"{' (all of them)' if s < p else ''}; set model.img_size to a multiple of {whole}")


def check_classes_built(model: nn.Module, cfg: ModelConfig, arch: str) -> None:
    """timm's building of an encoder without a classifier (qwen3_vit_*_enc, gemma4_vit_*_enc, ...) drops num_classes
    (its kwargs_filter): the model's outputs would be features, trained as if they were class scores. `model`: the
    model timm built of `arch` for `cfg` (or its meta-device build, the same shapes)."""
    built = getattr(model, "num_classes", cfg.num_classes)
    if built != cfg.num_classes:
        raise ModelError(f"model.num_classes={cfg.num_classes}: model '{cfg.name}' ({arch}) was built with "
                         f"num_classes={built} (timm's building drops the argument: a feature encoder without a "
                         f"classifier, whose outputs are no class scores); give a model.name with a classifier")


# what timm's constructors raise for values they cannot build with: their checks (embed_dim % num_heads, an unknown
# global_pool), sizes they divide by (patch_size=0), names they look up (act_layer=nonexistent: KeyError), per-stage
# lists shorter than the stages (Swin's num_heads: IndexError), and torch's refusal of the tensors they size
# (embed_dim=-8) or fill (init_values=a); TypeError is build_model's own except clause
VALUE_ERRORS = (AssertionError, ValueError, ZeroDivisionError, RuntimeError, KeyError, IndexError)


def rejected_arguments(cfg: ModelConfig, arch: str, kwargs: dict, error: Exception) -> str:
    """The error line for timm's constructor of `arch` refusing `kwargs` (model_kwargs' of `cfg`) with `error`, on
    one line (torch's messages span several; a bare assert has none), ending with the entries to check."""
    reason = " ".join(str(error).split()).rstrip(".") or type(error).__name__  # the line goes on after it
    if isinstance(error, (KeyError, IndexError)):  # their text alone is a bare key ('nonexistent') or index message
        reason = f"{type(error).__name__}: {reason}"
    reason = reason if len(reason) <= 300 else reason[:300] + " ..."
    given = [f"model.kwargs.{key}" for key in cfg.kwargs] + (["model.img_size"] if cfg.img_size is not None else [])
    module = timm.models.model_entrypoint(arch.split(".")[0]).__module__
    return (f"model '{cfg.name}' ({arch}) rejected its arguments {kwargs}: {reason}; check "
            f"{', '.join(given) or 'model.kwargs'} against the model's constructor ({module})")


# texts that say a switch's value (YAML 1.1's spellings and digits), for naming the unquoted value meant
TEXT_SWITCHES = {**dict.fromkeys(("true", "yes", "on", "y", "1"), "true"),
                 **dict.fromkeys(("false", "no", "off", "n", "0"), "false")}


def takes_bool(parameter: inspect.Parameter) -> bool:
    """Whether a constructor `parameter` is a true/false switch: a bool default, or annotated bool / Optional[bool]
    (timm's fc_norm=None: decided by the model unless given)."""
    return isinstance(parameter.default, bool) or parameter.annotation in (bool, "bool", Optional[bool],
                                                                            "Optional[bool]", "bool | None")


def check_text_for_bool(cfg: ModelConfig, arch: str, kwargs: dict) -> None:
    """Refuse a text value in model.kwargs for a true/false argument of the model's constructor: timm tests it as
    Python does, any non-empty text as true, so qkv_bias: "false" (quoted in YAML) would build the biases it
    turns off. timm's entry points take **kwargs: the switches are those of the class they build, found by a
    build on the meta device (no weights, no memory) without the text values; a build that fails leaves the
    refusal to the real one."""
    texts = {key: value for key, value in cfg.kwargs.items() if isinstance(value, str)}
    if not texts:
        return
    try:
        with torch.device("meta"):
            built = create_timm_model(arch, {key: value for key, value in kwargs.items() if key not in texts})
    except Exception:  # noqa: BLE001 - the real build raises (and build_model refuses) the same
        return
    entry = timm.models.model_entrypoint(arch.split(".")[0])
    # the arguments of every class the model is, base first: a subclass's __init__(*args, **kwargs) (LeViT's
    # LevitDistilled) hands its switches (use_conv) to its base's
    parameters = {}
    for cls in reversed(type(built).__mro__):
        if "__init__" in vars(cls):
            parameters.update(inspect.signature(cls.__init__).parameters)
    parameters.update(inspect.signature(entry).parameters)
    switches = sorted(key for key in texts if key in parameters and takes_bool(parameters[key]))
    if switches:
        key = switches[0]
        meant = TEXT_SWITCHES.get(texts[key].strip().lower())
        raise ModelError(f"model.kwargs.{key}={texts[key]!r}: a text for {type(built).__name__}'s true/false "
                         f"argument {key}, which any non-empty text turns on; give true or false unquoted"
                         + (f" (model.kwargs.{key}={meant})" if meant else ""))


def build_model(cfg: ModelConfig) -> nn.Module:
    """Create the model of `cfg` (a ModelConfig), with its attention variant, and load its pretrained
    weights, if any."""
    if cfg.name in OWN_MODELS:
        return OWN_MODELS[cfg.name](cfg)
    hub = cfg.pretrained == "hub"
    if hub:  # before the variant resolves to its timm architecture, whose hub weights timm would fetch
        check_hub_variant(cfg.name)
    arch, kwargs = model_kwargs(cfg)
    check_text_for_bool(cfg, arch, kwargs)
    if hub and cfg.pretrained_strict:  # timm would fit the weights to the model (a random classifier), not refuse
        check_hub_weights_fit(cfg, arch, kwargs)
    if hub:  # refused before the download of the weights (hundreds of MB for an encoder), on the model's shapes
        with torch.device("meta"):
            try:
                shapes = create_timm_model(arch, kwargs)
            except Exception:  # noqa: BLE001 - not built on the meta device: the real build's error, or its check
                shapes = None
        if shapes is not None:
            check_classes_built(shapes, cfg, arch)
            check_img_size_built(shapes, cfg, arch)
    try:
        model = create_timm_model(arch, kwargs, pretrained=hub)
    except TypeError as e:  # an unknown constructor argument in model.kwargs, or a value of another type
        if rejects_argument(e, "drop_path_rate"):  # above 0 (create_timm_model leaves 0 out): refused, not dropped
            default = (f"; {ModelConfig.drop_path} is the schema's default, meant for the ViT / Swin recipes, which a "
                       f"config of such a model must set to 0" if cfg.drop_path == ModelConfig.drop_path else "")
            raise ModelError(f"model.drop_path={cfg.drop_path}: model '{cfg.name}' ({arch}) has no stochastic depth "
                             f"(its constructor takes no drop_path_rate); set model.drop_path=0{default}") from e
        raise ModelError(rejected_arguments(cfg, arch, kwargs, e)) from e
    except Exception as e:
        if hub:  # not fetched (no internet, no cached copy), or fetched but not fitting the model
            raise ModelError(hub_load_failure(arch, kwargs, e)) from e
        # without hub weights nothing but the constructor's own refusal of its arguments raises these here
        if isinstance(e, VALUE_ERRORS):
            raise ModelError(rejected_arguments(cfg, arch, kwargs, e)) from e
        raise
    check_classes_built(model, cfg, arch)
    check_patch_grid(model, cfg)
    check_img_size_built(model, cfg, arch)
    if hub:  # the scored weights are not all the hub's: logged and recorded as a local file's (models/pretrained.py)
        model.pretrained_resampled, lines = hub_resampled(model, arch)
        for line in lines:
            log.warning(line)
    try:
        # after timm's init and hub weights (the variant takes them over, its sink parameters start at
        # zero), before local weights, so that a checkpoint of the variant fits
        use_sink_attention(model, cfg.attn)
    except ValueError as e:
        raise ModelError(f"model '{cfg.name}': {e}") from e
    if hub and (line := hub_new_sinks(model, arch)):  # logged as a local file's loading logs it
        log.info(line)
    if cfg.pretrained and not hub:
        load_pretrained(model, cfg.pretrained, strict=cfg.pretrained_strict)
    return model


def _build_language_model(cfg: ModelConfig) -> GPT:
    """A GPT-2 of `cfg.name`'s size (vocabulary: model.num_classes), with model.kwargs overrides."""
    vision_only = {"model.attn": cfg.attn != "softmax", "model.img_size": cfg.img_size is not None,
                   "model.drop_path": bool(cfg.drop_path), "model.pretrained": cfg.pretrained == "hub"}
    given = [f"{key}={getattr(cfg, key[len('model.'):])}" for key, set_ in vision_only.items() if set_]
    if given:
        others = [item for item in given if not item.startswith("model.drop_path=")]
        fixes = [f"drop {'it' if len(given) == 1 else 'them' if len(others) == len(given) else ', '.join(others)}"
                 ] if others else []
        if cfg.drop_path:
            # model.drop_path has a default (for the vision models) that a config which never names it still
            # carries: "drop it" would name no fix then; configs/lm/*.yaml set 0
            fixes.append("set model.drop_path=0 (stochastic depth"
                         + (f"; {ModelConfig.drop_path} is the schema's default, meant for the vision models, which "
                            f"a language model's config must set to 0, as configs/lm/*.yaml do"
                            if cfg.drop_path == ModelConfig.drop_path else "") + ")")
        raise ModelError(f"model '{cfg.name}' is a language model: {', '.join(given)} "
                         f"appl{'ies' if len(given) == 1 else 'y'} to the timm vision models only; "
                         f"{' and '.join(fixes)}")
    check_kwargs_given(cfg)
    if problem := shadowed_kwarg_problem(cfg.kwargs, GPT_FIRST_CLASS_KEYS):
        raise ModelError(problem)
    try:
        model = build_gpt(cfg.name, vocab_size=cfg.num_classes, drop=cfg.drop, **cfg.kwargs)
    except TypeError as e:
        raise ModelError(f"model '{cfg.name}' rejected its arguments {cfg.kwargs}: {e}; it takes "
                         "depth, num_heads, embed_dim, context, bias, gelu") from e
    except ValueError as e:
        raise ModelError(f"model '{cfg.name}': {e}") from e
    if cfg.pretrained:
        load_pretrained(model, cfg.pretrained, strict=True)  # the LM head is the tied embedding
    return model


# model.name -> the builder of a model class of the repository's own (not timm's), from the ModelConfig: GPT-2's
# sizes. build_model builds these, and what checks a name before anything is built (scripts/sweep.py's pre-check
# of every run) accepts them; a fork's own class goes here too (docs/extending.md, "A model family").
OWN_MODELS: dict[str, Callable[[ModelConfig], nn.Module]] = {size: _build_language_model for size in GPT_SIZES}


def attention_heads(model: nn.Module) -> dict[str, int]:
    """{module name: its head count} for every attention of `model` (timm's ViT / Swin attentions, the sink
    variants', models/gpt.py's)."""
    return {name: m.num_heads for name, m in model.named_modules() if isinstance(getattr(m, "num_heads", None), int)}


def check_recorded_architecture(recorded: ModelConfig, model: nn.Module, source: str) -> None:
    """Refuse `model` for the weights of `source` (a run checkpoint) when the model they were trained as (its
    recorded `recorded` ModelConfig) splits its attentions into other head counts: weights of a 2-head ViT have
    the shapes of a 4-head one and would load into it as another function without a word. Called once the
    weights fit `model`'s shapes; settings that fine-tuning or an evaluation may change (num_classes, dropout,
    img_size) play no part."""
    with torch.device("meta"):  # the recorded architecture, no memory or init time spent on its weights
        try:
            if recorded.name in GPT_SIZES:
                kwargs = {**GPT_SIZES[recorded.name], **recorded.kwargs}
                trained = GPT(vocab_size=recorded.num_classes, **kwargs)
            else:
                arch, kwargs = model_kwargs(dataclasses.replace(recorded, drop=0.0))
                trained = create_timm_model(arch, kwargs)
        except Exception:  # noqa: BLE001 - a record this code cannot build (another timm): its shapes were checked
            return
    heads, own = attention_heads(trained), attention_heads(model)
    differ = [name for name in own if name in heads and heads[name] != own[name]]
    if differ:
        name = differ[0]
        value = kwargs.get("num_heads", heads[name])  # the variant's / size's own, or timm's (one per block)
        raise ModelError(f"{source} was trained with {heads[name]} attention heads in '{name}', the model has "
                         f"{own[name]} (the same weights split another way): set model.kwargs.num_heads="
                         f"{json.dumps(list(value) if isinstance(value, tuple) else value)} (as trained)")


def own_img_size(cfg: ModelConfig) -> int | None:
    """The input size of `cfg`'s model with model.img_size unset: the variant's or timm's own (vit_nano's 32), from a
    build on the meta device (no weights, no memory). None for a language model (no img_size) or a config this code
    cannot build (its own refusal comes where the model is built)."""
    if cfg.name in GPT_SIZES:
        return None
    try:
        with torch.device("meta"):
            return input_size(build_model(dataclasses.replace(cfg, img_size=None, pretrained="")))
    except (ModelError, RuntimeError):
        return None


def is_language_model(model: nn.Module) -> bool:
    return isinstance(model, GPT)


def input_size(model: nn.Module) -> int:
    """Square input resolution the model was built for (a language model: its context, in tokens): the size its
    input embedding was built with (built_img_size), else the size timm's pretrained_cfg gives the family."""
    if isinstance(model, GPT):
        return model.context
    size = built_img_size(model)
    if size is None:
        size = model.pretrained_cfg["input_size"][1:]
    return int(size[0]) if isinstance(size, (tuple, list)) else int(size)


def built_img_size(model: nn.Module) -> int | tuple | None:
    """The image size `model` was built for, where its timm class keeps it: its patch embedding's (ViT, DeiT, Swin,
    EVA), its own (Visformer, EfficientViT-MSRA, MaxViT / CoAtNet, CrossViT), else that of the first module holding
    one, the input embedding of the families that name it otherwise (MLP-Mixer's stem, TNT's pixel_embed, CoaT's
    patch_embed1, Twins' patch_embeds.0). None where no module keeps one (LeViT, Hiera, RepViT, ...)."""
    for module in (getattr(model, "patch_embed", None), *model.modules()):
        size = getattr(module, "img_size", None)
        if isinstance(size, (int, tuple, list)):  # None: an embedding of any size (timm's dynamic ones)
            return size
    return None


def check_img_size_built(model: nn.Module, cfg: ModelConfig, arch: str) -> None:
    """model.img_size is what the images are sized to (input_size): refuse it where `model` (timm's build of `arch`)
    was not built for it or keeps no record of its size, which timm's families without a patch embedding that
    records it take without a word (RepViT, MobileViT: trained at their own size; LeViT, Hiera: a shape error in
    the first forward; EfficientFormer ignores the argument). CrossViT's branches see the input rescaled: each
    branch's size must be whole patches of its own."""
    if cfg.img_size is None:
        return
    built = input_size(model)
    if built != cfg.img_size:
        kept = ("keeps no record of the input size it was built for" if built_img_size(model) is None else
                f"was built for {built}-pixel inputs")
        raise ModelError(f"model.img_size={cfg.img_size}: model '{cfg.name}' ({arch}, timm's "
                         f"{type(model).__name__}) {kept}, so its images would be sized {built}; leave "
                         f"model.img_size unset (the model's own {built}), or give a model family that takes it "
                         f"(ViT, DeiT, Swin, EVA: a patch embedding built for the size)")
    branches = getattr(model, "patch_embed", None)
    for i, embed in enumerate(branches if isinstance(branches, nn.ModuleList) else ()):
        size, patch = getattr(embed, "img_size", None), getattr(embed, "patch_size", None)
        if size is None or patch is None:
            continue
        size, patch = to_2tuple(size), to_2tuple(patch)
        if any(s % p for s, p in zip(size, patch)):
            own = model.pretrained_cfg["input_size"][-1]
            raise ModelError(f"model.img_size={cfg.img_size}: model '{cfg.name}' ({arch}) rescales the input to "
                             f"{size[0]} pixels for its branch {i}, not a whole number of its patches of {patch[0]}; "
                             f"leave model.img_size unset (the model's own {own}) or give a size whose every "
                             f"branch is whole patches")


def model_input_size(cfg: ModelConfig) -> int:
    """The input size of the model `cfg` builds (model.img_size null: the model's own), from a build on the meta
    device (no weights, no memory; model.pretrained is not loaded)."""
    with torch.device("meta"):
        return input_size(build_model(dataclasses.replace(cfg, pretrained="")))


def model_label(cfg: ModelConfig) -> str:
    """The model's name in results and tables: the timm / variant name, plus the attention variant when
    it is not timm's softmax, e.g. "vit_base_patch16_224 (kv_bias)"."""
    return cfg.name if cfg.attn == "softmax" else f"{cfg.name} ({cfg.attn})"


def describe(model: nn.Module) -> str:
    """One line: class and parameter count, for the run log."""
    n = sum(p.numel() for p in model.parameters())
    return f"{type(model).__name__} with {n / 1e6:.2f}M parameters"
