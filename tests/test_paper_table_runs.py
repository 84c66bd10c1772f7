"""scripts/paper_table.py's rows layout printed two results of one model and method as two rows alike ("| vit_micro |
Baseline | 10.000 | ..."): a finished 22-update run of seed 0 and a run that train.max_steps=3 stopped at update 3 of
22, with nothing naming either run and no mark on the unfinished one. Such rows now name their run folder in a Run
column, and a run stopped before the end of its schedule beside a run of its model that ended at another update is
marked § with a note saying how far each got, as is one short of 99 % of its schedule even alone (3 of 22); runs that
all stop alike near their end (a recipe whose own train.max_steps stops its runs at update 20,000 of 20,016, 99.9 %)
are not marked, and a table whose rows read apart is printed as before. The
run folders here are written by hand as train.py and evaluate.py write them (eval_best.json's recipe and data,
metrics.jsonl's validations, config.yaml's train.max_steps)."""
import json

import paper_table


def write_run(folder, method="Baseline", seed=0, reached=22, max_steps=None, top1=80.0, steps=22, model="vit_micro",
              data=None):
    """A run folder of a `steps`-update schedule (sched.steps) that validated last at update `reached`, its
    config.yaml's train.max_steps where given, and its eval_best.json (top-1 `top1`, evaluate.py's `data` record
    where given); the path of the JSON."""
    folder.mkdir(parents=True)
    result = {"model": model, "method": method, "fp": {"top1": top1}, "max_act": {"module": 5.0, "block": 3.0},
              "quant": {}, "checkpoint": str(folder / "best.pt"), "checkpoint_kind": "best", "train_seed": seed,
              "recipe": {"sched.steps": steps, "sched.epochs": 1}, **({"data": data} if data else {})}
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
                             "it, at 13.6 % of its schedule's updates (under 99 %), while baseline ended at update "
                             "22"], lines


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


def test_over_seeds_marks_seeds_all_stopped_at_their_max_steps_short_of_99_percent_or_beside_other_ends(tmp_path):
    """Seeds that all stop at one train.max_steps ended alike and are averaged; alone, at 3 of 22 updates (short of
    99 % of their schedule), their row is marked § saying so, once. Beside the seeds of another method of the model
    whose 2-update schedule ended at update 2, their note also names those (the others are not marked: they
    finished). A table over seeds has no Run column (its rows are of one model and method each)."""
    capped = [write_run(tmp_path / f"s{seed}", seed=seed, reached=3, max_steps=3) for seed in (0, 1)]
    lines = paper_table.main([*capped, "--over-seeds"]).splitlines()
    assert lines[0] == "| Model | Method | FP Top-1 | Max. Act. (mod./blk.) |", lines
    assert cells(lines[2])[:2] == ["vit_micro", "Baseline (n=2)§"], lines
    assert lines[3:] == ["", "§ vit_micro Baseline: stopped before the end of its schedule: validated last at update "
                             "3 of the 22 of its schedule (sched.steps=22), where its train.max_steps stopped it, "
                             "at 13.6 % of its schedule's updates (under 99 %)"], lines
    short = [write_run(tmp_path / f"c{seed}", method="CD", seed=seed, reached=2, steps=2) for seed in (0, 1)]
    lines = paper_table.main([*capped, *short, "--over-seeds"]).splitlines()
    assert [cells(line)[:2] for line in lines[2:4]] == [["vit_micro", "Baseline (n=2)§"], ["vit_micro", "CD (n=2)"]]
    assert lines[4:] == ["", "§ vit_micro Baseline: stopped before the end of its schedule: validated last at update "
                             "3 of the 22 of its schedule (sched.steps=22), where its train.max_steps stopped it, "
                             "at 13.6 % of its schedule's updates (under 99 %), while c0 ended at update 2"], lines
    finished = [write_run(tmp_path / f"f{seed}", seed=seed) for seed in (0, 1)]
    assert "§" not in paper_table.main([*finished, "--over-seeds"])


def test_runs_that_all_stop_alike_are_not_marked(tmp_path):
    """Baseline and CD runs of a recipe that sets train.max_steps=20000 itself, both stopped by it at update 20,000
    of their 20,016 (8 epochs of 2,502 updates), alike: marked § as unfinished, though nothing in the table trained
    further. Printed as a table of finished runs is."""
    paths = [write_run(tmp_path / "finetune" / name, method=method, reached=20_000, max_steps=20_000, steps=20_016,
                       model="vit_base_patch16_224", top1=85.0)
             for name, method in (("imagenet_baseline", "Baseline"), ("imagenet_cd", "CD"))]
    assert paper_table.main(paths).splitlines() == ["| Model | Method | FP Top-1 | Max. Act. (mod./blk.) |",
                                                    "| --- | --- | --- | --- |",
                                                    "| vit_base_patch16_224 | Baseline | 85.000 | 5.00 / 3.00 |",
                                                    "| vit_base_patch16_224 | CD | 85.000 | 5.00 / 3.00 |"]


