"""The TWEO and Noise (UNIQ) baselines in a real MMEngine Runner (CPU, float64), each enabled by configuration alone.

TWEO (`TweoHook`): the weights after every update equal a float64 plain loop (task loss + rescaled TWEO on the
backbone's block outputs, by autograd, written here), with gradient accumulation and a cosine lambda; the wrong
versions (not rescaled, on the whole model including a Transformer block in the neck, lambda indexed by iteration
instead of update, the term not divided by the accumulation) are each told apart; validation captures nothing.
Noise (`WeightNoiseHook`): the weights and biases a training forward sees equal UNIQ's map written naively
(statistics' NormalDist for the CDF and its inverse, UNIQ's clamp to [1e-5, 1 - 1e-5]) on the same generator
draws; validation, the state dict and checkpoints hold the clean weights; the weights after each update equal a
plain loop whose gradient at the noisy values reaches the clean ones unchanged (UNIQ's reference code swaps the
data), not through the map's slope; same seed -> same run, another seed -> another, resume continues exactly; a
layer re-entered inside its own forward is refused with its Parameters left in place. MMDetection's
Swin backbone gets both hooks. The config fragments in configs/detection/method/ build their hooks.
"""
from __future__ import annotations

import copy
import math
import os
import statistics
from statistics import NormalDist

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("mmengine")
import timm  # noqa: E402
from mmengine.config import Config  # noqa: E402
from mmengine.evaluator import BaseMetric  # noqa: E402
from mmengine.hooks import Hook  # noqa: E402
from mmengine.model import BaseModel  # noqa: E402
from mmengine.registry import DATASETS, HOOKS, METRICS, MODELS  # noqa: E402
from timm.models.vision_transformer import Block  # noqa: E402

from cd.noise import noise_seed  # noqa: E402
from mmengine_runs import hook_of, run  # noqa: E402
from cd_integration_refs import RandomImages, assert_matches_reference  # noqa: E402
from cd_models import randomize_norms  # noqa: E402

DIM, TOL, LR, WD = 32, 1e-10, 2e-2, 0.1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@MODELS.register_module(force=True)
class BaselineNet(BaseModel):
    """A float64 MMEngine model: `backbone` (a tiny timm ViT returning its tokens, or a backbone config), a `neck`
    that is a timm Transformer block too (so TWEO on the whole model would differ from TWEO on the backbone), and
    a linear head; it records the micro-batches it trains on."""

    def __init__(self, backbone=None, width: int = DIM, neck: bool = True, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = MODELS.build(backbone) if backbone else timm.create_model(
            "vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=DIM, depth=2, num_heads=2, num_classes=0,
            global_pool="")
        self.neck = Block(DIM, 2) if neck else nn.Identity()
        self.head = nn.Linear(width, 10)
        randomize_norms(self, seed).double()
        self.batches = []

    def init_weights(self):
        """The weights made at construction stay."""

    def forward(self, inputs, labels=None, mode="tensor"):
        out = self.backbone(inputs)
        feats = out[-1].mean(dim=(2, 3)) if isinstance(out, (tuple, list)) else self.neck(out).mean(dim=1)
        logits = self.head(feats)
        if mode != "loss":
            return logits
        self.batches.append((inputs.clone(), labels.clone()))
        return {"loss": F.cross_entropy(logits, labels)}


DATASETS.register_module(name="BaselineData", force=True, module=RandomImages)


@METRICS.register_module(force=True)
class CountMetric(BaseMetric):
    def process(self, data_batch, data_samples):
        self.results.append(len(data_samples))

    def compute_metrics(self, results):
        return {"n": sum(results)}


@HOOKS.register_module(force=True)
class Recorder(Hook):
    """Records the clean weights before each iteration and after it, and the weight each backbone Linear's forward
    sees (pre-hooks placed after the noise hook's), in training and in validation; TWEO's pending terms at
    validation."""

    priority = "LOWEST"

    def __init__(self) -> None:
        self.clean, self.after, self.seen, self.val_seen, self.val_pending = [], [], [], [], []

    def before_train(self, runner):
        for name, m in runner.model.backbone.named_modules():
            if isinstance(m, nn.Linear):
                m.register_forward_pre_hook(lambda mod, args, name=name: (
                    self.seen if mod.training else self.val_seen)[-1].update(
                        {f"{name}.{p}": getattr(mod, p).detach().clone() for p in ("weight", "bias")
                         if getattr(mod, p) is not None}))

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.clean.append({n: p.detach().clone() for n, p in runner.model.named_parameters()})
        self.seen.append({})

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.after.append({n: p.detach().clone() for n, p in runner.model.named_parameters()})

    def before_val_iter(self, runner, batch_idx, data_batch=None):
        self.val_seen.append({})

    def after_val_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        tweo = [h for h in runner.hooks if type(h).__name__ == "TweoHook"]
        self.val_pending.append(bool(tweo) and tweo[0].tweo.pending)


def config(tmp_path, hooks, iters=4, accum=1, model=None, resume=None, val=False):
    """A Runner config as a user writes it: the baselines by `custom_imports` and `custom_hooks` alone."""
    cfg = dict(
        model=dict(type="BaselineNet", **(model or {})), work_dir=str(tmp_path), experiment_name="baselines",
        train_dataloader=dict(dataset=dict(type="BaselineData"), batch_size=2, num_workers=0,
                              sampler=dict(type="InfiniteSampler", shuffle=False),
                              collate_fn=dict(type="default_collate")),
        train_cfg=dict(by_epoch=False, max_iters=iters, **(dict(val_interval=2) if val else {})),
        optim_wrapper=dict(type="OptimWrapper", accumulative_counts=accum,
                           optimizer=dict(type="AdamW", lr=LR, weight_decay=WD)),
        custom_imports=dict(imports=["cd.integrations.mmengine"], allow_failed_imports=False),
        custom_hooks=[*hooks, dict(type="Recorder")],
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=2, by_epoch=False), logger=None),
        resume=resume is not None, load_from=resume, randomness=dict(seed=0), log_level="WARNING")
    if val:
        cfg.update(val_dataloader=dict(dataset=dict(type="BaselineData", n=4), batch_size=2, num_workers=0,
                                       sampler=dict(type="DefaultSampler", shuffle=False),
                                       collate_fn=dict(type="default_collate")),
                   val_cfg=dict(), val_evaluator=dict(type="CountMetric"))
    return cfg


# --- TWEO -------------------------------------------------------------------------------------------------------
TWEO_VARIANTS = ("paper", "not_rescaled", "whole_model", "iteration_step", "unscaled_by_accum")


