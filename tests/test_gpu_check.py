"""scripts/gpu_check.py end to end on a CPU (--smoke): every stage runs small in its own process and the
figures land in one valid JSON; a stage past its budget is killed and recorded, and the rest goes on.

The budgets are what the script enforces on a GPU machine; these tests check what it records, so they give
each stage a budget no busy CPU reaches (the default smoke budgets are tens of seconds: a loaded 2-core
machine ran past them), and time only the kill of a stage that is over its budget on purpose."""
import json

import pytest

from tests.conftest import load_script, run_entry

SCRIPT = "scripts/gpu_check.py"


STAGES = ["pytest", "precision", "overhead", "quant", "aphq_unit"]
UNHURRIED = ["--total-budget", "36000", "--test-timeout", "3600", *[f"--budget={s}=3600" for s in STAGES]]


@pytest.mark.slow
def test_smoke_run_writes_every_stage_s_figures(tmp_path, capsys):
    """The command line runs in this process (run_entry: a process of its own would import torch again, seconds);
    each stage it starts is a process of its own, as always."""
    out = tmp_path / "gpu_check.json"
    code, _, err = run_entry(SCRIPT, ["--smoke", *UNHURRIED, "--out", str(out)], capsys)
    assert code == 0, err[-3000:]
    report = json.loads(out.read_text())
    assert report["device"].startswith("cpu") and report["torch"] and report["smoke"] is True
    stages = report["stages"]
    assert {s: e["status"] for s, e in stages.items()} == dict.fromkeys(STAGES, "ok"), {
        s: e.get("log_tail") for s, e in stages.items()}
    tests = stages["pytest"]["figures"]["tests"]
    assert {name.split("[")[1]: t["outcome"] for name, t in tests.items()} == {"cpu]": "passed", "cuda]": "skipped"}
    assert all("CUDA" in t["reason"] for t in tests.values() if t["outcome"] == "skipped")
    rows = stages["precision"]["figures"]["rows"]
    assert {(r["amp"], r["fused"]) for r in rows} == {(a, f) for a in ("fp16", "bf16") for f in (True, False)}
    assert all(r["step_ms"] > 0 and r["img_per_s"] > 0 for r in rows)
    overhead = stages["overhead"]["figures"]
    assert set(overhead["step_over_baseline"]) == {"cd", "tweo", "tweo_plain"} and overhead["cd_apply_ms"] > 0
    pipelines = stages["quant"]["figures"]["pipelines"]
    assert set(pipelines) == {"percentile", "repq", "aphq", "gplq"}
    assert all(p["ratio_vs_fp"] > 0 for p in pipelines.values())
    assert stages["aphq_unit"]["figures"]["extrapolated"]["unit_s"] > 0
    assert (tmp_path / stages["quant"]["log"]).read_text()  # each stage's log next to the JSON


def test_a_stage_past_its_budget_is_killed_and_recorded(tmp_path, capsys):
    """The driver runs in this process (its command line as a process: the smoke test above); the stage it
    kills is a process of its own, as always."""
    gpu_check = load_script("gpu_check")
    out = tmp_path / "gpu_check.json"
    argv = ["--smoke", *UNHURRIED, "--out", str(out), "--stages", "aphq_unit"]
    gpu_check.main([*argv, "--budget", "aphq_unit=0.5"])
    entry = json.loads(out.read_text())["stages"]["aphq_unit"]
    # killed at its budget: the status says so; the time only rules out a kill that waited for the stage
    assert entry["status"] == "timeout" and entry["seconds"] < 300 and entry["budget_s"] == 0.5
    with pytest.raises(SystemExit) as refused:  # never replaces its outputs unasked
        gpu_check.main(argv)
    assert str(refused.value.code).startswith("error: ") and "--overwrite" in str(refused.value.code)
    assert json.loads(out.read_text())["stages"]["aphq_unit"] == entry
