"""CD's public API under misuse (cd/README.md, "The API's rules"): CD changes exactly the weights the
optimizer changes, at most once per real step, and every refusal states its true cause."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cd import ColinearityDecay, UnsupportedModelError, find_pairs
from cd_models import changed, snapshot, tiny_swin, tiny_vit


def step_with_zero_grads(model, opt):
    """One optimizer step on zero gradients: SGD without momentum or decay moves nothing, so every change
    is CD's."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()


def sgd(params, lr=0.5):
    return torch.optim.SGD(params, lr=lr)


# -- rule 1: exactly the weights the optimizer changes ---------------------------------------------------

def test_frozen_matrices_in_the_optimizer_are_left_alone():
    model = tiny_vit()
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)  # a frozen block that still sits in the optimizer
    opt = sgd(model.parameters())
    ColinearityDecay(model, lam=0.1).attach(opt)
    before = snapshot(model)
    step_with_zero_grads(model, opt)
    moved = changed(model, before)
    assert moved and not any(n.startswith("blocks.0.") for n in moved)


def test_a_matrix_without_a_gradient_at_this_step_is_left_alone():
    model = tiny_vit()
    opt = sgd(model.parameters())
    ColinearityDecay(model, lam=0.1).attach(opt)
    step_with_zero_grads(model, opt)
    model.blocks[1].mlp.fc2.weight.grad = None  # e.g. a branch that took no part in this backward
    before = snapshot(model)
    opt.step()
    assert "blocks.1.mlp.fc2.weight" not in changed(model, before)
    assert "blocks.0.mlp.fc2.weight" in changed(model, before)


def test_matrices_outside_the_optimizer_are_left_alone_with_a_warning():
    model = tiny_vit()
    trained = [p for n, p in model.named_parameters() if not n.startswith("blocks.0.")]
    opt = sgd(trained)
    with pytest.warns(UserWarning, match=r"4 decayed matrices are not in the optimizer .* leaves them alone"):
        ColinearityDecay(model, lam=0.1).attach(opt)
    before = snapshot(model)
    step_with_zero_grads(model, opt)
    assert not any(n.startswith("blocks.0.") for n in changed(model, before))
    with pytest.raises(ValueError, match="none of the 8 decayed matrices is in the optimizer"):
        ColinearityDecay(model).attach(sgd(model.head.parameters()))


def test_apply_leaves_frozen_matrices_alone_and_refuses_a_bad_lr():
    model = tiny_vit()
    model.blocks[1].attn.proj.weight.requires_grad_(False)
    decay = ColinearityDecay(model, lam=0.1)
    before = snapshot(model)
    decay.apply(lr=0.5)
    moved = changed(model, before)
    assert "blocks.1.attn.proj.weight" not in moved and "blocks.0.attn.proj.weight" in moved
    for lr in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
            decay.apply(lr=lr)


# -- rule 2: at most once per real step ------------------------------------------------------------------

