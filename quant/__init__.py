"""Fake quantization of timm ViT/DeiT/Swin: quantizers, quantized layers, conversion, calibration, pipelines, probes.

    from quant import PIPELINES, ActivationProbe, PipelineData
    qmodel, report = PIPELINES["repq"](fp_model, calib_images, "w4a4")        # or "percentile"
    qmodel, report = PIPELINES["aphq"](fp_model, calib_images, "w4a4", {"iters": 2000}, data=PipelineData(...))
    with ActivationProbe(fp_model) as probe: ...; probe.result().metrics()

Lower-level: `quantize_model(model, QuantSpec(...))` returns a converted deep copy (the original is
untouched); `calibrate(qmodel, images)` fits it. quant/ imports torch, timm, numpy, the standard library
and engine/ (runtime helpers: distributed, precision, the training loop and checkpoints, for GPLQ's
stage 1); it never imports data/, models/ or the entry points. See quant/README.md.
"""
from .calibrate import calibrate, refit_weight_quantizers
from .convert import quantize_model, quantized_layers
from .evaluate import evaluate_quantized
from .modes import describe, named_quantizers, quant_state, set_quant_state
from .pipeline_data import PipelineData, TrainBatches
from .pipelines import PIPELINES, Pipeline, PTQResult, register_pipeline
from .probes import ActivationProbe, ActMaxResult
from .quantizers import QUANTIZER_KINDS, LogSqrt2Quantizer, Quantizer, UniformQuantizer
from .ranges import RangeSearch
from .spec import AttentionRule, Bits, LinearRule, QuantizerSpec, QuantSpec, fqn_matches, parse_bits

__all__ = [
    "PIPELINES", "Pipeline", "PTQResult", "register_pipeline", "evaluate_quantized", "PipelineData", "TrainBatches",
    "quantize_model", "quantized_layers", "calibrate", "refit_weight_quantizers",
    "describe", "named_quantizers", "quant_state", "set_quant_state",
    "ActivationProbe", "ActMaxResult",
    "Quantizer", "UniformQuantizer", "LogSqrt2Quantizer", "QUANTIZER_KINDS", "RangeSearch",
    "QuantSpec", "LinearRule", "AttentionRule", "QuantizerSpec", "Bits", "parse_bits", "fqn_matches",
]
