"""What one COCO annotation file lists, against what a detection config reads it with: its images against the
loader's image folder, its categories against the config's classes, its objects against the images trained on or
scored, its boxes against their images. Functions of the parsed file (and a stat per image) only: each file is read
once, whole, by data_checks.check_annotations, which turns their findings into one error line (or one warning)."""
from __future__ import annotations

import math
import numbers
import os
import stat
from collections import Counter
from typing import Any, Iterator, List, Optional, Sequence, Tuple


def unusable_images(images: Sequence[dict], folder: str) -> Tuple[List[str], List[str]]:
    """(missing, empty): the file_name of each of `images` (an annotation file's images[]) that is no file under
    `folder`, where MMDetection's CocoDataset reads it (data_prefix.img joined with file_name), and of each that
    is a file of 0 bytes (an interrupted copy, which cv2 failed to decode with a traceback mid-epoch), each in the
    file's order.

    One stat per name (following a symlink: a broken one is missing), as os.path.isfile of each costs: a folder's
    listing holds no sizes, and its one scan (0.25-0.30 s where a stat per name took 0.90-0.97 s, on a 2-core AMD
    EPYC VM) saved no stat here. For train2017's 118,287 names in a folder of as many files (local disk, warm cache)
    it took 1.05-1.12 s on a shared 2-core Intel Xeon VM, isfile of each 0.95-1.09 s (docs/measurements.md); the
    sample's 16 names about 30 us."""
    missing, empty = [], []
    for name in (str(image["file_name"]) for image in images):
        try:
            info = os.stat(os.path.join(folder, name))
        except (OSError, ValueError):  # absent, a broken link, a name with a NUL byte (os.path.isfile: False)
            missing.append(name)
            continue
        if not stat.S_ISREG(info.st_mode):  # a folder named like an image
            missing.append(name)
        elif info.st_size == 0:
            empty.append(name)
    return missing, empty


def unlisted_image_problem(images: Sequence[dict], annotations: Sequence[dict]) -> Optional[str]:
    """What is wrong with a file whose `annotations` include objects of an image_id none of its `images` has (to
    follow "{file}, which "), or None where every object's image is listed: MMDetection's CocoDataset reads the
    objects of each listed image only (pycocotools' imgToAnns, by image id) and COCO's evaluation scores those of
    the images predicted, so such objects were neither trained on nor scored, without a word (a val file of half
    its objects so was scored as a whole one)."""
    listed = {image["id"] for image in images}
    unlisted = [a["image_id"] for a in annotations if a["image_id"] not in listed]
    if not unlisted:
        return None
    ids = list(dict.fromkeys(unlisted))
    return (f"lists {len(unlisted)} object{'' if len(unlisted) == 1 else 's'} of {len(ids)} image "
            f"id{'' if len(ids) == 1 else 's'} that its images do not have (the first: image_id {ids[0]!r})")


def label_names(categories: Sequence[dict], classes: Sequence[str]) -> List[str]:
    """The class each label means where MMDetection's CocoDataset and CocoMetric read a file with `categories`
    for the config's `classes`: label i is the i-th of the FILE's categories whose name is a class (pycocotools'
    getCatIds keeps the file's order), which is classes[i] only where the file lists them in that order."""
    return [str(c.get("name")) for c in categories if c.get("name") in classes]


def dropped_objects(categories: Sequence[dict], annotations: Sequence[dict], classes: Sequence[str]) -> dict:
    """{category shown: count} of the `annotations` whose category is none of the config's `classes`, which
    MMDetection's CocoDataset drops while it reads the file (neither trained on nor scored), in the order of the
    file's categories; an id the file does not list as a category is shown as `category_id N` (not listed)."""
    names = {c.get("id"): str(c.get("name")) for c in categories}
    kept = {c.get("id") for c in categories if c.get("name") in classes}
    counts = Counter(a["category_id"] for a in annotations if a["category_id"] not in kept)
    order = [i for i in names if i in counts] + sorted((i for i in counts if i not in names), key=str)
    return {names[i] if i in names else f"category_id {i} (not listed)": counts[i] for i in order}


def _class_ids(categories: Sequence[dict], classes: Sequence[str]) -> set:
    """The ids of the file's categories that are among the config's `classes`."""
    return {c.get("id") for c in categories if c.get("name") in classes}


