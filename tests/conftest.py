"""Shared test helpers: repository paths and small configs that train in seconds on a CPU."""
from __future__ import annotations

import logging
import os
import signal
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEBUG_CONFIG = os.path.join(ROOT, "configs", "debug", "tiny.yaml")
DEMO_CONFIG = os.path.join(ROOT, "configs", "demo", "vit_digits.yaml")

pytest_plugins = ["detection_runs"]  # the MMDetection tests' sample detector: fixtures sample, trained


def one_thread_per_xdist_worker() -> None:
    """With several pytest-xdist workers (`-n auto`: one per core), torch's default of one thread per core in
    each worker, and in each process a test starts, puts several busy threads on every core. One thread per
    worker, inherited by its child processes through OMP_NUM_THREADS, ran test_nothing_lost.py and
    test_quant_digits.py in 147-213 s against 310-358 s on 2 cores (docs/measurements.md). An
    OMP_NUM_THREADS the user set is kept."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


one_thread_per_xdist_worker()


def deterministic_cublas_workspace() -> None:
    """PyTorch reads CUBLAS_WORKSPACE_CONFIG once per process, at its first cuBLAS call (the workspace size is kept
    from then on); torch's deterministic mode needs it set by then. train.py sets it (setdefault) only when its
    config asks for deterministic kernels, which in a pytest process comes after earlier tests' CUDA matmuls:
    test_gpu.py's deterministic resume test would run on the default workspace. Set here, before any test (and
    inherited by the processes tests start); a value the user set is kept."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


deterministic_cublas_workspace()


