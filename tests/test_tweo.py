"""TWEO baseline: the penalty against hand computations, fp16 safety, hooks, schedule, rescaled variant."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cd import TWEO, tweo_penalty
from cd.tweo import _window_dtype, plain_tweo_penalty
from cd_models import tiny_swin, tiny_vit


def _block_outputs(model, blocks, x):
    """Block outputs captured by the test's own hooks."""
    outs = []
    handles = [b.register_forward_hook(lambda m, a, o: outs.append(o)) for b in blocks]
    y = model(x)
    for h in handles:
        h.remove()
    return y, outs


def test_penalty_of_known_activations():
    a = torch.tensor([[3.0, -6.0], [0.0, 1.5]])
    hand = (3 ** 4 + 6 ** 4 + 0 + 1.5 ** 4) / (3 + 1e-6) ** 4 / 4  # mean((|a| / (tau + eps))^4)
    assert math.isclose(float(tweo_penalty(a)), hand, rel_tol=1e-6)
    assert math.isclose(float(tweo_penalty(a, p=2.0, tau=1.0, eps=0.0)), (9 + 36 + 0 + 2.25) / 4,
                        rel_tol=1e-6)


@pytest.mark.parametrize("p", [4.0, 3.5, 1.0])
def test_penalty_gradient_matches_autograd_of_the_plain_formula(p):
    a = torch.randn(3, 5, 7, dtype=torch.float64) * 4
    a1 = a.clone().requires_grad_(True)
    a2 = a.clone().requires_grad_(True)
    tweo_penalty(a1, p=p, tau=2.0).backward()
    ((a2.abs() / (2.0 + 1e-6)) ** p).mean().backward()
    torch.testing.assert_close(a1.grad, a2.grad)


@pytest.mark.parametrize("make", [tiny_vit, tiny_swin])
def test_aux_loss_is_lam_times_mean_over_block_outputs(make):
    model = make()
    x = torch.randn(2, 3, 32, 32)
    lam = 0.01
    with TWEO(model, lam=lam) as tweo:
        names = [n for n, _ in tweo.blocks]
        y, outs = _block_outputs(model, [b for _, b in tweo.blocks], x)
        aux = tweo.aux_loss(F.cross_entropy(y, torch.zeros(2, dtype=torch.long)), step=0)
    want = sum(((o.detach().double().abs() / 3.000001) ** 4).mean() for o in outs) / len(outs)
    assert math.isclose(float(aux.detach()), lam * float(want), rel_tol=1e-5)
    if make is tiny_swin:  # Swin: the blocks of every stage, not patch merging, not the final norm
        assert names == ["layers.0.blocks.0", "layers.0.blocks.1", "layers.1.blocks.0", "layers.1.blocks.1"]
    else:
        assert names == ["blocks.0", "blocks.1"]


def test_aux_loss_uses_the_p_tau_and_eps_it_was_given():
    """Non-default p, tau and eps reach every block's term: mean((|A| / (tau + eps))^p), by hand in float64."""
    model = tiny_vit()
    x = torch.randn(2, 3, 32, 32)
    with TWEO(model, lam=0.02, p=3.0, tau=1.0, eps=0.5) as tweo:
        y, outs = _block_outputs(model, [b for _, b in tweo.blocks], x)
        aux = tweo.aux_loss(y.sum(), step=0)
    want = sum(((o.detach().double().abs() / 1.5) ** 3).mean() for o in outs) / len(outs)
    assert math.isclose(float(aux.detach()), 0.02 * float(want), rel_tol=1e-5)


def test_fp16_activations_of_several_hundred_stay_finite():
    a = torch.tensor([400.0, -350.0, 250.0, 5.0], dtype=torch.float16)
    assert torch.isinf(((a.abs() / 3) ** 4).mean())  # what a naive fp16 penalty does
    want = float(((a.double().abs() / 3.000001) ** 4).mean())
    assert math.isclose(float(tweo_penalty(a)), want, rel_tol=1e-6)

    model = tiny_vit()
    with torch.no_grad():
        for b in model.blocks:
            b.mlp.fc2.bias.fill_(300.0)  # block outputs of several hundred
    x = torch.randn(2, 3, 32, 32)
    tweo = TWEO(model, lam=1e-6)
    with torch.autocast("cpu", dtype=torch.float16):
        y = model(x)
        task = F.cross_entropy(y, torch.zeros(2, dtype=torch.long))
        aux = tweo.aux_loss(task)
    assert aux.dtype == torch.float32 and torch.isfinite(aux) and float(aux.detach()) > 1e-6 * 1e6
    (task + aux).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    tweo.remove()


