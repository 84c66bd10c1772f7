"""The warning of the boxes MMDetection drops by its own rule (engine/detection/data_checks.py): printed by
scripts/train_detection.py and evaluate_detection.py once their last refusal has passed, never by a refused
run; said "trained on as background" only where the run trains; and the objects marked `ignore`, whose boxes
MMDetection's CocoDataset never reads, refused only where COCO's evaluation reads them."""
from __future__ import annotations

import json
import shutil

import pytest

from detection_runs import SAMPLE_CONFIG

pytestmark = pytest.mark.detection

DROPPED = [5.0, 5.0, 0.5, 3.0]  # narrower than 1 px: MMDetection drops it (the sample's images are 64 x 64)


def _copy_with(sample, tmp_path, split, index, **fields):
    """A copy of the sample data set whose `split` file's `index`-th object has `fields`; (root, that file)."""
    root = tmp_path / "coco"
    shutil.copytree(sample, root)
    path = root / "annotations" / f"instances_{split}.json"
    data = json.loads(path.read_text())
    data["annotations"][index].update(fields)
    for key in [k for k, v in fields.items() if v is None]:
        data["annotations"][index].pop(key)
    path.write_text(json.dumps(data))
    return root, str(path)


def _warnings(err: str) -> list:
    return [line for line in err.splitlines() if line.startswith("warning: ") and "MMDetection's CocoDataset drops"
            in line]


@pytest.mark.parametrize("refusal", [["model.roi_head.bbox_head.num_classes=5"],  # check_head_classes
                                     ["--resume"]])  # check_work_dir: nothing to resume from
def test_a_refused_training_prints_no_box_warning(sample, tmp_path, capsys, refusal):
    """The checks after the annotation check (the heads' classes, the work dir) refuse the run: it warns of
    nothing, its one line is the error."""
    import train_detection
    root, _ = _copy_with(sample, tmp_path, "train2017", 0, bbox=DROPPED, area=1.5)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        train_detection.run(["--config", SAMPLE_CONFIG, "--data-root", str(root), "--work-dir",
                             str(tmp_path / "w"), *refusal])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith(("error:", "warning:"))][0].startswith("error:")
    assert _warnings(err) == [], err


def test_a_training_that_starts_prints_the_box_warning_once(sample, tmp_path, capsys, monkeypatch):
    """Past every check (the pipelines' on the first images the last), the warning is printed once."""
    from mmengine.runner import Runner
    import train_detection
    root, path = _copy_with(sample, tmp_path, "train2017", 0, bbox=DROPPED, area=1.5)
    monkeypatch.setattr(Runner, "train", lambda self: None)  # the training itself is not what is tested
    capsys.readouterr()
    assert train_detection.main(["--config", SAMPLE_CONFIG, "--data-root", str(root), "--work-dir",
                                 str(tmp_path / "w")]) == 0
    warnings = _warnings(capsys.readouterr().err)
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: train_dataloader reads {path}, which holds 1 box")


def _fresh_weights(root, tmp_path):
    """A detector as built, saved as a checkpoint (its scores do not matter here)."""
    import torch
    from mmdet.registry import MODELS
    from engine.detection import load_config
    weights = str(tmp_path / "fresh.pth")
    torch.save({"state_dict": MODELS.build(load_config([SAMPLE_CONFIG], {}, str(root), None).model).state_dict(),
                "meta": {}}, weights)
    return weights


def test_a_refused_evaluation_prints_no_box_warning_and_one_that_scores_prints_it_once(sample, tmp_path, capsys):
    """evaluate_detection.py refuses a --checkpoint that is no checkpoint after the annotation check: no warning;
    with a detector's weights it scores, and warns once."""
    from evaluate_detection import main
    root, path = _copy_with(sample, tmp_path, "val2017", 0, bbox=DROPPED, area=1.5)
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"junk")
    capsys.readouterr()
    with pytest.raises(Exception):
        main(["--config", SAMPLE_CONFIG, "--data-root", str(root), "--checkpoint", str(junk), "--quant",
              "--device", "cpu", "--out", str(tmp_path / "junk.json")])
    assert _warnings(capsys.readouterr().err) == []
    main(["--config", SAMPLE_CONFIG, "--data-root", str(root), "--checkpoint", _fresh_weights(root, tmp_path),
          "--quant", "--device", "cpu", "--out", str(tmp_path / "e.json")])
    warnings = _warnings(capsys.readouterr().err)
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: test_dataloader reads {path}, which holds 1 box")


def test_background_is_said_only_where_the_run_trains(sample, tmp_path):
    """A training file's image left without any box trains as background in a training; a run that reads the
    training split only to calibrate trains on nothing."""
    from engine.detection import check_annotations, load_config
    root, _ = _copy_with(sample, tmp_path, "train2017", 0, bbox=DROPPED, area=1.5)  # the first image's one object
    cfg = load_config([SAMPLE_CONFIG], data_root=str(root))
    trained, = check_annotations(cfg, ["train_dataloader"])
    calibrated, = check_annotations(cfg, ["train_dataloader"], trains=False)
    assert trained.endswith("leaving 1 image without any box because of it (trained on as background)")
    assert calibrated.endswith("leaving 1 image without any box because of it")


@pytest.mark.parametrize("pipeline, trains", [("aphq", False),  # calibrates: reconstructs, trains no detector
                                              ("gplq", True)])  # stage 1 trains on the detection loss
def test_evaluate_detection_says_whether_it_trains(sample, tmp_path, monkeypatch, pipeline, trains):
    import engine.detection
    from engine.detection import DetectionError
    from evaluate_detection import main
    asked = {}

    def stop(*args, **kwargs):
        asked.update(kwargs)
        raise DetectionError("stop")
    monkeypatch.setattr(engine.detection, "check_annotations", stop)
    with pytest.raises(Exception):
        main(["--config", SAMPLE_CONFIG, "--data-root", sample, "--checkpoint", str(tmp_path / "x.pth"),
              "--quant", pipeline, "--out", str(tmp_path / "e.json")])
    assert asked["trains"] is trains


