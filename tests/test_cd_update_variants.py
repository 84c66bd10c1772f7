"""Variants of the CD math in cd/update.py that the float64 references of test_cd_update.py do not reach: a call
from inside an autocast region, the product precision of target C's upstream products, the TF32 setting the
products see, the loss form's zero weights and stabilized scaling, an upstream step without a downstream one
(target C) or for a composable pair, and a step list of the wrong length.

References are written out here (float64 by hand, `ref_block_update`), or observe what torch.mm receives.
"""
from __future__ import annotations

import pytest
import torch

from cd import ColinearityDecay, find_pairs
from cd.update import align_to_task_loss, colinearity_decay_, pair_energy, pair_penalty
from cd_models import VIT_DEPTH, changed, normalized, ref_block_update, snapshot, tiny_vit


def test_an_update_and_energies_from_inside_cpu_autocast_stay_fp32():
    """A training loop may call `apply` inside `torch.autocast` (bf16): the CD math must not run in bf16 then
    (Eq. (24) against float64 at fp32 accuracy; bf16 products are off by about 2^-8)."""
    model = tiny_vit()
    P = snapshot(model)
    lr, lam = 0.5, 0.1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ColinearityDecay(model, lam=lam, matmul_precision="fp32").apply(lr=lr)
    expected = {}
    for i in range(VIT_DEPTH):
        ref_block_update(P, f"blocks.{i}", lr * lam, expected)
    params = dict(model.named_parameters())
    for name, want in expected.items():
        delta_want = want - P[name].double()
        delta_got = params[name].detach().double() - P[name].double()
        assert float((delta_got - delta_want).norm() / delta_want.norm()) < 1e-5, name

    fc1, fc2 = model.blocks[0].mlp.fc1.weight.detach(), model.blocks[0].mlp.fc2.weight.detach()
    fc1b, fc2b = model.blocks[1].mlp.fc1.weight.detach(), model.blocks[1].mlp.fc2.weight.detach()
    want = 0.5 * sum(float((w2.double() @ normalized(w1.double())).square().sum())
                     for w1, w2 in ((fc1, fc2), (fc1b, fc2b)))  # mean over the two blocks (Eq. (23))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = float(pair_energy(find_pairs(model))["fc2"])
    assert abs(got - want) / want < 1e-5


def _mm_spy(monkeypatch) -> list:
    """Record, for every torch.mm call, its operands' dtypes and the cuBLAS fp32 setting in force."""
    calls, mm = [], torch.mm

    def spy(a, b, *args, **kwargs):
        calls.append((a.dtype, b.dtype, torch.backends.cuda.matmul.fp32_precision))
        return mm(a, b, *args, **kwargs)
    monkeypatch.setattr(torch, "mm", spy)
    return calls


def test_bf16_precision_rounds_the_operands_of_target_cs_upstream_products_too(monkeypatch):
    """precision='bf16' is 'of the two products of a functional pair' and of target C's upstream product
    (W2^T (W2 W1)): every product of the update gets bf16 operands."""
    model = tiny_vit()
    pairs = [p for p in find_pairs(model) if p.kind == "functional"]
    calls = _mm_spy(monkeypatch)
    colinearity_decay_(pairs, [0.05] * len(pairs), [0.03] * len(pairs), precision="bf16")
    assert len(calls) == 3 * len(pairs)  # W2 W1, (W2 W1) W1^T and W2^T (W2 W1) per pair
    assert all(a == b == torch.bfloat16 for a, b, _ in calls), calls


@pytest.mark.skipif(getattr(torch.backends.cuda.matmul, "fp32_precision", None) is None,
                    reason="torch < 2.9 has only the legacy TF32 flag")
