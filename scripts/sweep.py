r"""Config-driven ablation sweeps: expand a sweep file into train (and evaluate) commands, check every run's
config (with --only, every run it keeps) before anything starts, then print the commands or run them one after
another.

    python scripts/sweep.py configs/sweeps/cd_lambda.yaml data.root=/datasets/imagenet          # print
    python scripts/sweep.py configs/sweeps/cd_lambda.yaml --run --evaluate \
        --launcher "torchrun --nproc_per_node=8" data.root=/datasets/imagenet                   # run
    python scripts/sweep.py configs/sweeps/pretrain_main.yaml --run --evaluate --eval-amp bf16 \
        --launcher "torchrun --nproc_per_node=8" data.root=/datasets/imagenet   # evaluate under bf16 autocast
    python scripts/sweep.py configs/sweeps/digits_demo.yaml --run --evaluate                      # CPU demo

A sweep file (configs/sweeps/*.yaml):
    configs: [configs/pretrain/vit_b.yaml, configs/method/cd.yaml]   # layered under every run
    out_root: runs/sweeps/cd_lambda                                  # run <name> writes to out_root/<name>
                                                                     # (an out_dir set anywhere else: refused)
    runs:
      baseline: [cd.enabled=false]              # items ending in .yaml (.yml) are further --config layers,
      lam0.01: [cd.lam=0.01]                    # the others key=value overrides
    evaluate: ["quant.pipelines=[repq,aphq]"]   # optional: overrides for every evaluate.py command
    run_keys: [data.root]                       # optional: keys each run sets (a data-set preset), which
                                                # an override for the whole sweep may not replace
Overrides given on this command line apply to every run; one that would replace a key any run of the sweep sets
itself (a seed, a dose, or a key its own config files set and other runs set otherwise or not at all: model.name in
gpt2_medium.yaml, cd.enabled in cd.yaml beside a baseline) is refused, whichever runs --only keeps (cd.enabled=true
with --only baseline_s0 would train the baseline as a CD run under its name), as is one (here, in a run or in its
own config files) that the 'evaluate' list would replace in evaluate.py. A key every run's config files set alike
(a recipe every run lists, the sweep's 'configs') may be overridden for the whole sweep, and so may a key that
only places work (PLACEMENT_KEYS); with --only, the other checks of settings cover the runs kept only. With --run
under a launcher that states how many processes it starts (torchrun --nproc_per_node=N, --nnodes=M, or python -m
torch.distributed.run: read by torchrun's own parser, scripts/launchers.py), a run whose
train.batch_size does not split into them (processes x train.batch_size_per_gpu x accumulation steps, as train.py
splits it) is refused too. With --run, so is a run's train.resume, or the model.pretrained of a run that starts
afresh, that is no file (model.pretrained=hub aside; a path in the folder of an earlier run, which that run may
write, is left alone).
Runs are plain train.py invocations, so a run that stopped resumes when the sweep is started again. Every
command runs in the repository root: relative paths (out_root, data.root, ...) are relative to it, wherever
the sweep is started from; printed, the commands follow a `cd` into it.

With --run, every run ends in one state, listed in a summary at the end: finished (and evaluated), stopped
at train.max_steps before its schedule ended (the update it reached and its schedule's length, read from its
checkpoint.pt; evaluated with --evaluate, and the sweep goes on: the limit was asked for), stopped
(train.py exited with EXIT_PREEMPTED = 75 after writing its checkpoint; or its launcher exited otherwise, as
torchrun exits 1 when its processes exit 75, and the lines this command added to the run's train.log record the
stop, eval.log for evaluate.py's GPLQ stage 1: scripts/launchers.py; not evaluated, and no later run starts; an
evaluate.py that the sweep's SIGTERM / SIGINT ended otherwise: evaluation stopped, re-run to continue), interrupted
(the sweep got SIGTERM / SIGINT, and train.py ended with another code and no record of the stop, as after a second
Ctrl-C: no checkpoint was written on the stop; the sweep exits with the command's code), failed (also a train.py that
exited 0 at train.max_steps without a checkpoint.pt of that update: the divergence guard withheld the writes of its
high-loss updates, and checkpoint.pt, where there is one, is of an earlier update; not evaluated, no later run starts,
and the sweep exits 1), or not started (also where SIGTERM / SIGINT came between two commands). The sweep exits 0
only when every run finished or stopped at train.max_steps; 75 when one stopped, or when SIGTERM / SIGINT came while
it checked its runs, before the first command, so the same command can be requeued: it continues each unfinished
run (a finished one only validates again) and evaluates it. SIGTERM / SIGINT to the sweep are passed on to the
running command, and the sweep waits for it to write its checkpoint and exit. An evaluation JSON of other weights
than the run's best.pt holds now (an earlier best.pt of the run: told by the weights fingerprint it records, or
where it records none, by being older than best.pt) is moved aside to eval_best.<time>.json, so that evaluate.py
writes a fresh one instead of refusing the old one.
--eval-amp {none,fp16,bf16} gives every evaluate.py command `--amp X` (its autocast; default: none, fp32, as the
paper's tables, and no --amp in the commands); tables mark results evaluated under an autocast. evaluate.py adds to
a result file only under the autocast it was written with: with --run, a run whose eval_best.json (of the weights
its best.pt holds) was evaluated under another --amp is refused before anything starts, as is one whose maxima files
(eval_best_act_max.csv / .png) are there without its eval_best.json, which evaluate.py would not write over, and one
whose eval_best.json is of other data (another data.root: evaluate.py adds to it only for the data it is of). So, with
--run, is a run whose checkpoint.pt, or train.resume file, train.py would not continue with the sweep's settings (a
setting edited in the sweep file since it trained: cd.lam; runs of several settings continuing one warm-up) or its
length and layout, also with train.allow_changed_config=true (a schedule
now shorter than its update, another train.batch_size: another number of updates per epoch; where its data settings
changed, the count is train.py's, at its turn), one whose folder train.py would not claim (an earlier run's files
without a checkpoint.pt, but the logs of the same command, which it restarts), and with --evaluate one whose
eval_best.json holds an entry the evaluate list now computes with other settings (quant.calib_images added):
--recompute gives such a run's evaluate.py command --recompute (the old entries are kept in the file's history).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import os
import shlex
import shutil
import signal
import sys
from typing import Optional, Sequence

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configs import DEFAULT_CONFIG, ConfigError, load_config  # noqa: E402
from configs.cli import OneLineParser, move_overrides  # noqa: E402
from configs.loader import (close_keys, dotted_settings, dump_yaml, get_key, overlapping_keys,  # noqa: E402
                            override_keys, parse_yaml, read_yaml_file, schema_keys)
from configs.schema import (EVAL_TRAIN_KEYS, TRAIN_BATCH_OVERRIDE_KEYS, TRAINING_ONLY_OVERRIDE_KEYS,  # noqa: E402
                            Config, unread_training_settings)
from engine.console import console_print  # noqa: E402
from engine.exit_codes import EXIT_PREEMPTED  # noqa: E402
from launchers import (ForwardedSignals, launcher_refusal, launcher_world_size, log_mark,  # noqa: E402  (scripts/)
                       stopped_after_checkpoint)

# evaluate.py's --amp choices (tests/test_sweep_folders.py checks that they are its parser's): importing evaluate.py
# here would import torch and the pipelines (seconds) before --help or the printed commands
EVAL_AMP_CHOICES = ("none", "fp16", "bf16")


def expand(sweep_path: str, extra_overrides: list[str], only: Optional[Sequence[str]] = None,
           world_size: Optional[int] = None, packages: bool = True) -> list[dict]:
    """One dict per run: name, config files, overrides (out_dir included), each run that `only` keeps (all
    without it) checked by the loader, and with `world_size` against that many processes. packages=False: the
    packages a run needs (log.wandb's) are not looked for on this machine (printed commands may run elsewhere)."""
    sweep = read_yaml_file(sweep_path)
    unknown = set(sweep) - {"configs", "out_root", "runs", "evaluate", "run_keys"}
    if unknown or not isinstance(sweep.get("runs"), dict) or not sweep["runs"]:
        raise ConfigError(f"{sweep_path}: a sweep has 'configs', 'out_root', a non-empty 'runs' mapping and "
                          f"optionally 'evaluate' and 'run_keys'"
                          + (f"; unknown keys {sorted(unknown)}" if unknown else ""))
    check_field_types(sweep, sweep_path)
    # e.g. data.root=/datasets/imagenet given to a multi-data-set sweep would train every run on ImageNet
    run_keys = {str(k) for k in sweep.get("run_keys") or []}
    clashing = [o for o in extra_overrides if sets_any(o, run_keys)]
    if clashing:
        raise ConfigError(f"{sweep_path}: {', '.join(clashing)} would replace a key that each run sets "
                          f"itself ({', '.join(sorted(run_keys))}); drop it from the command line (the sweep file's "
                          f"comments say where each run reads its data)")
    eval_overrides = [str(o) for o in sweep.get("evaluate") or []]
    out_root = os.path.expanduser(sweep["out_root"])  # ~: as the config loader reads out_dir
    base = [str(c) for c in sweep.get("configs") or []]
    split = {}  # run name -> (its config files, its key=value items)
    for name, items in sweep["runs"].items():
        if items is not None and not isinstance(items, list):  # a string would be read letter by letter
            raise ConfigError(f"{sweep_path}: run '{name}' must list its config files and overrides, e.g. "
                              f"{name}: [{example_items(items, str(items))}], not {type(items).__name__} {items!r}")
        odd = next((i for i in items or [] if isinstance(i, (list, dict))), None)
        if odd is not None:  # `- optim.lr: 1` (a colon for '=') or a nested list: read as its Python text
            example = example_items(odd, "optim.lr=1e-3") if isinstance(odd, dict) else "optim.lr=1e-3"
            raise ConfigError(f"{sweep_path}: run '{name}' lists {odd!r}, a YAML {type(odd).__name__}; its items "
                              f"are config files (.yaml) and key=value overrides, e.g. {name}: [{example}]")
        items = [str(i) for i in items or []]
        # a key=value item is an override whatever its value ends with (log.wandb_project=x.yaml); a path may hold '='
        # past a folder (configs/lr=1e-3.yaml). A .yml file is YAML too (--config reads it): taken for an override, it
        # was refused as 'not of the form key=value'
        files = [i for i in items if i.endswith((".yaml", ".yml")) and "=" not in i.split("/")[0]]
        # no config file at all: train.py's own default recipe, named in the command and read by every check here
        # (the schema's defaults alone are no run's settings)
        split[name] = (base + files or [DEFAULT_CONFIG], [i for i in items if i not in files])
    layer_keys = run_layer_keys({name: configs for name, (configs, _) in split.items()}, base)
    # what each run sets itself: its key=value items, and what its own config files set differently from other
    # runs (a key all runs share, e.g. from gpt2.yaml listed by every run, is common ground)
    owns = {name: {**layer_keys[name], **{k: i for i in own_items for k in keys_of([i])}}
            for name, (_, own_items) in split.items()}
    # runs that --only leaves out do not run: their settings are not checked (their folders are, below: a kept
    # run must not share one), but what they set still tells the sweep's runs apart
    kept_names = [name for name in split if only is None or str(name) in only]
    refuse_overrides_of_run_keys(owns, kept_names, extra_overrides, sweep_path)
    runs = []
    checked: dict = {}  # check_run_config's model and data settings, each built or checked once
    for name, (configs, own_items) in split.items():
        kept = name in kept_names
        own = owns[name]
        overrides = own_items + list(extra_overrides)
        # evaluate.py takes the sweep's 'evaluate' list last: quant.pipelines=[repq,aphq] given here would
        # be evaluated with the list's quant.pipelines=[repq] without a word
        given = {**own, **{k: o for o in extra_overrides for k in keys_of([o])}}
        replaced = set_by(given, eval_overrides) if kept else []
        if replaced:
            theirs = [e for e in eval_overrides if set_by(given, [e])]
            raise ConfigError(f"sweep run '{name}': {', '.join(replaced)} would be replaced in its evaluation by "
                              f"the sweep's evaluate list ({', '.join(theirs)}); drop it, or edit 'evaluate' in "
                              f"{sweep_path}")
        named = [o for o in overrides if o.split("=", 1)[0].strip() == "out_dir"]
        placing = file_setting_out_dir(configs) if kept else None
        if kept and (named or placing):  # the sweep names every run's folder; this one would be replaced silently
            what, where = (named[0], "") if named else (f"{placing[0]}: out_dir={placing[1]}", f" from {placing[0]}")
            raise ConfigError(f"sweep run '{name}': {what} would be ignored: a sweep writes run <name> to "
                              f"out_root/<name> ({os.path.join(out_root, str(name))}); drop it{where} and set "
                              f"out_root in {sweep_path}")
        overrides.append(f"out_dir={yaml_text(os.path.join(out_root, run_folder(name, sweep_path)))}")
        if kept:
            try:
                check_run_config(configs, overrides, eval_overrides, world_size, checked, packages)
            except ConfigError as e:
                raise ConfigError(f"sweep run '{name}': {e}") from e
        runs.append({"name": str(name), "configs": configs, "overrides": overrides,
                     "evaluate": eval_overrides})
    refuse_shared_folders(runs, sweep_path)
    return runs


def refuse_overrides_of_run_keys(owns: dict, kept: list, extra_overrides: list[str], sweep_path: str) -> None:
    """Refuse (ConfigError) a command-line override, given to every run, of a key that a run of the sweep sets itself
    (`owns`: {run: {dotted key: the item or '<key> in <file>' that sets it}}). For a kept run that sets it: train.seed=7
    would turn a sweep's seeds into copies of one run, model.name=gpt2 would train the gpt2_medium runs as GPT-2 Small
    under their names. For a kept run that does not: the key tells the sweep's runs apart, whichever of them --only
    keeps, and cd.enabled=true would train the baseline as a CD run under the baseline's name (and a report would
    read it as the baseline). A key that only places work (PLACEMENT_KEYS) tells no result apart: one that other
    runs' items set may be set for all."""
    for name in kept:  # first where the run names the key itself: the message says where
        own = owns[name]
        replaced = [o for o in extra_overrides if sets_any(o, set(own))]
        if replaced:
            where = set_by(own, replaced)
            layers = sorted({w.split(" in ", 1)[1] for w in where if " in " in w})
            raise ConfigError(f"sweep run '{name}': {', '.join(replaced)} would replace what the run sets itself "
                              f"({', '.join(where)}); drop it from the command line, or edit the run in "
                              f"{' or '.join([sweep_path, *layers])}")
    setters: dict = {}  # dotted key -> [the runs that set it themselves]
    files: dict = {}  # dotted key -> {the runs' own config files that set it}
    for name, own in owns.items():
        for key, where in own.items():
            if not key.startswith(PLACEMENT_KEYS):
                setters.setdefault(key, []).append(str(name))
                if " in " in where:
                    files.setdefault(key, set()).add(where.split(" in ", 1)[1])
    replaced = [o for o in extra_overrides if sets_any(o, set(setters))]
    if kept and replaced:  # named for the first run kept: every kept run takes the override alike
        keys = list(dict.fromkeys(k for o in replaced for k in overlapping_keys(o, setters)))
        named = "; ".join(f"{k}: {few(setters[k])}" for k in keys)
        where = sorted({f for k in keys for f in files.get(k, ())})
        raise ConfigError(f"sweep run '{kept[0]}': {', '.join(replaced)} would replace what other runs of the sweep "
                          f"set themselves ({named}), which tells the sweep's runs apart: run '{kept[0]}' would "
                          f"train with it under its own name; drop it from the command line, or edit the runs in "
                          f"{' or '.join([sweep_path, *where])} (or make a new sweep file for such runs)")


def few(names: list[str], shown: int = 4) -> str:
    """The first `shown` of `names` and how many more, for an error line."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def check_run_config(configs: list[str], overrides: list[str], eval_overrides: list[str],
                     world_size: Optional[int], checked: Optional[dict] = None, packages: bool = True) -> None:
    """Strict, up front: what train.py and evaluate.py would refuse of a run's settings at their start (ConfigError), in
    their own words. train.py's checks before it starts (train.check_before_start: the run's own quant.*, which its
    config.yaml records, CD's settings, optim.name, log.wandb's package, a val split that is the train split); its
    evaluation takes the 'evaluate' list last, whose quant.* must pass too, or the run ends at its evaluation. Then what
    train.py refuses once it builds the model and before it reads the data: the model built on the meta device
    (check_model: model.name, model.kwargs, model.img_size against its patches), the model against the task,
    log.act_max and optim.layer_decay (train.check_model_fits_run), the quant.act_max_extra_modules of the run and of
    its evaluation against
    the model's modules (check_probed_modules), and the data settings (data.check_data_settings: data.auto_augment,
    mixup's even batch, data.digits_val_fraction, the synthetic sizes, model.num_classes against the data's classes).
    `checked`: the settings checked already and the last model built (expand's runs: a 36-run sweep of seeds builds
    its model once, finetune.yaml's three methods on nine data sets nine models). With `world_size` (the processes the
    launcher starts), the global batch must split into them as train.py splits it (train.accumulation_steps). Left
    to the run's start: what needs the data read or its length counted (files under data.root, a token file's ids,
    train.max_steps and the cadences beyond the run's updates) and the device (cd.matmul_precision=tf32 off CUDA)."""
    from data import DataError, check_data_settings
    from models import input_size
    from quant.plan import check_quant_plan
    from train import accumulation_steps, check_before_start, check_model_fits_run  # torch: not for --help

    paths = [os.path.join(ROOT, c) for c in configs]
    cfg = load_config(paths, overrides)
    check_before_start(cfg, packages)
    evaluated = load_config(paths, overrides + eval_overrides) if eval_overrides else None
    if evaluated is not None:
        check_quant_plan(evaluated)
    if world_size is not None:
        accumulation_steps(cfg, world_size)
    checked = {} if checked is None else checked
    # all the checks below read (check_model_fits_run: optim.layer_decay too)
    key = repr((cfg.model, cfg.data, cfg.log.act_max, cfg.optim.layer_decay, cfg.train.batch_size_per_gpu))
    # what check_regularizers reads: a sweep of seeds and CD strengths finds the model's pairs once
    regularizers = repr((cfg.model, cfg.cd.enabled and cfg.cd.gated_mlp, cfg.cd.enabled, cfg.tweo.enabled))
    # the modules whose maxima the run's config (train.py) and its evaluation (evaluate.py) measure
    probed = repr((cfg.model, cfg.quant.act_max_extra_modules,
                   evaluated.quant.act_max_extra_modules if evaluated is not None else None))
    # the plans a conversion of the model is checked for: the run's own and its evaluation's quant.pipelines
    converts = repr((cfg.model, cfg.data.dataset, cfg.quant, evaluated.quant if evaluated is not None else None))
    if key in checked and regularizers in checked and probed in checked and converts in checked:
        return
    # the checks below read the model and leave it as it was, so the last run's serves the next run of the same
    # model.*; only one is held: a model the meta device cannot build is built on the CPU, with its weights
    if checked.get("model", (None,))[0] != repr(cfg.model):
        checked["model"] = (repr(cfg.model), check_model(cfg.model))
    model = checked["model"][1]
    if probed not in checked:
        check_probed_modules(cfg, evaluated, model)
        checked[probed] = True
    if key not in checked:
        check_model_fits_run(cfg, model)
        try:
            # a language model's context, the image size of a vision model, as train.py's build_data gives them
            check_data_settings(cfg.data, input_size=input_size(model), num_classes=cfg.model.num_classes,
                                batch_size_per_gpu=cfg.train.batch_size_per_gpu)
        except DataError as e:
            raise ConfigError(str(e)) from None
        checked[key] = True
    if regularizers not in checked:
        check_regularizers(cfg, model)
        checked[regularizers] = True
    if converts not in checked:
        check_plans_convert(cfg, evaluated, model)
        checked[converts] = True


