"""What the percentile and RepQ-ViT pipelines share: first/last-layer options and the layer layout.

Both pipelines quantize the same points (reference notes 1.1 / 2.2), so that they differ only in
their quantizers: the inputs and weights of every Linear in the blocks (qkv, proj, fc1, fc2, Swin's
PatchMerging reduction) and of the head, the patch-embedding conv, and both operands of q @ k^T and
attn @ v. LayerNorm, softmax, GELU, residual adds and biases stay float.
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, Optional

import torch

from engine.distributed import broadcast

from ..calibrate import Images, calibrate
from ..convert import quantize_model
from ..modes import describe, summarize
from ..spec import ATTENTION, BLOCK_LINEARS, HEAD, POST_NORM_LINEARS, STEM, AttentionRule, Bits, LinearRule, \
    QuantizerSpec, QuantSpec


@dataclass
class FirstLastOptions:
    """Bit-widths of the patch embedding ("stem") and the classifier ("head").

    None follows the main w/a bits, 0 keeps that operand in float. Defaults are the official
    RepQ-ViT code: stem weights at w_bits, stem (image) input at 8 bits, head at w_bits / a_bits.
    QwT's re-runs use 8/8 for both (about +0.7 points at W4A4).
    """

    stem_w_bits: Optional[int] = None
    stem_a_bits: Optional[int] = 8
    head_w_bits: Optional[int] = None
    head_a_bits: Optional[int] = None

    def resolved(self, bits: Bits) -> Dict[str, Dict[str, Optional[int]]]:
        """{"stem": {"w": .., "a": ..}, "head": {...}} with None meaning float."""
        def pick(value: Optional[int], default: int) -> Optional[int]:
            return default if value is None else (value or None)
        return {"stem": {"w": pick(self.stem_w_bits, bits.w), "a": pick(self.stem_a_bits, bits.a)},
                "head": {"w": pick(self.head_w_bits, bits.w), "a": pick(self.head_a_bits, bits.a)}}


def _with_bits(spec: QuantizerSpec, bits: Optional[int]) -> Optional[QuantizerSpec]:
    return None if bits is None else dataclasses.replace(spec, bits=bits)


def standard_layout(*, weight: QuantizerSpec, post_norm_input: QuantizerSpec, block_input: QuantizerSpec,
                    q: QuantizerSpec, k: QuantizerSpec, attn: QuantizerSpec, v: QuantizerSpec,
                    first_last: Dict[str, Dict[str, Optional[int]]]) -> QuantSpec:
    """The quantization points shared by the pipelines, with the given quantizer for each role.

    Rule roles: "stem" (patch_embed.proj), "head" (head / head.fc / head_dist), "post_norm" (inputs
    are LayerNorm outputs: qkv, fc1, Swin reduction), "block" (proj, fc2). The stem and head
    quantizers copy `weight` / `block_input` with their own bit-widths.
    """
    stem, head = first_last["stem"], first_last["head"]
    return QuantSpec(
        linears=(
            LinearRule(STEM, _with_bits(weight, stem["w"]), _with_bits(block_input, stem["a"]), role="stem"),
            LinearRule(HEAD, _with_bits(weight, head["w"]), _with_bits(block_input, head["a"]), role="head"),
            LinearRule(POST_NORM_LINEARS, weight, post_norm_input, role="post_norm"),
            LinearRule(BLOCK_LINEARS, weight, block_input, role="block"),
        ),
        attentions=(AttentionRule(ATTENTION, q=q, k=k, attn=attn, v=v),),
    )


class StageTimer:
    """Wall time per named stage (device-synchronised so GPU work is attributed to its stage)."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str, device: torch.device) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds[name] = round(time.perf_counter() - start, 4)


@torch.no_grad()
@contextmanager
def isolated_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch's global RNG (and the device's) for a pipeline, restoring the caller's streams on exit."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def sync_across_ranks(model: torch.nn.Module) -> None:
    """Make every rank hold rank 0's quantized model (parameters, buffers; no-op without a process group).

    Pipelines run redundantly on every rank of a distributed evaluation with identical seeds; this
    removes any kernel-level non-determinism between ranks before the sharded evaluation.
    """
    for tensor in model.state_dict().values():
        if isinstance(tensor, torch.Tensor):
            broadcast(tensor)
    for module in model.modules():  # in-place collectives need not bump version counters
        if hasattr(module, "invalidate_weight_cache"):
            module.invalidate_weight_cache()


def convert_and_calibrate(fp_model: torch.nn.Module, spec: QuantSpec, calib_images: Images, timer: StageTimer,
                          device: torch.device) -> tuple:
    """Convert a copy of `fp_model` by `spec` and calibrate it in one sequential pass (RepQ-ViT's order).

    Returns:
        (quantized model, number of calibration images).
    """
    with timer("convert", device):
        model = quantize_model(fp_model, spec)
    with timer("calibrate", device):
        calib = calibrate(model, calib_images)
    return model, calib["images"]


def pipeline_report(pipeline: str, model: torch.nn.Module, bits: Bits, options, **extra) -> dict:
    """The fields every pipeline report has (layout, bits, options, per-layer rows and their summary),
    with the pipeline's own entries in `extra`."""
    layers = describe(model)
    return {"pipeline": pipeline, "bits": str(bits), **options.resolved(bits), "options": dataclasses.asdict(options),
            **extra, "summary": summarize(layers), "layers": layers}
