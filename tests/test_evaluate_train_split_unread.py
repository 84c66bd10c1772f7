"""evaluate.py reads the training split (its name, and the size of a synthetic one) only for the pipelines that draw
from it: given to an evaluation that draws nothing (rtn, or no pipeline) it would be ignored, and is refused."""
from __future__ import annotations

import pytest
import torch

import evaluate
from configs import ConfigError
from tests.conftest import DEBUG_CONFIG  # synthetic data: 64 training images


@pytest.fixture
def weights(tmp_path):
    """A weights file for model.pretrained: resolve_config only checks the settings, it loads no weight."""
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(1)}, path)
    return str(path)


def resolve(weights, *argv):
    return evaluate.resolve_config(evaluate.parse_args(["--config", DEBUG_CONFIG, f"model.pretrained={weights}",
                                                        *argv]))[0]


@pytest.mark.parametrize("quant, pipelines", [(["--quant", "rtn"], "rtn"), (["--quant"], "none")])
def test_a_synthetic_training_size_is_refused_where_no_pipeline_draws_from_the_split(weights, quant, pipelines):
    with pytest.raises(ConfigError) as refused:
        resolve(weights, *quant, "data.synthetic_train_size=32")
    assert str(refused.value) == (f"data.synthetic_train_size=32 would be ignored: no pipeline of this evaluation "
                                  f"reads the training split (pipelines: {pipelines}; rtn reads no data); drop it")


def test_a_synthetic_training_size_is_taken_where_a_pipeline_draws_from_the_split(weights):
    # percentile calibrates on a batch of training images
    assert resolve(weights, "--quant", "percentile", "data.synthetic_train_size=32").data.synthetic_train_size == 32
    assert resolve(weights, "--quant", "rtn").data.synthetic_train_size == 64  # the recipe's own value is no override
