"""Under torchrun an error is one `error:` line per job, not one per rank: train.py and evaluate.py ranks that all
failed alike (a setting every rank reads, before or after the ranks met) print it once, from rank 0, with no
"telling the others" line; a rank whose error differs from rank 0's (its node's own missing data) still prints its
own, and a rank that only heard that another failed stays quiet where rank 0 failed too. A warning every rank logs
alike (a resume's changed settings) is one line too. The commands run as users run them (torchrun, 2 CPU ranks),
their output read as a whole."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dist_utils import free_port
from tests.conftest import DEBUG_CONFIG, ROOT
from tests.test_data import make_image_folder

TELLING = "failed before the ranks met; telling the others"
# cd off: what it computes is not what these tests are about, and its pair search costs each rank seconds
TINY = ["--config", DEBUG_CONFIG, "train.device=cpu", "cd.enabled=false", "log.tensorboard=false"]


def torchrun(tmp_path, script: str, *argvs: list[str]) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=2 script` with rank r's arguments argvs[r] (all ranks argvs[0] where one is
    given), through a wrapper that runs the script's __main__ as `python script` would."""
    wrapper = tmp_path / "per_rank.py"
    wrapper.write_text("import json, os, runpy, sys\n"
                       f"argvs = json.loads({json.dumps(json.dumps(argvs))})\n"
                       f"script = {os.path.join(ROOT, script)!r}\n"
                       "sys.argv = [script, *argvs[int(os.environ['RANK']) % len(argvs)]]\n"
                       "sys.path[0] = os.path.dirname(script)\n"
                       "runpy.run_path(script, run_name='__main__')\n")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                           str(free_port()), str(wrapper)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def error_lines(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow  # a torchrun of 2 ranks (about 30 s on a 2-core VM)
@pytest.mark.parametrize("script, argv, error", [
    ("train.py", [*TINY, "log.wandb=true"], "error: log.wandb=true but the wandb package is not installed"),
    ("evaluate.py", ["--config", DEBUG_CONFIG], "error: nothing to evaluate: give --checkpoint"),
], ids=["train", "evaluate"])
def test_an_error_every_rank_meets_before_the_ranks_meet_is_one_line(tmp_path, script, argv, error):
    """Each rank printed the error, and before it a "rank R failed before the ranks met; telling the others
    (waiting ...)" line: 4 lines for 2 ranks, 8 for 4."""
    if script == "train.py" and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed: log.wandb=true is no error here")
    run = torchrun(tmp_path, script, [*argv, f"out_dir={tmp_path / 'run'}"] if script == "train.py" else argv)
    assert run.returncode != 0
    assert len(error_lines(run)) == 1 and error_lines(run)[0].startswith(error), run.stderr[-3000:]
    assert TELLING not in run.stderr + run.stdout, run.stderr[-3000:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """out_dir of a one-process run stopped after 2 updates (checkpoint.pt there)."""
    import torch

    import train
    from configs import load_config

    out = tmp_path_factory.mktemp("trained") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train.main(load_config([DEBUG_CONFIG], [*TINY[2:], f"out_dir={out}", "train.max_steps=2"]))
    finally:
        torch.set_num_threads(threads)
    return str(out)


@pytest.mark.slow  # two torchruns of 2 ranks (about 60 s on a 2-core VM)
def test_a_resume_refused_or_warned_on_every_rank_is_one_line(trained, tmp_path):
    """A resume with another optim.lr: refused on each rank after the ranks met (the line once per rank), and with
    train.allow_changed_config=true its warning logged by each rank."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    refused = torchrun(tmp_path, "train.py", [*TINY, f"out_dir={out}", "optim.lr=0.1", "train.max_steps=3"])
    assert refused.returncode != 0
    errors = error_lines(refused)
    assert len(errors) == 1 and errors[0].startswith(f"error: {out / 'checkpoint.pt'} was written with other "
                                                     "settings (optim.lr: None -> 0.1)"), refused.stderr[-3000:]
    resumed = torchrun(tmp_path, "train.py", [*TINY, f"out_dir={out}", "optim.lr=0.1", "train.max_steps=3",
                                              "train.allow_changed_config=true"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = (resumed.stdout + resumed.stderr).count("WARNING resuming with changed settings: optim.lr: None -> 0.1")
    assert said == 1, resumed.stdout[-3000:]


@pytest.mark.slow  # two torchruns of 2 ranks (about 60 s on a 2-core VM)
@pytest.mark.parametrize("lacking", [0, 1])
def test_a_rank_whose_node_lacks_the_data_prints_its_own_error_and_rank_0_speaks_for_the_others(tmp_path, lacking):
    """One rank's data.root is missing. Rank 1 lacking it: its DataError and rank 0's line that another rank failed
    (which names no cause: rank 1's line does). Rank 0 lacking it: its DataError alone; rank 1 only heard that
    another rank failed, which rank 0's line says better (with 4 ranks, 3 such lines came)."""
    make_image_folder(tmp_path / "a", per_class=4)
    folder = ["data.dataset=folder", "model.num_classes=2", "train.batch_size=4", "train.batch_size_per_gpu=2",
              "train.eval_batch_size_per_gpu=2", "optim.lr=1e-4", "train.max_steps=1", f"out_dir={tmp_path / 'run'}"]
    roots = [tmp_path / "a", tmp_path / "a"]
    roots[lacking] = tmp_path / "missing"
    run = torchrun(tmp_path, "train.py", *[[*TINY, *folder, f"data.root={root}"] for root in roots])
    assert run.returncode != 0
    errors = error_lines(run)
    own = [line for line in errors if "missing" in line and "does not exist or is not a folder" in line]
    told = [line for line in errors if "another rank failed before the ranks met" in line]
    assert len(own) == 1, run.stderr[-3000:]
    assert told == (["error: rank 0: another rank failed before the ranks met (reading its node's --config files, "
                     "--checkpoint or data, or checking its settings); its output says why"]
                    if lacking == 1 else []), run.stderr[-3000:]
    assert len(errors) == 1 + len(told), errors
    assert not (tmp_path / "run").exists()  # refused before out_dir is claimed, on every rank


@pytest.mark.slow  # a process that imports torch, then waits for a rank that never comes
def test_a_sigterm_while_a_failed_rank_waits_for_the_others_ends_it_saying_why(tmp_path):
    """Rank 1 of 2 failed before the ranks met and waits for rank 0, which never comes. Its line that says so comes
    only after START_FAILURE_QUIET (ranks that failed alike meet at once, and print their error once), but torch's
    wait runs no Python handler: a SIGTERM meanwhile (torchrun's agent ending the ranks, a cancelled job) ends it at
    once, with its error said first (exit status 143)."""
    script = tmp_path / "waiting_rank.py"
    script.write_text("import os, sys\n"
                      f"sys.path.insert(0, {ROOT!r})\n"
                      "from engine.startup_signals import record_sigterm\n"
                      "record_sigterm()  # as train.py does first\n"
                      "from engine.distributed import fail_on_every_rank_at_start\n"
                      "print('failing', flush=True)\n"
                      "fail_on_every_rank_at_start(FileNotFoundError('its own'), 'cpu')\n")
    # TORCH_CPP_LOG_LEVEL=ERROR: a SIGTERM that lands while the store client is still connecting makes torch's C++
    # log a retry warning ('TCP client failed to connect ... Interrupted system call') before this line: torch's
    # own output, which came first in one CI run in three; the test is about the line this code prints
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout.readline() == "failing\n"
        time.sleep(2)  # in torch's wait for rank 0's store, well before START_FAILURE_QUIET
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - started < 10, err
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.startswith("rank 1 failed before the ranks met; telling the others (waiting at most 300 s for them "
                          "to join): its own\n"), err


@pytest.mark.slow  # a torchrun of 2 ranks (about 30 s on a 2-core VM)
def test_an_error_of_one_rank_mid_training_is_printed_at_once(tmp_path):
    """Rank 1's first run_epoch raises an error of its own (one outside the loop's agreement on unreadable batches)
    while rank 0 trains on, blocked in a collective until rank 1's process exits. Rank 1 waited SAME_ERROR_WAIT for
    rank 0's error before it printed its own (a SIGTERM meanwhile, a cancelled job, lost the line): now it prints it
    at once and the job ends within moments of the failure, as before the ranks compared their errors."""
    from engine.distributed import SAME_ERROR_WAIT

    argv = [*TINY, f"out_dir={tmp_path / 'run'}"]
    wrapper = tmp_path / "failing_rank.py"
    wrapper.write_text("import os, runpy, sys, time\n"
                       f"script = {os.path.join(ROOT, 'train.py')!r}\n"
                       f"sys.argv = [script, *{argv!r}]\n"
                       "sys.path[0] = os.path.dirname(script)\n"
                       "if os.environ['RANK'] == '1':\n"
                       "    import engine.loop\n"
                       "    from data import DataError\n"
                       "    def run_epoch(self, *args, **kwargs):\n"
                       "        print(f'failing at {time.time()}', file=sys.stderr, flush=True)\n"
                       "        raise DataError('rank 1 lost its data')\n"
                       "    engine.loop.TrainLoop.run_epoch = run_epoch\n"
                       "runpy.run_path(script, run_name='__main__')\n")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                          str(free_port()), str(wrapper)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    ended = time.time()
    assert run.returncode != 0
    assert error_lines(run).count("error: rank 1 lost its data") == 1, run.stderr[-3000:]
    failed = [float(line.split()[-1]) for line in run.stderr.splitlines() if line.startswith("failing at ")]
    assert len(failed) == 1, run.stderr[-3000:]
    # the job's end (torchrun's teardown included) well before the wait for rank 0's error would have ended
    assert ended - failed[0] < SAME_ERROR_WAIT.total_seconds() / 2, run.stderr[-3000:]


@pytest.mark.slow  # a torchrun of 2 ranks (about 30 s on a 2-core VM)
def test_a_loss_every_rank_finds_not_finite_mid_training_is_one_line(tmp_path):
    """A NaN loss is found on every rank after the same all-reduce (engine.loop.check_finite), after the ranks went
    apart (`ranks_apart`): without waiting for rank 0's error, rank 1 printed the same line as soon as it got there
    first. A learning rate of 1e30 makes every rank's loss NaN within the first windows."""
    run = torchrun(tmp_path, "train.py", [*TINY, "optim.lr=1e30", "train.divergence_factor=null",
                                          f"out_dir={tmp_path / 'run'}"])
    assert run.returncode != 0
    lines = error_lines(run)
    assert len(lines) == 1 and "the training loss is nan" in lines[0], run.stderr[-3000:]
