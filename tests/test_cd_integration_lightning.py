"""cd.integrations.lightning in a real Lightning Trainer (CPU, float64): a tiny timm ViT trained a few steps,
its weights after every update compared with the float64 reference of (task step + CD) in a plain loop
(tests/cd_integration_refs.py), which the wrong placements of CD miss by far. Lightning's automatic
optimization steps with `optimizer.step(closure)` (forward and backward inside the closure), so every test
here is a closure-based step; plus gradient accumulation, per-group lrs, clipping, a step the GradScaler
skips (also under manual optimization), manual optimization, torch's ZeroRedundancyOptimizer (on 1 and 2
processes) and resume from a Lightning checkpoint."""
from __future__ import annotations

import contextlib
import copy
import os
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning")
from lightning.pytorch.plugins.precision import MixedPrecision, Precision  # noqa: E402

from cd import ColinearityDecay, UnsupportedModelError  # noqa: E402
from cd.integrations.lightning import ColinearityDecayCallback  # noqa: E402
from cd_integration_refs import (assert_matches_reference, image_loader, reference_run,  # noqa: E402
                                 vit_optimizer_and_schedule, vit_pairs)
from cd_models import VIT_DEPTH, tiny_vit  # noqa: E402

LAM, TOL, DIM = 0.5, 1e-10, 32
BLOCKS = [f"blocks.{i}" for i in range(VIT_DEPTH)]


