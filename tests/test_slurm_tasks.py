"""srun started the command as one of several tasks without torchrun's variables (`srun python train.py` with
`--ntasks 8`): each task is a one-process run of its own (the first to claim out_dir trains, the others are
refused as in use), not one run over the tasks. The run's log says so in a warning with the launch that forms
one run; nothing warns where torchrun's variables are set or srun started one task."""
from __future__ import annotations

import pytest

from tests.conftest import DEBUG_CONFIG, run_entry

WARNING = ("srun started this command as task 2 of 4, without torchrun's RANK / WORLD_SIZE: it runs alone, one "
           "process (the tasks do not form one run); for one run over the tasks launch srun torchrun ... (one task "
           "per node), or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for each task "
           "(docs/operations.md)")


@pytest.mark.parametrize("env, warned", [
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2"}, True),
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2", "WORLD_SIZE": "1"}, True),  # torchrun's one process
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2", "WORLD_SIZE": "8"}, False),  # srun torchrun
    ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, False),  # srun -n 1, or the batch script
    ({"SLURM_PROCID": "2"}, False),
    ({}, False)])
def test_a_lone_srun_task_is_told_it_runs_alone(monkeypatch, env, warned):
    from engine.runinfo import lone_slurm_task

    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert lone_slurm_task() == (WARNING if warned else None)


def test_the_warning_is_in_the_runs_log(monkeypatch, tmp_path, capsys):
    """train.py as one of 4 srun tasks: the warning in train.log (and on the console), beside the environment
    line."""
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, out, _ = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={tmp_path / 'run'}",
                                          "train.max_steps=1"], capsys)
    assert code == 0
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"WARNING {WARNING}" in log and WARNING in out
