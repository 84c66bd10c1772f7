"""Attention-sink variants of timm's ViT `Attention` and Swin `WindowAttention` (`model.attn`).

The paper (App. "Attention-Sink Variants", Table 6) trains ViT-B with three changes to the attention
softmax that give every query somewhere to put attention mass besides the image tokens, so that no token
has to become a "sink" (one source of massive activations). Each is one extra key slot per head:

    p_ij = exp(s_ij) / (exp(s_sink,i) + sum_j' exp(s_ij'))       out_i = sum_j p_ij v_j + p_sink,i v_sink

    softmax1   (kaul2024softmax1)      s_sink = 0,                   v_sink = 0   ("+1" in the denominator)
    attn_bias  (agarwal2025attnbias)   s_sink = b_h (learnable),      v_sink = 0   (+exp(b_h), per head h)
    kv_bias    (sun2024massive)        s_sink = scale * q_i . k'_h,   v_sink = v'_h (learnable k'_h, v'_h)

Computed stably with m = max(max_j s_ij, s_sink): p_ij = exp(s_ij - m) / (exp(s_sink - m) +
sum_j' exp(s_ij' - m)); for softmax1 that is m = max(max_j s_ij, 0). The rows sum to 1 - p_sink < 1, and
a fully masked row gives a zero output (plain softmax: NaN). softmax1 and attn_bias compute this softmax
explicitly (fused SDPA has no denominator term); kv_bias is a plain softmax over N + 1 keys, so it uses
SDPA with the widened K and V whenever timm's `fused_attn` is on.

Choices the paper leaves open, made here:
* attn_bias adds exp(b_h) to the denominator, with `sink_logit` = b_h of shape [heads]: the log-space
  parameter keeps the term positive and the formula above stable (the same form as gpt-oss's learned
  "sinks"). The paper says only "one learnable bias term added to the softmax denominator of each head".
* Initialisation: all sink parameters start at zero (`sink_logit` b_h = 0, i.e. a denominator term of 1;
  `sink_k` = `sink_v` = 0). So all three variants start as softmax1, and since zeros draw no random
  numbers, a seed gives the same qkv/proj/MLP initialisation as the plain softmax model.
* kv_bias: `sink_k` and `sink_v` are one vector of length heads * head_dim each (the layout of the K and V
  rows of qkv's bias, head h at [h * head_dim, (h + 1) * head_dim)), appended after the N keys / values.
* No weight decay on the sink parameters: they are 1-D, and the optimizer's rule (timm's param groups,
  engine/optim.py) exempts 1-D parameters like biases and norm scales. Decay would pull them towards zero,
  which for b_h means a fixed denominator term of 1 (softmax1), not "no sink": an arbitrary target.
* Swin: all three. The relative-position bias and the shifted-window mask are added to the token scores
  before the sink softmax; a kv_bias sink slot gets neither (bias 0, never masked), and every window
  shares the same sink key and value. Likewise a ViT `attn_mask` / `is_causal` masks tokens, never the sink.
* Replacement: `use_sink_attention` swaps every module of exact type Attention / WindowAttention of a
  built timm model for the variant, which takes over its children, parameters and settings, so the
  state-dict keys stay timm's (`attn.qkv.*`, `attn.proj.*`, ...) plus `attn.sink_*`. SwinTransformer has
  no `attn_layer` argument, so one mechanism serves both families (the variants' constructors also take
  timm's arguments, e.g. `VisionTransformer(attn_layer=KVBiasAttention)`).

The quantized counterparts (quant/attention.py) reuse the mixins below: their hooks `project_qkv` and
`attention_probs` are the steps that quant's explicit-matmul attention calls, so the sink key and value
pass the same k / v operand quantizers as the tokens and the probabilities, sink column included, pass
the same post-softmax quantizer.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import nn
from timm.models.swin_transformer import WindowAttention
from timm.models.vision_transformer import Attention

ATTN_CHOICES = ("softmax", "softmax1", "kv_bias", "attn_bias")  # `model.attn` (configs/schema.py)


def softmax_with_sink(scores: torch.Tensor, sink_logit: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim with one value-less extra key of logit `sink_logit` in the denominator.

    Args:
        scores: [..., N_keys] attention logits (masked entries -inf).
        sink_logit: broadcastable to scores[..., :1]: 0 for softmax1, b_h as [H, 1, 1] for attn_bias.

    Returns:
        exp(s_j - m) / (exp(sink_logit - m) + sum_j' exp(s_j' - m)), m = max(max_j s_j, sink_logit),
        computed in at least float32 (fp16 / bf16 scores are upcast, as autocast does for softmax) and
        returned in scores' dtype.
    """
    dtype = torch.promote_types(scores.dtype, torch.float32)
    x, s = scores.to(dtype), sink_logit.to(dtype)
    m = torch.maximum(x.amax(dim=-1, keepdim=True), s).detach()  # the result does not depend on m
    e = torch.exp(x - m)
    return (e / (e.sum(dim=-1, keepdim=True) + torch.exp(s - m))).to(scores.dtype)


