"""The whole GPU check in one command of under 10 minutes on one GPU: `pytest -m gpu`, then the
GPU figures, all written to one JSON.

On a machine with one CUDA GPU, from the repository root, in under 10 minutes (the stages take at most
--total-budget 570 s; no internet or wandb needed), writing the JSON and its logs into one folder:

    PYTHONUNBUFFERED=1 python scripts/gpu_check.py --out gpu_check/gpu_check.json

The same with stage budgets that leave 40 s of a 10-minute command, writing into a folder $OUT of yours
(docs/mini_reproduction.md, "On a GPU"; tests/test_gpu_check_docs.py checks that its flags are this script's and
its budgets fit):

    nvidia-smi -L; python3 -c "import torch,timm;print(torch.__version__,timm.__version__)" && \
        PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out $OUT/gpu_check.json --total-budget 560 \
        --budget pytest=320 --budget precision=50 --budget overhead=50 --budget quant=90 --budget aphq_unit=40

    python scripts/gpu_check.py --stages precision overhead --out figures.json   # some stages only
    python scripts/gpu_check.py --smoke --out /tmp/gpu_check.json                # CPU, 1 to 4 minutes

Stages, in this order (also where --stages names them in another), each in its own process with its own
time budget (a stage that runs past it is killed and recorded as `timeout`, with whatever it had measured
so far; a stage that fails is recorded as `failed` or `error` with the tail of its log; the next stage runs
either way):

    pytest     `pytest -m gpu` over the test files that hold gpu-marked tests (GPU_TEST_FILES; a file that
               fails to import is recorded as an error and the others run), each test stopped after
               --test-timeout seconds; the outcome, duration and skip reason or failure of every test
    precision  fp16 against bf16 on ViT-B/16 at batch 256, fused AdamW and not, through the project's
               build_optimizer and TrainLoop: step time, images/s, peak memory (the loop's epoch costs)
    overhead   CD's and TWEO's step time against the baseline on ViT-B/16 at batch 256, with train.py's
               AdamW (fused), and CD's `apply` against its bare-product floor at TF32
               (scripts/bench_overhead.py, measure_config)
    quant      quantized forward time over float on ViT-B/16 at 224 px, batch 256, for percentile,
               repq, gplq and aphq (scripts/bench_quant.py), fp32 matmuls at full precision as in evaluate.py
    aphq_unit  one APHQ unit's reconstruction iteration and Hessian batch, extrapolated to the official
               counts (scripts/bench_aphq_block.py)

The JSON holds the device (cuda; cpu under --smoke), its hardware (the GPU's name; under --smoke the processor's)
and the torch, CUDA and timm versions, the fields of every benchmark's JSON (scripts/bench_env.py), and per stage its
status (ok, failed: a test failed, error: the stage raised or died, timeout, not_run: the total budget was
spent, or a stop signal came before it, interrupted: killed by a stop signal), seconds, budget, figures and log file;
it is written before the first stage starts (the environment alone) and again after each stage, and the stages'
full logs are written next to it (`<out stem>_logs/`),
where a stage's figures file (and any temporary of it) an earlier call left is removed before that stage starts.
--overwrite replaces only a report this script wrote (a JSON object with its REPORT_KEYS) and reuses only a logs
folder it made (marked by its LOGS_MARK file) or an empty one: another's file or folder there is refused. Every
stage writes its figures whole (a temporary file renamed into place) as soon as it has each; a figures
file the driver cannot read is kept there and named in the stage's `figures_error` (a stage that ended
well is then an error). The stage processes get CUBLAS_WORKSPACE_CONFIG=:4096:8 unless it is set
(PyTorch reads it once, at a process's first cuBLAS call: the deterministic CUDA resume test needs it
from the start; tests/conftest.py sets it for a plain `pytest -m gpu`).
The command exits with status 1, after writing the JSON and printing its summary, when a stage is not `ok`
(a test failed, a stage erred, timed out or was not run); 0 when every stage is `ok`. On SIGTERM (`timeout`, a
runner's limit), SIGINT (Ctrl-C) or SIGHUP it kills the stage under way with everything the stage started (each
stage is a process group of its own, in the driver's session), writes the JSON with that stage `interrupted`, the
later ones `not_run` and the signal under "interrupted", and exits with 128 + the signal's number (143 for SIGTERM).
`--smoke` runs every stage small on a CPU (pytest on one test of tests/test_gpu.py: its CPU case runs,
its CUDA case skips), to show that the script works end to end: on a 2-core Intel Xeon VM 52 to 55 s with other jobs
at load 3.5, 3.8 to 4.0 minutes at load 6 to 8 (torch 2.14 and 2.11; docs/measurements.md), within SMOKE_BUDGETS
(about twice each stage's time at that load).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from argparse import Namespace
from typing import Callable, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from configs.cli import OneLineParser, at_least, refuse_repeats  # noqa: E402
from engine import outputs  # noqa: E402
from engine.run_dir import RunDirError, partial_writes_of, refuse_existing_outputs  # noqa: E402
sys.path.insert(0, HERE)
from bench_env import environment  # noqa: E402  (scripts/)

# Seconds per stage on one H100; together below 10 minutes with the processes' start-up.
BUDGETS = {"pytest": 270, "precision": 60, "overhead": 60, "quant": 100, "aphq_unit": 40}
# --smoke's: about twice each stage's time on a loaded 2-core CPU (Intel Xeon VM, load 6 to 8: pytest 37 s, precision
# 38, overhead 44, quant 96, aphq_unit 26; docs/measurements.md), 540 s in all, within the default --total-budget
SMOKE_BUDGETS = {"pytest": 90, "precision": 90, "overhead": 100, "quant": 200, "aphq_unit": 60}
VIT_B = dict(embed_dim=768, depth=12, img_size=224, patch_size=16, num_classes=1000)
TINY = dict(embed_dim=64, depth=2, img_size=32, patch_size=8, num_classes=10)
MIN_STAGE_S = 5  # a stage is started only with at least this many seconds of the total budget left
TOTAL_BUDGET_S = 570.0  # --total-budget's default: the stages of one call of at most 10 minutes
# By these --overwrite knows its own outputs: the report's keys (engine.outputs.refuse_others_files), and in its
# logs folder a file of this name holding SOURCE, written when the folder is made; a non-empty folder without it is
# another's (its stage.log files would be replaced, its stage.figures.json removed)
SOURCE = "scripts/gpu_check.py"
REPORT_KEYS = ("device", "smoke", "started", "stages")
LOGS_MARK = ".gpu_check"


class Partial:
    """A stage's figures, rewritten to its file at every update, so that a stage killed at its time
    budget still leaves what it had measured."""

    def __init__(self, path: str) -> None:
        self.path, self.figures = path, {}

    def update(self, **figures) -> None:
        self.figures.update(figures)
        write_whole(self.path, self.figures)


def write_whole(path: str, data: dict, overwrite: bool = True) -> None:
    """`data` as JSON at `path`, whole or not at all: a process killed mid-write (a stage at its budget, or
    the call's own end) leaves the previous version, never a torn file (engine.outputs.write_json: the temporary is
    no user's file, and an exception removes it; a kill's leftover is removed by collect_figures)."""
    outputs.write_json(path, data, overwrite, indent=1)


# ----------------------------------------------------------------------------------- the stages (child side)
# `pytest -m gpu` over the files that hold gpu-marked tests, named (tests/test_gpu_check.py fails when a file with a
# gpu mark is missing here): collecting all of tests/ for ~30 GPU tests imports every test module, and one that
# cannot import on the GPU machine (other transformers / numpy / Python versions there) ended the stage with 0 tests
# run; --continue-on-collection-errors keeps a listed file's import error to that file (recorded as an error).
GPU_TEST_FILES = ["tests/test_cd_auto_precision_device.py", "tests/test_cd_decay.py",
                  "tests/test_cd_integrations_tf32_bind.py", "tests/test_cd_tf32_device.py", "tests/test_gpu.py",
                  "tests/test_quant_quantile.py"]
PYTEST_OPTIONS = ["-m", "gpu", "--continue-on-collection-errors"]
PYTEST = [*PYTEST_OPTIONS, *GPU_TEST_FILES]
# the smoke run's stand-in runs one test's CPU case and skips its CUDA case
SMOKE_PYTEST = ["-m", "gpu or not gpu", "-k", "fp16_updates", "tests/test_gpu.py"]


def stage_pytest(args, out: Partial, device: str) -> int:
    return run_pytest(SMOKE_PYTEST if args.smoke else PYTEST, args.test_timeout, out)


def run_pytest(selection: list[str], limit: int, out: Partial) -> int:
    """pytest in this process, each test's call stopped by an alarm after `limit` seconds; every test's
    outcome, seconds and skip reason or failure into `out`. Returns 0 (all passed or skipped) or 1."""
    import pytest

    tests: dict = {}

    class Recorder:
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(self, item):
            def expire(signum, frame):
                raise TimeoutError(f"{item.nodeid} ran past the per-test limit of {limit} s")

            previous = signal.signal(signal.SIGALRM, expire)
            signal.alarm(limit)
            try:
                yield
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)

        def pytest_collectreport(self, report):
            if report.failed:  # a test file that cannot be imported: an error under its own name, the others run
                tests[report.nodeid] = {"outcome": "error", "seconds": 0.0, "message": str(report.longrepr)[-2000:]}
                record()

        def pytest_runtest_logreport(self, report):
            entry = tests.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
            entry["seconds"] = round(entry["seconds"] + report.duration, 2)
            if report.skipped:
                entry["outcome"] = "skipped"
                reason = report.longrepr
                entry["reason"] = reason[2] if isinstance(reason, tuple) else str(reason)
            elif report.failed:
                entry["outcome"] = "failed" if report.when == "call" else "error"
                entry["message"] = str(report.longrepr)[-2000:]
            record()

    def record():
        counts = {}
        for t in tests.values():
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        out.update(counts=counts, tests=tests)

    code = pytest.main(["-p", "no:cacheprovider", "-q", "-rfEs", *selection], plugins=[Recorder()])
    out.update(exit_code=int(code))
    return 0 if int(code) in (0, 5) else 1  # 5: nothing collected (no CUDA case anywhere)


def _vit(kw: dict, device: str) -> torch.nn.Module:
    sys.path.insert(0, HERE)
    import bench_overhead

    return bench_overhead.build_vit(device=device, **kw)


def stage_precision(args, out: Partial, device: str) -> int:
    """fp16 against bf16, fused and not: the project's optimizer and loop on synthetic batches; the
    loop's own epoch costs (epoch/train_seconds, epoch/max_mem_mib) over the timed updates."""
    sys.path.insert(0, HERE)
    from bench_quant import FixedOrder
    from configs.schema import OptimConfig
    from engine.loop import TrainBatches, TrainLoop, TrainState
    from engine.optim import build_optimizer
    from engine.precision import grad_scaler

    kw, batch, warmup, steps = ((TINY, 4, 1, 2) if args.smoke else (VIT_B, 256, 3, 10))
    dev = torch.device(device)
    x = torch.randn(batch, 3, kw["img_size"], kw["img_size"], device=dev)
    y = torch.randint(0, kw["num_classes"], (batch,), device=dev)
    rows = []
    for amp in ("fp16", "bf16"):
        for fused in (True, False):
            torch.manual_seed(0)
            model = _vit(kw, device).train()
            optimizer = build_optimizer(model, OptimConfig(fused=fused), lr=1e-3, weight_decay=0.05, device=dev)
            logged: dict = {}
            loop = TrainLoop(model=model, optimizer=optimizer, device=dev, amp=amp, scaler=grad_scaler(amp, dev),
                             compute_loss=lambda m, a, b: torch.nn.functional.cross_entropy(m(a), b),
                             log_every=10 ** 9, log=lambda step, metrics: logged.update(metrics),
                             log_epoch_costs=True)
            state = TrainState()
            loop.run_epoch(TrainBatches([(x, y)] * warmup, FixedOrder()), state, batch)
            logged.clear()
            skipped_in_warmup = state.skipped_steps
            loop.run_epoch(TrainBatches([(x, y)] * steps, FixedOrder()), state, batch)
            seconds = logged["epoch/train_seconds"]
            rows.append({"amp": amp, "fused": fused, "batch": batch, "steps": steps,
                         "step_ms": 1e3 * seconds / steps, "img_per_s": batch * steps / seconds,
                         "peak_mib": logged.get("epoch/max_mem_mib"),
                         "skipped_steps": state.skipped_steps - skipped_in_warmup})
            print(f"  {amp} {'fused' if fused else 'foreach'}: {rows[-1]['step_ms']:.1f} ms/step, "
                  f"{rows[-1]['img_per_s']:.0f} img/s, peak {rows[-1]['peak_mib']} MiB", flush=True)
            out.update(model=kw, rows=rows)
            del model, optimizer, loop
            if device == "cuda":
                torch.cuda.empty_cache()
    ms = {(r["amp"], r["fused"]): r["step_ms"] for r in rows}
    out.update(fp16_over_bf16={"fused": ms["fp16", True] / ms["bf16", True],
                               "foreach": ms["fp16", False] / ms["bf16", False]})
    return 0


