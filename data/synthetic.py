"""Synthetic images for throughput runs and tests: deterministic random tensors, no files, no transforms.

Each sample is a function of (seed, index) only, so loaders with any number of workers, samplers and
resumes see identical data. Labels are index % num_classes (learnable only by memorising).

Image i of the split with seed s is torch.randn under the seed `image_seed(s, i)` = s * 2**28 + i. torch's CPU
generator keeps only the low 32 bits of a seed (5 and 5 + 2**32 draw the same numbers), so the seeds of all
images must differ in those: 16 splits (seeds 0..15) of up to 2**28 images each, no two images sharing a seed.
The train split (seed 0) has the images of the earlier seeds (i); the val split's (seed 1) changed from seed
1_000_003 + i, which were train images once a train split held more than 1_000_003.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset

INDEX_BITS = 28  # 2**28 images per split; the 4 bits above them tell the splits apart
SPLIT_SEEDS = 1 << (32 - INDEX_BITS)  # 16 splits
MAX_IMAGES = 1 << INDEX_BITS


def image_seed(seed: int, index: int) -> int:
    """The generator seed of image `index` of the split `seed`: distinct for every (seed, index) pair in range, and
    below 2**32, all of which torch's CPU generator keeps."""
    return (seed << INDEX_BITS) | index


class SyntheticDataset(Dataset):
    """`size` normalized-looking images of shape (3, img_size, img_size)."""

    def __init__(self, size: int, img_size: int, num_classes: int, seed: int = 0):
        if not 0 <= seed < SPLIT_SEEDS:
            raise ValueError(f"a synthetic split's seed must be in 0..{SPLIT_SEEDS - 1}, not {seed}")
        if size > MAX_IMAGES:
            from .folder import DataError  # the data set errors the entry points print as one line

            raise DataError(f"{size} synthetic images in one split: at most {MAX_IMAGES} (2**{INDEX_BITS}) get a "
                            f"seed of their own (torch's CPU generator keeps 32 bits of a seed); set "
                            f"data.synthetic_train_size / data.synthetic_val_size to at most {MAX_IMAGES}")
        self.size, self.img_size, self.num_classes, self.seed = size, img_size, num_classes, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(image_seed(self.seed, i))  # a CPU generator: the image is CPU data
        return torch.randn(3, self.img_size, self.img_size, generator=g, device="cpu"), i % self.num_classes
