r"""Report of a from-scratch language-model dose study (configs/sweeps/kjv_lm_dose.yaml): tables and figures.

    python scripts/sweep.py configs/sweeps/kjv_lm_dose.yaml --run --evaluate
    python scripts/lm_study.py runs/sweeps/kjv_lm_dose --out runs/kjv_lm_dose_report

Runs are the folders `<point>_s<seed>` under the sweep root (scripts/dose_report.py reads them), averaged
over seeds (mean ± sample std); runs evaluated differently, seeds of one point trained with other
settings or evaluated with other model.kwargs, a run that stopped before the others' end (sched.steps or
sched.epochs; engine/eval_results.refuse_unfinished) and an eval_best.json of weights other than the run's best.pt
beside it holds now (engine/eval_results.refuse_stale) are refused; a
point evaluated with other model.kwargs than it was trained with is marked † in the tables of evaluated numbers, with
a note naming both, a module maximum that also counts modules outside the blocks (quant.act_max_extra_modules)
‡, with a note naming the patterns, and a quantized number (or gap) computed with other settings than the defaults
(e.g. quant.calib_images=64) *, with a note naming them, as paper_table.py marks them, and a point whose runs their
own train.max_steps stopped before the end of their schedule (short of 99 % of its updates, or beside runs that ended
at another update) §, with a note saying how far they got; seeds of a point whose
train.seed no file records are named below the tables (one may be a seed counted twice). Written, and never
overwritten without --overwrite:
  lm_study.md              the paper's Table 8 settings (bf16 perplexity, with fp32 beside it, RTN-W4A16, GPTQ-W4A16,
                           SmoothQuant-W8A8 and -strict; then W3A16 and strict W6A6 where evaluated), the
                           final pair energies, the quantization gap at W8 with 8 to 4 activation bits
                           (where evaluated below 8), and the maxima and
                           kurtosis per module type (eval_best_act_max.csv), and each point's
                           training settings beside the first point's; printed as well
  lm_study_energy.png      pair energy against update (metrics.jsonl); both curve figures are titled with what
                           the runs trained, from the config their best.pt record (scripts/training_title.py)
  lm_study_outliers.png    act/max_block and act/kurtosis_block at every validation, against update
  lm_study_act_max_types.png   the largest max |activation| per module type, one bar per point
"""
from __future__ import annotations

import math
import os
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from configs import config_from_dict  # noqa: E402
from engine.checkpoint import run_checkpoint_config  # noqa: E402
from engine.train_seeds import unrecorded_seed_note  # noqa: E402
from scripts.dose_report import (ERRORS, ROLES, ReportError, Run, check_finished, check_numbers,  # noqa: E402
                                 evaluated_marks, final_energy, fmt, metric_number, metrics_records, module_marks,
                                 open_sweep, plot_energies, plot_type_maxima, point_settings, settings_marks,
                                 stopped_marks, type_maxima)
from engine.figures import new_figure  # noqa: E402
from engine.outputs import refuse_others_files, save_figure, source_mark, write_text  # noqa: E402
from engine.tasks import PPL_CAP, capped_cell  # noqa: E402
from engine.console import console_print  # noqa: E402
from scripts.training_title import training_title  # noqa: E402

# the paper's Table 8 settings, then lower bit-widths that separate the points more at laptop scale (shown
# where the runs were evaluated at them: evaluate.py --quant rtn gptq --bits w3a16, ... smoothquant_strict w6a6)
COLUMNS = (("rtn", "w4a16"), ("gptq", "w4a16"), ("smoothquant", "w8a8"), ("smoothquant_strict", "w8a8"),
           ("rtn", "w3a16"), ("gptq", "w3a16"), ("smoothquant_strict", "w6a6"))
# the activation-bit table: the quantization gap (quantized - fp32 perplexity, per run) with the weights at
# 8 bits and fewer activation bits, where the activation ranges (and so the outliers) decide the error
# (evaluate.py --quant smoothquant_strict smoothquant --bits w8a6 w8a5 w8a4); shown where evaluated
ACT_BITS = tuple((p, f"w8a{a}") for p in ("smoothquant_strict", "smoothquant") for a in (8, 6, 5, 4))
TYPES = ("norm1", "attn.qkv", "attn.proj", "attn", "norm2", "mlp.fc1", "mlp.act", "mlp.fc2", "mlp", "block")
CURVES = (("act/max_block", "max |block output|"), ("act/kurtosis_block", "largest kurtosis of a block output"),
          ("act/max_module", "max |module output|"), ("val/loss", "val loss (nats / {unit})"))
