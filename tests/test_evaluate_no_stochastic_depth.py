"""A model built to be evaluated only (no pipeline trains it) is built without dropout or stochastic depth, which
act in training only: a timm model that has no stochastic depth (GhostNet, VGG, DenseNet, ...) refuses a
model.drop_path above 0, and the schema's default 0.1, which a config that never names it carries, made
evaluate.py and scripts/mechanism.py refuse such a weights file (and model.drop_path=0 is refused there as an
ignored setting). A rate recorded by a checkpoint gives the same outputs (eval mode's DropPath is the identity), and
GPLQ's stage 1, which trains, still builds the model with the config's rates."""
import json

import pytest
import timm
import torch
from timm.layers import DropPath

import evaluate
import mechanism
from configs import load_config
from configs.schema import ModelConfig
from models import ModelError, build_model
from tests.conftest import run_entry

NAME = "ghostnet_050"  # timm's GhostNet: its constructor takes no drop_path_rate
DATA = ["data.dataset=synthetic", "data.synthetic_val_size=8", "data.num_workers=0", "model.num_classes=4"]


def reference(seed: int) -> torch.nn.Module:
    """timm's own model, built without the repository's code, in eval mode."""
    torch.manual_seed(seed)
    return timm.create_model(NAME, num_classes=4).eval()


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Two 4-class GhostNet weights files (torch.save of the state dict) and the models they hold."""
    folder = tmp_path_factory.mktemp("ghostnet")
    files = {}
    for seed in (0, 1):
        model = reference(seed)
        path = folder / f"ghost{seed}.pth"
        torch.save(model.state_dict(), path)
        files[str(path)] = model
    return files


def same_outputs(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), ref(x), rtol=0, atol=0)


def test_evaluate_py_scores_a_weights_file_of_a_model_without_stochastic_depth(weights, tmp_path, capsys):
    """It was refused: 'model.drop_path=0.1: ... has no stochastic depth; set model.drop_path=0'."""
    path, ref = next(iter(weights.items()))
    cfg = load_config([], [f"model.name={NAME}", f"model.pretrained={path}", *DATA])
    assert cfg.model.drop_path > 0  # the schema's default, which this config carries
    same_outputs(evaluate.load_float_model(cfg, None, evaluate.parse_args([])), ref)
    out = tmp_path / "r.json"
    code, _, err = run_entry("evaluate.py", [f"model.name={NAME}", f"model.pretrained={path}", *DATA, "--quant",
                                             "--out", str(out), "quant.act_max_csv=false"], capsys)
    assert code == 0, err
    assert json.loads(out.read_text())["fp"]["count"] == 8
    # a rate the user gives is still refused: no pass of this evaluation trains the model
    code, _, err = run_entry("evaluate.py", [f"model.name={NAME}", f"model.pretrained={path}", *DATA,
                                             "model.drop_path=0", "--quant", "--out", str(out)], capsys)
    assert code == 1 and err.startswith("error: model.drop_path would be ignored: "), err


def test_mechanism_loads_a_weights_file_and_a_compare_file_of_a_model_without_stochastic_depth(weights, tmp_path):
    (first, ref), (second, ref2) = weights.items()
    args = mechanism.parse_args(["surrogate", "--model", NAME, "--weights", first, "--out", str(tmp_path), *DATA])
    same_outputs(mechanism.load(args, images=True).model, ref)
    args = mechanism.parse_args(["energies", "--model", NAME, "--weights", first, "--compare", second,
                                 "--out", str(tmp_path), "model.num_classes=4"])
    same_outputs(mechanism.load_compare(second, mechanism.load(args), args).model, ref2)


@pytest.fixture(scope="module")
def vit_weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("vit") / "vit.pth"
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="vit_nano", num_classes=4, drop_path=0.3))
    torch.save(model.state_dict(), path)
    return str(path), model.eval()


def test_a_recorded_rate_gives_the_same_outputs_and_gplq_still_trains_with_it(vit_weights):
    path, trained = vit_weights  # built with stochastic depth 0.3, evaluated in eval mode: the reference
    overrides = ["model.name=vit_nano", f"model.pretrained={path}", "model.drop_path=0.3", *DATA]
    scored = evaluate.load_float_model(load_config([], overrides), None, evaluate.parse_args([]))
    assert not [m for m in scored.modules() if isinstance(m, DropPath)]
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(scored.eval()(x), trained(x), rtol=0, atol=0)
    # GPLQ's stage 1 trains the model in training mode: the config's rate is built in
    cfg = load_config([], [*overrides, "quant.pipelines=[gplq]"])
    assert evaluate.a_pipeline_trains(cfg)
    rates = [m.drop_prob for m in evaluate.load_float_model(cfg, None, evaluate.parse_args([])).modules()
             if isinstance(m, DropPath)]
    assert rates and max(rates) == pytest.approx(0.3)
    # and a model without stochastic depth is refused there for the default rate, naming the fix
    cfg = load_config([], [f"model.name={NAME}", "model.pretrained=x.pth", "quant.pipelines=[gplq]", *DATA])
    with pytest.raises(ModelError, match=r"model.drop_path=0.1: .*has no stochastic depth.*set model.drop_path=0"):
        evaluate.load_float_model(cfg, None, evaluate.parse_args([]))


def test_eval_model_config_drops_only_the_training_rates():
    cfg = ModelConfig(name="vit_nano", num_classes=4, drop=0.2, drop_path=0.3, img_size=32)
    assert evaluate.eval_model_config(cfg) == ModelConfig(name="vit_nano", num_classes=4, img_size=32, drop=0.0,
                                                          drop_path=0.0)
