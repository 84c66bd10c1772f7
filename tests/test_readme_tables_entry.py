"""scripts/readme_tables.py is a library of scripts/cd_families.py and scripts/quant_scope.py: run on its own (as
every file in scripts/ may be), it says so in one error line instead of ending in an import traceback."""
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("argv", [[], ["--help"]])
def test_running_the_library_says_which_scripts_use_it(tmp_path, argv):
    # from another folder: the repository root is not the working folder's
    done = subprocess.run([sys.executable, f"{ROOT}/scripts/readme_tables.py", *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and not done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: scripts/readme_tables.py is a library"), done.stderr
    assert "scripts/cd_families.py" in lines[0] and "scripts/quant_scope.py" in lines[0]