class Module(L.LightningModule):
    """The ViT, a cross-entropy step, the optimizer above; records its micro-batches and the weights after each
    update. `poison`: the update whose loss is multiplied by inf (an fp16 overflow)."""

    def __init__(self, net, steps: int, poison: int = -1, manual: bool = False) -> None:
        super().__init__()
        self.net, self.steps, self.poison = net, steps, poison
        self.automatic_optimization = not manual
        self.example_input_array = torch.zeros(1, 3, 32, 32, dtype=torch.float64)
        self.batches, self.after = [], []
        self.raw = False  # manual optimization on the torch optimizer itself, around Lightning's step

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.batches.append((x.clone(), y.clone()))
        loss = F.cross_entropy(self(x), y)
        if self.trainer.global_step == self.poison:
            loss = loss * float("inf")
        if self.automatic_optimization:
            return loss
        opt = self.optimizers(use_pl_optimizer=not self.raw)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.fit_loop._should_accumulate() and self.automatic_optimization:
            return
        self.after.append({n: p.detach().clone() for n, p in self.net.named_parameters()})

    def configure_optimizers(self):
        opt, sched = vit_optimizer_and_schedule(self.net, self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ScalerOnly(MixedPrecision):
    """Lightning's 16-mixed step (GradScaler: unscale, on_before_optimizer_step, scaler.step that skips on inf)
    without autocast: the CPU stand-in for fp16 AMP, exact in float64."""

    def __init__(self) -> None:
        super().__init__("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))

    def forward_context(self):
        return contextlib.nullcontext()


def fit(module, steps, accum=1, clip=None, plugins=None, n_batches=8, ckpt_path=None, callback=None, max_epochs=None):
    trainer = L.Trainer(max_steps=steps, max_epochs=max_epochs, accumulate_grad_batches=accum, gradient_clip_val=clip,
                        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, plugins=plugins,
                        precision=None if plugins else "64-true",
                        callbacks=[callback or ColinearityDecayCallback(lam=LAM)])
    trainer.fit(module, image_loader(n_batches), ckpt_path=ckpt_path)
    return trainer


def check(initial, module, steps, accum, clip=None, skipped=(), sched_on_skip=False, variants=None):
    micro = [[module.batches[i * accum + k] for k in range(accum)] for i in range(steps)]

    def run(variant):
        net = copy.deepcopy(initial)
        opt, sched = vit_optimizer_and_schedule(net, steps)
        return reference_run(net, micro, lambda m, b: F.cross_entropy(m(b[0]), b[1]), opt, sched,
                             vit_pairs(BLOCKS, DIM), LAM, clip=clip, skipped=skipped,
                             scheduler_steps_on_skip=sched_on_skip, variant=variant)

    assert_matches_reference(module.after, run, TOL, **({} if variants is None else {"variants": variants}))


def cd_callback(trainer) -> ColinearityDecayCallback:
    return next(c for c in trainer.callbacks if isinstance(c, ColinearityDecayCallback))


def test_closure_step_with_accumulation_clipping_and_group_lrs_matches_the_reference():
    net = tiny_vit().double()
    initial = copy.deepcopy(net)
    module = Module(net, steps=3)
    trainer = fit(module, 3, accum=2, clip=0.5)
    check(initial, module, 3, 2, clip=0.5,
          variants=("before_backward", "per_micro_batch", "after_step", "first_group_lr"))
    assert cd_callback(trainer).decay.num_updates == 3


def test_a_step_the_grad_scaler_skips_applies_no_cd():
    net = tiny_vit().double()
    initial = copy.deepcopy(net)
    module = Module(net, steps=3, poison=1)
    trainer = fit(module, 3, plugins=[ScalerOnly()])
    assert all(torch.equal(module.after[0][n], module.after[1][n]) for n in module.after[0])
    # Lightning steps the scheduler after a skipped step too
    check(initial, module, 3, 1, skipped=(1,), sched_on_skip=True, variants=("on_skipped_step", "after_step"))
    assert cd_callback(trainer).decay.num_updates == 2


def test_manual_optimization_matches_the_reference():
    net = tiny_vit().double()
    initial = copy.deepcopy(net)
    module = Module(net, steps=2, manual=True)
    fit(module, 2)
    check(initial, module, 2, 1, variants=("before_backward", "after_step", "first_group_lr"))


def test_manual_optimization_under_a_grad_scaler_applies_no_cd_on_the_step_it_skips():
    """Manual optimization under 16-mixed: `opt.step()` goes through the GradScaler, which skips the poisoned
    update; CD acts once per step taken, none on the skipped one (its lr schedule steps in training_step)."""
    net = tiny_vit().double()
    initial = copy.deepcopy(net)
    module = Module(net, steps=3, poison=1, manual=True)
    trainer = fit(module, 3, plugins=[ScalerOnly()])
    assert all(torch.equal(module.after[0][n], module.after[1][n]) for n in module.after[0])
    check(initial, module, 3, 1, skipped=(1,), sched_on_skip=True, variants=("on_skipped_step", "after_step"))
    assert cd_callback(trainer).decay.num_updates == 2


class ZeroModule(Module):
    """The optimizer above as torch's ZeroRedundancyOptimizer (each rank steps its shard of the parameters with
    AdamW, then broadcasts it), its second param group added as ZeRO takes groups."""

    def configure_optimizers(self):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        own = [p for n, p in self.net.named_parameters() if n.endswith(("qkv.weight", "fc1.weight"))]
        rest = [p for p in self.net.parameters() if all(p is not q for q in own)]
        opt = ZeroRedundancyOptimizer(rest, optimizer_class=torch.optim.AdamW, lr=2e-2, weight_decay=0.1)
        opt.add_param_group({"params": own, "lr": 5e-3})
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * self.steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_zero_redundancy_optimizer_under_ddp_matches_the_reference():
    """torch's ZeroRedundancyOptimizer in Lightning's DDP (gloo, one process): CD runs in its step (the one
    Lightning steps; the inner AdamW's is a part of it), with each group's lr, as for the plain AdamW."""
    net = tiny_vit().double()
    initial = copy.deepcopy(net)
    module = ZeroModule(net, steps=3)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, strategy="ddp", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        precision="64-true", callbacks=[ColinearityDecayCallback(lam=LAM)])
    # Lightning leaves its process group up, which a later test's init_process_group would meet, and its launch
    # variables (LOCAL_RANK, MASTER_ADDR, MASTER_PORT, NODE_RANK) set, which made a later transformers Trainer
    # (accelerate's state) start a process group of its own, met by test_cd_integration_mmengine's DDP tests
    try:
        with mock.patch.dict(os.environ):
            trainer.fit(module, image_loader(8))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    check(initial, module, 3, 1, variants=("before_backward", "after_step", "first_group_lr"))
    assert cd_callback(trainer).decay.num_updates == 3


def _zero_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank of Lightning's DDP over gloo, launched as torchrun launches it (Lightning then starts no process of
    its own), training ZeroModule with the callback; writes its micro-batches, its weights after each update, CD's
    update count and the names of the parameters its shard of the ZeroRedundancyOptimizer steps to rank<r>.pt."""
    import os

    from dist_utils import as_torchrun_rank, leave_and_exit
    as_torchrun_rank(rank, world, port)
    os.environ.update(GROUP_RANK="0", LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_RUN_ID="cd-zero")
    module = ZeroModule(tiny_vit().double(), steps=3)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=world, strategy="ddp", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        precision="64-true", callbacks=[ColinearityDecayCallback(lam=LAM)])
    trainer.fit(module, image_loader(8))
    names = {id(p): n for n, p in module.net.named_parameters()}
    shard = [names[id(p)] for g in trainer.optimizers[0].optim.param_groups for p in g["params"]]
    torch.save({"batches": module.batches, "after": module.after, "updates": cd_callback(trainer).decay.num_updates,
                "shard": shard}, os.path.join(out, f"rank{rank}.pt"))
    leave_and_exit()


@pytest.mark.slow
def test_zero_redundancy_optimizer_on_two_processes_matches_one_process_on_both_ranks_batches(tmp_path):
    """ZeroRedundancyOptimizer in Lightning's DDP on 2 gloo processes: each rank's AdamW steps its shard of the
    parameters, then ZeRO broadcasts the shards. CD runs once per update on every rank, before the step, so both
    ranks end every update with the same weights, those of the float64 reference in one process on the two ranks'
    batches together (DDP averages their gradients), whichever rank's shard holds a matrix."""
    from dist_utils import free_port, spawn_within
    spawn_within(_zero_rank, (2, free_port(), str(tmp_path)), nprocs=2, seconds=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    decayed = {p.w2 for p in vit_pairs(BLOCKS, DIM)}
    shards = [set(r["shard"]) for r in ranks]
    assert not shards[0] & shards[1] and all(s & decayed for s in shards)  # each rank steps decayed matrices
    assert [r["updates"] for r in ranks] == [3, 3]
    for got, other in zip(ranks[0]["after"], ranks[1]["after"]):
        assert all(torch.equal(got[n], other[n]) for n in got)
    assert not torch.equal(ranks[0]["batches"][0][0], ranks[1]["batches"][0][0])  # each rank its own data
    both = [tuple(torch.cat(parts) for parts in zip(a, b)) for a, b in zip(ranks[0]["batches"], ranks[1]["batches"])]

    def run(variant):
        ref = tiny_vit().double()  # the ranks' initial weights (seeded)
        opt, sched = vit_optimizer_and_schedule(ref, 3)
        return reference_run(ref, [[b] for b in both], lambda m, b: F.cross_entropy(m(b[0]), b[1]), opt, sched,
                             vit_pairs(BLOCKS, DIM), LAM, variant=variant)

    assert_matches_reference(ranks[0]["after"], run, TOL, variants=("before_backward", "after_step", "first_group_lr"))


def test_a_step_of_the_raw_torch_optimizer_is_refused_not_taken_without_cd():
    """Lightning's event (on_before_optimizer_step) comes only through its LightningOptimizer."""
    module = Module(tiny_vit().double(), steps=2, manual=True)
    module.raw = True
    with pytest.raises(RuntimeError, match="took a step without the framework's step event"):
        fit(module, 2, max_epochs=1)  # the raw steps leave Lightning's step count at 0
    assert len(module.batches) == 1  # right after the first step
    # the failed fit left no CD hook on its optimizer: an attach of the model's own is not a second update
    from cd import ColinearityDecay
    ColinearityDecay(module.net, lam=LAM).attach(module.trainer.optimizers[0])


def test_resume_from_a_lightning_checkpoint_continues_exactly(tmp_path):
    initial = tiny_vit().double()
    full = Module(copy.deepcopy(initial), steps=4)
    # one batch per epoch: where Lightning restarts an epoch that a checkpoint cut (it replays a loader without
    # state from its start) does not matter here
    fit(full, 4, n_batches=1)
    cut = Module(copy.deepcopy(initial), steps=4)
    trainer = fit(cut, 2, n_batches=1)
    trainer.save_checkpoint(tmp_path / "cut.ckpt")
    resumed = Module(tiny_vit(seed=5).double(), steps=4)  # other weights: the checkpoint's must win
    trainer = fit(resumed, 4, n_batches=1, ckpt_path=tmp_path / "cut.ckpt")
    assert len(resumed.after) == 2
    for got, want in zip(resumed.after, full.after[2:]):
        assert all(torch.allclose(got[n], want[n], rtol=0, atol=TOL) for n in want)
    assert cd_callback(trainer).decay.num_updates == 4


def test_module_names_the_part_to_decay_when_the_lightning_module_cannot_run_a_forward():
    net = tiny_vit().double()
    initial = copy.deepcopy(net)
    module = Module(net, steps=2)
    module.example_input_array = None  # nothing tells CD the LightningModule's input
    with pytest.raises(UnsupportedModelError, match=r"cannot tell the input size of Module.*set the LightningModule's "
                       r"example_input_array or pass ColinearityDecayCallback\(example_input=.*verify=False"):
        fit(module, 2)
    module = Module(copy.deepcopy(initial), steps=2)
    module.example_input_array = None
    trainer = fit(module, 2, callback=ColinearityDecayCallback(module="net", lam=LAM))  # timm's net tells its own
    check(initial, module, 2, 1, variants=("before_backward", "after_step"))
    assert cd_callback(trainer).decay.pairs[0].name == "blocks.0.attn.qkv.weight"


def test_a_refused_example_names_what_a_lightning_user_sets_and_both_spellings_work():
    """Lightning users set example_input_array on the LightningModule; the callback's example_input= works too."""
    module = Module(tiny_vit().double(), steps=1)
    module.example_input_array = torch.zeros(1, 3, 7, 7, dtype=torch.float64)  # not the net's 32 x 32
    with pytest.raises(UnsupportedModelError, match=r"set the LightningModule's example_input_array or pass "
                       r"ColinearityDecayCallback\(example_input=\.\.\.\) of the right shape"):
        fit(module, 1)
    module.example_input_array = None
    callback = ColinearityDecayCallback(lam=LAM, example_input=torch.zeros(1, 3, 32, 32, dtype=torch.float64))
    assert cd_callback(fit(module, 1, callback=callback)).decay.num_updates == 1
    with pytest.raises(UnsupportedModelError, match=r"give net's own input as ColinearityDecayCallback\(module='net', "
                       r"example_input=\.\.\.\) of the right shape"):
        fit(Module(tiny_vit().double(), steps=1), 1,
            callback=ColinearityDecayCallback(module="net", example_input=torch.zeros(1, 3, 7, 7, dtype=torch.float64)))


def test_a_restored_state_that_has_not_trained_yet_is_saved_again_as_restored():
    """Between Lightning's restore and on_train_start (a validate(ckpt_path=...) followed by save_checkpoint), the
    callback has no decay yet: its checkpoint state is the one restored, not a lost counter."""
    saved = {"num_updates": 7, "lam": 0.5}
    callback = ColinearityDecayCallback(lam=0.5)
    assert callback.state_dict() == {"cd": None}
    callback.load_state_dict({"cd": saved})
    assert callback.state_dict() == {"cd": saved}


def test_callbacks_on_two_parts_have_their_own_checkpoint_keys_and_module_is_checked():
    """Lightning refuses two stateful callbacks of one state_key; the whole module's keeps the class name."""
    whole, a, b = ColinearityDecayCallback(), ColinearityDecayCallback(module="a"), ColinearityDecayCallback(module="b")
    assert whole.state_key == "ColinearityDecayCallback" and len({whole.state_key, a.state_key, b.state_key}) == 3
    with pytest.raises(TypeError, match="module must be"):
        ColinearityDecayCallback(0.005)  # lam by position


def test_module_none_is_refused_and_the_example_goes_to_the_lightning_module_only():
    """module=None is not Lightning's default ("" is the whole module): it would be select_module's `backbone`
    (MMEngine's convention), here a part that the LightningModule's example_input_array (64 px, resized in its
    forward) does not fit. Refused at once, naming the two values taken."""
    with pytest.raises(TypeError, match=r'module must be "" \(the whole module\) or a dotted submodule name'):
        ColinearityDecayCallback(module=None, lam=LAM)

    class Resizing(Module):
        def forward(self, x):
            return self.net(F.interpolate(x, size=32))

    module = Resizing(tiny_vit().double(), steps=1)
    module.backbone = module.net  # what None would pick
    module.example_input_array = torch.zeros(1, 3, 64, 64, dtype=torch.float64)
    trainer = fit(module, 1, callback=ColinearityDecayCallback(module="", lam=LAM))  # the example fits the whole
    assert cd_callback(trainer).decay.num_updates == 1


def test_a_finished_fit_leaves_no_cd_on_its_optimizer():
    """After fit() the optimizer is the user's again: a step of their own is neither refused (strict_steps) nor
    given the callback's CD, and an attach of their own is not refused as a second CD update."""
    module = Module(tiny_vit().double(), steps=2)
    trainer = fit(module, 2)
    opt = trainer.optimizers[0]
    F.cross_entropy(module(torch.zeros(2, 3, 32, 32, dtype=torch.float64)), torch.tensor([0, 1])).backward()
    opt.step()
    assert cd_callback(trainer).decay.num_updates == 2
    ColinearityDecay(module.net, lam=LAM).attach(opt).remove()


def test_the_lightning_modules_example_input_is_not_given_to_the_part_that_module_names():
    """module="net": the LightningModule's example_input_array is the whole module's input (here images of
    another size, which it would resize), not that part's; timm's net tells its own."""
    module = Module(tiny_vit().double(), steps=1)
    module.example_input_array = torch.zeros(1, 3, 64, 64, dtype=torch.float64)
    trainer = fit(module, 1, callback=ColinearityDecayCallback(module="net", lam=LAM))
    assert cd_callback(trainer).decay.num_updates == 1


def _w1_apart(net):
    """Each functional pair's W1 (qkv, fc1, with the norms) in the first group, its W2 and the rest in the second."""
    first = [p for n, p in net.named_parameters() if n.endswith(("qkv.weight", "fc1.weight", "norm1.weight",
                                                                 "norm2.weight"))]
    return first, [p for p in net.parameters() if all(p is not q for q in first)]


class TwoOptimizers(Module):
    """Manual optimization over two optimizers (a model split between them, as a GAN's generator and
    discriminator are), stepped `a` then `b` after one backward: `b`'s CD must read the W1s that `a` holds as they
    were before `a` stepped them."""

    def __init__(self, net, steps: int) -> None:
        super().__init__(net, steps, manual=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.batches.append((x.clone(), y.clone()))
        opts = self.optimizers()
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(F.cross_entropy(self(x), y))
        for opt in opts:
            opt.step()

    def configure_optimizers(self):
        a, b = _w1_apart(self.net)
        return [torch.optim.AdamW(a, lr=2e-2, weight_decay=0.1), torch.optim.AdamW(b, lr=5e-3, weight_decay=0.1)]


def test_a_pair_split_over_two_optimizers_reads_the_weights_of_before_the_steps():
    net = tiny_vit().double()
    initial = copy.deepcopy(net)
    module = TwoOptimizers(net, steps=3)
    trainer = fit(module, 6)  # Lightning counts each optimizer's step in manual optimization

    def run(variant):
        ref = copy.deepcopy(initial)
        a, b = _w1_apart(ref)
        opt = torch.optim.AdamW([{"params": a, "lr": 2e-2}, {"params": b, "lr": 5e-3}], weight_decay=0.1)
        return reference_run(ref, [[batch] for batch in module.batches], lambda m, x: F.cross_entropy(m(x[0]), x[1]),
                             opt, None, vit_pairs(BLOCKS, DIM), LAM, variant=variant)

    assert_matches_reference(module.after, run, TOL, variants=("after_step", "first_group_lr"))
    assert cd_callback(trainer).decay.metrics()["cd/updates"] == 3  # one update per iteration, not per optimizer


class RawAfterLightningsStep(Module):
    """Manual optimization: in batch 0 a step through Lightning (its loss times inf with `skip`, so that the
    GradScaler skips it), then a step of the raw torch optimizer, in the same batch or (`skip`) in the next one."""

    def __init__(self, net, skip: bool) -> None:
        super().__init__(net, steps=2, manual=True)
        self.skip = skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss * float("inf") if self.skip and batch_idx == 0 else loss)
        if batch_idx == 0:
            opt.step()
        if batch_idx == int(self.skip):
            self.optimizers(use_pl_optimizer=False).step()


@pytest.mark.parametrize("skip", [False, True], ids=["same_batch", "batch_after_a_skipped_step"])
def test_a_raw_step_after_a_step_through_lightning_is_refused_too(skip):
    """Lightning's event is for its own step only: a raw step later in that batch, or in the batch after a step
    the GradScaler skipped (whose event armed CD and no step took it), is a step around Lightning, refused."""
    module = RawAfterLightningsStep(tiny_vit().double(), skip)
    with pytest.raises(RuntimeError, match="took a step without the framework's step event"):
        fit(module, 4, max_epochs=1, plugins=[ScalerOnly()] if skip else None)


def test_by_default_the_whole_lightning_module_is_decayed_also_one_with_a_backbone():
    """module="" (the default) is the whole LightningModule, not its `backbone` (MMEngine's default): a block
    outside the backbone gets CD too."""
    from types import SimpleNamespace

    from timm.models.vision_transformer import Block

    class WithBackbone(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone, self.neck = tiny_vit(), Block(DIM, 2)
            self.example_input_array = torch.zeros(1, 3, 32, 32)

        def forward(self, x):
            return self.neck(self.backbone.forward_features(x))

    module = WithBackbone()
    callback = ColinearityDecayCallback(lam=LAM)
    trainer = SimpleNamespace(optimizers=[torch.optim.SGD(module.parameters(), lr=0.1)],
                              precision_plugin=Precision())  # the attributes of a Trainer the callback reads
    callback.on_train_start(trainer, module)
    blocks = [f"backbone.{b}" for b in BLOCKS] + ["neck"]
    assert [p.name for p in callback.decay.pairs] == [f"{b}.{w}.weight" for b in blocks
                                                      for w in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
    callback.on_train_end(None, module)


def test_a_refusal_that_starts_a_sentence_with_its_fix_keeps_the_capital():
    """cd/values.py's masks refusal starts a sentence with "Pass example_input=": the Lightning wording replaces it
    as a sentence (capital kept), mid-sentence ones in lower case."""
    from cd.integrations.lightning import _lightning_names

    got = _lightning_names("No zero. Pass example_input= with masks, or pass example_input= again", "")
    assert got == ("No zero. Set the LightningModule's example_input_array or pass "
                   "ColinearityDecayCallback(example_input=...) with masks, or set the LightningModule's "
                   "example_input_array or pass ColinearityDecayCallback(example_input=...) again")
    assert _lightning_names("No zero. Pass example_input= now", "net") == (
        "No zero. Give net's own input as ColinearityDecayCallback(module='net', example_input=...) now")


def test_a_callback_reused_for_a_new_fit_after_a_resumed_one_counts_that_fits_updates_only(tmp_path):
    """The restored counter belongs to the fit that resumed from the checkpoint: a later fit without ckpt_path
    (a new run, e.g. the same callback object in a notebook) counts its own updates from 0."""
    trainer = fit(Module(tiny_vit().double(), steps=2), 2, n_batches=1)
    trainer.save_checkpoint(tmp_path / "cut.ckpt")
    callback = ColinearityDecayCallback(lam=LAM)
    fit(Module(tiny_vit().double(), steps=3), 3, n_batches=1, ckpt_path=tmp_path / "cut.ckpt", callback=callback)
    assert callback.decay.num_updates == 3  # 2 restored + 1 taken
    fit(Module(tiny_vit().double(), steps=2), 2, n_batches=1, callback=callback)
    assert callback.decay.num_updates == 2  # the new run's 2 updates, not 3 + 2


def test_a_fit_after_a_validate_from_a_checkpoint_counts_its_own_updates_only(tmp_path):
    """validate(ckpt_path=...) restores the callback's state too; the fit that follows without ckpt_path is a new
    run: its counter counts its own updates."""
    trainer = fit(Module(tiny_vit().double(), steps=2), 2, n_batches=1)
    trainer.save_checkpoint(tmp_path / "cut.ckpt")
    callback = ColinearityDecayCallback(lam=LAM)
    module = Module(tiny_vit().double(), steps=2)
    module.validation_step = lambda batch, batch_idx: None
    L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
              precision="64-true", callbacks=[callback]).validate(module, image_loader(1),
                                                                  ckpt_path=tmp_path / "cut.ckpt")
    fit(Module(tiny_vit().double(), steps=2), 2, n_batches=1, callback=callback)
    assert callback.decay.num_updates == 2  # not 2 restored + 2


def test_a_scheduler_built_on_an_unhooked_lookahead_is_refused_and_zero_grad_first_gets_cd_at_every_update():
    """configure_optimizers builds the lr scheduler before the callback binds: on timm's Lookahead (it skips
    Optimizer.__init__) before torch wraps its class's step, the scheduler keeps a `step` that calls no step hooks,
    and CD silently never ran (cd/updates 0 after every fit). A zero_grad() before the scheduler wraps the class."""
    from timm.optim import Lookahead

    for zero_grad_first in (False, True):
        class FreshLookahead(Lookahead):  # a class of its own: torch's wrapping of a step is per class, for good
            def step(self, closure=None):
                return super().step(closure)

        class WithLookahead(Module):
            def configure_optimizers(self):
                opt = FreshLookahead(torch.optim.SGD(self.net.parameters(), lr=0.1))
                if zero_grad_first:
                    opt.zero_grad()
                return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1)}

        module = WithLookahead(tiny_vit().double(), steps=2)
        if zero_grad_first:
            assert cd_callback(fit(module, 2)).decay.num_updates == 2
        else:
            with pytest.raises(RuntimeError, match=r"FreshLookahead\.step is a `step` of FreshLookahead taken before "
                                                   r"torch made its class's step call step hooks.*zero_grad\(\)"):
                fit(module, 2)


