"""model.drop is DeiT's drop_rate: dropout after the position embedding, the attention's output projection and the
MLP's two layers, never the classifier's (timm 1.x's drop_rate). Refused for timm's Swin, which lacks official
Swin's dropout after the patch embedding."""
import glob
import os
import re

import pytest
import torch
import torch.nn as nn

from configs import load_config
from models import ModelError, build_model
from models.factory import model_kwargs
from tests.conftest import ROOT, run_entry


def model_cfg(*overrides):
    return load_config(None, list(overrides)).model


def dropouts_at(model: nn.Module, p: float) -> set:
    return {name for name, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p == pytest.approx(p)}


# where timm 0.3.2's ViT (DeiT's code) puts its drop_rate, in timm 1.x's module names: ViT's pos_drop, every block's
# Attention.proj_drop and Mlp's dropout after fc1 and after fc2; microsoft/Swin-Transformer's drop_rate acts at the
# same block sites of timm's Swin, and at a pos_drop after the patch embedding that timm's Swin does not have
VIT_DEIT = re.compile(r"pos_drop|blocks\.\d+\.(attn\.proj_drop|mlp\.drop[12])")
SWIN_BLOCKS = re.compile(r"layers\.\d+\.blocks\.\d+\.(attn\.proj_drop|mlp\.drop[12])")


def test_model_drop_sets_the_dropout_of_deit_and_not_the_classifiers():
    model = build_model(model_cfg("model.name=vit_nano", "model.drop=0.1", "model.drop_path=0"))
    every = {n for n, m in model.named_modules() if isinstance(m, nn.Dropout)}
    at_rate = dropouts_at(model, 0.1)
    assert at_rate == {n for n in every if VIT_DEIT.fullmatch(n)} and at_rate  # all of those, nothing else
    assert dropouts_at(model, 0.0) == every - at_rate  # the head's, attention weights' dropout stay off


def test_model_drop_is_refused_for_timms_swin_and_its_block_dropout_is_a_model_kwarg():
    """Official Swin's drop_rate also drops after the patch embedding; timm's Swin has no module there, so
    model.drop would train another model than it names. model.kwargs.proj_drop_rate sets the block sites."""
    with pytest.raises(ModelError, match=r"model.drop=0.1: .* timm's Swin, which has no dropout after the patch "
                                         r"embedding.* model.kwargs.proj_drop_rate=0.1"):
        build_model(model_cfg("model.name=swin_nano", "model.drop=0.1"))
    model = build_model(model_cfg("model.name=swin_nano", "model.kwargs.proj_drop_rate=0.1", "model.drop_path=0"))
    every = {n for n, m in model.named_modules() if isinstance(m, nn.Dropout)}
    assert dropouts_at(model, 0.1) == {n for n in every if SWIN_BLOCKS.fullmatch(n)} and dropouts_at(model, 0.1)
    assert not any("embed" in n or n == "pos_drop" for n in every)  # the official pos_drop has no counterpart


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "**", "swin*.yaml"), recursive=True)),
                         ids=os.path.basename)
def test_the_shipped_swin_recipes_build(path):
    model_kwargs(load_config([path]).model)


def test_train_and_evaluate_refuse_model_drop_for_swin_with_one_error_line(tmp_path, capsys):
    demo = os.path.join(ROOT, "configs", "demo", "swin_digits.yaml")
    weights = tmp_path / "weights.pt"
    torch.save(build_model(load_config([demo]).model).state_dict(), weights)
    commands = [("train.py", ["--config", demo, "model.drop=0.1", f"out_dir={tmp_path / 'run'}"]),
                ("evaluate.py", ["--config", demo, f"model.pretrained={weights}", "model.drop=0.1",
                                 "--quant", "gplq", "--out", str(tmp_path / "result.json")])]  # gplq trains
    for path, argv in commands:
        code, _, err = run_entry(path, argv, capsys)
        assert code != 0, path
        assert err.startswith("error: model.drop=0.1: model 'swin_micro'") and err.count("\n") == 1, (path, err)
        assert "after the patch embedding" in err and "model.kwargs.proj_drop_rate=0.1" in err, path
    assert not (tmp_path / "result.json").exists()


