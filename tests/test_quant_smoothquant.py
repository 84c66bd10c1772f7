"""SmoothQuant (quant/smoothquant/) against independent references; GPT-2's quantized attention; the LM
pipelines on the meta device and on a ViT; the generated scope table of quant/README.md."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from models.gpt import build_gpt
from quant import PIPELINES, quantize_model
from quant.attention import QuantCausalAttention
from quant.calibrate import calibrate
from quant.convert import quantized_layers
from quant.ptq.percentile import PercentilePipeline
from quant.quantizers import DynamicQuantizer
from quant.smoothquant.smooth import smooth_model
from quant.spec import ATTENTION, AttentionRule, Bits, QuantSpec
from device_utils import tensors_of
from quant_models import perturb_norms
from tests.conftest import hooked_forward, load_script

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64
LM_BITS = {"rtn": "w4a16", "gptq": "w4a16", "smoothquant": "w8a8", "smoothquant_strict": "w8a8"}


def gpt(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return perturb_norms(build_gpt("gpt2_nano", vocab_size=VOCAB)).eval()


def vit(seed: int = 0) -> nn.Module:
    import timm

    from models.variants import VARIANTS

    kwargs = dict(VARIANTS["vit_nano"])
    torch.manual_seed(seed)
    return perturb_norms(timm.create_model(kwargs.pop("arch"), num_classes=10, **kwargs)).eval()


def tokens(n: int = 8, seed: int = 1, length: int = 32) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def images(n: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def with_outliers(model: nn.Module) -> nn.Module:
    """A few LayerNorm channels 20x larger: the activation outliers SmoothQuant migrates."""
    with torch.no_grad():
        for block in model.blocks:
            block.norm1.weight[:3] *= 20
            block.norm2.weight[-2:] *= 20
    return model


def norm_output_absmax(model: nn.Module, x: torch.Tensor) -> dict:
    """max |x| per channel of every norm1 / norm2 output (forward hooks on the norms themselves)."""
    out = {}
    hooks = [m.register_forward_hook(lambda m, a, y, n=n: out.__setitem__(n, y.abs().flatten(0, -2).amax(0)))
             for n, m in model.named_modules() if n.endswith(("norm1", "norm2"))]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return out


# -- smoothing ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, inputs", [(gpt, tokens), (vit, images)], ids=["gpt", "vit"])
def test_smoothing_leaves_the_float_function_unchanged(make, inputs):
    model = with_outliers(make()).double()
    x = inputs()
    x = x.double() if x.is_floating_point() else x
    smoothed = copy.deepcopy(model)
    pairs = smooth_model(smoothed, x, alpha=0.5, batch_size=3)
    assert len(pairs) == 4 and not torch.equal(smoothed.blocks[0].norm1.weight, model.blocks[0].norm1.weight)
    with torch.no_grad():
        torch.testing.assert_close(smoothed(x), model(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_smoothing_scales_are_the_closed_form(alpha):
    model, x = with_outliers(gpt()), tokens()
    act = norm_output_absmax(model, x)
    smoothed = copy.deepcopy(model)
    smooth_model(smoothed, x, alpha=alpha, batch_size=8)
    for i, block in enumerate(model.blocks):
        for norm, linear in (("norm1", "attn.qkv"), ("norm2", "mlp.fc1")):
            w = block.get_submodule(linear).weight
            s = act[f"blocks.{i}.{norm}"].pow(alpha) / w.abs().amax(0).clamp(min=1e-5).pow(1 - alpha)
            new = smoothed.blocks[i]
            torch.testing.assert_close(new.get_submodule(norm).weight, block.get_submodule(norm).weight / s)
            torch.testing.assert_close(new.get_submodule(norm).bias, block.get_submodule(norm).bias / s)
            torch.testing.assert_close(new.get_submodule(linear).weight, w * s)
    # outlier channels are divided most (alpha 0.5 balances the activation and weight ranges)
    ratio = smoothed.blocks[0].norm1.weight / model.blocks[0].norm1.weight
    assert ratio[:3].max() < ratio[3:].min()


# -- quantizers ---------------------------------------------------------------------------------------------
def naive_absmax(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Symmetric max-abs fake quantization of one group (SmoothQuant's formula), float64."""
    scale = max(x.abs().max().item(), 1e-5) / (2 ** (bits - 1) - 1)
    return torch.round(x.double() / scale) * scale


