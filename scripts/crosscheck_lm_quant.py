r"""Cross-check of the LM pipelines (quant/gptq/, quant/smoothquant/) against the official GPTQ and SmoothQuant code.

    python scripts/crosscheck_lm_quant.py --gptq /tmp/gptq_official --smoothquant /tmp/smoothquant_official \
        --out runs/lm_xcheck/xcheck.json --threads 2

The official checkouts are read, never copied into this repository: their modules are imported from the
given folders at run time (e.g. `git clone https://github.com/IST-DASLab/gptq /tmp/gptq_official`, checked at
commit 2d65066; `git clone https://github.com/mit-han-lab/smoothquant /tmp/smoothquant_official`, c61476d).

1. Model and text: a small GPT (models/gpt.py, `--model`, vocabulary = the 256 byte values) trained for
   `--steps` AdamW updates on the Python standard library's own source files (real text that ships with
   every Python; the top-level `*.py` files in sorted order, the last tenth of them held out). The float
   weights are saved next to --out (`<out>.lm.pt`, whole or not at all: an interrupted save leaves the file
   as it was; a training that diverges, a loss or weight that is not finite, saves nothing) and reused by a
   re-run with the same settings.
2. The same tensors for both: `--calib` training windows of the model's context, drawn with seed 0
   (GPTQ and SmoothQuant calibration), and `--eval-windows` consecutive held-out windows. Perplexity =
   exp(mean next-token cross-entropy), one window per forward (as both official perplexity evaluations).
3. Per setting, ours (`quant.PIPELINES`) and theirs on deep copies of the same float model:
   rtn          their `opt.py --nearest` branch: Quantizer(perchannel, asym) + quantize on every block Linear
   gptq         their GPTQ class and Quantizer driven by `opt_sequential` (transcribed, see 1 below):
                the defaults, ours with batch_size=1 (their accumulation order) and with our default 8;
                act_order with groups of 32 (smaller than the 128-column blocks); sym + act_order +
                static groups of 64
   smoothquant  their get_act_scales + smooth_ln_fcs + W8A8Linear(per_channel, per_token)
   smoothquant, quantize_bmm=qkv      ... + quantize_bmm_input=True (their ppl_eval.py setting)
   smoothquant, weight_granularity=tensor
                W8A8Linear(per_tensor, per_token) on q_proj, k_proj, v_proj (one weight scale each), out_proj,
                fc1, fc2 (their quantize_opt's per-tensor weights)
   smoothquant_strict, act_calibration=dynamic, quantize_bmm=qkv
                W8A8Linear(per_channel, per_tensor) + quantize_bmm_input=True (their fake_quant.py strict)
   smoothquant_strict (defaults: static per-tensor, q/k/v and probabilities quantized)
                their get_static_decoder_layer_scales on the smoothed float model, with the int8 arithmetic of
                their real-INT8 OPT (torch-int) emulated here (see 4 below)
   Reported: perplexities, and for the weight-only settings the max |difference| of every quantized
   weight and the fraction of differing entries; for SmoothQuant the same for the smoothed, quantized
   weights and the smoothed LayerNorms.

Adaptations of the official code (in this process only; none changes what is computed):
 1. GPTQ: their `opt_sequential` is OPT-specific (model.model.decoder, attention masks, fp16 on CUDA): its
    steps are transcribed onto our blocks: block 0's inputs caught one window at a time, then per block
    add_batch hooks on `find_layers(block)`, one window per forward, `fasterquant` of each Linear, the
    outputs recomputed with the quantized block. Their `quant.py` is imported under the name `quant` only
    while their gptq.py imports it (our package has the same name). `torch.cuda.synchronize` (called
    unconditionally in fasterquant) is a no-op on this CPU-only machine during their calls.
 2. SmoothQuant's calibration.py loads the Pile with `datasets` and tokenizes text: a stand-in `datasets`
    module serves our calibration windows as text (bytes as latin-1 characters) and a byte tokenizer gives
    the same ids back, so their get_act_scales / get_static_decoder_layer_scales run unchanged on our
    windows (their shuffle is the identity here: they take maxima, which no order changes).
    get_static_decoder_layer_scales ends with an OPT-only loop over model.config.num_hidden_layers: the
    reference model reports 0 layers, and the act_dict it returns is used.
 3. GPT-2 fuses q, k and v into one Linear; their fake quantization of the attention matmuls quantizes
    the outputs of OPT's three q / k / v projections, each with its own range, and their per-tensor weights
    give each projection its own weight scale. For those settings the reference model splits the fused
    Linear into q_proj, k_proj, v_proj (the same rows) and is smoothed as their smooth_lm smooths OPT (one
    scale vector for the three).
 4. Their static W8A8 exists only as real-INT8 CUDA kernels (torch-int, OPT only). The script emulates
    that arithmetic on their static scales: int8 = clamp(round(x / s), -128, 127) for every block Linear's
    input and the q / k / v projection outputs (s = max|x| / 127 from get_static_decoder_layer_scales),
    weights by their quantize_weight_per_channel_absmax, softmax probabilities round(p * 127) / 127.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import glob
import importlib
import io
import math
import os
import platform
import re
import sys
import sysconfig
import time
import types
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from configs.cli import OneLineParser, at_least, first_line  # noqa: E402
from engine.outputs import refuse_others_files, write_json  # noqa: E402
from engine.run_dir import RunDirError, refuse_existing_outputs, write_whole  # noqa: E402
from models.gpt import GPT_SIZES, build_gpt  # noqa: E402
from quant import PIPELINES  # noqa: E402
from quant.layers import QuantLinear  # noqa: E402

BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
# By these --overwrite knows its own results JSON (engine.outputs.refuse_others_files): keys every run writes, which
# another's JSON at that name (evaluate.py's has "fp" alone) is unlikely to hold both of
SOURCE = "scripts/crosscheck_lm_quant.py"
RESULT_KEYS = ("fp", "setup")


# -- data and the small model --------------------------------------------------------------------------
def corpus() -> tuple:
    """(train bytes, held-out bytes) of the standard library's top-level source files, as uint8 tensors."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if len(files) < 20:
        raise SystemExit(f"error: found only {len(files)} standard-library source files")
    cut = len(files) * 9 // 10
    read = lambda names: torch.frombuffer(bytearray(b"".join(open(f, "rb").read() for f in names)),  # noqa: E731
                                          dtype=torch.uint8).long()
    return read(files[:cut]), read(files[cut:])


