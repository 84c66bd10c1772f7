"""quant/ptq/percentile.py: a refused percentile level names the option that gave it, and the fix.

The levels were checked only by quant/ranges.py's RangeSearch, which knows neither the operand nor the key: `error:
quant.percentile: percentile levels must lie in (0.5, 1], got (0.3,)` for weight_percentiles=[0.3] beside a valid
act_percentiles, and `method 'percentile' takes exactly one level` (RangeSearch's name for weight_range=percentile).
PercentilePipeline.check now refuses each operand's levels with its keys. The reference is the tests' own: which
operand's options were set, and the interval (0.5, 1] of upper quantiles p whose range [q(1 - p), q(p)] is not empty.
"""
import pytest

import train
from configs import ConfigError, load_config
from quant import PIPELINES
from quant.plan import check_quant_plan
from quant.spec import Bits
from tests.conftest import DEBUG_CONFIG

OTHER = {"act": "weight", "weight": "act"}


def refusal(options: dict) -> str:
    """The ValueError PercentilePipeline.validate raises for `options` at w4a4 ('' where none)."""
    pipeline = PIPELINES["percentile"]
    try:
        pipeline.validate(Bits(4, 4), pipeline.Options(**options))
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("operand", ["act", "weight"])
@pytest.mark.parametrize("levels", [[0.3], [0.5], [0.999, 1.5], [0.0], [-0.9999]])
def test_a_level_outside_the_upper_half_names_its_operands_key(operand, levels):
    # the other operand's levels are valid: the error is of this operand's, named by its key, with the fix
    message = refusal({f"{operand}_percentiles": tuple(levels), f"{OTHER[operand]}_percentiles": (0.99,)})
    assert message.startswith(f"{operand}_percentiles={levels}: each level p must lie in (0.5, 1]"), message
    assert "or null for the default" in message


@pytest.mark.parametrize("operand", ["act", "weight"])
def test_several_levels_for_one_fixed_percentile_name_the_range_key(operand):
    message = refusal({f"{operand}_range": "percentile", f"{operand}_percentiles": (0.9, 0.99)})
    assert message.startswith(f"{operand}_range=percentile takes one level, {operand}_percentiles=[0.9, 0.99] "
                              f"gives 2"), message
    assert f"{operand}_range=percentile_mse" in message  # the fix: or choose among them


@pytest.mark.parametrize("options", [{"act_percentiles": (0.5000001, 1.0), "weight_percentiles": (1.0,)},
                                     {"act_range": "percentile", "act_percentiles": (0.99,),
                                      "weight_range": "percentile", "weight_percentiles": (0.9999,)},
                                     {"weight_range": "percentile"}, {}])
def test_levels_in_the_upper_half_pass(options):
    assert refusal(options) == ""


def test_train_refuses_a_bad_level_before_it_trains(tmp_path):
    """The run's quant.percentile settings are its evaluation's: refused from the config, before the run's folder."""
    out = tmp_path / "run"
    cfg = load_config([DEBUG_CONFIG], [f"out_dir={out}", "quant.percentile.act_percentiles=[0.99]",
                                       "quant.percentile.weight_percentiles=[0.3]"])
    with pytest.raises(ConfigError, match=r"^quant\.percentile: weight_percentiles=\[0\.3\]: each level"):
        check_quant_plan(cfg)
    with pytest.raises(ConfigError, match=r"quant\.percentile: weight_percentiles=\[0\.3\]"):
        train.main(cfg)
    assert not out.exists()


def test_results_record_the_levels_used_and_read_an_older_null_as_the_default_of_then(monkeypatch):
    """A null level means the range rule's default (quant.ranges.range_search). Recorded as null, a result computed at
    today's default would read as one of any later default: the settings now hold the levels used, in the result's
    settings and report alike, and an entry written with null compares as the levels null meant then (the constants
    of the range rules: 0.9999 for percentile, RepQ-ViT's {0.999, 0.9999, 0.99999} for percentile_mse); minmax reads
    none and records null."""
    import quant.ptq.percentile as percentile
    from configs import Config
    from engine.eval_results import as_stored, settings_change
    from engine.quant_settings import quant_settings
    from engine.result_table import nondefault_settings
    from quant.ranges import RangeSearch
    from quant_models import images, tiny_vit

    repq, fixed = [0.999, 0.9999, 0.99999], [0.9999]
    cfg = load_config(None, ["quant.percentile.weight_range=percentile", "data.dataset=digits"])
    settings = as_stored(quant_settings(cfg, "percentile"))  # as the result file holds it
    assert (settings["options"]["act_percentiles"], settings["options"]["weight_percentiles"]) == (repq, fixed)
    minmax = as_stored(quant_settings(load_config(None, ["quant.percentile.act_range=minmax", "data.dataset=digits"]),
                                      "percentile"))["options"]
    assert minmax["act_percentiles"] is None and minmax["weight_percentiles"] == repq
    _, report = PIPELINES["percentile"](tiny_vit(depth=1), images(2), "w4a4", {"weight_range": "percentile"})
    assert (list(report["options"]["act_percentiles"]), list(report["options"]["weight_percentiles"])) == (repq, fixed)

    older = {"settings": {**settings, "options": {**settings["options"], "act_percentiles": None,
                                                  "weight_percentiles": None}}}
    assert settings_change(older, settings, "percentile") is None  # null meant the levels used now
    assert nondefault_settings("percentile", older["settings"]) == ["quant.percentile.weight_range=percentile"]
    assert nondefault_settings("percentile", quant_settings(Config(), "percentile", files=False)) == []
    assert nondefault_settings("percentile", {"options": minmax}) == ["quant.percentile.act_range=minmax"]
    # a hand-edited rule no RangeSearch knows is named, not a traceback of the table
    edited = {"options": {"act_range": "bogus", "act_percentiles": None}}
    assert nondefault_settings("percentile", edited) == ["quant.percentile.act_range=bogus"]
    given = quant_settings(load_config(None, ["quant.percentile.act_percentiles=[0.99]"]), "percentile", files=False)
    assert nondefault_settings("percentile", given) == ["quant.percentile.act_percentiles=[0.99]"]

    # a later default: a result recorded now, and an older null, read as computed with other levels
    monkeypatch.setattr(percentile, "range_search",
                        lambda method, levels: RangeSearch(method, tuple(levels or (0.99,))))
    later = quant_settings(cfg, "percentile")
    assert later["options"]["act_percentiles"] == (0.99,)
    for entry in ({"settings": settings}, older):
        assert "act_percentiles" in settings_change(entry, later, "percentile")
