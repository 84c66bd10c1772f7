"""Fine-tuning from a checkpoint of this code base (model.pretrained=<a run's best.pt>) validates on data held out
from the training of those start weights, as evaluate.py --checkpoint scores them: a larger data.kjv_val_fraction,
another data.digits_val_fraction, or a val token file that is a copy of the start's training file is refused with one
`error:` line naming the setting and the fix, and so is text of the other kind (characters vs token ids). Whether a
split overlaps the start's training is computed here from the splits' definitions (the text's cut, sklearn's seeded
stratified split, the bytes of the files), not by the code under test."""
import filecmp
import shutil

import numpy as np
import pytest
import torch

import train
from configs import ConfigError, config_to_dict, load_config
from data.text import _kjv_text
from engine.distributed import DistInfo
from models import build_model
from tests.conftest import DEBUG_CONFIG

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
NANO = "configs/lm/kjv_nano.yaml"


def _start(path, files: list, overrides: list, **extra):
    """A run checkpoint of the model `files` + `overrides` configure, with its weights and recorded config."""
    cfg = load_config(files, overrides)
    torch.save({"model": build_model(cfg.model).state_dict(), "config": config_to_dict(cfg), **extra}, path)
    return path


def _build(files: list, overrides: list):
    return train.build_run(load_config(files, overrides), CPU, resumed=False)


@pytest.mark.parametrize("fraction", [0.3, 0.1, 0.05])
def test_a_kjv_val_tail_that_reaches_into_the_start_weights_training_text_is_refused(tmp_path, fraction):
    start = _start(tmp_path / "best.pt", [NANO], ["data.kjv_val_fraction=0.1"],
                   classes=sorted(set(_kjv_text())))
    characters = len(_kjv_text())
    trained_end = int(characters * (1 - 0.1))  # the start trained on characters [0, trained_end)
    overlap = max(0, trained_end - int(characters * (1 - fraction)))  # the fine-tune validates on [cut, end)
    overrides = [f"out_dir={tmp_path / 'run'}", f"model.pretrained={start}", f"data.kjv_val_fraction={fraction}"]
    if overlap:
        with pytest.raises(ConfigError, match=rf"^data.kjv_val_fraction={fraction}: model.pretrained=.*best.pt was "
                                              r"trained on the text before its last 0.1, .*text it was trained on; "
                                              r"give data.kjv_val_fraction=0.1 or less$"):
            _build([NANO], overrides)
    else:
        _build([NANO], overrides)  # held out: the fine-tune trains


@pytest.mark.parametrize("fraction", [0.3, 0.2, 0.1])
def test_another_digits_val_fraction_than_the_start_weights_is_refused(tmp_path, fraction):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    common = ["data.dataset=digits", "model.num_classes=10"]
    start = _start(tmp_path / "best.pt", [DEBUG_CONFIG], [*common, "data.digits_val_fraction=0.2"],
                   classes=[str(i) for i in range(10)])
    digits = load_digits()
    split = lambda f: train_test_split(np.arange(len(digits.target)), test_size=f,  # noqa: E731
                                       stratify=digits.target, random_state=0)
    overlap = set(split(0.2)[0]) & set(split(fraction)[1])  # start's training images among the fine-tune's val
    overrides = [*common, f"out_dir={tmp_path / 'run'}", f"model.pretrained={start}",
                 f"data.digits_val_fraction={fraction}"]
    if overlap:
        with pytest.raises(ConfigError, match=rf"^data.digits_val_fraction={fraction}: {len(overlap)} of its val "
                                              r"images are among the digits model.pretrained=.*best.pt was trained "
                                              r"on \(outside a val fraction of 0.2\), .*images it was trained on; "
                                              r"give data.digits_val_fraction=0.2$"):
            _build([DEBUG_CONFIG], overrides)
    else:
        _build([DEBUG_CONFIG], overrides)


