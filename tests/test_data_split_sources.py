"""Where a folder data set's splits come from: a split's .tar is read as timm reads it (uncompressed: a compressed tar
is refused by name, never left to fail in timm's reader), a split given both as a folder and as a .tar is refused
rather than one picked without a word, a val class folder that is a training class folder under another name is
refused as training data, and class names that differ only in their Unicode form are named as such."""
import os
import subprocess
import tarfile
import unicodedata

import pytest
from timm.data import ImageDataset

from configs import ConfigError, load_config
from data import DataError, build_loaders
from tests.conftest import DEBUG_CONFIG, make_folder


def folder_config(root, classes=2):
    return load_config([DEBUG_CONFIG], ["data.dataset=folder", f"data.root={root}", f"model.num_classes={classes}",
                                        "data.auto_augment=", "data.mixup=0", "data.cutmix=0", "data.num_workers=0"])


def loaders(root, classes=2):
    return build_loaders(folder_config(root, classes).data, img_size=32, batch_size_per_gpu=2,
                         eval_batch_size_per_gpu=4, rank=0, world_size=1, seed=0, num_classes=classes)


def pack(tar_path, folder, names, mode="w"):
    with tarfile.open(tar_path, mode) as tar:
        for name in names:
            tar.add(os.path.join(folder, name), arcname=name)


# -- compressed tars ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, kind, tool", [("w:gz", "gzip", "gunzip"), ("w:bz2", "bzip2", "bunzip2"),
                                              ("w:xz", "xz", "unxz")])
def test_a_compressed_split_tar_is_refused_by_name_before_timm_reads_it(tmp_path, mode, kind, tool):
    make_folder(tmp_path / "src", {"train": {"a": 4, "b": 4}, "val": {"a": 2, "b": 2}})
    make_folder(tmp_path, {"val": {"a": 2, "b": 2}})
    train_tar = str(tmp_path / "train.tar")
    pack(train_tar, tmp_path / "src" / "train", ["a", "b"], mode)
    with pytest.raises(tarfile.ReadError):  # the premise: timm's reader fails on it, inside a DataLoader worker
        list(ImageDataset(train_tar))
    with pytest.raises(DataError, match=rf"{train_tar} is a {kind}-compressed tar: timm's reader reads uncompressed "
                                        rf"tars only .*`{tool} -c {train_tar} > plain.tar`.*`tar cf`"):
        loaders(tmp_path)


def test_the_same_tar_uncompressed_is_read(tmp_path):
    make_folder(tmp_path / "src", {"train": {"a": 4, "b": 4}})
    make_folder(tmp_path, {"val": {"a": 2, "b": 2}})
    pack(str(tmp_path / "train.tar"), tmp_path / "src" / "train", ["a", "b"])
    assert len(loaders(tmp_path).train.loader.dataset) == 8


def test_a_compressed_class_tar_is_refused_by_name(tmp_path):
    """ImageNet's train tar holds one tar per class, which timm reads uncompressed too."""
    make_folder(tmp_path / "src", {"train": {"a": 4, "b": 4}})
    make_folder(tmp_path, {"val": {"a": 2, "b": 2}})
    for name, mode in (("a", "w"), ("b", "w:gz")):
        pack(str(tmp_path / "src" / f"{name}.tar"), tmp_path / "src" / "train" / name, ["0.png", "1.png"], mode)
    train_tar = str(tmp_path / "train.tar")
    pack(train_tar, tmp_path / "src", ["a.tar", "b.tar"])
    with pytest.raises(tarfile.ReadError):  # the premise, as above
        list(ImageDataset(train_tar))
    with pytest.raises(DataError, match=rf"{train_tar}/b.tar is a gzip-compressed tar, while timm's reader reads "
                                        r"each .tar in .* as a class tar, uncompressed"):
        loaders(tmp_path)


def test_a_file_named_tar_that_is_no_tar_is_refused_as_such(tmp_path):
    make_folder(tmp_path, {"val": {"a": 2, "b": 2}})
    (tmp_path / "train.tar").write_bytes(b"not a tar at all" * 64)
    with pytest.raises(DataError, match=r"train.tar is not a tar archive: a split is a folder"):
        loaders(tmp_path)


# -- a split as both a folder and a .tar -------------------------------------------------------------------

@pytest.mark.parametrize("split", ["train", "val"])
def test_a_split_both_a_folder_and_a_tar_is_refused_naming_both(tmp_path, split):
    make_folder(tmp_path, {"train": {"a": 4, "b": 4}, "val": {"a": 2, "b": 2}})
    pack(str(tmp_path / f"{split}.tar"), tmp_path / split, ["a"])  # another set of images: which one is a guess
    with pytest.raises(DataError, match=rf"holds both {tmp_path / split} and {tmp_path / split}.tar for the "
                                        rf"'{split}' split: rename or remove one"):
        loaders(tmp_path)


