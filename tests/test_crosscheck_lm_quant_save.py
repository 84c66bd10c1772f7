"""scripts/crosscheck_lm_quant.py writes its float model (<out>.lm.pt) whole or not at all, as the other scripts write
their outputs (engine/run_dir.write_whole): an interrupted save leaves no torn file that would refuse the re-run, with
--overwrite the earlier file stays until the new one is whole, and without --overwrite a file another command wrote
meanwhile is kept."""
import argparse
import os

import pytest
import torch

import crosscheck_lm_quant as xc
from models.gpt import build_gpt

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
