"""Writing a script's outputs (tables, figures, benchmark files) so that a second command given the same output
cannot replace it without --overwrite.

`refuse_existing_outputs` refuses an existing output when a script starts; an output is written minutes or hours
later, and another command given the same --out meanwhile may have written it. Each output is therefore written
to a temporary file and then published by `run_dir.write_whole`: without --overwrite it appears only where no
file is (atomically), and otherwise the command stops with one RunDirError naming the file and --overwrite.
A script whose outputs have fixed names marks them (`source_mark` in a PNG, its columns in a CSV's header, its own
keys in a JSON object, the header line of its table in a Markdown report) and lets --overwrite replace only files
so marked (`refuse_others_files`).
"""
from __future__ import annotations

import csv
import io
import json
import os
from typing import Any, Optional

from .run_dir import RunDirError, write_whole

PNG_SOURCE_KEY = "Source"  # the PNG text entry (a tEXt chunk) that names the script that drew a figure


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


def source_mark(source: str) -> dict[str, str]:
    """The PNG text entries that mark a figure as drawn by the script `source` (its path in the repository, e.g.
    scripts/compare_act_max.py): save_figure's `metadata`, by which `refuse_others_files` knows the figure."""
    return {PNG_SOURCE_KEY: source}


def png_text(path: str) -> dict[str, str]:
    """The tEXt entries of the PNG file at `path` (keyword -> text, those before its image data), {} for a file that
    is no PNG."""
    entries = {}
    with open(path, "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            return {}
        while len(head := f.read(8)) == 8:
            size, kind = int.from_bytes(head[:4], "big"), head[4:]
            if kind in (b"IDAT", b"IEND"):
                break
            data = f.read(size)
            f.read(4)  # the chunk's CRC
            if kind == b"tEXt" and b"\0" in data:
                keyword, _, text = data.partition(b"\0")
                entries[keyword.decode("latin-1")] = text.decode("latin-1")
    return entries


def written_by(path: str, source: str, csv_fields=(), json_keys=(), md_head: str = "") -> bool:
    """Whether the file at `path` is an output of the script `source`: a PNG that holds its `source_mark`, a JSON
    object that holds every key of `json_keys`, a Markdown report whose first line is `md_head` (its table's
    header), a CSV whose header line is `csv_fields`'. A file is judged by its name's extension, but as a JSON
    object by `json_keys` alone (`_json_only`)."""
    try:
        if path.endswith(".png"):
            return png_text(path).get(PNG_SOURCE_KEY) == source
        if path.endswith(".json") or _json_only(csv_fields, json_keys, md_head):
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            return isinstance(data, dict) and set(json_keys) <= data.keys()
        head = md_head if path.endswith(".md") else ",".join(csv_fields)
        with open(path, "rb") as f:
            return f.readline().rstrip(b"\r\n") == head.encode()
    except (OSError, ValueError):  # ValueError: no JSON (UnicodeDecodeError is one)
        return False


def _json_only(csv_fields, json_keys, md_head: str) -> bool:
    """Whether a script's outputs are known by JSON keys alone: its JSON may lie at an --out of any name (a second
    run with --overwrite would read its own file as a CSV without a header otherwise)."""
    return bool(json_keys) and not csv_fields and not md_head


def refuse_others_files(paths: list[str], source: str, csv_fields=(), json_keys=(), md_head: str = "") -> None:
    """A RunDirError naming the first file of `paths` there that the script `source` did not write (`written_by`):
    its --overwrite replaces only its own outputs ("Nothing lost"), never a figure or table another script or a
    person put at the same name."""
    for path in paths:
        if os.path.exists(path) and not written_by(path, source, csv_fields, json_keys, md_head):
            mark = f"its PNG text {PNG_SOURCE_KEY}" if path.endswith(".png") else \
                f"a JSON object with the keys {', '.join(json_keys)}" \
                if path.endswith(".json") or _json_only(csv_fields, json_keys, md_head) else \
                "the header of its table" if path.endswith(".md") else "the header of its columns"
            raise RunDirError(f"{path} is not a file {os.path.basename(source)} wrote ({mark} is not there), and "
                              "--overwrite replaces only those: choose another --out, or move the file aside")
