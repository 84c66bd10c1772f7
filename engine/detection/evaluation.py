"""Scoring a detector: COCO box / mask mAP over a loader (MMDetection's CocoMetric, restricted to the images
scored, gathered across ranks) and the paper's backbone / head activation maxima."""
from __future__ import annotations

import contextlib
import copy
import io
import time
from typing import Any, Dict, List

import torch
from torch import nn
from mmengine.config import Config
from mmengine.evaluator import Evaluator
from mmdet.registry import METRICS

from engine.act_max import ActivationProbe, first_not_finite
from engine.detection.data_checks import annotation_paths, check_evaluator_annotations, reading_annotations
from engine.detection.errors import DetectionError
from engine.distributed import OtherRankError, all_reduce, raise_on_every_rank

BACKBONE = ("backbone",)
HEADS = ("neck", "rpn_head", "roi_head")
METRIC_KEYS = ("bbox_mAP", "bbox_mAP_50", "bbox_mAP_75", "segm_mAP", "segm_mAP_50", "segm_mAP_75")


def _image_ids(dataset) -> List[int]:
    """The COCO image ids of the images `dataset` holds (only the first N under --max-images)."""
    return [dataset.get_data_info(i)["img_id"] for i in range(len(dataset))]


def _evaluator(cfg: Config, loader) -> Any:
    """The config's test metrics, scoring the images of `loader` only: MMDetection's CocoMetric scores every
    image of its annotation file unless its `img_ids` are set, so a partial set (--max-images) would count the
    images it never saw as missed. Under torchrun they gather the ranks' predictions through the process group
    (collect_device "gpu": all_gather_object, on gloo too) unless the config sets collect_device: MMEngine's
    default, "cpu", writes them into a `.dist_test` folder it leaves in the working directory, which every
    node must share."""
    check_evaluator_annotations(cfg)
    metrics = cfg.test_evaluator if isinstance(cfg.test_evaluator, list) else [cfg.test_evaluator]
    metrics = [copy.deepcopy(m) for m in metrics]
    if torch.distributed.is_initialized():
        for metric in metrics:
            metric.setdefault("collect_device", "gpu")
    # the file is the test loader's (check_evaluator_annotations), read whole when the loader was built: an error
    # here is a setting of the metric (metric=bboxx) as likely as the file, and the line names the metric first
    with reading_annotations(annotation_paths(cfg, "test_evaluator"), built="test_evaluator"):
        built = [METRICS.build(m) for m in metrics]
    ids = _image_ids(loader.dataset)
    for metric in built:
        if getattr(metric, "img_ids", False) is None:  # CocoMetric: None means every image of its ann_file
            metric.img_ids = ids
    evaluator = Evaluator(built)
    evaluator.dataset_meta = loader.dataset.metainfo
    return evaluator


@torch.no_grad()
def evaluate_detector(model: nn.Module, cfg: Config, loader, probe_maxima: bool = False,
                      progress: bool = True) -> Dict[str, Any]:
    """COCO box / mask mAP of `model` on `loader` (pycocotools, through MMDetection's CocoMetric, which rounds it
    to 3 decimals: 0.1 mAP point, the paper's precision), and with
    `probe_maxima` the activation maxima of the backbone and of the heads (module outputs, see
    `activation_maxima`). Returns {"bbox_mAP": .., "segm_mAP": .., ..., "images": N, "seconds": ..}.

    Under torchrun each rank scores its shard of `loader` (MMEngine's DefaultSampler); the evaluator gathers
    the predictions on rank 0, which computes the metrics for every rank, and the maxima are all-reduced."""
    evaluator = _evaluator(cfg, loader)
    model.eval()
    device = next(model.parameters()).device
    probe = ActivationProbe(model, blocks=BACKBONE + HEADS) if probe_maxima else None
    start, images, error = time.perf_counter(), 0, None
    with probe if probe is not None else contextlib.nullcontext():
        try:
            for i, batch in enumerate(loader):
                outputs = model.test_step(batch)
                evaluator.process(data_samples=outputs, data_batch=batch)
                images += len(outputs)
                if progress and (i + 1) % 50 == 0:  # under torchrun: of this rank's shard
                    print(f"  {images}/{len(loader.sampler)} images", flush=True)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            error = e
    # a rank whose shard failed (an image it cannot read) ends every rank, instead of leaving the others in the
    # evaluator's gathering of the predictions
    raise_on_every_rank(error, device, lambda: OtherRankError(
        "another rank could not score its share of the val images; its output says why"))
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its whole summary table
        metrics = evaluator.evaluate(len(loader.dataset))
    result = {k.split("/")[-1]: float(v) for k, v in metrics.items() if k.split("/")[-1] in METRIC_KEYS}
    # pycocotools' -1 is "no ground truth", not a score (check_annotations refuses such a split before any work);
    # every rank has the metrics rank 0 computed, so every rank raises
    undefined = [k for k, v in result.items() if v < 0]
    if undefined:
        raise DetectionError(f"{', '.join(undefined)} of the {len(loader.dataset)} images scored came out "
                             f"{result[undefined[0]]:g}, pycocotools' mark of no ground truth (no object of the "
                             "config's classes among them): not recorded; give the annotation file of the data "
                             "set's objects")
    # the sampler pads the last shards with repeated images, which the evaluator drops: count each image once
    scored = int(all_reduce(torch.tensor([images], device=device)).item())
    result.update(images=min(scored, len(loader.dataset)), seconds=time.perf_counter() - start)
    if probe is not None:
        result["max_act"] = {**activation_maxima(probe, device), "padding": padding_record(model, loader)}
    return result


