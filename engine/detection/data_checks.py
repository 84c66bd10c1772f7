"""The data a detection config reads: its loaders' datasets, one `--data-root` for every loader and evaluator,
and the checks that refuse, before any work, a missing or unreadable annotation file or image folder, an image
an annotation file lists that its folder lacks, an evaluator scoring against another annotation file than its
loader's, a pipeline transform that fails on the first image, annotation categories or head class counts
that do not match the config's classes, malformed boxes (with a warning of those MMDetection drops), and
objects without a segmentation where a pipeline loads masks."""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
from typing import Any, List, Optional, Sequence

from mmengine.config import Config
from mmdet.registry import DATASETS

from engine.detection.annotation_contents import (category_problems, dropped_boxes, images_with_objects,
                                                  malformed_boxes, scored_images, scored_objects,
                                                  unlisted_image_problem, unsegmented_objects, unsized_images,
                                                  unusable_images)
from engine.detection.errors import DetectionError
from engine.detection.rng_state import RngStateHook

LOADERS = ("train_dataloader", "val_dataloader", "test_dataloader")
EVALUATORS = ("val_evaluator", "test_evaluator")


def _datasets(dataset: dict) -> List[dict]:
    """A loader's dataset dict and those it wraps (RepeatDataset, ConcatDataset, ...)."""
    inner = dataset.get("dataset") or []
    inner = inner if isinstance(inner, list) else [inner]
    return [dataset] + [d for sub in inner + list(dataset.get("datasets") or []) for d in _datasets(sub)]


def loader_datasets(cfg: Config) -> List[tuple]:
    """(loader key, dataset dict) of every dataset the loaders of `cfg` read, wrapped ones included."""
    return [(key, dataset) for key in LOADERS if cfg.get(key) for dataset in _datasets(cfg[key]["dataset"])]


def set_data_root(cfg: Config, root: str, keep: Sequence[str] = ()) -> None:
    """Point every loader and COCO evaluator of `cfg` at `root` (COCO's layout: annotations/, train2017/,
    val2017/); the command checks the annotation files of those it reads (check_annotation_files). An
    evaluator's `ann_file` named in `keep` (the user's overrides) stays as given; a loader's data_root there is
    refused."""
    root = os.path.join(os.path.abspath(root), "")
    # a loader's own data_root would be replaced below: the user asked for two roots of one loader
    loader_roots = [k for k in keep if k.split(".")[0] in LOADERS and k.split(".")[-1] == "data_root"]
    if loader_roots:
        raise DetectionError(f"override {loader_roots[0]}: --data-root sets the data_root of every loader and "
                             "would replace it; give one of them (a file of another root: the loader's "
                             "dataset.ann_file / dataset.data_prefix.img as an absolute path)")
    if not os.path.isdir(root):
        raise DetectionError(f"--data-root {root}: no such folder (COCO's layout: annotations/, train2017/, "
                             "val2017/)")
    old = cfg.get("data_root")
    old = os.path.join(old, "") if old else old  # "data/coco" and "data/coco/" name one folder: cut whole parts
    for _, dataset in loader_datasets(cfg):
        if "data_root" in dataset:
            dataset["data_root"] = root
    for key in EVALUATORS:
        evaluators = cfg.get(key)
        for evaluator in evaluators if isinstance(evaluators, list) else [evaluators] if evaluators else []:
            ann = evaluator.get("ann_file")
            if ann and f"{key}.ann_file" not in keep:
                rel = ann[len(old):] if old and ann.startswith(old) else os.path.join(
                    "annotations", os.path.basename(ann))
                evaluator["ann_file"] = os.path.join(root, rel)
    cfg["data_root"] = root


def annotation_files(cfg: Config) -> List[tuple]:
    """(config key, absolute path) of every annotation file the loaders and evaluators of `cfg` read."""
    files = []
    for key, dataset in loader_datasets(cfg):
        if dataset.get("ann_file"):  # MMDetection's datasets join it with their data_root
            files.append((key, os.path.abspath(os.path.join(dataset.get("data_root") or "", dataset["ann_file"]))))
    for key in EVALUATORS:
        evaluators = cfg.get(key)
        for evaluator in evaluators if isinstance(evaluators, list) else [evaluators] if evaluators else []:
            if evaluator.get("ann_file"):
                files.append((key, os.path.abspath(evaluator["ann_file"])))
    return files


