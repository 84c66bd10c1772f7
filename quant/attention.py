"""Attention with explicit, quantizable matmuls, replacing timm's `Attention` (ViT/DeiT), Swin's
`WindowAttention`, their attention-sink variants (models/attention_sinks.py) and GPT-2's causal
self-attention (models/gpt.py).

timm (and models/gpt.py) run attention through fused SDPA, which never materialises q @ k^T or the probabilities,
so a quantized copy re-writes the forward as explicit steps, each a method a variant can override:

    q, k, v = project_qkv(x)                         # qkv Linear (a QuantLinear after conversion)
    scores  = attention_scores(q, k)                 # quant(q) @ quant(k)^T * scale
    scores  = scores + bias / masks                  # float (Swin: relative position bias, shift mask;
                                                     #   GPT-2: the causal mask)
    probs   = attention_probs(scores)                # float softmax; softmax1 / attn_bias override this
    context = attention_context(probs, v)            # quant(probs) @ quant(v)
    out     = proj(context)

The operand quantizers are `q_quant`, `k_quant`, `attn_quant`, `v_quant` (None = float operand); the
`qkv` / `proj` children keep their names, so FQN rules such as `blocks.*.attn.qkv` still match.
The softmax scale is applied after the first matmul for both model families (RepQ-ViT does this for
ViT; for Swin it scales q first). Uniform quantizers with percentile/min-max ranges are equivariant
to a positive scale, so both orders give the same codes and values up to float rounding.

Conversion is by exact source type (`ATTENTION_TYPES`; MMDetection's Swin `WindowMSA` by its qualified name). A
subclass of timm's Attention needs its own
entry there; it is never silently converted with the parent's forward. The attention-sink variants have
theirs: each quantized variant combines the variant's mixin from models/attention_sinks.py with the
classes here, so softmax1 / attn_bias replace `attention_probs` (the probabilities, whose rows then sum to
less than 1, still pass `attn_quant`) and kv_bias's `project_qkv` appends its sink key and value to k and
v before `k_quant` / `v_quant`. Scores then have N + 1 key columns: masks and Swin's relative-position bias
cover the N token keys and are padded with zeros for the sink (`pad_keys`).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Type

import torch
import torch.nn.functional as F
from torch import nn
# Import the classes the model modules use: timm >= 1.0.2x defines Attention in timm.layers and
# re-exports it here, older 1.0.x releases define it in vision_transformer.py itself.
from timm.models.swin_transformer import WindowAttention
from timm.models.vision_transformer import Attention

from models.gpt import CausalSelfAttention
from models.attention_sinks import (AttnBiasAttention, AttnBiasSink, AttnBiasWindowAttention, KVBiasAttention,
                                    KVBiasSink, KVBiasWindowAttention, Softmax1Attention, Softmax1Sink,
                                    Softmax1WindowAttention, pad_keys, token_mask)

from .quantizers import Quantizer

OPERANDS = ("q", "k", "attn", "v")


class QuantAttentionBase(nn.Module):
    """The quantized matmuls and the overridable steps shared by all converted attention modules."""

    num_heads: int
    scale: float

    def _init_quantizers(self, quantizers: Dict[str, Optional[Quantizer]]) -> None:
        for name in OPERANDS:
            self.register_module(f"{name}_quant", quantizers.get(name))

    @staticmethod
    def _maybe(quantizer: Optional[Quantizer], x: torch.Tensor) -> torch.Tensor:
        return x if quantizer is None else quantizer(x)

    def attention_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """matmul1 on quantized operands. q [B, H, N, D], k [B, H, N_keys, D] -> scores [B, H, N, N_keys]
        (N_keys = N, plus one for kv_bias's sink slot)."""
        return (self._maybe(self.q_quant, q) @ self._maybe(self.k_quant, k).transpose(-2, -1)) * self.scale

    def attention_probs(self, scores: torch.Tensor) -> torch.Tensor:
        """Float softmax over keys; attention-sink variants (softmax1, attn-bias) override this."""
        return scores.softmax(dim=-1)

    def attention_context(self, probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """matmul2 on quantized operands. probs [B, H, N, N_keys], v [B, H, N_keys, D] -> [B, H, N, D]."""
        return self._maybe(self.attn_quant, probs) @ self._maybe(self.v_quant, v)

    def project_qkv(self, x: torch.Tensor) -> tuple:
        """x [B, N, C] -> q, k, v [B, H, N, D]; kv_bias appends its sink slot to k and v."""
        return self.split_qkv(self.qkv(x))

    def split_qkv(self, qkv: torch.Tensor) -> tuple:
        """[B, N, 3*H*D] -> q, k, v of shape [B, H, N, D] (timm's fused layout: q|k|v, heads contiguous)."""
        B, N, _ = qkv.shape
        return qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)


class QuantAttention(QuantAttentionBase):
    """Converted timm `Attention` (ViT/DeiT); keeps qkv, q_norm, k_norm, norm, gate, proj as children."""

    def __init__(self, src: Attention, quantizers: Dict[str, Optional[Quantizer]]) -> None:
        super().__init__()
        self.num_heads = src.num_heads
        self.head_dim = src.head_dim
        self.scale = src.scale
        self.attn_dim = getattr(src, "attn_dim", src.num_heads * src.head_dim)  # older timm: no attn_dim
        self.qkv = src.qkv
        self.q_norm = src.q_norm
        self.k_norm = src.k_norm
        self.attn_drop = src.attn_drop
        self.norm = getattr(src, "norm", nn.Identity())
        self.gate = getattr(src, "gate", None)
        self.proj = src.proj
        self.proj_drop = src.proj_drop
        self._init_quantizers(quantizers)
        self.train(src.training)

    def project_qkv(self, x: torch.Tensor) -> tuple:
        """x [B, N, C] -> q, k, v [B, H, N, D] (after the optional q/k norms)."""
        q, k, v = self.split_qkv(self.qkv(x))
        return self.q_norm(q), self.k_norm(k), v

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.project_qkv(x)
        scores = self.attention_scores(q, k)
        mask = token_mask(attn_mask, is_causal, N, scores)  # SDPA semantics: is_causal wins over attn_mask
        if mask is not None:
            scores = scores + pad_keys(mask, scores.shape[-1])
        probs = self.attn_drop(self.attention_probs(scores))
        x = self.attention_context(probs, v).transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


class QuantWindowAttention(QuantAttentionBase):
    """Converted Swin `WindowAttention`: relative position bias and shift mask added in float
    after matmul1."""

    _dim_attr = "dim"  # the source's name for the channel width

    def __init__(self, src: WindowAttention, quantizers: Dict[str, Optional[Quantizer]]) -> None:
        super().__init__()
        self.dim = getattr(src, self._dim_attr)
        self.num_heads = src.num_heads
        self.scale = src.scale
        self.window_size = src.window_size
        self.qkv = src.qkv
        self.attn_drop = src.attn_drop
        self.proj = src.proj
        self.proj_drop = src.proj_drop
        self.relative_position_bias_table = src.relative_position_bias_table
        self.register_buffer("relative_position_index", src.relative_position_index, persistent=False)
        self._init_quantizers(quantizers)
        self.train(src.training)

    def relative_position_bias(self, n: int) -> torch.Tensor:
        """[1, H, N, N] bias gathered from the table (N = window area)."""
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        return bias.permute(2, 0, 1).unsqueeze(0)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [num_windows * B, N, C]; mask: [num_windows, N, N] of 0 / -inf (shifted windows) or None."""
        B_, N, C = x.shape
        q, k, v = self.project_qkv(x)
        scores = self.attention_scores(q, k)
        n_keys = scores.shape[-1]
        scores = scores + pad_keys(self.relative_position_bias(N), n_keys)
        if mask is not None:
            num_win = mask.shape[0]
            scores = (scores.view(-1, num_win, self.num_heads, N, n_keys)
                      + pad_keys(mask, n_keys).unsqueeze(1).unsqueeze(0))
            scores = scores.view(-1, self.num_heads, N, n_keys)
        probs = self.attn_drop(self.attention_probs(scores))
        x = self.attention_context(probs, v).transpose(1, 2).reshape(B_, N, -1)
        return self.proj_drop(self.proj(x))


class QuantWindowMSA(QuantWindowAttention):
    """Converted MMDetection 3.x `WindowMSA` (the attention of its Swin backbone, `...attn.w_msa`): the same
    computation as timm's WindowAttention (relative position bias and shift mask added in float after
    matmul1), under MMDetection's attribute names. MMDetection scales q before q @ k^T; see the module
    docstring for why applying the scale after matmul1 gives the same codes."""

    _dim_attr = "embed_dims"


class QuantCausalAttention(QuantAttentionBase):
    """Converted GPT-2 `models.gpt.CausalSelfAttention`: the causal mask is added in float after matmul1."""

    def __init__(self, src: CausalSelfAttention, quantizers: Dict[str, Optional[Quantizer]]) -> None:
        super().__init__()
        self.num_heads = src.num_heads
        self.head_dim = src.qkv.in_features // src.num_heads
        self.scale = self.head_dim ** -0.5  # SDPA's default scale, as the float module uses it
        self.qkv = src.qkv
        self.proj = src.proj
        self.attn_drop = src.attn_drop  # a probability (the float module calls SDPA with dropout_p)
        self.proj_drop = src.proj_drop
        self._init_quantizers(quantizers)
        self.train(src.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.project_qkv(x)
        scores = self.attention_scores(q, k)
        scores = scores + token_mask(None, True, N, scores)
        probs = F.dropout(self.attention_probs(scores), self.attn_drop if self.training else 0.0)
        x = self.attention_context(probs, v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class _SharedSink:
    """Registers the float variant's sink parameters (shared, not copied) under the same names."""

    sink_params: tuple

    def __init__(self, src: nn.Module, quantizers: Dict[str, Optional[Quantizer]]) -> None:
        super().__init__(src, quantizers)
        for name in self.sink_params:
            self.register_parameter(name, getattr(src, name))


