"""Quantized Linear and Conv2d: fake-quantized input and weight, float bias and float output.

They subclass nn.Linear / nn.Conv2d and adopt the original layer's parameters, so state-dict keys
(`...qkv.weight`, `...qkv.bias`) stay those of the float model; quantizer state is added under
`...qkv.weight_quantizer.*` and `...qkv.input_quantizer.*`.

Speed: in inference (grad disabled) the fake-quantized weight is computed once and cached. The cache
is keyed on the tensor objects (weak references), storage and version counter of the weight and of the
weight quantizer's parameters, so in-place edits (the RepQ-ViT LayerNorm fold, loading a state dict, an
optimizer step), device moves and a Parameter put in the old one's place (whose storage may reuse the freed
address, with the same version) invalidate it without any host sync in the forward pass. Inference tensors
(made under torch.inference_mode) have no version counter, so an in-place edit of one is invisible: a weight
or quantizer parameter that is one is fake-quantized at every forward, never cached. An edit through
`.data` (`layer.weight.data.mul_(2)`) is not seen either: `.data` is a tensor with a version counter of its own,
so the cache keeps the old values; edit in place under torch.no_grad() or call `invalidate_weight_cache()`.
"""
from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .quantizers import Quantizer


def _version(t: torch.Tensor) -> Tuple[int, Optional[int]]:
    # None: an inference tensor, which has no version counter (an in-place edit of it would go unseen)
    return t.data_ptr(), (None if t.is_inference() else t._version)


class _QuantWeightMixin:
    """Shared weight fake-quantization with the inference cache (needs `weight`, `weight_quantizer`)."""

    weight: nn.Parameter
    weight_quantizer: Optional[Quantizer]

    def _init_cache(self) -> None:
        self._wq_cache: Optional[torch.Tensor] = None
        self._wq_key: Optional[tuple] = None
        self._wq_refs: Optional[list] = None
        self.quant_role = ""  # label of the conversion rule that built this layer (reports)

    def quantized_weight(self) -> torch.Tensor:
        """The weight as the forward pass uses it (fake-quantized unless the quantizer is off)."""
        wq = self.weight_quantizer
        if wq is None or not wq.enabled:
            return self.weight
        needs_grad = torch.is_grad_enabled() and (
            self.weight.requires_grad or any(p.requires_grad for p in wq.parameters()))
        if needs_grad or not wq.calibrated:
            return wq(self.weight)
        tensors = [self.weight, *wq.parameters(recurse=False), *wq.buffers(recurse=False)]
        key = tuple(_version(t) for t in tensors)
        if any(version is None for _, version in key):
            return wq(self.weight).detach()
        # the same objects, not only the same address: a replaced tensor's storage may reuse a freed one
        refs = getattr(self, "_wq_refs", None)  # absent in a layer pickled before it existed
        same = refs is not None and len(refs) == len(tensors) and all(ref() is t for ref, t in zip(refs, tensors))
        if self._wq_cache is None or key != self._wq_key or not same:
            self._wq_cache = wq(self.weight).detach()
            self._wq_key, self._wq_refs = key, [weakref.ref(t) for t in tensors]
        return self._wq_cache

    def invalidate_weight_cache(self) -> None:
        self._wq_cache, self._wq_key, self._wq_refs = None, None, None

    def __getstate__(self) -> dict:
        # pickling (run_on_main sends quantized models to the other ranks, torch.save, deepcopy) leaves the
        # cache out: it would double the payload, and its key holds this process's tensor addresses
        state = dict(super().__getstate__())
        state["_wq_cache"], state["_wq_key"], state["_wq_refs"] = None, None, None  # weak references do not pickle
        return state

    def _apply(self, fn, *args, **kwargs):  # noqa: ANN001 - nn.Module signature
        self.invalidate_weight_cache()  # .to() / .half(): drop the copy on the old device or dtype
        return super()._apply(fn, *args, **kwargs)


class QuantLinear(_QuantWeightMixin, nn.Linear):
    """nn.Linear with fake-quantized input (any shape [..., C_in]) and weight [C_out, C_in]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 weight_quantizer: Optional[Quantizer] = None, input_quantizer: Optional[Quantizer] = None,
                 device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.register_module("weight_quantizer", weight_quantizer)
        self.register_module("input_quantizer", input_quantizer)
        self._init_cache()

    @classmethod
    def from_float(cls, linear: nn.Linear, weight_quantizer: Optional[Quantizer],
                   input_quantizer: Optional[Quantizer]) -> "QuantLinear":
        """Wrap `linear`, sharing (not copying) its weight and bias Parameters."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  weight_quantizer=weight_quantizer, input_quantizer=input_quantizer, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quantizer is not None:
            x = self.input_quantizer(x)
        return F.linear(x, self.quantized_weight(), self.bias)


class QuantConv2d(_QuantWeightMixin, nn.Conv2d):
    """nn.Conv2d (the patch embedding) with fake-quantized input [B, C, H, W] and weight [O, I, kh, kw]."""

    def __init__(self, *args, weight_quantizer: Optional[Quantizer] = None,
                 input_quantizer: Optional[Quantizer] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_module("weight_quantizer", weight_quantizer)
        self.register_module("input_quantizer", input_quantizer)
        self._init_cache()

    @classmethod
    def from_float(cls, conv: nn.Conv2d, weight_quantizer: Optional[Quantizer],
                   input_quantizer: Optional[Quantizer]) -> "QuantConv2d":
        """Wrap `conv`, sharing its weight and bias Parameters."""
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                  padding=conv.padding, dilation=conv.dilation, groups=conv.groups,
                  bias=conv.bias is not None, padding_mode=conv.padding_mode,
                  weight_quantizer=weight_quantizer, input_quantizer=input_quantizer, device="meta")
        new.weight = conv.weight
        new.bias = conv.bias
        new.train(conv.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quantizer is not None:
            x = self.input_quantizer(x)
        return self._conv_forward(x, self.quantized_weight(), self.bias)
