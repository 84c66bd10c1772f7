"""A class tar packed with its images under a folder (`tar cf cat.tar -C cat .` stores ./0.png) is refused with the
reason and a command that re-packs it, not with advice to put the images in a class tar, where they already are.

The reference for the re-packed split is the tar each image was stored in: its label must name that tar."""
import os
import re
import shutil
import subprocess
import tarfile

import numpy as np
import pytest
from PIL import Image

from data.folder import DataError, build_folder_dataset, class_names

CLASSES = ("cat", "dog")


def class_folders(root):
    """root/cat and root/dog with 4 PNGs each."""
    for c in CLASSES:
        os.makedirs(root / c)
        for i in range(4):
            Image.fromarray(np.full((8, 8, 3), 10 * i, dtype=np.uint8)).save(root / c / f"{i}.png")


def val_tar(root, packed):
    """root/val.tar holding the class tars root/packed/<class>.tar (the class tars alone, at its top)."""
    with tarfile.open(root / "data" / "val.tar", "w") as outer:
        for c in CLASSES:
            outer.add(packed / f"{c}.tar", arcname=f"{c}.tar")


@pytest.mark.parametrize("prefix, shown", [
    (".", "./"),  # tar cf cat.tar -C cat .
    ("class", "{c}/"),  # tar cf cat.tar cat: the images under the class's own folder
    ("x/y", "x/y/"),
])
def test_a_class_tar_with_a_folder_inside_is_refused_with_the_command_that_re_packs_it(tmp_path, prefix, shown):
    class_folders(tmp_path / "images")
    packed = tmp_path / "packed"
    packed.mkdir()
    (tmp_path / "data").mkdir()
    for c in CLASSES:
        with tarfile.open(packed / f"{c}.tar", "w") as tar:
            tar.add(tmp_path / "images" / c, arcname=c if prefix == "class" else prefix)
    val_tar(tmp_path, packed)
    with pytest.raises(DataError) as refused:
        build_folder_dataset(str(tmp_path / "data"), "val")
    message = str(refused.value)
    first = shown.format(c="cat")
    assert "8 image(s) sit in a folder inside their class tar" in message and f"cat.tar/{first}0.png" in message
    assert f"without the {first} prefix" in message and "`tar cf cat.tar -C cat $(ls cat)`" in message
    assert "must sit directly in" not in message and "\n" not in message


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs the tar command")
def test_the_re_pack_command_of_the_message_gives_a_split_labelled_by_its_class_tars(tmp_path):
    class_folders(tmp_path / "images")
    (tmp_path / "data").mkdir()
    for c in CLASSES:  # as the user did: tar cf cat.tar -C cat .
        subprocess.run(["tar", "cf", f"{c}.tar", "-C", c, "."], cwd=tmp_path / "images", check=True)
    val_tar(tmp_path, tmp_path / "images")
    with pytest.raises(DataError) as refused:
        build_folder_dataset(str(tmp_path / "data"), "val")
    command = re.search(r"`(tar cf cat\.tar .*)`", str(refused.value)).group(1)
    for c in CLASSES:  # the message's command, for each class
        subprocess.run(["bash", "-c", command.replace("cat", c)], cwd=tmp_path / "images", check=True)
    val_tar(tmp_path, tmp_path / "images")
    dataset = build_folder_dataset(str(tmp_path / "data"), "val")
    assert class_names(dataset) == list(CLASSES) and len(dataset) == 8
    stored = [(inner.name, class_names(dataset)[int(target)])
              for (_, _, inner), target in zip(dataset.reader.samples, dataset.reader.targets)]
    assert all(tar == f"{label}.tar" for tar, label in stored)
