"""model.kwargs of a fine-tune against those its start weights were trained with (a run checkpoint's record).

Most constructor arguments that change what a model computes change no parameter shape (timm's act_layer,
qkv_norm, global_pool, ...): weights trained with model.kwargs.act_layer=relu load into the GELU model without a
word, and fine-tuning starts from another function than the one trained. Each such change is named: a warning when
fine-tuning, an error under model.pretrained_strict=true (the weights as they are).

A key whose text differs is a change only if the weights compute another function with it: a value that spells out
the model's own default (global_pool=token, act_layer=gelu on a ViT) is none, and timm's defaults cannot be read from
its constructors (act_layer=None means GELU inside its Block). So each key the text flags is decided by building the
recorded model with and without that key changed (`alters_function`, on the CPU, no weights loaded) and comparing the
two on one fixed input with the same weights.

    check_kwargs_kept(recorded_model_cfg, model_cfg, "model.pretrained=/runs/x/best.pt")
"""
from __future__ import annotations

import dataclasses
import json
import logging

import torch
import torch.nn as nn

from configs.schema import ModelConfig

from .factory import build_model, input_size, is_language_model
from .pretrained import ModelError
from .variants import VARIANTS

log = logging.getLogger(__name__)

# model.kwargs whose change starts no other function, or is named elsewhere: timm's dropout rates (`*drop_rate`, in
# training only), how inputs of other sizes are handled (dynamic_img_size / dynamic_img_pad: at the trained size the
# model computes the same), the patch and window sizes the loader resamples the weights to and logs
# (models/pretrained.py), and the head counts check_recorded_architecture refuses when they split the weights
# otherwise
KEPT_FUNCTION_KEYS = ("dynamic_img_size", "dynamic_img_pad", "patch_size", "window_size", "num_heads")

UNSET = "unset (the model's own)"


def kwargs_changes(recorded: ModelConfig, current: ModelConfig) -> list[tuple[str, object, object]]:
    """(key, trained value, value now) for every model.kwargs entry that differs between the model `recorded` was
    trained as and `current` and makes its weights compute another function (`functional_changes`)."""
    return functional_changes(recorded, text_changes(recorded, current))


def text_changes(recorded: ModelConfig, current: ModelConfig) -> list[tuple[str, object, object]]:
    """(key, trained value, value now) for every model.kwargs entry whose text differs between `recorded` and
    `current`, a small variant's own arguments (models/variants.py) counted as given; UNSET for a side that leaves
    the key to the model. Keys of KEPT_FUNCTION_KEYS and dropout rates are left out."""
    trained, now = _resolved(recorded), _resolved(current)
    text = lambda value: json.dumps(value, sort_keys=True, default=str)  # a recorded tuple reads as a list
    return [(key, trained.get(key, UNSET), now.get(key, UNSET)) for key in sorted(set(trained) | set(now))
            if key not in KEPT_FUNCTION_KEYS and not key.endswith("drop_rate")
            and text(trained.get(key, UNSET)) != text(now.get(key, UNSET))]


def _resolved(cfg: ModelConfig) -> dict:
    """`cfg`'s constructor arguments beside its first-class settings: the variant's own, then model.kwargs."""
    variant = {k: v for k, v in VARIANTS.get(cfg.name, {}).items() if k not in ("arch", "img_size")}
    return {**variant, **cfg.kwargs}


def functional_changes(recorded: ModelConfig, changes: list[tuple[str, object, object]]
                       ) -> list[tuple[str, object, object]]:
    """The `changes` (text_changes) that make the weights of the model `recorded` compute another function: each
    key on its own, then the keys left out together (so that restoring the ones named restores the trained
    function). A probe that fails (a record this code cannot build) counts every change."""
    if not changes:
        return []
    # the same weights and input for every build, and the caller's RNG (the training's) untouched: a forked CPU
    # generator; the builds are on the CPU, so CUDA's generators are left out of the fork
    with torch.random.fork_rng(devices=[]):
        try:
            reference = _probe(recorded, {})
        except Exception:  # noqa: BLE001 - the trained model cannot be built here (another timm): judge by the text
            return changes
        named = [change for change in changes if alters_function(recorded, reference, [change])]
        kept = [change for change in changes if change not in named]
        if kept and alters_function(recorded, reference, kept):
            return changes
    return named