def learning_rate(text: str) -> float:
    """An argparse `type` for --lr: a finite number above 0. inf (or a NaN) trains a model of NaN weights, which
    would be saved as the float model and reloaded by every later run with the same flags."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text}: give a finite learning rate above 0")
    return value


learning_rate.__name__ = "float"  # argparse's "invalid float value" for text that is no number


def eval_windows_problem(args: argparse.Namespace, held_out: torch.Tensor) -> Optional[str]:
    """Why --eval-windows asks for more windows than the held-out text holds (None if it does not): the one
    argument check that needs the text, made before anything is written or trained."""
    ctx = GPT_SIZES[args.model]["context"]
    available = len(held_out) // ctx
    if args.eval_windows > available:
        return (f"--eval-windows {args.eval_windows}: the held-out text has {available} windows of {ctx} tokens "
                f"({args.model}); give at most that")
    return None


def train_model(args: argparse.Namespace, train: torch.Tensor) -> nn.Module:
    """The float model: loaded from the weights file when it matches the settings, else trained (AdamW)."""
    path = f"{os.path.splitext(args.out)[0]}.lm.pt"
    settings = {"model": args.model, "steps": args.steps, "lr": args.lr, "batch": args.batch, "seed": args.seed}
    torch.manual_seed(args.seed)
    model = build_gpt(args.model, vocab_size=256)
    if os.path.exists(path):
        try:
            saved = torch.load(path, weights_only=True)
            same = saved["settings"] == settings
        except Exception as e:  # noqa: BLE001 (any unreadable file: not one this script wrote)
            # the reason's first line only: torch.load's weights_only refusal runs over six lines, and the
            # error is one line
            reason = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
            raise SystemExit(f"error: {path} exists and is not a float model of this script ({reason}); move it "
                             f"away or give --out another name")
        if same:
            model.load_state_dict(saved["model"])
            return model.eval()
        if not args.overwrite:
            raise SystemExit(f"error: {path} holds a float model of other settings ({saved['settings']}, now "
                             f"{settings}); --overwrite retrains and replaces it, or give --out another name")
    ctx, g = model.context, torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    start = time.perf_counter()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(len(train) - ctx - 1, (args.batch,), generator=g)
        x = torch.stack([train[i:i + ctx + 1] for i in idx.tolist()])
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        if not torch.isfinite(loss):  # diverged: saved, it would be reloaded as the trained model by later runs
            raise SystemExit(f"error: the float model's training loss is {loss.item()} at step {step} (--lr "
                             f"{args.lr}): the training diverged and nothing was saved; give a smaller --lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"train step {step}: loss {loss.item():.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):  # the last update's, after its loss
        raise SystemExit(f"error: the float model's weights are not finite after {args.steps} steps (--lr {args.lr}): "
                         f"the training diverged and nothing was saved; give a smaller --lr")
    payload = {"settings": settings, "model": model.state_dict()}
    # --out's folder is made here, with the first file in it: a refused command or a diverged training leaves none
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:  # whole or not at all: an interrupted save leaves no torn file, and --overwrite keeps the old one until then
        write_whole(path, lambda tmp: torch.save(payload, tmp), overwrite=args.overwrite)
    except RunDirError as e:  # without --overwrite, another command wrote the file since this one looked
        raise SystemExit(f"error: {e}")
    return model.eval()


@torch.no_grad()
def perplexity(model: nn.Module, windows: torch.Tensor) -> float:
    """exp(mean next-token cross-entropy) over the windows, one window per forward."""
    nll, count = 0.0, 0
    for w in windows:
        logits = model(w[None])[0, :-1].float()
        nll += F.cross_entropy(logits, w[1:], reduction="sum").item()
        count += w.numel() - 1
    return math.exp(nll / count)


# -- official code -------------------------------------------------------------------------------------
@contextlib.contextmanager
def no_cuda_sync():
    """Adaptation 1: their fasterquant calls torch.cuda.synchronize() unconditionally."""
    saved = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.synchronize = saved


def load_gptq(path: str) -> types.SimpleNamespace:
    """Their gptq.py, quant.py and modelutils.py; their `quant` is importable as `quant` only meanwhile."""
    ours = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "quant" or k.startswith("quant.")}
    sys.path.insert(0, path)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # "CUDA extension not installed."
            quant_mod = importlib.import_module("quant")
            gptq_mod = importlib.import_module("gptq")
            modelutils = importlib.import_module("modelutils")
    finally:
        sys.path.remove(path)
        sys.modules.pop("quant", None)
        sys.modules.update(ours)
    return types.SimpleNamespace(quant=quant_mod, gptq=gptq_mod, modelutils=modelutils)


# GPTQ settings compared: ours' options -> their fasterquant / Quantizer arguments
GPTQ_SETTINGS = [
    ({}, dict(sym=False, groupsize=-1, actorder=False, static_groups=False)),  # the defaults of both
    ({"act_order": True, "group_size": 32}, dict(sym=False, groupsize=32, actorder=True, static_groups=False)),
    ({"symmetric": True, "act_order": True, "group_size": 64, "static_groups": True},
     dict(sym=True, groupsize=64, actorder=True, static_groups=True)),
]


def official_rtn(g: types.SimpleNamespace, model: nn.Module, wbits: int) -> nn.Module:
    """opt.py's `--nearest` branch of opt_eval, on every block."""
    model = copy.deepcopy(model)
    for block in model.blocks:
        for _, layer in g.modelutils.find_layers(block).items():
            quantizer = g.quant.Quantizer()
            quantizer.configure(wbits, perchannel=True, sym=False, mse=False)
            W = layer.weight.data
            quantizer.find_params(W, weight=True)
            layer.weight.data = g.quant.quantize(W, quantizer.scale, quantizer.zero, quantizer.maxq).to(W.dtype)
    return model