class QuantSoftmax1Attention(Softmax1Sink, _SharedSink, QuantAttention):
    """Converted ViT softmax1 attention."""


class QuantAttnBiasAttention(AttnBiasSink, _SharedSink, QuantAttention):
    """Converted ViT attn-bias attention (sink_logit shared with the float module)."""


class QuantKVBiasAttention(KVBiasSink, _SharedSink, QuantAttention):
    """Converted ViT kv-bias attention (sink_k / sink_v shared; the sink slot passes k_quant / v_quant)."""


class QuantSoftmax1WindowAttention(Softmax1Sink, _SharedSink, QuantWindowAttention):
    """Converted Swin softmax1 window attention."""


class QuantAttnBiasWindowAttention(AttnBiasSink, _SharedSink, QuantWindowAttention):
    """Converted Swin attn-bias window attention."""


class QuantKVBiasWindowAttention(KVBiasSink, _SharedSink, QuantWindowAttention):
    """Converted Swin kv-bias window attention."""


AttentionFactory = Callable[[nn.Module, Dict[str, Optional[Quantizer]]], QuantAttentionBase]

# exact source type -> quantized replacement (constructor taking (src, quantizers))
ATTENTION_TYPES: Dict[Type[nn.Module], AttentionFactory] = {
    Attention: QuantAttention,
    WindowAttention: QuantWindowAttention,
    Softmax1Attention: QuantSoftmax1Attention,
    AttnBiasAttention: QuantAttnBiasAttention,
    KVBiasAttention: QuantKVBiasAttention,
    Softmax1WindowAttention: QuantSoftmax1WindowAttention,
    AttnBiasWindowAttention: QuantAttnBiasWindowAttention,
    KVBiasWindowAttention: QuantKVBiasWindowAttention,
    CausalSelfAttention: QuantCausalAttention,
}


# Types of optional libraries, by exact qualified name, so that quant/ does not import them (mmdet is an extra).
ATTENTION_TYPE_NAMES: Dict[str, AttentionFactory] = {
    "mmdet.models.backbones.swin.WindowMSA": QuantWindowMSA,
}


def convert_attention(src: nn.Module, quantizers: Dict[str, Optional[Quantizer]]) -> QuantAttentionBase:
    """Quantized replacement of `src`, which keeps src's parameters (shared, not copied).

    Raises:
        TypeError: src's exact type is not in ATTENTION_TYPES / ATTENTION_TYPE_NAMES.
    """
    name = f"{type(src).__module__}.{type(src).__qualname__}"
    factory = ATTENTION_TYPES.get(type(src)) or ATTENTION_TYPE_NAMES.get(name)
    if factory is None:
        raise TypeError(f"no quantized attention for {name}: add it to quant.attention.ATTENTION_TYPES "
                        "(subclasses are not converted with their parent's forward)")
    return factory(src, quantizers)

