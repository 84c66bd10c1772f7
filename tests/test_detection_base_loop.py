"""A detection config whose `_base_` chain comes back to a file already in it: MMEngine followed it to Python's
recursion limit (seconds later, "RecursionError: maximum recursion depth exceeded"); the loop is named instead,
before any file is run. Refused before any model or data set is built, so part of the default suite."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("mmdet")

from detection_runs import error_line  # noqa: E402


def write(path, base, line="x = 1"):
    """A config file at `path` whose `_base_` is `base` (a name or a list), with one setting of its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"_base_ = {base!r}\n{line}\n")
    return str(path)


def test_a_base_loop_is_one_error_line_naming_the_files_in_order(tmp_path, capsys):
    """The reviewer's two files (a.py -> b.py -> a.py) through train_detection.py: one error line with the loop
    written from the --config file on, relative to its folder, and no work folder made."""
    config = write(tmp_path / "cyc_a.py", "./cyc_b.py")
    write(tmp_path / "cyc_b.py", "./cyc_a.py", "y = 2")
    started = time.perf_counter()
    line = error_line(capsys, ["--config", config, "--work-dir", str(tmp_path / "wd")])
    assert line == (f"error: --config {config}: _base_ chain loops: cyc_a.py -> cyc_b.py -> cyc_a.py; "
                    "remove one _base_"), line
    assert time.perf_counter() - started < 10  # the recursion took 12-26 s on a 2-core VM
    assert not (tmp_path / "wd").exists()


@pytest.mark.parametrize("files, loop", [
    # a file that names itself
    ({"a.py": "a.py"}, "a.py -> a.py"),
    # the loop below the --config file (b and c name each other), in a list of bases, across folders
    ({"a.py": ["sub/b.py"], "sub/b.py": "../c.py", "c.py": ["sub/b.py"]}, "a.py -> sub/b.py -> c.py -> sub/b.py"),
    # the second base of a list loops; the first is a plain file
    ({"a.py": ["plain.py", "d.py"], "d.py": "a.py"}, "a.py -> d.py -> a.py"),
    # a base two files share (plain.py, reached twice) is no loop; the loop is the one through right.py
    ({"a.py": ["left.py", "right.py"], "left.py": "plain.py", "right.py": ["plain.py", "r2.py"], "r2.py": "right.py"},
     "a.py -> right.py -> r2.py -> right.py"),
])
def test_the_loop_is_named_wherever_it_closes(tmp_path, files, loop):
    from engine.detection import DetectionError, load_config
    for name, base in files.items():
        write(tmp_path / name, base)
    (tmp_path / "plain.py").write_text("z = 3\n")
    with pytest.raises(DetectionError, match=r"^--config \S+a\.py: _base_ chain loops: (.*); remove one _base_$") \
            as refused:
        load_config([str(tmp_path / "a.py")])
    assert str(refused.value).split("loops: ")[1].split(";")[0] == loop
