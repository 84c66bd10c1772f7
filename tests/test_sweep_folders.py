"""A sweep refuses, before anything starts, any two runs that would share a run folder (and so one
checkpoint: the second would resume the first, and the summary call both finished), and a run folder
that the sweep would not name."""
import os
import subprocess
import sys

import pytest

from configs import ConfigError
from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import sweep  # noqa: E402


def sweep_file(tmp_path, runs: str, out_root=None):
    path = tmp_path / "s.yaml"
    path.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {out_root or tmp_path / 'runs'}\n"
                    f"runs:\n{runs}")
    return str(path)


@pytest.mark.parametrize("runs", [
    "  1.0: [optim.lr=0.001]\n  '1.0': [optim.lr=0.002]\n",     # a float and a string: one name
    "  null: [optim.lr=0.001]\n  None: [optim.lr=0.002]\n",      # None, typed and written
    "  lr1e-3: [optim.lr=0.001]\n  LR1E-3: [optim.lr=0.002]\n",  # one folder where case does not count
])
def test_names_that_resolve_to_one_folder_are_refused(tmp_path, runs):
    with pytest.raises(ConfigError, match=r"runs .* and .* would share the folder"):
        sweep.expand(sweep_file(tmp_path, runs), [])


def test_a_symbolic_link_in_out_root_that_joins_two_runs_is_refused(tmp_path):
    (tmp_path / "runs" / "a").mkdir(parents=True)
    os.symlink(tmp_path / "runs" / "a", tmp_path / "runs" / "b")
    with pytest.raises(ConfigError, match=r"runs 'a' and 'b' would share the folder"):
        sweep.expand(sweep_file(tmp_path, "  a: []\n  b: [optim.lr=0.01]\n"), [])


def test_a_symbolic_link_under_a_relative_out_root_is_found_from_any_folder(tmp_path, monkeypatch):
    """A relative out_root lies under the repository root, where the commands run: the check resolves it
    there, not in the folder the sweep was started from (which missed the link)."""
    root = tmp_path / "repo"
    (root / "runs" / "a").mkdir(parents=True)
    os.symlink(root / "runs" / "a", root / "runs" / "b")
    monkeypatch.setattr(sweep, "ROOT", str(root))
    monkeypatch.chdir(tmp_path)  # not the repository root
    with pytest.raises(ConfigError, match=r"runs 'a' and 'b' would share the folder"):
        sweep.refuse_shared_folders([{"name": n, "overrides": [f"out_dir=runs/{n}"]} for n in "ab"], "s.yaml")


@pytest.mark.parametrize("name", ["'.'", "'..'", "x/y", "''"])
def test_a_name_that_is_not_one_folder_is_refused(tmp_path, name):
    with pytest.raises(ConfigError, match="is not a folder name"):
        sweep.expand(sweep_file(tmp_path, f"  ok: []\n  {name}: []\n"), [])


@pytest.mark.parametrize("where", ["run", "command line"])
def test_an_out_dir_the_sweep_would_replace_is_refused(tmp_path, where):
    runs = "  a: [out_dir=/tmp/mine]\n" if where == "run" else "  a: []\n"
    extra = ["out_dir=/tmp/mine"] if where == "command line" else []
    with pytest.raises(ConfigError, match=r"out_dir=/tmp/mine would be ignored"):
        sweep.expand(sweep_file(tmp_path, runs), extra)


def test_the_command_refuses_before_any_run_starts(tmp_path):
    path = sweep_file(tmp_path, "  1.0: [train.max_steps=1]\n  '1.0': [train.max_steps=2]\n")
    done = subprocess.run([sys.executable, "scripts/sweep.py", path, "--run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.strip().startswith("error: ") and "share the folder" in done.stderr
    assert not (tmp_path / "runs").exists()
