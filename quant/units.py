"""Reconstruction units of a timm ViT/DeiT/Swin and capturing what flows into and out of them.

APHQ-ViT reconstructs, in module order (GoatWu/APHQ-ViT `test_quant.py`): the patch embedding, every
Transformer block (ViT `blocks.N`, Swin `layers.N.blocks.M`), every Swin PatchMerging (`layers.N.downsample`,
not the Identity of stage 0) and the classifier (`head` for ViT/DeiT, `head.fc` for Swin, plus DeiT's
`head_dist`). GPLQ's QwT compensates the Transformer blocks. Units are found by FQN, so the float and the
quantized copy of a model name the same units.

An MMDetection detector (APHQ-ViT's `Object-Detection/tools/quant_utils/block_recon.py`) has the units of its
Swin backbone (`backbone.patch_embed`, `backbone.stages.N.blocks.M`, `backbone.stages.N.downsample`) and the
FPN `neck`; its RPN and RoI heads are calibrated but not reconstructed, as officially.

Activations are captured with forward hooks that stop the forward pass right after the unit
(`_StopForward`), so capturing the input of unit k runs only the prefix of the network. Captures are
concatenated over the image batches on `store_device` (default: the model's device). A model that is not
called on one tensor (a detector: images with their metadata) is run through a `SampleFeed`, and its unit
captures stay per sample (`capture_unit_calls`): a detector's images differ in size.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Literal, NamedTuple, Optional, Protocol, Tuple, Union, runtime_checkable

import torch
from torch import nn

from .quantizers import Quantizer
from models.modules import BLOCK_PATTERNS, fqn_matches

from .spec import HEAD

UnitKind = Literal["stem", "block", "merge", "head", "neck"]
MERGE_PATTERNS = ("layers.*.downsample", "backbone.stages.*.downsample")
STEM_PATTERNS = ("patch_embed", "backbone.patch_embed")
DETECTOR_BLOCK_PATTERNS = ("backbone.stages.*.blocks.*",)
NECK_PATTERNS = ("neck",)


@runtime_checkable
class SampleFeed(Protocol):
    """Inputs of a model that is not called on one tensor (an MMDetection detector: `engine/detection/feeds.py`'s
    `DetectorSamples`), as `len(feed)` batches that run the model themselves: `feed.run(model, i)` is one
    forward of batch i. Captures over a feed are per batch."""

    def __len__(self) -> int: ...

    def run(self, model: nn.Module, index: int) -> Any: ...


Inputs = Union[torch.Tensor, SampleFeed]


@dataclass(frozen=True)
class Unit:
    """One reconstruction unit: its FQN and kind."""

    name: str
    kind: UnitKind


def find_units(model: nn.Module,
               kinds: Tuple[UnitKind, ...] = ("stem", "block", "merge", "head")) -> List[Unit]:
    """The units of `model` in module (= execution) order, restricted to `kinds`."""
    units = []
    for name, module in model.named_modules():
        if name in STEM_PATTERNS:
            kind = "stem"
        elif fqn_matches(name, BLOCK_PATTERNS + DETECTOR_BLOCK_PATTERNS):
            kind = "block"
        elif fqn_matches(name, MERGE_PATTERNS) and not isinstance(module, nn.Identity):
            kind = "merge"
        elif fqn_matches(name, HEAD) and isinstance(module, nn.Linear):
            kind = "head"
        elif name in NECK_PATTERNS:
            kind = "neck"
        else:
            continue
        if kind in kinds:
            units.append(Unit(name, kind))
    return units


def check_unit_coverage(model: nn.Module, units: List[Unit]) -> None:
    """Every enabled quantizer of `model` must lie inside some unit (else it would never be reconstructed)."""
    prefixes = tuple(u.name + "." for u in units)
    outside = [n for n, m in model.named_modules() if isinstance(m, Quantizer) and m.enabled
               and not n.startswith(prefixes)]
    if outside:
        raise ValueError(f"{len(outside)} quantizers lie outside every reconstruction unit: {outside[:6]}")


class _StopForward(Exception):
    """Raised by a capture hook once the watched module has run (skips the rest of the network)."""


def _forward_until_stop(model: nn.Module, images: Inputs, batch_size: int,
                        device: torch.device) -> None:
    """Run `images` through `model` in chunks (a SampleFeed: batch by batch); a hook raising _StopForward ends
    each chunk's forward early."""
    if isinstance(images, SampleFeed):
        for i in range(len(images)):
            try:
                images.run(model, i)
            except _StopForward:
                pass
        return
    for chunk in images.split(batch_size):
        try:
            model(chunk.to(device))
        except _StopForward:
            pass


