"""The tools in scripts/: every sweep expands into valid configs; a small sweep trains, evaluates and
tabulates end to end; the benchmarks run in their small CPU modes."""
import glob
import os
import sys

import pytest

from configs import ConfigError
from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import bench_quant  # noqa: E402
import paper_table  # noqa: E402
import sweep  # noqa: E402

SWEEPS = sorted(glob.glob(os.path.join(ROOT, "configs", "sweeps", "*.yaml")))


@pytest.mark.parametrize("path", SWEEPS, ids=os.path.basename)
def test_every_sweep_expands_into_valid_configs(path):
    runs = sweep.expand(path, ["data.root=/datasets/imagenet"])
    assert runs and len({r["name"] for r in runs}) == len(runs)
    out_dirs = [o for r in runs for o in r["overrides"] if o.startswith("out_dir=")]
    assert len(set(out_dirs)) == len(runs)  # every run writes to its own folder


def test_a_bad_key_in_a_sweep_names_the_run(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("configs: [configs/debug/tiny.yaml]\nruns:\n  first: [optim.lr=1e-3]\n"
                   "  second: [optim.lrr=1]\n")
    with pytest.raises(ConfigError, match="sweep run 'second'.*'optim.lr'"):
        sweep.expand(str(bad), [])


def test_a_small_sweep_trains_evaluates_and_tabulates(tmp_path, capsys):
    spec = tmp_path / "tiny_sweep.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\nruns:\n"
                    f"  base: []\n  cd: [configs/method/cd.yaml]\n")
    assert sweep.main([str(spec), "--run", "--evaluate", "train.max_steps=2", "quant.pipelines=[repq]"]) == 0
    results = sorted(glob.glob(str(tmp_path / "runs" / "*" / "eval_best.json")))
    assert len(results) == 2
    table = paper_table.main(results)
    assert "| vit_nano | Baseline |" in table and "| vit_nano | CD |" in table and "RepQ-ViT" in table


def test_bench_quant_reports_the_quantized_to_float_ratio():
    result = bench_quant.main(["--device", "cpu", "--model", "vit_tiny_patch16_224", "--batch", "2",
                               "--calib", "4", "--repeats", "2", "--warmup", "1", "--pipelines", "repq"])
    assert result["fp_forward_s"] > 0 and result["pipelines"]["repq"]["ratio_vs_fp"] > 0
