"""evaluate.py scores a folder checkpoint on images held out from its training only: neither a val split that is
its training folder nor a calibration drawn from the folder it scores."""
import dataclasses
import os
import re

import numpy as np
import pytest

import evaluate
import train
from configs import ConfigError, load_config
from configs.schema import DataConfig
from tests.conftest import DEBUG_CONFIG, make_folder

CLASSES = {"a": 4, "b": 4, "c": 4, "d": 4}


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """(best.pt of a vit_nano trained 2 updates on root/train, root): root holds train/ and val/ of 4 classes."""
    root = tmp_path_factory.mktemp("data")
    make_folder(root, {"train": CLASSES, "val": CLASSES})
    out = tmp_path_factory.mktemp("run")
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={out}", "data.dataset=folder", f"data.root={root}",
                                            "data.auto_augment=", "train.max_steps=2", "sched.epochs=1",
                                            "sched.warmup_epochs=0", "log.tensorboard=false"]))
    return str(out / "best.pt"), str(root)


def resolve(checkpoint, *overrides):
    return evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, *overrides]))[0]


@pytest.mark.parametrize("split", ["train", "./train/", "{root}/train", "linked"])
def test_a_val_split_that_is_the_checkpoints_training_folder_is_refused(folder_run, tmp_path, split):
    """data.val_split=train scored the 16 images the checkpoint was trained on as its validation accuracy; so did
    any name of that folder (a path, a link to it)."""
    checkpoint, root = folder_run
    if split == "linked":
        os.symlink(os.path.join(root, "train"), tmp_path / "linked")
        split = str(tmp_path / "linked")
    split = split.format(root=root)
    out = tmp_path / "e.json"
    with pytest.raises(ConfigError, match=rf"^data.val_split={re.escape(split)}: "
                                          rf"{re.escape(os.path.realpath(os.path.join(root, 'train')))} is the train "
                                          rf"split {re.escape(checkpoint)} was trained on .*images it was trained on; "
                                          rf"score its held-out split \(data.val_split=val\)$"):
        evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "percentile",
                                           "quant.calib_images=8", f"data.val_split={split}", "--out", str(out)]))
    assert not out.exists()


def test_the_training_split_of_a_copy_of_its_data_set_is_refused_and_a_held_out_split_is_scored(folder_run,
                                                                                               tmp_path):
    """Under another data.root (the data set copied to this machine) the split of the recorded training name is the
    training images again; that root's val split, or a held-out folder beside the recorded val one, is scored."""
    checkpoint, root = folder_run
    copy = tmp_path / "copy"
    make_folder(copy, {"train": CLASSES, "val": CLASSES, "test": CLASSES})
    with pytest.raises(ConfigError, match=r"^data.val_split=train: .* is the train split .*images it was trained on"):
        resolve(checkpoint, f"data.root={copy}", "data.val_split=train")
    assert resolve(checkpoint, f"data.root={copy}").data.val_split == "val"
    assert resolve(checkpoint, f"data.root={copy}", "data.val_split=test").data.val_split == "test"
    make_folder(tmp_path / "holdout", {"val": CLASSES})
    result = evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", f"data.root={tmp_path}",
                                                "data.val_split=holdout/val", "--out", str(tmp_path / "e.json")]))
    assert result["images"] == 16 and result["data"]["val_split"] == "holdout/val"


def test_a_token_checkpoint_is_not_scored_on_its_training_token_file(tmp_path):
    """The same rule for token files: <root>/train.bin as the val split is the text the model was trained on; another
    file beside it is scored."""
    for name in ("train", "val", "test"):
        np.arange(64, dtype=np.uint16).tofile(tmp_path / f"{name}.bin")
    trained = dataclasses.replace(DataConfig(), dataset="tokens", root=str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^data.val_split=train: {re.escape(os.path.realpath(tmp_path / 'train.bin'))} is "
                                          r"the train split run.pt was trained on .*of text it was trained on"):
        evaluate.check_not_trained_on(trained, dataclasses.replace(trained, val_split="train"), "run.pt")
    evaluate.check_not_trained_on(trained, dataclasses.replace(trained, val_split="test"), "run.pt")


@pytest.mark.parametrize("pipelines, split", [(["percentile"], "val"), (["repq", "gplq"], "{root}/val/"),
                                              (["aphq"], "./val")])
def test_a_training_split_that_is_the_scored_val_split_is_refused_before_any_pass(folder_run, tmp_path, pipelines,
                                                                                 split):
    """data.train_split=val drew the calibration batch (APHQ's and GPLQ's images and loader) from the 16 images that
    were then scored: refused, whatever the name of the folder, before anything is written."""
    checkpoint, root = folder_run
    split = split.format(root=root)
    out = tmp_path / "e.json"
    with pytest.raises(ConfigError, match=rf"^data.train_split={re.escape(split)}: "
                                          rf"{re.escape(os.path.realpath(os.path.join(root, 'val')))} is the val split "
                                          rf"that is scored \(data.val_split=val\), so {', '.join(pipelines)} would calibrate \(or "
                                          rf"train\) on the images that are scored"):
        evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", *pipelines,
                                           f"data.train_split={split}", "--out", str(out)]))
    assert not out.exists() and not (tmp_path / "eval.log").exists()
    # the training split by another name is drawn from; a pipeline that draws nothing (rtn) reads no split
    assert resolve(checkpoint, "--quant", "percentile", f"data.train_split={root}/train").data.train_split
    with pytest.raises(ConfigError, match=r"^data.train_split=val would be ignored: no pipeline"):
        resolve(checkpoint, "--quant", "rtn", "data.train_split=val")
