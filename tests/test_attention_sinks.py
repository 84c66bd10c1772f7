"""Attention-sink variants (model.attn): each against a float64 reference written out here, gradients and
weight decay of the sink parameters, CD pairs, train.py / resume / evaluate.py, and every quantization
pipeline on each variant (ViT and Swin), whose conversion shares the sink parameters with the float module."""
import math
import typing

import pytest
import torch
from timm.models.vision_transformer import Attention

import evaluate
import train
from cd import find_pairs
from cd.pairs import find_blocks
from configs import OptimConfig, load_config
from configs.schema import ModelConfig
from engine.checkpoint import CheckpointError
from engine.optim import build_optimizer
from models import ModelError, build_model
from models.attention_sinks import (ATTN_CHOICES, AttnBiasAttention, KVBiasAttention, KVBiasWindowAttention,
                                    Softmax1Attention, softmax_with_sink, use_sink_attention)
from quant import PIPELINES
from quant.attention import ATTENTION_TYPES
from quant.modes import quant_state
from device_utils import cpu_pipeline_data
from quant_models import images, tiny_swin, tiny_vit
from tests.conftest import DEMO_CONFIG

SINKS = ("softmax1", "kv_bias", "attn_bias")
pytestmark = pytest.mark.usefixtures("one_thread")


