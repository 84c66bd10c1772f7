"""Results averaged as seeds that record no train.seed (an older evaluate.py's file outside its run folder) are still
averaged, but the seed check (engine/train_seeds.py) cannot compare them: paper_table.py --over-seeds (through
engine.result_table.markdown_table), compare_act_max.py and dose_report.py name them in a note below the table, so
that a reader knows one seed may be counted twice there."""
import json

from engine.result_table import markdown_table
from tests.conftest import load_script
from tests.test_compare_act_max import run_rows, write
from tests.test_dose_report import write_run

import dose_report
import paper_table


def result(checkpoint, seed=None):
    """A result of one seed of 'm' 'CD', with its train_seed where given (None: an older file's, without it)."""
    found = {"model": "m", "method": "CD", "fp": {"top1": 80.0}, "max_act": {"module": 5.0, "block": 3.0},
             "quant": {}, "checkpoint": checkpoint}
    return found if seed is None else dict(found, train_seed=seed)


def notes(table):
    return [line for line in table.splitlines() if "train.seed" in line]


def test_a_row_over_seeds_names_its_results_without_a_recorded_seed():
    table = markdown_table([result("a/best.pt", 0), result("b/best.pt"), result("c/best.pt", 1),
                            result("d/best.pt")], over_seeds=True)
    assert "| m | CD (n=4) |" in table  # still averaged
    assert notes(table) == ["seeds of m CD: the train.seed of 2 of its 4 results is not recorded (b/best.pt, "
                            "d/best.pt: written before evaluate.py recorded it, and not in a run folder with its "
                            "config.yaml), so one seed may be counted twice"], table


def test_no_note_where_every_seed_is_recorded_or_nothing_is_averaged():
    assert notes(markdown_table([result("a/best.pt", 0), result("b/best.pt", 1)], over_seeds=True)) == []
    assert notes(markdown_table([result("a/best.pt")], over_seeds=True)) == []  # one result: no seed twice
    assert notes(markdown_table([result("a/best.pt"), result("b/best.pt")])) == []  # one row per result


def test_paper_table_over_seeds_prints_the_note(tmp_path):
    paths = []
    for name, seed in (("a", 3), ("b", None)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(result(f"runs/{name}/best.pt", seed)))
        paths.append(str(path))
    table = paper_table.main([*paths, "--over-seeds"])
    assert "| m | CD (n=2) |" in table
    said = notes(table)
    assert len(said) == 1 and said[0].startswith("seeds of m CD: the train.seed of 1 of its 2 results is not "
                                                 "recorded (runs/b/best.pt: "), table


def test_dose_report_names_the_runs_of_a_point_without_a_recorded_seed(tmp_path):
    root = tmp_path / "sweep"
    root.mkdir()
    for weights, (name, seed) in enumerate((("baseline_s0", 0), ("baseline_s1", 1), ("cd_s0", 0), ("cd_s1", 1))):
        folder = write_run(root, name, fp=80.0 + seed, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=weights)
        if name.startswith("cd") or seed == 0:  # baseline_s1's file records no seed (nor any config.yaml beside)
            path = folder / "eval_best.json"
            path.write_text(json.dumps(dict(json.loads(path.read_text()), train_seed=seed)))
    report = dose_report.main([str(root), "--out", str(tmp_path / "out")])
    assert notes(report) == [f"seeds of baseline: the train.seed of 1 of its 2 results is not recorded "
                             f"({root / 'baseline_s1'}: written before evaluate.py recorded it, and not in a run "
                             f"folder with its config.yaml), so one seed may be counted twice"], report


def test_compare_act_max_names_the_csvs_whose_results_record_no_seed(tmp_path, capsys):
    compare = load_script("compare_act_max")
    rows = run_rows([1.0], [2.0], [3.0])
    write(tmp_path / "a_s0_act_max.csv", rows, train_seed=0)
    write(tmp_path / "a_s1_act_max.csv", run_rows([2.0], [2.0], [3.0]))  # an older file: no train_seed
    compare.main([f"a={tmp_path}/a_s*_act_max.csv", "--out", str(tmp_path / "cmp")])
    said = notes(capsys.readouterr().out)
    assert said == [f"seeds of a: the train.seed of 1 of its 2 results is not recorded ({tmp_path}/a_s1_act_max.csv: "
                    f"written before evaluate.py recorded it, and not in a run folder with its config.yaml), so one "
                    f"seed may be counted twice"], said
