"""model.kwargs entries of a GPT (models/gpt.py) that a model.* setting gives are refused in one line naming that
setting, as the vision models' timm arguments are (tests/test_model_timm_args.py): build_gpt takes its name,
vocabulary and dropout from model.name, model.num_classes and model.drop, and the same keys in model.kwargs gave
a passed-through TypeError ("got multiple values for keyword argument 'drop'") that named no fix."""
import inspect

import pytest

from configs.schema import ModelConfig
from models import ModelError, build_model
from models.gpt import GPT, GPT_SIZES, build_gpt
from tests.conftest import run_entry

# written here from ModelConfig's fields, not read off models/factory.py's table
OWN_KEY = {"name": "model.name", "vocab_size": "model.num_classes", "drop": "model.drop",
           "num_classes": "model.num_classes", "pretrained": "model.pretrained", "checkpoint_path": "model.pretrained"}


def test_every_argument_build_gpt_takes_from_model_config_has_its_own_key_named():
    """build_gpt's named parameters are the ones build_model fills from ModelConfig: a new one belongs in OWN_KEY."""
    named = {name for name, p in inspect.signature(build_gpt).parameters.items() if p.kind != p.VAR_KEYWORD}
    assert named == {"name", "vocab_size", "drop"} and named <= set(OWN_KEY)


@pytest.mark.parametrize("key, value", [("name", "gpt2_micro"), ("vocab_size", 100), ("drop", 0.2),
                                        ("num_classes", 100), ("pretrained", "gpt2.pt"), ("checkpoint_path", "w.pt")])
def test_a_model_config_setting_given_as_a_gpt_kwarg_names_the_setting_in_one_line(key, value):
    with pytest.raises(ModelError) as refused:
        build_model(ModelConfig(name="gpt2_nano", num_classes=65, drop_path=0.0, kwargs={key: value}))
    message = str(refused.value)
    assert message == f"model.kwargs.{key}: set {OWN_KEY[key]} instead (the model's own key for it)", message


def test_the_gpt_constructor_arguments_without_a_setting_still_build_the_model_they_name():
    """depth, num_heads, embed_dim, context, bias and gelu stay model.kwargs; the settings still reach the model."""
    kwargs = {"depth": 3, "num_heads": 4, "embed_dim": 48, "context": 16, "bias": False, "gelu": "tanh"}
    assert set(kwargs) == set(inspect.signature(GPT).parameters) - {"vocab_size", "drop"}  # every other one
    model = build_model(ModelConfig(name="gpt2_nano", num_classes=70, drop=0.1, drop_path=0.0, kwargs=kwargs))
    assert len(model.blocks) == 3 and model.context == 16 and model.wte.weight.shape == (70, 48)
    assert model.blocks[0].attn.num_heads == 4 and model.drop.p == 0.1
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())
    assert GPT_SIZES["gpt2_nano"]["depth"] != 3  # the override is what was built, not the size's own


@pytest.mark.parametrize("override, says", [("model.kwargs.drop=0.2", "set model.drop instead"),
                                             ("model.kwargs.vocab_size=100", "set model.num_classes instead")])
def test_train_refuses_a_setting_given_as_a_gpt_kwarg_in_one_line_before_training(tmp_path, capsys, override, says):
    code, _, err = run_entry("train.py", ["--config", "configs/lm/kjv_nano.yaml", f"out_dir={tmp_path / 'run'}",
                                          override], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: {override.split('=')[0]}: {says}"), err
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