@torch.no_grad()
def official_gptq(g: types.SimpleNamespace, model: nn.Module, calib: torch.Tensor, wbits: int, sym: bool,
                  groupsize: int, actorder: bool, static_groups: bool) -> tuple:
    """opt_sequential transcribed onto our blocks (adaptation 1). Returns (model, their printed errors)."""
    model = copy.deepcopy(model)
    layers, inps = model.blocks, []

    class Catcher(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, inp: torch.Tensor) -> torch.Tensor:
            inps.append(inp)
            raise ValueError

    layers[0] = Catcher(layers[0])
    for j in range(len(calib)):
        try:
            model(calib[j:j + 1])
        except ValueError:
            pass
    layers[0] = layers[0].module
    inps = torch.cat(inps)
    outs = torch.zeros_like(inps)
    printed = io.StringIO()
    for layer in layers:
        subset = g.modelutils.find_layers(layer)
        gptq = {}
        for name in subset:
            gptq[name] = g.gptq.GPTQ(subset[name])
            gptq[name].quantizer = g.quant.Quantizer()
            gptq[name].quantizer.configure(wbits, perchannel=True, sym=sym, mse=False)

        def add_batch(name):
            def tmp(_, inp, out):
                gptq[name].add_batch(inp[0].data, out.data)
            return tmp
        handles = [subset[name].register_forward_hook(add_batch(name)) for name in subset]
        for j in range(len(calib)):
            outs[j] = layer(inps[j].unsqueeze(0))[0]
        for h in handles:
            h.remove()
        with no_cuda_sync(), contextlib.redirect_stdout(printed):
            for name in subset:
                gptq[name].fasterquant(percdamp=0.01, groupsize=groupsize, actorder=actorder,
                                       static_groups=static_groups)
                gptq[name].free()
        for j in range(len(calib)):
            outs[j] = layer(inps[j].unsqueeze(0))[0]
        inps, outs = outs, inps
    errors = [float(e) for e in re.findall(r"^error (\S+)$", printed.getvalue(), flags=re.M)]
    return model, errors