def images_with_objects(images: Sequence[dict], categories: Sequence[dict], annotations: Sequence[dict],
                        classes: Sequence[str]) -> int:
    """How many of `images` hold an object of the config's `classes`: the images MMDetection's CocoDataset keeps
    for training where its filter_cfg sets filter_empty_gt (an object of any size, a crowd region too)."""
    listed = {image["id"] for image in images}
    kept = _class_ids(categories, classes)
    return len({a["image_id"] for a in annotations if a["category_id"] in kept and a["image_id"] in listed})


def scored_images(images: Sequence[dict], indices: Any = None) -> List[Any]:
    """The ids of the images a COCO dataset of the annotation file's `images` scores, in its order: one per id, in
    the file's order (pycocotools' index), then its `indices` as MMEngine's BaseDataset takes them (an int N: the
    first N, or the last -N; a list: those positions; one out of range is left to the dataset to refuse)."""
    ids = list(dict.fromkeys(image["id"] for image in images))
    if isinstance(indices, int) and not isinstance(indices, bool):
        return ids[:indices] if indices >= 0 else ids[indices:]
    if indices is not None:
        return [ids[i] for i in indices if -len(ids) <= i < len(ids)]
    return ids


def scored_objects(image_ids: Sequence[Any], categories: Sequence[dict], annotations: Sequence[dict],
                   classes: Sequence[str]) -> int:
    """How many objects of the config's `classes` COCO's evaluation (pycocotools' COCOeval, through MMDetection's
    CocoMetric) scores in the images `image_ids`: it ignores crowd regions, and scores a class of no object as -1
    (no ground truth), an mAP of no object at all as -1 too."""
    ids, kept = set(image_ids), _class_ids(categories, classes)
    return sum(1 for a in annotations if a["category_id"] in kept and a["image_id"] in ids and not a.get("iscrowd"))


def _shown(names: Sequence[str], most: int = 6) -> str:
    """The first `most` of `names` for an error line (COCO has 80 categories)."""
    return ", ".join(names[:most]) + (" ..." if len(names) > most else "")


def category_problems(categories: Sequence[dict], annotations: Sequence[dict],
                      classes: Sequence[str]) -> Optional[str]:
    """What is wrong with a file of `categories` and `annotations` for the config's `classes` (to follow "{file},
    which "), or None when MMDetection reads it as the config means: each label i holds the objects of classes[i]
    (`label_names`) and no object is dropped (`dropped_objects`; a category of no object drops nothing)."""
    names = label_names(categories, classes)
    listed = _shown([str(c.get("name")) for c in categories])
    if not names:
        return f"has none of the config's classes ({', '.join(classes)}); its categories are {listed}"
    absent = [c for c in classes if c not in names]
    # a file naming a class twice numbers more labels than the config has classes
    meant = list(classes) + ["no class of the config"] * max(0, len(names) - len(classes))
    swapped = [f"label {i} ({meant[i]}) would hold {name}'s objects" for i, name in enumerate(names)
               if name != meant[i]]
    dropped = dropped_objects(categories, annotations, classes)
    if not (absent or swapped or dropped):
        return None
    problems = ([f"{', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not among them"] if absent else [])
    problems += swapped
    if dropped:
        shown = [f"{count} object{'' if count == 1 else 's'} of {name}" for name, count in dropped.items()]
        problems.append(f"{_shown(shown)} would be dropped")
    why = ((["MMDetection numbers the config's classes in the file's order"] if absent or swapped else []) +
           (["its CocoDataset drops the objects of other categories"] if dropped else []))
    return (f"lists the categories {listed} where the config's classes are {', '.join(classes)}: "
            f"{'; '.join(problems)} ({'; '.join(why)})")


def _number(value: Any) -> bool:
    """Whether `value` is a finite real number as JSON gives one (json.load reads NaN and Infinity too)."""
    if type(value) in (float, int):  # json.load's, first: this runs for each of train2017's 860,001 boxes
        return math.isfinite(value)
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def unsized_images(images: Sequence[dict]) -> List[Any]:
    """The ids of `images` (an annotation file's images[]) without a positive width and height, in the file's
    order: MMDetection's CocoDataset reads both for every image (a KeyError traceback where one is missing) and
    judges each box against them (`box_problem`)."""
    return [image.get("id") for image in images
            if not all(_number(image.get(side)) and image[side] > 0 for side in ("width", "height"))]


