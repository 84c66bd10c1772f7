"""Messages that name the right thing: a JSON, weights or checkpoint file of the wrong shape is one error
naming the file; a refused train.resume file is named as such; a run stopped by train.max_steps at an
epoch's end says so and how to go on; a full disk is named as a full disk and leaves no probe file."""
import errno
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

import evaluate
import train
from engine.checkpoint import CheckpointError
from engine.eval_results import ResultsError, read_result_files
from engine.metrics import MetricLogger
from engine.run_dir import RunDirError, prepare_folder
from models import ModelError
from tests.conftest import DEBUG_CONFIG, run_entry


# a JSON object of the user's (no field of a result, or 'quant' alone) is no result of another evaluation: it was
# refused with every identity field listed as 'None in the file'
@pytest.mark.parametrize("content", [[1, 2], {"quant": [1]}, "text", {"name": "my notes", "values": [1, 2]},
                                     {"quant": {}}])
def test_a_result_json_of_another_shape_is_one_error_naming_it(checkpoint, tmp_path, content):
    out = tmp_path / "r.json"
    out.write_text(json.dumps(content))
    with pytest.raises(ResultsError, match=rf"{out} exists but is not a result file of evaluate.py"):
        evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "--out", str(out)]))
    assert json.loads(out.read_text()) == content  # untouched


@pytest.mark.parametrize("content", [[1, 2], {"model": "m", "fp": {}}, {"model": "m", "method": "CD", "fp": {},
                                                                       "max_act": {}, "quant": {"repq": 3}}])
def test_the_table_scripts_name_a_result_json_of_another_shape(tmp_path, content):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ResultsError, match=rf"{path} is not a result file of evaluate.py"):
        read_result_files([str(path)])


def test_the_table_scripts_refuse_a_result_file_given_twice(tmp_path):
    """Overlapping globs name one file twice: its row (or circle) would be drawn twice."""
    path = tmp_path / "r.json"
    path.write_text("{}")
    with pytest.raises(ResultsError, match=rf"{path} is given twice; give each result file once"):
        read_result_files([str(path), str(path)])
    with pytest.raises(ResultsError, match=r"is given twice \(as "):
        read_result_files([str(path), os.path.join(str(tmp_path), ".", "r.json")])


def test_the_table_scripts_refuse_two_files_of_one_evaluation_of_the_same_weights(tmp_path):
    """A copied result (or two --out files of one checkpoint) would be two rows or circles of one model."""
    result = {"model": "m", "method": "CD", "fp": {"top1": 90.0}, "max_act": {}, "fingerprint": "f0",
              "data": {"dataset": "digits"}, "weights": "raw", "quant": {"repq": {"w4a4": {"top1": 80.0}}}}
    paths = []
    for name, content in (("a", result), ("b", {**result, "quant": {"aphq": {"w4a4": {"top1": 85.0}}}})):
        paths.append(str(tmp_path / f"{name}.json"))
        with open(paths[-1], "w") as f:
            json.dump(content, f)
    with pytest.raises(ResultsError, match=rf"{paths[0]} and {paths[1]} hold results of the same weights "
                                           r"evaluated alike"):
        read_result_files(paths)
    for other in ({"weights": "ema"}, {"data": {"dataset": "fashion_mnist"}}, {"fingerprint": "f1"}):
        with open(paths[1], "w") as f:  # the EMA weights, other data, other weights: another result
            json.dump({**result, **other}, f)
        assert len(read_result_files(paths)) == 2


@pytest.mark.parametrize("content", [[torch.zeros(2)], {"a": "b"}, 3])
def test_a_weights_file_of_another_shape_is_one_error_naming_it(tmp_path, debug_config, content):
    path = tmp_path / "w.pth"
    torch.save(content, path)
    with pytest.raises(ModelError, match=rf"model.pretrained={path} holds no state dict"):
        train.main(debug_config(f"model.pretrained={path}"))


def test_a_checkpoint_whose_model_entry_is_not_a_state_dict_is_one_error(checkpoint, tmp_path):
    payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    payload["model"] = list(payload["model"].values())
    bad = tmp_path / "bad.pt"
    torch.save(payload, bad)
    with pytest.raises(CheckpointError, match=rf"{bad} is not a checkpoint of this code base: its 'model' entry"):
        evaluate.main(evaluate.parse_args(["--checkpoint", str(bad), "--quant"]))


