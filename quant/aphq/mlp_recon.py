"""APHQ-ViT's MLP Reconstruction (MR): GELU -> ReLU, then per-block fine-tuning of fc1 and fc2.

Off by default, as in the Colinearity-Decay paper's APHQ column (CD paper Sec. 4.1). When on,
it runs on a float copy BEFORE quantization; the float targets of the later block reconstruction stay
those of the original GELU model.

Per block, in module order (GoatWu/APHQ-ViT `utils/mlp_recon.py`):
* every MLP activation is replaced by ReLU (all blocks at once, before the first block is tuned);
* input x: the input of the block's fc1 (after norm2, as the official `fc1.raw_input`) in the MR model whose
  earlier blocks are already tuned (sequential, like block reconstruction: later blocks absorb earlier changes;
  our choice; the official code takes it from the original model);
* target: the ORIGINAL block's GELU MLP on the same x (`block.mlp`, as officially: LayerScale, if any, and norm2
  lie outside it);
* loss: mean(H * (relu_mlp(x) - target)^2) + alpha * mean(H * (relu_mlp_clamped(x) - target)^2),
  alpha = 2, where the clamped branch clips the fc2 input to [0, c] and c is the p-th percentile of
  the positive fc2 inputs of the original model (p = 0.98, the 4-bit config; the paper says 0.99),
  measured on the calibration subset (a 1024-image ViT-B fc2 input has 620 M elements); H is the APH
  weight of the block's MLP OUTPUT (`block.mlp`, as officially: the +-eps is added to, and the gradient taken at,
  the MLP output). Without LayerScale it equals the block output's in exact arithmetic, but a LayerScale (or a
  norm after the MLP) carries the +-eps to the block output scaled per channel, so the block's weight is not it;
* Adam on fc1 and fc2 (weights and biases), lr 4e-5 with cosine decay to 0, batch 32. The official optimizer
  also lists norm2, which gets no gradient (the MLP starts at fc1's input), so norm2 is not trained.
No loss normalisation is stated for MR; we use none (Adam is invariant to a constant loss scale).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
from torch import nn
from timm.layers import Mlp

from .hessian import normalized_weight
from ..quantile import quantile
from ..units import capture_module_inputs, find_units

log = logging.getLogger("quant.mlp_recon")


@dataclass(frozen=True)
class MLPReconSettings:
    """Hyper-parameters of the MLP reconstruction (APHQOptions carries the user-facing defaults)."""
    iters: int
    batch_size: int
    lr: float
    clip_percentile: float
    clip_weight: float
    log_every: int


def _check_mlp(block: nn.Module, name: str) -> Mlp:
    mlp = getattr(block, "mlp", None)
    if type(mlp) is not Mlp or not hasattr(block, "norm2"):
        raise TypeError(f"{name}: MLP reconstruction supports timm blocks with norm2 and a plain timm Mlp")
    return mlp


def relu_mlps(model: nn.Module) -> List[str]:
    """Replace the activation of every block MLP with ReLU (in place). Returns the block names."""
    names = []
    for unit in find_units(model, kinds=("block",)):
        block = model.get_submodule(unit.name)
        _check_mlp(block, unit.name).act = nn.ReLU()
        names.append(unit.name)
    return names


def clipped_mlp(mlp: Mlp, x: torch.Tensor, clamp_max: torch.Tensor) -> torch.Tensor:
    """`mlp(x)` (x: fc1's input) with the fc2 input clipped to [0, clamp_max]."""
    h = torch.minimum(mlp.drop1(mlp.act(mlp.fc1(x))).clamp(min=0.0), clamp_max)
    return mlp.drop2(mlp.fc2(mlp.norm(h)))


def reconstruct_mlps(fp_model: nn.Module, mr_model: nn.Module, images: torch.Tensor, calib_count: int,
                     hessian: Callable[[str], torch.Tensor], settings: MLPReconSettings,
                     generator: torch.Generator) -> List[Dict[str, float]]:
    """Run MR on `mr_model` in place (a float copy of `fp_model`); `fp_model` is only read.

    Args:
        fp_model: the original float model (GELU), eval mode.
        mr_model: float copy to convert to ReLU and tune.
        images: [N, 3, H, W] reconstruction set; the first `calib_count` give the clip percentile.
        calib_count: images used for the clip percentile.
        hessian: module name -> APH weight [1, ...] of that module's output on the original model; asked for
            f"{block}.mlp" (the MLP output, as officially), not the block's.
        settings: iterations, batch, lr, clip percentile, clamp-term weight.
        generator: RNG on the model's device for batch indices.

    Returns:
        One stats dict per block: {"unit", "iters", "seconds", "loss_first", "loss_last", "clip"}.
    """
    device = next(mr_model.parameters()).device
    blocks = relu_mlps(mr_model)
    stats = []
    for name in blocks:
        start = time.perf_counter()
        block_fp, block = fp_model.get_submodule(name), mr_model.get_submodule(name)
        _check_mlp(block_fp, name)
        x = capture_module_inputs(mr_model, {"x": block.mlp.fc1}, name, images, settings.batch_size)["x"]
        with torch.no_grad():
            target = torch.cat([block_fp.mlp(c) for c in x.split(settings.batch_size)])
            h = block_fp.mlp.act(block_fp.mlp.fc1(x[:calib_count]))
            positive = h[h > 0]
            clip = quantile(positive, [settings.clip_percentile]) if positive.numel() else h.new_ones(1)
        weight = normalized_weight(hessian(f"{name}.mlp").to(device)).reshape(1, *target.shape[1:])
        params = [p for m in (block.mlp.fc1, block.mlp.fc2) for p in m.parameters()]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.Adam(params, lr=settings.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=settings.iters, eta_min=0.0)
        first = last = torch.zeros((), device=device)
        for it in range(settings.iters):
            idx = torch.randperm(x.shape[0], device=device, generator=generator)[:settings.batch_size]
            xb, tb = x[idx], target[idx]
            loss = (weight * (block.mlp(xb) - tb).pow(2)).mean() + settings.clip_weight * (
                weight * (clipped_mlp(block.mlp, xb, clip) - tb).pow(2)).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if it == 0:
                first = loss.detach()
            last = loss.detach()
            if settings.log_every and (it + 1) % settings.log_every == 0:
                log.info("MR %s iter %d/%d loss %.4g [%.1fs]", name, it + 1, settings.iters,
                         float(loss.detach()), time.perf_counter() - start)
        for p in params:
            p.requires_grad_(False)
        row = {"unit": name, "iters": settings.iters, "seconds": round(time.perf_counter() - start, 3),
               "loss_first": float(first), "loss_last": float(last), "clip": float(clip)}
        log.info("MR %s done: loss %.4g -> %.4g, clip %.3g [%.1fs]", name, row["loss_first"],
                 row["loss_last"], row["clip"], row["seconds"])
        stats.append(row)
    return stats
