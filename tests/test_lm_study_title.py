"""scripts/lm_study.py's figures are titled with what the runs trained, from the recipe each eval_best.json records
(scripts/training_title.py), and its tables name the seeds whose train.seed no file records. Both figures carried
"char-level GPT, King James Bible" whatever data the sweep trained on (a token folder included), and two results of
one seed without a recorded train.seed were averaged as two seeds with no note."""
import json
import sys

import pytest

from test_lm_study import write_run

import gap_test
import lm_study


def sweep_with_recipes(root, recipe):
    for name in ("baseline_s0", "baseline_s1", "cd10x_s0", "cd10x_s1"):
        write_run(root, name, ppl=4.0, rtn=5.0, block_max=9.0, kurtosis=5.0, fc2_final=50.0)
        path = root / name / "eval_best.json"
        result = json.loads(path.read_text())
        if recipe is not None:
            result["recipe"] = recipe
        path.write_text(json.dumps(result))
    return root


def drawn_titles(monkeypatch, root, out) -> dict:
    """The suptitle of each figure lm_study.main saves, by file name (read from the matplotlib Figure itself)."""
    titles = {}

    def keep(fig, path, overwrite, **options):
        titles[path.rsplit("/", 1)[-1]] = fig._suptitle.get_text() if fig._suptitle is not None else None
    monkeypatch.setattr(lm_study, "save_figure", keep)
    # plot_energies, which lm_study imports from scripts.dose_report (a module apart from the `dose_report` of tests)
    monkeypatch.setattr(sys.modules[lm_study.plot_energies.__module__], "save_figure", keep)
    monkeypatch.setattr(lm_study, "plot_type_maxima", lambda *a, **k: None)
    lm_study.main([str(root), "--out", str(out)])
    return titles


@pytest.mark.parametrize("recipe, named", [
    ({"model.name": "gpt2_nano", "data.dataset": "tokens", "data.root": "/data/owt_small/"}, "gpt2_nano, owt_small"),
    ({"model.name": "gpt2_nano", "data.dataset": "kjv"}, "gpt2_nano, kjv"),
])
def test_figures_are_titled_with_the_recorded_model_and_data(tmp_path, monkeypatch, recipe, named):
    (tmp_path / "s").mkdir()
    titles = drawn_titles(monkeypatch, sweep_with_recipes(tmp_path / "s", recipe), tmp_path / "o")
    assert titles["lm_study_energy.png"] == f"Pair energy during training from scratch ({named})"
    assert titles["lm_study_outliers.png"] == f"Outliers during training from scratch ({named})"
    assert not any("King James" in t for t in titles.values())


def test_runs_without_a_recorded_recipe_get_a_title_that_says_so(tmp_path, monkeypatch):
    (tmp_path / "s").mkdir()
    titles = drawn_titles(monkeypatch, sweep_with_recipes(tmp_path / "s", None), tmp_path / "o")
    assert titles["lm_study_outliers.png"] == \
        "Outliers during training (the runs' settings are not recorded in their eval_best.json)"


@pytest.mark.parametrize("recorded", [True, False])
def test_seeds_without_a_recorded_train_seed_are_named_below_the_tables(tmp_path, recorded):
    root = tmp_path / "s"
    root.mkdir()
    sweep_with_recipes(root, {"model.name": "gpt2_nano"})
    if recorded:
        for name in ("baseline_s0", "baseline_s1", "cd10x_s0", "cd10x_s1"):
            path = root / name / "eval_best.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), "train_seed": int(name[-1])}))
    report = lm_study.main([str(root), "--out", str(tmp_path / "o")])
    test = gap_test.main([str(root), "baseline", "cd10x"])
    for text in (report, test):
        notes = [line for line in text.splitlines() if line.startswith("seeds of ")]
        if recorded:
            assert notes == []
        else:  # both points, each naming its two folders
            assert [n.split(":")[0] for n in notes] == ["seeds of baseline", "seeds of cd10x"]
            assert all("the train.seed of 2 of its 2 results is not recorded" in n for n in notes)
