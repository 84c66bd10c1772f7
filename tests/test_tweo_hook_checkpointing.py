"""TweoHook with activation checkpointing and with the rescaled form's unread settings, in a real MMEngine Runner
(CPU, float64).

MMEngine's `activation_checkpointing` wraps a module in torch.utils.checkpoint's reentrant form: a module that holds
a penalized block runs it without grad (left out of L_TWEO) and again in the backward pass. Such a module is refused
before any update; a block checkpointed itself trains exactly as without checkpointing. Blocks that run again after
the term was added are named as such (not as a train_step without parse_losses). `rescale=True` refuses tau and eps,
whose factor (tau + eps)^-p cancels from the rescaled term's gradient (shown here with plain autograd).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

pytest.importorskip("mmengine")
from mmengine.model import BaseModel  # noqa: E402
from mmengine.registry import DATASETS, MODELS  # noqa: E402
from timm.models.vision_transformer import Block  # noqa: E402

from cd_integration_refs import RandomImages  # noqa: E402
from mmengine_runs import hook_of, run  # noqa: E402

DIM = 16
BLOCKS = ["backbone.stages.0.0", "backbone.stages.1.0"]  # the blocks TweoHook penalizes (the backbone's)


class Backbone(nn.Module):
    """Patch tokens, then two stages of one timm pre-norm block each (stages.N.0); `recompute_stage1` runs stage
    1 under reentrant checkpointing in the model's own code, where no config shows it."""

    def __init__(self, recompute_stage1: bool = False) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, DIM, 8, stride=8)
        self.stages = nn.ModuleList([nn.Sequential(Block(DIM, 2)), nn.Sequential(Block(DIM, 2))])
        self.recompute_stage1 = recompute_stage1

    def forward(self, x):
        x = self.stages[0](self.patch(x).flatten(2).transpose(1, 2))
        return checkpoint(self.stages[1], x, use_reentrant=True) if self.recompute_stage1 else self.stages[1](x)


@MODELS.register_module(force=True)
class StagedNet(BaseModel):
    """A float64 MMEngine model: `backbone` (Backbone) and a linear head on its mean token."""

    def __init__(self, recompute_stage1: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = Backbone(recompute_stage1)
        self.head = nn.Linear(DIM, 10)
        self.double()

    def init_weights(self):
        """The weights made at construction stay."""

    def forward(self, inputs, labels=None, mode="tensor"):
        logits = self.head(self.backbone(inputs).mean(dim=1))
        return {"loss": F.cross_entropy(logits, labels)} if mode == "loss" else logits


DATASETS.register_module(name="StagedData", force=True, module=RandomImages)


def config(tmp_path, checkpointed=None, iters=2, hook=None, model=None):
    """A Runner config with a TweoHook (not rescaled, lam 0.5: a term large enough to move the weights) and
    MMEngine's activation_checkpointing of the modules `checkpointed`."""
    cfg = dict(
        model=dict(type="StagedNet", **(model or {})), work_dir=str(tmp_path),
        # a name of its own: MMEngine shares one message hub between runners of one name and second
        experiment_name=f"tweo_ckpt_{os.path.basename(tmp_path)}",
        train_dataloader=dict(dataset=dict(type="StagedData"), batch_size=2, num_workers=0,
                              sampler=dict(type="InfiniteSampler", shuffle=False),
                              collate_fn=dict(type="default_collate")),
        train_cfg=dict(by_epoch=False, max_iters=iters),
        optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.1)),
        custom_imports=dict(imports=["cd.integrations.mmengine"], allow_failed_imports=False),
        custom_hooks=[hook or dict(type="TweoHook", lam=0.5, rescale=False)],
        default_hooks=dict(checkpoint=None, logger=None), randomness=dict(seed=0), log_level="WARNING")
    if checkpointed is not None:
        cfg["activation_checkpointing"] = checkpointed
    return cfg


def naive_penalty(model, x):
    """L_TWEO of App. A.3 written out: the mean over the backbone's blocks of mean((|A| / (3 + 1e-6))^4)."""
    outs = []
    handles = [model.get_submodule(name).register_forward_hook(lambda m, a, o: outs.append(o)) for name in BLOCKS]
    with torch.no_grad():
        model.backbone(x)
    for h in handles:
        h.remove()
    return torch.stack([((o.abs() / (3.0 + 1e-6)) ** 4).mean() for o in outs]).mean().item()


@pytest.mark.parametrize("checkpointed", [["backbone.stages.1"], ["backbone"], "backbone.stages.0"])
def test_checkpointing_a_module_that_holds_a_penalized_block_is_refused_before_any_update(tmp_path, checkpointed):
    """Before the fix the stage ran without grad (L_TWEO of one block of two), one update was applied and the
    hook then raised a RuntimeError blaming a train_step without parse_losses (or, for the whole backbone, TWEO's
    aux_loss found no block output)."""
    from mmengine.config import Config
    from mmengine.runner import Runner

    path = f"{tmp_path}.py"
    Config(config(tmp_path, checkpointed)).dump(path)
    runner = Runner.from_cfg(Config.fromfile(path))
    before = {n: p.detach().clone() for n, p in runner.model.named_parameters()}
    with pytest.raises(ValueError) as refused:
        runner.train()
    name = checkpointed if isinstance(checkpointed, str) else checkpointed[0]
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"activation_checkpointing names {name}, which contains the "
                                                      "block backbone.stages."), message
    assert "checkpoint the blocks themselves" in message
    assert runner.iter == 0
    assert all(torch.equal(p, before[n]) for n, p in runner.model.named_parameters())  # no update applied
    model = runner.model
    assert "parse_losses" not in vars(model)  # nothing of the hook left on the model
    assert all(not model.get_submodule(name)._forward_hooks for name in BLOCKS)


