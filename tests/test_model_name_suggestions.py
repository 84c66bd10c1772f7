"""An unknown model.name is refused with the names nearest to it among all model.name takes: timm's models, the
variants of models/variants.py and the GPT sizes of models/gpt.py."""
import pytest

from configs.schema import ModelConfig
from models import ModelError, build_model


@pytest.mark.parametrize("typo, meant", [("vit_nan", "vit_nano"), ("swin_nan", "swin_nano"),
                                         ("gpt2_nan", "gpt2_nano"), ("gpt2_mediun", "gpt2_medium"),
                                         ("vit_tiny_patch16_2244", "vit_tiny_patch16_224")])
def test_the_nearest_name_is_suggested_first_whether_timms_or_the_repositorys(typo, meant):
    """Each typo is one letter off the name meant (vit_nan suggested davit_giant and convnext_nano, timm's names
    alone, not the vit_nano variant)."""
    with pytest.raises(ModelError) as refused:
        build_model(ModelConfig(name=typo, num_classes=10, drop_path=0.0))
    message = str(refused.value)
    assert message.startswith(f"unknown model '{typo}'") and "\n" not in message, message
    assert f"; names like it: {meant}" in message, message
