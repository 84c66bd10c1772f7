"""The W8A8 LM settings of the paper: `smoothquant` (SmoothQuant-W8A8) and `smoothquant_strict`.

After mit-han-lab/smoothquant: `smooth.py` (smooth_lm / smooth_ln_fcs), `fake_quant.py` (W8A8Linear,
quantize_model) and, for static ranges, `calibration.py` (get_static_decoder_layer_scales) with the
real-INT8 OPT of `opt.py`. Steps:

1. statistics: max |x| per input channel of qkv and fc1 on the calibration windows, float model;
2. smoothing (alpha 0.5): s migrated into norm1 / norm2 and the columns of qkv / fc1 (`smooth.py`);
3. conversion of every Linear inside the blocks (qkv, proj, fc1, fc2; as fake_quant.py converts the q, k,
   v, out_proj, fc1, fc2 of each OPT decoder layer, the LM head and embeddings float): weights symmetric
   max-abs, per output channel (W8A8Linear's per_channel; `weight_granularity=tensor`: per tensor, their
   per_tensor, with a fused qkv's q, k and v rows each their own tensor as OPT's three projections, see
   `fused_qkv.py`), inputs symmetric max-abs:
   * `smoothquant`: per token, dynamic (their `act_quant="per_token"`), attention matmuls float;
   * `smoothquant_strict`: per tensor, static: ranges fixed from the smoothed float model on the
     calibration windows (get_static_decoder_layer_scales: max |x| / 127), and the attention matmuls'
     operands quantized the same way: q, k, v (their quantize_bmm_input, i.e. the q/k/v projection
     outputs) and the softmax output (Int8OPTAttention's int8 probabilities; with the causal mask the
     max is 1, i.e. their fixed 1/127 grid).
   Every one of these is an option (`configs/quant.py` SmoothQuantOptions); quant/README.md gives the
   mapping to the official settings and where it departs.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, Optional

from torch import nn

from configs.quant import SmoothQuantOptions, SmoothQuantStrictOptions

from ..calibrate import Images, calibrate_from_float, refit_weight_quantizers, stack_images
from ..convert import convert_in_place, quantized_layers
from ..layout import in_block_layout
from ..pipeline_base import Pipeline, PTQResult, StageTimer, check_float_ends, pipeline_report
from ..pipeline_data import PipelineData
from ..quantizers import DynamicQuantizer
from ..reparam import BLOCK_FOLD_SITES, check_fold_sites
from ..ranges import RangeSearch
from ..spec import ATTENTION, AttentionRule, Bits, LinearRule, QuantizerSpec, QuantSpec
from .fused_qkv import FUSED_QKV_LINEARS, ProjectionTensorQuantizer
from .smooth import smooth_model


class SmoothQuantPipeline(Pipeline):
    """SmoothQuant W8A8 with per-token dynamic activations (the paper's SmoothQuant-W8A8)."""

    name = "smoothquant"
    Options = SmoothQuantOptions
    tasks = ("classification", "causal_lm")
    default_bits = "w8a8"

    def check(self, bits: Bits, options: SmoothQuantOptions) -> None:
        super().check(bits, options)
        check_float_ends(self.name, options)
        if options.act_calibration == "static" and options.act_granularity != "tensor":
            raise ValueError(f"act_calibration=static needs act_granularity=tensor (per-{options.act_granularity} "
                             "ranges are computed at run time)")

    def check_folds(self, fp_model: nn.Module, bits: Bits, options: SmoothQuantOptions) -> None:
        """The smoothing scales every in-block norm1 / norm2, an nn.LayerNorm with a weight (a bias too where there is
        one), in the pre-norm blocks its sites are written for (reparam.check_fold_sites)."""
        check_fold_sites(fp_model, BLOCK_FOLD_SITES, self.name, bias=False)

    def scheme_settings(self, options: SmoothQuantOptions) -> Dict[str, Any]:
        """Per-tensor weights give a fused qkv one max-abs scale per q / k / v projection (fused_qkv.py); results
        computed before had one scale for the fused weight under the same options, and recording the scheme makes
        them differ. Per-channel weights are the same either way: nothing."""
        if options.weight_granularity == "tensor":
            return {"qkv_weight_scales": "per_projection"}
        return {}

    def layout(self, bits: Bits, options: SmoothQuantOptions) -> QuantSpec:
        weight = QuantizerSpec(bits.w, symmetric=True, granularity=options.weight_granularity,
                               search=RangeSearch("minmax"))
        if options.act_calibration == "dynamic":
            act = QuantizerSpec(bits.a, kind=DynamicQuantizer, symmetric=True, granularity=options.act_granularity)
        else:
            act = QuantizerSpec(bits.a, symmetric=True, granularity="tensor", search=RangeSearch("minmax"))
        attention = None
        if options.quantize_bmm != "none":
            probs = act if options.quantize_bmm == "all" else None
            attention = AttentionRule(ATTENTION, q=act, k=act, attn=probs, v=act)
        layout = in_block_layout(weight=weight, post_norm_input=act, block_input=act, attention=attention)
        if options.weight_granularity != "tensor":
            return layout
        # per tensor: a fused qkv gets one scale per projection, as their q_proj / k_proj / v_proj each get one
        # (the first matching rule wins, so this one goes before the in-block rules)
        qkv_weight = dataclasses.replace(weight, kind=ProjectionTensorQuantizer)
        qkv = LinearRule(FUSED_QKV_LINEARS, qkv_weight, act, role="post_norm")
        return dataclasses.replace(layout, linears=(qkv,) + layout.linears)

    def run(self, fp_model: nn.Module, calib_images: Images, bits: Bits, options: SmoothQuantOptions,
            data: Optional[PipelineData] = None) -> PTQResult:
        del data
        timer = StageTimer()
        device = next(fp_model.parameters()).device
        tokens = stack_images(calib_images)
        model = copy.deepcopy(fp_model).eval()
        with timer("smooth", device):
            smoothed = smooth_model(model, tokens, options.alpha, options.batch_size)
        with timer("convert", device):
            convert_in_place(model, self.layout(bits, options))
            model.train(fp_model.training)
        with timer("calibrate", device):
            layers = quantized_layers(model)
            refit_weight_quantizers(layers)
            for _, layer in layers:
                layer.weight_quantizer.search_label = "max-abs"
            if options.act_calibration == "static":
                calibrate_from_float(model, tokens, options.batch_size)
        report = pipeline_report(self.name, model, bits, options, calibration_images=int(tokens.shape[0]),
                                 smoothed=[f"{n} -> {l}" for n, l in smoothed], seconds=timer.seconds)
        return PTQResult(model, report)


class SmoothQuantStrictPipeline(SmoothQuantPipeline):
    """SmoothQuant W8A8 with per-tensor static activations and quantized attention matmuls (the paper's
    SmoothQuant-W8A8-strict)."""

    name = "smoothquant_strict"
    Options = SmoothQuantStrictOptions
