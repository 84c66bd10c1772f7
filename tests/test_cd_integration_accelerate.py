"""ColinearityDecay.attach in a custom Hugging Face accelerate loop (not the Trainer; CPU): the loop of accelerate's
documentation (`accelerator.accumulate`, `accelerator.backward`, clipping on `sync_gradients`, the prepared
optimizer and lr schedule stepped at every micro-batch). A tiny float64 timm ViT's weights after every update are
compared with the float64 reference of (task step + CD) in a plain loop (tests/cd_integration_refs.py), which the
wrong placements of CD miss by far; CD attached to the prepared `AcceleratedOptimizer` and to the raw optimizer
before `prepare` alike. Under bf16 autocast, CD's own update is checked inside the step; on 2 gloo processes,
against the reference on both ranks' batches; an attach that accelerate's saved `step` would bypass is refused; and
cd/README.md's example of such a loop runs as written."""
from __future__ import annotations

import copy
import os
import re

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from cd import ColinearityDecay  # noqa: E402
from cd_integration_refs import (assert_matches_reference, image_loader, reference_run,  # noqa: E402
                                 vit_optimizer_and_schedule, vit_pairs)
from cd_models import VIT_DEPTH, ref_w2, snapshot, tiny_vit  # noqa: E402
from dist_utils import free_port, leave_and_exit, spawn_within  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

LAM, TOL, DIM = 0.5, 1e-10, 32
STEPS, ACCUM, CLIP = 3, 2, 0.5
BLOCKS = [f"blocks.{i}" for i in range(VIT_DEPTH)]


def reset_accelerate() -> None:
    """Forget accelerate's settings (mixed precision, accumulation): it keeps them in process-wide singletons,
    against which a second Accelerator with other settings is refused."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test starts from no accelerate state and leaves none (for the Trainer's tests, too)."""
    reset_accelerate()
    yield
    reset_accelerate()


def train(net: torch.nn.Module, attach: str, mixed_precision: str = "no", dtype: torch.dtype = torch.float64,
          around_cd=None, schedule: bool = True):
    """STEPS updates of ACCUM micro-batches in the loop of accelerate's documentation. `attach`: "prepared" builds
    CD on the prepared model and attaches it to the prepared optimizer, "raw" does both before `prepare`.
    `around_cd`: two step pre-hooks for the raw optimizer, registered before and after CD's (raw order only).
    `schedule`: the lr schedule of vit_optimizer_and_schedule, prepared and stepped at every micro-batch.
    Returns the decay, the micro-batches the model saw and the weights after each update."""
    opt, sched = vit_optimizer_and_schedule(net, STEPS)
    sched = sched if schedule else None
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, mixed_precision=mixed_precision, cpu=True)
    if attach == "raw":
        decay = ColinearityDecay(net, lam=LAM)
        if around_cd is not None:  # step pre-hooks run in the order they were registered
            opt.register_step_pre_hook(around_cd[0])
        decay.attach(opt)
        if around_cd is not None:
            opt.register_step_pre_hook(around_cd[1])
    data = image_loader(STEPS * ACCUM * accelerator.num_processes, dtype=dtype)  # each process its own shard
    model, optimizer, loader, scheduler = accelerator.prepare(net, opt, data, sched)  # (None stays None)
    if attach == "prepared":
        decay = ColinearityDecay(model, lam=LAM)
        decay.attach(optimizer)
    batches, after = [], []
    for x, y in loader:
        with accelerator.accumulate(model):
            batches.append((x.clone(), y.clone()))
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()  # accelerate's wrapper steps the torch optimizer only when sync_gradients
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            after.append(snapshot(net))  # (the model itself, not a DDP wrapper around it)
    return decay, batches, after


