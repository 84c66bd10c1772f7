r"""Report of a CD dose-response sweep (configs/sweeps/fashion_mnist_dose.yaml): tables and two figures.

    python scripts/sweep.py configs/sweeps/fashion_mnist_dose.yaml --run --evaluate
    python scripts/dose_report.py runs/sweeps/fashion_mnist_dose --out runs/fashion_mnist_dose_report

Runs are the folders under the sweep root named `<point>_s<seed>`; the seeds of one point are averaged (mean ±
sample std). Two runs of a point trained with one train.seed (a run trained again: one seed twice), and a folder
whose <seed> is not the train.seed of its run (the one its eval_best.json records, or its config.yaml for an older
file), are refused; the seeds of a point that record no train.seed (neither file) are averaged, and a note below the
first table names them (one may be a seed counted twice). A run without eval_best.json, or not evaluated at every
quantized column of the table (an evaluation cut short), is left out, and a warning names it. Runs evaluated
differently (autocast, weights and the kind of checkpoint, data, quantization settings), seeds of one point of other
methods or trained with other settings (the method and recipe their eval_best.json records) or evaluated with other
model.kwargs, and a run that stopped before the others' end (train.max_steps, a signal:
engine/eval_results.refuse_unfinished) are refused. A point evaluated with other model.kwargs than it was trained
with (an evaluate override in the sweep file) is marked † in the tables of evaluated numbers, with a note naming
both; a module maximum that also counts modules outside the blocks (quant.act_max_extra_modules, not the paper's
set) is marked ‡, with a note naming the patterns, and a quantized number computed with other settings than the
defaults (e.g. quant.calib_images=8) *, with a note naming them, as paper_table.py marks them; a point whose runs
their own train.max_steps stopped before the end of their schedule (short of 99 % of its updates, or beside runs
that ended at another update: engine/eval_results.stopped_early) is marked §, with a note saying how far they got.
What is read from each run, and what is written:
  metrics.jsonl          cd/pair_energy/<role> at every log step (logged by baselines too)
                         -> dose_energy.png: energy against update, one line per point (mean over seeds),
                         titled with what the runs trained (best.pt's config: scripts/training_title.py)
  eval_best.json         FP top-1, module / block maxima, percentile and RepQ-ViT top-1 at W4A4 and W3A3
  eval_best_act_max.csv  max |activation| per module -> dose_act_max_types.png: the largest value per
                         module type (norm1, attn.qkv, ..., ls2, block output), one bar per point
  best.pt                the FC1-FC2 alignment peak max_ij alpha_ij (App. A.1, Eq. (13)) at the end (of the
                         weights eval_best.json scored: a best.pt saved after the evaluation is refused); the
                         start is the pretrained backbone (`model.pretrained` of the runs' config, one line per
                         start where points started from other weights; a file that holds other weights than the
                         runs started from, as best.pt records them, is refused)
  -> dose_report.md      the tables, and each point's training settings beside the first point's
                         (the recipe in eval_best.json); printed as well
Files are never overwritten: an existing output is refused unless --overwrite is given.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import re
import sys
from collections import defaultdict
from typing import Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from configs import Config, ConfigError, config_from_dict  # noqa: E402
from configs.cli import OneLineParser  # noqa: E402
from engine.checkpoint import CheckpointError, load_checkpoint, weights_fingerprint  # noqa: E402
from engine.eval_results import (ResultsError, extra_modules, first_difference, metrics_records,  # noqa: E402
                                 missing_number, read_result_file, recipe_difference, refuse_unfinished,
                                 repeated_weights, stopped_early)
from engine.act_max_files import FIELDS as ACT_MAX_FIELDS, csv_differs_from_record  # noqa: E402
from engine.result_table import (dagger_note, entries_nondefault, evaluated_otherwise, extra_modules_note,  # noqa: E402
                                 method_difference, model_kwargs_unlike, settings_note, stopped_note)
from engine.outputs import refuse_others_files, save_figure, source_mark, write_text  # noqa: E402
from engine.run_dir import RunDirError, refuse_existing_outputs  # noqa: E402
from engine.start_weights import check_start_file  # noqa: E402
from engine.train_seeds import recorded_seed, repeated_seed, unrecorded_seed_note  # noqa: E402
from models import ModelError, build_model  # noqa: E402
from engine.figures import new_figure  # noqa: E402
from engine.console import console_print  # noqa: E402
import evaluate  # noqa: E402
from scripts.mechanism import ffn_pairs, rank_directions  # noqa: E402
from scripts.training_title import training_title  # noqa: E402

ROLES = ("qkv", "proj", "fc1", "fc2")
QUANT_COLUMNS = (("percentile", "w4a4"), ("repq", "w4a4"), ("percentile", "w3a3"), ("repq", "w3a3"))
# module types in the order of the data flow through a pre-norm block (engine/act_max.py records the
# output of every sub-module under its name relative to the block)
TYPE_ORDER = ("norm1", "attn.qkv", "attn.proj", "ls1", "norm2", "mlp.fc1", "mlp.act", "mlp.fc2", "ls2",
              "block")
OUTPUTS = ("dose_energy.png", "dose_act_max_types.png", "dose_report.md")
# By it (a figure's PNG text Source) and the report's first line (report_head) --overwrite knows this script's files
SOURCE = "scripts/dose_report.py"
RUN_NAME = re.compile(r"^(?P<point>.+)_s(?P<seed>\d+)$")


class ReportError(ValueError):
    """A sweep folder that holds no finished, evaluated run."""


@dataclasses.dataclass
class Run:
    point: str
    seed: int
    folder: str
    energies: dict   # role -> [(update, energy)]
    result: dict     # eval_best.json
    act_max: list    # rows of eval_best_act_max.csv


def read_run(folder: str, point: str, seed: int) -> Optional[Run]:
    """A run with its metrics and evaluation, or None while it has not been evaluated yet."""
    result_path = os.path.join(folder, "eval_best.json")
    if not os.path.exists(result_path):
        return None
    result = read_result_file(result_path, fields=("fp", "max_act", "quant"))
    missing = [n for n in ("metrics.jsonl", "eval_best_act_max.csv") if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise ReportError(f"{folder} has eval_best.json but no {' or '.join(missing)}: not a run folder of "
                          "train.py and evaluate.py (with quant.act_max_csv=true)")
    energies = defaultdict(list)
    for record in metrics_records(folder):
        for role in ROLES:
            value = record.get(f"cd/pair_energy/{role}")
            if value is not None:
                energies[role].append((record["step"], metric_number(record, f"cd/pair_energy/{role}", folder)))
    missing = [f"cd/pair_energy/{role}" for role in ROLES if not energies[role]]
    if missing:  # train.py logs them at every log step, baselines too
        raise ReportError(f"{os.path.join(folder, 'metrics.jsonl')} has no record of {', '.join(missing)}: not "
                          "the log of a train.py run that reached a log step")
    act_max_path = os.path.join(folder, "eval_best_act_max.csv")
    if csv_differs_from_record(result["max_act"], act_max_path):  # not of the evaluation reported
        raise ReportError(f"{act_max_path} is not the CSV that {result_path} records (its size and SHA-256 are not "
                          f"those evaluate.py wrote: the file was edited or replaced since); put the CSV evaluate.py "
                          f"wrote back, or move it aside and re-evaluate the run (evaluate.py measures the maxima "
                          f"again): python evaluate.py --checkpoint {os.path.join(folder, 'best.pt')} --out "
                          f"{result_path}")
    act_max = read_act_max(act_max_path)
    return Run(point, seed, folder, dict(energies), result, act_max)


def metric_number(record: dict, key: str, folder: str) -> float:
    """A number train.py logged in metrics.jsonl, refused when the record holds something else there, or a
    NaN / inf (train.py writes those as the strings 'nan' / 'inf'; JSON readers give NaN for a bare NaN):
    a diverged run, whose curve would be drawn with a silent gap."""
    value = record[key]
    where = f"{os.path.join(folder, 'metrics.jsonl')}: {key} at update {record['step']} is {value!r}"
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf") or \
            isinstance(value, float) and not math.isfinite(value):
        raise ReportError(f"{where}: the run diverged there; leave it out of the sweep folder, or train it again "
                          "(e.g. with a lower optim.lr)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReportError(f"{where}, not a number: not the log of a train.py run")
    return float(value)


def read_act_max(path: str) -> list[dict]:
    """The rows of a per-layer maxima file of evaluate.py, refused when it lacks a column the reports read, a
    row's block is not an integer (-1: outside the blocks), its kurtosis not a number (NaN is one: an output too
    near a constant to resolve, engine.act_max.kurtosis_from_sums) or its max not a finite number (a NaN or inf
    activation: a model that diverged)."""
    try:  # evaluate.py writes module names and numbers: bytes that are not UTF-8, or a NUL, are damage
        with open(path, newline="", encoding="utf-8") as f:
            return act_max_rows(csv.DictReader(f), path)
    except (UnicodeDecodeError, csv.Error) as e:
        raise ReportError(f"{path} cannot be read as text ({e}): not a per-layer maxima file of evaluate.py, or a "
                          "damaged one; re-evaluate the run") from None


def act_max_rows(reader: csv.DictReader, path: str) -> list[dict]:
    """The rows of read_act_max's file, each checked."""
    missing = [c for c in ACT_MAX_FIELDS if c not in (reader.fieldnames or ())]
    if missing:
        raise ReportError(f"{path} has no column {', '.join(missing)}: not a per-layer maxima file of "
                          f"evaluate.py (columns {', '.join(ACT_MAX_FIELDS)}); re-evaluate the run")
    rows = []
    for row in reader:
        if not re.fullmatch(r"-?\d+", row["block"] or ""):
            raise ReportError(f"{path}, line {reader.line_num}: block {row['block']!r} is not an integer: "
                              "not a per-layer maxima file of evaluate.py; re-evaluate the run")
        for column in ("max", "kurtosis")[:2 if "kurtosis" in reader.fieldnames else 1]:
            try:
                value = float(row[column] or "")
            except ValueError:
                raise ReportError(f"{path}, line {reader.line_num}: {column} {row[column]!r} is not a number: "
                                  "not a per-layer maxima file of evaluate.py; re-evaluate the run") from None
            # a NaN max would drop out of every largest-value-per-type (NaN compares false) and the table would
            # show the others' maximum as the run's
            if column == "max" and not math.isfinite(value):
                raise ReportError(f"{path}, line {reader.line_num}: max {row[column]!r} is not a finite number: "
                                  f"the model's activations overflowed there (a diverged run); leave the run out "
                                  f"of the sweep folder, or train it again (e.g. with a lower optim.lr)")
        rows.append(row)
    return rows


