"""TWEO, the activation-regularization baseline CD is compared with (paper App. A.3 ("TWEO Background")).

    L_total = L_task + lam(t) * L_TWEO,   L_TWEO = (1/L) sum_l mean( (|A_l| / (tau + eps))^p )

A_l is the output of the l-th Transformer block (the residual stream after attention and MLP): timm
ViT/DeiT `blocks.N`, Swin `layers.N.blocks.M`, GPT-2 `transformer.h.N` (transformers, nanoGPT), the blocks of
every layout `cd.pairs.find_blocks` is given (`layouts=`, by default the built-in `cd.LAYOUTS`); not patch
merging, not the final norm. A block that returns a tuple gives its first element when that has the shape of the
block's input (transformers 4.x layers), and any other output is a TypeError naming the block
(`cd.pairs.residual_stream`). The mean runs
over batch x tokens x channels. Defaults p=4, tau=3, eps=1e-6; lam(t) is constant or a cosine from
lam to 0 over the run. The "rescaled" variant (used by the paper for fine-tuning and detection)
multiplies the term by detach(|L_task| / L_TWEO), so its value is lam(t) * |L_task|.
Readings of App. A.3, which gives no formula for these: its E[.] is the mean over all elements (as in TWEO
itself), its "optional cosine schedule" a decay to 0, and "rescaled ... to match the magnitude of the main
task loss" the detached ratio above.

    tweo = TWEO(model, lam=0.01)                   # forward hooks on every block, kept for the run
    loss = criterion(model(x), y)
    loss = loss + tweo.aux_loss(loss, step)        # step = optimizer-update index, for the schedule
    ...
    tweo.remove()                                  # or: with TWEO(model, ...) as tweo: ...

Block outputs are captured only in training forwards with grad enabled (never at evaluation). Each block's term is
computed in the hook, in fp32 even under fp16/bf16 autocast (fp16 (|A|/3)^4 overflows beyond |A| = 48), by a custom
autograd function that saves only the block output itself. Where the next layer saves that same tensor anyway (the next
block's LayerNorm, the final norm: timm's ViT, GPT-2), the penalty adds no activation memory; where it saves a copy
instead, the output is kept for TWEO alone: timm's Swin keeps the output of the last block of each stage before a
PatchMerging, which normalizes a permuted copy (+4.02 MiB on 203.6 MiB of saved activations, 2.0 %, for
swin_tiny_patch4_window7_224 at 224 px, batch 2, fp32; `python scripts/tweo_memory.py` measures it,
docs/measurements.md).
`form="plain"` computes the same value with ordinary autograd ops instead (`plain_tweo_penalty`), which
keep their fp32 intermediates for the backward pass: memory that grows with the batch, as the paper's
efficiency figure (Fig. 2) shows for TWEO; the paper does not say how its TWEO was written, so that it was
timed in this form is our reading (scripts/bench_overhead.py compares both).
"""
from __future__ import annotations

import math
import numbers
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from .layouts import LAYOUTS, Layout, check_layouts
from .pairs import find_blocks, residual_stream
from .unknown_blocks import unknown_blocks
from .update import align_to_task_loss, compute_dtype
from .wrappers import unwrap_model

SCHEDULES = ("constant", "cosine")
FORMS = ("memory_saving", "plain")
TAU, EPS = 3.0, 1e-6  # TWEO's magnitude scale and its epsilon where none is given


def _window_dtype(device: torch.device) -> torch.dtype:
    """The dtype TWEO sums the log window's penalties in on `device`: float64, where a sum of float32 penalties is
    exact (while they span less than 2^(29 - log2 n) in magnitude, n forwards), so it does not depend on the order of
    the additions, which a resume under DDP changes (`TWEO.load_window_state`). MPS has no float64: there float32, as
    the penalty itself, so that `TWEO` (a public API, called in users' own loops) runs on Apple GPUs, its window's
    sum then exact only up to float32 rounding."""
    return torch.float32 if device.type == "mps" else torch.float64


