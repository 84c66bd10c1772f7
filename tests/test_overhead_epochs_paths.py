"""scripts/overhead_epochs.py reads a relative --recipe from the working folder, as train.py reads a relative --config
(and as the script reads --out): it was read from the repository root, so `--recipe ./my.yaml` given from another
folder was "not found" though it is there, and a file of that name under the root would have been timed instead. The
runs, started in the repository root, are given its absolute path, and epochs.json records that path."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.conftest import ROOT, load_script


def test_a_relative_recipe_is_read_from_the_working_folder(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(os.path.join(ROOT, "configs", "debug", "tiny.yaml"), work / "my.yaml")
    read = []

    def stand_in(cmd, cwd):
        """train.py's reading of its --config files: each relative to the folder the command starts in."""
        configs = [os.path.realpath(os.path.join(cwd, cmd[i + 1])) for i, a in enumerate(cmd) if a == "--config"]
        read.append(configs)
        out = next(a.split("=", 1)[1] for a in cmd if a.startswith("out_dir="))
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"epoch/train_seconds": 1.0}) + "\n")
        return subprocess.CompletedProcess(cmd, 0)

    import launchers
    monkeypatch.setattr(launchers.ForwardedSignals, "run", lambda self, cmd: stand_in(cmd, cwd=self.cwd).returncode)
    monkeypatch.chdir(work)
    report = load_script("overhead_epochs").main(
        ["--recipe", "./my.yaml", "--global-batch", "16", "--batches", "8", "--models", "--methods", "baseline",
         "--epochs", "1", "--runs", "1", "--out", "ep"])
    recipe = str(work / "my.yaml")
    assert read == [[os.path.realpath(recipe)]]
    assert report["recipe"] == recipe and json.loads((work / "ep" / "epochs.json").read_text())["recipe"] == recipe


def test_a_relative_recipe_missing_from_the_working_folder_is_train_pys_error(tmp_path, monkeypatch, capsys):
    """The checkout's file of that name is not taken in its place: named in the error, as train.py names it."""
    import launchers
    monkeypatch.setattr(launchers.ForwardedSignals, "run", lambda self, cmd: pytest.fail(f"a run started: {cmd}"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as refused:
        load_script("overhead_epochs").main(["--recipe", "configs/debug/tiny.yaml", "--global-batch", "16",
                                             "--batches", "8", "--models", "--out", "ep"])
    checkout_file = os.path.join(ROOT, "configs", "debug", "tiny.yaml")
    assert str(refused.value.code).startswith("error: config file not found: configs/debug/tiny.yaml "), refused.value
    assert checkout_file in str(refused.value.code) and str(tmp_path) in str(refused.value.code)
    assert not (tmp_path / "ep").exists()


@pytest.mark.parametrize("out", ["ep #1", "ep: a", "'ep'", "*ep"])
def test_a_run_trains_in_its_run_folder_whatever_yaml_reads_in_out(out):
    """run_config handed train.py `out_dir=<--out>/runs/<run>` unquoted, and train.py reads an override's value as
    YAML: ' #' in --out was cut as a comment, ': ', a leading quote or '*' refused. The loader must read back the
    run's folder, character for character."""
    import argparse

    from configs import load_config

    epochs = load_script("overhead_epochs")
    args = argparse.Namespace(recipe=os.path.join(ROOT, "configs", "debug", "tiny.yaml"), global_batch=16, epochs=1,
                              overrides=[], out=out)
    folder = epochs.run_dir(args, "vit_nano", 8, "baseline", 0)
    configs, overrides = epochs.run_config(args, "baseline", "vit_nano", 8, 0, folder)
    assert load_config(configs, overrides).out_dir == folder