@pytest.mark.parametrize("kind, says", [("json", "a JSON file"), ("log", "not a PyTorch file"),
                                         ("safetensors", "a safetensors weights file")])
def test_a_file_that_is_no_torch_file_is_named_as_what_it_is(tmp_path, kind, says):
    """A JSON, a log or a safetensors file given as a checkpoint (or copied over checkpoint.pt) is named as
    such, not with torch's unpickler advice to load it with weights_only=False."""
    from safetensors.torch import save_file

    from engine.checkpoint import load_checkpoint
    from engine.snapshots import read_training_checkpoint
    path = tmp_path / f"wrong.{kind}"
    if kind == "safetensors":
        save_file({"w": torch.zeros(2)}, str(path))
    else:
        path.write_text(json.dumps({"fp": {"top1": 1.0}}) if kind == "json" else "03:24:16 train INFO ...\n")
    with pytest.raises(CheckpointError, match=rf"^{path} is not a checkpoint of this code base: it is {says}") as e:
        load_checkpoint(str(path))
    assert "weights_only" not in str(e.value)
    payload, problem = read_training_checkpoint(str(path))
    assert payload is None and problem.startswith(f"it is {says}") and "weights_only" not in problem
    # torch's own formats still reach torch.load: the zip archive and the legacy pickle
    for legacy in (False, True):
        good = tmp_path / f"good{legacy}.pt"
        torch.save({"model": {"w": torch.zeros(1)}, "config": {}}, good, _use_new_zipfile_serialization=not legacy)
        assert set(load_checkpoint(str(good))) == {"model", "config"}


def test_a_checkpoint_of_another_training_code_with_a_model_entry_but_no_config_is_refused(tmp_path):
    """DeiT's and many other training scripts' checkpoints hold {"model": state dict, "epoch": ...} but no
    run config: a 'model' entry alone does not make a checkpoint of this code base (every reader of a run
    checkpoint takes its settings from 'config'), so it is refused naming the file and model.pretrained."""
    from engine.checkpoint import load_checkpoint

    path = tmp_path / "deit_checkpoint.pth"
    torch.save({"model": {"w": torch.zeros(2)}, "optimizer": {}, "epoch": 3}, path)
    with pytest.raises(CheckpointError, match=rf"^{path} is not a checkpoint of this code base \(no 'model'/'config' "
                                              rf"entries\); for plain weights files use model.pretrained={path}$"):
        load_checkpoint(str(path))


def test_a_folder_given_as_a_checkpoint_is_named_as_a_folder_not_as_missing(tmp_path):
    """A run's out_dir given for --checkpoint exists: "checkpoint not found" would send the user looking for it."""
    from engine.checkpoint import load_checkpoint
    with pytest.raises(CheckpointError, match=rf"^{tmp_path} is a folder, not a checkpoint file: give a file in it, "
                                              rf"e.g. {tmp_path}/best.pt or {tmp_path}/checkpoint.pt$"):
        load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("tool", ["mmengine", "othertool"])
def test_another_tools_checkpoint_is_named_as_such_not_as_a_file_cut_short(tmp_path, monkeypatch, tool):
    """An MMEngine checkpoint (meta, state_dict, message_hub of pickled HistoryBuffers) given to evaluate.py
    or copied over checkpoint.pt was 'a file cut short or corrupted', under torch's page of weights_only
    advice; it is named as what it is, an MMEngine one with the script that reads it."""
    from engine.checkpoint import load_checkpoint
    from engine.snapshots import read_training_checkpoint
    names = [tool, f"{tool}.logging", f"{tool}.logging.history_buffer"]
    for name in names:  # a module of that name holding the class, as the tool's own would
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    buffer = type("HistoryBuffer", (), {"__module__": names[-1]})  # stands for MMEngine's logger buffer
    sys.modules[names[-1]].HistoryBuffer = buffer
    path = tmp_path / "epoch_1.pth"
    torch.save({"meta": {"epoch": 1}, "state_dict": {"w": torch.zeros(1)}, "message_hub": {"loss": buffer()}},
               path)
    hint = ("it is an MMEngine checkpoint (a detector's: evaluate it with evaluate_detection.py --checkpoint)"
            if tool == "mmengine" else "give a best.pt or checkpoint.pt written by train.py, or plain weights as "
            "model.pretrained=FILE")
    says = f"it holds pickled {names[-1]}.HistoryBuffer objects, which train.py never saves; {hint}"
    with pytest.raises(CheckpointError, match=rf"^{path} is not a checkpoint of this code base: {re.escape(says)}"
                       ) as e:
        load_checkpoint(str(path))
    assert "weights_only" not in str(e.value) and "cut short" not in str(e.value)
    assert read_training_checkpoint(str(path)) == (None, says)
    # without the pickled objects (plain data only) MMEngine's entries tell it
    torch.save({"meta": {"epoch": 1}, "state_dict": {"w": torch.zeros(1)}}, path)
    with pytest.raises(CheckpointError, match=r"no 'model'/'config' entries\); it is an MMEngine checkpoint \(a "
                                              r"detector's: evaluate it with evaluate_detection.py --checkpoint\); "
                                              r"for plain weights files use model.pretrained="):
        load_checkpoint(str(path))


