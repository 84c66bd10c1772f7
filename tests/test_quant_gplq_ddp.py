"""GPLQ under DDP: 2 gloo processes on CPU run stage 1 through a DDP-wrapped student and end identical."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_utils import free_port, init_gloo


def _worker(rank: int, world: int, port: int, work: str) -> None:
    init_gloo(rank, world, port, timeout_s=120)
    try:
        import evaluate as evaluate_entry
        from models import build_model
        from quant import PIPELINES
        from quant_models import digits_config

        cfg = digits_config("vit_nano")
        torch.manual_seed(0)
        model = build_model(cfg.model).eval()
        data = evaluate_entry.build_pipeline_data(cfg, 32, rank, world, os.path.join(work, "eval"))
        qmodel, report = PIPELINES["gplq"](model, None, "w4a4",
                                           dict(steps=3, batch_size_per_gpu=8, init_images=16, pca_images=32,
                                                stage2_images=16, log_every=1), data=data)
        flat = torch.cat([t.flatten().float() for t in qmodel.state_dict().values() if isinstance(t, torch.Tensor)])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        if rank == 0:
            torch.save({"identical": all(torch.equal(gathered[0], g) for g in gathered[1:]),
                        "world": report["stage1"]["world_size"], "steps": report["stage1"]["steps"],
                        "ddp": report["stage1"]["ddp"]}, os.path.join(work, "result.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_gplq_stage1_trains_a_ddp_student_and_ranks_agree(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    result = torch.load(tmp_path / "result.pt")
    assert result["world"] == 2 and result["steps"] == 3
    assert result["ddp"]  # the student forward went through DistributedDataParallel
    assert result["identical"]
    assert (tmp_path / "eval_gplq_w4a4_stage1.pt").exists()
