"""scripts/compare_act_max.py: per-block maxima averaged over runs, against values written into the CSVs."""
import csv
import os

import pytest

from tests.conftest import load_script


def load():
    return load_script("compare_act_max")


def write(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["name", "kind", "block", "type", "max"])
        writer.writeheader()
        writer.writerows(rows)


def run_rows(block_out, norm, fc2):
    rows = []
    for b, (o, n, f) in enumerate(zip(block_out, norm, fc2)):
        rows += [{"name": f"blocks.{b}", "kind": "block", "block": b, "type": "block", "max": o},
                 {"name": f"blocks.{b}.norm1", "kind": "module", "block": b, "type": "norm1", "max": n},
                 {"name": f"blocks.{b}.mlp.fc2", "kind": "module", "block": b, "type": "mlp.fc2", "max": f}]
    return rows + [{"name": "norm", "kind": "module", "block": -1, "type": "norm", "max": 999.0}]


def test_means_ranges_and_refusals(tmp_path, capsys):
    compare = load()
    write(tmp_path / "a_s0.csv", run_rows([1.0, 4.0], [10.0, 2.0], [3.0, 7.0]))
    write(tmp_path / "a_s1.csv", run_rows([3.0, 6.0], [20.0, 1.0], [5.0, 9.0]))
    write(tmp_path / "b_s0.csv", run_rows([2.0, 2.0], [1.0, 1.0], [1.0, 1.0]))
    out = str(tmp_path / "cmp")
    rows = compare.main([f"a={tmp_path}/a_s*.csv", f"b={tmp_path}/b_s*.csv", "--out", out])
    a1 = next(r for r in rows if r["method"] == "a" and r["block"] == 1)
    assert (a1["runs"], a1["block_mean"], a1["block_min"], a1["block_max"]) == (2, 5.0, 4.0, 6.0)
    assert a1["module_mean"] == 8.0  # max over the block's modules (7, 9), then the mean; the final norm
    assert "| 0 | 2.0 / 15.0 | 2.0 / 1.0 |" in capsys.readouterr().out  # (block -1) is not a block
    assert os.path.getsize(out + ".png") > 0 and os.path.exists(out + ".csv")
    with pytest.raises(SystemExit, match="already exist.*choose another --out or add --overwrite"):
        compare.main([f"a={tmp_path}/a_s*.csv", "--out", out])
    with pytest.raises(SystemExit, match="names no act_max CSV"):
        compare.main([f"a={tmp_path}/nothing*.csv", "--out", str(tmp_path / "other")])
    good = (tmp_path / "cmp.csv").read_bytes()
    write(tmp_path / "empty.csv", [])
    with pytest.raises(SystemExit, match="empty.csv holds no block rows"):
        compare.main([f"a={tmp_path}/empty.csv", "--out", out, "--overwrite"])
    assert (tmp_path / "cmp.csv").read_bytes() == good  # a refused run leaves the good output as it was
    write(tmp_path / "deep_s2.csv", run_rows([1.0, 1.0, 1.0], [1.0] * 3, [1.0] * 3))
    with pytest.raises(SystemExit, match=r"deep_s2.csv has blocks \[0, 1, 2\].*different models"):
        compare.main([f"a={tmp_path}/[ad]*_s*.csv", "--out", str(tmp_path / "mixed")])
    with pytest.raises(SystemExit, match="method 'a' is given twice"):
        compare.main([f"a={tmp_path}/a_s0.csv", f"a={tmp_path}/b_s0.csv", "--out", str(tmp_path / "twice")])
    # one run as two methods, or a copy of it as a second seed: its maxima would count twice
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "a_s0.csv").write_bytes((tmp_path / "a_s0.csv").read_bytes())
    for groups in ([f"a={tmp_path}/a_s0.csv", f"b={tmp_path}/a_s*.csv"],
                   [f"a={tmp_path}/*/a_s0.csv", f"b={tmp_path}/a_s0.csv"]):
        with pytest.raises(SystemExit, match=r"a_s0.csv \(b\) holds the same maxima as .*a_s0.csv \(a\): one run "
                                             r"would count twice"):
            compare.main([*groups, "--out", str(tmp_path / "twice")])
    with pytest.raises(SystemExit, match=r"copy \(a\) cannot be read"):  # a folder the glob matched
        compare.main([f"a={tmp_path}/co*", "--out", str(tmp_path / "twice")])
    assert not os.path.exists(tmp_path / "twice.csv")


def test_a_file_that_is_not_an_act_max_csv_is_named(tmp_path):
    """The error names the file (was 'a CSV lacks the column ...' without it), and a row cut short is one
    error line too (was a TypeError traceback)."""
    compare = load()
    (tmp_path / "eval_best.json").write_text('{\n  "fp": {}\n}\n')
    with pytest.raises(SystemExit, match=r"eval_best.json is not an act_max CSV of evaluate.py \(no column 'block'\)"):
        compare.main([f"a={tmp_path}/eval_best.json", "--out", str(tmp_path / "o")])
    (tmp_path / "short.csv").write_text("name,kind,block,type,max\nblocks.0,block,0\n")
    with pytest.raises(SystemExit, match=r"short.csv is not an act_max CSV of evaluate.py"):
        compare.main([f"a={tmp_path}/short.csv", "--out", str(tmp_path / "o")])
    assert not os.path.exists(tmp_path / "o.csv")


def test_the_csv_holds_min_mean_max_over_runs_in_any_order(tmp_path):
    """Every statistic of the written CSV against values worked out by hand, with the larger run first (the
    max is not the last run's value) and the module maxima differing between the runs."""
    compare = load()
    write(tmp_path / "m_s0.csv", run_rows([9.0, 2.0], [1.0, 8.0], [4.0, 3.0]))
    write(tmp_path / "m_s1.csv", run_rows([5.0, 6.0], [2.0, 1.0], [7.0, 1.0]))
    out = str(tmp_path / "cmp")
    compare.main([f"m={tmp_path}/m_s*.csv", "--out", out])
    with open(out + ".csv", newline="") as f:
        got = [{k: (v if k == "method" else float(v)) for k, v in row.items()} for row in csv.DictReader(f)]
    # block 0: outputs 9, 5; modules max(1, 4) = 4 and max(2, 7) = 7. block 1: outputs 2, 6; modules 8 and 1
    assert got == [
        {"method": "m", "block": 0, "runs": 2, "block_mean": 7.0, "block_min": 5.0, "block_max": 9.0,
         "module_mean": 5.5, "module_min": 4.0, "module_max": 7.0},
        {"method": "m", "block": 1, "runs": 2, "block_mean": 4.0, "block_min": 2.0, "block_max": 6.0,
         "module_mean": 4.5, "module_min": 1.0, "module_max": 8.0}]


def test_a_shallower_run_of_a_method_is_refused_not_a_traceback(tmp_path):
    """A later run with fewer blocks than the first (another model) is one error naming it, as a deeper one is."""
    compare = load()
    write(tmp_path / "m_s0.csv", run_rows([1.0, 2.0, 3.0], [1.0] * 3, [1.0] * 3))
    write(tmp_path / "m_s1.csv", run_rows([1.0, 2.0], [1.0] * 2, [1.0] * 2))
    with pytest.raises(SystemExit, match=r"m_s1.csv has blocks \[0, 1\], .*m_s0.csv has \[0, 1, 2\]"):
        compare.main([f"m={tmp_path}/m_s*.csv", "--out", str(tmp_path / "cmp")])
    assert not os.path.exists(tmp_path / "cmp.csv")
