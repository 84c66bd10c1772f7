"""The quantization pipelines by name, and quantize-then-evaluate for evaluate.py.

    PIPELINES["repq"](fp_model, calib_images, "w4a4")        # -> PTQResult(model, report)

quant/ never loads data: the entry point supplies the calibration inputs (images, or token windows [N, T]
for a language model), optionally a `PipelineData` (training images for APHQ / GPLQ), and an `eval_fn` that
runs its own validation loop on a model and returns metrics such as {"top1": .., "top5": ..} or
{"perplexity": ..}.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Mapping, Optional, Union

import torch
from torch import nn

from engine.distributed import world_size

from .aphq.pipeline import APHQPipeline
from .calibrate import Images
from .gplq.pipeline import GPLQPipeline
from .gptq.pipeline import GPTQPipeline, RTNPipeline
from .pipeline_base import Pipeline
from .pipeline_data import PipelineData
from .ptq.percentile import PercentilePipeline
from .ptq.repq import RepQPipeline
from .smoothquant.pipeline import SmoothQuantPipeline, SmoothQuantStrictPipeline
from .spec import Bits, parse_bits

# the vision pipelines of the paper's W4A4 tables, then its GPT-2 settings (which run on ViTs too)
PIPELINES: Dict[str, Pipeline] = {p.name: p for p in (
    PercentilePipeline(), RepQPipeline(), APHQPipeline(), GPLQPipeline(),
    RTNPipeline(), GPTQPipeline(), SmoothQuantPipeline(), SmoothQuantStrictPipeline())}


def run_settings(pipeline: str) -> Dict[str, Any]:
    """What a result of `pipeline` depends on besides its options, calibration, weights and data: for a
    data-parallel pipeline (GPLQ trains on every rank), the number of ranks, which sets the global batch and
    each rank's shard; {} for the others, whose result is the same on any number of ranks."""
    if not PIPELINES[pipeline].data_parallel:
        return {}
    return {"world_size": world_size()}


def evaluate_quantized(pipeline: str, fp_model: nn.Module, calib_images: Images, bits: Union[str, Bits],
                       eval_fn: Callable[[nn.Module], Mapping[str, float]],
                       options: Optional[Mapping[str, Any]] = None,
                       data: Optional[PipelineData] = None) -> Dict[str, Any]:
    """Quantize a copy of `fp_model` and evaluate it.

    Args:
        pipeline: a key of `PIPELINES` ("percentile", "repq", ...).
        fp_model: float model (untouched).
        calib_images: calibration images (see `calibrate`).
        bits: "w4a4" etc.
        eval_fn: model -> metrics (the entry point's validation loop).
        options: pipeline options.
        data: training data for pipelines that draw their own images (APHQ, GPLQ; see pipeline_data.py).

    Returns:
        {**metrics, "seconds": total, "quantize_seconds": .., "eval_seconds": .., "report": pipeline report}
        e.g. for evaluate.py's JSON `quant[pipeline][str(bits)]`.
    """
    if pipeline not in PIPELINES:
        raise KeyError(f"unknown quantization pipeline {pipeline!r}; known: {sorted(PIPELINES)}")
    start = time.perf_counter()
    model, report = PIPELINES[pipeline](fp_model, calib_images, parse_bits(bits), options, data=data)
    mid = time.perf_counter()
    with torch.no_grad():
        metrics = dict(eval_fn(model))
    end = time.perf_counter()
    return {**metrics, "seconds": round(end - start, 3), "quantize_seconds": round(mid - start, 3),
            "eval_seconds": round(end - mid, 3), "report": report}
