"""CD and TWEO under DDP: 2 gloo processes on CPU, different data per rank, weights stay bit-identical.

CD runs on every rank from replicated weights with deterministic math and no communication; TWEO's
term goes through the normal DDP gradient all-reduce.
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from cd import TWEO, ColinearityDecay
from cd_models import tiny_vit
from dist_utils import free_port, init_gloo, leave_and_exit, spawn_ranks


def _worker(rank: int, world: int, port: int, out_path: str) -> None:
    init_gloo(rank, world, port, timeout_s=60)
    try:
        model = tiny_vit(seed=0)  # same init on every rank (DDP also broadcasts rank 0's weights)
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.045)
        decay = ColinearityDecay(ddp, lam=0.05, lam_per_role={"fc2": 0.1})
        decay.attach(opt)
        tweo = TWEO(ddp, lam=0.01)
        gen = torch.Generator().manual_seed(1000 + rank)  # different data on each rank
        for step in range(3):
            x, y = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen)
            loss = F.cross_entropy(ddp(x), y)
            (loss + tweo.aux_loss(loss, step)).backward()
            opt.step()
            opt.zero_grad()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        if rank == 0:
            torch.save({"identical": all(torch.equal(gathered[0], g) for g in gathered[1:]),
                        "updates": decay.num_updates, "first_pair": decay.pairs[0].name,
                        "energy": decay.metrics()["cd/pair_energy/fc2"]}, out_path)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_and_exit()


@pytest.mark.slow
def test_ddp_two_ranks_stay_bit_identical_with_cd_and_tweo(tmp_path):
    out = str(tmp_path / "result.pt")
    spawn_ranks(_worker, (2, free_port(), out), 2)
    result = torch.load(out)
    assert result["identical"]
    assert result["updates"] == 3
    assert result["first_pair"] == "blocks.0.attn.qkv.weight"  # unwrapped names, no 'module.' prefix
