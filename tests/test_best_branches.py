"""best.pt across the branches of a run (engine/best_checkpoint.py): which write of best.pt a checkpoint's best
score belongs to is told by the fingerprint of its weights, so a return to a branch that a roll-back left, whose
best validation came at the same update as the other branch's, does not take the other branch's best.pt for its
own."""
import copy
import os

import pytest
import torch

import train
from engine.best_checkpoint import BestCheckpoint, BestMatch
from engine.checkpoint import save_atomic, weights_fingerprint
from engine.loop import TrainState
from tests.conftest import DEMO_CONFIG

CPU = torch.device("cpu")


def linear(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def best_of(path, model) -> BestCheckpoint:
    """best.pt at `path` for `model`, written as train.py writes it (atomically)."""
    return BestCheckpoint(str(path), model=model, ema=None, config={}, classes=None,
                          save=lambda payload_fn, target: save_atomic(payload_fn(), target))


def weights_in(path) -> dict:
    return torch.load(path, weights_only=True)["model"]


def same_weights(state_dict: dict, model: torch.nn.Module) -> bool:
    return state_dict.keys() == model.state_dict().keys() and all(
        torch.equal(state_dict[k], v) for k, v in model.state_dict().items())


def test_a_return_to_the_branch_a_roll_back_left_restores_its_own_best_pt(tmp_path):
    """Branch A validates best at update 8; a roll-back to update 4 (whose best, at update 4, A's later write
    replaced) starts branch B, which validates best at update 8 too; then the run returns to A's checkpoint at
    update 8. Both best.pt files were written at update 8: by the update alone B's would pass for A's. B's is kept
    aside, A's comes back from the file the roll-back kept it in, and the score stays A's."""
    path = tmp_path / "best.pt"
    a4, a8, b8 = linear(0), linear(1), linear(2)  # the weights of each validation
    state_a = TrainState(epoch=2, step=8, best_value=50.0, best_epoch=1, best_step=4,
                         best_fingerprint=weights_fingerprint(a4.state_dict()))
    assert best_of(path, a8).offer(state_a, {"val/top1": 70.0})
    a_checkpoint = copy.deepcopy(state_a)  # A's checkpoint.pt at update 8

    state_b = TrainState(epoch=1, step=4, best_value=50.0, best_epoch=1, best_step=4,
                         best_fingerprint=weights_fingerprint(a4.state_dict()))  # the snapshot at update 4
    match = best_of(path, b8).match_file(state_b, True, CPU)
    assert match == BestMatch(kept=str(tmp_path / "best.until_step4.pt"), restored=None, lost=4)
    assert same_weights(weights_in(match.kept), a8) and not path.exists()
    assert (state_b.best_value, state_b.best_step, state_b.best_fingerprint) == (None, 0, None)
    state_b.epoch, state_b.step = 2, 8
    assert best_of(path, b8).offer(state_b, {"val/top1": 60.0})  # B's first validation, also at update 8

    match = best_of(path, a8).match_file(a_checkpoint, True, CPU)
    assert match == BestMatch(kept=str(tmp_path / "best.until_step8.pt"),
                              restored=str(tmp_path / "best.until_step4.pt"))
    assert same_weights(weights_in(match.kept), b8)  # B's best.pt, kept
    assert same_weights(weights_in(path), a8)  # A's again
    assert (a_checkpoint.best_value, a_checkpoint.best_step) == (70.0, 8)
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "best.until_step4.pt", "best.until_step8.pt"]
    # best.pt is a link to the kept file: the next write of best.pt is a new file, the kept one stays A's
    assert best_of(path, b8).offer(a_checkpoint, {"val/top1": 80.0})
    assert same_weights(weights_in(tmp_path / "best.until_step4.pt"), a8) and same_weights(weights_in(path), b8)


