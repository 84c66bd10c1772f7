"""The tools in scripts/: every sweep expands into valid configs; a small sweep trains, evaluates and
tabulates end to end; the benchmarks run in their small CPU modes."""
import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from configs import ConfigError, load_config
from tests.conftest import ROOT, run_main

import bench_pair_check
import bench_quant
import paper_table
import sweep

SWEEPS = sorted(glob.glob(os.path.join(ROOT, "configs", "sweeps", "*.yaml")))


@pytest.mark.parametrize("path", SWEEPS, ids=os.path.basename)
def test_every_sweep_expands_into_valid_configs(path):
    with open(path) as f:
        text = f.read()
    # data.root for the sweeps that need one (not those whose runs set it, nor the embedded data's: the digits
    # demo, the King James Bible)
    needs_root = ("run_keys: [data.root]" not in text and "configs/demo/" not in text
                  and "configs/lm/kjv_" not in text)
    runs = sweep.expand(path, ["data.root=/datasets/imagenet"] if needs_root else [])
    assert runs and len({r["name"] for r in runs}) == len(runs)
    out_dirs = [o for r in runs for o in r["overrides"] if o.startswith("out_dir=")]
    assert len(set(out_dirs)) == len(runs)  # every run writes to its own folder


def test_the_gpu_study_takes_the_offline_copies_for_every_run_and_runs_each_methods_first_seed_first():
    """docs/mini_reproduction.md "On a GPU": the copied data, the half-precision weights and a shorter
    schedule are overrides for the whole sweep, and a sweep cut short has compared all four points."""
    kit = ["data.root=kit/fashion_mnist", "model.pretrained=kit/dinov2_s14_half.safetensors", "sched.epochs=4"]
    runs = sweep.expand(os.path.join(ROOT, "configs", "sweeps", "fashion_mnist_gpu.yaml"), kit)
    assert all(run["overrides"][-len(kit) - 1:-1] == kit for run in runs)
    points = [run["name"].rsplit("_s", 1) for run in runs]
    assert [p for p, s in points[:4]] == ["baseline", "cd1x", "cd100x", "tweo"]
    assert [s for p, s in points] == sorted(s for p, s in points)  # seed 0 of every point, then seed 1, ...
    methods = {}
    for (point, seed), run in zip(points, runs):
        cfg = load_config([os.path.join(ROOT, c) for c in run["configs"]], run["overrides"])
        assert (cfg.model.img_size, cfg.data.root, cfg.sched.epochs, cfg.train.seed) == (224, "kit/fashion_mnist", 4,
                                                                                          int(seed))
        cd = cfg.cd.enabled and (cfg.cd.lam, cfg.cd.lam_per_role["fc2"], cfg.cd.budget)
        methods.setdefault(point, set()).add((cd, cfg.tweo.enabled))  # one setting for all seeds of a point
    assert methods == {"baseline": {(False, False)}, "cd1x": {((0.01, 0.02, True), False)},
                       "cd100x": {((1.0, 2.0, False), False)}, "tweo": {(False, True)}}


def test_a_bad_key_in_a_sweep_names_the_run(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}\nruns:\n  first: [optim.lr=1e-3]\n"
                   "  second: [optim.lrr=1]\n")
    with pytest.raises(ConfigError, match="sweep run 'second'.*'optim.lr'"):
        sweep.expand(str(bad), [])


def test_a_sweep_run_given_as_a_string_is_refused_as_such(tmp_path):
    bad = tmp_path / "string.yaml"
    bad.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}\nruns:\n  a: train.seed=3\n")
    with pytest.raises(ConfigError, match=r"run 'a' must list its config files and overrides, e.g. "
                                          r"a: \[train.seed=3\]"):
        sweep.expand(str(bad), [])


@pytest.mark.parametrize("item, example", [("{optim.lr: 0.01}", r"a: \[optim.lr=0.01\]"),
                                           ("[optim.lr=0.01]", r"a: \[optim.lr=1e-3\]")])
def test_a_sweep_run_item_that_is_a_mapping_or_a_list_is_refused_as_such(tmp_path, item, example):
    """`- optim.lr: 0.01` (a colon for '=') or a nested list was read as its Python text: "unknown config key
    '['optim.lr'"."""
    bad = tmp_path / "s.yaml"
    bad.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}\nruns:\n  a: [{item}]\n")
    with pytest.raises(ConfigError, match=rf"run 'a' lists .*, a YAML (dict|list); its items are config files "
                                          rf"\(.yaml\) and key=value overrides, e.g. {example}"):
        sweep.expand(str(bad), [])


@pytest.mark.parametrize("field, value", [("configs", "configs/debug/tiny.yaml"), ("run_keys", "data.root"),
                                          ("evaluate", "quant.calib_images=8"), ("out_root", ""),
                                          ("out_root", "'  '")])  # blank: runs would write to a folder '  '/<name>
def test_a_sweep_field_of_the_wrong_type_is_refused(tmp_path, field, value):
    """A string where a list belongs would be read letter by letter: run_keys: data.root would guard nothing,
    and data.root=x on the command line would then train every run on x."""
    fields = {"configs": "[configs/debug/tiny.yaml]", "out_root": str(tmp_path), field: value}
    bad = tmp_path / "s.yaml"
    bad.write_text("".join(f"{k}: {v}\n" for k, v in fields.items()) + "runs:\n  a: []\n")
    with pytest.raises(ConfigError, match=f"'{field}' must be a"):
        sweep.expand(str(bad), ["data.root=/x"] if field == "run_keys" else [])


def test_a_sweep_refuses_run_keys_that_are_not_config_keys(tmp_path):
    """run_keys: [data.rooot] guarded nothing: data.root=/x on the command line then trained every run on /x."""
    bad = tmp_path / "s.yaml"
    bad.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}\nrun_keys: [data.rooot]\n"
                   "runs:\n  a: [data.root=/a]\n  b: [data.root=/b]\n")
    with pytest.raises(ConfigError, match=r"run_keys: 'data.rooot' is not a config key; did you mean 'data.root'"):
        sweep.expand(str(bad), ["data.root=/x"])
    # a key into a free-form dict field is a key the runs set like any other: it guards the command line
    good = tmp_path / "g.yaml"
    good.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}\nrun_keys: [model.kwargs.depth]\n"
                    "runs:\n  a: [model.kwargs.depth=2]\n  b: [model.kwargs.depth=3]\n")
    assert len(sweep.expand(str(good), [])) == 2
    with pytest.raises(ConfigError, match=r"model.kwargs.depth=5 would replace a key that each run sets itself"):
        sweep.expand(str(good), ["model.kwargs.depth=5"])


def test_a_sweep_file_with_a_key_twice_is_refused(tmp_path):
    bad = tmp_path / "twice.yaml"
    bad.write_text("configs: [configs/debug/tiny.yaml]\nruns:\n  a: [optim.lr=1e-3]\n  a: [optim.lr=1e-2]\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: .*key 'a' appears twice \(lines 3 and 4\)"):
        sweep.expand(str(bad), [])


def test_a_sweep_refuses_an_override_that_a_run_would_ignore():
    digits = os.path.join(ROOT, "configs", "sweeps", "digits_demo.yaml")
    with pytest.raises(ConfigError, match=r"sweep run 'baseline'.*data.root=/datasets/x would be ignored"):
        sweep.expand(digits, ["data.root=/datasets/x"])
    # cd.* for every run of a sweep whose baseline run sets cd.enabled=false itself: that run says so
    cd_lambda = os.path.join(ROOT, "configs", "sweeps", "cd_lambda.yaml")
    assert sweep.expand(cd_lambda, ["data.root=/datasets/imagenet", "cd.targets=B"])


@pytest.mark.parametrize("launcher, says", [
    ("no-such-launcher-here --nproc_per_node=8", "'no-such-launcher-here' is not an executable program on PATH"),
    ("./no/such/launcher", "'./no/such/launcher' is not an executable program"),
    ("/", "'/' is not an executable program"),  # a folder: a PermissionError traceback
    ("   ", "names no program"),
])
def test_a_sweep_refuses_a_launcher_it_cannot_start_before_any_run(tmp_path, capsys, launcher, says):
    """It was a FileNotFoundError (or PermissionError) traceback at the first run, without the sweep's summary."""
    spec = tmp_path / "tiny_sweep.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\nruns:\n  base: []\n")
    with pytest.raises(SystemExit) as stop:  # one error: line, not a FileNotFoundError traceback mid-sweep
        sweep.main([str(spec), "--run", "--launcher", launcher])
    assert str(stop.value).startswith(f"error: --launcher {launcher!r}: ") and says in str(stop.value)
    assert not (tmp_path / "runs").exists()
    # printing the commands needs no launcher on this machine (they may be meant for another)
    assert sweep.main([str(spec), "--launcher", launcher]) == 0