def image_folders(cfg: Config) -> List[tuple]:
    """(config key, absolute path) of every image folder the loaders of `cfg` read (`data_prefix`, which
    MMEngine's datasets join with their data_root)."""
    return [(key, os.path.abspath(os.path.join(dataset.get("data_root") or "", folder)))
            for key, dataset in loader_datasets(cfg) for folder in (dataset.get("data_prefix") or {}).values()
            if isinstance(folder, str) and folder]


def annotation_paths(cfg: Config, *keys: str) -> List[str]:
    """The paths of `annotation_files` read by the loaders / evaluators `keys` (all of them without keys)."""
    return [path for key, path in annotation_files(cfg) if not keys or key in keys]


def check_annotation_files(cfg: Config, source: Optional[str] = None, keys: Optional[Sequence[str]] = None) -> None:
    """Refuse a missing annotation file of `cfg`, or one that is not a JSON object (a truncated or corrupt file),
    naming it; `source` is where its path came from (`--data-root X`; None: the config's own paths); `keys`: the
    loaders and evaluators the command reads (None: all), so that a root with only the val split serves a
    full-precision evaluation. Only the first and last bytes are read: COCO's files are hundreds of MB."""
    for key, path in annotation_files(cfg):
        if keys is not None and key not in keys:
            continue
        if not os.path.isfile(path):
            where = f"{source}: " if source else ""
            fix = "" if source else " (give --data-root: COCO's layout, annotations/, train2017/, val2017/)"
            raise DetectionError(f"{where}{key} reads {path}, which does not exist{fix}")
        with open(path, "rb") as f:
            head = f.read(64).lstrip()
            f.seek(max(0, os.path.getsize(path) - 64))
            tail = f.read().rstrip()
        if not (head.startswith(b"{") and tail.endswith(b"}")):
            raise DetectionError(f"{key} reads {path}, which is not a JSON object (a truncated or corrupt "
                                 "annotation file?)")


def check_image_folders(cfg: Config, loaders: Sequence[str], source: Optional[str] = None) -> None:
    """Refuse a missing image folder of the `loaders` a command reads (train_dataloader, val_dataloader,
    test_dataloader), naming it: the images are read only when a batch is drawn, so a missing val2017/ failed
    after a training epoch (check_annotations then refuses a folder that lacks some of the images listed).
    `source` as for `check_annotation_files`."""
    for key, path in image_folders(cfg):
        if key in loaders and not os.path.isdir(path):
            where = f"{source}: " if source else ""
            fix = "" if source else " (give --data-root: COCO's layout, annotations/, train2017/, val2017/)"
            raise DetectionError(f"{where}{key} reads its images from {path}, which is no folder{fix}")


@contextlib.contextmanager
def reading_annotations(files: Sequence[str], built: Optional[str] = None):
    """Report an error MMDetection or pycocotools raise while reading the annotation `files` (a file without
    COCO's keys, invalid JSON) as one line naming them: their messages ('categories', 'Expecting value')
    name no file. `built`: the config's parts built inside besides reading the files (where the files have
    been read whole before, by check_annotations), which the line names first: a setting there (a batch size of
    0, an unknown metric) fails with the same kinds of error."""
    try:
        yield
    except DetectionError:
        raise
    except (KeyError, ValueError, TypeError, IndexError) as e:
        named = ", ".join(dict.fromkeys(files))  # a file read by several loaders and evaluators is named once
        if built:
            raise DetectionError(f"{built} could not be built from the config ({type(e).__name__}: {e}): check "
                                 f"its settings, and the annotation files it reads ({named})") from None
        raise DetectionError(f"{named}: cannot be read as a COCO annotation file ({type(e).__name__}: {e})") from None


def _built_datasets(dataset: Any, key: str) -> List[tuple]:
    """(config key, dataset) of a built dataset and those it wraps (RepeatDataset, ConcatDataset, ...), keyed as
    `_datasets` walks their config dicts."""
    found = [(key, dataset)]
    inner = getattr(dataset, "dataset", None)
    if inner is not None:
        found += _built_datasets(inner, f"{key}.dataset")
    for i, sub in enumerate(getattr(dataset, "datasets", None) or []):
        found += _built_datasets(sub, f"{key}.datasets.{i}")
    return found