@pytest.mark.parametrize("attach", ["prepared", "raw"])
def test_accumulation_clipping_and_group_lrs_match_the_reference(attach):
    net = tiny_vit().double()
    initial = copy.deepcopy(net)
    decay, batches, after = train(net, attach)
    assert len(batches) == STEPS * ACCUM and len(after) == STEPS
    micro = [batches[i * ACCUM:(i + 1) * ACCUM] for i in range(STEPS)]

    def run(variant):
        ref = copy.deepcopy(initial)
        opt, sched = vit_optimizer_and_schedule(ref, STEPS)
        return reference_run(ref, micro, lambda m, b: F.cross_entropy(m(b[0]), b[1]), opt, sched,
                             vit_pairs(BLOCKS, DIM), LAM, clip=CLIP, variant=variant)

    assert_matches_reference(after, run, TOL,
                             variants=("before_backward", "per_micro_batch", "after_step", "first_group_lr"))
    assert decay.num_updates == STEPS and decay.metrics()["cd/updates"] == STEPS


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """One process of a 2-process gloo run (accelerate reads the torchrun variables), CD attached to the prepared
    optimizer of the DDP-wrapped model; writes its micro-batches and weights after each update to rank<r>.pt.
    No lr schedule: accelerate steps a prepared schedule once per process at each update (its convention)."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    decay, batches, after = train(tiny_vit().double(), "prepared", schedule=False)
    assert AcceleratorState().num_processes == world and decay.num_updates == STEPS
    torch.save({"batches": batches, "after": after}, os.path.join(out, f"rank{rank}.pt"))
    leave_and_exit()


@pytest.mark.slow
def test_two_processes_end_identical_and_equal_one_process_on_the_concatenated_batches(tmp_path):
    """DDP over gloo (2 CPU processes, each its own shard of the loader): both ranks end with the same weights, those
    of the float64 reference on each micro-step's two shards concatenated (DDP averages the ranks' gradients)."""
    spawn_within(_rank, (2, free_port(), str(tmp_path)), nprocs=2, seconds=120)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for got, other in zip(ranks[0]["after"], ranks[1]["after"]):
        assert all(torch.equal(got[n], other[n]) for n in got)
    assert not torch.equal(ranks[0]["batches"][0][0], ranks[1]["batches"][0][0])  # each rank its own data
    both = [tuple(torch.cat(parts) for parts in zip(a, b)) for a, b in zip(ranks[0]["batches"], ranks[1]["batches"])]
    micro = [both[i * ACCUM:(i + 1) * ACCUM] for i in range(STEPS)]

    def run(variant):
        ref = tiny_vit().double()  # the ranks' initial weights (seeded)
        opt, _ = vit_optimizer_and_schedule(ref, STEPS)
        return reference_run(ref, micro, lambda m, b: F.cross_entropy(m(b[0]), b[1]), opt, None,
                             vit_pairs(BLOCKS, DIM), LAM, clip=CLIP, variant=variant)

    assert_matches_reference(ranks[0]["after"], run, TOL, variants=("per_micro_batch", "after_step"))


def test_bf16_autocast_gets_the_papers_update_once_per_update():
    """accelerate's bf16 on the CPU (autocast around the model's forward; fp32 weights): CD runs once per update,
    as in the fp32 run of the same loop, and its update inside the step is the paper's, from the weights the step
    found (float64 reference, cd_models.ref_w2), with the lr of W2's group."""
    fp32, _, _ = train(tiny_vit(), "prepared", dtype=torch.float32)
    reset_accelerate()
    net = tiny_vit()
    dtypes = []  # of fc2's output at each forward (the first ones: CD's pair check, outside the loop)
    net.blocks[0].mlp.fc2.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    seen = []  # per update: fc2 and fc1 before CD, fc2's lr, fc2 after CD
    fc1, fc2 = net.blocks[1].mlp.fc1.weight, net.blocks[1].mlp.fc2.weight

    def before(opt, args, kwargs):
        lr = next(g["lr"] for g in opt.param_groups if any(p is fc2 for p in g["params"]))
        seen.append([fc2.detach().clone(), fc1.detach().clone(), lr])

    decay, _, _ = train(net, "raw", mixed_precision="bf16", dtype=torch.float32,
                        around_cd=(before, lambda opt, args, kwargs: seen[-1].append(fc2.detach().clone())))
    assert dtypes[-STEPS * ACCUM:] == [torch.bfloat16] * (STEPS * ACCUM)  # the loop's forwards ran under autocast
    assert decay.num_updates == fp32.num_updates == STEPS
    assert decay.metrics()["cd/updates"] == fp32.metrics()["cd/updates"] == STEPS
    assert len(seen) == STEPS
    for t, (w2, w1, lr, got) in enumerate(seen):
        want = ref_w2(w2, w1, lr * LAM)
        assert not torch.equal(got, w2)
        assert torch.allclose(got.double(), want, rtol=0, atol=1e-6), (t, float((got.double() - want).abs().max()))