def check_numbers(runs: Sequence[Run], fields: Sequence[str], score: str) -> None:
    """Refuse a run whose eval_best.json lacks a number a report reads: each of `fields` (dotted paths, e.g.
    fp.ppl_bf16) and the `score` of every quantized entry. evaluate.py writes them all; a file cut by hand or
    written by an older version may not have them."""
    for run in runs:
        path = missing_number(run.result, fields, score)
        if path is not None:
            raise ReportError(f"{os.path.join(run.folder, 'eval_best.json')} has no number at {path}: "
                              f"re-evaluate the run: python evaluate.py --checkpoint "
                              f"{os.path.join(run.folder, 'best.pt')} with the sweep's evaluate settings "
                              f"(and --recompute for a quantized entry)")


def read_sweep(root: str) -> list[Run]:
    """The evaluated runs under `root` (folders `<point>_s<seed>`). A run folder without eval_best.json (still
    training, or not evaluated) is left out, and a warning names it: only the seeds column would show it."""
    runs, unevaluated = [], []
    for name in sorted(os.listdir(root)):
        match = RUN_NAME.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            run = read_run(os.path.join(root, name), match["point"], int(match["seed"]))
            if run is not None:
                runs.append(run)
            else:
                unevaluated.append(name)
    if not runs:
        raise ReportError(f"{root}: no evaluated run (<point>_s<seed>/eval_best.json); run the sweep with "
                          f"--run --evaluate first")
    if unevaluated:
        print(f"warning: {len(unevaluated)} run folder(s) under {root} have no eval_best.json and are left out of "
              f"the report: {', '.join(unevaluated)} (evaluate them with the sweep's --run --evaluate to include "
              f"them)", file=sys.stderr)
    seen = {}
    for run in runs:  # baseline_s1 and baseline_s01: one seed named twice, shown as "1,1" and averaged as two
        first = seen.setdefault((run.point, run.seed), run.folder)
        if first != run.folder:
            raise ReportError(f"{first} and {run.folder} both name seed {run.seed} of point {run.point}; give "
                              f"each run of a point its own seed number (folder <point>_s<seed>)")
    labelled = [(run.folder, run.result) for run in runs]
    repeated = repeated_weights(labelled)
    if repeated is not None:  # a copied folder would count as one more seed
        raise ReportError(f"{repeated[0]} and {repeated[1]} were evaluated on the same weights (fingerprint "
                          f"{repeated[2]}): one run would count twice; remove the copy")
    # averaged as seeds and compared as points: runs evaluated differently (bf16 autocast for one seed, another
    # calibration set for one point) would show a difference of evaluation as one of dose
    different = first_difference(labelled)
    if different is not None:
        raise ReportError(f"{different[0]} and {different[1]} were evaluated differently ({different[2]}); "
                          f"evaluate every run alike (the same evaluate.py options and overrides) before they are "
                          f"averaged and compared")
    # averaged as seeds: a run of the point trained with another lr or schedule (the recipe evaluate.py records:
    # every training setting but the seed) would count as one more seed of the point's settings
    for point in sorted({run.point for run in runs}):
        # the method evaluate.py records (Baseline, CD with its strength, TWEO) tells the seeds of results that
        # record no recipe apart too (written before evaluate.py recorded it: recipe_difference passes them)
        other_method = method_difference([(run.folder, run.result) for run in runs if run.point == point])
        if other_method is not None:
            raise ReportError(f"{other_method}, but both are seeds of point {point}; the seeds of a point are "
                              f"averaged: give a run of another method a point of its own (folder <point>_s<seed>)")
        other = recipe_difference([(run.folder, run.result) for run in runs if run.point == point])
        if other is not None:
            raise ReportError(f"{other[0]} and {other[1]} are seeds of point {point} but were trained with other "
                              f"settings ({other[2]}); the seeds of a point are averaged: give a run of other "
                              f"settings a point of its own (folder <point>_s<seed>)")
        # averaged as seeds: the same weights through another forward (a model.kwargs override at evaluation) are
        # another evaluation, compared as paper_table.py --over-seeds compares them; points are marked
        # (evaluated_marks)
        unlike = model_kwargs_unlike([(run.folder, run.result) for run in runs if run.point == point])
        if unlike is not None:
            raise ReportError(f"{unlike}; the seeds of point {point} are averaged: evaluate every run alike (the "
                              f"same evaluate.py model.kwargs overrides)")
        # averaged as seeds: a run trained again with a seed of the point (another thread count: weights a hair
        # apart, which repeated_weights tells apart) would count as one more independent seed
        same_seed = repeated_seed([(run.folder, run.result) for run in runs if run.point == point])
        if same_seed is not None:
            raise ReportError(f"{same_seed[0]} and {same_seed[1]} are both train.seed={same_seed[2]} of point "
                              f"{point}: one seed would count twice; remove one")
    check_seed_names(runs)
    return runs