def test_a_sweep_launcher_under_the_home_folder_is_started_from_there(tmp_path, monkeypatch):
    """--launcher "~/bin/x ..." (quoted: the shell leaves the ~) passed the launcher check, which read ~ as the home
    folder, and then failed with Popen's FileNotFoundError traceback for '~/bin/x': both read it as the home folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "bin").mkdir()
    launcher = tmp_path / "bin" / "x"
    launcher.write_text('#!/bin/sh\necho "$@" > "$HOME/started"\n')
    launcher.chmod(0o755)
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\nruns:\n  base: []\n")
    sweep.main([str(spec), "--run", "--launcher", "~/bin/x --flag"])
    assert (tmp_path / "started").read_text().startswith("--flag train.py --config configs/debug/tiny.yaml")


def test_bench_quant_reports_the_quantized_to_float_ratio():
    result = bench_quant.main(["--device", "cpu", "--model", "vit_tiny_patch16_224", "--img-size", "32",
                               "--depth", "2", "--embed-dim", "64", "--batch", "2", "--calib", "4", "--repeats", "2",
                               "--warmup", "1", "--pipelines", "repq"])
    assert result["fp_forward_s"] > 0 and result["pipelines"]["repq"]["ratio_vs_fp"] > 0


@pytest.mark.parametrize("argv, pairs", [
    (["--model", "vit_tiny_patch16_224"], 12 * 4),  # 12 blocks: qkv, proj, fc1, fc2 each
    (["--lm-config", os.path.join(ROOT, "configs", "lm", "kjv_nano.yaml")], 2 * 4),  # gpt2_nano: 2 blocks
])
def test_bench_pair_check_times_each_part_of_the_check(argv, pairs, capsys):
    result = bench_pair_check.main(argv + ["--repeats", "1", "--device", "cpu"])
    assert result["pairs"] == pairs
    assert all(result[k] > 0 for k in ("find_pairs_s", "meta_check_s", "no_check_s", "forward_s"))
    assert f"{pairs} pairs" in capsys.readouterr().out
    from tests.test_bench_overhead import expected_environment, recorded_environment  # bench_env's fields
    assert recorded_environment(result) == expected_environment() and "cpu" not in result


def test_bench_pair_check_refuses_an_lm_config_that_is_not_one(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("model: [")
    with pytest.raises(SystemExit, match="error: bench_pair_check.py: .*x.yaml"):
        bench_pair_check.main(["--lm-config", str(bad)])


def test_bench_pair_check_refuses_a_model_timm_does_not_have(capsys):
    """An unknown --model was timm's RuntimeError traceback."""
    with pytest.raises(SystemExit) as refused:
        bench_pair_check.main(["--model", "nonexistent"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "--model nonexistent: not a timm model name" in err


def test_bench_quant_times_the_median_after_the_warmup(monkeypatch):
    """timed_forward on a scripted clock: two warm-up passes of 100 s left out, the median of the timed
    1, 2 and 9 s (not their mean 4, nor the median 9 with the warm-up in)."""
    import types

    now = [0.0]
    durations = iter([100.0, 100.0, 1.0, 2.0, 9.0])

    def model(x):
        now[0] += next(durations)

    monkeypatch.setattr(bench_quant, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    assert bench_quant.timed_forward(model, None, torch.device("cpu"), repeats=3, warmup=2) == 2.0


def test_bench_quant_ratio_is_the_quantized_over_the_float_forward(monkeypatch, capsys):
    """Scripted forward times (float 0.5 s, quantized 1.5 s): the JSON and the printed line say 3x float."""
    times = iter([0.5, 1.5])
    monkeypatch.setattr(bench_quant, "timed_forward", lambda *a, **k: next(times))
    result = bench_quant.main(["--device", "cpu", "--model", "vit_tiny_patch16_224", "--img-size", "32",
                               "--depth", "1", "--embed-dim", "64", "--batch", "1", "--calib", "2",
                               "--pipelines", "percentile"])
    entry = result["pipelines"]["percentile"]
    assert result["fp_forward_s"] == 0.5 and entry["forward_s"] == 1.5 and entry["ratio_vs_fp"] == 3.0
    assert "forward 1500.0 ms = 3.00x float" in capsys.readouterr().out


def _finetune_result(root: str, method: str, fp: float, repq: float, max_act=(10.0, 20.0)) -> dict:
    return {"model": "vit_base_patch16_224.orig_in21k", "method": method, "checkpoint": f"{root}/{method}",
            "checkpoint_kind": "best", "data": {"dataset": "folder", "root": f"/data/{root}"}, "fp": {"top1": fp},
            "max_act": {"module": max_act[0], "block": max_act[1]},
            "quant": {"repq": {"w4a4": {"top1": repq}}}}


def test_finetune_layout_has_the_papers_rows_entries_and_average(tmp_path, capsys):
    values = {("pets", "Baseline"): (95.0, 94.0), ("pets", "CD"): (95.5, 95.0),
              ("pets", "TWEO"): (94.0, 93.0),
              ("imagenet", "Baseline"): (82.0, 78.0), ("imagenet", "CD"): (82.5, 79.5),
              ("flowers102", "CD"): (99.0, 98.0)}
    files = []
    for i, ((root, method), (fp, q)) in enumerate(values.items()):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(_finetune_result(root, method, fp, q, (100.0 + i, 200.0 + i))))
        files.append(str(path))
    table = paper_table.main(["--layout", "finetune", *files])
    lines = table.splitlines()
    assert lines[0] == "RepQ-ViT W4A4: FP top-1 / quantized top-1 / drop"
    assert lines[2] == "| Dataset | Baseline | CD | TWEO |"
    body = [ln for ln in lines[4:]]
    # paper order: Flowers102, Pets, ..., ImageNet-1K; a missing entry is '-'
    assert body[0] == "| Flowers102 | - | 99.00 / 98.00 / -1.00 | - |"
    assert body[1] == "| Pets | 95.00 / 94.00 / -1.00 | 95.50 / 95.00 / -0.50 | 94.00 / 93.00 / -1.00 |"
    assert body[2] == "| ImageNet-1K | 82.00 / 78.00 / -4.00 | 82.50 / 79.50 / -3.00 | - |"
    # simple averages over the data sets each method has, flagged when not all three
    cd_fp, cd_q = (99.0 + 95.5 + 82.5) / 3, (98.0 + 95.0 + 79.5) / 3
    assert body[3] == ("| Average | 88.50 / 86.00 / -2.50 (over 2 of 3) | "
                       f"{cd_fp:.2f} / {cd_q:.2f} / {cd_q - cd_fp:+.2f} | "
                       "94.00 / 93.00 / -1.00 (over 1 of 3) |")
    assert body[4] == "| Max. Act. (ImageNet-1K) | 103.00 / 203.00 | 104.00 / 204.00 | - |"


def test_finetune_layout_marks_an_entry_evaluated_with_other_model_kwargs_than_trained():
    """A result evaluated with a model.kwargs override (gelu=tanh on a model trained with the exact GELU) is the
    same weights through another forward: its entries, the maxima it gives and the Average that takes it in are
    marked †, with a note naming both settings, as the rows layout marks its row. The same settings in another
    key order, and a result that records no recipe, are no change."""
    def result(root, method, evaluated, trained):
        return dict(_finetune_result(root, method, 90.0, 80.0), model_kwargs=evaluated,
                    recipe={"model.kwargs": trained})
    same = {"gelu": "tanh", "global_pool": "avg"}
    results = [result("pets", "Baseline", {}, {}), result("pets", "CD", {"gelu": "tanh"}, {}),
               result("imagenet", "CD", dict(reversed(same.items())), same),
               result("imagenet", "Baseline", {"gelu": "tanh"}, {}),
               dict(_finetune_result("flowers102", "CD", 90.0, 80.0), model_kwargs={"gelu": "tanh"})]
    results[3]["quant"] = {"percentile": {"w4a4": {"top1": 70.0}}}  # no RepQ-ViT entry: only its maxima show
    lines = paper_table.finetune_table(results).splitlines()
    lines = lines[lines.index("RepQ-ViT W4A4: FP top-1 / quantized top-1 / drop"):]
    assert lines[4] == "| Flowers102 | - | 90.00 / 80.00 / -10.00 |"
    assert lines[5] == "| Pets | 90.00 / 80.00 / -10.00 | 90.00 / 80.00 / -10.00† |"
    assert lines[6] == "| ImageNet-1K | - | 90.00 / 80.00 / -10.00 |"
    assert lines[7] == "| Average | 90.00 / 80.00 / -10.00 (over 1 of 3) | 90.00 / 80.00 / -10.00† |"
    assert lines[8] == "| Max. Act. (ImageNet-1K) | 10.00 / 20.00† | 10.00 / 20.00 |"
    trained_with = 'evaluated with model.kwargs={"gelu": "tanh"} (trained with {})'
    assert lines[9:] == ["", f"† Pets CD: {trained_with}", f"† ImageNet-1K Baseline: {trained_with}"]


def test_finetune_layout_marks_maxima_over_extra_modules():
    """An ImageNet-1K result whose module maximum also counts modules outside the blocks
    (quant.act_max_extra_modules) is not the paper's maximum: its cell is marked ‡ with a note naming the patterns
    (was: drawn beside the paper's maxima unmarked)."""
    base = _finetune_result("imagenet", "Baseline", 82.0, 78.0)
    cd = _finetune_result("imagenet", "CD", 82.5, 79.5)
    cd["max_act"]["extra_modules"] = ["layers.*.downsample.reduction"]
    lines = paper_table.finetune_table([base, cd]).splitlines()
    assert lines[6] == "| Max. Act. (ImageNet-1K) | 10.00 / 20.00 | 10.00‡ / 20.00 |"
    assert lines[7:] == ["", '‡ ImageNet-1K CD: the module maximum also counts modules outside the blocks: '
                             'quant.act_max_extra_modules=["layers.*.downsample.reduction"]']


def test_finetune_layout_makes_one_table_per_bit_width_and_names_rows_by_data_set():
    """Each (pipeline, bit-width) is a table of its own; a row is the data set: data.root's last folder
    (a trailing slash too), or the name of a built-in data set."""
    pets = _finetune_result("pets", "CD", 95.0, 94.0)
    pets["data"]["root"] = "/data/pets/"
    pets["quant"]["repq"]["w6a6"] = {"top1": 90.0}
    digits = dict(_finetune_result("digits", "Baseline", 97.0, 96.0), data={"dataset": "digits"})
    tables = paper_table.finetune_table([pets, digits]).split("\n\n")
    assert [t.splitlines()[0] for t in tables[::2]] == ["RepQ-ViT W4A4: FP top-1 / quantized top-1 / drop",
                                                        "RepQ-ViT W6A6: FP top-1 / quantized top-1 / drop"]
    assert "| Pets | - | 95.00 / 94.00 / -1.00 |" in tables[1] and "| digits | 97.00 / 96.00 / -1.00 | - |" in tables[1]
    assert "| Pets | - | 95.00 / 90.00 / -5.00 |" in tables[3] and "| digits | - | - |" in tables[3]


def test_finetune_layout_orders_tables_by_the_papers_pipelines_and_rows_by_its_data_sets():
    """Tables in the paper's pipeline order (Percentile, RepQ-ViT, APHQ: not alphabetical), bit-widths ascending;
    rows in Table 3's order, then data sets it does not list by folder name."""
    results = []
    for root in ("zoo", "imagenet", "abc", "pets"):
        r = _finetune_result(root, "CD", 90.0, 80.0)
        r["quant"] = {"aphq": {"w4a4": {"top1": 81.0}}, "repq": {"w6a6": {"top1": 85.0}, "w4a4": {"top1": 80.0}},
                      "percentile": {"w4a4": {"top1": 70.0}}}
        results.append(r)
    tables = paper_table.finetune_table(results).split("\n\n")
    assert [t.splitlines()[0].split(":")[0] for t in tables[::2]] == [
        "Percentile W4A4", "RepQ-ViT W4A4", "RepQ-ViT W6A6", "APHQ W4A4"]
    assert [line.split(" | ")[0] for line in tables[1].splitlines()[2:]] == [
        "| Pets", "| ImageNet-1K", "| abc", "| zoo", "| Average", "| Max. Act. (ImageNet-1K)"]


def test_rows_layout_reads_a_language_models_perplexity_not_a_top1(tmp_path):
    """A language model's result has a perplexity where a classifier's has a top-1: the rows layout tabulates it
    (the check of the numbers it prints asks for fp.ppl, not fp.top1)."""
    path = tmp_path / "lm.json"
    path.write_text(json.dumps({"model": "gpt", "method": "CD", "checkpoint": "lm/best.pt",
                                "fp": {"ppl": 4.25, "ppl_bf16": 4.26}, "max_act": {"module": 9.0, "block": 20.0},
                                "quant": {"rtn": {"w4a16": {"ppl": 5.5}}}}))
    table = paper_table.main([str(path)])
    assert "| gpt | CD |" in table and "4.25" in table and "5.5" in table


def test_finetune_layout_refuses_two_results_for_one_cell_and_out_is_never_replaced(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        path.write_text(json.dumps(_finetune_result("pets", "CD", 95.0, 94.0)))
    with pytest.raises(SystemExit, match="error: two results for data set 'pets' and method 'CD'"):
        paper_table.main(["--layout", "finetune", str(a), str(b)])
    b.write_text(json.dumps(dict(_finetune_result("pets", "Baseline", 95.0, 94.0), model="vit_small_patch16_224")))
    with pytest.raises(SystemExit, match="error: the results are of 2 models"):  # the layout has no model column
        paper_table.main(["--layout", "finetune", str(a), str(b)])
    gpt = dict(_finetune_result("pets", "CD", 95.0, 94.0), fp={"ppl": 30.0})  # a language model's (was a KeyError)
    b.write_text(json.dumps(gpt))
    with pytest.raises(SystemExit, match=r"error: .* has no top-1 \(a language model's result"):
        paper_table.main(["--layout", "finetune", str(b)])
    # values the flags refuse on their own: usage errors (status 2, one line), as argparse's (they exited 1)
    for argv, expected in (([str(a), "--out", str(tmp_path), "--overwrite"], f"--out {tmp_path} is a folder"),
                           (["--layout", "finetune", "--over-seeds", str(a)], "--over-seeds is for the rows layout")):
        with pytest.raises(SystemExit) as refused:
            paper_table.main(argv)
        lines = capsys.readouterr().err.strip().splitlines()
        assert refused.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
    with pytest.raises(SystemExit, match=r"error: --out /proc/table.md: cannot be written"):  # was a traceback
        paper_table.main([str(a), "--out", "/proc/table.md"])
    out = tmp_path / "table.md"
    out.write_text("someone's table\n")
    with pytest.raises(SystemExit, match="already exist.*choose another --out or add --overwrite"):
        paper_table.main(["--out", str(out), str(a)])
    assert out.read_text() == "someone's table\n"
    mine = tmp_path / "mine.md"
    paper_table.main(["--out", str(mine), str(a)])
    paper_table.main(["--out", str(mine), "--overwrite", str(a)])
    assert "| CD |" in mine.read_text()


def test_paper_table_overwrite_replaces_only_a_table_it_wrote(tmp_path, capsys):
    """--out X --overwrite replaced whatever was at X (another run's result file that is not among the inputs, a
    hand-written table, another script's report) with the table. It replaces only a file this script wrote now (the
    marker line it ends its --out files with), and refuses any other with one error line, leaving it as it was; the
    reference is the bytes of the file before."""
    a = tmp_path / "a.json"
    a.write_text(json.dumps(_finetune_result("pets", "CD", 95.0, 94.0)))
    other = tmp_path / "other_run" / "eval_best.json"  # another run's result file, no input of this table
    other.parent.mkdir()
    other.write_text(json.dumps(_finetune_result("pets", "Baseline", 90.0, 80.0)))
    hand = tmp_path / "table.md"
    hand.write_text("| my | notes |\n")
    for path in (other, hand):
        before = path.read_bytes()
        with pytest.raises(SystemExit) as refused:
            paper_table.main(["--out", str(path), "--overwrite", str(a)])
        assert str(refused.value.code).startswith(f"error: --out {path} is not a table paper_table.py wrote")
        assert "\n" not in str(refused.value.code) and path.read_bytes() == before
    ours = tmp_path / "ours.md"
    first = paper_table.main(["--out", str(ours), str(a)])
    assert ours.read_text(encoding="utf-8").startswith(first + "\n")
    a.write_text(json.dumps(_finetune_result("pets", "CD", 96.0, 94.0)))
    second = paper_table.main(["--out", str(ours), "--overwrite", str(a)])  # its own table: replaced
    assert second != first and ours.read_text(encoding="utf-8").startswith(second + "\n")


def test_paper_table_refuses_a_result_of_weights_its_best_pt_no_longer_holds(tmp_path):
    """Training went on after the evaluation and saved a new best.pt: the table showed the old weights' figures
    under the run's name. The fingerprint the result records is computed as evaluate.py computes it (the model
    its loader builds from the checkpoint), not by the check under test."""
    import evaluate
    from configs import config_from_dict
    from engine.checkpoint import load_checkpoint, weights_fingerprint
    from tests.test_mechanism import make_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    checkpoint = make_checkpoint(run / "best.pt", 0)
    payload = load_checkpoint(checkpoint)
    model = evaluate.load_float_model(config_from_dict(payload["config"]), payload,
                                      evaluate.parse_args(["--checkpoint", checkpoint]))
    result = {"model": "vit_nano", "method": "CD", "checkpoint": "/elsewhere/run/best.pt", "weights": "raw",
              "fingerprint": weights_fingerprint(model.state_dict()), "fp": {"top1": 90.0},
              "max_act": {"module": 1.0, "block": 2.0}, "quant": {"repq": {"w4a4": {"top1": 80.0}}}}
    path = run / "eval_best.json"
    path.write_text(json.dumps(result))  # the run folder moved since: its best.pt is the one beside the file
    assert "| vit_nano | CD |" in paper_table.main([str(path)])
    make_checkpoint(run / "best.pt", 1)  # the run trained on and saved a new best
    with pytest.raises(SystemExit, match=rf"error: {path} is stale: it scored other weights than {run}/best.pt "
                                         rf"holds now .* python evaluate.py --checkpoint {run}/best.pt --out {path}"):
        paper_table.main([str(path)])
    links = tmp_path / "links"  # results gathered as links: the checkpoint is beside the file linked to
    links.mkdir()
    (links / "run.json").symlink_to(path)
    with pytest.raises(SystemExit, match=rf"error: {links}/run.json is stale"):
        paper_table.main([str(links / "run.json")])
    # not compared: a result without a fingerprint (older files, detection), one with no checkpoint beside it
    path.write_text(json.dumps({k: v for k, v in result.items() if k != "fingerprint"}))
    assert "| vit_nano | CD |" in paper_table.main([str(path)])
    other = tmp_path / "r.json"
    other.write_text(json.dumps(result))
    assert "| vit_nano | CD |" in paper_table.main([str(other)])


def test_a_result_written_beside_another_runs_best_pt_is_compared_with_the_checkpoint_it_scored(tmp_path):
    """evaluate.py --checkpoint A/best.pt --out B/eval_of_A.json: B's own best.pt holds other weights, which made
    every such file "stale" (and the advice evaluated B's weights into it); A's best.pt, where it still is, is the
    one compared. The fingerprint is computed as evaluate.py computes it (its loader), not by the check."""
    import evaluate
    from configs import config_from_dict
    from engine.checkpoint import load_checkpoint, weights_fingerprint
    from tests.test_mechanism import make_checkpoint

    (tmp_path / "A").mkdir(), (tmp_path / "B").mkdir()
    scored = make_checkpoint(tmp_path / "A" / "best.pt", 0)
    make_checkpoint(tmp_path / "B" / "best.pt", 1)  # another run's weights
    payload = load_checkpoint(scored)
    model = evaluate.load_float_model(config_from_dict(payload["config"]), payload,
                                      evaluate.parse_args(["--checkpoint", scored]))
    result = {"model": "vit_nano", "method": "CD", "checkpoint": scored, "weights": "raw",
              "fingerprint": weights_fingerprint(model.state_dict()), "fp": {"top1": 90.0},
              "max_act": {"module": 1.0, "block": 2.0}, "quant": {"repq": {"w4a4": {"top1": 80.0}}}}
    path = tmp_path / "B" / "eval_of_A.json"
    path.write_text(json.dumps(result))
    assert "| vit_nano | CD |" in paper_table.main([str(path)])
    make_checkpoint(tmp_path / "A" / "best.pt", 1)  # run A trained on: its result is stale
    with pytest.raises(SystemExit, match=rf"error: {path} is stale: it scored other weights than {scored} holds now"):
        paper_table.main([str(path)])


def test_the_ema_weights_of_a_result_are_compared_with_the_checkpoints_ema_weights(tmp_path):
    """evaluate.py --ema records the fingerprint of model_ema: the stale check compares that, not the raw weights."""
    import torch

    from engine.checkpoint import weights_fingerprint
    from tests.test_mechanism import make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "best.pt", 0)
    payload = torch.load(checkpoint)
    payload["model_ema"] = {k: v + 1 if v.is_floating_point() else v for k, v in payload["model"].items()}
    torch.save(payload, checkpoint)
    result = {"model": "vit_nano", "method": "CD", "checkpoint": checkpoint, "weights": "ema",
              "fingerprint": weights_fingerprint(payload["model_ema"]), "fp": {"top1": 90.0},
              "max_act": {"module": 1.0, "block": 2.0}, "quant": {"repq": {"w4a4": {"top1": 80.0}}}}
    path = tmp_path / "eval_best_ema.json"
    path.write_text(json.dumps(result))
    assert "| vit_nano† | CD |" in paper_table.main([str(path)])  # not stale († marks the EMA weights)
    path.write_text(json.dumps(dict(result, weights="raw")))  # the raw weights are other weights
    with pytest.raises(SystemExit, match=rf"error: {path} is stale"):
        paper_table.main([str(path)])


def test_one_weights_file_evaluated_on_other_data_is_two_rows_not_a_copy(tmp_path):
    """Results of one fingerprint are a copy only when evaluated alike; on another val set they are two results."""
    files = []
    for root in ("pets", "cars"):
        path = tmp_path / f"{root}.json"
        path.write_text(json.dumps(dict(_finetune_result(root, "CD", 95.0, 94.0), fingerprint="same")))
        files.append(str(path))
    assert len(paper_table.main(files).splitlines()) == 4
    (tmp_path / "copy.json").write_text((tmp_path / "pets.json").read_text())
    with pytest.raises(SystemExit, match="hold results of the same weights evaluated alike"):
        paper_table.main([*files, str(tmp_path / "copy.json")])


def test_a_copy_made_before_its_original_recorded_the_val_names_is_still_a_copy(tmp_path):
    """A result file copied, then its original given one more pipeline by evaluate.py (which has it take the val
    images' names): the copy without names and the original with them were two rows of one evaluation. Other names
    in both are two evaluations."""
    result = dict(_finetune_result("pets", "CD", 95.0, 94.0), fingerprint="same")
    (tmp_path / "copy.json").write_text(json.dumps(result))
    (tmp_path / "original.json").write_text(json.dumps(dict(result, val_names="a" * 64)))
    files = [str(tmp_path / "copy.json"), str(tmp_path / "original.json")]
    with pytest.raises(SystemExit, match="copy.json and .*original.json hold results of the same weights evaluated "
                                         "alike"):
        paper_table.main(files)
    (tmp_path / "copy.json").write_text(json.dumps(dict(result, val_names="b" * 64)))  # another export of pets/val
    assert len(paper_table.main(files).splitlines()) == 4
    (tmp_path / "third.json").write_text(json.dumps(result))  # alike both: named with the first
    with pytest.raises(SystemExit, match="copy.json and .*third.json hold results of the same weights"):
        paper_table.main([*files, str(tmp_path / "third.json")])


@pytest.mark.parametrize("edit, path", [(lambda r: r["max_act"].pop("block"), "max_act.block"),
                                        (lambda r: r["fp"].update(top1=None), "fp.top1"),
                                        (lambda r: r["fp"].update(top1=True), "fp.top1"),  # JSON true: no number
                                        (lambda r: r["quant"]["repq"]["w4a4"].pop("top1"), "quant.repq.w4a4.top1")])
def test_paper_table_names_a_number_missing_from_a_result(tmp_path, edit, path):
    """A result file cut by hand (or by an older version) stopped the table on a KeyError or TypeError."""
    result = _finetune_result("pets", "CD", 95.0, 94.0)
    edit(result)
    file = tmp_path / "r.json"
    file.write_text(json.dumps(result))
    for layout in ("rows", "finetune"):
        with pytest.raises(SystemExit, match=rf"error: {file} has no number at {path}: re-evaluate it"):
            paper_table.main(["--layout", layout, str(file)])


@pytest.mark.parametrize("change, differs", [
    ({"data": {"dataset": "folder", "root": "/other/pets"}}, "data"),  # another folder of the same name
    ({"data": {"dataset": "folder", "root": "/data/pets", "val_split": "train"}}, "data"),
    ({"images": 100}, "images"),  # a --max-images evaluation
    ({"weights": "ema"}, "weights"), ({"eval_amp": "bf16"}, "eval_amp"),
    ({"checkpoint_kind": "latest"}, "checkpoint_kind")])  # one method's checkpoint.pt beside the others' best.pt
def test_finetune_layout_refuses_a_row_or_table_of_results_evaluated_differently(tmp_path, change, differs):
    files = []
    for method, extra in (("Baseline", {}), ("CD", change)):
        path = tmp_path / f"{method}.json"
        path.write_text(json.dumps({**_finetune_result("pets", method, 95.0, 94.0), **extra}))
        files.append(str(path))
    with pytest.raises(SystemExit, match=rf"error: pets/Baseline and pets/CD were evaluated differently "
                                         rf"\({differs}: .*evaluate them with the same settings"):
        paper_table.main(["--layout", "finetune", *files])
    if differs in ("weights", "eval_amp", "checkpoint_kind"):  # across rows too: the Average would mix them
        (tmp_path / "CD.json").write_text(json.dumps({**_finetune_result("cars", "CD", 95.0, 94.0), **change}))
        with pytest.raises(SystemExit, match=rf"evaluated differently \({differs}: "):
            paper_table.main(["--layout", "finetune", *files])
    else:  # other data (and so another image count) in another row is what the layout is for
        (tmp_path / "CD.json").write_text(json.dumps({**_finetune_result("cars", "CD", 95.0, 94.0), "images": 100}))
        assert "| Cars |" in paper_table.main(["--layout", "finetune", *files])


def test_finetune_layout_refuses_a_row_of_snapshots_of_other_updates():
    """A data set's row of snapshots (evaluate.py --checkpoint <run>/snapshots/...): the Baseline's of update 100
    beside CD's of update 900 compared weights of other points of training as one method against the other (the
    row's keys held no update, and the table's kind of checkpoint, "snapshot" for both, was alike). Refused now;
    snapshots of one update in a row, and of other updates in other rows (other data sets' schedules), are
    tabulated."""
    results = [dict(_finetune_result(root, method, 95.0, 94.0), checkpoint_kind="snapshot", checkpoint_step=step)
               for root, method, step in (("pets", "Baseline", 100), ("pets", "CD", 900))]
    with pytest.raises(ValueError, match=r"pets/Baseline and pets/CD were evaluated differently \(checkpoint_step: "
                                         r"update 100 vs update 900 \(snapshot files\)"):
        paper_table.finetune_table(results)
    results[1]["checkpoint_step"] = 100
    cars = [dict(_finetune_result("cars", method, 90.0, 89.0), checkpoint_kind="snapshot", checkpoint_step=700)
            for method in ("Baseline", "CD")]
    assert "| Cars |" in paper_table.finetune_table(results + cars)


def test_finetune_layout_checks_every_data_sets_row_not_only_the_first():
    """Each row is checked on its own: Aircraft's entries evaluated alike, Pets' on other image counts (a
    --max-images evaluation of its CD entry) are refused, though Aircraft's row, the first in order, is
    fine."""
    results = [_finetune_result(root, method, 95.0, 94.0) for root in ("aircraft", "pets")
               for method in ("Baseline", "CD")]
    results[3]["images"] = 100
    with pytest.raises(ValueError, match=r"pets/Baseline and pets/CD were evaluated differently \(images: "):
        paper_table.finetune_table(results)


def test_finetune_layout_refuses_a_row_scored_on_other_val_images_under_the_same_root():
    """A data set's val folder exported again at the same path with as many other images between two methods'
    evaluations: the row compared their numbers as of one val set (val_names was not among its keys). A result
    that records no names (written before they were recorded) is not compared on them."""
    results = [dict(_finetune_result("pets", method, 95.0, 94.0), val_names=names)
               for method, names in (("Baseline", "a" * 64), ("CD", "b" * 64))]
    with pytest.raises(ValueError, match=r"pets/Baseline and pets/CD were evaluated differently \(val_names: "
                                         r"aaaaaaaaaaaa\.\.\. vs bbbbbbbbbbbb\.\.\.: other val images"):
        paper_table.finetune_table(results)
    assert "| Pets |" in paper_table.finetune_table([results[0], dict(results[1], val_names="a" * 64)])
    older = {k: v for k, v in results[1].items() if k != "val_names"}
    assert "| Pets |" in paper_table.finetune_table([results[0], older])


@pytest.mark.slow
def test_a_sweep_refuses_an_override_of_a_key_its_runs_set():
    path = os.path.join(ROOT, "configs", "sweeps", "finetune.yaml")
    runs = sweep.expand(path, ["model.pretrained=/w/in21k.safetensors"])
    assert len(runs) == 27
    roots = {r["name"]: sweep.commands(r, "", True) for r in runs}
    assert any("configs/finetune/datasets/smallnorb.yaml" in c for c in roots["smallnorb_tweo"][0])
    with pytest.raises(ConfigError, match="data.root=/datasets/imagenet would replace a key that each run"):
        sweep.expand(path, ["data.root=/datasets/imagenet"])
    # a key one run's own items set: the seeds (or doses) of a sweep would become copies of one run
    lm = os.path.join(ROOT, "configs", "sweeps", "kjv_lm_dose.yaml")
    with pytest.raises(ConfigError, match=r"sweep run 'baseline_s0': train.seed=7 would replace what the run sets "
                                          r"itself \(train.seed=0\)"):
        sweep.expand(lm, ["train.seed=7"])
    with pytest.raises(SystemExit):  # --only with no name would run them all
        sweep.main([lm, "--only"])


def test_overrides_after_only_are_overrides_not_run_names(capsys):
    lm = os.path.join(ROOT, "configs", "sweeps", "kjv_lm_dose.yaml")
    assert sweep.main([lm, "--only", "baseline_s0", "train.max_steps=5"]) == 0
    printed = capsys.readouterr().out.splitlines()[1:]  # after the `cd` into the repository root
    assert len(printed) == 1 and " train.max_steps=5 " in printed[0], printed
    with pytest.raises(SystemExit) as stop:  # a usage error (status 2), as argparse's
        sweep.main([lm, "--only", "train.max_steps=5"])
    assert stop.value.code == 2 and "--only needs the names of runs to keep" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["command line", "run"])
def test_a_sweep_refuses_an_override_its_evaluate_list_would_replace(tmp_path, where):
    """evaluate.py takes the sweep's evaluate list last: quant.pipelines=[repq,aphq] given on the command line
    (or by a run) would be evaluated with the list's pipelines, APHQ never run."""
    spec = tmp_path / "s.yaml"
    run = "['quant.pipelines=[repq,aphq]']" if where == "run" else "[]"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}\n"
                    f"evaluate: ['quant.pipelines=[repq]']\nruns:\n  a: {run}\n")
    extra = ["quant.pipelines=[repq,aphq]"] if where == "command line" else []
    with pytest.raises(ConfigError, match=r"sweep run 'a': quant.pipelines=\[repq,aphq\] would be replaced in its "
                                          r"evaluation by the sweep's evaluate list \(quant.pipelines=\[repq\]\)"):
        sweep.expand(str(spec), extra)
    assert sweep.expand(str(spec), ["quant.bits=[w6a6]"]) if where == "command line" else True  # another key


