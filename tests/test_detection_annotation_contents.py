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


def _training_refusal(capsys, root, tmp_path, *overrides) -> str:
    """The one `error:` line scripts/train_detection.py prints for the sample config on the data set `root`, having
    made no work dir."""
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", str(root), "--work-dir", str(tmp_path / "w"),
                               *overrides])
    assert not (tmp_path / "w").exists()
    return line


def test_unusable_images_match_a_stat_per_name(mmdet_ready, tmp_path):
    """The images named by no file (plain files, one in a subfolder, an absolute path, a symlink: a broken one is
    missing, a folder named like an image, a name not there) and those of 0 bytes (cv2 cannot decode them: a
    traceback mid-epoch), each as os.path.isfile and os.path.getsize find them."""
    from engine.detection import unusable_images
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.png", "b.png", "sub/c.png"):
        (folder / name).write_bytes(b"x")
    for name in ("z.png", "sub/z.png"):
        (folder / name).write_bytes(b"")
    (folder / "d.png").mkdir()  # no image
    os.symlink(folder / "a.png", folder / "link.png")
    os.symlink(folder / "z.png", folder / "zlink.png")  # a link to an empty file
    os.symlink(folder / "gone.png", folder / "broken.png")
    outside = tmp_path / "outside.png"
    outside.write_bytes(b"x")
    names = ["a.png", "b.png", "sub/c.png", "sub/x.png", "d.png", "z.png", "link.png", "zlink.png", "broken.png",
             "e.png", "sub/z.png", str(outside), str(tmp_path / "nowhere.png"), "a.png"]
    paths = {n: os.path.join(str(folder), n) for n in names}
    missing = [n for n in names if not os.path.isfile(paths[n])]
    empty = [n for n in names if os.path.isfile(paths[n]) and os.path.getsize(paths[n]) == 0]
    assert unusable_images([{"file_name": n} for n in names], str(folder)) == (missing, empty)
    assert missing == ["sub/x.png", "d.png", "broken.png", "e.png", str(tmp_path / "nowhere.png")]
    assert empty == ["z.png", "zlink.png", "sub/z.png"]
    assert unusable_images([{"file_name": "a.png"}], str(tmp_path / "no_folder")) == (["a.png"], [])


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


def _objects_read(path, images, classes):
    """How many objects MMDetection's CocoDataset reads from the file at `path` (every image's instances)."""
    from mmdet.datasets import CocoDataset
    dataset = CocoDataset(ann_file=path, data_prefix=dict(img=images), metainfo=dict(classes=classes),
                          test_mode=True, pipeline=[])
    return sum(len(dataset.get_data_info(i)["instances"]) for i in range(len(dataset)))


def _to_image(image_id, every=3):
    """Every `every`-th object moved to the image `image_id`."""
    def change(data):
        for ann in data["annotations"][::every]:
            ann["image_id"] = image_id
    return change


def _without_first_image(data):
    data["images"] = data["images"][1:]


@pytest.mark.parametrize("name, change", [
    ("as_is", lambda data: None), ("one", _to_image(99999, every=100)), ("several", _to_image(777)),
    ("unlisted_image", _without_first_image), ("text_id", _to_image("7", every=100))])
def test_unlisted_image_problem_exactly_where_mmdetection_reads_fewer_objects_than_the_file_lists(
        sample, tmp_path, name, change):
    """An object of an image id the file's images do not have is read by no CocoDataset (nor scored by COCO's
    evaluation): the problem is named exactly where MMDetection reads fewer objects than the file holds, with the
    count and the first such id."""
    from engine.detection import unlisted_image_problem
    root = _copy(sample, tmp_path, name)
    path = _edit(root, "val2017", change)
    data = json.loads(open(path).read())
    problem = unlisted_image_problem(data["images"], data["annotations"])
    lost = len(data["annotations"]) - _objects_read(path, str(root / "val2017"), ("box", "disc"))
    assert (problem is None) == (lost == 0), problem
    assert (problem is None) == (name == "as_is"), problem
    if problem:
        listed = {image["id"] for image in data["images"]}
        first = next(a["image_id"] for a in data["annotations"] if a["image_id"] not in listed)
        assert problem.startswith(f"lists {lost} object{'' if lost == 1 else 's'} of ") and \
            problem.endswith(f"(the first: image_id {first!r})"), problem


