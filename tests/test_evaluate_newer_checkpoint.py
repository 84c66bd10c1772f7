"""A checkpoint whose recorded config holds a setting this version of the code does not know (written by a newer
version) is refused by evaluate.py in one `error:` line that names the checkpoint and the likely cause, not a bare
'saved config: unknown config key' that names no file."""
import pytest
import torch

import train
from configs import load_config
from tests.conftest import DEBUG_CONFIG, run_entry


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
    """The contents of a tiny synthetic run's best.pt."""
    out = tmp_path_factory.mktemp("run")
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={out}", "train.max_steps=1", "sched.warmup_epochs=0",
                                            "log.tensorboard=false"]))
    return torch.load(out / "best.pt", weights_only=True)


@pytest.mark.parametrize("section, key", [(None, "newkey"), ("model", "new_option")])
def test_a_config_key_of_a_newer_version_names_the_checkpoint_and_the_cause(payload, tmp_path, capsys, section, key):
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in payload["config"].items()}
    (config[section] if section else config)[key] = 1
    newer = tmp_path / "newer.pt"
    torch.save({**payload, "config": config}, newer)
    out = tmp_path / "r.json"
    code, _, err = run_entry("evaluate.py", ["--checkpoint", str(newer), "--quant", "--out", str(out)], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {newer}: its recorded config does not fit this version of the code")
    dotted = f"{section}.{key}" if section else key
    assert f"unknown config key '{dotted}'" in lines[0] and "written by a newer version of the code?" in lines[0]
    assert not out.exists()