# what one val loss is per, by the data set the runs were evaluated on (eval_best.json's data.dataset): the embedded
# text is encoded by characters, token files hold tokenizer ids
LOSS_UNITS = {"kjv": "character", "tokens": "token"}
# the numbers of eval_best.json the tables read, besides each quantized entry's perplexity
FIELDS = ("fp.ppl", "fp.ppl_bf16", "max_act.module", "max_act.block", "max_act.kurtosis.block")
OUTPUTS = ("lm_study.md", "lm_study_energy.png", "lm_study_outliers.png", "lm_study_act_max_types.png")
# By it (a figure's PNG text Source) and the report's first line (report_head) --overwrite knows this script's files
SOURCE = "scripts/lm_study.py"


def validation_curve(run: Run, key: str) -> list[tuple[int, float]]:
    """(update, value) of `key` at every validation the run logged (the last record of a repeated step)."""
    points: dict[int, float] = {}
    for record in metrics_records(run.folder):
        if key in record:
            points[record["step"]] = metric_number(record, key, run.folder)
    return sorted(points.items())


def cell(values: list[float], runs: list[Run], digits: int = 3) -> str:
    """fmt of the values, '-' for none, and their count when fewer than the point's seeds (a column some runs
    were not evaluated at): the seeds column lists every run's seed. A perplexity at the cap (an overflowed exp,
    engine.tasks.perplexity) makes the cell that bound, not a mean of it; a gap of a run whose fp32 perplexity is
    at the cap (NaN, `quantization_gap`) makes it 'FP32 capped'."""
    if not values:
        return "-"
    text = "FP32 capped" if any(math.isnan(v) for v in values) else capped_cell(values) or fmt(values, digits)
    return text + (f" (n={len(values)})" if len(values) < len(runs) else "")


def report_head() -> str:
    """The first line of the report: its first table's header, by which --overwrite knows the report."""
    return "| Point | seeds | FP32 PPL | BF16 PPL | " + " | ".join(f"{p} {b.upper()}" for p, b in COLUMNS) + " |"


def tables(groups: dict[str, list[Run]]) -> str:
    lines = [report_head(), "|---|---|---|---|" + "---|" * len(COLUMNS)]
    labels, notes = evaluated_marks(groups)
    stopped, stopped_notes = stopped_marks(groups)  # runs their own train.max_steps stopped short: §
    labels = {point: label + stopped[point] for point, label in labels.items()}
    notes += stopped_notes
    starred, settings_notes = settings_marks(groups, COLUMNS)
    # seeds averaged without a recorded train.seed (read_sweep's check cannot compare them): named, not refused
    seed_notes = [note for point, runs in groups.items()
                  if (note := unrecorded_seed_note(point, [(run.folder, run.result) for run in runs]))]
    notes += settings_notes + seed_notes
    for point, runs in groups.items():
        # the seed numbers, as dose_report.py's Seeds column: a count there ("2") reads as seed 2
        cells = [labels[point], ",".join(str(r.seed) for r in runs), cell([r.result["fp"]["ppl"] for r in runs], runs),
                 cell([r.result["fp"]["ppl_bf16"] for r in runs], runs)]
        for pipeline, bits in COLUMNS:
            values = [r.result["quant"][pipeline][bits]["ppl"] for r in runs
                      if bits in r.result["quant"].get(pipeline, {})]
            cells.append(cell(values, runs) + starred.get((point, pipeline, bits), ""))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ([""] + notes) if notes else []
    lines += ["", "Final pair energy (mean ||W2 W1n||_F^2 over blocks) and activation statistics of best.pt on "
              "the val windows:", "",
              "| Point | " + " | ".join(f"E {r}" for r in ROLES) + " | max module | max block | kurtosis block |",
              "|---|" + "---|" * (len(ROLES) + 3)]
    marks, extra_notes = module_marks(groups)
    for point, runs in groups.items():
        cells = [fmt([final_energy(r, role) for r in runs], 1) for role in ROLES]
        cells += [fmt([r.result["max_act"]["module"] for r in runs]) + marks[point],
                  fmt([r.result["max_act"]["block"] for r in runs]),
                  fmt([r.result["max_act"]["kurtosis"]["block"] for r in runs], 1)]
        lines.append(f"| {labels[point]} | " + " | ".join(cells) + " |")  # maxima of the evaluation
    lines += ([""] + extra_notes) if extra_notes else []
    lines += activation_bit_gaps(groups, labels)
    for column, what in (("max", "Largest max |activation|"), ("kurtosis", "Largest kurtosis")):
        lines += ["", f"{what} per module type over the blocks:", "",
                  "| Point | " + " | ".join(TYPES) + " |", "|---|" + "---|" * len(TYPES)]
        for point, runs in groups.items():
            per_run = [type_maxima(r, column) for r in runs]
            lines.append(f"| {labels[point]} | " + " | ".join(
                cell([m[t] for m in per_run if t in m], runs, 1) for t in TYPES) + " |")
    return "\n".join(lines + point_settings(groups)) + "\n"


