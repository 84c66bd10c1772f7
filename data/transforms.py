"""Train/eval transforms from `DataConfig` through timm's `create_transform` (DeiT/Swin pipeline).

Train: RandomResizedCrop (bicubic), flip, RandAugment, normalize, random erasing. Eval: resize to
img_size / crop_pct, center crop, normalize. RandAugment switches colour jitter off inside timm.
data.auto_augment is checked section by section against what timm's parser reads (`check_auto_augment`): timm
skips a section it does not read without a word, and clips a magnitude or probability beyond its range. A policy
whose rotate, shear or translate ops would resample with a filter PIL's affine transforms refuse (box, hamming,
lanczos) is refused with the filter (`check_policy_interpolation`).
"""
from __future__ import annotations

import re
from typing import Optional

from timm.data import auto_augment as timm_aa
from timm.data import create_transform

from configs import ConfigError
from configs.schema import TRAIN_TRANSFORM_KEYS, DataConfig


def train_transform_settings(cfg: DataConfig) -> dict:
    """{key: value} of TRAIN_TRANSFORM_KEYS, as JSON writes them (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, getattr(cfg, k)) for k in TRAIN_TRANSFORM_KEYS)}


def build_transform(cfg: DataConfig, img_size: int, is_training: bool):
    if is_training:
        check_auto_augment(cfg.auto_augment)
        check_policy_interpolation(cfg.auto_augment, cfg.interpolation)
        return create_transform(
            img_size, is_training=True, scale=tuple(cfg.scale), ratio=tuple(cfg.ratio), hflip=cfg.hflip,
            color_jitter=cfg.color_jitter, auto_augment=cfg.auto_augment or None,
            interpolation=cfg.interpolation, mean=tuple(cfg.mean), std=tuple(cfg.std), re_prob=cfg.reprob,
            re_mode=cfg.remode, re_count=cfg.recount)
    return create_transform(img_size, is_training=False, interpolation=cfg.interpolation,
                            mean=tuple(cfg.mean), std=tuple(cfg.std), crop_pct=cfg.crop_pct,
                            crop_mode=cfg.crop_mode)


# What timm's parser of each policy family (timm.data.auto_augment; create_transform picks the family by the
# policy's start) reads from a '-' section: a key followed by a number. Any other section is skipped without a word
# (rand-m9-inc, a forgotten value, trains the non-increasing set), so it is refused here.
POLICY_KEYS = {
    "rand": ("m", "n", "p", "mstd", "mmax", "inc"),  # rand_augment_transform
    "augmix": ("m", "w", "d", "a", "b", "mstd"),  # augment_and_mix_transform
    "auto": ("mstd",),  # auto_augment_transform: original, originalr, v0, v0r, 3a
}
# RandAugment's t<name> section picks a transform set by name; timm takes any name it does not know (a typo too)
# for its default set
RAND_TRANSFORM_SETS = ("weights", "3aw", "3a")
FAMILY_NAMES = {"rand": "RandAugment", "augmix": "AugMix", "auto": "AutoAugment"}
# timm's AugmentOp clips every magnitude it draws to [0, mmax or 10] (its _LEVEL_DENOM); AugMix's parser reads no
# mmax, so its cap is always 10
MAGNITUDE_CAP = 10
# PIL's affine transforms (Image.transform, Image.rotate), which timm's rotate, shear and translate ops call with
# data.interpolation as their resampling filter, take these filters only: any other is a ValueError at the op's
# first draw, in the middle of training, from inside a loader worker
AFFINE_INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
AFFINE_OPS = (timm_aa.rotate, timm_aa.shear_x, timm_aa.shear_y, timm_aa.translate_x_abs, timm_aa.translate_y_abs,
              timm_aa.translate_x_rel, timm_aa.translate_y_rel)


def policy_family(policy: str) -> str:
    """The parser timm's create_transform hands `policy` to: 'rand', 'augmix' or 'auto' (AutoAugment)."""
    return "rand" if policy.startswith("rand") else "augmix" if policy.startswith("augmix") else "auto"


def check_auto_augment(policy: str) -> None:
    """data.auto_augment as timm parses it (rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, v0, ...): a policy timm
    cannot read is a ConfigError naming the key, not an AssertionError from inside timm, and so is one with a
    section that timm would skip or overrule without a word (`check_policy_sections`)."""
    if not policy:
        return
    check_policy_sections(policy)
    try:
        create_transform(32, is_training=True, auto_augment=policy)
    except Exception as e:  # noqa: BLE001 - timm asserts, or raises KeyError / ValueError, by policy part
        raise ConfigError(f"data.auto_augment={policy!r} is not a policy timm can read ({type(e).__name__}: "
                          f"{e}); e.g. rand-m9-mstd0.5-inc1 (RandAugment), augmix-m5-w4-d2, v0, or \"\" for none"
                          ) from None


