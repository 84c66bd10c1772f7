"""evaluate.py end to end on a checkpoint trained on digits: JSON layout, activation maxima, pipelines."""
import json
import os
import re
import statistics
import subprocess
import sys

import pytest

import evaluate
import train
from configs import ConfigError, config_to_dict, load_config
from configs.loader import parse_yaml
from engine import result_table
from engine.eval_results import ResultsError
from engine.quant_settings import quant_settings
from quant import bits_order
from tests.conftest import DEMO_CONFIG, ROOT, load_script, run_entry


@pytest.fixture(scope="module")
def digits_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits")
    cfg = load_config([DEMO_CONFIG], [f"out_dir={out}", "model.name=vit_nano", "train.max_steps=40",
                                      "sched.epochs=2", "sched.warmup_epochs=0", "log.tensorboard=false"])
    train.main(cfg)
    return os.path.join(out, "best.pt")


def test_evaluate_writes_the_documented_json(digits_checkpoint, tmp_path):
    out = str(tmp_path / "result.json")
    args = evaluate.parse_args(["--checkpoint", digits_checkpoint, "--quant", "percentile", "repq",
                                "--bits", "w8a8", "w4a4", "--out", out])
    result = evaluate.main(args)
    with open(out) as f:
        saved = json.load(f)
    assert saved["model"] == "vit_nano" and saved["method"] == "Baseline" and saved["images"] == 360
    # the training recipe (the seed and paths left out), for telling seeds from other experiments
    assert saved["recipe"]["model.name"] == "vit_nano" and saved["recipe"]["optim.name"] == "adamw"
    assert "train.seed" not in saved["recipe"] and "out_dir" not in saved["recipe"]
    assert 0 <= saved["fp"]["top1"] <= 100 and saved["fp"]["top5"] >= saved["fp"]["top1"]
    assert 0 < saved["max_act"]["module"] and 0 < saved["max_act"]["block"]
    assert os.path.exists(saved["max_act"]["csv"]) and os.path.exists(saved["max_act"]["plot"])
    for pipeline in ("percentile", "repq"):
        for bits in ("w8a8", "w4a4"):
            entry = saved["quant"][pipeline][bits]
            assert 0 <= entry["top1"] <= 100 and entry["seconds"] > 0
            # the cost against the FP pass: quantized eval time over FP eval time; both times are written
            # rounded to the millisecond and the ratio to 0.01, so it lies within these bounds
            fp_s, q_s = saved["fp"]["seconds"], entry["eval_seconds"]
            low, high = (q_s - 5e-4) / (fp_s + 5e-4), (q_s + 5e-4) / max(fp_s - 5e-4, 1e-9)
            assert low - 0.005 <= entry["eval_vs_fp"] <= high + 0.005
    # 8-bit fake quantization of a trained model keeps its accuracy within a point
    assert abs(saved["quant"]["repq"]["w8a8"]["top1"] - saved["fp"]["top1"]) <= 1.0
    assert abs(saved["quant"]["percentile"]["w8a8"]["top1"] - saved["fp"]["top1"]) <= 1.0
    table = result_table.markdown_table([result,
                                     {**result, "method": "CD", "quant": {"repq": result["quant"]["repq"]}}])
    header, _, base, cd = table.splitlines()
    assert "RepQ-ViT W4A4" in header and "Percentile W8A8" in header
    assert base.startswith("| vit_nano | Baseline |") and cd.startswith("| vit_nano | CD |")
    assert cd.count(" - ") == 2  # the CD result has no percentile columns


def test_the_result_file_names_the_software_that_scored_it(digits_checkpoint, tmp_path):
    """The run's log names torch and timm (engine/runinfo.py's environment line), the result file did not: a table
    row could not say what software scored it. The float pass and maxima (measured by every call) and each quantized
    entry (written by the call that ran it) now record the versions and the commit of the call that computed them."""
    import platform

    import timm
    import torch

    out = str(tmp_path / "result.json")
    evaluate.main(evaluate.parse_args(["--checkpoint", digits_checkpoint, "--quant", "percentile", "--bits", "w8a8",
                                       "--out", out]))
    with open(out) as f:
        saved = json.load(f)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    for software in (saved["software"], saved["quant"]["percentile"]["w8a8"]["software"]):
        assert software["torch"] == torch.__version__ and software["timm"] == timm.__version__
        assert software["python"] == platform.python_version()
        assert software["commit"].partition("+")[0] == commit.strip()
    # the run trained in one part, under this software too (test_a_checkpoint_records_the_software_of_each_part)
    assert saved["trained_software"] == [saved["software"]]


def test_block_maxima_match_a_direct_computation(digits_checkpoint, tmp_path):
    import torch

    from data import build_eval_loader
    from engine.checkpoint import load_checkpoint
    from models import build_model

    args = evaluate.parse_args(["--checkpoint", digits_checkpoint, "--quant", "--out",
                                str(tmp_path / "r.json")])
    result = evaluate.main(args)
    payload = load_checkpoint(digits_checkpoint)
    cfg = load_config([DEMO_CONFIG], ["model.name=vit_nano"])
    model = build_model(cfg.model).eval()
    model.load_state_dict(payload["model"])
    loader = build_eval_loader(cfg.data, img_size=32, batch_size_per_gpu=360, rank=0, world_size=1,
                               num_classes=10)
    block_max, block_kurtosis, module_max = 0.0, 0.0, 0.0
    with torch.no_grad():
        for x, _ in loader:  # one batch of all 360 images
            h = model.patch_embed(x)
            h = model._pos_embed(h)
            for block in model.blocks:  # direct computation: run the blocks by hand
                # the outputs of the modules inside the block (attn: its proj's; mlp: its fc2's)
                n1 = block.norm1(h)
                n2 = block.norm2(h + block.attn(n1))
                fc1 = block.mlp.fc1(n2)
                outputs = [n1, block.attn.qkv(n1), block.attn(n1), n2, fc1, block.mlp.act(fc1), block.mlp(n2)]
                module_max = max(module_max, *(t.abs().max().item() for t in outputs))
                h = block(h)
                block_max = max(block_max, h.abs().max().item())
                # Pearson kurtosis of every value of the block's output, centred in float64
                centred = h.double().flatten() - h.double().mean()
                block_kurtosis = max(block_kurtosis, (centred ** 4).mean().item() / (centred ** 2).mean().item() ** 2)
    assert result["max_act"]["block"] == pytest.approx(block_max, rel=1e-5)
    assert result["max_act"]["module"] == pytest.approx(module_max, rel=1e-5)
    assert result["max_act"]["kurtosis"]["block"] == pytest.approx(block_kurtosis, rel=1e-5)
    assert result["quant"] == {}