def test_a_best_pt_with_a_fingerprint_is_not_the_best_of_a_state_that_records_none(tmp_path):
    """A checkpoint written before the fingerprint was recorded (its best at update 6) and a best.pt written at
    update 6 by a later version of the code: that best.pt was written by a state that recorded its fingerprint,
    so not by this one, which is kept aside. A best.pt without one, at the state's best update, is matched by that
    update as before."""
    path = tmp_path / "best.pt"
    old_state = {"epoch": 2, "step": 9, "best_value": 60.0, "best_epoch": 2, "best_step": 6}  # no fingerprint
    assert best_of(path, linear(0)).offer(TrainState(epoch=2, step=6), {"val/top1": 55.0})
    state = TrainState(**old_state)
    match = best_of(path, linear(0)).match_file(state, True, CPU)
    assert match.kept == str(tmp_path / "best.until_step9.pt") and not path.exists() and state.best_value is None

    torch.save({"model": {}, "config": {}, "state": {"step": 6, "best_value": 60.0, "best_step": 6}}, path)
    state = TrainState(**old_state)
    assert best_of(path, linear(0)).match_file(state, True, CPU) == BestMatch() and path.exists()
    assert (state.best_value, state.best_step) == (60.0, 6)


@pytest.mark.slow
def test_train_py_back_on_a_branch_keeps_the_other_branch_best_pt_aside_and_evaluates_its_own(tmp_path, caplog):
    """The same through train.py on the digits: run A (2 epochs, a snapshot per epoch), branch B from A's epoch-1
    snapshot with another lr, then A again from its epoch-2 snapshot. Both branches validate at the end of epoch 2,
    at the same update. Afterwards best.pt holds A's weights (those of A's snapshot: A's best is its last
    validation), B's best.pt is kept as best.until_step<N>.pt (the weights of B's own snapshot), and the run's best
    score is A's."""
    out = tmp_path / "run"
    common = [f"--config={DEMO_CONFIG}", "model.name=vit_nano", "sched.epochs=2", "sched.warmup_epochs=1",
              "train.keep_every_epochs=1", "log.tensorboard=false", f"out_dir={out}"]
    a = train.main(train.parse_args(common))
    end = a.state.step
    assert a.state.best_step == end, "precondition: A's best validation is its last"
    b = train.main(train.parse_args([*common, "optim.lr=5e-3", "train.allow_changed_config=true",
                                     f"train.resume={out / 'snapshots' / 'epoch0001.pt'}"]))
    b_best = torch.load(out / "best.pt", weights_only=True)
    assert b.state.best_step == end == b_best["state"]["step"], "precondition: B wrote best.pt at the same update"
    snapshot_a, snapshot_b = (torch.load(out / "snapshots" / name, weights_only=True)["model"]
                              for name in ("epoch0002.pt", "epoch0002-1.pt"))
    assert not all(torch.equal(v, snapshot_b[k]) for k, v in snapshot_a.items())

    # B starts at the end of epoch 1, whose best is A's validation there: A's later best.pt replaced that file
    start_b = end // 2
    assert any(f"kept as {out / f'best.until_step{start_b}.pt'}; the weights of the run's best validation (update "
               f"{start_b}) are no longer in {out}: the next validation writes best.pt" in r.message
               for r in caplog.records)
    caplog.clear()
    again = train.main(train.parse_args([*common, f"train.resume={out / 'snapshots' / 'epoch0002.pt'}"]))
    best, kept = (torch.load(out / name, weights_only=True)["model"]
                  for name in ("best.pt", f"best.until_step{end}.pt"))
    assert all(torch.equal(best[k], v) for k, v in snapshot_a.items())
    assert all(torch.equal(kept[k], v) for k, v in snapshot_b.items())
    assert (again.state.best_value, again.state.best_step) == (a.state.best_value, end)
    assert any(f"kept as {out / f'best.until_step{end}.pt'}; the run's own best.pt is back, linked from "
               f"{out / f'best.until_step{start_b}.pt'}" in r.message for r in caplog.records)