def check_pipeline(dataset: Any, key: str) -> None:
    """Refuse a transform of the built loader `key`'s dataset that fails on its first image, naming the transform
    and the image: a transform is built from a setting of the wrong type without a word (Resize keeps
    scale="abc") and failed with a traceback only on an image, in the first training step or the first
    evaluation batch, or for the val loader after a training epoch. The image runs through the pipeline one
    transform at a time, as the dataset's Compose runs it, and the random-number state is put back after, so
    that training draws what it would have."""
    for prefix, inner in _built_datasets(dataset, f"{key}.dataset"):
        transforms = getattr(getattr(inner, "pipeline", None), "transforms", None)
        if not transforms or not hasattr(inner, "get_data_info") or not len(inner):
            continue  # a wrapper (its inner dataset has the pipeline), or no image to run
        state = RngStateHook._state()
        try:
            results = inner.get_data_info(0)
            image = results.get("img_path", "its first image") if isinstance(results, dict) else "its first image"
            for i, transform in enumerate(transforms):
                try:
                    results = transform(results)
                except (OSError, KeyError, ValueError, TypeError, IndexError, AssertionError, AttributeError) as e:
                    raise DetectionError(f"{prefix}.pipeline.{i} ({type(transform).__name__}) fails on {image} "
                                         f"({type(e).__name__}: {e}): check its settings") from None
                if results is None:  # a transform that drops the image (Compose stops there too)
                    break
        finally:
            RngStateHook._restore(state)


def dataset_classes(dataset: dict) -> Optional[tuple]:
    """The class names a loader's COCO dataset dict trains or scores, in label order as the config gives them
    (its metainfo, else its class's default: COCO's 80), or None for a dataset that is not a CocoDataset."""
    from mmdet.datasets import CocoDataset
    kind = DATASETS.get(dataset.get("type")) if isinstance(dataset.get("type"), str) else dataset.get("type")
    if not (inspect.isclass(kind) and issubclass(kind, CocoDataset)):
        return None
    classes = (dataset.get("metainfo") or {}).get("classes") or kind.METAINFO.get("classes")
    return tuple(classes) if classes else None


def _image_folder(dataset: dict) -> Optional[str]:
    """The folder a loader's dataset dict reads its images from (`data_prefix.img`, joined with its data_root as
    MMEngine's datasets join it), or None where it names none."""
    folder = (dataset.get("data_prefix") or {}).get("img")
    return os.path.abspath(os.path.join(dataset.get("data_root") or "", folder)) if isinstance(folder, str) else None


