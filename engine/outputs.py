"""Writing a script's outputs (tables, figures, benchmark files) so that a second command given the same output
cannot replace it without --overwrite.

`refuse_existing_outputs` refuses an existing output when a script starts; an output is written minutes or hours
later, and another command given the same --out meanwhile may have written it. Each output is therefore written
to a temporary file and then published by `run_dir.write_whole`: without --overwrite it appears only where no
file is (atomically), and otherwise the command stops with one RunDirError naming the file and --overwrite.
"""
from __future__ import annotations

import csv
import io
import json
import os
from typing import Any, Optional

from .run_dir import write_whole


def write_json(path: str, data: Any, overwrite: bool, **dump_options) -> None:
    """`data` as JSON at `path` (json.dump's `dump_options`, e.g. indent)."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, **dump_options)
    write_whole(path, write, overwrite)


def write_text(path: str, text: str, overwrite: bool, newline: Optional[str] = None) -> None:
    """`text` at `path`, UTF-8 whatever the locale (tables hold ± and †)."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline=newline) as f:
            f.write(text)
    write_whole(path, write, overwrite)


def write_bytes(path: str, data: bytes, overwrite: bool) -> None:
    """`data` at `path` as it is (a file made in memory, e.g. one whose digest was recorded before it is written)."""
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
    write_whole(path, write, overwrite)


def csv_text(rows, fieldnames: list[str], **writer_options) -> str:
    """`rows` (dicts) as CSV with a header, csv.DictWriter's line ends kept (written with newline="")."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=fieldnames, **writer_options)
    writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


def write_csv(path: str, rows: list[dict], fieldnames: list[str], overwrite: bool, **writer_options) -> None:
    """`rows` as CSV with a header at `path`, UTF-8 (a method or model name may carry any letter, or a †)."""
    write_text(path, csv_text(rows, fieldnames, **writer_options), overwrite, newline="")


def save_figure(fig, path: str, overwrite: bool, **savefig_options) -> None:
    """`fig.savefig` to `path`, in the format its extension names (the temporary's name has none)."""
    fmt = os.path.splitext(path)[1][1:].lower() or None
    write_whole(path, lambda tmp: fig.savefig(tmp, format=fmt, **savefig_options), overwrite)
