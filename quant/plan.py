"""The evaluation a config's quant section asks for, and the checks that refuse it before any work.

    pipelines = evaluation_pipelines(cfg)      # quant.pipelines, or the task's own (DEFAULT_PIPELINES)
    planned(cfg)                               # [(pipeline, bits), ...] once cfg.quant.pipelines is resolved
    check_quant_plan(cfg)                      # raises ConfigError for what evaluate.py would refuse of the config

evaluate.py resolves and checks its plan with these functions. A run's quant.* settings are recorded in its
config.yaml and checkpoints, where `evaluate.py --checkpoint` reads them as that run's defaults; train.py and
scripts/sweep.py call `check_quant_plan` so that an unknown pipeline or a malformed bit-width is refused before
the training, not by the evaluation hours later; train.py checks the image counts (a language model's
calibration windows) the plan draws from the training split (`train_image_demands`, `too_many_train_images`)
once its data is built.
"""
from __future__ import annotations

import copy
import re
from typing import Collection, Optional

from torch import nn

from configs import Config, ConfigError
from configs.cli import named_twice
from configs.quant import with_first_last
from engine.tasks import task_for

from .registry import PIPELINES
from .spec import parse_bits

# why train.py refuses a quant.* setting that only evaluate.py reads
RECORDED_FOR_EVALUATION = ("a run records its quant.* settings as the defaults of `evaluate.py --checkpoint`, "
                           "which would refuse them after the training")

# quant.pipelines unset (None, the default): what a task's checkpoint is scored with (the columns of paper
# Table 6, and of Table 8 for a language model)
DEFAULT_PIPELINES = {"classification": ["percentile", "repq"],
                     "causal_lm": ["rtn", "gptq", "smoothquant", "smoothquant_strict"]}


def evaluation_pipelines(cfg: Config) -> list[str]:
    """The pipelines an evaluation of `cfg` runs: quant.pipelines, or the task's own (DEFAULT_PIPELINES)."""
    if cfg.quant.pipelines is None:
        task = task_for(cfg.data.dataset).name
        if task not in DEFAULT_PIPELINES:  # a task a fork added without its default pipelines (docs/extending.md)
            # train.py and scripts/sweep.py reach this too: the setting first, evaluate.py's flag beside it
            names = [n for n, p in PIPELINES.items() if task in p.tasks] or ["<pipeline>"]
            raise ConfigError(f"quant.pipelines: the {task} task has no default pipelines (quant/plan.py "
                              f"DEFAULT_PIPELINES); name the pipelines to run, e.g. quant.pipelines=[{','.join(names)}]"
                              f" (evaluate.py: --quant {' '.join(names)})")
        return list(DEFAULT_PIPELINES[task])
    return list(cfg.quant.pipelines)


def planned(cfg: Config) -> list[tuple[str, str]]:
    """(pipeline, bits) to run: every quant.pipelines entry at every quant.bits entry, or, where quant.bits
    is [], each at its own default bit-width (quant/registry.py)."""
    return [(name, bits) for name in cfg.quant.pipelines
            for bits in (cfg.quant.bits or [str(PIPELINES[name].default_bits)])]


def pipeline_options(cfg: Config, pipeline: str):
    """The pipeline's `quant.<pipeline>` options with the `quant.first_last` preset applied."""
    options = getattr(cfg.quant, pipeline, None)
    if options is None and pipeline in PIPELINES:  # registered without its config section: a fork's omission
        raise TypeError(f"the {pipeline} pipeline (quant/registry.py PIPELINES) has no options section in the config "
                        f"schema: add `{pipeline}: {PIPELINES[pipeline].Options.__name__} = field(default_factory="
                        f"{PIPELINES[pipeline].Options.__name__})` to QuantConfig in configs/schema.py "
                        f"(docs/extending.md, 'Where a pipeline is listed')")
    return with_first_last(options, cfg.quant.first_last) if options is not None else None


def joined_bit_widths(value) -> list[str]:
    """The bit-widths of `value` when it is several valid ones joined by commas, semicolons or spaces in one
    string ('w4a16,w8a16'), else []: such a value is a list the shell or YAML did not split."""
    parts = [p for p in re.split(r"[,;\s]+", value) if p] if isinstance(value, str) else []
    if len(parts) < 2:
        return []
    try:
        for part in parts:
            parse_bits(part)
    except ValueError:
        return []
    return parts


