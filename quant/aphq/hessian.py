"""APHQ-ViT's average perturbation Hessian (APH) of a unit's output, as the official code computes it.

As GoatWu/APHQ-ViT `utils/block_recon.py` computes it (not as the paper's Eq. words it),
on the FLOAT model only:

1. p = softmax(logits / T) of the unperturbed float model (T = 20).
2. Add +eps to EVERY element of the unit's output at once (inside the forward pass), compute
   KL(p || softmax(logits+ / T)) with batchmean reduction and take its gradient J+ w.r.t. that output.
3. The same with -eps gives J-.
4. H = |J+ - J-| (the paper divides by 2 eps; irrelevant after APHQ's loss normalisation), averaged
   over the SAMPLE dimension only: one weight per token position and channel, [1, N, C] for ViT
   ([1, H, W, C] for Swin's NHWC blocks, [1, C] for the head input ...). Every sample weighs the same,
   also where the last batch is shorter (each sample's gradient carries the 1 / batch_size of a full batch).

At the unperturbed point the KL gradient is 0, so J+ - J- ~ 2 eps * (Hessian @ z) with probe z = 1:
the code measures Hessian row sums, which the paper calls its diagonal.

Caveat found while implementing (measured, see quant/README.md): in a pre-LayerNorm Transformer every
consumer of a block output (the next norm1, the residual, the final norm) is invariant to adding the
same constant to all channels of a token, so the logits do not change under the all-ones probe and,
in exact arithmetic, J+ = J- = 0. In float64 the official H is ~1e-20, in float32 ~1e-11 whatever eps
is: rounding noise carried back through the downstream Jacobian. That noise is structured (on a
digits ViT it correlates r = 0.87-0.95 with the diagonal below), which is presumably why it still
works as a weighting. `probe="rademacher"` is the principled alternative: Hutchinson's estimator
diag(H) ~ E[z * (H z)] with a random +-1 vector z per sample, H z from the same central difference,
averaged over samples and clamped at 0 (the KL Hessian at its minimum is PSD, so its diagonal is >= 0).
"""
from __future__ import annotations

from typing import Callable, List, Literal, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..units import SampleFeed, map_tensors

Probe = Literal["ones", "rademacher"]


