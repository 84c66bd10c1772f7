"""Block reconstruction of one unit with AdaRound + learned activation scales under QDrop (APHQ-ViT).

As GoatWu/APHQ-ViT `utils/block_recon.py` with `configs/4bit/best.py` does it. For one unit (patch embedding,
block, patch merging or head) of the quantized model, with cached tensors for the whole reconstruction set:

* learned: AdaRound alpha of every weight (Adam, lr 1e-3, no schedule) and the scale of every
  activation quantizer (Adam, lr 4e-5, cosine to 0 over all iterations); zero points and weight
  scales stay fixed;
* each iteration draws `batch_size` distinct random samples; the unit input is an element-wise 50/50 mix of
  the quantized-prefix input and the float input (QDrop level 1, `input_mix_prob`), and every activation
  quantizer returns its quantized value with p = 0.5 element-wise, its float input otherwise (QDrop level 2,
  `Quantizer.drop_prob`); both probabilities are of the quantized element, as the official `drop_prob` is (1: off);
* target: the float model's unit output on float inputs;
* loss (`block_loss`): mean((O^ - O)^2 * H) for ordinary units (H: APH weight [1, ...], normalised to mean 1
  here, which changes nothing below), KL(softmax(O) || softmax(O^)) for the head; then divided by its value
  at the first iteration and multiplied by 2 (APHQ commit 73e78a7, `normalize_loss=True`, the default), plus
  the AdaRound regulariser 0.01 * sum(1 - |2h - 1|^beta) after a 20% warm-up, beta 20 -> 2. Without the
  normalisation (`normalize_loss=False`) an ordinary unit's loss is the official code's before that commit:
  ((O^ - O)^2 * H).sum(1).mean() / 10 (summed over dimension 1, the tokens of a [B, N, C] output, H of mean 1
  as it normalised it then; plain MSE without H), the head's KL as above;
* afterwards: hard rounding baked into the weights, QDrop off, scales frozen, quantizers in eval mode.

Only quantizers run in train mode (for QDrop): dropout / drop path of the model stay in eval mode.
The loop has no host synchronisation except at logging steps while the caches are on the model's device (the
default); with `cache_device="cpu"` beside a GPU model each iteration copies its batch's indices to the host and
its inputs and targets to the GPU, four blocking copies that the memory saved costs.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.metrics import duration

from .adaround import AdaRoundQuantizer, RoundingSchedule
from .hessian import normalized_weight
from ..functional import qdrop_mix
from ..layers import QuantConv2d, QuantLinear
from ..modes import named_quantizers
from ..quantizers import UniformQuantizer
from ..units import UnitCall, map_tensors, output_tensors

log = logging.getLogger("quant.reconstruct")
ESTIMATE_AFTER = 10  # iterations before a unit's first time estimate


@dataclass(frozen=True)
class ReconSettings:
    """Hyper-parameters of one unit's reconstruction (APHQOptions carries the user-facing defaults)."""

    iters: int
    batch_size: int
    weight_lr: float
    act_lr: float
    drop_prob: float  # QDrop inside quantizers: probability of an element's quantized value (1: off)
    input_mix_prob: float  # QDrop at the unit input: probability of the quantized-prefix input element (1: off)
    rounding: RoundingSchedule
    normalize_loss: bool
    log_every: int


def _weight_layers(unit: nn.Module) -> List[nn.Module]:
    return [m for m in unit.modules() if isinstance(m, (QuantLinear, QuantConv2d))
            and isinstance(m.weight_quantizer, AdaRoundQuantizer) and m.weight_quantizer.enabled]


def _act_quantizers(unit: nn.Module) -> List[UniformQuantizer]:
    qs = [q for _, q in named_quantizers(unit, "activation") if q.enabled]
    bad = [q.name for q in qs if not isinstance(q, UniformQuantizer)]
    if bad:
        raise TypeError(f"scale learning needs uniform activation quantizers: {bad[:4]}")
    return qs


def reconstructs_anything(unit: nn.Module) -> bool:
    """Whether `unit`, in its current quantizer state, has anything to learn: an enabled AdaRound weight or an
    enabled activation quantizer. A float unit (`stem_w_bits=0`; `head_w_bits=0` with `head_a_bits=0`) has neither:
    its output is the float model's already."""
    return bool(_weight_layers(unit) or _act_quantizers(unit))


def skipped_stats() -> Dict[str, float]:
    """The stats of a unit with nothing to reconstruct (`reconstructs_anything`): no iteration ran."""
    return {"iters": 0, "seconds": 0.0, "rec_first": 0.0, "rec_last": 0.0, "round_last": 0.0}


