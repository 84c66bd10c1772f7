"""Fine-tuning a run checkpoint with other model.kwargs than it was trained with: a change that makes the weights
compute another function (act_layer, global_pool, fc_norm) is named, old -> new, with the setting that keeps the trained
function (a warning, an error under model.pretrained_strict=true); a change that does not (dropout rates,
dynamic_img_size, a value that spells out the model's own default) is not."""
import dataclasses
import logging
import random

import numpy as np
import pytest
import torch

import train
from configs import load_config
from models import ModelError, build_model
from models.kwargs_change import check_kwargs_kept


def nano(*overrides):
    return load_config(None, ["model.name=vit_nano", "model.num_classes=4", "model.drop_path=0", *overrides]).model


def computes_the_same(trained, now) -> bool:
    """Whether weights of the model `trained` compute the same in the model `now` (eval mode, one input): the
    reference the warning is checked against."""
    torch.manual_seed(0)
    before = build_model(trained).eval()
    after = build_model(now).eval()
    after.load_state_dict(before.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        return torch.allclose(before(x), after(x), atol=1e-6)


@pytest.mark.parametrize("trained, now", [
    (["model.kwargs.act_layer=relu"], []),
    (["model.kwargs.act_layer=relu"], ["model.kwargs.act_layer=relu"]),
    ([], ["model.kwargs.global_pool=avg", "model.kwargs.fc_norm=false"]),  # fc_norm: the same keys as trained
    ([], ["model.kwargs.dynamic_img_size=true"]),
    ([], ["model.kwargs.attn_drop_rate=0.1", "model.kwargs.proj_drop_rate=0.1"]),
    # the model's own defaults spelt out (timm's ViT: act_layer=None is GELU in its Block): no change
    ([], ["model.kwargs.global_pool=token"]),
    ([], ["model.kwargs.act_layer=gelu"]),
    (["model.kwargs.qkv_bias=true"], []),
    ([], ["model.kwargs.class_token=true"]),
    ([], ["model.kwargs.qkv_bias=false"]),  # another parameter set: the weights do not load
], ids=["relu_to_gelu", "relu_kept", "token_to_avg_pool", "dynamic_img_size", "drop_rates", "explicit_token_pool",
        "explicit_gelu", "explicit_qkv_bias", "explicit_class_token", "no_qkv_bias"])
def test_a_change_is_named_exactly_when_the_weights_compute_another_function(trained, now, caplog):
    try:
        same = computes_the_same(nano(*trained), nano(*now))
    except RuntimeError:  # the trained weights do not fit the model
        same = False
    with caplog.at_level(logging.WARNING, logger="models.kwargs_change"):
        check_kwargs_kept(nano(*trained), nano(*now), "model.pretrained=run/best.pt")
    assert bool(caplog.records) == (not same), caplog.text
    strict = dataclasses.replace(nano(*now), pretrained_strict=True)
    if same:
        check_kwargs_kept(nano(*trained), strict, "model.pretrained=run/best.pt")
    else:
        with pytest.raises(ModelError, match="other model.kwargs"):
            check_kwargs_kept(nano(*trained), strict, "model.pretrained=run/best.pt")


def test_a_language_model_spelling_out_its_own_gelu_is_no_change_and_another_gelu_is(caplog):
    gpt = lambda *kwargs: load_config(None, ["model.name=gpt2_nano", "model.num_classes=16", "model.drop_path=0",
                                             *kwargs]).model
    tokens = torch.arange(32).remainder(16).unsqueeze(0)
    torch.manual_seed(0)
    exact, tanh = build_model(gpt()).eval(), build_model(gpt("model.kwargs.gelu=tanh")).eval()
    tanh.load_state_dict(exact.state_dict())
    with torch.no_grad():  # the reference: GPT-2's tanh approximation computes another function than the erf GELU
        assert not torch.equal(exact(tokens), tanh(tokens))  # (by ~1e-6 at a fresh init's small activations)
    with caplog.at_level(logging.WARNING, logger="models.kwargs_change"):
        check_kwargs_kept(gpt(), gpt("model.kwargs.gelu=exact"), "model.pretrained=w")
        assert not caplog.records, caplog.text
        check_kwargs_kept(gpt(), gpt("model.kwargs.gelu=tanh"), "model.pretrained=w")
    assert [r.getMessage().split(": fine-tuning")[0] for r in caplog.records] == [
        "model.pretrained=w was trained with other model.kwargs than the model's (model.kwargs.gelu: unset (the "
        "model's own) -> tanh)"]


def test_deciding_a_change_leaves_the_callers_random_state_alone():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    check_kwargs_kept(nano("model.kwargs.act_layer=relu"), nano("model.kwargs.global_pool=token"), "w")
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_each_changed_key_is_named_with_both_values_and_the_settings_that_keep_the_trained_function(caplog):
    with caplog.at_level(logging.WARNING, logger="models.kwargs_change"):
        check_kwargs_kept(nano("model.kwargs.act_layer=relu", "model.kwargs.fc_norm=true"),
                          nano("model.kwargs.fc_norm=false", "model.kwargs.global_pool=avg"), "model.pretrained=w")
    assert [r.getMessage() for r in caplog.records] == [
        "model.pretrained=w was trained with other model.kwargs than the model's (model.kwargs.act_layer: relu -> "
        "unset (the model's own); model.kwargs.fc_norm: true -> false; model.kwargs.global_pool: unset (the model's "
        "own) -> avg): fine-tuning starts from another function than the trained one (set "
        "model.kwargs.act_layer=relu, model.kwargs.fc_norm=true and drop model.kwargs.global_pool to start from the "
        "trained function)"]


def test_train_py_warns_when_fine_tuning_a_relu_run_as_gelu_and_refuses_it_under_strict(debug_config, caplog):
    train.main(debug_config("model.kwargs.act_layer=relu", "train.max_steps=1", name="relu"))
    best = debug_config(name="relu").out_dir + "/best.pt"
    with caplog.at_level(logging.WARNING):
        train.main(debug_config(f"model.pretrained={best}", "train.max_steps=1", name="gelu"))
    warned = [r.getMessage() for r in caplog.records if "other model.kwargs" in r.getMessage()]
    assert len(warned) == 1 and "model.kwargs.act_layer: relu -> unset" in warned[0], caplog.text
    assert "set model.kwargs.act_layer=relu to start from the trained function" in warned[0]
    with pytest.raises(ModelError, match=r"^model.pretrained=.*best.pt was trained with other model.kwargs than the "
                                         r"model's \(model.kwargs.act_layer: relu -> unset \(the model's own\)\): .*"
                                         r"set model.kwargs.act_layer=relu to start from the trained function"):
        train.main(debug_config(f"model.pretrained={best}", "model.pretrained_strict=true", name="strict"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the trained function kept: nothing to say
        train.main(debug_config(f"model.pretrained={best}", "model.kwargs.act_layer=relu", "train.max_steps=1",
                                name="kept"))
    assert not [r for r in caplog.records if "other model.kwargs" in r.getMessage()], caplog.text


def test_train_py_fine_tunes_under_strict_with_model_kwargs_that_spell_out_the_models_own(debug_config, caplog):
    train.main(debug_config("train.max_steps=1", name="plain"))
    best = debug_config(name="plain").out_dir + "/best.pt"
    with caplog.at_level(logging.WARNING):
        train.main(debug_config(f"model.pretrained={best}", "model.pretrained_strict=true", "train.max_steps=1",
                                "model.kwargs.global_pool=token", "model.kwargs.act_layer=gelu", name="explicit"))
    assert not [r for r in caplog.records if "other model.kwargs" in r.getMessage()], caplog.text


def test_the_probe_computes_on_the_cpu_whatever_the_default_device(caplog):
    """The decision builds and runs the models on real numbers: under a default device of 'meta' (how GPU-only
    tensor placement bugs show on a CPU) a real change is still named and a spelt-out default still is not."""
    torch.set_default_device("meta")
    try:
        with caplog.at_level(logging.WARNING, logger="models.kwargs_change"):
            check_kwargs_kept(nano(), nano("model.kwargs.act_layer=gelu"), "model.pretrained=run/best.pt")
            assert not caplog.records, caplog.text
            check_kwargs_kept(nano("model.kwargs.act_layer=relu"), nano(), "model.pretrained=run/best.pt")
    finally:
        torch.set_default_device(None)
    assert "model.kwargs.act_layer: relu -> unset" in caplog.text, caplog.text
