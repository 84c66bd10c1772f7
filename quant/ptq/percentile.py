"""Percentile PTQ: per-tensor activation ranges from percentiles, per-channel weights, no reparameterisation.

What the paper's "percentile PTQ" column is taken to be (CD paper Table 2b, Sec. 4.4, and Table 6, App. A.4):
the paper cites Banner et al. 2019, which is an analytical-clipping method, not a percentile one, so the
citation does not define it. The authors' lab (QwT, GPLQ) uses "percentile" for RepQ-ViT's UniformQuantizer without
reparameterisation and without the log quantizer: GPLQ calls its weight initialiser "Percentile (as in
RepQ-ViT)", and QwT's "Percentile" baseline is exactly that quantizer with one batch of 32 images.
We therefore implement (not confirmed by the paper; every item is an option):

* the same quantization points as RepQ-ViT (quant/layout.py), so the two columns differ only in
  their quantizers; stem/head bits as in RepQ-ViT's code by default (stem input 8 bit);
* activations (Linear inputs, q, k, v, post-softmax map): asymmetric uniform, PER TENSOR, range by
  percentile candidates {0.999, 0.9999, 0.99999} with the lower end at 1 - p and MSE selection
  (`act_range="percentile_mse"`), or one fixed percentile pair (`act_range="percentile"`,
  default level 0.9999, i.e. [q(0.0001), q(0.9999)], the TensorRT / pytorch-quantization default);
* post-softmax: the same uniform quantizer (its lower end is ~0 since softmax >= 0); `softmax="log_sqrt2"`
  switches to RepQ-ViT's log quantizer;
* weights: asymmetric uniform per output channel, percentile candidates + MSE per channel;
* calibration: RepQ-ViT's sequential single pass on the calibration set; no reconstruction.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from torch import nn

from configs.quant import PercentileOptions

from ..calibrate import Images
from ..layout import standard_layout
from ..pipeline_base import Pipeline, PTQResult, StageTimer, convert_and_calibrate, pipeline_report
from ..pipeline_data import PipelineData
from ..quantizers import LogSqrt2Quantizer
from ..ranges import range_search
from ..spec import Bits, QuantizerSpec, QuantSpec


class PercentilePipeline(Pipeline):
    name = "percentile"
    Options = PercentileOptions
    tasks = ("classification", "detection")  # detection: MMDetection detectors (evaluate_detection.py)

    def check(self, bits: Bits, options: PercentileOptions) -> None:
        super().check(bits, options)
        for operand in ("act", "weight"):
            method, levels = getattr(options, f"{operand}_range"), getattr(options, f"{operand}_percentiles")
            if levels is not None and method == "minmax":  # they would be recorded but never read
                raise ValueError(f"{operand}_percentiles={list(levels)}: {operand}_range=minmax reads no percentile; "
                                 f"drop them, or set {operand}_range=percentile or percentile_mse")
            if levels is not None and not levels:
                raise ValueError(f"{operand}_percentiles=[]: give at least one level, or null for the default")
            # here, not in RangeSearch (which names neither key): a level is the upper quantile p of the range
            # [q(1 - p), q(p)], so p <= 0.5 would put its upper end at or below its lower one
            if levels is not None and not all(0.5 < p <= 1.0 for p in levels):
                raise ValueError(f"{operand}_percentiles={list(levels)}: each level p must lie in (0.5, 1] (the "
                                 f"range is [q(1 - p), q(p)]: 0.9999 clips to [q(0.0001), q(0.9999)]); give levels "
                                 f"such as 0.999 or 0.9999, or null for the default")
            if method == "percentile" and levels is not None and len(levels) != 1:
                raise ValueError(f"{operand}_range=percentile takes one level, {operand}_percentiles={list(levels)} "
                                 f"gives {len(levels)}; give one (e.g. {operand}_percentiles=[{levels[-1]}]), or "
                                 f"{operand}_range=percentile_mse to choose among them by calibration MSE")

    def recorded_options(self, options: PercentileOptions, ranks: Optional[int] = None) -> PercentileOptions:
        """`options` with the levels each operand's range rule runs with in place of null (`range_search`'s default
        for that rule); minmax reads none and keeps null (as does a rule no RangeSearch knows: a hand-edited result's,
        read by result_table.nondefault_settings). Result files compare these (engine/eval_results.py reads an
        older entry's null as the default of then)."""
        levels = {}
        for operand in ("act", "weight"):
            method = getattr(options, f"{operand}_range")
            if getattr(options, f"{operand}_percentiles") is None and method in ("percentile", "percentile_mse"):
                levels[f"{operand}_percentiles"] = range_search(method, None).percentiles
        return dataclasses.replace(options, **levels)

    def layout(self, bits: Bits, options: PercentileOptions) -> QuantSpec:
        act_search = range_search(options.act_range, options.act_percentiles)
        act = QuantizerSpec(bits.a, search=act_search)
        weight = QuantizerSpec(bits.w, symmetric=options.weight_symmetric, granularity="channel",
                               search=range_search(options.weight_range, options.weight_percentiles))
        attn = (QuantizerSpec(bits.a, kind=LogSqrt2Quantizer, search=act_search)
                if options.softmax == "log_sqrt2" else act)
        return standard_layout(weight=weight, post_norm_input=act, block_input=act, q=act, k=act, attn=attn,
                               v=act, first_last=options.resolved(bits))

    def run(self, fp_model: nn.Module, calib_images: Images, bits: Bits, options: PercentileOptions,
            data: Optional[PipelineData] = None) -> PTQResult:
        del data  # calibration images only
        timer = StageTimer()
        model, n_images = convert_and_calibrate(fp_model, self.layout(bits, options), calib_images, timer,
                                                next(fp_model.parameters()).device)
        report = pipeline_report(self.name, model, bits, self.recorded_options(options), calibration_images=n_images,
                                 seconds=timer.seconds)
        return PTQResult(model, report)

