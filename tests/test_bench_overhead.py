"""scripts/bench_overhead.py runs end to end on CPU (one tiny configuration per sweep)
and writes its outputs."""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import cd_models  # noqa: F401  (one torch thread)
import pytest

from tests.conftest import DEBUG_CONFIG, ROOT, load_script, run_main


def _bench():
    return load_script("bench_overhead")


def expected_environment() -> dict:
    """The hardware and software fields every benchmark JSON records on this CPU (scripts/bench_env.py), from
    their sources: the processor's model name as /proc/cpuinfo gives it, and the installed versions."""
    import platform

    import timm
    import torch

    names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")] \
        if os.path.exists("/proc/cpuinfo") else []
    return {"device": "cpu", "hardware": names[0] if names else platform.processor(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "timm": timm.__version__}


def recorded_environment(report: dict) -> dict:
    return {k: report.get(k, "missing") for k in expected_environment()}


@pytest.mark.slow
def test_bench_overhead_cpu_smoke(tmp_path, capsys):
    """Both sweeps of every method, the plain TWEO form among them, and outputs that are never replaced."""
    bench = _bench()
    args = ["--device", "cpu", "--small", "--batches", "2", "--widths", "64", "--width-batch", "2",
            "--warmup", "1", "--steps", "1", "--out", str(tmp_path)]
    report = bench.main(args)
    assert {(r["sweep"], r["method"]) for r in report["rows"]} == {(s, m) for s in ("batch", "width")
                                                                    for m in ("baseline", "cd", "tweo", "tweo_plain")}
    assert all(r["step_ms"] > 0 and r["peak_mib"] is None for r in report["rows"])
    assert json.load(open(tmp_path / "overhead.json"))["memory"] == "n/a"
    assert recorded_environment(json.load(open(tmp_path / "overhead.json"))) == expected_environment()
    assert (tmp_path / "overhead.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "cd/base" in printed and "tweo_plain/base" in printed
    cd_rows = [r for r in report["rows"] if r["method"] == "cd"]
    assert all(r["cd_apply_ms"] > 0 and r["cd_floor_ms"] > 0 and r["precision"] == "fp32" for r in cd_rows)
    written = (tmp_path / "overhead.json").read_text()
    with pytest.raises(SystemExit, match="overhead.json.*already exist.*choose another --out or add --overwrite"):
        bench.main(args)
    assert (tmp_path / "overhead.json").read_text() == written


def test_bench_overhead_apply_only(tmp_path):
    bench = _bench()
    report = bench.main(["--device", "cpu", "--small", "--apply-only", "--widths", "64",
                         "--precision", "bf16", "--warmup", "1", "--steps", "2", "--out", str(tmp_path)])
    (row,) = report["apply_only"]
    assert row["precision"] == "bf16" and row["apply_over_floor"] > 0
    assert json.load(open(tmp_path / "apply.json"))["apply_only"][0]["embed_dim"] == 64
    assert recorded_environment(json.load(open(tmp_path / "apply.json"))) == expected_environment()


def run_commands_with(monkeypatch, run) -> None:
    """The protocol's train.py commands go to `run(cmd, cwd=...)` (a subprocess.run stand-in) instead of
    launchers.ForwardedSignals.run, which starts them in a process of their own."""
    import launchers
    monkeypatch.setattr(launchers.ForwardedSignals, "run", lambda self, cmd: run(cmd, cwd=self.cwd).returncode)


def train_in_this_process(run):
    """subprocess.run with a `python .../train.py ...` command run in this process (conftest.run_main: the
    __main__ block of train.py with that command line, a process would import torch again); any other command
    as `run` runs it."""
    def run_or_train(cmd, *args, **kwargs):
        if list(cmd[:1]) == [sys.executable] and os.path.basename(cmd[1]) == "train.py":
            return subprocess.CompletedProcess(cmd, run_main(cmd[1], list(cmd[2:])))
        return run(cmd, *args, **kwargs)
    return run_or_train


def test_epochs_protocol_reads_epoch_times_of_real_runs(tmp_path, monkeypatch):
    """--protocol epochs: train.py runs whose loop logs epoch/train_seconds; two epochs per run, the mean
    over them, the same without the first, and ratios to the baseline. The runs' train.py commands, as the
    protocol builds them, run in this process (train_in_this_process)."""
    run_commands_with(monkeypatch, train_in_this_process(subprocess.run))
    monkeypatch.chdir(ROOT)  # where the protocol starts its runs
    out = tmp_path / "ep"
    report = _bench().main(["--protocol", "epochs", "--recipe", "configs/debug/tiny.yaml",
                            "--global-batch", "16", "--batches", "8", "--models", "--methods", "baseline",
                            "tweo_plain", "--epochs", "2", "--runs", "1", "--out", str(out),
                            "data.synthetic_train_size=32", "data.synthetic_val_size=8"])
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"baseline", "tweo_plain"} and all(r["epochs_timed"] == [2] for r in rows.values())
    for method, row in rows.items():
        run_dir = out / "runs" / f"vit_nano_bs8_{method}_run0"
        metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        seconds = [m["epoch/train_seconds"] for m in metrics if "epoch/train_seconds" in m]
        assert row["epoch_s"] == pytest.approx(sum(seconds) / 2) and row["epoch_s_after_first"] == seconds[1]
        assert row["peak_mib"] is None  # CPU: no max_memory_allocated
    assert rows["baseline"]["epoch_s_over_baseline"] == 1.0
    assert rows["tweo_plain"]["epoch_s_over_baseline"] == pytest.approx(
        rows["tweo_plain"]["epoch_s"] / rows["baseline"]["epoch_s"])
    assert (out / "epochs.json").exists() and (out / "epochs.png").stat().st_size > 0
    # the runs' own machine and versions, from their train.logs: this CPU's, where they ran
    assert recorded_environment(json.load(open(out / "epochs.json"))) == expected_environment()


@pytest.mark.slow
def test_epochs_protocol_refuses_a_launcher_it_cannot_start_before_the_first_run(tmp_path):
    bench = _bench()
    with pytest.raises(SystemExit, match=r"^error: --launcher 'no-such-torchrun --nproc_per_node=4': "
                                         r"'no-such-torchrun' is not an executable program on PATH"):
        bench.main(["--protocol", "epochs", "--launcher", "no-such-torchrun --nproc_per_node=4",
                    "--out", str(tmp_path / "ep")])
    assert not (tmp_path / "ep").exists()  # nothing ran


def test_epochs_protocol_refuses_a_plan_the_launcher_cannot_run_before_the_first_run(tmp_path):
    # the paper's 256 per GPU at global batch 1024 needs 4 processes: on 8 it used to fail after the other runs
    bench = _bench()
    with pytest.raises(SystemExit, match=r"per-GPU batch 256 on 8 process\(es\) does not divide --global-batch "
                                         r"1024"):
        bench.main(["--protocol", "epochs", "--launcher", "torchrun --nnodes=1 --nproc_per_node=8",
                    "--out", str(tmp_path / "ep")])
    # a recipe in updates (a language model's) would ignore the protocol's epochs: refused, not timed
    with pytest.raises(SystemExit, match=r"the cd run of \S+ at batch 8: sched.epochs=5 would be ignored"):
        bench.main(["--protocol", "epochs", "--recipe", "configs/lm/kjv_nano.yaml", "--global-batch", "16",
                    "--batches", "8", "--models", "--methods", "cd", "--out", str(tmp_path / "ep")])
    assert not (tmp_path / "ep").exists()  # nothing ran
    # scripts/overhead_epochs.py run itself, a per-GPU batch of 0 for the width sweep: a usage error, not a
    # ZeroDivisionError in the plan's check
    epochs = load_script("overhead_epochs")
    with pytest.raises(SystemExit) as refused:
        epochs.main(["--recipe", "configs/debug/tiny.yaml", "--global-batch", "16", "--batches", "--models",
                     "vit_nano", "--width-batch", "0", "--out", str(tmp_path / "ep")])
    assert refused.value.code == 2


@pytest.mark.parametrize("override, key", [("train.batch_size_per_gpu=8", "train.batch_size_per_gpu"),
                                           ("sched={epochs: 1}", "sched.epochs"),
                                           ("model.name=vit_tiny", "model.name"),
                                           ("cd.enabled=true", "cd.enabled"),
                                           ("tweo={enabled: true}", "tweo.enabled")])
def test_epochs_protocol_refuses_an_override_of_a_key_it_sets(tmp_path, override, key):
    """An override for every run came after the protocol's own keys: train.batch_size_per_gpu=8 timed every
    --batches row at 8, sched.epochs=1 ran 1 epoch under a report of --epochs, cd.enabled=true timed CD in the
    rows named "baseline"."""
    with pytest.raises(SystemExit, match=rf"error: .* would replace {key}, which the protocol sets"):
        _bench().main(["--protocol", "epochs", "--recipe", "configs/debug/tiny.yaml", "--global-batch", "16",
                       "--batches", "4", "8", "--models", "--methods", "baseline", "--epochs", "2", "--runs", "1",
                       "--out", str(tmp_path / "ep"), override])
    assert not (tmp_path / "ep").exists()  # nothing ran


def test_epochs_protocol_refuses_a_recipe_that_turns_a_method_on(tmp_path):
    """A recipe with CD on made every "baseline" and "tweo" row a CD run: refused before anything runs."""
    recipe = tmp_path / "tiny_cd.yaml"
    with open(os.path.join(ROOT, "configs", "debug", "tiny.yaml")) as f:
        recipe.write_text(f.read() + "cd:\n  enabled: true\n")
    with pytest.raises(SystemExit, match=r"^error: --recipe .*tiny_cd.yaml sets cd.enabled=true, so its baseline "
                                         r"runs would not be baseline"):
        _bench().main(["--protocol", "epochs", "--recipe", str(recipe), "--global-batch", "16", "--batches", "8",
                       "--models", "--methods", "baseline", "--epochs", "1", "--runs", "1",
                       "--out", str(tmp_path / "ep")])
    assert not (tmp_path / "ep").exists()  # nothing ran


def test_epochs_protocol_refuses_an_unknown_model_before_the_first_run(tmp_path, capsys):
    """The plan's check read each run's config but not its model name: the batch sweep's runs trained, then the
    width sweep's unknown model failed in train.py."""
    with pytest.raises(SystemExit, match=r"^error: the baseline run of no_such_model at batch 8: unknown model "
                                         r"'no_such_model'.*\)$"):
        _epochs_script().main(["--recipe", "configs/debug/tiny.yaml", "--global-batch", "16", "--batches", "8",
                               "--models", "no_such_model", "--width-batch", "8", "--methods", "baseline",
                               "--epochs", "1", "--runs", "1", "--out", str(tmp_path / "ep")])
    assert not (tmp_path / "ep").exists()  # nothing ran


def test_an_override_written_after_the_models_is_an_override_not_a_model(tmp_path):
    """--models takes every word after it: sched.epochs=1 there was a model name to time (and the override was
    lost); as an override, it is refused as one of the protocol's keys before anything runs."""
    with pytest.raises(SystemExit, match=r"error: sched.epochs=1 would replace sched.epochs, which the protocol"):
        _bench().main(["--protocol", "epochs", "--recipe", "configs/debug/tiny.yaml", "--global-batch", "16",
                       "--batches", "4", "--methods", "baseline", "--epochs", "2", "--runs", "1",
                       "--out", str(tmp_path / "ep"), "--models", "vit_nano", "sched.epochs=1"])
    assert not (tmp_path / "ep").exists()  # nothing ran


@pytest.mark.parametrize("launcher, world", [("", 1), ("torchrun --nproc_per_node=4", 4),
                                             ("torchrun --nnodes 2 --nproc-per-node 8", 16),
                                             ("torchrun --nproc_per_node=gpu", None), ("srun python", None)])
def test_launcher_world_size(launcher, world):
    module = load_script("overhead_epochs")
    assert module.launcher_world_size(launcher) == world


@pytest.mark.parametrize("framework", ["plain", "mmengine"])
def test_bench_integrations_prints_a_row_per_framework(framework, capsys, monkeypatch):
    """Each framework's runs train for real; their step times are then replaced by set ones (40 ms without CD,
    50 ms with), so the row must read those times, their ratio with / without and CD's cost with - without."""
    if framework != "plain":
        pytest.importorskip(framework)
    bench = load_script("bench_integrations")
    real, measured = bench.RUNS[framework], []

    def timed_as_set(args, with_cd):
        measured.append(real(args, with_cd=with_cd))
        return 0.050 if with_cd else 0.040

    monkeypatch.setitem(bench.RUNS, framework, timed_as_set)
    bench.main(["--frameworks", framework, "--steps", "2", "--warmup", "1", "--repeats", "1", "--width", "32",
                "--depth", "1", "--batch", "2", "--threads", "1"])
    assert len(measured) == 2 and all(t > 0 for t in measured)  # one run without CD, one with
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {framework} |")]
    assert rows == [f"| {framework} | 40.0 | 50.0 | 1.250 | 10.0 |"]


@pytest.mark.parametrize("framework", ["plain", "hf", "lightning", "mmengine"])
def test_bench_integrations_runs_without_cd_build_no_cd_and_runs_with_cd_one(framework, monkeypatch):
    """Counted at ColinearityDecay's construction, which every integration reaches (was: the MMEngine run
    `import cd.integrations.mmengine` inside a function whose flag was named `cd` replaced the flag by the
    package, so its runs "without CD" ran with it)."""
    if framework != "plain":
        pytest.importorskip({"hf": "transformers"}.get(framework, framework))
    import cd.decay

    bench = load_script("bench_integrations")
    built = []
    original = cd.decay.ColinearityDecay.__init__

    @functools.wraps(original)  # the integrations check their arguments against its signature
    def counted(self, *args, **kwargs):
        built.append(framework)
        original(self, *args, **kwargs)

    monkeypatch.setattr(cd.decay.ColinearityDecay, "__init__", counted)
    args = argparse.Namespace(steps=2, warmup=1, width=32, depth=1, batch=2, threads=1, norms_every=None, total=4)
    bench.RUNS[framework](args, with_cd=False)
    assert built == []
    bench.RUNS[framework](args, with_cd=True)
    assert built == [framework]


def test_bench_integrations_runs_cd_at_each_norms_every_given_one_row_each(capsys, monkeypatch):
    bench = load_script("bench_integrations")
    made = []

    class Recorded(bench.ColinearityDecay):  # what the runs with CD were given
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.norms_every)

    monkeypatch.setattr(bench, "ColinearityDecay", Recorded)
    bench.main(["--frameworks", "plain", "--steps", "2", "--warmup", "1", "--repeats", "1", "--width", "32",
                "--depth", "1", "--batch", "2", "--norms-every", "1", "7"])
    rows = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("| plain")]
    assert rows == ["| plain, norms_every 1", "| plain, norms_every 7"]
    assert made[1:] == [1, 7]  # the first counts the pairs for the header