class WithACopy(Module):
    """A LightningModule that keeps a frozen copy of its net (an EMA or a teacher) that its forward never runs."""

    def __init__(self, net, steps: int) -> None:
        super().__init__(net, steps)
        self.ema = copy.deepcopy(net).requires_grad_(False)


def test_a_copy_that_the_forward_does_not_run_is_refused_naming_module_and_the_parts():
    """The whole LightningModule is decayed by default: a frozen copy beside the net (an EMA, a teacher) fails the
    pair check as "not used in the forward pass", which named no fix; the refusal names `module=` and the module's
    children, and module="net" trains."""
    with pytest.raises(UnsupportedModelError, match=r"ema\.blocks\.0.*not used in the forward pass.*"
                       r"ColinearityDecayCallback\(module=\.\.\.\).*\['net', 'ema'\]"):
        fit(WithACopy(tiny_vit().double(), steps=1), 1)
    trainer = fit(WithACopy(tiny_vit().double(), steps=1), 1, callback=ColinearityDecayCallback(module="net", lam=LAM))
    assert cd_callback(trainer).decay.num_updates == 1


class FrozenBlocks(Module):
    """Lightning's BaseFinetuning recipe: the optimizer holds the trainable parameters only (the blocks, frozen by
    the callback below, are added with add_param_group when they are unfrozen)."""

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def test_blocks_frozen_out_of_the_optimizer_and_unfrozen_later_get_cd_from_then_on():
    """It was refused ("no optimizer holds the 8 matrices"), though the binding follows param groups added later:
    now a warning; while frozen the blocks stay as they were, and each update after the unfreeze gets CD."""
    from lightning.pytorch.callbacks import BaseFinetuning

    class Unfreeze(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.net.blocks)

        def finetune_function(self, pl_module, current_epoch, optimizer):
            if current_epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.net.blocks, optimizer)

    def fit_two_epochs(lam):
        module = FrozenBlocks(tiny_vit().double(), steps=4)
        callback = ColinearityDecayCallback(lam=lam)
        trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, precision="64-true",
                            callbacks=[Unfreeze(), callback])
        trainer.fit(module, image_loader(2))
        return module, callback

    initial = tiny_vit().double().blocks.state_dict()
    with pytest.warns(UserWarning, match=r"all 8 matrices CD decays are frozen .* and in no optimizer"):
        module, callback = fit_two_epochs(LAM)
    frozen = {n[len("blocks."):]: w for n, w in module.after[1].items() if n.startswith("blocks.")}
    assert all(torch.equal(frozen[n], initial[n]) for n in initial)  # epoch 0: neither the step nor CD moved them
    assert callback.decay.num_updates == 2  # the 2 updates of epoch 1
    plain, _ = fit_two_epochs(0.0)
    name = "blocks.1.mlp.fc2.weight"
    assert not torch.allclose(module.after[-1][name], plain.after[-1][name], rtol=0, atol=1e-6)


