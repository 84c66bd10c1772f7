"""data/coco_sample.py: the generated COCO-format set is what pycocotools reads, its masks are the drawn shapes up
to a one-pixel outline (the bound its docstring states), and nothing is written over an existing folder."""
from __future__ import annotations

import ast
import os
import random
import re

import numpy as np
import pytest
from PIL import Image

from data.coco_sample import CLASSES, write_coco_sample
import make_coco_sample

pycocotools = pytest.importorskip("pycocotools.coco")


def test_sample_is_coco_and_masks_are_the_drawn_objects(tmp_path):
    root = str(tmp_path / "s")
    counts = write_coco_sample(root, train=3, val=2, size=64, seed=1)
    assert (counts["train2017"], counts["val2017"]) == (3, 2)
    total = 0
    for split in ("train2017", "val2017"):
        coco = pycocotools.COCO(os.path.join(root, "annotations", f"instances_{split}.json"))
        assert [c["name"] for c in coco.loadCats(coco.getCatIds())] == list(CLASSES)
        for image_id in coco.getImgIds():
            info = coco.loadImgs(image_id)[0]
            pixels = np.asarray(Image.open(os.path.join(root, split, info["file_name"]))).astype(int)
            background = (pixels >= 60) & (pixels < 140)  # every background channel value lies there
            anns = coco.loadAnns(coco.getAnnIds(imgIds=image_id))
            assert 1 <= len(anns) <= 3
            objects = np.zeros(pixels.shape[:2], bool)
            for ann in anns:
                mask = coco.annToMask(ann).astype(bool)
                assert abs(mask.sum() - ann["area"]) <= 0.1 * ann["area"] + 8  # rasterised polygon vs shoelace
                x, y, w, h = ann["bbox"]
                ys, xs = np.nonzero(mask)
                # the box is the mask's bounds: within a pixel of rasterisation on every side
                assert abs(xs.min() - x) <= 1 and abs(xs.max() + 1 - (x + w)) <= 1
                assert abs(ys.min() - y) <= 1 and abs(ys.max() + 1 - (y + h)) <= 1
                assert not (objects & mask).any(), "objects overlap"
                objects |= mask
            # every object pixel has a channel outside the background band; every other pixel has none
            inside = ~background.all(axis=2)
            assert (inside[objects]).mean() > 0.95 and (inside[~objects]).mean() < 0.05
            total += len(anns)
    assert total == counts["annotations"]


def grown(mask: np.ndarray) -> np.ndarray:
    """`mask` grown by one pixel: every pixel whose 3x3 neighbourhood holds a mask pixel."""
    padded = np.pad(mask, 1)
    h, w = mask.shape
    return np.any([padded[dy:dy + h, dx:dx + w] for dy in range(3) for dx in range(3)], axis=0)


def stated_iou_bound() -> float:
    """The drawn-vs-mask IoU bound at 64 pixels that data/coco_sample.py's docstring states (read from the source:
    __doc__ is None under python -OO)."""
    with open(os.path.join(os.path.dirname(__file__), "..", "data", "coco_sample.py")) as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    found = re.search(r"64-pixel images \(the default\) it is at least ([0-9.]+)", doc.replace("\n", " "))
    assert found, "the docstring states no drawn-vs-mask bound at 64 pixels"
    return float(found.group(1))


def test_each_object_is_drawn_as_its_mask_up_to_one_pixel_and_the_stated_iou_bound_holds(tmp_path):
    """Against pycocotools' own rasterisation (annToMask) of each annotation: an object's drawn pixels (a channel
    outside the background's 60-139) lie within one pixel of its mask and the reverse, and the intersection over
    union of the two, over the 64-pixel set of docs/measurements.md's smoke run (96 + 32 images, seed 0), is at
    least the docstring's bound, which its smallest box reaches (the bound is no looser than what holds)."""
    bound = stated_iou_bound()
    root = str(tmp_path / "s")
    write_coco_sample(root, train=96, val=32, size=64, seed=0)
    ious = []
    for split in ("train2017", "val2017"):
        coco = pycocotools.COCO(os.path.join(root, "annotations", f"instances_{split}.json"))
        for image_id in coco.getImgIds():
            info = coco.loadImgs(image_id)[0]
            pixels = np.asarray(Image.open(os.path.join(root, split, info["file_name"]))).astype(int)
            painted = ~((pixels >= 60) & (pixels < 140)).all(axis=2)
            masks = [coco.annToMask(ann).astype(bool) for ann in coco.loadAnns(coco.getAnnIds(imgIds=image_id))]
            # objects lie far apart (data/coco_sample.py), so an object's drawn pixels are those near its mask
            assert not (painted & ~np.any([grown(m) for m in masks], axis=0)).any(), "a drawn pixel far from masks"
            for mask in masks:
                drawn = painted & grown(mask)
                assert not (mask & ~grown(drawn)).any(), "a mask pixel far from the drawn object"
                ious.append((drawn & mask).sum() / (drawn | mask).sum())
    assert len(ious) > 200
    assert bound <= min(ious) < bound + 0.005, (bound, min(ious))
    assert 0.9 < np.mean(ious) < 0.94


