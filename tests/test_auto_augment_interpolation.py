"""data.interpolation with data.auto_augment: timm hands the interpolation to the policy's ops as their resampling
filter, and PIL's affine transforms (rotate, shear, translate) refuse box, hamming and lanczos with a ValueError at
an op's first draw, in the middle of training. Such a pair is refused when the transform is built (one line naming
both keys); a policy without those ops, and the eval transform, take every filter.

The reference is PIL itself: every op of the transform timm builds for training is applied once, and a pair is
refused exactly when one of them raises."""
import typing

import numpy as np
import pytest
from PIL import Image
from timm.data import create_transform

from configs import ConfigError
from configs.schema import DataConfig
from data.transforms import build_transform

IMAGE = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 48, 3), dtype=np.uint8))
INTERPOLATIONS = typing.get_args(typing.get_type_hints(DataConfig)["interpolation"])
POLICIES = ["rand-m9-mstd0.5-inc1", "rand-m9-t3a", "rand-m9-tweights", "augmix-m5-w4-d2", "v0", "original", "3a"]


def pil_refuses(policy: str, interpolation: str) -> bool:
    """Whether PIL raises in one of the ops of timm's training transform for (policy, interpolation)."""
    transform = create_transform(32, is_training=True, auto_augment=policy, interpolation=interpolation)
    augment = next(t for t in transform.transforms if hasattr(t, "ops") or hasattr(t, "policy"))
    ops = augment.ops if hasattr(augment, "ops") else [op for sub in augment.policy for op in sub]
    for op in ops:
        op.prob = 1.0  # drawn for sure
        try:
            op(IMAGE)
        except ValueError:
            return True
    return False


def refused(policy: str, interpolation: str) -> bool:
    cfg = DataConfig(auto_augment=policy, interpolation=interpolation)
    try:
        build_transform(cfg, 32, is_training=True)
    except ConfigError as e:
        message = str(e)
        assert "\n" not in message and f"data.interpolation={interpolation}" in message
        assert "nearest, bilinear, bicubic" in message and 'data.auto_augment=""' in message
        return True
    return False


@pytest.mark.parametrize("policy", POLICIES)
def test_a_pair_is_refused_exactly_when_pil_would_raise_in_training(policy):
    for interpolation in INTERPOLATIONS:
        assert refused(policy, interpolation) == pil_refuses(policy, interpolation), (policy, interpolation)


def test_the_reference_tells_both_cases_apart():
    assert pil_refuses("rand-m9-mstd0.5-inc1", "lanczos") and not pil_refuses("3a", "lanczos")
    assert not pil_refuses("rand-m9-mstd0.5-inc1", "bicubic")


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
def test_every_filter_resizes_for_evaluation_and_without_a_policy(interpolation):
    cfg = DataConfig(auto_augment="", interpolation=interpolation)
    for training in (False, True):
        assert build_transform(cfg, 32, is_training=training)(IMAGE).shape == (3, 32, 32)
    policy = DataConfig(interpolation=interpolation)  # the default policy: evaluation reads no policy
    assert build_transform(policy, 32, is_training=False)(IMAGE).shape == (3, 32, 32)


def test_calibration_with_the_training_transform_is_refused_before_any_image_is_read():
    from data import calibration_images

    cfg = DataConfig(dataset="digits", interpolation="lanczos")
    with pytest.raises(ConfigError, match=r"^data\.interpolation=lanczos with data\.auto_augment="):
        calibration_images(cfg, 32, 10, count=4, seed=0, train_transform=True)
    assert calibration_images(cfg, 32, 10, count=4, seed=0).shape == (4, 3, 32, 32)  # the eval transform
