"""A seed is averaged once: evaluate.py records the train.seed of the checkpoint's run (`train_seed`), a result file
written before it did takes it from its run's config.yaml, and the readers that average seeds refuse two runs of one
seed (engine/train_seeds.py: engine.result_table.check_seed_group for paper_table.py --over-seeds and
compare_act_max.py, scripts/dose_report.py read_sweep for dose_report.py, lm_study.py and gap_test.py) and a sweep
folder `<point>_s<N>` of a run trained with another seed. A run trained again with a seed already there holds
weights a hair apart (another thread count), which the copy check (its weights' fingerprint) tells apart: it was
averaged and tested as one more independent seed. Tiny real runs of configs/debug/tiny.yaml, trained here."""
import json
import os
import shutil

import pytest
import torch

import evaluate
import gap_test
import paper_table
import train
from configs import load_config
from engine.eval_results import read_result_file
from engine.result_table import check_seed_group
from tests.conftest import DEBUG_CONFIG, run_entry

EVALUATION = ["--quant", "percentile", "--bits", "w4a4"]


def evaluated(out_dir) -> dict:
    """The eval_best.json evaluate.py writes beside the run's best.pt (one quick pipeline)."""
    evaluate.main(evaluate.parse_args(["--checkpoint", os.path.join(out_dir, "best.pt"), *EVALUATION]))
    with open(os.path.join(out_dir, "eval_best.json")) as f:
        return json.load(f)


