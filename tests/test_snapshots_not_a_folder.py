"""With train.keep_every_epochs > 0, an out_dir/snapshots that is not a folder (a file, a broken link) is refused when
the folder is claimed, with one error line, not at the end of the first kept epoch after that much training
(engine/run_dir.py, check_snapshots_folder)."""
import os

import pytest

import train
from engine.run_dir import RunDirError, claim_run_dir
from tests.conftest import DEBUG_CONFIG, run_entry


def config(keep_every_epochs: int) -> dict:
    return {"model": {"pretrained": ""}, "train": {"resume": "", "keep_every_epochs": keep_every_epochs}}


def refusal(out, every: int, what: str = "a file") -> str:
    return (f"{out / 'snapshots'} is {what}, where train.keep_every_epochs={every} keeps its snapshots (a folder): "
            f"move it away, or set train.keep_every_epochs=0")


@pytest.mark.parametrize("kind", ["file", "broken link"])
def test_a_resumed_run_with_no_snapshots_folder_is_refused_at_the_claim(tmp_path, kind):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"a resume point (not read by the claim)")
    if kind == "file":
        (out / "snapshots").write_text("notes")
    else:
        os.symlink(tmp_path / "gone", out / "snapshots")
    with pytest.raises(RunDirError) as refused:
        with claim_run_dir(str(out), config(keep_every_epochs=2)):
            pytest.fail("claimed a folder whose snapshots is not a folder")
    assert str(refused.value) == refusal(out, 2, "a file" if kind == "file" else "a device, a pipe or a broken link")
    assert sorted(os.listdir(out)) == ["checkpoint.pt", "snapshots"]  # nothing moved or written
    with claim_run_dir(str(out), config(keep_every_epochs=0)):  # no snapshots kept: the name is no one's business
        pass


def test_a_snapshots_folder_or_an_archived_file_is_claimed(tmp_path):
    out = tmp_path / "run"
    (out / "snapshots").mkdir(parents=True)
    (out / "checkpoint.pt").write_bytes(b"a resume point")
    with claim_run_dir(str(out), config(keep_every_epochs=1)):
        pass
    fresh = tmp_path / "fresh"  # a fresh start's archiving moves an earlier 'snapshots' file with the rest
    fresh.mkdir()
    (fresh / "snapshots").write_text("notes")
    with claim_run_dir(str(fresh), config(keep_every_epochs=1), archive_existing=True):
        assert not os.path.lexists(fresh / "snapshots")


def test_train_py_resuming_beside_a_snapshots_file_ends_before_training(tmp_path, debug_config, capsys):
    out = tmp_path / "run"  # debug_config's out_dir
    train.main(debug_config("train.max_steps=1", "log.tensorboard=false"))  # checkpoint.pt at update 1
    (out / "snapshots").write_text("notes")
    metrics = (out / "metrics.jsonl").read_bytes()
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={out}", "log.tensorboard=false",
                                          "train.keep_every_epochs=1"], capsys)
    assert code != 0 and err.strip().splitlines() == [f"error: {refusal(out, 1)}"], err
    assert (out / "metrics.jsonl").read_bytes() == metrics  # no update was trained