def test_attaching_twice_is_refused_and_remove_allows_it_again():
    model = tiny_vit().double()
    opt = sgd(model.parameters())
    decay = ColinearityDecay(model, lam=0.1)
    handle = decay.attach(opt)
    for target in (opt, sgd(model.parameters())):
        with pytest.raises(RuntimeError, match="attached to (this|another) optimizer already"):
            decay.attach(target)
    once = snapshot(model)
    step_with_zero_grads(model, opt)
    reference = tiny_vit().double()
    ColinearityDecay(reference, lam=0.1).apply(lr=0.5)  # one update by hand
    assert all(torch.allclose(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert changed(model, once)
    handle.remove()
    decay.attach(opt)  # detached first: allowed


def test_two_objects_decaying_one_matrix_through_one_optimizer_are_refused():
    model = tiny_vit()
    opt = sgd(model.parameters())
    ColinearityDecay(model, lam=0.1).attach(opt)
    with pytest.raises(RuntimeError, match=r"another ColinearityDecay attached to this optimizer decays "
                                           r"blocks\.0\.attn\.qkv\.weight"):
        ColinearityDecay(model, lam=0.1).attach(opt)


def test_apply_on_an_attached_object_is_refused():
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.1)
    opt = sgd(model.parameters())
    decay.attach(opt)
    with pytest.raises(RuntimeError, match="attached to an optimizer.*twice per step"):
        decay.apply(lr=0.1)


def test_a_skipped_fp16_step_and_accumulation_still_apply_at_most_once():
    model = tiny_vit()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    decay = ColinearityDecay(model, lam=0.1)
    decay.attach(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for micro in range(3):  # accumulation: one step for three backwards
        loss = F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([0, 1]))
        scaler.scale(loss * (float("inf") if micro == 0 else 1.0)).backward()
    scaler.step(opt)  # inf gradients: skipped, no CD
    scaler.update()
    assert decay.num_updates == 0


# -- rule 3: every refusal states its true cause ---------------------------------------------------------

@pytest.mark.parametrize("tie", ["module", "parameter"])
def test_a_matrix_shared_by_two_blocks_is_refused_as_shared(tie):
    model = tiny_vit()
    if tie == "module":
        model.blocks[1].mlp.fc2 = model.blocks[0].mlp.fc2
    else:
        model.blocks[1].attn.proj.weight = model.blocks[0].attn.proj.weight
    with pytest.raises(UnsupportedModelError, match=r"is the same tensor as blocks\.0\.\S+ of block 'blocks\.0' "
                                                    r"\(shared between blocks\)"):
        find_pairs(model)


def test_a_norm_shared_by_two_blocks_is_a_valid_upstream():
    model = tiny_vit()
    model.blocks[1].norm2 = model.blocks[0].norm2  # W1 of two pairs: only read
    pairs = find_pairs(model)
    fc1 = [p for p in pairs if p.role == "fc1"]
    assert len(fc1) == 2 and fc1[0].upstream is fc1[1].upstream is model.blocks[0].norm2.weight
    # the meta-device check swaps each shared module's tensors once and restores them (it used to leave
    # them on the meta device: the model's weights lost)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}


def test_a_block_used_twice_has_one_set_of_pairs():
    model = tiny_vit()
    model.blocks[1] = model.blocks[0]
    assert [p.name for p in find_pairs(model)] == ["blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight",
                                                   "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight"]


def test_replaced_parameters_are_refused_as_replaced_not_as_missing():
    model = tiny_vit()
    decay = ColinearityDecay(model)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with pytest.raises(ValueError, match=r"no longer the tensor .* replaced since"):
        decay.attach(sgd(model.parameters()))


@pytest.mark.parametrize("model, kwargs", [(tiny_vit, {"lam_per_role": {"reduction": 0.02}}),
                                           (tiny_swin, {"targets": "A", "lam_per_role": {"fc2": 0.02}})])
def test_a_role_strength_that_decays_nothing_is_refused(model, kwargs):
    with pytest.raises(ValueError, match=r"lam_per_role: \['(reduction|fc2)'\] decay\(s\) no matrix"):
        ColinearityDecay(model(), **kwargs)


def test_attach_to_something_else_than_an_optimizer_is_a_type_error():
    model = tiny_vit()
    scheduler_by_mistake = torch.optim.lr_scheduler.StepLR(sgd(model.parameters()), 1)
    with pytest.raises(TypeError, match="takes a torch.optim.Optimizer, got StepLR"):
        ColinearityDecay(model).attach(scheduler_by_mistake)


def test_the_rules_are_documented():
    import os

    from tests.conftest import ROOT

    with open(os.path.join(ROOT, "cd", "README.md")) as f:
        text = f.read()
    for rule in ("CD changes exactly the weights the optimizer changes", "At most once per real step",
                 "Every refusal states its true cause"):
        assert rule in text
