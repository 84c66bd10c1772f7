"""scripts/gpu_check.py end to end on a CPU (--smoke): every stage runs small in its own process and the
figures land in one valid JSON; a stage past its budget is killed and recorded, and the rest goes on.

The budgets are what the script enforces on a GPU machine; these tests check what it records, so they give
each stage a budget no busy CPU reaches (the default smoke budgets are about twice a loaded 2-core machine's stage
times: a busier one may still run past them), and time only the kill of a stage that is over its budget on purpose."""
import json
import os
import shutil
import stat
import sys
from argparse import Namespace

import pytest

from tests.conftest import ROOT, load_script, run_entry

SCRIPT = "scripts/gpu_check.py"


STAGES = ["pytest", "precision", "overhead", "quant", "aphq_unit"]


def unhurried(*stages: str) -> list[str]:
    """Budgets no busy CPU reaches, for `stages` (a budget for a stage not run is refused)."""
    return ["--total-budget", "36000", "--test-timeout", "3600", *[f"--budget={s}=3600" for s in stages]]


UNHURRIED = unhurried(*STAGES)


@pytest.mark.slow
def test_smoke_run_writes_every_stage_s_figures(tmp_path, capsys):
    """The command line runs in this process (run_entry: a process of its own would import torch again, seconds);
    each stage it starts is a process of its own, as always."""
    out = tmp_path / "gpu_check.json"
    from tests.test_bench_overhead import expected_environment, recorded_environment

    code, printed, err = run_entry(SCRIPT, ["--smoke", *UNHURRIED, "--out", str(out)], capsys)
    assert code == 0, err[-3000:]
    report = json.loads(out.read_text())
    # the fields of every benchmark's JSON (scripts/bench_env.py): "device" was "cpu (<processor>)", no "hardware"
    assert recorded_environment(report) == expected_environment() and report["smoke"] is True
    assert f"gpu_check on cpu ({expected_environment()['hardware']}), torch " in printed
    stages = report["stages"]
    assert {s: e["status"] for s, e in stages.items()} == dict.fromkeys(STAGES, "ok"), {
        s: e.get("log_tail") for s, e in stages.items()}
    tests = stages["pytest"]["figures"]["tests"]
    assert {name.split("[")[1]: t["outcome"] for name, t in tests.items()} == {"cpu]": "passed", "cuda]": "skipped"}
    assert all("CUDA" in t["reason"] for t in tests.values() if t["outcome"] == "skipped")
    rows = stages["precision"]["figures"]["rows"]
    assert {(r["amp"], r["fused"]) for r in rows} == {(a, f) for a in ("fp16", "bf16") for f in (True, False)}
    assert all(r["step_ms"] > 0 and r["img_per_s"] > 0 for r in rows)
    overhead = stages["overhead"]["figures"]
    assert set(overhead["step_over_baseline"]) == {"cd", "tweo", "tweo_plain"} and overhead["cd_apply_ms"] > 0
    pipelines = stages["quant"]["figures"]["pipelines"]
    assert set(pipelines) == {"percentile", "repq", "aphq", "gplq"}
    assert all(p["ratio_vs_fp"] > 0 for p in pipelines.values())
    assert stages["aphq_unit"]["figures"]["extrapolated"]["unit_s"] > 0
    assert (tmp_path / stages["quant"]["log"]).read_text()  # each stage's log next to the JSON


def test_a_stage_past_its_budget_is_killed_and_recorded(tmp_path, capsys):
    """The driver runs in this process (its command line as a process: the smoke test above); the stage it
    kills is a process of its own, as always."""
    gpu_check = load_script("gpu_check")
    out = tmp_path / "gpu_check.json"
    argv = ["--smoke", *unhurried(), "--out", str(out), "--stages", "aphq_unit"]
    gpu_check.main([*argv, "--budget", "aphq_unit=0.5"])
    entry = json.loads(out.read_text())["stages"]["aphq_unit"]
    # killed at its budget: the status says so; the time only rules out a kill that waited for the stage
    assert entry["status"] == "timeout" and entry["seconds"] < 300 and entry["budget_s"] == 0.5
    with pytest.raises(SystemExit) as refused:  # never replaces its outputs unasked
        gpu_check.main(argv)
    assert str(refused.value.code).startswith("error: ") and "--overwrite" in str(refused.value.code)
    assert json.loads(out.read_text())["stages"]["aphq_unit"] == entry