def test_tf32_on_a_cpu_is_a_usage_error_not_a_row_labelled_tf32(tmp_path, capsys):
    """CPUs have no TF32: the products ran in fp32 under a 'tf32' label."""
    with pytest.raises(SystemExit):
        _bench().main(["--device", "cpu", "--small", "--apply-only", "--precision", "tf32", "--out", str(tmp_path)])
    assert "--precision tf32 on a CPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _epochs_script():
    return load_script("overhead_epochs")


def test_epochs_protocol_sets_each_runs_keys_and_summarises_by_hand():
    """One timed run's config (the docstring's protocol keys, the method's own settings, then the user's), and
    the summary of epoch records written out by hand: the mean over all epochs, without each run's first, and
    the peak memory as the maximum over runs."""
    epochs = _epochs_script()
    args = argparse.Namespace(recipe="configs/debug/tiny.yaml", global_batch=16, epochs=2, overrides=["data.root=/d"])
    assert epochs.run_config(args, "tweo_plain", "vit_nano", 8, 2, "/o/r") == (
        ["configs/debug/tiny.yaml", "configs/method/tweo.yaml"],
        ["model.name=vit_nano", "train.batch_size=16", "train.batch_size_per_gpu=8", "sched.epochs=2",
         "sched.warmup_epochs=0", "train.eval_every_epochs=2", "train.seed=2", "out_dir=/o/r", "tweo.form=plain",
         "data.root=/d"])
    runs = [[{"epoch/train_seconds": 4.0, "epoch/max_mem_mib": 100.0},
             {"epoch/train_seconds": 2.0, "epoch/max_mem_mib": 300.0}],
            [{"epoch/train_seconds": 6.0, "epoch/max_mem_mib": 200.0}, {"epoch/train_seconds": 3.0},
             {"epoch/train_seconds": 1.0}]]
    assert epochs.summarise(runs) == {"epoch_s": 16 / 5, "epoch_s_after_first": 2.0, "peak_mib": 300.0,
                                      "epochs_timed": [2, 3]}
    # a run resumed after its second epoch: the resumed job's first epoch (8 s) began cold too
    resumed = [[{"epoch/train_seconds": s, "epoch/first_in_process": cold} for s, cold in
                [(6.0, True), (2.0, False), (8.0, True), (3.0, False)]]]
    assert epochs.summarise(resumed)["epoch_s_after_first"] == 2.5


