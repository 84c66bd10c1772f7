"""train.py validates on data held out from its training: a data.val_split that reads the train split's token file
or image folder (by its name, the other key's name, a symbolic or hard link), or a copy of the training token file,
is refused before any folder is made, naming both keys; splits that are different files are trained on."""
import filecmp
import os
import re
import shutil

import numpy as np
import pytest

import train
from configs import ConfigError, config_to_dict, load_config
from tests.conftest import DEBUG_CONFIG, make_folder

NANO = "configs/lm/kjv_nano.yaml"


def _token_root(root):
    """train.bin, val.bin and copy.bin (a link to train.bin) of 4096 ids below 65 each."""
    rng = np.random.default_rng(0)
    for name in ("train", "val"):
        rng.integers(0, 65, 4096).astype(np.uint16).tofile(root / f"{name}.bin")
    os.symlink(root / "train.bin", root / "copy.bin")
    return root


@pytest.mark.parametrize("overrides, file", [(["data.val_split=train"], "train.bin"),
                                             (["data.train_split=val"], "val.bin"),
                                             (["data.val_split=copy"], "train.bin")])
def test_a_val_token_file_that_is_the_training_file_is_refused_before_the_run(tmp_path, overrides, file):
    """Scored on the text it trains on, best.pt would be picked by training loss: refused, naming both keys and the
    one file they read (os.path.realpath: the link resolved), before out_dir is made."""
    root = _token_root(tmp_path)
    out = tmp_path / "run"
    cfg = load_config([NANO], [f"out_dir={out}", "data.dataset=tokens", f"data.root={root}", *overrides])
    assert os.path.samefile(root / f"{cfg.data.train_split}.bin", root / f"{cfg.data.val_split}.bin")
    with pytest.raises(ConfigError, match=rf"^data.train_split={cfg.data.train_split} and "
                                          rf"data.val_split={cfg.data.val_split} both read "
                                          rf"{re.escape(os.path.realpath(root / file))}, .*the text the model trains "
                                          rf"on; give data.val_split a split held out from training$"):
        train.main(cfg)
    assert not out.exists()


@pytest.mark.parametrize("made, how", [(os.link, "one file under two names"),
                                       (shutil.copyfile, r"copies of one token file \(the same bytes\)")])
def test_a_val_token_file_that_is_a_hard_link_or_a_copy_of_the_training_file_is_refused(tmp_path, made, how):
    """A hard link to train.bin resolves to its own path (os.path.realpath) and a byte copy is another file: both
    hold the training text (filecmp), so both are refused, naming the two paths, before out_dir is made."""
    root = _token_root(tmp_path)
    made(root / "train.bin", root / "same.bin")
    assert filecmp.cmp(root / "train.bin", root / "same.bin", shallow=False)
    out = tmp_path / "run"
    cfg = load_config([NANO], [f"out_dir={out}", "data.dataset=tokens", f"data.root={root}", "data.val_split=same"])
    with pytest.raises(ConfigError, match=rf"^data.train_split=train and data.val_split=same read "
                                          rf"{re.escape(os.path.realpath(root / 'train.bin'))} and "
                                          rf"{re.escape(os.path.realpath(root / 'same.bin'))}, {how}, .*the text the "
                                          rf"model trains on; give data.val_split a split held out from training$"):
        train.main(cfg)
    assert not out.exists()


def test_a_val_token_file_of_the_training_file_s_size_with_other_ids_passes(tmp_path):
    """A file of train.bin's size with another last id is other text (the file is under a MiB: all of it is in the
    fingerprint): held out, it passes."""
    root = _token_root(tmp_path)
    ids = np.fromfile(root / "train.bin", dtype=np.uint16)
    ids[-1] = (ids[-1] + 1) % 65
    ids.tofile(root / "other.bin")
    cfg = load_config([NANO], [f"out_dir={tmp_path / 'run'}", "data.dataset=tokens", f"data.root={root}",
                               "data.val_split=other"])
    train.check_before_start(cfg)


