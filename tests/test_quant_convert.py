"""quantize_model: FQN rules, the original model untouched, coverage checks, the weight cache,
8-bit closeness."""
import copy

import pytest
import torch
from torch import nn

from quant import PIPELINES, quantize_model
from quant.calibrate import calibrate
from quant.convert import quantized_layers
from quant.layers import QuantConv2d, QuantLinear
from quant.modes import describe, named_quantizers, quant_state, set_quant_state
from configs.quant import PercentileOptions, RepQOptions
from models.modules import fqn_matches
from quant.ranges import RangeSearch
from quant.spec import LinearRule, QuantizerSpec, QuantSpec, parse_bits
from quant_models import images, tiny_swin, tiny_vit


def snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [(n, type(m)) for n, m in model.named_modules()])


def test_fqn_patterns_match_whole_segments():
    assert fqn_matches("blocks.3.attn.qkv", ["blocks.*.attn.qkv"])
    assert not fqn_matches("layers.0.blocks.3.attn.qkv", ["blocks.*.attn.qkv"])
    assert fqn_matches("layers.0.blocks.3.attn.qkv", ["layers.*.blocks.*.attn.qkv"])
    assert fqn_matches("blocks.3", ["blocks.*"]) and not fqn_matches("blocks.3.attn", ["blocks.*"])
    assert fqn_matches("blocks.3.mlp.fc2", ["**.fc[12]"]) and not fqn_matches("head", ["**.fc[12]"])
    assert fqn_matches("head", ["head", "head.fc"]) and fqn_matches("head.fc", ["head", "head.fc"])
    # `**` is any number of segments, none included: a top-level qkv is a module named qkv too
    assert fqn_matches("qkv", ["**.qkv"]) and fqn_matches("blocks.3", ["blocks.*.**"])
    assert not fqn_matches("Blocks.3", ["blocks.*"])  # case-sensitive, as documented


@pytest.mark.parametrize("build", [tiny_vit, tiny_swin])
def test_original_model_is_untouched(build):
    model = build()
    x = images(4)
    with torch.no_grad():
        before_out = model(x)
    before_state, before_types = snapshot(model)
    qmodel, _ = PIPELINES["repq"](model, images(8, seed=3), "w4a4")  # conversion, calibration and LN folds
    with torch.no_grad():
        qmodel(x)
        after_out = model(x)
    after_state, after_types = snapshot(model)
    assert before_types == after_types
    assert before_state.keys() == after_state.keys()
    assert all(torch.equal(before_state[k], after_state[k]) for k in before_state)
    assert torch.equal(before_out, after_out)
    assert not any(p1 is p2 for p1 in model.parameters() for p2 in qmodel.parameters())


@pytest.mark.parametrize("training", [False, True])
def test_every_converted_module_and_quantizer_keeps_the_float_models_mode(training):
    # fresh layers and quantizers are built in training mode: an eval model must not come back partly in
    # training mode (QDrop mixing and dropout follow that flag)
    spec = QuantSpec(linears=(LinearRule(("**",), QuantizerSpec(8), QuantizerSpec(8)),), strict=False)
    qmodel = quantize_model(tiny_vit().train(training), spec)
    assert quantized_layers(qmodel)
    assert {m.training for m in qmodel.modules()} == {training}


def test_converting_a_converted_model_again_wraps_no_layer_twice():
    from quant.convert import convert_in_place

    spec = QuantSpec(linears=(LinearRule(("**",), QuantizerSpec(8), QuantizerSpec(8)),), strict=False)
    qmodel = quantize_model(tiny_vit(), spec)
    before = dict(quantized_layers(qmodel))
    done = convert_in_place(qmodel, spec)
    assert done["linear"] == []
    after = dict(quantized_layers(qmodel))
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)


