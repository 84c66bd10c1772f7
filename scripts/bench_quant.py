"""Cost of fake-quantized evaluation against float evaluation, and of calibration, on synthetic data.

The project's target: quantized evaluation costs at most 3x float evaluation. Both are
measured in one process on the same batch, warm-up excluded, as the median of several forward passes
(no data loading, so the ratio is the model's alone). Calibration (convert + calibration on --calib images +
RepQ fold) is timed once per pipeline.

APHQ and GPLQ draw their own training images (here random ones), --calib of them for their calibration (APHQ's
calib_images, GPLQ's init_images), and run with `QUICK` iteration counts:
the quantized model they produce, whose forward pass is what is timed, has the same layers and cost
whatever the counts, but their `calibrate_s` is then not the recipe's (scripts/bench_aphq_block.py
times APHQ's unit at the official counts). With --out, the JSON is written after the float timing and
rewritten after each pipeline, each time whole (a temporary file renamed into place): a run stopped at any
point leaves what it had measured, never a torn file. It records the device, its hardware and the torch / CUDA /
timm versions, as bench_overhead.py and overhead_epochs.py do (scripts/bench_env.py).

    python scripts/bench_quant.py                                    # GPU: ViT-B/16 at 224, batch 256
    python scripts/bench_quant.py --pipelines percentile repq gplq aphq   # all four
    python scripts/bench_quant.py --device cpu --model vit_small_patch16_224 --batch 8 --threads 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Optional

import timm
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from engine.loop import TrainBatches  # noqa: E402
from quant import PIPELINES, PipelineData, parse_bits  # noqa: E402
from engine import outputs  # noqa: E402
from engine.run_dir import RunDirError, prepare_folder, refuse_existing_outputs  # noqa: E402
from configs.cli import OneLineParser, at_least, refuse_repeats, torch_device  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for bench_env
from bench_env import environment  # noqa: E402

# By these --overwrite knows its own JSON (engine.outputs.refuse_others_files): keys every version of it has written
SOURCE = "scripts/bench_quant.py"
RESULT_KEYS = ("model", "fp_forward_s", "pipelines")
# Iteration counts that make APHQ and GPLQ quantize a ViT-B in seconds on a GPU (see the docstring). APHQ's eq_n
# is the smallest its check accepts at any width (2 ranges per zero point of a grid of 16): its quantized model
# is the same size whatever the grid, and the calibration is faster (gpu_check --smoke's quant-stage model with
# --threads 1 on a 2-core AMD EPYC VM: 1.5 s against 3.8 s at the default 128).
# Their calibration counts are --calib's (`quick_options`).
QUICK = {
    "aphq": dict(iters=2, recon_images=32, batch_size=16, matmul_steps=9, search_rounds=1, eq_n=32, log_every=1),
    "gplq": dict(steps=2, batch_size_per_gpu=16, pca_images=32, stage2_images=32, log_every=1, ckpt_every=0),
}


def quick_options(pipeline: str, calib: int) -> Optional[dict]:
    """`QUICK`'s options of `pipeline` with a calibration set of `calib` images (--calib; None for a pipeline that
    calibrates on the images it is given). These pipelines draw their own images and ignore the ones given, so
    --calib reaches them as a count: APHQ's calibration set is the first calib_images of its recon_images (so at
    least that many are drawn), GPLQ's calibration pass is on init_images."""
    if pipeline == "aphq":
        return dict(QUICK["aphq"], calib_images=calib, recon_images=max(QUICK["aphq"]["recon_images"], calib))
    if pipeline == "gplq":
        return dict(QUICK["gplq"], init_images=calib)
    return None


class FixedOrder:
    """A sampler stand-in for fixed batches (TrainBatches needs one)."""

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        pass


def random_pipeline_data(img_size: int, num_classes: int) -> PipelineData:
    """Seeded random CPU images and labels for the pipelines that draw training data (timing only)."""

    def train_images(count: int, seed: int, train_transform: bool) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(count, 3, img_size, img_size, generator=g)

    def train_loader(batch_size_per_gpu: int, seed: int) -> TrainBatches:
        x = train_images(4 * batch_size_per_gpu, seed, True)
        y = torch.arange(len(x)) % num_classes
        batches = [(x[i:i + batch_size_per_gpu], y[i:i + batch_size_per_gpu]) for i in range(0, len(x),
                                                                                          batch_size_per_gpu)]
        return TrainBatches(batches, FixedOrder())

    return PipelineData(train_images=train_images, train_loader=train_loader, work_prefix=None)