def randomize_sinks(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Non-zero sink parameters (they start at zero, which would hide a wrong slice or sign)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".sink_" in name or name.startswith("sink_"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def sink_model(build, attn: str, seed: int = 0) -> torch.nn.Module:
    model = build(seed=seed)
    use_sink_attention(model, attn)
    return randomize_sinks(model.eval(), seed)


def reference_heads(attn, x, extra_bias=None):
    """An attention module's output, head by head, in float64 with explicit exp / sum (no torch softmax).

    extra_bias: [H, N, N] additive bias on the token scores (Swin's relative position bias + shift mask)."""
    x = x.double()
    W, b = attn.qkv.weight.double(), attn.qkv.bias.double()
    H = attn.num_heads
    C3 = W.shape[0]
    D = C3 // 3 // H
    qkv = x @ W.T + b
    heads = []
    for h in range(H):
        q = qkv[..., h * D:(h + 1) * D]
        k = qkv[..., C3 // 3 + h * D:C3 // 3 + (h + 1) * D]
        v = qkv[..., 2 * C3 // 3 + h * D:2 * C3 // 3 + (h + 1) * D]
        scores = q @ k.transpose(-2, -1) / math.sqrt(D)
        if extra_bias is not None:
            scores = scores + extra_bias[..., h, :, :]
        num = torch.exp(scores)  # scores are small here: no max shift needed for a reference
        denom = num.sum(-1, keepdim=True)
        out = num @ v
        if attn.kind == "softmax1":
            denom = denom + 1.0
        elif attn.kind == "attn_bias":
            denom = denom + torch.exp(attn.sink_logit.double()[h])
        elif attn.kind == "kv_bias":
            ks, vs = attn.sink_k.double()[h * D:(h + 1) * D], attn.sink_v.double()[h * D:(h + 1) * D]
            e_sink = torch.exp(q @ ks / math.sqrt(D))[..., None]  # [B, N, 1]
            denom = denom + e_sink
            out = out + e_sink * vs
        heads.append(out / denom)
    return torch.cat(heads, dim=-1) @ attn.proj.weight.double().T + attn.proj.bias.double()


# -- the math ------------------------------------------------------------------------------------------
def test_schema_choices_are_the_models_choices():
    hint = typing.get_type_hints(ModelConfig, include_extras=True)["attn"]
    assert typing.get_args(hint) == ATTN_CHOICES and ModelConfig().attn == "softmax"


def test_softmax_with_sink_is_stable_and_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 7, generator=g, dtype=torch.float64)
    b = torch.randn(3, 1, 1, generator=g, dtype=torch.float64)
    want = torch.exp(x) / (torch.exp(x).sum(-1, keepdim=True) + torch.exp(b))
    torch.testing.assert_close(softmax_with_sink(x, b), want)
    # large logits overflow exp() in the naive form; the shifted form equals the sink-column softmax
    big = x * 1000
    with_column = torch.cat([big, b.expand(2, 3, 4, 1)], dim=-1).softmax(-1)[..., :-1]
    torch.testing.assert_close(softmax_with_sink(big, b), with_column)
    # softmax1: very negative scores put (almost) all mass on the sink, masked rows give zeros, not NaN
    assert softmax_with_sink(torch.full((5,), -1e4), torch.zeros(())).abs().max() < 1e-30
    masked = softmax_with_sink(torch.full((2, 5), float("-inf")), torch.zeros(()))
    assert torch.equal(masked, torch.zeros(2, 5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_softmax_with_sink_of_half_precision_scores_is_computed_in_float32(dtype):
    """fp16 / bf16 scores (autocast) are upcast as torch's softmax does: the result is the float64 formula rounded
    once to the half dtype, within one of its ulps (exp, sum and division in the half dtype itself miss it by
    several: ~7% in bf16 over 64 keys)."""
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(4, 3, 16, 64, generator=g)).to(dtype)
    b = torch.randn(3, 1, 1, generator=g).to(dtype)
    xd, bd = x.double(), b.double()
    want = torch.exp(xd) / (torch.exp(xd).sum(-1, keepdim=True) + torch.exp(bd))
    got = softmax_with_sink(x, b)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=torch.finfo(dtype).eps, atol=1e-6)


@pytest.mark.parametrize("cls", [Softmax1Attention, AttnBiasAttention, KVBiasAttention])
@pytest.mark.parametrize("fused", [True, False])
def test_vit_variant_matches_the_reference(cls, fused):
    torch.manual_seed(0)
    attn = randomize_sinks(cls(48, num_heads=3, qkv_bias=True)).double().eval()
    attn.fused_attn = fused  # kv_bias uses SDPA when fused; softmax1 / attn_bias always compute explicitly
    x = torch.randn(2, 9, 48, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), reference_heads(attn, x))


@pytest.mark.parametrize("cls", [Softmax1Attention, AttnBiasAttention, KVBiasAttention])
@pytest.mark.parametrize("fused", [True, False])
def test_vit_variant_is_causal_on_the_tokens_only(cls, fused):
    """is_causal masks the later tokens (a query sees itself and the earlier ones), never the sink."""
    torch.manual_seed(0)
    attn = randomize_sinks(cls(48, num_heads=3, qkv_bias=True)).double().eval()
    attn.fused_attn = fused
    x = torch.randn(2, 9, 48, dtype=torch.float64)
    later = torch.ones(9, 9, dtype=torch.bool).triu(1)
    causal = torch.zeros(3, 9, 9, dtype=torch.float64).masked_fill(later, float("-inf"))
    with torch.no_grad():
        torch.testing.assert_close(attn(x, is_causal=True), reference_heads(attn, x, causal))


@pytest.mark.parametrize("cls", [Softmax1Attention, AttnBiasAttention, KVBiasAttention])
def test_converted_variant_masks_the_tokens_only(cls):
    """The converted variant (quant/attention.py, no quantizers) with an additive attn_mask or is_causal: the
    mask covers the token keys, never the sink (kv_bias's extra key slot gets no mask column)."""
    from quant.attention import convert_attention

    torch.manual_seed(0)
    attn = randomize_sinks(cls(48, num_heads=3, qkv_bias=True)).double().eval()
    ours = convert_attention(attn, {})
    x = torch.randn(2, 9, 48, dtype=torch.float64)
    bias = torch.randn(9, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    later = torch.ones(9, 9, dtype=torch.bool).triu(1)
    causal = torch.zeros(3, 9, 9, dtype=torch.float64).masked_fill(later, float("-inf"))
    with torch.no_grad():
        torch.testing.assert_close(ours(x, attn_mask=bias), reference_heads(attn, x, bias.expand(3, 9, 9)))
        torch.testing.assert_close(ours(x, is_causal=True), reference_heads(attn, x, causal))


@pytest.mark.parametrize("cls", [Softmax1Attention, AttnBiasAttention, KVBiasAttention])
@pytest.mark.parametrize("fused", [True, False])
def test_attention_dropout_acts_in_training_only(cls, fused):
    torch.manual_seed(0)
    attn = randomize_sinks(cls(48, num_heads=3, qkv_bias=True, attn_drop=0.5))
    attn.fused_attn = fused
    x = torch.randn(2, 9, 48)
    with torch.no_grad():
        evaluation = attn.eval()(x)
        assert torch.equal(attn(x), evaluation)
        assert not torch.allclose(attn.train()(x), evaluation)


@pytest.mark.parametrize("attn_kind", SINKS)
def test_swin_variant_matches_the_reference_with_shift_mask(attn_kind):
    model = sink_model(tiny_swin, attn_kind).double()
    block = model.layers[0].blocks[1]
    assert any(block.shift_size) and block.attn_mask is not None
    attn, mask = block.attn, block.attn_mask.double()  # [nW, N, N]
    nw, n = mask.shape[0], mask.shape[1]
    x = torch.randn(2 * nw, n, 32, dtype=torch.float64)
    table = attn.relative_position_bias_table.double()
    rel = table[attn.relative_position_index.view(-1)].view(n, n, -1).permute(2, 0, 1)  # [H, N, N]
    bias = rel[None, None] + mask[None, :, None]  # [1, nW, H, N, N]: windows vary fastest in the batch
    bias = bias.expand(2, -1, -1, -1, -1).reshape(2 * nw, -1, n, n)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, mask=mask), reference_heads(attn, x, bias))


def test_variants_relate_to_plain_attention():
    """At init (zero sink parameters) all three variants are softmax1; attn_bias with a very negative
    logit is timm's plain attention; a fully masked row leaves only the sink's value."""
    torch.manual_seed(0)
    plain = Attention(48, num_heads=3, qkv_bias=True).eval()
    x = torch.randn(2, 9, 48)
    outs = {cls: cls.from_module(plain)(x) for cls in (Softmax1Attention, AttnBiasAttention, KVBiasAttention)}
    with torch.no_grad():
        first, *rest = outs.values()
        assert all(torch.allclose(first, o, atol=1e-6) for o in rest)
        assert not torch.allclose(first, plain(x), atol=1e-3)
        bias = AttnBiasAttention.from_module(plain)
        bias.sink_logit.fill_(-60.0)
        torch.testing.assert_close(bias(x), plain(x), rtol=0, atol=1e-5)
        nothing = torch.zeros(9, 9, dtype=torch.bool)
        torch.testing.assert_close(Softmax1Attention.from_module(plain)(x, attn_mask=nothing),
                                   plain.proj.bias.expand(2, 9, 48))
        kv = randomize_sinks(KVBiasAttention.from_module(plain))
        torch.testing.assert_close(kv(x, attn_mask=nothing), kv.proj(kv.sink_v).expand(2, 9, 48))
        kv.fused_attn = not kv.fused_attn  # SDPA and the explicit path agree, masks included
        torch.testing.assert_close(kv(x, attn_mask=nothing), kv.proj(kv.sink_v).expand(2, 9, 48))


# -- every option of timm's Attention, against timm's own module --------------------------------------------
TIMM_OPTIONS = {"qk_norm": dict(qk_norm=True), "scale_norm": dict(scale_norm=True), "gated": dict(gated=True),
                "head_dim": dict(attn_head_dim=8, dim_out=40)}


@pytest.mark.parametrize("masks", ["none", "causal", "bool_mask", "causal_and_mask"])
@pytest.mark.parametrize("option", sorted(TIMM_OPTIONS))
def test_a_vanishing_sink_is_timms_attention_with_each_of_its_options(option, masks):
    """attn_bias with exp(sink_logit) = 0 (a logit of -1e4 in float64) is plain softmax attention, so the variant
    that took over a timm Attention must give timm's output (its explicit path, float64) for each option timm's
    module has: q / k norms, a norm of the heads' output, a sigmoid gate, a head and output width of its own; and
    for each mask: is_causal, a bool attn_mask (True: attend), and both (is_causal wins, as in timm)."""
    g = torch.Generator().manual_seed(0)
    plain = Attention(48, num_heads=3, qkv_bias=True, norm_layer=torch.nn.LayerNorm, **TIMM_OPTIONS[option])
    plain = plain.double().eval()
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if "norm" in name:  # not the identity-like init: a norm applied twice or left out shows
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    plain.fused_attn = False
    variant = AttnBiasAttention.from_module(plain)
    with torch.no_grad():
        variant.sink_logit.fill_(-1e4)
    x = torch.randn(2, 9, 48, generator=g, dtype=torch.float64)
    allowed = (torch.rand(9, 9, generator=g) > 0.5) | torch.eye(9, dtype=torch.bool)  # no row fully masked
    kwargs = {"none": {}, "causal": dict(is_causal=True), "bool_mask": dict(attn_mask=allowed),
              "causal_and_mask": dict(attn_mask=allowed, is_causal=True)}[masks]
    with torch.no_grad():
        torch.testing.assert_close(variant(x, **kwargs), plain(x, **kwargs))


def test_a_variant_takes_over_only_the_timm_module_it_is_made_for():
    """from_module copies settings and children by name: a module of another type (Swin's WindowAttention for a ViT
    variant, or a variant already) would give a module mixing two layouts, so it is a TypeError."""
    vit = Attention(48, num_heads=3)
    with pytest.raises(TypeError, match="KVBiasWindowAttention.from_module takes a WindowAttention, not a Attention"):
        KVBiasWindowAttention.from_module(vit)
    with pytest.raises(TypeError, match="Softmax1Attention.from_module takes a Attention, not a Softmax1Attention"):
        Softmax1Attention.from_module(Softmax1Attention.from_module(vit))


@pytest.mark.parametrize("cls", [AttnBiasAttention, KVBiasAttention])
@pytest.mark.parametrize("device, dtype", [("meta", torch.float32), ("cpu", torch.bfloat16)])
def test_sink_parameters_are_made_on_the_device_and_in_the_dtype_of_the_module_taken_over(cls, device, dtype):
    """The sink parameters sit beside the module's own weights (meta stands in for a GPU here): on the default
    device, or in float32 beside bf16 weights, they would split the module across devices / dtypes."""
    src = Attention(48, num_heads=3, qkv_bias=True, device=device, dtype=dtype)
    sinks = [getattr(cls.from_module(src), name) for name in cls.sink_params]
    assert sinks and all(p.device == torch.device(device) and p.dtype == dtype for p in sinks)

# -- models, training pieces ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["vit_nano", "swin_nano"])
@pytest.mark.parametrize("attn_kind", SINKS)
def test_sink_parameters_learn_without_weight_decay_and_keep_the_pairs(name, attn_kind):
    plain = build_model(load_config(None, [f"model.name={name}", "model.num_classes=5"]).model)
    model = build_model(load_config(None, [f"model.name={name}", "model.num_classes=5",
                                           f"model.attn={attn_kind}"]).model)
    model(images(2)).sum().backward()
    sinks = {n: p for n, p in model.named_parameters() if ".sink_" in n}
    assert set(model.state_dict()) - set(plain.state_dict()) == set(sinks)  # timm's keys are all kept
    assert len(sinks) == {"softmax1": 0, "kv_bias": 2, "attn_bias": 1}[attn_kind] * len(find_blocks(model))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in sinks.values())
    optimizer = build_optimizer(model, OptimConfig(), lr=1e-3, weight_decay=0.05)
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert not any(id(p) in decayed for p in sinks.values())

    def described(m):
        return [(p.name, p.role, p.kind, p.w1_shape, p.w2_shape) for p in find_pairs(m)]

    assert described(model) == described(plain)


