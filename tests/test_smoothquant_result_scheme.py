"""SmoothQuant's per-tensor weights give a fused qkv one max-abs scale per q / k / v projection
(quant/smoothquant/fused_qkv.py); before, one scale covered the fused weight, under the same options. A result file
entry of the one-scale scheme is no result of the current one: it is refused as computed with other settings
(--recompute replaces it) and not averaged with a new one, while per-channel results, the same in both schemes,
are reused as they were written."""
import dataclasses
import json

import pytest

from configs import Config
from configs.loader import apply_overrides
from engine.eval_results import EvalResults, ResultsError, evaluation_difference
from engine.quant_settings import quant_settings
from engine.result_table import nondefault_settings
from quant.plan import pipeline_options

PIPELINES = ("smoothquant", "smoothquant_strict")


def plain(value):
    return json.loads(json.dumps(value, default=str))


def one_scale_entry(pipeline: str, granularity: str) -> dict:
    """The settings evaluate.py recorded before the per-projection scales: the options and the calibration batch,
    nothing else."""
    cfg = apply_overrides(Config(), [f"quant.{pipeline}.weight_granularity={granularity}"])
    now = plain(quant_settings(cfg, pipeline))
    return {"options": plain(dataclasses.asdict(pipeline_options(cfg, pipeline))), "calibration": now["calibration"]}


def stored(tmp_path, pipeline: str, settings: dict) -> EvalResults:
    results = EvalResults.open(str(tmp_path / "r.json"), {"model": "m"})
    results.add(pipeline, "w8a8", {"ppl": 1.4014854}, settings)
    results.save()
    return EvalResults.open(str(tmp_path / "r.json"), {"model": "m"})


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_a_one_scale_tensor_entry_is_refused_as_other_settings(pipeline, tmp_path):
    now = quant_settings(apply_overrides(Config(), [f"quant.{pipeline}.weight_granularity=tensor"]), pipeline)
    results = stored(tmp_path, pipeline, one_scale_entry(pipeline, "tensor"))
    with pytest.raises(ResultsError, match=r"computed with other settings \(qkv_weight_scales None -> "
                                           r"'per_projection'\).*--recompute"):
        results.plan(pipeline, "w8a8", now, recompute=False)
    assert results.plan(pipeline, "w8a8", now, recompute=True) is True
    old = {"model": "m", "quant": {pipeline: {"w8a8": {"settings": one_scale_entry(pipeline, "tensor")}}}}
    new = {"model": "m", "quant": {pipeline: {"w8a8": {"settings": plain(now)}}}}
    difference = evaluation_difference(old, new)
    assert difference is not None and difference.of_settings and "qkv_weight_scales" in difference.detail


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_a_per_channel_entry_is_reused_as_it_was_written(pipeline, tmp_path):
    now = quant_settings(Config(), pipeline)
    assert "qkv_weight_scales" not in now
    assert stored(tmp_path, pipeline, one_scale_entry(pipeline, "channel")).plan(pipeline, "w8a8", now, False) is False


def test_tables_mark_the_tensor_result_by_its_option_alone():
    """The scheme is no option: a table's note names weight_granularity=tensor, as it did."""
    now = quant_settings(apply_overrides(Config(), ["quant.smoothquant.weight_granularity=tensor"]), "smoothquant")
    assert nondefault_settings("smoothquant", now) == ["quant.smoothquant.weight_granularity=tensor"]
