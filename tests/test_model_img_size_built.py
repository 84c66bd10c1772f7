"""model.img_size is the size the loaders give the model's images (input_size): a timm family that records the size
its input embedding was built for under another name than patch_embed.img_size is sized by it, and one that keeps
no record of it (or rescales it per branch to no whole patches) is refused, never fed timm's default size."""
import pytest
import torch

from configs import load_config
from models import ModelError, build_model, input_size


def model_cfg(*overrides):
    return load_config(None, ["model.drop_path=0", "model.num_classes=3", *overrides]).model


# small builds of the families: MLP-Mixer's S/16 (its stem, a PatchEmbed named `stem`), CoaT-Lite Tiny (its
# patch_embed1), EfficientViT-MSRA m0 (its own img_size, one int)
@pytest.mark.parametrize("name", ["mixer_s16_224", "coat_lite_tiny", "efficientvit_m0"])
def test_a_family_recording_its_size_elsewhere_is_sized_by_model_img_size_and_runs_at_it(name):
    model = build_model(model_cfg(f"model.name={name}", "model.img_size=64")).eval()
    assert input_size(model) == 64
    with torch.no_grad():  # the size it was built for: an input of it runs (timm's default, 224, need not)
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3)


def test_a_family_keeping_no_record_of_its_size_is_refused_in_one_line_and_builds_without_it():
    with torch.device("meta"):  # the same setting where the patch embedding is built for it (ViT, DeiT, Swin, EVA)
        assert input_size(build_model(model_cfg("model.name=deit_tiny_patch16_224", "model.img_size=64"))) == 64
    with torch.device("meta"), pytest.raises(ModelError) as refused:
        build_model(model_cfg("model.name=levit_128s", "model.img_size=64"))
    message = str(refused.value)
    assert message.startswith("model.img_size=64: model 'levit_128s' (levit_128s, timm's LevitDistilled) keeps no "
                              "record of the input size it was built for") and "\n" not in message, message
    assert "leave model.img_size unset (the model's own 224)" in message, message
    with torch.device("meta"):  # the fix, followed: the model's own size, which timm gives the family
        model = build_model(model_cfg("model.name=levit_128s"))
    assert input_size(model) == model.pretrained_cfg["input_size"][-1] == 224


def test_a_family_ignoring_img_size_is_refused():
    """EfficientFormer takes img_size and drops it: its size is timm's default whatever was asked."""
    with torch.device("meta"), pytest.raises(ModelError, match=r"^model\.img_size=96: model 'efficientformer_l1'"):
        build_model(model_cfg("model.name=efficientformer_l1", "model.img_size=96"))


def test_crossvit_branches_of_no_whole_patches_are_refused_and_a_size_whose_branches_fit_builds():
    # crossvit_tiny_240's second branch sees the input scaled by 224/240 in patches of 16: 96 -> 89 pixels
    with torch.device("meta"), pytest.raises(ModelError) as refused:
        build_model(model_cfg("model.name=crossvit_tiny_240", "model.img_size=96"))
    assert str(refused.value).startswith("model.img_size=96: model 'crossvit_tiny_240' (crossvit_tiny_240) rescales "
                                         "the input to 89 pixels for its branch 1, not a whole number of its "
                                         "patches of 16"), refused.value
    with torch.device("meta"):  # 480 -> 480 (patches of 12) and 448 (patches of 16)
        model = build_model(model_cfg("model.name=crossvit_tiny_240", "model.img_size=480"))
    assert input_size(model) == 480

