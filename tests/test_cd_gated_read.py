"""gated_mlp (cd.gated_mlp) pairs the gated MLPs of a model: on a model none of whose blocks has one it would change
no pair, so `find_pairs` refuses it, and with it ColinearityDecay, a baseline's pair_energy_source and train.py
(before the run's folder gets its files)."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import train
from cd import ColinearityDecay, UnsupportedModelError, find_pairs, pair_energy_source
from cd_models import tiny_swin, tiny_vit
from configs import ConfigError, load_config
from tests.conftest import DEBUG_CONFIG

NO_GATED_MLP = r"^gated_mlp=True \(cd.gated_mlp=true\): {} has no gated MLP .*so the switch adds no pair; drop it$"


@pytest.mark.parametrize("build", [tiny_vit, tiny_swin])
def test_gated_mlp_on_a_model_without_a_gated_mlp_is_refused(build):
    model = build()
    names = {n for n, _ in model.named_modules()}
    assert not any(n.endswith(("fc1_g", "fc1_x", "gate_proj")) for n in names)  # plain fc1 -> act -> fc2 MLPs
    assert find_pairs(model)  # the model itself is supported
    message = NO_GATED_MLP.format(type(model).__name__)
    for call in (find_pairs, ColinearityDecay):
        with pytest.raises(ValueError, match=message) as refused:
            call(model, gated_mlp=True)
        assert not isinstance(refused.value, UnsupportedModelError)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused, not a warning that the baseline logs no energies
        with pytest.raises(ValueError, match=message):
            pair_energy_source(model, gated_mlp=True)


def test_gated_mlp_on_a_model_with_one_gated_block_pairs_it():
    """One gated block is enough: its MLP gets the gated pairs (fc1 x2: W_gate and W_up; fc2: W_up -> W_down), the
    plain block keeps fc1 and fc2."""
    from timm.layers import SwiGLU

    model = tiny_vit()
    torch.manual_seed(0)
    model.blocks[1].mlp = SwiGLU(in_features=32, hidden_features=64, act_layer=torch.nn.SiLU)
    pairs = find_pairs(model, gated_mlp=True)
    assert [(p.block, p.role, p.name) for p in pairs if p.role in ("fc1", "fc2")] == [
        ("blocks.0", "fc1", "blocks.0.mlp.fc1.weight"), ("blocks.0", "fc2", "blocks.0.mlp.fc2.weight"),
        ("blocks.1", "fc1", "blocks.1.mlp.fc1_g.weight"), ("blocks.1", "fc1", "blocks.1.mlp.fc1_x.weight"),
        ("blocks.1", "fc2", "blocks.1.mlp.fc2.weight")]


@pytest.mark.parametrize("cd", [[], ["cd.enabled=true"]])
def test_train_refuses_cd_gated_mlp_on_a_plain_vit_before_writing_the_run(tmp_path, cd):
    """A baseline reads cd.gated_mlp for its logged pair energies, a CD run for its pairs: either is one error."""
    cfg = load_config([DEBUG_CONFIG], [*cd, "cd.gated_mlp=true", f"out_dir={tmp_path}", "log.tensorboard=false"])
    with pytest.raises(ConfigError, match=NO_GATED_MLP.format("VisionTransformer").replace("^", "^cd: ")):
        train.main(cfg)
    assert not os.path.exists(tmp_path / "config.yaml")
