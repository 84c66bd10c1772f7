"""data.timeout: a loader worker that stops delivering batches ends the run with one `error:` line naming the
setting, within the timeout, keeping the training done so far; settings torch would not honour are refused
before anything runs. The stalls are real: a torch DataLoader worker process that sleeps in __getitem__."""
import os
import time
from typing import Optional

import pytest
import torch

import train
from configs import ConfigError, load_config
from configs.schema import DataConfig
from data import DataError, build_eval_loader
from data.loader import LoaderTimeoutError, loader_timeout
from data.synthetic import SyntheticDataset

from .conftest import DEBUG_CONFIG, run_entry

# a stalled worker's sleep: far beyond every timeout here (3-5 s: generous, so that a worker slowed by a loaded
# machine is not taken for a stalled one), so a missing timeout fails the test
STALL_S = 60


def stall_in_worker(release: str, call: int, size: Optional[int] = None) -> None:
    """Patch SyntheticDataset so that in each DataLoader worker process (never in the main process) the
    `call`-th __getitem__ (of a set of `size` images only, when given) sleeps until the file `release`
    exists, or STALL_S passes."""
    original = SyntheticDataset.__getitem__
    calls = {"n": 0}  # per process: each worker counts its own calls

    def stalling(self, i):
        if torch.utils.data.get_worker_info() is not None and size in (None, self.size):
            calls["n"] += 1
            if calls["n"] == call:
                deadline = time.monotonic() + STALL_S
                while not os.path.exists(release) and time.monotonic() < deadline:
                    time.sleep(0.05)
        return original(self, i)

    SyntheticDataset.__getitem__ = stalling


@pytest.mark.parametrize("overrides, message", [
    (["data.timeout=-1"], "'data.timeout' must be >= 0"),
    (["data.timeout=2", "data.num_workers=0"], "data.timeout=2 with data.num_workers=0"),
])
def test_a_timeout_torch_would_not_honour_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        load_config([DEBUG_CONFIG], overrides)
    assert "\n" not in str(refused.value)


def test_a_timeout_with_workers_and_none_without_are_accepted():
    assert load_config([DEBUG_CONFIG], ["data.timeout=2", "data.num_workers=1"]).data.timeout == 2
    assert load_config([DEBUG_CONFIG], ["data.timeout=0", "data.num_workers=0"]).data.timeout == 0


def test_the_loader_refuses_the_pair_a_checkpoints_config_could_bring():
    # evaluate.py layers overrides over a checkpoint's config without the config-time check
    with pytest.raises(DataError, match="data.timeout=2 with data.num_workers=0"):
        loader_timeout(DataConfig(timeout=2, num_workers=0), workers=0)
    # null: a finite wait with workers, none without (torch refuses a timeout without workers)
    assert 0 < loader_timeout(DataConfig(num_workers=2), workers=2) < float("inf")
    assert loader_timeout(DataConfig(num_workers=0), workers=0) == 0


def test_a_stalled_worker_ends_the_iteration_within_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(SyntheticDataset, "__getitem__", SyntheticDataset.__getitem__)  # undone after the test
    stall_in_worker(str(tmp_path / "release"), call=5)  # the first image of the second batch of 4
    cfg = DataConfig(dataset="synthetic", synthetic_val_size=16, num_workers=1, timeout=3)
    loader = build_eval_loader(cfg, img_size=8, batch_size_per_gpu=4, rank=0, world_size=1, num_classes=2)
    assert isinstance(loader, torch.utils.data.DataLoader) and loader.num_workers == 1
    batches = iter(loader)
    next(batches)
    waited = time.monotonic()
    try:
        with pytest.raises(LoaderTimeoutError) as stalled:
            next(batches)
        waited = time.monotonic() - waited
    finally:
        (tmp_path / "release").touch()  # the worker finishes its item and shuts down with the loader
    assert 3 <= waited < 3 + 10, waited
    message = str(stalled.value)
    assert "data.timeout=3 s" in message and "data.num_workers" in message and "data source" in message
    assert isinstance(stalled.value, DataError)  # the entry points' one-line user errors


@pytest.mark.slow
def test_a_stalled_worker_ends_a_training_run_with_one_error_line_and_its_checkpoint(tmp_path, monkeypatch, capsys):
    """train.py's __main__ in this process (run_entry; its loader workers fork from it, stall included): the
    debug recipe (64 train images, batches of 8, two per update) with one worker and a short timeout; the
    worker's 33rd item is the first image of micro-batch 5, the first of update 3."""
    monkeypatch.setattr(SyntheticDataset, "__getitem__", SyntheticDataset.__getitem__)  # undone after the test
    stall_in_worker(str(tmp_path / "release"), call=33)
    out = tmp_path / "run"
    started = time.monotonic()
    try:
        code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={out}", "data.num_workers=1",
                                              "data.timeout=5", "train.max_steps=6", "log.tensorboard=false"],
                                 capsys)
        took = time.monotonic() - started
    finally:
        (tmp_path / "release").touch()
    assert took < STALL_S, f"the run waited for the stalled worker ({took:.0f} s)"
    assert code == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data.timeout=5 s" in errors[0], err[-3000:]
    assert "Traceback" not in err
    saved = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert saved["state"]["step"] == 2 and saved["state"]["epoch_batches"] == 4  # update 3 is read again


@pytest.mark.slow
def test_a_stalled_worker_in_a_validation_keeps_the_epoch_and_the_resumed_run_validates(debug_config, tmp_path,
                                                                                      monkeypatch, caplog):
    monkeypatch.setattr(SyntheticDataset, "__getitem__", SyntheticDataset.__getitem__)  # undone after the test
    stall_in_worker(str(tmp_path / "release"), call=1, size=16)  # the val set's first image
    cfg = debug_config("data.num_workers=1", "data.timeout=5", "train.max_steps=4", "log.tensorboard=false")
    try:
        with caplog.at_level("ERROR"), pytest.raises(LoaderTimeoutError, match="data.timeout=5 s"):
            train.main(cfg)  # 4 updates are the first epoch; its validation stalls
    finally:
        (tmp_path / "release").touch()
    saved = torch.load(os.path.join(cfg.out_dir, "checkpoint.pt"), map_location="cpu", weights_only=True)
    assert saved["state"]["step"] == 4 and saved["state"]["validation_due"]
    assert "checkpoint.pt written" in caplog.text
