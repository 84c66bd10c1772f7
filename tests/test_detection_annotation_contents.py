"""What an annotation file lists against what a detection config reads it with (engine/detection/
annotation_contents.py, data_checks.check_annotations): every image it lists must be in its loader's image folder,
and MMDetection must read its objects as the config's classes, none dropped. Each refusal is one `error:` line
before any work (scripts/train_detection.py, evaluate_detection.py); the references are a stat per name and
MMDetection's own CocoDataset.

Marked `detection`: they need MMDetection with full mmcv (scripts/install_mmcv.sh).
"""
from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import pytest

from detection_runs import SAMPLE_CONFIG, error_line

pytestmark = pytest.mark.detection


def _copy(sample, tmp_path, name):
    root = tmp_path / name
    shutil.copytree(sample, root)
    return root


def _edit(root, split, change):
    """Apply `change` to the parsed annotation file of `split` and write it back; its path."""
    path = root / "annotations" / f"instances_{split}.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return str(path)


def test_missing_images_matches_a_stat_per_name(mmdet_ready, tmp_path):
    """The one listing of the folder finds what a stat of every name finds: plain files, one in a subfolder, an
    absolute path, a symlink (a broken one is missing), a folder named like an image, a name not there."""
    from engine.detection import missing_images
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.png", "b.png", "sub/c.png"):
        (folder / name).write_bytes(b"x")
    (folder / "d.png").mkdir()  # no image
    os.symlink(folder / "a.png", folder / "link.png")
    os.symlink(folder / "gone.png", folder / "broken.png")
    outside = tmp_path / "outside.png"
    outside.write_bytes(b"x")
    names = ["a.png", "b.png", "sub/c.png", "sub/x.png", "d.png", "link.png", "broken.png", "e.png", str(outside),
             str(tmp_path / "nowhere.png"), "a.png"]
    expected = [n for n in names if not os.path.isfile(os.path.join(str(folder), n))]
    assert missing_images([{"file_name": n} for n in names], str(folder)) == expected
    assert expected == ["sub/x.png", "d.png", "broken.png", "e.png", str(tmp_path / "nowhere.png")]
    assert missing_images([{"file_name": "a.png"}], str(tmp_path / "no_folder")) == ["a.png"]


def _mmdet_reads_as_meant(path, images, classes):
    """Whether MMDetection's CocoDataset reads every object of the file at `path` under the label of its own
    category's name (none dropped, none under another class): per image, the class names of its instances'
    labels against the category names of its annotations."""
    from mmdet.datasets import CocoDataset
    data = json.loads(open(path).read())
    names = {c["id"]: c["name"] for c in data["categories"]}
    given = {}
    for ann in data["annotations"]:
        given.setdefault(ann["image_id"], Counter())[names.get(ann["category_id"])] += 1
    dataset = CocoDataset(ann_file=path, data_prefix=dict(img=images), metainfo=dict(classes=classes),
                          test_mode=True, pipeline=[])
    read = {info["img_id"]: Counter(classes[i["bbox_label"]] for i in info["instances"])
            for info in (dataset.get_data_info(i) for i in range(len(dataset)))}
    return all(read.get(image, Counter()) == counts for image, counts in given.items())


def _renamed(names):
    def change(data):
        for category, name in zip(data["categories"], names):
            category["name"] = name
    return change


def _third_as(category_id, name=None):
    """Every third object as `category_id`, listed as category `name` (None: not listed)."""
    def change(data):
        if name:
            data["categories"].append({"id": category_id, "name": name, "supercategory": "shape"})
        for ann in data["annotations"][2::3]:
            ann["category_id"] = category_id
    return change


def _unused(data):
    data["categories"].append({"id": 3, "name": "tri", "supercategory": "shape"})


@pytest.mark.parametrize("name, change, classes", [
    ("as_is", lambda data: None, ("box", "disc")),
    ("swapped", _renamed(["disc", "box"]), ("box", "disc")),
    ("renamed", _renamed(["square", "disc"]), ("box", "disc")),
    ("extra", _third_as(3, "tri"), ("box", "disc")),
    ("unlisted", _third_as(7), ("box", "disc")),
    ("unused", _unused, ("box", "disc")),  # a category of no object drops nothing
    ("subset", lambda data: None, ("box",)),
    ("reordered", lambda data: None, ("disc", "box"))])
def test_category_problems_exactly_where_mmdetection_drops_or_mislabels_an_object(sample, tmp_path, name, change,
                                                                                   classes):
    from engine.detection import category_problems
    root = _copy(sample, tmp_path, name)
    path = _edit(root, "val2017", change)
    data = json.loads(open(path).read())
    problem = category_problems(data["categories"], data["annotations"], classes)
    assert (problem is None) == _mmdet_reads_as_meant(path, str(root / "val2017"), classes), problem
    assert (problem is None) == (name in ("as_is", "unused")), problem


