"""Collect evaluate.py results (JSON files) into markdown tables in the layout of the paper's tables.

    python scripts/paper_table.py runs/pretrain/*/eval_best.json                    # Table 1
    python scripts/paper_table.py runs/sweeps/cd_lambda/*/eval_best.json            # Table 4a (4b: cd_form,
                                                             # 5: cd_targets, 6: attn_sink; docs/reproduce.md)
    python scripts/paper_table.py runs/sweeps/digits/*/eval_best.json --out results/digits.md
    python scripts/paper_table.py runs/sweeps/fashion_mnist_mini/*/eval_best.json --over-seeds  # mean ± std
    python scripts/paper_table.py --layout finetune runs/sweeps/finetune/*/eval_best.json       # Table 3

A quantized number computed with settings other than the defaults (pipeline options, calibration set)
is marked with * and a note naming them (engine.result_table.nondefault_settings; in the fine-tuning layout, so is
the Average that takes it in); a result evaluated otherwise
than it was trained or than the paper evaluates (a model.kwargs override, other data or another eval transform
than its run's, another data.val_split, an --amp autocast, the --ema weights, val images left out as unreadable:
how many, of how many) is marked † with a note (engine.result_table.evaluated_otherwise): its row's model in the rows
layout, its entries (and the Average of its column) in the fine-tuning layout. A module
maximum that also counts modules outside the blocks (quant.act_max_extra_modules, not the paper's set) is marked ‡
with a note naming them; seeds averaged by --over-seeds must have counted the same modules, scored the same
kind of checkpoint (best.pt, checkpoint.pt, a snapshot: the `checkpoint_kind` evaluate.py records; snapshots, or
files set aside, of one update: the `checkpoint_step` it records, where both record one) and be runs of
distinct train.seed (the `train_seed` evaluate.py records, or for an older file in its run folder that of the run's
config.yaml: a run trained again with its seed is one seed twice; a result that records neither is averaged, and a
note below the table names it, as one seed may count twice there), and the run of
a best.pt or checkpoint.pt must have ended as the other seeds of its row (model and method) did (one stopped at
train.max_steps or by a signal before their end is refused, as its run folder's metrics.jsonl tells:
engine/eval_results.refuse_unfinished; rows of other models or methods end where their own recipes do). In
every layout a result of a run that stopped short of its schedule's end other than at its own train.max_steps (by a
signal, or evaluated while it trained) is refused: the numbers of an earlier model beside finished ones. A result
whose checkpoint beside it
(the run's best.pt) holds other weights now than those it scored (the run trained on after its evaluation) is
refused, naming the command that refreshes it (engine/eval_results.refuse_stale).

--out also writes the table to a file, ending it with a marker comment line (OWN_MARK); --overwrite replaces only a
file that ends with it, a table this script wrote, and refuses any other (a hand-written table, a result file).

Layouts:
    rows      one row per result: Model | Method | FP Top-1 | Max. Act. (mod./blk.) | one column per
              pipeline (and bit-width) (engine.result_table.markdown_table, the row evaluate.py prints).
              Where two rows would read alike (one model and method: seeds of a sweep, or one recipe
              trained for other lengths), a Run column after Method names each row's run folder, by its
              last path parts, and a note below the table names the training settings (the recipe
              evaluate.py records) in which a run differs from the first run of its model and method.
              A row whose run stopped at a train.max_steps of its own before the end of its schedule
              (its metrics.jsonl tells) is marked § after its method where EITHER the table
              holds a run of the same model (and data set) that ended at another update OR it reached less
              than 99 % of its schedule's updates, with a note saying how far it got and which reason
              applies; with --over-seeds, a row of seeds that all stopped there alike. Runs that all stop
              alike within 1 % of their schedule's end (a recipe that sets train.max_steps itself, e.g.
              20,000 of its schedule's 20,016 updates, 99.9 %) are not marked: a run records no origin of
              its train.max_steps.
    finetune  Table 3: one row per data set, one column per method, each entry "FP / quantized / drop"
              (drop = quantized - FP, of the two figures as printed), an Average row over the data sets
              (the paper's simple average over all nine) and the maximum activations of the ImageNet-1K run;
              one table per pipeline and bit-width found. The data set of a result is the last folder name
              of its data.root (data_sets/<name> in configs/sweeps/finetune.yaml). The entries of a row must
              be evaluated
              on the same data (root, split, transform, image count, the val images' names) and, where they score
              snapshots or files set aside, at one update; and all entries
              with the same kind of weights (raw or EMA), autocast and kind of checkpoint: results evaluated
              otherwise are refused. An entry whose run stopped at a train.max_steps of its own before the end
              of its schedule is marked § where the rows layout would mark its row (beside a run of its data
              set that ended at another update, or short of 99 % of its schedule), and so is the Average that
              takes it in, with a note saying how far it got.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from configs.cli import OneLineParser  # noqa: E402
from engine.console import console_print  # noqa: E402
from engine.eval_results import (BEST_FIELD, STEP_FIELD, ResultsError, extra_modules,  # noqa: E402
                                 first_difference, missing_number, read_result_files, recipe_difference,
                                 refuse_unfinished_groups, run_folder, stopped_early)
from engine.outputs import write_text  # noqa: E402
from engine.run_dir import RunDirError, refuse_existing_outputs  # noqa: E402
from engine.result_table import (FP_COLUMNS, PAPER_NAMES, dagger_note, evaluated_otherwise,  # noqa: E402
                                 extra_modules_note, markdown_table, nondefault_settings, stopped_note)

# the last line of every --out file this script writes (a markdown comment: not shown), by which --overwrite knows a
# file as one of its tables: any other file at --out (a hand-written table, another script's report) is not replaced
OWN_MARK = "<!-- written by scripts/paper_table.py: its --overwrite replaces only a file that ends with this line -->"


def refuse_unowned_out(path: str) -> None:
    """--overwrite replaces only a table this script wrote (its last line OWN_MARK): SystemExit naming any other file
    at `path` ("Nothing lost": no command replaces a file it did not create)."""
    if not os.path.exists(path):
        return
    try:
        with open(path, "rb") as f:  # its end only: --out may name a large file (a checkpoint), no table
            f.seek(max(0, os.fstat(f.fileno()).st_size - len(OWN_MARK) - 8))
            lines = f.read().decode("utf-8", errors="replace").rstrip("\n").split("\n")
    except OSError as e:
        sys.exit(f"error: --out {path} cannot be read ({e.strerror}) to tell whether this script wrote it: "
                 "choose another --out")
    if lines[-1].rstrip("\r") != OWN_MARK:
        sys.exit(f"error: --out {path} is not a table paper_table.py wrote (its last line is not {OWN_MARK}), "
                 "and --overwrite replaces only those: choose another --out, or move the file aside")


# Table 3's row order and names; data sets not listed follow, by folder name
FINETUNE_DATASETS = {"flowers102": "Flowers102", "pets": "Pets", "aircraft": "Aircraft", "cars": "Cars",
                     "food101": "Food101", "sun397": "SUN397", "eurosat": "EuroSAT", "smallnorb": "SmallNORB",
                     "imagenet": "ImageNet-1K"}


def dataset_of(result: dict) -> str:
    """The data-set name of one evaluate.py result: its data.root's last folder (or the built-in name)."""
    data = result.get("data", {})
    if data.get("dataset", "folder") != "folder":
        return data["dataset"]
    return os.path.basename(os.path.normpath(data.get("root", ""))) or "?"