@pytest.mark.slow
def test_bad_inputs_are_clear_errors(digits_checkpoint, tmp_path, capsys):
    """One refusal as the process runs (its whole stderr begins with the error), the others in this process
    (a process each would import torch again: seconds each)."""
    folder = os.path.dirname(digits_checkpoint)  # a run's folder exists: "not found" misleads
    bad = subprocess.run([sys.executable, "evaluate.py", "--checkpoint", folder], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and bad.stderr.startswith(f"error: {folder} is a folder")

    def run(*argv):
        code, _, err = run_entry("evaluate.py", list(argv), capsys)
        return code, err

    code, err = run("--checkpoint", str(tmp_path / "missing.pt"))
    assert code != 0 and "checkpoint not found" in err
    code, err = run("--checkpoint", digits_checkpoint, "--quant", "repqq")
    assert code != 0 and "unknown quantization pipeline" in err
    code, err = run("--config", DEMO_CONFIG)
    assert code != 0 and "nothing to evaluate" in err
    code, err = run("--checkpoint", digits_checkpoint, "quant.repq.round_zero_pont=true")
    assert code != 0 and "did you mean 'quant.repq.round_zero_point'" in err


# A 2-rank evaluation against one process (each image counted once; the same maxima and quantized top-1):
# test_evaluate_distributed.py, on ranks joined through torchrun's environment variables; the torchrun command's
# own exit after a finished evaluation: test_gplq_preemption.py (its resumed torchrun run).


def load_sensitivity_script():
    return load_script("quant_sensitivity")


def test_quant_sensitivity_runs_each_variant_into_its_own_file(digits_checkpoint, tmp_path, monkeypatch,
                                                              capsys):
    sens = load_sensitivity_script()
    monkeypatch.setattr(sens, "ALL", ["percentile", "repq"])
    monkeypatch.setattr(sens, "VARIANTS", {"official": (["percentile", "repq"], []),
                                           "first_last=w8a8": (["percentile"], ["quant.first_last=w8a8"])})
    table = sens.main(["--checkpoint", digits_checkpoint, "--out", str(tmp_path)])
    with open(tmp_path / "first_last-w8a8.json") as f:
        saved = json.load(f)
    assert saved["quant"]["percentile"]["w4a4"]["settings"]["options"]["stem_w_bits"] == 8
    assert table["first_last=w8a8"]["percentile"] == saved["quant"]["percentile"]["w4a4"]["top1"]
    assert "| first_last=w8a8 |" in capsys.readouterr().out
    assert json.load(open(tmp_path / "sensitivity_w4a4.json"))["top1"] == table


def test_quant_sensitivity_adds_aphq_to_its_variants_on_request(digits_checkpoint, tmp_path, monkeypatch, capsys):
    sens = load_sensitivity_script()
    monkeypatch.setattr(sens, "ALL", ["percentile"])
    monkeypatch.setattr(sens, "VARIANTS", {"official": (["percentile"], []),
                                           "calib=train": (["percentile"], ["quant.calib_transform=train"])})
    fast = ["quant.aphq.iters=2", "quant.aphq.recon_images=32", "quant.aphq.calib_images=16",
            "quant.aphq.batch_size=16", "quant.aphq.matmul_steps=9", "quant.aphq.search_rounds=1",
            "quant.aphq.eq_n=32"]
    table = sens.main(["--checkpoint", digits_checkpoint, "--out", str(tmp_path), "--with-aphq", *fast])
    assert set(table["official"]) == {"percentile", "aphq"}
    assert set(table["calib=train"]) == {"percentile"}  # APHQ calibrates on its own augmented images
    with open(tmp_path / "official.json") as f:
        assert json.load(f)["quant"]["aphq"]["w4a4"]["top1"] == table["official"]["aphq"]
    assert "| variant (w4a4) | percentile | aphq |" in capsys.readouterr().out


@pytest.mark.parametrize("override", ["quant.first_last=w8a8", "quant={calib_transform: train}"])
def test_quant_sensitivity_refuses_an_override_of_a_key_a_variant_varies(tmp_path, override):
    """quant.first_last=w8a8 for every run made the 'official' row first_last=w8a8, and that variant's change
    +0.00: refused before any evaluation."""
    sens = load_sensitivity_script()
    with pytest.raises(ConfigError, match=r"which a variant varies .*the 'official' row would be computed with it"):
        sens.main(["--checkpoint", str(tmp_path / "best.pt"), "--out", str(tmp_path / "sens"), override])
    assert not (tmp_path / "sens").exists()


@pytest.mark.parametrize("override, expected", [
    ("quant.aphq.iters=500", "no run of this command quantizes with aphq.*add --with-aphq"),
    ("quant={aphq: {iters: 500}}", "no run of this command quantizes with aphq"),
    ("quant.gptq.act_order=true", "no run of this command quantizes with gptq.*variants run gplq, percentile, repq"),
    ("quant.bits=[w3a3]", "the variants and --bits set quant.bits; give --bits instead"),
    ("quant.pipelines=[percentile]", "the variants and --bits set quant.pipelines"),
    ("quant={gplq: {steps: 5}, calib_images: 64}", "give the options of a pipeline as overrides of their own"),
])
def test_quant_sensitivity_refuses_an_override_that_no_run_reads(tmp_path, override, expected):
    """quant.aphq.iters=500 without --with-aphq ran every variant without APHQ and was recorded in the
    summary all the same: refused before any evaluation, like every key that no run reads."""
    sens = load_sensitivity_script()
    with pytest.raises(ConfigError, match=expected):
        sens.main(["--checkpoint", str(tmp_path / "best.pt"), "--out", str(tmp_path / "sens"), override])
    assert not (tmp_path / "sens").exists()


def test_quant_sensitivity_runs_the_documented_variants_and_tabulates_their_changes(tmp_path, monkeypatch, capsys):
    """Without evaluating (evaluate.main stands in, a top-1 per file and pipeline): each variant of the module
    docstring runs its pipelines with its one setting into its own file, an override of a pipeline's options
    reaches the variants that run it only, --bits W4A4 is w4a4, the table's change is variant minus official,
    and the summary records what was asked and is never replaced without --overwrite."""
    from engine.run_dir import RunDirError

    sens = load_sensitivity_script()
    official = {"percentile": 50.0, "repq": 60.0, "gplq": 70.0}
    calls = {}

    def stand_in(args):
        name = os.path.basename(args.out)
        calls[name] = (sorted(args.quant), list(args.overrides), args.bits)
        change = 0.0 if name == "official.json" else 2.5 if name == "first_last-w8a8.json" else -1.25
        return {"quant": {p: {"w4a4": {"top1": official[p] + change}} for p in args.quant}}

    monkeypatch.setattr(sens.evaluate, "main", stand_in)
    out = tmp_path / "sens"
    out.mkdir()  # evaluate.py, which this test does not run, makes it
    table = sens.main(["--checkpoint", str(tmp_path / "best.pt"), "--out", str(out), "--bits", "W4A4",
                       "quant.gplq.steps=5"])
    all3, gplq = ["gplq", "percentile", "repq"], ["gplq"]
    steps = "quant.gplq.steps=5"
    assert calls == {
        "official.json": (all3, [steps], ["w4a4"]),
        "first_last-w8a8.json": (all3, [steps, "quant.first_last=w8a8"], ["w4a4"]),
        "calib-train.json": (["percentile", "repq"], ["quant.calib_transform=train"], ["w4a4"]),
        "gplq_operands_float.json": (gplq, [steps, "quant.gplq.matmul_operands=false"], ["w4a4"]),
        "gplq_lsq_lr_1e-4.json": (gplq, [steps, "quant.gplq.scale_lr=1e-4"], ["w4a4"]),
        "gplq_qwt_w32a4.json": (gplq, [steps, "quant.gplq.qwt_target=w32a4"], ["w4a4"]),
        "gplq_qwt_teacher.json": (gplq, [steps, "quant.gplq.qwt_target=teacher"], ["w4a4"]),
        "gplq_stage2_eval.json": (gplq, [steps, "quant.gplq.stage2_train_transform=false"], ["w4a4"])}
    printed = capsys.readouterr().out
    assert "| official | 50.00 | 60.00 | 70.00 |" in printed
    assert "| first_last=w8a8 | 52.50 (+2.50) | 62.50 (+2.50) | 72.50 (+2.50) |" in printed
    assert "| calib=train | 48.75 (-1.25) | 58.75 (-1.25) |  |" in printed
    summary = out / "sensitivity_w4a4.json"
    saved = json.loads(summary.read_text())
    assert saved == {"checkpoint": str(tmp_path / "best.pt"), "bits": "w4a4", "overrides": [steps], "top1": table}
    with pytest.raises(RunDirError, match="sensitivity_w4a4.json already exist"):
        sens.main(["--checkpoint", str(tmp_path / "best.pt"), "--out", str(out)])
    assert json.loads(summary.read_text()) == saved


@pytest.mark.parametrize("pipelines, overrides, unread", [
    (["repq"], ["quant.aphq.iters=500"], "aphq"), (None, ["quant.calib_images=8", "quant.gplq={steps: 5}"], "gplq"),
    (["percentile"], ["quant={repq: {reparam: false}}"], "repq")])
def test_options_of_a_pipeline_the_evaluation_does_not_run_are_refused(digits_checkpoint, tmp_path, pipelines,
                                                                       overrides, unread):
    """quant.aphq.iters=500 beside --quant repq was accepted and ignored (each pipeline reads quant.<its name>
    only); refused before the model is evaluated, naming the override and the pipelines that run."""
    quant = ["--quant", *pipelines] if pipelines else []  # None: the default ones, percentile and repq
    with pytest.raises(ConfigError, match=rf"{re.escape(overrides[-1])} would be ignored: it sets options of "
                                          rf"{unread}, which this evaluation does not run \(pipelines: "):
        evaluate.main(evaluate.parse_args(["--checkpoint", digits_checkpoint, "--out", str(tmp_path / "e.json"),
                                           *quant, *overrides]))
    assert not (tmp_path / "e.json").exists()
    # the options of a pipeline that runs, and the settings every pipeline shares, are read
    assert evaluate.pipeline_options_unread(["quant.repq.reparam=false", "quant.calib_images=8",
                                             "quant.first_last=w8a8"], ["repq"]) == []


def test_quant_sensitivity_gives_each_variant_the_overrides_it_reads():
    """A gplq-only variant reads no calibration batch (GPLQ draws its own images): evaluate.py would refuse
    quant.calib_images there, so only the variants with percentile or repq get it."""
    sens = load_sensitivity_script()
    given = ["quant.calib_images=8", "quant.gplq.steps=5", "quant.first_last=w8a8"]
    assert sens.variant_overrides(given, ["gplq"]) == ["quant.gplq.steps=5", "quant.first_last=w8a8"]
    assert sens.variant_overrides(given, ["percentile", "repq"]) == ["quant.calib_images=8", "quant.first_last=w8a8"]
    assert sens.variant_overrides(given, ["percentile", "repq", "gplq"]) == given


@pytest.mark.parametrize("pipelines, override", [(["rtn"], "quant.calib_images=8"),
                                                (["aphq", "gplq"], "quant.calib_seed=3"),
                                                (["gplq"], "quant={calib_transform: train}")])
def test_a_calibration_batch_that_no_pipeline_reads_is_refused(digits_checkpoint, tmp_path, pipelines, override):
    """RTN reads no data and APHQ and GPLQ draw their own training images on a classifier: quant.calib_* beside
    them was accepted, and neither used nor recorded in the result."""
    with pytest.raises(ConfigError, match=rf"{re.escape(override)} would be ignored: no pipeline of this evaluation "
                                          rf"reads the calibration batch \(pipelines: {', '.join(pipelines)};"):
        evaluate.main(evaluate.parse_args(["--checkpoint", digits_checkpoint, "--out", str(tmp_path / "e.json"),
                                           "--quant", *pipelines, override]))
    assert not (tmp_path / "e.json").exists()
    # one pipeline that reads it is enough; a language model's GPTQ reads it, its RTN does not
    assert evaluate.calibration_overrides_unread([override], [*pipelines, "percentile"], language=False) == []
    assert evaluate.calibration_overrides_unread(["quant.calib_images=8"], ["gptq"], language=True) == []
    assert evaluate.calibration_overrides_unread(["quant.calib_images=8", "quant.first_last=w8a8"], ["rtn"],
                                                 language=True) == ["quant.calib_images=8"]
    assert evaluate.calibration_overrides_unread(["quant.calib_images=8"], ["gplq"], language=True) == []


def test_first_last_bit_widths_without_a_pipeline_are_refused(checkpoint, tmp_path):
    """quant.first_last sets the stem and head bit-widths of every pipeline: with --quant naming none it was taken,
    and neither applied nor recorded; from a --config file likewise. Wherever a pipeline runs it is read (APHQ
    included, which reads no calibration batch on a classifier)."""
    base = ["--checkpoint", checkpoint, "--quant"]
    refused = r"would be ignored: this evaluation runs no pipeline \(pipelines: none\)"
    with pytest.raises(ConfigError, match=rf"^quant.first_last=w8a8 {refused}"):
        evaluate.resolve_config(evaluate.parse_args([*base, "quant.first_last=w8a8"]))
    extra = tmp_path / "extra.yaml"
    extra.write_text("quant:\n  first_last: w8a8\n")
    with pytest.raises(ConfigError, match=rf'^quant.first_last="w8a8" \(--config {re.escape(str(extra))}\) {refused}'):
        evaluate.resolve_config(evaluate.parse_args([*base, "--config", str(extra)]))
    cfg, _ = evaluate.resolve_config(evaluate.parse_args([*base, "aphq", "quant.first_last=w8a8"]))
    assert cfg.quant.first_last == "w8a8"
    assert evaluate.calibration_overrides_unread(["quant={first_last: w8a8}"], [], language=False) == [
        "quant={first_last: w8a8}"]
    assert evaluate.calibration_overrides_unread(["quant.first_last=w8a8"], ["aphq"], language=False) == []


def test_table_over_seeds_reports_mean_and_sample_std_per_method():
    def result(method, fp, repq, module=5.0, block=3.0):
        return {"model": "m", "method": method, "fp": {"top1": fp},
                "max_act": {"module": module, "block": block}, "quant": {"repq": {"w4a4": {"top1": repq}}}}

    results = [result("Baseline", 80.0, 70.0), result("Baseline", 82.0, 74.0), result("Baseline", 84.0, 72.0),
               result("CD", 81.0, 75.0, module=4.0)]
    results = [dict(r, train_seed=seed) for seed, r in enumerate(results)]  # distinct seeds: no note below
    header, _, base, cd = result_table.markdown_table(results, over_seeds=True).splitlines()
    # mean and sample std (n - 1) of (80, 82, 84) = 82 +- 2; of (70, 74, 72) = 72 +- 2
    assert base == "| m | Baseline (n=3) | 82.00 ± 2.00 | 5.00 ± 0.00 / 3.00 ± 0.00 | 72.00 ± 2.00 |"
    assert cd == "| m | CD (n=1) | 81.00 | 4.00 / 3.00 | 75.00 |"
    # a run given twice, or results of another evaluation, are not seeds
    twice = [dict(result("Baseline", 80.0, 70.0), fingerprint="f", checkpoint=c) for c in ("a/best.pt", "b/best.pt")]
    with pytest.raises(ValueError, match="m Baseline: a/best.pt and b/best.pt hold the same weights"):
        result_table.markdown_table(twice, over_seeds=True)
    other_data = [dict(result("Baseline", 80.0, 70.0), data={"dataset": d}) for d in ("folder", "synthetic")]
    with pytest.raises(ValueError, match=r'm Baseline: result 1 and result 2 were evaluated differently \(data: '
                                         r'{"dataset": "folder"} vs {"dataset": "synthetic"}\); rows average the '
                                         r'seeds of one evaluation: give results evaluated alike$'):  # another file
        result_table.markdown_table(other_data, over_seeds=True)
    assert result_table.markdown_table(other_data)  # one row per result: nothing is averaged
    other_calibration = [dict(result("Baseline", 80.0, 70.0), fingerprint=f) for f in ("a", "b")]
    other_calibration[1]["quant"]["repq"]["w4a4"]["settings"] = {"calibration": {"images": 8}}
    with pytest.raises(ValueError, match=r"m Baseline: result 1 and result 2 were evaluated differently \(repq w4a4 "
                                         r"settings: calibration None -> {'images': 8}\); .* or --recompute them "
                                         r"with one set of settings$"):
        result_table.markdown_table(other_calibration, over_seeds=True)
    # runs of one method trained with another lr are not seeds; another seed is one
    from engine.run_dir import recipe
    configs = {overrides: config_to_dict(load_config([DEMO_CONFIG], list(overrides)))
               for overrides in (("train.seed=1",), ("train.seed=2",), ("train.seed=3", "optim.lr=0.01"))}
    runs = [dict(result("Baseline", 80.0, 70.0), fingerprint=str(i), checkpoint=f"{i}/best.pt",
                 recipe=recipe(config)) for i, config in enumerate(configs.values())]
    assert "(n=2)" in result_table.markdown_table(runs[:2], over_seeds=True)
    with pytest.raises(ValueError, match=r"m Baseline: 0/best.pt and 2/best.pt were trained with other settings "
                                         r"\(optim.lr 0.002 -> 0.01\)"):
        result_table.markdown_table(runs, over_seeds=True)
    # the same recipe evaluated with model.kwargs it was not trained with (gelu=tanh) is another evaluation
    runs = runs[:2]
    runs[1] = dict(runs[1], model_kwargs={"gelu": "tanh"})
    assert runs[0]["recipe"]["model.kwargs"] == {}
    with pytest.raises(ValueError, match=r'm Baseline: 0/best.pt and 1/best.pt were evaluated with other model.kwargs '
                                         r'\(as trained vs model.kwargs={"gelu": "tanh"} \(trained with {}\)\)'):
        result_table.markdown_table([dict(runs[0], model_kwargs={}), runs[1]], over_seeds=True)
    both = [dict(r, model_kwargs={"gelu": "tanh"}) for r in runs]
    assert "(n=2)" in result_table.markdown_table(both, over_seeds=True)  # alike: averaged, and marked


def test_table_marks_and_refuses_maxima_over_extra_modules():
    """A module maximum also over quant.act_max_extra_modules is not the paper's: its cell is marked ‡ with a note
    naming the patterns; seeds measured over other modules are refused, not averaged (was: neither)."""
    def result(seed, extra=None):
        max_act = {"module": 4.0 + seed, "block": 3.0, **({"extra_modules": extra} if extra is not None else {})}
        return {"model": "m", "method": "CD", "fp": {"top1": 80.0}, "max_act": max_act, "quant": {},
                "checkpoint": f"s{seed}/best.pt"}

    _, _, plain, marked, _, note = result_table.markdown_table(
        [result(0), result(1, ["patch_embed.proj"])]).splitlines()
    assert plain == "| m | CD | 80.000 | 4.00 / 3.00 |"
    assert marked == "| m | CD | 80.000 | 5.00‡ / 3.00 |"
    assert note == ('‡ m CD: the module maximum also counts modules outside the blocks: '
                    'quant.act_max_extra_modules=["patch_embed.proj"]')
    with pytest.raises(ValueError, match=r'm CD: s0/best.pt and s1/best.pt were evaluated differently '
                                         r'\(max_act.extra_modules: \[\] vs \["patch_embed.proj"\]\)'):
        result_table.markdown_table([result(0, []), result(1, ["patch_embed.proj"])], over_seeds=True)
    # alike (an empty list is the default, the order of the patterns plays no part): averaged
    assert result_table.markdown_table([result(0, []), result(1)], over_seeds=True).splitlines()[2] == \
        "| m | CD (n=2) | 80.00 ± 0.00 | 4.50 ± 0.71 / 3.00 ± 0.00 |"
    assert result_table.markdown_table([result(0, ["a", "b"]), result(1, ["b", "a"])],
                                       over_seeds=True).splitlines()[2] \
        == "| m | CD (n=2) | 80.00 ± 0.00 | 4.50 ± 0.71‡ / 3.00 ± 0.00 |"


def test_where_aphq_caches_its_units_is_no_setting_of_its_result(tmp_path):
    """quant.aphq.cache_device places copies of the units' inputs (exact on any device; the batches are drawn
    on the model's device, tests/test_gpu.py checks both placements agree on CUDA): a stored APHQ result
    is reused under another value, seeds evaluated with different ones average, and no table marks it; an
    option that changes the numbers (the grid) still counts."""
    from configs import Config
    from engine.eval_results import EvalResults, ResultsError, evaluation_difference

    cfg = Config()
    settings = quant_settings(cfg, "aphq")
    on_cpu = json.loads(json.dumps(settings, default=str))
    on_cpu["options"]["cache_device"] = "cpu"
    results = EvalResults.open(str(tmp_path / "r.json"), {"model": "m"})
    results.add("aphq", "w4a4", {"top1": 60.0}, on_cpu)
    results.save()
    reopened = EvalResults.open(str(tmp_path / "r.json"), {"model": "m"})
    assert reopened.plan("aphq", "w4a4", settings, recompute=False) is False  # already there
    other_grid = json.loads(json.dumps(settings, default=str))
    other_grid["options"]["iters"] = 7
    with pytest.raises(ResultsError, match=r"computed with other settings \(options.iters "):
        reopened.plan("aphq", "w4a4", other_grid, recompute=False)

    def result(aphq_settings):
        return {"model": "m", "quant": {"aphq": {"w4a4": {"top1": 60.0, "settings": aphq_settings}}}}
    assert evaluation_difference(result(settings), result(on_cpu)) is None
    difference = evaluation_difference(result(settings), result(other_grid))
    assert difference.what == "aphq w4a4 settings" and difference.of_settings
    assert str(difference).startswith("aphq w4a4 settings: options.iters")
    assert result_table.nondefault_settings("aphq", on_cpu) == []
    assert result_table.nondefault_settings("aphq", other_grid) == ["quant.aphq.iters=7"]


@pytest.mark.parametrize("overrides, name", [(["tweo.tau=6"], "TWEO (tau 6)"), (["tweo.p=2"], "TWEO (p 2)"),
                                             (["tweo.lam=0.1", "tweo.eps=0.001"], "TWEO (lam 0.1, eps 0.001)"),
                                             ([], "TWEO")])
def test_a_tweo_penalty_of_another_shape_is_named(overrides, name):
    """A tau or p ablation's runs were all 'TWEO': --over-seeds averaged them as the seeds of one method."""
    cfg = load_config([DEMO_CONFIG], ["tweo.enabled=true", *overrides])
    assert result_table.method_name(cfg) == name


@pytest.mark.parametrize("overrides, name", [([], "CD + TWEO"),
                                             (["cd.lam=0.01", "tweo.tau=6"], "CD (lam 0.01) + TWEO (tau 6)")])
def test_a_run_with_cd_and_tweo_is_named_by_both(overrides, name):
    """A run with both regularizers was 'CD', one of the CD runs: --over-seeds averaged it with them."""
    cfg = load_config([DEMO_CONFIG], ["cd.enabled=true", "tweo.enabled=true", *overrides])
    assert result_table.method_name(cfg) == name


def test_table_names_a_single_bit_width_other_than_w4a4():
    """Without a bit-width a column reads as the paper's W4A4: results of w6a6 alone are headed RepQ-ViT W6A6."""
    def result(bits):
        return {"model": "m", "method": "CD", "fp": {"top1": 80.0}, "max_act": {"module": 5.0, "block": 3.0},
                "quant": {"repq": {bits: {"top1": 70.0}}}}

    assert result_table.markdown_table([result("w6a6")]).splitlines()[0].endswith("| RepQ-ViT W6A6 |")
    assert result_table.markdown_table([result("w4a4")]).splitlines()[0].endswith("| RepQ-ViT |")


def test_table_orders_bit_widths_as_numbers():
    """Columns of one pipeline go by weight bits, then activation bits, as numbers: as text, w4a16 sorted before
    w4a4 and w16a16 before w3a3."""
    quant = {"repq": {b: {"top1": 70.0} for b in ("w8a8", "w4a16", "w16a16", "w4a4", "w3a3", "w4a8")}}
    result = {"model": "m", "method": "CD", "fp": {"top1": 80.0}, "max_act": {"module": 5.0, "block": 3.0},
              "quant": quant}
    header = result_table.markdown_table([result]).splitlines()[0]
    assert header.endswith("| RepQ-ViT W3A3 | RepQ-ViT W4A4 | RepQ-ViT W4A8 | RepQ-ViT W4A16 | RepQ-ViT W8A8 | "
                           "RepQ-ViT W16A16 |")


def test_bits_order_puts_a_name_that_does_not_parse_last():
    assert sorted(["w4a4", "int8", "w3a3"], key=bits_order) == ["w3a3", "w4a4", "int8"]


def test_model_kwargs_as_trained_are_unchanged_in_any_key_order():
    """The result file stores model.kwargs sorted, tuples as lists; the recipe keeps the order the run was given them
    in (model.kwargs.global_pool=avg model.kwargs.gelu=tanh). The same settings are no change (no † mark); another
    value is; a result without the recipe's model.kwargs is not compared."""
    trained = {"global_pool": "avg", "gelu": "tanh", "img_mean": (0.5, 0.5, 0.5)}
    stored = {"gelu": "tanh", "global_pool": "avg", "img_mean": [0.5, 0.5, 0.5]}
    assert result_table.model_kwargs_changed({"model_kwargs": stored, "recipe": {"model.kwargs": trained}}) is None
    other = dict(stored, gelu="none")
    assert result_table.model_kwargs_changed({"model_kwargs": other, "recipe": {"model.kwargs": trained}}) == (
        'model.kwargs={"gelu": "none", "global_pool": "avg", "img_mean": [0.5, 0.5, 0.5]} (trained with '
        '{"gelu": "tanh", "global_pool": "avg", "img_mean": [0.5, 0.5, 0.5]})')
    assert result_table.model_kwargs_changed({"model_kwargs": other, "recipe": {"optim.lr": 0.1}}) is None


def test_seeds_without_a_recipe_are_not_compared_by_model_kwargs():
    """A result that records no recipe (an older file, a weights file) is of unknown model.kwargs as trained: beside
    a seed evaluated with other model.kwargs than trained it is not called 'as trained' and refused; two seeds that
    record both are still told apart."""
    changed = {"recipe": {"model.kwargs": {}}, "model_kwargs": {"gelu": "tanh"}}
    as_trained = {"recipe": {"model.kwargs": {}}, "model_kwargs": {}}
    older = {"model_kwargs": {"gelu": "tanh"}}
    assert result_table.model_kwargs_unlike([("a.pt", changed), ("b.pt", older)]) is None
    assert result_table.model_kwargs_unlike([("b.pt", older), ("a.pt", changed), ("c.pt", as_trained)]) == (
        'a.pt and c.pt were evaluated with other model.kwargs (model.kwargs={"gelu": "tanh"} (trained with {}) vs '
        'as trained)')


def test_table_over_seeds_keeps_one_row_per_model_of_a_method():
    """--over-seeds averages the results of one model and method: the Baseline of two models is two rows, each of
    its own results (a seed of one model averaged with another model's is no seed of either). By hand: m1's FP
    80 and 84 give 82 and their sample std, its RepQ 70 and 74 give 72; m2's one result is its own numbers."""
    def result(model, fp, repq):
        return {"model": model, "method": "Baseline", "fp": {"top1": fp}, "max_act": {"module": 5.0, "block": 3.0},
                "quant": {"repq": {"w4a4": {"top1": repq}}}}

    results = [result("m1", 80.0, 70.0), result("m2", 60.0, 50.0), result("m1", 84.0, 74.0)]
    table = result_table.markdown_table([dict(r, train_seed=seed) for seed, r in enumerate(results)],  # distinct
                                        over_seeds=True)
    std = f"{statistics.stdev([80.0, 84.0]):.2f}"  # also that of 70 and 74
    assert table.splitlines()[2:] == [
        f"| m1 | Baseline (n=2) | 82.00 ± {std} | 5.00 ± 0.00 / 3.00 ± 0.00 | 72.00 ± {std} |",
        "| m2 | Baseline (n=1) | 60.00 | 5.00 / 3.00 | 50.00 |"]

def test_table_over_seeds_names_the_count_of_a_cell_over_fewer_seeds():
    """A pipeline some seeds were not evaluated with is averaged over those that were; the row's (n=3)
    counts every seed, so the cell names its own count."""
    def result(fp, repq=None):
        quant = {"repq": {"w4a4": {"top1": repq}}} if repq is not None else {}
        return {"model": "m", "method": "Baseline", "fp": {"top1": fp},
                "max_act": {"module": 5.0, "block": 3.0}, "quant": quant}

    rows = result_table.markdown_table([result(80.0, 60.0), result(82.0, 50.0), result(84.0)], over_seeds=True)
    assert rows.splitlines()[2] == ("| m | Baseline (n=3) | 82.00 ± 2.00 | 5.00 ± 0.00 / 3.00 ± 0.00 "
                                    "| 55.00 ± 7.07 (n=2) |")


def test_seeds_are_compared_pairwise_not_only_with_the_first():
    """The first seed lacks the APHQ entry the two others hold with other settings: they are not averaged."""
    def result(i, aphq_iters=None):
        quant = {"repq": {"w4a4": {"top1": 70.0}}}
        if aphq_iters is not None:
            quant["aphq"] = {"w4a4": {"top1": 60.0, "settings": {"options": {"iters": aphq_iters}}}}
        return {"model": "m", "method": "CD", "fp": {"top1": 80.0}, "max_act": {"module": 5.0, "block": 3.0},
                "quant": quant, "fingerprint": str(i), "checkpoint": f"s{i}/best.pt"}

    with pytest.raises(ValueError, match=r"m CD: s1/best.pt and s2/best.pt were evaluated differently \(aphq w4a4 "
                                         r"settings: options.iters 10 -> 20\)"):
        result_table.markdown_table([result(0), result(1, 10), result(2, 20)], over_seeds=True)


@pytest.mark.parametrize("split, marked", [("val/", False), ("./val", False), ("val//", False), ("train/", True),
                                           ("validation", True), ("/datasets/imagenet/val", False),
                                           ("/datasets/imagenet/val/", False), ("/datasets/other/val", True),
                                           ("/datasets/imagenet/train", True)])
def test_a_val_split_spelled_with_a_trailing_slash_or_its_full_path_is_not_marked_as_another_split(split, marked):
    """data.val_split='val/' names the same folder as 'val' (data/folder.find_split joins it onto data.root), and
    so does data.root's val folder by its full path: its row was marked † as evaluated on another split than the
    validation split."""
    result = {"data": {"dataset": "folder", "root": "/datasets/imagenet", "val_split": split}}
    assert result_table.evaluated_otherwise(result) == (f"data.val_split={split!r}" if marked else None)


def test_table_marks_a_result_scored_on_another_split_or_under_an_autocast():
    """The paper's numbers are validation accuracies in fp32: a result scored with data.val_split=train (the training
    images) or under --amp reads as one unless marked. Its row is marked † with a note naming the setting, also in
    scripts/paper_table.py's fine-tuning layout; results on 'val' in fp32, or older files that record neither, are
    not (was: no mark)."""
    def result(method, split=None, amp=None):
        data = {"dataset": "folder", **({"val_split": split} if split is not None else {})}
        return {"model": "m", "method": method, "fp": {"top1": 80.0}, "max_act": {"module": 5.0, "block": 3.0},
                "quant": {"repq": {"w4a4": {"top1": 60.0}}}, "data": data,
                **({"eval_amp": amp} if amp is not None else {})}

    results = [result("Baseline", "val", "none"), result("CD", "train", "none"), result("TWEO", "val", "bf16"),
               result("Old")]
    _, _, plain, train_split, bf16, old, _, note_split, note_amp = result_table.markdown_table(results).splitlines()
    assert plain.startswith("| m | Baseline |") and old.startswith("| m | Old |")
    assert train_split.startswith("| m† | CD |") and bf16.startswith("| m† | TWEO |")
    assert note_split == "† m CD: evaluated with data.val_split='train'"
    assert note_amp == "† m TWEO: evaluated with --amp bf16"
    assert result_table.evaluated_otherwise(result("CD", "train", "fp16")) == "data.val_split='train'; --amp fp16"
    # the fine-tuning layout compares a data set's methods on the same split: both scored on train, both marked
    on_train = [dict(result(m, "train", "none"), checkpoint=f"{m}/best.pt", data={"dataset": "cifar100",
                                                                                  "val_split": "train"})
                for m in ("Baseline", "CD")]
    table = load_script("paper_table").finetune_table(on_train).splitlines()
    assert "| cifar100 | 80.00 / 60.00 / -20.00† | 80.00 / 60.00 / -20.00† |" in table
    assert "† cifar100 CD: evaluated with data.val_split='train'" in table


def test_table_columns_cells_and_marks_follow_the_papers_layout():
    """Columns in the paper's pipeline order (Percentile, RepQ-ViT, APHQ, ...; not alphabetical); a cell over
    one of three seeds names its count; a result calibrated on another set than the default's is marked."""
    from configs import Config

    def result(fp, quant, method="CD"):
        return {"model": "m", "method": method, "fp": {"top1": fp}, "max_act": {"module": 5.0, "block": 3.0},
                "quant": quant}

    header = result_table.markdown_table([result(80.0, {p: {"w4a4": {"top1": 1.0}} for p in ("aphq", "repq")})])
    assert header.splitlines()[0].endswith("| RepQ-ViT | APHQ |")
    rows = result_table.markdown_table([result(80.0, {"repq": {"w4a4": {"top1": 60.0}}}), result(82.0, {}),
                                    result(84.0, {})], over_seeds=True)
    assert rows.splitlines()[2].endswith("| 60.00 (n=1) |")
    settings = json.loads(json.dumps(quant_settings(Config(), "repq"), default=str))
    assert result_table.nondefault_settings("repq", settings) == []
    settings["calibration"]["images"] = Config().quant.calib_images + 1
    assert result_table.nondefault_settings("repq", settings) == [
        f"quant.calib_images={Config().quant.calib_images + 1}"]


@pytest.mark.parametrize("overrides, message", [
    (["quant.aphq.calib_images=64", "quant.aphq.recon_images=32"],
     "quant.aphq: calib_images=64 exceeds recon_images=32"),
    (["quant.aphq.batch_size=64", "quant.aphq.recon_images=32", "quant.aphq.calib_images=32"],
     "quant.aphq: batch_size=64 exceeds recon_images=32"),
    (["quant.aphq.eq_n=8"], "quant.aphq: eq_n=8 leaves the 4-bit grids at w4a4 fewer than 2 ranges for each "
                            "of their 16 zero points (a degenerate search): give eq_n >= 32"),
    (["quant.aphq.eq_n=16"], "quant.aphq: eq_n=16 leaves the 4-bit grids at w4a4 fewer than 2 ranges"),
    (["quant.aphq.matmul_steps=1"], "quant.aphq: matmul_steps=1: the matmul search needs >= 2 candidates"),
    (["quant.aphq.weight_pct=[1.0,0.9]"], "quant.aphq: weight_pct=[1.0, 0.9]: percentile levels"),
    # a float weight beside a quantized input: the search would leave the input unsearched after the FP run
    (["quant.aphq.head_w_bits=0"], "quant.aphq: head_w_bits=0 with the head input at 4 bits: APHQ searches a layer's "
                                   "input together with its quantized weight; give head_w_bits >= 2 or head_a_bits=0"),
    (["quant.aphq.stem_w_bits=0", "quant.aphq.stem_a_bits=8"],
     "quant.aphq: stem_w_bits=0 with the stem input at 8 bits"),
])
def test_aphq_options_that_cannot_go_together_stop_before_any_work(checkpoint, overrides, message):
    from configs import ConfigError
    from quant import PIPELINES

    args = evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "repq", "aphq", *overrides])
    with pytest.raises(ConfigError, match=re.escape(message)):
        evaluate.resolve_config(args)  # checked with the config, before a model or a loader exists
    # the API checks them before it looks at the model or the data (which would raise otherwise)
    options = {o.split("=")[0].split(".")[-1]: tuple(v) if isinstance(v := parse_yaml(o.split("=")[1]), list) else v
               for o in overrides}
    with pytest.raises(ValueError, match=re.escape(message.split(": ", 1)[1])):
        PIPELINES["aphq"](None, None, "w4a4", options, data=None)


