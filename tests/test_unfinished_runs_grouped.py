"""Runs that stopped before the end of their schedule, and seeds of other updates, where results are averaged or
drawn: compare_act_max.py judges each method's CSVs as seeds (a run stopped by train.max_steps before the others of
its method ended was averaged in), motivation_figure.py each circle as paper_table.py's rows layout judges each row
(a run stopped by a signal was drawn as an ordinary point, one its own train.max_steps stopped unmarked),
paper_table.py --over-seeds the seeds of each row (model and method) apart from the other rows' (seeds of one model
that all stopped alike were refused because another model trained further), the rows layout names the training
settings in which two rows of one model and method differ, and seeds' snapshots of other updates are not averaged
(evaluate.py records the update of the checkpoint it scores). The run folders of the first tests are written by
hand as train.py and evaluate.py write them (eval_best.json and its act_max CSV, metrics.jsonl's validations,
config.yaml's train.max_steps): the numbers the messages must name are those written here."""
import csv
import json
import os
import shutil

import pytest
import torch

import evaluate
import paper_table
import train
from engine.eval_results import evaluation_difference
from tests.conftest import load_script


def write_run(folder, method="Baseline", seed=0, reached=22, max_steps=None, steps=22, model="vit_micro",
              recipe=None):
    """A run folder of a `steps`-update schedule (sched.steps) that validated last at update `reached` (short of
    `steps` without `max_steps`: stopped by a signal), its config.yaml's train.max_steps where given, its
    eval_best.json (RepQ W4A4) and eval_best_act_max.csv (maxima of its own, by seed and update); the JSON's path."""
    folder.mkdir(parents=True)
    csv_path = folder / "eval_best_act_max.csv"
    module = 10.0 + seed + reached / 100
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["name", "kind", "block", "type", "max"])
        writer.writeheader()
        writer.writerows([{"name": "blocks.0", "kind": "block", "block": 0, "type": "block", "max": 2.0},
                          {"name": "blocks.0.mlp.fc2", "kind": "module", "block": 0, "type": "mlp.fc2",
                           "max": module}])
    result = {"model": model, "model_kwargs": {}, "method": method, "fp": {"top1": 80.0},
              "max_act": {"module": module, "block": 2.0, "csv": str(csv_path), "plot": str(csv_path)[:-4] + ".png"},
              "quant": {"repq": {"w4a4": {"top1": 70.0}}}, "checkpoint": str(folder / "best.pt"),
              "checkpoint_kind": "best", "weights": "raw", "eval_amp": "none", "images": 48,
              "data": {"dataset": "digits"}, "train_seed": seed,
              "recipe": {"sched.steps": steps, "sched.epochs": 1, **(recipe or {})}}
    (folder / "eval_best.json").write_text(json.dumps(result))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": reached, "train/loss": 2.3}) + "\n"
                                          + json.dumps({"step": reached, "val/top1": 80.0}) + "\n")
    (folder / "config.yaml").write_text(f"train:\n  seed: {seed}\n"
                                        + (f"  max_steps: {max_steps}\n" if max_steps else ""))
    return str(folder / "eval_best.json")


def act_max_csv(json_path):
    return json_path[:-len(".json")] + "_act_max.csv"


