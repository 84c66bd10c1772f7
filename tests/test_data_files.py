"""Image folders: the files checked, counted and reported are exactly the files timm reads, and every file
that cannot be read is handled one way (left out or replaced, named, counted), in evaluation, training and
calibration alike, whatever PIL raises for it."""
import os
import re
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from configs import load_config
from data import DataError, build_eval_loader, build_loaders, calibration_images
from engine.loop import NothingScoredError, TrainLoop, TrainState, evaluate
from tests.conftest import DEBUG_CONFIG, make_folder


def folder_config(root, *overrides):
    return load_config([DEBUG_CONFIG], ["data.dataset=folder", f"data.root={root}", "model.num_classes=2",
                                        "data.auto_augment=", "data.mixup=0", "data.cutmix=0", *overrides])


def eval_loader(root, *overrides, batch=4):
    return build_eval_loader(folder_config(root, *overrides).data, img_size=32, batch_size_per_gpu=batch, rank=0,
                             world_size=1, num_classes=2)


def linear_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 2))


# -- class 1: what is counted is what is read --------------------------------------------------------------

def test_the_extensions_are_timm_s():
    from timm.data import get_img_extensions

    from data.folder import read_extensions

    assert read_extensions() == tuple(get_img_extensions())


@pytest.mark.parametrize("ext", [".webp", ".bmp", ".tif", ".gif", ".jfif", ".PPM"])
def test_an_image_timm_would_skip_is_refused_with_its_name(tmp_path, ext):
    """17 val files, 2 of them in a format timm skips: refused, never scored on 15 without a word."""
    make_folder(tmp_path, {"train": {"a": 4, "b": 4}, "val": {"a": 8, "b": 7}})
    make_folder(tmp_path / "extra", {"val": {"b": 2}}, ext=ext)
    for i in range(2):
        os.replace(tmp_path / "extra" / "val" / "b" / f"{i}{ext}", tmp_path / "val" / "b" / f"x{i}{ext}")
    with pytest.raises(DataError, match=rf"2 image file\(s\) that timm's reader skips .*e\.g\. "
                                        rf"b/x0\{ext}, b/x1\{ext}.*Convert them"):
        eval_loader(tmp_path)


def test_a_class_folder_of_skipped_images_is_named_as_such_not_as_empty(tmp_path):
    make_folder(tmp_path, {"train": {"a": 4}, "val": {"a": 2}})
    make_folder(tmp_path, {"train": {"b": 4}, "val": {"b": 2}}, ext=".webp")
    with pytest.raises(DataError, match=r"train: 4 image file\(s\) that timm's reader skips"):
        build_loaders(folder_config(tmp_path).data, img_size=32, batch_size_per_gpu=2,
                      eval_batch_size_per_gpu=2, rank=0, world_size=1, seed=0, num_classes=2)


def test_upper_case_extensions_and_other_files_count_as_timm_counts_them(tmp_path):
    make_folder(tmp_path, {"val": {"a": 3, "b": 2}}, ext=".PNG")
    for name in ("notes.txt", "labels.csv", "b/README"):
        (tmp_path / "val" / name).write_text("not an image")
    loader = eval_loader(tmp_path)
    assert len(loader.dataset) == 5
    assert evaluate(linear_model(), loader, torch.device("cpu"))["count"] == 5


def test_a_tar_split_with_a_skipped_image_is_refused(tmp_path):
    make_folder(tmp_path / "src", {"val": {"a": 2, "b": 2}})
    make_folder(tmp_path / "src", {"val": {"c": 1}}, ext=".bmp")
    os.makedirs(tmp_path / "data")
    with tarfile.open(tmp_path / "data" / "val.tar", "w") as tar:
        tar.add(tmp_path / "src" / "val", arcname=".")
    with pytest.raises(DataError, match=r"1 image file\(s\) that timm's reader skips.*c/0\.bmp"):
        build_eval_loader(folder_config(tmp_path / "data").data, img_size=32, batch_size_per_gpu=2, rank=0,
                          world_size=1, num_classes=2)


@pytest.mark.parametrize("name, archive, says", [("val", False, "a file, not a folder"),
                                                  ("val.tar", False, "not a tar archive"),
                                                  # timm's reader takes a .tar by its name alone: without it, an
                                                  # archive is read as a folder
                                                  ("val", True, "a file, not a folder")])
