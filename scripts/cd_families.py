"""The family coverage table of cd/README.md: what CD and each quantization pipeline do with timm's families.

    python scripts/cd_families.py            # print the table
    python scripts/cd_families.py --write    # replace the table in cd/README.md (between its markers)

CD column: `cd.families.describe_pairs` (pairs per block type by role, checked against a forward pass,
or the refusal). Quantization columns, W4A4 on the tiny model of each family (`cd.families`):
percentile and repq run the whole pipeline on 4 random images and one forward of the result; aphq and
gplq run the steps they start with (conversion with the pipeline's layout, the unit checks, calibration,
and, where quant.aphq.mlp_reconstruct is on (off by default), APHQ's MLP-reconstruction requirement),
not their reconstruction or training stages, which need data. A cell reads "supported" or "refused: <the first
clause of the error the pipeline raises>".
CPU, no downloads, seconds.
"""
from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # repo root, for `cd` and `quant`
sys.path.insert(0, str(ROOT / "scripts"))  # readme_tables
from cd.families import family_table  # noqa: E402
from quant import PIPELINES  # noqa: E402
from quant.aphq.mlp_recon import relu_mlps  # noqa: E402
from quant.calibrate import calibrate  # noqa: E402
from quant.convert import quantize_model  # noqa: E402
from quant.pipeline_base import parse_options  # noqa: E402
from quant.spec import parse_bits  # noqa: E402
from quant.units import check_unit_coverage, find_units  # noqa: E402
from configs.cli import first_line  # noqa: E402
from readme_tables import marked_table, table_command  # noqa: E402

README = ROOT / "cd" / "README.md"
BEGIN, END = "<!-- families:begin (scripts/cd_families.py --write) -->", "<!-- families:end -->"
BITS = "w4a4"


def _images(model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 32, 32, generator=g)


def _full_run(name: str):
    def check(model: nn.Module) -> None:
        quantized, _ = PIPELINES[name](model, _images(model), BITS)
        with torch.no_grad():
            quantized(_images(model))
    return check


def _start_of(name: str):
    def check(model: nn.Module) -> None:
        pipeline = PIPELINES[name]
        options = parse_options(pipeline.Options, None)
        if getattr(options, "mlp_reconstruct", False):
            relu_mlps(copy.deepcopy(model))  # raises for MLPs the reconstruction does not support
        quantized = quantize_model(model, pipeline.layout(parse_bits(BITS), options)).eval()
        check_unit_coverage(quantized, find_units(quantized))
        calibrate(quantized, _images(model))
    return check


def _cell(check):
    def run(model: nn.Module) -> str:
        try:
            check(model)
        except Exception as e:  # the table reports whatever the pipeline raises
            # the error's first clause: the list of layers and the advice to developers are left out
            return "refused: " + re.split(r": \[|: add |; add ", str(e).splitlines()[0])[0]
        return "supported"
    return run


COLUMNS = {"percentile": _cell(_full_run("percentile")), "repq": _cell(_full_run("repq")),
           "aphq (start)": _cell(_start_of("aphq")), "gplq (start)": _cell(_start_of("gplq"))}


def table() -> str:
    """The markdown table (family, timm model, CD pairs, one column per pipeline)."""
    torch.manual_seed(0)
    return family_table(COLUMNS)


def readme_table(text: str) -> str:
    """The table currently in cd/README.md's text, between the markers."""
    return marked_table(text, BEGIN, END)


def main(argv=None) -> None:
    table_command(first_line(__doc__), table, README, BEGIN, END, argv)


if __name__ == "__main__":
    main()
