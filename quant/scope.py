"""What each pipeline quantizes, per task, and at what precision: generated from the pipelines themselves.

    python scripts/quant_scope.py            # print the table
    python scripts/quant_scope.py --write    # replace it in quant/README.md (between its markers)

Each pipeline runs on a tiny model of each task (random weights and inputs, CPU, seconds): GPT-2
(models/gpt.py `gpt2_nano`) and a timm ViT (models/variants.py `vit_nano`); Swin's rows are the ViT's
with `layers.*.blocks.*` names. The rows come from the quantized copy's layers (`modes.describe`), with
block indices folded into `*`: weights (bits, symmetric or not, granularity, how the range is set) and
the Linear's input (or the attention matmul operands): bits, granularity, static or dynamic range.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from .attention import OPERANDS, QuantAttentionBase
from .layers import QuantConv2d, QuantLinear
from .modes import describe
from .quantizers import Quantizer

# task -> (tiny model factory, calibration inputs factory, pipelines with the bit-width they are run at)
LM_PIPELINES = {"rtn": "w4a16", "gptq": "w4a16", "smoothquant": "w8a8", "smoothquant_strict": "w8a8"}
VISION_PIPELINES = {"percentile": "w4a4", "repq": "w4a4", **LM_PIPELINES}


def _gpt() -> nn.Module:
    from models.gpt import build_gpt

    return build_gpt("gpt2_nano", vocab_size=64).eval()


def _vit() -> nn.Module:
    import timm

    from models.variants import VARIANTS

    kwargs = dict(VARIANTS["vit_nano"])
    return timm.create_model(kwargs.pop("arch"), num_classes=10, **kwargs).eval()


TASKS: Dict[str, Tuple[Callable[[], nn.Module], Callable[[torch.Generator], torch.Tensor], Dict[str, str]]] = {
    "GPT-2": (_gpt, lambda g: torch.randint(0, 64, (4, 32), generator=g, device="cpu"), LM_PIPELINES),
    "ViT": (_vit, lambda g: torch.randn(4, 3, 32, 32, generator=g, device="cpu"), VISION_PIPELINES),
}

_OPERAND_NAMES = {"q": "q", "k": "k", "attn": "softmax output", "v": "v"}


def _pattern(fqn: str) -> str:
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", fqn)


def _join(names: List[str]) -> str:
    return ", ".join(f"`{n}`" for n in dict.fromkeys(names))


def scope_rows(fp_model: nn.Module, qmodel: nn.Module) -> List[Tuple[str, str, str]]:
    """(layers, weights, inputs / operands) of a quantized copy, one row per distinct description, then a
    row of what stays float (modules with parameters, and the attention matmuls when not converted)."""
    groups: Dict[Tuple[str, str, str], List[str]] = {}
    for row in describe(qmodel):
        if row["role"] == "attention":
            by_value: Dict[str, List[str]] = {}
            for op in OPERANDS:
                by_value.setdefault(row[op], []).append(_OPERAND_NAMES[op])
            operands = "; ".join(f"{', '.join(ops)}: {value}" for value, ops in by_value.items())
            key = (" matmuls q·kᵀ and softmax·v", "(no weights)", operands)
        else:
            key = ("", row["weight"], row["input"])
        groups.setdefault(key, []).append(_pattern(row["module"]))
    rows = [(_join(names) + suffix, weight, inputs) for (suffix, weight, inputs), names in groups.items()]
    converted = tuple(n + "." for n, m in qmodel.named_modules()
                      if isinstance(m, (QuantLinear, QuantConv2d, QuantAttentionBase, Quantizer)))
    kept = []
    for name, module in qmodel.named_modules():
        own = [p for p, _ in module.named_parameters(recurse=False)]
        if own and not (name + ".").startswith(converted):
            kept.extend([_pattern(name)] if name else own)  # the root's own: cls_token, pos_embed
    tied = getattr(fp_model, "wte", None) is not None and getattr(fp_model, "head", None) is not None \
        and fp_model.head.weight is fp_model.wte.weight
    text = _join(kept).replace("`head`", "`head` (tied to `wte`)") if tied else _join(kept)
    if not any(isinstance(m, QuantAttentionBase) for m in qmodel.modules()):
        text += ", attention matmuls"
    rows.append((text, "float", "float"))
    return rows


def scope_table() -> str:
    """The markdown table: task, pipeline (bits), layers, weights, inputs / attention operands."""
    from .registry import PIPELINES  # the registry imports every pipeline

    lines = ["| task | pipeline (bits) | layers | weights | inputs / attention operands |",
             "|---|---|---|---|---|"]
    for task, (make_model, make_inputs, pipelines) in TASKS.items():
        torch.manual_seed(0)
        model = make_model()
        calib = make_inputs(torch.Generator().manual_seed(0))
        for name, bits in pipelines.items():
            qmodel, _ = PIPELINES[name](model, calib, bits)
            for layers, weight, inputs in scope_rows(model, qmodel):
                lines.append(f"| {task} | {name} ({bits}) | {layers} | {weight} | {inputs} |")
    return "\n".join(lines)
