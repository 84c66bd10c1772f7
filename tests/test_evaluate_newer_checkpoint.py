"""A checkpoint whose recorded config holds a setting this version of the code does not know (written by a newer
version) is refused by evaluate.py in one `error:` line that names the checkpoint and the likely cause, not a bare
'saved config: unknown config key' that names no file; one whose recorded value this version's checks refuse (an
older version accepted it) is refused as such."""
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


def test_a_recorded_value_this_version_refuses_is_not_called_newer_and_no_override_is_promised(payload, tmp_path,
                                                                                                capsys):
    """A checkpoint of a version before the 0..1 check of data.mean (MMDetection's 0..255 values were accepted then):
    its value is refused by this version's checks, not a sign of a newer version; overrides apply to the recorded
    config once it has passed them, so the error says that an override of data.mean cannot replace it."""
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in payload["config"].items()}
    config["data"]["mean"] = [123.675, 116.28, 103.53]
    older = tmp_path / "old255.pt"
    torch.save({**payload, "config": config}, older)
    out = tmp_path / "r.json"
    code, _, err = run_entry("evaluate.py", ["--checkpoint", str(older), "--quant", "--out", str(out),
                                             "data.mean=[0.485,0.456,0.406]"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {older}: its recorded data.mean is refused by this version's checks")
    assert "123.675" in lines[0] and "newer version" not in lines[0]
    assert "overrides, of data.mean too, apply only to a recorded config that passes them" in lines[0]
    assert not out.exists()