def test_a_val_token_file_that_copies_the_start_weights_training_file_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    for name in ("train", "val"):
        rng.integers(0, 65, 8192).astype(np.uint16).tofile(first / f"{name}.bin")
    rng.integers(0, 65, 8192).astype(np.uint16).tofile(second / "train.bin")
    shutil.copyfile(first / "train.bin", second / "val.bin")  # the start's training text, under another root
    assert filecmp.cmp(first / "train.bin", second / "val.bin", shallow=False)
    start = _start(tmp_path / "best.pt", [NANO], ["data.dataset=tokens", f"data.root={first}"])
    overrides = ["data.dataset=tokens", f"out_dir={tmp_path / 'run'}", f"model.pretrained={start}"]
    with pytest.raises(ConfigError, match=r"^data.val_split=val: .*second/val.bin is a copy of the train split "
                                          r"model.pretrained=.*best.pt was trained on .*text it was trained on"):
        _build([NANO], [*overrides, f"data.root={second}"])
    assert not filecmp.cmp(first / "train.bin", first / "val.bin", shallow=False)
    _build([NANO], [*overrides, f"data.root={first}"])  # its own held-out file: the fine-tune trains


@pytest.mark.parametrize("trained, given", [("kjv", "tokens"), ("tokens", "kjv")])
def test_fine_tuning_on_the_other_kind_of_text_is_refused(tmp_path, trained, given):
    rng = np.random.default_rng(1)
    for name in ("train", "val"):
        rng.integers(0, 65, 8192).astype(np.uint16).tofile(tmp_path / f"{name}.bin")
    root = lambda dataset: [f"data.root={tmp_path}"] if dataset == "tokens" else []  # noqa: E731
    start = _start(tmp_path / "best.pt", [NANO], [f"data.dataset={trained}", *root(trained)],
                   **({"classes": sorted(set(_kjv_text()))} if trained == "kjv" else {}))
    kinds = {"kjv": "characters", "tokens": "token ids"}
    with pytest.raises(ConfigError, match=rf"^data.dataset={given}: model.pretrained=.*best.pt was trained on "
                                          rf"{kinds[trained]} \(data.dataset={trained}\), this run's text is "
                                          rf"{kinds[given]} .*fine-tune it on data.dataset={trained}, or train from "
                                          r"scratch \(without model.pretrained\)$"):
        _build([NANO], [f"data.dataset={given}", *root(given), f"out_dir={tmp_path / 'run'}",
                        f"model.pretrained={start}"])


@pytest.mark.parametrize("layout", ["nanogpt", "weights", "safetensors"])
def test_fine_tuning_on_kjv_from_weights_that_record_no_characters_is_refused(tmp_path, layout):
    """A nanoGPT ckpt.pt of another 65-symbol text (shakespeare_char), a bare state dict or a safetensors file fits
    gpt2_nano of 65 ids, but its id i names a symbol it does not record: trained on kjv it would be read as the i-th
    character of the Bible. A train.py checkpoint that records kjv's characters fine-tunes."""
    from safetensors.torch import save_file
    weights = build_model(load_config([NANO], []).model).state_dict()
    path = tmp_path / ("w.safetensors" if layout == "safetensors" else "w.pt")
    if layout == "safetensors":
        save_file({k: v.contiguous() for k, v in weights.items() if k != "head.weight"}, path)
    else:
        torch.save({"model": weights, "model_args": {"n_layer": 2, "vocab_size": 65}, "iter_num": 5000,
                    "config": {"dataset": "shakespeare_char"}} if layout == "nanogpt" else weights, path)
    with pytest.raises(ConfigError, match=r"^data.dataset=kjv: model.pretrained=.*records no vocabulary .*fine-tune a "
                                          r"train.py checkpoint trained on data.dataset=kjv, or train from scratch"):
        _build([NANO], [f"out_dir={tmp_path / 'run'}", f"model.pretrained={path}"])
    start = _start(tmp_path / "best.pt", [NANO], [], classes=sorted(set(_kjv_text())))
    _build([NANO], [f"out_dir={tmp_path / 'run'}", f"model.pretrained={start}"])  # its characters recorded: trains
