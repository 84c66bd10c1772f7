"""scripts/dose_report.py: the dose-response report's numbers against values computed by hand from run
folders written here (metrics.jsonl, eval_best.json, the activation-max CSV, best.pt of a tiny ViT), and
its command line (outputs refused when present, one-line errors)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from engine.checkpoint import weights_fingerprint
from tests.conftest import ROOT, check_overwrite_keeps_others_files, run_entry
from tests.test_mechanism import make_checkpoint

import dose_report
import mechanism

SCRIPT = os.path.join(ROOT, "scripts", "dose_report.py")


def write_run(root, name, *, fp, w4, fc2_curve, norm1_max, seed):
    """A finished, evaluated run folder; every other figure is fixed so that only these differ."""
    folder = root / name
    folder.mkdir()
    with open(folder / "metrics.jsonl", "w") as f:
        for k, e in enumerate(fc2_curve):
            f.write(json.dumps({"step": 10 * (k + 1), "train/loss": 1.0, "cd/pair_energy/qkv": 8.0,
                                "cd/pair_energy/proj": 4.0, "cd/pair_energy/fc1": 6.0,
                                "cd/pair_energy/fc2": e}) + "\n")
            f.write(json.dumps({"step": 10 * (k + 1), "val/top1": 50.0}) + "\n")  # no energies: skipped
    quant = {p: {"w4a4": {"top1": w4}, "w3a3": {"top1": w4 - 20}} for p in ("percentile", "repq")}
    make_checkpoint(folder / "best.pt", seed)
    # as evaluate.py records the weights it scored: the fingerprint of the checkpoint's state dict
    fingerprint = weights_fingerprint(torch.load(folder / "best.pt")["model"])
    with open(folder / "eval_best.json", "w") as f:
        json.dump({"fp": {"top1": fp}, "max_act": {"module": 10.0 * norm1_max, "block": 5.0},
                   "quant": quant, "weights": "raw", "fingerprint": fingerprint}, f)
    with open(folder / "eval_best_act_max.csv", "w") as f:
        f.write("name,kind,block,type,max\n")
        f.write(f"blocks.0.norm1,module,0,norm1,{norm1_max}\n")
        f.write(f"blocks.1.norm1,module,1,norm1,{norm1_max / 2}\n")
        f.write("blocks.1,block,1,block,5.0\n")
        f.write("patch_embed,module,-1,patch_embed,999.0\n")  # outside the blocks: not a module type
    return folder


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    write_run(root, "baseline_s0", fp=80.0, w4=60.0, fc2_curve=[100.0, 100.0], norm1_max=4.0, seed=0)
    write_run(root, "baseline_s1", fp=84.0, w4=64.0, fc2_curve=[100.0, 120.0], norm1_max=6.0, seed=1)
    write_run(root, "cd100x_s0", fp=70.0, w4=66.0, fc2_curve=[90.0, 55.0], norm1_max=2.0, seed=2)
    write_run(root, "tweo_s0", fp=79.0, w4=50.0, fc2_curve=[100.0, 110.0], norm1_max=3.0, seed=3)
    write_run(root, "cd10x_s0", fp=81.0, w4=61.0, fc2_curve=[100.0, 99.0], norm1_max=4.0, seed=4)
    (root / "cd1x_s0").mkdir()          # still training: no eval_best.json, left out
    (root / "notes").mkdir()            # not <point>_s<seed>: ignored
    return root


def test_points_in_dose_order_with_seeds_averaged(sweep, capsys):
    groups = dose_report.by_point(dose_report.read_sweep(str(sweep)))
    assert list(groups) == ["baseline", "cd10x", "cd100x", "tweo"]
    assert [r.seed for r in groups["baseline"]] == [0, 1]
    # the run still training is left out, and said to be: only the seeds column would show it
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and warnings[0].endswith(
        "are left out of the report: cd1x_s0 (evaluate them with the sweep's --run --evaluate to include them)")


def test_doses_and_seeds_are_ordered_as_numbers_not_as_text(tmp_path):
    """cd2x is a lower dose than cd10x, and seed 2 comes before seed 10 in a point's row ("10" < "2" as text);
    a fractional dose (cd0.5x) sorts by its strength too."""
    for name, seed in (("baseline_s10", 0), ("baseline_s2", 1), ("cd10x_s0", 2), ("cd2x_s0", 3), ("cd0.5x_s0", 4),
                       ("tweo_s0", 5)):
        write_run(tmp_path, name, fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=seed)
    groups = dose_report.by_point(dose_report.read_sweep(str(tmp_path)))
    assert list(groups) == ["baseline", "cd0.5x", "cd2x", "cd10x", "tweo"]
    assert [r.seed for r in groups["baseline"]] == [2, 10]


def test_report_figures_match_hand_computed_values(sweep, tmp_path):
    report = dose_report.main([str(sweep), "--out", str(tmp_path / "o")])
    first_table = report.split("Pair energy")[0]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in first_table.splitlines() if line.startswith("| ")}
    # FP 80 and 84: mean 82, sample std sqrt(8) = 2.83; W4A4 60 and 64: 62 ± 2.83; W3A3 = W4A4 - 20
    assert "| baseline | 0,1 | 82.00 ± 2.83 | 50.00 ± 14.14 | 5.00 ± 0.00 | 62.00 ± 2.83 | 62.00 ± 2.83 | " \
           "42.00 ± 2.83 | 42.00 ± 2.83 |" in report
    assert rows["cd100x"].startswith("| cd100x | 0 | 70.00 | 20.00 |")
    # last fc2 energy: baseline (100 + 120) / 2 = 110, cd100x 55 -> -50 %; cd10x 99 -> -10 %
    energy_lines = report.split("Pair energy")[1].split("Largest")[0]
    assert "| baseline | 8.0 ± 0.0 | 4.0 ± 0.0 | 6.0 ± 0.0 | 110.0 ± 14.1 |" in energy_lines
    assert "55.0 (-50.0 %)" in energy_lines and "99.0 (-10.0 %)" in energy_lines
    assert "8.0 (+0.0 %)" in energy_lines
    # norm1: the max over blocks (4 and 6 -> mean 5.0); patch_embed (block -1) is not a module type
    types = report.split("Largest")[1].split("FC1-FC2")[0]
    assert "| baseline | 5.0 | - |" in types and "| cd100x | 2.0 | - |" in types and "999" not in types
    for name in dose_report.OUTPUTS:
        assert os.path.getsize(tmp_path / "o" / name) > 0
    # each seed's alignment peak is of its own best.pt (s0 and s1 hold other weights): the largest alpha over the
    # blocks, computed here from each checkpoint directly
    line = next(line for line in report.splitlines() if line.startswith("- baseline: "))
    parts = line[len("- baseline: "):].split("; ")
    for seed, part in zip((0, 1), parts):
        model = dose_report.model_of(str(sweep / f"baseline_s{seed}" / "best.pt"))
        alpha, block = max((float(mechanism.alignment(b.mlp.fc1.weight, b.mlp.fc2.weight)[0].max()), name)
                           for name, b in mechanism.ffn_blocks(model))
        assert part.startswith(f"s{seed} {block} i=") and part.endswith(f" alpha {alpha:.3f}")
    assert len(parts) == 2 and parts[0].split(" alpha ")[1] != parts[1].split(" alpha ")[1]
    # runs without model.pretrained started from a random initialisation: no backbone peak to report
    assert "- pretrained backbone (start): n/a (the runs start from a random initialisation)" in report


def test_alignment_peak_is_the_largest_alpha_of_the_model(sweep):
    model = dose_report.model_of(str(sweep / "cd100x_s0" / "best.pt"))
    peak = dose_report.alignment_peak(model)
    direct = max((float(mechanism.alignment(b.mlp.fc1.weight, b.mlp.fc2.weight)[0].max()), name)
                 for name, b in mechanism.ffn_blocks(model))
    assert peak["alpha"] == pytest.approx(direct[0]) and peak["block"] == direct[1]


def refusal(argv, capsys) -> str:
    """The `error:` line of scripts/dose_report.py's refusal of argv: its __main__ run in this process (one start of
    torch less; as a process: test_a_deleted_best_pt_is_one_error_line), checked to be one line, all it writes."""
    code, out, err = run_entry("scripts/dose_report.py", argv, capsys)
    # sys.exit("error: ...") of a process prints that line to stderr and exits 1
    assert isinstance(code, str) and code.startswith("error: ") and "\n" not in code and not out and not err
    return code


def test_existing_outputs_are_refused_and_errors_are_one_line(sweep, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "dose_report.md").write_text("mine")
    assert "--overwrite" in refusal([str(sweep), "--out", str(out)], capsys)
    assert (out / "dose_report.md").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no evaluated run" in refusal([str(empty), "--out", str(out / "x")], capsys)


def test_a_copied_run_folder_is_refused_not_counted_as_another_seed(tmp_path):
    for name, seed in (("baseline_s0", 0), ("baseline_s1", 1), ("cd10x_s0", 2)):
        write_run(tmp_path, name, fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=seed)
    for name, fingerprint in (("baseline_s0", "aa"), ("baseline_s1", "bb"), ("cd10x_s0", "aa")):
        path = tmp_path / name / "eval_best.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "fingerprint": fingerprint}))
    with pytest.raises(dose_report.ReportError, match=r"baseline_s0 and .*cd10x_s0 were evaluated on the same "
                                                      r"weights \(fingerprint aa\)"):
        dose_report.read_sweep(str(tmp_path))


def test_two_folders_naming_one_seed_of_a_point_are_refused(tmp_path):
    for name, seed in (("baseline_s1", 0), ("baseline_s01", 1), ("cd10x_s1", 2)):
        write_run(tmp_path, name, fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=seed)
    with pytest.raises(dose_report.ReportError, match=r"baseline_s01 and .*baseline_s1 both name seed 1 of point "
                                                      r"baseline; give each run"):
        dose_report.read_sweep(str(tmp_path))


@pytest.mark.parametrize("field, other", [
    ("eval_amp", "bf16"),                                                     # one seed under autocast
    ("settings", {"calibration": {"images": 8}}),                             # one calibration set of 8
    ("model", "vit_small_patch16_224"),                                       # a run of another model
])
def test_runs_evaluated_differently_are_refused_not_averaged(tmp_path, field, other):
    for name, seed in (("baseline_s0", 0), ("baseline_s1", 1), ("cd10x_s0", 2)):
        write_run(tmp_path, name, fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=seed)
    for name in ("baseline_s0", "baseline_s1", "cd10x_s0"):
        path = tmp_path / name / "eval_best.json"
        result = {**json.loads(path.read_text()), "eval_amp": "none", "model": "vit_nano"}
        result["quant"]["repq"]["w4a4"]["settings"] = {"calibration": {"images": 32}}
        if name == "baseline_s1" and field in ("eval_amp", "model"):
            result[field] = other
        elif name == "baseline_s1":
            result["quant"]["repq"]["w4a4"]["settings"] = other
        path.write_text(json.dumps(result))
    what = field if field in ("eval_amp", "model") else "repq w4a4 settings"
    with pytest.raises(dose_report.ReportError, match=rf"baseline_s0 and .*baseline_s1 were evaluated differently "
                                                      rf"\({what}: "):
        dose_report.read_sweep(str(tmp_path))


def test_a_partial_last_metrics_line_is_left_out_and_a_damaged_one_named(tmp_path):
    """A run killed mid-write (or still training) ends metrics.jsonl in a partial record: left out, as train.py
    drops it on resume (was a JSONDecodeError traceback); a bad line before the last is named."""
    for name, seed in (("baseline_s0", 0), ("cd10x_s0", 1)):
        write_run(tmp_path, name, fp=80.0, w4=60.0, fc2_curve=[100.0, 90.0], norm1_max=4.0, seed=seed)
    metrics = tmp_path / "cd10x_s0" / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 30, "cd/pair_en')
    runs = {r.point: r for r in dose_report.read_sweep(str(tmp_path))}
    assert runs["cd10x"].energies["fc2"] == [(10, 100.0), (20, 90.0)]
    metrics.write_text('{"step": 1\n' + metrics.read_text())
    with pytest.raises(dose_report.ResultsError, match=r"metrics.jsonl, line 1: not a JSON record"):
        dose_report.read_sweep(str(tmp_path))


@pytest.mark.slow
def test_a_deleted_best_pt_is_one_error_line(tmp_path):
    """best.pt removed after the evaluation (to save space): the alignment peak cannot be read, said in one
    `error:` line (was a CheckpointError traceback), and nothing is written."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    write_run(sweep, "baseline_s0", fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=0)
    os.remove(sweep / "baseline_s0" / "best.pt")
    run = subprocess.run([sys.executable, SCRIPT, str(sweep), "--out", str(tmp_path / "o")], capture_output=True,
                         text=True, cwd=ROOT)
    assert run.returncode == 1 and run.stderr.startswith("error: checkpoint not found: ")
    assert len(run.stderr.splitlines()) == 1 and not (tmp_path / "o").exists()