# what must match for entries to share the fine-tuning layout: a data set's row compares its methods on the same
# val images seen the same way (val_names: their names, compared where both results record them: a val folder
# exported again at the same path holds other images), and where they score snapshots (or files set aside), those of
# one update (engine.eval_results.step_difference: the data sets' schedules differ, their rows' updates may too);
# the whole table (its Average) uses one kind of weights (raw or EMA), autocast and kind of checkpoint (every
# method's best.pt, or every one's checkpoint.pt: weights of the same point of training)
ROW_KEYS = ("data", "images", "val_names", "checkpoint_kind", STEP_FIELD, BEST_FIELD)
TABLE_KEYS = ("weights", "eval_amp", "checkpoint_kind")


def refuse_unlike(results: list[dict], keys: tuple, where: str) -> None:
    """A ValueError naming the first two of `results` that differ in one of `keys` (evaluate.py's identity fields,
    compared as --over-seeds compares them)."""
    found = first_difference([(r.get("checkpoint", r["model"]), {k: r.get(k) for k in keys}) for r in results])
    if found is not None:
        first, second, difference = found
        raise ValueError(f"{first} and {second} were evaluated differently ({difference}); {where} compares "
                         "results evaluated alike: evaluate them with the same settings, or tabulate them apart")


def method_order(method: str) -> tuple:
    """Baseline, CD, TWEO (the paper's column order), then the rest by name."""
    family = method.split(" ")[0]
    return (["Baseline", "CD", "TWEO"].index(family) if family in ("Baseline", "CD", "TWEO") else 3, method)


