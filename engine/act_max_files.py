"""Files for the activation-maxima records of `engine.act_max.ActivationProbe`: a CSV and a per-block plot.

The plot draws one line per module type (norm1, attn.qkv, mlp.fc2, ..., block) over the block
index, on a log scale (engine.figures: matplotlib's object API on the Agg canvas), and the modules outside the
blocks that quant.act_max_extra_modules adds (records of block -1, counted in the module maximum) as points in a
column of their own left of block 0, so that the plot shows every maximum the module maximum is taken over.

Each file is made in memory (`csv_bytes`, `plot_bytes`): evaluate.py records their size and SHA-256 (`digest`) in the
result file before it writes them whole (engine.act_max_ownership: which files at their names it may replace).
"""
from __future__ import annotations

import hashlib
import io
import os
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from engine.figures import new_figure
from engine.outputs import csv_text

FIELDS = ("name", "kind", "block", "type", "max")


def csv_bytes(records: Sequence[Dict[str, object]]) -> bytes:
    """The CSV of `ActMaxResult.per_layer` records, UTF-8 (columns: name, kind, block, type, max, and kurtosis when
    the probe measured moments): one row per output measured, none for a module whose forward never ran."""
    fields = FIELDS + (("kurtosis",) if records and "kurtosis" in records[0] else ())
    return csv_text(({k: r[k] for k in fields} for r in records), list(fields)).encode("utf-8")


def digest(data: bytes) -> Dict[str, object]:
    """What a result file records of a maxima file it names: {"bytes": size, "sha256": hex digest}."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def file_digest(path: Union[str, Path]) -> Optional[Dict[str, object]]:
    """`digest` of the file at `path`, None where no file is (nothing, a folder, a link that reaches no file)."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return digest(f.read())


def csv_differs_from_record(max_act: dict, path: Union[str, Path]) -> bool:
    """Whether the maxima CSV at `path` is not the one a result file's `max_act` section records (the size and SHA-256
    evaluate.py wrote, engine.act_max_ownership): edited since, or another evaluation's put at its name, it holds
    maxima the recorded settings are not those of. A result written before digests records none: nothing to tell."""
    digests = max_act.get("digests")
    recorded = digests.get("csv") if isinstance(digests, dict) else None
    return recorded is not None and file_digest(path) != recorded


def max_by_type(records: Sequence[Dict[str, object]]) -> Dict[str, List[tuple]]:
    """{module type: [(block index, max), ...]} sorted by block index
    (records without a block are left to `outside_blocks`)."""
    out: Dict[str, List[tuple]] = defaultdict(list)
    for r in records:
        if int(r["block"]) >= 0:
            out[str(r["type"])].append((int(r["block"]), float(r["max"])))
    return {k: sorted(v) for k, v in out.items()}


OUTSIDE_X = -1  # the plot's column of the modules outside the blocks, left of block 0
OUTSIDE_TICK = "outside"


def outside_blocks(records: Sequence[Dict[str, object]]) -> Dict[str, List[float]]:
    """{module type: [max, ...]} of the records without a block (block -1: the modules quant.act_max_extra_modules
    adds, e.g. patch_embed.proj, or Swin's layers.N.downsample.reduction, one type for the stages' alike)."""
    out: Dict[str, List[float]] = defaultdict(list)
    for r in records:
        if int(r["block"]) < 0:
            out[str(r["type"])].append(float(r["max"]))
    return {k: sorted(v) for k, v in out.items()}


def plot_series(records: Sequence[Dict[str, object]]) -> List[tuple]:
    """What `plot` draws: (label, [(x, max), ...], joined) for each module type over the block index (max_by_type,
    joined by a line), then for each type of module outside the blocks (outside_blocks) its maxima at OUTSIDE_X,
    labelled '<type> (outside the blocks)', points only: every record's maximum, so the plot's highest module point
    is the module maximum evaluate.py reports (marked ‡ where it counts modules outside the blocks)."""
    series = [(typ, points, True) for typ, points in sorted(max_by_type(records).items())]
    return series + [(f"{typ} (outside the blocks)", [(OUTSIDE_X, v) for v in maxima], False)
                     for typ, maxima in sorted(outside_blocks(records).items())]


def plot_bytes(records: Sequence[Dict[str, object]], fmt: str = "png", title: str = "") -> bytes:
    """The plot of max |activation| per block for each module type (plot_series) as a `fmt` file (png, pdf)."""
    fig = new_figure(7, 4)
    ax = fig.add_subplot(1, 1, 1)
    for label, points, joined in plot_series(records):
        xs, ys = zip(*points)
        if joined:
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=2.0 if label == "block" else 1.0, label=label)
        else:  # no block index to draw a line over
            ax.plot(xs, ys, marker="D", markersize=4, linestyle="none", label=label)
    ax.set_yscale("log")
    if outside_blocks(records):  # the column at OUTSIDE_X is named, not "-1"
        ticks = [t for t in ax.get_xticks() if 0 <= t <= max(int(r["block"]) for r in records)
                 and float(t).is_integer()]
        ax.set_xticks([OUTSIDE_X] + ticks, [OUTSIDE_TICK] + [str(int(t)) for t in ticks])
    ax.set_xlabel("block")
    ax.set_ylabel("max |activation|")
    ax.set_title(title)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    data = io.BytesIO()
    fig.savefig(data, format=fmt)
    return data.getvalue()
