"""Train/eval transforms from `DataConfig` through timm's `create_transform` (DeiT/Swin pipeline).

Train: RandomResizedCrop (bicubic), flip, RandAugment, normalize, random erasing. Eval: resize to
img_size / crop_pct, center crop, normalize. RandAugment switches colour jitter off inside timm.
"""
from __future__ import annotations

from timm.data import create_transform

from configs.schema import DataConfig


def build_transform(cfg: DataConfig, img_size: int, is_training: bool):
    if is_training:
        return create_transform(
            img_size, is_training=True, scale=tuple(cfg.scale), ratio=tuple(cfg.ratio), hflip=cfg.hflip,
            color_jitter=cfg.color_jitter, auto_augment=cfg.auto_augment or None,
            interpolation=cfg.interpolation, mean=tuple(cfg.mean), std=tuple(cfg.std), re_prob=cfg.reprob,
            re_mode=cfg.remode, re_count=cfg.recount)
    return create_transform(img_size, is_training=False, interpolation=cfg.interpolation,
                            mean=tuple(cfg.mean), std=tuple(cfg.std), crop_pct=cfg.crop_pct,
                            crop_mode=cfg.crop_mode)
