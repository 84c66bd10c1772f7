"""ColinearityDecay as used by a trainer: the optimizer pre-hook (group lr, GradScaler skips, fused
optimizers, accumulation), loss mode, metrics, state, config and the weight-decay budget."""
from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import cd.decay
from cd import ColinearityDecay, budget_weight_decay, find_pairs
from cd.update import colinearity_decay_
from cd_models import VIT_DEPTH, changed, normalized, ref_block_update, snapshot, tiny_vit
from configs import load_config


def _zero_grads(model):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def _batch(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def _assert_cd_applied(model, P, steps_by_block, rtol=1e-10):
    expected = {}
    for i, step in enumerate(steps_by_block):
        ref_block_update(P, f"blocks.{i}", step, expected)
    params = dict(model.named_parameters())
    for name, want in expected.items():
        torch.testing.assert_close(params[name].detach().double(), want, rtol=rtol, atol=rtol * 1e-2)
    assert set(changed(model, P)) == set(expected)


def test_hook_applies_one_update_per_step_with_each_groups_current_lr():
    model = tiny_vit().double()
    lam = 0.2
    b0 = [p for n, p in model.named_parameters() if n.startswith("blocks.0.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.0.")]
    # SGD without momentum/decay on zero gradients leaves the weights alone: only CD moves them.
    opt = torch.optim.SGD([{"params": b0, "lr": 0.1}, {"params": rest, "lr": 0.5}], lr=0.5)
    decay = ColinearityDecay(model, lam=lam)
    decay.attach(opt)
    P = snapshot(model)
    _zero_grads(model)
    opt.step()
    _assert_cd_applied(model, P, [0.1 * lam, 0.5 * lam])
    assert decay.num_updates == 1

    # a scheduler changes the lr between steps: the hook reads it at step time
    opt.param_groups[0]["lr"] = 0.3
    P = snapshot(model)
    opt.step()
    _assert_cd_applied(model, P, [0.3 * lam, 0.5 * lam])
    assert decay.metrics()["cd/updates"] == 2



def test_the_group_lr_follows_params_moved_between_groups_of_the_same_sizes():
    """The param-group index is cached; a regrouping that keeps every group's length (two blocks' matrices
    exchanged, or a new optimizer of the same shape at a freed one's address) must not reuse it."""
    model = tiny_vit().double()
    lam = 0.2
    blocks = [[p for n, p in model.named_parameters() if n.startswith(f"blocks.{i}.")] for i in range(VIT_DEPTH)]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    opt = torch.optim.SGD([{"params": blocks[0], "lr": 0.1}, {"params": blocks[1], "lr": 0.5},
                           {"params": rest, "lr": 0.0}], lr=0.5)
    ColinearityDecay(model, lam=lam).attach(opt)
    _zero_grads(model)
    opt.step()
    opt.param_groups[0]["params"], opt.param_groups[1]["params"] = blocks[1], blocks[0]
    P = snapshot(model)
    opt.step()
    _assert_cd_applied(model, P, [0.5 * lam, 0.1 * lam])

def test_handle_removes_the_hook_and_lam_zero_hook_is_bit_identical():
    model = tiny_vit()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    handle = ColinearityDecay(model, lam=0.2).attach(opt)
    handle.remove()
    ColinearityDecay(model, lam=0.0).attach(opt)
    P = snapshot(model)
    _zero_grads(model)
    opt.step()
    assert changed(model, P) == []


def test_lam_zero_counts_no_update_and_says_nothing_about_weight_precision():
    """Every strength 0 makes no update (the apply() docstring: 'no work'): cd/updates stays 0 through
    attached steps, and bf16 weights, whose rounding only matters to an update that runs, are not
    warned about."""
    model = tiny_vit().bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    decay = ColinearityDecay(model, lam=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning here fails the test
        decay.attach(opt)
        _zero_grads(model)
        opt.step()
    assert decay.metrics()["cd/updates"] == 0.0


def test_lam_zero_training_is_bit_identical_to_no_cd():
    runs = []
    for with_cd in (False, True):
        model = tiny_vit()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
        if with_cd:
            ColinearityDecay(model, lam=0.0).attach(opt)
        for s in range(2):
            x, y = _batch(s)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        runs.append(snapshot(model))
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def test_gradscaler_skipped_step_applies_no_cd_and_a_real_step_applies_one():
    model = tiny_vit()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # non-fused: GradScaler skips step() on overflow
    decay = ColinearityDecay(model, lam=0.5)
    decay.attach(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    reference = copy.deepcopy(model)  # same weights, stepped by hand: CD then AdamW
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_decay = ColinearityDecay(reference, lam=0.5)

    x, y = _batch(0)
    P = snapshot(model)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    model.blocks[0].mlp.fc2.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    assert changed(model, P) == [] and decay.num_updates == 0
    assert scaler.get_scale() < 2.0 ** 10

    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    assert decay.num_updates == 1
    F.cross_entropy(reference(x), y).backward()
    ref_decay.apply(lr=1e-2)
    ref_opt.step()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_optimizer_under_gradscaler_gates_cd_on_device(device):
    """Fused AdamW is stepped even on overflow; CD must then be a no-op (gated by found_inf)."""
    model = tiny_vit().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0, fused=True)
    assert getattr(opt, "_step_supports_amp_scaling", False)  # the path under test really is taken
    decay = ColinearityDecay(model, lam=0.5)
    decay.attach(opt)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10)
    scaler.scale(torch.ones((), device=device))  # initialise the scale

    P = snapshot(model)
    _zero_grads(model)
    model.blocks[1].attn.proj.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert changed(model, P) == []
    assert decay.metrics()["cd/updates"] == 0
    assert decay.state_dict()["num_updates"] == 0  # a checkpoint does not count the skipped step either

    _zero_grads(model)  # Adam on zero gradients without weight decay moves nothing: only CD does
    scaler.step(opt)
    scaler.update()
    expected = copy.deepcopy(tiny_vit()).to(device)
    expected.load_state_dict({n: P[n] for n in P})
    ColinearityDecay(expected, lam=0.5).apply(lr=0.1)
    for (n, p), q in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8, msg=n)
    assert changed(model, P) and decay.metrics()["cd/updates"] == 1
    resumed = ColinearityDecay(model, lam=0.5)
    resumed.load_state_dict(decay.state_dict())
    assert resumed.metrics()["cd/updates"] == 1  # one skipped and one real step: 1 after resume too


