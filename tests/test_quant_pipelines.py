"""Pipeline registry, options, reports, first/last-layer bits and frozen quantizers at evaluation."""
import os
import time

import numpy as np
import pytest
import torch

from quant import PIPELINES, evaluate_quantized
from quant.layers import QuantConv2d
from quant.modes import named_quantizers
from quant.quantizers import LogSqrt2Quantizer, UniformQuantizer
from quant.spec import Bits, parse_bits
from quant_models import images, tiny_swin, tiny_vit


def test_registry_and_bits():
    assert {"percentile", "repq"} <= set(PIPELINES)
    assert parse_bits("W4A4") == Bits(4, 4) and str(parse_bits((6, 6))) == "w6a6"
    with pytest.raises(ValueError, match="w4a4"):
        parse_bits("4bit")


@pytest.mark.parametrize("text, w, a", [("w2a2", 2, 2), ("W4A8", 4, 8), ("w8a4", 8, 4), ("w4a16", 4, 16),
                                        ("w16a16", 16, 16)])
def test_bit_width_is_weights_then_activations_within_2_to_16(text, w, a):
    bits = parse_bits(text)
    assert (bits.w, bits.a) == (w, a) and str(bits) == text.lower()
    assert (bits.float_weights, bits.float_activations) == (w == 16, a == 16)


@pytest.mark.parametrize("text", ["w1a4", "w4a1", "w0a8", "w17a4", "w4a17"])
def test_bit_widths_outside_2_to_16_are_refused(text):
    with pytest.raises(ValueError, match="2..16"):
        parse_bits(text)


@pytest.mark.parametrize("pair", [(4.7, 4), (4, True), ("4", 4)])
def test_bit_widths_as_a_pair_must_be_whole_numbers(pair):
    with pytest.raises(ValueError, match="whole numbers of bits"):  # int(4.7) would run w4 without a word
        parse_bits(pair)
    assert parse_bits((4, 8)) == (4, 8)


def test_unknown_option_names_close_match():
    with pytest.raises(ValueError, match="round_zero_point"):
        PIPELINES["repq"](tiny_vit(), images(2), "w4a4", {"round_zeropoint": True})


def test_report_and_default_first_last_bits():
    model, report = PIPELINES["repq"](tiny_vit(), images(4), "w4a4")
    assert report["bits"] == "w4a4" and report["calibration_images"] == 4
    assert report["stem"] == {"w": 4, "a": 8} and report["head"] == {"w": 4, "a": 4}
    assert set(report["seconds"]) == {"convert", "calibrate", "reparam"}
    stem = model.patch_embed.proj
    assert (isinstance(stem, QuantConv2d) and stem.input_quantizer.bits == 8
            and stem.weight_quantizer.bits == 4)
    assert model.head.input_quantizer.bits == 4
    attn = model.blocks[0].attn
    assert isinstance(attn.attn_quant, LogSqrt2Quantizer)
    assert attn.q_quant.channel_dim is None  # matmul operands per tensor in RepQ-ViT


def test_repq_layout_is_the_official_one_quantizer_by_quantizer():
    # zkkli/RepQ-ViT before the fold: every range, weights' and activations' (the attention map's included),
    # is the percentile-MSE search over 0.999 / 0.9999 / 0.99999; the LayerNorm outputs (qkv and fc1 inputs)
    # per channel (last dim), every other Linear input and q, k, v per tensor; the attention map log-sqrt2
    from configs.quant import RepQOptions
    from quant import quantize_model
    from quant.ranges import RangeSearch
    model = quantize_model(tiny_vit(), PIPELINES["repq"].layout(Bits(4, 4), RepQOptions()))
    official = RangeSearch("percentile_mse", (0.999, 0.9999, 0.99999))
    quantizers = dict(named_quantizers(model))
    assert quantizers and all(q.search == official for q in quantizers.values())
    for name, q in named_quantizers(model, "activation"):
        per_channel = name.endswith(("attn.qkv.input_quantizer", "mlp.fc1.input_quantizer"))
        assert getattr(q, "channel_dim", None) == (-1 if per_channel else None), name
        assert isinstance(q, LogSqrt2Quantizer if name.endswith("attn_quant") else UniformQuantizer), name
    assert all(q.channel_dim == 0 for _, q in named_quantizers(model, "weight"))  # per output channel
    assert {"blocks.0.attn.v_quant", "blocks.0.attn.attn_quant", "blocks.1.mlp.fc2.input_quantizer"} <= set(quantizers)


