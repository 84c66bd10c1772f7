"""Weights that differ from the model by attention-sink parameters alone (`attn.sink_*`, models/attention_sinks.py)
are one error line naming the file's model.attn variant and the setting that loads them, not a bare key list: a
kv_bias / attn_bias run fine-tuned without model.attn, plain weights evaluated in a variant."""
import re

import pytest
import torch

from configs.schema import ModelConfig
from models import ModelError, build_model

# which model.attn holds which sink parameters (models/attention_sinks.py's docstring: b_h; k'_h, v'_h)
PARAMS = {"softmax": set(), "softmax1": set(), "attn_bias": {"sink_logit"}, "kv_bias": {"sink_k", "sink_v"}}


def weights(name: str, attn: str) -> dict:
    """The state dict of `name` (4 classes) built with `attn`; its sink parameter names checked against PARAMS."""
    state = build_model(ModelConfig(name=name, num_classes=4, attn=attn)).state_dict()
    assert {k.rpartition(".")[2] for k in state if ".sink_" in k} == PARAMS[attn]
    return state


def refusal(path, name: str, attn: str, strict: bool) -> str:
    """The one-line error of loading `path` into `name` with model.attn=`attn`."""
    with pytest.raises(ModelError) as refused:
        build_model(ModelConfig(name=name, num_classes=4, attn=attn, pretrained=str(path), pretrained_strict=strict))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{path} does not fit "), message
    return message


@pytest.mark.parametrize("name", ["vit_nano", "swin_nano"])
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("file_attn, model_attn", [("kv_bias", "softmax"), ("attn_bias", "softmax"),
                                                   ("kv_bias", "softmax1"), ("attn_bias", "kv_bias"),
                                                   ("kv_bias", "attn_bias")])
def test_a_sink_variants_weights_name_the_model_attn_that_loads_them(tmp_path, name, strict, file_attn, model_attn):
    """The reviewer's case (a kv_bias run's best.pt, fine-tuned without model.attn) and the other pairs: the line
    names the file's variant and says to set it, and loading with that setting then succeeds."""
    path = tmp_path / "run.pt"
    torch.save({"model": weights(name, file_attn), "config": {"model": {"attn": file_attn}}}, path)
    message = refusal(path, name, model_attn, strict)
    assert re.search(rf"weights of a model\.attn={file_attn} model, the model is model\.attn={model_attn} \(", message)
    assert message.endswith(f"set model.attn={file_attn} to load them"), message
    build_model(ModelConfig(name=name, num_classes=4, attn=file_attn, pretrained=str(path), pretrained_strict=strict))


@pytest.mark.parametrize("name", ["vit_nano", "swin_nano"])
@pytest.mark.parametrize("model_attn", ["kv_bias", "attn_bias"])
def test_plain_weights_evaluated_in_a_sink_variant_say_to_drop_it_or_fine_tune(tmp_path, name, model_attn):
    """Plain weights into a variant under model.pretrained_strict=true ("missing sink_k" before): drop the
    override to use them as they are, or fine-tune without strict, which loads them (sinks at zero)."""
    path = tmp_path / "plain.pth"
    torch.save(weights(name, "softmax"), path)
    message = refusal(path, name, model_attn, strict=True)
    assert f"model.attn=softmax (or softmax1) model, without the attention-sink parameters of the model's " \
           f"model.attn={model_attn} (the file lacks [" in message, message
    assert "drop the model.attn override (model.attn=softmax)" in message, message
    assert "model.pretrained_strict=false" in message, message
    model = build_model(ModelConfig(name=name, num_classes=4, attn=model_attn, pretrained=str(path)))
    assert all(not v.any() for k, v in model.state_dict().items() if ".sink_" in k)


def test_a_softmax1_runs_weights_are_named_by_the_config_it_recorded(tmp_path):
    """softmax1 has no parameters to tell its weights from softmax's: a train.py checkpoint's config does, and the
    setting named is the run's, model.attn=softmax1."""
    path = tmp_path / "best.pt"
    torch.save({"model": weights("vit_nano", "softmax1"), "config": {"model": {"attn": "softmax1"}}}, path)
    message = refusal(path, "vit_nano", "kv_bias", strict=True)
    assert "weights of a model.attn=softmax1 model" in message and "set model.attn=softmax1 to use" in message


def test_other_differences_beside_the_sinks_keep_the_key_list(tmp_path):
    """A file that lacks another key too is not fixed by model.attn: the plain key list, no variant advice."""
    state = weights("vit_nano", "kv_bias")
    del state["blocks.0.norm1.weight"]
    path = tmp_path / "other.pth"
    torch.save(state, path)
    message = refusal(path, "vit_nano", "softmax", strict=True)
    assert "missing ['blocks.0.norm1.weight']" in message and "model.attn" not in message, message
