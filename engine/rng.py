"""Deterministic seeds derived from counters, so that no RNG state has to be checkpointed."""
from __future__ import annotations

import random

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers: each part is xored in and mixed with the constants of
    splitmix64's finalizer (a variant: the part enters where splitmix64 shifts by 30)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h >> 1


def seed_all(seed: int, cuda: bool = True) -> None:
    """Seed python's, numpy's and torch's global RNGs
    (torch's CUDA generators too, unless `cuda` is False)."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    if cuda:
        torch.manual_seed(seed)
    else:  # e.g. in data workers: leave the CUDA generators alone
        torch.random.default_generator.manual_seed(seed)