def test_fp16_model_block_outputs():
    model = tiny_vit().half()
    with torch.no_grad():
        model.blocks[0].mlp.fc2.bias.fill_(200.0)
    with TWEO(model, lam=1.0) as tweo:
        y, outs = _block_outputs(model, [b for _, b in tweo.blocks], torch.randn(2, 3, 32, 32).half())
        assert outs[0].dtype == torch.float16
        aux = tweo.aux_loss(y.float().mean())
    want = sum(((o.detach().double().abs() / 3.000001) ** 4).mean() for o in outs) / len(outs)
    assert torch.isfinite(aux) and math.isclose(float(aux.detach()), float(want), rel_tol=1e-5)


def test_hooks_are_removed_and_eval_or_no_grad_forwards_are_not_captured():
    model = tiny_vit()
    x = torch.randn(2, 3, 32, 32)
    tweo = TWEO(model, lam=0.01)
    model.eval()
    model(x)
    with pytest.raises(RuntimeError, match="no block output captured"):
        tweo.aux_loss(torch.tensor(1.0))
    model.train()
    with torch.no_grad():
        model(x)
    with pytest.raises(RuntimeError, match="no block output captured"):
        tweo.aux_loss(torch.tensor(1.0))
    model(x)
    model(x)  # a new forward replaces the terms of the previous one (no growth)
    assert len(tweo._terms) == len(model.blocks)
    tweo.remove()
    assert all(not b._forward_hooks for b in model.blocks) and not model._forward_pre_hooks
    with TWEO(model, lam=0.01):
        assert all(len(b._forward_hooks) == 1 for b in model.blocks)
    assert all(not b._forward_hooks for b in model.blocks) and not model._forward_pre_hooks


@pytest.mark.parametrize("rescale", [False, True])
def test_a_compiled_model_gives_the_eager_models_term_and_gradients(rescale):
    """torch.compile (the aot_eager backend: dynamo and AOTAutograd's graphs, run by eager kernels, so no C++
    toolchain) of a model TWEO hooks: its block hooks and the penalty's autograd.Function are traced into the one
    graph of the forward (no graph break, no fall back to eager), and two training steps (an SGD step between them,
    so the second runs other weights through the compiled graph) give the eager copy's total loss and gradients,
    with no block output left pending after aux_loss."""
    import copy

    from torch._dynamo.backends.debugging import aot_eager

    torch._dynamo.reset()  # no compiled frame of another test's model counts towards the recompile limit
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    eager = tiny_vit().double()
    compiled = torch.compile(copy.deepcopy(eager), backend=backend)
    tweos = [TWEO(eager, lam=0.1, rescale=rescale), TWEO(compiled, lam=0.1, rescale=rescale)]
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.5) for model in (eager, compiled)]
    x, target = torch.randn(2, 3, 32, 32, dtype=torch.float64), torch.tensor([1, 2])
    losses = []
    for step in range(2):
        runs = []
        for model, tweo, optimizer in zip((eager, compiled), tweos, optimizers):
            optimizer.zero_grad()
            task = F.cross_entropy(model(x), target)
            loss = task + tweo.aux_loss(task, step)
            assert not tweo.pending
            loss.backward()
            runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()], tweo.metrics()))
            optimizer.step()
        (loss, grads, metrics), (loss_c, grads_c, metrics_c) = runs
        torch.testing.assert_close(loss_c, loss)
        torch.testing.assert_close(grads_c, grads)
        assert metrics_c == pytest.approx(metrics) and metrics["tweo/penalty"] > 0
        losses.append(loss)
    assert not torch.equal(losses[0], losses[1])  # the step moved the weights: the second step is another check
    # one graph of the forward, traced once and run at both steps, holding each block's penalty
    assert len(graphs) == 1
    applied = [n for n in graphs[0].graph.nodes if "autograd_function_apply" in str(n.target)]
    assert len(applied) == len(eager.blocks)
    for tweo in tweos:
        tweo.remove()


