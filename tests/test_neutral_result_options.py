"""Options that change no number of a result (engine.eval_results.NEUTRAL_OPTIONS): APHQ's cache_device and
log_every, GPLQ's log_every and ckpt_every (how often it logs and writes its stage-1 checkpoint). A result file
records them, but a stored result is reused under another value, seeds that differ only in them average, and no
table marks a result computed with another value as "not the default settings"; an option that changes the
numbers still counts, and the names are the pipeline's own (another pipeline's option of that name would count)."""
import dataclasses
import json

import pytest

from configs import Config
from configs.quant import APHQOptions, GPLQOptions
from device_utils import cpu_pipeline_data
from engine.eval_results import EvalResults, ResultsError, comparable_settings, evaluation_difference
from engine.quant_settings import quant_settings
from engine.result_table import nondefault_settings
from quant import PIPELINES
from quant_models import images, same_state, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")

# each pipeline's options that change no number, with a value other than the default
NEUTRAL = {"aphq": {"log_every": 1}, "gplq": {"log_every": 1, "ckpt_every": 1}}


def test_aphq_logging_changes_no_number():
    def state(**options):
        opts = APHQOptions(iters=3, recon_images=8, calib_images=8, batch_size=4, eq_n=32, matmul_steps=5,
                           search_rounds=0, **options)
        return PIPELINES["aphq"](tiny_vit(), images(2), "w4a4", opts, data=cpu_pipeline_data(16))[0].state_dict()
    assert same_state(state(), state(log_every=1))


def test_gplq_logging_and_stage1_checkpoints_change_no_number(tmp_path):
    """With a work prefix, so that ckpt_every=1 writes the stage-1 checkpoint after every update."""
    def state(folder, **options):
        data = dataclasses.replace(cpu_pipeline_data(16), work_prefix=str(tmp_path / folder / "r"))
        (tmp_path / folder).mkdir()
        opts = GPLQOptions(steps=3, batch_size_per_gpu=4, init_images=8, stage2_images=8, pca_images=8, **options)
        return PIPELINES["gplq"](tiny_vit(), images(2), "w4a4", opts, data=data)[0].state_dict()
    assert same_state(state("a"), state("b", log_every=1, ckpt_every=1))
    assert (tmp_path / "b" / "r_gplq_w4a4_stage1.pt").exists()


def settings_with(pipeline: str, **options) -> dict:
    settings = json.loads(json.dumps(quant_settings(Config(), pipeline), default=str))
    settings["options"].update(options)
    return settings


def result(pipeline: str, settings: dict) -> dict:
    return {"model": "m", "quant": {pipeline: {"w4a4": {"top1": 60.0, "settings": settings}}}}


@pytest.mark.parametrize("pipeline, key", [(p, k) for p in NEUTRAL for k in NEUTRAL[p]])
def test_a_stored_result_is_reused_under_another_value(pipeline, key, tmp_path):
    stored = settings_with(pipeline, **{key: NEUTRAL[pipeline][key]})
    results = EvalResults.open(str(tmp_path / "r.json"), {"model": "m"})
    results.add(pipeline, "w4a4", {"top1": 60.0}, stored)
    results.save()
    reopened = EvalResults.open(str(tmp_path / "r.json"), {"model": "m"})
    assert reopened.plan(pipeline, "w4a4", settings_with(pipeline), recompute=False) is False  # already there
    with pytest.raises(ResultsError, match=r"computed with other settings \(options.seed "):
        reopened.plan(pipeline, "w4a4", settings_with(pipeline, seed=5), recompute=False)


@pytest.mark.parametrize("pipeline, key", [(p, k) for p in NEUTRAL for k in NEUTRAL[p]])
def test_seeds_differing_only_in_it_average_and_no_table_marks_it(pipeline, key):
    other = settings_with(pipeline, **{key: NEUTRAL[pipeline][key]})
    assert evaluation_difference(result(pipeline, settings_with(pipeline)), result(pipeline, other)) is None
    assert nondefault_settings(pipeline, other) == []
    changed = settings_with(pipeline, seed=5)
    assert evaluation_difference(result(pipeline, settings_with(pipeline)), result(pipeline, changed)) is not None
    assert nondefault_settings(pipeline, changed) == [f"quant.{pipeline}.seed=5"]


def test_the_neutral_names_are_each_pipelines_own():
    """APHQ has no ckpt_every: an option of that name in an APHQ entry is compared."""
    assert comparable_settings({"options": {"ckpt_every": 3}}, "aphq") == {"options": {"ckpt_every": 3}}
    assert comparable_settings({"options": {"ckpt_every": 3}}, "gplq") == {"options": {}}
