"""Calibration: RepQ-ViT's sequential procedure on a converted model.

One forward pass over the whole calibration set with every quantizer switched on. Each quantizer
fits itself the first time it sees data, so it is calibrated on the inputs produced by the
already-quantized upstream network; afterwards all quantizers are frozen.

The calibration images (32 fixed, seeded train images with the eval transform in the paper's
setting; chosen by the entry point, quant/ never loads data) are concatenated into ONE batch: every
quantile is then exact over the pooled set, as in RepQ-ViT. Memory grows linearly with the set size.
"""
from __future__ import annotations

import time
from typing import Dict, Iterable, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .modes import set_calibration, uncalibrated
from .units import device_of

Images = Union[torch.Tensor, Iterable[Union[torch.Tensor, Sequence[torch.Tensor]]]]


def stack_images(images: Images) -> torch.Tensor:
    """One [N, C, H, W] tensor from a tensor or an iterable of tensors / (images, labels) batches."""
    if isinstance(images, torch.Tensor):
        return images
    batches = [b[0] if isinstance(b, (tuple, list)) else b for b in images]
    if not batches:
        raise ValueError("no calibration images")
    return torch.cat(batches, dim=0)


@torch.no_grad()
def calibrate(model: nn.Module, images: Images, device: Optional[torch.device] = None) -> Dict[str, float]:
    """Fit every uncalibrated quantizer of `model` with one sequential forward pass, then freeze them.

    Already-calibrated quantizers are kept (they just quantize), which is how RepQ-ViT's second pass
    only re-fits the quantizers that were reset.

    Args:
        model: a converted model (see `quantize_model`); run in eval mode, its mode is restored.
        images: [N, C, H, W] tensor, or an iterable of such batches (or of (images, labels) pairs).
        device: where to run; default: the model's device.

    Returns:
        {"images": N, "seconds": wall time, "quantizers": number fitted in this call}.

    Raises:
        RuntimeError: some enabled quantizer saw no data (its layer is not on the forward path).
    """
    x = stack_images(images).to(device or device_of(model))
    todo = len(uncalibrated(model))
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    set_calibration(model, True)
    try:
        model(x)
    finally:
        set_calibration(model, False)
        model.train(was_training)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    left = uncalibrated(model)
    if left:
        raise RuntimeError(f"{len(left)} quantizers saw no calibration data: {left[:6]}")
    return {"images": int(x.shape[0]), "seconds": time.perf_counter() - start, "quantizers": todo}


@torch.no_grad()
def refit_weight_quantizers(layers: Iterable[Tuple[str, nn.Module]]) -> int:
    """Re-fit the weight quantizers of the given QuantLinear/QuantConv2d layers on their current weights.

    Equivalent to RepQ-ViT's second calibration forward after the LayerNorm fold (a weight quantizer's
    fit depends on the weight only), without running the network again.

    Returns:
        The number of quantizers re-fitted.
    """
    n = 0
    for _, layer in layers:
        q = layer.weight_quantizer
        if q is None:
            continue
        q.reset()
        q.calibrating = True
        try:
            q(layer.weight)
        finally:
            q.calibrating = False
        layer.invalidate_weight_cache()
        n += 1
    return n
