"""Per-block activation maxima of several methods side by side, each averaged over its runs (seeds).

Reads the `*_act_max.csv` files that evaluate.py writes next to its JSON (engine/act_max_files.py) and draws, per
block, the maximum |activation| of the block output (solid) and of any module inside the block (dashed), mean over a
method's files with their min-max range shaded; writes the PNG and a CSV, and prints a markdown table. Each CSV is
read with the result file evaluate.py wrote beside it (`<stem>.json` for `<stem>_act_max.csv`), which says how its
maxima were measured (a CSV whose size and SHA-256 are not those that result file records, edited or replaced since,
is refused; --overwrite replaces only this script's own outputs, a PNG it marked and a CSV of its columns, never a
maxima file evaluate.py wrote for a result file): the runs of a method must
be distinct runs evaluated alike (engine.result_table.check_seed_group: data, raw or EMA weights, the kind of
checkpoint (best.pt, checkpoint.pt), the update of snapshots, autocast, quant.act_max_extra_modules, model.kwargs,
and the method and recipe the result files record) whose runs ended alike (engine/eval_results.refuse_unfinished: a
run stopped by train.max_steps or a signal before the others' end is refused, and one stopped by a signal, or
evaluated while it trained, even alone, as its run folder's metrics.jsonl tells); the methods must be measured alike
in what sets the float maxima (data, image count, the val images' names, raw or EMA weights, autocast, the kind of a
run's checkpoint (model.pretrained weights, no file of a run, are drawn beside any), the modules counted
(quant.act_max_extra_modules): compared as paper_table.py's fine-tuning layout compares its methods,
engine/eval_results.first_difference), and a method evaluated with other model.kwargs than it trained with is marked
† with a note below the table, as paper_table.py marks it; a method whose runs their own train.max_steps stopped
before the end of their schedule, beside a method of its model that ended at another update or short of 99 % of its
schedule, is marked § (in its legend label, table column and CSV `method`) with a note on stderr saying how far they
got, as paper_table.py and motivation_figure.py mark it. A method whose result files record no train.seed for some
of its runs (older files outside their run folders) is averaged, and a note below the table names them: the seed
check could not compare them, so one seed may be counted twice.

    python scripts/compare_act_max.py \\
        baseline='runs/sweeps/fashion_mnist_mini/baseline_s*/eval_best_act_max.csv' \\
        cd='runs/sweeps/fashion_mnist_mini/cd_s*/eval_best_act_max.csv' \\
        tweo='runs/sweeps/fashion_mnist_mini/tweo_s*/eval_best_act_max.csv' \\
        --out runs/sweeps/fashion_mnist_mini/act_max_compare
"""
from __future__ import annotations

import csv
import glob
import hashlib
import math
import os
import re
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from configs.cli import OneLineParser, first_line  # noqa: E402
from engine.act_max_files import csv_differs_from_record  # noqa: E402
from engine.eval_results import (EVALUATION_KEYS, first_difference, read_result_file,  # noqa: E402
                                 refuse_unfinished_groups, stopped_early)
from engine.figures import new_figure  # noqa: E402
from engine.console import console_print  # noqa: E402
from engine.outputs import refuse_others_files, save_figure, source_mark, write_csv  # noqa: E402
from engine.run_dir import RunDirError, refuse_existing_outputs  # noqa: E402
from engine.result_table import check_seed_group, dagger_note, evaluated_otherwise, stopped_note  # noqa: E402
from engine.train_seeds import unrecorded_seed_note  # noqa: E402

SUFFIX = "_act_max.csv"  # engine.act_max_ownership.act_max_paths: <stem>_act_max.csv beside the result file <stem>.json
# what sets a float maximum besides the weights: the methods drawn side by side must agree on these, or the figure
# shows a setting's effect as the method's (and on the kind of checkpoint: one method's best.pt beside another's
# checkpoint.pt compares weights of other updates; and on the val images' names where both record them: a val folder
# exported again at the same path holds other images). The model is not: models are compared on purpose, under
# method names the user chooses
FLOAT_KEYS = tuple(k for k in EVALUATION_KEYS if k != "model") + ("checkpoint_kind", "val_names")


