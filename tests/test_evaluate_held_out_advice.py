"""evaluate.py's refusal of a val split that is the checkpoint's training split advises the checkpoint's recorded
val split only where that split is held out: a run validated on its train file (by name, a link to it or a copy of
it) gets no advice to score that file again."""
import dataclasses
import filecmp
import hashlib
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import evaluate
from configs import ConfigError
from configs.schema import DataConfig


@pytest.fixture
def tokens(tmp_path):
    """DataConfig of token files train.bin, val.bin, copy.bin (a link to train.bin), hard.bin (a hard link to it)
    and dup.bin (a byte copy of it) under tmp_path."""
    for offset, name in enumerate(("train", "val")):  # two texts: a copy of train.bin is refused too
        np.arange(offset, 64 + offset, dtype=np.uint16).tofile(tmp_path / f"{name}.bin")
    os.symlink(tmp_path / "train.bin", tmp_path / "copy.bin")
    os.link(tmp_path / "train.bin", tmp_path / "hard.bin")
    shutil.copyfile(tmp_path / "train.bin", tmp_path / "dup.bin")
    return DataConfig(dataset="tokens", root=str(tmp_path))


def refusal(trained: DataConfig, val_split: str, fingerprint=None) -> str:
    with pytest.raises(ConfigError) as e:
        evaluate.check_not_trained_on(trained, dataclasses.replace(trained, val_split=val_split), "run.pt",
                                      fingerprint)
    return str(e.value)


def test_a_held_out_recorded_val_split_is_advised(tokens):
    assert refusal(tokens, "train").endswith("; score its held-out split (data.val_split=val)")


@pytest.mark.parametrize("recorded", ["train", "copy", "hard", "dup"])
def test_a_recorded_val_split_that_is_the_train_file_is_not_advised(tokens, recorded):
    """A run trained on train.bin and validated on train.bin (or copy.bin, hard.bin: the same file, or dup.bin: its
    text): scoring any of them is refused, and the advice names no split that holds train.bin's text."""
    trained = dataclasses.replace(tokens, val_split=recorded)
    assert filecmp.cmp(os.path.join(tokens.root, f"{recorded}.bin"), os.path.join(tokens.root, "train.bin"),
                       shallow=False)
    for asked in ("train", "copy", "hard", "dup"):
        line = refusal(trained, asked)
        assert re.search(rf"; it was validated on that split too \(data.val_split={recorded}\): give data.val_split "
                         r"a split held out from its training$", line), line
        assert "held-out split (data.val_split=" not in line  # the advice of a held-out recorded split


def test_a_recorded_val_file_of_the_train_file_s_recorded_text_is_not_advised(tokens, tmp_path):
    """The run's files are gone from this machine (another data.root is scored): the checkpoint's record of them
    (data_fingerprint; here computed with hashlib) says its val file held its train file's text, so that split is not
    advised; a record of two texts advises it."""
    trained = dataclasses.replace(tokens, root=str(tmp_path / "gone"))

    def record(ids):
        blob = np.asarray(ids, dtype=np.uint16).tobytes()
        return {"bytes": len(blob), "head_sha256": hashlib.sha256(blob[:1 << 20]).hexdigest()}
    here = dataclasses.replace(trained, root=tokens.root)
    same = {"train.bin": record(range(64)), "val.bin": record(range(64))}
    assert "held-out split" not in evaluate.held_out_advice(trained, here, same)
    other = {"train.bin": record(range(64)), "val.bin": record(range(1, 65))}
    assert evaluate.held_out_advice(trained, here, other) == "score its held-out split (data.val_split=val)"


def test_a_recorded_val_split_that_reads_the_train_file_under_another_root_only_is_not_said_to_be_trained_on(tokens,
                                                                                                          tmp_path):
    """The run validated on its own val.bin (held out); under another data.root, val.bin is a copy of the run's
    train.bin: scoring it is refused, and the advice neither names that split as one to score nor says the run was
    validated on its training text."""
    other = tmp_path / "other"
    other.mkdir()
    shutil.copyfile(tmp_path / "train.bin", other / "val.bin")
    np.arange(7, 71, dtype=np.uint16).tofile(other / "train.bin")
    line = _refused_under(tokens, other)
    shutil.copyfile(tmp_path / "val.bin", other / "train.bin")  # the two files swapped: the run's val.bin is held out
    assert line == _refused_under(tokens, other)


def _refused_under(tokens, other) -> str:
    """The refusal of scoring val.bin under the root `other`, whose val.bin is a copy of the run's train.bin."""
    tmp_path = Path(tokens.root)
    assert filecmp.cmp(tmp_path / "train.bin", other / "val.bin", shallow=False)
    assert not filecmp.cmp(tmp_path / "train.bin", tmp_path / "val.bin", shallow=False)  # the run's val: held out
    with pytest.raises(ConfigError) as e:
        evaluate.check_not_trained_on(tokens, dataclasses.replace(tokens, root=str(other)), "run.pt")
    line = str(e.value)
    assert "validated on that split too" not in line and "score its held-out split" not in line, line
    assert line.endswith(f"; data.val_split=val, the split it was validated on, reads its training split under "
                         f"data.root={other}: give data.val_split a split there held out from its training"), line
    return line