class _PowerMean(torch.autograd.Function):
    """mean((|a| * k)^p) in fp32, saving only `a` (no fp32 or |a|^p copies kept for backward)."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, p: float, k: float) -> Tensor:
        ctx.save_for_backward(a)
        ctx.p, ctx.k = p, k
        return a.detach().to(compute_dtype(a)).abs().mul_(k).pow_(p).mean()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None]:
        (a,) = ctx.saved_tensors
        p, k = ctx.p, ctx.k
        af = a.to(compute_dtype(a))
        # d/da mean((|a| k)^p) = p k (|a| k)^(p-1) sign(a) / numel
        g = af.abs().mul_(k).pow_(p - 1).mul_(af.sign()).mul_(grad.to(af.dtype) * (p * k / a.numel()))
        return g.to(a.dtype), None, None


def tweo_penalty(a: Tensor, p: float = 4.0, tau: float = 3.0, eps: float = 1e-6) -> Tensor:
    """One block's TWEO term mean((|a| / (tau + eps))^p), fp32, differentiable w.r.t. `a`.

    Args:
        a: block output of any shape and float dtype (e.g. (B, N, D) for ViT, (B, H, W, C) for Swin).
        p: exponent (>= 1). tau: magnitude scale. eps: keeps tau + eps > 0.

    Returns:
        0-dim fp32 tensor (float64 for a float64 `a`).
    """
    return _PowerMean.apply(a, float(p), 1.0 / (tau + eps))


def plain_tweo_penalty(a: Tensor, p: float = 4.0, tau: float = 3.0, eps: float = 1e-6) -> Tensor:
    """The same term as `tweo_penalty` written as plain autograd ops, as a direct implementation of
    App. A.3's L_TWEO would be: autograd keeps the fp32 copy of `a` and (|a| / (tau + eps))^(p-1) for the
    backward pass, about two fp32 copies of every block output."""
    return (a.to(compute_dtype(a)).abs() / (tau + eps)).pow(p).mean()


def _check_types(lam: object, p: object, tau: object, eps: object, total_steps: object, rescale: object) -> None:
    """Refuse settings of the wrong type before their values are compared: a bool is an int in Python (lam=True
    would be 1.0, total_steps=True a schedule of one step), a string is no number (its comparison fails with a
    TypeError naming no setting) and a string switch such as rescale='false' is true. Raises ValueError."""
    for name, value in (("lam", lam), ("p", p), ("tau", tau), ("eps", eps)):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ValueError(f"tweo {name} must be a real number, got {value!r} ({type(value).__name__})")
    if total_steps is not None and (not isinstance(total_steps, numbers.Integral) or isinstance(total_steps, bool)):
        raise ValueError(f"tweo total_steps must be a positive integer (optimizer updates of the run) or None, got "
                         f"{total_steps!r} ({type(total_steps).__name__})")
    if not isinstance(rescale, bool):
        raise ValueError(f"tweo rescale must be True or False, got {rescale!r} ({type(rescale).__name__}; a string "
                         f"such as 'false' would count as true)")


def adds_nothing(lam: object) -> bool:
    """Whether TWEO at peak strength `lam` trains as without it: lam 0 adds 0 x its term at every step, whatever the
    schedule, the rescale, the penalty's shape or its form, a term and gradients of zeros (a penalty past float32's
    range would make 0 x inf a NaN loss, which stops train.py's training: engine/loop.py NonFiniteLossError), so that
    configs/debug/tiny.yaml trained with tweo.lam=0 ends with the baseline's weights
    (tests/test_method_of_a_training_that_changes_nothing.py). A value that is no number is not 0."""
    return isinstance(lam, numbers.Real) and not isinstance(lam, bool) and lam == 0


def check_tweo_settings(lam: object, p: object, tau: object, eps: object, schedule: object, total_steps: object,
                        rescale: object, form: object) -> None:
    """Refuse TWEO settings that cannot run, without a model: what `TWEO` checks first, for the integrations to
    check when they are built (a hook in a Runner's config) rather than when training starts. `tau` and `eps`
    None: the defaults (TAU, EPS). Raises ValueError naming the setting."""
    tau, eps = TAU if tau is None else tau, EPS if eps is None else eps
    if form not in FORMS:
        raise ValueError(f"tweo form must be one of {FORMS}, got {form!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"tweo schedule must be one of {SCHEDULES}, got {schedule!r}")
    _check_types(lam=lam, p=p, tau=tau, eps=eps, total_steps=total_steps, rescale=rescale)
    if schedule == "cosine" and not (total_steps is not None and total_steps > 0):
        raise ValueError("tweo schedule 'cosine' needs total_steps > 0 (optimizer updates of the run)")
    # the constant schedule never reads it: a run length given with it was meant for a cosine that does not run
    if schedule != "cosine" and total_steps is not None:
        raise ValueError(f"tweo total_steps={total_steps} sets the length of schedule 'cosine'; the schedule is "
                         f"{schedule!r}: drop total_steps or set schedule='cosine'")
    # NaN passes every comparison: checked as not finite, or the loss would be NaN from the first step
    if not all(math.isfinite(v) for v in (lam, p, tau, eps)) or p < 1 or tau + eps <= 0 or lam < 0:
        raise ValueError(f"tweo needs finite p >= 1, tau + eps > 0, lam >= 0; "
                         f"got p={p}, tau={tau}, eps={eps}, lam={lam}")


def check_scale_read(who: str, rescale: bool, tau: Optional[float], eps: Optional[float]) -> None:
    """Refuse `tau` or `eps` given (not None) beside rescale=True, where nothing reads them: the rescaled term
    lam * P * detach(|L| / P) has the gradient lam * |L| * grad(P) / P, from which P's factor (tau + eps)^-p
    cancels, so they would change only the logged penalty (train.py refuses `tweo.tau` beside `tweo.rescale=true`
    alike). `who` names the entry point in the message.

    Raises:
        ValueError: naming the settings given, why they would be ignored and the fix.
    """
    given = {key: value for key, value in (("tau", tau), ("eps", eps)) if value is not None}
    if not rescale or not given:
        return
    shown, keys = ", ".join(f"{key}={value!r}" for key, value in given.items()), " and ".join(given)
    one = len(given) == 1
    raise ValueError(f"{who} {shown} would be ignored: {keys} {'is' if one else 'are'} read only when "
                     "rescale=False (the rescaled term's gradient lam * |L_task| * grad(P) / P does not "
                     f"depend on {'it' if one else 'them'}), and here rescale=True; drop {keys}, or give "
                     "rescale=False")


class TWEO:
    """TWEO auxiliary loss on block outputs, through forward hooks kept for the run.

    Args:
        model: the model (possibly DDP/torch.compile-wrapped); hooks go on its pre-norm blocks.
        lam: peak weight lambda.
        p, tau, eps: penalty exponent, magnitude scale and its epsilon; tau and eps None (the default): 3.0 and
            1e-6 (TAU, EPS). The rescaled form does not read tau and eps: given with rescale=True, refused.
        schedule: 'constant' or 'cosine' (lam(t) = lam * (1 + cos(pi * t / total_steps)) / 2, 0 after).
        total_steps: number of optimizer updates of the run (needed for 'cosine', refused for 'constant').
        rescale: multiply the term by detach(|task_loss| / penalty) before lam (the "rescaled" variant).
        form: 'memory_saving' (`tweo_penalty`, the default) or 'plain' (`plain_tweo_penalty`): the same
            value and gradient, different activation memory.
        layouts: the block layouts whose blocks are hooked (`cd.pairs.find_blocks`): default the built-in
            `cd.LAYOUTS`; a model with names of its own gives its own `cd.Layout`s, as to `ColinearityDecay`.

    Raises:
        ValueError: naming the setting: lam, p, tau or eps not a real number (a bool, a string) or out of range,
            total_steps not an integer (a bool), not > 0 for 'cosine' or given for 'constant', rescale not a bool,
            tau or eps given beside rescale=True (`check_scale_read`), an unknown schedule or form, or no pre-norm
            block in the model; an UnsupportedModelError (a ValueError) for a block under names no layout has
            beside the blocks found (`cd.pairs.find_blocks`), which would get no term.
    """

    def __init__(self, model: nn.Module, lam: float = 0.01, p: float = 4.0, tau: Optional[float] = None,
                 eps: Optional[float] = None, schedule: str = "constant", total_steps: Optional[int] = None,
                 rescale: bool = False, form: str = "memory_saving", layouts: Sequence[Layout] = LAYOUTS) -> None:
        check_tweo_settings(lam=lam, p=p, tau=tau, eps=eps, schedule=schedule, total_steps=total_steps,
                            rescale=rescale, form=form)
        check_scale_read("TWEO", rescale, tau, eps)
        tau, eps = TAU if tau is None else tau, EPS if eps is None else eps
        self.lam, self.p, self.tau, self.eps = float(lam), float(p), float(tau), float(eps)
        self.schedule, self.total_steps, self.rescale, self.form = schedule, total_steps, rescale, form
        self._penalty = tweo_penalty if form == "memory_saving" else plain_tweo_penalty
        layouts = check_layouts(layouts)

        self.blocks = find_blocks(model, layouts)
        if not self.blocks:
            tried = ("norm1/attn/norm2/mlp, or the same parts under another library's names: cd.LAYOUTS; a model "
                     "with names of its own gives layouts=[cd.Layout(...)]" if layouts is LAYOUTS else
                     "of the layouts given: " + "; ".join(lay.describe() for lay in layouts))
            # the module that is a block by its structure, named as find_pairs names it: a block of names of one's
            # own is told apart from a model without blocks (a ConvNeXt)
            block = next(unknown_blocks(unwrap_model(model), ()), None)
            seen = (f"; its module '{block[0]}' ({type(block[1]).__name__}) holds a Transformer block's parts "
                    f"({block[2]}) under names no layout tried has" if block is not None else "")
            raise ValueError(f"TWEO: no pre-norm Transformer block ({tried}) in {type(model).__name__}{seen}")
        self._terms: list[Tensor] = []  # per-block terms of the latest training forward
        # L_TWEO of the forwards since the last `metrics()` (sum, count), and the mean that call gave
        self._window_sum: Optional[Tensor] = None
        self._window_count = 0
        self._last_penalty: Optional[float] = None
        self._last_lam: Optional[float] = None
        root = unwrap_model(model)
        # A new forward starts a new set of terms: no growth if aux_loss is not called after some forward.
        self._handles = [root.register_forward_pre_hook(self._reset)]
        # with kwargs: a block given the stream by keyword still has its input compared with a tuple's first element
        self._handles += [block.register_forward_hook(partial(self._capture, name), with_kwargs=True)
                          for name, block in self.blocks]

    @classmethod
    def from_config(cls, cfg_tweo: Any, model: nn.Module, total_steps: Optional[int] = None) -> "TWEO":
        """Build from a `TWEOConfig` (lam, p, tau, eps, schedule, rescale, form);
        `enabled` is the trainer's switch. `total_steps`, the run's length that a trainer knows whatever the
        schedule, is passed on for schedule 'cosine' only (the constant schedule refuses one). Beside rescale,
        tau and eps at their defaults are the config's fill-ins, not settings, and are left out; others are passed
        on, for TWEO to refuse (load_config refuses them first; a TWEOConfig made in code does not)."""
        tau = None if cfg_tweo.rescale and cfg_tweo.tau == TAU else cfg_tweo.tau
        eps = None if cfg_tweo.rescale and cfg_tweo.eps == EPS else cfg_tweo.eps
        return cls(model, lam=cfg_tweo.lam, p=cfg_tweo.p, tau=tau, eps=eps,
                   schedule=cfg_tweo.schedule, total_steps=total_steps if cfg_tweo.schedule == "cosine" else None,
                   rescale=cfg_tweo.rescale, form=cfg_tweo.form)

    def _reset(self, module: nn.Module, args: Any) -> None:
        self._terms = []

    def _capture(self, name: str, module: nn.Module, args: Any, kwargs: dict, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation / no-grad forwards are never penalized
        stream = residual_stream(name, module, args, output, kwargs)
        self._terms.append(self._penalty(stream, self.p, self.tau, self.eps))

    @property
    def pending(self) -> bool:
        """Whether block outputs of a training forward are captured and not yet consumed by `aux_loss`."""
        return bool(self._terms)

    def lam_at(self, step: int) -> float:
        """lambda(t) at optimizer update `step` (0-based)."""
        if self.schedule == "constant":
            return self.lam
        t = min(max(step, 0), self.total_steps) / self.total_steps
        return self.lam * 0.5 * (1.0 + math.cos(math.pi * t))

    def aux_loss(self, task_loss: Tensor, step: int = 0) -> Tensor:
        """The term to add to the task loss for the latest training forward: lam(step) * L_TWEO (or rescaled).

        Args:
            task_loss: 0-dim task loss of the same forward (used by the rescaled variant only).
            step: optimizer-update index for the schedule.

        Returns:
            0-dim fp32 tensor.
        """
        if not self._terms:
            raise RuntimeError("TWEO.aux_loss: no block output captured; call it after a training-mode "
                               "forward with grad enabled (and before remove()). Blocks under reentrant activation "
                               "checkpointing (torch.utils.checkpoint(use_reentrant=True), timm's "
                               "set_reentrant_ckpt(True)) run that forward without grad: checkpoint with "
                               "use_reentrant=False")
        # (1/L) sum_l over the blocks, on the task loss's device: a model split over devices (transformers'
        # device_map="auto", through the integrations) has each block's term on its block's device
        penalty = torch.stack([term.to(task_loss.device) for term in self._terms]).mean()
        self._terms = []
        lam = self.lam_at(step)
        # summed on its device (no host sync per forward), in float64 where the device has it (`_window_dtype`)
        detached = penalty.detach().to(_window_dtype(penalty.device))
        # .to: a sum carried by `load_window_state` lies on the hooked blocks' device, which is not the task loss's
        # in a model split over devices (a no-op where it is)
        self._window_sum = detached if self._window_sum is None else self._window_sum.to(detached.device) + detached
        self._window_count += 1
        self._last_lam = lam
        return lam * (align_to_task_loss(penalty, task_loss) if self.rescale else penalty)

    def metrics(self, sum_fn: Optional[Callable[[Tensor], Tensor]] = None) -> dict[str, float]:
        """tweo/penalty: the mean L_TWEO (before lam) over the training forwards since the last call (every
        micro-batch of a logging window; the previous call's value if there was none since), and tweo/lam: the
        last lam(t); empty before aux_loss.

        Args:
            sum_fn: a distributed SUM all-reduce (`torch.distributed.all_reduce` in place, returning the tensor)
                to make the mean over every rank's forwards, as a trainer's loss is; every rank must call
                `metrics` together then. None: this process's forwards only.
        """
        penalty_sum, count = self._window_totals(sum_fn)
        if count:
            self._last_penalty = penalty_sum / count
        self._window_sum, self._window_count = None, 0
        if self._last_penalty is None:
            return {}
        return {"tweo/penalty": self._last_penalty, "tweo/lam": float(self._last_lam)}

    def window_state(self, sum_fn: Optional[Callable[[Tensor], Tensor]] = None) -> dict:
        """What the next `metrics()` would average (the forwards since the last call; over every rank with `sum_fn`,
        which every rank then calls together, as for `metrics`) and the last values: what a trainer's checkpoint
        written between two log steps keeps, so that the resumed run's next `metrics()` is the one of a run never
        stopped (`load_window_state`)."""
        penalty_sum, count = self._window_totals(sum_fn)
        return {"penalty_sum": penalty_sum, "count": count, "last_penalty": self._last_penalty,
                "last_lam": self._last_lam}

    def load_window_state(self, state: dict, keep_sums: bool = True, forwards: Optional[int] = None) -> None:
        """Go on from `window_state`'s `state`. `keep_sums`: this process takes the sums (the main rank, the others
        starting from 0, so that their sum over the ranks is the window's); the last values are taken either way.
        The sum goes on the hooked blocks' device, where `sum_fn` reduces it; the next forward adds to it on the task
        loss's (`aux_loss`).
        `forwards`: the forwards (over all ranks) this run makes in the updates the window carries, where a trainer
        knows it (its micro-batches per update x those updates); None: as the window counted them."""
        if keep_sums and state["count"]:
            device = self._device()
            penalty_sum, count = float(state["penalty_sum"]), int(state["count"])
            if forwards and count != forwards:
                # written with the global batch in other micro-batches (another per-process batch, e.g. on another
                # process count): tweo/penalty, the mean over the forwards, would weigh each update by its number of
                # forwards; the carried updates count as many as this run's do (their mean penalty kept), as the
                # trainer's train/loss (engine/loop.py _Window.carry_on)
                penalty_sum, count = penalty_sum * forwards / count, forwards
            self._window_sum = torch.tensor(penalty_sum, dtype=_window_dtype(device), device=device)
            self._window_count = count
        self._last_penalty, self._last_lam = state["last_penalty"], state["last_lam"]

    def _device(self) -> torch.device:
        """The hooked blocks' device (that of their first parameter or buffer; CPU for a block of neither)."""
        for _, block in self.blocks:
            for tensor in [*block.parameters(), *block.buffers()]:
                return tensor.device
        return torch.device("cpu")

    def _window_totals(self, sum_fn: Optional[Callable[[Tensor], Tensor]]) -> tuple[float, float]:
        """(sum, count) of L_TWEO over the window's forwards, over every rank with `sum_fn`. With `sum_fn` every
        rank all-reduces, also one of no forward since (zeros): whether a rank joins must not hang on its own
        count, which differs between ranks after a resume (`load_window_state` gives the carried sums to one)."""
        # in the sum's dtype (`_window_dtype`) on every rank: the ranks' tensors must agree in dtype (the zeros of a
        # rank of no forward too)
        if self._window_count:
            totals = torch.stack([self._window_sum, self._window_sum.new_tensor(float(self._window_count))])
        elif sum_fn is not None:
            device = self._device()
            totals = torch.zeros(2, dtype=_window_dtype(device), device=device)
        else:
            return 0.0, 0.0
        penalty_sum, count = (sum_fn(totals) if sum_fn is not None else totals).tolist()
        return penalty_sum, count

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._terms = []

    def __repr__(self) -> str:
        """The settings that act (a trainer's log line, as ColinearityDecay's): the hooked blocks (their count, the
        first and the last), lam, p, tau and eps, or rescale (its ratio cancels the (tau + eps)^-p factor, so they
        do not act), the schedule (its length for 'cosine') and the form."""
        names = [name for name, _ in self.blocks]
        blocks = f"{len(names)} [{names[0]}{f' .. {names[-1]}' if len(names) > 1 else ''}]"
        scale = "rescale=True" if self.rescale else f"tau={self.tau}, eps={self.eps}"
        length = f", total_steps={self.total_steps}" if self.schedule == "cosine" else ""
        return (f"TWEO(blocks={blocks}, lam={self.lam}, p={self.p}, {scale}, schedule={self.schedule!r}{length}, "
                f"form={self.form!r})")

    def __enter__(self) -> "TWEO":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()
