"""cd.integrations.mmengine in a real MMEngine Runner (CPU, float64), enabled by configuration alone: a tiny
timm ViT as the `backbone` of an MMEngine model, trained a few iterations, its weights after every update
compared with the float64 reference of (task step + CD) in a plain loop (tests/cd_integration_refs.py), which
the wrong placements of CD miss by far: gradient accumulation (`accumulative_counts`), per-parameter lrs from
`paramwise_cfg` with a param scheduler, clipping, a step that AmpOptimWrapper's GradScaler skips, resume from
MMEngine's own checkpoint (under torch >= 2.6, whose torch.load defaults to weights_only), and MMDetection's
Swin backbone from an MMDetection-scoped config."""
from __future__ import annotations

import contextlib
import copy
import json
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("mmengine")
from mmengine.hooks import Hook  # noqa: E402
from mmengine.model import BaseModel  # noqa: E402
from mmengine.optim import AmpOptimWrapper, OptimWrapper  # noqa: E402
from mmengine.optim.optimizer import amp_optimizer_wrapper  # noqa: E402
from mmengine.registry import DATASETS, HOOKS, MODELS, OPTIM_WRAPPERS  # noqa: E402

from mmengine_runs import hook_of, run  # noqa: E402
from cd_integration_refs import (RandomImages, RefPair, assert_matches_reference, reference_run,  # noqa: E402
                                 vit_pairs)
from cd_models import VIT_DEPTH, randomize_norms, tiny_vit  # noqa: E402

LAM, TOL, DIM = 0.5, 1e-10, 32
BLOCKS = [f"blocks.{i}" for i in range(VIT_DEPTH)]


@MODELS.register_module(force=True)
class Classifier(BaseModel):
    """An MMEngine model with a `backbone` (a tiny timm ViT, or a backbone config) and a linear head for 10
    classes, in float64 with random norm scales, seeded; it records the micro-batches it trains on. `poison`:
    the iteration whose loss is multiplied by inf."""

    def __init__(self, backbone=None, width: int = 0, poison: int = -1, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = MODELS.build(backbone) if backbone else tiny_vit(seed, randomize=False)
        self.head = torch.nn.Linear(width, 10) if width else torch.nn.Identity()
        randomize_norms(self, seed).double()
        self.poison, self.batches = poison, []

    def init_weights(self):
        """The weights made at construction stay (the Runner would call timm's own re-initialisation)."""

    def forward(self, inputs, labels=None, mode="tensor"):
        out = self.backbone(inputs)
        logits = self.head(out[-1].mean(dim=(2, 3)) if isinstance(out, (tuple, list)) else out)
        if mode != "loss":
            return logits
        self.batches.append((inputs.clone(), labels.clone()))
        loss = F.cross_entropy(logits, labels)
        return {"loss": loss * float("inf") if len(self.batches) - 1 == self.poison else loss}


@HOOKS.register_module(force=True)
class RecordWeights(Hook):
    priority = "LOWEST"

    def __init__(self) -> None:
        self.after = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.after.append({n: p.detach().clone() for n, p in runner.model.named_parameters()})


@OPTIM_WRAPPERS.register_module(force=True)
class CpuAmpOptimWrapper(AmpOptimWrapper):
    """AmpOptimWrapper's step (GradScaler unscale, clipping, a scaler.step that skips on inf) on the CPU,
    without autocast: the CPU stand-in for fp16 AMP, exact in float64 (AmpOptimWrapper refuses a CPU)."""

    def __init__(self, **kwargs) -> None:
        with mock.patch.object(amp_optimizer_wrapper, "is_cuda_available", return_value=True):
            super().__init__(**kwargs)
        self.loss_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)

    @contextlib.contextmanager
    def optim_context(self, model):
        with OptimWrapper.optim_context(self, model):
            yield


DATASETS.register_module(name="Data", force=True, module=RandomImages)


def config(tmp_path, iters, accum=1, clip=None, amp=False, model=None, resume=None, lam=LAM, **hook):
    """A Runner config as a user writes it: CD by `custom_imports` and `custom_hooks` alone. `model`: the
    Classifier's config (its `type` another registered model)."""
    wrapper = dict(type="CpuAmpOptimWrapper" if amp else "OptimWrapper", accumulative_counts=accum,
                   optimizer=dict(type="AdamW", lr=2e-2, weight_decay=0.1),
                   paramwise_cfg=dict(custom_keys={"qkv.weight": dict(lr_mult=0.25), "fc1.weight": dict(lr_mult=0.25)}))
    if clip:
        wrapper["clip_grad"] = dict(max_norm=clip)
    return dict(
        model={"type": "Classifier", **(model or {})}, work_dir=str(tmp_path), experiment_name="cd",
        train_dataloader=dict(dataset=dict(type="Data"), batch_size=2, num_workers=0,
                              sampler=dict(type="InfiniteSampler", shuffle=False),
                              collate_fn=dict(type="default_collate")),
        train_cfg=dict(by_epoch=False, max_iters=iters),
        optim_wrapper=wrapper,
        param_scheduler=[dict(type="LinearLR", start_factor=1.0, end_factor=0.5, by_epoch=False, begin=0,
                              end=iters)],
        custom_imports=dict(imports=["cd.integrations.mmengine"], allow_failed_imports=False),
        custom_hooks=[dict(type="ColinearityDecayHook", lam=lam, **hook), dict(type="RecordWeights")],
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=2, by_epoch=False), logger=None),
        resume=resume is not None, load_from=resume, randomness=dict(seed=0), log_level="WARNING")


def reference(initial, runner, iters, accum, pairs, clip=None, skipped=(), variants=None, prefix="backbone."):
    updates = iters // accum
    micro = [[runner.model.batches[i * accum + k] for k in range(accum)] for i in range(updates)]
    after = hook_of(runner, "RecordWeights").after[accum - 1::accum]

    def run_ref(variant):
        net = copy.deepcopy(initial)
        own = [p for n, p in net.named_parameters() if n.endswith(("qkv.weight", "fc1.weight"))]
        rest = [p for p in net.parameters() if all(p is not q for q in own)]
        opt = torch.optim.AdamW([{"params": rest, "lr": 2e-2}, {"params": own, "lr": 5e-3}], weight_decay=0.1)
        # MMEngine's LinearLR reaches its end factor on iteration end - 1, and steps every iteration
        # (micro-batch): update s, on iteration (s + 1) * accum - 1, has the lr of that iteration
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.5 * ((s + 1) * accum - 1) / (iters - 1))
        pairs_ = [RefPair(prefix + p.w2, prefix + p.w1, p.diag, p.rows, p.transposed) for p in pairs]
        return reference_run(net, micro, lambda m, b: F.cross_entropy(m(b[0]), b[1]), opt, sched, pairs_, LAM,
                             clip=clip, skipped=skipped, scheduler_steps_on_skip=True, variant=variant)

    assert_matches_reference(after, run_ref, TOL, **({} if variants is None else {"variants": variants}))


