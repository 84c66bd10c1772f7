"""RepQ-ViT's round_zero_point is read only by the LayerNorm fold (quant/reparam.py fold_layernorm): with
reparam=false nothing reads it, so a value given for it is refused instead of being recorded as a setting."""
import pytest

from configs import load_config
from configs.loader import ConfigError


def test_round_zero_point_over_a_recipe_without_the_fold_is_refused(tmp_path):
    recipe = tmp_path / "no_fold.yaml"
    recipe.write_text("quant:\n  repq:\n    reparam: false\n")
    with pytest.raises(ConfigError, match=r"quant\.repq\.round_zero_point=true would be ignored: .*quant\.repq\.reparam"):
        load_config([str(recipe)], ["quant.repq.round_zero_point=true"])
    assert load_config([str(recipe)], ["quant.repq.reparam=true", "quant.repq.round_zero_point=true"]).quant.repq.reparam
