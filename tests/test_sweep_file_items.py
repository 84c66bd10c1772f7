"""A sweep file's lists hold strings: a run given as a mapping, or a nested list or a mapping among 'configs',
'evaluate' or 'run_keys', is refused naming the field, and the example the error gives, pasted into the file, is
accepted and sets what the refused item meant."""
from __future__ import annotations

import os
import re
import sys
import types

import pytest

import sweep
from configs import ConfigError, load_config
from configs.loader import get_key
from tests.conftest import ROOT

TINY = "configs: [configs/debug/tiny.yaml]\n"


def suggestion(error: str, field: str) -> str:
    """The `field: [...]` example an error gives."""
    found = re.search(rf"e\.g\. ({re.escape(field)}: \[.*\])(, not |$)", error)
    assert found, error
    return found.group(1)


@pytest.mark.parametrize("run, meant", [
    ("{optim.lr: 0.001}", {"optim.lr": 0.001}),
    ("{optim: {lr: 0.001}, train.seed: 1}", {"optim.lr": 0.001, "train.seed": 1}),  # a section as a mapping
    ("train.seed=3", {"train.seed": 3}),
])
def test_a_run_given_as_a_mapping_or_a_string_is_refused_with_an_example_that_is_accepted(tmp_path, run, meant):
    """`a: {optim.lr: 0.001}` suggested `a: [{'optim.lr': 0.001}]`, which is refused in its turn."""
    spec = tmp_path / "s.yaml"
    spec.write_text(f"{TINY}out_root: {tmp_path}/runs\nruns:\n  a: {run}\n")
    with pytest.raises(ConfigError, match=r"run 'a' must list its config files and overrides") as refused:
        sweep.expand(str(spec), [])
    spec.write_text(f"{TINY}out_root: {tmp_path}/runs\nruns:\n  {suggestion(str(refused.value), 'a')}\n")
    (run,) = sweep.expand(str(spec), [])
    cfg = load_config([os.path.join(ROOT, c) for c in run["configs"]], run["overrides"])
    assert {key: get_key(cfg, key) for key in meant} == meant


@pytest.mark.parametrize("field, value", [
    ("configs", "[[configs/debug/tiny.yaml]]"),
    ("configs", "[{configs/debug/tiny.yaml: 1}]"),
    ("evaluate", "[{quant.pipelines: [repq]}]"),
    ("evaluate", "[[quant.calib_images=8]]"),
    ("run_keys", "[[data.root]]"),
])
def test_a_list_item_that_is_no_string_is_refused_naming_the_field(tmp_path, field, value):
    """configs: [[tiny.yaml]] was read as the file "['configs/debug/tiny.yaml']" (config file not found)."""
    fields = {"configs": "[configs/debug/tiny.yaml]", field: value}
    spec = tmp_path / "s.yaml"
    spec.write_text("".join(f"{k}: {v}\n" for k, v in fields.items()) + f"out_root: {tmp_path}/runs\nruns:\n  a: []\n")
    with pytest.raises(ConfigError, match=rf"'{field}' lists .*, a YAML (list|dict); its items are ") as refused:
        sweep.expand(str(spec), [])
    assert "not found" not in str(refused.value)
    if field == "configs" and "{" in value:
        return  # a mapping for a config file has no file to suggest: the example is another recipe
    fields[field] = suggestion(str(refused.value), field).split(": ", 1)[1]
    spec.write_text("".join(f"{k}: {v}\n" for k, v in fields.items()) + f"out_root: {tmp_path}/runs\nruns:\n  a: []\n")
    (run,) = sweep.expand(str(spec), [])
    if field == "configs":
        assert run["configs"] == ["configs/debug/tiny.yaml"]
    elif field == "evaluate":  # the override the item meant, as evaluate.py reads it
        (item,) = run["evaluate"]
        cfg = load_config([os.path.join(ROOT, "configs/debug/tiny.yaml")], [item])
        assert (cfg.quant.pipelines == ["repq"]) if "pipelines" in value else (cfg.quant.calib_images == 8)
    else:  # the key is guarded: an override of it for the whole sweep is refused
        with pytest.raises(ConfigError, match=r"data.root=/x would replace a key that each run sets itself"):
            sweep.expand(str(spec), ["data.root=/x"])


def test_an_override_whose_value_ends_in_yaml_is_an_override_and_a_path_with_an_equals_sign_a_file(tmp_path,
                                                                                                    monkeypatch):
    """`log.wandb_project=x.yaml` was taken for a config file (config file not found: .../log.wandb_project=x.yaml)."""
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))  # log.wandb=true checks it is installed
    recipe = tmp_path / "lr=1e-3"
    recipe.mkdir()
    (recipe / "r.yaml").write_text("optim:\n  lr: 0.002\n")
    spec = tmp_path / "s.yaml"
    items = f"[log.wandb=true, log.wandb_project=x.yaml, {recipe}/r.yaml]"
    spec.write_text(f"{TINY}out_root: {tmp_path}/runs\nruns:\n  a: {items}\n")
    (run,) = sweep.expand(str(spec), [])
    assert run["configs"] == ["configs/debug/tiny.yaml", f"{recipe}/r.yaml"]
    cfg = load_config([os.path.join(ROOT, c) for c in run["configs"]], run["overrides"])
    assert (cfg.log.wandb_project, cfg.optim.lr) == ("x.yaml", 0.002)
