"""A checkpoint torch cannot read (cut short, emptied) and --ema on a run trained without EMA are each refused in
one `error:` line that names the file and ends with what to do, by evaluate.py and scripts/mechanism.py alike (they
share the reader and the float-model loader). The unreadable file's line was torch's whole zip-reader text (some 300
characters of generic advice) and no fix; the --ema line named the cause only."""
import pytest
import torch

import mechanism
from engine.checkpoint import CheckpointError, load_checkpoint
from tests.conftest import run_entry
from tests.test_mechanism import make_checkpoint

FIX = "; copy it again from the run, or give the run's other checkpoint (checkpoint.pt / best.pt)"
EMA_FIX = "(it was trained without train.ema=true); drop --ema to score its raw weights"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "best.pt")


def cut(checkpoint: str, folder, size: int) -> str:
    """The first `size` bytes of `checkpoint` as a file of its own (a copy that did not finish)."""
    with open(checkpoint, "rb") as f:
        head = f.read(size)
    path = folder / "trunc.pt"
    path.write_bytes(head)
    return str(path)


def first_sentence(path: str) -> str:
    """What torch itself says first about the file: its message up to the first '. ' or line end, else the
    error's type (an empty file's EOFError says nothing)."""
    with pytest.raises(Exception) as e:
        torch.load(path, map_location="cpu", weights_only=True)
    text = str(e.value).strip()
    if not text:
        return type(e.value).__name__
    return text.splitlines()[0].split(". ")[0].rstrip(".")


@pytest.mark.parametrize("size", [0, 2, 100, 100000, -1])
def test_a_cut_short_checkpoint_is_one_line_with_torchs_first_sentence_and_the_fix(checkpoint, tmp_path, size):
    """Cut at 0 bytes (EOFError), inside the zip's header ('PK': torch's weights_only page of several lines),
    and before the central directory (the miniz text); the size is the file's."""
    path = cut(checkpoint, tmp_path, size if size >= 0 else len(open(checkpoint, "rb").read()) + size)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    message, reason = str(e.value), first_sentence(path)
    assert "\n" not in message and "miniz" not in message and "weights_only" not in message, message
    assert message.startswith(f"cannot read checkpoint {path} ({tmp_path.joinpath('trunc.pt').stat().st_size} "
                              f"bytes): {reason}; a file cut short"), message
    assert message.endswith(FIX), message


def test_a_caller_reading_a_file_of_its_own_names_its_own_fix(checkpoint, tmp_path):
    path = cut(checkpoint, tmp_path, 100000)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, unreadable="move the file away to start anew")
    assert str(e.value).endswith("or corrupted reads so; move the file away to start anew"), str(e.value)


def test_evaluate_and_mechanism_refuse_a_cut_short_checkpoint_with_the_fix(checkpoint, tmp_path, capsys):
    path = cut(checkpoint, tmp_path, 100000)
    code, _, err = run_entry("evaluate.py", ["--checkpoint", path, "--quant", "--out", str(tmp_path / "r.json")],
                             capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"error: cannot read checkpoint {path} "), lines
    assert lines[0].endswith(FIX) and not (tmp_path / "r.json").exists(), lines
    assert mechanism.cli(["energies", "--checkpoint", path, "--out", str(tmp_path / "o")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot read checkpoint") and lines[0].endswith(FIX), lines


def test_ema_of_a_run_without_ema_names_dropping_ema(checkpoint, tmp_path, capsys):
    """evaluate.py's float-model loader refuses it; scripts/mechanism.py's --ema reaches the same refusal."""
    code, _, err = run_entry("evaluate.py", ["--checkpoint", checkpoint, "--ema", "--out", str(tmp_path / "r.json")],
                             capsys)
    lines = err.strip().splitlines()
    assert code == 1 and lines[-1] == f"error: {checkpoint} has no 'model_ema' weights {EMA_FIX}", lines[-3:]
    assert mechanism.cli(["energies", "--checkpoint", checkpoint, "--ema", "--out", str(tmp_path / "o")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == f"error: {checkpoint} has no 'model_ema' weights {EMA_FIX}", lines[-3:]


def test_a_cut_short_gplq_stage1_file_is_refused_with_the_fix_for_that_file(checkpoint, tmp_path):
    """GPLQ's stage-1 file is the evaluation's own resume file: no run holds another copy of it, so the fix is to
    move it away, not the run's other checkpoint."""
    from types import SimpleNamespace

    from quant.gplq.pipeline import check_stage1_checkpoint
    path = cut(checkpoint, tmp_path, 100000)
    data = SimpleNamespace(work_path=lambda suffix: path)
    with pytest.raises(CheckpointError) as e:
        check_stage1_checkpoint(None, "w4a4", None, data)
    assert str(e.value).endswith("reads so; move the file away to start stage 1 anew"), str(e.value)


def test_dose_report_names_the_fix_for_a_runs_own_cut_short_best_pt(checkpoint, tmp_path):
    """dose_report reads each run's best.pt: giving checkpoint.pt instead is no fix there."""
    import dose_report
    run = tmp_path / "run"
    run.mkdir()
    cut(checkpoint, run, 100000)
    (run / "trunc.pt").rename(run / "best.pt")
    with pytest.raises(CheckpointError) as e:
        dose_report.run_config(dose_report.Run("p", 0, str(run), {}, {}, []))
    assert str(e.value).endswith("reads so; copy the run's folder again from where it trained, or train the run "
                                 "again"), str(e.value)
