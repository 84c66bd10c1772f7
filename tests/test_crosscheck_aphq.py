"""scripts/crosscheck_aphq.py without the official APHQ-ViT code (CI has no copy): its argument errors, its
metrics, and the plumbing of the official run against a FAKE official tree written to tmp_path (it records
what the script hands it; it computes nothing of APHQ)."""
import json
import os
import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engine.run_dir import RunDirError
from tests.conftest import ROOT
from tests.quant_models import images, tiny_vit

import crosscheck_aphq as xc

SCRIPT = os.path.join(ROOT, "scripts", "crosscheck_aphq.py")

FAKE = {
    "quant_layers/__init__.py": """
        import torch
        SEEN = []
        def _init(self):
            SEEN.append((torch.cuda.is_available(), torch.cuda.get_device_properties(0).total_memory))
        class PTQSLBatchingQuantLinear:
            _initialize_calib_parameters = _init
        class PTQSLBatchingQuantConv2d:
            _initialize_calib_parameters = _init
        class PTQSLBatchingQuantMatMul:
            _initialize_calib_parameters = _init
        """,
    "utils/__init__.py": "",
    "utils/wrap_net.py": """
        from types import MethodType
        from timm.models.vision_transformer import Attention
        def vit_attn_forward(self, x):
            return self.proj(x)
        def wrap_modules_in_net(model, cfg, reparam=False, recon=False):
            for m in model.modules():
                if isinstance(m, Attention):
                    m.forward = MethodType(vit_attn_forward, m)  # looked up at call time, as officially
            return model.cuda()
        def wrap_reparamed_modules_in_net(model):
            return model
        """,
    "utils/calibrator.py": """
        import torch
        import quant_layers
        class QuantCalibrator:
            def __init__(self, model, calib_loader):
                self.model, self.calib_loader = model, calib_loader
            def batching_quant_calib(self):
                for inp, _ in self.calib_loader:
                    self.model(inp.cuda())  # timm 1.x passes attn_mask / is_causal to the attention
                for cls in (quant_layers.PTQSLBatchingQuantLinear, quant_layers.PTQSLBatchingQuantConv2d,
                            quant_layers.PTQSLBatchingQuantMatMul):
                    cls()._initialize_calib_parameters()
        """,
    "utils/block_recon.py": """
        CALLS = []
        class BlockReconstructor:
            def __init__(self, model, full_model, calib_loader, metric="hessian_perturb",
                         use_mean_hessian=True, temp=20):
                CALLS.append(("init", len(calib_loader), metric, temp, use_mean_hessian))
                self.model = model
            def reconstruct_single_block(self, name, block, device, batch_size=32, iters=20000, **kwargs):
                CALLS.append(("block", name, iters))
            def reconstruct_model(self, quant_act=False, mode="qdrop+", drop_prob=1.0, keep_gpu=True):
                CALLS.append(("model", quant_act, mode, drop_prob))
                self.reconstruct_single_block("head", self.model.head, "cpu")
        """,
    "configs/4bit/best.py": """
        class Config:
            def __init__(self):
                self.calib_batch_size, self.optim_batch_size = 4, 8
                self.optim_metric, self.temp, self.use_mean_hessian = "hessian_perturb", 20, True
                self.optim_mode, self.drop_prob, self.keep_gpu = "qdrop", 0.5, True
                self.w_bit = self.a_bit = self.qhead_a_bit = 4
                self.qconv_a_bit, self.eq_n, self.search_round = 8, 128, 3
        """,
}


@pytest.fixture
def fake_official(tmp_path):
    root = tmp_path / "official"
    for rel in xc.OFFICIAL_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    for rel, text in FAKE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    yield str(root)
    for name in [n for n in sys.modules if n.split(".")[0] in xc.OFFICIAL_PACKAGES]:
        del sys.modules[name]
    while str(root) in sys.path:
        sys.path.remove(str(root))


