"""Activation maxima as the paper reports them ("Max. Act. (module / block)"), via removable forward hooks.

Definitions (measured over a data set, e.g. the validation set):
* block: max |value| over the outputs of every Transformer block (ViT `blocks.N`, Swin
  `layers.N.blocks.M`), i.e. the residual stream after each block;
* module: max |value| over the outputs of every module inside those blocks, at any depth. For timm
  ViT/DeiT: norm1, attn.qkv, attn.norm (an Identity in timm ViT: skipped, see below), attn.proj, attn,
  norm2, mlp.fc1, mlp.act, mlp.fc2, mlp (and ls1/ls2 when LayerScale is on); Swin blocks the same
  (Swin's attention output is the window-merged proj output). Pass-through modules (Identity,
  Dropout, DropPath) are skipped because they only repeat a tensor already counted or the residual,
  and so are quantizers when probing a converted model. Swin's PatchMerging (norm, reduction) lies
  between blocks, not inside one, and is not counted unless `extra_modules` names it
  (e.g. `("layers.*.downsample.norm", "layers.*.downsample.reduction")`).
A module whose forward never ran (timm Swin's `attn.softmax` under fused attention, TIMM_FUSED_ATTN=2, whose
kernel replaces it) has no output to measure: it has no record (no row of 0.0 in the CSV). Its maximum, a
probability (<= 1), leaves the module maximum the same either way unless no other output exceeds 1.

With `moments`, the kurtosis (Pearson: E[(x - mu)^4] / var^2, 3 for a Gaussian) of every output, over all its
elements in the data set; act/kurtosis_module and act/kurtosis_block are the largest over the modules' and the
blocks' outputs. Softmax modules (`nn.Softmax`: attention probabilities) are left out of it (their kurtosis is
NaN, no value, in `per_layer` and the CSV): their outputs are probabilities, not activations, whose kurtosis
(Swin's is the largest module kurtosis there) would be counted only where the attention is not fused, so that
act/kurtosis_module would change with TIMM_FUSED_ATTN.

An output that is not finite (an fp16 overflow under autocast, a diverged model) has the maximum inf (a NaN too),
so that the module or block maximum is inf, never the largest of the other outputs, and no kurtosis. Where it began
(`first_not_finite`) is found from the order in which the forward computed the outputs (each record's `call`; a
module's output after those of the modules inside it) and from whether the call that made a module's output not
finite first read an input that was not finite already (`input_finite`; a module called again, shared or on the next
batch, reads its own inf), not from the order the modules are registered in: Swin's softmax module is registered
after the proj that reads its output, and a softmax done as a function (timm ViT's, any fused attention) is no module.

Swin's window attention (timm's `SwinTransformerBlock._attn` and SwinV2's, MMDetection's `ShiftWindowMSA`) zero-pads a
token grid that is not a multiple of its window to whole windows, and crops the padded tokens off again after the
attention. The outputs of the attention module and of the modules in it (qkv, softmax, proj) hold rows for those
padded tokens: no token of the image, yet a padded query's attention output is not zero, and its qkv row is the bias.
They are left out of the maxima and the kurtosis (only the padded queries' rows: a real token's probabilities over the
padded keys are the model's computation). The padding is known to the block's forward from its input's grid
(`_window_validity`). An output in the attention that holds no tokens (SwinV2's position-bias MLP over the window
offsets) is measured whole.

Running maxima stay on the device (no host sync per batch); `result()` syncs once. A model split over devices
(transformers' device_map="auto": block 0 on cuda:0, block 1 on cuda:1) has its outputs' statistics kept on each
output's own device, with no copy per batch; `maxima()`, `seen()` and `moment_sums()` join them on one device.
For distributed evaluation pass `reduce_fn` (e.g. an all_reduce with MAX) or reduce `maxima()` and `seen()` yourself;
nothing here touches torch.distributed. The model is never modified: hooks are removed when the context exits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch
from torch import nn
from timm.layers import DropPath
from timm.models.swin_transformer import SwinTransformerBlock
from timm.models.swin_transformer_v2 import SwinTransformerV2Block

from configs import ConfigError
from models.modules import BLOCK_PATTERNS, fqn_matches

PASS_THROUGH: Tuple[Type[nn.Module], ...] = (nn.Identity, nn.Dropout, DropPath)
# modules whose output is a probability distribution (attention's softmax): no kurtosis (module docstring)
PROBABILITIES: Tuple[Type[nn.Module], ...] = (nn.Softmax, nn.Softmax2d)


def repeats_its_input(module: nn.Module) -> bool:
    """Pass-through modules, and modules that declare `repeats_its_input = True` (quant's quantizers:
    their output is the fake-quantized input of a layer whose output is counted anyway)."""
    return isinstance(module, PASS_THROUGH) or getattr(module, "repeats_its_input", False)


@dataclass
class ActMaxResult:
    """Aggregated maxima (`module`, `block`) and one record per probed output that was measured (`per_layer`: a
    module whose forward never ran has none)."""

    module: float
    block: float
    per_layer: List[Dict[str, object]] = field(default_factory=list)

    def metrics(self) -> Dict[str, float]:
        """Flat metrics for logging, e.g. {"act/max_module": .., "act/max_block": ..}; with moments also
        the largest kurtosis of a block output and of a module output (act/kurtosis_block, ..._module)."""
        out = {"act/max_module": self.module, "act/max_block": self.block}
        for kind in ("module", "block"):
            values = [r["kurtosis"] for r in self.per_layer if r["kind"] == kind and "kurtosis" in r
                      and r["kurtosis"] == r["kurtosis"]]
            if values:
                # an output that was not finite has no kurtosis, and the largest is then not known: NaN, not the
                # largest of the others
                finite = all(math.isfinite(r["max"]) for r in self.per_layer if r["kind"] == kind)
                out[f"act/kurtosis_{kind}"] = max(values) if finite else float("nan")
        return out


class ActivationProbe:
    """Context manager that records running max |output| of block-internal modules and of blocks.

        with ActivationProbe(model) as probe:
            for x, _ in loader:
                model(x)
        stats = probe.result()          # stats.module, stats.block, stats.per_layer

    Args:
        model: the (unwrapped: not DDP / torch.compile wrapped) model.
        blocks: patterns of the Transformer blocks (see `spec.fqn_matches`).
        extra_modules: patterns of further modules counted in "module" (e.g. Swin PatchMerging parts).
        skip: module -> True if its output is not counted (default: `repeats_its_input`).
    """

    def __init__(self, model: nn.Module, blocks: Sequence[str] = BLOCK_PATTERNS,
                 extra_modules: Sequence[str] = (),
                 skip: Callable[[nn.Module], bool] = repeats_its_input, moments: bool = False) -> None:
        self.model = model
        self.moments = moments  # also the kurtosis of every output but a softmax's (four raw moments, float64)
        # (name, kind, block index, module type relative to its block, module)
        self.targets: List[Tuple[str, str, int, str, nn.Module]] = []
        block_names = names_of_blocks(model, blocks)
        if not block_names:
            raise ValueError(f"no Transformer blocks match {tuple(blocks)}; pass the unwrapped model "
                             "(model.module for DDP, model._orig_mod for torch.compile)")
        for index, block_name in enumerate(block_names):
            block = model.get_submodule(block_name)
            self.targets.append((block_name, "block", index, "block", block))
            for sub_name, sub in block.named_modules():
                if sub_name and not skip(sub):
                    self.targets.append((f"{block_name}.{sub_name}", "module", index, sub_name, sub))
        # a block, or a module inside one, is counted already: named again, it was a second record, drawn and marked
        # as one outside the blocks (check_extra_modules refuses a pattern that names nothing else)
        counted = {id(t[4]) for t in self.targets}
        outside = [name for name, sub in model.named_modules()
                   if fqn_matches(name, extra_modules) and not skip(sub) and id(sub) not in counted]
        types = types_outside_blocks(model, outside)
        self.targets += [(name, "module", -1, types[name], model.get_submodule(name)) for name in outside]
        # the targets whose outputs are probabilities: measured for the maxima, not for the kurtosis
        self._probabilities = {i for i, target in enumerate(self.targets) if isinstance(target[4], PROBABILITIES)}
        # Swin window attention whose windows may be padded (module docstring): the target index -> the owner (the
        # module that pads) of the attention module that it is or lies in; the owners' pre-hooks set the validity
        self._owners = {id(owner): (owner, attention, layout) for owner, attention, layout in _window_owners(model)}
        inside = {id(sub): key for key, (_, attention, _) in self._owners.items() for sub in attention.modules()}
        self._owner_of = {i: inside[id(t[4])] for i, t in enumerate(self.targets) if id(t[4]) in inside}
        self._valid: Dict[int, Optional[torch.Tensor]] = {}  # owner -> [windows * B, N] bool of the real tokens
        self._handles: list = []
        # per device of the outputs (a split model's: module docstring), in the order the devices were first seen
        self._max: Dict[torch.device, torch.Tensor] = {}  # [K]
        self._seen: Dict[torch.device, torch.Tensor] = {}  # [K]: 1.0 where the hook measured an output, else 0.0
        self._sums: Dict[torch.device, torch.Tensor] = {}  # [K, 5]: count, sum x, x^2, x^3, x^4 (with `moments`)
        # [K]: 1.0 where the call that made the module's output not finite first read an input not finite
        self._read: Dict[torch.device, torch.Tensor] = {}
        self._calls: Dict[int, int] = {}  # target index -> its place in the forward's order (the first call's)

    # -- hooks ----------------------------------------------------------------------------------
    def _hook(self, index: int) -> Callable:
        def hook(module: nn.Module, inputs: tuple, output: object) -> None:
            # hooks run in the order the forward computes the outputs: counted on the host, no sync
            self._calls.setdefault(index, len(self._calls))
            read_bad = None  # 0-dim bool: an input not finite already, an overflow that began before (module doc)
            for x in inputs:
                if isinstance(x, torch.Tensor) and x.numel() and x.is_floating_point():
                    # one pass (isfinite().all() takes several): an inf shows in the min or max, a NaN in both
                    low, high = x.detach().aminmax()
                    bad = ~(low.isfinite() & high.isfinite())
                    read_bad = bad if read_bad is None else read_bad | bad.to(read_bad.device)
            # flagged at the call whose output is the module's first not finite alone: a module called again (shared,
            # or on the next batch) reads its own inf, and a softmax reads a mask's -inf into a finite output
            maxima = None if read_bad is None else self._max.get(read_bad.device)
            was_finite = None if maxima is None else maxima[index].isfinite()
            tensors = output if isinstance(output, (tuple, list)) else (output,)
            for t in tensors:
                if not isinstance(t, torch.Tensor) or t.numel() == 0 or not t.is_floating_point():
                    continue
                # a NaN (an overflow's inf - inf) is kept as inf: a NaN drops out of Python's max() of the records
                # (it compares false) and of a distributed MAX all-reduce, and the other outputs' largest was reported
                # Swin's padded tokens are no tokens of the image (module docstring): left out
                valid = self._valid.get(self._owner_of[index]) if index in self._owner_of else None
                mask = None if valid is None else _token_mask(t, valid, index in self._probabilities)
                magnitude = t.detach().abs()
                # a padded entry as 0: the largest |value| of a tensor that holds a real token is unchanged
                value = (magnitude if mask is None else magnitude.masked_fill(~mask, 0)).amax().float()
                value = value.masked_fill(value.isnan(), float("inf"))
                if value.device not in self._max:
                    self._max[value.device] = torch.zeros(len(self.targets), device=value.device)
                    self._seen[value.device] = torch.zeros(len(self.targets), device=value.device)
                self._max[value.device][index].clamp_(min=value)  # in place on the device, no sync
                # a max of 0.0 may be measured (an all-zero output): only the flag tells it from "never ran"
                self._seen[value.device][index].fill_(1.0)
                if self.moments and index not in self._probabilities:
                    x = t.detach().double()
                    if mask is None:
                        # the count as a fill: new_tensor is a blocking host-to-device copy (a sync per module)
                        count = x.new_full((), float(x.numel()))
                    else:  # padded entries as 0 add nothing to the sums; the count of the others stays on the device
                        count = mask.expand(x.shape).sum(dtype=torch.float64)
                        x = x.masked_fill(~mask, 0)
                    x = x.flatten()
                    if x.device not in self._sums:
                        self._sums[x.device] = torch.zeros(len(self.targets), 5, device=x.device, dtype=torch.float64)
                    powers = torch.stack([count, x.sum(), x.square().sum(), x.pow(3).sum(), x.square().square().sum()])
                    self._sums[x.device][index] += powers
            if read_bad is not None and read_bad.device in self._max:  # an output measured on the input's device
                turned = ~self._max[read_bad.device][index].isfinite()
                turned = turned if was_finite is None else turned & was_finite
                if read_bad.device not in self._read:
                    self._read[read_bad.device] = torch.zeros(len(self.targets), device=read_bad.device)
                self._read[read_bad.device][index].clamp_(min=(read_bad & turned).float())
        return hook

    def __enter__(self) -> "ActivationProbe":
        if self._handles:
            raise RuntimeError("probe is already attached")
        self._handles = [m.register_forward_hook(self._hook(i))
                         for i, (_, _, _, _, m) in enumerate(self.targets)]
        for key, (owner, _, layout) in self._owners.items():
            self._handles.append(owner.register_forward_pre_hook(self._window_hook(key, layout), with_kwargs=True))
            self._handles.append(owner.register_forward_hook(self._window_done(key)))
        return self

    def _window_hook(self, key: int, layout: Callable) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._valid[key] = layout(module, args, kwargs)
        return hook

    def _window_done(self, key: int) -> Callable:
        def hook(module: nn.Module, inputs: tuple, output: object) -> None:
            self._valid.pop(key, None)
        return hook

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._valid = {}

    # -- results --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the maxima (and moments) seen so far (e.g. at the start of each validation)."""
        self._max, self._seen, self._sums, self._read, self._calls = {}, {}, {}, {}, {}

    def names(self) -> List[str]:
        return [t[0] for t in self.targets]

    def maxima(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """[K] float32 running maxima in `names()` order (zeros if nothing was seen), for all_reduce(MAX); on
        `device`, else on the device of the first output seen."""
        return _joined(self._max, torch.amax, (len(self.targets),), torch.float32, device)

    def seen(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """[K] float32 flags in `names()` order, 1.0 for a target whose output was measured and 0.0 for one whose
        forward never ran (zeros if nothing was seen), for all_reduce(MAX) beside `maxima()`."""
        return _joined(self._seen, torch.amax, (len(self.targets),), torch.float32, device)

    def moment_sums(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """[K, 5] float64 sums of count, x, x^2, x^3, x^4 in `names()` order (zeros if nothing was seen; with
        `moments`), for all_reduce(SUM)."""
        return _joined(self._sums, torch.sum, (len(self.targets), 5), torch.float64, device)

    def result(self, reduce_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
               device: Optional[torch.device] = None,
               sum_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> ActMaxResult:
        """Aggregate (one host sync). Targets whose forward never ran (on any rank, with `reduce_fn`) have no
        record in `per_layer`. Each record holds, besides its name, kind, block, type and max, its `call` (its place in
        the order the forward computed the outputs on this rank, None where only another rank ran it) and
        `input_finite` (False where the call that made its output not finite first read an input not finite),
        which `first_not_finite` reads.

        Args:
            reduce_fn: applied before aggregation to the [3, K] stack of `maxima()`, `seen()` and the flags of an
                input not finite, e.g. a distributed MAX all-reduce returning the reduced tensor: one collective,
                after which every rank holds the same records.
            device: where to place the zeros of a probe that saw no data (needed for collectives).
            sum_fn: with `moments`, applied to the [K, 5] moment sums (a distributed SUM all-reduce).
        """
        maxima = self.maxima(device)
        read = _joined(self._read, torch.amax, (len(self.targets),), torch.float32, maxima.device)
        stacked = torch.stack([maxima, self.seen(maxima.device), read])
        if reduce_fn is not None:
            stacked = reduce_fn(stacked.clone())
        values, seen, read_not_finite = stacked.cpu().tolist()
        records = [{"name": name, "kind": kind, "block": block, "type": typ, "max": v, "call": self._calls.get(i),
                    "input_finite": bad == 0}
                   for i, ((name, kind, block, typ, _), v, bad)
                   in enumerate(zip(self.targets, values, read_not_finite))]
        if self.moments:
            sums = self.moment_sums(device)
            if sum_fn is not None:
                sums = sum_fn(sums.clone())
            # a softmax's has no moments summed: NaN, no value (as an output too near a constant), left out of the
            # largest kurtosis (`metrics`) and of scripts/dose_report.py's
            for record, kurtosis in zip(records, kurtosis_from_sums(sums).tolist()):
                record["kurtosis"] = kurtosis
        records = [r for r, flag in zip(records, seen) if flag > 0]
        module = max((r["max"] for r in records if r["kind"] == "module"), default=0.0)
        block = max((r["max"] for r in records if r["kind"] == "block"), default=0.0)
        return ActMaxResult(module=module, block=block, per_layer=records)


def first_not_finite(records: Sequence[Dict[str, object]]) -> Optional[Tuple[str, int, str]]:
    """Where the outputs that are not finite began, for the errors that refuse such maxima (evaluate.py,
    engine/detection/evaluation.py): None where every max is finite, else (the first output not finite in the order
    the forward computed them, how many more are not, a note: "" where that module's own computation made it, else
    where the value it read was computed). A NaN spreads on from where it began, so the outputs after it are not
    finite too; a value computed outside every measured module (an attention's q @ k or softmax done as a function in
    the attention's forward, a block's residual add, a position embedding added before the blocks) shows first in the
    module that reads it, whose input was not finite: the value came from the forward of the innermost module around
    it that read a finite input, else from before them all."""
    bad = sorted((r for r in records if not math.isfinite(r["max"])),
                 key=lambda r: (r.get("call") is None, r.get("call") or 0))
    if not bad:
        return None
    first = bad[0]
    name = str(first["name"])
    if first.get("input_finite", True):
        return name, len(bad) - 1, ""
    by_name = {str(r["name"]): r for r in records}
    around = [n for n in by_name if n != name and (n == "" or name.startswith(f"{n}."))]
    outer = name
    for parent in sorted(around, key=len, reverse=True):  # the innermost first
        if by_name[parent].get("input_finite", True):
            inside = "the model" if parent == "" else parent
            return name, len(bad) - 1, (f"{name} read a value that was not finite already, computed in {inside}'s "
                                        "forward outside the modules measured in it (an operation there that is no "
                                        "module: an attention's q @ k, a softmax done as a function, a residual "
                                        "add)")
        outer = parent
    return name, len(bad) - 1, (f"{name} read a value that was not finite already, computed before "
                                f"{outer or 'the model'} outside the modules measured")


def _joined(per_device: Dict[torch.device, torch.Tensor], join: Callable, shape: Tuple[int, ...],
            dtype: torch.dtype, device: Optional[torch.device]) -> torch.Tensor:
    """One tensor of the per-device statistics (`join`: torch.amax for maxima and flags, torch.sum for moment sums)
    on `device`, else on the first device seen; zeros on `device` if nothing was seen."""
    if not per_device:
        return torch.zeros(shape, dtype=dtype, device=device)
    parts = list(per_device.values())
    target = parts[0].device if device is None else device
    if len(parts) == 1:
        return parts[0] if device is None else parts[0].to(device)
    return join(torch.stack([p.to(target) for p in parts]), dim=0)


def _window_validity(batch: int, height: int, width: int, window: Tuple[int, int], roll: Tuple[int, int],
                     device: torch.device) -> Optional[torch.Tensor]:
    """[windows * batch, window tokens] bool, True at the tokens of the (height, width) grid, in the order of the
    window partition (batch, window row, window column; row-major inside a window) after zero-padding the grid at the
    bottom and right to whole windows and rolling the padded grid by `roll`; None where nothing is padded."""
    wh, ww = window
    padded_h, padded_w = -(-height // wh) * wh, -(-width // ww) * ww
    if (padded_h, padded_w) == (height, width):
        return None
    grid = torch.zeros(padded_h, padded_w, dtype=torch.bool, device=device)
    grid[:height, :width] = True
    if any(roll):
        grid = grid.roll(roll, dims=(0, 1))
    windows = grid.view(padded_h // wh, wh, padded_w // ww, ww).permute(0, 2, 1, 3).reshape(-1, wh * ww)
    return windows.repeat(batch, 1)


def _timm_swin_layout(block: nn.Module, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """timm's SwinTransformerBlock: x [B, H, W, C] is rolled by -shift_size, then padded (`_attn`): the real tokens
    are the top-left H x W of the padded grid."""
    x = args[0] if args else kwargs["x"]
    return _window_validity(x.shape[0], x.shape[1], x.shape[2], tuple(block.window_size), (0, 0), x.device)


def _mmdet_swin_layout(msa: nn.Module, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """MMDetection's ShiftWindowMSA(query [B, H * W, C], hw_shape): padded first, then rolled by -shift_size."""
    query = args[0] if args else kwargs["query"]
    height, width = args[1] if len(args) > 1 else kwargs["hw_shape"]
    window, shift = (msa.window_size,) * 2, (-msa.shift_size,) * 2
    return _window_validity(query.shape[0], height, width, window, shift, query.device)


def _window_owners(model: nn.Module) -> List[Tuple[nn.Module, nn.Module, Callable]]:
    """(the module that pads the windows, the window attention module it calls, its layout) for each Swin block."""
    found = []
    for module in model.modules():
        if isinstance(module, (SwinTransformerBlock, SwinTransformerV2Block)):  # the same roll, pad and partition
            found.append((module, module.attn, _timm_swin_layout))
        elif f"{type(module).__module__}.{type(module).__qualname__}" == "mmdet.models.backbones.swin.ShiftWindowMSA":
            found.append((module, module.w_msa, _mmdet_swin_layout))
    return found


def _token_mask(t: torch.Tensor, valid: torch.Tensor, probabilities: bool) -> Optional[torch.Tensor]:
    """`valid` [windows * B, N] as a mask broadcasting over `t`, the output of a module in a window attention: rows of
    tokens ([windows * B, N, ...]: qkv, proj, the attention's output) or probabilities ([windows * B, heads, N, keys],
    a softmax: the rows of the padded queries); None for an output not laid out by window and token, which holds no
    token (SwinV2's cpb_mlp: the position bias of each window offset)."""
    rows, tokens = valid.shape
    if probabilities and t.dim() == 4 and t.shape[0] == rows and t.shape[2] == tokens:
        return valid[:, None, :, None]
    if not probabilities and t.dim() >= 2 and tuple(t.shape[:2]) == (rows, tokens):
        return valid.view(rows, tokens, *([1] * (t.dim() - 2)))
    return None


def kurtosis_from_sums(sums: torch.Tensor) -> torch.Tensor:
    """Pearson kurtosis E[(x - mu)^4] / var^2 (3 for a Gaussian) per row of [count, sum x, .. x^4] sums;
    NaN where a row saw nothing, a constant, or values so near a constant that the raw moments cannot resolve it.

    Raw moments (they sum across batches and ranks with one all-reduce) lose digits to cancellation as
    (|mean| / std)^4 grows: the relative error on 65,536 Gaussian samples is 2e-12 at a mean of 10 std, 2e-9 at
    100 std and 2e-4 at 1,000 std. An output whose mean is over ~300 std (a near-constant) needs shifted moments.
    The relative error is about eps * (E[x^2] / var)^2: where var <= sqrt(eps) * E[x^2] (a mean over ~10^4 std,
    a constant's variance of a few ulps either side of zero included) it exceeds the kurtosis itself, so NaN.
    """
    n = sums[:, 0].clamp(min=1)
    m1, m2, m3, m4 = (sums[:, k] / n for k in range(1, 5))
    var = m2 - m1 ** 2
    central4 = m4 - 4 * m1 * m3 + 6 * m1 ** 2 * m2 - 3 * m1 ** 4
    resolved = var > m2 * torch.finfo(torch.float64).eps ** 0.5
    return torch.where((sums[:, 0] > 0) & resolved, central4 / var.clamp(min=1e-300) ** 2,
                       torch.full_like(var, float("nan")))


def types_outside_blocks(model: nn.Module, names: Sequence[str]) -> Dict[str, str]:
    """{name: module type} of modules outside the blocks, which groups a module's record with those of the same module
    of the other stages: each index into a container of repeated units (a ModuleList or Sequential whose children are
    all of one class: Swin's `layers`, MMDetection's `stages`, GPT-2's `transformer.h`, nested ones too) as N, so
    `layers.1.downsample.reduction` is `layers.N.downsample.reduction` and `a.0.1.b` is `a.N.N.b`. An index into a
    container of unlike members (a Sequential of a conv and a norm: `downsample.0`, `downsample.1`) names distinct
    modules and stays, and so do the names of modules of other classes that would share a type."""
    types = {}
    for name in names:
        parent, parts = model, []
        for part in name.split(".") if name else []:  # "" is the model itself ('**' names it too)
            children = dict(parent.named_children())
            repeated = part.isdigit() and len({type(child) for child in children.values()}) == 1
            parts.append("N" if repeated else part)
            parent = children[part]
        types[name] = ".".join(parts)
    classes: Dict[str, set] = {}
    for name, typ in types.items():
        classes.setdefault(typ, set()).add(type(model.get_submodule(name)))
    return {name: typ if len(classes[typ]) == 1 else name for name, typ in types.items()}


def names_of_blocks(model: nn.Module, blocks: Sequence[str] = BLOCK_PATTERNS) -> List[str]:
    """The names of the model's Transformer blocks, the modules whose outputs are the "block" maxima."""
    return [name for name, _ in model.named_modules() if fqn_matches(name, blocks)]


def check_has_blocks(model: nn.Module, model_name: str, fix: str) -> None:
    """The activation maxima are measured over Transformer blocks (`BLOCK_PATTERNS`): a model that train.py trains
    but that has none (a timm ResNet) is refused before the work, not by `ActivationProbe` after the training or the
    FP pass. `fix`: how this entry point does without the maxima."""
    if not names_of_blocks(model):
        patterns = " or ".join(repr(p) for p in BLOCK_PATTERNS)
        raise ConfigError(f"model.name={model_name}: {type(model).__name__} has no Transformer blocks (modules named "
                          f"{patterns}) to measure the activation maxima over; {fix}")


def check_extra_modules(model: torch.nn.Module, patterns: list) -> None:
    """Each quant.act_max_extra_modules pattern must name modules of the model whose outputs the probe measures:
    one that names none (a typo, a name of another architecture), only pass-through modules (`repeats_its_input`:
    an Identity, a Dropout, a DropPath, which `ActivationProbe` skips), or only the blocks and modules inside them
    (counted already: the result's note would say that modules outside the blocks were), would be recorded in the
    result file as probed while adding nothing. evaluate.py checks before its passes, train.py once its model is built
    (the run's quant.* settings are the defaults of `evaluate.py --checkpoint`)."""
    modules = list(model.named_modules())
    names = [name for name, _ in modules]
    blocks = names_of_blocks(model)
    for pattern in patterns:
        matched = [(name, sub) for name, sub in modules if fqn_matches(name, [pattern])]
        if not matched:
            raise ConfigError(f"quant.act_max_extra_modules: {pattern!r} names no module of {type(model).__name__} "
                              f"(full module names, '*' for one name segment, '**' for several: e.g. "
                              f"{names[-1]!r}); drop it or fix it")
        if all(repeats_its_input(sub) for _, sub in matched):
            shown = ", ".join(f"{name}: {type(sub).__name__}" for name, sub in matched[:3])
            more = f" and {len(matched) - 3} more" if len(matched) > 3 else ""
            raise ConfigError(f"quant.act_max_extra_modules: {pattern!r} names only pass-through modules of "
                              f"{type(model).__name__} ({shown}{more}), whose outputs repeat their inputs and are not "
                              "measured; drop it or name the module that computes what they pass on")
        # a block's own name is no name under it: its output is the block maximum's
        outside = [name for name, sub in matched if not repeats_its_input(sub)
                   and not any(name == block or name.startswith(block + ".") for block in blocks)]
        if not outside:
            shown = ", ".join(name for name, _ in matched[:3])
            more = f" and {len(matched) - 3} more" if len(matched) > 3 else ""
            what, maxima = (("Transformer blocks (and modules inside them)", "block and module maxima count")
                            if set(blocks) & {name for name, _ in matched} else
                            ("modules inside the Transformer blocks", "module maximum counts"))
            raise ConfigError(f"quant.act_max_extra_modules: {pattern!r} names only {what} of "
                              f"{type(model).__name__} ({shown}{more}), whose outputs the {maxima} already; drop it "
                              "(the setting adds modules outside the blocks)")
