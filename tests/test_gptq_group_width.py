"""A GPTQ / RTN group holds group_size input columns of one output channel: at a group_size no narrower than every
quantized Linear's in_features, each output channel is one group, the per-channel grid of the default. Such a
group_size is refused before any work (it would be recorded as a grouped run of per-channel weights), through the API
and in evaluate.py's one error line naming model.name; a group_size narrower than the widest layer is taken."""
import pytest
import torch
from torch import nn

from configs import load_config
from models.factory import build_model
from models.gpt import build_gpt
from quant import PIPELINES
from quant.spec import parse_bits
from tests.conftest import DEMO_CONFIG, run_entry

pytestmark = pytest.mark.usefixtures("one_thread")

IN_BLOCK = ("qkv", "proj", "fc1", "fc2")  # the Linears rtn / gptq quantize (quant/layout.py in_block_layout)


def gpt():
    torch.manual_seed(0)
    return build_gpt("gpt2_nano", vocab_size=64).eval()


def calibration():
    return torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(0))


def widest_in_block(model: nn.Module) -> int:
    """The widest in_features of the blocks' Linears, read off the float model (the head, 32 wide, stays float)."""
    return max(m.in_features for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and n.startswith("blocks.") and n.rsplit(".", 1)[-1] in IN_BLOCK)


def per_channel_rtn(w: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """GPTQ's asymmetric per-output-channel grid written out (IST-DASLab/gptq quant.py find_params, --nearest): the
    range includes 0, an all-zero row gets [-1, 1], and each weight is rounded to the nearest level."""
    lo, hi = w.min(1, keepdim=True).values.clamp(max=0), w.max(1, keepdim=True).values.clamp(min=0)
    empty = (lo == 0) & (hi == 0)
    lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
    qmax = 2 ** bits - 1
    scale = (hi - lo) / qmax
    zero = torch.round(-lo / scale)
    return scale * (torch.clamp(torch.round(w / scale) + zero, 0, qmax) - zero)


def quantized_weights(model: nn.Module) -> dict:
    return {n: m.quantized_weight() for n, m in model.named_modules() if hasattr(m, "quantized_weight")}


def test_a_group_as_wide_as_the_layer_is_the_per_channel_grid():
    """The premise of the refusal, against the grid written out: run past the check (`run`), RTN with one group the
    width of the widest layer gives every layer's per-channel weights, and a narrower group changes some."""
    model, pipeline = gpt(), PIPELINES["rtn"]
    width = widest_in_block(model)
    floats = {n: m.weight.detach() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for group_size in (width, 4 * width):
        q, _ = pipeline.run(model, None, parse_bits("w4a16"), pipeline.Options(group_size=group_size))
        weights = quantized_weights(q)
        assert len(weights) == 8
        for name, w in weights.items():
            torch.testing.assert_close(w, per_channel_rtn(floats[name]), rtol=0, atol=1e-6)
    q, _ = pipeline.run(model, None, parse_bits("w4a16"), pipeline.Options(group_size=width - 1))
    assert any(not torch.allclose(w, per_channel_rtn(floats[n]), atol=1e-6) for n, w in quantized_weights(q).items())


@pytest.mark.parametrize("name, options", [
    ("gptq", {"group_size": 4096, "static_groups": True}), ("gptq", {"group_size": 128}),
    ("rtn", {"group_size": 128}), ("rtn", {"group_size": 1000})])
def test_the_api_refuses_a_group_no_narrower_than_every_quantized_layer(name, options):
    model = gpt()
    assert widest_in_block(model) == 128
    with pytest.raises(ValueError, match=rf"^quant\.{name}\.group_size={options['group_size']} would be ignored: the "
                                         rf"widest Linear {name} quantizes here \(blocks\.0\.mlp\.fc2\) has 128 input "
                                         rf"columns, .*give quant\.{name}\.group_size below 128$") as refused:
        PIPELINES[name](model, calibration(), "w4a16", options)
    # static_groups needs group_size: the fix names both where both were given
    assert ("static_groups" in str(refused.value)) == ("static_groups" in options)


@pytest.mark.parametrize("name", ["rtn", "gptq"])
def test_a_group_narrower_than_the_widest_layer_is_taken(name):
    _, report = PIPELINES[name](gpt(), calibration(), "w4a16", {"group_size": 127})
    assert report["options"]["group_size"] == 127


def test_evaluate_refuses_it_with_one_error_line(tmp_path, capsys):
    cfg = load_config([DEMO_CONFIG])
    weights = tmp_path / "w.pt"
    model = build_model(cfg.model)
    torch.save(model.state_dict(), weights)
    width = widest_in_block(model)
    code, _, err = run_entry("evaluate.py", [
        "--config", DEMO_CONFIG, f"model.pretrained={weights}", "--quant", "gptq", "--bits", "w4a16",
        f"quant.gptq.group_size={width}", "quant.gptq.static_groups=true", "--out", str(tmp_path / "r.json")],
        capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, err
    assert lines[0].startswith(f"error: model.name={cfg.model.name}: quant.gptq.group_size={width} would be ignored: "
                               f"the widest Linear gptq quantizes here"), lines[0]
    assert not (tmp_path / "r.json").exists()
