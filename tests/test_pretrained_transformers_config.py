"""transformers' GPT-2 weights (save_pretrained: model.safetensors beside config.json) load only into the GPT their
config.json records: another head count or GELU has the same shapes and loaded without a word as another function.
The reference is transformers' own GPT2LMHeadModel: with the settings the error names, its logits are reproduced."""
import json

import pytest
import torch

from configs.schema import ModelConfig
from models import ModelError, build_model

transformers = pytest.importorskip("transformers")

NANO = dict(vocab_size=65, n_positions=32, n_embd=32, n_layer=2, n_head=2)  # gpt2_nano's size


def saved_gpt2(folder, **fields) -> tuple:
    """(the weights file transformers' save_pretrained wrote to `folder`, the model it holds): a GPT2LMHeadModel of
    gpt2_nano's size with `fields` of GPT2Config changed, every parameter moved off its init (norms, biases)."""
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**NANO, **fields})).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.1 * torch.randn_like(p))
    reference.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "gpt2"
    return str(folder / "model.safetensors"), reference


def gpt(path, **kwargs):
    return build_model(ModelConfig(name="gpt2_nano", num_classes=65, drop_path=0.0, kwargs=kwargs,
                                   pretrained=path)).eval()


def assert_same_logits(ours, reference, vocab=65):
    ids = torch.randint(0, vocab, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_the_reviewers_file_of_four_heads_and_gelu_new_is_refused_naming_both_settings(tmp_path):
    """n_head=4 and GPT2Config's default GELU (gelu_new, the tanh approximation) into gpt2_nano (2 heads, exact
    GELU): one line naming both fields and the settings; with those settings transformers' logits come out."""
    path, reference = saved_gpt2(tmp_path, n_head=4)
    assert reference.config.activation_function == "gelu_new"
    with pytest.raises(ModelError, match=r"^model.pretrained=.*model.safetensors: its config.json beside it "
                                         r"\(transformers' GPT-2\) records n_head=4 and activation_function=gelu_new, "
                                         r"the model has 2 and exact: set model.kwargs.num_heads=4 "
                                         r"model.kwargs.gelu=tanh to load it as it was trained$"):
        gpt(path)
    assert_same_logits(gpt(path, num_heads=4, gelu="tanh"), reference)


@pytest.mark.parametrize("fields, kwargs, named, fix", [
    (dict(n_layer=3), {"gelu": "tanh"}, "n_layer=3, the model has 2: set model.kwargs.depth=3", {"depth": 3}),
    (dict(n_embd=64), {"gelu": "tanh"}, "n_embd=64, the model has 32: set model.kwargs.embed_dim=64",
     {"embed_dim": 64}),
    (dict(n_positions=64), {"gelu": "tanh"}, "n_positions=64, the model has 32: set model.kwargs.context=64",
     {"context": 64}),
    (dict(activation_function="gelu"), {"gelu": "tanh"}, "activation_function=gelu, the model has tanh: "
                                                         "set model.kwargs.gelu=exact", {"gelu": "exact"})])
def test_each_size_and_the_gelu_name_the_setting_that_reproduces_transformers_logits(tmp_path, fields, kwargs,
                                                                                    named, fix):
    """Each field of the architecture names its setting; built with it (the GELU: gelu_new is tanh, gelu the exact
    one), the model gives transformers' logits."""
    path, reference = saved_gpt2(tmp_path, **fields)
    with pytest.raises(ModelError, match=rf"records {named} to load it as it was trained$"):
        gpt(path, **kwargs)
    assert_same_logits(gpt(path, **{**kwargs, **fix}), reference)


@pytest.mark.parametrize("fields, named", [(dict(activation_function="relu"), "activation_function=relu"),
                                           (dict(layer_norm_epsilon=1e-6), "layer_norm_epsilon=1e-06"),
                                           (dict(scale_attn_by_inverse_layer_idx=True),
                                            "scale_attn_by_inverse_layer_idx=True")])
def test_a_field_no_setting_builds_is_refused_as_such(tmp_path, fields, named):
    """An activation of neither GELU, another LayerNorm epsilon, attention scaled by the layer index: no setting of
    models/gpt.py builds the function, so no setting is advised."""
    path, _ = saved_gpt2(tmp_path, **fields)
    with pytest.raises(ModelError, match=rf"records {named}, which no setting of models/gpt.py builds .*give weights "
                                         r"of a GPT-2 it builds$"):
        gpt(path, gelu="tanh")


def test_a_field_left_out_of_config_json_is_read_as_transformers_default(tmp_path):
    """config.json without activation_function: transformers reads its GPT2Config default (gelu_new), so does the
    check; other configs beside the file (another model_type, not JSON) are not read: the weights are read as
    without one, with GPT2Config's defaults (gelu_new) too, and load with that GELU."""
    path, reference = saved_gpt2(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["activation_function"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert transformers.GPT2Config.from_pretrained(tmp_path).activation_function == "gelu_new"
    with pytest.raises(ModelError, match=r"records activation_function=gelu_new, the model has exact"):
        gpt(path)
    assert_same_logits(gpt(path, gelu="tanh"), reference)
    for other in (json.dumps({**config, "model_type": "llama"}), "{not json"):
        (tmp_path / "config.json").write_text(other)
        with pytest.raises(ModelError, match=r"no GPT-2 config.json beside them, .* activation_function=gelu_new"):
            gpt(path)
        assert_same_logits(gpt(path, gelu="tanh"), reference)


def test_each_transformers_gelu_name_is_the_gelu_it_is_read_as():
    """models/gpt.py's TRANSFORMERS_GELU against transformers' own functions (ACT2FN): each name's function equals
    nn.GELU with the approximation the table reads it as, and differs from the other one (a name read as the other
    GELU loaded its weights as another function: only gelu_new and gelu were checked)."""
    from models.gpt import TRANSFORMERS_GELU

    x = torch.linspace(-4, 4, 4001, dtype=torch.float64)
    for name, approximate in TRANSFORMERS_GELU.items():
        theirs = transformers.activations.ACT2FN[name](x)
        ours = {a: torch.nn.GELU(approximate="none" if a == "exact" else a)(x) for a in ("exact", "tanh")}
        assert (theirs - ours[approximate]).abs().max().item() < 1e-6, name
        other = "tanh" if approximate == "exact" else "exact"
        assert (theirs - ours[other]).abs().max().item() > 1e-4, name


@pytest.mark.parametrize("saved_as", ["model.safetensors", "state_dict.pt"])
def test_transformers_weights_without_config_json_are_read_with_gpt2s_own_gelu(tmp_path, saved_as):
    """transformers' GPT-2 layout (Conv1D weights) with no config.json beside it (the folder's weights copied alone,
    or torch.save of the state dict): transformers reads such weights with GPT2Config's defaults, gelu_new, the GELU
    every released GPT-2 was trained with. Loaded into the exact GELU they computed another function without a word;
    refused naming model.kwargs.gelu=tanh, with which transformers' logits come out. nanoGPT's layout (nn.Linear)
    without a record is nanoGPT's model, exact GELU: it loads as before."""
    path, reference = saved_gpt2(tmp_path)
    if saved_as != "model.safetensors":
        path = str(tmp_path / saved_as)
        torch.save(reference.state_dict(), path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelError, match=r"^model.pretrained=.*: its weights are in transformers' GPT-2 layout "
                                         r"\(Conv1D\) with no GPT-2 config.json beside them, which transformers reads "
                                         r"with GPT2Config's activation_function=gelu_new, the model has exact: set "
                                         r"model.kwargs.gelu=tanh to load it as it was trained"):
        gpt(path)
    assert_same_logits(gpt(path, gelu="tanh"), reference)
    from tests.test_lm import _nanogpt_names
    linear = str(tmp_path / "nanogpt.pt")  # the same tensors in nanoGPT's nn.Linear layout
    torch.save(_nanogpt_names(gpt(path, gelu="tanh").state_dict()), linear)
    assert gpt(linear).blocks[0].mlp.act.approximate == "none"
