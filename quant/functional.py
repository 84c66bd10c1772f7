"""Stateless fake-quantization math: uniform (affine) and log-sqrt2, plus the straight-through helpers.

Everything here is elementwise torch, vectorised over channels/heads through broadcasting of the
scale and zero-point tensors (no Python loops, no host syncs). Quantizer modules (`quantizers.py`)
hold the parameters and call these functions; learnable-scale methods (LSQ, APHQ's activation-scale
learning) call them with `ste=True` so gradients reach the input and the scale.
"""
from __future__ import annotations

import torch


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round half to even in the forward pass, identity gradient in the backward pass."""
    return x + (torch.round(x) - x).detach()


def qdrop_mix(fp: torch.Tensor, q: torch.Tensor, prob: float) -> torch.Tensor:
    """QDrop: each element of the quantized `q` with probability `prob`, of the float `fp` otherwise (1: `q`
    alone), the official `drop_prob` (QDrop, APHQ-ViT: where(rand < drop_prob, quantized, float)). The float
    element where rand < 1 - prob: the complement mask of the official one, equal in distribution."""
    if prob >= 1:
        return q
    return torch.where(torch.rand_like(q) < 1.0 - prob, fp, q)


def grad_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Same value as x, gradient multiplied by `factor` (LSQ's step-size gradient scaling)."""
    return x * factor + (x - x * factor).detach()


def fake_quant_uniform(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int,
                       qmax: int, ste: bool = False) -> torch.Tensor:
    """Uniform affine fake quantization `(clamp(round(x / s) + z, qmin, qmax) - z) * s`.

    Rounding is half-to-even (torch.round), the division is a true division (as in RepQ-ViT, so that
    codes at .5 ties match it), and z may be a non-integer float (RepQ-ViT keeps the mean zero point
    of the LayerNorm fold unrounded) or lie outside [qmin, qmax] (it is not clamped).

    Args:
        x: input of any shape.
        scale: step size, broadcastable to x (e.g. [1] per tensor, [C] / [C,1,...] per channel).
        zero_point: same shape as scale.
        qmin, qmax: integer code range (0, 2^b - 1 asymmetric; -2^(b-1), 2^(b-1) - 1 symmetric).
        ste: differentiable path (straight-through rounding, gradients to x, scale and zero point). torch.clamp
            passes no gradient at its bounds, so x whose code is exactly qmin or qmax gets none, as if clipped:
            QDrop's and APHQ's quantizers (round_ste, then clamp to scalar bounds) behave the same.

    Returns:
        Tensor like x, in x's dtype promoted with the scale's dtype.
    """
    if ste:
        q = torch.clamp(round_ste(x / scale) + zero_point, qmin, qmax)
        return (q - zero_point) * scale
    # Inference path, 4 elementwise kernels with in-place temporaries: clamping round(x/s) to
    # [qmin - z, qmax - z] is the same as clamping round(x/s) + z to [qmin, qmax] and subtracting z
    # (exactly for integer z; for RepQ-ViT's fractional folded z it skips one float rounding of a + z).
    # The bounds are tiny [G] tensors, so no host sync is needed for per-channel or per-tensor z.
    return torch.div(x, scale).round_().clamp_(qmin - zero_point, qmax - zero_point).mul_(scale)


def log_sqrt2_codes(x: torch.Tensor, delta: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of the log-sqrt2 quantizer (RepQ-ViT) for non-negative inputs such as post-softmax maps.

    q_raw = round(-2 log2(x / delta)); elements with q_raw >= 2^bits become exactly zero (`zero` mask),
    the rest are clamped to [0, 2^bits - 1] (so x > delta saturates at code 0, i.e. value delta).

    Args:
        x: non-negative tensor (negative entries are treated as 0).
        delta: largest representable value, broadcastable to x.
        bits: code width.

    Returns:
        (codes, zero): float codes in [0, 2^bits - 1] and a bool mask of the elements quantized to 0.
    """
    levels = 2 ** bits
    # x = 0 gives log2(0) = -inf, so q_raw = +inf and the element lands in the zero mask.
    q = torch.div(x, delta).clamp_(min=0).log2_().mul_(-2.0).round_()  # delta > 0, so clamp after the div
    zero = q >= levels
    return q.clamp_(0, levels - 1), zero


def fake_quant_log_sqrt2(x: torch.Tensor, delta: torch.Tensor, bits: int, ste: bool = False) -> torch.Tensor:
    """Log-sqrt2 fake quantization: value `delta * 2^(-q / 2)` for code q, 0 for underflowing inputs.

    Odd codes are a power of two times sqrt(2); RepQ-ViT writes the value as 2^(-ceil(q/2)) * sqrt(2)
    for odd q, which is the same number (up to float rounding in the last bit).

    Args:
        x: non-negative tensor of any shape.
        delta: largest level, broadcastable to x.
        bits: code width.
        ste: differentiable path: the rounding is straight-through in the log domain, so inside the
            representable range d out / d x = out / x (about 1, not exactly 1); 0 where x saturates
            above delta or underflows to 0, and at the first and last codes themselves (torch.clamp passes no
            gradient at its bounds, as in the official QDrop / APHQ code). delta gets 1 per element that
            saturates at delta and 0 inside the range, where the code's straight-through dependence on delta
            cancels the dequantisation's.

    Returns:
        Tensor like x.
    """
    if ste:
        levels = 2 ** bits
        ratio = x / delta
        # x <= 0 underflows, as log2(0) = -inf codes it in the inference path; its log is taken of 1 instead (a
        # finite value and gradient, masked below). Not a clamp of x to a tiny positive number: 1e-30 is 0 in
        # float16 (log2(0): NaN values and gradients), and at 8 bits it codes 0 as round(-2 log2 1e-30) = 199 < 256,
        # a nonzero level. NaN stays NaN, as in the inference path.
        q_raw = round_ste(-2.0 * torch.log2(torch.where(ratio <= 0, torch.ones_like(ratio), ratio)))
        q = torch.clamp(q_raw, 0, levels - 1)
        out = delta * torch.exp2(-0.5 * q)
        return torch.where((ratio.detach() <= 0) | (q_raw.detach() >= levels), torch.zeros_like(out), out)
    q, zero = log_sqrt2_codes(x, delta, bits)
    out = q.mul_(-0.5).exp2_().mul_(delta)
    return out.masked_fill_(zero, 0.0)