def test_first_last_options():
    model, report = PIPELINES["percentile"](tiny_swin(), images(4), "w4a4",
                                            {"stem_a_bits": 0, "head_w_bits": 8, "head_a_bits": 8})
    assert report["stem"] == {"w": 4, "a": None} and report["head"] == {"w": 8, "a": 8}
    assert model.patch_embed.proj.input_quantizer is None
    assert model.head.fc.weight_quantizer.bits == 8



def test_an_options_object_is_honoured_like_a_mapping():
    """evaluate.py hands the pipeline its config dataclass: every field of it must reach the model, both
    through the pipeline call and through evaluate_quantized (8-bit head weights, float stem input)."""
    from configs.quant import PercentileOptions

    options = PercentileOptions(stem_a_bits=0, head_w_bits=8, act_range="minmax")
    model, report = PIPELINES["percentile"](tiny_vit(), images(4), "w4a4", options)
    assert model.patch_embed.proj.input_quantizer is None and model.head.weight_quantizer.bits == 8
    assert model.blocks[0].mlp.fc2.input_quantizer.search.method == "minmax"
    assert report["options"]["act_range"] == "minmax" and report["head"] == {"w": 8, "a": 4}

    def eval_fn(qmodel):
        time.sleep(0.05)  # an evaluation that takes measurable time, kept apart from the quantization time
        return {"head_w_bits": qmodel.head.weight_quantizer.bits}

    out = evaluate_quantized("percentile", tiny_vit(), images(4), "w4a4", eval_fn, options)
    assert out["head_w_bits"] == 8 and out["report"]["stem"] == {"w": 4, "a": None}
    assert out["eval_seconds"] >= 0.05 and abs(out["quantize_seconds"] + out["eval_seconds"] - out["seconds"]) <= 0.002


@pytest.mark.parametrize("key", ["stem_w_bits", "stem_a_bits", "head_w_bits", "head_a_bits"])
def test_stem_and_head_bits_accept_2_to_15_and_0(key):
    # 16 means float in a bit-width (w4a16); here float is 0, and 16 built a real 16-bit grid that the report's
    # {"a": 16} then read as float: refused, naming the spelling of float
    from configs.quant import PercentileOptions

    bits = parse_bits("w4a4")
    for value in (0, 2, 15):
        PIPELINES["percentile"].validate(bits, PercentileOptions(**{key: value}))
    for value in (1, 16, 17):
        with pytest.raises(ValueError, match=f"{key}={value}: give 2..15 bits, 0 \\(float, which a bit-width such as "
                                             "w4a16 spells 16\\) or null"):
            PIPELINES["percentile"].validate(bits, PercentileOptions(**{key: value}))


def test_stem_and_head_bits_of_16_are_refused_before_any_quantizer_is_built():
    # the reviewer's reproducer: it reported head {"w": 4, "a": 16} (float, as --bits reads 16) over a 16-bit grid
    with pytest.raises(ValueError, match="head_a_bits=16: give 2..15 bits"):
        PIPELINES["repq"](tiny_vit(), images(2), "w4a4", {"head_a_bits": 16})
    model, report = PIPELINES["repq"](tiny_vit(), images(2), "w4a4", {"head_a_bits": 15, "stem_w_bits": 0})
    assert report["head"] == {"w": 4, "a": 15} and model.head.input_quantizer.bits == 15
    assert report["stem"]["w"] is None and model.patch_embed.proj.weight_quantizer is None


