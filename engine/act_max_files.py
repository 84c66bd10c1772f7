"""Files for the activation-maxima records of `engine.act_max.ActivationProbe`: a CSV and a per-block plot.

The plot draws one line per module type (norm1, attn.qkv, mlp.fc2, ..., block) over the block
index, on a log scale (engine.figures: matplotlib's object API on the Agg canvas).

Each file is written whole (engine.outputs: a temporary file beside it, then a rename): a file at its name is the
earlier complete one or the new complete one, never a torn one that a Ctrl-C or a full disk left half written,
and the temporary is removed on failure.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Sequence, Union

from engine.figures import new_figure
from engine.outputs import save_figure, write_csv as write_csv_whole

FIELDS = ("name", "kind", "block", "type", "max")


def write_csv(records: Sequence[Dict[str, object]], path: Union[str, Path]) -> Path:
    """Write `ActMaxResult.per_layer` records (columns: name, kind, block, type, max, and kurtosis when the
    probe measured moments): one row per output measured, none for a module whose forward never ran."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = FIELDS + (("kurtosis",) if records and "kurtosis" in records[0] else ())
    # replaced whole: the result file names it before it is written (evaluate.py), and may name the earlier one
    write_csv_whole(str(path), [{k: r[k] for k in fields} for r in records], list(fields), overwrite=True)
    return path


def max_by_type(records: Sequence[Dict[str, object]]) -> Dict[str, List[tuple]]:
    """{module type: [(block index, max), ...]} sorted by block index
    (records without a block are dropped)."""
    out: Dict[str, List[tuple]] = defaultdict(list)
    for r in records:
        if int(r["block"]) >= 0:
            out[str(r["type"])].append((int(r["block"]), float(r["max"])))
    return {k: sorted(v) for k, v in out.items()}


def plot(records: Sequence[Dict[str, object]], path: Union[str, Path], title: str = "") -> Path:
    """Save a PNG/PDF of max |activation| per block for each module type."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = new_figure(7, 4)
    ax = fig.add_subplot(1, 1, 1)
    for typ, points in sorted(max_by_type(records).items()):
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=2.0 if typ == "block" else 1.0, label=typ)
    ax.set_yscale("log")
    ax.set_xlabel("block")
    ax.set_ylabel("max |activation|")
    ax.set_title(title)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    save_figure(fig, str(path), overwrite=True)  # in the format the extension names, replaced whole
    return path
