"""The model behind DDP / torch.compile wrappers and the torch optimizer behind a framework's optimizer wrapper
(CD, TWEO, the integrations and the training code share these definitions)."""
from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn


# wrappers that hold the model as `.module`, by class name where their package may be missing: DeepSpeed's engine
# (which accelerate's DeepSpeed plugin returns from `prepare`)
_WRAPPER_NAMES = {"DeepSpeedEngine"}


def _module_wrappers() -> tuple:
    """The torch classes that hold the model as `.module`: DDP (and its subclasses, MMEngine's
    MMDistributedDataParallel among them), DataParallel and FSDP1's FullyShardedDataParallel (whose `.module` is
    the wrapped model; CD refuses FSDP1 itself, `cd.verify.refuse_fsdp1`, before stripping)."""
    kinds = [nn.DataParallel, nn.parallel.DistributedDataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch built without distributed
        pass
    else:
        kinds.append(FullyShardedDataParallel)
    return tuple(kinds)


def _is_module_wrapper(model: nn.Module) -> bool:
    """`model` is a known wrapper holding the model as `.module`: by type, so that a model of the user's own that
    names its only part `module` keeps its own forward (which may reshape the input first)."""
    return isinstance(model, _module_wrappers()) or any(
        c.__name__ in _WRAPPER_NAMES for c in type(model).__mro__)


def check_model(model: Any, who: str) -> None:
    """Refuse a `model` that is no nn.Module (None, its state_dict(), a list of its blocks) in one line naming what
    `who` was given, before the first `.modules()` on it fails deep inside with an AttributeError.

    Raises:
        TypeError: naming the type given and what to pass.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who} needs the model as a torch.nn.Module (or its DDP/torch.compile wrapper), got "
                        f"{type(model).__name__}; pass the model itself, not its state_dict() or a list of its parts")


def unwrap_model(model: nn.Module, who: str = "CD") -> nn.Module:
    """Strip DDP/DataParallel-style wrappers (`.module`) and torch.compile (`._orig_mod`), in any order.

    A wrapper is recognised by its type: torch's DistributedDataParallel (and subclasses such as MMEngine's
    MMDistributedDataParallel), DataParallel, FSDP1's FullyShardedDataParallel and DeepSpeed's DeepSpeedEngine
    hold the model as `.module`; torch.compile's OptimizedModule holds it as `._orig_mod`.

    Raises:
        TypeError: `model` is no nn.Module (`check_model`, naming `who`).
    """
    check_model(model, who)
    while True:
        orig = getattr(model, "_orig_mod", None)
        if isinstance(orig, nn.Module):
            model = orig
            continue
        inner = getattr(model, "module", None) if _is_module_wrapper(model) else None
        if isinstance(inner, nn.Module):
            model = inner
            continue
        return model


def wrapper_chain(optimizer: Any) -> list:
    """`optimizer` and the objects inside it, outermost first, down to the one without an inner optimizer: a
    framework's wrapper (accelerate's `AcceleratedOptimizer`, Lightning's `LightningOptimizer`, MMEngine's
    `OptimWrapper`) holds the torch optimizer as `.optimizer` or `._optimizer`."""
    chain = [optimizer]
    while len(chain) <= 8:
        inner = getattr(chain[-1], "optimizer", None) or getattr(chain[-1], "_optimizer", None)
        if inner is None or inner is chain[-1]:
            break
        chain.append(inner)
    return chain


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (accelerate's `AcceleratedOptimizer`, Lightning's
    `LightningOptimizer`, MMEngine's `OptimWrapper`): the object whose `step()` really updates the weights.
    accelerate's wrapper subclasses `torch.optim.Optimizer` without its state, so it is looked through too.

    Raises:
        TypeError: no torch.optim.Optimizer is found.
    """
    if isinstance(optimizer, torch.optim.lr_scheduler.LRScheduler):  # it holds an optimizer too: a likely mix-up
        raise TypeError(f"CD needs a torch.optim.Optimizer, got {type(optimizer).__name__} (an lr scheduler); "
                        "pass the optimizer")
    optimizer = wrapper_chain(optimizer)[-1]
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"CD needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


# DeepSpeed's optimizers as the frameworks hold them, by class name (DeepSpeed need not be installed): accelerate's
# wrapper of the engine's optimizer (whose step() does nothing) and its placeholder for a DeepSpeed config's own
# optimizer (`DummyOptim`, no torch optimizer at all), MMEngine's wrapper (whose step() is the engine's)
_DEEPSPEED_OPTIMIZERS = {"DeepSpeedOptimizerWrapper", "DummyOptim", "DeepSpeedOptimWrapper"}


