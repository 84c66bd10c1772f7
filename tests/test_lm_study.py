"""scripts/lm_study.py: the language-model study's tables against values computed by hand from run folders
written here (metrics.jsonl, eval_best.json, the activation CSV with kurtosis), its figures, and its
refusals (an image sweep, existing outputs)."""
import json
import math
import os
import statistics

import pytest

from engine.eval_results import ResultsError
from tests.conftest import check_overwrite_keeps_others_files

import dose_report
import lm_study



def write_run(root, name, *, ppl, rtn, block_max, kurtosis, fc2_final, strict_a5=None):
    folder = root / name
    folder.mkdir()
    with open(folder / "metrics.jsonl", "w") as f:
        for step, energy in ((25, 50.0), (50, fc2_final)):
            f.write(json.dumps({"step": step, "train/loss": 2.0, "cd/pair_energy/qkv": 8.0, "cd/pair_energy/proj": 4.0,
                                "cd/pair_energy/fc1": 6.0, "cd/pair_energy/fc2": energy}) + "\n")
            f.write(json.dumps({"step": step, "val/loss": 1.5, "act/max_block": block_max * step / 50,
                                "act/kurtosis_block": kurtosis, "act/max_module": 9.0}) + "\n")
    quant = {"rtn": {"w4a16": {"ppl": rtn}}, "gptq": {"w4a16": {"ppl": ppl + 0.01}},
             "smoothquant": {"w8a8": {"ppl": ppl}}}
    if strict_a5 is not None:
        quant["smoothquant_strict"] = {"w8a5": {"ppl": strict_a5}}
    with open(folder / "eval_best.json", "w") as f:
        json.dump({"fp": {"ppl": ppl, "ppl_bf16": ppl + 0.002, "loss": 1.0},
                   "max_act": {"module": 9.0, "block": block_max, "kurtosis": {"block": kurtosis, "module": 40.0}},
                   "quant": quant}, f)
    with open(folder / "eval_best_act_max.csv", "w") as f:
        f.write("name,kind,block,type,max,kurtosis\n")
        f.write(f"blocks.0.mlp.fc2,module,0,mlp.fc2,2.0,{kurtosis + 1}\n")
        f.write(f"blocks.1.mlp.fc2,module,1,mlp.fc2,3.0,{kurtosis}\n")
        f.write(f"blocks.1,block,1,block,{block_max},{kurtosis}\n")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_sweep")
    write_run(root, "baseline_s0", ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0, strict_a5=5.0)
    write_run(root, "baseline_s1", ppl=4.2, rtn=5.4, block_max=30.0, kurtosis=14.0, fc2_final=120.0, strict_a5=5.6)
    write_run(root, "cd10x_s0", ppl=4.1, rtn=4.5, block_max=8.0, kurtosis=5.0, fc2_final=40.0)
    return root


def test_tables_match_hand_computed_values(sweep, tmp_path):
    report = lm_study.main([str(sweep), "--out", str(tmp_path)])
    rows = {line.split(" | ")[0].strip("| "): line for line in report.splitlines() if line.startswith("| ")}
    # baseline: ppl mean 4.1, sample std 0.1414; rtn mean 5.2, std 0.2828; smoothquant_strict absent
    assert "| baseline | 0,1 | 4.100 ± 0.141 | 4.102 ± 0.141 | 5.200 ± 0.283 | 4.110 ± 0.141 | 4.100 ± 0.141 | " \
           "- | - | - | - |" in report
    assert "| cd10x | 0 | 4.100 | 4.102 | 4.500 | 4.110 | 4.100 | - | - | - | - |" in report
    # final energies (fc2: 110 ± 14.1), block maxima, kurtosis
    assert ("| baseline | 8.0 ± 0.0 | 4.0 ± 0.0 | 6.0 ± 0.0 | 110.0 ± 14.1 | 9.00 ± 0.00 | 25.00 ± 7.07 | "
            "12.0 ± 2.8 |") in report
    # activation bits: baseline gaps 1.0 and 1.4 (each run against its own fp32): 1.2 ± 0.283; SQ W8A8 gaps 0
    assert "| baseline | - | - | 1.200 ± 0.283 | - | 0.000 ± 0.000 | - | - | - |" in report
    assert "| cd10x | - | - | - | - | 0.000 | - | - | - |" in report
    # per type: mlp.fc2's largest max over blocks is 3.0; its largest kurtosis is kurtosis + 1 (block 0)
    assert rows["cd10x"]  # present in every table
    assert "| cd10x | - | - | - | - | - | - | - | 3.0 | - | 8.0 |" in report
    assert "| cd10x | - | - | - | - | - | - | - | 6.0 | - | 5.0 |" in report
    for name in lm_study.OUTPUTS[1:]:
        assert os.path.getsize(tmp_path / name) > 1000  # a PNG was drawn