def quantization_gap(run: Run, pipeline: str, bits: str) -> float:
    """The run's quantized minus fp32 perplexity (its eval_best.json) under `pipeline` at `bits`. With the
    quantized perplexity at the cap (an overflowed exp, engine.tasks.perplexity) the cap itself: the gap is at
    least about that, a bound, which `cell` shows as such. With the fp32 one at the cap NaN: the float model
    collapsed, and cap - cap is no gap of 0 nor cap - 4 a gap below -exp(700); `cell` says so. gap_test.py tests
    neither."""
    quantized, fp = run.result["quant"][pipeline][bits]["ppl"], run.result["fp"]["ppl"]
    if fp >= PPL_CAP:
        return math.nan
    return PPL_CAP if quantized >= PPL_CAP else quantized - fp


def activation_bit_gaps(groups: dict[str, list[Run]], labels: dict[str, str]) -> list[str]:
    """The ACT_BITS table (markdown lines), or nothing when no run was evaluated below 8 activation bits; labels:
    each point's name in it (evaluated_marks)."""
    def gaps(runs: list[Run], pipeline: str, bits: str) -> list[float]:
        return [quantization_gap(r, pipeline, bits) for r in runs if bits in r.result["quant"].get(pipeline, {})]

    if not any(gaps(runs, p, b) for runs in groups.values() for p, b in ACT_BITS if b != "w8a8"):
        return []
    lines = ["", "Quantization gap (quantized - FP32 perplexity of each run) with 8-bit weights and fewer activation "
             "bits (a run with its quantized perplexity at the cap makes its cell that bound; one with its FP32 "
             "perplexity at the cap has no gap: FP32 capped):", "",
             "| Point | " + " | ".join(f"{p} {b.upper()}" for p, b in ACT_BITS) + " |",
             "|---|" + "---|" * len(ACT_BITS)]
    starred, notes = settings_marks(groups, ACT_BITS)
    for point, runs in groups.items():
        cells = [cell(gaps(runs, p, b), runs) + starred.get((point, p, b), "") for p, b in ACT_BITS]
        lines.append(f"| {labels[point]} | " + " | ".join(cells) + " |")
    return lines + ([""] + notes if notes else [])


def figure_title(subject: str, groups: dict[str, list[Run]]) -> str:
    """`subject` during what the runs trained (scripts/training_title.py), read from the config each run's best.pt
    records, as dose_report.py titles its figure: the model, training from scratch or fine-tuning
    (model.pretrained), and the data set (KJV, or a token folder by its name). Where a run's best.pt is not beside
    its result (a copied result file), the title says so rather than guess."""
    saved = [run_checkpoint_config(os.path.join(r.folder, "best.pt")) for runs in groups.values() for r in runs]
    if any(config is None for config in saved):
        return f"{subject} during training (the runs' settings: no best.pt beside some of their results)"
    return training_title(subject, [config_from_dict(config) for config in saved])