def test_a_stem_or_head_bits_of_16_recorded_by_an_older_run_is_refused_naming_the_override(checkpoint, tmp_path):
    """A run trained while 16 was taken (it meant float in the reports) records quant.repq.head_a_bits=16 in its
    config, the defaults of `evaluate.py --checkpoint`: the refusal named 16 as a value the user never typed, and no
    way out. It says a run's recorded config may hold it and names the overrides of the full key, and each one it
    names lets the same evaluation through with that value."""
    import re

    import evaluate
    from configs import ConfigError

    payload = torch.load(checkpoint, weights_only=True)
    payload["config"]["quant"]["repq"]["head_a_bits"] = 16  # as such a run's config.yaml and checkpoints hold it
    recorded = tmp_path / "best.pt"
    torch.save(payload, recorded)
    argv = ["--checkpoint", str(recorded), "--quant", "repq", "--bits", "w4a4", "--out", str(tmp_path / "e.json")]
    with pytest.raises(ConfigError) as refused:
        evaluate.resolve_config(evaluate.parse_args(argv))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("quant.repq: head_a_bits=16: give 2..15 bits")
    assert "recorded config" in message and message.count("quant.repq:") == 1
    fixes = re.findall(r"quant\.repq\.head_a_bits=\d+", message)
    assert sorted(fixes) == ["quant.repq.head_a_bits=0", "quant.repq.head_a_bits=15"]
    for fix in fixes:
        cfg, _ = evaluate.resolve_config(evaluate.parse_args(argv + [fix]))
        assert cfg.quant.repq.head_a_bits == int(fix.split("=")[1])
    assert sorted(os.listdir(tmp_path)) == ["best.pt"]  # refused and resolved before any work


def test_a_detector_stem_bits_of_16_names_its_quant_options_spelling():
    """evaluate_detection.py takes pipeline options from --quant-options alone (no recorded config): the refusal of
    16 names the fix in that flag's spelling, and the options it names are taken."""
    import re

    from configs.quant import RepQOptions
    from evaluate_detection import pipeline_options
    from quant.pipeline_base import parse_options

    with pytest.raises(ValueError) as refused:
        PIPELINES["repq"].validate(parse_bits("w4a4"), RepQOptions(stem_w_bits=16), detection=True)
    fixes = re.findall(r"--quant-options (repq\.stem_w_bits=\d+)", str(refused.value))
    assert sorted(fixes) == ["repq.stem_w_bits=0", "repq.stem_w_bits=15"]
    assert "recorded config" not in str(refused.value)
    for fix in fixes:
        options = parse_options(RepQOptions, pipeline_options([fix], ["repq"])["repq"])
        PIPELINES["repq"].validate(parse_bits("w4a4"), options, detection=True)
        assert options.stem_w_bits == int(fix.split("=")[1])

def test_percentile_modes():
    model, _ = PIPELINES["percentile"](tiny_vit(), images(4), "w6a6")
    attn = model.blocks[1].attn
    assert isinstance(attn.attn_quant, UniformQuantizer) and attn.attn_quant.bits == 6
    assert attn.attn_quant.search.method == "percentile_mse"
    assert model.blocks[0].attn.qkv.input_quantizer.channel_dim is None  # per tensor, no reparam
    model, report = PIPELINES["percentile"](tiny_vit(), images(4), "w4a4",
                                            {"act_range": "percentile", "softmax": "log_sqrt2"})
    acts = [q for _, q in named_quantizers(model, "activation")]
    assert all(q.search.method == "percentile" and q.search.percentiles == (0.9999,) for q in acts)
    assert isinstance(model.blocks[0].attn.attn_quant, LogSqrt2Quantizer)
    assert report["options"]["act_range"] == "percentile"
    model, _ = PIPELINES["percentile"](tiny_vit(), images(4), "w4a4", {"weight_range": "percentile"})
    weights = [q for _, q in named_quantizers(model, "weight")]
    assert weights and all(q.search.method == "percentile" and q.search.percentiles == (0.9999,)
                           for q in weights)
    model, _ = PIPELINES["percentile"](tiny_vit(), images(4), "w4a4",
                                       {"weight_range": "percentile", "weight_percentiles": [0.99]})
    assert all(q.search.percentiles == (0.99,) for _, q in named_quantizers(model, "weight"))
    model, _ = PIPELINES["percentile"](tiny_vit(), images(4), "w4a4", {"act_range": "percentile",
                                                                        "act_percentiles": [0.99],
                                                                        "softmax": "log_sqrt2"})
    acts = [q for _, q in named_quantizers(model, "activation")]
    assert any(isinstance(q, LogSqrt2Quantizer) for q in acts)  # the attention quantizer reads them too
    assert acts and all(q.search.percentiles == (0.99,) for q in acts)