def check_plans_convert(cfg, evaluated, model) -> None:
    """A quant.pipelines plan the model cannot be quantized with (quant.plan.check_model_converts: RepQ-ViT's fold on
    a Swin whose windows are padded, an attention class without a quantized version) is refused by train.py once its
    data are built (check_evaluation_fits, before the first update: the run's own quant.pipelines) and by evaluate.py
    after the training (the sweep's evaluate list's, or the run's): in a sweep, after the runs before it had trained,
    or after its own training. Refused here, in their words. `evaluated`: the run's config under the evaluate list
    (None without one). The task's default plan (quant.pipelines unset) is left to the run, which trains for its float
    score and warns what its evaluation will refuse (train.check_evaluation_fits). `model` is check_model's, on the
    meta device; the evaluation's model is built as evaluate.py builds it (evaluate.eval_model_config). Raises
    ConfigError."""
    import dataclasses

    from quant.plan import RECORDED_FOR_EVALUATION, check_model_converts, evaluation_pipelines

    def plan(config):
        return dataclasses.replace(config, quant=dataclasses.replace(config.quant,
                                                                     pipelines=evaluation_pipelines(config)))

    if cfg.quant.pipelines is not None:
        try:
            check_model_converts(model, plan(cfg))
        except ConfigError as e:
            raise ConfigError(f"{e} ({RECORDED_FOR_EVALUATION})") from None
    if evaluated is not None and evaluated.quant.pipelines is not None:
        from evaluate import eval_model_config
        try:
            check_model_converts(check_model(eval_model_config(cfg.model)), plan(evaluated))
        except ConfigError as e:
            raise ConfigError(f"{e} (the sweep's evaluate list: evaluate.py would refuse it after the training)"
                              ) from None


