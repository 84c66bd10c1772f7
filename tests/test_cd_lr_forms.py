"""ColinearityDecay's lr in its forms: a 0-dim tensor lr (apply(tensor), an optimizer built with lr=tensor) does what
the same Python lr does, and an lr of 0 (apply(0), a warmup from 0) is no update: not counted, norms kept."""
from __future__ import annotations

import pytest
import torch

import cd.decay
from cd import ColinearityDecay
from cd_models import VIT_DEPTH, changed, ref_block_update, snapshot, tiny_vit

LAM, LR = 0.2, 0.5
ROLES = ("qkv", "proj", "fc1", "fc2")


def _zero_grads(model):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def _expected(P: dict, step: float) -> dict:
    expected = {}
    for i in range(VIT_DEPTH):
        ref_block_update(P, f"blocks.{i}", step, expected)
    return expected


def _norm_keys(decay: ColinearityDecay) -> set:
    return {k for k in decay.metrics() if k.startswith("cd/update_norm/")}


@pytest.mark.parametrize("targets,written", [("A+B", ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")),
                                             ("B", ("attn.proj", "mlp.fc2"))])
def test_a_tensor_lr_writes_only_the_targets_matrices_once_each(targets, written):
    # without target C no upstream matrix is decayed: a tensor lr must not make a (zero) upstream update, which
    # would write qkv's V rows and fc1 a second time (under B, at all)
    model = tiny_vit().double()
    P = snapshot(model)
    versions = {n: p._version for n, p in model.named_parameters()}
    decay = ColinearityDecay(model, lam=LAM, targets=targets)
    decay.apply(torch.tensor(LR, dtype=torch.float64))
    writes = {n: p._version - versions[n] for n, p in model.named_parameters()}
    want = {f"blocks.{i}.{layer}.weight" for i in range(VIT_DEPTH) for layer in written}
    assert {n: w for n, w in writes.items() if w} == dict.fromkeys(want, 1)
    roles = [r for r in ROLES if any(layer.endswith(r) for layer in written)]
    assert _norm_keys(decay) == {f"cd/update_norm/{r}" for r in roles}
    if targets == "A+B":
        for name, value in _expected(P, LR * LAM).items():
            torch.testing.assert_close(dict(model.named_parameters())[name].detach(), value, rtol=1e-10, atol=1e-12)


def test_a_tensor_lr_leaves_a_role_of_strength_zero_unwritten():
    model = tiny_vit().double()
    versions = {n: p._version for n, p in model.named_parameters()}
    decay = ColinearityDecay(model, lam=LAM, lam_per_role={"fc2": 0.0})
    decay.apply(torch.tensor(LR, dtype=torch.float64))
    assert all(model.blocks[i].mlp.fc2.weight._version == versions[f"blocks.{i}.mlp.fc2.weight"]
               for i in range(VIT_DEPTH))
    assert "cd/update_norm/fc2" not in decay.metrics()


def test_an_optimizers_tensor_lr_gives_the_update_and_metrics_of_that_lr():
    model = tiny_vit().double()
    P = snapshot(model)
    # SGD without momentum or decay on zero gradients moves nothing: only CD does
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(LR, dtype=torch.float64))
    decay = ColinearityDecay(model, lam=LAM)
    decay.attach(opt)
    _zero_grads(model)
    opt.step()
    expected = _expected(P, LR * LAM)
    for name, value in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), value, rtol=1e-10, atol=1e-12)
    assert set(changed(model, P)) == set(expected)
    assert _norm_keys(decay) == {f"cd/update_norm/{r}" for r in ROLES}  # no <role>_upstream: that is target C's
    assert decay.metrics()["cd/updates"] == 1


def test_apply_with_lr_zero_is_a_no_op_that_keeps_the_counter_and_the_norms(monkeypatch):
    calls = []
    real = cd.decay.colinearity_decay_
    monkeypatch.setattr(cd.decay, "colinearity_decay_", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=LAM)
    P = snapshot(model)
    decay.apply(0)
    assert calls == [] and changed(model, P) == []
    assert decay.metrics()["cd/updates"] == 0 and _norm_keys(decay) == set()

    decay.apply(LR)
    before = decay.metrics()
    P = snapshot(model)
    for zero in (0, 0.0):
        decay.apply(zero)
    assert len(calls) == 1 and changed(model, P) == []
    assert decay.metrics() == before  # cd/updates still 1, every update norm that of the lr-0.5 update
    assert decay.state_dict()["num_updates"] == 1


