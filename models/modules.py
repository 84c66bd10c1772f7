"""Finding things in timm models: module-name patterns, the Transformer blocks, the model behind wrappers,
the tensors of a state dict that are not numbers.

Used by everything that inspects a model (quantization rules, activation probes, CD, checkpoints), so
that one definition of each holds: a pattern language over fully-qualified module names (FQNs), the
FQN patterns of timm's pre-norm blocks, and the unwrapping of DDP / torch.compile wrappers (defined in
`cd/wrappers.py`, so that the installable `cd` package needs nothing of this repository).
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Iterable, List, Mapping

import torch


# timm's Transformer blocks: ViT/DeiT `blocks.N`, Swin `layers.N.blocks.M`
BLOCK_PATTERNS = ("blocks.*", "layers.*.blocks.*")


def _match_segments(parts: List[str], pattern: List[str]) -> bool:
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_match_segments(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], pattern[0]) and _match_segments(parts[1:], pattern[1:])


def fqn_matches(fqn: str, patterns: Iterable[str]) -> bool:
    """True if a module name matches any pattern, segment by segment.

    `blocks.*` matches `blocks.3` but not `blocks.3.attn`; `blocks.*.attn.qkv` matches
    `blocks.3.attn.qkv`; `**.qkv` matches any module named qkv; inside a segment fnmatch applies
    (`fc[12]`). Matching is case-sensitive.
    """
    parts = fqn.split(".")
    return any(_match_segments(parts, p.split(".")) for p in patterns)


def nonfinite_tensors(tensors: Mapping[str, Any]) -> list[str]:
    """'name (k NaN, j inf of n values)' for every floating-point tensor of `tensors` (a state dict) that
    holds a NaN or an inf, in order: weights that every evaluation would turn into chance-level numbers."""
    found = []
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.itemsize == 1:
            t = t.float()  # float8 (e4m3fn, e5m2, ...): torch has no isfinite / isinf for them; exact in float32
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            nan = int(torch.isnan(t).sum())
            found.append(f"{name} ({nan} NaN, {int(torch.isinf(t).sum())} inf of {t.numel()} values)")
    return found