def test_seeds_of_a_point_trained_with_other_settings_are_refused_not_averaged(tmp_path):
    """The seeds of a point must share every training setting but the seed (the recipe evaluate.py records);
    points differ (CD's strength) by design."""
    recipes = {"baseline_s0": {"optim.lr": 3e-4, "cd.lam": 0.0}, "baseline_s1": {"optim.lr": 3e-4, "cd.lam": 0.0},
               "cd10x_s0": {"optim.lr": 3e-4, "cd.lam": 0.1}, "cd10x_s1": {"optim.lr": 3e-4, "cd.lam": 0.1}}
    for seed, (name, recipe) in enumerate(recipes.items()):
        write_run(tmp_path, name, fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=seed)
        path = tmp_path / name / "eval_best.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "recipe": recipe}))
    assert len(dose_report.read_sweep(str(tmp_path))) == 4
    path = tmp_path / "cd10x_s1" / "eval_best.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "recipe": {"optim.lr": 1e-3, "cd.lam": 0.1}}))
    with pytest.raises(dose_report.ReportError, match=r"cd10x_s0 and .*cd10x_s1 are seeds of point cd10x but were "
                                                      r"trained with other settings \(optim.lr 0.0003 -> 0.001\)"):
        dose_report.read_sweep(str(tmp_path))


