"""scripts/cd_update_memory.py's storage tracker against allocations of known size (a closed form)."""
import pytest
import torch

from cd_update_memory import LiveStorage, main  # scripts/ is on pytest's path (pyproject.toml)


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


def test_an_unknown_model_is_a_usage_error(capsys):
    """timm's refusal of a --model name exited 1; a value the flag refuses is one line with status 2, as a model
    without pairs is."""
    with pytest.raises(SystemExit) as refused:
        main(["--model", "no_such_model"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") \
        and "--model no_such_model: Unknown model" in lines[0], lines
