"""Uniform noise injection in the weights: UNIQ (Baskin et al., "UNIQ: Uniform Noise Injection for Non-Uniform
Quantization of Neural Networks", ACM TOCS 37(1-4), 2021; arXiv 1804.10969), the "Noise" baseline of the
paper's detection study (Sec. "COCO Detection": "uniform-noise injection in weights", on the backbone only).

UNIQ trains for a k-quantile quantizer (k = 2^bits levels: the bins hold equal probability mass of the
weights' distribution, each bin is represented by its median). Uniformized by the weights' CDF F, that
quantizer is a uniform quantizer with step 1/k, whose error UNIQ replaces in training by additive uniform
noise; in every training forward each selected layer uses, instead of each of its parameters p (weight and bias),

    u  = F(p)                                   uniformize: F Gaussian, fitted to that parameter tensor
    e  ~ U[-1/(2k), 1/(2k)]                     i.i.d. per element, fresh per (seed, step, layer)
    p~ = F^-1( clamp(u + e, 1e-5, 1 - 1e-5) )

with F(p) = Phi((p - mu) / sigma), mu and sigma the mean and unbiased standard deviation (at least 1e-5) of the
tensor at that forward. As UNIQ's reference code does it (its `quantize.add_noise`, read in the copy vendored by
yochaiz/darts-UNIQ, `UNIQ/quantize.py`: the parameters' data are swapped for the noisy values around the
forward), the gradient taken at p~ is applied to the clean p unchanged (straight through). Choices of ours:
  - the math runs in fp32 (float64 for float64 weights) and the result is cast to the parameter's dtype;
  - a parameter of one element is left clean (no Gaussian can be fitted to it; the reference would give NaN);
  - gradual training in stages (UNIQ's block-by-block schedule; with the vendored code's default
    `step_setup=[15, 9]` the first switch comes after 15 epochs, so a 12-epoch detector would see noise in its
    first layer group only) is not implemented: every selected layer gets noise from the first step.
Only the selected layers' parameters are perturbed (norms and activations are left alone), and only layers whose
own forward runs (nn.MultiheadAttention reads `out_proj.weight` directly: no noise there).

    noise = WeightNoise(model.backbone, bits=4, seed=0)   # hooks on every Linear of the backbone
    for it, (x, y) in enumerate(loader):
        noise.step = it                                   # the noise of each layer is a function of (seed, step)
        loss = criterion(model(x), y)                     # training forward: noisy weights
        ...                                               # backward reaches the clean weights; optimizer.step
    noise.remove()

Where the noise comes from: each layer's forward draws from a `torch.Generator` on the weight's device, seeded
from (seed, step, layer index) (`noise_seed`), so a run is reproducible and a resumed run draws what the
uninterrupted run drew, and every DDP rank perturbs its replica identically. Every forward of a layer in training
mode gets the noise, with grad or under no_grad; eval mode gets the clean weights. So every forward of a layer at
one `step` (with its clean weights unchanged) sees the same noisy weights: activation checkpointing's recomputation
in the backward sees the weights its forward saw, reentrant (`use_reentrant=True`, MMDetection's `with_cp`, whose
forward runs under no_grad) or not, and gives the loss and gradients of the run without checkpointing; a layer
called twice in one training forward gets the same noise both times. The noise changes only when `step` does: the
caller sets it before each training forward (WeightNoiseHook: to runner.iter). It starts at 0 and never advances
by itself; a second training forward of the model while it was never set warns once (the run would train with one
fixed perturbation), and setting it at all, even once, says the caller manages it. The swap is done by forward
hooks (`module._parameters["weight"]` and `["bias"]` hold the noisy tensors during that module's forward only, as
`torch.func.functional_call` does): the module code is untouched, and the state dict, the optimizer and checkpoints
only ever hold the clean Parameters.

A forward on the `meta` device (shapes only, no values: CD's pair check runs one in training mode) gets no noise and
is not counted as a training forward, and CD's checks on real numbers run in eval mode: ColinearityDecay and
WeightNoise may be built in either order, and neither order changes the noise or the run.
"""
from __future__ import annotations

import math
import warnings
import weakref
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from .update import compute_dtype
from .wrappers import unwrap_model

LAYER_TYPES: dict[str, type] = {"Linear": nn.Linear, "Conv2d": nn.Conv2d}
_MASK64 = (1 << 64) - 1
# layer -> the WeightNoise whose hooks are on it. Two on one layer would stack: the second takes the first's noisy
# tensor for the clean weight and puts it back after the forward, a plain tensor in the Parameter's place.
_NOISE_ON: "weakref.WeakKeyDictionary[nn.Module, WeightNoise]" = weakref.WeakKeyDictionary()