def test_epochs_protocol_times_each_run_in_its_own_folder(tmp_path, monkeypatch):
    """--runs 2 with a stand-in for train.py (it writes the epoch times of its seed, and leaves a finished
    run as it is, as train.py does): each run has its folder, and the ratios are method over baseline."""
    epochs = _epochs_script()
    started = []

    def stand_in(cmd, cwd):
        value = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in cmd if "=" in a and not a.startswith("-")}
        out, seed = value["out_dir"], int(value["train.seed"])
        started.append(os.path.relpath(out, tmp_path))
        scale = 2.0 if "configs/method/cd.yaml" in cmd else 1.0
        os.makedirs(out, exist_ok=True)
        metrics = os.path.join(out, "metrics.jsonl")
        if not os.path.exists(metrics):
            with open(metrics, "w") as f:
                for seconds in (2 + seed, 1 + seed):
                    f.write(json.dumps({"epoch/train_seconds": scale * seconds}) + "\n")
        return subprocess.CompletedProcess(cmd, 0)

    run_commands_with(monkeypatch, stand_in)
    argv = ["--recipe", "configs/debug/tiny.yaml", "--global-batch", "16", "--batches", "8", "--models",
            "--methods", "baseline", "cd", "--epochs", "2", "--runs", "2", "--out", str(tmp_path)]
    report = epochs.main(argv)
    assert started == [f"runs/vit_nano_bs8_{m}_run{r}" for m in ("baseline", "cd") for r in (0, 1)]
    rows = {r["method"]: r for r in report["rows"]}
    # baseline: runs [2, 1] and [3, 2]; cd: twice that
    assert (rows["baseline"]["epoch_s"], rows["baseline"]["epoch_s_after_first"]) == (2.0, 1.5)
    assert (rows["cd"]["epoch_s"], rows["cd"]["epoch_s_after_first"]) == (4.0, 3.0)
    assert rows["cd"]["epoch_s_over_baseline"] == 2.0 and rows["baseline"]["epoch_s_over_baseline"] == 1.0
    # the machine and versions are the runs' own (their train.logs), as bench_overhead.py and bench_quant.py's fields:
    # the stand-in writes no train.log, so none is known, and this process's are no stand-in for them
    assert recorded_environment(json.loads((tmp_path / "epochs.json").read_text())) == dict.fromkeys(
        expected_environment())
    # the same command again: the report is never replaced without --overwrite, and no run starts
    saved = (tmp_path / "epochs.json").read_text()
    with pytest.raises(SystemExit, match=r"epochs\.json.*already exist.*choose another --out or add --overwrite"):
        epochs.main(argv)
    assert (tmp_path / "epochs.json").read_text() == saved and len(started) == 4


