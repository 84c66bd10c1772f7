"""An explicit matmul_precision='tf32' is refused where there is no TF32: CPUs have none, so the update's products
would run in fp32 while the setting (and a run's config) says tf32. Refused at the first update, not when CD is built
(a model may be moved to a GPU after that), by ColinearityDecay and so by an OptimizerBinding; the integrations refuse
it earlier, when they bind the framework's optimizers (the model is on its device by then), before any forward;
train.py makes the same check before a run starts, with its own setting's name (tests/test_train.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cd import ColinearityDecay
from cd.integrations import OptimizerBinding, check_cd_arguments
from cd_models import VIT_DEPTH, ref_block_update, snapshot, tiny_vit

REFUSED = (r"^ColinearityDecay: matmul_precision=tf32 but the decayed matrices are on the cpu, which has no TF32 "
           r"\(the update would run in fp32\): pass matmul_precision='fp32', or 'auto'")


def _unchanged(model, before) -> bool:
    return all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_apply_with_tf32_on_a_cpu_model_is_refused_at_the_first_update_and_moves_nothing():
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.1, matmul_precision="tf32")  # built: the model may still move
    before = snapshot(model)
    decay.apply(lr=0.0)  # no update (lr 0): nothing to refuse yet
    with pytest.raises(ValueError, match=REFUSED):
        decay.apply(lr=0.5)
    assert _unchanged(model, before) and decay.num_updates == 0


def test_an_attached_step_with_tf32_on_a_cpu_model_is_refused_before_the_optimizer_moves_anything():
    model = tiny_vit()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ColinearityDecay(model, lam=0.1, matmul_precision="tf32").attach(opt)
    F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2])).backward()
    before = snapshot(model)
    with pytest.raises(ValueError, match=REFUSED):
        opt.step()
    assert _unchanged(model, before)


def test_an_integrations_binding_with_tf32_on_a_cpu_model_is_refused_at_its_step():
    kwargs = check_cd_arguments({"lam": 0.1, "matmul_precision": "tf32"})  # taken when the callback is made
    model = tiny_vit()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    binding = OptimizerBinding(ColinearityDecay(model, **kwargs), opt)
    F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2])).backward()
    binding.arm()  # the framework's event: a real update comes
    before = snapshot(model)
    with pytest.raises(ValueError, match=REFUSED):
        opt.step()
    assert _unchanged(model, before)


@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_fp32_and_auto_on_a_cpu_model_update_as_the_float64_reference(precision):
    # auto is fp32 off CUDA: both run, exact fp32 products against the float64 reference at lr * lam = 0.05
    model = tiny_vit()
    P = snapshot(model)
    ColinearityDecay(model, lam=0.1, matmul_precision=precision).apply(lr=0.5)
    expected: dict = {}
    for i in range(VIT_DEPTH):
        ref_block_update(P, f"blocks.{i}", 0.05, expected)
    for name, want in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].double(), want, rtol=1e-5, atol=1e-6)



@pytest.mark.gpu
def test_a_model_moved_to_cuda_after_cd_is_built_takes_tf32():
    """Built on the CPU, moved with .cuda() (same Parameter objects) before the first update: the products run in
    TF32 there, as asked; the update matches the float64 reference to TF32's error (tests/test_gpu.py's bound)."""
    model = tiny_vit()
    P = snapshot(model)
    decay = ColinearityDecay(model, lam=0.1, matmul_precision="tf32")
    model.cuda()
    decay.apply(lr=0.5)
    expected: dict = {}
    for i in range(VIT_DEPTH):
        ref_block_update(P, f"blocks.{i}", 0.05, expected)
    for name, want in expected.items():
        got = dict(model.named_parameters())[name].detach().double().cpu()
        assert float((got - want).abs().max()) <= 5e-3 * float((want - P[name].double()).abs().max()), name
