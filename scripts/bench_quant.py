"""Cost of fake-quantized evaluation against float evaluation, and of calibration, on synthetic data.

The target of the quantization issue: quantized evaluation costs at most 3x float evaluation. Both are
measured in one process on the same batch, warm-up excluded, as the median of several forward passes
(no data loading, so the ratio is the model's alone). Calibration (convert + 32-image calibration +
RepQ fold) is timed once per pipeline.

    python scripts/bench_quant.py                                    # GPU: ViT-B/16 at 224, batch 256
    python scripts/bench_quant.py --device cpu --model vit_small_patch16_224 --batch 8 --threads 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import timm
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from quant import PIPELINES  # noqa: E402


def timed_forward(model, x, device, repeats: int, warmup: int) -> float:
    """Median seconds of one forward pass over `repeats` timed passes."""
    times = []
    with torch.no_grad():
        for i in range(warmup + repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--calib", type=int, default=32)
    p.add_argument("--pipelines", nargs="*", default=["repq", "percentile"])
    p.add_argument("--bits", default="w4a4")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    p.add_argument("--out", default="", help="optional JSON path")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=1000).to(device).eval()
    size = model.patch_embed.img_size[0]
    x = torch.randn(args.batch, 3, size, size, device=device)
    calib = torch.randn(args.calib, 3, size, size, device=device)

    fp = timed_forward(model, x, device, args.repeats, args.warmup)
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu ({torch.get_num_threads()} threads)")
    result = {"model": args.model, "device": name, "batch": args.batch, "fp_forward_s": fp, "pipelines": {}}
    print(f"{args.model} on {name}, batch {args.batch}: float forward {fp * 1e3:.1f} ms")
    for pipeline in args.pipelines:
        start = time.perf_counter()
        qmodel, report = PIPELINES[pipeline](model, calib, args.bits)
        calibrate_s = time.perf_counter() - start
        q = timed_forward(qmodel, x, device, args.repeats, args.warmup)
        result["pipelines"][pipeline] = {"calibrate_s": calibrate_s, "forward_s": q, "ratio_vs_fp": q / fp}
        print(f"  {pipeline:>10} {args.bits}: calibration {calibrate_s:.1f} s, forward {q * 1e3:.1f} ms = "
              f"{q / fp:.2f}x float")
        del qmodel
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