def box_problem(annotation: dict) -> Optional[str]:
    """What is malformed about the box of `annotation`, or None: a bbox that is not 4 finite numbers (or an area
    that is not one: MMDetection reads both), or a negative width or height. MMDetection's CocoDataset drops them
    (NaN: its overlap test; a negative width: its 1 px rule) or keeps them (an infinite width, a NaN area) without
    a word, or fails (an area it cannot read: a KeyError traceback). A box reaching past its
    image is no error: it is kept as given (CrowdHuman's full-body boxes do so by design), and one with nothing
    inside its image is dropped by MMDetection's own rule (`mmdet_drops`, a warning)."""
    box = annotation.get("bbox")
    if not (isinstance(box, (list, tuple)) and len(box) == 4 and _number(box[0]) and _number(box[1])
            and _number(box[2]) and _number(box[3])):
        return f"bbox {box!r} is not 4 finite numbers"
    if not _number(annotation.get("area")):
        return f"area {annotation.get('area')!r} is not a finite number"
    if box[2] < 0 or box[3] < 0:
        return f"bbox {box!r} has a negative width or height"
    return None


def malformed_boxes(annotations: Sequence[dict], skip_ignored: bool = False) -> Tuple[int, Optional[str]]:
    """(count, what is wrong with the first) of the `annotations` whose box is malformed (`box_problem`); with
    `skip_ignored`, of those not marked `ignore` (a file read by MMDetection's CocoDataset alone, which skips them
    before reading a box; COCO's evaluation sets `ignore` from iscrowd and reads every box)."""
    count, first = 0, None
    for annotation in annotations:
        if skip_ignored and annotation.get("ignore", False):
            continue
        problem = box_problem(annotation)
        if problem:
            count += 1
            first = first or f"annotation id {annotation.get('id')!r}: {problem}"
    return count, first


def mmdet_drops(annotation: dict, width: float, height: float) -> bool:
    """Whether MMDetection's CocoDataset (mmdet/datasets/coco.py, parse_data_info, 3.x) drops the well-formed box
    of `annotation` on an image of `width` x `height` by its own rule: no area inside the image, or an area <= 0,
    or a width or height under 1 px; a crowd region's too (it would be an ignored region). An object marked
    `ignore` it skips before, as no box."""
    x, y, w, h = annotation["bbox"]
    inside_w = max(0, min(x + w, width) - max(x, 0))
    inside_h = max(0, min(y + h, height) - max(y, 0))
    return inside_w * inside_h == 0 or annotation["area"] <= 0 or w < 1 or h < 1


def read_boxes(images: Sequence[dict], annotations: Sequence[dict]) -> Iterator[Tuple[dict, bool]]:
    """(annotation, whether MMDetection's CocoDataset drops its box: `mmdet_drops`) for each of the well-formed
    `annotations` (`malformed_boxes` finds none) that it reads as a box: not marked `ignore` (skipped before), on
    an image the file lists."""
    sizes = {image["id"]: (image["width"], image["height"]) for image in images}
    for annotation in annotations:
        if not annotation.get("ignore", False) and annotation["image_id"] in sizes:
            yield annotation, mmdet_drops(annotation, *sizes[annotation["image_id"]])


def dropped_boxes(images: Sequence[dict], annotations: Sequence[dict]) -> Tuple[int, Any, int]:
    """(count, the first one's annotation id, images left without any box) of the well-formed `annotations`
    that MMDetection's CocoDataset drops (`read_boxes`): COCO 2017's training file holds a few boxes narrower than
    1 px. An image is left without any box where the file gives it objects and MMDetection keeps none of them:
    its filter_empty_gt, which counts the file's objects, keeps it, and it trains as background."""
    count, first, given, kept = 0, None, set(), set()
    for annotation, dropped in read_boxes(images, annotations):
        given.add(annotation["image_id"])
        if dropped:
            count += 1
            first = annotation.get("id") if count == 1 else first
        else:
            kept.add(annotation["image_id"])
    return count, first, len(given - kept)


def unsegmented_objects(images: Sequence[dict], categories: Sequence[dict], annotations: Sequence[dict],
                        classes: Sequence[str]) -> Tuple[int, Any]:
    """(count, the first one's annotation id) of the objects MMDetection's CocoDataset keeps (`read_boxes`: not
    marked `ignore`, a box it does not drop; of the config's `classes`; crowd regions too) without a segmentation
    (none, or an empty one): its parse_data_info gives them no mask, and a pipeline's LoadAnnotations with
    with_mask=True fails on their image with a KeyError 'mask'. The boxes are well-formed (`malformed_boxes`)."""
    kept = _class_ids(categories, classes)
    count, first = 0, None
    for annotation, dropped in read_boxes(images, annotations):
        if dropped or annotation["category_id"] not in kept or annotation.get("segmentation"):
            continue
        count += 1
        first = annotation.get("id") if count == 1 else first
    return count, first