def test_a_refused_train_resume_file_is_named_not_the_out_dir_checkpoint(debug_config):
    other = debug_config("train.max_steps=1", "model.name=vit_micro", name="other")
    train.main(other)
    source = os.path.join(other.out_dir, "checkpoint.pt")
    with pytest.raises(CheckpointError, match=rf"^{source} was written for model .*give train.resume a "
                                              rf"checkpoint of this model"):
        train.main(debug_config(f"train.resume={source}", name="mine"))


def test_max_steps_at_an_epoch_end_is_not_called_finished(debug_config, caplog):
    cfg = debug_config("train.max_steps=4", name="m")  # 4 updates per epoch, 2 epochs
    with caplog.at_level("INFO"):
        first = train.main(cfg)
        again = train.main(debug_config("train.max_steps=4", name="m"))  # the same command once more
    assert first.reason == again.reason == "max_steps" and first.state.epoch == 1
    assert caplog.text.count("raise train.max_steps (or drop it)") == 2
    # the second process trained and wrote nothing: it says so, not "checkpoint saved"
    assert caplog.text.count("checkpoint saved") == 1
    assert "the run is at update 4, at or beyond train.max_steps=4: nothing trained" in caplog.text
    assert "run summary: finished" not in caplog.text
    with caplog.at_level("INFO"):
        assert train.main(debug_config(name="m")).reason == "finished"
    # each job counts the images of its own updates (x the global batch of 16), not the run's since update 0
    assert re.findall(r"this job trained (\d+) images", caplog.text) == ["64", "0", "64"]
    assert caplog.text.count("(no updates trained)") == 1


