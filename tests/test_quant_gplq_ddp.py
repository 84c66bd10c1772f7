"""GPLQ under DDP: 2 gloo processes train stage 1 on their own shards and agree before any broadcast."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port, init_gloo, spawn_ranks


def _stage1_case(rank: int, world: int, work: str) -> None:
    """GPLQ with stage 1 on both ranks; rank 0 saves what the ranks held after it in `work`/result.pt."""
    try:
        import evaluate as evaluate_entry
        from models import build_model
        import quant.gplq.pipeline as gplq_module
        from quant import PIPELINES
        from quant_models import digits_config

        # Compare the ranks right after stage 1 (stage 2 runs on rank 0 and every rank receives its
        # model, so they agree by construction after it): every rank trains on its own shard, so only
        # averaged gradients make them agree.
        after_stage1 = {}
        real_stage1 = gplq_module.run_stage1

        def recording_stage1(model, *args, **kwargs):
            result = real_stage1(model, *args, **kwargs)
            after_stage1["flat"] = _flat_state(model)
            return result

        gplq_module.run_stage1 = recording_stage1

        cfg = digits_config("vit_nano")
        torch.manual_seed(0)
        model = build_model(cfg.model).eval()
        data = evaluate_entry.build_pipeline_data(cfg, 32, rank, world, os.path.join(work, "eval"))
        qmodel, report = PIPELINES["gplq"](model, None, "w4a4",
                                           dict(steps=3, batch_size_per_gpu=8, init_images=16, pca_images=32,
                                                stage2_images=16, log_every=1), data=data)
        flat = after_stage1["flat"]
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        # each rank's stage-1 shard: the ranks' data differ
        shard = next(iter(data.train_loader(4, 0).loader))[0]
        shards = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(shards, shard)
        if rank == 0:
            torch.save({"identical": all(torch.equal(gathered[0], g) for g in gathered[1:]),
                        "same_data": all(torch.equal(shards[0], x) for x in shards[1:]),
                        "world": report["stage1"]["world_size"], "steps": report["stage1"]["steps"],
                        "ddp": report["stage1"]["ddp"]}, os.path.join(work, "result.pt"))
        gplq_module.run_stage1 = real_stage1
    except BaseException:
        dist.destroy_process_group()
        raise


def _flat_state(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().flatten().float() for t in model.state_dict().values()
                      if isinstance(t, torch.Tensor)])


def _resume_case(rank: int, world: int, work: str) -> None:
    """Rank 0's folder holds a stage-1 file (unreadable here, so that the run stops right at resume), rank
    1's folder is another (as on nodes that do not share it) and has none."""
    import time

    import evaluate as evaluate_entry
    from engine.checkpoint import CheckpointError
    from models import build_model
    from quant import PIPELINES
    from quant_models import digits_config

    folder = os.path.join(work, f"rank{rank}")
    os.makedirs(folder)
    if rank == 0:
        with open(os.path.join(folder, "eval_gplq_w4a4_stage1.pt"), "wb") as f:
            f.write(b"not a checkpoint")
    cfg = digits_config("vit_nano")
    torch.manual_seed(0)
    data = evaluate_entry.build_pipeline_data(cfg, 32, rank, world, os.path.join(folder, "eval"))
    start = time.monotonic()
    try:
        PIPELINES["gplq"](build_model(cfg.model).eval(), None, "w4a4",
                          dict(steps=3, batch_size_per_gpu=8, init_images=16, pca_images=32, stage2_images=16),
                          data=data)
        outcome = ("returned", "")
    except (CheckpointError, RuntimeError) as e:
        outcome = (type(e).__name__, str(e))
    torch.save({"outcome": outcome, "seconds": time.monotonic() - start}, os.path.join(work, f"rank{rank}.pt"))