def test_a_point_evaluated_with_other_model_kwargs_than_trained_is_marked_and_its_seeds_must_be_alike(tmp_path):
    """A sweep whose 'evaluate' list overrides model.kwargs (gelu=tanh on runs trained with the exact GELU) scores
    the same weights through another forward: the point's row in the tables of evaluated numbers is marked †,
    with a note naming both settings, as evaluate.py's table marks it; training numbers (pair energies) are not.
    Seeds of one point evaluated with other model.kwargs are not averaged (paper_table.py --over-seeds refuses them)."""
    tanh = {"gelu": "tanh"}
    evaluated = {"baseline_s0": {}, "baseline_s1": {}, "cd10x_s0": tanh, "cd10x_s1": tanh}
    for seed, (name, kwargs) in enumerate(evaluated.items()):
        write_run(tmp_path, name, fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=seed)
        path = tmp_path / name / "eval_best.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "model_kwargs": kwargs,
                                    "recipe": {"model.kwargs": {}}, "train_seed": int(name[-1])}))
    report = dose_report.main([str(tmp_path), "--out", str(tmp_path / "o")])
    first, energies = report.split("Pair energy")[0], report.split("Pair energy")[1].split("Largest")[0]
    types = report.split("Largest")[1].split("FC1-FC2")[0]
    assert "| baseline | 0,1 |" in first and "| cd10x† | 0,1 |" in first
    assert first.strip().splitlines()[-1] == '† cd10x: evaluated with model.kwargs={"gelu": "tanh"} (trained with {})'
    assert "| cd10x | " in energies and "| baseline | 4.0 | - |" in types and "| cd10x† | 4.0 | - |" in types
    path = tmp_path / "cd10x_s1" / "eval_best.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "model_kwargs": {}}))
    with pytest.raises(dose_report.ReportError, match=r'cd10x_s0 and .*cd10x_s1 were evaluated with other '
                                                      r'model.kwargs \(model.kwargs={"gelu": "tanh"} \(trained with '
                                                      r'{}\) vs as trained\); the seeds of point cd10x are averaged'):
        dose_report.read_sweep(str(tmp_path))