def nudge(checkpoint) -> None:
    """Move one weight of `checkpoint` by one float step: the same seed trained again under another thread count
    (its weights a hair apart, another fingerprint)."""
    payload = torch.load(checkpoint, weights_only=True)
    name = next(k for k, v in payload["model"].items() if v.is_floating_point())
    flat = payload["model"][name].view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))
    torch.save(payload, checkpoint)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Three evaluated runs: seed 0, seed 1, and seed 0 trained again (weights a hair apart)."""
    root = tmp_path_factory.mktemp("store")
    for name, seed in (("first", 0), ("other", 1), ("again", 0)):
        out_dir = root / name
        train.main(load_config([DEBUG_CONFIG], [f"out_dir={out_dir}", f"train.seed={seed}"]))
        if name == "again":
            nudge(out_dir / "best.pt")
        evaluated(out_dir)
    return root


def sweep(tmp_path, store, folders: dict, older: bool = False):
    """A sweep root of copies of the store's runs, {folder name: run}; `older`: their result files without the
    train_seed evaluate.py records now (as an older evaluate.py wrote them)."""
    root = tmp_path / "sweep"
    for name, run in folders.items():
        shutil.copytree(store / run, root / name)
        if older:
            path = root / name / "eval_best.json"
            result = json.loads(path.read_text())
            result.pop("train_seed", None)
            path.write_text(json.dumps(result))
    return root


@pytest.mark.slow
def test_evaluate_records_the_seed_the_run_trained_with(store):
    for run, seed in (("first", 0), ("other", 1), ("again", 0)):
        result = json.loads((store / run / "eval_best.json").read_text())
        assert result["train_seed"] == seed
        assert "train.seed" not in result["recipe"]  # the seeds of one recipe share it


def test_an_older_result_file_is_reused_and_takes_its_seed_from_its_run(store, tmp_path):
    """A result file without train_seed (an older evaluate.py's) is read with the seed of its run folder's
    config.yaml; evaluate.py adds to it as before: every entry is reused, none computed again, and the seed is
    recorded."""
    (run,) = sweep(tmp_path, store, {"baseline_s1": "other"}, older=True).iterdir()
    path = run / "eval_best.json"
    before = json.loads(path.read_text())
    assert read_result_file(str(path))["train_seed"] == 1
    # the result file's own checkpoint: the copy records the original's path, which names its evaluation
    evaluate.main(evaluate.parse_args(["--checkpoint", before["checkpoint"], "--out", str(path), *EVALUATION]))
    after = json.loads(path.read_text())
    assert after["quant"] == before["quant"] and "history" not in after
    assert after["train_seed"] == 1


def test_a_file_gathered_outside_its_run_folder_is_not_given_a_config_yaml_seed(store, tmp_path):
    """The config.yaml beside a file gathered elsewhere need not be its run's: the file is left without a seed."""
    result = json.loads((store / "other" / "eval_best.json").read_text())
    result.pop("train_seed", None)
    gathered = tmp_path / "gathered"
    gathered.mkdir()
    (gathered / "config.yaml").write_text("train:\n  seed: 7\n")
    (gathered / "other.json").write_text(json.dumps(result))
    assert "train_seed" not in read_result_file(str(gathered / "other.json"))


@pytest.mark.parametrize("older", [False, True], ids=["recorded", "older-files"])
def test_the_sweep_reports_refuse_one_seed_trained_twice(store, tmp_path, capsys, older):
    root = sweep(tmp_path, store, {"baseline_s0": "first", "baseline_s1": "other", "baseline_s2": "again"},
                 older=older)
    # baseline_s2 is named for a seed of its own, but trained with train.seed=0: the repeated seed is refused
    # first (renaming it would not help)
    expected = (f"{root / 'baseline_s0'} and {root / 'baseline_s2'} are both train.seed=0 of point baseline: one "
                "seed would count twice; remove one")
    with pytest.raises(gap_test.ReportError) as refused:
        gap_test.main([str(root), "baseline", "cd10x"])
    assert str(refused.value) == expected
    code, _, _ = run_entry("scripts/dose_report.py", [str(root), "--out", str(tmp_path / "report")], capsys)
    assert code == f"error: {expected}"


@pytest.mark.parametrize("older", [False, True], ids=["recorded", "older-files"])
def test_a_sweep_folder_named_for_another_seed_is_refused(store, tmp_path, capsys, older):
    """gap_test.py --seeds chose runs by their folder's name, and the reports printed it as their seed."""
    root = sweep(tmp_path, store, {"baseline_s0": "first", "baseline_s5": "other"}, older=older)
    expected = (f"{root / 'baseline_s5'} is named seed 5 (<point>_s<seed>) but its run was trained with "
                "train.seed=1: its numbers would be reported as seed 5's; rename the folder baseline_s1")
    code, _, _ = run_entry("scripts/gap_test.py", [str(root), "baseline", "cd10x", "--seeds", "0", "5"], capsys)
    assert code == f"error: {expected}"
    code, _, _ = run_entry("scripts/lm_study.py", [str(root), "--out", str(tmp_path / "report")], capsys)
    assert code == f"error: {expected}"
    # named as trained, the runs are seeds 0 and 1 of the point: read, and the test goes on to its points
    os.rename(root / "baseline_s5", root / "baseline_s1")
    with pytest.raises(gap_test.ReportError, match="has no evaluated runs of point 'cd10x'; its points: baseline"):
        gap_test.main([str(root), "baseline", "cd10x"])


@pytest.mark.parametrize("older", [False, True], ids=["recorded", "older-files"])
def test_paper_table_over_seeds_refuses_one_seed_trained_twice(store, tmp_path, older):
    root = sweep(tmp_path, store, {"baseline_s0": "first", "baseline_s1": "other", "baseline_s2": "again"},
                 older=older)
    paths = [str(root / name / "eval_best.json") for name in ("baseline_s0", "baseline_s1", "baseline_s2")]
    assert "| vit_nano | Baseline (n=2) |" in paper_table.main([*paths[:2], "--over-seeds"])
    assert paper_table.main(paths).count("| vit_nano | Baseline |") == 3  # one row per run: nothing averaged
    with pytest.raises(SystemExit) as refused:
        paper_table.main([*paths, "--over-seeds"])
    first, again = (json.loads(open(p).read())["checkpoint"] for p in (paths[0], paths[2]))
    assert refused.value.code == (f"error: vit_nano Baseline: {first} and {again} are both runs of train.seed=0: one "
                                  "seed would count twice (a run trained again with its seed is no new seed); give "
                                  "one result of each seed")


def test_check_seed_group_names_the_results_of_one_seed_by_their_labels():
    """compare_act_max.py labels the results by their CSVs; results that record no seed are not compared."""
    results = [{"model": "m", "method": "CD", "train_seed": seed} for seed in (3, 4, 3)]
    with pytest.raises(ValueError, match=r"^m CD: a and c are both runs of train.seed=3: one seed would count twice"):
        check_seed_group("m", "CD", results, labels=["a", "b", "c"])
    check_seed_group("m", "CD", [{"model": "m", "method": "CD"}] * 3, labels=["a", "b", "c"])
