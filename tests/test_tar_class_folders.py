"""A .tar split is held to the class-folder rules of a folder split: every image directly in a class folder (or a
class tar), no hidden or nested folders, no empty class folder; whatever the folder split refuses, its tar refuses.

The reference for each layout is the path each image was stored under: its class is the first folder of that
path, which timm's tar reader does not check (it labels an image by the last folder of its path, and an image at
the root as class '')."""
import io
import os
import tarfile

import numpy as np
import pytest
from PIL import Image

from data.folder import DataError, build_folder_dataset, class_names

TWO_CLASSES = [f"{c}/{i}.png" for c in ("a", "b") for i in range(2)]


def write(root, files):
    """files: paths relative to root; '.png' ones become small images, names ending in '/' empty folders, others
    short text files."""
    for rel in files:
        path = os.path.join(root, rel)
        os.makedirs(path if rel.endswith("/") else os.path.dirname(path), exist_ok=True)
        if rel.endswith(".png"):
            Image.fromarray(np.full((8, 8, 3), len(rel), dtype=np.uint8)).save(path)
        elif not rel.endswith("/"):
            with open(path, "w") as f:
                f.write("x")


def tar_of(folder, tar_path, dot):
    """`folder` as a tar, its members named ./a/0.png (`tar -C folder -cf x.tar .`) or a/0.png (one `tar.add`
    per top-level entry)."""
    with tarfile.open(tar_path, "w") as tar:
        if dot:
            tar.add(folder, arcname=".")
        else:
            for name in sorted(os.listdir(folder)):
                tar.add(os.path.join(folder, name), arcname=name)


def splits(tmp_path, files, dot=True):
    """The same files as a folder split and as a tar split: (folder root, tar root), each holding a train split."""
    write(tmp_path / "folder" / "train", files)
    (tmp_path / "tar").mkdir()
    tar_of(tmp_path / "folder" / "train", tmp_path / "tar" / "train.tar", dot)
    return str(tmp_path / "folder"), str(tmp_path / "tar")


@pytest.mark.parametrize("dot", [True, False])
@pytest.mark.parametrize("extra, message", [
    (["stray.png"], r"1 image\(s\) outside a class folder, e.g. (\./)?stray\.png"),  # timm: class ''
    (["a/more/x.png"], r"1 image\(s\) outside a class folder, e.g. (\./)?a/more/x\.png"),  # timm: class 'more'
    (["a/x/0.png", "b/x/1.png"], r"2 image\(s\) outside a class folder"),  # timm: one class 'x' of both
    ([".cache/x.png"], r"1 image\(s\) outside a class folder, e.g. (\./)?\.cache/x\.png"),  # a hidden class
    (["c/"], r"class folder\(s\) c hold no images"),  # timm makes no class of it: later labels shift
    (["c/notes.txt"], r"class folder\(s\) c hold no images"),
    (["A/0.png"], r"class folders (a, A|A, a) sort as one name"),
])
def test_a_tar_split_refuses_what_its_folder_split_refuses(tmp_path, dot, extra, message):
    folder, tar = splits(tmp_path, TWO_CLASSES + extra, dot)
    for root in (folder, tar):
        with pytest.raises(DataError, match=message) as refused:
            build_folder_dataset(root, "train")
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize("dot", [True, False])
def test_a_tar_split_keeps_the_harmless_extras_its_folder_split_keeps(tmp_path, dot):
    """Files that are no images and an empty hidden folder change no class: both splits read the same classes, and
    each image's label names the folder it was stored in."""
    folder, tar = splits(tmp_path, TWO_CLASSES + ["README.txt", ".ipynb_checkpoints/", "a/labels.csv"], dot)
    for root in (folder, tar):
        dataset = build_folder_dataset(root, "train")
        names = class_names(dataset)
        assert names == ["a", "b"] and len(dataset) == 4
        for i in range(len(dataset)):
            stored = os.path.normpath(dataset.filename(i)).split(os.sep)
            assert names[int(dataset[i][1])] == stored[-2]