def logged_job(out_dir: str, device: str, gpu_name: str = "") -> None:
    """One job's environment line in the train.log of `out_dir`, written by train.py's own logging
    (engine/runinfo.py) for one process on `device`; a CUDA device's name is `gpu_name` (CUDA answers it there:
    this machine need not have a GPU)."""
    import logging
    from unittest import mock

    import torch

    from engine.distributed import DistInfo
    from engine.runinfo import log_environment, setup_logging
    try:
        with mock.patch.object(torch.cuda, "get_device_name", lambda device=None: gpu_name):
            setup_logging(out_dir, is_main=True)
            log_environment(logging.getLogger("train"), DistInfo(0, 1, 0, torch.device(device)))
    finally:
        for handler in [h for h in logging.getLogger().handlers if getattr(h, "_cd_run", False)]:
            logging.getLogger().removeHandler(handler)
            handler.close()


def test_the_epochs_report_names_the_device_its_runs_trained_on(tmp_path, monkeypatch):
    """epochs.json's device and hardware were this process's, worked out from train.device after all the runs:
    with train.device=cuda and no GPU here (srun from a head node), asking CUDA for the device's name raised after
    the results table and no epochs.json / epochs.png was written; with auto, the head node's processor was named.
    They are the runs' own, as each job's train.log records them (a GPU whose name CUDA does not give here)."""
    import timm
    import torch

    gpu = "NVIDIA Stand-in GPU 80GB"

    def stand_in(cmd, cwd):
        out = next(a.split("=", 1)[1] for a in cmd if a.startswith("out_dir="))
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.write("".join(json.dumps({"epoch/train_seconds": s}) + "\n" for s in (2.0, 1.0)))
        logged_job(out, "cuda", gpu)
        return subprocess.CompletedProcess(cmd, 0)

    run_commands_with(monkeypatch, stand_in)
    report = _epochs_script().main(["--recipe", "configs/debug/tiny.yaml", "--global-batch", "16", "--batches", "8",
                                    "--models", "--methods", "baseline", "--epochs", "2", "--runs", "2", "--out",
                                    str(tmp_path), "train.device=cuda"])
    runs = {"device": "cuda", "hardware": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
            "timm": timm.__version__}
    assert recorded_environment(json.loads((tmp_path / "epochs.json").read_text())) == runs
    assert recorded_environment(report) == runs and (tmp_path / "epochs.png").stat().st_size > 0


