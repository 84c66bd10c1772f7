"""GPLQ's teacher PCA keeps the smallest multiple of pca_multiple components reaching pca_variance, at least one
multiple and at most the feature width D. Where D <= pca_multiple that is all D components whatever the target (the
PCA loss a plain feature MSE), so a pca_multiple other than the default is refused there, whatever pca_variance says,
and with the default multiple a pca_variance other than the default (the API, and evaluate.py in one error line
naming model.name); both pass where the model's features are wider than the multiple, and the defaults pass on any
model."""
import pytest
import torch

from cd_models import tiny_vit as narrow_vit  # features 32 wide
from configs import load_config
from configs.quant import GPLQOptions
from device_utils import cpu_pipeline_data
from models.factory import build_model
from quant import PIPELINES
from quant.gplq.pca import components_from_moments
from quant_models import images, tiny_swin, tiny_vit
from tests.conftest import DEMO_CONFIG, run_entry

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(steps=1, batch_size_per_gpu=4, init_images=8, stage2_images=8, pca_images=8)


def moments(width: int, n: int = 200):
    """Summed features, outer products and count of `n` seeded features with a decaying spectrum."""
    g = torch.Generator().manual_seed(0)
    f = (torch.randn(n, width, generator=g, dtype=torch.float64)
         * torch.logspace(0, -2, width, dtype=torch.float64))
    return f.sum(0), f.t() @ f, torch.tensor(float(n), dtype=torch.float64)


@pytest.mark.parametrize("width, multiple", [(32, 32), (24, 32), (48, 64)])
def test_features_no_wider_than_the_multiple_keep_every_component_at_any_target(width, multiple):
    for variance in (0.05, 0.6, 0.999):
        pca = components_from_moments(*moments(width), variance, multiple)
        assert pca.components.shape == (width, width)
        assert pca.explained == pytest.approx(1.0)


def test_wider_features_read_the_target():
    """The boundary of the refusal: at D > pca_multiple the target changes the count."""
    low, high = (components_from_moments(*moments(48), variance, 16).dims for variance in (0.05, 0.999))
    assert low == 16 and high == 48


def test_feature_width_is_the_width_of_the_penultimate_features():
    from quant.gplq.pca_width import feature_width

    for model in (tiny_vit(), tiny_swin()):
        x = images(2)
        assert feature_width(model) == model.forward_head(model.forward_features(x), pre_logits=True).shape[1]


def test_the_explained_fraction_is_at_most_one():
    """All components of these features sum, in float64, to 1.0000000000000002 of the variance: a fraction above 1
    was reported."""
    g = torch.Generator().manual_seed(5)
    f = torch.randn(50, 8, generator=g, dtype=torch.float64)
    mean = f.mean(0)
    evals = torch.linalg.eigh(f.t() @ f / 50 - torch.outer(mean, mean))[0].flip(0).clamp(min=0)
    assert float(evals.cumsum(0)[-1] / evals.sum()) > 1  # the rounding the clamp is for
    pca = components_from_moments(f.sum(0), f.t() @ f, torch.tensor(50.0, dtype=torch.float64), 0.6, 32)
    assert pca.dims == 8 and pca.explained == 1.0


def test_the_api_refuses_a_target_the_width_makes_moot_before_any_work():
    drawn = []
    data = cpu_pipeline_data(num_images=16)
    data.train_images = lambda count, seed, train_transform: drawn.append(count)
    with pytest.raises(ValueError, match=r"^quant.gplq.pca_variance=0.9 would be ignored: the model's penultimate "
                                         r"features have 32 dims, no more than quant.gplq.pca_multiple=32, .*give "
                                         r"quant.gplq.pca_multiple below 32$"):
        PIPELINES["gplq"](narrow_vit(), images(2), "w4a4", {**SMALL, "pca_variance": 0.9},
                          data=data)
    assert drawn == []


@pytest.mark.parametrize("variance", [None, 0.3, 0.9])
@pytest.mark.parametrize("multiple", [48, 64, 1000])
def test_a_chosen_multiple_no_narrower_than_the_features_is_refused_whatever_the_target(multiple, variance):
    """pca_multiple=1000 on features 48 wide kept all 48 at the default target (0.6 unused: a plain feature MSE) and
    was accepted; with pca_variance=0.3 the refusal blamed pca_variance. The refusal names pca_multiple, before any
    image is drawn."""
    drawn = []
    data = cpu_pipeline_data(num_images=16)
    data.train_images = lambda count, seed, train_transform: drawn.append(count)
    given = {**SMALL, "pca_multiple": multiple, **({"pca_variance": variance} if variance is not None else {})}
    shown = variance if variance is not None else GPLQOptions().pca_variance
    with pytest.raises(ValueError) as e:
        PIPELINES["gplq"](tiny_vit(), images(2), "w4a4", given, data=data)
    assert str(e.value) == (f"quant.gplq.pca_multiple={multiple} keeps every component: the model's penultimate "
                            f"features have 48 dims, no more than it, so the teacher PCA keeps all 48 whatever "
                            f"quant.gplq.pca_variance={shown} asks, and its loss is a plain feature MSE; give "
                            f"quant.gplq.pca_multiple below 48, or drop it for the default 32")
    assert drawn == []


def test_the_api_takes_it_where_the_width_is_above_the_multiple_and_the_defaults_anywhere():
    """The default multiple (32) on features 32 wide keeps all 32, as the method always has: not refused, and its
    report's explained fraction is that of every component, 1."""
    _, report = PIPELINES["gplq"](tiny_vit(), images(2), "w4a4", {**SMALL, "pca_variance": 0.9, "pca_multiple": 16},
                                  data=cpu_pipeline_data(num_images=16))
    assert report["stage1"]["pca_dims"] in (16, 32, 48)
    _, report = PIPELINES["gplq"](narrow_vit(), images(2), "w4a4", GPLQOptions(**SMALL),
                                  data=cpu_pipeline_data(num_images=16))
    assert report["stage1"]["pca_dims"] == 32 and report["stage1"]["pca_explained"] <= 1


@pytest.mark.parametrize("override, refusal", [
    ("quant.gplq.pca_variance=0.9", "quant.gplq.pca_variance=0.9 would be ignored: the model's penultimate features "
                                    "have 32 dims"),
    ("quant.gplq.pca_multiple=64", "quant.gplq.pca_multiple=64 keeps every component: the model's penultimate "
                                   "features have 32 dims, no more than it, so the teacher PCA keeps all 32 whatever "
                                   "quant.gplq.pca_variance=0.6 asks, and its loss is a plain feature MSE; give "
                                   "quant.gplq.pca_multiple below 32, or drop it for the default 32, which keeps all "
                                   "32 too but is not refused: the method's own setting")])
def test_evaluate_refuses_it_with_one_error_line(tmp_path, capsys, override, refusal):
    """vit_nano on the demo's digits: features 32 wide, the default pca_multiple 32."""
    weights = tmp_path / "w.pt"
    torch.save(build_model(load_config([DEMO_CONFIG], ["model.name=vit_nano"]).model).state_dict(), weights)
    code, _, err = run_entry("evaluate.py", [
        "--config", DEMO_CONFIG, "model.name=vit_nano", f"model.pretrained={weights}", "--quant", "gplq", "--bits",
        "w4a4", "quant.gplq.steps=2", "quant.gplq.init_images=16", "quant.gplq.stage2_images=16",
        "quant.gplq.pca_images=32",
        override, "--out", str(tmp_path / "r.json")], capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, err
    assert lines[0].startswith(f"error: model.name=vit_nano: {refusal}"), lines[0]
