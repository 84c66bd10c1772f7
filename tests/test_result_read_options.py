"""A result's settings hold the pipeline options it read, not those the config's rules say are unread under the
others (configs/loader.py READ_ONLY_WHEN: quant.aphq.recon_images at iters=0). The command line refuses an
unread option, so a result file written before they were left out, with an unread option at another value than
the default, must still be reused by a command without it (the numbers are the same), averaged with a new file's
result and marked alike in tables; where the option is read it is still compared."""
import dataclasses
import json

import pytest

from configs import Config
from configs.loader import IgnoredOverrideError, apply_overrides
from engine.eval_results import EvalResults, ResultsError, evaluation_difference
from engine.quant_settings import quant_settings
from engine.result_table import nondefault_settings
from quant.plan import pipeline_options

# (pipeline, the overrides of a run, an option those leave unread, a value other than its default)
UNREAD = [
    ("aphq", ["quant.aphq.iters=0"], "recon_images", 32),
    ("aphq", ["quant.aphq.iters=0"], "seed", 7),
    ("aphq", ["quant.aphq.round_weight=0"], "beta_start", 5.0),
    ("aphq", ["quant.aphq.round_weight=0"], "warmup", 0.5),
    ("aphq", ["quant.aphq.mlp_reconstruct=true", "quant.aphq.mlp_clip_weight=0"], "mlp_clip_percentile", 0.9),
    ("gplq", ["quant.gplq.lr=0", "quant.gplq.scale_lr=0.001"], "weight_decay", 0.5),
    ("aphq", ["quant.aphq.drop_prob=0"], "act_lr", 1e-4),  # a classifier's (CLASSIFIER_ONLY)
]
CASES = [pytest.param(*case, id=f"{case[2]} at {' '.join(case[1])}") for case in UNREAD]


def plain(value):
    return json.loads(json.dumps(value, default=str))


def old_style(pipeline: str, overrides: list, **options) -> dict:
    """The settings an entry was recorded with before unread options were left out: every option of the section
    (dataclasses.asdict, as evaluate.py wrote them), `options` changed by hand as an older command could."""
    cfg = apply_overrides(Config(), overrides)
    settings = plain(quant_settings(cfg, pipeline))
    settings["options"] = {**plain(dataclasses.asdict(pipeline_options(cfg, pipeline))), **plain(options)}
    return settings


def result(pipeline: str, settings: dict) -> dict:
    return {"model": "m", "quant": {pipeline: {"w4a4": {"top1": 60.0, "settings": settings}}}}


@pytest.mark.parametrize("pipeline, overrides, option, value", CASES)
def test_the_command_line_refuses_the_option_so_no_new_file_records_it(pipeline, overrides, option, value):
    """The reference: the config's own refusal of the override says the option is unread there."""
    with pytest.raises(IgnoredOverrideError, match=f"quant.{pipeline}.{option}=.* would be ignored"):
        apply_overrides(Config(), [*overrides, f"quant.{pipeline}.{option}={value}"])
    assert option not in quant_settings(apply_overrides(Config(), overrides), pipeline)["options"]


@pytest.mark.parametrize("pipeline, overrides, option, value", CASES)
def test_an_old_entry_with_an_unread_option_is_reused_averaged_and_marked_alike(pipeline, overrides, option, value,
                                                                               tmp_path):
    stored = old_style(pipeline, overrides, **{option: value})
    results = EvalResults.open(str(tmp_path / "r.json"), {"model": "m"})
    results.add(pipeline, "w4a4", {"top1": 60.0}, stored)
    results.save()
    now = quant_settings(apply_overrides(Config(), overrides), pipeline)  # what a command accepted now records
    assert EvalResults.open(str(tmp_path / "r.json"), {"model": "m"}).plan(pipeline, "w4a4", now, False) is False
    assert evaluation_difference(result(pipeline, stored), result(pipeline, plain(now))) is None
    assert nondefault_settings(pipeline, stored) == nondefault_settings(pipeline, now)
    assert not any(f".{option}=" in note for note in nondefault_settings(pipeline, stored))


def test_where_the_option_is_read_it_is_still_compared(tmp_path):
    stored = old_style("aphq", [], recon_images=32)
    results = EvalResults.open(str(tmp_path / "r.json"), {"model": "m"})
    results.add("aphq", "w4a4", {"top1": 60.0}, stored)
    results.save()
    now = quant_settings(Config(), "aphq")  # iters above 0: the reconstruction set is drawn
    with pytest.raises(ResultsError, match=r"computed with other settings \(options.recon_images 32 -> 1024\)"):
        EvalResults.open(str(tmp_path / "r.json"), {"model": "m"}).plan("aphq", "w4a4", now, False)
    assert evaluation_difference(result("aphq", stored), result("aphq", plain(now))) is not None
    assert "quant.aphq.recon_images=32" in nondefault_settings("aphq", stored)