def test_a_split_that_is_neither_a_folder_nor_a_tar_archive_is_refused_with_its_path(tmp_path, name, archive, says):
    """data.root/val a plain file (or an archive without the .tar name), or a val.tar that is no archive: a
    DataError naming it and what it is, not tarfile's ReadError from inside the checks."""
    os.makedirs(tmp_path / "data")
    if archive:
        make_folder(tmp_path / "src", {"val": {"a": 2, "b": 2}})
        with tarfile.open(tmp_path / "data" / name, "w") as tar:
            tar.add(tmp_path / "src" / "val", arcname=".")
    else:
        (tmp_path / "data" / name).write_bytes(b"not a folder, not an archive")
    with pytest.raises(DataError, match=rf"data/{name} is {says}: .*<split>\.tar"):
        eval_loader(tmp_path / "data")


@pytest.mark.parametrize("split", ["", ".", "./"])
def test_a_split_name_that_names_the_root_itself_is_refused(tmp_path, split):
    """data.val_split= (empty) or '.' would make the split folders train/ and val/ the classes."""
    make_folder(tmp_path, {"train": {"a": 2, "b": 2}, "val": {"a": 2, "b": 2}})
    with pytest.raises(DataError, match=rf"the split name '{re.escape(split)}' names data.root itself"):
        eval_loader(tmp_path, "data.val_split=" + split)


# -- class 2: a sample that fails, whatever PIL raises -----------------------------------------------------

def spoil(path, how, monkeypatch):
    """Make the image at `path` fail the way `how` says."""
    if how == "garbage":
        path.write_bytes(b"not an image at all")
    elif how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "bomb":  # PIL's decompression-bomb limit: an Exception, not an OSError
        Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8)).save(path)
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1500)
    elif how == "unreadable file":
        path.chmod(0)
    elif how == "broken png chunk":  # PIL raises SyntaxError / struct.error for such files
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\x0dIHDR" + b"\x00" * 5)


FAILURES = ["garbage", "truncated", "bomb", "broken png chunk"] + (["unreadable file"] if os.getuid() else [])


@pytest.mark.parametrize("how", FAILURES)
def test_evaluation_leaves_out_names_and_counts_any_failing_image(tmp_path, how, monkeypatch, caplog):
    make_folder(tmp_path, {"val": {"a": 3, "b": 3}})
    spoil(tmp_path / "val" / "b" / "1.png", how, monkeypatch)
    with caplog.at_level("WARNING"):
        result = evaluate(linear_model(), eval_loader(tmp_path), torch.device("cpu"))
    assert result["count"] == 5 and result["excluded"] == 1
    assert os.path.join("b", "1.png") in caplog.text


def test_an_evaluation_that_scores_no_image_is_an_error_not_a_top1_of_zero(tmp_path, caplog):
    """Every val image unreadable (or an empty loader): train.py logged "val top-1 0.00% on 0 images", called
    it chance level and kept best.pt; a result made of no image is refused on every rank."""
    make_folder(tmp_path, {"val": {"a": 2, "b": 1}})
    for path in (tmp_path / "val").rglob("*.png"):
        path.write_bytes(b"not an image")
    with pytest.raises(NothingScoredError, match=r"no image was scored: all 3 image\(s\) are unreadable"):
        evaluate(linear_model(), eval_loader(tmp_path), torch.device("cpu"))
    with pytest.raises(NothingScoredError, match="the data loader yielded no image"):
        evaluate(linear_model(), [], torch.device("cpu"))


@pytest.mark.parametrize("how", ["garbage", "bomb"])
def test_training_replaces_names_and_counts_failing_images(tmp_path, how, monkeypatch, caplog):
    make_folder(tmp_path, {"train": {"a": 4, "b": 4}, "val": {"a": 2, "b": 2}})
    spoil(tmp_path / "train" / "a" / "2.png", how, monkeypatch)
    cfg = folder_config(tmp_path)
    loaders = build_loaders(cfg.data, img_size=32, batch_size_per_gpu=4, eval_batch_size_per_gpu=4, rank=0,
                            world_size=1, seed=0, num_classes=2)
    model = linear_model()
    seen = []

    def compute_loss(m, x, y):
        seen.append(y.clone())
        return torch.nn.functional.cross_entropy(m(x), y)

    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     compute_loss=compute_loss, device=torch.device("cpu"), log_every=1)
    state = TrainState()
    with caplog.at_level("WARNING"):
        assert loop.run_epoch(loaders.train, state, batch_size_per_gpu=4) == "epoch_end"
    assert state.unreadable_images == 1 and all((y >= 0).all() for y in seen)
    assert "1 unreadable training image(s) replaced" in caplog.text
    assert os.path.join(str(tmp_path), "train", "a", "2.png") in caplog.text