def test_a_missing_val_image_is_refused_before_training_naming_it_and_the_count(sample, tmp_path, capsys):
    """The val images are read only in the validation after the first epoch: a run trained it, wrote its
    checkpoint and failed with a FileNotFoundError traceback. One error line, before the work dir is made."""
    root = _copy(sample, tmp_path, "coco")
    val = sorted(os.listdir(root / "val2017"))
    for name in val[1:3]:
        os.remove(root / "val2017" / name)
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", str(root), "--work-dir", str(tmp_path / "w"),
                               "train_cfg.max_epochs=1"])
    path = root / "annotations" / "instances_val2017.json"
    assert line == (f"error: --data-root {root}: val_dataloader reads {path}, which lists {len(val)} images, 2 of "
                    f"them not in {root / 'val2017'} (the first: {val[1]}): put the missing images there, or give "
                    "the annotation file of the images that folder holds"), line
    assert not (tmp_path / "w").exists()


def test_an_empty_training_folder_names_its_missing_images_not_a_pipeline_transform(sample, tmp_path, capsys):
    root = _copy(sample, tmp_path, "coco")
    listed = [image["file_name"] for image in json.loads(
        (root / "annotations" / "instances_train2017.json").read_text())["images"]]
    for name in os.listdir(root / "train2017"):
        os.remove(root / "train2017" / name)
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", str(root), "--work-dir", str(tmp_path / "w")])
    assert (f"train_dataloader reads {root / 'annotations' / 'instances_train2017.json'}, which lists {len(listed)} "
            f"images, {len(listed)} of them not in {root / 'train2017'} (the first: {listed[0]})") in line, line
    assert "LoadImageFromFile" not in line


def test_evaluation_refuses_a_missing_test_image_before_the_weights_are_read(sample, tmp_path):
    """It failed in the full-precision pass with `[Errno 2] No such file or directory`, naming no input or fix.
    The checkpoint does not exist: the refusal comes first."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    root = _copy(sample, tmp_path, "coco")
    first = sorted(os.listdir(root / "val2017"))[0]
    os.remove(root / "val2017" / first)
    with pytest.raises(DetectionError, match=rf"test_dataloader reads .*instances_val2017.json, which lists \d+ "
                                             rf"images, 1 of them not in .*val2017 \(the first: {first}\)"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--data-root", str(root),
              "--quant", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_objects_of_categories_beyond_the_classes_are_refused_with_their_count(sample, tmp_path, capsys):
    """MMDetection's CocoDataset drops the objects of a category that is not among the config's classes: they
    were neither trained on nor scored, without a word. Training and evaluation refuse, counting them."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    root = _copy(sample, tmp_path, "coco")
    dropped = {}
    for split in ("train2017", "val2017"):
        path = _edit(root, split, _third_as(3, "tri"))
        dropped[split] = sum(a["category_id"] == 3 for a in json.loads(open(path).read())["annotations"])
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", str(root), "--work-dir", str(tmp_path / "w")])
    assert line == (f"error: train_dataloader reads {root / 'annotations' / 'instances_train2017.json'}, which lists "
                    f"the categories box, disc, tri where the config's classes are box, disc: {dropped['train2017']} "
                    "objects of tri would be dropped (its CocoDataset drops the objects of other categories): give "
                    "the data set the detector is configured for, or set train_dataloader.dataset.metainfo.classes "
                    "to its categories in the file's order"), line
    assert not (tmp_path / "w").exists()
    with pytest.raises(DetectionError, match=rf"test_dataloader reads .*instances_val2017.json, which lists the "
                                             rf"categories box, disc, tri .*: {dropped['val2017']} objects of tri "
                                             "would be dropped"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--data-root", str(root),
              "--quant", "--out", str(tmp_path / "x.json")])


def test_a_renamed_class_says_what_the_file_lists_and_what_the_config_expects(sample, tmp_path, capsys):
    """A file of `square, disc` for the classes `box, disc` read 'numbers its categories disc'. Now: the file's
    categories, the config's classes, the class it lacks, the label that would hold another class's objects and
    the objects dropped."""
    root = _copy(sample, tmp_path, "coco")
    for split in ("train2017", "val2017"):
        _edit(root, split, _renamed(["square", "disc"]))
    squares = sum(a["category_id"] == 1 for a in json.loads(
        (root / "annotations" / "instances_train2017.json").read_text())["annotations"])
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", str(root), "--work-dir", str(tmp_path / "w")])
    assert (f"which lists the categories square, disc where the config's classes are box, disc: box is not among "
            f"them; label 0 (box) would hold disc's objects; {squares} object{'' if squares == 1 else 's'} of "
            "square would be dropped") in line, line
    assert not (tmp_path / "w").exists()
