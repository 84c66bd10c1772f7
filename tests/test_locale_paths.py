"""Paths under a locale without UTF-8 (LC_ALL=C with PYTHONUTF8=0, a Latin-1 locale): a path in a config file
that the file-system encoding cannot spell, or a command line whose bytes the locale cannot decode, is one
`error:` line naming the key and the fix, not a UnicodeEncodeError traceback from os.makedirs. A run's saved
config (a checkpoint's) keeps the paths of the machine it was saved on and is not refused for them."""
import os

import pytest

from configs import ConfigError, config_from_dict, config_to_dict, load_config
from configs.constraints import LOCALE_FIX, nameable
from conftest import DEBUG_CONFIG


@pytest.fixture
def ascii_file_system(monkeypatch):
    """os.fsencode as Python has it when the locale is C and UTF-8 mode is off: ASCII, with the bytes it could
    not decode (PEP 383 surrogates) passed back as they came."""
    monkeypatch.setattr(os, "fsencode", lambda path: path.encode("ascii", "surrogateescape"))


def test_a_config_path_the_file_system_cannot_spell_is_refused_with_the_fix(tmp_path, ascii_file_system):
    recipe = tmp_path / "out.yaml"
    recipe.write_text('out_dir: "/runs/m\\u00fcller"\n', encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config([DEBUG_CONFIG, str(recipe)])
    assert str(e.value).startswith(f"{recipe}: 'out_dir' must be a path ") and LOCALE_FIX in str(e.value)
    with pytest.raises(ConfigError, match="'model.pretrained' must be a path .*PYTHONUTF8=1"):
        load_config([DEBUG_CONFIG], ["model.pretrained=/weights/\u00fc.pt"])
    assert load_config([DEBUG_CONFIG], ["out_dir=/runs/plain"]).out_dir == "/runs/plain"
    # the bytes of a command line the locale could not decode go back to the file system as they came
    assert nameable("/runs/\udcc3\udcbc") and not nameable("/runs/\u00fc")

def test_a_command_line_the_locale_cannot_decode_is_refused_with_the_fix(ascii_file_system):
    """`out_dir=/runs/ü` typed in a UTF-8 terminal under LC_ALL=C: Python decodes its bytes to surrogates,
    which the YAML reader refused as 'unacceptable character #xdcc3'."""
    with pytest.raises(ConfigError) as e:
        load_config([DEBUG_CONFIG], ["out_dir=/runs/\udcc3\udcbc"])
    assert "the command line has bytes the locale's encoding" in str(e.value) and LOCALE_FIX in str(e.value)


def test_a_saved_config_keeps_paths_of_the_machine_it_was_saved_on(ascii_file_system):
    saved = config_to_dict(load_config([DEBUG_CONFIG]))
    saved["out_dir"] = "/runs/m\u00fcller"
    assert config_from_dict(saved).out_dir == "/runs/m\u00fcller"
