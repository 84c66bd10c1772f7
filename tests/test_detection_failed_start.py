"""What a train_detection.py run that fails inside runner.train() leaves in its work dir: before its first
checkpoint, nothing that refuses the corrected command (the settings file and config dump it wrote are removed,
files that were there before it stay); after a checkpoint, everything, for --resume. The failure is injected into
MMEngine's Runner.train, so no step runs and mmcv's compiled ops are stood in (cd.families.import_mmdet_swin):
part of the default suite."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("mmdet")

from detection_runs import SAMPLE_CONFIG  # noqa: E402

SETTINGS = "train_detection_config.json"
DUMP = os.path.basename(SAMPLE_CONFIG)  # MMEngine's config dump: the first --config's name


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from cd.families import import_mmdet_swin
    from data.coco_sample import write_coco_sample
    import_mmdet_swin()
    path = str(tmp_path_factory.mktemp("coco") / "sample")
    write_coco_sample(path, train=4, val=2, size=64, seed=0)
    return path


def start(root, work, monkeypatch, train, *overrides):
    """train_detection.main with MMEngine's Runner.train replaced by `train(runner)`."""
    from mmengine.runner import Runner
    from tests.conftest import load_script
    monkeypatch.setattr(Runner, "train", train)
    return load_script("train_detection").main(["--config", SAMPLE_CONFIG, "--data-root", root, "--work-dir",
                                                str(work), *overrides])


def out_of_memory(runner):
    raise RuntimeError("CUDA out of memory")


def checkpoint_then_out_of_memory(runner):
    """A first epoch saved as MMEngine saves it (epoch_1.pth, then last_checkpoint pointing at it), then a
    failure in the second."""
    path = os.path.join(runner.work_dir, "epoch_1.pth")
    with open(path, "wb") as f:
        f.write(b"weights")
    with open(os.path.join(runner.work_dir, "last_checkpoint"), "w") as f:
        f.write(path)
    out_of_memory(runner)


@pytest.mark.slow
def test_a_failure_before_the_first_checkpoint_leaves_nothing_that_refuses_the_corrected_command(
        root, tmp_path, monkeypatch):
    """The settings file stayed: the corrected command, with other settings, was refused ("move the file
    away") in the work dir that holds no checkpoint of any run."""
    work = tmp_path / "work"
    with pytest.raises(RuntimeError, match="out of memory"):
        start(root, work, monkeypatch, out_of_memory, "train_cfg.max_epochs=3")
    assert not (work / SETTINGS).exists() and not (work / DUMP).exists()
    assert start(root, work, monkeypatch, lambda runner: None, "train_cfg.max_epochs=2") == 0
    assert json.loads((work / SETTINGS).read_text())["train_cfg.max_epochs"] == "2"


@pytest.mark.slow
def test_a_failure_after_a_checkpoint_keeps_the_run_s_files(root, tmp_path, monkeypatch):
    work = tmp_path / "work"
    with pytest.raises(RuntimeError, match="out of memory"):
        start(root, work, monkeypatch, checkpoint_then_out_of_memory, "train_cfg.max_epochs=3")
    assert json.loads((work / SETTINGS).read_text())["train_cfg.max_epochs"] == "3"
    assert (work / DUMP).is_file() and (work / "epoch_1.pth").is_file()


@pytest.mark.slow
def test_a_failed_start_keeps_the_files_that_were_there_before_it(root, tmp_path, monkeypatch):
    """The same run started again over an earlier start's settings file and dump (kept: same settings) did not
    write them, so its failure leaves them as they were."""
    work = tmp_path / "work"
    assert start(root, work, monkeypatch, lambda runner: None) == 0  # an earlier start, no checkpoint
    before = {name: (work / name).read_bytes() for name in (SETTINGS, DUMP)}
    with pytest.raises(RuntimeError, match="out of memory"):
        start(root, work, monkeypatch, out_of_memory)
    assert {name: (work / name).read_bytes() for name in (SETTINGS, DUMP)} == before
