"""data.interpolation given to evaluate.py on digits is refused where no image of the evaluation is resampled with it:
DigitsDataset makes its images at data.digits_img_size with bicubic whatever the setting, an eval transform at the
model's input size and data.crop_pct=1.0 does not resize them, and no planned pipeline sees training-transform images
(whose random crop resamples with it). Where any of these resamples, it passes; so does the checkpoint's own value (a
sweep passes a run's data overrides on)."""
import dataclasses

import pytest
import torch

import evaluate
import train
from configs import ConfigError, load_config
from data.loader import build_dataset
from tests.conftest import DEMO_CONFIG


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A vit_nano (32 px) trained one update on digits at the demo's data.crop_pct=1.0 and bicubic."""
    out = tmp_path_factory.mktemp("digits")
    train.main(load_config([DEMO_CONFIG], [f"out_dir={out}", "model.name=vit_nano", "train.max_steps=1",
                                           "sched.epochs=1", "sched.warmup_epochs=0", "log.tensorboard=false"]))
    return str(out / "best.pt")


def val_images(data, interpolation: str) -> torch.Tensor:
    """The first digits val images as the eval transform gives them under `interpolation` (the model's 32 px)."""
    dataset = build_dataset(dataclasses.replace(data, interpolation=interpolation), "val", 32, 10,
                            train_transform=False)
    return torch.stack([dataset[i][0] for i in range(8)])


def resolve(checkpoint, *argv):
    return evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, *argv]))


def test_the_refused_override_has_no_effect_on_the_scored_images(checkpoint):
    cfg, _ = resolve(checkpoint, "--quant")
    assert torch.equal(val_images(cfg.data, "bilinear"), val_images(cfg.data, "bicubic"))  # nothing it acts on
    with pytest.raises(ConfigError, match=r"^data.interpolation=bilinear would be ignored: the digits images are made "
                                          r"at data.digits_img_size=32 with bicubic.*\(pipelines: none;.*drop it$"):
        resolve(checkpoint, "--quant", "data.interpolation=bilinear")
    with pytest.raises(ConfigError, match=r"data.interpolation=nearest would be ignored: .*\(pipelines: repq;"):
        resolve(checkpoint, "--quant", "repq", "data.interpolation=nearest")


@pytest.mark.parametrize("setting", ["data.crop_pct=0.875", "data.digits_img_size=28"])
def test_where_the_eval_transform_resizes_the_override_passes_and_acts(checkpoint, setting):
    cfg, _ = resolve(checkpoint, "--quant", setting, "data.interpolation=bilinear")
    assert cfg.data.interpolation == "bilinear"
    assert not torch.equal(val_images(cfg.data, "bilinear"), val_images(cfg.data, "bicubic"))


def test_pipelines_that_see_training_transform_images_read_it_and_the_recorded_value_passes(checkpoint):
    for quant in (["--quant", "aphq"], ["--quant", "repq", "quant.calib_transform=train"]):
        cfg, _ = resolve(checkpoint, *quant, "data.interpolation=bilinear")
        assert cfg.data.interpolation == "bilinear"
    cfg, payload = resolve(checkpoint, "--quant", "data.interpolation=bicubic")  # what it was trained with
    assert payload["config"]["data"]["interpolation"] == cfg.data.interpolation == "bicubic"