def _splitmix64(x: int) -> int:
    """One step of splitmix64: a well-mixed 64-bit value from a 64-bit value."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, step: int, index: int) -> int:
    """The generator seed of layer `index` at `step` (a 63-bit int): distinct triples give unrelated streams."""
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ step) ^ index) >> 1


UNIFORM_EPS = 1e-5  # UNIQ's clamp of u + e away from 0 and 1, and the floor of sigma (its `eps`)
PARAMETERS = ("weight", "bias")  # what UNIQ's add_noise perturbs in a Conv2d / Linear (every parameter)


def uniq_noise(p: Tensor, bits: int, generator: torch.Generator) -> Tensor:
    """UNIQ's noisy version of one parameter tensor (see the module docstring); its gradient w.r.t. `p` is the
    identity (the gradient at the noisy value reaches the clean one unchanged).

    Args:
        p: a weight or bias of any shape; one Gaussian is fitted to all of it.
        bits: the quantizer's bit-width; k = 2^bits levels.
        generator: a torch.Generator on p's device; one uniform draw per element, in p.numel() order.

    Returns:
        p~, shape and dtype of `p` (`p` itself when it has one element).
    """
    if p.numel() < 2:
        return p
    k = 2 ** bits
    dtype = compute_dtype(p)
    with torch.no_grad():
        pf = p.to(dtype)
        sigma, mu = torch.std_mean(pf)
        sigma = sigma.clamp_min(UNIFORM_EPS)
        u = 0.5 * (1.0 + torch.erf((pf - mu) / (sigma * math.sqrt(2.0))))  # F(p)
        e = (torch.rand(p.shape, generator=generator, device=p.device, dtype=dtype) - 0.5) / k  # U[-1/2k, 1/2k]
        v = (u + e).clamp(UNIFORM_EPS, 1.0 - UNIFORM_EPS)
        noisy = (mu + sigma * math.sqrt(2.0) * torch.erfinv(2.0 * v - 1.0)).to(p.dtype)  # F^-1
    return p + (noisy - p).detach()  # straight through, as UNIQ's swap of .data


def check_arguments(bits: Any, layer_types: Any, seed: Any) -> None:
    """WeightNoise's arguments; raises ValueError naming the bad one."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16:
        raise ValueError(f"bits must be an int in [1, 16], got {bits!r}")
    if isinstance(layer_types, str) or not layer_types or any(t not in LAYER_TYPES for t in layer_types):
        raise ValueError(f"layer_types must be a non-empty list of {sorted(LAYER_TYPES)}, got {layer_types!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")


