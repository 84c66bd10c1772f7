"""What tests/conftest.py does in pytest-xdist's controller before the workers start: caches that a first import
writes are written there, by one process, so that workers collecting side by side only read them."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

CONFIGURE = """
import sys, types
sys.path.insert(0, {tests!r})
import conftest
config = types.SimpleNamespace()
if {worker}:
    config.workerinput = {{"workerid": "gw0"}}
conftest.pytest_configure(config)
print("yapf" in sys.modules)
"""


def configure_in_a_fresh_process(cache_home, worker: bool) -> str:
    """conftest.pytest_configure in a new Python (yapf not yet imported) with its user cache in cache_home."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home)}
    code = CONFIGURE.format(tests=os.path.join(ROOT, "tests"), worker=worker)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_controller_writes_yapfs_grammar_cache_and_a_worker_leaves_it_alone(tmp_path):
    pytest.importorskip("yapf")
    worker_cache, controller_cache = tmp_path / "worker", tmp_path / "controller"

    assert configure_in_a_fresh_process(worker_cache, worker=True) == "False"
    assert not worker_cache.exists()

    assert configure_in_a_fresh_process(controller_cache, worker=False) == "True"
    pickles = sorted(path.name for path in controller_cache.rglob("*.pickle"))
    assert [name.split("-py")[0] for name in pickles] == ["Grammar", "PatternGrammar"]
    assert all(path.stat().st_size > 0 for path in controller_cache.rglob("*.pickle"))
