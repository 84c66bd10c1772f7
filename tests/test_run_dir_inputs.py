"""A fresh start that archives out_dir's earlier files never moves away a file the same command reads
(model.pretrained, train.resume): it is refused with one line before anything moves, however the path reaches the
folder (relative, through a link to the folder, a link in it, a link from outside to a file in it)."""
import os

import pytest
import torch

from engine.run_dir import RunDirError, claim_run_dir
from models import build_model
from tests.conftest import run_entry

EARLIER = ("best.pt", "metrics.jsonl", "train.log")  # an earlier run's results: only archive_existing moves them


def earlier_run(out_dir) -> dict:
    """out_dir holding an earlier run's files (no checkpoint.pt); {name: bytes} as written."""
    os.makedirs(out_dir, exist_ok=True)
    written = {}
    for name in EARLIER:
        written[name] = f"earlier {name}".encode()
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(written[name])
    return written


def files(folder) -> dict:
    """{relative path: bytes, or the target of a link} of everything under `folder` but the run lock."""
    found = {}
    for root, dirs, names in os.walk(folder):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, name)
            key = os.path.relpath(path, folder)
            if os.path.islink(path):
                found[key] = "-> " + os.readlink(path)
            elif name != ".run.lock":
                with open(path, "rb") as f:
                    found[key] = f.read()
    return found


def config(pretrained: str = "", resume: str = "") -> dict:
    return {"model": {"pretrained": pretrained}, "train": {"resume": resume}}


def claim(out_dir, cfg: dict) -> None:
    with claim_run_dir(str(out_dir), cfg, archive_existing=True):
        pass


def test_weights_among_the_files_archive_would_move_are_refused_and_nothing_moves(tmp_path):
    out = tmp_path / "run"
    earlier_run(out)
    before = files(out)
    with pytest.raises(RunDirError) as refused:
        claim(out, config(pretrained=str(out / "best.pt")))
    assert str(refused.value) == (
        f"model.pretrained={out / 'best.pt'} lies in out_dir '{out}' among the files train.archive_existing=true "
        f"would move to {out}/archive/<time>/ (best.pt): use another out_dir, or move the weights out of it first")
    assert files(out) == before and not os.path.exists(out / "archive")


@pytest.mark.parametrize("setting", ["pretrained", "resume"])
def test_without_archive_existing_the_refusal_offers_no_archive_that_would_move_the_weights(tmp_path, setting):
    """Without train.archive_existing the refusal of an out_dir of earlier files offered it as the fix, and that
    command was refused in turn (the weights it reads lie among the files it moves): the refusal names the weights."""
    out = tmp_path / "run"
    earlier_run(out)
    before = files(out)
    with pytest.raises(RunDirError) as refused:
        with claim_run_dir(str(out), config(**{setting: str(out / "best.pt")}), archive_existing=False):
            pass
    assert "archive_existing=true to move" not in str(refused.value)
    assert str(refused.value).startswith(f"{'model' if setting == 'pretrained' else 'train'}.{setting}="
                                         f"{out / 'best.pt'} lies in out_dir '{out}' among the files "
                                         f"train.archive_existing=true would move")
    assert files(out) == before and not os.path.exists(out / "archive")


def test_a_relative_path_and_a_link_to_the_folder_name_the_same_file(tmp_path, monkeypatch):
    out = tmp_path / "run"
    earlier_run(out)
    os.symlink(out, tmp_path / "alias")
    before = files(out)
    monkeypatch.chdir(tmp_path)
    for given in ("run/best.pt", "alias/best.pt", "run/../run/./train.log", str(tmp_path / "alias" / "best.pt")):
        with pytest.raises(RunDirError, match=rf"^model\.pretrained={given} lies in out_dir"):
            claim(out, config(pretrained=given))
        # the folder given through its alias, relatively
        with pytest.raises(RunDirError, match=r"lies in out_dir 'alias'"):
            claim("alias", config(pretrained=given))
    assert files(out) == before


def test_links_in_or_into_the_folder_count_as_the_folders_files(tmp_path):
    """Archiving a link breaks the path as moving its target does: a link in out_dir to weights elsewhere, and a
    link elsewhere to weights in out_dir, are both refused; a link elsewhere to weights elsewhere is not."""
    out, elsewhere = tmp_path / "run", tmp_path / "weights"
    earlier_run(out)
    elsewhere.mkdir()
    (elsewhere / "w.pth").write_bytes(b"weights")
    os.symlink(elsewhere / "w.pth", out / "w.pth")  # in the folder, to a file elsewhere
    os.symlink(out / "best.pt", elsewhere / "to_best.pt")  # elsewhere, to a file in the folder
    os.symlink(out, elsewhere / "run_link")  # a folder link whose target holds a link
    before = files(out)
    for given, named in ((out / "w.pth", "w.pth"), (elsewhere / "to_best.pt", "best.pt"),
                         (elsewhere / "run_link" / "w.pth", "w.pth")):
        with pytest.raises(RunDirError, match=rf"\({named}\): use another out_dir"):
            claim(out, config(pretrained=str(given)))
    assert files(out) == before
    os.remove(out / "w.pth")
    claim(out, config(pretrained=str(elsewhere / "w.pth")))  # not in the folder: archived as ever
    assert sorted(os.listdir(out)) == ["archive"]


def test_weights_in_a_subfolder_or_a_checkpoint_to_resume_are_refused_and_the_archive_is_not_moved(tmp_path):
    out = tmp_path / "run"
    earlier_run(out)
    (out / "weights").mkdir()
    (out / "weights" / "vit.pth").write_bytes(b"weights")
    before = files(out)
    with pytest.raises(RunDirError, match=r"among the files .* \(weights\): use another out_dir, or move the weights"):
        claim(out, config(pretrained=str(out / "weights" / "vit.pth")))
    with pytest.raises(RunDirError, match=r"^train\.resume=.* \(best\.pt\): .*move the checkpoint out of it first$"):
        claim(out, config(resume=str(out / "best.pt")))
    assert files(out) == before
    # the archive stays where it is: weights of an archived run start the next one
    os.remove(out / "weights" / "vit.pth")
    os.rmdir(out / "weights")
    claim(out, config())
    (stamp,) = os.listdir(out / "archive")
    kept = out / "archive" / stamp / "best.pt"
    earlier_run(out)
    claim(out, config(pretrained=str(kept)))
    assert kept.read_bytes() == b"earlier best.pt" and len(os.listdir(out / "archive")) == 2


def test_train_py_refuses_with_one_error_line_before_moving_the_weights(tmp_path, debug_config, capsys):
    """The reported command: an earlier run's best.pt in out_dir as model.pretrained with train.archive_existing=true
    moved it to the archive, then failed with 'pretrained weights not found'."""
    out = tmp_path / "run"
    earlier = debug_config(name="first")
    os.makedirs(out)
    torch.save({"model": build_model(earlier.model).state_dict()}, out / "best.pt")
    (out / "metrics.jsonl").write_text('{"step": 2}\n')
    before = files(out)
    code, _, err = run_entry("train.py", ["--config", os.path.join("configs", "debug", "tiny.yaml"), f"out_dir={out}",
                                          f"model.pretrained={out / 'best.pt'}", "train.max_steps=1",
                                          "train.archive_existing=true"], capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith(f"error: model.pretrained={out / 'best.pt'} lies in "
                                                                 f"out_dir"), err
    assert files(out) == before
