"""evaluate.py writes its result where --out says (default: beside the checkpoint) and never reads out_dir, train.py's
folder: an out_dir override, or one a --config file sets over a checkpoint's own, is refused in one `error:` line
that names --out, before any file is written; the checkpoint's own out_dir in a --config file, and a weights file's
recipe (its --config files), pass."""
import os

import pytest
import torch

import evaluate
import train
from configs import ConfigError, load_config
from tests.conftest import DEBUG_CONFIG, run_entry


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny synthetic run's folder (best.pt, and the config it records)."""
    out = tmp_path_factory.mktemp("run")
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={out}", "train.max_steps=1", "sched.warmup_epochs=0",
                                            "log.tensorboard=false"]))
    return out


def test_an_out_dir_override_is_refused_in_one_line_and_nothing_is_written_there(run, tmp_path, capsys):
    elsewhere = tmp_path / "zz2"
    code, _, err = run_entry("evaluate.py", ["--checkpoint", str(run / "best.pt"), "--quant",
                                             f"out_dir={elsewhere}"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"error: out_dir={elsewhere}: evaluate.py does not read out_dir")
    assert lines[0].endswith(f"give --out {elsewhere / 'eval_best.json'}")
    # refused before any work: neither the folder it named nor the default result beside the checkpoint
    assert not elsewhere.exists() and not (run / "eval_best.json").exists()


def test_a_config_file_that_moves_out_dir_over_the_checkpoints_own_is_refused(run, tmp_path):
    layer = tmp_path / "layer.yaml"
    layer.write_text(f"out_dir: {tmp_path / 'zz3'}\n")
    with pytest.raises(ConfigError, match=rf"out_dir={tmp_path / 'zz3'} \(--config {layer} sets it over "
                                          rf"{run / 'best.pt'}'s own\): .* give --out {tmp_path / 'zz3'}/eval_best"):
        evaluate.resolve_config(evaluate.parse_args(["--checkpoint", str(run / "best.pt"), "--config", str(layer),
                                                     "--quant"]))
    # the out_dir the checkpoint records, given again by a file (the run's own config.yaml layered on), moves nothing
    same = tmp_path / "same.yaml"
    same.write_text(f"out_dir: {run}\n")
    cfg, _ = evaluate.resolve_config(evaluate.parse_args(["--checkpoint", str(run / "best.pt"), "--config",
                                                          str(same), "--quant"]))
    assert cfg.out_dir == str(run)


def test_a_weights_files_recipe_may_name_an_out_dir_but_an_override_may_not(run, tmp_path):
    weights = tmp_path / "weights.pth"
    torch.save(torch.load(run / "best.pt", weights_only=True)["model"], weights)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(open(DEBUG_CONFIG).read() + f"out_dir: {tmp_path / 'theirs'}\n")
    base = ["--config", str(recipe), f"model.pretrained={weights}", "--quant"]
    cfg, payload = evaluate.resolve_config(evaluate.parse_args(base))  # the recipe's out_dir: the run's, not read
    assert payload is None and cfg.out_dir == str(tmp_path / "theirs")
    with pytest.raises(ConfigError, match=r"evaluate.py does not read out_dir.*give --out .*mine.*vit_nano\.json$"):
        evaluate.resolve_config(evaluate.parse_args([*base, f"out_dir={tmp_path / 'mine'}"]))
    assert not os.path.exists(tmp_path / "mine")