def test_a_capped_run_near_its_end_is_marked_only_beside_a_run_of_its_model_and_data_set_that_ended_elsewhere(
        tmp_path):
    """A run of vit_micro stopped at update 199 of 200 (99.5 %, past the 99 % that marks a run alone): beside a
    finished run of another model, or of vit_micro on another data set (data.root's last folder, as evaluate.py
    records it), it is not marked; beside vit_micro on its own data set (under another root: the data set may move)
    that finished, or that its own train.max_steps stopped at update 198, both compared runs of other ends are, each
    note naming the other and nothing of a share of the schedule."""
    flowers, pets = ({"dataset": "folder", "root": f"/data/{name}", "val_split": "val"} for name in ("flowers", "pets"))
    capped = write_run(tmp_path / "capped", reached=199, max_steps=199, steps=200, data=flowers)
    other_model = write_run(tmp_path / "other_model", model="vit_nano", reached=200, steps=200, data=flowers)
    other_data = write_run(tmp_path / "other_data", method="CD", reached=200, steps=200, data=pets)
    assert "§" not in paper_table.main([capped, other_model, other_data])
    moved = dict(flowers, root="/mnt/copy/flowers")
    finished = write_run(tmp_path / "finished", method="CD", reached=200, steps=200, data=moved)
    lines = paper_table.main([capped, other_model, finished]).splitlines()
    assert [cells(line)[:2] for line in lines[2:5]] == [["vit_micro", "Baseline§"], ["vit_nano", "Baseline"],
                                                        ["vit_micro", "CD"]], lines
    assert lines[5:] == ["", "§ vit_micro Baseline: stopped before the end of its schedule: validated last at update "
                             "199 of the 200 of its schedule (sched.steps=200), where its train.max_steps stopped it, "
                             "while finished ended at update 200"], lines
    other_end = write_run(tmp_path / "other_end", method="CD", reached=198, max_steps=198, steps=200, data=moved)
    lines = paper_table.main([capped, other_end]).splitlines()
    assert [cells(line)[:2] for line in lines[2:4]] == [["vit_micro", "Baseline§"], ["vit_micro", "CD§"]], lines
    assert [line.split("stopped it, ")[1] for line in lines[5:]] == ["while other_end ended at update 198",
                                                                      "while capped ended at update 199"]


def test_a_run_capped_short_of_99_percent_of_its_schedule_is_marked_alone_or_beside_runs_stopped_alike(tmp_path):
    """The defect: Baseline and CD of vit_micro, both stopped by train.max_steps=3 at update 3 of their 22, printed
    as plain rows, like finished runs, as did a lone capped run beside runs of other models: 3 updates are 13.6 % of
    the schedule (under 99 %), and each such row is marked §, its note saying so (no run ended elsewhere)."""
    both = [write_run(tmp_path / name, method=method, reached=3, max_steps=3) for name, method in
            (("baseline", "Baseline"), ("cd", "CD"))]
    lines = paper_table.main(both).splitlines()
    assert [cells(line)[:2] for line in lines[2:4]] == [["vit_micro", "Baseline§"], ["vit_micro", "CD§"]], lines
    # the share against the schedule itself: 3 / 22 = 0.136...
    share = f"{int(1000 * 3 / 22) / 10} % of its schedule's updates (under 99 %)"
    assert lines[4:] == ["", *(f"§ vit_micro {method}: stopped before the end of its schedule: validated last at "
                               f"update 3 of the 22 of its schedule (sched.steps=22), where its train.max_steps "
                               f"stopped it, at {share}" for method in ("Baseline", "CD"))], lines
    others = [write_run(tmp_path / name, model=model) for name, model in (("nano", "vit_nano"), ("pico", "vit_pico"))]
    lines = paper_table.main([both[0], *others]).splitlines()
    assert [cells(line)[:2] for line in lines[2:5]] == [["vit_micro", "Baseline§"], ["vit_nano", "Baseline"],
                                                        ["vit_pico", "Baseline"]], lines
    assert lines[5:] == ["", f"§ vit_micro Baseline: stopped before the end of its schedule: validated last at update "
                             f"3 of the 22 of its schedule (sched.steps=22), where its train.max_steps stopped it, "
                             f"at {share}"], lines


def with_entry(path, drop=5.0):
    """The result file at `path` given a RepQ-ViT W4A4 entry `drop` points below its FP top-1; its path."""
    with open(path) as f:
        result = json.load(f)
    result["quant"] = {"repq": {"w4a4": {"top1": result["fp"]["top1"] - drop}}}
    with open(path, "w") as f:
        json.dump(result, f)
    return path


def test_the_finetune_layout_marks_an_entry_whose_run_stopped_short_as_the_rows_layout_marks_its_row(tmp_path):
    """The defect: Table 3's layout printed CD's Flowers102 entry of a run that train.max_steps=3 stopped at update 3
    of 22 beside Baseline's finished one, and averaged it, as a finished run's, with no mark (the rows layout marks
    the same run §). Its entry and the Average that takes it in are marked §, its note naming how far it got; runs
    that all stop alike near their end (20,000 of 20,016 updates) are not marked."""
    flowers = {"dataset": "folder", "root": "/data/flowers102", "val_split": "val"}
    finished = with_entry(write_run(tmp_path / "baseline", data=flowers, top1=80.0))
    capped = with_entry(write_run(tmp_path / "cd", method="CD", reached=3, max_steps=3, data=flowers, top1=40.0))
    lines = paper_table.main([finished, capped, "--layout", "finetune"]).splitlines()
    assert lines[2:6] == ["| Dataset | Baseline | CD |", "| --- | --- | --- |",
                          "| Flowers102 | 80.00 / 75.00 / -5.00 | 40.00 / 35.00 / -5.00§ |",
                          "| Average | 80.00 / 75.00 / -5.00 | 40.00 / 35.00 / -5.00§ |"], lines
    assert lines[6:] == ["", "§ Flowers102 CD: stopped before the end of its schedule: validated last at update 3 of "
                             "the 22 of its schedule (sched.steps=22), where its train.max_steps stopped it, at 13.6 % "
                             "of its schedule's updates (under 99 %), while Flowers102 Baseline ended at update 22"], lines
    alike = [with_entry(write_run(tmp_path / "imagenet" / name, method=method, reached=20_000, max_steps=20_000,
                                  steps=20_016, data=dict(flowers, root="/data/imagenet")))
             for name, method in (("baseline", "Baseline"), ("cd", "CD"))]
    assert "§" not in paper_table.main([*alike, "--layout", "finetune"])
