"""model.kwargs of a fine-tune against those its start weights were trained with (a run checkpoint's record).

Most constructor arguments that change what a model computes change no parameter shape (timm's act_layer,
qkv_norm, global_pool, ...): weights trained with model.kwargs.act_layer=relu load into the GELU model without a
word, and fine-tuning starts from another function than the one trained. Each such change is named: a warning when
fine-tuning, an error under model.pretrained_strict=true (the weights as they are).

    check_kwargs_kept(recorded_model_cfg, model_cfg, "model.pretrained=/runs/x/best.pt")
"""
from __future__ import annotations

import json
import logging

from configs.schema import ModelConfig

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
    trained as and `current`, a small variant's own arguments (models/variants.py) counted as given; UNSET for a
    side that leaves the key to the model. Keys of KEPT_FUNCTION_KEYS and dropout rates are left out."""
    trained, now = _resolved(recorded), _resolved(current)
    text = lambda value: json.dumps(value, sort_keys=True, default=str)  # a recorded tuple reads as a list
    return [(key, trained.get(key, UNSET), now.get(key, UNSET)) for key in sorted(set(trained) | set(now))
            if key not in KEPT_FUNCTION_KEYS and not key.endswith("drop_rate")
            and text(trained.get(key, UNSET)) != text(now.get(key, UNSET))]


def _resolved(cfg: ModelConfig) -> dict:
    """`cfg`'s constructor arguments beside its first-class settings: the variant's own, then model.kwargs."""
    variant = {k: v for k, v in VARIANTS.get(cfg.name, {}).items() if k not in ("arch", "img_size")}
    return {**variant, **cfg.kwargs}


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
