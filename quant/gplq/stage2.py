"""GPLQ stage 2, shared by classifiers (pipeline.py) and detectors (detector.py): freeze the activation
quantizers, quantize the weights per output channel, then QwT block by block in order (qwt.py), each fit
seeing the quantized and already compensated prefix. How a block's fit gets its inputs is the caller's: a
classifier's images as one tensor, a detector's streamed image by image."""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from torch import nn

from configs.quant import GPLQOptions

from ..calibrate import refit_weight_quantizers
from ..convert import quantized_layers
from ..modes import quant_state, set_quant_state
from ..units import find_units
from .qwt import CompensationFit, add_compensation, fit_report

log = logging.getLogger("quant.gplq")

# (block FQN, reference: (*block args) -> reference output) -> the block's least-squares compensation
FitBlock = Callable[[str, Callable[..., torch.Tensor]], CompensationFit]


def block_reference(model: nn.Module, teacher: Optional[nn.Module], unit: str,
                    options: GPLQOptions) -> Callable[..., torch.Tensor]:
    """The output QwT moves block `unit` towards: the same block fully float (QwT's code), without weight
    quantization (w32a4), or the float model's block (teacher)."""
    if options.qwt_target == "teacher":
        return teacher.get_submodule(unit)
    block = model.get_submodule(unit)
    acts = None if options.qwt_target == "w32a4" else False

    def reference(*args) -> torch.Tensor:
        with quant_state(block, weights=False, activations=acts):
            return block(*args)
    return reference


def compensate_blocks(model: nn.Module, teacher: Optional[nn.Module], options: GPLQOptions,
                      fit_block: FitBlock) -> list:
    """QwT over the Transformer blocks of `model` in order (each fit sees the compensated prefix); the stats
    of every block."""
    stats = []
    for unit in find_units(model, kinds=("block",)):
        fit = fit_block(unit.name, block_reference(model, teacher, unit.name, options))
        if fit.keep:
            add_compensation(model.get_submodule(unit.name), fit.weight, fit.bias)
        stats.append({"unit": unit.name, **fit_report(fit)})
        log.info("GPLQ QwT %s: R2 %.4f, block error %.4g -> %.4g (%s)", unit.name, fit.r2, fit.sse_before,
                 fit.sse_after, "kept" if fit.keep else "dropped")
    return stats


def quantize_weights_and_compensate(model: nn.Module, teacher: Optional[nn.Module], options: GPLQOptions,
                                    fit_block: FitBlock, timer, device: torch.device) -> dict:
    """Stage 2 in place on `model` (module docstring); the report's `weights_refit` and `qwt` entries."""
    model.eval().requires_grad_(False)
    with timer("weights", device):
        set_quant_state(model, weights=True)
        n_weights = refit_weight_quantizers(quantized_layers(model))
    stats = []
    if options.qwt:
        with timer("qwt", device):
            stats = compensate_blocks(model, teacher, options, fit_block)
    model.eval()
    return {"weights_refit": n_weights,
            "qwt": {"blocks": stats, "kept": sum(s["kept"] for s in stats),
                    "images": options.stage2_images if options.qwt else 0, "target": options.qwt_target}}