def test_a_step_that_accelerate_saved_without_hooks_is_refused_at_attach_and_attach_before_prepare_works():
    """With a GradScaler (fp16; set by hand here: accelerate 1.15 uses none on the CPU), accelerate keeps the
    optimizer's bound `step` from `prepare` on and steps through it. An optimizer that skips Optimizer.__init__
    (timm's Lookahead) has a `step` that calls no step hook until torch wraps its class's step: an attach after
    `prepare` would never run (before: 0 updates of STEPS, silently). Attached before `prepare`, CD runs at each
    update."""
    from timm.optim import Lookahead

    for order in ("prepared", "raw_after_a_step", "raw"):
        class FreshLookahead(Lookahead):  # a class of its own: torch's wrapping of a step is per class, for good
            def step(self, closure=None):
                return super().step(closure)

        reset_accelerate()
        net = tiny_vit()
        opt = FreshLookahead(torch.optim.AdamW(net.parameters(), lr=1e-2))
        accelerator = Accelerator(cpu=True)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        decay = ColinearityDecay(net, lam=LAM)
        if order == "raw":
            decay.attach(opt)
        model, optimizer, loader = accelerator.prepare(net, opt, image_loader(STEPS, dtype=torch.float32))
        for i, (x, y) in enumerate(loader):
            if i == 0 and order == "prepared":
                with pytest.raises(RuntimeError, match=r"AcceleratedOptimizer\._optimizer_original_step_method is a "
                                                       r"`step` of FreshLookahead .*\(before accelerator\.prepare"):
                    decay.attach(optimizer)
            if i == 1 and order == "raw_after_a_step":  # accelerate left the saved step on the optimizer itself
                with pytest.raises(RuntimeError, match=r"FreshLookahead\.step is a `step` of FreshLookahead"):
                    decay.attach(opt)
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        assert decay.num_updates == (STEPS if order == "raw" else 0), order


def test_register_for_checkpointing_carries_the_update_counter_through_save_and_load_state(tmp_path):
    """CD's update has no state; its `cd/updates` counter and config echo (state_dict) go into accelerate's
    save_state as a registered object and come back with load_state, into a new ColinearityDecay."""
    decay, _, _ = train(tiny_vit().double(), "prepared")
    accelerator = Accelerator(cpu=True)
    accelerator.register_for_checkpointing(decay)
    accelerator.save_state(str(tmp_path / "state"))
    reset_accelerate()
    resumed = ColinearityDecay(tiny_vit().double(), lam=LAM)
    accelerator = Accelerator(cpu=True)
    accelerator.register_for_checkpointing(resumed)
    accelerator.load_state(str(tmp_path / "state"))
    assert resumed.num_updates == STEPS and resumed.metrics()["cd/updates"] == STEPS

def test_the_readme_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """cd/README.md's custom accelerate loop, pasted as it is: 4 updates, each with CD."""
    with open(os.path.join(ROOT, "cd", "README.md")) as f:
        section = f.read().split("#### A custom accelerate loop", 1)[1].split("\n### ", 1)[0]
    (code,) = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "cd/README.md", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert "cd/pair_energy/fc2" in out and "'cd/updates': 4.0" in out, out


