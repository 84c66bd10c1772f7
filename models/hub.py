"""timm's hub weights (model.pretrained=hub) against the model they are loaded into.

timm's own loading fits the hub weights to any model: a classifier of another size (or none, for a backbone's
weights) is replaced by a random one, an attention-sink variant's parameters keep their zero init, and the position
table is resampled to the model's grid, each with no more than a line of timm's log. A local file is checked for
the same by models/pretrained.py; here the hub weights are, from timm's record of them (their pretrained_cfg), so
that a refusal comes before the download:

    check_hub_weights_fit(cfg, arch)     # under model.pretrained_strict (and for every evaluation)
    record, line = hub_table_resize(model, arch)   # once timm has loaded them
"""
from __future__ import annotations

import timm
import torch
import torch.nn as nn

from configs.schema import ModelConfig

from .pretrained import NEW_CLASSIFIER, ModelError

# attention-sink variants with parameters of their own, which no hub weights hold (models/attention_sinks.py)
SINK_VARIANTS = ("attn_bias", "kv_bias")


def check_hub_weights_fit(cfg: ModelConfig, arch: str) -> None:
    """Refuse the hub weights of `arch` (timm's name, with its tag) for the model of `cfg` where loading them would
    replace what they hold: a classifier of another number of outputs than model.num_classes, a classifier where they
    hold none, or an attention-sink variant's parameters. Called where the weights must be used as they are
    (model.pretrained_strict, an evaluation), with the words a local file gets there (models/pretrained.py)."""
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
    if cfg.attn in SINK_VARIANTS:
        raise ModelError(f"{source} has no parameters of model.attn={cfg.attn} (they would keep their zero init): "
                         f"drop the model.attn override, or fine-tune the weights with it (model.pretrained_strict="
                         f"false)")


def hub_table_resize(model: nn.Module, arch: str) -> tuple[dict, str]:
    """The position table timm resampled (bicubic) when it loaded the hub weights of `arch` into `model`, whose grid
    is another than the one the weights were trained at (their pretrained_cfg's input size at the hub model's patch
    size): the record ({'pos_embed_resampled': '14x14->2x2'}) an evaluation keeps beside its result and the line to
    log, as for a local file (models/pretrained.py's `position_table_resize`); {} and '' for none."""
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    hub = timm.models.get_pretrained_cfg(arch)
    if getattr(model, "pos_embed", None) is None or grid is None or hub is None or not hub.input_size:
        return {}, ""
    with torch.device("meta"):  # the hub model's patch size, no memory or init time spent on its weights
        patch = getattr(getattr(timm.models.model_entrypoint(arch.split(".")[0])(), "patch_embed", None),
                        "patch_size", None)
    if patch is None:
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
