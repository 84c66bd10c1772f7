"""GPLQ's stage 1 is AdamW over two groups: the weights at quant.gplq.lr with weight_decay, the LSQ scales at scale_lr
(null: lr) without decay. At lr 0 with scale_lr null or 0 neither group moves: stage 1 would make its passes for the
model of steps=0, so lr=0 is refused there, pointing at steps=0. With scale_lr above 0 the scales train and lr=0 is
taken, but the weights' decoupled decay p *= 1 - lr * weight_decay is then 1: a weight_decay given is refused."""
import pytest
import torch

from configs.loader import ConfigError, load_config
from configs.quant import GPLQOptions
from device_utils import cpu_pipeline_data
from quant import PIPELINES
from quant_models import images, same_state, tiny_vit
from tests.conftest import quant_option_refusal

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(batch_size_per_gpu=4, init_images=8, stage2_images=8, pca_weight=0.0)


def quantize(**options) -> dict:
    """The state dict of GPLQ on a tiny ViT, `options` handed over as the dataclass (parse_options checks nothing)."""
    model, _ = PIPELINES["gplq"](tiny_vit(), images(8), "w4a4", GPLQOptions(**BASE, **options),
                                 data=cpu_pipeline_data(num_images=16))
    return model.state_dict()


def test_adamw_at_lr_0_moves_nothing_decay_included():
    """The closed form the refusals rest on: AdamW's step is p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)."""
    p = torch.nn.Parameter(torch.randn(5, 3))
    start = p.detach().clone()
    opt = torch.optim.AdamW([p], lr=0.0, weight_decay=0.5)
    for _ in range(3):
        opt.zero_grad()
        (p ** 2).sum().backward()
        opt.step()
    assert torch.equal(p.detach(), start)


def test_stage1_at_lr_0_gives_the_model_of_steps_0():
    assert same_state(quantize(steps=2, lr=0.0), quantize(steps=0))
    assert not same_state(quantize(steps=2, lr=1e-2), quantize(steps=0))  # the comparison can tell updates apart


def test_weight_decay_changes_nothing_at_lr_0():
    """With scale_lr above 0 the scales train (the model is not steps=0's), and the weights' decay does not act."""
    trained = quantize(steps=2, lr=0.0, scale_lr=1e-2)
    assert not same_state(trained, quantize(steps=0))
    assert same_state(trained, quantize(steps=2, lr=0.0, scale_lr=1e-2, weight_decay=0.5))


@pytest.mark.parametrize("overrides", [["quant.gplq.lr=0"], ["quant.gplq.lr=0", "quant.gplq.scale_lr=0"],
                                       ["quant.gplq.scale_lr=0", "quant.gplq.lr=0"]])
def test_the_config_refuses_lr_0_when_the_scales_do_not_train_either(overrides):
    with pytest.raises(ConfigError, match=r"^quant.gplq.(scale_)?lr=0 would be ignored: .*quant.gplq.scale_lr.*"
                                          r"stage 1 would update nothing; give quant.gplq.steps=0"):
        load_config([], overrides)


def test_the_config_takes_lr_0_beside_a_scale_lr_and_scale_lr_0_beside_the_default_lr():
    assert load_config([], ["quant.gplq.lr=0", "quant.gplq.scale_lr=1e-3"]).quant.gplq.lr == 0
    assert load_config([], ["quant.gplq.scale_lr=0"]).quant.gplq.scale_lr == 0


def test_the_config_refuses_weight_decay_at_lr_0_and_takes_it_otherwise():
    with pytest.raises(ConfigError, match=r"^quant.gplq.weight_decay=0.05 would be ignored: .*quant.gplq.lr is "
                                          r"nonzero"):
        load_config([], ["quant.gplq.lr=0", "quant.gplq.scale_lr=1e-3", "quant.gplq.weight_decay=0.05"])
    for lr in (["quant.gplq.lr=1e-3"], []):  # null: the paper's lr rule, above 0
        assert load_config([], [*lr, "quant.gplq.weight_decay=0.05"]).quant.gplq.weight_decay == 0.05


def test_a_recipe_file_with_lr_0_is_refused_naming_it(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("quant:\n  gplq:\n    lr: 0\n")
    with pytest.raises(ConfigError, match=f"^{recipe}: quant.gplq.lr=0 would be ignored"):
        load_config([str(recipe)], [])


def test_the_api_refuses_it_too():
    with pytest.raises(ValueError, match=r"quant.gplq.lr=0(\.0)? would be ignored: .*give quant.gplq.steps=0"):
        PIPELINES["gplq"](tiny_vit(), images(2), "w4a4", {**BASE, "steps": 2, "lr": 0})


def test_evaluate_refuses_it_with_one_error_line(tmp_path, capsys):
    line = quant_option_refusal(tmp_path, capsys, "gplq", "quant.gplq.steps=3", "quant.gplq.lr=0")
    assert line.startswith("error: quant.gplq.lr=0 would be ignored") and "quant.gplq.steps=0" in line