@pytest.mark.parametrize("kwargs", [dict(lam=float("nan")), dict(lam=float("inf")), dict(p=float("nan")),
                                    dict(tau=float("nan")), dict(eps=float("inf")), dict(lam=-1.0),
                                    dict(p=0.5), dict(tau=0.0, eps=0.0), dict(tau=-1.0, eps=0.5)])
def test_non_finite_or_negative_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="tweo needs finite p >= 1"):
        TWEO(tiny_vit(), **kwargs)


@pytest.mark.parametrize("kwargs,match", [(dict(schedule="linear"), "tweo schedule must be one of"),
                                          (dict(form="fused"), "tweo form must be one of"),
                                          (dict(schedule="cosine", total_steps=-5), "total_steps > 0")])
def test_unknown_schedule_or_form_and_a_negative_run_length_are_refused(kwargs, match):
    """Not silently read as another setting: an unknown schedule would run the cosine, an unknown form the plain
    penalty, and total_steps=-5 would give lam(t) = 0 at every step."""
    with pytest.raises(ValueError, match=match):
        TWEO(tiny_vit(), **kwargs)


def test_a_run_length_beside_the_constant_schedule_is_refused():
    """total_steps is the cosine's length: given with the constant schedule (the default) it was meant for a decay
    that would not run, and lam(t) stays lam (TweoHook refuses the same). A trainer's from_config, which knows the
    run's length whatever the schedule, passes it on for the cosine only."""
    from configs import load_config

    for kwargs in (dict(total_steps=100), dict(schedule="constant", total_steps=100)):
        with pytest.raises(ValueError, match=r"^tweo total_steps=100 sets the length of schedule 'cosine'; the "
                                             r"schedule is 'constant': drop total_steps or set schedule='cosine'$"):
            TWEO(tiny_vit(), **kwargs)
    cfg = load_config(None, ["tweo.enabled=true", "tweo.lam=0.02"])
    tweo = TWEO.from_config(cfg.tweo, tiny_vit(), total_steps=100)
    assert (tweo.schedule, tweo.total_steps, tweo.lam_at(50)) == ("constant", None, 0.02)
    tweo.remove()


def test_fp16_block_output_gradient_is_computed_in_fp32():
    """(|a| / 3)^3 overflows fp16 beyond |a| = 121 although the gradient p (|a| k)^(p-1) k / numel (k = 1/(tau +
    eps)) fits; the gradient of an fp16 `a` is the float64 autograd one of the formula, in fp16."""
    a = torch.linspace(-150.0, 150.0, 64).to(torch.float16).requires_grad_(True)
    tweo_penalty(a).backward()
    ref = a.detach().double().requires_grad_(True)
    ((ref.abs() / (3.0 + 1e-6)) ** 4).mean().backward()
    assert a.grad.dtype == torch.float16 and torch.isfinite(a.grad).all()
    torch.testing.assert_close(a.grad.double(), ref.grad, rtol=2e-3, atol=1e-3)


def test_remove_drops_the_terms_of_a_forward_it_follows():
    """After remove(), aux_loss refuses (as its message says) instead of adding the terms captured before."""
    model = tiny_vit()
    tweo = TWEO(model, lam=0.01)
    model(torch.randn(2, 3, 32, 32))
    assert tweo.pending
    tweo.remove()
    assert not tweo.pending
    with pytest.raises(RuntimeError, match="no block output captured"):
        tweo.aux_loss(torch.tensor(1.0))