def test_runner_with_accumulation_clipping_and_paramwise_lrs_matches_the_reference(tmp_path):
    runner = run(config(tmp_path, iters=6, accum=2, clip=0.5))
    reference(Classifier(), runner, 6, 2, vit_pairs(BLOCKS, DIM), clip=0.5,
              variants=("before_backward", "per_micro_batch", "after_step", "first_group_lr"))
    decay = hook_of(runner, "ColinearityDecayHook").decay
    assert decay.num_updates == 3 and decay.pairs[0].name == "blocks.0.attn.qkv.weight"  # the backbone's


@MODELS.register_module(force=True)
class TwoUpdatesPerIteration(Classifier):
    """A train_step that updates twice per iteration (inner steps, SAM-like or n-critic loops do)."""

    def train_step(self, data, optim_wrapper):
        for _ in range(2):
            losses = self._run_forward(self.data_preprocessor(data, True), mode="loss")
            loss, log_vars = self.parse_losses(losses)
            optim_wrapper.update_params(loss)
        return log_vars


def test_every_update_of_an_iteration_gets_cd(tmp_path):
    """The hook armed CD once per iteration: of two updates in one train_step, the second ran without it."""
    runner = run(config(tmp_path, iters=3, model=dict(type="TwoUpdatesPerIteration")))
    optimizer = runner.optim_wrapper.optimizer
    assert hook_of(runner, "ColinearityDecayHook").decay.num_updates == 6 == optimizer.state[
        next(iter(optimizer.state))]["step"]  # AdamW's own count of its updates


@HOOKS.register_module(force=True)
class LaterStep(Hook):
    """A hook that runs after ColinearityDecayHook's after_train_iter (priority LOW) and makes one more SGD update
    of the runner's optimizer on the iteration's batch (an extra step, as a SAM-like or n-critic hook does),
    recording the backbone's weights and gradients before that step and its weights after it."""

    priority = "LOW"

    def __init__(self) -> None:
        self.steps: list[tuple[dict, dict, dict]] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        model, wrapper = runner.model, runner.optim_wrapper
        net = model.backbone
        loss, _ = model.parse_losses(model._run_forward(model.data_preprocessor(data_batch, True), mode="loss"))
        wrapper.backward(loss)
        before = ({n: p.detach().clone() for n, p in net.named_parameters()},
                  {n: p.grad.detach().clone() for n, p in net.named_parameters()})
        wrapper.step()
        wrapper.zero_grad()
        self.steps.append((*before, {n: p.detach().clone() for n, p in net.named_parameters()}))


def test_a_step_that_a_later_hook_makes_gets_cd(tmp_path):
    """A hook after ColinearityDecayHook's after_train_iter that steps the runner's optimizer: that update got
    no CD and no error (CD was armed from before_train_iter to the hook's own after_train_iter). Each such step
    is SGD on the weights that CD (eq. 12, from the weights of before the step, ref_block_update) left."""
    from mmengine.runner import Runner

    from cd.integrations.mmengine import ColinearityDecayHook
    from cd_models import ref_block_update

    later, lr, iters = LaterStep(), 0.1, 3
    runner = Runner(model=Classifier(), work_dir=str(tmp_path), log_level="ERROR",
                    train_dataloader=dict(dataset=RandomImages(2 * iters), batch_size=2, num_workers=0,
                                          sampler=dict(type="DefaultSampler", shuffle=False),
                                          collate_fn=dict(type="default_collate")),
                    train_cfg=dict(by_epoch=False, max_iters=iters),
                    optim_wrapper=dict(optimizer=dict(type="SGD", lr=lr)),
                    default_hooks=dict(checkpoint=None, logger=None),
                    custom_hooks=[ColinearityDecayHook(lam=LAM), later])
    runner.train()
    assert len(later.steps) == iters
    assert hook_of(runner, "ColinearityDecayHook").decay.num_updates == 2 * iters  # train_step's and the hook's
    for before, grads, after in later.steps:
        want = {n: w.double() for n, w in before.items()}
        for block in BLOCKS:
            ref_block_update(before, block, lr * LAM, want)
        for name, got in after.items():
            torch.testing.assert_close(got, want[name] - lr * grads[name], rtol=0, atol=1e-12, msg=name)


class LateWrapper(Hook):
    """Sets runner.optim_wrapper to a new SGD wrapper at iteration 1, in a before_train_iter that runs after
    ColinearityDecayHook's (priority LOW): the train_step then steps an optimizer CD has not bound."""

    priority = "LOW"

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if runner.iter == 1:
            runner.optim_wrapper = OptimWrapper(torch.optim.SGD(runner.model.parameters(), lr=0.1))


def test_a_step_of_an_optimizer_cd_has_not_bound_is_refused_before_it_changes_the_weights(tmp_path):
    """The wrapper set after the hook bound the iteration's optimizers stepped the decayed matrices without CD and
    without a word (bound only at the next iteration's start); its step is refused before it changes them."""
    from mmengine.runner import Runner

    from cd.integrations.mmengine import ColinearityDecayHook

    record = RecordWeights()
    runner = Runner(model=Classifier(), work_dir=str(tmp_path), log_level="ERROR",
                    train_dataloader=dict(dataset=RandomImages(6), batch_size=2, num_workers=0,
                                          sampler=dict(type="DefaultSampler", shuffle=False),
                                          collate_fn=dict(type="default_collate")),
                    train_cfg=dict(by_epoch=False, max_iters=3),
                    optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
                    default_hooks=dict(checkpoint=None, logger=None),
                    custom_hooks=[ColinearityDecayHook(lam=LAM), LateWrapper(), record])
    with pytest.raises(RuntimeError, match=r"^ColinearityDecayHook: a SGD that is not runner.optim_wrapper's "
                                           r"optimizer at the iteration's start steps blocks\.0\.attn\.qkv\.weight "):
        runner.train()
    assert runner.iter == 1 and len(record.after) == 1
    assert all(torch.equal(p, record.after[0][n]) for n, p in runner.model.named_parameters())  # not stepped
    hook = hook_of(runner, "ColinearityDecayHook")
    assert hook.decay.num_updates == 1
    hook.after_train(runner)  # MMEngine calls none after a raise: the run's hooks come off the optimizers
    torch.optim.SGD(runner.model.parameters(), lr=0.1).step()  # another optimizer's step is its own again


@pytest.mark.parametrize("module, decayed, shape", [(None, BLOCKS, None), ("backbone", BLOCKS, None),
                                                    ("backbone.blocks.1", ["blocks.1"], (1, 17, DIM))])
