"""The window that trips the divergence guard is logged (metrics.jsonl, the progress line) before the error."""
import pytest
import torch

from data import build_loaders
from engine.divergence import DivergenceError, DivergenceGuard
from engine.loop import TrainLoop, TrainState


def test_the_window_that_stops_the_run_is_logged_before_the_error(debug_config):
    """One update per log window, losses 1 then 50: the guard (3 windows) stops at update 4; the log callback got
    update 4's record, with its loss, before the error (metrics.jsonl and the progress line are written from it)."""
    cfg = debug_config("data.mixup=0", "data.cutmix=0")
    loaders = build_loaders(cfg.data, img_size=32, batch_size_per_gpu=8, eval_batch_size_per_gpu=8, rank=0,
                            world_size=1, seed=0, num_classes=4)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))
    losses = iter([1.0] + [50.0] * 20)
    logged = {}
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                     compute_loss=lambda m, x, y: m(x).sum() * 0 + next(losses), device=torch.device("cpu"),
                     log_every=1, log=lambda step, metrics: logged.update({step: metrics}),
                     divergence=DivergenceGuard(3.0, 3))
    with pytest.raises(DivergenceError, match="at update 4"):
        loop.run_epoch(loaders.train, TrainState(), batch_size_per_gpu=8)
    assert sorted(logged) == [1, 2, 3, 4] and logged[4]["train/loss"] == 50.0 and "train/lr" in logged[4]