def test_gradient_accumulation_applies_cd_once_per_optimizer_update(monkeypatch):
    calls = []
    real = cd.decay.colinearity_decay_
    monkeypatch.setattr(cd.decay, "colinearity_decay_", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_vit()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    decay = ColinearityDecay(model, lam=0.005)
    decay.attach(opt)
    updates, accum = 3, 4
    for u in range(updates):
        for m in range(accum):
            x, y = _batch(u * accum + m, n=2)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y) / accum
            loss.backward()
        opt.step()
        opt.zero_grad()
    assert len(calls) == updates and decay.num_updates == updates


def test_attach_rejects_an_optimizer_without_the_decayed_matrices():
    model = tiny_vit()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not in the optimizer"):
        ColinearityDecay(model).attach(opt)


def test_metrics_energy_and_update_norm_match_independent_values():
    model = tiny_vit().double()
    P = snapshot(model)
    decay = ColinearityDecay(model, lam=0.2)
    m0 = decay.metrics()
    want_fc2 = sum((P[f"blocks.{i}.mlp.fc2.weight"] @ normalized(P[f"blocks.{i}.mlp.fc1.weight"]))
                   .square().sum() for i in range(VIT_DEPTH)) / VIT_DEPTH
    want_qkv = sum((P[f"blocks.{i}.attn.qkv.weight"] @ normalized(torch.diag(P[f"blocks.{i}.norm1.weight"])))
                   .square().sum() for i in range(VIT_DEPTH)) / VIT_DEPTH
    assert math.isclose(m0["cd/pair_energy/fc2"], float(want_fc2), rel_tol=1e-9)
    assert math.isclose(m0["cd/pair_energy/qkv"], float(want_qkv), rel_tol=1e-9)
    assert not any(k.startswith("cd/update_norm/") for k in m0)
    decay.apply(lr=0.5)
    m1 = decay.metrics()
    assert set(m1) >= {f"cd/{k}/{r}" for k in ("pair_energy", "update_norm")
                       for r in ("qkv", "proj", "fc1", "fc2")}
    moved = math.sqrt(sum(
        float((P[f"blocks.{i}.mlp.fc2.weight"] - model.blocks[i].mlp.fc2.weight.detach()).square().sum())
        for i in range(VIT_DEPTH)))
    assert math.isclose(m1["cd/update_norm/fc2"], moved, rel_tol=1e-9)
    assert m1["cd/pair_energy/fc2"] < m0["cd/pair_energy/fc2"]  # CD lowers the energy it targets


