"""List the CD matrix pairs of any timm model, built on the `meta` device (no weights, no memory):

    python -m cd --model vit_base_patch16_224
    python -m cd --model swin_tiny_patch4_window7_224
    python -m cd --families        # what CD makes of each timm family (cd/families.py)
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Optional

import torch

from cd.pairs import ROLES, Pair, find_pairs
from cd.verify import UnsupportedModelError


def format_pairs(pairs: list[Pair]) -> str:
    """A plain-text table of pairs: index, role, kind, W2 name and shape, W1 and shape."""
    rows = [("#", "role", "kind", "W2 (downstream, decayed)", "W2 shape", "W1 (upstream)", "W1 shape")]
    for i, p in enumerate(pairs):
        rows.append((str(i), p.role, p.kind, p.name, "x".join(map(str, p.w2_shape)), p.upstream_label,
                     "x".join(map(str, p.w1_shape))))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    counts = {role: sum(p.role == role for p in pairs) for role in ROLES}
    lines.append(f"{len(pairs)} pairs: " + ", ".join(f"{r} {n}" for r, n in counts.items() if n))
    return "\n".join(lines)


class OneLineParser(argparse.ArgumentParser):
    """A usage error (`--modle`) as one `error:` line with status 2, as configs.cli.OneLineParser makes it for
    every other entry point: `cd` installs on its own (torch alone), so it cannot import configs."""

    def error(self, message: str):
        message = " ".join(message.splitlines())
        self.exit(2, f"error: {self.prog}: {message}; see {self.prog} --help\n")


def show(text: str) -> None:
    """Print `text`; a reader that has gone (`python -m cd ... | head -1`) ends the output quietly, as
    engine/console.py does for the entry points (`cd` installs without engine/): the descriptor is pointed at
    /dev/null so that neither this write nor the flush at exit ends in a BrokenPipeError traceback."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def main(argv: Optional[list[str]] = None) -> None:
    parser = OneLineParser(prog="python -m cd",  # not argparse's default, `__main__.py`
                           description="List the CD matrix pairs of a timm model (meta device).")
    parser.add_argument("--model", default=None, help="timm model name (default vit_base_patch16_224)")
    parser.add_argument("--families", action="store_true",
                        help="a table of timm's Transformer families: the pairs per block, or why refused")
    args = parser.parse_args(argv)
    if args.families and args.model is not None:  # one table per run: the other request would go unanswered
        parser.exit(2, f"error: --families lists every family, not --model {args.model}'s pairs; give one of "
                       "them\n")
    if args.families:
        from cd.families import family_table

        show(family_table())
        return
    try:
        import timm  # only the CLI needs timm
    except ImportError:
        parser.exit(2, 'error: python -m cd --model needs timm: pip install timm (or pip install ".[timm]")\n')
    if args.model is None:  # only when not given: an empty --model "$UNSET" is refused below, not the default's table
        args.model = "vit_base_patch16_224"
    if not timm.is_model(args.model):  # a typo: one line with the closest names, not a traceback
        close = difflib.get_close_matches(args.model, timm.list_models(), n=3, cutoff=0.6)
        parser.exit(2, f"error: unknown timm model {args.model!r}"
                       + (f"; did you mean {', '.join(close)}?" if close else "; see timm.list_models()") + "\n")
    with torch.device("meta"):  # shapes only: no weights, no memory, no download
        model = timm.create_model(args.model, pretrained=False)
    try:
        pairs = find_pairs(model)
    except UnsupportedModelError as e:  # one error line, no traceback: the model is refused, not broken
        parser.exit(2, f"error: {args.model}: {e}\n")
    show(f"{args.model}:\n{format_pairs(pairs)}")


if __name__ == "__main__":
    main()
