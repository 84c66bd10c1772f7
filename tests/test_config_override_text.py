"""An override's value is read as YAML, which takes some text for something else: `out_dir=|` and `out_dir=>` are
block scalars with no lines (the empty string, which train.py replaces by runs/<recipe>), `data.val_split=2012` a
number, `out_dir=2024-01-31` a date, `log.wandb_project=on` a boolean. Each is refused with one line that names the
override and says how to quote it, and the quoted override it suggests gives the field that text."""
import os
import re

import pytest

from configs import ConfigError, load_config
from tests.conftest import DEBUG_CONFIG

FOLDER_DATA = ["data.dataset=folder", "data.root=/datasets/imagenet"]  # where data.val_split is read
WANDB = ["log.wandb=true"]  # where log.wandb_project is read


def suggested(message: str, key: str) -> str:
    """The override `key='...'` that `message` suggests (a YAML single-quoted value, '' for a quote inside)."""
    found = re.search(rf"\({re.escape(key)}=('(?:[^']|'')*'), inside the shell's quotes\)", message)
    assert found, message
    return f"{key}={found.group(1)}"


def refusal(overrides: list) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config([DEBUG_CONFIG], overrides)
    message = str(raised.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("raw", ["|", ">", "|-", ">+", "!!str"])
def test_an_override_yaml_reads_as_empty_text_is_refused_and_its_quoted_form_keeps_the_text(raw):
    message = refusal([f"out_dir={raw}"])
    assert message.startswith(f"override 'out_dir={raw}': "), message
    fixed = load_config([DEBUG_CONFIG], [suggested(message, "out_dir")])
    assert fixed.out_dir == raw


@pytest.mark.parametrize("raw", ["", "  ", "''", '""'])
def test_an_empty_value_given_as_one_stays_empty(raw):
    assert load_config([DEBUG_CONFIG], [f"out_dir={raw}"]).out_dir == ""


@pytest.mark.parametrize("key, raw, context", [
    ("data.val_split", "2012", FOLDER_DATA),
    ("out_dir", "2024-01-31", []),
    ("log.wandb_project", "on", WANDB),
    ("log.wandb_project", "1e-3", WANDB),  # the float 0.001: the quoted form keeps the text as typed
], ids=["int", "date", "bool", "float"])
def test_text_yaml_reads_as_a_number_date_or_boolean_is_refused_with_its_quoted_form(key, raw, context):
    message = refusal([*context, f"{key}={raw}"])
    assert message.startswith(f"command line: '{key}' expects str, got "), message
    fixed = load_config([DEBUG_CONFIG], [*context, suggested(message, key)])
    section, _, name = key.rpartition(".")
    assert getattr(getattr(fixed, section) if section else fixed, name) == raw


def test_a_number_in_a_config_file_for_a_text_field_is_refused_with_the_quoted_text(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("data:\n  dataset: folder\n  root: /datasets/imagenet\n  val_split: 2012\n")
    with pytest.raises(ConfigError) as raised:
        load_config([DEBUG_CONFIG, str(recipe)])
    assert str(raised.value).endswith("expects str, got 2012 (int); quote it to keep it as text: '2012'")


def test_a_number_for_a_number_field_and_null_for_a_text_field_get_no_advice_to_quote():
    assert "quote" not in refusal(["optim.lr=abc"])
    assert "quote" not in refusal(["out_dir=null"])


def test_a_bare_tilde_for_a_path_is_refused_with_the_quoted_form_that_reads_as_the_home_folder():
    """YAML reads `~` as null: `out_dir=~` (the README: a path key's leading ~ is the home folder) was refused as
    'expects ..., got None' without saying why or how to give the home folder."""
    message = refusal(["out_dir=~"])
    assert message.startswith("override 'out_dir=~': ") and "null" in message, message
    assert load_config([DEBUG_CONFIG], [suggested(message, "out_dir")]).out_dir == os.path.expanduser("~")
    assert "quote" not in refusal(["out_dir=null"])  # null written as such: the type error alone


@pytest.mark.parametrize("item", ["sched.epochs=~", "optim.weight_decay=~", "cd.lam=~"])
def test_a_bare_tilde_for_a_number_field_gets_no_advice_to_quote_it(item):
    """A number field takes no text: quoting its '~' (the tilde advice of a path key) would be refused in turn."""
    message = refusal([item])
    assert "quote" not in message and message.startswith(f"command line: '{item[:-2]}' expects "), message