def padding_record(model: nn.Module, loader) -> Dict[str, Any]:
    """What the activation maxima were measured on as to padding, for the result file: the data preprocessor pads
    each image of a test batch at the bottom and right with `pad_value` (in normalized pixels) to a multiple of
    `pad_size_divisor` and to the largest image of its batch (`batch_size`), and the backbone, neck and heads
    compute on the padded batch, so their outputs at the padded pixels are in the maxima (`counted`): the detector
    computes them (the neck's and RPN's convolutions read them beside the image's; the windows of real tokens
    attend to them), unlike Swin's window padding, whose rows are cropped off and left out (engine/act_max.py).
    The maxima thus depend on the test batch: at batch 1 on the padding to the divisor alone."""
    pre = getattr(model, "data_preprocessor", None)
    return {"counted": True, "pad_size_divisor": getattr(pre, "pad_size_divisor", None),
            "pad_value": getattr(pre, "pad_value", None), "batch_size": getattr(loader, "batch_size", None)}


def activation_maxima(probe: ActivationProbe, device: torch.device) -> Dict[str, Any]:
    """The paper's detection "Max. Act. (backbone / head)": max |value| over the outputs of every module in
    the backbone (blocks and everything in them, patch merging, the output norms), and over those of every
    module of the neck, RPN and RoI heads, on the evaluated images as the detector sees them, padded
    (`padding_record`). (The paper does not define the sets further; this is our reading of "aggregated ... over
    the backbone and detector head outputs".)"""
    records = probe.result(reduce_fn=lambda t: all_reduce(t, op="max"), device=device).per_layer
    check_finite_maxima(records)  # the records all-reduced: every rank raises alike
    def largest(prefixes):
        return max((r["max"] for r in records if r["name"].split(".")[0] in prefixes), default=0.0)
    return {"backbone": largest(BACKBONE), "head": largest(HEADS)}


def check_finite_maxima(records: List[Dict[str, Any]]) -> None:
    """Refuse activation maxima that are not finite (engine.act_max records an output holding an inf or a NaN as
    inf), as evaluate.py does: no maximum was measured there, and written as the result's max_act (JSON Infinity) it
    is refused by the figure that reads it as a file without that number (scripts/motivation_figure.py). The scores
    can be defined all the same (an overflow in the mask head's logits, whose sigmoid is 0 or 1), so the FP pass did
    not refuse them. The evaluation runs in
    fp32 (no autocast), so no precision flag is the fix. Nothing is written."""
    # where it began: the first output not finite in the order the forward computed them (a NaN spreads on from there)
    found = first_not_finite(records)
    if found:
        first, more, origin = found
        more = f" and {more} more" if more else ""
        origin = f"; {origin}" if origin else ""
        raise DetectionError(f"activation maxima: the output of {first}{more} is not finite (inf or NaN) on the test "
                             f"images, so it has no maximum and nothing is written{origin}; the detector runs in fp32 "
                             "there, so its weights overflow it (a diverged run): score a checkpoint of before the "
                             "divergence")
