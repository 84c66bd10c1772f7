"""A fresh start that archives out_dir's earlier files never moves the data set the same command reads: a data.root
inside out_dir, or out_dir itself holding the splits, is refused with one line naming data.root before anything
moves (engine/run_dir.py, check_inputs_stay). A data set that reads no data.root (synthetic) does not hold the
archive back."""
import os

import pytest

from engine.run_dir import RunDirError, claim_run_dir
from tests.conftest import DEBUG_CONFIG, make_folder, run_entry
from tests.test_run_dir_inputs import earlier_run, files


def config(root: str, dataset: str = "folder", train_split: str = "train", val_split: str = "val") -> dict:
    return {"model": {"pretrained": ""}, "train": {"resume": ""},
            "data": {"dataset": dataset, "root": root, "train_split": train_split, "val_split": val_split}}


def claim(out_dir, cfg: dict) -> None:
    with claim_run_dir(str(out_dir), cfg, archive_existing=True):
        pass


def test_a_data_root_inside_out_dir_is_refused_and_nothing_moves(tmp_path):
    out = tmp_path / "run"
    earlier_run(out)
    make_folder(out / "data", {"train": {"a": 1}, "val": {"a": 1}})
    before = files(out)
    with pytest.raises(RunDirError) as refused:
        claim(out, config(str(out / "data")))
    assert str(refused.value) == (
        f"data.root={out / 'data'} lies in out_dir '{out}' among the files train.archive_existing=true would move to "
        f"{out}/archive/<time>/ (data): use another out_dir, or move the data set out of it first")
    assert files(out) == before and not os.path.exists(out / "archive")


@pytest.mark.parametrize("dataset, split_files", [("folder", ("train", "val")), ("folder", ("train.tar", "val")),
                                                   ("tokens", ("train.bin", "val.bin"))])
def test_out_dir_as_data_root_is_refused_naming_a_split_in_it(tmp_path, dataset, split_files):
    """data.root=out_dir: the root is not moved, its splits are (a folder, a .tar, a token file)."""
    out = tmp_path / "run"
    earlier_run(out)
    for name in split_files:
        if name.endswith((".tar", ".bin")):
            (out / name).write_bytes(b"\0\0")
        else:
            (out / name / "a").mkdir(parents=True)
    before = files(out)
    with pytest.raises(RunDirError, match=rf"^data\.root={out} lies in out_dir .* \((train|val)[.a-z]*\): use another "
                                          rf"out_dir, or move the data set out of it first$"):
        claim(out, config(str(out), dataset=dataset))
    assert files(out) == before and not os.path.exists(out / "archive")


def test_a_link_in_out_dir_to_the_data_set_elsewhere_is_refused(tmp_path):
    out, data = tmp_path / "run", tmp_path / "datasets" / "small"
    earlier_run(out)
    make_folder(data, {"train": {"a": 1}, "val": {"a": 1}})
    os.symlink(data, out / "data")
    with pytest.raises(RunDirError, match=r"\(data\): use another out_dir"):
        claim(out, config(str(out / "data")))
    assert os.path.islink(out / "data")


def test_a_data_set_elsewhere_or_one_without_a_root_does_not_hold_the_archive_back(tmp_path):
    out, data = tmp_path / "run", tmp_path / "run-data"
    earlier_run(out)
    make_folder(data, {"train": {"a": 1}, "val": {"a": 1}})
    claim(out, config(str(data)))  # another folder whose name starts as out_dir's does not count
    assert sorted(os.listdir(out)) == ["archive"]
    earlier_run(out)
    (out / "data").mkdir()
    claim(out, config(str(out / "data"), dataset="synthetic"))  # synthetic images read no data.root
    assert sorted(os.listdir(out)) == ["archive"] and len(os.listdir(out / "archive")) == 2


def test_train_py_refuses_with_one_error_line_and_the_data_set_stays(tmp_path, capsys):
    """The reported command: data.root inside out_dir with train.archive_existing=true moved the data set into the
    archive, then failed with 'data.root does not exist'."""
    out = tmp_path / "X"
    make_folder(out / "data", {split: {c: 2 for c in "abcd"} for split in ("train", "val")})
    (out / "old_notes.txt").write_text("notes")
    before = files(out)
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={out}", "data.dataset=folder",
                                          f"data.root={out / 'data'}", "train.archive_existing=true"], capsys)
    lines = err.strip().splitlines()
    assert code != 0 and lines == [
        f"error: data.root={out / 'data'} lies in out_dir '{out}' among the files train.archive_existing=true would "
        f"move to {out}/archive/<time>/ (data): use another out_dir, or move the data set out of it first"], err
    assert files(out) == before
