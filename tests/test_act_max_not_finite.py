"""A NaN or inf `max` in an activation-maxima CSV (a model whose activations overflowed) is refused where the rows
are read, naming the file and line: dose_report.read_act_max (dose_report.py, lm_study.py) and compare_act_max.py's
per_block used to let it through, and the largest value of a type or block (max() ignores a NaN after the first
value) was then the other modules' maximum. A NaN kurtosis (an output too near a constant to resolve) stays a value
the per-type table leaves out.

Where they are measured (engine.act_max.ActivationProbe): an output that is NaN (an fp16 overflow's inf - inf) was
a record of max NaN, which Python's max() of the records skips, so act/max_block was the largest of the other blocks'
outputs; it is inf, and the largest kurtosis of its kind NaN (not known)."""
import contextlib
import math

import pytest
import torch
from torch import nn

from engine.act_max import ActivationProbe
from quant_models import images, tiny_swin, tiny_vit
from test_compare_act_max import load as load_compare, run_rows, write as write_act_max
from test_lm_study import write_run
from tests.conftest import run_entry

import dose_report

HEADER = "name,kind,block,type,max,kurtosis\n"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_read_act_max_names_the_file_and_line_of_a_max_that_is_not_finite(tmp_path, value):
    path = tmp_path / "eval_best_act_max.csv"
    path.write_text(HEADER + "blocks.0.mlp.fc2,module,0,mlp.fc2,2.0,4.0\n"
                    f"blocks.1.mlp.fc2,module,1,mlp.fc2,{value},4.0\n" + "blocks.1,block,1,block,5.0,3.0\n")
    with pytest.raises(dose_report.ReportError, match=rf"eval_best_act_max.csv, line 3: max '{value}' is not a "
                                                      r"finite number: the model's activations overflowed"):
        dose_report.read_act_max(str(path))


def test_a_nan_kurtosis_is_read_and_left_out_of_the_largest_kurtosis_of_its_type(tmp_path):
    path = tmp_path / "eval_best_act_max.csv"
    path.write_text(HEADER + "blocks.0.mlp.fc2,module,0,mlp.fc2,2.0,nan\nblocks.1.mlp.fc2,module,1,mlp.fc2,3.0,7.5\n"
                    "blocks.1.norm1,module,1,norm1,1.5,nan\nblocks.1,block,1,block,5.0,3.0\n")
    run = dose_report.Run("p", 0, str(tmp_path), {}, {}, dose_report.read_act_max(str(path)))
    # by hand: mlp.fc2's maxima 2.0 and 3.0, its kurtosis 7.5 (the NaN is no value); norm1 has no kurtosis at all
    assert dose_report.type_maxima(run) == {"mlp.fc2": 3.0, "norm1": 1.5, "block": 5.0}
    assert dose_report.type_maxima(run, "kurtosis") == {"mlp.fc2": 7.5, "block": 3.0}


def test_lm_study_refuses_a_run_with_a_nan_max_in_one_error_line(tmp_path, capsys):
    root = tmp_path / "sweep"
    root.mkdir()
    for name in ("baseline_s0", "baseline_s1"):
        write_run(root, name, ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
    csv_path = root / "baseline_s1" / "eval_best_act_max.csv"
    csv_path.write_text(csv_path.read_text().replace("mlp.fc2,3.0,", "mlp.fc2,nan,"))
    code, out, err = run_entry("scripts/lm_study.py", [str(root), "--out", str(tmp_path / "out")], capsys)
    assert isinstance(code, str) and "\n" not in code and not out and not err, (code, err)
    assert code.startswith(f"error: {csv_path}, line 3: max 'nan' is not a finite number"), code
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["module", "block", "outside"])
def test_compare_act_max_refuses_a_max_that_is_not_finite_naming_file_and_line(tmp_path, kind):
    compare = load_compare()
    write_act_max(tmp_path / "a_s0_act_max.csv", run_rows([1.0, 4.0], [10.0, 2.0], [3.0, 7.0]))
    rows = run_rows([3.0, 6.0], [20.0, 1.0], [5.0, 9.0])
    # rows: block 0 output, norm1, fc2, block 1 output, norm1, fc2, the final norm (block -1); line = index + 2
    index = {"module": 1, "block": 3, "outside": 6}[kind]
    rows[index]["max"] = float("nan")
    write_act_max(tmp_path / "a_s1_act_max.csv", rows, checkpoint=str(tmp_path / "other.pt"))
    with pytest.raises(SystemExit, match=rf"error: .*a_s1_act_max.csv, line {index + 2}: max nan is not a finite "
                                         r"number: the model's activations overflowed"):
        compare.main([f"a={tmp_path}/a_s*_act_max.csv", "--out", str(tmp_path / "cmp")])
    assert not (tmp_path / "cmp.csv").exists()