def float_settings(result: dict) -> dict:
    """What sets a result's float maxima: its FLOAT_KEYS and `max_act` (whose extra_modules say which modules the
    module maxima are over); two results compared side by side must agree on all of it."""
    return {k: result.get(k) for k in (*FLOAT_KEYS, "max_act")}


def per_block(path: str) -> dict[int, tuple[float, float]]:
    """{block: (max of the block output, max over the modules inside the block)} of one CSV; a file that
    cannot be read as one, or a max that is not a finite number, is a ValueError naming it."""
    rows = []  # (line, block, kind, max)
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
                rows.append((reader.line_num, int(row["block"]), row["kind"], float(row["max"])))
    except (OSError, ValueError, KeyError, TypeError) as e:  # TypeError: a short row (None for a column)
        problem = f"no column {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{path} is not an act_max CSV of evaluate.py ({problem})") from None
    block, module = {}, defaultdict(float)
    for line, b, kind, value in rows:
        # a NaN drops out of max() (it compares false) and the mean would be of the other modules' maxima
        if not math.isfinite(value):
            raise ValueError(f"{path}, line {line}: max {value} is not a finite number: the model's activations "
                             f"overflowed there (a diverged run); leave the run out, or train it again (e.g. with a "
                             f"lower optim.lr)")
        if b < 0:
            continue
        if kind == "block":
            block[b] = value
        else:
            module[b] = max(module[b], value)
    return {b: (block[b], module[b]) for b in sorted(block)}


def json_beside(path: str) -> str | None:
    """The path of the result file evaluate.py wrote with the CSV at `path` (`<stem>.json` beside
    `<stem>_act_max.csv`), None for a CSV of another name."""
    return path[:-len(SUFFIX)] + ".json" if path.endswith(SUFFIX) else None


def result_beside(path: str) -> dict:
    """The evaluate.py result file written with the CSV at `path` (`<stem>.json` beside `<stem>_act_max.csv`):
    the record of how its maxima were measured; a CSV without one is a ValueError naming it and the fix."""
    json_path = json_beside(path)
    if json_path is None or not os.path.isfile(json_path):
        raise ValueError(f"{path} has no result file of evaluate.py beside it "
                         f"({json_path or '<stem>.json for a <stem>' + SUFFIX}), so the settings its maxima were "
                         f"measured with (autocast, raw or EMA weights, model.kwargs, data) are unknown: give the "
                         f"CSVs where evaluate.py wrote them, or measure again with python evaluate.py "
                         f"--checkpoint <run>/best.pt (it writes eval_best.json and eval_best{SUFFIX})")
    result = read_result_file(json_path)  # a ResultsError (a ValueError) names a file that is not one
    if "csv" not in result["max_act"]:  # the evaluation recorded there wrote no maxima CSV
        raise ValueError(f"{json_path} lists no act_max CSV (evaluated with quant.act_max_csv=false), so {path} "
                         f"is not of its evaluation: measure again with python evaluate.py --out {json_path} "
                         f"quant.act_max_csv=true and the same settings, or leave the CSV out")
    if csv_differs_from_record(result["max_act"], path):
        raise ValueError(f"{path} is not the CSV that {json_path} records (its size and SHA-256 are not those "
                         f"evaluate.py wrote: the file was edited or replaced since), so the settings recorded there "
                         f"are not known to be those of its maxima: give the CSV as evaluate.py wrote it, or move it "
                         f"aside and measure again with python evaluate.py --out {json_path} and the same settings")
    return result


# the CSV's columns (its header line), and the PNG's text entry (a tEXt chunk) that marks this script's figure: by
# them --overwrite knows the files at --out as this script's, and replaces no other file (a figure or table another
# script or a person made)
CSV_FIELDS = ["method", "block", "runs", "block_mean", "block_min", "block_max", "module_mean", "module_min",
              "module_max"]