def perturbation_hessian(model: nn.Module, unit: str, images: torch.Tensor, fp_logits: torch.Tensor,
                         batch_size: int, temperature: float = 20.0, eps: float = 1e-6, probe: Probe = "ones",
                         generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """APH weight of unit `unit`'s output (see module docstring).

    Args:
        model: the float model (eval mode; no parameter gradient is formed either way).
        unit: FQN of the unit whose output is perturbed.
        images: [N, 3, H, W] (the reconstruction set).
        fp_logits: [N, classes] unperturbed float logits of `model` on `images` (same order).
        batch_size: images per forward/backward pass.
        temperature: KL temperature T.
        eps: size of the perturbation of every output element.
        probe: "ones" (official: +-eps on all elements, H = |J+ - J-|) or "rademacher" (Hutchinson
            diagonal: +-eps z, H = z * (J+ - J-) / (2 eps), clamped at 0 after the sample mean).
        generator: RNG for the Rademacher probes (on the model's device); None uses the global RNG.

    Returns:
        Non-negative [1, *unit_output_shape[1:]] float32 tensor on the model's device.
    """
    if probe not in ("ones", "rademacher"):
        raise ValueError(f"unknown Hessian probe {probe!r}")
    if fp_logits.shape[0] != images.shape[0]:  # zip over the batches would silently drop the rest
        raise ValueError(f"fp_logits has {fp_logits.shape[0]} rows for {images.shape[0]} images")
    device = next(model.parameters()).device
    module = model.get_submodule(unit)
    leaf: List[torch.Tensor] = []
    state: dict = {"sign": 1.0, "z": None}  # z: this batch's Rademacher probe, drawn on the first pass

    def hook(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        o = out.detach().requires_grad_(True)
        leaf.append(o)
        if probe == "ones":
            return o + state["sign"] * eps
        if state["z"] is None:
            state["z"] = (torch.randint(0, 2, o.shape, device=o.device, generator=generator).to(o.dtype)
                          * 2 - 1)
        return o + (state["sign"] * eps) * state["z"]

    handle = module.register_forward_hook(hook)
    total = None
    try:
        for chunk, logits in zip(images.split(batch_size), fp_logits.split(batch_size)):
            chunk = chunk.to(device)
            target = F.softmax(logits.to(device).float() / temperature, dim=-1)
            state["z"] = None
            grads = []
            for sign in (1.0, -1.0):
                leaf.clear()
                state["sign"] = sign
                with torch.enable_grad():
                    out = model(chunk).float()
                    loss = F.kl_div(F.log_softmax(out / temperature, dim=-1), target, reduction="batchmean")
                    grads.append(torch.autograd.grad(loss, leaf[0])[0])
            diff = grads[0] - grads[1]
            part = diff.abs() if probe == "ones" else state["z"] * diff / (2.0 * eps)
            # the batch-mean KL gives each sample's gradient a factor 1 / (its chunk's size): a last chunk shorter
            # than batch_size (recon_images no multiple of batch_size) would weigh each of its samples
            # batch_size / len(chunk) times as much as the others in the sample mean; every sample at 1 / batch_size
            # (a factor of exactly 1 on full chunks: the official code's numbers wherever the count divides)
            part = part.sum(dim=0, keepdim=True) * (chunk.shape[0] / batch_size)
            total = part if total is None else total + part
    finally:
        handle.remove()
    h = (total / images.shape[0]).float()
    return h if probe == "ones" else h.clamp_(min=0.0)


def normalized_weight(h: torch.Tensor) -> torch.Tensor:
    """An APH weight scaled to mean 1 (loss weights are relative; APHQ normalises the loss anyway)."""
    return h / h.mean().clamp(min=1e-30)


# -- detectors (GoatWu/APHQ-ViT Object-Detection/tools/quant_utils/block_recon.py) ---------------------------

RPNOutputs = Tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]  # (objectness logits, box deltas) per level


def binary_kl(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean Bernoulli KL(target || pred) of probabilities clamped to [1e-7, 1 - 1e-7] (official `binary_kl`)."""
    p = pred.clamp(1e-7, 1 - 1e-7)
    t = target.clamp(1e-7, 1 - 1e-7)
    return (t * (t.log() - p.log()) + (1 - t) * ((1 - t).log() - (1 - p).log())).mean()


def rpn_output_loss(out: RPNOutputs, ref: RPNOutputs) -> torch.Tensor:
    """The detector's APH objective: how far an RPN output moved from the float model's.

    Summed over the FPN levels: the binary KL of the objectness sigmoid from the float one, and the smooth-L1
    of the box deltas where the float objectness exceeds 0.7 (each anchor's mask repeated over its 4
    deltas); each term divided by its own detached value, so both weigh 1. A term that is exactly 0 (no
    anchor above 0.7: the official code would divide 0 by 0 and give NaN) is left out.

    Args:
        out: raw RPN outputs ([B, A, H, W] logits, [B, 4A, H, W] deltas per level) of the perturbed model.
        ref: the float model's, objectness already a probability (sigmoid).
    """
    cls = sum(binary_kl(torch.sigmoid(c), r.to(c.device)) for c, r in zip(out[0], ref[0]))
    reg = 0.0
    for c_ref, b, b_ref in zip(ref[0], out[1], ref[1]):
        c_ref, b_ref = c_ref.to(b.device), b_ref.to(b.device)  # the float references may be cached elsewhere
        mask = (c_ref > 0.7).repeat_interleave(4, dim=1).to(b.dtype)
        reg = reg + F.smooth_l1_loss(b * mask, b_ref * mask, reduction="mean")
    return sum(term / term.detach() for term in (cls, reg) if isinstance(term, torch.Tensor) and term.detach() != 0)


def detector_hessians(model: nn.Module, unit: str, feed: SampleFeed,
                      rpn_outputs: Callable[[nn.Module, int], RPNOutputs], refs: List[RPNOutputs],
                      eps: float = 1e-3) -> List[List[torch.Tensor]]:
    """Per image of `feed`, the APH weight of each output tensor of unit `unit` of the float detector `model`.

    As the official detection code: +eps on every element of the unit output, then -eps, the gradient of
    `rpn_output_loss` against the float RPN outputs `refs` w.r.t. that output, H = |J+ - J-| scaled to mean 1
    per image (`grad * numel / sum`). Kept per image, not averaged: the images differ in size.

    Args:
        model: the float detector (eval mode, parameters frozen).
        unit: FQN of a backbone unit.
        feed: the reconstruction images.
        rpn_outputs: (model, i) -> the raw RPN outputs of image i, computed with gradients.
        refs: the float model's RPN outputs per image (objectness as probabilities).
        eps: the perturbation (official 1e-3).
    """
    module = model.get_submodule(unit)
    leaves: List[torch.Tensor] = []
    state = {"sign": 1.0}

    def perturb(t: torch.Tensor) -> torch.Tensor:
        leaf = t.detach().requires_grad_(True)
        leaves.append(leaf)
        return leaf + state["sign"] * eps

    def hook(_mod: nn.Module, _args: tuple, out):
        return map_tensors(out, perturb)  # MMDetection's (x, out_size): x only

    handle = module.register_forward_hook(hook)
    weights: List[List[torch.Tensor]] = []
    try:
        for i in range(len(feed)):
            grads = []
            for sign in (1.0, -1.0):
                leaves.clear()
                state["sign"] = sign
                with torch.enable_grad():
                    loss = rpn_output_loss(rpn_outputs(model, i), refs[i])
                    grads.append(torch.autograd.grad(loss, leaves, allow_unused=True))
            per_image = []
            for g_up, g_down, leaf in zip(grads[0], grads[1], leaves):
                if g_up is None or g_down is None:
                    h = torch.ones_like(leaf)  # an output the RPN does not read: plain MSE weight
                else:
                    h = (g_up - g_down).abs().float()
                    total = h.sum()
                    h = h * h.numel() / total if total > 0 else torch.ones_like(h)
                per_image.append(h.detach())
            weights.append(per_image)
    finally:
        handle.remove()
    return weights