def run_script(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.slow
def test_an_existing_out_file_is_refused_in_one_error_line(tmp_path, fake_official):
    out = tmp_path / "x.json"
    out.write_text(json.dumps({key: {} for key in xc.RESULT_KEYS}))  # a JSON of this script's: --overwrite's to replace
    common = ("--checkpoint", str(tmp_path / "none.pt"), "--official", fake_official, "--out", str(out))
    proc = run_script(*common)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith(f"error: {out} already exist(s)")
    # --overwrite passes that refusal; the next one is the checkpoint's, an error the script prints as one line
    # as the process above shows (here in this process: one start of torch less)
    import evaluate

    with pytest.raises((xc.UserError, *evaluate.USER_ERRORS), match=r"^checkpoint not found"):
        xc.main([*common, "--overwrite", "--bits", "w4a4"])


def test_overwrite_refuses_an_out_file_the_script_did_not_write_before_any_work(tmp_path, fake_official):
    """--overwrite replaced whatever file --out named (an evaluate.py result, another script's JSON) after the
    first bit-width's minutes of reconstruction: only a JSON of this script's is replaced; another file is one
    error before the checkpoint is read, and kept."""
    out = tmp_path / "x.json"
    out.write_text('{"model": "vit_small_patch16_224", "fp": {"top1": 79.9}}')
    with pytest.raises(RunDirError, match=rf"^{re.escape(str(out))} is not a file crosscheck_aphq.py wrote"):
        xc.main(["--checkpoint", str(tmp_path / "none.pt"), "--official", fake_official, "--out", str(out),
                 "--overwrite", "--bits", "w4a4"])
    assert json.loads(out.read_text()) == {"model": "vit_small_patch16_224", "fp": {"top1": 79.9}}


def test_argument_errors(tmp_path, fake_official):
    with pytest.raises(xc.UserError, match="not an APHQ-ViT checkout"):
        xc.check_official(str(tmp_path))
    with pytest.raises(xc.UserError, match="equal weight and activation bits"):
        xc.official_config(fake_official, "w4a8")
    with pytest.raises(xc.UserError, match="no configs/3bit/best.py"):
        xc.official_config(fake_official, "w3a3")
    with pytest.raises(xc.UserError, match="--bits"):
        xc.official_config(fake_official, "four")
    assert xc.official_config(fake_official, "w4a4").endswith(os.path.join("configs", "4bit", "best.py"))
    given = xc.parse_args(["--checkpoint", "c", "--official", "o", "--out", "x", "--bits", "w4a4", "data.root=d"])
    assert given.bits == ["w4a4"] and given.overrides == ["data.root=d"]  # an override, as in evaluate.py


@pytest.mark.parametrize("flags, expected", [
    (["--iters", "-1"], "--iters: -1: must be at least 0"),
    (["--threads", "0"], "--threads: 0: must be at least 1"),
    (["--bits", "data.root=d"], "--bits needs at least one bit-width"),  # an override, no bit-width
    (["--bits", "w4a4", "four"], "--bits: bit-width 'four' is not of the form 'w4a4'"),
    (["--bits", "w4a8"], "--bits w4a8: the official configs have equal weight and activation bits"),
])
def test_values_the_flags_refuse_are_usage_errors(capsys, flags, expected):
    """They were a UserError after parsing (status 1); a usage error is one line with status 2, before any work."""
    with pytest.raises(SystemExit) as refused:
        xc.parse_args(["--checkpoint", "c", "--official", "o", "--out", "x", *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]


def test_options_that_differ_from_the_official_run_are_listed(fake_official):
    import dataclasses

    from configs.quant import APHQOptions

    cfg = xc.load_official_config(xc.official_config(fake_official, "w4a4"))
    cfg.optim_batch_size = 32
    assert xc.option_differences(APHQOptions(), cfg, "w4a4") == []
    assert xc.option_differences(dataclasses.replace(APHQOptions(), eq_n=64, act_lr=1e-4), cfg, "w4a4") == [
        "eq_n: ours 64, official 128", "act_lr: ours 0.0001, official 4e-05"]
    assert xc.option_differences(APHQOptions(), cfg, "w3a3")[0].startswith("bits: ours w3a3")
    stem_input_8_bit = dataclasses.replace(APHQOptions(), stem_a_bits=8)
    assert xc.option_differences(stem_input_8_bit, cfg, "w4a4")[0].startswith("bits:")


def test_models_the_official_forwards_would_change_are_refused():
    xc.check_model_fits_official(tiny_vit())
    with pytest.raises(xc.UserError, match="qk_norm"):
        xc.check_model_fits_official(tiny_vit(qk_norm=True))


def test_metrics_and_stage_entry():
    a, b, labels = torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 0, 4]), torch.tensor([1, 2, 3, 3])
    assert xc.agreement(a, b) == 0.75 and xc.top1(a, labels) == 75.0
    entry = xc.stage_entry({"ours": a, "official": b, "ref": a}, labels,
                           {"ours": 1.0, "official": 2.0, "ref": 3.0}, {})
    assert entry["ours"] == {"top1": 75.0, "seconds": 1.0} and entry["official"]["top1"] == 50.0
    assert entry["agreement"] == {"ours_vs_official": 0.75, "ours_vs_ref": 1.0, "official_vs_ref": 0.75}
    with pytest.raises(ValueError):
        xc.agreement(a, a[:2])


