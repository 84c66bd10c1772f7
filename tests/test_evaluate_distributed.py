"""evaluate.py on 2 gloo ranks (spawned processes joining through torchrun's environment variables):
each pipeline's quantization runs once, on rank 0 (GPLQ: stage 2; its stage 1 is data parallel), every
rank scores the same model, the numbers equal a 1-rank run, and a failed write on rank 0 stops both ranks
with their errors instead of leaving rank 1 at a collective."""
from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from dist_utils import as_torchrun_rank, free_port, run_for_outcomes, save_outcome_and_exit, spawn_ranks

TINY_APHQ = ["quant.aphq.iters=2", "quant.aphq.recon_images=32", "quant.aphq.calib_images=16",
             "quant.aphq.batch_size=16", "quant.aphq.matmul_steps=9", "quant.aphq.search_rounds=1",
             "quant.aphq.eq_n=32"]
TINY_GPLQ = ["quant.gplq.steps=2", "quant.gplq.batch_size_per_gpu=8", "quant.gplq.init_images=16",
             "quant.gplq.pca_images=32", "quant.gplq.stage2_images=16"]


def _record_calls(work: str, rank: int, patch=setattr) -> None:
    """Wrap the parts that must run once with a line per call in calls_rank<r>.txt (`patch(owner, name,
    value)` sets each wrapper)."""
    from quant.aphq.pipeline import APHQPipeline
    from quant.gplq.pipeline import GPLQPipeline
    from quant.ptq.repq import RepQPipeline

    def wrap(owner, attribute: str, label: str) -> None:
        real = getattr(owner, attribute)

        def recorded(*args, **kwargs):
            with open(os.path.join(work, f"calls_rank{rank}.txt"), "a") as f:
                f.write(label + "\n")
            return real(*args, **kwargs)

        patch(owner, attribute, recorded)

    wrap(RepQPipeline, "run", "repq")
    wrap(APHQPipeline, "run", "aphq")
    wrap(GPLQPipeline, "_stage2", "gplq stage 2")


def _record_scored_models(work: str, rank: int) -> None:
    """A line per evaluation pass in scored_rank<r>.txt: what it scored and the weights' fingerprint (the
    quantized models' scales and zero points included), to compare the models the ranks scored."""
    import engine.tasks
    from engine.checkpoint import weights_fingerprint

    real = engine.tasks.evaluate_classifier  # what evaluate.py's classification task scores with

    def recorded(model, *args, progress: str = "", **kwargs):
        with open(os.path.join(work, f"scored_rank{rank}.txt"), "a") as f:
            f.write(f"{progress} {weights_fingerprint(model.state_dict())}\n")
        return real(model, *args, progress=progress, **kwargs)

    engine.tasks.evaluate_classifier = recorded


def _worker(rank: int, world: int, port: int, argv: list, work: str) -> None:
    as_torchrun_rank(rank, world, port)
    import evaluate

    _record_calls(work, rank)
    _record_scored_models(work, rank)
    try:
        outcome = ("ok", evaluate.main(evaluate.parse_args(argv)))
    except (evaluate.OtherRankError, *evaluate.USER_ERRORS) as e:
        outcome = (type(e).__name__, str(e))
    save_outcome_and_exit(work, rank, outcome)


def _run(world: int, work, argv: list) -> list:
    return run_for_outcomes(_worker, world, work, argv)


def _calls(work, rank: int) -> list:
    path = os.path.join(work, f"calls_rank{rank}.txt")
    return open(path).read().splitlines() if os.path.exists(path) else []


