"""evaluate.py's refusal of a val split that is the checkpoint's training split advises the checkpoint's recorded
val split only where that split is held out: a run validated on its train file (by name or a link to it) gets no
advice to score that file again."""
import dataclasses
import os
import re

import numpy as np
import pytest

import evaluate
from configs import ConfigError
from configs.schema import DataConfig


@pytest.fixture
def tokens(tmp_path):
    """DataConfig of token files train.bin, val.bin and copy.bin (a link to train.bin) under tmp_path."""
    for name in ("train", "val"):
        np.arange(64, dtype=np.uint16).tofile(tmp_path / f"{name}.bin")
    os.symlink(tmp_path / "train.bin", tmp_path / "copy.bin")
    return DataConfig(dataset="tokens", root=str(tmp_path))


def refusal(trained: DataConfig, val_split: str) -> str:
    with pytest.raises(ConfigError) as e:
        evaluate.check_not_trained_on(trained, dataclasses.replace(trained, val_split=val_split), "run.pt")
    return str(e.value)


def test_a_held_out_recorded_val_split_is_advised(tokens):
    assert refusal(tokens, "train").endswith("; score its held-out split (data.val_split=val)")


@pytest.mark.parametrize("recorded", ["train", "copy"])
def test_a_recorded_val_split_that_is_the_train_file_is_not_advised(tokens, recorded):
    """A run trained on train.bin and validated on train.bin (or copy.bin, the same file): scoring either is refused,
    and the advice names no split that reads train.bin."""
    trained = dataclasses.replace(tokens, val_split=recorded)
    assert os.path.samefile(os.path.join(tokens.root, f"{recorded}.bin"), os.path.join(tokens.root, "train.bin"))
    for asked in ("train", "copy"):
        line = refusal(trained, asked)
        assert re.search(rf"; it was validated on that split too \(data.val_split={recorded}\): give data.val_split "
                         r"a split held out from its training$", line), line
        assert "held-out split (data.val_split=" not in line  # the advice of a held-out recorded split
