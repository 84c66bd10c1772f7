"""Figures that the documentation and the configs' comments state agree with the records they come from: a
timing in a config's comment is a row of docs/measurements.md (named by its commit)."""
import glob
import os
import re

from tests.conftest import ROOT

TIMING = re.compile(r"\b(\d+(?:\.\d+)?) ?(ms|s)\b")  # "0.17 s", "147 ms" (not "22 min")


def measurement_rows() -> dict[str, list[str]]:
    """commit -> the rows of docs/measurements.md's tables recorded at it (the second cell of a row)."""
    rows: dict[str, list[str]] = {}
    with open(os.path.join(ROOT, "docs", "measurements.md"), encoding="utf-8") as f:
        for line in f:
            cells = [c.strip() for c in line.split("|")]
            if line.startswith("|") and len(cells) > 3 and re.fullmatch(r"[0-9a-f]{7,40}", cells[2]):
                rows.setdefault(cells[2], []).append(line)
    return rows


def test_a_timing_in_a_configs_comment_is_a_measurement_row_that_it_names():
    """A comment that quotes a timing names the commit of its docs/measurements.md row, and that row has the
    figure: a number with no row behind it cannot be checked or rerun."""
    rows, unbacked = measurement_rows(), []
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            comments = " ".join(line.split("#", 1)[1] for line in f if "#" in line)
        named = [row for commit in re.findall(r"\b[0-9a-f]{7,40}\b", comments) for row in rows.get(commit, [])]
        for number, unit in TIMING.findall(comments):
            if not any(re.search(rf"(?<![\d.]){re.escape(number)} ?{unit}\b", row) for row in named):
                unbacked.append(f"{os.path.relpath(path, ROOT)}: {number} {unit}")
    assert not unbacked, unbacked
