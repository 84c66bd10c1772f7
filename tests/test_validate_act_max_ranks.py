"""train.validate(act_max=True) under DDP: the activation maxima are the largest over every rank's validation shard
(a MAX all-reduce) and the kurtosis is that of all ranks' outputs together (the moment sums SUM-reduced), so each
rank holds what one process measures over the union of the shards.

References: the maxima of one process probing both shards; the kurtosis as float64 central moments of the module
and block outputs, computed by running the ViT's blocks by hand on each shard and concatenating them."""
import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import free_port, init_gloo, leave_and_exit, spawn_ranks
from engine.act_max import ActivationProbe
from quant_models import images, tiny_vit


def shard(rank: int) -> torch.Tensor:
    """Rank `rank`'s validation images: other images, scale and offset on each rank, so that neither rank's outputs
    have the union's maxima or kurtosis."""
    return images(4, seed=rank + 1) * (1 + 2 * rank) + rank


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank: validate the same tiny ViT on its own shard, with the activation maxima, and save the metrics."""
    import train
    from engine.tasks import ClassificationTask

    init_gloo(rank, world, port, timeout_s=60)
    try:
        x = shard(rank)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(len(x), dtype=torch.long)),
                                             batch_size=len(x))
        metrics = train.validate(ClassificationTask(), tiny_vit(), None, loader, torch.device("cpu"), "none",
                                 act_max=True)
        torch.save(metrics, os.path.join(out, f"rank{rank}.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_and_exit()


def vit_outputs(model, x: torch.Tensor) -> tuple:
    """(module outputs, block outputs) of the ViT's blocks on `x`, run by hand (eval: dropouts, layer scales and
    drop paths are identities; attention's output is its proj's)."""
    modules, blocks = [], []
    h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    for blk in model.blocks:
        n1 = blk.norm1(h)
        attn = blk.attn(n1)
        h = h + attn
        n2 = blk.norm2(h)
        fc1 = blk.mlp.fc1(n2)
        act = blk.mlp.act(fc1)
        fc2 = blk.mlp.fc2(act)
        h = h + fc2
        modules += [n1, blk.attn.qkv(n1), attn, n2, fc1, act, fc2]
        blocks.append(h)
    return modules, blocks


def kurtosis(t: torch.Tensor) -> float:
    """Pearson kurtosis of all of `t`'s elements, from float64 central moments."""
    centred = t.double().flatten() - t.double().mean()
    return ((centred ** 4).mean() / (centred ** 2).mean() ** 2).item()


def test_validate_reduces_the_activation_maxima_and_kurtosis_over_the_ranks(tmp_path):
    """Each rank's act/max_* is the max over both shards (a SUM all-reduce of the maxima passed every test) and its
    act/kurtosis_* is that of both shards' outputs (rank 0's own moments, unreduced, passed too)."""
    spawn_ranks(_rank, (2, free_port(), str(tmp_path)), 2)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    act = [{k: v for k, v in g.items() if k.startswith("act/")} for g in got]
    assert set(act[0]) == {"act/max_module", "act/max_block", "act/kurtosis_module", "act/kurtosis_block"}
    assert act[0] == act[1]
    model = tiny_vit()
    with torch.no_grad(), ActivationProbe(model) as probe:
        for rank in range(2):
            model(shard(rank))
        per_shard = [vit_outputs(model, shard(rank)) for rank in range(2)]
    want = probe.result()
    assert act[0]["act/max_module"] == pytest.approx(want.module, rel=1e-5)
    assert act[0]["act/max_block"] == pytest.approx(want.block, rel=1e-5)
    for kind, index in (("module", 0), ("block", 1)):
        union = [torch.cat(pair) for pair in zip(per_shard[0][index], per_shard[1][index])]
        assert act[0][f"act/kurtosis_{kind}"] == pytest.approx(max(kurtosis(t) for t in union), rel=1e-5), kind