def tweo_reference(initial, batches, iters, accum, lam, variant, last_losses=None):
    """float64 plain loop: per micro-batch (CE + lam(t) * L_TWEO * detach(CE / L_TWEO)) / accum, L_TWEO the mean
    over the backbone's blocks of mean((|A| / (3 + 1e-6))^4) (App. A.3, Eq. (26)), t the update index, cosine lam
    over the updates.
    `last_losses`, a dict, receives the last micro-batch's task loss, L_TWEO and term."""
    net = copy.deepcopy(initial)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
    outs = []
    blocks = ["backbone.blocks.0", "backbone.blocks.1"] + (["neck"] if variant == "whole_model" else [])
    for name in blocks:
        net.get_submodule(name).register_forward_hook(lambda m, a, o: outs.append(o))
    updates = iters // accum
    snapshots = []
    for t in range(updates):
        opt.zero_grad(set_to_none=True)
        for k in range(accum):
            i = t * accum + k
            x, y = batches[i]
            outs.clear()
            task = F.cross_entropy(net(x), y)
            penalty = torch.stack([((o.abs() / (3.0 + 1e-6)) ** 4).mean() for o in outs]).mean()
            s = i if variant == "iteration_step" else t
            lam_t = lam * 0.5 * (1.0 + math.cos(math.pi * min(s, updates) / updates))
            term = lam_t * penalty * (1.0 if variant == "not_rescaled" else task.detach() / penalty.detach())
            (task / accum + (term if variant == "unscaled_by_accum" else term / accum)).backward()
            if last_losses is not None:
                last_losses.update(task=task.item(), penalty=penalty.item(), term=term.item())
        opt.step()
        snapshots.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return snapshots


def test_tweo_hook_matches_the_float64_reference_with_accumulation_and_adds_nothing_at_validation(tmp_path):
    lam = 0.5  # large, so that every wrong variant moves the weights far beyond the tolerance
    runner = run(config(tmp_path, [dict(type="TweoHook", lam=lam, schedule="cosine")], iters=6, accum=2,
                        val=True))
    hook, rec = hook_of(runner, "TweoHook"), hook_of(runner, "Recorder")
    assert [n for n, _ in hook.tweo.blocks] == ["blocks.0", "blocks.1"]  # the backbone's, not the neck's
    after = rec.after[1::2]  # after each optimizer update
    assert_matches_reference(after, lambda v: tweo_reference(BaselineNet(), runner.model.batches, 6, 2, lam, v),
                             TOL, TWEO_VARIANTS)
    # validation ran (val_interval 2) and captured no block output; the term is logged in training only
    assert rec.val_pending and not any(rec.val_pending)
    hub = runner.message_hub
    assert hub.get_scalar("train/tweo_lam").current() == pytest.approx(lam * 0.5 * (1 + math.cos(math.pi * 2 / 3)))
    # the last iteration's log variables: `loss` is the total (task + term), the raw penalty and the term
    want = {}
    tweo_reference(BaselineNet(), runner.model.batches, 6, 2, lam, "paper", last_losses=want)
    assert hub.get_scalar("train/loss").current() == pytest.approx(want["task"] + want["term"], rel=1e-9)
    assert hub.get_scalar("train/loss_tweo").current() == pytest.approx(want["term"], rel=1e-9)
    assert hub.get_scalar("train/tweo_penalty").current() == pytest.approx(want["penalty"], rel=1e-9)
    assert not any("tweo" in k for k in hub.log_scalars if k.startswith("val/"))
    assert "parse_losses" not in vars(runner.model)  # unwrapped after training


def test_tweo_hook_refuses_bad_arguments():
    from cd.integrations.mmengine import TweoHook

    with pytest.raises(ValueError, match="lam"):
        TweoHook(lam=-1.0)
    with pytest.raises(TypeError, match="nope"):
        TweoHook(nope=1)
    with pytest.raises(ValueError, match="total_steps=10 sets the length of schedule 'cosine'"):
        TweoHook(total_steps=10)  # the constant schedule would never read it
    assert TweoHook(total_steps=10, schedule="cosine").total_steps == 10
    with pytest.raises(TypeError, match="module must be"):
        TweoHook(module=1)


@pytest.mark.parametrize("given, refused", [
    (dict(p=-1.0), "finite p >= 1"), (dict(p=float("nan")), "finite p >= 1"), (dict(tau=-5.0), "tau \\+ eps > 0"),
    (dict(tau="3"), "tau must be a real number"), (dict(eps=True), "eps must be a real number"),
    (dict(schedule="cosin"), "schedule must be one of"), (dict(form="x"), "form must be one of"),
    (dict(total_steps=True, schedule="cosine"), "total_steps must be a positive integer")])
def test_tweo_hook_refuses_the_values_tweo_refuses_when_it_is_built(given, refused):
    """What TWEO refuses once the runner trains (its model is made then) is refused when the hook is built, as the
    Runner builds it from its config: before the model, the data and the work_dir."""
    from cd.integrations.mmengine import TweoHook

    with pytest.raises(ValueError, match=refused):
        TweoHook(**given)
    assert TweoHook(schedule="cosine").total_steps is None  # the run's length is filled in at before_train


# --- Noise (UNIQ) -----------------------------------------------------------------------------------------------
BITS, SEED = 4, 3


@pytest.mark.parametrize("given", [
    dict(lam=np.float32(1e-4)), dict(lam=np.float64(0.5)), dict(lam=np.int64(0)), dict(lam=True), dict(lam="1e-4"),
    dict(lam=np.float32("nan")), dict(schedule="cosine", total_steps=np.int64(5)),
    dict(schedule="cosine", total_steps=np.int32(3)), dict(schedule="cosine", total_steps=True),
    dict(schedule="cosine", total_steps=5.0), dict(schedule="cosine", total_steps=0), dict(total_steps=np.int64(5))],
    ids=repr)
def test_tweo_hook_takes_exactly_the_lam_and_total_steps_tweo_takes(given):
    """The hook accepts what TWEO (the reference) accepts and refuses what it refuses, with TWEO's words: was its
    own test of lam and total_steps, which refused numpy's numbers (lam=np.float32(1e-4), total_steps=np.int64(5))
    that TWEO and ColinearityDecayHook take. An accepted setting builds the run's TWEO with it."""
    from types import SimpleNamespace

    from mmengine.optim import OptimWrapper

    from cd.integrations.mmengine import TweoHook
    from cd.tweo import TWEO

    try:
        TWEO(BaselineNet(), rescale=True, **given).remove()
        refused = None
    except ValueError as e:
        refused = str(e)
    if refused is not None:
        with pytest.raises(ValueError) as error:
            TweoHook(**given)
        assert str(error.value) == refused
        return

    class Runner(SimpleNamespace):  # the hook keeps a weak reference to its runner
        pass

    model = BaselineNet()
    runner = Runner(model=model, optim_wrapper=OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1)),
                    max_iters=2, iter=0)
    hook = TweoHook(**given)
    hook.before_train(runner)
    assert hook.tweo.lam == float(given.get("lam", 1e-4)) and hook.tweo.total_steps == given.get("total_steps")
    hook.after_train(runner)