def test_cd_through_mmengines_separate_ddp_wrapper_decays_the_part_named(tmp_path, module, decayed, shape):
    """MMSeparateDistributedDataParallel (MMEngine's wrapper for GANs and the like) wraps each child of the model
    in its own MMDistributedDataParallel, so a dotted name that reaches inside a child (module='backbone.blocks.1')
    met the child's wrapper and was refused as naming no submodule. Through it, in a gloo group of one process,
    the hook decays the blocks named and nothing else: one train_step of SGD is W2 - lr * lam * W2 W1n W1n^T
    (eq. 12, ref_block_update) from the weights of before it, minus lr * grad, and the blocks not named and the
    head take the SGD step alone."""
    import torch.distributed as dist
    from types import SimpleNamespace

    from mmengine.model import MMSeparateDistributedDataParallel

    from cd.integrations.mmengine import ColinearityDecayHook
    from cd_models import ref_block_update

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        net = Classifier(width=DIM)
        net.backbone.reset_classifier(0)  # the head classifies the pooled features
        model = MMSeparateDistributedDataParallel(net)
        assert type(model.module.backbone).__name__ == "MMDistributedDataParallel"  # the child's own wrapper
        lr = 0.1
        sgd = torch.optim.SGD(model.parameters(), lr=lr)
        grads = {}  # each gradient as the step finds it: this pre-hook, registered before CD's, runs first
        sgd.register_step_pre_hook(lambda *_: grads.update({p: p.grad.clone() for p in net.parameters()}))
        wrapper = OptimWrapper(sgd)
        runner = SimpleNamespace(model=model, optim_wrapper=wrapper, iter=0)
        hook = ColinearityDecayHook(lam=LAM, module=module, input_shape=shape)  # a block's: 16 patches + cls
        hook.before_train(runner)
        # the parameters by their names in the unwrapped model (each child's wrapper holds it as `.module`)
        params = {n.replace(".module.", "."): p for n, p in net.named_parameters()}
        names = {id(p): n for n, p in params.items()}
        assert {names[id(pair.downstream)].split(".")[2] for pair in hook.decay.pairs} == {b[-1] for b in decayed}
        before = {n: p.detach().clone() for n, p in params.items()}
        hook.before_train_iter(runner, 0)
        data = RandomImages(2)
        model.train_step(dict(inputs=torch.stack([data[i]["inputs"] for i in range(2)]),
                              labels=data.y[:2]), wrapper)
        hook.after_train_iter(runner, 0)
        hook.after_train(runner)
        assert hook.decay.num_updates == 1
        want = {n: w.double() for n, w in before.items()}
        for block in decayed:
            cd = {}
            ref_block_update({n[len("backbone."):]: w for n, w in before.items() if n.startswith("backbone.")},
                             block, lr * LAM, cd)
            want.update({f"backbone.{n}": w for n, w in cd.items()})
        for name, p in params.items():
            torch.testing.assert_close(p.detach(), want[name] - lr * grads[p], rtol=0, atol=1e-12, msg=name)
    finally:
        dist.destroy_process_group()


def test_a_step_amp_optim_wrapper_skips_applies_no_cd(tmp_path):
    runner = run(config(tmp_path, iters=3, amp=True, model=dict(poison=1)))
    after = hook_of(runner, "RecordWeights").after
    assert all(torch.equal(after[0][n], after[1][n]) for n in after[0])
    reference(Classifier(), runner, 3, 1, vit_pairs(BLOCKS, DIM), skipped=(1,),
              variants=("on_skipped_step", "after_step"))
    assert hook_of(runner, "ColinearityDecayHook").decay.num_updates == 2


def test_resume_from_an_mmengine_checkpoint_continues_exactly(tmp_path, monkeypatch):
    full = run(config(tmp_path / "full", iters=4))
    checkpoint = tmp_path / "full" / "iter_2.pth"
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["colinearity_decay"]
    assert saved["num_updates"] == 2 and json.loads(json.dumps(saved)) == saved  # plain values only
    # MMEngine 0.10's resume calls torch.load without weights_only, and its own message hub (numpy arrays)
    # fails torch >= 2.6's weights_only default, with or without CD: a trusted checkpoint needs this
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    resumed = run(config(tmp_path / "resumed", iters=4, model=dict(seed=5), resume=str(checkpoint)))
    got, want = hook_of(resumed, "RecordWeights").after, hook_of(full, "RecordWeights").after[2:]
    assert len(got) == 2
    for g, w in zip(got, want):
        assert all(torch.allclose(g[n], w[n], rtol=0, atol=TOL) for n in w)
    assert hook_of(resumed, "ColinearityDecayHook").decay.num_updates == 4


def test_fine_tuning_from_a_checkpoint_with_load_from_is_a_new_run(tmp_path, monkeypatch):
    run(config(tmp_path / "pretrain", iters=2))
    cfg = config(tmp_path / "finetune", iters=2, lam=2 * LAM)
    cfg.update(load_from=str(tmp_path / "pretrain" / "iter_2.pth"), resume=False)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "resuming with a different CD config"
        warnings.filterwarnings("ignore", module="mmengine")
        warnings.filterwarnings("ignore", message=".*weights_only.*")
        finetuned = run(cfg)
    assert hook_of(finetuned, "ColinearityDecayHook").decay.num_updates == 2  # counted from 0, not 2 + 2


@pytest.mark.slow
def test_mmdetection_swin_backbone_from_an_mmdet_config_matches_the_reference(tmp_path):
    pytest.importorskip("mmdet")
    from cd.families import import_mmdet_swin

    import_mmdet_swin()  # MMDetection's own Swin, registered in mmdet's MODELS
    backbone = dict(type="mmdet.SwinTransformer", pretrain_img_size=32, embed_dims=DIM, depths=(2, 2),
                    num_heads=(2, 4), window_size=4, patch_size=2, strides=(2, 2), out_indices=(1,))
    cfg = config(tmp_path, iters=2, model=dict(backbone=backbone, width=2 * DIM))
    cfg["default_scope"] = "mmdet"
    runner = run(cfg)
    decay = hook_of(runner, "ColinearityDecayHook").decay
    assert len(decay.pairs) == 17 and decay.pairs[8].name == "stages.0.downsample.reduction.weight"
    pairs = []
    for s, width in ((0, DIM), (1, 2 * DIM)):
        for k in range(2):
            b = f"stages.{s}.blocks.{k}"
            pairs += [RefPair(f"{b}.attn.w_msa.qkv.weight", f"{b}.norm1.weight", True),
                      RefPair(f"{b}.attn.w_msa.proj.weight", f"{b}.attn.w_msa.qkv.weight", False,
                              (2 * width, 3 * width)),
                      RefPair(f"{b}.ffn.layers.0.0.weight", f"{b}.norm2.weight", True),
                      RefPair(f"{b}.ffn.layers.1.weight", f"{b}.ffn.layers.0.0.weight", False)]
    pairs.append(RefPair("stages.0.downsample.reduction.weight", "stages.0.downsample.norm.weight", True))
    reference(Classifier(backbone, 2 * DIM), runner, 2, 1, pairs,
              variants=("before_backward", "after_step", "first_group_lr"))


