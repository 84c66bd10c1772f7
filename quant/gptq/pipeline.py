"""The weight-only LM settings of the paper: `rtn` (RTN-W4A16) and `gptq` (GPTQ-W4A16).

Both quantize the weights of every Linear inside the Transformer blocks (qkv, proj, fc1, fc2) on GPTQ's grid
(`quantizer.py`: per output channel, min/max including 0, asymmetric by default) and keep activations,
embeddings, the patch embedding, Swin's PatchMerging and the head float, as IST-DASLab/gptq's OPT / LLaMA
scripts do (their `find_layers` over each decoder layer; `lm_head` untouched).

rtn (their `--nearest`): each weight rounded to the nearest level of its channel's min/max grid; no data.

gptq (their `opt_sequential`, `llama_sequential`), block by block in order:
1. the block's calibration inputs are what the already-quantized earlier blocks produce: one forward of
   the calibration windows through the (quantized) prefix, stopped after the block, with the block itself
   still float; hooks accumulate each of its Linears' Hessian H = 2/n sum x x^T from the inputs they see
   (all of the block's Linears from that one pass, as `opt_sequential`; with `true_sequential` one pass per
   Linear, after the earlier ones of the block were quantized, as llama.py's option);
2. each Linear (a Conv2d as officially, on its unfolded inputs): GPTQ (`solver.py`) with the official defaults
   (percdamp 0.01, blocksize 128, no act_order, no groups); the result is written into the copy's weight and the
   layer's weight quantizer keeps the grid.
The next block's inputs then come from this quantized block (officially the block's outputs are recomputed
with its quantized weights; here the prefix forward recomputes them).
"""
from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from configs import ConfigError
from configs.quant import GPTQOptions, RTNOptions

from ..calibrate import Images, refit_weight_quantizers, stack_images
from ..convert import quantize_model, quantized_layers
from ..layout import in_block_layout
from ..modes import set_quant_state
from ..pipeline_base import Pipeline, PTQResult, StageTimer, check_float_ends, pipeline_report
from ..pipeline_data import PipelineData
from ..spec import Bits, QuantizerSpec, QuantSpec
from ..units import find_units, stream_module_inputs
from models.modules import fqn_matches
from .group_width import group_size_unread
from .quantizer import GPTQQuantizer
from .solver import HessianAccumulator, conv_rows, gptq_quantize

log = logging.getLogger("quant.gptq")


class RTNPipeline(Pipeline):
    """Round-to-nearest weight-only quantization (the paper's RTN-W4A16)."""

    name = "rtn"
    Options = RTNOptions
    weight_only = True
    calibrated = False
    tasks = ("classification", "causal_lm")
    default_bits = "w4a16"

    def check(self, bits: Bits, options: RTNOptions) -> None:
        super().check(bits, options)
        check_float_ends(self.name, options)

    def check_model_options(self, fp_model: nn.Module, bits: Bits, options: RTNOptions) -> None:
        # a group as wide as every quantized layer is per-channel: refused rather than recorded as a grouped run
        problem = group_size_unread(fp_model, self.layout(bits, options), self.name, options)
        if problem:
            raise ValueError(problem)

    def layout(self, bits: Bits, options: RTNOptions) -> QuantSpec:
        weight = QuantizerSpec(bits.w, kind=GPTQQuantizer, symmetric=options.symmetric, granularity="channel",
                               group_size=options.group_size)
        return in_block_layout(weight=weight, post_norm_input=None, block_input=None)

    def run(self, fp_model: nn.Module, calib_images: Images, bits: Bits, options: RTNOptions,
            data: Optional[PipelineData] = None) -> PTQResult:
        del calib_images, data  # the weights alone decide
        timer = StageTimer()
        device = next(fp_model.parameters()).device
        with timer("convert", device):
            model = quantize_model(fp_model, self.layout(bits, options))
        with timer("round", device):
            layers = quantized_layers(model)
            refit_weight_quantizers(layers)
            for _, layer in layers:
                layer.weight_quantizer.search_label = "GPTQ grid, round to nearest"
        report = pipeline_report(self.name, model, bits, options, calibration_images=0, seconds=timer.seconds)
        return PTQResult(model, report)