def test_a_full_disk_is_named_and_leaves_no_probe_file(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(RunDirError, match=r"the disk is full \(No space left on device; \d+ MB free\): free "
                                          r"space there"):
        prepare_folder(str(tmp_path / "out"))
    assert os.listdir(tmp_path / "out") == []


def test_a_metrics_line_of_another_shape_is_dropped_on_resume_not_a_traceback(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x": 1}\n[1, 2]\n{"step": 5}\n')
    with caplog.at_level("WARNING"):
        MetricLogger(str(tmp_path), True, tensorboard=False, resume_step=3).close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "x": 1}\n'
    assert "dropped 1 unreadable line" in caplog.text


def test_a_disabled_metric_logger_writes_nothing(tmp_path):
    """Only the main rank writes: a logger made with enabled=False (the other ranks) leaves no metrics.jsonl."""
    logger = MetricLogger(str(tmp_path), False, tensorboard=False)
    logger.log(1, {"train/loss": 1.0})
    logger.close()
    assert os.listdir(tmp_path) == []


def test_metrics_jsonl_keeps_records_up_to_the_resumed_step_whole_lines_and_non_finite_values(tmp_path):
    """Records at or before the resumed step are kept, a last record without its newline is still one line
    when the resumed run appends, and NaN/inf are written as strings (JSON has no NaN)."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 2}\n{"step": 3, "x": 1}')  # no newline at the end
    logger = MetricLogger(str(tmp_path), True, tensorboard=False, resume_step=3)
    logger.log(4, {"train/loss": float("nan"), "train/lr": float("inf"), "t": torch.tensor(0.5)})
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 2}, {"step": 3, "x": 1},
                       {"step": 4, "train/loss": "nan", "train/lr": "inf", "t": 0.5}]


def test_metrics_jsonl_drops_every_record_after_the_resumed_step(tmp_path):
    """A resume from update 3 of a run that logged every update up to 5 keeps updates 1-3 only (the next record
    is the resumed run's update 4); the file as it was is kept as metrics.until_step3.jsonl."""
    before = "".join(f'{{"step": {step}}}\n' for step in range(1, 6))
    (tmp_path / "metrics.jsonl").write_text(before)
    MetricLogger(str(tmp_path), True, tensorboard=False, resume_step=3).close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    assert (tmp_path / "metrics.until_step3.jsonl").read_text() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a machine without a GPU")
def test_train_device_cuda_without_a_gpu_is_a_config_error_not_a_traceback(debug_config):
    from configs import ConfigError
    with pytest.raises(ConfigError, match=r"train.device=cuda but no CUDA device is visible"):
        train.main(debug_config("train.device=cuda"))


def test_a_stopping_error_is_in_train_log_as_well_as_on_stderr(tmp_path, capsys):
    """train.py's __main__ in this process (run_entry: a process would import torch again); that a real process
    adds nothing to stderr: test_usage_errors.py::test_the_whole_process_writes_one_line_and_exits_2."""
    out = tmp_path / "nan"
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={out}", "optim.lr=1e6",
                                          "sched.epochs=10"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: the training loss is nan"), err[-2000:]
    assert (out / "train.log").read_text().splitlines()[-1].endswith(f"train ERROR {lines[0]}")  # a job's log says why


def test_the_summary_names_the_epoch_in_progress_as_best_epoch_does():
    """A language model's 12 updates lie inside its first epoch: 'epoch 1/1', not 'epoch 0/1'; a run that
    ended at an epoch's end names that epoch."""
    from engine.loop import TrainState

    inside = train.run_summary(TrainState(epoch=0, step=12, epoch_batches=24), "finished", 1, 5.0, 192, 4.0)
    at_end = train.run_summary(TrainState(epoch=2, step=8, epoch_batches=0), "finished", 2, 5.0, 128, 4.0)
    assert "finished at update 12, epoch 1/1;" in inside and "finished at update 8, epoch 2/2;" in at_end


def test_the_summary_names_the_best_validation_and_the_speed_of_the_updates_alone():
    """The best validation's score, epoch and update (not the current ones), the wall time, and the images per
    second of the time spent in updates (128 images in 4 s: 32 img/s), not of the wall time (12.8 img/s)."""
    from engine.loop import TrainState

    state = TrainState(epoch=2, step=8, epoch_batches=0, best_value=87.5, best_epoch=1, best_step=4)
    line = train.run_summary(state, "finished", 2, 10.0, 128, 4.0)
    assert line == ("run summary: finished at update 8, epoch 2/2; best val top-1 87.50% at epoch 1 (update 4); "
                    "wall time 0:00:10; this job trained 128 images in 0:00:04 (32 img/s)")
    resumed = train.run_summary(state, "max_steps", 2, 10.0, 0, 0.0)
    assert resumed.startswith("run summary: stopped at train.max_steps at update 8")
    assert resumed.endswith("this job trained 0 images in 0:00:00 (no updates trained)")


@pytest.mark.parametrize("code", [None, 2, 130])
def test_an_error_line_is_one_write_so_ranks_sharing_stderr_cannot_run_their_lines_together(monkeypatch, code):
    """Under torchrun every rank writes to one stderr: a line written as text and newline apart (print, or
    sys.exit(text)) can end up as two ranks' lines joined into one. exit_with_error writes it in one call."""
    from engine.runinfo import exit_with_error

    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)
            return len(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    with pytest.raises(SystemExit) as done:
        exit_with_error("the disk is on fire", code=code)
    assert writes == ["error: the disk is on fire\n"]
    assert done.value.code == (1 if code is None else code)


def test_an_error_line_goes_to_stderr_and_the_log_file_once_and_only_the_main_rank_writes_a_log(tmp_path, capsys):
    import logging

    from engine.runinfo import exit_with_error, setup_logging

    root = logging.getLogger()
    level = root.level
    try:
        setup_logging(str(tmp_path), is_main=True)
        setup_logging(str(tmp_path), is_main=True)  # set up again (a second run in one process): no double lines
        logging.getLogger("t").info("hello")
        with pytest.raises(SystemExit):
            exit_with_error("the disk is on fire")
        out, err = capsys.readouterr()
        assert err == "error: the disk is on fire\n"
        assert out.count("hello") == 1 and "on fire" not in out  # the console gets stderr's line only
        lines = (tmp_path / "train.log").read_text().splitlines()  # the default file name
        assert len(lines) == 2 and lines[0].endswith(" t INFO hello"), lines
        assert lines[1].endswith(" ERROR error: the disk is on fire"), lines  # logger named after the program
        other = tmp_path / "rank1"
        other.mkdir()
        setup_logging(str(other), is_main=False)
        logging.getLogger("t").info("quiet")
        logging.getLogger("t").warning("loud")
        assert os.listdir(other) == [] and root.level == logging.WARNING
        out = capsys.readouterr().out
        assert "quiet" not in out and "loud" in out
    finally:
        for handler in [h for h in root.handlers if getattr(h, "_cd_run", False)]:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)


def test_git_commit_is_the_checkout_holding_the_code_and_its_tracked_changes(tmp_path, monkeypatch):
    """engine.runinfo.git_commit (the commit of every log's environment line): the short hash of the repository
    that holds engine/, whatever the working directory; '+dirty' for a changed tracked file, not for an untracked
    one; 'unknown' outside a repository."""
    from engine import runinfo

    def git(repo, *args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                              capture_output=True, text=True).stdout.strip()

    heads = {}
    for name in ("code", "elsewhere"):
        (tmp_path / name / "engine").mkdir(parents=True)
        (tmp_path / name / "engine" / "a.py").write_text(f"name = {name!r}\n")
        git(tmp_path / name, "init", "-q")
        git(tmp_path / name, "add", ".")
        git(tmp_path / name, "commit", "-qm", name)
        heads[name] = git(tmp_path / name, "rev-parse", "HEAD")
    monkeypatch.setattr(runinfo, "__file__", str(tmp_path / "code" / "engine" / "runinfo.py"))
    monkeypatch.chdir(tmp_path / "elsewhere")  # another repository: not the one whose commit is asked
    commit = runinfo.git_commit()
    assert 4 <= len(commit) < 40 and heads["code"].startswith(commit), (commit, heads)
    (tmp_path / "code" / "engine" / "new.py").write_text("")
    assert runinfo.git_commit() == commit  # untracked files do not make a checkout dirty
    (tmp_path / "code" / "engine" / "a.py").write_text("changed = True\n")
    assert runinfo.git_commit() == commit + "+dirty"
    (tmp_path / "plain" / "engine").mkdir(parents=True)
    monkeypatch.setattr(runinfo, "__file__", str(tmp_path / "plain" / "engine" / "runinfo.py"))
    assert runinfo.git_commit() == "unknown"


def test_cpu_name_is_the_model_name_line_of_cpuinfo(monkeypatch):
    """engine.runinfo.cpu_name: the value of /proc/cpuinfo's `model name` line (not of the `model` number line
    before it); without one, or without the file (macOS), platform.processor(), else 'unknown CPU'."""
    import io
    import platform

    from engine import runinfo

    cpuinfo = {"text": "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 85\n"
                       "model name\t: Intel(R) Xeon(R) Gold 6230 CPU @ 2.10GHz\nstepping\t: 7\n"}

    def fake_open(path, *args, **kwargs):
        assert path == "/proc/cpuinfo"
        if cpuinfo["text"] is None:
            raise FileNotFoundError(path)
        return io.StringIO(cpuinfo["text"])

    monkeypatch.setattr(runinfo, "open", fake_open, raising=False)
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    assert runinfo.cpu_name() == "Intel(R) Xeon(R) Gold 6230 CPU @ 2.10GHz"
    cpuinfo["text"] = "processor\t: 0\nBogoMIPS\t: 50.00\nCPU part\t: 0xd0c\n"  # aarch64: no model name
    assert runinfo.cpu_name() == "arm"
    cpuinfo["text"] = None
    assert runinfo.cpu_name() == "arm"
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert runinfo.cpu_name() == "unknown CPU"