def test_a_float32_example_input_array_serves_a_true_precision_run_as_lightning_converts_its_batches():
    """Users write example_input_array in float32; under precision="64-true" (or "bf16-true") Lightning converts
    every batch to the module's dtype (precision_plugin.convert_input), but the pair check ran the example as given
    and refused the module ("Input type (float) and bias type (double)", asking for "the right shape")."""
    net = tiny_vit().double()
    initial = copy.deepcopy(net)
    module = Module(net, steps=2)
    module.example_input_array = torch.zeros(1, 3, 32, 32)  # float32
    fit(module, 2)
    check(initial, module, 2, 1, variants=("after_step",))


class ModuleHooksAfterTheCallbacks(Module):
    """Lightning's step calls, after the closure's backward, the callbacks' `on_before_optimizer_step`, then the
    module's own, then the gradient clipping. This module's hook sets the step's lr to 0 (a warmup written there)
    and its clipping records the weights it sees (adaptive clipping reads them)."""

    def on_before_optimizer_step(self, optimizer):
        for group in optimizer.param_groups:
            group["lr"] = 0.0

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.seen_by_clipping = {n: p.detach().clone() for n, p in self.net.named_parameters()}


@pytest.mark.parametrize("precision", ["64-true", "16-mixed"])
def test_cd_runs_after_the_modules_own_hook_and_the_clipping_with_the_lr_the_step_uses(precision):
    """A step whose lr the module's hook sets to 0 moves no weight (AdamW at lr 0, and CD's lr * lam W2 W1n W1n^T
    at lr 0), and the clipping sees the weights before the update. CD ran in the callbacks' hook when the step had
    a closure (no GradScaler: 64-true here, as fp32 and bf16), with the lr of before, ahead of clipping."""
    net = tiny_vit().double()
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    module = ModuleHooksAfterTheCallbacks(net, steps=1)
    fit(module, 1, plugins=[ScalerOnly()] if precision == "16-mixed" else None)
    assert all(torch.equal(module.seen_by_clipping[n], initial[n]) for n in initial)
    assert all(torch.equal(module.after[0][n], initial[n]) for n in initial)


