"""GPTQ on one Linear: the Hessian of its calibration inputs and the blocked, lazy-batch column update.

A transcription of IST-DASLab/gptq `gptq.py` (`GPTQ.add_batch`, `GPTQ.fasterquant`) onto `GPTQQuantizer`,
step for step and in the same floating-point order, so that the same inputs give the same weights:

    H = 2/n sum_x x x^T over the n calibration sequences' tokens (a running mean, as `add_batch`)
    dead columns (H_jj = 0): H_jj = 1, W[:, j] = 0
    act_order: columns in order of decreasing H_jj
    H += percdamp * mean(diag H) * I;  U = cholesky(H^-1) (upper)
    for each block of `blocksize` columns, for each column j in it:
        q_j = quant(w_j);  e_j = (w_j - q_j) / U_jj;  W[:, j:block end] -= e_j U[j, j:block end]
    then W[:, block end:] -= E_block U[block, block end:]        (the lazy batch update)

Groups (`group_size`): a group's range is taken when its first column comes up, from the columns as they
stood at the start of the current block (officially from `W`, which the lazy update refreshes only at block
boundaries; with groups aligned to the blocks, as the usual 128 / 128, that is their current value);
`static_groups` takes every group's range from the weights before any update, in the original column order.

A Conv2d, as officially: its weight is the matrix [C_out, C_in * kh * kw] (`weight.flatten(1)`), whose columns are
those of its input unfolded into patches (`add_batch`'s nn.Unfold(kernel, dilation, padding, stride): each output
position's patch is one input row, `conv_rows`); the result is reshaped back to the kernel. The padding is applied
as the layer's own forward applies it (its padding_mode: zeros as officially, reflect / replicate / circular as
the layer reads them). A grouped convolution (groups > 1) is refused: its output channels read disjoint input
channels, which one Hessian of the whole unfolded input does not describe (officially a shape error).
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..functional import fake_quant_uniform
from .quantizer import GPTQQuantizer


def conv_rows(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The inputs [B, C_in, H, W] of `conv` as the rows GPTQ's Hessian sums: [B, L, C_in * kh * kw], one row per
    output position (L of them) in weight.flatten(1)'s column order (channel, then kernel row, then column)."""
    if conv.groups != 1:
        raise ValueError(f"a Conv2d with groups={conv.groups}: GPTQ's Hessian is one of the whole unfolded input, "
                         "which a grouped convolution's output channels do not each read")
    if x.dim() == 3:  # an unbatched input, as Conv2d accepts it
        x = x.unsqueeze(0)
    # the padding as conv._conv_forward applies it (F.pad with its padding_mode; the zeros of nn.Unfold's padding)
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    return F.unfold(x, conv.kernel_size, dilation=conv.dilation, stride=conv.stride).transpose(1, 2)


class HessianAccumulator:
    """H = 2/n sum x x^T of one Linear's inputs, n counting sequences (GPTQ's `add_batch`, in float32).

    `rows` counts the input vectors x summed (tokens: a sequence's positions, a ViT's patches and class token),
    what decides whether H can have full rank."""

    def __init__(self, columns: int, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.hessian = torch.zeros(columns, columns, device=device, dtype=dtype)
        self.samples = 0
        self.rows = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        """Add a batch of inputs [B, T, C] (B sequences) or [T, C] (one)."""
        if x.dim() == 2:
            x = x.unsqueeze(0)
        count = x.shape[0]
        x = x.reshape(-1, x.shape[-1]).t()
        self.rows += x.shape[1]
        self.hessian *= self.samples / (self.samples + count)
        self.samples += count
        x = math.sqrt(2 / self.samples) * x.to(self.hessian.dtype)
        self.hessian += x.matmul(x.t())


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, quantizer: GPTQQuantizer, *, blocksize: int = 128,
                  percdamp: float = 0.01, act_order: bool = False,
                  static_groups: bool = False) -> Tuple[torch.Tensor, float]:
    """GPTQ of one weight matrix (see the module docstring); sets `quantizer`'s ranges and group index.

    Args:
        weight: [C_out, C_in], in the precision to work in (float32 as officially; float64 in tests).
        hessian: [C_in, C_in] from `HessianAccumulator` (not modified).
        quantizer: its bits, symmetric flag and group_size define the grid; it receives the ranges used.
        blocksize, percdamp, act_order, static_groups: GPTQ's options.

    Returns:
        (the quantized weight, on the grid, in weight's dtype; GPTQ's error sum (w - q)^2 / (2 U_jj^2)).

    Raises:
        ValueError: the Hessian is not finite; torch.linalg.LinAlgError: the dampened Hessian is not positive definite.
    """
    if not bool(torch.isfinite(hessian).all()):
        # checked before the dampening: cholesky would fail on it and the failure read as a too small percdamp
        raise ValueError("its Hessian holds NaN or inf: the layer's calibration inputs are not finite (NaN/inf in the "
                         "calibration inputs or the model's weights) or their products overflow float32; no "
                         "percdamp makes it invertible: give finite calibration inputs")
    W = weight.clone()
    columns = W.shape[1]
    size = quantizer.group_size
    scale, zero = quantizer.range_params(W)
    H = hessian.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    groups = []
    if size and static_groups:
        groups = [quantizer.range_params(W[:, i:i + size]) for i in range(0, columns, size)]
    perm = torch.arange(columns, device=W.device)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    damp = percdamp * torch.mean(torch.diag(H))
    diag = torch.arange(columns, device=W.device)
    H[diag, diag] += damp
    H = torch.linalg.cholesky(H)
    H = torch.cholesky_inverse(H)
    Hinv = torch.linalg.cholesky(H, upper=True)

    Q = torch.zeros_like(W)
    losses = torch.zeros_like(W)
    # static groups: each column's original position, read once (int(perm[j]) per column waited for the device)
    order = perm.tolist() if size and static_groups else None
    found = []  # (scale, zero) of each group in the order its first column came up
    for i1 in range(0, columns, blocksize):
        i2 = min(i1 + blocksize, columns)
        W1 = W[:, i1:i2].clone()
        Q1, Err1, Losses1 = torch.zeros_like(W1), torch.zeros_like(W1), torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w, d = W1[:, i], Hinv1[i, i]
            if size and not static_groups and (i1 + i) % size == 0:
                scale, zero = quantizer.range_params(W[:, (i1 + i):(i1 + i + size)])
                found.append((scale, zero))
            elif size and static_groups:
                scale, zero = groups[order[i1 + i] // size]
            q = fake_quant_uniform(w.unsqueeze(1), scale.unsqueeze(1), zero.unsqueeze(1), quantizer.qmin,
                                   quantizer.qmax).flatten()
            Q1[:, i] = q
            Losses1[:, i] = (w - q) ** 2 / d ** 2
            err1 = (w - q) / d
            W1[:, i:] -= err1.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err1
        Q[:, i1:i2] = Q1
        losses[:, i1:i2] = Losses1 / 2
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])

    invperm = torch.argsort(perm)
    Q = Q[:, invperm]
    if not size:
        found, group_index = [(scale, zero)], torch.zeros(columns, dtype=torch.long, device=W.device)
    elif static_groups:
        found, group_index = groups, torch.arange(columns, device=W.device) // size
    else:  # the k-th group holds the columns at positions k*size .. in (activation) order
        group_index = (torch.arange(columns, device=W.device) // size)[invperm]
    quantizer.set_group_params(torch.stack([s for s, _ in found], 1), torch.stack([z for _, z in found], 1),
                               group_index)
    return Q, float(losses.sum())
