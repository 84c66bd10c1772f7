"""Where quantizers go: the points the vision pipelines share, and the in-block scope of the LM pipelines.

Percentile, RepQ-ViT, APHQ and GPLQ quantize the same points, so that they differ only in their
quantizers (RepQ-ViT's official code, zkkli/RepQ-ViT `quant/quant_model.py`, quantizes these): the
inputs and weights of every Linear in the blocks (qkv, proj, fc1, fc2, Swin's PatchMerging reduction)
and of the head, the patch-embedding conv, and both operands of q @ k^T and attn @ v. LayerNorm,
softmax, GELU, residual adds and biases stay float. The stem and head bit-widths come from the
pipeline's FirstLastOptions (configs/quant.py).

rtn, gptq and smoothquant(_strict) quantize what the official GPTQ and SmoothQuant code quantize in OPT /
LLaMA: the Linears inside the Transformer blocks only (`in_block_layout`); embeddings, the patch
embedding, Swin's PatchMerging reduction and the (tied) LM head or classifier stay float.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from .spec import (ATTENTION, BLOCK_LINEARS, BLOCK_POST_NORM_LINEARS, DETECTOR_HEADS, HEAD, MERGE_LINEARS,
                   POST_NORM_LINEARS, STEM,
                   AttentionRule, LinearRule, QuantizerSpec, QuantSpec)


def _with_bits(spec: QuantizerSpec, bits: Optional[int]) -> Optional[QuantizerSpec]:
    return None if bits is None else dataclasses.replace(spec, bits=bits)


def standard_layout(*, weight: QuantizerSpec, post_norm_input: QuantizerSpec, block_input: QuantizerSpec,
                    q: QuantizerSpec, k: QuantizerSpec, attn: QuantizerSpec, v: QuantizerSpec,
                    first_last: Dict[str, Dict[str, Optional[int]]]) -> QuantSpec:
    """The quantization points shared by the pipelines, with the given quantizer for each role.

    Rule roles: "stem" (patch_embed.proj), "head" (head / head.fc / head_dist), "post_norm" (inputs
    are LayerNorm outputs: qkv, fc1, Swin reduction), "block" (proj, fc2), "detector_head" (a detector's
    neck and heads: every Conv2d / Linear there, as the official RepQ-ViT detection code quantizes them,
    with the block quantizers). The stem and head quantizers copy `weight` / `block_input` with their own
    bit-widths.
    """
    stem, head = first_last["stem"], first_last["head"]
    return QuantSpec(
        linears=(
            LinearRule(STEM, _with_bits(weight, stem["w"]), _with_bits(block_input, stem["a"]), role="stem"),
            LinearRule(HEAD, _with_bits(weight, head["w"]), _with_bits(block_input, head["a"]), role="head"),
            LinearRule(POST_NORM_LINEARS, weight, post_norm_input, role="post_norm"),
            LinearRule(BLOCK_LINEARS, weight, block_input, role="block"),
            LinearRule(DETECTOR_HEADS, weight, block_input, role="detector_head"),
        ),
        attentions=(AttentionRule(ATTENTION, q=q, k=k, attn=attn, v=v),),
    )


def in_block_layout(*, weight: QuantizerSpec, post_norm_input: Optional[QuantizerSpec],
                    block_input: Optional[QuantizerSpec], attention: Optional[AttentionRule] = None) -> QuantSpec:
    """The Linears inside the Transformer blocks (qkv, proj, fc1, fc2 of ViT, Swin and GPT-2), optionally
    the attention matmuls; every other Linear / Conv2d is deliberately float (`keep_float`).

    Rule roles as in `standard_layout`: "post_norm" (qkv, fc1: inputs are LayerNorm outputs), "block"
    (proj, fc2). None inputs stay float (weight-only pipelines).
    """
    return QuantSpec(
        linears=(LinearRule(BLOCK_POST_NORM_LINEARS, weight, post_norm_input, role="post_norm"),
                 LinearRule(BLOCK_LINEARS, weight, block_input, role="block")),
        attentions=(attention,) if attention is not None else (),
        keep_float=STEM + HEAD + MERGE_LINEARS + DETECTOR_HEADS,
    )
