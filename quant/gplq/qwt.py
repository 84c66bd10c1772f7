"""QwT (Quantization without Tears) per-block linear compensation, as GPLQ's stage 2 uses it.

As wujx2001/QwT `QwT-cls-RepQ-ViT` fits it. Blocks are processed in order. For block b:

    X    = input of b produced by the already quantized AND compensated prefix (tokens as rows)
    D    = Y_ref(X) - Y_Q(X)                 (reference block minus quantized block, same input)
    W, c = argmin ||[X 1] [W; c] - D||^2 (+ ridge * ||W||^2; the bias is not penalised)

and the block becomes block_q(x) + x W + c (`add_compensation`: a float Linear child and a forward
hook; in eval mode x W runs in FP16, as QwT's CompensationBlock runs it in eval, which here includes the
compensated prefix of the later blocks' fits, where QwT's new blocks are still in training mode, FP32). The fit
uses the normal equations accumulated in float64 over the fitting images and solved with
`lstsq` (rank deficiency safe); QwT's script uses a plain inverse with a bias column, the paper writes ridge.
R^2 = 1 - sum_c SSE_c / sum_c SST_c, pooled over output channels as QwT's `lienar_regression` computes
it (each channel centred on its own mean). The
compensation is kept only if R^2 > 0 and its total squared error on the fitting data is below the
uncompensated one (guaranteed in exact arithmetic, since W = 0, c = 0 is a candidate; checked anyway).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
from torch import nn

from ..units import SampleFeed, for_each_call


COMPENSATION = "qwt_compensation"  # child name of the compensation Linear inside a compensated block


def _add_compensation(block: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
    x = args[0] if args else kwargs["x"]
    linear = getattr(block, COMPENSATION)
    if block.training:
        return output + linear(x)
    # in eval the product runs in FP16 and the bias is added in FP32, as QwT's CompensationBlock.forward:
    # `out + (x.half() @ lora_weight.half()).float() + self.lora_bias` (its lora_weight is our weight^T)
    compensation = (x.half() @ linear.weight.t().half()).float() + linear.bias
    return output + compensation.to(output.dtype)


def add_compensation(block: nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    """Make `block(x)` return block(x) + x W^T + b, in place; in eval mode x W^T in FP16, as QwT runs it.

    The compensation is a float `nn.Linear` child named `qwt_compensation` plus a forward hook, so
    every existing FQN of the model (e.g. `blocks.3.mlp.fc1`) keeps its name and the state dict only
    gains `<block>.qwt_compensation.{weight,bias}`.
    """
    if hasattr(block, COMPENSATION):
        raise ValueError("the block already has a QwT compensation")
    linear = nn.Linear(weight.shape[1], weight.shape[0], device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    linear.requires_grad_(False)
    block.add_module(COMPENSATION, linear)
    block.register_forward_hook(_add_compensation, with_kwargs=True)
    return linear


def is_compensated(block: nn.Module) -> bool:
    return isinstance(getattr(block, COMPENSATION, None), nn.Linear)


@dataclass
class CompensationFit:
    """Solution [C_out, C_in] + [C_out] and its quality on the fitting data."""

    weight: torch.Tensor
    bias: torch.Tensor
    r2: float
    sse_before: float
    sse_after: float

    @property
    def keep(self) -> bool:
        return self.r2 > 0.0 and self.sse_after < self.sse_before


class _NormalEquations:
    """Running [X 1]^T [X 1], [X 1]^T D, per-channel sums of D and D^2 (float64)."""

    def __init__(self, c_in: int, c_out: int, device: torch.device) -> None:
        kw = dict(dtype=torch.float64, device=device)
        self.ata = torch.zeros(c_in + 1, c_in + 1, **kw)
        self.atd = torch.zeros(c_in + 1, c_out, **kw)
        self.d_sum = torch.zeros(c_out, **kw)
        self.d_sq = torch.zeros(c_out, **kw)
        self.n = 0

    def add(self, x: torch.Tensor, d: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        d = d.reshape(-1, d.shape[-1]).double()
        a = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)
        self.ata += a.t() @ a
        self.atd += a.t() @ d
        self.d_sum += d.sum(0)
        self.d_sq += d.pow(2).sum(0)
        self.n += x.shape[0]

    def solve(self, ridge: float) -> CompensationFit:
        reg = torch.full((self.ata.shape[0],), ridge, dtype=torch.float64, device=self.ata.device)
        reg[-1] = 0.0  # no penalty on the bias
        # small matrices: solve on the CPU, where lstsq handles rank-deficient systems (gelsd)
        sol = torch.linalg.lstsq((self.ata + torch.diag(reg)).cpu(), self.atd.cpu(), driver="gelsd").solution
        sol = sol.to(self.ata.device)
        # per-channel SSE after the fit from the accumulated moments: d^2 - 2 s^T A^T d + s^T A^T A s
        sse_after_c = self.d_sq - 2.0 * (sol * self.atd).sum(0) + (sol * (self.ata @ sol)).sum(0)
        sst_c = self.d_sq - self.d_sum.pow(2) / max(self.n, 1)
        sst = float(sst_c.sum())
        r2 = 1.0 - float(sse_after_c.sum()) / sst if sst > 0 else 0.0
        return CompensationFit(weight=sol[:-1].t().float().contiguous(), bias=sol[-1].float().contiguous(),
                               r2=r2, sse_before=float(self.d_sq.sum()),
                               sse_after=float(sse_after_c.sum().clamp(min=0.0)))


@torch.no_grad()
def fit_block_compensation(x: torch.Tensor, quantized: Callable[[torch.Tensor], torch.Tensor],
                           reference: Callable[[torch.Tensor], torch.Tensor], batch_size: int,
                           ridge: float = 0.0) -> CompensationFit:
    """Least-squares compensation of one block (see module docstring).

    Args:
        x: [N, ..., C_in] block inputs from the quantized, compensated prefix.
        quantized: x -> quantized block output [N, ..., C_out].
        reference: x -> reference block output (same shape).
        batch_size: samples per block evaluation.
        ridge: L2 penalty on W (0: plain least squares).

    Returns:
        CompensationFit (weight, bias, R^2, SSE before / after on the fitting data).
    """
    stats: Optional[_NormalEquations] = None
    for chunk in x.split(batch_size):
        d = reference(chunk) - quantized(chunk)
        if stats is None:
            stats = _NormalEquations(chunk.shape[-1], d.shape[-1], chunk.device)
        stats.add(chunk, d)
    if stats is None:
        raise ValueError("no samples to fit the compensation on")
    return stats.solve(ridge)


@torch.no_grad()
def fit_block_compensation_streamed(model: nn.Module, unit: str, feed: SampleFeed,
                                    reference: Callable[..., torch.Tensor], ridge: float = 0.0) -> CompensationFit:
    """`fit_block_compensation` for a model run through a `SampleFeed` (a detector: images of different sizes,
    Swin blocks called as block(x, hw_shape)): for each batch, X = the input of block `unit` from the quantized,
    compensated prefix and D = reference(*args) - the block's own output, accumulated without storing them.

    Args:
        model: the quantized model (its prefix already compensated).
        unit: FQN of the block.
        feed: the fitting images.
        reference: (*block args) -> reference output (same shape as the block's).
        ridge: L2 penalty on W.
    """
    found: Dict[str, _NormalEquations] = {}

    def accumulate(args: tuple, out: torch.Tensor) -> None:
        d = reference(*args) - out
        if "stats" not in found:
            found["stats"] = _NormalEquations(args[0].shape[-1], d.shape[-1], d.device)
        found["stats"].add(args[0], d)

    for_each_call(model, unit, feed, accumulate)
    if "stats" not in found:
        raise ValueError("no samples to fit the compensation on")
    return found["stats"].solve(ridge)


def fit_report(fit: CompensationFit) -> Dict[str, float]:
    """JSON-able summary of a fit (for pipeline reports)."""
    return {"r2": round(fit.r2, 6), "sse_before": fit.sse_before, "sse_after": fit.sse_after,
            "kept": fit.keep}