def stage_overhead(args, out: Partial, device: str) -> int:
    """bench_overhead.measure_config at one configuration: the four methods' steps and CD's apply, each
    method's row kept as soon as it is measured."""
    sys.path.insert(0, HERE)
    import bench_overhead

    kw, batch = (TINY, 4) if args.smoke else (VIT_B, 256)
    options = Namespace(amp="fp16" if device == "cuda" else "bf16", precision="auto",
                        warmup=1 if args.smoke else 3, steps=2 if args.smoke else 10)
    rows: list[dict] = []

    def keep(row: dict) -> None:  # each method's row as soon as it is measured
        rows.append(row)
        out.update(model=kw, batch=batch, amp=options.amp, rows=rows)

    bench_overhead.measure_config(kw, batch, options, device, on_row=keep)
    by = {r["method"]: r for r in rows}
    base = by["baseline"]["step_ms"]
    cd = by["cd"]
    out.update(step_over_baseline={m: r["step_ms"] / base for m, r in by.items() if m != "baseline"},
               cd_apply_ms=cd["cd_apply_ms"], cd_floor_ms=cd["cd_floor_ms"],
               cd_apply_over_floor=cd["cd_apply_ms"] / cd["cd_floor_ms"], cd_precision=cd["precision"])
    return 0


