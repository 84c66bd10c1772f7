"""Details of a part that does nothing are refused when given (configs/loader.py READ_ONLY_WHEN): the Mixup's
alphas, switch and mode at data.mixup_prob=0 (no batch is mixed), sched.warmup_prefix without a warmup, and
data.crop_mode on the digits (square images, which every crop mode crops alike). Each premise is checked against
what runs; a value from a file whose deciding key a later layer changes stays moot on purpose, as for every rule."""
from __future__ import annotations

import math
import os
import re

import pytest
import torch

from configs import ConfigError, load_config
from configs.schema import SchedConfig
from tests.conftest import DEMO_CONFIG, ROOT

VIT_B = os.path.join(ROOT, "configs", "pretrain", "vit_b.yaml")  # mixup 0.8, cutmix 1.0: a Mixup is built
SWIN_T = os.path.join(ROOT, "configs", "pretrain", "swin_t.yaml")  # sched.warmup_prefix: true


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
@pytest.mark.parametrize("mixup, cutmix", [(0.8, 1.0), (0.2, 0.0), (0.0, 0.5)])
def test_a_mixup_at_prob_0_mixes_nothing_whatever_its_alphas_and_mode(mode, mixup, cutmix):
    """The premise: timm's Mixup at prob 0 returns the images as they were and label-smoothed one-hot targets,
    (1 - s) * onehot + s / classes, for any alphas, switch and mode."""
    from timm.data import Mixup

    torch.manual_seed(0)
    images, labels = torch.randn(4, 3, 8, 8), torch.tensor([0, 2, 1, 2])
    mix = Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, prob=0.0, switch_prob=0.3, mode=mode, label_smoothing=0.1,
                num_classes=3)
    mixed, targets = mix(images.clone(), labels)
    assert torch.equal(mixed, images)
    want = torch.full((4, 3), 0.1 / 3)
    want[torch.arange(4), labels] += 0.9
    torch.testing.assert_close(targets, want)


@pytest.mark.parametrize("override, key", [("data.mixup=0.5", "data.mixup"), ("data.cutmix=0", "data.cutmix"),
                                           ("data.mixup_switch_prob=0.3", "data.mixup_switch_prob"),
                                           ("data.mixup_mode=elem", "data.mixup_mode")])
def test_a_mixup_detail_beside_mixup_prob_0_is_refused(override, key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(override)} would be ignored: {re.escape(key)} is read only "
                                          r"when data.mixup_prob is"):
        load_config([VIT_B], ["data.mixup_prob=0", override])


def test_mixup_prob_0_switches_a_recipes_mixup_off(tmp_path):
    """data.mixup_prob=0 alone over a recipe whose file sets the alphas (the file's values are moot: the later
    layer changed what decides them); mixup and cutmix both 0 say that no Mixup is built, and are read."""
    recipe = tmp_path / "mix.yaml"
    recipe.write_text("data:\n  mixup: 0.5\n  cutmix: 0.4\n  mixup_switch_prob: 0.3\n  mixup_mode: pair\n")
    assert load_config([VIT_B, str(recipe)], ["data.mixup_prob=0"]).data.mixup_prob == 0
    assert load_config([VIT_B], ["data.mixup_prob=0"]).data.mixup == 0.8
    off = tmp_path / "off.yaml"
    off.write_text("data:\n  mixup_prob: 0.0\n")
    cfg = load_config([VIT_B, str(off)], ["data.mixup=0", "data.cutmix=0"])
    assert (cfg.data.mixup, cfg.data.cutmix) == (0, 0)
    # a later file's mixup details over an earlier layer's mixup_prob 0 are unread, and named with their file
    with pytest.raises(ConfigError, match=r"mix.yaml: data.mixup\S*=\S+ would be ignored: .*drop it from .*mix.yaml"):
        load_config([VIT_B, str(off), str(recipe)])


def cosine(epoch: float, epochs: int, peak: float, low: float) -> float:
    return low + 0.5 * (peak - low) * (1 + math.cos(math.pi * epoch / epochs))


