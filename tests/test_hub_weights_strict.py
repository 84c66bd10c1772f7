"""model.pretrained=hub under model.pretrained_strict=true is refused where a local file of the same weights is
(timm's loading replaced a classifier of another size by a random one, with a line of its log), and so is any
model.attn but softmax, the hub weights' attention (fine-tuning into it logs the change), and a position
table timm resampled to the model's grid is logged and recorded as a local file's is. The hub is a Hugging Face
cache made here (offline: nothing is fetched)."""
import logging
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import train
from conftest import DEBUG_CONFIG, run_entry
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


SOFTMAX_ONLY = (r"timm's hub weights are softmax attention, which model.attn={attn} would turn into another function"
                r" than the one they were trained as; drop the model.attn override, or fine-tune into it with "
                r"model.pretrained_strict=false")


@pytest.mark.parametrize("attn", ["softmax1", "kv_bias", "attn_bias"])
def test_strict_hub_weights_of_another_attention_function_are_refused(hub, attn):
    # softmax1 adds no parameter: only the attention function tells it from the weights' softmax
    with pytest.raises(ModelError, match=SOFTMAX_ONLY.format(attn=attn)):
        build_model(model_cfg("model.pretrained=hub", "model.pretrained_strict=true", f"model.attn={attn}"))


def test_evaluate_py_refuses_hub_weights_under_another_attention_function_in_one_error_line(hub, tmp_path, capsys):
    out = tmp_path / "e.json"
    code, _, err = run_entry("evaluate.py", [
        "--config", DEBUG_CONFIG, f"model.name={NAME}", "model.pretrained=hub", "model.num_classes=1000",
        "model.img_size=32", "model.attn=softmax1", "--quant", "--out", str(out)], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and not any("Traceback" in line for line in lines), err
    assert lines[-1].startswith(f"error: model.pretrained=hub ({NAME}): "), lines[-1]
    assert re.search(SOFTMAX_ONLY.format(attn="softmax1"), lines[-1]), lines[-1]
    assert not out.exists()


def test_fine_tuning_hub_weights_into_softmax1_logs_the_change_of_function(hub, caplog):
    with caplog.at_level(logging.INFO):
        model = build_model(model_cfg("model.pretrained=hub", "model.num_classes=10", "model.img_size=32",
                                      "model.attn=softmax1"))
    lines = [r.getMessage() for r in caplog.records if "softmax attention is computed as" in r.getMessage()]
    assert lines == [f"model.pretrained=hub ({NAME}): the weights' softmax attention is computed as "
                     f"model.attn=softmax1 (another function, which fine-tuning adapts them to)"], caplog.text
    # the weights are loaded all the same (no parameter of softmax1's own), and the function is another: a
    # reference softmax model of the same weights gives other outputs
    plain = build_model(load_config(None, ["model.name=vit_tiny_patch16_224", "model.num_classes=10",
                                           "model.img_size=32"]).model)
    plain.load_state_dict(model.state_dict())
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(model.eval()(x), plain.eval()(x), atol=1e-4)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in hub.items()
               if not k.startswith("head.") and k != "pos_embed")


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
    assert all(torch.equal(loaded[k], v) for k, v in hub.items()
               if not k.startswith("head.") and k != "pos_embed")