def stage_quant(args, out: Partial, device: str) -> int:
    """bench_quant over the four pipelines (the slow ones last), writing straight into the stage's figures
    file after the float timing and after each pipeline (whole each time: bench_quant.write_json)."""
    sys.path.insert(0, HERE)
    import bench_quant

    small = ["--img-size", "32", "--depth", "2", "--embed-dim", "64", "--batch", "4", "--calib", "8",
             "--repeats", "2", "--warmup", "1"] if args.smoke else []
    bench_quant.main(["--device", device, "--pipelines", "percentile", "repq", "gplq", "aphq", "--out", out.path,
                      "--overwrite", *small])  # --overwrite: the file is this stage's own
    return 0


def stage_aphq_unit(args, out: Partial, device: str) -> int:
    """bench_aphq_block: the Hessian batch, then the reconstruction iterations, kept after each."""
    sys.path.insert(0, HERE)
    import bench_aphq_block

    small = ["--img-size", "32", "--depth", "2", "--embed-dim", "64", "--block", "blocks.1", "--batch", "4",
             "--images", "8", "--iters", "2"] if args.smoke else ["--iters", "50", "--warmup", "3"]
    bench_aphq_block.main(["--device", device, *small], on_figures=lambda figures: out.update(**figures))
    return 0


STAGES: dict[str, Callable] = {"pytest": stage_pytest, "precision": stage_precision, "overhead": stage_overhead,
                               "quant": stage_quant, "aphq_unit": stage_aphq_unit}