def test_another_digits_val_fraction_is_refused_for_a_checkpoint(checkpoint):
    """Another split of the embedded digits puts images the checkpoint was trained on into the val split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from configs import ConfigError

    # independent of the data code: the images a 0.5 split holds out include many of a 0.2 split's training ones
    ids, labels = range(len(load_digits().target)), load_digits().target
    trained_on = set(train_test_split(ids, test_size=0.2, stratify=labels, random_state=0)[0])
    assert len(trained_on & set(train_test_split(ids, test_size=0.5, stratify=labels, random_state=0)[1])) > 100
    args = evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "repq", "data.digits_val_fraction=0.5"])
    with pytest.raises(ConfigError, match=r"data.digits_val_fraction=0.5: .* images it was trained on"):
        evaluate.resolve_config(args)
    evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, "data.digits_val_fraction=0.2"]))


@pytest.mark.parametrize("overrides, message", [
    (["quant.repq.stem_w_bits=40"], "quant.repq: stem_w_bits=40: give 2..15 bits, 0 (float, which a bit-width "
                                     "such as w4a16 spells 16) or null"),
    (["quant.repq.head_a_bits=1"], "quant.repq: head_a_bits=1: give 2..15 bits"),
    (["quant.repq.head_a_bits=16"], "quant.repq: head_a_bits=16: give 2..15 bits"),
    (["quant.percentile.act_percentiles=[1.5]"], "quant.percentile: act_percentiles=[1.5]: each level p must lie in "
                                                 "(0.5, 1]"),
    (["quant.percentile.act_range=percentile", "quant.percentile.act_percentiles=[0.999,0.9999]"],
     "quant.percentile: act_range=percentile takes one level, act_percentiles=[0.999, 0.9999] gives 2"),
    (["quant.percentile.act_percentiles=[]"], "quant.percentile: act_percentiles=[]: give at least one level"),
    (["quant.percentile.act_range=minmax", "quant.percentile.act_percentiles=[0.999]"],
     "quant.percentile: act_percentiles=[0.999]: act_range=minmax reads no percentile"),
    (["quant.aphq.cache_device=foo"], "quant.aphq: cache_device='foo': not a torch device"),
    (["quant.gplq.stage2_images=0"], "'quant.gplq.stage2_images' must be >= 1; got 0"),
    (["quant.aphq.drop_prob=1.5"], "'quant.aphq.drop_prob' must be >= 0 and <= 1; got 1.5"),
    (["quant.aphq.temperature=0"], "'quant.aphq.temperature' must be > 0"),
    (["quant.gplq.lr=-1"], "'quant.gplq.lr' must be >= 0"),
    (["quant.pipelines=[percentile]"], "--quant and quant.pipelines= both say what to run: give one of them"),
    (["quant.bits=[w8a8]"], "--bits and quant.bits= both say what to run"),
    (["quant={pipelines: [percentile]}"], "--quant and quant.pipelines= both say what to run"),  # --quant won
])
def test_option_values_a_pipeline_cannot_use_stop_before_any_work(checkpoint, overrides, message):
    from configs import ConfigError
    args = evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "percentile", "repq", "aphq", "gplq",
                                "--bits", "w4a4", *overrides])
    with pytest.raises(ConfigError, match=re.escape(message)):
        evaluate.resolve_config(args)


@pytest.mark.parametrize("flag, yaml_text, key", [(["--quant", "percentile"], "quant:\n  pipelines: [repq]\n",
                                                    "quant.pipelines"),
                                                   (["--quant", "repq", "--bits", "w4a4"],
                                                    "quant:\n  bits: [w8a8]\n", "quant.bits")])
def test_a_config_file_naming_what_to_run_beside_the_flag_is_refused(checkpoint, tmp_path, flag, yaml_text, key):
    """A --config file's quant.pipelines / quant.bits beside --quant / --bits was dropped without a word (the flag
    ran percentile where the file asked for repq), where the same key given as an override is refused."""
    layer = tmp_path / "quant.yaml"
    layer.write_text(yaml_text)
    with pytest.raises(ConfigError, match=re.escape(f"{flag[-2]} and {key} (--config {layer}) both say what to run")):
        evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, "--config", str(layer), *flag]))


@pytest.mark.parametrize("argv, message", [(["--quant", "repq", "repq"], "--quant / quant.pipelines names repq twice"),
                                           (["--bits", "w4a4", "W4A4"], "--bits / quant.bits names w4a4 twice"),
                                           # `--quant` with no pipeline: the float evaluation alone reads no bits
                                           (["--quant", "--bits", "w4a4"], "--bits / quant.bits: w4a4 given, but "
                                            "--quant / quant.pipelines names no pipeline")])
def test_a_pipeline_or_bit_width_named_twice_is_refused(checkpoint, argv, message):
    from configs import ConfigError
    with pytest.raises(ConfigError, match=re.escape(message)):
        evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, *argv]))


def test_bits_flag_with_no_value_is_refused_and_quant_bits_empty_gives_each_pipelines_own(checkpoint):
    """`--bits` with no value (an empty shell variable) ran each pipeline at its own default without a word, while
    `--quant` with none means the float evaluation: refused, naming quant.bits=[] for the defaults, which still runs."""
    from configs import ConfigError
    with pytest.raises(ConfigError, match=re.escape("--bits names no bit-width: name them")):
        evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "percentile", "--bits"]))
    cfg, _ = evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "percentile",
                                                          "quant.bits=[]"]))
    assert (cfg.quant.pipelines, cfg.quant.bits) == (["percentile"], [])


def test_a_float_evaluation_of_a_run_that_records_bit_widths_runs(checkpoint, tmp_path):
    """A run trained with quant.bits=[w4a4] records them as its evaluation's defaults; `--quant` naming no pipeline
    asks for the float evaluation alone, which was refused as '--bits / quant.bits: w4a4 given', bits this command
    never gave. Bits that the command gives itself are still refused."""
    import torch
    payload = torch.load(checkpoint, weights_only=True)
    payload["config"]["quant"]["bits"] = ["w4a4"]  # as train.py records quant.bits=[w4a4]
    recorded = tmp_path / "best.pt"
    torch.save(payload, recorded)
    cfg, _ = evaluate.resolve_config(evaluate.parse_args(["--checkpoint", str(recorded), "--quant"]))
    assert (cfg.quant.pipelines, cfg.quant.bits) == ([], [])
    for given in (["--bits", "w4a4"], ["quant.bits=[w4a4]"]):
        with pytest.raises(ConfigError, match=re.escape("w4a4 given, but --quant / quant.pipelines names no")):
            evaluate.resolve_config(evaluate.parse_args(["--checkpoint", str(recorded), "--quant", *given]))


@pytest.mark.parametrize("argv, message", [
    (["--bits", "w4a16,w8a16"], "--bits: 'w4a16,w8a16' joins 2 bit-widths in one value; separate them with spaces: "
                                "--bits w4a16 w8a16"),
    (["--bits", "w4a4", "w6a6;w8a8"], "--bits: 'w6a6;w8a8' joins 2 bit-widths in one value; separate them with "
                                      "spaces: --bits w4a4 w6a6 w8a8"),
    (["quant.bits=['w4a4,w8a8']"], "quant.bits: 'w4a4,w8a8' joins 2 bit-widths in one value; give each as an item "
                                   "of the list: quant.bits=[w4a4,w8a8]"),
    (["--bits", "w4a4,x8"], "--bits / quant.bits: bit-width 'w4a4,x8' is not of the form 'w4a4'"),  # not a list
])
def test_bit_widths_joined_in_one_value_are_refused_naming_the_spaced_command(checkpoint, argv, message):
    with pytest.raises(ConfigError) as refused:
        evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, *argv]))
    assert str(refused.value) == message

@pytest.mark.parametrize("overrides, message", [
    (["--quant", "repq", "quant.calib_images=100000"], "quant.calib_images=100000: the train split has 1437 images"),
    (["--quant", "aphq", "quant.aphq.recon_images=5000", "quant.aphq.calib_images=8"],
     "quant.aphq.recon_images=5000: the train split has 1437 images"),
])
def test_more_training_images_than_the_split_holds_stop_before_the_fp_pass(checkpoint, tmp_path, overrides, message):
    from data import DataError
    out = tmp_path / "r.json"
    with pytest.raises(DataError, match=re.escape(message)):
        evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--out", str(out), *overrides]))
    if out.exists():  # the result file may be claimed already; no FP pass ran
        assert "fp" not in json.loads(out.read_text())


def test_training_transform_settings_are_part_of_an_aphq_result_and_the_batch_is_not(checkpoint, tmp_path):
    # APHQ draws its own training-transform images: another augmentation is another result; the calibration
    # batch, which it does not read, is no part of it
    base = ["--checkpoint", checkpoint, "--quant", "aphq", "quant.aphq.iters=0",
            "quant.aphq.calib_images=8", "quant.aphq.batch_size=4"]
    cfg, _ = evaluate.resolve_config(evaluate.parse_args(base))
    settings = quant_settings(cfg, "aphq")
    assert "calibration" not in settings and settings["train_transform"]["scale"] == list(cfg.data.scale)
    cfg2, _ = evaluate.resolve_config(evaluate.parse_args([*base, "data.scale=[0.5,0.6]"]))
    assert quant_settings(cfg2, "aphq") != settings
    # (beside a pipeline that reads the batch: alone, APHQ would have it refused as ignored)
    cfg3, _ = evaluate.resolve_config(evaluate.parse_args([*base, "--quant", "repq", "quant.calib_images=7"]))
    assert quant_settings(cfg3, "aphq") == settings
    repq = quant_settings(cfg, "repq")  # the eval-transform batch: the augmentation plays no part
    assert "calibration" in repq and "train_transform" not in repq
    cfg4, _ = evaluate.resolve_config(evaluate.parse_args([*base, "--quant", "repq", "quant.calib_transform=train"]))
    assert "train_transform" in quant_settings(cfg4, "repq")


def test_act_max_files_stay_listed_after_a_call_without_them(checkpoint, tmp_path):
    out = str(tmp_path / "r.json")
    common = ["--checkpoint", checkpoint, "--out", out, "--quant"]
    evaluate.main(evaluate.parse_args(common))
    first = json.loads(open(out).read())["max_act"]
    evaluate.main(evaluate.parse_args([*common, "quant.act_max_csv=false"]))
    assert {k: v for k, v in json.loads(open(out).read())["max_act"].items() if k in ("csv", "plot")} == \
        {k: first[k] for k in ("csv", "plot")}
    evaluate.main(evaluate.parse_args(common))  # the plain command again: its own files, not refused
    # maxima over other modules: another measurement, which --recompute puts in the old one's place
    data = evaluate.main(evaluate.parse_args([*common, "--recompute",
                                              "quant.act_max_extra_modules=[patch_embed.proj]"]))
    assert data["max_act"]["extra_modules"] == ["patch_embed.proj"]
    # without the files, maxima over other modules than the listed files hold: the JSON listed files of another
    # measurement beside its numbers
    listed = open(data["max_act"]["csv"]).read()
    with pytest.raises(ResultsError, match=r"holds activation maxima over quant.act_max_extra_modules=\["):
        evaluate.main(evaluate.parse_args([*common, "quant.act_max_csv=false"]))
    assert open(data["max_act"]["csv"]).read() == listed


def test_dropout_settings_are_taken_for_gplq_which_trains_and_are_part_of_its_results_settings(checkpoint):
    """GPLQ's stage 1 trains the model in training mode: model.drop / model.drop_path act there, so a GPLQ result
    records them (a result or stage-1 checkpoint of other ones is not reused); no other pipeline reads them."""
    from configs import ConfigError
    base = ["--checkpoint", checkpoint, "--out", "unused.json", "model.drop_path=0.3"]
    cfg, _ = evaluate.resolve_config(evaluate.parse_args([*base, "--quant", "gplq"]))
    assert quant_settings(cfg, "gplq")["model_training"] == {"drop": cfg.model.drop, "drop_path": 0.3}
    assert "model_training" not in quant_settings(cfg, "repq")
    with pytest.raises(ConfigError, match=r"model.drop_path would be ignored: .*\(pipelines: repq\); drop it"):
        evaluate.resolve_config(evaluate.parse_args([*base, "--quant", "repq"]))


def test_an_extra_maxima_module_that_names_no_module_is_refused_before_any_work(checkpoint, tmp_path):
    """The result would list the pattern as probed while its maxima are those of the usual modules."""
    from configs import ConfigError

    out = tmp_path / "r.json"
    args = evaluate.parse_args(["--checkpoint", checkpoint, "--out", str(out), "--quant",
                                "quant.act_max_extra_modules=[patch_embed.proj,blocks.*.attn.qkvv]"])
    with pytest.raises(ConfigError, match=r"'blocks.\*.attn.qkvv' names no module"):
        evaluate.main(args)
    assert not out.exists()


def test_the_logged_precision_of_an_evaluation_names_no_grad_scaler(checkpoint, tmp_path, caplog):
    """An evaluation computes no gradients: its fp16 autocast has no GradScaler to log."""
    with caplog.at_level("INFO"):
        evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--out", str(tmp_path / "r.json"),
                                           "--amp", "fp16", "--quant", "quant.act_max_csv=false"]))
    assert "precision: fp16 autocast on cpu (--amp=fp16)" in caplog.text and "GradScaler" not in caplog.text


def test_ema_and_amp_flags_score_the_ema_weights_under_that_autocast_and_pipelines_score_their_own_model(tmp_path):
    """--ema scores the checkpoint's EMA weights and --amp the autocast it names (the FP loss against a naive
    loop over the val images with those weights and that autocast), and the JSON says so; a quantized entry is
    the score of the quantized copy, not of the float model."""
    import torch

    from data import build_eval_loader
    from models import build_model
    from tests.conftest import DEBUG_CONFIG

    cfg = load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / 'run'}", "train.ema=true", "train.ema_decay=0.5",
                                       "train.max_steps=2", "optim.lr=0.01", "sched.warmup_epochs=0",
                                       "log.tensorboard=false"])
    train.main(cfg)
    checkpoint = str(tmp_path / "run" / "best.pt")
    payload = torch.load(checkpoint, weights_only=True)

    def naive_loss(weights: str, dtype) -> float:
        model = build_model(cfg.model).eval()
        model.load_state_dict(payload[weights])
        loader = build_eval_loader(cfg.data, img_size=32, batch_size_per_gpu=cfg.train.eval_batch_size_per_gpu,
                                   rank=0, world_size=1, num_classes=4)
        total, count = 0.0, 0
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            for images, targets in loader:
                logits = model(images).float()
                total += float(-torch.log_softmax(logits, 1).gather(1, targets[:, None]).sum())
                count += len(targets)
        return total / count

    tolerance = 1e-6  # relative, of evaluate.py's FP loss against the naive loop's (fp32 sums in another order)
    expected = {(w, amp): naive_loss("model_ema" if w == "ema" else "model", torch.bfloat16 if amp == "bf16" else None)
                for w in ("raw", "ema") for amp in ("none", "bf16")}
    assert abs(expected["raw", "none"] - expected["ema", "none"]) > 1e-3  # the two weights tell themselves apart
    # ... and so do the two precisions, by more than the tolerance of the comparisons below (the FP loss of 16 val
    # images; bf16 moves it by about 1e-5 here, several times the tolerance)
    assert abs(expected["ema", "none"] - expected["ema", "bf16"]) > 4 * tolerance * abs(expected["ema", "none"])
    for weights, amp in (("ema", "bf16"), ("raw", "none")):
        flags = (["--ema"] if weights == "ema" else []) + ["--amp", amp]
        quant = (["--quant", "percentile", "--bits", "w2a2", "quant.calib_images=8"] if weights == "raw"
                 else ["--quant"])
        result = evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--out",
                                                    str(tmp_path / f"{weights}_{amp}.json"), *flags, *quant,
                                                    "quant.act_max_csv=false"]))
        saved = json.loads((tmp_path / f"{weights}_{amp}.json").read_text())
        assert saved["weights"] == weights and saved["eval_amp"] == amp and saved["images"] == 16
        assert saved["fp"]["loss"] == pytest.approx(expected[weights, amp], rel=tolerance, abs=0)
        assert result["fp"] == saved["fp"]
    # 2-bit weights and activations: the quantized copy scores far from the float model it was made from
    assert abs(saved["quant"]["percentile"]["w2a2"]["loss"] - saved["fp"]["loss"]) > 1e-3


def test_a_config_file_layers_over_the_checkpoints_config_and_overrides_over_both(checkpoint, tmp_path):
    """--config beside --checkpoint is a layer on the checkpoint's config (e.g. a data preset for another
    machine), and key=value overrides come last: checkpoint < --config files < overrides."""
    preset = tmp_path / "preset.yaml"
    preset.write_text("quant:\n  calib_images: 7\n  calib_seed: 3\n")
    base = ["--checkpoint", checkpoint, "--config", str(preset), "--quant", "repq"]
    cfg, _ = evaluate.resolve_config(evaluate.parse_args(base))
    assert (cfg.quant.calib_images, cfg.quant.calib_seed, cfg.model.name) == (7, 3, "vit_nano")
    cfg, _ = evaluate.resolve_config(evaluate.parse_args([*base, "quant.calib_images=9"]))
    assert (cfg.quant.calib_images, cfg.quant.calib_seed) == (9, 3)


def test_as_many_calibration_images_as_the_train_split_holds_are_accepted_and_one_more_is_refused():
    """The tiny config's synthetic train split holds 64 images: quant.calib_images=64 draws each once."""
    from data import DataError
    from tests.conftest import DEBUG_CONFIG

    cfg = load_config([DEBUG_CONFIG], ["quant.calib_images=64"])
    evaluate.check_train_split(cfg, {"repq"}, True, 32, None)
    cfg.quant.calib_images = 65
    with pytest.raises(DataError, match=r"quant.calib_images=65: the train split has 64 images"):
        evaluate.check_train_split(cfg, {"repq"}, True, 32, None)