def test_a_warmup_step_from_lr_zero_is_no_update_through_the_optimizer():
    model = tiny_vit().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    decay = ColinearityDecay(model, lam=LAM)
    decay.attach(opt)
    _zero_grads(model)
    P = snapshot(model)
    opt.step()
    assert changed(model, P) == [] and decay.metrics()["cd/updates"] == 0 and _norm_keys(decay) == set()
    opt.param_groups[0]["lr"] = LR
    opt.step()
    before = decay.metrics()
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    assert decay.metrics() == before and before["cd/updates"] == 1


def test_a_tensor_lr_of_zero_is_no_update_either_counted_out_on_the_device():
    # its value is not read on the host (that would wait for the device): the update runs with zero deltas, and
    # cd/updates and the update norms leave it out as for a step GradScaler skips
    model = tiny_vit().double()
    lr = torch.tensor(LR, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    decay = ColinearityDecay(model, lam=LAM)
    decay.attach(opt)
    _zero_grads(model)
    lr.fill_(0.0)
    P = snapshot(model)
    opt.step()
    assert changed(model, P) == [] and decay.metrics()["cd/updates"] == 0
    lr.fill_(LR)
    opt.step()
    before = decay.metrics()
    lr.fill_(0.0)
    P = snapshot(model)
    opt.step()
    assert changed(model, P) == []
    assert decay.metrics() == before and before["cd/updates"] == 1
    assert decay.state_dict()["num_updates"] == 1

    alone = ColinearityDecay(tiny_vit().double(), lam=LAM)
    alone.apply(torch.tensor(LR, dtype=torch.float64))
    before = alone.metrics()
    alone.apply(torch.tensor(0.0, dtype=torch.float64))
    assert alone.metrics() == before


def test_a_fused_step_that_gradscaler_skips_keeps_the_last_update_norms():
    model = tiny_vit()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0, fused=True)
    decay = ColinearityDecay(model, lam=LAM)
    decay.attach(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(torch.ones(()))  # initialise the scale
    _zero_grads(model)
    scaler.step(opt)
    scaler.update()
    before = decay.metrics()
    _zero_grads(model)
    model.blocks[1].attn.proj.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    after = decay.metrics()
    assert before["cd/updates"] == after["cd/updates"] == 1
    assert {k: v for k, v in after.items() if "update_norm" in k} == \
        {k: v for k, v in before.items() if "update_norm" in k} != {}


# the matrices each update norm measures the change of (target C's upstream updates write qkv's V rows and fc1)
_NORM_LAYERS = {"qkv": "attn.qkv", "proj": "attn.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2",
                "proj_upstream": "attn.qkv", "fc2_upstream": "mlp.fc1"}


def _change_norms(model, before: dict, roles) -> dict:
    """cd/update_norm/<role> measured from the weights: the root of the summed squared changes over the blocks."""
    now = dict(model.named_parameters())
    return {f"cd/update_norm/{role}": sum(float((now[n] - before[n]).square().sum())
                                          for n in (f"blocks.{i}.{_NORM_LAYERS[role]}.weight"
                                                    for i in range(VIT_DEPTH))) ** 0.5 for role in roles}


@pytest.mark.parametrize("targets,roles", [("A+B", ROLES), ("C", ("proj", "fc2", "proj_upstream", "fc2_upstream"))])
@pytest.mark.parametrize("norms_every", [1, 2])
def test_update_norms_stay_absent_until_an_update_that_ran_gives_them(targets, roles, norms_every):
    # a tensor lr of 0 runs the update with zero deltas (its value is not read on the host): before any update that
    # moved the weights, no norm is an update's, so none is logged (not 0.0), also across a state_dict round trip
    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=LAM, targets=targets, norms_every=norms_every)
    zero, lr = torch.tensor(0.0, dtype=torch.float64), torch.tensor(LR, dtype=torch.float64)
    for _ in range(norms_every):  # the last one is a norm update
        decay.apply(zero)
    assert _norm_keys(decay) == set() and decay.metrics()["cd/updates"] == 0
    again = ColinearityDecay(model, lam=LAM, targets=targets, norms_every=norms_every)
    again.load_state_dict(decay.state_dict())
    for _ in range(norms_every):
        again.apply(zero)
    assert _norm_keys(again) == set() and again.state_dict()["steps"] == 2 * norms_every
    for _ in range(norms_every):  # the last one is a norm update
        P = snapshot(model)
        again.apply(lr)
    got = {k: v for k, v in again.metrics().items() if k.startswith("cd/update_norm/")}
    assert got == pytest.approx(_change_norms(model, P, roles), rel=1e-9)
    assert again.metrics()["cd/updates"] == norms_every


