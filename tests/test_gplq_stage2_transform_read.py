"""GPLQ's QwT images are train-split images with the training transform or the eval one
(quant.gplq.stage2_train_transform). Synthetic images get no transform, so both give the same images there: the
option is refused beside synthetic data, as quant.calib_transform is."""
import pytest
import torch

from configs.loader import ConfigError, load_config
from data.loader import calibration_images
from tests.conftest import DEBUG_CONFIG, DEMO_CONFIG, quant_option_refusal


def test_synthetic_images_are_the_same_under_both_transforms():
    """The property the refusal rests on (the images GPLQ's stage 2 draws: data.calibration_images)."""
    cfg = load_config([DEBUG_CONFIG])
    assert cfg.data.dataset == "synthetic"
    both = [calibration_images(cfg.data, 32, cfg.model.num_classes, 8, 0, train_transform=t)
            for t in (True, False)]
    assert torch.equal(*both)


@pytest.mark.parametrize("value", ["true", "false"])
def test_it_is_refused_beside_synthetic_images(value):
    with pytest.raises(ConfigError, match=rf"^quant.gplq.stage2_train_transform={value} would be ignored: .*read "
                                          r"only when data.dataset is folder or digits, and it is synthetic"):
        load_config([DEBUG_CONFIG], [f"quant.gplq.stage2_train_transform={value}"])


def test_it_is_taken_where_a_transform_prepares_the_images():
    cfg = load_config([DEMO_CONFIG], ["quant.gplq.stage2_train_transform=false"])
    assert cfg.data.dataset == "digits" and cfg.quant.gplq.stage2_train_transform is False


def test_evaluate_refuses_it_with_one_error_line(tmp_path, capsys):
    line = quant_option_refusal(tmp_path, capsys, "gplq", "quant.gplq.stage2_train_transform=false",
                                config=DEBUG_CONFIG)
    assert line.startswith("error: quant.gplq.stage2_train_transform=false would be ignored")