def test_loss_mode_is_aligned_to_the_task_loss_and_reaches_only_decayed_matrices():
    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=0.005, mode="loss", loss_coef=0.01)
    P = snapshot(model)
    task = torch.tensor(2.5, dtype=torch.float64)
    aux = decay.aux_loss(task)
    assert math.isclose(float(aux.detach()), 0.01 * 2.5, rel_tol=1e-6)
    aux.backward()
    ratio = 2.5 / decay.metrics()["cd/penalty"]
    fc2, fc1 = model.blocks[0].mlp.fc2.weight, model.blocks[0].mlp.fc1.weight
    w1n = normalized(P["blocks.0.mlp.fc1.weight"])
    torch.testing.assert_close(fc2.grad, 0.01 * ratio * 2 * P["blocks.0.mlp.fc2.weight"] @ w1n @ w1n.T)
    g2n = normalized(torch.diag(P["blocks.0.norm2.weight"]))
    # fc1's gradient comes from its own (norm2, fc1) pair only: the (fc1, fc2) pair's W1 is detached
    torch.testing.assert_close(fc1.grad, 0.01 * ratio * 2 * P["blocks.0.mlp.fc1.weight"] @ g2n @ g2n.T)
    assert model.blocks[0].norm1.weight.grad is None and model.head.weight.grad is None


def test_decoupled_mode_has_no_aux_loss():
    with pytest.raises(RuntimeError, match="mode='loss'"):
        ColinearityDecay(tiny_vit()).aux_loss(torch.tensor(1.0))


def test_state_dict_round_trip_and_config_mismatch_warning():
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.01)
    decay.apply(lr=1e-3)
    decay.apply(lr=1e-3)
    state = decay.state_dict()
    assert state["num_updates"] == 2 and state["config"]["lam"] == 0.01
    again = ColinearityDecay(model, lam=0.01)
    again.load_state_dict(state)
    assert again.num_updates == 2
    with pytest.warns(UserWarning, match="different CD config"):
        ColinearityDecay(model, lam=0.02).load_state_dict(state)


def test_states_of_earlier_versions_load():
    """What state_dict() wrote before `steps` was kept, and what the HF callback restores from a checkpoint of a
    version that saved no config (config None)."""
    decay = ColinearityDecay(tiny_vit(), lam=0.01)
    config = decay.state_dict()["config"]
    decay.load_state_dict({"num_updates": 3, "config": config})
    assert (decay.num_updates, decay.state_dict()["steps"]) == (3, 3)
    decay.load_state_dict({"num_updates": 4, "steps": 6, "config": None})
    assert (decay.num_updates, decay.state_dict()["steps"]) == (4, 6)


@pytest.mark.parametrize("state, error, match", [
    ({"foo": 1}, ValueError, r"unknown key\(s\) \['foo'\]; no key\(s\) \['num_updates', 'config'\]"),
    ("model", ValueError, r"unknown key\(s\) \['cls_token'"),
    ({"num_updates": 5}, ValueError, r"no key\(s\) \['config'\]"),
    ({"num_updates": -5, "config": None}, ValueError, "num_updates must be >= 0, got -5"),
    ({"num_updates": 1, "steps": -1, "config": None}, ValueError, "steps must be >= 0, got -1"),
    ({"num_updates": "7", "config": None}, TypeError, "num_updates must be an integer, got '7'"),
    ({"num_updates": 7.0, "config": None}, TypeError, "num_updates must be an integer, got 7.0"),
    ({"num_updates": True, "config": None}, TypeError, "num_updates must be an integer, got True"),
    ({"num_updates": 1, "config": "lam=0.01"}, TypeError, "config must be a mapping, got str"),
    ([("num_updates", 1)], TypeError, "got list"),
])
def test_a_state_that_state_dict_did_not_write_is_refused_and_loads_nothing(state, error, match):
    """A model's state_dict (or any other mapping) loaded as 0 updates without a word, and a negative or string
    counter was taken as given."""
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.01)
    decay.apply(lr=1e-3)
    state = model.state_dict() if state == "model" else state
    with pytest.raises(error, match=rf"^ColinearityDecay\.load_state_dict: .*{match}.*; pass the mapping "
                                    r"ColinearityDecay\.state_dict\(\) returned"):
        decay.load_state_dict(state)
    assert decay.metrics()["cd/updates"] == 1


