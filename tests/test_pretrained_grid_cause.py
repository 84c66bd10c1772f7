"""A file's position table of another grid is resampled to the model's, and the log line names the cause: the grid
is the image side over the patch side, so a file of another patch size at the same img_size has another grid too,
which was put down to another img_size."""
import logging

import pytest
import torch

from configs import load_config
from models import build_model


def nano(*overrides):
    return load_config(None, ["model.name=vit_nano", "model.num_classes=4", *overrides]).model


@pytest.mark.parametrize("file, cause", [
    # 32 / 4 = 8 patches a side in the file, 32 / 8 = 4 in vit_nano: the same pixels
    (["model.kwargs.patch_size=4"], "8x8 grid resampled to the model's 4x4 (timm's bicubic resize; the weights were "
                                    "trained with another patch size, 4x4, than the model's 8x8, at the same img_size "
                                    "(32 pixels))"),
    # 16 / 8 = 2 patches a side: the patch size is vit_nano's
    (["model.img_size=16"], "2x2 grid resampled to the model's 4x4 (timm's bicubic resize; the weights were trained "
                            "at another img_size than model.img_size)"),
    # 48 / 4 = 12 patches a side: both differ
    (["model.kwargs.patch_size=4", "model.img_size=48"],
     "12x12 grid resampled to the model's 4x4 (timm's bicubic resize; the weights were trained with another patch "
     "size, 4x4, than the model's 8x8, and at another img_size (48 pixels) than the model's (32))"),
], ids=["patch_size", "img_size", "both"])
def test_the_resampled_tables_line_names_the_patch_size_when_it_is_the_cause(file, cause, tmp_path, caplog):
    torch.save(build_model(nano(*file)).state_dict(), tmp_path / "w.pth")
    with caplog.at_level(logging.WARNING, logger="models.pretrained"):
        model = build_model(nano(f"model.pretrained={tmp_path / 'w.pth'}"))
    lines = [r.getMessage() for r in caplog.records if "position table" in r.getMessage()]
    assert lines == [f"{tmp_path / 'w.pth'}: position table of a {cause}"], caplog.text
    assert model.pretrained_resampled == {"pos_embed_resampled": cause.split(" grid resampled")[0] + "->4x4"}
