"""A sweep run with --run under a launcher that states its processes (torchrun --nproc_per_node=N): a global batch
that does not split into N processes x train.batch_size_per_gpu x accumulation steps is refused before anything
starts, in one error line naming the run, not when that run starts after the earlier runs trained."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

import launchers
import sweep

TORCHRUN = """#!/bin/sh
# stands in for torchrun: records each command it is given and leaves the checkpoint.pt a finished train.py leaves
# (the sweep counts a run that exits 0 without one as failed), trains nothing
echo "$@" >> "$(dirname "$0")/started"
for a; do case "$a" in out_dir=*) mkdir -p "${a#out_dir=}"; : > "${a#out_dir=}/checkpoint.pt";; esac; done
"""


@pytest.fixture
def torchrun(tmp_path):
    """A program named torchrun (launcher_world_size reads its --nproc_per_node), and the file of its commands."""
    path = tmp_path / "bin" / "torchrun"
    path.parent.mkdir()
    path.write_text(TORCHRUN)
    path.chmod(0o755)
    return str(path), path.parent / "started"


def sweep_of_batches(tmp_path, batch_a: int, batch_b: int) -> str:
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\nruns:\n"
                    f"  a: [optim.lr=1e-3, train.batch_size={batch_a}]\n"
                    f"  b: [optim.lr=1e-3, train.batch_size={batch_b}]\n")
    return str(spec)


@pytest.mark.parametrize("processes, batch_b", [(2, 24), (3, 32), (4, 40)])
def test_a_batch_that_does_not_split_into_the_launchers_processes_is_refused_before_any_run(
        tmp_path, torchrun, capsys, processes, batch_b):
    path, started = torchrun
    per_gpu = 8  # configs/debug/tiny.yaml's train.batch_size_per_gpu
    # the reference: a global batch is processes x per-GPU batch x accumulation steps (run a's 96 splits into each)
    assert 96 % (per_gpu * processes) == 0 and batch_b % (per_gpu * processes) != 0
    with pytest.raises(SystemExit) as refused:
        sweep.main([sweep_of_batches(tmp_path, 96, batch_b), "--run", "--launcher",
                    f"{path} --nproc_per_node={processes}"])
    message = str(refused.value.code)
    assert message.startswith(f"error: sweep run 'b': train.batch_size={batch_b} is not a multiple of "
                              f"train.batch_size_per_gpu={per_gpu} x {processes} processes") and "\n" not in message
    assert not started.exists() and not (tmp_path / "runs").exists()  # nothing started, no run folder made


def test_every_run_is_checked_before_the_first_trains(tmp_path, torchrun):
    """Run a (batch 16) fits 2 processes, run b (batch 24) does not: b is refused before a trains."""
    path, started = torchrun
    with pytest.raises(SystemExit, match=r"^error: sweep run 'b': train.batch_size=24 is not a multiple of "):
        sweep.main([sweep_of_batches(tmp_path, 16, 24), "--run", "--launcher", f"{path} --nproc_per_node=2"])
    assert not started.exists()


def test_batches_that_split_into_the_launchers_processes_run(tmp_path, torchrun):
    path, started = torchrun
    code = sweep.main([sweep_of_batches(tmp_path, 16, 32), "--run", "--launcher", f"{path} --nproc_per_node 2"])
    assert code == 0
    commands = started.read_text().splitlines()
    assert [c.split()[:2] for c in commands] == [["--nproc_per_node", "2"]] * 2
    assert [c.rsplit("/", 1)[1] for c in commands] == ["a", "b"]  # both trained, in order


@pytest.mark.parametrize("module_words", [["-m", "torch.distributed.run"], ["-u", "-m", "torch.distributed.run"],
                                          ["-m", "torch.distributed.launch", "--use-env"]])
def test_torchrun_run_as_a_python_module_is_checked_as_torchrun(tmp_path, capsys, module_words):
    """`python -m torch.distributed.run --nproc_per_node=3` starts 3 processes as torchrun does: a batch that does
    not split into them is refused before anything starts, not at the run's start (a ChildFailedError traceback)."""
    stub = tmp_path / "bin" / "python"  # stands in for the python: it records its command, trains nothing
    stub.parent.mkdir()
    stub.write_text(TORCHRUN)
    stub.chmod(0o755)
    with pytest.raises(SystemExit) as refused:
        sweep.main([sweep_of_batches(tmp_path, 40, 40), "--run", "--launcher",
                    " ".join([str(stub), *module_words, "--nproc_per_node=3"])])
    assert str(refused.value.code).startswith("error: sweep run 'a': train.batch_size=40 is not a multiple of "
                                              "train.batch_size_per_gpu=8 x 3 processes")
    assert not (stub.parent / "started").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("options", ["--nproc_per=3", "--nproc-per 3", "--nproc_per_node 3 --nnode 1"])
def test_an_abbreviated_torchrun_option_counts_its_processes(tmp_path, torchrun, options):
    """torchrun's parser takes unique abbreviations of its options (--nproc_per=3 is --nproc_per_node=3): they were
    counted as one process, and a batch for one was not refused."""
    path, started = torchrun
    with pytest.raises(SystemExit, match=r"^error: sweep run 'a': train.batch_size=16 is not a multiple of "
                                         r"train.batch_size_per_gpu=8 x 3 processes"):
        sweep.main([sweep_of_batches(tmp_path, 16, 48), "--run", "--launcher", f"{path} {options}"])
    assert not started.exists()


