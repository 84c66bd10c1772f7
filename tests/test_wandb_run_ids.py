"""Which wandb run a training run logs into: its own, kept in its checkpoints, whatever file it resumes from.

A resume from the run's own checkpoint.pt continues its wandb run. A roll-back to one of its own snapshots (a
resume below the update the run's records reached) logs into a wandb run of its own, <id>-r<N>: wandb logs no step
below the one its run reached, so in the same run the new branch's updates up to there were dropped and the branch
left kept. A new run started from another run's checkpoint (train.resume=PATH into another out_dir) gets a wandb
run of its own: with the id copied from that checkpoint, wandb.init(id=..., resume="allow") would log the new run
into the old one and rename it. wandb itself is replaced by a stand-in that records the keywords of wandb.init."""
import os
import sys
import types

import pytest
import torch

import train

RUN = ("log.wandb=true", "log.tensorboard=false")


def fake_wandb(monkeypatch) -> list[dict]:
    """Install a stand-in wandb module; the keyword arguments of each wandb.init call are appended to the list."""
    inits: list[dict] = []
    fake = types.SimpleNamespace(init=lambda **kw: inits.append(kw) or types.SimpleNamespace(
        log=lambda *a, **k: None, finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return inits


def saved_id(out_dir: str) -> str:
    return torch.load(os.path.join(out_dir, "checkpoint.pt"), weights_only=True)["wandb_id"]


def test_a_run_started_from_another_runs_checkpoint_gets_its_own_wandb_run(debug_config, monkeypatch):
    inits = fake_wandb(monkeypatch)
    first = debug_config(*RUN, name="x")
    train.main(first)
    resume = f"train.resume={os.path.join(first.out_dir, 'checkpoint.pt')}"
    second = debug_config(*RUN, "sched.epochs=3", "train.allow_changed_config=true", resume, name="y")
    train.main(second)
    train.main(second)  # the same command again (a requeue): it continues y's own checkpoint.pt
    x_id, y_id, y_again = (kw["id"] for kw in inits)
    assert x_id and y_id and x_id != y_id, inits
    assert y_again == y_id  # the requeued y goes on in y's wandb run, not x's
    assert saved_id(first.out_dir) == x_id and saved_id(second.out_dir) == y_id
    assert inits[0]["dir"] == first.out_dir and inits[1]["dir"] == second.out_dir


def test_a_roll_back_to_one_of_the_runs_own_snapshots_logs_into_a_wandb_run_of_its_own(debug_config, monkeypatch,
                                                                                     caplog):
    inits = fake_wandb(monkeypatch)
    cfg = debug_config(*RUN, "train.keep_every_epochs=1", name="x")
    train.main(cfg)  # 2 epochs of 4 updates: records up to update 8
    snapshot = os.path.join(cfg.out_dir, "snapshots", "epoch0001.pt")
    assert torch.load(snapshot, weights_only=True)["state"]["step"] == 4
    back = debug_config(*RUN, "train.keep_every_epochs=1", f"train.resume={snapshot}", name="x")
    train.main(back)
    x_id = inits[0]["id"]
    assert inits[1]["id"] == f"{x_id}-r4", inits  # was: x_id, whose wandb run had reached update 8
    assert f"this run logs into wandb run {x_id}-r4 from update 5 on" in caplog.text
    assert saved_id(cfg.out_dir) == f"{x_id}-r4"  # its checkpoints record the run it logs into
    train.main(back)  # the same command again (a requeue): it goes on in its own checkpoint.pt's wandb run
    assert inits[2]["id"] == f"{x_id}-r4", inits
    os.remove(os.path.join(cfg.out_dir, "checkpoint.pt"))  # a second roll-back to the same update
    train.main(back)
    assert inits[3]["id"] not in (x_id, f"{x_id}-r4"), inits  # not the first roll-back's run, which reached 8
    assert len({kw["id"] for kw in inits}) == 3


def test_a_roll_back_re_run_after_failing_before_its_first_record_still_gets_a_wandb_run_of_its_own(
        debug_config, monkeypatch):
    """The first try cut metrics.jsonl back to update 4 (keeping the rest) and failed before logging; the same
    command again found the records ending at 4 and logged into the snapshot's wandb run, which had reached 8 and
    drops updates 5 to 8 (was: the id of run x)."""
    inits = fake_wandb(monkeypatch)
    cfg = debug_config(*RUN, "train.keep_every_epochs=1", name="x")
    train.main(cfg)
    back = debug_config(*RUN, "train.keep_every_epochs=1",
                        f"train.resume={os.path.join(cfg.out_dir, 'snapshots', 'epoch0001.pt')}", name="x")
    real = train.build_loop

    def fail(*args, **kwargs):
        raise RuntimeError("failed before the first update")
    monkeypatch.setattr(train, "build_loop", fail)
    with pytest.raises(RuntimeError, match="failed before the first update"):
        train.main(back)
    monkeypatch.setattr(train, "build_loop", real)
    train.main(back)
    x_id = inits[0]["id"]
    assert [kw["id"] for kw in inits[1:]] == [f"{x_id}-r4", f"{x_id}-r4"], inits


def test_a_resume_where_the_records_end_keeps_its_wandb_run(debug_config, monkeypatch):
    """A stop (train.max_steps here; a preemption alike) and its requeue: the wandb run goes on."""
    inits = fake_wandb(monkeypatch)
    train.main(debug_config(*RUN, "train.max_steps=4", name="x"))
    cfg = debug_config(*RUN, name="x")
    train.main(cfg)
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"], inits
    assert saved_id(cfg.out_dir) == inits[0]["id"]
