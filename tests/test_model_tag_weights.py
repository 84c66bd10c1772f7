"""A pretrained tag in model.name (timm's NAME.TAG) names hub weights: without model.pretrained the run would start
from random init under the weights' name, so the config is refused where it is loaded; with model.pretrained=hub or a
local file of those weights (the shipped fine-tuning recipe's documented use) it loads, and a model built without
model.pretrained to take a checkpoint's weights (a resumed run, an evaluated checkpoint) still builds."""
import dataclasses

import pytest
import timm
import torch

from configs import ConfigError, load_config
from models import build_model
from tests.conftest import DEBUG_CONFIG, run_entry

NAME = "vit_tiny_patch16_224.augreg_in21k"


def test_a_tag_without_model_pretrained_is_one_error_line_and_nothing_trains(tmp_path, capsys):
    assert NAME in timm.list_pretrained("vit_tiny_patch16_224.*")  # a tag of timm's hub weights
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"model.name={NAME}", "train.max_steps=1",
                                          f"out_dir={tmp_path / 'run'}"], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: model.name={NAME}: the tag 'augreg_in21k' selects hub weights"), err
    assert "set model.pretrained=hub" in err and "drop the tag (model.name=vit_tiny_patch16_224)" in err, err
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


@pytest.mark.parametrize("weights", ["hub", "/weights/vit_base_patch16_224.orig_in21k.safetensors"])
def test_a_tag_with_hub_weights_or_a_local_file_of_them_loads(weights):
    cfg = load_config(["configs/finetune/vit_b_in21k.yaml"], [f"model.pretrained={weights}"])
    assert cfg.model.name == "vit_base_patch16_224.orig_in21k" and cfg.model.pretrained == weights
    with pytest.raises(ConfigError, match=r"selects hub weights, but model.pretrained is empty"):
        load_config(["configs/finetune/vit_b_in21k.yaml"], ["model.pretrained="])


def test_a_tagged_model_built_for_a_checkpoints_weights_builds():
    """train.py's resume and evaluate.py build the model without model.pretrained and load their own weights."""
    cfg = load_config(None, [f"model.name={NAME}", "model.pretrained=hub", "model.num_classes=10"]).model
    with torch.device("meta"):
        model = build_model(dataclasses.replace(cfg, pretrained=""))
        reference = timm.create_model(NAME, num_classes=10)
    shapes = [{k: v.shape for k, v in m.state_dict().items()} for m in (model, reference)]
    assert shapes[0] == shapes[1]
