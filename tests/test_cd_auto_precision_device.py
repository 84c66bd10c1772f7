"""matmul_precision='auto' is tf32 on CUDA and fp32 elsewhere (cd/README.md), decided at each update from where the
decayed matrices are then: a ColinearityDecay built on the CPU and followed by model.cuda() (the order of a plain
training loop) ran IEEE fp32 products on the GPU when 'auto' was fixed at construction. On the CPU the weights'
device is made to report CUDA after construction (no GPU needed: the update kernel is replaced by a recorder), and an
'auto' CD on the CPU keeps the exact fp32 products of the float64 reference."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import cd.decay
from cd import ColinearityDecay
from cd_models import VIT_DEPTH, ref_block_update, snapshot, tiny_vit


class ReportsCuda(nn.Parameter):
    """A CPU parameter that reports a CUDA device, as one moved by model.cuda() does (same object, new place)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda")


@pytest.mark.parametrize("device, resolved", [(torch.device("cuda"), "tf32"), ("cuda:1", "tf32"),
                                              (torch.device("cpu"), "fp32"), (torch.device("meta"), "fp32")])
def test_auto_is_tf32_on_cuda_and_fp32_elsewhere(device, resolved):
    from cd.update import resolve_precision
    assert resolve_precision("auto", device) == resolved
    for explicit in ("fp32", "tf32", "bf16"):  # an explicit setting is what it says wherever the matrices are
        assert resolve_precision(explicit, device) == explicit


def record_precisions(monkeypatch) -> list:
    """Replace the update kernel by one that records the `precision` it is handed (and changes nothing)."""
    seen: list = []

    def kernel(*args, precision, **kwargs):
        seen.append(precision)
        return {}
    monkeypatch.setattr(cd.decay, "colinearity_decay_", kernel)
    return seen


def test_auto_follows_the_matrices_to_cuda_after_cd_is_built(monkeypatch):
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.1)  # 'auto', built with the model on the CPU
    seen = record_precisions(monkeypatch)
    decay.apply(lr=0.5)
    for p in model.parameters():  # model.cuda(): the same Parameter objects, now on the GPU
        p.__class__ = ReportsCuda
    decay.apply(lr=0.5)
    assert seen == ["fp32", "tf32"]
    assert decay.matmul_precision == "tf32"


def test_auto_is_tf32_when_a_block_after_the_first_is_on_cuda(monkeypatch):
    """A model whose first block stays on the CPU (offloaded) and whose others are on a GPU: 'auto' was resolved from
    the first pair's device alone, so the GPU blocks' products ran in IEEE fp32 where 'auto' is tf32 on CUDA. The
    TF32 switch is cuBLAS's, so the CPU block's products stay fp32 under it."""
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.1)
    seen = record_precisions(monkeypatch)
    for p in model.blocks[1].parameters():
        p.__class__ = ReportsCuda
    assert decay.pairs[0].downstream.device.type == "cpu"
    decay.apply(lr=0.5)
    assert seen == ["tf32"] and decay.matmul_precision == "tf32"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_explicit_precision_is_kept_wherever_the_matrices_move(monkeypatch, precision):
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.1, matmul_precision=precision)
    seen = record_precisions(monkeypatch)
    for p in model.parameters():
        p.__class__ = ReportsCuda
    decay.apply(lr=0.5)
    assert seen == [precision]


def test_auto_built_and_used_on_the_cpu_keeps_exact_fp32_products():
    """Two updates at lr * lam = 0.05, each against the float64 reference of the weights it started from."""
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.1, matmul_precision="auto")
    for _ in range(2):
        P = snapshot(model)
        decay.apply(lr=0.5)
        expected: dict = {}
        for i in range(VIT_DEPTH):
            ref_block_update(P, f"blocks.{i}", 0.05, expected)
        for name, want in expected.items():
            torch.testing.assert_close(dict(model.named_parameters())[name].double(), want, rtol=1e-5, atol=1e-6)
    assert decay.matmul_precision == "fp32"


@pytest.mark.gpu
def test_auto_built_on_the_cpu_runs_tf32_after_model_cuda(monkeypatch):
    """The real move: built on the CPU, model.cuda(), then the update hands the kernel tf32 and matches the float64
    reference to TF32's error (tests/test_gpu.py's bound)."""
    kernel, seen = cd.decay.colinearity_decay_, []

    def recorded(*args, precision, **kwargs):
        seen.append(precision)
        return kernel(*args, precision=precision, **kwargs)
    monkeypatch.setattr(cd.decay, "colinearity_decay_", recorded)
    model = tiny_vit()
    P = snapshot(model)
    decay = ColinearityDecay(model, lam=0.1)
    model.cuda()
    decay.apply(lr=0.5)
    assert seen == ["tf32"]
    expected: dict = {}
    for i in range(VIT_DEPTH):
        ref_block_update(P, f"blocks.{i}", 0.05, expected)
    for name, want in expected.items():
        got = dict(model.named_parameters())[name].detach().double().cpu()
        assert float((got - want).abs().max()) <= 5e-3 * float((want - P[name].double()).abs().max()), name
