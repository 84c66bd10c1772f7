"""Model conversion: apply a `QuantSpec` to a deep copy of a float model (a torchtitan-style converter).

Layers are selected by patterns over fully-qualified module names (`spec.fqn_matches`), never by substring
checks, and the float model is never modified. Attention modules are converted first (their `qkv` /
`proj` children keep their FQNs), then every nn.Linear / nn.Conv2d is matched against the linear
rules; in strict mode a Linear/Conv2d that matches neither a rule nor `keep_float` is an error.

A QuantLinear / QuantConv2d runs nn.Linear's / nn.Conv2d's forward on the adopted parameters, so a rule that matches
a subclass with a computation of its own (a forward or _conv_forward of its own: timm's StdConv2d, mmcv's ConvWS2d
weight standardisation; a parametrized weight; nn.MultiheadAttention's out_proj, whose weight the attention reads
itself) is refused, naming the layer and its class, rather than converted into a layer that silently computes
something else. Subclasses whose forward is the base's up to dead branches (`_SAME_FORWARD`) convert as the base
class does.

A module replaced by its quantized layer (an attention, a Linear/Conv2d a rule matches) that has forward or backward
hooks registered on it (a user's hook, cd.noise's WeightNoise, torch's old weight_norm / spectral_norm / pruning,
which compute the weight in a forward pre-hook), or a forward set on the instance (accelerate's hooks), is refused
naming its path and hooks: the quantized layer is a new module, which would run without them (a hook may also hold
the float module itself, as WeightNoise does by id).
"""
from __future__ import annotations

import copy
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.nn.utils import parametrize

from .attention import OPERANDS, convert_attention
from .layers import QuantConv2d, QuantLinear
from .quantizers import Quantizer
from models.modules import fqn_matches

from .spec import AttentionRule, LinearRule, QuantizerSpec, QuantSpec


# subclasses whose forward is nn.Linear's / nn.Conv2d's on this torch: mmcv's wrappers differ only for an empty input
# on torch < 1.4 / 1.5, timm's Linear only under torch.jit scripting (MMDetection's heads hold mmcv's wrappers)
_SAME_FORWARD = {"mmcv.cnn.bricks.wrappers.Linear", "mmcv.cnn.bricks.wrappers.Conv2d", "timm.layers.linear.Linear"}


def _own_computation(module: nn.Module) -> Optional[str]:
    """Why `module` (an nn.Linear / nn.Conv2d) computes other than its base class's forward; None where it does not."""
    cls = type(module)
    if f"{cls.__module__}.{cls.__qualname__}" in _SAME_FORWARD:
        return None
    if parametrize.is_parametrized(module):
        return "a parametrized weight"
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        # nn.MultiheadAttention reads out_proj.weight itself (F.multi_head_attention_forward) and never calls this
        # Linear: its weight quantizer would never run while the layer is reported quantized
        return "a weight nn.MultiheadAttention reads directly, never calling the layer"
    base = nn.Conv2d if isinstance(module, nn.Conv2d) else nn.Linear
    own = [name for name in ("forward", "_conv_forward") if getattr(cls, name, None) is not getattr(base, name, None)]
    return f"a {' and '.join(own)} of its own" if own else None


# the hook dicts nn.Module's __call__ runs (torch/nn/modules/module.py: _call_impl), and what each holds
_HOOKS = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
          ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook"))


def _refuse_hooks(fqn: str, module: nn.Module) -> None:
    """Raise ValueError naming `module`'s forward/backward hooks, which its replacement would not run; None without."""
    hooks = []
    for attr, kind in _HOOKS:
        for hook in getattr(module, attr, {}).values():
            target = getattr(hook, "func", hook)  # functools.partial: the function it calls
            hooks.append(f"{kind} {getattr(target, '__qualname__', type(target).__qualname__)}")
    if "forward" in vars(module):  # set on the instance (layer.forward = ..., accelerate's add_hook_to_module)
        hooks.append("a forward of the instance's own (module.forward = ...)")
    if hooks:
        raise ValueError(f"{fqn or type(module).__name__} ({type(module).__name__}) has {', '.join(hooks)} registered "
                         "on it, which the quantized layer replacing it would not run: remove them (their handles' "
                         "remove(), cd.noise's WeightNoise.remove()) before quantizing, or leave it out of the rules' "
                         "patterns (float)")


