"""scripts/train_detection.py --resume on 2 gloo ranks (spawned processes joining through torchrun's environment
variables), on the sample detector with CD: a run stopped after its first epoch's checkpoint and re-run with the
same command resumes on every rank from that checkpoint (the same epoch and iteration, the same weights on both
ranks, the images an uninterrupted run reads next, the optimizer and CD state of the checkpoint); a resume that
one rank cannot make ends every rank with one error instead of a wait or a fresh start on that rank.

MMEngine initialises a distributed run on GPUs only (train_detection.check_launcher refuses it on the CPU): the
workers join a gloo group first, so MMEngine's Runner takes that group, and wrap the detector in DDP without
device ids (a CPU module). Marked `detection` (full mmcv), like tests/test_detection_distributed.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from detection_runs import SAMPLE_CONFIG
from dist_utils import free_port, init_gloo, spawn_within, stay_until_all_recorded

pytestmark = [pytest.mark.detection, pytest.mark.slow]

METHOD = "configs/detection/method/cd.py"


def _cpu_ddp(rank: int, world: int, port: int, work: str) -> None:
    """Join the gloo group and let train_detection run on it (see the module docstring)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    init_gloo(rank, world, port)
    import engine.detection
    import train_detection
    from engine.checkpoint import weights_fingerprint

    train_detection.check_launcher = lambda launcher: None
    engine.detection.load_config = _with_ddp_wrapper(engine.detection.load_config)

    def state(runner) -> dict:
        """What this rank trains from or has trained: its iteration, epoch, weights, optimizer and CD state."""
        model = runner.model.module if hasattr(runner.model, "module") else runner.model
        hook = next(h for h in runner.hooks if type(h).__name__ == "ColinearityDecayHook")
        optimizer = runner.optim_wrapper.optimizer.state_dict()["state"]
        return {"iter": runner.iter, "epoch": runner.epoch, "weights": weights_fingerprint(model.state_dict()),
                "optimizer": weights_fingerprint({f"{k}.{name}": v for k, s in optimizer.items()
                                                  for name, v in s.items()}),
                "cd": hook.decay.state_dict()["num_updates"]}

    class Recording(engine.detection.RngStateHook):
        """RngStateHook that also records what this rank trains: start_rank<r>.pt when training starts (after
        every other hook's before_train: the CD hook's restore), the images of each iteration, and
        trained_rank<r>.pt at the end."""

        def before_train(self, runner):
            super().before_train(runner)
            torch.save(state(runner), os.path.join(work, f"start_rank{rank}.pt"))

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            ids = [s.img_id for s in data_batch["data_samples"]]
            with open(os.path.join(work, f"images_rank{rank}.txt"), "a") as f:
                f.write(f"{runner.iter} {ids}\n")

        def after_train(self, runner):
            torch.save(state(runner), os.path.join(work, f"trained_rank{rank}.pt"))
    engine.detection.RngStateHook = Recording


def _worker(rank: int, world: int, port: int, argv: list, work: str, cwds=None) -> None:
    """Run train_detection.main on this rank (in cwds[rank], where given: a --work-dir relative to it is then a
    folder of this rank's node alone) and record its outcome in `work`/rank<r>.pt."""
    _cpu_ddp(rank, world, port, work)
    if cwds:
        os.chdir(cwds[rank])
    import train_detection
    from engine.distributed import OtherRankError
    try:
        outcome = ("ok", train_detection.main(argv))
    except (OtherRankError, ValueError) as e:
        outcome = (type(e).__name__, str(e))
    torch.save(outcome, os.path.join(work, f"rank{rank}.pt"))
    stay_until_all_recorded(work, world)


def _run(work, argv: list, seconds: float = 240, cwds=None) -> list:
    os.makedirs(work, exist_ok=True)
    for name in os.listdir(work):
        if name.startswith("rank") and name.endswith(".pt"):
            os.remove(os.path.join(work, name))
    spawn_within(_worker, (2, free_port(), argv, str(work), cwds), nprocs=2, seconds=seconds)
    return [torch.load(os.path.join(work, f"rank{r}.pt"), weights_only=False) for r in range(2)]


def _argv(sample, work_dir, epochs: int, *extra) -> list:
    return ["--config", os.path.abspath(SAMPLE_CONFIG), "--config", os.path.abspath(METHOD), "--data-root", sample,
            "--work-dir", str(work_dir), "--launcher", "pytorch", f"train_cfg.max_epochs={epochs}",
            "randomness.seed=0", "train_cfg.val_interval=100", *extra]