def _copies_case(rank: int, world: int, work: str) -> None:
    """The stage-1 checkpoint of the stage1 case at each rank's own path (nodes that do not share --out): "alone",
    on rank 0's node only; "stale", on both, rank 1's of another update. Each rank's outcome in <case>_rank<r>.pt."""
    import shutil

    import evaluate as evaluate_entry
    from engine.checkpoint import CheckpointError
    from models import build_model
    from quant import PIPELINES
    from quant_models import digits_config

    written = os.path.join(os.path.dirname(work), "stage1", "eval_gplq_w4a4_stage1.pt")
    for case in ("alone", "stale"):
        folder = os.path.join(work, case, f"rank{rank}")
        os.makedirs(folder)
        mine = os.path.join(folder, "eval_gplq_w4a4_stage1.pt")
        if rank == 0:
            shutil.copyfile(written, mine)
        elif case == "stale":
            payload = torch.load(written, weights_only=False)
            payload["state"]["step"] -= 1
            torch.save(payload, mine)
        cfg = digits_config("vit_nano")
        torch.manual_seed(0)
        data = evaluate_entry.build_pipeline_data(cfg, 32, rank, world, os.path.join(folder, "eval"))
        try:
            PIPELINES["gplq"](build_model(cfg.model).eval(), None, "w4a4",
                              dict(steps=3, batch_size_per_gpu=8, init_images=16, pca_images=32, stage2_images=16,
                                   log_every=1), data=data)
            outcome = ("returned", "")
        except (CheckpointError, RuntimeError) as e:
            outcome = (type(e).__name__, str(e))
        torch.save(outcome, os.path.join(work, f"{case}_rank{rank}.pt"))


def _worker(rank: int, world: int, port: int, work: str) -> None:
    """Both cases in one group (a spawn each imports torch twice again: seconds); the resume case ends the
    ranks apart, so it runs last and no group teardown follows it."""
    init_gloo(rank, world, port, timeout_s=120)
    _stage1_case(rank, world, os.path.join(work, "stage1"))
    _copies_case(rank, world, os.path.join(work, "copies"))
    _resume_case(rank, world, os.path.join(work, "resume"))
    os._exit(0)  # the ranks stopped apart: no group teardown together


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The folder of both cases: stage1/ (the DDP run) and resume/ (the resume decision)."""
    work = tmp_path_factory.mktemp("gplq_ddp")
    for case in ("stage1", "copies", "resume"):
        os.makedirs(work / case)
    spawn_ranks(_worker, (2, free_port(), str(work)), 2)
    return work


@pytest.mark.slow
def test_gplq_stage1_trains_a_ddp_student_and_ranks_agree(work):
    result = torch.load(work / "stage1" / "result.pt")
    assert result["world"] == 2 and result["steps"] == 3
    assert result["ddp"]  # the student forward went through DistributedDataParallel
    assert not result["same_data"]
    assert result["identical"]
    assert (work / "stage1" / "eval_gplq_w4a4_stage1.pt").exists()


def test_rank_0_decides_whether_stage1_resumes(work):
    """Ranks that each looked for the file would split: rank 0 resuming, rank 1 fitting the PCA (an
    all-reduce nobody joins) until the group timeout. Rank 0 decides; rank 1 fails on its own path."""
    resume = work / "resume"
    rank0, rank1 = (torch.load(resume / f"rank{r}.pt") for r in (0, 1))
    assert rank0["outcome"][0] == "CheckpointError" and "eval_gplq_w4a4_stage1.pt" in rank0["outcome"][1]
    assert rank1["outcome"][0] == "CheckpointError", rank1
    # its own CheckpointError, not the group's timeout error: it did not wait for the 120 s timeout (no
    # wall-clock bound, which a busy machine could break)
    assert str(resume / "rank1" / "eval_gplq_w4a4_stage1.pt") in rank1["outcome"][1]


def test_ranks_that_read_other_stage1_checkpoints_stop_together(work):
    """An --out on each node's own disk after a stop in stage 1: rank 0's node holds the checkpoint, rank 1's none
    (it failed alone while rank 0 went on into stage 1's collectives), or a copy of another update (the loops
    would run other lengths)."""
    copies = work / "copies"
    alone = [torch.load(copies / f"alone_rank{r}.pt") for r in (0, 1)]
    assert alone[0] == ("OtherRankError", "rank 0: another rank failed reading the GPLQ stage-1 checkpoint; its "
                                          "output says why"), alone
    assert alone[1] == ("CheckpointError", f"the GPLQ stage-1 checkpoint {copies / 'alone' / 'rank1'}/"
                                           f"eval_gplq_w4a4_stage1.pt that rank 0 resumes from is not on this rank's "
                                           f"node: give --out a folder every node sees (a shared file system)"), alone
    for rank in (0, 1):
        kind, message = torch.load(copies / f"stale_rank{rank}.pt")
        assert kind == "CheckpointError" and message.startswith(
            f"the ranks read other GPLQ stage-1 checkpoints at {copies / 'stale' / f'rank{rank}'}"), message
        assert f"update {3 - rank}, weights " in message and "give --out a folder every node sees" in message