def test_expected_layers_are_converted():
    vit = PIPELINES["percentile"](tiny_vit(), images(4), "w4a4").model
    names = {n for n, _ in quantized_layers(vit)}
    assert names == {"patch_embed.proj", "head", *(f"blocks.{i}.{s}" for i in range(2)
                     for s in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"))}
    swin = PIPELINES["percentile"](tiny_swin(), images(4), "w4a4").model
    names = {n for n, _ in quantized_layers(swin)}
    assert {"patch_embed.proj", "head.fc", "layers.1.downsample.reduction",
            "layers.1.blocks.1.mlp.fc2"} <= names
    assert not any(isinstance(m, (nn.Linear, nn.Conv2d)) and not isinstance(m, (QuantLinear, QuantConv2d))
                   for m in swin.modules())
    roles = {r["module"]: r["role"] for r in describe(swin)}
    assert roles["layers.1.downsample.reduction"] == "post_norm" and roles["head.fc"] == "head"



def test_every_classifier_head_gets_the_head_bit_widths():
    """DeiT-distilled has two classifiers (head, head_dist): both are "head" layers with the head's own weight
    and input bits, which differ here from each other and from the main w4a4 (hand-listed layers)."""
    import timm

    torch.manual_seed(0)
    deit = timm.create_model("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, embed_dim=48, depth=1,
                             num_heads=3, num_classes=10).eval()
    spec = PIPELINES["percentile"].layout(parse_bits("w4a4"),
                                          PercentileOptions(stem_w_bits=6, stem_a_bits=0, head_w_bits=8, head_a_bits=5))
    qmodel = quantize_model(deit, spec)
    bits = {n: (m.quant_role, m.weight_quantizer and m.weight_quantizer.bits,
                m.input_quantizer and m.input_quantizer.bits) for n, m in quantized_layers(qmodel)}
    blocks = {f"blocks.0.{s}": ("post_norm" if s in ("attn.qkv", "mlp.fc1") else "block", 4, 4)
              for s in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    assert bits == {"patch_embed.proj": ("stem", 6, None), "head": ("head", 8, 5), "head_dist": ("head", 8, 5),
                    **blocks}

def test_strict_spec_names_unmatched_layers():
    model = tiny_vit()
    spec = QuantSpec(linears=(
        LinearRule(("blocks.*.attn.qkv",), QuantizerSpec(8, granularity="channel"), None),))
    with pytest.raises(ValueError, match="blocks.0.mlp.fc1"):
        quantize_model(model, spec)
    loose = QuantSpec(linears=spec.linears, keep_float=("**",))
    qmodel = quantize_model(model, loose)
    assert isinstance(qmodel.blocks[0].attn.qkv, QuantLinear) and type(qmodel.blocks[0].mlp.fc1) is nn.Linear



def test_the_first_matching_rule_wins():
    """Rules are tried in order: a specific rule placed before a catch-all decides its layers."""
    spec = QuantSpec(linears=(LinearRule(("blocks.*.attn.qkv",), QuantizerSpec(8), None, role="first"),
                              LinearRule(("**",), QuantizerSpec(3), None, role="rest")))
    qmodel = quantize_model(tiny_vit(depth=1), spec)
    got = {n: (m.quant_role, m.weight_quantizer.bits) for n, m in quantized_layers(qmodel)}
    assert got == {"blocks.0.attn.qkv": ("first", 8), "patch_embed.proj": ("rest", 3), "head": ("rest", 3),
                   **{f"blocks.0.{s}": ("rest", 3) for s in ("attn.proj", "mlp.fc1", "mlp.fc2")}}

def test_granularity_resolution():
    w = QuantizerSpec(4, granularity="channel")
    a = QuantizerSpec(4, granularity="channel")
    qmodel = quantize_model(tiny_vit(), QuantSpec(linears=(LinearRule(("**",), w, a),)))
    qkv = qmodel.blocks[0].attn.qkv
    assert qkv.weight_quantizer.channel_dim == 0 and qkv.weight_quantizer.scale.shape == (144,)
    assert qkv.input_quantizer.channel_dim == -1 and qkv.input_quantizer.scale.shape == (48,)
    stem = qmodel.patch_embed.proj
    assert stem.input_quantizer.channel_dim == 1 and stem.input_quantizer.scale.shape == (3,)
    # sized at conversion (a learnable scale cannot be resized later): one per output channel of the 3->48 conv
    assert stem.weight_quantizer.channel_dim == 0 and stem.weight_quantizer.scale.shape == (48,)
    with pytest.raises(ValueError, match="granularity"):
        quantize_model(tiny_vit(),
                       QuantSpec(linears=(LinearRule(("**",), QuantizerSpec(4, granularity="head"), None),)))



def test_a_wrapped_conv_keeps_the_float_conv_geometry():
    """QuantConv2d.from_float with no quantizers is the float conv (stride, padding, dilation, groups, padding
    mode all carried over), shares its parameters and keeps its mode. Reference: the nn.Conv2d itself."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2, padding_mode="reflect").train()
    wrapped = QuantConv2d.from_float(conv, None, None)
    x = torch.randn(2, 4, 9, 9)
    assert wrapped.weight is conv.weight and wrapped.bias is conv.bias and wrapped.training
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), conv(x), rtol=0, atol=0)

def test_weight_cache_follows_in_place_weight_edits():
    qmodel, _ = PIPELINES["percentile"](tiny_vit(), images(8), "w4a4")
    fc1 = qmodel.blocks[0].mlp.fc1
    x = torch.randn(3, 17, 48)
    with torch.no_grad():
        fc1(x)
        cached = fc1._wq_cache
        assert cached is not None
        fc1(x)
        assert fc1._wq_cache is cached  # reused, not recomputed
        fc1.weight.mul_(2.0)  # e.g. a LayerNorm fold
        out = fc1(x)
        want = nn.functional.linear(fc1.input_quantizer(x), fc1.weight_quantizer(fc1.weight), fc1.bias)
        torch.testing.assert_close(out, want)
        fc1.weight_quantizer.scale.mul_(1.5)  # a quantizer parameter update
        want = nn.functional.linear(fc1.input_quantizer(x), fc1.weight_quantizer(fc1.weight), fc1.bias)
        torch.testing.assert_close(fc1(x), want)


def _hand_quantized_weight(layer):
    """The layer's current weight fake-quantized by hand, in its own dtype (UniformQuantizer's map)."""
    q, w = layer.weight_quantizer, layer.weight.detach()
    s = q.scale.detach().to(w.dtype).view(-1, *[1] * (w.ndim - 1))
    z = q.zero_point.detach().to(w.dtype).view_as(s)
    return (torch.clamp(torch.round(w / s) + z, q.qmin, q.qmax) - z) * s


@pytest.mark.parametrize("name", ["blocks.0.mlp.fc1", "patch_embed.proj"])
def test_weight_cache_follows_dtype_round_trips_and_state_dict_loads(name):
    """float32 -> float64 -> float32 (-> float16 -> float32), with the weights edited in each dtype, and a
    state dict loaded in place or by assignment, and a meta round trip: each forward uses the current weight's
    quantization in its dtype, never a cached copy of another dtype or of older values."""
    qmodel, _ = PIPELINES["percentile"](tiny_vit(), images(8), "w4a4")
    layer = qmodel.get_submodule(name)
    assert layer.weight_quantizer.channel_dim == 0  # per output channel: scale viewed as [C, 1, ...]

    def check():
        with torch.no_grad():
            got = layer.quantized_weight()
        assert got.dtype == layer.weight.dtype
        torch.testing.assert_close(got, _hand_quantized_weight(layer), rtol=0, atol=0)

    def edited_state(factor):
        return {k: v * factor if k == f"{name}.weight" else v for k, v in qmodel.state_dict().items()}

    check()
    for convert, factor in [(nn.Module.double, 1.7), (nn.Module.float, 0.5), (nn.Module.half, 1.25),
                            (nn.Module.float, 0.8)]:
        convert(qmodel)
        check()
        with torch.no_grad():
            layer.weight.mul_(factor)
        check()
    qmodel.load_state_dict(edited_state(1.3))
    check()
    qmodel.load_state_dict(edited_state(0.9), assign=True)
    check()
    state = edited_state(1.1)
    qmodel.to("meta").to_empty(device="cpu").load_state_dict(state)
    check()


def test_weight_cache_follows_an_optimizer_step_on_a_learnable_scale():
    """A scale made learnable (APHQ/GPLQ: a Parameter, not a buffer) and moved by an optimizer step, then read
    in inference: the forward quantizes with the new scale, as by hand, not the cached weight of the old one."""
    qmodel, _ = PIPELINES["percentile"](tiny_vit(), images(8), "w4a4")
    fc1 = qmodel.blocks[0].mlp.fc1
    fc1.weight.requires_grad_(False)
    fc1.weight_quantizer.make_learnable(scale=True)
    assert isinstance(fc1.weight_quantizer.scale, nn.Parameter)
    with torch.no_grad():
        fc1.quantized_weight()  # cached under the old scale
    optimizer = torch.optim.SGD([fc1.weight_quantizer.scale], lr=0.1)
    fc1.weight_quantizer.scale.grad = -fc1.weight_quantizer.scale.detach()  # the step scales it by 1.1
    optimizer.step()
    with torch.no_grad():
        torch.testing.assert_close(fc1.quantized_weight(), _hand_quantized_weight(fc1), rtol=0, atol=0)


def test_weight_cache_is_not_taken_for_a_new_weight_at_the_old_ones_address():
    """A Parameter put in the old one's place can have its storage at the old (freed) address and the same
    version 0 (the CPU and CUDA allocators reuse freed blocks of the size): here made deterministic by two
    tensors over one numpy buffer, rewritten in between."""
    qmodel, _ = PIPELINES["percentile"](tiny_vit(), images(8), "w4a4")
    fc1 = qmodel.blocks[0].mlp.fc1
    buffer = fc1.weight.detach().numpy().copy()
    fc1.weight = nn.Parameter(torch.from_numpy(buffer))
    with torch.no_grad():
        fc1.quantized_weight()
    buffer *= 3.0  # the new weight's values, written where the old one lay
    fc1.weight = nn.Parameter(torch.from_numpy(buffer))
    with torch.no_grad():
        torch.testing.assert_close(fc1.quantized_weight(), _hand_quantized_weight(fc1), rtol=0, atol=0)


def test_weight_cache_follows_in_place_edits_of_inference_tensors():
    """A model made and edited under torch.inference_mode: its inference tensors have no version counter, so an
    in-place edit (a fold) leaves the old key; the forward still uses the edited weight."""
    qmodel, _ = PIPELINES["percentile"](tiny_vit(), images(8), "w4a4")
    fc1 = qmodel.blocks[0].mlp.fc1
    with torch.inference_mode():
        fc1.weight = nn.Parameter(fc1.weight.detach().clone())
        assert fc1.weight.is_inference()
        fc1.quantized_weight()
        fc1.weight.mul_(2.0)
        torch.testing.assert_close(fc1.quantized_weight(), _hand_quantized_weight(fc1), rtol=0, atol=0)


def test_a_pickled_layer_leaves_its_weight_cache_behind():
    """run_on_main pickles quantized models for the other ranks: the cached fake-quantized weight (a
    second copy of every weight, keyed by this process's tensor addresses) must not travel with them."""
    import io

    qmodel, _ = PIPELINES["percentile"](tiny_vit(), images(8), "w4a4")
    fc1 = qmodel.blocks[0].mlp.fc1

    def pickled(layer) -> bytes:
        buffer = io.BytesIO()
        torch.save(layer, buffer)
        return buffer.getvalue()

    before = len(pickled(fc1))
    with torch.no_grad():
        fc1(torch.randn(2, 17, 48))
    assert fc1._wq_cache is not None
    assert len(pickled(fc1)) == before  # a 192x48 cache would add ~36 kB
    copy = torch.load(io.BytesIO(pickled(fc1)), weights_only=False)
    assert copy._wq_cache is None and fc1._wq_cache is not None  # the original keeps its cache
    x = torch.randn(2, 17, 48)
    with torch.no_grad():
        torch.testing.assert_close(copy(x), fc1(x))


def test_gradients_flow_with_grad_enabled():
    qmodel, _ = PIPELINES["percentile"](tiny_vit(), images(8), "w4a4")
    qmodel(images(2)).sum().backward()
    assert qmodel.blocks[0].mlp.fc1.weight.grad is not None


@pytest.mark.parametrize("build", [tiny_vit, tiny_swin])
def test_state_dict_round_trip_of_a_calibrated_model(build):
    fp = build()
    qmodel, _ = PIPELINES["repq"](fp, images(8), "w4a4")
    x = images(3, seed=9)
    # target 1: a copy whose every parameter and quantizer buffer is overwritten and whose quantizers
    # are uncalibrated and per channel again, so all that matches afterwards came from the state dict
    scrambled = copy.deepcopy(qmodel)
    with torch.no_grad():
        for t in scrambled.state_dict().values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.fill_(0.5)
    for _, q in named_quantizers(scrambled):
        q.reset()
        if getattr(q, "channel_dim", 0) is None:
            q.channel_dim = -1
    targets = [scrambled]
    if build is tiny_vit:  # target 2: a fresh conversion with lazily sized (empty) per-channel groups
        # (not for Swin: its fold creates a bias on the bias-free PatchMerging reduction)
        targets.append(quantize_model(fp, PIPELINES["repq"].layout(parse_bits("w4a4"), RepQOptions())))
    with torch.no_grad():
        expected = qmodel(x)
        for target in targets:
            state = qmodel.state_dict()
            assert any(not torch.equal(t, state[k]) for k, t in target.state_dict().items()
                       if k.endswith("qkv.weight"))  # folded (or scrambled) weights differ before loading
            target.load_state_dict(qmodel.state_dict())
            for name, q in named_quantizers(target):
                assert q.calibrated, name
            torch.testing.assert_close(target(x), expected, rtol=0, atol=0)


def test_uncalibrated_model_refuses_to_run():
    qmodel = quantize_model(tiny_vit(),
                            QuantSpec(linears=(LinearRule(("**",), QuantizerSpec(8), QuantizerSpec(8)),)))
    with pytest.raises(RuntimeError, match="before calibration"):
        qmodel(images(2))
    calibrate(qmodel, [images(2), (images(2, seed=4), torch.zeros(2))])  # iterable of batches / pairs
    qmodel(images(2))



def test_calibration_pools_every_batch_in_eval_mode_and_restores_the_mode():
    """One fit over ALL calibration batches, with dropout off; a model handed over in train mode stays in it.
    Reference: the closed-form 8-bit min/max grid of the pooled inputs, scale = (max - min) / 255."""
    from quant.ranges import RangeSearch

    minmax = QuantizerSpec(8, search=RangeSearch("minmax"))
    model = quantize_model(nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 3)),
                           QuantSpec(linears=(LinearRule(("1",), None, minmax),)))
    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(5, 4, generator=g), 3.0 + 4.0 * torch.rand(2, 4, generator=g)  # new max
    second[0, 0] = -7.0  # and a new min, both in the last batch
    model.train()
    out = calibrate(model, [first, (second, torch.zeros(2))])
    assert out["images"] == 7 and model.training and model[0].training and model[1].training
    pooled = torch.cat([first, second])
    lo, hi = pooled.min(), pooled.max()
    scale = (hi - lo) / 255
    q = model[1].input_quantizer
    torch.testing.assert_close(q.scale, scale.reshape(1))
    torch.testing.assert_close(q.zero_point, torch.round(-lo / scale).reshape(1))



def test_calibration_fits_the_enabled_quantizers_only():
    """Bypassed quantizers are neither fitted nor required: with weights off, the 6 layer inputs of a one-block
    ViT (patch_embed.proj, qkv, proj, fc1, fc2, head) are fitted and the 6 weight quantizers stay unfitted."""
    both = QuantizerSpec(8)
    qmodel = quantize_model(tiny_vit(depth=1), QuantSpec(linears=(LinearRule(("**",), both, both),)))
    with quant_state(qmodel, weights=False):
        out = calibrate(qmodel, images(2))
    assert out["quantizers"] == 6
    assert [q.calibrated for _, q in named_quantizers(qmodel, "activation")] == [True] * 6
    assert [q.calibrated for _, q in named_quantizers(qmodel, "weight")] == [False] * 6


def test_a_quantizer_left_out_of_calibration_is_refused_at_its_first_use_afterwards():
    """calibrate ends calibration mode: a quantizer bypassed during calibration and switched on later has no range
    and must say so at its first input, not fit itself silently on that input (an evaluation batch)."""
    both = QuantizerSpec(8)
    qmodel = quantize_model(tiny_vit(depth=1), QuantSpec(linears=(LinearRule(("**",), both, both),)))
    with quant_state(qmodel, weights=False):
        calibrate(qmodel, images(2))
    assert not any(q.calibrating for _, q in named_quantizers(qmodel))
    with pytest.raises(RuntimeError, match="used before calibration"):
        qmodel(images(2, seed=3))
    assert [q.calibrated for _, q in named_quantizers(qmodel, "weight")] == [False] * 6


def test_every_quantizer_is_named_by_its_module_path():
    """Error messages and warnings (an uncalibrated quantizer, the fold's zero-point warning) name a quantizer by
    its `name`: it must be the FQN under which the model holds it."""
    both = QuantizerSpec(8)
    qmodel = quantize_model(tiny_vit(depth=1), QuantSpec(linears=(LinearRule(("**",), both, both),)))
    names = {fqn: q.name for fqn, q in qmodel.named_modules() if fqn.endswith(("weight_quantizer", "input_quantizer"))}
    assert len(names) == 12 and all(fqn == name for fqn, name in names.items()), names


def test_named_quantizers_refuses_an_unknown_kind():
    # "weights" is not "weight": answering with the activation quantizers would switch the wrong ones
    qmodel = quantize_model(tiny_vit(depth=1), QuantSpec(linears=(LinearRule(("**",), QuantizerSpec(8), None),)))
    assert len(list(named_quantizers(qmodel, "weight"))) == 6
    with pytest.raises(ValueError, match=r"kind must be all\|weight\|activation, got 'weights'"):
        list(named_quantizers(qmodel, "weights"))


def test_quant_state_restores_each_quantizers_own_flag():
    """Inside the block: weights bypassed, activations on; afterwards every quantizer has its own earlier flag
    back, including one that was already bypassed before."""
    both = QuantizerSpec(8)
    qmodel = quantize_model(tiny_vit(depth=1), QuantSpec(linears=(LinearRule(("**",), both, both),)))
    qmodel.head.input_quantizer.enabled = False
    before = {n: q.enabled for n, q in named_quantizers(qmodel)}
    with quant_state(qmodel, weights=False, activations=True):
        assert all(q.enabled == (not n.endswith("weight_quantizer")) for n, q in named_quantizers(qmodel))
    assert {n: q.enabled for n, q in named_quantizers(qmodel)} == before and not before["head.input_quantizer"]

def test_static_ranges_from_the_float_model_cover_every_batch():
    """calibrate_from_float: each activation quantizer takes the min / max of its input over ALL batches of
    the FLOAT model (weights not quantized), then freezes. Reference: the float layers run by hand."""
    from quant.calibrate import calibrate_from_float
    from quant.ranges import RangeSearch

    torch.manual_seed(0)
    fp = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    minmax = QuantizerSpec(8, search=RangeSearch("minmax"))
    qmodel = quantize_model(fp, QuantSpec(linears=(LinearRule(("**",), QuantizerSpec(2), minmax),)))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    x[0, 1], x[7, 2] = -12.0, 9.0  # the minimum (largest |x|) in the first batch of 3, the maximum in the last
    out = calibrate_from_float(qmodel, x, batch_size=3)
    assert out["images"] == 8 and out["quantizers"] == 2
    with torch.no_grad():
        seen = {"0": x, "2": torch.relu(x @ fp[0].weight.T + fp[0].bias)}
    for name, inputs in seen.items():
        q = qmodel.get_submodule(name).input_quantizer
        lo, hi = inputs.min(), inputs.max()
        assert q.calibrated
        torch.testing.assert_close(q.scale, ((hi - lo) / 255).reshape(1), msg=name)
        torch.testing.assert_close(q.zero_point, torch.round(-lo * 255 / (hi - lo)).reshape(1), msg=name)


def test_static_calibration_fits_the_enabled_quantizers_only():
    """calibrate_from_float, like calibrate, neither fits nor vets a bypassed quantizer: here a percentile-search
    one (a range rule the static calibration refuses) that is switched off stays unfitted and is no error."""
    from quant.calibrate import calibrate_from_float
    from quant.ranges import RangeSearch

    minmax = QuantizerSpec(8, search=RangeSearch("minmax"))
    rules = (LinearRule(("0",), None, minmax), LinearRule(("2",), None, QuantizerSpec(8)))
    qmodel = quantize_model(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)), QuantSpec(linears=rules))
    qmodel[2].input_quantizer.enabled = False
    out = calibrate_from_float(qmodel, torch.randn(5, 4), batch_size=2)
    assert out["quantizers"] == 1
    assert qmodel[0].input_quantizer.calibrated and not qmodel[2].input_quantizer.calibrated