def naive_uniq(module, step, index, seed=SEED, bits=BITS, draws=torch.float64):
    """UNIQ's map written out element by element, for the weight and then the bias of `module` on the layer's
    generator draws r (of dtype `draws`: the layer's compute dtype, fp32 for a half-precision layer):
    NormalDist fitted to the tensor (mean, unbiased std), u = F(p), u + (r - 1/2) / k clamped
    to [1e-5, 1 - 1e-5], F^-1. Also the map's slope pdf(p) / pdf(p~). Returns {name: (p~, slope)}, float64."""
    k = 2 ** bits
    gen = torch.Generator().manual_seed(noise_seed(seed, step, index))
    out = {}
    for name in ("weight", "bias"):
        p = getattr(module, name).detach()
        r = torch.rand(p.shape, generator=gen, dtype=draws).flatten().tolist()
        vals = p.flatten().tolist()
        dist = NormalDist(statistics.fmean(vals), max(statistics.stdev(vals), 1e-5))
        noisy, slope = [], []
        for pi, ri in zip(vals, r):
            v = min(max(dist.cdf(pi) + (ri - 0.5) / k, 1e-5), 1.0 - 1e-5)
            pn = dist.inv_cdf(v)
            noisy.append(pn)
            slope.append(dist.pdf(pi) / dist.pdf(pn))
        out[name] = (torch.tensor(noisy, dtype=torch.float64).view_as(p),
                     torch.tensor(slope, dtype=torch.float64).view_as(p))
    return out


def linear_names(model):
    return [n for n, m in model.backbone.named_modules() if isinstance(m, nn.Linear)]


def noise_reference(initial, batches, iters, variant):
    """float64 plain loop: each backbone Linear uses naive_uniq's p~ (weight and bias) in the forward; the clean
    parameter's gradient is dL/dp~ ("paper": UNIQ's straight-through), or dL/dp~ times the map's slope ("slope"),
    or no noise at all ("clean")."""
    net = copy.deepcopy(initial)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
    names = linear_names(net)
    snapshots = []
    for i in range(iters):
        x, y = batches[i]
        opt.zero_grad(set_to_none=True)
        subs, slopes = {}, {}
        if variant != "clean":
            for index, name in enumerate(names):
                for param, (noisy, slope) in naive_uniq(net.backbone.get_submodule(name), i, index).items():
                    key = f"backbone.{name}.{param}"
                    subs[key], slopes[key] = noisy.requires_grad_(), slope
        F.cross_entropy(torch.func.functional_call(net, subs, (x,)), y).backward()
        params = dict(net.named_parameters())
        for key in slopes:
            g = subs[key].grad
            params[key].grad = g if variant == "paper" else g * slopes[key]
        opt.step()
        snapshots.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return snapshots


def test_weight_noise_hook_is_uniq_in_training_clean_elsewhere_and_matches_the_reference(tmp_path):
    hooks = [dict(type="WeightNoiseHook", bits=BITS, seed=SEED)]
    runner = run(config(tmp_path, hooks, iters=4, val=True))
    rec, noise = hook_of(runner, "Recorder"), hook_of(runner, "WeightNoiseHook").noise
    names = linear_names(runner.model)
    assert [n for n, _ in noise.layers] == names and len(names) == 8  # qkv, proj, fc1, fc2 of 2 blocks
    # the training forward sees UNIQ's map of the clean weights, on the generator draws of (seed, iteration, layer)
    for i in (0, 3):
        for index, name in enumerate(names):
            module = copy.deepcopy(runner.model.backbone.get_submodule(name))
            for param in ("weight", "bias"):
                getattr(module, param).data.copy_(rec.clean[i][f"backbone.{name}.{param}"])
            want = naive_uniq(module, i, index)
            for param in ("weight", "bias"):
                clean, seen = rec.clean[i][f"backbone.{name}.{param}"], rec.seen[i][f"{name}.{param}"]
                assert torch.allclose(seen, want[param][0], rtol=0, atol=1e-12), (i, name, param)
                # really perturbed (a zero-initialised bias only by its sigma floor, 1e-5)
                assert (seen - clean).abs().max() > (1e-3 if param == "weight" or i else 1e-8)
    # validation (after iterations 2 and 4) sees the clean weights
    assert len(rec.val_seen) == 4
    for j, seen in enumerate(rec.val_seen):
        clean = rec.after[1 if j < 2 else 3]
        assert all(torch.equal(seen[f"{n}.{p}"], clean[f"backbone.{n}.{p}"]) for n in names for p in ("weight", "bias"))
    # the gradient at the noisy values reaches the clean ones unchanged: the weights follow that reference, not
    # the map's slope and not a noiseless run
    assert_matches_reference(rec.after, lambda v: noise_reference(BaselineNet(), runner.model.batches, 4, v),
                             TOL, ("paper", "slope", "clean"))
    # nothing noisy is kept: the model holds its Parameters (those the optimizer steps), checkpoints the clean ones
    held = {id(p) for g in runner.optim_wrapper.optimizer.param_groups for p in g["params"]}
    for name in names:
        w = runner.model.backbone.get_submodule(name)._parameters["weight"]
        assert isinstance(w, nn.Parameter) and id(w) in held
    saved = torch.load(tmp_path / "iter_2.pth", map_location="cpu", weights_only=False)["state_dict"]
    assert all(torch.equal(saved[n], rec.after[1][n]) for n in rec.after[1])