# Cost: only where the text differs, one build + forward of the model as trained and one per flagged key (one more
# when some are left out), on the CPU: for vit_base_patch16_224 at 224, the largest model the configs fine-tune,
# about 2-3 s each on two cores (measured: 2.7 s and 2.1 s for one flagged key), most of it timm's weight init
PROBE_SEED = 0


def _probe(cfg: ModelConfig, state: dict, x: torch.Tensor | None = None
           ) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(state_dict, input, output) of `cfg`'s model built on the CPU without its weights file, in eval mode (no
    dropout), the weights of `state` loaded strictly when given, on the input `x`, or else a fixed random one: images
    at the model's size, or token ids of its vocabulary and context for a language model."""
    # the CPU generator alone (forked by functional_changes): torch.manual_seed would reseed the training's CUDA ones
    torch.random.default_generator.manual_seed(PROBE_SEED)
    with torch.device("cpu"):  # real numbers on the CPU, whatever the default device
        model: nn.Module = build_model(dataclasses.replace(cfg, pretrained="")).eval()
    if state:
        model.load_state_dict(state)  # a change of parameter names or shapes raises: another function
    if x is None:  # a generator of its own: the input does not depend on what the build drew
        size, draw = input_size(model), torch.Generator().manual_seed(PROBE_SEED)
        x = (torch.randint(0, cfg.num_classes, (2, size), generator=draw, device="cpu") if is_language_model(model)
             else torch.randn(2, 3, size, size, generator=draw, device="cpu"))
    with torch.no_grad():
        return model.state_dict(), x, model(x)


def alters_function(recorded: ModelConfig, reference: tuple[dict, torch.Tensor, torch.Tensor],
                    changes: list[tuple[str, object, object]]) -> bool:
    """Whether the weights of the model `recorded` (its `reference` probe) compute another output on its input once
    `changes` are made to its model.kwargs (a value set, or the key removed for an UNSET one). A change that the
    kwargs cannot express (a variant's own argument left to timm) or that the model refuses counts as one."""
    kwargs = dict(recorded.kwargs)
    for key, _, new in changes:
        if new is UNSET:
            if key not in kwargs:  # the variant's own argument (models/variants.py): only another name unsets it
                return True
            del kwargs[key]
        else:
            kwargs[key] = new
    state, x, out = reference
    try:
        _, _, out_now = _probe(dataclasses.replace(recorded, kwargs=kwargs), state, x)
    except Exception:  # noqa: BLE001 - another parameter set, a refused combination, a failing forward: a change
        return True
    return not torch.equal(out, out_now)


def override(value) -> str:
    """`value` as a key=value override gives it: a string as it is, anything else as JSON (true, [2, 2])."""
    return value if isinstance(value, str) else json.dumps(value)


def check_kwargs_kept(recorded: ModelConfig, current: ModelConfig, source: str) -> None:
    """Name the model.kwargs changes (`kwargs_changes`) between the model the weights of `source` were trained as
    (`recorded`) and `current`: refused under model.pretrained_strict=true, a warning otherwise."""
    changes = kwargs_changes(recorded, current)
    if not changes:
        return
    told = "; ".join(f"model.kwargs.{key}: {override(old) if old is not UNSET else old} -> "
                     f"{override(new) if new is not UNSET else new}" for key, old, new in changes)
    restore = [f"model.kwargs.{key}={override(old)}" for key, old, _ in changes if old is not UNSET]
    drop = [f"model.kwargs.{key}" for key, old, _ in changes if old is UNSET]
    advice = " and ".join(([f"set {', '.join(restore)}"] if restore else []) + ([f"drop {', '.join(drop)}"]
                                                                                if drop else []))
    if current.pretrained_strict:
        raise ModelError(f"{source} was trained with other model.kwargs than the model's ({told}): the weights "
                         f"would compute another function than the trained one; {advice} to start from the trained "
                         f"function, or fine-tune with the change (model.pretrained_strict=false)")
    log.warning("%s was trained with other model.kwargs than the model's (%s): fine-tuning starts from another "
                "function than the trained one (%s to start from the trained function)", source, told, advice)
