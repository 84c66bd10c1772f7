r"""The paper's mechanism figures as tools: FFN surrogate, FC1-FC2 alignment, removing aligned directions,
pair energies (paper Sec. 3.1-3.2 and App. A.1 "FFN Outliers and FC1-FC2 Colinearity").

    python scripts/mechanism.py surrogate --checkpoint runs/vit_digits/best.pt --out figs  # app_ffn_surrogate
    python scripts/mechanism.py alignment --checkpoint runs/vit_digits/best.pt --out figs  # app_ffn_alignment
    python scripts/mechanism.py remove    --checkpoint runs/vit_digits/best.pt --out figs  # its right panel
    python scripts/mechanism.py energies  --checkpoint runs/vit_digits/best.pt \
        --compare runs/vit_digits+cd/best.pt --out figs                               # baseline vs CD
    python scripts/mechanism.py alignment --model vit_base_patch16_224 \
        --weights /weights/vit_b.safetensors --out figs                  # a timm model + a local weights file

What each subcommand writes into --out (existing files are refused unless --overwrite):
  surrogate   surrogate.png, surrogate.csv   real FFN branch output fc2(act(fc1(norm2(x)))) against the
              no-activation surrogate W_F2 W_F1 norm2(x) (Sec. 3.2, Eq. (8)), per block, on --images
              validation images; the CSV has per-block agreement figures
  alignment   alignment.png, alignment.csv   alpha_ij = |w2_j_hat . u_i| (App. A.1, Eq. (13)) per block; the
              CSV ranks every (block, direction i) by its strongest row j; the PNG ranks each block's
              directions by their peak and crops the strongest blocks to their top --crop directions x rows
  remove      remove.json, remove.png        zero FC1's singular values of the top-k aligned directions
              (k = 0..--k, no retraining) -> FP top-1, max activation, quantized top-1 (RepQ-ViT W4A4);
              the JSON's `settings` record the quantization options, calibration batch, val data, weights
              (raw / --ema), --config files and overrides the numbers were computed with
  energies    energies.png, energies.csv     ||W2 W1n||_F^2 per role and block (Sec. 3.1, Eq. (2), normalised
              as App. A.2, Eq. (23); separate q, k, v layers as one stacked [W_Q; W_K; W_V]), for one model
              or two side by side (--compare: other weights of the same architecture, their task, model.name
              and model.kwargs alike; the first model's file or weights again are refused)

Model source: --checkpoint (best.pt / checkpoint.pt of train.py; its saved config gives the model and the
data), or --model NAME --weights FILE (with --config files and key=value overrides for the data, e.g.
data.root=/datasets/imagenet model.num_classes=1000); the file must fit the model, but `alignment` and
`energies`, which read the blocks' matrices alone, also take a backbone without its classifier (DINOv2's, MAE's)
and leave the model's own unread. Only `surrogate` and `remove` read images, and only
they take --device (`alignment` and `energies` compute on the CPU). An override of a key that the
subcommand does not read, or a --config file that changes one over a checkpoint's own config (and --compare's,
which gets the same layers), is refused (`READS`, `unread_keys`): each reads model.* but the training-mode
model.drop and model.drop_path; `surrogate` and `remove` data.* too, but the training batches' keys (data.mixup,
data.label_smoothing, ...), the training transform's (data.hflip, data.scale, data.auto_augment, ...; `remove` reads
them when it calibrates on training-transform images, quant.calib_transform=train) and the text data sets' (they
refuse a language model), and `surrogate` no train split key; `remove` also the calibration settings and
quant.<--pipeline>.*; a key a flag sets (quant.bits: --bits) is given by the flag.
Indices are 0-based: blocks in model order (`blocks.N`, Swin `layers.N.blocks.M` flattened), singular
directions i in descending singular value, rows j of FC2.

The weight-only math (`alignment`, `energies`, and the FC1 edit of `remove`) reads each block's FC1 / FC2 and every
other pair from `cd.find_pairs`, which knows each layer's role and storage, so that it takes any model CD pairs: a
train.py language model on the command line; from Python, transformers' GPT-2 (Conv1D weights stored (in, out), read
transposed), ViT, torchvision's ViT / Swin, MMDetection's Swin, or blocks of one's own (`ffn_pairs(model,
layouts=...)`, `pair_energies(model, layouts=...)`, `rank_directions`, `model_without`).
A block CD refuses (a gated MLP such as Llama's) is left out with a warning; a model with none left is refused.
`surrogate` hooks timm's module names (norm2, mlp) and, like `remove`, reads val images: both refuse a language
model.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import sys
import time
from typing import Optional, Sequence

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from cd.layouts import LAYOUTS, Layout  # noqa: E402
from cd.pairs import Pair, find_blocks, find_pairs  # noqa: E402
from cd.update import energy_unit, pair_energy  # noqa: E402
from cd.values import check_channel_order  # noqa: E402
from cd.verify import UnsupportedModelError, verify_pairs  # noqa: E402
from cd.wrappers import unwrap_model  # noqa: E402
from configs import ConfigError, config_from_dict, config_to_dict, layer_config, load_config  # noqa: E402
from configs.cli import OneLineParser, at_least, move_overrides  # noqa: E402
from configs.loader import LM_DATA, dict_fields, override_keys, schema_keys  # noqa: E402
from configs.schema import (TRAIN_BATCH_OVERRIDE_KEYS, TRAIN_MODE_MODEL_KEYS,  # noqa: E402
                            TRAIN_TRANSFORM_ONLY_OVERRIDE_KEYS)
from data import DataError, build_eval_loader  # noqa: E402
from engine.act_max import ActivationProbe, check_extra_modules  # noqa: E402
from engine.checkpoint import CheckpointError, load_checkpoint, weights_fingerprint  # noqa: E402
from engine.figures import new_figure  # noqa: E402
from engine.loop import evaluate  # noqa: E402
from engine import outputs  # noqa: E402
from engine.outputs import save_figure  # noqa: E402
from engine.run_dir import RunDirError, config_changes, prepare_folder, refuse_existing_outputs  # noqa: E402
from engine.result_table import method_name  # noqa: E402
from engine.quant_settings import quant_settings  # noqa: E402
from evaluate import calibration_set, data_identity, eval_model_config, load_float_model  # noqa: E402
from quant.plan import pipeline_options  # noqa: E402
from models import ModelError, build_model, input_size, is_language_model, model_label  # noqa: E402
from timm.models import load_state_dict  # noqa: E402
from models.pretrained import ema_advice, ema_copy, module_entry  # noqa: E402
from models.sink_weights import PLAIN, keys_variant  # noqa: E402
from quant import PIPELINES, evaluate_quantized, parse_bits  # noqa: E402

OUTPUTS = {"surrogate": ("surrogate.png", "surrogate.csv"), "alignment": ("alignment.png", "alignment.csv"),
           "remove": ("remove.json", "remove.png"), "energies": ("energies.png", "energies.csv")}
# By these --overwrite knows a subcommand's own outputs (engine.outputs.refuse_others_files): its PNG's text entry
# Source, its CSV's header (the columns), its JSON's keys; another's file at one of these names is never replaced
SOURCE = "scripts/mechanism.py"
SURROGATE_FIELDS = ["block", "tokens", "channels", "pearson", "top1pct_sign_agreement", "max_abs_real",
                    "max_abs_surrogate", "channel_max_real", "channel_max_surrogate", "top5_channels_shared"]
ALIGNMENT_FIELDS = ["rank", "block", "block_index", "direction", "row", "alpha", "singular_value", "gain"]
ENERGY_FIELDS = ["label", "source", "role", "block", "w2", "w1", "energy", "energy_raw"]
OWN = {"surrogate": {"csv_fields": SURROGATE_FIELDS}, "alignment": {"csv_fields": ALIGNMENT_FIELDS},
       "remove": {"json_keys": ("source", "model", "method", "pipeline", "bits", "results")},
       "energies": {"csv_fields": ENERGY_FIELDS}}


log = logging.getLogger("mechanism")


class MechanismError(ValueError):
    """A user error: a bad argument, an existing output file, a model without FFN blocks."""


# ------------------------------------------------------------------------------------------------------
# The math (pure functions on tensors and modules; tests/test_mechanism.py checks each against a direct
# computation)
# ------------------------------------------------------------------------------------------------------
def ffn_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of every pre-norm block with an ungated FFN mlp.fc1 -> mlp.fc2, in model order: the blocks
    `surrogate` hooks by timm's module names (the weight-only tools read any layout CD pairs: `ffn_pairs`)."""
    out = []
    for name, block in find_blocks(model):
        # blocks of other layouts (MMDetection's `ffn`, GPT-2's `mlp.c_fc`) have no mlp.fc1 and are left out
        mlp = getattr(block, "mlp", None)
        fc1, fc2 = getattr(mlp, "fc1", None), getattr(mlp, "fc2", None)
        if isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear) and fc2.in_features == fc1.out_features:
            out.append((name, block))
    return out