def check_seed_names(runs: Sequence[Run]) -> None:
    """Refuse a run whose folder's seed (`<point>_s<seed>`) is not the train.seed it was trained with (the seed
    its eval_best.json records, or its config.yaml for an older file: engine/train_seeds.py): its numbers would be
    reported, and chosen by gap_test.py --seeds, as another seed's. Runs that record no seed are not compared."""
    for run in runs:
        seed = recorded_seed(run.result)
        if seed is not None and seed != run.seed:
            raise ReportError(f"{run.folder} is named seed {run.seed} (<point>_s<seed>) but its run was trained with "
                              f"train.seed={seed}: its numbers would be reported as seed {run.seed}'s; rename the "
                              f"folder {run.point}_s{seed}")


def check_finished(runs: Sequence[Run]) -> None:
    """Refuse runs that did not all end alike (engine.eval_results.refuse_unfinished): one stopped before the end
    of its schedule beside runs that trained further would be averaged as one more seed of its point."""
    refuse_unfinished([(run.folder, run.result, "move its folder out of the sweep root") for run in runs])


def evaluated_marks(groups: dict[str, list[Run]]) -> tuple[dict[str, str], list[str]]:
    """Each point's label in the tables of evaluated numbers, with † when its runs were evaluated otherwise
    than trained or than the paper evaluates (engine.result_table.evaluated_otherwise: model.kwargs, data, split,
    autocast, EMA weights; its seeds alike, read_sweep), and the notes naming how, for below the first such table."""
    labels, notes = {}, []
    for point, runs in groups.items():
        changed = sorted({c for r in runs if (c := evaluated_otherwise(r.result))})
        labels[point] = point + ("†" if changed else "")
        if changed:
            notes.append(dagger_note(point, changed))
    return labels, notes