@pytest.mark.parametrize("precision,seen", [("fp32", "ieee"), ("tf32", "tf32")])
def test_the_products_run_with_the_precisions_tf32_setting_whatever_the_caller_set(monkeypatch, precision, seen):
    """'fp32' means exact fp32 products even when the caller allowed TF32 globally (train.py may), 'tf32' means
    TF32 even when the caller did not; the flag is a host setting, so this is observable without CUDA."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    model = tiny_vit()
    pairs = [p for p in find_pairs(model) if p.kind == "functional"]
    calls = _mm_spy(monkeypatch)
    try:
        matmul.fp32_precision = "ieee" if precision == "tf32" else "tf32"
        colinearity_decay_(pairs, [0.05] * len(pairs), precision=precision)
    finally:
        matmul.fp32_precision = saved
    assert calls and {flag for _, _, flag in calls} == {seen}


def test_a_zero_weight_leaves_its_pair_out_of_the_penalty_graph():
    """pair_penalty's docstring: 'a weight of 0 leaves the pair out' and all-zero weights give a zero without a
    graph, so an optimizer sees no (zero) gradient for those matrices."""
    model = tiny_vit().double()
    pairs = find_pairs(model)
    weights = [0.0 if p.role == "fc2" else 1.0 for p in pairs]
    pair_penalty(pairs, weights).backward()
    for p in pairs:
        assert (p.downstream.grad is None) == (p.role == "fc2"), p.name
    total = pair_penalty(pairs, [0.0] * len(pairs))
    assert float(total) == 0.0 and not total.requires_grad


def test_stabilized_scaling_is_exact_in_float64():
    """align_to_task_loss(penalty, loss) = penalty * detach(loss / penalty): its value is the task loss and its
    gradient w.r.t. the penalty is loss / penalty, both at float64 accuracy for float64 inputs."""
    penalty = torch.tensor(7.0 / 11.0, dtype=torch.float64, requires_grad=True)
    task = torch.tensor(1.0 / 3.0, dtype=torch.float64)
    out = align_to_task_loss(penalty, task)
    out.backward()
    assert out.dtype == torch.float64
    assert abs(float(out.detach()) - 1.0 / 3.0) < 1e-15
    assert abs(float(penalty.grad) - (1.0 / 3.0) / (7.0 / 11.0)) < 1e-15


def test_stabilized_scaling_follows_the_task_losss_magnitude_not_its_sign():
    """A negative task loss (a Gaussian NLL, -similarity) must still give a term whose gradient descent lowers the
    penalty: the factor is |loss| / penalty (value |loss|, gradient |loss| / penalty > 0)."""
    penalty = torch.tensor(7.0 / 11.0, dtype=torch.float64, requires_grad=True)
    out = align_to_task_loss(penalty, torch.tensor(-2.0, dtype=torch.float64))
    out.backward()
    assert abs(float(out.detach()) - 2.0) < 1e-15
    assert abs(float(penalty.grad) - 2.0 / (7.0 / 11.0)) < 1e-15


def test_a_step_list_of_another_length_than_the_pairs_is_refused():
    pairs = find_pairs(tiny_vit())
    with pytest.raises(ValueError, match=f"step_sizes has 1 entries for {len(pairs)} pairs"):
        colinearity_decay_(pairs, [0.05])


@pytest.mark.parametrize("extra", [-3, 4])
def test_a_penalty_weight_list_of_another_length_than_the_pairs_is_refused(extra):
    """pair_penalty's per-pair weights: a shorter list failed with an IndexError, a longer one's extra weights were
    ignored unread."""
    pairs = find_pairs(tiny_vit())
    n = len(pairs) + extra
    with pytest.raises(ValueError, match=f"^weights has {n} entries for {len(pairs)} pairs$"):
        pair_penalty(pairs, [1.0] * n)


@pytest.mark.parametrize("extra", [-3, 4])
def test_an_upstream_step_list_of_another_length_than_the_pairs_is_refused(extra):
    """Target C's per-pair upstream steps: a shorter list failed with an IndexError mid-update, a longer one had its
    extra steps ignored unread; either is refused before any write, as step_sizes is."""
    model = tiny_vit()
    pairs = find_pairs(model)
    before = snapshot(model)
    n = len(pairs) + extra
    with pytest.raises(ValueError, match=f"^upstream_step_sizes has {n} entries for {len(pairs)} pairs$"):
        colinearity_decay_(pairs, [0.05] * len(pairs), [0.05] * n)
    assert not changed(model, before)


def test_target_c_moves_the_upstream_matrix_of_a_pair_whose_downstream_step_is_zero():
    """A functional pair whose W2 does not move at this step (frozen, no gradient) still decays its W1 under
    target C: W1 <- W1 - s1 c^2 W2^T W2 W1 with c^2 = r / ||W1||_F^2, W2 unchanged (float64 by hand)."""
    model = tiny_vit().double()
    P = snapshot(model)
    pairs = [p for p in find_pairs(model) if p.role == "fc2"]
    s1 = 0.03
    colinearity_decay_(pairs, [0.0] * len(pairs), [s1] * len(pairs))
    for i in range(VIT_DEPTH):
        b = f"blocks.{i}"
        fc1, fc2 = P[f"{b}.mlp.fc1.weight"], P[f"{b}.mlp.fc2.weight"]
        c2 = fc1.shape[0] / fc1.norm() ** 2
        torch.testing.assert_close(model.blocks[i].mlp.fc1.weight.detach(), fc1 - s1 * c2 * fc2.T @ fc2 @ fc1,
                                   rtol=1e-10, atol=1e-12)
        assert torch.equal(model.blocks[i].mlp.fc2.weight.detach(), fc2)


def test_upstream_steps_of_composable_pairs_are_ignored():
    """Norm scales are never decayed: an upstream step given for a composable pair changes nothing, also when
    its W2 step is 0."""
    model = tiny_vit().double()
    P = snapshot(model)
    pairs = [p for p in find_pairs(model) if p.kind == "composable"]
    colinearity_decay_(pairs, [0.0] * len(pairs), [0.05] * len(pairs))
    assert all(torch.equal(t, P[n]) for n, t in model.named_parameters())


def test_a_penalty_of_zero_weights_keeps_the_pairs_compute_dtype_under_another_default_dtype():
    """The zero returned when every weight is 0 is made in the pairs' compute dtype (fp32 for fp32 weights), not in
    torch's default dtype: under a float64 default a float64 zero would promote `loss + term` to float64."""
    pairs = find_pairs(tiny_vit())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        zero = pair_penalty(pairs, [0.0] * len(pairs))
    finally:
        torch.set_default_dtype(previous)
    assert zero.dtype == torch.float32 and float(zero) == 0.0


