"""timm's hub weights (model.pretrained=hub) against the model they are loaded into.

timm's own loading fits the hub weights to any model: a classifier of another size (or none, for a backbone's
weights) is replaced by a random one, an attention-sink variant's parameters keep their zero init, a patch embedding
of another patch size is resampled (FlexiViT's resize), and the position table and Swin's relative position bias
tables are resampled to the model's grid and windows, each with no more than a line of timm's log. A local file is
checked for the same by models/pretrained.py; here the hub weights are, from timm's record of them (their
pretrained_cfg) and the hub model's shapes (a build on the meta device), so that a refusal comes before the download,
and what fine-tuning changed of them is logged with a local file's words:

    check_hub_variant(cfg.name)                   # before anything: a small variant has no hub weights
    check_pretrained_tag(cfg.name, arch)          # for every model name (an unknown tag is no model timm builds)
    check_hub_weights_fit(cfg, arch, kwargs)      # under model.pretrained_strict (and for every evaluation)
    record, lines = hub_resampled(model, arch)    # once timm has loaded them: patch embedding, tables
    line = hub_new_sinks(model, arch)             # once the attention-sink variant has taken them over
    hub_load_failure(arch, kwargs, error)         # the error line when timm's fetching or loading failed
    line = hub_data_mismatch(cfg)                 # train.py / evaluate.py: other preprocessing than the weights'
"""
from __future__ import annotations

import json
import math
import traceback

import timm
import torch
import torch.nn as nn

from configs import Config
from configs.loader import unread_by_rules
from configs.schema import ModelConfig

from .attention_sinks import VARIANTS as ATTENTION_VARIANTS
from .pretrained import NEW_CLASSIFIER, ModelError, check_patch_size, conversion_failed, relative_table_resize
from .sink_weights import is_sink_key
from .variants import VARIANTS

# attention-sink variants with parameters of their own, which no hub weights hold (models/attention_sinks.py)
SINK_VARIANTS = ("attn_bias", "kv_bias")
# model.attn of each module type models/attention_sinks.py puts in place of timm's attentions
ATTN_OF_MODULE = {variant: attn for attn, types in ATTENTION_VARIANTS.items() for variant in types.values()}


def check_hub_variant(name: str) -> None:
    """Refuse model.pretrained=hub for model.name=`name` when it is one of models/variants.py's small variants: timm
    would fetch the weights of the variant's timm architecture (vit_nano's vit_tiny_patch16_224), of other widths and
    depths, and fail on their shapes deep inside its loading, or fail to fetch them offline, as if a cached copy or
    internet were what was missing."""
    if name in VARIANTS:
        arch = VARIANTS[name]["arch"]
        raise ModelError(f"model.pretrained=hub: model.name={name} is one of models/variants.py's small variants, "
                         f"which have no hub weights (timm's are {arch}'s, of other sizes); give a local file of "
                         f"its weights, model.pretrained=PATH, or a timm model name (e.g. model.name={arch}) for "
                         f"timm's hub weights")


def check_pretrained_tag(name: str, arch: str) -> None:
    """Refuse a timm name whose pretrained tag (`arch`'s part after the dot, model.name's) timm does not know: timm
    refuses to build it at all, with or without hub weights, in a traceback."""
    try:
        timm.models.get_pretrained_cfg(arch)
    except RuntimeError:  # timm's "Invalid pretrained tag (...) for ...": the only error it raises for a name
        base, _, tag = arch.partition(".")
        tags = [known.partition(".")[2] for known in timm.models.get_arch_pretrained_cfgs(base)]
        default = timm.models.get_pretrained_cfg(base).tag  # the architecture exists: it has a default tag
        raise ModelError(f"model.name={name}: timm's {base} has no pretrained tag '{tag}'; its tags: "
                         f"{', '.join(tags)} (set model.name={base}.TAG, or model.name={base} for its default, "
                         f"{default})") from None


