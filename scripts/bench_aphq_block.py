"""Time one APHQ unit: the APH Hessian and block-reconstruction iterations of one ViT block, then extrapolate.

The official recipe runs 20k reconstruction iterations (batch 32) per unit plus the APH of the unit on
1024 images (2 forward + backward passes of the float model per image). This script measures, on the
given device, the median time of one reconstruction iteration of `--block` (AdaRound + learned
activation scales + QDrop + APH-weighted loss, the code path of quant/reconstruct.py) and the time of
the Hessian on one batch, and extrapolates both to the official counts. Images are random: the cost
does not depend on their content. Quantizer parameters come from one quick RepQ-style calibration
pass, not from the APHQ output-MSE search, which this script does not time (quant/README.md estimates it).

    python scripts/bench_aphq_block.py --threads 1 --iters 5 --out /tmp/aphq_block.json  # ViT-B/16 224, CPU
    python scripts/bench_aphq_block.py --device cuda --iters 200                         # on a GPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Optional

import timm
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root, for `quant`
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for bench_quant
from bench_quant import refuse_unbuildable, timed  # noqa: E402
from quant.aphq.adaround import RoundingSchedule  # noqa: E402
from quant.calibrate import calibrate  # noqa: E402
from quant.convert import quantize_model  # noqa: E402
from quant.aphq.hessian import perturbation_hessian  # noqa: E402
from quant.modes import set_quant_state  # noqa: E402
from configs.quant import APHQOptions
from quant.aphq.pipeline import APHQPipeline  # noqa: E402
from quant.aphq.reconstruct import ReconSettings, reconstruct_unit  # noqa: E402
from quant.spec import Bits  # noqa: E402
from quant.units import capture_unit, find_units, model_logits  # noqa: E402
from bench_env import environment  # noqa: E402
from engine.outputs import refuse_others_files, write_json  # noqa: E402
from engine.run_dir import RunDirError, refuse_existing_outputs  # noqa: E402
from configs.cli import OneLineParser, at_least, torch_device  # noqa: E402


# By these --overwrite knows its own JSON (engine.outputs.refuse_others_files): keys every version of it has written
SOURCE = "scripts/bench_aphq_block.py"
RESULT_KEYS = ("model", "block", "hessian_batch_s", "extrapolated")
TIMED_KINDS = ("stem", "block", "merge")  # quant.units kinds whose APHQ reconstruction is the one timed here


def main(argv: list[str], on_figures: Optional[Callable[[dict], None]] = None) -> dict:
    """The timings as a dict (also printed, and written to --out). on_figures: called with the figures so far
    after the Hessian batch and after every reconstruction iteration (gpu_check.py keeps them, so that a stage
    stopped at its time budget leaves what it had measured)."""
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_base_patch16_224", help="timm model name (default: %(default)s)")
    p.add_argument("--img-size", type=at_least(1), default=224,
                   help="input side in pixels, a multiple of the patch size (default: %(default)s)")
    p.add_argument("--depth", type=at_least(1), default=None, help="override (smoke tests)")
    p.add_argument("--embed-dim", type=at_least(1), default=None,
                   help="override (smoke tests); heads = dim // 64 (at least 1), which must divide it")
    p.add_argument("--block", default="blocks.5",
                   help="the APHQ unit to reconstruct: the stem, a block or a patch merging (quant.units.find_units; "
                        "not the head, which APHQ reconstructs with a KL loss and no Hessian; default: %(default)s)")
    p.add_argument("--batch", type=at_least(1), default=32,
                   help="reconstruction batch (default: %(default)s, the official)")
    p.add_argument("--images", type=at_least(1), default=64,
                   help="cached images, at least --batch; the timing does not depend on them (default: %(default)s)")
    p.add_argument("--iters", type=at_least(1), default=5,
                   help="timed reconstruction iterations (default: %(default)s)")
    p.add_argument("--warmup", type=at_least(0), default=1,
                   help="untimed first reconstruction iterations, and Hessian batches before the timed one "
                        "(default: %(default)s)")
    p.add_argument("--official-iters", type=at_least(1), default=20000,
                   help="reconstruction iterations per unit of the official recipe, the extrapolation's count "
                        "(default: %(default)s)")
    p.add_argument("--official-images", type=at_least(1), default=1024,
                   help="images of the official APH pass (default: %(default)s)")
    p.add_argument("--device", type=torch_device, default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--threads", type=at_least(1), default=None,
                   help="torch CPU threads (default: torch's; 1 on a shared machine)")
    p.add_argument("--out", default="", help="JSON path (default: none, the timings are printed only)")
    p.add_argument("--overwrite", action="store_true", help="replace a JSON this script wrote at --out")
    args = p.parse_args(argv)
    heads = refuse_unbuildable(p, args)
    if args.images < args.batch:  # the Hessian batch would be smaller than the batch it is extrapolated by
        p.error(f"--images {args.images} < --batch {args.batch}: the timed Hessian batch needs --batch images")
    try:
        refuse_existing_outputs([args.out] if args.out else [], args.overwrite)  # before minutes of timing
        if args.out and args.overwrite:  # a file of another's at --out is not this script's to replace
            refuse_others_files([args.out], SOURCE, json_keys=RESULT_KEYS)
    except RunDirError as e:
        sys.exit(f"error: {e}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device
    # `is not None`: a size of 0 is refused by at_least(1) above, never dropped for the model's default
    kw = {"depth": args.depth} if args.depth is not None else {}
    if args.embed_dim is not None:
        kw.update(embed_dim=args.embed_dim, num_heads=heads)
    torch.manual_seed(0)
    try:
        fp = timm.create_model(args.model, img_size=args.img_size, **kw)
    except TypeError as e:  # a model whose constructor has no such argument (a CNN: resnet18 and img_size)
        sys.exit(f"error: --model {args.model} does not take --img-size / --depth / --embed-dim ({e}); give a ViT "
                 f"(e.g. vit_small_patch16_224)")
    embed = getattr(fp, "patch_embed", None)
    patch = getattr(embed, "patch_size", None)
    if patch is None:  # the input size is read off the patch embedding
        sys.exit(f"error: --model {args.model} is no vision Transformer with a patch embedding (a CNN?): this "
                 f"benchmark times an APHQ unit of a ViT; give e.g. vit_small_patch16_224")
    if args.img_size % patch[0]:  # a conv error below one patch; above, a smaller model than asked timed
        sys.exit(f"error: --img-size {args.img_size} is not a multiple of {args.model}'s patch size {patch[0]}; "
                 f"give a multiple of {patch[0]} (e.g. {args.img_size - args.img_size % patch[0] or patch[0]})")
    fp = fp.to(device).eval().requires_grad_(False)
    # the units APHQ reconstructs with the APH-weighted loss timed here (quant/aphq/pipeline.py): any other module
    # (the root "", a layer inside a block, the head) would be timed and extrapolated as a unit it never is
    units = [u.name for u in find_units(fp, kinds=TIMED_KINDS)]
    if args.block not in units:
        p.error(f"--block {args.block!r}: not an APHQ unit of {args.model} that this script times (the stem, a "
                f"block or a patch merging; the head's reconstruction has no Hessian): give one of {', '.join(units)}")
    images = torch.randn(args.images, 3, args.img_size, args.img_size)

    options = APHQOptions()
    qmodel = quantize_model(fp, APHQPipeline().layout(Bits(4, 4), options)).eval().requires_grad_(False)
    calibrate(qmodel, images[: min(8, args.images)])  # quick parameters: the timing does not depend on them
    set_quant_state(qmodel, weights=False, activations=False)
    set_quant_state(qmodel.get_submodule(args.block), weights=True, activations=True)

    fp_in, fp_out = capture_unit(fp, args.block, images, args.batch, inputs=True, outputs=True)
    batch_imgs = images[: args.batch]
    # the float logits outside the timed part: APHQ computes them once for every unit (quant/aphq/pipeline.py
    # fp_logits), so a unit's APH is the perturbed passes alone
    logits = model_logits(fp, batch_imgs, args.batch)
    for _ in range(args.warmup):  # untimed, as the first iterations: the first backward passes' one-time costs
        perturbation_hessian(fp, args.block, batch_imgs, logits, args.batch)  # (CUDA's kernel loading, allocations)
    h, hessian_batch_s = timed(lambda: perturbation_hessian(fp, args.block, batch_imgs, logits, args.batch), device)

    base = {"model": args.model, "img_size": args.img_size, "overrides": kw, "block": args.block,
            "batch": args.batch, **environment(device), "threads": torch.get_num_threads()}

    def figures(stamps: list[float]) -> dict:
        """The result so far: the Hessian batch, and the reconstruction iterations once one is timed."""
        extrapolated = {}
        result = dict(base)
        # each stamp counts from one taken before the first iteration (quant/aphq/reconstruct.py's `start`):
        # iteration 1 took stamps[0], iteration i stamps[i - 1] - stamps[i - 2]; the first --warmup are not timed
        per_iter = [b - a for a, b in zip([0.0, *stamps], stamps)][args.warmup:]
        if per_iter:
            per_iter_s = statistics.median(per_iter)
            result.update(timed_iters=len(per_iter), iter_s=round(per_iter_s, 4),
                          iter_s_min_max=[round(min(per_iter), 4), round(max(per_iter), 4)])
            extrapolated["reconstruction_s"] = round(per_iter_s * args.official_iters, 1)
        result["hessian_batch_s"] = round(hessian_batch_s, 4)
        extrapolated["hessian_s"] = round(hessian_batch_s * args.official_images / args.batch, 1)
        if per_iter:  # the unit's total only with both parts
            extrapolated["unit_s"] = round(sum(extrapolated.values()), 1)
        result["extrapolated"] = extrapolated
        return result

    stamps: list[float] = []
    if on_figures is not None:
        on_figures(figures(stamps))

    away = [0.0]  # seconds spent in on_figures so far: between two iterations' stamps, and no part of either

    def progress(metrics: dict) -> None:
        stamps.append(metrics["seconds"] - away[0])
        if on_figures is not None:
            start = time.perf_counter()
            on_figures(figures(stamps))  # gpu_check.py writes its figures file (fsync'd) here
            away[0] += time.perf_counter() - start

    total = args.warmup + args.iters
    settings = ReconSettings(
        iters=total, batch_size=args.batch, weight_lr=options.weight_lr, act_lr=options.act_lr,
        drop_prob=options.drop_prob, input_mix_prob=options.input_mix_prob,
        rounding=RoundingSchedule(total, warmup=0.0), normalize_loss=True, log_every=1)
    reconstruct_unit(qmodel.get_submodule(args.block), fp_in, fp_in, fp_out, h, "weighted_mse", settings,
                     torch.Generator(device=device).manual_seed(0), name=args.block, progress=progress)
    result = figures(stamps)
    print(json.dumps(result, indent=2))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        try:  # never over a file another command wrote since this one started
            if args.overwrite:  # nor over another's that another command put there meanwhile
                refuse_others_files([args.out], SOURCE, json_keys=RESULT_KEYS)
            write_json(args.out, result, args.overwrite, indent=2)
        except RunDirError as e:
            sys.exit(f"error: {e}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
