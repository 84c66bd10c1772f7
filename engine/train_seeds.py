"""The training seed of an evaluated run, and the check that results averaged as seeds are of distinct seeds.

evaluate.py records the train.seed of the checkpoint's run as `train_seed` in its result file, beside the `recipe`
(every training setting but the seed). A result file written before it recorded the seed takes it from its run's
config.yaml (`config_seed`) when the file sits in its run folder (engine.eval_results.read_result_file).

Results averaged as seeds (engine.result_table.check_seed_group: paper_table.py --over-seeds, compare_act_max.py;
the seeds of a point of a sweep report: scripts/dose_report.py read_sweep) must each be of a seed of their own
(`repeated_seed`): a run trained again with a seed already there (under another thread count or on another
machine) holds weights a hair apart from the first, which the fingerprint check of a copied run
(engine.eval_results.repeated_weights) tells apart, and would count as one more independent seed. A result that
records no seed (an older file outside its run folder, or one whose run left no readable config.yaml) is still
averaged, but it cannot be compared: the table or report names such results below it (`unrecorded_seed_note`),
so that a reader knows one seed may be counted twice there.
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


def unrecorded_seeds(labelled: Sequence[tuple[str, dict]]) -> list[str]:
    """The labels of the (label, result) pairs that record no train.seed (`recorded_seed`), in their order."""
    return [label for label, result in labelled if recorded_seed(result) is None]


def unrecorded_seed_note(label: str, labelled: Sequence[tuple[str, dict]]) -> str:
    """The note below a table for the results of `label` (e.g. 'vit_t CD', a report's point) averaged as seeds (the
    (label, result) pairs `labelled`) of which some record no train.seed, so that `repeated_seed` could not compare
    them: one of them may be a run trained again with a seed already there, counted as one more seed. '' where all
    record theirs, and for a single result (nothing averaged)."""
    unknown = unrecorded_seeds(labelled)
    if not unknown or len(labelled) < 2:
        return ""
    return (f"seeds of {label}: the train.seed of {len(unknown)} of its {len(labelled)} results is not recorded "
            f"({', '.join(unknown)}: written before evaluate.py recorded it, and not in a run folder with its "
            f"config.yaml), so one seed may be counted twice")