# one write per process: the processes share torchrun's stdout, and print's pieces of two would interleave
WORKER = "import os\nos.write(1, f\"worker of {os.environ['WORLD_SIZE']}\\n\".encode())\n"
PYTHON, TORCHRUN_PROGRAM = sys.executable, os.path.join(os.path.dirname(sys.executable), "torchrun")


@pytest.mark.parametrize("launcher, environment", [
    (f"{PYTHON} -m torch.distributed.run --standalone --nproc_per=3", {}),
    (f"{PYTHON} -u -m torch.distributed.launch --standalone --nnode 1 --nproc-per-node 2", {}),
    (f"{TORCHRUN_PROGRAM} --standalone --nproc_per_node=2", {}),
    (f"{TORCHRUN_PROGRAM} --standalone", {"PET_NPROC_PER_NODE": "2"}),  # torchrun's default from the environment
    (f"env OMP_NUM_THREADS=1 PET_NPROC_PER_NODE=3 {TORCHRUN_PROGRAM} --standalone", {"PET_NPROC_PER_NODE": "2"}),
    # env's own options: the default unset (one process per node), or set after an unset
    (f"env -u PET_NPROC_PER_NODE {TORCHRUN_PROGRAM} --standalone", {"PET_NPROC_PER_NODE": "2"}),
    (f"env --unset=PET_NNODES -- PET_NPROC_PER_NODE=3 {TORCHRUN_PROGRAM} --standalone", {"PET_NNODES": "2"}),
])
def test_launcher_world_size_is_the_number_of_processes_the_launcher_starts(tmp_path, monkeypatch, launcher,
                                                                            environment):
    """The reference: the launcher itself, run on a script whose processes print the WORLD_SIZE torchrun gives
    them (one line per process started)."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)  # the sweep's commands inherit its environment
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ran = subprocess.run([*shlex.split(launcher), str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stderr
    lines = [line for line in ran.stdout.splitlines() if line.startswith("worker of ")]
    assert lines and lines == [f"worker of {len(lines)}"] * len(lines), (ran.stdout, ran.stderr)
    assert launchers.launcher_world_size(launcher) == len(lines)


@pytest.mark.parametrize("launcher, world", [
    ("torchrun --nnode=2 --nproc_per=4", 8),          # nodes x processes per node (torchrun's WORLD_SIZE)
    ("torchrun --nnodes=2:2 --nproc_per_node=4", 8),  # a range of one size: a fixed number of nodes
    ("torchrun --nnodes=1:4 --nproc_per_node=4", None),  # elastic: known at the start only
    ("torchrun --nproc_per_node=gpu", None), ("torchrun --nproc_per_node=auto", None),
    ("torchrun --n=2", None),  # ambiguous: torchrun refuses it at the start
    ("python -c 'import torch.distributed.run'", None), ("python train.py", None), ("srun python", None)])
def test_launcher_world_size_of_launchers_not_run_here(launcher, world):
    assert launchers.launcher_world_size(launcher) == world


# what a process is given: its command line's options past the script (one write: see WORKER)
ARGUMENTS = "import os, sys\nos.write(1, f\"arguments {sys.argv[1:]}\\n\".encode())\n"


@pytest.mark.parametrize("options", ["", "--use-env", "--use_env", "--use-e"])
def test_a_launcher_that_passes_the_commands_local_rank_is_refused(tmp_path, options):
    """`python -m torch.distributed.launch` without --use-env gives each process `--local-rank=N`, which train.py
    and evaluate.py refuse: under a sweep every process ended on that usage error and the launcher on a
    ChildFailedError traceback. The reference: the launcher itself, run on a script that prints its arguments."""
    launcher = f"{PYTHON} -m torch.distributed.launch {options} --standalone --nproc_per_node=1"
    script = tmp_path / "worker.py"
    script.write_text(ARGUMENTS)
    ran = subprocess.run([*shlex.split(launcher), str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stderr
    (line,) = [line for line in ran.stdout.splitlines() if line.startswith("arguments ")]
    given_a_rank = "local-rank" in line or "local_rank" in line
    assert given_a_rank == (options == "")
    assert (launchers.launcher_refusal(launcher) is not None) == given_a_rank
    assert (launchers.launcher_refusal(f"env OMP_NUM_THREADS=1 {launcher}") is not None) == given_a_rank


def test_a_sweep_refuses_that_launcher_in_one_line_before_anything_starts(tmp_path):
    stub = tmp_path / "bin" / "python"  # stands in for the python: it records its command, trains nothing
    stub.parent.mkdir()
    stub.write_text(TORCHRUN)
    stub.chmod(0o755)
    launcher = f"{stub} -m torch.distributed.launch --nproc_per_node=2"
    with pytest.raises(SystemExit) as refused:
        sweep.main([sweep_of_batches(tmp_path, 16, 16), "--run", "--launcher", launcher])
    message = str(refused.value.code)
    assert message.startswith(f"error: --launcher {launcher!r}: python -m torch.distributed.launch without "
                              "--use-env") and "\n" not in message
    assert not (stub.parent / "started").exists() and not (tmp_path / "runs").exists()
    assert launchers.launcher_refusal(f"{stub} -m torch.distributed.run --nproc_per_node=2") is None
    assert launchers.launcher_refusal("torchrun --nproc_per_node=2") is None