def _coco_eval_reads(path):
    """Run COCO's evaluation of the file's own boxes as detections (what CocoMetric runs on a val file)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    gt = COCO(path)
    dets = [dict(image_id=a["image_id"], category_id=a["category_id"], bbox=[1.0, 1.0, 5.0, 5.0], score=1.0)
            for a in gt.dataset["annotations"]]
    e = COCOeval(gt, gt.loadRes(dets), "bbox")
    e.evaluate()


@pytest.mark.parametrize("split", ["train2017", "val2017"])
def test_an_ignored_object_without_an_area_is_refused_only_where_coco_evaluation_reads_it(sample, tmp_path, split):
    """MMDetection's CocoDataset skips an object marked `ignore` before reading its box or area, so a training
    file's is no error; COCO's evaluation sets `ignore` from iscrowd and reads every object's area (a KeyError),
    so a val file's is refused."""
    from mmdet.datasets import CocoDataset
    from engine.detection import DetectionError, check_annotations, load_config
    root, path = _copy_with(sample, tmp_path, split, 1, ignore=1, area=None)
    dataset = CocoDataset(ann_file=path, data_prefix=dict(img=str(root / split)),
                          metainfo=dict(classes=("box", "disc")), test_mode=True, pipeline=[])
    assert len(dataset) > 0  # read without a word
    cfg = load_config([SAMPLE_CONFIG], data_root=str(root))
    if split == "train2017":
        assert check_annotations(cfg, ["train_dataloader"]) == []
        return
    with pytest.raises(KeyError):
        _coco_eval_reads(path)
    with pytest.raises(DetectionError, match=r"holds 1 malformed box \(the first: annotation id .*: area None is "
                                             "not a finite number\\)"):
        check_annotations(cfg, ["val_dataloader"])


def _objects_of_second_image(change):
    """Apply `change` to each object of the file's second image (the sample's holds three)."""
    def edit(data):
        second = data["images"][1]["id"]
        for annotation in data["annotations"]:
            if annotation["image_id"] == second:
                change(annotation)
    return edit


def _first_object(change):
    def edit(data):
        change(data["annotations"][0])
    return edit


@pytest.mark.parametrize("name, edit, with_mask", [
    ("as_is", lambda data: None, True),
    ("missing", _objects_of_second_image(lambda a: a.pop("segmentation")), True),  # a box-only data set's objects
    ("empty", _first_object(lambda a: a.update(segmentation=[])), True),
    ("crowd", _first_object(lambda a: a.update(segmentation=None, iscrowd=1)), True),  # kept as an ignored region
    ("ignored", _first_object(lambda a: (a.pop("segmentation"), a.update(ignore=1))), True),  # skipped by MMDet
    ("dropped", _first_object(lambda a: (a.pop("segmentation"), a.update(bbox=DROPPED, area=1.5))), True),
    ("no_masks", _objects_of_second_image(lambda a: a.pop("segmentation")), False)])  # a pipeline without masks
def test_objects_without_a_segmentation_are_refused_exactly_where_loading_their_masks_fails(sample, tmp_path, name,
                                                                                           edit, with_mask):
    """Mask R-CNN's LoadAnnotations(with_mask=True) failed mid-epoch with a KeyError 'mask' on the first image
    holding an object without a segmentation; refused before any work, naming the first and the count, exactly
    where MMDetection's own CocoDataset and LoadAnnotations fail on an image of the file."""
    from mmcv.transforms import LoadImageFromFile
    from mmdet.datasets import CocoDataset
    from mmdet.datasets.transforms import LoadAnnotations
    from engine.detection import DetectionError, check_annotations, load_config
    root = tmp_path / name
    shutil.copytree(sample, root)
    path = root / "annotations" / "instances_train2017.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    dataset = CocoDataset(ann_file=str(path), data_prefix=dict(img=str(root / "train2017")),
                          metainfo=dict(classes=("box", "disc")), test_mode=True,
                          pipeline=[dict(type=LoadImageFromFile),
                                    dict(type=LoadAnnotations, with_bbox=True, with_mask=with_mask)])
    # the objects MMDetection reads without a mask
    unmasked = [inst for k in range(len(dataset)) for inst in dataset.get_data_info(k)["instances"]
                if "mask" not in inst]
    failed = 0
    for index in range(len(dataset)):
        try:
            dataset[index]
        except KeyError as e:
            assert e.args == ("mask",)
            failed += 1
    cfg = load_config([SAMPLE_CONFIG], data_root=str(root))
    for transform in cfg.train_dataloader.dataset.pipeline:
        if transform["type"] == "LoadAnnotations":
            transform["with_mask"] = with_mask
    if not failed:
        check_annotations(cfg, ["train_dataloader"])
        assert name in ("as_is", "ignored", "dropped", "no_masks")
        return
    first = next(a["id"] for a in data["annotations"] if not a.get("segmentation"))
    with pytest.raises(DetectionError) as error:
        check_annotations(cfg, ["train_dataloader"])
    count = len(unmasked)
    assert count == {"missing": 3}.get(name, 1)
    assert str(error.value) == (
        f"train_dataloader reads {path}, which holds {count} object{'' if count == 1 else 's'} without a "
        f"segmentation (the first: annotation id {first!r}), and train_dataloader's pipeline loads masks "
        "(LoadAnnotations with with_mask=True), which fails on such an object with a KeyError 'mask': give every "
        "object its segmentation (a polygon or RLE), or train a detector without a mask head, with_mask=False")
