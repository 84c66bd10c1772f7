"""Calibration of a converted model: RepQ-ViT's sequential procedure, and static ranges of the float model.

`calibrate`: one forward pass over the whole calibration set with every quantizer switched on. Each
quantizer fits itself the first time it sees data, so it is calibrated on the inputs produced by the
already-quantized upstream network; afterwards all quantizers are frozen. The calibration inputs (32
fixed, seeded train images with the eval transform in the paper's setting, or token windows [N, T] for a
language model; chosen by the entry point, quant/ never loads data) are concatenated into ONE batch:
every quantile is then exact over the pooled set, as in RepQ-ViT. Memory grows linearly with the set size.

`calibrate_from_float`: min / max ranges of the values every activation quantizer sees in the FLOAT model
(all quantizers bypassed), streamed over batches: SmoothQuant's static scales, which its code takes from
the smoothed float model (`get_static_decoder_layer_scales`).
"""
from __future__ import annotations

import time
from typing import Dict, Iterable, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

import torch
from torch import nn

from .modes import named_quantizers, quant_state, set_calibration, uncalibrated
from .quantizers import UniformQuantizer
from .ranges import to_rows
from .units import device_of, stream_module_inputs



@runtime_checkable
class ModelFeed(Protocol):
    """Calibration inputs that run a model themselves, for models that are not called on one tensor (an
    MMDetection detector: `engine/detection/feeds.py`'s `DetectorFeed` runs its test step on one collated batch of
    images with their metadata). `feed(model)` runs ONE forward of `model` on the whole calibration set, so
    that each quantizer fits on all of it at once, and returns how many inputs that was."""

    def feed(self, model: nn.Module) -> int: ...


Images = Union[torch.Tensor, ModelFeed, Iterable[Union[torch.Tensor, Sequence[torch.Tensor]]]]


def stack_images(images: Images) -> torch.Tensor:
    """One [N, ...] tensor (images [N, C, H, W], token ids [N, T]) from a tensor or an iterable of tensors /
    (inputs, labels) batches.

    Raises:
        ValueError: no input (N = 0; the quantizers' fits would fail on the empty set).
    """
    if isinstance(images, torch.Tensor):
        x = images
    else:
        batches = [b[0] if isinstance(b, (tuple, list)) else b for b in images]
        if not batches:
            raise ValueError("no calibration inputs")
        x = torch.cat(batches, dim=0)
    if x.dim() == 0 or x.shape[0] == 0:
        raise ValueError(f"no calibration inputs: got a tensor of shape {tuple(x.shape)}; give [N, ...] inputs "
                         "with N >= 1")
    return x


@torch.no_grad()
def calibrate(model: nn.Module, images: Images, device: Optional[Union[str, torch.device]] = None
              ) -> Dict[str, float]:
    """Fit every uncalibrated quantizer of `model` with one sequential forward pass, then freeze them.

    Already-calibrated quantizers are kept (they just quantize), which is how RepQ-ViT's second pass
    only re-fits the quantizers that were reset.

    Args:
        model: a converted model (see `quantize_model`); run in eval mode, its mode is restored.
        images: model inputs [N, ...] (images [N, C, H, W], token ids [N, T]), or an iterable of such batches
            (or of (inputs, labels) pairs), or a `ModelFeed` (which runs the forward itself).
        device: where to run, which must be the model's device (checked; calibration moves the inputs there,
            never the model); default: the model's device.

    Returns:
        {"images": N (inputs: images or token windows), "seconds": wall time, "quantizers": number fitted}.

    Raises:
        RuntimeError: some enabled quantizer saw no data (its layer is not on the forward path).
        ValueError: `device` is not the model's device.
    """
    here = device_of(model)
    device = here if device is None else torch.device(device)
    if device.type != here.type or device.index not in (None, here.index):
        raise ValueError(f"calibrate: device={device} but the model is on {here}; calibration moves the inputs "
                         f"only: move the model first (model.to({str(device)!r})) or leave device unset")
    device = here
    x = None if isinstance(images, ModelFeed) else stack_images(images).to(device)
    fitting = set(uncalibrated(model))
    todo = len(fitting)
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    set_calibration(model, True)
    try:
        if x is None:
            n = images.feed(model)
        else:
            model(x)
            n = int(x.shape[0])
    finally:
        set_calibration(model, False)
        model.train(was_training)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    left = uncalibrated(model)
    if left:
        raise RuntimeError(f"{len(left)} quantizers saw no calibration data: {left[:6]}")
    # a NaN / inf input or weight fits a NaN range, and the quantized model then computes NaN everywhere
    bad = [name for name, q in named_quantizers(model) if name in fitting and not all(
        bool(torch.isfinite(t).all()) for t in (*q.parameters(), *q.buffers()) if t.is_floating_point())]
    if bad:
        raise RuntimeError(f"{len(bad)} quantizers fitted non-finite parameters (NaN/inf in the calibration inputs "
                           f"or the model's weights): {bad[:6]}")
    return {"images": n, "seconds": time.perf_counter() - start, "quantizers": todo}


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


@torch.no_grad()
def calibrate_from_float(model: nn.Module, inputs: Images, batch_size: int) -> Dict[str, float]:
    """Fit every uncalibrated activation quantizer on the values it sees in the float model, then freeze it.

    The pass runs with every quantizer bypassed (weights and activations float) and keeps, per quantizer
    group, the running min and max over the batches; each quantizer then takes the range
    [min, max] (symmetric kinds: max |x|). This is SmoothQuant's static calibration (their scales come from
    hooks on the float, smoothed model, max-abs over all calibration samples), not RepQ-ViT's sequential
    one (`calibrate`).

    Args:
        model: a converted model whose uncalibrated activation quantizers are UniformQuantizers with the
            "minmax" range rule (anything else raises).
        inputs: model inputs (see `calibrate`), run `batch_size` at a time.

    Returns:
        {"images": N, "seconds": wall time, "quantizers": number fitted}.
    """
    todo = {name: q for name, q in named_quantizers(model, "activation") if q.enabled and not q.calibrated}
    wrong = [n for n, q in todo.items() if type(q) is not UniformQuantizer or q.search.method != "minmax"]
    if wrong:
        raise ValueError(f"float-model calibration fits min/max UniformQuantizers only, not: {wrong[:6]}")
    lo: Dict[str, torch.Tensor] = {}
    hi: Dict[str, torch.Tensor] = {}

    def observe(key: str, x: torch.Tensor) -> None:
        rows = to_rows(x, todo[key].channel_dim)
        low, high = rows.amin(dim=1), rows.amax(dim=1)
        lo[key] = low if key not in lo else torch.minimum(lo[key], low)
        hi[key] = high if key not in hi else torch.maximum(hi[key], high)

    x = stack_images(inputs)
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        with quant_state(model, weights=False, activations=False):
            stream_module_inputs(model, todo, None, x, batch_size, observe)
    finally:
        model.train(was_training)
    for key, q in todo.items():
        q.set_params(*q.params_from_range(lo[key], hi[key]))
        q.search_label = f"static, {'max-abs' if q.symmetric else 'min/max'} of the float model"
    return {"images": int(x.shape[0]), "seconds": time.perf_counter() - start, "quantizers": len(todo)}