def test_static_calibration_runs_in_eval_mode_and_restores_the_mode():
    """A model in train mode: the static ranges are those of the eval-mode float model (dropout off), by hand."""
    from quant.calibrate import calibrate_from_float
    from quant.ranges import RangeSearch

    torch.manual_seed(0)
    fp = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Linear(6, 3))
    minmax = QuantizerSpec(8, search=RangeSearch("minmax"))
    qmodel = quantize_model(fp, QuantSpec(linears=(LinearRule(("2",), None, minmax),), strict=False)).train()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    calibrate_from_float(qmodel, x, batch_size=3)
    assert qmodel.training and qmodel[1].training
    with torch.no_grad():
        seen = x @ fp[0].weight.T + fp[0].bias
    q = qmodel[2].input_quantizer
    torch.testing.assert_close(q.scale, ((seen.max() - seen.min()) / 255).reshape(1))

@pytest.mark.parametrize("build", [tiny_vit, tiny_swin])
@pytest.mark.parametrize("pipeline", ["percentile", "repq"])
def test_w8a8_stays_close_to_float(build, pipeline):
    model = build()
    x = images(64, seed=5)
    qmodel, _ = PIPELINES[pipeline](model, images(32, seed=6), "w8a8")
    with torch.no_grad():
        ref, out = model(x), qmodel(x)
        assert nn.functional.cosine_similarity(out, ref).min() > 0.99
        assert (out.argmax(1) == ref.argmax(1)).float().mean() >= 0.9
        set_quant_state(qmodel, weights=False, activations=False)
        torch.testing.assert_close(qmodel(x), ref, rtol=0, atol=1e-4)  # folds keep the float function


