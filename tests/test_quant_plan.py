"""A run's quant.* settings are the defaults of its evaluation (`evaluate.py --checkpoint` reads them from the
checkpoint's config): train.py and scripts/sweep.py refuse what evaluate.py would refuse of them before the
training starts, not when the evaluation reaches them. Nothing here trains: each refusal comes first."""
import copy
import os

import numpy as np
import pytest

import train
from configs import ConfigError, load_config
from quant.plan import check_quant_plan
from tests.conftest import DEBUG_CONFIG, ROOT

import sweep

LM_CONFIG = os.path.join(ROOT, "configs", "lm", "kjv_nano.yaml")


@pytest.mark.parametrize("config, overrides, message", [
    (DEBUG_CONFIG, ["quant.pipelines=[nonsense]"], r"unknown quantization pipeline\(s\) \['nonsense'\]"),
    (DEBUG_CONFIG, ["quant.bits=[w9z]"], r"quant.bits: bit-width 'w9z' is not of the form 'w4a4'"),
    (DEBUG_CONFIG, ["quant.bits=[w4a4 w8a8]"], r"give each as an item of the list: quant.bits=\[w4a4,w8a8\]"),
    (DEBUG_CONFIG, ["quant.bits=[w4a4,W4A4]"], r"quant.bits names w4a4 twice"),
    # the task's own pipelines (percentile, repq) quantize activations: the fix is named in config keys
    (DEBUG_CONFIG, ["quant.bits=[w4a16]"],
     r"quant.percentile: .*without quant.pipelines an image classifier runs percentile, repq at every quant.bits "
     r"bit-width: give quant.pipelines=\[gptq\] or quant.pipelines=\[rtn\] for w4a16"),
    (LM_CONFIG, ["quant.pipelines=[gplq]"], r"quant.pipelines: gplq cannot quantize a causal_lm model"),
    (DEBUG_CONFIG, ["quant.pipelines=[]", "quant.bits=[w4a4]"],
     r"quant.bits: w4a4 given, but quant.pipelines names no pipeline, so nothing is quantized at them"),
], ids=["unknown pipeline", "malformed bits", "joined bits", "bits twice", "default pipelines", "other task",
        "bits without pipelines"])
def test_train_refuses_quant_settings_its_evaluation_would_refuse_before_making_a_folder(tmp_path, config,
                                                                                          overrides, message):
    out = tmp_path / "run"
    cfg = load_config([config], [f"out_dir={out}", *overrides])
    with pytest.raises(ConfigError, match=message) as raised:
        train.main(cfg)
    assert "evaluate.py --checkpoint" in str(raised.value)  # says why training refuses an evaluation setting
    assert not out.exists()


@pytest.mark.parametrize("config, overrides", [
    (DEBUG_CONFIG, []),
    (DEBUG_CONFIG, ["quant.pipelines=[rtn,gptq]", "quant.bits=[W3A16,w4a16]"]),
    (DEBUG_CONFIG, ["quant.pipelines=[]"]),
    (LM_CONFIG, []),
    (LM_CONFIG, ["quant.pipelines=[smoothquant]", "quant.bits=[w8a8,w6a6]"]),
], ids=["classifier defaults", "weight-only", "none", "lm defaults", "smoothquant"])
def test_valid_quant_settings_pass_and_the_config_is_left_as_given(config, overrides):
    cfg = load_config([config], list(overrides))
    before = copy.deepcopy(cfg)
    check_quant_plan(cfg)
    assert cfg == before  # quant.pipelines stays None where unset (config.yaml records what was given)


def test_an_option_refused_at_each_pipelines_own_bit_width_gets_no_advice_about_bit_widths(tmp_path):
    """quant.first_last=w8a8 on a language model without quant.bits: RTN (each pipeline at its own bit-width) refuses
    the option. The advice for bit-widths given to the task's own pipelines does not apply: no bit-width was given
    (it said "give no pipeline of this task takes w4a16; no pipeline of this task takes w8a8")."""
    cfg = load_config([LM_CONFIG], [f"out_dir={tmp_path / 'run'}", "quant.first_last=w8a8"])
    with pytest.raises(ConfigError) as raised:
        train.main(cfg)
    assert str(raised.value).startswith("quant.rtn: stem_w_bits=8: rtn keeps the stem / embeddings and the head "
                                        "float (0)"), raised.value
    assert "bit-width" not in str(raised.value) and "no pipeline of this task" not in str(raised.value)