def stopped_marks(groups: dict[str, list[Run]]) -> tuple[dict[str, str], list[str]]:
    """Each point's mark, § when its runs' own train.max_steps stopped them before the end of their schedule
    (engine.eval_results.stopped_early: short of 99 % of its updates, or beside a point's runs that ended at another
    update; `check_finished` has refused a run stopped short beside runs that trained further), as paper_table.py
    marks such a row, and the notes saying how far they got (engine.result_table.stopped_note), for below the first
    table that shows the point's evaluated numbers. '' for a point whose runs reached their schedule's end."""
    runs = [run for point_runs in groups.values() for run in point_runs]
    # each judged by its own folder, as check_finished judges it: eval_best.json is of the best.pt beside it
    results = [{"model": None, **run.result, "checkpoint_kind": "best",
                "checkpoint": os.path.join(run.folder, "best.pt")} for run in runs]
    how = stopped_early([os.path.join(run.folder, "eval_best.json") for run in runs], results,
                        [os.path.basename(run.folder) for run in runs])
    marks, notes = {}, []
    for point in groups:
        short = sorted({text for run, text in zip(runs, how) if run.point == point and text})
        marks[point] = "§" if short else ""
        if short:
            notes.append(stopped_note(point, short))
    return marks, notes


def module_marks(groups: dict[str, list[Run]]) -> tuple[dict[str, str], list[str]]:
    """Each point's mark on its module maximum, ‡ when it also counts modules outside the blocks
    (quant.act_max_extra_modules; not the paper's maximum; the runs of a sweep are alike in it, read_sweep), and the
    notes naming the patterns (engine.result_table.extra_modules_note), for below the table that shows it."""
    marks, notes = {}, []
    for point, runs in groups.items():
        extra = sorted({m for r in runs for m in extra_modules(r.result)})
        marks[point] = "‡" if extra else ""
        if extra:
            notes.append(extra_modules_note(point, extra))
    return marks, notes


def settings_marks(groups: dict[str, list[Run]], columns) -> tuple[dict[tuple[str, str, str], str], list[str]]:
    """'*' for each (point, pipeline, bits) of `columns` whose results were computed with other settings than the
    default config's (engine.result_table.entries_nondefault: a smaller calibration set, another APHQ grid), as
    paper_table.py marks such a cell, and the notes naming them, for below the table: one per pipeline and bits,
    naming the points that share them (the runs of a sweep are alike in them, read_sweep)."""
    marks, points = {}, {}
    for point, runs in groups.items():
        for pipeline, bits in columns:
            holding = [r.result for r in runs if bits in r.result["quant"].get(pipeline, {})]
            unusual = entries_nondefault(pipeline, [r["quant"][pipeline][bits] for r in holding], bits,
                                         [r.get("recipe") for r in holding])
            if unusual:
                marks[(point, pipeline, bits)] = "*"
                points.setdefault((pipeline, bits, tuple(unusual)), []).append(point)
    return marks, [settings_note(", ".join(names), p, b, list(u)) for (p, b, u), names in points.items()]