def _first_rule(fqn: str, rules: Iterable) -> Optional[object]:
    return next((r for r in rules if fqn_matches(fqn, r.patterns)), None)


def set_submodule(root: nn.Module, fqn: str, module: nn.Module) -> None:
    """Replace the submodule at `fqn` (e.g. "blocks.3.attn.qkv") with `module`."""
    parent_name, _, child = fqn.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def _channel_dim(spec: QuantizerSpec, operand: str, fqn: str) -> Optional[Union[int, Tuple[int, ...]]]:
    """Resolve a granularity into the grouped dimension for an operand type (for "token": the dims that
    one token's range pools, see QuantizerSpec)."""
    if spec.granularity == "tensor":
        return None
    dims = {"weight": {"channel": 0}, "linear_input": {"channel": -1, "token": (-1,)}, "conv_input": {"channel": 1},
            "matmul": {"channel": -1, "head": 1, "token": (1, -1)}}[operand]
    if spec.granularity not in dims:
        raise ValueError(f"{fqn}: granularity {spec.granularity!r} is not defined for a {operand} operand")
    return dims[spec.granularity]


def _make(spec: Optional[QuantizerSpec], operand: str, fqn: str, groups: Dict[Optional[int], Optional[int]],
          device: torch.device) -> Optional[Quantizer]:
    """Build a quantizer for an operand on the layer's `device`; `groups` maps a channel dim to its size
    (None: lazily sized)."""
    if spec is None:
        return None
    dim = _channel_dim(spec, operand, fqn)
    quantizer = spec.kind.from_spec(spec, dim, groups.get(dim), device=device)
    quantizer.name = fqn
    return quantizer


def _convert_linear(fqn: str, layer: nn.Module, rule: LinearRule) -> nn.Module:
    device = layer.weight.device
    if isinstance(layer, nn.Conv2d):
        wq = _make(rule.weight, "weight", f"{fqn}.weight_quantizer", {0: layer.out_channels}, device)
        iq = _make(rule.input, "conv_input", f"{fqn}.input_quantizer", {1: layer.in_channels}, device)
        new = QuantConv2d.from_float(layer, wq, iq)
    else:
        wq = _make(rule.weight, "weight", f"{fqn}.weight_quantizer", {0: layer.out_features}, device)
        iq = _make(rule.input, "linear_input", f"{fqn}.input_quantizer", {-1: layer.in_features}, device)
        new = QuantLinear.from_float(layer, wq, iq)
    new.quant_role = rule.role  # plain attribute: reports (quant.modes) name each layer's rule
    return new


def _convert_attention(fqn: str, attn: nn.Module, rule: AttentionRule) -> nn.Module:
    heads = int(attn.num_heads)
    head_dim = getattr(attn, "head_dim", None)
    device = attn.qkv.weight.device  # the matmul operands are computed from qkv's output
    quantizers = {}
    for op in OPERANDS:
        groups = {1: heads, -1: None if op == "attn" else head_dim}
        quantizers[op] = _make(getattr(rule, op), "matmul", f"{fqn}.{op}_quant", groups, device)
    return convert_attention(attn, quantizers)


def _converted_at_another_path(seen: Dict[int, Tuple[str, object, Optional[nn.Module]]], fqn: str, module: nn.Module,
                                decision: object) -> Optional[nn.Module]:
    """The conversion of `module` made at an earlier path of it (None: none); records its first path's rule (`decision`,
    None: float).

    A module held at several paths is one layer: a spec that treats its paths differently (a rule at one, another
    rule or float at another) cannot be followed at both, and is refused naming them."""
    first = seen.get(id(module))
    if first is None:
        seen[id(module)] = (fqn, decision, None)
        return None
    if first[1] is not decision:
        raise ValueError(f"{first[0]} and {fqn} are one module ({type(module).__name__}) held at two paths, which "
                         "the spec's rules treat differently; converting it at one converts it at both: give both "
                         "paths the same rule (or keep both float)")
    return first[2]


