"""What engine/detection/evaluation.evaluate_detector records as a detector's mAP, against pycocotools' COCOeval run
directly on the same detections: its value rounded to 3 decimals (MMDetection's CocoMetric rounds it so; README.md
says it), never another number.

Marked `detection`: they need MMDetection with full mmcv (scripts/install_mmcv.sh).
"""
from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch
from torch import nn

from detection_runs import SAMPLE_CONFIG

pytestmark = pytest.mark.detection


class _Shifted(nn.Module):
    """A stand-in detector (no training): for each image, every ground-truth box of the annotation file shifted
    by a few pixels, with a score of its own, so that COCO's mAP is a number of more than 3 decimals."""

    def __init__(self, gt, cat_ids):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))  # evaluate_detector reads the device of the model's parameters
        self.gt, self.cat_ids, self.detections = gt, cat_ids, []

    def test_step(self, batch):
        from mmengine.structures import InstanceData
        samples = batch["data_samples"]
        for sample in samples:
            anns = self.gt.imgToAnns[sample.img_id]
            boxes, scores = [], []
            for i, ann in enumerate(anns):
                x, y, w, h = ann["bbox"]
                shift = 1.5 + 1.7 * ((ann["id"] * 7) % 5)  # IoU from about 0.9 down to about 0.5
                boxes.append([x + shift, y + 0.5 * shift, x + w + shift, y + h + 0.5 * shift])
                scores.append(0.9 - 0.13 * i)
                self.detections.append({"image_id": sample.img_id, "category_id": ann["category_id"],
                                        "bbox": [x + shift, y + 0.5 * shift, w, h], "score": scores[-1]})
            sample.pred_instances = InstanceData(
                bboxes=torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                scores=torch.tensor(scores, dtype=torch.float32),
                labels=torch.tensor([self.cat_ids.index(a["category_id"]) for a in anns], dtype=torch.long))
        return samples


def test_the_recorded_map_is_pycocotools_rounded_to_3_decimals(sample):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    from engine.detection import build_loader, load_config
    from engine.detection.evaluation import evaluate_detector
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    cfg.test_evaluator = dict(cfg.test_evaluator, metric="bbox")
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(os.path.join(sample, "annotations", "instances_val2017.json"))
    model = _Shifted(gt, sorted(gt.getCatIds()))
    result = evaluate_detector(model, cfg, build_loader(cfg, "test"), progress=False)
    with contextlib.redirect_stdout(io.StringIO()):  # the reference: COCOeval on the same detections
        run = COCOeval(gt, gt.loadRes(model.detections), "bbox")
        run.evaluate()
        run.accumulate()
        run.summarize()
    for key, exact in zip(("bbox_mAP", "bbox_mAP_50", "bbox_mAP_75"), run.stats[:3]):
        assert result[key] == round(float(exact), 3), (key, result[key], exact)
    assert result["bbox_mAP"] != float(run.stats[0])  # a number of more than 3 decimals, so the test tells
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    assert ("box / mask mAP by pycocotools, as MMDetection's CocoMetric records it (rounded to 3 decimals"
            in " ".join(readme.split()))  # what the results file holds, as the docs say


class _ShiftedMasks(_Shifted):
    """A stand-in detector: each image's ground-truth boxes as they are (box mAP 1.0), with their masks shifted
    right by a few pixels (a mask mAP below it), and scores of their own."""

    def test_step(self, batch):
        import numpy as np
        from mmengine.structures import InstanceData
        from pycocotools import mask as mask_utils
        samples = batch["data_samples"]
        for sample in samples:
            anns = self.gt.imgToAnns[sample.img_id]
            info = self.gt.imgs[sample.img_id]
            boxes, scores, masks = [], [], []
            for i, ann in enumerate(anns):
                x, y, w, h = ann["bbox"]
                shift = 1 + (ann["id"] * 7) % 5  # mask IoUs from high to low
                mask = np.zeros((info["height"], info["width"]), dtype=np.uint8)
                mask[:, shift:] = self.gt.annToMask(ann)[:, :-shift]
                boxes.append([x, y, x + w, y + h])
                scores.append(0.9 - 0.13 * i)
                masks.append(mask)
                rle = mask_utils.encode(np.asfortranarray(mask))
                rle["counts"] = rle["counts"].decode()
                self.detections.append({"image_id": sample.img_id, "category_id": ann["category_id"],
                                        "bbox": [x, y, w, h], "segmentation": rle, "score": scores[-1]})
            sample.pred_instances = InstanceData(
                bboxes=torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                scores=torch.tensor(scores, dtype=torch.float32),
                labels=torch.tensor([self.cat_ids.index(a["category_id"]) for a in anns], dtype=torch.long),
                masks=torch.from_numpy(np.stack(masks)).bool() if masks
                else torch.zeros(0, info["height"], info["width"], dtype=torch.bool))
        return samples


