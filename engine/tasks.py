"""What differs between the tasks the engine trains: the loss, the validation metric, and how a result reads.

    task = task_for(cfg.data.dataset)      # ClassificationTask() or CausalLMTask()
    criterion = task.criterion(cfg.data.label_smoothing, mixup)   # (logits, targets) -> loss
    metrics = task.evaluate(model, loader, device, amp)     # {"top1", ...} or {"loss", "ppl", ...}

Everything else (the update loop, AMP, DDP, accumulation, resume, preemption, checkpoints, metrics, CD,
TWEO, activation maxima) is one engine for all tasks. The data set decides the task: image data sets
train a classifier, token streams (data/text.py: `tokens`, `kjv`) a causal language model. The model
and the data are built by their packages (`models.build_model`, `data.build_loaders` /
`data.build_token_loaders`); a task only names which.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

from configs import ConfigError
from models import is_language_model

from .distributed import all_reduce
from .loop import EvalBatches, NonFiniteLossError, NothingScoredError
from .loop import evaluate as evaluate_classifier
from .precision import autocast

LANGUAGE_DATASETS = ("tokens", "kjv")  # data/text.py TOKEN_DATASETS (engine does not import data/)
# exp() of a mean loss past 709.78 nats overflows a float (a collapsed model's loss reaches 1e5): the
# perplexity is recorded as exp(700) from there (the loss beside it is exact) and always printed as that bound
PPL_CAP_LOSS = 700.0
PPL_CAP = math.exp(PPL_CAP_LOSS)


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(PPL_CAP_LOSS)."""
    return math.exp(min(loss, PPL_CAP_LOSS))


def perplexity_text(ppl: float) -> str:
    """A perplexity as text: two decimals, or '>= exp(700) (capped)' for the cap (a finite-looking 305-digit number
    would hide that the real value overflowed)."""
    return f"{ppl:.2f}" if ppl < PPL_CAP else f">= exp({PPL_CAP_LOSS:.0f}) (capped)"


def capped_cell(values: Sequence[float]) -> Optional[str]:
    """The text of a table cell of perplexities (seeds) when one is at the cap: that bound, as a mean of it would
    be no number; None when none is."""
    return perplexity_text(max(values)) if values and max(values) >= PPL_CAP else None