def test_objects_of_images_the_file_does_not_list_are_refused_by_training_and_evaluation(sample, tmp_path, capsys):
    """MMDetection's CocoDataset reads the objects of the file's images only: an object of another image_id was
    neither trained on nor scored, without a word (an evaluation scored a val file of fewer objects than it holds,
    recorded as the whole set's mAP). Training and evaluation refuse before any work, naming the file, the count
    and the first id."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    root = _copy(sample, tmp_path, "coco")
    train = _edit(root, "train2017", _to_image(99999, every=100))
    line = _training_refusal(capsys, root, tmp_path)
    assert line == (f"error: train_dataloader reads {train}, which lists 1 object of 1 image id that its images do "
                    "not have (the first: image_id 99999): MMDetection would neither train on nor score those "
                    "objects; give the data set's whole annotation file, or one without them"), line
    val = _edit(root, "val2017", _to_image(777))
    moved = len(json.loads(open(val).read())["annotations"][::3])
    with pytest.raises(DetectionError, match=rf"^test_dataloader reads {val}, which lists {moved} objects of 1 image "
                                             r"id that its images do not have \(the first: image_id 777\)"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--data-root", str(root),
              "--quant", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_a_missing_val_image_is_refused_before_training_naming_it_and_the_count(sample, tmp_path, capsys):
    """The val images are read only in the validation after the first epoch: a run trained it, wrote its
    checkpoint and failed with a FileNotFoundError traceback. One error line, before the work dir is made."""
    root = _copy(sample, tmp_path, "coco")
    val = sorted(os.listdir(root / "val2017"))
    for name in val[1:3]:
        os.remove(root / "val2017" / name)
    line = _training_refusal(capsys, root, tmp_path, "train_cfg.max_epochs=1")
    path = root / "annotations" / "instances_val2017.json"
    assert line == (f"error: --data-root {root}: val_dataloader reads {path}, which lists {len(val)} images, 2 of "
                    f"them not in {root / 'val2017'} (the first: {val[1]}): put the missing images there, or give "
                    "the annotation file of the images that folder holds"), line


def test_an_empty_training_folder_names_its_missing_images_not_a_pipeline_transform(sample, tmp_path, capsys):
    root = _copy(sample, tmp_path, "coco")
    listed = [image["file_name"] for image in json.loads(
        (root / "annotations" / "instances_train2017.json").read_text())["images"]]
    for name in os.listdir(root / "train2017"):
        os.remove(root / "train2017" / name)
    line = _training_refusal(capsys, root, tmp_path)
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
    line = _training_refusal(capsys, root, tmp_path)
    assert line == (f"error: train_dataloader reads {root / 'annotations' / 'instances_train2017.json'}, which lists "
                    f"the categories box, disc, tri where the config's classes are box, disc: {dropped['train2017']} "
                    "objects of tri would be dropped (its CocoDataset drops the objects of other categories): give "
                    "the data set the detector is configured for, or set train_dataloader.dataset.metainfo.classes "
                    "to its categories in the file's order"), line
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
    line = _training_refusal(capsys, root, tmp_path)
    assert (f"which lists the categories square, disc where the config's classes are box, disc: box is not among "
            f"them; label 0 (box) would hold disc's objects; {squares} object{'' if squares == 1 else 's'} of "
            "square would be dropped") in line, line


def test_empty_images_are_refused_before_training_naming_them_and_the_count(sample, tmp_path, capsys):
    """A zero-byte training image (an interrupted copy) trained 3 of the sample's 4 updates and failed with a cv2
    traceback; an empty val image would fail after the epoch. One error line each, before the work dir is made,
    for training and for evaluation (whose checkpoint does not exist: the refusal comes first)."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    root = _copy(sample, tmp_path, "coco")
    train = sorted(os.listdir(root / "train2017"))
    (root / "train2017" / train[4]).write_bytes(b"")
    line = _training_refusal(capsys, root, tmp_path, "train_cfg.max_epochs=1")
    path = root / "annotations" / "instances_train2017.json"
    assert line == (f"error: --data-root {root}: train_dataloader reads {path}, which lists {len(train)} images, 1 of "
                    f"them an empty file (0 bytes) in {root / 'train2017'} (the first: {train[4]}): copy the empty "
                    "one there again, or give the annotation file of the images that folder holds"), line
    shutil.copy(os.path.join(sample, "train2017", train[4]), root / "train2017" / train[4])
    val = sorted(os.listdir(root / "val2017"))
    for name in val[1:3]:
        (root / "val2017" / name).write_bytes(b"")
    os.remove(root / "val2017" / val[0])
    with pytest.raises(DetectionError, match=rf"test_dataloader reads .*instances_val2017.json, which lists "
                                             rf"{len(val)} images, 1 of them not in .*val2017 \(the first: {val[0]}\) "
                                             rf"and 2 of them empty files \(0 bytes\) in .*val2017 \(the first: "
                                             rf"{val[1]}\): put the missing images there and copy the empty ones "
                                             "there again, or give"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--data-root", str(root),
              "--quant", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def _pycocotools_map(path, image_ids, classes):
    """COCO box mAP (pycocotools' COCOeval, as MMDetection's CocoMetric calls it) of one detection per image of
    `image_ids` for the categories named `classes`: -1 where it finds no ground truth."""
    import contextlib
    import io
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(path)
        cat_ids = gt.getCatIds(catNms=list(classes))
        dt = gt.loadRes([{"image_id": i, "category_id": cat_ids[0], "bbox": [8.0, 8.0, 16.0, 16.0], "score": 0.5}
                         for i in image_ids])
        run = COCOeval(gt, dt, "bbox")
        run.params.imgIds, run.params.catIds = list(image_ids), cat_ids
        run.evaluate()
        run.accumulate()
        run.summarize()
    return run.stats[0]


def _no_objects_in(count):
    def change(data):
        empty = {image["id"] for image in data["images"][:count]}
        data["annotations"] = [a for a in data["annotations"] if a["image_id"] not in empty]
    return change


def _crowds_only(data):
    for ann in data["annotations"]:
        ann["iscrowd"] = 1


@pytest.mark.parametrize("name, change, indices", [
    ("as_is", lambda data: None, None),
    ("none", _no_objects_in(4), None),
    ("crowds", _crowds_only, None),
    ("first_two", _no_objects_in(2), 2),  # --max-images 2
    ("first_two_of_three", _no_objects_in(2), 3),
    ("indices", _no_objects_in(2), [1, 0]),
    ("last", _no_objects_in(3), -1)])
def test_scored_objects_are_none_exactly_where_pycocotools_scores_minus_one(sample, tmp_path, name, change, indices):
    from engine.detection import scored_images, scored_objects
    root = _copy(sample, tmp_path, name)
    path = _edit(root, "val2017", change)
    data = json.loads(open(path).read())
    ids = scored_images(data["images"], indices)
    everything = [image["id"] for image in data["images"]]
    assert ids == (everything if indices is None else everything[:indices] if indices == 2 or indices == 3 else
                   [everything[1], everything[0]] if isinstance(indices, list) else everything[-1:])
    objects = scored_objects(ids, data["categories"], data["annotations"], ("box", "disc"))
    assert (objects == 0) == (_pycocotools_map(path, ids, ("box", "disc")) == -1), objects
    assert (objects == 0) == (name in ("none", "crowds", "first_two", "indices")), objects


def test_an_evaluation_of_images_without_objects_is_refused_before_any_work(sample, tmp_path):
    """A val split without objects (or its first N images, --max-images N) was scored mAP -1, pycocotools' mark of
    no ground truth, and recorded with rc 0. Refused before the weights are read (the checkpoint does not exist)."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    root = _copy(sample, tmp_path, "coco")
    path = _edit(root, "val2017", _no_objects_in(2))
    argv = ["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--data-root", str(root), "--quant",
            "--out", str(tmp_path / "x.json")]
    with pytest.raises(DetectionError) as refused:
        main(argv + ["--max-images", "2"])
    assert str(refused.value) == (
        f"test_dataloader reads {path}, which holds no objects of the config's classes (box, disc) in its first 2 "
        "images (--max-images 2) (crowd regions, which COCO's evaluation ignores, not counted): mAP is undefined "
        "(pycocotools scores it -1); give the data set's annotation file, or score more images (--max-images)")
    with pytest.raises(DetectionError) as later:  # 3 images hold objects: the missing checkpoint is next
        main(argv + ["--max-images", "3"])
    assert "holds no objects" not in str(later.value) and "w.pth" in str(later.value), later.value
    _edit(root, "val2017", _no_objects_in(4))
    with pytest.raises(DetectionError, match=r"which holds no objects of the config's classes \(box, disc\) in its 4 "
                                             r"images \(crowd"):
        main(argv)
    assert not (tmp_path / "x.json").exists()


def test_a_training_split_without_objects_is_refused_before_training(sample, tmp_path, capsys):
    """MMDetection's filter_empty_gt kept no image: 'train_dataloader, val_dataloader or val_evaluator could not be
    built ... (ValueError: need at least one array to concatenate)'."""
    root = _copy(sample, tmp_path, "coco")
    path = _edit(root, "train2017", lambda data: data.update(annotations=[]))
    line = _training_refusal(capsys, root, tmp_path)
    assert line == (f"error: train_dataloader reads {path}, in which no training image has an object of the config's "
                    "classes (box, disc): a detector would train on none (with filter_cfg.filter_empty_gt, "
                    "MMDetection keeps no image); give the data set's annotation file"), line


def _negatives(root, split, name):
    """A copy of `split`'s annotation file with no object (background images only), as annotations/`name`."""
    data = json.loads((root / "annotations" / f"instances_{split}.json").read_text())
    data["annotations"] = []
    (root / "annotations" / name).write_text(json.dumps(data))
    return str(root / "annotations" / name)


NO_OBJECT = "train_dataloader reads {where} an object of the config's classes (box, disc): a detector would train on "


@pytest.mark.parametrize("name, joined, refused", [
    ("with_negatives", [("train", False), ("val_empty", False)], None),  # hard negatives
    ("negatives_alone", [("val_empty", False)],
     NO_OBJECT + "none (the images MMDetection keeps, with filter_cfg.filter_empty_gt off, are background alone); give "
                 "the data set's annotation file"),
    ("all_empty_filtered", [("train_empty", True), ("val_empty", True)],
     NO_OBJECT + "none (with filter_cfg.filter_empty_gt, MMDetection keeps no image); give the data set's annotation "
                 "file"),
    ("empty_filtered_joined", [("train_empty", True), ("val", True)],
     "train_dataloader reads {train_empty}, in which no training image has an object of the config's classes (box, "
     "disc), with filter_cfg.filter_empty_gt: MMDetection keeps none of its images; give the data set's annotation "
     "file, or set that dataset's filter_cfg.filter_empty_gt=False to train on its images as background (hard "
     "negatives)")])
def test_a_training_split_is_refused_exactly_where_mmdetection_trains_on_no_object(sample, tmp_path, name, joined,
                                                                                 refused):
    """A training file of no object was refused on its own, though a ConcatDataset joined it to files with objects
    with filter_empty_gt off (background images: MMDetection trains on them as hard negatives); the split is judged
    whole, and refused exactly where the dataset MMDetection builds holds no image with an object, or fails to
    build (a dataset that keeps no image: 'need at least one array to concatenate')."""
    import copy
    from engine.detection import DetectionError, check_annotations, load_config
    from mmdet.registry import DATASETS
    root = _copy(sample, tmp_path, name)
    files = {"train_empty": _negatives(root, "train2017", "train_empty.json"),
             "val_empty": _negatives(root, "val2017", "val_empty.json")}
    cfg = load_config([SAMPLE_CONFIG], data_root=str(root))
    datasets = []
    for part, filtered in joined:
        dataset = copy.deepcopy(cfg.train_dataloader.dataset)
        split = "train2017" if part.startswith("train") else "val2017"
        dataset.update(ann_file=files.get(part, f"annotations/instances_{split}.json"),
                       data_prefix=dict(img=f"{split}/"), filter_cfg=dict(filter_empty_gt=filtered, min_size=8))
        datasets.append(dataset)
    cfg.train_dataloader.dataset = datasets[0] if len(datasets) == 1 else dict(type="ConcatDataset",
                                                                              datasets=datasets)
    try:
        built = DATASETS.build(cfg.train_dataloader.dataset)
        trains = any(built.get_data_info(i)["instances"] for i in range(len(built)))
    except ValueError as e:
        assert "need at least one array to concatenate" in str(e)
        trains = False
    assert trains == (refused is None)
    if refused is None:
        check_annotations(cfg, ["train_dataloader"])
        return
    paths = [files[part] for part, _ in joined if part in files]
    where = (f"{paths[0]}, in which no training image has" if len(paths) == 1 else
             f"2 files ({', '.join(paths)}), in none of which a training image has")
    with pytest.raises(DetectionError) as error:
        check_annotations(cfg, ["train_dataloader"])
    assert str(error.value) == refused.format(where=where, **files)


def test_a_negative_map_is_not_recorded(sample, tmp_path, monkeypatch):
    """Past the early check (here switched off), pycocotools' -1 of a split without objects is an error, not a
    score in the results file."""
    import torch
    import engine.detection
    from mmdet.registry import MODELS
    from engine.detection import DetectionError, load_config
    from evaluate_detection import main
    root = _copy(sample, tmp_path, "coco")
    weights = str(tmp_path / "fresh.pth")  # a detector as built (its scores do not matter: there is nothing to find)
    torch.save({"state_dict": MODELS.build(load_config([SAMPLE_CONFIG], {}, str(root), None).model).state_dict(),
                "meta": {}}, weights)
    _edit(root, "val2017", _no_objects_in(4))
    monkeypatch.setattr(engine.detection, "check_annotations", lambda *args, **kwargs: [])
    out = tmp_path / "x.json"
    with pytest.raises(DetectionError, match=r"bbox_mAP, .*segm_mAP.* of the 4 images scored came out -1, "
                                             "pycocotools' mark of no ground truth"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", weights, "--data-root", str(root), "--quant", "--out",
              str(out)])
    assert not out.exists() or "fp" not in json.loads(out.read_text())


