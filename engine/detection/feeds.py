"""Detection images for scoring and quantization: a split's loader, and the training images given the test
pipeline that quantization calibrates and reconstructs on (`DetectorFeed`, a `quant.calibrate.ModelFeed`;
`DetectorSamples`, a `quant.units.SampleFeed`): the seam between a detector and quant/."""
from __future__ import annotations

import copy
import os
import random
from typing import Any, Optional

import torch
from torch import nn
from mmengine.config import Config
from mmengine.dataset import pseudo_collate
from mmengine.runner import Runner
from mmdet.registry import DATASETS

from engine.detection.data_checks import annotation_paths, reading_annotations
from engine.detection.errors import DetectionError

def build_loader(cfg: Config, split: str = "test", max_images: Optional[int] = None,
                 seed: Optional[int] = None) -> torch.utils.data.DataLoader:
    """The `split` loader of `cfg` ("test" or "val"); `max_images` keeps the first N images (a partial result,
    marked as such by the caller) of those the split has, or of its dataset's `indices` where it gives them.
    `seed`: the sampler's, where its config gives none (MMEngine's sync_random_seed, which the sampler calls
    without one, is a collective: under torchrun the caller draws it before work that may fail on one rank)."""
    loader_cfg = copy.deepcopy(cfg[f"{split}_dataloader"])
    if seed is not None and isinstance(loader_cfg.get("sampler"), dict):
        loader_cfg["sampler"].setdefault("seed", seed)  # as Runner.build_dataloader's default_args would
    if max_images is not None:
        if max_images < 1:
            raise DetectionError(f"--max-images {max_images}: give at least 1")
        wrapper = loader_cfg["dataset"]
        if wrapper.get("dataset") or wrapper.get("datasets"):  # MMEngine's wrappers take no indices: a TypeError
            raise DetectionError(f"--max-images {max_images}: {split}_dataloader.dataset is a {wrapper.get('type')}, "
                                 "which takes no indices; drop --max-images to score the whole split")
        # an `indices` of the config or an override is the split asked for: the dataset is built with it and the first
        # N of what it holds are kept, as MMEngine takes them (they were of the whole split, which
        # `test_dataloader.dataset.indices=[2,3] --max-images 1` scored image 0 of; and min(indices, N) kept all of the
        # last 3 images of `indices=-3 --max-images 1`, of which annotation_contents.scored_images counts the first)
        with reading_annotations(annotation_paths(cfg, f"{split}_dataloader")):
            dataset = DATASETS.build(wrapper)
            if hasattr(dataset, "full_init"):
                dataset.full_init()
        if not hasattr(dataset, "get_subset_"):  # a plain torch Dataset registered in DATASETS
            raise DetectionError(f"--max-images {max_images}: {split}_dataloader.dataset is a "
                                 f"{type(dataset).__name__}, which cannot keep its first images; drop --max-images to "
                                 "score the whole split")
        if len(dataset) < max_images:  # MMEngine keeps what there is, silently
            raise DetectionError(f"--max-images {max_images}: the {split} split has only {len(dataset)} images "
                                 "(drop --max-images to score them all)")
        if len(dataset) > max_images:  # MMEngine's subset of a serialized dataset asserts N < its length
            dataset.get_subset_(max_images)
        loader_cfg["dataset"] = dataset  # Runner.build_dataloader takes a built dataset as it is
    with reading_annotations(annotation_paths(cfg, f"{split}_dataloader")):
        loader = Runner.build_dataloader(loader_cfg)
    return loader


def _split_images(dataset: dict, pipeline: list) -> dict:
    """The training `dataset` dict as the images it trains on, each once, given `pipeline`: a wrapper of one
    dataset (`dataset`: RepeatDataset, ClassBalancedDataset, MultiImageMixDataset) only repeats or mixes that
    dataset's images, so it is replaced by it (its repeats drew one image several times and counted it as
    several, and a MultiImageMixDataset given the test pipeline too ran it again on the packed image: a KeyError);
    a ConcatDataset (`datasets`) keeps every dataset it joins; each dataset is whole (its `indices` dropped)."""
    if isinstance(dataset.get("dataset"), dict):
        return _split_images(dataset["dataset"], pipeline)
    dataset = {k: v for k, v in dataset.items() if k != "indices"}
    if dataset.get("datasets"):
        dataset["datasets"] = [_split_images(inner, pipeline) for inner in dataset["datasets"]]
    else:
        dataset["pipeline"] = copy.deepcopy(pipeline)
    return dataset


