"""The TWEO baseline in MMEngine / MMDetection (paper Sec. "COCO Detection", App. A.3): `TweoHook`, enabled by
configuration alone (`cd.integrations.mmengine` imports this module):

    custom_imports = dict(imports=["cd.integrations.mmengine"], allow_failed_imports=False)
    custom_hooks = [dict(type="TweoHook", lam=1e-4)]

The penalty is `cd.tweo.TWEO` on the blocks of the detector's `backbone` (`module=` as in ColinearityDecayHook),
in its rescaled form by default: the paper rescales TWEO's term to the task-loss magnitude for detection and
tunes lambda in the 1e-4 range, so `rescale=True, lam=1e-4` (1e-4 is our choice within that range).

Where the term enters MMEngine's step (0.10): `model.train_step` runs data_preprocessor -> forward(mode="loss")
-> `parse_losses` -> `optim_wrapper.update_params(loss)` inside, and no hook event sits between the loss and the
backward. The hook wraps the model's `parse_losses` for the run (an instance attribute set at `before_train`,
removed at `after_train`) and adds `lam(t) * L_TWEO` (rescaled) to the loss it returns:
  - it is the one place that sees the whole task loss (the rescaled variant needs it) before any wrapper
    scales it, so every OptimWrapper type works unchanged: `update_params` divides the sum by the accumulation
    count, AmpOptimWrapper's GradScaler scales it, clipping sees its gradient, exactly as for the task loss;
  - MMEngine's DDP wrappers call `self.module.parse_losses`, the attribute of the unwrapped model it sets;
  - wrapping the OptimWrapper's `update_params`/`backward` instead would miss the log variables and be tied
    to one wrapper object (an OptimWrapperDict has several).
The term is added once per micro-batch (each has its own forward), and lam(t) reads t = runner.iter //
accumulative_counts, the index of the optimizer update the micro-batch belongs to (restored by resume with
runner.iter). That index holds for one accumulation count over the whole run: where the cosine schedule reads it,
a count that changes during training (a hook that sets the wrapper's, a wrapper replaced by one of another count)
or differs from the one that the resumed checkpoint's run trained with (saved in it under
"tweo_accumulative_counts") is refused, as t would no longer count the updates. The cosine's length where
`total_steps` is not given, ceil(max_iters / accumulative_counts), is that of the run's first start: saved in its
checkpoints ("tweo_total_steps") and kept by a resume that extends the run (a larger max_iters or max_epochs, which
scripts/train_detection.py allows), as MMEngine's param schedulers keep their configured ends; a length taken
again from the longer run would make lam(t) jump up at the resume (from 0 where the first length had ended) and
differ from the start's schedule at every update after it. lam(t) is then 0 past the first length (a warning
says so at the resume); give `total_steps` to the first start for a schedule over a longer run.
It is logged as `loss_tweo` (and the raw L_TWEO as `tweo_penalty`, lam(t) as `tweo_lam`) in the
step's log variables, which MMEngine puts in the message hub as `train/loss_tweo`; `loss` is the total.
A model whose `train_step` never calls `parse_losses` would train without TWEO: the hook then raises after the
iteration, as it does when blocks ran again after the term was added. Validation forwards (eval mode, no grad)
capture nothing and add nothing.
`rescale=True` refuses `tau` and `eps`: the rescaled term lam * P * detach(|L| / P) has the gradient
lam * |L| * grad(P) / P, from which P's factor (tau + eps)^-p cancels, so they would change only the logged
`tweo_penalty` (train.py refuses `tweo.tau` beside `tweo.rescale=true` alike).
MMEngine's `activation_checkpointing` (the Runner's config key) wraps each module it names in
torch.utils.checkpoint's reentrant form (MMEngine passes no use_reentrant): the module's forward runs without grad
and again, with grad, in the backward pass. A named module that strictly contains a penalized block would leave
that block out of L_TWEO and capture it after the loss, so `before_train` refuses it; a block named itself, or a
part inside one, keeps the block's forward hook outside the checkpoint (MMDetection's Swin `with_cp=True`
checkpoints inside each block), and the penalty and gradients stay those of a run without checkpointing.
MMEngine calls no hook when training raises: a failed run leaves its `parse_losses` and block hooks on the model.
The next TweoHook's `before_train` in another Runner on that model object removes them (a run that is over); two
TweoHooks in one Runner are refused. A run without the hook on such a model would still add the failed run's term:
call the failed run's `hook.after_train(runner)` first, which removes it.
"""
from __future__ import annotations

