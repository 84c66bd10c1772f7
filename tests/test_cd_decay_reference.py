"""ColinearityDecay and the update against independent float64 references: the per-role strength under a target
subset, the composable update of half-precision weights (fp32 math, one rounding), and the update counter after
`load_state_dict` on an object that skipped fused steps. The reference is the paper's update written out in float64
(`ref_w2`), never cd/'s own helpers."""
from __future__ import annotations

import pytest
import torch

from cd import ColinearityDecay
from cd_models import VIT_DEPTH, changed, ref_w2, snapshot, tiny_vit


def _zero_grads(model):
    """Zero gradients: SGD without momentum or decay then leaves the weights alone, and only CD moves them."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def test_lam_per_role_under_targets_b_gives_each_pair_its_own_roles_strength():
    """Targets B select only proj and fc2: each must read the strength of its own role (fc2: the override,
    proj: lam), not the one at its index among all pairs."""
    model = tiny_vit().double()
    P = snapshot(model)
    lr, lam, lam_fc2 = 0.5, 0.1, 0.3
    ColinearityDecay(model, lam=lam, lam_per_role={"fc2": lam_fc2}, targets="B").apply(lr=lr)
    params = dict(model.named_parameters())
    expected = {}
    for i in range(VIT_DEPTH):
        b = f"blocks.{i}"
        qkv = P[f"{b}.attn.qkv.weight"]
        expected[f"{b}.attn.proj.weight"] = ref_w2(P[f"{b}.attn.proj.weight"], qkv[2 * qkv.shape[0] // 3:], lr * lam)
        expected[f"{b}.mlp.fc2.weight"] = ref_w2(P[f"{b}.mlp.fc2.weight"], P[f"{b}.mlp.fc1.weight"], lr * lam_fc2)
    for name, want in expected.items():
        torch.testing.assert_close(params[name].detach(), want, rtol=1e-10, atol=1e-12, msg=name)
    assert set(changed(model, P)) == set(expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_composable_update_of_half_precision_weights_is_the_float64_result_rounded_once(dtype):
    """qkv and fc1 (column scaling by g^2 / mean(g^2)) stored in bf16/fp16: the scale is computed in fp32, so the
    new weight is the float64 reference rounded once, within half a unit in the last place (a scale computed in
    the storage dtype carries its own rounding, of the order of that unit times the step)."""
    model = tiny_vit().to(dtype)
    P = snapshot(model)
    lr, lam = 0.5, 0.5  # a large step, so that an error in the scale shows through the final rounding
    ColinearityDecay(model, lam=lam).apply(lr=lr)
    params = dict(model.named_parameters())
    eps = torch.finfo(dtype).eps
    for i in range(VIT_DEPTH):
        b = f"blocks.{i}"
        for w2, g in ((f"{b}.attn.qkv.weight", f"{b}.norm1.weight"), (f"{b}.mlp.fc1.weight", f"{b}.norm2.weight")):
            want = ref_w2(P[w2], torch.diag(P[g].double()), lr * lam)
            got = params[w2].detach()
            assert got.dtype == dtype
            err = (got.double() - want).abs()
            bound = 0.5 * eps * want.abs() * (1 + 1e-3) + torch.finfo(dtype).tiny
            assert (err <= bound).all(), f"{w2}: {int((err > bound).sum())} entries beyond half an ulp"


def test_load_state_dict_replaces_the_count_of_skipped_fused_steps_too():
    """A fused optimizer's skipped step is subtracted from cd/updates lazily; loading a state into the same object
    sets the count to the saved one, with no subtraction left over from the steps before the load."""
    model = tiny_vit()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0, fused=True)
    decay = ColinearityDecay(model, lam=0.5)
    decay.attach(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(torch.ones(()))  # initialise the scale
    _zero_grads(model)
    model.blocks[1].attn.proj.weight.grad[0, 0] = float("inf")
    scaler.step(opt)  # skipped on the device
    scaler.update()
    assert decay.metrics()["cd/updates"] == 0
    decay.load_state_dict({"num_updates": 5, "config": decay.state_dict()["config"]})
    assert decay.metrics()["cd/updates"] == 5
    assert decay.state_dict()["num_updates"] == 5