def test_a_training_batch_without_a_readable_image_is_a_data_error(tmp_path):
    make_folder(tmp_path, {"train": {"a": 2, "b": 2}, "val": {"a": 1, "b": 1}})
    for path in (tmp_path / "train").rglob("*.png"):
        path.write_bytes(b"gone")
    loaders = build_loaders(folder_config(tmp_path).data, img_size=32, batch_size_per_gpu=4,
                            eval_batch_size_per_gpu=2, rank=0, world_size=1, seed=0, num_classes=2)
    model = linear_model()
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     compute_loss=lambda m, x, y: m(x).sum(), device=torch.device("cpu"))
    with pytest.raises(DataError, match="none of the 4 images of a training batch could be read"):
        loop.run_epoch(loaders.train, TrainState(), batch_size_per_gpu=4)


def test_calibration_leaves_out_and_names_failing_images(tmp_path, monkeypatch, caplog):
    make_folder(tmp_path, {"train": {"a": 3, "b": 3}})
    spoil(tmp_path / "train" / "a" / "0.png", "bomb", monkeypatch)
    cfg = folder_config(tmp_path)
    with caplog.at_level("WARNING"):
        images = calibration_images(cfg.data, 32, 2, count=5, seed=0)
    assert images.shape[0] == 5 and "a/0.png" in caplog.text
    with pytest.raises(DataError, match="only 5 readable"):
        calibration_images(cfg.data, 32, 2, count=6, seed=0)


def test_a_16_bit_grayscale_png_is_scaled_to_8_bits_and_32_bit_pixels_are_refused(tmp_path):
    """PIL's convert('RGB') clips 16-bit grayscale (I;16) to 0..255: a 16-bit PNG read almost white (mean 254
    for a gradient whose mean is 127.5). It reads as the 8-bit image of the same values now; 32-bit integer and
    float pixels have no range to map, so they are refused (a file of them is marked unreadable), not guessed."""
    from data.folder import build_folder_dataset, to_rgb

    make_folder(tmp_path, {"val": {"a": 1, "b": 1}})
    wide = np.linspace(0, 65535, 16 * 16).reshape(16, 16).astype(np.uint16)
    Image.fromarray(wide).save(tmp_path / "val" / "a" / "0.png")
    dataset = build_folder_dataset(str(tmp_path), "val")
    gray, target = next((img, t) for i, (img, t) in enumerate(dataset) if dataset.filename(i).startswith("a"))
    assert target == 0 and gray.mode == "RGB"
    expected = np.rint(wide / 257.0).astype(np.uint8)  # the 8-bit value of each 16-bit one (65535 -> 255)
    assert all(np.array_equal(np.asarray(gray)[..., c], expected) for c in range(3))
    for mode_image in (Image.fromarray(wide.astype(np.float32)), Image.fromarray(wide.astype(np.int32))):
        with pytest.raises(ValueError, match="have no 8-bit range"):
            to_rgb(mode_image)


def test_unreadable_samples_of_a_batch_are_replaced_by_the_readable_ones_in_turn():
    """Batch [bad 0, good, bad 2, good, bad 4]: the bad samples become the 1st, 2nd, then again the 1st readable
    sample (not all the same one), and are named by their files."""
    from data.folder import unreadable_replacer, unreadable_target

    class Files:
        def filename(self, index, absolute=False):
            return f"/d/{index}.png"

    images = torch.arange(5.0).view(5, 1)
    targets = torch.tensor([unreadable_target(0), 7, unreadable_target(2), 8, unreadable_target(4)])
    out, labels, names = unreadable_replacer(Files())(images, targets)
    assert out.flatten().tolist() == [1.0, 1.0, 3.0, 3.0, 1.0] and labels.tolist() == [7, 7, 8, 8, 7]
    assert names == ["/d/0.png", "/d/2.png", "/d/4.png"]
    assert images.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]  # the caller's batch is left as it was