@pytest.mark.parametrize("pipeline", ["percentile", "repq"])
def test_quantizers_frozen_during_evaluation(pipeline):
    model, _ = PIPELINES[pipeline](tiny_swin(), images(8), "w4a4")
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        for seed in range(3):
            model(images(4, seed=10 + seed) * (seed + 1) * 3)  # batches with very different ranges
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_evaluate_quantized():
    fp = tiny_vit()
    x = images(16, seed=3)
    labels = fp(x).argmax(1)

    def eval_fn(model):
        return {"top1": 100.0 * (model(x).argmax(1) == labels).float().mean().item()}

    out = evaluate_quantized("repq", fp, images(8), "w8a8", eval_fn)
    assert out["top1"] >= 80.0 and out["seconds"] >= out["eval_seconds"] >= 0
    assert out["report"]["pipeline"] == "repq"
    with pytest.raises(KeyError, match="known"):
        evaluate_quantized("nope", fp, images(8), "w8a8", eval_fn)


def test_percentile_weight_symmetric_gives_signed_codes_with_zero_offset():
    model, _ = PIPELINES["percentile"](tiny_vit(), images(4), "w4a4", {"weight_symmetric": True})
    blocks = [q for name, q in named_quantizers(model, "weight") if name.startswith("blocks.")]
    assert blocks and all(q.symmetric and (q.qmin, q.qmax) == (-8, 7) for q in blocks)
    assert all(torch.equal(q.zero_point, torch.zeros_like(q.zero_point)) for q in blocks)


def official_init_scale(x: torch.Tensor, bits: int):
    """zkkli/RepQ-ViT `UniformQuantizer.init_quantization_scale` for one group (channel_wise=False), restated:
    candidates [q(1 - p), q(p)] for p in 0.999 / 0.9999 / 0.99999 by torch.quantile (np.percentile where
    torch.quantile raises, which older torch did above 2^24 elements), the first of the smallest mean
    squared errors (its lp_loss, reduction 'all') wins. Returns (delta, zero_point)."""
    best_score, delta, zero_point = 1e10, None, None
    for pct in [0.999, 0.9999, 0.99999]:
        try:
            new_max = torch.quantile(x.reshape(-1), pct)
            new_min = torch.quantile(x.reshape(-1), 1.0 - pct)
        except Exception:
            new_max = torch.tensor(np.percentile(x.reshape(-1).cpu(), pct * 100), dtype=torch.float32)
            new_min = torch.tensor(np.percentile(x.reshape(-1).cpu(), (1 - pct) * 100), dtype=torch.float32)
        d = (new_max - new_min) / (2 ** bits - 1)
        z = (-new_min / d).round()
        x_q = (torch.clamp(torch.round(x / d) + z, 0, 2 ** bits - 1) - z) * d
        score = (x - x_q).abs().pow(2).mean()
        if score < best_score:
            best_score, delta, zero_point = score, d, z
    return delta, zero_point


def naive_repq_rows(w: np.ndarray, bits: int) -> np.ndarray:
    """RepQ-ViT's per-output-channel weight quantizer (the official one, one row at a time, in float32)."""
    out = np.empty_like(w)
    for r, row in enumerate(torch.from_numpy(w)):
        delta, zero_point = official_init_scale(row, bits)
        out[r] = ((torch.clamp(torch.round(row / delta) + zero_point, 0, 2 ** bits - 1) - zero_point) * delta).numpy()
    return out