def test_an_evaluation_of_an_earlier_best_pt_is_refused(tmp_path):
    """A run resumed after its evaluation saved a new best.pt: its eval_best.json scored other weights, and the
    report put that accuracy beside the new weights' alignment peak (no check: only a missing or unreadable
    best.pt was an error). Refused before anything is written, naming the command that re-evaluates it."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for name, seed in (("baseline_s0", 0), ("cd10x_s0", 1)):
        write_run(sweep, name, fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=seed)
    make_checkpoint(sweep / "cd10x_s0" / "best.pt", 7)  # the resumed run's new best
    with pytest.raises(dose_report.ReportError, match=r"cd10x_s0/eval_best.json scored other weights than "
                                                      r".*cd10x_s0/best.pt holds now .* run python evaluate.py "
                                                      r"--checkpoint .*cd10x_s0/best.pt --out "):
        dose_report.main([str(sweep), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_a_copied_sweep_whose_best_pt_changed_is_refused_though_the_recorded_checkpoint_is_unchanged(tmp_path):
    """An eval_best.json records the checkpoint it scored: in a copy of a sweep, the original run's best.pt. The
    report reads the copy's best.pt, the one beside the file; when that one saved a new best after the copy, the
    file is refused as stale on reading (engine.eval_results.refuse_stale), as in the original sweep."""
    original = tmp_path / "a"
    original.mkdir()
    write_run(original, "baseline_s0", fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=0)
    path = original / "baseline_s0" / "eval_best.json"
    recorded = str(original / "baseline_s0" / "best.pt")  # as evaluate.py records it: an absolute path
    path.write_text(json.dumps({**json.loads(path.read_text()), "checkpoint": recorded}))
    copy = tmp_path / "b"
    shutil.copytree(original, copy)
    dose_report.read_sweep(str(copy))  # the copy as it was: of the weights its best.pt holds
    make_checkpoint(copy / "baseline_s0" / "best.pt", 7)  # the copy's run trained on and saved a new best
    with pytest.raises(dose_report.ResultsError, match=r"b/baseline_s0/eval_best.json is stale: it scored other "
                                                       r"weights than .*b/baseline_s0/best.pt holds now"):
        dose_report.read_sweep(str(copy))
    dose_report.read_sweep(str(original))  # the original is unchanged


def test_the_alignment_peak_is_of_the_weights_the_evaluation_scored(tmp_path):
    """An evaluation of the EMA weights (evaluate.py --ema) is matched with best.pt's EMA weights, whose
    alignment peak is reported; the raw weights are other weights."""
    write_run(tmp_path, "baseline_s0", fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=0)
    checkpoint = tmp_path / "baseline_s0" / "best.pt"
    ema = torch.load(make_checkpoint(tmp_path / "ema.pt", 5))["model"]
    torch.save({**torch.load(checkpoint), "model_ema": ema}, checkpoint)
    path = tmp_path / "baseline_s0" / "eval_best.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "weights": "ema",
                                "fingerprint": weights_fingerprint(ema)}))
    model = dose_report.evaluated_model(dose_report.read_sweep(str(tmp_path))[0])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ema.items())
    path.write_text(json.dumps({**json.loads(path.read_text()), "weights": "raw"}))
    with pytest.raises(dose_report.ReportError, match="scored other weights"):
        dose_report.evaluated_model(dose_report.read_sweep(str(tmp_path))[0])
    # a file of an older evaluate.py, without a fingerprint: refused as such, not as a best.pt saved after it
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "fingerprint"}))
    with pytest.raises(dose_report.ReportError, match=r"baseline_s0/eval_best.json records no weights fingerprint "
                                                      r"\(an older evaluate.py wrote it\): whether it scored .* is "
                                                      r"unknown; re-evaluate it"):
        dose_report.evaluated_model(dose_report.read_sweep(str(tmp_path))[0])


def test_an_evaluation_of_ema_weights_best_pt_no_longer_holds_is_refused_in_the_reports_words(tmp_path):
    """best.pt saved again by a run without EMA after its EMA weights were evaluated: refused as a stale
    evaluation (re-evaluate it), not with evaluate.py's advice to drop an --ema flag nobody gave."""
    write_run(tmp_path, "baseline_s0", fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=0)
    path = tmp_path / "baseline_s0" / "eval_best.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "weights": "ema"}))
    with pytest.raises(dose_report.ReportError) as refused:
        dose_report.evaluated_model(dose_report.read_sweep(str(tmp_path))[0])
    assert "baseline_s0/eval_best.json scored EMA weights, but" in str(refused.value)
    assert "re-evaluate it" in str(refused.value) and "--ema" not in str(refused.value)


@pytest.mark.parametrize("edit, path", [(lambda r: r["max_act"].pop("block"), "max_act.block"),
                                        (lambda r: r["quant"]["repq"]["w3a3"].pop("top1"), "quant.repq.w3a3.top1")])
