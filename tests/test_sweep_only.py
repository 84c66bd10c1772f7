"""`--only` keeps some runs of a sweep: only their settings are checked (a run left out does not run, and an unknown
key of its own does not refuse the others), while every run's folder still counts, so a kept run never shares one."""
from __future__ import annotations

import pytest

import sweep
from configs import ConfigError


def sweep_file(tmp_path, other: str = "b") -> str:
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\nruns:\n  a: [optim.lr=1e-3]\n"
                    f"  {other}: [optim.lrr=1]\n")
    return str(spec)


def test_only_checks_the_runs_it_keeps(tmp_path, capsys):
    spec = sweep_file(tmp_path)
    assert [r["name"] for r in sweep.expand(spec, [], only=["a"])] == ["a", "b"]
    assert sweep.main([spec, "--only", "a"]) == 0
    (command,) = capsys.readouterr().out.splitlines()
    assert command.endswith(f"optim.lr=1e-3 out_dir={tmp_path}/runs/a")
    # the run with the unknown key, kept (or every run, without --only): refused, naming it
    for only in (["b"], None):
        with pytest.raises(ConfigError, match=r"sweep run 'b': .*unknown config key 'optim.lrr'"):
            sweep.expand(spec, [], only=only)


def test_only_still_refuses_a_kept_run_that_would_share_its_folder_with_one_left_out(tmp_path):
    """Runs 'a' and 'A' are one folder where names differ only in case (macOS, Windows): refused with --only a too,
    for the folder, not for A's settings."""
    with pytest.raises(ConfigError, match=r"runs 'a' and 'A' would share the folder"):
        sweep.expand(sweep_file(tmp_path, other="A"), [], only=["a"])
