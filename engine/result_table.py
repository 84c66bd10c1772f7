"""The tables of evaluate.py's result files in the paper's layout (Model | Method | FP Top-1 | Max. Act. |
one column per pipeline), with the marks that say where a number is not of the paper's protocol: `*` on a
quantized cell of non-default settings, `†` on a model evaluated otherwise than it trained, `‡` on a module
maximum that also counts modules outside the blocks, `§` on the method of a run stopped before the end of its
schedule where the table compares it with a run of its model that trained to another end or where it reached less
than 99 % of its schedule (scripts/paper_table.py stopped_short: runs that all stop alike near their end, a
recipe's own stop, are not marked); and the checks that results
averaged as seeds are alike.
A model marked † has a note below the table that says how it was evaluated: other model.kwargs, another input
size, other data or another eval transform than its run's (data.dataset, data.root's val files, data.crop_pct and
the like), another split, an autocast, its EMA weights (evaluate.py --ema), or val images left out as unreadable.

    print(markdown_table(read_result_files(paths), over_seeds=True))  # engine.eval_results: older files as new

evaluate.py prints one row per call; scripts/paper_table.py, compare_act_max.py, motivation_figure.py and the sweep
reports (dose_report.py, lm_study.py, gap_test.py) build their tables with the same marks and checks.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional, Sequence

from cd.decay import config_decays_nothing
from cd.tweo import adds_nothing
from configs import Config
from configs.schema import EVAL_TRANSFORM_KEYS
from data.text import scored_val_windows
from quant import PIPELINES, bits_order
from quant.plan import pipeline_options

from .eval_results import (NEUTRAL_OPTIONS, as_stored, extra_modules, first_difference, first_last_at_bits,
                           read_options, recipe_difference, repeated_weights, unread_at_bits)
from .quant_settings import quant_settings
from .tasks import capped_cell
from .train_seeds import repeated_seed, unrecorded_seed_note

PAPER_NAMES = {"percentile": "Percentile", "repq": "RepQ-ViT", "aphq": "APHQ", "gplq": "GPLQ", "rtn": "RTN",
               "gptq": "GPTQ", "smoothquant": "SmoothQuant", "smoothquant_strict": "SmoothQuant-strict"}
# the float columns of a table, by the score of its results (perplexity for a language model, top-1 for a
# classifier): (key in a result's `fp`, header); scripts/paper_table.py checks each one it will print
FP_COLUMNS = {"ppl": (("ppl", "FP32 PPL"), ("ppl_bf16", "BF16 PPL")), "top1": (("top1", "FP Top-1"),)}


def method_name(cfg: Config) -> str:
    """Baseline / CD / TWEO (CD + TWEO when both are on), with the settings that differ from the paper's
    defaults (so that the rows of an ablation table tell themselves apart), e.g. "CD (lam 0.01)",
    "CD (targets C)", "CD (loss 0.005)". A regularizer that is on but changes nothing (cd.decay.config_decays_nothing,
    cd.tweo.adds_nothing: tweo.lam=0) is left out, as engine/detection/model.py method_of leaves out a detector's
    hook of that kind: such a run trains bit for bit as the baseline, and two names would draw one training twice."""
    from configs import CDConfig, TWEOConfig

    names = []
    if cfg.cd.enabled and not config_decays_nothing(cfg.cd):
        default, c = CDConfig(), cfg.cd
        names.append(_named("CD", [f"lam {c.lam:g}" if c.lam != default.lam else "",
                                   f"targets {c.targets}" if c.targets != default.targets else "",
                                   f"loss {c.loss_coef:g}" if c.mode == "loss" else "",
                                   " ".join(f"{r} {v:g}" for r, v in sorted(c.lam_per_role.items())),
                                   # without the budget rule the weight decay is as given, as it is with it at lam 0
                                   "" if c.budget or c.lam == 0 else "no budget"]))
    # also beside CD: such a run is not one of the CD runs (--over-seeds would average it)
    if cfg.tweo.enabled and not adds_nothing(cfg.tweo.lam):
        default, t = TWEOConfig(), cfg.tweo
        names.append(_named("TWEO", [f"lam {t.lam:g}" if t.lam != default.lam else "",
                                     "rescaled" if t.rescale else "",
                                     t.schedule if t.schedule != default.schedule else "",
                                     # the penalty's shape: a tau or p ablation would otherwise average as
                                     # seeds of one method
                                     f"p {t.p:g}" if t.p != default.p else "",
                                     f"tau {t.tau:g}" if t.tau != default.tau else "",
                                     f"eps {t.eps:g}" if t.eps != default.eps else ""]))
    return " + ".join(names) or "Baseline"


def _named(name: str, notes: list[str]) -> str:
    notes = [n for n in notes if n]
    return f"{name} ({', '.join(notes)})" if notes else name


def markdown_table(results: list[dict], over_seeds: bool = False, runs: Optional[Sequence[str]] = None,
                   stopped: Optional[Sequence[Optional[str]]] = None) -> str:
    """Results as a table in the paper's layout: Model | Method | FP Top-1 | Max. Act. (mod./blk.) | one
    column per pipeline (and bit-width, when several were run); '-' where a result lacks a column. For
    language models (Table 8): perplexities, FP32 and BF16 first. A quantized cell of non-default settings is
    marked * (`nondefault_settings`), the model of a row evaluated otherwise than trained or than the paper
    evaluates (other model.kwargs, other data or eval transform, another split, an autocast, the EMA weights,
    images left out as unreadable) †
    (`evaluated_otherwise`), a module maximum also over quant.act_max_extra_modules ‡, the method of a row whose
    run stopped before the end of its schedule beside a run of its model that ended elsewhere, or short of 99 % of
    its schedule, § (`stopped`), each
    with a note below the table.

    over_seeds: one row per (model, method) with mean +- sample std over its results (e.g. the seeds of a
    sweep) and their count, instead of one row per result; a row averaging results that record no train.seed
    (older files: `check_seed_group` cannot tell one seed twice among them) has a note naming them.
    runs: the name of each result's run (scripts/paper_table.py: its run folder). One row per result, two rows of
    one model and method (seeds, or runs of other schedules, of one recipe) would read as one run twice: such a
    table has a Run column after Method, and its notes name the row's run too. A table whose rows differ in model
    or method is printed as without `runs`.
    stopped: for each result, how far its run got where it stopped before the end of its schedule (at a
    train.max_steps of its own, engine.eval_results.run_end) and EITHER the table compares it with a run of its
    model that ended at another update OR it reached less than 99 % of its schedule's updates (scripts/paper_table.py
    stopped_short), with the reason, else None: numbers of a model trained to another length than the one beside it
    or to a fraction of its recipe, marked § with a note. Runs that all stop alike within 1 % of their end (a
    recipe's own train.max_steps, e.g. 20,000 of its schedule's 20,016 updates) are None: they ended as their recipe
    says.
    """
    language = all("ppl" in r["fp"] for r in results)
    if not language and any("ppl" in r["fp"] for r in results):
        lm = next(r for r in results if "ppl" in r["fp"])["model"]
        raise ValueError(f"the results mix language models ({lm}: perplexity) and classifiers (top-1), whose "
                         "columns differ: make one table per task")
    score = "ppl" if language else "top1"
    fp_columns = FP_COLUMNS[score]
    seen = {(p, b) for r in results for p in r["quant"] for b in r["quant"][p]}
    order = list(PAPER_NAMES) + sorted({p for p, _ in seen} - set(PAPER_NAMES))
    columns = sorted(seen, key=lambda pb: (order.index(pb[0]), bits_order(pb[1])))
    # a header without bits reads as the paper's W4A4: any other bit-width is named, even alone
    many_bits = language or {b for _, b in columns} - {"w4a4"}
    # one row per result, two of one model and method tell themselves apart by nothing else: name each row's run
    labels = [(r["model"], r["method"]) for r in results]
    named = runs is not None and not over_seeds and len(set(labels)) < len(labels)
    header = ["Model", "Method", *(["Run"] if named else []), *(title for _, title in fp_columns),
              "Max. Act. (mod./blk.)"] + [PAPER_NAMES.get(p, p) + (f" {b.upper()}" if many_bits else "")
                                          for p, b in columns]
    groups: dict = {}  # the row's key -> the indices of its results
    for i, r in enumerate(results):
        groups.setdefault((r["model"], r["method"]) if over_seeds else i, []).append(i)
    if over_seeds:
        for (model, method), group in groups.items():
            check_seed_group(model, method, [results[i] for i in group])

    def fmt(values: list, spec: str, of: int = 0, ppl: bool = False) -> str:
        """One value, or mean ± sample std; of: the row's result count, named when fewer values make the cell
        (a pipeline some seeds were not evaluated with). ppl: perplexities, where one at the cap (an overflowed
        exp, engine.tasks.perplexity) makes the cell that bound, not a mean of it."""
        if not values:
            return "-"
        partial = f" (n={len(values)})" if over_seeds and len(values) < of else ""
        capped = capped_cell(values) if ppl else None
        if capped:
            return capped + partial
        if len(values) == 1:
            return format(values[0], spec) + partial
        mean = sum(values) / len(values)
        # hypot: a squared deviation past 1e154 (a diverged seed's perplexity below the cap) overflows ** 2
        std = math.hypot(*(v - mean for v in values)) / math.sqrt(len(values) - 1)
        return f"{format(mean, spec)} ± {format(std, spec)}{partial}"

    spec = ".2f" if over_seeds or language else ".3f"
    rows, notes = [], []

    def quantized(group: list, label: str, p: str, b: str) -> str:
        """The cell of pipeline p at bits b; '*' and a note when a result has non-default settings."""
        holding = [r for r in group if b in r["quant"].get(p, {})]
        entries = [r["quant"][p][b] for r in holding]
        cell = fmt([e[score] for e in entries], spec, of=len(group), ppl=language)
        unusual = entries_nondefault(p, entries, b, [r.get("recipe") for r in holding])
        if unusual:
            cell += "*"
            notes.append(settings_note(label, p, b, unusual))
        return cell

    for indices in groups.values():
        group = [results[i] for i in indices]
        first = group[0]
        # how the notes name the row: by its run too where the Run column tells rows of one model and method apart
        label = f"{first['model']} {first['method']}" + (f" ({runs[indices[0]]})" if named else "")
        # a run stopped before the end of its schedule (its own train.max_steps) beside one that ended elsewhere
        short = sorted({how for i in indices if stopped and (how := stopped[i])})
        if short:
            notes.append(stopped_note(label, short))
        method = first["method"] + (f" (n={len(group)})" if over_seeds else "") + ("§" if short else "")
        # a model evaluated otherwise than it trained (a model.kwargs override): the row is of another forward
        changed = sorted({c for r in group if (c := evaluated_otherwise(r))})
        if changed:
            notes.append(dagger_note(label, changed))
        model = first["model"] + ("†" if changed else "")
        # seeds averaged without the train.seed of each: one may be a run trained again with another's seed
        if over_seeds and (unknown := unrecorded_seed_note(label, seed_labels(group))):
            notes.append(unknown)
        # a module maximum also over quant.act_max_extra_modules is not the paper's (inside blocks only): marked ‡
        # (a group's results are alike in them: check_seed_group)
        extra = sorted({m for r in group for m in extra_modules(r)})
        if extra:
            notes.append(extra_modules_note(label, extra))
        rows.append([model, method, *([runs[indices[0]]] if named else []),
                     *(fmt([r["fp"][k] for r in group if k in r["fp"]], spec, len(group),
                                          ppl=language)
                                      for k, _ in fp_columns),
                     fmt([r["max_act"]["module"] for r in group], ".2f") + ("‡" if extra else "") + " / "
                     + fmt([r["max_act"]["block"] for r in group], ".2f")]
                    + [quantized(group, label, p, b) for p, b in columns])
    line = lambda cells: "| " + " | ".join(cells) + " |"
    return "\n".join([line(header), line(["---"] * len(header))] + [line(r) for r in rows]
                     + ([""] + notes if notes else []))


def check_seed_group(model: str, method: str, group: list[dict], labels: Optional[list[str]] = None) -> None:
    """The results averaged into one row (`markdown_table(over_seeds=True)`, scripts/compare_act_max.py) must be
    distinct runs of one method evaluated alike: one weights file twice would count as two seeds, and results on
    other data, of EMA weights, under another autocast or quantized with other settings, or of another method or
    recipe (the `method` and `recipe` evaluate.py records) would be averaged as if they were seeds, and so would two
    runs of one train.seed (engine/train_seeds.py: a run trained again, its weights a hair apart).
    labels: how the errors name the results (default: their checkpoints)."""
    labelled = seed_labels(group, labels)
    repeated = repeated_weights(labelled)
    if repeated is not None:
        raise ValueError(f"{model} {method}: {repeated[0]} and {repeated[1]} hold the same weights; give each "
                         "run's result once")
    different = first_difference(labelled)
    if different is not None:
        # --recompute replaces a quantized entry; other data, weights or autocast are another file (--out)
        recompute = ", or --recompute them with one set of settings" if different[2].of_settings else ""
        raise ValueError(f"{model} {method}: {different[0]} and {different[1]} were evaluated differently "
                         f"({different[2]}); rows average the seeds of one evaluation: give results evaluated "
                         f"alike{recompute}")
    unlike = model_kwargs_unlike(labelled)
    if unlike is not None:
        raise ValueError(f"{model} {method}: {unlike}; rows average the seeds of one evaluation: give results "
                         "evaluated alike")
    # seeds of one method: results without a recipe (older files) would otherwise pass as seeds of any method
    other_method = method_difference(labelled)
    if other_method is not None:
        raise ValueError(f"{model} {method}: {other_method}; rows average the seeds of one method: give each "
                         "method's results in a group of their own")
    # seeds of one recipe: runs trained with another lr or schedule under the same method name are not seeds
    # (results written before the recipe was recorded have none and are not compared)
    other = recipe_difference(labelled)
    if other is not None:
        raise ValueError(f"{model} {method}: {other[0]} and {other[1]} were trained with other settings "
                         f"({other[2]}); rows average the seeds of one recipe: give runs trained alike")
    # last: runs alike in all the above but trained with one seed are one seed twice (runs of other settings that
    # share a seed are refused above, for those settings)
    same_seed = repeated_seed(labelled)
    if same_seed is not None:
        raise ValueError(f"{model} {method}: {same_seed[0]} and {same_seed[1]} are both runs of train.seed="
                         f"{same_seed[2]}: one seed would count twice (a run trained again with its seed is no new "
                         "seed); give one result of each seed")


def seed_labels(group: list[dict], labels: Optional[list[str]] = None) -> list[tuple[str, dict]]:
    """(label, result) for each result of `group` averaged as seeds: `labels`, else its checkpoint (or 'result N')."""
    return [(labels[i] if labels else r.get("checkpoint") or f"result {i + 1}", r) for i, r in enumerate(group)]


def model_kwargs_unlike(labelled: list[tuple[str, dict]]) -> Optional[str]:
    """'<a> and <b> were evaluated with other model.kwargs (...)' for the first two of the (label, result) pairs
    that `model_kwargs_changed` tells apart, else None. Results to be averaged as seeds (check_seed_group, the
    dose reports' points) must be alike: the same weights through another forward (model.kwargs given at
    evaluation, marked † in a row) are another evaluation. Older files and weights files, which record no recipe,
    are not compared."""
    # a result that records no recipe is of unknown model.kwargs as trained: not "as trained"
    changed = [(label, model_kwargs_changed(r)) for label, r in labelled if _trained_kwargs_known(r)]
    unlike = next(((changed[0], c) for c in changed[1:] if c[1] != changed[0][1]), None)
    if unlike is None:
        return None
    (a, how_a), (b, how_b) = unlike
    return f"{a} and {b} were evaluated with other model.kwargs ({how_a or 'as trained'} vs {how_b or 'as trained'})"


def method_difference(labelled: list[tuple[str, dict]]) -> Optional[str]:
    """'<a> and <b> are results of other methods (X vs Y)' for the first two of the (label, result) pairs whose
    `method` differs, else None. evaluate.py writes `method_name` of the run's config (Baseline, CD or TWEO with the
    settings that set it apart from the defaults, never the seed), so the seeds of one run's settings share it; the
    recipe tells runs apart too, but a result that records none (written before evaluate.py recorded it) is not
    compared by `recipe_difference`, and would be averaged as one more seed of any method. Results without a
    method (a file cut by hand) are not compared."""
    named = [(label, r["method"]) for label, r in labelled if isinstance(r.get("method"), str)]
    other = next(((label, m) for label, m in named[1:] if m != named[0][1]), None)
    if other is None:
        return None
    return f"{named[0][0]} and {other[0]} are results of other methods ({named[0][1]!r} vs {other[1]!r})"


def nondefault_settings(pipeline: str, settings: Optional[dict], bits: Optional[str] = None,
                        recipe: Optional[dict] = None) -> list[str]:
    """'quant.<pipeline>.<option>=value' (and quant.calib_*) for every setting a quantized result was
    computed with that differs from the default config's; a table marks such results (a degenerate APHQ
    grid or a 2-iteration run scores far from what the pipeline does). Settings the result does not record
    (an older file), options unread under the others (engine.eval_results.read_options) and, given the
    result's `bits`, options the pipeline does not read at them (APHQ's round_zero_point at a_bits != w_bits:
    engine.eval_results.unread_at_bits) are not compared. Given the `recipe` of the result's run (its file's
    "recipe"), so are the training images and training mode it drew on (`training_changed`)."""
    if not settings or pipeline not in PIPELINES:
        return []
    settings, defaults = as_stored(settings), as_stored(quant_settings(Config(), pipeline, files=False))
    # every default option, also those the defaults leave unread (the MLP reconstruction's, read where it is on)
    base = pipeline_options(Config(), pipeline)
    ranks = settings.get("world_size")  # GPLQ's: its default lr is that of its global batch
    # a null stem / head bit-width as the main one of `bits` it ran at, in the entry and the defaults alike
    options = first_last_at_bits(read_options(pipeline, settings.get("options") or {}, ranks=ranks), bits)
    # an option whose null means a default is recorded as the value used (quant_settings: percentile's levels, GPLQ's
    # lr), which depends on the entry's other options (weight_range=percentile's one level, GPLQ's batch and, for
    # scale_lr, its lr): compared with the value its default's null takes beside the entry's own other options, so
    # that only a value given differs
    own = {k: v for k, v in options.items() if k in {f.name for f in dataclasses.fields(base)}}
    resolved = {k: getattr(PIPELINES[pipeline].recorded_options(
        dataclasses.replace(base, **{**own, k: None}), ranks if ranks is not None else 1), k)
        for k, v in dataclasses.asdict(base).items() if v is None and own.get(k) is not None}  # a null: as the base
    defaults["options"] = as_stored(first_last_at_bits({**dataclasses.asdict(base), **resolved}, bits))
    names = {"images": "quant.calib_images", "seed": "quant.calib_seed", "transform": "quant.calib_transform"}
    found, unread = [], unread_at_bits(pipeline, bits)
    # the options read under the entry's own (an older entry holds unread ones, at whatever value it was given)
    for key, value in options.items():
        default = defaults["options"].get(key, value)
        if value != default and key not in NEUTRAL_OPTIONS.get(pipeline, ()) and key not in unread:
            found.append(f"quant.{pipeline}.{key}={value}")
    for key, value in (settings.get("calibration") or {}).items():
        if key in names and value != defaults["calibration"].get(key, value):
            found.append(f"{names[key]}={value}")
    return found + training_changed(settings, recipe)


# where a quantized result's settings record what its training images and training mode were drawn with, and the
# config section of each key; the eval transform's share of the training transform (interpolation, mean, std) is
# data_changed's, which marks the row
TRAINING_SETTINGS = {"train_transform": "data", "calibration": "data", "model_training": "model"}
KEY_IN_RECIPE = {"split": "train_split"}  # the training split, as the settings name it


def training_changed(settings: dict, recipe: Optional[dict]) -> list[str]:
    """'data.<key>=<value> (trained with <value>)' (or model.<key>) for each setting of the training-split images a
    quantized result calibrated or trained on (APHQ's and GPLQ's training transform, a calibration batch's split and
    synthetic size) and of the model's training mode (GPLQ stage 1's dropout and stochastic depth) that differs from
    the `recipe` its run trained with: an evaluation override (data.reprob=0 for APHQ) is another setting than the
    run's own, which the entry's quant.* options do not show. Nothing is compared without a recipe (a weights file, an
    older result file) or for a key the recipe lacks."""
    if not isinstance(recipe, dict):
        return []
    text = lambda value: value if isinstance(value, str) else json.dumps(value)
    found = []
    for part, section in TRAINING_SETTINGS.items():
        for key, value in (settings.get(part) or {}).items():
            name = f"{section}.{KEY_IN_RECIPE.get(key, key)}"
            if (key not in EVAL_TRANSFORM_KEYS and name in recipe and as_stored(value) != as_stored(recipe[name])
                    and not (part == "calibration" and key not in ("split", "synthetic_train_size"))):
                found.append(f"{name}={text(value)} (trained with {text(recipe[name])})")
    return list(dict.fromkeys(found))  # the split and size the training transform and the batch both record


def entries_nondefault(pipeline: str, entries: list[dict], bits: Optional[str] = None,
                       recipes: Optional[Sequence[Optional[dict]]] = None) -> list[str]:
    """`nondefault_settings` of any of the quantized `entries` of `pipeline` at `bits` (the seeds of one cell),
    sorted; `recipes`: each entry's run's recipe (its result file's "recipe"), compared with its training settings."""
    recipes = recipes if recipes is not None else [None] * len(entries)
    return sorted({d for e, recipe in zip(entries, recipes)
                   for d in nondefault_settings(pipeline, e.get("settings"), bits, recipe)})


def settings_note(label: str, pipeline: str, bits: str, unusual: list[str]) -> str:
    """The note below a table for a quantized cell marked * (`label`, e.g. 'vit_t CD'; a report's points): the
    settings of `entries_nondefault` it was computed with."""
    return f"\\* {label} {PAPER_NAMES.get(pipeline, pipeline)} {bits.upper()}: not the default settings: " \
           f"{', '.join(unusual)}"


def _trained_kwargs_known(result: dict) -> bool:
    """Whether a result records the model.kwargs it was evaluated with and those its run trained with."""
    recipe = result.get("recipe")
    return isinstance(recipe, dict) and "model.kwargs" in recipe and "model_kwargs" in result


def model_kwargs_changed(result: dict) -> Optional[str]:
    """'model.kwargs={...} (trained with {...})' when a result was computed with other model.kwargs than its run
    trained with (an override at evaluation: the same weights through another forward, e.g. gelu=tanh on a model
    trained with the exact GELU), else None; a table marks such results. Results without the recipe as trained
    (a weights file, an older file) are not compared."""
    if not _trained_kwargs_known(result):
        return None
    recipe = result["recipe"]
    text = lambda value: json.dumps(value, sort_keys=True, default=str)  # tuples as lists, as in the file
    evaluated, trained = text(result["model_kwargs"]), text(recipe["model.kwargs"])
    return None if evaluated == trained else f"model.kwargs={evaluated} (trained with {trained})"


def evaluated_otherwise(result: dict) -> Optional[str]:
    """How a result was evaluated otherwise than the paper's protocol (the weights as trained, on the validation
    split, in fp32), or None: `model_kwargs_changed`, an input size other than the one trained at, other data or
    another eval transform than the run's (`data_changed`), a `data.val_split` other than 'val' (scoring the
    training images gives a number that reads as a validation accuracy), an `--amp` autocast and the EMA weights
    (`--ema`: an average of the trained weights, whose row would otherwise read as the raw weights') and images left
    out as unreadable (`unreadable_left_out`: a score of fewer images than the split holds), joined by '; '. Tables
    mark such results † with a `dagger_note`; results that do not record a setting (older files) are not marked for
    it.
    A language model's FP32 and BF16 PPL are computed in fp32 and bf16 whatever --amp is, its quantized ones under
    --amp: its row is marked for those."""
    found = [changed] if (changed := model_kwargs_changed(result)) else []
    if result.get("img_size_changed"):  # model.img_size given at evaluation: the weights at another input size
        found.append(f"model.img_size={result['img_size_changed']}")
    found += data_changed(result)
    if left_out := unreadable_left_out(result):
        found.append(left_out)
    data = result.get("data") or {}
    split, root = data.get("val_split", "val"), str(data.get("root") or "")
    # find_split joins the split onto data.root: 'val/', './val' and data.root's own val folder by its full path
    # name the validation split
    if os.path.normpath(os.path.join(root, str(split))) != os.path.normpath(os.path.join(root, "val")):
        found.append(f"data.val_split={split!r}")
    if result.get("eval_amp", "none") != "none":
        found.append(f"--amp {result['eval_amp']}")
    if result.get("weights") == "ema":
        found.append("--ema (the EMA weights)")
    return "; ".join(found) or None


def unreadable_left_out(result: dict) -> Optional[str]:
    """'<n> of its <images> <split> images left out as unreadable' when a pass of the result (its `fp`, a quantized
    entry) scored fewer images than its split holds: engine/loop.py leaves out each image data/folder.py could not
    read (a broken file, a link to nothing, an I/O error) and records their number as `excluded`. The score is then
    of other images than a reader takes it to be of, as a val split that holds fewer files is (`data_root_changed`).
    Passes that left out other numbers are named with theirs, e.g. '... (FP); 2 ... (RepQ-ViT W4A4)'. Results that
    record no `excluded` (older files, a language model's) are not marked."""
    passes = [("FP", result.get("fp"))] + [(f"{PAPER_NAMES.get(p, p)} {b.upper()}", entry)
                                          for p, by_bits in (result.get("quant") or {}).items()
                                          for b, entry in by_bits.items()]
    counts = [(name, entry["excluded"]) for name, entry in passes if isinstance(entry, dict)
              and isinstance(entry.get("excluded"), int) and not isinstance(entry["excluded"], bool)]
    left = {}  # how many were left out -> the passes that left out as many
    for name, excluded in counts:
        if excluded > 0:
            left.setdefault(excluded, []).append(name)
    if not left:
        return None
    images, split = result.get("images"), (result.get("data") or {}).get("val_split", "val")
    of = f" of its {images}" if isinstance(images, int) else ""
    if len(left) == 1 and len(next(iter(left.values()))) == len(counts):  # every pass left out the same
        return f"{next(iter(left))}{of} {split} images left out as unreadable"
    return "; ".join(f"{n}{of} {split} images left out as unreadable ({', '.join(names)})"
                     for n, names in sorted(left.items()))


def data_changed(result: dict) -> list[str]:
    """'data.<key>=<value> (trained with <value>)' for each data setting a result was scored with that differs from
    its run's recipe: another data.dataset (digits weights scored on synthetic noise), or, on the data set it trained
    on, another setting of the eval transform (data.crop_pct, crop_mode, interpolation, mean, std,
    digits_img_size), of the val text (data.val_windows) or of the synthetic val split (data.synthetic_val_size;
    a file written before it was recorded takes its image count, eval_results.take_later_data), and data.root where
    it holds other val data than the run validated on (`data_root_changed`). Results without a recipe (a weights
    file, an older file) are not compared; the input size is `img_size_changed`'s, the split `evaluated_otherwise`'s."""
    recipe, data = result.get("recipe"), result.get("data")
    if not isinstance(recipe, dict) or not isinstance(data, dict):
        return []
    trained_on = recipe.get("data.dataset")
    if trained_on is not None and data.get("dataset", trained_on) != trained_on:
        # the transform's settings of another data set compare with nothing the run read
        return [f"data.dataset={data['dataset']} (trained on {trained_on})"]
    scored = {k: v for k, v in data.items() if k not in ("dataset", "root", "val_split", "val_file", "eval_transform")}
    scored.update({k: v for k, v in (data.get("eval_transform") or {}).items() if k != "img_size"})
    text = lambda value: value if isinstance(value, str) else json.dumps(value)
    found = [f"data.{key}={text(value)} (trained with {text(recipe[f'data.{key}'])})" for key, value in scored.items()
             if f"data.{key}" in recipe and as_stored(value) != as_stored(recipe[f"data.{key}"])
             and not (key == "val_windows" and same_windows_scored(recipe[f"data.{key}"], value, result.get("images")))]
    root = data_root_changed(result)
    return found + ([root] if root else [])


def same_windows_scored(trained, evaluated, scored) -> bool:
    """Whether the run's data.val_windows=`trained` validated on the windows a result scored with `evaluated`
    (`scored` of them: its "images"). The windows are a function of their count and the text (data/text.py
    scored_val_windows), so values of one count are the same windows; the text's count is known where the
    evaluation scored all of it: `evaluated` 0, or past the count (a result written before that was refused). There
    the run's 0, that count or more (a run written before more was refused scored all) are the same windows, e.g.
    64 trained on a text of 38 and evaluated with 0. An evaluation of N > 0 that scored N leaves the count unknown
    (N or more), so no other value is known to be the same there."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (trained, evaluated, scored)):
        return False
    return (evaluated == 0 or evaluated > scored) and scored_val_windows(trained, scored) == scored


def data_root_changed(result: dict) -> Optional[str]:
    """'data.root=<root> (...)' when the val split a result scored under data.root holds other data than the split of
    that name the run validated on: the images' names and count (a folder data set: `val_names`) or the token file's
    size and head (`data.val_file`) against the fingerprint its checkpoint recorded (`trained_data`, train.py's
    data_fingerprint), else None. data.root is a path that may move between machines: the same files under another
    root are the same data. Results without the record (a checkpoint that holds none, an older file) are not
    compared."""
    trained, data = result.get("trained_data"), result.get("data") or {}
    fingerprint = trained.get("fingerprint") if isinstance(trained, dict) else None
    if not isinstance(fingerprint, dict):
        return None
    split = str(data.get("val_split", "val"))
    if data.get("dataset") == "folder":
        then, names = fingerprint.get(split), result.get("val_names")
        if not isinstance(then, dict) or names is None or then.get("names_sha256") == names:
            return None
        now, before = result.get("images"), then.get("images")
        how = (f"its {split} split: {now} images of other names than the {before}" if now == before else
               f"its {split} split: {now} images, not the {before}")
    elif data.get("dataset") == "tokens":
        then, file = fingerprint.get(f"{split}.bin"), data.get("val_file")
        if not isinstance(then, dict) or not isinstance(file, dict) or then == file:
            return None
        now, before = file.get("bytes"), then.get("bytes")
        how = (f"its {split}.bin: other tokens than the file of as many bytes" if now == before else
               f"its {split}.bin: {now} bytes, not the file of {before}")
    else:  # the embedded data sets read no data.root
        return None
    return f"data.root={data.get('root')} ({how} the run validated on under {trained.get('root') or '?'})"


def dagger_note(label: str, changes) -> str:
    """The note below a table for an entry marked † (`label`, e.g. 'vit_t CD'): how it was evaluated otherwise
    than trained, one `model_kwargs_changed` text or several (a group's, joined)."""
    return f"† {label}: evaluated with {changes if isinstance(changes, str) else '; '.join(changes)}"


def stopped_note(label: str, how: Sequence[str]) -> str:
    """The note below a table for a row marked § (`label`, e.g. 'vit_t CD'): its run (a seed of it) stopped before
    the end of its schedule, how far it got (engine.eval_results.run_end) and why it is marked: the share of its
    schedule it reached, under 99 %, and/or where the run of its model it is compared with ended (one text or
    several)."""
    return f"§ {label}: stopped before the end of its schedule: {'; '.join(how)}"


def extra_modules_note(label: str, patterns: list) -> str:
    """The note below a table for a maximum marked ‡ (`label`, e.g. 'vit_t CD'): its module maximum also counts
    modules outside the blocks (quant.act_max_extra_modules), unlike the paper's."""
    # worded for any table's column (Max. Act. (mod.), dose_report's Max. Act. mod., lm_study's max module)
    return f"‡ {label}: the module maximum also counts modules outside the blocks: " \
           f"quant.act_max_extra_modules={json.dumps(patterns)}"

