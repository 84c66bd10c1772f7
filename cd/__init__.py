"""Colinearity Decay (CD) and the TWEO baseline: training-time regularizers for vision Transformers.

    from cd import find_pairs, ColinearityDecay, TWEO
    decay = ColinearityDecay(model, lam=0.005)     # paper Sec. 3.3, targets A+B
    decay.attach(optimizer)                        # decoupled update before every real optimizer step

Pure functions for your own loop: `cd.update.colinearity_decay_`, `cd.update.pair_energy`,
`cd.update.pair_penalty`. See cd/README.md.

Names are imported lazily (PEP 562) so that `python -m cd.pairs` runs without importing itself twice.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Pair": "pairs", "find_pairs": "pairs", "find_blocks": "pairs", "unwrap_model": "pairs",
    "ColinearityDecay": "decay", "budget_weight_decay": "decay", "energy_metrics": "decay",
    "colinearity_decay_": "update", "pair_energy": "update", "pair_penalty": "update",
    "TWEO": "tweo", "tweo_penalty": "tweo",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'cd' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