def _failing_cases_worker(rank: int, world: int, ports: list, cases: list) -> None:
    """The cases that end in an error, one after another in one pair of processes (a spawn each imports torch
    twice again: seconds), each in a group of its own on its own port; each rank saves a case's outcome in
    its folder. A case is (argv, folder, the JSON writes fail, the calibration batch fails on rank 1 alone);
    what a case patches is undone before the next."""
    import contextlib
    from unittest import mock

    torch.set_num_threads(1)
    import engine.eval_results
    import evaluate
    from data import DataError

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    def unreadable(cfg, img_size):  # a file one node lacks
        raise DataError("train/3/x.jpg cannot be read on this rank")

    for port, (argv, work, disk_full, calibration_fails) in zip(ports, cases):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
        with contextlib.ExitStack() as undo:
            def patch(owner, name, value):
                undo.enter_context(mock.patch.object(owner, name, value))

            _record_calls(work, rank, patch)
            if disk_full:
                patch(engine.eval_results.json, "dump", no_space)
            if calibration_fails and rank == 1:
                patch(evaluate, "calibration_set", unreadable)
            try:
                outcome = ("ok", evaluate.main(evaluate.parse_args(argv)))
            except (evaluate.OtherRankError, *evaluate.USER_ERRORS) as e:
                outcome = (type(e).__name__, str(e))
        torch.save(outcome, os.path.join(work, f"outcome_rank{rank}.pt"))
    os._exit(0)  # the other rank may have left already: no group teardown together


@pytest.fixture(scope="module")
def failing(checkpoint, tmp_path_factory) -> dict:
    """{case: (its folder, the path of its JSON, [rank 0's outcome, rank 1's])} of the 2-rank cases that end
    in an error: "write" (every JSON write fails), "read" (the JSON holds another evaluation), "calibration"
    (the calibration batch fails on rank 1)."""
    root = tmp_path_factory.mktemp("failing")
    folders = {case: root / case for case in ("write", "read", "calibration")}
    for folder in folders.values():
        folder.mkdir()
    outs = {case: folder / "eval.json" for case, folder in folders.items()}
    outs["read"].write_text(json.dumps({"model": "another model", "quant": {}}))
    repq = {case: ["--checkpoint", checkpoint, "--quant", "repq", "--out", str(out)] for case, out in outs.items()}
    cases = [(repq["write"] + ["quant.act_max_csv=false"], str(folders["write"]), True, False),
             (repq["read"], str(folders["read"]), False, False),
             (repq["calibration"] + ["quant.act_max_csv=false"], str(folders["calibration"]), False, True)]
    spawn_ranks(_failing_cases_worker, (2, [free_port() for _ in cases], cases), 2)
    return {case: (folder, outs[case], [torch.load(folder / f"outcome_rank{r}.pt", weights_only=False)
                                        for r in (0, 1)])
            for case, folder in folders.items()}


@pytest.mark.slow
def test_each_pipeline_quantizes_once_and_every_rank_scores_its_model(checkpoint, tmp_path, one_thread):
    import evaluate

    def argv(name):
        return ["--checkpoint", checkpoint, "--quant", "repq", "aphq", "gplq",
                "--out", str(tmp_path / name / "eval.json"), *TINY_APHQ, *TINY_GPLQ]

    os.makedirs(tmp_path / "single")
    single = evaluate.main(evaluate.parse_args(argv("single")))  # the 1-rank run here: a spawn imports torch again
    rank0, rank1 = _run(2, tmp_path / "two", argv("two"))
    assert rank0[0] == rank1[0] == "ok", (rank0, rank1)

    assert _calls(tmp_path / "two", 0) == ["repq", "aphq", "gplq stage 2"]
    assert _calls(tmp_path / "two", 1) == []  # rank 1 received the models
    # ... and scored the very models rank 0 made (the top-1 below is all-reduced: equal in any case)
    scored = [open(tmp_path / "two" / f"scored_rank{r}.txt").read().splitlines() for r in (0, 1)]
    assert [line.split()[0] for line in scored[0]] == ["FP", "activation", "repq", "aphq", "gplq"]
    assert scored[0] == scored[1]
    # the sharded evaluation of the one model: both ranks hold the same numbers, which the JSON has
    saved = json.load(open(tmp_path / "two" / "eval.json"))
    for pipeline in ("repq", "aphq", "gplq"):
        top1 = saved["quant"][pipeline]["w4a4"]["top1"]
        assert rank0[1]["quant"][pipeline]["w4a4"]["top1"] == rank1[1]["quant"][pipeline]["w4a4"]["top1"] == top1
    assert rank1[1]["quant"]["aphq"]["w4a4"]["report"] == saved["quant"]["aphq"]["w4a4"]["report"]
    # GPLQ's result depends on the ranks its stage 1 trained on; the others' do not
    assert saved["quant"]["gplq"]["w4a4"]["settings"]["world_size"] == 2
    assert single["quant"]["gplq"]["w4a4"]["settings"]["world_size"] == 1
    assert "world_size" not in saved["quant"]["aphq"]["w4a4"]["settings"]
    # repq and APHQ quantize on rank 0 exactly as one process does (GPLQ's stage 1 trains on 2 shards)
    for pipeline in ("repq", "aphq"):
        expected = single["quant"][pipeline]["w4a4"]["top1"]
        assert saved["quant"][pipeline]["w4a4"]["top1"] == pytest.approx(expected)
    assert saved["fp"]["top1"] == pytest.approx(single["fp"]["top1"])  # each image counted exactly once
    assert saved["max_act"]["block"] == pytest.approx(single["max_act"]["block"], rel=1e-5)
    assert os.path.exists(saved["max_act"]["csv"]) and rank1[1]["max_act"]["csv"] == saved["max_act"]["csv"]


