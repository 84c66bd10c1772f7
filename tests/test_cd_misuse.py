"""CD's public API under misuse (cd/README.md, "The API's rules"): CD changes exactly the weights the
optimizer changes, at most once per real step, and every refusal states its true cause."""
from __future__ import annotations

import copy
import itertools
import re
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cd.verify
from cd import ColinearityDecay, UnsupportedModelError, find_pairs, pair_energy_source
from cd.verify import _share_element
from cd_integration_refs import assert_matches_reference, reference_run, vit_pairs
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


def test_every_decayed_matrix_frozen_is_said_not_silent():
    """A frozen backbone (e.g. MMDetection's frozen_stages) in the optimizer: CD would act on nothing."""
    from cd.integrations import OptimizerBinding
    model = tiny_vit()
    model.blocks.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"all 8 decayed matrices in the optimizer are frozen"):
        ColinearityDecay(model, lam=0.1).attach(sgd(model.parameters()))
    with pytest.warns(UserWarning, match=r"cd.integrations: all 8 decayed matrices in the optimizer are frozen"):
        OptimizerBinding(ColinearityDecay(model, lam=0.1), sgd(model.parameters()))
    model.blocks[0].requires_grad_(True)  # one frozen block of two: nothing said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ColinearityDecay(model, lam=0.1).attach(sgd(model.parameters()))


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

@pytest.fixture
def unhooked_lookahead(monkeypatch):
    """timm's Lookahead with its class `step` as it is before torch wraps it for hooks (it skips
    Optimizer.__init__, which wraps; a zero_grad() anywhere in the process wraps the class for good)."""
    from timm.optim import Lookahead
    monkeypatch.setattr(Lookahead, "step", getattr(Lookahead.step, "__wrapped__", Lookahead.step))
    return Lookahead


