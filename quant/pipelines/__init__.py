"""Quantization pipelines by name: `PIPELINES["percentile"]`, `["repq"]`, `["aphq"]`, `["gplq"]`.

    from quant import PIPELINES
    qmodel, report = PIPELINES["repq"](fp_model, calib_images, "w4a4", {"round_zero_point": False})
"""
from .registry import PIPELINES, Pipeline, PTQResult, parse_options, register_pipeline
from . import aphq, gplq, percentile, repq  # noqa: F401,E402  (register the built-in pipelines)

__all__ = ["PIPELINES", "Pipeline", "PTQResult", "parse_options", "register_pipeline"]