class GPTQPipeline(RTNPipeline):
    """GPTQ weight-only quantization (the paper's GPTQ-W4A16), block-sequential (see the module docstring).

    Its report adds `calibration_images` (N, the calibration inputs), `calibration_tokens` (the input rows the
    first quantized Linear's Hessian summed: N*T for N windows of T tokens, N*(patches + class token) for N images
    of a ViT; a later Swin stage sees fewer, its patch merging quartering the tokens) and `gptq_error`
    ({layer: GPTQ's error}).
    """

    name = "gptq"
    Options = GPTQOptions
    calibrated = True  # its Hessians come from the calibration windows

    def check(self, bits: Bits, options: GPTQOptions) -> None:
        super().check(bits, options)
        if options.static_groups and not options.group_size:
            # officially a silent no-op (fasterquant reads it only with groups): here the result would be
            # recorded as a static-groups one while it is the per-channel default
            raise ValueError("static_groups=true fixes the ranges of groups of input columns: give group_size "
                             "as well (without it every output channel has one range and there are no groups)")

    def check_model_options(self, fp_model: nn.Module, bits: Bits, options: GPTQOptions) -> None:
        super().check_model_options(fp_model, bits, options)
        # before any work: conv_rows refuses a grouped convolution (solver.py), here named by its path
        spec = self.layout(bits, options)
        for fqn, module in fp_model.named_modules():
            if (isinstance(module, nn.Conv2d) and module.groups != 1
                    and any(fqn_matches(fqn, rule.patterns) for rule in spec.linears)):
                raise ValueError(f"gptq cannot quantize {fqn}, a Conv2d with groups={module.groups}: GPTQ's Hessian "
                                 "is one of the whole unfolded input (IST-DASLab/gptq unfolds a convolution's input), "
                                 "which a grouped convolution's output channels do not each read; use rtn, or a "
                                 "model with an ungrouped convolution there")

    def run(self, fp_model: nn.Module, calib_images: Images, bits: Bits, options: GPTQOptions,
            data: Optional[PipelineData] = None) -> PTQResult:
        del data
        timer = StageTimer()
        device = next(fp_model.parameters()).device
        tokens = stack_images(calib_images)
        with timer("convert", device):
            model = quantize_model(fp_model, self.layout(bits, options)).eval()
        set_quant_state(model, weights=False)  # every layer float until GPTQ has quantized it
        errors: Dict[str, float] = {}
        rows: Dict[str, int] = {}
        with timer("gptq", device):
            for unit in find_units(model, ("block",)):
                start = time.perf_counter()
                block = model.get_submodule(unit.name)
                layers = [(f"{unit.name}.{n}", m) for n, m in quantized_layers(block)]
                for group in ([[layer] for layer in layers] if options.true_sequential else [layers]):
                    hessians = block_hessians(model, group, tokens, options.batch_size)
                    for name, layer in group:
                        rows[name] = hessians[name].rows
                        errors[name] = quantize_layer(layer, hessians[name].hessian, options, name, rows[name])
                log.info("%s: GPTQ of %d layers, error %s (%.1f s)", unit.name, len(layers),
                         " ".join(f"{errors[n]:.4g}" for n, _ in layers), time.perf_counter() - start)
        model.train(fp_model.training)  # evaluation mode only for the Hessians (no dropout); returned as given, as rtn
        report = pipeline_report(self.name, model, bits, options, calibration_images=int(tokens.shape[0]),
                                 calibration_tokens=next(iter(rows.values())), gptq_error=errors,
                                 seconds=timer.seconds)
        return PTQResult(model, report)


def block_hessians(model: nn.Module, layers: List[Tuple[str, nn.Module]], tokens: torch.Tensor,
                   batch_size: int) -> Dict[str, HessianAccumulator]:
    """GPTQ's Hessian of each layer (and the rows it summed) from the inputs it sees in `model`'s current state
    (the forward stops after the last of `layers`, which are in execution order)."""
    acc = {name: HessianAccumulator(layer.weight[0].numel(), layer.weight.device) for name, layer in layers}
    convs = {name: layer for name, layer in layers if isinstance(layer, nn.Conv2d)}

    def add(name: str, x: torch.Tensor) -> None:
        acc[name].add(conv_rows(convs[name], x) if name in convs else x)

    stream_module_inputs(model, dict(layers), layers[-1][0], tokens, batch_size, add)
    return acc


@torch.no_grad()
def quantize_layer(layer: nn.Module, hessian: torch.Tensor, options: GPTQOptions, name: str = "the layer",
                   tokens: int = 0) -> float:
    """GPTQ of one QuantLinear: its weight becomes GPTQ's result, its weight quantizer GPTQ's grid (enabled).
    `name` and `tokens` (the input rows its Hessian summed) only word the error below."""
    try:  # a conv's weight as the matrix of its unfolded input's columns (solver.py), reshaped back below
        q, error = gptq_quantize(layer.weight.float().flatten(1), hessian, layer.weight_quantizer,
                                 blocksize=options.blocksize, percdamp=options.percdamp,
                                 act_order=options.act_order, static_groups=options.static_groups)
    except ValueError as e:  # a Hessian of NaN / inf (solver.py), named by its layer
        raise ValueError(f"GPTQ of {name}: {e}") from None
    except torch.linalg.LinAlgError:
        # fewer calibration tokens than input columns leave H singular, and a tiny dampening does not make it
        # invertible in float32: the user's settings, worded as such rather than a traceback from cholesky
        raise ConfigError(f"quant.gptq.percdamp={options.percdamp}: the dampened Hessian of {name} "
                          f"({hessian.shape[0]} input columns, from {tokens} calibration tokens) is not positive "
                          f"definite, so GPTQ cannot invert it; give a larger quant.gptq.percdamp (default 0.01) "
                          f"or more calibration windows (quant.calib_images)") from None
    layer.weight.copy_(q.view_as(layer.weight))
    layer.weight_quantizer.enabled = True
    layer.weight_quantizer.search_label = "GPTQ"
    layer.invalidate_weight_cache()
    return error