@pytest.mark.parametrize("override, own", [
    ("train={seed: 7}", "train.seed=0"),                          # the section holding the run's key
    ("cd.lam_per_role.fc2=0.5", "cd.lam_per_role={fc2: 2.0}"),   # a part of the run's value
])
def test_a_sweep_refuses_any_spelling_of_a_key_its_runs_set(tmp_path, override, own):
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml, configs/method/cd.yaml]\nout_root: {tmp_path}\n"
                    f"run_keys: [data.synthetic_train_size]\nruns:\n  a: ['{own}']\n")
    with pytest.raises(ConfigError, match=r"sweep run 'a': .* would replace what the run sets itself"):
        sweep.expand(str(spec), [override])
    with pytest.raises(ConfigError, match=r"would replace a key that each run sets itself"):
        sweep.expand(str(spec), ["data={synthetic_train_size: 8}"])
    assert sweep.expand(str(spec), ["train={batch_size: 32}"])  # another key of the section: no clash


def test_motivation_figure_places_each_result_and_scales_areas_with_max_activation(tmp_path):
    import csv

    import motivation_figure

    files = []
    for i, (model, method, q, mod, blk) in enumerate([("vit_b", "Baseline", 76.5, 78.1, 250.6),
                                                      ("vit_b", "CD", 77.8, 45.6, 162.4),
                                                      ("vit_b", "TWEO", 77.0, 20.0, 30.0)]):
        result = {"model": model, "method": method, "fp": {"top1": 81.0},
                  "max_act": {"module": mod, "block": blk},
                  "quant": {"repq": {"w4a4": {"top1": q}}, "percentile": {"w4a4": {"top1": 1.0}}}}
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(result))
        files.append(str(path))
    out = tmp_path / "fig"
    rows = motivation_figure.main([*files, "--max-act", "block", "--out", str(out)])
    assert [(r["method"], r["quantized"], r["max_act"]) for r in rows] == [
        ("Baseline", 76.5, 250.6), ("CD", 77.8, 162.4), ("TWEO", 77.0, 30.0)]
    areas = motivation_figure.circle_areas([r["max_act"] for r in rows])
    assert areas[0] == motivation_figure.MAX_AREA and areas[2] == pytest.approx(areas[0] * 30.0 / 250.6)
    with open(out / "motivation.csv") as f:
        assert [row["method"] for row in csv.DictReader(f)] == ["Baseline", "CD", "TWEO"]
    assert (out / "motivation.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="already exist.*choose another --out or add --overwrite"):
        motivation_figure.main([*files, "--out", str(out)])
    with pytest.raises(SystemExit, match="3 of the 3 results lack aphq w4a4"):
        motivation_figure.main([*files, "--pipeline", "aphq", "--out", str(tmp_path / "other")])
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"model": "vit_b", "method": "CD (lam 0.01)", "fp": {"top1": 80.0},
                                   "max_act": {"module": 1.0, "block": 1.0}, "quant": {}}))
    with pytest.raises(SystemExit, match=r"1 of the 4 results lack repq w4a4 \(e.g. .*partial.json\)"):
        motivation_figure.main([*files, str(partial), "--out", str(tmp_path / "third")])  # not one circle short
    assert not (tmp_path / "third").exists()
    language = tmp_path / "gpt.json"  # a language model's result: perplexities, no top-1 (was a KeyError)
    language.write_text(json.dumps({"model": "gpt2", "method": "CD", "fp": {"ppl": 30.0, "ppl_bf16": 30.1},
                                    "max_act": {"module": 1.0, "block": 1.0},
                                    "quant": {"rtn": {"w4a16": {"ppl": 32.0}}}}))
    with pytest.raises(SystemExit, match=r"error: .*gpt.json has no top-1 \(a language model's result"):
        motivation_figure.main([str(language), "--pipeline", "rtn", "--bits", "w4a16", "--out", str(tmp_path / "lm")])
    assert not (tmp_path / "lm").exists()
    cut = tmp_path / "cut.json"  # a file cut by hand: a maximum missing (was KeyError: 'module')
    cut.write_text(json.dumps({**json.loads(open(files[0]).read()), "max_act": {"block": 250.6}}))
    with pytest.raises(SystemExit, match=r"error: .*cut.json has no number at max_act.module: re-evaluate it"):
        motivation_figure.main([*files, str(cut), "--out", str(tmp_path / "cut")])
    assert not (tmp_path / "cut").exists()