def test_matrices_that_are_views_of_one_buffer_without_overlap_are_decayed_each_once():
    """Parameters may share a storage without sharing memory (a checkpoint loaded with assign=True from one mapped
    file): each is its own matrix, updated once as the reference update says; only overlapping memory is refused."""
    model = tiny_vit().double()
    w = model.blocks[0].mlp.fc2.weight
    buffer = torch.cat([model.blocks[0].mlp.fc2.weight.detach().flatten(),
                        model.blocks[1].mlp.fc2.weight.detach().flatten()])
    model.blocks[0].mlp.fc2.weight = torch.nn.Parameter(buffer[:w.numel()].view(w.shape))
    model.blocks[1].mlp.fc2.weight = torch.nn.Parameter(buffer[w.numel():].view(w.shape))
    lam, lr = 0.2, 0.5
    decay = ColinearityDecay(model, lam=lam)
    P = snapshot(model)
    decay.apply(lr)
    _assert_cd_applied(model, P, [lr * lam] * VIT_DEPTH)


def test_matrices_that_are_interleaved_views_of_one_buffer_are_decayed_each_once():
    """Views of one buffer whose bytes interleave (block b's matrix big[:, b, :], a buffer of shape (out, blocks,
    in)) span overlapping memory and share no element: separate matrices, each updated once as the reference says."""
    model = tiny_vit().double()
    w = model.blocks[0].attn.proj.weight
    big = torch.stack([model.blocks[b].attn.proj.weight.detach() for b in range(VIT_DEPTH)], dim=1)  # (out, 2, in)
    for b in range(VIT_DEPTH):
        model.blocks[b].attn.proj.weight = torch.nn.Parameter(big[:, b, :])
    views = [model.blocks[b].attn.proj.weight for b in range(VIT_DEPTH)]
    assert views[1].data_ptr() < views[0].data_ptr() + w.nbytes  # their spans overlap
    lam, lr = 0.2, 0.5
    decay = ColinearityDecay(model, lam=lam)
    P = snapshot(model)
    decay.apply(lr)
    _assert_cd_applied(model, P, [lr * lam] * VIT_DEPTH)


