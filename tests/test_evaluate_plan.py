"""What evaluate.py plans to run and record, checked against hand lists: the (pipeline, bits) pairs of a
command, which pipelines read the calibration batch, and what a result's settings name. resolve_config is
called on a weights path that is never opened (it reads no weights), so these tests train nothing."""
import os
import re

import pytest

import evaluate
from engine.quant_settings import quant_settings
from quant import plan
from tests.conftest import DEMO_CONFIG, ROOT

LM_CONFIG = os.path.join(ROOT, "configs", "lm", "kjv_nano.yaml")


CONFIGS = {"classifier": DEMO_CONFIG, "language model": LM_CONFIG}


def resolved(task: str, *argv: str):
    """The config of `evaluate.py --config <the task's config> model.pretrained=<a path never read> *argv`."""
    cfg, _ = evaluate.resolve_config(evaluate.parse_args(["--config", CONFIGS[task], "model.pretrained=/absent/w.pt",
                                                          *argv]))
    return cfg


@pytest.mark.parametrize("task, argv, pairs", [
    # no --quant / --bits: the paper's columns (Table 6 for a classifier, Table 8 for GPT-2) at their bit-widths
    ("classifier", [], [("percentile", "w4a4"), ("repq", "w4a4")]),
    ("language model", [],
     [("rtn", "w4a16"), ("gptq", "w4a16"), ("smoothquant", "w8a8"), ("smoothquant_strict", "w8a8")]),
    # each pipeline at each --bits, in the order given (normalised to lower case)
    ("classifier", ["--quant", "repq", "percentile", "--bits", "W6A6", "w4a4"],
     [("repq", "w6a6"), ("repq", "w4a4"), ("percentile", "w6a6"), ("percentile", "w4a4")]),
    ("language model", ["--quant", "rtn", "gptq", "--bits", "w3a16"], [("rtn", "w3a16"), ("gptq", "w3a16")]),
    # --quant without --bits: each at its own default bit-width
    ("classifier", ["--quant", "rtn", "smoothquant", "percentile"],
     [("rtn", "w4a16"), ("smoothquant", "w8a8"), ("percentile", "w4a4")]),
    # --quant naming nothing: the FP pass and maxima only, not the defaults
    ("classifier", ["--quant"], []),
])
def test_a_command_plans_every_pipeline_at_every_bit_width_it_names(task, argv, pairs):
    assert plan.planned(resolved(task, *argv)) == pairs


# by hand from the pipelines' descriptions (module docstring of evaluate.py, quant/README.md): RTN reads no
# data; APHQ and GPLQ draw their own training images on a classifier; every other pipeline reads the batch
READS_BATCH = {"percentile": True, "repq": True, "aphq": False, "gplq": False, "rtn": False, "gptq": True,
               "smoothquant": True, "smoothquant_strict": True}


@pytest.mark.parametrize("pipeline", sorted(READS_BATCH))
def test_which_pipelines_read_the_calibration_batch(pipeline):
    assert plan.reads_calibration_batch(pipeline, language=False) is READS_BATCH[pipeline]
    # on a language model only RTN reads none: there are no training images of its own to draw
    assert plan.reads_calibration_batch(pipeline, language=True) is (pipeline != "rtn")


def test_a_results_settings_name_the_calibration_only_where_it_is_read_and_the_ranks_only_for_gplq():
    """The settings decide whether a stored result is reused: a calibration batch RTN never reads must not
    make its stored result 'other settings', and GPLQ's result depends on the number of ranks it trained on."""
    cfg = resolved("language model")
    batch = {"images": cfg.quant.calib_images, "seed": cfg.quant.calib_seed, "split": cfg.data.train_split,
             "transform": cfg.quant.calib_transform}
    rtn, gptq, gplq = (quant_settings(cfg, name) for name in ("rtn", "gptq", "gplq"))
    assert set(rtn) == {"options"} and set(gptq) == {"options", "calibration"} and gptq["calibration"] == batch
    assert gplq["world_size"] == 1 and "world_size" not in gptq


def test_a_result_file_is_added_to_only_by_the_evaluation_it_records(tmp_path):
    """A result file written by hand: what it has with these settings is skipped, --recompute runs it again,
    other settings are refused (not silently replaced), and a file of another checkpoint is refused."""
    import json

    from engine.eval_results import EvalResults, ResultsError

    identity = {"model": "vit_nano", "checkpoint": "/runs/a/best.pt", "weights": "raw", "fingerprint": "f1"}
    settings = {"options": {"reparam": True}, "calibration": {"images": 32, "seed": 0}}
    path = tmp_path / "eval_best.json"
    path.write_text(json.dumps({**identity, "fp": {"top1": 90.0}, "quant": {
        "repq": {"w4a4": {"top1": 80.0, "settings": settings}}}}))
    results = EvalResults.open(str(path), identity)
    assert results.plan("repq", "w4a4", settings, recompute=False) is False  # there, with these settings
    assert results.plan("repq", "w4a4", settings, recompute=True) is True
    assert results.plan("repq", "w6a6", settings, recompute=False) is True  # not there: at another bit-width
    assert results.plan("percentile", "w4a4", settings, recompute=False) is True
    other = {**settings, "calibration": {"images": 64, "seed": 0}}
    with pytest.raises(ResultsError, match=r"already has repq w4a4, computed with other settings "
                                           r"\(calibration.images 32 -> 64\)"):
        results.plan("repq", "w4a4", other, recompute=False)
    assert results.plan("repq", "w4a4", other, recompute=True) is True
    for key, value in (("checkpoint", "/runs/b/best.pt"), ("model", "vit_tiny"), ("fingerprint", "f2")):
        with pytest.raises(ResultsError, match=rf"holds results of another evaluation \({key}: "):
            EvalResults.open(str(path), {**identity, key: value})


