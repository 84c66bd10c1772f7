"""A loader worker that dies (killed for memory) surfaces as an error of `next(loader)`, where the training loop
handles a failed batch (its own error line, the other ranks' OtherRankError), not wherever the main process happens
to be when torch's SIGCHLD handler fires (mostly inside a forward or backward, a traceback on every rank).

The reference is torch's plain DataLoader in a process of its own, whose handler raises during the "forward" (a
sleep between batches); StopSafeDataLoader, in another fresh process, must raise from next().
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import os, signal, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
from data.loader import StopSafeDataLoader


class DiesAtTheThirdItem(Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # the worker, killed as the kernel's OOM killer would
        return torch.tensor(float(i))


cls = StopSafeDataLoader if sys.argv[1] == "safe" else DataLoader
batches = iter(cls(DiesAtTheThirdItem(), batch_size=1, num_workers=1))
where = "nowhere"
try:
    for _ in range(20):
        try:
            next(batches)
        except RuntimeError:
            where = "next"
            break
        time.sleep(1.0)  # the forward and backward of the batch
except RuntimeError:
    where = "during the forward"
print("raised", where, flush=True)
"""


@pytest.mark.slow  # two processes, each waiting for torch's worker status check (5 s)
@pytest.mark.parametrize("loader, where", [("safe", "next"), ("plain", "during the forward")])
def test_a_dead_worker_raises_from_next_not_inside_the_step(loader, where):
    run = subprocess.run([sys.executable, "-c", SCRIPT, loader], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert f"raised {where}" in run.stdout, run.stdout + run.stderr[-2000:]
