"""A sweep run with --run under a launcher that states its processes (torchrun --nproc_per_node=N): a global batch
that does not split into N processes x train.batch_size_per_gpu x accumulation steps is refused before anything
starts, in one error line naming the run, not when that run starts after the earlier runs trained."""
from __future__ import annotations

import pytest

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
