"""A detection command's refusal is one line of stderr in a real process, as README.md promises: MMEngine 0.10
imports pkg_resources, of which setuptools 80 warns at each import (four lines before the error line), which
pytest's own warning capture hid from the in-process tests.

Marked `detection`: they need MMDetection with full mmcv (scripts/install_mmcv.sh)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from detection_runs import SAMPLE_CONFIG
from tests.conftest import ROOT

pytestmark = pytest.mark.detection


@pytest.mark.parametrize("command", [
    ["evaluate_detection.py", "--config", SAMPLE_CONFIG, "--checkpoint", "{tmp}/gone.pth", "--data-root", "{sample}",
     "--max-images", "0"],
    ["scripts/train_detection.py", "--config", SAMPLE_CONFIG, "--data-root", "{sample}", "--work-dir", "{tmp}/w",
     "no_such_key=1"]], ids=["evaluate_detection", "train_detection"])
def test_a_refusal_after_mmengine_is_imported_is_one_line(sample, tmp_path, command):
    argv = [a.format(tmp=tmp_path, sample=sample) for a in command]
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = done.stderr.strip().splitlines()
    assert done.returncode in (1, 2) and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
