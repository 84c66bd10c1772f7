"""Weights of another architecture than the model's are one error line naming what differs, not a traceback from
inside timm's conversion: a position table of another rank."""
import pytest
import torch

from configs.schema import ModelConfig
from models import ModelError, build_model


@pytest.mark.parametrize("shape", [(), (17, 32), (1, 1, 17, 32)])
def test_a_position_table_of_another_rank_is_the_shape_error(tmp_path, shape):
    """A scalar pos_embed ended in an IndexError (its token count read before any rank check); a table of another
    rank reached timm's resample and was named as another token layout."""
    state = build_model(ModelConfig(name="vit_nano", num_classes=10)).state_dict()
    expected = tuple(state["pos_embed"].shape)
    state["pos_embed"] = torch.zeros(shape)
    path = tmp_path / "vit.pth"
    torch.save(state, path)
    with pytest.raises(ModelError) as refused:
        build_model(ModelConfig(name="vit_nano", num_classes=10, pretrained=str(path)))
    assert str(refused.value) == (f"{path}: 'pos_embed' has shape {shape}, the model expects {expected}: a "
                                  f"checkpoint of another model?")