def test_warmup_prefix_without_a_warmup_changes_no_lr_and_is_refused(tmp_path):
    """The premise: without warmup epochs the schedule is the closed-form cosine with or without the prefix; a
    given sched.warmup_prefix=true is refused there, as sched.warmup_lr is; Swin's recipe file value is moot under
    an override of its warmup."""
    from engine.optim import build_scheduler

    for prefix in (False, True):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
        scheduler = build_scheduler(optimizer, SchedConfig(epochs=10, warmup_epochs=0, warmup_prefix=prefix,
                                                           per_step=False, min_lr=1e-4), updates_per_epoch=4)
        for epoch in range(11):
            scheduler.step(epoch)
            assert optimizer.param_groups[0]["lr"] == pytest.approx(cosine(epoch, 10, 0.01, 1e-4), rel=1e-9)
    with pytest.raises(ConfigError, match=r"^sched.warmup_prefix=true would be ignored: sched.warmup_prefix is read "
                                          r"only when the schedule has a warmup"):
        load_config([DEMO_CONFIG], ["sched.warmup_epochs=0", "sched.warmup_prefix=true"])
    assert load_config([DEMO_CONFIG], ["sched.warmup_prefix=true"]).sched.warmup_prefix is True  # 3 warmup epochs
    assert load_config([SWIN_T], ["sched.warmup_epochs=0"]).sched.warmup_prefix is True


def test_crop_mode_on_the_digits_crops_alike_and_is_refused():
    """The premise: a digits image is square, and timm's center, squash and border eval crops give the same pixels;
    data.crop_mode is read on a folder data set only."""
    from data.digits import DigitsDataset
    from data.transforms import build_transform

    cfg = load_config([DEMO_CONFIG]).data
    for digits_size, img_size in ((8, 32), (32, 32), (33, 16)):
        image = DigitsDataset("val", digits_size, 0.2).images[0]
        crops = []
        for mode in ("center", "squash", "border"):
            cfg.crop_mode = mode
            crops.append(build_transform(cfg, img_size, is_training=False)(image))
        assert all(torch.equal(crops[0], crop) for crop in crops[1:]), (digits_size, img_size)
    with pytest.raises(ConfigError, match=r"^data.crop_mode=squash would be ignored: data.crop_mode is read only "
                                          r"when data.dataset is folder, and it is digits"):
        load_config([DEMO_CONFIG], ["data.crop_mode=squash"])
    assert load_config([VIT_B], ["data.crop_mode=squash"]).data.crop_mode == "squash"


LM_CONFIG = os.path.join(ROOT, "configs", "lm", "kjv_nano.yaml")


@pytest.mark.parametrize("override", ["quant.repq.reparam=false", "quant.percentile.act_range=minmax",
                                      "quant.aphq.iters=10", "quant.gplq.steps=10"])
def test_the_options_of_an_image_pipeline_are_refused_on_a_language_model(tmp_path, override):
    """RepQ-ViT, percentile, APHQ and GPLQ quantize image models only (quant/registry.py: their tasks), so no
    evaluation of a language model reads their options: train.py trained and recorded quant.repq.reparam=false on
    configs/lm/kjv_nano.yaml without a word. Refused by name, before anything is written; the same option on the
    digits is taken, and the LM pipelines' options on a language model too."""
    from quant import PIPELINES

    pipeline = override.split(".")[1]
    assert "causal_lm" not in PIPELINES[pipeline].tasks and "classification" in PIPELINES[pipeline].tasks
    with pytest.raises(ConfigError) as refused:
        load_config([LM_CONFIG], [override])
    key = override.partition("=")[0]
    assert str(refused.value).startswith(f"{override} would be ignored: {key} is read only when data.dataset is "), \
        refused.value
    assert str(refused.value).endswith("and it is kjv; drop it or set data.dataset as well"), refused.value
    load_config([DEMO_CONFIG], [override])
    load_config([LM_CONFIG], ["quant.gptq.act_order=true", "quant.smoothquant.alpha=0.6", "quant.rtn.group_size=16"])


def test_every_pipeline_that_quantizes_no_language_model_has_its_options_refused_on_one():
    """The rule's sections (configs/loader.py, which imports no quantization code) against quant/registry.py."""
    from configs.loader import IMAGE_PIPELINE_SECTIONS
    from quant import PIPELINES

    assert set(IMAGE_PIPELINE_SECTIONS) == {f"quant.{name}." for name, p in PIPELINES.items()
                                            if "causal_lm" not in p.tasks}
