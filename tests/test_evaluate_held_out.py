"""evaluate.py scores a folder checkpoint on images held out from its training only: neither a val split that is
its training folder nor a calibration drawn from the folder it scores."""
import dataclasses
import filecmp
import hashlib
import os
import re
import shutil

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
                                            "data.auto_augment=", "train.max_steps=2", "sched.epochs=2",
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
    for offset, name in enumerate(("train", "val", "test")):  # three texts: a copy of train.bin is refused too
        np.arange(offset, 64 + offset, dtype=np.uint16).tofile(tmp_path / f"{name}.bin")
    trained = dataclasses.replace(DataConfig(), dataset="tokens", root=str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^data.val_split=train: "
                                          rf"{re.escape(os.path.realpath(tmp_path / 'train.bin'))} is "
                                          r"the train split run.pt was trained on .*of text it was trained on"):
        evaluate.check_not_trained_on(trained, dataclasses.replace(trained, val_split="train"), "run.pt")
    evaluate.check_not_trained_on(trained, dataclasses.replace(trained, val_split="test"), "run.pt")


@pytest.mark.parametrize("made, how", [(os.link, "is the"),
                                       (shutil.copyfile, r"is a copy of the")])
def test_a_hard_link_or_a_copy_of_the_training_token_file_is_refused_as_the_val_split(tmp_path, made, how):
    """A hard link to train.bin (its own resolved path) and a byte copy of it (another file) hold the text the model
    was trained on (filecmp): refused like train.bin itself; val.bin, other text of the same size, is scored."""
    for name, seed in (("train", 0), ("val", 1)):
        np.random.default_rng(seed).integers(0, 65, 64).astype(np.uint16).tofile(tmp_path / f"{name}.bin")
    made(tmp_path / "train.bin", tmp_path / "same.bin")
    assert filecmp.cmp(tmp_path / "train.bin", tmp_path / "same.bin", shallow=False)
    trained = dataclasses.replace(DataConfig(), dataset="tokens", root=str(tmp_path))
    same = re.escape(os.path.realpath(tmp_path / "same.bin"))
    with pytest.raises(ConfigError, match=rf"^data.val_split=same: {same} {how} train split run.pt was trained on "
                                          r".*of text it was trained on; score its held-out split "
                                          r"\(data.val_split=val\)$"):
        evaluate.check_not_trained_on(trained, dataclasses.replace(trained, val_split="same"), "run.pt")
    evaluate.check_not_trained_on(trained, trained, "run.pt")


def test_a_copy_of_the_training_token_file_is_refused_by_the_checkpoint_s_record_when_the_file_is_gone(tmp_path):
    """The checkpoint trained on <there>/train.bin, gone from this machine; <here>/copy.bin holds its text: the
    record of the file in the checkpoint (data_fingerprint: its size and the SHA-256 of its first MiB, computed
    here with hashlib) tells it, through evaluate.py's command line; <here>/val.bin, other text, is scored."""
    there, here = tmp_path / "there", tmp_path / "here"
    here.mkdir()
    rng = np.random.default_rng(0)
    ids = {"train": rng.integers(0, 65, 20_000).astype(np.uint16), "val": rng.integers(0, 65, 4_000).astype(np.uint16)}
    ids["train"].tofile(here / "copy.bin")
    ids["val"].tofile(here / "val.bin")
    trained = dataclasses.replace(DataConfig(), dataset="tokens", root=str(there))
    blob = ids["train"].tobytes()
    recorded = {"train.bin": {"bytes": len(blob), "head_sha256": hashlib.sha256(blob[:1 << 20]).hexdigest()}}
    data = dataclasses.replace(trained, root=str(here), val_split="copy")
    with pytest.raises(ConfigError, match=r"^data.val_split=copy: .*copy.bin is a copy "
                                          r"of the train split run.pt was trained on"):
        evaluate.check_not_trained_on(trained, data, "run.pt", recorded)
    evaluate.check_not_trained_on(trained, data, "run.pt")  # without the record nothing tells it: scored
    evaluate.check_not_trained_on(trained, dataclasses.replace(data, val_split="val"), "run.pt", recorded)
    # the same through evaluate.py: a run trained on there/, whose train.bin is then deleted
    there.mkdir()
    ids["train"].tofile(there / "train.bin")
    ids["val"].tofile(there / "val.bin")
    train.main(load_config(["configs/lm/kjv_nano.yaml"], [f"out_dir={tmp_path / 'run'}", "data.dataset=tokens",
                                                          f"data.root={there}", "train.max_steps=1"]))
    (there / "train.bin").unlink()
    out = tmp_path / "e.json"
    with pytest.raises(ConfigError, match=r"^data.val_split=copy: .*copy.bin is a copy "
                                          r"of the train split .*best.pt was trained on"):
        evaluate.main(evaluate.parse_args(["--checkpoint", str(tmp_path / "run" / "best.pt"), "--quant", "rtn",
                                           f"data.root={here}", "data.val_split=copy", "--out", str(out)]))
    assert not out.exists()