def test_dynamic_quantizer_per_token_and_per_tensor_match_a_naive_loop():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g) * torch.linspace(0.1, 30, 16)
    per_token = DynamicQuantizer(8, (-1,))(x)
    for b in range(2):
        for t in range(5):
            torch.testing.assert_close(per_token[b, t].double(), naive_absmax(x[b, t]), rtol=0, atol=1e-5)
    per_tensor = DynamicQuantizer(8)(x)  # one range per sample: a sequence's, as one sequence per forward
    for b in range(2):
        torch.testing.assert_close(per_tensor[b].double(), naive_absmax(x[b]), rtol=0, atol=1e-5)
    heads = torch.randn(2, 3, 5, 4, generator=g)  # [B, H, N, D]: a token's range spans all its heads
    got = DynamicQuantizer(8, (1, -1))(heads)
    for b in range(2):
        for n in range(5):
            torch.testing.assert_close(got[b, :, n].double(), naive_absmax(heads[b, :, n]), rtol=0, atol=1e-6)


def test_dynamic_per_tensor_results_do_not_depend_on_the_windows_beside_them():
    """strict with run-time per-tensor ranges: a batch of windows gives each window the logits it gets alone,
    as in the official one-sequence-per-forward perplexity."""
    model = with_outliers(gpt())
    calib, windows = tokens(8), tokens(4, seed=3)
    quantized = PIPELINES["smoothquant_strict"](model, calib, "w8a8", {"act_calibration": "dynamic",
                                                                       "quantize_bmm": "qkv"})[0]
    with torch.no_grad():
        together = quantized(windows)
        alone = torch.cat([quantized(w[None]) for w in windows])
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)


def _on_grid(values: torch.Tensor, scale: torch.Tensor, qmax: int = 127) -> bool:
    codes = values.double() / scale.double()
    return bool(((codes - codes.round()).abs() < 1e-3).all() and (codes.abs() <= qmax + 1e-3).all())