@pytest.mark.parametrize("indices", [[0, 0, 0], [3, 3, 5, 5], [0, 1, 2, 3]])
def test_a_training_batch_without_a_readable_image_names_each_file_once(indices):
    """Repeated augmentation puts an image's repeats side by side: a batch of one bad file read 3 times named it 3
    times and blamed the mount. Each distinct file is named once, their number said, and a batch of few files
    repeated is advised as bad files; a batch of as many files as images keeps the mount advice."""
    from data.folder import unreadable_replacer, unreadable_target

    class Files:
        def filename(self, index, absolute=False):
            return f"/d/{index}.png"

    targets = torch.tensor([unreadable_target(i) for i in indices])
    with pytest.raises(DataError, match=rf"^none of the {len(indices)} images of a training batch") as refused:
        unreadable_replacer(Files())(torch.zeros(len(indices), 1), targets)
    message = str(refused.value)
    distinct = sorted(set(indices))
    assert all(message.count(f"/d/{i}.png") == 1 for i in distinct[:3]), message
    if len(distinct) < len(indices):
        assert f"they are {len(distinct)} distinct file(s)" in message and "remove or repair" in message
        assert "check that the files are there" not in message
    else:
        assert message.endswith("check that the files are there and readable")


def test_splits_of_the_same_classes_in_another_order_are_refused():
    from data.folder import check_same_classes

    check_same_classes(["cat", "dog"], ["cat", "dog"], "root")
    with pytest.raises(DataError, match=r"root: the train and val splits have different class folders \(other "
                                        r"order\)"):
        check_same_classes(["cat", "dog"], ["dog", "cat"], "root")


@pytest.mark.parametrize("members", [[], ["a/notes.txt", "b/labels.csv"]])
def test_a_tar_split_without_images_is_refused_with_its_path(tmp_path, members):
    """A .tar split holding no file timm reads (an empty archive, or only other files) is a DataError naming it,
    not timm's 'not enough values to unpack' from inside its tar reader."""
    os.makedirs(tmp_path / "data")
    with tarfile.open(tmp_path / "data" / "val.tar", "w") as tar:
        for name in members:
            (tmp_path / "member").write_text("x")
            tar.add(tmp_path / "member", arcname=name)
    with pytest.raises(DataError, match=r"val\.tar holds no images \(\.png"):
        eval_loader(tmp_path / "data")


def _tar_of_class_tars(path, images: dict) -> None:
    """`path`: a tar of one tar per class (ImageNet's ILSVRC2012_img_train.tar layout), `images` {class: [names]}."""
    import io

    def add(tar, name, data):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(path, "w") as outer:
        for cls, names in images.items():
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as tar:
                for i, name in enumerate(names):
                    png = io.BytesIO()
                    Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(png, "PNG")
                    add(tar, name, png.getvalue())
            add(outer, f"{cls}.tar", inner.getvalue())


def test_a_tar_of_class_tars_is_read_as_timm_reads_it(tmp_path):
    """timm's tar reader takes a tar of per-class tars (one level down); the split is not refused as holding no
    images. Was: 'val.tar holds no images' (only the outer tar's own members were looked at)."""
    os.makedirs(tmp_path / "data")
    _tar_of_class_tars(tmp_path / "data" / "val.tar", {"cat": ["c0.png", "c1.png"], "dog": ["d0.png", "d1.png"]})
    loader = eval_loader(tmp_path / "data")
    targets = torch.cat([t for _, t in loader])
    assert sorted(targets.tolist()) == [0, 0, 1, 1]


def test_images_timm_skips_inside_a_class_tar_are_refused(tmp_path):
    os.makedirs(tmp_path / "data")
    _tar_of_class_tars(tmp_path / "data" / "val.tar", {"cat": ["c0.png", "c1.webp"], "dog": ["d0.png"]})
    with pytest.raises(DataError, match=r"1 image file\(s\) that timm's reader skips .* e\.g\. cat\.tar/c1\.webp"):
        eval_loader(tmp_path / "data")