def test_options_under_an_unread_decider_of_another_value_differ():
    """An entry at iters=0 beside one at iters=100: the iterations differ, and so does what each read."""
    calibration_only = old_style("aphq", ["quant.aphq.iters=0"])
    assert evaluation_difference(result("aphq", calibration_only), result("aphq", old_style("aphq", []))) is not None


def test_an_entry_without_the_deciding_option_compares_every_option():
    """A file older than the deciding option cannot say the option was unread: it stays compared."""
    old = result("aphq", {"options": {"recon_images": 32}})
    assert evaluation_difference(old, result("aphq", {"options": {"recon_images": 1024}})) is not None


def act_lr_shapes() -> dict:
    """An APHQ classifier entry at drop_prob=0 as evaluate.py wrote it: before ac3a53d with act_lr (read by no rule
    yet, at whatever value the command gave), from ac3a53d to 90fb3cc^ without it (the config's rule), from 90fb3cc
    with the default (the rule left to the pipeline, so the result file's comparison kept it)."""
    now = plain(quant_settings(apply_overrides(Config(), ["quant.aphq.drop_prob=0"]), "aphq"))
    options = {k: v for k, v in now["options"].items() if k != "act_lr"}
    default = dataclasses.asdict(pipeline_options(Config(), "aphq"))["act_lr"]
    return {"before ac3a53d": {**now, "options": {**options, "act_lr": 1e-4}},
            "ac3a53d..90fb3cc^": {**now, "options": options},
            "90fb3cc": {**now, "options": {**options, "act_lr": default}}}


@pytest.mark.parametrize("shape", ["before ac3a53d", "ac3a53d..90fb3cc^", "90fb3cc"])
def test_a_classifier_entry_at_drop_prob_0_is_reused_whatever_act_lr_it_recorded(shape, tmp_path):
    """The config refuses act_lr beside drop_prob=0 on a classifier (test_the_command_line_refuses_...), so every
    shape an older evaluate.py wrote is a result of the command `quant.aphq.drop_prob=0`: reused, averaged with a
    new file's result and not marked; a classifier's file (no task) compares by the classifier's rules."""
    stored = act_lr_shapes()[shape]
    results = EvalResults.open(str(tmp_path / "r.json"), {"model": "m"})
    results.add("aphq", "w4a4", {"top1": 60.0}, stored)
    results.save()
    now = quant_settings(apply_overrides(Config(), ["quant.aphq.drop_prob=0"]), "aphq")
    assert EvalResults.open(str(tmp_path / "r.json"), {"model": "m"}).plan("aphq", "w4a4", now, False) is False
    for other in act_lr_shapes().values():
        assert evaluation_difference(result("aphq", stored), result("aphq", other)) is None
    assert nondefault_settings("aphq", stored) == nondefault_settings("aphq", now) == ["quant.aphq.drop_prob=0.0"]


def test_act_lr_is_still_compared_where_a_classifier_reads_it():
    """At a nonzero drop_prob the activation scales learn at act_lr: another value is another result."""
    read = old_style("aphq", ["quant.aphq.drop_prob=0.25"])
    assert evaluation_difference(result("aphq", read), result("aphq", old_style(
        "aphq", ["quant.aphq.drop_prob=0.25"], act_lr=1e-4))) is not None



@pytest.mark.parametrize("pipeline, overrides, recorded, marked", [
    ("aphq", [], {"hessian_eps": 1e-6}, []),  # the official all-ones probe's +-1e-6
    ("aphq", ["quant.aphq.hessian_probe=rademacher"], {"hessian_eps": 1e-4}, ["quant.aphq.hessian_probe=rademacher"]),
    ("gplq", [], {"lr": 1e-6, "scale_lr": 1e-6}, []),  # the paper's lr of a global batch of 16 (one process)
    ("gplq", ["quant.gplq.lr=3e-6"], {"scale_lr": 3e-6}, ["quant.gplq.lr=3e-06"]),  # scale_lr null: the lr
])
def test_results_record_the_value_a_null_default_meant_and_read_an_older_null_as_then(pipeline, overrides, recorded,
                                                                                      marked, monkeypatch):
    """APHQ's hessian_eps and GPLQ's lr and scale_lr mean a default where null (the paper's and the official code's
    constants, written out here): a result records the values used, so a later default cannot make it read as computed
    with the new one, and an entry written with null compares as what null meant then: equal to the same settings
    now, marked by no table, and another result once the default changes."""
    import quant.aphq.pipeline as aphq
    import quant.gplq.pipeline as gplq
    from engine.eval_results import settings_change

    settings = plain(quant_settings(apply_overrides(Config(), overrides), pipeline))
    assert {k: settings["options"][k] for k in recorded} == recorded
    older = {**settings, "options": {**settings["options"], **{k: None for k in recorded}}}
    assert settings_change({"settings": older}, settings, pipeline) is None
    assert nondefault_settings(pipeline, older) == nondefault_settings(pipeline, settings) == marked
    # a later default: the result recorded now, and the older null, read as computed with other settings
    monkeypatch.setattr(aphq, "hessian_eps", lambda options: options.hessian_eps or 1e-5)
    monkeypatch.setattr(gplq, "default_lr", lambda batch: 7e-6)
    later = quant_settings(apply_overrides(Config(), [o for o in overrides if "lr=" not in o]), pipeline)
    for entry in (settings, older):
        assert settings_change({"settings": entry}, later, pipeline) is not None