def timed(fn, device: torch.device) -> tuple:
    """(fn(), its wall seconds). On CUDA the device is synchronized before the clock starts (kernels queued
    earlier stay out) and before it stops (the kernels fn queued are in: CUDA calls return before they run)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    value = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return value, time.perf_counter() - start


def timed_forward(model, x, device, repeats: int, warmup: int) -> float:
    """Median seconds of one forward pass over `repeats` timed passes."""
    with torch.no_grad():
        times = [timed(lambda: model(x), device)[1] for _ in range(warmup + repeats)]
    return statistics.median(times[warmup:])


def calibrate(pipeline: str, model, calib: torch.Tensor, bits: str, size: int, device: torch.device) -> tuple:
    """(the quantized model, the QUICK options it ran with or None, the seconds its calibration took): convert,
    calibration on `calib` (on APHQ and GPLQ, on random images of their own) and fold, timed with `timed`."""
    options = quick_options(pipeline, len(calib))
    data = random_pipeline_data(size, 1000) if options is not None else None
    (qmodel, _), seconds = timed(lambda: PIPELINES[pipeline](model, calib, bits, options, data=data), device)
    return qmodel, options, seconds


def vit_heads(embed_dim: int) -> int:
    """The attention heads the ViT benchmarks give a width: head dim 64, at least one head."""
    return max(1, embed_dim // 64)


def undivided_heads(flag: str, embed_dim: int) -> Optional[str]:
    """The usage error for a width that its `vit_heads` do not divide (timm's AssertionError traceback once the
    model is built, after minutes of timing in a sweep), or None. Shared by every ViT benchmark that takes a width
    (this script, bench_aphq_block.py, bench_overhead.py)."""
    heads = vit_heads(embed_dim)
    if embed_dim % heads == 0:
        return None
    return (f"{flag} {embed_dim}: its {heads} heads (dim // 64) do not divide it; give a multiple of 64, "
            "or less than 128")


def refuse_unbuildable(p, args) -> Optional[int]:
    """Usage errors of the ViT benchmarks' shared flags (this script's and bench_aphq_block.py's), each one line
    before any timing; the heads of an --embed-dim override (None without one)."""
    if args.overwrite and not args.out:  # nothing would be replaced: the flag was meant with an --out
        p.error("--overwrite replaces the --out file, and no --out is given: add --out PATH, or drop --overwrite")
    if not timm.is_model(args.model):  # timm's RuntimeError traceback otherwise
        p.error(f"--model {args.model}: not a timm model name (timm.list_models('vit_*') lists some)")
    if args.embed_dim is None:
        return None
    refusal = undivided_heads("--embed-dim", args.embed_dim)
    if refusal:
        p.error(refusal)
    return vit_heads(args.embed_dim)


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_base_patch16_224", help="timm model name (default: %(default)s)")
    p.add_argument("--img-size", type=at_least(1), default=None, help="override (smoke runs)")
    p.add_argument("--depth", type=at_least(1), default=None, help="override (smoke runs)")
    p.add_argument("--embed-dim", type=at_least(1), default=None,
                   help="override (smoke runs); heads = dim // 64 (at least 1), which must divide it")
    p.add_argument("--device", type=torch_device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda if torch sees a CUDA device, else cpu)")
    p.add_argument("--batch", type=at_least(1), default=256, help="images per timed forward (default: %(default)s)")
    p.add_argument("--calib", type=at_least(1), default=32,
                   help="calibration images (APHQ's calib_images, GPLQ's init_images; default: %(default)s)")
    # "+": an empty --pipelines timed the float model alone and exited 0
    p.add_argument("--pipelines", nargs="+", default=["repq", "percentile"], choices=sorted(PIPELINES),
                   metavar="PIPELINE", help=f"pipelines to time, of {', '.join(sorted(PIPELINES))} (default: repq "
                                            f"percentile)")
    p.add_argument("--bits", default="w4a4", help="bit-width, e.g. w4a4 or w8a8 (default: %(default)s)")
    p.add_argument("--repeats", type=at_least(1), default=10,
                   help="timed forwards, the median reported (default: %(default)s)")
    p.add_argument("--warmup", type=at_least(0), default=3,
                   help="untimed forwards before them (default: %(default)s)")
    p.add_argument("--threads", type=at_least(0), default=0, help="CPU threads (0: torch default)")
    p.add_argument("--out", default="", help="optional JSON path")
    p.add_argument("--overwrite", action="store_true", help="replace a JSON this script wrote at --out")
    args = p.parse_args(argv)
    # timed again, a second line printed, and only the last timing kept under its key in --out
    refuse_repeats(p, ("--pipelines", args.pipelines))
    try:  # a usage error (status 2), as argparse's: 'w4' is no bit-width, not one a pipeline cannot do
        bits = parse_bits(args.bits)
    except ValueError as e:
        p.error(f"--bits {args.bits}: {e}")
    heads = refuse_unbuildable(p, args)
    try:
        refuse_existing_outputs([args.out] if args.out else [], args.overwrite)  # before minutes of timing
        if args.out and args.overwrite:  # a file of another's at --out is not this script's to replace
            outputs.refuse_others_files([args.out], SOURCE, json_keys=RESULT_KEYS)
        if args.out:  # its folder too: open() after the timings failed on a folder that was not there
            prepare_folder(os.path.dirname(os.path.abspath(args.out)), setting="--out")
        for pipeline in args.pipelines:  # a bit-width a pipeline cannot do: now, not after the float timing
            PIPELINES[pipeline].validate(bits, PIPELINES[pipeline].Options(
                **(quick_options(pipeline, args.calib) or {})))
    except (RunDirError, ValueError) as e:
        sys.exit(f"error: {e}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    torch.manual_seed(0)
    # `is not None`: a size of 0 is refused by at_least(1) above, never dropped for the model's default
    kw = {k: v for k, v in (("img_size", args.img_size), ("depth", args.depth)) if v is not None}
    if args.embed_dim is not None:
        kw.update(embed_dim=args.embed_dim, num_heads=heads)
    flags = " / ".join(f"--{k.replace('_', '-')}" for k in ("img_size", "depth", "embed_dim") if k in kw)
    try:
        model = timm.create_model(args.model, num_classes=1000, **kw).to(device).eval()
    except TypeError as e:  # a model whose constructor has no such argument (a CNN: resnet18 and img_size)
        sys.exit(f"error: --model {args.model} does not take {flags or 'these arguments'} ({e}); drop them, or give "
                 f"a ViT (e.g. vit_small_patch16_224)")
    embed = getattr(model, "patch_embed", None)
    if getattr(embed, "img_size", None) is None:  # the input size is read off the patch embedding
        sys.exit(f"error: --model {args.model} is no vision Transformer with a patch embedding (a CNN?): this "
                 f"benchmark times quantized ViTs and Swins; give e.g. vit_small_patch16_224")
    size, patch = embed.img_size[0], embed.patch_size[0]
    if size % patch:  # the patch convolution's stride drops the rest: a smaller model than asked would be timed
        sys.exit(f"error: --img-size {size} is not a multiple of {args.model}'s patch size {patch}: its last "
                 f"{size % patch} pixel rows and columns would be dropped; give a multiple of {patch} (e.g. "
                 f"{size - size % patch or patch})")
    x = torch.randn(args.batch, 3, size, size, device=device)
    calib = torch.randn(args.calib, 3, size, size, device=device)

    fp = timed_forward(model, x, device, args.repeats, args.warmup)
    env = environment(device)  # the same fields as bench_overhead.py's and overhead_epochs.py's JSON
    result = {"model": args.model, "overrides": kw, "img_size": size, "bits": args.bits, **env,
              "threads": torch.get_num_threads(), "batch": args.batch, "fp_forward_s": fp, "pipelines": {}}
    print(f"{args.model} on {env['device']} ({env['hardware']}, {torch.get_num_threads()} threads), batch "
          f"{args.batch}: float forward {fp * 1e3:.1f} ms")
    try:  # the first write: never over a file another command wrote since this one started
        if args.out and args.overwrite:  # nor over another's that another command put there meanwhile
            outputs.refuse_others_files([args.out], SOURCE, json_keys=RESULT_KEYS)
        write_json(args.out, result, args.overwrite)
    except RunDirError as e:
        sys.exit(f"error: {e}")
    for pipeline in args.pipelines:
        qmodel, options, calibrate_s = calibrate(pipeline, model, calib, args.bits, size, device)
        quick = options is not None
        q = timed_forward(qmodel, x, device, args.repeats, args.warmup)
        result["pipelines"][pipeline] = {"calibrate_s": calibrate_s, "forward_s": q, "ratio_vs_fp": q / fp,
                                         **({"options": options} if quick else {})}
        print(f"  {pipeline:>10} {args.bits}: calibration {calibrate_s:.1f} s{' (quick)' if quick else ''}, "
              f"forward {q * 1e3:.1f} ms = {q / fp:.2f}x float", flush=True)
        del qmodel
        write_json(args.out, result, True)  # after each pipeline (over its own file): a run stopped later keeps
        # what it measured
    return result


def write_json(path: str, result: dict, overwrite: bool) -> None:
    """`result` to `path` (nothing without one), whole or not at all: written to a temporary file, then
    renamed over `path`, so that a process killed mid-write (gpu_check.py's stage budget) leaves the last
    complete version (write_whole: the temporary is no user's file, and an interrupt removes it). Without
    `overwrite`, a file at `path` (another command's, written since this one started) is refused: RunDirError."""
    if not path:
        return
    outputs.write_json(path, result, overwrite, indent=2)


if __name__ == "__main__":
    main()