def test_cosine_schedule():
    tweo = TWEO(tiny_vit(), lam=0.02, schedule="cosine", total_steps=100)
    assert tweo.lam_at(0) == 0.02 and tweo.lam_at(-10) == 0.02  # a step before the first: t = 0, not cos(-t)
    assert math.isclose(tweo.lam_at(50), 0.01)
    assert math.isclose(tweo.lam_at(25), 0.01 * (1 + math.cos(math.pi / 4)))
    # 0 after the run, not the cosine rising again (at 150 it would be lam / 2; at odd multiples of 100 it is 0)
    assert tweo.lam_at(100) == 0.0 and tweo.lam_at(150) == 0.0 and tweo.lam_at(500) == 0.0
    assert TWEO(tiny_vit(), lam=0.02).lam_at(10 ** 6) == 0.02
    with pytest.raises(ValueError, match="total_steps"):
        TWEO(tiny_vit(), schedule="cosine")


def test_rescaled_variant_has_lam_times_task_loss_magnitude():
    model = tiny_vit()
    x, target = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    tweo = TWEO(model, lam=1e-4, rescale=True)
    task = F.cross_entropy(model(x), target)
    aux = tweo.aux_loss(task, step=3)
    assert math.isclose(float(aux.detach()), 1e-4 * float(task.detach()), rel_tol=1e-6)
    metrics = tweo.metrics()
    assert metrics["tweo/lam"] == 1e-4 and metrics["tweo/penalty"] > 0
    # the gradient is the plain penalty's (from the test's own hooks and formula) times lam * T / P, with
    # T and P constants: neither the task loss nor the penalty in the ratio carries gradient
    task_value, penalty_value = float(task.detach()), metrics["tweo/penalty"]
    (g,) = torch.autograd.grad(aux, model.blocks[1].mlp.fc2.bias)
    _, outs = _block_outputs(model, model.blocks, x)
    plain = torch.stack([((o.float().abs() / (3.0 + 1e-6)) ** 4).mean() for o in outs]).mean()
    assert math.isclose(float(plain.detach()), penalty_value, rel_tol=1e-5)
    (g_plain,) = torch.autograd.grad(1e-4 * task_value / penalty_value * plain, model.blocks[1].mlp.fc2.bias)
    torch.testing.assert_close(g, g_plain)


def test_from_config():
    from configs import load_config

    cfg = load_config(None, ["tweo.enabled=true", "tweo.lam=0.05", "tweo.schedule=cosine", "tweo.tau=5",
                             "tweo.form=plain"])
    tweo = TWEO.from_config(cfg.tweo, tiny_vit(), total_steps=10)
    assert (tweo.lam, tweo.tau, tweo.p, tweo.schedule, tweo.total_steps) == (0.05, 5.0, 4.0, "cosine", 10)
    assert tweo._penalty is plain_tweo_penalty


def _term_and_grads(overrides, x, target):
    """TWEO built from the config with `overrides` on a float64 tiny_vit: the block outputs (the test's own hooks),
    the task loss, the TWEO term and its gradient w.r.t. every parameter (what trains)."""
    from configs import load_config

    cfg = load_config(None, ["tweo.enabled=true", "tweo.lam=0.05", *overrides])
    model = tiny_vit().double()
    tweo = TWEO.from_config(cfg.tweo, model, total_steps=10)
    try:
        y, outs = _block_outputs(model, [b for _, b in tweo.blocks], x)
        task = F.cross_entropy(y, target)
        aux = tweo.aux_loss(task, step=0)
    finally:
        tweo.remove()
    params = list(model.parameters())
    grads = torch.autograd.grad(aux, params, retain_graph=True, allow_unused=True, materialize_grads=True)
    return outs, task, aux, params, torch.cat([g.flatten() for g in grads]), tweo


def _flat_grad(value, params):
    grads = torch.autograd.grad(value, params, retain_graph=True, allow_unused=True, materialize_grads=True)
    return torch.cat([g.flatten() for g in grads])