@pytest.mark.parametrize("batch, world_size", [(32, 2), (33, 2), (64, 1), (65, 1), (21, 3), (22, 3)])
def test_a_gplq_batch_is_refused_before_the_fp_pass_exactly_when_its_training_loader_would_refuse_it(batch,
                                                                                                      world_size):
    """GPLQ's stage-1 loader (built after the FP and maxima passes) refused a batch above a process's share of the
    train split without naming the setting; check_train_split refuses the same batches first, naming it."""
    from data import DataError, build_train_loader
    from tests.conftest import DEBUG_CONFIG

    cfg = load_config([DEBUG_CONFIG], ["quant.gplq.init_images=16", "quant.gplq.stage2_images=16",
                                       f"quant.gplq.batch_size_per_gpu={batch}"])
    try:  # the reference: the loader evaluate.py's build_pipeline_data gives GPLQ, on rank 0
        build_train_loader(cfg.data, img_size=32, batch_size_per_gpu=batch, rank=0, world_size=world_size, seed=0,
                           num_classes=cfg.model.num_classes)
        loader_refuses = False
    except DataError:
        loader_refuses = True
    if loader_refuses:
        with pytest.raises(DataError, match=rf"^quant.gplq.batch_size_per_gpu={batch}: the train split has 64 images"):
            evaluate.check_train_split(cfg, {"gplq"}, False, 32, None, world_size)
    else:
        evaluate.check_train_split(cfg, {"gplq"}, False, 32, None, world_size)
    assert loader_refuses is (batch > 64 // world_size)  # both outcomes are exercised across the cases


def test_an_extra_maxima_module_is_probed_and_its_maximum_is_that_of_its_outputs(checkpoint, tmp_path):
    """quant.act_max_extra_modules adds modules to the probe: the per-layer CSV has a row for each with the max
    |output| over the val images (a direct computation), and "module" is the maximum over them too."""
    import csv

    import torch

    from data import build_eval_loader
    from models import build_model

    out = tmp_path / "r.json"
    data = evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--out", str(out), "--quant",
                                              "quant.act_max_extra_modules=[patch_embed.proj]"]))
    rows = {r["name"]: r for r in csv.DictReader(open(data["max_act"]["csv"]))}
    cfg = load_config([DEMO_CONFIG], ["model.name=vit_nano"])
    model = build_model(cfg.model).eval()
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    loader = build_eval_loader(cfg.data, img_size=32, batch_size_per_gpu=360, rank=0, world_size=1, num_classes=10)
    with torch.no_grad():
        direct = max(model.patch_embed.proj(x).abs().max().item() for x, _ in loader)
    assert float(rows["patch_embed.proj"]["max"]) == pytest.approx(direct, rel=1e-5)
    assert data["max_act"]["module"] >= float(rows["patch_embed.proj"]["max"]) * (1 - 1e-6)