def test_refuses_existing_outputs_and_image_sweeps(sweep, tmp_path):
    (tmp_path / "lm_study.md").write_text("mine")
    with pytest.raises(Exception, match="lm_study.md"):
        lm_study.main([str(sweep), "--out", str(tmp_path)])
    assert (tmp_path / "lm_study.md").read_text() == "mine"
    image = tmp_path / "image_sweep"
    image.mkdir()
    write_run(image, "baseline_s0", ppl=4.0, rtn=5.0, block_max=2.0, kurtosis=3.0, fc2_final=1.0)
    result = json.loads((image / "baseline_s0" / "eval_best.json").read_text())
    result["fp"] = {"top1": 80.0}
    (image / "baseline_s0" / "eval_best.json").write_text(json.dumps(result))
    with pytest.raises(lm_study.ReportError, match="not a language-model sweep"):
        lm_study.main([str(image), "--out", str(tmp_path / "out")])


def test_a_perplexity_at_the_cap_is_shown_as_the_bound(tmp_path):
    """A seed whose model collapsed has the capped perplexity exp(700) (its exp overflowed): the point's cells
    say so, never a 305-digit mean of it."""
    root = tmp_path / "sweep"
    root.mkdir()
    write_run(root, "baseline_s0", ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
    write_run(root, "baseline_s1", ppl=math.exp(700.0), rtn=math.exp(700.0), block_max=30.0, kurtosis=14.0,
              fc2_final=120.0)
    report = lm_study.main([str(root), "--out", str(tmp_path / "out")])
    capped = ">= exp(700) (capped)"
    assert f"| baseline | 0,1 | {capped} | {capped} | {capped} | {capped} | {capped} | - | - | - | - |" in report
    assert "e+303" not in report and "0000000000" not in report
    assert "Quantization gap" not in report  # no run was evaluated below 8 activation bits: no such table


def test_a_huge_perplexity_below_the_cap_is_averaged_not_an_overflow(tmp_path):
    """A diverged seed's perplexity below the cap (loss 400 nats: 5e173) beside a healthy one: the squared deviation
    (1e347) ended the report in an OverflowError; the cell is mean ± sample std, against Python's statistics
    module (exact fractions)."""
    root = tmp_path / "sweep"
    root.mkdir()
    write_run(root, "baseline_s0", ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
    write_run(root, "baseline_s1", ppl=math.exp(400.0), rtn=5.0, block_max=30.0, kurtosis=14.0, fc2_final=120.0)
    report = lm_study.main([str(root), "--out", str(tmp_path / "out")])
    row = next(line for line in report.splitlines() if line.startswith("| baseline | 0,1 | "))
    mean, std = (float(part) for part in row.split(" | ")[2].split(" ± "))
    assert mean == pytest.approx(statistics.mean([4.0, math.exp(400.0)]), rel=1e-12)
    assert std == pytest.approx(statistics.stdev([4.0, math.exp(400.0)]), rel=1e-12)


def test_a_validation_logged_twice_counts_with_its_last_record(tmp_path):
    """A run resumed from before a validation logs that update again: the curve holds the later record once."""
    folder = tmp_path / "baseline_s0"
    folder.mkdir()
    records = [{"step": 10, "val/loss": 2.0}, {"step": 20, "val/loss": 1.8}, {"step": 10, "val/loss": 1.5},
               {"step": 20, "train/loss": 1.0}, {"step": 20, "val/loss": 1.2}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = lm_study.Run("baseline", 0, str(folder), {}, {}, [])
    assert lm_study.validation_curve(run, "val/loss") == [(10, 1.5), (20, 1.2)]


def test_a_column_over_fewer_seeds_names_its_count(tmp_path):
    """The seeds column lists every run of a point; a cell averaged over fewer (a pipeline or bit-width
    some seeds were not evaluated at) says over how many."""
    root = tmp_path / "sweep"
    root.mkdir()
    write_run(root, "baseline_s0", ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0, strict_a5=5.0)
    write_run(root, "baseline_s1", ppl=4.2, rtn=5.4, block_max=30.0, kurtosis=14.0, fc2_final=120.0)
    report = lm_study.main([str(root), "--out", str(tmp_path / "out")])
    assert "| baseline | - | - | 1.000 (n=1) | - | 0.000 ± 0.000 | - | - | - |" in report  # the W8A5 gap of s0


def test_the_seeds_column_lists_the_seed_numbers_not_their_count(tmp_path):
    """A point's seeds cell names the seeds its row averages, as dose_report.py's Seeds column does: it held their
    count, and a point of two runs showed "2", which reads as seed 2. Seeds 2 and 5 and a lone seed 3 (neither
    a count nor 0..n-1), from the run folders' names <point>_s<seed>."""
    root = tmp_path / "sweep"
    root.mkdir()
    for name in ("baseline_s2", "baseline_s5", "cd10x_s3"):
        write_run(root, name, ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
    report = lm_study.main([str(root), "--out", str(tmp_path / "out")])
    first_table = report.split("\n\n")[0].splitlines()
    assert first_table[0].startswith("| Point | seeds | FP32 PPL |")
    assert {line.split(" | ")[0].strip("| "): line.split(" | ")[1] for line in first_table[2:]} == \
        {"baseline": "2,5", "cd10x": "3"}


def test_type_tables_average_every_seed_and_name_the_count_of_a_type_some_seeds_lack(tmp_path):
    """The per-type tables are over all seeds of a point: the block type's largest max of 20 and 30 is their mean
    and sample std, computed here with statistics; a type only one seed of two records (s1's CSV has no mlp.fc2
    rows) is that seed's value with its count, as the quantized columns name theirs."""
    root = tmp_path / "sweep"
    root.mkdir()
    write_run(root, "baseline_s0", ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
    write_run(root, "baseline_s1", ppl=4.2, rtn=5.4, block_max=30.0, kurtosis=14.0, fc2_final=120.0)
    csv = root / "baseline_s1" / "eval_best_act_max.csv"
    csv.write_text("".join(line for line in csv.read_text().splitlines(keepends=True) if ",mlp.fc2," not in line))
    tables = lm_study.tables(dose_report.by_point(dose_report.read_sweep(str(root))))
    maxima, kurtosis = (tables.split(what)[1].split("\n\n")[1].splitlines()[-1]
                        for what in ("Largest max |activation| per module type", "Largest kurtosis per module type"))
    dashes = " | ".join(["-"] * 7)
    # s0's mlp.fc2: max(2, 3) over its blocks, kurtosis max(10 + 1, 10); the block output of both seeds
    assert maxima == f"| baseline | {dashes} | 3.0 (n=1) | - | 25.0 ± {statistics.stdev([20.0, 30.0]):.1f} |"
    assert kurtosis == f"| baseline | {dashes} | 11.0 (n=1) | - | 12.0 ± {statistics.stdev([10.0, 14.0]):.1f} |"

def test_seeds_of_a_point_trained_with_other_settings_are_refused_not_averaged(tmp_path):
    """A seed of the baseline trained with another learning rate is no seed of the baseline (was averaged into
    one 'baseline | 2' row); points differ in their settings (the CD strength) by design."""
    root = tmp_path / "sweep"
    root.mkdir()
    recipes = {"baseline_s0": {"optim.lr": 0.001, "cd.lam": 0.0}, "baseline_s1": {"optim.lr": 0.01, "cd.lam": 0.0},
               "cd10x_s0": {"optim.lr": 0.001, "cd.lam": 0.05}}
    for name, recipe in recipes.items():
        write_run(root, name, ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
        path = root / name / "eval_best.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "recipe": recipe}))
    with pytest.raises(lm_study.ReportError, match=r"baseline_s0 and .*baseline_s1 are seeds of point baseline but "
                                                   r"were trained with other settings \(optim.lr 0.001 -> 0.01\)"):
        lm_study.main([str(root), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    # a key only one seed's recipe has is a setting added to the config between two evaluate.py versions
    path = root / "baseline_s1" / "eval_best.json"
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                "recipe": {"optim.lr": 0.001, "cd.lam": 0.0, "cd.precision": "fp32"}}))
    assert "| baseline | 0,1 |" in lm_study.main([str(root), "--out", str(tmp_path / "out")])


def test_a_point_evaluated_with_other_model_kwargs_than_trained_is_marked(tmp_path):
    """Runs evaluated with a model.kwargs override (gelu=tanh, trained with the exact GELU) are the same weights
    through another forward: the point is marked † in every table of evaluated numbers, with a note naming both
    settings below the first; a seed evaluated as trained beside one evaluated otherwise is refused."""
    root = tmp_path / "sweep"
    root.mkdir()
    for name, kwargs in (("baseline_s0", {}), ("cd10x_s0", {"gelu": "tanh"}), ("cd10x_s1", {"gelu": "tanh"})):
        write_run(root, name, ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0, strict_a5=5.0)
        _edit_result(root / name, lambda r: r.update(model_kwargs=kwargs, recipe={"model.kwargs": {}}))
    lines = lm_study.main([str(root), "--out", str(tmp_path / "out")]).splitlines()
    rows = [line for line in lines if line.startswith("| cd10x")]
    assert len(rows) == 5 and all(line.startswith("| cd10x† | ") for line in rows)  # ppl, maxima, gaps, 2 types
    assert not any(line.startswith("| baseline†") for line in lines)
    note = '† cd10x: evaluated with model.kwargs={"gelu": "tanh"} (trained with {})'
    assert lines.count(note) == 1 and lines.index(note) < lines.index(next(r for r in lines if "Final pair" in r))
    _edit_result(root / "cd10x_s1", lambda r: r.update(model_kwargs={}))
    with pytest.raises(lm_study.ReportError, match=r"cd10x_s0 and .*cd10x_s1 were evaluated with other model.kwargs"):
        lm_study.main([str(root), "--out", str(tmp_path / "out2")])


def test_a_run_evaluated_before_its_last_update_is_refused_not_averaged(tmp_path):
    """A run evaluated while it trained (last validation at update 50 of 2,000) would count as a seed of its
    point, its energies and perplexities those of an early model; runs that reached their sched.steps, and
    runs whose log does not tell (an epoch schedule without a training record of its epochs), are reported."""
    root = tmp_path / "sweep"
    root.mkdir()
    for name in ("baseline_s0", "cd10x_s0"):  # both validated last at update 50
        write_run(root, name, ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
    _edit_result(root / "baseline_s0", lambda r: r.update(recipe={"sched.steps": 50}))
    _edit_result(root / "cd10x_s0", lambda r: r.update(recipe={"sched.steps": 2000}))
    with pytest.raises(ResultsError, match=r"cd10x_s0 validated last at update 50 of the 2000 of its "
                                                    r"schedule \(sched.steps=2000\): an unfinished run"):
        lm_study.main([str(root), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    _edit_result(root / "cd10x_s0", lambda r: r.update(recipe={"sched.steps": None, "sched.epochs": 3}))
    assert "| cd10x | 0 |" in lm_study.main([str(root), "--out", str(tmp_path / "out")])


def test_a_run_one_update_short_of_its_schedule_is_unfinished(tmp_path):
    """The bound of the check: a run that validated last at update 50 finished a schedule of 50 updates and
    did not finish one of 51 (train.py validates at its last update)."""
    write_run(tmp_path, "baseline_s0", ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
    folder = str(tmp_path / "baseline_s0")  # write_run: validations at updates 25 and 50
    lm_study.check_finished([lm_study.Run("baseline", 0, folder, {}, {"recipe": {"sched.steps": 50}}, [])])
    with pytest.raises(ResultsError, match=r"validated last at update 50 of the 51 of its schedule"):
        lm_study.check_finished([lm_study.Run("baseline", 0, folder, {}, {"recipe": {"sched.steps": 51}}, [])])


def _edit_result(folder, edit):
    result = json.loads((folder / "eval_best.json").read_text())
    edit(result)
    (folder / "eval_best.json").write_text(json.dumps(result))


@pytest.mark.parametrize("damage, message", [
    (lambda f: _edit_result(f, lambda r: r["fp"].pop("ppl_bf16")), r"eval_best.json has no number at fp.ppl_bf16"),
    (lambda f: _edit_result(f, lambda r: r["max_act"].pop("kurtosis")),
     r"eval_best.json has no number at max_act.kurtosis.block"),
    (lambda f: _edit_result(f, lambda r: r["quant"]["rtn"]["w4a16"].pop("ppl")),
     r"eval_best.json has no number at quant.rtn.w4a16.ppl"),
    (lambda f: (f / "metrics.jsonl").write_text(""), r"metrics.jsonl has no record of cd/pair_energy/qkv"),
    (lambda f: (f / "metrics.jsonl").write_text('{"train/loss": 2.0}\n' + (f / "metrics.jsonl").read_text()),
     r"metrics.jsonl, line 1: a record without an integer 'step'"),
    (lambda f: (f / "eval_best_act_max.csv").write_text("name,kind,type,max\nblocks.1,block,block,3.0\n"),
     r"eval_best_act_max.csv has no column block"),
    (lambda f: (f / "eval_best_act_max.csv").write_text("name,kind,block,type,max\nblocks.1,block,one,block,3.0\n"),
     r"eval_best_act_max.csv, line 2: block 'one' is not an integer"),
    (lambda f: (f / "eval_best_act_max.csv").write_text("name,kind,block,type,max\nblocks.1,block,1,block,big\n"),
     r"eval_best_act_max.csv, line 2: max 'big' is not a number"),
    (lambda f: (f / "eval_best_act_max.csv").write_text(
        "name,kind,block,type,max,kurtosis\nblocks.1,block,1,block,3.0,\n"), r"line 2: kurtosis '' is not a number"),
    (lambda f: (f / "metrics.jsonl").write_text('{"step": 5, "cd/pair_energy/qkv": "8.0"}\n'),
     r"metrics.jsonl: cd/pair_energy/qkv at update 5 is '8.0', not a number"),
    (lambda f: (f / "metrics.jsonl").write_text((f / "metrics.jsonl").read_text().replace('"val/loss": 1.5',
                                                                                          '"val/loss": null')),
     r"metrics.jsonl: val/loss at update 25 is None, not a number"),
    (lambda f: (f / "metrics.jsonl").write_text((f / "metrics.jsonl").read_text().replace('"val/loss": 1.5, "act',
                                                                                          '"val/loss": NaN, "act', 1)),
     r"baseline_s0.metrics.jsonl: val/loss at update 25 is nan: the run diverged there"),
    (lambda f: (f / "metrics.jsonl").write_text((f / "metrics.jsonl").read_text().replace(
        '"val/loss": 1.5, "act', '"val/loss": "inf", "act', 1)),
     r"baseline_s0.metrics.jsonl: val/loss at update 25 is 'inf': the run diverged there"),
    (lambda f: (f / "metrics.jsonl").write_text("".join(  # a run trained without log.act_max: an empty curve
        json.dumps({k: v for k, v in json.loads(line).items() if not k.startswith("act/")}) + "\n"
        for line in (f / "metrics.jsonl").read_text().splitlines())),
     r"baseline_s0.metrics.jsonl has no record of act/max_block, which lm_study_outliers.png draws at every "
     r"validation: train the runs with log.act_max=true"),
    (lambda f: (f / "metrics.jsonl").write_text("".join(  # no validation record at all: log.act_max is no fix
        json.dumps({k: v for k, v in json.loads(line).items() if k != "val/loss"}) + "\n"
        for line in (f / "metrics.jsonl").read_text().splitlines())),
     r"has no record of val/loss, which lm_study_outliers.png draws at every validation: give runs that validated"),
])
def test_a_run_file_without_what_the_report_reads_is_named(tmp_path, damage, message):
    """A result, metrics log or maxima file of another shape is one error naming the file and what it lacks
    (were KeyError / ValueError tracebacks), before anything is written."""
    root = tmp_path / "sweep"
    root.mkdir()
    write_run(root, "baseline_s0", ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
    damage(root / "baseline_s0")
    with pytest.raises((lm_study.ReportError, ResultsError), match=message):
        lm_study.main([str(root), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_the_report_names_what_each_point_changes_beside_the_baseline(tmp_path):
    """A point trained at another lr as well as another dose shows both: the tables alone credit the dose."""
    root = tmp_path / "sweep"
    root.mkdir()
    recipes = {"baseline_s0": {"optim.lr": 0.003, "cd.enabled": False, "cd.lam": 0.005},
               "cd10x_s0": {"optim.lr": 0.003, "cd.enabled": True, "cd.lam": 0.05},
               "cd30x_s0": {"optim.lr": 0.001, "cd.enabled": True, "cd.lam": 0.15}, "tweo_s0": None}
    for name, recipe in recipes.items():
        write_run(root, name, ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
        if recipe is not None:
            path = root / name / "eval_best.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), "recipe": recipe}))
    report = lm_study.main([str(root), "--out", str(tmp_path / "out")]).splitlines()
    section = report[report.index("Training settings of each point beside baseline's (the recipe in its "
                                  "eval_best.json)"):]
    assert section[2:] == ["- baseline: the reference",
                           "- cd10x: cd.enabled false -> true; cd.lam 0.005 -> 0.05",
                           "- cd30x: cd.enabled false -> true; cd.lam 0.005 -> 0.15; optim.lr 0.003 -> 0.001",
                           "- tweo: not recorded (an eval_best.json written before evaluate.py recorded it)"]


def test_a_run_evaluated_before_its_best_pt_was_replaced_is_refused_by_name(tmp_path):
    """A run that trained on after its evaluation holds a newer best.pt than the one its eval_best.json scored:
    its row would mix the old weights' perplexities with the new run's curves. The file records the weights it
    scored (evaluate.py's checkpoint path and fingerprint); one that no longer matches best.pt is refused, naming
    the file and the command that refreshes it, while a file of the current best.pt is read."""
    import torch

    from engine.checkpoint import weights_fingerprint

    root = tmp_path / "sweep"
    root.mkdir()
    for name in ("baseline_s0", "baseline_s1"):
        write_run(root, name, ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
    other_seed, evaluated, newer = ({"w": torch.full((3,), float(v))} for v in range(3))
    for name, scored, now in (("baseline_s0", other_seed, other_seed), ("baseline_s1", evaluated, newer)):
        folder = root / name
        torch.save({"model": now, "config": {}}, folder / "best.pt")
        result = json.loads((folder / "eval_best.json").read_text())
        result.update(checkpoint=str(folder / "best.pt"), weights="raw", fingerprint=weights_fingerprint(scored))
        (folder / "eval_best.json").write_text(json.dumps(result))
    stale = root / "baseline_s1" / "eval_best.json"
    with pytest.raises(ResultsError) as refused:
        lm_study.main([str(root), "--out", str(tmp_path / "out")])
    message = str(refused.value)
    assert message.startswith(f"{stale} is stale") and "\n" not in message, message
    assert f"python evaluate.py --checkpoint {root / 'baseline_s1' / 'best.pt'} --out {stale}" in message, message
    assert not (tmp_path / "out").exists()  # refused before anything is written
    torch.save({"model": evaluated, "config": {}}, root / "baseline_s1" / "best.pt")  # the weights it scored
    assert "| baseline | 0,1 |" in lm_study.main([str(root), "--out", str(tmp_path / "out")])


def test_module_maxima_over_extra_modules_are_marked_in_the_table(tmp_path):
    """Runs whose module maximum also counts modules outside the blocks (quant.act_max_extra_modules, e.g. the
    token embedding) all alike: not the paper's maximum, so its cell is marked ‡ with a note naming the patterns
    below that table, as evaluate.py's table marks it; the block maximum and the point labels are not."""
    for name, seed_ppl in (("baseline_s0", 4.0), ("cd10x_s0", 4.1)):
        write_run(tmp_path, name, ppl=seed_ppl, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
        path = tmp_path / name / "eval_best.json"
        result = json.loads(path.read_text())
        result["max_act"]["extra_modules"] = ["wte"]
        path.write_text(json.dumps(result))
    report = lm_study.tables(dose_report.by_point(dose_report.read_sweep(str(tmp_path))))
    second = report.split("Final pair energy")[1].split("per module type")[0]
    # module maximum 9.0 (write_run), block 20.0, kurtosis 10.0
    assert "| baseline | 8.0 | 4.0 | 6.0 | 100.0 | 9.00‡ | 20.00 | 10.0 |" in second
    assert "| cd10x | 8.0 | 4.0 | 6.0 | 100.0 | 9.00‡ | 20.00 | 10.0 |" in second
    note = '‡ {}: the module maximum also counts modules outside the blocks: quant.act_max_extra_modules=["wte"]'
    assert note.format("baseline") in second.splitlines() and note.format("cd10x") in second.splitlines()
    assert "‡" not in report.split("Final pair energy")[0] and report.count("‡") == 4


@pytest.mark.parametrize("damage, file, message", [
    (lambda f: (f / "metrics.jsonl").write_bytes(b'{"step": 1, "val/loss": 1.0}\n\xff\xfe\n'), "metrics.jsonl",
     "cannot be read as text"),
    (lambda f: (f / "eval_best_act_max.csv").write_bytes(b"name,kind,block,type,max\nblocks.\xff,block,1,block,3\n"),
     "eval_best_act_max.csv", "cannot be read as text"),
    (lambda f: _edit_result(f, lambda r: r["quant"].update(rtn={"w4a16": 5.0})), "eval_best.json",
     "missing or odd: quant.rtn.w4a16)"),
    (lambda f: _edit_result(f, lambda r: r["quant"]["rtn"]["w4a16"].update(settings=[1])), "eval_best.json",
     "missing or odd: quant.rtn.w4a16.settings)"),
    (lambda f: _edit_result(f, lambda r: r.update(recipe=["sched.steps", 50])), "eval_best.json",
     "missing or odd: recipe)"),
    (lambda f: _edit_result(f, lambda r: r["fp"].update(ppl=float("nan"))), "eval_best.json",
     "has no number at fp.ppl:"),
    (lambda f: _edit_result(f, lambda r: r["max_act"].update(block=float("inf"))), "eval_best.json",
     "has no number at max_act.block:"),
])
def test_a_damaged_run_file_is_one_error_line_naming_the_file_and_the_key(tmp_path, capsys, damage, file, message):
    """Bytes that are not UTF-8 in metrics.jsonl or the maxima CSV, a quantized entry or a recipe of another type
    than evaluate.py writes (were UnicodeDecodeError / AttributeError tracebacks), and a NaN or inf where the
    tables read a number (printed as nan ± nan): one `error:` line naming the file and what is wrong there."""
    from tests.conftest import run_entry

    root = tmp_path / "sweep"
    root.mkdir()
    for name in ("baseline_s0", "baseline_s1"):
        write_run(root, name, ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
    damage(root / "baseline_s1")
    code, out, err = run_entry("scripts/lm_study.py", [str(root), "--out", str(tmp_path / "out")], capsys)
    assert isinstance(code, str) and "\n" not in code and not out and not err, (code, err)
    assert code.startswith("error: ") and str(root / "baseline_s1" / file) in code and message in code, code
    assert not (tmp_path / "out").exists()


def copied_sweep_with_a_new_best(tmp_path, names=("baseline_s0", "baseline_s1")):
    """(the original sweep, a copy of it whose baseline_s1 saved a new best.pt after the copy): every
    eval_best.json records the original's best.pt, as evaluate.py records the checkpoint it scored."""
    import shutil

    import torch

    from engine.checkpoint import weights_fingerprint

    original = tmp_path / "sweep"
    original.mkdir()
    for k, name in enumerate(names):
        write_run(original, name, ppl=4.0 + 0.1 * k, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0,
                  strict_a5=5.2 + 0.1 * k)
        weights = {"w": torch.full((3,), float(k))}
        torch.save({"model": weights, "config": {}}, original / name / "best.pt")
        _edit_result(original / name, lambda r: r.update(checkpoint=str(original / name / "best.pt"), weights="raw",
                                                         fingerprint=weights_fingerprint(weights)))
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    torch.save({"model": {"w": torch.full((3,), 9.0)}, "config": {}}, copy / names[-1] / "best.pt")
    return original, copy


def test_a_copied_sweep_is_checked_against_the_best_pt_beside_each_result(tmp_path):
    """The staleness check compared the checkpoint an eval_best.json records while it exists: in a copy of a sweep,
    the original's best.pt, so a copy whose run trained on was reported with its old evaluation. The best.pt beside
    the file, which the report's run folder holds, is the one compared."""
    original, copy = copied_sweep_with_a_new_best(tmp_path)
    assert "| baseline | 0,1 |" in lm_study.main([str(original), "--out", str(tmp_path / "out")])
    stale, now = copy / "baseline_s1" / "eval_best.json", copy / "baseline_s1" / "best.pt"
    with pytest.raises(ResultsError, match=rf"{stale} is stale: it scored other weights than {now} holds now"):
        lm_study.main([str(copy), "--out", str(tmp_path / "out2")])
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("fp, strict_a5, shown", [
    (4.2, math.exp(700.0), ">= exp(700) (capped)"),  # quantized at the cap: a gap of at least about that
    (math.exp(700.0), math.exp(700.0), "FP32 capped"),  # cap - cap: no gap of 0
    (math.exp(700.0), 4.0, "FP32 capped"),  # 4 - cap: no gap of at least exp(700), nor a number
])
def test_a_gap_with_a_perplexity_at_the_cap_is_that_bound_not_a_number(tmp_path, fp, strict_a5, shown):
    """A collapsed seed has its quantized perplexity, or its fp32 one, at the cap exp(700): its gap, cap - cap, was
    averaged as 0 (lowering the point's mean gap), cap - 4 was averaged as a number, and 4 - cap shown as a gap of
    at least exp(700). A quantized perplexity at the cap makes the cell that bound, as the perplexity tables show
    it; an fp32 one at the cap leaves the run no gap, and the cell says so."""
    root = tmp_path / "sweep"
    root.mkdir()
    write_run(root, "baseline_s0", ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0, strict_a5=5.0)
    write_run(root, "baseline_s1", ppl=fp, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0,
              strict_a5=strict_a5)
    report = lm_study.main([str(root), "--out", str(tmp_path / "out")])
    gaps = report.split("Quantization gap")[1].split("per module type")[0]
    assert f"| baseline | - | - | {shown} | - | " in gaps, gaps
    assert "0.500" not in gaps and "e+30" not in gaps


def test_quantized_numbers_of_other_settings_than_the_defaults_are_marked_and_named(tmp_path):
    """Every run calibrated on 64 windows (quant.calib_images=64, the defaults' 32 otherwise): paper_table.py marks
    such a cell * with a note naming the setting; lm_study.py showed it as the defaults' number. Marked in both
    tables of quantized numbers, one note per pipeline and bits naming the points."""
    root = tmp_path / "sweep"
    root.mkdir()
    for name in ("baseline_s0", "cd10x_s0"):
        write_run(root, name, ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0, strict_a5=5.0)
        for pipeline, bits in (("gptq", "w4a16"), ("smoothquant_strict", "w8a5")):
            _edit_result(root / name, lambda r: r["quant"][pipeline][bits].update(
                settings={"options": {}, "calibration": {"images": 64, "seed": 0, "split": "train"}}))
    report = lm_study.main([str(root), "--out", str(tmp_path / "out")])
    assert "| baseline | 0 | 4.000 | 4.002 | 5.000 | 4.010* | 4.000 |" in report
    assert "| cd10x | - | - | 1.000* | - |" in report
    note = "\\* baseline, cd10x {}: not the default settings: quant.calib_images=64"
    assert report.splitlines().count(note.format("GPTQ W4A16")) == 1
    assert report.splitlines().count(note.format("SmoothQuant-strict W8A5")) == 1
    assert report.count("*") == 4 + 2  # the four cells and the two notes


def capped_sweep(root, steps=2000):
    """Two points of two seeds each whose runs train.max_steps=50 stopped at update 50 (their last validation) of a
    `steps`-update schedule (the recipe eval_best.json records; config.yaml's max_steps): ended alike, not refused."""
    root.mkdir()
    for name, ppl in (("baseline_s0", 4.0), ("baseline_s1", 4.2), ("cd10x_s0", 4.1), ("cd10x_s1", 4.3)):
        write_run(root, name, ppl=ppl, rtn=ppl + 1, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
        result = root / name / "eval_best.json"
        result.write_text(json.dumps({**json.loads(result.read_text()), "recipe": {"sched.steps": steps}}))
        (root / name / "config.yaml").write_text("train:\n  max_steps: 50\n")
    return root


def test_points_whose_runs_max_steps_stopped_short_of_their_schedule_are_marked(tmp_path):
    """The defect: runs that all stopped at train.max_steps=50 of their 2,000-update schedule (2.5 %) were reported
    as finished runs, with no mark (paper_table.py marks such a row §). Each point is marked § in the tables of its
    evaluated numbers, a note saying how far its runs got; runs that reached their schedule's end are not."""
    report = lm_study.main([str(capped_sweep(tmp_path / "capped")), "--out", str(tmp_path / "o")])
    first = [line for line in report.split("\n\nFinal pair energy")[0].splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in first[1:]] == ["| baseline§", "| cd10x§"], first
    for point in ("baseline", "cd10x"):
        assert (f"§ {point}: stopped before the end of its schedule: validated last at update 50 of the 2000 of its "
                f"schedule (sched.steps=2000), where its train.max_steps stopped it, at 2.5 % of its schedule's "
                f"updates (under 99 %)") in report
    finished = lm_study.main([str(capped_sweep(tmp_path / "finished", steps=50)), "--out", str(tmp_path / "f")])
    assert "§" not in finished


@pytest.mark.parametrize("foreign", ["lm_study.md", "lm_study_energy.png", "lm_study_outliers.png"])
def test_overwrite_replaces_only_the_files_lm_study_wrote(sweep, tmp_path, foreign):
    """--overwrite replaced any lm_study.md or lm_study_*.png in --out, another's file of that name included. It
    replaces only its own (a PNG by its text entry Source, the report by the header of its table) and refuses any
    other with one error naming the file, leaving every file as it was."""
    from engine.run_dir import RunDirError

    argv = [str(sweep), "--out", str(tmp_path)]
    other = b"\x89PNG\r\n\x1a\nsomeone's figure" if foreign.endswith(".png") else "| Point | notes |\n".encode()
    check_overwrite_keeps_others_files(lambda extra: lm_study.main(argv + extra), tmp_path, foreign, other,
                                       RunDirError, f"{tmp_path / foreign} is not a file lm_study.py wrote")