def reconstruct_unit(unit: nn.Module, fp_in: torch.Tensor, q_in: torch.Tensor, target: torch.Tensor,
                     hessian: Optional[torch.Tensor], loss_kind: Literal["weighted_mse", "kl"],
                     settings: ReconSettings, generator: torch.Generator, name: str = "",
                     progress: Optional[Callable[[Dict[str, float]], None]] = None) -> Dict[str, float]:
    """Reconstruct `unit` in place (see module docstring).

    Args:
        unit: the unit of the quantized model, quantizers enabled and calibrated; its float parameters
            should not require grad (only alpha and activation scales are trained).
        fp_in: [N, ...] float-model inputs of the unit (cache; any device).
        q_in: [N, ...] inputs produced by the quantized prefix (already reconstructed units).
        target: [N, ...] float-model outputs of the unit (logits for the head).
        hessian: [1, ...] APH weight broadcastable to an output batch, or None for plain MSE.
        loss_kind: "weighted_mse" (blocks) or "kl" (head).
        settings: iterations, batch, learning rates, QDrop, rounding schedule.
        generator: RNG for the batch indices, on the model's device (the cache may live elsewhere).
        name: unit FQN for logs.
        progress: optional callback receiving the logged metrics (tests, custom loggers).

    Returns:
        {"iters", "seconds", "rec_first", "rec_last", "round_last"} (floats; rec_* before normalisation).
    """
    device = next(unit.parameters()).device
    weight = None if hessian is None else normalized_weight(hessian).to(device)
    n = fp_in.shape[0]

    def reconstruction_error(_it: int) -> torch.Tensor:
        # a batch of distinct samples, as the official code's randperm(n)[:batch_size], drawn on the generator's
        # device (the model's) whatever the cache's: where the cache lives must not change which samples train
        idx = torch.randperm(n, device=generator.device, generator=generator)[:settings.batch_size].to(fp_in.device)
        x_fp, x_q = fp_in[idx].to(device), q_in[idx].to(device)
        x = qdrop_mix(x_fp, x_q, settings.input_mix_prob)
        out = unit(x)
        tgt = target[idx].to(device)
        if loss_kind == "kl":
            return F.kl_div(F.log_softmax(out, dim=-1), F.softmax(tgt, dim=-1), reduction="batchmean")
        return block_loss(out, tgt, weight, settings.normalize_loss)

    return optimize_unit(unit, reconstruction_error, settings, name, progress)


def block_loss(out: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor], normalize: bool
               ) -> torch.Tensor:
    """The reconstruction error of an ordinary unit's output `out` [B, ...] against `target`, weighted by the APH
    `weight` (mean 1, broadcastable; None: plain MSE). `normalize` (ReconSettings.normalize_loss): the mean over
    every element, which optimize_unit divides by its first value (official since commit 73e78a7, whose
    normalisation makes the loss's scale irrelevant). Without it: the official loss before that commit, which
    nothing rescales, so its scale is the recipe: GoatWu/APHQ-ViT `LossFunction`, ((pred - tgt).pow(2) *
    grad).sum(1).mean() / 10 for the Hessian metrics, lp_loss(p=2) = (pred - tgt).pow(2).sum(1).mean() / 10 for
    plain MSE."""
    err = (out - target).pow(2)
    if weight is not None:
        err = err * weight
    return err.mean() if normalize else err.sum(1).mean() / 10


def reconstruct_unit_calls(unit: nn.Module, fp_calls: List[UnitCall], q_calls: List[UnitCall],
                           hessians: Optional[List[List[torch.Tensor]]], settings: ReconSettings, name: str = "",
                           progress: Optional[Callable[[Dict[str, float]], None]] = None) -> Dict[str, float]:
    """Reconstruct a unit of a detector in place from per-image captures (GoatWu/APHQ-ViT
    `Object-Detection/tools/quant_utils/block_recon.py`): one image per iteration, taken in order and
    cycling (`idx = it % n`); the first argument (a tensor, or FPN's tuple of levels) mixed element-wise from
    the quantized-prefix and float inputs, the other arguments (Swin's `hw_shape`) as captured; loss
    sum((O^ - O)^2 * H_i) with the image's own APH weight H_i (backbone units), else the MSE over all output
    tensors (FPN), then normalised and regularised as `reconstruct_unit` (`normalize_loss=False`: these raw sums and
    means, the official detection code's rec_loss before its normalisation; it has no /10 form).

    Args:
        unit: the unit of the quantized model (quantizers enabled and calibrated).
        fp_calls: `capture_unit_calls(float model, outputs=True)`: float inputs and targets per image.
        q_calls: `capture_unit_calls(quantized model)`: inputs from the quantized prefix per image.
        hessians: per image, the APH weight of each output tensor (mean 1), or None (plain MSE).
        settings: as `reconstruct_unit` (`batch_size` must be 1: the images differ in size).
    """
    if settings.batch_size != 1:
        raise ValueError(f"batch_size={settings.batch_size}: a detector's images differ in size, so its "
                         "reconstruction takes one image per iteration (batch_size=1, as officially)")
    device = next(unit.parameters()).device
    n = len(fp_calls)
    to_device = functools.partial(map_tensors, fn=lambda t: t.to(device))

    def reconstruction_error(it: int) -> torch.Tensor:
        i = it % n
        fp_args, q_args = to_device(fp_calls[i].args), to_device(q_calls[i].args)
        first = fp_args[0]
        if settings.input_mix_prob < 1:
            if isinstance(first, torch.Tensor):
                first = qdrop_mix(first, q_args[0], settings.input_mix_prob)
            else:
                first = type(first)(qdrop_mix(f, q, settings.input_mix_prob) for f, q in zip(first, q_args[0]))
        else:
            first = q_args[0]
        outs = output_tensors(unit(first, *fp_args[1:]))
        targets = [t.to(device) for t in fp_calls[i].outputs]
        if hessians is not None:
            return sum(((o - t).pow(2) * h.to(device)).sum() for o, t, h in zip(outs, targets, hessians[i]))
        return (torch.cat([o.reshape(-1) for o in outs]) - torch.cat([t.reshape(-1) for t in targets])).pow(2).mean()

    return optimize_unit(unit, reconstruction_error, settings, name, progress)