def test_motivation_figure_marks_a_classifier_evaluated_with_other_model_kwargs_than_trained(tmp_path, capsys):
    """A result evaluated with a model.kwargs override (gelu=tanh on a model trained with the exact GELU) is the
    same weights through another forward: its model is marked † (its own place on the axis, and in the CSV), with a
    note naming both settings, as evaluate.py's table marks its row; the model as trained is not."""
    import csv

    import motivation_figure

    files = []
    for method, kwargs in (("Baseline", {}), ("CD", {"gelu": "tanh"})):
        result = {"model": "vit_b", "method": method, "fp": {"top1": 81.0}, "max_act": {"module": 5.0, "block": 9.0},
                  "quant": {"repq": {"w4a4": {"top1": 70.0}}}, "model_kwargs": kwargs,
                  "recipe": {"model.kwargs": {}}}
        files.append(str(tmp_path / f"{method}.json"))
        open(files[-1], "w").write(json.dumps(result))
    rows = motivation_figure.main([*files, "--out", str(tmp_path / "fig")])
    assert [r["model"] for r in rows] == ["vit_b", "vit_b†"]
    with open(tmp_path / "fig" / "motivation.csv", encoding="utf-8") as f:
        assert [row["model"] for row in csv.DictReader(f)] == ["vit_b", "vit_b†"]
    note = 'note: † vit_b CD: evaluated with model.kwargs={"gelu": "tanh"} (trained with {})'
    assert note in capsys.readouterr().err