def test_from_config_trains_with_p_tau_and_eps():
    """tweo.p, tweo.tau and tweo.eps from the config reach what trains: the term's gradient is that of
    lam * mean over blocks of mean((|A| / (tau + eps))^p), by hand in float64 (p 3, tau + eps 1.5), not of the
    defaults (p 4, tau 3); the logged L_TWEO is that mean."""
    x, target = torch.randn(2, 3, 32, 32, dtype=torch.float64), torch.tensor([1, 2])
    outs, _, aux, params, g, tweo = _term_and_grads(["tweo.p=3", "tweo.tau=1", "tweo.eps=0.5"], x, target)
    hand = sum(((o.abs() / 1.5) ** 3).mean() for o in outs) / len(outs)
    assert math.isclose(tweo.metrics()["tweo/penalty"], float(hand.detach()), rel_tol=1e-12)
    assert math.isclose(float(aux.detach()), 0.05 * float(hand.detach()), rel_tol=1e-12)
    torch.testing.assert_close(g, _flat_grad(0.05 * hand, params), rtol=1e-10, atol=1e-16)
    defaults = sum(((o.abs() / (3 + 1e-6)) ** 4).mean() for o in outs) / len(outs)
    assert not torch.allclose(g, _flat_grad(0.05 * defaults, params), rtol=1e-3)


def test_the_rescaled_term_trains_with_p_and_not_with_tau_or_eps():
    """rescale=true: the term lam * P * detach(|L| / P) has the gradient lam * |L| * grad(Q) / Q with
    Q = mean over blocks of mean(|A|^p), the (tau + eps)^-p of P cancelling: the gradient follows tweo.p (by hand,
    float64) and is the same for every tau and eps (which the config refuses there); its value is lam * |L|."""
    x, target = torch.randn(2, 3, 32, 32, dtype=torch.float64), torch.tensor([1, 2])
    outs, task, aux, params, g, _ = _term_and_grads(["tweo.rescale=true", "tweo.p=3"], x, target)
    assert math.isclose(float(aux.detach()), 0.05 * float(task.detach()), rel_tol=1e-12)
    q = sum((o.abs() ** 3).mean() for o in outs) / len(outs)
    torch.testing.assert_close(g, _flat_grad(0.05 * float(task.detach()) / float(q.detach()) * q, params),
                               rtol=1e-10, atol=1e-16)
    _, _, _, _, g4, _ = _term_and_grads(["tweo.rescale=true", "tweo.p=4"], x, target)
    assert not torch.allclose(g, g4, rtol=1e-3)

    def direct(**scale):  # TWEO itself, which refuses tau and eps beside rescale: set on the object its hooks read
        model = tiny_vit().double()
        with TWEO(model, lam=0.05, p=3.0, rescale=True) as tweo:
            for key, value in scale.items():
                setattr(tweo, key, value)
            term = tweo.aux_loss(F.cross_entropy(model(x), target))
        return _flat_grad(term, list(model.parameters()))

    base = direct()
    torch.testing.assert_close(base, g, rtol=1e-12, atol=1e-16)
    for scale in (dict(tau=30.0), dict(tau=0.5), dict(eps=2.0)):
        torch.testing.assert_close(direct(**scale), base, rtol=1e-12, atol=1e-16)


def saved_storages(use_tweo: bool, form: str = "memory_saving", batch: int = 8) -> dict:
    """Autograd's saved tensors of one training forward, {storage pointer: bytes}."""
    model = tiny_vit()
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    tweo = TWEO(model, lam=0.01, form=form) if use_tweo else None
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x), y)
        if tweo is not None:
            loss = loss + tweo.aux_loss(loss)
    return seen


def test_penalty_saves_no_extra_activation_memory():
    """Autograd's saved tensors (by storage) are the same with and without TWEO: the penalty only keeps
    the block outputs, which the next LayerNorm saves anyway."""
    base, with_tweo = saved_storages(False), saved_storages(True)
    assert sum(with_tweo.values()) == sum(base.values()) and len(with_tweo) == len(base)


def test_plain_form_has_the_same_value_and_gradient_and_keeps_block_sized_copies():
    """form='plain' (what the paper's efficiency figure timed) against the memory-saving default: the same
    loss and gradients; its extra saved memory is a multiple of the block outputs' size, so it grows with
    the batch (fp32 tiny_vit: 2 blocks x (B, 17, 32) outputs)."""
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    grads = []
    for form in ("memory_saving", "plain"):
        model = tiny_vit()
        tweo = TWEO(model, lam=0.5, form=form)
        loss = F.cross_entropy(model(x), y)
        loss = loss + tweo.aux_loss(loss)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    extra = {}
    for batch in (4, 8):
        base = sum(saved_storages(False, batch=batch).values())
        extra[batch] = sum(saved_storages(True, "plain", batch).values()) - base
    block_output_bytes = 2 * 17 * 32 * 4  # per image: 2 blocks, 17 tokens, width 32, fp32
    assert extra[4] >= 4 * block_output_bytes and extra[8] == 2 * extra[4]


