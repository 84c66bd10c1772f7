"""A model whose pairs hold a NaN or inf weight is refused naming that weight, not its example input.

The value checks (`cd/values.py`) run the model on real numbers; one NaN in a pair's matrix or norm scale makes
every input they judge NaN, which read as an example or masks without a finite value, with verify=False as the way
out (which then spreads the NaN through CD's update). The weight is named instead, before any forward.
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch

from cd import ColinearityDecay, find_pairs, pair_energy_source
from cd_models import snapshot, tiny_vit

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("name,index,value", [
    ("blocks.0.mlp.fc1.weight", (3, 5), NAN),      # W1 of fc2 and W2 of fc1
    ("blocks.0.norm1.weight", (0,), NAN),          # a norm's scale: W1 of the qkv pair
    ("blocks.1.attn.proj.weight", (0, 0), INF),    # a W2
    ("blocks.1.attn.qkv.weight", (70, 1), -INF),   # a V row: W1 of the proj pair
])
def test_a_non_finite_weight_of_a_pair_is_refused_naming_it(name, index, value):
    model = tiny_vit()
    with torch.no_grad():
        dict(model.named_parameters())[name][index] = value
    before = snapshot(model)
    with pytest.raises(ValueError) as refused:
        ColinearityDecay(model)
    assert type(refused.value) is ValueError  # not UnsupportedModelError: the model is supported, its weights bad
    message = str(refused.value)
    assert message.startswith(f"the model's parameter {name} holds 1 NaN or inf value(s) "), message
    assert f"the first at {list(index)}" in message
    assert "load or initialise finite weights" in message
    assert "verify=False" not in message and "example_input" not in message
    assert "\n" not in message
    params = dict(model.named_parameters())
    for n, t in before.items():  # nothing written: NaN where it was, every other entry as it was
        assert torch.equal(params[n].isfinite(), t.isfinite()) and torch.equal(
            params[n][t.isfinite()], t[t.isfinite()]), n


def test_the_first_non_finite_parameter_in_model_order_is_named_with_its_count():
    model = tiny_vit()
    with torch.no_grad():
        model.blocks[1].mlp.fc2.weight[0, :3] = NAN
        model.blocks[0].norm2.weight[[2, 4]] = INF
    with pytest.raises(ValueError, match=re.escape("the model's parameter blocks.0.norm2.weight holds 2 NaN or inf "
                                                   "value(s) (of 32; the first at [2])")):
        find_pairs(model)


def test_a_baseline_energy_source_refuses_it_too_rather_than_warn_and_log_nothing():
    model = tiny_vit()
    with torch.no_grad():
        model.blocks[0].mlp.fc2.weight[1, 1] = NAN
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # UnsupportedModelError would be a warning here
        with pytest.raises(ValueError, match=r"^the model's parameter blocks\.0\.mlp\.fc2\.weight holds 1 NaN"):
            pair_energy_source(model)


def test_finite_weights_still_pass_and_a_nan_outside_the_pairs_is_not_named():
    model = tiny_vit()
    assert len(find_pairs(model)) == 8
    with torch.no_grad():
        model.head.weight[0, 0] = NAN  # after the blocks: no pair reads it, the checks see finite values
    assert len(find_pairs(model)) == 8


@pytest.mark.parametrize("meta", ["head", "blocks.1.mlp.fc2"])
def test_a_non_finite_weight_of_a_partly_materialised_model_is_refused_naming_it(meta):
    """A model with one layer still on the meta device (outside the pairs: the head; or a pair's matrix) cannot run the
    value checks' forwards, and every check was skipped for it, the NaN of a materialised pair's weight too; the
    materialised matrices are checked, the meta one passed over."""
    model = tiny_vit()
    part = model.get_submodule(meta)
    part.weight = torch.nn.Parameter(torch.empty_like(part.weight, device="meta"))
    with torch.no_grad():
        model.blocks[0].attn.proj.weight[2, 3] = NAN
    with pytest.raises(ValueError, match=re.escape("the model's parameter blocks.0.attn.proj.weight holds 1 NaN or "
                                                   "inf value(s) (of 1024; the first at [2, 3])")):
        find_pairs(model)
    with torch.no_grad():
        model.blocks[0].attn.proj.weight[2, 3] = 0.0
    assert len(find_pairs(model)) == 8  # finite: the meta weight is passed over, not refused
