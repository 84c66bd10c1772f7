"""A split that is a symbolic link to nothing (a data set moved away, a disk not mounted) is named as such, with the
path it points at: not "no 'train' split" beside a listing that holds train."""
import os
import re

import numpy as np
import pytest
from PIL import Image

from data.folder import DataError, build_folder_dataset, class_folders, find_split


def image_split(folder):
    """`folder` as a split of two classes of one 8x8 image each."""
    for name in ("cat", "dog"):
        os.makedirs(folder / name)
        Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(folder / name / "0.png")


def test_a_split_linked_to_a_missing_folder_names_the_link_and_its_target(tmp_path):
    root = tmp_path / "data"
    image_split(root / "val")
    os.symlink(tmp_path / "nowhere", root / "train")
    with pytest.raises(DataError) as refused:
        find_split(str(root), "train")
    message = str(refused.value)
    assert message.startswith(f"{root / 'train'} is a symbolic link to {tmp_path / 'nowhere'}")
    assert "which does not exist: mount or restore it, or point the link at the split's folder or .tar" in message
    assert "no 'train' split" not in message and "\n" not in message
    assert find_split(str(root), "val") == str(root / "val")  # the other split is read as before


def test_a_relative_link_names_the_path_it_leads_to(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    os.symlink(os.path.join("..", "moved", "train"), root / "train")
    leads_to = os.path.realpath(tmp_path / "moved" / "train")  # where the link's folder is, links resolved
    with pytest.raises(DataError, match=r"is a symbolic link to \.\./moved/train, which leads to "
                                        rf"{re.escape(leads_to)}, which does not exist"):
        build_folder_dataset(str(root), "train")


def test_a_link_to_nothing_beside_the_split_s_tar_leaves_the_tar_read(tmp_path):
    """find_split takes <split> or else <split>.tar: a dead <split> link does not hide the tar."""
    import tarfile

    image_split(tmp_path / "files")
    root = tmp_path / "data"
    root.mkdir()
    with tarfile.open(root / "train.tar", "w") as tar:
        for name in ("cat", "dog"):
            tar.add(tmp_path / "files" / name, arcname=name)
    os.symlink(tmp_path / "nowhere", root / "train")
    assert find_split(str(root), "train") == str(root / "train.tar")


def test_a_class_folder_linked_to_nothing_is_refused_not_dropped_from_the_classes(tmp_path):
    """train/n2 -> /mnt/gone/train/n2: no folder to os.scandir or timm's walk, so the class set was three classes and
    the run advised model.num_classes=3. Each place that lists a split's classes names the link and its target; a
    live link to a class folder is a class, and a hidden link to nothing (no class) is left alone."""
    root = tmp_path / "data"
    image_split(root / "train")
    image_split(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere" / "cat", root / "train" / "lion")  # a live link: a class
    os.symlink(tmp_path / "gone" / "n2", root / "train" / "n2")
    os.symlink(tmp_path / "gone" / "cache", root / "train" / ".cache")
    expected = (f"{root / 'train' / 'n2'} is a symbolic link to {tmp_path / 'gone' / 'n2'}, which does not exist: "
                "mount or restore it, or point the link at the class's folder; or remove it if it was no class folder")
    for read in (lambda: class_folders(str(root / "train")), lambda: build_folder_dataset(str(root), "train")):
        with pytest.raises(DataError) as refused:
            read()
        assert str(refused.value) == expected
    os.unlink(root / "train" / "n2")
    assert class_folders(str(root / "train")) == ["cat", "dog", "lion"]
    assert len(build_folder_dataset(str(root), "train")) == 3


def test_a_run_is_refused_on_a_class_folder_linked_to_nothing_before_it_trains(tmp_path):
    """The count the run used to advise (one class fewer) does not make it train without that class."""
    import train
    from configs import load_config
    from tests.conftest import DEBUG_CONFIG, make_folder

    root = tmp_path / "data"
    make_folder(root, {"train": {"cat": 8, "dog": 8}, "val": {"cat": 2, "dog": 2}})  # a run of 2 classes trains on it
    for split in ("train", "val"):
        os.symlink(tmp_path / "gone" / split / "n2", root / split / "n2")
    cfg = load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / 'run'}", "model.num_classes=2", "data.dataset=folder",
                                       f"data.root={root}", "train.max_steps=1", "log.tensorboard=false"])
    with pytest.raises(DataError, match=re.escape(f"{root / 'train' / 'n2'} is a symbolic link to "
                                                  f"{tmp_path / 'gone' / 'train' / 'n2'}, which does not exist")):
        train.main(cfg)
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
