"""scripts/bench_aphq_block.py runs end to end on CPU with a tiny ViT and writes its JSON."""
from __future__ import annotations

import json
import statistics
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import load_script


def test_bench_aphq_block_cpu_smoke(tmp_path):
    bench = load_script("bench_aphq_block")
    out = tmp_path / "block.json"
    threads = torch.get_num_threads()
    try:
        result = bench.main(["--img-size", "32", "--depth", "2", "--embed-dim", "64", "--block", "blocks.1",
                             "--batch", "4",
                             "--images", "8", "--iters", "2", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # the script sets the process-wide count
    assert result["timed_iters"] == 2 and result["iter_s"] > 0
    assert result["extrapolated"]["unit_s"] >= result["extrapolated"]["reconstruction_s"] > 0
    assert json.load(open(out))["block"] == "blocks.1"
    # the fields of every benchmark's JSON (scripts/bench_env.py): a "cpu" field and no hardware or CUDA / timm before
    from tests.test_bench_overhead import expected_environment, recorded_environment
    assert recorded_environment(json.load(open(out))) == expected_environment() and "cpu" not in result
    args = ["--img-size", "32", "--depth", "2", "--embed-dim", "64", "--block", "blocks.1", "--batch", "4",
            "--images", "8", "--iters", "2", "--threads", "1", "--out", str(out)]
    with pytest.raises(SystemExit, match="error: .*block.json already exist"):  # before any timing
        bench.main(args)
    with pytest.raises(SystemExit):  # a Hessian batch of 2 images extrapolated as one of 4
        bench.main([*args[:-2], "--images", "2", "--out", str(tmp_path / "other.json")])
    assert not (tmp_path / "other.json").exists()


SMALL = ["--img-size", "32", "--depth", "2", "--embed-dim", "64", "--block", "blocks.1", "--batch", "4",
         "--images", "8", "--threads", "1"]


@pytest.mark.parametrize("warmup, iters", [(0, 1), (0, 3), (2, 2)])
def test_every_iteration_after_the_warmup_is_timed_the_first_from_the_start(monkeypatch, warmup, iters):
    """The progress stamps count from a stamp taken before the first iteration: --warmup 0 --iters 3 timed 2
    iterations (each from the one before it), and --warmup 0 --iters 1 none (a StatisticsError)."""
    bench = load_script("bench_aphq_block")
    reconstruct, seconds = bench.reconstruct_unit, []

    def recording(*args, progress, **kwargs):
        def each(metrics):
            seconds.append(metrics["seconds"])
            progress(metrics)
        return reconstruct(*args, progress=each, **kwargs)

    monkeypatch.setattr(bench, "reconstruct_unit", recording)
    threads = torch.get_num_threads()
    try:
        result = bench.main([*SMALL, "--warmup", str(warmup), "--iters", str(iters)])
    finally:
        torch.set_num_threads(threads)
    assert len(seconds) == warmup + iters
    ends = seconds[warmup:]
    durations = [ends[0] - (seconds[warmup - 1] if warmup else 0.0)] + [b - a for a, b in zip(ends, ends[1:])]
    assert result["timed_iters"] == iters
    assert result["iter_s"] == round(statistics.median(durations), 4) > 0


def test_the_time_a_caller_spends_on_the_figures_is_no_part_of_an_iteration(monkeypatch):
    """gpu_check.py's aphq_unit stage writes the figures file (an fsync'd JSON) after every iteration through
    on_figures: that write fell between two iterations' stamps and was timed, and extrapolated 20,000-fold, as
    reconstruction. A caller that takes 1 s over each call: the iterations of a tiny block (milliseconds) must not
    read as seconds."""
    import time

    bench = load_script("bench_aphq_block")
    calls = []

    def slow_caller(figures):
        calls.append(figures)
        time.sleep(1.0)

    threads = torch.get_num_threads()
    try:
        result = bench.main([*SMALL, "--warmup", "0", "--iters", "3"], on_figures=slow_caller)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 4 and result["timed_iters"] == 3  # after the Hessian batch and after each iteration
    assert 0 < result["iter_s"] < 0.5 and result["iter_s_min_max"][1] < 0.5, result


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_the_hessian_batch_is_timed_warm_and_without_the_float_logits(monkeypatch, warmup):
    """The timed Hessian batch is one perturbed pass pair, as each unit's APH is in the pipeline: the float logits,
    which APHQ computes once for every unit (quant/aphq/pipeline.py fp_logits), and the --warmup batches before it
    (the first backward passes' one-time costs: CUDA's lazy kernel loading, the allocator's growth) are outside it.
    A clock that moves only in the stand-ins: the logits take 100 s, a cold Hessian 1000 s, a warm one 1 s."""
    bench = load_script("bench_aphq_block")
    clock, calls = [0.0], []
    model_logits, hessian = bench.model_logits, bench.perturbation_hessian

    def logits(*args, **kwargs):
        clock[0] += 100.0
        return model_logits(*args, **kwargs)

    def timed_hessian(*args, **kwargs):
        clock[0] += 1000.0 if not calls else 1.0
        calls.append(args[1])
        return hessian(*args, **kwargs)

    monkeypatch.setattr(bench, "model_logits", logits)
    monkeypatch.setattr(bench, "perturbation_hessian", timed_hessian)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(sys.modules["bench_quant"], "time", bench.time)  # bench_quant.timed clocks the Hessian
    threads = torch.get_num_threads()
    try:
        result = bench.main([*SMALL, "--warmup", str(warmup), "--iters", "1"])
    finally:
        torch.set_num_threads(threads)
    assert calls == ["blocks.1"] * (warmup + 1)
    assert result["hessian_batch_s"] == (1000.0 if warmup == 0 else 1.0)
    assert result["extrapolated"]["hessian_s"] == round(result["hessian_batch_s"] * 1024 / 4, 1)


@pytest.mark.parametrize("argv, says", [
    (["--depth", "0"], "argument --depth: 0: must be at least 1"),  # was the model's default depth
    (["--embed-dim", "0"], "argument --embed-dim: 0: must be at least 1"),  # was the model's default width
    (["--img-size", "0"], "argument --img-size: 0: must be at least 1"),
    (["--img-size", "8"], "--img-size 8 is not a multiple of vit_base_patch16_224's patch size 16"),
    (["--model", "nonexistent_model"], "--model nonexistent_model: not a timm model name"),
    (["--model", "resnet18"], "--model resnet18 does not take"),
    (["--embed-dim", "129"], "--embed-dim 129: its 2 heads (dim // 64) do not divide it"),
    (["--threads", "-1"], "argument --threads: -1: must be at least 1"),
    (["--threads", "0"], "argument --threads: 0: must be at least 1"),  # was torch's default, silently
    (["--official-iters", "-5"], "argument --official-iters: -5: must be at least 1"),  # negative seconds
    (["--official-images", "-8"], "argument --official-images: -8: must be at least 1"),
    (["--images", "0"], "argument --images: 0: must be at least 1"),
    (["--overwrite"], "--overwrite replaces the --out file, and no --out is given"),  # was ignored
])
def test_bad_values_are_one_error_line_before_any_timing(monkeypatch, capsys, argv, says):
    bench = load_script("bench_aphq_block")
    monkeypatch.setattr(bench, "perturbation_hessian", None)  # reached: a TypeError, not the refusal
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as refused:
            bench.main(argv)
    finally:
        torch.set_num_threads(threads)
    message = str(refused.value.code) if isinstance(refused.value.code, str) else capsys.readouterr().err
    assert message.startswith("error: ") and says in message and len(message.strip().splitlines()) == 1, message


def test_overwrite_replaces_a_timing_json_of_its_own_and_refuses_another_file(tmp_path, monkeypatch):
    """--overwrite replaced whatever file --out named (an evaluate.py result, another benchmark's JSON) after the
    timing: only a JSON of this script's is replaced; another file is one error line before any timing, and kept."""
    bench = load_script("bench_aphq_block")
    out = tmp_path / "t.json"
    out.write_text('{"model": "vit_small_patch16_224", "fp": {"top1": 79.9}}')
    monkeypatch.setattr(bench, "perturbation_hessian", lambda *a, **k: pytest.fail("timed after all"))
    with pytest.raises(SystemExit) as refused:
        bench.main([*SMALL, "--iters", "1", "--out", str(out), "--overwrite"])
    message = str(refused.value.code)
    assert message.startswith(f"error: {out} is not a file bench_aphq_block.py wrote") and "\n" not in message
    assert json.loads(out.read_text()) == {"model": "vit_small_patch16_224", "fp": {"top1": 79.9}}
    monkeypatch.undo()
    threads = torch.get_num_threads()
    try:
        bench.main([*SMALL, "--iters", "1", "--out", str(tmp_path / "own.json")])
        bench.main([*SMALL, "--iters", "1", "--out", str(tmp_path / "own.json"), "--overwrite"])  # its own: replaced
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "own.json").read_text())["timed_iters"] == 1
