"""model.img_size null is the model's own input size: a run resumed (or re-run) with the size written out
(vit_nano's 32) continues the same model, where it was refused as `model.img_size: None -> 32`; another size is
still another model."""
import pytest

import train
from configs import load_config
from engine.checkpoint import CheckpointError
from models import VARIANTS
from models.factory import own_img_size


@pytest.mark.parametrize("first, then", [([], ["model.img_size=32"]), (["model.img_size=32"], [])],
                         ids=["null_then_32", "32_then_null"])
def test_a_run_continues_with_its_models_own_img_size_written_out_or_left_null(first, then, debug_config):
    assert VARIANTS["vit_nano"]["img_size"] == 32  # the debug config's model
    train.main(debug_config(*first, "train.max_steps=1", name="r"))
    result = train.main(debug_config(*then, "train.max_steps=2", name="r"))  # no train.allow_changed_config
    assert result.state.step == 2 and result.reason == "max_steps"


def test_another_img_size_is_still_another_model(debug_config):
    train.main(debug_config("train.max_steps=1", name="o"))
    with pytest.raises(CheckpointError, match=r"other settings \(model.img_size: None -> 64\)"):
        train.main(debug_config("model.img_size=64", "train.max_steps=2", "train.allow_changed_config=true", name="o"))


@pytest.mark.parametrize("name, size", [("vit_nano", 32), ("swin_nano", 32), ("vit_tiny_patch16_224", 224),
                                        ("vit_base_patch16_384", 384), ("gpt2_nano", None)])
def test_a_models_own_img_size_is_its_variants_or_timms_default(name, size):
    """The sizes in the names (timm) and in models/variants.py; a language model has none."""
    assert own_img_size(load_config(None, [f"model.name={name}", "model.img_size=16"]
                                    if size else [f"model.name={name}"]).model) == size
