"""The scope table of quant/README.md: what each pipeline quantizes, per task, at what precision.

    python scripts/quant_scope.py            # print the table
    python scripts/quant_scope.py --write    # replace the table in quant/README.md (between its markers)

The table comes from `quant.scope.scope_table`: every pipeline run on a tiny GPT-2 and a tiny ViT (random
weights and inputs), each quantized copy described layer by layer. CPU, no downloads, seconds.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # repo root, for `quant`
sys.path.insert(0, str(ROOT / "scripts"))  # readme_tables
from quant.scope import scope_table  # noqa: E402
from configs.cli import first_line  # noqa: E402
from readme_tables import marked_table, table_command  # noqa: E402

README = ROOT / "quant" / "README.md"
BEGIN, END = "<!-- scope:begin (scripts/quant_scope.py --write) -->", "<!-- scope:end -->"


def readme_table(text: str) -> str:
    """The table currently in quant/README.md's text, between the markers."""
    return marked_table(text, BEGIN, END)


def main(argv=None) -> None:
    table_command(first_line(__doc__), scope_table, README, BEGIN, END, argv)


if __name__ == "__main__":
    main()