def check_annotations(cfg: Config, keys: Sequence[str], source: Optional[str] = None,
                      max_images: Optional[int] = None, trains: bool = True) -> List[str]:
    """Refuse a COCO annotation file of the loaders `keys` that lists no images, lists images its loader's image
    folder lacks or holds as empty files, holds objects of an image id its images lack (`unlisted_image_problem`:
    MMDetection reads the objects of the listed images only), whose categories are not the config's classes in label
    order (`category_problems`), with an image of no size or a malformed box (`_check_boxes`), with a kept object
    without a segmentation where the loader's pipeline loads masks (`_check_segmentations`), or that gives no
    object to score, and a training split (all the files its loader joins) of no object to train on: MMDetection
    reads an image only when a batch is drawn (a missing val image failed with a traceback after a training
    epoch, an empty training image mid-epoch), drops the objects of other categories without a word, and numbers
    the classes in the file's order (a file with some of them, or with them in another order, would train or
    score each class against another's objects); a training split of no object left its filter_cfg no image
    ("need at least one array to concatenate"), and the val or test images scored without an object were scored
    mAP -1, pycocotools' mark of no ground truth, recorded as a score. Every image the file lists is checked,
    those the training's filter_cfg would skip too. `source` as for
    `check_annotation_files`; `max_images`: the first N images of the test split scored (evaluate_detection.py's
    --max-images, of its dataset's `indices` where it gives them); `trains`: whether the run trains on
    train_dataloader's boxes (evaluate_detection.py may read it only to calibrate).

    Each file is read once, whole, before any dataset is built, so COCO's train2017 file (about 450 MB) is read
    twice in all, here and by the dataset: json.load of a 317 MB file of train2017's counts (118,287 images,
    860,001 polygons) took 12.4 s and 1.9 GB on a 2-core Intel Xeon VM, per process (every rank of a torchrun
    reads it); its boxes' checks (`_check_boxes`, `_dropped_boxes_warning`) took 2.7-2.8 s more on an idle 2-core
    AMD EPYC VM (860,001 random boxes on 118,287 images, as Python built them), and 3.75 s of CPU on the same data
    read back from JSON on a loaded 2-core VM. The boxes MMDetection drops by its own rule (narrower than 1 px:
    COCO 2017 has a few) are returned, one warning a file, for the caller to print (`print_warnings`) once its
    last check has passed: a refused run warns of nothing."""
    by_file: dict = {}  # the loaders of each file, so that one read serves them all
    trained: dict = {}  # training file -> its images with an object of the classes: judged together, below
    warnings: List[str] = []  # of boxes MMDetection drops: the caller prints them once nothing is refused
    for key, dataset in loader_datasets(cfg):
        classes = dataset_classes(dataset) if key in keys and dataset.get("ann_file") else None
        if classes:  # a COCO dataset (others read other formats)
            path = os.path.abspath(os.path.join(dataset.get("data_root") or "", dataset["ann_file"]))
            indices = dataset.get("indices")
            # --max-images cuts the test loader's own dataset (feeds.build_loader refuses it for a wrapper)
            limit = max_images if key == "test_dataloader" and dataset is cfg[key]["dataset"] else None
            by_file.setdefault(path, []).append((key, classes, _image_folder(dataset),
                                                 tuple(indices) if isinstance(indices, (list, tuple)) else indices,
                                                 limit, _loads_masks(dataset.get("pipeline"))))
    for path, readers in by_file.items():
        with reading_annotations([path]):
            with open(path) as f:
                data = json.load(f)
            images, categories, annotations = data["images"], data["categories"], data.get("annotations") or []
            boxes_checked = masks_checked = False
            # a file a ConcatDataset reads twice: once
            for key, classes, folder, indices, limit, masks in dict.fromkeys(readers):
                if images == []:  # MMEngine's sampler failed on it with "need at least one array to concatenate"
                    raise DetectionError(f"{key} reads {path}, which lists no images: give the data set's annotation "
                                         "file")
                missing, empty = unusable_images(images, folder) if folder else ([], [])
                if missing or empty:
                    where = f"{source}: " if source else ""
                    found = ([f"{len(missing)} of them not in {folder} (the first: {missing[0]})"] if missing else [])
                    found += ([f"{len(empty)} of them {'an empty file' if len(empty) == 1 else 'empty files'} "
                               f"(0 bytes) in {folder} (the first: {empty[0]})"] if empty else [])
                    fix = " and ".join((["put the missing images there"] if missing else []) +
                                       ([f"copy the empty {'one' if len(empty) == 1 else 'ones'} there again"]
                                        if empty else []))
                    raise DetectionError(f"{where}{key} reads {path}, which lists {len(images)} images, "
                                         f"{' and '.join(found)}: {fix}, or give the annotation file of the images "
                                         "that folder holds")
                problem = unlisted_image_problem(images, annotations)
                if problem:
                    raise DetectionError(f"{key} reads {path}, which {problem}: MMDetection would neither train on "
                                         "nor score those objects; give the data set's whole annotation file, or one "
                                         "without them")
                problem = category_problems(categories, annotations, classes)
                if problem:
                    raise DetectionError(f"{key} reads {path}, which {problem}: give the data set the detector is "
                                         f"configured for, or set {key}.dataset.metainfo.classes to its categories "
                                         "in the file's order")
                if not boxes_checked:  # once a file (its first reader names it)
                    # MMDetection's CocoDataset skips an object marked `ignore` before it reads its box; COCO's
                    # evaluation (a val or test file) sets `ignore` from iscrowd and reads every object's box
                    _check_boxes(key, path, images, annotations,
                                 skip_ignored={k for k, *_ in readers} == {"train_dataloader"})
                    boxes_checked = True
                if masks and not masks_checked:  # once a file, for its first reader that loads masks
                    _check_segmentations(key, path, images, categories, annotations, classes)
                    masks_checked = True
                if key == "train_dataloader":
                    trained[path] = images_with_objects(images, categories, annotations, classes)
                _check_objects(key, path, images, categories, annotations, classes, indices, limit)
            warning = _dropped_boxes_warning([key for key, *_ in readers], path, images, annotations, trains)
            if warning:
                warnings.append(warning)
        del data, images, annotations  # one file's objects at a time: a parsed train2017 file takes GBs
    if "train_dataloader" in keys:
        _check_training_objects(cfg, trained)
    return warnings


