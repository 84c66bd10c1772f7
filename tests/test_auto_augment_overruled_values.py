"""data.auto_augment values that timm takes and then overrules without a word are refused by section: a magnitude
above timm's cap (mmax, else 10; AugMix reads no mmax) is clipped to the cap, mmax0 reads as no cap, and a
probability above 1 applies every op always. Every value timm keeps as given passes.

The reference is what timm's ops do at run time: the magnitude that reaches each op's level function, and the
images a policy gives under fixed seeds, not the check's own rules."""
import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.auto_augment import augment_and_mix_transform, rand_augment_transform

from configs import ConfigError
from configs.schema import DataConfig
from data.transforms import build_transform, check_auto_augment

IMAGE = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 48, 3), dtype=np.uint8))


def magnitudes_used(policy: str) -> set:
    """The magnitudes timm's ops hand their level functions for `policy` (mstd0: no noise), each op applied once."""
    make = rand_augment_transform if policy.startswith("rand") else augment_and_mix_transform
    used = set()
    for op in make(policy).ops:
        if op.level_fn is None:  # AutoContrast, Equalize, Invert: no magnitude
            continue
        level_fn = op.level_fn
        op.level_fn = lambda magnitude, hparams, level_fn=level_fn: used.add(magnitude) or level_fn(magnitude, hparams)
        op.prob = 1.0
        op(IMAGE)
    return used


def refused(policy: str) -> bool:
    try:
        check_auto_augment(policy)
    except ConfigError as e:
        assert "\n" not in str(e)
        return True
    return False


@pytest.mark.parametrize("base", ["rand-mstd0-inc1", "rand-mstd0-mmax5", "rand-mstd0-mmax20", "augmix-mstd0"])
def test_a_magnitude_is_refused_exactly_when_timm_clips_it(base):
    for m in range(0, 31):
        policy = f"{base}-m{m}"
        clipped = magnitudes_used(policy) != {m}
        assert refused(policy) == clipped, policy
    assert refused(f"{base}-m30"), "the reference found no cap"


def test_the_refusal_of_a_magnitude_names_the_section_and_the_cap_to_give():
    with pytest.raises(ConfigError, match=r"section 'm30' is above timm's magnitude cap 10.*give mmax30 with it"):
        check_auto_augment("rand-m30-inc1")
    with pytest.raises(ConfigError, match=r"section 'm12' .* cap 10.*give mmax12 instead of mmax10"):
        check_auto_augment("rand-m12-mmax10")
    with pytest.raises(ConfigError, match=r"section 'm11' .* cap 10.*give m10 or lower"):
        check_auto_augment("augmix-m11-w3")


def test_mmax0_is_refused_as_timm_reads_it_as_no_cap():
    assert magnitudes_used("rand-m10-mstd0-mmax0") == {10}  # not capped at 0: timm's `mmax or 10`
    with pytest.raises(ConfigError, match=r"section 'mmax0' is read by timm as no cap"):
        check_auto_augment("rand-m10-mmax0")


def images(policy: str) -> torch.Tensor:
    """The training transform's images of one picture under 30 fixed seeds."""
    transform = build_transform(DataConfig(auto_augment=policy, reprob=0.0), 32, is_training=True)
    out = []
    for seed in range(30):
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        out.append(transform(IMAGE))
    return torch.stack(out)


def test_a_probability_is_refused_exactly_when_timm_trains_it_as_p1():
    always = images("rand-m9-p1-inc1")
    for p in ("0", "0.3", "0.9", "1", "1.0"):
        assert not refused(f"rand-m9-p{p}-inc1")
        assert torch.equal(images(f"rand-m9-p{p}-inc1"), always) == (float(p) == 1), p
    for p in ("1.5", "5", "1e3"):
        built = rand_augment_transform(f"rand-m9-p{p}-inc1")
        assert all(op.prob > 1 for op in built.ops)  # taken as given, then applied always (`prob < 1.0` fails)
        with pytest.raises(ConfigError, match=rf"section 'p{p}' is no probability"):
            check_auto_augment(f"rand-m9-p{p}-inc1")


def test_with_mmax_a_magnitude_above_10_is_a_policy_of_its_own():
    """rand-m30-inc1 trains as rand-m10-inc1 (refused above); with mmax30 its images are its own."""
    assert refused("rand-m30-inc1") and not refused("rand-m30-mmax30-inc1")
    assert not torch.equal(images("rand-m30-mmax30-inc1"), images("rand-m10-inc1"))


@pytest.mark.parametrize("policy", ["rand-m9-mstd0.5-inc1", "rand-m9", "rand-m5", "3a", "rand-m10-mstd0.5",
                                    "rand-m9-mmax10-p0.5-mstd101", "rand-mmax5", "augmix-m10-w3", "augmix-m5-w4-d2"])
def test_shipped_and_documented_policies_pass(policy):
    check_auto_augment(policy)
