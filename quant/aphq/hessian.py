"""APHQ-ViT's average perturbation Hessian (APH) of a unit's output, as the official code computes it.

As GoatWu/APHQ-ViT `utils/block_recon.py` computes it (not as the paper's Eq. words it),
on the FLOAT model only:

1. p = softmax(logits / T) of the unperturbed float model (T = 20).
2. Add +eps to EVERY element of the unit's output at once (inside the forward pass), compute
   KL(p || softmax(logits+ / T)) with batchmean reduction and take its gradient J+ w.r.t. that output.
3. The same with -eps gives J-.
4. H = |J+ - J-| (the paper divides by 2 eps; irrelevant after APHQ's loss normalisation), averaged
   over the SAMPLE dimension only: one weight per token position and channel, [1, N, C] for ViT
   ([1, H, W, C] for Swin's NHWC blocks, [1, C] for the head input ...).

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

from typing import List, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

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
            part = part.sum(dim=0, keepdim=True)
            total = part if total is None else total + part
    finally:
        handle.remove()
    h = (total / images.shape[0]).float()
    return h if probe == "ones" else h.clamp_(min=0.0)


def normalized_weight(h: torch.Tensor) -> torch.Tensor:
    """An APH weight scaled to mean 1 (loss weights are relative; APHQ normalises the loss anyway)."""
    return h / h.mean().clamp(min=1e-30)
