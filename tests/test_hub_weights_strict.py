"""model.pretrained=hub under model.pretrained_strict=true is refused where a local file of the same weights is
(timm's loading replaced a classifier of another size by a random one, with a line of its log), and a position
table timm resampled to the model's grid is logged and recorded as a local file's is. The hub is a Hugging Face
cache made here (offline: nothing is fetched)."""
import logging
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import train
from hub_cache import make_hub_cache, serve_hub_cache
from configs import load_config
from models import ModelError, build_model

NAME = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"  # timm/<NAME> on the hub: 1000 classes at 224 pixels, patch 16


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache holding random weights of NAME as timm's hub copy, and the weights themselves."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    return root, load_file(make_hub_cache(root, [NAME])[NAME])


@pytest.fixture
def hub(hub_cache, monkeypatch):
    root, weights = hub_cache
    serve_hub_cache(monkeypatch, root)
    return weights


def model_cfg(*overrides):
    return load_config(None, [f"model.name={NAME}", *overrides]).model


def test_strict_hub_weights_of_another_classifier_size_are_refused_with_a_local_files_words(hub, tmp_path):
    local = tmp_path / "w.safetensors"
    save_file(hub, local)
    with pytest.raises(ModelError) as file_refused:
        build_model(model_cfg(f"model.pretrained={local}", "model.pretrained_strict=true", "model.num_classes=10"))
    with pytest.raises(ModelError) as hub_refused:
        build_model(model_cfg("model.pretrained=hub", "model.pretrained_strict=true", "model.num_classes=10"))
    said = str(hub_refused.value)
    assert said.startswith(f"model.pretrained=hub ({NAME}): its classifier"), said
    # the same words after the source (the file's line names whichever of the classifier's keys it met first)
    same = lambda line: re.sub(r"'head\.\w+'", "'head.*'", line.partition(": ")[2])
    assert same(said) == same(str(file_refused.value)), (said, str(file_refused.value))
    assert "'head.weight' has 1000 outputs, model.num_classes=10: set model.num_classes=1000" in said


def test_train_py_refuses_them_before_the_data(hub, debug_config):
    with pytest.raises(ModelError, match=r"has 1000 outputs, model.num_classes=4: set model.num_classes=1000"):
        train.main(debug_config(f"model.name={NAME}", "model.pretrained=hub", "model.pretrained_strict=true",
                                "model.img_size=32"))


def test_strict_hub_weights_of_another_attention_variant_are_refused(hub):
    with pytest.raises(ModelError, match=r"has no parameters of model.attn=kv_bias"):
        build_model(model_cfg("model.pretrained=hub", "model.pretrained_strict=true", "model.attn=kv_bias"))


def test_fitting_hub_weights_load_as_they_are_and_a_resampled_position_table_is_named(hub, caplog):
    with caplog.at_level(logging.INFO):
        model = build_model(model_cfg("model.pretrained=hub", "model.pretrained_strict=true", "model.img_size=32"))
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in hub.items() if k != "pos_embed")
    # 224 / 16 = 14 patches a side in the weights, 32 / 16 = 2 in the model; the class token's entry stays
    assert loaded["pos_embed"].shape == (1, 1 + 2 * 2, 192)
    assert torch.equal(loaded["pos_embed"][:, 0], hub["pos_embed"][:, 0])
    assert model.pretrained_resampled == {"pos_embed_resampled": "14x14->2x2"}
    lines = [r.getMessage() for r in caplog.records if "position table" in r.getMessage()]
    assert lines == [f"model.pretrained=hub ({NAME}): position table of a 14x14 grid resampled to the model's 2x2 "
                     f"(timm's bicubic resize; the weights were trained at 224x224 pixels in patches of 16x16, the "
                     f"model takes 32x32 in patches of 16x16)"], caplog.text
    assert build_model(model_cfg("model.pretrained=hub")).pretrained_resampled == {}  # at their own 224 pixels


def test_fine_tuning_hub_weights_still_replaces_their_classifier(hub):
    model = build_model(model_cfg("model.pretrained=hub", "model.num_classes=10", "model.img_size=224"))
    loaded = model.state_dict()
    assert loaded["head.weight"].shape == (10, 192)
    assert all(torch.equal(loaded[k], v) for k, v in hub.items() if not k.startswith("head."))