def class_tars(path, members, loose=()):
    """A tar of class tars at `path`: members {class tar name: [member names]}; `loose` images sit in the outer tar
    itself."""
    def add(tar, name, data):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    png = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(png, format="png")
    with tarfile.open(path, "w") as outer:
        for tar_name, names in members.items():
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as tar:
                for name in names:
                    add(tar, name, png.getvalue() if name.endswith(".png") else b"x")
            add(outer, tar_name, inner.getvalue())
        for name in loose:
            add(outer, name, png.getvalue())


@pytest.mark.parametrize("members, loose, message", [
    ({}, ["stray.png"], r"1 image\(s\) outside a class folder, e.g. stray\.png"),  # timm: class ''
    ({"a.tar": ["more/x.png"]}, [], r"e\.g\. a\.tar/more/x\.png"),  # timm: class 'more'
    ({"a.tar": ["./x.png"]}, [], r"e\.g\. a\.tar/\./x\.png"),  # timm: class '.'
    ({"sub/a.tar": ["x.png"]}, [], r"e\.g\. sub/a\.tar/x\.png"),  # timm: class 'a', out of a folder 'sub'
    ({".a.tar": ["x.png"]}, [], r"e\.g\. \.a\.tar/x\.png"),  # a hidden class
    ({"c.tar": ["notes.txt"]}, [], r"class folder\(s\) c hold no images"),  # timm makes no class of it
])
def test_a_tar_of_class_tars_holds_each_image_directly_in_its_class_tar(tmp_path, members, loose, message):
    """ImageNet's train tar: one tar per class, its images at its root. An image anywhere else, or a class tar
    without images, is refused as in a folder split."""
    class_tars(tmp_path / "train.tar", {"a.tar": ["0.png"], "b.tar": ["0.png"], **members}, loose)
    with pytest.raises(DataError, match=message):
        build_folder_dataset(str(tmp_path), "train")


def test_a_tar_of_class_tars_names_its_classes_after_them(tmp_path):
    class_tars(tmp_path / "train.tar", {"b.tar": ["0.png", "1.png"], "a.tar": ["0.png"]})
    dataset = build_folder_dataset(str(tmp_path), "train")
    assert class_names(dataset) == ["a", "b"]
    stored = sorted((inner.name, class_names(dataset)[int(target)])
                    for (_, _, inner), target in zip(dataset.reader.samples, dataset.reader.targets))
    assert stored == [("a.tar", "a"), ("b.tar", "b"), ("b.tar", "b")]


@pytest.mark.parametrize("wrapper", ["train", "data/imagenet/train"])
def test_a_tar_of_the_split_folder_itself_reads_its_class_folders(tmp_path, wrapper):
    """`tar cf train.tar train/` stores train/<class>/<image>: timm labels each image by its last folder, so the
    classes are the class folders under the one folder every member sits in; the rules apply below it."""
    write(tmp_path / "src" / wrapper, TWO_CLASSES + ["README.txt"])
    (tmp_path / "tar").mkdir()
    with tarfile.open(tmp_path / "tar" / "train.tar", "w") as tar:
        tar.add(tmp_path / "src" / wrapper.split("/")[0], arcname=wrapper.split("/")[0])
    dataset = build_folder_dataset(str(tmp_path / "tar"), "train")
    names = class_names(dataset)
    assert names == ["a", "b"] and len(dataset) == 4
    for i in range(len(dataset)):
        assert names[int(dataset[i][1])] == os.path.normpath(dataset.filename(i)).split(os.sep)[-2]
    write(tmp_path / "src" / wrapper, ["a/more/x.png"])  # below the wrapper, a nested folder is refused again
    with tarfile.open(tmp_path / "tar" / "train.tar", "w") as tar:
        tar.add(tmp_path / "src" / wrapper.split("/")[0], arcname=wrapper.split("/")[0])
    with pytest.raises(DataError, match=rf"1 image\(s\) outside a class folder, e.g. {wrapper}/a/more/x\.png"):
        build_folder_dataset(str(tmp_path / "tar"), "train")


def test_a_wrapper_folder_of_class_tars_names_its_classes_after_them(tmp_path):
    class_tars(tmp_path / "train.tar", {"train/b.tar": ["0.png"], "train/a.tar": ["0.png", "1.png"]})
    dataset = build_folder_dataset(str(tmp_path), "train")
    assert class_names(dataset) == ["a", "b"] and len(dataset) == 3
