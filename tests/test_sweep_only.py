"""`--only` keeps some runs of a sweep: only their settings are checked (a run left out does not run, and an unknown
key of its own does not refuse the others), while every run's folder still counts, so a kept run never shares one,
and so does every key a run sets itself: an override for the whole sweep may not turn a kept baseline into the
sweep's CD or TWEO run under the baseline's name, whichever runs --only keeps."""
from __future__ import annotations

import itertools
import os
import re
import shlex

import pytest

import sweep
from configs import ConfigError, load_config
from configs.loader import config_to_dict, read_yaml_file
from tests.conftest import ROOT


def sweep_file(tmp_path, other: str = "b") -> str:
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\nruns:\n  a: [optim.lr=1e-3]\n"
                    f"  {other}: [optim.lrr=1]\n")
    return str(spec)


def test_only_checks_the_runs_it_keeps(tmp_path, capsys):
    spec = sweep_file(tmp_path)
    assert [r["name"] for r in sweep.expand(spec, [], only=["a"])] == ["a", "b"]
    assert sweep.main([spec, "--only", "a"]) == 0
    (_, command) = capsys.readouterr().out.splitlines()  # the `cd` into the repository root, the one command
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


DOSE = os.path.join(ROOT, "configs", "sweeps", "fashion_mnist_dose.yaml")


@pytest.mark.parametrize("override, method, setter", [
    ("cd.enabled=true", "cd_finetune.yaml", "cd100x_s0"),
    ("cd={enabled: true, lam: 1.0}", "cd_finetune.yaml", "cd100x_s0"),
    ("tweo.enabled=true", "tweo_finetune.yaml", "tweo_s0")])
def test_only_a_baseline_refuses_an_override_that_would_give_it_another_runs_method(override, method, setter, capsys):
    """fashion_mnist_dose.yaml's baselines list only their seed, its CD and TWEO runs a method file that enables
    the method: cd.enabled=true for the whole sweep with --only baseline_s0 would train a CD run under the
    baseline's name (dose_report.py would read it as the baseline point). Refused as without --only, naming the
    runs that set the key and the files to edit."""
    section = override.split(".")[0].split("=")[0]
    # the reference, from the files: the baseline trains without the method, the method file turns it on
    sweep_file = read_yaml_file(DOSE)
    assert sweep_file["runs"]["baseline_s0"] == ["train.seed=0"]
    baseline = load_config([os.path.join(ROOT, c) for c in sweep_file["configs"]], ["train.seed=0"])
    assert getattr(baseline, section).enabled is False
    assert read_yaml_file(os.path.join(ROOT, "configs", "method", method))[section]["enabled"] is True
    for only in (["baseline_s0"], ["baseline_s0", "baseline_s1"]):
        with pytest.raises(SystemExit, match=rf"^error: sweep run 'baseline_s0': {re.escape(override)} would replace "
                                             rf"what other runs of the sweep set themselves \(.*?{section}\.enabled: "
                                             rf"{setter}, .*edit the runs in {re.escape(DOSE)} or "
                                             rf"configs/method/{re.escape(method)} "):
            sweep.main([DOSE, "--evaluate", "--only", *only, override])
        assert "train.py" not in capsys.readouterr().out


def test_an_override_of_a_key_that_tells_the_runs_apart_is_refused_whichever_runs_only_keeps(tmp_path):
    """A baseline, a CD run (a config file of its own) and a run of another optim.lr: for every set of runs --only
    may keep, an override of a key in which their resolved configs differ (the reference: load_config of each run,
    compared key by key) is refused, in any spelling; one of a key that no run sets itself reaches every kept run."""
    spec = tmp_path / "s.yaml"
    runs = {"base": [], "cd": ["configs/method/cd.yaml"], "lr": ["optim.lr=0.0123"]}
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\nruns:\n"
                    + "".join(f"  {n}: [{', '.join(items)}]\n" for n, items in runs.items()))
    resolved = {n: flat(config_to_dict(load_config(
        [os.path.join(ROOT, c) for c in ["configs/debug/tiny.yaml", *(i for i in items if i.endswith(".yaml"))]],
        [i for i in items if not i.endswith(".yaml")]))) for n, items in runs.items()}
    differ = sorted(k for k in resolved["base"] if len({repr(r[k]) for r in resolved.values()}) > 1)
    assert {"cd.enabled", "optim.lr"} <= set(differ)
    for only in (list(c) for r in range(1, 4) for c in itertools.combinations(runs, r)):
        for key in differ:
            value = resolved["base"][key]
            for override in (f"{key}={value}", f"{key.split('.')[0]}={{{key.split('.')[1]}: {value}}}"):
                with pytest.raises(ConfigError, match=r"would replace what (the run sets itself|other runs of the "
                                                      r"sweep set themselves)"):
                    sweep.expand(str(spec), [override], only=only)
        kept = [r for r in sweep.expand(str(spec), ["train.seed=7"], only=only) if r["name"] in only]
        assert len(kept) == len(only) and all("train.seed=7" in r["overrides"] for r in kept)


def flat(d: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a nested dict of config sections (a free-form dict field counts as one value)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not prefix:
            out.update(flat(v, f"{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_a_key_that_only_places_work_set_by_another_runs_item_may_be_set_for_the_runs_kept(tmp_path):
    """data.num_workers in run b's items changes where b's batches are made, not what any run computes: with
    --only a, data.num_workers=2 for the whole sweep is no other run's setting."""
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\nruns:\n  a: [optim.lr=1e-3]\n"
                    "  b: [optim.lr=1e-3, data.num_workers=1]\n")
    (a, _) = sweep.expand(str(spec), ["data.num_workers=2"], only=["a"])
    assert a["overrides"][-2] == "data.num_workers=2"


def test_the_documented_shrinking_overrides_keep_the_baseline_a_baseline(capsys, monkeypatch):
    """docs/mini_reproduction.md ("On a GPU") checked fashion_mnist_gpu.yaml on a CPU with --only baseline_s0
    cd100x_s0 and overrides that shrink every run: no run sets those keys itself, so they pass, and each printed
    train.py command, loaded as train.py loads it, is still its run: the baseline without CD, cd100x at lam 1.0."""
    monkeypatch.chdir(ROOT)
    path = os.path.join("configs", "sweeps", "fashion_mnist_gpu.yaml")
    shrink = ["sched.epochs=1", "sched.warmup_epochs=0.2", "train.max_steps=3", "model.img_size=28",
              "data.num_workers=2", "data.root=kit/fashion_mnist", "model.pretrained=kit/dinov2_s14_half.safetensors"]
    assert sweep.main([path, "--only", "baseline_s0", "cd100x_s0", *shrink]) == 0
    commands = [shlex.split(line) for line in capsys.readouterr().out.splitlines()[1:]]  # after the `cd`
    assert [c[-1].rsplit("/", 1)[1] for c in commands] == ["baseline_s0", "cd100x_s0"]
    baseline, cd100x = (load_config([c[i + 1] for i, w in enumerate(c) if w == "--config"],
                                    [w for w in c[c.index("train.py") + 1:] if "=" in w and not w.startswith("--")])
                        for c in commands)
    assert not baseline.cd.enabled and not baseline.tweo.enabled
    assert cd100x.cd.enabled and cd100x.cd.lam == 1.0 and cd100x.cd.lam_per_role == {"fc2": 2.0}
    assert baseline.sched.epochs == cd100x.sched.epochs == 1 and baseline.train.max_steps == 3
