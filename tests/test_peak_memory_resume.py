"""train/peak_mem_mib of a run resumed in the middle of an epoch is the peak of its training, measured from the start
of its run_epoch call, not the CUDA allocator's peak since the process started (the model built, the checkpoint
read): torch.cuda's statistics are stubbed, so the test runs on the CPU."""
import torch

import engine.loop
from engine.loop import TrainBatches, TrainLoop, TrainState


def test_a_run_resumed_mid_epoch_logs_the_peak_of_its_training_not_of_its_start_up(monkeypatch):
    events, allocator = [], {"peak": 5000.0}  # MiB: the start-up's peak (model, optimizer, the checkpoint read)

    def reset(device=None):
        events.append("reset")
        allocator["peak"] = 100.0  # what is allocated at the reset: the model and optimizer

    monkeypatch.setattr(engine.loop, "_measures_cuda", lambda device: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocator["peak"] * 2 ** 20)

    def compute_loss(model, x, y):
        events.append("batch")
        allocator["peak"] = max(allocator["peak"], 300.0)  # a training step's activations
        return model(x).sum()

    model = torch.nn.Linear(4, 2)
    logged = []
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), compute_loss=compute_loss,
                     device=torch.device("cpu"), log_every=1, log=lambda step, metrics: logged.append(metrics))
    sampler = type("S", (), {"set_epoch": lambda self, epoch, start=0: None})()
    state = TrainState(step=2, epoch=0, epoch_batches=2)  # resumed after 2 of the epoch's 4 updates
    batches = [(torch.randn(2, 4), torch.tensor([0, 1]))] * 2
    assert loop.run_epoch(TrainBatches(batches, sampler), state, batch_size_per_gpu=2) == "epoch_end"
    assert events[0] == "reset" and "batch" in events
    peaks = [m["train/peak_mem_mib"] for m in logged if "train/peak_mem_mib" in m]
    assert peaks and all(p == 300.0 for p in peaks)
