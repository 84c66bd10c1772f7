"""Fine-tuning a run checkpoint with other model.kwargs than it was trained with: a change that makes the weights
compute another function (act_layer, global_pool, fc_norm) is named, old -> new, with the setting that keeps the trained
function (a warning, an error under model.pretrained_strict=true); a change that does not (dropout rates,
dynamic_img_size) is not."""
import logging

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
], ids=["relu_to_gelu", "relu_kept", "token_to_avg_pool", "dynamic_img_size", "drop_rates"])
def test_a_change_is_named_exactly_when_the_weights_compute_another_function(trained, now, caplog):
    with caplog.at_level(logging.WARNING, logger="models.kwargs_change"):
        check_kwargs_kept(nano(*trained), nano(*now), "model.pretrained=run/best.pt")
    assert bool(caplog.records) == (not computes_the_same(nano(*trained), nano(*now))), caplog.text


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