def cd_pairs(model: nn.Module, layouts: Sequence[Layout] = LAYOUTS, example_input: object = None) -> list[Pair]:
    """CD's matrix pairs of `model` (`cd.find_pairs`, which reads each layer's storage and role off the layer: an
    nn.Linear (out, in), transformers' Conv1D (in, out)), of every block CD pairs; a block CD refuses (a gated MLP,
    a norm without an affine scale, ...) is left out with a warning naming it and why, and the model is refused
    when no block is left. The pairs kept are checked against the model's forward as find_pairs checks its own, on
    `example_input` (find_pairs' default when None; a model whose input size it cannot tell needs one).
    """
    try:
        return find_pairs(model, example_input, layouts=layouts)
    except UnsupportedModelError as e:
        whole = e
    model = unwrap_model(model)  # the names find_pairs gives (DDP's `module.`, torch.compile's `_orig_mod.` dropped)
    kept: list[Pair] = []
    types: dict[str, str] = {}
    left_out = []
    for name, module in _pairing_units(model, layouts):
        try:  # one block on its own (names relative to it); checked below, in the whole model's forward
            pairs = find_pairs(module, verify=False, layouts=layouts)
        except UnsupportedModelError as refusal:
            left_out.append(str(refusal).replace("block ''", f"block '{name}'", 1))
            continue
        types[name] = type(module).__name__
        kept += [dataclasses.replace(p, name=_join(name, p.name), block=name,
                                     upstream_name=_join(name, p.upstream_name)) for p in pairs]
    if not left_out or not kept:  # refused for the whole model (tied weights, ...), or no block is left
        raise MechanismError(str(whole) if not left_out else
                             f"no block of {type(model).__name__} is one CD pairs; the first: {left_out[0]}") from None
    try:
        verify_pairs(model, kept, types, example_input)
        check_channel_order(model, kept, types, example_input)
    except UnsupportedModelError as e:
        raise MechanismError(str(e)) from None
    for why in left_out:
        log.warning("left out: %s", why)
    return kept


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _pairing_units(model: nn.Module, layouts: Sequence[Layout]) -> list[tuple[str, nn.Module]]:
    """The blocks of `layouts` and the patch-merging layers (children `norm` and `reduction`) of `model`, in model
    order: what find_pairs pairs one by one."""
    blocks = dict(find_blocks(model, layouts))
    units, inside = [], None
    for name, module in model.named_modules():
        if inside is not None and (inside == "" or name.startswith(inside + ".")):  # inside a unit found
            continue
        weight = getattr(getattr(module, "reduction", None), "weight", None)
        merging = isinstance(getattr(module, "norm", None), nn.Module) and isinstance(weight, torch.Tensor) and \
            weight.dim() == 2
        if name in blocks or merging:
            units.append((name, module))
            inside = name
    return units


def ffn_pairs(model: nn.Module, layouts: Sequence[Layout] = LAYOUTS,
              example_input: object = None) -> list[tuple[str, Pair]]:
    """(block name, its FC1 -> FC2 pair) of every block CD pairs (`cd_pairs`), in model order. The pair's `w1()` is
    W_F1 (hidden x dim) and `w2()` W_F2 (dim x hidden) as the layers apply them, whatever their storage."""
    return [(p.block, p) for p in cd_pairs(model, layouts, example_input) if p.role == "fc2"]


def ffn_surrogate(mlp: nn.Module, z: torch.Tensor, bias: bool = False) -> torch.Tensor:
    """The no-activation surrogate of the FFN branch on its input z = norm2(x).

    Sec. 3.2, Eq. (8): FFN_hat(z) = W_F2 W_F1 z, the exact branch W_F2 phi(W_F1 z) (Eq. (7)) without phi.
    The paper writes both without biases, so by default they are left out; with `bias` the linear biases
    are kept, which makes the surrogate the branch itself with phi replaced by the identity.
    """
    w1, w2 = mlp.fc1.weight, mlp.fc2.weight
    h = z @ w1.T + (mlp.fc1.bias if bias and mlp.fc1.bias is not None else 0)
    return h @ w2.T + (mlp.fc2.bias if bias and mlp.fc2.bias is not None else 0)