@pytest.mark.parametrize("penalty", [tweo_penalty, plain_tweo_penalty])
def test_both_forms_read_eps_and_tau(penalty):
    """mean((|a| / (tau + eps))^p) by hand with an eps large enough to show (the default 1e-6 would not)."""
    a = torch.tensor([[3.0, -6.0], [0.0, 1.5]])
    hand = (3 ** 3 + 6 ** 3 + 0 + 1.5 ** 3) / (2.0 + 0.5) ** 3 / 4
    assert math.isclose(float(penalty(a, p=3.0, tau=2.0, eps=0.5)), hand, rel_tol=1e-6)


def test_the_logged_penalty_is_the_mean_over_the_forwards_since_the_last_call_and_over_the_ranks():
    """tweo/penalty is the window's mean of L_TWEO (by hand from each forward's block outputs: mean over blocks of
    mean((|A| / (tau + eps))^p)), not the last forward's; `sum_fn` (a SUM all-reduce) adds the other ranks' sums
    and counts, so the mean is over every rank's forwards; with no forward since, the previous value stays."""
    torch.manual_seed(0)
    model = tiny_vit().double()
    tweo = TWEO(model, lam=0.01)
    hands = []
    try:
        for _ in range(3):  # three micro-batches of one logging window
            _, outs = _block_outputs(model, [b for _, b in tweo.blocks], torch.randn(2, 3, 32, 32, dtype=torch.float64))
            hands.append(float(sum(((o.abs() / (3 + 1e-6)) ** 4).mean() for o in outs) / len(outs)))
            tweo.aux_loss(torch.ones((), dtype=torch.float64), step=0)
        assert len(set(hands)) == 3  # else a mean and the last value cannot be told apart
        assert math.isclose(tweo.metrics()["tweo/penalty"], sum(hands) / 3, rel_tol=1e-6)
        assert math.isclose(tweo.metrics()["tweo/penalty"], sum(hands) / 3, rel_tol=1e-6)  # nothing since: kept
        _, outs = _block_outputs(model, [b for _, b in tweo.blocks], torch.randn(2, 3, 32, 32, dtype=torch.float64))
        mine = float(sum(((o.abs() / (3 + 1e-6)) ** 4).mean() for o in outs) / len(outs))
        tweo.aux_loss(torch.ones((), dtype=torch.float64), step=1)
        other_rank = torch.tensor([0.5 * 3, 3.0])  # another rank's window: 3 forwards of mean 0.5
        seen = []
        merged = tweo.metrics(sum_fn=lambda t: seen.append(t.clone()) or t.add_(other_rank.to(t)))
        assert seen[0][1].item() == 1.0  # this rank's count since the last call
        assert math.isclose(merged["tweo/penalty"], (mine + 1.5) / 4, rel_tol=1e-6)
    finally:
        tweo.remove()



@pytest.mark.parametrize("device, dtype", [("cpu", torch.float64), ("cuda:1", torch.float64), ("mps", torch.float32)])
def test_the_window_sums_in_float64_where_the_device_has_it(device, dtype):
    """The log window's penalty sum is float64 (exact for float32 penalties in any order), but float32 on MPS, which
    has no float64: TWEO (public, called in users' own loops) ran there before its sum was float64. Without an MPS
    device here, only the choice by device type is checked (and that TWEO takes it, below, on the CPU)."""
    assert _window_dtype(torch.device(device)) == dtype