def test_percentile_weights_are_repq_searched_per_output_channel():
    # each output row of a block Linear gets its own percentile-MSE range (per tensor would share one range)
    fp = tiny_vit()
    model, _ = PIPELINES["percentile"](fp, images(4), "w4a4")
    for name in ("blocks.0.attn.qkv", "blocks.1.mlp.fc2"):
        layer = model.get_submodule(name)
        want = naive_repq_rows(fp.get_submodule(name).weight.detach().numpy(), 4)
        np.testing.assert_array_equal(layer.quantized_weight().detach().numpy(), want)


def test_repq_weights_are_repq_searched_per_output_channel_folded_or_not():
    fp = tiny_vit()
    model, _ = PIPELINES["repq"](fp, images(4), "w4a4")
    for name in ("blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.1.mlp.fc1", "blocks.1.mlp.fc2"):
        layer = model.get_submodule(name)  # qkv / fc1: the weight as rescaled by the LayerNorm fold
        want = naive_repq_rows(layer.weight.detach().numpy(), 4)
        np.testing.assert_array_equal(layer.quantized_weight().detach().numpy(), want)


def test_stem_and_head_take_their_own_weight_and_input_bits():
    opts = {"stem_w_bits": 5, "stem_a_bits": 7, "head_w_bits": 6, "head_a_bits": 3}
    model, _ = PIPELINES["percentile"](tiny_vit(depth=1), images(4), "w4a4", opts)
    stem, head = model.patch_embed.proj, model.head
    assert (stem.weight_quantizer.bits, stem.input_quantizer.bits) == (5, 7)
    assert (head.weight_quantizer.bits, head.input_quantizer.bits) == (6, 3)
    # the head's input is a block input (per tensor), not a LayerNorm output with RepQ-ViT's per-channel start
    repq, _ = PIPELINES["repq"](tiny_vit(depth=1), images(4), "w4a4", opts)
    assert repq.head.input_quantizer.channel_dim is None and repq.head.input_quantizer.bits == 3
    assert repq.patch_embed.proj.input_quantizer.channel_dim is None  # likewise the image: per tensor


@pytest.mark.parametrize("text", ["w4a4x", "xw4a4", "w4a4-strict", "w4a4 a8"])
def test_a_bit_width_with_anything_around_it_is_refused(text):
    with pytest.raises(ValueError, match="not of the form"):  # never read as the w4a4 inside it
        parse_bits(text)


def test_only_a_data_parallel_pipeline_records_the_number_of_ranks():
    # GPLQ trains on every rank (the global batch and each shard depend on it); the others give the same result
    # on any number of ranks, and a rank count in their settings would split results that are the same
    from quant.registry import run_settings
    assert run_settings("gplq") == {"world_size": 1}  # one process, not distributed
    assert all(run_settings(name) == {} for name in ("percentile", "repq", "aphq", "rtn", "gptq", "smoothquant"))


def test_repq_on_swin_folds_every_block_norm_and_the_patch_merging_norm_into_per_tensor_inputs():
    # RepQ-ViT reparameterises norm1 -> qkv and norm2 -> fc1 of every block and Swin's PatchMerging
    # norm -> reduction, never the final norm or patch_embed.norm; afterwards every activation quantizer is
    # per tensor, every range a {0.999, 0.9999, 0.99999} percentile-MSE search, post-softmax log-sqrt2
    model, report = PIPELINES["repq"](tiny_swin(), images(4), "w4a4")
    want = {f"layers.{i}.blocks.{j}.{norm} -> layers.{i}.blocks.{j}.{linear}"
            for i in (0, 1) for j in (0, 1) for norm, linear in (("norm1", "attn.qkv"), ("norm2", "mlp.fc1"))}
    want.add("layers.1.downsample.norm -> layers.1.downsample.reduction")
    assert set(report["folded"]) == want
    acts = dict(named_quantizers(model, "activation"))
    assert acts and all(getattr(q, "channel_dim", None) is None for q in acts.values())
    assert all(q.search.method == "percentile_mse" and q.search.percentiles == (0.999, 0.9999, 0.99999)
               for q in acts.values())
    attn = [name for name, q in acts.items() if isinstance(q, LogSqrt2Quantizer)]
    assert len(attn) == 4 and all(name.endswith("attn.attn_quant") for name in attn)