def joined_pipelines(value) -> list[str]:
    """The pipelines of `value` when it is several known ones joined by commas, semicolons or spaces in one string
    ('repq aphq'), else [] (as `joined_bit_widths`)."""
    parts = [p for p in re.split(r"[,;\s]+", value) if p] if isinstance(value, str) else []
    return parts if len(parts) > 1 and all(p in PIPELINES for p in parts) else []


def default_pipelines_hint(cfg: Config, task, flags: bool = True) -> str:
    """The advice for bit-widths that the task's default pipelines (no --quant) cannot all run: the user asked for
    the bits, not for those pipelines, so for every such bit-width name the --quant of the task's pipelines that
    take it (w8a8 and w3a16 on a language model: SmoothQuant, and RTN or GPTQ; no one pipeline takes both).
    `flags`: in evaluate.py's words (--quant, --bits); else in config keys (quant.pipelines, quant.bits)."""
    def takes(name: str, bits: str) -> bool:
        try:
            PIPELINES[name].validate(parse_bits(bits), pipeline_options(cfg, name))
        except ValueError:
            return False
        return True

    pipelines, choose, widths, each = (("--quant", "--quant {}", "--bits / quant.bits", "--quant at every --bits")
                                       if flags else ("quant.pipelines", "quant.pipelines=[{}]", "quant.bits",
                                                      "pipelines at every bit-width"))
    own = sorted(p for p in PIPELINES if task.name in PIPELINES[p].tasks)
    advice, untaken = [], []
    for bits in dict.fromkeys(b for name, b in planned(cfg) if not takes(name, b)):  # each failing width, in order
        fitting = [choose.format(name) for name in own if takes(name, bits)]
        if fitting:
            advice.append(f"{' or '.join(fitting)} for {bits}")
        else:  # no pipeline to name: the bit-width itself has to go
            untaken.append(bits)
    fixes = ([f"give {'; '.join(advice)}"
              + (f", in separate evaluations (each runs its {each})" if len(advice) > 1 else "")] if advice else [])
    if untaken:
        them = "it" if len(untaken) == 1 else "them"
        fixes.append(f"drop {', '.join(untaken)}: no pipeline of this task takes {them}")
    model = "a language model" if task.language else "an image classifier"
    return (f"; without {pipelines} {model} runs {', '.join(cfg.quant.pipelines)} at every {widths} bit-width: "
            f"{'; '.join(fixes)}")


def check_pipelines(cfg: Config, task) -> None:
    """cfg.quant.pipelines (resolved: a list) names only known pipelines that quantize `task`'s models."""
    unknown = [p for p in cfg.quant.pipelines if p not in PIPELINES]
    joined = next((p for p in unknown if joined_pipelines(p)), None)
    if joined is not None:  # `quant.pipelines=['repq aphq']`, `--quant repq,aphq`: a list the shell or YAML left whole
        every = [part for p in cfg.quant.pipelines for part in (joined_pipelines(p) or [p])]
        raise ConfigError(f"quant.pipelines: {joined!r} joins {len(joined_pipelines(joined))} pipelines in one value; "
                          f"give each as an item of the list: quant.pipelines=[{','.join(every)}] (evaluate.py: "
                          f"--quant {' '.join(every)})")
    if unknown:
        raise ConfigError(f"unknown quantization pipeline(s) {unknown}; available: {sorted(PIPELINES)}")
    other = [p for p in cfg.quant.pipelines if task.name not in PIPELINES[p].tasks]
    if other:
        fitting = sorted(p for p in PIPELINES if task.name in PIPELINES[p].tasks)
        raise ConfigError(f"quant.pipelines: {', '.join(other)} cannot quantize a {task.name} model "
                          f"(data.dataset={cfg.data.dataset}); its pipelines are {', '.join(fitting)}")


