"""The paper's motivation figure (Fig. 1): quantized accuracy against maximum activation, per model and method.

For each evaluate.py result: a circle at (model, quantized top-1) whose area is proportional to the
maximum activation, one colour per method (Baseline, CD, TWEO, ...). The paper's reading: TWEO has the
smaller circles, CD the higher ones. Writes motivation.png and motivation.csv (model, method, FP top-1,
quantized top-1, module and block maxima) into --out; an existing file is replaced only with --overwrite.

    python scripts/motivation_figure.py runs/pretrain/*/eval_best.json --out results/motivation
    python scripts/motivation_figure.py runs/sweeps/digits_demo/*/eval_best.json --pipeline repq --bits w4a4 \
        --max-act module --out runs/motivation
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from engine.eval_results import ResultsError, read_result_files  # noqa: E402
from engine.figures import new_figure  # noqa: E402
from engine.run_dir import RunDirError, refuse_existing_outputs  # noqa: E402
from evaluate import nondefault_settings  # noqa: E402

METHOD_COLOURS = {"Baseline": "tab:gray", "CD": "tab:blue", "TWEO": "tab:orange"}
MAX_AREA = 2000.0  # points^2 of the largest circle; the others scale with their maximum activation


def points(results: list[dict], pipeline: str, bits: str, max_act: str) -> list[dict]:
    """One row per result that has the (pipeline, bits) entry, in input order."""
    rows = []
    for r in results:
        q = r.get("quant", {}).get(pipeline, {}).get(bits)
        if q is None:
            continue
        rows.append({"model": r["model"], "method": r["method"], "fp_top1": r["fp"]["top1"],
                     "quant_top1": q["top1"], "max_module": r["max_act"]["module"],
                     "max_block": r["max_act"]["block"], "max_act": r["max_act"][max_act]})
    return rows


def circle_areas(values: list[float]) -> list[float]:
    """Marker areas proportional to the values (the largest gets MAX_AREA)."""
    top = max(values)
    return [MAX_AREA * v / top if top > 0 else MAX_AREA for v in values]


def draw(rows: list[dict], path: str, title: str) -> None:
    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    areas = circle_areas([r["max_act"] for r in rows])
    fig = new_figure(max(5.0, 1.8 * len(models)), 4.5)
    ax = fig.subplots()
    for m_index, method in enumerate(methods):
        offset = (m_index - (len(methods) - 1) / 2) * 0.15  # side by side within a model
        colour = METHOD_COLOURS.get(method.split(" ")[0], f"C{m_index + 3}")
        mine = [(r, a) for r, a in zip(rows, areas) if r["method"] == method]
        ax.scatter([models.index(r["model"]) + offset for r, _ in mine], [r["quant_top1"] for r, _ in mine],
                   s=[a for _, a in mine], c=colour, alpha=0.5, edgecolors="k", label=method)
        for r, _ in mine:
            ax.annotate(f"{r['max_act']:.1f}", (models.index(r["model"]) + offset, r["quant_top1"]),
                        ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(models)), models)
    ax.set_xlim(-0.6, len(models) - 0.4)
    ax.set_ylabel("quantized top-1 (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    legend = ax.legend(markerscale=0.3, fontsize=8)
    for handle in legend.legend_handles:
        handle.set_sizes([60])
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="JSON files written by evaluate.py")
    p.add_argument("--pipeline", default="repq", help="quantization pipeline (default repq, as the paper)")
    p.add_argument("--bits", default="w4a4")
    p.add_argument("--max-act", choices=["module", "block"], default="module",
                   help="which maximum sets the circle area (default module)")
    p.add_argument("--out", default="results/motivation", help="folder for motivation.png / .csv")
    p.add_argument("--overwrite", action="store_true", help="replace motivation.png / .csv in --out")
    args = p.parse_args(argv)
    written = [os.path.join(args.out, n) for n in ("motivation.png", "motivation.csv")]
    try:
        refuse_existing_outputs(written, args.overwrite, inputs=args.results)
        results = read_result_files(args.results)
    except (RunDirError, ResultsError) as e:
        sys.exit(f"error: {e}")
    language = [path for path, r in zip(args.results, results) if "top1" not in r["fp"]]
    if language:  # a language model's result has perplexities: there is no top-1 to draw
        sys.exit(f"error: {language[0]} has no top-1 (a language model's result: perplexity); the figure plots "
                 "the top-1 of image classifiers: leave the language-model results out")
    rows = points(results, args.pipeline, args.bits.lower(), args.max_act)
    lacking = [path for path, r in zip(args.results, results)
               if args.bits.lower() not in r["quant"].get(args.pipeline, {})]
    if lacking:  # every result asked for is drawn, or none: a missing circle would look like a finding
        sys.exit(f"error: {len(lacking)} of the {len(results)} results lack {args.pipeline} {args.bits} (e.g. "
                 f"{lacking[0]}); run evaluate.py --quant {args.pipeline} --bits {args.bits} on their checkpoints, "
                 "or leave them out")
    unusual = sorted({d for r in results for d in nondefault_settings(args.pipeline, r["quant"][args.pipeline]
                                                                       [args.bits.lower()].get("settings"))})
    if unusual:
        print(f"note: some results were quantized with non-default settings: {', '.join(unusual)}", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    with open(written[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    draw(rows, written[0], f"{args.pipeline} {args.bits.upper()}: circle area ~ {args.max_act} max activation")
    print(f"wrote {written[0]} and {written[1]} ({len(rows)} results)")
    return rows


if __name__ == "__main__":
    main()
