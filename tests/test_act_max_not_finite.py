"""A NaN or inf `max` in an activation-maxima CSV (a model whose activations overflowed) is refused where the rows
are read, naming the file and line: dose_report.read_act_max (dose_report.py, lm_study.py) and compare_act_max.py's
per_block used to let it through, and the largest value of a type or block (max() ignores a NaN after the first
value) was then the other modules' maximum. A NaN kurtosis (an output too near a constant to resolve) stays a value
the per-type table leaves out."""
import pytest

from test_compare_act_max import load as load_compare, run_rows, write as write_act_max
from test_lm_study import write_run
from tests.conftest import run_entry

import dose_report

HEADER = "name,kind,block,type,max,kurtosis\n"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_read_act_max_names_the_file_and_line_of_a_max_that_is_not_finite(tmp_path, value):
    path = tmp_path / "eval_best_act_max.csv"
    path.write_text(HEADER + "blocks.0.mlp.fc2,module,0,mlp.fc2,2.0,4.0\n"
                    f"blocks.1.mlp.fc2,module,1,mlp.fc2,{value},4.0\n" + "blocks.1,block,1,block,5.0,3.0\n")
    with pytest.raises(dose_report.ReportError, match=rf"eval_best_act_max.csv, line 3: max '{value}' is not a "
                                                      r"finite number: the model's activations overflowed"):
        dose_report.read_act_max(str(path))


def test_a_nan_kurtosis_is_read_and_left_out_of_the_largest_kurtosis_of_its_type(tmp_path):
    path = tmp_path / "eval_best_act_max.csv"
    path.write_text(HEADER + "blocks.0.mlp.fc2,module,0,mlp.fc2,2.0,nan\nblocks.1.mlp.fc2,module,1,mlp.fc2,3.0,7.5\n"
                    "blocks.1.norm1,module,1,norm1,1.5,nan\nblocks.1,block,1,block,5.0,3.0\n")
    run = dose_report.Run("p", 0, str(tmp_path), {}, {}, dose_report.read_act_max(str(path)))
    # by hand: mlp.fc2's maxima 2.0 and 3.0, its kurtosis 7.5 (the NaN is no value); norm1 has no kurtosis at all
    assert dose_report.type_maxima(run) == {"mlp.fc2": 3.0, "norm1": 1.5, "block": 5.0}
    assert dose_report.type_maxima(run, "kurtosis") == {"mlp.fc2": 7.5, "block": 3.0}


def test_lm_study_refuses_a_run_with_a_nan_max_in_one_error_line(tmp_path, capsys):
    root = tmp_path / "sweep"
    root.mkdir()
    for name in ("baseline_s0", "baseline_s1"):
        write_run(root, name, ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
    csv_path = root / "baseline_s1" / "eval_best_act_max.csv"
    csv_path.write_text(csv_path.read_text().replace("mlp.fc2,3.0,", "mlp.fc2,nan,"))
    code, out, err = run_entry("scripts/lm_study.py", [str(root), "--out", str(tmp_path / "out")], capsys)
    assert isinstance(code, str) and "\n" not in code and not out and not err, (code, err)
    assert code.startswith(f"error: {csv_path}, line 3: max 'nan' is not a finite number"), code
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["module", "block", "outside"])
def test_compare_act_max_refuses_a_max_that_is_not_finite_naming_file_and_line(tmp_path, kind):
    compare = load_compare()
    write_act_max(tmp_path / "a_s0_act_max.csv", run_rows([1.0, 4.0], [10.0, 2.0], [3.0, 7.0]))
    rows = run_rows([3.0, 6.0], [20.0, 1.0], [5.0, 9.0])
    # rows: block 0 output, norm1, fc2, block 1 output, norm1, fc2, the final norm (block -1); line = index + 2
    index = {"module": 1, "block": 3, "outside": 6}[kind]
    rows[index]["max"] = float("nan")
    write_act_max(tmp_path / "a_s1_act_max.csv", rows, checkpoint=str(tmp_path / "other.pt"))
    with pytest.raises(SystemExit, match=rf"error: .*a_s1_act_max.csv, line {index + 2}: max nan is not a finite "
                                         r"number: the model's activations overflowed"):
        compare.main([f"a={tmp_path}/a_s*_act_max.csv", "--out", str(tmp_path / "cmp")])
    assert not (tmp_path / "cmp.csv").exists()
