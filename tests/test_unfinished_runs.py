"""Runs that stopped before the end of their schedule (train.max_steps) are refused where results are averaged as
seeds (engine.eval_results.refuse_unfinished: paper_table.py --over-seeds, dose_report.py, lm_study.py,
gap_test.py), told from what train.py itself writes: the recipe evaluate.py records and the run's metrics.jsonl.
The sweep reports' own cases are in their test files (test_dose_report.py, test_lm_study.py, test_gap_test.py)."""
import json
import os

import pytest

import evaluate
import paper_table
import train
from configs import load_config
from engine.eval_results import ResultsError, refuse_unfinished, run_end
from tests.conftest import DEBUG_CONFIG


def evaluated(out_dir: str) -> dict:
    """The eval_best.json that evaluate.py writes beside the run's best.pt (one quick pipeline)."""
    evaluate.main(evaluate.parse_args(["--checkpoint", os.path.join(out_dir, "best.pt"), "--quant", "percentile",
                                       "--bits", "w4a4"]))
    with open(os.path.join(out_dir, "eval_best.json")) as f:
        return json.load(f)


def test_a_run_of_an_epoch_schedule_stopped_at_max_steps_is_no_seed_until_it_finishes(debug_config):
    """configs/debug/tiny.yaml: 2 epochs of 4 updates. A seed stopped by train.max_steps=4 at the end of its first
    epoch has no sched.steps, and train.max_steps is no recipe setting (an environment key): it was averaged with the
    finished seed as one of two. Refused, naming the folder and how far it got; once the same command without
    train.max_steps has trained it to the end (a resume), it is a seed again."""
    runs = {"baseline_s0": debug_config("train.seed=0", name="sweep/baseline_s0"),
            "baseline_s1": debug_config("train.seed=1", "train.max_steps=4", name="sweep/baseline_s1")}
    assert [train.main(cfg).state.step for cfg in runs.values()] == [8, 4]
    results = {name: evaluated(cfg.out_dir) for name, cfg in runs.items()}
    folder = runs["baseline_s1"].out_dir
    paths = [os.path.join(cfg.out_dir, "eval_best.json") for cfg in runs.values()]
    with pytest.raises(SystemExit) as refused:
        paper_table.main([*paths, "--over-seeds"])
    message = str(refused.value.code)
    assert message.startswith(f"error: {folder} validated last at update 4 of the 8 of its schedule (sched.epochs=2 "
                              f"of 4 updates): an unfinished run (stopped at its train.max_steps=4, where "
                              f"{runs['baseline_s0'].out_dir} trained further)") and "\n" not in message, message
    assert "re-run its command without train.max_steps" in message, message
    assert f"leave {paths[1]} out of --over-seeds" in message, message
    assert "| vit_nano | Baseline |" in paper_table.main(paths)  # one row per result: nothing averaged
    assert run_end(runs["baseline_s0"].out_dir, results["baseline_s0"]) == (None, 8)  # at its schedule's end
    train.main(debug_config("train.seed=1", name="sweep/baseline_s1"))  # resumed to the end of its schedule
    assert run_end(folder, results["baseline_s1"]) == (None, 8)


