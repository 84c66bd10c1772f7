"""The scope table of quant/README.md: what each pipeline quantizes, per task, at what precision.

    python scripts/quant_scope.py            # print the table
    python scripts/quant_scope.py --write    # replace the table in quant/README.md (between its markers)

The table comes from `quant.scope.scope_table`: every pipeline run on a tiny GPT-2 and a tiny ViT (random
weights and inputs), each quantized copy described layer by layer. CPU, no downloads, seconds.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # repo root, for `quant`
from quant.scope import scope_table  # noqa: E402

README = ROOT / "quant" / "README.md"
BEGIN, END = "<!-- scope:begin (scripts/quant_scope.py --write) -->", "<!-- scope:end -->"


def readme_table(text: str) -> str:
    """The table currently in quant/README.md's text, between the markers."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in quant/README.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = scope_table()
    if not args.write:
        print(out)
        return
    text = README.read_text()
    head, rest = text.split(BEGIN, 1)
    README.write_text(head + BEGIN + "\n" + out + "\n" + END + rest.split(END, 1)[1])
    print(f"wrote the table into {README}")


if __name__ == "__main__":
    main()
