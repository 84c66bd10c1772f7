"""GPLQ's teacher PCA keeps the smallest multiple of pca_multiple components reaching pca_variance, at least one
multiple and at most the feature width D. Where D <= pca_multiple that is all D components whatever the target, so a
pca_variance other than the default is refused before any work (the API, and evaluate.py in one error line naming
model.name), and passes where the model's features are wider than the multiple."""
import pytest
import torch

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


def test_the_api_refuses_a_target_the_width_makes_moot_before_any_work():
    drawn = []
    data = cpu_pipeline_data(num_images=16)
    data.train_images = lambda count, seed, train_transform: drawn.append(count)
    with pytest.raises(ValueError, match=r"^quant.gplq.pca_variance=0.9 would be ignored: the model's penultimate "
                                         r"features have 48 dims, no more than quant.gplq.pca_multiple=64, .*give "
                                         r"quant.gplq.pca_multiple below 48$"):
        PIPELINES["gplq"](tiny_vit(), images(2), "w4a4", {**SMALL, "pca_variance": 0.9, "pca_multiple": 64}, data=data)
    assert drawn == []


def test_the_api_takes_it_where_the_width_is_above_the_multiple_and_the_default_anywhere():
    _, report = PIPELINES["gplq"](tiny_vit(), images(2), "w4a4", {**SMALL, "pca_variance": 0.9, "pca_multiple": 16},
                                  data=cpu_pipeline_data(num_images=16))
    assert report["stage1"]["pca_dims"] in (16, 32, 48)
    _, report = PIPELINES["gplq"](tiny_vit(), images(2), "w4a4", GPLQOptions(**SMALL, pca_multiple=64),
                                  data=cpu_pipeline_data(num_images=16))
    assert report["stage1"]["pca_dims"] == 48


def test_evaluate_refuses_it_with_one_error_line(tmp_path, capsys):
    """vit_nano on the demo's digits: features 32 wide, the default pca_multiple 32."""
    weights = tmp_path / "w.pt"
    torch.save(build_model(load_config([DEMO_CONFIG], ["model.name=vit_nano"]).model).state_dict(), weights)
    code, _, err = run_entry("evaluate.py", [
        "--config", DEMO_CONFIG, "model.name=vit_nano", f"model.pretrained={weights}", "--quant", "gplq", "--bits",
        "w4a4", "quant.gplq.steps=2", "quant.gplq.init_images=16", "quant.gplq.stage2_images=16",
        "quant.gplq.pca_images=32",
        "quant.gplq.pca_variance=0.9", "--out", str(tmp_path / "r.json")], capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, err
    assert lines[0].startswith("error: model.name=vit_nano: quant.gplq.pca_variance=0.9 would be ignored: the "
                               "model's penultimate features have 32 dims"), lines[0]