def check_hub_weights_fit(cfg: ModelConfig, arch: str, kwargs: dict | None = None) -> None:
    """Refuse the hub weights of `arch` (timm's name, with its tag) for the model of `cfg` where loading them would
    replace what they hold: a classifier of another number of outputs than model.num_classes, a classifier where they
    hold none, their softmax attention (any other model.attn: softmax1, or a sink variant, whose parameters they
    lack), or a patch embedding of another patch size than the model's
    (built with `kwargs`, models/factory.py's model_kwargs; None: the patch size is not compared). Called where the
    weights must be used as they are (model.pretrained_strict, an evaluation), with the words a local file gets there
    (models/pretrained.py)."""
    hub = timm.models.get_pretrained_cfg(arch)
    if hub is None:  # no hub weights: timm's own error says so when it fetches them
        return
    source = f"model.pretrained=hub ({arch})"
    classes = getattr(hub, "num_classes", None)
    if classes == 0:  # a backbone's weights (e.g. DINOv2's): the classifier would be random
        raise ModelError(f"{source}: the weights hold no classifier (a backbone's), so model.num_classes="
                         f"{cfg.num_classes} would be a random one; only fine-tuning, with model.pretrained_strict="
                         f"false, adds a new classifier")
    if classes is not None and classes != cfg.num_classes:
        head = hub.classifier if isinstance(hub.classifier, str) else hub.classifier[0]
        raise ModelError(f"{source}: its classifier '{head}.weight' has {classes} outputs, model.num_classes="
                         f"{cfg.num_classes}: set model.num_classes={classes} to use it as it is ({NEW_CLASSIFIER})")
    if cfg.attn != "softmax":  # timm's attentions are all softmax: any variant is another function of the weights
        sinks = (f" has no parameters of model.attn={cfg.attn} (they would keep their zero init), and"
                 if cfg.attn in SINK_VARIANTS else ":")
        raise ModelError(f"{source}{sinks} timm's hub weights are softmax attention, which model.attn={cfg.attn} "
                         f"would turn into another function than the one they were trained as; drop the model.attn "
                         f"override, or fine-tune into it with model.pretrained_strict=false")
    if kwargs is not None:
        weights, model = _meta_model(arch), _meta_model(arch, kwargs)
        if weights is not None and model is not None:  # timm would resample the patch embedding (FlexiViT's resize)
            check_patch_size(weights.state_dict(), model.state_dict(), source, strict=True)


def _meta_model(arch: str, kwargs: dict | None = None) -> nn.Module | None:
    """timm's model `arch` built on the meta device (its shapes; no memory or init time spent on weights): the hub
    weights' own model without `kwargs` (timm builds a tagged name at the input size of its weights), else the model
    of `kwargs`. None where timm cannot build it: the real build's own error comes where the model is built."""
    base, _, tag = arch.partition(".")
    # what timm.create_model does with a tagged name, without its download (pretrained is left False)
    tagged = {"pretrained_cfg": tag} if tag else {}
    with torch.device("meta"):
        try:
            return timm.models.model_entrypoint(base)(**tagged, **(kwargs or {}))
        except Exception:  # noqa: BLE001 - e.g. an unknown constructor argument, which build_model names
            return None


def hub_resampled(model: nn.Module, arch: str) -> tuple[dict, list[str]]:
    """What timm resampled when it loaded the hub weights of `arch` into `model`, as a local file's loading names it
    (models/pretrained.py): the record an evaluation keeps beside its result ({'pos_embed_resampled': '14x14->2x2'},
    {'relative_position_bias_resampled': '7x7->4x4'}; a patch embedding's resize is logged, not recorded, as a local
    file's is) and the lines to log, one per change; {} and [] for none."""
    weights = _meta_model(arch)
    if weights is None:
        return {}, []
    source = f"model.pretrained=hub ({arch})"
    theirs, ours = weights.state_dict(), model.state_dict()
    # Swin's relative position bias tables of another window size (model.kwargs.window_size), or windows timm shrank
    # to a smaller img_size's feature maps: a local file's record and line, from the hub model's table shapes
    tables = [_position_table_resize(model, weights, arch), relative_table_resize(theirs, ours, model, source)]
    # a patch embedding of another patch size (model.kwargs.patch_size): timm resampled it (FlexiViT's resize), which
    # fine-tuning may ask for; strict loading refused it before the download (check_hub_weights_fit)
    lines = [check_patch_size(theirs, ours, source, strict=False), *(line for _, line in tables)]
    return {key: change for record, _ in tables for key, change in record.items()}, [line for line in lines if line]