def check_bits(cfg: Config, task, defaulted: bool, flags: bool = False, bits_flag: bool = False) -> None:
    """cfg.quant.bits are valid bit-widths, named once (and written as parsed, e.g. 'w4a4'), no pipeline is named
    twice, and each planned (pipeline, bits) takes its options. `defaulted`: the pipelines are the task's own (the
    user named none: the error says which pipelines take the bits); `flags`: the plan comes from evaluate.py's
    command line, whose --quant / --bits the messages name (`bits_flag`: --bits gave the bit-widths)."""
    bits_name, pipelines_name = (("--bits / quant.bits", "--quant / quant.pipelines") if flags
                                 else ("quant.bits", "quant.pipelines"))
    joined = next((b for b in cfg.quant.bits if joined_bit_widths(b)), None)
    if joined is not None:  # `--bits w4a16,w8a16`: a list in one word, each part a bit-width of its own
        every = [part for b in cfg.quant.bits for part in (joined_bit_widths(b) or [b])]
        given, fix = (("--bits", f"separate them with spaces: --bits {' '.join(every)}") if bits_flag
                      else ("quant.bits", f"give each as an item of the list: quant.bits=[{','.join(every)}]"))
        raise ConfigError(f"{given}: {joined!r} joins {len(joined_bit_widths(joined))} bit-widths in one value; "
                          f"{fix}")
    try:
        cfg.quant.bits = [str(parse_bits(b)) for b in cfg.quant.bits]
    except ValueError as e:
        raise ConfigError(f"{bits_name}: {e}") from None
    for what, values in ((pipelines_name, cfg.quant.pipelines), (bits_name, cfg.quant.bits)):
        problem = named_twice(what, values)
        if problem:
            raise ConfigError(problem)
    if cfg.quant.bits and not cfg.quant.pipelines:  # no pipeline would read them: asked is not what runs
        raise ConfigError(f"{bits_name}: {', '.join(cfg.quant.bits)} given, but {pipelines_name} names no pipeline, "
                          f"so nothing is quantized at them; name the pipelines, or drop the bit-widths for the "
                          f"float evaluation alone")
    for name, bits in planned(cfg):  # options that cannot go together: now, not after hours of work
        try:
            PIPELINES[name].validate(parse_bits(bits), pipeline_options(cfg, name))
        except ValueError as e:
            # the hint answers bits the user gave to the task's own pipelines; with none given, each pipeline runs
            # at its own bit-width and the refusal is of an option (quant.first_last=w8a8 on a language model)
            hint = default_pipelines_hint(cfg, task, flags) if defaulted and cfg.quant.bits else ""
            raise ConfigError(f"quant.{name}: {e}{hint}") from None


def check_quant_plan(cfg: Config) -> None:
    """Refuse the quant.* settings of `cfg` that evaluate.py would refuse as the defaults of an evaluation of the
    run (unknown or unfitting pipelines, malformed or repeated bit-widths, options a pipeline cannot take at its
    bits), naming where they come from. `cfg` itself is left as it is (quant.pipelines stays None where unset).
    The checks that need the model and data (image counts against the training split, activation-maxima patterns)
    run once those are built: train.check_evaluation_fits, evaluate.check_train_split."""
    plan = copy.deepcopy(cfg)
    task = task_for(plan.data.dataset)
    defaulted = plan.quant.pipelines is None
    plan.quant.pipelines = evaluation_pipelines(plan)
    try:
        check_pipelines(plan, task)
        check_bits(plan, task, defaulted)
    except ConfigError as e:
        raise ConfigError(f"{e} ({RECORDED_FOR_EVALUATION})") from None