def test_percentile_quantizes_every_activation_per_tensor():
    model, _ = PIPELINES["percentile"](tiny_vit(), images(4), "w4a4")
    acts = dict(named_quantizers(model, "activation"))
    assert acts and all(isinstance(q, UniformQuantizer) and q.channel_dim is None for q in acts.values())
    # at the a of w4a4: the operands of both attention matmuls included; only the image (stem input) takes 8
    assert {name: q.bits for name, q in acts.items() if q.bits != 4} == {"patch_embed.proj.input_quantizer": 8}
    assert {"blocks.0.attn.q_quant", "blocks.0.attn.k_quant", "blocks.0.attn.v_quant"} <= set(acts)


@pytest.mark.parametrize("pipeline", ["percentile", "repq"])
@pytest.mark.parametrize("text, operand", [("w16a4", "weights"), ("w4a16", "activations")])
def test_ptq_pipelines_refuse_a_bit_width_that_keeps_an_operand_float(pipeline, text, operand):
    # both quantize weights and activations: 16 bits (float) on either side would run a different method
    with pytest.raises(ValueError, match=f"quantizes {operand}: {text} keeps them float"):
        PIPELINES[pipeline].validate(parse_bits(text), PIPELINES[pipeline].Options())


@pytest.mark.parametrize("operand", ["act", "weight"])
def test_percentile_levels_that_the_range_rule_would_not_read_are_refused(operand):
    # minmax reads no percentile, and an empty level list has none: either would run silently on other ranges
    from configs.quant import PercentileOptions
    bits = parse_bits("w4a4")
    with pytest.raises(ValueError, match=f"{operand}_percentiles=\\[0.99\\]: {operand}_range=minmax reads no"):
        PIPELINES["percentile"].validate(bits, PercentileOptions(**{f"{operand}_range": "minmax",
                                                                    f"{operand}_percentiles": (0.99,)}))
    with pytest.raises(ValueError, match=f"{operand}_percentiles=\\[\\]: give at least one level"):
        PIPELINES["percentile"].validate(bits, PercentileOptions(**{f"{operand}_percentiles": ()}))


def test_pipeline_data_names_what_a_pipeline_lacks_and_builds_work_paths_only_from_a_prefix():
    """require_data: not a PipelineData, no image source (train_images or detector_samples), and no train_loader
    when one is asked for are each refused by what is missing; each source alone is accepted (returned as is)."""
    from quant.pipeline_data import PipelineData, require_data

    def draw(*args):
        raise AssertionError("require_data must not draw")

    with pytest.raises(ValueError, match=r"the 'aphq' pipeline draws its own training images: pass data=PipelineData"):
        require_data("aphq", None)
    with pytest.raises(ValueError,
                       match=r"PipelineData.train_images \(or detector_samples for a detector\) is required"):
        require_data("aphq", PipelineData(train_loader=draw))
    for data in (PipelineData(train_images=draw), PipelineData(detector_samples=draw)):
        assert require_data("aphq", data) is data
    with pytest.raises(ValueError, match=r"the 'gplq' pipeline trains: PipelineData.train_loader is required"):
        require_data("gplq", PipelineData(train_images=draw), loader=True)
    both = PipelineData(train_images=draw, train_loader=draw)
    assert require_data("gplq", both, loader=True) is both
    assert PipelineData().work_path("_gplq_w4a4_stage1.pt") is None  # no prefix: nothing is written
    assert PipelineData(work_prefix="runs/x/eval_best").work_path("_gplq_w4a4_stage1.pt") == \
        "runs/x/eval_best_gplq_w4a4_stage1.pt"