SOURCE = "scripts/compare_act_max.py"


# evaluate.py's per-layer maxima files of a result file <stem>.json (engine.act_max_ownership.act_max_paths and the
# <stem>_act_max.replaced<N> names keep_act_max_files moves them aside as)
EVALUATE_FILE = re.compile(r"^(?P<stem>.*)_act_max(\.replaced\d+)?\.(csv|png)$")


def evaluate_files(paths: list[str]) -> list[tuple[str, str]]:
    """(path, result file) for each existing file of `paths` named as evaluate.py names the maxima files of a result
    file that is there: files this script did not write, which --overwrite never replaces."""
    found = []
    for path in paths:
        match = EVALUATE_FILE.match(path)
        if match and os.path.lexists(path) and os.path.isfile(match["stem"] + ".json"):
            found.append((path, match["stem"] + ".json"))
    return found


def evaluated_alike(groups: dict[str, list[str]]) -> dict[str, list[str]]:
    """{method: notes} after refusing (ValueError) a method whose files are not distinct runs evaluated alike
    (`check_seed_group` on their result files) or that did not all end alike (engine.eval_results.
    refuse_unfinished_groups: one stopped by train.max_steps or a signal before the others' end, as its run folder's
    metrics.jsonl tells; one stopped by a signal, or evaluated while it trained, even alone); the notes say how a
    method's model was evaluated otherwise than trained or than the paper evaluates (`evaluated_otherwise`:
    model.kwargs, data, split, autocast, EMA weights), empty when alike.
    Methods measured with other FLOAT_KEYS settings are refused too (the first run of each: a method's runs are
    alike by then)."""
    notes, firsts = {}, []
    for method, paths in groups.items():
        results = [result_beside(p) for p in paths]
        # the maxima come from the float pass: the quantized entries' settings play no part in them
        check_seed_group(results[0]["model"], method, [dict(r, quant={}) for r in results], labels=paths)
        # averaged as seeds: a run stopped before the others of its method ended (train.max_steps, a signal)
        use = "averaged as a seed of finished ones" if len(paths) > 1 else "drawn as a finished run's"
        refuse_unfinished_groups([[(json_beside(p), r, f"leave {p} out of method {method!r}")
                                   for p, r in zip(paths, results)]], use=use)
        notes[method] = sorted({c for r in results if (c := evaluated_otherwise(r))})
        firsts.append((f"{paths[0]} ({method})", float_settings(results[0])))
    found = first_difference(firsts)
    if found is not None:
        first, second, difference = found
        raise ValueError(f"{first} and {second} were measured differently ({difference}); methods are compared "
                         f"on maxima measured alike: give CSVs of evaluations with the same data, images, weights, "
                         f"autocast and quant.act_max_extra_modules, of the same file of each run (python "
                         f"evaluate.py --checkpoint <run>/best.pt with one set of settings), or compare those "
                         f"methods in separate figures")
    return notes


def stopped_methods(groups: dict[str, list[str]]) -> dict[str, str]:
    """{method: how far its runs got and why it is marked §} for each method whose runs their own train.max_steps
    stopped before the end of their schedule (engine.eval_results.stopped_early, as paper_table.py and
    motivation_figure.py mark a row or circle: beside a method of its model that ended at another update, or short
    of 99 % of its schedule), judged by its first CSV's result: its runs ended alike once `evaluated_alike` passed."""
    firsts = [(json_beside(paths[0]), result_beside(paths[0])) for paths in groups.values()]
    how = stopped_early([p for p, _ in firsts], [r for _, r in firsts], [f"method {m!r}" for m in groups])
    return {method: note for method, note in zip(groups, how) if note}