def test_a_result_without_a_number_the_report_reads_is_named(tmp_path, edit, path):
    """A cut eval_best.json is one error naming the file and the missing number (was a KeyError traceback)."""
    write_run(tmp_path, "baseline_s0", fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=0)
    result = json.loads((tmp_path / "baseline_s0" / "eval_best.json").read_text())
    edit(result)
    (tmp_path / "baseline_s0" / "eval_best.json").write_text(json.dumps(result))
    with pytest.raises(dose_report.ReportError, match=rf"baseline_s0/eval_best.json has no number at {path}: "):
        dose_report.main([str(tmp_path), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_module_maxima_over_extra_modules_are_marked_in_the_table(tmp_path):
    """Runs whose module maximum also counts modules outside the blocks (quant.act_max_extra_modules) all alike:
    not the paper's maximum, so its cell is marked ‡ with a note naming the patterns, as evaluate.py's table marks
    it (was unmarked: only a mix of such runs was refused); the block maximum and the point label are not."""
    for name, seed in (("baseline_s0", 0), ("cd10x_s0", 1)):
        write_run(tmp_path, name, fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=seed)
        path = tmp_path / name / "eval_best.json"
        result = json.loads(path.read_text())
        result["max_act"]["extra_modules"] = ["patch_embed.proj"]
        path.write_text(json.dumps(result))
    groups = dose_report.by_point(dose_report.read_sweep(str(tmp_path)))
    peak = {"block": "blocks.0", "direction": 0, "row": 0, "alpha": 1.0}
    first = dose_report.tables(groups, {p: [peak] * len(rs) for p, rs in groups.items()}, None) \
        .split("Pair energy")[0]
    # module maximum 10 * norm1_max = 40.00 (write_run), block 5.00
    assert "| baseline | 0 | 80.00 | 40.00‡ | 5.00 |" in first and "| cd10x | 0 | 80.00 | 40.00‡ | 5.00 |" in first
    note = '‡ {}: the module maximum also counts modules outside the blocks: ' \
           'quant.act_max_extra_modules=["patch_embed.proj"]'
    assert first.strip().splitlines()[-2:] == [note.format("baseline"), note.format("cd10x")]
    for name in ("baseline_s0", "cd10x_s0"):  # the paper's set (none recorded): no mark, no note
        path = tmp_path / name / "eval_best.json"
        result = json.loads(path.read_text())
        del result["max_act"]["extra_modules"]
        path.write_text(json.dumps(result))
    groups = dose_report.by_point(dose_report.read_sweep(str(tmp_path)))
    report = dose_report.tables(groups, {p: [peak] * len(rs) for p, rs in groups.items()}, None)
    assert "‡" not in report and "| baseline | 0 | 80.00 | 40.00 | 5.00 |" in report


def test_each_quantized_number_is_in_the_column_that_names_its_pipeline_and_bits(tmp_path):
    """Percentile and RepQ-ViT at W4A4 and W3A3 with four different numbers: each sits under the header naming
    it (write_run gives both pipelines one number, which cannot tell the columns apart)."""
    write_run(tmp_path, "baseline_s0", fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=0)
    path = tmp_path / "baseline_s0" / "eval_best.json"
    result = json.loads(path.read_text())
    numbers = {("Percentile", "W4A4"): 61.0, ("RepQ-ViT", "W4A4"): 72.0, ("Percentile", "W3A3"): 13.0,
               ("RepQ-ViT", "W3A3"): 24.0}
    result["quant"] = {p: {b: {"top1": numbers[(name, b.upper())]} for b in ("w4a4", "w3a3")}
                       for p, name in (("percentile", "Percentile"), ("repq", "RepQ-ViT"))}
    path.write_text(json.dumps(result))
    groups = dose_report.by_point(dose_report.read_sweep(str(tmp_path)))
    peak = {"block": "blocks.0", "direction": 0, "row": 0, "alpha": 1.0}
    head, _, row = dose_report.tables(groups, {"baseline": [peak]}, None).splitlines()[:3]
    cells = dict(zip([c.strip() for c in head.strip("|").split("|")], [c.strip() for c in row.strip("|").split("|")]))
    assert {k: cells.pop(f"{k[0]} {k[1]}") for k in numbers} == {k: f"{v:.2f}" for k, v in numbers.items()}
    assert cells == {"Point": "baseline", "Seeds": "0", "FP Top-1": "80.00", "Max. Act. mod.": "40.00",
                     "Max. Act. blk.": "5.00"}


def drop_entry(folder, pipeline, bits):
    """The run's eval_best.json without one quantized entry, as evaluate.py leaves it when stopped before it."""
    path = folder / "eval_best.json"
    result = json.loads(path.read_text())
    del result["quant"][pipeline][bits]
    path.write_text(json.dumps(result))


def test_a_run_whose_evaluation_was_cut_short_is_left_out_and_named_with_what_it_lacks(tmp_path, capsys):
    """A seed evaluated without RepQ-ViT W3A3 (a sweep stopped during its evaluation: evaluate.py keeps the entries
    it finished) has no number for that column: left out of the report as a run not yet evaluated is, and the
    warning names it, what it lacks and how to finish it (without the check: a KeyError in the table, after the
    figures were written)."""
    write_run(tmp_path, "baseline_s0", fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=0)
    drop_entry(write_run(tmp_path, "baseline_s1", fp=90.0, w4=70.0, fc2_curve=[100.0], norm1_max=4.0, seed=1),
               "repq", "w3a3")
    report = dose_report.main([str(tmp_path), "--out", str(tmp_path / "o")])
    row = next(line for line in report.splitlines() if line.startswith("| baseline |"))
    assert row.startswith("| baseline | 0 | 80.00 |")  # seed 1's 90.00 would make it 85.00 ± 7.07 over "0,1"
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")] == [
        "warning: left out of the report, not evaluated at every column of the table: baseline_s1 lacks repq w3a3; "
        "finish their evaluation with the sweep's --run --evaluate (it continues one that was cut short), or python "
        "evaluate.py --checkpoint RUN/best.pt --quant percentile repq --bits w3a3 w4a4"]


def test_no_run_evaluated_at_every_column_is_refused_before_anything_is_written(tmp_path):
    for name, seed in (("baseline_s0", 0), ("cd10x_s0", 1)):
        drop_entry(write_run(tmp_path, name, fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=seed),
                   "percentile", "w4a4" if seed else "w3a3")
    with pytest.raises(dose_report.ReportError, match=r"no run is evaluated at every column of the table "
                                                      r"\(baseline_s0 lacks percentile w3a3; cd10x_s0 lacks "
                                                      r"percentile w4a4\): finish their evaluation"):
        dose_report.main([str(tmp_path), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_a_damaged_line_just_before_the_last_is_named_not_left_out(tmp_path):
    """Only the last line of metrics.jsonl may be a partial record (one being written); a bad line before it, even
    the one just before, is damage and named."""
    folder = tmp_path / "baseline_s0"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 10, "train/loss": 1.0}\n{"step": 20, "tra\n{"step": 30}\n')
    with pytest.raises(dose_report.ResultsError, match=r"metrics.jsonl, line 2: not a JSON record"):
        dose_report.metrics_records(str(folder))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", float("-inf")])
def test_a_non_finite_logged_number_is_named_as_a_divergence(value):
    """train.py writes a non-finite number as 'nan', 'inf' or '-inf': each one is the run diverging there."""
    with pytest.raises(dose_report.ReportError, match=r"val/loss at update 5 is .*: the run diverged there"):
        dose_report.metric_number({"step": 5, "val/loss": value}, "val/loss", "run")


def test_a_setting_one_point_records_and_the_reference_lacks_is_shown():
    """point_settings compares every key of either recipe: a setting only the CD point records (null in the
    baseline's) is a difference, as one both record with other values is."""
    def run(point, recipe):
        return dose_report.Run(point, 0, point, {}, {"recipe": recipe}, [])
    groups = {"baseline": [run("baseline", {"optim.lr": 0.001})],
              "cd10x": [run("cd10x", {"optim.lr": 0.002, "cd.lam": 0.05})]}
    assert dose_report.point_settings(groups)[-2:] == ["- baseline: the reference",
                                                       "- cd10x: cd.lam null -> 0.05; optim.lr 0.001 -> 0.002"]


def test_a_logged_true_is_not_the_number_one():
    """JSON true where train.py logs a number is no number (Python's bool is an int: it read as 1.0)."""
    with pytest.raises(dose_report.ReportError, match=r"cd/pair_energy/fc2 at update 5 is True, not a number"):
        dose_report.metric_number({"step": 5, "cd/pair_energy/fc2": True}, "cd/pair_energy/fc2", "run")


def _act_row(block, typ, value, name=None):
    """A row of eval_best_act_max.csv as read_act_max returns it (strings, as csv.DictReader gives them)."""
    return {"name": name or f"blocks.{block}.{typ}", "kind": "block" if typ == "block" else "module",
            "block": str(block), "type": typ, "max": str(value)}


def test_a_module_outside_the_blocks_is_no_module_type_even_when_it_shares_a_types_name():
    """type_maxima is over the blocks: a row at block -1 (quant.act_max_extra_modules) whose type reads like a
    block's sub-module (a top-level module named norm1) stays out of norm1's maximum. By hand: norm1 over the
    blocks is max(3, 7) = 7, not the 50 outside them."""
    run = dose_report.Run("baseline", 0, "run", {}, {}, [
        _act_row(0, "norm1", 3.0), _act_row(1, "norm1", 7.0), _act_row(1, "block", 9.0),
        _act_row(-1, "norm1", 50.0, name="norm1")])
    assert dose_report.type_maxima(run) == {"norm1": 7.0, "block": 9.0}


def test_a_type_some_seeds_lack_is_a_dash_not_a_mean_over_the_others():
    """The per-type table averages a type over a point's seeds only when every seed has it: mlp.fc2 in one
    seed of two is '-', norm1 in both is their mean by hand, (4 + 6) / 2 = 5.0."""
    result = {"fp": {"top1": 80.0}, "max_act": {"module": 10.0, "block": 5.0},
              "quant": {p: {b: {"top1": 60.0} for b in ("w4a4", "w3a3")} for p in ("percentile", "repq")}}
    energies = {role: [(10, 1.0)] for role in dose_report.ROLES}
    runs = [dose_report.Run("baseline", 0, "s0", energies, result, [_act_row(0, "norm1", 4.0),
                                                                     _act_row(0, "mlp.fc2", 8.0)]),
            dose_report.Run("baseline", 1, "s1", energies, result, [_act_row(0, "norm1", 6.0)])]
    peak = {"block": "blocks.0", "direction": 0, "row": 0, "alpha": 1.0}
    types = dose_report.tables({"baseline": runs}, {"baseline": [peak, peak]}, None) \
        .split("Largest max |activation| per module type")[1].split("FC1-FC2")[0]
    row = [line for line in types.splitlines() if line.startswith("| baseline |")][0]
    cells = dict(zip(dose_report.TYPE_ORDER, [c.strip() for c in row.strip("|").split("|")][1:]))
    assert cells["norm1"] == "5.0" and cells["mlp.fc2"] == "-" and cells["block"] == "-"


def test_the_energy_change_is_of_a_points_seed_mean_against_the_baselines():
    """A point's change against the baseline compares the means over seeds: fc2 baseline (100 + 120) / 2 = 110,
    cd10x (44 + 66) / 2 = 55, so -50.0 % by hand (its first seed alone would read -60.0 %)."""
    result = {"fp": {"top1": 80.0}, "max_act": {"module": 10.0, "block": 5.0},
              "quant": {p: {b: {"top1": 60.0} for b in ("w4a4", "w3a3")} for p in ("percentile", "repq")}}

    def run(point, seed, fc2):
        energies = {role: [(10, 1.0)] for role in dose_report.ROLES}
        energies["fc2"] = [(10, 500.0), (20, fc2)]  # the last update's energy counts
        return dose_report.Run(point, seed, f"{point}_s{seed}", energies, result, [_act_row(0, "norm1", 4.0)])
    groups = {"baseline": [run("baseline", 0, 100.0), run("baseline", 1, 120.0)],
              "cd10x": [run("cd10x", 0, 44.0), run("cd10x", 1, 66.0)]}
    peak = {"block": "blocks.0", "direction": 0, "row": 0, "alpha": 1.0}
    energy = dose_report.tables(groups, {p: [peak, peak] for p in groups}, None) \
        .split("Pair energy")[1].split("Largest")[0]
    assert "| cd10x | 1.0 ± 0.0 (+0.0 %) | 1.0 ± 0.0 (+0.0 %) | 1.0 ± 0.0 (+0.0 %) | 55.0 ± 15.6 (-50.0 %) |" \
        in energy


def test_a_run_stopped_before_the_end_of_its_epochs_is_refused_not_averaged(tmp_path):
    """A seed stopped at train.max_steps (an environment key, not in the recipe) under an epoch schedule was
    averaged with the finished seeds of its point. The run's metrics.jsonl tells how far it got: its last validation
    against sched.epochs x the updates of an epoch (update 10 at 0.5 epochs: 20). Refused before anything is
    written, naming the folder, how far it got and the fix."""
    for name, seed in (("baseline_s0", 0), ("baseline_s1", 1), ("cd10x_s0", 2)):
        folder = write_run(tmp_path, name, fp=80.0, w4=60.0, fc2_curve=[100.0, 90.0], norm1_max=4.0, seed=seed)
        metrics = folder / "metrics.jsonl"
        metrics.write_text(metrics.read_text().replace('"train/loss": 1.0', '"train/loss": 1.0, "train/epoch": 0.5', 1))
        result = json.loads((folder / "eval_best.json").read_text())
        (folder / "eval_best.json").write_text(json.dumps({**result, "recipe": {"sched.epochs": 1,
                                                                                "sched.steps": None}}))
    assert "| baseline | 0,1 |" in dose_report.main([str(tmp_path), "--out", str(tmp_path / "o")])
    metrics = tmp_path / "baseline_s1" / "metrics.jsonl"  # stopped at update 10, validated there
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:2]))
    with pytest.raises(dose_report.ResultsError) as refused:
        dose_report.main([str(tmp_path), "--out", str(tmp_path / "o2")])
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'baseline_s1'} validated last at update 10 of the 20 of its schedule "
                              "(sched.epochs=1 of 20 updates): an unfinished run"), message
    assert message.endswith("or move its folder out of the sweep root"), message
    assert not (tmp_path / "o2").exists()


