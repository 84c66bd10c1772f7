r"""Evaluate an MMDetection detector (the paper's COCO study, Table 2): box / mask mAP in full precision and
under the W4A4 pipelines, and the backbone / head activation maxima, into one JSON per checkpoint.

    python evaluate_detection.py --config configs/detection/mask_rcnn_swin_t_1x.py \
        --checkpoint runs/det_t1x_cd/epoch_12.pth --data-root /datasets/coco
    python evaluate_detection.py --config configs/detection/mask_rcnn_swin_t_1x.py \
        --checkpoint runs/det_t1x_cd/epoch_12.pth --data-root /datasets/coco --quant repq --bits w4a4 w6a6 \
        --out results/det_t1x_cd.json
    torchrun --nproc_per_node=8 evaluate_detection.py --config configs/detection/mask_rcnn_swin_t_1x.py \
        --checkpoint runs/det_t1x_cd/epoch_12.pth --data-root /datasets/coco --quant gplq   # the paper's 8 GPUs

The detector is quantized as the official RepQ-ViT / APHQ detection code quantizes it: every Conv2d and
Linear of the backbone, FPN neck, RPN and RoI heads, and both matmuls of every window attention (quant/spec.py,
quant/README.md); the mask head's transposed conv stays float. Calibration: `--calib-images` training images
(default 1, the official RepQ-ViT and APHQ detection setting) with the test pipeline, in one batch (a bare `--quant`
runs no pipeline and refuses --bits, --calib-images and --calib-seed). APHQ also
reconstructs on its own training images (quant/aphq/detector.py) and starts from the official detection
recipe (configs/quant.py APHQ_DETECTION); GPLQ trains the activation quantizers with the detection loss for one
epoch (quant/gplq/detector.py, GPLQ_DETECTION; its resumable checkpoints go to `<out>_gplq_<bits>_stage1/`, a path
checked before any scoring).
`--quant-options aphq.iters=2000 gplq.steps=500 ...` overrides pipeline options. The calibration batch and
APHQ's and GPLQ's own image sets (where they are drawn: APHQ's at aphq.iters > 0, GPLQ's with QwT) are checked
against the training split's size before any work.

Under torchrun every rank scores its shard of the val set (the metric is computed once, on all of them);
percentile, RepQ-ViT and APHQ quantize on rank 0, which hands the quantized detector to the others, and GPLQ's
stage 1 trains on every rank in DDP (batch 1 per GPU, as the paper), its stage 2 on rank 0. The other ranks
wait for rank 0 up to --main-rank-wait-hours.

The JSON is evaluate.py's (engine/eval_results.py): `fp` (box/mask mAP), `max_act` (backbone, head; measured on the
padded test batches, the padded pixels counted, as `max_act.padding` records: docs/reproduce.md),
`quant.<pipeline>.<bits>`, `method` (CD, TWEO, Noise or Baseline, from the hooks of the training config the
checkpoint keeps, with the settings that differ from configs/detection/method/*.py: "CD (lam 0.01)"; null without
one); a file of other weights, data or config (the merged config's hash,
`config_sha256`) is refused, later calls add their pipelines. A checkpoint whose training config (which MMEngine
keeps in it) built the model with other settings than --config (a data preprocessor's mean / std, a qk_scale, a
test threshold) is scored with --config's, and one warning line names them.
Config entries can be overridden as `key=value` after the flags, or after `--cfg-options` as MMDetection's tools
take them (the same syntax): those the
evaluation reads (model, test_dataloader, test_evaluator, ...; of train_dataloader, what its pipelines read:
nothing without one, the dataset but its pipeline, indices, max_refetch and a wrapper's repeats (of the datasets
it wraps too) for percentile, RepQ-ViT and APHQ, the loader but its batch_size, which gplq.batch_size_per_gpu
sets, for GPLQ's stage 1); others are refused, and so is model.backbone.init_cfg: every weight comes from --checkpoint.
"""
from __future__ import annotations

import datetime
import math
import os
import warnings
from typing import Optional, Sequence

import torch

# MMEngine 0.10 imports pkg_resources, of which setuptools 80 warns at each import: two warnings (four lines) on
# stderr before this command's own output, a one-line refusal too; not this command's to act on
warnings.filterwarnings("ignore", message="pkg_resources is deprecated as an API", category=UserWarning)