class _Windows:
    """Adaptation 2: what their calibration code reads from `datasets.load_dataset(...)`: our windows."""

    def __init__(self, windows: torch.Tensor) -> None:
        self.texts = [bytes(w.tolist()).decode("latin-1") for w in windows]

    def shuffle(self, seed: int) -> "_Windows":
        return self

    def __getitem__(self, i: int) -> dict:
        return {"text": self.texts[i]}


class _ByteTokenizer:
    def __call__(self, text: str, return_tensors: str, max_length: int, truncation: bool):
        return types.SimpleNamespace(input_ids=torch.tensor([list(text.encode("latin-1"))[:max_length]]))


def load_smoothquant(path: str, calib: torch.Tensor) -> types.SimpleNamespace:
    """Their smooth.py, fake_quant.py and calibration.py (the latter with the stand-in `datasets`)."""
    stub = types.ModuleType("datasets")
    stub.load_dataset = lambda *a, **k: _Windows(calib)
    saved = sys.modules.get("datasets")
    sys.modules["datasets"] = stub
    sys.path.insert(0, path)
    try:
        mods = {name: importlib.import_module(f"smoothquant.{name}")
                for name in ("smooth", "fake_quant", "calibration")}
    finally:
        sys.path.remove(path)
        if saved is not None:
            sys.modules["datasets"] = saved
    return types.SimpleNamespace(**mods)


class SplitAttention(nn.Module):
    """Adaptation 3: GPT-2 attention with OPT's three q / k / v projections (the rows of the fused qkv)."""

    def __init__(self, src: nn.Module) -> None:
        super().__init__()
        self.num_heads, self.proj = src.num_heads, src.proj
        c = src.qkv.in_features
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            # on the fused weight's device and dtype: a model split on a GPU or in bf16 keeps them
            lin = nn.Linear(c, c, bias=src.qkv.bias is not None, device=src.qkv.weight.device,
                            dtype=src.qkv.weight.dtype)
            lin.weight.data.copy_(src.qkv.weight.data[i * c:(i + 1) * c])
            if src.qkv.bias is not None:
                lin.bias.data.copy_(src.qkv.bias.data[i * c:(i + 1) * c])
            setattr(self, name, lin)
        self.prob_bits = None  # adaptation 4: int8 probabilities round(p * 127) / 127

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (getattr(self, n)(x).view(b, t, self.num_heads, -1).transpose(1, 2)
                   for n in ("q_proj", "k_proj", "v_proj"))
        if self.prob_bits is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
            # the causal mask on the scores' device and dtype (a mask on the default device fails on another)
            scores = scores + scores.new_full((t, t), float("-inf")).triu_(1)
            y = (scores.softmax(-1).mul(127).round().div(127)) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def split_qkv(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model)
    for block in model.blocks:
        block.attn = SplitAttention(block.attn)
    return model


