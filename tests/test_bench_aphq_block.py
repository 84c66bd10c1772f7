"""scripts/bench_aphq_block.py runs end to end on CPU with a tiny ViT and writes its JSON."""
from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import load_script


def test_bench_aphq_block_cpu_smoke(tmp_path):
    bench = load_script("bench_aphq_block")
    out = tmp_path / "block.json"
    threads = torch.get_num_threads()
    try:
        result = bench.main(["--img-size", "32", "--depth", "2", "--embed-dim", "64", "--block", "blocks.1",
                             "--batch", "4",
                             "--images", "8", "--iters", "2", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # the script sets the process-wide count
    assert result["timed_iters"] == 2 and result["iter_s"] > 0
    assert result["extrapolated"]["unit_s"] >= result["extrapolated"]["reconstruction_s"] > 0
    assert json.load(open(out))["block"] == "blocks.1"
    args = ["--img-size", "32", "--depth", "2", "--embed-dim", "64", "--block", "blocks.1", "--batch", "4",
            "--images", "8", "--iters", "2", "--threads", "1", "--out", str(out)]
    with pytest.raises(SystemExit, match="error: .*block.json already exist"):  # before any timing
        bench.main(args)
    with pytest.raises(SystemExit):  # a Hessian batch of 2 images extrapolated as one of 4
        bench.main([*args[:-2], "--images", "2", "--out", str(tmp_path / "other.json")])
    assert not (tmp_path / "other.json").exists()


def test_one_iteration_in_all_is_refused_before_any_timing(tmp_path, capsys):
    """An iteration is timed from the one before it: --warmup 0 --iters 1 would time none (a median of nothing)."""
    bench = load_script("bench_aphq_block")
    with pytest.raises(SystemExit) as refused:
        bench.main(["--warmup", "0", "--iters", "1", "--out", str(tmp_path / "block.json")])
    assert refused.value.code == 2
    assert capsys.readouterr().err.startswith("error: ") and not (tmp_path / "block.json").exists()
