"""The CD update against independent float64 references (paper Sec. 3.3, Eq. (12) + App. A.2, Eq. (24)).

The references (`ref_w2`, `ref_block_update` in tests/cd_models.py) are written from parameter names, with
explicit V-row slicing and full matrices (diag(g) as a matrix), never with cd/'s own helpers.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import cd.decay
from cd import ColinearityDecay, UnsupportedModelError, find_pairs, pair_energy_source
from cd.update import align_to_task_loss, colinearity_decay_, pair_energy, pair_penalty
from cd_models import (SWIN_DEPTHS, VIT_DEPTH, changed, normalized, randomize_norms, ref_block_update, ref_w2,
                       snapshot, tiny_swin, tiny_vit)


def _assert_update_matches(model, P, expected, tol):
    params = dict(model.named_parameters())
    for name, want in expected.items():
        got = params[name].detach().double()
        delta_want = want - P[name].double()
        delta_got = got - P[name].double()
        assert delta_want.norm() > 1e-3, name  # the update is not trivially small
        err = (delta_got - delta_want).norm() / delta_want.norm()
        assert err < tol, f"{name}: relative error {err:.2e}"
    assert set(changed(model, P)) == set(expected)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_vit_update_matches_float64_reference(dtype, tol):
    model = tiny_vit().to(dtype)
    P = snapshot(model)
    lr, lam = 0.5, 0.1
    ColinearityDecay(model, lam=lam).apply(lr=lr)
    expected = {}
    for i in range(VIT_DEPTH):
        ref_block_update(P, f"blocks.{i}", lr * lam, expected)
    _assert_update_matches(model, P, expected, tol)


def test_swin_update_matches_float64_reference():
    model = tiny_swin()
    P = snapshot(model)
    lr, lam = 0.5, 0.1
    ColinearityDecay(model, lam=lam).apply(lr=lr)
    expected = {}
    for s, depth in enumerate(SWIN_DEPTHS):
        if s > 0:  # timm: patch merging at the start of stages 1..3
            ds = f"layers.{s}.downsample"
            expected[f"{ds}.reduction.weight"] = ref_w2(P[f"{ds}.reduction.weight"],
                                                         torch.diag(P[f"{ds}.norm.weight"]), lr * lam)
        for j in range(depth):
            ref_block_update(P, f"layers.{s}.blocks.{j}", lr * lam, expected)
    _assert_update_matches(model, P, expected, 1e-5)


def test_update_is_half_step_times_autograd_gradient_of_normalized_energy():
    """W2 delta == lr*lam/2 * d||W2 W1n||_F^2 / dW2 with W1 (and its normalization) held fixed, float64."""
    model = tiny_vit().double()
    P = snapshot(model)
    lr, lam = 0.3, 0.2
    ColinearityDecay(model, lam=lam).apply(lr=lr)
    params = dict(model.named_parameters())
    b = "blocks.1"
    d = P[f"{b}.attn.qkv.weight"].shape[0] // 3
    cases = {f"{b}.attn.qkv.weight": torch.diag(P[f"{b}.norm1.weight"]),
             f"{b}.attn.proj.weight": P[f"{b}.attn.qkv.weight"][2 * d:],
             f"{b}.mlp.fc1.weight": torch.diag(P[f"{b}.norm2.weight"]),
             f"{b}.mlp.fc2.weight": P[f"{b}.mlp.fc1.weight"]}
    for name, w1 in cases.items():
        w2 = P[name].clone().requires_grad_(True)
        w1 = w1.clone()  # no grad: held fixed
        energy = (w2 @ (w1 * math.sqrt(w1.shape[0]) / w1.norm())).square().sum()
        (grad,) = torch.autograd.grad(energy, w2)
        torch.testing.assert_close(P[name] - params[name].detach(), lr * lam / 2 * grad,
                                   rtol=1e-10, atol=1e-13)


def test_all_updates_use_pre_step_weights():
    """fc1 is downstream (norm2 -> fc1) and upstream (fc1 -> fc2): fc2's update must use the old fc1."""
    model = tiny_vit().double()
    P = snapshot(model)
    step = 0.5 * 0.4
    ColinearityDecay(model, lam=0.4).apply(lr=0.5)
    fc1_new = model.blocks[0].mlp.fc1.weight.detach()
    fc2_new = model.blocks[0].mlp.fc2.weight.detach()
    from_old = ref_w2(P["blocks.0.mlp.fc2.weight"], P["blocks.0.mlp.fc1.weight"], step)
    from_new = ref_w2(P["blocks.0.mlp.fc2.weight"], fc1_new, step)
    assert not torch.allclose(from_old, from_new, rtol=0, atol=1e-9)  # the test can tell them apart
    torch.testing.assert_close(fc2_new, from_old, rtol=1e-10, atol=1e-12)


def test_lam_zero_is_a_bit_identical_noop():
    model = tiny_vit()
    P = snapshot(model)
    ColinearityDecay(model, lam=0.0).apply(lr=1.0)
    ColinearityDecay(model, lam=0.1).apply(lr=0.0)
    assert changed(model, P) == []