def _box(index, bbox, area=None, **extra):
    """The `index`-th object's box as `bbox` (its area: `area`, else bbox's own), and other fields `extra`."""
    def change(data):
        ann = data["annotations"][index]
        ann.update(bbox=bbox, area=bbox[2] * bbox[3] if area is None else area, **extra)
    return change


def _image_boxes(image_index, bbox):
    """Every object of the `image_index`-th image with the box `bbox` (area 0 where it has none)."""
    def change(data):
        image = data["images"][image_index]["id"]
        for ann in data["annotations"]:
            if ann["image_id"] == image:
                ann.update(bbox=bbox, area=max(0, bbox[2] * bbox[3]))
    return change


def _both(*changes):
    def change(data):
        for c in changes:
            c(data)
    return change


# the sample's images are 64 x 64
@pytest.mark.parametrize("name, change", [
    ("as_is", lambda data: None),
    ("zero", _box(0, [10.0, 10.0, 0.0, 0.0])),
    ("narrow", _box(1, [10.0, 10.0, 0.5, 12.0])),  # as COCO 2017's few under 1 px
    ("low", _box(1, [10.0, 10.0, 12.0, 0.9])),
    ("no_area", _box(2, [10.0, 10.0, 12.0, 12.0], area=0)),
    ("narrow_crowd", _box(3, [10.0, 10.0, 0.5, 12.0], iscrowd=1)),  # an ignored region, dropped the same way
    ("ignored", _box(3, [10.0, 10.0, 0.5, 12.0], ignore=1)),  # skipped before its rule: not counted
    ("border_sliver", _box(0, [64.0, 10.0, 0.9, 12.0])),  # on the border: nothing inside
    ("rounded_past", _box(0, [10.0, 10.0, 54.6, 54.9])),  # past the border by less than 1 px: kept
    ("whole_image", _image_boxes(0, [5.0, 5.0, 0.0, 3.0])),
    ("two_images", _both(_image_boxes(0, [5.0, 5.0, 0.5, 3.0]), _image_boxes(1, [5.0, 5.0, 3.0, 0.0])))])
