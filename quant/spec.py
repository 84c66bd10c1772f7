"""Declarative description of a quantized model: which layers (by fully-qualified name), which quantizers.

A `QuantSpec` is a list of rules. Each rule names modules with patterns over their FQNs as timm
spells them (`blocks.*.attn.qkv`, `layers.*.blocks.*.mlp.fc1`, `layers.*.downsample.reduction`,
`head`, `head.fc`, `patch_embed.proj`). Patterns match name segments (see `fqn_matches`): `*` is
one segment (fnmatch inside it), `**` any number of segments. The rule then says how its modules'
weights / inputs (Linear, Conv2d) or matmul operands (attention) are quantized. The first rule that
matches a module wins. `quantize_model` (convert.py) applies a spec to a copy of a model.

Pipelines build their specs from the pattern groups below; APHQ / GPLQ add their own layouts
(per-head matmul operands, symmetric per-channel activations, learnable kinds) with the same types.
"""
from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Optional, Tuple, Type

from .quantizers import Quantizer, UniformQuantizer, check_code_bits
from .ranges import RangeSearch

Granularity = Literal["tensor", "channel", "head", "token"]


# timm 1.0 module names (ViT/DeiT: blocks.N; Swin: layers.N.blocks.M, PatchMerging at the start of
# stages 1-3 as layers.N.downsample, classifier at head.fc). DeiT-distilled adds head_dist.
BLOCK_POST_NORM_LINEARS = ("blocks.*.attn.qkv", "blocks.*.mlp.fc1", "layers.*.blocks.*.attn.qkv",
                           "layers.*.blocks.*.mlp.fc1")
MERGE_LINEARS = ("layers.*.downsample.reduction",)  # Swin's PatchMerging, between blocks
POST_NORM_LINEARS = BLOCK_POST_NORM_LINEARS + MERGE_LINEARS
BLOCK_LINEARS = ("blocks.*.attn.proj", "blocks.*.mlp.fc2", "layers.*.blocks.*.attn.proj",
                 "layers.*.blocks.*.mlp.fc2")
STEM = ("patch_embed.proj",)
HEAD = ("head", "head.fc", "head_dist")
ATTENTION = ("blocks.*.attn", "layers.*.blocks.*.attn")

# MMDetection 3.x's Swin as the `backbone` of a detector: blocks at backbone.stages.N.blocks.M, attention in
# attn.w_msa, the MLP as ffn.layers.0.0 (fc1, after norm2) and ffn.layers.1 (fc2), PatchMerging at the END of
# stages 0-2 (stages.N.downsample), the patch embedding conv at patch_embed.projection. Every other Conv2d /
# Linear of the detector (FPN neck, RPN and RoI heads) is a DETECTOR_HEADS layer, which the vision pipelines
# quantize like the in-block Linears, as the official RepQ-ViT / APHQ detection code does (every nn.Conv2d and
# nn.Linear of the detector; the mask head's ConvTranspose2d stays float there and here).
_MMDET_BLOCK = "backbone.stages.*.blocks.*"
BLOCK_POST_NORM_LINEARS += (f"{_MMDET_BLOCK}.attn.w_msa.qkv", f"{_MMDET_BLOCK}.ffn.layers.0.0")
MERGE_LINEARS += ("backbone.stages.*.downsample.reduction",)
POST_NORM_LINEARS = BLOCK_POST_NORM_LINEARS + MERGE_LINEARS
BLOCK_LINEARS += (f"{_MMDET_BLOCK}.attn.w_msa.proj", f"{_MMDET_BLOCK}.ffn.layers.1")
STEM += ("backbone.patch_embed.projection",)
ATTENTION += (f"{_MMDET_BLOCK}.attn.w_msa",)
DETECTOR_HEADS = ("neck.**", "rpn_head.**", "roi_head.**")