def refuse_deepspeed(who: str, fix: str, optimizers: tuple = (), model: Optional[nn.Module] = None,
                     strategy: Any = None) -> None:
    """Refuse a run under DeepSpeed (DeepSpeed need not be installed: known by the names of its classes), before CD is
    built or bound: ZeRO (and DeepSpeed's fp16 / bf16 optimizers) step flattened copies of the weights, partitioned
    under ZeRO (ZeRO-3 empties the model's own), which hold no matrix to pair, and under accelerate the engine takes
    the optimizer step inside the backward (`DeepSpeedOptimizerWrapper.step` is a no-op), before the framework's
    event that arms CD (Lightning's and MMEngine's engine steps after the backward). ZeRO stage 0 in fp32 steps the
    weights themselves through the torch optimizer, but trains as DDP does, which the fix names.
    Bound anyway, CD missed the update or never acted, and the errors or warnings that followed named other causes.
    `optimizers`: the framework's (wrappers looked through); `model`: its parameters as ZeRO-3 leaves them
    (`ds_id`); `strategy`: Lightning's or MMEngine's (`DeepSpeedStrategy`). Shared by `ColinearityDecay.attach` and
    the integrations.

    Raises:
        RuntimeError: naming what was found and `fix`.
    """
    found = [type(obj).__name__ for opt in optimizers for obj in wrapper_chain(opt)
             if type(obj).__module__.split(".")[0] == "deepspeed"
             or any(c.__name__ in _DEEPSPEED_OPTIMIZERS for c in type(obj).__mro__)]
    if strategy is not None and any(c.__name__ == "DeepSpeedStrategy" for c in type(strategy).__mro__):
        found.append(type(strategy).__name__)
    if model is not None and any(hasattr(p, "ds_id") for p in model.parameters()):
        found.append("ZeRO-3 partitioned parameters")
    if found:
        raise RuntimeError(f"{who}: CD does not support DeepSpeed (found {', '.join(dict.fromkeys(found))}): ZeRO "
                           "and DeepSpeed's fp16/bf16 optimizers step flattened, partitioned copies of the weights "
                           "that hold no matrix to pair, and under accelerate the engine steps inside the backward, "
                           "before the event that arms CD (ZeRO stage 0 in fp32, which steps the weights themselves, "
                           f"trains as DDP does); {fix}")


def refuse_backward_steps(optimizer: torch.optim.Optimizer, who: str) -> None:
    """Refuse an optimizer that steps the weights inside the backward, in gradient hooks, not in its `step()`, where
    CD runs: a CD update there never ran before an update (a loop that calls no `step()`) or ran on weights already
    stepped. Known by name (their packages need not be installed): torch's ZeroRedundancyOptimizer built with
    overlap_with_ddp=True (DDP's comm hook `hook_with_zero_step` steps each rank's shard; its own `step()` returns
    before stepping), and lomo_optim's Lomo and AdaLomo (their `fused_backward`, which transformers' Trainer calls
    for optim="lomo" / "adalomo" and accelerate's `backward(loss, learning_rate=...)`).

    Raises:
        RuntimeError: naming `who`, the optimizer and the fix.
    """
    kinds = type(optimizer).__mro__
    if getattr(optimizer, "_overlap_with_ddp", False) is True and any(
            c.__name__ == "ZeroRedundancyOptimizer" for c in kinds):
        raise RuntimeError(f"{who}: ZeroRedundancyOptimizer(overlap_with_ddp=True) steps the weights inside DDP's "
                           "backward (hook_with_zero_step), and its own step() returns before stepping, so CD, which "
                           "runs in that step, would never run before an update; build it with "
                           "overlap_with_ddp=False (the default) and call its step()")
    lomo = next((c.__name__ for c in kinds if c.__module__.split(".")[0] == "lomo_optim"), None)
    if lomo is not None:
        raise RuntimeError(f"{who}: {lomo} (lomo_optim) steps the weights inside the backward (fused_backward, in a "
                           "gradient hook of each parameter), not in the optimizer's step that CD runs in, so no "
                           "update would have CD; train with another optimizer (transformers: an optim other than "
                           "'lomo' / 'adalomo', e.g. 'adamw_torch')")


