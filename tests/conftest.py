"""Shared test helpers: repository paths and small configs that train in seconds on a CPU."""
from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEBUG_CONFIG = os.path.join(ROOT, "configs", "debug", "tiny.yaml")
DEMO_CONFIG = os.path.join(ROOT, "configs", "demo", "vit_digits.yaml")


@pytest.fixture
def debug_config(tmp_path):
    """A factory: the tiny debug config with out_dir in tmp_path plus extra key=value overrides."""
    from configs import load_config

    def make(*overrides: str, name: str = "run"):
        return load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / name}", *overrides])

    return make