def test_the_classifier_dropout_is_timms_own_argument():
    model = build_model(model_cfg("model.name=vit_nano", "model.kwargs.drop_rate=0.3"))
    assert dropouts_at(model, 0.3) == {"head_drop"}


def test_model_drop_of_a_model_it_has_no_meaning_for_is_refused():
    with pytest.raises(ModelError, match=r"model.drop=0.1: model 'resnet18' .* set model.drop=0"):
        build_model(model_cfg("model.name=resnet18", "model.drop=0.1", "model.num_classes=3"))
    build_model(model_cfg("model.name=resnet18", "model.num_classes=3"))  # model.drop=0: nothing to set


def test_a_rate_of_model_drops_arguments_in_model_kwargs_is_refused_only_beside_model_drop():
    """With model.drop=0 a model.kwargs.proj_drop_rate is the only rate set (a run recorded so still builds);
    beside model.drop one of the two would be ignored."""
    model = build_model(model_cfg("model.name=vit_nano", "model.kwargs.proj_drop_rate=0.2", "model.drop_path=0"))
    assert {n for n in dropouts_at(model, 0.2)} and all("proj_drop" in n or "mlp.drop" in n
                                                        for n in dropouts_at(model, 0.2))
    with pytest.raises(ModelError, match="model.kwargs.proj_drop_rate: set model.drop instead"):
        build_model(model_cfg("model.name=vit_nano", "model.kwargs.proj_drop_rate=0.2", "model.drop=0.1"))


def test_a_hybrid_vit_is_timms_vision_transformer_and_takes_model_drop():
    model = build_model(model_cfg("model.name=vit_tiny_r_s16_p8_224", "model.drop=0.1", "model.drop_path=0",
                                  "model.img_size=32", "model.num_classes=3", "model.kwargs.depth=1"))
    assert "pos_drop" in dropouts_at(model, 0.1) and "head_drop" not in dropouts_at(model, 0.1)


def test_a_run_that_trained_with_model_drop_as_the_head_dropout_is_not_resumed_under_the_new_meaning():
    """A checkpoint without `model_drop_sites` comes from code that passed model.drop to timm's drop_rate (the
    classifier's dropout): resuming it with model.drop would train on with dropout at other layers. Refused with
    the settings that continue it as it trained; a checkpoint of the present meaning, a GPT (whose dropout kept its
    meaning) and a run without model.drop resume."""
    from configs import config_to_dict
    from engine.checkpoint import CheckpointError
    from train import check_model_drop_sites

    cfg = load_config(None, ["model.name=vit_nano", "model.drop=0.1"])
    old = {"config": config_to_dict(cfg)}
    with pytest.raises(CheckpointError, match=r"model.drop=0 model.kwargs.drop_rate=0.1 train.allow_changed_config"):
        check_model_drop_sites(old, cfg, "checkpoint.pt")
    check_model_drop_sites({**old, "model_drop_sites": "pos_proj_mlp"}, cfg, "checkpoint.pt")
    check_model_drop_sites(old, load_config(None, ["model.name=vit_nano"]), "checkpoint.pt")
    gpt = load_config(None, ["model.name=gpt2_nano", "model.drop=0.1"])
    check_model_drop_sites({"config": config_to_dict(gpt)}, gpt, "checkpoint.pt")