# The stages that time training, run as train.py runs it: TF32 for float32 matmuls and convolutions (train.tf32's
# default). quant and aphq_unit time evaluate.py's work (its float and quantized forwards, APHQ's reconstruction),
# which leaves torch's defaults (fp32 matmuls at full precision): under TF32 the float forward that the quantized
# one is divided by, and APHQ's passes, ran faster than evaluate.py runs them. The tests set their own.
TRAINING_STAGES = ("precision", "overhead")


def run_stage(args) -> int:
    """Child side: one stage, its figures in --stage-out."""
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and args.stage in TRAINING_STAGES:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        return STAGES[args.stage](args, Partial(args.stage_out), device)
    except Exception:  # recorded by the driver as the stage's error, with this traceback in its log
        traceback.print_exc()
        return 2


# ----------------------------------------------------------------------------------- the driver (parent side)
def stage_env() -> dict:
    """The environment of a stage's process: this one's, unbuffered, with cuBLAS's deterministic workspace
    unless one is set. PyTorch reads CUBLAS_WORKSPACE_CONFIG once per process, at its first cuBLAS call:
    train.py sets it only when its config asks (train.deterministic=true), too late for a test after the
    stage's first CUDA matmul (tests/test_gpu.py test_resume_on_device[deterministic-cuda])."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return env


def clear_figures(path: str) -> None:
    """Remove a stage's figures file at `path` and its temporaries, as an earlier call (--overwrite reuses the
    logs folder) left them: a stage that dies before its first write would otherwise report that call's figures
    as its own. Both are this script's names in its own logs folder."""
    for own in [path, *partial_writes_of(path)]:
        if os.path.isfile(own) or os.path.islink(own):
            os.remove(own)