def test_a_checkpoint_only_rank_0_sees_ends_both_ranks_with_one_error(sample, tmp_path):
    """A work dir on each node's own disk: rank 1's has no checkpoint. Rank 1 refused the resume while rank 0
    went on into MMEngine's Runner and waited there for it (until the group's timeout; under torchrun its agent
    then ended rank 0 without a word why); now both ranks end at once, each with one error naming the cause."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    # the first epoch in node0 (MMEngine's evaluator gathers the ranks' results through a folder in the working
    # directory, so the run itself needs a shared one); a relative --work-dir is then node<r>/run on rank r
    assert _run(tmp_path / "first", _argv(sample, "run", 1), cwds=[str(nodes[0])] * 2) == [("ok", 0)] * 2
    assert (nodes[0] / "run" / "epoch_1.pth").is_file()
    rank0, rank1 = _run(tmp_path / "again", _argv(sample, "run", 2, "--resume"), seconds=100,
                        cwds=[str(n) for n in nodes])
    assert rank1 == ("DetectionError", "--resume: --work-dir run has no last_checkpoint to continue from"), rank1
    assert rank0[0] == "DetectionError" and rank0[1].startswith("rank 1 cannot start: --resume: --work-dir run has "
                                                               "no last_checkpoint"), rank0
    assert not (nodes[1] / "run").exists()  # the refused rank made no folder

    # rank 1's node holds a copy of the run whose epoch_1.pth is another file (a stale copy, of another run): rank 1
    # resumed from it, rank 0 from its own, without a word
    import shutil
    shutil.copytree(nodes[0] / "run", nodes[1] / "run")
    stale = torch.load(nodes[1] / "run" / "epoch_1.pth", weights_only=False)
    del stale["optimizer"]
    torch.save(stale, nodes[1] / "run" / "epoch_1.pth")
    (nodes[1] / "run" / "last_checkpoint").write_text(str(nodes[1] / "run" / "epoch_1.pth"))  # MMEngine's: absolute
    sizes = [os.path.getsize(node / "run" / "epoch_1.pth") for node in nodes]
    outcomes = _run(tmp_path / "stale", _argv(sample, "run", 2, "--resume"), seconds=100,
                    cwds=[str(n) for n in nodes])
    assert outcomes[0] == outcomes[1] == (
        "DetectionError", f"--resume: the ranks would continue from different checkpoints: rank 0 epoch_1.pth "
        f"({sizes[0]} bytes), rank 1 epoch_1.pth ({sizes[1]} bytes); give every rank the same --work-dir (a folder "
        "all nodes share)"), outcomes


def _saved(path) -> dict:
    """What an MMEngine checkpoint holds, in the terms of `state`."""
    from engine.checkpoint import weights_fingerprint
    saved = torch.load(path, map_location="cpu", weights_only=False)
    return {"iter": saved["meta"]["iter"], "epoch": saved["meta"]["epoch"],
            "weights": weights_fingerprint(saved["state_dict"]),
            "optimizer": weights_fingerprint({f"{k}.{name}": v for k, s in saved["optimizer"]["state"].items()
                                              for name, v in s.items()}),
            "cd": saved["colinearity_decay"]["num_updates"]}


def test_a_resume_on_two_ranks_continues_every_rank_from_the_checkpoint(sample, tmp_path):
    """Stopped after epoch 1 (of 4 iterations: 8 images, 2 per rank and iteration) and resumed with the same
    command (train_cfg.max_epochs may grow): both ranks start from epoch_1.pth (its iteration, weights, AdamW
    moments and CD update count), read the images the uninterrupted run reads, and end where it ends."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert _run(whole, _argv(sample, whole / "run", 2)) == [("ok", 0)] * 2
    assert _run(parts, _argv(sample, parts / "run", 1)) == [("ok", 0)] * 2
    checkpoint = _saved(parts / "run" / "epoch_1.pth")
    assert (checkpoint["iter"], checkpoint["epoch"], checkpoint["cd"]) == (2, 1, 2)
    assert _run(parts, _argv(sample, parts / "run", 2, "--resume")) == [("ok", 0)] * 2
    started = [torch.load(parts / f"start_rank{r}.pt") for r in (0, 1)]
    assert started == [checkpoint, checkpoint]
    done = [torch.load(parts / f"trained_rank{r}.pt") for r in (0, 1)]
    full = [torch.load(whole / f"trained_rank{r}.pt") for r in (0, 1)]
    assert done[0] == done[1]  # DDP kept the ranks together
    assert (done[0]["iter"], done[0]["epoch"], done[0]["cd"]) == (4, 2, 4)
    # bit for bit the uninterrupted run: rank 1 drew its RoI samples from its own state at the checkpoint, not
    # from the seed (its weights and AdamW moments differed)
    assert done[0] == full[0]
    for r in (0, 1):  # each rank's images, iteration by iteration, epoch 2 from the resumed run
        images = (parts / f"images_rank{r}.txt").read_text().splitlines()
        assert len(images) == 4 and images == (whole / f"images_rank{r}.txt").read_text().splitlines()


