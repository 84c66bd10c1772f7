"""The LM pipelines rtn / gptq (quant/gptq/), each against an independent reference, plus the bit-width rules
every pipeline follows; SmoothQuant is in test_quant_smoothquant.py, the official cross-check in
scripts/crosscheck_lm_quant.py."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from models.gpt import build_gpt
from quant import PIPELINES
from quant.convert import quantized_layers
from quant.gptq.quantizer import GPTQQuantizer
from quant.gptq.solver import HessianAccumulator, gptq_quantize
from quant.layers import QuantLinear
from quant.spec import Bits
from quant_models import images, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")


def gpt(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_gpt("gpt2_nano", vocab_size=VOCAB).eval()


def tokens(n: int = 8, seed: int = 1, length: int = 32) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def block_linears(model: nn.Module) -> dict:
    return {f"blocks.{i}.{p}": b.get_submodule(p) for i, b in enumerate(model.blocks) for p in BLOCK_LINEARS}


# -- a naive reference of GPTQ's grid (IST-DASLab/gptq quant.py, perchannel) ------------------------------
def naive_params(w: torch.Tensor, bits: int, symmetric: bool) -> tuple:
    """(scale, zero) of every row, one row at a time, in w's dtype."""
    maxq = 2 ** bits - 1
    scales, zeros = [], []
    for row in w:
        lo, hi = min(row.min().item(), 0.0), max(row.max().item(), 0.0)
        if symmetric:
            hi = max(abs(lo), hi)
            lo = -hi if lo < 0 else lo
        if lo == 0 and hi == 0:
            lo, hi = -1.0, 1.0
        scale = (hi - lo) / maxq
        scales.append(scale)
        zeros.append((maxq + 1) / 2 if symmetric else round(-lo / scale))
    return torch.tensor(scales, dtype=w.dtype), torch.tensor(zeros, dtype=w.dtype)


def naive_round(w: torch.Tensor, bits: int, symmetric: bool = False, group: int = 0) -> torch.Tensor:
    """Round to nearest per output channel (and group of input columns), in w's dtype (float32 as the official
    code: GPTQ's symmetric grid puts max |w| exactly on a rounding tie, so the precision decides it)."""
    w = w.detach()
    out = torch.empty_like(w)
    size = group or w.shape[1]
    for start in range(0, w.shape[1], size):
        cols = w[:, start:start + size]
        scale, zero = naive_params(cols, bits, symmetric)
        q = torch.clamp(torch.round(cols / scale[:, None]) + zero[:, None], 0, 2 ** bits - 1)
        out[:, start:start + size] = scale[:, None] * (q - zero[:, None])
    return out


# g24 divides neither width (qkv 32, fc2 128): each row ends in a narrower group of the columns that remain
@pytest.mark.parametrize("options", [{}, {"symmetric": True}, {"group_size": 16}, {"group_size": 24}],
                         ids=["asym", "sym", "g16", "g24"])
def test_rtn_is_naive_per_channel_rounding_of_the_block_linears_only(options):
    model = gpt()
    qmodel, report = PIPELINES["rtn"](model, tokens(), "w4a16", options)
    for name, layer in block_linears(qmodel).items():
        assert isinstance(layer, QuantLinear) and layer.input_quantizer is None, name
        want = naive_round(block_linears(model)[name].weight, 4, options.get("symmetric", False),
                           options.get("group_size", 0))
        torch.testing.assert_close(layer.quantized_weight(), want, rtol=0, atol=1e-6)
    # everything else float and untouched; the head still shares the token embedding
    for name in ("wte.weight", "wpe.weight", "norm.weight", "blocks.0.norm1.weight"):
        assert torch.equal(qmodel.get_parameter(name), model.get_parameter(name)), name
    assert type(qmodel.head) is nn.Linear and qmodel.head.weight is qmodel.wte.weight
    assert report["calibration_images"] == 0  # no data


def test_a_grouped_weight_quantizer_is_described_by_its_group_size():
    """Reports (describe, the quant scope table) name the range granularity: one range per group of 16 input
    columns reads "per-group of 16", one per output channel "per-channel"."""
    from quant.modes import describe
    grouped, _ = PIPELINES["rtn"](gpt(), tokens(), "w4a16", {"group_size": 16})
    channel, _ = PIPELINES["rtn"](gpt(), tokens(), "w4a16")
    for qmodel, gran in ((grouped, "group of 16"), (channel, "channel")):
        weights = {r["weight"] for r in describe(qmodel)}
        assert len(weights) == 1 and weights.pop().startswith(f"4b asym per-{gran} ("), gran


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_rtn_of_a_half_precision_model_takes_its_ranges_in_float32_as_the_official_nearest(dtype, symmetric):
    # IST-DASLab/gptq `--nearest` on a half-precision model: find_params compares the rows' min / max with float32
    # zeros (torch.zeros' default dtype), so scale and zero point are float32, and quantize's float32 result is cast
    # to the weight's dtype; a scale rounded to 8 mantissa bits moves the grid and puts some weights on another level
    model = gpt().to(dtype)
    qmodel, _ = PIPELINES["rtn"](model, tokens(), "w4a16", {"symmetric": symmetric})
    for name, layer in block_linears(qmodel).items():
        w = block_linears(model)[name].weight.detach().float()
        lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
        if symmetric:
            hi = torch.maximum(lo.abs(), hi)
            lo = torch.where(lo < 0, -hi, lo)
        scale = ((hi - lo) / 15)[:, None]
        zero = torch.full_like(scale, 8) if symmetric else torch.round(-lo[:, None] / scale)
        want = (scale * (torch.clamp(torch.round(w / scale) + zero, 0, 15) - zero)).to(dtype)
        got = layer.quantized_weight()
        assert got.dtype == dtype and torch.equal(got, want), name


