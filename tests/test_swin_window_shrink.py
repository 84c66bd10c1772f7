"""Swin weights trained at a larger img_size loaded into a model at a smaller one: timm shrinks a late stage's
window to its feature map, so that stage's relative position bias tables are resampled although the model's
window_size is the file's. The log line names that cause (model.img_size), not model.kwargs.window_size."""
import logging

import torch
from timm.layers import resize_rel_pos_bias_table

from configs.schema import ModelConfig
from models import build_model

TABLE = "layers.{}.blocks.0.attn.relative_position_bias_table"


def test_a_window_shrunk_to_the_feature_map_names_img_size_not_window_size(tmp_path, caplog):
    """swin_nano (windows of 4, patches of 4) at 16 pixels: stage 0's feature map is 16 / 4 = 4, stage 1's after
    one patch merging 2, so stage 1's window is 2x2 where the 32-pixel file's is 4x4."""
    torch.manual_seed(0)
    source = build_model(ModelConfig(name="swin_nano", num_classes=10)).state_dict()
    torch.save(source, tmp_path / "at32.pth")
    with caplog.at_level(logging.WARNING):
        model = build_model(ModelConfig(name="swin_nano", num_classes=10, img_size=16,
                                        pretrained=str(tmp_path / "at32.pth"), pretrained_strict=True))
    assert ("relative position bias tables of 1 attention layer(s) (e.g. 'layers.1.blocks.0.attn."
            "relative_position_bias_table') of 4x4 windows resampled to the model's 2x2 (timm's resize; timm shrinks "
            "a window to its stage's feature map, 2x2 at an input of 16x16 pixels (model.img_size): the weights were "
            "trained at a larger img_size)") in caplog.text, caplog.text
    assert "window_size" not in caplog.text
    loaded = model.state_dict()
    assert torch.equal(loaded[TABLE.format(0)], source[TABLE.format(0)])  # stage 0 keeps the file's 4x4 window
    expected = resize_rel_pos_bias_table(source[TABLE.format(1)], new_window_size=(2, 2), new_bias_shape=(9, 4))
    assert torch.allclose(loaded[TABLE.format(1)], expected)  # timm's resize of the file's own table
    assert model.pretrained_resampled == {"relative_position_bias_resampled": "4x4->2x2"}


def test_another_window_size_and_a_shrunk_window_are_each_named(tmp_path, caplog):
    """At 16 pixels with windows of 2: stage 0 (feature map 4) has the window the setting gives, stage 1 (feature
    map 2) a window shrunk to its map; each table is named with its own cause."""
    torch.save(build_model(ModelConfig(name="swin_nano", num_classes=10)).state_dict(), tmp_path / "at32.pth")
    with caplog.at_level(logging.WARNING):
        build_model(ModelConfig(name="swin_nano", num_classes=10, img_size=16, kwargs={"window_size": 2},
                                pretrained=str(tmp_path / "at32.pth")))
    assert (f"of 1 attention layer(s) (e.g. '{TABLE.format(0)}') of 4x4 windows resampled to the model's 2x2 "
            "(timm's resize; the weights were trained with another window size than the model's, "
            "model.kwargs.window_size)") in caplog.text, caplog.text
    assert (f"of 1 attention layer(s) (e.g. '{TABLE.format(1)}') of 4x4 windows resampled to the model's 2x2 "
            "(timm's resize; timm shrinks a window to its stage's feature map, 2x2") in caplog.text, caplog.text