def collect_figures(path: str) -> tuple[dict, Optional[str]]:
    """The figures a stage left at `path` (removed once read; {} when it left none) and, when the file cannot be
    read as a JSON object, why: that file is then kept for a look, and the driver goes on with the next stage."""
    # a write cut short by the kill leaves its temporary (partial_path); the last whole version is at `path`
    for cut in partial_writes_of(path):
        os.remove(cut)
    if not os.path.exists(path):
        return {}, None
    try:
        with open(path) as f:
            figures = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: json's JSONDecodeError, a UnicodeDecodeError
        return {}, f"{path} unreadable ({type(e).__name__}: {e}); kept"
    if not isinstance(figures, dict):
        return {}, f"{path} holds a JSON {type(figures).__name__}, not the figures' object; kept"
    os.remove(path)
    return figures, None


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # `timeout`, Ctrl-C, a closed terminal


class StopSignals:
    """The driver's STOP_SIGNALS while installed (`with`; the previous handlers are put back at its end): the first
    is kept in `got`, and the stage under way (`running`, set by `launch`) is killed with its whole process group at
    once; `launch` records it as `interrupted` and starts none after, and `main` writes the report and exits with 128
    + the signal's number. No exception is raised from the handler, so it cuts no write or wait short."""

    def __init__(self) -> None:
        self.got: Optional[signal.Signals] = None
        self.running: Optional[subprocess.Popen] = None

    def __enter__(self) -> "StopSignals":
        self.got, self.running = None, None
        self.previous = {s: signal.signal(s, self._stop) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _stop(self, signum, frame) -> None:
        self.got = self.got or signal.Signals(signum)
        if self.running is not None:
            kill_group(self.running)


STOP = StopSignals()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the process group of a stage not reaped yet (its pgid is its pid while it is unreaped, and no other
    group can have taken that number), the stage and all it started."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone already
            pass


# The stage's own process group (its pgid its pid), so that one kill takes it with what it started (a test's
# subprocesses); in the driver's session, not a session of its own (start_new_session): a runner that ends the
# processes a command leaves (a remote runner may end all but those in a session of their own) then ends a stage
# whose driver was killed outright (SIGKILL, no handler). process_group= is Python 3.11's; 3.10 sets it in the child.
OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def launch(stage: str, args, figures_path: str, log_path: str, budget: float) -> dict:
    """Run one stage in its own process group, killed (with anything it started) at `budget` seconds, when the driver
    gets a stop signal (StopSignals: status `interrupted`), or when it leaves by an exception: no stage outlives the
    driver's wait for it."""
    cmd = [sys.executable, os.path.abspath(__file__), "--stage", stage, "--stage-out", figures_path,
           "--test-timeout", str(args.test_timeout), *(["--smoke"] if args.smoke else [])]
    env = stage_env()
    clear_figures(figures_path)  # what is read after the stage is then this stage's, or nothing
    start = time.perf_counter()
    code: Optional[int] = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, **OWN_GROUP)
        STOP.running = proc
        try:
            if STOP.got is None:  # else a stop signal came while it was being started: killed below
                code = proc.wait(timeout=budget)  # a stop signal kills it (StopSignals), and the wait returns
        except subprocess.TimeoutExpired:
            pass
        finally:  # past its budget, stopped, or the driver leaving by an exception: the whole group is killed
            STOP.running = None
            if code is None:
                kill_group(proc)
                proc.wait()
    seconds = time.perf_counter() - start
    figures, problem = collect_figures(figures_path)
    # a stage that ended before the stop signal (code 0, 1, 2) keeps its status; one it killed is `interrupted`
    stopped = STOP.got is not None and (code is None or code < 0)
    status = ("interrupted" if stopped else "timeout" if code is None else "ok" if code == 0
              else "failed" if code == 1 else "error")
    if problem and status == "ok":  # its figures are lost: not a stage that worked
        status = "error"
    entry = {"status": status, "seconds": round(seconds, 1), "budget_s": round(budget, 1),
             "log": os.path.relpath(log_path, os.path.dirname(args.out)), "figures": figures,
             **({"reason": f"the driver got {STOP.got.name}; the stage was killed"} if stopped else {}),
             **({"figures_error": problem} if problem else {})}
    if status != "ok":
        with open(log_path) as f:
            entry["log_tail"] = f.read()[-3000:]
    return entry


