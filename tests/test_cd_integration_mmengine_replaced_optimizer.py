"""ColinearityDecayHook in a Runner whose optimizer wrapper a hook replaces during training (a second stage's
optimizer, set as `runner.optim_wrapper` at `before_train_epoch`): the new optimizer's steps get CD as the first
one's did, checked by counting the steps and the updates and by each step of the new optimizer against the float64
reference of (SGD step + CD) from the weights and gradients of before that step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("mmengine")
from mmengine.hooks import Hook  # noqa: E402
from mmengine.model import BaseModel  # noqa: E402
from mmengine.optim import OptimWrapper  # noqa: E402
from mmengine.runner import Runner  # noqa: E402

from cd.integrations.mmengine import ColinearityDecayHook  # noqa: E402
from cd_integration_refs import RandomImages  # noqa: E402
from cd_models import VIT_DEPTH, ref_block_update, tiny_vit  # noqa: E402

LAM, LR, ITERS_PER_EPOCH = 0.5, 0.1, 4


class Net(BaseModel):
    """A tiny timm ViT (float64) as the `backbone` of an MMEngine model."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = tiny_vit().double()

    def init_weights(self):
        """The weights made at construction stay."""

    def forward(self, inputs, labels=None, mode="tensor"):
        logits = self.backbone(inputs)
        return {"loss": F.cross_entropy(logits, labels)} if mode == "loss" else logits


class SecondStage(Hook):
    """At epoch 1, a fresh SGD optimizer in a new OptimWrapper, whose every step this hook records: the backbone's
    weights and gradients before the step (its step pre-hook, registered before any of CD's, runs first) and its
    weights after it."""

    def __init__(self) -> None:
        self.steps: list[tuple[dict, dict, dict]] = []

    def before_train_epoch(self, runner):
        if runner.epoch != 1:
            return
        sgd = torch.optim.SGD(runner.model.parameters(), lr=LR)
        net = runner.model.backbone

        def before(optimizer, args, kwargs):
            self.steps.append(({n: p.detach().clone() for n, p in net.named_parameters()},
                               {n: p.grad.detach().clone() for n, p in net.named_parameters()}, {}))

        def after(optimizer, args, kwargs):
            self.steps[-1][2].update({n: p.detach().clone() for n, p in net.named_parameters()})

        sgd.register_step_pre_hook(before)
        sgd.register_step_post_hook(after)
        runner.optim_wrapper = OptimWrapper(sgd)


def test_an_optim_wrapper_replaced_during_training_gets_cd_on_every_step(tmp_path):
    stage = SecondStage()
    runner = Runner(model=Net(), work_dir=str(tmp_path), log_level="ERROR",
                    train_dataloader=dict(dataset=RandomImages(2 * ITERS_PER_EPOCH), batch_size=2, num_workers=0,
                                          sampler=dict(type="DefaultSampler", shuffle=False),
                                          collate_fn=dict(type="default_collate")),
                    train_cfg=dict(by_epoch=True, max_epochs=2),
                    optim_wrapper=dict(optimizer=dict(type="AdamW", lr=2e-2)),
                    default_hooks=dict(checkpoint=None, logger=None),
                    custom_hooks=[stage, ColinearityDecayHook(lam=LAM)])
    runner.train()
    hook = next(h for h in runner.hooks if isinstance(h, ColinearityDecayHook))
    assert runner.iter == 2 * ITERS_PER_EPOCH and len(stage.steps) == ITERS_PER_EPOCH
    assert hook.decay.num_updates == runner.iter  # one CD update per optimizer step, of either stage
    for before, grads, after in stage.steps:
        # SGD on the weights CD left: W - lr * lam * (CD's term, from the weights before the step) - lr * grad
        want = {n: w.double() for n, w in before.items()}
        for i in range(VIT_DEPTH):
            ref_block_update(before, f"blocks.{i}", LR * LAM, want)
        for name, got in after.items():
            torch.testing.assert_close(got, want[name] - LR * grads[name], rtol=0, atol=1e-12, msg=name)