def test_calibration_on_another_device_than_the_models_is_refused_before_anything_runs():
    """`device` names where calibration runs; it moves the inputs there, never the model, so a device the model is
    not on is refused with both named (it failed inside the forward). A device of the model's own type without an
    index is the model's."""
    minmax = QuantizerSpec(8)
    model = quantize_model(nn.Sequential(nn.Linear(4, 3)), QuantSpec(linears=(LinearRule(("0",), None, minmax),)))
    with pytest.raises(ValueError, match=r"device=meta but the model is on cpu.*move the model first"):
        calibrate(model, torch.randn(5, 4), device="meta")
    assert not model[0].input_quantizer.calibrated
    assert calibrate(model, torch.randn(5, 4), device=torch.device("cpu"))["quantizers"] == 1


@pytest.mark.parametrize("inputs", [torch.empty(0, 4), [torch.empty(0, 4)], [(torch.empty(0, 4), torch.zeros(0))]])
def test_an_empty_calibration_set_is_refused_before_any_quantizer_fits(inputs):
    """It failed inside a quantizer's fit (an IndexError of amin over no rows), for both calibrations."""
    from quant.calibrate import calibrate_from_float
    from quant.ranges import RangeSearch

    minmax = QuantizerSpec(8, search=RangeSearch("minmax"))
    model = quantize_model(nn.Sequential(nn.Linear(4, 3)), QuantSpec(linears=(LinearRule(("0",), None, minmax),)))
    with pytest.raises(ValueError, match=r"no calibration inputs: got a tensor of shape \(0, 4\)"):
        calibrate(model, inputs)
    with pytest.raises(ValueError, match=r"no calibration inputs: got a tensor of shape \(0, 4\)"):
        calibrate_from_float(model, inputs, batch_size=2)
    assert not model[0].input_quantizer.calibrated


