"""A weights file torch's weights-only reader refuses is named with advice a user can follow (timm's own, 'retry
with weights_only=False', is no setting of model.pretrained), and following it loads the weights."""
import fractions
import os

import pytest
import torch
from safetensors.torch import save_file

from configs.schema import ModelConfig
from models import ModelError, build_model


def weights() -> dict:
    torch.manual_seed(0)
    return build_model(ModelConfig(name="vit_nano", num_classes=10)).state_dict()


def load(path) -> dict:
    return build_model(ModelConfig(name="vit_nano", num_classes=10, pretrained=str(path),
                                   pretrained_strict=True)).state_dict()


def test_a_safetensors_file_named_pth_is_named_as_such_and_loads_under_its_own_extension(tmp_path):
    source = weights()
    path = tmp_path / "w.pth"
    save_file(source, path)
    with pytest.raises(ModelError) as refused:
        load(path)
    message = str(refused.value)
    assert message == (f"model.pretrained={path} is a safetensors file under another name, which torch's reader "
                       f"cannot read: give it the .safetensors extension"), message
    os.rename(path, tmp_path / "w.safetensors")  # the advice, followed
    loaded = load(tmp_path / "w.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in source.items())


def test_a_file_with_python_objects_beside_its_tensors_names_them_and_how_to_save_the_weights_alone(tmp_path):
    source = weights()
    path = tmp_path / "run.pth"
    torch.save({"model": source, "ratio": fractions.Fraction(1, 2)}, path)
    with pytest.raises(ModelError) as refused:
        load(path)
    message = str(refused.value)
    assert message.startswith(f"model.pretrained={path} holds Python objects beside its tensors "
                              f"(fractions.Fraction) that weights-only loading refuses") and "\n" not in message
    assert "retry with weights_only" not in message, message
    torch.save(torch.load(path, weights_only=False)["model"], tmp_path / "alone.pth")  # the advice, followed
    loaded = load(tmp_path / "alone.pth")
    assert all(torch.equal(loaded[k], v) for k, v in source.items())
