"""GPLQ stage 1 under evaluate.py stops on SIGTERM as train.py does: the stage-1 checkpoint is written at the
update the signal came in, the process exits with EXIT_PREEMPTED (75), and the same command resumes to the
student weights of a run that was never stopped (bit-exact on CPU, one thread)."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import evaluate as evaluate_entry
from configs import config_to_dict
from engine.loop import TrainLoop
from engine.preemption import EXIT_PREEMPTED, Preempted
from dist_utils import free_port
from quant_models import train_on_digits
from tests.conftest import ROOT, run_entry

STEPS = 5
GPLQ = [f"quant.gplq.{k}={v}" for k, v in dict(steps=STEPS, batch_size_per_gpu=16, init_images=32, pca_images=64,
                                                 log_every=1, ckpt_every=2, qwt="false").items()]

# evaluate.py as its command line runs it, with SIGTERM sent to itself while stage 1 computes update STOP_AT (the
# update's gradients exist, its optimizer step has not run): the stop must come right after that update
# (under torchrun only the rank STOP_RANK does)
DRIVER = """
import os, runpy, signal, sys
sys.path.insert(0, os.getcwd())
from engine.loop import TrainLoop
step, calls, stop_at = TrainLoop._optimizer_step, [], int(os.environ["STOP_AT"])
mine = os.environ.get("RANK", "0") == os.environ.get("STOP_RANK", "0")
def signalled(self):
    calls.append(1)
    if mine and len(calls) == stop_at:
        os.kill(os.getpid(), signal.SIGTERM)
    return step(self)
TrainLoop._optimizer_step = signalled
sys.argv = ["evaluate.py", *sys.argv[1:]]
runpy.run_path("evaluate.py", run_name="__main__")
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model, cfg, _, _ = train_on_digits("vit_nano", steps=30)
    path = tmp_path_factory.mktemp("gplq_preemption") / "best.pt"
    torch.save({"model": model.state_dict(), "config": config_to_dict(cfg)}, path)
    return path


def command(checkpoint, out):
    return ["--checkpoint", str(checkpoint), *GPLQ, "quant.act_max_csv=false", "--quant", "gplq", "--bits", "w4a4",
            "--out", str(out)]


def stage1(out) -> dict:
    return torch.load(f"{os.path.splitext(out)[0]}_gplq_w4a4_stage1.pt", weights_only=True)


def same(a, b) -> bool:
    """Bit-equal tensors, in nested dicts (a quantizer's extra state) too."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def signal_at(monkeypatch, update: int) -> None:
    """SIGTERM to this process while stage 1 computes `update` (in-process: the handler runs between bytecodes)."""
    step, calls = TrainLoop._optimizer_step, []

    def signalled(self):
        calls.append(1)
        if len(calls) == update:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self)
    monkeypatch.setattr(TrainLoop, "_optimizer_step", signalled)


def test_sigterm_in_stage1_saves_that_update_exits_75_and_resumes_to_the_uninterrupted_weights(
        checkpoint, tmp_path, monkeypatch, capsys, one_thread):
    """evaluate.py's __main__ in this process (run_entry: a process would import torch again; the signal handler
    runs here as in a process); a real process's exit status 75 under torchrun:
    test_sigterm_to_one_torchrun_rank_in_stage1_stops_both_at_one_update_and_resumes."""
    stopped_out = tmp_path / "stopped.json"
    signal_at(monkeypatch, 3)
    code, out, err = run_entry("evaluate.py", command(checkpoint, stopped_out), capsys)
    monkeypatch.undo()
    output = out + err
    assert code == EXIT_PREEMPTED, output[-3000:]
    assert "GPLQ stage 1 preempted at update 3;" in output and "re-run the same command to resume" in output
    assert "Traceback" not in output, output[-3000:]
    assert stage1(stopped_out)["state"]["step"] == 3  # not the periodic checkpoint of update 2
    with open(stopped_out) as f:
        assert "gplq" not in json.load(f).get("quant", {})  # no result from a student trained 3 updates of 5

    resumed = evaluate_entry.main(evaluate_entry.parse_args(command(checkpoint, stopped_out)))
    assert resumed["quant"]["gplq"]["w4a4"]["report"]["stage1"]["resumed_from"] == 3
    whole_out = tmp_path / "whole.json"
    whole = evaluate_entry.main(evaluate_entry.parse_args(command(checkpoint, whole_out)))
    assert whole["quant"]["gplq"]["w4a4"]["report"]["stage1"]["resumed_from"] is None
    a, b = stage1(stopped_out), stage1(whole_out)
    assert a["state"]["step"] == b["state"]["step"] == STEPS
    assert a["model"].keys() == b["model"].keys()
    different = [k for k in a["model"] if not same(a["model"][k], b["model"][k])]
    assert not different, f"student weights differ from the uninterrupted run's: {different[:5]}"
    assert resumed["quant"]["gplq"]["w4a4"]["top1"] == whole["quant"]["gplq"]["w4a4"]["top1"]


def test_sigterm_in_stage1s_last_update_stops_before_stage2_and_resumes_the_finished_stage(
        checkpoint, tmp_path, monkeypatch, one_thread):
    """The loop stops for its update count before it asks about a stop: the request still ends the run, with
    stage 1 complete in its checkpoint, rather than being dropped while stage 2 and the evaluation run."""
    out = tmp_path / "last.json"
    signal_at(monkeypatch, STEPS)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted):
        evaluate_entry.main(evaluate_entry.parse_args(command(checkpoint, out)))
    assert signal.getsignal(signal.SIGTERM) == before  # handlers restored once stage 1 ended
    assert stage1(out)["state"]["step"] == STEPS
    monkeypatch.undo()
    resumed = evaluate_entry.main(evaluate_entry.parse_args(command(checkpoint, out)))
    assert resumed["quant"]["gplq"]["w4a4"]["report"]["stage1"]["resumed_from"] == STEPS


@pytest.mark.slow
def test_sigterm_to_one_torchrun_rank_in_stage1_stops_both_at_one_update_and_resumes(checkpoint, tmp_path):
    """Rank 1 alone gets the signal; rank 0 writes the checkpoint: the ranks agree one update later (the stop
    agreement is read one call late) and leave stage 1 after the write; both exit 75 (the first rank out makes
    torchrun SIGTERM the other, still in its interpreter shutdown, which ignores it from there on:
    ignore_sigterm_until_exit), and the same torchrun command resumes there."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
           str(driver), *[item.replace("batch_size_per_gpu=16", "batch_size_per_gpu=8")
                          for item in command(checkpoint, out)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STOP_AT": "2", "STOP_RANK": "1"}
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    output = run.stdout + run.stderr
    assert "GPLQ stage 1 preempted at update 3;" in output, output[-3000:]
    assert output.count("exitcode  : 75") == 2, output[-3000:]  # torchrun reports each rank's code (and a traceback)
    assert 'evaluate.py", line' not in output and 'qat.py", line' not in output, output[-3000:]
    assert stage1(out)["state"]["step"] == 3
    # the resume runs under torchrun as well: the suite's one evaluate.py run to a finished evaluation under the
    # torchrun command (test_evaluate_distributed.py's ranks join through its environment variables instead)
    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**env, "STOP_AT": "0"})
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    with open(out) as f:
        assert json.load(f)["quant"]["gplq"]["w4a4"]["report"]["stage1"]["resumed_from"] == 3