def test_an_existing_folder_is_never_written_over(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        write_coco_sample(str(tmp_path))
    assert os.listdir(tmp_path) == ["keep.txt"]
    with pytest.raises(ValueError):
        write_coco_sample(str(tmp_path / "new"), train=0)


@pytest.mark.parametrize("made", [False, True], ids=["absent", "empty_folder"])
def test_a_set_cut_short_leaves_nothing_at_root_and_the_same_command_then_writes_it(tmp_path, monkeypatch, made):
    """Cut off in its val images (Ctrl-C), the set was left at root with all its train split and part of the val
    one, and the same command refused root as not empty: the set appears at root only once whole, a user's empty
    root stays as it was, no temporary is left, and the same command then writes the set."""
    root = tmp_path / "s"
    if made:
        root.mkdir()
    saved, save = [], Image.Image.save

    def save_until_cut(image, path, *args, **kwargs):
        if len(saved) == 4:  # the 3 train images, then 1 of the 2 val ones
            raise KeyboardInterrupt
        saved.append(path)
        return save(image, path, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", save_until_cut)
    with pytest.raises(KeyboardInterrupt):
        write_coco_sample(str(root), train=3, val=2, size=32)
    assert len(saved) == 4 and os.listdir(tmp_path) == (["s"] if made else [])
    assert not made or os.listdir(root) == []
    monkeypatch.setattr(Image.Image, "save", save)
    assert write_coco_sample(str(root), train=3, val=2, size=32)["val2017"] == 2
    assert sorted(os.listdir(root)) == ["annotations", "train2017", "val2017"]


@pytest.mark.parametrize("kwargs", [{"size": 100_000}, {"size": 31}, {"train": 100_001}, {"val": 0}])
def test_settings_out_of_range_are_refused_before_anything_is_written(tmp_path, kwargs):
    with pytest.raises(ValueError, match="need 1 <= train <= 100000"):
        write_coco_sample(str(tmp_path / "new"), **kwargs)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("seed", [-1, -5])
def test_a_negative_seed_is_one_error_line_before_anything_is_written(tmp_path, capsys, seed):
    """random.Random seeds with the seed's absolute value, so a negative seed silently wrote the set of -seed."""
    assert random.Random(seed).random() == random.Random(-seed).random()  # why it is refused, not mapped
    assert make_coco_sample.main([str(tmp_path / "new"), "--seed", str(seed)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: seed {seed}: give a seed >= 0"), lines
    assert not (tmp_path / "new").exists()
    assert make_coco_sample.main([str(tmp_path / "zero"), "--train", "1", "--val", "1", "--size", "32",
                                  "--seed", "0"]) == 0  # 0, the default, is a seed


def test_a_root_under_a_file_is_one_error_line(tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    assert make_coco_sample.main([str(tmp_path / "file" / "sample")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "writable new folder" in lines[0], lines
    assert (tmp_path / "file").read_text() == "mine"


def test_an_empty_root_is_one_error_line_not_a_write_into_the_current_folder(tmp_path, monkeypatch, capsys):
    here = tmp_path / "here"
    here.mkdir()
    (here / "keep.txt").write_text("mine")
    monkeypatch.chdir(here)
    assert make_coco_sample.main([""]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "root folder is empty" in lines[0], lines
    assert os.listdir(here) == ["keep.txt"]


def test_the_command_line_passes_every_setting_and_refuses_with_exit_status_2(tmp_path, capsys):
    root = tmp_path / "cli"
    assert make_coco_sample.main([str(root), "--train", "3", "--val", "1", "--size", "40", "--seed", "5"]) == 0
    assert capsys.readouterr().out.startswith("3 train and 1 val images")
    assert len(os.listdir(root / "train2017")) == 3 and len(os.listdir(root / "val2017")) == 1
    write_coco_sample(str(tmp_path / "ref"), train=3, val=1, size=40, seed=5)  # the same set, from the function
    for split in ("train2017", "val2017"):
        name = f"annotations/instances_{split}.json"
        assert (root / name).read_text() == (tmp_path / "ref" / name).read_text()
    assert Image.open(next((root / "val2017").iterdir())).size == (40, 40)
    assert make_coco_sample.main([str(root)]) == 2  # not empty
    assert capsys.readouterr().err.strip().endswith("give a new folder (nothing is overwritten)")
    assert make_coco_sample.main([str(tmp_path / "bad"), "--size", "8"]) == 2
    assert capsys.readouterr().err.startswith("error: need 1 <= train")


def test_boxes_are_squares_and_discs_regular_24_gons_in_closed_form(tmp_path):
    """A box's polygon is its 4 corners: bbox w = h and area w * h. A disc is a regular 24-gon of radius r = w / 2
    (vertices at 0 and 180 degrees span the width): area 12 r^2 sin(2 pi / 24), bbox h = w. The pixel at an object's
    centre has every channel far from the background's 60-139: at most 30 or at least 180."""
    import json
    root = tmp_path / "s"
    write_coco_sample(str(root), train=6, val=1, size=96, seed=2)
    coco = json.loads((root / "annotations" / "instances_train2017.json").read_text())
    files = {image["id"]: image["file_name"] for image in coco["images"]}
    anns = coco["annotations"]
    kinds = {CLASSES[a["category_id"] - 1] for a in anns}
    assert kinds == {"box", "disc"}  # both shapes occur in this sample
    for ann in anns:
        x, y, w, h = ann["bbox"]
        points = len(ann["segmentation"][0]) // 2
        if CLASSES[ann["category_id"] - 1] == "box":
            assert points == 4 and ann["area"] == pytest.approx(w * w, rel=1e-9)
        else:
            r = w / 2
            assert points == 24 and ann["area"] == pytest.approx(12 * r * r * np.sin(2 * np.pi / 24), rel=1e-9)
        assert h == pytest.approx(w, rel=1e-9), ann
        pixels = np.asarray(Image.open(root / "train2017" / files[ann["image_id"]]))
        centre = pixels[int(y + h / 2), int(x + w / 2)]
        assert all(c <= 30 or c >= 180 for c in centre), (ann, centre)


def test_an_image_holds_one_to_three_objects_and_each_count_occurs():
    """Over 200 seeded draws on a 256-px image, where four objects would fit, the counts are exactly {1, 2, 3}."""
    import random

    from data.coco_sample import _objects
    counts = {len(_objects(random.Random(seed), 256)) for seed in range(200)}
    assert counts == {1, 2, 3}


def test_image_and_annotation_ids_are_unique_across_the_splits(tmp_path):
    """train images are 1, 2, ...; val images 100001, ...; annotations are numbered 1..N over both files."""
    import json
    root = tmp_path / "s"
    counts = write_coco_sample(str(root), train=3, val=2, size=48, seed=4)
    files = {split: json.loads((root / "annotations" / f"instances_{split}.json").read_text())
             for split in ("train2017", "val2017")}
    assert [i["id"] for i in files["train2017"]["images"]] == [1, 2, 3]
    assert [i["id"] for i in files["val2017"]["images"]] == [100_001, 100_002]
    ann_ids = [a["id"] for f in files.values() for a in f["annotations"]]
    assert ann_ids == list(range(1, counts["annotations"] + 1))


def test_the_seed_decides_the_set(tmp_path):
    """The same seed writes the same annotations again; another seed other ones."""
    def annotations(name, seed):
        write_coco_sample(str(tmp_path / name), train=2, val=1, size=48, seed=seed)
        return (tmp_path / name / "annotations" / "instances_train2017.json").read_text()
    assert annotations("a", 3) == annotations("b", 3) != annotations("c", 4)


def test_a_val_count_above_the_bound_is_one_error_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """--val is bounded as --train is (100000 images a split): a larger count was taken, and written image by
    image. Drawing an object fails here, so that a count taken fails at once instead of writing the set."""
    import data.coco_sample as coco_sample

    def drawn(*args):
        raise AssertionError("a set was drawn")
    monkeypatch.setattr(coco_sample, "_objects", drawn)
    assert make_coco_sample.main([str(tmp_path / "new"), "--val", "100001"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: need ") and "1 <= val <= 100000" in lines[0], lines
    assert not (tmp_path / "new").exists()
