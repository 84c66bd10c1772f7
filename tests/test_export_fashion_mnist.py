"""scripts/export_fashion_mnist.py on tiny synthetic idx.gz files: the class folders, the per-class subset,
the exact pixel values, labels as the repository's folder loader reads them, and the refusals."""
import errno
import gzip
import os
import struct

import numpy as np
import pytest
from PIL import Image

import export_fashion_mnist as fm


def write_idx(path, array):
    """An idx file as the data set ships it: 0, 0, type 0x08 (ubyte), ndim, big-endian sizes, bytes."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(">" + "I" * array.ndim, *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def source(tmp_path):
    """3 train images per class (6 for class 4) and 1 test image per class, shuffled, random pixels."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "src"
    folder.mkdir()
    data = {}
    for split, labels in (("train", np.array([*range(10)] * 3 + [4] * 3)), ("val", np.arange(10))):
        labels = rng.permutation(labels).astype(np.uint8)
        images = rng.integers(0, 256, (len(labels), 28, 28), dtype=np.uint8)
        image_file, label_file = fm.FILES[split]
        write_idx(folder / image_file, images)
        write_idx(folder / label_file, labels)
        data[split] = (images, labels)
    return str(folder), data


def test_exports_class_folders_with_the_original_pixels(source, tmp_path):
    folder, data = source
    out = tmp_path / "out"
    counts = fm.export(folder, str(out), train_per_class=2)
    assert counts == {"train": 20, "val": 10}
    expected_classes = ["0_t-shirt_top", "1_trouser", "2_pullover", "3_dress", "4_coat", "5_sandal",
                        "6_shirt", "7_sneaker", "8_bag", "9_ankle_boot"]
    for split, per_class in (("train", 2), ("val", 1)):
        assert sorted(os.listdir(out / split)) == expected_classes
        images, labels = data[split]
        for label, name in enumerate(expected_classes):
            files = sorted(os.listdir(out / split / name))
            first = np.flatnonzero(labels == label)[:per_class]  # the first N of the class, in file order
            assert files == [f"{i:05d}.png" for i in first]
            for f in files:
                img = Image.open(out / split / name / f)
                assert img.mode == "L" and img.size == (28, 28)
                assert np.array_equal(np.asarray(img), images[int(f[:-4])])


def test_the_folder_loader_reads_the_labels_of_the_data_set(source, tmp_path):
    from data.folder import build_folder_dataset, class_names
    folder, data = source
    out = tmp_path / "out"
    fm.export(folder, str(out))  # every image
    dataset = build_folder_dataset(str(out), "train")
    assert class_names(dataset) == [fm.class_folder(i) for i in range(10)]  # index i is Fashion-MNIST label i
    images, labels = data["train"]
    assert len(dataset) == len(labels)
    for i in range(len(dataset)):
        img, target = dataset[i]
        index = int(os.path.basename(dataset.filename(i, absolute=True))[:-4])
        assert target == labels[index]
        assert np.array_equal(np.asarray(img.convert("L")), images[index])


def test_a_non_empty_output_folder_is_refused(source, tmp_path, capsys):
    folder, _ = source
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert fm.main(["--source", folder, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(out) in err and "remove it or give another --out" in err
    assert os.listdir(out) == ["keep.txt"]  # nothing written


def test_bad_inputs_are_error_lines(source, tmp_path, capsys):
    folder, _ = source
    assert fm.main(["--source", folder, "--out", str(tmp_path / "a"), "--train-per-class", "4"]) == 2
    assert "fewer than the 4 asked for" in capsys.readouterr().err  # class 0 has 3 training images
    assert fm.main(["--source", folder, "--out", str(tmp_path / "v"), "--val-per-class", "1000"]) == 2
    assert "the val split has" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "v")  # no train images written before the val selection failed
    (tmp_path / "file").write_text("mine")
    assert fm.main(["--source", folder, "--out", str(tmp_path / "file" / "out")]) == 2  # under a file
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "give a writable folder" in lines[0] and (tmp_path / "file").read_text() == "mine"
    assert fm.main(["--source", str(tmp_path / "none"), "--out", str(tmp_path / "b")]) == 2
    assert "apt-get install -y dataset-fashion-mnist" in capsys.readouterr().err
    with gzip.open(os.path.join(folder, fm.FILES["val"][1]), "wb") as f:
        f.write(b"\x00\x00\x0d\x01" + struct.pack(">I", 10) + bytes(40))  # float data: not Fashion-MNIST's
    assert fm.main(["--source", folder, "--out", str(tmp_path / "c")]) == 2
    assert "not an idx file of unsigned bytes" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "c")  # everything is read before anything is written