def refuse_others_outputs(out: str, logs: str) -> None:
    """A RunDirError when --overwrite would replace a report at `out` this script did not write (a JSON without
    REPORT_KEYS), or write and remove files in a non-empty folder at `logs` it did not make (no LOGS_MARK there)."""
    outputs.refuse_others_files([out], SOURCE, json_keys=REPORT_KEYS)
    mark = os.path.join(logs, LOGS_MARK)
    if os.path.isdir(logs) and os.listdir(logs) and not outputs.written_by(mark, SOURCE, csv_fields=[SOURCE]):
        raise RunDirError(f"{logs} is not a logs folder {os.path.basename(SOURCE)} made (its {LOGS_MARK} is not "
                          "there), and --overwrite reuses only those: choose another --out, or move the folder aside")


def stage_budgets(p: argparse.ArgumentParser, args) -> dict[str, float]:
    """Each stage's budget: BUDGETS (SMOKE_BUDGETS) with the --budget items over them. Refused: a stage named
    twice in --stages, a budget of 0 s (a stage that could not start), two budgets for one stage (which one?),
    and a budget for a stage that --stages leaves out (it would be dropped without a word)."""
    refuse_repeats(p, ("--stages", args.stages))
    budgets = dict(SMOKE_BUDGETS if args.smoke else BUDGETS)
    given: dict[str, str] = {}
    for item in args.budget:
        name, _, value = item.partition("=")
        if name not in STAGES or not value.replace(".", "", 1).isdigit():
            p.error(f"--budget {item}: expected STAGE=SECONDS with STAGE one of {', '.join(STAGES)}")
        if float(value) <= 0:
            p.error(f"--budget {item}: a stage's budget must be more than 0 seconds; give e.g. "
                    f"{name}={budgets[name]:g}, or leave {name} out of --stages")
        if name in given:
            p.error(f"--budget {given[name]} and --budget {item}: two budgets for {name}; give one")
        if name not in args.stages:
            p.error(f"--budget {item}: {name} is not among the stages run (--stages {' '.join(args.stages)}); "
                    f"drop the budget, or add {name} to --stages")
        given[name] = item
        budgets[name] = float(value)
    return budgets