def smoothed_official(s: types.SimpleNamespace, model: nn.Module, calib: torch.Tensor, split: bool,
                      alpha: float = 0.5) -> nn.Module:
    """get_act_scales on the float model, then smooth_ln_fcs per block (fused qkv, or q/k/v as for OPT)."""
    model = split_qkv(model) if split else copy.deepcopy(model)
    with contextlib.redirect_stderr(io.StringIO()):  # tqdm
        scales = s.calibration.get_act_scales(model, _ByteTokenizer(), "calib", len(calib), calib.shape[1])
    for i, block in enumerate(model.blocks):
        attn = block.attn
        fcs = [attn.q_proj, attn.k_proj, attn.v_proj] if split else attn.qkv
        key = f"blocks.{i}.attn.{'q_proj' if split else 'qkv'}"
        s.smooth.smooth_ln_fcs(block.norm1, fcs, scales[key], alpha)
        s.smooth.smooth_ln_fcs(block.norm2, block.mlp.fc1, scales[f"blocks.{i}.mlp.fc1"], alpha)
    return model


def official_w8a8(s: types.SimpleNamespace, model: nn.Module, act_quant: str, quantize_bmm_input: bool,
                  weight_quant: str = "per_channel") -> nn.Module:
    """W8A8Linear.from_float on every block Linear (their quantize_opt / quantize_llama_like)."""
    model = copy.deepcopy(model)
    W8A8 = s.fake_quant.W8A8Linear
    for block in model.blocks:
        attn = block.attn
        for name in ("q_proj", "k_proj", "v_proj", "qkv"):
            if hasattr(attn, name):
                setattr(attn, name, W8A8.from_float(getattr(attn, name), weight_quant=weight_quant,
                                                    act_quant=act_quant, quantize_output=quantize_bmm_input))
        attn.proj = W8A8.from_float(attn.proj, weight_quant=weight_quant, act_quant=act_quant)
        block.mlp.fc1 = W8A8.from_float(block.mlp.fc1, weight_quant=weight_quant, act_quant=act_quant)
        block.mlp.fc2 = W8A8.from_float(block.mlp.fc2, weight_quant=weight_quant, act_quant=act_quant)
    return model


class StaticInt8Linear(nn.Module):
    """Adaptation 4: torch-int's W8A8 arithmetic with static per-tensor scales, emulated in float."""

    def __init__(self, s: types.SimpleNamespace, linear: nn.Linear, input_scale: float,
                 output_scale: Optional[float]) -> None:
        super().__init__()
        self.weight = s.fake_quant.quantize_weight_per_channel_absmax(linear.weight.detach().clone())
        self.bias = linear.bias
        self.input_scale, self.output_scale = input_scale, output_scale

    @staticmethod
    def _int8(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x / scale).round().clamp(-128, 127) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self._int8(x, self.input_scale), self.weight, self.bias)
        return y if self.output_scale is None else self._int8(y, self.output_scale)


def official_static(s: types.SimpleNamespace, smoothed_split: nn.Module, calib: torch.Tensor) -> nn.Module:
    """Their static scales (get_static_decoder_layer_scales) on the smoothed float model + emulated INT8."""
    model = copy.deepcopy(smoothed_split)
    model.config = types.SimpleNamespace(num_hidden_layers=0)  # adaptation 2: skip the OPT-only loop
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        _, act = s.calibration.get_static_decoder_layer_scales(model, _ByteTokenizer(), "calib", len(calib),
                                                               calib.shape[1])
    for i, block in enumerate(model.blocks):
        attn = block.attn
        for name in ("q_proj", "k_proj", "v_proj"):
            key = f"blocks.{i}.attn.{name}"
            setattr(attn, name, StaticInt8Linear(s, getattr(attn, name), act[key]["input"] / 127,
                                                 act[key]["output"] / 127))
        attn.prob_bits = 8
        for parent, name in ((attn, "proj"), (block.mlp, "fc1"), (block.mlp, "fc2")):
            key = f"blocks.{i}.{'attn' if parent is attn else 'mlp'}.{name}"
            setattr(parent, name, StaticInt8Linear(s, getattr(parent, name), act[key]["input"] / 127, None))
    del model.config
    return model


