"""The paper's motivation figure (Fig. 1): quantized score against maximum activation, per model and method.

For each result: a circle at (model, quantized score) whose area is proportional to the maximum
activation, one colour per method (Baseline, CD, TWEO, ...; shades of it for each of its settings, such as two CD
strengths). The paper's reading: TWEO has the smaller circles, CD the higher ones, most of all in detection.
evaluate.py's results (image classifiers: top-1, maxima of a block's modules or of block outputs, --max-act) make
the classification panel; evaluate_detection.py's (box mAP in %, backbone or head maximum, --det-max-act) the
detection panel beside it. A detector is named by its first config file, its method by what evaluate_detection.py read
from the checkpoint's training config (CD, TWEO, Noise, Baseline).
Writes motivation.png and motivation.csv (task, model, method, metric, FP and quantized score, maxima) into
--out; an existing file is replaced only with --overwrite, and only one this script wrote (a PNG it marked, a CSV
of its columns: engine.outputs.refuse_others_files), never another figure or table of that name. A classifier
evaluated otherwise than it was trained or than the paper evaluates (a model.kwargs override: the same weights
through another forward; another split; an autocast; the EMA weights) is marked † in its model name (a place of
its own on the axis, and in the CSV), with a note naming both on stderr (engine.result_table.evaluated_otherwise),
as evaluate.py's table marks its row.
Classifiers measured differently in what sets a maximum (data, image count, val images, raw or EMA weights, autocast,
the kind of checkpoint, the modules counted: what scripts/compare_act_max.py refuses) or in the drawn entry's
quantization settings (calibration images, pipeline options) are refused: their circles would show a setting as the
method's; so are detectors measured on other val data or annotations, other test batch padding (their maxima:
`max_act.padding`) or with other settings of the drawn entry (--calib-images, --quant-options). As in paper_table.py's
rows layout, a classifier whose run stopped before the end of its schedule by a signal (or was evaluated while it
trained) is refused, as its run folder's metrics.jsonl tells, and one its own train.max_steps stopped is marked §
in its model name (a place of its own on the axis, and in the CSV), with a note on stderr saying how far it got, where a
classifier of its model and data set beside it ended at another update or it reached less than 99 % of its schedule's
updates (engine/eval_results.stopped_early).

    python scripts/motivation_figure.py runs/pretrain/*/eval_best.json runs/det/*/eval_epoch_*.json \
        --out results/motivation
    python scripts/motivation_figure.py runs/sweeps/digits/*/eval_best.json --pipeline repq --bits w4a4 \
        --max-act module --out runs/motivation
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from configs.cli import OneLineParser  # noqa: E402
from engine.eval_results import (Difference, ResultsError, first_difference, missing_number,  # noqa: E402
                                 read_result_files, refuse_unfinished_groups, stopped_early)
from engine.figures import colour_rgb, new_figure  # noqa: E402
from engine.outputs import refuse_others_files, save_figure, source_mark, write_csv  # noqa: E402
from engine.run_dir import RunDirError, refuse_existing_outputs  # noqa: E402
from engine.result_table import dagger_note, evaluated_otherwise, nondefault_settings, stopped_note  # noqa: E402
from compare_act_max import float_settings  # noqa: E402  (scripts/: this folder, as this script runs it)
from quant import PIPELINES, parse_bits  # noqa: E402

METHOD_COLOURS = {"Baseline": "tab:gray", "CD": "tab:blue", "TWEO": "tab:orange"}
# the colours of further method families (Noise, CD + TWEO, ...): the tab10 colours the named families leave
OTHER_COLOURS = ("tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
MAX_AREA = 2000.0  # points^2 of the largest circle in a panel; the others scale with their maximum activation
FIELDS = ("task", "model", "method", "metric", "fp", "quantized", "max_act", "max_module", "max_block",
          "max_backbone", "max_head")  # the CSV's header line: by it and by SOURCE, --overwrite knows its own files
SOURCE = "scripts/motivation_figure.py"


def is_detection(result: dict) -> bool:
    return result.get("task") == "detection"


def detector_names(path: str, result: dict) -> tuple[str, str]:
    """(model, method) of an evaluate_detection.py result: its first config file, and the method its checkpoint
    was trained with (`method`, read from the checkpoint's training config)."""
    if (result.get("data") or {}).get("partial"):  # --max-images: a few images' mAP, not the split's
        raise ResultsError(f"{path} scores only {result['data'].get('images')} images (evaluate_detection.py "
                           "--max-images); the figure compares results on the whole val split: leave it out")
    if not result.get("method"):
        raise ResultsError(f"{path} does not say which method its checkpoint was trained with (a file written "
                           "before evaluate_detection.py recorded it, or a checkpoint without its training config); "
                           "run evaluate_detection.py on it again (it adds the method and recomputes nothing), or "
                           "leave it out")
    return os.path.splitext(os.path.basename(result["config"][0]))[0], result["method"]


def points(paths: list[str], results: list[dict], pipeline: str, bits: str, max_act: str,
           det_max_act: str = "backbone", stopped: Optional[list[Optional[str]]] = None) -> list[dict]:
    """One row per result that has the (pipeline, bits) entry, in input order: a classifier's top-1, a
    detector's box mAP (in %, on the top-1 scale; the paper's Table 2 writes mAP as a fraction, 0.344), with the
    maximum the circle's area stands for. A classifier whose run its own train.max_steps stopped early (`stopped`,
    per result: `stopped_runs`) has § in its model name, as one evaluated otherwise has †."""
    rows = []
    for i, (path, r) in enumerate(zip(paths, results)):
        q = r.get("quant", {}).get(pipeline, {}).get(bits)
        if q is None:
            continue
        detection = is_detection(r)
        fields = ("fp.bbox_mAP", "max_act.backbone", "max_act.head") if detection else (
            "fp.top1", "max_act.module", "max_act.block")
        missing = missing_number(r, fields, "bbox_mAP" if detection else "top1")
        if missing is not None:  # a file cut by hand or written by an older version: not a traceback
            raise ResultsError(f"{path} has no number at {missing}: re-evaluate it with "
                               f"{'evaluate_detection.py' if detection else 'evaluate.py'} (--recompute for a "
                               f"quantized entry)")
        if detection:
            model, method = detector_names(path, r)
            rows.append({"task": "detection", "model": model, "method": method, "metric": "box mAP (%)",
                         "fp": 100 * r["fp"]["bbox_mAP"], "quantized": 100 * q["bbox_mAP"],
                         "max_act": r["max_act"][det_max_act], "max_backbone": r["max_act"]["backbone"],
                         "max_head": r["max_act"]["head"]})
        else:
            # another forward, split or precision: not a circle of the model as trained
            changed = evaluated_otherwise(r)
            short = "§" if stopped and stopped[i] else ""  # trained to another length than a circle beside it
            rows.append({"task": "classification", "model": r["model"] + ("†" if changed else "") + short,
                         "method": r["method"], "metric": "top-1 (%)",
                         "fp": r["fp"]["top1"], "quantized": q["top1"], "max_act": r["max_act"][max_act],
                         "max_module": r["max_act"]["module"], "max_block": r["max_act"]["block"]})
    return rows


def refuse_unlike(paths: list[str], results: list[dict], pipeline: str, bits: str) -> None:
    """A ResultsError naming the first two classifiers' results measured differently: in what sets a float maximum
    (compare_act_max.py's FLOAT_KEYS and the modules counted: data, image count, val images, raw or EMA weights,
    autocast, kind of checkpoint), which compare_act_max.py refuses for the same pair, or in the settings of the
    drawn quantized entry (calibration images, pipeline options), which set the circle's height. The models
    are not compared: the figure sets them side by side on purpose. Detectors are compared among themselves
    (their panel is another; the model is their config): the val data, its annotations' content, the test batch
    padding their maxima were measured on (`max_act.padding`) and the drawn entry's settings."""
    labelled = [(path, {**float_settings(r), "quant": {pipeline: {bits: r["quant"][pipeline][bits]}}})
                for path, r in zip(paths, results) if not is_detection(r)]
    found = first_difference(labelled)
    if found is not None:
        first, second, difference = found
        raise ResultsError(f"{first} and {second} were measured differently ({difference}); the figure compares "
                           f"circles measured alike: give results of evaluations with the same data, images, "
                           f"weights, autocast, quant.act_max_extra_modules and {pipeline} {bits} settings (python "
                           f"evaluate.py --checkpoint <run>/best.pt with one set of settings), or draw them in "
                           f"separate figures")
    found = detector_difference(paths, results, pipeline, bits)
    if found is not None:
        first, second, difference = found
        raise ResultsError(f"{first} and {second} were measured differently ({difference}); the figure compares "
                           f"circles measured alike: give results of evaluate_detection.py on the same val data, "
                           f"test_dataloader.batch_size and {pipeline} {bits} settings (--calib-images, "
                           f"--calib-seed, --quant-options), or draw them in separate figures")


def detector_difference(paths: list[str], results: list[dict], pipeline: str, bits: str) -> Optional[tuple]:
    """(path, path, difference) of the first two detectors' results measured differently, as refuse_unlike
    compares them, or None. The padding of the test batches enters the backbone and heads (evaluate_detection.py:
    at batch 2 each image is padded to the larger one), so the maxima of other batch sizes are other maxima."""
    # a partial result (--max-images) is refused on its own, with its own reason (detector_names)
    detectors = [(path, r) for path, r in zip(paths, results)
                 if is_detection(r) and not (r.get("data") or {}).get("partial")]
    labelled = [(path, {"task": "detection", "data": r.get("data"), "annotations_sha256": r.get("annotations_sha256"),
                        "quant": {pipeline: {bits: r["quant"][pipeline][bits]}}}) for path, r in detectors]
    found = first_difference(labelled)
    if found is not None:
        return found
    # results written before the padding was recorded have none and are not compared
    padded = [(path, r["max_act"]["padding"]) for path, r in detectors
              if (r.get("max_act") or {}).get("padding") is not None]
    for path, padding in padded[1:]:
        if padding != padded[0][1]:
            return padded[0][0], path, Difference("max_act.padding", f"{json.dumps(padded[0][1], sort_keys=True)} "
                                                                     f"vs {json.dumps(padding, sort_keys=True)}",
                                                  False)
    return None


def stopped_runs(paths: list[str], results: list[dict]) -> list[Optional[str]]:
    """Refuse (ResultsError) a classifier's result whose run stopped before the end of its schedule other than at
    its own train.max_steps (by a signal, or evaluated while it trained), as paper_table.py's rows layout does
    (engine.eval_results.refuse_unfinished_groups, each circle judged alone); per result, how far a run its own
    train.max_steps stopped got and why it is marked § (engine.eval_results.stopped_early: beside a classifier of
    its model and data set that ended at another update, named by its path, or short of 99 % of its schedule),
    else None (and for a detector's: evaluate_detection.py records no schedule)."""
    classifiers = [i for i, r in enumerate(results) if not is_detection(r)]
    refuse_unfinished_groups([[(paths[i], results[i], f"leave {paths[i]} out of the figure")] for i in classifiers],
                             use="drawn as a finished run's")
    how = stopped_early([paths[i] for i in classifiers], [results[i] for i in classifiers],
                        [paths[i] for i in classifiers])
    found: list[Optional[str]] = [None] * len(results)
    for i, note in zip(classifiers, how):
        found[i] = note
    return found


def circle_areas(values: list[float]) -> list[float]:
    """Marker areas proportional to the values (the largest gets MAX_AREA)."""
    top = max(values)
    return [MAX_AREA * v / top if top > 0 else MAX_AREA for v in values]


def method_family(method: str) -> str:
    """A method's label without its settings in parentheses: "CD (lam 0.01)" -> "CD", "CD (lam 0.01) + TWEO" ->
    "CD + TWEO" (engine.result_table.method_name's labels, and engine.detection.method_of's)."""
    return re.sub(r" \([^)]*\)", "", method)


def method_colours(methods: list[str]) -> dict[str, tuple]:
    """{label: RGB}, one colour per distinct label: its family's (METHOD_COLOURS, else the next of OTHER_COLOURS),
    and where several labels share a colour (two CD strengths of a sweep, "CD (lam 0.005)" and "CD (lam 0.05)"),
    shades of it from dark to light in the order given, so that no two legend entries look alike."""
    methods = list(dict.fromkeys(methods))
    families = list(dict.fromkeys(method_family(m) for m in methods))
    others = [f for f in families if f not in METHOD_COLOURS]
    base = {**{f: OTHER_COLOURS[k % len(OTHER_COLOURS)] for k, f in enumerate(others)}, **METHOD_COLOURS}
    colours = {}
    for colour in dict.fromkeys(base[method_family(m)] for m in methods):
        mine = [m for m in methods if base[method_family(m)] == colour]
        rgb = colour_rgb(colour)
        for k, method in enumerate(mine):
            # -0.3 (towards black) .. +0.5 (towards white); the family's own colour when it is alone
            t = 0.8 * k / (len(mine) - 1) - 0.3 if len(mine) > 1 else 0.0
            colours[method] = tuple(c * (1 + t) if t < 0 else c + (1 - c) * t for c in rgb)
    return colours


def draw(rows: list[dict], path: str, title, overwrite: bool) -> None:
    """One panel per task present, in input order, circles scaled within each panel; `title(task)`. A method has
    one colour in every panel (`method_colours`)."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    colours = method_colours([r["method"] for r in rows])
    widths = [max(5.0, 1.8 * len({r["model"] for r in rows if r["task"] == t})) for t in tasks]
    fig = new_figure(sum(widths), 4.5)
    axes = fig.subplots(1, len(tasks), squeeze=False, gridspec_kw={"width_ratios": widths})[0]
    for ax, task in zip(axes, tasks):
        mine = [r for r in rows if r["task"] == task]
        _panel(ax, mine, title(task), colours)
    fig.tight_layout()
    save_figure(fig, path, overwrite, dpi=130, metadata=source_mark(SOURCE))  # refuse_others_files knows it


def _panel(ax, rows: list[dict], title: str, colours: dict[str, tuple]) -> None:
    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    areas = circle_areas([r["max_act"] for r in rows])
    for m_index, method in enumerate(methods):
        offset = (m_index - (len(methods) - 1) / 2) * 0.15  # side by side within a model
        mine = [(r, a) for r, a in zip(rows, areas) if r["method"] == method]
        ax.scatter([models.index(r["model"]) + offset for r, _ in mine], [r["quantized"] for r, _ in mine],
                   s=[a for _, a in mine], color=colours[method], alpha=0.5, edgecolors="k", label=method)
        for r, _ in mine:
            ax.annotate(f"{r['max_act']:.1f}", (models.index(r["model"]) + offset, r["quantized"]),
                        ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(models)), models)
    ax.set_xlim(-0.6, len(models) - 0.4)
    ax.margins(y=0.2)  # room for the largest circles above and below
    ax.set_ylabel(f"quantized {rows[0]['metric']}")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    legend = ax.legend(markerscale=0.3, fontsize=8)
    for handle in legend.legend_handles:
        handle.set_sizes([60])


def main(argv=None) -> list[dict]:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="JSON files written by evaluate.py or evaluate_detection.py")
    # a name no pipeline has is a usage error, not a result that lacks it (whose fix would be an evaluate.py run)
    p.add_argument("--pipeline", default="repq", choices=sorted(PIPELINES),
                   help="quantization pipeline (default repq, as the paper)")
    p.add_argument("--bits", default="w4a4", help="bit-width of the drawn entries (default w4a4)")
    p.add_argument("--max-act", choices=["module", "block"], default=None,
                   help="which maximum of a classifier sets the circle area (default module)")
    p.add_argument("--det-max-act", choices=["backbone", "head"], default=None,
                   help="which maximum of a detector sets the circle area (default backbone)")
    p.add_argument("--out", default="results/motivation",
                   help="folder for motivation.png / .csv (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace motivation.png / .csv in --out")
    args = p.parse_args(argv)
    try:  # as --pipeline: 'w4' is no bit-width, not one the results lack
        # the results' key: evaluate.py names a bit-width by its parsed form (quant/plan.py), so w04a4 or "W4A4 " is
        # w4a4 there, which lowercasing alone missed
        bits = str(parse_bits(args.bits))
    except ValueError as e:
        p.error(f"--bits {args.bits}: {e}")
    written = [os.path.join(args.out, n) for n in ("motivation.png", "motivation.csv")]
    try:
        refuse_existing_outputs(written, args.overwrite, inputs=args.results)
        if args.overwrite:  # a figure or table of another's at these names is not this script's to replace
            refuse_others_files(written, SOURCE, FIELDS)
        results = read_result_files(args.results, detection=True)
    except (RunDirError, ResultsError) as e:
        sys.exit(f"error: {e}")
    language = [path for path, r in zip(args.results, results) if not is_detection(r) and "top1" not in r["fp"]]
    if language:  # a language model's result has perplexities: there is no top-1 to draw
        sys.exit(f"error: {language[0]} has no top-1 (a language model's result: perplexity); the figure plots "
                 "the top-1 of image classifiers and the box mAP of detectors: leave the language-model results out")
    # a choice for a kind of result that is not given would change nothing
    detectors = [is_detection(r) for r in results]
    for flag, given, kind, present in (("--max-act", args.max_act, "classifier", not all(detectors)),
                                       ("--det-max-act", args.det_max_act, "detector", any(detectors))):
        if given is not None and not present:
            sys.exit(f"error: {flag} {given}: no {kind}'s result is given, so it would change nothing; drop it")
    args.max_act, args.det_max_act = args.max_act or "module", args.det_max_act or "backbone"
    lacking = [(path, r) for path, r in zip(args.results, results) if bits not in r["quant"].get(args.pipeline, {})]
    if lacking:  # every result asked for is drawn, or none: a missing circle would look like a finding
        tool = "evaluate_detection.py" if is_detection(lacking[0][1]) else "evaluate.py"
        sys.exit(f"error: {len(lacking)} of the {len(results)} results lack {args.pipeline} {bits} (e.g. "
                 f"{lacking[0][0]}); run {tool} --quant {args.pipeline} --bits {bits} on their checkpoints, "
                 "or leave them out")
    try:
        refuse_unlike(args.results, results, args.pipeline, bits)
        stopped = stopped_runs(args.results, results)
        rows = points(args.results, results, args.pipeline, bits, args.max_act, args.det_max_act, stopped)
    except ResultsError as e:
        sys.exit(f"error: {e}")
    # evaluate.py's defaults; a detector's are evaluate_detection.py's own (refuse_unlike compares the detectors')
    unusual = sorted({d for r in results if not is_detection(r)
                      for d in nondefault_settings(args.pipeline, r["quant"][args.pipeline][bits].get("settings"),
                                                   bits, r.get("recipe"))})
    if unusual:
        print(f"note: some results were quantized with non-default settings: {', '.join(unusual)}", file=sys.stderr)
    for r, short in zip(results, stopped):
        if is_detection(r):  # evaluate_detection.py records neither a model.kwargs change nor a schedule
            continue
        label, changed = f"{r['model']} {r['method']}", evaluated_otherwise(r)
        if changed:
            print(f"note: {dagger_note(label, changed)}", file=sys.stderr)
        if short:
            print(f"note: {stopped_note(label, [short])}", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    which = {"classification": args.max_act, "detection": args.det_max_act}
    try:  # never over a file another command wrote since this one started
        if args.overwrite:  # nor over one another command put there meanwhile
            refuse_others_files(written, SOURCE, FIELDS)
        write_csv(written[1], rows, FIELDS, args.overwrite, restval="")  # a † in a model name
        draw(rows, written[0], lambda task: f"{task}, {args.pipeline} {bits.upper()}: circle area ~ "
                                            f"{which[task]} max activation", args.overwrite)
    except RunDirError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {written[0]} and {written[1]} ({len(rows)} results)")
    return rows


if __name__ == "__main__":
    main()