def check_model_converts(model: nn.Module, cfg: Config) -> None:
    """Convert a copy of `model` with the layout of every planned (pipeline, bits), as each pipeline's first
    step does, and drop it: a model the pipelines cannot quantize (an attention class with no quantized version,
    such as EVA's or CaiT's, or layers no rule covers), one whose norms the pipeline cannot fold
    (`Pipeline.check_folds`: an RMSNorm, a post-norm block), or one at an input size the pipeline cannot take
    (`Pipeline.check_input_size`: RepQ-ViT's fold on a Swin with padded windows), is refused with one ConfigError
    naming model.name before the float and maxima passes (an ImageNet pass each), not by a traceback after them; so
    is an option the model leaves without effect (`Pipeline.check_model_options`: GPLQ's pca_multiple or pca_variance
    where the model's features are no wider than pca_multiple)."""
    from .convert import quantize_model
    from .pipeline_base import isolated_rng, parse_options

    device = next(model.parameters()).device
    for name, bits in planned(cfg):
        pipeline = PIPELINES[name]
        options = parse_options(pipeline.Options, pipeline_options(cfg, name))
        spec = pipeline.layout(parse_bits(bits), options)
        try:
            with isolated_rng(0, device):  # a layer built in the conversion draws nothing from the run's streams
                quantize_model(model, spec)  # the converted copy is dropped
            pipeline.check_folds(model, parse_bits(bits), options)
            pipeline.check_input_size(model, parse_bits(bits), options)
        except (TypeError, ValueError) as e:  # convert.py's refusals: an unknown attention, an uncovered layer
            raise ConfigError(f"model.name={cfg.model.name}: {name} {bits} cannot quantize it: {e}") from None
        try:
            pipeline.check_model_options(model, parse_bits(bits), options)
        except ValueError as e:  # an option this model leaves without effect, named as its config key
            raise ConfigError(f"model.name={cfg.model.name}: {e}") from None


def reads_calibration_batch(pipeline: str, language: bool) -> bool:
    """Whether `pipeline` reads the calibration batch (of a `language` model or an image classifier): RTN reads
    no data, and APHQ and GPLQ on an image classifier draw their own training images (`draws_training_images`)."""
    p = PIPELINES[pipeline]
    return p.calibrated and not (p.draws_training_images and not language)


def train_image_demands(cfg: Config, pipelines, reads_batch: bool) -> dict[str, int]:
    """{setting: images} that `pipelines` of an image classifier draw from the training split: the calibration
    batch (quant.calib_images, when `reads_batch`) and APHQ's and GPLQ's own images."""
    wanted = {"quant.calib_images": cfg.quant.calib_images} if reads_batch else {}
    for name in sorted(pipelines):
        wanted.update({f"quant.{name}.{key}": count for key, count in
                       PIPELINES[name].train_image_counts(pipeline_options(cfg, name)).items()})
    return wanted


def too_many_train_images(wanted: dict[str, int], size: int, split: str, unit: str = "images") -> Optional[str]:
    """The refusal of the first demand of `wanted` (train_image_demands) above the `size` images (or other
    `unit`s: a language model's windows) of the training split `split`, or None when the split holds them all."""
    for key, count in wanted.items():
        if count > size:
            return f"{key}={count}: the {split} split has {size} {unit}; give at most that"
    return None


def too_few_for_a_batch(cfg: Config, pipelines, size: int, split: str, world_size: int,
                        given: Collection[str] = ()) -> Optional[str]:
    """The refusal of the first training-loader batch of `pipelines` (`train_batch_sizes`) above the images each
    of `world_size` processes gets from the `size` images of the training split `split` (the loader shards them
    and drops the last partial batch), or of the first count of images read from one epoch of that loader
    (`train_loader_images`, of the dotted keys the user set in `given` and values of their own) above what its full
    batches hold, naming that maximum; None when every batch and count fits."""
    per_process = size // world_size
    shares = f", {per_process} for each of {world_size} processes" if world_size > 1 else ""
    for name in sorted(pipelines):
        options = pipeline_options(cfg, name)
        batches = PIPELINES[name].train_batch_sizes(options)
        for key, batch in batches.items():
            if batch > per_process:
                return (f"quant.{name}.{key}={batch}: the {split} split has {size} images{shares}, fewer than one "
                        f"batch; give at most {per_process}")
        own = {key.split(".", 2)[2] for key in given if key.startswith(f"quant.{name}.")}
        for key, count in PIPELINES[name].train_loader_images(options, own).items():
            # the loader's batch (GPLQ reads one loader; with several, the one whose epoch holds the fewest)
            held, batch = min((per_process // b * b, b) for b in batches.values())
            if count > held:
                each = " each process" if world_size > 1 else ""
                return (f"quant.{name}.{key}={count}: the {split} split has {size} images{shares}, and one epoch of "
                        f"the training loader gives{each} {held} of them (full batches of {batch}); give at most "
                        f"{held}")
    return None
