"""scripts/gap_test.py: Welch's t-test of the quantization gap between two points of a language-model sweep (the
perplexity gap) or of an image-classifier sweep (the top-1 drop), against the closed form worked by hand and
scipy.stats.ttest_ind(equal_var=False) on gaps computed here, and its refusals (a point or seed the sweep lacks,
one run, the same point twice, runs of both kinds, an unfinished classifier run)."""
import json
import math

import pytest
from scipy import stats

from test_dose_report import write_run as write_classifier_run
from test_lm_study import write_run

import gap_test

# (ppl, rtn w4a16 ppl, smoothquant_strict w8a5 ppl or None) per run
BASELINE = {0: (4.0, 5.0, 5.0), 1: (4.2, 5.4, 5.6), 2: (4.1, 5.0, 5.3), 3: (4.0, 5.3, 5.2)}
CD = {0: (4.1, 4.5, 4.6), 1: (4.0, 4.6, 4.5), 2: (4.05, 4.4, 4.75), 3: (4.1, 4.9, None)}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("gap_sweep")
    for point, runs in (("baseline", BASELINE), ("cd10x", CD)):
        for seed, (ppl, rtn, strict_a5) in runs.items():
            write_run(root, f"{point}_s{seed}", ppl=ppl, rtn=rtn, block_max=10.0, kurtosis=5.0, fc2_final=50.0,
                      strict_a5=strict_a5)
    return root