def test_the_calibration_batch_follows_its_seed_and_transform_settings():
    """quant.calib_seed picks the images (the same seed the same batch again), and quant.calib_transform=train
    draws them through the training augmentation instead of the eval transform."""
    import torch

    def batch(*overrides):
        return evaluate.calibration_set(load_config([DEMO_CONFIG], ["quant.calib_images=8", *overrides]), 32)

    assert torch.equal(batch("quant.calib_seed=1"), batch("quant.calib_seed=1"))
    assert not torch.equal(batch("quant.calib_seed=0"), batch("quant.calib_seed=1"))
    assert not torch.equal(batch("quant.calib_seed=1"), batch("quant.calib_seed=1", "quant.calib_transform=train"))


@pytest.mark.parametrize("argv, key", [(["train.amp=bf16"], "train.amp"), (["cd.enabled=true"], "cd.enabled"),
                                       (["--config", os.path.join(ROOT, "configs/method/cd.yaml")], "cd.enabled"),
                                       (["tweo={enabled: true}"], "tweo.enabled"), (["optim.lr=0.5"], "optim.lr"),
                                       (["sched.epochs=3"], "sched.epochs"),
                                       (["train.max_steps=5"], "train.max_steps")])
def test_training_settings_given_for_a_checkpoint_are_refused(checkpoint, argv, key):
    """evaluate.py reads no training setting: train.amp=bf16 scored under fp32 (--amp is the autocast), and
    cd.enabled=true labelled a baseline checkpoint's result 'CD'."""
    import torch

    assert torch.load(checkpoint, weights_only=True)["config"]["cd"]["enabled"] is False  # a baseline
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: evaluate.py does not read training settings"):
        evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", *argv]))
    # what it does read of the train section: the device and the evaluation batch size
    cfg, _ = evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "train.device=cpu",
                                                          "train.eval_batch_size_per_gpu=5"]))
    assert cfg.train.eval_batch_size_per_gpu == 5 and result_table.method_name(cfg) == "Baseline"