def finetune_table(results: list[dict], stopped: Optional[Sequence[Optional[str]]] = None) -> str:
    """Table 3's layout, one table per (pipeline, bit-width) present in `results` (see the module doc). `stopped`:
    for each result, how far its run got where its own train.max_steps stopped it short (`stopped_short`), else
    None: its entry, the Average it is part of and its ImageNet-1K maxima are marked §, with a note."""
    cells: dict = {}
    models = sorted({r.get("model", "?") for r in results})
    if len(models) > 1:  # the layout has no model column: cells of two models would sit side by side
        raise ValueError(f"the results are of {len(models)} models ({', '.join(models)}); the fine-tuning layout "
                         "compares methods on one model: give the results of one model")
    language = next((r for r in results if "top1" not in r["fp"]), None)
    if language is not None:  # Table 3 is of image classifiers: a perplexity has no place in it
        raise ValueError(f"{language.get('checkpoint', language['model'])} has no top-1 (a language model's "
                         "result: perplexity); the fine-tuning layout tabulates image classifiers: use the rows "
                         "layout for language models")
    for r in results:
        key = (dataset_of(r), r["method"])
        if key in cells:
            raise ValueError(f"two results for data set '{key[0]}' and method '{key[1]}' "
                             f"({cells[key]['checkpoint']} and {r['checkpoint']}); give one per pair")
        cells[key] = r
    refuse_unlike(results, TABLE_KEYS, "the fine-tuning layout (one Average over its rows)")
    for d in sorted({d for d, _ in cells}):
        refuse_unlike([r for (d_, _), r in cells.items() if d_ == d], ROW_KEYS, f"a data set's row ('{d}')")
    datasets = sorted({d for d, _ in cells}, key=lambda d: (list(FINETUNE_DATASETS).index(d)
                                                             if d in FINETUNE_DATASETS else 99, d))
    methods = sorted({m for _, m in cells}, key=method_order)
    columns = sorted({(p, b) for r in results for p in r["quant"] for b in r["quant"][p]},
                     key=lambda pb: (list(PAPER_NAMES).index(pb[0]) if pb[0] in PAPER_NAMES else 9, pb))
    line = lambda cells_: "| " + " | ".join(cells_) + " |"
    # a result evaluated otherwise than trained or than the paper evaluates (evaluated_otherwise): marked †
    changed = {key: how for key, r in cells.items() if (how := evaluated_otherwise(r))}
    dagger = lambda key: "†" if key in changed else ""
    # a run its own train.max_steps stopped short of its schedule, or beside a run of its data set that ended
    # elsewhere (stopped_short): marked §, as the rows layout marks its row
    short = {(dataset_of(r), r["method"]): how for r, how in zip(results, stopped or []) if how}
    section = lambda key: "§" if key in short else ""
    tables = []
    for pipeline, bits in columns:
        rows = [line(["Dataset"] + methods), line(["---"] * (len(methods) + 1))]
        notes = []
        sums = {m: [] for m in methods}
        marked = set()  # the methods whose Average takes in a † entry
        cut = set()  # the methods whose Average takes in a § entry
        other = set()  # the methods whose Average takes in an entry of non-default settings (*)
        for d in datasets:
            row = [FINETUNE_DATASETS.get(d, d)]
            for m in methods:
                r = cells.get((d, m))
                q = r and r["quant"].get(pipeline, {}).get(bits)
                if (d, m) in changed and (q or d == "imagenet"):  # an entry, or the maxima row, shows it
                    notes.append(dagger_note(f"{FINETUNE_DATASETS.get(d, d)} {m}", changed[(d, m)]))
                if (d, m) in short and (q or d == "imagenet"):
                    notes.append(stopped_note(f"{FINETUNE_DATASETS.get(d, d)} {m}", [short[(d, m)]]))
                if not q:
                    row.append("-")
                    continue
                fp, qt = r["fp"]["top1"], q["top1"]
                sums[m].append((fp, qt))
                unusual = nondefault_settings(pipeline, q.get("settings"), bits, r.get("recipe"))  # as evaluate.py
                row.append(fp_quantized_drop(fp, qt) + ("*" if unusual else "") + dagger((d, m))
                           + section((d, m)))
                if unusual:
                    notes.append(f"\\* {FINETUNE_DATASETS.get(d, d)} {m}: not the default settings: "
                                 f"{', '.join(unusual)}")
                    other.add(m)
                if (d, m) in changed:
                    marked.add(m)
                if (d, m) in short:
                    cut.add(m)
            rows.append(line(row))
        average = ["Average"]
        for m in methods:
            n = len(sums[m])
            if not n:
                average.append("-")
                continue
            fp, qt = (sum(v[i] for v in sums[m]) / n for i in (0, 1))
            partial = f" (over {n} of {len(datasets)})" if n < len(datasets) else ""
            average.append(f"{fp_quantized_drop(fp, qt)}{partial}" + ("*" if m in other else "")
                           + ("†" if m in marked else "")
                           + ("§" if m in cut else ""))
        rows.append(line(average))
        if any(d == "imagenet" for d, _ in cells):  # the paper measures maxima on the ImageNet-1K run only
            # a module maximum also over quant.act_max_extra_modules is marked ‡, as evaluate.py's table marks it
            extra = {m: patterns for m in methods if (patterns := extra_modules(cells.get(("imagenet", m), {})))}
            notes += [extra_modules_note(f"ImageNet-1K {m}", patterns) for m, patterns in extra.items()]
            rows.append(line(["Max. Act. (ImageNet-1K)"] + [
                f"{cells[('imagenet', m)]['max_act']['module']:.2f}{'‡' if m in extra else ''} / "
                f"{cells[('imagenet', m)]['max_act']['block']:.2f}{dagger(('imagenet', m))}{section(('imagenet', m))}"
                if ("imagenet", m) in cells else "-"
                for m in methods]))
        title = f"{PAPER_NAMES.get(pipeline, pipeline)} {bits.upper()}: FP top-1 / quantized top-1 / drop"
        tables.append(f"{title}\n\n" + "\n".join(rows + ([""] + notes if notes else [])))
    return "\n\n".join(tables)