def row(report: str, setting: str) -> list[str]:
    (line,) = [line for line in report.splitlines() if line.startswith(f"| {setting} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def assert_row_is_scipys(cells: list[str], base: list[float], cd: list[float], digits: int) -> None:
    """A table row (row()) holds the means ± sample stds of these three gaps each, their change, and
    scipy.stats.ttest_ind(equal_var=False)'s t, df and p."""
    reference = stats.ttest_ind(base, cd, equal_var=False)
    assert cells[1] == f"{sum(base) / 3:.{digits}f} ± {stats.tstd(base):.{digits}f}"
    assert cells[2] == f"{sum(cd) / 3:.{digits}f} ± {stats.tstd(cd):.{digits}f}"
    relative = (sum(cd) - sum(base)) / abs(sum(base)) * 100
    assert cells[3] == f"{(sum(cd) - sum(base)) / 3:+.{digits}f} ({relative:+.0f} %)"
    assert float(cells[4]) == pytest.approx(reference.statistic, abs=0.005)
    assert float(cells[5]) == pytest.approx(reference.df, abs=0.05)
    assert float(cells[6]) == pytest.approx(reference.pvalue, rel=0.05)


def test_welch_matches_the_closed_form_worked_by_hand():
    # means 2 and 5, variances 1 and 1: t = -3 / sqrt(1/3 + 1/3), df = (2/3)^2 / (2 * (1/3)^2 / 2) = 4
    t, df, p = gap_test.welch([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    assert t == pytest.approx(-3 / math.sqrt(2 / 3)) and df == pytest.approx(4.0)
    assert p == pytest.approx(2 * stats.t.sf(3 / math.sqrt(2 / 3), 4))
    assert gap_test.welch([1.0, 1.0], [2.0, 2.0]) is None  # no spread: no test


def test_rows_match_scipy_on_gaps_computed_here(sweep):
    report = gap_test.main([str(sweep), "baseline", "cd10x", "--seeds", "0", "1", "2"])
    base = [rtn - ppl for ppl, rtn, _ in (BASELINE[s] for s in (0, 1, 2))]
    cd = [rtn - ppl for ppl, rtn, _ in (CD[s] for s in (0, 1, 2))]
    assert_row_is_scipys(row(report, "rtn W4A16"), base, cd, digits=3)
    # the seeds 0-2 both points have at strict W8A5 are tested too; gptq's gap is 0.01 in every run: no spread
    assert row(report, "smoothquant_strict W8A5")[4] != "-"
    assert row(report, "gptq W4A16")[4:] == ["-", "-", "- (no spread)"]
    assert "seeds 0, 1, 2" in report and "not tested" not in report


def test_a_setting_some_chosen_runs_lack_is_named_not_tested(sweep):
    report = gap_test.main([str(sweep), "baseline", "cd10x"])  # all seeds: cd10x_s3 has no strict W8A5
    assert "not tested: smoothquant_strict w8a5: not evaluated for cd10x_s3" in report
    assert "| smoothquant_strict W8A5 |" not in report and "| rtn W4A16 |" in report


@pytest.mark.parametrize("argv, message", [
    (["baseline", "cd1x"], "has no evaluated runs of point 'cd1x'; its points: baseline, cd10x"),
    (["baseline", "cd10x", "--seeds", "0", "7"], "point baseline has no evaluated run of seed(s) 7"),
    (["baseline", "cd10x", "--seeds", "0"], "point baseline has 1 chosen run(s); a sample std needs two or more"),
])
def test_refusals_name_the_input(sweep, argv, message):
    with pytest.raises(gap_test.ReportError) as refused:
        gap_test.main([str(sweep), *argv])
    assert message in str(refused.value)


def test_a_point_given_twice_is_a_usage_error(sweep, capsys):
    """It was a ReportError (status 1) after parsing; a value the arguments refuse on their own is a usage error."""
    with pytest.raises(SystemExit) as refused:
        gap_test.main([str(sweep), "cd10x", "cd10x"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") \
        and "cd10x given twice: give two different points" in lines[0], lines


# (fp top-1, top-1 at W4A4 of both pipelines) per classifier run; the fixture's W3A3 is 20 points below W4A4
CLASSIFIER_BASELINE = {0: (80.0, 70.0), 1: (82.0, 75.5), 2: (81.0, 68.0)}
CLASSIFIER_CD = {0: (81.5, 79.0), 1: (80.5, 78.5), 2: (81.0, 77.0)}


def classifier_sweep(root, recipe=None):
    for offset, (point, runs) in enumerate((("baseline", CLASSIFIER_BASELINE), ("cd10x", CLASSIFIER_CD))):
        for seed, (fp, w4) in runs.items():  # weights of their own (a copied run is refused), validations at 10, 20
            folder = write_classifier_run(root, f"{point}_s{seed}", fp=fp, w4=w4, fc2_curve=[100.0, 90.0],
                                          norm1_max=4.0, seed=10 * offset + seed)
            if recipe is not None:
                result = json.loads((folder / "eval_best.json").read_text())
                (folder / "eval_best.json").write_text(json.dumps({**result, "recipe": recipe}))
    return root


def test_a_classifier_sweep_tests_the_top1_drop_against_scipy(tmp_path):
    # sched.steps 20: finished at its last validation, which train.py logs as val/top1 (no val/loss)
    report = gap_test.main([str(classifier_sweep(tmp_path, {"sched.steps": 20})), "baseline", "cd10x"])
    assert report.startswith("Top-1 drop (fp32 - quantized top-1, points), baseline (seeds 0, 1, 2) against cd10x")
    for bits, below in (("W4A4", 0.0), ("W3A3", 20.0)):
        base = [fp - (w4 - below) for fp, w4 in CLASSIFIER_BASELINE.values()]
        cd = [fp - (w4 - below) for fp, w4 in CLASSIFIER_CD.values()]
        cells = row(report, f"repq {bits}")
        assert_row_is_scipys(cells, base, cd, digits=2)
        assert row(report, f"percentile {bits}") == ["percentile " + bits, *cells[1:]]


def test_an_unfinished_classifier_run_is_refused(tmp_path):
    from engine.eval_results import ResultsError

    with pytest.raises(ResultsError) as refused:
        gap_test.main([str(classifier_sweep(tmp_path, {"sched.steps": 100})), "baseline", "cd10x"])
    assert "baseline_s0 validated last at update 20 of the 100 of its schedule (sched.steps=100)" in str(refused.value)


def test_a_classifier_run_of_an_epoch_schedule_stopped_at_max_steps_is_refused(tmp_path):
    """Every classifier config trains for sched.epochs: the check judged sched.steps only, and a seed stopped at
    train.max_steps (no recipe setting) was tested as one of its point. The updates of an epoch are those its logged
    training records count (update 10 at 0.5 epochs: 20)."""
    from engine.eval_results import ResultsError

    root = classifier_sweep(tmp_path, {"sched.steps": None, "sched.epochs": 1})
    for metrics in root.glob("*/metrics.jsonl"):  # validations at 10 and 20: the end of the one epoch
        metrics.write_text(metrics.read_text().replace('"train/loss": 1.0', '"train/loss": 1.0, "train/epoch": 0.5', 1))
    assert "| repq W4A4 |" in gap_test.main([str(root), "baseline", "cd10x"])
    stopped = root / "cd10x_s1" / "metrics.jsonl"  # stopped at update 10 (train.max_steps=10), validated there
    stopped.write_text("".join(line + "\n" for line in stopped.read_text().splitlines()[:2]))
    with pytest.raises(ResultsError, match=r"cd10x_s1 validated last at update 10 of the 20 of its schedule "
                                           r"\(sched.epochs=1 of 20 updates\): an unfinished run"):
        gap_test.main([str(root), "baseline", "cd10x"])


def test_runs_of_a_language_model_and_a_classifier_are_not_tested_together(tmp_path):
    classifier_sweep(tmp_path)
    for seed in (0, 1, 2):
        write_run(tmp_path, f"gpt_s{seed}", ppl=4.0, rtn=5.0, block_max=10.0, kurtosis=5.0, fc2_final=50.0,
                  strict_a5=None)
    with pytest.raises(gap_test.ReportError) as refused:
        gap_test.main([str(tmp_path), "baseline", "gpt"])
    assert "evaluate every run alike" in str(refused.value)  # the data set differs


def test_a_negative_first_gap_gives_the_change_its_own_sign(tmp_path):
    """Quantized above fp32 (a drop of -0.5 points), then a drop of +0.5: the change is +1.00, +200 % of the first
    gap's size (it read -200 %, the relative change of a ratio of a negative mean)."""
    for point, w4s in (("baseline", (80.5, 80.7, 80.3)), ("cd10x", (79.5, 79.4, 79.6))):
        for seed, w4 in enumerate(w4s):
            write_classifier_run(tmp_path, f"{point}_s{seed}", fp=80.0, w4=w4, fc2_curve=[100.0, 90.0],
                                 norm1_max=4.0, seed=10 * (point == "cd10x") + seed)
    cells = row(gap_test.main([str(tmp_path), "baseline", "cd10x"]), "repq W4A4")
    assert cells[1:4] == ["-0.50 ± 0.20", "0.50 ± 0.10", "+1.00 (+200 %)"]


def test_a_first_gap_that_prints_as_zero_gives_no_relative_change(tmp_path):
    """Perplexity gaps +0.3, -0.1, -0.2 have mean zero, which their float sum misses by about 1e-17: the first
    mean prints as 0.000 and the change as a difference alone, not a relative change of some 1e16 %."""
    for point, rtns in (("baseline", (4.3, 3.9, 3.8)), ("cd10x", (4.1, 4.2, 4.0))):
        for seed, rtn in enumerate(rtns):
            write_run(tmp_path, f"{point}_s{seed}", ppl=4.0, rtn=rtn, block_max=10.0, kurtosis=5.0, fc2_final=50.0,
                      strict_a5=None)
    gaps = [rtn - 4.0 for rtn in (4.3, 3.9, 3.8)]
    assert sum(gaps) != 0 and abs(sum(gaps)) < 1e-12  # the premise: a float residue, not zero
    cells = row(gap_test.main([str(tmp_path), "baseline", "cd10x"]), "rtn W4A16")
    assert cells[1].startswith(("0.000 ±", "-0.000 ±")) and cells[3] == "+0.100"


def test_points_evaluated_otherwise_are_marked_and_the_way_is_named(tmp_path):
    """A gap under --amp bf16 is quantized-under-autocast minus fp32 (a language model's FP32 PPL ignores --amp):
    the table said nothing of it, where dose_report.py and lm_study.py mark the point †."""
    root = classifier_sweep(tmp_path, {"sched.steps": 20})
    for result_file in root.glob("*/eval_best.json"):
        result_file.write_text(json.dumps({**json.loads(result_file.read_text()), "eval_amp": "bf16"}))
    report = gap_test.main([str(root), "baseline", "cd10x"])
    assert "| setting | baseline† | cd10x† |" in report
    assert "† baseline: evaluated with --amp bf16" in report and "† cd10x: evaluated with --amp bf16" in report


def test_a_copied_sweep_is_checked_against_the_best_pt_beside_each_result(tmp_path):
    """As lm_study.py: a copy of a sweep whose run saved a new best.pt is refused, though the original best.pt that
    its eval_best.json records still holds the weights it scored."""
    from engine.eval_results import ResultsError
    from test_lm_study import copied_sweep_with_a_new_best

    names = ("baseline_s0", "baseline_s1", "cd10x_s0", "cd10x_s1")
    original, copy = copied_sweep_with_a_new_best(tmp_path, names)
    assert "| rtn W4A16 |" in gap_test.main([str(original), "baseline", "cd10x"])
    with pytest.raises(ResultsError, match=rf"{copy / 'cd10x_s1' / 'eval_best.json'} is stale"):
        gap_test.main([str(copy), "baseline", "cd10x"])


@pytest.mark.parametrize("rtn", [math.exp(700.0), 5.0])
def test_a_setting_where_a_collapsed_run_has_a_perplexity_at_the_cap_is_not_tested(tmp_path, rtn):
    """A run whose fp32 perplexity is at the cap exp(700) has no gap but a bound, its quantized perplexity at the
    cap too (cap - cap was 0) or not (5 - cap was tested as a number): the setting is named below the table, not
    tested."""
    for point, runs in (("baseline", BASELINE), ("cd10x", CD)):
        for seed, (ppl, rtn_ppl, _) in list(runs.items())[:3]:
            collapsed = point == "cd10x" and seed == 0
            write_run(tmp_path, f"{point}_s{seed}", ppl=math.exp(700.0) if collapsed else ppl,
                      rtn=rtn if collapsed else rtn_ppl, block_max=10.0, kurtosis=5.0, fc2_final=50.0)
    report = gap_test.main([str(tmp_path), "baseline", "cd10x"])
    assert "not tested: rtn w4a16: a perplexity at the cap (a bound, not a number)" in report
    assert "| rtn W4A16 |" not in report


def test_a_setting_computed_with_other_settings_than_the_defaults_is_marked_and_named(tmp_path):
    """A gap of a calibration set of 8 windows (quant.calib_images=8) is marked *, with a note naming the setting, as
    dose_report.py, lm_study.py and paper_table.py mark it; the settings of the defaults are not."""
    for point, runs in (("baseline", BASELINE), ("cd10x", CD)):
        for seed, (ppl, rtn, _) in list(runs.items())[:3]:
            folder = tmp_path / f"{point}_s{seed}"
            write_run(tmp_path, folder.name, ppl=ppl, rtn=rtn, block_max=10.0, kurtosis=5.0, fc2_final=50.0)
            result = json.loads((folder / "eval_best.json").read_text())
            result["quant"]["smoothquant"]["w8a8"]["settings"] = {"calibration": {"images": 8, "seed": 0}}
            result["quant"]["rtn"]["w4a16"]["settings"] = {"options": {}}
            (folder / "eval_best.json").write_text(json.dumps(result))
    report = gap_test.main([str(tmp_path), "baseline", "cd10x"])
    assert "| smoothquant W8A8* |" in report and "| rtn W4A16 |" in report
    assert "\\* baseline, cd10x SmoothQuant W8A8: not the default settings: quant.calib_images=8" in report.splitlines()


@pytest.mark.parametrize("count", [500, None])
def test_drops_of_the_same_number_of_images_in_every_seed_have_no_spread(tmp_path, count):
    """Of 500 images the baseline loses none in every seed and cd10x exactly one: no spread. The drops computed from
    the top-1s, 100 * k / 500 - 100 * (k - 1) / 500, came out 0.20000000000000284 or 0.19999999999998863 as k
    varied, and the test of a variance of 1e-28 read t ~ -4e13, p ~ 1e-28. With the image count evaluate.py records
    the drop is exact; without it (an older file) a spread within float rounding is none."""
    for point, lost in (("baseline", 0), ("cd10x", 1)):
        for seed, k in enumerate((400, 403, 427)):  # images right in fp32: noisy drops of 1 image at each
            folder = write_classifier_run(tmp_path, f"{point}_s{seed}", fp=80.0, w4=80.0, fc2_curve=[100.0, 90.0],
                                          norm1_max=4.0, seed=10 * (point == "cd10x") + seed)
            result = json.loads((folder / "eval_best.json").read_text())
            counted = {"count": count} if count else {}
            result["fp"] = {"top1": 100.0 * k / 500, **counted}
            result["quant"] = {p: {b: {"top1": 100.0 * (k - lost) / 500, **counted} for b in ("w4a4", "w3a3")}
                               for p in ("percentile", "repq")}
            (folder / "eval_best.json").write_text(json.dumps(result))
    report = gap_test.main([str(tmp_path), "baseline", "cd10x"])
    for setting in ("repq W4A4", "percentile W3A3"):
        assert row(report, setting)[1:] == ["0.00 ± 0.00", "0.20 ± 0.00", "+0.20", "-", "-", "- (no spread)"]


def test_a_spread_within_float_rounding_is_no_spread_and_a_small_real_one_is_tested():
    assert gap_test.welch([0.0, 0.0, 0.0], [0.20000000000000284, 0.19999999999998863, 0.20000000000000284]) is None
    t, df, p = gap_test.welch([0.0, 0.0, 0.0], [0.2, 0.2, 0.2 + 1e-6])  # one sample varies: tested
    reference = stats.ttest_ind([0.0, 0.0, 0.0], [0.2, 0.2, 0.2 + 1e-6], equal_var=False)
    assert (t, df, p) == pytest.approx((reference.statistic, reference.df, reference.pvalue))


def test_points_whose_runs_max_steps_stopped_short_of_their_schedule_are_marked(tmp_path):
    """Runs that all stopped at train.max_steps=50 of their 2,000-update schedule were tested as finished runs with
    no mark; each point is marked § in the caption and header, a note saying how far its runs got."""
    from test_lm_study import capped_sweep

    report = gap_test.main([str(capped_sweep(tmp_path / "sweep")), "baseline", "cd10x"])
    assert "baseline§ (seeds 0, 1) against cd10x§ (seeds 0, 1)" in report
    assert "| setting | baseline§ | cd10x§ |" in report
    assert "§ cd10x: stopped before the end of its schedule: validated last at update 50 of the 2000" in report