@pytest.mark.parametrize("inputs", [[], iter(())], ids=["empty-list", "exhausted-iterator"])
def test_an_iterable_of_no_batches_is_refused_by_name(inputs):
    """No batch at all (an empty loader) is the same user error as a batch of no rows: one ValueError naming it,
    not torch.cat's 'expected a non-empty list of Tensors' from inside the calibration."""
    from quant.calibrate import stack_images

    with pytest.raises(ValueError, match="^no calibration inputs$"):
        stack_images(inputs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_calibration_that_fits_non_finite_ranges_is_refused(bad):
    """A NaN / inf calibration input fitted a NaN range without a word, and every output of the quantized model
    was NaN; the closed-form min/max fit of the same finite inputs is what a finite set gives."""
    from quant.ranges import RangeSearch

    minmax = QuantizerSpec(8, search=RangeSearch("minmax"))
    spec = QuantSpec(linears=(LinearRule(("0",), None, minmax),))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    model = quantize_model(nn.Sequential(nn.Linear(4, 3)), spec)
    poisoned = x.clone()
    poisoned[2, 1] = bad
    with pytest.raises(RuntimeError, match=r"1 quantizers fitted non-finite parameters .*\['0.input_quantizer'\]"):
        calibrate(model, poisoned)
    model = quantize_model(nn.Sequential(nn.Linear(4, 3)), spec)
    calibrate(model, x)
    torch.testing.assert_close(model[0].input_quantizer.scale, ((x.max() - x.min()) / 255).reshape(1))


def test_calibration_on_another_index_of_the_models_device_type_is_refused():
    """Same type, other index (cuda:1 for a model on cuda:0) is another device: refused, not run on the model's
    device instead. A CPU model stands in for the GPU case here: its device has no index, so cpu:1 differs."""
    minmax = QuantizerSpec(8)
    model = quantize_model(nn.Sequential(nn.Linear(4, 3)), QuantSpec(linears=(LinearRule(("0",), None, minmax),)))
    with pytest.raises(ValueError, match=r"device=cpu:1 but the model is on cpu"):
        calibrate(model, torch.randn(5, 4), device="cpu:1")
    assert not model[0].input_quantizer.calibrated


def test_calibration_refuses_a_quantizer_off_the_forward_path():
    """A quantized layer the forward never calls keeps no range: named, instead of failing at evaluation."""
    class TwoPaths(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x):
            return self.used(x)

    spec = QuantSpec(linears=(LinearRule(("**",), None, QuantizerSpec(8)),))
    model = quantize_model(TwoPaths(), spec)
    with pytest.raises(RuntimeError, match=r"1 quantizers saw no calibration data: \['unused.input_quantizer'\]"):
        calibrate(model, torch.randn(5, 4))


def test_static_calibration_refuses_a_range_rule_it_would_not_apply():
    """calibrate_from_float takes min / max only: a percentile-MSE quantizer is refused, not fitted min / max."""
    from quant.calibrate import calibrate_from_float

    model = quantize_model(nn.Sequential(nn.Linear(4, 3)), QuantSpec(linears=(LinearRule(("0",), None,
                                                                                          QuantizerSpec(8)),)))
    with pytest.raises(ValueError, match=r"fits min/max UniformQuantizers only, not: \['0.input_quantizer'\]"):
        calibrate_from_float(model, torch.randn(5, 4), batch_size=2)
    assert not model[0].input_quantizer.calibrated


def test_convert_in_place_reports_every_layer_it_left_float():
    """Without strict, a layer that matches no rule stays float and is reported as float beside those kept float
    on purpose: the returned lists together name every Linear of the model once."""
    from quant.convert import convert_in_place

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    spec = QuantSpec(linears=(LinearRule(("0",), QuantizerSpec(8), None),), keep_float=("2",), strict=False)
    done = convert_in_place(model, spec)
    assert done["attention"] == [] and done["linear"] == ["0"] and sorted(done["float"]) == ["1", "2"]
    assert isinstance(model[0], QuantLinear) and type(model[1]) is nn.Linear and type(model[2]) is nn.Linear


class _Doubling(nn.Linear):
    """A Linear subclass with a forward of its own (a stand-in for a weight-standardised or scaled layer)."""

    def forward(self, x):
        return 2 * super().forward(x)


class _StandardisedConv(nn.Conv2d):
    """Weight standardisation through _conv_forward, as a subclass may do it without touching forward."""

    def _conv_forward(self, x, weight, bias):
        weight = (weight - weight.mean(dim=(1, 2, 3), keepdim=True)) / weight.std(dim=(1, 2, 3), keepdim=True)
        return super()._conv_forward(x, weight, bias)


class _Plain(nn.Linear):
    """A subclass that computes nn.Linear's forward (only a name of its own)."""


@pytest.mark.parametrize("layer", [_Doubling(4, 3), _StandardisedConv(4, 3, 1), "parametrized"],
                         ids=["forward", "conv_forward", "parametrized"])
def test_a_subclass_with_a_computation_of_its_own_is_refused_by_name_not_silently_changed(layer):
    """A rule matching an nn.Linear / nn.Conv2d subclass whose forward differs is one ValueError naming the layer and
    its class: a QuantLinear / QuantConv2d would run the plain layer's forward (reference: the float model's own
    output, which a quantizer-free conversion would have to keep). Left out of the rules, it stays float."""
    torch.manual_seed(0)
    if layer == "parametrized":
        layer = nn.Linear(4, 3)
        torch.nn.utils.parametrize.register_parametrization(layer, "weight", _Halve())
    model = nn.Sequential(nn.Identity(), layer)
    x = torch.randn(2, 4, 5, 5) if isinstance(layer, nn.Conv2d) else torch.randn(5, 4)
    with pytest.raises(ValueError, match=rf"^1 is a .*{type(layer).__name__}, a subclass of nn\.(Linear|Conv2d) "):
        quantize_model(model, QuantSpec(linears=(LinearRule(("**",), None, None),)))
    kept = quantize_model(model, QuantSpec(linears=(LinearRule(("0",), None, None),), keep_float=("1",)))
    with torch.no_grad():
        torch.testing.assert_close(kept(x), model(x), rtol=0, atol=0)


def test_the_out_projection_of_torchs_multihead_attention_is_refused_not_reported_quantized():
    """nn.MultiheadAttention computes with out_proj.weight itself (F.multi_head_attention_forward) and never calls
    out_proj: a QuantLinear there would never quantize anything (a weight-only refit, as RTN's, reported it quantized;
    a calibration forward found its quantizer unused, after the conversion). Refused at the conversion, by name."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"mha": nn.MultiheadAttention(8, 2, batch_first=True)}).eval()
    with pytest.raises(ValueError, match=r"^mha\.out_proj is a torch\..*NonDynamicallyQuantizableLinear.* reads "
                                         r"directly"):
        quantize_model(model, QuantSpec(linears=(LinearRule(("**",), QuantizerSpec(2), None),)))


class _Halve(nn.Module):
    def forward(self, w):
        return w / 2


def test_a_subclass_computing_the_plain_forward_converts_as_the_plain_layer():
    """A subclass without a computation of its own (and mmcv's wrappers, whose forward is the base's on this torch,
    in MMDetection's heads) converts; without quantizers it is the float layer, bit for bit."""
    torch.manual_seed(0)
    layers = [_Plain(4, 3)]
    wrappers = pytest.importorskip("mmcv.cnn.bricks.wrappers")
    layers += [wrappers.Linear(4, 3)]
    for layer in layers:
        model = nn.Sequential(layer)
        qmodel = quantize_model(model, QuantSpec(linears=(LinearRule(("**",), None, None),)))
        assert isinstance(qmodel[0], QuantLinear)
        x = torch.randn(5, 4)
        with torch.no_grad():
            torch.testing.assert_close(qmodel(x), model(x), rtol=0, atol=0)
    conv = wrappers.Conv2d(4, 3, 3, padding=1)
    qconv = quantize_model(nn.Sequential(conv), QuantSpec(linears=(LinearRule(("**",), None, None),)))[0]
    x = torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        assert isinstance(qconv, QuantConv2d)
        torch.testing.assert_close(qconv(x), conv(x), rtol=0, atol=0)


def test_a_layer_held_at_two_paths_is_converted_at_both_or_refused():
    """One Linear at two paths (weight sharing): named_modules lists it once, so the second path kept the float layer
    the rule asked to quantize. Both paths now hold one QuantLinear; reference: the float model with the weight
    rounded naively (per output channel, min/max, 4 bits) at both uses. Rules that differ between the paths are
    refused naming both."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    spec = QuantSpec(linears=(LinearRule(("**",), QuantizerSpec(4, granularity="channel",
                                                                search=RangeSearch("minmax")), None),))
    qmodel = quantize_model(model, spec)
    assert isinstance(qmodel[0], QuantLinear) and qmodel[2] is qmodel[0]
    calibrate(qmodel, torch.randn(3, 4))
    w = shared.weight.detach()
    lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    step = (hi - lo) / 15
    zero = torch.round(-lo / step)
    wq = (torch.clamp(torch.round(w / step) + zero, 0, 15) - zero) * step
    x = torch.randn(5, 4)
    with torch.no_grad():
        want = torch.relu(x @ wq.T + shared.bias) @ wq.T + shared.bias
        torch.testing.assert_close(qmodel(x), want, rtol=0, atol=1e-6)
    mixed = QuantSpec(linears=(LinearRule(("0",), QuantizerSpec(4, granularity="channel"), None),), keep_float=("2",))
    with pytest.raises(ValueError, match="^0 and 2 are one module .* held at two paths"):
        quantize_model(model, mixed)


def test_describe_and_summarize_name_each_quantizer_once_as_it_runs():
    """describe: a Linear input quantized per channel (its last dim) reads "per-channel", a bypassed one "float";
    summarize: one entry per distinct description, in first-seen order (the report's summary)."""
    from quant.modes import summarize
    spec = QuantSpec(linears=(LinearRule(("blocks.*.mlp.fc1", "head"), QuantizerSpec(4, symmetric=True,
                                                                                         granularity="channel"),
                                         QuantizerSpec(8, granularity="channel"), role="probe"),), strict=False)
    qmodel = quantize_model(tiny_vit(depth=2), spec)
    qmodel.head.input_quantizer.enabled = False
    rows = describe(qmodel)
    inputs = {r["module"]: r["input"] for r in rows}
    assert inputs == {"blocks.0.mlp.fc1": "8b asym per-channel (percentile_mse)",
                      "blocks.1.mlp.fc1": "8b asym per-channel (percentile_mse)", "head": "float"}
    assert summarize(rows) == {"probe": {"weight": "4b sym per-channel (percentile_mse)",
                                         "input": "8b asym per-channel (percentile_mse) | float"}}


def test_standard_layout_gives_each_role_its_own_quantizer():
    """Every role of quant.layout.standard_layout with its own bit-width, checked quantizer by quantizer (by hand):
    the stem and head copy the weight / block-input quantizers with their own bits (None: float), the post-norm
    inputs (qkv, fc1), the block inputs (proj, fc2) and q, k, attn, v keep theirs, and a detector's neck and heads
    take the weight / block-input quantizers."""
    from quant.layout import standard_layout
    spec = standard_layout(weight=QuantizerSpec(4, granularity="channel"), post_norm_input=QuantizerSpec(5),
                           block_input=QuantizerSpec(6), q=QuantizerSpec(7), k=QuantizerSpec(8), attn=QuantizerSpec(9),
                           v=QuantizerSpec(10), first_last={"stem": {"w": 2, "a": None}, "head": {"w": 11, "a": 12}})
    vit = {name: q.bits for name, q in named_quantizers(quantize_model(tiny_vit(depth=1), spec))}
    want = {"patch_embed.proj.weight_quantizer": 2, "head.weight_quantizer": 11, "head.input_quantizer": 12,
            "blocks.0.attn.q_quant": 7, "blocks.0.attn.k_quant": 8, "blocks.0.attn.attn_quant": 9,
            "blocks.0.attn.v_quant": 10}
    for layer, input_bits in (("attn.qkv", 5), ("mlp.fc1", 5), ("attn.proj", 6), ("mlp.fc2", 6)):
        want.update({f"blocks.0.{layer}.weight_quantizer": 4, f"blocks.0.{layer}.input_quantizer": input_bits})
    assert vit == want
    detector = nn.Module()
    detector.neck, detector.rpn_head = nn.Conv2d(3, 4, 1), nn.Sequential(nn.Conv2d(4, 4, 1))
    heads = {name: q.bits for name, q in named_quantizers(quantize_model(detector, spec))}
    assert heads == {"neck.weight_quantizer": 4, "neck.input_quantizer": 6, "rpn_head.0.weight_quantizer": 4,
                     "rpn_head.0.input_quantizer": 6}


def test_in_block_layout_quantizes_the_block_linears_only():
    """quant.layout.in_block_layout on a Swin (by hand): qkv and fc1 take the post-norm input quantizer, proj and
    fc2 the block one, the attention rule its operands; the patch embedding, the PatchMerging reduction and the
    head stay float (no quantizer), and a rule without an attention leaves the matmuls float."""
    from quant.attention import QuantAttentionBase
    from quant.layout import in_block_layout
    from quant.spec import ATTENTION, AttentionRule
    rule = AttentionRule(ATTENTION, q=QuantizerSpec(7), k=QuantizerSpec(7), attn=QuantizerSpec(7), v=QuantizerSpec(7))
    spec = in_block_layout(weight=QuantizerSpec(4, granularity="channel"), post_norm_input=QuantizerSpec(5),
                           block_input=QuantizerSpec(6), attention=rule)
    bits = {name: q.bits for name, q in named_quantizers(quantize_model(tiny_swin(), spec))}
    want = {}
    for block in ("layers.0.blocks.0", "layers.0.blocks.1", "layers.1.blocks.0", "layers.1.blocks.1"):
        for layer, input_bits in (("attn.qkv", 5), ("mlp.fc1", 5), ("attn.proj", 6), ("mlp.fc2", 6)):
            want.update({f"{block}.{layer}.weight_quantizer": 4, f"{block}.{layer}.input_quantizer": input_bits})
        want.update({f"{block}.attn.{operand}_quant": 7 for operand in ("q", "k", "attn", "v")})
    assert bits == want
    plain = quantize_model(tiny_swin(), in_block_layout(weight=QuantizerSpec(4), post_norm_input=None,
                                                        block_input=None))
    assert not any(isinstance(m, QuantAttentionBase) for m in plain.modules())
    assert {name for name, _ in named_quantizers(plain)} == {n for n in want if n.endswith("weight_quantizer")}


def test_a_layer_with_hooks_is_refused_by_path_not_replaced_by_a_layer_without_them():
    """Hooks live on the module object: the QuantLinear / quantized attention put in its place ran without them, so
    cd.noise's WeightNoise (hooks on every Linear), a user's hook or torch's hook-based weight_norm silently stopped
    acting. Each is one ValueError naming the path and the hook; the same layer left float converts (its hooks stay)."""
    from cd.noise import WeightNoise
    torch.manual_seed(0)
    spec = QuantSpec(linears=(LinearRule(("**",), QuantizerSpec(4), None),))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    noise = WeightNoise(model, bits=4, seed=0)
    with pytest.raises(ValueError, match=r"^0 \(Linear\) has forward pre-hook WeightNoise\._swap_in, forward hook "
                                         r"WeightNoise\._swap_out registered on it"):
        quantize_model(model, spec)
    noise.remove()
    assert isinstance(quantize_model(model, spec)[0], QuantLinear)

    seen = []
    model[2].register_forward_hook(lambda m, args, out: seen.append(out))
    with pytest.raises(ValueError, match=r"^2 \(Linear\) has forward hook .*<lambda> registered"):
        quantize_model(model, spec)
    kept = quantize_model(model, QuantSpec(linears=(LinearRule(("0",), None, None),), keep_float=("2",)))
    with torch.no_grad():
        kept(torch.randn(3, 4))
    assert len(seen) == 1  # the float layer kept its hook in the copy

    from quant.convert import convert_in_place
    normed = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 4)))  # the old API: a forward pre-hook
    with pytest.raises(ValueError, match=r"^0 \(Linear\) has forward pre-hook WeightNorm registered"):
        convert_in_place(normed, spec)  # (a deep copy of it fails in torch: its weight is no leaf)

    patched = nn.Sequential(nn.Linear(4, 4))
    patched[0].forward = lambda x: 2 * nn.Linear.forward(patched[0], x)  # as accelerate's add_hook_to_module does
    with pytest.raises(ValueError, match=r"^0 \(Linear\) has a forward of the instance's own"):
        quantize_model(patched, spec)

    vit = tiny_vit()
    vit.blocks[0].attn.register_forward_pre_hook(lambda m, args: None)
    with pytest.raises(ValueError, match=r"^blocks\.0\.attn \(Attention\) has forward pre-hook"):
        PIPELINES["percentile"](vit, images(2), "w4a4")


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_a_weight_norm_layer_is_refused_by_path_before_any_copy(pipeline, monkeypatch):
    """torch's old hook-based weight_norm makes a model that copy.deepcopy refuses with torch's own RuntimeError
    (its weight is computed, no graph leaf): quantize_model, and every pipeline (SmoothQuant, APHQ and GPLQ copy the
    model before they convert it), refuse the layer's hook by its path before they copy anything."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the hook-based weight_norm
        normed = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 4)))
        vit = tiny_vit(depth=1)
        torch.nn.utils.weight_norm(vit.blocks[0].mlp.fc1)
    with pytest.raises(RuntimeError):  # the premise: no copy of it
        copy.deepcopy(normed)
    with pytest.raises(ValueError, match=r"^0 \(Linear\) has forward pre-hook WeightNorm registered"):
        quantize_model(normed, QuantSpec(linears=(LinearRule(("**",), QuantizerSpec(4), None),)))
    monkeypatch.setattr(copy, "deepcopy", lambda *a, **k: pytest.fail("copied"))
    p = PIPELINES[pipeline]
    bits = p.default_bits if getattr(p, "default_bits", None) else "w4a16" if p.weight_only else "w4a4"
    with pytest.raises(ValueError, match=r"^blocks\.0\.mlp\.fc1 \(Linear\) has forward pre-hook WeightNorm registered"):
        p(vit, images(2), bits)