class ClassificationTask:
    """Images -> class logits; best.pt keeps the highest val top-1."""

    name = "classification"
    language = False
    score_key, higher_is_better = "val/top1", True

    @staticmethod
    def criterion(label_smoothing: float, mixup: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """DeiT's choice: soft-target CE with mixup (smoothing inside Mixup), else label-smoothing CE; on float32
        (float64) logits, whatever autocast made them."""
        if mixup:
            return _on_float32_logits(SoftTargetCrossEntropy())
        if label_smoothing > 0:
            return _on_float32_logits(LabelSmoothingCrossEntropy(smoothing=label_smoothing))
        return nn.CrossEntropyLoss()

    def evaluate(self, model: nn.Module, loader, device: torch.device, amp: str = "none", progress: str = "",
                 should_stop: Optional[Callable[[], bool]] = None) -> Optional[dict]:
        return evaluate_classifier(model, loader, device, amp, progress=progress, should_stop=should_stop)

    @staticmethod
    def describe(val: dict) -> str:
        top5 = f" (top-5 {val['val/top5']:.2f}%)" if "val/top5" in val else ""  # more than 5 classes only
        return f"val top-1 {val['val/top1']:.2f}%{top5} on {val['val/count']} images"

    @staticmethod
    def score_text(value: float) -> str:
        return f"val top-1 {value:.2f}%"


def _on_float32_logits(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                       ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`loss` of fp16 / bf16 logits taken in float32. timm's smoothing and soft-target losses are log_softmax and a
    sum, which CUDA's autocast runs in float32 but the CPU's does not: a CPU run under train.amp=bf16 computed the
    loss it trains on and logs in bf16 (11.125 for 11.1556 with 1,000 classes), where nn.CrossEntropyLoss (in the
    CPU autocast's float32 list) and a GPU run take float32."""
    return lambda logits, targets: loss(logits.float() if logits.dtype in (torch.float16, torch.bfloat16)
                                        else logits, targets)


class CausalLMTask:
    """Token ids -> next-token logits; the loss is the mean cross-entropy over every position (nanoGPT);
    best.pt keeps the lowest val loss (= the lowest perplexity)."""

    name = "causal_lm"
    language = True
    score_key, higher_is_better = "val/loss", False

    @staticmethod
    def criterion(label_smoothing: float = 0.0, mixup: bool = False
                  ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Mean cross-entropy of (B, T, V) logits against (B, T) next ids (no smoothing, no mixing)."""
        return lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def evaluate(self, model: nn.Module, loader, device: torch.device, amp: str = "none", progress: str = "",
                 should_stop: Optional[Callable[[], bool]] = None) -> Optional[dict]:
        return evaluate_language_model(model, loader, device, amp, progress=progress, should_stop=should_stop)

    @staticmethod
    def describe(val: dict) -> str:
        return (f"val loss {val['val/loss']:.4f} (perplexity {perplexity_text(val['val/ppl'])}) on {val['val/count']} "
                f"windows")

    @staticmethod
    def score_text(value: float) -> str:
        return f"val loss {value:.4f} (perplexity {perplexity_text(perplexity(value))})"


def task_for(dataset: str):
    """The task a data set trains (see the module docstring)."""
    return CausalLMTask() if dataset in LANGUAGE_DATASETS else ClassificationTask()


@torch.no_grad()
def evaluate_language_model(model: nn.Module, loader, device: torch.device, amp: str = "none",
                            progress: str = "", should_stop: Optional[Callable[[], bool]] = None
                            ) -> Optional[dict]:
    """Mean next-token cross-entropy and perplexity over every position of every window of `loader`,
    summed over all ranks (each window on one rank: ShardedEvalSampler). `should_stop` as in
    engine.loop.evaluate: asked before every batch all ranks have; None when it says stop.

    Returns:
        {"loss" (nats per token), "ppl" (exp(loss), capped: `perplexity`), "count" (windows), "tokens"}.
    Raises NothingScoredError when no window was scored.
    """
    model.eval()
    sums = torch.zeros(4, device=device, dtype=torch.float64)  # summed loss, tokens, windows, failed ranks
    batches = EvalBatches(loader, device, progress, should_stop)
    for _, (ids, targets) in batches:
        ids, targets = ids.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast(amp, device):
            logits = model(ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
        # counts added as scalars: torch.tensor(..., device=cuda) is a blocking copy (a host sync per batch)
        sums[0] += loss.double()
        sums[1] += targets.numel()
        sums[2] += len(targets)
    if batches.stopped:
        return None
    sums[3] = float(batches.error is not None)
    all_reduce(sums)
    batches.raise_if_failed(sums[3].item())
    loss, tokens, windows, _ = sums.tolist()
    if not math.isfinite(loss):  # class of engine.loop.evaluate's check: never a perplexity of NaN
        raise NonFiniteLossError(f"{progress or 'evaluation'}: the loss over the validation windows is {loss}, so "
                                 "no perplexity can be computed and nothing is written; the weights (or the "
                                 "quantized model) produce non-finite logits (with fp16 autocast an overflow can: "
                                 "try none or bf16)")
    if tokens == 0:  # a perplexity of 1 over no token is no result (the same sums on every rank)
        raise NothingScoredError(f"{progress or 'evaluation'}: no token was scored: the data loader yielded no "
                                 "window; check the split and the window length (model.kwargs.context)")
    mean = loss / tokens
    return {"loss": mean, "ppl": perplexity(mean), "count": int(windows), "tokens": int(tokens)}


def check_model_fits_task(model: nn.Module, model_name: str, dataset: str) -> None:
    """A language model trains and scores on text, a vision model on images (train.py and evaluate.py)."""
    language = is_language_model(model)
    if language != task_for(dataset).language:
        raise ConfigError(f"model.name={model_name} is {'a language' if language else 'an image'} model, "
                          f"data.dataset={dataset} is {'images' if language else 'text'}: use a GPT size "
                          "(models/gpt.py) with dataset tokens or kjv, a vision model with the others")