def test_lam_per_role_overrides():
    model = tiny_vit().double()
    P = snapshot(model)
    lr = 0.5
    ColinearityDecay(model, lam=0.0, lam_per_role={"fc2": 0.2}).apply(lr=lr)
    assert sorted(changed(model, P)) == ["blocks.0.mlp.fc2.weight", "blocks.1.mlp.fc2.weight"]
    torch.testing.assert_close(model.blocks[1].mlp.fc2.weight.detach(),
                               ref_w2(P["blocks.1.mlp.fc2.weight"], P["blocks.1.mlp.fc1.weight"], lr * 0.2))

    model = tiny_vit().double()
    ColinearityDecay(model, lam=0.1, lam_per_role={"fc2": 0.3}).apply(lr=lr)
    torch.testing.assert_close(model.blocks[0].mlp.fc2.weight.detach(),
                               ref_w2(P["blocks.0.mlp.fc2.weight"], P["blocks.0.mlp.fc1.weight"], lr * 0.3))
    torch.testing.assert_close(
        model.blocks[0].mlp.fc1.weight.detach(),
        ref_w2(P["blocks.0.mlp.fc1.weight"], torch.diag(P["blocks.0.norm2.weight"]), lr * 0.1))


@pytest.mark.parametrize("targets,roles", [("A", {"attn.qkv", "mlp.fc1"}), ("B", {"attn.proj", "mlp.fc2"}),
                                           ("A+B", {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"})])
def test_targets_select_matrices(targets, roles):
    model = tiny_vit()
    P = snapshot(model)
    ColinearityDecay(model, lam=0.1, targets=targets).apply(lr=1.0)
    assert set(changed(model, P)) == {f"blocks.{i}.{r}.weight" for i in range(VIT_DEPTH) for r in roles}


def test_target_c_decays_both_functional_matrices_with_the_detached_normalizer_gradient():
    model = tiny_vit().double()
    P = snapshot(model)
    lr, lam = 0.5, 0.2
    ColinearityDecay(model, lam=lam, targets="C").apply(lr=lr)
    assert set(changed(model, P)) == {f"blocks.{i}.{r}.weight" for i in range(VIT_DEPTH)
                                      for r in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    for i in range(VIT_DEPTH):
        b = f"blocks.{i}"
        qkv_old, qkv_new = P[f"{b}.attn.qkv.weight"], model.blocks[i].attn.qkv.weight.detach()
        d = qkv_old.shape[0] // 3
        assert torch.equal(qkv_new[:2 * d], qkv_old[:2 * d])  # Q and K rows untouched
        for w1_old, w1_new, w2_name in [(qkv_old[2 * d:], qkv_new[2 * d:], f"{b}.attn.proj.weight"),
                                        (P[f"{b}.mlp.fc1.weight"], model.blocks[i].mlp.fc1.weight.detach(),
                                         f"{b}.mlp.fc2.weight")]:
            w1 = w1_old.clone().requires_grad_(True)
            c = math.sqrt(w1_old.shape[0]) / w1_old.norm()  # the normalization, held constant
            energy = (P[w2_name] @ (c * w1)).square().sum()
            (grad,) = torch.autograd.grad(energy, w1)
            torch.testing.assert_close(w1_old - w1_new, lr * lam / 2 * grad, rtol=1e-10, atol=1e-13)
            # ... and W2 gets the usual update computed from the OLD W1
            torch.testing.assert_close(dict(model.named_parameters())[w2_name].detach(),
                                       ref_w2(P[w2_name], w1_old, lr * lam), rtol=1e-10, atol=1e-12)


def test_pure_function_defers_conflicting_writes():
    """Composable (norm2 -> fc1) plus upstream decay of fc1 (fc1 -> fc2) in one call: both deltas are computed
    from the pre-step fc1 and add up."""
    model = tiny_vit().double()
    P = snapshot(model)
    pairs = find_pairs(model)
    s, s1 = 0.05, 0.07
    up = [s1 if p.role == "fc2" else 0.0 for p in pairs]
    colinearity_decay_(pairs, [s] * len(pairs), up)
    for i in range(VIT_DEPTH):  # every block: the deferred writes of the last one too
        b = f"blocks.{i}"
        fc1, fc2, g2 = P[f"{b}.mlp.fc1.weight"], P[f"{b}.mlp.fc2.weight"], P[f"{b}.norm2.weight"]
        w1n = normalized(torch.diag(g2))
        c2 = fc1.shape[0] / fc1.norm() ** 2
        want = fc1 - s * fc1 @ w1n @ w1n.T - s1 * c2 * fc2.T @ fc2 @ fc1
        torch.testing.assert_close(model.blocks[i].mlp.fc1.weight.detach(), want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(model.blocks[i].mlp.fc2.weight.detach(), ref_w2(fc2, fc1, s),
                                   rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_are_updated_in_fp32_and_keep_their_dtype(dtype):
    model = tiny_vit().to(dtype)
    P = snapshot(model)
    ColinearityDecay(model, lam=0.1).apply(lr=0.5)
    w = model.blocks[0].mlp.fc2.weight
    assert w.dtype == dtype
    want = ref_w2(P["blocks.0.mlp.fc2.weight"], P["blocks.0.mlp.fc1.weight"], 0.05).to(dtype)
    # fp32 math then one rounding to the parameter dtype: at most one ulp from the float64 result
    ulp = torch.finfo(dtype).eps * want.double().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((w.double() - want.double()).abs() <= 1.01 * ulp).all()


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("tf32", 1e-5), ("bf16", 2e-2)])
def test_matmul_precisions_against_the_float64_reference(precision, tol):
    """tf32 products are exact fp32 on a CPU (no TF32 there; ColinearityDecay refuses an explicit tf32 there, so they
    run through the pure function); bf16 rounds the products' operands (8-bit mantissa), so the delta carries an
    error of order 2^-8 relative."""
    model = tiny_vit()
    P = snapshot(model)
    if precision == "tf32":  # every pair of a ViT is decayed (targets A+B) with step lr * lam = 0.05
        pairs = find_pairs(model)
        colinearity_decay_(pairs, [0.05] * len(pairs), precision=precision)
    else:
        ColinearityDecay(model, lam=0.1, matmul_precision=precision).apply(lr=0.5)
    expected = {}
    for i in range(VIT_DEPTH):
        ref_block_update(P, f"blocks.{i}", 0.05, expected)
    _assert_update_matches(model, P, expected, tol)


@pytest.mark.parametrize("targets", ["A+B", "C"])
def test_update_norms_are_optional_and_do_not_change_the_update(targets):
    """norms=True materialises each delta (for logging); the in-place path must write the same weights."""
    fast, logged = tiny_vit().double(), tiny_vit().double()
    logged.load_state_dict(fast.state_dict())
    P = snapshot(fast)
    results = []
    for model, norms in ((fast, False), (logged, True)):
        pairs = [p for p in find_pairs(model) if targets != "C" or p.kind == "functional"]
        up = [0.03 if targets == "C" else 0.0] * len(pairs)
        results.append(colinearity_decay_(pairs, [0.05] * len(pairs), up, norms=norms))
    assert results[0] == {}
    for name, p in logged.named_parameters():
        torch.testing.assert_close(dict(fast.named_parameters())[name], p, rtol=1e-13, atol=1e-15)
    # the returned norm is the norm of the whole role's delta, from the weights before and after
    fc2 = [f"blocks.{i}.mlp.fc2.weight" for i in range(VIT_DEPTH)]
    after = {n: p.detach() for n, p in logged.named_parameters()}
    moved = math.sqrt(sum(float((after[n] - P[n]).norm() ** 2) for n in fc2))
    assert math.isclose(float(results[1]["fc2"]), moved, rel_tol=1e-9)
    if targets == "C":
        assert "fc2_upstream" in results[1] and "qkv" not in results[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("targets", ["A+B", "C"])
def test_weights_are_bitwise_the_same_whatever_norms_every(targets, dtype):
    """norms_every only says when `metrics()` gets the update norms: the weights after several updates with the
    norms on every update are those without them (norms_every past the run) to the bit, in fp32, where a delta
    made and then added rounds otherwise than the fused in-place update, and in bf16 storage (updated in fp32)."""
    runs = []
    for norms_every in (1, 10 ** 9):
        model = tiny_vit(seed=3).to(dtype)
        decay = ColinearityDecay(model, lam=0.5, targets=targets, norms_every=norms_every)
        for step in range(4):
            decay.apply(lr=[0.02, 0.05, 0.01, 0.04][step])
        assert ("cd/update_norm/fc2" in decay.metrics()) == (norms_every == 1)
        runs.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert [n for n in runs[0] if not torch.equal(runs[0][n], runs[1][n])] == []


def test_gate_and_tensor_steps_stay_on_the_device_and_match_float_steps():
    """A 0-dim tensor step (capturable optimizers) and the fused-optimizer gate fold into the update on
    the device; gate 0 leaves every weight bit-identical."""
    a, b, c = tiny_vit().double(), tiny_vit().double(), tiny_vit().double()
    b.load_state_dict(a.state_dict())
    c.load_state_dict(a.state_dict())
    P = snapshot(c)
    pa, pb, pc = find_pairs(a), find_pairs(b), find_pairs(c)
    colinearity_decay_(pa, [0.05] * len(pa))
    colinearity_decay_(pb, [torch.tensor(0.05, dtype=torch.float64)] * len(pb), gate=torch.tensor(True))
    colinearity_decay_(pc, [0.05] * len(pc), gate=torch.tensor(False))
    for name, p in a.named_parameters():
        torch.testing.assert_close(dict(b.named_parameters())[name], p, rtol=1e-13, atol=1e-15)
    assert changed(c, P) == []


def test_update_norms_are_computed_every_norms_every_updates():
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.1, norms_every=3)
    seen = []
    for _ in range(6):
        decay.apply(lr=0.5)
        seen.append("cd/update_norm/fc2" in decay.metrics())
    assert seen == [False, False, True, True, True, True]  # from update 3 on: the one of update 3, then 6
    with pytest.raises(ValueError, match="norms_every"):
        ColinearityDecay(model, norms_every=0)
    with pytest.raises(ValueError, match="matmul_precision"):
        ColinearityDecay(model, matmul_precision="fp8")


def _fc2_change(model: torch.nn.Module, before: dict) -> float:
    """Frobenius norm of the change of every fc2 weight since `before`, all blocks together (measured)."""
    return math.sqrt(sum(float((b.mlp.fc2.weight - before[i]).double().square().sum())
                         for i, b in enumerate(model.blocks)))


def test_norms_every_counts_lr_0_updates_so_the_norm_is_that_of_the_update_at_each_multiple():
    """A warmup from lr 0 (every LM recipe's first update) is an update of the caller's, counted toward
    norms_every: with norms_every=2, after updates 2 and 4 the norm is that of update 2 and 4, measured from the
    weights (it was none after update 2, and update 3's after update 4: only the updates CD ran were counted)."""
    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=0.1, norms_every=2)
    for number, lr in enumerate((0.0, 0.5, 0.3, 0.2), start=1):
        before = [b.mlp.fc2.weight.detach().clone() for b in model.blocks]
        decay.apply(lr=lr)
        if number % 2 == 0:
            assert decay.metrics()["cd/update_norm/fc2"] == pytest.approx(_fc2_change(model, before), rel=1e-9)
    assert decay.metrics()["cd/updates"] == 3


def test_an_attached_optimizers_lr_0_step_is_counted_toward_norms_every_and_kept_over_a_resume():
    """The same through `attach` (train.py's way), with a state_dict/load_state_dict after update 2: the resumed
    object computes the norm of update 4, as the uninterrupted one."""
    model = tiny_vit().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    decay = ColinearityDecay(model, lam=0.1, norms_every=2)
    handle = decay.attach(opt)
    for number, lr in enumerate((0.0, 0.5, 0.3, 0.2), start=1):
        if number == 3:  # a resume: a new object from the saved state
            handle.remove()
            saved, decay = decay.state_dict(), ColinearityDecay(model, lam=0.1, norms_every=2)
            decay.load_state_dict(saved)
            handle = decay.attach(opt)
        for group in opt.param_groups:
            group["lr"] = lr
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # the SGD step itself changes nothing: CD's change alone
        before = [b.mlp.fc2.weight.detach().clone() for b in model.blocks]
        opt.step()
        if number % 2 == 0:
            assert decay.metrics()["cd/update_norm/fc2"] == pytest.approx(_fc2_change(model, before), rel=1e-9)
    assert decay.metrics()["cd/updates"] == 3


def _gated_vit(mlp: str) -> torch.nn.Module:
    """Tiny ViT with SwiGLU MLPs: timm `SwiGLU` (fc1_g, fc1_x, hidden 64) or `GluMlp` packed (fc1 = 2 x 64)."""
    import timm
    from timm.layers import GluMlp, SwiGLU

    torch.manual_seed(0)
    layer = {"swiglu": SwiGLU, "packed": functools.partial(GluMlp, gate_last=False)}[mlp]
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=VIT_DEPTH,
                              num_heads=2, num_classes=10, mlp_layer=layer, act_layer=torch.nn.SiLU,
                              mlp_ratio=2.0 if mlp == "swiglu" else 4.0)
    with torch.no_grad():  # timm starts fc1_g near zero (std 1e-6), which would hide its update
        for block in model.blocks:
            for layer in block.mlp.children():
                if isinstance(layer, torch.nn.Linear):
                    layer.weight.normal_(0, 0.1)
    return randomize_norms(model)


@pytest.mark.parametrize("mlp", ["swiglu", "packed"])
def test_gated_mlp_update_matches_float64_reference(mlp):
    """Opt-in gated pairs: norm2 -> W_gate and W_up (composable), W_up -> W_down (functional; the packed
    fc1's W_up is its second half: GluMlp(gate_last=False) computes act(x1) * x2)."""
    model = _gated_vit(mlp).double()
    with pytest.raises(UnsupportedModelError, match="gated MLP"):
        ColinearityDecay(model)  # off by default: the paper's settings are unchanged
    P = snapshot(model)
    ColinearityDecay(model, lam=0.1, gated_mlp=True).apply(lr=0.5)
    s, expected = 0.05, {}
    for i in range(VIT_DEPTH):
        b = f"blocks.{i}"
        qkv = P[f"{b}.attn.qkv.weight"]
        d = qkv.shape[0] // 3
        expected[f"{b}.attn.qkv.weight"] = ref_w2(qkv, torch.diag(P[f"{b}.norm1.weight"]), s)
        expected[f"{b}.attn.proj.weight"] = ref_w2(P[f"{b}.attn.proj.weight"], qkv[2 * d:3 * d], s)
        g2 = torch.diag(P[f"{b}.norm2.weight"])
        if mlp == "swiglu":
            up = P[f"{b}.mlp.fc1_x.weight"]
            expected[f"{b}.mlp.fc1_g.weight"] = ref_w2(P[f"{b}.mlp.fc1_g.weight"], g2, s)
            expected[f"{b}.mlp.fc1_x.weight"] = ref_w2(up, g2, s)
        else:
            fc1 = P[f"{b}.mlp.fc1.weight"]
            up = fc1[fc1.shape[0] // 2:]
            expected[f"{b}.mlp.fc1.weight"] = ref_w2(fc1, g2, s)
        expected[f"{b}.mlp.fc2.weight"] = ref_w2(P[f"{b}.mlp.fc2.weight"], up, s)
    _assert_update_matches(model, P, expected, 1e-12)


def test_class_attention_update_matches_float64_reference():
    """CaiT's class-attention block: q, k, v each with norm1 (composable), proj with v (functional)."""
    import timm

    torch.manual_seed(0)
    model = randomize_norms(timm.create_model("cait_xxs24_224", img_size=32, patch_size=8, embed_dim=32, depth=1,
                                              num_heads=2, num_classes=3)).double()
    P = snapshot(model)
    ColinearityDecay(model, lam=0.1).apply(lr=0.5)
    params = dict(model.named_parameters())
    b, s = "blocks_token_only.0", 0.05
    g1 = torch.diag(P[f"{b}.norm1.weight"])
    expected = {f"{b}.attn.{n}.weight": ref_w2(P[f"{b}.attn.{n}.weight"], g1, s) for n in "qkv"}
    expected[f"{b}.attn.proj.weight"] = ref_w2(P[f"{b}.attn.proj.weight"], P[f"{b}.attn.v.weight"], s)
    for name, want in expected.items():
        torch.testing.assert_close(params[name].detach(), want, rtol=1e-10, atol=1e-12)


def test_target_c_with_tensor_steps_matches_the_closed_form():
    """Capturable optimizers pass 0-dim tensor steps; target C folds W2's and W1's steps into two factors,
    which must stay separate: W2 <- W2 - s2 W2 W1n W1n^T and W1 <- W1 - s1 c^2 W2^T W2 W1 (old weights)."""
    model = tiny_vit().double()
    P = snapshot(model)
    pairs = [p for p in find_pairs(model) if p.kind == "functional"]
    s2, s1 = 0.05, 0.03
    colinearity_decay_(pairs, [torch.tensor(s2, dtype=torch.float64)] * len(pairs),
                       [torch.tensor(s1, dtype=torch.float64)] * len(pairs), gate=torch.tensor(True))
    b = "blocks.0"
    fc1, fc2 = P[f"{b}.mlp.fc1.weight"], P[f"{b}.mlp.fc2.weight"]
    c2 = fc1.shape[0] / fc1.norm() ** 2
    torch.testing.assert_close(model.blocks[0].mlp.fc2.weight.detach(), ref_w2(fc2, fc1, s2),
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(model.blocks[0].mlp.fc1.weight.detach(), fc1 - s1 * c2 * fc2.T @ fc2 @ fc1,
                               rtol=1e-10, atol=1e-12)


def test_bf16_precision_really_rounds_the_operands():
    """precision='bf16' is a speed setting whose error the docs state (about 2^-8 relative): the products must
    run on bf16-rounded operands, so the delta differs from the float64 reference by more than fp32 rounding,
    yet stays within that bound."""
    model = tiny_vit()
    P = snapshot(model)
    pairs = [p for p in find_pairs(model) if p.role == "fc2"]
    colinearity_decay_(pairs, [0.05] * len(pairs), precision="bf16")
    name = "blocks.0.mlp.fc2.weight"
    want = ref_w2(P[name], P["blocks.0.mlp.fc1.weight"], 0.05) - P[name].double()
    got = model.blocks[0].mlp.fc2.weight.detach().double() - P[name].double()
    err = float((got - want).norm() / want.norm())
    assert 1e-4 < err < 2e-2, err


def test_pair_penalty_weights_each_pair_by_its_own_weight():
    """pair_penalty(pairs, weights) = sum_k w_k ||W2_k W1n_k||_F^2 (Eq. (23)) with a different weight per
    pair, also within one batched group (the two fc2 pairs), written out from the parameters."""
    from cd.update import pair_penalty

    model = tiny_vit().double()
    P = snapshot(model)
    pairs = find_pairs(model)
    weights = [0.5 + k for k in range(len(pairs))]
    want = 0.0
    for w, p in zip(weights, pairs):
        if p.role == "fc2":
            w1 = P[p.upstream_name]
        elif p.role == "proj":
            qkv = P[p.upstream_name]
            w1 = qkv[2 * qkv.shape[0] // 3:]
        else:
            w1 = torch.diag(P[p.upstream_name])
        want += w * float((P[p.name] @ normalized(w1)).square().sum())
    assert math.isclose(float(pair_penalty(pairs, weights).detach()), want, rel_tol=1e-12)


def test_an_all_zero_upstream_matrix_gives_no_update_and_zero_energy():
    """A zero norm scale or a zero fc1 (W1 = 0, so W1n = 0: nothing to normalize) leaves its W2 unchanged and
    has energy 0, not NaN; the other pairs still get the float64 reference update."""
    model = tiny_vit().double()
    with torch.no_grad():
        model.blocks[0].norm1.weight.zero_()
        model.blocks[1].mlp.fc1.weight.zero_()
    P = snapshot(model)
    decay = ColinearityDecay(model, lam=0.1)
    energy = decay.metrics()
    # by hand: the mean over the two blocks, one of which is 0
    want_qkv = (P["blocks.1.attn.qkv.weight"] @ normalized(torch.diag(P["blocks.1.norm1.weight"]))).square().sum() / 2
    want_fc2 = (P["blocks.0.mlp.fc2.weight"] @ normalized(P["blocks.0.mlp.fc1.weight"])).square().sum() / 2
    assert math.isclose(energy["cd/pair_energy/qkv"], float(want_qkv), rel_tol=1e-9)
    assert math.isclose(energy["cd/pair_energy/fc2"], float(want_fc2), rel_tol=1e-9)
    decay.apply(lr=0.5)
    params = dict(model.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    for name in ("blocks.0.attn.qkv.weight", "blocks.1.mlp.fc2.weight"):
        assert torch.equal(params[name], P[name]), name
    expected = {}
    ref_block_update(P, "blocks.0", 0.05, expected)
    torch.testing.assert_close(params["blocks.0.mlp.fc2.weight"], expected["blocks.0.mlp.fc2.weight"])
    torch.testing.assert_close(params["blocks.0.mlp.fc1.weight"], expected["blocks.0.mlp.fc1.weight"])


def test_a_tiny_but_nonzero_upstream_matrix_is_normalized_like_any_other():
    """W1n (App. A.2, Eq. (22)) does not depend on W1's scale: an fc1 or norm scale of RMS about 1e-11 gives the
    update of the same matrix at scale 1 (only an all-zero W1 is floored, to no update), float64."""
    model = tiny_vit().double()
    P = snapshot(model)
    with torch.no_grad():
        model.blocks[0].mlp.fc1.weight.mul_(1e-9)
        model.blocks[1].norm1.weight.mul_(1e-9)
    ColinearityDecay(model, lam=0.1).apply(lr=0.5)
    params = dict(model.named_parameters())
    torch.testing.assert_close(params["blocks.0.mlp.fc2.weight"].detach(),
                               ref_w2(P["blocks.0.mlp.fc2.weight"], P["blocks.0.mlp.fc1.weight"], 0.05),
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(params["blocks.1.attn.qkv.weight"].detach(),
                               ref_w2(P["blocks.1.attn.qkv.weight"], torch.diag(P["blocks.1.norm1.weight"]), 0.05),
                               rtol=1e-10, atol=1e-12)


def _split_over_two_gpus(model, first="cuda:0"):
    """`model` with block 1 on cuda:1 and every other parameter on `first` (pipeline stages, transformers'
    device_map="auto"), as torch's FakeTensors: tensors of shape and device only, which refuse an op on tensors of
    two CUDA devices as CUDA does ("found at least two devices"), on a machine without a GPU. Returns the mode."""
    mode = FakeTensorMode()
    values = {name: p.detach() for name, p in model.named_parameters()}
    with mode:
        for name, value in values.items():
            module, _, attr = name.rpartition(".")
            device = "cuda:1" if name.startswith("blocks.1.") else first
            setattr(model.get_submodule(module), attr, nn.Parameter(mode.from_tensor(value).to(device)))
    return mode


def test_the_sums_over_blocks_of_a_model_split_over_two_gpus_are_made_on_one_device():
    """The 0-dim norms, energies and penalty of blocks on cuda:0 and cuda:1 were added across the two devices, which
    torch refuses; they are summed on the first pair's device, and the penalty follows the task loss's."""
    model = tiny_vit()
    pairs = find_pairs(model)
    mode = _split_over_two_gpus(model)
    params = dict(model.named_parameters())
    pairs = [dataclasses.replace(p, upstream=params[p.upstream_name.split("[")[0]], downstream=params[p.name])
             for p in pairs]
    with mode:
        assert {p.w2().device.index for p in pairs} == {0, 1}
        gate = torch.ones((), dtype=torch.bool, device="cuda:1")  # GradScaler's found_inf == 0, on its own GPU
        norms = colinearity_decay_(pairs, [0.1] * len(pairs), [0.1] * len(pairs), gate=gate, norms=True)
        energy = pair_energy(pairs)
        penalty = pair_penalty(pairs, [1.0] * len(pairs), upstream_grad=True)
        term = align_to_task_loss(penalty, torch.ones((), device="cuda:1"))  # the last stage's loss
    assert set(norms) == {"qkv", "proj", "fc1", "fc2", "proj_upstream", "fc2_upstream"}
    assert {str(v.device) for v in (*norms.values(), *energy.values(), penalty)} == {"cuda:0"}
    assert term.device == torch.device("cuda:1")


def test_colinearity_decay_steps_a_model_split_over_two_gpus():
    """Attached to an optimizer whose param groups hold their lrs on their blocks' GPUs, under a fused step's
    GradScaler verdict on the other one: the update, its flags and its norms were combined across the devices."""
    model = tiny_vit()
    mode = _split_over_two_gpus(model)
    with mode:
        decay = ColinearityDecay(model, verify=False, matmul_precision="fp32")
        opt = torch.optim.SGD([
            {"params": list(model.blocks[0].parameters()), "lr": torch.tensor(0.1, device="cuda:0")},
            {"params": list(model.blocks[1].parameters()), "lr": torch.tensor(0.1, device="cuda:1")}])
        decay.attach(opt)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for device in ("cuda:1", "cuda:0"):  # the second update also joins the first's flags and norms
            opt.found_inf = torch.zeros((), device=device)
            assert decay.apply_for(opt)
    assert {str(v.device) for v in decay._last_update_norms.values()} == {"cuda:0"}


def test_the_verdict_of_lrs_on_the_cpu_and_a_gpu_stays_on_the_gpu():
    """A param group's lr on the CPU beside another's on a GPU: their verdict (whether the update moves anything) is
    made on the GPU, with the CPU flag as a scalar; made on the CPU, it would copy the GPU's flag there, a wait for
    the device at every step."""
    from cd.decay import _ran_on_device

    with FakeTensorMode():
        for lrs in ([torch.tensor(0.1), torch.tensor(0.2, device="cuda:0")],
                    [torch.tensor(0.2, device="cuda:0"), torch.tensor(0.1)]):
            assert _ran_on_device(lrs, None).device == torch.device("cuda:0")


def test_the_sums_over_blocks_of_a_model_whose_first_block_is_on_the_cpu_are_made_on_the_gpu():
    """Block 0 offloaded to the CPU, block 1 on a GPU: the sums are made on the GPU (a CPU block's 0-dim term enters
    as a scalar); made on the first pair's CPU, each GPU term copied there would wait for the device, at every step of
    the loss form."""
    model = tiny_vit()
    pairs = find_pairs(model)
    mode = _split_over_two_gpus(model, first="cpu")
    params = dict(model.named_parameters())
    pairs = [dataclasses.replace(p, upstream=params[p.upstream_name.split("[")[0]], downstream=params[p.name])
             for p in pairs]
    with mode:
        assert pairs[0].w2().device == torch.device("cpu")
        norms = colinearity_decay_(pairs, [0.1] * len(pairs), norms=True)
        energy = pair_energy(pairs)
        penalty = pair_penalty(pairs, [1.0] * len(pairs))
    assert {str(v.device) for v in (*norms.values(), *energy.values(), penalty)} == {"cuda:1"}


def test_a_model_split_between_a_gpu_and_the_cpu_runs_no_product_under_the_callers_autocast():
    """Autocast was disabled on the first pair's device type alone: a model split between a GPU and the CPU (an
    offloaded block) ran the other device's products under the caller's autocast, in bf16. Only the CPU block moves
    here, so its update norms are those products' (fp32 when autocast is off)."""
    model = tiny_vit()
    pairs = find_pairs(model)
    mode = FakeTensorMode()
    values = {name: p.detach() for name, p in model.named_parameters()}
    with mode:
        for name, value in values.items():
            module, _, attr = name.rpartition(".")
            device = "cpu" if name.startswith("blocks.1.") else "cuda:0"
            setattr(model.get_submodule(module), attr, nn.Parameter(mode.from_tensor(value).to(device)))
    params = dict(model.named_parameters())
    pairs = [dataclasses.replace(p, upstream=params[p.upstream_name.split("[")[0]], downstream=params[p.name])
             for p in pairs]
    steps = [0.1 if p.block == "blocks.1" else 0.0 for p in pairs]
    with mode, torch.autocast("cpu", dtype=torch.bfloat16):
        assert pairs[0].w2().device.type == "cuda" and pairs[-1].w2().device.type == "cpu"
        norms = colinearity_decay_(pairs, steps, norms=True, precision="fp32")
        energy = pair_energy(pairs)
    assert {v.dtype for v in (*norms.values(), *energy.values())} == {torch.float32}


def test_pair_penalty_of_no_pairs_is_refused_by_name():
    """No pairs (a selection that kept none) failed with an IndexError from the zero's device and dtype, which are
    the first pair's; a penalty of none would train the loss form without CD, so it is refused, naming the fix."""
    with pytest.raises(ValueError, match=r"^pair_penalty: no pairs, .*pass find_pairs\(model\)'s pairs"):
        pair_penalty([], [])


def _move_in_place(params, device):
    """`params` (FakeTensor Parameters) onto `device`, the same Parameter objects, as module.to moves real ones
    (`.data` swapped). module.to itself swaps a FakeTensor's whole tensor (torch.utils.swap_tensors), which its
    Parameter refuses, and `.data =` keeps its fake device: the fake device is set directly."""
    for p in params:
        p.fake_device = torch.device(device)


def test_colinearity_decay_follows_blocks_moved_to_another_gpu_after_it_was_built():
    """The cached batching plans group pairs by the devices they were on when ColinearityDecay was built: block 1
    moved to cuda:1 afterwards left a group over two GPUs, and apply / aux_loss failed inside torch.stack with torch's
    "found at least two devices". The plans are built again when the devices change; the whole model moved after
    that (model.cuda()) is stepped as before."""
    model = tiny_vit()
    mode = _split_over_two_gpus(model)
    _move_in_place(model.blocks[1].parameters(), "cuda:0")  # built with the whole model on cuda:0
    decay = ColinearityDecay(model, verify=False, matmul_precision="fp32")
    loss_form = ColinearityDecay(model, verify=False, mode="loss")
    with mode:
        for blocks, device in (([model.blocks[1]], "cuda:1"), (list(model.children()), "cuda:1")):
            for block in blocks:
                _move_in_place(block.parameters(), device)
            assert model.blocks[1].mlp.fc2.weight is decay.pairs[-1].downstream  # the same objects, moved
            decay.apply(0.1)
            norms = decay._last_update_norms
            term = loss_form.aux_loss(torch.ones((), device="cuda:1"))
            assert set(norms) == {"qkv", "proj", "fc1", "fc2"} and term.device == torch.device("cuda:1")
            assert {str(v.device) for v in norms.values()} == {"cuda:0" if len(blocks) == 1 else "cuda:1"}


def test_a_pair_energy_source_follows_blocks_moved_to_another_gpu_after_it_was_made(monkeypatch):
    """A baseline's pair_energy_source cached its plan as ColinearityDecay did: block 1 moved to cuda:1 after it was
    made failed inside torch.stack. (The energies' float() cannot read FakeTensors: the sums are taken unread.)"""
    model = tiny_vit()
    mode = _split_over_two_gpus(model)
    _move_in_place(model.blocks[1].parameters(), "cuda:0")
    source = pair_energy_source(model, verify=False)
    sums = []
    monkeypatch.setattr(cd.decay, "energy_metrics", lambda pairs, plan, plans: sums.append(pair_energy(pairs, plan)))
    with mode:
        _move_in_place(model.blocks[1].parameters(), "cuda:1")
        source()
    assert set(sums[0]) == {"qkv", "proj", "fc1", "fc2"}


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_pair_penalty_refuses_a_negative_or_non_finite_weight(bad):
    """A negative weight made the penalty grow the energy it penalises (a negative total, aligned to the task loss
    through the floor of its divisor, a term ~1e38 times the loss); NaN or inf made it NaN or inf. Refused, naming
    the weight and its pair."""
    pairs = find_pairs(tiny_vit())
    weights = [1.0] * len(pairs)
    weights[2] = bad
    with pytest.raises(ValueError, match=rf"^pair_penalty: weights\[2\] = {bad!r} \(pair {pairs[2].name}\); every"):
        pair_penalty(pairs, weights)


def test_a_pair_split_over_two_gpus_after_cd_was_built_is_refused_by_name():
    """A model split by hand after CD was built (block 0's fc2 moved to cuda:1, its fc1 left on cuda:0): construction
    refuses such a pair, but afterwards apply, aux_loss, metrics and a baseline's pair_energy_source failed inside
    torch.mm with "found at least two devices", naming neither the pair nor the fix (apply after the groups before it
    had been written). Each refuses it as construction does, before any product."""
    model = tiny_vit()
    mode = _split_over_two_gpus(model)
    _move_in_place(model.blocks[1].parameters(), "cuda:0")  # built with the whole model on cuda:0
    decay = ColinearityDecay(model, verify=False, matmul_precision="fp32")
    loss_form = ColinearityDecay(model, verify=False, mode="loss")
    source = pair_energy_source(model, verify=False)
    split = (r"^block 'blocks\.0' \(Block\) is not supported by CD: its fc2 pair has blocks\.0\.mlp\.fc2\.weight on "
             r"cuda:1 and blocks\.0\.mlp\.fc1\.weight on cuda:0; .*Keep each block on one device$")
    with mode:
        _move_in_place(model.blocks[0].mlp.fc2.parameters(), "cuda:1")
        for call in (lambda: decay.apply(0.1), lambda: loss_form.aux_loss(torch.ones((), device="cuda:0")),
                     decay.metrics, source):
            with pytest.raises(UnsupportedModelError, match=split):
                call()
    assert decay.num_updates == 0 and loss_form._last_penalty is None