@pytest.mark.parametrize("bits", [2, 8])
def test_weight_noise_hook_draws_the_noise_of_the_bits_given(tmp_path, bits):
    """A non-default `bits` in the config is the k = 2^bits of the noise the training forward sees (naive UNIQ map
    of that k), not the default's: the default's map of the same draws is far from it."""
    runner = run(config(tmp_path, [dict(type="WeightNoiseHook", bits=bits, seed=SEED)], iters=2))
    rec = hook_of(runner, "Recorder")
    assert hook_of(runner, "WeightNoiseHook").noise.bits == bits
    for i in (0, 1):
        for index, name in enumerate(linear_names(runner.model)):
            module = copy.deepcopy(runner.model.backbone.get_submodule(name))
            for param in ("weight", "bias"):
                getattr(module, param).data.copy_(rec.clean[i][f"backbone.{name}.{param}"])
            want, default = naive_uniq(module, i, index, bits=bits), naive_uniq(module, i, index, bits=BITS)
            seen = rec.seen[i][f"{name}.weight"]
            assert torch.allclose(seen, want["weight"][0], rtol=0, atol=1e-12), (bits, i, name)
            assert (seen - default["weight"][0]).abs().max() > 1e-3


def test_weight_noise_same_seed_same_run_other_seed_other_run_and_resume_continues(tmp_path, monkeypatch):
    def hooks(seed):
        return [dict(type="WeightNoiseHook", bits=BITS, seed=seed)]

    full = hook_of(run(config(tmp_path / "full", hooks(SEED))), "Recorder").after
    again = hook_of(run(config(tmp_path / "again", hooks(SEED))), "Recorder").after
    other = hook_of(run(config(tmp_path / "other", hooks(SEED + 1))), "Recorder").after
    assert all(torch.equal(full[-1][n], again[-1][n]) for n in full[-1])
    assert max(float((full[-1][n] - other[-1][n]).abs().max()) for n in full[-1]) > 1e-4
    # MMEngine 0.10's resume needs this under torch >= 2.6 (its message hub holds numpy arrays), CD or not
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    resumed = hook_of(run(config(tmp_path / "resumed", hooks(SEED), model=dict(seed=5),
                                 resume=str(tmp_path / "full" / "iter_2.pth"))), "Recorder").after
    assert len(resumed) == 2
    for got, want in zip(resumed, full[2:]):
        assert all(torch.allclose(got[n], want[n], rtol=0, atol=TOL) for n in want)


def test_two_weight_noises_on_one_layer_are_refused_and_one_removed_makes_room():
    """Stacked, the second WeightNoise would take the first's noisy tensor for the clean weight and put it back
    after the forward: a plain tensor in place of the Parameter the optimizer steps."""
    from cd.noise import WeightNoise

    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).train()
    weights = [m.weight for m in net]
    first = WeightNoise(net, seed=0)
    with pytest.raises(RuntimeError, match="0, 1 have the hooks of another WeightNoise already"):
        WeightNoise(net, seed=1)
    with pytest.raises(RuntimeError, match="another WeightNoise"):
        WeightNoise(net[1], seed=1)  # one layer in common is enough
    first.remove()
    with WeightNoise(net, seed=1):
        net(torch.randn(4, 8)).sum().backward()
    assert all(m.weight is w and w.grad is not None for m, w in zip(net, weights))
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net)


@pytest.mark.parametrize("computed, fix", [
    ("parametrizations.weight_norm", r"parametrize\.remove_parametrizations\(layer, 'weight'\)"),
    ("utils.weight_norm", r"torch\.nn\.utils\.remove_weight_norm\(layer\)"),
    ("utils.spectral_norm", r"torch\.nn\.utils\.remove_spectral_norm\(layer\)"),
    ("prune", r"torch\.nn\.utils\.prune\.remove\(layer, 'weight'\)"),
])
def test_a_layer_whose_weight_is_computed_at_each_forward_is_refused_not_left_clean(computed, fix):
    """weight_norm (either torch API), spectral_norm and pruning make a Linear's weight from other tensors at each
    forward: no Parameter in its place for the noise to swap, so the layer would train clean beside noisy ones. The
    refusal names the function that undoes each (remove_parametrizations undoes none of the hook-based ones)."""
    import warnings

    import torch.nn.utils.prune as prune

    from cd.noise import WeightNoise

    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        {"utils.weight_norm": torch.nn.utils.weight_norm, "utils.spectral_norm": torch.nn.utils.spectral_norm,
         "prune": lambda m: prune.l1_unstructured(m, "weight", amount=0.5),
         "parametrizations.weight_norm": torch.nn.utils.parametrizations.weight_norm}[computed](net[1])
    with pytest.raises(ValueError, match=f"weight of 1 is computed at each forward .*{fix}"):
        WeightNoise(net)
    assert not net[0]._forward_pre_hooks and not net[0]._forward_hooks  # refused before any layer is hooked
    with WeightNoise(net[0]):  # the plain layer alone is taken
        pass


@HOOKS.register_module(force=True)
class FailAt(Hook):
    """Raises before training iteration `it`: a run that fails with the baselines' hooks on the model."""

    def __init__(self, it: int = 1) -> None:
        self.it = it

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if runner.iter == self.it:
            raise RuntimeError("a failed run")


def test_a_run_after_a_failed_one_on_the_same_model_object_gets_its_own_baselines_only(tmp_path):
    """MMEngine calls no hook when training raises, so a failed run's noise hooks and TWEO wrapper stay on the
    model object; a new Runner with the baselines on it removes them: it trains as the same run on a fresh model
    (one noise, one TWEO term, not two), and leaves nothing on the model when it is done."""
    from mmengine.runner import Runner

    import cd.integrations.mmengine  # noqa: F401  (registers the hooks; a Runner built in code reads no custom_imports)
    from cd.noise import _NOISE_ON

    def train(folder, model, hooks):
        cfg = dict(config(tmp_path / folder, hooks), experiment_name=folder)  # one name per Runner of a second
        del cfg["custom_imports"]
        runner = Runner(**dict(cfg, model=model))
        runner.train()
        return hook_of(runner, "Recorder").after

    baselines = [dict(type="WeightNoiseHook", bits=BITS, seed=SEED), dict(type="TweoHook", lam=0.5)]
    reused = BaselineNet()
    with pytest.raises(RuntimeError, match="a failed run"):
        train("failed", reused, [*baselines, dict(type="FailAt")])
    assert "parse_losses" in vars(reused) and reused.backbone.blocks[0].attn.qkv._forward_pre_hooks  # left behind
    reused.load_state_dict(BaselineNet().state_dict())  # the failed run's first update undone
    got, want = train("again", reused, baselines), train("fresh", BaselineNet(), baselines)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert all(torch.equal(g[n], w[n]) for n in w)
    assert "parse_losses" not in vars(reused)
    assert not any(m in _NOISE_ON for m in reused.modules())  # no noise hook (the Recorders' pre-hooks stay)
    assert not any(block._forward_hooks for block in reused.backbone.blocks)  # no TWEO capture