def test_verify_false_trains_a_module_with_an_example_input_array():
    """The module's example_input_array is given to the pair check only when there is one: with verify=False the
    callback does not pass it on, where ColinearityDecay refuses an example beside verify=False."""
    net = tiny_vit().double()
    initial = copy.deepcopy(net)
    module = Module(net, steps=2)
    fit(module, 2, callback=ColinearityDecayCallback(lam=LAM, verify=False))
    check(initial, module, 2, 1, variants=("after_step",))


class SecondStage(Module):
    """Lightning's way to switch optimizers during fit: at epoch 1 the Trainer sets up the module's optimizer and
    schedule again (a second stage's, here a fresh AdamW and a schedule from its start); `late`: at its own
    on_train_batch_start, after the callbacks' (one batch per epoch); `in_step`: in the first training_step of
    epoch 1."""

    def __init__(self, net, steps: int, late: bool = False, in_step: bool = False) -> None:
        super().__init__(net, steps)
        self.late, self.in_step = late, in_step

    def training_step(self, batch, batch_idx):
        if self.in_step and self.current_epoch == 1 and batch_idx == 0:
            self.trainer.strategy.setup_optimizers(self.trainer)
        return super().training_step(batch, batch_idx)

    def on_train_epoch_start(self):
        if self.current_epoch == 1 and not self.late and not self.in_step:
            self.trainer.strategy.setup_optimizers(self.trainer)

    def on_train_batch_start(self, batch, batch_idx):
        if self.current_epoch == 1 and self.late:
            self.trainer.strategy.setup_optimizers(self.trainer)