def hub_new_sinks(model: nn.Module, arch: str) -> str:
    """The line to log where `model` computes another attention than the hub weights' softmax (its model.attn
    variant, after models/attention_sinks.py took timm's attentions over), which fine-tuning the weights then adapts
    them to: the variant, and its attention-sink parameters, which no hub weights hold and which keep their zero
    init, as a local file's loading says of those not in the file; '' for softmax attention."""
    attns = sorted({ATTN_OF_MODULE[type(module)] for module in model.modules() if type(module) in ATTN_OF_MODULE})
    if not attns:
        return ""
    sinks = [name for name, _ in model.named_parameters() if is_sink_key(name)]
    # softmax1 has no parameters of its own: without this line nothing would show that the function changed
    kept = f"; {len(sinks)} attention-sink parameters not in the weights keep their zero init" if sinks else ""
    return (f"model.pretrained=hub ({arch}): the weights' softmax attention is computed as model.attn="
            f"{', '.join(attns)} (another function, which fine-tuning adapts them to){kept}")


def _position_table_resize(model: nn.Module, weights: nn.Module, arch: str) -> tuple[dict, str]:
    """A ViT's position table timm resampled (bicubic) to `model`'s grid, another than the one the hub weights
    (their model: `weights`) were trained at, their pretrained_cfg's input size at the hub model's patch size."""
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    hub = timm.models.get_pretrained_cfg(arch)
    patch = getattr(getattr(weights, "patch_embed", None), "patch_size", None)
    if getattr(model, "pos_embed", None) is None or grid is None or hub is None or not hub.input_size or patch is None:
        return {}, ""
    pixels = tuple(hub.input_size[-2:])
    trained = tuple(side // p for side, p in zip(pixels, patch))
    if trained == tuple(grid):
        return {}, ""
    theirs, mine = "x".join(map(str, trained)), "x".join(map(str, grid))
    return ({"pos_embed_resampled": f"{theirs}->{mine}"},
            f"model.pretrained=hub ({arch}): position table of a {theirs} grid resampled to the model's {mine} "
            f"(timm's bicubic resize; the weights were trained at {pixels[0]}x{pixels[1]} pixels in patches of "
            f"{patch[0]}x{patch[1]}, the model takes {model.patch_embed.img_size[0]}x{model.patch_embed.img_size[1]}"
            f" in patches of {model.patch_embed.patch_size[0]}x{model.patch_embed.patch_size[1]})")


# where fetching hub weights fails: huggingface_hub's errors (LocalEntryNotFoundError offline or without a cached
# copy, OfflineModeIsEnabled, HfHubHTTPError) and torch.hub's (urllib's URLError) are OSErrors; anything else raised
# inside these modules (an HTTP client's own error, an unreadable download) is a failure to fetch too
FETCH_MODULES = ("huggingface_hub", "httpx", "httpx2", "requests", "urllib3", "urllib", "torch.hub", "timm.models._hub",
                 "safetensors")


def hub_load_failure(arch: str, kwargs: dict, error: Exception) -> str:
    """The error line for timm's create_model(`arch`, pretrained=True, **`kwargs`) failing with `error`: the hub
    weights could not be fetched (no internet, no cached copy: a local file is the way), or they were and timm's
    conversion to the model failed (a position table of another token layout: a local file's words for it)."""
    if not _fetch_error(error):
        model = _meta_model(arch, kwargs)
        if model is not None:
            return conversion_failed(f"model.pretrained=hub ({arch})", model, error)
    reason = " ".join(str(error).split()) or type(error).__name__
    return (f"could not fetch hub weights for '{arch}' ({reason}); without internet, give a local file: "
            f"model.pretrained=/path/to/weights.safetensors")


def _fetch_error(error: Exception) -> bool:
    """Whether `error` came from fetching or reading the hub weights (FETCH_MODULES), or from timm's finding no hub
    weights to fetch (raised by its builder itself: "No pretrained weights exist for ..."), not from fitting them to
    the model (timm's conversion of them, torch's load_state_dict)."""
    if isinstance(error, OSError):
        return True
    modules = [frame.f_globals.get("__name__", "") for frame, _ in traceback.walk_tb(error.__traceback__)]
    return (any(name == m or name.startswith(m + ".") for name in modules for m in FETCH_MODULES)
            or modules[-1:] == ["timm.models._builder"])


# the data keys of the input pipeline that timm records for hub weights (their pretrained_cfg), as timm's
# resolve_data_config reads them: the normalization, eval crop and resize the weights were trained and scored with
# (crop_mode too: 131 of timm's weights are scored on the whole image squashed to a square, crop_mode squash)
HUB_DATA_KEYS = ("mean", "std", "crop_pct", "crop_mode", "interpolation")


def hub_data_mismatch(cfg: Config) -> str:
    """The line to log where model.pretrained=hub weights (model.name's, timm's default tag for an untagged name) get
    another input pipeline than timm records for them (their pretrained_cfg, read offline: no download): each of
    HUB_DATA_KEYS that `cfg`'s data set reads (synthetic images and token windows get no transform) and sets
    otherwise, with both values and the overrides that match the weights; '' where all match (or for no hub weights).
    Not refused: fine-tuning with other values is a recipe's choice (DeiT's is), but a model fed other inputs than it
    learnt from starts off worse, and the config alone does not show it."""
    model, data = cfg.model, cfg.data
    if model.pretrained != "hub" or model.name in VARIANTS or not timm.is_model(model.name.partition(".")[0]):
        return ""
    try:
        hub = timm.models.get_pretrained_cfg(model.name)
    except RuntimeError:  # an unknown tag: refused where the model is built (check_pretrained_tag)
        return ""
    if hub is None:
        return ""
    unread = {key for key, *_ in unread_by_rules(cfg, [f"data.{key}" for key in HUB_DATA_KEYS])}
    differ = [(key, getattr(data, key), getattr(hub, key)) for key in HUB_DATA_KEYS
              if f"data.{key}" not in unread and getattr(hub, key, None) is not None
              and not _same(getattr(data, key), getattr(hub, key))]
    if not differ:
        return ""
    given = "; ".join(f"data.{key}={_shown(ours)} (the weights': {_shown(theirs)})" for key, ours, theirs in differ)
    fix = " ".join(f"data.{key}={_override(theirs)}" for key, _, theirs in differ)
    return (f"model.pretrained=hub ({model.name}): the data are prepared otherwise than these weights were trained "
            f"and scored with (timm's pretrained_cfg of {hub.architecture}.{hub.tag}): {given}; to match them, set "
            f"{fix} (other values are a recipe's choice, e.g. DeiT's, not a fault)")


def _same(ours, theirs) -> bool:
    """Whether a data setting (a number, a string or a per-channel tuple) equals the weights' own."""
    if isinstance(theirs, str) or isinstance(ours, str):
        return ours == theirs
    ours, theirs = (tuple(v) if isinstance(v, (tuple, list)) else (v,) for v in (ours, theirs))
    return len(ours) == len(theirs) and all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(ours, theirs))


def _shown(value) -> str:
    """A data setting as the log shows it: [0.485, 0.456, 0.406], 0.875, bicubic."""
    return json.dumps(list(value)) if isinstance(value, (tuple, list)) else str(value)


def _override(value) -> str:
    """A data setting as a command-line override takes it, without spaces: [0.5,0.5,0.5], 0.9, bicubic."""
    return json.dumps(list(value), separators=(",", ":")) if isinstance(value, (tuple, list)) else str(value)
