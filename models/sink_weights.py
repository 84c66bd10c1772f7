"""The error line for weights that fit the model but for its attention-sink parameters (`attn.sink_*`,
models/attention_sinks.py): a file of another `model.attn` variant than the model's.

Such a file's keys differ from the model's by the sink parameters alone (`sink_logit` for attn_bias, `sink_k` /
`sink_v` for kv_bias; softmax and softmax1 have none), which a list of keys does not say how to fix: the line names
the file's variant and the model.attn that loads it. The file's variant is the one its sink parameters give; for a
file without any, the one its run recorded (a train.py checkpoint's config: softmax1 has no parameters to tell it
from softmax).
"""
from __future__ import annotations

import torch.nn as nn

from .attention_sinks import SINK_PARAMS, VARIANTS

# the model.attn variant each sink parameter belongs to (every name of SINK_PARAMS)
SINK_VARIANT = {"sink_logit": "attn_bias", "sink_k": "kv_bias", "sink_v": "kv_bias"}
PLAIN = ("softmax", "softmax1")  # the variants without sink parameters


def is_sink_key(key: str) -> bool:
    """Whether the state-dict key `key` is an attention-sink parameter (blocks.0.attn.sink_k)."""
    return key.rpartition(".")[2] in SINK_PARAMS


def keys_variant(keys) -> str | None:
    """The model.attn variant whose sink parameters `keys` hold: 'softmax' for none (softmax1 has none either),
    None for those of several variants (no one model's)."""
    found = {SINK_VARIANT[k.rpartition(".")[2]] for k in keys if is_sink_key(k)}
    return found.pop() if len(found) == 1 else (None if found else "softmax")


def model_variant(model: nn.Module) -> str:
    """The model.attn variant of `model`'s attention modules ('softmax': timm's own)."""
    for name, variants in VARIANTS.items():
        if any(isinstance(m, tuple(variants.values())) for m in model.modules()):
            return name
    return "softmax"


def recorded_attn(payload: object) -> str | None:
    """The model.attn a train.py checkpoint (`payload`, what the file holds) records in its config; None for
    another file."""
    config = payload.get("config") if isinstance(payload, dict) else None
    model = config.get("model") if isinstance(config, dict) else None
    attn = model.get("attn") if isinstance(model, dict) else None
    return attn if isinstance(attn, str) else None


def sink_mismatch(missing: list, unexpected: list, state: dict, model: nn.Module, recorded: str | None) -> str:
    """What to set when the keys the file lacks (`missing`) and those the model lacks (`unexpected`) are all
    attention-sink parameters; '' when any other key differs (or none does). `state` is the file's state dict,
    `recorded` the model.attn its run recorded (None: not a train.py checkpoint)."""
    differ = [*missing, *unexpected]
    if not differ or not all(is_sink_key(k) for k in differ):
        return ""
    ours, theirs = model_variant(model), keys_variant(state)
    if theirs == "softmax" and recorded in PLAIN:
        theirs = recorded
    if theirs is None or theirs == ours:  # sink parameters of two variants, or some of the model's own: no setting
        return ""
    found = "; ".join(([f"the file lacks {_few(missing)}"] if missing else [])
                      + ([f"the model lacks {_few(unexpected)}"] if unexpected else []))
    if theirs in PLAIN:  # weights of a plain model into a sink variant: refused only when strict
        run = f"model.attn={theirs}" if recorded in PLAIN else "model.attn=softmax (or softmax1)"
        use = "drop the model.attn override (model.attn=softmax)" if theirs == "softmax" else "set model.attn=softmax1"
        return (f"weights of a {run} model, without the attention-sink parameters of the model's model.attn={ours} "
                f"({found}): {use} to use them as they are, or fine-tune them into model.attn={ours} with "
                f"model.pretrained_strict=false (its sink parameters start at zero)")
    return (f"weights of a model.attn={theirs} model, the model is model.attn={ours} ({found}): set "
            f"model.attn={theirs} to load them")


def _few(keys: list) -> str:
    """Up to three of `keys`, '...' marking those left out."""
    return str(keys[:3]) + ("..." if len(keys) > 3 else "")