def test_the_runs_environment_is_every_job_s_and_none_where_no_job_states_it(tmp_path):
    """A run resumed on another GPU, a run on a CPU and a lost log: each field lists the jobs' distinct values in
    order; where no log states one, every field is None, not this process's."""
    epochs = _epochs_script()
    gpu_run, cpu_run = tmp_path / "gpu", tmp_path / "cpu"
    gpu_run.mkdir(), cpu_run.mkdir()
    logged_job(str(gpu_run), "cuda", "GPU A")
    logged_job(str(gpu_run), "cuda", "GPU B")  # resumed elsewhere
    logged_job(str(cpu_run), "cpu")
    lost = str(tmp_path / "lost" / "train.log")
    env = epochs.run_environment([str(gpu_run / "train.log"), str(cpu_run / "train.log"), lost])
    assert (env["device"], env["hardware"]) == ("cuda; cpu", f"GPU A; GPU B; {expected_environment()['hardware']}")
    assert (env["torch"], env["timm"]) == (expected_environment()["torch"], expected_environment()["timm"])
    assert epochs.run_environment([lost]) == dict.fromkeys(expected_environment())


def test_epochs_protocol_reads_its_command_line_with_overhead_epochs_forms(tmp_path, monkeypatch, capsys):
    """`--batches` with no value is overhead_epochs.py's 'skip the sweep' (its --help), but `--protocol epochs
    --batches --models vit_nano` was refused by --protocol step's parser ('expected at least one argument') before
    overhead_epochs.py read it. It runs the width sweep alone, as overhead_epochs.py itself does with that command
    line (the runs: a stand-in for train.py); `--protocol epochs --help` lists overhead_epochs.py's options."""
    started = []

    def stand_in(cmd, cwd):
        out = next(a.split("=", 1)[1] for a in cmd if a.startswith("out_dir="))
        started.append(os.path.relpath(out, tmp_path))
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.write("".join(json.dumps({"epoch/train_seconds": s}) + "\n" for s in (2.0, 1.0)))
        return subprocess.CompletedProcess(cmd, 0)

    run_commands_with(monkeypatch, stand_in)
    argv = ["--recipe", "configs/debug/tiny.yaml", "--global-batch", "16", "--batches", "--models", "vit_nano",
            "--width-batch", "8", "--methods", "baseline", "--epochs", "2", "--runs", "1"]
    direct = _epochs_script().main(argv + ["--out", str(tmp_path / "direct")])
    report = _bench().main(["--protocol", "epochs", *argv, "--out", str(tmp_path / "bench")])
    assert [(r["sweep"], r["model"], r["batch"]) for r in report["rows"]] == [("width", "vit_nano", 8)]
    assert report["rows"] == direct["rows"]
    assert started == [f"{out}/runs/vit_nano_bs8_baseline_run0" for out in ("direct", "bench")]
    with pytest.raises(SystemExit) as shown:
        _bench().main(["--protocol", "epochs", "--help"])
    printed = capsys.readouterr().out
    assert shown.value.code == 0 and "--models" in printed and "--protocol" in printed


def test_a_relative_out_is_the_folder_under_the_directory_the_command_runs_in(tmp_path, monkeypatch):
    """The runs start in the repository root and this script read their folders from where it ran: a relative
    --out given elsewhere was trained into under the root, then its metrics.jsonl was looked for here (a traceback
    after the first run). Both are --out under the directory the command runs in. The stand-in for train.py
    resolves out_dir from the folder it is started in, as train.py does (writing nothing outside tmp_path)."""
    trained = []

    def stand_in(cmd, cwd):
        out = os.path.join(cwd, next(a.split("=", 1)[1] for a in cmd if a.startswith("out_dir=")))
        trained.append(out)
        if os.path.commonpath([out, str(tmp_path)]) == str(tmp_path):
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "metrics.jsonl"), "w") as f:
                f.write(json.dumps({"epoch/train_seconds": 1.0}) + "\n")
        return subprocess.CompletedProcess(cmd, 0)

    run_commands_with(monkeypatch, stand_in)
    monkeypatch.chdir(tmp_path)
    # the recipe by its absolute path: a relative one starts here too (test_overhead_epochs_paths.py)
    report = _epochs_script().main(["--recipe", DEBUG_CONFIG, "--global-batch", "16", "--batches", "8",
                                    "--models", "--methods", "baseline", "--epochs", "1", "--runs", "1", "--out",
                                    "rel"])
    assert trained == [str(tmp_path / "rel" / "runs" / "vit_nano_bs8_baseline_run0")]
    assert report["rows"][0]["epoch_s"] == 1.0 and (tmp_path / "rel" / "epochs.json").exists()


