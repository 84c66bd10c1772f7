"""Time CD's pair checks: `find_pairs` with both checks, the meta forward alone, no check, and one plain forward.

`find_pairs(model)` (and so `ColinearityDecay(model)`) checks its pairs by one forward on the `meta` device
(cd/verify.py) and real forwards of one sample (cd/values.py): for a fused qkv one with V's rows set to zero, and
one per bit of the widest pair's channel index with some channels of every pair set to zero. This prints the
median time of each part on random weights, beside one plain forward of the same one-sample input, so that the
real check's cost reads as a number of forwards.

    python scripts/bench_pair_check.py                                  # timm ViT-B/16 at 224, CPU
    python scripts/bench_pair_check.py --lm-config configs/lm/gpt2.yaml  # models/gpt.py's GPT-2 Small, 1x1024
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import timm
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from cd import UnsupportedModelError, find_pairs  # noqa: E402
from cd.values import probe_input  # noqa: E402
from cd.verify import example_input, verify_pairs  # noqa: E402
from configs.cli import OneLineParser, at_least, torch_device  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for bench_env and bench_quant
from bench_env import environment  # noqa: E402
from bench_quant import timed  # noqa: E402


DEFAULT_MODEL = "vit_base_patch16_224"


def median_seconds(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of `repeats` calls of fn, each on finished CUDA work (bench_quant.timed)."""
    return statistics.median(timed(fn, device)[1] for _ in range(repeats))


def build(args) -> tuple[str, torch.nn.Module]:
    if args.lm_config is not None:
        from configs import ConfigError, load_config
        from models import build_model
        try:
            cfg = load_config([args.lm_config])  # the model only; no data is read
        except ConfigError as e:
            raise SystemExit(f"error: bench_pair_check.py: {e}") from None
        return f"{cfg.model.name} ({args.lm_config})", build_model(cfg.model)
    return args.model or DEFAULT_MODEL, timm.create_model(args.model or DEFAULT_MODEL)


def main(argv: list[str]) -> dict:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help=f"timm model name (random weights; default {DEFAULT_MODEL}); not with --lm-config")
    p.add_argument("--lm-config", default=None, help="a configs/lm/*.yaml whose model to build instead of --model")
    p.add_argument("--repeats", type=at_least(1), default=5,
                   help="timed calls of each part, the median reported (default: %(default)s)")
    p.add_argument("--device", type=torch_device, default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    # one model is timed: the other flag would be dropped unread
    if args.lm_config is not None and args.model is not None:
        p.error(f"--model {args.model} and --lm-config {args.lm_config} each name the model to time; give one")
    if args.lm_config is not None and not os.path.isfile(args.lm_config):  # '' too: it was the default timm model
        p.error(f"--lm-config {args.lm_config!r}: no such file; give a configs/lm/*.yaml")
    if args.model is not None and not timm.is_model(args.model):  # timm's RuntimeError traceback otherwise
        p.error(f"--model {args.model}: not a timm model name (timm.list_models('vit_*') lists some)")
    if args.threads:
        torch.set_num_threads(args.threads)
    name, model = build(args)
    model = model.to(args.device).eval()
    try:  # once untimed: the first call's imports and allocations are not the check's cost
        pairs = find_pairs(model)
    except UnsupportedModelError as e:  # a model CD finds no pairs in (a CNN): one line, not a traceback
        p.error(f"--lm-config {args.lm_config}: {e}" if args.lm_config is not None else f"--model {name}: {e}")
    sample_args, sample_kwargs = probe_input(example_input(model), args.device)

    def plain_forward():
        with torch.no_grad():
            model(*sample_args, **sample_kwargs)

    result = {
        "model": name, **environment(args.device), "threads": torch.get_num_threads(), "pairs": len(pairs),
        "find_pairs_s": median_seconds(lambda: find_pairs(model), args.repeats, args.device),
        "meta_check_s": median_seconds(lambda: verify_pairs(model, pairs, {}), args.repeats, args.device),
        "no_check_s": median_seconds(lambda: find_pairs(model, verify=False), args.repeats, args.device),
        "forward_s": median_seconds(plain_forward, args.repeats, args.device),
    }
    print(f"{name} on {result['device']} ({result['hardware']}, torch {result['torch']}, {result['threads']} threads), "
          f"{len(pairs)} pairs, median of {args.repeats}: find_pairs {result['find_pairs_s']:.3f} s, meta check "
          f"alone {result['meta_check_s']:.3f} s, verify=False {result['no_check_s']:.4f} s; one forward of the "
          f"check's one-sample input {result['forward_s']:.3f} s")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