@pytest.mark.parametrize("override", ["data.mixup=0.5", "data.cutmix=1.0", "data.label_smoothing=0.2",
                                      "data.repeated_aug=2"])
def test_data_settings_of_training_batches_given_for_a_checkpoint_are_refused(checkpoint, override):
    """No pass of evaluate.py mixes images, smooths labels or repeats samples (APHQ and GPLQ included): such an
    override would be parsed, written nowhere and applied nowhere."""
    key = override.split("=")[0]
    for quant in (["percentile"], ["aphq", "gplq"]):
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: evaluate.py does not read training settings"):
            evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", *quant, override]))


@pytest.mark.parametrize("override", ["data.reprob=0.5", "data.scale=[0.5,0.6]", "data.hflip=0.5",
                                      "data.auto_augment=rand-m5"])
def test_training_transform_settings_are_refused_where_no_pipeline_sees_training_images(checkpoint, override):
    """Percentile on the eval-transform calibration batch sees no training-transform image: data.reprob=0.5 and
    the like would be ignored. APHQ draws training-transform images, as does any pipeline with
    quant.calib_transform=train: there the same override is read (and part of the result's settings)."""
    base = ["--checkpoint", checkpoint]
    with pytest.raises(ConfigError, match=rf"^{re.escape(override)} would be ignored: no pipeline of this "
                                          r"evaluation sees training-transform images"):
        evaluate.resolve_config(evaluate.parse_args([*base, "--quant", "percentile", override]))
    for seeing in (["--quant", "aphq"], ["--quant", "percentile", "quant.calib_transform=train"]):
        cfg, _ = evaluate.resolve_config(evaluate.parse_args([*base, *seeing, override]))
        default, _ = evaluate.resolve_config(evaluate.parse_args([*base, *seeing]))
        name = seeing[1]
        assert quant_settings(cfg, name)["train_transform"] != quant_settings(default, name)[
            "train_transform"]
    # the settings the eval transform shares stay open to every evaluation where it reads them (at crop_pct 1.0 the
    # digits eval transform resizes nothing: tests/test_evaluate_interpolation_unread.py)
    evaluate.resolve_config(evaluate.parse_args([*base, "--quant", "percentile", "data.crop_pct=0.875",
                                                 "data.interpolation=bilinear"]))


