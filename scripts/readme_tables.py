"""Generated markdown tables kept inside a document between two marker comments, and the command line of
the scripts that generate them (scripts/cd_families.py: cd/README.md; scripts/quant_scope.py: quant/README.md).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # repo root, for `engine` and `configs`, also when this file is run by mistake
import torch  # noqa: E402

from configs.cli import OneLineParser  # noqa: E402
from engine.console import console_print  # noqa: E402
from engine.outputs import write_text  # noqa: E402


def marked_table(text: str, begin: str, end: str) -> str:
    """The text between the markers (what the document holds now)."""
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


def table_command(description: str, table: Callable[[], str], document: Path, begin: str, end: str,
                  argv: Optional[Sequence[str]] = None) -> None:
    """Print the table, or with --write replace the one between the markers of `document`."""
    parser = OneLineParser(description=description)
    parser.add_argument("--write", action="store_true", help=f"replace the table in {document.parent.name}/"
                                                              f"{document.name}")
    args = parser.parse_args(argv)
    threads = os.environ.get("OMP_NUM_THREADS", "1")  # the tables' figures are measured with this many threads
    if not threads.isdigit() or int(threads) < 1:  # OpenMP's lists (4,2) and empty values: say which number
        raise SystemExit(f"error: OMP_NUM_THREADS={threads!r}: give one positive number of threads, or unset it "
                         "(1 thread)")
    torch.set_num_threads(int(threads))
    out = table()
    if not args.write:
        console_print(out)  # on an ASCII console too
        return
    # the documents are UTF-8 (×, ±), whatever the locale; their line ends are kept as read (newline=""): a CRLF
    # checkout read as text and written back would turn every line of it LF
    with open(document, encoding="utf-8", newline="") as f:
        text = f.read()
    eol = "\r\n" if "\r\n" in text else "\n"
    if begin not in text or end not in text.split(begin, 1)[1]:  # an edit removed a marker: nothing to replace
        raise SystemExit(f"error: {document} lacks the markers {begin} ... {end} around its table; put them back "
                         "(git diff shows them) and run --write again")
    head, rest = text.split(begin, 1)
    # rewritten on purpose (overwrite), but whole: a kill mid-write leaves the document as it was, never cut short
    table = eol.join(out.split("\n"))
    write_text(str(document), head + begin + eol + table + eol + end + rest.split(end, 1)[1], overwrite=True,
               newline="")
    print(f"wrote the table into {document}")


if __name__ == "__main__":
    # a library: its command line is that of the scripts built on it
    print("error: scripts/readme_tables.py is a library used by scripts/cd_families.py and scripts/quant_scope.py; "
          "run one of those (--help says how)", file=sys.stderr)
    sys.exit(2)