def test_unit_errors_are_zero_for_the_same_model_and_grow_with_a_change():
    model, x = tiny_vit(), images(4)
    units = ["patch_embed", "blocks.0", "blocks.1", "head"]
    assert all(v == 0 for v in xc.unit_errors(model, model, units, x, 2).values())
    other = tiny_vit()
    with torch.no_grad():
        other.blocks[1].mlp.fc2.weight.add_(0.1)
    err = xc.unit_errors(model, other, units, x, 2)
    assert err["blocks.0"] == 0 and err["blocks.1"] > 0 and err["head"] > 0


def test_unit_errors_are_the_summed_squared_error_over_the_summed_squared_output_of_all_images():
    """One Linear unit, images in batches of 2 of 5: sum ||O_q - O||^2 / sum ||O||^2 over every image (not a mean
    of squares, not the last batch alone), written out with the two weight matrices."""
    torch.manual_seed(0)
    fp, q = nn.Sequential(nn.Linear(3, 4, bias=False)), nn.Sequential(nn.Linear(3, 4, bias=False))
    x = torch.randn(5, 3)
    with torch.no_grad():
        ref, out = x @ fp[0].weight.T, x @ q[0].weight.T
    expected = float(((out - ref) ** 2).sum() / (ref ** 2).sum())
    assert xc.unit_errors(fp, q, ["0"], x, 2)["0"] == pytest.approx(expected, rel=1e-5)