@torch.no_grad()
def capture_ffn(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]],
                images: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{block name: (z, real)}: the FFN input z = norm2(x) and the real branch output mlp(z), both
    (tokens, dim), captured by hooks on `block.mlp` during one forward pass of `images`.

    Hooking the mlp itself (not recomputing it) means `real` is exactly what the model computed, for ViT
    and Swin blocks alike (timm's Mlp: fc1, act, drop, norm (Identity), fc2, drop; eval mode).
    """
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name):
        def fn(module, inputs, output):
            captured[name] = (inputs[0].detach().flatten(0, -2), output.detach().flatten(0, -2))
        return fn

    handles = [block.mlp.register_forward_hook(hook(name)) for name, block in blocks]
    try:
        model.eval()(images)
    finally:
        for h in handles:
            h.remove()
    return captured


def alignment(w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha_ij = |w2_j_hat . u_i| (App. A.1, Eq. (13)) for the FFN pair W_F1 = w1 (hidden x dim),
    W_F2 = w2 (dim x hidden).

    u_i are the left singular vectors of W_F1 = U S V^T: they live in the hidden space, which is FC2's
    input space, so they meet FC2's rows there (Sec. 3.1, Eq. (1): y_j = sum_i s_i (w2_j . u_i)(v_i . x)).
    w2_j_hat is row j of W_F2 divided by its norm. The SVD runs in float64 (singular vectors of close
    singular values are ill-conditioned in fp32; the cost is negligible next to a forward pass).

    Returns:
        alpha (r, dim) in float64 with alpha[i, j] = alpha_ij, r = min(hidden, dim); and the singular
        values s (r,), descending.
    """
    u, s, _ = torch.linalg.svd(w1.detach().double(), full_matrices=False)
    w2 = w2.detach().double()
    w2_hat = w2 / w2.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return (w2_hat @ u).abs().T, s


def rank_directions(blocks: Sequence[tuple[str, Pair]]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Every FC1 singular direction (block, i) ranked by its strongest alignment max_j alpha_ij
    (App. A.1: "aggregate the alignment scores over the selected layers, sort the strongest directions"), over
    the (block name, FC1 -> FC2 pair) of `ffn_pairs`.

    Returns:
        (rows, alphas): rows sorted by alpha, descending, each {"rank", "block", "block_index",
        "direction", "row", "alpha", "singular_value", "gain"}, where gain = s_i |w2_j . u_i| (the row's
        own norm included) is the factor of that term in Eq. (1); alphas: {block name: alpha (r, dim)}.
    """
    rows, alphas = [], {}
    for index, (name, pair) in enumerate(blocks):
        w2 = pair.w2().detach().double()
        alpha, s = alignment(pair.w1(), w2)
        alphas[name] = alpha
        best, j = alpha.max(dim=1)
        norms = w2.norm(dim=1)
        for i in range(len(s)):
            rows.append({"block": name, "block_index": index, "direction": i, "row": int(j[i]),
                         "alpha": float(best[i]), "singular_value": float(s[i]),
                         "gain": float(s[i] * best[i] * norms[j[i]])})
    rows.sort(key=lambda r: -r["alpha"])
    for rank, r in enumerate(rows):
        r["rank"] = rank
    return rows, alphas


def strongest_cells(alpha: torch.Tensor, n: int) -> tuple[list[int], list[int]]:
    """The `n` directions i with the highest peak max_j alpha_ij, descending, and the `n` FC2 rows j with
    the highest alpha among those directions, descending: the crop of alpha in which the peak shows."""
    directions = alpha.max(dim=1).values.argsort(descending=True)[:n]
    fc2_rows = alpha[directions].max(dim=0).values.argsort(descending=True)[:n]
    return directions.tolist(), fc2_rows.tolist()


def remove_directions(w1: torch.Tensor, directions: Sequence[int]) -> torch.Tensor:
    """W_F1 with the singular values of `directions` set to zero: U S' V^T (App. A.1), in w1's dtype.

    Computed as W - sum_{i removed} s_i u_i v_i^T in float64, which equals U S' V^T, but leaves W exactly
    as it was where nothing is removed and does not round the kept part of W through a reconstruction.
    """
    if not directions:
        return w1.detach().clone()
    w = w1.detach().double()
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    idx = torch.tensor(sorted(set(directions)), dtype=torch.long, device=w.device)
    return (w - (u[:, idx] * s[idx]) @ vh[idx]).to(w1.dtype)


def model_without(model: nn.Module, removed: Sequence[dict],
                  blocks: Optional[Sequence[tuple[str, Pair]]] = None) -> nn.Module:
    """A copy of `model` whose FC1 weights lack the `removed` directions ({"block", "direction"} dicts); `blocks`:
    the model's `ffn_pairs` (found when not given). A wrapped model (DDP, torch.compile) is copied with its wrapper."""
    fc1 = {name: pair for name, pair in (ffn_pairs(model) if blocks is None else blocks)}
    model = copy.deepcopy(model)
    params = dict(unwrap_model(model).named_parameters())  # the pairs' names are the unwrapped model's (find_pairs)
    per_block: dict[str, list[int]] = {}
    for r in removed:
        per_block.setdefault(r["block"], []).append(r["direction"])
    with torch.no_grad():
        for name, directions in per_block.items():
            pair = fc1[name]
            stored = params[pair.upstream_name]
            # W_F1 as applied; a view, so copy_ writes the storage
            w1 = stored.t() if pair.upstream_transposed else stored
            w1.copy_(remove_directions(w1, directions))
    return model


def pair_energies(model: nn.Module, layouts: Sequence[Layout] = LAYOUTS, example_input: object = None) -> list[dict]:
    """Per block and role of every block CD pairs (`cd_pairs`): the normalised energy ||W2 W1n||_F^2 that CD
    decays (Sec. 3.1, Eq. (2) with App. A.2, Eq. (23), from cd/update.py `pair_energy`) and the raw ||W2 W1||_F^2
    of Eq. (2), both of the matrices as the layers apply them (a Conv1D's (in, out) weight transposed). Layers that
    share a block, role and W1 (separate q, k, v after one norm; a gated MLP's W_gate and W_up) make one row, of
    their stacked matrix W2 = [W_Q; W_K; W_V] (`w2` names them, in brackets): its energies are the sums of theirs,
    the number a fused qkv gives, and the mean of a role's rows is the logged cd/pair_energy/<role>. Each row also
    holds the shapes of its stacked W2 (`w2_shape`, (out, mid)) and of W1 (`w1_shape`: (mid,) for a norm scale),
    which tell two models' rows of one name apart (`pairs_differ`)."""
    try:
        pairs = cd_pairs(model, layouts, example_input)
    except ValueError as e:  # no pre-norm block at all, or layouts that are not Layouts
        raise MechanismError(str(e)) from None
    units: dict[tuple, list[Pair]] = {}  # in model order (dicts keep insertion order)
    for pair in pairs:
        units.setdefault(energy_unit(pair), []).append(pair)  # the units cd/update.py energy_units counts
    rows = []
    for (block, role, _, _), unit in units.items():
        raw = 0.0
        for pair in unit:
            w2 = pair.w2().detach().double()
            w1 = pair.w1().detach().double()
            raw += float((w2 * w1).square().sum() if pair.diagonal else (w2 @ w1).square().sum())
        w2_name = unit[0].name if len(unit) == 1 else "[" + "; ".join(p.name for p in unit) + "]"
        w2_shape = (sum(p.w2().shape[0] for p in unit), unit[0].w2().shape[1])
        rows.append({"role": role, "block": block, "w2": w2_name, "w1": unit[0].upstream_label,
                     "energy": float(pair_energy(unit)[role]), "energy_raw": raw,
                     "w2_shape": w2_shape, "w1_shape": tuple(unit[0].w1().shape)})
    return rows


def pairs_differ(first: Sequence[dict], second: Sequence[dict]) -> Optional[str]:
    """The first difference between two `pair_energies` tables in the pairs they are of (role, W2 name, and the
    shapes of the stacked W2 and of W1), or None when they are of the same pairs: two models' energies compared row
    by row must be of matrices of one size (||W2 W1n||_F^2 grows with the width, whatever the method)."""
    def key(r: dict) -> tuple:
        return r["role"], r["w2"], tuple(r["w2_shape"]), tuple(r["w1_shape"])

    for a, b in zip(first, second):
        if key(a) != key(b):
            return (f"{a['role']} {a['w2']} (W2 {'x'.join(map(str, a['w2_shape']))}, W1 "
                    f"{'x'.join(map(str, a['w1_shape']))}) against {b['role']} {b['w2']} (W2 "
                    f"{'x'.join(map(str, b['w2_shape']))}, W1 {'x'.join(map(str, b['w1_shape']))})")
    if len(first) != len(second):
        return f"{len(first)} rows of pairs against {len(second)}"
    return None


# ------------------------------------------------------------------------------------------------------
# Loading (one place for every subcommand)
# ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Loaded:
    cfg: object
    model: nn.Module
    source: str  # what the numbers are numbers of: a checkpoint path, or "NAME + weights FILE"
    label: str   # Baseline / CD (...) / TWEO, from the checkpoint's config


# Subcommands that read the blocks' matrices alone: a weights file without a classifier (a backbone, as DINOv2 and
# MAE publish theirs) is read as it is, the model's own classifier left unread; the others score or run the model.
READ_NO_CLASSIFIER = ("alignment", "energies")


def load(args: argparse.Namespace, images: bool = False) -> Loaded:
    """The float model (eval mode, on the CPU) and its config, from --checkpoint or --model/--weights; with
    `images`, refused when it is a language model (the subcommand runs the model on val images)."""
    if args.checkpoint and (args.model or args.weights):
        raise MechanismError("give either --checkpoint, or --model NAME --weights FILE, not both")
    check_flag_overrides(args)
    check_overrides_first(args)
    if args.checkpoint:
        if not os.path.isfile(args.checkpoint):
            raise MechanismError(f"--checkpoint {args.checkpoint}: no such file; give the best.pt or "
                                 f"checkpoint.pt that train.py wrote")
        payload = load_checkpoint(args.checkpoint)
        cfg = layer_config(config_from_dict(payload["config"]), args.config or (), args.overrides)
        check_overrides(args, cfg)
        check_config_layers(args, payload["config"], args.checkpoint)
        model = load_float_model(cfg, payload, args, trains=False)  # --pipeline's repq / percentile train nothing
        source = os.path.abspath(args.checkpoint)
    elif args.model and args.weights:
        if not os.path.isfile(args.weights):
            raise MechanismError(f"--weights {args.weights}: no such file; give a local .pth, .pt or "
                                 f".safetensors file of {args.model}")
        if args.ema:
            raise MechanismError(f"--ema: --weights {args.weights} is one set of weights, with no EMA copy; "
                                 f"drop --ema, or give the train.py checkpoint that holds them with --checkpoint")
        # strict (the weights as they are, never a random classifier in place of one of another size) wherever
        # the subcommand runs the model; alignment and energies never read the classifier (READ_NO_CLASSIFIER)
        strict = str(args.command not in READ_NO_CLASSIFIER).lower()
        cfg = load_config(args.config or [], [*args.overrides, f"model.name={args.model}",
                                              f"model.pretrained={os.path.abspath(args.weights)}",
                                              f"model.pretrained_strict={strict}"])
        check_overrides(args, cfg)
        # read in eval mode only: built without dropout / stochastic depth (the schema's model.drop_path default
        # would refuse a model without it, vgg, ghostnet), as evaluate.py builds one no pipeline trains
        model = build_model(eval_model_config(cfg.model))
        source = f"{args.model} + weights {os.path.abspath(args.weights)}"
    else:
        raise MechanismError("nothing to load: give --checkpoint runs/<run>/best.pt, or --model NAME "
                             "--weights FILE")
    if images and is_language_model(model):
        reads = "runs the model on" if args.command == "surrogate" else "scores the top-1 of"
        raise MechanismError(f"`{args.command}`: {source} is a language model (data.dataset={cfg.data.dataset}), and "
                             f"`{args.command}` {reads} val images of an image classifier; run `alignment` or "
                             f"`energies` on it (they read its weights alone), or `{args.command}` on a vision "
                             "checkpoint")
    set_threads(args.threads, model)
    return Loaded(cfg, model.eval(), source, method_name(cfg))


# Below this many parameters one CPU thread is the default: the per-op work of a model this small is too
# little to split, and on a busy machine OpenMP's waiting threads cost far more than they save (measured
# on the 2-core VM of the README: `remove` on the digits demo took 13 s with 1 thread, 100 s with 2 while
# other jobs ran, 11 s with 2 on a quiet machine).
SMALL_MODEL = 5_000_000


def set_threads(threads: Optional[int], model: nn.Module) -> None:
    if threads is None:
        threads = 1 if sum(p.numel() for p in model.parameters()) < SMALL_MODEL else None
    if threads is not None:
        torch.set_num_threads(threads)


def load_compare(path: str, first: Loaded, args: argparse.Namespace) -> Loaded:
    """The --compare model: a train.py checkpoint (its own config), else a weights file for the first
    model's architecture, in the model.attn variant its keys hold (`weights_attn`). Refused when it is the first
    model's file or weights (one model drawn twice, its ratio 1.000), or, from its config before it is built, a model
    of another architecture (`check_same_model`)."""
    if not os.path.isfile(path):
        raise MechanismError(f"--compare {path}: no such file; give a second best.pt / checkpoint.pt, or a "
                             f"weights file of the same model")
    first_file = args.checkpoint or args.weights
    if first_file and os.path.isfile(first_file) and os.path.samefile(path, first_file):
        raise MechanismError(f"--compare {path} is the file of the first model ({first_file}): one model would "
                             f"be drawn twice; give the checkpoint of another run")
    try:
        payload = load_checkpoint(path)
    except CheckpointError:
        if args.ema:
            raise MechanismError(f"--ema: --compare {path} is a weights file, with no EMA copy; drop --ema, or "
                                 f"compare a train.py checkpoint") from None
        cfg = copy.deepcopy(first.cfg)
        # built as the model.attn variant its keys give (energies read no attention-sink parameter): in the first
        # model's variant, a file of another one was refused with advice the first model's checks then refused
        # (model.attn=kv_bias over a softmax checkpoint), or (not strict) loaded with zero sinks in place of none
        cfg.model = dataclasses.replace(cfg.model, attn=weights_attn(path, cfg.model.attn),
                                        pretrained=os.path.abspath(path),
                                        pretrained_strict=args.command not in READ_NO_CLASSIFIER)
        try:
            model = build_model(eval_model_config(cfg.model))
        except ModelError as e:
            raise compare_weights_error(e, path) from None
        loaded = Loaded(cfg, model.eval(), os.path.abspath(path), os.path.basename(path))
    else:
        # the --config layers and overrides of the first model, so that both are read alike
        cfg = layer_config(config_from_dict(payload["config"]), args.config or (), args.overrides)
        check_config_layers(args, payload["config"], path)
        check_same_model(first, cfg, path)
        model = load_float_model(cfg, payload, argparse.Namespace(ema=args.ema, checkpoint=path), trains=False)
        loaded = Loaded(cfg, model.eval(), os.path.abspath(path), method_name(cfg))
    # the same weights in another file (a copy, best.pt of a run that ended on its best update beside checkpoint.pt)
    if weights_fingerprint(loaded.model.state_dict()) == weights_fingerprint(first.model.state_dict()):
        raise MechanismError(f"--compare {path} holds the same weights as the first model ({first.source}): one "
                             f"model would be drawn twice; give the checkpoint of another run")
    return loaded


def compare_weights_error(error: ModelError, path: str) -> MechanismError:
    """The load's refusal of the --compare weights file `path`, which models/ words for the key it reads
    (model.pretrained=<absolute path>, "to start from it", "give model.pretrained=x.pth"), re-worded for the flag the
    user typed: `--compare <path> ...`, its advice about giving a file made to name --compare."""
    given, text = os.path.abspath(path), str(error)
    ema = ema_copy(given) if "to start from it" in text else ""
    if ema:  # an EMA copy alone: compared once saved as a weights file of its own
        text = text.replace(f"to start from it, {ema_advice(ema)}", f"to compare it, {ema_advice(ema)} as --compare")
    text = text.replace(f"model.pretrained={given}", given).replace("give model.pretrained=", "give --compare ")
    return MechanismError(f"--compare {path}{text[len(given):]}" if text.startswith(given)
                          else f"--compare {path}: {text}")


def weights_attn(path: str, first: str) -> str:
    """The model.attn variant of the weights file `path`, from its attention-sink parameters (keys_variant); the
    first model's (`first`) where they cannot tell it from that one (no sink parameter beside a softmax1 model: the
    two have the same weights) or the file cannot be read as weights (the build's load_pretrained then says why)."""
    try:
        state = module_entry(load_state_dict(path, use_ema=False))
    except Exception:  # noqa: BLE001 - unreadable: load_pretrained reads it again and names the problem
        return first
    theirs = keys_variant(state) if isinstance(state, dict) else None
    if theirs is None or (theirs == "softmax" and first in PLAIN):  # sinks of several variants: refused at the load
        return first
    return theirs


def task_of(cfg) -> str:
    """What a config's model is, as its data set decides (configs.schema.DataConfig): a language model or an image
    classifier."""
    return "a language model" if cfg.data.dataset in LM_DATA else "an image classifier"


def check_same_model(first: Loaded, cfg, path: str) -> None:
    """Refuse a --compare checkpoint whose config `cfg` is of another model than the first's: another task (a GPT
    beside a ViT), model.name or model.kwargs (embed_dim=64 beside 32). Its pairs are other matrices, whose
    energies grow with their size: a ratio of them says nothing of the method. Checked on the configs, before the
    compared model is built."""
    text = lambda value: json.dumps(value, sort_keys=True, default=str)  # tuples as lists, as the config file
    checks = (("task", task_of(first.cfg), task_of(cfg),
               lambda c: f"{task_of(c)} (data.dataset={c.data.dataset})"),
              ("model.name", first.cfg.model.name, cfg.model.name, lambda c: f"of model.name={c.model.name}"),
              ("model.kwargs", text(first.cfg.model.kwargs), text(cfg.model.kwargs),
               lambda c: f"of model.kwargs={text(c.model.kwargs)}"))
    for what, ours, theirs, describe in checks:
        if ours != theirs:
            raise MechanismError(f"--compare {path} is {describe(cfg)}, the first model ({first.source}) "
                                 f"{describe(first.cfg)}: pair energies are compared between two checkpoints of "
                                 f"one architecture (task, model.name and model.kwargs alike); give a --compare "
                                 f"checkpoint of the first model's {what}")


def pick_device(cfg, wanted: str) -> torch.device:
    wanted = cfg.train.device if wanted == "auto" else wanted
    if wanted == "cuda" and not torch.cuda.is_available():
        raise MechanismError("--device cuda: no CUDA device is visible; use --device cpu")
    return torch.device("cuda" if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available())
                        else "cpu")


def select_blocks(blocks: list[tuple[str, object]], wanted: Optional[Sequence[str]],
                  ) -> list[tuple[str, object]]:
    """`--blocks`: 0-based positions in model order or block names; all blocks when not given. `blocks`: (name,
    block module) of `ffn_blocks` or (name, FC1 -> FC2 pair) of `ffn_pairs`."""
    if not blocks:
        raise MechanismError("the model has no pre-norm block with an FFN fc1 -> fc2 (timm ViT / DeiT / Swin, "
                             "or a layout of cd.LAYOUTS); these tools need one")
    if wanted is None:
        return blocks
    if not wanted:  # `--blocks` with nothing after it: a list cut off, not "all"
        raise MechanismError("--blocks without a block: give 0-based positions or names, or drop --blocks for all")
    names = [n for n, _ in blocks]
    chosen = []
    for w in wanted:
        if w.lstrip("-").isdigit() and 0 <= int(w) < len(blocks):
            chosen.append(blocks[int(w)])
        elif w in names:
            chosen.append(blocks[names.index(w)])
        else:
            raise MechanismError(f"--blocks {w}: no such block; give 0..{len(blocks) - 1} or a name "
                                 f"({names[0]} .. {names[-1]})")
    return list(dict.fromkeys(chosen))


def check_outputs(out: str, command: str, overwrite: bool) -> list[str]:
    """The output paths of the subcommand `command`, checked before any work: --out must be a usable folder, and
    no file may be replaced without --overwrite (a figure is often the only record of how it was made), nor
    another's with it (`refuse_others`)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise MechanismError(f"--out {out} is a file; give a folder")
    paths = [os.path.join(out, n) for n in OUTPUTS[command]]
    try:
        refuse_existing_outputs(paths, overwrite)
        refuse_others(command, paths, overwrite)
    except RunDirError as e:
        raise MechanismError(str(e)) from None
    prepare_folder(out, setting="--out")
    return paths


def val_loader(cfg, img_size: int, batch: int):
    return build_eval_loader(cfg.data, img_size=img_size, batch_size_per_gpu=batch, rank=0, world_size=1,
                             num_classes=cfg.model.num_classes)


# ------------------------------------------------------------------------------------------------------
# Figures (engine/figures.new_figure) and their tables
# ------------------------------------------------------------------------------------------------------
def grid(n: int, cols: int = 4) -> tuple[int, int]:
    cols = min(n, cols)
    return math.ceil(n / cols), cols


def refuse_others(command: str, paths: Sequence[str], overwrite: bool) -> None:
    """With --overwrite, a RunDirError naming the first of `paths` that the subcommand `command` did not write
    (OWN): at the start, and again at the write, for a file another command put there meanwhile."""
    if overwrite:
        outputs.refuse_others_files(list(paths), SOURCE, **OWN[command])


def save_marked(fig, path: str, overwrite: bool) -> None:
    """The figure at `path`, marked as this script's (its PNG text Source), by which `refuse_others` knows it."""
    save_figure(fig, path, overwrite, dpi=120, metadata=outputs.source_mark(SOURCE))


def write_csv(path: str, rows: Sequence[dict], fields: Sequence[str], overwrite: bool) -> None:
    """The table at `path`; without `overwrite` never over a file another command wrote since this one started
    (check_outputs looked at the start only): RunDirError then."""
    outputs.write_csv(path, list(rows), list(fields), overwrite, extrasaction="ignore")


# ------------------------------------------------------------------------------------------------------
# Subcommands
# ------------------------------------------------------------------------------------------------------
def surrogate_stats(name: str, real: torch.Tensor, sur: torch.Tensor) -> dict:
    """Agreement of the surrogate with the real branch on one block's tokens (rows) x channels."""
    r, s = real.double().flatten(), sur.double().flatten()
    corr = float(torch.corrcoef(torch.stack([r, s]))[0, 1])
    top = r.abs().topk(max(1, r.numel() // 100)).indices  # the 1% largest real outputs
    # the channels carrying the largest outputs: the paper's claim is that these coincide
    top_real = set(real.abs().amax(0).topk(min(5, real.shape[1])).indices.tolist())
    top_sur = set(sur.abs().amax(0).topk(min(5, sur.shape[1])).indices.tolist())
    return {"block": name, "tokens": real.shape[0], "channels": real.shape[1], "pearson": round(corr, 4),
            "top1pct_sign_agreement": round(float((r[top].sign() == s[top].sign()).double().mean()), 4),
            "max_abs_real": round(float(r.abs().max()), 4),
            "max_abs_surrogate": round(float(s.abs().max()), 4),
            "channel_max_real": int(real.abs().amax(0).argmax()),
            "channel_max_surrogate": int(sur.abs().amax(0).argmax()),
            "top5_channels_shared": len(top_real & top_sur)}


def plot_points(real: torch.Tensor, sur: torch.Tensor, limit: int, seed: int = 0):
    """At most `limit` (surrogate, real) points: the 10% of them with the largest magnitudes (the
    outliers the figure is about) plus a seeded uniform sample of the rest."""
    r, s = real.flatten(), sur.flatten()
    if r.numel() <= limit:
        return s, r
    big = torch.maximum(r.abs(), s.abs()).topk(limit // 10).indices
    # drawn on the CPU whatever the default device (the same sample on any device), then moved beside `big`
    generator = torch.Generator(device="cpu").manual_seed(seed)
    rest = torch.randperm(r.numel(), generator=generator, device="cpu")[:limit - len(big)].to(r.device)
    idx = torch.cat([big, rest])
    return s[idx], r[idx]


def cmd_surrogate(args: argparse.Namespace) -> dict:
    png, csv_path = check_outputs(args.out, "surrogate", args.overwrite)
    loaded = load(args, images=True)
    device = pick_device(loaded.cfg, args.device)
    model = loaded.model.to(device)
    blocks = select_blocks(ffn_blocks(model), args.blocks)
    images, _ = next(iter(val_loader(loaded.cfg, input_size(model), args.images)))
    if len(images) < args.images:  # a val split smaller than asked: the figure would name a count it lacks
        raise MechanismError(f"--images {args.images}: the val split has {len(images)} images; give --images "
                             f"{len(images)} or fewer")
    captured = capture_ffn(model, blocks, images[:args.images].to(device))

    nrows, ncols = grid(len(blocks))
    rows, fig = [], new_figure(3.2 * ncols, 3.0 * nrows + 0.4)
    for k, (name, block) in enumerate(blocks):
        z, real = captured[name]
        with torch.no_grad():
            sur = ffn_surrogate(block.mlp, z, bias=args.bias)
        real, sur = real.float().cpu(), sur.float().cpu()
        rows.append(surrogate_stats(name, real, sur))
        x, y = plot_points(real, sur, args.max_points)
        ax = fig.add_subplot(nrows, ncols, k + 1)
        ax.scatter(x.numpy(), y.numpy(), s=2, alpha=0.3, linewidths=0, rasterized=True)
        lim = float(max(x.abs().max(), y.abs().max())) * 1.05
        ax.plot([-lim, lim], [-lim, lim], "k--", linewidth=0.8)  # y = x
        ax.set_xlim(-lim, lim)
        ax.set_ylim(-lim, lim)
        ax.set_title(f"{name} (r = {rows[-1]['pearson']:.2f})", fontsize=9)
        ax.set_xlabel("surrogate $W_{F2}W_{F1}x$" + (" + biases" if args.bias else ""), fontsize=8)
        ax.set_ylabel("real FFN output", fontsize=8)
    fig.suptitle(f"FFN branch vs no-activation surrogate, {args.images} val images\n{loaded.source}",
                 fontsize=8)
    fig.tight_layout()
    refuse_others("surrogate", [png, csv_path], args.overwrite)
    save_marked(fig, png, args.overwrite)
    write_csv(csv_path, rows, SURROGATE_FIELDS, args.overwrite)
    for r in rows:
        print(f"{r['block']}: pearson {r['pearson']:.3f}, max |real| {r['max_abs_real']:.2f}, "
              f"max |surrogate| {r['max_abs_surrogate']:.2f}, "
              f"top-5 channels shared {r['top5_channels_shared']}")
    return {"files": [png, csv_path], "blocks": rows}


def cmd_alignment(args: argparse.Namespace) -> dict:
    png, csv_path = check_outputs(args.out, "alignment", args.overwrite)
    loaded = load(args)
    blocks = select_blocks(ffn_pairs(loaded.model), args.blocks)
    rows, alphas = rank_directions(blocks)

    # A 384 x 1536 field of alpha_ij has a few bright pixels that vanish at page size, so the figure shows
    # what the paper reads off it. Left: each block's directions ranked by their peak max_j alpha_ij (a
    # block whose first points stand far above its bulk has the concentrated alignment of App. A.1), the
    # strongest (block, i, j) labelled. Right: for the blocks with the highest peaks, alpha cropped to their
    # strongest directions and FC2 rows, sorted, with the original indices on the axes.
    peak = {name: float(a.max()) for name, a in alphas.items()}
    detail = sorted(peak, key=lambda n: -peak[n])[:max(0, args.detail)]
    fig = new_figure(5.0 + 3.6 * len(detail), 3.8)
    ax = fig.add_subplot(1, 1 + len(detail), 1)
    for name, a in alphas.items():
        ranked = a.max(dim=1).values.sort(descending=True).values[:args.crop * 4].float().numpy()
        ax.plot(range(1, len(ranked) + 1), ranked, linewidth=1.0 if name in detail else 0.6,
                label=name if name in detail else None, alpha=1.0 if name in detail else 0.45)
    for r in rows[:3]:
        ax.annotate(f"{r['block']} i={r['direction']} j={r['row']}", (1, r["alpha"]), fontsize=6,
                    xytext=(4, -3 - 7 * r["rank"]), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("direction rank within the block (by its peak)", fontsize=8)
    ax.set_ylabel("$\\max_j |\\hat w_{2,j}^\\top u_i|$", fontsize=8)
    ax.set_title("peak alignment per FC1 direction", fontsize=9)
    ax.grid(alpha=0.3)
    if detail:
        ax.legend(fontsize=6)
    for k, name in enumerate(detail):
        directions, fc2_rows = strongest_cells(alphas[name], args.crop)
        crop = alphas[name][directions][:, fc2_rows].float().numpy()
        ax = fig.add_subplot(1, 1 + len(detail), k + 2)
        im = ax.imshow(crop, aspect="auto", interpolation="nearest", cmap="magma", vmin=0.0)
        ax.set_xticks(range(len(fc2_rows)))
        ax.set_xticklabels([str(j) for j in fc2_rows], fontsize=5, rotation=90)
        ax.set_yticks(range(len(directions)))
        ax.set_yticklabels([str(i) for i in directions], fontsize=5)
        ax.set_title(f"{name}: strongest {len(directions)} directions x {len(fc2_rows)} rows", fontsize=8)
        ax.set_xlabel("FC2 row j", fontsize=8)
        ax.set_ylabel("FC1 direction i", fontsize=8)
        fig.colorbar(im, ax=ax)
    fig.suptitle(f"FC1-FC2 alignment (App. A.1, Eq. (13)): {loaded.source}", fontsize=8)
    fig.tight_layout()
    # files only once everything is computed and drawn: a failure leaves no partial output to refuse later
    refuse_others("alignment", [png, csv_path], args.overwrite)
    save_marked(fig, png, args.overwrite)
    write_csv(csv_path, rows, ALIGNMENT_FIELDS, args.overwrite)
    for r in rows[:5]:
        print(f"#{r['rank']}: {r['block']} direction {r['direction']} row {r['row']}: "
              f"alpha {r['alpha']:.3f}, s {r['singular_value']:.3f}")
    return {"files": [png, csv_path], "ranked": rows}


def cmd_remove(args: argparse.Namespace) -> dict:
    bits = parse_bits(args.bits)  # its form checked by parse_args
    json_path, png = check_outputs(args.out, "remove", args.overwrite)
    start = time.perf_counter()
    loaded = load(args, images=True)
    cfg, device = loaded.cfg, pick_device(loaded.cfg, args.device)
    try:  # before any work: repq at w4a16 (weight-only bits) raised deep inside the first quantization
        PIPELINES[args.pipeline].validate(bits, pipeline_options(cfg, args.pipeline))
    except ValueError as e:
        raise MechanismError(f"--pipeline {args.pipeline} --bits {args.bits}: {e}") from None
    # a pattern that names no module would be recorded in remove.json as probed while adding nothing
    check_extra_modules(loaded.model, cfg.quant.act_max_extra_modules)
    model = loaded.model.to(device)
    blocks = select_blocks(ffn_pairs(model), args.blocks)
    ranked, _ = rank_directions(blocks)
    if args.k > len(ranked):
        raise MechanismError(f"--k {args.k}: the chosen blocks have only {len(ranked)} directions")
    img_size = input_size(model)
    loader = val_loader(cfg, img_size, cfg.train.eval_batch_size_per_gpu)
    calib = calibration_set(cfg, img_size).to(device)
    settings = remove_settings(args, cfg, img_size)

    results = []
    for k in range(args.k + 1):
        t0 = time.perf_counter()
        # "sequentially set the corresponding FC1 singular values to zero" (App. A.1): k = 0 is the model
        # itself, k the top-k directions of the ranking of the unmodified model
        current = model if k == 0 else model_without(model, ranked[:k], blocks)
        # one pass gives FP accuracy and the activation maxima (the hooks only read the outputs)
        with ActivationProbe(current, extra_modules=cfg.quant.act_max_extra_modules) as probe:
            fp = evaluate(current, loader, device)
        act = probe.result()
        quant = evaluate_quantized(args.pipeline, current, calib, bits,
                                   eval_fn=lambda m: evaluate(m, loader, device),
                                   options=pipeline_options(cfg, args.pipeline))
        # the FFN output (mlp.fc2) is what the removal acts on directly; the module maximum may sit elsewhere
        ffn = max((r["max"] for r in act.per_layer if r["type"] == "mlp.fc2"), default=0.0)
        results.append({"k": k, "removed": [{key: r[key] for key in ("block", "direction", "row", "alpha",
                                                                    "singular_value")} for r in ranked[:k]],
                        "fp_top1": fp["top1"], "max_act_module": act.module, "max_act_block": act.block,
                        "max_act_ffn": ffn, "quant_top1": quant["top1"],
                        "seconds": round(time.perf_counter() - t0, 2)})
        print(f"k={k}: FP top-1 {fp['top1']:.2f}, max act {act.module:.2f} / {act.block:.2f} / {ffn:.2f} "
              f"(module / block / mlp.fc2), {args.pipeline} {bits} top-1 {quant['top1']:.2f}")

    summary = {"source": loaded.source, "model": model_label(cfg.model), "method": loaded.label,
               "pipeline": args.pipeline, "bits": str(bits), "images": len(loader.dataset),
               "calib_images": cfg.quant.calib_images, "settings": settings,
               # which modules max_act_module is over besides those inside blocks (the maxima's own setting)
               "act_max_extra_modules": list(cfg.quant.act_max_extra_modules), "blocks": [n for n, _ in blocks],
               "results": results, "seconds": round(time.perf_counter() - start, 2)}
    # left: accuracies against k; right: the maxima against k (the paper draws quantized accuracy against
    # the maximum with the marker area proportional to FP accuracy; two plain panels show the same numbers)
    fig = new_figure(8.0, 3.4)
    ks = [r["k"] for r in results]
    ax = fig.add_subplot(1, 2, 1)
    ax.plot(ks, [r["fp_top1"] for r in results], "o-", label="FP")
    ax.plot(ks, [r["quant_top1"] for r in results], "s-", label=f"{args.pipeline} {str(bits).upper()}")
    ax.set_xlabel("top-k aligned FC1 directions removed")
    ax.set_ylabel("top-1 (%)")
    ax.set_xticks(ks)
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    for key, label in (("max_act_module", "module"), ("max_act_block", "block"), ("max_act_ffn", "mlp.fc2")):
        ax.plot(ks, [r[key] for r in results], "o-", label=label)
    ax.set_xlabel("top-k aligned FC1 directions removed")
    ax.set_ylabel("max |activation| over the val set")
    ax.set_xticks(ks)
    ax.legend(fontsize=8)
    fig.suptitle(f"removing aligned directions (App. A.1): {loaded.source}", fontsize=8)
    fig.tight_layout()
    refuse_others("remove", [json_path, png], args.overwrite)
    save_marked(fig, png, args.overwrite)
    outputs.write_json(json_path, summary, args.overwrite, indent=1)
    return {"files": [json_path, png], **summary}


def remove_settings(args: argparse.Namespace, cfg, img_size: int) -> dict:
    """What `remove`'s numbers depend on besides the weights file and --k / --blocks: the quantization settings as
    evaluate.py records them with each result (engine/quant_settings.py: --pipeline's options with quant.first_last
    applied, the calibration batch's count, seed, split and transform, the training transform where it is read),
    the val data as evaluate.py's result files name it, which weights of the checkpoint, and the --config files and
    key=value overrides given (a quant.repq.reparam=false result would otherwise read as one of the defaults)."""
    return {"quant": quant_settings(cfg, args.pipeline), "data": data_identity(cfg.data, img_size),
            "weights": "ema" if args.ema else "raw",
            "config_files": [os.path.abspath(path) for path in args.config or ()],
            "overrides": list(args.overrides)}


def distinct_tails(paths: Sequence[str]) -> list[str]:
    """The shortest tails of `paths` (their last 1, 2, ... parts) that tell them apart: two runs' best.pt by their
    run folders ('a/best.pt', 'b/best.pt'), two files of one folder by their names; the whole paths if nothing
    shorter does."""
    parts = [os.path.normpath(p).split(os.sep) for p in paths]
    for n in range(1, max(map(len, parts)) + 1):
        tails = ["/".join(p[-n:]) for p in parts]
        if len(set(tails)) == len(tails):
            return tails
    return list(paths)


def cmd_energies(args: argparse.Namespace) -> dict:
    png, csv_path = check_outputs(args.out, "energies", args.overwrite)
    models = [load(args)]
    if args.compare:
        models.append(load_compare(args.compare, models[0], args))
    labels = list(args.labels if args.labels is not None else [m.label for m in models])  # counted by parse_args
    if len(set(labels)) < len(labels):  # e.g. two baselines: tell them apart by where their files are
        labels = [f"{lab} ({where})" for lab, where in zip(labels, distinct_tails([m.source for m in models]))]
    tables = [pair_energies(m.model) for m in models]
    difference = pairs_differ(*tables) if len(tables) == 2 else None
    if difference is not None:  # load_compare checked the configs: this is a model they do not tell apart
        raise MechanismError(f"--compare {args.compare}: its pairs differ from those of the first model "
                             f"({difference}); compare two checkpoints of the same architecture")
    rows = [{"label": lab, "source": m.source, **r} for lab, m, t in zip(labels, models, tables) for r in t]

    roles = list(dict.fromkeys(r["role"] for r in tables[0]))
    fig = new_figure(3.4 * len(roles), 3.2)
    width = 0.8 / len(models)
    for k, role in enumerate(roles):
        ax = fig.add_subplot(1, len(roles), k + 1)
        for m, (lab, table) in enumerate(zip(labels, tables)):
            values = [r["energy"] for r in table if r["role"] == role]
            ax.bar([i + (m - (len(models) - 1) / 2) * width for i in range(len(values))], values, width,
                   label=lab)
        ax.set_title(role, fontsize=9)
        ax.set_xlabel("block (in model order)", fontsize=8)
        if k == 0:
            ax.set_ylabel("$\\|W_2 \\bar W_1\\|_F^2$", fontsize=8)
            ax.legend(fontsize=7)
    fig.suptitle("pair energies (Sec. 3.1, Eq. (2); normalised as App. A.2, Eq. (23))", fontsize=9)
    fig.tight_layout()
    refuse_others("energies", [png, csv_path], args.overwrite)
    save_marked(fig, png, args.overwrite)
    write_csv(csv_path, rows, ENERGY_FIELDS, args.overwrite)
    for role in roles:
        means = [sum(r["energy"] for r in t if r["role"] == role) / sum(r["role"] == role for r in t)
                 for t in tables]
        print(f"{role}: mean energy " + ", ".join(f"{lab} {v:.4g}" for lab, v in zip(labels, means))
              + (f" (ratio {means[1] / means[0]:.3f})" if len(means) == 2 and means[0] else ""))
    return {"files": [png, csv_path], "labels": labels, "rows": rows}


COMMANDS = {"surrogate": cmd_surrogate, "alignment": cmd_alignment, "remove": cmd_remove,
            "energies": cmd_energies}


# ------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------
# The config keys each subcommand reads (a key, or `section.*`: every key below it but those of `unread_keys`);
# `remove` also reads quant.<--pipeline>.*. An override of any other key would change nothing the subcommand
# computes (data.root for `alignment`, data.hflip for `surrogate`) and is refused, as is one of a key that a flag
# sets (FLAG_KEYS), which the flag overwrites.
READS = {"surrogate": ("model.*", "data.*"), "alignment": ("model.*",), "energies": ("model.*",),
         "remove": ("model.*", "data.*", "train.eval_batch_size_per_gpu", "quant.calib_images", "quant.calib_seed",
                    "quant.calib_transform", "quant.first_last", "quant.act_max_extra_modules")}
FLAG_KEYS = {"model.name": "--model", "model.pretrained": "--weights", "model.pretrained_strict": "--weights",
             "train.device": "--device", "quant.bits": "--bits", "quant.pipelines": "--pipeline"}
# the text data sets' keys: `surrogate` and `remove` refuse a language model, so an override of one changes nothing
TEXT_DATA_KEYS = ("data.val_windows", "data.kjv_val_fraction")


def unread_keys(command: str, cfg) -> dict[str, str]:
    """{key: why it is not read} of the keys below a READS section (model.*, data.*) that `command` does not read
    with the config `cfg` (data.hflip, data.mixup, model.drop_path were accepted and ignored); with `cfg` None,
    those it reads with no config (remove's training-transform keys, read with quant.calib_transform=train, left
    out)."""
    unread = dict.fromkeys(TRAIN_MODE_MODEL_KEYS, "a training-mode setting, and the model is read in eval mode")
    if command not in ("surrogate", "remove"):
        return unread
    unread.update(dict.fromkeys(TRAIN_BATCH_OVERRIDE_KEYS, "a setting of training batches"))
    unread.update(dict.fromkeys(TEXT_DATA_KEYS, "a language model's data, which it refuses"))
    # remove's calibration reads the training transform with quant.calib_transform=train
    if command == "surrogate" or (cfg is not None and cfg.quant.calib_transform != "train"):
        unread.update(dict.fromkeys(TRAIN_TRANSFORM_ONLY_OVERRIDE_KEYS, "a setting of the training transform, and "
                                    "it reads eval-transform images only (quant.calib_transform=eval)"))
    if command == "surrogate":  # val images only: remove calibrates on train-split images
        unread.update(dict.fromkeys(("data.train_split", "data.synthetic_train_size"),
                                    "a setting of the train split, and it reads val images only"))
    return unread


def reads_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The config keys `args.command` reads (READS; `remove` also quant.<--pipeline>.*); `unread_keys` names those
    below them that it does not."""
    return READS[args.command] + ((f"quant.{args.pipeline}.*",) if args.command == "remove" else ())


def is_read(key: str, reads: Sequence[str], unread: dict) -> bool:
    return key not in FLAG_KEYS and key not in unread and \
        any(key == r or (r.endswith(".*") and key.startswith(r[:-1])) for r in reads)


def not_read(command: str, key: str, reads: Sequence[str], unread: dict) -> str:
    """Why `command` does not read `key`: what it reads, or why a key of a section it reads is left unread."""
    why = unread.get(key) or f"it reads {', '.join(reads)}"
    return f"`{command}` does not read {key} ({why})"


def check_config_layers(args: argparse.Namespace, saved: dict, checkpoint: str) -> None:
    """Refuse a --config file that changes, over `checkpoint`'s own config (`saved`), a key that `args.command`
    does not read: as an override of it would be, it changes nothing computed, and of the method's keys (cd.*,
    tweo.*) it would relabel the checkpoint's weights by another method than they were trained with."""
    if not args.config:
        return
    own = config_to_dict(config_from_dict(saved))
    cfg = layer_config(config_from_dict(saved), args.config, args.overrides)  # the config the subcommand reads
    layered = config_to_dict(layer_config(config_from_dict(saved), args.config, ()))
    reads, unread = reads_of(args), unread_keys(args.command, cfg)
    for change in config_changes(own, layered):
        key = change.split(": ", 1)[0]
        if not is_read(key, reads, unread):
            raise MechanismError(f"--config {' '.join(args.config)} changes {change} over {checkpoint}'s own, and "
                                 f"{not_read(args.command, key, reads, unread)}: give --config files of the "
                                 f"settings it reads only, or key=value overrides")


def check_flag_overrides(args: argparse.Namespace) -> None:
    """Refuse an override of a key that a flag of `args.command` sets (FLAG_KEYS); before the config is loaded, where
    the flag's own item (model.name=<--model>) would meet it as a key given twice."""
    for item in args.overrides:
        for key in override_keys(item):
            flag = FLAG_KEYS.get(key)
            if flag in ("--model", "--weights") and args.checkpoint:
                raise MechanismError(f"{item}: the model and its weights come from --checkpoint {args.checkpoint}; "
                                     "drop it")
            if flag and hasattr(args, flag[2:]):  # a flag of this subcommand
                raise MechanismError(f"{item}: `{args.command}` sets {key} from {flag}; give {flag} instead")


def check_overrides(args: argparse.Namespace, cfg) -> None:
    """Refuse an override that `args.command` would not read with the config `cfg` (READS, unread_keys); after the
    config loader has checked the overrides against the schema (which names the key meant by a misspelt one)."""
    reads, unread = reads_of(args), unread_keys(args.command, cfg)
    for item in args.overrides:
        for key in override_keys(item):
            if not is_read(key, reads, unread):
                raise MechanismError(f"{item}: {not_read(args.command, key, reads, unread)}; drop it")


def check_overrides_first(args: argparse.Namespace) -> None:
    """Refuse, before the config is loaded, an override of a schema key that `args.command` reads under no config
    (unread_keys with none): the loader's rules would first ask for a deciding key that it does not read either
    (`alignment` of a digits checkpoint with data.root=/x: 'set data.dataset as well', then data.dataset=folder
    refused), where dropping it is the fix. A key the schema does not know is left to the loader, which names the
    key meant; the keys read under some configs only, to check_overrides."""
    reads, unread = reads_of(args), unread_keys(args.command, None)
    for item in args.overrides:
        for key in override_keys(item):
            if is_setting(key) and not is_read(key, reads, unread):
                raise MechanismError(f"{item}: {not_read(args.command, key, reads, unread)}; drop it")


def is_setting(key: str) -> bool:
    """Whether `key` is a setting of the schema: a key that holds a value (not a section), or an entry of a dict
    field (model.kwargs.depth)."""
    keys = schema_keys()
    if any(key.startswith(field + ".") for field in dict_fields()):
        return True
    return key in keys and not any(k.startswith(key + ".") for k in keys)


def build_parser(command: str) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=f"mechanism.py {command}", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="best.pt / checkpoint.pt written by train.py")
    parser.add_argument("--model", help="timm model name (or a variant such as vit_micro), with --weights")
    parser.add_argument("--weights", help="local .pth/.pt/.safetensors weights for --model")
    parser.add_argument("--config", action="append", help="YAML layer(s) on top of the model's config")
    parser.add_argument("--ema", action="store_true", help="the checkpoint's EMA weights")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    if command in ("surrogate", "remove"):  # the others compute on the CPU
        parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                            help="auto: the train.device of the config, cuda where that is auto and torch sees "
                                 "one (default: %(default)s)")
    parser.add_argument("--threads", type=at_least(1), help="CPU threads (default: 1 for models under 5M "
                        "parameters, torch's default otherwise)")
    if command in ("surrogate", "alignment", "remove"):
        parser.add_argument("--blocks", nargs="*", help="0-based block positions or names (default: all)")
    if command == "surrogate":
        parser.add_argument("--images", type=at_least(1), default=8, help="validation images (default 8)")
        parser.add_argument("--bias", action="store_true",
                            help="keep fc1/fc2 biases in the surrogate (the paper's Eq. (8) has none)")
        parser.add_argument("--max-points", type=at_least(1), default=40000,
                            help="points drawn per block (default: %(default)s)")
    if command == "alignment":
        parser.add_argument("--detail", type=at_least(1), default=3,
                            help="blocks with the highest peak drawn in detail (default 3)")
        parser.add_argument("--crop", type=at_least(1), default=16,
                            help="strongest directions and FC2 rows shown per detail block (default 16)")
    if command == "remove":
        parser.add_argument("--k", type=at_least(0), default=3, help="remove the top 1..k directions (default 3)")
        parser.add_argument("--pipeline", default="repq", choices=["repq", "percentile"],
                            help="the quantization pipeline scored (default: %(default)s)")
        parser.add_argument("--bits", default="w4a4", help="bit-width, e.g. w4a4 or w3a3 (default: %(default)s)")
    if command == "energies":
        parser.add_argument("--compare", help="a second checkpoint (or weights file) drawn side by side")
        parser.add_argument("--labels", nargs="*", help="legend labels (default: Baseline / CD / ...)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. data.root=/data")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        # python -OO strips the docstring: the subcommands at least
        print(__doc__ or f"usage: mechanism.py {{{','.join(COMMANDS)}}} ... (each has --help)")
        sys.exit(0 if argv else 2)
    if argv[0] not in COMMANDS:  # a usage error as argparse's own: one `error:` line, status 2
        OneLineParser(prog="mechanism.py").error(f"unknown subcommand {argv[0]!r}; give one of "
                                                 f"{', '.join(COMMANDS)}")
    parser = build_parser(argv[0])
    args = parser.parse_intermixed_args(argv[1:])
    args.command = argv[0]
    move_overrides(args, "blocks", "labels")  # `--blocks 1 2 data.root=x`: data.root=x is an override
    # a value a flag refuses on its own is a usage error, as argparse's (status 2), before any model is loaded
    if getattr(args, "blocks", None) == []:  # `--blocks` with nothing after it: a list cut off, not "all"
        parser.error("--blocks without a block: give 0-based positions or names, or drop --blocks for all")
    if getattr(args, "labels", None) == []:  # `--labels` with nothing after it: a list cut off, not "the defaults"
        parser.error("--labels without a label: give one per model, or drop --labels for the defaults")
    if args.command == "energies" and args.labels is not None and len(args.labels) != 1 + bool(args.compare):
        parser.error(f"--labels {' '.join(args.labels)}: give one label per model ({1 + bool(args.compare)})")
    if args.command == "remove":
        try:
            parse_bits(args.bits)
        except ValueError as e:
            parser.error(f"--bits {args.bits}: {e}")
    return args


def missing_folders(path: str) -> list[str]:
    """`path` and each of its parents that does not exist yet, deepest first: what makedirs would create."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def main(argv: Sequence[str]) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    created = missing_folders(args.out)
    try:
        result = COMMANDS[args.command](args)
    except BaseException:  # a refusal or failure leaves no empty folder behind: only those this run made
        for folder in created:
            with contextlib.suppress(OSError):  # not empty (or gone): left as it is
                os.rmdir(folder)
        raise
    print(f"wrote {', '.join(result['files'])} [{time.perf_counter() - start:.1f}s]")
    return result


ERRORS = (MechanismError, ConfigError, CheckpointError, DataError, ModelError, RunDirError)


def cli(argv: Sequence[str]) -> int:
    """main() with every user error as one `error:` line on stderr (exit status 1), no traceback; a usage error
    (an unknown flag or subcommand, a bad value) is one such line from OneLineParser, with status 2."""
    try:
        main(argv)
    except ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(cli(sys.argv[1:]))