@pytest.mark.parametrize("bits, advice", [
    ("[w16a16]", "drop w16a16: no pipeline of this task takes it"),
    ("[w4a16,w16a16]", "give quant.pipelines=[gptq] or quant.pipelines=[rtn] for w4a16; drop w16a16: no pipeline of "
                       "this task takes it"),
], ids=["one", "with a fitting one"])
def test_a_bit_width_no_pipeline_of_the_task_takes_is_advised_to_be_dropped(bits, advice):
    """The advice for bit-widths the task's own pipelines cannot all run: for one that none of the task's pipelines
    takes, it said "give no pipeline of this task takes w16a16"."""
    cfg = load_config([DEBUG_CONFIG], [f"quant.bits={bits}"])
    with pytest.raises(ConfigError) as raised:
        check_quant_plan(cfg)
    assert f"at every quant.bits bit-width: {advice} (a run records" in str(raised.value), raised.value


def test_a_sweep_refuses_a_bad_evaluation_setting_before_its_first_run_trains(tmp_path):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\nruns:\n  a: []\n  b: []\n"
                    "evaluate: ['quant.bits=[w9z]']\n")
    with pytest.raises(SystemExit, match=r"error: sweep run 'a': quant.bits: bit-width 'w9z'"):
        sweep.main([str(spec), "--run", "--evaluate"])
    assert not (tmp_path / "runs").exists()


def test_a_sweep_refuses_a_runs_own_quant_setting_that_train_py_refuses_though_its_evaluate_list_fixes_it(tmp_path):
    """train.py checks the run's config without the sweep's 'evaluate' list: quant.bits=[w4a16] on a classifier with
    the task's own pipelines is refused there, even where the list's quant.pipelines=[gptq] would evaluate it. The
    sweep checked only the two together, passed, and every run would have ended at its start."""
    spec = tmp_path / "sweep.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\nruns:\n"
                    "  a: ['quant.bits=[w4a16]']\nevaluate: ['quant.pipelines=[gptq]']\n")
    with pytest.raises(SystemExit, match=r"error: sweep run 'a': quant.percentile: .*give quant.pipelines=\[gptq\]"):
        sweep.main([str(spec), "--evaluate"])
    cfg = load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / 'run'}", "quant.bits=[w4a16]"])  # train.py, alone
    with pytest.raises(ConfigError, match=r"quant.percentile"):
        train.main(cfg)


@pytest.mark.parametrize("overrides, message", [
    (["quant.act_max_extra_modules=[blocks.*.nope]"], r"quant.act_max_extra_modules: 'blocks.\*.nope' names no module"),
    (["quant.calib_images=65"], r"quant.calib_images=65: the train split has 64 images; give at most that"),
    (["quant.pipelines=[aphq]"], r"quant.aphq.recon_images=1024: the train split has 64 images"),
    (["quant.pipelines=[gplq]", "quant.gplq.init_images=16", "quant.gplq.stage2_images=16",
      "quant.gplq.batch_size_per_gpu=65"], r"quant.gplq.batch_size_per_gpu=65: the train split has 64 images"),
], ids=["extra module", "calibration images", "aphq images", "gplq batch"])
def test_train_refuses_quant_settings_that_do_not_fit_its_model_or_train_split_before_training(
        tmp_path, monkeypatch, overrides, message):
    """What evaluate.py checks against the model and the train split (tiny.yaml: 64 synthetic images) is refused
    once train.py has built them, before the first update."""
    def trains(*args, **kwargs):
        raise AssertionError("train.py started training")
    monkeypatch.setattr(train, "train_epochs", trains)
    cfg = load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / 'run'}", *overrides])
    with pytest.raises(ConfigError, match=message) as raised:
        train.main(cfg)
    assert "evaluate.py --checkpoint" in str(raised.value)


@pytest.mark.parametrize("overrides, warning", [
    (["quant.calib_images=64", "quant.act_max_extra_modules=[patch_embed.proj]"], None),
    # quant.calib_images=32 and the pipelines are the defaults, set by no one: the run trains, told what
    # evaluate.py --checkpoint will need
    (["data.synthetic_train_size=16"], "quant.calib_images=32: the train split has 16 images; give at most that"),
], ids=["fits", "default does not fit"])
def test_quant_settings_that_fit_or_were_not_given_pass_to_training(tmp_path, monkeypatch, caplog, overrides,
                                                                     warning):
    class Started(Exception):
        pass

    def trains(*args, **kwargs):
        raise Started
    monkeypatch.setattr(train, "train_epochs", trains)
    cfg = load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / 'run'}", *overrides])
    with caplog.at_level("WARNING", logger="train"), pytest.raises(Started):
        train.main(cfg)
    warned = [r.getMessage() for r in caplog.records if "evaluate.py --checkpoint" in r.getMessage()]
    assert [w.split(" (")[0] for w in warned] == ([warning] if warning else [])