class _Wrapped(torch.Tensor):
    """A minimal wrapper tensor subclass (as torchao's float8 weights, fake tensors): its values are in `inner`,
    its own storage a placeholder without an address (its data pointer refused)."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device,
                                                   strides=inner.stride(), requires_grad=inner.requires_grad)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, _Wrapped) else x  # noqa: E731
        out = func(*torch.utils._pytree.tree_map(unwrap, args),
                   **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        return _Wrapped(out) if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) else out


def test_a_weight_that_is_a_wrapper_tensor_subclass_is_decayed_as_the_reference_says():
    """A wrapper subclass has no memory of its own to compare for sharing (its storage's data pointer is refused):
    CD compares it as a tensor, builds, and updates its values (in `inner`) as the reference does."""
    model = tiny_vit().double()
    for block in model.blocks:
        for linear in (block.attn.proj, block.mlp.fc2):
            linear.weight = torch.nn.Parameter(_Wrapped(linear.weight.detach().clone()))
    with pytest.raises(RuntimeError, match="invalid python storage"):
        model.blocks[0].mlp.fc2.weight.untyped_storage().data_ptr()
    lam, lr = 0.2, 0.5
    decay = ColinearityDecay(model, lam=lam)
    assert len(decay.pairs) == 4 * VIT_DEPTH
    P = {name: (p.inner if isinstance(p, _Wrapped) else p).detach().clone() for name, p in model.named_parameters()}
    decay.apply(lr)
    expected = {}
    for i in range(VIT_DEPTH):
        ref_block_update(P, f"blocks.{i}", lr * lam, expected)
    params = {name: p.inner if isinstance(p, _Wrapped) else p for name, p in model.named_parameters()}
    for name, want in expected.items():
        torch.testing.assert_close(params[name].detach(), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("saved, changed_setting", [
    ({}, dict(lam=0.02)), ({}, dict(lam_per_role={"fc2": 0.02})), ({}, dict(targets="B")), ({}, dict(mode="loss")),
    (dict(mode="loss"), dict(loss_coef=0.3))])
def test_resuming_with_any_other_setting_that_changes_cd_warns(saved, changed_setting):
    """Each setting that changes the update (or the loss-form term) is in the checkpoint's config echo: resuming
    with another value of it is said, not silent."""
    model = tiny_vit()
    state = ColinearityDecay(model, lam=0.01, **saved).state_dict()
    with pytest.warns(UserWarning, match="different CD config"):
        ColinearityDecay(model, **{"lam": 0.01, **saved, **changed_setting}).load_state_dict(state)


def test_from_config_and_bad_arguments():
    cfg = load_config(None, ["cd.enabled=true", "cd.lam=0.01", "cd.lam_per_role.fc2=0.02", "cd.targets=B"])
    decay = ColinearityDecay.from_config(cfg.cd, tiny_vit())
    assert ((decay.lam, decay.lam_per_role, decay.targets, decay.mode)
            == (0.01, {"fc2": 0.02}, "B", "decoupled"))
    assert {p.role for p in decay.pairs} == {"proj", "fc2"}
    with pytest.raises(ValueError, match="unknown role"):
        ColinearityDecay(tiny_vit(), lam_per_role={"fc3": 0.1})
    with pytest.raises(ValueError, match="targets"):
        ColinearityDecay(tiny_vit(), targets="D")
    with pytest.raises(ValueError, match=">= 0"):
        ColinearityDecay(tiny_vit(), lam=-0.1)


def test_from_config_honours_loss_coef_and_matmul_precision():
    """cd.loss_coef scales the loss-form term, whose value is loss_coef * task loss (the stabilized scaling), and
    cd.matmul_precision=bf16 really rounds the update's operands: off the float64 reference by bf16's error, where
    fp32 is exact to 1e-6."""
    cfg = load_config(None, ["cd.enabled=true", "cd.mode=loss", "cd.loss_coef=0.3"])
    decay = ColinearityDecay.from_config(cfg.cd, tiny_vit())
    task = torch.tensor(2.5)
    assert math.isclose(float(decay.aux_loss(task).detach()), 0.3 * 2.5, rel_tol=1e-6)

    cfg = load_config(None, ["cd.enabled=true", "cd.lam=0.1", "cd.matmul_precision=bf16"])
    model = tiny_vit()
    P = snapshot(model)
    ColinearityDecay.from_config(cfg.cd, model).apply(lr=0.5)
    expected = {}
    ref_block_update(P, "blocks.0", 0.05, expected)
    name = "blocks.0.mlp.fc2.weight"  # a functional pair: its products are the ones the precision sets
    delta_got = dict(model.named_parameters())[name].detach().double() - P[name].double()
    delta_want = expected[name] - P[name].double()
    error = float((delta_got - delta_want).norm() / delta_want.norm())
    assert 1e-4 < error < 5e-2  # bf16's rounding (unit 2^-8 = 0.004), not another update (cd.lam dropped: 0.95)


def test_weight_decay_budget_rule():
    assert math.isclose(budget_weight_decay(0.05, 0.005), 0.045)
    assert budget_weight_decay(0.005, 0.005) == 0.0
    with pytest.raises(ValueError, match="< 0"):
        budget_weight_decay(0.001, 0.005)


def test_a_budget_below_zero_names_the_fix_outside_train_py_too():
    """budget_weight_decay is public (the README's own-loop example calls it): an optimizer without weight decay
    (SGD) has no budget to take lam from, and the message says what to do in one's own code, not only train.py's
    cd.budget=false."""
    with pytest.raises(ValueError, match=r"< 0; .*cd\.budget=false.*do not call budget_weight_decay") as refusal:
        budget_weight_decay(0.0, 0.005)
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize("weight_decay, lam, name", [
    (float("nan"), 0.005, "weight_decay"), (0.05, float("nan"), "cd.lam"), (float("inf"), 0.005, "weight_decay"),
    (0.05, -0.01, "cd.lam"), (-0.01, 0.0, "weight_decay"), (0.05, True, "cd.lam"), ("0.05", 0.005, "weight_decay"),
])
def test_weight_decay_budget_refuses_values_that_are_no_budget(weight_decay, lam, name):
    """A NaN would reach AdamW as its weight decay (NaN weights from the first step) and a negative lam would
    raise the weight decay: each is refused, naming the value, not returned."""
    bad = weight_decay if name == "weight_decay" else lam
    with pytest.raises(ValueError, match=rf"{name} must be a finite number >= 0, got {re.escape(repr(bad))}$"):
        budget_weight_decay(weight_decay, lam)


def _tf32_flags() -> tuple:
    """What a caller reads back through each cuBLAS TF32 API ('raises' where torch refuses the read)."""
    matmul = torch.backends.cuda.matmul
    try:
        legacy = matmul.allow_tf32
    except RuntimeError:
        legacy = "raises"
    try:  # the global getter (inductor's and Lightning's read), which raises for a mix of the two APIs
        whole = torch.get_float32_matmul_precision()
    except RuntimeError:
        whole = "raises"
    return legacy, getattr(matmul, "fp32_precision", None), whole


@pytest.mark.parametrize("api,value", [("legacy", True), ("legacy", False), ("new", "tf32"),
                                       ("new", "ieee"), ("new", "none"), ("global", "medium"),
                                       ("global", "high"), (None, None)])
@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_attach_steps_whichever_tf32_api_the_caller_used_and_leaves_it_as_set(api, value, precision):
    # torch >= 2.9: a caller setting TF32 through fp32_precision made the legacy read in CD raise at the
    # first optimizer.step(). The flags are process-wide host settings, so this runs without CUDA; ColinearityDecay
    # refuses an explicit tf32 off CUDA at the first update (tests/test_cd_tf32_device.py), so the tf32 products
    # run through the pure function on this CPU model.
    matmul = torch.backends.cuda.matmul
    if api == "new" and getattr(matmul, "fp32_precision", None) is None:
        pytest.skip("torch < 2.9 has only the legacy TF32 flag")
    saved = _tf32_flags()
    mkldnn_saved = getattr(torch.backends.mkldnn.matmul, "fp32_precision", None)
    try:
        if api == "legacy":
            matmul.allow_tf32 = value
        elif api == "new":
            matmul.fp32_precision = value
        elif api == "global":  # 'medium' (Lightning's advice): CD's restore made the global getter raise after
            torch.set_float32_matmul_precision(value)
        before = _tf32_flags()
        model = tiny_vit()
        if precision == "tf32":
            pairs = find_pairs(model)
            colinearity_decay_(pairs, [5e-6] * len(pairs), precision=precision)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            decay = ColinearityDecay(model, lam=0.005, matmul_precision=precision)
            decay.attach(opt)
            model(torch.randn(2, 3, 32, 32)).sum().backward()
            opt.step()
            assert decay.num_updates == 1
        assert _tf32_flags() == before  # read back through each API as the caller set it
    finally:
        if api == "global" and saved[2] != "raises":
            torch.set_float32_matmul_precision(saved[2])
        if api == "global" and mkldnn_saved is not None:  # 'medium' sets oneDNN's CPU matmuls to bf16 too
            torch.backends.mkldnn.matmul.fp32_precision = mkldnn_saved
        if saved[0] != "raises":
            matmul.allow_tf32 = saved[0]
        if saved[1] is not None:
            matmul.fp32_precision = saved[1]


def test_gated_mlp_config_switch_reaches_the_pairs():
    """cd.gated_mlp (off by default) is what ColinearityDecay.from_config passes to find_pairs."""
    import timm
    from timm.layers import SwiGLU

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1,
                              num_heads=2, num_classes=3, mlp_layer=SwiGLU, act_layer=torch.nn.SiLU)
    with pytest.raises(ValueError, match=r"'blocks.0' \(Block\).*gated MLP SwiGLU"):
        ColinearityDecay.from_config(load_config(None, []).cd, model)
    decay = ColinearityDecay.from_config(load_config(None, ["cd.gated_mlp=true"]).cd, model)
    assert [(p.role, p.name) for p in decay.pairs][2:] == [
        ("fc1", "blocks.0.mlp.fc1_g.weight"), ("fc1", "blocks.0.mlp.fc1_x.weight"), ("fc2", "blocks.0.mlp.fc2.weight")]
    assert decay.state_dict()["config"]["gated_mlp"] is True


def test_loss_mode_target_c_differentiates_w1_with_the_normalizer_held_constant():
    """Target C in loss mode: W1 of a functional pair gets the gradient of ||W2 W1 c||_F^2 at fixed
    c = sqrt(r)/||W1||_F (as the decoupled target-C update), checked against the closed form 2 c^2 W2^T W2 W1."""
    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=0.005, mode="loss", loss_coef=0.01, targets="C")
    P = snapshot(model)
    task = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    decay.aux_loss(task).backward()
    assert task.grad is None or float(task.grad) == 0.0  # the alignment factor carries no gradient
    ratio = 2.5 / decay.metrics()["cd/penalty"]
    fc1, fc2 = P["blocks.0.mlp.fc1.weight"], P["blocks.0.mlp.fc2.weight"]
    c2 = fc1.shape[0] / fc1.norm() ** 2
    torch.testing.assert_close(model.blocks[0].mlp.fc1.weight.grad, 0.01 * ratio * 2 * c2 * fc2.T @ fc2 @ fc1)
    w1n = normalized(fc1)
    torch.testing.assert_close(model.blocks[0].mlp.fc2.weight.grad, 0.01 * ratio * 2 * fc2 @ w1n @ w1n.T)
    assert model.blocks[0].norm2.weight.grad is None


def test_weight_decay_budget_refuses_any_shortfall():
    """wd - lam below 0 by more than rounding (here 5e-4) is refused, never clamped to 0 in silence."""
    with pytest.raises(ValueError, match="< 0"):
        budget_weight_decay(0.0045, 0.005)
    assert budget_weight_decay(0.3, 0.1 + 0.2) == 0.0  # float rounding (-5.6e-17) of an exact budget is none


def test_apply_refuses_a_meta_lr_before_it_changes_anything():
    """A 0-dim lr on the meta device has no value: the update failed inside torch with a bare NotImplementedError
    ("Cannot copy out of meta tensor"), naming neither the lr nor the fix; it is refused, the weights untouched."""
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.005)
    P = snapshot(model)
    with pytest.raises(ValueError, match=r"^ColinearityDecay\.apply: lr is a tensor on the meta device"):
        decay.apply(torch.tensor(0.1, device="meta"))
    assert changed(model, P) == [] and decay.num_updates == 0


def test_loss_mode_refuses_apply_and_an_attached_step_without_aux_loss():
    """Loss mode: apply() did nothing and an attached optimizer's hook never acted, silently, so a loop that attached
    and forgot aux_loss trained without CD. apply is refused (as aux_loss is in decoupled mode); a step with no
    aux_loss taken since the last one (or the attach; one taken under no_grad trains nothing) is refused before it
    changes anything; a step after aux_loss(...).backward() is the loss form's alone: W2 -= lr * the closed-form
    gradient 0.01 * ratio * 2 W2 W1n W1n^T of the aligned penalty (eq. 8; no decoupled eq. 12 update on top)."""
    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=0.005, mode="loss", loss_coef=0.01)
    P = snapshot(model)
    with pytest.raises(RuntimeError, match=r"^ColinearityDecay\.apply is for mode='decoupled'; .*aux_loss"):
        decay.apply(lr=1.0)
    decay.aux_loss(torch.tensor(1.0, dtype=torch.float64)).backward()  # before attach: no step's
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    decay.attach(opt)
    with torch.no_grad():
        decay.aux_loss(torch.tensor(1.0, dtype=torch.float64))  # an evaluation's: no gradient
    _zero_grads(model)
    refused = r"^ColinearityDecay\.attach: the attached SGD steps, but no aux_loss\(task_loss\) was taken since its"
    with pytest.raises(RuntimeError, match=refused):
        opt.step()
    assert changed(model, P) == []
    _zero_grads(model)
    decay.aux_loss(torch.tensor(2.5, dtype=torch.float64)).backward()
    ratio = 2.5 / decay.metrics()["cd/penalty"]
    opt.step()
    w2, w1n = P["blocks.0.mlp.fc2.weight"], normalized(P["blocks.0.mlp.fc1.weight"])
    torch.testing.assert_close(model.blocks[0].mlp.fc2.weight.detach(), w2 - 0.5 * 0.01 * ratio * 2 * w2 @ w1n @ w1n.T)
    with pytest.raises(RuntimeError, match=refused):  # the next step needs a term of its own
        opt.step()

    def closure():  # a step whose backward runs inside it: the term is taken there, before the hook checks
        opt.zero_grad()
        loss = decay.aux_loss(torch.tensor(2.5, dtype=torch.float64))
        loss.backward()
        return loss
    opt.step(closure)
    other = tiny_vit()
    off = ColinearityDecay(other, lam=0.0, mode="loss")  # every strength 0: no CD to miss
    plain = torch.optim.SGD(other.parameters(), lr=0.1)
    off.attach(plain)
    plain.step()


@pytest.mark.parametrize("task_loss, got", [(2.5, "float"), (torch.tensor([1.0, 4.0]), r"shape \(2,\)")],
                         ids=["number", "per-sample"])
def test_aux_loss_refuses_a_task_loss_other_than_a_0_dim_tensor(task_loss, got):
    """A number failed with "'float' object has no attribute 'device'"; a per-sample loss gave a term per sample, each
    aligned to its own sample's loss, where the term is loss_coef * |the batch's loss| (eq. 8, stabilized)."""
    decay = ColinearityDecay(tiny_vit(), mode="loss")
    refused = rf"^ColinearityDecay\.aux_loss: task_loss must be the 0-dim tensor .*got {got}"
    with pytest.raises(TypeError, match=refused):
        decay.aux_loss(task_loss)
    assert decay._last_penalty is None


def test_aux_loss_and_metrics_refuse_parameters_replaced_after_the_pairs_were_found():
    """After load_state_dict(assign=True) the pairs hold tensors the model no longer uses: apply refused them, but the
    loss form's penalty sent its gradient there (the model's own fc2 got none: trained without CD), and metrics logged
    the old tensors' energies (constant curves). Both are refused as apply is, naming the cause."""
    model = tiny_vit()
    loss_form, decoupled = ColinearityDecay(model, mode="loss"), ColinearityDecay(model)
    model.load_state_dict({k: v.clone() for k, v in tiny_vit().state_dict().items()}, assign=True)
    replaced = r"^ColinearityDecay: the model's parameter blocks\.0\..* is no longer the tensor its pairs were found on"
    with pytest.raises(ValueError, match=replaced):
        loss_form.aux_loss(torch.tensor(2.0))
    assert model.blocks[0].mlp.fc2.weight.grad is None and loss_form._last_penalty is None
    for decay in (loss_form, decoupled):
        with pytest.raises(ValueError, match=replaced):
            decay.metrics()


def test_loss_mode_leaves_pairs_whose_decayed_matrices_are_frozen_out_of_the_penalty():
    """A frozen stage (block 0, requires_grad=False) in loss mode: its pairs' energies, constants to the optimizer,
    were summed into the penalty that the term aligns to the task loss, so the trained block's gradient was scaled by
    E(block 1) / E(all) (here about 1/2; 1/12 for a ViT-B with 11 blocks frozen) and cd/penalty logged the frozen
    energies. A pair is in the penalty while a matrix it decays trains: target C's (fc1, fc2) with fc2 frozen is
    (fc1 gets the gradient), and block 0, frozen whole, is not. Checked against the closed forms of the penalty of
    block 1's two functional pairs (naive float64 energies)."""
    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=0.005, mode="loss", loss_coef=0.01, targets="C")
    model.blocks[0].requires_grad_(False)
    model.blocks[1].mlp.fc2.weight.requires_grad_(False)
    P = snapshot(model)
    dim = P["blocks.1.attn.proj.weight"].shape[0]
    proj, v = P["blocks.1.attn.proj.weight"], P["blocks.1.attn.qkv.weight"][2 * dim:]
    fc1, fc2 = P["blocks.1.mlp.fc1.weight"], P["blocks.1.mlp.fc2.weight"]
    penalty = float((proj @ normalized(v)).square().sum() + (fc2 @ normalized(fc1)).square().sum())
    decay.aux_loss(torch.tensor(2.5, dtype=torch.float64)).backward()
    assert math.isclose(decay.metrics()["cd/penalty"], penalty, rel_tol=1e-12)
    ratio = 0.01 * 2.5 / penalty
    w1n = normalized(v)
    torch.testing.assert_close(model.blocks[1].attn.proj.weight.grad, ratio * 2 * proj @ w1n @ w1n.T)
    c2 = fc1.shape[0] / fc1.norm() ** 2
    torch.testing.assert_close(model.blocks[1].mlp.fc1.weight.grad, ratio * 2 * c2 * fc2.T @ fc2 @ fc1)
    assert all(p.grad is None for p in model.blocks[0].parameters())
    model.requires_grad_(False)  # every decayed matrix frozen: a zero term, no gradient
    term = decay.aux_loss(torch.tensor(2.5, dtype=torch.float64))
    assert float(term) == 0.0 and not term.requires_grad and decay.metrics()["cd/penalty"] == 0.0
