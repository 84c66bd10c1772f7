"""An exception inside a run never loses what was trained since the last checkpoint without saying how to
resume: one process writes checkpoint.pt at the last completed update (or before the validation that
failed) and the same command resumes exactly; a start that failed leaves no folder that refuses the
corrected command."""
import os

import pytest
import torch

import train
from configs import config_to_dict
from data.synthetic import SyntheticDataset
from device_utils import _FixedOrder
from engine.loop import TrainLoop, TrainState
from engine.run_dir import claim_run_dir, save_config_history


def weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def fail_at_train_sample(monkeypatch, call):
    """The `call`-th training sample raises RuntimeError (the synthetic train set has 64 images)."""
    calls = {"n": 0}
    original = SyntheticDataset.__getitem__

    def failing(self, i):
        if self.size == 64:
            calls["n"] += 1
            if calls["n"] == call:
                raise RuntimeError("the file server went away")
        return original(self, i)

    monkeypatch.setattr(SyntheticDataset, "__getitem__", failing)


def test_an_error_mid_epoch_keeps_the_updates_and_the_same_command_resumes_exactly(debug_config,
                                                                                  monkeypatch, caplog):
    straight = debug_config("train.max_steps=6", name="straight")
    train.main(straight)
    cfg = debug_config("train.max_steps=6", name="crash")
    fail_at_train_sample(monkeypatch, 45)  # micro-batch 6 of 8: the second half of update 3
    with caplog.at_level("ERROR"), pytest.raises(RuntimeError, match="file server"):
        train.main(cfg)
    saved = weights(os.path.join(cfg.out_dir, "checkpoint.pt"))
    assert saved["state"]["step"] == 2 and saved["state"]["epoch_batches"] == 4  # update 3 is read again
    assert "checkpoint.pt written at update 2" in caplog.text and "re-run the same command" in caplog.text
    monkeypatch.undo()
    train.main(debug_config("train.max_steps=6", name="crash"))
    a = weights(os.path.join(straight.out_dir, "checkpoint.pt"))["model"]
    b = weights(os.path.join(cfg.out_dir, "checkpoint.pt"))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("update", [1, 2])
def test_an_error_inside_the_optimizer_step_saves_nothing_and_says_so(debug_config, caplog, update):
    """Also after a completed update (2): the weights of a step that broke half-way are never saved."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = [0]

    def broken(*args, **kwargs):
        steps[0] += 1
        if steps[0] == update:
            raise RuntimeError("CUDA error: an illegal memory access")

    optimizer.register_step_pre_hook(lambda *a: broken())
    batches = [(torch.randn(2, 4), torch.tensor([0, 1]))] * 4
    from engine.loop import TrainBatches

    saves = []
    loop = TrainLoop(model=model, optimizer=optimizer, compute_loss=lambda m, x, y: m(x).sum(),
                     device=torch.device("cpu"), save=lambda: saves.append(1))
    sampler = type("S", (), {"set_epoch": lambda self, epoch, start=0: None})()
    with caplog.at_level("ERROR"), pytest.raises(RuntimeError, match="illegal memory"):
        loop.run_epoch(TrainBatches(batches, sampler), TrainState(), batch_size_per_gpu=2)
    assert saves == [] and f"inside the optimizer step of update {update}" in caplog.text


def test_an_error_in_validation_keeps_the_epoch_and_the_resumed_run_validates_first(debug_config,
                                                                                  monkeypatch, caplog):
    cfg = debug_config(name="val")
    real = train.validate
    monkeypatch.setattr(train, "validate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("probe bug")))
    with caplog.at_level("ERROR"), pytest.raises(RuntimeError, match="probe bug"):
        train.main(cfg)
    saved = weights(os.path.join(cfg.out_dir, "checkpoint.pt"))["state"]
    assert saved["step"] == 4 and saved["epoch"] == 1 and saved["validation_due"]
    assert "validation failed at update 4 (RuntimeError): checkpoint.pt written" in caplog.text
    monkeypatch.setattr(train, "validate", real)
    result = train.main(debug_config(name="val"))
    assert result.state.step == 8 and result.state.best_epoch in (1, 2) and result.reason == "finished"


def test_a_failed_start_never_leaves_a_folder_that_refuses_the_corrected_command(debug_config):
    """What a start that failed before its first logged update leaves (train.log, config.yaml, tb/, no
    metrics) is moved aside for a command with other settings too; nothing is deleted."""
    failed = debug_config("optim.lr=10.0", name="f")
    os.makedirs(os.path.join(failed.out_dir, "tb"))
    save_config_history(failed.out_dir, config_to_dict(failed), 0)
    for name in ("train.log", "metrics.jsonl"):
        open(os.path.join(failed.out_dir, name), "w").close()
    corrected = debug_config("optim.lr=0.001", name="f")
    with claim_run_dir(corrected.out_dir, config_to_dict(corrected)):
        pass
    archived = os.listdir(os.path.join(corrected.out_dir, "archive"))
    assert sorted(os.listdir(os.path.join(corrected.out_dir, "archive", archived[0]))) == [
        "config.yaml", "metrics.jsonl", "tb", "train.log"]


def test_an_error_after_a_non_finite_loss_writes_no_checkpoint():
    """An exception mid-epoch keeps the updates since the last checkpoint only when they are finite: here update 2's
    loss is NaN (its weights are NaN) and the loader fails at update 3, before any log step had seen the NaN. No
    checkpoint may be written (it would replace the last good one with NaN weights), and the loader's error is the
    one raised."""
    from engine.loop import TrainBatches

    class FailingLoader:  # two batches, then the file server goes away
        def __len__(self):
            return 4

        def __iter__(self):
            for _ in range(2):
                yield torch.randn(2, 3), torch.tensor([0, 1])
            raise OSError("the file server went away")

    calls, saves = [0], []

    def compute_loss(m, x, y):
        calls[0] += 1
        loss = torch.nn.functional.cross_entropy(m(x), y)
        return loss * float("nan") if calls[0] == 2 else loss

    model = torch.nn.Linear(3, 2)
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), compute_loss=compute_loss,
                     device=torch.device("cpu"), save=lambda: saves.append(1), log_every=100)
    with pytest.raises(OSError, match="the file server went away"):
        loop.run_epoch(TrainBatches(FailingLoader(), _FixedOrder()), TrainState(), batch_size_per_gpu=2)
    assert calls[0] == 2 and saves == []
    assert not torch.isfinite(model.weight).all()  # the premise: the weights are NaN


@pytest.mark.parametrize("failing_micro_batch", [1, 2])
def test_an_error_before_the_first_update_completes_writes_no_checkpoint(failing_micro_batch):
    """Nothing is trained before the first update completes (2 micro-batches here): an error in either of its
    micro-batches writes no checkpoint.pt, which would make the corrected command a resume of the untrained
    weights under the failed settings. The error itself is raised."""
    from engine.loop import TrainBatches

    calls, saves = [0], []

    def compute_loss(m, x, y):
        calls[0] += 1
        if calls[0] == failing_micro_batch:
            raise RuntimeError("a bad batch")
        return torch.nn.functional.cross_entropy(m(x), y)

    model = torch.nn.Linear(3, 2)
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), compute_loss=compute_loss,
                     device=torch.device("cpu"), accum_steps=2, save=lambda: saves.append(1), log_every=100)
    batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(4)]
    state = TrainState()
    with pytest.raises(RuntimeError, match="a bad batch"):
        loop.run_epoch(TrainBatches(batches, _FixedOrder()), state, batch_size_per_gpu=2)
    assert saves == [] and (state.step, state.epoch_batches) == (0, 0)