def _token_split(root, windows: int, context: int = 32) -> None:
    """train.bin holding exactly `windows` calibration windows of `context` ids ((ids - 1) // context), val.bin two."""
    ids = np.arange(windows * context + 1, dtype=np.uint16) % 65
    (root / "train.bin").write_bytes(ids.tobytes())
    (root / "val.bin").write_bytes(ids[:2 * context + 1].tobytes())


@pytest.mark.parametrize("overrides, refused, warning", [
    (["quant.calib_images=11"], "quant.calib_images=11: the train split has 10 windows of 32 tokens; give at most that",
     None),
    (["quant.calib_images=10"], None, None),
    (["quant.pipelines=[rtn]", "quant.calib_images=11"], None, None),  # RTN reads no calibration windows
    ([], None, "quant.calib_images=32: the train split has 10 windows of 32 tokens; give at most that"),
], ids=["too many", "fits", "rtn reads none", "default does not fit"])
def test_train_counts_a_language_models_calibration_windows_before_training(tmp_path, monkeypatch, caplog,
                                                                            overrides, refused, warning):
    """A language model's evaluation draws quant.calib_images windows of its context from the training tokens:
    more than the split holds is refused before the first update with evaluate.py's own refusal, and the
    schema's default that does not fit is a warning."""
    from data import DataError, calibration_windows

    class Started(Exception):
        pass

    def trains(*args, **kwargs):
        raise Started
    monkeypatch.setattr(train, "train_epochs", trains)
    _token_split(tmp_path, windows=10)
    cfg = load_config([os.path.join(ROOT, "configs", "lm", "kjv_nano.yaml")],
                      [f"out_dir={tmp_path / 'run'}", "data.dataset=tokens", f"data.root={tmp_path}",
                       "train.batch_size=8", "data.val_windows=2", *overrides])  # the val.bin's two (more are refused)
    with caplog.at_level("WARNING", logger="train"), pytest.raises(ConfigError if refused else Started) as raised:
        train.main(cfg)
    if refused:
        assert str(raised.value).startswith(refused) and "evaluate.py --checkpoint" in str(raised.value)
        with pytest.raises(DataError) as evaluation:  # what the evaluation of the run would say
            calibration_windows(cfg.data, 32, cfg.quant.calib_images, cfg.quant.calib_seed, vocab_size=65)
        assert str(evaluation.value) == refused
    warned = [r.getMessage() for r in caplog.records if "evaluate.py --checkpoint" in r.getMessage()]
    assert [w.split(" (")[0] for w in warned] == ([warning] if warning else [])


def test_a_model_the_pipelines_cannot_convert_is_refused_naming_it_and_a_vit_passes_without_drawing_randomness():
    """check_model_converts converts a copy with each planned layout, as the pipelines' first step does: EVA's
    attention has no quantized version, so evaluate.py is refused before its float pass (one ConfigError naming
    model.name); a tiny ViT converts for every vision pipeline, the model and the global RNG left as they were."""
    import timm
    import torch

    from models import build_model
    from quant.plan import check_model_converts

    eva = timm.create_model("eva02_tiny_patch14_224", img_size=28, num_classes=4)
    cfg = load_config([DEBUG_CONFIG], ["model.name=eva02_tiny_patch14_224", "quant.pipelines=[repq]"])
    with pytest.raises(ConfigError, match=r"^model.name=eva02_tiny_patch14_224: repq w4a4 cannot quantize it: "
                                          r"no quantized attention for timm.models.eva.EvaAttention"):
        check_model_converts(eva, cfg)
    cfg = load_config([DEBUG_CONFIG], ["quant.pipelines=[percentile,repq,aphq,gplq]"])
    vit = build_model(cfg.model)
    before = copy.deepcopy(vit.state_dict())
    torch.manual_seed(5)
    state = torch.get_rng_state()
    check_model_converts(vit, cfg)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(v, vit.state_dict()[k]) for k, v in before.items())
    assert not any("Quant" in type(m).__name__ for m in vit.modules())  # the original is not converted


@pytest.mark.parametrize("item", ["repq aphq", "repq,aphq", "repq;aphq", "repq, aphq"])
def test_pipelines_joined_in_one_item_are_named_as_the_list_of_them(item):
    """`quant.pipelines=['repq aphq']` (a list the shell or YAML did not split) was refused as one unknown pipeline;
    the refusal names the list of the pipelines it joins, as joined bit-widths are named, and that list is taken."""
    cfg = load_config([DEBUG_CONFIG], [f"quant.pipelines=['{item}']"])
    with pytest.raises(ConfigError) as refused:
        check_quant_plan(cfg)
    assert str(refused.value).startswith(f"quant.pipelines: {item!r} joins 2 pipelines in one value; give each as an "
                                         f"item of the list: quant.pipelines=[repq,aphq] "), refused.value
    check_quant_plan(load_config([DEBUG_CONFIG], ["quant.pipelines=[repq,aphq]"]))