def test_weight_noise_hook_refuses_bad_arguments():
    from cd.integrations.mmengine import WeightNoiseHook

    with pytest.raises(ValueError, match="bits"):
        WeightNoiseHook(bits=0)
    with pytest.raises(ValueError, match="layer_types"):
        WeightNoiseHook(layer_types=["LayerNorm"])
    with pytest.raises(ValueError, match="seed"):
        WeightNoiseHook(seed=-1)
    with pytest.raises(TypeError, match="module must be"):
        WeightNoiseHook(module=["backbone"])


def test_weight_noise_perturbs_only_training_forwards_of_linear_layers():
    """UNIQ noise on a plain Linear (no runner): a training forward sees noisy weights, with grad or under no_grad
    (reentrant checkpointing's first forward: the same noise at one step, tests/test_noise_checkpoint.py), an
    evaluation forward the clean ones, compared with F.linear on the clean weights; a parameter of one element has
    no distribution to fit and stays clean; bits outside [1, 16] refused; by default only Linear layers get
    noise."""
    from cd.noise import WeightNoise

    torch.manual_seed(0)
    layer, single = nn.Linear(8, 6).train(), nn.Linear(1, 1).train()
    x = torch.randn(3, 8)
    with WeightNoise(layer, bits=4), WeightNoise(single, bits=4):
        clean = F.linear(x, layer.weight, layer.bias)
        noisy = layer(x)
        assert (noisy - clean).abs().max() > 1e-3  # the training forward is perturbed
        with torch.no_grad():
            assert torch.equal(layer(x), noisy)
        layer.eval()  # an evaluation forward with grad on (a validation loop without no_grad): clean too
        assert torch.equal(layer(x), clean)
        layer.train()
        assert torch.equal(single(x[:, :1]), F.linear(x[:, :1], single.weight, single.bias))
    for bits in (0, 17, True, 4.0):  # a bool is no bit-width (True would be read as 1)
        with pytest.raises(ValueError, match="bits must be an int in \\[1, 16\\]"):
            WeightNoise(nn.Linear(2, 2), bits=bits)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        WeightNoise(nn.Linear(2, 2), seed=True)
    noise = WeightNoise(nn.Sequential(nn.Conv2d(1, 1, 1), nn.Linear(2, 2)))  # the default: Linear layers only
    assert [name for name, _ in noise.layers] == ["1"]
    noise.remove()


def test_a_training_forward_that_raises_leaves_the_clean_parameters_in_place():
    """The swap-out runs even when the layer's forward raises (a wrong input width here): the layer holds its own
    Parameters afterwards, not the noisy tensors, and its next training forward runs."""
    from cd.noise import WeightNoise

    layer = nn.Linear(4, 3).train()
    weight, bias = layer.weight, layer.bias
    with WeightNoise(layer, bits=4):
        with pytest.raises(RuntimeError):
            layer(torch.randn(2, 5))
        assert layer._parameters["weight"] is weight and layer._parameters["bias"] is bias
        layer(torch.randn(2, 4))


def test_a_layer_called_inside_its_own_forward_is_refused_and_keeps_its_parameters():
    """A layer whose forward calls itself (a recursive module): unguarded, the inner call would record the outer
    call's noisy tensor as the clean weight and put it back, and the outer call find nothing to restore: a plain
    tensor in the Parameter's place, which the optimizer no longer steps. The re-entered training forward is
    refused, and both the weight and the bias are the layer's own Parameters afterwards (identity, not value); its
    next plain training forward runs."""
    from cd.noise import WeightNoise

    class Twice(nn.Linear):
        """A square Linear applied twice: its forward calls the module itself once more."""

        def forward(self, x, again=True):
            y = super().forward(x)
            return self(y, again=False) if again else y

    layer = Twice(4, 4).train()
    weight, bias = layer.weight, layer.bias
    with WeightNoise(layer, bits=4):
        with pytest.raises(RuntimeError, match="Twice called again inside its own forward"):
            layer(torch.randn(2, 4))
        assert layer._parameters["weight"] is weight and layer._parameters["bias"] is bias
        layer(torch.randn(2, 4), again=False).sum().backward()
    assert layer._parameters["weight"] is weight and isinstance(weight, nn.Parameter) and weight.grad is not None

def test_weight_noise_keeps_a_half_precision_layers_dtype_and_takes_both_ends_of_the_bits_range():
    """The noise is computed in fp32 and cast back (cd/noise.py): a bf16 layer's training forward multiplies bf16
    weights (an fp32 weight beside a bf16 input is a dtype error in F.linear) and its clean weight gets a bf16
    gradient; bits 1 and 16, the ends of [1, 16], are taken."""
    from cd.noise import WeightNoise

    torch.manual_seed(0)
    layer = nn.Linear(8, 6).to(torch.bfloat16).train()
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    seen = []
    layer.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))  # after the noise's own hook
    with WeightNoise(layer, bits=4):
        out = layer(x)
        out.float().square().sum().backward()
    assert seen == [torch.bfloat16] and out.dtype == torch.bfloat16 and layer.weight.grad.dtype == torch.bfloat16
    assert (out - F.linear(x, layer.weight, layer.bias)).abs().max() > 1e-3  # the forward was perturbed
    for bits in (1, 16):
        WeightNoise(nn.Linear(2, 2), bits=bits).remove()


def test_a_half_precision_layers_noise_is_uniqs_map_computed_in_fp32_and_rounded_once():
    """A bf16 layer's noisy weight and bias are naive_uniq's float64 map of its values on fp32 draws
    (cd/noise.py: fp32 compute for half precision), rounded once to bf16: within a bf16 step (2^-8
    relative) plus a floor for values near 0. A map computed in bf16 (bf16 draws, u, clamp and erfinv) is off
    by many steps."""
    from cd.noise import WeightNoise

    torch.manual_seed(0)
    layer = nn.Linear(64, 64).to(torch.bfloat16).train()
    as64 = nn.Linear(64, 64).double()
    with torch.no_grad():
        as64.weight.copy_(layer.weight), as64.bias.copy_(layer.bias)
    want = naive_uniq(as64, 0, 0, draws=torch.float32)
    seen = {}
    with WeightNoise(layer, bits=BITS, seed=SEED):
        # registered after the noise's own pre-hook, so it sees the noisy parameters
        layer.register_forward_pre_hook(
            lambda m, args: seen.update(weight=m.weight.detach(), bias=m.bias.detach()))
        layer(torch.randn(2, 64, dtype=torch.bfloat16))
    for name in ("weight", "bias"):
        assert seen[name].dtype == torch.bfloat16
        torch.testing.assert_close(seen[name].double(), want[name][0], rtol=2 ** -8, atol=1e-4, msg=name)