def pipeline_of_test_split(cfg: Config) -> list:
    """The pipeline test_dataloader gives its images: its dataset's, or that of every dataset a wrapper of it
    (ConcatDataset, ...) holds; one error line where those differ, as there is then no one test pipeline. A
    MultiImageMixDataset runs its own pipeline on what its dataset's made (less its skip_type_keys), so the two
    are one pipeline; one that mixes in other images (Mosaic, MixUp: a `get_indexes`) is refused, as it has no
    one-image form."""
    found = []

    def walk(key: str, dataset: dict, after: list) -> None:
        if dataset.get("dataset"):
            walk(f"{key}.dataset", dataset["dataset"], _wrapper_steps(key, dataset) + after)
        elif dataset.get("datasets"):
            for index, inner in enumerate(dataset["datasets"]):
                walk(f"{key}.datasets.{index}", inner, after)
        else:
            found.append((f"{key}.pipeline", list(dataset.get("pipeline") or []) + after))
    walk("test_dataloader.dataset", cfg.test_dataloader["dataset"], [])
    other = next((key for key, pipeline in found if pipeline != found[0][1]), None)
    if other is not None:
        raise DetectionError(f"{found[0][0]} and {other} differ: quantization gives its training images the test "
                             "pipeline, so give the test split's datasets one pipeline")
    return copy.deepcopy(found[0][1])


def _wrapper_steps(key: str, wrapper: dict) -> list:
    """The transforms the test-split wrapper `wrapper` (at `key`) runs on its dataset's images: a
    MultiImageMixDataset's `pipeline` but the types in its `skip_type_keys`; none for the others (RepeatDataset,
    ClassBalancedDataset: no pipeline). A mixing transform is one error line naming it."""
    from mmdet.registry import TRANSFORMS
    skip = set(wrapper.get("skip_type_keys") or ())
    steps = [t for t in wrapper.get("pipeline") or [] if t.get("type") not in skip]
    for index, step in enumerate(wrapper.get("pipeline") or []):
        kind = TRANSFORMS.get(step["type"]) if isinstance(step.get("type"), str) else step.get("type")
        # looked up on the classes: mmcv's cache_randomness descriptor fails when read from a class
        if step.get("type") not in skip and any("get_indexes" in vars(c) for c in getattr(kind, "__mro__", ())):
            raise DetectionError(f"{key}.pipeline.{index} ({step.get('type')}) mixes other test images into each "
                                 "one, which quantization's training images cannot follow: give the test split a "
                                 f"pipeline of one image at a time (or add it to {key}.skip_type_keys)")
    return copy.deepcopy(steps)


class TrainingImages:
    """The training split with the TEST pipeline (resize, no flip), so that no validation image is seen before
    scoring: built once (COCO's train2017 annotations take a while) for the counts to be checked before any work
    and for every pipeline that draws calibration or reconstruction images from it. A dataset wrapper's repeats
    are not drawn: the split is the images of the datasets it wraps, each once, whole (`_split_images`)."""

    def __init__(self, cfg: Config) -> None:
        dataset_cfg = _split_images(copy.deepcopy(cfg.train_dataloader["dataset"]), pipeline_of_test_split(cfg))
        with reading_annotations(annotation_paths(cfg, "train_dataloader")):
            self.dataset = DATASETS.build(dataset_cfg)
        # the dataset indices drawn from: a ConcatDataset may join an image file twice (one dataset given twice, to
        # oversample it), which is drawn and counted once
        self.positions = (_first_of_each_image(self.dataset) if dataset_cfg.get("datasets")
                          else range(len(self.dataset)))

    def __len__(self) -> int:
        return len(self.positions)

    def check(self, count: int, flag: str) -> None:
        """Refuse drawing `count` images, `flag` naming the option that asked for them."""
        if count < 1:
            raise DetectionError(f"{flag} {count}: give at least 1")
        if len(self) < count:
            raise DetectionError(f"{flag} {count}: the training split has only {len(self)} images")

    def draw(self, count: int, seed: int, flag: str) -> tuple:
        """(indices, samples): `count` distinct images drawn with `seed`."""
        self.check(count, flag)
        # random.Random seeds with abs(seed), so -s would draw the images of s; modulo 2**64 gives every seed of
        # configs' Seed range (-2**63 ..) its own non-negative one, as torch.manual_seed does, and keeps s >= 0 as is
        indices = sorted(random.Random(seed % 2 ** 64).sample(self.positions, count))
        return indices, [_prepared(self.dataset, i) for i in indices]


