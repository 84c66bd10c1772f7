"""scripts/cd_update_memory.py's storage tracker against allocations of known size (a closed form)."""
import torch

from cd_update_memory import LiveStorage  # scripts/ is on pytest's path (pyproject.toml)


def test_the_peak_counts_new_storages_while_alive_and_not_views_or_in_place_results():
    x = torch.ones(256)  # made outside: not counted
    tracker = LiveStorage()
    with tracker:
        a = x * 2                      # 1 KiB
        a.add_(1)                      # in place: no new storage
        view = a[:128]                 # a view: none either
        b = torch.zeros(512)           # 2 KiB: 3 KiB alive
        del a, view, b                 # freed
        c = torch.zeros(128)           # 0.5 KiB
    assert tracker.peak == 3 * 1024
    assert tracker.live == 512 and c.numel() == 128