# -- a val class folder that is a training class folder ------------------------------------------------------

def check_before_start(root):
    from train import check_before_start as check

    check(folder_config(root), packages=False)


def test_a_val_class_folder_linked_to_the_training_one_is_refused(tmp_path):
    make_folder(tmp_path, {"train": {"a": 4, "b": 4}, "val": {"a": 2}})
    os.symlink(os.path.join("..", "train", "b"), tmp_path / "val" / "b")
    assert os.path.samefile(tmp_path / "val" / "b", tmp_path / "train" / "b")  # the reference: one folder
    with pytest.raises(ConfigError, match=rf"1 class folder\(s\) in common, one folder under two names "
                                          rf"\({tmp_path / 'val' / 'b'} is {tmp_path / 'train' / 'b'}\), so "
                                          r"validation \(and best.pt\) would score the images the model trains on"):
        check_before_start(tmp_path)


def test_a_val_class_folder_linked_elsewhere_is_taken(tmp_path):
    make_folder(tmp_path, {"train": {"a": 4, "b": 4}, "val": {"a": 2}, "held_out": {"b": 2}})
    os.symlink(tmp_path / "held_out" / "b", tmp_path / "val" / "b")
    check_before_start(tmp_path)


def test_a_val_split_of_its_own_class_folders_is_taken(tmp_path):
    make_folder(tmp_path, {"train": {"a": 4, "b": 4}, "val": {"a": 2, "b": 2}})
    check_before_start(tmp_path)


def test_two_class_folders_of_a_split_that_are_one_folder_are_refused(tmp_path):
    """train/b a link to train/a: timm read a's images once as class a and once as class b, the same images under
    two labels. Refused naming both, in either split."""
    make_folder(tmp_path, {"train": {"a": 4, "c": 4}, "val": {"a": 2, "b": 2, "c": 2}})
    os.symlink("a", tmp_path / "train" / "b")
    assert os.path.samefile(tmp_path / "train" / "b", tmp_path / "train" / "a")  # the reference: one folder
    with pytest.raises(DataError, match=rf"^{tmp_path / 'train'}: class folders a and b are one folder under two "
                                        r"names .*its images would be labelled as both classes"):
        loaders(tmp_path, classes=3)


def test_class_folders_linked_to_folders_of_their_own_are_taken(tmp_path):
    make_folder(tmp_path, {"train": {"a": 4}, "val": {"a": 2, "b": 2}, "more": {"b": 4}})
    os.symlink(tmp_path / "more" / "b", tmp_path / "train" / "b")
    assert len(loaders(tmp_path).train.loader.dataset) == 8


# -- class names in other Unicode forms ----------------------------------------------------------------------

def test_class_names_that_differ_only_in_unicode_form_are_named_as_such(tmp_path):
    composed, decomposed = unicodedata.normalize("NFC", "é"), unicodedata.normalize("NFD", "é")
    assert composed != decomposed and unicodedata.normalize("NFC", decomposed) == composed  # the premise
    make_folder(tmp_path, {"train": {"a": 4, composed: 4}, "val": {"a": 2, decomposed: 2}})
    if len(os.listdir(tmp_path / "val")) != 2 or decomposed not in os.listdir(tmp_path / "val"):
        pytest.skip("this file system normalizes names")  # e.g. one that stores every name in one form
    with pytest.raises(DataError, match=r"1 class folder\(s\) with the same letters in other Unicode forms "
                                        r"\(train '\\xe9', val 'e\\u0301'\)") as raised:
        loaders(tmp_path)
    assert "lacks" not in str(raised.value)


def test_gunzip_undoes_the_compression_the_advice_names(tmp_path):
    """The advice's command gives a tar that is read (where gunzip is installed)."""
    make_folder(tmp_path / "src", {"train": {"a": 4, "b": 4}})
    make_folder(tmp_path, {"val": {"a": 2, "b": 2}})
    pack(str(tmp_path / "train.tar"), tmp_path / "src" / "train", ["a", "b"], "w:gz")
    try:
        plain = subprocess.run(["gunzip", "-c", str(tmp_path / "train.tar")], capture_output=True, check=True).stdout
    except FileNotFoundError:
        pytest.skip("gunzip is not installed")
    (tmp_path / "train.tar").write_bytes(plain)
    assert len(loaders(tmp_path).train.loader.dataset) == 8