def test_dropped_boxes_are_exactly_those_mmdetection_drops(sample, tmp_path, name, change):
    """Well-formed boxes that MMDetection's CocoDataset drops by its own rule (area <= 0, a width or height under
    1 px, nothing inside the image) are counted, and so are the images left without any box: against the
    instances its CocoDataset reads from the same file."""
    from mmdet.datasets import CocoDataset
    from engine.detection.annotation_contents import dropped_boxes, malformed_boxes
    root = _copy(sample, tmp_path, name)
    path = _edit(root, "train2017", change)
    data = json.loads(open(path).read())
    dataset = CocoDataset(ann_file=path, data_prefix=dict(img=str(root / "train2017")),
                          metainfo=dict(classes=("box", "disc")), test_mode=True, pipeline=[])
    instances = {info["img_id"]: len(info["instances"]) for info in (dataset.get_data_info(i)
                                                                     for i in range(len(dataset)))}
    given = Counter(a["image_id"] for a in data["annotations"] if not a.get("ignore"))
    read = sum(instances.values())
    bare = sum(1 for image in given if instances[image] == 0)
    assert malformed_boxes(data["annotations"]) == (0, None)
    count, first, left = dropped_boxes(data["images"], data["annotations"])
    assert (count, left) == (sum(given.values()) - read, bare)
    # the sample's first image holds one object, its second three
    assert (count, left) == {"as_is": (0, 0), "ignored": (0, 0), "rounded_past": (0, 0), "zero": (1, 1),
                             "border_sliver": (1, 1), "whole_image": (1, 1), "two_images": (4, 2)}.get(name, (1, 0))
    if count:
        assert first == next(a["id"] for a in data["annotations"] if not a.get("ignore") and (
            a["bbox"][2] < 1 or a["bbox"][3] < 1 or a["area"] <= 0 or a["bbox"][0] >= 64))


