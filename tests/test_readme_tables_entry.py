"""scripts/readme_tables.py is a library of scripts/cd_families.py and scripts/quant_scope.py: run on its own (as
every file in scripts/ may be), it says so in one error line instead of ending in an import traceback; so do the
other libraries in scripts/."""
import os
import re
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


@pytest.mark.parametrize("library", ["bench_env", "training_title", "launchers", "overhead_run_folders"])
def test_every_library_in_scripts_says_so_in_one_line(tmp_path, library):
    """The other libraries in scripts/ exited 0 without a word (bench_env, training_title) or in an import
    traceback (launchers, overhead_run_folders) on any command line. The scripts each names import it."""
    done = subprocess.run([sys.executable, f"{ROOT}/scripts/{library}.py", "--frobnicate"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and not done.stdout and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: scripts/{library}.py is a library used by "), lines
    named = re.findall(r"(\w+)\.py", lines[0].split(" used by ", 1)[1])
    assert named, lines
    for user in named:
        source = open(os.path.join(ROOT, "scripts", f"{user}.py")).read()
        assert re.search(rf"^\s*(from (scripts\.)?{library} import|import (scripts\.)?{library}\b)", source, re.M), (
            user, library)
