"""engine/act_max.py: a module whose forward never ran has no record in `per_layer` (nor a row in the CSV).

Its maximum was recorded as 0.0 and its kurtosis as NaN, as if its output had been measured: timm Swin's
`attn.softmax` under fused attention (TIMM_FUSED_ATTN=2), whose kernel replaces the softmax module, is the case
met. The references are forward hooks of the tests' own that record which modules ran and their max |output|; an
output that is measured as all zeros keeps its record of 0.0. Under DDP every rank holds the same records: a module
that ran on one rank only is recorded on all of them, with that rank's maximum.
"""
import csv
import io
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_utils import free_port, init_gloo, leave_and_exit, spawn_ranks
from engine.act_max import ActivationProbe
from engine.act_max_files import csv_bytes
from quant_models import images, tiny_swin


class Branchy(nn.Module):
    """A block with a branch that runs only when `rare` is set, a layer that never runs, and a ReLU whose output
    is all zeros (a measured maximum of 0.0)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.branch = nn.Linear(4, 4)
        self.never = nn.Linear(4, 4)
        self.zero = nn.ReLU()
        self.rare = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.rare:
            h = h + self.branch(x)
        return h + self.zero(-h.abs())


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Branchy(), Branchy()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def measured(model: nn.Module, run) -> dict:
    """{module name: max |output|} of every module whose forward ran in `run()`, by hooks of this test's own."""
    maxima: dict = {}

    def hook(name):
        def fn(module, inputs, output):
            maxima[name] = max(maxima.get(name, 0.0), float(output.detach().abs().max()))
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return maxima


def test_a_module_whose_forward_never_ran_has_no_record():
    model = Model()
    model.blocks[0].rare = True
    with torch.no_grad(), ActivationProbe(model, moments=True) as probe:
        ran = measured(model, lambda: model(torch.randn(3, 4)))
    result = probe.result()
    assert "blocks.1.branch" in probe.names() and "blocks.0.never" in probe.names()
    assert {r["name"]: r["max"] for r in result.per_layer} == {n: ran[n] for n in probe.names() if n in ran}
    assert {"blocks.0.branch", "blocks.0.zero", "blocks.1.zero"} <= set(ran)
    assert not {"blocks.0.never", "blocks.1.never", "blocks.1.branch"} & {r["name"] for r in result.per_layer}
    assert {r["name"]: r["max"] for r in result.per_layer}["blocks.0.zero"] == 0.0  # measured: kept
    rows = list(csv.DictReader(io.StringIO(csv_bytes(result.per_layer).decode())))
    assert [r["name"] for r in rows] == [r["name"] for r in result.per_layer]


def test_swin_softmax_under_fused_attention_has_no_record():
    """With the softmax module (timm's default here) its records are those of its outputs; with fused attention it
    never runs and has none, and every record left is of an output the hooks saw."""
    for fused in (False, True):
        model = tiny_swin()
        for module in model.modules():
            if hasattr(module, "fused_attn"):
                module.fused_attn = fused
        with torch.no_grad(), ActivationProbe(model, moments=True) as probe:
            ran = measured(model, lambda: model(images(2)))
        records = {r["name"]: r for r in probe.result().per_layer}
        softmax = [n for n in probe.names() if n.endswith("attn.softmax")]
        assert len(softmax) == 4
        assert all((n in records) == (not fused) for n in softmax)
        assert records.keys() == {n for n in probe.names() if n in ran}
        for name, record in records.items():
            assert record["max"] == ran[name], name
            # a softmax (probabilities) has no kurtosis, NaN (test_swin_kurtosis_...), every other output one
            assert (record["kurtosis"] == record["kurtosis"]) == (name not in softmax), name


def test_swin_kurtosis_leaves_out_the_attention_probabilities_and_is_the_same_fused_or_not():
    """act/kurtosis_module is the largest Pearson kurtosis (E[(x - mu)^4] / var^2, computed here from the outputs
    the tests' own hooks keep) of the block modules' outputs but the softmax's probabilities, whose kurtosis was the
    largest where the attention is not fused and absent where it is: the metrics are the same either way."""
    metrics = []
    for fused in (False, True):
        model = tiny_swin()
        for module in model.modules():
            if hasattr(module, "fused_attn"):
                module.fused_attn = fused
        outputs, handles = {}, []
        with torch.no_grad(), ActivationProbe(model, moments=True) as probe:
            def keep(name):
                def hook(module, inputs, output):  # returns None: the output goes on unchanged
                    outputs[name] = output.detach().double().flatten()
                return hook

            for name in probe.names():
                handles.append(model.get_submodule(name).register_forward_hook(keep(name)))
            model(images(2))
        for handle in handles:
            handle.remove()
        result = probe.result()
        kinds = {r["name"]: r["kind"] for r in result.per_layer}

        def kurtosis(x):
            centred = x - x.mean()
            return float(centred.pow(4).mean() / centred.square().mean() ** 2)

        want = max(kurtosis(x) for name, x in outputs.items()
                   if kinds[name] == "module" and not name.endswith("attn.softmax"))
        got = result.metrics()
        assert got["act/kurtosis_module"] == pytest.approx(want, rel=1e-9), fused
        metrics.append(got)
    assert metrics[0].keys() == metrics[1].keys()
    assert all(metrics[0][k] == pytest.approx(metrics[1][k], rel=1e-5) for k in metrics[0]), metrics


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank: the rare branch of block 0 runs on rank 1 only, on inputs 10x rank 0's."""
    from engine.distributed import all_reduce

    init_gloo(rank, world, port, timeout_s=60)
    try:
        model = Model()
        model.blocks[0].rare = rank == 1
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank)) * (1 + 9 * rank)
        with torch.no_grad(), ActivationProbe(model, moments=True) as probe:
            ran = measured(model, lambda: model(x))
        result = probe.result(reduce_fn=lambda t: all_reduce(t, op="max"), sum_fn=all_reduce)
        torch.save({"records": result.per_layer, "ran": ran}, os.path.join(out, f"rank{rank}.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_and_exit()


def test_ranks_hold_the_same_records_of_what_any_rank_measured(tmp_path):
    """evaluate.py's reduction (a MAX all-reduce of the maxima and the flags together): a module that ran on rank 1
    only is recorded on both ranks with rank 1's maximum; one that ran on no rank on neither."""
    spawn_ranks(_rank, (2, free_port(), str(tmp_path)), 2)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    same = [[(r["name"], r["max"]) for r in g["records"]] for g in got]
    assert same[0] == same[1]
    kurtosis = [torch.tensor([r["kurtosis"] for r in g["records"]]) for g in got]
    torch.testing.assert_close(kurtosis[0], kurtosis[1], rtol=0, atol=0, equal_nan=True)  # an all-zero output: NaN
    ran = [g["ran"] for g in got]
    assert "blocks.0.branch" in ran[1] and "blocks.0.branch" not in ran[0]
    expected = {n: max(r[n] for r in ran if n in r) for n in set(ran[0]) | set(ran[1]) if n.startswith("blocks.")}
    assert {r["name"]: r["max"] for r in got[0]["records"]} == expected