# -- comparison ----------------------------------------------------------------------------------------
def block_weights(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The weight each block Linear computes with (fake-quantized for ours; q/k/v concatenated)."""
    out = {}
    for i, block in enumerate(model.blocks):
        for path in BLOCK_LINEARS:
            parent, _, name = path.rpartition(".")
            owner = block.get_submodule(parent)
            if hasattr(owner, name):
                m = getattr(owner, name)
                w = m.quantized_weight() if isinstance(m, QuantLinear) else m.weight
            else:  # split q / k / v
                w = torch.cat([getattr(owner, n).weight for n in ("q_proj", "k_proj", "v_proj")])
            out[f"blocks.{i}.{path}"] = w.detach().float()
    return out


def weight_diff(ours: nn.Module, theirs: nn.Module) -> dict:
    a, b = block_weights(ours), block_weights(theirs)
    per_layer = {k: float((a[k] - b[k]).abs().max()) for k in a}
    differing = sum(int((a[k] != b[k]).sum()) for k in a)
    total = sum(a[k].numel() for k in a)
    return {"max_abs": max(per_layer.values()), "differing_fraction": differing / total, "per_layer": per_layer}


def norm_diff(ours: nn.Module, theirs: nn.Module) -> float:
    """max |difference| of the smoothed LayerNorm weights and biases."""
    return max(float((p - theirs.get_parameter(n)).detach().abs().max()) for n, p in ours.named_parameters()
               if re.search(r"blocks\.\d+\.norm[12]\.", n))


def write_results(path: str, results: dict, overwrite: bool) -> None:
    """The results JSON at `path`, never over a file another command wrote since this one started: without
    `overwrite` over none, with it over this script's own results alone (one error line otherwise)."""
    try:
        if overwrite:
            refuse_others_files([path], SOURCE, json_keys=RESULT_KEYS)
        write_json(path, results, overwrite, indent=1)
    except RunDirError as e:
        sys.exit(f"error: {e}")


def main(argv: Optional[List[str]] = None) -> None:
    parser = OneLineParser(description=first_line(__doc__))
    parser.add_argument("--gptq", required=True, help="a checkout of IST-DASLab/gptq")
    parser.add_argument("--smoothquant", required=True, help="a checkout of mit-han-lab/smoothquant")
    parser.add_argument("--out", required=True, help="JSON of the results (the float weights go next to it)")
    parser.add_argument("--model", default="gpt2_micro", choices=sorted(GPT_SIZES),
                        help="the GPT size trained (models/gpt.py; default: %(default)s)")
    # the counts and the learning rate are checked here, before anything is written or minutes are trained (a
    # negative --steps would train nothing and save the model as trained)
    parser.add_argument("--steps", type=at_least(0), default=600,
                        help="training updates of the float model (default: %(default)s)")
    parser.add_argument("--lr", type=learning_rate, default=2e-3,
                        help="peak AdamW learning rate, finite, above 0 (default: %(default)s)")
    parser.add_argument("--batch", type=at_least(1), default=32,
                        help="training windows per update (default: %(default)s)")
    parser.add_argument("--calib", type=at_least(1), default=128, help="calibration windows (GPTQ's 128 samples)")
    parser.add_argument("--eval-windows", type=at_least(1), default=400,
                        help="held-out windows for the perplexity (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the float model's training (default: %(default)s)")
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch CPU threads (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the results JSON this script wrote at --out, and a float model of other "
                             "settings next to it")
    args = parser.parse_args(argv)
    needed = {args.gptq: ("gptq.py", "quant.py", "modelutils.py"),
              args.smoothquant: ("smoothquant/smooth.py", "smoothquant/fake_quant.py", "smoothquant/calibration.py")}
    for checkout, files in needed.items():  # before minutes of training
        missing = [f for f in files if not os.path.isfile(os.path.join(checkout, f))]
        if missing:
            raise SystemExit(f"error: {checkout} lacks {', '.join(missing)}: give checkouts of IST-DASLab/gptq "
                             f"(--gptq) and mit-han-lab/smoothquant (--smoothquant)")
    try:  # a folder at --out, or a file where its folder goes: one error line now, not a traceback after training
        refuse_existing_outputs([args.out], args.overwrite)
        if args.overwrite:  # a file of another's at --out is not this script's to replace
            refuse_others_files([args.out], SOURCE, json_keys=RESULT_KEYS)
    except RunDirError as e:
        raise SystemExit(f"error: {e}")
    start = time.perf_counter()
    train, held_out = corpus()
    if problem := eval_windows_problem(args, held_out):
        parser.error(problem)
    torch.set_num_threads(args.threads)
    fp = train_model(args, train)
    ctx = fp.context
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(len(train) - ctx, (args.calib,), generator=g).tolist()
    calib = torch.stack([train[i:i + ctx] for i in starts])
    windows = held_out[:args.eval_windows * ctx].view(-1, ctx)
    gq, sq = load_gptq(args.gptq), load_smoothquant(args.smoothquant, calib)
    results: Dict[str, dict] = {"fp": {"perplexity": perplexity(fp, windows)}}

    def record(name: str, ours: nn.Module, theirs: nn.Module, **extra) -> None:
        results[name] = {"ours": perplexity(ours, windows), "official": perplexity(theirs, windows), **extra}
        print(f"{name}: ours {results[name]['ours']:.4f}, official {results[name]['official']:.4f}", flush=True)

    ours, _ = PIPELINES["rtn"](fp, calib, "w4a16")
    theirs = official_rtn(gq, fp, 4)
    record("rtn w4a16", ours, theirs, weights=weight_diff(ours, theirs))
    for options, official in GPTQ_SETTINGS:
        theirs, their_errors = official_gptq(gq, fp, calib, 4, **official)
        for batch in (1, 8) if not options else (1,):
            ours, report = PIPELINES["gptq"](fp, calib, "w4a16", {**options, "batch_size": batch})
            record(f"gptq w4a16 {options}, batch_size {batch}", ours, theirs, weights=weight_diff(ours, theirs),
                   gptq_error={"ours": list(report["gptq_error"].values()), "official": their_errors})

    fused, split = smoothed_official(sq, fp, calib, split=False), smoothed_official(sq, fp, calib, split=True)
    # per-tensor weights on the split model: OPT's q_proj, k_proj and v_proj each get their own weight scale
    settings = [("smoothquant", {}, fused, "per_token", False, "per_channel"),
                ("smoothquant", {"quantize_bmm": "qkv"}, split, "per_token", True, "per_channel"),
                ("smoothquant", {"weight_granularity": "tensor"}, split, "per_token", False, "per_tensor"),
                ("smoothquant_strict", {"act_calibration": "dynamic", "quantize_bmm": "qkv"}, split, "per_tensor",
                 True, "per_channel")]
    for name, options, smoothed, act_quant, bmm, weight_quant in settings:
        ours, _ = PIPELINES[name](fp, calib, "w8a8", options)
        theirs = official_w8a8(sq, smoothed, act_quant, bmm, weight_quant)
        record(f"{name} w8a8 {options or ''}".strip(), ours, theirs, weights=weight_diff(ours, theirs),
               smoothed_norms_max_abs=norm_diff(ours, smoothed))
    ours, _ = PIPELINES["smoothquant_strict"](fp, calib, "w8a8")
    theirs = official_static(sq, split, calib)
    record("smoothquant_strict w8a8 (static)", ours, theirs, weights=weight_diff(ours, theirs))

    results["setup"] = {"model": args.model, "params": sum(p.numel() for p in fp.parameters()), "context": ctx,
                        "train_bytes": len(train), "steps": args.steps, "calib_windows": args.calib,
                        "eval_windows": len(windows), "threads": args.threads, "seconds": time.perf_counter() - start,
                        "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    write_results(args.out, results, args.overwrite)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