def test_reported_step_times_are_medians_and_the_ratios_are_to_the_baseline(monkeypatch):
    """Scripted timings in place of the clock: each row's step_ms is the median of its timed steps (not the mean
    or the slowest), CD's apply and floor are the medians of their own interleaved timings, and the table's
    ratios are method / baseline and apply / floor, computed here by hand."""
    bench = _bench()
    steps = {"baseline": [10.0, 11.0, 40.0], "cd": [22.0, 23.0, 90.0], "tweo": [33.0, 30.0, 31.0],
             "tweo_plain": [55.0, 44.0, 45.0]}  # medians 11, 23, 31, 45
    taken = {m: iter(v) for m, v in steps.items()}
    monkeypatch.setattr(bench.Runner, "timed", lambda self, fn: next(taken[self.method]))
    clock = iter([3.0, 1.0, 4.0, 2.0, 30.0, 9.0])  # apply, floor, apply, ...: medians 4 and 2
    monkeypatch.setattr(bench, "timed_ms", lambda fn, device: next(clock))
    args = argparse.Namespace(warmup=0, steps=3, amp="none", precision="fp32")
    model_kw = dict(embed_dim=64, depth=1, img_size=16, patch_size=8, num_classes=10)
    rows = bench.measure_config(model_kw, 2, args, "cpu")
    medians = {"baseline": 11.0, "cd": 23.0, "tweo": 31.0, "tweo_plain": 45.0}
    assert {r["method"]: r["step_ms"] for r in rows} == medians
    (cd,) = [r for r in rows if r["method"] == "cd"]
    assert (cd["cd_apply_ms"], cd["cd_floor_ms"]) == (4.0, 2.0)
    line = bench.table([dict(r, sweep="batch") for r in rows]).splitlines()[1]
    ratios = " ".join(format(medians[m] / 11.0, "15.3f") for m in ("cd", "tweo", "tweo_plain"))
    assert ratios in line and line.endswith(f"{4.0:8.2f} {2.0:8.2f} {2.0:11.2f}"), line


def test_apply_only_reports_the_median_apply_over_the_median_floor(tmp_path, monkeypatch):
    bench = _bench()
    clock = iter([3.0, 1.0, 4.0, 2.0, 30.0, 9.0])  # apply, floor, apply, ...: medians 4 and 2
    monkeypatch.setattr(bench, "timed_ms", lambda fn, device: next(clock))
    report = bench.main(["--device", "cpu", "--small", "--apply-only", "--widths", "64", "--warmup", "0",
                         "--steps", "3", "--out", str(tmp_path)])
    (row,) = report["apply_only"]
    assert (row["cd_apply_ms"], row["cd_floor_ms"], row["apply_over_floor"]) == (4.0, 2.0, 2.0)