def test_motivation_figure_draws_detectors_beside_classifiers(tmp_path):
    """Fig. 1's detection half: evaluate_detection.py's results (box mAP, backbone / head maxima; a detector
    named by its config, its method as evaluate_detection.py recorded it) in a panel of their own."""
    import csv

    import motivation_figure

    def detection(name, method, fp, q, backbone, head):
        result = {"task": "detection", "config": ["/r/configs/detection/mask_rcnn_swin_t_1x.py"],
                  "fp": {"bbox_mAP": fp, "segm_mAP": fp - 0.04}, "max_act": {"backbone": backbone, "head": head},
                  "quant": {"repq": {"w4a4": {"bbox_mAP": q, "segm_mAP": q - 0.03}}},
                  **({"method": method} if method else {})}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(result))
        return str(path)
    files = [detection("base", "Baseline", 0.437, 0.351, 480.0, 61.0),
             detection("cd", "CD", 0.436, 0.402, 420.0, 40.0),
             detection("tweo", "TWEO", 0.431, 0.377, 120.0, 30.0)]
    classifier = tmp_path / "vit.json"
    classifier.write_text(json.dumps({"model": "vit_b", "method": "CD", "fp": {"top1": 81.0},
                                      "max_act": {"module": 45.6, "block": 162.4},
                                      "quant": {"repq": {"w4a4": {"top1": 77.8}}}}))
    out = tmp_path / "fig"
    rows = motivation_figure.main([str(classifier), *files, "--det-max-act", "head", "--out", str(out)])
    assert [(r["task"], r["model"], r["method"]) for r in rows] == [
        ("classification", "vit_b", "CD"), ("detection", "mask_rcnn_swin_t_1x", "Baseline"),
        ("detection", "mask_rcnn_swin_t_1x", "CD"), ("detection", "mask_rcnn_swin_t_1x", "TWEO")]
    assert [r["quantized"] for r in rows[1:]] == pytest.approx([35.1, 40.2, 37.7])  # box mAP in %
    assert [r["max_act"] for r in rows] == [45.6, 61.0, 40.0, 30.0]  # --max-act module, --det-max-act head
    with open(out / "motivation.csv") as f:
        table = list(csv.DictReader(f))
    assert table[0]["max_block"] == "162.4" and table[0]["max_backbone"] == ""
    assert table[3]["max_backbone"] == "120.0" and table[3]["metric"] == "box mAP (%)"
    # the FP score beside the quantized one: a classifier's top-1 as given, a detector's box mAP in %; both maxima
    assert float(table[0]["fp"]) == 81.0 and float(table[1]["fp"]) == pytest.approx(43.7)
    assert (float(table[1]["max_backbone"]), float(table[1]["max_head"])) == (480.0, 61.0)
    assert (out / "motivation.png").stat().st_size > 0
    with pytest.raises(SystemExit, match=r"1 of the 1 results lack aphq w4a4 .*run evaluate_detection.py --quant"):
        motivation_figure.main([files[0], "--pipeline", "aphq", "--out", str(tmp_path / "other")])
    for flag, files_given in (("--max-act", files), ("--det-max-act", [str(classifier)])):  # nothing to choose for
        with pytest.raises(SystemExit, match=f"error: {flag} .*: no .* result is given, so it would change nothing"):
            motivation_figure.main([*files_given, flag, "block" if flag == "--max-act" else "head",
                                    "--out", str(tmp_path / "moot")])
    assert not (tmp_path / "moot").exists()
    partial = json.loads(open(files[0]).read())
    partial["data"] = {"partial": True, "images": 2}  # evaluate_detection.py --max-images 2, same default name
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    with pytest.raises(SystemExit, match=r"partial.json scores only 2 images .*leave it out"):
        motivation_figure.main([*files, str(tmp_path / "partial.json"), "--out", str(tmp_path / "partial")])
    unlabelled = detection("old", None, 0.437, 0.351, 480.0, 61.0)  # written before the method was recorded
    with pytest.raises(SystemExit, match=r"old.json does not say which method .*run evaluate_detection.py on it again"):
        motivation_figure.main([unlabelled, "--out", str(tmp_path / "unlabelled")])
    assert not (tmp_path / "unlabelled").exists()
    from engine.eval_results import ResultsError, read_result_files
    with pytest.raises(ResultsError, match="base.json is not a result file of evaluate.py"):
        read_result_files([files[0]])  # the table scripts read classifiers' results only


