"""The embedded real data set: scikit-learn's 1,797 handwritten 8x8 digits (10 classes, no download).

Images are upscaled (bicubic) to a small square RGB image so that tiny ViTs/Swins and the ordinary
timm transform pipeline apply unchanged. The train/val split is stratified and fixed (seed 0): each split
needs at least one image per class, which bounds data.digits_val_fraction (`check_val_fraction`).
"""
from __future__ import annotations

import math

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from configs import ConfigError


class DigitsDataset(Dataset):
    """`split` of sklearn's digits as PIL RGB images of `img_size` pixels, with integer labels."""

    num_classes = 10

    def __init__(self, split: str, img_size: int = 32, val_fraction: float = 0.2, transform=None):
        from sklearn.datasets import load_digits

        if split not in ("train", "val"):
            raise ValueError(f"digits has splits 'train' and 'val', not '{split}'")
        digits = load_digits()
        images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)  # 0..16 -> 0..255
        idx_train, idx_val = split_indices(val_fraction, digits.target)
        idx = idx_train if split == "train" else idx_val
        self.images = [Image.fromarray(images[i]).resize((img_size, img_size), Image.BICUBIC).convert("RGB")
                       for i in idx]
        self.targets = [int(t) for t in digits.target[idx]]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        img = self.images[i]
        return (self.transform(img) if self.transform else img), self.targets[i]


def split_indices(val_fraction: float, targets=None) -> tuple[np.ndarray, np.ndarray]:
    """The indices into sklearn's digits (`targets`: their labels, read when None) of the train and val splits of
    `val_fraction`: stratified and seeded (seed 0). Splits of two fractions are two draws, neither of which need
    hold the other's val images (train.py compares a fine-tune's val split with its start weights' training)."""
    from sklearn.model_selection import train_test_split

    if targets is None:
        from sklearn.datasets import load_digits
        targets = load_digits().target
    check_val_fraction(val_fraction, len(targets), len(set(targets.tolist())))
    idx_train, idx_val = train_test_split(np.arange(len(targets)), test_size=val_fraction, stratify=targets,
                                          random_state=0)
    return idx_train, idx_val


def check_val_fraction(val_fraction: float, images: int, classes: int) -> None:
    """A ConfigError unless `val_fraction` of `images` leaves at least `classes` images in each split: a stratified
    split (sklearn's train_test_split) needs one image per class in each, or it ends in a ValueError naming its own
    arguments. It takes ceil(val_fraction * images) images for val, the rest for train."""
    val = math.ceil(val_fraction * images)
    if classes <= val <= images - classes:
        return
    # the closed range of 4-decimal values that fit, each bound rounded inwards: (classes - 1) / images < fraction
    # <= (images - classes) / images
    low, high = math.floor((classes - 1) / images * 1e4 + 1) / 1e4, math.floor((images - classes) / images * 1e4) / 1e4
    raise ConfigError(f"data.digits_val_fraction={val_fraction} leaves {val} of the {images} digits images for val "
                      f"and {images - val} for train; a stratified split needs at least {classes} (one per class) in "
                      f"each: set data.digits_val_fraction between {low} and {high}")