def test_a_config_one_node_lacks_ends_every_rank_before_the_ranks_meet(sample, tmp_path):
    """The --config files are read before the process group forms: rank 1's node without one raised there, and the
    others waited for it at the rendezvous (in MMEngine's init_dist) until the group's timeout. Rank 1 joins the
    group to fail, and the others stop at their first collective naming its cause."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    (nodes[0] / "detector.py").write_text(f"_base_ = [{os.path.abspath(SAMPLE_CONFIG)!r}]\n")  # on node 0 only
    argv = ["--config", "detector.py", "--data-root", sample, "--work-dir", "run", "--launcher", "pytorch",
            "train_cfg.max_epochs=1", "randomness.seed=0"]
    rank0, rank1 = _run(tmp_path / "work", argv, seconds=100, cwds=[str(n) for n in nodes])
    assert rank1 == ("DetectionError", "--config detector.py: no such file"), rank1
    assert rank0 == ("DetectionError", "rank 1 cannot start: --config detector.py: no such file"), rank0
    assert not (nodes[0] / "run").exists() and not (nodes[1] / "run").exists()


def _log_text(work_dir) -> str:
    """Every log MMEngine wrote into `work_dir` (a folder per command, <timestamp>/<timestamp>.log)."""
    import glob
    return "".join(open(path).read() for path in sorted(glob.glob(os.path.join(work_dir, "*", "*.log"))))


def _with_ddp_wrapper(load_config):
    """`load_config` whose configs wrap the model in MMEngine's DDP, as _cpu_ddp's ranks train it."""
    def load(*args, **kwargs):
        cfg = load_config(*args, **kwargs)
        cfg.model_wrapper_cfg = dict(type="MMDistributedDataParallel", device_ids=None, broadcast_buffers=False,
                                     find_unused_parameters=True)
        return cfg
    return load


def _as_the_ranks_load_config(monkeypatch) -> None:
    """load_config in this process as _cpu_ddp's ranks have it (their model_wrapper_cfg is a setting of the run,
    which --resume compares; MMEngine reads it only under torchrun)."""
    import engine.detection
    monkeypatch.setattr(engine.detection, "load_config", _with_ddp_wrapper(engine.detection.load_config))


def test_a_resume_on_another_number_of_ranks_names_the_global_batch_it_changes(sample, tmp_path, monkeypatch):
    """A run trained on 2 ranks (2 images each: a global batch of 4) resumed in one process without a word: the
    global batch halved and an epoch took twice the iterations, so the warmup ended elsewhere in the data. Each
    checkpoint records its ranks, and the resumed run's log names the change, from 2 ranks to 1 and from 1 to 2."""
    import train_detection
    _as_the_ranks_load_config(monkeypatch)
    two = tmp_path / "two" / "run"
    assert _run(tmp_path / "two", _argv(sample, two, 1)) == [("ok", 0)] * 2
    assert torch.load(two / "epoch_1.pth", weights_only=False)["world_size"] == 2
    one_process = [a for a in _argv(sample, two, 2, "--resume") if a not in ("--launcher", "pytorch")]
    assert train_detection.main(one_process) == 0
    assert ("the checkpoint was written by a run of 2 rank(s) and this one has 1: the global batch is 2 images "
            "instead of 4 (2 per rank) and an epoch 4 iterations") in _log_text(two)

    one = tmp_path / "one" / "run"
    assert train_detection.main([a for a in _argv(sample, one, 1) if a not in ("--launcher", "pytorch")]) == 0
    assert torch.load(one / "epoch_1.pth", weights_only=False)["world_size"] == 1
    assert _run(tmp_path / "one", _argv(sample, one, 2, "--resume")) == [("ok", 0)] * 2
    log = _log_text(one)
    assert ("the checkpoint was written by a run of 1 rank(s) and this one has 2: the global batch is 4 images "
            "instead of 2 (2 per rank) and an epoch 2 iterations") in log
    assert "ranks 1 to 1 continue from the run's seed" in log  # and rank 1 has no state of its own to go on from


def _worker_pipeline_fails_on_rank_1(rank: int, world: int, port: int, argv: list, work: str, cwds=None) -> None:
    """`_worker`, with the loaders' first images failing their pipeline on rank 1 alone (a file its node lacks)."""
    if rank == 1:
        import engine.detection
        from engine.detection import DetectionError

        def fails(dataset, key):
            raise DetectionError(f"{key}.dataset.pipeline.0 (LoadImageFromFile) fails on this rank's first image")
        engine.detection.check_pipeline = fails
    _worker(rank, world, port, argv, work, cwds)


def test_a_pipeline_that_fails_on_one_rank_after_the_ranks_met_ends_every_rank_with_one_error(sample, tmp_path):
    """The pipelines are checked on each rank's first images once the Runner is built, after the ranks agreed to
    start: rank 1 failing there left rank 0 to go on into training and wait there for it (or die with a gloo
    traceback once it was gone); now rank 0 stops with one error saying so, and the failed start leaves nothing."""
    work = tmp_path / "work"
    os.makedirs(work)
    spawn_within(_worker_pipeline_fails_on_rank_1, (2, free_port(), _argv(sample, tmp_path / "run", 1), str(work)),
                 2, seconds=100)
    rank0, rank1 = [torch.load(work / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert rank1 == ("DetectionError", "train_dataloader.dataset.pipeline.0 (LoadImageFromFile) fails on this "
                                       "rank's first image"), rank1
    assert rank0 == ("OtherRankError", "rank 0: another rank failed checking the loaders' pipelines on its first "
                                        "images; its output says why"), rank0
    assert not (tmp_path / "run" / "train_detection_config.json").exists()
