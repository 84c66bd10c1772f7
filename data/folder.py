"""ImageNet-style folders (`root/<split>/<class>/<image>`) through timm's ImageDataset, checked early.

A missing root, a missing split folder or a split without class folders is a clear error here rather
than an exception from inside a DataLoader worker. timm's reader also accepts a .tar per split.
"""
from __future__ import annotations

import os

from timm.data import ImageDataset


class DataError(ValueError):
    """A missing or malformed data set."""


IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def find_split(root: str, split: str) -> str:
    """Path of `split` under `root` (a folder or a .tar); the error lists what is there."""
    if not root:
        raise DataError("data.root is empty: set it to a folder holding train/ and val/ class folders, "
                        "e.g. data.root=/datasets/imagenet (or use data.dataset=digits)")
    if not os.path.isdir(root):
        raise DataError(f"data.root '{root}' does not exist or is not a folder")
    for candidate in (os.path.join(root, split), os.path.join(root, split + ".tar")):
        if os.path.exists(candidate):
            return candidate
    raise DataError(f"no '{split}' split in {root}: found {sorted(os.listdir(root))[:10]}; set "
                    f"data.train_split / data.val_split")


def build_folder_dataset(root: str, split: str, transform=None) -> ImageDataset:
    path = find_split(root, split)
    if os.path.isdir(path):
        classes = [d for d in os.scandir(path) if d.is_dir()]
        if not classes:
            raise DataError(f"{path} has no class sub-folders (expected {path}/<class>/<image>)")
        if not any(f.lower().endswith(IMG_EXTENSIONS) for c in classes[:20] for f in os.listdir(c.path)):
            raise DataError(f"the class folders in {path} hold no images ({', '.join(IMG_EXTENSIONS)})")
    dataset = ImageDataset(path, transform=transform)
    if len(dataset) == 0:
        raise DataError(f"{path} holds no images")
    return dataset


def num_classes_of(dataset) -> int:
    reader = getattr(dataset, "reader", None)
    class_to_idx = getattr(reader, "class_to_idx", None)
    if class_to_idx:
        return len(class_to_idx)
    return getattr(dataset, "num_classes")