def print_warnings(warnings: Sequence[str]) -> None:
    """Print `warnings` (check_annotations') on stderr, one `warning:` line each, on the main rank only: called
    by a command once its last refusal has passed (a refused run warns of nothing)."""
    if _on_main_rank():
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr, flush=True)


def _on_main_rank() -> bool:
    """Whether this process is rank 0 or the only one, before the ranks meet too (torchrun's RANK; srun's
    SLURM_PROCID where the Runner has not copied it into RANK yet)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def _check_boxes(key: str, path: str, images: list, annotations: list, skip_ignored: bool = False) -> None:
    """Refuse a file with an image of no positive width and height, or with malformed boxes (`box_problem`: not
    4 finite numbers, an area that is not one, a negative width or height), naming the first and the count:
    MMDetection's CocoDataset dropped them (an image whose drawn object was so dropped trained as background) or
    kept them (an infinite width: a box to infinity) without a word, and failed with a KeyError traceback on an
    image without a size. `skip_ignored`: the file is read by train_dataloader alone, whose CocoDataset skips an
    object marked `ignore` without reading its box."""
    unsized = unsized_images(images)
    if unsized:
        image = next(i for i in images if i.get("id") == unsized[0])
        raise DetectionError(f"{key} reads {path}, which lists {len(unsized)} image{'' if len(unsized) == 1 else 's'} "
                             f"without a positive width and height (the first: image id {unsized[0]!r}, width "
                             f"{image.get('width')!r}, height {image.get('height')!r}): MMDetection judges every box "
                             "against them; give each image's size in pixels")
    count, first = malformed_boxes(annotations, skip_ignored)
    if count:
        raise DetectionError(f"{key} reads {path}, which holds {count} malformed box{'' if count == 1 else 'es'} "
                             f"(the first: {first}): MMDetection's CocoDataset drops or keeps such a box without a "
                             f"word; correct or remove {'it' if count == 1 else 'them'} (a box is [x, y, width, "
                             "height] in pixels of its image)")


def _loads_masks(pipeline: Any) -> bool:
    """Whether a dataset's `pipeline` (its transforms' dicts, wrappers' inner ones too) has a LoadAnnotations
    with with_mask=True (MMDetection's default is False)."""
    if isinstance(pipeline, dict):
        kind = pipeline.get("type")
        name = kind if isinstance(kind, str) else getattr(kind, "__name__", "")
        return ((name.split(".")[-1] == "LoadAnnotations" and bool(pipeline.get("with_mask")))
                or any(_loads_masks(value) for value in pipeline.values()))
    if isinstance(pipeline, (list, tuple)):
        return any(_loads_masks(item) for item in pipeline)
    return False


def _check_segmentations(key: str, path: str, images: list, categories: list, annotations: list,
                         classes: Sequence[str]) -> None:
    """Refuse a file whose kept objects (`unsegmented_objects`) lack a segmentation, where `key`'s pipeline loads
    masks: MMDetection's LoadAnnotations failed on the first image holding one with a KeyError 'mask' traceback,
    mid-epoch (a box-only data set, as Objects365 or CrowdHuman, given to Mask R-CNN)."""
    count, first = unsegmented_objects(images, categories, annotations, classes)
    if count:
        raise DetectionError(f"{key} reads {path}, which holds {count} object{'' if count == 1 else 's'} without a "
                             f"segmentation (the first: annotation id {first!r}), and {key}'s pipeline loads masks "
                             "(LoadAnnotations with with_mask=True), which fails on such an object with a KeyError "
                             "'mask': give every object its segmentation (a polygon or RLE), or train a detector "
                             "without a mask head, with_mask=False")


def _dropped_boxes_warning(keys: Sequence[str], path: str, images: list, annotations: list,
                           trains: bool = True) -> Optional[str]:
    """The warning for a file (read by the loaders `keys`, train_dataloader's trained on where `trains`) holding
    well-formed boxes that MMDetection's CocoDataset drops by its own rule (`dropped_boxes`: COCO 2017's training
    file has a few narrower than 1 px, which must not make it unusable), or None: their count, the first, and the
    images left without any box because of it."""
    count, first, bare = dropped_boxes(images, annotations)
    if not count:
        return None
    keys = list(dict.fromkeys(keys))
    trained = trains and "train_dataloader" in keys  # evaluate_detection.py may read it to calibrate alone
    scored = any(k in ("val_dataloader", "test_dataloader") for k in keys)
    return (f"{' and '.join(keys)} read{'s' if len(keys) == 1 else ''} {path}, which holds {count} "
            f"box{'' if count == 1 else 'es'} (the first: annotation id {first!r}) that MMDetection's CocoDataset "
            "drops by its own rule (no area inside the image, an area <= 0, or a width or height under 1 px)"
            + (f", leaving {bare} image{'' if bare == 1 else 's'} without any box because of it"
               + (" (trained on as background)" if trained else "") if bare else
               ", leaving no image without a box")
            + ("; COCO's evaluation, which reads the file itself, scores those boxes all the same" if scored
               else ""))


def _check_training_objects(cfg: Config, trained: dict) -> None:
    """Refuse a training split of no image with an object of the config's classes in any of its files (`trained`:
    file -> such images), and a file of none that a dataset reads with filter_cfg.filter_empty_gt: MMDetection
    keeps none of its images (alone, "need at least one array to concatenate"; joined by a ConcatDataset, the same
    error from its empty dataset, where it is serialized: MMEngine's default). A file of background images only,
    which a ConcatDataset joins to files with objects with filter_empty_gt off (hard negatives), is fine. A split
    with a dataset that is not COCO's, whose objects are not counted here, is judged on its COCO files alone."""
    leaves = [d for k, d in loader_datasets(cfg) if k == "train_dataloader" and not d.get("dataset")
              and not d.get("datasets")]
    # CocoDataset filters only where filter_cfg sets filter_empty_gt, and not in test mode
    read = [(os.path.abspath(os.path.join(d.get("data_root") or "", d["ann_file"])),
             bool((d.get("filter_cfg") or {}).get("filter_empty_gt")) and not d.get("test_mode"))
            for d in leaves if d.get("ann_file") and dataset_classes(d)]
    if not read:
        return
    classes = next(dataset_classes(d) for d in leaves if d.get("ann_file") and dataset_classes(d))
    named = ", ".join(classes[:6]) + (" ..." if len(classes) > 6 else "")
    files = list(dict.fromkeys(path for path, _ in read))
    if len(read) == len(leaves) and not any(trained.get(path) for path in files):
        filtered = {f for _, f in read}
        why = ("with filter_cfg.filter_empty_gt, MMDetection keeps no image" if filtered == {True} else
               "the images MMDetection keeps, with filter_cfg.filter_empty_gt off, are background alone"
               if filtered == {False} else "MMDetection keeps no image of the files read with "
               "filter_cfg.filter_empty_gt, and background alone of the others")
        where = (f"{files[0]}, in which no training image has" if len(files) == 1 else
                 f"{len(files)} files ({', '.join(files)}), in none of which a training image has")
        raise DetectionError(f"train_dataloader reads {where} an object of the config's classes ({named}): a "
                             f"detector would train on none ({why}); give the data set's annotation file")
    empty = next((path for path, f in read if f and not trained.get(path)), None)
    if empty:
        raise DetectionError(f"train_dataloader reads {empty}, in which no training image has an object of the "
                             f"config's classes ({named}), with filter_cfg.filter_empty_gt: MMDetection keeps none "
                             "of its images; give the data set's annotation file, or set that dataset's "
                             "filter_cfg.filter_empty_gt=False to train on its images as background (hard negatives)")


def _check_objects(key: str, path: str, images: list, categories: list, annotations: list, classes: Sequence[str],
                   indices: Any, limit: Optional[int]) -> None:
    """Refuse a val or test file whose scored images (its `indices`, then the first `limit`: --max-images) hold no
    object COCO's evaluation scores, which makes their mAP undefined (pycocotools gives -1). A training file is
    judged with the others of its split (`_check_training_objects`)."""
    named = ", ".join(classes[:6]) + (" ..." if len(classes) > 6 else "")
    if key not in ("val_dataloader", "test_dataloader"):
        return
    ids = scored_images(images, indices)
    cut = limit is not None and limit >= 1 and len(ids) > limit  # a limit below 1 is build_loader's to refuse
    ids = ids[:limit] if cut else ids
    if not scored_objects(ids, categories, annotations, classes):
        scope = (f"its first {len(ids)} images (--max-images {limit})" if cut else
                 f"the {len(ids)} images of {key}.dataset.indices" if indices is not None else
                 f"its {len(ids)} images")
        more = ", or score more images (--max-images)" if cut else ""
        raise DetectionError(f"{key} reads {path}, which holds no objects of the config's classes ({named}) in "
                             f"{scope} (crowd regions, which COCO's evaluation ignores, not counted): mAP is "
                             f"undefined (pycocotools scores it -1); give the data set's annotation file{more}")


CLASS_HEADS = ("bbox_head", "mask_head")  # the heads that predict the data set's classes


def check_head_classes(cfg: Config) -> None:
    """Refuse a box or mask head of `cfg.model` (CLASS_HEADS: one-stage, two-stage and cascade) whose num_classes
    is not the number of classes its train_dataloader trains: a box head of 5 classes on the sample's 2 trained an
    epoch and failed with an IndexError traceback in the validation after it. Other heads keep their own counts
    (the RPN's is class-agnostic, an HTC semantic head's counts stuff classes)."""
    key = "train_dataloader"
    classes = next((c for k, d in loader_datasets(cfg) if k == key for c in [dataset_classes(d)] if c), None)
    if not classes:
        return

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            count = node.get("num_classes")
            named = [part for part in prefix.split(".") if not part.isdigit()][-1]  # a cascade's list index skipped
            if (isinstance(count, int) and not isinstance(count, bool) and count != len(classes)
                    and named in CLASS_HEADS):
                raise DetectionError(f"{prefix}.num_classes={count}, but {key} has {len(classes)} classes "
                                     f"({', '.join(classes[:6])}{' ...' if len(classes) > 6 else ''}): set "
                                     f"{prefix}.num_classes={len(classes)}, or the data set's classes "
                                     f"({key}.dataset.metainfo.classes)")
            for inner, value in node.items():
                walk(f"{prefix}.{inner}", value)
        elif isinstance(node, (list, tuple)):  # a cascade's box heads
            for index, value in enumerate(node):
                walk(f"{prefix}.{index}", value)
    walk("model", cfg.get("model"))


def check_evaluator_annotations(cfg: Config, split: str = "test") -> None:
    """Refuse a `split` evaluator that reads another annotation file than the `split` loader: it would score
    the loader's predictions against the ground truth of other images."""
    metrics = cfg.get(f"{split}_evaluator")
    if not metrics:  # a training config without validation
        return
    read = annotation_paths(cfg, f"{split}_dataloader")  # one file, unless it concatenates data sets
    loader_ann = read[0] if len(read) == 1 else None
    for metric in metrics if isinstance(metrics, list) else [metrics]:
        ann = metric.get("ann_file")
        if ann and loader_ann and os.path.abspath(ann) != loader_ann:
            raise DetectionError(f"{split}_evaluator.ann_file={ann} but {split}_dataloader reads {loader_ann}: "
                                 f"give both the same file ({split}_dataloader.dataset.ann_file is relative to "
                                 "its data_root)")


def check_evaluator_thresholds(cfg: Config, split: str = "test") -> None:
    """Refuse an `iou_thrs` of the `split` evaluator (CocoMetric's IoU thresholds): pycocotools' summary looks up
    mAP_50 and mAP_75 with `iouThr == p.iouThrs`, which for thresholds given as a list or a number (a config can give
    no numpy array) is one bool: under numpy 2 a ValueError ("Calling nonzero on 0d arrays") once the whole split is
    scored (in training at the first validation), under numpy 1 the two scores -1, pycocotools' mark of no ground
    truth. COCO's thresholds (0.5:0.95), CocoMetric's default, are the paper's mAP."""
    metrics = cfg.get(f"{split}_evaluator")
    for metric in (metrics if isinstance(metrics, list) else [metrics]) if metrics else []:
        if isinstance(metric, dict) and metric.get("iou_thrs") is not None:
            raise DetectionError(f"{split}_evaluator.iou_thrs={metric['iou_thrs']}: pycocotools' summary cannot "
                                 "look up its mAP_50 and mAP_75 among thresholds given in a config (it fails once "
                                 "every image is scored); drop it, for COCO's IoU thresholds 0.5:0.95")
