"""Weights files whose tensors are not weights: integer (or bool) values where the model holds a floating-point
parameter or buffer, e.g. the int8 codes of a quantized model saved without their scales.

torch's `load_state_dict` copies them in with a cast (the code 57 becomes the weight 57.0), so the model would be
trained or scored on numbers that are not its weights, without a word. A float16 / bfloat16 file is weights at a
lower precision and loads as it is (cast to the model's dtype); the model's own integer buffers (Swin's
relative_position_index) take integers as before.
"""
from __future__ import annotations

import torch

# the advice of the refusal: only the codes and their scales together give the weights back
DEQUANTIZE = "quantized codes without their scales are not weights: dequantize first"


def not_floating(state: dict, own: dict) -> list[str]:
    """The keys of `state` (a file's state dict) whose tensor is not floating point where the model's entry of that
    name (`own`, its state dict) is, in the file's order; keys the model lacks are left to the key checks."""
    return [k for k, v in state.items() if isinstance(own.get(k), torch.Tensor) and own[k].is_floating_point()
            and not v.is_floating_point()]


def codes_refusal(state: dict, own: dict, path: str) -> str:
    """The error line for a file (`path`) that holds non-floating-point tensors where the model's are floating point
    (`not_floating`), naming the first of them and its dtype; '' for none."""
    keys = not_floating(state, own)
    if not keys:
        return ""
    key = keys[0]
    others = f" ({len(keys) - 1} more tensor(s) of the file alike)" if len(keys) > 1 else ""
    return (f"model.pretrained={path}: '{key}' is {state[key].dtype}, the model's {own[key].dtype}{others}: "
            f"{DEQUANTIZE} (give the floating-point weights)")