# --- MMDetection's Swin and the config fragments ------------------------------------------------------------------
def test_mmdetection_swin_backbone_gets_both_hooks(tmp_path):
    pytest.importorskip("mmdet")
    from cd.families import import_mmdet_swin

    import_mmdet_swin()  # MMDetection's own Swin, registered in mmdet's MODELS (mmcv-lite or full mmcv)
    backbone = dict(type="mmdet.SwinTransformer", pretrain_img_size=32, embed_dims=DIM, depths=(2, 2),
                    num_heads=(2, 4), window_size=4, patch_size=2, strides=(2, 2), out_indices=(1,))
    cfg = config(tmp_path, [dict(type="TweoHook"), dict(type="WeightNoiseHook")], iters=2,
                 model=dict(backbone=backbone, width=2 * DIM, neck=False))
    cfg["default_scope"] = "mmdet"
    runner = run(cfg)
    tweo, noise, rec = (hook_of(runner, k) for k in ("TweoHook", "WeightNoiseHook", "Recorder"))
    blocks = [f"stages.{s}.blocks.{b}" for s in (0, 1) for b in (0, 1)]
    assert [n for n, _ in tweo.tweo.blocks] == blocks  # SwinBlock outputs: the residual stream
    layers = [n for n, _ in noise.noise.layers]
    assert "stages.0.blocks.0.attn.w_msa.qkv" in layers and "stages.1.blocks.1.ffn.layers.1" in layers
    assert "stages.0.downsample.reduction" in layers and not any("patch_embed" in n for n in layers)
    assert runner.message_hub.get_scalar("train/loss_tweo").current() > 0
    name = "stages.1.blocks.1.ffn.layers.1"
    assert (rec.seen[1][f"{name}.weight"] - rec.clean[1][f"backbone.{name}.weight"]).abs().max() > 1e-4


@pytest.mark.parametrize("method,hook", [("cd", "ColinearityDecayHook"), ("tweo", "TweoHook"),
                                         ("noise", "WeightNoiseHook")])
def test_detection_method_fragments_build_their_hook_and_merge_onto_a_base(tmp_path, method, hook):
    fragment = Config.fromfile(os.path.join(ROOT, "configs", "detection", "method", f"{method}.py"))
    assert fragment.custom_imports.imports == ["cd.integrations.mmengine"]
    (spec,) = fragment.custom_hooks
    assert spec["type"] == hook and type(HOOKS.build(dict(spec))).__name__ == hook
    base = Config(dict(optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-4,
                                                                             weight_decay=0.05))))
    base.merge_from_dict(fragment.to_dict())
    assert base.optim_wrapper.optimizer.lr == 1e-4 and base.custom_hooks[0]["type"] == hook
    if method == "cd":  # the budget rule, applied to the merged config: weight decay 0.05 - lam
        from cd.integrations.mmengine import apply_weight_decay_budget

        assert base.optim_wrapper.optimizer.weight_decay == 0.05 and base.cd_budget is True
        apply_weight_decay_budget(base)
        assert base.optim_wrapper.optimizer.weight_decay == pytest.approx(0.05 - spec["lam"])
    else:
        assert base.optim_wrapper.optimizer.weight_decay == 0.05


@pytest.mark.parametrize("weight_decay, lam, named", [(0.05, float("nan"), "ColinearityDecayHook lam"),
                                                      (0.05, -0.01, "ColinearityDecayHook lam"),
                                                      (-0.1, 0.005, "optim_wrapper.optimizer.weight_decay"),
                                                      (float("inf"), 0.005, "optim_wrapper.optimizer.weight_decay")])
def test_the_budget_names_a_weight_decay_or_lam_that_is_no_finite_number_at_least_0(weight_decay, lam, named):
    """budget_weight_decay refuses these; the budget said "weight_decay - lam < 0; lower the hook's lam" for each
    (0.05 - (-0.01) is 0.06, and a NaN lam or a negative weight decay are not fixed by a lower lam)."""
    from cd.integrations.mmengine import apply_weight_decay_budget

    cfg = dict(cd_budget=True, custom_hooks=[dict(type="ColinearityDecayHook", lam=lam)],
               optim_wrapper=dict(optimizer=dict(type="AdamW", weight_decay=weight_decay)))
    with pytest.raises(ValueError, match=rf"^cd_budget=True needs a finite number >= 0 as {named}, got "):
        apply_weight_decay_budget(cfg)
    assert cfg["optim_wrapper"]["optimizer"]["weight_decay"] is weight_decay and cfg["cd_budget"] is True


def test_noise_seeds_are_splitmix64_and_distinct_per_seed_step_and_layer():
    """noise_seed mixes all of (seed, step, layer index): splitmix64's published first output for state 0
    (0xE220A8397B1DCDAF) and a grid of triples whose seeds are all distinct (one layer's noise is not
    another's, one step's not the next's)."""
    from cd.noise import _splitmix64, noise_seed

    assert _splitmix64(0) == 0xE220A8397B1DCDAF
    triples = [(s, t, i) for s in range(3) for t in range(6) for i in range(6)]
    seeds = {noise_seed(*x) for x in triples}
    assert len(seeds) == len(triples) and all(0 <= v < 2 ** 63 for v in seeds)


