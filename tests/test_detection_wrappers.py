"""Training splits given as MMEngine / MMDetection dataset wrappers (RepeatDataset, ClassBalancedDataset,
MultiImageMixDataset, ConcatDataset): the images quantization draws from them (engine/detection/feeds.py), and
the overrides of their inner datasets an evaluation refuses because its pipelines do not read them
(evaluate_detection.evaluation_reads).

Marked `detection`: they need MMDetection with full mmcv (scripts/install_mmcv.sh).
"""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from detection_runs import SAMPLE_CONFIG

pytestmark = pytest.mark.detection


def _wrapped(cfg, kind):
    """`cfg` with its training dataset wrapped as `kind` (the wrapper's own settings as a config would give them)."""
    inner = copy.deepcopy(cfg.train_dataloader.dataset)
    if kind == "RepeatDataset":
        outer = dict(type=kind, times=3, dataset=inner)
    elif kind == "ClassBalancedDataset":
        outer = dict(type=kind, oversample_thr=0.9, dataset=inner)  # repeats the images of the rarer class
    elif kind == "MultiImageMixDataset":  # the loading transforms inside, the rest on the mixed images
        pipeline = inner.pop("pipeline")
        inner["pipeline"], outer = pipeline[:2], dict(type=kind, dataset=inner, pipeline=pipeline[2:])
    else:
        outer = dict(type="RepeatDataset", times=2, dataset=dict(type="ClassBalancedDataset", oversample_thr=0.9,
                                                                   dataset=inner))
    cfg.train_dataloader.dataset = outer
    return cfg


def _split_images(sample, name="train2017"):
    with open(os.path.join(sample, "annotations", f"instances_{name}.json")) as f:
        return {image["id"] for image in json.load(f)["images"]}


@pytest.mark.parametrize("kind", ["RepeatDataset", "ClassBalancedDataset", "MultiImageMixDataset", "nested"])
def test_a_wrapped_training_split_gives_each_of_its_images_once_with_the_test_pipeline(sample, kind):
    """A wrapper that repeats or mixes its dataset's images (3 times, by class frequency, mosaic) is the same
    training split to draw calibration images from: its 8 images, each once and as the test pipeline makes it. The
    repeats counted 24 (12) images, so that --calib-images 24 drew 8 images three times each, and a
    MultiImageMixDataset failed with a KeyError traceback on the first image drawn."""
    from engine.detection import DetectionError, TrainingImages, load_config
    from mmdet.registry import TRANSFORMS
    cfg = _wrapped(load_config([SAMPLE_CONFIG], data_root=sample), kind)
    images = TrainingImages(cfg)
    ids = _split_images(sample)
    assert len(images) == len(ids) == 8
    indices, samples = images.draw(8, 0, "--calib-images")
    assert sorted(s["data_samples"].img_id for s in samples) == sorted(ids)
    with pytest.raises(DetectionError, match=r"^--calib-images 9: the training split has only 8 images"):
        images.check(9, "--calib-images")
    # each image is what the config's test transforms, built here one by one, make of the file
    transforms = [TRANSFORMS.build(t) for t in copy.deepcopy(cfg.test_dataloader.dataset.pipeline)]
    root = os.path.join(sample, "train2017")
    for got in samples:
        expected = {"img_path": got["data_samples"].img_path, "img_id": got["data_samples"].img_id,
                    "instances": []}
        assert os.path.dirname(expected["img_path"]) == root
        for transform in transforms:
            expected = transform(expected)
        assert torch.equal(got["inputs"], expected["inputs"])
        assert got["data_samples"].metainfo["scale_factor"] == expected["data_samples"].metainfo["scale_factor"]
        assert got["data_samples"].metainfo.get("flip") in (None, False)


def test_the_datasets_a_concat_dataset_joins_are_drawn_from_all_and_whole(sample):
    """A ConcatDataset training split is the images of every dataset it joins (here train2017's 8 and val2017's 4),
    each dataset whole: an `indices` of an inner dataset is dropped
    as the outer one is (it kept 2 of the 8 images)."""
    from engine.detection import TrainingImages, load_config
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    train = copy.deepcopy(cfg.train_dataloader.dataset)
    train["indices"] = [0, 1]
    val = copy.deepcopy(cfg.test_dataloader.dataset)
    cfg.train_dataloader.dataset = dict(type="ConcatDataset", datasets=[train, val])
    images = TrainingImages(cfg)
    assert len(images) == 12
    _, samples = images.draw(12, 0, "--calib-images")
    drawn = {(os.path.basename(os.path.dirname(s["data_samples"].img_path)), s["data_samples"].img_id)
             for s in samples}
    assert drawn == ({("train2017", i) for i in _split_images(sample)}
                     | {("val2017", i) for i in _split_images(sample, "val2017")})
