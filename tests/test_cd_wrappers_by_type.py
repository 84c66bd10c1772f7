"""cd.wrappers.unwrap_model strips a wrapper by its type (DDP and its subclasses, DataParallel, DeepSpeed's engine,
torch.compile), never a model of the user's own that names its only part `module`: such a model's forward may
do more than call that part (reshape the input first), so the pair check must run the model's own forward."""
from __future__ import annotations

import torch
from torch import nn

from cd import ColinearityDecay, find_pairs
from cd.wrappers import unwrap_model
from tests.cd_models import tiny_vit

_WANT = [f"blocks.{i}.{w}.weight" for i in range(2) for w in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]


class _Flattened(nn.Module):
    """A user's model: takes a flat (B, 3*32*32) input, makes the image of it, then runs the ViT held as `module`."""

    def __init__(self):
        super().__init__()
        self.module = tiny_vit()

    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        return self.module(flat.reshape(flat.shape[0], 3, 32, 32))


class _DDPSubclass(nn.parallel.DistributedDataParallel):
    """A framework's DDP subclass (MMEngine's MMDistributedDataParallel), built without a process group."""

    def __init__(self, module: nn.Module):
        nn.Module.__init__(self)
        self.module = module


class DeepSpeedEngine(nn.Module):
    """DeepSpeed's engine, known by its class name (DeepSpeed need not be installed): the model as `.module`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module


def test_a_model_whose_only_part_is_called_module_is_kept_with_its_own_forward():
    model = _Flattened()
    flat = torch.randn(1, 3 * 32 * 32)
    assert model(flat).shape == (1, 10)  # the model takes this input
    assert unwrap_model(model) is model
    assert [p.name for p in find_pairs(model, example_input=flat)] == [f"module.{n}" for n in _WANT]
    assert len(ColinearityDecay(model, example_input=flat).pairs) == len(_WANT)


def test_wrappers_are_stripped_by_type():
    net = tiny_vit()
    assert unwrap_model(_DDPSubclass(net)) is net
    assert unwrap_model(DeepSpeedEngine(_DDPSubclass(net))) is net
    assert unwrap_model(torch.compile(DeepSpeedEngine(net))) is net
    assert [p.name for p in find_pairs(_DDPSubclass(net))] == _WANT