def refusal(main, argv) -> str:
    with pytest.raises(SystemExit) as refused:
        main(argv)
    message = str(refused.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def test_compare_act_max_refuses_a_seed_stopped_before_the_others_of_its_method(tmp_path):
    """base_s1 stopped by train.max_steps=3 at update 3 of 22 beside base_s0, which finished: its maxima were averaged
    in as a seed. A method alone whose run a signal stopped is refused too; seeds that all stopped alike beside
    another method's finished run are drawn (each method averages its own runs)."""
    compare = load_script("compare_act_max")
    finished = write_run(tmp_path / "base_s0")
    capped = write_run(tmp_path / "base_s1", seed=1, reached=3, max_steps=3)
    out = str(tmp_path / "cmp" / "x")
    message = refusal(compare.main, [f"base={tmp_path}/base_s*/eval_best_act_max.csv", "--out", out])
    assert message.startswith(f"error: {tmp_path / 'base_s1'} validated last at update 3 of the 22 of its schedule "
                              f"(sched.steps=22): an unfinished run (stopped at its train.max_steps=3, where "
                              f"{tmp_path / 'base_s0'} trained further)"), message
    assert message.endswith(f"leave {act_max_csv(capped)} out of method 'base'"), message
    signal = write_run(tmp_path / "cd_s0", method="CD", reached=5)  # no train.max_steps: a signal stopped it
    message = refusal(compare.main, [f"base={act_max_csv(finished)}", f"cd={act_max_csv(signal)}", "--out", out])
    assert message.startswith(f"error: {tmp_path / 'cd_s0'} validated last at update 5 of the 22 of its schedule "
                              "(sched.steps=22): an unfinished run (stopped by a signal"), message
    assert not os.path.exists(out + ".csv") and not os.path.exists(out + ".png")
    alike = [write_run(tmp_path / f"tweo_s{seed}", method="TWEO", seed=seed, reached=3, max_steps=3) for seed in (0, 1)]
    rows = compare.main([f"base={act_max_csv(finished)}", f"tweo={tmp_path}/tweo_s*/eval_best_act_max.csv",
                         "--out", out])
    assert {(r["method"], r["runs"]) for r in rows} == {("base", 1), ("tweo§", 2)}, (rows, alike)


def test_compare_act_max_marks_a_method_its_max_steps_stopped(tmp_path, capsys, monkeypatch):
    """CD's seeds that train.max_steps=3 stopped at update 3 of 22, beside a finished Baseline of their model, were
    drawn as an ordinary curve; their method is marked § in the CSV's `method`, the legend and the table, with a note
    on stderr saying how far they got, as paper_table.py and motivation_figure.py mark it. The finished method is
    not marked."""
    compare = load_script("compare_act_max")
    write_run(tmp_path / "base_s0")
    for seed in (0, 1):
        write_run(tmp_path / f"cd_s{seed}", method="CD", seed=seed, reached=3, max_steps=3)
    legends = []
    monkeypatch.setattr(compare, "save_figure",
                        lambda fig, path, overwrite, **kwargs: legends.append(fig.axes[0].get_legend_handles_labels()[1]))
    out = tmp_path / "cmp" / "x"
    capsys.readouterr()
    compare.main([f"base={tmp_path}/base_s*/eval_best_act_max.csv", f"cd={tmp_path}/cd_s*/eval_best_act_max.csv",
                  "--out", str(out)])
    with open(f"{out}.csv", newline="") as f:
        assert sorted({(r["method"], r["runs"]) for r in csv.DictReader(f)}) == [("base", "1"), ("cd§", "2")]
    assert legends == [["base block output", "base module", "cd§ block output", "cd§ module"]], legends
    captured = capsys.readouterr()
    assert "| block | base (block / module) | cd§ (block / module) |" in captured.out, captured.out
    assert ("note: § cd: stopped before the end of its schedule: validated last at update 3 of the 22 of its "
            "schedule (sched.steps=22), where its train.max_steps stopped it, at 13.6 % of its schedule's updates "
            "(under 99 %), while method 'base' ended at update 22") in captured.err, captured.err
    assert "§ base" not in captured.err


def test_motivation_figure_refuses_a_run_a_signal_stopped_and_marks_one_its_max_steps_stopped(tmp_path, capsys):
    """A CD run a signal stopped at update 5 of 22 was drawn as an ordinary circle and CSV row; one that
    train.max_steps=3 stopped at update 3 of 22 beside the finished baseline of its model is drawn with § in its model
    name (a place of its own on the axis, and in the CSV) and a note saying how far it got, as paper_table.py's rows
    layout marks its row."""
    figure = load_script("motivation_figure")
    base = write_run(tmp_path / "base")
    signal = write_run(tmp_path / "signal", method="CD", seed=1, reached=5)
    out = tmp_path / "fig"
    message = refusal(figure.main, [base, signal, "--out", str(out)])
    assert message.startswith(f"error: {tmp_path / 'signal'} validated last at update 5 of the 22 of its schedule "
                              "(sched.steps=22): an unfinished run (stopped by a signal"), message
    assert message.endswith(f"leave {signal} out of the figure") and "drawn as a finished run's" in message, message
    assert not out.exists()
    capped = write_run(tmp_path / "capped", method="CD", seed=1, reached=3, max_steps=3)
    capsys.readouterr()
    figure.main([base, capped, "--out", str(out)])
    with open(out / "motivation.csv", newline="") as f:
        assert [(r["model"], r["method"]) for r in csv.DictReader(f)] == [("vit_micro", "Baseline"),
                                                                            ("vit_micro§", "CD")]
    assert (f"note: § vit_micro CD: stopped before the end of its schedule: validated last at update 3 of the 22 of "
            f"its schedule (sched.steps=22), where its train.max_steps stopped it, at 13.6 % of its schedule's "
            f"updates (under 99 %), while {base} ended at update 22") in capsys.readouterr().err


def test_over_seeds_judges_the_seeds_of_each_row_apart_from_the_other_rows(tmp_path):
    """Baseline seeds that both stopped at train.max_steps=3 of 22 were refused because the CD run of the model,
    never averaged with them, trained to update 22 ('would be averaged as a seed of ... runs that trained longer').
    They are averaged and marked §; a Baseline seed that trained further is refused beside them, naming it."""
    capped = [write_run(tmp_path / f"b{seed}", seed=seed, reached=3, max_steps=3) for seed in (0, 1)]
    cd = write_run(tmp_path / "c0", method="CD")
    lines = paper_table.main([*capped, cd, "--over-seeds"]).splitlines()
    assert [line.split(" | ")[1] for line in lines[2:4]] == ["Baseline (n=2)§", "CD (n=1)"], lines
    assert lines[4:] == ["", "§ vit_micro Baseline: stopped before the end of its schedule: validated last at update "
                             "3 of the 22 of its schedule (sched.steps=22), where its train.max_steps stopped it, at "
                             "13.6 % of its schedule's updates (under 99 %), while c0 ended at update 22"], lines
    further = write_run(tmp_path / "b2", seed=2)
    message = refusal(paper_table.main, [*capped, further, cd, "--over-seeds"])
    assert message.startswith(f"error: {tmp_path / 'b0'} validated last at update 3 of the 22 of its schedule "
                              f"(sched.steps=22): an unfinished run (stopped at its train.max_steps=3, where "
                              f"{tmp_path / 'b2'} trained further)"), message


def test_rows_of_one_model_and_method_trained_otherwise_say_how(tmp_path):
    """Two Baseline rows of runs trained at optim.lr 0.001 and 0.002 read alike but for their Run column; a note
    names the setting. Seeds of one recipe get none."""
    paths = [write_run(tmp_path / "lr1", recipe={"optim.lr": 0.001}),
             write_run(tmp_path / "lr1_s1", seed=1, recipe={"optim.lr": 0.001}),
             write_run(tmp_path / "lr2", recipe={"optim.lr": 0.002})]
    lines = paper_table.main(paths).splitlines()
    assert [line.split(" | ")[2] for line in lines[2:5]] == ["lr1", "lr1_s1", "lr2"], lines
    assert lines[5:] == ["", "vit_micro Baseline: lr2 was trained with other settings than lr1 (optim.lr 0.001 -> "
                             "0.002)"], lines
    assert "\n\n" not in paper_table.main(paths[:2])


def test_seeds_of_other_updates_differ_where_they_are_snapshots_or_files_set_aside():
    """Snapshots (or files set aside) of updates 4 and 8 are no seeds of one evaluation; best.pt files of those
    updates are (each run's best validation), and a checkpoint.pt's update is its run's end (refuse_unfinished).
    A result written before the update was recorded is not compared."""
    for kind, differs in (("snapshot", True), ("other", True), ("best", False), ("latest", False)):
        a = {"model": "vit_nano", "checkpoint_kind": kind, "checkpoint_step": 4}
        b = dict(a, checkpoint_step=8)
        difference = evaluation_difference(a, b)
        assert (difference is not None) == differs, (kind, difference)
        if differs:
            assert difference.what == "checkpoint_step" and str(difference).startswith(
                f"checkpoint_step: update 4 vs update 8 ({kind} files)"), difference
        assert evaluation_difference(a, {k: v for k, v in b.items() if k != "checkpoint_step"}) is None
        assert evaluation_difference(a, dict(a)) is None
    # files whose training state shows their run's best validation: renamed best.pt copies (kind "other") are seeds
    # of one evaluation, as best.pt files are; one of them beside another file, or snapshots, are not
    for kind, flags, differs in (("other", (True, True), False), ("other", (True, False), True),
                                 ("other", (True, None), True), ("snapshot", (True, True), True)):
        a = {"model": "vit_nano", "checkpoint_kind": kind, "checkpoint_step": 4, "checkpoint_best": flags[0]}
        b = dict(a, checkpoint_step=8, checkpoint_best=flags[1])
        assert (evaluation_difference(a, b) is not None) == differs, (kind, flags)


@pytest.mark.slow
def test_evaluate_records_the_update_of_a_snapshot_and_over_seeds_refuses_snapshots_of_other_epochs(debug_config,
                                                                                                   tmp_path):
    """configs/debug/tiny.yaml: 2 epochs of 4 updates (64 images at batch 16), a snapshot after each
    (train.keep_every_epochs=1); seed 0 validates every 2 updates (train.eval_every_steps, no recipe setting), so its
    best validation falls at another update than seed 1's. Seed 0's epoch-1 snapshot and seed 1's epoch-2 snapshot
    were averaged as seeds of 'the same kind of checkpoint'; evaluate.py records each one's update (4 and 8) and
    --over-seeds refuses them, while the two seeds' best.pt results are averaged, and so are copies of their best.pt
    files under other names (gathered/seed<N>.pt, kind "other", which were refused for their updates); copies of the
    two snapshots under other names are still refused."""
    runs = [debug_config(f"train.seed={seed}", "train.keep_every_epochs=1", name=f"snap_s{seed}",
                         *(["train.eval_every_steps=2"] if seed == 0 else [])) for seed in (0, 1)]
    for cfg in runs:
        assert train.main(cfg).state.step == 8
    paths = []
    for cfg, checkpoint in zip(runs, ("snapshots/epoch0001.pt", "snapshots/epoch0002.pt")):
        evaluate.main(evaluate.parse_args(["--checkpoint", os.path.join(cfg.out_dir, checkpoint), "--quant"]))
        paths.append(os.path.join(cfg.out_dir, "snapshots", f"eval_{os.path.basename(checkpoint)[:-3]}.json"))
    assert [json.load(open(p))["checkpoint_step"] for p in paths] == [4, 8]
    message = refusal(paper_table.main, [*paths, "--over-seeds"])
    assert "were evaluated differently (checkpoint_step: update 4 vs update 8 (snapshot files)" in message, message
    best = []
    for cfg in runs:
        evaluate.main(evaluate.parse_args(["--checkpoint", os.path.join(cfg.out_dir, "best.pt"), "--quant"]))
        best.append(os.path.join(cfg.out_dir, "eval_best.json"))
    assert "| vit_nano | Baseline (n=2) |" in paper_table.main([*best, "--over-seeds"])
    gathered = tmp_path / "gathered"
    gathered.mkdir()
    copies = {}
    for name, sources in (("seed", [os.path.join(cfg.out_dir, "best.pt") for cfg in runs]),
                          ("snap", [os.path.join(cfg.out_dir, c) for cfg, c in zip(runs, ("snapshots/epoch0001.pt",
                                                                                        "snapshots/epoch0002.pt"))])):
        copies[name] = []
        for seed, source in enumerate(sources):
            shutil.copyfile(source, gathered / f"{name}{seed}.pt")
            evaluate.main(evaluate.parse_args(["--checkpoint", str(gathered / f"{name}{seed}.pt"), "--quant"]))
            copies[name].append(str(gathered / f"eval_{name}{seed}.json"))
    # the best validations' updates, as train.py's state in each best.pt records them: other updates
    steps = [torch.load(os.path.join(cfg.out_dir, "best.pt"), weights_only=True)["state"]["best_step"] for cfg in runs]
    assert steps[0] != steps[1], steps
    recorded = [json.load(open(p)) for p in copies["seed"]]
    assert [(r["checkpoint_kind"], r["checkpoint_step"], r["checkpoint_best"]) for r in recorded] == \
        [("other", steps[0], True), ("other", steps[1], True)], recorded
    assert "| vit_nano | Baseline (n=2) |" in paper_table.main([*copies["seed"], "--over-seeds"])
    message = refusal(paper_table.main, [*copies["snap"], "--over-seeds"])
    assert "were evaluated differently (checkpoint_step: update 4 vs update 8 (other files)" in message, message