def steps_without_hooks(optimizer: Any) -> list[str]:
    """Where `optimizer` (or a wrapper around it, `wrapper_chain`) keeps a `step` of the torch optimizer that calls
    no step hooks: one taken before torch wrapped the optimizer class's `step` to call them, which an optimizer that
    skips Optimizer.__init__ (timm's Lookahead) has until its first zero_grad(). accelerate's AcceleratedOptimizer
    with a GradScaler (fp16) keeps the bound `step` it finds at `prepare` and steps through it (and leaves it on the
    optimizer after a step); a torch or MMEngine lr scheduler replaces the optimizer's `step` by a function that
    calls the class's step function of that moment. Either way a step pre-hook registered later never runs there.

    Returns:
        "<type>.<attribute>" of each such method (empty: every step the wrappers take runs the hooks).
    """
    chain = wrapper_chain(optimizer)
    inner = chain[-1]
    return [f"{type(obj).__name__}.{name}" for obj in chain for name, value in getattr(obj, "__dict__", {}).items()
            if calls_no_hooks(value, inner, own_step=obj is inner and name == "step")]


def unhooked_step_text(where: str, optimizer: torch.optim.Optimizer) -> str:
    """The start of the refusal of an unhooked `step` (`where`, from steps_without_hooks) of `optimizer`, shared by
    `ColinearityDecay.attach` and the integrations (each adds its own fix)."""
    name = type(optimizer).__name__
    return (f"{where} is a `step` of {name} taken before torch made its class's step call step hooks ({name} skips "
            f"Optimizer.__init__, as timm's Lookahead does")


def calls_no_hooks(value: Any, inner: torch.optim.Optimizer, own_step: bool = False) -> bool:
    """`value` is a `step` of `inner` that bypasses its step hooks: a bound `step` of it whose function is one of
    its class's step functions not marked `hooked` by torch (`class_steps_without_hooks`), or (`own_step`: `value`
    is inner's own `step` attribute) a wrapper of one (an lr scheduler's, torch.compile's: functools.wraps, whose
    `__wrapped__` leads to it and which copies the mark). Any other function (a user's own `step` that forwards to
    the optimizer's) is not known to bypass the hooks, so it is not reported."""
    unhooked = class_steps_without_hooks(inner)
    for _ in range(8):  # the wrappers around it, outermost first
        if getattr(value, "hooked", False):
            return False
        if inspect.ismethod(value):
            return value.__self__ is inner and any(value.__func__ is f for f in unhooked)
        if any(value is f for f in unhooked):
            return own_step
        if not own_step or getattr(value, "__name__", None) != "step" or not hasattr(value, "__wrapped__"):
            return False
        value = value.__wrapped__
    return False


def class_steps_without_hooks(optimizer: Any) -> list:
    """The functions of `optimizer`'s class `step` that call no step hooks: the class's step and the functions it
    wraps (`__wrapped__`: torch.no_grad and other functools.wraps decorators) before torch wraps it for hooks, the
    ones under torch's wrapper (marked `hooked`) after. A step taken from one of them skips the hooks for good."""
    found, func = [], getattr(type(optimizer), "step", None)
    for _ in range(8):
        if func is None:
            break
        if not getattr(func, "hooked", False):
            found.append(func)
        func = getattr(func, "__wrapped__", None)
    return found


# the code of torch's wrapper that makes an optimizer class's `step` call the step hooks (one for every class)
_HOOKED_STEP_CODE = torch.optim.Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__


def steps_under_way() -> Iterator[object]:
    """The optimizers whose (hook-calling) step is under way in this thread, innermost first. Read from the calls
    under way, so that a step that raised leaves nothing behind."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _HOOKED_STEP_CODE:
            yield frame.f_locals.get("self")
        frame = frame.f_back


def in_outer_step(optimizer: torch.optim.Optimizer) -> bool:
    """A step hook of `optimizer` runs inside another step of it: a subclass's `step` calling super().step(), where
    torch has wrapped both classes' steps to call the hooks (the parent's at any instance's Optimizer.__init__),
    runs them twice per step."""
    return sum(under_way is optimizer for under_way in steps_under_way()) > 1


def closure_then(args: tuple, kwargs: dict, after_first_call: Callable[[], None]) -> Optional[tuple[tuple, dict]]:
    """For a step pre-hook (torch passes step's own arguments: args = (optimizer, closure?), kwargs): the step's
    (args, kwargs) with its closure replaced by one that calls `after_first_call()` right after the closure's first
    call returns, or None when the step has no closure. A closure runs the forward and backward inside the step
    (`optimizer.step(closure)`; Lightning's adds its `on_before_optimizer_step` hooks and the gradient clipping), so
    the gradient a step-time update needs exists only then, still before the optimizer reads the weights. Once per
    step, also for optimizers that call the closure again (LBFGS)."""
    closure = kwargs["closure"] if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    if closure is None:
        return None
    calls = 0

    def closure_then_update():
        nonlocal calls
        loss = closure()
        calls += 1
        if calls == 1:
            after_first_call()
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_update}
    return (args[0], closure_then_update, *args[2:]), kwargs
