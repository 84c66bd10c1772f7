"""The evaluation JSON of one checkpoint, grown by every evaluate.py call and never overwritten blindly.

    results = EvalResults.open(path, identity)  # refuses a file that describes other weights or data
    if results.plan("repq", "w4a4", settings, recompute=False):
        ... results.add("repq", "w4a4", entry); results.save()

* identity: what the numbers are numbers of (model, checkpoint and its kind, weights fingerprint, raw/EMA, data,
  and for a folder data set the names of its val images). A file with another identity is refused, e.g. when
  best.pt has changed since it was evaluated, or the val folder was exported again with other images. The
  checkpoint reached through a link, or moved (nothing left where it was; the same weights and kind of file), is
  the same one (`_same_checkpoint`).
* every quantized result is keyed by pipeline and bit-width and records the settings it was computed
  with (pipeline options, calibration set) and when it was written; a later call skips what is there
  with the same settings, refuses other settings, and with `recompute` keeps the old entry in `history`.
  The activation maxima (`max_act`) likewise: maxima over other quant.act_max_extra_modules are refused, and
  with `recompute` the old ones move to `history` (`plan_max_act`, `retire_max_act`).
  Options that change no number (`NEUTRAL_OPTIONS`: where APHQ caches, how often APHQ and GPLQ log or GPLQ
  checkpoints its stage 1) are recorded but never make settings differ.
* `evaluation_difference`, `recipe_difference` and `repeated_weights` say whether results can be averaged as
  seeds (scripts/paper_table.py --over-seeds) or compared as points of one sweep (the dose reports); results of one
  train.seed are no two seeds (engine/train_seeds.py).
* `refuse_stale` (run by the readers of result files) refuses a result whose checkpoint holds other weights now
  (training went on after the evaluation and saved a new best.pt).
* `refuse_unfinished` (run by the readers that average runs as seeds) refuses runs that did not all end alike:
  one stopped before the end of its schedule (train.max_steps, a signal) beside runs that trained further, told by
  its metrics.jsonl and config.yaml; `refuse_unfinished_groups` runs it over result files, per group of results
  averaged together (the seeds of a row or of a method) or each alone (one result per row or circle), and
  `stopped_early` says which of a table's or figure's runs that their own train.max_steps stopped to mark (§).
* the file is rewritten (atomically) after each result, so a crash loses at most the running pipeline;
  each write merges into the file as it is then, under a lock, so that concurrent evaluate.py processes
  writing one file all keep their results (maxima over other modules written meanwhile are refused, or with
  `recompute` moved to `history`, as when written before).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import math
import os
import types
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

import torch

from cd.decay import config_decays_nothing
from cd.tweo import adds_nothing
from configs.loader import ConfigError, unread_options
from configs.quant import detection_recipe

from .checkpoint import weights_fingerprint
from .run_dir import SETTINGS_BEFORE_THEIR_KEY, SNAPSHOTS, exclusive_lock, partial_path, saved_train_setting
from .run_dir import recipe as config_recipe
from .train_seeds import SEED_FIELD, config_seed

log = logging.getLogger(__name__)


class ResultsError(ValueError):
    """An evaluation JSON that cannot take these results (another checkpoint, other settings)."""


# what the numbers of a result depend on besides its weights and its quantized entries' settings
EVALUATION_KEYS = ("model", "data", "weights", "eval_amp", "images")
# pipeline options, per pipeline, that change no number of a result: where APHQ caches its units' inputs and targets
# (copies, exact on any device, its batches drawn on the model's device), and how often APHQ and GPLQ log progress
# and GPLQ writes its stage-1 checkpoint (it records the RNG states, draws nothing). Results with other values are
# alike: a stored one is reused, seeds average, and no table marks them
NEUTRAL_OPTIONS = {"aphq": ("cache_device", "log_every"), "gplq": ("log_every", "ckpt_every")}


# identity fields added after result files were first written: a file without one takes it (see _read). A
# resampled position table's grids (pos_embed_resampled, relative_position_bias_resampled) are also named by the
# weights' fingerprint, which is compared, so a file written before they were recorded is of the same weights. An
# input size other than the one trained at (img_size_changed) is also data.eval_transform's img_size, compared
LATER_FIELDS = ("checkpoint_kind", "val_names", "annotations_sha256", "pos_embed_resampled",
                "relative_position_bias_resampled", "img_size_changed")

def take_later_data(result: dict) -> None:
    """Give `result` (a result file's record) the data settings its "data" holds now and a file written before
    lacks (LATER_FIELDS' kind, inside "data"): a synthetic result's synthetic_val_size, its image count ("images":
    the synthetic val split is that many seeded images, data/synthetic.py). Such a file then compares with a newer
    result of the same images alike, and tables compare its size with its run's (result_table.data_changed)."""
    data, images = result.get("data"), result.get("images")
    if (isinstance(data, dict) and data.get("dataset") == "synthetic" and "synthetic_val_size" not in data
            and isinstance(images, int) and not isinstance(images, bool)):
        data["synthetic_val_size"] = images


# the kinds of file a result can score (`checkpoint_kind`): a run's best.pt and its checkpoint.pt (the latest) hold
# weights of different updates, so seeds of one kind and of the other are no seeds of one evaluation
CHECKPOINT_KINDS = {"best.pt": "best", "checkpoint.pt": "latest"}
# the update of training the scored checkpoint's weights are of (its state.step), which evaluate.py records for a
# run's checkpoint. Seeds' snapshots, or files set aside, of one kind may be of other updates (epoch0001.pt beside
# epoch0002.pt): compared (`step_difference`). A best.pt is of its own run's best validation, whose update differs
# between seeds by nature, and a checkpoint.pt of its run's end (one that ended early: refuse_unfinished)
STEP_FIELD = "checkpoint_step"
STEP_KINDS = ("snapshot", "other")
# whether the scored file holds its run's best validation weights, as its own training state shows (evaluate.py:
# state.step == state.best_step and state.best_fingerprint that of its raw weights): a best.pt renamed or gathered
# (seed0.pt) or set aside by a resume (best.until_step<N>.pt) is of kind "other", yet of its run's best validation
# as best.pt is, whose update differs between seeds by nature (`step_difference` does not compare two of them)
BEST_FIELD = "checkpoint_best"


def checkpoint_kind(checkpoint: Optional[str], pretrained: bool = False) -> str:
    """Which of a run's files `checkpoint` is: "best" (best.pt), "latest" (checkpoint.pt), "snapshot" (a file in a
    run's snapshots folder, train.keep_every_epochs), "other" (a file set aside as *.until_step<N>.pt, a renamed
    copy) or, with `pretrained` (model.pretrained weights, "hub" included), "weights". The name given decides
    when it is best.pt or checkpoint.pt (a run whose files are links into a content-addressed store, DVC or
    git-annex); any other name is of the kind of the file it links to (results gathered as links named by seed).
    The path is normalized (./, .., a trailing separator)."""
    if pretrained or not checkpoint:
        return "weights"
    for path in (os.path.abspath(checkpoint), os.path.realpath(checkpoint)):
        # the name first: a run's own folder may be called snapshots (out_dir=runs/snapshots), and its best.pt is best
        if os.path.basename(path) in CHECKPOINT_KINDS:
            return CHECKPOINT_KINDS[os.path.basename(path)]
    return "snapshot" if os.path.basename(os.path.dirname(path)) == SNAPSHOTS else "other"


def as_stored(value: Any) -> Any:
    """`value` as it reads back from a result file (JSON: tuples as lists, other objects as their text)."""
    return json.loads(json.dumps(value, default=str))  # tuples -> lists, as they come back from the file


def detector_result(result: dict) -> bool:
    """Whether `result` (a result file's record, or its identity) is of a detector: evaluate_detection.py records
    task "detection" in its identity (since its first version), evaluate.py, which quantizes classifiers and
    language models, no task."""
    return result.get("task") == "detection"


# what percentile's clipping levels recorded as null meant, by the range rule of their operand: entries written before
# results recorded the levels used (quant/ptq/percentile.py recorded_options) hold null for the default of then
# (quant.ranges.range_search, unchanged until they were recorded), which is compared as these values, not as whatever
# the default is when they are read; minmax reads no level (null)
NULL_PERCENTILES = {"percentile": [0.9999], "percentile_mse": [0.999, 0.9999, 0.99999]}
# the same for APHQ's hessian_eps (quant/aphq/pipeline.py hessian_eps: by the classifier's probe; a detector's
# quant/aphq/detector.py DETECTION_EPS) and GPLQ's lr (quant/gplq/pipeline.py default_lr: by the global batch, the
# entry's batch_size_per_gpu x its recorded world_size) and scale_lr (null: the lr), recorded as the values used since
NULL_HESSIAN_EPS = {"ones": 1e-6, "rademacher": 1e-4}
NULL_DETECTION_EPS = 1e-3
# a detector entry written before evaluate_detection.py recorded the values of the defaults it resolves (its
# recorded_options) holds none of them where none was given, and ran at what null meant then (`_null_meant`; GPLQ's lr
# by the detection recipe's batch_size_per_gpu of then where the entry holds none)
NULL_DETECTION_GPLQ_BATCH = 1


def null_gplq_lr(global_batch: int) -> float:
    """GPLQ's lr that null meant at `global_batch` images per update (default_lr of then; a stage-1 checkpoint's null
    reads so too, quant/gplq/qat.py lr_meant_then)."""
    return 5e-6 if global_batch >= 128 else 2.5e-6 if global_batch >= 64 else 1e-6


def _null_meant(pipeline: str, options: dict, detector: bool = False, ranks: Optional[int] = None) -> dict:
    """`options` with each option recorded as null whose value results now record replaced by what it meant: a
    percentile level the levels of NULL_PERCENTILES (by its operand's range rule as recorded, else the default rule of
    then, percentile_mse), APHQ's hessian_eps NULL_HESSIAN_EPS (a `detector`'s NULL_DETECTION_EPS) and mlp_iters
    (with mlp_reconstruct on) the entry's iters, GPLQ's lr the lr of the entry's global batch on its `ranks` processes
    (unknown without them: kept null) and scale_lr its lr."""
    meant = {}
    if pipeline == "percentile":
        for operand in ("act", "weight"):
            key, method = f"{operand}_percentiles", options.get(f"{operand}_range", "percentile_mse")
            if key in options and options[key] is None and method in NULL_PERCENTILES:
                meant[key] = NULL_PERCENTILES[method]
    elif pipeline == "aphq":
        if "hessian_eps" in options and options["hessian_eps"] is None:
            probe = options.get("hessian_probe", "ones")
            meant["hessian_eps"] = NULL_DETECTION_EPS if detector else NULL_HESSIAN_EPS.get(probe)
        if "mlp_iters" in options and options["mlp_iters"] is None and options.get("mlp_reconstruct"):
            meant["mlp_iters"] = options.get("iters")  # mlp_iterations: null follows iters
    elif pipeline == "gplq":
        lr = options.get("lr")
        batch = options.get("batch_size_per_gpu", NULL_DETECTION_GPLQ_BATCH if detector else None)
        if "lr" in options and lr is None and ranks is not None and isinstance(batch, int):
            lr = meant["lr"] = null_gplq_lr(batch * ranks)
        if "scale_lr" in options and options["scale_lr"] is None and lr is not None:
            meant["scale_lr"] = lr
    return {**options, **meant}


def read_options(pipeline: str, options: dict, detector: bool = False, ranks: Optional[int] = None) -> dict:
    """`options` ({name: value} of `pipeline`'s quant.<pipeline> section) without those that the config's rules
    say are unread under the others (configs/loader.py unread_options: quant.aphq.recon_images at iters=0): the
    result is the same whatever they hold, and no command sets them (an override of an unread key is refused).
    Options of a classifier (evaluate.py's, the default) by every rule, those of a `detector` by the rules its
    --quant-options obey (configs/loader.py DETECTOR_RULES: without the classifier's own, CLASSIFIER_ONLY, as a
    detector's neck reads quant.aphq.act_lr at drop_prob=0; with its own, DETECTOR_ONLY, as an entry written before
    they refused quant.gplq.batch_size_per_gpu at steps=0 holds it). A null that an older entry holds for what results
    now record the value of reads as the value it meant then (`_null_meant`; GPLQ's lr by the entry's `ranks`, its
    recorded world_size)."""
    unread = unread_options(f"quant.{pipeline}", options, classifier=not detector, detector=detector)
    return {name: value for name, value in _null_meant(pipeline, options, detector, ranks).items()
            if name not in unread}


def detector_entry_options(pipeline: str, settings: dict) -> dict:
    """A detector entry's options, each one it leaves out at the value it ran with. evaluate_detection.py records
    every option it reads; an entry written before holds those typed (and since, the values of the defaults it
    resolves), and ran the others at the pipeline's defaults with its detection recipe (configs/quant.py
    detection_recipe, of the entry's calib_images), read here as they are now: a change of one of them must give
    such entries its old value here. A command that types a default out asks for the same result. A resolved default
    that an older entry leaves out is null here, read as what null meant then (`_null_meant`). An APHQ entry at
    drop_prob=0 without act_lr ran at the default too (between ac3a53d and 90fb3cc act_lr was refused there on a
    detector, whose neck reads it)."""
    from quant import PIPELINES
    options = settings.get("options", {})
    if pipeline not in PIPELINES or not isinstance(options, dict):
        return options
    defaults = {**dataclasses.asdict(PIPELINES[pipeline].Options()),
                **detection_recipe(pipeline, settings.get("calib_images"))}
    return {**as_stored(defaults), **options}


def comparable_settings(settings: Optional[dict], pipeline: str, detector: bool = False,
                        bits: Optional[str] = None) -> dict:
    """A quantized entry's settings of `pipeline` as compared: plain JSON types, without its NEUTRAL_OPTIONS,
    without the options unread under its own (`read_options`, by a `detector`'s rules for an entry of
    evaluate_detection.py; entries written before evaluate.py left them out hold them, maybe with another value than
    the default a command now records), and, given the entry's `bits` (its key, e.g. "w4a8"), without the options
    the pipeline does not read at those bits (`unread_at_bits`: APHQ's round_zero_point at a_bits != w_bits) and with
    a null stem / head bit-width as the one of `bits` it ran at (`first_last_at_bits`)."""
    plain = as_stored(settings or {})
    if detector:  # the options it records, and the defaults it ran the others at
        plain["options"] = detector_entry_options(pipeline, plain)
    if isinstance(plain.get("options"), dict):
        skipped = {*NEUTRAL_OPTIONS.get(pipeline, ()), *unread_at_bits(pipeline, bits)}
        options = first_last_at_bits(read_options(pipeline, plain["options"], detector, plain.get("world_size")), bits)
        plain["options"] = {k: v for k, v in options.items() if k not in skipped}
    return plain


# a stem / head bit-width option and the main bit-width its null follows (configs.quant.FirstLastOptions.resolved)
FIRST_LAST_BITS = {"stem_w_bits": "w", "stem_a_bits": "a", "head_w_bits": "w", "head_a_bits": "a"}


def first_last_at_bits(options: dict, bits: Optional[str]) -> dict:
    """`options` with each null stem / head bit-width replaced by the main bit-width of `bits` it ran at: a null
    head_w_bits at w4a4 and head_w_bits=4 quantize the head alike (quant.first_last=w8a8 at w8a8 runs what the null
    ones run). As they are without bits, or with a key that names no bit-width (a hand-edited one)."""
    from quant import parse_bits  # here: the quantization package imports engine modules
    if bits is None:
        return options
    try:
        parsed = parse_bits(bits)
    except (ValueError, TypeError):
        return options
    return {k: getattr(parsed, FIRST_LAST_BITS[k]) if k in FIRST_LAST_BITS and v is None else v
            for k, v in options.items()}


def unread_at_bits(pipeline: str, bits: Optional[str]) -> set[str]:
    """The options `pipeline` does not read at `bits`, whatever their value (the pipeline's `unread_at`): every
    entry at those bits is the same result whatever they hold. None for no bits, an unknown pipeline, or a key that
    names no bit-width: nothing is left out."""
    # imported here: the quantization package imports engine modules, which must not wait on it
    from quant import PIPELINES, parse_bits
    unread_at = getattr(PIPELINES.get(pipeline), "unread_at", None)
    if bits is None or unread_at is None:
        return set()
    try:
        parsed = parse_bits(bits)
    except (ValueError, TypeError):  # a hand-edited key: compared in full
        return set()
    return set(unread_at(parsed))


# settings added after quantized entries were first written, compared only where both hold them: a folder data set's
# train-split files (engine/quant_settings.py train_folder_fingerprint). An entry written before is taken as of the
# files the split holds now, as the identity's val_names (LATER_FIELDS): refusing it would refuse every quantized
# entry of a folder (an ImageNet) data set written until then
LATER_SETTINGS = (("calibration", "train_files"), ("train_transform", "train_files"))
# the same of a detector's entries (evaluate_detection.py), at the top of its settings: the contents of the training
# split's annotation files its images are drawn from
LATER_DETECTOR_SETTINGS = ("train_annotations_sha256",)


def without_later_settings(x: dict, y: dict) -> tuple[dict, dict]:
    """Comparable settings `x` and `y` without each LATER_SETTINGS or LATER_DETECTOR_SETTINGS key that only one of
    them holds."""
    for part, key in LATER_SETTINGS:
        a, b = x.get(part), y.get(part)
        if isinstance(a, dict) and isinstance(b, dict) and (key in a) != (key in b):
            x, y = ({**s, part: {k: v for k, v in s[part].items() if k != key}} for s in (x, y))
    for key in LATER_DETECTOR_SETTINGS:
        if (key in x) != (key in y):
            x, y = ({k: v for k, v in s.items() if k != key} for s in (x, y))
    return x, y


def settings_change(entry: dict, settings: dict, pipeline: str, detector: bool = False,
                    bits: Optional[str] = None) -> Optional[str]:
    """How the settings a quantized entry of `pipeline` in a result file was computed with differ from `settings`
    ('key old -> new; ...', its NEUTRAL_OPTIONS aside, and given the entry's `bits` the options unread at them), or
    None when alike: such an entry is no result of `settings`. `detector`: the file is evaluate_detection.py's
    (`detector_result`), compared by its rules."""
    stored, asked = without_later_settings(comparable_settings(entry.get("settings"), pipeline, detector, bits),
                                           comparable_settings(settings, pipeline, detector, bits))
    return None if stored == asked else settings_diff(stored, asked)


class Difference(NamedTuple):
    """How two results were evaluated differently: `what` differs (an EVALUATION_KEYS key, or
    '<pipeline> <bits> settings'), `detail` says how; `of_settings` when it is a quantized entry's settings
    (evaluate.py --recompute replaces such an entry; other data or weights are another file)."""
    what: str
    detail: str
    of_settings: bool

    def __str__(self) -> str:
        return f"{self.what}: {self.detail}"


def evaluation_difference(a: dict, b: dict) -> Optional[Difference]:
    """How two results of evaluate.py were evaluated differently, besides their weights: the first differing
    of the model, the val data, raw or EMA weights, autocast, the image count, and the settings of each
    quantized entry both hold, the kind of checkpoint scored (of run files: best.pt, checkpoint.pt, a snapshot, a
    file set aside), the update of two snapshots or two files set aside (`step_difference`) and the names of the
    val images where both record them; None when alike."""
    for key in EVALUATION_KEYS:
        x, y = as_stored(a.get(key)), as_stored(b.get(key))
        if x != y:
            return Difference(key, f"{json.dumps(x, sort_keys=True)} vs {json.dumps(y, sort_keys=True)}", False)
    # one seed's best.pt beside another's checkpoint.pt: weights of other updates (the best validation, the last).
    # Results written before the kind was recorded have none and are not compared (their checkpoint's name would
    # tell, but a result gathered as a copy records the path it was evaluated at, which may be gone); nor are
    # model.pretrained weights ("weights"): no file of a run, so there is no same file of it to score instead
    # (a public model's maxima beside a run's, README's `model.pretrained=/weights/deit_base.pth`)
    x, y = a.get("checkpoint_kind"), b.get("checkpoint_kind")
    if None not in (x, y) and "weights" not in (x, y) and x != y:
        return Difference("checkpoint_kind", f"{json.dumps(x)} vs {json.dumps(y)}: score the same file of every "
                                             "run (each one's best.pt, or each one's checkpoint.pt)", False)
    step = step_difference(a, b)
    if step is not None:
        return step
    content = content_difference(a, b)
    if content is not None:
        return content
    # the module maximum is over the modules inside blocks plus quant.act_max_extra_modules: other patterns measure
    # another maximum (a file holds one: evaluate.py --recompute moves maxima over other modules to its history)
    x, y = extra_modules(a), extra_modules(b)
    if x != y:
        return Difference("max_act.extra_modules", f"{json.dumps(x)} vs {json.dumps(y)}", False)
    quant_a, quant_b = a.get("quant") or {}, b.get("quant") or {}
    for pipeline in sorted(set(quant_a) & set(quant_b)):
        for bits in sorted(set(quant_a[pipeline]) & set(quant_b[pipeline])):
            x, y = without_later_settings(*(comparable_settings(r["quant"][pipeline][bits].get("settings"), pipeline,
                                                                detector_result(r), bits) for r in (a, b)))
            if x != y:
                return Difference(f"{pipeline} {bits} settings", settings_diff(x, y), True)
    return None


def step_difference(a: dict, b: dict) -> Optional[Difference]:
    """Other updates of training, where both results score a file of one of STEP_KINDS (two snapshots, or two files
    set aside or renamed) and record the update its weights are of (STEP_FIELD); None otherwise. Results written
    before evaluate.py recorded the update have none: not compared (their update is unknown, as their kind is for
    files written before that was recorded). Two files of kind "other" that both hold their run's best validation
    weights (BEST_FIELD: best.pt files renamed or set aside as best.until_step<N>.pt) are not compared, as two best.pt
    files are not; a snapshot is of the epoch it was kept at, whatever validation it holds."""
    kinds = {a.get("checkpoint_kind"), b.get("checkpoint_kind")}
    x, y = a.get(STEP_FIELD), b.get(STEP_FIELD)
    if len(kinds) != 1 or not kinds <= set(STEP_KINDS) or None in (x, y) or x == y:
        return None
    if kinds == {"other"} and a.get(BEST_FIELD) is True and b.get(BEST_FIELD) is True:
        return None
    return Difference(STEP_FIELD, f"update {x} vs update {y} ({kinds.pop()} files): score the file of one update of "
                                  "every run (each one's snapshot of one epoch), or each one's best.pt (a copy of it "
                                  f"evaluated before evaluate.py recorded {BEST_FIELD}: evaluate it again)", False)


def content_difference(a: dict, b: dict) -> Optional[Difference]:
    """Other data under the same root, split and image count: other image names (a val folder exported again
    between two evaluations) or another annotation file's content (detection), or None. Results written before
    these were recorded have none and are not compared."""
    for key, what in (("val_names", "other val images"), ("annotations_sha256", "other annotations")):
        x, y = a.get(key), b.get(key)
        if None not in (x, y) and x != y:
            return Difference(key, f"{x[:12]}... vs {y[:12]}...: {what} under the same data.root", False)
    return None


def extra_modules(result: dict) -> list:
    """The quant.act_max_extra_modules a result's activation maxima were measured with ([]: inside blocks only,
    the paper's set; also for a result without max_act)."""
    return sorted(as_stored((result.get("max_act") or {}).get("extra_modules") or []))


def first_difference(labelled: Sequence[tuple[str, dict]]) -> Optional[tuple[str, str, Difference]]:
    """(label, label, difference) of the first two results evaluated differently (every pair is compared: an
    entry the first result lacks is compared among the others), or None."""
    for i, (label, result) in enumerate(labelled):
        for earlier_label, earlier in labelled[:i]:
            difference = evaluation_difference(earlier, result)
            if difference is not None:
                return earlier_label, label, difference
    return None


@functools.lru_cache(maxsize=1)
def _default_recipe() -> dict:
    """The recipe of the default config, as evaluate.py records a run's."""
    from configs import Config, config_to_dict
    return config_recipe(config_to_dict(Config()))


def regularizers_as_trained(run_recipe: dict) -> dict:
    """`run_recipe` with the cd.* or tweo.* settings of a regularizer that is off or trains as without it
    (cd.decay.config_decays_nothing, cd.tweo.adds_nothing: cd.lam=0, tweo.lam=0) at their defaults, and cd.budget at
    its default where cd.lam is 0 (the rule's wd - 0 is the weight decay as given): such a run trains bit for bit as
    its baseline (tests/test_method_of_a_training_that_changes_nothing.py), is labelled as it
    (engine.result_table.method_name) and is one of its seeds. A recipe without a key the rule reads (an older
    file) keeps its settings."""
    defaults, found = _default_recipe(), dict(run_recipe)
    cd = {k[len("cd."):]: v for k, v in run_recipe.items() if k.startswith("cd.")}
    if {"enabled", "lam", "lam_per_role", "mode", "loss_coef", "budget"} <= set(cd):
        if not cd["enabled"] or config_decays_nothing(types.SimpleNamespace(**cd)):
            found.update({f"cd.{k}": defaults[f"cd.{k}"] for k in cd if f"cd.{k}" in defaults})
        elif cd["lam"] == 0:
            found["cd.budget"] = defaults["cd.budget"]
    if {"tweo.enabled", "tweo.lam"} <= set(run_recipe) and (not run_recipe["tweo.enabled"]
                                                             or adds_nothing(run_recipe["tweo.lam"])):
        found.update({k: defaults[k] for k in run_recipe if k.startswith("tweo.") and k in defaults})
    return found


def recipe_difference(labelled: Sequence[tuple[str, dict]]) -> Optional[tuple[str, str, str]]:
    """(label, label, how) of the first result trained with other settings than the first one (the `recipe`
    evaluate.py records: every training setting but the seed), or None. Results written before the recipe was
    recorded have none and are not compared; nor are keys only one recipe has (a setting added to the config
    between two evaluate.py versions: the older result could not record it), but those of SETTINGS_BEFORE_THEIR_KEY,
    compared as the value every run had before its key: a train.tf32=false run is no seed of an older result's.
    The settings of a regularizer that changes nothing are compared as the baseline's (`regularizers_as_trained`)."""
    recipes = [(label, regularizers_as_trained({**SETTINGS_BEFORE_THEIR_KEY, **result["recipe"]}))
               for label, result in labelled if result.get("recipe")]
    for label, other in recipes[1:]:
        first = recipes[0][1]
        shared = set(first) & set(other)
        if any(first[k] != other[k] for k in shared):
            return recipes[0][0], label, settings_diff({k: first[k] for k in shared}, {k: other[k] for k in shared})
    return None


def repeated_weights(labelled: Sequence[tuple[str, dict]]) -> Optional[tuple[str, str, str]]:
    """(label, label, fingerprint) of the first two results of one weights file (a run given twice, a copied
    folder: one run would count as two seeds), or None; results without a fingerprint are not compared."""
    seen: dict[str, str] = {}
    for label, result in labelled:
        fingerprint = result.get("fingerprint")
        if fingerprint is not None and fingerprint in seen:
            return seen[fingerprint], label, fingerprint
        if fingerprint is not None:
            seen[fingerprint] = label
    return None


def metrics_records(folder: str) -> list[dict]:
    """The records of a run's metrics.jsonl; a last line that is not JSON is a record being written (a run
    still training, or one killed mid-write: train.py drops it when it resumes) and is left out."""
    path = os.path.join(folder, "metrics.jsonl")
    try:  # train.py writes JSON's ASCII: bytes that are not UTF-8 are damage, not a record being written
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as e:
        raise ResultsError(f"{path} cannot be read as text ({e}): the file is damaged") from None
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            if number < len(lines):
                raise ResultsError(f"{path}, line {number}: not a JSON record; the file is damaged") from None
            continue
        # every record of train.py is an object with the update it was logged at
        if not isinstance(record, dict) or isinstance(record.get("step"), bool) or \
                not isinstance(record.get("step"), int):
            raise ResultsError(f"{path}, line {number}: a record without an integer 'step': not the metrics "
                              "log of a train.py run")
        records.append(record)
    return records


def run_end(folder: str, result: dict) -> Optional[tuple[Optional[str], int]]:
    """(how far the run in `folder` got when it stopped before the end of its schedule, e.g. 'validated last at
    update 2 of the 8 of its schedule (sched.epochs=2 of 4 updates)', or None when it reached the end; the update
    it validated last at), or None when its files do not tell. train.py validates at the last update of a
    schedule (finished or not) and logs it in metrics.jsonl: the run reached the end when its last validation
    is at the schedule's last update, sched.steps or sched.epochs x the updates of an epoch (the `recipe` of
    `result`, its eval_best.json, records the schedule it trained with; each logged training record its
    updates and epochs so far, `train/epoch`, whose ratio is the updates of an epoch). Not told: a folder
    without metrics.jsonl, a result without a recorded schedule (an older file), an epoch schedule without a
    training record that counts its epochs (none logged yet)."""
    recipe = result.get("recipe")
    if not isinstance(recipe, dict) or not os.path.isfile(os.path.join(folder, "metrics.jsonl")):
        return None
    records = metrics_records(folder)
    if (length := schedule_updates(recipe, records)) is None:
        return None
    planned, schedule = length
    reached = max((r["step"] for r in records if any(k.startswith("val/") for k in r)), default=0)
    short = None if reached >= planned else f"validated last at update {reached} of the {planned} of its schedule " \
                                            f"({schedule})"
    return short, reached


def schedule_updates(recipe: dict, records: Sequence[dict]) -> Optional[tuple[int, str]]:
    """The updates of the schedule a run trained with (`run_end`: its result's `recipe`, its metrics.jsonl's
    `records`) and how it was given (e.g. 'sched.epochs=2 of 4 updates'), or None where they do not tell."""
    steps, epochs = recipe.get("sched.steps"), recipe.get("sched.epochs")
    if _positive_int(steps):
        return steps, f"sched.steps={steps}"
    if _positive_int(epochs) and (per_epoch := updates_per_epoch(records)) is not None:
        return epochs * per_epoch, f"sched.epochs={epochs} of {per_epoch} updates"
    return None


def updates_per_epoch(records: Sequence[dict]) -> Optional[int]:
    """The updates of an epoch by the last training record of metrics.jsonl (its update over its epochs so far,
    `train/epoch`, fractional), or None without one."""
    for record in reversed(records):
        epoch = record.get("train/epoch")
        if isinstance(epoch, (int, float)) and not isinstance(epoch, bool) and math.isfinite(epoch) and epoch > 0:
            return max(1, round(record["step"] / epoch))
    return None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def refuse_unfinished(runs: Sequence[tuple[str, dict, str]],
                      use: str = "averaged as a seed of finished ones") -> None:
    """A ResultsError unless the runs, each (folder, result, how to leave it out of what is averaged, e.g. 'move
    it out of the sweep root'), all ended alike: each at the end of its schedule, or each at one update that its
    own train.max_steps stops it at (a recipe that ends there on purpose, e.g. one that sets train.max_steps=20000
    within 1 % of its schedule's 20,016 updates). A run short of its schedule's end
    (`run_end`) and not at its config.yaml's train.max_steps stopped on a signal or was evaluated while it trained;
    one stopped at a train.max_steps of its own beside runs that trained further was stopped early. Either one's
    numbers, averaged as one more seed or compared with the others, would be those of an earlier model. `use` says
    what would be done with an unfinished run's numbers (a table of one run per row tabulates them rather than
    averaging them)."""
    capped, ended = [], []  # (folder, progress, leave_out, update) at their own train.max_steps; (folder, update)
    for folder, result, leave_out in runs:
        end = run_end(folder, result)
        if end is None:
            continue  # its files do not tell
        progress, reached = end
        if progress is None:
            ended.append((folder, reached))
        elif reached == _max_steps(folder):
            capped.append((folder, progress, leave_out, reached))
        else:
            raise ResultsError(f"{folder} {progress}: an unfinished run (stopped by a signal, or evaluated while it "
                               f"trained) would be {use}; finish it: re-run its "
                               f"command (a sweep's: scripts/sweep.py SWEEP.yaml --run --evaluate, which continues it "
                               f"and evaluates it again), or {leave_out}")
    if not capped:
        return
    stopped = min(capped, key=lambda c: c[3])
    further = next((f for f, reached in ended + [(c[0], c[3]) for c in capped] if reached > stopped[3]), None)
    if further is not None:
        raise ResultsError(f"{stopped[0]} {stopped[1]}: an unfinished run (stopped at its train.max_steps="
                           f"{stopped[3]}, where {further} trained further) would be averaged as a seed of, or "
                           f"compared with, runs that trained longer; finish it: re-run its command without "
                           f"train.max_steps (a sweep's: scripts/sweep.py SWEEP.yaml --run --evaluate, which "
                           f"continues it and evaluates it again), or {stopped[2]}")


def _max_steps(folder: str) -> Optional[int]:
    """The train.max_steps of the run's config.yaml (what its latest command set), None without one."""
    value = saved_train_setting(folder, "max_steps")
    return value if _positive_int(value) else None


def run_folder(path: str, result: dict) -> Optional[str]:
    """The folder of the run whose end the result at `path` is of: that of its best.pt or checkpoint.pt
    (`evaluated_checkpoint`), or of the file itself when that checkpoint is gone; None for a result of a snapshot,
    of a file set aside or of model.pretrained weights, which no run's end is expected of."""
    kind = result.get("checkpoint_kind") or checkpoint_kind(result.get("checkpoint"))
    if kind not in ("best", "latest"):
        return None
    checkpoint = evaluated_checkpoint(path, result)
    return os.path.dirname(checkpoint if checkpoint else os.path.realpath(path))


def refuse_unfinished_groups(groups: Iterable[Sequence[tuple[str, dict, str]]], use: str) -> None:
    """`refuse_unfinished` over each group of result files, each (the file's path, its result, how to leave it out,
    e.g. 'leave x.json out of --over-seeds'), judged by the run of its best.pt or checkpoint.pt (`run_folder`; a
    result of no run's end, a snapshot's, is not judged). A group is what is averaged together: the seeds of one row
    (paper_table.py --over-seeds: one model and method) or of one method (compare_act_max.py); a table or figure of
    one result per row or circle makes a group of each (runs of other recipes end at other updates, and none is
    averaged with another). `use` says what would be done with an unfinished run's numbers."""
    for group in groups:
        refuse_unfinished([(folder, result, leave_out) for path, result, leave_out in group
                           if (folder := run_folder(path, result)) is not None], use=use)


# a run its own train.max_steps stopped short of this percentage of its schedule's updates is marked § even where
# nothing beside it ended elsewhere (`stopped_early`); 20,000 of 20,016 (99.9 %) is not
SHORT_OF_SCHEDULE = 99


def stopped_early(paths: Sequence[str], results: Sequence[dict], names: Sequence[str]) -> list[Optional[str]]:
    """For each result (at `paths`) whose run stopped before the end of its schedule and was not refused
    (`refuse_unfinished_groups`: at a train.max_steps of its own, e.g. 3 of 22 updates), how far it got and why a
    table or figure marks it (§), where EITHER it is shown beside a run that trained to another end (a result of the
    same model, and data set where both record one, whose run ended at another update, at its schedule's end or at
    a train.max_steps of its own; its note names that run by `names`) OR it reached less than 99 % of its schedule's
    updates (SHORT_OF_SCHEDULE: a model trained for a fraction of its recipe, alone or beside runs that all stopped
    alike); else None. Both reasons are given where both apply. A run records no origin of its train.max_steps (its
    command line or its recipe file), so a recipe that stops there on purpose is told by its runs stopping alike
    within 1 % of their schedule's end: a recipe whose train.max_steps stops its runs at 20,000 of their 20,016
    updates (99.9 %) marks none of them. A damaged metrics.jsonl is a ResultsError."""
    ends = []  # per result: (how far it got, or None at its schedule's end; the update it validated last at)
    planned = []  # per result: the updates of its schedule, or None where its files do not tell
    for path, result in zip(paths, results):
        folder = run_folder(path, result)
        end = run_end(folder, result) if folder is not None else None
        length = (schedule_updates(result["recipe"], metrics_records(folder))
                  if end is not None and end[0] is not None else None)
        ends.append(end)
        planned.append(length[0] if length is not None else None)

    def trained_elsewhere(i: int, j: int) -> bool:
        """Whether result j is of i's model and data set (where both record one) and its run ended at another
        update than i's."""
        first, second = _trained_data_set(results[i]), _trained_data_set(results[j])
        return (ends[j] is not None and ends[j][1] != ends[i][1] and results[j]["model"] == results[i]["model"]
                and (first is None or second is None or first == second))
    found: list[Optional[str]] = []
    for i, end in enumerate(ends):
        # one stopped short elsewhere than at its own train.max_steps is refused (refuse_unfinished)
        if end is None or end[0] is None:
            found.append(None)
            continue
        other = next((j for j in range(len(results)) if trained_elsewhere(i, j)), None)
        # integers: 99 % of 20,016 updates is 19,815.84, and 20,000 are past it
        under = planned[i] is not None and 100 * end[1] < SHORT_OF_SCHEDULE * planned[i]
        reasons = ([f"at {math.floor(1000 * end[1] / planned[i]) / 10} % of its schedule's updates (under "
                    f"{SHORT_OF_SCHEDULE} %)"] if under else []) \
            + ([f"while {names[other]} ended at update {ends[other][1]}"] if other is not None else [])
        found.append(", ".join([f"{end[0]}, where its train.max_steps stopped it", *reasons]) if reasons else None)
    return found


def _trained_data_set(result: dict) -> Optional[tuple]:
    """What tells the data set a result's model was trained and scored on for `stopped_early` (runs of one model on
    other data sets end at other updates by their recipes): data.dataset and, for image folders and token files,
    data.root's last folder (the root may move between machines); None for a result that records no data (an older
    file)."""
    data = result.get("data")
    if not isinstance(data, dict) or "dataset" not in data:
        return None
    root = data.get("root") if data["dataset"] in ("folder", "tokens") else None
    return data["dataset"], os.path.basename(os.path.normpath(root)) if root else ""


class EvalResults:
    def __init__(self, path: str, data: dict, identity: dict) -> None:
        self.path, self.data, self.identity = path, data, identity
        # what this process wrote, merged into the file as it is at each save (other writers' too)
        self._fields: dict = {}
        self._added: dict = {}  # (pipeline, bits) -> entry
        self._history: list = []
        self._recompute_max_act = False  # plan_max_act's `recompute`, applied again at each save

    @classmethod
    def open(cls, path: str, identity: dict) -> "EvalResults":
        """The results at `path` (an empty record if there is none yet) for the evaluation `identity`."""
        identity = as_stored(identity)
        return cls(path, _read(path, identity), identity)

    def plan(self, pipeline: str, bits: str, settings: dict, recompute: bool) -> bool:
        """True if (pipeline, bits) must run now; False if the file already has it with these settings."""
        entry = self.data["quant"].get(pipeline, {}).get(bits)
        if entry is None or recompute:
            return True
        change = settings_change(entry, settings, pipeline, detector_result(self.identity), bits)
        if change is None:
            return False
        raise ResultsError(f"{self.path} already has {pipeline} {bits}, computed with other settings ({change}): "
                           f"give --out another file, or --recompute to replace it "
                           f"(the old entry is kept under 'history')")

    def plan_max_act(self, extra: Sequence[str], recompute: bool) -> bool:
        """Whether the activation maxima of this call, over the quant.act_max_extra_modules `extra`, replace
        maxima of the file measured over other modules (another maximum, not the same one measured again): with
        `recompute` True, and the caller keeps the old ones (`retire_max_act`); without it a ResultsError. False
        when the file has none, or of the same modules (in any order)."""
        self._recompute_max_act = recompute
        listed = self.data.get("max_act")
        before, now = extra_modules(self.data), sorted(as_stored(list(extra)))
        if not listed or before == now:
            return False
        if recompute:
            return True
        raise ResultsError(f"{self.path} holds activation maxima over quant.act_max_extra_modules="
                           f"{json.dumps(before)}, this call measures them over {json.dumps(now)}: give --out another "
                           f"file, or --recompute to replace them (the old ones are kept under 'history', with their "
                           f"CSV and plot)")

    def check_recompute_read(self, recompute: bool, runs_pipeline: bool, replaces: bool, what: str) -> None:
        """Refuse `recompute` (--recompute) where it would change nothing: no pipeline runs (no entry of the file to
        run again) and `replaces` is False: the file holds nothing else that this call measures anew only with it.
        `what` names what the file lacks, for the message (evaluate.py: maxima over other modules; every call
        measures the full-precision score and the maxima of its own modules again. evaluate_detection.py: a
        full-precision score; one is scored without --recompute where the file has none)."""
        if recompute and not runs_pipeline and not replaces:
            raise ConfigError(f"--recompute would be ignored: this evaluation runs no pipeline (pipelines: none), and "
                              f"{self.path} holds no {what}; drop it")

    def retire_max_act(self, files: dict) -> None:
        """Move the file's activation maxima to `history` (this call's replace them: `plan_max_act`), naming their
        CSV and plot where they lie now (`files`: {"csv": path, "plot": path}, e.g. moved aside; {} when there are
        none) and when they were replaced."""
        self._history.append(as_stored({"max_act": {**_measured(self.data["max_act"]), **files}, "replaced": _now()}))
        self._merge_into(self.data)

    def add(self, pipeline: str, bits: str, entry: dict, settings: dict) -> None:
        """Record a result; an entry it replaces moves to `history`."""
        self._added[(pipeline, bits)] = as_stored({**entry, "settings": settings, "written": _now()})
        self._merge_into(self.data)

    def update(self, **fields: Any) -> None:
        """Set top-level fields (fp accuracy, activation maxima: the same for every call of one identity)."""
        self._fields.update(as_stored(fields))
        self._merge_into(self.data)

    def save(self, keep_files: Optional[Callable[[dict], dict]] = None,
             then: Optional[Callable[[], object]] = None) -> None:
        """Merge this process's results into the file as it is now and write it (a temporary file and a
        rename), under an exclusive lock on `<path>.lock`, removed after: evaluate.py processes writing one
        file at the same time all keep their results (an entry of the same pipeline and bit-width written
        meanwhile by another moves to `history`). Activation maxima over other quant.act_max_extra_modules that
        another process wrote since `plan_max_act` are checked as it checks them (`_maxima_written_meanwhile`):
        refused, or with its `recompute` moved to `history`, their CSV and plot moved aside by `keep_files`
        (engine.act_max_ownership.keep_act_max_files: the listed {"csv": path, "plot": path} -> where they lie
        now). `then` runs after the write, still under the lock (evaluate.py writes the maxima files the JSON
        names: another process moving them aside finds them whole, never half-way to being written); its errors
        go on as they come, the file written."""
        # a path that is a symlink to a file: the file it names is the one written (a rename over the link replaced
        # the link by a copy and left its file as it was), locked under its own name whichever name a writer gives
        target = os.path.realpath(self.path)
        folder = os.path.dirname(target)
        tmp = partial_path(target)
        with contextlib.ExitStack() as held:
            try:
                os.makedirs(folder, exist_ok=True)
                held.enter_context(exclusive_lock(f"{target}.lock", wait=True))  # released if this process dies
                data = _read(self.path, self.identity, say_moved=False)  # said when it was opened
                self._maxima_written_meanwhile(data, keep_files)
                self._merge_into(data)
                with open(tmp, "w") as f:
                    json.dump(data, f, indent=2, default=str)
                    # on disk before the rename (docs/operations.md): a machine that goes down after it could
                    # otherwise leave an empty file in place of every result written so far (XFS, ext4 without
                    # auto_da_alloc), and a full disk shows here, with the file unchanged
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException as e:  # a full disk, a read-only folder, Ctrl-C: the file stays, the temp goes
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                if not isinstance(e, OSError):  # an interrupt (or a bug) goes on as it came, minus the temp in --out
                    raise
                state = "the file is unchanged" if os.path.exists(self.path) else "no file was written"
                raise ResultsError(f"could not write {self.path}: {e}; {state}, the results finished so far are "
                                   f"in the log. Fix the folder (or give --out a file in another one) and re-run: "
                                   f"what the file has is not computed again") from e
            self.data = data
            if then is not None:
                then()

    def _maxima_written_meanwhile(self, data: dict, keep_files: Optional[Callable[[dict], dict]]) -> None:
        """plan_max_act's check of the file as it is at a save (`data`, read under the lock): maxima over other
        modules than this call's that another evaluate.py wrote after this one planned (two calls started at once,
        each finding none) are another measurement, which an update would silently replace. Without `recompute` a
        ResultsError (the file unchanged); with it they move to `history` as `retire_max_act` moves them. Those this
        call retired itself are in its history already."""
        ours = self._fields.get("max_act")
        if not ours or not data.get("max_act") or extra_modules(data) == extra_modules({"max_act": ours}):
            return
        theirs = _measured(data["max_act"])
        if any(_measured(h["max_act"]) == theirs for h in self._history if isinstance(h.get("max_act"), dict)):
            return
        if not self._recompute_max_act:
            raise ResultsError(f"{self.path} now holds activation maxima over quant.act_max_extra_modules="
                               f"{json.dumps(extra_modules(data))}, written by another evaluate.py since this call "
                               f"read it; this call measured them over {json.dumps(extra_modules({'max_act': ours}))} "
                               f"and writes nothing more to it: give --out another file, or --recompute to replace "
                               f"them (the old ones are kept under 'history', with their CSV and plot)")
        # with their digests: without them keep_files takes any file at the listed names for theirs (a result
        # written before digests were) and moves a file of someone else's aside as the old maxima's
        listed = {k: v for k, v in data["max_act"].items() if k in ("csv", "plot", "digests")}
        files = keep_files(listed) if keep_files is not None else {}
        self._history.append(as_stored({"max_act": {**theirs, **files}, "replaced": _now()}))

    def _merge_into(self, data: dict) -> None:
        data.update(self._fields)
        history = data.setdefault("history", [])
        for (pipeline, bits), entry in self._added.items():
            current = data["quant"].get(pipeline, {}).get(bits)
            replaced = {"pipeline": pipeline, "bits": bits, **(current or {})}
            if current is not None and current != entry and replaced not in self._history:
                self._history.append(replaced)
            data["quant"].setdefault(pipeline, {})[bits] = entry
        history += [h for h in self._history if h not in history]
        if not history:
            del data["history"]


def _measured(max_act: dict) -> dict:
    """Activation maxima without the names of their CSV and plot (which move aside when they are replaced)."""
    return {k: v for k, v in max_act.items() if k not in ("csv", "plot")}


def check_result_path(path: str, flag: str = "--out") -> None:
    """Refuse a result path (`flag`'s value) that names a folder: one that exists, or one still to be made (the path
    ends in a separator, or in . / ..). evaluate.py runs it with its arguments, before any work: found at the first
    write, such a path came after the full-precision and maxima passes, as an error about its lock file. A file path
    in a folder that does not exist yet is taken (evaluate.py makes the folder). An empty one (an unset shell
    variable in --out "$OUT") is refused, not taken for the default path."""
    if not path:
        raise ResultsError(f"{flag} is empty: give a file path (e.g. {flag} eval.json), or drop {flag} for the "
                           f"default beside the checkpoint")
    example = os.path.join(os.path.normpath(path), "eval.json")
    if os.path.isdir(path):  # not "move it away": a folder of the user's (a run's) stays where it is
        raise ResultsError(f"{path} is a folder: give {flag} a file path, e.g. {example}")
    name = os.path.basename(path)
    if name in ("", ".", ".."):  # "new/", "new/.": no file name to write
        raise ResultsError(f"{flag} {path} names a folder (it ends in {name or 'a path separator'}): give {flag} a "
                           f"file path, e.g. {example}")


def _read(path: str, identity: dict, say_moved: bool = True) -> dict:
    """The record at `path` (a new one if there is none), refused if it is of another evaluation. A checkpoint
    recorded at another path is the same one reached otherwise, or moved (`_same_checkpoint`; `say_moved`: log
    the new path taken)."""
    if not os.path.exists(path):
        return {**identity, "quant": {}}
    check_result_path(path)  # a folder made since the command's own check
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not text at all (UnicodeDecodeError)
        raise ResultsError(f"{path} exists but cannot be read as JSON ({e}); "
                           f"move it away or give --out another file") from None
    # every file evaluate.py writes holds 'quant' and its identity's fields: a JSON object with none of them was
    # written by something else, and its lack of every field is no 'other evaluation' (checkpoint_kind: see below)
    recorded = any(k in data for k in identity if k not in LATER_FIELDS) if isinstance(data, dict) else False
    if not recorded or not isinstance(data.get("quant"), dict) or not all(
            isinstance(entries, dict) for entries in data["quant"].values()):
        raise ResultsError(f"{path} exists but is not a result file of evaluate.py ({_shape(data)}); move it "
                           f"away or give --out another file")
    # a file written before a field was recorded takes it. The checkpoint's kind follows from its path, which is
    # compared. The val images' names (a detection result's annotation file's content) cannot be checked: such a
    # file is taken as of the images its root, split and image count (compared) hold now, as before they were
    # recorded; refusing it would refuse every result file of a folder (a COCO) data set written until then
    for key in LATER_FIELDS:
        if key in identity and key not in data:
            data[key] = identity[key]
    take_later_data(data)
    differs = [k for k, v in identity.items() if data.get(k) != v]
    if "checkpoint" in differs and _same_checkpoint(data, identity, differs, path, say_moved):
        differs.remove("checkpoint")
    if differs:
        detail = "; ".join(f"{k}: {data.get(k)!r} in the file, {identity[k]!r} now" for k in differs)
        # under another autocast alone, the file's own --amp adds to it (scripts/sweep.py: its --eval-amp)
        same_amp = (f", or --amp {data['eval_amp']} to add to it" if differs == ["eval_amp"]
                    and isinstance(data.get("eval_amp"), str) else "")
        fix = f"give --out another file{same_amp}"
        if differs == ["val_names"]:  # the val folder exported again: a sweep names --out itself, setting aside works
            fix = ("the val split holds other images now than those its results are of: move the file away to score "
                   "them into a new one, or give --out another file")
        raise ResultsError(f"{path} holds results of another evaluation ({detail}); {fix}")
    data.setdefault("quant", {})
    return data


def _same_checkpoint(data: dict, identity: dict, differs: list, path: str, say_moved: bool) -> bool:
    """Whether the checkpoint the file `data` records and the one scored now (`identity`), at other paths, are one:
    the same file reached through a link or another name (os.path.samefile), or the recorded one moved (its run
    folder renamed: nothing at the recorded path now) to one of the same kind (best.pt, checkpoint.pt, ...) holding
    the same weights (fingerprint, compared); the file then takes the new path. A file at the recorded path that is
    another one (a copy of the run) is another checkpoint."""
    old, new = data.get("checkpoint"), identity.get("checkpoint")
    if not (isinstance(old, str) and isinstance(new, str) and os.path.isfile(new)):
        return False
    if os.path.exists(old):
        return os.path.samefile(old, new)
    if (identity.get("fingerprint") is None or {"fingerprint", "checkpoint_kind"} & set(differs)
            or checkpoint_kind(old) != checkpoint_kind(new)):
        return False
    data["checkpoint"] = new
    if say_moved:
        log.info("%s: its checkpoint %s is gone, %s holds the same weights: the file now records that path",
                 path, old, new)
    return True


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def settings_diff(old: dict, new: dict, prefix: str = "") -> str:
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = settings_diff(a, b, f"{prefix}{key}.")
            if inner:
                diffs.append(inner)
        elif a != b:
            diffs.append(f"{prefix}{key} {a!r} -> {b!r}")
    return "; ".join(diffs[:6])


def read_result_files(paths: list[str], detection: bool = False) -> list[dict]:
    """evaluate.py's JSON files, for the scripts that tabulate or plot them (`detection`: evaluate_detection.py's
    too); one error names a bad file (unreadable, not JSON, or JSON of another shape), one given twice
    (overlapping globs: a row or circle twice) or two holding one evaluation of the same weights (a copy)."""
    seen: dict[str, str] = {}  # the file -> the path it was first given as
    for path in paths:
        first = seen.get(os.path.realpath(path))
        if first is not None:
            raise ResultsError(f"{path} is given twice{'' if first == path else f' (as {first})'}; give each "
                               "result file once")
        seen[os.path.realpath(path)] = path
    results = [read_result_file(path, detection=detection) for path in paths]
    # the same weights evaluated alike: the quantized entries may differ (each file's own pipelines or settings),
    # the rest is one evaluation; other data, EMA weights or autocast make another result, kept
    evaluations: dict[tuple, list[tuple[str, dict]]] = {}
    for path, result in zip(paths, results):
        if result.get("fingerprint") is None:  # detection results, and files written before fingerprints
            continue
        evaluation = as_stored({k: result.get(k) for k in EVALUATION_KEYS})
        key = (result["fingerprint"], json.dumps(evaluation, sort_keys=True))
        # other data content is another evaluation where both record it (content_difference): a copy made before
        # its original took the names (a later evaluate.py call) is still a copy
        alike = next((p for p, other in evaluations.get(key, []) if content_difference(other, result) is None), None)
        if alike is not None:
            raise ResultsError(f"{alike} and {path} hold results of the same weights evaluated alike "
                               "(a copied file, or two --out files of one checkpoint): each would be a row or "
                               "circle of its own; give one (evaluate.py adds every pipeline to one file)")
        evaluations.setdefault(key, []).append((path, result))
    return results


FIELD_TYPES = {"model": str, "method": str, "fp": dict, "max_act": dict, "quant": dict, "task": str, "config": list}
TABLE_FIELDS = ("model", "method", "fp", "max_act", "quant")  # an evaluate.py result, as tables and figures read it
DETECTION_FIELDS = ("task", "config", "fp", "max_act", "quant")  # an evaluate_detection.py result
# fields a result may lack (older files, weights files) but that the readers use as these types where present:
# a recipe given as a list, a quantized entry or its settings as a number would stop them on a traceback
OPTIONAL_FIELD_TYPES = {"recipe": dict, "data": dict, "checkpoint": str, "checkpoint_kind": str, "fingerprint": str,
                        "weights": str, "eval_amp": str, SEED_FIELD: int, STEP_FIELD: int,
                        BEST_FIELD: bool}


def read_result_file(path: str, fields: tuple = TABLE_FIELDS, detection: bool = False) -> dict:
    """One evaluate.py JSON with the `fields` its reader needs (by default those of the table and figure
    scripts), or a ResultsError naming it; with `detection`, an evaluate_detection.py JSON (its "task" says so)
    is read with DETECTION_FIELDS instead. A file written before evaluate.py recorded the run's train.seed takes
    it from its run (`take_run_seed`), one written before its "data" held a setting takes it (`take_later_data`)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ResultsError(f"cannot read the result file {path} ({e}); give JSON files written by "
                           f"evaluate.py") from None
    if detection and isinstance(data, dict) and data.get("task") == "detection":
        fields = DETECTION_FIELDS
    wrong = odd_fields(data, fields) if isinstance(data, dict) else list(fields)
    if not wrong:
        refuse_stale(path, data)
        take_run_seed(path, data)
        take_later_data(data)
        return data
    raise ResultsError(f"{path} is not a result file of evaluate.py ({_shape(data)}"
                       f"{'; missing or odd: ' + ', '.join(wrong) if isinstance(data, dict) else ''}); give "
                       f"JSON files written by evaluate.py")


def take_run_seed(path: str, result: dict) -> None:
    """Give the result at `path` that records no train.seed (written before evaluate.py recorded it) the one of its
    run's config.yaml, where the file sits in its run folder (the folder of the best.pt or checkpoint.pt it is of,
    `run_folder`): the checks of results averaged as seeds (engine/train_seeds.py) then tell a run trained again
    with a seed already there. A file elsewhere (gathered into a folder of results) is left without: the config.yaml
    beside it, if any, need not be its run's. Detection results record no train.py seed."""
    if SEED_FIELD in result or result.get("task") == "detection":
        return
    folder, own = run_folder(path, result), os.path.dirname(os.path.realpath(path))
    if folder is None or not os.path.isdir(folder) or not os.path.samefile(folder, own):
        return
    seed = config_seed(folder)
    if seed is not None:
        result[SEED_FIELD] = seed


def odd_fields(data: dict, fields: Sequence[str]) -> list[str]:
    """The dotted names of what a result lacks or holds as another type than evaluate.py writes: each of `fields`,
    the OPTIONAL_FIELD_TYPES present, every pipeline of "quant" and each of its bit-widths (an object), and the
    settings of a quantized entry (an object, where present)."""
    wrong = [k for k in fields if not isinstance(data.get(k), FIELD_TYPES[k])]
    wrong += [k for k, kind in OPTIONAL_FIELD_TYPES.items()
              if data.get(k) is not None and not isinstance(data[k], kind)]
    for pipeline, entries in (data["quant"] if isinstance(data.get("quant"), dict) else {}).items():
        if not isinstance(entries, dict):
            wrong.append(f"quant.{pipeline}")
            continue
        for bits, entry in entries.items():
            if not isinstance(entry, dict):
                wrong.append(f"quant.{pipeline}.{bits}")
            elif entry.get("settings") is not None and not isinstance(entry["settings"], dict):
                wrong.append(f"quant.{pipeline}.{bits}.settings")
    return wrong


def missing_number(result: dict, fields: Sequence[str], score: str) -> Optional[str]:
    """The first of `fields` (dotted paths, e.g. max_act.module) and the `score` of every quantized entry (e.g.
    quant.repq.w4a4.top1) that is not a finite number in `result`, or None. evaluate.py writes them all; a file cut
    by hand or written by an older version may not have them, and a table or report would stop on a traceback; a
    NaN or inf (JSON readers take a bare NaN) would be printed as a mean of nan."""
    paths = [*fields, *(f"quant.{p}.{b}.{score}" for p, entries in result["quant"].items() for b in entries)]
    for path in paths:
        value = result
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return path
    return None


def evaluated_checkpoint(path: str, result: dict) -> Optional[str]:
    """The checkpoint file that the result at `path` is of, where it is now, or None (no checkpoint recorded, or
    none there). A file of evaluate.py's own name for its checkpoint (eval_<name>.json: eval_best.json of best.pt,
    as a sweep writes it) is of the checkpoint of that name beside it: a run folder moved or copied whole (a copy
    of a sweep) keeps its JSON beside its best.pt, and the path the JSON records is the original's. A file of
    another name (evaluate.py --out elsewhere, even in a folder holding another run's best.pt) is of the path it
    records while that exists, else of the file of its name beside it. Beside is in the folder of the file itself,
    not of a link to it (results gathered as links in a folder of their own)."""
    checkpoint = result.get("checkpoint")
    if not isinstance(checkpoint, str) or not checkpoint:
        return None
    real = os.path.realpath(path)
    beside = os.path.join(os.path.dirname(real), os.path.basename(checkpoint))
    own_name = os.path.basename(real) == f"eval_{os.path.splitext(os.path.basename(checkpoint))[0]}.json"
    return next((p for p in ((beside, checkpoint) if own_name else (checkpoint, beside)) if os.path.isfile(p)), None)


def refuse_stale(path: str, result: dict) -> None:
    """A ResultsError when the checkpoint `result` is of now (`evaluated_checkpoint`: the run's best.pt beside
    its eval_best.json) holds other weights than those evaluated: a run that trained on after its evaluation saved
    a new best.pt, and the file's figures are of the old one. Results without a fingerprint (files of older
    versions) and files that are not train.py checkpoints (model.pretrained weights, MMEngine's) are not
    compared. The checkpoint is memory-mapped: only the weights the fingerprint hashes are read (evaluate.py
    hashes the same state dict, engine/checkpoint.py)."""
    scored, beside = result.get("fingerprint"), evaluated_checkpoint(path, result)
    if not isinstance(scored, str) or beside is None:
        return
    try:
        payload = torch.load(beside, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - not a torch checkpoint (safetensors weights): not one train.py wrote
        return
    if not (isinstance(payload, dict) and isinstance(payload.get("model"), dict)
            and isinstance(payload.get("config"), dict)):
        return
    key = "model_ema" if result.get("weights") == "ema" else "model"
    now = weights_fingerprint(payload[key]) if isinstance(payload.get(key), dict) else f"no '{key}' weights"
    if now != scored:
        raise ResultsError(f"{path} is stale: it scored other weights than {beside} holds now (fingerprint "
                           f"{scored} in the file, {now} now: the run saved a new {os.path.basename(beside)} "
                           f"after the evaluation); refresh it: run its sweep again with --run --evaluate "
                           f"(scripts/sweep.py moves the old file aside), or move {path} and its _act_max files "
                           f"aside and run python evaluate.py --checkpoint {beside} --out {path} with the same "
                           f"evaluate settings")


def _shape(data: Any) -> str:
    return f"a JSON {type(data).__name__}" if not isinstance(data, dict) else "a JSON object of other fields"
