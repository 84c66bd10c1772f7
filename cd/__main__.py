"""List the CD matrix pairs of any timm model, built on the `meta` device (no weights, no memory for them):

    python -m cd --model vit_base_patch16_224
    python -m cd --model swin_tiny_patch4_window7_224
    python -m cd --model eva02_tiny_patch14_224 --gated-mlp   # gated MLPs (SwiGLU) paired too, beyond the paper
    python -m cd --families        # what CD makes of each timm family (cd/families.py)

The table is the full-size model's, checked by the meta forward. The checks on real numbers (which rows of a fused
qkv are V, in which order W2 reads W1's channels: `cd/values.py`), which a meta model has no values for, run on a
small copy built on the CPU: the family's tiny config where `cd/families.py` has one for the model, else the model
with one block per stage (`depth=1`, `depths=(1, ...)`) or at 128 px; a model refused there is refused here, and
where no small copy builds and runs, a line says that those checks were not run. `--gated-mlp` is find_pairs'
`gated_mlp=True` (train.py's `cd.gated_mlp=true`) on both, refused as there on a model without a gated MLP.
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
import warnings
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from cd.pairs import LEFT_OUT_LAYERS, ROLES, Pair, find_pairs
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


class StoreOnce(argparse.Action):
    """A single-value option given twice is refused (`--model a --model b` had listed b's pairs alone), as
    configs.cli.OneLineParser refuses it for the other entry points."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = namespace.__dict__.setdefault("_given", set())
        if self.dest in seen:
            parser.error(f"{self.option_strings[0]} is given twice; give it once")
        seen.add(self.dest)
        setattr(namespace, self.dest, values)


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


# a small copy's settings beyond a family's tiny config, tried in order: one block per stage, or a smaller image
_SMALL = (dict(depth=1), *(dict(depths=(1,) * n) for n in (4, 3, 2)), dict(img_size=128))


def _small_copies(name: str) -> Iterator[tuple[str, Callable[[], nn.Module], object]]:
    """(settings, builder, example input or None) of each small CPU copy of timm model `name` to try."""
    import timm

    from cd.families import FAMILIES, build_family

    for family, (timm_name, kwargs) in FAMILIES.items():
        if timm_name == name:
            yield f"cd/families.py's tiny {family} config", lambda family=family: build_family(family), None
    for kwargs in _SMALL:
        size = kwargs.get("img_size")  # the example's size: a model's own default may be the full size's
        example = None if size is None else torch.empty(1, 3, size, size, device="meta")
        yield (", ".join(f"{k}={v}" for k, v in kwargs.items()),
               lambda kwargs=kwargs: timm.create_model(name, pretrained=False, **kwargs).eval(), example)


def check_small_copy(name: str, gated_mlp: bool = False) -> Optional[str]:
    """Run `find_pairs` (with `gated_mlp`, as on the meta model) with its checks on real numbers on the first small
    CPU copy of timm model `name` that builds and runs (`_small_copies`), or return why none was checked.

    Raises:
        UnsupportedModelError: the copy's pairs are refused (a contradicted pair, not a forward that failed).
    """
    for settings, build, example in _small_copies(name):
        with torch.random.fork_rng(devices=[]):  # the caller's random streams untouched (main runs in tests)
            torch.manual_seed(0)
            try:
                model = build()
            except Exception:  # settings the model does not take (depth for a staged model): the next ones
                continue
            try:
                # the meta model's find_pairs has warned of the full-size model's half blocks and left-out layers,
                # which this smaller copy of it would name again: one warning per command (cd/README.md); refusals
                # are still raised
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="CD and TWEO leave out ")
                    warnings.filterwarnings("ignore", message=LEFT_OUT_LAYERS)
                    find_pairs(model, example, gated_mlp=gated_mlp)
            except UnsupportedModelError as e:
                if e.__cause__ is not None:  # its forward failed (a size it cannot take): not a refusal
                    continue
                raise UnsupportedModelError(f"{e} (found by the checks on real numbers, run on a copy built on the "
                                            f"CPU with {settings})") from None
        return None
    call = "find_pairs(model, gated_mlp=True)" if gated_mlp else "find_pairs(model)"
    return (f"note: {name}: the checks on real numbers (V rows, channel order) were not run: no small copy of it "
            f"could be built and run on the CPU; {call} on the real model runs them")


# find_pairs' words for its gated_mlp switch, in its refusals: the CLI names its own flag beside them
_LIBRARY_SWITCH = "gated_mlp=True (cd.gated_mlp=true)"
_CLI_SWITCH = "--gated-mlp (gated_mlp=True, cd.gated_mlp=true)"


def main(argv: Optional[list[str]] = None) -> None:
    parser = OneLineParser(prog="python -m cd",  # not argparse's default, `__main__.py`
                           description="List the CD matrix pairs of a timm model (meta device).")
    parser.add_argument("--model", default=None, action=StoreOnce,
                        help="timm model name (default vit_base_patch16_224)")
    parser.add_argument("--families", action="store_true",
                        help="a table of timm's Transformer families: the pairs per block, or why refused")
    parser.add_argument("--gated-mlp", action="store_true",
                        help="also pair gated MLPs (SwiGLU), beyond the paper: find_pairs' gated_mlp=True, "
                             "train.py's cd.gated_mlp=true; refused on a model without one")
    args = parser.parse_args(argv)
    if args.families and args.model is not None:  # one table per run: the other request would go unanswered
        parser.exit(2, f"error: --families lists every family, not --model {args.model}'s pairs; give one of "
                       "them\n")
    if args.families and args.gated_mlp:  # the table has both already: it would change nothing
        parser.exit(2, "error: --gated-mlp is for --model: --families already shows what cd.gated_mlp=true finds "
                       "in each family refused for its gated MLPs; drop --gated-mlp\n")
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
        # on the meta device: the structure and the meta forward's checks
        pairs = find_pairs(model, gated_mlp=args.gated_mlp)
        note = check_small_copy(args.model, gated_mlp=args.gated_mlp)
    except ValueError as e:  # one error line, no traceback: the model is refused, not broken
        # UnsupportedModelError, or (a plain ValueError, the only one the arguments given here can raise)
        # --gated-mlp on a model without a gated MLP, refused as find_pairs refuses it
        if not (isinstance(e, UnsupportedModelError) or args.gated_mlp):
            raise
        parser.exit(2, f"error: {args.model}: {str(e).replace(_LIBRARY_SWITCH, _CLI_SWITCH)}\n")
    show(f"{args.model}:\n{format_pairs(pairs)}")
    if note:
        print(note, file=sys.stderr)


if __name__ == "__main__":
    main()
