"""With --run, a sweep refuses a run's missing train.resume or model.pretrained file before its first run trains.

train.py refuses such a file at its own start (engine/snapshots.resume_source, models/pretrained.load_pretrained), so
a missing file in a later run of a sweep was told only after the earlier runs had trained. Checked up front: every
kept run's train.resume, and the model.pretrained of a run that starts afresh (a resumed run takes its weights from
its checkpoint and never reads it); model.pretrained=hub is no path; a path in the folder of an earlier run of the
sweep may be written by that run."""
import pytest

import sweep  # noqa: E402  (scripts/, on the path of the tests)

STAND_IN = """#!/bin/sh
# stands in for `python`: logs its script and exits 0 (the tests that reach it expect nothing to start)
echo "$1" >> "$CALLS"
exit 0
"""


def sweep_file(tmp_path, b_items: str) -> str:
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\n"
                    f"runs:\n  a: []\n  b: [{b_items}]\n")
    return str(spec)


@pytest.fixture
def launcher(tmp_path, monkeypatch):
    """(the stand-in launcher, the file it logs its calls to)."""
    path, calls = tmp_path / "launcher", tmp_path / "calls"
    path.write_text(STAND_IN)
    path.chmod(0o755)
    monkeypatch.setenv("CALLS", str(calls))
    return str(path), calls


@pytest.mark.parametrize("key, problem", [("model.pretrained", "is no such file"),
                                          ("train.resume", "is no such file"),
                                          ("model.pretrained", "is a folder")])
def test_a_later_runs_missing_input_file_is_refused_before_the_first_run_trains(tmp_path, launcher, key, problem):
    path, calls = launcher
    value = tmp_path if problem == "is a folder" else tmp_path / "weights" / "missing.pt"
    spec = sweep_file(tmp_path, f"{key}={value}")
    with pytest.raises(SystemExit) as refused:
        sweep.main([spec, "--run", "--launcher", path])
    message = str(refused.value)
    assert message.startswith(f"error: sweep run 'b': {key}={value} {problem}: give "), message
    assert "\n" not in message
    assert not calls.exists()  # run a did not train first


def test_printed_commands_are_not_checked_for_files(tmp_path, capsys):
    """Without --run the commands may be meant for another machine, whose files are not here."""
    spec = sweep_file(tmp_path, f"model.pretrained={tmp_path}/elsewhere.pt")
    assert sweep.main([spec]) == 0
    assert f"model.pretrained={tmp_path}/elsewhere.pt" in capsys.readouterr().out


def expanded(tmp_path, b_items: str, only=None) -> list[dict]:
    runs = sweep.expand(sweep_file(tmp_path, b_items), [], only)
    return [r for r in runs if only is None or r["name"] in only]


def test_what_is_not_refused(tmp_path):
    runs = tmp_path / "runs"
    # timm's hub weights, no path (of a timm name: the debug config's small variant has none, refused by the sweep)
    sweep.refuse_missing_input_files(expanded(tmp_path, "model.name=vit_tiny_patch16_224, model.pretrained=hub"))
    # a file that run a, which trains first, writes
    sweep.refuse_missing_input_files(expanded(tmp_path, f"model.pretrained={runs}/a/best.pt"))
    sweep.refuse_missing_input_files(expanded(tmp_path, f"train.resume={runs}/a/checkpoint.pt"))
    # a relative path is read from the repository root, where the commands run
    sweep.refuse_missing_input_files(expanded(tmp_path, "model.pretrained=README.md"))
    # b resumes from its own checkpoint.pt: its start weights are not read again
    (runs / "b").mkdir(parents=True)
    (runs / "b" / "checkpoint.pt").write_bytes(b"")
    sweep.refuse_missing_input_files(expanded(tmp_path, f"model.pretrained={tmp_path}/moved_away.pt"))


def test_a_file_of_a_run_that_only_leaves_out_is_refused(tmp_path):
    """--only b: run a does not run before b, so nothing writes its best.pt."""
    with pytest.raises(sweep.ConfigError, match=r"sweep run 'b': model\.pretrained=.*/a/best\.pt is no such file"):
        sweep.refuse_missing_input_files(expanded(tmp_path, f"model.pretrained={tmp_path}/runs/a/best.pt", ["b"]))


@pytest.mark.parametrize("items, problem", [
    ("data.dataset=folder, model.num_classes=2, data.root={tmp}/missing", "data.root '{tmp}/missing' does not exist"),
    ("data.dataset=tokens, model.name=gpt2_nano, model.num_classes=65, model.drop_path=0, data.root={tmp}",
     "{tmp}/train.bin not found"),
])
def test_a_later_runs_data_that_is_not_there_is_refused_before_the_first_run_trains(tmp_path, launcher, items,
                                                                                    problem):
    """A run's own data (a data-set preset: configs/sweeps/finetune.yaml's run_keys) whose data.root or token file is
    not there was told by its train.py, after the earlier runs had trained."""
    path, calls = launcher
    spec = sweep_file(tmp_path, items.format(tmp=tmp_path))
    with pytest.raises(SystemExit) as refused:
        sweep.main([spec, "--run", "--launcher", path])
    message = str(refused.value)
    assert message.startswith(f"error: sweep run 'b': {problem.format(tmp=tmp_path)}"), message
    assert "\n" not in message
    assert not calls.exists()  # run a did not train first
