"""evaluate_detection.py on 2 gloo ranks (spawned processes joining through torchrun's environment variables), on
the sample detector: each rank scores its shard and the metric counts every val image once (the numbers equal a
1-rank run); RepQ-ViT and APHQ quantize on rank 0 only and GPLQ's stage 2 too, every rank scores the very model
rank 0 made; GPLQ's stage 1 trains on both ranks in DDP and records its world size; rank 0 alone writes.
A calibration batch rank 0 cannot draw ends both ranks with one error line each.

Marked `detection` (full mmcv), like tests/test_detection.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from detection_runs import SAMPLE_CONFIG
from dist_utils import (as_torchrun_rank, free_port, run_for_outcomes, save_outcome_and_exit, spawn_ranks,
                        spawn_within)

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
    as_torchrun_rank(rank, world, port)
    from engine.distributed import OtherRankError
    import evaluate_detection

    _record(work, rank)
    try:
        outcome = ("ok", evaluate_detection.main(argv))
    except (OtherRankError, ValueError) as e:
        outcome = (type(e).__name__, str(e))
    save_outcome_and_exit(work, rank, outcome)


def _run(world: int, work, argv: list) -> list:
    return run_for_outcomes(_worker, world, work, argv)


def _lines(work, name: str, rank: int) -> list:
    path = os.path.join(work, f"{name}_rank{rank}.txt")
    return open(path).read().splitlines() if os.path.exists(path) else []


def test_two_ranks_score_each_image_once_and_quantize_on_rank_0(sample, trained, tmp_path, monkeypatch):
    config = os.path.abspath(SAMPLE_CONFIG)

    def argv(name):  # test batch 1, as the paper configs: at 2 the ranks' batches round otherwise (docs/reproduce.md)
        return ["--config", config, "--checkpoint", trained, "--data-root", sample, "--device", "cpu",
                "test_dataloader.batch_size=1", "--quant", "repq", "aphq", "gplq", "--out",
                str(tmp_path / name / "eval.json"), *TINY]

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
    assert "world_size" not in saved["quant"]["repq"]["w4a4"]["settings"]  # the same on any number of ranks at batch 1
    assert not [p.name for p in (tmp_path / "two").iterdir() if ".partial-" in p.name]


def test_training_images_gone_end_every_rank_with_one_error_line_before_any_work(sample, trained, tmp_path):
    """The command as users run it, one process per rank (no torchrun agent to stop the others), with the training
    images gone: drawing the calibration batch on rank 0 alone once failed there while rank 1 went on scoring and
    died at the metric's first collective (a gloo traceback, exit 1). The annotation check (check_annotations) now
    finds the missing images on every rank before any work: each ends with exit code 2 and one `error:` line naming
    the annotation file and the first missing image, and no result file is written."""
    import shutil
    import subprocess
    import sys

    from tests.conftest import ROOT

    root = tmp_path / "coco"
    shutil.copytree(sample, root)
    images = root / "train2017"
    missing = sorted(images.iterdir())
    for path in missing:
        path.unlink()
    argv = [sys.executable, "evaluate_detection.py", "--config", os.path.abspath(SAMPLE_CONFIG), "--checkpoint",
            trained, "--data-root", str(root), "--device", "cpu", "--quant", "repq", "--calib-images", "2",
            "--out", str(tmp_path / "eval.json"), "--main-rank-wait-hours", "0.05"]
    port = free_port()
    ranks = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_RANK": str(r)}) for r in (0, 1)]
    ended = []
    try:
        for process in ranks:
            ended.append((process.communicate(timeout=240)[1], process.returncode))
    finally:
        for process in ranks:
            process.kill()  # a rank still waiting (no-op for those that ended)
    (err0, code0), (err1, code1) = ended
    assert (code0, code1) == (2, 2), (err0[-3000:], err1[-3000:])
    assert "Traceback" not in err0 + err1
    errors = [[line for line in err.splitlines() if line.startswith("error:")] for err in (err0, err1)]
    for lines in errors:
        assert len(lines) == 1 and "train_dataloader reads" in lines[0], errors
        assert f"{len(missing)} of them not in {images}" in lines[0] and f"the first: {missing[0].name})" in lines[0]
    assert not (tmp_path / "eval.json").exists()


def _worker_failing_on_rank_1(rank: int, world: int, port: int, argv: list, work: str) -> None:
    """`_worker`, with the training split unreadable on rank 1 alone (a file one node lacks)."""
    if rank == 1:
        import engine.detection
        from engine.detection import DetectionError

        class Unreadable(engine.detection.TrainingImages):
            def __init__(self, cfg) -> None:
                raise DetectionError("the training split cannot be read on this rank")

        engine.detection.TrainingImages = Unreadable
    _worker(rank, world, port, argv, work)


def test_gplq_training_images_that_fail_on_one_rank_end_every_rank(sample, trained, tmp_path):
    """GPLQ reads the training images on every rank (its stage 1 starts from the calibration batch): one rank
    failing there ends the others with an error that says so, instead of leaving them at the next collective
    with a peer that is gone (rank 0 died with a gloo traceback)."""
    work = tmp_path / "work"
    work.mkdir()
    argv = ["--config", os.path.abspath(SAMPLE_CONFIG), "--checkpoint", trained, "--data-root", sample, "--device",
            "cpu", "--quant", "gplq", "--out", str(tmp_path / "eval.json"), "--quant-options",
            *[option for option in TINY if option.startswith("gplq.")]]
    spawn_ranks(_worker_failing_on_rank_1, (2, free_port(), argv, str(work)), 2)
    rank0, rank1 = [torch.load(work / f"outcome_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert rank1 == ("DetectionError", "the training split cannot be read on this rank")
    assert rank0 == ("OtherRankError", "rank 0: another rank failed reading the training images; its output says why")
    assert not (tmp_path / "eval.json").exists()


def _worker_scoring_fails_on_rank_1(rank: int, world: int, port: int, argv: list, work: str) -> None:
    """`_worker`, with every val image unreadable on rank 1 alone (a file one node cannot decode)."""
    if rank == 1:
        import mmdet.datasets

        def undecodable(self, index):
            raise ValueError("cannot decode val image on this rank")

        mmdet.datasets.CocoDataset.prepare_data = undecodable
    _worker(rank, world, port, argv, work)


def test_a_val_image_that_fails_on_one_rank_ends_every_rank(sample, trained, tmp_path):
    """Each rank scores its shard: one failing there ends the other with an error that says so, instead of
    leaving it in the evaluator's gathering of the predictions with a peer that is gone (a gloo traceback)."""
    work = tmp_path / "work"
    work.mkdir()
    argv = ["--config", os.path.abspath(SAMPLE_CONFIG), "--checkpoint", trained, "--data-root", sample, "--device",
            "cpu", "--quant", "--out", str(tmp_path / "eval.json")]  # a bare --quant: FP only
    spawn_ranks(_worker_scoring_fails_on_rank_1, (2, free_port(), argv, str(work)), 2)
    rank0, rank1 = [torch.load(work / f"outcome_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert rank1[0] == "ValueError" and "cannot decode val image on this rank" in rank1[1]
    assert rank0 == ("OtherRankError", "another rank could not score its share of the val images; its output says why")
    assert not (tmp_path / "eval.json").exists()


def _worker_own_argv(rank: int, world: int, port: int, argvs: list, work: str) -> None:
    """`_worker`, each rank with its own command line (paths of its own node)."""
    _worker(rank, world, port, argvs[rank], work)


@pytest.mark.parametrize("lacks, what", [
    ("data", "before the ranks met (reading its node's --config files, --checkpoint or data, or checking its "
             "settings)"),
    ("checkpoint", "loading the --checkpoint"),
    ("cut", "loading the --checkpoint")])
def test_a_file_one_node_lacks_ends_every_rank(sample, trained, tmp_path, lacks, what):
    """The config, annotation files and image folders are read before the process group forms: rank 1's node
    without the data raised there, and rank 0 waited at the rendezvous until the group's timeout. Rank 1 joins
    the group to fail, and rank 0 stops at its first collective saying so. Without the --checkpoint, or with a copy
    cut short, rank 1 failed in the detector's build while rank 0 went on to the first collective of the loader's
    sampler (MMEngine's sync_random_seed): a gloo traceback there. Both now stop with one error each."""
    work = tmp_path / "work"
    work.mkdir()
    missing = str(tmp_path / "none")
    cut = tmp_path / "cut.pth"
    cut.write_bytes(open(trained, "rb").read()[:4096])  # a copy that stopped part-way
    node1 = {"data": (missing, trained), "checkpoint": (sample, missing), "cut": (sample, str(cut))}[lacks]
    argvs = [["--config", os.path.abspath(SAMPLE_CONFIG), "--checkpoint", checkpoint, "--data-root", root,
              "--device", "cpu", "--quant", "--out", str(tmp_path / "eval.json")]
             for root, checkpoint in ((sample, trained), node1)]
    spawn_within(_worker_own_argv, (2, free_port(), argvs, str(work)), 2, seconds=120)
    rank0, rank1 = [torch.load(work / f"outcome_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert rank1[0] == "DetectionError" and (str(cut) if lacks == "cut" else missing) in rank1[1], rank1
    assert rank0 == ("OtherRankError", f"rank 0: another rank failed {what}; its output says why")
    assert not (tmp_path / "eval.json").exists()


def _worker_test_split_fails_on_rank_1(rank: int, world: int, port: int, argv: list, work: str) -> None:
    """`_worker`, with the test split failing on rank 1 alone (a file its node lacks or cannot decode): its
    annotations while the loader is built (before the sampler's collective), or its first image's pipeline."""
    failing = argv.pop()
    if rank == 1:
        from engine.detection import DetectionError

        def fails(*args, **kwargs):
            raise DetectionError(f"the test split fails in {failing} on this rank")
        if failing == "loader":
            import mmdet.datasets
            mmdet.datasets.CocoDataset.load_data_list = fails
        else:
            import engine.detection
            engine.detection.check_pipeline = fails
    _worker(rank, world, port, argv, work)


@pytest.mark.parametrize("failing", ["loader", "pipeline"])
def test_a_test_split_that_fails_on_one_rank_ends_every_rank(sample, trained, tmp_path, failing):
    """The test loader is built and its pipeline checked on each rank once the ranks have met: rank 1 failing
    there left rank 0 in the sampler's seed broadcast (a gloo traceback) or, past it, waiting in run_on_main for
    --main-rank-wait-hours. Both now stop with one error each."""
    work = tmp_path / "work"
    work.mkdir()
    argv = ["--config", os.path.abspath(SAMPLE_CONFIG), "--checkpoint", trained, "--data-root", sample, "--device",
            "cpu", "--quant", "--out", str(tmp_path / "eval.json"), "--main-rank-wait-hours", "0.01", failing]
    spawn_within(_worker_test_split_fails_on_rank_1, (2, free_port(), argv, str(work)), 2, seconds=120)
    rank0, rank1 = [torch.load(work / f"outcome_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert rank1 == ("DetectionError", f"the test split fails in {failing} on this rank"), rank1
    assert rank0 == ("OtherRankError", "rank 0: another rank failed reading its test split (test_dataloader); its "
                                       "output says why"), rank0
    assert not (tmp_path / "eval.json").exists()
