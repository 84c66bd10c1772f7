r"""Welch's t-test of the quantization gap between two points of a sweep, per quantized setting.

    python scripts/gap_test.py runs/sweeps/kjv_lm_dose baseline cd10x --seeds 2 3 4 5          # language model
    python scripts/gap_test.py runs/sweeps/fashion_mnist_scratch baseline cd10x --seeds 2 3 4  # image classifier

A run's gap is what quantization costs it, from its eval_best.json: for a language model its quantized minus its
fp32 perplexity (the number of lm_study.py's activation-bit table), for an image classifier its fp32 minus its
quantized top-1 (the drop, in points; dose_report.py's sweeps), exact where the result records the count of images
it scored (seeds that lose the same number of images have the same drop, no spread). Larger is worse in both. For every
(pipeline, bits) that each chosen run of both points was evaluated at, it prints one markdown row: each point's
mean ± sample std, the change of the means (second minus first, and relative to the size of the first: of gaps
near zero, +100 % may be a few thousandths), Welch's t (first point minus second, unequal variances), its
Welch-Satterthwaite degrees of freedom and the two-sided p-value (scipy's t distribution;
scipy.stats.ttest_ind(a, b, equal_var=False) computes the same). Settings that only some of the chosen runs were
evaluated at are named below the table, not tested. Nothing is corrected for multiple comparisons: which tests
were planned before the numbers were seen is the reader's to say (docs/lm_study.md, docs/vit_scratch.md). A point
whose runs were evaluated otherwise than the paper evaluates (model.kwargs, the split, --amp) is marked †, with a
note of how below the table, and a setting computed with other settings than the defaults (e.g.
quant.calib_images=64) *, with a note naming them, a point whose runs their own train.max_steps stopped before the
end of their schedule (short of 99 % of its updates, or beside runs that ended at another update) §, with a note
saying how far they got, and the seeds of a point whose train.seed no file records are
named below the table (one may be a seed counted twice), as dose_report.py and lm_study.py mark them. The
runs are read and checked as lm_study.py (a language model) or dose_report.py (a classifier) reads them
(numbers present, not stale, the runs ending alike: engine/eval_results.refuse_unfinished);
nothing is written.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from fractions import Fraction
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from configs.cli import OneLineParser  # noqa: E402
from engine.console import console_print  # noqa: E402
from engine.tasks import PPL_CAP  # noqa: E402
from engine.train_seeds import unrecorded_seed_note  # noqa: E402
from quant import bits_order  # noqa: E402
from scripts.dose_report import (ERRORS, ReportError, Run, by_point, check_finished, check_numbers,  # noqa: E402
                                 evaluated_marks, read_sweep, settings_marks, stopped_marks)
from scripts.lm_study import FIELDS, quantization_gap  # noqa: E402

# the score of each kind of sweep (eval_best.json's fp / quant entries) -> the gap table's caption
CAPTIONS = {"ppl": "Quantization gap (quantized - fp32 perplexity)",
            "top1": "Top-1 drop (fp32 - quantized top-1, points)"}
DIGITS = {"ppl": 3, "top1": 2}  # a perplexity to thousandths; a top-1 to hundredths of a point


def sweep_score(runs: Sequence[Run]) -> str:
    """'ppl' for a language-model sweep, 'top1' for an image classifier's, by the first run (check_numbers then
    asks every run for that number; read_sweep has refused runs evaluated on other data)."""
    return "ppl" if "ppl" in runs[0].result["fp"] else "top1"


def gap(run: Run, pipeline: str, bits: str, score: str) -> float:
    """What quantization costs the run under `pipeline` at `bits`; larger is worse for both scores."""
    if score == "ppl":
        return quantization_gap(run, pipeline, bits)
    fp, quantized = run.result["fp"], run.result["quant"][pipeline][bits]
    exact = [counted_top1(entry) for entry in (fp, quantized)]
    if None not in exact:  # the same images lost, the same drop: 100 * 403 / 500 - 100 * 402 / 500 is not 0.2
        return float(exact[0] - exact[1])
    return fp["top1"] - quantized["top1"]


def counted_top1(entry: dict) -> Optional[Fraction]:
    """An evaluate.py top-1 as the exact 100 * correct / count (engine/loop.py computes it so) where the entry
    records the count of images it scored; None without a count, or a top-1 that is no share of it."""
    count = entry.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return None
    correct = entry["top1"] * count / 100
    if abs(correct - round(correct)) > 1e-6:  # not a count of images (a number edited by hand): the float it is
        return None
    return Fraction(100 * round(correct), count)


def welch(a: Sequence[float], b: Sequence[float]) -> Optional[tuple[float, float, float]]:
    """(t, degrees of freedom, two-sided p) of Welch's test of mean(a) = mean(b), t > 0 when a's mean is larger;
    None when neither sample varies (no test): a sample whose values differ by float rounding alone (`varies`)
    has no variance."""
    from scipy.stats import t as student_t

    va, vb = (statistics.variance(x) / len(x) if varies(x) else 0.0 for x in (a, b))
    if va + vb == 0:
        return None
    t = (statistics.fmean(a) - statistics.fmean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return t, df, 2 * float(student_t.sf(abs(t), df))


def varies(x: Sequence[float]) -> bool:
    """Whether the values differ by more than float rounding: gaps subtracted from scores of the same resolution
    (a top-1 of 500 images without its count: 0.2 reads 0.20000000000000284 or 0.19999999999998863) differ by
    ~1e-14, and a variance of 1e-28 made a t of 4e13; 1e-9 of the largest is far below any score's resolution."""
    return max(x) - min(x) > 1e-9 * max(1.0, max(map(abs, x)))


