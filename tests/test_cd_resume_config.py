"""The config a CD state dict records holds what decides the update beyond lam/targets/mode: the matmul_precision
setting (as given: 'auto' stays 'auto') and the names of the decayed matrices (other `layouts=` pair other ones).
Resuming with another value of either warns; a state dict of an earlier release, without these keys, loads without
a warning about them."""
from __future__ import annotations

import warnings

import pytest
import torch
from timm.models.vision_transformer import Block
from torch import nn

from cd import LAYOUTS, ColinearityDecay
from test_cd_custom_layout import D, HEADS, MINE, T, MyBlock


def _model() -> nn.Module:
    """One block under names of its own (MINE), one timm Block under built-in names."""
    torch.manual_seed(0)
    return nn.Sequential(MyBlock(), Block(D, HEADS))


_X = torch.randn(1, T, D)


def _warnings(decay: ColinearityDecay, state: dict) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decay.load_state_dict(state)
    return [str(w.message) for w in caught]


def test_the_config_records_the_precision_setting_and_the_decayed_names():
    model = _model()
    config = ColinearityDecay(model, example_input=_X, layouts=[MINE]).state_dict()["config"]
    assert config["matmul_precision"] == "auto"  # the setting, not what it resolves to on this device
    # MINE pairs the first block only: its four matrices, in model order
    assert config["decayed"] == [f"0.{n}.weight" for n in ("attention.qkv_proj", "attention.out", "ffn.up",
                                                           "ffn.down")]


@pytest.mark.parametrize("changed", [dict(layouts=[MINE, *LAYOUTS]), dict(matmul_precision="bf16")])
def test_resuming_with_other_layouts_or_precision_warns(changed):
    model = _model()
    state = ColinearityDecay(model, example_input=_X, layouts=[MINE]).state_dict()
    now = ColinearityDecay(model, example_input=_X, **{"layouts": [MINE], **changed})
    said = [m for m in _warnings(now, state) if "different CD config" in m]
    assert len(said) == 1
    if "layouts" in changed:  # the timm block's four matrices are decayed only now
        assert "decayed matrices: 4 saved, 8 now (4 only now, e.g. 1.attn.qkv.weight)" in said[0]
    else:
        assert "'matmul_precision': 'auto'}" in said[0] and "'matmul_precision': 'bf16'}" in said[0]


def test_the_same_config_and_an_older_state_dict_without_the_new_keys_load_silently():
    model = _model()
    decay = ColinearityDecay(model, example_input=_X, layouts=[MINE, *LAYOUTS], matmul_precision="bf16")
    state = decay.state_dict()
    assert _warnings(ColinearityDecay(model, example_input=_X, layouts=[MINE, *LAYOUTS], matmul_precision="bf16"),
                     state) == []
    older = {"num_updates": 3, "config": {k: v for k, v in state["config"].items()
                                          if k not in ("matmul_precision", "decayed")}}
    assert _warnings(decay, older) == [] and decay.num_updates == 3


def test_a_state_dict_of_another_model_names_the_decayed_matrices_not_two_equal_settings():
    """The same settings on a model with other blocks: the warning says what differs (the decayed matrices), not
    'saved {...}, now {...}' with the same settings twice."""
    model = _model()
    state = ColinearityDecay(model, example_input=_X, layouts=[MINE]).state_dict()
    now = ColinearityDecay(model, example_input=_X, layouts=[MINE, *LAYOUTS])
    assert _warnings(now, state) == ["ColinearityDecay: resuming with a different CD config: decayed matrices: "
                                     "4 saved, 8 now (4 only now, e.g. 1.attn.qkv.weight)"]
