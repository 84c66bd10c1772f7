"""Samplers that make data order and augmentation a pure function of (seed, epoch, position in the epoch).

`SeededSampler` wraps a per-epoch deterministic index sampler (DistributedSampler, RepeatAugSampler)
and yields `(index, sample_seed)` pairs; `SeededDataset` applies its transform under that seed. So the
augmentation of every sample is fixed by its position in the epoch, whatever the number of workers,
and a run resumed in the middle of an epoch (`set_epoch(epoch, start=k)`) sees exactly the samples
and augmentations that the uninterrupted run would have seen. Repeats of one image under repeated
augmentation sit at different positions, so they get different augmentations, as they should. The position is
the sample's place in the epoch's global order, which both base samplers deal out to the ranks round-robin (rank
r's k-th sample is the global k * world + r): a sample keeps its seed under any number of processes, so a run
resumed on another process count, or run on another, sees the same windows and augmentations (the main process's
randomness, mixup and drop path, is drawn per rank: docs/operations.md). Each seed shuffles its epochs in orders of
its own (`order_seed`); checkpoints record the rule (`ORDER_RULE`), so a run begun under the earlier one keeps it.

`ShardedEvalSampler` splits the validation set across ranks without padding or duplicates, so a
distributed evaluation counts every image exactly once (DeiT's DistributedSampler pads).
"""
from __future__ import annotations

import random
from contextlib import contextmanager

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from engine.rng import mix_seed, seed_all


@contextmanager
def forked_rng(seed: int):
    """Seed python, numpy and torch (CPU) RNGs inside the block; restore their states after."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    seed_all(seed, cuda=False)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


# How an epoch's shuffle (DistributedSampler's) is seeded from (train.seed, epoch); checkpoints record it
# (engine/resume.py epoch_position), since a run resumed under another rule would see other samples.
ORDER_RULE = "mix_seed(seed) - mix_seed(0) + epoch"
# The rule before it, torch's DistributedSampler(seed=seed) itself: seed s epoch e shuffled as seed s + 1 epoch e - 1,
# so the seeds of a sweep shared their orders one epoch apart. A checkpoint that records no rule was written under it.
OLD_ORDER_RULE = "seed + epoch"
ORDER_RULES = (ORDER_RULE, OLD_ORDER_RULE)


def order_seed(seed: int, epoch: int, rule: str = ORDER_RULE) -> int:
    """The generator seed of the shuffle of epoch `epoch` of a run of train.seed `seed` under `rule` (`ORDER_RULES`).

    Seed 0 keeps torch's DistributedSampler(seed=0) order (the epoch number itself), which its recorded results and
    figures were trained on. Any other seed starts its epochs at an offset that mix_seed scatters over the 2**63
    generator seeds, not at its own value: two seeds' orders coincide only by chance, not one epoch apart (about
    epochs / 2**32: torch's CPU generator, whose mt19937 randperm shuffles, keeps a seed's low 32 bits). The result
    lies in [0, 2**63) for any 64-bit seed: a valid torch.Generator seed."""
    if rule == OLD_ORDER_RULE:
        return seed + epoch
    if rule != ORDER_RULE:
        raise ValueError(f"unknown sample order rule {rule!r} (known: {', '.join(ORDER_RULES)})")
    return (mix_seed(seed) - mix_seed(0) + epoch) % (1 << 63)


class SeededSampler(Sampler):
    """Yield `(index, seed)` from `base`, skipping the first `start` positions of the epoch; the seed is keyed by
    the global position (`base.num_replicas` ranks, round-robin)."""

    def __init__(self, base: Sampler, seed: int, rank: int):
        self.base, self.seed, self.rank = base, seed, rank
        self.world = int(getattr(base, "num_replicas", 1))  # DistributedSampler's and RepeatAugSampler's
        self.epoch, self.start = 0, 0
        self.order_rule = ORDER_RULE  # a run resumed from a checkpoint of the earlier rule sets that one

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Fix the order and the sample seeds of epoch `epoch`; iterate from its position `start` on."""
        self.epoch, self.start = epoch, start
        if self.shuffles_by_seed():
            # DistributedSampler seeds its shuffle with its own seed + the epoch it is given: the sum is made the
            # epoch's order_seed, whatever seed it was built with
            self.base.set_epoch(order_seed(self.seed, epoch, self.order_rule) - self.base.seed)
        elif hasattr(self.base, "set_epoch"):
            # timm's RepeatAugSampler shuffles by the epoch alone, so it gets an epoch number mixed with the run's
            # seed (the same on every rank)
            self.base.set_epoch(mix_seed(self.seed, epoch) % (1 << 31))

    def shuffles_by_seed(self) -> bool:
        """Whether the base sampler's order follows `order_rule` (DistributedSampler's; not RepeatAugSampler's)."""
        return hasattr(self.base, "seed") and hasattr(self.base, "set_epoch")

    def __iter__(self):
        for pos, idx in enumerate(self.base):
            if pos >= self.start:
                yield int(idx), mix_seed(self.seed, self.epoch, 0, pos * self.world + self.rank)

    def __len__(self) -> int:
        return max(len(self.base) - self.start, 0)


class SeededDataset(Dataset):
    """Index with `(index, seed)`: the wrapped dataset's transform runs under that seed."""

    def __init__(self, base: Dataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key):
        index, seed = key
        with forked_rng(seed):
            return self.base[index]


class ShardedEvalSampler(Sampler):
    """Indices rank, rank + world, ... of a data set of `size`: every index on exactly one rank."""

    def __init__(self, size: int, rank: int, world_size: int):
        self.indices = list(range(rank, size, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
