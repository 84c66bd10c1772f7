"""A file's classifier of another shape than the model's, whatever dimension differs (outputs or input width), is
replaced as a whole when fine-tuning (weight and bias: the file's bias beside a new weight is no classifier) and
refused when strict with a line naming what differs; the model.num_classes advice only where it would load it."""
import logging

import pytest
import torch

from configs.schema import ModelConfig
from models import ModelError, build_model


def save_with_head(tmp_path, name: str, num_classes: int, shapes: dict) -> tuple[str, dict]:
    """A file of `name`'s weights whose classifier keys get random tensors of `shapes` (key -> shape)."""
    torch.manual_seed(0)
    state = dict(build_model(ModelConfig(name=name, num_classes=num_classes)).state_dict())
    state.update({k: torch.randn(shape) for k, shape in shapes.items()})
    path = str(tmp_path / "head.pth")
    torch.save(state, path)
    return path, state


@pytest.mark.parametrize("name, head, shapes", [
    ("vit_nano", "head.", {"head.weight": (7, 5), "head.bias": (7,)}),  # another input width
    ("vit_nano", "head.", {"head.weight": (7, 32), "head.bias": (5,)}),  # a bias of another size
    ("vit_nano", "head.", {"head.weight": (5, 32), "head.bias": (5,)}),  # another number of classes
    ("swin_nano", "head.fc.", {"head.fc.weight": (7, 3), "head.fc.bias": (7,)}),
])
def test_fine_tuning_replaces_the_whole_classifier_and_keeps_the_rest(tmp_path, caplog, name, head, shapes):
    path, state = save_with_head(tmp_path, name, 7, shapes)
    fresh = build_model(ModelConfig(name=name, num_classes=7)).state_dict()
    with caplog.at_level(logging.INFO, logger="models.pretrained"):
        model = build_model(ModelConfig(name=name, num_classes=7, pretrained=path))
    for key, value in model.state_dict().items():
        if key.startswith(head):  # a new classifier: none of the file's tensors, also those of the model's shape
            assert value.shape == fresh[key].shape, key
            assert value.shape != state[key].shape or not torch.equal(value, state[key]), key
        else:
            assert torch.equal(value, state[key]), key
    assert f"(new classifier: {head}weight, {head}bias)" in caplog.text, caplog.text


def test_strict_names_an_input_width_that_differs_and_gives_no_impossible_advice(tmp_path):
    path, _ = save_with_head(tmp_path, "vit_nano", 7, {"head.weight": (7, 5)})
    with pytest.raises(ModelError) as refused:
        build_model(ModelConfig(name="vit_nano", num_classes=7, pretrained=path, pretrained_strict=True))
    message = str(refused.value)
    assert "'head.weight' has shape (7, 5), the model expects (7, 32)" in message and "\n" not in message
    assert "set model.num_classes" not in message and "other features" in message


def test_strict_names_a_bias_that_disagrees_with_its_weight(tmp_path):
    path, _ = save_with_head(tmp_path, "vit_nano", 7, {"head.bias": (5,)})
    with pytest.raises(ModelError) as refused:
        build_model(ModelConfig(name="vit_nano", num_classes=7, pretrained=path, pretrained_strict=True))
    message = str(refused.value)
    assert "'head.bias' has shape (5,), the model expects (7,)" in message
    assert "set model.num_classes" not in message and "(5, 7)" in message


def test_strict_advises_the_number_of_classes_that_loads_the_file_and_it_does(tmp_path):
    path, state = save_with_head(tmp_path, "vit_nano", 7, {"head.weight": (5, 32), "head.bias": (5,)})
    with pytest.raises(ModelError, match=r"'head.weight' has 5 outputs, model.num_classes=7: set "
                                         r"model.num_classes=5 to use it as it is"):
        build_model(ModelConfig(name="vit_nano", num_classes=7, pretrained=path, pretrained_strict=True))
    model = build_model(ModelConfig(name="vit_nano", num_classes=5, pretrained=path, pretrained_strict=True))
    assert torch.equal(model.head.weight.detach(), state["head.weight"])