def test_a_weights_files_recipe_names_its_method_and_its_training_overrides_are_refused(checkpoint, tmp_path):
    import torch

    weights = tmp_path / "weights.pt"
    torch.save(torch.load(checkpoint, weights_only=True)["model"], weights)
    recipe = ["--config", DEMO_CONFIG, "--config", os.path.join(ROOT, "configs/method/cd.yaml"),
              "model.name=vit_nano", f"model.pretrained={weights}", "--quant"]
    cfg, _ = evaluate.resolve_config(evaluate.parse_args(recipe))
    assert result_table.method_name(cfg) == "CD"
    with pytest.raises(ConfigError, match=r"^train.amp: .*give --amp"):
        evaluate.resolve_config(evaluate.parse_args([*recipe, "train.amp=bf16"]))


@pytest.mark.parametrize("dataset, pipelines, calib_transform, read", [
    ("folder", ["repq", "aphq"], "eval", True),  # APHQ draws training-transform images: one such pipeline reads it
    ("folder", ["percentile"], "train", True),  # percentile's calibration batch drawn with the training transform
    ("folder", ["percentile", "repq"], "eval", False),
    ("folder", ["rtn"], "train", False),  # RTN reads no image at all, whatever the calibration batch's transform
    ("tokens", ["gptq"], "train", False),  # a language model's windows pass through no image transform
])
def test_training_transform_overrides_are_unread_unless_a_planned_pipeline_sees_training_images(
        dataset, pipelines, calib_transform, read):
    """The rule written out per pipeline (which of them draw training-transform images), on a bare Config: the
    training transform's own keys are listed where none does, and an eval-transform key (crop_pct) never is."""
    from configs.schema import Config

    cfg = Config()
    cfg.data.dataset, cfg.quant.pipelines, cfg.quant.calib_transform = dataset, pipelines, calib_transform
    given = ["data.reprob=0.5", "data.crop_pct=0.9", "data={hflip: 0.0}"]
    want = [] if read else ["data.reprob=0.5", "data={hflip: 0.0}"]
    assert evaluate.train_transform_overrides_unread(given, cfg) == want


def test_the_kind_of_checkpoint_follows_the_file_named_whatever_the_path(tmp_path):
    """best.pt, checkpoint.pt (the latest) and a snapshot hold weights of other updates of one run; a link is of
    the kind of the file it names, a file set aside or renamed is "other", model.pretrained weights "weights"."""
    from engine.eval_results import checkpoint_kind

    run = tmp_path / "run"
    (run / "snapshots").mkdir(parents=True)
    for name in ("best.pt", "checkpoint.pt", "snapshots/epoch3.pt", "best.until_step40.pt"):
        (run / name).write_bytes(b"")
    os.symlink(run / "best.pt", tmp_path / "seed1.pt")
    expected = {str(run / "best.pt"): "best", f"{run}/./snapshots/../best.pt": "best",
                str(run / "checkpoint.pt"): "latest", str(run / "snapshots" / "epoch3.pt"): "snapshot",
                str(run / "best.until_step40.pt"): "other", str(tmp_path / "seed1.pt"): "best",
                str(tmp_path / "gone" / "checkpoint.pt"): "latest"}
    assert {path: checkpoint_kind(path) for path in expected} == expected
    # a run whose files are links into a content-addressed store (DVC, git-annex): the name given decides
    (tmp_path / "store").mkdir()
    (tmp_path / "run2").mkdir()
    for name, blob in (("best.pt", "ab12cd"), ("checkpoint.pt", "ef34ab")):
        (tmp_path / "store" / blob).write_bytes(b"")
        os.symlink(tmp_path / "store" / blob, tmp_path / "run2" / name)
    assert checkpoint_kind(str(tmp_path / "run2" / "best.pt")) == "best"
    assert checkpoint_kind(str(tmp_path / "run2" / "checkpoint.pt")) == "latest"
    assert checkpoint_kind("/weights/deit_base.pth", pretrained=True) == "weights"
    assert checkpoint_kind("hub", pretrained=True) == "weights"


def test_a_run_folder_named_snapshots_holds_best_and_latest_not_snapshots(tmp_path):
    """out_dir=runs/snapshots: its best.pt and checkpoint.pt are a run's best and latest, as in any run folder
    (a snapshot is a file train.keep_every_epochs writes into a run's snapshots folder, epoch<E>.pt)."""
    from engine.eval_results import checkpoint_kind

    run = tmp_path / "snapshots"
    assert checkpoint_kind(str(run / "best.pt")) == "best"
    assert checkpoint_kind(str(run / "checkpoint.pt")) == "latest"
    assert checkpoint_kind(str(run / "snapshots" / "epoch2.pt")) == "snapshot"


