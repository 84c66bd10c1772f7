"""Colinearity Decay (CD) and the TWEO baseline: training-time regularizers for vision Transformers.

    from cd import find_pairs, ColinearityDecay, TWEO
    decay = ColinearityDecay(model, lam=0.005)     # paper Sec. 3.3, targets A+B
    decay.attach(optimizer)                        # decoupled update before every real optimizer step

Pure functions for your own loop: `cd.update.colinearity_decay_`, `cd.update.pair_energy`,
`cd.update.pair_penalty`. `python -m cd --model NAME` lists a model's pairs. A model whose blocks name their
layers otherwise gives them as `layouts=[Layout(...)]` to find_pairs, ColinearityDecay and TWEO. See cd/README.md.
"""
from .decay import ColinearityDecay, budget_weight_decay, pair_energy_source
from .layouts import LAYOUTS, Layout
from .pairs import Pair, find_pairs
from .tweo import TWEO, tweo_penalty
from .verify import UnsupportedModelError

__all__ = ["ColinearityDecay", "budget_weight_decay", "pair_energy_source", "Pair", "find_pairs", "Layout", "LAYOUTS",
           "TWEO", "tweo_penalty", "UnsupportedModelError"]
