"""scripts/gpu_session.sh, the one-call GPU session, driven by a stand-in Python that records each call and sleeps
instead of working: the figure stages run alone before anything else, pytest runs beside the study, the study's
two streams are the sweep file's runs with every point's first seed first, no run starts that would end past the
study's deadline and a first run still going there is stopped, the archive comes back whole also from a call killed
midway, and bad settings are refused before anything runs. The script runs from a copy in a folder of its own (it
works from its repository root: runs/ and its WORK land there, not in the checkout)."""
import os
import shutil
import subprocess
import tarfile

import pytest
import yaml

from tests.conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "gpu_session.sh")
SWEEP = os.path.join(ROOT, "configs", "sweeps", "fashion_mnist_gpu.yaml")

# records "<start> <end> <status> <args>" per call (seconds since the epoch), sleeps as told
STAND_IN = r"""#!/usr/bin/env bash
start=$(date +%s.%N)
case "$1" in
  scripts/gpu_check.py) sleep "$FAKE_STAGE_S"; rc=0 ;;
  scripts/sweep.py) sleep "$FAKE_RUN_S"; rc=0; [ "$6" = "${FAKE_FAILING_RUN:-}" ] && rc=3 ;;
  *) rc=0 ;;
esac
echo "$start $(date +%s.%N) $rc $*" >> "$FAKE_LOG"
exit $rc
"""


def make_kit(root) -> str:
    kit = root / "kit"
    (kit / "fashion_mnist").mkdir(parents=True)
    (kit / "dinov2_s14_half.safetensors").write_bytes(b"stand-in")
    return str(kit)


def run_script(tmp_path, kill_after: float = 0, **env) -> tuple[subprocess.CompletedProcess, list]:
    """The script from a copy at tmp_path/repo/scripts/ with the stand-in Python; killed with everything it started
    after `kill_after` seconds if given (a device call cut off at its limit). Returns its process and the calls,
    each (start, end, exit status, arguments)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(SCRIPT, repo / "scripts")
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    log = tmp_path / "calls.log"
    base = {"PATH": os.environ["PATH"], "PY": str(stand_in), "FAKE_LOG": str(log), "FAKE_STAGE_S": "0.2",
            "FAKE_RUN_S": "2", "WORK": str(tmp_path / "work")}
    command = ["bash", str(repo / "scripts" / "gpu_session.sh")]
    if kill_after:  # timeout signals the whole process group it leads, as a runner's limit ends a call
        command = ["timeout", "-s", "KILL", str(kill_after), *command]
    done = subprocess.run(command, env={**base, **env}, capture_output=True, text=True, timeout=120)
    calls = []
    if log.exists():
        for line in log.read_text().splitlines():
            start, end, rc, *args = line.split()
            calls.append((float(start), float(end), int(rc), args))
    return done, calls


def ran(calls, script: str) -> list:
    return [c for c in calls if c[3][0] == script]


def sweep_runs() -> list[str]:
    with open(SWEEP) as f:
        return list(yaml.safe_load(f)["runs"])


@pytest.fixture
def out(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    return folder


@pytest.mark.slow
def test_figures_first_then_pytest_beside_a_study_that_stops_before_its_deadline(tmp_path, out):
    limit = 8
    done, calls = run_script(tmp_path, OUT=str(out), KIT=make_kit(tmp_path), LIMIT=str(limit), END_MARGIN="0")
    # 0, or 1 where a run that the whole-second clock let start was stopped at the deadline (a loaded machine)
    cut = "stopped at the study's deadline" in done.stdout
    assert done.returncode == int(cut), done.stdout + done.stderr
    figures, pytest_stage = ran(calls, "scripts/gpu_check.py")
    assert "--stages" in figures[3] and figures[3][figures[3].index("--stages") + 1:][:4] == [
        "precision", "overhead", "quant", "aphq_unit"]
    assert pytest_stage[3][pytest_stage[3].index("--stages") + 1] == "pytest"
    runs = ran(calls, "scripts/sweep.py")
    assert runs and figures[1] <= min(r[0] for r in runs)  # the figures alone on the GPU
    assert pytest_stage[0] <= min(r[0] for r in runs) + 1  # pytest started with the study, not after it
    names = [r[3][r[3].index("--only") + 1] for r in runs]
    assert 2 <= len(names) < len(sweep_runs()), names  # the deadline stopped the streams
    # every point's first seed before any second seed, and the runs are the sweep file's
    seeds = [int(n.rsplit("_s", 1)[1]) for n in sorted(names, key=lambda n: [r for r in runs
                                                                               if n in r[3]][0][0])]
    assert seeds == sorted(seeds) and set(names) <= set(sweep_runs())
    start_of_script = min(c[0] for c in calls)
    assert max(r[1] for r in runs) <= start_of_script + limit + 1  # none ran past the deadline (1 s: clock steps)
    for r in runs:
        assert "data.root=" + str(tmp_path / "kit" / "fashion_mnist") in r[3] and "--evaluate" in r[3]
    assert ran(calls, "scripts/dose_report.py")[0][0] >= max(r[1] for r in runs)  # the report after the study
    with tarfile.open(out / "gpu_session.tgz") as archive:
        members = archive.getnames()
    assert any(m.endswith("stream_a.log") for m in members) and any(m.endswith("env.txt") for m in members)
    assert not (out / "gpu_session.tgz.tmp").exists()


def test_the_streams_hold_every_run_of_the_sweep_file_first_seeds_first():
    """The script's two stream lists, read from its text, are the sweep file's twelve runs, and each lists seed 0's
    points, then seed 1's, then seed 2's."""
    text = open(SCRIPT).read()
    streams = [line.split()[1:line.split().index(">")] for line in text.splitlines() if line.startswith("stream ")]
    assert len(streams) == 2 and sorted(streams[0] + streams[1]) == sorted(sweep_runs())
    for names in streams:
        seeds = [int(n.rsplit("_s", 1)[1]) for n in names]
        assert seeds == sorted(seeds), names
    assert {n for s in streams for n in s[:2]} == {n for n in sweep_runs() if n.endswith("_s0")}


@pytest.mark.slow
def test_a_first_run_still_going_at_the_deadline_is_stopped_there(tmp_path, out):
    """Nothing foretells a stream's first run's time: it starts, and gets SIGTERM at the study's deadline."""
    done, calls = run_script(tmp_path, OUT=str(out), KIT=make_kit(tmp_path), LIMIT="4", END_MARGIN="0",
                             FAKE_RUN_S="30")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.count("stopped at the study's deadline, unfinished") == 2, done.stdout
    assert "cd1x_s0: not started" in done.stdout and "tweo_s0: not started" in done.stdout
    script_start = min(c[0] for c in calls)
    assert ran(calls, "scripts/dose_report.py")[0][0] <= script_start + 4 + 2  # not after the 30 s runs


