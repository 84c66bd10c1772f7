"""GPLQ's stage-1 checkpoint of a classifier records the training data it trained on: its split's name and transform,
and (a folder data set) its files, as a result entry records them (engine/quant_settings.py train_folder_fingerprint).
It recorded the name only, so that the split exported again under its path (other images) resumed the stage 1 of the
images before; it is refused now. A checkpoint written before the files were recorded is taken as of the files the
split holds now, as a result entry without them is (and as a detector's stage-1 folder without its annotations')."""
import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

import evaluate
from configs import Config
from conftest import make_folder
from engine.checkpoint import CheckpointError
from quant import PIPELINES
from quant.gplq.pipeline import check_stage1_checkpoint, stage1_identity
from quant.spec import parse_bits
from quant_models import tiny_vit

BITS = "w4a4"


def _config(root) -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset="folder", root=str(root)))


def _data(cfg: Config, out) -> "evaluate.PipelineData":
    return evaluate.build_pipeline_data(cfg, 32, 0, 1, str(out))


def _identity(model, cfg: Config, out) -> dict:
    return stage1_identity(model, parse_bits(BITS), PIPELINES["gplq"].Options(), _data(cfg, out))


def _checkpoint(out, identity: dict) -> None:
    """A stage-1 checkpoint at evaluate.py's path for `out` (quant/gplq/pipeline.py stage1_checkpoint) of
    `identity`."""
    torch.save({"model": {}, "config": identity}, f"{out}_gplq_{BITS}_stage1.pt")


def _check(model, cfg: Config, out) -> None:
    check_stage1_checkpoint(model, parse_bits(BITS), PIPELINES["gplq"].Options(), _data(cfg, out))


def test_a_stage1_checkpoint_of_other_images_under_the_splits_path_is_refused(tmp_path):
    root, out, model = tmp_path / "data", tmp_path / "eval", tiny_vit(depth=1)
    make_folder(root, {"train": {"a": 3, "b": 3}, "val": {"a": 1, "b": 1}})
    cfg = _config(root)
    _checkpoint(out, _identity(model, cfg, out))
    _check(model, cfg, out)  # the same images: resumed
    # the split exported again under its path: class b holds one image more
    Image.fromarray(np.zeros((20, 20, 3), dtype=np.uint8)).save(root / "train" / "b" / "3.png")
    with pytest.raises(CheckpointError, match=r"data\.train_files\.images: 6 then, 7 now.*; restore those settings, "
                                              r"or move the file away to start stage 1 anew"):
        _check(model, cfg, out)


def test_a_stage1_checkpoint_written_before_the_files_were_recorded_is_taken_as_of_the_files_now(tmp_path):
    root, out, model = tmp_path / "data", tmp_path / "eval", tiny_vit(depth=1)
    make_folder(root, {"train": {"a": 3, "b": 3}, "val": {"a": 1, "b": 1}})
    cfg = _config(root)
    identity = _identity(model, cfg, out)
    older = {**identity, "data": {k: v for k, v in identity["data"].items() if k != "train_files"}}
    _checkpoint(out, older)
    _check(model, cfg, out)
    # anything else it recorded is still compared
    _checkpoint(out, {**older, "data": {**older["data"], "split": "train_other"}})
    with pytest.raises(CheckpointError, match=r"data\.split: 'train_other' then, 'train' now"):
        _check(model, cfg, out)
