"""WeightNoise (cd/noise.py) and ColinearityDecay on one model, attached in either order: CD's pair check (one
forward on the meta device in training mode, then forwards on real numbers in eval mode) is neither perturbed by the
noise nor counted as a training forward, so the weights after a few steps are those of a run whose CD ran no check
at all (verify=False), whichever of the two came first; and a single training forward with `noise.step` never set
does not warn. The same with the two MMEngine hooks in both orders of `custom_hooks`. ColinearityDecayHook's refusal
of a check whose forward fails names input_shape= and the other cause (the forward itself) with verify=False.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cd.decay import ColinearityDecay
from cd.noise import WeightNoise
from cd_models import tiny_vit

STEPS, LAM, LR = 3, 0.5, 0.05


def weights_after_steps(order: str, verify: bool = True) -> dict[str, torch.Tensor]:
    """The tiny ViT's weights after STEPS SGD updates with noise (step set to the iteration) and CD, the two built in
    `order` ("noise first" or "cd first"); fixed initial weights and data."""
    model = tiny_vit().double().train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    if order == "noise first":
        noise = WeightNoise(model, bits=4, seed=5)
        decay = ColinearityDecay(model, lam=LAM, verify=verify)
    else:
        decay = ColinearityDecay(model, lam=LAM, verify=verify)
        noise = WeightNoise(model, bits=4, seed=5)
    handle = decay.attach(opt)
    gen = torch.Generator().manual_seed(1)
    for it in range(STEPS):
        x = torch.randn(2, 3, 32, 32, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 10, (2,), generator=gen)
        noise.step = it
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    handle.remove()
    noise.remove()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_noise_and_cd_in_either_order_train_as_cd_without_its_check():
    reference = weights_after_steps("noise first", verify=False)  # no probing forward at all
    for order in ("noise first", "cd first"):
        got = weights_after_steps(order)
        assert got.keys() == reference.keys()
        assert all(torch.equal(got[k], reference[k]) for k in reference), order
    # the noise is on: a run without it ends elsewhere
    model = tiny_vit().double().train()
    assert not torch.equal(dict(model.named_parameters())["blocks.0.attn.qkv.weight"],
                           reference["blocks.0.attn.qkv.weight"])


def test_cds_check_is_not_counted_as_a_training_forward_of_the_noise():
    """The warning for a step never set comes with the second training forward: CD's check forwards are none."""
    model = tiny_vit().train()
    noise = WeightNoise(model, bits=4, seed=0)
    ColinearityDecay(model, lam=LAM)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(1, 3, 32, 32))
    with pytest.warns(UserWarning, match="second training forward with noise.step never set"):
        model(torch.randn(1, 3, 32, 32))
    noise.remove()


def test_mmengine_hooks_in_either_order_train_as_cd_without_its_check(tmp_path):
    pytest.importorskip("mmengine")
    from mmengine_runs import hook_of, run
    from test_mmengine_baselines import config

    noise = dict(type="WeightNoiseHook", bits=4, seed=3)
    runs = {}
    for name, hooks in (("reference", [noise, dict(type="ColinearityDecayHook", lam=LAM, verify=False)]),
                        ("noise first", [noise, dict(type="ColinearityDecayHook", lam=LAM)]),
                        ("cd first", [dict(type="ColinearityDecayHook", lam=LAM), noise])):
        runner = run(config(tmp_path / name.replace(" ", "_"), hooks, iters=3))
        assert hook_of(runner, "ColinearityDecayHook").decay.pairs  # CD was on
        runs[name] = hook_of(runner, "Recorder").after
    for name in ("noise first", "cd first"):
        assert len(runs[name]) == 3
        for got, want in zip(runs[name], runs["reference"]):
            assert all(torch.equal(got[k], want[k]) for k in want), name


def test_the_hooks_refusal_of_a_failed_check_names_a_cause_other_than_the_input_shape():
    """A part whose forward fails on the meta device for a reason other than its input (here a hook of its own):
    the refusal still names input_shape= where the shape is wrong, and names the other cause and verify=False."""
    pytest.importorskip("mmengine")
    from types import SimpleNamespace

    from mmengine.optim import OptimWrapper

    from cd.integrations.mmengine import ColinearityDecayHook
    from cd.verify import UnsupportedModelError

    def no_meta(module, args):
        """Refuses a meta input, as code that reads values does."""
        if args[0].is_meta:
            raise RuntimeError("this step reads values")

    net = tiny_vit()
    net.register_forward_pre_hook(no_meta)
    runner = SimpleNamespace(model=net, optim_wrapper=OptimWrapper(torch.optim.SGD(net.parameters(), lr=0.1)), iter=0)
    with pytest.raises(UnsupportedModelError) as refusal:
        ColinearityDecayHook(lam=0.5).before_train(runner)
    message = str(refusal.value)
    assert "this step reads values" in message and "if that is not the shape of the part's input" in message
    assert "fails for another reason" in message and "verify=False" in message and "\n" not in message


def test_a_real_forward_beside_an_unused_meta_layer_is_counted():
    """A forward is one of shapes only where every noised layer is on meta: an unused layer left on meta (listed
    first) beside a real one must not make real training forwards uncounted, so the second one with noise.step
    never set still warns (and the real layer is still perturbed)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.aux = nn.Linear(4, 4, device="meta")  # never called
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    torch.manual_seed(0)
    net = Net().train()
    clean = net.fc(torch.ones(1, 4)).detach()
    WeightNoise(net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = net(torch.ones(1, 4))
        net(torch.ones(1, 4))
    assert not torch.equal(first.detach(), clean)
    assert [str(w.message) for w in caught if "noise.step never set" in str(w.message)], caught
