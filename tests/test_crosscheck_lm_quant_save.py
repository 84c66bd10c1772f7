"""scripts/crosscheck_lm_quant.py writes its float model (<out>.lm.pt) whole or not at all, as the other scripts write
their outputs (engine/run_dir.write_whole): an interrupted save leaves no torn file that would refuse the re-run, with
--overwrite the earlier file stays until the new one is whole, and without --overwrite a file another command wrote
meanwhile is kept."""
import argparse
import json
import os

import pytest
import torch

import crosscheck_lm_quant as xc
from models.gpt import build_gpt
from test_crosscheck_lm_quant import _empty_checkouts

TEXT = torch.randint(0, 256, (2000,), generator=torch.Generator().manual_seed(0))


def arguments(tmp_path, overwrite: bool, steps: int = 1) -> argparse.Namespace:
    return argparse.Namespace(out=str(tmp_path / "res.json"), model="gpt2_nano", steps=steps, lr=1e-3, batch=2,
                              seed=0, overwrite=overwrite)


def interrupted_save(payload, f, *args, **kwargs) -> None:
    """torch.save stopped by Ctrl-C halfway: some bytes written, then KeyboardInterrupt."""
    with open(f, "wb") as out:
        out.write(b"PK\x03\x04 half a zip archive")
    raise KeyboardInterrupt


def test_an_interrupted_save_leaves_nothing_and_the_rerun_writes_the_model(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        xc.train_model(arguments(tmp_path, overwrite=False), TEXT)
    assert os.listdir(tmp_path) == []  # neither res.lm.pt nor a temporary
    monkeypatch.undo()
    model = xc.train_model(arguments(tmp_path, overwrite=False), TEXT)  # the re-run is not refused
    saved = torch.load(tmp_path / "res.lm.pt", weights_only=True)
    assert saved["settings"] == {"model": "gpt2_nano", "steps": 1, "lr": 1e-3, "batch": 2, "seed": 0}
    fresh = build_gpt("gpt2_nano", vocab_size=256)
    fresh.load_state_dict(saved["model"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert os.listdir(tmp_path) == ["res.lm.pt"]


def test_an_interrupted_save_with_overwrite_keeps_the_earlier_model(tmp_path, monkeypatch):
    xc.train_model(arguments(tmp_path, overwrite=False, steps=1), TEXT)
    before = (tmp_path / "res.lm.pt").read_bytes()
    monkeypatch.setattr(torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):  # other settings: retrained and replaced, interrupted at the save
        xc.train_model(arguments(tmp_path, overwrite=True, steps=2), TEXT)
    assert (tmp_path / "res.lm.pt").read_bytes() == before and os.listdir(tmp_path) == ["res.lm.pt"]


def test_without_overwrite_a_model_another_command_wrote_meanwhile_is_kept(tmp_path, monkeypatch):
    """Two commands given the same --out both find no res.lm.pt and train: the later save is refused with one
    error line naming the file and --overwrite, and the earlier one's file stays."""
    real_save = torch.save

    def save_after_another(payload, f, *args, **kwargs):
        (tmp_path / "res.lm.pt").write_bytes(b"the other command's model")
        real_save(payload, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_after_another)
    with pytest.raises(SystemExit) as refused:
        xc.train_model(arguments(tmp_path, overwrite=False), TEXT)
    message = str(refused.value.code)
    assert message.startswith(f"error: {tmp_path / 'res.lm.pt'} was written by another command after this one "
                              f"started") and "--overwrite" in message and "\n" not in message
    assert (tmp_path / "res.lm.pt").read_bytes() == b"the other command's model"
    assert os.listdir(tmp_path) == ["res.lm.pt"]


ANOTHERS = b'{"model": "vit_small_patch16_224", "fp": {"top1": 79.9}}\n'  # evaluate.py's JSON has "fp" too


def test_overwrite_refuses_an_out_file_the_script_did_not_write_before_training(tmp_path, monkeypatch):
    """--overwrite replaced whatever file --out named (an evaluate.py result, a table) after minutes of training:
    only a results JSON of this script's ("fp" and "setup") is replaced; another file is one error line, before
    anything is trained or written, and kept."""
    out = tmp_path / "res.json"
    out.write_bytes(ANOTHERS)
    monkeypatch.setattr(xc, "train_model", lambda *a, **k: pytest.fail("trained over another's file"))
    with pytest.raises(SystemExit) as refused:
        xc.main([*_empty_checkouts(tmp_path), "--out", str(out), "--overwrite", "--model", "gpt2_nano"])
    message = str(refused.value.code)
    assert message.startswith(f"error: {out} is not a file crosscheck_lm_quant.py wrote") and "\n" not in message
    assert out.read_bytes() == ANOTHERS and sorted(os.listdir(tmp_path)) == ["g", "res.json", "s"]


def test_overwrite_keeps_a_file_another_command_put_at_out_meanwhile_and_replaces_its_own(tmp_path):
    """The results are written at the end of the run: a file another command put at --out since the start is kept
    (one error line), one of this script's earlier runs is replaced."""
    out = tmp_path / "res.json"
    out.write_bytes(ANOTHERS)
    with pytest.raises(SystemExit) as refused:
        xc.write_results(str(out), {"fp": {"perplexity": 3.0}, "setup": {}}, overwrite=True)
    assert str(refused.value.code).startswith(f"error: {out} is not a file crosscheck_lm_quant.py wrote")
    assert out.read_bytes() == ANOTHERS
    out.write_text('{"fp": {"perplexity": 9.0}, "setup": {"steps": 1}}')
    xc.write_results(str(out), {"fp": {"perplexity": 3.0}, "setup": {}}, overwrite=True)
    assert json.loads(out.read_text()) == {"fp": {"perplexity": 3.0}, "setup": {}}
