"""Over a --checkpoint, a --config file is a layer of evaluation settings (a data preset for another machine): a data
setting it changes is one the user gave, refused as its key=value override is where no pass of the evaluation reads
it (the training transform without a pipeline that sees training-transform images, digits' data.interpolation where
nothing is resampled, the training split where no pipeline draws from it), naming the file. Before, such a file's
setting was taken and ignored without a word while the same override was refused. A file restating the checkpoint's
own value, and one whose setting a pipeline reads, pass."""
from __future__ import annotations

import re

import pytest
import torch

import evaluate
from configs import ConfigError, config_to_dict, load_config
from engine.quant_settings import quant_settings
from tests.conftest import DEBUG_CONFIG, DEMO_CONFIG


def fake_checkpoint(folder, config: str, *overrides: str) -> str:
    """A file with a run checkpoint's `config` and `model` entries: resolve_config reads the config, no weight."""
    path = folder / "best.pt"
    torch.save({"model": {}, "config": config_to_dict(load_config([config], list(overrides)))}, path)
    return str(path)


@pytest.fixture
def digits(tmp_path):
    return fake_checkpoint(tmp_path, DEMO_CONFIG, "model.name=vit_nano")  # crop_pct 1.0: 32 px digits, no resize


def resolve(checkpoint, layer, text: str, *argv: str):
    layer.write_text(text)
    return evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, "--config", str(layer), *argv]))[0]


@pytest.mark.parametrize("text, item", [
    ("data:\n  scale: [0.5, 1.0]\n", "data.scale=[0.5, 1.0]"),
    ("data:\n  reprob: 0.25\n", "data.reprob=0.25"),
    ("data:\n  interpolation: bilinear\n", 'data.interpolation="bilinear"'),
])
def test_a_data_setting_of_a_config_file_that_no_pass_reads_is_refused_naming_the_file(digits, tmp_path, text, item):
    layer = tmp_path / "layer.yaml"
    with pytest.raises(ConfigError, match=rf"^{re.escape(f'{item} (--config {layer})')} would be ignored: .*"
                                          r"\(pipelines: percentile;"):
        resolve(digits, layer, text, "--quant", "percentile")


def test_a_training_split_of_a_config_file_that_no_pipeline_draws_from_is_refused(tmp_path):
    checkpoint = fake_checkpoint(tmp_path, DEBUG_CONFIG)  # synthetic: 64 training images
    layer = tmp_path / "layer.yaml"
    with pytest.raises(ConfigError) as refused:
        resolve(checkpoint, layer, "data:\n  synthetic_train_size: 32\n", "--quant", "rtn")
    assert str(refused.value) == (f"data.synthetic_train_size=32 (--config {layer}) would be ignored: no pipeline of "
                                  f"this evaluation reads the training split (pipelines: rtn; rtn reads no data); "
                                  f"drop it")
    assert resolve(checkpoint, layer, "data:\n  synthetic_train_size: 64\n", "--quant", "rtn")  # the run's own
    assert resolve(checkpoint, layer, "data:\n  synthetic_train_size: 32\n", "--quant", "percentile").data.\
        synthetic_train_size == 32  # its calibration batch is drawn from the split


def test_a_config_files_data_setting_passes_where_it_is_read_or_restates_the_checkpoints_value(digits, tmp_path):
    layer = tmp_path / "layer.yaml"
    cfg = resolve(digits, layer, "data:\n  scale: [0.5, 1.0]\n", "--quant", "aphq")  # APHQ's training images
    assert quant_settings(cfg, "aphq")["train_transform"]["scale"] == [0.5, 1.0]
    for text in ("data:\n  scale: [0.7, 1.0]\n", "data:\n  interpolation: bicubic\n"):  # the recipe's own values
        assert resolve(digits, layer, text, "--quant", "percentile").quant.pipelines == ["percentile"]