def fp_quantized_drop(fp: float, quantized: float) -> str:
    """'FP / quantized / drop' to two decimals, the drop the difference of the two figures printed: taken of the
    unrounded top-1s it could differ from it by 0.01 (66.67 / 33.33 / -33.33 for 2 and 1 of 3 images right), a cell
    whose arithmetic a reader sees fail."""
    fp_shown, quantized_shown = f"{fp:.2f}", f"{quantized:.2f}"
    return f"{fp_shown} / {quantized_shown} / {float(quantized_shown) - float(fp_shown):+.2f}"


def refuse_unfinished_runs(paths: list[str], results: list[dict], over_seeds: bool) -> None:
    """A result of a run that stopped before its end is refused (engine.eval_results.refuse_unfinished_groups, told
    by the run folder of its best.pt or checkpoint.pt): --over-seeds averages the results of one model and method
    (`seed_key`, its rows) as seeds, and one of them that stopped before the others' end is refused (seeds of one
    model that all stopped alike are averaged, whatever another row's runs trained to); in a table of one result per
    row or entry each run is judged alone (the runs of other recipes end at other updates), and one stopped by a
    signal or evaluated while it trained is refused, one its own train.max_steps stops is not."""
    where = "--over-seeds" if over_seeds else "the table"
    files = [(path, result, f"leave {path} out of {where}") for path, result in zip(paths, results)]
    groups: dict = {}
    for i, file in enumerate(files):
        groups.setdefault(seed_key(file[1]) if over_seeds else i, []).append(file)
    try:
        refuse_unfinished_groups(groups.values(), use="averaged as a seed of finished ones" if over_seeds
                                 else "tabulated as a finished run's")
    except ResultsError as e:  # also a damaged metrics.jsonl
        sys.exit(f"error: {e}")


