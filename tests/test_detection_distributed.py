"""evaluate_detection.py on 2 gloo ranks (spawned processes joining through torchrun's environment variables), on
the sample detector: each rank scores its shard and the metric counts every val image once (the numbers equal a
1-rank run); RepQ-ViT and APHQ quantize on rank 0 only and GPLQ's stage 2 too, every rank scores the very model
rank 0 made; GPLQ's stage 1 trains on both ranks in DDP and records its world size; rank 0 alone writes.

Marked `detection` (full mmcv), like tests/test_detection.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from detection_runs import SAMPLE_CONFIG
from dist_utils import free_port, leave_and_exit

pytestmark = [pytest.mark.detection, pytest.mark.slow]

TINY = ["--quant-options", "aphq.iters=2", "aphq.recon_images=2", "gplq.steps=2", "gplq.stage2_images=2",
        "gplq.lr=0.001"]


def _record(work: str, rank: int) -> None:
    """calls_rank<r>.txt: a line per run of the work that must happen once; scored_rank<r>.txt: a line per
    evaluation pass with the fingerprint of the weights it scored (quantizer scales included);
    stage1_rank<r>.txt: the fingerprint of the detector GPLQ's stage 1 trained."""
    import engine.detection
    import quant.gplq.detector
    from engine.checkpoint import weights_fingerprint
    from quant.aphq.pipeline import APHQPipeline
    from quant.ptq.repq import RepQPipeline

    def line(name: str, text: str) -> None:
        with open(os.path.join(work, f"{name}_rank{rank}.txt"), "a") as f:
            f.write(text + "\n")

    def wrap(owner, attribute: str, label: str) -> None:
        real = getattr(owner, attribute)

        def recorded(*args, **kwargs):
            line("calls", label)
            return real(*args, **kwargs)

        setattr(owner, attribute, recorded)

    wrap(RepQPipeline, "run", "repq")
    wrap(APHQPipeline, "run", "aphq")
    wrap(quant.gplq.detector, "_stage2", "gplq stage 2")
    real_evaluate = engine.detection.evaluate_detector

    def scored(model, *args, **kwargs):
        line("scored", weights_fingerprint(model.state_dict()))
        return real_evaluate(model, *args, **kwargs)

    engine.detection.evaluate_detector = scored
    real_train = engine.detection.train_activation_qat

    def trained(student, *args, **kwargs):
        report = real_train(student, *args, **kwargs)
        line("stage1", weights_fingerprint(student.state_dict()))
        return report

    engine.detection.train_activation_qat = trained


def _worker(rank: int, world: int, port: int, argv: list, work: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from engine.distributed import OtherRankError
    import evaluate_detection

    _record(work, rank)
    try:
        outcome = ("ok", evaluate_detection.main(argv))
    except (OtherRankError, ValueError) as e:
        outcome = (type(e).__name__, str(e))
    torch.save(outcome, os.path.join(work, f"outcome_rank{rank}.pt"))
    if outcome[0] == "ok":
        leave_and_exit()
    os._exit(0)  # the other rank may have left already: no group teardown together


def _run(world: int, work, argv: list) -> list:
    os.makedirs(work, exist_ok=True)
    mp.spawn(_worker, args=(world, free_port(), argv, str(work)), nprocs=world, join=True)
    return [torch.load(os.path.join(work, f"outcome_rank{r}.pt"), weights_only=False) for r in range(world)]


def _lines(work, name: str, rank: int) -> list:
    path = os.path.join(work, f"{name}_rank{rank}.txt")
    return open(path).read().splitlines() if os.path.exists(path) else []


def test_two_ranks_score_each_image_once_and_quantize_on_rank_0(sample, trained, tmp_path, monkeypatch):
    config = os.path.abspath(SAMPLE_CONFIG)

    def argv(name):
        return ["--config", config, "--checkpoint", trained, "--data-root", sample, "--device", "cpu",
                "--quant", "repq", "aphq", "gplq", "--out", str(tmp_path / name / "eval.json"), *TINY]

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    (single,) = _run(1, tmp_path / "single", argv("single"))
    rank0, rank1 = _run(2, tmp_path / "two", argv("two"))
    assert single[0] == rank0[0] == rank1[0] == "ok", (single, rank0, rank1)
    assert os.listdir(cwd) == []  # the ranks' predictions met through the process group, not a folder here

    assert _lines(tmp_path / "two", "calls", 0) == ["repq", "aphq", "gplq stage 2"]
    assert _lines(tmp_path / "two", "calls", 1) == []  # rank 1 received the quantized detectors ...
    scored = [_lines(tmp_path / "two", "scored", r) for r in (0, 1)]
    assert len(scored[0]) == 4 and scored[0] == scored[1]  # ... and scored the very models rank 0 made

    # repq and APHQ quantize on rank 0 exactly as one process does: the same weights, scales and zero points
    assert scored[0][1:3] == _lines(tmp_path / "single", "scored", 0)[1:3]

    saved = json.loads((tmp_path / "two" / "eval.json").read_text())
    scores = ("bbox_mAP", "segm_mAP", "bbox_mAP_50", "segm_mAP_50")
    for rank in (rank0, rank1):  # every rank returns the gathered metrics that rank 0 wrote
        assert [rank[1]["fp"][k] for k in scores] == [saved["fp"][k] for k in scores]
        for pipeline in ("repq", "aphq", "gplq"):
            assert [rank[1]["quant"][pipeline]["w4a4"][k] for k in scores] == \
                [saved["quant"][pipeline]["w4a4"][k] for k in scores]
    # 2 of the 4 val images on each rank; the gathered metric is the one-process metric
    assert saved["fp"]["images"] == single[1]["fp"]["images"] == 4
    for key in scores:
        assert saved["fp"][key] == pytest.approx(single[1]["fp"][key])
        for pipeline in ("repq", "aphq"):
            assert saved["quant"][pipeline]["w4a4"][key] == pytest.approx(single[1]["quant"][pipeline]["w4a4"][key])
    for part in ("backbone", "head"):  # the all-reduced maxima of the shards
        assert saved["max_act"][part] == pytest.approx(single[1]["max_act"][part], rel=1e-6)

    # GPLQ stage 1 trained in DDP, 2 updates on each rank's shard: the ranks' gradients were averaged, so both
    # hold the same weights (ranks training alone on their shards would differ); the folder says the world size
    stage1 = [_lines(tmp_path / "two", "stage1", r) for r in (0, 1)]
    assert len(stage1[0]) == 1 and stage1[0] == stage1[1]
    assert stage1[0] != _lines(tmp_path / "single", "stage1", 0)
    assert saved["quant"]["gplq"]["w4a4"]["stage1"]["world_size"] == 2
    assert single[1]["quant"]["gplq"]["w4a4"]["stage1"]["world_size"] == 1
    assert saved["quant"]["gplq"]["w4a4"]["stage1"]["steps"] == 2
    identity = json.loads((tmp_path / "two" / "eval_gplq_w4a4_stage1" / "gplq_stage1.json").read_text())
    assert identity["world_size"] == 2
    # ... and so does the result: a 1-process GPLQ entry is another result than a 2-rank one
    assert saved["quant"]["gplq"]["w4a4"]["settings"]["world_size"] == 2
    assert single[1]["quant"]["gplq"]["w4a4"]["settings"]["world_size"] == 1
    assert "world_size" not in saved["quant"]["repq"]["w4a4"]["settings"]  # the same on any number of ranks
    assert not [p.name for p in (tmp_path / "two").iterdir() if ".partial-" in p.name]
