"""scripts/bench_overhead.py runs end to end on CPU (one tiny configuration per sweep)
and writes its outputs."""
from __future__ import annotations

import importlib.util
import json
import os

import cd_models  # noqa: F401  (one torch thread)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_overhead_cpu_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_overhead",
                                                  os.path.join(ROOT, "scripts", "bench_overhead.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--device", "cpu", "--small", "--batches", "2", "--widths", "64",
                         "--width-batch", "2", "--warmup", "1", "--steps", "1", "--out", str(tmp_path)])
    assert {(r["sweep"], r["method"]) for r in report["rows"]} == {(s, m) for s in ("batch", "width")
                                                                    for m in ("baseline", "cd", "tweo")}
    assert all(r["step_ms"] > 0 and r["peak_mib"] is None for r in report["rows"])
    assert json.load(open(tmp_path / "overhead.json"))["memory"] == "n/a"
    assert (tmp_path / "overhead.png").stat().st_size > 0
    assert "cd/base" in capsys.readouterr().out
    cd_rows = [r for r in report["rows"] if r["method"] == "cd"]
    assert all(r["cd_apply_ms"] > 0 and r["cd_floor_ms"] > 0 and r["precision"] == "fp32" for r in cd_rows)


def test_bench_overhead_apply_only(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_overhead",
                                                  os.path.join(ROOT, "scripts", "bench_overhead.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--device", "cpu", "--small", "--apply-only", "--widths", "64",
                         "--precision", "bf16", "--warmup", "1", "--steps", "2", "--out", str(tmp_path)])
    (row,) = report["apply_only"]
    assert row["precision"] == "bf16" and row["apply_over_floor"] > 0
    assert json.load(open(tmp_path / "apply.json"))["apply_only"][0]["embed_dim"] == 64