def test_quantizer_comparison_counts_groups_with_another_scale_or_zero_point():
    from quant.aphq.pipeline import APHQPipeline
    from quant.convert import quantize_model
    from quant.spec import parse_bits
    from configs.quant import APHQOptions

    ours = quantize_model(tiny_vit(), APHQPipeline().layout(parse_bits("w4a4"), APHQOptions()))
    official = nn.Module()  # same FQNs, the official attribute names
    g = torch.Generator().manual_seed(0)
    total = {}
    for name, m in ours.named_modules():
        if hasattr(m, "weight_quantizer"):
            for key, q in (("w_quantizer", m.weight_quantizer), ("a_quantizer", m.input_quantizer)):
                if q is None:
                    continue
                groups = m.weight.shape[0] if key == "w_quantizer" else 1
                q.set_params(torch.rand(groups, generator=g) + 0.1, torch.randint(0, 15, (groups,)).float())
                total["weight" if key == "w_quantizer" else "input"] = total.get(
                    "weight" if key == "w_quantizer" else "input", 0) + groups
        if hasattr(m, "q_quant"):
            for op in ("q", "k", "attn", "v"):
                getattr(m, f"{op}_quant").set_params(torch.rand(3, generator=g) + 0.1, torch.zeros(3))
            total["matmul"] = total.get("matmul", 0) + 12
    for name, m in ours.named_modules():
        if hasattr(m, "weight_quantizer"):
            mirror = SimpleNamespace(w_quantizer=_copy(m.weight_quantizer, (-1, 1)),
                                     a_quantizer=_copy(m.input_quantizer, (1,)))
            _attach(official, name, mirror)
        if hasattr(m, "q_quant"):
            for mm, (a, b) in (("matmul1", ("q", "k")), ("matmul2", ("attn", "v"))):
                _attach(official, f"{name}.{mm}", SimpleNamespace(
                    A_quantizer=_copy(getattr(m, f"{a}_quant"), (1, -1, 1, 1)),
                    B_quantizer=_copy(getattr(m, f"{b}_quant"), (1, -1, 1, 1))))
    same = xc.compare_quantizers(ours, official)
    assert {k: v["groups"] for k, v in same["totals"].items()} == total
    assert all(v["same"] == v["groups"] for v in same["totals"].values())
    off_qkv = official.get_submodule("blocks.0.attn.qkv")
    off_qkv.w_quantizer.zero_point[3] += 1
    off_qkv.w_quantizer.scale[5] *= 1.001
    off_qkv.w_quantizer.scale[6] *= 1 + xc.SCALE_RTOL / 10  # float rounding of the same candidate
    official.get_submodule("blocks.1.attn.matmul2").A_quantizer.scale[0, 2] *= 1.5
    diff = xc.compare_quantizers(ours, official)
    assert diff["per_quantizer"]["blocks.0.attn.qkv.weight"]["same"] == 144 - 2
    assert diff["per_quantizer"]["blocks.0.attn.qkv.weight"]["zero_points_differ"] == 1
    assert diff["per_quantizer"]["blocks.0.attn.qkv.weight"]["differing_scale_rel_diffs"] == [
        0.0, pytest.approx(1e-3, rel=1e-3)]
    assert diff["totals"]["matmul"]["same"] == total["matmul"] - 1
    # relative to the official scale
    assert diff["totals"]["matmul"]["max_scale_rel_diff"] == pytest.approx(1 / 3)


def _copy(q, shape):
    if q is None:
        return None
    return SimpleNamespace(scale=q.scale.detach().clone().view(shape),
                           zero_point=q.zero_point.clone().view(shape))


def _attach(root: nn.Module, fqn: str, leaf) -> None:
    """Put `leaf`'s attributes on a module at `fqn` under `root`, creating the intermediate modules."""
    node = root
    for part in fqn.split("."):
        if not hasattr(node, part) or getattr(node, part) is None:
            node.register_module(part, nn.Module())
        node = getattr(node, part)
    for key, value in vars(leaf).items():
        setattr(node, key, value)


def test_the_official_run_gets_our_tensors_the_iterations_and_a_cpu_environment(fake_official):
    model, calib, recon = tiny_vit(), images(8), images(16, seed=3)
    cuda = (torch.Tensor.cuda, nn.Module.cuda)
    device_queries = (torch.cuda.is_available, torch.cuda.get_device_properties)
    seen = {}

    def on_calibrated(m, seconds):
        seen["model"], seen["seconds"] = m, seconds

    config = xc.official_config(fake_official, "w4a4")
    out, seconds = xc.run_official(fake_official, config, model, calib, recon, 7, 3407, on_calibrated)
    assert seen["model"] is out and seconds >= 0
    assert (torch.Tensor.cuda, nn.Module.cuda) == cuda  # adaptation 1 undone
    assert sys.modules["quant_layers"].SEEN == [(True, xc.FAKE_DEVICE_MEMORY)] * 3  # adaptation 2
    assert (torch.cuda.is_available, torch.cuda.get_device_properties) == device_queries  # ... and undone
    assert sys.modules["utils.block_recon"].CALLS == [
        ("init", 2, "hessian_perturb", 20, True), ("model", True, "qdrop", 0.5), ("block", "head", 7)]
    assert sys.modules["utils.block_recon"].BlockReconstructor.reconstruct_single_block.__name__ == \
        "reconstruct_single_block"  # adaptation 4 undone
    assert sys.modules["utils.wrap_net"].vit_attn_forward.__name__ == "vit_attn_forward"  # 5 undone
    assert out is not model  # a copy was wrapped; our float model is untouched
    assert all(type(m).forward is m.forward.__func__ for m in model.modules() if hasattr(m, "qkv"))


