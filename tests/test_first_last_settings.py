"""A quantized result's stem / head bit-widths are compared as the bit-widths they ran at.

A null stem_w_bits / stem_a_bits / head_w_bits / head_a_bits means the entry's main weight or activation bits
(configs/quant.py FirstLastOptions.resolved): at w4a4 a null head_w_bits and head_w_bits=4 quantize the head alike,
and at w8a8 quant.first_last=w8a8 (stem and head W8A8) runs what the official null stem / head bits run. The entries
were compared as recorded (null against 4 or 8), so evaluate.py refused to reuse an identical result ("computed with
other settings") and the tables marked it as computed with non-default settings. The reference is the layout each
setting builds: the quantizers of the stem and the head that the pipeline reports having run with.
"""
import pytest

from configs import load_config
from engine.eval_results import as_stored, settings_change
from engine.quant_settings import quant_settings
from engine.result_table import nondefault_settings
from quant import PIPELINES
from quant.plan import pipeline_options
from quant_models import images, tiny_vit


def stem_and_head(pipeline: str, bits: str, overrides: list) -> dict:
    """What the stem and the head are quantized with when the pipeline runs with the options these overrides record
    (its report's per-role summary on a tiny ViT)."""
    cfg = load_config(None, ["data.dataset=digits", *overrides])
    _, report = PIPELINES[pipeline](tiny_vit(depth=1), images(2), bits, pipeline_options(cfg, pipeline))
    return {role: report["summary"][role] for role in ("stem", "head")}


def settings(pipeline: str, overrides: list) -> dict:
    return as_stored(quant_settings(load_config(None, ["data.dataset=digits", *overrides]), pipeline))


@pytest.mark.parametrize("pipeline", ["percentile", "repq"])
@pytest.mark.parametrize("bits, overrides", [
    ("w8a8", ["quant.first_last=w8a8"]),
    ("w4a4", ["quant.{p}.head_w_bits=4", "quant.{p}.head_a_bits=4", "quant.{p}.stem_w_bits=4"]),
])
def test_stem_and_head_bits_that_run_alike_are_the_same_settings(pipeline, bits, overrides):
    given = [o.format(p=pipeline) for o in overrides]
    assert stem_and_head(pipeline, bits, given) == stem_and_head(pipeline, bits, [])  # the same layout runs
    official, typed = settings(pipeline, []), settings(pipeline, given)
    assert settings_change({"settings": official}, typed, pipeline, bits=bits) is None
    assert settings_change({"settings": typed}, official, pipeline, bits=bits) is None
    assert nondefault_settings(pipeline, typed, bits) == []


@pytest.mark.parametrize("pipeline", ["percentile", "repq"])
def test_stem_and_head_bits_that_run_otherwise_still_differ(pipeline):
    official, w8a8 = settings(pipeline, []), settings(pipeline, ["quant.first_last=w8a8"])
    assert stem_and_head(pipeline, "w4a4", ["quant.first_last=w8a8"]) != stem_and_head(pipeline, "w4a4", [])
    change = settings_change({"settings": official}, w8a8, pipeline, bits="w4a4")
    assert change is not None and "head_w_bits" in change and "stem_w_bits" in change
    assert f"quant.{pipeline}.head_a_bits=8" in nondefault_settings(pipeline, w8a8, "w4a4")
    # a float stem input (0) is no main bit-width
    floated = settings(pipeline, [f"quant.{pipeline}.stem_a_bits=0"])
    assert "stem_a_bits" in settings_change({"settings": official}, floated, pipeline, bits="w8a8")
    assert nondefault_settings(pipeline, floated, "w8a8") == [f"quant.{pipeline}.stem_a_bits=0"]