def check_probed_modules(cfg, evaluated, model) -> None:
    """quant.act_max_extra_modules patterns must name modules of the model whose outputs are measured
    (engine/act_max.check_extra_modules): train.py refuses the run's own once its model is built, before the data are
    read (its config records them as evaluate.py's defaults), and evaluate.py those of `evaluated` (the run's config
    under the sweep's evaluate list: None without one) after the training. `model` is check_model's, on the meta
    device: its module names are the run's, which evaluate.py builds from the checkpoint's config, without dropout
    or stochastic depth (evaluate.eval_model_config: the evaluate list is checked on that build). Raises
    ConfigError, in their words."""
    from engine.act_max import check_extra_modules
    from quant.plan import RECORDED_FOR_EVALUATION

    try:
        check_extra_modules(model, cfg.quant.act_max_extra_modules)
    except ConfigError as e:
        raise ConfigError(f"{e} ({RECORDED_FOR_EVALUATION})") from None
    if evaluated is not None and evaluated.quant.act_max_extra_modules != cfg.quant.act_max_extra_modules:
        from evaluate import eval_model_config
        # the model as evaluate.py builds it, without stochastic depth or dropout (its modules are Identity there)
        scored = check_model(eval_model_config(cfg.model))
        try:  # set by the evaluate list (a run's own item that it would replace: refused by expand)
            check_extra_modules(scored, evaluated.quant.act_max_extra_modules)
        except ConfigError as e:
            raise ConfigError(f"{e} (the sweep's evaluate list: evaluate.py would refuse it after the training)"
                              ) from None


def check_regularizers(cfg, model) -> None:
    """What train.py's build_run refuses once the model is built, before the first update: CD's pairs of the model
    (ColinearityDecay.from_config's find_pairs, with cd.gated_mlp: a model without pairs, a block that does not fit
    them, a gated MLP without cd.gated_mlp) and TWEO's pre-norm blocks (TWEO.from_config), in train.py's words
    (train.as_config_error). `model` is check_model's, on the meta device: the pairs are found without the forward
    checks (verify=False; ColinearityDecay itself refuses a meta model, with nothing to update), which the run makes
    at its start. Raises ConfigError."""
    from cd import TWEO, find_pairs
    from train import as_config_error

    if cfg.cd.enabled:
        as_config_error("cd", find_pairs, model, verify=False, gated_mlp=cfg.cd.gated_mlp)
    if cfg.tweo.enabled:
        # total_steps: the run's is counted from its data at its start; any positive count finds the same blocks
        as_config_error("tweo", TWEO.from_config, cfg.tweo, model, total_steps=1).remove()


def check_model(model_cfg):
    """The model train.py builds of `model_cfg`, built on the meta device (train.check_model), so that what it refuses
    is refused in its own words before the first run trains. Raises ConfigError (imports timm and torch)."""
    from models import ModelError
    from train import check_model as build

    try:
        return build(model_cfg)
    except ModelError as e:
        raise ConfigError(str(e)) from None


def file_setting_out_dir(configs: list[str]) -> Optional[tuple[str, str]]:
    """(file, folder) of the last of the config files `configs` that sets out_dir to a folder, or None when the
    run's folder is left to the default ("", the schema's: runs/<the config names>). A value that is no string
    is the loader's to refuse."""
    placing = None
    for path in configs:
        data = read_yaml_file(os.path.join(ROOT, path))
        if "out_dir" in data:  # a later file's value replaces an earlier one's
            value = data["out_dir"]
            placing = (path, value) if isinstance(value, str) and value != Config().out_dir else None
    return placing


def is_config_key(key: str) -> bool:
    """A dotted key of the schema, or one into a free-form dict field (model.kwargs.depth, cd.lam_per_role.fc2),
    which overrides set as any other key."""
    parts = key.split(".")
    for end in range(1, len(parts)):
        prefix = ".".join(parts[:end])
        if prefix in schema_keys() and isinstance(get_key(Config(), prefix), dict):
            return True
    return key in schema_keys()


def example_items(value, default: str) -> str:
    """The items of a sweep-file list that `value` was probably meant as, for an error's example: a mapping's as
    key=value words (`{optim.lr: 0.001}`: optim.lr=0.001), a list's as its words; `default` for any other value.
    Each is written as it can stand in a YAML flow list (`[...]`), quoted where it holds a bracket, a comma, ..."""
    if isinstance(value, dict):
        words = [f"{k}={v}" for k, v in value.items()]
    elif isinstance(value, list):
        words = [str(v) for v in value]
    else:
        words = []
    return ", ".join(map(flow_item, words or [default]))


def flow_item(word: str) -> str:
    """`word` as an item of a YAML flow list that reads back as that string: plain where it does, else quoted
    (quant.pipelines=[repq] plain would be read as the word quant.pipelines= and a list)."""
    try:
        if yaml.safe_load(f"[{word}]") == [word]:
            return word
    except yaml.YAMLError:
        pass
    return json.dumps(word)  # a JSON string is a YAML double-quoted one


# what the items of a sweep file's lists are, with an example of one
LIST_ITEMS = {"configs": ("config files", "configs/pretrain/vit_b.yaml"),
              "evaluate": ("key=value overrides", "quant.pipelines=[repq]"),
              "run_keys": ("config keys", "data.root")}


def check_field_types(sweep: dict, sweep_path: str) -> None:
    """'configs', 'evaluate' and 'run_keys' are lists of strings, run_keys of config keys, and 'out_root' a folder: a
    string in place of a list would be read letter by letter (run_keys: data.root would guard the keys 'd', 'a', ...
    and so nothing), a nested list or a mapping as its Python text (configs: [[a.yaml]] as the file "['a.yaml']"), an
    empty out_root would become the folder 'None'. out_root is required."""
    for key, (what, default) in LIST_ITEMS.items():
        if sweep.get(key) is not None and not isinstance(sweep[key], list):  # empty (None): none
            raise ConfigError(f"{sweep_path}: '{key}' must be a list, e.g. {key}: [{sweep[key]}], not "
                              f"{type(sweep[key]).__name__} {sweep[key]!r}")
        odd = next((i for i in sweep.get(key) or [] if not isinstance(i, str)), None)
        if odd is not None:
            raise ConfigError(f"{sweep_path}: '{key}' lists {odd!r}, a YAML {type(odd).__name__}; its items are "
                              f"{what}, e.g. {key}: [{example_items(odd, default)}]")
    # a key the schema lacks (data.rooot) would guard nothing: data.root=x would train every run on x
    unknown = [k for k in sweep.get("run_keys") or [] if not is_config_key(str(k))]
    if unknown:
        close = close_keys(str(unknown[0]))
        raise ConfigError(f"{sweep_path}: run_keys: {unknown[0]!r} is not a config key"
                          + (f"; did you mean {', '.join(map(repr, close))}?" if close else ""))
    # no default folder: one (runs/sweep) would be shared by every sweep file without out_root, whose runs of one
    # name would then resume each other's checkpoints
    if "out_root" not in sweep:
        raise ConfigError(f"{sweep_path}: no 'out_root': a sweep names the folder its runs write to (run <name> to "
                          f"out_root/<name>); add e.g. out_root: runs/sweeps/"
                          f"{os.path.splitext(os.path.basename(sweep_path))[0]}")
    if not (isinstance(sweep["out_root"], str) and sweep["out_root"].strip()):
        raise ConfigError(f"{sweep_path}: 'out_root' must be a folder, e.g. out_root: runs/sweeps/mine, not "
                          f"{sweep['out_root']!r}")


def sets_any(override: str, keys: set) -> bool:
    """Whether `override` sets one of the dotted `keys` (configs.loader.overlapping_keys)."""
    return bool(overlapping_keys(override, keys))


def keys_of(overrides: list[str]) -> set:
    return {k for o in overrides for k in override_keys(o)}


def set_by(settings: dict, overrides: list[str]) -> list[str]:
    """What in `settings` ({dotted key: the item or file that sets it}) the `overrides` would replace, once each."""
    return list(dict.fromkeys(where for key, where in settings.items()
                              if any(sets_any(o, {key}) for o in overrides)))


def run_layer_keys(configs: dict, base: list[str]) -> dict:
    """{run: {dotted key: '<key> in <file>'}} for the keys that a run's own config files (those beyond the
    sweep's 'configs') set last and that the runs' files do not all set to one value: what makes the run
    differ from the others (model.name in gpt2_medium.yaml, cd.enabled in cd.yaml beside a baseline). A key
    every run's files set alike (a recipe every run lists, one batch size for all) is common ground that an
    override for the whole sweep may change."""
    layered = {}  # run -> {dotted key: (value, the file that sets it last)}
    for name, files in configs.items():
        layered[name] = {}
        for path in files:
            try:
                data = read_yaml_file(os.path.join(ROOT, path))
            except ConfigError as e:
                raise ConfigError(f"sweep run '{name}': {e}") from e
            for key, value in data.items():
                try:  # a section given as a mapping counts by key, as in the loader
                    dotted = dotted_settings(str(key), value, Config())
                except (AttributeError, KeyError, TypeError):  # not a key of the schema: load_config names it
                    dotted = {str(key): value}
                layered[name].update({k: (v, path) for k, v in dotted.items()})
    return {name: {key: f"{key} in {path}" for key, (value, path) in settings.items()
                   if path not in base and not key.startswith(PLACEMENT_KEYS)
                   and any(key not in other or other[key][0] != value for other in layered.values())}
            for name, settings in layered.items()}


# keys that place a run's work (loader workers and their timeout, the eval batch, device, compilation, logging): one
# value for the whole sweep may replace what a run's config file sets (imagenet.yaml's eval batch), as nothing
# computed changes
PLACEMENT_KEYS = ("data.num_workers", "data.pin_memory", "data.timeout", "train.eval_batch_size_per_gpu",
                  "train.device", "train.compile", "log.")


def run_folder(name, sweep_path: str) -> str:
    """The folder name of run `name` (as YAML typed it: 1.0, true and null are names too), which must be
    one plain folder: no path separator, not '.' or '..' (the run would write to out_root or beyond); and a
    name that `--only <name>` selects: no '=' (--only reads such a word as an override), no leading '-'
    (an option)."""
    folder = str(name)
    if (not folder or folder in (".", "..") or "/" in folder or os.sep in folder or "\0" in folder
            or "=" in folder or folder.startswith("-")):
        raise ConfigError(f"{sweep_path}: run name {name!r} is not a folder name that --only can select; each "
                          f"run writes to out_root/<name> and is picked by --only <name>, so a name is one folder "
                          f"(no '/', not '.' or '..') with no '=' (an override to --only) and no leading '-'")
    return folder


def yaml_text(text: str) -> str:
    """`text` as an override value that the loader reads back as that text: plain where YAML reads it so, else
    double-quoted (a run named 'a ' lost its space, and so trained in run a's folder; 'lam #2' was cut at the '#')."""
    try:
        if parse_yaml(text) == text:
            return text
    except yaml.YAMLError:
        pass
    return json.dumps(text)  # a JSON string is a YAML double-quoted one


def out_dir_of(run: dict) -> str:
    """The folder a run's train.py writes to: the value of its out_dir override, as the loader reads it."""
    return parse_yaml(next(o.split("=", 1)[1] for o in reversed(run["overrides"]) if o.startswith("out_dir=")))


