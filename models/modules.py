"""Finding things in timm models: module-name patterns, the Transformer blocks, the model behind wrappers.

Used by everything that inspects a model (quantization rules, activation probes, CD, checkpoints), so
that one definition of each holds: a pattern language over fully-qualified module names (FQNs), the
FQN patterns of timm's pre-norm blocks, and the unwrapping of DDP / torch.compile wrappers (defined in
`cd/wrappers.py`, so that the installable `cd` package needs nothing of this repository).
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Iterable, List

from cd.wrappers import unwrap_model  # noqa: F401  (one definition, shared with cd/)

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