@pytest.mark.slow
def test_a_failed_write_on_rank_0_stops_every_rank_with_its_error(failing):
    tmp_path, out, (rank0, rank1) = failing["write"]
    assert rank0[0] == "ResultsError" and f"could not write {out}: [Errno 28] No space left" in rank0[1]
    assert "no file was written" in rank0[1]
    assert rank1[0] == "OtherRankError"
    assert rank1[1].startswith(f"rank 0 failed writing {out}: ResultsError: could not write {out}")
    assert not [name for name in os.listdir(tmp_path) if ".partial-" in name]  # its temporary file went
    assert _calls(tmp_path, 0) == [] and not out.exists()  # it stopped at the first write, before repq


@pytest.mark.slow  # two evaluate.py ranks
def test_the_result_file_is_read_on_rank_0_only(failing):
    """Its plan is rank 0's: a file rank 0 refuses stops rank 1 with rank 0's reason (a rank that read the
    file itself could plan other work and wait at another collective)."""
    _, out, (rank0, rank1) = failing["read"]
    assert rank0[0] == "ResultsError" and "holds results of another evaluation" in rank0[1]
    assert rank1 == ("OtherRankError", f"rank 0 failed reading {out}: ResultsError: {rank0[1]}")
    assert json.loads(out.read_text()) == {"model": "another model", "quant": {}}


@pytest.mark.slow
def test_torchrun_prints_one_error_line_per_rank_when_rank_0_cannot_write(checkpoint, tmp_path):
    """The command as users run it: a folder where the JSON's lock file goes makes rank 0's first write
    fail (whoever runs the test, root included); the job ends at once with rank 0's `error:` line."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "eval.json"
    os.makedirs(f"{out}.lock")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          "--master_port", str(free_port()), "evaluate.py", "--checkpoint", checkpoint,
                          "--quant", "repq", "--out", str(out), "quant.main_rank_wait_hours=1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert any(line.startswith(f"error: could not write {out}: [Errno 21] Is a directory") for line in errors), \
        run.stderr[-3000:]
    # rank 1 prints its line unless torchrun's agent, seeing rank 0 fail, terminated it first (a race
    # the spawned test above does not have); either way it did not wait out the 1-hour limit
    # (rank 1 names the step: the result file and, where they are written with it, the maxima CSV and plot)
    stem = os.path.splitext(out)[0]
    assert all(line.startswith(f"error: could not write {out}") or
               line.startswith((f"error: rank 0 failed writing {out}: ResultsError: could not write",
                                f"error: rank 0 failed writing {out}, {stem}_act_max.csv / .png: ResultsError: "
                                f"could not write"))
               for line in errors), errors
    assert os.path.isdir(f"{out}.lock") and not out.exists()  # nothing of the user's removed


@pytest.mark.slow
def test_a_calibration_batch_that_fails_on_one_rank_ends_every_rank(failing):
    """Every rank draws the calibration batch itself: one failing there ends the other with an error that says
    so, instead of leaving it at the FP pass's all-reduce with a peer that is gone (a gloo traceback)."""
    _, _, (rank0, rank1) = failing["calibration"]
    assert rank1 == ("DataError", "train/3/x.jpg cannot be read on this rank")
    assert rank0 == ("OtherRankError", "rank 0: another rank could not read the training split (its calibration "
                                       "batch or images); its output says why")


def _per_rank_worker(rank: int, world: int, port: int, argvs: list, work: str) -> None:
    """_worker with each rank's own command line (`argvs[rank]`: a node's own paths)."""
    _worker(rank, world, port, argvs[rank], work)


