"""The activation maxima need Transformer blocks: a model without any (a timm ResNet, which train.py trains) is
refused at the start of evaluate.py and of a train.py run with log.act_max=true, in one `error:` line naming
model.name and what to do, before the FP pass or the training; not by a traceback after them."""
import os

import pytest
import torch

from configs import ConfigError, load_config
from engine.act_max import ActivationProbe, check_has_blocks
from engine.tasks import ClassificationTask
from models import build_model
from tests.conftest import DEBUG_CONFIG, run_entry


def model_of(name: str):
    return build_model(load_config([DEBUG_CONFIG], [f"model.name={name}", "model.drop_path=0"]).model)


def test_a_resnet_is_refused_naming_the_model_and_the_fix():
    resnet = model_of("resnet10t")
    # the reference: the model really has no module the probe could measure as a block
    assert not any(name.startswith("blocks.") or ".blocks." in name for name, _ in resnet.named_modules())
    with pytest.raises(ConfigError, match=r"^model\.name=resnet10t: ResNet has no Transformer blocks .*; "
                                          r"set log\.act_max=false$"):
        check_has_blocks(resnet, "resnet10t", "set log.act_max=false")


def test_a_vit_passes_and_the_probe_measures_its_blocks():
    vit = model_of("vit_nano")
    check_has_blocks(vit, "vit_nano", "unused")
    with ActivationProbe(vit) as probe:
        vit(torch.randn(2, 3, 32, 32))
    assert probe.result().block > 0  # the model the check passes is one the probe measures


def test_train_with_log_act_max_refuses_a_resnet_before_training(tmp_path, capsys):
    out_dir = tmp_path / "run"
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, "model.name=resnet10t", "log.act_max=true",
                                          "train.max_steps=1", f"out_dir={out_dir}"], capsys)
    assert code != 0 and "Traceback" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: model.name=resnet10t: ") and "log.act_max=false" in last, err[-2000:]
    assert not (out_dir / "checkpoint.pt").exists()  # refused before any update


def test_evaluate_refuses_a_resnet_checkpoint_before_the_fp_pass(checkpoint, tmp_path, capsys, monkeypatch):
    # a checkpoint of train.py whose model is a ResNet: the ViT run's payload with the model swapped
    payload = torch.load(checkpoint, map_location="cpu", weights_only=False)
    payload["config"]["model"]["name"] = "resnet10t"
    payload["model"] = build_model(load_config([DEBUG_CONFIG], ["model.name=resnet10t", "model.num_classes=10",
                                                                "model.drop_path=0"]).model).state_dict()
    payload.pop("model_ema", None)
    path = tmp_path / "resnet.pt"
    torch.save(payload, path)
    passes = []
    monkeypatch.setattr(ClassificationTask, "evaluate", lambda *a, **k: passes.append(1))
    code, out, err = run_entry("evaluate.py", ["--checkpoint", str(path)], capsys)
    assert code != 0 and "Traceback" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: model.name=resnet10t: ") and "evaluate.py" in last, err[-2000:]
    assert passes == [] and not os.path.exists(tmp_path / "eval_resnet.json")  # no FP pass, no result
