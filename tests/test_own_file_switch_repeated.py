"""A --config file that sets a switch false beside an option it leaves unread (a run's own config.yaml written with
train.ema=false and train.ema_decay) says what it means, and keeps saying it when a later layer repeats the switch's
value (`--config <run>/config.yaml train.ema=false`); README.md: "as does a file that sets the deciding key". An option
alone in a file, under a switch that only a later layer gives, stays refused, as does the pair given as overrides."""
import pytest
import yaml

from configs import load_config
from configs.loader import ConfigError
from tests.conftest import DEMO_CONFIG

# (a file setting a step's switch false and its option, the switch, the option's dotted key, the option's value)
PAIRS = [
    ("train: {ema: false, ema_decay: 0.999}\n", "train.ema", "train.ema_decay", 0.999),
    ("quant: {gplq: {matmul_operands: false, matmul_percentile: 0.9}}\n", "quant.gplq.matmul_operands",
     "quant.gplq.matmul_percentile", 0.9),
    ("quant: {aphq: {mlp_reconstruct: false, mlp_lr: 0.1}}\n", "quant.aphq.mlp_reconstruct", "quant.aphq.mlp_lr", 0.1),
]


def value_of(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def nested(dotted, value):
    """{"train": {"ema": False}} for ("train.ema", False): a YAML layer setting one key."""
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


@pytest.mark.parametrize("text, switch, option, value", PAIRS)
def test_a_files_own_switch_repeated_by_a_later_layer_passes(tmp_path, text, switch, option, value):
    own = tmp_path / "config.yaml"
    own.write_text(text)
    repeat = tmp_path / "repeat.yaml"
    repeat.write_text(yaml.safe_dump(nested(switch, False)))
    for overrides, files in (([], [own]), ([f"{switch}=false"], [own]), ([], [own, repeat])):
        cfg = load_config([DEMO_CONFIG, *map(str, files)], overrides)
        assert value_of(cfg, switch) is False and value_of(cfg, option) == value


@pytest.mark.parametrize("text, switch, option, value",
                         [pair for pair in PAIRS if pair[1] != "quant.gplq.matmul_operands"])
def test_the_option_alone_in_a_file_or_beside_its_switch_as_overrides_stays_refused(tmp_path, text, switch, option,
                                                                                    value):
    """Switches false by default: the override repeats the value the file's option was already unread under (a
    switch true by default and given false by a later layer makes the option moot on purpose, as a recipe does)."""
    assert value_of(load_config([DEMO_CONFIG], []), switch) is False
    alone = tmp_path / "alone.yaml"
    alone.write_text(yaml.safe_dump(nested(option, value)))
    with pytest.raises(ConfigError, match=rf"^{alone}: {option}={value} would be ignored"):
        load_config([DEMO_CONFIG, str(alone)], [f"{switch}=false"])
    with pytest.raises(ConfigError, match=rf"^{option}={value} would be ignored"):
        load_config([DEMO_CONFIG], [f"{switch}=false", f"{option}={value}"])