@pytest.mark.parametrize("task_loss", [2.0, 6.9, 1e30])
def test_a_zero_penalty_gives_a_zero_term_and_gradient_at_any_task_loss(task_loss):
    """A penalty of 0 (every decayed W2 zero: output projections initialised to zero, as some GPT recipes do) was
    aligned through its floor, |loss| / 1.2e-38, which overflows fp32 for |loss| > 4 (ImageNet's ln(1000) = 6.9 at
    init): the term 0 * inf was NaN, and so was the gradient of every decayed matrix. There is no energy to lower:
    the term and its gradient are 0, at any loss; a penalty above 0 keeps its alignment (value |loss|)."""
    zero = torch.zeros((), requires_grad=True)
    out = align_to_task_loss(zero, torch.tensor(task_loss))
    out.backward()
    assert float(out.detach()) == 0.0 and float(zero.grad) == 0.0
    model = tiny_vit()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.proj.weight.zero_()
            block.mlp.fc2.weight.zero_()
    decay = ColinearityDecay(model, mode="loss", targets="B")
    term = decay.aux_loss(torch.tensor(task_loss))
    term.backward()
    assert float(term.detach()) == 0.0
    for block in model.blocks:
        assert torch.equal(block.attn.proj.weight.grad, torch.zeros_like(block.attn.proj.weight))
        assert torch.equal(block.mlp.fc2.weight.grad, torch.zeros_like(block.mlp.fc2.weight))
    tiny = torch.tensor(1e-30, requires_grad=True)  # above 0: aligned to the loss as before
    assert float(align_to_task_loss(tiny, torch.tensor(6.9))) == pytest.approx(6.9, rel=1e-6)