def test_a_checkpointed_block_trains_as_without_checkpointing_with_every_block_in_the_term(tmp_path):
    """A block named itself keeps its forward hook outside the checkpoint: the logged L_TWEO is the naive mean over
    both blocks, and the weights after two updates are those of a run without checkpointing."""
    plain = run(config(tmp_path / "plain"))
    ckpt = run(config(tmp_path / "ckpt", BLOCKS + ["backbone.stages.1.0.mlp"]))  # and a part inside a block
    for name, p in plain.model.named_parameters():
        torch.testing.assert_close(dict(ckpt.model.named_parameters())[name], p, rtol=0, atol=1e-12, msg=name)
    hook = hook_of(ckpt, "TweoHook")
    assert len(hook.tweo.blocks) == 2
    # the last iteration's micro-batch, on the weights before its update: the first run's state after update 1
    x = RandomImages()[2]["inputs"], RandomImages()[3]["inputs"]
    reference = run(config(tmp_path / "one", iters=1)).model
    want = naive_penalty(reference, torch.stack(x))
    got = ckpt.message_hub.get_scalar("train/tweo_penalty").current()
    assert got == pytest.approx(want, rel=1e-9)


def test_blocks_recomputed_after_the_term_are_named_as_such_not_as_a_missing_parse_losses(tmp_path):
    """Reentrant checkpointing in the model's own code, which no config names: stage 1's block is captured in the
    backward pass, after the term was added; the error says so instead of blaming train_step."""
    with pytest.raises(RuntimeError) as raised:
        run(config(tmp_path, model=dict(recompute_stage1=True), iters=1))
    message = str(raised.value)
    assert "after the TWEO term was added" in message and "recomputed during the backward pass" in message
    assert "parse_losses never ran" not in message


@pytest.mark.parametrize("given, named", [(dict(tau=5.0), "tau=5.0 would be ignored: tau is read"),
                                         (dict(eps=1e-3), "eps=0.001 would be ignored: eps is read"),
                                         (dict(tau=3.0, eps=1e-6), "tau=3.0, eps=1e-06 would be ignored: tau and "
                                                                   "eps are read")])
def test_rescaled_tweo_refuses_tau_and_eps_which_it_never_reads(given, named):
    """train.py refuses tweo.tau beside tweo.rescale=true; the hook took them and trained the same run."""
    from cd.integrations.mmengine import TweoHook

    with pytest.raises(ValueError) as refused:
        TweoHook(**given)  # rescale=True is the hook's default
    assert str(refused.value).startswith(f"TweoHook {named} only when rescale=False")
    assert "give rescale=False" in str(refused.value)
    assert TweoHook(rescale=False, **given).tweo is None  # read there: taken
    assert TweoHook(p=2.0).kwargs["p"] == 2.0  # p is in the rescaled gradient: taken


def test_the_rescaled_gradient_does_not_depend_on_tau_or_eps():
    """Why the refusal holds: d/dw [lam * P * detach(L / P)] = lam * L * grad(P) / P, and P = c * mean(|A|^4) with
    c = (tau + eps)^-4, so c cancels; written with plain autograd, two tau's give one gradient."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(8, 4, dtype=torch.float64)

    def grad(tau, eps):
        a = x @ w
        task = a.pow(2).mean()
        penalty = ((a.abs() / (tau + eps)) ** 4).mean()
        (g,) = torch.autograd.grad(task + 0.1 * penalty * (task / penalty).detach(), w)
        return g

    torch.testing.assert_close(grad(3.0, 1e-6), grad(5.0, 1e-2), rtol=1e-12, atol=0)


@pytest.mark.parametrize("checkpointed, block", [("backbone.stages.1", "backbone.stages.1.0"),
                                                 ("backbone", "backbone.stages.0.0")])
def test_the_checkpointing_refusal_reads_the_names_through_mmengines_separate_ddp(tmp_path, checkpointed, block):
    """MMSeparateDistributedDataParallel wraps each child of the model in a DDP of its own, after MMEngine applied
    activation_checkpointing by the unwrapped model's names: the refusal looked those names up through the child's
    wrapper, so backbone.stages.1 (which holds a penalized block) resolved to nothing and passed, and the backbone
    itself was refused naming a block backbone.module.stages.0.0 that no config can name."""
    import torch.distributed as dist
    from mmengine.model import MMSeparateDistributedDataParallel

    from cd.integrations.mmengine import TweoHook

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = MMSeparateDistributedDataParallel(StagedNet())
        refusal = TweoHook(lam=0.5, rescale=False).checkpointing_refusal(model, [checkpointed])
    finally:
        dist.destroy_process_group()
    assert refusal is not None and refusal.startswith(f"activation_checkpointing names {checkpointed}, which "
                                                      f"contains the block {block} "), refusal