def complete_runs(root: str, runs: Sequence[Run]) -> list[Run]:
    """The runs evaluated at every quantized column of the table (QUANT_COLUMNS). A run without some of them
    (an evaluation cut short: evaluate.py keeps the entries it finished; or one run with other --quant / --bits)
    is left out as a run not yet evaluated is, and a warning names it and what it lacks; none left is an
    error."""
    lacking = {r.folder: [f"{p} {b}" for p, b in QUANT_COLUMNS if b not in r.result["quant"].get(p, {})]
               for r in runs}
    incomplete = "; ".join(f"{os.path.basename(folder)} lacks {', '.join(what)}" for folder, what in lacking.items()
                           if what)
    fix = (f"finish their evaluation with the sweep's --run --evaluate (it continues one that was cut short), or "
           f"python evaluate.py --checkpoint RUN/best.pt --quant {' '.join(sorted({p for p, _ in QUANT_COLUMNS}))} "
           f"--bits {' '.join(sorted({b for _, b in QUANT_COLUMNS}))}")
    complete = [r for r in runs if not lacking[r.folder]]
    if not complete:
        raise ReportError(f"{root}: no run is evaluated at every column of the table ({incomplete}): {fix}")
    if incomplete:
        print(f"warning: left out of the report, not evaluated at every column of the table: {incomplete}; {fix}",
              file=sys.stderr)
    return complete