def token_mask(attn_mask: Optional[torch.Tensor], is_causal: bool, n: int,
               like: torch.Tensor) -> Optional[torch.Tensor]:
    """timm's / SDPA's mask arguments as an additive float mask over the N token keys (None: no mask).

    A bool mask is True where attention is allowed; `is_causal` takes precedence over `attn_mask`.
    """
    if is_causal:
        return like.new_full((n, n), float("-inf")).triu_(1)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        return torch.zeros_like(attn_mask, dtype=like.dtype).masked_fill_(~attn_mask, float("-inf"))
    return attn_mask


def pad_keys(bias: torch.Tensor, n_keys: int) -> torch.Tensor:
    """An additive bias / mask over the token keys, widened with zero columns for the sink slots that
    follow them (a sink is never masked and has no position)."""
    extra = n_keys - bias.shape[-1]
    return bias if extra == 0 else F.pad(bias, (0, extra))


# -- the variants, as mixins over the attention steps (also used by quant/attention.py) -------------------
class Softmax1Sink:
    """softmax1 (Kaul et al. 2024): a constant 1 in the softmax denominator, i.e. a sink logit of 0."""

    kind = "softmax1"
    sink_params: Tuple[str, ...] = ()
    uses_plain_softmax = False

    def init_sink(self, heads: int, width: int, like: torch.Tensor) -> None:
        pass

    def attention_probs(self, scores: torch.Tensor) -> torch.Tensor:
        return softmax_with_sink(scores, scores.new_zeros(()))


class AttnBiasSink:
    """attn-bias (Agarwal et al. 2025): + exp(sink_logit[h]) in the softmax denominator of head h."""

    kind = "attn_bias"
    sink_params = ("sink_logit",)
    uses_plain_softmax = False

    def init_sink(self, heads: int, width: int, like: torch.Tensor) -> None:
        self.sink_logit = nn.Parameter(torch.zeros(heads, device=like.device, dtype=like.dtype))

    def attention_probs(self, scores: torch.Tensor) -> torch.Tensor:
        return softmax_with_sink(scores, self.sink_logit.view(-1, 1, 1))  # [H, 1, 1] against [B, H, N, N]


class KVBiasSink:
    """kv-bias (Sun et al. 2024, "Massive activations"): a learnable key and value appended after K and V."""

    kind = "kv_bias"
    sink_params = ("sink_k", "sink_v")
    uses_plain_softmax = True

    def init_sink(self, heads: int, width: int, like: torch.Tensor) -> None:
        self.sink_k = nn.Parameter(torch.zeros(width, device=like.device, dtype=like.dtype))
        self.sink_v = nn.Parameter(torch.zeros(width, device=like.device, dtype=like.dtype))

    def project_qkv(self, x: torch.Tensor) -> tuple:
        """q [B, H, N, D]; k, v [B, H, N + 1, D] with the sink slot last."""
        q, k, v = super().project_qkv(x)
        B, H, _, D = k.shape
        sink_k = self.sink_k.view(1, H, 1, D).expand(B, H, 1, D).to(k.dtype)
        sink_v = self.sink_v.view(1, H, 1, D).expand(B, H, 1, D).to(v.dtype)
        return q, torch.cat([k, sink_k], dim=2), torch.cat([v, sink_v], dim=2)