def test_smoothquant_quantizes_every_block_linear_per_token_and_per_channel():
    model, calib, x = with_outliers(gpt()), tokens(), tokens(3, seed=5)
    qmodel, report = PIPELINES["smoothquant"](model, calib, "w8a8")
    layers = dict(quantized_layers(qmodel))
    assert set(layers) == {f"blocks.{i}.{p}" for i in range(2) for p in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    assert not any(isinstance(m, QuantCausalAttention) for m in qmodel.modules())  # attention matmuls float
    seen = {}
    hooks = [layer.input_quantizer.register_forward_hook(lambda m, a, y, n=n: seen.__setitem__(n, (a[0], y)))
             for n, layer in layers.items()]
    with torch.no_grad():
        qmodel(x)
    for h in hooks:
        h.remove()
    for name, layer in layers.items():
        inp, out = seen[name]
        rows, qrows = inp.flatten(0, -2), out.flatten(0, -2)
        for row, qrow in zip(rows, qrows):  # per token: the naive formula
            torch.testing.assert_close(qrow.double(), naive_absmax(row), rtol=0, atol=1e-5)
        w = layer.weight  # the smoothed weight; per output channel max-abs
        for row, qrow in zip(w, layer.quantized_weight()):
            torch.testing.assert_close(qrow.double(), naive_absmax(row), rtol=0, atol=1e-6)
    assert report["smoothed"] == ["blocks.0.norm1 -> blocks.0.attn.qkv", "blocks.0.norm2 -> blocks.0.mlp.fc1",
                                  "blocks.1.norm1 -> blocks.1.attn.qkv", "blocks.1.norm2 -> blocks.1.mlp.fc1"]


def test_strict_quantizes_the_attention_operands_with_static_ranges_of_the_smoothed_float_model():
    model, calib, x = with_outliers(gpt()), tokens(), tokens(3, seed=5)
    strict, _ = PIPELINES["smoothquant_strict"](model, calib, "w8a8")
    no_bmm, _ = PIPELINES["smoothquant_strict"](model, calib, "w8a8", {"quantize_bmm": "none"})
    attn = strict.blocks[0].attn
    assert isinstance(attn, QuantCausalAttention) and not isinstance(no_bmm.blocks[0].attn, QuantCausalAttention)
    seen = {}
    hooks = [getattr(attn, f"{op}_quant").register_forward_hook(lambda m, a, y, op=op: seen.__setitem__(op, y))
             for op in ("q", "k", "attn", "v")]
    with torch.no_grad():
        out, ref = strict(x), no_bmm(x)
    for h in hooks:
        h.remove()
    assert not torch.allclose(out, ref)
    for op, y in seen.items():  # every operand lies on its static per-tensor grid
        q = getattr(attn, f"{op}_quant")
        assert q.scale.numel() == 1 and _on_grid(y, q.scale), op
    assert attn.attn_quant.scale.item() == pytest.approx(1 / 127)  # causal: the first row's probability is 1
    # the static ranges are the max |x| of the smoothed FLOAT model over the calibration set
    smoothed = copy.deepcopy(model)
    smooth_model(smoothed, calib, alpha=0.5, batch_size=8)
    fc1_in = {}
    hook = smoothed.blocks[1].mlp.fc1.register_forward_pre_hook(lambda m, a: fc1_in.setdefault("x", a[0]))
    with torch.no_grad():
        smoothed(calib)
    hook.remove()
    want = fc1_in["x"].abs().max() / 127
    assert strict.blocks[1].mlp.fc1.input_quantizer.scale.item() == pytest.approx(want.item(), rel=1e-6)


def test_quantized_gpt_attention_without_quantizers_is_the_float_attention():
    model, x = gpt(), tokens(3)
    converted = quantize_model(model, QuantSpec(linears=(), attentions=(AttentionRule(ATTENTION, None, None, None,
                                                                                      None),), strict=False))
    assert isinstance(converted.blocks[1].attn, QuantCausalAttention)
    with torch.no_grad():
        torch.testing.assert_close(converted(x), model(x), rtol=1e-5, atol=1e-5)


def test_static_ranges_need_per_tensor_granularity():
    options = PIPELINES["smoothquant"].Options(act_calibration="static")
    with pytest.raises(ValueError, match="act_calibration=static needs act_granularity=tensor"):
        PIPELINES["smoothquant"].check(Bits(8, 8), options)


def test_calibrate_takes_token_windows():
    model = gpt()
    qmodel = quantize_model(model, PercentilePipeline().layout(Bits(8, 8), PercentilePipeline.Options()))
    assert calibrate(qmodel, tokens(4))["images"] == 4


# -- the LM pipelines on a ViT and on the meta device -------------------------------------------------------
@pytest.mark.parametrize("pipeline", ["smoothquant", "smoothquant_strict"])
def test_smoothquant_runs_on_a_vit_near_its_float_output(pipeline):
    model, x = with_outliers(vit()), images()
    qmodel, report = PIPELINES[pipeline](model, x, "w8a8")
    assert "patch_embed.proj" not in dict(quantized_layers(qmodel)) and type(qmodel.head) is nn.Linear
    with torch.no_grad():
        out, ref = qmodel(x), model(x)
    assert 0 < (out - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize("pipeline", ["smoothquant", "smoothquant_strict"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_calibration_activations_are_refused_naming_the_layer(pipeline, bad):
    """One NaN / inf pixel made max |X_j| non-finite, the smoothing scales NaN and the quantized model NaN on every
    input; the API refuses it (evaluate.py refuses such images before) naming the first layer whose input holds it."""
    x = images()
    x[3, 1, 4, 5] = bad
    with pytest.raises(ValueError, match=r"input of blocks\.0\.attn\.qkv hold NaN or inf"):
        PIPELINES[pipeline](vit(), x, "w8a8")


@pytest.mark.parametrize("pipeline", sorted(LM_BITS))
@pytest.mark.parametrize("make, inputs", [(gpt, tokens), (vit, images)], ids=["gpt", "vit"])
def test_lm_pipelines_create_no_tensor_on_the_default_device(pipeline, make, inputs):
    """tests/test_device_explicit.py's trick: every tensor is created on the device of its data."""
    model, calib = make(), inputs()
    with torch.device("meta"):
        qmodel, _ = PIPELINES[pipeline](model, calib, LM_BITS[pipeline], {"batch_size": 3}
                                        if pipeline != "rtn" else None)
        out = qmodel(calib)
    assert out.device.type == "cpu" and torch.isfinite(out).all()
    assert [name for name, t in tensors_of(qmodel) if t.device.type != "cpu"] == []


# -- the scope table ------------------------------------------------------------------------------------------
def test_readme_scope_table_is_current():
    script = load_script("quant_scope")
    want = script.scope_table()
    got = script.readme_table((ROOT / "quant" / "README.md").read_text())
    assert got == want, "quant/README.md's scope table is stale: run python scripts/quant_scope.py --write"
    rows = [line.split(" | ") for line in want.splitlines()[2:]]
    gptq_lm = [r for r in rows if r[0] == "| GPT-2" and r[1] == "gptq (w4a16)"]
    assert gptq_lm[0][2:] == ["`blocks.*.attn.qkv`, `blocks.*.attn.proj`, `blocks.*.mlp.fc1`, `blocks.*.mlp.fc2`",
                              "4b asym per-channel (GPTQ)", "float |"]
    assert "`head` (tied to `wte`)" in gptq_lm[1][2] and "attention matmuls" in gptq_lm[1][2]


def test_smoothing_statistics_are_the_max_over_every_batch():
    # batch_size 3 over 8 sequences: the activation max must pool all three batches, not keep the last
    model, x = with_outliers(gpt()), tokens()
    act = norm_output_absmax(model, x)
    smoothed = copy.deepcopy(model)
    smooth_model(smoothed, x, alpha=0.5, batch_size=3)
    for i, block in enumerate(model.blocks):
        w = block.attn.qkv.weight
        s = act[f"blocks.{i}.norm1"].pow(0.5) / w.abs().amax(0).clamp(min=1e-5).pow(0.5)
        torch.testing.assert_close(smoothed.blocks[i].norm1.weight, block.norm1.weight / s)


def test_smoothing_scales_clamp_a_zero_weight_column_and_a_tiny_result():
    # s_j = clamp(max|X_j|^a / clamp(max_i |W_ij| over every weight, 1e-5)^(1-a), 1e-5), written out per channel
    from quant.smoothquant.smooth import smoothing_scales
    act = torch.tensor([4.0, 9.0, 1e-12], dtype=torch.float64)
    w1 = torch.tensor([[0.5, 0.0, 2.0], [-1.0, 0.0, 0.1]], dtype=torch.float64)
    w2 = torch.tensor([[-3.0, 0.0, 0.0]], dtype=torch.float64)  # a second consumer: the max spans both
    want = [4.0 ** 0.5 / 3.0 ** 0.5, 9.0 ** 0.5 / 1e-5 ** 0.5, 1e-5]
    assert smoothing_scales(act, [w1, w2], 0.5).tolist() == pytest.approx(want, rel=1e-12)


def test_smoothing_scales_are_computed_in_the_weights_dtype():
    # channel_absmax gives float32 statistics; smooth_ln_fcs casts them to the weight's dtype before the power, so a
    # float64 model's scales are float64 throughout (sqrt(2) and sqrt(3) to 1e-15, not float32's 1e-8) and a
    # bfloat16 model's scales are bfloat16, as the norm and weight they rescale
    from quant.smoothquant.smooth import smoothing_scales
    act = torch.tensor([2.0, 3.0], dtype=torch.float32)
    w = torch.tensor([[1.0, -0.5], [0.25, 0.125]], dtype=torch.float64)
    s = smoothing_scales(act, [w], 0.5)
    assert s.dtype == torch.float64
    assert s.tolist() == pytest.approx([2.0 ** 0.5 / 1.0, 3.0 ** 0.5 / 0.5 ** 0.5], rel=1e-14)
    assert smoothing_scales(act, [w.bfloat16()], 0.5).dtype == torch.bfloat16


def test_smoothquant_pipeline_smooths_with_the_alpha_it_is_given():
    model, x = with_outliers(gpt()), tokens()
    act = norm_output_absmax(model, x)
    qmodel, _ = PIPELINES["smoothquant"](model, x, "w8a8", {"alpha": 0.8})
    w = model.blocks[0].attn.qkv.weight
    s = act["blocks.0.norm1"].pow(0.8) / w.abs().amax(0).clamp(min=1e-5).pow(0.2)
    torch.testing.assert_close(qmodel.blocks[0].norm1.weight, model.blocks[0].norm1.weight / s)


def test_smoothquant_honours_weight_granularity_and_quantize_bmm_qkv():
    qmodel, _ = PIPELINES["smoothquant"](gpt(), tokens(), "w8a8",
                                         {"weight_granularity": "tensor", "quantize_bmm": "qkv"})
    for block in qmodel.blocks:
        for name in ("attn.proj", "mlp.fc1", "mlp.fc2"):
            q = block.get_submodule(name).weight_quantizer
            assert q.channel_dim is None and q.scale.numel() == 1, name
        # the fused qkv: one scale per projection (tests/test_quant_smoothquant_tensor_weights.py)
        assert block.attn.qkv.weight_quantizer.scale.unique().numel() == 3
        attn = block.attn
        assert attn.q_quant is not None and attn.k_quant is not None and attn.v_quant is not None
        assert attn.attn_quant is None  # "qkv": the softmax output stays float


# -- the documented option defaults, as evaluate.py reads them -------------------------------------------------
def _documented_smoothquant_defaults() -> dict:
    """{pipeline: {option: default}} of smoothquant and smoothquant_strict, read from quant/README.md's options
    table: `key` (default), or `key` (default / strict: strict default)."""
    import re

    import yaml

    out = {"smoothquant": {}, "smoothquant_strict": {}}
    for line in (ROOT / "quant" / "README.md").read_text().splitlines():
        row = re.match(r"\| [a-z, ]*smoothquant\(_strict\) \| `(\w+)` \(([^)]*)\) \|", line)
        if row:
            key, default = row.groups()
            plain, _, strict = default.partition(" / strict: ")
            out["smoothquant"][key] = yaml.safe_load(plain)
            out["smoothquant_strict"][key] = yaml.safe_load(strict or plain)
    return out


def _activation_quantizers(qmodel: nn.Module) -> dict:
    """{name: quantizer} of every activation quantizer: the block Linears' inputs and the attention operands."""
    found = {f"{n}.input": layer.input_quantizer for n, layer in quantized_layers(qmodel)}
    for name, module in qmodel.named_modules():
        if isinstance(module, QuantCausalAttention):
            found.update({f"{name}.{op}": getattr(module, f"{op}_quant") for op in ("q", "k", "attn", "v")})
    return found


def test_strict_defaults_are_the_documented_ones_and_quantize_per_tensor_statically_with_the_matmuls():
    """evaluate.py's options (the config's quant.smoothquant_strict section) are quant/README.md's defaults: strict
    quantizes every block Linear input and q, k, softmax output and v with one static range per tensor (not a
    DynamicQuantizer), the non-strict setting per token at run time with the attention matmuls float; a setting
    the user gives for strict is used, and one given for smoothquant does not reach strict."""
    from configs import load_config
    from quant import plan

    documented = _documented_smoothquant_defaults()
    assert set(documented["smoothquant_strict"]) == {"batch_size", "alpha", "weight_granularity", "act_granularity",
                                                     "act_calibration", "quantize_bmm"}
    assert documented["smoothquant_strict"]["act_granularity"] == "tensor"  # the table says what strict means
    cfg = load_config([], [])
    for name, want in documented.items():
        options = plan.pipeline_options(cfg, name)
        assert {key: getattr(options, key) for key in want} == want, name

    model, calib = with_outliers(gpt()), tokens()
    strict = PIPELINES["smoothquant_strict"](model, calib, "w8a8", plan.pipeline_options(cfg, "smoothquant_strict"))
    found = _activation_quantizers(strict.model)
    assert len(found) == 2 * (4 + 4)  # 2 blocks: qkv, proj, fc1, fc2 inputs and q, k, attn, v
    for name, quantizer in found.items():
        assert quantizer is not None and not isinstance(quantizer, DynamicQuantizer), name
        assert quantizer.scale.numel() == 1, name  # one range for the whole tensor, fixed at calibration
    plain = PIPELINES["smoothquant"](model, calib, "w8a8", plan.pipeline_options(cfg, "smoothquant"))
    found = _activation_quantizers(plain.model)
    assert len(found) == 2 * 4 and all(isinstance(q, DynamicQuantizer) for q in found.values())

    told = load_config([], ["quant.smoothquant_strict.act_calibration=dynamic",
                            "quant.smoothquant_strict.quantize_bmm=qkv", "quant.smoothquant.quantize_bmm=none",
                            "quant.smoothquant.act_granularity=tensor"])
    options = plan.pipeline_options(told, "smoothquant_strict")
    assert (options.act_calibration, options.quantize_bmm, options.act_granularity) == ("dynamic", "qkv", "tensor")
    found = _activation_quantizers(PIPELINES["smoothquant_strict"](model, calib, "w8a8", options).model)
    assert {n.rsplit(".", 1)[1] for n, q in found.items() if q is None} == {"attn"}  # qkv: probabilities float
    assert all(isinstance(q, DynamicQuantizer) for q in found.values() if q is not None)


def test_scope_script_writes_its_table_between_the_markers_of_the_quant_readme(monkeypatch, tmp_path):
    """--write (the argv given, not the process's) targets quant/README.md, the document that holds the
    script's markers, and replaces only what lies between them."""
    script = load_script("quant_scope")
    readme = (ROOT / "quant" / "README.md").read_text()
    assert script.README.resolve() == (ROOT / "quant" / "README.md").resolve()
    assert script.BEGIN in readme and script.END in readme.split(script.BEGIN, 1)[1]
    doc = tmp_path / "README.md"
    doc.write_text(f"a\n{script.BEGIN}\nold\n{script.END}\nb\n")
    monkeypatch.setattr(script, "README", doc)
    monkeypatch.setattr(script, "scope_table", lambda: "new")  # the table itself: test_readme_scope_table_is_current
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # leaves torch's threads as they are
    script.main(["--write"])
    assert doc.read_text() == f"a\n{script.BEGIN}\nnew\n{script.END}\nb\n"


def test_quantized_gpt_attention_of_a_dropout_model_drops_nothing_in_eval_mode():
    # a model trained with dropout (drop=0.5) is evaluated deterministically: the converted attention's
    # probabilities must not be dropped in eval mode, as the float module's SDPA call (dropout_p 0 in eval)
    torch.manual_seed(0)
    model, x = perturb_norms(build_gpt("gpt2_nano", vocab_size=VOCAB, drop=0.5)).eval(), tokens(3)
    converted = quantize_model(model, QuantSpec(linears=(), attentions=(AttentionRule(ATTENTION, None, None, None,
                                                                                      None),), strict=False))
    with torch.no_grad():
        torch.testing.assert_close(converted(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [{"granularity": "channel"}, {"granularity": "tensor", "symmetric": False}],
                         ids=["per-channel", "asymmetric"])
def test_dynamic_quantizer_refuses_what_it_cannot_do(options):
    # SmoothQuant's run-time max-abs ranges are symmetric, per tensor or per token: anything else is refused
    from quant.spec import QuantizerSpec
    spec = QuantizerSpec(8, kind=DynamicQuantizer, **{"symmetric": True, **options})
    with pytest.raises(ValueError, match="symmetric, per tensor or per token"):
        DynamicQuantizer.from_spec(spec, -1 if options["granularity"] == "channel" else None)


def test_dynamic_quantizer_clamps_a_tiny_token_range_at_the_official_1e_5():
    # smoothquant/fake_quant.py: scale = max(|x|).clamp(min=1e-5) / 127, so a token whose values are all below
    # 1e-5 is quantized on the 1e-5 / 127 grid (values far below it become 0), not on its own max-abs grid
    x = torch.tensor([[[3e-7, -3e-8, 2e-6, 0.0]], [[0.5, -2.0, 1.0, 0.25]]], dtype=torch.float64)
    got = DynamicQuantizer(8, (-1,))(x)
    tiny = 1e-5 / 127
    torch.testing.assert_close(got[0, 0], torch.round(x[0, 0] / tiny) * tiny, rtol=0, atol=1e-15)
    assert got[0, 0, 1].item() == 0.0 and got[0, 0, 0].item() == pytest.approx(4 * tiny)
    torch.testing.assert_close(got[1, 0], naive_absmax(x[1, 0]), rtol=0, atol=1e-12)


def test_smoothing_touches_the_block_norms_only_not_swins_patch_merging():
    # SmoothQuant smooths norm1 -> qkv and norm2 -> fc1 in every block; PatchMerging's norm -> reduction
    # (which the RepQ-ViT fold does reparameterise) and every other norm keep their parameters
    from quant_models import tiny_swin
    model = perturb_norms(tiny_swin())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pairs = smooth_model(model, images(2), alpha=0.5, batch_size=2)
    blocks = sorted(n.rsplit(".", 1)[0] for n, m in model.named_modules() if n.endswith(".mlp"))
    want = [(f"{b}.norm1", f"{b}.attn.qkv") for b in blocks] + [(f"{b}.norm2", f"{b}.mlp.fc1") for b in blocks]
    assert sorted(pairs) == sorted(want) and len(want) == 8
    merges = [n for n in before if ".downsample." in n]
    assert merges and all(torch.equal(model.get_parameter(n), before[n]) for n in merges)


def _operands(qmodel: nn.Module, x: torch.Tensor) -> dict:
    """{name: (input, output)} of every activation quantizer of `qmodel` on `x` (forward hooks)."""
    seen = {}
    quantizers = {name: q for name, q in _activation_quantizers(qmodel).items() if q is not None}
    hooked_forward(qmodel, x, quantizers, lambda n, inputs, y: seen.__setitem__(n, (inputs[0], y)))
    return seen


def test_dynamic_ranges_are_one_per_window_or_one_per_token_across_the_heads():
    """act_calibration=dynamic honours act_granularity: per tensor, every Linear input and q, k, v take one max-abs
    range per window (the official per_tensor fake quantization, one sequence per forward); per token (with
    quantize_bmm=qkv) q, k and v take one range per token spanning all heads, as the official quantize_bmm_input
    quantizes the (B, T, C) projection outputs before they are split into heads."""
    model, calib, x = with_outliers(gpt()), tokens(), tokens(3, seed=5)
    for pipeline, options in (("smoothquant_strict", {"act_calibration": "dynamic", "quantize_bmm": "qkv"}),
                              ("smoothquant", {"quantize_bmm": "qkv"})):
        per_token = PIPELINES[pipeline].Options(**options).act_granularity == "token"
        seen = _operands(PIPELINES[pipeline](model, calib, "w8a8", options).model, x)
        assert {n.rsplit(".", 1)[1] for n in seen} == {"input", "q", "k", "v"}, pipeline
        for name, (inp, out) in seen.items():
            matmul = inp.dim() == 4  # q, k, v: [B, H, T, D]; Linear inputs: [B, T, C]
            for b in range(len(inp)):
                groups = ([(b, slice(None), t) if matmul else (b, t) for t in range(inp.shape[-2])] if per_token
                          else [(b,)])
                for g in groups:
                    torch.testing.assert_close(out[g].double(), naive_absmax(inp[g]), rtol=0, atol=1e-5,
                                               msg=f"{pipeline} {name} {g}")


def test_smoothquant_of_a_dropout_model_in_training_mode_takes_its_statistics_without_dropout():
    # the official get_act_scales runs model.eval(): the embedding dropout in front of block 0 would otherwise
    # scale norm1's input by 1 / (1 - p) at random and move max |X_j|; the model comes back in training mode
    torch.manual_seed(0)
    model = with_outliers(perturb_norms(build_gpt("gpt2_nano", vocab_size=VOCAB, drop=0.5))).train()
    x = tokens()
    act = norm_output_absmax(copy.deepcopy(model).eval(), x)
    qmodel, _ = PIPELINES["smoothquant"](model, x, "w8a8")
    assert qmodel.training
    w = model.blocks[0].attn.qkv.weight
    s = act["blocks.0.norm1"].pow(0.5) / w.abs().amax(0).clamp(min=1e-5).pow(0.5)
    torch.testing.assert_close(qmodel.blocks[0].norm1.weight, model.blocks[0].norm1.weight / s)