@pytest.mark.parametrize("damage", ["sizes cut short", "gzip cut short", "gzip corrupt", "one byte short",
                                    "one byte extra"])
def test_a_damaged_idx_file_is_one_error_line(source, tmp_path, capsys, damage):
    folder, _ = source
    path = os.path.join(folder, fm.FILES["val"][0])
    if damage == "sizes cut short":  # 3 dimensions promised, the file ends inside the first size
        with gzip.open(path, "wb") as f:
            f.write(b"\x00\x00\x08\x03\x00\x00")
    elif damage.startswith("one byte"):  # the header's 10 x 28 x 28 sizes kept, the pixel bytes one off
        with gzip.open(path, "rb") as f:
            data = f.read()
        with gzip.open(path, "wb") as f:
            f.write(data[:-1] if damage == "one byte short" else data + b"\x00")
    else:
        with gzip.open(path, "rb") as f:
            data = bytearray(gzip.compress(f.read(), mtime=0))  # a header of 10 bytes, no file name
        if damage == "gzip cut short":
            data = data[:len(data) // 2]
        else:  # the first deflate block of the reserved type 3: zlib's "invalid block type"
            data[10] = 0b111
        open(path, "wb").write(bytes(data))
    assert fm.main(["--source", folder, "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and path in lines[0], lines
    assert not os.path.exists(tmp_path / "out")


def test_an_empty_out_is_refused_instead_of_writing_into_the_current_folder(source, tmp_path, monkeypatch, capsys):
    folder, _ = source
    here = tmp_path / "here"
    here.mkdir()
    (here / "keep.txt").write_text("mine")
    monkeypatch.chdir(here)
    assert fm.main(["--source", folder, "--out", ""]) == 2
    assert capsys.readouterr().err.startswith("error: --out is empty")
    assert os.listdir(here) == ["keep.txt"]


def test_an_empty_out_folder_and_a_class_of_exactly_n_images_are_accepted(source, tmp_path):
    folder, _ = source
    out = tmp_path / "out"
    out.mkdir()  # "must be empty or absent"
    assert fm.export(folder, str(out), train_per_class=3, val_per_class=1) == {"train": 30, "val": 10}


def test_a_label_beyond_the_ten_classes_is_one_error_line(source, tmp_path, capsys):
    folder, data = source
    write_idx(os.path.join(folder, fm.FILES["val"][1]), np.append(data["val"][1][:-1], 10))
    assert fm.main(["--source", folder, "--out", str(tmp_path / "out")]) == 2
    assert "labels go up to 10; Fashion-MNIST has 10 classes" in capsys.readouterr().err


@pytest.mark.parametrize("shape", [(10, 1, 784), (0, 28, 28)], ids=["not_28x28", "no_image"])
def test_images_that_are_not_28x28_or_none_are_one_error_line(source, tmp_path, capsys, shape):
    """[10, 1, 784] was written as 1x784 PNGs, and an empty split as an empty tree, both with exit 0."""
    folder, _ = source
    write_idx(os.path.join(folder, fm.FILES["val"][0]), np.zeros(shape, np.uint8))
    write_idx(os.path.join(folder, fm.FILES["val"][1]), np.zeros(shape[0], np.uint8))
    assert fm.main(["--source", folder, "--out", str(tmp_path / "out")]) == 2
    assert f"val images {shape}: Fashion-MNIST holds 28x28 images, at least one" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_labels_that_do_not_pair_with_the_images_are_one_error_line(source, tmp_path, capsys):
    """10 test images and 9 labels: the last image has no label, so nothing is exported."""
    folder, data = source
    write_idx(os.path.join(folder, fm.FILES["val"][1]), data["val"][1][:-1])
    assert fm.main(["--source", folder, "--out", str(tmp_path / "out")]) == 2
    assert "val images (10, 28, 28) and labels (9,) do not pair up" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("magic", [b"\x01\x00\x08\x01", b"\x00\x01\x08\x01"], ids=["first_byte", "second_byte"])
def test_an_idx_header_without_its_two_zero_bytes_is_refused(tmp_path, magic):
    path = tmp_path / "labels.idx"
    path.write_bytes(magic + struct.pack(">I", 3) + bytes([1, 2, 3]))
    with pytest.raises(fm.ExportError, match=f"header {magic.hex()}"):
        fm.read_idx(str(path))


def test_an_uncompressed_idx_file_is_read_too(tmp_path):
    """read_idx takes the idx format with or without gzip: the bytes written by hand here, not through gzip."""
    path = tmp_path / "images.idx"
    path.write_bytes(bytes([0, 0, 8, 2]) + struct.pack(">II", 2, 3) + bytes(range(6)))
    assert np.array_equal(fm.read_idx(str(path)), np.arange(6, dtype=np.uint8).reshape(2, 3))


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError], ids=["ctrl_c", "full_disk"])
@pytest.mark.parametrize("made", [False, True], ids=["absent", "empty_folder"])
def test_an_export_cut_short_leaves_no_partial_set_that_a_run_would_train_on(source, tmp_path, monkeypatch, stop,
                                                                              made):
    """Cut off in its val images (Ctrl-C, a full disk), the export left a tree of all the train images and some of
    the val ones at --out, which train.py read as the data set and which the same command refused as not empty: the
    images appear at --out only once all are written, a user's empty --out stays as it was, no temporary is left,
    and the same command then exports the whole set."""
    folder, _ = source
    out = tmp_path / "out"
    if made:
        out.mkdir()
    saved, save = [], Image.Image.save

    def save_until_cut(image, path, *args, **kwargs):
        if len(saved) == 35:  # the 30 train images, then 5 of the 10 val ones
            raise stop(28, "No space left on device") if stop is OSError else stop()
        saved.append(path)
        return save(image, path, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", save_until_cut)
    with pytest.raises(fm.ExportError if stop is OSError else KeyboardInterrupt):
        fm.export(folder, str(out), train_per_class=3)
    assert len(saved) == 35
    assert sorted(os.listdir(tmp_path)) == (["out", "src"] if made else ["src"])
    assert not made or os.listdir(out) == []
    monkeypatch.setattr(Image.Image, "save", save)
    assert fm.export(folder, str(out), train_per_class=3) == {"train": 30, "val": 10}
    assert [len(os.listdir(out / "val" / fm.class_folder(label))) for label in range(10)] == [1] * 10


def test_the_current_folder_as_out_is_filled_not_replaced(source, tmp_path, monkeypatch):
    """--out . (an empty current folder): the set appears in the folder itself, which stays the current one (a
    folder renamed over it left the shell in a deleted folder, the set out of its sight)."""
    folder, _ = source
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert fm.main(["--source", folder, "--out", ".", "--train-per-class", "1"]) == 0
    assert sorted(os.listdir(".")) == ["train", "val"]
    assert os.path.samefile(".", here) and sorted(os.listdir(tmp_path)) == ["here", "src"]


def test_a_file_put_into_out_during_the_export_is_kept_and_nothing_is_mixed_in(source, tmp_path, monkeypatch):
    """--out was empty when the export started; a file another command put there meanwhile stays, alone: the images
    are not mixed in with it (one error line), and no temporary is left."""
    folder, _ = source
    out = tmp_path / "out"
    out.mkdir()
    save = Image.Image.save

    def save_while_another_writes(image, path, *args, **kwargs):
        (out / "keep.txt").write_text("mine")
        return save(image, path, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", save_while_another_writes)
    with pytest.raises(fm.ExportError, match=f"--out {out}: Directory not empty"):
        fm.export(folder, str(out), train_per_class=1)
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


@pytest.mark.parametrize("boundary", ["mount_point", "parent_not_writable"])
def test_an_empty_out_on_another_file_system_or_under_a_folder_not_writable_is_filled(source, tmp_path, monkeypatch,
                                                                                       boundary):
    """An empty --out that is a mount point (a container's volume) or lies in a folder the user may not write: the
    set was written beside it, on the parent's file system, and each entry's rename into --out failed (EXDEV), or
    nothing could be made beside it (EACCES), an ExportError on a folder that takes files. Both are modelled here
    (root ignores permissions, and a mount needs it): renames that cross --out's boundary fail, as between mounts."""
    folder, _ = source
    out = tmp_path / "out"
    out.mkdir()
    inside = str(out) + os.sep
    rename, mkdir = os.rename, os.mkdir

    def rename_on_one_file_system(src, dst, *args, **kwargs):
        if str(src).startswith(inside) != str(dst).startswith(inside):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), src, dst)
        return rename(src, dst, *args, **kwargs)

    def mkdir_in_out_alone(path, *args, **kwargs):
        if os.path.dirname(os.path.abspath(path)) == str(tmp_path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return mkdir(path, *args, **kwargs)

    if boundary == "mount_point":
        monkeypatch.setattr(os, "rename", rename_on_one_file_system)
    else:
        monkeypatch.setattr(os, "mkdir", mkdir_in_out_alone)
    assert fm.export(folder, str(out), train_per_class=1) == {"train": 10, "val": 10}
    assert sorted(os.listdir(out)) == ["train", "val"] and sorted(os.listdir(tmp_path)) == ["out", "src"]
    assert [len(os.listdir(out / "train" / fm.class_folder(label))) for label in range(10)] == [1] * 10