def chosen_runs(groups: dict[str, list[Run]], point: str, seeds: Optional[Sequence[int]], root: str) -> list[Run]:
    """The runs of `point` with the given seeds (all its seeds when None), at least two; every asked seed there."""
    if point not in groups:
        raise ReportError(f"{root} has no evaluated runs of point {point!r}; its points: {', '.join(groups)}")
    runs = [r for r in groups[point] if seeds is None or r.seed in seeds]
    missing = sorted(set(seeds or ()) - {r.seed for r in runs})
    if missing:
        raise ReportError(f"{root}: point {point} has no evaluated run of seed(s) {', '.join(map(str, missing))} "
                          f"(its seeds: {', '.join(str(r.seed) for r in groups[point])}); give --seeds it has")
    if len(runs) < 2:
        raise ReportError(f"{root}: point {point} has {len(runs)} chosen run(s); a sample std needs two or more")
    return runs


def settings_of(run: Run) -> set[tuple[str, str]]:
    return {(pipeline, bits) for pipeline, by_bits in run.result["quant"].items() for bits in by_bits}


def report(a: list[Run], b: list[Run], score: str) -> str:
    """The markdown table of every setting all runs of a and b share, and a line per setting only some have;
    `score`: 'ppl' or 'top1' (sweep_score)."""
    runs = a + b
    shared = set.intersection(*map(settings_of, runs))
    partial = sorted(set.union(*map(settings_of, runs)) - shared)
    # a bound or no gap at all (a perplexity at the cap: NaN when the fp32 one is, lm_study.quantization_gap)
    capped = sorted(s for s in shared if any(not gap(r, *s, score) < PPL_CAP for r in runs))
    tested = sorted(shared - set(capped), key=lambda pb: (pb[0], bits_order(pb[1])))
    points = {a[0].point: a, b[0].point: b}
    labels, notes = evaluated_marks(points)  # † and how, as dose_report / lm_study mark
    stopped, stopped_notes = stopped_marks(points)  # § where their own train.max_steps stopped the runs short
    labels = {point: label + stopped[point] for point, label in labels.items()}
    notes += stopped_notes
    starred, settings_notes = settings_marks(points, tested)  # * and which settings, as they mark them
    # seeds tested without a recorded train.seed (read_sweep's check cannot compare them): named, not refused
    seed_notes = [note for point, runs in points.items()
                  if (note := unrecorded_seed_note(point, [(run.folder, run.result) for run in runs]))]
    notes += settings_notes + seed_notes
    names, d = (labels[a[0].point], labels[b[0].point]), DIGITS[score]
    lines = [f"{CAPTIONS[score]}, {names[0]} (seeds "
             f"{', '.join(str(r.seed) for r in a)}) against {names[1]} (seeds {', '.join(str(r.seed) for r in b)}); "
             "Welch's t-test, two-sided, uncorrected:", "",
             f"| setting | {names[0]} | {names[1]} | change | t | df | p |", "|---|---|---|---|---|---|---|"]
    for pipeline, bits in tested:
        ga, gb = ([gap(r, pipeline, bits, score) for r in runs] for runs in (a, b))
        mean_a, mean_b = statistics.fmean(ga), statistics.fmean(gb)
        # the difference first: two near-zero gaps (0.002 -> 0.004) read +100 % relative, a change of nothing
        # relative to the size of the first gap: a negative one (a quantized top-1 above the fp32 one, a perplexity
        # below) gives the change its own sign, not the opposite; a first gap that prints as zero gives none (gaps of
        # mean zero sum to a float residue, 1e-17, whose relative change reads +1e16 %)
        relative = f" ({(mean_b - mean_a) / abs(mean_a) * 100:+.0f} %)" if round(mean_a, d) else ""
        change = f"{mean_b - mean_a:+.{d}f}" + relative
        test = welch(ga, gb)
        outcome = "- | - | - (no spread)" if test is None else "{:.2f} | {:.1f} | {:.2g}".format(*test)
        mark = "*" if any((point, pipeline, bits) in starred for point in points) else ""
        lines.append(f"| {pipeline} {bits.upper()}{mark} | {mean_a:.{d}f} ± {statistics.stdev(ga):.{d}f} | "
                     f"{mean_b:.{d}f} ± {statistics.stdev(gb):.{d}f} | {change} | {outcome} |")
    lines += [f"\n{note}" for note in notes]
    for pipeline, bits in capped:
        lines.append(f"\nnot tested: {pipeline} {bits}: a perplexity at the cap (a bound, not a number)")
    for pipeline, bits in partial:
        lacking = [os.path.basename(r.folder) for r in runs if (pipeline, bits) not in settings_of(r)]
        lines.append(f"\nnot tested: {pipeline} {bits}: not evaluated for {', '.join(lacking)}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> str:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="the folder the sweep's runs trained into (out_root in its scripts/sweep.py "
                                     "file), holding a folder <point>_s<seed> per run, e.g. runs/sweeps/kjv_lm_dose")
    parser.add_argument("points", nargs=2, metavar="POINT",
                        help="the two points, the <point> of their run folders, e.g. baseline cd10x")
    parser.add_argument("--seeds", type=int, nargs="+", help="the seeds of both points to test (default: all)")
    args = parser.parse_args(argv)
    if args.points[0] == args.points[1]:  # a usage error (status 2), as argparse's: before the sweep is read
        parser.error(f"{args.points[0]} given twice: give two different points")
    if not os.path.isdir(args.root):
        raise ReportError(f"{args.root}: no such folder; give the sweep's out_root")
    groups = by_point(read_sweep(args.root))
    a, b = (chosen_runs(groups, point, args.seeds, args.root) for point in args.points)
    score = sweep_score(a + b)
    check_numbers(a + b, FIELDS if score == "ppl" else ("fp.top1",), score)
    check_finished(a + b)
    text = report(a, b, score)
    console_print(text)  # its ± on an ASCII console, or a closed pipe
    return text


if __name__ == "__main__":
    try:
        main()
    except ERRORS as e:  # the sweep reports' user errors, one line each
        sys.exit(f"error: {e}")