def test_a_gplq_entry_records_and_reads_the_lr_of_its_global_batch(monkeypatch):
    """GPLQ's null lr is the paper's lr of the global batch (batch_size_per_gpu x ranks: 5e-6 from 128): an entry
    trained on 8 processes records 5e-6, an older one of 8 processes holding null reads as 5e-6 (its recorded
    world_size), and a table compares it with the default of 8 processes, not of the one that reads the file."""
    import quant.gplq.pipeline as gplq
    import quant.registry as registry
    from engine.eval_results import settings_change

    monkeypatch.setattr(gplq, "world_size", lambda: 8)
    monkeypatch.setattr(registry, "world_size", lambda: 8)
    settings = plain(quant_settings(Config(), "gplq"))
    assert (settings["world_size"], settings["options"]["lr"], settings["options"]["scale_lr"]) == (8, 5e-6, 5e-6)
    older = {**settings, "options": {**settings["options"], "lr": None, "scale_lr": None}}
    assert settings_change({"settings": older}, settings, "gplq") is None
    monkeypatch.undo()  # the table is read in one process
    assert nondefault_settings("gplq", older) == nondefault_settings("gplq", settings) == []


def test_an_aphq_report_records_the_perturbation_used():
    """The report of a run (evaluate.py's result file keeps it) holds the hessian_eps the APH used, not null."""
    from configs.quant import APHQOptions
    from device_utils import cpu_pipeline_data
    from quant import PIPELINES
    from quant_models import images, tiny_vit

    small = dict(iters=1, recon_images=8, calib_images=8, batch_size=4, eq_n=32, matmul_steps=5, search_rounds=0)
    options = APHQOptions(**small, hessian_probe="rademacher")
    _, report = PIPELINES["aphq"](tiny_vit(depth=1), images(2), "w4a4", options, data=cpu_pipeline_data(num_images=16))
    assert report["options"]["hessian_eps"] == 1e-4


@pytest.mark.parametrize("pipeline, items, recorded", [
    ("aphq", [], {"hessian_eps": 1e-3}),  # the official detection perturbation (not the classifier's 1e-6)
    ("gplq", [], {"lr": 1e-6, "scale_lr": 1e-6}),  # the paper's lr of a global batch of 1 (one process)
    ("gplq", ["gplq.lr=3e-6"], {"lr": 3e-6, "scale_lr": 3e-6}),  # scale_lr null: the lr given
    ("percentile", [], {"act_percentiles": [0.999, 0.9999, 0.99999], "weight_percentiles": [0.999, 0.9999, 0.99999]}),
])
def test_a_detector_entry_records_the_value_a_null_default_meant_and_reads_an_older_entry_as_then(
        pipeline, items, recorded, monkeypatch):
    """evaluate_detection.py records the options typed and, since, the values of the defaults the pipelines resolve
    (APHQ's hessian_eps, GPLQ's lr and scale_lr, percentile's levels; the constants of then written out here): an
    entry written before without them compares as what they meant then, equal to the same command now, and both read
    as computed with other settings once the default changes (they read as the new default while left out)."""
    from types import SimpleNamespace
    import quant.aphq.detector as aphq_detector
    import quant.gplq.pipeline as gplq
    import quant.ranges as ranges
    from engine.eval_results import settings_change
    from evaluate_detection import detection_defaults, pipeline_options as detector_options, settings
    from quant import PIPELINES
    from quant.pipeline_base import parse_options

    args = SimpleNamespace(calib_images=1, calib_seed=0)

    def asked() -> dict:
        user = detector_options(items, [pipeline]).get(pipeline, {})
        parsed = parse_options(PIPELINES[pipeline].Options, {**detection_defaults(pipeline, args, user), **user})
        return plain(settings(args, pipeline, user, 1, parsed))

    now = asked()
    assert {key: now["options"][key] for key in recorded} == recorded
    given = detector_options(items, [pipeline]).get(pipeline, {})
    older = {**now, "options": plain(given)} if given else {k: v for k, v in now.items() if k != "options"}
    assert settings_change({"settings": older}, now, pipeline, detector=True) is None
    # a later default: the entry recorded now and the older one are both of other settings than the new default's
    monkeypatch.setattr(aphq_detector, "DETECTION_EPS", 5e-3)
    monkeypatch.setattr(gplq, "default_lr", lambda batch: 7e-6)
    search = ranges.range_search
    monkeypatch.setattr(ranges, "range_search", lambda method, levels: search(method, levels or [0.99]))
    import quant.ptq.percentile as percentile
    monkeypatch.setattr(percentile, "range_search", ranges.range_search)
    later = asked()
    if pipeline == "gplq" and items:  # the lr given: a later default changes nothing
        assert settings_change({"settings": older}, later, pipeline, detector=True) is None
        return
    for entry in (now, older):
        assert settings_change({"settings": entry}, later, pipeline, detector=True) is not None


