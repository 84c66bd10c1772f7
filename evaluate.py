r"""Evaluate a checkpoint: FP accuracy (a language model's perplexity), activation maxima, and fake-quantized
results per pipeline.

    python evaluate.py --checkpoint runs/vit_digits/best.pt                    # repq + percentile, W4A4
    python evaluate.py --checkpoint runs/vit_b_cd/best.pt --quant repq aphq --bits w4a4 w6a6 \
        --out results/vit_b_cd.json data.root=/datasets/imagenet
    torchrun --nproc_per_node=8 evaluate.py --checkpoint runs/vit_b/best.pt data.root=/datasets/imagenet
    python evaluate.py --config configs/pretrain/vit_b.yaml model.pretrained=/weights/deit_base.pth \
        data.root=/datasets/imagenet                                           # a timm model + weights file

Weights are scored as they are: a checkpoint or a `model.pretrained` file that does not fit the model (a classifier
of another size included) is an error, never a model with a new random part. The one change made to them is timm's:
a `model.pretrained` file trained at another image size (a Swin at another window size) has its position table
(relative position bias tables) resampled to the model's grid, with a warning, and the result records it
(e.g. "pos_embed_resampled": "14x14->16x16").
The checkpoint's saved config describes model and data; `key=value` overrides change it (e.g. data.root
on another machine, quant.calib_images=128, quant.repq.round_zero_point=true; training settings, which it does
not read, are refused, data.mixup / cutmix / label_smoothing / repeated_aug among them: --amp is the evaluation's
autocast; so is out_dir: --out names the result). A checkpoint is scored on held-out data only: a data.val_split
that reads its training split (the folder or token file it recorded, or the split of that name under another
data.root), or the data of the weights it was fine-tuned from (their record's trained_on), is refused, as is a
data.train_split that reads the val split where a pipeline draws from it. Quantization always works on a copy of
the model, calibrated on `quant.calib_images` seeded train images (eval transform, or
`quant.calib_transform=train`) or, for a language model, as many seeded train token windows;
APHQ and GPLQ on a classifier draw their own seeded training images and loader (`build_pipeline_data`),
e.g. `--quant aphq gplq quant.aphq.iters=2000 quant.gplq.steps=500` for a quick run (an override of the
options of a pipeline that does not run, quant.aphq.* beside `--quant repq`, is refused, as is quant.calib_*
where no pipeline reads the calibration batch: RTN, APHQ and GPLQ on a classifier, quant.first_last where no
pipeline runs, and the training augmentation, data.scale / reprob / auto_augment and the like, where no pipeline
sees training-transform images; the quant.* settings a --config file changes, and over a --checkpoint its data
settings, are checked as overrides, a weights file's other --config sections are its recipe). Writes one JSON
(default: next to the checkpoint; without one, runs/eval/<model.name>.json), a per-layer activation-max CSV
and plot beside it (the JSON records their paths, sizes and SHA-256: a file at those names that is not the one it
records, e.g. beside a copy of the JSON, is refused and never replaced), and prints a markdown row in the layout of
the paper's tables. A later call adds to that JSON;
maxima over other quant.act_max_extra_modules than it holds are refused unless --recompute, which keeps the old
ones under "history" and their files as <name>_act_max.replaced<N>.csv / .png (also under quant.act_max_csv=false,
so that a later call writes the new maxima's files in their place).
GPLQ's stage 1 trains (a resumable checkpoint beside the JSON): a SIGTERM / SIGINT during it writes that
checkpoint at the next update and exits with code 75; the same command resumes. A signal at any other time ends
the process at once (Ctrl-C: exit code 130); the JSON keeps every result finished so far.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import logging
import os
import sys
import time
from typing import Collection, Optional

import torch

from configs import Config, ConfigError, config_from_dict, config_to_dict, layer_config, load_config
from configs.cli import OneLineParser, add_config_arguments, move_overrides, parse_known, print_config
from configs.loader import (RefusedValueError, device_of_overrides, dotted_settings, get_key, override_keys,
                            read_yaml_file)
from configs.schema import (TRAIN_MODE_MODEL_KEYS, TRAIN_TRANSFORM_ONLY_OVERRIDE_KEYS, DataConfig, ModelConfig,
                            unread_training_settings)
from data import (DataError, build_dataset, build_eval_loader, build_token_eval_loader, build_train_loader,
                  calibration_images, calibration_windows, check_same_data_on_every_rank, dataset_classes,
                  val_fingerprint)
from data.digits import split_indices as digits_split
from data.folder import ClassCountError, check_same_classes, folder_fingerprint
from data.loader import ShortSplitError, check_split_files, same_split_data, split_location, split_reading
from data.text import FINGERPRINT_HEAD_BYTES, ShortTextError, VocabularyError, token_file_fingerprint, token_stream
from engine.checkpoint import (CheckpointError, class_differences, is_run_checkpoint, load_checkpoint,
                               weights_fingerprint)
from engine.eval_results import (BEST_FIELD, STEP_FIELD, EvalResults, ResultsError, check_result_path,
                                 checkpoint_kind)
from engine.snapshots import check_same_weights_on_every_rank
from engine.train_seeds import SEED_FIELD
from engine.run_dir import RunDirError, config_changes, prepare_folder, recipe
from engine.start_weights import EARLIER_TRAINING, ancestors_data, recipe_entries
from engine.distributed import (MainRankWait, OtherRankError, all_reduce, check_main_rank_wait_read,
                                fail_on_every_rank_at_start, failure_on_every_rank, process_group,
                                raise_on_every_rank, run_on_main, whole_number)
from engine.rank_agreement import SAME_SETTINGS_FIX, check_same_settings_on_every_rank
from engine.loop import NonFiniteLossError, NothingScoredError
from engine.precision import describe_precision
from engine.preemption import EXIT_PREEMPTED, Preempted, Preemption, ignore_sigterm_until_exit
from engine.quant_settings import (quant_settings, sees_training_transform, train_folder_fingerprint,
                                   train_mode_settings, training_data)
from engine.result_table import markdown_table, method_name
from engine.tasks import check_model_fits_task, perplexity_text, task_for
from engine.console import console_print
from engine.runinfo import exit_with_error, foreign_log, log_environment, setup_logging, software
from models import ModelError, build_model, input_size, model_input_size, model_label
from models.factory import check_recorded_architecture
from models.hub import hub_data_mismatch
from models.modules import nonfinite_tensors
from models.pretrained import check_weights_file
from engine.act_max import ActivationProbe, check_extra_modules, check_has_blocks, first_not_finite
from quant import PIPELINES, PipelineData, evaluate_quantized, parse_bits
from quant.gplq.pipeline import check_stage1_checkpoint
from quant.pipeline_base import parse_options
from quant.pipeline_data import TooFewImages
from quant.plan import (check_bits, check_model_converts, check_pipelines, evaluation_pipelines, pipeline_options,
                        planned, reads_calibration_batch, too_few_for_a_batch, too_many_train_images,
                        train_image_demands)
from engine.act_max_ownership import (act_max_contents, act_max_paths, check_act_max_files, keep_act_max_files,
                                      save_naming_act_max_files)

log = logging.getLogger("evaluate")


def main(args: argparse.Namespace) -> dict:
    # Everything that can be wrong with the command is checked before any work (config, pipelines, bits,
    # checkpoint vs model, data, the existing result file), so no finished result is lost to a late error.
    try:  # this node's --checkpoint and --config files, read before the ranks meet
        if args.out is not None:  # a folder, the log's name, a log of someone else's: refused before the weights
            # are read and the log opened; the main rank (RANK 0 or unset) is the one that writes the log
            check_out(args.out, whole_number(os.environ.get("RANK", "0")) == 0)
        cfg, payload = resolve_config(args)
        check_inputs(cfg, payload)  # before --out's folder and eval.log are made: a typo leaves no folder
    except Exception as e:  # noqa: BLE001 - raised on this rank after the others know (under torchrun)
        fail_on_every_rank_at_start(e, device_of_overrides(args.overrides))
    wait = MainRankWait(datetime.timedelta(hours=cfg.quant.main_rank_wait_hours), "quant.main_rank_wait_hours")
    with process_group(cfg.train.device, wait) as dist:
        device = dist.device
        # the config as resolved (the overrides are in it), and the flags but the paths (a node's own copies)
        flags = {k: v for k, v in vars(args).items() if k not in ("checkpoint", "config", "out", "overrides")}
        check_same_settings_on_every_rank(  # a checkpoint's config is the base of its settings: a node's copy too
            {**config_to_dict(cfg), "evaluate.py flags": flags}, device,
            f"{SAME_SETTINGS_FIX}, and the same --checkpoint file (its config is the base of the settings)"
            if args.checkpoint else SAME_SETTINGS_FIX)
        with failure_on_every_rank(device, "making the --out folder"):  # on each node (a read-only one: this rank)
            out = written_path(default_out_path(args.checkpoint, cfg.model.name) if args.out is None else args.out)
            check_out(out, dist.is_main)  # the default path too (a folder of that name)
            prepare_folder(os.path.dirname(os.path.abspath(out)), setting="--out")  # default: beside the checkpoint
            open_eval_log(out, dist.is_main)
        log_environment(log, dist)
        # TF32 as torch leaves it (evaluate.py sets no switch): on CUDA the line says what the fp32 math ran at
        log.info("%s", describe_precision(args.amp, device, key="--amp", scaler=False, tf32=""))

        with failure_on_every_rank(device, "loading the weights"):  # each rank reads its own node's files
            model = load_float_model(cfg, payload, args)
            model.to(device).eval()
        # which weights of which file: raw and EMA weights, best.pt and checkpoint.pt give lines and rows alike
        log.info("scoring %s", scored_weights(args, cfg))
        if not payload and (line := hub_data_mismatch(cfg)):  # hub weights scored on other inputs
            log.warning(line)
        if dist.distributed:  # each rank read the weights from its own node's copy of the file
            check_same_weights_on_every_rank(model, args.checkpoint or cfg.model.pretrained, device, dist.rank)
        task = task_for(cfg.data.dataset)
        check_model_fits_task(model, cfg.model.name, cfg.data.dataset)
        check_has_blocks(model, cfg.model.name, "evaluate.py measures them in every evaluation: give it a ViT, DeiT, "
                         "Swin or GPT-2 (a block layout of your own: docs/extending.md)")
        check_extra_modules(model, cfg.quant.act_max_extra_modules)
        check_model_converts(model, cfg)
        img_size = input_size(model)  # a language model: its context in tokens
        with failure_on_every_rank(device, "reading the val split"):
            val_loader = build_val_loader(cfg, args, img_size, dist, payload, task)
        # the val split's images (a token file's head), the same on every rank (each scores its shard of its own
        # copy; one process compares nothing) and named in the result file
        val_print = val_fingerprint(cfg.data, val_loader.dataset)
        check_same_data_on_every_rank(cfg.data, val_print, device, dist.rank)

        def open_results() -> tuple[EvalResults, bool, list, dict, dict]:
            results = EvalResults.open(out, identity(cfg, args, model, len(val_loader.dataset), val_print,
                                                     trained_input_size(payload, task.language)))
            # maxima over other quant.act_max_extra_modules than the file's are another measurement: refused, or
            # with --recompute the file's move to its history (their files aside) instead of being written over
            replaces = results.plan_max_act(cfg.quant.act_max_extra_modules, args.recompute)
            results.check_recompute_read(  # the maxima are measured again by every call
                args.recompute, bool(planned(cfg)), replaces,
                f"activation maxima over other quant.act_max_extra_modules than "
                f"{json.dumps(sorted(cfg.quant.act_max_extra_modules))} to replace (those of the same modules every "
                f"call measures again)")
            # the maxima files there that are the result file's own: the only ones the call replaces
            own = check_act_max_files(results.data, os.path.splitext(out)[0]) if cfg.quant.act_max_csv else {}
            # computed once, now, and recorded with each result: computed again at its writing, a train folder
            # changed during the run would name its new files beside a calibration batch drawn from the old ones
            asked = {name: quant_settings(cfg, name) for name in dict.fromkeys(name for name, _ in planned(cfg))}
            return results, replaces, [(name, bits) for name, bits in planned(cfg)
                                       if results.plan(name, bits, asked[name], args.recompute)], own, asked

        # rank 0's result path, the one file read and written (by rank 0): another node's --out, or its default
        # beside that node's own --checkpoint path, names a path of its own, and run_on_main's labels (which name
        # the file) must be alike on every rank, or the others stop as taking other steps than rank 0
        main_out = run_on_main(lambda: out, "naming the result file", device)
        # read once, on rank 0: ranks that each read the file (while another process writes it, or from a
        # folder that is not shared) could plan different work and then wait for each other forever
        results, replaces_max_act, todo, own_files, asked = run_on_main(open_results, f"reading {main_out}", device)
        for name, bits in planned(cfg):
            if (name, bits) not in todo:
                log.info("%s %s is already in %s with these settings (--recompute runs it again)", name, bits, out)
        reads_batch = any(reads_calibration_batch(name, task.language) for name, _ in todo)
        calib = pipeline_data = error = train_print = None
        try:  # every rank reads the train split itself: one that cannot (a node without a file) ends every rank
            if todo and not task.language:
                train_print = check_train_split(cfg, {name for name, _ in todo}, reads_batch, img_size,
                                                dataset_classes(cfg.data, val_loader.dataset), dist.world_size,
                                                given_quant_keys(args, payload))
            # the calibration batch (seeded: the same whenever it is drawn) is drawn now, so that more images or
            # windows than the train split has (or ids the model cannot embed) are refused before the FP and
            # maxima passes
            with text_of_the_weights(args.checkpoint or cfg.model.pretrained):
                calib = calibration_set(cfg, img_size).to(device) if todo and reads_batch else None

            # APHQ and GPLQ on a classifier draw their own images; a GPLQ stage-1 checkpoint another run left at
            # this result file's path is refused now, not after the FP pass, the maxima and the pipelines planned
            # before it
            pipeline_data = (build_pipeline_data(cfg, img_size, dist.rank, dist.world_size,
                                                 os.path.splitext(out)[0],
                                                 lambda saves: Preemption(device, dist.distributed, saves=saves),
                                                 gplq=any(name == "gplq" for name, _ in todo))
                             if todo and not task.language else None)  # the LM pipelines need the calibration windows
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            error = e
        raise_on_every_rank(error, device, lambda: OtherRankError(
            f"rank {dist.rank}: another rank could not read the training split (its calibration batch or "
            f"images); its output says why"))
        # the split GPLQ's stage 1 trains on, each rank its shard of its node's copy (None alike on every rank where
        # no rank compares: the embedded data sets, one process, no data-parallel pipeline)
        check_same_data_on_every_rank(cfg.data, train_print, device, dist.rank)
        for name, bits in todo:
            if name == "gplq":
                options = parse_options(PIPELINES[name].Options, pipeline_options(cfg, name))
                run_on_main(lambda: check_stage1_checkpoint(model, parse_bits(bits), options, pipeline_data),
                            f"checking the GPLQ stage-1 checkpoint at {bits}", device)

        # FP accuracy in a plain pass (its time is the reference for the quantized evaluations' cost), then
        # the activation maxima in a pass with the probe hooks.
        start = time.perf_counter()
        fp = task.evaluate(model, val_loader, device, args.amp, progress="FP eval")  # under --amp, as quantized ones
        fp_seconds = time.perf_counter() - start
        if task.language:  # whatever --amp is: bf16 ("ppl_bf16", the paper's Table 8 row) and fp32 ("ppl") beside it
            passes = {args.amp: fp}
            for amp in ("none", "bf16"):
                if amp not in passes:
                    passes[amp] = task.evaluate(model, val_loader, device, amp,
                                                progress={"none": "fp32 eval", "bf16": "bf16 eval"}[amp])
            fp = dict(passes["none"], ppl_bf16=passes["bf16"]["ppl"])
        start = time.perf_counter()
        with ActivationProbe(model, extra_modules=cfg.quant.act_max_extra_modules, moments=True) as probe:
            task.evaluate(model, val_loader, device, args.amp, progress="activation maxima")
        act = probe.result(reduce_fn=lambda t: all_reduce(t, op="max"), device=device, sum_fn=all_reduce)
        # the records all-reduced: every rank raises alike
        check_finite_maxima(act.per_layer, args.amp)
        kurtosis = {k.rpartition("_")[2]: v for k, v in act.metrics().items() if "kurtosis" in k}
        max_act = {"module": act.module, "block": act.block, "kurtosis": kurtosis,
                   "seconds": round(time.perf_counter() - start, 3),
                   # modules probed beyond the paper's set: "module" is then the maximum over them too
                   **({"extra_modules": list(cfg.quant.act_max_extra_modules)} if cfg.quant.act_max_extra_modules
                      else {})}
        log.info("FP [%s] %s  max act (module/block) %.2f / %.2f  [%.1fs]", weights_tag(args), score_line(fp),
                 act.module, act.block, fp_seconds)
        listed = {k: v for k, v in (results.data.get("max_act") or {}).items() if k in ("csv", "plot", "digests")}
        if replaces_max_act:  # --recompute over other modules: the old maxima go to history with their files
            # moved aside whatever quant.act_max_csv says now: left in place, a later call writing the maxima would
            # find them listed only in the history and refuse them as foreign, or write over them
            moved = run_on_main(lambda: keep_act_max_files(os.path.splitext(out)[0], listed),
                                f"moving {main_out}'s maxima files aside", device)
            log.info("the maxima over quant.act_max_extra_modules=%s move to the history of %s%s",
                     json.dumps(results.data["max_act"].get("extra_modules", [])), out,
                     "" if not moved else f", their files now at {', '.join(moved.values())}")
            results.retire_max_act(moved)
        # without the files this time, those an earlier call wrote stay listed: still this result file's own (not
        # when its maxima were replaced: those files are of the old ones)
        paths = (act_max_paths(os.path.splitext(out)[0]) if cfg.quant.act_max_csv else
                 {} if replaces_max_act else listed)
        # a classifier's count of images scored: the top-1 is 100 * right / count, which gap_test.py reads exactly
        kept = (("loss", "ppl", "ppl_bf16", "tokens") if task.language
                else ("top1", "top5", "loss", "count", "excluded"))
        # the recipe as trained (the checkpoint's config through the schema, none for a weights file), not as
        # evaluated: evaluation overrides (an APHQ data.scale) are no training setting; and its seed apart from it,
        # so that the readers that average seeds refuse one seed trained twice (engine/train_seeds.py); with the
        # weights the run started from, which its model.pretrained path (no recipe setting) does not tell
        # (engine/start_weights.py: runs fine-tuned from other weights, or from none, are no seeds of one recipe)
        trained = {}
        if payload:
            as_trained = config_from_dict(payload["config"])
            trained = {"recipe": recipe(config_to_dict(as_trained)) | recipe_entries(payload),
                       SEED_FIELD: as_trained.train.seed,
                       # the update its weights are of, and whether they are its run's best validation: seeds'
                       # snapshots of other epochs are no seeds of one evaluation (eval_results.step_difference)
                       **checkpoint_update(payload),
                       # data.root is a path (the recipe leaves it out: it may move): the files the run read under it,
                       # whose val split tables compare with the one scored (result_table.data_root_changed)
                       "trained_data": {"root": as_trained.data.root,
                                        "fingerprint": payload.get("data_fingerprint")},
                       # the software that trained its weights, part by part (a resume under another torch adds
                       # one; engine/runinfo.py trained_software); null: a checkpoint written before the record
                       "trained_software": payload.get("software")}
        # the code and packages of this call, as its log's first line names them: with the float score and maxima
        # it measured, and with each quantized entry it writes (an entry of an earlier call keeps its own)
        scored_with = software()
        results.update(method=method_name(cfg), **trained,
                       fp={k: fp[k] for k in kept if k in fp} |
                       {"seconds": round(fp_seconds, 3)}, max_act=max_act | paths, software=scored_with)
        # the JSON names the maxima files (and their digests) before they are written, so that a second evaluate.py
        # adding to this result file meanwhile knows them as this file's (check_act_max_files) and does not refuse
        # them; a save or write that fails or is interrupted leaves the JSON naming only files that are there as it
        # records them (save_naming_act_max_files)
        title = f"{model_label(cfg.model)} ({method_name(cfg)})"
        # maxima over other modules that another evaluate.py writes to the file meanwhile go aside as those planned
        keep = lambda listed: keep_act_max_files(os.path.splitext(out)[0], listed)
        run_on_main(lambda: save_naming_act_max_files(
            results, act_max_contents(act.per_layer, title) if cfg.quant.act_max_csv else None, paths, keep,
            own_files), f"writing {main_out}" + (
                f", {act_max_paths(os.path.splitext(main_out)[0])['csv']} / .png" if cfg.quant.act_max_csv else ""),
            device)

        # Quantized accuracy: every pipeline at every bit-width, each on a fresh copy of the float model, each
        # written to the JSON as soon as it is done.
        for name, bits in todo:
            entry = evaluate_quantized(
                name, model, calib, bits, options=pipeline_options(cfg, name), data=pipeline_data,
                eval_fn=lambda m: task.evaluate(m, val_loader, device, args.amp, progress=f"{name} {bits}"))
            entry["eval_vs_fp"] = round(entry["eval_seconds"] / max(fp_seconds, 1e-9), 2)
            entry["software"] = scored_with
            results.add(name, bits, entry, asked[name])  # the settings planned (open_results)
            run_on_main(lambda: results.save(keep), f"writing {main_out}", device)
            log.info("%s %s %s  [quantize %.1fs, eval %.1fs = %.2fx FP eval]", name, bits, score_line(entry),
                     entry["quantize_seconds"], entry["eval_seconds"], entry["eval_vs_fp"])

        if dist.is_main:
            console_print(markdown_table([results.data]))  # its † and ± on an ASCII console, or a closed pipe
            log.info("wrote %s", out)
    return results.data


def checkpoint_update(payload: dict) -> dict:
    """{STEP_FIELD: the update of training a train.py checkpoint's weights are of (its state.step; a snapshot's,
    best.pt's and checkpoint.pt's alike), or None where the file records none; BEST_FIELD: whether they are its
    run's best validation weights, as its state shows: state.best_step is that update and state.best_fingerprint
    the fingerprint of its raw weights (best.pt, and a copy of it under any name or set aside as
    best.until_step<N>.pt, whose kind is "other": engine/eval_results.step_difference)}."""
    state = payload.get("state")
    state = state if isinstance(state, dict) else {}
    step = state.get("step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    # the fingerprint only where the update matches: hashing the weights again costs a pass over them
    best = (step is not None and state.get("best_step") == step and state.get("best_fingerprint") is not None
            and isinstance(payload.get("model"), dict)
            and state["best_fingerprint"] == weights_fingerprint(payload["model"]))
    return {STEP_FIELD: step, BEST_FIELD: best}


def check_inputs(cfg: Config, payload: Optional[dict]) -> None:
    """The files the evaluation reads, as far as their listing refuses them, on each rank its node's: a weights file
    (model.pretrained without --checkpoint, which resolve_config has read) that is not there, and the val split under
    data.root (its folder and class folders, or its token file's size and first ids: check_split_files). Asked
    before --out's folder and eval.log are made; load_float_model and build_val_loader read them in full."""
    if not payload and cfg.model.pretrained != "hub":
        check_weights_file(cfg.model.pretrained)
    check_split_files(cfg.data, "val")


def check_out(out: str, writes_log: bool) -> None:
    """Refuse a result path that names a folder (engine.eval_results.check_result_path), the log's own name (the
    log, opened first, would be the file the result is refused by) or a file not named *.json, and, on the process
    that writes the log (`writes_log`), an EVAL_LOG beside it (beside the file a symlink names: the log the command
    writes) that is no log (a file of the user's: evaluate.py appends to its own log of earlier calls, not to notes
    it would bury under its lines); all are told before any work."""
    check_result_path(out, "--out")
    written = written_path(out)  # a link's file: the log is written beside it, not beside the link
    if os.path.basename(written) == EVAL_LOG:
        raise RunDirError(f"--out {out}: evaluate.py writes its log to {EVAL_LOG} in the result's folder; give "
                          f"the result another name (e.g. eval.json)")
    if os.path.splitext(written)[1] != ".json":  # <stem>_act_max.csv is read back with <stem>.json (compare_act_max.py)
        raise RunDirError(f"--out {out}: evaluate.py writes a JSON result whose name ends in .json (its maxima files "
                          f"are named after it, and compare_act_max.py finds it by that name beside them); give e.g. "
                          f"--out {os.path.splitext(written)[0]}.json")
    log_path = os.path.join(os.path.dirname(os.path.abspath(written)), EVAL_LOG)
    if writes_log and (why := foreign_log(log_path)):
        raise RunDirError(f"--out {out}: evaluate.py writes its log to {log_path}, which is not evaluate.py's log "
                          f"({why}); move that file away, or give --out a file in another folder")


def written_path(out: str) -> str:
    """The file evaluate.py writes for the result path `out`: the file a symlink names, so that the JSON, its
    maxima CSV and plot and eval.log all lie beside it (the link kept as it is); `out` itself else. A loop of
    links names no file: one RunDirError (written as a file, the last link of the loop would be replaced)."""
    if not os.path.islink(out):
        return out
    target = os.path.realpath(out)
    if os.path.islink(target):  # realpath stops where links go round
        raise RunDirError(f"--out {out} is a link that never reaches a file (a loop of links); remove it or choose "
                          "another --out")
    return target


def open_eval_log(out: str, is_main: bool) -> None:
    """The log (EVAL_LOG beside the result `out`), or one RunDirError naming it and --out: the folder was found
    writable (prepare_folder), but the log's own name may be taken by a folder, or by a file this user cannot
    write."""
    folder = os.path.dirname(os.path.abspath(out))
    try:
        setup_logging(folder, is_main, filename=EVAL_LOG)
    except OSError as e:
        raise RunDirError(f"--out {out}: evaluate.py writes its log to {os.path.join(folder, EVAL_LOG)}, which "
                          f"cannot be opened ({e.strerror or e}); move it away, or give --out a file in another "
                          f"folder") from None


def build_val_loader(cfg: Config, args: argparse.Namespace, img_size: int, dist, payload: Optional[dict], task):
    """The val split, sharded across ranks: token windows of the model's context for a language model (its
    characters must be those the checkpoint was trained on), images else (its classes likewise)."""
    if task.language:
        stream = token_stream(cfg.data, "val")
        # the kind of text first: ids of another kind are not a vocabulary to widen (model.num_classes)
        check_vocabulary_kind(payload, stream.vocab, args.checkpoint or cfg.model.pretrained, cfg.data.dataset)
        check_classes(payload, stream.vocab, args.checkpoint)
        with text_of_the_weights(args.checkpoint or cfg.model.pretrained):
            return build_token_eval_loader(cfg.data, stream, context=img_size,
                                           batch_size_per_gpu=cfg.train.eval_batch_size_per_gpu, rank=dist.rank,
                                           world_size=dist.world_size, vocab_size=cfg.model.num_classes)
    try:
        loader = build_eval_loader(cfg.data, img_size=img_size, batch_size_per_gpu=cfg.train.eval_batch_size_per_gpu,
                                   rank=dist.rank, world_size=dist.world_size, num_classes=cfg.model.num_classes)
    except ClassCountError as e:  # the weights fit model.num_classes (they loaded): the data is the odd one
        weights = args.checkpoint or cfg.model.pretrained
        where = f" of {cfg.data.root}" if cfg.data.root else ""
        raise DataError(f"the {cfg.data.dataset} {cfg.data.val_split} split{where} has {e.found} classes, "
                        f"{weights} was trained on {cfg.model.num_classes}: point data.root at the data set "
                        f"it was trained on, or fine-tune it first (train.py model.pretrained={weights})"
                        ) from None
    check_classes(payload, dataset_classes(cfg.data, loader.dataset), args.checkpoint, cfg.data.dataset)
    return loader


@contextlib.contextmanager
def text_of_the_weights(weights: str):
    """Ids past the vocabulary of weights that loaded (their model.num_classes) are text of another tokenizer:
    check_vocabulary's advice to raise model.num_classes (train.py's) would only make the weights not fit; so
    would TokenWindows' advice of a shorter context for a text shorter than one window."""
    try:
        yield
    except VocabularyError as e:
        raise DataError(f"{e.problem}, the ids {weights} was trained on: point data.root at the token files it was "
                        "trained on (their tokenizer)") from None
    except ShortTextError as e:  # the weights' position embeddings fix the context: a shorter one does not load
        raise DataError(f"{e.problem}, the context {weights} was trained with: point data.root (data.train_split, "
                        "data.val_split) at token files of at least one window") from None


def score_line(metrics: dict) -> str:
    """'top-1 81.630  top-5 95.700' or 'perplexity 23.70 (bf16 23.71)' for the log."""
    if "ppl" in metrics:
        bf16 = f" (bf16 {perplexity_text(metrics['ppl_bf16'])})" if "ppl_bf16" in metrics else ""
        return f"perplexity {perplexity_text(metrics['ppl'])}{bf16}"
    top5 = f"  top-5 {metrics['top5']:.3f}" if "top5" in metrics else ""
    return f"top-1 {metrics['top1']:.3f}{top5}"


def scored_weights(args: argparse.Namespace, cfg: Config) -> str:
    """The weights scored, for the log: 'the EMA weights of /runs/x/best.pt (checkpoint_kind best)', or
    'model.pretrained=/weights/deit_base.pth' (the result file records the same: checkpoint, checkpoint_kind,
    weights)."""
    if not args.checkpoint:
        return f"model.pretrained={cfg.model.pretrained}"
    return (f"the {'EMA' if args.ema else 'raw'} weights of {os.path.abspath(args.checkpoint)} "
            f"(checkpoint_kind {checkpoint_kind(args.checkpoint)})")


def weights_tag(args: argparse.Namespace) -> str:
    """The weights scored in short, for the FP line: 'best, EMA', 'latest, raw' (checkpoint_kind and raw / EMA)
    or 'model.pretrained'."""
    return f"{checkpoint_kind(args.checkpoint)}, {'EMA' if args.ema else 'raw'}" if args.checkpoint \
        else "model.pretrained"


def a_pipeline_trains(cfg: Config) -> bool:
    """Whether a pipeline of the run trains the model (GPLQ's stage 1): only then do dropout settings act."""
    return any(PIPELINES[name].trains_model for name in cfg.quant.pipelines or ())


def eval_model_config(model: ModelConfig) -> ModelConfig:
    """`model` to build for evaluation only (eval mode throughout): without dropout or stochastic depth, which
    act in training only; a model that has none (timm's VGG, GhostNet, ...) refuses a model.drop_path above 0."""
    return dataclasses.replace(model, drop=0.0, drop_path=0.0)


def load_float_model(cfg: Config, payload: Optional[dict], args: argparse.Namespace,
                     trains: Optional[bool] = None) -> torch.nn.Module:
    """The float model: checkpoint weights (raw or EMA), or a timm model with model.pretrained weights. `trains`:
    whether what runs on it trains it (GPLQ's stage 1), so that its dropout rates act; None: a_pipeline_trains."""
    if payload:  # softmax1 has no parameters of its own: only the config tells it from softmax
        trained = payload["config"].get("model", {}).get("attn", "softmax")
        if trained != cfg.model.attn:
            raise CheckpointError(f"{args.checkpoint} was trained with model.attn={trained}; drop the "
                                  f"model.attn={cfg.model.attn} override")
    # dropout and stochastic depth act in training only: unless a pipeline trains (GPLQ's stage 1), the model is
    # built without them (eval mode's DropPath / Dropout are the identity: the same outputs), so a run recorded with
    # a rate this code places otherwise, or refuses for its model (model.drop), still evaluates, and so does a model
    # without stochastic depth (vgg, ghostnet) whose config carries the schema's model.drop_path default
    trains = a_pipeline_trains(cfg) if trains is None else trains
    built = cfg.model if trains else eval_model_config(cfg.model)
    # a weights file or the hub's is evaluated only as it is (strict: never with a new classifier)
    model = build_model(dataclasses.replace(built, pretrained="") if payload
                        else dataclasses.replace(built, pretrained_strict=True))
    if payload:
        key = "model_ema" if args.ema else "model"
        if key not in payload:
            raise CheckpointError(f"{args.checkpoint} has no '{key}' weights" +
                                  (" (it was trained without train.ema=true); drop --ema to score its raw weights"
                                   if args.ema else ""))
        own, saved = model.state_dict(), payload[key]
        missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
        shapes = [k for k in saved if k in own and getattr(saved[k], "shape", None) != own[k].shape]
        if missing or unexpected or shapes:
            raise CheckpointError(f"{args.checkpoint} does not fit model {model_label(cfg.model)!r}: "
                                  f"missing {missing[:4]}, unexpected {unexpected[:4]}, "
                                  f"other shapes {shapes[:4]}; evaluate it with the model settings it was "
                                  f"trained with (drop the model.* overrides)")
        # shapes alone do not tell a 2-head model from a 4-head one: the config it records does
        check_recorded_architecture(config_from_dict(payload["config"]).model, model, args.checkpoint)
        model.load_state_dict(saved)
    bad = nonfinite_tensors(model.state_dict())  # every number computed from them would be meaningless
    if bad:
        raise CheckpointError(f"{args.checkpoint or cfg.model.pretrained}: {len(bad)} tensor(s) hold NaN or inf "
                              f"values, e.g. {'; '.join(bad[:3])}; nothing was evaluated or written: "
                              f"evaluate an earlier checkpoint of the run")
    return model


def check_vocabulary_kind(payload: Optional[dict], val_vocab: Optional[list], weights: str, dataset: str) -> None:
    """A language model's val text must be encoded as it was trained: characters (with the same vocabulary,
    `check_classes`) or token ids. Weights without a checkpoint's record (model.pretrained: GPT-2's, nanoGPT's)
    count as trained on token ids."""
    trained = (payload or {}).get("classes")
    if (trained is None) != (val_vocab is None):
        kind = lambda vocab: f"{len(vocab)} characters" if vocab is not None else "token ids"
        record = "" if payload else (" (a train.py checkpoint records its characters: give it as --checkpoint, "
                                     "not model.pretrained)")
        raise DataError(f"{weights} was trained on {kind(trained)}, data.dataset={dataset} gives {kind(val_vocab)}: "
                        f"id i would mean another symbol. Evaluate it on the kind of text it was trained on{record}")


def check_classes(payload: Optional[dict], val_classes: Optional[list], checkpoint: Optional[str],
                  dataset: str = "") -> None:
    """The val folder must name the classes the checkpoint was trained on, in the same order; a checkpoint that
    records its classes is not scored on a val set without any (synthetic images: noise with random labels, whose
    top-1 is chance whatever the weights learned)."""
    trained = (payload or {}).get("classes")
    if trained and val_classes is None:
        raise DataError(f"{checkpoint} was trained on {len(trained)} classes ({', '.join(map(str, trained[:3]))}"
                        f"{', ...' if len(trained) > 3 else ''}), data.dataset={dataset} has none (random images "
                        f"and labels): its score would be chance. Evaluate it on the data set it was trained on")
    different = class_differences(trained, val_classes)
    if different:
        raise DataError(f"the val split's classes differ from those {checkpoint} was trained on "
                        f"({different}): label i would name another class. Point data.root at the data set it "
                        f"was trained on")


def trained_input_size(payload: Optional[dict], language: bool) -> Optional[int]:
    """The input size a checkpoint's run trained at: its config's model built on the meta device (no weights, no
    memory; model.img_size null is the model's own size), or None for a weights file or a language model."""
    if payload is None or language:
        return None
    return model_input_size(config_from_dict(payload["config"]).model)


def identity(cfg: Config, args: argparse.Namespace, model: torch.nn.Module, images: int,
             val_print: Optional[dict], trained_size: Optional[int] = None) -> dict:
    """What the numbers of one result file are numbers of (engine/eval_results.py). A folder data set's val
    images are named by their count and the SHA-256 of their names (`val_names`, from `val_print`:
    data.loader.val_fingerprint): a val folder re-exported at the same path with as many other images is another
    evaluation. A model.pretrained file's resampled position tables are named with both grids
    (`pos_embed_resampled`, `relative_position_bias_resampled`)."""
    checkpoint = os.path.abspath(args.checkpoint) if args.checkpoint else cfg.model.pretrained
    return {"model": model_label(cfg.model), "model_kwargs": _plain_kwargs(cfg.model.kwargs),
            # a checkpoint scored at another input size than it trained at (model.img_size given at evaluation:
            # Swin's tables keep their shapes, so the weights load) is marked, as model.kwargs are
            # (engine/result_table.evaluated_otherwise); None: at its own size, or a weights file
            "img_size_changed": (f"{input_size(model)} (trained at {trained_size})"
                                 if trained_size is not None and trained_size != input_size(model) else None),
            "checkpoint": checkpoint,
            # best.pt / checkpoint.pt / a snapshot: seeds of other kinds are not averaged (evaluation_difference)
            "checkpoint_kind": checkpoint_kind(args.checkpoint, pretrained=not args.checkpoint),
            "weights": "ema" if args.ema else "raw",
            "fingerprint": weights_fingerprint(model.state_dict()), "eval_amp": args.amp, "images": images,
            # a model.pretrained file's position tables that timm resampled to the model's grid (models/pretrained.py)
            **getattr(model, "pretrained_resampled", {}),
            **({"val_names": val_print[cfg.data.val_split]["names_sha256"]} if cfg.data.dataset == "folder" else {}),
            "data": data_identity(cfg.data, input_size(model))}


def data_identity(data: DataConfig, img_size: int) -> dict:
    """The data a result's numbers are of, as its file records it (its "data"): the data set, its val split, and each
    setting of engine.run_dir.VALIDATION_KEYS that the data set reads (configs/loader.py READ_ONLY_WHEN), which the
    tables compare with the run's recipe (engine/result_table.data_changed: † where another). `img_size`: the
    model's input size (a language model: its context)."""
    if task_for(data.dataset).language:
        return text_identity(data)
    return {"dataset": data.dataset,
            "root": os.path.abspath(data.root) if data.root else "",
            "val_split": data.val_split,
            # the synthetic val split is that many seeded images (data/synthetic.py): another count is another set
            **({"synthetic_val_size": data.synthetic_val_size} if data.dataset == "synthetic" else {}),
            # what the val images look like to the model: a data.crop_pct override is another evaluation, never
            # merged with results of the recipe's crop
            "eval_transform": {"img_size": img_size, "crop_pct": data.crop_pct, "crop_mode": data.crop_mode,
                               "interpolation": data.interpolation, "mean": list(data.mean), "std": list(data.std),
                               **({"digits_img_size": data.digits_img_size,
                                   "digits_val_fraction": data.digits_val_fraction}
                                  if data.dataset == "digits" else {})}
            if data.dataset != "synthetic" else {}}


def text_identity(data) -> dict:
    """Which text a language model's numbers are of: the token files (root, val split, the number of val
    windows, and the val file's content: nanoGPT's prepare.py rewrites val.bin in place, and results of the old
    text must not stand beside numbers of the new) or the embedded King James Bible's split (its val fraction);
    the image settings play no part."""
    text = {"dataset": data.dataset, "val_windows": data.val_windows}
    if data.dataset == "tokens":
        return {**text, "root": os.path.abspath(data.root), "val_split": data.val_split,
                "val_file": token_file_fingerprint(data, "val")}
    return {**text, "kjv_val_fraction": data.kjv_val_fraction}


def _plain_kwargs(kwargs: dict) -> dict:
    """model.kwargs (e.g. global_pool=avg: same weights, other outputs) as the result file stores them."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(kwargs.items())}


def calibration_set(cfg: Config, img_size: int) -> torch.Tensor:
    """The calibration batch: `quant.calib_images` seeded train images with the transform
    `quant.calib_transform` names, or for a language model as many seeded train windows of its context
    (`img_size`)."""
    if task_for(cfg.data.dataset).language:
        return calibration_windows(cfg.data, img_size, cfg.quant.calib_images, cfg.quant.calib_seed,
                                   cfg.model.num_classes)
    return calibration_images(cfg.data, img_size, cfg.model.num_classes, cfg.quant.calib_images,
                              cfg.quant.calib_seed, train_transform=cfg.quant.calib_transform == "train")


def check_train_split(cfg: Config, pipelines: set, reads_batch: bool, img_size: int,
                      val_classes: Optional[list], world_size: int = 1, given: Collection[str] = ()) -> Optional[dict]:
    """The images the planned pipelines draw from the training split (the calibration batch, APHQ's and GPLQ's
    own) and the batch of GPLQ's training loader on each of `world_size` processes, against the split's size, and
    its classes against the val split's (which are the checkpoint's; GPLQ trains on the split's labels): before
    the FP and maxima passes, not after them. `given`: the quant.* keys the command set (`given_quant_keys`), whose
    counts from one epoch of that loader are checked even at their default (which is capped there).

    Returns the split's fingerprint (data.loader's, a folder's images) where a pipeline of `pipelines` trains on
    every rank's shard of its own node's copy (GPLQ's stage 1, data parallel) under several processes, for the
    ranks to compare (check_same_data_on_every_rank): a node's copy of other images would be trained on under rank
    0's name, and one of another size gives its rank other updates than the others' (their collectives no longer
    pair up: gloo aborts); None otherwise (the other pipelines read rank 0's copy alone)."""
    wanted = train_image_demands(cfg, pipelines, reads_batch)
    if not wanted:
        return None
    train = build_dataset(cfg.data, "train", img_size, cfg.model.num_classes, train_transform=False)
    if cfg.data.dataset == "folder":  # label i must name one class in both (the counts agree: build_dataset)
        check_same_classes(dataset_classes(cfg.data, train), val_classes, cfg.data.root)
    too_many = (too_many_train_images(wanted, len(train), cfg.data.train_split)
                or too_few_for_a_batch(cfg, pipelines, len(train), cfg.data.train_split, world_size, given))
    if too_many:
        raise DataError(too_many)
    if cfg.data.dataset != "folder" or world_size == 1 or not any(PIPELINES[p].data_parallel for p in pipelines):
        return None
    return {cfg.data.train_split: folder_fingerprint(train)}


# the settings of no one pipeline's section, each with whether a pipeline (of a language model or not) reads it:
# the calibration batch's where the pipeline calibrates on it, the stem and head bit-widths wherever one runs
SHARED_KEYS = {**dict.fromkeys(("quant.calib_images", "quant.calib_seed", "quant.calib_transform"),
                               reads_calibration_batch),
               "quant.first_last": lambda pipeline, language: True}


def calibration_overrides_unread(overrides: list[str], pipelines: list[str], language: bool) -> list[str]:
    """The overrides of settings that no one pipeline's section holds (`SHARED_KEYS`) when none of `pipelines` reads
    them: the calibration batch's (quant.calib_*) where none reads it, quant.first_last where none runs; []
    otherwise."""
    return [item for item in overrides if any(key in SHARED_KEYS and not any(SHARED_KEYS[key](p, language)
                                                                             for p in pipelines)
                                              for key in override_keys(item))]


def train_transform_overrides_unread(overrides: list[str], cfg: Config) -> list[str]:
    """The overrides of the training transform's own settings (not those the eval transform shares) when no
    planned pipeline sees training-transform images: [] otherwise."""
    if any(sees_training_transform(cfg, p) for p in cfg.quant.pipelines):
        return []
    return [item for item in overrides if any(k in TRAIN_TRANSFORM_ONLY_OVERRIDE_KEYS for k in override_keys(item))]


def interpolation_override_unread(overrides: list[str], cfg: Config, recorded: Optional[dict]) -> Optional[str]:
    """The data.interpolation override when no image of this evaluation is resampled with it, else None: on digits
    (DigitsDataset resizes to data.digits_img_size with bicubic, whatever the setting) whose eval transform does not
    resample (`eval_transform_resamples`), with no planned pipeline that sees training-transform images (their random
    crop resamples with it). As in the data.crop_mode refusal on digits (configs/loader.py), the setting reads as
    applied where it is not. The checkpoint's own value (`recorded`, its data section: a sweep passes a run's data
    overrides on) changes nothing and passes."""
    given = [item for item in overrides if "data.interpolation" in override_keys(item)]
    if not given or cfg.data.dataset != "digits":
        return None
    if recorded is not None and cfg.data.interpolation == recorded.get("interpolation", DataConfig().interpolation):
        return None
    if any(sees_training_transform(cfg, p) for p in cfg.quant.pipelines):
        return None
    return None if eval_transform_resamples(cfg.data, model_input_size(cfg.model)) else given[-1]


def eval_transform_resamples(data: DataConfig, img_size: int) -> bool:
    """Whether the eval transform (resize to img_size / crop_pct, center crop to img_size) resamples a
    data.digits_img_size image, told by what it does: one random image of that size through it under two filters
    (nearest, bicubic) gives other pixels wherever a resize acts."""
    import numpy as np
    from PIL import Image

    from data.transforms import build_transform

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (data.digits_img_size,) * 2 + (3,),
                                                              dtype=np.uint8))
    nearest, bicubic = (build_transform(dataclasses.replace(data, interpolation=filter_), img_size,
                                        is_training=False)(image) for filter_ in ("nearest", "bicubic"))
    return nearest.shape != bicubic.shape or not torch.equal(nearest, bicubic)


class ShortTrainImages(DataError, TooFewImages):
    """A train split short of the images APHQ or GPLQ asks for: a user's error (one `error:` line), which the
    pipeline's draw names by its setting (quant.pipeline_data.PipelineData.draw_train_images)."""


def build_pipeline_data(cfg: Config, img_size: int, rank: int, world_size: int,
                        work_prefix: str, preemption=None, gplq: bool = True) -> PipelineData:
    """Training data for pipelines that draw their own images (APHQ, GPLQ; see quant/pipeline_data.py).

    train_images: seeded train-split images (training or eval transform), the same on every rank.
    train_loader: this rank's shard of the train split with the training transform (no repeated
    augmentation; mixup/cutmix are never applied by pipelines). work_prefix: where GPLQ keeps its
    resumable stage-1 checkpoint (next to the output JSON). preemption: (checkpoint path) -> a Preemption
    (engine/preemption.py) that GPLQ stage 1 alone opens, so that a signal there saves its checkpoint; None:
    signals keep their default effect. gplq: whether GPLQ may run on it, whose stage-1 identity names a folder
    split's files (`identity`: a walk of the split, which the other pipelines do not need).
    """
    def train_images(count: int, seed: int, train_transform: bool) -> torch.Tensor:
        try:  # a split short of readable images (known only now) is refused under the quant.* setting that asked
            return calibration_images(cfg.data, img_size, cfg.model.num_classes, count, seed,
                                      train_transform=train_transform, key="the pipeline's training images")
        except ShortSplitError as e:
            raise ShortTrainImages(e.reason) from None

    def train_loader(batch_size_per_gpu: int, seed: int):
        train = build_train_loader(dataclasses.replace(cfg.data, repeated_aug=0), img_size=img_size,
                                   batch_size_per_gpu=batch_size_per_gpu, rank=rank, world_size=world_size,
                                   seed=seed, num_classes=cfg.model.num_classes)
        return train

    # the split's files, not its name alone: GPLQ's stage-1 checkpoint of the split exported again under its path
    # (other images) is another run's
    files = ({"train_files": train_folder_fingerprint(cfg.data.root, cfg.data.train_split)}
             if gplq and cfg.data.dataset == "folder" and cfg.data.root else {})
    return PipelineData(train_images=train_images, train_loader=train_loader, work_prefix=work_prefix,
                        identity={**training_data(cfg), **files, "model_training": train_mode_settings(cfg)},
                        preemption=preemption)


def checkpoint_config(payload: dict, checkpoint: str) -> Config:
    """The config `checkpoint` records, through this version's schema. A key the schema does not know (a setting a
    newer version of the code added) or a value it refuses is an error naming the file: the schema's own error
    names only a 'saved config', which the user cannot find. A refused value (e.g. a data.mean on the 0..255 scale,
    which versions before the check accepted) is no sign of a newer version, and --config files and overrides are
    applied to the recorded config once it has passed: one of that key cannot replace the recorded value."""
    try:
        return config_from_dict(payload["config"])
    except RefusedValueError as e:
        raise CheckpointError(f"{checkpoint}: its recorded {e.key} is refused by this version's checks ({e}); "
                              f"--config files and overrides, of {e.key} too, apply only to a recorded config that "
                              f"passes them, so none can replace the recorded value: evaluate the checkpoint with the "
                              f"version of the code that trained it") from None
    except ConfigError as e:
        raise CheckpointError(f"{checkpoint}: its recorded config does not fit this version of the code ({e}); "
                              f"written by a newer version of the code? Evaluate it with the version that "
                              f"trained it") from None


def resolve_config(args: argparse.Namespace, recorded_quant: Optional[dict] = None):
    """Config and checkpoint payload: the checkpoint's own config (+ overrides), or --config files.

    recorded_quant: the quant section the checkpoint's config will hold when the command runs, in place of the one
    it holds now (scripts/sweep.py: a run's train.py records the run's quant.* in its best.pt before the sweep
    evaluates it, engine.checkpoint.record_quant_settings)."""
    payload, saved = None, None
    if args.checkpoint:
        payload = load_checkpoint(args.checkpoint)
        if recorded_quant is not None and isinstance(payload, dict) and isinstance(payload.get("config"), dict):
            payload = {**payload, "config": {**payload["config"], "quant": recorded_quant}}
        # --config: e.g. a data preset for another machine
        saved = checkpoint_config(payload, args.checkpoint)  # parsed once: cfg is built on a copy
        cfg = layer_config(copy.deepcopy(saved), args.config or (), args.overrides)
        check_checkpoint_settings(payload["config"], cfg, args.checkpoint, payload.get("data_fingerprint"),
                                  ancestors_data(payload))
        # what --config files and overrides changed ('key: old -> new'): its method is the checkpoint's own
        changed = [change.split(": ", 1)[0] for change in config_changes(config_to_dict(saved), config_to_dict(cfg))]
    else:
        cfg = load_config(args.config or [], args.overrides)
        if not cfg.model.pretrained:
            raise ConfigError("nothing to evaluate: give --checkpoint, or model.pretrained=/path/to/weights "
                              "(with --config for the model and data)")
        if os.path.isfile(cfg.model.pretrained) and is_run_checkpoint(cfg.model.pretrained):
            # as a weights file its recorded settings would go unchecked: the classes it was trained on, its
            # attention variant (softmax1 has no parameters to tell it by), its kind of text
            raise ConfigError(f"model.pretrained={cfg.model.pretrained} is a checkpoint of train.py: give it as "
                              f"--checkpoint {cfg.model.pretrained}, which evaluates it with the settings it "
                              f"records (its config, classes and, with --ema, its EMA weights)")
        if args.ema:  # models/pretrained.py reads a weights file's own entry (timm's 'state_dict' / 'model')
            raise ConfigError(f"--ema: it scores the EMA weights of a train.py --checkpoint; model.pretrained="
                              f"{cfg.model.pretrained} is loaded as its plain weights, never an EMA copy in the file: "
                              f"drop --ema, or save the EMA weights as a file of their own and give that as "
                              f"model.pretrained")
    given = {key for item in args.overrides for key in override_keys(item)}  # quant={pipelines: [..]} too
    # a weights file's --config files are its recipe (cd / tweo name its method): its overrides are checked
    unread = unread_training_settings(sorted(given | set(changed if payload else ())), method_read=not payload)
    if unread:
        key = unread[0]
        raise ConfigError(f"{key}: evaluate.py does not read training settings"
                          + (f" ({args.checkpoint} is named by the cd / tweo settings it was trained with)"
                             if key.startswith(("cd.", "tweo.")) else "")
                          + ("; for an evaluation under autocast give --amp" if key == "train.amp" else "")
                          + ("; drop it" if key in given else  # else a --config file over the checkpoint's set it
                             f"; --config {' '.join(args.config or ())} sets it over {args.checkpoint}'s own: "
                             "give --config files of evaluation settings only (e.g. data), or key=value overrides"))
    check_out_dir_unread(args, cfg, given, saved)
    if "model.pretrained_strict" in given and not cfg.model.pretrained_strict:  # asked, and never done here
        raise ConfigError("model.pretrained_strict=false: evaluate.py loads weights only as they are (a "
                          "classifier of another size is refused, not replaced); drop it, or fine-tune "
                          "with train.py first")
    if args.bits == []:  # `--bits` with no value (an empty shell variable): unlike `--quant`'s, no asked meaning
        own = "; ".join(f"{name} {p.default_bits}" for name, p in PIPELINES.items())
        raise ConfigError(f"--bits names no bit-width: name them (e.g. --bits w4a4 w8a8), or give quant.bits=[] "
                          f"for each pipeline's own ({own})")
    # quant settings that --config files change count as given too: --quant / --bits would replace the file's
    # quant.pipelines / quant.bits without a word
    from_files = config_file_items(args.config or (), payload, "quant.")
    filed = {override_keys(item)[0]: path for item, path in from_files.items()}
    for flag, key, value in (("--quant", "quant.pipelines", args.quant), ("--bits", "quant.bits", args.bits)):
        if value is not None and key in given:  # one of the two would be ignored
            raise ConfigError(f"{flag} and {key}= both say what to run: give one of them")
        if value is not None and key in filed:
            raise ConfigError(f"{flag} and {key} (--config {filed[key]}) both say what to run: give one of them")
    if args.quant is not None:
        cfg.quant.pipelines = list(args.quant)
    if args.bits is not None:
        cfg.quant.bits = list(args.bits)
    task = task_for(cfg.data.dataset)
    defaulted = cfg.quant.pipelines is None  # the task's own pipelines: the user named none of them
    cfg.quant.pipelines = evaluation_pipelines(cfg)
    check_pipelines(cfg, task)
    dropout = sorted(k for k in given | set(changed if payload else ()) if k in TRAIN_MODE_MODEL_KEYS)
    if dropout and not a_pipeline_trains(cfg):  # all in eval mode
        raise ConfigError(f"{dropout[0]} would be ignored: dropout and stochastic depth act in training only, and "
                          f"of evaluate.py's passes only GPLQ's stage 1 trains (pipelines: "
                          f"{', '.join(cfg.quant.pipelines) or 'none'}); drop it")
    # and so, over a checkpoint, do their data settings (there the files are layers of evaluation settings, e.g.
    # data.root; a weights file's --config files are its recipe, whose training-transform keys are not refused);
    # `named` says where such an item comes from
    items = [*args.overrides, *from_files]
    data_from_files = config_file_items(args.config or (), payload, "data.") if payload else {}
    data_items = [*args.overrides, *data_from_files]
    data_files = {override_keys(item)[0]: path for item, path in data_from_files.items()}
    named = {item: f"{item} (--config {path})" for item, path in {**from_files, **data_from_files}.items()}
    # how long the other ranks of a torchrun evaluation wait for rank 0's work (run_on_main): one process waits for
    # no one (run_on_main calls the work directly, no wait group is made)
    waits = [item for item in items if "quant.main_rank_wait_hours" in override_keys(item)]
    if waits:
        check_main_rank_wait_read(named.get(waits[0], waits[0]))
    unread = pipeline_options_unread(items, cfg.quant.pipelines)
    if unread:  # e.g. quant.aphq.iters=500 beside --quant repq: the result would not be what the user tuned
        item, pipeline = unread[0]
        raise ConfigError(f"{named.get(item, item)} would be ignored: it sets options of {pipeline}, which this "
                          f"evaluation does not run (pipelines: {', '.join(cfg.quant.pipelines) or 'none'}); add "
                          f"{pipeline} to --quant / quant.pipelines, or drop it")
    batch = calibration_overrides_unread(items, cfg.quant.pipelines, task.language)
    if batch and not cfg.quant.pipelines:  # quant.first_last is read wherever a pipeline runs
        raise ConfigError(f"{named.get(batch[0], batch[0])} would be ignored: this evaluation runs no pipeline "
                          f"(pipelines: none), and only pipelines read the calibration batch and quant.first_last; "
                          f"name the pipelines with --quant / quant.pipelines, or drop it")
    if batch:
        raise ConfigError(f"{named.get(batch[0], batch[0])} would be ignored: no pipeline of this evaluation reads "
                          f"the calibration batch (pipelines: {', '.join(cfg.quant.pipelines) or 'none'}; rtn reads "
                          f"no data, aphq and gplq on an image classifier draw their own training images: "
                          f"quant.aphq.calib_images, quant.aphq.data_seed, quant.gplq.init_images, quant.gplq.seed); "
                          f"drop it")
    # the training split's name, and the size of the synthetic one, are read by the pipelines that draw from it
    # only: another one given to an evaluation that draws nothing (rtn, or no pipeline) would be ignored, even a
    # split that does not exist; the checkpoint's own value (a sweep passes a run's data overrides on) changes nothing
    recorded = (payload["config"].get("data") or {}) if payload else None
    drawing = [p for p in cfg.quant.pipelines
               if reads_calibration_batch(p, task.language) or PIPELINES[p].draws_training_images]
    for name in ("train_split", "synthetic_train_size"):
        value = getattr(cfg.data, name)
        key = f"data.{name}"
        if ((key in given or key in data_files) and not drawing
                and (recorded is None or value != recorded.get(name, getattr(DataConfig(), name)))):
            where = "" if key in given else f" (--config {data_files[key]})"
            raise ConfigError(f"{key}={value}{where} would be ignored: no pipeline of this evaluation reads the "
                              f"training split (pipelines: {', '.join(cfg.quant.pipelines) or 'none'}; rtn reads no "
                              f"data); drop it")
    # the scored val split as the training split: by any name or link, or a copy of its token file (same_split_data)
    how = same_split_data(cfg.data, "train", cfg.data, "val") if drawing else None
    seen = "text" if task.language else "images"
    if how == "classes":  # another folder, some of whose class folders are the val split's (train/n2 -> val/n2)
        raise ConfigError(f"data.train_split={cfg.data.train_split}: it and the val split that is scored "
                          f"(data.val_split={cfg.data.val_split}) "
                          f"{split_reading(how, split_location(cfg.data, 'train'), split_location(cfg.data, 'val'))}, "
                          f"so {', '.join(drawing)} would calibrate (or train) on the {seen} it scores; give "
                          f"data.train_split the training split")
    if how is not None:
        copied = "" if how == "same" else "a copy of "
        raise ConfigError(f"data.train_split={cfg.data.train_split}: {split_location(cfg.data, 'train')} is {copied}"
                          f"the val split that is scored (data.val_split={cfg.data.val_split}), so "
                          f"{', '.join(drawing)} would calibrate (or train) on the {seen} it scores; give "
                          f"data.train_split the training split")
    augmentation = train_transform_overrides_unread(data_items, cfg)
    if augmentation:
        raise ConfigError(f"{named.get(augmentation[0], augmentation[0])} would be ignored: no pipeline of this "
                          f"evaluation sees training-transform images (pipelines: "
                          f"{', '.join(cfg.quant.pipelines) or 'none'}; aphq and gplq draw them, as does any pipeline "
                          f"that reads the calibration batch with quant.calib_transform=train) and the val split takes "
                          f"the eval transform; drop it")
    interpolation = interpolation_override_unread(data_items, cfg, recorded)
    if interpolation:
        raise ConfigError(f"{named.get(interpolation, interpolation)} would be ignored: the digits images are made "
                          f"at data.digits_img_size={cfg.data.digits_img_size} with bicubic whatever it says, the eval "
                          f"transform leaves them as they are (the model's input size at data.crop_pct="
                          f"{cfg.data.crop_pct}: no resize), and no pipeline of this evaluation sees training-"
                          f"transform images, whose crop resamples with it (pipelines: "
                          f"{', '.join(cfg.quant.pipelines) or 'none'}; aphq and gplq draw them, as does any pipeline "
                          f"that reads the calibration batch with quant.calib_transform=train); drop it")
    if (payload and not cfg.quant.pipelines and args.bits is None
            and not any("quant.bits" in override_keys(item) for item in items)):
        # the run's recorded bit-widths are those of the pipelines it would be scored with: a float evaluation
        # (--quant naming none) reads none of them, and the user gave none to refuse
        cfg.quant.bits = []
    check_bits(cfg, task, defaulted, flags=True, bits_flag=args.bits is not None)
    unread_bits = options_unread_at_planned_bits(items, cfg)
    if unread_bits:  # e.g. quant.aphq.round_zero_point at w4a8 alone: APHQ folds no LayerNorm there
        item, why, widths = unread_bits[0]
        raise ConfigError(f"{named.get(item, item)} would be ignored: {why}, and every bit-width it runs at has "
                          f"a_bits != w_bits ({', '.join(widths)}); drop it, or add a bit-width with a_bits == w_bits")
    return cfg, payload


def check_out_dir_unread(args: argparse.Namespace, cfg: Config, given: set[str], saved: Optional[Config]) -> None:
    """out_dir is train.py's folder: evaluate.py writes where --out says (default: beside the checkpoint), so an
    out_dir override, or one a --config file sets over a checkpoint's own (`saved`, the checkpoint's config; None
    for a weights file), would be ignored while the result went elsewhere. A weights file's --config files are its
    recipe, whose out_dir is the run's and stays unread. (resolve_config's `changed` leaves out_dir out: it is an
    environment key of engine/run_dir.py.)"""
    from_file = saved is not None and cfg.out_dir != saved.out_dir
    if "out_dir" not in given and not from_file:
        return
    where = ("" if "out_dir" in given else
             f" (--config {' '.join(args.config or ())} sets it over {args.checkpoint}'s own)")
    out = os.path.join(cfg.out_dir, os.path.basename(default_out_path(args.checkpoint, cfg.model.name)))
    raise ConfigError(f"out_dir={cfg.out_dir}{where}: evaluate.py does not read out_dir, it writes its result where "
                      f"--out says (default: beside the checkpoint); give --out {out}"
                      + ("" if "out_dir" in given else ", and --config files of evaluation settings only (e.g. data)"))


def pipeline_options_unread(overrides: list[str], pipelines: list[str]) -> list[tuple[str, str]]:
    """(override, pipeline) for each key=value override that sets options of a pipeline not in `pipelines`
    (quant.<pipeline>.*: each pipeline reads its own section only); [] when every one is read."""
    unread = []
    for item in overrides:
        for key in override_keys(item):
            parts = key.split(".")
            if len(parts) > 2 and parts[0] == "quant" and parts[1] in PIPELINES and parts[1] not in pipelines:
                unread.append((item, parts[1]))
                break
    return unread


def options_unread_at_planned_bits(overrides: list[str], cfg: Config) -> list[tuple[str, str, list[str]]]:
    """(override, why, the pipeline's bit-widths) for each key=value override of a pipeline option that none of
    the pipeline's planned runs reads at its bit-width (the pipeline's `unread_at`, e.g. APHQ's round_zero_point
    where every run has a_bits != w_bits); [] when each is read by some run."""
    widths: dict[str, list[str]] = {}
    for name, bits in planned(cfg):
        widths.setdefault(name, []).append(bits)
    unread = []
    for item in overrides:
        for key in override_keys(item):
            parts = key.split(".")
            if len(parts) != 3 or parts[0] != "quant" or parts[1] not in widths:
                continue
            unread_at = getattr(PIPELINES[parts[1]], "unread_at", None)
            reasons = [unread_at(parse_bits(bits)).get(parts[2]) for bits in widths[parts[1]]] if unread_at else []
            if reasons and all(reasons):
                unread.append((item, f"{key} {reasons[0]}", widths[parts[1]]))
                break
    return unread


def given_quant_keys(args: argparse.Namespace, payload: Optional[dict]) -> set[str]:
    """The quant.* keys this command sets, as resolve_config finds them: its key=value overrides and the settings
    its --config files change (`config_file_items`). A checkpoint's own config sets none: its values are
    defaults of this evaluation (an old run's recorded quant.gplq.pca_images=10000 is capped, not refused)."""
    items = [*args.overrides, *config_file_items(args.config or (), payload, "quant.")]
    return {key for item in items for key in override_keys(item) if key.startswith("quant.")}


def config_file_items(paths, payload: Optional[dict], section: str) -> dict[str, str]:
    """{`key=value`: the file} for each setting under `section` ("quant.", "data.") that the --config files `paths`
    give a value other than the checkpoint's config (`payload`) or the defaults have: the last file that sets a key
    gives its value, as when the files are layered. (An override of the same key comes before these items in the
    checks, so an error names the override.)"""
    base = config_from_dict(payload["config"]) if payload else Config()
    found: dict[str, tuple[str, object]] = {}
    for path in paths:
        for top, value in read_yaml_file(path).items():
            for key, inner in dotted_settings(str(top), value, base).items():
                if key.startswith(section):
                    found[key] = (path, inner)
    return {f"{key}={json.dumps(inner)}": path for key, (path, inner) in found.items()
            if _setting_value(base, key) != json.dumps(inner)}


def _setting_value(cfg: Config, key: str) -> Optional[str]:
    """The value of `key` in `cfg` as JSON (a tuple of the schema reads as the list a YAML file writes), or None
    when the schema has no such key (the layering has refused such a file already)."""
    try:
        return json.dumps(get_key(cfg, key))
    except (KeyError, AttributeError, TypeError):
        return None


def check_checkpoint_settings(saved: dict, cfg: Config, checkpoint: str, fingerprint: Optional[dict] = None,
                              starts: Collection[dict] = ()) -> None:
    """Settings that --config / overrides may not change for a checkpoint: the weights are the checkpoint's
    (another model.pretrained would be ignored), and the val split must be held out from its training: not the
    folder or token file of its training split, nor a copy of that file (`check_not_trained_on`; `fingerprint`: the
    checkpoint's data_fingerprint), nor data that the weights it was fine-tuned from learned (`starts`: its record's
    engine/start_weights.py ancestors_data, `check_held_out_from_starts`), and for the embedded data sets not
    another data.kjv_val_fraction (a larger one would score on text it was trained on, a smaller one on part of the
    held-out text only) or data.digits_val_fraction (images it was trained on: the digits split is a seeded
    stratified split of one set)."""
    if cfg.model.pretrained != saved.get("model", {}).get("pretrained", cfg.model.pretrained):
        raise ConfigError(f"model.pretrained={cfg.model.pretrained}: --checkpoint {checkpoint} gives the weights; "
                          f"evaluate other weights with model.pretrained and --config, without --checkpoint")
    check_not_trained_on(config_from_dict(saved).data, cfg.data, checkpoint, fingerprint)
    # digits it and its starts learned at other fractions: one line, not two checks' opposite fixes
    check_digits_held_out_from_all(config_from_dict(saved).data, starts, cfg.data, f"--checkpoint {checkpoint}")
    trained = saved.get("data", {})
    if (cfg.data.dataset == "kjv" and trained.get("dataset") == "kjv"
            and trained.get("kjv_val_fraction", cfg.data.kjv_val_fraction) != cfg.data.kjv_val_fraction):
        given, held_out = cfg.data.kjv_val_fraction, trained["kjv_val_fraction"]
        # a larger tail reaches into the training text; a smaller one lies inside the held-out tail, but scores
        # other text than the split the checkpoint's val numbers (and the tables' rows) were measured on
        why = (f", so the last {given} would score it on text it was trained on; drop the override" if given > held_out
               else f" and its last {given} is only part of that held-out text, not the split its val numbers were "
                    f"measured on; drop the override (to score fewer windows of the held-out text: "
                    f"data.val_windows=N)")
        raise ConfigError(f"data.kjv_val_fraction={given}: {checkpoint} was trained on the text before its last "
                          f"{held_out}{why}")
    if (cfg.data.dataset == "digits" and trained.get("dataset", "digits") == "digits"
            and trained.get("digits_val_fraction", cfg.data.digits_val_fraction) != cfg.data.digits_val_fraction):
        raise ConfigError(f"data.digits_val_fraction={cfg.data.digits_val_fraction}: {checkpoint} was trained on "
                          f"the digits outside a val fraction of {trained['digits_val_fraction']}, so another "
                          f"split would score it on images it was trained on; drop the override")
    # and the data its starts learned (a fine-tune of a fine-tune), as train.py refuses it for a fine-tune of it;
    # after the checkpoint's own data, whose refusal names the checkpoint itself
    check_held_out_from_starts(starts, cfg.data, f"--checkpoint {checkpoint}", "the evaluation")


def check_held_out_from_starts(starts: Collection[dict], data: DataConfig, weights: str, scored: str) -> None:
    """`check_held_out_from` for the data of every start a run checkpoint descends from (`starts`: its record's
    engine/start_weights.py ancestors_data, nearest first: a fine-tune of a fine-tune), each named by how far back it
    lies from `weights`, or as the run's own training before a resume changed its data (an entry marked
    EARLIER_TRAINING: data learned by the run of the entry before it, `weights`' own at the front); an entry of an
    older schema's data settings is compared on the keys that name the data (`recorded_training_data`)."""
    for entry, learned_by in labelled_starts(starts, weights):
        trained = recorded_training_data(entry["data"], learned_by)
        check_held_out_from(trained, entry.get("data_fingerprint"), data, learned_by, scored)


def labelled_starts(starts: Collection[dict], weights: str) -> list[tuple[dict, str]]:
    """Each entry of `starts` (check_held_out_from_starts') with the weights that learned it as errors name them: a
    start of `weights` by how far back it lies, or `weights`' own run before a resume changed its training data."""
    labelled, back = [], 0  # fine-tunes back from `weights`
    for entry in starts:
        back += not entry.get(EARLIER_TRAINING)
        start = (" (its own run's training before a resume changed its training data)" if back == 0
                 else "'s start (weights it was fine-tuned from)" if back == 1
                 else "'s start" * back + f" (weights {back} fine-tunes back)")
        labelled.append((entry, f"{weights}{start}"))
    return labelled


def check_digits_held_out_from_all(own: DataConfig, starts: Collection[dict], data: DataConfig, weights: str) -> None:
    """Refuse in one line a digits val split where no data.digits_val_fraction is held out from all the digits the
    weights `weights` learned: its own run's (`own`) and its starts' (`starts`, as check_held_out_from_starts'),
    learned at other fractions (C at 0.3 fine-tuned from A at 0.2, a lineage older code let through). The val
    images of each fraction, another seeded draw (data.digits.split_indices), include some another one trained on,
    so the checks of each (check_held_out_from, the checkpoint's own fraction check) would each refuse with the fix
    the other refuses. A fraction none of them learned at is another draw still, whose val images meet their
    training images too: only the learned fractions are tried."""
    if data.dataset != "digits":
        return
    learned = [(own, weights)] + [(recorded_training_data(entry["data"], by), by)
                                  for entry, by in labelled_starts(starts, weights)]
    fractions = dict.fromkeys(trained.digits_val_fraction for trained, _ in learned if trained.dataset == "digits")
    if len(fractions) < 2:
        return
    train_of = {f: set(digits_split(f)[0].tolist()) for f in fractions}

    def held_out(fraction: float) -> bool:
        val = set(digits_split(fraction)[1].tolist())
        return not any(val & train_of[f] for f in fractions if f != fraction)

    if held_out(data.digits_val_fraction) or any(held_out(f) for f in fractions):
        return
    named = [f"it was trained on those outside a val fraction of {own.digits_val_fraction}" if by == weights
             else f"{by} on those outside {trained.digits_val_fraction}"
             for trained, by in learned if trained.dataset == "digits"]
    raise ConfigError(f"data.digits_val_fraction={data.digits_val_fraction}: no data.digits_val_fraction is held out "
                      f"from all the digits {weights} learned: {', '.join(named)}, and the val images of each "
                      f"include some another trained on; score it on other data")


# the data.* keys that name the data a checkpoint was trained on and held out (check_held_out_from reads no other)
HELD_OUT_KEYS = ("dataset", "root", "train_split", "val_split", "kjv_val_fraction", "digits_val_fraction")


def recorded_training_data(data: dict, weights: str) -> DataConfig:
    """The data settings `data` (the data.* a checkpoint of `weights`, as errors name it, recorded) as a DataConfig for
    check_held_out_from. Where other settings of an older schema no longer parse (an 0..255 data.mean, a key since
    removed), the `HELD_OUT_KEYS` alone, which name its training data, are compared rather than the check passed
    over; one of those that this version cannot read is refused, as nothing would tell its training data apart."""
    try:
        return config_from_dict({"data": data}).data
    except ConfigError:
        pass
    try:
        return config_from_dict({"data": {k: data[k] for k in HELD_OUT_KEYS if k in data}}).data
    except ConfigError as e:
        raise ConfigError(f"{weights} records data settings this version of the code cannot read ({e}), so the val "
                          f"split cannot be checked against the data it was trained on; use the version of the code "
                          f"that trained it") from None


def check_held_out_from(trained: DataConfig, fingerprint: Optional[dict], data: DataConfig, weights: str,
                        scored: str = "validation (and best.pt)") -> None:
    """Refuse a val split of `data` that reads data the weights `weights` (a run checkpoint, as the error names it)
    were trained on, which `scored` (what the error says the split is read by) would score: `trained`, the data
    settings it recorded (`fingerprint`: its data_fingerprint), its training folder or token file by any name, link
    or copy (`check_not_trained_on`); for kjv a larger data.kjv_val_fraction (that tail reaches into the text it
    trained on; a smaller one lies inside its held-out tail); for digits another data.digits_val_fraction whose val
    images include some of its training images (the split is a seeded stratified draw of one set, another for each
    fraction, which data.digits.split_indices gives). train.py's check of a fine-tune's or resume's val split."""
    if data.dataset == trained.dataset == "kjv" and data.kjv_val_fraction > trained.kjv_val_fraction:
        raise ConfigError(f"data.kjv_val_fraction={data.kjv_val_fraction}: {weights} was trained on the text before "
                          f"its last {trained.kjv_val_fraction}, so {scored} on the last {data.kjv_val_fraction} "
                          f"would score text it was trained on; give data.kjv_val_fraction="
                          f"{trained.kjv_val_fraction} or less")
    if data.dataset == trained.dataset == "digits" and data.digits_val_fraction != trained.digits_val_fraction:
        # another fraction's split is another seeded draw: its val images may or may not lie in the start's val split
        seen = (set(digits_split(trained.digits_val_fraction)[0].tolist())
                & set(digits_split(data.digits_val_fraction)[1].tolist()))
        if len(seen):
            raise ConfigError(f"data.digits_val_fraction={data.digits_val_fraction}: {len(seen)} of its val images "
                              f"are among the digits {weights} was trained on (outside a val fraction of "
                              f"{trained.digits_val_fraction}), so {scored} would score images it was trained on; "
                              f"give data.digits_val_fraction={trained.digits_val_fraction}")
    check_not_trained_on(trained, data, weights, fingerprint)


def check_not_trained_on(trained: DataConfig, data: DataConfig, checkpoint: str,
                         fingerprint: Optional[dict] = None) -> None:
    """Refuse a val split (of `data`) that reads the training split of the checkpoint's data set (`trained`, its
    recorded settings): the folder or token file it recorded, by any name or link (os.path.samefile), or the split
    of that name under another data.root (a copy of the data set on this machine), a folder holding one of its class
    folders (val2/n2 a link to train/n2, named as data.loader.split_reading names it) or a byte copy of the training
    token file (same_split_data), and where that file is not on this machine as the checkpoint recorded it
    (`fingerprint`, its data_fingerprint: each file's size and first MiB; None for an older checkpoint), a token
    file of its recorded size and first MiB. Any other val split is taken: a held-out folder beside the recorded val
    one, or another data.root's own."""
    val = split_location(data, "val")
    if val is None or trained.dataset != data.dataset:
        return
    here = dataclasses.replace(trained, root=data.root)
    how, train_at = None, None  # how the val split reads the training split, and where that split is
    for at in (trained, here):
        how = same_split_data(data, "val", at, "train")
        if how is not None:
            train_at = split_location(at, "train")
            break
    recorded = recorded_train_file(trained, fingerprint)  # the train file may be elsewhere now, or gone
    # the record holds the train file's size and the SHA-256 of its first MiB, no more: where the file is here as
    # recorded, same_split_data compared the two in full; where it is not, a val file of that size and first MiB is
    # a copy only if that MiB is all of it, and is otherwise refused as what it is, not called a copy. Refused rather
    # than scored with a warning: its first MiB (524,288 ids) at least is the training file's text, which no held-out
    # split begins with, and the user who holds a file that differs further on can put the train file back to have
    # the two compared in full
    if (how is None and recorded is not None and recorded.get("bytes") == os.path.getsize(val)
            and not holds_recorded_file(recorded, "train", trained, here)
            and recorded == token_file_fingerprint(data, "val")):
        how = "copy" if recorded["bytes"] <= FINGERPRINT_HEAD_BYTES else "head"
    if how == "head":
        raise ConfigError(f"data.val_split={data.val_split}: {val} has the size and first MiB of the "
                          f"{trained.train_split} token file {checkpoint} was trained on, as the checkpoint recorded "
                          f"them, so its first MiB at least is text it was trained on (that file is not under "
                          f"data.root={' or '.join(dict.fromkeys((trained.root, data.root)))} as recorded, to compare "
                          f"the two in full); "
                          f"{held_out_advice(trained, here, fingerprint)}, or put the training file back as "
                          f"{os.path.join(data.root, trained.train_split)}.bin to compare them in full")
    seen = "text" if data.dataset == "tokens" else "images"
    if how == "classes":  # another folder, some of whose class folders are the training split's (val/n2 -> train/n2)
        raise ConfigError(f"data.val_split={data.val_split}: it and the {trained.train_split} split {checkpoint} was "
                          f"trained on (data.root={trained.root}) {split_reading(how, train_at, val)}, so its scores "
                          f"would be of {seen} it was trained on; {held_out_advice(trained, here, fingerprint)}")
    if how is not None:
        copied = "" if how == "same" else "a copy of "
        raise ConfigError(f"data.val_split={data.val_split}: {val} is {copied}the {trained.train_split} split "
                          f"{checkpoint} was trained on (data.root={trained.root}), so its scores would be of {seen} "
                          f"it was trained on; {held_out_advice(trained, here, fingerprint)}")


def recorded_train_file(trained: DataConfig, fingerprint: Optional[dict]) -> Optional[dict]:
    """The size and first MiB's SHA-256 of the token file the checkpoint was trained on, as it recorded them
    (`fingerprint`: its data_fingerprint), or None: a folder data set, or a checkpoint without the record."""
    if trained.dataset != "tokens" or not fingerprint:
        return None
    return fingerprint.get(f"{trained.train_split}.bin")


def holds_recorded_file(record: Optional[dict], split: str, *datas: DataConfig) -> bool:
    """Whether one of `datas` (token data sets) has a `split` token file of the size and first MiB `record` holds
    (token_file_fingerprint): the file a checkpoint recorded, here to be compared in full."""
    return record is not None and any(split_location(at, split) is not None
                                      and token_file_fingerprint(at, split) == record for at in datas)


def held_out_advice(trained: DataConfig, here: DataConfig, fingerprint: Optional[dict] = None) -> str:
    """What check_not_trained_on advises: the checkpoint's recorded val split, unless that reads its training split
    too (a run validated on its train file or folder, by name or link, or on a copy of its train file, under the
    recorded root or `here`'s), or the checkpoint's `fingerprint` recorded both files of one size and first MiB and
    they are not both here to be compared in full: a name that would only be refused again. A held-out val split
    whose name reads the training split under `here`'s root only is said to be so, not to have been trained on."""
    recorded = recorded_train_file(trained, fingerprint)
    recorded_val = fingerprint.get(f"{trained.val_split}.bin") if recorded is not None else None
    same_record = recorded is not None and recorded == recorded_val
    if (trained.val_split == trained.train_split
            or any(same_split_data(val_at, "val", train_at, "train")
                   for val_at, train_at in ((trained, trained), (here, here)))
            # the run's val file and this root's train file: its training split only where its own is gone
            or (split_location(trained, "train") is None and same_split_data(trained, "val", here, "train"))
            or (same_record and recorded["bytes"] <= FINGERPRINT_HEAD_BYTES)):  # the record hashed both files whole
        return (f"it was validated on that split too (data.val_split={trained.val_split}): give data.val_split a "
                f"split held out from its training")
    if same_split_data(here, "val", trained, "train"):  # its own val split was held out; this root's of that name not
        return (f"data.val_split={trained.val_split}, the split it was validated on, reads its training split under "
                f"data.root={here.root}: give data.val_split a split there held out from its training")
    if same_record and not any(holds_recorded_file(recorded, "train", at)
                               and holds_recorded_file(recorded_val, "val", at) for at in (trained, here)):
        return (f"it was validated on a split of its train file's size and first MiB, as the checkpoint recorded "
                f"them (data.val_split={trained.val_split}): give data.val_split a split held out from its training")
    return f"score its held-out split (data.val_split={trained.val_split})"


def check_finite_maxima(records: list, amp: str) -> None:
    """Refuse activation maxima that are not finite numbers (engine.act_max records an output holding an inf or a
    NaN as inf): no maximum was measured there, and written as the result's max_act it is refused by every table that
    reads it as a diverged run's. The logits can be finite all the same (an overflow at tokens the head does not read,
    the last block's patch tokens), so the FP pass did not refuse them. Nothing is written. The error names the first
    output not finite in the order the forward computed them (engine.act_max.first_not_finite: a NaN spreads on from
    there), and where the value it read was computed when that was not finite already."""
    found = first_not_finite(records)
    if found:
        first, more, origin = found
        more = f" and {more} more" if more else ""
        origin = f"; {origin}" if origin else ""
        cause = ("under --amp fp16 a value past fp16's largest, 65504, overflows: give --amp bf16 or none"
                 if amp == "fp16" else "the weights' activations overflow there (a diverged run)")
        raise NonFiniteLossError(f"activation maxima: the output of {first}{more} is not finite (inf or NaN) on the "
                                 f"val images, so it has no maximum and nothing is written{origin}; {cause}")


def default_out_path(checkpoint: str | None, model_name: str) -> str:
    if checkpoint:
        return os.path.join(os.path.dirname(os.path.abspath(checkpoint)),
                            f"eval_{os.path.splitext(os.path.basename(checkpoint))[0]}.json")
    return os.path.join("runs", "eval", f"{model_name}.json")


# timm / DeiT evaluation flags and ours (configs/cli.py has those shared with train.py)
FOREIGN_EVAL_FLAGS = {"resume": "--checkpoint {}", "finetune": "--checkpoint {} (or model.pretrained={})",
                      "output_dir": "--out {}", "output": "--out {}", "eval": "",
                      "batch_size": "train.eval_batch_size_per_gpu={}",
                      "b": "train.eval_batch_size_per_gpu={}"}


def build_parser() -> OneLineParser:
    """evaluate.py's command line; scripts that run evaluate.py name its options in their --help from it."""
    parser = OneLineParser(description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="best.pt / checkpoint.pt written by train.py")
    parser.add_argument("--config", action="append", help="YAML file(s): the recipe when there is no "
                        "checkpoint, or a layer on top of the checkpoint's config")
    # "extend": a repeated flag adds to the list (with "store", `--bits w4a4 --bits w8a8` ran w8a8 alone)
    parser.add_argument("--quant", nargs="*", action="extend",
                        help=f"pipelines (default: quant.pipelines); any of {sorted(PIPELINES)}; --quant alone: the "
                             "float evaluation only")
    parser.add_argument("--bits", nargs="*", action="extend",
                        help="bit-widths such as w4a4 w6a6 w8a8 (default: quant.bits)")
    parser.add_argument("--out", help="JSON file path ending in .json, its folder made if missing (a folder is "
                                      "refused; default: "
                                      "eval_<checkpoint>.json next to the checkpoint; without --checkpoint "
                                      "runs/eval/<model.name>.json)")
    parser.add_argument("--ema", action="store_true", help="evaluate the EMA weights of the --checkpoint (a "
                        "model.pretrained file is read as its plain weights: refused there)")
    parser.add_argument("--recompute", action="store_true", help="run pipeline/bit-widths that the JSON "
                        "already has again, and measure the activation maxima over other "
                        "quant.act_max_extra_modules than it has (the old entries are kept under 'history'); "
                        "refused where it would change nothing (no pipeline runs, and the JSON's maxima are of the "
                        "same modules)")
    parser.add_argument("--amp", default="none", choices=["none", "fp16", "bf16"],
                        help="autocast for evaluation "
                             "(default none: fp32, as the official quantization code)")
    parser.add_argument("overrides", nargs="*",
                        help="key=value config overrides, e.g. data.root=/datasets/imagenet")
    add_config_arguments(parser, "evaluate.py")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = parse_known(build_parser(), argv, "evaluate.py", own_flags=FOREIGN_EVAL_FLAGS)
    move_overrides(args, "quant", "bits")  # `--quant repq data.root=x`: data.root=x is an override
    if args.print_config:
        print_config(resolve_config(args)[0])
        sys.exit(0)
    return args


# the user's mistakes: one `error:` line each (scripts that call main() catch the same)
EVAL_LOG = "eval.log"  # evaluate.py's log, beside the result
USER_ERRORS = (ConfigError, CheckpointError, DataError, ModelError, ResultsError, RunDirError,
               NonFiniteLossError, NothingScoredError)

if __name__ == "__main__":
    try:
        main(parse_args(sys.argv[1:]))
    except USER_ERRORS as e:
        exit_with_error(str(e), error=e)  # stderr (once under torchrun: said_by_rank_0) and eval.log
    except OtherRankError as e:  # rank 0 prints the error itself (a traceback if it is not the user's)
        exit_with_error(str(e), error=e)
    except Preempted:  # GPLQ stage 1 logged where it stopped; its checkpoint is written, the same command resumes
        ignore_sigterm_until_exit()  # torchrun's SIGTERM once another rank exited must not make this rank's code -15
        sys.exit(EXIT_PREEMPTED)
    except KeyboardInterrupt:  # Ctrl-C: the JSON holds every result finished so far (written as they come)
        exit_with_error("interrupted; the results finished so far are in the JSON, and the same command runs "
                        "only what is missing", code=130)