def _prepared(dataset: Any, index: int) -> dict:
    """Image `index` of the training split given its (test) pipeline, or one error line where the pipeline drops it:
    a training dataset's __getitem__ (test_mode off) would put a random other image in its place, drawn with numpy's
    global state up to `max_refetch` times, so the images calibrated on were not those drawn, and could repeat.
    A dataset that is no MMEngine BaseDataset (a plain torch Dataset registered in DATASETS) has no prepare_data:
    its dataset[index] is taken as it is, so a dropped image is caught only where that item is None; one such a
    dataset replaces by another image cannot be told apart here."""
    # a ConcatDataset: the dataset holding the image, and its index there
    while getattr(dataset, "datasets", None) and hasattr(dataset, "_get_ori_dataset_idx"):
        which, index = dataset._get_ori_dataset_idx(index)
        dataset = dataset.datasets[which]
    if not hasattr(dataset, "prepare_data"):
        data = dataset[index]
        if data is None:
            raise DetectionError(f"the test pipeline drops training image {index} of the {type(dataset).__name__} "
                                 "dataset (its item is None): quantization gives its training images the test "
                                 "pipeline, so give test_dataloader.dataset.pipeline transforms that keep every image")
        return data
    data = dataset.prepare_data(index)
    if data is None:
        path = dataset.get_data_info(index).get("img_path")
        raise DetectionError(f"the test pipeline drops the training image {path} (a transform returned None, e.g. "
                             "FilterAnnotations): quantization gives its training images the test pipeline, so give "
                             "test_dataloader.dataset.pipeline transforms that keep every image")
    return data


def _first_of_each_image(dataset: Any) -> list:
    """The indices of `dataset` at which each image file it reads comes first."""
    seen, first = set(), []
    for index in range(len(dataset)):
        path = os.path.abspath(dataset.get_data_info(index)["img_path"])
        if path not in seen:
            seen.add(path)
            first.append(index)
    return first


def train_images_with_test_pipeline(cfg: Config, count: int, seed: int, flag: str,
                                    images: Optional[TrainingImages] = None) -> tuple:
    """(indices, samples): `count` distinct images of the training split drawn with `seed`, each given the TEST
    pipeline (`TrainingImages`; `images`: one already built). `flag` names the option that asked for them in
    errors."""
    if count < 1:  # before the split is read
        raise DetectionError(f"{flag} {count}: give at least 1")
    return (images or TrainingImages(cfg)).draw(count, seed, flag)


class DetectorFeed:
    """A detector's calibration set as a `quant.calibrate.ModelFeed` and a one-batch `quant.units.SampleFeed`:
    `count` images of the training split, drawn with `seed` and given the TEST pipeline (resize, no flip),
    collated into ONE padded batch, so that a single test step of the detector calibrates every quantizer on
    all of them at once.

    The official RepQ-ViT and APHQ detection code calibrates on one image at batch 1 (RepQ-ViT: its test
    loader's first; APHQ: its training loader's first); here the images come from the training split with the
    test pipeline.
    """

    def __init__(self, cfg: Config, count: int, seed: int = 0, images: Optional[TrainingImages] = None) -> None:
        self.indices, images = train_images_with_test_pipeline(cfg, count, seed, "--calib-images", images)
        self.batch = pseudo_collate(images)
        self.count = count

    @torch.no_grad()
    def feed(self, model: nn.Module) -> int:
        model.test_step(self.batch)
        return self.count

    def __len__(self) -> int:
        return 1

    @torch.no_grad()
    def run(self, model: nn.Module, index: int) -> Any:
        return model.test_step(self.batch)


class DetectorSamples:
    """APHQ's reconstruction images of a detector (`quant.aphq.detector.DetectorSamples`), and GPLQ's QwT images:
    `count` training images drawn with `seed`, test pipeline, one image per batch (the official optimisation
    loader has batch 1 and takes the first 256 images with the training pipeline). `flag`: the option that set
    `count`, for errors."""

    def __init__(self, cfg: Config, count: int, seed: int = 0, flag: str = "--quant-options aphq.recon_images",
                 images: Optional[TrainingImages] = None) -> None:
        self.indices, images = train_images_with_test_pipeline(cfg, count, seed, flag, images)
        self.batches = [pseudo_collate([image]) for image in images]

    def __len__(self) -> int:
        return len(self.batches)

    @torch.no_grad()
    def run(self, model: nn.Module, index: int) -> Any:
        return model.test_step(self.batches[index])

    def rpn_outputs(self, model: nn.Module, index: int) -> tuple:
        """The raw RPN outputs (objectness logits, box deltas per FPN level) of image `index`, with gradients."""
        data = model.data_preprocessor(self.batches[index], False)
        return model.rpn_head(model.extract_feat(data["inputs"]))
