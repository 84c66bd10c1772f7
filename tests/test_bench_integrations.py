"""scripts/bench_integrations.py refuses sizes and thread counts it cannot time with one usage error line before
any run: a batch of 0 printed a table timed on empty batches, a width of 0 or a depth of 0 ended in a traceback
(ZeroDivisionError, cd's UnsupportedModelError), 0 or -1 threads in torch's RuntimeError."""
import pytest
import torch

from tests.conftest import load_script


@pytest.mark.parametrize("argv, says", [
    (["--batch", "0"], "argument --batch: 0: must be at least 1"),
    (["--width", "0"], "argument --width: 0: must be at least 1"),
    (["--depth", "0"], "argument --depth: 0: must be at least 1"),
    (["--threads", "0"], "argument --threads: 0: must be at least 1"),
    (["--threads", "-1"], "argument --threads: -1: must be at least 1"),
    (["--width", "129"], "--width 129: its 2 heads (width // 64) do not divide it"),
    (["--norms-every", "10", "1", "10"], "argument --norms-every: 10 given twice"),  # was timed and printed twice
])
def test_sizes_and_threads_it_cannot_time_are_one_error_line_before_any_run(monkeypatch, capsys, argv, says):
    bench = load_script("bench_integrations")
    monkeypatch.setattr(bench, "_table", None)  # reached: a TypeError, not the refusal
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as refused:
            bench.main(["--frameworks", "plain", *argv])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.startswith("error: ") and says in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_framework_named_twice_is_one_error_line_before_any_run(monkeypatch, capsys):
    """`--frameworks plain plain` timed plain twice and printed two rows for it."""
    bench = load_script("bench_integrations")
    monkeypatch.setattr(bench, "_table", None)  # reached: a TypeError, not the refusal
    with pytest.raises(SystemExit) as refused:
        bench.main(["--frameworks", "plain", "plain"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "argument --frameworks: plain given twice; give each value once" in err


@pytest.mark.parametrize("module", ["transformers", "accelerate", "lightning", "mmengine"])
@pytest.mark.parametrize("given", [True, False], ids=["named", "default"])
def test_a_framework_not_installed_is_refused_before_any_run_with_the_extra_that_installs_it(
        monkeypatch, capsys, module, given):
    """A framework not installed (transformers, Lightning and MMEngine are extras) ended the command in a
    ModuleNotFoundError traceback after the frameworks before it were timed. The extra the message names is
    checked against pyproject.toml's: it installs the missing package."""
    import re
    import sys
    import tomllib

    from tests.conftest import ROOT

    bench = load_script("bench_integrations")
    monkeypatch.setattr(bench, "_table", None)  # reached: a TypeError, not the refusal
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: find_spec None, import fails
    framework = {"transformers": "hf", "accelerate": "hf"}.get(module, module)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as refused:
            bench.main(["--frameworks", "plain", framework] if given else [])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert f"{framework} needs {module}, not installed" in err
    (extra,) = re.findall(r'pip install "\.\[(\w+)\]"', err)
    with open(f"{ROOT}/pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(re.match(rf"{module}\b", requirement) for requirement in extras[extra]), (extra, extras[extra])


def test_mmengine_runs_on_the_cpu_as_the_table_says_where_mmengine_found_a_gpu(monkeypatch):
    """The table's header says CPU, and the plain loop, hf (use_cpu) and Lightning (accelerator cpu) run there;
    MMEngine's Runner moves the model to the device it found at import (mmengine.device.get_device: cuda on a GPU
    machine), so its row was timed on the GPU beside CPU rows. Here that import found a GPU (stubbed): the run's
    model stays on the CPU (on a machine without one, the move to cuda was a RuntimeError)."""
    pytest.importorskip("mmengine")
    import argparse

    import mmengine.device.utils

    bench = load_script("bench_integrations")
    monkeypatch.setattr(mmengine.device.utils, "DEVICE", "cuda")
    built, build = [], bench.build_model
    monkeypatch.setattr(bench, "build_model", lambda args: built.append(build(args)) or built[-1])
    args = argparse.Namespace(width=32, depth=1, batch=2, warmup=0, steps=1, total=2, norms_every=None)
    threads = torch.get_num_threads()
    try:
        assert bench.run_mmengine(args, with_cd=True) >= 0
    finally:
        torch.set_num_threads(threads)
    assert [{p.device.type for p in model.parameters()} for model in built] == [{"cpu"}]