def summarize(groups: dict[str, list[str]]) -> list[dict]:
    """Rows (method, block, mean / min / max of the block and module maxima over the method's files)."""
    rows = []
    for method, paths in groups.items():
        runs = [per_block(p) for p in paths]
        empty = [p for p, r in zip(paths, runs) if not r]
        if empty:
            raise ValueError(f"{empty[0]} holds no block rows: not an act_max CSV of evaluate.py")
        other = [p for p, r in zip(paths, runs) if sorted(r) != sorted(runs[0])]
        if other:  # another depth: its blocks would be dropped or missing from the means
            raise ValueError(f"{other[0]} has blocks {sorted(per_block(other[0]))}, {paths[0]} has "
                             f"{sorted(runs[0])}: the runs of method {method!r} are of different models")
        for b in sorted(runs[0]):
            blocks = [r[b][0] for r in runs]
            modules = [r[b][1] for r in runs]
            rows.append({"method": method, "block": b, "runs": len(runs),
                         "block_mean": sum(blocks) / len(blocks), "block_min": min(blocks),
                         "block_max": max(blocks), "module_mean": sum(modules) / len(modules),
                         "module_min": min(modules), "module_max": max(modules)})
    return rows


def plot(rows: list[dict], path: str, marked: set = frozenset(), overwrite: bool = False) -> None:
    fig = new_figure(7, 4)
    ax = fig.add_subplot(1, 1, 1)
    for k, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
        mine = [r for r in rows if r["method"] == method]
        xs = [r["block"] for r in mine]
        color = f"C{k}"
        method = method + ("†" if method in marked else "")
        ax.plot(xs, [r["block_mean"] for r in mine], color=color, marker="o", label=f"{method} block output")
        ax.fill_between(xs, [r["block_min"] for r in mine], [r["block_max"] for r in mine], color=color,
                        alpha=0.15)
        ax.plot(xs, [r["module_mean"] for r in mine], color=color, linestyle="--", label=f"{method} module")
    ax.set_yscale("log")
    ax.set_xlabel("block")
    ax.set_ylabel("max |activation| (mean over runs)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, overwrite, metadata=source_mark(SOURCE))  # refuse_others_files knows it by this


def unrecorded_seeds(groups: dict[str, list[str]]) -> list[str]:
    """The notes below the table for the methods some of whose CSVs' result files record no train.seed (older
    files outside their run folders): averaged, but `check_seed_group` could not tell one seed twice among them."""
    return [note for method, paths in groups.items()
            if (note := unrecorded_seed_note(method, [(p, result_beside(p)) for p in paths]))]


def markdown(rows: list[dict], notes: dict[str, list[str]] | None = None, seed_notes: list[str] | None = None) -> str:
    """The table of mean maxima per block; a method with notes (other model.kwargs than trained) is marked †
    and its notes follow the table, and so do `seed_notes` (`unrecorded_seeds`)."""
    notes = notes or {}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    blocks = sorted({r["block"] for r in rows})
    cell = {(r["method"], r["block"]): f"{r['block_mean']:.1f} / {r['module_mean']:.1f}" for r in rows}
    lines = ["| block | " + " | ".join(f"{m}{'†' if notes.get(m) else ''} (block / module)" for m in methods) + " |",
             "|---|" + "---|" * len(methods)]
    lines += [f"| {b} | " + " | ".join(cell.get((m, b), "-") for m in methods) + " |" for b in blocks]
    marks = [dagger_note(m, notes[m]) for m in methods if notes.get(m)] + (seed_notes or [])
    return "\n".join(lines + ([""] + marks if marks else []))


def main(argv=None) -> list[dict]:
    parser = OneLineParser(description=first_line(__doc__))
    parser.add_argument("groups", nargs="+", help="method=GLOB of act_max CSV files, one per method")
    parser.add_argument("--out", required=True, help="output path without extension (.png and .csv)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    args = parser.parse_args(argv)
    # values the arguments refuse on their own are usage errors (status 2), as argparse's, before any file is read
    name = os.path.basename(args.out)
    if not name or name.startswith(".") or os.path.isdir(args.out):  # 'DIR/' wrote DIR/.csv and DIR/.png.png
        parser.error(f"--out {args.out} names a folder, not the path of the two files: give a path without "
                     f"extension in it, e.g. --out {os.path.join(args.out, 'act_max_compare')}")
    if name.endswith((".png", ".csv")):  # 'x.png' wrote x.png.png and x.png.csv
        parser.error(f"--out {args.out}: give the path without extension (.png and .csv are added), e.g. "
                     f"--out {os.path.splitext(args.out)[0]}")
    methods = [item.partition("=") for item in args.groups]
    for item, (method, sep, _) in zip(args.groups, methods):
        if not method or not sep:
            parser.error(f"{item!r} is not method=GLOB: give e.g. cd='runs/x/cd_s*/eval_best_act_max.csv'")
        if [m for m, _, _ in methods].count(method) > 1:  # a second group of one name would replace the first
            parser.error(f"method {method!r} is given twice; give each group its own name")
    groups = {}
    for item, (method, _, pattern) in zip(args.groups, methods):
        paths = sorted(glob.glob(pattern))
        if not paths:
            sys.exit(f"error: {item!r} names no act_max CSV: give method=GLOB of evaluate.py's act_max CSV files, "
                     f"e.g. cd='runs/x/cd_s*/eval_best_act_max.csv'")
        groups[method] = paths
    seen: dict = {}  # the bytes of each file -> (method, path): one run's maxima must count once
    for method, paths in groups.items():
        for path in paths:
            try:
                with open(path, "rb") as f:
                    first = seen.setdefault(hashlib.sha256(f.read()).hexdigest(), (method, path))
            except OSError as e:  # a folder the glob matched, a file without read permission
                sys.exit(f"error: {path} ({method}) cannot be read ({e.strerror}): give act_max CSV files")
            if first != (method, path):
                sys.exit(f"error: {path} ({method}) holds the same maxima as {first[1]} ({first[0]}): one run "
                         "would count twice (a file given twice, or a copy); give each run's CSV once")
    outputs, inputs = [args.out + ".png", args.out + ".csv"], [p for paths in groups.values() for p in paths]
    read = {os.path.realpath(p) for p in inputs}  # an input is refused as one (refuse_existing_outputs)
    theirs = [(path, result) for path, result in evaluate_files(outputs) if os.path.realpath(path) not in read]
    if theirs:  # evaluate.py's per-layer plot or CSV (of another run than those read): not this script's to replace
        path, result = theirs[0]
        sys.exit(f"error: {path} is a per-layer maxima file that evaluate.py wrote for {result}; --overwrite "
                 f"replaces only this script's outputs: choose another --out")
    try:
        refuse_existing_outputs(outputs, args.overwrite, inputs=inputs)
        if args.overwrite:
            refuse_others_files(outputs, SOURCE, CSV_FIELDS)
    except RunDirError as e:
        sys.exit(f"error: {e}")
    try:
        rows = summarize(groups)  # everything that can fail, before an output is opened
        notes = evaluated_alike(groups)
        seed_notes = unrecorded_seeds(groups)
        stopped = stopped_methods(groups)
    except ValueError as e:
        sys.exit(f"error: {e}")
    # a method trained to another length than the one beside it: § in its label (legend, table, CSV)
    marked = {method: method + "§" for method in stopped}
    rows = [dict(r, method=marked.get(r["method"], r["method"])) for r in rows]
    notes = {marked.get(method, method): n for method, n in notes.items()}
    for method, how in stopped.items():
        print(f"note: {stopped_note(method, [how])}", file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    try:  # never over a file another command wrote since this one started
        if args.overwrite:  # nor over one another command put there meanwhile
            refuse_others_files(outputs, SOURCE, CSV_FIELDS)
        write_csv(args.out + ".csv", rows, CSV_FIELDS, args.overwrite)  # a method name may carry any letter
        plot(rows, args.out + ".png", {m for m, n in notes.items() if n}, args.overwrite)
    except RunDirError as e:
        sys.exit(f"error: {e}")
    console_print(markdown(rows, notes, seed_notes))  # its † on an ASCII console, or a closed pipe
    print(f"wrote {args.out}.png and {args.out}.csv", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