@pytest.mark.slow
def test_a_call_killed_midway_returns_a_whole_archive_of_what_had_finished(tmp_path, out):
    """The device tool ends a call at its limit with everything it started: the archive packed after the figures,
    the pytest stage and the first runs (by the streams and the pytest stage, up to three at once) is whole."""
    done, calls = run_script(tmp_path, kill_after=4.5, OUT=str(out), KIT=make_kit(tmp_path), LIMIT="60",
                             FAKE_RUN_S="3")  # the first runs end at about 3.2 s, the second would at 6.2 s
    assert done.returncode in (137, -9)  # killed (timeout with its group, or timeout itself): no final pack
    assert len(ran(calls, "scripts/sweep.py")) == 2  # the first run of each stream finished, the second did not
    with tarfile.open(out / "gpu_session.tgz") as archive:  # a torn archive raises here
        names = {os.path.basename(m) for m in archive.getnames()}
    assert {"figures.log", "pytest.log", "run_baseline_s0.log", "run_cd100x_s0.log"} <= names, names


@pytest.mark.slow
def test_a_failing_run_makes_the_exit_status_1_and_the_other_runs_go_on(tmp_path, out):
    done, calls = run_script(tmp_path, OUT=str(out), KIT=make_kit(tmp_path), LIMIT="6", END_MARGIN="0",
                             FAKE_FAILING_RUN="baseline_s0")
    assert done.returncode == 1, done.stdout + done.stderr
    names = [r[3][r[3].index("--only") + 1] for r in ran(calls, "scripts/sweep.py")]
    assert "baseline_s0" in names and "cd1x_s0" in names
    assert "baseline_s0: exit status 3" in done.stdout


@pytest.mark.parametrize("case", ["no OUT", "OUT not a folder", "archive exists", "WORK exists", "runs exist",
                                  "no kit", "LIMIT=10m", "END_MARGIN=600", "EPOCHS=1", "EPOCHS=x"])
def test_bad_settings_are_refused_before_anything_runs(tmp_path, out, case):
    env = {"OUT": str(out), "KIT": make_kit(tmp_path)}
    if case == "no OUT":
        del env["OUT"]
    elif case == "OUT not a folder":
        env["OUT"] = str(tmp_path / "missing")
    elif case == "archive exists":
        (out / "gpu_session.tgz").write_bytes(b"an earlier call's archive")
    elif case == "WORK exists":
        (tmp_path / "work").mkdir()
    elif case == "runs exist":
        (tmp_path / "repo" / "runs" / "sweeps" / "fashion_mnist_gpu" / "baseline_s0").mkdir(parents=True)
    elif "=" in case:
        env.update([case.split("=")])
    else:
        env["KIT"] = str(tmp_path / "empty")
    done, calls = run_script(tmp_path, **env)
    assert done.returncode == 2 and calls == []
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    if case == "archive exists":
        assert (out / "gpu_session.tgz").read_bytes() == b"an earlier call's archive"
