"""Fake quantization of timm ViT/DeiT/Swin and GPT-2: quantizers, conversion, calibration and eight pipelines.

    from quant import PIPELINES, PipelineData
    qmodel, report = PIPELINES["repq"](fp_model, calib_images, "w4a4")        # or "percentile"
    qmodel, report = PIPELINES["aphq"](fp_model, calib_images, "w4a4", {"iters": 2000},
                                       data=PipelineData(...))
    qmodel, report = PIPELINES["gptq"](gpt, calib_tokens, "w4a16")            # rtn, smoothquant(_strict)

The shared core is in this folder (quantizers, layers, attention, spec, convert, calibrate, ranges,
reparam, units, layout; plan: the evaluation a config asks for and its checks; pipeline_base: the interface
every pipeline implements, pipeline_data: the training data some draw, registry: PIPELINES by name, scope:
what each quantizes); each method family is a sub-package: ptq/ (percentile, RepQ-ViT), aphq/, gplq/, gptq/
(GPTQ, RTN), smoothquant/. quant/ imports torch, timm, configs (its options), models (the attention
classes it replaces) and engine (distributed helpers, the training loop for GPLQ's stage 1, the task of a
data set); never data/ or the entry points. See quant/README.md.
"""
from .convert import quantize_model
from .pipeline_data import PipelineData
from .registry import PIPELINES, evaluate_quantized, run_settings
from .spec import Bits, bits_order, parse_bits

__all__ = ["PIPELINES", "evaluate_quantized", "run_settings", "PipelineData", "quantize_model", "Bits",
           "bits_order", "parse_bits"]