def test_an_optimizer_set_up_again_during_fit_gets_cd_as_the_first_one_did():
    """The callback bound the Trainer's optimizers at on_train_start only: the new optimizer's steps had no CD, and
    no error (it skipped an optimizer it had not bound). Each stage's reference starts a fresh optimizer and
    schedule on the weights the first left."""
    net = tiny_vit().double()
    initial = copy.deepcopy(net)
    module = SecondStage(net, steps=2)
    trainer = fit(module, 4, n_batches=2, max_epochs=2)
    micro = [[batch] for batch in module.batches]

    def run(variant):
        ref, out = copy.deepcopy(initial), []
        for stage in (micro[:2], micro[2:]):
            opt, sched = vit_optimizer_and_schedule(ref, 2)
            out += reference_run(ref, stage, lambda m, b: F.cross_entropy(m(b[0]), b[1]), opt, sched,
                                 vit_pairs(BLOCKS, DIM), LAM, variant=variant)
        return out

    assert_matches_reference(module.after, run, TOL, variants=("before_backward", "after_step", "first_group_lr"))
    assert cd_callback(trainer).decay.num_updates == 4


def test_an_optimizer_set_up_after_the_batch_started_is_refused_before_its_step():
    """Set up after the callback's on_train_batch_start, inside the step CD would come too late: an error before
    the step (it was stepped without CD, silently), and the weights are those the first stage left."""
    module = SecondStage(tiny_vit().double(), steps=2, late=True)
    with pytest.raises(RuntimeError, match="an optimizer that ColinearityDecayCallback has not bound"):
        fit(module, 2, n_batches=1, max_epochs=2)
    assert len(module.after) == 1
    assert all(torch.equal(p, module.after[0][n]) for n, p in module.net.named_parameters())