import inspect
import math
import warnings
import weakref
from typing import Any, Optional, Sequence

import torch
from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from ..layouts import LAYOUTS, check_layouts
from ..pairs import find_blocks
from ..tweo import TWEO, check_tweo_settings
from ..wrappers import unwrap_model
from . import check_module_name, select_module


ACCUM_KEY = "tweo_accumulative_counts"  # the run's accumulation count in its checkpoints (module doc)
LENGTH_KEY = "tweo_total_steps"  # the cosine's length the run's first start took from max_iters (module doc)


def accumulative_counts(optim_wrapper: Any) -> int:
    """The micro-batches per optimizer update of an OptimWrapper, or of every wrapper of an OptimWrapperDict
    (MMEngine keeps it in `_accumulative_counts`, with no public accessor)."""
    wrappers = list(optim_wrapper.optim_wrappers.values()) if hasattr(optim_wrapper, "optim_wrappers") \
        else [optim_wrapper]
    counts = {int(w._accumulative_counts) for w in wrappers}
    if len(counts) != 1:
        raise ValueError(f"the optim wrappers accumulate over different counts {sorted(counts)}: the optimizer-"
                         "update index of a micro-batch is ambiguous")
    return counts.pop()


def checkpointing_refusal(model: torch.nn.Module, names: Any, blocks: Sequence[torch.nn.Module]) -> Optional[str]:
    """The refusal of MMEngine's `activation_checkpointing` `names` (a module name or a list of them, resolved in the
    unwrapped `model` as MMEngine's Runner resolves them) where one names a module that strictly contains one of
    `blocks` (the blocks TWEO penalizes), or None. Names that resolve to no module are left to the Runner."""
    names = [names] if isinstance(names, str) else list(names or [])
    model = unwrap_model(model)
    penalized = {id(block) for block in blocks}
    for name in names:
        if not isinstance(name, str) or not name:
            continue
        try:  # through the wrappers of its parts too (MMSeparateDistributedDataParallel wraps each child, after
            part = select_module(model, name)  # MMEngine applied activation_checkpointing to the unwrapped model)
        except ValueError:
            continue
        if not isinstance(part, torch.nn.Module) or isinstance(part, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue  # a container list has no forward of its own: checkpointing it wraps nothing that runs
        inside = next((f"{name}.{inner}" for inner, m in part.named_modules() if inner and id(m) in penalized), None)
        if inside is not None:
            return (f"activation_checkpointing names {name}, which contains the block {inside} that TweoHook "
                    "penalizes: MMEngine checkpoints it with torch.utils.checkpoint's reentrant form, which runs its "
                    "forward without grad (L_TWEO would leave its blocks out) and again in the backward pass (after "
                    f"the loss); checkpoint the blocks themselves (activation_checkpointing=['{inside}', ...]) or "
                    "inside them (MMDetection's Swin: model.backbone.with_cp=True)")
    return None


@HOOKS.register_module()
class TweoHook(Hook):
    """TWEO's auxiliary loss on a part of an MMEngine model (the detector's backbone by default).

    Args:
        module: None (default) the `backbone` if the model has one, else the whole model; "" the whole model;
            or a dotted submodule name.
        lam: lambda_TWEO (default 1e-4, in the paper's detection range).
        rescale: the rescaled variant, term * detach(L_task / L_TWEO) (default True, the paper's detection form).
        total_steps: optimizer updates of the run, for `schedule="cosine"`; default: ceil(max_iters / accumulation)
            at the run's first start, kept by a resume (module doc).
        **tweo_kwargs: TWEO's other arguments (`p`, `tau`, `eps`, `schedule`, `form`, `layouts`); `tau` and `eps`
            only with rescale=False (the rescaled form's gradient does not depend on them: refused).

    Attributes:
        tweo: the `TWEO` object, from `before_train` on (`tweo.blocks`, `tweo.metrics()`).
    """

    priority = "NORMAL"

    def __init__(self, module: Optional[str] = None, lam: float = 1e-4, rescale: bool = True,
                 total_steps: Optional[int] = None, **tweo_kwargs: Any) -> None:
        # lam and total_steps are checked by check_tweo_settings below, so the hook takes exactly what TWEO takes
        # (numpy numbers included, bools refused); rescale's test is TWEO's too, with the hook's own words
        if not isinstance(rescale, bool):
            raise ValueError(f"rescale must be True or False, got {rescale!r}")
        if "model" in tweo_kwargs:
            raise TypeError("TweoHook takes `module=` (the part of the runner's model), not `model=`")
        try:
            bound = inspect.signature(TWEO).bind(None, **tweo_kwargs)
        except TypeError as e:
            raise TypeError(f"TweoHook: TWEO arguments: {e}") from None
        bound.apply_defaults()
        given = bound.arguments
        # the values TWEO refuses, now rather than in before_train (after the model, data and work_dir are made);
        # total_steps left None for 'cosine' is the hook's max_iters / accumulation, so a placeholder of 1 here
        # (only for None: a total_steps of 0 is refused, not read as the run's length)
        steps = 1 if total_steps is None and given["schedule"] == "cosine" else total_steps
        check_tweo_settings(lam=lam, p=given["p"], tau=given["tau"], eps=given["eps"], schedule=given["schedule"],
                            total_steps=steps, rescale=rescale, form=given["form"])
        ignored = [key for key in ("tau", "eps") if key in tweo_kwargs]
        if rescale and ignored:  # the rescaled term's gradient does not depend on them (module doc)
            shown, keys = ", ".join(f"{key}={tweo_kwargs[key]!r}" for key in ignored), " and ".join(ignored)
            one = len(ignored) == 1
            raise ValueError(f"TweoHook {shown} would be ignored: {keys} {'is' if one else 'are'} read only when "
                             "rescale=False (the rescaled term's gradient lam * |L_task| * grad(P) / P does not "
                             f"depend on {'it' if one else 'them'}), and here rescale=True; drop {keys}, or give "
                             "rescale=False")
        if "layouts" in tweo_kwargs:  # checked now, as ColinearityDecayHook does; a config file's mappings made Layouts
            tweo_kwargs["layouts"] = check_layouts(tweo_kwargs["layouts"])
        self.module, self.total_steps = check_module_name(module, "TweoHook"), total_steps
        self.kwargs = dict(tweo_kwargs, lam=float(lam), rescale=rescale)
        self.tweo: Optional[TWEO] = None
        self._model: Optional[torch.nn.Module] = None
        self._step = 0
        self._armed = False
        self._added = False  # whether this iteration's parse_losses added the term
        self._accum: Optional[int] = None
        self._loaded_accum: Optional[int] = None  # the count that the loaded checkpoint's run trained with, if saved
        self._length: Optional[int] = None  # the cosine's length taken from max_iters, where total_steps is not given
        self._loaded_length: Optional[int] = None  # that of the loaded checkpoint's run, if saved

    def before_train(self, runner) -> None:
        self._unwrap_parse_losses()
        if self.tweo is not None:
            self.tweo.remove()
        accum = accumulative_counts(runner.optim_wrapper)
        total = self.total_steps or math.ceil(runner.max_iters / accum)
        if runner.iter > 0 and self._loaded_accum not in (None, accum) and self._reads_step():  # a resumed run
            raise ValueError(f"TweoHook: resuming at iteration {runner.iter} with optim_wrapper accumulative_counts="
                             f"{accum}, where the checkpoint's run accumulated over {self._loaded_accum}: the cosine "
                             "schedule's update index t = iteration // accumulative_counts would no longer count the "
                             f"run's updates; resume with accumulative_counts={self._loaded_accum}")
        self._accum = accum
        self._length = None if self.total_steps or not self._reads_step() else total
        if runner.iter > 0 and self._length is not None and self._loaded_length is not None:  # a resumed run
            if self._loaded_length != total:  # max_iters changed (an extended run): the first start's length stays
                warnings.warn(f"TweoHook: resuming at iteration {runner.iter} with max_iters={runner.max_iters}, the "
                              f"cosine schedule keeps the run's first length of {self._loaded_length} updates (lam(t) "
                              f"is 0 after it), not {total}; give total_steps to a new run for a schedule over "
                              "another length", stacklevel=2)
            total = self._length = self._loaded_length
        model = unwrap_model(runner.model)
        if "parse_losses" in vars(model):
            owner = getattr(vars(model)["parse_losses"], "tweo_run", None)  # (runner, TWEO) of the hook that set it
            if owner is None or owner[0]() is runner:
                raise RuntimeError("TweoHook: the model's parse_losses is already replaced on the instance (a "
                                   "second TweoHook?)")
            del vars(model)["parse_losses"]  # a failed run's (module doc)
            owner[1].remove()
        cfg = getattr(runner, "cfg", None)  # MMEngine has applied its activation_checkpointing by now
        refusal = self.checkpointing_refusal(model, cfg.get("activation_checkpointing") if cfg is not None else None)
        if refusal is not None:  # before any hook or wrapper is put on the model
            raise ValueError(refusal)
        cosine = self.kwargs.get("schedule", "constant") == "cosine"  # TWEO refuses a length for a constant lam
        self.tweo = TWEO(select_module(runner.model, self.module), total_steps=total if cosine else None,
                         **self.kwargs)
        original = model.parse_losses

        def parse_losses(losses):
            loss, log_vars = original(losses)
            if not self._armed:  # a parse_losses call outside a training iteration is left alone
                return loss, log_vars
            term = self.tweo.aux_loss(loss, self._step)
            self._added = True
            metrics = self.tweo.metrics()
            total_loss = loss + term
            log_vars["loss"] = total_loss
            log_vars["loss_tweo"] = term.detach()
            log_vars["tweo_penalty"] = loss.new_tensor(metrics["tweo/penalty"])  # on the loss's device
            log_vars["tweo_lam"] = loss.new_tensor(metrics["tweo/lam"])
            return total_loss, log_vars

        parse_losses.tweo_run = (weakref.ref(runner), self.tweo)
        model.parse_losses = parse_losses
        self._model = model

    def checkpointing_refusal(self, model: torch.nn.Module, names: Any) -> Optional[str]:
        """`checkpointing_refusal` of MMEngine's activation_checkpointing `names` for the blocks this hook penalizes
        in `model` (wrappers looked through): for a check of a config before its Runner is built, too."""
        blocks = find_blocks(select_module(model, self.module), self.kwargs.get("layouts", LAYOUTS))
        return checkpointing_refusal(model, names, [block for _, block in blocks])

    def _reads_step(self) -> bool:
        """Whether lam(t) depends on the update index t (the cosine schedule; the constant one never reads it)."""
        return self.kwargs.get("schedule", "constant") == "cosine"

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        # read at every iteration: a hook may set the count, or replace the wrapper, during training
        accum = accumulative_counts(runner.optim_wrapper)
        if accum != self._accum and self._reads_step():
            raise RuntimeError(f"TweoHook: the optim wrapper's accumulative_counts changed from {self._accum} to "
                               f"{accum} at iteration {runner.iter}: the cosine schedule's update index t = iteration "
                               "// accumulative_counts would no longer count the run's updates; keep one "
                               "accumulative_counts for the run, or use schedule='constant'")
        self._accum = accum
        self._step = runner.iter // accum  # the optimizer update this micro-batch belongs to
        self._armed = True
        self._added = False

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        self._armed = False
        if self.tweo is None or not self.tweo.pending:
            return
        if self._added:  # the term was added, and blocks ran again after it: most likely in the backward pass
            raise RuntimeError(f"TweoHook: block outputs were captured at iteration {runner.iter} after the TWEO "
                               "term was added, so they are not in it: blocks ran again after the model's "
                               "parse_losses, e.g. recomputed during the backward pass by reentrant activation "
                               "checkpointing of a module that contains them (torch.utils.checkpoint with "
                               "use_reentrant=True, which runs their first forward without grad, so L_TWEO left "
                               "them out); checkpoint the blocks themselves or inside them, or use "
                               "use_reentrant=False")
        raise RuntimeError(f"TweoHook: block outputs were captured at iteration {runner.iter} but the model's "
                           "parse_losses never ran, so no TWEO term was added (does the model override train_step "
                           "without calling parse_losses? or were the blocks recomputed during the backward pass "
                           "by reentrant activation checkpointing of a module that contains them?)")

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        if self._accum is not None:
            checkpoint[ACCUM_KEY] = self._accum  # a plain int: loads with weights_only
        if self._length is not None:
            checkpoint[LENGTH_KEY] = self._length

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        self._loaded_accum = checkpoint.get(ACCUM_KEY)  # compared in before_train, for a resumed run only
        self._loaded_length = checkpoint.get(LENGTH_KEY)  # kept in before_train, for a resumed run only

    def after_train(self, runner) -> None:
        self._unwrap_parse_losses()
        if self.tweo is not None:
            self.tweo.remove()

    def _unwrap_parse_losses(self) -> None:
        if self._model is not None:
            vars(self._model).pop("parse_losses", None)
            self._model = None
