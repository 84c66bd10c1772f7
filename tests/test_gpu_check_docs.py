"""What docs/mini_reproduction.md ("On a GPU") and configs/sweeps/fashion_mnist_gpu.yaml tell a GPU machine to run
works as written: the stated shortest `sched.epochs` is accepted by the GPU study's configs while the next shorter
one is refused."""
import os
import re

import pytest

from configs import ConfigError, load_config
from tests.conftest import ROOT

DOC = os.path.join(ROOT, "docs", "mini_reproduction.md")
SWEEP = os.path.join(ROOT, "configs", "sweeps", "fashion_mnist_gpu.yaml")
GPU_CONFIGS = [os.path.join(ROOT, "configs", "finetune", f) for f in
               ("fashion_mnist_dinov2_s14.yaml", "fashion_mnist_dinov2_s14_gpu.yaml")]


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_the_stated_shortest_schedule_is_accepted_and_a_shorter_one_refused():
    stated = set()
    for text in (read(DOC), read(SWEEP)):
        text = " ".join(text.replace("`", "").replace("#", "").split())
        stated.add(int(re.search(r"sched\.epochs=N,? (?:with )?N >= (\d+)", text)[1]))
    (shortest,) = stated
    load_config(GPU_CONFIGS, [f"sched.epochs={shortest}"])
    with pytest.raises(ConfigError, match="is not shorter than sched.epochs"):
        load_config(GPU_CONFIGS, [f"sched.epochs={shortest - 1}"])
    load_config(GPU_CONFIGS, ["sched.epochs=1", "sched.warmup_epochs=0.2"])  # the doc's way to one epoch