def test_an_optimizer_set_up_in_training_step_is_first_stepped_in_the_next_batch_with_cd():
    """Automatic optimization: Lightning steps the optimizer that the batch started with (bound), so the one set up
    in training_step is not refused; the callback binds it at the next batch's start, and every step gets CD.
    Lightning steps the new schedule at the end of the batch that set it up, before the new optimizer's first step."""
    net = tiny_vit().double()
    initial = copy.deepcopy(net)
    module = SecondStage(net, steps=2, in_step=True)
    trainer = fit(module, 4, n_batches=2, max_epochs=2)
    micro = [[batch] for batch in module.batches]

    def run(variant):
        ref = copy.deepcopy(initial)
        opt, sched = vit_optimizer_and_schedule(ref, 2)
        out = reference_run(ref, micro[:3], lambda m, b: F.cross_entropy(m(b[0]), b[1]), opt, sched,
                            vit_pairs(BLOCKS, DIM), LAM, variant=variant)
        opt, sched = vit_optimizer_and_schedule(ref, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "lr_scheduler.step() before optimizer.step()": Lightning's order
            sched.step()
        return out + reference_run(ref, micro[3:], lambda m, b: F.cross_entropy(m(b[0]), b[1]), opt, sched,
                                   vit_pairs(BLOCKS, DIM), LAM, variant=variant)

    assert_matches_reference(module.after, run, TOL, variants=("before_backward", "after_step", "first_group_lr"))
    assert cd_callback(trainer).decay.num_updates == trainer.global_step == 4


def test_a_resume_whose_checkpoint_holds_no_state_under_the_callbacks_key_warns_naming_the_keys(tmp_path):
    """Lightning hands a callback the state under its own state_key only, which holds module=: a fit resumed with
    another module= (or from a run without CD) restored nothing and counted from 0 without a word, where cd/README.md
    says a resume with another CD config warns. The keys are Lightning's (class name, then the module= kwargs)."""
    trainer = fit(Module(tiny_vit().double(), steps=2), 2, n_batches=1)  # the whole module's callback
    trainer.save_checkpoint(tmp_path / "whole.ckpt")
    assert list(torch.load(tmp_path / "whole.ckpt", weights_only=False)["callbacks"]) == ["ColinearityDecayCallback"]
    callback = ColinearityDecayCallback(module="net", lam=LAM)
    with pytest.warns(UserWarning, match=r"ColinearityDecayCallback: resuming at step 2 with no CD state under "
                                         r"\"ColinearityDecayCallback\{'module': 'net'\}\".*it holds CD state under "
                                         r"'ColinearityDecayCallback' \(no module=\) \(saved by a "
                                         r"ColinearityDecayCallback with another module=.*starts from 0"):
        part = fit(Module(tiny_vit().double(), steps=3), 3, n_batches=1, ckpt_path=tmp_path / "whole.ckpt",
                   callback=callback)
    assert callback.decay.num_updates == 1  # as the warning says: not restored
    # the module= named for a key is the one that continues its counter: the default key is no module=, which
    # "give that module=" said of it too; a part's key names its module=, which restores it
    part.save_checkpoint(tmp_path / "part.ckpt")
    with pytest.warns(UserWarning, match=r"no CD state under 'ColinearityDecayCallback' in the checkpoint; it holds "
                                         r"CD state under \"ColinearityDecayCallback\{'module': 'net'\}\" "
                                         r"\(module='net'\) \(saved"):
        fit(Module(tiny_vit().double(), steps=4), 4, n_batches=1, ckpt_path=tmp_path / "part.ckpt")
    callback = ColinearityDecayCallback(module="net", lam=LAM)
    fit(Module(tiny_vit().double(), steps=4), 4, n_batches=1, ckpt_path=tmp_path / "part.ckpt", callback=callback)
    assert callback.decay.num_updates == 2  # the 1 restored, then 1 more
    plain = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, precision="64-true")
    plain.fit(Module(tiny_vit().double(), steps=2), image_loader(1))
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.warns(UserWarning, match=r"resuming at step 2 with no CD state under 'ColinearityDecayCallback' in "
                                         r"the checkpoint; it holds no CD state \(saved by a run without CD\)"):
        fit(Module(tiny_vit().double(), steps=3), 3, n_batches=1, ckpt_path=tmp_path / "plain.ckpt")
    with warnings.catch_warnings(record=True) as caught:  # the same callback resumes its own state, silently
        warnings.simplefilter("always")
        callback = ColinearityDecayCallback(lam=LAM)
        fit(Module(tiny_vit().double(), steps=3), 3, n_batches=1, ckpt_path=tmp_path / "whole.ckpt", callback=callback)
    assert callback.decay.num_updates == 3 and not [w for w in caught if "no CD state" in str(w.message)]