def test_motivation_figure_reads_bits_in_any_case_names_a_detector_by_its_first_config_and_keeps_its_inputs(
        tmp_path):
    """--bits W4A4 is evaluate.py's w4a4 (as --bits is there); a detector given as base + override configs
    is named by the first (the documented rule); a result file at an output's path is never replaced, even
    with --overwrite."""
    import motivation_figure

    classifier = tmp_path / "vit.json"
    classifier.write_text(json.dumps({"model": "vit_b", "method": "CD", "fp": {"top1": 81.0},
                                      "max_act": {"module": 45.6, "block": 162.4},
                                      "quant": {"repq": {"w4a4": {"top1": 77.8}}}}))
    detector = tmp_path / "det.json"
    detector.write_text(json.dumps({"task": "detection", "method": "CD",
                                    "config": ["/r/mask_rcnn_swin_t_1x.py", "/r/override_lr.py"],
                                    "fp": {"bbox_mAP": 0.4}, "max_act": {"backbone": 5.0, "head": 1.0},
                                    "quant": {"repq": {"w4a4": {"bbox_mAP": 0.3}}}}))
    rows = motivation_figure.main([str(classifier), str(detector), "--bits", "W4A4", "--out", str(tmp_path / "f")])
    assert [(r["model"], r["quantized"]) for r in rows] == [("vit_b", 77.8), ("mask_rcnn_swin_t_1x", 30.0)]
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "motivation.csv").write_text(classifier.read_text())  # a result, under the name of an output
    with pytest.raises(SystemExit, match=r"motivation.csv is an input of this command and would be replaced"):
        motivation_figure.main([str(kept / "motivation.csv"), "--out", str(kept), "--overwrite"])
    assert (kept / "motivation.csv").read_text() == classifier.read_text()
    assert not (kept / "motivation.png").exists()


