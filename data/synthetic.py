"""Synthetic images for throughput runs and tests: deterministic random tensors, no files, no transforms.

Each sample is a function of (seed, index) only, so loaders with any number of workers, samplers and
resumes see identical data. Labels are index % num_classes (learnable only by memorising).
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class SyntheticDataset(Dataset):
    """`size` normalized-looking images of shape (3, img_size, img_size)."""

    def __init__(self, size: int, img_size: int, num_classes: int, seed: int = 0):
        self.size, self.img_size, self.num_classes, self.seed = size, img_size, num_classes, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)  # a CPU generator: the image is CPU data
        return torch.randn(3, self.img_size, self.img_size, generator=g, device="cpu"), i % self.num_classes