def test_the_box_and_mask_maps_are_pycocotools_bbox_and_segm_each(sample):
    """Where box and mask mAP differ (exact boxes, shifted masks), each recorded number is COCOeval's of its own
    kind on the same detections (a perfect detector, 1.0 on both, tells neither from the other)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    from engine.detection import build_loader, load_config
    from engine.detection.evaluation import evaluate_detector
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)  # the sample config's metric: bbox and segm
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(os.path.join(sample, "annotations", "instances_val2017.json"))
    model = _ShiftedMasks(gt, sorted(gt.getCatIds()))
    result = evaluate_detector(model, cfg, build_loader(cfg, "test"), progress=False)
    for kind in ("bbox", "segm"):
        with contextlib.redirect_stdout(io.StringIO()):  # the reference: COCOeval run directly, of this kind
            run = COCOeval(gt, gt.loadRes(model.detections), kind)
            run.evaluate()
            run.accumulate()
            run.summarize()
        for key, exact in zip((f"{kind}_mAP", f"{kind}_mAP_50", f"{kind}_mAP_75"), run.stats[:3]):
            assert result[key] == round(float(exact), 3), (key, result[key], exact)
    assert result["bbox_mAP"] == pytest.approx(1.0) and result["segm_mAP"] < 0.9, result  # so the test tells


class _PaddedIdentity(_Shifted):
    """A stand-in detector whose `backbone` is an identity 1x1 conv on the batch its data preprocessor makes:
    each image padded to a multiple of 48 pixels with the value 1000 (unnormalized pixels, at most 255)."""

    def __init__(self, gt, cat_ids):
        from mmdet.models.data_preprocessors import DetDataPreprocessor
        super().__init__(gt, cat_ids)
        self.data_preprocessor = DetDataPreprocessor(pad_size_divisor=48, pad_value=1000)
        self.backbone = nn.Conv2d(3, 3, 1, bias=False)
        with torch.no_grad():
            self.backbone.weight.copy_(torch.eye(3).view(3, 3, 1, 1))

    def test_step(self, batch):
        self.backbone(self.data_preprocessor(batch, False)["inputs"])
        return super().test_step(batch)


def test_the_recorded_maxima_count_the_padded_pixels_and_say_so(sample):
    """The data preprocessor pads every test image (the 64-pixel sample images to 96 here) and the backbone
    computes on the padding too: its maximum is the pad value, 1000, not a pixel's (255 at most), and the result
    records that (max_act.padding, docs/reproduce.md): the settings it was measured under were nowhere in it."""
    from pycocotools.coco import COCO
    from engine.detection import build_loader, load_config
    from engine.detection.evaluation import evaluate_detector
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    cfg.test_evaluator = dict(cfg.test_evaluator, metric="bbox")
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(os.path.join(sample, "annotations", "instances_val2017.json"))
    loader = build_loader(cfg, "test")
    result = evaluate_detector(_PaddedIdentity(gt, sorted(gt.getCatIds())), cfg, loader, probe_maxima=True,
                               progress=False)
    assert result["max_act"] == {"backbone": 1000.0, "head": 0.0, "padding": {
        "counted": True, "pad_size_divisor": 48, "pad_value": 1000, "batch_size": cfg.test_dataloader.batch_size}}