def test_a_val_token_file_of_the_training_file_s_size_and_first_mib_passes_unless_all_its_bytes_are_the_same(tmp_path):
    """Files over a MiB: val.bin of train.bin's size and first MiB (the bytes token_file_fingerprint hashes) but
    other ids after it is other text (its bytes differ, as the bytes read back say): it was refused as a copy of
    train.bin; it trains. A byte copy of the same 1.2 MiB train.bin is still refused."""
    rng = np.random.default_rng(0)
    head = rng.integers(0, 65, 1 << 19).astype(np.uint16)  # exactly 1 MiB
    for name in ("train", "val"):
        np.concatenate([head, rng.integers(0, 65, 100_000).astype(np.uint16)]).tofile(tmp_path / f"{name}.bin")
    shutil.copyfile(tmp_path / "train.bin", tmp_path / "same.bin")
    train_bytes, val_bytes = (tmp_path / "train.bin").read_bytes(), (tmp_path / "val.bin").read_bytes()
    assert len(train_bytes) == len(val_bytes) > 1 << 20 and train_bytes[:1 << 20] == val_bytes[:1 << 20]
    assert train_bytes != val_bytes and (tmp_path / "same.bin").read_bytes() == train_bytes
    common = [f"out_dir={tmp_path / 'run'}", "data.dataset=tokens", f"data.root={tmp_path}"]
    train.check_before_start(load_config([NANO], common))
    with pytest.raises(ConfigError, match=r"^data.train_split=train and data.val_split=same read .*, copies of one "
                                          r"token file \(the same bytes\), "):
        train.check_before_start(load_config([NANO], [*common, "data.val_split=same"]))


def test_distinct_token_files_pass_the_check(tmp_path):
    """train.bin and val.bin, two files, start (check_before_start raises nothing)."""
    root = _token_root(tmp_path)
    cfg = load_config([NANO], [f"out_dir={tmp_path / 'run'}", "data.dataset=tokens", f"data.root={root}"])
    assert not os.path.samefile(root / "train.bin", root / "val.bin")
    train.check_before_start(cfg)


@pytest.mark.parametrize("split", ["train", "./train/", "{root}/train"])
def test_a_val_folder_that_is_the_training_folder_is_refused(tmp_path, split):
    """The same rule for image folders, whatever the folder's name; a val/ beside train/ passes."""
    root = tmp_path / "data"
    make_folder(root, {"train": {"a": 2, "b": 2}, "val": {"a": 2, "b": 2}})
    split = split.format(root=root)
    common = [f"out_dir={tmp_path / 'run'}", "data.dataset=folder", f"data.root={root}"]
    with pytest.raises(ConfigError, match=rf"^data.train_split=train and data.val_split={re.escape(split)} both read "
                                          rf"{re.escape(os.path.realpath(root / 'train'))}, .*the images the model "
                                          r"trains on"):
        train.check_before_start(load_config([DEBUG_CONFIG], [*common, f"data.val_split={split}"]))
    train.check_before_start(load_config([DEBUG_CONFIG], common))


@pytest.mark.parametrize("split", ["train", "old"])
def test_a_resume_whose_val_split_reads_the_checkpoint_s_training_file_is_refused(tmp_path, split):
    """train.allow_changed_config=true lets a resume change data.train_split: a val split that is the token file the
    checkpoint recorded as its training split (or a byte copy of it) would score, and pick best.pt on, text the run
    trained on. The resume's own train and val files differ, so only the checkpoint's record tells it."""
    root = _token_root(tmp_path)
    shutil.copyfile(root / "train.bin", root / "old.bin")
    np.random.default_rng(1).integers(0, 65, 4096).astype(np.uint16).tofile(root / "new.bin")
    assert filecmp.cmp(root / "train.bin", root / f"{split}.bin", shallow=False)
    assert not filecmp.cmp(root / "new.bin", root / f"{split}.bin", shallow=False)
    common = [f"out_dir={tmp_path / 'run'}", "data.dataset=tokens", f"data.root={root}"]
    trained = load_config([NANO], common)  # trained on train.bin, validated on val.bin
    payload = {"config": config_to_dict(trained), "state": {"step": 2}}
    cfg = load_config([NANO], [*common, "data.train_split=new", f"data.val_split={split}",
                               "train.allow_changed_config=true"])
    with pytest.raises(ConfigError, match=rf"^data.val_split={split}: .*{split}.bin is (a copy of )?the train split "
                                          r".*checkpoint.pt was trained on .*text it was trained on; score its "
                                          r"held-out split \(data.val_split=val\)$"):
        train.check_resume(cfg, str(tmp_path / "run" / "checkpoint.pt"), payload, warn=False)
    held_out = load_config([NANO], [*common, "data.train_split=new", "train.allow_changed_config=true"])
    train.check_resume(held_out, str(tmp_path / "run" / "checkpoint.pt"), payload, warn=False)  # val.bin: held out