def stand_in_python(tmp_path, monkeypatch, prelude: str) -> None:
    """The driver starts its stages with sys.executable: here a stand-in that runs `prelude` (Python, with ROOT
    defined) and then the stage's command line as python would, so that a stage process can be changed."""
    prelude_path = tmp_path / "prelude.py"
    prelude_path.write_text(f"import os, runpy, signal, sys\nROOT = {ROOT!r}\n{prelude}\n"
                            "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{prelude_path}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sys, "executable", str(wrapper))


@pytest.mark.slow
def test_a_stage_killed_after_its_first_pipeline_keeps_that_pipeline_s_figures(tmp_path, monkeypatch):
    """The quant stage's process is killed as the driver kills one at its budget (SIGKILL to its process group:
    no `finally` runs) while it times the second pipeline: the float timing and the first pipeline's figures,
    written when they were measured, are in the report, and no temporary file is left."""
    stand_in_python(tmp_path, monkeypatch, """
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import bench_quant
forward, calls = bench_quant.timed_forward, []

def timed_forward(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:  # the float model's and percentile's timings are done: repq's starts
        os.killpg(0, signal.SIGKILL)
    return forward(*args, **kwargs)

bench_quant.timed_forward = timed_forward
""")
    gpu_check = load_script("gpu_check")
    out = tmp_path / "gpu_check.json"
    gpu_check.main(["--smoke", *unhurried("quant"), "--out", str(out), "--stages", "quant"])
    entry = json.loads(out.read_text())["stages"]["quant"]
    assert entry["status"] == "error" and "figures_error" not in entry  # ended by the signal, not by itself
    assert list(entry["figures"]["pipelines"]) == ["percentile"]
    assert entry["figures"]["fp_forward_s"] > 0 and entry["figures"]["pipelines"]["percentile"]["forward_s"] > 0
    assert sorted(os.listdir(tmp_path / "gpu_check_logs")) == [".gpu_check", "quant.log"]  # its mark and log


def test_an_unreadable_figures_file_is_recorded_and_the_next_stage_runs(tmp_path, monkeypatch):
    """A stage that leaves a torn figures file: the driver records why and keeps the file; the next stage runs
    and its figures are read. Each stage's environment carries CUBLAS_WORKSPACE_CONFIG, set by the driver when
    unset (PyTorch reads it at a process's first cuBLAS call), kept as given otherwise. The stand-in stages
    write their figures without Python's start-up."""
    script = tmp_path / "python"  # $1 the script, $3 the stage, $5 its figures file
    script.write_text('#!/bin/sh\ncase "$3" in precision) printf \'{"rows": [{"amp"\' > "$5" ;;\n'
                      '*) printf \'{"cublas": "%s"}\' "$CUBLAS_WORKSPACE_CONFIG" > "$5" ;; esac\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sys, "executable", str(script))
    gpu_check = load_script("gpu_check")
    for given, expected in ((None, ":4096:8"), (":16:8", ":16:8")):
        if given is None:
            monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
        else:
            monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", given)
        out = tmp_path / f"gc_{expected.replace(':', '_')}.json"
        report = gpu_check.main(["--smoke", *unhurried("precision", "overhead"), "--out", str(out), "--stages",
                                 "precision", "overhead"])
        stages = json.loads(out.read_text())["stages"]
        assert stages == report["stages"]
        torn = out.parent / f"{out.stem}_logs" / "precision.figures.json"
        assert stages["precision"]["status"] == "error" and stages["precision"]["figures"] == {}
        assert str(torn) in stages["precision"]["figures_error"] and torn.read_text() == '{"rows": [{"amp"'
        assert stages["overhead"] == {**stages["overhead"], "status": "ok", "figures": {"cublas": expected}}
        if given is None:  # set for the stages only
            assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


@pytest.mark.parametrize("stage", ["overhead", "aphq_unit"])
def test_a_stage_keeps_each_figure_as_soon_as_it_is_measured(tmp_path, monkeypatch, stage):
    """The stage stopped inside its work (here by an exception in the next piece, in this process; in the
    driver by a SIGKILL): the figures file holds what came before. overhead: the baseline's row, stopped in
    CD's `apply` timing; aphq_unit: the Hessian batch and the first timed iteration, stopped at the next."""
    gpu_check = load_script("gpu_check")
    name = {"overhead": "bench_overhead", "aphq_unit": "bench_aphq_block"}[stage]
    bench = load_script(name)
    monkeypatch.setitem(sys.modules, name, bench)  # the module the stage imports

    def stopped(*args, **kwargs):
        raise RuntimeError("stopped")

    if stage == "overhead":
        monkeypatch.setattr(bench, "measure_apply", stopped)
    else:
        reconstruct = bench.reconstruct_unit

        def two_iterations_then_stop(*args, progress, **kwargs):
            stamps = []

            def each(metrics):
                if len(stamps) == 2:
                    stopped()
                stamps.append(metrics)
                progress(metrics)

            return reconstruct(*args, progress=each, **kwargs)

        monkeypatch.setattr(bench, "reconstruct_unit", two_iterations_then_stop)
    path = tmp_path / "figures.json"
    threads = gpu_check.torch.get_num_threads()
    try:
        with pytest.raises(RuntimeError, match="stopped"):
            gpu_check.STAGES[stage](Namespace(smoke=True), gpu_check.Partial(str(path)), "cpu")
    finally:
        gpu_check.torch.set_num_threads(threads)
    figures = json.loads(path.read_text())
    if stage == "overhead":
        assert [r["method"] for r in figures["rows"]] == ["baseline"] and figures["rows"][0]["step_ms"] > 0
    else:
        assert figures["hessian_batch_s"] > 0 and figures["timed_iters"] == 1 and figures["iter_s"] > 0


@pytest.mark.parametrize("argv,named", [
    (["--budget", "pytest=0"], "--budget pytest=0: a stage's budget must be more than 0"),
    (["--stages", "quant", "quant"], "argument --stages: quant given twice; give each value once"),
    (["--budget", "aphq_unit=30", "--stages", "pytest"], "--budget aphq_unit=30: aphq_unit is not among"),
    (["--budget", "quant=10", "--budget", "quant=20"], "--budget quant=10 and --budget quant=20: two budgets"),
    (["--total-budget", "4.5"], "argument --total-budget: 4.5: must be at least 5"),  # no stage would start
], ids=["zero-budget", "stage-twice", "budget-of-a-stage-not-run", "two-budgets-for-one-stage", "total-below-floor"])
def test_stages_and_budgets_that_cannot_be_meant_are_refused(tmp_path, capsys, argv, named):
    out = tmp_path / "gpu_check.json"
    code, _, err = run_entry(SCRIPT, ["--smoke", "--out", str(out), *argv], capsys)
    assert code == 2 and err.startswith("error: ") and named in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not (tmp_path / "gpu_check_logs").exists()


def stand_in_stage(tmp_path, monkeypatch, body: str) -> None:
    """The driver's stage processes replaced by a shell script running `body` ($3 the stage, $5 its figures
    file): no Python start-up."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sys, "executable", str(script))


def test_figures_an_earlier_call_left_are_not_reported_as_this_call_s(tmp_path, monkeypatch, capsys):
    """--overwrite reuses the logs folder: a stage that dies before its first write had reported the figures file
    an earlier call left there as its own. That file and its partial writes (engine.run_dir.partial_path's names)
    are removed before the stage starts; a file of another name is left alone."""
    from engine.run_dir import partial_path

    out, logs = tmp_path / "gc.json", tmp_path / "gc_logs"
    logs.mkdir()  # an earlier call's report and logs folder (--overwrite replaces only those)
    out.write_text('{"device": "cpu", "smoke": true, "started": "", "stages": {}}')
    (logs / ".gpu_check").write_text("scripts/gpu_check.py")
    stale = logs / "quant.figures.json"
    stale.write_text('{"pipelines": {"repq": {"ratio_vs_fp": 1.01}}, "note": "stale"}')
    cut = partial_path(str(stale))
    with open(cut, "w") as f:
        f.write('{"note": "stale partial"}')
    foreign = logs / "quant.figures.json.partial-notes"  # not a name the script writes
    foreign.write_text("a user's file")
    stand_in_stage(tmp_path, monkeypatch, 'test -e "$5" && echo "figures file present at start"; exit 2')
    code, _, err = run_entry(SCRIPT, ["--smoke", *unhurried("quant"), "--stages", "quant", "--out", str(out),
                                      "--overwrite"], capsys)
    entry = json.loads(out.read_text())["stages"]["quant"]
    assert entry["status"] == "error" and entry["figures"] == {} and "present at start" not in entry["log_tail"]
    assert not stale.exists() and not os.path.exists(cut) and foreign.read_text() == "a user's file"
    assert code == 1 and "quant (error)" in err


def refused_unchanged(tmp_path, capsys, argv: list[str], named: str) -> None:
    """gpu_check.py `argv` exits with one `error:` line naming `named`, and every file under tmp_path is as it was."""
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code = str(run_entry(SCRIPT, argv, capsys)[0])  # sys.exit's message: the process prints it, exits with 1
    assert code.startswith("error: ") and named in code and "\n" not in code, code
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_overwrite_replaces_only_a_report_and_logs_folder_it_wrote(tmp_path, monkeypatch, capsys):
    """--overwrite had replaced any file at --out (a JSON of another's at the default gpu_check.json in the working
    folder) and written and removed files of its names (quant.log) in any folder at <out stem>_logs. It replaces
    only its own report (a JSON object with its keys) and reuses only a logs folder it made (or an empty one); the
    refusal is one line, before anything is written."""
    stand_in_stage(tmp_path, monkeypatch, 'printf "{}" > "$5"')
    out, logs = tmp_path / "gc.json", tmp_path / "gc_logs"
    argv = ["--smoke", *unhurried("quant"), "--stages", "quant", "--out", str(out)]
    assert run_entry(SCRIPT, argv, capsys)[0] == 0
    assert run_entry(SCRIPT, [*argv, "--overwrite"], capsys)[0] == 0  # its own report and logs: replaced
    out.write_text('{"device": "cuda", "stages": ["theirs"]}')  # another's JSON at --out
    refused_unchanged(tmp_path, capsys, [*argv, "--overwrite"], str(out))
    out.unlink()
    shutil.rmtree(logs)
    logs.mkdir()
    (logs / "quant.log").write_text("notes")  # a folder the script did not make, at its logs folder's name
    refused_unchanged(tmp_path, capsys, [*argv, "--overwrite"], str(logs))
    (logs / "quant.log").unlink()
    assert run_entry(SCRIPT, [*argv, "--overwrite"], capsys)[0] == 0  # an empty logs folder: nothing of another's


@pytest.mark.parametrize("body,stages,expected", [
    ('printf "{}" > "$5"', ["precision", "overhead"], {"precision": "ok", "overhead": "ok"}),
    ('test "$3" = precision && exit 1; printf "{}" > "$5"', ["precision", "overhead"],
     {"precision": "failed", "overhead": "ok"}),
    ('printf "{}" > "$5"; sleep 6', ["precision", "overhead"], {"precision": "timeout", "overhead": "not_run"}),
], ids=["all-ok", "a-stage-failed", "timeout-and-not-run"])
def test_the_exit_status_is_1_unless_every_stage_is_ok(tmp_path, monkeypatch, capsys, body, stages, expected):
    """Exit 0 only when every stage ended `ok`; the JSON is written either way. The third case: a total budget of
    the 5 s floor, which the first stage spends."""
    stand_in_stage(tmp_path, monkeypatch, body)
    out = tmp_path / "gc.json"
    argv = unhurried(*stages)
    if "timeout" in expected.values():
        argv[argv.index("--total-budget") + 1] = "5"
    code, _, err = run_entry(SCRIPT, ["--smoke", *argv, "--stages", *stages, "--out", str(out)], capsys)
    assert {s: e["status"] for s, e in json.loads(out.read_text())["stages"].items()} == expected
    assert code == (0 if set(expected.values()) == {"ok"} else 1), err
    assert ("not ok: " in err) == (code == 1)


def test_stages_run_in_the_documented_order_whatever_the_order_of_stages(tmp_path, monkeypatch):
    """`--stages quant pytest` had run quant first: the tests run first, as the docstring says (a stand-in
    python records the order in which the stages start)."""
    order = tmp_path / "order"
    script = tmp_path / "python"  # $3 the stage, $5 its figures file
    script.write_text(f'#!/bin/sh\necho "$3" >> {order}\nprintf "{{}}" > "$5"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sys, "executable", str(script))
    gpu_check = load_script("gpu_check")
    report = gpu_check.main(["--smoke", "--out", str(tmp_path / "gc.json"), "--stages", "aphq_unit", "quant",
                             "pytest"])
    assert order.read_text().split() == ["pytest", "quant", "aphq_unit"] == list(report["stages"])


@pytest.fixture
def cuda_tf32_switches():
    """The CUDA TF32 switches, set as a stage process starts (torch's defaults: matmuls at full fp32, cuDNN at TF32)
    and put back as they were, through torch >= 2.9's fp32_precision where it exists (the legacy flags' setters turn
    an inherited 'none' into 'ieee')."""
    import torch

    matmul, conv = torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)
    saved = [(o, getattr(o, "fp32_precision", None)) for o in (matmul, conv) if o is not None]
    legacy = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32) if saved[0][1] is None else None
    matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    yield lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if legacy is not None:
        matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = legacy
    for backend, precision in saved:
        if precision is not None:
            backend.fp32_precision = precision


@pytest.mark.parametrize("stage, tf32", [("precision", True), ("overhead", True), ("quant", False),
                                         ("aphq_unit", False), ("pytest", False)])
def test_only_the_training_stages_run_at_tf32(tmp_path, monkeypatch, cuda_tf32_switches, stage, tf32):
    """precision and overhead time training, which train.py runs with TF32 for float32 matmuls; quant and aphq_unit
    time evaluate.py's work (the float forward the quantized one is divided by, APHQ's reconstruction), which runs
    at torch's defaults (matmuls at full fp32): under TF32 the quant stage's float forward was not evaluate.py's. A
    stand-in stage reads the switches in the child's place, on a CPU, as they are on the GPU machine."""
    gpu_check = load_script("gpu_check")
    seen = []

    def stand_in(args, out, device):
        seen.append((device, cuda_tf32_switches()))
        return 0

    monkeypatch.setitem(gpu_check.STAGES, stage, stand_in)
    assert gpu_check.run_stage(Namespace(smoke=False, stage=stage, stage_out=str(tmp_path / "figures.json"))) == 0
    assert seen == [("cuda", (tf32, True))]


def test_every_test_file_with_a_gpu_mark_is_in_the_pytest_stage():
    # The stage names its files instead of collecting all of tests/ (one module that cannot import there ended it with
    # 0 tests run): a new file with a gpu-marked test that is not listed would be silently left out of the GPU check
    import ast

    def has_gpu_mark(path):  # `pytest.mark.gpu` in the code (a decorator, a param's marks, pytestmark), not in a string
        with open(path) as f:
            tree = ast.parse(f.read())
        return any(isinstance(node, ast.Attribute) and node.attr == "gpu" and isinstance(node.value, ast.Attribute)
                   and node.value.attr == "mark" for node in ast.walk(tree))

    marked = sorted(f"tests/{name}" for name in os.listdir(os.path.join(ROOT, "tests"))
                    if name.endswith(".py") and has_gpu_mark(os.path.join(ROOT, "tests", name)))
    gpu_check = load_script("gpu_check")
    assert sorted(gpu_check.GPU_TEST_FILES) == marked
    assert gpu_check.PYTEST[-len(marked):] == gpu_check.GPU_TEST_FILES and "tests" not in gpu_check.PYTEST


def test_a_test_file_that_cannot_import_is_an_error_and_the_other_files_run(tmp_path):
    # transformers 5.17 on the GPU image against a module-level import: that file's error, the other files' tests
    (tmp_path / "test_gc_unimportable.py").write_text("import not_a_module_anywhere_gc\n\n\ndef test_x():\n    pass\n")
    (tmp_path / "test_gc_fine.py").write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_on_gpu():\n    pass\n\n\n"
                                              "def test_not_gpu():\n    pass\n")
    gpu_check = load_script("gpu_check")
    out = gpu_check.Partial(str(tmp_path / "figures.json"))
    files = [str(tmp_path / "test_gc_unimportable.py"), str(tmp_path / "test_gc_fine.py")]
    assert gpu_check.run_pytest([*gpu_check.PYTEST_OPTIONS, *files], 60, out) == 1
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["counts"] == {"error": 1, "passed": 1}, figures
    (error,) = [t for name, t in figures["tests"].items() if "unimportable" in name]
    assert "not_a_module_anywhere_gc" in error["message"]


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (an orphan's zombie waits for a reaper: it is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_kills_the_stage_with_what_it_started_and_the_report_names_it(tmp_path, monkeypatch, name):
    """`timeout -s TERM` on the call (or Ctrl-C): the driver died with no JSON written (the first write came after the
    first stage), and its stage, in a session of its own, ran on with its children, out of any budget. Now the JSON
    holds the environment before the first stage starts; a stop signal kills the stage's process group (the stage
    and the child it started; the group in the driver's session, so a runner that ends a command's leftovers ends
    it too), the JSON names the stage `interrupted` and the later ones `not_run`, and the driver exits 128 + the
    signal. The driver runs in a fork of this process: a signal to this one would end the test run, and a fresh
    process would import torch again."""
    import signal
    import time

    pids = tmp_path / "pids"  # the stage's pid and its child's, once both run
    stand_in_stage(tmp_path, monkeypatch, f'sleep 600 & echo "$$ $!" > {pids}.tmp; mv {pids}.tmp {pids}; wait')
    out = tmp_path / "gc.json"
    gpu_check = load_script("gpu_check")
    argv = ["--smoke", *unhurried("pytest", "quant"), "--stages", "pytest", "quant", "--out", str(out)]
    driver = os.fork()
    if driver == 0:  # the driver: its exit status is main's (SystemExit's code), 3 for anything else
        code = 3
        try:
            gpu_check.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
        finally:
            os._exit(code)
    status = None  # the driver's wait status, once reaped
    stage = child = None
    try:
        deadline = time.monotonic() + 120
        while not pids.exists():
            ended, exited = os.waitpid(driver, os.WNOHANG)
            if ended:
                status = exited
            assert time.monotonic() < deadline and status is None, "the driver started no stage"
            time.sleep(0.05)
        stage, child = map(int, pids.read_text().split())
        assert os.getpgid(stage) == stage == os.getpgid(child) and os.getsid(stage) == os.getsid(0)
        first = json.loads(out.read_text())  # written before the stage started
        assert first["stages"] == {} and first["device"] == "cpu" and first["hardware"] and first["torch"]
        os.kill(driver, getattr(signal, name))
        _, status = os.waitpid(driver, 0)
    finally:  # nothing of this test is left behind, whatever failed
        if status is None:
            os.kill(driver, signal.SIGKILL)
            os.waitpid(driver, 0)
        for pid in (stage, child):
            if pid and running(pid):
                os.kill(pid, signal.SIGKILL)
    assert os.waitstatus_to_exitcode(status) == 128 + getattr(signal, name)
    report = json.loads(out.read_text())
    assert report["interrupted"] == name
    assert report["stages"]["pytest"]["status"] == "interrupted" and name in report["stages"]["pytest"]["reason"]
    assert report["stages"]["quant"] == {"status": "not_run", "reason": f"the driver got {name} before it"}
    deadline = time.monotonic() + 30  # the group was killed before the driver wrote: gone by now, or nearly
    while running(stage) or running(child):
        assert time.monotonic() < deadline, f"stage {stage} running: {running(stage)}, its child: {running(child)}"
        time.sleep(0.05)



def test_the_smoke_budgets_fit_the_default_total_budget():
    """Raised to about twice a loaded 2-core CPU's stage times (the old ones, 30 s for overhead and 60 s for quant,
    were run past there), they still add up to no more than the default --total-budget, as the GPU budgets do: no
    stage is cut to what the earlier ones left."""
    gpu_check = load_script("gpu_check")
    assert sum(gpu_check.SMOKE_BUDGETS.values()) <= gpu_check.TOTAL_BUDGET_S
    assert sum(gpu_check.BUDGETS.values()) <= gpu_check.TOTAL_BUDGET_S