@pytest.mark.slow
def test_a_stopped_sweep_run_is_reported_not_evaluated_and_a_rerun_finishes_it(tmp_path, capfd, monkeypatch):
    """Ctrl-C (SIGINT to the sweep's process group) while the first run trains: the run writes its checkpoint
    and is reported as stopped, the sweep exits 75 without evaluating; the same sweep, again, continues it and
    trains the run it had not started. Both stop at train.max_steps: each is evaluated and the sweep goes on
    after the first (the limit was asked for; the summary said "finished and evaluated"), and paper_table
    tabulates the two. The rerun's sweep runs in this process, and so do the train.py and evaluate.py commands it
    starts (conftest.run_main, as the sweep builds them: four processes would import torch again, seconds each);
    the Ctrl-C, which is about processes, reaches real ones."""
    import signal
    import subprocess

    import torch

    from engine.preemption import EXIT_PREEMPTED

    spec = tmp_path / "sweep.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\nruns:\n"
                    f"  first: []\n  second: [configs/method/cd.yaml]\n")
    cmd = [sys.executable, "scripts/sweep.py", str(spec), "--run", "--evaluate", "sched.epochs=1000",
           "train.log_every_steps=1", "log.tensorboard=false", "quant.pipelines=[repq]"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "update 6/" in line:  # the first run is training
            break
    os.killpg(proc.pid, signal.SIGINT)
    output = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    assert "first: stopped during training (resumable)" in output and "second: not started" in output
    assert "evaluate.py" not in output.split("update 6/")[1] and "Traceback" not in output, output[-3000:]
    step = torch.load(tmp_path / "runs" / "first" / "checkpoint.pt", weights_only=True)["state"]["step"]
    assert step >= 6
    # the same sweep, limited to two more updates per run: the first continues, both are evaluated
    monkeypatch.setattr(sweep.ForwardedSignals, "run", run_in_this_process)
    monkeypatch.chdir(ROOT)  # where the sweep starts its commands
    capfd.readouterr()
    code = sweep.main([*cmd[2:], f"train.max_steps={step + 2}"])
    again = capfd.readouterr()  # the sweep's lines and those of the commands it started
    assert code == 0, again.out[-3000:] + again.err[-3000:]
    # sched.epochs=1000 of 4 updates (64 images, global batch 16): both stop at train.max_steps, long before the end
    for name in ("first", "second"):
        assert (f"{name}: stopped at train.max_steps at update {step + 2} of 4000, before its schedule ended; "
                "evaluated") in again.out
    assert f"resumed from {tmp_path}/runs/first/checkpoint.pt at epoch" in again.out
    results = sorted(glob.glob(str(tmp_path / "runs" / "*" / "eval_best.json")))
    assert len(results) == 2
    table = paper_table.main(results)
    # each stopped at a few of its schedule's 4000 updates (under 99 %): marked § (paper_table.stopped_short)
    assert "| vit_nano | Baseline§ |" in table and "| vit_nano | CD§ |" in table and "RepQ-ViT" in table


def run_in_this_process(signals, cmd: list[str]) -> int:
    """ForwardedSignals.run for a sweep without --launcher: the exit status of its command `python script ...`,
    the script's __main__ block run in this process."""
    assert cmd[0] == sys.executable, cmd
    return run_main(cmd[1], cmd[2:])


def test_a_sweep_moves_aside_an_evaluation_older_than_its_checkpoint(tmp_path):
    result, checkpoint = tmp_path / "eval_best.json", tmp_path / "best.pt"
    result.write_text("{}")
    checkpoint.write_bytes(b"weights")
    os.utime(result, (1_000_000_000, 1_000_000_000))  # evaluated before best.pt changed
    sweep.move_stale_result(str(result), str(checkpoint))
    assert not result.exists() and len(glob.glob(str(tmp_path / "eval_best.*.json"))) == 1
    result.write_text("{}")  # newer than best.pt: results of this best.pt, kept
    sweep.move_stale_result(str(result), str(checkpoint))
    assert result.exists()
    # the per-layer maxima files it wrote go with it: evaluate.py would refuse to overwrite them
    (tmp_path / "eval_best_act_max.csv").write_text("name,max\n")
    os.utime(result, (1_000_000_000, 1_000_000_000))
    sweep.move_stale_result(str(result), str(checkpoint))
    assert not (tmp_path / "eval_best_act_max.csv").exists()
    assert len(glob.glob(str(tmp_path / "eval_best.*_act_max.csv"))) == 1
    # written in the same second as the first one moved: both kept, never one over the other
    assert sorted(open(p).read() for p in glob.glob(str(tmp_path / "eval_best.*.json"))) == ["{}", "{}"]


def test_a_sweep_keeps_an_evaluation_as_old_as_its_checkpoint(tmp_path):
    """Only a JSON older than best.pt is stale: one with the same modification time (written in the same tick of
    a coarse file-system clock, right after training) is this best.pt's evaluation and stays where it is."""
    result, checkpoint = tmp_path / "eval_best.json", tmp_path / "best.pt"
    result.write_text("{}")
    checkpoint.write_bytes(b"weights")
    for path in (result, checkpoint):
        os.utime(path, (1_000_000_000, 1_000_000_000))
    sweep.move_stale_result(str(result), str(checkpoint))
    assert result.exists() and glob.glob(str(tmp_path / "eval_best.*.json")) == []


def test_the_sweep_expands_yaml_without_loading_torch():
    """scripts/sweep.py checks and prints a sweep's commands on a login node without torch's import time
    (engine.exit_codes, not engine.preemption, gives it the stop code)."""
    code = ("import sys; sys.path.insert(0, 'scripts'); import sweep; "
            "assert 'torch' not in sys.modules, 'sweep imports torch'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.slow  # the precision script on a ViT (about 17 s)
def test_cd_precision_measures_the_products_and_the_storage_rounding(capsys):
    """fp32 products move the weights as much as fp32 storage rounding does; weights stored in half precision
    keep most entries as they were after one update at the training step (what the CD warning is about).
    On a CPU the tf32 row is emulated, in both figures, and says so: its product error is of the order of TF32's
    unit roundoff 2^-11 (10 explicit mantissa bits), between fp32's and bf16's (a tf32 row of plain fp32
    products, as CPUs compute under torch's 'high' precision, would equal the fp32 row)."""
    import cd_precision

    rows = cd_precision.main(["--model", "vit_tiny_patch16_224", "--device", "cpu"])
    by_precision = {r["precision"]: r for r in rows if "precision" in r}
    assert by_precision["fp32"]["weight_error_over_fp32_rounding"] == pytest.approx(1.0, abs=0.05)
    share = {r["storage"]: r["changed_share"] for r in rows if "storage" in r}
    assert share["float32"] > 0.9 and share["bfloat16"] < 0.1 and share["float16"] < 0.1, share
    assert {p: r["emulated"] for p, r in by_precision.items()} == {"fp32": False, "tf32": True, "bf16": False}
    product = [by_precision[p]["product_error"] for p in ("fp32", "tf32", "bf16")]
    weight = [by_precision[p]["weight_error_over_fp32_rounding"] for p in ("fp32", "tf32", "bf16")]
    assert product[0] < product[1] < product[2] and weight[0] < weight[1] < weight[2], (product, weight)
    assert 2.0 ** -11 / 10 < product[1] < 2 * 2.0 ** -11, product
    out = capsys.readouterr().out
    assert "by storage dtype" in out and "  tf32 (emulated)  product error" in out


def test_cd_precision_rounds_to_tf32_nearest_with_ties_away_from_zero():
    """TF32 keeps 10 explicit mantissa bits: values written out in powers of two, both signs, and the emulated
    products, the one CD commits in place (addmm_) too, round both operands and not the accumulator."""
    import torch

    import cd_precision

    u = 2.0 ** -10  # one unit in the last place of TF32 at 1.0
    for x, want in ((1 + u / 4, 1.0), (1 + u / 2, 1 + u), (1 + 3 * u / 4, 1 + u), (1 + u, 1 + u),
                    (1 + 3 * u / 2, 1 + 2 * u), (3.0 + 2 * u / 3, 3.0), (2 ** -20 * (1 + u / 2), 2 ** -20 * (1 + u))):
        for sign in (1, -1):
            got = cd_precision.round_to_tf32(torch.tensor([sign * x], dtype=torch.float32))
            assert got.item() == sign * want, (sign * x, got.item())
    a = torch.tensor([[1 + u / 2]], dtype=torch.float32)
    # 1 + 2^-20 has 21 significant bits: TF32 would round it to 1, and the commit would be -2^-9 - 2^-20
    acc = torch.tensor([[1 + 2.0 ** -20]], dtype=torch.float32)
    with cd_precision.EmulatedTF32():
        product, committed = torch.mm(a, a), acc.clone().addmm_(a, a, alpha=-1.0)
    assert product.item() == (1 + u) ** 2 and committed.item() == -(2.0 ** -9), (product, committed)
    with cd_precision.EmulatedTF32(), pytest.raises(NotImplementedError, match="aten._addmm_activation"):
        torch._addmm_activation(acc, a, a)  # a product it does not emulate raises, never runs exactly


@pytest.mark.parametrize("inner", [64, 768])
def test_cd_precision_commit_probe_measures_in_units_of_one_rounding(inner):
    """W - A B computed apart rounds once: its error is the fp32 rounding of the exact result, 1.000 in the
    probe's unit; the fused addmm_ rounds at least once (how often is the BLAS's: once per block of the inner
    dimension on x86 CPUs' torch)."""
    import cd_precision
    fused, apart = cd_precision.commit_rounding(inner, "cpu")
    assert apart == pytest.approx(1.0, abs=1e-6) and fused >= 1.0 - 1e-6, (fused, apart)


def test_cd_precision_computes_each_precision_it_names():
    """One update of a tiny ViT at s = 1 against float64: fp32 products are closer than emulated TF32 ones (10
    mantissa bits), and those than bf16 ones (7 bits); a row that ran at another precision would not order so."""
    import copy

    import cd_precision
    from cd_models import tiny_vit

    model = tiny_vit()
    ref = cd_precision.updated(copy.deepcopy(model).double(), 1.0, "fp32", emulate=False)

    def error(got):
        return max(float((got[n].double() - ref[n]).abs().max()) for n in ref)
    fp32, tf32, bf16 = (error(cd_precision.updated(model, 1.0, p, emulate=p == "tf32"))
                        for p in ("fp32", "tf32", "bf16"))
    assert 0 < fp32 < tf32 < bf16, (fp32, tf32, bf16)


def test_cd_precision_emulates_tf32_in_every_product_of_the_update():
    """The emulated tf32 row (a CPU's) against one CD update of a tiny ViT at s = 1 computed here in float64 with
    each product's operands rounded to TF32 (W2 <- W2 - s P W1^T, P = c^2 W2 W1, c^2 = r / ||W1||_F^2, Eq. (12)):
    equal to fp32 precision over the functional pairs. An emulation that rounded the first product's operands alone
    (CD commits the second with addmm_, past cd.update._product) is off by ~1e-4 of the update, TF32's own error."""
    import copy

    import cd_precision
    from cd import ColinearityDecay
    from cd_models import tiny_vit

    def tf32(x):  # float64 -> 11 significant bits (10 explicit), nearest, ties away from zero
        m, e = torch.frexp(x.double())
        return torch.ldexp(torch.sign(m) * torch.floor(m.abs() * 2 ** 11 + 0.5), e - 11)

    model = tiny_vit()
    pairs = [p for p in ColinearityDecay(copy.deepcopy(model)).pairs if p.kind == "functional"]
    got = cd_precision.updated(model, 1.0, "tf32", emulate=True)
    err = den = 0.0
    for p in pairs:
        w2, w1 = p.w2().detach().double(), p.w1().detach().double()
        c2 = w1.shape[0] / w1.square().sum()
        delta = tf32(c2 * (tf32(w2) @ tf32(w1))) @ tf32(w1).t()
        err += float((got[p.name].double() - (w2 - delta)).norm() ** 2)
        den += float(delta.norm() ** 2)
    assert pairs and (err / den) ** 0.5 < 2e-5, (err / den) ** 0.5


def test_cd_precision_product_error_is_relative_to_the_update(monkeypatch):
    """The fp32 row's product error, ||dW_32 - dW_64||_F / ||dW_64||_F at s = 1 (the module docstring), against one
    CD update of a tiny ViT computed here in float64 and in fp32 with ColinearityDecay itself (the script's model
    replaced by the tiny one): relative to the update dW, not to the weights W, and over the functional pairs
    alone (proj, fc2), whose update is a matrix product; over every pair, the composable ones' product-free
    updates watered it down (bf16 on vit_tiny: 1.454 x fp32 rounding instead of 1.916)."""
    import copy

    import torch

    import cd_precision
    from cd import ColinearityDecay
    from cd_models import tiny_vit

    tiny = tiny_vit()
    monkeypatch.setattr(cd_precision.timm, "create_model", lambda name, num_classes: copy.deepcopy(tiny))
    rows = cd_precision.main(["--model", "vit_tiny_patch16_224", "--device", "cpu"])

    def one_update(dtype):
        model = copy.deepcopy(tiny).to(dtype)
        decay = ColinearityDecay(model, lam=1.0)
        before = {p.name: p.w2().detach().double().clone() for p in decay.pairs}
        decay.apply(lr=1.0)
        return {p.name: p.w2().detach().double() - before[p.name] for p in decay.pairs if p.kind == "functional"}
    d32, d64 = one_update(torch.float32), one_update(torch.float64)
    num = sum(float((d32[n] - d64[n]).norm() ** 2) for n in d64)
    den = sum(float(d64[n].norm() ** 2) for n in d64)
    fp32 = next(r for r in rows if r.get("precision") == "fp32")
    assert fp32["product_error"] == pytest.approx((num / den) ** 0.5, rel=0.05)
    assert sorted(fp32["pairs"]) == sorted(d64) and all(n.endswith(("proj.weight", "fc2.weight")) for n in d64)


def test_a_sweep_out_root_under_the_home_folder_is_where_its_runs_write(tmp_path, monkeypatch):
    """`out_root: ~/sweeps/x` gave out_dir=~/sweeps/x/<name>, which train.py reads as the home folder: the sweep
    must look for the runs' files there too, not in a folder named '~' in the repository."""
    monkeypatch.setenv("HOME", str(tmp_path))
    spec = tmp_path / "s.yaml"
    spec.write_text("configs: [configs/debug/tiny.yaml]\nout_root: ~/sweeps/x\nruns:\n  a: []\n")
    (run,) = sweep.expand(str(spec), [])
    assert f"out_dir={tmp_path}/sweeps/x/a" in run["overrides"], run["overrides"]


# -- the sweep's run states and exit codes, with a stand-in launcher (no training) --------------------------

STAND_IN = """#!/bin/sh
# stands in for `python`: logs "<script> <run>", exits with the code in $CODES/<run>.<script> (default 0); train.py
# exiting 0 leaves $CODES/checkpoint.pt (a finished run's) in out_dir when it has none (the sweep reads it)
script=$1; name=""; dir=""
for a in "$@"; do
  case "$a" in
    out_dir=*) dir="${a#out_dir=}"; name=$(basename "$dir");;
    */best.pt) name=$(basename "$(dirname "$a")");;
  esac
done
echo "$script $name" >> "$CODES/log"
if [ -f "$CODES/$name.$script" ]; then
  code=$(cat "$CODES/$name.$script")
  if [ "$code" = kill ]; then kill -9 $$; fi
  exit "$code"
fi
if [ "$script" = train.py ] && [ ! -f "$dir/checkpoint.pt" ]; then
  mkdir -p "$dir"; cp "$CODES/checkpoint.pt" "$dir/"
fi
exit 0
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """(sweep file of runs a, b, c; codes folder; launcher): the sweep's commands run the stand-in."""
    codes = tmp_path / "codes"
    codes.mkdir()
    launcher = tmp_path / "launcher"
    launcher.write_text(STAND_IN)
    launcher.chmod(0o755)
    monkeypatch.setenv("CODES", str(codes))
    _checkpoint_of(codes, step=12, epoch=3)  # what train.py leaves: a finished run's checkpoint.pt
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\n"
                    "runs:\n  a: []\n  b: []\n  c: []\n")
    return str(spec), codes, str(launcher)


@pytest.mark.parametrize("script, code, exit_code, state", [
    ("train.py", "75", 75, "stopped during training (resumable)"),
    ("evaluate.py", "75", 75, "stopped during evaluation (resumable)"),
    ("train.py", "3", 3, "failed during training (exit code 3)"),
    ("evaluate.py", "1", 1, "failed during evaluation (exit code 1)"),
    # killed by a signal (the OOM killer's SIGKILL): the shell's 128 + 9, not Python's -9 (exit status 247)
    ("train.py", "kill", 137, "failed during training (exit code 137: killed by SIGKILL)"),
])
def test_a_sweep_stops_at_the_first_run_that_does_not_finish_and_exits_with_its_code(stand_in, capsys, script,
                                                                                     code, exit_code, state):
    spec, codes, launcher = stand_in
    (codes / f"b.{script}").write_text(code)
    assert sweep.main([spec, "--run", "--evaluate", "--launcher", launcher]) == exit_code
    started = (codes / "log").read_text().splitlines()
    done_b = ["train.py b"] if script == "train.py" else ["train.py b", "evaluate.py b"]
    assert started == ["train.py a", "evaluate.py a", *done_b]  # c never starts
    summary = capsys.readouterr().out.split("sweep summary:\n")[1].splitlines()
    assert summary == ["  a: finished and evaluated", f"  b: {state}", "  c: not started"]


def test_a_sweep_whose_console_reader_has_gone_runs_every_command(stand_in):
    """`sweep.py ... --run | head -1`: the printed command of the second run met a closed pipe and ended the
    sweep in a BrokenPipeError traceback, the later runs never started (engine/console.py)."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    spec, codes, launcher = stand_in
    with open(write_fd, "w") as closed, contextlib.redirect_stdout(closed):
        sweep.main([spec, "--run", "--evaluate", "--launcher", launcher])
    assert (codes / "log").read_text().splitlines() == [f"{script} {run}" for run in "abc"
                                                        for script in ("train.py", "evaluate.py")]


def test_a_stop_before_or_between_a_runs_commands_starts_nothing_more(stand_in):
    import signal

    spec, codes, launcher = stand_in
    (run, *_) = sweep.expand(spec, [])
    args = sweep.argparse.Namespace(launcher=launcher, evaluate=True, eval_amp=None)
    before = sweep.ForwardedSignals()
    before.received.append(signal.SIGTERM)
    assert sweep.run_one(run, args, before) == (75, "not started")
    assert not (codes / "log").exists()

    class StopAfterTraining(sweep.ForwardedSignals):
        def run(self, cmd):
            code = super().run(cmd)
            self.received.append(signal.SIGTERM)
            return code

    assert sweep.run_one(run, args, StopAfterTraining()) == (75, "trained, evaluation not started")
    assert (codes / "log").read_text().splitlines() == ["train.py a"]

    class StopDuringTraining(sweep.ForwardedSignals):
        def run(self, cmd):
            code = super().run(cmd)
            self.received.append(signal.SIGINT)  # came while it ran (the command got it from the terminal too)
            return code

    # e.g. a second Ctrl-C: train.py ends at once with another code than 75 and no record of a stop, no checkpoint
    # written on it; the run is not "stopped"
    (codes / "a.train.py").write_text("1")
    assert sweep.run_one(run, args, StopDuringTraining()) == (
        1, "interrupted during training, no checkpoint written on the stop (exit code 1)")
    (codes / "a.train.py").write_text("75")  # its own 75: stopped after its checkpoint
    assert sweep.run_one(run, args, StopDuringTraining()) == (75, "stopped during training (resumable)")


def test_a_signal_that_came_just_before_a_command_started_reaches_it():
    import signal

    signals = sweep.ForwardedSignals()
    signals.received.append(signal.SIGTERM)
    assert signals.run(["sleep", "30"]) == -signal.SIGTERM  # at once, not after 30 s with exit 0


def test_a_sweeps_commands_are_train_then_evaluate_of_best_pt_with_the_runs_data_and_quant_settings(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\n"
                    f"evaluate: ['quant.bits=[w4a4]']\nruns:\n  a: [configs/method/cd.yaml, optim.lr=0.01]\n")
    (run,) = sweep.expand(str(spec), ["data.synthetic_val_size=8", "quant.pipelines=[repq]"])
    out = f"{tmp_path}/runs/a"
    assert sweep.commands(run, "torchrun --nproc_per_node=2", True) == [
        ["torchrun", "--nproc_per_node=2", "train.py", "--config", "configs/debug/tiny.yaml", "--config",
         "configs/method/cd.yaml", "optim.lr=0.01", "data.synthetic_val_size=8", "quant.pipelines=[repq]",
         f"out_dir={out}"],
        ["torchrun", "--nproc_per_node=2", "evaluate.py", "--checkpoint", f"{out}/best.pt", "--out",
         f"{out}/eval_best.json", "data.synthetic_val_size=8", "quant.pipelines=[repq]", "quant.bits=[w4a4]"]]


@pytest.mark.parametrize("schedule, step, epoch, says", [
    ([], 8, 2, None),                                                   # 2 epochs of 4 updates: done
    ([], 4, 1, "stopped at train.max_steps at update 4 of 8, before its schedule ended"),
    (["sched.steps=6"], 6, 1, None),                                    # 6 updates end inside epoch 2: done
    (["sched.steps=6"], 5, 1, "stopped at train.max_steps at update 5 of 6, before its schedule ended"),
])
def test_a_run_that_exited_0_is_finished_only_when_its_schedule_ended(tmp_path, schedule, step, epoch, says):
    """tiny.yaml: 64 images in global batches of 16, 4 updates per epoch, 2 epochs (8 updates); sched.steps=6
    ends the run at update 6, in its second epoch."""
    import torch

    from configs import config_to_dict, load_config

    config = config_to_dict(load_config([os.path.join(ROOT, "configs", "debug", "tiny.yaml")], schedule))
    torch.save({"state": {"step": step, "epoch": epoch}, "config": config,
                "epoch_position": {"updates_per_epoch": 4}}, tmp_path / "checkpoint.pt")
    assert sweep.stopped_before_schedule_end(str(tmp_path)) == says


def test_only_with_an_unknown_name_says_which_and_the_sweeps_runs():
    lm = os.path.join(ROOT, "configs", "sweeps", "kjv_lm_dose.yaml")
    with pytest.raises(SystemExit) as stop:
        sweep.main([lm, "--only", "baseline_s0", "nosuch", "cd10x_s99"])
    message = str(stop.value)
    assert message.startswith("error: --only: no run named cd10x_s99, nosuch in ") and "[" not in message, message
    assert "(its runs: baseline_s0, " in message and " more)" in message and "\n" not in message, message


def _checkpoint_of(folder, step: int, epoch: int) -> None:
    """The fields of checkpoint.pt the sweep reads (its state, sched.epochs=3, 4 updates per epoch: 12 updates)."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"state": {"step": step, "epoch": epoch}, "config": {"sched": {"epochs": 3}},
                "epoch_position": {"updates_per_epoch": 4}}, folder / "checkpoint.pt")


