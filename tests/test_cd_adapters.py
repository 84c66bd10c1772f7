"""Adapters at a layer CD pairs are refused by structure, whatever package they come from: a loralib-style Linear
subclass with lora_A / lora_B Parameters (W x + B A x), and a PEFT-shaped wrapper of one's own (base_layer plus
lora_A / lora_B layers) with or without a `weight` property. Each such layer applies another matrix than its
weight, which the tests check against F.linear first. Plain layers, and a layer whose child holds vectors only,
are paired as before."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cd import ColinearityDecay, UnsupportedModelError, find_pairs
from cd_models import tiny_vit

FIX = "merge the adapters into the weight first (PEFT: merge_and_unload())"


class LoraLibLinear(nn.Linear):
    """loralib's lora.Linear: the Linear's own weight plus lora_A / lora_B Parameters."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__(base.in_features, base.out_features)
        self.load_state_dict(base.state_dict())
        self.lora_A = nn.Parameter(0.1 * torch.randn(rank, base.in_features))
        self.lora_B = nn.Parameter(0.1 * torch.randn(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + (x @ self.lora_A.T) @ self.lora_B.T


class OwnLora(nn.Module):
    """PEFT's lora.Linear shape, as one's own class: base_layer plus low-rank layers."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


class OwnLoraWithWeight(OwnLora):
    """The same, with the base weight exposed as `weight`, as PEFT exposes it."""

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor:
        return self.base_layer.bias


def _with(kind, names=("attn.qkv", "mlp.fc1", "mlp.fc2")) -> nn.Module:
    model = tiny_vit()
    for block in model.blocks:
        for name in names:
            parent, _, leaf = name.rpartition(".")
            owner = block.get_submodule(parent)
            setattr(owner, leaf, kind(getattr(owner, leaf)))
    layer = model.blocks[0].get_submodule(names[0])
    x = torch.randn(3, layer.in_features if hasattr(layer, "in_features") else layer.base_layer.in_features)
    base = layer if isinstance(layer, nn.Linear) else layer.base_layer
    assert not torch.allclose(layer(x), F.linear(x, base.weight, base.bias))  # the layer applies another matrix
    return model


def test_a_loralib_style_linear_subclass_is_refused_naming_the_layer_and_its_adapters():
    model = _with(LoraLibLinear)
    with pytest.raises(UnsupportedModelError) as caught:
        find_pairs(model)
    message = str(caught.value)
    assert message.startswith("block 'blocks.0' (Block) is not supported by CD: the layer blocks.0.attn.qkv "
                              f"({__name__}.LoraLibLinear) of its qkv pair holds adapters (lora_A, lora_B)")
    assert FIX in message
    with pytest.raises(UnsupportedModelError, match="holds adapters"):
        ColinearityDecay(model, verify=False)  # refused without the checks too


def test_a_peft_shaped_wrapper_with_a_weight_property_is_refused_as_adapters_not_as_unused():
    with pytest.raises(UnsupportedModelError) as caught:
        find_pairs(_with(OwnLoraWithWeight, names=("attn.qkv", "mlp.fc2")))
    message = str(caught.value)
    assert (f"the layer blocks.0.attn.qkv ({__name__}.OwnLoraWithWeight) of its qkv pair holds adapters "
            "(base_layer.weight, base_layer.bias, lora_A.weight, lora_B.weight)") in message
    assert "not used in the forward pass" not in message and FIX in message


def test_a_wrapper_without_a_weight_is_named_as_such_not_as_missing():
    with pytest.raises(UnsupportedModelError) as caught:
        find_pairs(_with(OwnLora, names=("attn.qkv", "mlp.fc1")))
    message = str(caught.value)
    assert "attn.qkv is a OwnLora with no 2-D weight Parameter (it holds base_layer.weight, " in message
    assert "found no" not in message and FIX in message


class _Scaled(nn.Module):
    """A quantizer-like child holding a vector only."""

    def __init__(self, n: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))


class LinearWithVectorChild(nn.Linear):
    def __init__(self, base: nn.Linear):
        super().__init__(base.in_features, base.out_features)
        self.load_state_dict(base.state_dict())
        self.quantizer = _Scaled(base.out_features)


class PlainSubclass(nn.Linear):
    def __init__(self, base: nn.Linear):
        super().__init__(base.in_features, base.out_features)
        self.load_state_dict(base.state_dict())


@pytest.mark.parametrize("kind", [PlainSubclass, LinearWithVectorChild])
def test_layers_without_adapters_are_paired_as_before(kind):
    want = [(p.name, p.role) for p in find_pairs(tiny_vit())]
    assert [(p.name, p.role) for p in find_pairs(_with_plain(kind))] == want


def _with_plain(kind) -> nn.Module:
    model = tiny_vit()
    for block in model.blocks:
        block.attn.qkv, block.mlp.fc1, block.mlp.fc2 = (kind(block.attn.qkv), kind(block.mlp.fc1),
                                                        kind(block.mlp.fc2))
    return model


def test_a_pair_layer_with_a_pruned_bias_is_no_adapter():
    """torch.nn.utils.prune on a bias gives the layer an own `bias_orig` vector; its weight stays the matrix it
    applies, so the pairs are found as without the pruning (it was refused as "holds adapters (bias_orig)")."""
    import timm
    from torch.nn.utils import prune

    def model():
        torch.manual_seed(0)
        return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=4, depth=2)

    pruned = model()
    prune.l1_unstructured(pruned.blocks[0].mlp.fc2, "bias", 0.3)
    example = torch.randn(1, 3, 32, 32)
    names = [p.name for p in find_pairs(pruned, example)]
    assert names == [p.name for p in find_pairs(model(), example)] and len(names) == 8