# -- float modules --------------------------------------------------------------------------------------
class _SinkModule:
    """Construction shared by the ViT and Swin variants: timm's constructor plus the sink parameters, or
    `from_module` to take over an existing timm module."""

    timm_type: Type[nn.Module]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.init_sink(self.num_heads, self.qkv.out_features // 3, self.qkv.weight)

    @classmethod
    def from_module(cls, src: nn.Module) -> nn.Module:
        """The variant of timm module `src`, holding src's children, parameters, buffers and settings
        (shared, not copied) and new, zero-initialised sink parameters on src's device and dtype."""
        if type(src) is not cls.timm_type:
            raise TypeError(f"{cls.__name__}.from_module takes a {cls.timm_type.__name__}, "
                            f"not a {type(src).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        persistent = set(src.state_dict(keep_vars=True))
        for key, value in vars(src).items():
            if not key.startswith("_"):  # plain settings: num_heads, scale, fused_attn, window_size, training
                object.__setattr__(new, key, value)
        for name, child in src.named_children():
            new.add_module(name, child)
        for name, param in src.named_parameters(recurse=False):
            new.register_parameter(name, param)
        for name, buf in src.named_buffers(recurse=False):
            new.register_buffer(name, buf, persistent=name in persistent)
        new.init_sink(new.num_heads, new.qkv.out_features // 3, new.qkv.weight)
        return new

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               bias: Optional[torch.Tensor]) -> torch.Tensor:
        """q [B, H, N, D], k / v [B, H, N_keys, D], bias additive over [.., N, N_keys] -> [B, H, N, D]."""
        if self.fused_attn and self.uses_plain_softmax:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                  dropout_p=self.attn_drop.p if self.training else 0.0)
        scores = (q * self.scale) @ k.transpose(-2, -1)
        if bias is not None:
            scores = scores + bias
        return self.attn_drop(self.attention_probs(scores)) @ v

    def attention_probs(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.softmax(dim=-1)


class SinkAttention(_SinkModule, Attention):
    """Base of the ViT/DeiT variants: timm's Attention written as project_qkv -> attend, the steps the
    sink mixins override (`attn_mask` and `is_causal` as in timm, applied to the token keys only)."""

    timm_type = Attention

    def project_qkv(self, x: torch.Tensor) -> tuple:
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return self.q_norm(q), self.k_norm(k), v

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.project_qkv(x)
        mask = token_mask(attn_mask, is_causal, N, q)
        x = self.attend(q, k, v, None if mask is None else pad_keys(mask, k.shape[-2]))
        x = self.norm(x.transpose(1, 2).reshape(B, N, self.attn_dim))
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


class SinkWindowAttention(_SinkModule, WindowAttention):
    """Base of the Swin variants: relative-position bias and shift mask over the token keys, then the sink."""

    timm_type = WindowAttention

    def project_qkv(self, x: torch.Tensor) -> tuple:
        B_, N, _ = x.shape
        return self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [num_windows * B, N, C]; mask: [num_windows, N, N] of 0 / -inf (shifted windows) or None."""
        B_, N, _ = x.shape
        q, k, v = self.project_qkv(x)
        bias = self._get_rel_pos_bias()  # [1, H, N, N]
        if mask is not None:  # windows are the fastest-varying part of B_ (timm's window_partition)
            num_win = mask.shape[0]
            bias = (bias.unsqueeze(1) + mask.unsqueeze(1).unsqueeze(0)).expand(B_ // num_win, -1, -1, -1, -1)
            bias = bias.reshape(B_, self.num_heads, N, N)
        x = self.attend(q, k, v, pad_keys(bias.to(q.dtype), k.shape[-2]))
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B_, N, -1)))


class Softmax1Attention(Softmax1Sink, SinkAttention):
    """ViT/DeiT attention with softmax1."""


class AttnBiasAttention(AttnBiasSink, SinkAttention):
    """ViT/DeiT attention with a learnable per-head denominator term exp(sink_logit)."""


class KVBiasAttention(KVBiasSink, SinkAttention):
    """ViT/DeiT attention with a learnable sink key and value (sink_k, sink_v)."""


class Softmax1WindowAttention(Softmax1Sink, SinkWindowAttention):
    """Swin window attention with softmax1."""


class AttnBiasWindowAttention(AttnBiasSink, SinkWindowAttention):
    """Swin window attention with a learnable per-head denominator term exp(sink_logit)."""


class KVBiasWindowAttention(KVBiasSink, SinkWindowAttention):
    """Swin window attention with a learnable sink key and value (sink_k, sink_v)."""


SINK_PARAMS = ("sink_logit", "sink_k", "sink_v")  # names of the variants' parameters inside `attn`

# model.attn -> {timm type: variant}
VARIANTS: Dict[str, Dict[Type[nn.Module], Type[nn.Module]]] = {
    "softmax1": {Attention: Softmax1Attention, WindowAttention: Softmax1WindowAttention},
    "kv_bias": {Attention: KVBiasAttention, WindowAttention: KVBiasWindowAttention},
    "attn_bias": {Attention: AttnBiasAttention, WindowAttention: AttnBiasWindowAttention},
}


def use_sink_attention(model: nn.Module, attn: str) -> int:
    """Replace, in place, every module of `model` whose exact type is timm's Attention or WindowAttention
    by the `attn` variant (`from_module`: same children and parameters, plus the sink parameters).

    Args:
        model: a freshly built timm model (build_model calls this before loading any weights).
        attn: one of ATTN_CHOICES; "softmax" changes nothing.

    Returns:
        The number of attention modules replaced (0 for "softmax").

    Raises:
        ValueError: unknown `attn`, or a variant was asked for and the model has no such module.
    """
    if attn == "softmax":
        return 0
    if attn not in VARIANTS:
        raise ValueError(f"unknown attention '{attn}'; choose one of {', '.join(ATTN_CHOICES)}")
    variants = VARIANTS[attn]
    replaced = 0
    for name, module in list(model.named_modules()):
        variant = variants.get(type(module))
        if variant is None:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, variant.from_module(module))
        replaced += 1
    if not replaced:
        raise ValueError(f"model.attn={attn}: {type(model).__name__} has no timm Attention or "
                         "WindowAttention module to turn into the variant (the variants exist for timm "
                         "ViT/DeiT and Swin); use model.attn=softmax")
    return replaced