def test_unsupported_models_and_overrides_are_clear_errors():
    with pytest.raises(ModelError, match="model.attn=kv_bias.*no timm Attention"):
        build_model(load_config(None, ["model.name=resnet18", "model.attn=kv_bias"]).model)


def test_plain_weights_load_into_a_variant_unless_strict(tmp_path):
    plain = build_model(load_config(None, ["model.name=vit_nano"]).model)
    torch.save(plain.state_dict(), tmp_path / "w.pth")
    args = ["model.name=vit_nano", "model.attn=attn_bias", f"model.pretrained={tmp_path / 'w.pth'}"]
    model = build_model(load_config(None, args).model)
    assert torch.equal(model.blocks[1].attn.qkv.weight, plain.blocks[1].attn.qkv.weight)
    assert not model.blocks[1].attn.sink_logit.any()
    with pytest.raises(ModelError, match="sink_logit"):
        build_model(load_config(None, args + ["model.pretrained_strict=true"]).model)


@pytest.mark.parametrize("attn_kind", SINKS)
def test_train_resume_and_evaluate_rebuild_the_variant(tmp_path, attn_kind):
    common = [f"out_dir={tmp_path}", "model.name=vit_nano", f"model.attn={attn_kind}", "sched.epochs=1",
              "sched.warmup_epochs=0", "log.tensorboard=false", "cd.enabled=true", "tweo.enabled=true",
              "log.act_max=true"]
    first = train.main(load_config([DEMO_CONFIG], common + ["train.max_steps=2"]))
    resumed = train.main(load_config([DEMO_CONFIG], common + ["train.max_steps=3"]))
    assert first.state.step == 2 and resumed.state.step == 3  # the second run resumed the first
    ckpt = str(tmp_path / "checkpoint.pt")
    result = evaluate.main(evaluate.parse_args(["--checkpoint", ckpt, "--quant", "--out",
                                                str(tmp_path / "eval.json"), "quant.act_max_csv=false"]))
    assert result["model"] == f"vit_nano ({attn_kind})" and result["max_act"]["block"] > 0
    assert result["fp"]["top1"] == pytest.approx(resumed.metrics["val/top1"], abs=1e-6)
    with pytest.raises(CheckpointError, match=f"model.attn={attn_kind}"):
        evaluate.main(evaluate.parse_args(["--checkpoint", ckpt, "--quant", "--out",
                                           str(tmp_path / "other.json"), "model.attn=softmax"]))