def test_quantized_numbers_of_other_settings_than_the_defaults_are_marked_and_named(tmp_path):
    """Runs calibrated on 8 images (quant.calib_images=8): paper_table.py marks such a cell * with a note naming the
    setting, and engine/result_table.py said dose_report.py used the same marks; its table showed the numbers as
    the defaults'. Marked, with one note per pipeline and bits naming the points."""
    for name, seed in (("baseline_s0", 0), ("cd10x_s0", 1)):
        folder = write_run(tmp_path, name, fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=seed)
        result = json.loads((folder / "eval_best.json").read_text())
        result["quant"]["repq"]["w4a4"]["settings"] = {"calibration": {"images": 8, "seed": 0, "split": "train"}}
        (folder / "eval_best.json").write_text(json.dumps(result))
    report = dose_report.main([str(tmp_path), "--out", str(tmp_path / "o")])
    assert "| baseline | 0 | 80.00 | 40.00 | 5.00 | 60.00 | 60.00* | 40.00 | 40.00 |" in report
    assert "| cd10x | 0 | 80.00 | 40.00 | 5.00 | 60.00 | 60.00* | 40.00 | 40.00 |" in report
    assert "\\* baseline, cd10x RepQ-ViT W4A4: not the default settings: quant.calib_images=8" in report.splitlines()


