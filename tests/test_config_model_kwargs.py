"""A model.kwargs entry without a value is refused by the config's own checks (configs/constraints.py), before
anything is written or built: timm's create_model drops None arguments, so the model would be built with its
default (depth=null: timm's 12 blocks) while the config and the results record the entry as set."""
import os

import pytest

from configs import ConfigError, load_config
from tests.conftest import DEBUG_CONFIG, ROOT, run_entry

import sweep

FIX = "give it a value, or leave the entry out for the model's own default"


@pytest.mark.parametrize("name", ["vit_nano", "gpt2_nano"])
@pytest.mark.parametrize("override, key", [("model.kwargs.depth=null", "depth"),
                                           ("model.kwargs={bogus_key: null}", "bogus_key")])
def test_loading_a_config_with_a_kwarg_without_a_value_is_refused_naming_it(name, override, key):
    with pytest.raises(ConfigError) as refused:
        load_config([DEBUG_CONFIG], [f"model.name={name}", "model.drop_path=0", override])
    assert str(refused.value) == f"model.kwargs.{key} is null: {FIX}"


def test_a_yaml_mapping_without_a_space_after_the_colon_is_named_as_such():
    with pytest.raises(ConfigError) as refused:
        load_config([DEBUG_CONFIG], ["model.kwargs={num_heads:4}"])
    assert str(refused.value) == ("model.kwargs.num_heads:4 is null (YAML reads 'num_heads:4' as one key without a "
                                  f"value: write a space after the colon, {{num_heads: 4}}): {FIX}")


@pytest.mark.parametrize("print_config", [True, False], ids=["print_config", "start"])
def test_train_refuses_it_in_one_line_before_writing_anything(tmp_path, capsys, print_config):
    out_dir = tmp_path / "run"
    argv = ["--config", DEBUG_CONFIG, f"out_dir={out_dir}", "model.kwargs.depth=null"]
    code, _, err = run_entry("train.py", argv + (["--print-config"] if print_config else []), capsys)
    assert code == 1 and err == f"error: model.kwargs.depth is null: {FIX}\n", err
    assert not out_dir.exists()


def test_the_sweep_check_refuses_it_for_a_language_model_before_any_run():
    """The sweep's model check skips GPT sizes (no timm name to resolve): the entry is refused when the run's
    config loads, as for every model."""
    path = os.path.join(ROOT, "configs", "sweeps", "kjv_lm_dose.yaml")
    with pytest.raises(ConfigError, match=rf"^sweep run 'baseline_s0': model.kwargs.depth is null: {FIX}$"):
        sweep.expand(path, ["model.kwargs.depth=null"])


# an entry's name is text with no empty part between dots: `model.kwargs.=3` reached timm's constructor as the keyword
# '' (refused only once train.py had built the model, its train.log written), `model.kwargs={1: 3}` as a keyword 1
@pytest.mark.parametrize("override, says", [
    ("model.kwargs.=3", "'model.kwargs.' names an entry of model.kwargs with an empty name"),
    ("model.kwargs..depth=3", "'model.kwargs..depth' names an entry of model.kwargs with an empty name"),
    ("model.kwargs.depth.=3", "'model.kwargs.depth.' names an entry of model.kwargs with an empty name"),
    ("model.kwargs={'': 3}", "'model.kwargs' has an entry named '' (str)"),
    ("model.kwargs={1: 3}", "'model.kwargs' has an entry named 1 (int)"),
    ("cd.lam_per_role.=0.1", "'cd.lam_per_role.' names an entry of cd.lam_per_role with an empty name"),
], ids=["empty", "empty part", "empty end", "empty in a mapping", "a number in a mapping", "cd"])
def test_an_entry_without_a_name_is_refused_where_the_override_is_read(tmp_path, capsys, override, says):
    with pytest.raises(ConfigError) as refused:
        load_config([DEBUG_CONFIG], ["cd.enabled=true", override])
    assert str(refused.value).startswith(f"command line: {says}"), refused.value
    out_dir = tmp_path / "run"
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={out_dir}", "cd.enabled=true", override],
                             capsys)
    assert code == 1 and err.count("\n") == 1 and err.startswith(f"error: command line: {says}"), err
    assert not out_dir.exists()


def test_an_entry_without_a_name_in_a_config_file_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  kwargs:\n    '': 3\n")
    with pytest.raises(ConfigError, match=rf"^{path}: 'model.kwargs' has an entry named '' \(str\)"):
        load_config([DEBUG_CONFIG, str(path)])
