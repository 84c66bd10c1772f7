"""TWEO's settings take the types they name: its numbers are real numbers (not bools, not strings), its run length
an integer, its rescale switch a bool; each of the others is refused naming the setting, before any comparison."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cd import TWEO
from cd_models import tiny_vit


@pytest.mark.parametrize("name", ["lam", "p", "tau", "eps"])
@pytest.mark.parametrize("value", [True, "0.01"])
def test_a_bool_or_a_string_number_is_refused_naming_it(name, value):
    # lam=True was 1.0; lam='0.01' failed in a comparison with a TypeError naming no setting
    with pytest.raises(ValueError, match=rf"^tweo {name} must be a real number, got {value!r}"):
        TWEO(tiny_vit(), **{name: value})


@pytest.mark.parametrize("value", [True, 2.5, "100"])
def test_a_run_length_that_is_not_an_integer_is_refused(value):
    # total_steps=True made a cosine schedule of one step: lam(t) 0 from the second update on
    with pytest.raises(ValueError, match=rf"^tweo total_steps must be a positive integer .* got {value!r}"):
        TWEO(tiny_vit(), schedule="cosine", total_steps=value)


@pytest.mark.parametrize("value", ["false", 0, None])
def test_rescale_that_is_not_a_bool_is_refused_not_taken_as_true(value):
    with pytest.raises(ValueError, match=rf"^tweo rescale must be True or False, got {value!r}"):
        TWEO(tiny_vit(), rescale=value)


def test_numpy_numbers_are_real_numbers():
    np = pytest.importorskip("numpy")
    model = tiny_vit()
    x, target = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    tweo = TWEO(model, lam=np.float32(0.5), schedule="cosine", total_steps=np.int64(10))
    task = F.cross_entropy(model(x), target)
    tweo.aux_loss(task, step=5)
    # the cosine schedule at the middle of the run: lam * (1 + cos(pi / 2)) / 2 = lam / 2
    assert math.isclose(tweo.metrics()["tweo/lam"], 0.25, rel_tol=1e-6)
