"""The learning rate a resumed run's optimizer holds is the one a run never stopped holds at that point, also where
the resumed run trains no update before it writes its checkpoint."""
from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.optim.optimizer as optimizer_module

import train


def groups(out_dir) -> list[dict]:
    payload = torch.load(os.path.join(out_dir, "checkpoint.pt"), map_location="cpu", weights_only=True)
    return [{k: v for k, v in group.items() if k != "params"} for group in payload["optimizer"]["param_groups"]]


@pytest.mark.parametrize("per_step", [False, True], ids=["per_epoch", "per_step"])
def test_a_rerun_after_a_stop_at_the_last_update_writes_the_lr_of_the_run_never_stopped(debug_config, per_step):
    """Stopped by a signal at the schedule's last update (8), the re-run validates and writes the last checkpoint
    without training an update, so no epoch began and the schedule never set the lr: checkpoint.pt held the fresh
    schedule's first (warmup) lr, 1e-06, where the run never stopped holds its last epoch's, 0.005005."""
    run = ("optim.lr=0.01", f"sched.per_step={str(per_step).lower()}")
    train.main(debug_config(*run, name="straight"))
    updates = [0]

    def stop_at_the_last_update(*_):
        updates[0] += 1
        if updates[0] == 8:
            os.kill(os.getpid(), signal.SIGTERM)

    handle = optimizer_module.register_optimizer_step_post_hook(stop_at_the_last_update)
    try:
        assert train.main(debug_config(*run, name="stopped")).reason == "preempted"
    finally:
        handle.remove()
    train.main(debug_config(*run, name="stopped"))  # trains nothing: validates and writes the last checkpoint
    assert groups(debug_config(name="stopped").out_dir) == groups(debug_config(name="straight").out_dir)