@pytest.mark.parametrize("flag", [["--amp", "fp16"], ["--batches", "4"], ["--width-batch", "4"]])
def test_apply_only_refuses_a_flag_of_the_training_steps(tmp_path, capsys, flag):
    """--apply-only times no training step: --amp, --batches and --width-batch were dropped without a word (and the
    header printed an amp that nothing ran under)."""
    with pytest.raises(SystemExit) as refused:
        _bench().main(["--device", "cpu", "--small", "--apply-only", "--widths", "64", *flag, "--out", str(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and f": {flag[0]}: --apply-only times CD's update alone" in lines[0], lines
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("threads", ["0", "-1"])
def test_bench_overhead_refuses_a_thread_count_below_one(tmp_path, capsys, threads, monkeypatch):
    """--threads 0 was dropped (`if args.threads:`) and the run timed on torch's default threads; -1 was a
    RuntimeError traceback from torch.set_num_threads."""
    import torch

    monkeypatch.setattr(torch, "set_num_threads", lambda n: pytest.fail(f"set_num_threads({n})"))
    with pytest.raises(SystemExit) as refused:
        _bench().main(["--device", "cpu", "--small", "--apply-only", "--widths", "64", "--threads", threads,
                       "--out", str(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1 and f"argument --threads: {threads}: must be at least 1" \
        in lines[0], lines
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("device, fused", [("cuda", True), ("cpu", False)])
def test_the_steps_are_timed_with_the_optimizer_train_py_builds(device, fused):
    # train.py's AdamW is fused on CUDA (GradScaler then needs no host sync per step) and leaves 1-D parameters
    # undecayed; a plain torch AdamW over model.parameters() is neither, so the figures described another path
    bench = _bench()
    model = bench.build_vit(embed_dim=64, depth=1, img_size=32, patch_size=8, num_classes=10, device="cpu")
    optimizer, is_fused = bench.train_optimizer(model, device)  # a CPU model: torch's fused AdamW runs there too
    assert is_fused is fused and bool(optimizer.defaults.get("fused")) is fused
    undecayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert {id(p) for p in model.parameters() if p.ndim <= 1} <= undecayed
    assert any(g["weight_decay"] == 0.05 for g in optimizer.param_groups)
    assert all(g["lr"] == 1e-3 for g in optimizer.param_groups)


@pytest.mark.slow
def test_every_row_says_whether_its_optimizer_was_fused(tmp_path, capsys):
    bench = _bench()
    report = bench.main(["--device", "cpu", "--small", "--batches", "2", "--widths", "64", "--width-batch", "2",
                         "--warmup", "0", "--steps", "1", "--out", str(tmp_path)])
    assert [r["fused"] for r in report["rows"]] == [False] * len(report["rows"])
    assert json.loads((tmp_path / "overhead.json").read_text())["rows"][0]["fused"] is False
    assert capsys.readouterr().out.count("foreach AdamW") == len(report["rows"])


def test_a_step_protocol_flag_under_the_epochs_protocol_says_it_belongs_to_the_step_protocol(capsys):
    """`--protocol epochs --small` was refused as `unrecognized arguments: --small`, though --help lists --small: the
    flags that only --protocol step reads are named as its. Which flags those are is taken from the two parsers' own
    --help (this script's flags that overhead_epochs.py does not take), not from the script's list."""
    import re

    bench = _bench()
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    own = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", capsys.readouterr().out))
    with pytest.raises(SystemExit):
        _epochs_script().main(["--help"])
    epochs = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", capsys.readouterr().out))
    step_only = own - epochs - {"--help", "--protocol"}
    assert step_only == set(bench.STEP_FLAGS)
    values = {"--device": "cpu", "--widths": "64", "--amp": "bf16", "--warmup": "1", "--steps": "1", "--threads": "1",
              "--precision": "fp32", "--norms-every": "1"}
    for flag in sorted(step_only):
        with pytest.raises(SystemExit) as refused:
            bench.main(["--protocol", "epochs", flag, *([values[flag]] if flag in values else []), "--out", "/nowhere"])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("error: ") and f"{flag}: a flag of --protocol step" in err, err


def test_a_cuda_sample_waits_for_earlier_queued_work_before_its_clock_starts(monkeypatch):
    """On CUDA the clock may start only after the device has finished what earlier calls queued (the warm-up
    before the first sample, the floor before each apply): a fake clock and a fake synchronize record the order,
    and no work of fn may fall between a synchronize and the clock's start."""
    bench = _bench()
    events = []
    ticks = iter([100.0, 100.005])
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda *a, **k: events.append("sync"))
    monkeypatch.setattr(time, "perf_counter", lambda: events.append("clock") or next(ticks))
    ms = bench.timed_ms(lambda: events.append("fn"), "cuda")
    assert events == ["sync", "clock", "fn", "sync", "clock"]
    assert ms == pytest.approx(5.0)
    events.clear()
    ticks = iter([1.0, 1.25])
    assert bench.timed_ms(lambda: events.append("fn"), "cpu") == pytest.approx(250.0) and "sync" not in events


def test_a_cuda_sample_synchronizes_the_device_it_times_not_the_current_one(monkeypatch):
    """timed_ms synchronized the current CUDA device (torch.cuda.synchronize()), and none at all for a device string
    other than "cuda": a model on cuda:1 was timed on the clock of the calls that queued its kernels. It is
    bench_quant.timed in ms: the device it is given is synchronized before the clock starts and before it stops."""
    bench = _bench()
    events = []
    ticks = iter([10.0, 10.002])
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda device=None: events.append(f"sync {device}"))
    monkeypatch.setattr(time, "perf_counter", lambda: events.append("clock") or next(ticks))
    ms = bench.timed_ms(lambda: events.append("fn"), "cuda:1")
    assert events == ["sync cuda:1", "clock", "fn", "sync cuda:1", "clock"]
    assert ms == pytest.approx(2.0)


def test_a_method_that_runs_out_of_gpu_memory_leaves_the_others_rows_measured(monkeypatch):
    """On CUDA, TWEO's plain form running out of memory at a large batch (the memory the paper's figure shows
    growing) marked all four methods of the configuration out of memory, the baseline and CD that had been timed
    too, so the table lost the very ratios it is for. A fake runner in place of the model (no GPU here): each
    method's steps take a fixed time, tweo_plain's construction raises CUDA's out-of-memory error."""
    bench = _bench()
    step_ms = {"baseline": 10.0, "cd": 11.0, "tweo": 12.0}

    class FakeRunner:
        def __init__(self, method, model_kw, batch, args, device):
            if method == "tweo_plain":
                raise bench.torch.cuda.OutOfMemoryError("CUDA out of memory")
            self.method, self.fused = method, True

        def step(self):
            pass

        def timed(self, fn):
            return step_ms[self.method]

        def close(self):
            pass

    monkeypatch.setattr(bench, "Runner", FakeRunner)
    monkeypatch.setattr(bench, "measure_apply", lambda *a: {"cd_apply_ms": 2.0, "cd_floor_ms": 1.0,
                                                            "precision": "tf32"})
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(bench.torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(bench.torch.cuda, "max_memory_allocated", lambda *a, **k: 3 * 2 ** 20)
    args = argparse.Namespace(warmup=1, steps=3)
    rows = bench.run_sweep("batch", [(dict(embed_dim=768), 256)], args, "cuda")
    by = {r["method"]: r for r in rows}
    assert set(by) == set(bench.METHODS)
    for method, ms in step_ms.items():
        assert (by[method]["step_ms"], by[method]["peak_mib"], by[method].get("oom")) == (ms, 3.0, None), method
    assert by["cd"]["cd_apply_ms"] == 2.0
    assert by["tweo_plain"]["oom"] is True and by["tweo_plain"]["step_ms"] is None


@pytest.mark.parametrize("flag", [["--widths", "64", "128", "64"], ["--batches", "4", "4"]])
def test_a_width_or_batch_given_twice_is_a_usage_error_before_any_timing(tmp_path, capsys, monkeypatch, flag):
    """--widths 64 64 timed the width twice into two rows of one configuration: the table printed the second alone,
    overhead.json and the plot held both."""
    bench = _bench()
    monkeypatch.setattr(bench, "measure_apply", lambda *a, **k: pytest.fail("timed after all"))
    monkeypatch.setattr(bench, "measure_config", lambda *a, **k: pytest.fail("timed after all"))
    with pytest.raises(SystemExit) as refused:
        bench.main(["--device", "cpu", "--small", *flag, "--out", str(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and f"argument {flag[0]}: {flag[1]} given twice" in lines[0], lines
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("flag", [["--batches", "4", "4"], ["--models", "vit_nano", "vit_nano"],
                                  ["--methods", "baseline", "cd", "baseline"]])
def test_epochs_protocol_refuses_a_value_given_twice_before_the_first_run(tmp_path, capsys, flag):
    """--batches 4 4 ran the same runs (one folder) twice over and printed their row twice, in the table and in
    epochs.json."""
    given = {"--batches": ["8"], "--models": [], "--methods": ["baseline"], flag[0]: flag[1:]}
    argv = ["--recipe", "configs/debug/tiny.yaml", "--global-batch", "16", "--width-batch", "8", "--epochs", "1",
            "--runs", "1", "--out", str(tmp_path / "ep"), *(word for f, v in given.items() for word in (f, *v))]
    with pytest.raises(SystemExit) as refused:
        _epochs_script().main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and f"argument {flag[0]}: {flag[-1]} given twice" in lines[0], lines
    assert not (tmp_path / "ep").exists()  # nothing ran


def canned_sweep(name, configs, args, device):
    """run_sweep's rows for each configuration without timing a step (the outputs are what is under test)."""
    return [{"sweep": name, "method": m, "batch": batch, "embed_dim": kw["embed_dim"], "fused": False,
             "step_ms": 1.0, "peak_mib": None, **({"cd_apply_ms": 1.0, "cd_floor_ms": 1.0} if m == "cd" else {})}
            for kw, batch in configs for m in ("baseline", "cd", "tweo", "tweo_plain")]


OTHERS_FILES = {".json": b'{"name": "someone else\'s table"}\n', ".png": b"\x89PNG\r\n\x1a\nsomeone's figure"}


@pytest.mark.parametrize("foreign", ["apply.json", "overhead.json", "overhead.png"])
def test_overwrite_replaces_only_the_files_bench_overhead_wrote(tmp_path, monkeypatch, foreign):
    """--overwrite replaced any overhead.json / overhead.png / apply.json in --out: a paper's figure or another
    script's JSON of that name was lost. It replaces only its own (a JSON by its keys, a PNG by its text entry
    Source) and refuses any other with one error line before any timing, leaving every file as it was; the
    reference is the files' bytes before."""
    bench = _bench()
    monkeypatch.setattr(bench, "run_sweep", canned_sweep)
    monkeypatch.setattr(bench, "measure_apply", lambda kw, args, device: {"cd_apply_ms": 2.0, "cd_floor_ms": 1.0,
                                                                          "precision": "fp32"})
    argv = ["--device", "cpu", "--small", "--widths", "64", "--out", str(tmp_path)]
    argv += ["--apply-only"] if foreign == "apply.json" else ["--batches", "2"]
    bench.main(argv)
    mine = (tmp_path / foreign).read_bytes()
    bench.main(argv + ["--overwrite"])  # its own: replaced
    (tmp_path / foreign).write_bytes(OTHERS_FILES[os.path.splitext(foreign)[1]])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.setattr(bench, "environment", lambda device: pytest.fail("timed over another's file"))
    with pytest.raises(SystemExit) as refused:
        bench.main(argv + ["--overwrite"])
    message = str(refused.value.code)
    assert message.startswith(f"error: {tmp_path / foreign} is not a file bench_overhead.py wrote"), message
    assert "\n" not in message and "move the file aside" in message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.undo()
    monkeypatch.setattr(bench, "run_sweep", canned_sweep)
    (tmp_path / foreign).write_bytes(mine)  # this script's file again: replaced
    bench.main(argv + ["--overwrite"])


@pytest.mark.parametrize("foreign", ["epochs.json", "epochs.png"])
def test_overwrite_replaces_only_the_files_overhead_epochs_wrote(tmp_path, monkeypatch, foreign):
    """--overwrite replaced any epochs.json / epochs.png in --out, after hours of runs: another script's JSON or a
    paper's figure of that name was lost. It replaces only its own (the JSON by its keys, the PNG by its text entry
    Source) and refuses any other with one error line before the first run starts, leaving every file as it was;
    the reference is the files' bytes before."""
    epochs = _epochs_script()
    started = []

    def stand_in(cmd, cwd):  # a train.py stand-in: a run that timed its one epoch
        out = next(a.split("=", 1)[1] for a in cmd if a.startswith("out_dir="))
        started.append(out)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"epoch/train_seconds": 1.0}) + "\n")
        return subprocess.CompletedProcess(cmd, 0)

    run_commands_with(monkeypatch, stand_in)
    argv = ["--recipe", "configs/debug/tiny.yaml", "--global-batch", "16", "--batches", "8", "--models",
            "--methods", "baseline", "--epochs", "1", "--runs", "1", "--out", str(tmp_path)]
    epochs.main(argv)
    mine = (tmp_path / foreign).read_bytes()
    epochs.main(argv + ["--overwrite"])  # its own: replaced
    (tmp_path / foreign).write_bytes(OTHERS_FILES[os.path.splitext(foreign)[1]])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(SystemExit) as refused:
        epochs.main(argv + ["--overwrite"])
    message = str(refused.value.code)
    assert message.startswith(f"error: {tmp_path / foreign} is not a file overhead_epochs.py wrote"), message
    assert "\n" not in message and "move the file aside" in message and len(started) == 2
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    (tmp_path / foreign).write_bytes(mine)  # this script's file again: replaced
    epochs.main(argv + ["--overwrite"])
    assert len(started) == 3