def by_point(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Points in dose order: baseline, CD by strength (0.5x, 1x, 10x, ...), then the others (TWEO)."""
    groups = defaultdict(list)
    for run in runs:
        groups[run.point].append(run)

    def order(point: str):
        strength = re.fullmatch(r"cd(\d+(?:\.\d+)?)x", point)  # cd0.5x, cd1x, cd10x
        return (0, 0) if point == "baseline" else (1, float(strength[1])) if strength else (2, point)
    return {p: sorted(groups[p], key=lambda r: r.seed) for p in sorted(groups, key=order)}


def point_settings(groups: dict[str, list[Run]]) -> list[str]:
    """The report's section on what its points are: each point's training settings beside the first point's
    (the baseline), from the recipe each eval_best.json records (every training setting but the seed; the
    seeds of a point share theirs, read_sweep). A dose shows as cd.lam 0.005 -> 0.05; a point trained at
    another lr as well shows that too, where a table alone would credit the dose with its effect."""
    reference, first = next(iter(groups.items()))
    lines = ["", f"Training settings of each point beside {reference}'s (the recipe in its eval_best.json)", ""]
    for point, runs in groups.items():
        recipe, base = runs[0].result.get("recipe"), first[0].result.get("recipe")
        if not recipe or not base:
            lines.append(f"- {point}: not recorded (an eval_best.json written before evaluate.py recorded it)")
            continue
        changes = [f"{key} {json.dumps(base.get(key))} -> {json.dumps(recipe.get(key))}"
                   for key in sorted(set(base) | set(recipe)) if base.get(key) != recipe.get(key)]
        lines.append(f"- {point}: " + ("the reference" if point == reference else
                                       "; ".join(changes) or "the same settings"))
    return lines


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    # hypot: a squared deviation past 1e154 (a diverged seed's perplexity below the cap) overflows ** 2
    std = math.hypot(*(v - mean for v in values)) / math.sqrt(n - 1) if n > 1 else 0.0
    return mean, std


def fmt(values: Sequence[float], digits: int = 2) -> str:
    mean, std = mean_std(values)
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"


def final_energy(run: Run, role: str) -> float:
    return run.energies[role][-1][1]


def type_maxima(run: Run, column: str = "max") -> dict[str, float]:
    """The largest value of `column` (max |activation|, or kurtosis) of each module type over all blocks. A NaN
    kurtosis (an output too near a constant to resolve: engine.act_max.kurtosis_from_sums) is no value and left
    out; a max is finite in every row read_act_max passes."""
    out: dict[str, float] = {}
    for row in run.act_max:
        value = row.get(column)
        if int(row["block"]) < 0 or value in (None, ""):  # outside the blocks; a file without kurtosis
            continue
        if column == "kurtosis" and math.isnan(float(value)):
            continue
        out[row["type"]] = max(out.get(row["type"], float("-inf")), float(value))
    return out


def alignment_peak(model: torch.nn.Module) -> dict:
    """The strongest FC1-FC2 alignment of the model (scripts/mechanism.py `rank_directions`)."""
    top = rank_directions(ffn_pairs(model))[0][0]
    return {k: top[k] for k in ("block", "direction", "row", "alpha", "singular_value")}


# the report reads each run's own best.pt: no other checkpoint stands in for it
RUN_UNREADABLE = "copy the run's folder again from where it trained, or train the run again"


def model_of(checkpoint: str, weights: str = "raw") -> torch.nn.Module:
    """The model of a train.py checkpoint with its raw or EMA weights, loaded by evaluate.py's own loader; EMA
    weights that the checkpoint lacks are refused here, in the report's words (evaluate.py's advice to drop an
    --ema flag is for its own command line, which the user never typed here)."""
    payload = load_checkpoint(checkpoint, unreadable=RUN_UNREADABLE)
    if weights == "ema" and "model_ema" not in payload:
        result = os.path.join(os.path.dirname(checkpoint), "eval_best.json")
        raise ReportError(f"{result} scored EMA weights, but {checkpoint} holds none now (saved again since, by a run "
                          f"without train.ema=true); {reevaluate(checkpoint, result)}")
    args = evaluate.parse_args(["--checkpoint", checkpoint, *(["--ema"] if weights == "ema" else [])])
    return evaluate.load_float_model(config_from_dict(payload["config"]), payload, args).eval()


def evaluated_model(run: Run) -> torch.nn.Module:
    """The run's best.pt with the weights its eval_best.json scored (raw or EMA), refused when best.pt holds
    other weights now (a run resumed after its evaluation saves a new best): the report would put the old
    weights' accuracy and maxima beside the new weights' alignment peak. The JSON records the fingerprint of
    the weights evaluate.py loaded, the same function of the same state dict. Not the repeat of read_result_file's
    refuse_stale it looks like: that one checks the checkpoint the file is of (engine.eval_results.
    evaluated_checkpoint: the one it names, beside it) and passes files without a fingerprint; this one checks the
    best.pt whose weights the report reads, and refuses a file whose weights are unknown."""
    checkpoint = os.path.join(run.folder, "best.pt")
    model = model_of(checkpoint, run.result.get("weights", "raw"))
    scored, now = run.result.get("fingerprint"), weights_fingerprint(model.state_dict())
    if scored != now:
        result = os.path.join(run.folder, "eval_best.json")
        what = (f"{result} scored other weights than {checkpoint} holds now (fingerprint {scored} in the file, "
                f"{now} of best.pt: best.pt was saved after the evaluation)" if scored is not None else
                f"{result} records no weights fingerprint (an older evaluate.py wrote it): whether it scored the "
                f"weights {checkpoint} holds now is unknown")
        raise ReportError(f"{what}; {reevaluate(checkpoint, result)}")
    return model


def reevaluate(checkpoint: str, result: str) -> str:
    """The fix for an evaluation `result` of other weights than `checkpoint` holds now."""
    return (f"re-evaluate it: run the sweep again with --run --evaluate (scripts/sweep.py moves an evaluation older "
            f"than best.pt aside), or move it and its _act_max files aside and run python evaluate.py --checkpoint "
            f"{checkpoint} --out {result} with the sweep's evaluate settings")


def run_config(run: Run) -> Config:
    """The config the run trained with, as its best.pt records it."""
    return config_from_dict(load_checkpoint(os.path.join(run.folder, "best.pt"), unreadable=RUN_UNREADABLE)["config"])


def start_models(groups: dict[str, list[Run]]) -> list[tuple[list[str], Optional[torch.nn.Module]]]:
    """The backbones the runs started from (`model.pretrained` of each run's config, with its model.name), each with
    the names of the runs that did: their points where every run of a point did, else the run folders; one entry
    where all started alike. None for runs that started from a random initialisation, which is no backbone to report.
    Each path is read now: a file that no longer holds the weights a run started from (overwritten since: the
    fingerprint its best.pt records, engine/start_weights.py) is refused, not reported as the start. A best.pt written
    before that record is not checked. Points may start from other weights (a sweep over backbones, or a run from
    scratch beside fine-tunes): the report shows each start, never the first run's as every run's."""
    starts: dict = {}  # (model.pretrained, model.name) -> (the start model or None, its runs)
    for run in (run for runs in groups.values() for run in runs):
        checkpoint = os.path.join(run.folder, "best.pt")
        payload = load_checkpoint(checkpoint, unreadable=RUN_UNREADABLE)
        cfg = config_from_dict(payload["config"]).model
        key = (cfg.pretrained, cfg.name) if cfg.pretrained else None
        if key not in starts:
            starts[key] = (build_model(cfg).eval() if cfg.pretrained else None, [])
        model, members = starts[key]
        problem = check_start_file(payload, checkpoint, cfg.pretrained, model) if model is not None else None
        if problem:
            raise ReportError(problem)
        members.append(run)
    return [(run_names(groups, members), model) for model, members in starts.values()]


def run_names(groups: dict[str, list[Run]], members: Sequence[Run]) -> list[str]:
    """`members` named by their points where a point's runs are all among them, else by their folders."""
    names = []
    for point, runs in groups.items():
        mine = [run for run in runs if run in members]
        names += [point] if len(mine) == len(runs) else [os.path.basename(run.folder) for run in mine]
    return names


def report_head() -> str:
    """The first line of the report: its first table's header, by which --overwrite knows the report."""
    head = ["Point", "Seeds", "FP Top-1", "Max. Act. mod.", "Max. Act. blk."] + \
        [f"{'Percentile' if p == 'percentile' else 'RepQ-ViT'} {b.upper()}" for p, b in QUANT_COLUMNS]
    return "| " + " | ".join(head) + " |"


def tables(groups: dict[str, list[Run]], peaks: dict[str, list[dict]],
           start_peaks: list[tuple[list[str], Optional[dict]]] | Optional[dict]) -> str:
    """The markdown report: accuracy and maxima, pair energies against the baseline, alignment peaks (of each start
    the runs trained from, `start_models`: (the runs' names, its peak or None for a random initialisation); or one
    peak, None for a random initialisation, of the start of every run)."""
    if not isinstance(start_peaks, list):
        start_peaks = [(list(groups), start_peaks)]
    head = report_head()
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    labels, notes = evaluated_marks(groups)
    stopped, stopped_notes = stopped_marks(groups)  # runs their own train.max_steps stopped short: §
    labels = {point: label + stopped[point] for point, label in labels.items()}
    notes += stopped_notes
    marks, extra_notes = module_marks(groups)
    starred, settings_notes = settings_marks(groups, QUANT_COLUMNS)
    # seeds averaged without a recorded train.seed (read_sweep's check cannot compare them): named, not refused
    seed_notes = [note for point, runs in groups.items()
                  if (note := unrecorded_seed_note(point, [(run.folder, run.result) for run in runs]))]
    notes += extra_notes + settings_notes + seed_notes
    for point, runs in groups.items():
        cells = [labels[point], ",".join(str(r.seed) for r in runs),
                 fmt([r.result["fp"]["top1"] for r in runs]),
                 fmt([r.result["max_act"]["module"] for r in runs]) + marks[point],
                 fmt([r.result["max_act"]["block"] for r in runs])]
        for pipeline, bits in QUANT_COLUMNS:
            cells.append(fmt([r.result["quant"][pipeline][bits]["top1"] for r in runs])
                         + starred.get((point, pipeline, bits), ""))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ([""] + notes) if notes else []

    base = {role: mean_std([final_energy(r, role) for r in groups["baseline"]])[0] for role in ROLES} \
        if "baseline" in groups else None
    lines += ["", "Pair energy ||W2 W1n||_F^2 at the last update, mean over the role's pairs (one per block)"
              + (" (change against the baseline)" if base else ""), "",
              "| Point | " + " | ".join(ROLES) + " |", "|---|" + "---|" * len(ROLES)]
    for point, runs in groups.items():
        cells = []
        for role in ROLES:
            mean = mean_std([final_energy(r, role) for r in runs])[0]
            change = f" ({100 * (mean / base[role] - 1):+.1f} %)" if base and point != "baseline" else ""
            cells.append(f"{fmt([final_energy(r, role) for r in runs], 1)}{change}")
        lines.append(f"| {point} | " + " | ".join(cells) + " |")

    lines += ["", "Largest max |activation| per module type over all blocks (mean over seeds)", "",
              "| Point | " + " | ".join(TYPE_ORDER) + " |", "|---|" + "---|" * len(TYPE_ORDER)]
    for point, runs in groups.items():
        per_type = [type_maxima(r) for r in runs]
        lines.append(f"| {labels[point]} | " + " | ".join(
            f"{mean_std([t[k] for t in per_type])[0]:.1f}" if all(k in t for t in per_type) else "-"
            for k in TYPE_ORDER) + " |")

    lines += ["", "FC1-FC2 alignment peak max_ij alpha_ij (App. A.1, Eq. (13)): block / direction i / FC2 "
              "row j / alpha", ""]
    if len(start_peaks) == 1:
        start_peak = start_peaks[0][1]
        none = "n/a (the runs start from a random initialisation)"
        lines.append(f"- pretrained backbone (start): {describe_peak(start_peak) if start_peak else none}")
    else:  # the runs started from other weights: each start, naming its runs
        lines += [f"- pretrained backbone (start) of {', '.join(names)}: "
                  f"{describe_peak(peak) if peak else 'n/a (a random initialisation)'}" for names, peak in start_peaks]
    for point, runs in groups.items():
        lines.append(f"- {point}: " + "; ".join(f"s{r.seed} {describe_peak(p)}"
                                                 for r, p in zip(runs, peaks[point])))
    return "\n".join(lines + point_settings(groups)) + "\n"


def describe_peak(peak: dict) -> str:
    return f"{peak['block']} i={peak['direction']} j={peak['row']} alpha {peak['alpha']:.3f}"


def plot_energies(groups: dict[str, list[Run]], path: str, overwrite: bool, *, title: str, source: str) -> None:
    """Energy against update per role, one line per point (mean over its seeds, the seeds' range shaded), under
    `title`: what the runs trained, which only the caller knows (no default: one sweep's setting on another's figure
    would name a model and data the runs never saw), marked as the figure of the script `source`."""
    fig = new_figure(11, 6.4)
    for k, role in enumerate(ROLES):
        ax = fig.add_subplot(2, 2, k + 1)
        for point, runs in groups.items():
            # the log steps every seed has (a resumed run repeats or drops records around its stop)
            per_seed = [dict(r.energies[role]) for r in runs]
            steps = sorted(set.intersection(*(set(d) for d in per_seed)))
            curves = torch.tensor([[d[step] for step in steps] for d in per_seed])
            style = {"color": "black", "linestyle": "--"} if point == "baseline" else {}
            ax.plot(steps, curves.mean(0).numpy(), label=point, linewidth=1.3, **style)
            if len(runs) > 1:
                ax.fill_between(steps, curves.min(0).values.numpy(), curves.max(0).values.numpy(), alpha=0.15,
                                color=ax.lines[-1].get_color())
        ax.set_yscale("log")
        ax.set_title(f"{role}: mean ||W2 W1n||_F^2 over blocks", fontsize=9)
        ax.set_xlabel("update", fontsize=8)
        ax.grid(alpha=0.3)
        if k == 0:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    # never over a file another command wrote meanwhile; marked: refuse_others_files knows it
    save_figure(fig, path, overwrite, dpi=90, metadata=source_mark(source))


def plot_type_maxima(groups: dict[str, list[Run]], path: str, overwrite: bool,
                     types: Sequence[str] = TYPE_ORDER, *, source: str) -> None:
    """One group of bars per module type, one bar per point (mean over seeds, seed range as error bar), marked as
    the figure of the script `source`."""
    fig = new_figure(11, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(groups)
    for k, (point, runs) in enumerate(groups.items()):
        values = torch.tensor([[type_maxima(r).get(t, float("nan")) for t in types] for r in runs])
        mean = values.mean(0)
        err = torch.stack([mean - values.min(0).values, values.max(0).values - mean])
        x = [i + (k - (len(groups) - 1) / 2) * width for i in range(len(types))]
        ax.bar(x, mean.numpy(), width, yerr=err.numpy(), label=point, capsize=1.5)
    ax.set_xticks(range(len(types)))
    ax.set_xticklabels(types, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("max |activation| over blocks", fontsize=8)
    ax.legend(fontsize=7, ncol=len(groups))
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("Activation maxima by module type (val set, best.pt)", fontsize=9)
    fig.tight_layout()
    # never over a file another command wrote meanwhile; marked: refuse_others_files knows it
    save_figure(fig, path, overwrite, dpi=90, metadata=source_mark(source))


def open_sweep(argv: Optional[Sequence[str]], description: str, example: str, outputs: Sequence[str],
               source: str, md_head: str) -> tuple[argparse.Namespace, dict[str, list[Run]], list[str]]:
    """The command line of a sweep report: (arguments, the evaluated runs by point, the output paths), the
    outputs refused when present (unless --overwrite), and with --overwrite those the script `source` did not
    write (its figures' PNG text Source, its report's first line `md_head`)."""
    parser = OneLineParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help=f"the folder the sweep's runs trained into (out_root in its scripts/sweep.py "
                                     f"file), holding a folder <point>_s<seed> per run, e.g. {example}")
    parser.add_argument("--out", required=True, help=f"folder for {', '.join(outputs)} (made if absent)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the outputs this script wrote in --out (never a file of another's)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.root):
        raise ReportError(f"{args.root}: no such folder; give the sweep's out_root")
    paths = [os.path.join(args.out, name) for name in outputs]
    refuse_existing_outputs(paths, args.overwrite)
    if args.overwrite:  # a figure or notes of another's at these names are not this script's to replace
        refuse_others_files(paths, source, md_head=md_head)
    return args, by_point(read_sweep(args.root)), paths


def main(argv: Optional[Sequence[str]] = None) -> str:
    args, groups, paths = open_sweep(argv, __doc__, "runs/sweeps/fashion_mnist_dose", OUTPUTS, SOURCE,
                                     report_head())
    runs = [r for rs in groups.values() for r in rs]
    if any("top1" not in r.result["fp"] for r in runs):
        raise ReportError(f"{args.root}: not an image-classifier sweep (its eval_best.json have no top-1); "
                          "scripts/lm_study.py reports language models")
    check_numbers(runs, ("fp.top1", "max_act.module", "max_act.block"), "top1")
    groups = by_point(complete_runs(args.root, runs))  # before any output is written
    check_finished([r for rs in groups.values() for r in rs])
    torch.set_num_threads(1)  # a few SVDs of 384 x 1536 matrices: one thread is as fast and shares the CPU
    with torch.no_grad():
        start_peaks = [(names, alignment_peak(start) if start is not None else None)
                       for names, start in start_models(groups)]
        peaks = {p: [alignment_peak(evaluated_model(r)) for r in runs]
                 for p, runs in groups.items()}
    # the runs' own configs name what they trained; read before any output is written
    title = training_title("Pair energy", [run_config(r) for rs in groups.values() for r in rs])
    os.makedirs(args.out, exist_ok=True)
    if args.overwrite:  # nor over another's that another command put there meanwhile
        refuse_others_files(paths, SOURCE, md_head=report_head())
    plot_energies(groups, paths[0], args.overwrite, title=title, source=SOURCE)
    plot_type_maxima(groups, paths[1], args.overwrite, source=SOURCE)
    report = tables(groups, peaks, start_peaks)
    write_text(paths[2], report, args.overwrite)  # UTF-8 whatever the locale: the report has ± and †
    console_print(report)
    return report


# the user's mistakes, one `error:` line each: a best.pt deleted or cut short after its evaluation (one saved
# again after it is refused by evaluated_model), a pretrained backbone that moved, a saved config this version
# cannot read
ERRORS = (ReportError, RunDirError, ResultsError, CheckpointError, ModelError, ConfigError)

if __name__ == "__main__":
    try:
        main()
    except ERRORS as e:
        sys.exit(f"error: {e}")
