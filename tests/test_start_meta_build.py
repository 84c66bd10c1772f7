"""The checks before the claim of out_dir build the model on the meta device once: check_model_builds' build (the
model.name and model.kwargs refusals) also takes the weights a fine-tune starts from (check_start_weights) or the
checkpoint a resume into another folder continues (check_checkpoint_fits)."""
import os

import pytest
import torch

import train
from models import build_model


class Claimed(Exception):
    """Raised in place of the claim of out_dir: the start's checks are done."""


def meta_builds_until_the_claim(monkeypatch) -> list:
    """The models train.py builds on the meta device from now on, until train.main stops at the claim."""
    builds, real = [], train.build_model

    def counted(model_cfg):
        model = real(model_cfg)
        builds.extend(["meta"] if all(p.is_meta for p in model.parameters()) else [])
        return model

    def claim(*args, **kwargs):
        raise Claimed

    monkeypatch.setattr(train, "build_model", counted)
    monkeypatch.setattr(train, "claim_on_main_rank", claim)
    return builds


def test_a_fine_tune_start_builds_its_model_on_the_meta_device_once(debug_config, tmp_path, monkeypatch):
    weights = str(tmp_path / "start.pth")
    torch.save(build_model(debug_config().model).state_dict(), weights)
    builds = meta_builds_until_the_claim(monkeypatch)
    with pytest.raises(Claimed):
        train.main(debug_config(f"model.pretrained={weights}"))
    assert builds == ["meta"]


def test_a_resume_into_another_folder_builds_its_model_on_the_meta_device_once(debug_config, monkeypatch):
    first = debug_config("train.max_steps=1", name="a")
    train.main(first)
    builds = meta_builds_until_the_claim(monkeypatch)
    with pytest.raises(Claimed):
        train.main(debug_config(f"train.resume={os.path.join(first.out_dir, 'checkpoint.pt')}", name="b"))
    assert builds == ["meta"]