def test_aux_loss_a_resume_and_the_all_reduce_sum_in_the_devices_window_dtype():
    """aux_loss, the sums a resume carries and the totals all-reduced (also a rank's zeros) take `_window_dtype`."""
    model = tiny_vit()
    tweo = TWEO(model, lam=0.01)
    try:
        _block_outputs(model, [b for _, b in tweo.blocks], torch.randn(2, 3, 32, 32))
        tweo.aux_loss(torch.ones(()), step=0)
        tweo.load_window_state(tweo.window_state())
        seen = []
        tweo.metrics(sum_fn=lambda t: seen.append(t.dtype) or t)
        tweo.metrics(sum_fn=lambda t: seen.append(t.dtype) or t)  # a rank of no forward since: zeros
        assert seen == [_window_dtype(torch.device("cpu"))] * 2
    finally:
        tweo.remove()


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_plain_runs_term_or_a_refusal_naming_it(reentrant):
    """Every block under torch.utils.checkpoint (as timm's set_grad_checkpointing runs them): non-reentrant, TWEO's
    term and its gradient equal those of the run without checkpointing (the reference); reentrant runs the blocks'
    forward without grad, where no term can be taken: aux_loss refuses, naming use_reentrant=False."""
    from torch.utils.checkpoint import checkpoint

    def run(checkpointed):
        torch.manual_seed(0)
        model = tiny_vit()
        model.train()
        tweo = TWEO(model, lam=0.5)
        x = model._pos_embed(model.patch_embed(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))))
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=reentrant) if checkpointed else block(x)
        aux = tweo.aux_loss(torch.tensor(1.0))
        aux.backward()
        return aux.detach(), model.blocks[0].mlp.fc1.weight.grad

    reference = run(False)
    if reentrant:
        with pytest.raises(RuntimeError, match="no block output captured.*use_reentrant=False"):
            run(True)
    else:
        aux, grad = run(True)
        assert torch.equal(aux, reference[0]) and torch.allclose(grad, reference[1], rtol=1e-5, atol=1e-7)


def test_aux_loss_of_a_model_split_over_devices_is_on_the_task_losss_device():
    """A model whose blocks sit on different devices (transformers' device_map="auto": hooks move each block's input
    to its device) gave a device-mismatch error from torch.stack of the blocks' terms; the terms are gathered on the
    task loss's device. Here the second block and the head are on "meta", the first on the CPU."""
    model = tiny_vit().eval()
    meta = torch.device("meta")
    for module in (model.blocks[1], model.norm, model.fc_norm, model.head_drop, model.head):
        module.to(meta)
        module.register_forward_pre_hook(lambda m, args: tuple(a.to(meta) for a in args))
    with TWEO(model, lam=0.01) as tweo:
        model.train()
        y = model(torch.randn(2, 3, 32, 32))
        aux = tweo.aux_loss(F.cross_entropy(y, torch.zeros(2, dtype=torch.long, device=meta)), step=0)
    assert y.device == meta and aux.device == meta and aux.shape == ()


def test_a_window_carried_by_a_resume_is_summed_on_the_task_losss_device_of_a_split_model():
    """load_window_state put the carried sum on the first hooked block's device, and the next forward added its
    penalty, on the task loss's device (a model split over GPUs: cuda:0 then cuda:1, FakeTensors that check devices as
    CUDA does), to it across the two devices, which torch refuses. The sum follows the task loss's device."""
    from test_cd_update import _split_over_two_gpus

    model = tiny_vit().train()
    mode = _split_over_two_gpus(model)
    model.blocks[1].register_forward_pre_hook(lambda m, args: tuple(a.to("cuda:1") for a in args))
    model.norm.register_forward_pre_hook(lambda m, args: tuple(a.to("cuda:0") for a in args))
    with mode, TWEO(model, lam=0.01) as tweo:
        tweo.load_window_state({"penalty_sum": 3.0, "count": 2, "last_penalty": 1.5, "last_lam": 0.01})
        y = model(torch.randn(2, 3, 32, 32, device="cuda:0")).to("cuda:1")
        aux = tweo.aux_loss(F.cross_entropy(y, torch.zeros(2, dtype=torch.long, device="cuda:1")), step=0)
        assert aux.device == tweo._window_sum.device == torch.device("cuda:1") and tweo._window_count == 3
