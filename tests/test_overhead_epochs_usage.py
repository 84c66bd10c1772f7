"""scripts/overhead_epochs.py refuses what its flags refuse on their own as a usage error, as argparse's (one `error:`
line, status 2), before any config is read or any model built: --batches and --models both given empty (an
override after --models is an override, not a model) leave nothing to measure."""
from __future__ import annotations

import pytest

from tests.conftest import ROOT, load_script


@pytest.mark.parametrize("flags", [["--batches", "--models"],
                                   ["--models", "data.synthetic_train_size=32", "--batches"]])
def test_both_sweeps_empty_is_a_usage_error_before_any_config_is_read(flags, tmp_path, monkeypatch, capsys):
    """It exited 1 (sys.exit with the line) after the recipe was loaded."""
    import configs

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(configs, "load_config", lambda *a, **k: pytest.fail("a config was read"))
    out = tmp_path / "ep"
    with pytest.raises(SystemExit) as refused:
        load_script("overhead_epochs").main(["--recipe", "configs/debug/tiny.yaml", *flags, "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1, (refused.value.code, lines)
    assert lines[0].startswith("error: ") and "--batches and --models are both empty" in lines[0], lines
    assert not out.exists()
