"""GPLQ's PCA feature-mimicking loss: penultimate features projected on the teacher's top components.

GPLQ paper (arXiv 2506.11784), Sec. 3: take the float teacher's penultimate (pre-head) features on a training
subset, compute their mean mu_t and principal components, keep V with about 60% explained variance rounded to
a multiple of 32 (Swin-T 256/768 = 61.3%, DeiT-T 64/192), and train the student with

    L_PCA = mean_batch || (f_s - mu_t) V - (f_t - mu_t) V ||^2,

both features centred on the TEACHER mean. (The mean cancels in the difference, so L_PCA equals
mean ||(f_s - f_t) V||^2; we keep the written form.) The rounding rule is "the smallest multiple of 32
reaching the variance target" (ceil), capped at the feature width: it reproduces both quoted sizes.
Moments are accumulated in float64 and all-reduced, so every rank of a distributed run gets the same V: the
PCA of the union of the ranks' images. A rank whose loader yields no image adds zero moments (the sums are
unchanged by it); only when no rank has an image does every rank raise. An error reading a rank's images ends
every rank (the others with OtherRankError) instead of leaving them in the all-reduce.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from engine.distributed import OtherRankError, all_reduce, raise_on_every_rank, world_size
from engine.precision import autocast


@dataclass
class PCAProjection:
    """Teacher mean [D], kept components [D, k] (columns, descending variance), explained fraction."""

    mean: torch.Tensor
    components: torch.Tensor
    explained: float
    samples: int

    @property
    def dims(self) -> int:
        return int(self.components.shape[1])

    def state_dict(self) -> dict:
        return {"mean": self.mean.cpu(), "components": self.components.cpu(), "explained": self.explained,
                "samples": self.samples}

    @classmethod
    def from_state_dict(cls, state: dict, device: torch.device) -> "PCAProjection":
        return cls(state["mean"].to(device), state["components"].to(device), float(state["explained"]),
                   int(state["samples"]))


def penultimate(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """timm's pre-logits features [B, D] (pooled, after the final norm / fc_norm, before the classifier)."""
    return model.forward_head(model.forward_features(images), pre_logits=True)


@torch.no_grad()
def fit_pca(teacher: nn.Module, batches: Iterable, max_images: int, variance: float = 0.6, multiple: int = 32,
            amp: str = "none", exact: bool = False) -> PCAProjection:
    """PCA of the teacher's penultimate features over at most `max_images` images of `batches` per rank, of the
    union of every rank's images (a rank whose `batches` yield none adds none).

    Args:
        teacher: float model in eval mode.
        batches: iterable of (images, labels) on any device (e.g. this rank's training loader).
        max_images: images per rank to use (stops early).
        variance: explained-variance target.
        multiple: component counts are multiples of this (capped at the feature width).
        amp: autocast mode of the teacher forward.
        exact: `max_images` is a count the user gave: a rank whose `batches` end before it is a ValueError on
            every rank (naming the images that rank had), not a smaller PCA subset.

    Returns:
        PCAProjection on the teacher's device (float32).
    """
    if max_images < 1:  # the loop would run the teacher on an empty slice and divide by its 0 images (NaN)
        raise ValueError(f"max_images={max_images}: the PCA needs at least one image")
    device = next(teacher.parameters()).device
    error = None
    try:
        s1, s2, n = _local_moments(teacher, batches, max_images, amp, device)
    except Exception as e:  # noqa: BLE001 - raised below, on this rank as it is, on the others as OtherRankError
        error, s1, s2, n = e, None, None, torch.zeros((), dtype=torch.float64, device=device)
    # every rank reaches the collectives below, also the one whose loader failed: none waits for it forever
    raise_on_every_rank(error, device, lambda: OtherRankError(
        "another rank failed reading its images for the GPLQ PCA of the teacher features; its output says why"))
    # the feature width over ranks (0 where a rank saw no image), so that such a rank adds zero moments
    width = int(all_reduce(torch.tensor([0 if s1 is None else s1.numel()], device=device), op="max").item())
    if width == 0:  # the same on every rank: every rank raises
        raise ValueError("no images for the PCA of the teacher features: the training loader yielded none"
                         + (" on any rank" if world_size() > 1 else ""))
    if exact:  # the rank with the fewest images, as a shortfall (max_images - n), so that a "max" finds it
        short = int(all_reduce((max_images - n).reshape(1), op="max").item())
        if short > 0:  # the same on every rank: every rank raises
            raise ValueError(f"pca_images={max_images}: one epoch of the training loader gives "
                             f"{'a rank' if world_size() > 1 else 'it'} {max_images - short} images; give at most "
                             f"that, or leave pca_images out (its default is capped at one epoch)")
    if s1 is None:
        s1 = torch.zeros(width, dtype=torch.float64, device=device)
        s2 = torch.zeros(width, width, dtype=torch.float64, device=device)
    all_reduce(s1)
    all_reduce(s2)
    all_reduce(n)
    return components_from_moments(s1, s2, n, variance, multiple)


def _local_moments(teacher: nn.Module, batches: Iterable, max_images: int, amp: str,
                   device: torch.device) -> tuple:
    """This rank's summed features s1 [D], summed outer products s2 [D, D] (float64; None without an image) and
    image count n (a float64 scalar) over at most `max_images` images of `batches`."""
    s1 = s2 = None
    n = torch.zeros((), dtype=torch.float64, device=device)
    seen = 0
    for images, _ in batches:
        images = images[: max_images - seen].to(device, non_blocking=True)
        with autocast(amp, device):
            f = penultimate(teacher, images)
        f = f.double()
        s1 = f.sum(0) if s1 is None else s1 + f.sum(0)
        s2 = f.t() @ f if s2 is None else s2 + f.t() @ f
        n += f.shape[0]
        seen += images.shape[0]
        if seen >= max_images:  # stop here: a further batch would be read (decoded, augmented) for nothing
            break
    return s1, s2, n


def components_from_moments(s1: torch.Tensor, s2: torch.Tensor, n: torch.Tensor, variance: float,
                            multiple: int) -> PCAProjection:
    """PCA from summed features s1 [D], summed outer products s2 [D, D] and the count n (float64).

    Keeps the smallest multiple of `multiple` components whose explained variance reaches `variance`
    (capped at D).
    """
    mean = s1 / n
    cov = s2 / n - torch.outer(mean, mean)
    evals, evecs = torch.linalg.eigh(cov)  # ascending
    evals, evecs = evals.flip(0).clamp(min=0.0), evecs.flip(1)
    ratio = torch.cumsum(evals, 0) / evals.sum().clamp(min=1e-300)
    reach = int((ratio < variance).sum().item()) + 1  # smallest k with ratio >= variance
    k = min(evals.numel(), max(multiple, math.ceil(reach / multiple) * multiple))
    # all D components sum to 1 up to rounding (1.0000000000000002 was reported): a fraction, at most 1
    explained = min(1.0, float(ratio[k - 1]))
    return PCAProjection(mean.float(), evecs[:, :k].float().contiguous(), explained, int(n.item()))


def pca_loss(student_features: torch.Tensor, teacher_features: torch.Tensor,
             pca: PCAProjection) -> torch.Tensor:
    """mean_batch ||(f_s - mu_t) V - (f_t - mu_t) V||^2 (scalar; features [B, D])."""
    s = (student_features.float() - pca.mean) @ pca.components
    t = (teacher_features.float() - pca.mean) @ pca.components
    return (s - t).pow(2).sum(dim=1).mean()