def weight_source(layer: nn.Module) -> tuple[str, str]:
    """(what makes `layer`'s weight, the fix) for a layer whose weight is no Parameter: the refusal names the true
    cause, as each of torch's ways of computing a weight at each forward is removed by its own function."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm
    if parametrize.is_parametrized(layer, "weight"):
        return ("computed at each forward by a parametrization (parametrizations.weight_norm, spectral_norm, ...)",
                "remove it with torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight')")
    # the older hook-based APIs compute the weight in a forward pre-hook of these classes
    for kind, what, fix in ((WeightNorm, "torch.nn.utils.weight_norm", "remove_weight_norm(layer)"),
                            (SpectralNorm, "torch.nn.utils.spectral_norm", "remove_spectral_norm(layer)"),
                            (BasePruningMethod, "torch.nn.utils.prune", "prune.remove(layer, 'weight')")):
        if any(isinstance(hook, kind) for hook in layer._forward_pre_hooks.values()):
            return f"computed at each forward by {what}", f"remove it with torch.nn.utils.{fix}"
    return "held or computed outside the layer's parameters", "give WeightNoise layers that hold their own weight"


class WeightNoise:
    """UNIQ noise on the weights and biases of a model's layers during its training forwards, by forward hooks.

    Args:
        model: the model (or part, e.g. a detector's backbone); DDP / torch.compile wrappers are looked through.
        bits: k = 2^bits quantization levels; 4 (default) emulates the W4 target of the paper's W4A4 evaluation.
        layer_types: which layers get noise: "Linear" (default: the Transformer's matrices that W4 quantizes),
            "Conv2d" (e.g. the patch embedding) or both.
        seed: the run's noise seed (an int >= 0).

    Attributes:
        layers: (name, module) of the noisy layers, model order; a layer's index here enters its seed.
        step: set by the caller before each training forward (the iteration); part of every layer's seed. It
            starts at 0 and never advances by itself: a second training forward of the model while it was never
            set warns once (`_count_forward`).
    """

    def __init__(self, model: nn.Module, bits: int = 4, layer_types: Sequence[str] = ("Linear",),
                 seed: int = 0) -> None:
        check_arguments(bits, layer_types, seed)
        self.bits, self.seed = bits, seed
        self._step, self._step_set, self._unset_forwards = 0, False, 0
        root = unwrap_model(model)
        kinds = tuple(LAYER_TYPES[t] for t in layer_types)
        chosen = [(name, m) for name, m in root.named_modules() if isinstance(m, kinds)]
        # a weight computed at each forward (weight_norm, torch.nn.utils.parametrize) is no Parameter of the layer
        # for the swap to replace: refused, not left clean while its neighbours are noisy
        computed = [(name or type(m).__name__, m) for name, m in chosen
                    if not isinstance(m._parameters.get("weight"), nn.Parameter)]
        if computed:
            names = ", ".join(name for name, _ in computed[:3]) + (" ..." if len(computed) > 3 else "")
            how, fix = weight_source(computed[0][1])
            raise ValueError(f"WeightNoise: the weight of {names} is {how}: no Parameter for the noise to replace; "
                             f"{fix}, or leave that layer type out of layer_types")
        self.layers = chosen
        if not self.layers:
            raise ValueError(f"WeightNoise: no {'/'.join(layer_types)} layer with a weight in {type(model).__name__}")
        taken = [name for name, m in self.layers if m in _NOISE_ON]
        if taken:
            raise RuntimeError(f"WeightNoise: the layers {', '.join(taken[:3])}{' ...' if len(taken) > 3 else ''} "
                               "have the hooks of another WeightNoise already: remove() that one first (two would "
                               "stack their noise and leave a noisy tensor in place of the weight)")
        self._index = {id(m): i for i, (_, m) in enumerate(self.layers)}
        self._clean: dict[int, dict[str, nn.Parameter]] = {}  # id(module) -> its clean parameters, in its forward
        self._generators: dict[torch.device, torch.Generator] = {}
        self._handles = []
        for _, m in self.layers:
            self._handles.append(m.register_forward_pre_hook(self._swap_in))
            # always_call: the clean weight comes back even when the forward raises
            self._handles.append(m.register_forward_hook(self._swap_out, always_call=True))
            _NOISE_ON[m] = self
        self._handles.append(root.register_forward_pre_hook(self._count_forward))

    @property
    def step(self) -> int:
        """The noise step: part of every layer's seed (`noise_seed`), set by the caller."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step, self._step_set = value, True

    def _count_forward(self, module: nn.Module, args: Any) -> None:
        # the model's training forwards while `step` was never set: from the second on, each would draw the noise of
        # the first (the noise is a function of (seed, step, layer)), so the run would train with one fixed
        # perturbation instead of UNIQ's fresh noise. Counted on the model, not per layer: a layer's second forward
        # in one model forward (a layer called twice, activation checkpointing's recomputation) is meant to see the
        # noise its first forward saw.
        if not module.training or self._step_set or self._on_meta():
            return  # a meta forward (shapes only: CD's pair check) is no training forward: it gets no noise either
        self._unset_forwards += 1
        if self._unset_forwards == 2:
            warnings.warn("WeightNoise: a second training forward with noise.step never set draws the same noise as "
                          "the first (the noise is a function of (seed, step, layer), and step stays 0 unless set): "
                          "set noise.step = <iteration> before each training forward, as WeightNoiseHook does with "
                          "runner.iter; setting it once keeps one noise on purpose and silences this warning",
                          stacklevel=5)  # the caller's model(x), past Module.__call__'s frames

    def _on_meta(self) -> bool:
        """Whether the model runs on the `meta` device now: all its layers hold meta tensors (a model built there, or
        torch.func.functional_call with meta tensors, as CD's pair check runs it), which have no values to perturb.
        All of them: a layer left on meta (an unused one) beside real ones makes no forward one of shapes only."""
        return all(layer._parameters["weight"].is_meta for _, layer in self.layers)

    def _generator(self, device: torch.device) -> torch.Generator:
        """This WeightNoise's generator on `device` (one per device, reseeded by each layer's forward)."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    def _swap_in(self, module: nn.Module, args: Any) -> None:
        # Training forwards under no_grad get the noise too: reentrant activation checkpointing
        # (torch.utils.checkpoint(use_reentrant=True), MMDetection's `with_cp`) runs its first forward, the one the
        # loss comes from, under no_grad and recomputes it with grad in the backward; both must see the same noisy
        # weights, which they do as the draws are a function of (seed, step, layer) and the clean weights.
        if not module.training:
            return  # evaluation forwards use the clean weights
        key = id(module)
        if key in self._clean:
            raise RuntimeError(f"WeightNoise: {type(module).__name__} called again inside its own forward")
        clean = {name: module._parameters[name] for name in PARAMETERS if module._parameters.get(name) is not None}
        if clean["weight"].is_meta:
            # a forward of shapes only (CD's pair check runs one in training mode, whichever was attached first):
            # no values to perturb, and a noisy tensor in place of the meta weight would hide it from that check
            return
        gen = self._generator(clean["weight"].device)
        gen.manual_seed(noise_seed(self.seed, self.step, self._index[key]))  # weight's draws, then bias's
        self._clean[key] = clean
        for name, param in clean.items():
            module._parameters[name] = uniq_noise(param, self.bits, gen)

    def _swap_out(self, module: nn.Module, args: Any, output: Any) -> None:
        clean = self._clean.pop(id(module), None)
        if clean is not None:
            module._parameters.update(clean)

    def remove(self) -> None:
        """Remove every hook (idempotent); no layer is left holding a noisy weight."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for _, m in self.layers:
            clean = self._clean.pop(id(m), None)
            if clean is not None:
                m._parameters.update(clean)
            if _NOISE_ON.get(m) is self:
                del _NOISE_ON[m]

    def __enter__(self) -> "WeightNoise":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()