def test_a_pretrained_file_overwritten_since_the_runs_started_is_refused_not_reported_as_their_start(tmp_path):
    """The "pretrained backbone (start)" peak is of the model.pretrained file as it is now; best.pt records the
    weights the run started from (engine/start_weights.py), so a file overwritten since is refused in one line
    naming it, not reported as the start. The record here is made as train.py makes it, from the file directly:
    its tensors less the classifier, which a fine-tune to other classes replaces."""
    from models import build_model
    from configs import load_config
    from tests.conftest import DEMO_CONFIG

    def weights_file(seed):
        torch.manual_seed(seed)
        model = build_model(load_config([DEMO_CONFIG], ["model.name=vit_nano"]).model)
        torch.save(model.state_dict(), tmp_path / "start.pt")
        return weights_fingerprint({k: v for k, v in model.state_dict().items() if not k.startswith("head.")})

    recorded = weights_file(7)
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for seed, name in enumerate(("baseline_s0", "cd10x_s0")):
        folder = write_run(sweep, name, fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=seed)
        payload = torch.load(folder / "best.pt")
        payload["config"]["model"]["pretrained"] = str(tmp_path / "start.pt")
        payload["start_weights"] = {"pretrained": "file", "fingerprint": recorded}
        torch.save(payload, folder / "best.pt")
    report = dose_report.main([str(sweep), "--out", str(tmp_path / "o1")])
    assert "- pretrained backbone (start): blocks." in report
    weights_file(8)  # other weights under the runs' model.pretrained path
    with pytest.raises(dose_report.ReportError) as refused:
        dose_report.main([str(sweep), "--out", str(tmp_path / "o2")])
    message = str(refused.value)
    assert f"model.pretrained={tmp_path / 'start.pt'} is not the weights the run of" in message
    assert recorded in message and "\n" not in message and not (tmp_path / "o2").exists()


def test_points_whose_runs_max_steps_stopped_short_of_their_schedule_are_marked(tmp_path):
    """The defect: runs that all stopped at train.max_steps=20 (validated last there) of their 200-update schedule
    (10 %) ended alike, were not refused, and were reported as finished runs with no mark (paper_table.py marks such
    a row §). Each point is marked § in the tables of its evaluated numbers, a note saying how far its runs got."""
    for name, seed in (("baseline_s0", 0), ("cd10x_s0", 1)):
        folder = write_run(tmp_path, name, fp=80.0, w4=60.0, fc2_curve=[100.0, 90.0], norm1_max=4.0, seed=seed)
        result = json.loads((folder / "eval_best.json").read_text())
        (folder / "eval_best.json").write_text(json.dumps({**result, "recipe": {"sched.steps": 200}}))
        (folder / "config.yaml").write_text("train:\n  max_steps: 20\n")
    report = dose_report.main([str(tmp_path), "--out", str(tmp_path / "o")])
    assert "| baseline§ | 0 | 80.00 | 40.00 | 5.00 | 60.00 | 60.00 | 40.00 | 40.00 |" in report
    assert "| cd10x§ | 0 | 80.00 | 40.00 | 5.00 | 60.00 | 60.00 | 40.00 | 40.00 |" in report
    assert "| baseline§ | 4.0 |" in report.split("Largest max")[1]  # the table of module types' maxima too
    assert ("§ cd10x: stopped before the end of its schedule: validated last at update 20 of the 200 of its schedule "
            "(sched.steps=200), where its train.max_steps stopped it, at 10.0 % of its schedule's updates (under "
            "99 %)") in report.splitlines()