def overflowing_vit():
    """A tiny ViT whose last block's fc1 overflows fp16 at the patch tokens only (their position embedding's large
    channel 0, which two fc1 rows read 2e4 times, and fc2 adds them with opposite signs: inf - inf = NaN); the cls
    token that the head reads stays finite."""
    model = tiny_vit()
    with torch.no_grad():
        model.pos_embed[0, 1:, 0] = 50.0
        fc1, fc2 = model.blocks[-1].mlp.fc1, model.blocks[-1].mlp.fc2
        fc1.weight[:, 0] = 0.0
        fc1.weight[0:2, 0] = 2e4
        fc2.weight[:, 0], fc2.weight[:, 1] = 1.0, -1.0
    return model


def test_a_nan_block_output_under_fp16_autocast_is_an_infinite_block_maximum():
    model = overflowing_vit()
    outputs = {}  # the reference: every block output, kept by the test's own hooks
    handles = [block.register_forward_hook(lambda m, i, o, n=n: outputs.__setitem__(n, o.detach()))
               for n, block in enumerate(model.blocks)]
    with torch.no_grad(), ActivationProbe(model, moments=True) as probe, torch.autocast("cpu", dtype=torch.float16):
        logits = model(images(4))
    for handle in handles:
        handle.remove()
    # the premise: the logits are finite (the FP pass scores them), block 0's output too, block 1's has NaN
    assert torch.isfinite(logits).all() and torch.isfinite(outputs[0]).all() and outputs[1].isnan().any()
    result = probe.result()
    assert result.block == math.inf and result.module == math.inf  # was block 0's maximum, 51.3
    assert {r["name"]: r["max"] for r in result.per_layer}["blocks.1"] == math.inf
    assert not probe.maxima().isnan().any()  # a MAX all-reduce keeps it on every rank
    metrics = result.metrics()
    assert math.isnan(metrics["act/kurtosis_block"]) and math.isnan(metrics["act/kurtosis_module"])


def test_finite_outputs_keep_their_largest_kurtosis():
    model = tiny_vit()
    with torch.no_grad(), ActivationProbe(model, moments=True) as probe:
        model(images(4))
    result = probe.result()
    kurtosis = [r["kurtosis"] for r in result.per_layer if r["kind"] == "block"]
    assert math.isfinite(result.block) and result.metrics()["act/kurtosis_block"] == max(kurtosis)


@contextlib.contextmanager
def calls_in_order(model):
    """The reference: every module's call as plain forward hooks see it, in the order they fire, as (name, its inputs
    are finite, its output is finite), for the forwards inside the `with`."""
    calls = []

    def finite(values):
        values = values if isinstance(values, (tuple, list)) else (values,)
        return all(bool(v.isfinite().all()) for v in values if isinstance(v, torch.Tensor) and v.is_floating_point())

    handles = [m.register_forward_hook(lambda m, i, o, n=n: calls.append((n, finite(i), finite(o))))
               for n, m in model.named_modules()]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("arch", ["swin", "vit"])
def test_an_overflow_in_the_attention_is_named_at_the_first_output_the_forward_computed_not_finite(arch, fused):
    """The last block's q @ k past fp32's largest (its qkv's column 0 at 1e20: q, k and the qkv output finite): on
    timm Swin's unfused path its softmax module reads the inf and gives NaN first, but the records were searched in
    the order the modules are registered, where the softmax comes after proj, so the error named proj. It names the
    first output not finite in the forward's order, as plain forward hooks see it (Swin's softmax unfused, else the
    proj, fused attention or timm ViT's functional softmax), and that the value it read was not finite already,
    computed in the attention's forward (which read a finite input)."""
    import evaluate

    model = tiny_swin() if arch == "swin" else tiny_vit()
    attention = "layers.1.blocks.1.attn" if arch == "swin" else "blocks.1.attn"
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = fused
    with torch.no_grad():
        model.get_submodule(f"{attention}.qkv").weight[:, 0] = 1e20
    with calls_in_order(model) as calls, torch.no_grad(), ActivationProbe(model) as probe:
        model(images(2))
    probed = set(probe.names())
    bad = [(name, read_finite) for name, read_finite, finite in calls if name in probed and not finite]
    first, read_finite = bad[0]
    # the premises: the first is the softmax where it is a module that ran, else the proj; it read a value not finite
    # (q @ k, computed in the attention's forward), and the attention itself read a finite input
    assert first == f"{attention}.{'softmax' if arch == 'swin' and not fused else 'proj'}" and not read_finite
    assert [finite for name, finite, _ in calls if name == attention] == [True]
    with pytest.raises(evaluate.NonFiniteLossError) as error:
        evaluate.check_finite_maxima(probe.result().per_layer, "none")
    # the records of the outputs not finite: each probed module's once, however often it ran
    assert str(error.value).startswith(f"activation maxima: the output of {first} and {len({n for n, _ in bad}) - 1} "
                                       "more is not finite (inf or NaN) on the val images")
    assert (f"; {first} read a value that was not finite already, computed in {attention}'s forward outside the "
            "modules measured in it") in str(error.value)


