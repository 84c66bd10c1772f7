"""The training seed of an evaluated run, and the check that results averaged as seeds are of distinct seeds.

evaluate.py records the train.seed of the checkpoint's run as `train_seed` in its result file, beside the `recipe`
(every training setting but the seed). A result file written before it recorded the seed takes it from its run's
config.yaml (`config_seed`) when the file sits in its run folder (engine.eval_results.read_result_file).

Results averaged as seeds (engine.result_table.check_seed_group: paper_table.py --over-seeds, compare_act_max.py;
the seeds of a point of a sweep report: scripts/dose_report.py read_sweep) must each be of a seed of their own
(`repeated_seed`): a run trained again with a seed already there (under another thread count or on another
machine) holds weights a hair apart from the first, which the fingerprint check of a copied run
(engine.eval_results.repeated_weights) tells apart, and would count as one more independent seed.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from .run_dir import saved_train_setting

SEED_FIELD = "train_seed"  # the key of a result file that records the run's train.seed


def _is_seed(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def config_seed(folder: str) -> Optional[int]:
    """The train.seed of the run config.yaml in `folder` records (train.py refuses to resume with another), or None
    without a readable one."""
    seed = saved_train_setting(folder, "seed")
    return seed if _is_seed(seed) else None


def recorded_seed(result: dict) -> Optional[int]:
    """The train.seed a result records (`SEED_FIELD`), or None: a weights file's result, or an older file outside
    its run folder."""
    seed = result.get(SEED_FIELD)
    return seed if _is_seed(seed) else None


def repeated_seed(labelled: Sequence[tuple[str, dict]]) -> Optional[tuple[str, str, int]]:
    """(label, label, seed) of the first two of the (label, result) pairs that record one train.seed, or None;
    results that record none are not compared."""
    seen: dict[int, str] = {}
    for label, result in labelled:
        seed = recorded_seed(result)
        if seed is None:
            continue
        if seed in seen:
            return seen[seed], label, seed
        seen[seed] = label
    return None