def main(argv: Optional[list[str]] = None) -> dict:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check.json",
                   help="the JSON of figures, its logs next to it (default: %(default)s)")
    p.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES), help="default: all")
    p.add_argument("--total-budget", type=at_least(MIN_STAGE_S, float), default=TOTAL_BUDGET_S,
                   help=f"seconds for all stages together (at least {MIN_STAGE_S}); a stage gets at most what is "
                        f"left of it, and is not run with under {MIN_STAGE_S} s left (default: %(default)s)")
    p.add_argument("--budget", action="append", default=[], metavar="STAGE=SECONDS",
                   help="a stage's own budget (repeatable); defaults in BUDGETS")
    p.add_argument("--test-timeout", type=at_least(1), default=150,
                   help="seconds per GPU test, train.compile=true compiles twice (default: %(default)s)")
    p.add_argument("--smoke", action="store_true", help="every stage small, on a CPU")
    p.add_argument("--overwrite", action="store_true",
                   help="replace this script's earlier report at --out and reuse its logs folder")
    p.add_argument("--stage", choices=list(STAGES), help=argparse.SUPPRESS)  # child process
    p.add_argument("--stage-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stage:
        sys.exit(run_stage(args))

    budgets = stage_budgets(p, args)
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA device visible; --smoke runs the stages small on a CPU")
    args.out = os.path.abspath(args.out)
    logs = os.path.splitext(args.out)[0] + "_logs"
    try:
        refuse_existing_outputs([args.out], args.overwrite, folders=[logs])
        if args.overwrite:
            refuse_others_outputs(args.out, logs)
    except RunDirError as e:
        sys.exit(f"error: {e}")
    os.makedirs(logs, exist_ok=True)
    outputs.write_text(os.path.join(logs, LOGS_MARK), SOURCE, overwrite=True)  # the folder is this script's now

    # the fields every benchmark's JSON records (scripts/bench_env.py): the device the stages run on (a GPU is
    # required above, but under --smoke), its hardware (the GPU's or the processor's name) and the versions
    report = {**environment("cpu" if args.smoke else "cuda"), "smoke": args.smoke,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "stages": {}}
    start = time.perf_counter()
    deadline = start + args.total_budget
    print(f"gpu_check on {report['device']} ({report['hardware']}), torch {report['torch']}, CUDA {report['cuda']}, "
          f"timm {report['timm']}", flush=True)

    written = []

    def write() -> None:  # the first write never over a file another command wrote since this one started
        try:
            if args.overwrite and not written:
                outputs.refuse_others_files([args.out], SOURCE, json_keys=REPORT_KEYS)
            write_whole(args.out, report, overwrite=args.overwrite or bool(written))
        except RunDirError as e:
            sys.exit(f"error: {e}")
        written.append(True)

    with STOP:
        write()  # now: a call killed in its first stage still returns the device, hardware and versions
        run_stages(args, budgets, logs, report, deadline, write)
        report["seconds"] = round(time.perf_counter() - start, 1)
        if STOP.got:
            for stage in [s for s in STAGES if s in args.stages and s not in report["stages"]]:
                report["stages"][stage] = {"status": "not_run", "reason": f"the driver got {STOP.got.name} before it"}
            report["interrupted"] = STOP.got.name
        write()
        stopped = STOP.got
    if stopped:
        print(f"interrupted by {stopped.name}: wrote {args.out} (logs in {logs})", file=sys.stderr)
        sys.exit(128 + stopped)
    print(json.dumps(summary(report), indent=1))
    print(f"wrote {args.out} (logs in {logs})")
    return report


def run_stages(args, budgets: dict[str, float], logs: str, report: dict, deadline: float,
               write: Callable[[], None]) -> None:
    """Each stage of --stages in STAGES' order, its entry into `report` and the report written after it."""
    for stage in [s for s in STAGES if s in args.stages]:  # the tests first: a later stage's figures mean less
        if STOP.got:  # a stop signal: no stage after the one it ended
            return
        # the first stage gets the whole total (the parser's floor is MIN_STAGE_S: the microseconds since `start`
        # must not leave it just under the floor, with nothing run); a later one only what is left
        left = deadline - time.perf_counter() if report["stages"] else args.total_budget
        if left < MIN_STAGE_S:
            report["stages"][stage] = {"status": "not_run", "reason": "the total budget was spent"}
            continue
        print(f"[{stage}] up to {min(budgets[stage], left):.0f} s ...", flush=True)
        entry = launch(stage, args, os.path.join(logs, f"{stage}.figures.json"),
                       os.path.join(logs, f"{stage}.log"), min(budgets[stage], left))
        report["stages"][stage] = entry
        print(f"[{stage}] {entry['status']} in {entry['seconds']} s", flush=True)
        if entry["status"] != "ok":
            print(entry.get("log_tail", "")[-1500:], flush=True)
        write()  # after every stage: a call cut short keeps the stages done


def exit_status(report: dict) -> int:
    """0 when every stage ended `ok`, else 1 (naming those that did not, on stderr)."""
    bad = {s: e["status"] for s, e in report["stages"].items() if e["status"] != "ok"}
    if bad:
        print(f"not ok: {', '.join(f'{s} ({status})' for s, status in bad.items())}", file=sys.stderr)
    return 1 if bad else 0


def summary(report: dict) -> dict:
    """The headline figures, for the console."""
    stages = report["stages"]
    fig = {s: e.get("figures", {}) for s, e in stages.items()}
    out: dict = {"device": report["device"], "hardware": report["hardware"],
                 "status": {s: e["status"] for s, e in stages.items()}}
    if "counts" in fig.get("pytest", {}):
        out["pytest"] = fig["pytest"]["counts"]
    if "fp16_over_bf16" in fig.get("precision", {}):
        out["fp16_over_bf16"] = fig["precision"]["fp16_over_bf16"]
    if "step_over_baseline" in fig.get("overhead", {}):  # the stage ran to its end
        out["step_over_baseline"] = fig["overhead"]["step_over_baseline"]
        out["cd_apply_over_floor"] = fig["overhead"]["cd_apply_over_floor"]
    if "pipelines" in fig.get("quant", {}):
        out["quant_over_float"] = {k: v["ratio_vs_fp"] for k, v in fig["quant"]["pipelines"].items()}
    if "unit_s" in fig.get("aphq_unit", {}).get("extrapolated", {}):  # a stage cut short: the Hessian's only
        out["aphq_unit_s"] = fig["aphq_unit"]["extrapolated"]["unit_s"]
    return out


if __name__ == "__main__":
    sys.exit(exit_status(main()))
