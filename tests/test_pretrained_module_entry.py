"""DeepSpeed's checkpoint layout, {'module': state dict}, in which the official EVA / EVA-02 weights come, loads as
timm's EVA conversion reads it (timm/models/eva.py: state_dict.get('module', state_dict)); a file with no state dict
anywhere names 'module' among the places looked in."""
import pytest
import timm
import torch

from configs.schema import ModelConfig
from models import ModelError, build_model

EVA = dict(name="eva02_tiny_patch14_224", num_classes=10, img_size=28)


def assert_loaded(model, source: dict) -> None:
    """Every tensor of the model is the file's of that name (the file holds the model's own layout)."""
    own = model.state_dict()
    assert set(own) <= set(source)
    for key, value in own.items():
        assert torch.equal(value, source[key]), key


@pytest.mark.parametrize("beside", [{}, {"epoch": 3, "global_steps": 100}])
def test_an_eva_checkpoint_under_module_loads(tmp_path, beside):
    """The reviewer's file: refused before as holding no state dict. Entries DeepSpeed writes beside the weights
    (epoch, steps) are no weights."""
    source = timm.create_model("eva02_tiny_patch14_224", num_classes=10, img_size=28).state_dict()
    path = tmp_path / "eva.pt"
    torch.save({"module": source, **beside}, path)
    for strict in (False, True):
        assert_loaded(build_model(ModelConfig(**EVA, pretrained=str(path), pretrained_strict=strict)), source)


def test_a_vit_under_module_with_ddp_prefixes_loads(tmp_path):
    """The state dict under 'module' may carry DDP's 'module.' prefixes of its own, stripped as timm strips them
    from a file's top level; a file under 'model' then 'module' is unwrapped too."""
    source = build_model(ModelConfig(name="vit_nano", num_classes=4)).state_dict()
    for n, payload in enumerate([{"module": {f"module.{k}": v for k, v in source.items()}},
                                 {"model": {"module": source}}]):
        path = tmp_path / f"vit{n}.pth"
        torch.save(payload, path)
        assert_loaded(build_model(ModelConfig(name="vit_nano", num_classes=4, pretrained=str(path),
                                              pretrained_strict=True)), source)


@pytest.mark.parametrize("payload", [{"module": {"a": 1}}, {"module": [1, 2]}, {"module": {}}, {"epoch": 3}])
def test_a_file_without_a_state_dict_names_module_among_the_places_looked_in(tmp_path, payload):
    """A 'module' entry that holds no tensors is no state dict: the one-line refusal names every entry it looked
    under."""
    path = tmp_path / "x.pth"
    torch.save(payload, path)
    with pytest.raises(ModelError) as refused:
        build_model(ModelConfig(name="vit_nano", num_classes=4, pretrained=str(path)))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"model.pretrained={path} holds no state dict"), message
    assert "'model' / 'state_dict' / 'module'" in message, message