def check_policy_sections(policy: str) -> None:
    """Each '-' section after the policy's name must be one timm's parser for its family reads: a key of
    POLICY_KEYS with a number (m9, mstd0.5, inc1), or for RandAugment t<name> naming one of RAND_TRANSFORM_SETS;
    each key once (timm keeps the first mstd and the last of the others); a value timm takes without overruling it
    (`overruled_value_problem`). Else a ConfigError naming the section."""
    family = policy_family(policy)
    keys = POLICY_KEYS[family]
    readable = ", ".join([f"{k}<number>" for k in keys] + (["t<set>"] if family == "rand" else []))

    def refused(section: str, why: str) -> ConfigError:
        return ConfigError(f"data.auto_augment={policy!r} is not a policy timm can read: section {section!r} {why}")

    seen: dict[str, str] = {}
    for section in policy.split("-")[1:]:
        if family == "rand" and section.startswith("t"):  # as timm reads it: t<name> before any number
            key = "t"
            if section[1:] not in RAND_TRANSFORM_SETS:
                sets = ", ".join(f"t{name}" for name in RAND_TRANSFORM_SETS)
                raise refused(section, f"names no transform set timm has ({sets}); timm would use its default set "
                                       f"instead")
        else:
            key, number, _ = (re.split(r"(\d.*)", section) + ["", ""])[:3]  # timm's split: key, then from the digit
            parser = f"timm's {FAMILY_NAMES[family]} parser"
            if not number:
                raise refused(section, f"has no number, so {parser} would skip it without a word (it reads "
                                       f"{readable})")
            if key not in keys:
                raise refused(section, f"is no setting {parser} reads ({readable})")
        if key in seen:
            raise refused(section, f"sets {key} again after {seen[key]!r}, and timm would keep only one of them: "
                                   f"give it once")
        seen[key] = section
    problem = overruled_value_problem(family, {key: section[len(key):] for key, section in seen.items()})
    if problem is not None:
        raise refused(*problem)


def overruled_value_problem(family: str, values: dict) -> Optional[tuple]:
    """(section, why) of a value timm takes and then overrules without a word, or None. `values`: {key: its
    number as written} of a policy of `family`. timm clips a magnitude above its cap (mmax, else 10) to the cap, so
    rand-m30 trains as rand-m10; reads mmax0 as no cap (10); and applies an op of probability 1 or more always, so
    p5 trains as p1. A number timm cannot read is left to timm's parser (check_auto_augment names it)."""
    def read(key, kind):
        try:
            return kind(values[key]) if key in values else None
        except ValueError:
            return None

    magnitude = read("m", int)
    cap = read("mmax", int) if family == "rand" else None
    if "mmax" in values and cap is None:  # timm's int() fails on it: check_auto_augment names that error
        return None
    if cap == 0:
        return f"mmax{values['mmax']}", (f"is read by timm as no cap, which is {MAGNITUDE_CAP}: give mmax above 0 "
                                          f"(the highest magnitude), or leave it out")
    if magnitude is not None and magnitude > (cap or MAGNITUDE_CAP):
        if family == "rand":
            raise_cap = f"mmax{magnitude} instead of mmax{values['mmax']}" if cap else f"mmax{magnitude} with it"
            fix = f"give {raise_cap} (timm's cap), or m{cap or MAGNITUDE_CAP}"
        else:
            fix = f"give m{MAGNITUDE_CAP} or lower (timm's AugMix reads no mmax)"
        return f"m{values['m']}", (f"is above timm's magnitude cap {cap or MAGNITUDE_CAP}, to which timm clips every "
                                    f"magnitude it draws without a word; {fix}")
    probability = read("p", float) if family == "rand" else None
    if probability is not None and not 0 <= probability <= 1:
        return f"p{values['p']}", ("is no probability: timm applies each op always at p1 or more, so it would train "
                                   "as p1; give p between 0 and 1")
    return None


def policy_ops(policy: str) -> list:
    """The ops (timm AugmentOp) of the transform timm builds for `policy`, a policy check_auto_augment passed."""
    family = policy_family(policy)
    if family == "rand":
        return list(timm_aa.rand_augment_transform(policy, {}).ops)
    if family == "augmix":
        return list(timm_aa.augment_and_mix_transform(policy, {}).ops)
    return [op for sub_policy in timm_aa.auto_augment_transform(policy, {}).policy for op in sub_policy]


def check_policy_interpolation(policy: str, interpolation: str) -> None:
    """data.interpolation with data.auto_augment: timm hands the interpolation to the policy's ops as their
    resampling filter, and PIL's affine transforms (rotate, shear, translate) take AFFINE_INTERPOLATIONS only. A
    policy with such an op under any other filter is a ConfigError naming both keys; one without (3a, rand-t3a)
    passes, and so does every filter for the eval transform, which resizes only."""
    if not policy or interpolation in AFFINE_INTERPOLATIONS:
        return
    affine = sorted({op.name for op in policy_ops(policy) if op.aug_fn in AFFINE_OPS})
    if affine:
        raise ConfigError(f"data.interpolation={interpolation} with data.auto_augment={policy!r}: the policy's "
                          f"{', '.join(affine)} ops resample through PIL's affine transforms, which take "
                          f"{', '.join(AFFINE_INTERPOLATIONS)} only (a ValueError in the middle of training); set "
                          f"data.interpolation to one of those, or data.auto_augment=\"\" for no policy")
