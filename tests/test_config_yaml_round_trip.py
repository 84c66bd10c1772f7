"""Every config written (a run's config.yaml, --print-config) is read back by --config as it was: text that a YAML
reader could take for a number, a date or a boolean is quoted. The loader reads numbers as YAML 1.2 does (`1e-3`,
`5E4`, `0o17`, `+.5e3` are numbers), PyYAML's safe_dump quoted by YAML 1.1 only, so a run in the folder '1e-3'
wrote `out_dir: 1e-3` and its config.yaml was refused by --config (a float for a text field)."""
import pytest
import yaml

from configs import config_to_dict, load_config
from configs.cli import print_config
from engine.run_dir import save_config_history
from tests.conftest import DEBUG_CONFIG

# text that YAML 1.2 (the loader), YAML 1.1 (PyYAML's safe_load) or both read as something else when unquoted
NUMBER_LIKE = ["1e-3", "5E4", "0o17", "+.5e3", ".5", "1_000", "0x1f", "+0x1F", "0b101", "010", "1:30", "190:20:30.15",
               "2024-01-31", "on", "yes", "null", "true", ".inf", "-.NaN"]


def quoted(text: str) -> str:
    """`text` as a single-quoted YAML scalar: one override value that is that string whatever its characters."""
    return "'" + text.replace("'", "''") + "'"


@pytest.mark.parametrize("text", NUMBER_LIKE)
def test_print_config_and_config_yaml_read_back_text_as_text(tmp_path, capsys, text):
    cfg = load_config([DEBUG_CONFIG], [f"out_dir={quoted(text)}", "log.wandb=true", f"log.wandb_project={quoted(text)}",
                                       f"model.kwargs.note={quoted(text)}"])
    assert cfg.out_dir == text  # as given: the reference every copy below is compared with

    print_config(cfg)
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    save_config_history(str(tmp_path), config_to_dict(cfg), step=0)
    for path in (printed, tmp_path / "config.yaml"):
        again = load_config([str(path)])
        assert (again.out_dir, again.log.wandb_project, again.model.kwargs["note"]) == (text, text, text), path
        assert config_to_dict(again) == config_to_dict(cfg)
        # PyYAML's own reading (a user's script; engine/run_dir.py's saved_config) takes it as text too
        saved = yaml.safe_load(path.read_text())
        assert (saved["out_dir"], saved["log"]["wandb_project"], saved["model"]["kwargs"]["note"]) == (text, text, text)


def test_numbers_booleans_and_null_are_written_as_themselves():
    """The quoting is of text only: a number, a boolean and null are written plain, as YAML reads them back."""
    from configs.loader import dump_yaml

    cfg = load_config([DEBUG_CONFIG], ["optim.lr=1e-3", "train.max_steps=7", "optim.clip_grad=null",
                                       "log.tensorboard=false"])
    text = dump_yaml(config_to_dict(cfg), sort_keys=False)
    assert "  lr: 0.001\n" in text and "  max_steps: 7\n" in text
    assert "  clip_grad: null\n" in text and "  tensorboard: false\n" in text
