"""A run records its quant.* plan as the defaults of `evaluate.py --checkpoint`, which converts a copy of the model
with each planned layout before anything else (quant.plan.check_model_converts): a model that conversion refuses
is refused by train.py before the first update when quant.pipelines was given, and warned about when the plan is
the task's default. Nothing here trains: the training loop is replaced by one that stops the run."""
import os

import pytest

import train
from configs import ConfigError, load_config
from tests.conftest import ROOT

SWIN_CONFIG = os.path.join(ROOT, "configs", "demo", "swin_digits.yaml")


class Started(Exception):
    """Raised in place of the training loop: the run got past every check before the first update."""


def pads_windows(img_size: int, patch: int = 2, window: int = 4, stages: int = 3) -> bool:
    """Whether timm's Swin pads a window of swin_micro (2-px patches, windows of 4, three stages) at `img_size`
    pixels: a stage's token grid that is larger than the window but not a multiple of it (a grid no larger than
    the window is one window of its own size)."""
    grid = img_size // patch
    for _ in range(stages):
        if grid > window and grid % window:
            return True
        grid //= 2
    return False


def start(tmp_path, monkeypatch, *overrides: str):
    """train.main on the Swin digits demo with `overrides`, stopped where the training loop would begin."""
    def trains(*args, **kwargs):
        raise Started
    monkeypatch.setattr(train, "train_epochs", trains)
    cfg = load_config([SWIN_CONFIG], [f"out_dir={tmp_path / 'run'}", *overrides])
    return train.main(cfg)


@pytest.mark.parametrize("img_size", [40, 64])
def test_an_explicit_repq_plan_is_refused_before_training_exactly_where_swin_pads_its_windows(tmp_path, monkeypatch,
                                                                                               img_size):
    """RepQ-ViT folds each Swin block's norm1 into the qkv layer, which padded windows break: train.py refused
    nothing, trained to the end, and evaluate.py then refused the plan the run recorded."""
    overrides = [f"model.img_size={img_size}", "quant.pipelines=[repq]"]
    if pads_windows(img_size):
        with pytest.raises(ConfigError) as raised:
            start(tmp_path, monkeypatch, *overrides)
        message = str(raised.value)
        assert message.startswith("model.name=swin_micro: repq w4a4 cannot quantize it: "), message
        assert "model.img_size" in message and "evaluate.py --checkpoint" in message, message
    else:
        with pytest.raises(Started):
            start(tmp_path, monkeypatch, *overrides)


def test_repq_without_its_fold_takes_padded_windows(tmp_path, monkeypatch):
    assert pads_windows(40)
    with pytest.raises(Started):
        start(tmp_path, monkeypatch, "model.img_size=40", "quant.pipelines=[repq]", "quant.repq.reparam=false")


def test_the_default_plan_on_padded_windows_is_a_warning_and_the_run_trains(tmp_path, monkeypatch, caplog):
    """quant.pipelines unset: the task's default plan (percentile, repq) was asked for by no one, so the run trains
    for its float score, told what its evaluation will refuse."""
    assert pads_windows(40)
    with caplog.at_level("WARNING", logger="train"), pytest.raises(Started):
        start(tmp_path, monkeypatch, "model.img_size=40")
    warned = [r.getMessage() for r in caplog.records if "evaluate.py --checkpoint" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("model.name=swin_micro: repq w4a4 cannot quantize it"), warned
