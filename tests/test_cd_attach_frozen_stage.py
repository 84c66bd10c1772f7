"""ColinearityDecay.attach on an optimizer that holds none of the decayed matrices (cd/README.md, "The API's rules"
and "Frozen weights"): refused while one of them is trainable (CD would never act); all of them frozen and left
out of the optimizer (a stage to unfreeze later) is a warning, as in cd.integrations, and CD acts on each from the
first step after add_param_group adds it."""
from __future__ import annotations

import warnings

import pytest
import torch

from cd import ColinearityDecay
from cd_integration_refs import reference_cd_, vit_pairs
from cd_models import snapshot, tiny_vit


def zero_grad_step(model, opt):
    """One step on zero gradients of every trainable parameter: SGD without momentum or decay moves nothing, so
    every change is CD's."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    opt.step()


def test_all_decayed_matrices_frozen_out_of_the_optimizer_warn_once_and_get_cd_once_added():
    """Blocks outside an SGD over the head: refused while block 0 is trainable; all frozen, one warning at attach,
    and a step leaves them as they were; unfrozen and added in a param group of lr 0.25, the next step makes every
    decayed matrix the hand-written W2 - lr lam W2 W1n W1n^T (float64, cd_integration_refs.reference_cd_) and moves
    nothing else."""
    model = tiny_vit().double()
    model.blocks[1].requires_grad_(False)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.5)
    with pytest.raises(ValueError, match=r"none of the 8 decayed matrices is in the optimizer"):
        ColinearityDecay(model, lam=0.1).attach(opt)  # CD would never act on block 0, which trains
    model.blocks.requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ColinearityDecay(model, lam=0.1).attach(opt)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "all 8 decayed matrices are frozen" in messages[0] and "add_param_group" in messages[0]
    start = snapshot(model)
    zero_grad_step(model, opt)
    assert all(torch.equal(v, start[n]) for n, v in snapshot(model).items())
    model.blocks.requires_grad_(True)
    opt.add_param_group({"params": list(model.blocks.parameters()), "lr": 0.25})
    want = tiny_vit().double()
    want.load_state_dict(model.state_dict())
    pairs = vit_pairs(["blocks.0", "blocks.1"], 32)
    reference_cd_(want, pairs, 0.1, {p.w2: 0.25 for p in pairs})
    zero_grad_step(model, opt)
    got, expected = snapshot(model), snapshot(want)
    decayed = {p.w2 for p in pairs}
    for name in got:
        if name in decayed:
            assert not torch.equal(got[name], start[name]), name
            torch.testing.assert_close(got[name], expected[name], rtol=1e-12, atol=1e-12)
        else:
            assert torch.equal(got[name], start[name]), name

