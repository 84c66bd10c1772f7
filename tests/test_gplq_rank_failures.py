"""GPLQ under 2 gloo processes when one rank's data fails or is empty: every rank ends, each with an error that
says what happened (the failing rank its own, the others one naming it), never one left waiting in a
collective; a rank without images adds none to the PCA, which is then that of the other ranks' images."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from dist_utils import init_gloo, free_port, spawn_within, stay_until_all_recorded

DEADLINE_S = 90  # far above a passing run (seconds), below the group's timeout (a rank left waiting)


class Teacher(nn.Module):
    """penultimate() of this teacher is a fixed linear map of the flattened images."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 5)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.flatten(1))

    def forward_head(self, h: torch.Tensor, pre_logits: bool) -> torch.Tensor:
        return h


def images(seed: int, count: int) -> torch.Tensor:
    return torch.randn(count, 3, 2, 2, generator=torch.Generator().manual_seed(seed))


class Unreadable:
    """A loader whose second batch fails, as a worker that cannot decode an image raises in the main process."""

    def __iter__(self):
        yield images(1, 4), None
        raise OSError("cannot identify image file 'train/3/x.jpg'")


def _outcome(fn) -> tuple:
    try:
        pca = fn()
        return ("ok", {"mean": pca.mean, "components": pca.components, "samples": pca.samples})
    except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
        return (type(e).__name__, str(e))


def _pca_outcomes(rank: int) -> dict:
    from quant.gplq.pca import fit_pca

    torch.manual_seed(0)
    teacher = Teacher().eval()
    own = [(images(10, 6)[i:i + 3], None) for i in (0, 3)]
    outcomes = {
        "rank_1_empty": _outcome(lambda: fit_pca(teacher, own if rank == 0 else [], 64, 0.9, 1)),
        "all_empty": _outcome(lambda: fit_pca(teacher, [], 64, 0.9, 1)),
        "rank_1_unreadable": _outcome(lambda: fit_pca(teacher, own if rank == 0 else Unreadable(), 64, 0.9, 1)),
    }
    return outcomes


def test_pca_on_two_ranks_with_one_empty_or_failing(outcomes):
    rank0, rank1 = (outcomes[r]["pca"] for r in (0, 1))

    # rank 1 saw no image: both ranks get the PCA of rank 0's six images, computed here in closed form
    torch.manual_seed(0)
    with torch.no_grad():
        f = Teacher().proj(images(10, 6).flatten(1)).double()
    mean = f.mean(0)
    evals, evecs = torch.linalg.eigh((f - mean).t() @ (f - mean) / len(f))
    for status, pca in (rank0["rank_1_empty"], rank1["rank_1_empty"]):
        assert status == "ok", pca
        assert pca["samples"] == 6
        torch.testing.assert_close(pca["mean"].double(), mean, rtol=1e-5, atol=1e-5)
        k = pca["components"].shape[1]
        assert 1 <= k < 5 and evals.flip(0)[:k].sum() / evals.sum() >= 0.9
        top = evecs.flip(1)[:, :k]
        v = pca["components"].double()
        torch.testing.assert_close(v @ v.t(), top @ top.t(), rtol=0, atol=1e-4)

    # no rank saw an image: every rank raises the same error
    for status, message in (rank0["all_empty"], rank1["all_empty"]):
        assert status == "ValueError" and "no images for the PCA" in message and "on any rank" in message

    # rank 1's loader failed: its own error there, one naming it on rank 0
    assert rank1["rank_1_unreadable"] == ("OSError", "cannot identify image file 'train/3/x.jpg'")
    status, message = rank0["rank_1_unreadable"]
    assert status == "OtherRankError" and "another rank failed reading its images for the GPLQ PCA" in message


def _gplq_outcome(data, **options) -> tuple:
    from quant import PIPELINES
    from quant_models import tiny_vit

    try:
        PIPELINES["gplq"](tiny_vit(depth=1), None, "w4a4", {**dict(steps=2, batch_size_per_gpu=4, init_images=8,
                                                                   pca_images=8, qwt=False), **options}, data=data)
        return ("ok", "")
    except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
        return (type(e).__name__, str(e))


def _stage1_outcomes(rank: int) -> dict:
    from device_utils import cpu_pipeline_data
    from engine.loop import TrainBatches

    def unreadable(count, seed, train_transform):
        raise OSError("cannot identify image file 'train/3/x.jpg'")

    outcomes = {}
    data = cpu_pipeline_data(num_images=16)
    if rank == 1:  # the initialisation images cannot be read on this rank alone
        data.train_images = unreadable
    outcomes["init_images"] = _gplq_outcome(data)
    data = cpu_pipeline_data(num_images=16)
    if rank == 1:  # this rank's stage-1 loader is empty (and so is its PCA's)
        data.train_loader = lambda batch_size, seed: TrainBatches([], None)
    outcomes["empty_loader"] = _gplq_outcome(data)
    # QwT's images (drawn by rank 0, which runs stage 2) number fewer than stage2_images: refused before stage 1
    import quant.gplq.pipeline as gplq_pipeline
    from quant_models import images as images_32px
    real, stage1_runs = gplq_pipeline.run_stage1, []
    gplq_pipeline.run_stage1 = lambda *args, **kwargs: stage1_runs.append(1) or real(*args, **kwargs)
    try:
        data = cpu_pipeline_data(num_images=16)
        data.train_images = lambda count, seed, train_transform: images_32px(8)[:count]
        outcomes["stage2_images"] = (*_gplq_outcome(data, qwt=True, stage2_images=16), len(stage1_runs))
    finally:
        gplq_pipeline.run_stage1 = real
    return outcomes


def _worker(rank: int, world: int, port: int, work: str) -> None:
    """Both tests' cases in one group (a spawn each would import torch twice again: seconds): each case ends
    with every rank out of its collectives, so the next starts in step."""
    init_gloo(rank, world, port, timeout_s=300)
    outcomes = {"pca": _pca_outcomes(rank), "stage1": _stage1_outcomes(rank)}
    torch.save(outcomes, os.path.join(work, f"rank{rank}.pt"))
    stay_until_all_recorded(work, world)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list:
    """Each rank's outcomes of the PCA cases ("pca") and the GPLQ stage-1 cases ("stage1"), rank 0 first."""
    work = tmp_path_factory.mktemp("gplq_rank_failures")
    spawn_within(_worker, (2, free_port(), str(work)), 2, DEADLINE_S)
    return [torch.load(work / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_gplq_stage1_data_that_fails_on_one_rank_ends_every_rank(outcomes):
    rank0, rank1 = (outcomes[r]["stage1"] for r in (0, 1))
    assert rank1["init_images"] == ("OSError", "cannot identify image file 'train/3/x.jpg'")
    assert rank0["init_images"][0] == "OtherRankError" and "preparing GPLQ stage 1" in rank0["init_images"][1]
    assert rank1["empty_loader"] == ("ValueError", "the stage-1 training loader is empty")
    assert rank0["empty_loader"] == ("OtherRankError", "the stage-1 training loader of another rank is empty")
    # rank 0's QwT images are too few: its own error, one naming it on rank 1, and no rank started stage 1
    status, message, stage1_runs = rank0["stage2_images"]
    assert (status, stage1_runs) == ("ValueError", 0)
    assert message.startswith("stage2_images=16: PipelineData.train_images(16, ...) returned a tensor of shape "
                              "[8, 3, 32, 32], not 16 images")
    status, message, stage1_runs = rank1["stage2_images"]
    assert (status, stage1_runs) == ("OtherRankError", 0) and "its initialisation images, QwT images" in message