def test_a_result_file_of_another_autocast_names_the_amp_that_adds_to_it(tmp_path):
    """A file written under --amp bf16 is refused under none, its error naming --amp bf16 beside --out (a sweep
    names --out itself; its --eval-amp is this --amp); a file that differs in more than the autocast names --out
    alone."""
    import json

    from engine.eval_results import EvalResults, ResultsError

    identity = {"model": "vit_nano", "checkpoint": "/runs/a/best.pt", "eval_amp": "bf16"}
    path = tmp_path / "eval_best.json"
    path.write_text(json.dumps({**identity, "quant": {}}))
    with pytest.raises(ResultsError, match=r"\(eval_amp: 'bf16' in the file, 'none' now\); give --out another file, "
                                           r"or --amp bf16 to add to it$"):
        EvalResults.open(str(path), {**identity, "eval_amp": "none"})
    with pytest.raises(ResultsError, match=r"give --out another file$"):
        EvalResults.open(str(path), {**identity, "eval_amp": "none", "model": "vit_tiny"})


@pytest.mark.parametrize("task, pipelines, refused, own", [
    ("language model", ["gptq", "repq", "aphq"], "repq, aphq", "gptq, rtn, smoothquant, smoothquant_strict"),
    ("classifier", ["repq"], None, None),  # every pipeline quantizes a classifier: the LM ones run on ViTs too
    ("classifier", ["rtn", "gptq", "smoothquant", "smoothquant_strict", "percentile", "aphq", "gplq"], None, None),
])
def test_pipelines_of_another_task_are_refused_naming_the_tasks_own(task, pipelines, refused, own):
    from configs import ConfigError

    if refused is None:
        assert resolved(task, "--quant", *pipelines).quant.pipelines == pipelines
        return
    with pytest.raises(ConfigError, match=rf"^quant.pipelines: {refused} cannot quantize a causal_lm model "
                                          rf"\(data.dataset=kjv\); its pipelines are {own}$"):
        resolved(task, "--quant", *pipelines)


@pytest.mark.parametrize("text, argv, refused", [
    # options of a pipeline that does not run, as a section or dotted, and a batch no pipeline reads
    ("quant:\n  aphq:\n    iters: 500\n", ["--quant", "repq"], "quant.aphq.iters=500 (--config {}) would be ignored: "
                                                                "it sets options of aphq"),
    ("quant.gplq.steps: 5\n", [], "quant.gplq.steps=5 (--config {}) would be ignored: it sets options of gplq"),
    ("quant:\n  calib_images: 8\n", ["--quant", "rtn"], "quant.calib_images=8 (--config {}) would be ignored: no "
                                                        "pipeline of this evaluation reads the calibration batch"),
])
def test_quant_settings_a_config_file_gives_are_refused_where_no_pipeline_reads_them(tmp_path, text, argv, refused):
    """A --config file's quant settings are settings the user gave: as key=value overrides, those no pipeline of the
    evaluation reads are refused, naming the file (they were ignored without a word)."""
    extra = tmp_path / "extra.yaml"
    extra.write_text(text)
    with pytest.raises(evaluate.ConfigError, match=re.escape(refused.format(extra))):
        resolved("classifier", "--config", str(extra), *argv)


@pytest.mark.parametrize("text, argv", [
    ("quant:\n  aphq:\n    iters: 500\n", ["--quant", "repq", "aphq"]),  # the pipeline runs: read
    ("quant:\n  calib_images: 8\n", ["--quant", "rtn", "repq"]),  # repq reads the batch
    ("quant:\n  aphq:\n    iters: {iters}\n  calib_images: {images}\n", ["--quant", "rtn"]),  # the defaults, restated
    ("quant:\n  aphq:\n    act_pct: [{pct[0]}, {pct[1]}]\n", ["--quant", "repq"]),  # a tuple default as a list
])
def test_quant_settings_a_config_file_gives_are_accepted_where_they_are_read_or_change_nothing(tmp_path, text, argv):
    defaults = evaluate.Config().quant
    extra = tmp_path / "extra.yaml"
    extra.write_text(text.format(iters=defaults.aphq.iters, images=defaults.calib_images, pct=defaults.aphq.act_pct))
    assert resolved("classifier", "--config", str(extra), *argv).quant.pipelines == argv[1:]


def test_a_config_files_quant_setting_that_an_override_sets_again_is_named_as_the_override(tmp_path):
    """The override is the user's last word on the key: the error names it, not the file's value under it."""
    extra = tmp_path / "extra.yaml"
    extra.write_text("quant:\n  aphq:\n    iters: 500\n")
    with pytest.raises(evaluate.ConfigError, match=r"^quant.aphq.iters=20000 would be ignored"):
        resolved("classifier", "--config", str(extra), "--quant", "repq", "quant.aphq.iters=20000")
