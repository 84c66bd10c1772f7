"""Results averaged as seeds must be of one method: the `method` evaluate.py records (engine.result_table.method_name
of the run's config) tells runs of another method apart even in results that record no recipe (files written before
evaluate.py recorded it), which recipe_difference does not compare. Checked in the sweep reports' read_sweep (a
point's seeds: dose_report.py, lm_study.py, gap_test.py), check_seed_group (paper_table.py --over-seeds) and
compare_act_max.py (a group's files)."""
import json

import pytest

from test_compare_act_max import load as load_compare, run_rows, write as write_act_max
from test_lm_study import write_run
from tests.conftest import run_entry

import dose_report
from engine.result_table import check_seed_group

METHODS = {"baseline_s0": "Baseline", "baseline_s1": "Baseline", "cd10x_s0": "CD (lam 0.05)", "cd10x_s1": "TWEO"}


def lm_sweep(root, methods):
    """Four evaluated language-model runs (no recipe recorded), each result's `method` set from `methods`."""
    for name, (ppl, rtn) in {"baseline_s0": (4.0, 5.0), "baseline_s1": (4.2, 5.4), "cd10x_s0": (4.1, 4.5),
                             "cd10x_s1": (4.0, 4.6)}.items():
        write_run(root, name, ppl=ppl, rtn=rtn, block_max=10.0, kurtosis=5.0, fc2_final=50.0)
        path = root / name / "eval_best.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "method": methods[name]}))
    return root


def test_method_difference_names_the_first_pair_of_other_methods_and_skips_results_without_one():
    from engine.result_table import method_difference

    same = [("a", {"method": "CD"}), ("b", {"method": "CD"}), ("c", {})]
    assert method_difference(same) is None
    assert method_difference([("a", {}), ("b", {"method": "CD"}), ("c", {"method": "TWEO"})]) == \
        "b and c are results of other methods ('CD' vs 'TWEO')"


def test_seeds_of_a_point_that_record_other_methods_are_refused_not_averaged(tmp_path):
    root = lm_sweep(tmp_path, METHODS)
    with pytest.raises(dose_report.ReportError,
                       match=r"cd10x_s0 and .*cd10x_s1 are results of other methods \('CD \(lam 0.05\)' vs 'TWEO'\), "
                             r"but both are seeds of point cd10x"):
        dose_report.read_sweep(str(root))
    # seeds of one method, as evaluate.py writes them, are read: each point holds two
    (tmp_path / "alike").mkdir()
    root = lm_sweep(tmp_path / "alike", {**METHODS, "cd10x_s1": "CD (lam 0.05)"})
    assert sorted(r.point for r in dose_report.read_sweep(str(root))) == ["baseline"] * 2 + ["cd10x"] * 2


def test_gap_test_refuses_them_in_one_error_line(tmp_path, capsys):
    """The reviewer's case: gap_test.py averaged the TWEO run into cd10x and exited 0."""
    root = lm_sweep(tmp_path, METHODS)
    code, out, err = run_entry("scripts/gap_test.py", [str(root), "baseline", "cd10x"], capsys)
    # sys.exit(message): the process prints it as one line on stderr and ends with status 1
    assert isinstance(code, str) and "\n" not in code and not out and not err, (code, err)
    assert code.startswith("error: ") and str(root / "cd10x_s1") in code and "'TWEO'" in code, code


def test_check_seed_group_refuses_results_of_other_methods_without_a_recipe():
    """paper_table.py --over-seeds groups by method already; compare_act_max.py groups by the name the user gives."""
    result = lambda method, seed: {"model": "vit_t", "method": method, "checkpoint": f"run{seed}/best.pt",
                                   "fingerprint": f"w{seed}"}
    check_seed_group("vit_t", "cd", [result("CD", 0), result("CD", 1)])  # alike: no error
    with pytest.raises(ValueError, match=r"vit_t cd: run0/best.pt and run1/best.pt are results of other methods "
                                         r"\('CD' vs 'TWEO'\)"):
        check_seed_group("vit_t", "cd", [result("CD", 0), result("TWEO", 1)])


def test_compare_act_max_refuses_a_group_of_files_of_other_methods(tmp_path):
    compare = load_compare()
    write_act_max(tmp_path / "cd_s0_act_max.csv", run_rows([1.0, 4.0], [10.0, 2.0], [3.0, 7.0]), recipe=None)
    write_act_max(tmp_path / "cd_s1_act_max.csv", run_rows([3.0, 6.0], [2.0, 1.0], [5.0, 9.0]), recipe=None,
                  method="TWEO", checkpoint=str(tmp_path / "other.pt"))
    with pytest.raises(SystemExit, match=r"error: vit_t cd: .*cd_s0_act_max.csv and .*cd_s1_act_max.csv are results "
                                         r"of other methods \('CD' vs 'TWEO'\)"):
        compare.main([f"cd={tmp_path}/cd_s*_act_max.csv", "--out", str(tmp_path / "cmp")])
    assert not (tmp_path / "cmp.csv").exists()
