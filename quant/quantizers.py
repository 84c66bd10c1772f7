"""Stateful fake quantizers: uniform (asymmetric / symmetric; per tensor, channel or head), log-sqrt2, and
dynamic (SmoothQuant's max-abs ranges per token or per tensor, computed from every input at run time).

Life cycle of a quantizer (all flags are Python attributes, so forward never syncs with the device):

* built uncalibrated by the converter (`convert.py`, through its spec kind's `from_spec`);
* `calibrating = True` (see calibrate.py): the first tensor it sees fits its parameters, then it
  quantizes that same tensor, so downstream quantizers calibrate on already-quantized inputs;
* afterwards it is frozen: later batches never re-initialise it, and using an uncalibrated quantizer
  outside calibration is an error, not a silent pass-through. `reset()` re-opens calibration.

Parameters are buffers (`scale`, `zero_point`, `delta`); `make_learnable()` turns them into
nn.Parameters with the same state-dict names (LSQ / APHQ scale learning). With grad enabled the
forward uses straight-through rounding; `drop_prob` < 1 in training mode gives QDrop's element-wise
mix of quantized and float values. The calibrated flag is saved with the state dict (extra state).
"""
from __future__ import annotations

import numbers
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from .functional import fake_quant_log_sqrt2, fake_quant_uniform, qdrop_mix
from .ranges import RangeSearch, best_per_group, to_rows

MIN_SCALE = 1e-8  # smallest step size: guards constant tensors and learned scales against zero
MAX_CODE_BITS = 16  # widest code a quantizer takes (QuantizerSpec and the constructors share the check below)


def check_code_bits(bits: Any, signed: bool = False) -> None:
    """Raise ValueError unless `bits` is a code width a quantizer can have: a whole number in [1, 16], at least 2
    for a signed (symmetric) grid. Outside it the grid is meaningless, and silently so: 0 bits gives an infinite
    scale (NaN outputs), negative bits a constant, 1 signed bit the grid {-1, 0} with no positive level (scale
    max|x| / 0), and beyond 16 bits the step falls below MIN_SCALE."""
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or not 1 <= bits <= MAX_CODE_BITS:
        raise ValueError(f"bits must be a whole number in [1, {MAX_CODE_BITS}], got {bits!r}")
    if signed and bits < 2:
        raise ValueError(f"bits={bits}: a symmetric grid needs at least 2 bits (give 2..{MAX_CODE_BITS})")