def test_weight_noise_in_an_epoch_based_loop_draws_by_the_runs_iteration_not_the_epochs_batch(tmp_path):
    """In an epoch-based loop `batch_idx` restarts every epoch: the noise of the second epoch's first batch is the
    draw of run iteration 2 (naive UNIQ map on those draws), not a repeat of iteration 0's."""
    cfg = config(tmp_path, [dict(type="WeightNoiseHook", bits=BITS, seed=SEED)])
    cfg["train_dataloader"].update(dataset=dict(type="BaselineData", n=4),
                                   sampler=dict(type="DefaultSampler", shuffle=False))
    cfg["train_cfg"] = dict(by_epoch=True, max_epochs=2)
    cfg["default_hooks"] = dict(logger=None, checkpoint=None)
    runner = run(cfg)
    rec = hook_of(runner, "Recorder")
    assert len(rec.seen) == 4
    name = linear_names(runner.model)[0]
    module = copy.deepcopy(runner.model.backbone.get_submodule(name))
    for param in ("weight", "bias"):
        getattr(module, param).data.copy_(rec.clean[2][f"backbone.{name}.{param}"])
    want = naive_uniq(module, 2, 0)["weight"][0]
    assert torch.allclose(rec.seen[2][f"{name}.weight"], want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("iters, accum, total_steps, update", [(3, 2, None, 1), (2, 1, 8, 1)],
                         ids=["default_length_rounds_up", "total_steps_given"])
def test_tweo_hook_cosine_runs_over_the_updates_of_the_run_or_the_total_steps_given(tmp_path, iters, accum,
                                                                                     total_steps, update):
    """lam(t) = lam * (1 + cos(pi * t / T)) / 2 at the last iteration's update t: T is ceil(max_iters / accum)
    (3 iterations of 2 micro-batches: 2 updates, the last one partial), or `total_steps` where given."""
    lam = 0.5
    hook = dict(type="TweoHook", lam=lam, schedule="cosine", **({"total_steps": total_steps} if total_steps else {}))
    runner = run(config(tmp_path, [hook], iters=iters, accum=accum))
    length = total_steps or math.ceil(iters / accum)
    want = lam * 0.5 * (1 + math.cos(math.pi * update / length))
    assert runner.message_hub.get_scalar("train/tweo_lam").current() == pytest.approx(want, rel=1e-12)


def test_tweo_hook_takes_lam_0_and_refuses_total_steps_0():
    """lam >= 0 (0 is TWEO off, as in a sweep), total_steps > 0: a total_steps of 0 would otherwise fall back to
    the run's length unsaid."""
    from cd.integrations.mmengine import TweoHook

    assert TweoHook(lam=0.0).kwargs["lam"] == 0.0
    with pytest.raises(ValueError, match="schedule 'cosine' needs total_steps > 0"):
        TweoHook(total_steps=0, schedule="cosine")


def test_two_tweo_hooks_in_one_runner_are_refused(tmp_path):
    """The second would take the first's parse_losses wrapper for a failed run's and drop it: one TWEO term."""
    hooks = [dict(type="TweoHook", lam=0.5), dict(type="TweoHook", lam=0.5)]
    with pytest.raises(RuntimeError, match="second TweoHook"):
        run(config(tmp_path, hooks, iters=1))


def test_optim_wrappers_that_accumulate_over_different_counts_are_refused():
    """The update index of a micro-batch (lam(t) of the cosine schedule) has one answer only for one count."""
    from types import SimpleNamespace

    from cd.integrations.mmengine_tweo import accumulative_counts

    def wrappers(*counts):
        return SimpleNamespace(optim_wrappers={str(i): SimpleNamespace(_accumulative_counts=c)
                                               for i, c in enumerate(counts)})

    assert accumulative_counts(wrappers(2, 2)) == 2
    with pytest.raises(ValueError, match=r"different counts \[1, 2\]"):
        accumulative_counts(wrappers(1, 2))


@HOOKS.register_module(force=True)
class SetAccumulation(Hook):
    """Sets the optim wrapper's accumulative_counts to `counts` before iteration `at` (runs before TweoHook's)."""

    priority = "HIGH"

    def __init__(self, at: int, counts: int) -> None:
        self.at, self.counts = at, counts

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if runner.iter == self.at:
            runner.optim_wrapper._accumulative_counts = self.counts


def test_a_cosine_tweo_refuses_an_accumulation_count_that_changes_during_training(tmp_path):
    """The count was read once at before_train: after a hook set 1 for 2, t = iteration // 2 went on indexing the
    cosine's lam(t) by half the updates made. A constant lam reads no t: the change passes there."""
    hooks = [dict(type="TweoHook", lam=0.5, schedule="cosine"), dict(type="SetAccumulation", at=2, counts=1)]
    with pytest.raises(RuntimeError, match="accumulative_counts changed from 2 to 1 at iteration 2"):
        run(config(tmp_path / "cosine", hooks, iters=4, accum=2))
    hooks[0] = dict(type="TweoHook", lam=0.5)
    assert run(config(tmp_path / "constant", hooks, iters=4, accum=2)).iter == 4


def test_a_cosine_tweo_resumed_with_another_accumulation_count_is_refused(tmp_path, monkeypatch):
    """The resumed run's t = iteration // accumulative_counts counts its updates only under the checkpoint's count
    (4 iterations of 2 micro-batches are 2 updates, not 4 of 1)."""
    hook = dict(type="TweoHook", lam=0.5, schedule="cosine")
    run(config(tmp_path / "first", [hook], iters=4, accum=2))
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # MMEngine's own message hub (numpy) in it
    checkpoint = str(tmp_path / "first" / "iter_4.pth")
    with pytest.raises(ValueError, match="accumulative_counts=1, where the checkpoint's run accumulated over 2"):
        run(config(tmp_path / "other", [hook], iters=6, accum=1, resume=checkpoint))
    assert run(config(tmp_path / "same", [hook], iters=6, accum=2, resume=checkpoint)).iter == 6


def test_a_cosine_tweo_resumed_into_a_longer_run_keeps_the_first_starts_length(tmp_path, monkeypatch):
    """The default length, ceil(max_iters / accumulation), was taken again at each start: a run of 4 updates resumed
    at update 2 with max_iters=8 (an extended run) went on with lam(t) of a cosine over 8, a jump from the first
    schedule at the resume. The first start's length is kept (lam 0 after it), with a warning; a total_steps given
    is the length asked."""
    lam = 0.5
    hook = dict(type="TweoHook", lam=lam, schedule="cosine")
    run(config(tmp_path / "first", [hook], iters=4))
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # MMEngine's own message hub (numpy) in it
    checkpoint = str(tmp_path / "first" / "iter_2.pth")
    with pytest.warns(UserWarning, match="keeps the run's first length of 4 updates .* not 8"):
        runner = run(config(tmp_path / "longer", [hook], iters=8, resume=checkpoint))
    lams = runner.message_hub.get_scalar("train/tweo_lam").data[0][-6:]  # updates 2 to 7, the resumed ones
    want = [lam * 0.5 * (1 + math.cos(math.pi * min(t, 4) / 4)) for t in range(2, 8)]
    assert lams.tolist() == pytest.approx(want, rel=1e-12, abs=1e-15)
    given = dict(hook, total_steps=8)
    run(config(tmp_path / "given", [given], iters=4))
    runner = run(config(tmp_path / "given_longer", [given], iters=8, resume=str(tmp_path / "given" / "iter_2.pth")))
    lams = runner.message_hub.get_scalar("train/tweo_lam").data[0][-6:]
    assert lams.tolist() == pytest.approx([lam * 0.5 * (1 + math.cos(math.pi * t / 8)) for t in range(2, 8)],
                                          rel=1e-12, abs=1e-15)


@MODELS.register_module(force=True)
class NoParseLosses(BaselineNet):
    """A train_step of its own that steps on the loss without the model's parse_losses."""

    def train_step(self, data, optim_wrapper):
        loss = self._run_forward(self.data_preprocessor(data, True), mode="loss")["loss"]
        optim_wrapper.update_params(loss)
        return {"loss": loss.detach()}


def test_a_train_step_that_never_calls_parse_losses_is_an_error_not_a_run_without_tweo(tmp_path):
    cfg = config(tmp_path, [dict(type="TweoHook", lam=0.5)], iters=1)
    cfg["model"] = dict(type="NoParseLosses")
    with pytest.raises(RuntimeError, match="parse_losses never ran"):
        run(cfg)


def test_tweo_hook_adds_its_term_inside_training_iterations_only():
    """parse_losses outside a training iteration (a hook's loss before the train loop, a val_step that logs its
    loss in eval mode, between iterations) returns MMEngine's own result; inside one, the rescaled term makes the
    loss task * (1 + lam) (lam * L_TWEO * detach(task / L_TWEO), constant schedule)."""
    from types import SimpleNamespace

    from mmengine.optim import OptimWrapper

    from cd.integrations.mmengine import TweoHook

    lam = 0.5
    model = BaselineNet()
    class Runner(SimpleNamespace):  # the hook keeps a weak reference to its runner
        pass

    runner = Runner(model=model, optim_wrapper=OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1)),
                    max_iters=2, iter=0)
    hook = TweoHook(lam=lam)
    hook.before_train(runner)
    x, y = torch.randn(2, 3, 32, 32, dtype=torch.float64), torch.tensor([1, 2])

    def loss_and_log(train):
        model.train(train)
        with torch.set_grad_enabled(train):
            losses = model(x, y, mode="loss")
            return model.parse_losses(losses), BaseModel.parse_losses(model, losses)  # the hook's, MMEngine's

    (loss, log), (task, _) = loss_and_log(True)  # before the train loop
    assert torch.equal(loss, task) and "loss_tweo" not in log
    hook.before_train_iter(runner, 0)
    (loss, log), (task, _) = loss_and_log(True)
    assert loss.item() == pytest.approx(task.item() * (1 + lam), rel=1e-12) and "loss_tweo" in log
    hook.after_train_iter(runner, 0)
    for train in (False, True):  # a validation forward, then one between iterations
        (loss, log), (task, _) = loss_and_log(train)
        assert torch.equal(loss, task) and "loss_tweo" not in log
    hook.after_train(runner)