def convert_in_place(model: nn.Module, spec: QuantSpec) -> Dict[str, List[str]]:
    """Apply `spec` to `model` itself (use `quantize_model` to keep the original).

    Returns:
        {"attention": [...], "linear": [...], "float": [...]}: the FQNs converted / deliberately kept float.

    Raises:
        ValueError: strict spec and some Linear/Conv2d matches no rule and no keep_float pattern; a rule matches a
            subclass with a computation of its own (see the module docstring); a module held at two paths that the
            rules treat differently; a module to replace has forward/backward hooks.
    """
    done: Dict[str, List[str]] = {"attention": [], "linear": [], "float": []}
    # every path of a module held at several (one object at two names: named_modules would list it once, and the
    # second path kept the float module whatever the rules said); it is converted once and set at each path
    seen: Dict[int, Tuple[str, object, Optional[nn.Module]]] = {}
    for fqn, module in list(model.named_modules(remove_duplicate=False)):
        rule = _first_rule(fqn, spec.attentions)
        new = _converted_at_another_path(seen, fqn, module, rule)
        if rule is not None:
            _refuse_hooks(fqn, module)
            if new is None:
                new = _convert_attention(fqn, module, rule)
                seen[id(module)] = (fqn, rule, new)
            set_submodule(model, fqn, new)
            done["attention"].append(fqn)

    unmatched = []
    seen = {}
    for fqn, module in list(model.named_modules(remove_duplicate=False)):
        if isinstance(module, (QuantLinear, QuantConv2d)) or not isinstance(module, (nn.Linear, nn.Conv2d)):
            continue
        rule = _first_rule(fqn, spec.linears)
        new = _converted_at_another_path(seen, fqn, module, rule)
        if rule is not None:
            why = _own_computation(module)
            if why is not None:
                cls = type(module)
                raise ValueError(f"{fqn} is a {cls.__module__}.{cls.__qualname__}, a subclass of "
                                 f"nn.{'Conv2d' if isinstance(module, nn.Conv2d) else 'Linear'} with {why}: its "
                                 "quantized layer would run the plain layer's computation and change the model's "
                                 "output; quantize a model with a plain layer there, or leave it out of the "
                                 "rules' patterns (float)")
            _refuse_hooks(fqn, module)
            if new is None:
                new = _convert_linear(fqn, module, rule)
                seen[id(module)] = (fqn, rule, new)
            set_submodule(model, fqn, new)
            done["linear"].append(fqn)
        elif fqn_matches(fqn, spec.keep_float):
            done["float"].append(fqn)
        else:
            unmatched.append(fqn)
    if unmatched and spec.strict:
        raise ValueError(f"{len(unmatched)} Linear/Conv2d layers match no quantization rule: {unmatched[:8]}"
                         f"{' ...' if len(unmatched) > 8 else ''}; add a rule or a keep_float pattern")
    done["float"].extend(unmatched)
    return done


def refuse_hooked_layers(model: nn.Module, spec: QuantSpec) -> None:
    """Raise convert_in_place's ValueError for the first module `spec` replaces (an attention, a Linear/Conv2d a rule
    matches) that has hooks, on `model` itself: before a copy, which torch's old hook-based weight_norm makes raise
    its own RuntimeError (its weight is no graph leaf), so that the refusal names the layer's path and hooks."""
    for fqn, module in model.named_modules(remove_duplicate=False):
        if _first_rule(fqn, spec.attentions) is not None or (
                isinstance(module, (nn.Linear, nn.Conv2d)) and not isinstance(module, (QuantLinear, QuantConv2d))
                and _first_rule(fqn, spec.linears) is not None):
            _refuse_hooks(fqn, module)


def quantize_model(model: nn.Module, spec: QuantSpec) -> nn.Module:
    """A quantized deep copy of `model`; the original model is left untouched.

    All quantizers start uncalibrated: run `quant.calibrate` (or a pipeline) before evaluation.

    Args:
        model: float timm ViT/DeiT/Swin (or any model the spec's patterns describe).
        spec: the layout (see spec.py, layout.py and the pipelines in ptq/, aphq/, gplq/, gptq/, smoothquant/).

    Returns:
        The converted copy, in the original's train/eval mode and on its device.

    Raises:
        ValueError: as convert_in_place; a layer with hooks before the copy (`refuse_hooked_layers`).
    """
    refuse_hooked_layers(model, spec)  # before the copy (a weight_norm layer cannot be copied)
    new = copy.deepcopy(model)
    convert_in_place(new, spec)
    return new


def quantized_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(FQN, layer) of the QuantLinear / QuantConv2d layers."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantConv2d))]