def test_a_first_fused_step_that_gradscaler_skips_logs_no_update_norm():
    # the non-fused optimizer's skipped step never calls step(): no norm until the good step; the fused one's
    # update runs gated on the device and must log the same
    metrics = {}
    for fused in (False, True):
        model = tiny_vit()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0, fused=fused)
        decay = ColinearityDecay(model, lam=LAM, matmul_precision="fp32")
        decay.attach(opt)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        scaler.scale(torch.ones(()))  # initialise the scale
        _zero_grads(model)
        model.blocks[1].attn.proj.weight.grad[0, 0] = float("inf")
        P = snapshot(model)
        scaler.step(opt)
        scaler.update()
        assert changed(model, P) == [] and _norm_keys(decay) == set() and decay.metrics()["cd/updates"] == 0
        _zero_grads(model)
        scaler.step(opt)
        scaler.update()
        metrics[fused] = {k: v for k, v in decay.metrics().items() if k.startswith("cd/update_norm/")}
    assert set(metrics[True]) == {f"cd/update_norm/{r}" for r in ROLES}
    assert metrics[True] == pytest.approx(metrics[False], rel=1e-5)


def test_an_update_over_two_optimizers_logs_only_the_norms_of_the_parts_that_ran():
    # cd.integrations' update over several optimizers (apply_for, count=False for the later parts), each gated by
    # its own GradScaler verdict (`found_inf`, as GradScaler sets it on a fused optimizer for its step)
    model = tiny_vit().double()
    params = dict(model.named_parameters())
    composable = [params[f"blocks.{i}.{layer}.weight"] for i in range(VIT_DEPTH) for layer in ("attn.qkv", "mlp.fc1")]
    rest = [p for p in model.parameters() if all(p is not q for q in composable)]
    first, second = torch.optim.SGD(composable, lr=LR), torch.optim.SGD(rest, lr=LR)
    decay = ColinearityDecay(model, lam=LAM)
    _zero_grads(model)

    def update(skip_first: bool, skip_second: bool) -> None:
        first.found_inf = torch.tensor(float(skip_first), dtype=torch.float64)
        second.found_inf = torch.tensor(float(skip_second), dtype=torch.float64)
        decay.apply_for(first)
        decay.apply_for(second, count=False)

    P = snapshot(model)
    update(True, True)
    assert changed(model, P) == [] and _norm_keys(decay) == set() and decay.metrics()["cd/updates"] == 0
    update(True, False)  # the functional pairs' W2 (proj, fc2) move; qkv and fc1 do not
    assert set(changed(model, P)) == {f"blocks.{i}.{layer}.weight" for i in range(VIT_DEPTH)
                                      for layer in ("attn.proj", "mlp.fc2")}
    got = {k: v for k, v in decay.metrics().items() if k.startswith("cd/update_norm/")}
    assert got == pytest.approx(_change_norms(model, P, ("proj", "fc2")), rel=1e-9)
    assert decay.metrics()["cd/updates"] == 1


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), float("-inf")])
def test_a_cpu_tensor_lr_that_is_negative_or_not_finite_is_refused_as_a_number_is(bad):
    # a CPU tensor's value costs nothing to read: a negative lr would raise the pair energy, a NaN one would make every
    # decayed weight NaN; refused with the message a Python float gets, and nothing moves
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=LAM)
    before = snapshot(model)
    for lr in (bad, torch.tensor(bad), torch.tensor(bad, dtype=torch.float64)):
        with pytest.raises(ValueError, match=r"^ColinearityDecay\.apply: lr must be a finite number >= 0, got "):
            decay.apply(lr)
    assert changed(model, before) == []
    assert decay.num_updates == 0