def test_the_updates_of_an_epoch_are_told_by_the_training_records_and_a_schedule_in_steps_by_itself(tmp_path):
    """Without a logged training record an epoch schedule's length in updates is not known: not judged; a schedule
    in updates (sched.steps) needs none. A result that records no recipe (an older file) is not judged either."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 3, "val/top1": 50.0}) + "\n")
    epochs = {"recipe": {"sched.epochs": 2, "sched.steps": None}}
    assert run_end(str(tmp_path), epochs) is None
    assert run_end(str(tmp_path), {}) is None
    with pytest.raises(ResultsError, match=r"validated last at update 3 of the 5 of its schedule \(sched.steps=5\)"):
        refuse_unfinished([(str(tmp_path), {"recipe": {"sched.epochs": 2, "sched.steps": 5}}, "leave it out")])
    # 3 updates are 0.75 of an epoch of 4: the schedule is 8 updates long
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 3, "train/loss": 1.0, "train/epoch": 0.75}) + "\n"
                                            + json.dumps({"step": 3, "val/top1": 50.0}) + "\n")
    assert run_end(str(tmp_path), epochs) == ("validated last at update 3 of the 8 of its schedule (sched.epochs=2 "
                                              "of 4 updates)", 3)


def test_runs_that_their_recipe_stops_at_one_max_steps_are_seeds_and_one_stopped_short_of_them_is_not(tmp_path):
    """A recipe that sets train.max_steps itself, e.g. train.max_steps=20000 over 8 epochs of 2,502 updates: its
    runs stop at update 20,000, short of the 20,016 its schedule has. Its finished seeds were refused as unfinished,
    and the fix named (re-run without train.max_steps) trained nothing: the file sets it. Runs that all stop at the
    one train.max_steps their config.yaml records ended alike; a seed stopped earlier beside them did not."""
    recipe = tmp_path / "capped.yaml"
    recipe.write_text("train:\n  max_steps: 7\n")  # configs/debug/tiny.yaml: 2 epochs of 4 updates
    runs = [load_config([DEBUG_CONFIG, str(recipe)], [f"out_dir={tmp_path / f'baseline_s{seed}'}", f"train.seed={seed}",
                                                      *extra])
            for seed, extra in ((0, ()), (1, ()), (2, ("train.max_steps=5",)))]
    assert [train.main(cfg).state.step for cfg in runs] == [7, 7, 5]
    paths = []
    for cfg in runs:
        evaluated(cfg.out_dir)
        paths.append(os.path.join(cfg.out_dir, "eval_best.json"))
    # averaged: both stopped at update 7 of their schedule's 8, as their recipe says, and nothing in the table trained
    # further; marked § all the same, 7 of 8 updates being short of 99 % of the schedule (the ImageNet recipe's
    # 20,000 of 20,016 are not: tests/test_paper_table_runs.py)
    table = paper_table.main([*paths[:2], "--over-seeds"])
    assert "| vit_nano | Baseline (n=2)§ |" in table and "at 87.5 % of its schedule's updates (under 99 %)" in table
    with pytest.raises(SystemExit) as refused:
        paper_table.main([*paths, "--over-seeds"])
    message = str(refused.value.code)
    assert message.startswith(f"error: {runs[2].out_dir} validated last at update 5 of the 8 of its schedule "
                              f"(sched.epochs=2 of 4 updates): an unfinished run (stopped at its train.max_steps=5, "
                              f"where {runs[0].out_dir} trained further)"), message


def test_a_run_stopped_by_a_signal_is_refused_in_the_rows_and_finetune_layouts_too(debug_config, monkeypatch):
    """A run stopped by a signal at update 6 of 8 (its best.pt of update 4) was tabulated beside a finished run in
    the rows and fine-tuning layouts with no mark, where --over-seeds, dose_report.py and gap_test.py refuse it. A run
    its own train.max_steps stops is a row of its own there (the first test)."""
    from engine.preemption import Preemption

    finished = debug_config("train.seed=0", name="table/finished")
    assert train.main(finished).state.step == 8
    monkeypatch.setattr(Preemption, "should_stop", lambda self, step=0, boundary=False: step >= 6)  # a SIGTERM
    stopped = debug_config("train.seed=1", name="table/stopped")
    assert train.main(stopped).state.step == 6
    monkeypatch.undo()
    paths = []
    for cfg in (finished, stopped):
        evaluated(cfg.out_dir)
        paths.append(os.path.join(cfg.out_dir, "eval_best.json"))
    assert "| vit_nano | Baseline |" in paper_table.main(paths[:1])
    for layout in (["--layout", "rows"], ["--layout", "finetune"], []):
        with pytest.raises(SystemExit) as refused:
            paper_table.main([*(paths if layout != ["--layout", "finetune"] else paths[1:]), *layout])
        message = str(refused.value.code)
        assert message.startswith(f"error: {stopped.out_dir} validated last at update 4 of the 8 of its schedule "
                                  "(sched.epochs=2 of 4 updates): an unfinished run (stopped by a signal"), message
        assert message.endswith(f"leave {paths[1]} out of the table") and "\n" not in message, message
        assert "would be tabulated as a finished run's" in message and "seed" not in message, message  # one per row