def _size(index, **size):
    def change(data):
        image = data["images"][index]
        for side in ("width", "height"):
            image.pop(side)
        image.update(size)
    return change


@pytest.mark.parametrize("name, change, problem", [
    ("nan", _box(0, [float("nan"), 10.0, 12.0, 12.0], area=144.0), "bbox [nan, 10.0, 12.0, 12.0] is not 4 finite "
                                                                   "numbers"),
    ("inf", _box(0, [10.0, 10.0, float("inf"), 12.0], area=144.0), "bbox [10.0, 10.0, inf, 12.0] is not 4 finite "
                                                                   "numbers"),
    ("negative", _box(0, [10.0, 10.0, -5.0, 12.0], area=60.0), "bbox [10.0, 10.0, -5.0, 12.0] has a negative width "
                                                               "or height"),
    ("no_area", _box(0, [10.0, 10.0, 12.0, 12.0], area=float("nan")), "area nan is not a finite number"),
    ("two", _both(_box(0, [10.0, 10.0, -5.0, 12.0], area=60.0), _box(5, [10.0, 10.0, 5.0, -2.0], area=10.0)),
     "bbox [10.0, 10.0, -5.0, 12.0] has a negative width or height")])
def test_malformed_boxes_are_refused_before_training_naming_the_first_and_the_count(sample, tmp_path, capsys, name,
                                                                                    change, problem):
    """A box of a NaN or an infinite number, or of a negative width or height: MMDetection's CocoDataset dropped it
    (its drawn object trained as background) or kept it (a box to infinity; an area of NaN, which COCO's evaluation
    puts in no size range) without a word (checked here on its own CocoDataset). One `error:` line before any
    work, naming the file, the first and the count."""
    from mmdet.datasets import CocoDataset
    root = _copy(sample, tmp_path, name)
    path = _edit(root, "train2017", change)
    data = json.loads(open(path).read())
    dataset = CocoDataset(ann_file=path, data_prefix=dict(img=str(root / "train2017")),
                          metainfo=dict(classes=("box", "disc")), test_mode=True, pipeline=[])
    boxes = [i["bbox"] for info in (dataset.get_data_info(i) for i in range(len(dataset))) for i in info["instances"]]
    dropped = len(data["annotations"]) - len(boxes)
    # dropped (its overlap test is False for NaN, its 1 px rule drops a negative width) or kept (inf, a NaN area)
    assert dropped == {"two": 2, "inf": 0, "no_area": 0}.get(name, 1), dropped
    count = 2 if name == "two" else 1
    line = _training_refusal(capsys, root, tmp_path)
    assert line == (f"error: train_dataloader reads {path}, which holds {count} malformed box"
                    f"{'es' if count == 2 else ''} (the first: annotation id {data['annotations'][0]['id']}: "
                    f"{problem}): MMDetection's CocoDataset drops or keeps such a box without a word; correct or "
                    f"remove {'them' if count == 2 else 'it'} (a box is [x, y, width, height] in pixels of its "
                    "image)"), line


