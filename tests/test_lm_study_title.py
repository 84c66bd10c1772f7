"""scripts/lm_study.py's figures are titled with what the runs trained, from the config each run's best.pt records
(scripts/training_title.py), and its tables name the seeds whose train.seed no file records. Both figures carried
"char-level GPT, King James Bible" whatever data the sweep trained on (a token folder included), and two results of
one seed without a recorded train.seed were averaged as two seeds with no note. The configs are made by the loader
from the runs' settings, as train.py saves them."""
import json
import os
import sys

import pytest
import torch

from configs import config_to_dict, load_config
from tests.conftest import ROOT
from test_lm_study import write_run
from tests.test_dose_report_title import saved_titles

import gap_test
import lm_study

NAMES = ("baseline_s0", "baseline_s1", "cd10x_s0", "cd10x_s1")


def write_sweep(root, overrides=None):
    """Four runs of lm_study's test layout; with `overrides`, each with a best.pt whose config is kjv_nano.yaml's
    with them (no weights: the title reads the config alone)."""
    root.mkdir()
    for name in NAMES:
        write_run(root, name, ppl=4.0, rtn=5.0, block_max=9.0, kurtosis=5.0, fc2_final=50.0)
        if overrides is not None:
            cfg = load_config([os.path.join(ROOT, "configs", "lm", "kjv_nano.yaml")], overrides)
            torch.save({"config": config_to_dict(cfg), "model": {}}, root / name / "best.pt")
    return root


def drawn_titles(monkeypatch, root, out) -> dict:
    """The suptitle of each figure lm_study.main saves, by file name (read from the matplotlib Figure itself)."""
    # plot_energies, which lm_study imports from scripts.dose_report (a module apart from the `dose_report` of tests)
    titles = saved_titles(monkeypatch, lm_study, sys.modules[lm_study.plot_energies.__module__])
    monkeypatch.setattr(lm_study, "plot_type_maxima", lambda *a, **k: None)
    lm_study.main([str(root), "--out", str(out)])
    return titles


@pytest.mark.parametrize("overrides, phase, named", [
    (["data.dataset=tokens", "data.root=/data/owt_small/"], "training from scratch", "gpt2_nano, owt_small"),
    ([], "training from scratch", "gpt2_nano, kjv"),
    (["model.pretrained=/weights/gpt2_nano_kjv.pt"], "fine-tuning", "gpt2_nano, kjv"),
])
def test_figures_are_titled_with_the_model_data_and_phase_best_pt_records(tmp_path, monkeypatch, overrides, phase,
                                                                         named):
    titles = drawn_titles(monkeypatch, write_sweep(tmp_path / "s", overrides), tmp_path / "o")
    assert titles["lm_study_energy.png"] == f"Pair energy during {phase} ({named})"
    assert titles["lm_study_outliers.png"] == f"Outliers during {phase} ({named})"
    assert not any("King James" in t for t in titles.values())


def test_runs_without_a_best_pt_get_a_title_that_says_so(tmp_path, monkeypatch):
    titles = drawn_titles(monkeypatch, write_sweep(tmp_path / "s"), tmp_path / "o")
    assert titles["lm_study_outliers.png"] == \
        "Outliers during training (the runs' settings: no best.pt beside some of their results)"


@pytest.mark.parametrize("recorded", [True, False])
def test_seeds_without_a_recorded_train_seed_are_named_below_the_tables(tmp_path, recorded):
    root = write_sweep(tmp_path / "s")
    if recorded:
        for name in NAMES:
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


@pytest.mark.parametrize("dataset, unit", [("tokens", "token"), ("kjv", "character"), (None, "token or character")])
def test_the_val_loss_panel_is_per_token_or_character_as_the_runs_were_evaluated(tmp_path, monkeypatch, dataset,
                                                                                 unit):
    """The outliers figure's val-loss panel named nats per character for a sweep of token files as well."""
    root = write_sweep(tmp_path / "s")
    if dataset is not None:  # eval_best.json's "data", as evaluate.py records it (engine/eval_results identity)
        for name in NAMES:
            path = root / name / "eval_best.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), "data": {"dataset": dataset}}))
    panels = {}

    def keep(fig, path, overwrite, **options):
        panels[os.path.basename(path)] = [ax.get_title() for ax in fig.axes]
    monkeypatch.setattr(lm_study, "save_figure", keep)
    monkeypatch.setattr(sys.modules[lm_study.plot_energies.__module__], "save_figure", keep)
    monkeypatch.setattr(lm_study, "plot_type_maxima", lambda *a, **k: None)
    lm_study.main([str(root), "--out", str(tmp_path / "o")])
    assert f"val loss (nats / {unit})" in panels["lm_study_outliers.png"]
