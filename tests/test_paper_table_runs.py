"""scripts/paper_table.py's rows layout printed two results of one model and method as two rows alike ("| vit_micro |
Baseline | 10.000 | ..."): a finished 22-update run of seed 0 and a run that train.max_steps=3 stopped at update 3 of
22, with nothing naming either run and no mark on the unfinished one. Such rows now name their run folder in a Run
column, and a run stopped before the end of its schedule is marked § with a note saying how far it got; a table
whose rows read apart is printed as before. The run folders here are written by hand as train.py and evaluate.py
write them (eval_best.json's recipe, metrics.jsonl's validations, config.yaml's train.max_steps)."""
import json

import paper_table


def write_run(folder, method="Baseline", seed=0, reached=22, max_steps=None, top1=80.0):
    """A run folder of a 22-update schedule (sched.steps=22) that validated last at update `reached`, its
    config.yaml's train.max_steps where given, and its eval_best.json (top-1 `top1`); the path of the JSON."""
    folder.mkdir(parents=True)
    result = {"model": "vit_micro", "method": method, "fp": {"top1": top1}, "max_act": {"module": 5.0, "block": 3.0},
              "quant": {}, "checkpoint": str(folder / "best.pt"), "checkpoint_kind": "best", "train_seed": seed,
              "recipe": {"sched.steps": 22, "sched.epochs": 1}}
    (folder / "eval_best.json").write_text(json.dumps(result))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": reached, "train/loss": 2.3}) + "\n"
                                          + json.dumps({"step": reached, "val/top1": top1}) + "\n")
    (folder / "config.yaml").write_text(f"train:\n  seed: {seed}\n"
                                        + (f"  max_steps: {max_steps}\n" if max_steps else ""))
    return str(folder / "eval_best.json")


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_rows_of_one_model_and_method_name_their_runs_and_the_run_stopped_short_is_marked(tmp_path):
    """The reviewer's folders: tiny/baseline (finished, seed 0), tiny/cd and tiny2/b (seed 1, stopped by
    train.max_steps=3 at update 3 of 22). Each row is told by its run folder, and only b's is marked."""
    paths = [write_run(tmp_path / "tiny" / "baseline", top1=80.0),
             write_run(tmp_path / "tiny" / "cd", method="CD", top1=81.0),
             write_run(tmp_path / "tiny2" / "b", seed=1, reached=3, max_steps=3, top1=10.0)]
    lines = paper_table.main(paths).splitlines()
    assert cells(lines[0]) == ["Model", "Method", "Run", "FP Top-1", "Max. Act. (mod./blk.)"], lines
    rows = {cells(line)[2]: cells(line) for line in lines[2:5]}
    # each row holds the numbers of the run it names: the top-1 each folder's file was written with
    assert rows == {"baseline": ["vit_micro", "Baseline", "baseline", "80.000", "5.00 / 3.00"],
                    "cd": ["vit_micro", "CD", "cd", "81.000", "5.00 / 3.00"],
                    "b": ["vit_micro", "Baseline§", "b", "10.000", "5.00 / 3.00"]}, lines
    assert lines[5:] == ["", "§ vit_micro Baseline (b): stopped before the end of its schedule: validated last at "
                             "update 3 of the 22 of its schedule (sched.steps=22), where its train.max_steps stopped "
                             "it"], lines


def test_a_table_whose_rows_read_apart_is_printed_as_before(tmp_path):
    paths = [write_run(tmp_path / "tiny" / "baseline"), write_run(tmp_path / "tiny" / "cd", method="CD", top1=81.0)]
    assert paper_table.main(paths).splitlines() == ["| Model | Method | FP Top-1 | Max. Act. (mod./blk.) |",
                                                    "| --- | --- | --- | --- |",
                                                    "| vit_micro | Baseline | 80.000 | 5.00 / 3.00 |",
                                                    "| vit_micro | CD | 81.000 | 5.00 / 3.00 |"]


def test_a_run_is_named_by_the_fewest_last_path_parts_that_tell_the_rows_apart(tmp_path):
    """Two sweeps' folders of one name are named with their sweep's; two files of one run folder by their names."""
    paths = [write_run(tmp_path / "sweep_a" / "s0"), write_run(tmp_path / "sweep_b" / "s0", seed=1, top1=81.0)]
    lines = paper_table.main(paths).splitlines()
    assert [(cells(line)[2], cells(line)[3]) for line in lines[2:]] == [("sweep_a/s0", "80.000"),
                                                                        ("sweep_b/s0", "81.000")], lines
    other = tmp_path / "sweep_a" / "s0" / "eval_other.json"  # evaluate.py --out of the same run's best.pt
    other.write_text(json.dumps(dict(json.loads(open(paths[0]).read()), fp={"top1": 82.0})))
    lines = paper_table.main([paths[0], str(other), paths[1]]).splitlines()
    assert [(cells(line)[2], cells(line)[3]) for line in lines[2:]] == [("sweep_a/s0 (eval_best.json)", "80.000"),
                                                                        ("sweep_a/s0 (eval_other.json)", "82.000"),
                                                                        ("sweep_b/s0", "81.000")], lines


def test_over_seeds_marks_a_row_whose_seeds_all_stopped_at_their_max_steps(tmp_path):
    """Seeds that all stop at one train.max_steps ended alike and are averaged; their row is marked §. Finished
    seeds are not, and a table over seeds has no Run column (its rows are of one model and method each)."""
    capped = [write_run(tmp_path / f"s{seed}", seed=seed, reached=3, max_steps=3) for seed in (0, 1)]
    lines = paper_table.main([*capped, "--over-seeds"]).splitlines()
    assert lines[0] == "| Model | Method | FP Top-1 | Max. Act. (mod./blk.) |", lines
    assert cells(lines[2])[:2] == ["vit_micro", "Baseline (n=2)§"], lines
    assert lines[3:] == ["", "§ vit_micro Baseline: stopped before the end of its schedule: validated last at update "
                             "3 of the 22 of its schedule (sched.steps=22), where its train.max_steps stopped "
                             "it"], lines
    finished = [write_run(tmp_path / f"f{seed}", seed=seed) for seed in (0, 1)]
    assert "§" not in paper_table.main([*finished, "--over-seeds"])