def test_a_deepspeed_strategy_is_refused_at_the_train_start_before_cd_is_built():
    """Lightning's DeepSpeedStrategy (the real class; DeepSpeed need not be installed) steps the engine's optimizer in
    the engine, on flattened partitions of the weights under ZeRO: the callback bound an optimizer that holds the
    matrices without a word (ZeRO stage 0), or refused one of partitions with "no optimizer holds the matrices CD
    decays ... build the optimizer on the parameters", a fix that does not apply. One RuntimeError naming DeepSpeed,
    and why as it holds in Lightning, whose engine steps after the backward (not inside the backward, as under
    accelerate): the flattened copies of ZeRO and DeepSpeed's fp16/bf16 optimizers, and ZeRO-0 in fp32 training as
    DDP does."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DeepSpeedStrategy
    module = Module(tiny_vit().double(), steps=1)
    trainer = SimpleNamespace(strategy=DeepSpeedStrategy.__new__(DeepSpeedStrategy), precision_plugin=Precision(),
                              optimizers=[torch.optim.SGD(module.parameters(), lr=0.1)])
    callback = ColinearityDecayCallback(lam=LAM)
    with pytest.raises(RuntimeError, match=r"CD does not support DeepSpeed \(found DeepSpeedStrategy\): ZeRO and "
                                           r"DeepSpeed's fp16/bf16 optimizers step flattened.*under accelerate the "
                                           r"engine steps inside the backward.*ZeRO stage 0 in fp32.*trains as DDP "
                                           r"does.*strategy='ddp'"):
        callback.on_train_start(trainer, module)
    assert callback.decay is None and not callback._bindings


class Bf16Module(L.LightningModule):
    """The float32 ViT under SGD; records the dtype of an MLP's output at each forward and, per update, fc2 and fc1
    of block 1 before the step, then fc2's gradient and fc2 after the step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_vit()
        self.example_input_array = torch.zeros(1, 3, 32, 32)
        self.dtypes, self.seen = [], []
        self.net.blocks[0].mlp.fc2.register_forward_hook(lambda m, a, out: self.dtypes.append(out.dtype))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.net.parameters(), lr=0.1)
        fc1, fc2 = self.net.blocks[1].mlp.fc1.weight, self.net.blocks[1].mlp.fc2.weight
        opt.register_step_pre_hook(lambda o, a, k: self.seen.append([fc2.detach().clone(), fc1.detach().clone()]))
        opt.register_step_post_hook(lambda o, a, k: self.seen[-1].extend([fc2.grad.clone(), fc2.detach().clone()]))
        return opt


def test_bf16_mixed_gets_the_papers_update_once_per_update():
    """precision="bf16-mixed" on the CPU (autocast around training_step, float32 weights, no GradScaler): CD runs
    once per update, and the step's result is the paper's update on the weights the step found (float64 reference,
    cd_models.ref_w2) followed by SGD's lr * grad."""
    from cd_models import ref_w2

    module = Bf16Module()
    callback = ColinearityDecayCallback(lam=LAM)
    trainer = L.Trainer(max_steps=3, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        precision="bf16-mixed", callbacks=[callback])
    trainer.fit(module, image_loader(6, dtype=torch.float32))
    assert module.dtypes[-6:] == [torch.bfloat16] * 6  # the training forwards ran under autocast
    assert callback.decay.num_updates == len(module.seen) == 3
    for t, (w2, w1, grad, got) in enumerate(module.seen):
        want = ref_w2(w2, w1, 0.1 * LAM) - 0.1 * grad.double()
        assert torch.allclose(got.double(), want, rtol=0, atol=1e-6), (t, float((got.double() - want).abs().max()))
        assert not torch.allclose(got.double(), w2.double() - 0.1 * grad.double(), rtol=0, atol=1e-4)  # CD acted