@pytest.mark.parametrize("pipeline, defaults, other", [
    ("aphq", ["aphq.iters=20000", "aphq.recon_images=256", "aphq.batch_size=1"], ["aphq.recon_images=128"]),
    ("aphq", ["aphq.drop_prob=0", "aphq.act_lr=4e-5"], ["aphq.drop_prob=0", "aphq.act_lr=1e-4"]),
    ("gplq", ["gplq.batch_size_per_gpu=1", "gplq.pca_weight=0"], ["gplq.batch_size_per_gpu=2"]),
    ("percentile", ["percentile.act_range=percentile_mse"], ["percentile.act_range=minmax"]),
])
def test_a_detector_entry_of_the_defaults_is_the_same_as_one_with_those_defaults_typed_out(pipeline, defaults, other):
    """evaluate_detection.py records the options typed: its default run (the detection recipe, configs/quant.py
    APHQ_DETECTION / GPLQ_DETECTION over the pipeline's defaults, written out here) and the same run with those
    values typed out are one result, reused by either command, and a value other than the recipe's is another."""
    from types import SimpleNamespace
    from engine.eval_results import settings_change
    from evaluate_detection import detection_defaults, pipeline_options as detector_options, settings
    from quant import PIPELINES
    from quant.pipeline_base import parse_options

    args = SimpleNamespace(calib_images=1, calib_seed=0)

    def asked(items: list) -> dict:
        user = detector_options(items, [pipeline]).get(pipeline, {})
        parsed = parse_options(PIPELINES[pipeline].Options, {**detection_defaults(pipeline, args, user), **user})
        return plain(settings(args, pipeline, user, 1, parsed))

    plain_run, typed_out = asked(defaults[:1] if "drop_prob=0" in defaults[0] else []), asked(defaults)
    for entry, now in ((plain_run, typed_out), (typed_out, plain_run)):
        assert settings_change({"settings": entry}, now, pipeline, detector=True) is None
    assert settings_change({"settings": plain_run}, asked(other), pipeline, detector=True) is not None



@pytest.mark.parametrize("pipeline, recipe, later", [
    ("aphq", "APHQ_DETECTION", {"recon_images": 128}), ("aphq", "APHQ_DETECTION", {"eq_n": 64}),
    ("gplq", "GPLQ_DETECTION", {"pca_weight": 1.0}),
])
def test_a_detector_entry_records_every_option_it_ran_with(pipeline, recipe, later, monkeypatch):
    """evaluate_detection.py records every option a detector entry ran with (as evaluate.py does a classifier's),
    not only those typed: left out, a later change of the detection recipe (configs/quant.py) would make the entry
    read as computed with the new one, and a command of the new recipe would reuse it as its result."""
    from types import SimpleNamespace
    import configs.quant
    from engine.eval_results import settings_change
    from evaluate_detection import detection_defaults, settings
    from quant import PIPELINES
    from quant.pipeline_base import parse_options

    args = SimpleNamespace(calib_images=1, calib_seed=0)

    def asked() -> dict:
        parsed = parse_options(PIPELINES[pipeline].Options, detection_defaults(pipeline, args, {}))
        return plain(settings(args, pipeline, {}, 1, parsed))

    now = asked()
    assert {key: now["options"][key] for key in later} != later
    monkeypatch.setattr(configs.quant, recipe, {**getattr(configs.quant, recipe), **later})
    assert settings_change({"settings": now}, asked(), pipeline, detector=True) is not None
