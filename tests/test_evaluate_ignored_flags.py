"""Flags and settings that would change nothing are refused in one line, as quant.calib_images beside `--quant` is:
--recompute where no pipeline runs and the result file holds no maxima over other quant.act_max_extra_modules to
replace (every call measures the maxima again), and quant.main_rank_wait_hours in one process (no rank waits for
rank 0 there: run_on_main calls the work directly)."""
import json
import re

import pytest

import evaluate
from configs import ConfigError


def evaluate_into(checkpoint, out, *argv) -> dict:
    evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--out", str(out), *argv]))
    return json.loads(out.read_text())


def test_recompute_is_refused_where_it_would_change_nothing_and_taken_where_it_replaces(checkpoint, tmp_path):
    out = tmp_path / "e.json"
    refused = r"--recompute would be ignored: this evaluation runs no pipeline .*no activation maxima over other"
    with pytest.raises(ConfigError, match=refused):  # no file yet
        evaluate_into(checkpoint, out, "--quant", "--recompute")
    assert not out.exists()
    first = evaluate_into(checkpoint, out, "--quant")
    with pytest.raises(ConfigError, match=refused):  # maxima of the same modules: measured again without it
        evaluate_into(checkpoint, out, "--quant", "--recompute")
    assert json.loads(out.read_text()) == first
    # maxima over other modules are replaced (the old ones to history); a pipeline to run again is taken
    other = evaluate_into(checkpoint, out, "--quant", "--recompute", "quant.act_max_extra_modules=[norm]")
    assert other["max_act"]["extra_modules"] == ["norm"] and len(other["history"]) == 1
    evaluate_into(checkpoint, out, "--quant", "rtn", "--bits", "w8a16", "quant.act_max_extra_modules=[norm]")
    again = evaluate_into(checkpoint, out, "--quant", "rtn", "--bits", "w8a16", "--recompute",
                          "quant.act_max_extra_modules=[norm]")
    assert [h.get("pipeline") for h in again["history"]] == [None, "rtn"]


def test_main_rank_wait_hours_is_refused_in_one_process_and_taken_under_torchrun(checkpoint, tmp_path, monkeypatch):
    recipe = tmp_path / "wait.yaml"
    recipe.write_text("quant:\n  main_rank_wait_hours: 2\n")
    for argv, named in ((["quant.main_rank_wait_hours=1"], "quant.main_rank_wait_hours=1"),
                        (["--config", str(recipe)], f"quant.main_rank_wait_hours=2 (--config {recipe})")):
        with pytest.raises(ConfigError, match=rf"^{re.escape(named)} would be ignored: .*this is one process"):
            evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "repq", *argv]))
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it: the other rank waits that long
    cfg, _ = evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "repq",
                                                          "quant.main_rank_wait_hours=1"]))
    assert cfg.quant.main_rank_wait_hours == 1
