"""The data seam between the entry point and pipelines that need more than the calibration batch.

percentile / repq only need the fixed calibration images that `Pipeline.__call__` receives. APHQ needs
1024 training-transform images (GoatWu/APHQ-ViT `test_quant.py`) and GPLQ a training loader, a PCA subset and
512 stage-2 images (GPLQ paper, arXiv 2506.11784, Sec. 3). quant/ never imports data/ or the entry points, so
the entry point hands a `PipelineData` of callables over (evaluate.py builds it from data/loader.py):

    data = PipelineData(train_images=lambda count, seed, train_transform: ...,
                        train_loader=lambda batch_size_per_gpu, seed: TrainBatches(loader, sampler),
                        work_prefix="runs/vit_b/eval_best")
    PIPELINES["aphq"](fp_model, calib_images, "w4a4", {"iters": 100}, data=data)

Everything a pipeline draws is a pure function of its arguments (seeded), so every rank of a
distributed run sees the same images from `train_images`; `train_loader` is the rank's shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

from engine.loop import TrainBatches


class TooFewImages(ValueError):
    """A `PipelineData.train_images` provider's refusal of a count its data cannot give (fewer readable images), its
    message the reason alone: `draw_train_images` raises one of the same type naming the pipeline's setting that
    asked before it."""


@dataclass
class PipelineData:
    """Training data for pipelines that reconstruct or train (APHQ, GPLQ); see the module docstring.

    train_images: (count, seed, train_transform) -> [count, 3, H, W] CPU tensor of `count` distinct
        train-split images chosen by `seed`. With train_transform each image carries ONE fixed random
        augmentation that depends on (seed, position) only (APHQ's preloaded optimisation set); with
        train_transform=False the eval transform (RepQ-ViT / QwT calibration convention).
        Pipelines draw through `draw_train_images`, which refuses a result that is not [count, C, H, W]
        (fewer images above all). A provider short of images raises `TooFewImages`.
    train_loader: (batch_size_per_gpu, seed) -> TrainBatches over the train split with the training
        transform, sharded across ranks (GPLQ stage 1, PCA subset). None: pipelines that need it raise.
    work_prefix: path prefix for files a pipeline keeps between runs, e.g. "runs/x/eval_best"; GPLQ
        writes "<prefix>_gplq_w4a4_stage1.pt" and resumes from it. None: nothing is written.
    detector_samples: (count, seed) -> `count` training images of a detector drawn with `seed`, one per
        batch (quant.aphq.detector.DetectorSamples; evaluate_detection.py builds it). Given instead of
        train_images for a model that is not called on an image tensor. Pipelines draw through
        `draw_detector_samples`, which refuses a result that does not hold `count` images.
    train_detector: (student, settings, work_dir) -> report: trains a detector in place on its own loss
        with MMDetection's runner (GPLQ stage 1; engine/detection/qat.py `train_activation_qat`), resuming from
        the checkpoints in work_dir.
    identity: what the drawn images depend on besides the arguments (the training split, its files and its
        transform), and the model's training-mode settings (dropout, stochastic depth): a pipeline that keeps
        files between runs (GPLQ stage 1) records it, so that a file trained otherwise is never resumed.
    preemption: (path of the checkpoint a stop writes) -> an engine.preemption.Preemption, a context manager
        (evaluate.py: this rank's, agreeing across ranks): GPLQ stage 1 opens it while it trains, so that
        SIGTERM / SIGINT write its checkpoint at the next update and raise `Preempted`. None: signals keep
        their default effect.
    """

    train_images: Optional[Callable[[int, int, bool], torch.Tensor]] = None
    train_loader: Optional[Callable[[int, int], TrainBatches]] = None
    work_prefix: Optional[str] = None
    detector_samples: Optional[Callable[[int, int], Any]] = None
    train_detector: Optional[Callable[[Any, Dict[str, Any], Optional[str]], Dict[str, Any]]] = None
    identity: Optional[Dict[str, Any]] = None
    preemption: Optional[Callable[[str], Any]] = None

    def draw_train_images(self, count: int, seed: int, train_transform: bool, option: str) -> torch.Tensor:
        """`train_images(count, seed, train_transform)`, refused unless it is a [count, C, H, W] tensor: a provider
        that has fewer images (a fixed pool sliced `pool[:count]`) would otherwise run the pipeline on those while
        its report records `count`. `option` names the setting that asked, e.g. "recon_images=1024", for the
        error. Every pipeline draws its classification images through here (APHQ, GPLQ)."""
        try:
            images = self.train_images(count, seed, train_transform)
        except TooFewImages as e:  # the provider knows no setting: the one that asked is the user's to change
            raise type(e)(f"{option}: {e}") from None  # its own type: evaluate.py's is a user error (one line)
        if isinstance(images, torch.Tensor) and images.dim() == 4 and images.shape[0] == count:
            return images
        got = (f"a tensor of shape {list(images.shape)}" if isinstance(images, torch.Tensor)
               else f"a {type(images).__name__}")
        raise ValueError(f"{option}: PipelineData.train_images({count}, ...) returned {got}, not {count} images "
                         f"[{count}, C, H, W]; give a count the data holds, or data that holds {count} images")

    def draw_detector_samples(self, count: int, seed: int, option: str) -> Any:
        """`detector_samples(count, seed)`, refused unless it holds `count` images (its `len`, one image per batch):
        as for `draw_train_images`, a provider with fewer (a fixed pool sliced `pool[:count]`) would otherwise run
        the pipeline on those while its report records `count`. `option` names the setting that asked, e.g.
        "recon_images=1024", for the error. Every pipeline draws a detector's images through here (APHQ, GPLQ)."""
        samples = self.detector_samples(count, seed)
        try:
            held = len(samples)
        except TypeError:  # no length: not a feed of images at all
            held = None
        if held == count:
            return samples
        asked = f"{option}: PipelineData.detector_samples({count}, ...) returned"
        if held is None:  # an iterator, None, ...: the pipelines index a feed of `count` images (one per batch)
            raise ValueError(f"{asked} a {type(samples).__name__}, which has no len(); give a feed of {count} images, "
                             "one per batch (a quant.units.SampleFeed: len() and run(model, index))")
        if held > count:  # the provider's fault: a count the data holds came back with more
            raise ValueError(f"{asked} {held} images, more than the {count} asked; the provider must return exactly "
                             "the count it is given")
        raise ValueError(f"{asked} {held} images, not {count}; give a count the data holds, or data that holds "
                         f"{count} images")

    def work_path(self, suffix: str) -> Optional[str]:
        """`<work_prefix><suffix>`, or None when there is no work prefix."""
        return None if self.work_prefix is None else f"{self.work_prefix}{suffix}"


def require_data(pipeline: str, data: Any, loader: bool = False) -> PipelineData:
    """`data` as PipelineData, or a clear error saying what the pipeline needs (no silent fallback)."""
    if not isinstance(data, PipelineData):
        raise ValueError(f"the {pipeline!r} pipeline draws its own training images: pass "
                         f"data=PipelineData(...) (evaluate.py builds it from the data config); "
                         "the calibration batch alone is not enough")
    if data.train_images is None and data.detector_samples is None:
        raise ValueError(f"the {pipeline!r} pipeline draws its own training images: PipelineData.train_images "
                         "(or detector_samples for a detector) is required")
    if loader and data.train_loader is None:
        raise ValueError(f"the {pipeline!r} pipeline trains: PipelineData.train_loader is required")
    return data