def refuse_shared_folders(runs: list[dict], sweep_path: str) -> None:
    """Two runs of one sweep in one folder would share one run: the second resumes the first's checkpoint
    and the summary calls both finished. Refused before anything starts, whatever makes the folders one:
    the same name after YAML typing (1.0 and '1.0'), a symbolic link, or names that differ only in case
    (one folder on macOS and Windows file systems)."""
    seen: dict[str, str] = {}
    for run in runs:
        # relative to the repository root, where the commands run, wherever the sweep was started from
        key = os.path.normcase(os.path.realpath(os.path.join(ROOT, out_dir_of(run)))).casefold()
        if key in seen:
            raise ConfigError(f"{sweep_path}: runs {seen[key]!r} and {run['name']!r} would share the folder "
                              f"{out_dir_of(run)} (and so one checkpoint: the second would resume the first); "
                              f"give them names that differ as folder names")
        seen[key] = run["name"]


def unrunnable_launcher(launcher: str) -> Optional[str]:
    """Why the --launcher cannot start a command (None when it can). Its program is resolved as Popen
    will resolve it: on PATH, or a path relative to the repository root, where every command runs. One that would
    pass the commands options they do not take is refused too (launchers.launcher_refusal: python -m
    torch.distributed.launch without --use-env)."""
    if not launcher:
        return None  # this python
    words = launcher_prefix(launcher)
    if not words:
        return 'names no program; leave --launcher out to use this python, or give e.g. "torchrun --nproc_per_node=8"'
    program = words[0]
    found = os.path.join(ROOT, program) if os.sep in program else shutil.which(program)
    if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
        return f"{program!r} is not an executable program" + ("" if os.sep in program else " on PATH") + \
            " (activate the environment that has it, or give its full path)"
    return launcher_refusal(launcher)


def launcher_prefix(launcher: str) -> list[str]:
    """The words a command starts with: this python without a --launcher, else the launcher's words with a
    leading ~ of its program read as the home folder (a quoted "~/bin/torchrun ..." reaches us unexpanded, and
    Popen, which starts it without a shell, would not find it). Raises ValueError for an unclosed quote."""
    if not launcher:
        return [sys.executable]
    words = shlex.split(launcher)
    return [os.path.expanduser(words[0]), *words[1:]] if words else []


def commands(run: dict, launcher: str, evaluate: bool, eval_amp: Optional[str] = None) -> list[list[str]]:
    """The run's train.py command, then (with `evaluate`) its evaluate.py command, under --amp `eval_amp` when
    one is given (none given: evaluate.py's default, and no --amp in the command), with --recompute where
    plan_changed_evaluations marked the run."""
    prefix = launcher_prefix(launcher)
    config_args = [a for c in run["configs"] for a in ("--config", c)]
    cmds = [prefix + ["train.py", *config_args, *run["overrides"]]]
    if evaluate:
        checkpoint, result = evaluation_paths(run)
        amp = ["--amp", eval_amp] if eval_amp is not None else []
        recompute = ["--recompute"] if run.get("recompute") else []  # plan_changed_evaluations
        cmds.append(prefix + ["evaluate.py", "--checkpoint", checkpoint, "--out", result, *amp, *recompute,
                              *evaluation_overrides(run)])
    return cmds


def evaluation_paths(run: dict) -> tuple[str, str]:
    """(the checkpoint, the result JSON) of a run's evaluation, relative to the repository root."""
    out_dir = out_dir_of(run)
    return os.path.join(out_dir, "best.pt"), os.path.join(out_dir, "eval_best.json")