@dataclass(frozen=True)
class QuantizerSpec:
    """How to build one quantizer.

    `kind` is the quantizer class (UniformQuantizer, LogSqrt2Quantizer, DynamicQuantizer, or a subclass
    such as APHQ's AdaRoundQuantizer, GPLQ's LSQQuantizer and GPTQ's GPTQQuantizer), built by its
    `from_spec`. Granularity: "tensor" (one scale), "channel" (weights: output channel = dim 0;
    activations: the LAST dim, pooled over batch and tokens, also for NHWC tensors; conv inputs: dim 1),
    "head" (attention operands [B, H, N, D]: dim 1) or "token" (one scale per token, computed on the fly:
    dynamic kinds only; a Linear input [..., C] per row of C, an attention operand [B, H, N, D] per (b, n)
    over all heads, as SmoothQuant's per-token quantization of a q/k/v projection's output).
    group_size: weights only, one range per output channel and group of that many input columns (GPTQ's
    groupsize; kinds with `supports_groups`).
    """

    bits: int
    kind: Type[Quantizer] = UniformQuantizer
    symmetric: bool = False
    granularity: Granularity = "tensor"
    search: RangeSearch = field(default_factory=RangeSearch)
    group_size: Optional[int] = None

    def __post_init__(self) -> None:
        # the constructors' own check, here too so that a layout is refused when built, before any model is converted
        check_code_bits(self.bits, signed=self.symmetric or self.kind.dynamic)
        if self.granularity not in ("tensor", "channel", "head", "token"):
            raise ValueError(f"unknown granularity {self.granularity!r}")
        if self.granularity == "token" and not self.kind.dynamic:
            raise ValueError(f"per-token ranges are computed at run time: {self.kind.__name__} is not a dynamic "
                             "quantizer kind")
        if self.group_size is not None and not self.kind.supports_groups:
            raise ValueError(f"group_size={self.group_size}: {self.kind.__name__} has no groups of input "
                             "columns (GPTQ's grid, the rtn / gptq pipelines, has them)")
        if self.group_size is not None and self.group_size < 1:
            # a kind with groups was asked for none: saying it "has none" would send the user to another kind
            raise ValueError(f"group_size={self.group_size}: needs a positive size (input columns per range)")


@dataclass(frozen=True)
class LinearRule:
    """Quantize every nn.Linear / nn.Conv2d whose FQN matches one of `patterns`.

    weight / input: None leaves that operand in float. `role` labels the rule in reports and lets
    pipelines find layers again (e.g. the post-LayerNorm inputs that RepQ-ViT reparameterises).
    """

    patterns: Tuple[str, ...]
    weight: Optional[QuantizerSpec]
    input: Optional[QuantizerSpec]
    role: str = ""


@dataclass(frozen=True)
class AttentionRule:
    """Rewrite attention modules matching `patterns` with explicit, quantized matmuls.

    q, k: operands of q @ k^T; attn, v: operands of attn @ v (attn = post-softmax probabilities).
    """

    patterns: Tuple[str, ...]
    q: Optional[QuantizerSpec]
    k: Optional[QuantizerSpec]
    attn: Optional[QuantizerSpec]
    v: Optional[QuantizerSpec]


@dataclass(frozen=True)
class QuantSpec:
    """A whole-model quantization layout.

    keep_float: FQN patterns of Linear/Conv2d layers deliberately left in float. With `strict`, every
    nn.Linear / nn.Conv2d of the model must match a rule or `keep_float`, so that a layer that a new
    model variant adds is never silently left unquantized.
    """

    linears: Tuple[LinearRule, ...]
    attentions: Tuple[AttentionRule, ...] = ()
    keep_float: Tuple[str, ...] = ()
    strict: bool = True


MIN_BITS, MAX_BITS = 2, 16  # a 1-bit symmetric grid has no positive level; beyond 16 bits is float territory
FLOAT_BITS = 16  # w16 / a16: that operand stays in float (the LM convention: W4A16 = 4-bit weights only)


class Bits(NamedTuple):
    """Weight and activation bit-widths, e.g. parsed from "w4a4"; 16 means float ("w4a16": weights only)."""

    w: int
    a: int

    def __str__(self) -> str:
        return f"w{self.w}a{self.a}"

    @property
    def float_weights(self) -> bool:
        return self.w >= FLOAT_BITS

    @property
    def float_activations(self) -> bool:
        return self.a >= FLOAT_BITS


def parse_bits(bits: "str | Bits | Tuple[int, int]") -> Bits:
    """Parse "w4a4" / "W6A6" / "w4a16" / (8, 8) / Bits(4, 4) into `Bits` (16 bits: that operand stays float;
    which combinations a pipeline accepts is its `Pipeline.check`)."""
    if isinstance(bits, str):
        m = re.fullmatch(r"[wW](\d+)[aA](\d+)", bits.strip())
        if m is None:
            raise ValueError(f"bit-width {bits!r} is not of the form 'w4a4'")
        w, a = int(m.group(1)), int(m.group(2))
    else:
        if any(isinstance(b, bool) or not isinstance(b, numbers.Integral) for b in bits):
            raise ValueError(f"bit-width {tuple(bits)!r}: give whole numbers of bits, e.g. (4, 4)")
        w, a = (int(b) for b in bits)
    if not (MIN_BITS <= w <= MAX_BITS and MIN_BITS <= a <= MAX_BITS):
        raise ValueError(f"bit-width {str(bits)!r}: weight and activation bits must lie in "
                         f"{MIN_BITS}..{MAX_BITS}")
    return Bits(w, a)


def bits_order(bits: str) -> tuple:
    """Sort key of bit-width names as numbers, weights then activations: w3a3, w4a4, w4a8, w4a16, w8a8 (as text,
    w4a16 would come before w4a4); a name that does not parse comes last, by its text."""
    try:
        return (0, *parse_bits(bits), "")
    except ValueError:
        return (1, 0, 0, bits)
