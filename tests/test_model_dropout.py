"""model.drop is DeiT's / official Swin's drop_rate: dropout after the position embedding (ViT), the attention's
output projection and the MLP's two layers, never the classifier's (timm 1.x's drop_rate)."""
import re

import pytest
import torch.nn as nn

from configs import load_config
from models import ModelError, build_model


def model_cfg(*overrides):
    return load_config(None, list(overrides)).model


def dropouts_at(model: nn.Module, p: float) -> set:
    return {name for name, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p == pytest.approx(p)}


# where timm 0.3.2's ViT (DeiT's code) and microsoft/Swin-Transformer put their drop_rate, in timm 1.x's module
# names: ViT's pos_drop, every block's Attention.proj_drop and Mlp's dropout after fc1 and after fc2 (timm's Swin
# has no dropout after the patch embedding to set)
VIT_DEIT = re.compile(r"pos_drop|blocks\.\d+\.(attn\.proj_drop|mlp\.drop[12])")
SWIN_OFFICIAL = re.compile(r"layers\.\d+\.blocks\.\d+\.(attn\.proj_drop|mlp\.drop[12])")


@pytest.mark.parametrize("name, expected", [("vit_nano", VIT_DEIT), ("swin_nano", SWIN_OFFICIAL)],
                         ids=["vit", "swin"])
def test_model_drop_sets_the_dropout_of_deit_and_swin_and_not_the_classifiers(name, expected):
    model = build_model(model_cfg(f"model.name={name}", "model.drop=0.1", "model.drop_path=0"))
    every = {n for n, m in model.named_modules() if isinstance(m, nn.Dropout)}
    at_rate = dropouts_at(model, 0.1)
    assert at_rate == {n for n in every if expected.fullmatch(n)} and at_rate  # all of those, nothing else
    assert dropouts_at(model, 0.0) == every - at_rate  # the head's, attention weights' dropout stay off


def test_the_classifier_dropout_is_timms_own_argument():
    model = build_model(model_cfg("model.name=vit_nano", "model.kwargs.drop_rate=0.3"))
    assert dropouts_at(model, 0.3) == {"head_drop"}


def test_model_drop_of_a_model_it_has_no_meaning_for_is_refused():
    with pytest.raises(ModelError, match=r"model.drop=0.1: model 'resnet18' .* set model.drop=0"):
        build_model(model_cfg("model.name=resnet18", "model.drop=0.1", "model.num_classes=3"))
    build_model(model_cfg("model.name=resnet18", "model.num_classes=3"))  # model.drop=0: nothing to set