class Quantizer(nn.Module):
    """Base class: the calibrate-once-then-freeze protocol shared by all quantizers."""

    repeats_its_input = True  # activation probes (engine/act_max.py) do not count a quantizer's output
    dynamic = False  # True: ranges are computed from each input at run time (nothing to calibrate)
    supports_groups = False  # True: weight ranges per group of input columns (QuantizerSpec.group_size)

    def __init__(self, bits: int, search: RangeSearch, signed: bool = False) -> None:
        # here, not only in QuantizerSpec: the constructors are an extension point (quant/README.md) of their own
        check_code_bits(bits, signed)
        super().__init__()
        self.bits = bits
        self.search = search
        self.enabled = True  # False: identity (float) pass-through
        self.calibrating = False  # True: an uncalibrated quantizer fits itself on its next input
        self.calibrated = False
        # QDrop (training only): the probability of an element's quantized value, the float one otherwise; 1: off.
        # The official codes' meaning of `drop_prob` (QDrop's, APHQ-ViT's: where(rand < drop_prob, quant, float))
        self.drop_prob = 1.0
        self.name = ""  # FQN, set by the converter, for error messages and reports
        self.search_label = ""  # how the parameters were set, when not by `search` (reports only)

    # -- subclasses implement these two ---------------------------------------------------------
    def fit(self, x: torch.Tensor) -> None:
        """Set the parameters from calibration data x (called once, under no_grad)."""
        raise NotImplementedError

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Fake-quantize x with the current parameters."""
        raise NotImplementedError

    # -- protocol -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        if not self.calibrated:
            if not self.calibrating:
                raise RuntimeError(f"quantizer {self.name or type(self).__name__} is used before "
                                   "calibration; run quant.calibrate(model, images) first")
            with torch.no_grad():
                self.fit(x.detach())
            self.calibrated = True
        # in x's dtype: the parameters are fp32, and a bf16 / fp16 model (or a float64 default dtype) would otherwise
        # get an fp32 weight or activation its next product refuses to multiply with its own dtype
        out = self.quantize(x).to(x.dtype)
        if self.training:
            out = qdrop_mix(x, out, self.drop_prob)
        return out

    def reset(self) -> None:
        """Forget the calibration: the next input seen in calibration mode fits the parameters again."""
        self.calibrated = False

    @classmethod
    def from_spec(cls, spec: Any, channel_dim: Optional[int], num_channels: Optional[int] = None,
                  device: Optional[torch.device] = None) -> "Quantizer":
        """Build from a `spec.QuantizerSpec` whose granularity the converter resolved into `channel_dim`."""
        return cls(spec.bits, spec.symmetric, channel_dim, num_channels, spec.search, device=device)

    def _use_ste(self, x: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad
                                            or any(p.requires_grad for p in self.parameters()))

    def make_learnable(self, **which: bool) -> None:
        """Turn the named parameter buffers into nn.Parameters (same state-dict keys).

        Example: `q.make_learnable(scale=True)`; keys that are False or absent stay buffers.
        """
        for key, on in which.items():
            if not on:
                continue
            if key not in self._buffers:
                raise KeyError(f"{type(self).__name__} has no parameter buffer {key!r}")
            value = self._buffers.pop(key)
            setattr(self, key, nn.Parameter(value.detach().clone()))

    def get_extra_state(self) -> Dict[str, Any]:
        return {"calibrated": self.calibrated, "enabled": self.enabled}

    def set_extra_state(self, state: Dict[str, Any]) -> None:
        self.calibrated = bool(state["calibrated"])
        self.enabled = bool(state["enabled"])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001
        # Per-channel groups of lazily sized quantizers are only known after calibration: adopt the
        # saved shapes before the default loader copies values (it refuses shape mismatches).
        for key in list(self._buffers):
            saved = state_dict.get(prefix + key)
            if (saved is not None and self._buffers[key] is not None
                    and saved.shape != self._buffers[key].shape):
                self._buffers[key] = torch.empty_like(saved, device=self._buffers[key].device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


# A range narrower than this fraction of its distance from 0 counts as degenerate (a near-constant group).
_DEGENERATE_WIDTH = 1e-3


def _widen_degenerate(lo: torch.Tensor, hi: torch.Tensor) -> tuple:
    """Stretch near-constant ranges to include 0.

    A group whose values barely vary (e.g. a LayerNorm channel with gamma ~ 0, which outputs ~beta)
    would get a tiny scale and a zero point of order |lo| / scale (1e8 and more): useless codes, and a
    LayerNorm fold whose mean zero point, and hence every folded bias, blows up. With [min(lo, 0),
    max(hi, 0)] the constant itself is a grid point (code 0 or 2^b - 1) and the zero point stays in
    range. Ranges of ordinary width keep RepQ-ViT's behaviour (0 need not be inside).
    """
    degenerate = (hi - lo) <= _DEGENERATE_WIDTH * torch.maximum(lo.abs(), hi.abs())
    return torch.where(degenerate, lo.clamp(max=0), lo), torch.where(degenerate, hi.clamp(min=0), hi)


def _broadcast(param: torch.Tensor, ndim: int, dim: Optional[int]) -> torch.Tensor:
    """View a [G] parameter so that it broadcasts along `dim` of an ndim-D tensor."""
    if dim is None:
        return param
    shape = [1] * ndim
    shape[dim] = -1
    return param.view(shape)


class UniformQuantizer(Quantizer):
    """Uniform fake quantizer with one (scale, zero point) per group.

    Asymmetric: codes 0 .. 2^b - 1, scale = (hi - lo) / (2^b - 1), zero point = round(-lo / scale)
    (not clamped to the code range, as in RepQ-ViT). Symmetric: codes -2^(b-1) .. 2^(b-1) - 1, zero
    point 0, scale = max(|lo|, |hi|) / (2^(b-1) - 1). With a multi-candidate `percentile_mse` search
    each group keeps its own lowest-MSE candidate.

    Args:
        bits: code width.
        symmetric: signed symmetric codes instead of unsigned asymmetric ones.
        channel_dim: None (per tensor) or the grouped dimension (0 weights, -1 activations, 1 heads).
        num_channels: groups along channel_dim; None sizes them at calibration.
        search: calibration range rule.
        device: where the parameters live (the device of the layer or operand they quantize).
    """

    def __init__(self, bits: int, symmetric: bool = False, channel_dim: Optional[int] = None,
                 num_channels: Optional[int] = None, search: RangeSearch = RangeSearch(),
                 device: Optional[torch.device] = None) -> None:
        super().__init__(bits, search, signed=symmetric)
        self.symmetric = symmetric
        self.channel_dim = channel_dim
        if symmetric:
            self.qmin, self.qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        else:
            self.qmin, self.qmax = 0, 2 ** bits - 1
        groups = 1 if channel_dim is None else (num_channels or 0)
        self.register_buffer("scale", torch.ones(groups, dtype=torch.float32, device=device))
        self.register_buffer("zero_point", torch.zeros(groups, dtype=torch.float32, device=device))

    def params_from_range(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple:
        """(scale, zero_point) of the given ranges ([G] tensors)."""
        if self.symmetric:
            scale = torch.maximum(lo.abs(), hi.abs()) / self.qmax
            return scale.clamp(min=MIN_SCALE), torch.zeros_like(scale)
        lo, hi = _widen_degenerate(lo, hi)
        scale = ((hi - lo) / (self.qmax - self.qmin)).clamp(min=MIN_SCALE)
        return scale, torch.round(-lo / scale)

    def fit(self, x: torch.Tensor) -> None:
        rows = to_rows(x, self.channel_dim)  # [G, M]
        params = [self.params_from_range(lo, hi) for lo, hi in self.search.candidates(rows)]
        if len(params) == 1 or not self.search.selects_by_mse:
            scale, zp = params[0]
        else:
            scale, zp, _ = best_per_group(
                lambda s, z: (fake_quant_uniform(rows, s[:, None], z[:, None], self.qmin, self.qmax) - rows)
                .pow_(2).mean(dim=1),
                torch.stack([s for s, _ in params]), torch.stack([z for _, z in params]))
        self.set_params(scale, zp)

    def set_params(self, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
        """Overwrite (and resize, for lazily sized groups) the parameters in place; marks calibrated.

        A resized buffer is created on the device of `scale` / `zero_point`, i.e. of the data they were
        fitted on, never on the device of the placeholder it replaces.
        """
        with torch.no_grad():
            for key, value in (("scale", scale), ("zero_point", zero_point)):
                current = getattr(self, key)
                value = value.detach().reshape(-1).to(current.dtype)
                if current.shape != value.shape:
                    if isinstance(current, nn.Parameter):
                        raise ValueError(f"cannot resize learnable {key} of {self.name}")
                    self._buffers[key] = value.clone()
                else:
                    current.copy_(value)
        self.calibrated = True

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        scale = _broadcast(self.scale, x.ndim, self.channel_dim)
        zp = _broadcast(self.zero_point, x.ndim, self.channel_dim)
        return fake_quant_uniform(x, scale, zp, self.qmin, self.qmax, ste=self._use_ste(x))

    def get_extra_state(self) -> Dict[str, Any]:
        # the grouping changes when RepQ-ViT folds a per-channel quantizer into a per-tensor one
        return {**super().get_extra_state(), "channel_dim": self.channel_dim}

    def set_extra_state(self, state: Dict[str, Any]) -> None:
        super().set_extra_state(state)
        self.channel_dim = state.get("channel_dim", self.channel_dim)

    def extra_repr(self) -> str:
        gran = ("tensor" if self.channel_dim is None
                else f"dim={self.channel_dim}, groups={self.scale.numel()}")
        return (f"bits={self.bits}, {'symmetric' if self.symmetric else 'asymmetric'}, {gran}, "
                f"search={self.search.method}, calibrated={self.calibrated}")


class LogSqrt2Quantizer(Quantizer):
    """RepQ-ViT's log-sqrt2 quantizer for post-softmax attention (one delta per tensor).

    Value delta * 2^(-q/2) for code q = round(-2 log2(x / delta)) clamped to [0, 2^b - 1]; inputs whose
    code would be >= 2^b become exactly 0. delta: the `search` upper percentiles of the whole tensor
    (one-sided), the candidate with the smallest MSE wins.
    """

    def __init__(self, bits: int, search: RangeSearch = RangeSearch(),
                 device: Optional[torch.device] = None) -> None:
        super().__init__(bits, search)
        self.register_buffer("delta", torch.ones(1, dtype=torch.float32, device=device))

    def fit(self, x: torch.Tensor) -> None:
        rows = to_rows(x, None)
        candidates = self.search.candidates(rows, lower=False)
        deltas = torch.stack([hi.clamp(min=MIN_SCALE) for _, hi in candidates])  # [K, 1]
        if len(deltas) > 1 and self.search.selects_by_mse:
            delta, _, _ = best_per_group(
                lambda d, _: (fake_quant_log_sqrt2(rows, d, self.bits) - rows).pow_(2).mean().reshape(1),
                deltas, torch.zeros_like(deltas))
        else:
            delta = deltas[0]
        with torch.no_grad():
            self.delta.copy_(delta.reshape(1))

    @classmethod
    def from_spec(cls, spec: Any, channel_dim: Optional[int], num_channels: Optional[int] = None,
                  device: Optional[torch.device] = None) -> "LogSqrt2Quantizer":
        if channel_dim is not None or spec.symmetric:
            raise ValueError("the log-sqrt2 quantizer is per-tensor and one-sided")
        return cls(spec.bits, spec.search, device=device)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant_log_sqrt2(x, self.delta, self.bits, ste=self._use_ste(x))

    def extra_repr(self) -> str:
        return f"bits={self.bits}, log-sqrt2, search={self.search.method}, calibrated={self.calibrated}"


class DynamicQuantizer(Quantizer):
    """Symmetric max-abs quantizer whose range is computed from each input at run time (no calibration).

    SmoothQuant's `quantize_activation_per_token_absmax` / `..._per_tensor_absmax` (mit-han-lab/smoothquant
    `smoothquant/fake_quant.py`): scale = max(|x| over the group, 1e-5) / (2^(b-1) - 1), value
    round(x / scale) * scale (no clamp is needed: |x| / scale <= 2^(b-1) - 1). Groups: one per sample for
    "per tensor" (`reduce_dims` None: every dim but the first, the batch's; their perplexity scripts run one
    sequence per forward, so their per-tensor range is one sequence's, and a range over the whole batch would
    make a window's result depend on the windows beside it, i.e. on the eval batch size and the number of
    ranks; on a Swin's window attention the first dim holds windows, so there it is one range per window), or
    one per token (`reduce_dims`: the dims pooled into one token's range, (-1,) for a Linear input [..., C],
    (1, -1) for an attention operand [B, H, N, D], i.e. all heads of a token as in a quantized q/k/v
    projection output).
    """

    dynamic = True
    MIN_RANGE = 1e-5  # the official clamp of the max-abs (before the division by 2^(b-1) - 1)

    def __init__(self, bits: int, reduce_dims: Optional[Tuple[int, ...]] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__(bits, RangeSearch("minmax"), signed=True)  # max-abs codes -2^(b-1) .. 2^(b-1) - 1
        del device  # no parameters: the scale lives on the device of each input
        self.reduce_dims = reduce_dims
        self.qmax = 2 ** (bits - 1) - 1
        self.calibrated = True  # nothing to fit

    @classmethod
    def from_spec(cls, spec: Any, channel_dim: Any, num_channels: Optional[int] = None,
                  device: Optional[torch.device] = None) -> "DynamicQuantizer":
        if spec.granularity not in ("tensor", "token") or not spec.symmetric:
            raise ValueError("the dynamic quantizer is symmetric, per tensor or per token")
        return cls(spec.bits, channel_dim if spec.granularity == "token" else None, device=device)

    def fit(self, x: torch.Tensor) -> None:
        pass

    def reset(self) -> None:
        pass  # stays calibrated: it has no parameters

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        dims = self.reduce_dims if self.reduce_dims is not None else tuple(range(1, x.dim()))
        amax = x.detach().abs().amax(dim=dims, keepdim=True) if dims else x.detach().abs().amax()
        scale = amax.clamp(min=self.MIN_RANGE) / self.qmax
        return fake_quant_uniform(x, scale, torch.zeros_like(scale), -self.qmax - 1, self.qmax,
                                  ste=self._use_ste(x))

    def get_extra_state(self) -> Dict[str, Any]:
        return {**super().get_extra_state(), "reduce_dims": self.reduce_dims}

    def set_extra_state(self, state: Dict[str, Any]) -> None:
        super().set_extra_state(state)
        self.calibrated = True
        self.reduce_dims = state.get("reduce_dims", self.reduce_dims)

    def extra_repr(self) -> str:
        gran = "tensor (one range per sample)" if self.reduce_dims is None else \
            f"token (max over dims {self.reduce_dims})"
        return f"bits={self.bits}, symmetric, dynamic per-{gran}"