def old_record(out_dir, drop, drop_sites=True):
    """Rewrite the run of `out_dir` as the code before the present model.drop rules recorded it: model.drop=`drop`
    and no model.kwargs in checkpoint.pt's and config.yaml's config (without `drop_sites`, no model_drop_sites: the
    code that passed model.drop to timm's drop_rate). The weights are those that code trained."""
    import yaml

    path = os.path.join(out_dir, "checkpoint.pt")
    payload = torch.load(path, weights_only=True)
    payload["config"]["model"].update(drop=drop, kwargs={})
    if not drop_sites:
        del payload["model_drop_sites"]
    torch.save(payload, path)
    with open(os.path.join(out_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(payload["config"], f, sort_keys=False)


def test_dropout_rates_in_model_kwargs_create_no_parameter():
    """What lets a resume move a rate between model.drop and model.kwargs: the timm constructors' *drop_rate
    arguments build the same parameters at any rate."""
    for name in ("vit_nano", "swin_nano"):
        plain = build_model(model_cfg(f"model.name={name}", "model.drop_path=0")).state_dict()
        rates = [f"model.kwargs.{key}=0.2" for key in ("drop_rate", "proj_drop_rate", "attn_drop_rate")]
        rates += ["model.kwargs.pos_drop_rate=0.2", "model.kwargs.patch_drop_rate=0.2"] if name == "vit_nano" else []
        dropped = build_model(model_cfg(f"model.name={name}", "model.drop_path=0", *rates)).state_dict()
        assert {k: v.shape for k, v in plain.items()} == {k: v.shape for k, v in dropped.items()}, name


def test_a_swin_run_of_model_drop_resumes_with_its_block_dropout_as_a_model_kwarg(debug_config):
    """A Swin run recorded with model.drop=0.1 (block dropout, timm's proj_drop_rate) cannot be rebuilt with
    model.drop, which is refused for timm's Swin; it continues with the same dropout given as
    model.kwargs.proj_drop_rate under train.allow_changed_config=true. A model.kwargs change of the model's
    parameters stays another model."""
    import train
    from engine.checkpoint import CheckpointError

    swin = ("model.name=swin_nano", "model.drop_path=0")
    train.main(debug_config(*swin, "model.kwargs.proj_drop_rate=0.1", "train.max_steps=1", name="s"))
    old_record(debug_config(name="s").out_dir, drop=0.1)
    with pytest.raises(ModelError, match=r"model.drop=0.1: .*timm's Swin.*model.kwargs.proj_drop_rate=0.1"):
        train.main(debug_config(*swin, "model.drop=0.1", "train.max_steps=2", name="s"))
    moved = (*swin, "model.drop=0", "model.kwargs.proj_drop_rate=0.1", "train.max_steps=2")
    with pytest.raises(CheckpointError, match=r"was written with other settings \(model.drop: 0.1 -> 0.0; "
                                              r"model.kwargs: \{\} -> \{'proj_drop_rate': 0.1\}\).*"
                                              r"train.allow_changed_config=true"):
        train.main(debug_config(*moved, name="s"))
    with pytest.raises(CheckpointError, match=r"was written for model swin_nano with other settings \(model.kwargs"):
        train.main(debug_config(*moved, "model.kwargs.mlp_ratio=2", "train.allow_changed_config=true", name="s"))
    result = train.main(debug_config(*moved, "train.allow_changed_config=true", name="s"))
    assert result.state.step == 2 and result.reason == "max_steps"
    assert dropouts_at(result.model, 0.1) == {n for n, m in result.model.named_modules()
                                              if isinstance(m, nn.Dropout) and SWIN_BLOCKS.fullmatch(n)}


def test_a_run_of_model_drop_as_the_head_dropout_resumes_as_check_model_drop_sites_advises(debug_config):
    """A ViT run recorded before model_drop_sites trained model.drop as timm's drop_rate (the classifier's dropout):
    the refusal's settings (model.drop=0 model.kwargs.drop_rate=<rate> train.allow_changed_config=true) continue
    it with that dropout."""
    import train
    from engine.checkpoint import CheckpointError

    train.main(debug_config("model.kwargs.drop_rate=0.1", "train.max_steps=1", name="h"))
    old_record(debug_config(name="h").out_dir, drop=0.1, drop_sites=False)
    with pytest.raises(CheckpointError, match=r"trained with model.drop=0.1 as timm's classifier-head dropout.* "
                                              r"resume with model.drop=0 model.kwargs.drop_rate=0.1 "
                                              r"train.allow_changed_config=true"):
        train.main(debug_config("model.drop=0.1", "train.max_steps=2", "train.allow_changed_config=true", name="h"))
    result = train.main(debug_config("model.drop=0", "model.kwargs.drop_rate=0.1", "train.allow_changed_config=true",
                                     "train.max_steps=2", name="h"))
    assert result.state.step == 2 and dropouts_at(result.model, 0.1) == {"head_drop"}
