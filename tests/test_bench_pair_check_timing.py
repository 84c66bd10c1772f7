"""scripts/bench_pair_check.py times each part on finished CUDA work: the device is synchronized before the clock
starts (kernels an earlier call queued, the untimed find_pairs or the probe input's copy, stay out of the first
timed call) and before it stops, as bench_quant.py's timings are. A stubbed torch.cuda and clock record the order."""
from __future__ import annotations

import types

import torch

import bench_pair_check
import bench_quant


def test_every_timed_call_starts_and_stops_on_finished_cuda_work(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(f"sync {device}"))
    clock = types.SimpleNamespace(perf_counter=lambda: events.append("clock") or float(len(events)))
    monkeypatch.setattr(bench_quant, "time", clock)  # bench_quant.timed, the clock of every timed section
    seconds = bench_pair_check.median_seconds(lambda: events.append("call"), 2, torch.device("cuda"))
    assert events == ["sync cuda", "clock", "call", "sync cuda", "clock"] * 2
    assert seconds == 3.0  # each call between clock readings 2 and 5 (7 and 10)