@pytest.mark.slow  # two evaluate.py ranks
def test_each_node_may_give_its_own_checkpoint_and_result_paths(checkpoint, tmp_path):
    """--checkpoint and --out are paths on each node (not compared between ranks; the weights are): rank 1 given its
    node's copy of the weights, and no --out (its default: beside that copy, eval_copy.json), evaluates with rank 0,
    which alone writes its own --out. The ranks labelled the work they wait for with their own result path, so rank 1
    stopped at the first wait ('the ranks disagree on the work') and rank 0 in gloo's 'Connection closed by peer'
    traceback."""
    import shutil

    node = tmp_path / "node1"
    node.mkdir()
    shutil.copy(checkpoint, node / "copy.pt")
    out = tmp_path / "node0" / "eval.json"
    argvs = [["--checkpoint", checkpoint, "--quant", "repq", "--out", str(out)],
             ["--checkpoint", str(node / "copy.pt"), "--quant", "repq"]]
    rank0, rank1 = run_for_outcomes(_per_rank_worker, 2, tmp_path / "work", argvs)
    assert rank0[0] == rank1[0] == "ok", (rank0, rank1)
    saved = json.loads(out.read_text())
    assert saved["checkpoint"] == os.path.abspath(checkpoint)  # rank 0's own path
    assert rank1[1]["quant"]["repq"]["w4a4"]["top1"] == saved["quant"]["repq"]["w4a4"]["top1"]
    assert sorted(os.listdir(node)) == ["copy.pt"]  # nothing written at rank 1's own result path


@pytest.mark.slow  # two evaluate.py ranks
def test_gplq_refuses_a_node_whose_training_images_differ(checkpoint, tmp_path):
    """GPLQ's stage 1 trains on every rank's shard of its own node's training split (data.root is a node's path):
    a node's copy of other images (here: as many, under other names) was trained on under rank 0's name, and one of
    another size ended in gloo's abort (the ranks' loaders of other lengths). Both ranks refuse it before the FP
    pass, naming the split, and the file is not written; a copy of the same images at another path is taken."""
    import shutil

    from tests.conftest import make_folder

    digits = {str(c): 2 for c in range(10)}  # the classes the checkpoint was trained on (digits)
    make_folder(tmp_path / "node0", {"train": {str(c): 4 for c in range(10)}, "val": digits})
    make_folder(tmp_path / "node1", {"train": {str(c): 4 for c in range(10)}, "val": digits})
    for c in range(10):  # the same images on node 1, one under another name
        os.replace(tmp_path / "node1" / "train" / str(c) / "3.png", tmp_path / "node1" / "train" / str(c) / "x.png")
    gplq = ["--quant", "gplq", "quant.gplq.steps=1", "quant.gplq.batch_size_per_gpu=4", "quant.gplq.init_images=8",
            "quant.gplq.pca_images=8", "quant.gplq.stage2_images=8", "quant.gplq.pca_multiple=8",
            "data.dataset=folder"]
    out = tmp_path / "eval.json"
    argvs = [["--checkpoint", checkpoint, "--out", str(out), *gplq, f"data.root={tmp_path / f'node{r}'}"]
             for r in (0, 1)]
    rank0, rank1 = run_for_outcomes(_per_rank_worker, 2, tmp_path / "work", argvs)
    for rank, outcome in enumerate((rank0, rank1)):
        assert outcome[0] == "DataError", outcome
        assert outcome[1].startswith(f"the processes read other data under data.root={tmp_path / f'node{rank}'}: "
                                     "train differs between ranks"), outcome
    assert not out.exists()
    assert _calls(tmp_path / "work", 0) == []  # no stage 2 (nor stage 1) ran

    shutil.copytree(tmp_path / "node0", tmp_path / "copy")  # node 1's own copy of node 0's images
    argvs[1][-1] = f"data.root={tmp_path / 'copy'}"
    rank0, rank1 = run_for_outcomes(_per_rank_worker, 2, tmp_path / "work_copy", argvs)
    assert rank0[0] == rank1[0] == "ok", (rank0, rank1)
    assert json.loads(out.read_text())["quant"]["gplq"]["w4a4"]["settings"]["world_size"] == 2
