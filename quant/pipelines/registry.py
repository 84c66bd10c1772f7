"""Pipeline registry: name -> pipeline object, and the strict options parsing all pipelines share.

A pipeline is called as `PIPELINES[name](fp_model, calib_images, bits="w4a4", options=None)` and
returns `PTQResult(model, report)`: the quantized deep copy (the float model is untouched) and a small
JSON-able report (layout, stem/head bits, options, calibration size, seconds per stage). Later
pipelines (APHQ, GPLQ) subclass `Pipeline`, declare an `Options` dataclass and register themselves;
they also receive the optional `data` (a `PipelineData`) with the training images they draw.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Dict, Mapping, NamedTuple, Optional, Type, Union

from torch import nn

from ..calibrate import Images
from ..pipeline_data import PipelineData
from ..spec import Bits, QuantSpec, parse_bits


class PTQResult(NamedTuple):
    """What a pipeline returns: `model, report = PIPELINES["repq"](...)`."""

    model: nn.Module
    report: Dict[str, Any]


def parse_options(options_type: Type, options: Union[None, Mapping[str, Any], Any]) -> Any:
    """Build an options dataclass from a mapping; an unknown key is an error naming close matches."""
    if options is None:
        return options_type()
    if isinstance(options, options_type):
        return options
    known = {f.name for f in dataclasses.fields(options_type)}
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(sorted(known))}"
            raise ValueError(f"unknown option {key!r} for {options_type.__qualname__}{hint}")
    return options_type(**dict(options))


class Pipeline:
    """Base class: parse bits and options, then `run` (which usually starts from `layout`)."""

    name: str = ""
    Options: Type = type(None)

    def __call__(self, fp_model: nn.Module, calib_images: Images, bits: Union[str, Bits] = "w4a4",
                 options: Optional[Mapping[str, Any]] = None, data: Optional[PipelineData] = None) -> PTQResult:
        """Quantize a copy of `fp_model`.

        Args:
            fp_model: float timm ViT/DeiT/Swin, on the device to calibrate on (left untouched).
            calib_images: [N, 3, H, W] tensor or iterable of batches (eval transform; the entry point picks them).
            bits: "w4a4", "w6a6", "w8a8", ... or Bits(w, a).
            options: pipeline-specific overrides of `Options` (unknown keys raise).
            data: training data for pipelines that draw their own images (APHQ, GPLQ); percentile and
                repq ignore it (see pipeline_data.py).

        Returns:
            PTQResult(model, report).
        """
        return self.run(fp_model, calib_images, parse_bits(bits), parse_options(self.Options, options), data)

    def layout(self, bits: Bits, options: Any) -> QuantSpec:
        """The conversion spec this pipeline starts from (also used by tests and derived pipelines)."""
        raise NotImplementedError

    def run(self, fp_model: nn.Module, calib_images: Images, bits: Bits, options: Any,
            data: Optional[PipelineData] = None) -> PTQResult:
        raise NotImplementedError


PIPELINES: Dict[str, Pipeline] = {}


def register_pipeline(pipeline: Pipeline) -> Pipeline:
    """Add a pipeline instance under its `name` (an existing name is an error)."""
    if not pipeline.name:
        raise ValueError("a pipeline needs a name")
    if pipeline.name in PIPELINES:
        raise ValueError(f"pipeline {pipeline.name!r} is already registered")
    PIPELINES[pipeline.name] = pipeline
    return pipeline