def test_seeds_scored_on_other_kinds_of_checkpoint_are_refused_not_averaged():
    """One seed's best.pt beside another's checkpoint.pt were averaged as seeds (the fingerprints differ); results
    written before the kind was recorded are not compared."""
    def result(seed, kind=None):
        return {"model": "m", "method": "CD", "fp": {"top1": 80.0 + seed}, "max_act": {"module": 5.0, "block": 3.0},
                "quant": {}, "fingerprint": str(seed), "checkpoint": f"s{seed}/x.pt",
                **({"checkpoint_kind": kind} if kind else {})}

    with pytest.raises(ValueError, match=r'^m CD: s0/x.pt and s1/x.pt were evaluated differently \(checkpoint_kind: '
                                         r'"best" vs "latest": score the same file of every run'):
        result_table.markdown_table([result(0, "best"), result(1, "latest")], over_seeds=True)
    with pytest.raises(ValueError, match=r'\(checkpoint_kind: "best" vs "snapshot"'):  # pairwise, past an older one
        result_table.markdown_table([result(0, "best"), result(1), result(2, "snapshot")], over_seeds=True)
    rows = result_table.markdown_table([result(0, "best"), result(1), result(2, "best")], over_seeds=True)
    assert rows.splitlines()[2].startswith("| m | CD (n=3) | 81.00 ± 1.00 |")



def test_pretrained_weights_beside_a_run_file_and_results_without_a_fingerprint_are_no_difference_or_copy():
    """model.pretrained weights (kind "weights") are no file of a run: a public model's result beside a run's
    best.pt is not refused for its kind (two runs' best.pt and checkpoint.pt are). Results without a fingerprint
    (older files) are never taken for two results of one weights file; two with the same fingerprint are."""
    from engine.eval_results import evaluation_difference, repeated_weights

    def result(kind):
        return {"model": "m", "checkpoint_kind": kind}

    assert evaluation_difference(result("weights"), result("best")) is None
    assert evaluation_difference(result("latest"), result("weights")) is None
    assert evaluation_difference(result("best"), result("latest")).what == "checkpoint_kind"
    assert repeated_weights([("a", {}), ("b", {"fingerprint": None}), ("c", {"fingerprint": "f1"})]) is None
    assert repeated_weights([("a", {"fingerprint": "f0"}), ("b", {}), ("c", {"fingerprint": "f0"})]) == ("a", "c", "f0")

def test_results_record_the_kind_of_checkpoint_and_older_files_take_it(checkpoint, tmp_path):
    out = tmp_path / "r.json"
    saved = evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--out", str(out), "--quant"]))
    assert os.path.basename(checkpoint) == "best.pt" and saved["checkpoint_kind"] == "best"
    older = json.loads(out.read_text())
    del older["checkpoint_kind"]  # a file written before the kind was recorded: still this evaluation's
    out.write_text(json.dumps(older))
    evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--out", str(out), "--quant"]))
    assert json.loads(out.read_text())["checkpoint_kind"] == "best"


def test_seeds_are_compared_at_every_bit_width_they_share():
    """Seeds alike at W4A4 but quantized with other settings at W6A6 are no seeds of one evaluation (the comparison
    stopped at a pipeline's first bit-width)."""
    def result(i, w6a6_images):
        settings = {"calibration": {"images": 32}}
        quant = {"repq": {"w4a4": {"top1": 70.0, "settings": settings},
                          "w6a6": {"top1": 75.0, "settings": {"calibration": {"images": w6a6_images}}}}}
        return {"model": "m", "method": "CD", "fp": {"top1": 80.0}, "max_act": {"module": 5.0, "block": 3.0},
                "quant": quant, "fingerprint": str(i), "checkpoint": f"s{i}/best.pt"}

    with pytest.raises(ValueError, match=r"m CD: s0/best.pt and s1/best.pt were evaluated differently \(repq w6a6 "
                                         r"settings: calibration.images 32 -> 8\)"):
        result_table.markdown_table([result(0, 32), result(1, 8)], over_seeds=True)
    assert "(n=2)" in result_table.markdown_table([result(0, 32), result(1, 32)], over_seeds=True)


def test_two_seeds_trained_with_other_settings_are_refused():
    """The second result is compared with the first too (not only the third on): two runs of another lr are no
    seeds; a setting only one recipe records (added between versions) is not compared."""
    from engine.eval_results import recipe_difference

    a, b = {"recipe": {"optim.lr": 0.1, "sched.epochs": 3}}, {"recipe": {"optim.lr": 0.2, "sched.epochs": 3}}
    assert recipe_difference([("a", a), ("b", b)]) == ("a", "b", "optim.lr 0.1 -> 0.2")
    assert recipe_difference([("a", a), ("c", {"recipe": {"optim.lr": 0.1, "new.key": 1}})]) is None


def test_a_result_recorded_before_the_tf32_key_is_compared_as_tf32_on():
    """evaluate.py recorded no train.tf32 before the key existed, when every run trained with TF32 on
    (engine/run_dir.py SETTINGS_BEFORE_THEIR_KEY): such a result is no seed of a train.tf32=false run's, and
    is one of a train.tf32=true run's."""
    from engine.eval_results import recipe_difference

    older = {"recipe": {"optim.lr": 0.1}}
    off, on = ({"recipe": {"optim.lr": 0.1, "train.tf32": value}} for value in (False, True))
    assert recipe_difference([("older", older), ("off", off)]) == ("older", "off", "train.tf32 True -> False")
    assert recipe_difference([("off", off), ("older", older)]) == ("off", "older", "train.tf32 False -> True")
    assert recipe_difference([("older", older), ("on", on)]) is None


def test_seeds_scored_on_other_image_counts_are_evaluated_differently():
    """The image count is part of an evaluation (a val folder that lost or gained images since): two seeds
    scored on 360 and on 100 images are not averaged."""
    from engine.eval_results import evaluation_difference

    difference = evaluation_difference({"model": "m", "images": 360}, {"model": "m", "images": 100})
    assert (difference.what, difference.detail, difference.of_settings) == ("images", "360 vs 100", False)
    assert evaluation_difference({"model": "m", "images": 360}, {"model": "m", "images": 360}) is None


def test_quant_sensitivity_table_has_a_column_for_a_pipeline_beyond_the_three():
    """APHQ (--with-aphq) gets a column after percentile / repq / gplq; a variant that does not run a pipeline
    leaves its cell empty; the change is variant minus official (the table written out by hand)."""
    sens = load_sensitivity_script()
    table = {"official": {"percentile": 50.0, "repq": 60.0, "gplq": 70.0, "aphq": 65.0},
             "calib=train": {"percentile": 49.0, "repq": 61.5}}
    assert sens.markdown(table, "w4a4").splitlines() == [
        "| variant (w4a4) | percentile | repq | gplq | aphq |", "|---|---|---|---|---|",
        "| official | 50.00 | 60.00 | 70.00 | 65.00 |", "| calib=train | 49.00 (-1.00) | 61.50 (+1.50) |  |  |"]


def overflowing_checkpoint(checkpoint: str, path) -> str:
    """`checkpoint` with its last block's fc1 made to overflow fp16 at the patch tokens only: their position embedding's
    channel 0 large, read 2e4 times by fc1's first rows (finite in fp32), which fc2 adds with opposite signs (inf - inf:
    NaN); the cls token, which the head reads, stays finite, so the FP pass scores the logits."""
    import torch

    payload = torch.load(checkpoint, map_location="cpu", weights_only=False)
    state = payload["model"]
    last = max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    state["pos_embed"][0, 1:, 0] = 50.0
    state[f"blocks.{last}.mlp.fc1.weight"][:, 0] = 0.0
    state[f"blocks.{last}.mlp.fc1.weight"][0:2, 0] = 2e4
    state[f"blocks.{last}.mlp.fc2.weight"][:, 0] = 1.0
    state[f"blocks.{last}.mlp.fc2.weight"][:, 1] = -1.0
    torch.save(payload, path)
    return str(path)


def test_maxima_that_overflow_fp16_are_refused_naming_the_module_and_amp(checkpoint, tmp_path, capsys):
    """An output of inf or NaN under --amp fp16 was written as max_act inf (or, for a NaN, the other blocks'
    maximum), which the tables then refused as a diverged run's; evaluate.py refuses it in one error: line, naming
    the module and --amp, and writes nothing. The same weights in fp32 (the reference: no overflow) are measured."""
    weights = overflowing_checkpoint(checkpoint, tmp_path / "overflow.pt")
    out = tmp_path / "fp16.json"
    code, _, err = run_entry("evaluate.py", ["--checkpoint", weights, "--amp", "fp16", "--quant", "--out", str(out)],
                             capsys)
    last = err.strip().splitlines()[-1]
    assert code == 1 and "Traceback" not in err, err[-2000:]
    assert re.match(r"error: activation maxima: the output of blocks\.\d+\.mlp\.fc1 and \d+ more is not finite "
                    r"\(inf or NaN\) .*give --amp bf16 or none$", last), last
    assert not out.exists() and not (tmp_path / "fp16_act_max.csv").exists()
    result = evaluate.main(evaluate.parse_args(["--checkpoint", weights, "--quant", "--out",
                                                str(tmp_path / "fp32.json")]))
    assert 1e5 < result["max_act"]["module"] < float("inf")  # 2e4 times channel 0 of the norm's output


def test_an_overflow_is_named_where_it_began_not_at_a_module_outside_the_blocks_after_it(checkpoint, tmp_path, capsys):
    """With quant.act_max_extra_modules the records of the modules outside the blocks (block -1) were searched first,
    so the error named the final norm, which reads the overflowing last block's output, as the output that is not
    finite; it names the last block's fc1, where overflowing_checkpoint puts the overflow, as without them."""
    weights = overflowing_checkpoint(checkpoint, tmp_path / "overflow.pt")
    code, _, err = run_entry("evaluate.py", ["--checkpoint", weights, "--amp", "fp16", "--quant", "--out",
                                             str(tmp_path / "fp16.json"),
                                             "quant.act_max_extra_modules=[patch_embed.proj,norm]"], capsys)
    last = err.strip().splitlines()[-1]
    assert code == 1 and "Traceback" not in err, err[-2000:]
    assert re.match(r"error: activation maxima: the output of blocks\.\d+\.mlp\.fc1 and \d+ more is not finite ",
                    last), last