def evaluation_overrides(run: dict) -> list[str]:
    """The overrides of a run's evaluate.py command: its data and quant overrides (data.root=..., and
    quant={...} as well as quant.x=...), its train.device and train.eval_batch_size_per_gpu (EVAL_TRAIN_KEYS, which
    evaluate.py reads: a train={...} mapping gives them as key=value items of their own), then the sweep's list.
    Training's own data settings (data.mixup, data.reprob, ...) stay out: the checkpoint's config holds them as the
    run trained, and evaluate.py refuses them where none of its passes reads them. The train.* ones go on, as the
    data placement keys do: the checkpoint holds the values of the command that wrote it, so a sweep requeued with
    train.eval_batch_size_per_gpu=32 (an evaluation that ran out of memory) or train.device=cpu evaluated a run
    trained before it at its checkpoint's values."""
    items = []
    for o in run["overrides"]:
        section, keys = o.split("=", 1)[0].split(".", 1)[0].strip(), set(override_keys(o))
        if section in ("data", "quant") and not keys <= TRAINING_ONLY_OVERRIDE_KEYS:
            items.append(o)
        elif section == "train" and keys <= set(EVAL_TRAIN_KEYS):
            items.append(o)
        elif section == "train" and keys & set(EVAL_TRAIN_KEYS):  # train={device: cpu, seed: 3}: the device alone
            key, _, raw = o.partition("=")
            settings = dotted_settings(key.strip(), parse_yaml(raw), Config())
            items += [f"{k}={dump_yaml(v, default_flow_style=True).splitlines()[0]}" for k, v in settings.items()
                      if k in EVAL_TRAIN_KEYS]
    return items + run["evaluate"]


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="sweep file, e.g. configs/sweeps/cd_lambda.yaml")
    # default=[]: without it, Python 3.11's parse_intermixed_args names `overrides` as required beside `sweep`
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides for every run (e.g. data.root=...)")
    p.add_argument("--run", action="store_true",
                   help="run the commands one after another (default: print them)")
    p.add_argument("--evaluate", action="store_true", help="also evaluate each run's best.pt (evaluate.py)")
    # default None, not "none": an --eval-amp given without --evaluate is refused, whatever its value
    p.add_argument("--eval-amp", choices=EVAL_AMP_CHOICES,
                   help="autocast of every evaluate.py command (its --amp; default: none, fp32); needs --evaluate")
    p.add_argument("--recompute", action="store_true",
                   help="with --run --evaluate: give evaluate.py --recompute for each run whose result file holds "
                        "entries computed with other settings than the sweep's (the old ones kept in its history); "
                        "without it such a run is refused before anything starts")
    p.add_argument("--launcher", default="", help='e.g. "torchrun --nproc_per_node=8" (default: this python)')
    p.add_argument("--only", nargs="+", help="names of the runs to keep")
    args = p.parse_intermixed_args(argv)
    # flags the command line refuses on its own: usage errors (one line, status 2, as argparse's), before the sweep
    # file is read
    if args.eval_amp is not None and not args.evaluate:  # no evaluate.py command would take it
        p.error(f"--eval-amp {args.eval_amp} sets the autocast of the evaluate.py commands, which only --evaluate "
                "adds: add --evaluate, or drop --eval-amp")
    if args.recompute and not (args.run and args.evaluate):  # the result files are read where the commands run
        p.error("--recompute is passed on to the evaluate.py commands of the runs whose result file holds entries of "
                "other settings, which the sweep reads with --run --evaluate only: add "
                f"{' '.join(f for f, given in (('--run', args.run), ('--evaluate', args.evaluate)) if not given)}, "
                "or drop --recompute (a printed evaluate.py command takes it as any)")
    if args.only:  # `--only a quant.x=1`: --only takes every item after it; key=value ones are overrides
        move_overrides(args, "only")
        if not args.only:
            p.error("--only needs the names of runs to keep (its key=value words are overrides for every run)")
    # argparse takes the first word for the sweep file: `sweep.py data.root=/d SWEEP.yaml` read the override as the
    # sweep's path ("config file not found: data.root=/d") and the sweep file as an override
    if "=" in args.sweep and not os.path.isfile(args.sweep):
        file = next((o for o in args.overrides if "=" not in o), "SWEEP.yaml")
        p.error(f"{args.sweep} is a key=value override, not a sweep file: give the sweep file first (python "
                f"scripts/sweep.py {file} {args.sweep} ...)")
    files = [o for o in args.overrides if "=" not in o and o.endswith((".yaml", ".yml"))]
    if files:  # it reached the loader as an override: 'not of the form key=value', naming no fix
        p.error(f"{files[0]} is no key=value override, and a sweep takes one sweep file: a config file for every run "
                f"goes in the sweep file's 'configs' list, one of a run's own in its items")
    try:
        with stops_before_start(args.run):
            runs = prepare(args)
    except StoppedBeforeStart as stop:  # no command started: the same command starts them all
        print(f"sweep: {stop.name} came before any run started; none started: run the same command again",
              file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    if not args.run:
        # the commands' paths (scripts, config files, out_dir) are the repository root's, as --run runs them: pasted
        # into a shell anywhere else they would miss train.py or write elsewhere
        console_print(shlex.join(["cd", ROOT]))
        for run in runs:
            for cmd in commands(run, args.launcher, args.evaluate, args.eval_amp):
                console_print(shlex.join(cmd))
        return 0
    states = {r["name"]: "not started" for r in runs}
    code = 0
    with ForwardedSignals() as signals:
        for run in runs:
            code, states[run["name"]] = run_one(run, args, signals)
            if code:
                break
    console_print("sweep summary:\n" + "\n".join(f"  {name}: {state}" for name, state in states.items()))
    return code


def prepare(args: argparse.Namespace) -> list[dict]:
    """The runs of the sweep that `args` (main's) keeps, each checked as far as can be told before any starts; exits
    with one `error:` line for a refusal."""
    try:
        shlex.split(args.launcher)
        # a launcher that cannot be started stopped the sweep on a FileNotFoundError traceback, without its
        # summary (printed commands may be meant for another machine: checked only where they run)
        launcher_problem = unrunnable_launcher(args.launcher) if args.run else None
    except ValueError as e:  # e.g. an unclosed quote
        sys.exit(f"error: --launcher {args.launcher!r}: {e}")
    if launcher_problem:
        sys.exit(f"error: --launcher {args.launcher!r}: {launcher_problem}")
    try:
        # with --run, a batch that does not split into the launcher's processes is refused before the first run
        # trains, not at the start of its own run after the earlier runs trained
        world_size = launcher_world_size(args.launcher) if args.run else None
        # log.wandb's package: looked for only where the commands run (printed ones may be run on another machine)
        runs = expand(args.sweep, args.overrides, args.only, world_size, packages=args.run)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if args.only:
        missing = sorted(set(args.only) - {r["name"] for r in runs})
        if missing:
            names = [r["name"] for r in runs]
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            sys.exit(f"error: --only: no run named {', '.join(missing)} in {args.sweep} (its runs: {shown})")
        runs = [r for r in runs if r["name"] in args.only]
    if args.evaluate:
        try:
            refuse_unevaluated_options(runs)
            if args.run:  # (printed commands may be meant for another machine: checked only where they run)
                refuse_results_of_another_autocast(runs, args.eval_amp)
                refuse_results_of_other_data(runs)
                refuse_maxima_files_without_their_result(runs)
        except ConfigError as e:
            sys.exit(f"error: {e}")
    if args.run:  # (printed commands may be meant for another machine: checked only where they run)
        try:
            refuse_missing_input_files(runs)
            # settings the sweep file changed since a run trained or was evaluated: train.py and evaluate.py would
            # refuse them at that run's turn, after the runs before it
            refuse_changed_training_settings(runs, args.sweep, world_size)
            if args.evaluate:
                plan_changed_evaluations(runs, args.recompute, world_size, args.sweep, args.overrides)
        except ConfigError as e:
            sys.exit(f"error: {e}")
    return runs


class StoppedBeforeStart(BaseException):
    """SIGTERM / SIGINT before the first command started (BaseException: no check's `except Exception` takes it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.name = signal.Signals(signum).name


@contextlib.contextmanager
def stops_before_start(active: bool):
    """With `active` (--run), SIGTERM / SIGINT while the sweep checks its runs (reading every run's checkpoint.pt and
    best.pt: minutes for a large sweep) raise StoppedBeforeStart, so that the sweep exits with EXIT_PREEMPTED as a
    stop during a run does, for a job script that requeues on it: ended by the signal itself, it exited 143 (or a
    KeyboardInterrupt traceback), which such a script takes for a failure, dropping the sweep. The checks only read:
    nothing is left half done. The handlers before are restored on leaving."""
    if not active:
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise StoppedBeforeStart(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def refuse_unevaluated_options(runs: list[dict]) -> None:
    """evaluate.py refuses an override of the options of a pipeline it does not run (quant.aphq.iters=500
    where the evaluation runs repq only), of the calibration batch where no pipeline reads it, of the training
    batches' data settings (data.mixup, ...) and of the training sections (train.*, optim.*, ...) always, and of
    the training transform's (data.reprob, ...) where no pipeline sees training-transform images: say so before
    the first run trains, not after it."""
    for run in runs:
        evaluated = evaluation_overrides(run)
        # what is left of the run's own training data settings: data={root: /x, mixup: 0.5} (evaluate.py needs the
        # root and refuses the mixup)
        for item in evaluated[:len(evaluated) - len(run["evaluate"])]:
            mixed = sorted(set(override_keys(item)) & TRAINING_ONLY_OVERRIDE_KEYS)
            if mixed:
                raise ConfigError(f"sweep run '{run['name']}': {item} sets {mixed[0]}, which only training reads "
                                  "(its evaluation takes it from the checkpoint, and evaluate.py would refuse it "
                                  f"after the training): give it as a training override of its own ({mixed[0]}=...)")
        # the sweep's evaluate list goes to evaluate.py alone: the data settings of training batches are read by no
        # pass of it (the training transform's, by a pipeline that sees training-transform images: below)
        for item in run["evaluate"]:
            batch = sorted(set(override_keys(item)) & TRAIN_BATCH_OVERRIDE_KEYS)
            if batch:
                raise ConfigError(f"sweep run '{run['name']}': '{item}' in the sweep's evaluate list: no pass of "
                                  f"evaluate.py reads {batch[0]} (the checkpoint holds the value the run trained "
                                  "with), and it would refuse it after the training; drop it from 'evaluate' (a "
                                  "run's own override trains with it)")
            unread = unread_training_settings(sorted(override_keys(item)), method_read=False)
            if unread:  # train.*, optim.*, sched.*, log.*, cd.*, tweo.*
                raise ConfigError(f"sweep run '{run['name']}': '{item}' in the sweep's evaluate list: evaluate.py does "
                                  f"not read training settings ({unread[0]}), and it would refuse it after the "
                                  "training; drop it from 'evaluate' (a run's own override trains with it)")
        transform = any(set(override_keys(item)) & TRAINING_ONLY_OVERRIDE_KEYS for item in run["evaluate"])
        if not transform and not any(k.startswith("quant.") for k in keys_of(evaluated)):
            continue  # no quantization setting: nothing to check (and no need to import evaluate.py's stack)
        import evaluate  # torch and the pipelines: only where a pipeline's options are given
        from quant.plan import evaluation_pipelines
        cfg = load_config([os.path.join(ROOT, c) for c in run["configs"]], run["overrides"] + run["evaluate"])
        pipelines = evaluation_pipelines(cfg)
        for item, pipeline in evaluate.pipeline_options_unread(evaluated, pipelines):
            raise ConfigError(f"sweep run '{run['name']}': {item} sets options of {pipeline}, which its evaluation "
                              f"does not run (pipelines: {', '.join(pipelines) or 'none'}): evaluate.py would "
                              f"refuse it after the training; add {pipeline} to quant.pipelines (the sweep's "
                              "evaluate list), or drop it")
        cfg.quant.pipelines = [p for p in pipelines if p in evaluate.PIPELINES]  # an unknown one: evaluate.py's error
        for item in evaluate.train_transform_overrides_unread(run["evaluate"], cfg):
            raise ConfigError(f"sweep run '{run['name']}': '{item}' in the sweep's evaluate list: no pipeline of its "
                              "evaluation sees training-transform images (pipelines: "
                              f"{', '.join(pipelines) or 'none'}; aphq and gplq draw them, as does a pipeline that "
                              "reads the calibration batch with quant.calib_transform=train), and evaluate.py would "
                              "refuse it after the training; drop it from 'evaluate'")
        language = evaluate.task_for(cfg.data.dataset).language
        for item in evaluate.calibration_overrides_unread(evaluated, pipelines, language):
            what = ("a setting only pipelines read, and its evaluation runs none" if not pipelines else
                    "the calibration batch, which no pipeline of its evaluation reads")
            raise ConfigError(f"sweep run '{run['name']}': {item} sets {what} (pipelines: "
                              f"{', '.join(pipelines) or 'none'}): evaluate.py would refuse it after the training; "
                              "drop it")


def run_one(run: dict, args: argparse.Namespace, signals: "ForwardedSignals") -> tuple[int, str]:
    """Train (and evaluate) one run; (exit code for the sweep, 0 to go on; the run's state)."""
    for i, cmd in enumerate(commands(run, args.launcher, args.evaluate, args.eval_amp)):
        if signals.received:  # the stop came between two commands
            return EXIT_PREEMPTED, "not started" if i == 0 else "trained, evaluation not started"
        if i == 1:  # the evaluation of best.pt
            move_stale_result(cmd[cmd.index("--out") + 1], cmd[cmd.index("--checkpoint") + 1])
        console_print(shlex.join(cmd))  # a reader that has gone (`| head`) stops no run (engine/console.py)
        # a launcher may not pass the command's EXIT_PREEMPTED on (torchrun exits 1 when its processes exit 75):
        # the command's own log, as far as this command wrote it, says whether a stop request ended it
        log = os.path.join(ROOT, out_dir_of(run), "train.log" if i == 0 else "eval.log")
        mark = log_mark(log)
        code, killed = shell_status(signals.run(cmd))
        step = "training" if i == 0 else "evaluation"
        if stopped_after_checkpoint(code, log, mark):
            print(f"sweep: run '{run['name']}' stopped during {step}; run the same command again to continue",
                  file=sys.stderr, flush=True)
            return EXIT_PREEMPTED, f"stopped during {step} (resumable)"
        if code and signals.received and i == 1:
            # evaluate.py ends on the signal (only GPLQ's stage 1 writes a checkpoint, above); the same command
            # evaluates again and skips what its JSON already holds: a stop to requeue, as a training's
            print(f"sweep: run '{run['name']}': its evaluation was stopped ({code}{killed}); run the same command "
                  "again to continue", file=sys.stderr, flush=True)
            return EXIT_PREEMPTED, "evaluation stopped (re-run to continue)"
        if code and signals.received:  # e.g. a second Ctrl-C: train.py ended at once, without a checkpoint
            print(f"sweep: run '{run['name']}' was interrupted during {step} before it wrote a checkpoint ({code}); "
                  "stopping", file=sys.stderr, flush=True)
            return code, f"interrupted during {step}, no checkpoint written on the stop (exit code {code}{killed})"
        if code:
            print(f"sweep: run '{run['name']}' failed ({code}); stopping", file=sys.stderr, flush=True)
            return code, f"failed during {step} (exit code {code}{killed})"
        if i == 0 and (unsaved := trained_without_checkpoint(out_dir_of(run), run["name"])
                       or withheld_at_max_steps(run)):
            # a failure, not a result: its best.pt (none, or one of an earlier point) is not evaluated
            print(f"sweep: run '{run['name']}' {unsaved}; stopping", file=sys.stderr, flush=True)
            return 1, f"failed during training: {unsaved}"
    stopped = stopped_before_schedule_end(out_dir_of(run))
    if stopped:
        return 0, f"{stopped}; {'evaluated' if args.evaluate else 'not evaluated'}"
    return 0, "finished and evaluated" if args.evaluate else "finished"


def shell_status(returncode: int) -> tuple[int, str]:
    """(exit code, '' or ': killed by SIG...') of a command's Popen returncode. A command killed by signal n
    (the OOM killer's SIGKILL) has returncode -n: the sweep exits as a shell reports it, 128 + n, since
    sys.exit(-9) would make the sweep's own exit status 247, which names no signal to a job script."""
    if returncode >= 0:
        return returncode, ""
    try:
        name = signal.Signals(-returncode).name
    except ValueError:  # a real-time signal has no name
        name = f"signal {-returncode}"
    return 128 - returncode, f": killed by {name}"


def trained_without_checkpoint(out_dir: str, name: str) -> Optional[str]:
    """What ended a run whose train.py exited 0 without a checkpoint.pt in `out_dir`, or None when it wrote one.
    train.py ends so only at train.max_steps inside a streak of high training losses before its first checkpoint:
    the divergence guard withholds checkpoint.pt and best.pt from such weights (engine/divergence.py). Nothing is
    left to resume or to evaluate, and a re-run with other settings (a lower optim.lr) is refused beside the run's
    logs. The way out named is moving the folder away: train.archive_existing=true, train.py's own, is a setting
    only a run's start reads, which every later resume of the run would then have to repeat (--only NAME)."""
    if os.path.exists(os.path.join(ROOT, out_dir, "checkpoint.pt")):
        return None
    return ("stopped at train.max_steps with no checkpoint written (divergence guard: the training loss was above its "
            f"threshold, its train.log says from which update); not evaluated: lower the optim.lr of run '{name}' and "
            f"move {out_dir} (its logs only) out of the way, or give the run another name")


def withheld_at_max_steps(run: dict) -> Optional[str]:
    """What ended a run whose train.py exited 0 with a checkpoint.pt of an update before the one it stopped at, or
    None. train.py stops at min(train.max_steps, the schedule's updates) and exits 0 there also when the divergence
    guard withheld the writes of its high-loss updates (engine/divergence.py): the checkpoint.pt and best.pt left are
    an earlier update's, not a result of the run's length. Compared with the config the run trained with (the
    sweep's, not the checkpoint's: a resume with a raised train.max_steps whose writes were all withheld leaves the
    older config in it), its schedule counted in the checkpoint's updates per epoch. Without train.max_steps the write
    that ends the schedule is always made. An unreadable checkpoint is left to stopped_before_schedule_end, which
    says so."""
    cfg = load_config([os.path.join(ROOT, c) for c in run["configs"]], run["overrides"])
    if cfg.train.max_steps is None:
        return None
    out_dir = out_dir_of(run)
    try:
        step, _, updates_per_epoch, _ = checkpoint_position(out_dir)
    except Exception:  # noqa: BLE001 - no checkpoint, or one of an older version: told by the caller's next check
        return None
    from engine.optim import schedule_length

    _, total, _ = schedule_length(cfg.sched, updates_per_epoch)
    stop = min(total, cfg.train.max_steps)
    if step >= stop:
        return None
    return (f"stopped at train.max_steps at update {stop} with its checkpoint withheld (divergence guard: the training "
            f"loss was above its threshold, its train.log says from which update; checkpoint.pt is of update "
            f"{step}); not evaluated: lower the optim.lr of run '{run['name']}' (with train.allow_changed_config=true "
            f"it goes on from update {step}), or move {out_dir} out of the way")


def checkpoint_position(out_dir: str) -> tuple[int, int, int, dict]:
    """(update, epoch, updates per epoch, saved config) of `out_dir`'s checkpoint.pt, memory-mapped: its weights are
    not read. Raises whatever reading it raises (no file, a file of an older version)."""
    import torch  # only once a run has trained: expanding a sweep does not need it

    payload = torch.load(os.path.join(ROOT, out_dir, "checkpoint.pt"), map_location="cpu", weights_only=True,
                         mmap=True)
    state = payload["state"]
    return (int(state["step"]), int(state["epoch"]), int(payload["epoch_position"]["updates_per_epoch"]),
            payload["config"])


def stopped_before_schedule_end(out_dir: str) -> Optional[str]:
    """How far a run that train.py ended with exit 0 got, when its schedule has not ended (train.max_steps
    stopped it): e.g. 'stopped at train.max_steps at update 8 of 24, before its schedule ended'; None when it
    finished. Read from the run's checkpoint.pt as train.py decides it (engine/optim.schedule_length of its saved
    config and updates per epoch), memory-mapped: its weights are not read."""
    from configs import config_from_dict
    from engine.optim import schedule_length

    path = os.path.join(ROOT, out_dir, "checkpoint.pt")
    try:
        step, epoch, updates_per_epoch, config = checkpoint_position(out_dir)
        epochs, total, _ = schedule_length(config_from_dict(config).sched, updates_per_epoch)
    except Exception as e:  # noqa: BLE001 - no checkpoint, or one of an older version: say what is not known
        return f"trained (exit 0), but {path} does not say whether its schedule ended ({type(e).__name__}: {e})"
    if epoch < epochs and step < total:  # train.py's own test of a run cut short (train.finish)
        return f"stopped at train.max_steps at update {step} of {total}, before its schedule ended"
    return None


def refuse_missing_input_files(runs: list[dict]) -> None:
    """A run's train.resume, and the model.pretrained of a run that starts afresh (no train.resume, no checkpoint.pt
    in its folder: a resumed run takes its weights from the checkpoint), must be a file when its train.py starts:
    refused before the first run trains (ConfigError), not after the earlier runs have trained. model.pretrained=hub
    is timm's download, no path. A path in the folder of an earlier run of the sweep is left alone: that run may
    write it (b: [model.pretrained=<out_root>/a/best.pt]). So are a run's data files as train.py's start refuses
    them from a listing (data/loader.py check_data_files: data.root, its splits, a token file's size and first ids)."""
    from data import DataError
    from data.loader import check_data_files
    from engine.run_dir import is_inside

    earlier: list[str] = []  # the folders of the runs before this one
    for run in runs:
        cfg = load_config([os.path.join(ROOT, c) for c in run["configs"]], run["overrides"])
        out_dir = os.path.join(ROOT, out_dir_of(run))
        resumes = bool(cfg.train.resume) or os.path.isfile(os.path.join(out_dir, "checkpoint.pt"))
        inputs = [("train.resume", cfg.train.resume, "a checkpoint.pt or a snapshot (out_dir/snapshots/epoch<E>.pt) "
                   "written by train.py")] if cfg.train.resume else []
        if cfg.model.pretrained and cfg.model.pretrained != "hub" and not resumes:
            inputs.append(("model.pretrained", cfg.model.pretrained,
                           "a local .pth, .pt or .safetensors weights file, or hub"))
        for key, value, what in inputs:
            path = os.path.join(ROOT, value)  # the commands run in the repository root
            if os.path.isfile(path) or any(is_inside(path, folder) for folder in earlier):
                continue
            problem = "is a folder" if os.path.isdir(path) else "is no such file"
            raise ConfigError(f"sweep run '{run['name']}': {key}={value} {problem}: give {what} (checked before the "
                              f"sweep's first run trains)")
        # data.root as the command reads it, in the repository root ('' stays '': the error names it unset)
        data = dataclasses.replace(cfg.data, root=cfg.data.root and os.path.join(ROOT, cfg.data.root))
        try:
            check_data_files(data, cfg.model.num_classes)
        except DataError as e:
            raise ConfigError(f"sweep run '{run['name']}': {e} (checked before the sweep's first run trains)"
                              ) from None
        earlier.append(out_dir)


def current_result(run: dict) -> Optional[tuple[str, object]]:
    """(the run's result file, its JSON) where the file is of the weights the run's best.pt holds; None for a missing
    file or one evaluate.py would not add to for that best.pt (the sweep moves it aside: move_stale_result)."""
    checkpoint, result = evaluation_paths(run)
    path = os.path.join(ROOT, result)
    if not os.path.isfile(path) or is_stale_result(path, os.path.join(ROOT, checkpoint)):
        return None
    try:
        with open(path) as f:
            return result, json.load(f)
    except (OSError, ValueError):
        return None


def refuse_results_of_another_autocast(runs: list[dict], eval_amp: Optional[str]) -> None:
    """evaluate.py refuses a result file written under another --amp (its eval_amp), and --out, which its error
    offers, is the sweep's to name: a requeued sweep under another --eval-amp would end at the first such run,
    after its training, as 'failed during evaluation', the later runs not started. Refused before anything starts,
    saying what to do. Not refused: a file of other weights than the run's best.pt holds, or that evaluate.py cannot
    read as a result (the sweep moves it aside, move_stale_result). A run
    that is to train further may yet write a newer best.pt, which would have the file moved aside: that is not known
    before it trains, and the file is refused."""
    amp = eval_amp or "none"  # evaluate.py's default
    for run in runs:
        found = current_result(run)
        if found is None:
            continue
        result, data = found
        recorded = data.get("eval_amp") if isinstance(data, dict) else None
        if isinstance(recorded, str) and recorded != amp:
            same = "leave --eval-amp out" if recorded == "none" else f"give --eval-amp {recorded}"
            stem = os.path.splitext(result)[0]
            raise ConfigError(f"sweep run '{run['name']}': {result} holds its evaluation under --amp {recorded}, "
                              f"and evaluate.py adds to a result file only under the --amp it was written with: "
                              f"{same} to continue it, or move it away (with {stem}_act_max.csv and .png) to "
                              f"evaluate the run under --eval-amp {amp}")


@contextlib.contextmanager
def in_root():
    """The repository root as the working folder, where the sweep's commands run (their relative paths are read
    from it); the folder before is restored on leaving (contextlib.chdir from Python 3.11 on)."""
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(here)


def refuse_results_of_other_data(runs: list[dict]) -> None:
    """evaluate.py adds to a result file only for the data it was written of (its 'data': the data set, data.root,
    the val split and the eval transform; evaluate.data_identity), and --out, which its error offers, is the sweep's
    to name: a sweep requeued with another data.root (a copy of the data set on the node's own disk, the data moved)
    validated its first finished run again and ended at that run's evaluation as 'failed during evaluation', the
    later runs not started. Refused before anything starts (ConfigError), naming the settings the file was evaluated
    with. The data are resolved as evaluate.py resolves them (its resolve_config of the run's best.pt and the
    command's overrides, in the repository root, with the model's input size; best.pt as the run's train.py leaves it:
    quant_recorded_at_its_turn); a command evaluate.py would refuse for another reason is left to it and the other
    checks. Not refused: results move_stale_result moves aside. As in
    refuse_results_of_another_autocast, a run that is to train further may yet write a newer best.pt, which would
    have the file moved aside: that is not known before it trains, and the file is refused."""
    import evaluate
    from engine.eval_results import as_stored, take_later_data
    from models import input_size

    for run in runs:
        found = current_result(run)
        if found is None or not isinstance(found[1], dict) or not isinstance(found[1].get("data"), dict):
            continue  # no result to add to, or one that records no data (evaluate.py's own reading)
        result, data = found
        take_later_data(data)  # a file written before a data field was recorded, as evaluate.py reads it
        checkpoint = evaluation_paths(run)[0]
        args = evaluate.parse_args(["--checkpoint", os.path.join(ROOT, checkpoint), "--out",
                                    os.path.join(ROOT, result), *evaluation_overrides(run)])
        try:
            # relative paths (data.root) as the command reads them, best.pt as the run's train.py leaves it
            with in_root():
                cfg, _ = evaluate.resolve_config(args, recorded_quant=quant_recorded_at_its_turn(run))
                now = evaluate.data_identity(cfg.data, input_size(check_model(evaluate.eval_model_config(cfg.model))))
        except evaluate.USER_ERRORS:
            continue
        recorded, now = data["data"], as_stored(now)  # as the file compares it: lists, not tuples
        if recorded != now:
            differs = "; ".join(f"{key}: {old!r} in the file, {new!r} now"
                                for key, old, new in changed_fields(recorded, now, "data."))
            stem = os.path.splitext(result)[0]
            raise ConfigError(f"sweep run '{run['name']}': {result} holds its evaluation of other data ({differs}), "
                              "and evaluate.py adds to a result file only for the data it was written of: give the "
                              f"sweep the settings it was evaluated with to continue it, or move it away (with "
                              f"{stem}_act_max.csv and .png) to evaluate the run on these data")


def changed_fields(old: dict, new: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted field, old value, new value) of each field that differs between the records `old` and `new`, nested
    records field by field."""
    changed = []
    for key in list(dict.fromkeys([*old, *new])):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += changed_fields(a, b, f"{prefix}{key}.")
        elif a != b:
            changed.append((f"{prefix}{key}", a, b))
    return changed


def refuse_maxima_files_without_their_result(runs: list[dict]) -> None:
    """evaluate.py writes a result's per-layer maxima beside it (eval_best_act_max.csv / .png) and refuses to
    overwrite such a file that its result file did not write (engine/act_max_ownership.check_act_max_files): a run
    whose eval_best.json was deleted to evaluate it again, its maxima files left, failed at its evaluation, after its
    training, and the later runs were not started. Refused before anything starts (ConfigError). A result file that
    is there is left to evaluate.py and move_stale_result: its own files are replaced, and those of a stale one are
    moved aside with it. Not refused: an evaluation that writes no maxima files (quant.act_max_csv=false)."""
    from engine.act_max_ownership import act_max_paths

    for run in runs:
        result = evaluation_paths(run)[1]
        if os.path.lexists(os.path.join(ROOT, result)):
            continue
        there = [path for path in act_max_paths(os.path.splitext(result)[0]).values()
                 if os.path.exists(os.path.join(ROOT, path))]  # as check_act_max_files finds them
        if not there:
            continue
        # quant.act_max_csv as evaluate.py reads it: the run's recorded setting under its evaluation's overrides
        cfg = load_config([os.path.join(ROOT, c) for c in run["configs"]], run["overrides"] + run["evaluate"])
        if cfg.quant.act_max_csv:
            raise ConfigError(f"sweep run '{run['name']}': {' and '.join(there)} {'is' if len(there) == 1 else 'are'} "
                              f"there without {result}, whose maxima files they would be, and evaluate.py would "
                              "refuse to write the run's maxima over them after its training: move them out of the "
                              "folder (or add quant.act_max_csv=false to the sweep's evaluate list)")


def refuse_changed_training_settings(runs: list[dict], sweep_path: str, world_size: Optional[int]) -> None:
    """train.py continues the checkpoint.pt in a run's folder only with the settings it was written with (train.py's
    check_resumable, which this runs: train.allow_changed_config=true aside) and only where the run's length and
    layout can continue it (check_resume_length: also with train.allow_changed_config=true), and it claims the
    folder first (engine/run_dir.check_claim, as train.py --print-config asks it, nothing moved): files of an earlier
    run without a checkpoint.pt are refused unless they are the logs of the same command (a run that stopped before
    its first checkpoint and whose settings were edited since). A run whose settings in the sweep file were changed
    since (cd.lam of a finished run; a shorter sched.epochs) was refused at its turn, after the runs before it had
    trained, or validated and been evaluated again, and the later runs were not started. Refused before anything
    starts (ConfigError), saying what to do in the sweep's terms (it names out_dir itself). `world_size`: the
    processes the launcher starts (None: it does not say, and the checks of the layout are left to train.py). A run
    with train.resume is checked against the file train.py would continue (engine/snapshots.planned_resume: that file,
    or the checkpoint.pt its folder holds of a start from it): a train.resume for every run of a sweep (a shared
    warm-up) with their settings was refused at the second run's turn, after the first had trained, and so was a
    train.resume beside a checkpoint.pt of another start in the run's folder (resume_source's refusal). Left to
    train.py's start: a train.resume in the folder of an earlier run of the sweep (that run writes it first), one
    that is no file (refuse_missing_input_files) and a checkpoint whose config cannot be read (train.py's error names
    what is wrong with the file)."""
    import torch  # only with --run: printing the commands does not need it

    from configs import config_to_dict
    from engine.checkpoint import CheckpointError
    from engine.run_dir import RunDirError, check_claim, is_inside
    from engine.snapshots import CONFIG_SECTIONS, planned_resume, resume_source
    from train import check_resumable

    earlier: list[str] = []  # the folders of the runs before this one
    for run in runs:
        cfg = load_config([os.path.join(ROOT, c) for c in run["configs"]], run["overrides"])
        # the commands run in the repository root: check_resumable tells the run's own checkpoint.pt by out_dir
        cfg.out_dir = os.path.join(ROOT, cfg.out_dir)

        def refused(e: Exception) -> ConfigError:
            return ConfigError(f"sweep run '{run['name']}': train.py would refuse it at its start: {e} (in a sweep, "
                               f"out_dir is out_root/{run['name']}: another out_root in {sweep_path} gives every run "
                               f"a new folder, and a setting of this run goes in its items there)")

        # train.py's claim of the folder, before it reads a checkpoint (out_dir is no setting it compares), with the
        # relative paths the run reads (model.pretrained), which the claim keeps from being archived, as it reads them
        try:
            with in_root():
                check_claim(cfg.out_dir, config_to_dict(cfg), cfg.train.archive_existing)
        except RunDirError as e:
            raise refused(e) from e
        resume = os.path.join(ROOT, cfg.train.resume) if cfg.train.resume else ""  # as the command reads it
        earlier_run = any(is_inside(resume, folder) for folder in earlier) if resume else False
        earlier.append(cfg.out_dir)
        _, checkpoint = planned_resume(cfg.out_dir, resume)
        if checkpoint is None or earlier_run:
            continue
        own = os.path.join(cfg.out_dir, "checkpoint.pt")
        if checkpoint != own and os.path.isfile(own) and not os.path.samefile(own, checkpoint):
            # beside a checkpoint.pt of a start that did not begin from train.resume: train.py refuses it before its
            # claim (resume_source: its next checkpoint would replace that run's progress), or takes a snapshot of
            # the folder as a roll-back. Read whole, as train.py reads them (rare: not memory-mapped), its log quiet
            previous = logging.root.manager.disable
            logging.disable(logging.CRITICAL)
            try:
                resume_source(cfg.out_dir, resume)
            except CheckpointError as e:
                raise refused(e) from e
            finally:
                logging.disable(previous)
        try:  # memory-mapped: the weights are not read
            payload = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
            saved = payload["config"]
        except Exception:  # noqa: BLE001 - not a checkpoint of train.py: its own refusal at the run's start
            continue
        if not isinstance(saved, dict) or not all(isinstance(saved.get(k), dict) for k in CONFIG_SECTIONS):
            continue  # (engine/snapshots.read_training_checkpoint's test of what a resume compares)
        try:
            check_resumable(saved, cfg, checkpoint, warn=False)  # train.py announces the resume at its turn
            check_resume_length(cfg, payload, checkpoint, world_size)
        except (CheckpointError, ConfigError) as e:
            raise refused(e) from e


# The data settings the number of training samples depends on (data/loader.py build_dataset, data/text.py
# token_stream): where one of them changed since the checkpoint, its recorded count is not the run's, and only
# train.py's reading of the data tells the run's. The others (validation, transforms, mixing, the sampler's
# data.repeated_aug, which the count below goes through) leave the count as recorded.
TRAIN_SAMPLE_KEYS = (
    "data.dataset",  # which data set (train.py refuses another at resume; kept so that the list is whole)
    "data.root",  # an environment key (not in config_changes): another copy may hold other images or token files
    "data.train_split",  # the class folder or token file (<root>/<train_split>.bin) trained on
    "data.synthetic_train_size",  # the synthetic train set's images
    "data.kjv_val_fraction",  # the embedded text's tail held out: the training text is the rest
    "data.digits_val_fraction",  # the digits' stratified split: the training images are the rest
)


def check_resume_length(cfg, payload: dict, checkpoint: str, world_size: Optional[int]) -> None:
    """train.py's refusals of a resume that need the run's updates per epoch, which it counts once its data are
    read, made with its own checks in its order: the schedule reaches the checkpoint's update and train.max_steps is
    not below it (train.check_resume_point), a poly schedule decays with the checkpoint's power
    (engine/training_checks.check_poly_power; with train.allow_changed_config=true it only logs, at the run's turn),
    and the epochs have the checkpoint's number of updates and its position in the epoch falls on a whole update
    (engine/resume.resume_position: a changed train.batch_size). Fed from the memory-mapped checkpoint: its update,
    its scheduler state and its epoch_position, whose count of training samples stands for the data where the run's
    settings that size the training data (TRAIN_SAMPLE_KEYS) are the checkpoint's. The updates per epoch are those of
    train.py's loader over that count and `world_size` processes. Nothing is checked where the layout is not known:
    processes the launcher does not state (None), a checkpoint older than its epoch_position, a TRAIN_SAMPLE_KEYS
    setting changed since (train.allow_changed_config=true: data.synthetic_train_size, data.train_split, a
    validation fraction that sizes the training split or data.root may change the count, which only train.py's
    reading of the data tells), a batch that does not fit the samples (train.py's refusal, at its start). Raises
    CheckpointError or ConfigError, train.py's own."""
    from configs import config_to_dict
    from data import DataError
    from data.loader import _train_batches
    from engine.optim import schedule_length
    from engine.resume import epoch_layout, epoch_position, resume_position
    from engine.tasks import task_for
    from engine.training_checks import check_poly_power
    from train import accumulation_steps, check_resume_point

    recorded = payload.get("epoch_position")
    if world_size is None or not isinstance(recorded, dict):
        return
    # the recorded count is of the checkpoint's data: a changed setting that sizes the training data may read another
    # number of training samples, and with it other updates per epoch and another schedule; counting them means
    # reading the data, train.py's at its start. Any other data change (data.synthetic_val_size, a transform) leaves
    # the count, and the run's length is checked here as without it
    saved, now = payload["config"]["data"], config_to_dict(cfg)["data"]
    if any(saved.get(k.split(".", 1)[1]) != now.get(k.split(".", 1)[1]) for k in TRAIN_SAMPLE_KEYS):
        return
    accum_steps = accumulation_steps(cfg, world_size)
    samples = int(recorded["train_images"])
    try:  # train.py's loader (len: its sampler's full batches per process) over a stand-in of the samples
        batches = len(_train_batches(cfg.data, range(samples), cfg.train.batch_size_per_gpu, 0, world_size,
                                     cfg.train.seed, "training samples", "more training samples"))
    except DataError:
        return
    updates_per_epoch = batches // accum_steps
    if updates_per_epoch == 0:
        return
    _, total_steps, _ = schedule_length(cfg.sched, updates_per_epoch)
    check_resume_point(cfg, payload, checkpoint, total_steps, updates_per_epoch)
    state = payload["state"]
    if not cfg.train.allow_changed_config:
        last = total_steps if cfg.train.max_steps is None else min(total_steps, cfg.train.max_steps)
        check_poly_power(cfg, payload.get("scheduler"), checkpoint, updates_left=last - int(state["step"]))
    now = epoch_layout(cfg, world_size=world_size, accum_steps=accum_steps, updates_per_epoch=updates_per_epoch,
                       train_images=samples, language=task_for(cfg.data.dataset).language)
    resume_position(recorded, epoch_position(epoch_batches=0, **now), epoch_batches=int(state["epoch_batches"]),
                    step=int(state["step"]), checkpoint=checkpoint)


def plan_changed_evaluations(runs: list[dict], recompute: bool, world_size: Optional[int], sweep_path: str,
                             overrides: Sequence[str] = ()) -> None:
    """evaluate.py adds to a result file only what the sweep's settings compute alike (engine/eval_results.py): an
    entry of a pipeline and bit-width it is to run, computed with other settings ('evaluate' edited since: another
    quant.calib_images), or activation maxima over other quant.act_max_extra_modules, it refuses, advising --out
    (the sweep's to name) or --recompute. That ended the run as 'failed during evaluation' after its training (or
    validation) and evaluate.py's loading of the model, the later runs not started. With `recompute` (the sweep's
    --recompute) such a run's evaluate.py command gets --recompute (run['recompute']: the old entries go to the
    file's history; files that agree get none, so that a requeued sweep computes nothing twice); without it, refused
    before anything starts (ConfigError), naming where the difference comes from (change_sources): the command
    line's `overrides` (the sweep file as it was), the sweep file, or both. Not checked: a file of other weights than
    the run's best.pt holds, or that evaluate.py cannot read as a result (moved aside, move_stale_result). A run that
    is to train further may yet write a newer best.pt, which would have the file moved aside: that is not known
    before it trains, and the file is refused (as refuse_results_of_another_autocast)."""
    for run in runs:
        found = current_result(run)
        if found is None:
            continue
        result, data = found
        if not isinstance(data, dict) or not isinstance(data.get("quant"), dict):
            continue
        if not (data["quant"] or data.get("max_act")):
            continue  # nothing that settings could disagree with
        change = evaluation_change(run, data, world_size)
        if change is None:
            continue
        if recompute:
            run["recompute"] = True
            continue
        behind, by_file = change_sources(run, data, world_size, change, overrides)
        raise ConfigError(f"sweep run '{run['name']}': {result} holds {change}"
                          + refusal_advice(behind, by_file, sweep_path))


def refusal_advice(behind: list[str], by_file: bool, sweep_path: str) -> str:
    """The end of plan_changed_evaluations' refusal: where the change comes from (the command line's overrides
    `behind`, the sweep file `sweep_path` where `by_file`, or both) and how to undo it, or --recompute."""
    given = " ".join(behind)
    if not behind:  # the sweep file's settings alone
        source, settings, undo = "", "the sweep's settings", f"put the settings in {sweep_path} back as they were"
    elif not by_file:  # the sweep file is as it was: only the command line's overrides would undo it
        source, settings = f", set by the command line's {given}", "it" if len(behind) == 1 else "them"
        undo = f"drop {given} from the command line"
    else:
        source, settings = f", set by the command line's {given} and by {sweep_path}", "the sweep's settings and " \
            "the command line's"
        undo = f"drop {given} from the command line and put the settings in {sweep_path} back as they were"
    return (f"{source}, and evaluate.py would refuse to add to it: give the sweep --recompute to evaluate the run "
            f"again with {settings} (evaluate.py keeps the old entries in the file's 'history'), or {undo}")


def change_sources(run: dict, data: dict, world_size: Optional[int], change: str,
                   overrides: Sequence[str]) -> tuple[list[str], bool]:
    """Where `change` of the run's evaluation from its result file `data` comes from: (the command line's
    `overrides` that make it, whether the sweep file's settings do). The overrides that reach evaluate.py make it
    where the command without them differs otherwise or not at all: of them, those whose removal alone alters
    `change`, or all where none does alone. The sweep file makes it where the command without them still differs,
    or would be refused (the difference then not known to be theirs alone)."""
    given = [o for o in overrides if o in evaluation_overrides(run)]  # those that reach evaluate.py
    rest = evaluation_change(without(run, given), data, world_size, refused=change) if given else change
    if rest == change:
        return [], True
    behind = [o for o in given if evaluation_change(without(run, [o]), data, world_size, refused=change) != change]
    return behind or given, rest is not None


def without(run: dict, items: Sequence[str]) -> dict:
    """`run` with the override `items` left out of its overrides (a copy)."""
    return {**run, "overrides": [o for o in run["overrides"] if o not in items]}


def evaluation_change(run: dict, data: dict, world_size: Optional[int],
                      refused: Optional[str] = None) -> Optional[str]:
    """What of the result file `data` of `run` the run's evaluate.py command would refuse to add to, or None: an
    entry it plans that was computed with other settings, or activation maxima over other modules. Its config is
    resolved by evaluate.py's own resolve_config from the run's best.pt and the command's overrides, and compared as
    evaluate.py compares (engine/eval_results.py settings_change, extra_modules); in the repository root, where the
    commands run (relative data paths: a token file's train split is part of its settings). A data-parallel
    pipeline's result depends on the number of processes (GPLQ): the launcher's, which a launcher that does not say
    how many it starts leaves uncompared. `refused` (default None) where evaluate.py would refuse the command itself:
    its error says why. best.pt is read as the run's train.py leaves it before the evaluation: with the run's quant.*
    settings (quant_recorded_at_its_turn)."""
    import evaluate
    from engine.eval_results import extra_modules, settings_change
    from engine.quant_settings import quant_settings
    from quant.plan import planned

    checkpoint, result = evaluation_paths(run)
    args = evaluate.parse_args(["--checkpoint", os.path.join(ROOT, checkpoint), "--out", os.path.join(ROOT, result),
                                *evaluation_overrides(run)])
    with in_root():  # the command's relative paths (data.root) as it reads them
        try:
            cfg, _ = evaluate.resolve_config(args, recorded_quant=quant_recorded_at_its_turn(run))
            for name, bits in planned(cfg):
                entries = data["quant"].get(name)
                entry = entries.get(bits) if isinstance(entries, dict) else None
                if not isinstance(entry, dict):
                    continue
                asked = quant_settings(cfg, name)
                if "world_size" in asked:  # quant_settings records this process's (1), not the launcher's
                    stored = entry.get("settings") if isinstance(entry.get("settings"), dict) else {}
                    asked["world_size"] = world_size if world_size is not None else stored.get("world_size")
                change = settings_change(entry, asked, name, bits=bits)
                if change:
                    return f"{name} {bits} computed with other settings ({change})"
        except evaluate.USER_ERRORS:  # e.g. a token file that is not there: evaluate.py's refusal, in its own words
            return refused
    before, now = extra_modules(data), sorted(cfg.quant.act_max_extra_modules)
    if data.get("max_act") and before != now:
        return (f"activation maxima over quant.act_max_extra_modules={json.dumps(before)}, the sweep measures them "
                f"over {json.dumps(now)}")
    return None


def quant_recorded_at_its_turn(run: dict) -> dict:
    """The quant section of the config in `run`'s best.pt when the sweep evaluates it: its train.py records the run's
    quant.* settings there (train.py record_quant_in_checkpoints, which rewrites only that section), so a quant.*
    setting of the sweep's config files or overrides changed since the run trained (no training setting, so train.py
    resumes with it) is the evaluation's default then. Read from best.pt as it is now (evaluate.resolve_config
    without it), the old one passed the check before the start, and evaluate.py refused it after the run's
    training."""
    from configs import config_to_dict

    return config_to_dict(load_config([os.path.join(ROOT, c) for c in run["configs"]], run["overrides"]))["quant"]


def is_stale_result(json_path: str, checkpoint: str) -> bool:
    """Whether evaluate.py would not add to the result `json_path` for `checkpoint`: it is of other weights (an
    earlier best.pt of the run), records none, is of another checkpoint or is no result file (`stale_result`)."""
    return stale_result(json_path, checkpoint) is not None


def stale_result(json_path: str, checkpoint: str) -> Optional[str]:
    """Why evaluate.py would not add to the result `json_path` for an evaluation of `checkpoint`, or None where it
    would (or either file is missing). Decided by evaluate.py's own check (engine/eval_results.EvalResults.open)
    with the identity fields its command for `checkpoint` records that the sweep knows before it: the checkpoint's
    path and kind, and the fingerprint of its raw weights (the sweep's command gives no --ema). So a result of other
    weights (an earlier best.pt of the run) is told by that fingerprint, not by file times (a copy made without
    them, `cp -r`, rsync without -t, object storage, leaves the result older than its best.pt; a file written by
    hand for an earlier best.pt may be newer), and it refuses as well one that records no fingerprint (an older
    evaluate.py's, whatever its time), one of another best.pt that is still there (a copy of the run beside the
    original; a run folder moved away from the recorded path is the same checkpoint: _same_checkpoint) and one that
    is no result file of evaluate.py. Its other fields (--amp, data, settings) are the checks before the start's
    (refuse_results_of_another_autocast, plan_changed_evaluations). A `checkpoint` that is no train.py checkpoint
    has no fingerprint to compare (evaluate.py refuses it as --checkpoint): a result older than it is of an earlier
    one. The fingerprint is kept while best.pt is unchanged: it loads the weights, once per run and not per check."""
    if not (os.path.isfile(json_path) and os.path.isfile(checkpoint)):
        return None
    # torch: only with --run, which imports it anyway
    from engine.eval_results import ResultsError, _read, checkpoint_kind
    checkpoint, name = os.path.abspath(checkpoint), os.path.basename(checkpoint)  # absolute: as evaluate.py records
    fingerprint = _weights_fingerprint(checkpoint, _file_state(checkpoint))
    if fingerprint is None:  # no train.py checkpoint (evaluate.py refuses it): no weights to compare, its time tells
        if os.path.getmtime(json_path) < os.path.getmtime(checkpoint):
            return f"is older than {name}, which is no train.py checkpoint (written for an earlier {name})"
        return None
    identity = {"checkpoint": checkpoint, "checkpoint_kind": checkpoint_kind(checkpoint), "fingerprint": fingerprint,
                "weights": "raw"}  # the sweep's evaluate.py command gives no --ema
    try:
        _read(json_path, identity, say_moved=False)
    except ResultsError as e:
        result = _read_result(json_path)
        recorded = result.get("fingerprint") if isinstance(result, dict) else None
        if isinstance(result, dict) and "checkpoint" in result and recorded is None:  # a result of evaluate.py
            return (f"records no weights fingerprint (an older evaluate.py's), and evaluate.py adds only to a "
                    f"result of the weights {name} holds")
        if isinstance(recorded, str) and recorded != fingerprint:
            return f"scored other weights than {name} holds now (its weights fingerprint)"
        # another checkpoint, or no result file of evaluate.py: its words, less its advice (--out is the sweep's)
        return f"is refused by evaluate.py ({str(e).removeprefix(f'{json_path} ').rsplit('; ', 1)[0]})"
    return None


def _read_result(json_path: str) -> object:
    """The JSON at `json_path`, or None where it cannot be read as JSON."""
    try:
        with open(json_path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _file_state(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=None)
def _weights_fingerprint(checkpoint: str, state: tuple) -> Optional[str]:
    """The fingerprint evaluate.py records for the raw weights of `checkpoint` (engine/checkpoint.weights_fingerprint
    of its 'model', the state dict evaluate.py loads and hashes, as engine/eval_results.refuse_stale compares), or
    None where it is no train.py checkpoint; kept for this file `state` (_file_state: a new best.pt is read again).
    Memory-mapped: only the weights hashed are read."""
    import torch

    from engine.checkpoint import weights_fingerprint
    try:
        payload = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - not a torch checkpoint: evaluate.py's own refusal names what it is
        return None
    if not (isinstance(payload, dict) and isinstance(payload.get("model"), dict)):
        return None
    return weights_fingerprint(payload["model"])


def move_stale_result(json_path: str, checkpoint: str) -> None:
    """evaluate.py refuses a JSON written for other weights than the checkpoint holds (an earlier best.pt of this
    run, e.g. evaluated by hand mid-training), by an older version without their fingerprint, or that is no result
    file of it (`stale_result`): move it aside with the per-layer maxima files it wrote beside it (which evaluate.py
    would refuse to overwrite), nothing is deleted. Paths are relative to the repository root, where the commands
    run."""
    json_path, checkpoint = (os.path.join(ROOT, p) for p in (json_path, checkpoint))
    reason = stale_result(json_path, checkpoint)
    if reason is not None:
        stamp = datetime.datetime.fromtimestamp(os.path.getmtime(json_path)).strftime("%Y%m%d-%H%M%S")
        stem = os.path.splitext(json_path)[0]
        base, suffix = stamp, 1
        while any(os.path.exists(f"{stem}.{stamp}{end}") for end in (".json", "_act_max.csv", "_act_max.png")):
            suffix += 1  # an earlier move of a file written in the same second: never over it
            stamp = f"{base}.{suffix}"
        moves = [(json_path, f"{stem}.{stamp}.json")] + [
            (f"{stem}_act_max{ext}", f"{stem}.{stamp}_act_max{ext}") for ext in (".csv", ".png")]
        for source, target in moves:
            if os.path.exists(source):
                os.replace(source, target)
        print(f"sweep: {json_path} {reason}; moved to {moves[0][1]} (with its _act_max files)", file=sys.stderr,
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
