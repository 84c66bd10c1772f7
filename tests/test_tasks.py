"""engine/tasks.py parts that the training and evaluation tests do not reach: the mixup loss, the capped
perplexity cell of no value, the failure flag a language-model evaluation carries to the other ranks, and the
task each data set trains."""
from __future__ import annotations

import math

import pytest
import torch

import engine.loop
import engine.tasks
from engine.distributed import OtherRankError
from engine.tasks import PPL_CAP, ClassificationTask, capped_cell, evaluate_language_model, perplexity
from models.gpt import build_gpt


def test_the_mixup_loss_is_cross_entropy_against_the_soft_targets():
    """With mixup the targets are class distributions (smoothing is inside Mixup): the loss is the batch mean of
    -sum_c t_c log p_c, written out, whatever data.label_smoothing says."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, dtype=torch.float64, generator=g)
    soft = torch.rand(4, 5, dtype=torch.float64, generator=g)
    soft /= soft.sum(-1, keepdim=True)
    logp = torch.log_softmax(logits, -1)
    want = sum(-sum(soft[i, c] * logp[i, c] for c in range(5)) for i in range(4)) / 4
    for smoothing in (0.0, 0.1):
        got = ClassificationTask.criterion(smoothing, mixup=True)(logits, soft)
        assert float(got) == pytest.approx(float(want), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mixup", [False, True])
def test_a_smoothed_or_mixup_loss_under_cpu_autocast_is_taken_in_float32(mixup, dtype):
    """The logits a classifier head gives under CPU autocast are bf16 / fp16; the loss it trains on and logs is the
    float32 one of those logits (as CUDA's autocast takes log_softmax, and as nn.CrossEntropyLoss is taken), not one
    rounded to bf16: against -(1 - s) log p_y - s mean_c log p_c (or -sum_c t_c log p_c), written out in float64."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 1000)
    features = 3 * torch.randn(64, 16, generator=g)
    labels = torch.randint(0, 1000, (64,), generator=g)
    soft = torch.rand(64, 1000, generator=g)
    soft /= soft.sum(-1, keepdim=True)
    with torch.autocast("cpu", dtype=dtype):
        logits = head(features)
        got = ClassificationTask.criterion(0.1, mixup=mixup)(logits, soft if mixup else labels)
    assert logits.dtype == dtype and got.dtype == torch.float32
    logp = torch.log_softmax(logits.double(), -1)
    want = (-(soft.double() * logp).sum(-1) if mixup else
            -0.9 * logp[torch.arange(64), labels] - 0.1 * logp.mean(-1)).mean()
    assert float(got) == pytest.approx(float(want), rel=1e-6)


def test_a_cell_of_no_perplexity_or_of_finite_ones_is_no_capped_cell():
    """capped_cell: the bound only when a value is at the cap; None for finite values and for no value."""
    assert perplexity(2.0) == math.exp(2.0) and perplexity(710.0) == PPL_CAP == math.exp(700.0)
    assert capped_cell([]) is None and capped_cell([4.0, 1e300]) is None
    assert capped_cell([4.0, perplexity(9e4)]) == ">= exp(700) (capped)"


class _FailsAtSecondBatch:
    """A loader of one window batch, then a batch that cannot be read (a missing file, a bad shard)."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.first = (torch.randint(0, 65, (2, 8), generator=g), torch.randint(0, 65, (2, 8), generator=g))

    def __len__(self):
        return 2

    def __iter__(self):
        yield self.first
        raise OSError("cannot read shard 1")


def test_a_language_model_evaluation_tells_the_other_ranks_that_a_batch_failed(monkeypatch):
    """Two ranks, simulated: the rank whose loader fails sends the failure flag (the 4th of the sums it
    all-reduces) and raises its own error; a rank whose loader was fine receives the flag in the sum and raises
    OtherRankError, never a perplexity over part of the windows."""
    model = build_gpt("gpt2_nano", vocab_size=65).eval()
    monkeypatch.setattr(engine.loop, "_world_and_rank", lambda: (2, 1))  # a batch error is carried, not raised
    sent = []

    def reduce_with(other):
        def all_reduce(t, op="sum"):
            sent.append(t.clone())
            return t.add_(torch.tensor(other, dtype=t.dtype))
        return all_reduce

    monkeypatch.setattr(engine.tasks, "all_reduce", reduce_with([0.0, 0.0, 0.0, 0.0]))
    with pytest.raises(OSError, match="cannot read shard 1"):
        evaluate_language_model(model, _FailsAtSecondBatch(), torch.device("cpu"))
    assert sent[-1][3].item() == 1.0  # what the other rank adds to its own sums
    # the other rank: its own batches loaded; the sum says one rank failed
    windows = [_FailsAtSecondBatch().first]
    monkeypatch.setattr(engine.tasks, "all_reduce", reduce_with([0.0, 0.0, 0.0, 1.0]))
    with pytest.raises(OtherRankError, match="could not load its batches"):
        evaluate_language_model(model, windows, torch.device("cpu"))
    assert sent[-1][3].item() == 0.0


class _RecordsAutocast(torch.nn.Module):
    """Logits of either task (B, C) from (B, 3) images or (B, T, C) from (B, T) ids, recording for each forward
    whether it ran under CPU autocast and in which dtype."""

    def __init__(self, language: bool):
        super().__init__()
        self.language, self.seen = language, []
        self.head = torch.nn.Embedding(7, 7) if language else torch.nn.Linear(3, 7)

    def forward(self, x):
        self.seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return self.head(x)


@pytest.mark.parametrize("task", [engine.tasks.ClassificationTask(), engine.tasks.CausalLMTask()],
                         ids=["classification", "causal_lm"])
def test_a_tasks_evaluation_runs_in_the_precision_and_stops_as_asked(task):
    """task.evaluate is what train.py validates with: train.amp reaches the forward (bf16 autocast here, fp32
    without one), and a stop request (preemption) gives None instead of numbers."""
    model = _RecordsAutocast(task.language)
    x = torch.randint(0, 7, (2, 4)) if task.language else torch.randn(2, 3)
    y = torch.randint(0, 7, (2, 4) if task.language else (2,))
    loader = [(x, y), (x, y)]
    assert task.evaluate(model, loader, torch.device("cpu"), amp="bf16") is not None
    assert model.seen == [torch.bfloat16] * 2
    model.seen.clear()
    assert task.evaluate(model, loader, torch.device("cpu")) is not None and model.seen == [None] * 2
    assert task.evaluate(model, loader, torch.device("cpu"), should_stop=lambda: True) is None


def test_a_bf16_language_model_evaluation_scores_its_logits_in_float():
    """Under bf16 autocast the logits are bf16; the loss is the NLL of those logits computed in float (a bf16 sum
    of the NLL keeps 8 bits), against the same logits' NLL in float64 written as a loop."""
    torch.manual_seed(0)
    model = build_gpt("gpt2_nano", vocab_size=65).eval()
    g = torch.Generator().manual_seed(2)
    windows = [(torch.randint(0, 65, (2, 16), generator=g), torch.randint(0, 65, (2, 16), generator=g))
               for _ in range(3)]
    result = evaluate_language_model(model, windows, torch.device("cpu"), amp="bf16")
    nll = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for x, y in windows:
            logits = model(x)
            assert logits.dtype == torch.bfloat16  # what the test is about: bf16 logits
            logp = torch.log_softmax(logits.double(), -1)
            nll += sum(-logp[b, t, y[b, t]].item() for b in range(2) for t in range(16))
    assert result["tokens"] == 96 and result["loss"] == pytest.approx(nll / 96, rel=1e-6)


def test_every_token_data_set_trains_the_language_model_task_and_every_other_one_a_classifier():
    """engine/tasks.py keeps its own copy of data/text.py's TOKEN_DATASETS (engine/ does not import data/): a token
    data set added to one list and not the other would train a classifier on token windows. Every data set the
    schema accepts is checked against data/'s list."""
    import typing
    from configs.schema import DataConfig
    from data import TOKEN_DATASETS
    from engine.tasks import CausalLMTask, task_for

    accepted = typing.get_args(typing.get_type_hints(DataConfig)["dataset"])
    assert set(TOKEN_DATASETS) <= set(accepted)
    for dataset in accepted:
        task = task_for(dataset)
        assert isinstance(task, CausalLMTask if dataset in TOKEN_DATASETS else ClassificationTask), dataset
