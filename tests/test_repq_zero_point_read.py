"""RepQ-ViT's round_zero_point is read only by the LayerNorm fold (quant/reparam.py fold_layernorm): with
reparam=false nothing reads it, so a value given for it is refused instead of being recorded as a setting."""
import pytest

from configs import load_config
from configs.loader import ConfigError
from configs.quant import RepQOptions
from quant import PIPELINES
from quant.pipeline_base import parse_options
from quant.spec import parse_bits
from tests.conftest import DEMO_CONFIG, run_entry


def test_round_zero_point_over_a_recipe_without_the_fold_is_refused(tmp_path):
    recipe = tmp_path / "no_fold.yaml"
    recipe.write_text("quant:\n  repq:\n    reparam: false\n")
    refused = r"quant\.repq\.round_zero_point=true would be ignored: .*quant\.repq\.reparam"
    with pytest.raises(ConfigError, match=refused):
        load_config([str(recipe)], ["quant.repq.round_zero_point=true"])
    cfg = load_config([str(recipe)], ["quant.repq.reparam=true", "quant.repq.round_zero_point=true"])
    assert cfg.quant.repq.reparam and cfg.quant.repq.round_zero_point


def test_round_zero_point_without_the_fold_is_refused_through_the_api():
    """A mapping is refused by the config rules (the switch of one step given as false excuses nothing); a
    RepQOptions handed over as it is, by the pipeline's own check of the non-default value."""
    pipeline = PIPELINES["repq"]
    with pytest.raises(ValueError, match=r"^quant\.repq\.round_zero_point=true would be ignored: "
                                         r".*quant\.repq\.reparam"):
        parse_options(pipeline.Options, {"reparam": False, "round_zero_point": True})
    with pytest.raises(ValueError, match="round_zero_point=True is read only by the LayerNorm fold.*reparam=False"):
        pipeline.validate(parse_bits("w4a4"), parse_options(pipeline.Options,
                                                            RepQOptions(reparam=False, round_zero_point=True)))


def test_round_zero_point_with_the_fold_or_at_its_default_passes():
    pipeline = PIPELINES["repq"]
    for options in ({"reparam": True, "round_zero_point": True}, RepQOptions(reparam=False, round_zero_point=False),
                    {"reparam": False}):
        pipeline.validate(parse_bits("w4a4"), parse_options(pipeline.Options, options))


def test_evaluate_refuses_it_in_one_error_line(tmp_path, capsys):
    """The reviewer's command line: one `error:` line naming the option and the fix, before any work (the weights
    file is never opened)."""
    code, _, err = run_entry("evaluate.py", ["--config", DEMO_CONFIG, f"model.pretrained={tmp_path / 'w.pt'}",
                                             "--quant", "repq", "quant.repq.reparam=false",
                                             "quant.repq.round_zero_point=true", "--out", str(tmp_path / "r.json")],
                             capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, err
    assert lines[0].startswith("error: quant.repq.round_zero_point=true would be ignored: "
                               "quant.repq.round_zero_point is read only when quant.repq.reparam is true") \
        and "drop it" in lines[0], err