def test_a_file_of_the_training_file_s_size_and_first_mib_is_scored_beside_it_and_refused_by_the_record_alone(
        tmp_path):
    """Files over a MiB. there/train.bin trained run.pt; here/held.bin has its size and first MiB (what the
    checkpoint's record hashes, computed here with hashlib) but other ids after it (the bytes read back differ): with
    train.bin on this machine the two are compared in full and held.bin is scored (it was refused as a copy); a byte
    copy of train.bin is refused. With train.bin gone, the record alone cannot tell a copy from held.bin: it is
    refused for what the record holds (its first MiB at least is training text), not called a copy, and a recorded
    val split of the same size and first MiB is not advised."""
    there, here = tmp_path / "there", tmp_path / "here"
    there.mkdir(), here.mkdir()
    rng = np.random.default_rng(0)
    head = rng.integers(0, 65, 1 << 19).astype(np.uint16)  # exactly 1 MiB
    np.concatenate([head, rng.integers(0, 65, 100_000).astype(np.uint16)]).tofile(there / "train.bin")
    np.concatenate([head, rng.integers(0, 65, 100_000).astype(np.uint16)]).tofile(here / "held.bin")
    shutil.copyfile(there / "train.bin", here / "copy.bin")
    blob, held = (there / "train.bin").read_bytes(), (here / "held.bin").read_bytes()
    assert len(blob) == len(held) > 1 << 20 and blob[:1 << 20] == held[:1 << 20] and blob != held
    record = {"bytes": len(blob), "head_sha256": hashlib.sha256(blob[:1 << 20]).hexdigest()}
    trained = dataclasses.replace(DataConfig(), dataset="tokens", root=str(there))
    data = dataclasses.replace(trained, root=str(here), val_split="held")
    evaluate.check_not_trained_on(trained, data, "run.pt", {"train.bin": record})
    with pytest.raises(ConfigError, match=r"^data.val_split=copy: .*copy.bin is a copy of the train split run.pt was "
                                          r"trained on"):
        evaluate.check_not_trained_on(trained, dataclasses.replace(data, val_split="copy"), "run.pt",
                                      {"train.bin": record})
    (there / "train.bin").unlink()
    with pytest.raises(ConfigError, match=rf"^data.val_split=held: {re.escape(os.path.realpath(here / 'held.bin'))} "
                                          r"has the size and first MiB of the train token file run.pt was trained on, "
                                          r"as the checkpoint recorded them, so its first MiB at least is text it was "
                                          r"trained on .*; score its held-out split \(data.val_split=val\), or put the "
                                          rf"training file back as {re.escape(str(here / 'train.bin'))} to compare "
                                          r"them in full$"):
        evaluate.check_not_trained_on(trained, data, "run.pt", {"train.bin": record})
    advice = evaluate.held_out_advice(trained, data, {"train.bin": record, "val.bin": record})
    assert advice.startswith("it was validated on a split of its train file's size and first MiB"), advice


