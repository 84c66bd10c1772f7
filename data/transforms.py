"""Train/eval transforms from `DataConfig` through timm's `create_transform` (DeiT/Swin pipeline).

Train: RandomResizedCrop (bicubic), flip, RandAugment, normalize, random erasing. Eval: resize to
img_size / crop_pct, center crop, normalize. RandAugment switches colour jitter off inside timm.
"""
from __future__ import annotations

from timm.data import create_transform

from configs import ConfigError
from configs.schema import TRAIN_TRANSFORM_KEYS, DataConfig


def train_transform_settings(cfg: DataConfig) -> dict:
    """{key: value} of TRAIN_TRANSFORM_KEYS, as JSON writes them (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, getattr(cfg, k)) for k in TRAIN_TRANSFORM_KEYS)}


def build_transform(cfg: DataConfig, img_size: int, is_training: bool):
    if is_training:
        check_auto_augment(cfg.auto_augment)
        return create_transform(
            img_size, is_training=True, scale=tuple(cfg.scale), ratio=tuple(cfg.ratio), hflip=cfg.hflip,
            color_jitter=cfg.color_jitter, auto_augment=cfg.auto_augment or None,
            interpolation=cfg.interpolation, mean=tuple(cfg.mean), std=tuple(cfg.std), re_prob=cfg.reprob,
            re_mode=cfg.remode, re_count=cfg.recount)
    return create_transform(img_size, is_training=False, interpolation=cfg.interpolation,
                            mean=tuple(cfg.mean), std=tuple(cfg.std), crop_pct=cfg.crop_pct,
                            crop_mode=cfg.crop_mode)


def check_auto_augment(policy: str) -> None:
    """data.auto_augment as timm parses it (rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, v0, ...): a policy timm
    cannot read is a ConfigError naming the key, not an AssertionError from inside timm."""
    if not policy:
        return
    try:
        create_transform(32, is_training=True, auto_augment=policy)
    except Exception as e:  # noqa: BLE001 - timm asserts, or raises KeyError / ValueError, by policy part
        raise ConfigError(f"data.auto_augment={policy!r} is not a policy timm can read ({type(e).__name__}: "
                          f"{e}); e.g. rand-m9-mstd0.5-inc1 (RandAugment), augmix-m5-w4-d2, v0, or \"\" for none"
                          ) from None