def test_cd_runs_from_the_first_step_of_an_optimizer_that_skips_optimizer_init(unhooked_lookahead):
    """attach on timm's Lookahead took the hook and never called it before the first zero_grad(): the first
    update (every update in a trainer that zeroes only the model's gradients) went without CD."""
    model = tiny_vit().double()
    opt = unhooked_lookahead(sgd(model.parameters()))
    decay = ColinearityDecay(model, lam=0.1)
    decay.attach(opt)
    step_with_zero_grads(model, opt)  # no zero_grad() before it
    reference = tiny_vit().double()
    ColinearityDecay(reference, lam=0.1).apply(lr=0.5)  # one update by hand
    assert all(torch.allclose(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert decay.metrics()["cd/updates"] == 1


def test_a_wrapper_that_saved_a_step_calling_no_hooks_is_refused_at_attach(unhooked_lookahead):
    """A wrapper that keeps the optimizer's bound `step` from before torch wrapped the class for hooks (as
    accelerate's AcceleratedOptimizer does with a GradScaler) steps through it: a hook attached later never ran,
    silently (tests/test_cd_integration_accelerate.py has the real one). Attached to the bare optimizer first, the
    hook runs in the wrapper's steps."""
    class Wrapper(torch.optim.Optimizer):  # a subclass without its state, as accelerate's
        def __init__(self, optimizer):
            self.optimizer, self.saved_step = optimizer, optimizer.step

        def step(self, closure=None):
            return self.saved_step(closure)

    model = tiny_vit()
    wrapped = Wrapper(unhooked_lookahead(sgd(model.parameters())))
    with pytest.raises(RuntimeError, match=r"Wrapper\.saved_step is a `step` of Lookahead taken before torch made "
                                           r"its class's step call step hooks"):
        ColinearityDecay(model, lam=0.1).attach(wrapped)
    inner = unhooked_lookahead(sgd(model.parameters()))
    decay = ColinearityDecay(model, lam=0.1)
    decay.attach(inner)
    wrapped = Wrapper(inner)
    step_with_zero_grads(model, wrapped)
    assert decay.num_updates == 1


def test_an_lr_scheduler_built_before_attach_on_an_unhooked_optimizer_is_refused(unhooked_lookahead):
    """A torch lr scheduler replaces the optimizer's `step` by a wrapper of the class's step function of that moment:
    on a Lookahead not yet wrapped for hooks, CD attached later silently never ran (cd/updates stayed 0). Attached
    before the scheduler is built, the update runs (one SGD step of lr 0.5 plus CD's, by hand)."""
    model = tiny_vit().double()
    opt = unhooked_lookahead(sgd(model.parameters()))
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with pytest.raises(RuntimeError, match=r"Lookahead\.step is a `step` of Lookahead taken before torch made its "
                                           r"class's step call step hooks.*building an lr scheduler"):
        ColinearityDecay(model, lam=0.1).attach(opt)
    model = tiny_vit().double()
    opt = unhooked_lookahead(sgd(model.parameters()))
    decay = ColinearityDecay(model, lam=0.1)
    decay.attach(opt)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    step_with_zero_grads(model, opt)
    reference = tiny_vit().double()
    ColinearityDecay(reference, lam=0.1).apply(lr=0.5)
    assert all(torch.allclose(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert decay.metrics()["cd/updates"] == 1


@pytest.mark.parametrize("wrap", ["mmengine_scheduler", "torch_compile"])
def test_other_wrappers_of_an_unhooked_step_on_the_optimizer_are_refused(unhooked_lookahead, wrap):
    """An MMEngine param scheduler built on the torch optimizer, and torch.compile of its bound `step`, put on it a
    `step` that calls the class's step function of that moment (functools.wraps): on a Lookahead not yet wrapped for
    hooks, CD attached later would never run."""
    model = tiny_vit()
    opt = unhooked_lookahead(sgd(model.parameters()))
    if wrap == "mmengine_scheduler":
        scheduler = pytest.importorskip("mmengine.optim.scheduler")
        scheduler.MultiStepLR(opt, milestones=[1])
    else:
        opt.step = torch.compile(opt.step)  # compiled at its first call: never here
    with pytest.raises(RuntimeError, match=r"Lookahead\.step is a `step` of Lookahead taken before torch made"):
        ColinearityDecay(model, lam=0.1).attach(opt)


@pytest.mark.parametrize("wrap", ["closure", "method"])
def test_a_users_step_that_forwards_to_the_hooked_step_is_attached_to(wrap):
    """A user's own `step` put on the optimizer (a closure forwarding to the bound step, or a method calling the
    class's step) runs torch's hooked step, so CD runs in it; attach refused both as 'a step of SGD taken before
    torch made its class's step call step hooks'. Reference: one update by hand (SGD moves nothing)."""
    import types
    model = tiny_vit().double()
    opt = sgd(model.parameters())
    bound = opt.step

    def step(*args, **kwargs):  # closure: forwards to the bound step
        return bound(*args, **kwargs)

    def method_step(self, closure=None):  # method: calls the class's step
        return type(self).step(self, closure)
    method_step.__name__ = "step"
    opt.step = step if wrap == "closure" else types.MethodType(method_step, opt)
    decay = ColinearityDecay(model, lam=0.1)
    decay.attach(opt)
    step_with_zero_grads(model, opt)
    reference = tiny_vit().double()
    ColinearityDecay(reference, lam=0.1).apply(lr=0.5)
    assert all(torch.allclose(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert decay.metrics()["cd/updates"] == 1


class ClippedSGD(torch.optim.SGD):
    """A user's optimizer subclass whose `step` calls its parent's."""

    def step(self, closure=None):
        return super().step(closure)


@pytest.mark.parametrize("how", ["attach", "binding", "held binding"])
def test_a_subclass_step_calling_the_parents_step_gets_one_update_per_step(how):
    """An optimizer subclass whose `step` calls super().step(): once torch has wrapped both classes' steps for hooks
    (the parent's at any instance's Optimizer.__init__), a step runs the step hooks twice: attach decayed twice per
    step, a Lightning binding (strict_steps) raised 'took a step without the framework's step event', an MMEngine
    one (armed until disarmed) decayed twice. Reference: one update by hand (SGD on zero gradients moves nothing)."""
    from cd.integrations import OptimizerBinding
    sgd([torch.nn.Parameter(torch.zeros(1))])  # torch wraps SGD's own step for hooks, for good
    model = tiny_vit().double()
    opt = ClippedSGD(model.parameters(), lr=0.5)
    decay = ColinearityDecay(model, lam=0.1)
    if how == "attach":
        decay.attach(opt)
    else:
        OptimizerBinding(decay, opt, strict_steps=True).arm(until_disarmed=how == "held binding")
    step_with_zero_grads(model, opt)
    reference = tiny_vit().double()
    ColinearityDecay(reference, lam=0.1).apply(lr=0.5)
    assert all(torch.allclose(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert decay.metrics()["cd/updates"] == 1


def test_the_engines_optimizers_run_step_hooks_from_the_first_step(unhooked_lookahead):
    """optim.name=lookahead_adamw: the loop counts real updates in a step hook (an uncounted one reads as
    skipped) and CD / TWEO act in them."""
    from configs.schema import OptimConfig
    from engine.optim import build_optimizer

    opt = build_optimizer(tiny_vit(), OptimConfig(name="lookahead_adamw"), lr=1e-3, weight_decay=0.05)
    assert isinstance(opt, unhooked_lookahead)
    steps = []
    opt.register_step_post_hook(lambda *_: steps.append(1))
    opt.step()
    assert steps == [1]


def test_a_model_sharded_by_fsdp2_is_refused_before_the_check_and_still_runs(tmp_path):
    """The pair check's meta forward ran FSDP2's hooks, which it left broken: after the refusal the model's next
    forward raised (AttributeError in FSDPParam). Refused before it now, with the way to check the pairs."""
    import torch.distributed as dist
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("no public fully_shard in this torch")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = tiny_vit()
        for block in model.blocks:
            fsdp.fully_shard(block)
        fsdp.fully_shard(model)
        with pytest.raises(UnsupportedModelError, match=r"sharded by FSDP2 .*\(find_pairs\(model\) before "
                                                        r"fully_shard\) and pass verify=False here"):
            ColinearityDecay(model, lam=0.1)
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    finally:
        dist.destroy_process_group()


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
    model = tiny_vit().double()
    opt = sgd(model.parameters())
    first = ColinearityDecay(model, lam=0.1).attach(opt)
    with pytest.raises(RuntimeError, match=r"another CD update runs in this optimizer's step already .* decays "
                                           r"blocks\.0\.attn\.qkv\.weight"):
        ColinearityDecay(model, lam=0.1).attach(opt)
    first.remove()  # the first one detached: the second one's step is the only update
    reference = tiny_vit().double()
    reference.load_state_dict(model.state_dict())
    ColinearityDecay(model, lam=0.1).attach(opt)
    step_with_zero_grads(model, opt)
    ColinearityDecay(reference, lam=0.1).apply(lr=0.5)  # one update by hand
    assert all(torch.allclose(p, q, rtol=0, atol=1e-12) for p, q in zip(model.parameters(), reference.parameters()))


def test_apply_of_a_second_object_on_matrices_an_attached_one_decays_is_refused():
    """A.attach(opt) and B.apply(lr) on one model would decay each matrix twice per step; B on another model, or
    after A's remove(), is one update (checked against a third object's apply on a copy)."""
    model = tiny_vit().double()
    opt = sgd(model.parameters())
    handle = ColinearityDecay(model, lam=0.1).attach(opt)
    second = ColinearityDecay(model, lam=0.1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"another CD object decays blocks\.0\.attn\.qkv\.weight in an "
                                           r"optimizer's step already"):
        second.apply(lr=0.5)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # refused before any write
    other = tiny_vit().double()
    other.load_state_dict(before)
    ColinearityDecay(other, lam=0.1).apply(lr=0.5)  # another model's matrices: taken
    handle.remove()
    second.apply(lr=0.5)
    assert all(torch.allclose(p, q, rtol=0, atol=1e-12) for p, q in zip(model.parameters(), other.parameters()))


def test_apply_on_matrices_outside_the_attached_objects_optimizer_is_taken():
    """A on a model of two ViTs, attached to an optimizer of the first only, decays the second's matrices in no
    step (they are outside its optimizer): B.apply on the second is its one update (checked against an apply on
    a copy), while B.apply on the first is still refused."""
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = tiny_vit().double(), tiny_vit().double()

        def forward(self, x):
            return self.a(x) + self.b(x)

    model = Two()
    opt = sgd(model.a.parameters())  # held: a freed optimizer frees its objects
    with pytest.warns(UserWarning, match="not in the optimizer"):
        ColinearityDecay(model, lam=0.1, verify=False).attach(opt)
    copy_of_b, before = copy.deepcopy(model.b), snapshot(model.b)
    ColinearityDecay(model.b, lam=0.1).apply(lr=0.5)
    ColinearityDecay(copy_of_b, lam=0.1).apply(lr=0.5)
    assert changed(model.b, before)  # the update is not a no-op
    assert all(torch.equal(p, q) for p, q in zip(model.b.parameters(), copy_of_b.parameters()))
    with pytest.raises(RuntimeError, match=r"another CD object decays blocks\.0\.attn\.qkv\.weight"):
        ColinearityDecay(model.a, lam=0.1).apply(lr=0.5)


def test_a_closure_step_gets_the_update_after_its_backward_once():
    model = tiny_vit().double()
    initial = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 10, (4,), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ColinearityDecay(model, lam=0.5).attach(opt)
    got = []
    for step in range(3):
        opt.zero_grad()

        def closure():  # backward inside the step: the gradient exists only after the closure's call
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        opt.step(closure) if step % 2 == 0 else opt.step(closure=closure)  # positional and keyword
        got.append(snapshot(model))

    def reference(variant):
        net = copy.deepcopy(initial)
        return reference_run(net, [[(x, y)]] * 3, lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                             torch.optim.AdamW(net.parameters(), lr=1e-2), None,
                             vit_pairs(["blocks.0", "blocks.1"], 32), 0.5, variant=variant)

    assert_matches_reference(got, reference, 1e-10, variants=("before_backward", "after_step"))


def test_an_optimizer_that_calls_the_closure_again_gets_one_update_per_step():
    model = tiny_vit()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    decay = ColinearityDecay(model, lam=0.1)
    decay.attach(opt)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    calls = []

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        calls.append(1)
        return loss

    opt.step(closure)
    opt.step(closure)
    assert len(calls) > 2 and decay.num_updates == 2


def test_a_step_without_any_gradient_is_not_counted():
    model = tiny_vit()
    opt = sgd(model.parameters())
    decay = ColinearityDecay(model, lam=0.1)
    decay.attach(opt)
    opt.step()  # no backward yet
    assert decay.metrics()["cd/updates"] == 0.0


def test_attach_looks_through_a_framework_optimizer_wrapper():
    class Wrapper(torch.optim.Optimizer):  # as accelerate's AcceleratedOptimizer: a subclass without its state
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self, closure=None):
            return self.optimizer.step(closure)

    model = tiny_vit()
    inner = sgd(model.parameters())
    wrapped = Wrapper(inner)
    decay = ColinearityDecay(model, lam=0.1)
    decay.attach(wrapped)
    before = snapshot(model)
    step_with_zero_grads(model, wrapped)
    assert decay.num_updates == 1 and "blocks.0.mlp.fc2.weight" in changed(model, before)
    with pytest.raises(RuntimeError, match="attached to this optimizer already"):
        decay.attach(inner)


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

@pytest.mark.parametrize("tie", ["module", "parameter", "storage", "overlap", "interleaved", "numpy"])
def test_a_matrix_shared_by_two_blocks_is_refused_as_shared(tie):
    """One tensor in two blocks, or two Parameters over one memory (which the tensor's identity does not show: CD
    would update that memory once per block, the second update reading what the first wrote), whole or in part,
    also through two storages over one memory (two torch.from_numpy of one array)."""
    model = tiny_vit()
    w = model.blocks[0].attn.proj.weight
    rows, cols = w.shape
    if tie == "module":
        model.blocks[1].mlp.fc2 = model.blocks[0].mlp.fc2
    elif tie == "parameter":
        model.blocks[1].attn.proj.weight = model.blocks[0].attn.proj.weight
    elif tie == "storage":
        model.blocks[1].attn.proj.weight = torch.nn.Parameter(model.blocks[0].attn.proj.weight.data)
    elif tie == "overlap":  # two matrices in one buffer, the second starting in the first's last row
        buffer = torch.randn(2 * w.numel() - cols)
        model.blocks[0].attn.proj.weight = torch.nn.Parameter(buffer[:w.numel()].view(w.shape))
        model.blocks[1].attn.proj.weight = torch.nn.Parameter(buffer[-w.numel():].view(w.shape))
    elif tie == "interleaved":  # rows 0, 2, 4, ... and 1, 4, 7, ... of one buffer: rows 4, 10, ... in both
        buffer = torch.randn(3 * rows, cols)
        model.blocks[0].attn.proj.weight = torch.nn.Parameter(buffer[0::2][:rows])
        model.blocks[1].attn.proj.weight = torch.nn.Parameter(buffer[1::3][:rows])
    else:  # two numpy views of one array (two storages), overlapping in all but one row
        array = np.random.default_rng(0).standard_normal(w.numel() + cols).astype(np.float32)
        model.blocks[0].attn.proj.weight = torch.nn.Parameter(torch.from_numpy(array[:w.numel()]).view(w.shape))
        model.blocks[1].attn.proj.weight = torch.nn.Parameter(torch.from_numpy(array[cols:]).view(w.shape))
    how = "is the same tensor as" if tie in ("module", "parameter") else "shares memory with"
    with pytest.raises(UnsupportedModelError, match=rf"{how} blocks\.0\.\S+ of block 'blocks\.0' "
                                                    r"\(shared between blocks\)"):
        find_pairs(model)



def _interleaved_vit():
    """tiny_vit whose blocks' attn.proj weights are the views big[:, b, :] of one (out, blocks, in) buffer: spans that
    all overlap, without an element in common."""
    model = tiny_vit()
    w = model.blocks[0].attn.proj.weight
    big = torch.randn(w.shape[0], len(model.blocks), w.shape[1])
    for b, block in enumerate(model.blocks):
        block.attn.proj.weight = torch.nn.Parameter(big[:, b, :])
    return model


def test_interleaved_views_are_taken_under_the_default_device_meta():
    """The element addresses `_share_element` compares are built on the CPU whatever the default device (they were
    built on the default device: under `meta`, torch.nonzero on meta was refused)."""
    model = _interleaved_vit()
    expected = [(p.name, p.upstream_name, p.role) for p in find_pairs(model)]
    torch.set_default_device("meta")
    try:
        pairs = [(p.name, p.upstream_name, p.role) for p in find_pairs(model)]
    finally:
        torch.set_default_device(None)
    assert pairs == expected and sum(role == "proj" for _, _, role in expected) == len(model.blocks)


def test_each_matrix_s_element_addresses_are_built_once(monkeypatch):
    """Views interleaved in one buffer all overlap in span: each one's element addresses are built once per check,
    not once per pair of them (quadratic in the blocks), and the check still finds no element in common."""
    built, build = [], cd.verify._element_starts
    monkeypatch.setattr(cd.verify, "_element_starts", lambda t, *rest: built.append(t) or build(t, *rest))
    big = torch.zeros(8, 5, 6)
    pairs = [SimpleNamespace(downstream=big[:, b, :], block=f"blocks.{b}", role="proj", name=f"blocks.{b}.w")
             for b in range(5)]
    cd.verify.refuse_shared(pairs, {})
    assert len(built) == len({id(t) for t in built}) == 5

def _bytes(t):
    """The addresses of every byte of `t`'s elements, walked index by index."""
    size = t.element_size()
    return {t.data_ptr() + size * sum(i * s for i, s in zip(index, t.stride())) + k
            for index in itertools.product(*map(range, t.shape)) for k in range(size)}


@pytest.mark.parametrize("second", [
    lambda b: b.view(3, 2, 4)[:, 1, :], lambda b: b[20:].view(torch.float16)[::2],  # no byte in common
    lambda b: b[1:23:2], lambda b: b.view(6, 4).t()[1], lambda b: b[2:].view(torch.float64)[::3],
    lambda b: b[1:].view(torch.float16)[::4], lambda b: b[1:].view(torch.float16)[1::4]])  # the last: none aligned
def test_matrices_with_overlapping_spans_share_memory_where_a_byte_is_in_both(second):
    """`_share_element` (run where two matrices' spans overlap) against the bytes of each element, walked one by one:
    interleaved views share none, and views of other dtypes can meet without starting at one byte."""
    buffer = torch.zeros(24)
    first, other = buffer.view(3, 2, 4)[:, 0, :], second(buffer)
    assert _share_element(first, other) == _share_element(other, first) == bool(_bytes(first) & _bytes(other))


def test_a_norm_shared_by_two_blocks_is_a_valid_upstream():
    model = tiny_vit()
    model.blocks[1].norm2 = model.blocks[0].norm2  # W1 of two pairs: only read
    pairs = find_pairs(model)
    fc1 = [p for p in pairs if p.role == "fc1"]
    assert len(fc1) == 2 and fc1[0].upstream is fc1[1].upstream is model.blocks[0].norm2.weight
    # the meta-device check swaps each shared module's tensors once and restores them (it used to leave
    # them on the meta device: the model's weights lost)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}


def test_one_replaced_parameter_is_named_alone():
    model = tiny_vit()
    decay = ColinearityDecay(model)
    model.blocks[0].mlp.fc2.weight = torch.nn.Parameter(model.blocks[0].mlp.fc2.weight.detach().clone())
    with pytest.raises(ValueError, match=r"parameter blocks\.0\.mlp\.fc2\.weight is no longer the tensor"):
        decay.apply(0.1)


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
    with pytest.raises(ValueError, match=r"no longer the tensor .* replaced since"):  # not a write to stale tensors
        decay.apply(0.1)


def test_a_baselines_energy_source_follows_its_models_weights_and_refuses_replaced_ones():
    """The source reads the model's tensors at each call: weights changed in place give the new energies; weights
    replaced (load_state_dict(assign=True), as fully_shard after the source was made) are refused, not logged as
    the old tensors' energies (constant curves)."""
    model = tiny_vit()
    source = pair_energy_source(model)
    before = source()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    after = source()
    # W1n is W1 scaled to a fixed norm (App. A.2, Eq. (23)): doubling every weight makes ||W2 W1n||_F^2 four times
    assert after.keys() == before.keys() and len(after) == 4
    assert all(after[k] == pytest.approx(4 * before[k], rel=1e-5) for k in before)
    naive = []  # fc2 pairs by the definition: W2 = fc2, W1 = fc1, W1n = W1 * sqrt(rows(W1)) / ||W1||_F
    for block in model.blocks:
        w1, w2 = block.mlp.fc1.weight.detach().double(), block.mlp.fc2.weight.detach().double()
        naive.append((w2 @ (w1 * w1.shape[0] ** 0.5 / w1.norm())).square().sum().item())
    assert after["cd/pair_energy/fc2"] == pytest.approx(sum(naive) / len(naive), rel=1e-5)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with pytest.raises(ValueError, match=r"^pair_energy_source: the model's parameter blocks\.0\.attn\.qkv\.weight "
                                         r"\(and \d+ more\) is no longer the tensor .* replaced since"):
        source()


def test_parameters_replaced_after_attach_are_refused_at_the_step():
    model = tiny_vit()
    opt = sgd(model.parameters())
    ColinearityDecay(model, lam=0.1).attach(opt)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match=r"no longer the tensor"):  # the hook would decay stale tensors
        opt.step()


@pytest.mark.parametrize("change", ["new_module", "removed_module", "new_attribute_tensor"])
def test_a_replaced_or_removed_module_is_refused_like_replaced_parameters(change):
    model = tiny_vit()
    decay = ColinearityDecay(model)
    if change == "new_module":  # a module built anew: same names, other tensors
        model.blocks[1].mlp.fc2 = torch.nn.Linear(model.blocks[1].mlp.fc2.in_features,
                                                  model.blocks[1].mlp.fc2.out_features)
    elif change == "removed_module":
        del model.blocks[1].mlp.fc2
    else:  # the attribute holds a new Parameter
        model.blocks[0].attn.proj.weight = torch.nn.Parameter(model.blocks[0].attn.proj.weight.detach().clone())
    with pytest.raises(ValueError, match=r"no longer the tensor"):
        decay.apply(0.1)


def test_apply_takes_numpy_numbers_and_0_dim_tensors_and_refuses_other_tensors():
    np = pytest.importorskip("numpy")
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.1)
    before = snapshot(model)
    decay.apply(np.float32(0.5))
    after_numpy = snapshot(model)
    model.load_state_dict(before)
    decay.apply(torch.tensor(0.5))
    assert changed(model, before) and all(torch.allclose(p, after_numpy[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="0-dim float tensor"):
        decay.apply(torch.tensor([0.5]))
    with pytest.raises(ValueError, match="finite number >= 0"):
        decay.apply(np.float64("nan"))


@pytest.mark.parametrize("model, kwargs", [(tiny_vit, {"lam_per_role": {"reduction": 0.02}}),
                                           (tiny_swin, {"targets": "A", "lam_per_role": {"fc2": 0.02}})])
def test_a_role_strength_that_decays_nothing_is_refused(model, kwargs):
    with pytest.raises(ValueError, match=r"lam_per_role: \['(reduction|fc2)'\] decay\(s\) no matrix"):
        ColinearityDecay(model(), **kwargs)


class RelativeStep(torch.optim.Optimizer):
    """Adafactor's contract (transformers, timm): lr=None and relative_step=True, the step size computed
    inside step(); AdafactorSchedule then writes a proxy number into the group's lr."""

    def __init__(self, params, lr=None):
        super().__init__(params, dict(lr=lr, relative_step=lr is None))

    def step(self, closure=None):
        pass


@pytest.mark.parametrize("proxy_lr", [None, 0.0])
def test_an_optimizer_without_an_lr_to_follow_is_refused_at_attach(proxy_lr):
    model = tiny_vit()
    opt = RelativeStep(model.parameters())
    opt.param_groups[0]["lr"] = proxy_lr
    with pytest.raises(ValueError, match=r"param group 0 of RelativeStep holds .* with lr (None|0\.0) and "
                                         r"relative_step=True; .* has none to follow"):
        ColinearityDecay(model).attach(opt)


def test_an_optimizer_with_its_own_lr_is_followed():
    """Adafactor-like with an lr given (relative_step=False): attach takes it, and CD's step is lr * lam with the
    lr the group holds at the step (a scheduler's 2e-3, not the 1e-3 given): the weights are the float64
    hand-written update (cd_models.ref_block_update, paper Eq. (12)), as RelativeStep's own step moves nothing."""
    from cd_models import ref_block_update

    model = tiny_vit().double()
    opt = RelativeStep(model.parameters(), lr=1e-3)
    ColinearityDecay(model, lam=0.5).attach(opt)
    opt.param_groups[0]["lr"] = 2e-3
    before = snapshot(model)
    want = dict(before)
    for b in ("blocks.0", "blocks.1"):
        ref_block_update(before, b, 2e-3 * 0.5, want)
    step_with_zero_grads(model, opt)
    assert changed(model, before)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[name], rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("coef", [float("nan"), float("inf"), -0.01])
def test_a_non_finite_or_negative_loss_coef_is_refused(coef):
    with pytest.raises(ValueError, match="cd loss_coef must be a finite number >= 0"):
        ColinearityDecay(tiny_vit(), mode="loss", loss_coef=coef)


@pytest.mark.parametrize("mode, setting, fix", [
    ("loss", {"matmul_precision": "bf16"}, "drop matmul_precision, or use mode='decoupled'"),
    ("decoupled", {"loss_coef": 0.5}, "drop loss_coef, or use mode='loss'"),
])
def test_a_setting_of_the_other_form_is_refused_not_ignored(mode, setting, fix):
    """The loss form's penalty never reads matmul_precision (fp32 under autograd) and the decoupled update adds no
    term for loss_coef to scale: either would run as if it were not given."""
    with pytest.raises(ValueError, match=re.escape(fix)):
        ColinearityDecay(tiny_vit(), mode=mode, **setting)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_a_matmul_precision_with_only_composable_pairs_decayed_is_refused_not_ignored(precision):
    """Targets 'A' decay the composable pairs alone, whose update is W2's columns scaled by g^2 / mean(g^2) in fp32:
    there is no product for matmul_precision to make in another precision, so the run would be the same whatever it
    says (tf32 on a CPU model included)."""
    with pytest.raises(ValueError, match=re.escape("drop matmul_precision, or use targets that decay functional")):
        ColinearityDecay(tiny_vit(), targets="A", matmul_precision=precision)
    ColinearityDecay(tiny_vit(), targets="A")  # the default, 'auto', says nothing of its own
    ColinearityDecay(tiny_vit(), targets="B", matmul_precision=precision if precision != "tf32" else "fp32")


def test_attach_to_something_else_than_an_optimizer_is_a_type_error():
    model = tiny_vit()
    scheduler_by_mistake = torch.optim.lr_scheduler.StepLR(sgd(model.parameters()), 1)
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer, got StepLR"):
        ColinearityDecay(model).attach(scheduler_by_mistake)


@pytest.mark.parametrize("given", ["None", "state_dict", "list of blocks"])
@pytest.mark.parametrize("entry", ["find_pairs", "ColinearityDecay", "TWEO", "pair_energy_source"])
def test_a_model_that_is_no_module_is_a_type_error_naming_what_was_given(entry, given):
    """Not an AttributeError ('NoneType' object has no attribute 'modules') from deep inside."""
    import cd
    model = tiny_vit()
    arg = {"None": None, "state_dict": model.state_dict(), "list of blocks": list(model.blocks)}[given]
    got = {"None": "NoneType", "state_dict": "OrderedDict", "list of blocks": "list"}[given]
    with pytest.raises(TypeError, match=rf"^{entry}.* needs the model as a torch\.nn\.Module .*, got {got}; "
                                        r"pass the model itself"):
        getattr(cd, entry)(arg)


def test_the_rules_are_documented():
    import os

    from tests.conftest import ROOT

    with open(os.path.join(ROOT, "cd", "README.md")) as f:
        text = f.read()
    for rule in ("CD changes exactly the weights the optimizer changes", "At most once per real step",
                 "Every refusal states its true cause"):
        assert rule in text


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_stored_in_half_precision_are_warned_about_once(dtype):
    """The warning's premise, checked against the fp32 model: at the paper's lam and a usual lr, the fp32 step
    changes (nearly) every fc2 weight and the half-precision one leaves most of them as they were."""
    import warnings

    changes = {}
    for kind in (torch.float32, dtype):
        torch.manual_seed(0)
        model = tiny_vit().to(kind)
        before = model.blocks[0].mlp.fc2.weight.detach().clone()
        decay = ColinearityDecay(model, lam=0.005)
        opt = sgd(model.parameters(), lr=1e-3)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            decay.attach(opt)
            for _ in range(3):
                step_with_zero_grads(model, opt)
        said = [w for w in seen if "below that format's resolution" in str(w.message)]
        assert len(said) == (0 if kind == torch.float32 else 1), [str(w.message) for w in seen]
        changes[kind] = (model.blocks[0].mlp.fc2.weight != before).float().mean().item()
    assert changes[torch.float32] > 0.9 and changes[dtype] < 0.5, changes


class LoraLinear(torch.nn.Module):
    """A stand-in of PEFT's lora.Linear (the refusal's hint is keyed on the class's module): a frozen base layer,
    a trained low-rank term, and the base weight exposed as `weight`, as PEFT exposes it."""
    __module__ = "peft.tuners.lora.layer"

    def __init__(self, base: torch.nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = torch.nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = torch.nn.Linear(rank, base.out_features, bias=False)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_a_model_with_lora_adapters_is_refused_naming_them():
    model = tiny_vit()
    for block in model.blocks:
        block.attn.qkv, block.mlp.fc2 = LoraLinear(block.attn.qkv), LoraLinear(block.mlp.fc2)
    with pytest.raises(UnsupportedModelError, match=r"the layer blocks.0.attn.qkv "
                                                    r"\(peft.tuners.lora.layer.LoraLinear\) of its qkv pair holds "
                                                    r"adapters \(base_layer.weight, "):
        ColinearityDecay(model)


def test_target_c_moves_each_upstream_matrix_with_its_own_group_lr_and_only_when_it_trains():
    """Target C writes W1 too: with the pair's strength and W1's own param-group lr (not W2's), and not at all
    when W1 is frozen; checked against the closed forms W2 - s2 W2 W1n W1n^T and W1 - s1 c^2 W2^T W2 W1."""
    from cd_models import normalized

    model = tiny_vit().double()
    P = snapshot(model)
    model.blocks[0].mlp.fc1.weight.requires_grad_(False)
    ColinearityDecay(model, lam=0.1, targets="C").apply(lr=0.5)
    moved = changed(model, P)
    assert "blocks.0.mlp.fc1.weight" not in moved and "blocks.0.mlp.fc2.weight" in moved
    assert "blocks.1.mlp.fc1.weight" in moved

    model = tiny_vit().double()
    fc1 = model.blocks[1].mlp.fc1.weight
    opt = torch.optim.SGD([{"params": [p for p in model.parameters() if p is not fc1], "lr": 0.5},
                           {"params": [fc1], "lr": 0.2}])
    ColinearityDecay(model, lam=0.1, lam_per_role={"fc2": 0.3}, targets="C").attach(opt)
    step_with_zero_grads(model, opt)
    w1, w2 = P["blocks.1.mlp.fc1.weight"], P["blocks.1.mlp.fc2.weight"]
    w1n, c2 = normalized(w1), w1.shape[0] / w1.norm() ** 2
    torch.testing.assert_close(model.blocks[1].mlp.fc2.weight.detach(), w2 - 0.15 * w2 @ w1n @ w1n.T)
    torch.testing.assert_close(fc1.detach(), w1 - 0.06 * c2 * w2.T @ w2 @ w1)


@pytest.mark.parametrize("target", ["mlp.fc2", "attn.qkv"])
def test_a_layer_whose_weight_a_parametrization_computes_is_refused_for_that_cause(target):
    """The layer is there; its weight is computed at each forward (weight_norm), so CD has no Parameter to update:
    the refusal says so and how to remove it, not that the layer is missing."""
    from torch.nn.utils.parametrizations import weight_norm
    model = tiny_vit()
    weight_norm(model.blocks[0].get_submodule(target))
    with pytest.raises(UnsupportedModelError) as refused:
        ColinearityDecay(model)
    said = str(refused.value)
    assert f"the weight of {target} is computed at each forward by a parametrization" in said
    assert "remove_parametrizations" in said and "found no" not in said



class _Positive(torch.nn.Module):
    """A parametrization keeping a norm's scale positive: the norm stays affine, its weight is computed."""

    def forward(self, w):
        return w.abs()


@pytest.mark.parametrize("norm", ["norm1", "norm2"])
def test_a_norm_whose_scale_a_parametrization_computes_is_refused_for_that_cause(norm):
    """The norm is affine, but its weight is computed at each forward, so the pair holds no Parameter for W1: the
    refusal says so and how to remove it, not that the block needs an affine norm."""
    from torch.nn.utils import parametrize
    model = tiny_vit()
    parametrize.register_parametrization(getattr(model.blocks[0], norm), "weight", _Positive())
    with pytest.raises(UnsupportedModelError) as refused:
        ColinearityDecay(model)
    said = str(refused.value)
    assert f"the weight of {norm} is computed at each forward by a parametrization" in said, said
    assert "remove_parametrizations" in said and "needs an affine" not in said, said

class _ScaledNorm(torch.nn.Module):
    """An RMSNorm whose scale reaches its output through another computation than x_hat * weight: Gemma's
    x_hat * (1 + weight) ("one_plus"), or x_hat * weight * 2.0 ("doubled")."""

    def __init__(self, d: int, how: str) -> None:
        super().__init__()
        self.how, self.weight = how, torch.nn.Parameter(torch.zeros(d) if how == "one_plus" else torch.ones(d))

    def forward(self, x):
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x_hat * (1 + self.weight) if self.how == "one_plus" else x_hat * self.weight * 2.0


class _NormBlock(torch.nn.Module):
    """A timm-named block, pre-norm with `norm` as its norms, or post-norm (each norm after its branch)."""

    def __init__(self, norm, post: bool = False, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.post, self.heads = post, heads
        self.norm1, self.norm2 = norm(), norm()
        self.attn, self.mlp = torch.nn.Module(), torch.nn.Module()
        self.attn.qkv, self.attn.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp.fc1, self.mlp.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def _attn(self, x):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.attn.qkv(x).split(d, -1))
        return self.attn.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        if self.post:
            x = x + self.norm1(self._attn(x))
            return x + self.norm2(self.mlp.fc2(F.gelu(self.mlp.fc1(x))))
        x = x + self._attn(self.norm1(x))
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(self.norm2(x))))


@pytest.mark.parametrize("how", ["one_plus", "doubled"])
def test_a_norm_scaling_otherwise_than_by_its_weight_is_refused_for_that_not_as_post_norm(how):
    model = torch.nn.Sequential(_NormBlock(lambda: _ScaledNorm(8, how)))
    with pytest.raises(UnsupportedModelError) as refusal:
        find_pairs(model, torch.randn(1, 5, 8))
    said = str(refusal.value)
    assert re.search(r"the qkv pair: the input of 0\.attn\.qkv\.weight depends on the output of the norm 0\.norm1, "
                     r"but the norm's scale reaches it through a computation other than a multiplication by its "
                     r"weight \(such as x_hat \* \(1 \+ weight\)", said), said
    assert "post-norm" not in said, said


def test_a_post_norm_block_is_still_refused_as_one():
    model = torch.nn.Sequential(_NormBlock(lambda: torch.nn.LayerNorm(8), post=True))
    with pytest.raises(UnsupportedModelError, match=r"the qkv pair: the input of 0\.attn\.qkv\.weight is not the "
                                                    r"output of the norm 0\.norm1 \(CD supports pre-norm blocks"):
        find_pairs(model, torch.randn(1, 5, 8))


def test_transformers_gemma_is_refused_for_its_one_plus_weight_norm():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GemmaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(cfg)
    with pytest.raises(UnsupportedModelError, match=r"'model\.layers\.0' \(GemmaDecoderLayer\): the qkv pair: the "
                                                    r"input of model\.layers\.0\.self_attn\.q_proj\.weight depends on "
                                                    r"the output of the norm model\.layers\.0\.input_layernorm, but"):
        find_pairs(model, torch.zeros(1, 8, dtype=torch.long), gated_mlp=True)


def _low_precision_warnings(seen) -> int:
    return sum("below that format's resolution" in str(w.message) for w in seen)


def test_apply_on_weights_stored_in_bf16_is_warned_about_once():
    model = tiny_vit().bfloat16()
    decay = ColinearityDecay(model, lam=0.005)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        decay.apply(1e-3)
        decay.apply(1e-3)
    assert _low_precision_warnings(seen) == 1, [str(w.message) for w in seen]


def test_weights_cast_to_bf16_after_attach_are_warned_about_at_the_next_step():
    model = tiny_vit()
    opt = sgd(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ColinearityDecay(model, lam=0.005).attach(opt)
        step_with_zero_grads(model, opt)
        assert _low_precision_warnings(seen) == 0, [str(w.message) for w in seen]
        model.bfloat16()  # the same Parameters, now stored in bf16: the optimizer's groups are unchanged
        step_with_zero_grads(model, opt)
        step_with_zero_grads(model, opt)
    assert _low_precision_warnings(seen) == 1, [str(w.message) for w in seen]


def test_a_loss_form_attached_beside_a_decoupled_update_is_refused_for_what_each_does():
    """A loss-mode object attached to an optimizer makes no update in its steps (its CD is the aux_loss penalty), yet a
    decoupled object's apply or attach beside it was refused with "decays it in an optimizer's step already", and the
    loss-mode object's attach beside a decoupled update with "another CD update ... each step would decay it twice":
    the matrices would get both forms of CD, which the refusals now say. Both orders, and apply, leave the weights
    as they were."""
    model = tiny_vit().double()
    opt = sgd(model.parameters())
    before = copy.deepcopy(model.state_dict())
    handle = ColinearityDecay(model, mode="loss").attach(opt)
    decoupled = ColinearityDecay(model, lam=0.1)
    penalty = (r"another CD object \(mode='loss'\) attached to an optimizer decays blocks\.0\.attn\.qkv\.weight by "
               r"its aux_loss penalty; ")
    with pytest.raises(RuntimeError, match=r"^ColinearityDecay\.apply: " + penalty + r"apply\(\) would decay it a "
                                           r"second time, by the decoupled update"):
        decoupled.apply(lr=0.5)
    with pytest.raises(RuntimeError, match=r"^ColinearityDecay\.attach: " + penalty + r"this object's update in the "
                                           r"optimizer's step would decay it a second time"):
        decoupled.attach(opt)
    handle.remove()
    decoupled.attach(opt)
    with pytest.raises(RuntimeError, match=r"^ColinearityDecay\.attach: another CD update runs in this optimizer's "
                                           r"step already .* decays blocks\.0\.attn\.qkv\.weight; this object's "
                                           r"aux_loss penalty \(mode='loss'\) would decay it a second time"):
        ColinearityDecay(model, mode="loss").attach(opt)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_loss_forms_aux_loss_beside_a_decoupled_update_in_a_step_is_refused():
    """An unattached loss-mode object's aux_loss beside a decoupled object attached to the optimizer gave the matrices
    the penalty's gradient and the decoupled update in each step, without a word (only attached objects were
    compared). aux_loss is refused while the decoupled update decays a shared matrix in a step, and taken once the
    other's handle is removed, beside an update of another model's matrices, or without gradients (a value to log)."""
    model = tiny_vit().double()
    opt = sgd(model.parameters())
    loss_form = ColinearityDecay(model, mode="loss")
    handle = ColinearityDecay(model, lam=0.1).attach(opt)
    task_loss = model(torch.randn(1, 3, 32, 32, dtype=torch.float64)).square().mean()
    with pytest.raises(RuntimeError, match=r"^ColinearityDecay\.aux_loss: another CD object decays "
                                           r"blocks\.0\.attn\.qkv\.weight by its decoupled update in an optimizer's "
                                           r"step .*; this object's aux_loss penalty \(mode='loss'\) would decay it a "
                                           r"second time"):
        loss_form.aux_loss(task_loss)
    with torch.no_grad():  # a term without gradients trains nothing: a value to log
        loss_form.aux_loss(task_loss)
    handle.remove()
    assert loss_form.aux_loss(task_loss).requires_grad
    other = tiny_vit().double()
    ColinearityDecay(other, lam=0.1).attach(held := sgd(other.parameters()))  # another model's matrices: taken
    assert loss_form.aux_loss(task_loss).requires_grad and held