def seed_key(result: dict) -> tuple:
    """The row a result is averaged into with --over-seeds: its model and method (engine.result_table.markdown_table
    groups its rows so)."""
    return result["model"], result["method"]


def stopped_short(paths: list[str], results: list[dict], names: list[str]) -> list:
    """For each result whose run stopped before the end of its schedule and was not refused
    (`refuse_unfinished_runs`: at a train.max_steps of its own, e.g. 3 of 22 updates), how far it got and why the
    table marks it (engine.eval_results.stopped_early: beside a run of its model and data set that ended at another
    update, named by `names`: `run_names`, or short of 99 % of its schedule), else None. The rows layout marks such
    a row § (engine.result_table.markdown_table), its note saying which reason applies (both where both do)."""
    try:
        return stopped_early(paths, results, names)
    except ResultsError as e:  # a damaged metrics.jsonl (refuse_unfinished_runs has read it already)
        sys.exit(f"error: {e}")


def recipe_notes(results: list[dict], names: list[str]) -> list[str]:
    """The notes below a rows-layout table for rows of one model and method (told apart by their Run column) whose
    runs were trained with other settings (the `recipe` evaluate.py records, engine.eval_results.recipe_difference:
    another optim.lr, another schedule), one per run that differs from the first run of its model and method: rows
    that read alike but for their folder names are no seeds of one recipe."""
    notes: list[str] = []
    first: dict = {}  # (model, method) -> (name, result) of its first run
    for name, result in zip(names, results):
        key = seed_key(result)
        if key not in first:
            first[key] = (name, result)
            continue
        other = recipe_difference([first[key], (name, result)])
        if other is not None:
            notes.append(f"{key[0]} {key[1]}: {other[1]} was trained with other settings than {other[0]} "
                         f"({other[2]})")
    return notes


def run_names(paths: list[str], results: list[dict]) -> list[str]:
    """The name of each result's run for the rows layout's Run column: its run folder (`run_folder`; the file's own
    folder for a result of no run's end, e.g. of a snapshot) cut to the fewest last path parts that tell the folders
    apart (sweep/baseline_s0 and sweep/baseline_s1: baseline_s0 and baseline_s1), with the result file's name where
    two results are of one run (its eval_best.json and an evaluate.py --out file of its best.pt): 's0 (x.json)'."""
    folders = [os.path.realpath(run_folder(path, result) or os.path.dirname(os.path.realpath(path)))
               for path, result in zip(paths, results)]
    parts = {folder: folder.strip(os.sep).split(os.sep) for folder in folders}
    for last in range(1, max(map(len, parts.values())) + 1):
        short = {folder: "/".join(p[-last:]) for folder, p in parts.items()}
        if len(set(short.values())) == len(short):
            break
    return [short[folder] + (f" ({os.path.basename(path)})" if folders.count(folder) > 1 else "")
            for path, folder in zip(paths, folders)]