@pytest.mark.parametrize("made", [os.link, shutil.copyfile])
def test_a_training_token_file_that_is_a_hard_link_or_a_copy_of_the_scored_one_is_refused(tmp_path, made):
    """data.train_split naming a hard link to, or a byte copy of, the scored val.bin drew GPTQ's calibration windows
    from the scored text: refused before any pass."""
    root = tmp_path / "tokens"
    root.mkdir()
    for name, n in (("train", 20_000), ("val", 4_000)):
        np.random.default_rng(n).integers(0, 65, n).astype(np.uint16).tofile(root / f"{name}.bin")
    train.main(load_config(["configs/lm/kjv_nano.yaml"], [f"out_dir={tmp_path / 'run'}", "data.dataset=tokens",
                                                          f"data.root={root}", "train.max_steps=1"]))
    made(root / "val.bin", root / "calib.bin")
    out = tmp_path / "e.json"
    with pytest.raises(ConfigError, match=r"^data.train_split=calib: .*calib.bin is (a copy of )?the val split that "
                                          r"is scored \(data.val_split=val\), so gptq would calibrate"):
        evaluate.main(evaluate.parse_args(["--checkpoint", str(tmp_path / "run" / "best.pt"), "--quant", "gptq",
                                           "data.train_split=calib", "quant.calib_images=4", "--out", str(out)]))
    assert not out.exists()


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
                                          rf"that is scored \(data.val_split=val\), so {', '.join(pipelines)} "
                                          rf"would calibrate \(or "
                                          rf"train\) on the images it scores"):
        evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", *pipelines,
                                           f"data.train_split={split}", "--out", str(out)]))
    assert not out.exists() and not (tmp_path / "eval.log").exists()
    # the training split by another name is drawn from; a pipeline that draws nothing (rtn) reads no split
    assert resolve(checkpoint, "--quant", "percentile", f"data.train_split={root}/train").data.train_split
    with pytest.raises(ConfigError, match=r"^data.train_split=val would be ignored: no pipeline"):
        resolve(checkpoint, "--quant", "rtn", "data.train_split=val")


def linked_classes(folder, root, of_split, linked=("b",)) -> None:
    """`folder` with the classes of CLASSES: those in `linked` links to the class folders of root/`of_split`, the
    others held-out images of their own."""
    make_folder(folder.parent, {folder.name: {name: n for name, n in CLASSES.items() if name not in linked}})
    for name in linked:
        os.symlink(os.path.join(root, of_split, name), folder / name)


def test_a_val_split_with_a_class_folder_of_the_training_split_is_refused_naming_that_folder(folder_run, tmp_path):
    """A val folder whose class folder b is the training split's (val2/b -> train/b) scores the images of b the
    checkpoint trained on: refused, the error naming that folder under both its names, not calling the folder a copy
    of the training split (its other classes are held out)."""
    checkpoint, root = folder_run
    linked_classes(tmp_path / "val2", root, "train")
    train_b = os.path.join(os.path.realpath(os.path.join(root, "train")), "b")
    with pytest.raises(ConfigError) as refused:
        resolve(checkpoint, "--quant", f"data.val_split={tmp_path / 'val2'}")
    message = str(refused.value)
    assert "1 class folder(s) in common" in message and f"{tmp_path / 'val2' / 'b'} is {train_b}" in message
    assert "copy" not in message and message.endswith("score its held-out split (data.val_split=val)")


def test_a_training_split_with_a_class_folder_of_the_scored_val_split_is_refused_naming_that_folder(folder_run,
                                                                                                  tmp_path):
    """The calibration drawn from a folder whose class folder a is the scored val split's (calib/a -> val/a)
    would calibrate on images it then scores: refused, naming the shared folder, not calling the split a copy."""
    checkpoint, root = folder_run
    linked_classes(tmp_path / "calib", root, "val", linked=("a",))
    with pytest.raises(ConfigError) as refused:
        resolve(checkpoint, "--quant", "percentile", f"data.train_split={tmp_path / 'calib'}")
    message = str(refused.value)
    assert message.startswith(f"data.train_split={tmp_path / 'calib'}: it and the val split that is scored")
    assert "1 class folder(s) in common" in message and "copy" not in message
    assert f"{os.sep}val{os.sep}a is {tmp_path / 'calib' / 'a'})" in message