def test_deepspeeds_optimizers_are_refused_at_attach_by_name_not_as_matrices_missing_from_the_optimizer():
    """In a custom loop under accelerate's DeepSpeed plugin, `prepare` returns DeepSpeedOptimizerWrapper (whose step()
    does nothing: the engine steps inside accelerator.backward) around the engine's optimizer, which under ZeRO steps
    the user's optimizer on one flat partition of the weights. attach looked through to that optimizer and refused it
    as one that holds none of the decayed matrices ("give the optimizer the model's parameters", which it was given),
    or warned that CD leaves the missing ones alone where it held some; accelerate's DummyOptim (a DeepSpeed config's
    own optimizer) was "not a torch.optim.Optimizer"; ZeRO-3's parameters (ds_id) went unnoticed. Each is one
    RuntimeError naming DeepSpeed and the fix, and nothing is attached. DeepSpeed is not installed: a ZeRO optimizer
    stand-in of its module and name."""
    from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper, DummyOptim

    net = tiny_vit()
    decay = ColinearityDecay(net, lam=LAM)
    Accelerator(cpu=True)  # the state accelerate's optimizer wrapper reads
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).requires_grad_()  # ZeRO-1/2's partition
    inner = torch.optim.AdamW([flat], lr=1e-2)
    zero = type("DeepSpeedZeroOptimizer", (), {"__module__": "deepspeed.runtime.zero.stage_1_and_2"})()
    zero.optimizer = inner
    for given, found in ((DeepSpeedOptimizerWrapper(zero), "DeepSpeedOptimizerWrapper, DeepSpeedZeroOptimizer"),
                         (zero, "DeepSpeedZeroOptimizer"), (DummyOptim(net.parameters()), "DummyOptim")):
        with pytest.raises(RuntimeError, match=rf"^ColinearityDecay\.attach: CD does not support DeepSpeed \(found "
                                               rf"{found}\).*; train without DeepSpeed \(drop accelerate's DeepSpeed"):
            decay.attach(given)
        assert decay._attached() is None and not inner._optimizer_step_pre_hooks
    net.blocks[0].attn.qkv.weight.ds_id = 0  # ZeRO-3 (zero.Init) marks each parameter it partitions
    plain = torch.optim.AdamW(net.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match=r"CD does not support DeepSpeed \(found ZeRO-3 partitioned parameters\)"):
        decay.attach(plain)
    assert decay._attached() is None and not plain._optimizer_step_pre_hooks


def test_an_attached_optimizer_whose_matrices_deepspeed_replaced_by_flat_copies_is_refused_at_its_step():
    """attach's own advice is to attach before accelerator.prepare; under DeepSpeed, `prepare` (deepspeed.initialize)
    then replaces the attached optimizer's parameters in place by flat fp32 copies (partitions under ZeRO) and the
    engine steps it on them: the hook found no decayed matrix in the optimizer and returned, so every update ran
    without CD and without a word. A step of an attached optimizer that holds none of the decayed matrices it held at
    attach is refused before the optimizer changes anything; one that still holds them gets CD (closed form below)."""
    net = tiny_vit().double()
    decay = ColinearityDecay(net, lam=LAM)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    decay.attach(opt)
    w2 = net.blocks[0].mlp.fc2.weight
    w2.grad = torch.zeros_like(w2)
    want = ref_w2(w2.detach(), net.blocks[0].mlp.fc1.weight.detach(), LAM * 0.1)  # eq. 12 at lr 0.1
    opt.step()  # plain SGD on a zero gradient: the weight is CD's update alone
    assert decay.num_updates == 1 and torch.allclose(w2.detach(), want, rtol=0, atol=1e-12)
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).requires_grad_()  # DeepSpeed's copy
    flat.grad = torch.ones_like(flat)
    for group in opt.param_groups:  # as DeepSpeed's ZeRO optimizer rewrites the optimizer it is given
        group["params"] = [flat] if group is opt.param_groups[0] else []
    before = flat.detach().clone()
    with pytest.raises(RuntimeError, match=r"^ColinearityDecay\.attach: the attached SGD no longer holds any of the "
                                           r"decayed matrices it held at attach .*CD does not support DeepSpeed"):
        opt.step()
    assert torch.equal(flat.detach(), before) and decay.num_updates == 1
