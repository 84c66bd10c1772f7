"""Numbers in config files and overrides are read as YAML 1.2 reads them, and a plain scalar that YAML 1.1 reads
as another number (a leading zero: octal; digits with colons: base 60) is refused by a number field, never read
as 8 or 90 without a word."""
import pytest

from configs import ConfigError, load_config
from configs.loader import parse_yaml

TINY = "configs/debug/tiny.yaml"


@pytest.mark.parametrize("text", ["10", "0", "-5", "+7", "0x1F", "0o17", "123456789"])
def test_integers_are_read_as_python_reads_the_literal(text):
    assert parse_yaml(text) == int(text, 0) and type(parse_yaml(text)) is int  # Python's literal: the reference


@pytest.mark.parametrize("text", ["1e-3", "5E4", "1.5", ".5", "010.5", "-2.5e3"])
def test_floats_are_read_as_python_reads_the_literal(text):
    assert parse_yaml(text) == float(text) and type(parse_yaml(text)) is float


@pytest.mark.parametrize("override, yaml11", [("train.seed=010", 8), ("train.seed=-010", -8), ("train.seed=09", None),
                                               ("train.max_steps=1:30", 90), ("optim.lr=1:30.5", 90.5),
                                               ("train.max_steps=1:00:00", 3600)])
def test_a_number_yaml_versions_read_differently_is_refused_naming_the_key(override, yaml11):
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError) as e:
        load_config([TINY], [override])
    message = str(e.value)
    assert message.startswith(f"command line: '{key}' = {value}: ") and "\n" not in message
    if ":" in value:  # the base-60 reading is named, so the fix is plain
        assert f"is {yaml11}" in message
    else:  # both readings named: decimal, and octal where the digits are octal ones
        assert f"write {int(value)} for decimal" in message
        assert (yaml11 is None) == ("octal " not in message.partition("decimal;")[2])
        if yaml11 is not None:
            assert message.endswith(f"for octal {yaml11}")


def test_a_config_files_zero_padded_seed_is_refused(tmp_path):
    path = tmp_path / "seed.yaml"
    path.write_text("train:\n  seed: 010\n")
    with pytest.raises(ConfigError, match=rf"^{path}: 'train.seed' = 010: .*write 10 for decimal, or 0o10 for octal 8"):
        load_config([TINY, str(path)])


def test_a_text_field_takes_the_text_and_a_free_form_entry_is_refused(tmp_path):
    assert load_config([TINY], ["out_dir=010"]).out_dir == "010"
    assert load_config([TINY], ["out_dir=1:30"]).out_dir == "1:30"
    for item in ("model.kwargs.depth=03", "model.kwargs={depth: 03}"):
        with pytest.raises(ConfigError, match=r"^command line: 'model.kwargs.depth' = 03: .*quote it for text"):
            load_config([TINY], [item])
    assert load_config([TINY], ["train.seed=10", "train.max_steps=0o17"]).train.max_steps == 15