def test_a_module_name_clash_with_the_official_packages_is_refused(fake_official, monkeypatch):
    monkeypatch.setitem(sys.modules, "utils", SimpleNamespace(__file__="/elsewhere/utils/__init__.py"))
    with pytest.raises(xc.UserError, match="already imported"):
        with xc.official_environment(fake_official):
            pass


def test_candidate_steps_of_an_evenly_spaced_stem_follow_the_closed_form():
    # a channel of n evenly spaced weights in [-1, 1] has the linear-interpolation quantile -1 + 2p, so the
    # mirrored candidate pair at level p has width 4p - 2 and adjacent pairs differ by 4 (p' - p)
    model = tiny_vit().eval()
    w = model.patch_embed.proj.weight
    with torch.no_grad():
        w.copy_(torch.linspace(-1, 1, w[0].numel()).repeat(w.shape[0], 1).view_as(w))
    steps = xc.candidate_steps(model, images(4), eq_n=16)
    p = torch.tensor(xc.stem_levels(16), dtype=torch.float64)
    width = 4 * p - 2
    pair = (width[1:] - width[:-1]).abs() / width[:-1]
    assert steps["stem_pair"]["min"] == pytest.approx(float(pair.min()), rel=1e-2)
    assert steps["stem_pair"]["max"] == pytest.approx(float(pair.max()), rel=1e-2)
    for kind in ("matmul_pair", "matmul_one_bound"):
        s = steps[kind]
        assert 0 <= s["min"] <= s["median"] <= s["max"] < float("inf")


def test_aphq_options_are_overrides_it_reads(tmp_path, fake_official, monkeypatch):
    """The script checks APHQ: its quant.aphq.* overrides reach the options it compares (evaluate.py refuses the
    options of a pipeline it does not run, and the script once resolved the config with the default ones)."""
    from configs import config_to_dict, load_config
    from models import build_model
    from tests.conftest import DEMO_CONFIG

    cfg = load_config([DEMO_CONFIG], ["model.name=vit_nano"])  # an untrained checkpoint: only its config is read
    checkpoint = str(tmp_path / "best.pt")
    torch.save({"config": config_to_dict(cfg), "model": build_model(cfg.model).state_dict()}, checkpoint)

    class Reached(Exception):
        pass

    def stop(model):
        raise Reached

    monkeypatch.setattr(xc, "check_model_fits_official", stop)  # past the config, before the official code runs
    with pytest.raises(Reached):
        xc.main(["--checkpoint", checkpoint, "--official", fake_official, "--out", str(tmp_path / "x.json"),
                 "quant.aphq.seed=1", "--bits", "w4a4"])


def test_the_calibration_stage_sets_only_options_our_pipeline_reads(fake_official, monkeypatch):
    """Ours at the calibration stage is the user's options at iters=0: every option the script changes for it is
    one the pipeline reads there (the Python API's check, configs.loader.check_options_read, passes them)."""
    import dataclasses
    from configs.loader import check_options_read
    from configs.quant import APHQOptions

    class Stop(Exception):
        pass

    handed = []

    def run_ours(fp_model, options, *args):
        handed.append(options)
        raise Stop
    monkeypatch.setattr(xc, "run_ours", run_ours)
    options = APHQOptions(iters=5)
    setup = xc.Setup(tiny_vit(), options, images(8), images(4), images(4), [], None)
    with pytest.raises(Stop):
        xc.compare_bits(setup, "w4a4", xc.official_config(fake_official, "w4a4"), torch.zeros(4), SimpleNamespace())
    calibration, = handed
    changed = [f.name for f in dataclasses.fields(options) if getattr(calibration, f.name) != getattr(options, f.name)]
    assert calibration.iters == 0
    check_options_read(calibration, changed)  # raises on an option the pipeline leaves unread at iters=0