def main(argv=None) -> str:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="JSON files written by evaluate.py")
    p.add_argument("--layout", choices=["rows", "finetune"], default="rows", help="see above (default rows)")
    p.add_argument("--out", help="also write the table to this file (a new file, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out file that this script wrote (it ends with a marker comment)")
    p.add_argument("--over-seeds", action="store_true",
                   help="rows layout: one row per model and method, mean ± std over its results (the seeds "
                        "of a sweep: results of other training settings, evaluations or weights are refused)")
    args = p.parse_args(argv)
    if args.overwrite and not args.out:  # nothing would be replaced: the flag was meant with an --out
        p.error("--overwrite replaces the --out file, and no --out is given: add --out PATH, or drop --overwrite")
    if args.out and os.path.isdir(args.out):  # --overwrite replaces a file, never a folder
        p.error(f"--out {args.out} is a folder; give the path of the table's file, e.g. "
                f"{os.path.join(args.out, 'table.md')}")
    if args.over_seeds and args.layout == "finetune":  # a usage error: before any result file is read
        p.error("--over-seeds is for the rows layout (the fine-tuning layout takes one result per cell)")
    try:
        refuse_existing_outputs([args.out] if args.out else [], args.overwrite, inputs=args.results)
        results = read_result_files(args.results)
    except (RunDirError, ResultsError) as e:
        sys.exit(f"error: {e}")
    if args.out and args.overwrite:
        refuse_unowned_out(args.out)
    for path, result in zip(args.results, results):  # the numbers the tables print (a file cut by hand lacks some)
        if args.layout == "finetune" and "top1" not in result["fp"]:
            continue  # a language model's: the fine-tuning layout refuses it as such
        score = "ppl" if "ppl" in result["fp"] else "top1"
        # every float column the table prints of the result (a language model's BF16 PPL beside its FP32 one), and
        # the score itself even where absent; an older file without ppl_bf16 shows '-' there
        printed = [f"fp.{k}" for k, _ in FP_COLUMNS[score] if k == score or k in result["fp"]]
        missing = missing_number(result, (*printed, "max_act.module", "max_act.block"), score)
        if missing is not None:
            sys.exit(f"error: {path} has no number at {missing}: re-evaluate it with evaluate.py (--recompute for "
                     "a quantized entry)")
    refuse_unfinished_runs(args.results, results, args.over_seeds)
    try:
        # rows of one model and method are told apart by their runs, and a run stopped short of one that trained
        # further (or less) is marked §
        names = run_names(args.results, results) if args.layout == "rows" else []
        # the fine-tuning layout names a run by its entry (data set and method), as its notes do
        entries = [f"{FINETUNE_DATASETS.get(dataset_of(r), dataset_of(r))} {r['method']}" for r in results]
        table = (finetune_table(results, stopped=stopped_short(args.results, results, entries))
                 if args.layout == "finetune"
                 else markdown_table(results, over_seeds=args.over_seeds, runs=names,
                                     stopped=stopped_short(args.results, results, names)))
    except ValueError as e:
        sys.exit(f"error: {e}")
    # rows of one model and method trained with other settings (--over-seeds refuses such seeds): the notes say how
    notes = recipe_notes(results, names) if args.layout == "rows" and not args.over_seeds else []
    if notes:  # below the table's own notes, which follow it after a blank line
        table += ("\n" if "\n\n" in table else "\n\n") + "\n".join(notes)
    console_print(table)  # its † and ± on an ASCII console, or a closed pipe
    if args.out:
        if args.overwrite:  # a file another command put at --out meanwhile is not this script's either
            refuse_unowned_out(args.out)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            # never over a file another command wrote meanwhile
            write_text(args.out, f"{table}\n\n{OWN_MARK}\n", args.overwrite)
        except RunDirError as e:
            sys.exit(f"error: {e}; the table is printed above")
        except OSError as e:  # a folder that cannot be made or written (read-only, /proc): the table is printed
            sys.exit(f"error: --out {args.out}: cannot be written ({e.strerror}); the table is printed above: "
                     "give a writable path")
    return table


if __name__ == "__main__":
    main()
