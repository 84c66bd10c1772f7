"""Deterministic seeds derived from counters, so that no RNG state has to be checkpointed."""
from __future__ import annotations

_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (the splitmix64 finalizer folded over the parts)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h >> 1
