"""WeightNoise (cd/noise.py) under activation checkpointing: the loss and every gradient of a model whose middle
block is checkpointed equal those of the same model run without checkpointing (the reference), with
`torch.utils.checkpoint` reentrant (its forward runs under no_grad, MMDetection's `with_cp`) and not. A noiseless
run gives another loss, so the equality is not that of two runs without noise. MMDetection's Swin backbone with
`with_cp=True` against `with_cp=False` where mmdet is installed. In eval mode a layer has its clean weights.
A second training forward with `noise.step` never set warns once (the same noise again); a recomputation does not.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cd.noise import WeightNoise


class Net(nn.Module):
    """Linear -> (Linear, GELU, Linear) -> Linear; the middle block optionally checkpointed. The first layer makes
    the block's input require grad, which reentrant checkpointing needs to reach the block's parameters."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode  # "none", "reentrant" or "non-reentrant"
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 3)
        self.block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.mode == "none":
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.mode == "reentrant")
        return self.out(h)


def loss_and_grads(mode: str, noise: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training forward and backward of Net (float64, fixed initial weights and input) at noise step 3."""
    torch.manual_seed(0)
    net = Net(mode).double().train()
    x = torch.randn(5, 6, dtype=torch.float64)
    if noise:
        with WeightNoise(net, bits=4, seed=7) as weight_noise:
            weight_noise.step = 3
            loss = net(x).pow(2).sum()
            loss.backward()
    else:
        loss = net(x).pow(2).sum()
        loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in net.named_parameters()}


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_checkpointed_training_sees_the_noise_of_the_run_without_checkpointing(mode):
    ref_loss, ref_grads = loss_and_grads("none", noise=True)
    loss, grads = loss_and_grads(mode, noise=True)
    clean_loss, _ = loss_and_grads("none", noise=False)
    assert abs(ref_loss - clean_loss) > 1e-6  # the noise is on
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-12, atol=1e-14, msg=name)


def test_a_training_forward_under_no_grad_sees_the_noisy_weights_of_its_step():
    """The first forward of reentrant checkpointing runs under no_grad: in training mode it gets the noise (the
    same as with grad at that step), in eval mode the clean weights."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 6).double().train()
    x = torch.randn(3, 8, dtype=torch.float64)
    clean = nn.functional.linear(x, layer.weight, layer.bias)
    with WeightNoise(layer, bits=4, seed=1) as weight_noise:
        weight_noise.step = 5
        with_grad = layer(x).detach()
        with torch.no_grad():
            without_grad = layer(x)
        assert (with_grad - clean).abs().max() > 1e-3
        assert torch.equal(without_grad, with_grad)
        layer.eval()
        with torch.no_grad():
            assert torch.equal(layer(x), clean)


def test_mmdetection_swin_with_cp_trains_on_the_noise_of_the_run_without_it():
    """MMDetection's Swin with `with_cp=True` checkpoints each block (reentrant): the loss and the gradients equal
    those of `with_cp=False`."""
    pytest.importorskip("mmdet")
    from cd.families import import_mmdet_swin

    SwinTransformer = import_mmdet_swin()  # MMDetection's own Swin (mmcv-lite or full mmcv)
    runs = {}
    for with_cp in (False, True):
        torch.manual_seed(0)
        swin = SwinTransformer(embed_dims=16, depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 4], window_size=7,
                               drop_path_rate=0.0, pretrain_img_size=64, with_cp=with_cp).double()
        swin.train()  # its train() override returns None
        x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
        with WeightNoise(swin, bits=4, seed=0):
            loss = sum(o.pow(2).sum() for o in swin(x))
            loss.backward()
        runs[with_cp] = loss.detach(), {n: p.grad.clone() for n, p in swin.named_parameters() if p.grad is not None}
    (ref_loss, ref_grads), (loss, grads) = runs[False], runs[True]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)


def test_a_second_training_forward_with_the_step_never_set_warns_once():
    """The noise is a function of (seed, step, layer) and `step` never advances by itself (cd/README.md). Was: two
    training forwards without `noise.step` set drew the same noise without a word, so such a loop trained with one
    fixed perturbation. The second training forward of the model warns, once; an eval forward and a checkpointed
    block's recomputation in the backward (a second forward of its layers inside one model forward) count as none.
    A caller that sets `step`, each iteration (as WeightNoiseHook does with runner.iter) or once, is not warned."""
    torch.manual_seed(0)
    net = Net("reentrant").double().train()
    x = torch.randn(5, 6, dtype=torch.float64)
    with WeightNoise(net, bits=4, seed=7), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = net(x)
        first.pow(2).sum().backward()  # recomputes the block's layers
        net.eval()
        net(x)
        net.train()
        assert seen == []
        second = net(x)
        net(x)
    assert torch.equal(second, first)  # the same noise: step is still 0
    assert len(seen) == 1 and "second training forward with noise.step never set" in str(seen[0].message)
    for steps in ([0, 1, 2], [4, 4, 4]):  # set each iteration, or once to keep one noise on purpose
        with WeightNoise(net, bits=4, seed=7) as weight_noise, warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            outs = []
            for step in steps:
                weight_noise.step = step
                outs.append(net(x).detach())
        assert seen == [], steps
        assert torch.equal(outs[0], first.detach()) == (steps[0] == 0)
        assert all(torch.equal(a, b) == (s == t) for a, s, b, t in zip(outs, steps, outs[1:], steps[1:]))
