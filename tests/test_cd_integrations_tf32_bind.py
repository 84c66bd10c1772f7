"""An explicit matmul_precision='tf32' on a model off CUDA is refused by the integrations when they bind the
framework's optimizers (the model is on the run's device by then): one ValueError at the framework's train start,
before any forward or backward, not inside the first optimizer step."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from cd import ColinearityDecay
from cd.integrations import bind_optimizers
from cd_integration_refs import RandomImages
from cd_models import snapshot, tiny_vit
from test_cd_tf32_device import assert_update_precision, vit_b_block

REFUSED = (r"^cd.integrations: matmul_precision=tf32 but the decayed matrices are on the cpu, which has no TF32 "
           r"\(the update would run in fp32\): pass matmul_precision='fp32', or 'auto' \(tf32 on CUDA, fp32 "
           r"elsewhere\), or train on a GPU")


def test_bind_optimizers_refuses_tf32_on_a_cpu_model_and_hooks_nothing():
    model = tiny_vit()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=REFUSED):
        bind_optimizers(ColinearityDecay(model, lam=0.1, matmul_precision="tf32"), [opt])
    assert not opt._optimizer_step_pre_hooks  # no binding was left on the optimizer


def test_auto_and_fp32_on_a_cpu_model_bind():
    for precision in ("auto", "fp32"):
        model = tiny_vit()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for binding in bind_optimizers(ColinearityDecay(model, lam=0.1, matmul_precision=precision), [opt]).values():
            binding.remove()


def _hf():
    pytest.importorskip("transformers")
    from transformers import TrainerState

    from cd.integrations.hf import ColinearityDecayCallback
    model = tiny_vit()
    callback = ColinearityDecayCallback(lam=0.1, matmul_precision="tf32")
    return lambda: callback.on_train_begin(None, TrainerState(), None, model=model,
                                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _lightning():
    pytest.importorskip("lightning")
    from lightning.pytorch.plugins.precision import Precision

    from cd.integrations.lightning import ColinearityDecayCallback
    model = tiny_vit()
    trainer = SimpleNamespace(optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)], precision_plugin=Precision())
    callback = ColinearityDecayCallback(lam=0.1, matmul_precision="tf32")
    return lambda: callback.on_train_start(trainer, model)


def _mmengine():
    pytest.importorskip("mmengine")
    from mmengine.optim import OptimWrapper

    from cd.integrations.mmengine import ColinearityDecayHook
    model = tiny_vit()
    runner = SimpleNamespace(model=model, optim_wrapper=OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1)),
                             iter=0)
    hook = ColinearityDecayHook(lam=0.1, module="", matmul_precision="tf32")
    return lambda: hook.before_train(runner)


@pytest.mark.parametrize("train_start", [_hf, _lightning, _mmengine], ids=["hf", "lightning", "mmengine"])
def test_each_integration_refuses_tf32_on_a_cpu_model_at_its_train_start(train_start):
    with pytest.raises(ValueError, match=REFUSED):
        train_start()()


def test_an_mmengine_runner_with_tf32_on_the_cpu_stops_before_its_first_forward(tmp_path):
    """A real Runner: the refusal comes at before_train, so no iteration has run and no weight has moved."""
    pytest.importorskip("mmengine")
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    from cd.integrations.mmengine import ColinearityDecayHook

    class Net(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            self.backbone, self.forwards = tiny_vit(), 0  # fp32: a float64 model is refused for its dtype first

        def init_weights(self):
            """The weights made at construction stay."""

        def forward(self, inputs, labels=None, mode="tensor"):
            self.forwards += 1
            logits = self.backbone(inputs.float())
            return {"loss": F.cross_entropy(logits, labels)} if mode == "loss" else logits

    model = Net()
    before = snapshot(model)
    runner = Runner(model=model, work_dir=str(tmp_path), log_level="ERROR",
                    train_dataloader=dict(dataset=RandomImages(4), batch_size=2, num_workers=0,
                                          sampler=dict(type="DefaultSampler", shuffle=False),
                                          collate_fn=dict(type="default_collate")),
                    train_cfg=dict(by_epoch=False, max_iters=2), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
                    default_hooks=dict(checkpoint=None, logger=None),
                    custom_hooks=[ColinearityDecayHook(lam=0.1, matmul_precision="tf32")])
    with pytest.raises(ValueError, match=REFUSED):
        runner.train()
    assert runner.iter == 0 and model.forwards == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.gpu
def test_bind_optimizers_takes_tf32_on_a_cuda_model():
    """Bound without an error, and bound to TF32: the decay the binding runs says tf32, and the update of an armed
    step (zero gradients: SGD moves nothing, CD alone acts, at lr x lam = 0.05) has TF32's error against float64,
    not fp32's (assert_update_precision, on vit_b_block: matrices cuBLAS multiplies on TF32 tensor cores)."""
    model = vit_b_block().cuda()
    before = snapshot(model)
    for p in model.parameters():  # a binding runs CD in a step that has gradients; zero ones leave SGD's part 0
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    bindings = bind_optimizers(ColinearityDecay(model, lam=0.1, matmul_precision="tf32"), [opt])
    (binding,) = bindings.values()
    assert binding.decay.matmul_precision == "tf32"
    binding.arm()
    opt.step()
    binding.disarm()
    assert binding.decay.num_updates == 1
    assert_update_precision(model, before, 0.05, "tf32")
    binding.remove()