@pytest.mark.parametrize("budget", ["yes", 1, 0, "True"])
def test_a_cd_budget_that_is_neither_true_nor_false_is_refused_not_read_as_either(budget):
    """`cd_budget = 1` or "yes" in a config is no bool: refused by one line naming the value and both choices,
    with the weight decay left as given (not lowered as for True, not kept silently as for False)."""
    from cd.integrations.mmengine import apply_weight_decay_budget

    cfg = dict(cd_budget=budget, custom_hooks=[dict(type="ColinearityDecayHook", lam=0.005)],
               optim_wrapper=dict(optimizer=dict(type="AdamW", weight_decay=0.05)))
    with pytest.raises(ValueError, match=rf"^cd_budget={budget!r}: give True .* or False$"):
        apply_weight_decay_budget(cfg)
    assert cfg["optim_wrapper"]["optimizer"]["weight_decay"] == 0.05 and cfg["cd_budget"] == budget


def test_weight_noise_hook_trains_again_after_a_run_that_raised():
    """MMEngine calls no after_train when training raises: the hook's next before_train (train() again on the
    same runner) removes its own noise first, so the layers get one noise (one set of hooks), not a refusal."""
    from types import SimpleNamespace

    from cd.integrations.mmengine import WeightNoiseHook

    class Runner(SimpleNamespace):  # the hook keeps a weak reference to its runner
        pass

    model = BaselineNet()
    runner = Runner(model=model, iter=0)
    hook = WeightNoiseHook(seed=0)
    hook.before_train(runner)
    hook.before_train(runner)  # no after_train in between
    linear = model.backbone.blocks[0].mlp.fc1
    assert len(linear._forward_pre_hooks) == 1  # one noise: the failed run's is off
    hook.after_train(runner)
    assert len(linear._forward_pre_hooks) == 0


@pytest.mark.parametrize("rescale", ["False", 0, None])
def test_tweo_hook_refuses_a_rescale_that_is_no_bool(rescale):
    """rescale="False" from a config string would otherwise be truthy (the rescaled form), 0 and None falsy."""
    from cd.integrations.mmengine import TweoHook

    with pytest.raises(ValueError, match=rf"^rescale must be True or False, got {rescale!r}$"):
        TweoHook(rescale=rescale)


def test_tweo_hook_trains_again_after_a_run_that_raised_with_one_term():
    """MMEngine calls no after_train when training raises: the hook's next before_train (train() again on the
    same runner) takes its own parse_losses wrapper off first, so it is not refused as a second TweoHook and the
    loss gets one rescaled term: task * (1 + lam)."""
    from types import SimpleNamespace

    from mmengine.optim import OptimWrapper

    from cd.integrations.mmengine import TweoHook

    class Runner(SimpleNamespace):  # the hook keeps a weak reference to its runner
        pass

    lam, model = 0.5, BaselineNet()
    runner = Runner(model=model, optim_wrapper=OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1)),
                    max_iters=2, iter=0)
    hook = TweoHook(lam=lam)
    hook.before_train(runner)
    hook.before_train_iter(runner, 0)  # the run raises here
    hook.before_train(runner)
    hook.before_train_iter(runner, 0)
    losses = model(torch.randn(2, 3, 32, 32, dtype=torch.float64), torch.tensor([1, 2]), mode="loss")
    loss, _ = model.parse_losses(losses)
    task, _ = BaseModel.parse_losses(model, losses)
    assert loss.item() == pytest.approx(task.item() * (1 + lam), rel=1e-12)
    hook.after_train_iter(runner, 0)
    hook.after_train(runner)
    assert "parse_losses" not in vars(model)


def test_tweo_hook_given_model_names_its_module_argument():
    """TWEO's own first argument is `model`; the hook finds the model in the runner and takes the part as
    `module=`, which the refusal names (TWEO's signature alone would say "multiple values for 'model'")."""
    from cd.integrations.mmengine import TweoHook

    with pytest.raises(TypeError, match=r"^TweoHook takes `module=` \(the part of the runner's model\), not `model=`$"):
        TweoHook(model="backbone")