@MODELS.register_module(force=True)
class TwoTowers(Classifier):
    """Two ViTs side by side (`backbone` and `neck`), for a CD hook on each part."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.neck = tiny_vit(seed + 1).double()

    def forward(self, inputs, labels=None, mode="tensor"):
        logits = self.backbone(inputs) + self.neck(inputs)
        return {"loss": F.cross_entropy(logits, labels)} if mode == "loss" else logits


def test_hooks_on_two_parts_keep_their_own_state_across_a_resume(tmp_path, monkeypatch):
    def two_hooks(cfg):
        cfg["custom_hooks"] = [dict(type="ColinearityDecayHook", module="backbone", lam=LAM),
                               dict(type="ColinearityDecayHook", module="neck", lam=2 * LAM)]
        return cfg

    run(two_hooks(config(tmp_path / "full", iters=2, model=dict(type="TwoTowers"))))
    checkpoint = tmp_path / "full" / "iter_2.pth"
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert saved["colinearity_decay:backbone"]["config"]["lam"] == LAM
    assert saved["colinearity_decay:neck"]["config"]["lam"] == 2 * LAM
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "resuming with a different CD config"
        warnings.filterwarnings("ignore", module="mmengine")
        warnings.filterwarnings("ignore", message=".*weights_only.*")
        resumed = run(two_hooks(config(tmp_path / "resumed", iters=4, model=dict(type="TwoTowers"),
                                       resume=str(checkpoint))))
    hooks = [h for h in resumed.hooks if type(h).__name__ == "ColinearityDecayHook"]
    assert [(h.module, h.decay.lam, h.decay.num_updates) for h in hooks] == [("backbone", LAM, 4), ("neck", 2 * LAM, 4)]


def test_input_shape_is_checked_when_the_hook_is_made_and_used_when_given(tmp_path):
    from cd.integrations.mmengine import ColinearityDecayHook
    # an empty shape too: all() over nothing is True, and the pair check would fail inside runner.train()
    for bad in [("a", "b"), (1, 3, 0, 32), "1,3,32,32", (1.0, 3, 32, 32), (True, 3, 32, 32), (), []]:
        with pytest.raises(ValueError, match="input_shape must be a sequence of positive ints"):
            ColinearityDecayHook(input_shape=bad)
    with pytest.raises(TypeError, match="module must be"):
        ColinearityDecayHook(module=3)
    # an input_shape that no check would run on (no check; an example given beside it) is refused, not ignored
    with pytest.raises(ValueError, match="input_shape serves the pair check only, and verify=False skips it"):
        ColinearityDecayHook(input_shape=(1, 3, 32, 32), verify=False)
    with pytest.raises(ValueError, match="input_shape and example_input both give the pair check's input"):
        ColinearityDecayHook(input_shape=(1, 3, 32, 32), example_input=torch.zeros(1, 3, 32, 32))
    # the tiny ViT states its own 32 px input; a given 48 px batch is what the pair check runs (and fails on)
    from cd.verify import UnsupportedModelError
    with pytest.raises(UnsupportedModelError, match=r"Input height \(48\) doesn't match model \(32\)"):
        run(config(tmp_path, iters=1, input_shape=(1, 3, 48, 48)))


def test_an_input_shape_that_is_no_sequence_is_refused_naming_it_not_taken_or_failed_on_while_iterating():
    """One number (input_shape=224, a side length), an unordered set or a dict is not one batch's shape: each is
    refused with the hook's error, not "'int' object is not iterable" (a number), nor taken in an arbitrary order
    (a set) or as its keys (a dict)."""
    from cd.integrations.mmengine import ColinearityDecayHook
    for bad in [224, 3.5, {1, 3, 32}, {1: 3, 3: 32}, (n for n in (1, 3, 32, 32))]:
        with pytest.raises(ValueError, match=r"input_shape must be a sequence of positive ints .*got "):
            ColinearityDecayHook(input_shape=bad)
    assert ColinearityDecayHook(input_shape=[1, 3, 32, 32]).input_shape == (1, 3, 32, 32)  # a config's list
    assert ColinearityDecayHook(input_shape=torch.Size([1, 3, 32, 32])).input_shape == (1, 3, 32, 32)


@pytest.mark.parametrize("hook, shape", [(dict(module=""), "(1, 3, 224, 224)"),
                                         (dict(input_shape=(1, 3, 48, 48)), "(1, 3, 48, 48)")])
def test_a_pair_check_on_the_wrong_input_shape_names_the_hooks_input_shape(tmp_path, hook, shape):
    """The whole Classifier states no input size, so the hook checks the pairs on its default image batch, which
    the 32 px ViT inside refuses: the error names that batch and the hook's own argument for the fix (a config
    file gives input_shape, not the example_input tensor of ColinearityDecay)."""
    from cd.verify import UnsupportedModelError
    with pytest.raises(UnsupportedModelError) as refusal:
        run(config(tmp_path, iters=1, **hook))
    message = str(refusal.value)
    assert f"input batch of shape {shape}" in message and "give the hook input_shape=" in message
    assert "doesn't match model (32)" in message and "\n" not in message


def test_a_pair_check_on_the_models_own_wrong_input_size_names_that_size_and_the_hooks_input_shape():
    """A part whose own input size is not the one its forward takes (here a stated 48 px for the 32 px ViT): the
    error names that batch and the hook's input_shape= (a config file's fix), not ColinearityDecay's
    example_input= tensor; the input_shape it names then runs."""
    from types import SimpleNamespace

    from cd.integrations.mmengine import ColinearityDecayHook
    from cd.verify import UnsupportedModelError

    net = tiny_vit()
    net.example_input = lambda: torch.empty(1, 3, 48, 48)  # the model's own input size, wrong
    runner = SimpleNamespace(model=net, optim_wrapper=OptimWrapper(torch.optim.SGD(net.parameters(), lr=0.1)), iter=0)
    with pytest.raises(UnsupportedModelError) as refusal:
        ColinearityDecayHook(lam=0.5).before_train(runner)
    message = str(refusal.value)
    assert "input batch of shape (1, 3, 48, 48) (the model's own input size)" in message
    assert "give the hook input_shape=" in message and "example_input" not in message
    hook = ColinearityDecayHook(lam=0.5, input_shape=(1, 3, 32, 32))
    hook.before_train(runner)
    assert len(hook.decay.pairs) == 4 * VIT_DEPTH  # qkv, fc1, proj, fc2 of each block
    hook.after_train(runner)


def test_verify_false_asks_the_part_nothing_about_its_input():
    """verify=False trusts the structure alone (the way out where the check cannot run): the hook then builds
    no input batch either, so a part whose own example_input() fails still gets CD."""
    from types import SimpleNamespace

    from cd.integrations.mmengine import ColinearityDecayHook

    def no_example():
        raise RuntimeError("this model cannot make an example input")

    net = tiny_vit()
    net.example_input = no_example
    runner = SimpleNamespace(model=net, optim_wrapper=OptimWrapper(torch.optim.SGD(net.parameters(), lr=0.1)), iter=0)
    hook = ColinearityDecayHook(lam=0.5, verify=False)
    hook.before_train(runner)
    assert len(hook.decay.pairs) == 4 * VIT_DEPTH
    hook.after_train(runner)


def step_with_cd_alone(net, runner, hook):
    """One step of `runner`'s SGD (lr 0.1) on zero gradients, so that only CD (lam 0.5) changes the weights, checked
    against the closed form W2 - lr * lam * W2 W1n W1n^T of the weights before the step (block 0's MLP pair)."""
    from cd_models import ref_w2

    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    fc1, fc2 = (net.get_submodule(f"blocks.0.mlp.{n}").weight.detach().clone() for n in ("fc1", "fc2"))
    runner.optim_wrapper.step()
    hook.after_train_iter(runner, 0)
    assert torch.allclose(net.blocks[0].mlp.fc2.weight, ref_w2(fc2, fc1, 0.1 * 0.5), rtol=0, atol=1e-12)


def test_a_train_again_after_one_that_raised_gets_one_cd_update_per_step():
    """MMEngine calls no after_train when training raises: the hook's next before_train (train() again) takes
    its bindings off the optimizer first, so the new run is not refused as a second CD update and its steps get
    the new decay's update only, once: W2 - lr * lam * W2 W1n W1n^T from the weights of before the step."""
    from types import SimpleNamespace

    from cd.integrations.mmengine import ColinearityDecayHook

    net = tiny_vit().double()
    runner = SimpleNamespace(model=net, optim_wrapper=OptimWrapper(torch.optim.SGD(net.parameters(), lr=0.1)), iter=0)
    hook = ColinearityDecayHook(lam=0.5, module="")
    hook.before_train(runner)
    hook.before_train_iter(runner, 0)  # the run raises here: no after_train_iter, no after_train
    failed = hook.decay
    hook.before_train(runner)
    hook.before_train_iter(runner, 0)
    step_with_cd_alone(net, runner, hook)
    assert (failed.num_updates, hook.decay.num_updates) == (0, 1)
    hook.after_train(runner)


def test_a_second_runner_after_one_that_raised_trains_the_same_model_with_its_own_cd_only():
    """A sweep or a notebook: a runner's train() raises (MMEngine calls no after_train, so its hook keeps its
    bindings and its refusal of other optimizers' steps), then a new runner with a new hook and optimizer trains
    the same model. The stale hook refused every step of the new optimizer as one "that is not
    runner.optim_wrapper's optimizer"; the new hook's before_train takes the other runner's hooks off, so the step
    gets the new decay's update once: W2 - lr * lam * W2 W1n W1n^T from the weights of before the step."""
    from types import SimpleNamespace

    from cd.integrations.mmengine import ColinearityDecayHook

    net = tiny_vit().double()
    first = SimpleNamespace(model=net, optim_wrapper=OptimWrapper(torch.optim.SGD(net.parameters(), lr=0.1)), iter=0)
    failed = ColinearityDecayHook(lam=0.5, module="")
    failed.before_train(first)
    failed.before_train_iter(first, 0)  # the run raises here: no after_train_iter, no after_train
    second = SimpleNamespace(model=net, optim_wrapper=OptimWrapper(torch.optim.SGD(net.parameters(), lr=0.1)), iter=0)
    hook = ColinearityDecayHook(lam=0.5, module="")
    hook.before_train(second)
    hook.before_train_iter(second, 0)
    step_with_cd_alone(net, second, hook)
    assert (failed.decay.num_updates, hook.decay.num_updates) == (0, 1)
    hook.after_train(second)


def test_cd_runs_in_every_step_of_the_run_only():
    """The hook's events, called as the Runner calls them: a step inside an iteration gets CD, a step of the
    same optimizer after the iteration (another hook's) too (an update as any other), and after_train leaves no
    CD on the optimizer."""
    from types import SimpleNamespace

    from cd import ColinearityDecay
    from cd.integrations.mmengine import ColinearityDecayHook

    net = tiny_vit()
    wrapper = OptimWrapper(torch.optim.SGD(net.parameters(), lr=0.1))
    runner = SimpleNamespace(model=net, optim_wrapper=wrapper, iter=0)
    hook = ColinearityDecayHook(lam=0.5, module="")
    hook.before_train(runner)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    for inside in (True, False):
        if inside:
            hook.before_train_iter(runner, 0)
        wrapper.update_params(F.cross_entropy(net(x), y))
        if inside:
            hook.after_train_iter(runner, 0)
        assert hook.decay.num_updates == 1 + (not inside)
    hook.after_train(runner)  # the optimizer is the user's again: an attach of their own is no second update
    ColinearityDecay(net, lam=0.5).attach(wrapper.optimizer).remove()


def test_budget_rule_lowers_the_merged_weight_decay_once_by_the_hooks_lam():
    """App. A.2's budget, on plain config dicts against hand-computed values: weight decay minus the hook's lam
    (the documented default 0.005 where the hook gives none), zero lam and zero weight decay are budgets (0 is
    allowed, only a negative number is refused), and a config whose cd_budget records the rule as applied (a
    dumped config loaded again) is not lowered a second time."""
    from cd.integrations.mmengine import apply_weight_decay_budget

    def config(weight_decay, **hook):
        return {"cd_budget": True, "custom_hooks": [{"type": "ColinearityDecayHook", **hook}],
                "optim_wrapper": {"optimizer": {"type": "AdamW", "weight_decay": weight_decay}}}

    for weight_decay, hook, expected in [(0.05, {"lam": 0.01}, 0.04), (0.05, {}, 0.045), (0.05, {"lam": 0.0}, 0.05),
                                         (0.0, {"lam": 0.0}, 0.0), (0.005, {}, 0.0)]:
        cfg = config(weight_decay, **hook)
        apply_weight_decay_budget(cfg)
        assert cfg["optim_wrapper"]["optimizer"]["weight_decay"] == pytest.approx(expected, abs=1e-15), (weight_decay,
                                                                                                         hook)
        assert cfg["cd_budget"].startswith("applied: ")
        apply_weight_decay_budget(cfg)  # the dump of a run, loaded again
        assert cfg["optim_wrapper"]["optimizer"]["weight_decay"] == pytest.approx(expected, abs=1e-15)
    for weight_decay, lam in [(-0.01, 0.0), (0.05, -0.001), (0.001, 0.005)]:
        with pytest.raises(ValueError, match="cd_budget=True"):
            apply_weight_decay_budget(config(weight_decay, lam=lam))
    # the config and its dump read the decimal budget, not 0.05 - 0.005 in binary (0.045000000000000005)
    documented = config(0.05)
    apply_weight_decay_budget(documented)
    assert documented["optim_wrapper"]["optimizer"]["weight_decay"] == 0.045
    assert documented["cd_budget"] == "applied: 0.05 - lam 0.005 = 0.045"
    untouched = config(0.05, lam=0.01)
    untouched["cd_budget"] = False
    apply_weight_decay_budget(untouched)
    assert untouched["optim_wrapper"]["optimizer"]["weight_decay"] == 0.05


def test_budget_rule_finds_the_hook_in_each_form_mmengine_builds_it_from():
    """custom_hooks may give the hook's type as its registry name, that name with a registry scope, or the class,
    and MMEngine builds the hook from each (the reference: HOOKS.build); the rule matched the unscoped name alone,
    so it refused a config whose one hook was given as the class ("0 ColinearityDecayHooks"), and where a second
    hook of another lam was given so, lowered the weight decay by the first one's lam instead of refusing."""
    from mmengine.config import Config

    from cd.integrations.mmengine import ColinearityDecayHook, apply_weight_decay_budget

    def config(*hooks):
        return Config({"cd_budget": True, "custom_hooks": [dict(type=kind, lam=lam) for kind, lam in hooks],
                       "optim_wrapper": {"optimizer": {"type": "AdamW", "weight_decay": 0.05}}})

    forms = ["ColinearityDecayHook", "mmengine.ColinearityDecayHook", ColinearityDecayHook]
    for form in forms:
        assert type(HOOKS.build(dict(type=form, lam=0.01))) is ColinearityDecayHook  # the reference
        cfg = config((form, 0.01))
        apply_weight_decay_budget(cfg)
        assert cfg.optim_wrapper.optimizer.weight_decay == pytest.approx(0.04, abs=1e-15), form
    for first in forms:
        for second in forms:
            with pytest.raises(ValueError, match=r"with 2 ColinearityDecayHooks of lam \[0\.01, 0\.02\]"):
                apply_weight_decay_budget(config((first, 0.01), (second, 0.02)))
    plain = config(("RecordWeights", 0.01))  # another hook is not CD's
    with pytest.raises(ValueError, match="with 0 ColinearityDecayHooks"):
        apply_weight_decay_budget(plain)


def test_a_dumped_budget_loaded_again_follows_an_override_of_the_lam_or_of_the_weight_decay(tmp_path):
    """The dump of a run (what MMEngine's Runner writes to work_dir) loaded again with overrides, as
    engine.detection.load_config merges them: the record "applied: ..." returned early, so a new lam kept the old
    budget (lam 0.01 beside weight decay 0.045, not 0.04). Hand-computed: the recorded base 0.05 minus the lam
    now, or an overridden weight decay (the new base, as in the files) minus it; a record this function did not
    write is refused."""
    from mmengine.config import Config

    from cd.integrations.mmengine import apply_weight_decay_budget

    first = Config({"cd_budget": True, "custom_hooks": [{"type": "ColinearityDecayHook", "lam": 0.005}],
                    "optim_wrapper": {"optimizer": {"type": "AdamW", "lr": 1e-4, "weight_decay": 0.05}}})
    apply_weight_decay_budget(first)
    first.dump(tmp_path / "dump.py")
    for overrides, weight_decay, record in [
            ({}, 0.045, "0.05 - lam 0.005 = 0.045"),
            ({"custom_hooks.0.lam": 0.01}, 0.04, "0.05 - lam 0.01 = 0.04"),
            ({"optim_wrapper.optimizer.weight_decay": 0.1}, 0.095, "0.1 - lam 0.005 = 0.095"),
            ({"custom_hooks.0.lam": 0.01, "optim_wrapper.optimizer.weight_decay": 0.1}, 0.09, "0.1 - lam 0.01 = 0.09")]:
        cfg = Config.fromfile(tmp_path / "dump.py")
        cfg.merge_from_dict(overrides)
        apply_weight_decay_budget(cfg)
        assert cfg.optim_wrapper.optimizer.weight_decay == weight_decay, overrides
        assert cfg.cd_budget == "applied: " + record
        apply_weight_decay_budget(cfg)  # that run's dump, loaded again: not lowered twice
        assert cfg.optim_wrapper.optimizer.weight_decay == weight_decay, overrides
    for record in ("applied: by hand", "applied: 0.05 - lam 0.005 = x"):
        cfg = Config.fromfile(tmp_path / "dump.py")
        cfg.cd_budget = record
        with pytest.raises(ValueError, match="not a record that apply_weight_decay_budget writes"):
            apply_weight_decay_budget(cfg)


@MODELS.register_module(force=True)
class TwoOptimizers(Classifier):
    """A train_step that steps each optimizer of an OptimWrapperDict (`a`, then `b`) after one backward."""

    def train_step(self, data, optim_wrapper):
        losses = self._run_forward(self.data_preprocessor(data, True), mode="loss")
        loss, log_vars = self.parse_losses(losses)
        optim_wrapper["a"].backward(loss)
        for name in ("a", "b"):
            optim_wrapper[name].step()
        optim_wrapper.zero_grad()
        return log_vars


def _blocks_1(net):
    """Block 1 in optimizer `b`, the rest in `a`: each pair's two matrices in one optimizer."""
    return [n.startswith("backbone.blocks.1.") for n, _ in net.named_parameters()]


def _upstream_apart(net):
    """Each functional pair split: its W1 (qkv, fc1, with the norms) in `a`, its W2 (proj, fc2) in `b`, which
    steps after `a`: b's CD must read W1 as it was before `a` stepped it."""
    return [not n.endswith(("qkv.weight", "fc1.weight", "norm1.weight", "norm2.weight"))
            for n, _ in net.named_parameters()]


@pytest.mark.parametrize("in_b", [_blocks_1, _upstream_apart])
def test_every_optimizer_of_an_optim_wrapper_dict_gets_cd(tmp_path, in_b):
    """The parameters split over two optimizers (`in_b`), of different lrs: each pair gets CD with the lr of its
    W2's optimizer and from the weights of before the iteration's steps, as one AdamW with a group per optimizer
    in the reference loop (AdamW acts per parameter), counted once per iteration; a hook that bound only the
    first wrapper leaves the pairs of `b` without CD."""
    from mmengine.optim import OptimWrapperDict
    from mmengine.runner import Runner

    import cd.integrations.mmengine  # noqa: F401  (registers the hook, as custom_imports does)

    def split(net):
        flags = in_b(net)
        params = list(net.parameters())
        return [p for p, f in zip(params, flags) if not f], [p for p, f in zip(params, flags) if f]

    model = MODELS.build(dict(type="TwoOptimizers"))
    initial = copy.deepcopy(model)
    a, b = split(model)
    wrappers = OptimWrapperDict(a=OptimWrapper(torch.optim.AdamW(a, lr=2e-2, weight_decay=0.1)),
                                b=OptimWrapper(torch.optim.AdamW(b, lr=5e-3, weight_decay=0.1)))
    cfg = config(tmp_path, iters=3)
    for key in ("custom_imports", "model", "optim_wrapper", "param_scheduler", "resume", "load_from"):
        cfg.pop(key)
    runner = Runner(model=model, optim_wrapper=wrappers, **cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.train()
    assert not [w for w in caught if "not in the optimizer" in str(w.message)]  # each is in one of them
    micro = [[batch] for batch in model.batches]
    after = hook_of(runner, "RecordWeights").after

    def run_ref(variant):
        net = copy.deepcopy(initial)
        ref_a, ref_b = split(net)
        opt = torch.optim.AdamW([{"params": ref_a, "lr": 2e-2}, {"params": ref_b, "lr": 5e-3}], weight_decay=0.1)
        pairs = [RefPair("backbone." + p.w2, "backbone." + p.w1, p.diag, p.rows) for p in vit_pairs(BLOCKS, DIM)]
        return reference_run(net, micro, lambda m, x: F.cross_entropy(m(x[0]), x[1]), opt, None, pairs, LAM,
                             variant=variant)

    assert_matches_reference(after, run_ref, TOL, variants=("after_step", "first_group_lr"))
    assert hook_of(runner, "ColinearityDecayHook").decay.metrics()["cd/updates"] == 3  # one per iteration


@pytest.mark.parametrize("module", ["neck", "backbone.blocks.7", "backbone.blocks.0.attn.qkv.weight"])
def test_a_module_that_names_no_submodule_is_refused_naming_the_argument(tmp_path, module):
    """It failed with torch's AttributeError from get_submodule, which named neither `module=` nor a fix."""
    with pytest.raises(ValueError, match=rf"module={module!r} names no submodule of the Classifier.*'backbone'"):
        run(config(tmp_path, iters=1, module=module))


def test_each_part_has_its_own_checkpoint_key_the_whole_model_too():
    """module=None (the backbone where there is one) and module="" (the whole model) are different parts: a
    resume must not hand one part's counter to the other."""
    from cd.integrations.mmengine import ColinearityDecayHook

    keys = [ColinearityDecayHook(module=m).checkpoint_key for m in (None, "", "neck")]
    assert keys == ["colinearity_decay", "colinearity_decay:", "colinearity_decay:neck"]


def test_budget_keeps_twelve_significant_digits_of_the_weight_decay():
    """0.0123456789 - 0.001 by hand: the rounding only drops float noise (0.045, not 0.045000000000000005),
    never digits that the config gives."""
    from cd.integrations.mmengine import apply_weight_decay_budget

    cfg = {"cd_budget": True, "custom_hooks": [{"type": "ColinearityDecayHook", "lam": 0.001}],
           "optim_wrapper": {"optimizer": {"type": "AdamW", "weight_decay": 0.0123456789}}}
    apply_weight_decay_budget(cfg)
    assert cfg["optim_wrapper"]["optimizer"]["weight_decay"] == 0.0113456789


def test_a_part_that_cannot_say_its_input_size_is_checked_on_a_224px_image_batch():
    """The documented default for the pair check, (1, 3, 224, 224), in the part's dtype (the checks' forwards
    record what they were given)."""
    from types import SimpleNamespace

    from timm.models.vision_transformer import Block

    from cd.integrations.mmengine import ColinearityDecayHook

    class NoInputSize(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.block, self.seen = torch.nn.Conv2d(3, DIM, 8, 8), Block(DIM, 2), []

        def forward(self, x):
            self.seen.append((tuple(x.shape), x.dtype))
            return self.block(self.embed(x).flatten(2).transpose(1, 2))

    net = NoInputSize().double()
    runner = SimpleNamespace(model=net, optim_wrapper=OptimWrapper(torch.optim.SGD(net.parameters(), lr=0.1)), iter=0)
    hook = ColinearityDecayHook(lam=LAM, module="")
    hook.before_train(runner)
    hook.after_train(runner)
    # one forward on meta, and real ones (cd/values.py): one for the V rows of the fused qkv, one per bit of the
    # widest pair's channel index (fc1's 4 * DIM = 128 outputs: 7 bits); all of that batch
    assert net.seen == [((1, 3, 224, 224), torch.float64)] * (1 + 1 + 7) and len(hook.decay.pairs) == 4


def test_a_budget_that_is_not_true_or_false_is_refused_and_the_weight_decay_left_alone():
    """cd_budget "yes" or 1 (not True) is refused naming the two values it takes; the weight decay is not lowered."""
    from cd.integrations.mmengine import apply_weight_decay_budget

    for budget in ("yes", 1):
        cfg = {"cd_budget": budget, "custom_hooks": [{"type": "ColinearityDecayHook", "lam": 0.005}],
               "optim_wrapper": {"optimizer": {"weight_decay": 0.05}}}
        with pytest.raises(ValueError, match=r"^cd_budget=.*: give True .* or False$"):
            apply_weight_decay_budget(cfg)
        assert cfg["optim_wrapper"]["optimizer"]["weight_decay"] == 0.05


def test_budget_without_a_cd_hook_is_refused_with_the_fix():
    """cd_budget=True and no ColinearityDecayHook: no lam to lower the weight decay by (a clear error, not a
    KeyError from inside)."""
    from cd.integrations.mmengine import apply_weight_decay_budget

    cfg = {"cd_budget": True, "custom_hooks": [], "optim_wrapper": {"optimizer": {"weight_decay": 0.05}}}
    with pytest.raises(ValueError, match="cd_budget=True with 0 ColinearityDecayHooks.*set cd_budget=False"):
        apply_weight_decay_budget(cfg)


def test_a_legacy_optimizer_that_amp_optim_wrapper_hands_grad_scaler_is_refused_before_the_first_update(tmp_path):
    """AmpOptimWrapper's GradScaler passes `grad_scaler=` to an optimizer of the legacy custom AMP contract, which
    then decides itself whether to skip: CD cannot follow that verdict, so the first update raises rather than
    decaying on steps the optimizer may skip."""
    from mmengine.registry import OPTIMIZERS

    @OPTIMIZERS.register_module(name="LegacyScalingAdamW", force=True)
    class LegacyScalingAdamW(torch.optim.AdamW):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            return super().step(closure)

    cfg = config(tmp_path, iters=1, amp=True)
    cfg["optim_wrapper"]["optimizer"]["type"] = "LegacyScalingAdamW"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation of that contract
        with pytest.raises(RuntimeError, match="`grad_scaler` in step"):
            run(cfg)


@MODELS.register_module(force=True)
class WithACopy(Classifier):
    """The Classifier with a frozen copy of its backbone (a teacher, an EMA) that its forward never runs."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.teacher = copy.deepcopy(self.backbone).requires_grad_(False)


def test_a_copy_that_the_forward_does_not_run_is_refused_naming_module_and_the_parts(tmp_path):
    """module="" decays the whole model: a frozen copy beside the backbone fails the pair check as "not used in the
    forward pass", which named no fix; the refusal names the hook's `module=` and the model's children."""
    from cd.verify import UnsupportedModelError
    with pytest.raises(UnsupportedModelError, match=r"teacher\.blocks\.0.*not used in the forward pass.*"
                       r"module=\.\.\.\).*'backbone', 'head', 'teacher'\]"):
        run(config(tmp_path, iters=1, model=dict(type="WithACopy"), module="", input_shape=(1, 3, 32, 32)))


def test_a_resume_whose_checkpoint_holds_no_state_under_the_hooks_key_warns_naming_the_keys(tmp_path, monkeypatch):
    """The hook reads its state under its own checkpoint_key, which holds module=: a run resumed with another
    module= (or from a run without CD) restored nothing and counted from 0 without a word, where cd/README.md says
    a resume with another CD config warns."""
    run(config(tmp_path / "whole", iters=2))  # module=None: the backbone, under "colinearity_decay"
    cfg = config(tmp_path / "plain", iters=2)
    cfg["custom_hooks"] = [dict(type="RecordWeights")]
    run(cfg)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.warns(UserWarning, match=r"ColinearityDecayHook: resuming at step 2 with no CD state under "
                                         r"'colinearity_decay:backbone' in the checkpoint; it holds CD state under "
                                         r"'colinearity_decay' \(no module=\) \(saved by a ColinearityDecayHook with "
                                         r"another module=.*starts from 0"):
        resumed = run(config(tmp_path / "part", iters=4, module="backbone",
                             resume=str(tmp_path / "whole" / "iter_2.pth")))
    assert hook_of(resumed, "ColinearityDecayHook").decay.num_updates == 2  # as the warning says: not restored
    # the module= named for a key is the one that continues its counter: the default key is no module=, which
    # "give that module=" said of it too; a part's key names its module=, which restores it
    with pytest.warns(UserWarning, match=r"no CD state under 'colinearity_decay' in the checkpoint; it holds CD state "
                                         r"under 'colinearity_decay:backbone' \(module='backbone'\) \(saved"):
        run(config(tmp_path / "whole_again", iters=6, resume=str(tmp_path / "part" / "iter_4.pth")))
    continued = run(config(tmp_path / "part_again", iters=6, module="backbone",
                           resume=str(tmp_path / "part" / "iter_4.pth")))
    assert hook_of(continued, "ColinearityDecayHook").decay.num_updates == 4  # the 2 restored, then 2 more
    with pytest.warns(UserWarning, match=r"resuming at step 2 with no CD state under 'colinearity_decay' in the "
                                         r"checkpoint; it holds no CD state \(saved by a run without CD\)"):
        run(config(tmp_path / "late", iters=4, resume=str(tmp_path / "plain" / "iter_2.pth")))


def test_the_readme_examples_model_keeps_its_backbones_weights_through_runner_train(tmp_path):
    """Runner.train() calls the model's init_weights(), and MMEngine's BaseModule one calls the children's: timm's
    VisionTransformer.init_weights() redrew the backbone of cd/README.md's complete MMEngine example (pretrained
    weights lost without a word: 21 of its 56 tensors changed at lr 0). The example's Classifier, as written there,
    keeps every backbone tensor through training at lr 0 (and so no weight decay or CD update)."""
    import os
    import re

    from mmengine.runner import Runner

    pytest.importorskip("timm")
    with open(os.path.join(os.path.dirname(__file__), "..", "cd", "README.md")) as f:
        section = f.read().split("### In transformers, Lightning and MMEngine", 1)[1].split("\n### ", 1)[0]
    (code,) = [b for b in re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
               if "cd.integrations.mmengine" in b and ".train()" in b]
    scope: dict = {}
    exec(compile(code.split("\ndata = ", 1)[0], "cd/README.md", "exec"), scope)  # its imports and the Classifier
    torch.manual_seed(0)
    model = scope["Classifier"]()
    before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    data = [{"inputs": torch.randn(3, 32, 32), "labels": torch.tensor(i % 10)} for i in range(16)]
    runner = Runner(model=model, work_dir=str(tmp_path),
                    train_dataloader=dict(dataset=data, batch_size=8, sampler=dict(type="DefaultSampler"),
                                          collate_fn=dict(type="default_collate")),
                    train_cfg=dict(by_epoch=False, max_iters=2),
                    optim_wrapper=dict(optimizer=dict(type="AdamW", lr=0.0, weight_decay=0.045)),
                    custom_hooks=[dict(type="ColinearityDecayHook", lam=0.005)])
    runner.train()
    assert runner.iter == 2  # trained (at lr 0)
    after = model.backbone.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


def test_mmengines_deepspeed_strategy_is_refused_at_before_train_naming_deepspeed():
    """FlexibleRunner with MMEngine's DeepSpeedStrategy hands the hook an MMDeepSpeedEngineWrapper (no nn.Module)
    as runner.model and a DeepSpeedOptimWrapper, whose step is the engine's (on flat partitions under ZeRO): the hook
    refused it as "CD needs the model as a torch.nn.Module ... pass the model itself, not its state_dict()", a fix
    that does not apply to a config. One RuntimeError naming DeepSpeed and the runner to use, before CD is built.
    DeepSpeed is not installed: MMEngine's own classes, around a stand-in of the engine named as DeepSpeed's."""
    from types import SimpleNamespace

    from mmengine._strategy.deepspeed import DeepSpeedOptimWrapper, DeepSpeedStrategy, MMDeepSpeedEngineWrapper

    from cd.integrations.mmengine import ColinearityDecayHook

    class DeepSpeedEngine(torch.nn.Module):  # holds the model as `.module`, as DeepSpeed's does
        def __init__(self, module):
            super().__init__()
            self.module = module

    net = tiny_vit()
    wrapper = DeepSpeedOptimWrapper(torch.optim.SGD(net.parameters(), lr=0.1))  # ZeRO stage 0, fp32
    runner = SimpleNamespace(model=MMDeepSpeedEngineWrapper(model=DeepSpeedEngine(net)), optim_wrapper=wrapper,
                             strategy=DeepSpeedStrategy.__new__(DeepSpeedStrategy), iter=0)
    hook = ColinearityDecayHook(lam=LAM, verify=False)
    with pytest.raises(RuntimeError, match=r"^ColinearityDecayHook: CD does not support DeepSpeed \(found "
                                           r"DeepSpeedOptimWrapper, DeepSpeedStrategy\).*FlexibleRunner with "
                                           r"strategy=dict\(type='DDPStrategy'\)"):
        hook.before_train(runner)
    assert hook.decay is None and not hook._bindings and not wrapper.optimizer._optimizer_step_pre_hooks