def loss_unit(groups: dict[str, list[Run]]) -> str:
    """What the runs' val loss is per (LOSS_UNITS), from the data set each eval_best.json records; 'token or
    character' where they record none, or several."""
    kinds = {(r.result.get("data") or {}).get("dataset") for runs in groups.values() for r in runs}
    return LOSS_UNITS.get(kinds.pop(), "token or character") if len(kinds) == 1 else "token or character"


def plot_outliers(groups: dict[str, list[Run]], path: str, overwrite: bool, title: str) -> None:
    """The validation curves of CURVES, one line per point (mean over its seeds, the seeds' range shaded)."""
    fig = new_figure(11, 6.4)
    unit = loss_unit(groups)
    for k, (key, panel) in enumerate(CURVES):
        panel = panel.format(unit=unit)
        ax = fig.add_subplot(2, 2, k + 1)
        for point, runs in groups.items():
            per_seed = [dict(validation_curve(r, key)) for r in runs]
            steps = sorted(set.intersection(*(set(d) for d in per_seed)))
            values = [[d[s] for s in steps] for d in per_seed]
            mean = [sum(v[i] for v in values) / len(values) for i in range(len(steps))]
            style = {"color": "black", "linestyle": "--"} if point == "baseline" else {}
            ax.plot(steps, mean, marker=".", label=point, linewidth=1.3, **style)
            if len(runs) > 1:
                ax.fill_between(steps, [min(v[i] for v in values) for i in range(len(steps))],
                                [max(v[i] for v in values) for i in range(len(steps))], alpha=0.15,
                                color=ax.lines[-1].get_color())
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("update", fontsize=8)
        ax.grid(alpha=0.3)
        if k == 0:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    # never over a file another command wrote meanwhile; marked: refuse_others_files knows it
    save_figure(fig, path, overwrite, dpi=90, metadata=source_mark(SOURCE))


def main(argv: Optional[Sequence[str]] = None) -> str:
    args, groups, paths = open_sweep(argv, __doc__, "runs/sweeps/kjv_lm_dose", OUTPUTS, SOURCE, report_head())
    if any("ppl" not in r.result["fp"] for runs in groups.values() for r in runs):
        raise ReportError(f"{args.root}: not a language-model sweep (its eval_best.json have no perplexity); "
                          "scripts/dose_report.py reports image classifiers")
    check_numbers([r for runs in groups.values() for r in runs], FIELDS, "ppl")
    for run in (r for runs in groups.values() for r in runs):  # the curves' logs, before anything is written
        for key, *_ in CURVES:  # a seed without a curve would empty its point's line (steps all seeds have)
            if not validation_curve(run, key):
                fix = ("train the runs with log.act_max=true (configs/lm/kjv_cpu.yaml sets it)"
                       if key.startswith("act/") else
                       "give runs that validated (a run stopped before its first validation has none)")
                raise ReportError(f"{os.path.join(run.folder, 'metrics.jsonl')} has no record of {key}, which "
                                  f"{OUTPUTS[2]} draws at every validation: {fix}")
    check_finished([r for runs in groups.values() for r in runs])
    # the runs' own configs name what they trained; read before any output is written
    titles = {subject: figure_title(subject, groups) for subject in ("Pair energy", "Outliers")}
    os.makedirs(args.out, exist_ok=True)
    report = tables(groups)
    if args.overwrite:  # nor over another's that another command put there meanwhile
        refuse_others_files(paths, SOURCE, md_head=report_head())
    write_text(paths[0], report, args.overwrite)  # UTF-8 whatever the locale: the report has ± and †
    plot_energies(groups, paths[1], args.overwrite, title=titles["Pair energy"], source=SOURCE)
    plot_outliers(groups, paths[2], args.overwrite, title=titles["Outliers"])
    plot_type_maxima(groups, paths[3], args.overwrite, types=TYPES, source=SOURCE)
    console_print(report)
    return report


if __name__ == "__main__":
    try:
        main()
    except ERRORS as e:  # the sweep reports' user errors, one line each (a saved config it cannot read included)
        sys.exit(f"error: {e}")
