"""model.kwargs values timm's constructors cannot build with, or would read as another value: one error line each,
naming the entries to check, through build_model and train.py / evaluate.py."""
import pytest
import torch

from configs import load_config
from models import ModelError, build_model
from tests.conftest import DEBUG_CONFIG, run_entry

# (overrides, what the reason must name): a name timm looks up (KeyError), a per-stage list shorter than Swin's
# stages (IndexError), a bare assert of timm's (no message), torch's multi-line message of fill_()
REFUSED = [
    (["model.kwargs.act_layer=nonexistent"], "act_layer", "KeyError: 'nonexistent'"),
    (["model.name=swin_nano", "model.kwargs.num_heads=[2]"], "num_heads", "IndexError"),
    (["model.kwargs.pos_embed=bogus"], "pos_embed", "AssertionError"),
    (["model.kwargs.init_values=a"], "init_values", "fill_()"),
]


def model_cfg(*overrides):
    return load_config(DEBUG_CONFIG, list(overrides)).model


def refusal(*overrides) -> str:
    with pytest.raises(ModelError) as info:
        build_model(model_cfg(*overrides))
    return str(info.value)


@pytest.mark.parametrize("overrides, key, reason", REFUSED)
def test_a_value_timm_cannot_build_with_is_one_line_naming_the_reason_and_the_entry(overrides, key, reason):
    message = refusal(*overrides)
    assert "\n" not in message, message
    head, _, tail = message.partition(" rejected its arguments ")
    assert head.startswith("model '") and tail, message
    assert reason in tail.rpartition("}: ")[2], message
    module = "swin_transformer" if "swin" in head else "vision_transformer"
    assert message.endswith(f"; check model.kwargs.{key} against the model's constructor (timm.models.{module})"), \
        message


def test_an_unknown_argument_keeps_pythons_message_and_names_the_entry():
    message = refusal("model.kwargs.depht=3")
    assert "unexpected keyword argument 'depht'" in message
    assert "check model.kwargs.depht against the model's constructor" in message


@pytest.mark.parametrize("overrides, key, reason", REFUSED[:2])
def test_train_py_refuses_them_with_one_error_line(overrides, key, reason, tmp_path, capsys):
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={tmp_path / 'run'}", *overrides],
                             capsys)
    assert code == 1 and err.startswith("error: model '") and err.count("\n") == 1, err
    assert reason in err and f"model.kwargs.{key}" in err, err


# (overrides, the switch, whether a model has it off): timm's ViT / Swin take these as true/false; fc_norm's default
# is None (Optional[bool]); global_pool is a text argument, which still builds
TEXT_SWITCHES = [
    (['model.kwargs.qkv_bias="false"'], "qkv_bias", lambda m: all(b.attn.qkv.bias is None for b in m.blocks)),
    (["model.name=swin_nano", 'model.kwargs.qkv_bias="false"'], "qkv_bias",
     lambda m: all(b.attn.qkv.bias is None for layer in m.layers for b in layer.blocks)),
    (['model.kwargs.class_token="no"', "model.kwargs.global_pool=avg"], "class_token",
     lambda m: m.cls_token is None and m.global_pool == "avg"),
    (['model.kwargs.fc_norm="off"'], "fc_norm", lambda m: isinstance(m.fc_norm, torch.nn.Identity)),
]


@pytest.mark.parametrize("overrides, key, off", TEXT_SWITCHES)
def test_a_text_for_a_true_false_argument_is_refused_and_the_value_it_names_builds_the_switch_off(overrides, key, off):
    cfg = model_cfg(*overrides)
    assert isinstance(cfg.kwargs[key], str)  # the config keeps the text: Python would read it as true
    message = refusal(*overrides)
    assert message.startswith(f"model.kwargs.{key}=") and "give true or false unquoted" in message, message
    fix = message.rpartition("(")[2].rstrip(")")
    assert fix == f"model.kwargs.{key}=false", message
    model = build_model(model_cfg(*[fix if item.startswith(f"model.kwargs.{key}=") else item for item in overrides]))
    assert off(model)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 32, 32)).shape == (1, 4)


def test_a_text_switch_of_the_base_class_of_a_subclass_taking_any_arguments_is_refused():
    """LeViT's LevitDistilled.__init__(*args, **kwargs) hands use_conv (a bool of Levit.__init__) on: "yes" built
    the convolutional variant, as would "no"."""
    message = refusal("model.name=levit_128s", 'model.kwargs.use_conv="no"')
    assert message.startswith("model.kwargs.use_conv='no': a text for LevitDistilled's true/false argument"), message
    assert message.endswith("(model.kwargs.use_conv=false)"), message


def test_train_and_evaluate_refuse_a_text_switch_with_one_error_line(tmp_path, capsys):
    weights = tmp_path / "w.pt"
    torch.save({}, weights)
    out = tmp_path / "r.json"
    runs = {"train.py": ["--config", DEBUG_CONFIG, f"out_dir={tmp_path / 'run'}", 'model.kwargs.qkv_bias="false"'],
            "evaluate.py": ["--config", DEBUG_CONFIG, f"model.pretrained={weights}", 'model.kwargs.qkv_bias="false"',
                            "--out", str(out)]}
    for script, argv in runs.items():
        code, _, err = run_entry(script, argv, capsys)
        assert code == 1 and err.startswith("error: model.kwargs.qkv_bias='false'") and err.count("\n") == 1, \
            (script, err)
    assert not out.exists() and not (tmp_path / "run" / "checkpoint.pt").exists()
