"""scripts/bench_aphq_block.py times --block only when it is one of the model's APHQ units that it times (the stem,
a block, a patch merging: the APH-weighted reconstruction). Any module name was accepted, the root "" and the head
among them, and extrapolated to the official counts as if APHQ reconstructed it so; now it is one `error:` line,
before any timing, that lists the units to give."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import load_script

SMALL = ["--img-size", "32", "--depth", "2", "--embed-dim", "64", "--batch", "4", "--images", "8", "--threads", "1"]
# a 2-block ViT's units, by hand: the patch embedding, then the blocks; the head is APHQ's too, with a KL loss and no
# Hessian, which is not the reconstruction timed here
UNITS = "patch_embed, blocks.0, blocks.1"


@pytest.mark.parametrize("block", ["", "head", "blocks.1.attn", "blocks.1.mlp.fc2", "blocks.2", "norm"])
def test_a_module_that_is_no_timed_unit_is_one_error_line_listing_the_units(block, monkeypatch, capsys):
    bench = load_script("bench_aphq_block")
    monkeypatch.setattr(bench, "perturbation_hessian", None)  # reached: a TypeError, not the refusal
    monkeypatch.setattr(bench, "quantize_model", None)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as refused:
            bench.main([*SMALL, "--block", block])
    finally:
        torch.set_num_threads(threads)  # the script sets the process-wide count
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert f"--block {block!r}: not an APHQ unit" in lines[0] and lines[0].split("give one of ")[1].startswith(
        UNITS + ";"), lines