def interrupts_as_in_a_terminal() -> None:
    """A shell without job control starts a background job (`pytest ... &` in a script) with SIGINT ignored,
    and every process inherits that: Python then installs no KeyboardInterrupt handler, so evaluate.py ran to
    the end through the Ctrl-C of test_newcomer, and the handler Preemption restores was SIG_IGN (both tests
    failed that way). The Ctrl-C tests ask what a terminal's foreground job does: Python's handler here, and
    through it (a caught signal is reset to the default at exec) Python's handler in every process a test starts."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


interrupts_as_in_a_terminal()


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are no package), run fresh at each call."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    # a dataclass resolves its string annotations through sys.modules[its module]: registered while it runs,
    # the module imported under the same name elsewhere restored after
    before = sys.modules.get(name)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        if before is None:
            del sys.modules[name]
        else:
            sys.modules[name] = before
    return module



def check_overwrite_keeps_others_files(run, out, foreign: str, other: bytes, error: type, says: str) -> None:
    """The --overwrite contract of a script with fixed-name outputs in `out`: `run(extra_argv)` writes them, replaces
    its own file `foreign` under --overwrite, refuses (raising `error`, one line starting with `says`) when `foreign`
    holds `other` (another's file), leaving every file's bytes as they were, and replaces its own file again."""
    run([])
    mine = (out / foreign).read_bytes()
    run(["--overwrite"])  # its own: replaced
    (out / foreign).write_bytes(other)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(error) as refused:
        run(["--overwrite"])
    message = str(refused.value.code if isinstance(refused.value, SystemExit) else refused.value)
    assert message.startswith(says) and "\n" not in message, message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (out / foreign).write_bytes(mine)  # this script's file again: replaced
    run(["--overwrite"])

def run_entry(path: str, argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python path *argv` (path relative to ROOT), its `__main__` block run
    in this process: each subprocess would import torch again (seconds each). What a process would print
    before the block runs (warnings at import) is not seen here: a test of that runs the entry point as a
    process."""
    code = run_main(path, argv)
    out, err = capsys.readouterr()
    return code, out, err


def quant_option_refusal(tmp_path, capsys, pipeline: str, *overrides: str, config: str = DEMO_CONFIG) -> str:
    """The one `error:` line `evaluate.py --quant <pipeline> --bits w4a4 <overrides>` exits with, on weights that
    do not exist (a refusal of the options must come before the weights file is opened) and no result file."""
    code, _, err = run_entry("evaluate.py", [
        "--config", config, f"model.pretrained={tmp_path / 'w.pt'}", "--quant", pipeline, "--bits", "w4a4",
        *overrides, "--out", str(tmp_path / "r.json")], capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, err
    assert not (tmp_path / "r.json").exists()
    return lines[0]


def run_main(path: str, argv: list[str]) -> int:
    """The exit status of `python path *argv` (path relative to ROOT), its `__main__` block run in this process,
    its output left to the test's capture (run_entry reads it). sys.argv[0] is the script's path relative to the
    working directory (as `python train.py` from the repository root gives it), so messages that quote the
    command read as the real process's. The log handlers the run adds (engine.runinfo.setup_logging) end with
    it, as a process's do: left on the root logger, the one on this test's captured stdout would write later
    tests' records into a closed stream."""
    import runpy

    old = sys.argv
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    # a process's signal handlers end with it: train.py's __main__ installs a SIGTERM recorder
    # (engine/startup_signals.py) that, left here, would make this test process ignore SIGTERM
    stop_handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    script = os.path.relpath(os.path.join(ROOT, path))
    sys.argv = [script, *argv]
    code = None  # a script that returns from its __main__ block ends its process with status 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        code = done.code
    finally:
        sys.argv = old
        for signum, handler in stop_handlers.items():
            signal.signal(signum, handler)
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
    return 0 if code is None else code


def make_folder(root, splits: dict, ext: str = ".png") -> None:
    """An ImageNet-style folder: splits = {split: {class: number of images}} of small random images, named
    <i><ext> (the extension picks PIL's format)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, classes in splits.items():
        for name, count in classes.items():
            os.makedirs(os.path.join(root, split, name), exist_ok=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(
                    os.path.join(root, split, name, f"{i}{ext}"))


def hooked_forward(model, x, modules: dict, record) -> None:
    """One forward of `model` on `x` without gradients, calling `record(name, inputs, output)` for each module of
    `modules` ({name: module}) as it runs; the hooks are removed after it, however it ends."""
    handles = [m.register_forward_hook(lambda _, inputs, out, n=n: record(n, inputs, out)) for n, m in modules.items()]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()


@pytest.fixture(autouse=True)
def end_run_logging():
    """The log handlers a run's logging setup (engine.runinfo.setup_logging) adds end with the test, as they end with
    a process: a test that calls train.main or evaluate.main in this process leaves them on the root logger, where
    the one on that test's captured stdout would take later tests' records into a closed stream (the next run's
    setup removes them, so a test that compares the root logger's handlers would see them go)."""
    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_cd_run", False)]:
        root.removeHandler(handler)
        handler.close()
    logging.captureWarnings(False)  # setup_logging's routing of Python warnings into the log ends with it too


@pytest.fixture
def debug_config(tmp_path):
    """A factory: the tiny debug config with out_dir in tmp_path plus extra key=value overrides."""
    from configs import load_config

    def make(*overrides: str, name: str = "run"):
        return load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / name}", *overrides])

    return make


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller, before pytest-xdist starts its workers
        write_yapf_grammar_cache()


def write_yapf_grammar_cache() -> None:
    """mmengine imports yapf, whose first import in a user account pickles its grammars into the user's cache
    (~/.cache/YAPF) and renames each file into place before closing it (yapf 0.43, grammar.dump): a process
    that loads it in that moment reads a truncated pickle. pytest-xdist's workers import mmengine side by side
    while they collect, and on a fresh machine one of them once failed to collect
    tests/test_cd_integration_mmengine.py that way (EOFError: Ran out of input). Imported once here, in one
    process before the workers start, the cache is written before any worker reads it."""
    import importlib.util

    if importlib.util.find_spec("yapf") is not None:
        import yapf  # noqa: F401  (the import writes the cache)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests are deselected by default (pyproject); a command line `-m` replaces that, so they are
    also skipped wherever no CUDA device is visible."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """The run folder of a vit_nano trained 10 updates on digits, trained once per test process: `checkpoint` copies
    it for each module (trained per module, it was 18 trainings of the same run in the default suite)."""
    import train
    from configs import load_config

    out = tmp_path_factory.mktemp("digits_run")
    train.main(load_config([DEMO_CONFIG], [f"out_dir={out}", "model.name=vit_nano", "train.max_steps=10",
                                           "sched.epochs=1", "sched.warmup_epochs=0",
                                           "log.tensorboard=false"]))
    return out


@pytest.fixture(scope="module")
def checkpoint(digits_run, tmp_path_factory):
    """best.pt of a vit_nano trained 10 updates on digits: weights for evaluate.py's tests. Each module gets its own
    copy of the run folder, as when it trained its own: its tests write results and logs beside the checkpoint."""
    import shutil

    out = tmp_path_factory.mktemp("ckpt")
    shutil.copytree(digits_run, out, dirs_exist_ok=True)
    return str(out / "best.pt")


@pytest.fixture
def one_thread():
    """One torch thread for the duration of a test: tiny tensors run faster, and CI machines are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def adam_step_on_cpu(monkeypatch):
    """Under the meta default (tests/device_utils.py), torch's own Adam / AdamW state init runs with the CPU
    as the default device where that torch version leaves the device of `step` to the default (torch 2.11;
    2.14 gives device="cpu"). Only torch's state init is shielded: this code's tensors stay under test."""
    from device_utils import adam_step_follows_default_device

    if adam_step_follows_default_device():
        # Each class: the first torch.compile (tests/test_cd_pairs.py) gives AdamW an _init_group of its own.
        for cls in (torch.optim.AdamW, torch.optim.Adam):
            monkeypatch.setattr(cls, "_init_group", _on_cpu(cls._init_group))
    yield


def _on_cpu(init_group):
    def wrapped(self, *args, **kwargs):
        with torch.device("cpu"):
            return init_group(self, *args, **kwargs)

    return wrapped


@pytest.fixture
def evaluations(monkeypatch):
    """The JSON names evaluate.main is called for from now on, in order: it stands in, computing nothing (for
    scripts that call it per variant, scripts/quant_sensitivity.py)."""
    import evaluate

    called = []

    def stand_in(args):
        called.append(os.path.basename(args.out))
        return {"quant": {p: {args.bits[0]: {"top1": 50.0}} for p in args.quant}}

    monkeypatch.setattr(evaluate, "main", stand_in)
    return called