def test_an_overflow_of_a_modules_own_output_is_named_without_a_note_on_its_input():
    """overflowing_vit's fc1 makes its own inf from a finite input (the reference: plain hooks in call order)."""
    import evaluate

    model = overflowing_vit()
    with calls_in_order(model) as calls, torch.no_grad(), ActivationProbe(model) as probe, \
            torch.autocast("cpu", dtype=torch.float16):
        model(images(4))
    probed = set(probe.names())
    first = next((name, read_finite) for name, read_finite, finite in calls if name in probed and not finite)
    assert first == ("blocks.1.mlp.fc1", True)
    with pytest.raises(evaluate.NonFiniteLossError, match=r"^activation maxima: the output of blocks\.1\.mlp\.fc1 "
                                                          r"and \d+ more is not finite \(inf or NaN\) on the val "
                                                          r"images, so it has no maximum and nothing is written; "
                                                          r"under --amp fp16"):
        evaluate.check_finite_maxima(probe.result().per_layer, "fp16")


@pytest.mark.detection  # MMDetection needs full mmcv (scripts/install_mmcv.sh): CI's detection step runs it
def test_an_overflow_in_mmdetection_swins_attention_is_named_at_its_softmax():
    """MMDetection's WindowMSA registers its softmax after proj: an inf q @ k (qkv's column 0 at 1e20), which the
    softmax reads and makes NaN, was named at proj; it is named at the softmax, the first output not finite as plain
    forward hooks see them, with the value it read computed in w_msa's forward."""
    from engine.detection import DetectionError
    from engine.detection.evaluation import BACKBONE, HEADS, activation_maxima
    from test_act_max_padded_windows import tiny_mmdet_detector

    torch.manual_seed(0)
    model = tiny_mmdet_detector().eval()
    msa = "backbone.stages.0.blocks.1.attn.w_msa"
    with torch.no_grad():
        model.get_submodule(f"{msa}.qkv").weight[:, 0] = 1e20
    with calls_in_order(model) as calls, torch.no_grad(), ActivationProbe(model, blocks=BACKBONE + HEADS) as probe:
        model(torch.randn(1, 3, 16, 16))
    probed = set(probe.names())
    bad = [(name, read_finite) for name, read_finite, finite in calls if name in probed and not finite]
    assert bad[0] == (f"{msa}.softmax", False)  # the premise: the softmax reads the inf
    with pytest.raises(DetectionError) as error:
        activation_maxima(probe, torch.device("cpu"))
    assert str(error.value).startswith(f"activation maxima: the output of {msa}.softmax and "
                                       f"{len({n for n, _ in bad}) - 1} more is not finite (inf or NaN)")
    assert f"computed in {msa}'s forward outside the modules measured in it" in str(error.value)


def test_a_value_not_finite_from_before_the_blocks_is_named_so():
    """A position embedding of inf (added in the model's forward, before the blocks, where no module is measured):
    block 0's norm1 is the first output not finite and it read the inf, as its block did (the reference: plain hooks
    in call order), so the value came from before the block."""
    import evaluate

    model = tiny_vit()
    with torch.no_grad():
        model.pos_embed[0, 1:, 0] = float("inf")
    with calls_in_order(model) as calls, torch.no_grad(), ActivationProbe(model) as probe:
        model(images(2))
    probed = set(probe.names())
    reads = {name: read_finite for name, read_finite, _ in calls}
    first = next(name for name, _, finite in calls if name in probed and not finite)
    assert first == "blocks.0.norm1" and not reads["blocks.0.norm1"] and not reads["blocks.0"]
    with pytest.raises(evaluate.NonFiniteLossError, match=r"; blocks\.0\.norm1 read a value that was not finite "
                                                          r"already, computed before blocks\.0 outside the modules "
                                                          r"measured; the weights' activations overflow"):
        evaluate.check_finite_maxima(probe.result().per_layer, "none")


class SharedLinearTwice(nn.Module):
    """Blocks that run one Linear twice (a module shared within the forward, as weight-shared layers run theirs)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"lin": nn.Linear(4, 4)}) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block["lin"](block["lin"](x))
        return x


def test_a_module_that_overflows_then_reads_its_own_inf_is_named_as_making_it():
    """blocks.1's lin overflows in its first call (4 inputs of 16 times 1e38) and reads that inf in its second: the
    module was flagged as reading a value not finite already, and the error said the value was computed outside the
    modules measured, in its parent's forward. As plain forward hooks see it (the reference), the first call whose
    output is not finite read a finite input: the error names lin with no note on its input."""
    import evaluate

    model = SharedLinearTwice()
    with torch.no_grad():
        for block, weight in zip(model.blocks, (1.0, 1e38)):
            block.lin.weight.fill_(weight)
            block.lin.bias.zero_()
    with calls_in_order(model) as calls, torch.no_grad(), ActivationProbe(model, blocks=("blocks.*",)) as probe:
        model(torch.ones(2, 4))
    # the premise: (input finite, output finite) of its two calls
    assert [(read, out) for name, read, out in calls if name == "blocks.1.lin"] == [(True, False), (False, False)]
    with pytest.raises(evaluate.NonFiniteLossError) as error:
        evaluate.check_finite_maxima(probe.result().per_layer, "none")
    assert str(error.value).startswith("activation maxima: the output of blocks.1.lin is not finite")
    assert "read a value that was not finite already" not in str(error.value)