@pytest.mark.parametrize("evaluate, says", [(True, "evaluated"), (False, "not evaluated")])
def test_the_summary_tells_a_run_stopped_at_max_steps_from_a_finished_one_and_says_if_it_was_evaluated(
        stand_in, capsys, evaluate, says):
    """A run that train.py ended with exit 0 before its schedule's end (update 5 of 3 x 4) is reported as stopped
    at train.max_steps, one at the end of its last epoch as finished; each says whether it was evaluated."""
    spec, codes, launcher = stand_in
    import pathlib

    runs = pathlib.Path(spec).parent / "runs"  # the stand-in's out_root
    _checkpoint_of(runs / "a", step=5, epoch=1)
    for name in ("b", "c"):
        _checkpoint_of(runs / name, step=12, epoch=3)
    assert sweep.main([spec, "--run", "--launcher", launcher, *(["--evaluate"] if evaluate else [])]) == 0
    summary = capsys.readouterr().out.split("sweep summary:\n")[1].splitlines()
    finished = "finished and evaluated" if evaluate else "finished"
    assert summary == [f"  a: stopped at train.max_steps at update 5 of 12, before its schedule ended; {says}",
                       f"  b: {finished}", f"  c: {finished}"]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_to_the_sweep_alone_reaches_the_running_command_and_the_handlers_are_restored(name):
    """SIGTERM / SIGINT sent to the sweep's process only (not its process group, as a scheduler may do) reach the
    command it runs, which ends at once instead of after its 20 s; after the sweep the earlier handlers are back."""
    import signal
    import threading

    signum = getattr(signal, name)
    before = signal.getsignal(signum)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signum))
    try:
        with sweep.ForwardedSignals() as signals:
            timer.start()
            code = signals.run(["sleep", "20"])
    except KeyboardInterrupt:
        pytest.fail(f"{name} stopped the sweep itself instead of reaching its command")
    finally:
        timer.cancel()
    assert code == -signum and signals.received == [signum]
    assert signal.getsignal(signum) is before


def test_evaluations_moved_aside_in_one_second_never_land_on_an_earlier_move(tmp_path):
    """Three stale evaluations with one modification time go to three names (.<time>, .<time>.2, .<time>.3), and a
    per-layer maxima file left by an earlier move (its JSON deleted since) is not written over either."""
    import time

    result, checkpoint = tmp_path / "eval_best.json", tmp_path / "best.pt"
    checkpoint.write_bytes(b"weights")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(1_000_000_000))
    (tmp_path / f"eval_best.{stamp}_act_max.csv").write_text("earlier")  # its JSON was deleted by hand
    for n in range(3):
        result.write_text(json.dumps({"n": n}))
        (tmp_path / "eval_best_act_max.csv").write_text(f"csv {n}")
        os.utime(result, (1_000_000_000, 1_000_000_000))
        sweep.move_stale_result(str(result), str(checkpoint))
    assert (tmp_path / f"eval_best.{stamp}_act_max.csv").read_text() == "earlier"
    for n, suffix in enumerate((".2", ".3", ".4")):
        assert json.loads((tmp_path / f"eval_best.{stamp}{suffix}.json").read_text()) == {"n": n}
        assert (tmp_path / f"eval_best.{stamp}{suffix}_act_max.csv").read_text() == f"csv {n}"


def test_a_sweep_moves_a_runs_stale_evaluation_aside_before_evaluating_it(stand_in):
    """run a's eval_best.json is older than its best.pt (it scored an earlier one): the sweep moves it aside before
    its evaluate.py command starts (the stand-in writes no new one), and leaves b's, of its current best.pt."""
    import pathlib
    import time

    spec, codes, launcher = stand_in
    runs = pathlib.Path(spec).parent / "runs"
    for name in ("a", "b"):  # finished runs (train.py, and the sweep, refuse a best.pt without a checkpoint.pt)
        (runs / name).mkdir(parents=True)
        shutil.copy2(codes / "checkpoint.pt", runs / name)
        (runs / name / "best.pt").write_bytes(b"weights")
        (runs / name / "eval_best.json").write_text("{}")
    os.utime(runs / "a" / "eval_best.json", (1_000_000_000, 1_000_000_000))
    assert sweep.main([spec, "--run", "--evaluate", "--launcher", launcher]) == 0
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(1_000_000_000))
    assert sorted(os.listdir(runs / "a")) == ["best.pt", "checkpoint.pt", f"eval_best.{stamp}.json"]
    assert sorted(os.listdir(runs / "b")) == ["best.pt", "checkpoint.pt", "eval_best.json"]


@pytest.mark.parametrize("argv, says", [
    (["data.root=/d", "{sweep}"], "data.root=/d is a key=value override, not a sweep file: give the sweep file first "
                                  "(python scripts/sweep.py {sweep} data.root=/d ...)"),
    (["data.root=/d"], "data.root=/d is a key=value override, not a sweep file: give the sweep file first (python "
                       "scripts/sweep.py SWEEP.yaml data.root=/d ...)"),
    (["{sweep}", "configs/method/cd.yaml"], "configs/method/cd.yaml is no key=value override, and a sweep takes one "
                                            "sweep file: a config file for every run goes in the sweep file's "
                                            "'configs' list, one of a run's own in its items"),
])
def test_words_in_the_wrong_place_are_refused_saying_where_they_go(capsys, monkeypatch, argv, says):
    """The first word is the sweep file to argparse: an override before it was looked for as a file ('config file not
    found: data.root=/d'), and a config file among the overrides was refused as 'not of the form key=value'."""
    demo = os.path.relpath(os.path.join(ROOT, "configs", "sweeps", "digits_demo.yaml"))
    monkeypatch.setattr(sys, "argv", ["sweep.py"])  # argparse names the program after it
    with pytest.raises(SystemExit) as stop:
        sweep.main([a.format(sweep=demo) for a in argv])
    assert stop.value.code == 2  # a usage error, as argparse's
    assert capsys.readouterr().err == f"error: sweep.py: {says.format(sweep=demo)}; see sweep.py --help\n"


def test_finetune_layout_drop_is_the_difference_of_the_figures_printed(tmp_path):
    """2 and 1 of 3 images right: 66.67 and 33.33 printed, whose difference is -33.34; the unrounded drop, -33.333...,
    printed as -33.33, was a cell whose arithmetic fails. The Average takes the same rule."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_finetune_result("pets", "CD", 100 * 2 / 3, 100 * 1 / 3)))
    lines = paper_table.main(["--layout", "finetune", str(path)]).splitlines()
    assert "| Pets | 66.67 / 33.33 / -33.34 |" in lines
    assert "| Average | 66.67 / 33.33 / -33.34 |" in lines
