"""CD's settings take the types they name: a switch is a bool and a count or a step size a number, never a string
that Python reads as true ('false') nor a bool that it reads as 1 (True). Each is refused naming the setting."""
from __future__ import annotations

import warnings

import pytest

from cd import ColinearityDecay, find_pairs, pair_energy_source
from cd.families import build_family
from cd.integrations import check_cd_arguments
from cd_models import snapshot, tiny_vit


@pytest.fixture(scope="module")
def swiglu_vit():
    """timm's AIMv2 (a SwiGLU MLP), refused unless gated_mlp=True."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_family("SwiGLU ViT (aimv2)")


@pytest.mark.parametrize("value", ["false", "no", 0, None])
def test_gated_mlp_that_is_not_a_bool_is_refused_not_taken_as_true(swiglu_vit, value):
    # 'false' switched the gated pairs on (10 pairs, config gated_mlp True) where False refuses the model
    message = rf"gated_mlp must be True or False, got {value!r}"
    with pytest.raises(ValueError, match=message):
        ColinearityDecay(swiglu_vit, gated_mlp=value)
    with pytest.raises(ValueError, match=message):
        find_pairs(swiglu_vit, gated_mlp=value)
    with pytest.raises(ValueError, match=message):
        pair_energy_source(swiglu_vit, gated_mlp=value)
    with pytest.raises(ValueError, match=rf"^cd {message}"):  # the callbacks and hooks, when they are made
        check_cd_arguments({"gated_mlp": value})


def test_gated_mlp_true_still_pairs_the_swiglu_blocks(swiglu_vit):
    # cd/README.md's family table: "Block (x2): qkv, proj, fc1 x2, fc2", five pairs in each of two blocks
    decay = ColinearityDecay(swiglu_vit, gated_mlp=True)
    assert len(decay.all_pairs) == 10 and decay.gated_mlp is True
    assert decay.state_dict()["config"]["gated_mlp"] is True


@pytest.mark.parametrize("value", ["false", 1, None])
def test_verify_that_is_not_a_bool_is_refused(value):
    message = rf"verify must be True or False, got {value!r}"
    model = tiny_vit()
    with pytest.raises(ValueError, match=message):
        ColinearityDecay(model, verify=value)
    with pytest.raises(ValueError, match=message):
        find_pairs(model, verify=value)
    with pytest.raises(ValueError, match=rf"^cd {message}"):
        check_cd_arguments({"verify": value})


def test_norms_every_true_is_refused_not_taken_as_1():
    with pytest.raises(ValueError, match=r"cd norms_every must be an integer >= 1, got True"):
        ColinearityDecay(tiny_vit(), norms_every=True)
    with pytest.raises(ValueError, match=r"cd norms_every must be an integer >= 1, got True"):
        check_cd_arguments({"norms_every": True})
    assert ColinearityDecay(tiny_vit(), norms_every=1).norms_every == 1


def test_norms_every_as_a_numpy_integer_is_honoured_as_that_integer():
    """np.int64(2) is an integer >= 1 (a log interval computed with numpy): the norms come on every 2nd update, as
    TWEO takes its total_steps; refusing it named no wrong input."""
    np = pytest.importorskip("numpy")
    decay = ColinearityDecay(tiny_vit(), norms_every=np.int64(2))
    check_cd_arguments({"norms_every": np.int64(2)})
    decay.apply(1e-3)
    assert not any(key.startswith("cd/update_norm/") for key in decay.metrics())  # update 1: no norms
    decay.apply(1e-3)
    assert {"cd/update_norm/qkv", "cd/update_norm/fc2"} <= set(decay.metrics())  # update 2: the norms


@pytest.mark.parametrize("lr", [True, False])
def test_apply_with_a_bool_lr_is_refused_and_moves_nothing(lr):
    # apply(True) made a step with lr 1.0, a thousand times a typical lr of 1e-3; apply(False) a silent no-op
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.005)
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"ColinearityDecay.apply: lr must be a finite number >= 0, got {lr}"):
        decay.apply(lr)
    assert all((p == before[n]).all() for n, p in model.named_parameters())
    assert decay.num_updates == 0