def test_rtn_of_a_model_equals_the_float_model_with_naively_rounded_weights():
    model, x = gpt(), tokens(4, seed=3)
    qmodel, _ = PIPELINES["rtn"](model, x, "w3a16")
    ref = gpt()
    with torch.no_grad():
        for name, layer in block_linears(ref).items():
            layer.weight.copy_(naive_round(layer.weight, 3))
        torch.testing.assert_close(qmodel(x), ref(x), rtol=0, atol=1e-5)


# -- GPTQ against a direct float64 implementation of its update ----------------------------------------
def reference_gptq(W, H, bits, *, percdamp=0.01, act_order=False, group=0, symmetric=False, static=False,
                   blocksize=0):
    """GPTQ as the paper writes it: columns one at a time, full inverse Hessian, Gaussian elimination of
    each quantized column (no Cholesky, no blocks, no lazy updates), float64. With `blocksize`, a group's range
    comes from the columns as they stood at the start of their block (the official lazy-batch code's `W`)."""
    W, H = W.double().clone(), H.double().clone()
    cols, maxq = W.shape[1], 2 ** bits - 1
    row_params = naive_params(W, bits, symmetric)  # from the weights as given (dead columns included)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    static_params = [naive_params(W[:, i:i + group], bits, symmetric) for i in range(0, cols, group)] if static else []
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(cols)
    W, H = W[:, perm], H[perm][:, perm]
    H += percdamp * torch.diag(H).mean() * torch.eye(cols, dtype=torch.float64)
    Hinv = torch.linalg.inv(H)
    Q = torch.zeros_like(W)
    scale, zero = row_params
    for j in range(cols):
        if blocksize and j % blocksize == 0:
            block_start = W.clone()
        if group and static:
            scale, zero = static_params[int(perm[j]) // group]
        elif group and j % group == 0:
            scale, zero = naive_params((block_start if blocksize else W)[:, j:j + group], bits, symmetric)
        q = torch.clamp(torch.round(W[:, j] / scale) + zero, 0, maxq)
        Q[:, j] = scale * (q - zero)
        d = Hinv[j, j]
        W[:, j:] -= torch.outer((W[:, j] - Q[:, j]) / d, Hinv[j, j:])
        Hinv = Hinv - torch.outer(Hinv[:, j], Hinv[j, :]) / d  # eliminate column j
    return Q[:, torch.argsort(perm)]


def correlated_inputs(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.3 + torch.eye(dim, dtype=torch.float64)
    scales = torch.linspace(0.2, 3.0, dim, dtype=torch.float64)
    return (torch.randn(n, dim, generator=g, dtype=torch.float64) @ mix) * scales


CASES = {"defaults": {}, "act_order": dict(act_order=True), "sym": dict(symmetric=True),
         "groups+act_order": dict(group=4, act_order=True), "static groups": dict(group=4, static=True),
         "static groups+act_order": dict(group=4, static=True, act_order=True)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gptq_update_equals_the_direct_float64_algorithm(case):
    kw = CASES[case]
    g = torch.Generator().manual_seed(1)
    W = torch.randn(6, 12, generator=g, dtype=torch.float64)
    x = correlated_inputs(200, 12)
    x[:, 5] = 0  # a dead input column
    acc = HessianAccumulator(12, torch.device("cpu"), torch.float64)
    for chunk in x.view(10, 20, 12):  # 10 "sequences"
        acc.add(chunk[None])
    quantizer = GPTQQuantizer(3, symmetric=kw.get("symmetric", False), group_size=kw.get("group") or None)
    Q, error = gptq_quantize(W, acc.hessian, quantizer, blocksize=4, act_order=kw.get("act_order", False),
                             static_groups=kw.get("static", False))
    want = reference_gptq(W, acc.hessian, 3, act_order=kw.get("act_order", False), group=kw.get("group", 0),
                          symmetric=kw.get("symmetric", False), static=kw.get("static", False))
    torch.testing.assert_close(Q, want, rtol=0, atol=1e-9)
    assert error > 0
    # the quantizer holds GPTQ's grid (in float32: its buffers' dtype), on which the result lies
    torch.testing.assert_close(quantizer(Q), Q, rtol=0, atol=1e-6)


def test_hessian_is_two_over_n_sum_of_outer_products():
    x = torch.randn(3, 7, 5, dtype=torch.float64)
    acc = HessianAccumulator(5, torch.device("cpu"), torch.float64)
    acc.add(x[:2])
    acc.add(x[2])  # one sequence [T, C]
    flat = x.reshape(-1, 5)
    torch.testing.assert_close(acc.hessian, 2 / 3 * flat.T @ flat)
    assert acc.rows == 3 * 7  # the input vectors summed, whatever the batch shape


def test_gptq_reconstructs_correlated_inputs_better_than_rtn():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(64, 32, generator=g)
    g = torch.Generator().manual_seed(1)  # strongly correlated: 8 latent factors + a little noise
    x = torch.randn(512, 8, generator=g) @ torch.randn(8, 32, generator=g) + 0.1 * torch.randn(512, 32, generator=g)
    acc = HessianAccumulator(32, torch.device("cpu"))
    acc.add(x[None])
    Q, _ = gptq_quantize(W, acc.hessian, GPTQQuantizer(3))
    rtn = naive_round(W, 3).float()
    err = lambda w: (x @ (w - W).T).pow(2).sum().item()  # noqa: E731
    assert err(Q) < 0.5 * err(rtn)


def test_gptq_pipeline_quantizes_block_by_block_onto_the_grid():
    model, calib = gpt(), tokens(8)
    qmodel, report = PIPELINES["gptq"](model, calib, "w4a16", {"batch_size": 3})
    assert set(report["gptq_error"]) == set(block_linears(model))
    for name, layer in block_linears(qmodel).items():
        wq = layer.weight_quantizer
        assert wq.enabled and wq.calibrated and layer.input_quantizer is None
        assert torch.equal(layer.quantized_weight(), layer.weight), name  # GPTQ's result, on its grid
        assert not torch.equal(layer.weight, block_linears(model)[name].weight), name
    assert torch.equal(model.blocks[0].attn.qkv.weight, gpt().blocks[0].attn.qkv.weight)  # float model untouched
    # the calibration batch size only changes float summation order
    again, _ = PIPELINES["gptq"](model, calib, "w4a16", {"batch_size": 8})
    diff = [(a.weight != b.weight).float().mean().item() for a, b in
            zip(block_linears(qmodel).values(), block_linears(again).values())]
    assert max(diff) < 0.01


def gptq_with_inputs_in(source: nn.Module, model: nn.Module, layer: str, calib: torch.Tensor,
                        quantizer: GPTQQuantizer = None, **options) -> torch.Tensor:
    """GPTQ (4 bits, the defaults unless `quantizer` and solver `options` say otherwise) of `model`'s float
    weight of `layer` with the Hessian of that layer's inputs in `source` on `calib`, caught by a hook: the
    reference a pipeline's layer must equal."""
    linear = source.get_submodule(layer)
    acc = HessianAccumulator(linear.in_features, torch.device("cpu"))
    handle = linear.register_forward_pre_hook(lambda m, a: acc.add(a[0]))
    with torch.no_grad():
        source(calib)
    handle.remove()
    return gptq_quantize(model.get_submodule(layer).weight.float(), acc.hessian, quantizer or GPTQQuantizer(4),
                         **options)[0]


def test_gptq_later_blocks_see_the_quantized_earlier_blocks():
    """Block 1's Hessian comes from block 0's quantized output: quantizing block 1 alone on float inputs
    gives other weights (true_sequential also changes them: fc1 sees the quantized qkv / proj)."""
    model, calib = gpt(), tokens(8)
    qmodel, _ = PIPELINES["gptq"](model, calib, "w4a16")

    block1_qkv_gptq = lambda source: gptq_with_inputs_in(source, model, "blocks.1.attn.qkv", calib)
    assert not torch.equal(block1_qkv_gptq(model), qmodel.blocks[1].attn.qkv.weight)  # float inputs
    assert torch.equal(block1_qkv_gptq(qmodel), qmodel.blocks[1].attn.qkv.weight)  # the quantized prefix's
    sequential, _ = PIPELINES["gptq"](model, calib, "w4a16", {"true_sequential": True})
    assert torch.equal(sequential.blocks[0].attn.qkv.weight, qmodel.blocks[0].attn.qkv.weight)
    assert not torch.equal(sequential.blocks[0].mlp.fc1.weight, qmodel.blocks[0].mlp.fc1.weight)


# -- bit-widths: 16 = float; every pipeline refuses what it cannot do ---------------------------------------
@pytest.mark.parametrize("pipeline, bits, match", [
    ("rtn", "w4a8", "weight-only.*w4a16"),
    ("gptq", "w16a16", "keeps them float"),
    ("smoothquant", "w4a16", "quantizes activations"),
    ("smoothquant_strict", "w8a16", "quantizes activations"),
    ("repq", "w4a16", "quantizes activations"),
    ("percentile", "w16a4", "quantizes weights"),
    ("aphq", "w4a16", "quantizes activations"),
])
def test_pipelines_refuse_bits_they_cannot_do(pipeline, bits, match):
    with pytest.raises(ValueError, match=match):
        PIPELINES[pipeline](gpt(), tokens(2), bits)


@pytest.mark.parametrize("pipeline", ["rtn", "gptq", "smoothquant", "smoothquant_strict"])
def test_lm_pipelines_refuse_a_quantized_stem_or_head_naming_the_option(pipeline):
    bits = "w4a16" if pipeline in ("rtn", "gptq") else "w8a8"
    with pytest.raises(ValueError, match="head_w_bits=8"):
        PIPELINES[pipeline].check(Bits(int(bits[1]), int(bits[3:])), PIPELINES[pipeline].Options(head_w_bits=8))
    typo, meant = ("groupsize", "group_size") if pipeline in ("rtn", "gptq") else ("alpah", "alpha")
    with pytest.raises(ValueError, match=f"unknown option '{typo}'.*did you mean {meant}"):
        PIPELINES[pipeline](gpt(), tokens(2), bits, {typo: 1})


@pytest.mark.parametrize("pipeline", ["rtn", "gptq", "smoothquant", "smoothquant_strict"])
def test_lm_pipelines_refuse_a_null_stem_or_head_which_would_mean_the_main_bits(pipeline):
    # null means "the main bit-width" in FirstLastOptions; these layouts keep the head float whatever it says,
    # and the report's resolved bits would claim a quantized head
    bits = Bits(4, 16) if pipeline in ("rtn", "gptq") else Bits(8, 8)
    with pytest.raises(ValueError, match="head_w_bits=null"):
        PIPELINES[pipeline].validate(bits, PIPELINES[pipeline].Options(head_w_bits=None))


def test_gptq_refuses_static_groups_without_groups():
    # fasterquant ignores static_groups when groupsize is -1: the run would be the default one under another name
    with pytest.raises(ValueError, match="static_groups=true .* give group_size"):
        PIPELINES["gptq"](gpt(), tokens(2), "w4a16", {"static_groups": True})
    PIPELINES["gptq"].validate(Bits(4, 16), PIPELINES["gptq"].Options(static_groups=True, group_size=16))


def test_a_hessian_that_no_dampening_makes_invertible_is_a_config_error_naming_the_layer():
    # one window of 32 tokens gives each 32- and 128-column Linear a singular Hessian; a dampening of 1e-12 leaves
    # it singular in float32: the user's setting, named, and not a traceback from the Cholesky factorization
    from configs import ConfigError

    with pytest.raises(ConfigError, match=r"quant.gptq.percdamp=1e-12: the dampened Hessian of blocks\.0\.\S+ "
                                          r"\(\d+ input columns, from 32 calibration tokens\) is not positive"):
        PIPELINES["gptq"](gpt(), tokens(1), "w4a16", {"percdamp": 1e-12})
    PIPELINES["gptq"](gpt(), tokens(1), "w4a16")  # the default dampening inverts the same Hessians


def test_gptq_on_a_vit_counts_the_patch_tokens_its_hessians_sum_not_the_pixels():
    # tiny_vit: 32 px images in 8 px patches, 16 patches + the class token reach every block's Linears
    from configs import ConfigError

    per_image = (32 // 8) ** 2 + 1
    _, report = PIPELINES["gptq"](tiny_vit(), images(2), "w4a16")
    assert report["calibration_images"] == 2 and report["calibration_tokens"] == 2 * per_image
    # 17 rows leave the 48-column Hessians singular: the error counts the rows they were summed from
    with pytest.raises(ConfigError, match=rf"\(48 input columns, from {per_image} calibration tokens\)"):
        PIPELINES["gptq"](tiny_vit(), images(1), "w4a16", {"percdamp": 1e-12})


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_calibration_inputs_are_named_as_such_not_blamed_on_percdamp(bad):
    """A NaN / inf input makes the first Linear's Hessian non-finite, which cholesky refused and the refusal read as a
    too small quant.gptq.percdamp; no dampening helps, so it is a ValueError saying what is wrong, naming the layer."""
    from configs import ConfigError

    x = images(4)
    x[2, 0, 5, 6] = bad
    with pytest.raises(ValueError, match=r"^GPTQ of blocks\.0\.attn\.qkv: its Hessian holds NaN or inf") as e:
        PIPELINES["gptq"](tiny_vit(), x, "w4a16")
    assert not isinstance(e.value, ConfigError) and "percdamp=" not in str(e.value)
    hessian = torch.eye(6)
    hessian[1, 2] = bad
    with pytest.raises(ValueError, match="Hessian holds NaN or inf"):
        gptq_quantize(torch.randn(3, 6), hessian, GPTQQuantizer(4))


def test_a16_parses_as_float_activations():
    from quant import parse_bits

    bits = parse_bits("w4a16")
    assert bits == Bits(4, 16) and bits.float_activations and not bits.float_weights and str(bits) == "w4a16"


def test_weight_only_pipelines_run_on_a_vit_and_keep_its_stem_and_head_float():
    import timm

    from models.variants import VARIANTS

    kwargs = dict(VARIANTS["vit_nano"])
    torch.manual_seed(0)
    vit = timm.create_model(kwargs.pop("arch"), num_classes=10, **kwargs).eval()
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for name in ("rtn", "gptq"):
        qvit, _ = PIPELINES[name](vit, images, "w4a16")
        assert {n for n, _ in quantized_layers(qvit)} == {f"blocks.{i}.{p}" for i in range(2) for p in BLOCK_LINEARS}
        with torch.no_grad():
            out, ref = qvit(images), vit(images)
        assert torch.isfinite(out).all() and 0 < (out - ref).abs().max() < 0.2 * ref.abs().max()


def test_perplexity_of_quantized_gpt_is_finite_and_near_float():
    model, calib, x = gpt(), tokens(8), tokens(4, seed=7)
    nll = lambda m: torch.nn.functional.cross_entropy(  # noqa: E731
        m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).item()
    with torch.no_grad():
        base = nll(model)
        for name, bits in (("rtn", "w4a16"), ("gptq", "w4a16"), ("smoothquant", "w8a8"),
                           ("smoothquant_strict", "w8a8")):
            q = nll(PIPELINES[name](model, calib, bits).model)
            assert math.isfinite(q) and abs(q - base) < 0.05, name


def test_symmetric_grid_keeps_lo_zero_for_a_row_without_negative_values():
    # IST-DASLab/gptq `--sym`: lo = -hi only where the row has a negative value; a non-negative row keeps
    # [0, hi] (its levels reach about half of hi), an all-zero row gets [-1, 1]
    w = torch.tensor([[-0.7, 0.2, 0.5, 0.1], [0.3, 0.9, 0.05, 0.6], [0.0, 0.0, 0.0, 0.0]])
    q = GPTQQuantizer(3, symmetric=True)
    q.calibrating = True
    out = q(w)
    scale, zero = naive_params(w, 3, True)
    torch.testing.assert_close(q.scale, scale)
    torch.testing.assert_close(q.zero_point, zero)
    torch.testing.assert_close(out, naive_round(w, 3, True), rtol=0, atol=1e-6)
    assert out[1].max() < 0.5  # the positive row's top levels are cut off at about hi / 2


def test_gptq_group_inside_a_block_takes_its_range_from_the_block_start():
    # groups of 4 in blocks of 6: the groups at columns 4 and 8 start mid-block, where the official code reads
    # the columns before the current block's updates reached them (the lazy batch refreshes W per block)
    g = torch.Generator().manual_seed(2)
    W = torch.randn(6, 12, generator=g, dtype=torch.float64)
    acc = HessianAccumulator(12, torch.device("cpu"), torch.float64)
    acc.add(correlated_inputs(200, 12, seed=3)[None])
    Q, _ = gptq_quantize(W, acc.hessian, GPTQQuantizer(3, group_size=4), blocksize=6)
    torch.testing.assert_close(Q, reference_gptq(W, acc.hessian, 3, group=4, blocksize=6), rtol=0, atol=1e-9)
    assert not torch.allclose(Q, reference_gptq(W, acc.hessian, 3, group=4), rtol=0, atol=1e-9)


@pytest.mark.parametrize("case", ["groups", "groups+act_order", "static groups", "static groups+act_order"])
def test_gptq_groups_that_do_not_divide_the_columns_end_in_a_narrower_group(case):
    # groups of 5 over 12 columns (5, 5, 2; officially W[:, i:i + groupsize] slices the last short), in blocks of 4:
    # the last group's range is of its 2 columns alone, in activation order too, and its columns keep that range
    kw = dict(CASES.get(case, {}), group=5)
    g = torch.Generator().manual_seed(5)
    W = torch.randn(6, 12, generator=g, dtype=torch.float64)
    acc = HessianAccumulator(12, torch.device("cpu"), torch.float64)
    acc.add(correlated_inputs(200, 12, seed=6)[None])
    quantizer = GPTQQuantizer(3, group_size=5)
    Q, _ = gptq_quantize(W, acc.hessian, quantizer, blocksize=4, act_order=kw.get("act_order", False),
                         static_groups=kw.get("static", False))
    want = reference_gptq(W, acc.hessian, 3, act_order=kw.get("act_order", False), group=5,
                          static=kw.get("static", False), blocksize=4)
    torch.testing.assert_close(Q, want, rtol=0, atol=1e-9)
    assert quantizer.scale.view(6, -1).shape[1] == 3  # three ranges a row, the quantizer reproducing the result
    torch.testing.assert_close(quantizer(Q), Q, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ["defaults", "act_order", "groups+act_order"])
def test_gptq_error_is_half_the_damped_quadratic_form_of_the_weight_change(case):
    # Optimal Brain Quantization: each column's error (w - q)^2 / (2 [H^-1]_jj) is exactly the rise of the
    # proxy loss 1/2 (w0 - w) H (w0 - w)^T after the optimal update of the remaining columns, so the sum that
    # the report shows as `gptq_error` equals the closed form on the final weights (H with GPTQ's dampening)
    kw = CASES[case]
    g = torch.Generator().manual_seed(2)
    W = torch.randn(5, 12, generator=g, dtype=torch.float64)
    x = correlated_inputs(120, 12, seed=3)
    x[:, 7] = 0  # a dead input column: its weights are dropped (they multiply a zero input)
    acc = HessianAccumulator(12, torch.device("cpu"), torch.float64)
    acc.add(x.view(6, 20, 12))
    quantizer = GPTQQuantizer(3, group_size=kw.get("group") or None)
    Q, error = gptq_quantize(W, acc.hessian, quantizer, blocksize=4, act_order=kw.get("act_order", False))
    H = acc.hessian.clone()
    H[7, 7] = 1  # GPTQ's dead-column rule, before the dampening's mean of the diagonal
    H += 0.01 * torch.diag(H).mean() * torch.eye(12, dtype=torch.float64)  # percdamp 0.01
    D = W.clone()
    D[:, 7] = 0
    D -= Q
    assert error == pytest.approx(0.5 * float(torch.einsum("ri,ij,rj->", D, H, D)), rel=1e-9)


# IST-DASLab/gptq: `fasterquant(blocksize=128, percdamp=.01, groupsize=-1, actorder=False, static_groups=False)`,
# opt.py / llama.py's argparse (--percdamp .01, --groupsize -1, --sym, --act-order, --static-groups and llama.py's
# --true-sequential all off); -1 is group_size None here
OFFICIAL_GPTQ_DEFAULTS = {"blocksize": 128, "percdamp": 0.01, "group_size": None, "act_order": False,
                          "static_groups": False, "symmetric": False, "true_sequential": False}


def test_gptq_defaults_are_the_official_ones_in_the_config_and_the_readme():
    # blocksize decides where a group that is no multiple of it takes its range (the block start): another default
    # changes grouped results and passed every other test
    import re
    from pathlib import Path

    import yaml

    from configs import load_config
    from quant import plan

    options = plan.pipeline_options(load_config([], []), "gptq")  # what evaluate.py runs without quant.gptq.*
    assert {key: getattr(options, key) for key in OFFICIAL_GPTQ_DEFAULTS} == OFFICIAL_GPTQ_DEFAULTS
    documented = {}
    readme = Path(__file__).resolve().parents[1] / "quant" / "README.md"
    for line in readme.read_text().splitlines():
        row = re.match(r"\| (?:rtn, )?gptq(?:, smoothquant\(_strict\))? \| (.*?) \|", line)
        if row:
            documented.update({k: yaml.safe_load(v) for k, v in re.findall(r"`(\w+)` \(([^)]*)\)", row.group(1))})
    documented["group_size"] = None if documented["group_size"] == "None" else documented["group_size"]
    assert {key: documented[key] for key in OFFICIAL_GPTQ_DEFAULTS} == OFFICIAL_GPTQ_DEFAULTS


def test_a_grouped_grid_loaded_into_a_quantizer_built_without_groups_refits_per_group():
    # the group size travels in the state dict: a re-calibration after loading (reset, then fit) forms the saved
    # groups of 16 input columns, not one range per output channel
    w = torch.randn(6, 48, generator=torch.Generator().manual_seed(4))
    grouped = GPTQQuantizer(4, group_size=16)
    grouped.calibrating = True
    grouped(w)
    fresh = GPTQQuantizer(4)
    fresh.load_state_dict(grouped.state_dict())
    fresh.reset()
    fresh.calibrating = True
    torch.testing.assert_close(fresh(w * 2), naive_round(w * 2, 4, group=16), rtol=0, atol=1e-6)


def test_gptq_grid_refuses_a_granularity_other_than_per_output_channel():
    # its ranges are per output channel (or group): a per-tensor request is refused, not run per channel
    from quant.spec import QuantizerSpec
    with pytest.raises(ValueError, match="per output channel"):
        GPTQQuantizer.from_spec(QuantizerSpec(4, kind=GPTQQuantizer, granularity="tensor"), None)


def test_gptq_hessians_of_one_pass_per_block_or_one_pass_per_linear():
    """true_sequential=false (opt_sequential): every Linear of block 0 is GPTQ'd with the Hessian of its inputs in
    the float model, fc1 included; true_sequential=true (llama.py's option): fc1's Hessian comes from the inputs it
    sees once qkv and proj are quantized. Each checked against GPTQ with a Hessian caught by a hook."""
    model, calib = gpt(), tokens(8)
    fc1_gptq = lambda source: gptq_with_inputs_in(source, model, "blocks.0.mlp.fc1", calib)
    one_pass, _ = PIPELINES["gptq"](model, calib, "w4a16")
    sequential, _ = PIPELINES["gptq"](model, calib, "w4a16", {"true_sequential": True})
    assert torch.equal(fc1_gptq(model), one_pass.blocks[0].mlp.fc1.weight)  # the float block's fc1 inputs
    assert torch.equal(fc1_gptq(sequential), sequential.blocks[0].mlp.fc1.weight)  # after qkv, proj quantized


@pytest.mark.parametrize("pipeline, bits", [("rtn", "w4a16"), ("gptq", "w4a16"), ("smoothquant", "w8a8")])
@pytest.mark.parametrize("training", [True, False])
def test_lm_pipelines_return_the_model_in_the_mode_it_was_given(pipeline, bits, training):
    # GPTQ gathers its Hessians in evaluation mode (no dropout) but, like rtn and smoothquant, must not hand back
    # a model in another mode than the float one it was given
    model = gpt().train(training)
    qmodel, _ = PIPELINES[pipeline](model, tokens(4), bits)
    assert [m.training for m in qmodel.modules()] == [training] * len(list(qmodel.modules()))
    assert all(m.training == training for m in model.modules())  # the float model's mode untouched


@pytest.mark.parametrize("options", [
    {"act_order": True, "group_size": 12, "blocksize": 8, "percdamp": 0.05, "symmetric": True},
    {"act_order": True, "group_size": 12, "static_groups": True},
], ids=["act_order+groups+blocksize", "static_groups"])
def test_gptq_pipeline_runs_the_solver_with_the_options_it_is_given(options):
    """Every option reaches each layer's GPTQ: block 0's Linears (float inputs, one pass) equal GPTQ with those
    options on a Hessian caught by a hook. Groups of 12 in blocks of 8 start mid-block, so the block size moves
    their ranges (not only the summation order); the report counts windows and their tokens."""
    model, calib = gpt(), tokens(8)
    qmodel, report = PIPELINES["gptq"](model, calib, "w4a16", options)
    solver = {k: options[k] for k in ("act_order", "blocksize", "percdamp", "static_groups") if k in options}
    for layer in ("blocks.0.attn.qkv", "blocks.0.mlp.fc2"):
        quantizer = GPTQQuantizer(4, symmetric=options.get("symmetric", False), group_size=options["group_size"])
        want = gptq_with_inputs_in(model, model, layer, calib, quantizer, **solver)
        assert torch.equal(qmodel.get_submodule(layer).weight, want), layer
    assert report["calibration_images"] == 8 and report["calibration_tokens"] == 8 * 32


def test_gptq_of_a_dropout_model_in_training_mode_takes_its_hessians_without_dropout():
    # as the official scripts (model.eval() before opt_sequential): the embedding dropout in front of block 0
    # would otherwise make the Hessians random; the model comes back in training mode
    torch.manual_seed(0)
    model, calib = build_gpt("gpt2_nano", vocab_size=VOCAB, drop=0.5).train(), tokens(8)
    reference = build_gpt("gpt2_nano", vocab_size=VOCAB, drop=0.5).eval()
    reference.load_state_dict(model.state_dict())
    qmodel, _ = PIPELINES["gptq"](model, calib, "w4a16")
    assert qmodel.training
    want = gptq_with_inputs_in(reference, reference, "blocks.0.attn.qkv", calib)
    assert torch.equal(qmodel.blocks[0].attn.qkv.weight, want)


@pytest.mark.parametrize("pipeline, options, message", [
    ("gptq", {"blocksize": 0}, r"GPTQOptions: 'blocksize' must be >= 1; got 0"),
    ("gptq", {"batch_size": 0}, r"GPTQOptions: 'batch_size' must be >= 1; got 0"),
    ("gptq", {"percdamp": -0.5}, r"GPTQOptions: 'percdamp' must be > 0; got -0.5"),
    ("smoothquant", {"alpha": 1.5}, r"SmoothQuantOptions: 'alpha' must be >= 0 and <= 1; got 1.5"),
    ("smoothquant_strict", {"alpha": float("nan")}, r"SmoothQuantStrictOptions: 'alpha' must be a finite number"),
    # inf is above every lower bound: the finite-number rule, not the range, refuses it
    ("gptq", {"percdamp": float("inf")}, r"GPTQOptions: 'percdamp' must be a finite number; got inf"),
])
def test_lm_pipelines_refuse_option_values_out_of_range_before_any_work(pipeline, options, message):
    # the ranges configs/quant.py declares, checked for a mapping handed to the pipeline as for evaluate.py's config:
    # were a "range() arg 3 must not be zero" / split_size traceback, or a SmoothQuant run at alpha 1.5 or NaN
    bits = "w4a16" if pipeline == "gptq" else "w8a8"
    with pytest.raises(ValueError, match=message):
        PIPELINES[pipeline](gpt(), tokens(2), bits, options)


@pytest.mark.parametrize("pipeline, options, expected", [
    ("gptq", {"act_order": "yes"}, r"'act_order' expects bool, got 'yes' \(str\)"),
    ("gptq", {"act_order": "false"}, r"'act_order' expects bool, got 'false' \(str\)"),  # a non-empty string: True
    ("gptq", {"act_order": 0}, r"'act_order' expects bool, got 0 \(int\)"),
    ("smoothquant", {"alpha": "0.5"}, r"'alpha' expects float, got '0.5' \(str\)"),
    ("gptq", {"blocksize": 128.0}, r"'blocksize' expects int, got 128.0 \(float\)"),  # as the config loader
    ("gptq", {"blocksize": 2.5}, r"'blocksize' expects int, got 2.5 \(float\)"),
    ("rtn", {"group_size": True}, r"'group_size' expects int or null, got True \(bool\)"),
    ("smoothquant_strict", {"quantize_bmm": "qk"}, r"'quantize_bmm' must be one of 'none', 'qkv', 'all'; got 'qk'"),
])
def test_lm_pipelines_refuse_option_values_of_another_type_before_any_work(pipeline, options, expected):
    # a mapping handed to the pipeline is typed as evaluate.py's config is (configs/loader.py): one ValueError
    # naming the option, the value and the type, not a string run as True or a traceback from inside the run
    bits = "w4a16" if pipeline in ("rtn", "gptq") else "w8a8"
    model = gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=expected) as error:
        PIPELINES[pipeline](model, tokens(2), bits, options)
    assert len(str(error.value).splitlines()) == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_pipeline_options_take_ints_for_floats_none_for_optional_and_lists_for_tuples():
    # the values a config file gives these fields (alpha: 1, group_size: null, act_percentiles: [0.99, 1]) pass as
    # mappings too, in the field's own type, as the config loader stores them
    from configs.quant import GPTQOptions, PercentileOptions, SmoothQuantOptions
    from quant.pipeline_base import parse_options
    smooth = parse_options(SmoothQuantOptions, {"alpha": 1, "batch_size": 2, "head_w_bits": 0})
    assert (smooth.alpha, smooth.batch_size, smooth.head_w_bits) == (1.0, 2, 0) and type(smooth.alpha) is float
    gptq = parse_options(GPTQOptions, {"group_size": None, "percdamp": 1, "act_order": False, "blocksize": 4})
    assert (gptq.group_size, gptq.percdamp, gptq.act_order, gptq.blocksize) == (None, 1.0, False, 4)
    assert type(gptq.percdamp) is float
    percentile = parse_options(PercentileOptions, {"act_percentiles": [0.99, 1], "stem_a_bits": None})
    assert percentile.act_percentiles == (0.99, 1.0) and percentile.stem_a_bits is None
    assert all(type(p) is float for p in percentile.act_percentiles)
    _, report = PIPELINES["smoothquant"](gpt(), tokens(2), "w8a8", {"alpha": 1, "batch_size": 1})
    assert report["options"]["alpha"] == 1.0 and report["options"]["batch_size"] == 1


LM_SETTINGS = [("rtn", "w4a16", {}), ("gptq", "w4a16", {"group_size": 16, "act_order": True}),
               ("smoothquant", "w8a8", {"quantize_bmm": "all"}), ("smoothquant_strict", "w8a8", {})]


@pytest.mark.parametrize("name, bits, options", LM_SETTINGS, ids=[s[0] for s in LM_SETTINGS])
def test_a_bf16_model_is_quantized_and_scored_in_bf16(name, bits, options):
    """A model kept in bf16 (no autocast): the fake-quantized weights and activations keep the model's dtype, so
    every product multiplies bf16 by bf16 (an fp32 weight from fp32 quantizer parameters would be refused by
    F.linear). The reference: the same pipeline on the fp32 model, within bf16's rounding."""
    model, calib, x = gpt(), tokens(4), tokens(2, seed=3)
    with torch.no_grad():
        want = PIPELINES[name](model, calib, bits, options).model(x)
        got = PIPELINES[name](gpt().to(torch.bfloat16), calib, bits, options).model(x)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().mean()) < 0.1 * float(want.abs().mean())


@pytest.mark.parametrize("name, bits, options", LM_SETTINGS, ids=[s[0] for s in LM_SETTINGS])
def test_a_float64_default_dtype_changes_nothing(name, bits, options):
    """Quantizer parameters are made fp32 whatever torch's default dtype: a float64 default would otherwise give
    fp32 layers float64 weights their F.linear refuses. Same logits, bit for bit."""
    model, calib, x = gpt(), tokens(4), tokens(2, seed=3)
    with torch.no_grad():
        want = PIPELINES[name](model, calib, bits, options).model(x)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            got = PIPELINES[name](model, calib, bits, options).model(x)
        finally:
            torch.set_default_dtype(previous)
    assert got.dtype == torch.float32 and torch.equal(got, want)


# -- a Conv2d inside a block: GPTQ's flattened weight and unfolded inputs (IST-DASLab/gptq gptq.py) ----------------
class _ConvMlp(nn.Module):
    def __init__(self, padding_mode: str, groups: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(3, 6, 3, padding=2, dilation=2, padding_mode=padding_mode)
        self.fc2 = nn.Conv2d(6, 3, 1, groups=groups)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class _ConvBlock(nn.Module):
    def __init__(self, padding_mode: str, groups: int) -> None:
        super().__init__()
        self.mlp = _ConvMlp(padding_mode, groups)

    def forward(self, x):
        return x + self.mlp(x)


class _ConvNet(nn.Module):
    """Two blocks whose MLP layers (blocks.N.mlp.fc1 / fc2: the in-block patterns) are convolutions."""

    def __init__(self, padding_mode: str, groups: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_ConvBlock(padding_mode, groups), _ConvBlock(padding_mode, groups))
        self.head = nn.Linear(3, 10)

    def forward(self, x):
        return self.head(self.blocks(x).mean((2, 3)))


def conv_net(padding_mode: str = "zeros", groups: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return _ConvNet(padding_mode, groups).eval()


def naive_patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """[B, L, C * kh * kw]: each output position's input values under the kernel, read one at a time in
    (channel, kernel row, kernel column) order, from the input padded as the layer's padding_mode pads it."""
    (ph, pw), (kh, kw), (dh, dw), (sh, sw) = conv.padding, conv.kernel_size, conv.dilation, conv.stride
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    xp = torch.nn.functional.pad(x, (pw, pw, ph, ph), mode=mode)
    out_h, out_w = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1, (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    rows = [[[xp[b, c, i * sh + u * dh, j * sw + v * dw] for c in range(x.shape[1]) for u in range(kh)
              for v in range(kw)] for i in range(out_h) for j in range(out_w)] for b in range(x.shape[0])]
    return torch.tensor(rows, dtype=x.dtype)


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_gptq_and_rtn_of_a_conv_quantize_its_flattened_weight_on_its_unfolded_inputs(padding_mode):
    """A Conv2d the in-block patterns match ended in an AttributeError (gptq: in_features) or a shape error (rtn).
    GPTQ quantizes it as IST-DASLab/gptq does: the weight as [C_out, C_in*kh*kw], the Hessian of the input unfolded
    into kernel patches. Reference: the patches read naively (checked against the conv's own output), their Hessian,
    and GPTQ of the flattened weight; rtn: naive per-row rounding of the flattened weight (groups of its columns)."""
    model, x = conv_net(padding_mode), torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    qmodel, report = PIPELINES["gptq"](model, x, "w4a16", {"batch_size": 4})
    inputs = {}
    hooks = [model.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: inputs.setdefault(n, a[0]))
             for n in ("blocks.0.mlp.fc1", "blocks.0.mlp.fc2")]
    with torch.no_grad():
        model(x)  # block 0's layers: their inputs in the float model (one pass per block, as opt_sequential)
    for h in hooks:
        h.remove()
    for name, seen in inputs.items():
        conv, layer = model.get_submodule(name), qmodel.get_submodule(name)
        patches = naive_patches(conv, seen)
        with torch.no_grad():  # the patches' column order is the flattened weight's: the conv's own output
            want = (patches @ conv.weight.flatten(1).T + conv.bias).transpose(1, 2).reshape(conv(seen).shape)
            torch.testing.assert_close(want, conv(seen), rtol=1e-5, atol=1e-5)
        acc = HessianAccumulator(patches.shape[-1], torch.device("cpu"))
        acc.add(patches)
        ref = gptq_quantize(conv.weight.detach().flatten(1), acc.hessian, GPTQQuantizer(4))[0].view_as(conv.weight)
        torch.testing.assert_close(layer.weight, ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(layer.quantized_weight(), layer.weight, rtol=0, atol=1e-6)  # on its grid
    assert report["calibration_tokens"] == 4 * 36  # one row per output position

    rtn, _ = PIPELINES["rtn"](model, x, "w4a16", {"group_size": 9})
    ref = conv_net(padding_mode)
    with torch.no_grad():
        for block in ref.blocks:
            for conv in (block.mlp.fc1, block.mlp.fc2):
                conv.weight.copy_(naive_round(conv.weight.flatten(1), 4, group=9).view_as(conv.weight))
        torch.testing.assert_close(rtn(x), ref(x), rtol=0, atol=1e-5)


def test_gptq_refuses_a_grouped_conv_by_name_before_any_work():
    """One Hessian of the whole unfolded input does not describe a grouped convolution (officially a shape error):
    refused naming the layer; rtn, which needs no inputs, rounds it per output channel."""
    model, x = conv_net(groups=3), torch.randn(2, 3, 6, 6)
    with pytest.raises(ValueError, match=r"^gptq cannot quantize blocks\.0\.mlp\.fc2, a Conv2d with groups=3"):
        PIPELINES["gptq"](model, x, "w4a16")
    rtn, _ = PIPELINES["rtn"](model, x, "w4a16")
    w = model.blocks[0].mlp.fc2.weight
    torch.testing.assert_close(rtn.blocks[0].mlp.fc2.quantized_weight(), naive_round(w.flatten(1), 4).view_as(w))


def test_the_readme_says_rtn_groups_are_no_setting_of_the_official_nearest_rtn():
    # IST-DASLab/gptq opt.py's `--nearest` branch fits Quantizer.find_params on the whole weight: one range per row
    # whatever --groupsize says, so quant.rtn.group_size has no official counterpart and the README must not name
    # --groupsize as its source without saying so
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "quant" / "README.md").read_text()
    row = next(line for line in readme.splitlines() if re.match(r"\| rtn(, gptq)? \| `group_size`", line))
    assert "--nearest" in row and "ignores" in row
    assert "rtn.group_size" in re.sub(r"\s+", " ", readme.split("* **rtn**", 1)[1].split("\n* **", 1)[0])