def parse_args(argv):
    from configs.cli import OneLineParser, first_line

    parser = OneLineParser(description=first_line(__doc__))  # one paragraph, wrapped to the terminal
    parser.add_argument("--config", action="append", required=True,
                        help="MMDetection config; repeat to merge fragments in order")
    parser.add_argument("--checkpoint", required=True, help="the detector's MMEngine checkpoint (.pth)")
    parser.add_argument("--data-root", help="COCO folder (annotations/, train2017/, val2017/)")
    # "extend", as evaluate.py: a repeated flag adds to the list (with "store", `--quant repq --quant aphq` ran
    # aphq alone and `--bits w4a4 --bits w6a6` w6a6 alone, without a word)
    parser.add_argument("--quant", nargs="*", action="extend", default=None,
                        help="pipelines (default: every pipeline that quantizes detectors); a bare --quant, "
                             "naming none: FP only")
    # None: not given (a full-precision-only evaluation refuses them); QUANT_DEFAULTS otherwise. "*", not "+": a
    # --bits left with no bit-width (an empty shell variable, or only key=value words after it) is refused below
    parser.add_argument("--bits", nargs="*", action="extend", default=None,
                        help=f"bit-widths (default: {' '.join(QUANT_DEFAULTS['bits'])})")
    parser.add_argument("--calib-images", type=int, default=None,
                        help="training images calibrating the quantizers, one batch (default 1, as RepQ-ViT's)")
    parser.add_argument("--calib-seed", type=int, default=None, help="seed drawing the calibration images (default 0)")
    parser.add_argument("--quant-options", nargs="+", action="extend", default=[], metavar="PIPELINE.KEY=VALUE",
                        help="pipeline options, e.g. aphq.iters=2000 aphq.recon_images=64 (configs/quant.py)")
    parser.add_argument("--max-images", type=int, default=None,
                        help="score the first N validation images only (a partial result, marked in the JSON)")
    parser.add_argument("--out", help="result JSON (default: eval_<checkpoint name>.json beside it)")
    parser.add_argument("--recompute", action="store_true", help="replace results the JSON already has (its "
                        "full-precision score, its entries of the pipelines named); refused where it would replace "
                        "nothing (a bare --quant, and no full-precision score in the JSON)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: CUDA if visible (under torchrun, GPU LOCAL_RANK), else the CPU")
    # None: not given (refused in one process, where no rank waits); MAIN_RANK_WAIT_HOURS otherwise
    parser.add_argument("--main-rank-wait-hours", type=float, default=None,
                        help=f"under torchrun, how long the other ranks wait while rank 0 quantizes (default "
                             f"{MAIN_RANK_WAIT_HOURS:g}; refused in one process)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    parser.add_argument("--cfg-options", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="config overrides as MMDetection's tools take them (the same as bare key=value)")
    args = parser.parse_intermixed_args(argv)  # as evaluate.py: overrides before, between and after the flags
    from configs.cli import move_overrides
    move_overrides(args, "quant", "bits")  # as evaluate.py: `--quant test_dataloader.x=1`: an override, FP only
    args.overrides += args.cfg_options  # MMDetection's spelling, after the bare ones as in train_detection.py
    if args.bits == []:  # `--bits $EMPTY k=v`: unlike a bare --quant's, no asked meaning; the default would run
        parser.error(f"--bits names no bit-width: name them (e.g. --bits w4a4 w6a6), or drop --bits for the "
                     f"default ({' '.join(QUANT_DEFAULTS['bits'])})")
    return args


QUANT_DEFAULTS = {"bits": ["w4a4"], "calib_images": 1, "calib_seed": 0}
MAIN_RANK_WAIT_HOURS = 24.0  # --main-rank-wait-hours not given: evaluate.py's quant.main_rank_wait_hours default
# the option of each pipeline that draws its own training images besides the calibration batch
SAMPLE_OPTIONS = {"aphq": "recon_images", "gplq": "stage2_images"}


def quant_flags(args, pipelines) -> None:
    """Refuse the quantization flags given to an evaluation that runs no pipeline (a bare --quant: they would be
    ignored), and a calibration batch of no image; then fill in their defaults."""
    from engine.detection import DetectionError
    if not pipelines:
        given = [f"--{k.replace('_', '-')}" for k in QUANT_DEFAULTS if getattr(args, k) is not None]
        if given:
            raise DetectionError(f"{', '.join(given)} with a bare --quant: no pipeline runs to use "
                                 f"{'them' if len(given) > 1 else 'it'}; name the pipelines after --quant, or drop "
                                 f"{', '.join(given)}")
    for key, default in QUANT_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    if args.calib_images < 1:
        raise DetectionError(f"--calib-images {args.calib_images}: give at least 1")
    from configs.constraints import Seed
    if Seed.violation(args.calib_seed) is not None:  # the range of every other seed (quant.calib_seed, gplq.seed)
        raise DetectionError(f"--calib-seed {args.calib_seed}: give a seed {Seed.violation(args.calib_seed)}")


def check_head_options(name: str, options) -> None:
    """Refuse a head bit-width for a detector: head_w_bits / head_a_bits set a classifier's head (quant/spec.py
    HEAD: timm's head, head.fc, head_dist), a module no MMDetection detector has, so the option would be recorded
    in the result's settings and change nothing (the detector's RPN and RoI heads are quantized at the main
    bit-width, its mask head's ConvTranspose2d stays float)."""
    given = [f"{key}={getattr(options, key)}" for key in ("head_w_bits", "head_a_bits")
             if getattr(options, key, None) is not None]
    if given:
        from engine.detection import DetectionError
        raise DetectionError(f"--quant-options {', '.join(f'{name}.{item}' for item in given)}: the bit-width of a "
                             "classifier's head (timm's head / head.fc), which a detector does not have (its RPN and "
                             "RoI heads take the main bit-width); drop it")


def check_image_counts(images, todo, options, calib_images: int) -> None:
    """Refuse, before any work, a calibration batch or a pipeline's own image set (APHQ's reconstruction, GPLQ's
    QwT) larger than the training split `images`; a set the pipeline will not draw is not checked."""
    from quant import PIPELINES
    from quant.pipeline_base import parse_options
    images.check(calib_images, "--calib-images")
    for name in dict.fromkeys(p for p, _ in todo):
        option = SAMPLE_OPTIONS.get(name)
        parsed = parse_options(PIPELINES[name].Options, options[name])
        # APHQ draws its reconstruction images only to reconstruct (iters > 0), GPLQ its QwT images only with QwT on
        draws = parsed.iters > 0 if name == "aphq" else parsed.qwt if name == "gplq" else False
        if option and draws:
            images.check(getattr(parsed, option), f"--quant-options {name}.{option}")


# APHQ's options that only a detector's reconstruction reads (quant/aphq/detector.py draws no images at iters=0)
RECONSTRUCTION_DATA = ("recon_images", "data_seed")


def check_reconstruction_data(given: dict) -> None:
    """Refuse aphq.recon_images and aphq.data_seed where the user gave them (`given`: their --quant-options, not
    the detection defaults) with aphq.iters=0: they set the reconstruction images, which iters=0 does not draw (the
    calibration batch is --calib-images, --calib-seed), so they would be recorded in the result's settings and
    change nothing."""
    unread = [f"aphq.{key}={given[key]}" for key in RECONSTRUCTION_DATA if key in given]
    if given.get("iters") == 0 and unread:  # the detection recipe leaves iters at its default, above 0
        from engine.detection import DetectionError
        raise DetectionError(f"--quant-options {' '.join(unread)} with aphq.iters=0: read only by the "
                             f"reconstruction, which iters=0 skips (the calibration batch is --calib-images, "
                             f"--calib-seed); drop {'them' if len(unread) > 1 else 'it'}, or give aphq.iters>0")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.main_rank_wait_hours is not None:  # before any mmdet import: one process waits for no rank
        from engine.distributed import check_main_rank_wait_read
        check_main_rank_wait_read("--main-rank-wait-hours")
    from engine.detection import (DetectionError, DetectorFeed, DetectorSamples, annotation_paths, build_detector,
                                  build_loader, check_annotation_files, check_annotations, check_checkpoint_classes,
                                  check_evaluator_annotations, check_evaluator_thresholds, check_image_folders,
                                  check_pipeline,
                                  check_stage1_amp, check_stage1_device, check_stage1_folder, evaluate_detector,
                                  load_config, parse_overrides, train_activation_qat, TrainingImages)
    from configs.cli import named_twice
    from configs.constraints import WaitHours
    from engine.checkpoint import weights_fingerprint
    from engine.detection.data_checks import print_warnings
    from engine.distributed import (MainRankWait, OtherRankError, fail_on_every_rank_at_start,
                                    failure_on_every_rank, process_group, raise_on_every_rank, run_on_main)
    from engine.eval_results import EvalResults, check_result_path
    from engine.runinfo import software
    from mmengine.dist import sync_random_seed
    from quant import PIPELINES, evaluate_quantized, parse_bits
    from quant.aphq.detector import check_detector_options as check_aphq_options
    from quant.gplq.detector import check_detector_options as check_gplq_options, stage1_folder, stage1_identity
    from quant.pipeline_base import parse_options
    from quant.pipeline_data import PipelineData

    detection = [name for name, p in PIPELINES.items() if "detection" in p.tasks]
    pipelines = detection if args.quant is None else args.quant
    for name in pipelines:
        if name not in PIPELINES:
            raise DetectionError(f"--quant {name}: no such pipeline ({', '.join(PIPELINES)}); a bare --quant, "
                                 "naming none, scores full precision only")
        if "detection" not in PIPELINES[name].tasks:
            raise DetectionError(f"--quant {name} does not quantize detectors; the detection pipelines are "
                                 f"{', '.join(detection)}")
    quant_flags(args, pipelines)
    out = args.out if args.out is not None else os.path.join(  # "" (an unset $OUT) is refused, not the default
        os.path.dirname(os.path.abspath(args.checkpoint)),
        f"eval_{os.path.splitext(os.path.basename(args.checkpoint))[0]}.json")
    check_result_path(out)  # a folder: refused now, not at the first write after the detector is scored
    try:
        bits = [str(parse_bits(b)) for b in args.bits]
    except ValueError as e:  # as evaluate.py, the message names the flag
        raise DetectionError(f"--bits: {e}") from None
    for flag, values in (("--quant", pipelines), ("--bits", bits)):  # as evaluate.py: each would run twice
        problem = named_twice(flag, values)
        if problem:
            raise DetectionError(problem)
    user_options = pipeline_options(args.quant_options, pipelines)
    options = {name: {**detection_defaults(name, args, user_options.get(name, {})), **user_options.get(name, {})}
               for name in pipelines}
    parsed_options = {}  # {pipeline: its options parsed}, whose resolved defaults results record (`settings`)
    for name in pipelines:
        if name == "aphq":  # before parse_options, whose refusal of an unread recon_images names no flag of ours
            check_reconstruction_data(user_options.get(name, {}))
        parsed = parse_options(PIPELINES[name].Options, options[name])
        parsed_options[name] = parsed
        if name == "aphq":
            check_aphq_options(parsed)
        if name == "gplq":
            check_gplq_options(parsed)
        check_head_options(name, parsed)
        for b in bits:
            PIPELINES[name].validate(parse_bits(b), parsed, detection=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise DetectionError("--device cuda but no CUDA device is visible; use --device cpu or auto")
    if "gplq" in pipelines:  # before any work
        if args.device == "cpu":
            check_stage1_device(torch.device("cpu"))
        on_cpu = args.device == "cpu" or not torch.cuda.is_available()  # where --device puts stage 1
        check_stage1_amp(parse_options(PIPELINES["gplq"].Options, options["gplq"]).amp,
                         torch.device("cpu" if on_cpu else "cuda"), "--quant-options gplq.amp")
    hours = MAIN_RANK_WAIT_HOURS if args.main_rank_wait_hours is None else args.main_rank_wait_hours
    if WaitHours.violation(hours) is not None or not math.isfinite(hours):  # NaN passes any comparison
        raise DetectionError(f"--main-rank-wait-hours {hours}: give a positive number of hours, "
                             f"{WaitHours.describe()} (a gloo timeout past that overflows)")
    wait = MainRankWait(datetime.timedelta(hours=hours), "--main-rank-wait-hours")
    overrides = parse_overrides(args.overrides)
    try:  # this node's config and data files, read before the ranks meet
        cfg = load_config(args.config, overrides, args.data_root, evaluation_reads(pipelines))
        # the test split; the training split only where a pipeline calibrates or trains on it
        loaders = ("test_dataloader", "train_dataloader") if pipelines else ("test_dataloader",)
        source = args.data_root and f"--data-root {args.data_root}"
        check_annotation_files(cfg, source, loaders + ("test_evaluator",))
        check_image_folders(cfg, loaders, source)
        check_evaluator_annotations(cfg)
        check_evaluator_thresholds(cfg)
        check_scoring_evaluator(cfg)
        # the images scored: --max-images cut; train_dataloader's boxes trained on only by a pipeline that trains
        data_warnings = check_annotations(cfg, loaders, source, args.max_images,
                                     trains=any(PIPELINES[name].trains_model for name in pipelines))
    except Exception as e:  # noqa: BLE001 - raised on this rank after the others know (under torchrun)
        fail_on_every_rank_at_start(e, args.device)
    with process_group(args.device, wait) as dist:
        say = print if dist.is_main else (lambda *_, **__: None)
        # each rank reads its node's copy; no collective inside (the others would wait in it for a rank failing here)
        with failure_on_every_rank(dist.device, "loading the --checkpoint"):
            model = build_detector(cfg, args.checkpoint, dist.device)
        # the test sampler's seed (the sampler's own draw is a collective, MMEngine's sync_random_seed): drawn here,
        # so that the block below holds none and a rank that fails in it ends every rank with one error
        seed = sync_random_seed()
        with failure_on_every_rank(dist.device, "reading its test split (test_dataloader)"):
            loader = build_loader(cfg, "test", args.max_images, seed)  # under torchrun: this rank's shard
            check_checkpoint_classes(model, loader, args.checkpoint)
            check_pipeline(loader.dataset, "test_dataloader")  # a setting that fails on an image: before scoring
        identity = {"task": "detection", "config": [os.path.abspath(p) for p in args.config],
                    "config_sha256": config_hash(cfg),
                    "overrides": list(args.overrides), "checkpoint": os.path.abspath(args.checkpoint),
                    "fingerprint": weights_fingerprint(model.state_dict()),
                    "data": {"root": cfg.get("data_root"), "ann_file": evaluator_files(cfg),
                             "images": len(loader.dataset), "partial": args.max_images is not None},
                    # the ground truth by content: an annotation file edited or exported again at the same path
                    "annotations_sha256": files_sha256(annotation_paths(cfg, "test_dataloader"))}

        test_batch = loader.batch_size or getattr(loader.batch_sampler, "batch_size", 1)  # a batch sampler's own
        # the training split the pipelines draw their images from by index, by content: another file at the same path
        # draws other images; read only where a pipeline runs (COCO's train2017 annotations: 448 MB; files_sha256
        # read 450 MB from the page cache in 0.67 s on a 2-core AMD EPYC VM, docs/measurements.md)
        train_sha = files_sha256(annotation_paths(cfg, "train_dataloader")) if pipelines else None
        # what GPLQ's stage-1 folder records of the training data beside its images' indices (stage1_identity)
        train_data = {"train_annotations_sha256": train_sha}

        def open_results():
            results = EvalResults.open(out, identity)
            # the full-precision score is scored again only with --recompute (where the file has one)
            results.check_recompute_read(args.recompute, bool(pipelines), "fp" in results.data,
                                         "full-precision score to replace (one is scored without --recompute "
                                         "where the file has none)")
            asked = {p: settings(args, p, user_options.get(p), test_batch, parsed_options[p], train_sha)
                     for p in pipelines}
            return results, [(p, b) for p in pipelines for b in bits
                             if results.plan(p, b, asked[p], args.recompute)]

        # read once, on rank 0, so that every rank plans the same work
        results, todo = run_on_main(open_results, f"reading {out}", dist.device)
        # the method the checkpoint was trained with (its training config's hooks), the label of Fig. 1's circles;
        # recorded also in a file written before it was (no result depends on it)
        labelled = results.data.get("method") == model.training_method
        def training_feed() -> tuple:
            """The training split (read once, its counts checked before work) and the calibration batch drawn."""
            split = TrainingImages(cfg)
            check_image_counts(split, todo, options, args.calib_images)
            return split, DetectorFeed(cfg, args.calib_images, args.calib_seed, split)

        # the calibration batch: on rank 0, which quantizes, and on every rank for GPLQ, whose stage 1 starts there;
        # built where a failure ends every rank (an image the test pipeline drops, a missing file, a refused test
        # split): rank 0 alone failing left the others scoring, then stuck at a collective with a dead peer
        images = feed = None
        if todo and any(PIPELINES[p].data_parallel for p, _ in todo):  # every rank builds it, at the same time
            error = None
            try:
                images, feed = training_feed()
            except Exception as e:  # raised below on this rank, after every rank knows
                error = e
            raise_on_every_rank(error, dist.device, lambda: OtherRankError(
                f"rank {dist.rank}: another rank failed reading the training images; its output says why"))
        elif todo:  # rank 0 alone; the others wait in run_on_main, which ends them with its error
            built: dict = {}
            run_on_main(lambda: built.update(zip(("images", "feed"), training_feed())),
                        "reading the training images", dist.device)
            images, feed = built.get("images"), built.get("feed")
        work_prefix = os.path.splitext(out)[0]  # where GPLQ's stage 1 keeps its checkpoints
        # the folders GPLQ's stage 1 will write, checked (and left as they are) before the full-precision score:
        # one of another run (other weights, bits, calibration images, ranks or stage-1 options) is refused now
        gplq_bits = [b for p, b in todo if p == "gplq"]
        def check_folders() -> None:
            parsed = parse_options(PIPELINES["gplq"].Options, options["gplq"])
            for b in gplq_bits:
                data = PipelineData(work_prefix=work_prefix, identity=train_data)
                check_stage1_folder(stage1_folder(data, parse_bits(b)),
                                    stage1_identity(model, parse_bits(b), parsed, feed, data))

        if gplq_bits:  # on rank 0, which creates them; the other ranks fail with it
            run_on_main(check_folders, "checking GPLQ's stage-1 folders", dist.device)
        if dist.is_main:  # once nothing above has refused: a refused run warns of nothing
            # the weights fit, but the --config's model computes other outputs from them than the one trained
            print_warnings(data_warnings + ([model.settings_warning] if model.settings_warning else []))
        results.update(method=model.training_method)
        compute_fp = "fp" not in results.data or args.recompute
        if compute_fp:
            say(f"full precision on {len(loader.dataset)} images ...", flush=True)
            fp = evaluate_detector(model, cfg, loader, probe_maxima=True, progress=dist.is_main)
            # the code and packages that scored them, as evaluate.py records them (engine/runinfo.py software);
            # not compared when a result is reused: a score of another commit is the same score
            results.update(fp={k: v for k, v in fp.items() if k != "max_act"}, max_act=fp["max_act"],
                           software=software())
        if compute_fp or not labelled:  # new numbers, or the method added to an older file
            run_on_main(results.save, f"writing {out}", dist.device)
        say(f"FP: {score(results.data['fp'])}; max act backbone / head: "
            f"{results.data['max_act']['backbone']:.2f} / {results.data['max_act']['head']:.2f}", flush=True)

        for name, b in todo:
            flag = f"--quant-options {name}.{SAMPLE_OPTIONS.get(name)}"  # names the count in errors
            data = PipelineData(
                detector_samples=lambda count, seed, flag=flag: DetectorSamples(cfg, count, seed, flag, images),
                train_detector=lambda student, stage1, work_dir: train_activation_qat(student, cfg, stage1, work_dir),
                work_prefix=work_prefix, identity=train_data)
            say(f"{name} {b} ...", flush=True)
            entry = evaluate_quantized(name, model, feed, b, options=options[name], data=data,
                                       eval_fn=lambda q: evaluate_detector(q, cfg, loader, progress=dist.is_main))
            report = entry.pop("report", {})
            entry["summary"] = report.get("summary")
            entry["software"] = software()  # of the call that quantized and scored it (an earlier one's keep theirs)
            for key in ("units", "stage1", "qwt"):  # APHQ's reconstruction, GPLQ's training and compensation
                if key in report:
                    entry[key] = report[key]
            results.add(name, b, entry, settings(args, name, user_options.get(name), test_batch, parsed_options[name],
                                                 train_sha))
            run_on_main(results.save, f"writing {out}", dist.device)
            say(f"{name} {b}: {score(entry)} ({entry['seconds']:.0f} s)", flush=True)
        say(markdown_row(results.data))
        say(f"results in {out}")
    return results.data


def evaluation_reads(pipelines: Sequence[str]):
    """The config keys an evaluation running `pipelines` reads (an override of another is refused): the model,
    the test loader and metric, what GPLQ's stage-1 runner takes from the config where GPLQ runs (env_cfg,
    log_processor, and under torchrun find_unused_parameters), and of train_dataloader what
    the pipelines read: nothing without a pipeline; its dataset (without its pipeline and indices, nor a
    wrapper's repeats: the images are drawn from the whole split, each once, and given the test pipeline,
    engine/detection/feeds.py; the same of every dataset a wrapper holds) for percentile, RepQ-ViT and APHQ; the
    whole loader but its batch size for GPLQ's stage 1."""
    from engine.detection import CommandReads, loader_arguments  # imports mmdet, an optional dependency
    from engine.distributed import launched_world_size
    keys = {"model", "test_dataloader", "test_evaluator", "train_dataloader", "default_scope"}
    instead = {"val_dataloader": "test_dataloader", "val_evaluator": "test_evaluator", "load_from": "--checkpoint",
               # the detector is built without it and takes every weight from --checkpoint (build_detector)
               "model.backbone.init_cfg": "--checkpoint",
               # GPLQ's stage 1 trains on train_dataloader (its sampler, workers) with a batch size of its own
               "train_dataloader.batch_size": "--quant-options gplq.batch_size_per_gpu=N"}
    does = "the evaluation scores --checkpoint on test_dataloader with test_evaluator"
    if not pipelines:
        keys.discard("train_dataloader")
        del instead["train_dataloader.batch_size"]  # the whole loader is unread
        does = "an evaluation without a quantization pipeline scores --checkpoint on test_dataloader only"
    elif "gplq" not in pipelines:
        instead.update({f"train_dataloader.{arg}": "" for arg in sorted(loader_arguments())})
        # also of a wrapped dataset (`wrapped` below): RepeatDataset's times, ClassBalancedDataset's oversample_thr
        # and MultiImageMixDataset's skip_type_keys only repeat or mix images, which the draw takes once each;
        # max_refetch bounds the random images put in place of one the pipeline drops, which the draw refuses
        instead.update({f"train_dataloader.dataset.{key}": "" for key in ("indices", "times", "oversample_thr",
                                                                           "skip_type_keys", "max_refetch")})
        instead["train_dataloader.dataset.pipeline"] = "test_dataloader.dataset.pipeline"
        does = (f"the evaluation ({', '.join(pipelines)}) scores --checkpoint on test_dataloader with test_evaluator "
                "and draws its calibration images from the whole of train_dataloader.dataset (each image once, "
                "whatever a dataset wrapper repeats) with the test pipeline (only GPLQ's stage 1 loads batches with "
                "train_dataloader)")
    else:
        # GPLQ's stage 1 runs MMEngine's Runner (engine/detection/qat.py), which reads env_cfg (not its dist_cfg:
        # the evaluation's ranks have met already), log_processor, and find_unused_parameters for the DDP wrapper it
        # makes under torchrun only
        keys |= {"env_cfg", "log_processor"}
        instead["env_cfg.dist_cfg"] = ""
        distributed = launched_world_size() > 1
        if distributed:
            keys.add("find_unused_parameters")
        does = ("the evaluation scores --checkpoint on test_dataloader with test_evaluator and trains GPLQ's stage 1 "
                "with MMEngine's Runner on the evaluation's ranks "
                f"({'in DDP' if distributed else 'in this one process, without DDP'})")
    return CommandReads(frozenset(keys), does, instead,
                        frozenset({"data_root"}),  # --data-root; it has no --work-dir, --launcher or --resume
                        wrapped=frozenset({"train_dataloader.dataset"}))


def check_scoring_evaluator(cfg) -> None:
    """Refuse a test metric that writes predictions without scoring them (CocoMetric's format_only): the result
    file would hold an FP entry without an mAP, which a later call takes as computed. Refuse one that dumps its
    predictions to a fixed place (outfile_prefix) too: every scoring of a call, full precision and each pipeline
    and bit-width, would write PREFIX.bbox.json ... over the one before, and over files already there."""
    from engine.detection import DetectionError
    metrics = cfg.test_evaluator if isinstance(cfg.test_evaluator, list) else [cfg.test_evaluator]
    if any(metric.get("format_only") for metric in metrics):
        raise DetectionError("test_evaluator.format_only=True writes the predictions without scoring them, and "
                             "evaluate_detection.py records mAPs: drop it (for a submission file, run MMDetection's "
                             "tools/test.py)")
    prefixes = [metric["outfile_prefix"] for metric in metrics if metric.get("outfile_prefix") is not None]
    if prefixes:
        raise DetectionError(f"test_evaluator.outfile_prefix={prefixes[0]}: each scoring of the call (full precision, "
                             "then every pipeline and bit-width) would write its predictions over the files there "
                             "and over the last scoring's: drop it (to dump one model's predictions, run "
                             "MMDetection's tools/test.py)")


def evaluator_files(cfg):
    """The annotation file the test metric reads (as the config gives it), or the list of those of a list of
    metrics (MMEngine's Evaluator takes either)."""
    metrics = cfg.test_evaluator if isinstance(cfg.test_evaluator, list) else [cfg.test_evaluator]
    files = [metric.get("ann_file") for metric in metrics]
    return files[0] if len(files) == 1 else files


def files_sha256(paths: Sequence[str]) -> str:
    """The SHA-256 of the files' contents, in their order (COCO's val annotations are 25 MB; 450 MB in the page
    cache took 0.67 s on a 2-core AMD EPYC VM, docs/measurements.md)."""
    import hashlib
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def config_hash(cfg) -> str:
    """A short hash of the merged config's text: the config files are named by path in the identity, and an
    edited file is another evaluation."""
    import hashlib
    return hashlib.sha256(cfg.pretty_text.encode()).hexdigest()[:16]


def pipeline_options(items, pipelines) -> dict:
    """{pipeline: {key: value}} from `PIPELINE.KEY=VALUE` items, typed and checked by the config schema as
    evaluate.py's `quant.PIPELINE.KEY=VALUE` (configs/loader.py: types, ranges, close matches of a typo). A
    pipeline that is not run is refused (its option would be ignored), a word naming no pipeline (a config
    override typed after the flag) as such, and so are aphq.calib_images and gplq.init_images (the calibration
    batch is --calib-images). An option that the others leave unread (configs/loader.py DETECTOR_RULES: gplq.lr
    or gplq.batch_size_per_gpu at gplq.steps=0) is refused in whatever order the items come."""
    import difflib
    from configs.loader import DETECTOR_RULES, IgnoredOverrideError, apply_overrides, check_keys_read
    from configs.schema import Config
    from quant import PIPELINES
    typed = Config()
    by_pipeline: dict = {}
    # spaces around `=` ("gplq.lr =1e-3", a quoted word): the config parser reads the key without them, and so must
    # the option looked up below and the item an error names (with the space it was an AttributeError traceback)
    items = ["=".join(part.strip() for part in item.partition("=")[::2]) if "=" in item else item for item in items]
    for item in items:
        key = item.partition("=")[0]
        name, _, option = key.partition(".")
        if "=" in item and option and name not in PIPELINES:  # `--quant-options aphq.iters=5 test_dataloader.x=1`:
            # the flag takes every word after it, and a config override typed there is no pipeline option (a bare
            # `iters=1` lacks its pipeline: the message below)
            close = difflib.get_close_matches(name, PIPELINES, n=1)
            raise ValueError(f"--quant-options {item}: {name} is no pipeline"
                             f"{f' (did you mean {close[0]}?)' if close else ''}; a config override goes after "
                             "the flags as key=value (or after --cfg-options), not inside --quant-options")
        if "=" not in item or not option or name not in pipelines:
            raise ValueError(f"--quant-options {item}: give PIPELINE.KEY=VALUE for a pipeline that runs "
                             f"({', '.join(pipelines) or 'none: a bare --quant scores full precision only'})")
        if option in ("calib_images", "init_images"):
            raise ValueError(f"--quant-options {key}: the calibration images are --calib-images")
        if option in by_pipeline.get(name, {}):  # one item after the other: the later would replace the earlier
            raise ValueError(f"--quant-options {key} is given twice; keep one")
        try:  # typed and checked item by item; whether it is read, below, once all are in
            apply_overrides(typed, [f"quant.{item}"], rules=())
        except ValueError as e:  # configs.loader.ConfigError, in the schema's names (quant.aphq.iters ...)
            raise ValueError(f"--quant-options {item}: " + _schema_words(e)) from None
        by_pipeline.setdefault(name, {})[option] = getattr(getattr(typed.quant, name), option)
    # Every option against the others at once: checked as each item came, batch_size_per_gpu before steps=0 met the
    # default steps and was taken (a rule of a detector's, DETECTOR_ONLY, which no later check of the mapping
    # applies). A detector's rules: aphq.act_lr is read at aphq.drop_prob=0 (the neck's units run without QDrop)
    given = {f"quant.{name}.{option}": value for name, chosen in by_pipeline.items()
             for option, value in chosen.items()}
    try:
        check_keys_read(typed, given, rules=DETECTOR_RULES)
    except IgnoredOverrideError as e:  # it starts `quant.KEY=VALUE would be ignored`: the item given for KEY
        item = next(item for item in items if str(e).startswith(f"quant.{item.partition('=')[0]}="))
        raise ValueError(f"--quant-options {item}: " + _schema_words(e)) from None
    return by_pipeline


def _schema_words(error: Exception) -> str:
    """A config error about a --quant-options item, without the config's own source word (command line)."""
    return str(error).replace("command line: ", "").replace("'quant.", "'")


def detection_defaults(name: str, args, given: Optional[dict] = None) -> dict:
    """The options a pipeline starts from on a detector: APHQ's and GPLQ's detection recipes (configs/quant.py),
    with their calibration / initialisation images the --calib-images batch. `given`: the user's options of that
    pipeline; with aphq.iters=0 there the recipe's recon_images is left out, as nothing reads it (parse_options
    refuses an unread option of the mapping it is handed, the recipe's as the user's), and with gplq.qwt=false
    the recipe's stage2_train_transform likewise (stage 2 draws images only for QwT's fits)."""
    from configs.quant import detection_recipe
    recipe = detection_recipe(name, args.calib_images)
    if name == "aphq" and (given or {}).get("iters") == 0:
        del recipe["recon_images"]
    if name == "gplq" and (given or {}).get("qwt") is False:
        del recipe["stage2_train_transform"]
    return recipe


def recorded_options(name: str, parsed, ranks: int) -> dict:
    """The options of pipeline `name` that its results record (`settings`): every option the detector rules read,
    as run (`parsed`: the detection recipe with the --quant-options given over it), each option whose null means a
    default the pipeline resolves at the value used (the pipeline's recorded_options: GPLQ's lr by the global batch
    on `ranks` processes and its scale_lr, percentile's levels; APHQ's hessian_eps a detector's DETECTION_EPS,
    not the classifier's probe default), as evaluate.py records a classifier's. Left out, a later change of the
    recipe or of a default would make an entry read as computed with the new one; engine/eval_results.py reads an
    entry written before, which holds the options given (and since, those resolved defaults), as run with the
    defaults and recipe of then for the others."""
    import dataclasses
    from configs.loader import unread_options
    from quant import PIPELINES
    from quant.aphq.detector import detection_eps
    used = dataclasses.replace(parsed, hessian_eps=detection_eps(parsed)) if name == "aphq" else parsed
    used = dataclasses.asdict(PIPELINES[name].recorded_options(used, ranks))
    unread = unread_options(f"quant.{name}", dataclasses.asdict(parsed), detector=True)
    return {key: value for key, value in used.items() if key not in unread}


def settings(args, pipeline: str, options=None, test_batch: int = 1, parsed=None,
             train_sha: Optional[str] = None) -> dict:
    """What a quantized result depends on besides the weights and data (a different value is another result):
    the calibration batch (its count and seed, and `train_sha`, the SHA-256 of the training split's annotation files
    it is drawn from by index), the user's `options` or, given `parsed` (the options as run), every option the run
    read (`recorded_options`), for GPLQ the number of ranks its stage 1 trained on, and under
    torchrun at a test batch of more than one image the number of ranks too: each rank batches the images of
    its shard, other batches than one process's, whose outputs round about 1e-7 apart, enough to flip 4-bit codes
    (docs/reproduce.md); at batch 1 (the paper configs') the scores are the one-process ones."""
    from engine.distributed import world_size
    from quant import run_settings
    ranks = world_size()
    if parsed is not None:
        options = recorded_options(pipeline, parsed, ranks)
    return {"calib_images": args.calib_images, "calib_seed": args.calib_seed,
            **({"train_annotations_sha256": train_sha} if train_sha is not None else {}),
            **({"options": options} if options else {}),
            **({"world_size": ranks} if ranks > 1 and test_batch > 1 else {}), **run_settings(pipeline)}


def score(metrics: dict) -> str:
    return f"box mAP {metrics.get('bbox_mAP', float('nan')):.3f} / mask mAP {metrics.get('segm_mAP', float('nan')):.3f}"


def markdown_row(data: dict) -> str:
    """The paper's Table 2 layout: Max. Act. (backbone / head) | FP | one column per pipeline and bit-width,
    each "box / mask" mAP."""
    def pair(m):
        return f"{m.get('bbox_mAP', float('nan')):.3f} / {m.get('segm_mAP', float('nan')):.3f}"
    cols = [(f"{p} {b}", pair(e)) for p, by_bits in data["quant"].items() for b, e in by_bits.items()]
    head = ["Max. Act. (backbone / head)", "FP"] + [c for c, _ in cols]
    act = data["max_act"]
    row = [f"{act['backbone']:.2f} / {act['head']:.2f}", pair(data["fp"])] + [v for _, v in cols]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), "| " + " | ".join(row) + " |"])


if __name__ == "__main__":
    from engine.distributed import OtherRankError
    from engine.runinfo import exit_with_error
    try:
        main()
    except (ValueError, FileNotFoundError) as e:  # DetectionError, ResultsError, a bad override
        exit_with_error(str(e), code=2)
    except OtherRankError as e:  # rank 0 prints the error itself
        exit_with_error(str(e), code=2)
