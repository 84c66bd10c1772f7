"""Collect evaluate.py results (JSON files) into one markdown table in the layout of the paper's tables.

    python scripts/paper_table.py runs/pretrain/*/eval_best.json
    python scripts/paper_table.py runs/sweeps/digits/*/eval_best.json --out results/digits.md
    python scripts/paper_table.py runs/sweeps/fashion_mnist_mini/*/eval_best.json --over-seeds  # mean ± std
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from evaluate import markdown_table  # noqa: E402


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="JSON files written by evaluate.py")
    p.add_argument("--out", help="also write the table to this file")
    p.add_argument("--over-seeds", action="store_true",
                   help="one row per model and method: mean ± std over its results (the seeds of a sweep)")
    args = p.parse_args(argv)
    results = []
    for path in args.results:
        with open(path) as f:
            results.append(json.load(f))
    table = markdown_table(results, over_seeds=args.over_seeds)
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return table


if __name__ == "__main__":
    main()