def optimize_unit(unit: nn.Module, reconstruction_error: Callable[[int], torch.Tensor], settings: ReconSettings,
                  name: str = "", progress: Optional[Callable[[Dict[str, float]], None]] = None
                  ) -> Dict[str, float]:
    """The optimisation every reconstruction shares: AdaRound alphas and activation scales of `unit` trained on
    `reconstruction_error(iteration)` (normalised to 2 at the first iteration) plus the rounding regulariser,
    under QDrop; then hard rounding baked in and the quantizers frozen (module docstring). A unit with nothing to
    learn (not `reconstructs_anything`) and no parameter that requires grad is skipped: 0 iterations,
    `reconstruction_error` never called."""
    device = next(unit.parameters()).device
    layers = _weight_layers(unit)
    acts = _act_quantizers(unit)
    if not layers and not acts and not any(p.requires_grad for p in unit.parameters()):
        # a float unit of a frozen model: its loss has no gradient, and nothing would change
        log.info("%s: skipped: no quantized weight or activation to reconstruct (a float unit)", name)
        return skipped_stats()
    alphas = [layer.weight_quantizer.start_rounding(layer.weight) for layer in layers]
    for q in acts:
        if not isinstance(q.scale, nn.Parameter):
            q.make_learnable(scale=True)
        q.scale.requires_grad_(True)
        q.drop_prob = settings.drop_prob
    unit.eval()
    for q in acts:
        q.train()  # QDrop acts in training mode only; the rest of the unit stays in eval mode

    optimizers = []
    scheduler = None
    if alphas:
        optimizers.append(torch.optim.Adam(alphas, lr=settings.weight_lr))
    if acts:
        opt = torch.optim.Adam([q.scale for q in acts], lr=settings.act_lr)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=settings.iters, eta_min=0.0)
        optimizers.append(opt)

    start = time.perf_counter()
    norm = None
    rec_first = None
    rec = round_loss = torch.zeros((), device=device)
    for it in range(settings.iters):
        rec = reconstruction_error(it)
        if it == 0:
            rec_first = rec.detach()
            norm = (rec_first / 2.0).clamp(min=1e-30) if settings.normalize_loss else None
        loss = rec / norm if norm is not None else rec
        beta = settings.rounding.beta(it)
        if beta is not None and layers:
            round_loss = settings.rounding.weight * sum(l.weight_quantizer.regularizer(beta) for l in layers)
            loss = loss + round_loss
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in optimizers:
            opt.step()
        if scheduler is not None:
            scheduler.step()
        if it + 1 == ESTIMATE_AFTER < settings.iters:  # the first word on a unit's time, long before log_every
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # once per unit: the time of finished work, not of launches
            spent = time.perf_counter() - start
            log.info("%s: %d iterations in %.1fs; about %s for its %d iterations at this speed", name,
                     it + 1, spent, duration(spent / (it + 1) * settings.iters), settings.iters)
        if settings.log_every and ((it + 1) % settings.log_every == 0 or it + 1 == settings.iters):
            metrics = {"iter": it + 1, "rec": float(rec.detach()), "loss": float(loss.detach()),
                       "round": float(round_loss.detach()),
                       "beta": beta if beta is not None else 0.0, "seconds": time.perf_counter() - start}
            log.info("%s iter %d/%d  rec %.4g  loss %.4g  round %.4g  beta %.2f  [%.1fs]", name, it + 1,
                     settings.iters, metrics["rec"], metrics["loss"], metrics["round"], metrics["beta"],
                     metrics["seconds"])
            if progress is not None:
                progress(metrics)

    for layer in layers:
        layer.weight_quantizer.bake(layer)
        layer.weight_quantizer.search_label = "output-MSE search, AdaRound"
    for q in acts:
        q.search_label = "output-MSE search, learned scale"
        q.scale.requires_grad_(False)
        q.drop_prob = 1.0  # QDrop off
        q.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"iters": settings.iters, "seconds": round(time.perf_counter() - start, 3),
            "rec_first": float(rec_first) if rec_first is not None else 0.0, "rec_last": float(rec.detach()),
            "round_last": float(round_loss.detach())}