def test_fine_tuning_a_run_with_another_attention_says_so(tmp_path, caplog):
    """softmax1 has no parameters: its weights load into plain softmax without a mismatch to show it."""
    common = ["model.name=vit_nano", "sched.epochs=1", "sched.warmup_epochs=0", "log.tensorboard=false",
              "train.max_steps=1"]
    train.main(load_config([DEMO_CONFIG], common + [f"out_dir={tmp_path / 'a'}", "model.attn=softmax1"]))
    ckpt = tmp_path / "a" / "checkpoint.pt"
    for attn, said in (("softmax", True), ("softmax1", False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="train"):
            train.main(load_config([DEMO_CONFIG], common + [f"out_dir={tmp_path / attn}", f"model.attn={attn}",
                                                            f"model.pretrained={ckpt}"]))
        assert ("was trained with model.attn=softmax1; fine-tuning it with model.attn=softmax" in caplog.text) == said
    # strict loads the weights as trained or not at all: the attention change (no key to show it) is refused
    strict = common + [f"model.pretrained={ckpt}", "model.pretrained_strict=true"]
    with pytest.raises(ModelError, match=r"model\.attn=softmax1.*model\.pretrained_strict=false"):
        train.main(load_config([DEMO_CONFIG], strict + [f"out_dir={tmp_path / 's'}", "model.attn=softmax"]))
    kept = train.main(load_config([DEMO_CONFIG], strict + [f"out_dir={tmp_path / 's1'}", "model.attn=softmax1"]))
    assert kept.state.step == 1
    torch.save(torch.load(ckpt, weights_only=False)["model"], tmp_path / "weights.pth")  # a plain weights file
    caplog.clear()
    with caplog.at_level("WARNING", logger="train"):
        train.main(load_config([DEMO_CONFIG], common + [f"out_dir={tmp_path / 'plain'}", "model.attn=softmax1",
                                                        f"model.pretrained={tmp_path / 'weights.pth'}"]))
    assert "was trained with" not in caplog.text  # it records no attention variant: nothing to compare


def test_a_checkpoint_written_before_model_attn_resumes_as_softmax(debug_config, caplog):
    """Runs written before model.attn existed (907cb62f) trained timm's softmax attention: their checkpoint's config
    lacks the key, and resumes with the default as the same model, with no changed setting; model.attn=softmax1
    there is another model, named as softmax -> softmax1. Refused as 'model.attn: None -> softmax', such a run
    could not resume at all: the fix it gave, its original model settings, has no value to pass."""
    train.main(debug_config("train.max_steps=2", "log.tensorboard=false"))
    path = debug_config().out_dir + "/checkpoint.pt"
    payload = torch.load(path, map_location="cpu", weights_only=True)
    del payload["config"]["model"]["attn"]
    torch.save(payload, path)
    with pytest.raises(CheckpointError, match=r"other settings \(model\.attn: 'softmax' -> 'softmax1'\)"):
        train.main(debug_config("train.max_steps=3", "log.tensorboard=false", "model.attn=softmax1"))
    with caplog.at_level("WARNING"):
        assert train.main(debug_config("train.max_steps=3", "log.tensorboard=false")).state.step == 3
    assert "resuming with changed settings" not in caplog.text


# -- quantization --------------------------------------------------------------------------------------
FAST = {
    "percentile": None,
    "repq": None,
    "aphq": dict(iters=2, recon_images=16, calib_images=16, batch_size=16, matmul_steps=5, search_rounds=1,
                 eq_n=32, search_max_rows=64, log_every=1),
    "gplq": dict(steps=2, batch_size_per_gpu=8, init_images=16, pca_images=16, stage2_images=16, log_every=1,
                 ckpt_every=0),
    "rtn": None,
    "gptq": None,
    "smoothquant": None,
    "smoothquant_strict": None,
}
# the pipelines that leave both attention matmuls float (quant/README.md's scope table): their attention keeps its class
FLOAT_MATMULS = {"rtn", "gptq", "smoothquant"}


def test_the_pipeline_tests_cover_every_pipeline():
    """docs/attention_sinks.md says every quantization pipeline runs on the variants and is tested so."""
    assert set(FAST) == set(PIPELINES)


@pytest.mark.parametrize("pipeline", sorted(FAST))
@pytest.mark.parametrize("build", [tiny_vit, tiny_swin], ids=["vit", "swin"])
@pytest.mark.parametrize("attn_kind", SINKS)
def test_every_pipeline_converts_and_runs_each_variant(attn_kind, build, pipeline):
    model = sink_model(build, attn_kind)
    calib, data, x = images(16), cpu_pipeline_data(16), images(4, seed=5)
    low, high = ("w4a16", "w12a16") if PIPELINES[pipeline].weight_only else ("w4a4", "w12a12")
    qmodel, _ = PIPELINES[pipeline](model, calib, low, FAST[pipeline], data=data)
    float_attn = {n: type(m) for n, m in model.named_modules() if n.endswith(".attn")}
    assert {n: type(m) for n, m in qmodel.named_modules() if n.endswith(".attn")} == \
        {n: t if pipeline in FLOAT_MATMULS else ATTENTION_TYPES[t] for n, t in float_attn.items()}
    with torch.no_grad():
        ref = model(x)
        assert torch.isfinite(qmodel(x)).all()
    if pipeline == "gplq":  # its stage 1 trains the weights, sink parameters included
        return
    sinks = {n: p for n, p in model.named_parameters() if ".sink_" in n}
    assert all(torch.equal(qmodel.get_parameter(n), p) for n, p in sinks.items())
    if pipeline == "aphq":  # its percentile-clipped matmul ranges keep it far from float at any width
        return
    if pipeline != "gptq":  # GPTQ's updates change the float weights it quantizes
        with torch.no_grad(), quant_state(qmodel, weights=False, activations=False):  # after RepQ's fold too
            torch.testing.assert_close(qmodel(x), ref, rtol=0, atol=1e-4)
    qmodel, _ = PIPELINES[pipeline](model, calib, high, FAST[pipeline], data=data)
    with torch.no_grad():
        err = (qmodel(x) - ref).abs().max() / ref.abs().max()
    # 8-bit stem input; RepQ-ViT's log-sqrt2 softmax codes are ~19% apart at any width. Measured: percentile
    # <= 0.024, repq <= 0.066 (the softmax models: 0.020 and 0.038)
    assert err < (0.15 if pipeline == "repq" else 0.05), err


@pytest.mark.parametrize("build", [tiny_vit, tiny_swin], ids=["vit", "swin"])
@pytest.mark.parametrize("attn_kind", ["kv_bias", "attn_bias"])  # softmax1 has no sink parameter
def test_conversion_shares_the_sink_parameters_so_training_the_converted_module_moves_the_sources(
        attn_kind, build):
    """convert_attention keeps the source's parameters, sinks included (quant/README.md, "Attention variants"): the
    converted module holds the float module's own sink Parameters, and an SGD step on the converted module (its
    matmul quantizers off, GPLQ-style training) moves them by -lr times the gradient autograd gives through the
    float module itself. A copy would leave the source's sinks where they were."""
    from quant.attention import convert_attention

    src = next(m for m in sink_model(build, attn_kind).modules() if type(m) in ATTENTION_TYPES)
    src.train()
    n = src.window_size[0] * src.window_size[1] if hasattr(src, "window_size") else 9
    x = torch.randn(2, n, src.qkv.in_features, generator=torch.Generator().manual_seed(3))
    names = src.sink_params
    before = [getattr(src, name).detach().clone() for name in names]
    grads = torch.autograd.grad(src(x).square().sum(), [getattr(src, name) for name in names])
    ours = convert_attention(src, {})
    assert all(getattr(ours, name) is getattr(src, name) for name in names)
    lr = 10.0  # a sink key's gradient is small (one key of a Swin window's 17): a step it visibly takes
    optimizer = torch.optim.SGD(ours.parameters(), lr=lr)
    ours(x).square().sum().backward()
    optimizer.step()
    for name, old, grad in zip(names, before, grads):
        assert (lr * grad).abs().max() > 1e-3, name  # the step really moves the sink
        torch.testing.assert_close(getattr(src, name).detach(), old - lr * grad, rtol=1e-4, atol=1e-6, msg=name)