@pytest.mark.parametrize("change, shown", [(_size(2, width=0, height=64), "width 0, height 64"),
                                           (_size(2, height=64), "width None, height 64")])
def test_an_image_without_a_size_is_refused_before_training(sample, tmp_path, capsys, change, shown):
    """MMDetection's CocoDataset reads every image's width and height (a KeyError traceback where one is
    missing) and judges each box against them."""
    root = _copy(sample, tmp_path, "coco")
    path = _edit(root, "train2017", change)
    image = json.loads(open(path).read())["images"][2]["id"]
    line = _training_refusal(capsys, root, tmp_path)
    assert line == (f"error: train_dataloader reads {path}, which lists 1 image without a positive width and height "
                    f"(the first: image id {image}, {shown}): MMDetection judges every box against them; give each "
                    "image's size in pixels"), line


def test_boxes_mmdetection_drops_are_one_warning_a_file(sample, tmp_path, capsys):
    """COCO 2017's training file holds a few boxes narrower than 1 px, which MMDetection drops: they must not make
    it unusable. One warning a file, returned for the command to print once its last check has passed, with the
    count, the first, and the images left without any box; a val file's adds that COCO's evaluation scores them
    (it reads the file, not the dataset)."""
    from engine.detection import check_annotations, load_config
    root = _copy(sample, tmp_path, "coco")
    train = _edit(root, "train2017", _both(_image_boxes(0, [5.0, 5.0, 0.5, 3.0]), _box(5, [9.0, 9.0, 7.0, 0.0])))
    val = _edit(root, "val2017", _box(1, [9.0, 9.0, 0.0, 0.0]))
    data = json.loads(open(train).read())
    first_image = data["images"][0]["id"]
    count = sum(1 for a in data["annotations"] if a["image_id"] == first_image) + 1
    capsys.readouterr()
    warnings = check_annotations(load_config([SAMPLE_CONFIG], data_root=str(root)),
                                 ["train_dataloader", "val_dataloader"])
    assert capsys.readouterr().err == ""  # printed by the command, once nothing is refused
    rule = ("that MMDetection's CocoDataset drops by its own rule (no area inside the image, an area <= 0, or a "
            "width or height under 1 px)")
    assert warnings == [
        f"train_dataloader reads {train}, which holds {count} boxes (the first: annotation id "
        f"{data['annotations'][0]['id']}) {rule}, leaving 1 image without any box because of it (trained on as "
        "background)",
        f"val_dataloader reads {val}, which holds 1 box (the first: annotation id "
        f"{json.loads(open(val).read())['annotations'][1]['id']}) {rule}, leaving no image without a box; COCO's "
        "evaluation, which reads the file itself, scores those boxes all the same"]