def test_points_started_from_other_weights_each_show_their_start_not_the_first_runs(tmp_path):
    """The "pretrained backbone (start)" peak was of the first run's model.pretrained alone: points fine-tuned from
    other files, or trained from scratch beside fine-tunes, were reported as starting from it (and only the first
    run's file was checked against the start its best.pt records). Each start is shown with the points that started
    from it; its peak is that of the file's weights, loaded here into a model of the tests' own."""
    from models import build_model
    from configs import load_config
    from tests.conftest import DEMO_CONFIG

    def weights_file(seed, name):
        torch.manual_seed(seed)
        model = build_model(load_config([DEMO_CONFIG], ["model.name=vit_nano"]).model)
        torch.save(model.state_dict(), tmp_path / name)
        fingerprint = weights_fingerprint({k: v for k, v in model.state_dict().items() if not k.startswith("head.")})
        return fingerprint, dose_report.describe_peak(dose_report.alignment_peak(model.eval()))

    starts = {"a.pt": weights_file(7, "a.pt"), "b.pt": weights_file(8, "b.pt")}
    assert starts["a.pt"][1] != starts["b.pt"][1]  # the two starts' peaks tell them apart
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for seed, (name, start) in enumerate((("baseline_s0", "a.pt"), ("baseline_s1", "a.pt"), ("cd10x_s0", "b.pt"),
                                          ("scratch_s0", None))):
        folder = write_run(sweep, name, fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=seed)
        if start is not None:
            payload = torch.load(folder / "best.pt")
            payload["config"]["model"]["pretrained"] = str(tmp_path / start)
            payload["start_weights"] = {"pretrained": "file", "fingerprint": starts[start][0]}
            torch.save(payload, folder / "best.pt")
    report = dose_report.main([str(sweep), "--out", str(tmp_path / "o")])
    lines = [line for line in report.splitlines() if line.startswith("- pretrained backbone (start)")]
    assert lines == [f"- pretrained backbone (start) of baseline: {starts['a.pt'][1]}",
                     f"- pretrained backbone (start) of cd10x: {starts['b.pt'][1]}",
                     "- pretrained backbone (start) of scratch: n/a (a random initialisation)"]
    # every run's file is checked against the start its best.pt records, not the first run's only
    weights_file(9, "b.pt")
    with pytest.raises(dose_report.ReportError, match=rf"model.pretrained={tmp_path / 'b.pt'} is not the weights the "
                                                      r"run of .*cd10x_s0.best\.pt started from"):
        dose_report.main([str(sweep), "--out", str(tmp_path / "o2")])


def test_a_maxima_csv_other_than_the_one_its_result_file_records_is_refused(tmp_path):
    """eval_best.json records the size and SHA-256 of the eval_best_act_max.csv evaluate.py wrote; a CSV edited since
    (or another evaluation's put at its name) was read into the per-type maxima table and figure as the run's."""
    import hashlib

    folder = write_run(tmp_path, "baseline_s0", fp=80.0, w4=60.0, fc2_curve=[100.0], norm1_max=4.0, seed=0)
    data = (folder / "eval_best_act_max.csv").read_bytes()
    result = json.loads((folder / "eval_best.json").read_text())
    result["max_act"].update(csv=str(folder / "eval_best_act_max.csv"),
                             digests={"csv": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}})
    (folder / "eval_best.json").write_text(json.dumps(result))
    report = dose_report.main([str(tmp_path), "--out", str(tmp_path / "o1")])
    assert "| baseline | 4.0 | - | - | - | - | - | - | - | - | 5.0 |" in report  # the recorded CSV: read
    (folder / "eval_best_act_max.csv").write_bytes(data.replace(b"norm1,4.0", b"norm1,40.0"))
    with pytest.raises(dose_report.ReportError, match=r"eval_best_act_max.csv is not the CSV that .*eval_best.json "
                                                      r"records .*edited or replaced since.*--out .*eval_best.json$"):
        dose_report.main([str(tmp_path), "--out", str(tmp_path / "o2")])
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize("foreign", ["dose_report.md", "dose_act_max_types.png"])  # figures: one stands for both
def test_overwrite_replaces_only_the_files_dose_report_wrote(sweep, tmp_path, foreign):
    """--overwrite replaced any dose_report.md / dose_energy.png / dose_act_max_types.png in --out: a paper's figure
    or another's notes of that name were lost. It replaces only its own (a PNG by its text entry Source, the report
    by the header of its table) and refuses any other with one error naming the file, leaving every file as it was;
    the reference is the files' bytes before."""
    from engine.run_dir import RunDirError

    out = tmp_path / "o"
    argv = [str(sweep), "--out", str(out)]
    other = b"\x89PNG\r\n\x1a\nsomeone's figure" if foreign.endswith(".png") else "| Point | notes |\n".encode()
    check_overwrite_keeps_others_files(lambda extra: dose_report.main(argv + extra), out, foreign, other, RunDirError,
                                       f"{out / foreign} is not a file dose_report.py wrote")
