"""evaluate.py --out naming a folder (one that exists, or a new one: a path ending in a separator) is one `error:`
line before the weights are read and before eval.log is opened. It was found at the first write, after the FP and
maxima passes, as an error about `<out>.lock` ("no file was written"), and eval.log had been written into the
folder above the one named."""
import os

import pytest

from tests.conftest import run_entry


def _tree(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(folder, name), root)
                  for folder, folders, files in os.walk(root) for name in folders + files)


def _folder_outs(tmp_path) -> list[tuple[str, str]]:
    (tmp_path / "run").mkdir()
    return [(str(tmp_path / "new") + os.sep, "names a folder (it ends in a path separator)"),
            (str(tmp_path / "a" / "b" / "new") + os.sep, "names a folder (it ends in a path separator)"),
            (os.path.join(tmp_path, "new", "."), "names a folder (it ends in .)"),
            (str(tmp_path / "run"), f"{tmp_path / 'run'} is a folder"),
            (str(tmp_path / "run") + os.sep, "is a folder")]


def _refused(checkpoint: str, out: str, capsys) -> str:
    code, _, err = run_entry("evaluate.py", ["--checkpoint", checkpoint, "--quant", "--out", out], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_a_folder_as_out_is_refused_before_the_weights_are_read(tmp_path, capsys):
    """The checkpoint does not exist: a refusal that came after reading it would name the checkpoint."""
    for out, message in _folder_outs(tmp_path):
        line = _refused(str(tmp_path / "gone.pt"), out, capsys)
        assert message in line and "give --out a file path, e.g. " in line, line
        assert os.path.join(os.path.normpath(out), "eval.json") in line, line
        assert _tree(tmp_path) == ["run"], out  # nothing made, no eval.log anywhere


def test_a_folder_as_out_writes_nothing(checkpoint, tmp_path, capsys):
    for out, message in _folder_outs(tmp_path):
        assert message in _refused(checkpoint, out, capsys)
        assert _tree(tmp_path) == ["run"], out


@pytest.mark.parametrize("name", ["r.json", os.path.join("a", "b", "r.json")])
def test_a_file_in_a_folder_still_to_be_made_is_taken(checkpoint, tmp_path, capsys, name):
    """The folders of a file path are made, as before (README: --out results/vit_b_cd.json)."""
    code, _, err = run_entry("evaluate.py", ["--checkpoint", checkpoint, "--quant", "--out", str(tmp_path / name)],
                             capsys)
    assert code == 0, err
    assert (tmp_path / name).is_file() and (tmp_path / os.path.dirname(name) / "eval.log").is_file()


def test_an_empty_out_is_refused_not_taken_for_the_default_path(tmp_path, capsys):
    """`--out "$OUT"` with OUT unset wrote eval_best.json beside the checkpoint without a word."""
    line = _refused(str(tmp_path / "gone.pt"), "", capsys)
    assert line.startswith("error: --out is empty: give a file path"), line
    assert _tree(tmp_path) == []


def test_an_out_that_is_a_symlink_updates_the_file_it_names_and_keeps_the_link(checkpoint, tmp_path, capsys):
    """The result was renamed over the link: the link became a plain copy and its file stayed as it was."""
    target = tmp_path / "results" / "target.json"
    code, _, err = run_entry("evaluate.py", ["--checkpoint", checkpoint, "--quant", "--out", str(target)], capsys)
    assert code == 0, err
    link = tmp_path / "link.json"
    link.symlink_to(target)
    code, _, err = run_entry("evaluate.py", ["--checkpoint", checkpoint, "--quant", "rtn", "--bits", "w8a16",
                                             "--out", str(link)], capsys)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    import json
    assert "rtn" in json.loads(target.read_text())["quant"]
    assert not [p for p in os.listdir(tmp_path / "results") if p.endswith(".lock") or ".partial" in p]
    # the maxima files the JSON names lie beside it (the JSON names them by its own stem), none beside the link
    named = json.loads(target.read_text())["act_max_files"] if "act_max_files" in target.read_text() else None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "results"], named