def device_of(model: nn.Module) -> torch.device:
    """The device of a model's first parameter (CPU for a parameter-free module)."""
    tensor = next(model.parameters(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


@torch.no_grad()
def capture_unit(model: nn.Module, name: str, images: torch.Tensor, batch_size: int, *, inputs: bool = True,
                 outputs: bool = False, store_device: Optional[torch.device] = None
                 ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """First positional input and/or output of submodule `name` for all `images`, in `model`'s current state.

    Args:
        model: a timm model (float or converted, in whatever quantizer state the caller set).
        name: FQN of the submodule (a unit).
        images: [N, 3, H, W] on any device (moved batch by batch).
        batch_size: images per forward pass.
        inputs, outputs: which tensors to keep.
        store_device: where the captures live (default: the model's device).

    Returns:
        (inputs [N, ...] or None, outputs [N, ...] or None).
    """
    device = device_of(model)
    store = store_device or device
    module = model.get_submodule(name)
    got_in: List[torch.Tensor] = []
    got_out: List[torch.Tensor] = []

    def hook(_mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if inputs:
            got_in.append(args[0].detach().to(store))
        if outputs:
            got_out.append(out.detach().to(store))
        raise _StopForward

    handle = module.register_forward_hook(hook)
    try:
        _forward_until_stop(model, images, batch_size, device)
    finally:
        handle.remove()
    return (torch.cat(got_in) if inputs else None), (torch.cat(got_out) if outputs else None)


@torch.no_grad()
def stream_module_inputs(model: nn.Module, modules: Dict[str, nn.Module], stop_at: Optional[str],
                         images: Inputs, batch_size: int,
                         consume: Callable[[str, torch.Tensor], None]) -> None:
    """Hand the first positional input of each module in `modules` to `consume(key, input)`, batch by batch,
    as the forward pass computes it (nothing is stored here: running statistics, Hessians).

    Modules are called even when their quantizer is disabled, so this also sees float operands.

    Args:
        model: float or converted model, in whatever quantizer state the caller set.
        modules: {key: submodule of model}.
        stop_at: FQN of the submodule after which each forward stops (None: the whole model runs).
        images: model inputs [N, ...] (images or token ids) on any device, moved batch by batch.
        batch_size: inputs per forward pass.

    Raises:
        RuntimeError: some module saw no input.
    """
    seen = set()

    def hook(_m: nn.Module, args: tuple, key: str) -> None:
        seen.add(key)
        consume(key, args[0].detach())

    handles = [m.register_forward_pre_hook(functools.partial(hook, key=key)) for key, m in modules.items()]
    if stop_at is not None:
        handles.append(model.get_submodule(stop_at).register_forward_hook(_stop))
    try:
        _forward_until_stop(model, images, batch_size, device_of(model))
    finally:
        for h in handles:
            h.remove()
    missing = [k for k in modules if k not in seen]
    if missing:
        raise RuntimeError(f"modules saw no input{f' before {stop_at} finished' if stop_at else ''}: {missing[:6]}")


def _stop(*_: object) -> None:
    raise _StopForward


@torch.no_grad()
def capture_module_calls(model: nn.Module, modules: Dict[str, nn.Module], stop_at: Optional[str], images: Inputs,
                         batch_size: int) -> Dict[str, List[torch.Tensor]]:
    """The first positional input of each module in `modules` (e.g. quantizers inside one unit), one tensor
    per call: a module that runs several times per forward (an RPN convolution on every FPN level) or over
    several batches gives several tensors, in call order.

    The forward pass stops after module `stop_at` (the unit that contains them; None: the whole model runs).
    Modules are called even when their quantizer is disabled, so this also records float operands.

    Returns:
        {key: [input of each call]} on the model's device.
    """
    got: Dict[str, List[torch.Tensor]] = {k: [] for k in modules}
    stream_module_inputs(model, modules, stop_at, images, batch_size, lambda key, x: got[key].append(x))
    return got


def capture_module_inputs(model: nn.Module, modules: Dict[str, nn.Module], stop_at: Optional[str], images: Inputs,
                          batch_size: int) -> Dict[str, torch.Tensor]:
    """`capture_module_calls` concatenated over the calls along dim 0: {key: [N_total, ...]}."""
    return {k: torch.cat(v) for k, v in capture_module_calls(model, modules, stop_at, images, batch_size).items()}


class UnitCall(NamedTuple):
    """One call of a unit: its positional arguments (tensors detached, on the store device; shapes such as
    Swin's `hw_shape` as they were) and, when asked for, the tensors of its output in order."""

    args: tuple
    outputs: Optional[List[torch.Tensor]]


def output_tensors(out: Any) -> List[torch.Tensor]:
    """Every tensor of a module output, depth first: a tensor, MMDetection's (x, out_size) or FPN's tuple."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in output_tensors(item)]
    return []


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with `fn` applied to every tensor in it (tuples and lists keep their type)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def for_each_call(model: nn.Module, name: str, feed: SampleFeed,
                  consume: Callable[[tuple, Any], None]) -> int:
    """Run each batch of `feed` through `model` up to unit `name` and hand the unit's positional arguments and
    output to `consume(args, output)` (nothing is stored here); calls that `consume` itself makes to the unit
    (a reference forward) are not handed on. Returns the number of calls, which must be one per batch."""
    module = model.get_submodule(name)
    state = {"calls": 0, "busy": False}

    def hook(_mod: nn.Module, args: tuple, out: Any) -> None:
        if state["busy"]:
            return
        state["busy"] = True
        try:
            consume(args, out)
        finally:
            state["busy"] = False
        state["calls"] += 1
        raise _StopForward

    handle = module.register_forward_hook(hook)
    try:
        _forward_until_stop(model, feed, 1, device_of(model))
    finally:
        handle.remove()
    if state["calls"] != len(feed):
        raise RuntimeError(f"unit {name} ran {state['calls']} times over {len(feed)} batches (once per batch "
                           "expected)")
    return state["calls"]


@torch.no_grad()
def capture_unit_calls(model: nn.Module, name: str, feed: SampleFeed, *, outputs: bool = False,
                       store_device: Optional[torch.device] = None) -> List[UnitCall]:
    """The arguments (and with `outputs` the output tensors) of unit `name` for each batch of `feed`, in the
    model's current quantizer state: per sample, since a detector's images differ in size."""
    store = store_device or device_of(model)
    calls: List[UnitCall] = []

    def keep(args: tuple, out: Any) -> None:
        calls.append(UnitCall(map_tensors(args, lambda t: t.detach().to(store)),
                              [t.detach().to(store) for t in output_tensors(out)] if outputs else None))

    for_each_call(model, name, feed, keep)
    return calls


@torch.no_grad()
def model_logits(model: nn.Module, images: torch.Tensor, batch_size: int) -> torch.Tensor:
    """[N, classes] logits of `model` on `images`, batch by batch, on the model's device."""
    device = device_of(model)
    return torch.cat([model(chunk.to(device)) for chunk in images.split(batch_size)])
