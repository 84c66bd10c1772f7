r"""Cross-check of our APHQ-ViT pipeline (quant/aphq/) against the official code (GoatWu/APHQ-ViT).

Both implementations quantize the same float checkpoint from the same tensors: the reconstruction
images our `aphq` pipeline draws (quant.aphq.recon_images = 1024 train-split images, training
transform, one fixed augmentation each, seed quant.aphq.data_seed), their first quant.aphq.calib_images
(128) as the calibration set, and the val split (eval transform). For every bit-width, two stages:

  calibration     scale / zero-point search only. Official: right after QuantCalibrator (test_quant.py
                  validates the model there); ours: the pipeline with iters=0 (calibration only)
  reconstruction  block reconstruction with --iters iterations per unit in both

Reported per stage: top-1 of each, per-image agreement (fraction of val images with the same
predicted class), each unit's output error relative to the float model (end-to-end on the val images),
and how many quantizer groups (channels, heads, tensors) got the same scale and zero point in both,
with (calibration stage) `candidate_steps`: how far apart adjacent candidates of the official grids lie
on this model, the yardstick for a differing group's scale difference.
`--reference-seed S` also reconstructs ours with seed S: the ours-vs-ours agreement is the sampling
noise of the reconstruction (batch draws, QDrop masks), the scale of any ours-vs-official difference.

    python scripts/crosscheck_aphq.py --checkpoint runs/vit_digits/best.pt --official /tmp/aphq_official \
        --out runs/aphq_xcheck/xcheck.json --bits w4a4 w3a3 --iters 500 --threads 1

The official checkout is read, never copied into this repository: the official modules are imported
from --official at run time (e.g. `git clone https://github.com/GoatWu/APHQ-ViT /tmp/aphq_official`;
checked at commit 84c9fde). The official path is test_quant.py with --calibrate --optimize and
without --reconstruct-mlp, configs/<b>bit/best.py: wrap_modules_in_net(reparam=True),
QuantCalibrator.batching_quant_calib, wrap_reparamed_modules_in_net, then
BlockReconstructor.reconstruct_model(quant_act=True, mode=optim_mode, drop_prob=drop_prob).

Adaptations of the official code to this machine and timm 1.x (in this process only; the patches of
1, 2, 4 and 5 are undone after each official run; `option_differences` lists, per bit-width, every
one of our quant.aphq options that differs from the official config or its hard-coded values):
 1. No GPU: torch.Tensor.cuda and nn.Module.cuda return self. No effect on the numbers.
 2. `_initialize_calib_parameters` of the official linear / conv / matmul layers raises without CUDA: it
    runs with torch.cuda reporting a 4 GiB device. That only sets how many candidates one chunk
    evaluates (parallel_eq_n); each candidate's error is computed on its own, so no effect beyond
    float summation order.
 3. test_quant.py itself is not run: it builds the model by ImageNet name (timm 0.9.2), loads ImageNet
    with its own loaders (224 px, 1000 classes) and writes checkpoints. Its steps are called as it calls
    them, on deep copies of our float model (timm 1.0.31 VisionTransformer as built by models/) and on
    our tensors in batches of the config's calib_batch_size / optim_batch_size; labels are not used.
    Effect: officially the 128 calibration images are a second draw with fresh augmentations of the
    first 128 source images; here they are the same tensors as ours (the first 128 of the 1024).
 4. The iterations per unit (reconstruct_single_block's iters=20000, which test_quant.py does not
    expose) are --iters; the rounding warm-up / beta decay and the cosine lr scale with them, as ours.
 5. timm 1.x: its ViT Block calls attn(x, attn_mask=None, is_causal=False), but the official
    vit_attn_forward takes x only (timm 0.9.2 passed no more): it is wrapped to accept and refuse (raise
    on) a mask. The official replacement forwards also drop Attention.norm / gate / q_norm (scale_norm,
    gated, qk_norm) and PatchEmbed's size check / dynamic padding: the script refuses models where these
    are not Identity / None / off. Block classes and window_partition are found under the timm 1.x names
    the official code uses. No effect on the numbers.
 6. Seeds: torch.manual_seed(--official-seed, default 3407 = test_quant.py's --seed) before the official
    run; ours uses quant.aphq.seed. Batch draws and QDrop masks differ between the two (see
    --reference-seed).
Evaluation is this script's loop (argmax of the logits) for both, on the same val tensors.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import importlib
import importlib.util
import logging
import os
import platform
import sys
import time
from typing import Dict, Iterator, List, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import evaluate  # noqa: E402
from configs.cli import OneLineParser, at_least, first_line, move_overrides, passed_on_epilog  # noqa: E402
from data import build_eval_loader  # noqa: E402
from engine.checkpoint import weights_fingerprint  # noqa: E402
from engine import outputs  # noqa: E402
from engine.run_dir import refuse_existing_outputs  # noqa: E402
from models import input_size  # noqa: E402
from quant import PipelineData, evaluate_quantized, parse_bits  # noqa: E402
from quant.plan import pipeline_options  # noqa: E402
from quant.aphq.search import matmul_candidates, official_levels, stem_levels  # noqa: E402
from quant.attention import QuantAttentionBase  # noqa: E402
from quant.layers import QuantConv2d, QuantLinear  # noqa: E402
from quant.quantile import quantile  # noqa: E402
from quant.units import find_units  # noqa: E402

log = logging.getLogger("crosscheck_aphq")
# By these --overwrite knows its own JSON (engine.outputs.refuse_others_files): keys every version of it has written
SOURCE = "scripts/crosscheck_aphq.py"
RESULT_KEYS = ("checkpoint", "fingerprint", "official", "fp_top1", "bits")
OFFICIAL_MODULES = ("utils.calibrator", "utils.block_recon", "utils.wrap_net")
OFFICIAL_PACKAGES = ("utils", "quant_layers", "quantizers")
OFFICIAL_FILES = ("utils/calibrator.py", "utils/block_recon.py", "utils/wrap_net.py",
                  "quant_layers/linear.py",
                  "quant_layers/conv.py", "quant_layers/matmul.py", "quantizers/uniform.py",
                  "quantizers/adaround.py", "quantizers/_ste.py")
FAKE_DEVICE_MEMORY = 4 << 30  # adaptation 2: bytes the official chunking believes the device has
# Two scales are "the same" candidate within this relative difference. Chosen when ours took numpy's
# linear-interpolation quantiles, which moved a matmul candidate by up to ~5e-5 relative on vit_digits from the
# official float32 torch.quantile; ours now follow torch.quantile at the official float32 levels, so equal inputs
# give equal candidates bit for bit (tests/test_aphq_official_levels.py) and the tolerance is a margin only.
# Neighbouring candidates are mostly further apart (vit_digits: median relative step 3e-4 between matmul
# pairs, 2e-3 when one bound moves; 1.7e-4 between stem pairs), but the closest are not (down to ~1e-6), so a
# group counted "same" may be a neighbour, and a differing group is at least one candidate away.
SCALE_RTOL = 1e-4


class UserError(Exception):
    """A mistake in the command line (printed as one `error:` line)."""


# ---------------------------------------------------------------------------------------------- checks
def official_config(official: str, bits: str) -> str:
    """configs/<b>bit/best.py of the official checkout for `bits` (W and A equal, as its configs)."""
    try:
        b = parse_bits(bits)
    except ValueError as e:
        raise UserError(f"--bits: {e}") from None
    if b.w != b.a:
        raise UserError(f"--bits {bits}: the official configs have equal weight and activation bits")
    path = os.path.join(official, "configs", f"{b.w}bit", "best.py")
    if not os.path.isfile(path):
        raise UserError(f"--bits {bits}: the official checkout has no {os.path.relpath(path, official)}")
    return path


def check_official(official: str) -> None:
    missing = [f for f in OFFICIAL_FILES if not os.path.isfile(os.path.join(official, f))]
    if missing:
        raise UserError(f"--official {official} is not an APHQ-ViT checkout "
                        f"(missing {', '.join(missing[:3])})")


def official_digest(official: str) -> str:
    """sha256 of the official files this script runs (which code the numbers are of)."""
    h = hashlib.sha256()
    for rel in OFFICIAL_FILES:
        with open(os.path.join(official, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def check_model_fits_official(model: nn.Module) -> None:
    """Adaptation 5: the official forwards leave out these timm 1.x features, so they must be off."""
    from timm.models.vision_transformer import Attention, VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise UserError(f"the cross-check supports timm VisionTransformer models, not {type(model).__name__}")
    for name, m in model.named_modules():
        if isinstance(m, Attention) and (not isinstance(m.norm, nn.Identity) or getattr(m, "gate", None)
                                         is not None or not isinstance(m.q_norm, nn.Identity)):
            raise UserError(f"{name}: scale_norm / gate / qk_norm are not in the official attention forward")
    pe = model.patch_embed
    if getattr(pe, "dynamic_img_pad", False) or not pe.flatten or pe.proj.padding != (0, 0):
        raise UserError("patch_embed: dynamic padding / NHWC output / conv padding differ from the official")


def option_differences(options, cfg, bits: str) -> List[str]:
    """Our APHQ options that differ from what the official run uses (its config and its hard-coded values)."""
    b = parse_bits(bits)
    official = {
        "eq_n": cfg.eq_n, "search_rounds": cfg.search_round, "batch_size": cfg.optim_batch_size,
        "drop_prob": cfg.drop_prob, "input_mix_prob": cfg.drop_prob, "temperature": cfg.temp,
        "loss": "aph" if cfg.optim_metric == "hessian_perturb" else cfg.optim_metric, "hessian_probe": "ones",
        "hessian_eps": None, "matmul_steps": cfg.eq_n + 1, "weight_pct": (0.9, 1.0), "act_pct": (0.9, 1.0),
        "matmul_pct": (0.99, 0.99999), "weight_lr": 1e-3, "act_lr": 4e-5, "round_weight": 0.01,
        "beta_start": 20.0, "beta_end": 2.0, "warmup": 0.2, "normalize_loss": True, "round_zero_point": True,
        "mlp_reconstruct": False, "search_max_rows": None}
    diffs = [f"{k}: ours {getattr(options, k)!r}, official {v!r}" for k, v in official.items()
             if (tuple(getattr(options, k)) if isinstance(v, tuple) else getattr(options, k)) != v]
    first_last = options.resolved(b)
    official_first_last = {"stem": {"w": cfg.w_bit, "a": None},  # qconv_a_bit >= 8: float image input
                           "head": {"w": cfg.w_bit, "a": cfg.qhead_a_bit}}
    if (cfg.w_bit, cfg.a_bit) != (b.w, b.a) or first_last != official_first_last or cfg.qconv_a_bit < 8:
        diffs.append(f"bits: ours {bits} {first_last}, "
                     f"official w{cfg.w_bit}a{cfg.a_bit} {official_first_last}")
    if cfg.optim_mode != "qdrop" or not cfg.use_mean_hessian:
        diffs.append(f"official optim_mode {cfg.optim_mode!r}, use_mean_hessian {cfg.use_mean_hessian}")
    return diffs


# ------------------------------------------------------------------------------------------- metrics
def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of images with the same predicted class."""
    if a.shape != b.shape:
        raise ValueError(f"prediction shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return float((a == b).float().mean())


def top1(preds: torch.Tensor, labels: torch.Tensor) -> float:
    return 100.0 * float((preds == labels).float().mean())


@torch.no_grad()
def predict(model: nn.Module, images: torch.Tensor, batch_size: int) -> torch.Tensor:
    model.eval()
    return torch.cat([model(chunk).argmax(-1) for chunk in images.split(batch_size)])


@torch.no_grad()
def unit_errors(fp_model: nn.Module, model: nn.Module, units: List[str], images: torch.Tensor,
                batch_size: int) -> Dict[str, float]:
    """sum ||O_q - O||^2 / sum ||O||^2 of every unit's output, both models run end to end."""
    def outputs(m: nn.Module) -> Dict[str, torch.Tensor]:
        got: Dict[str, List[torch.Tensor]] = {u: [] for u in units}
        hooks = [m.get_submodule(u).register_forward_hook(
            lambda _m, _a, out, u=u: got[u].append(out.detach().float())) for u in units]
        try:
            predict(m, images, batch_size)
        finally:
            for h in hooks:
                h.remove()
        return {u: torch.cat(v) for u, v in got.items()}

    ref, out = outputs(fp_model), outputs(model)
    return {u: float((out[u] - ref[u]).pow(2).sum() / ref[u].pow(2).sum().clamp(min=1e-30)) for u in units}


def _group_match(ours_scale: torch.Tensor, ours_zp: torch.Tensor, off_scale: torch.Tensor,
                 off_zp: torch.Tensor) -> dict:
    s_o, s_f = ours_scale.detach().reshape(-1).double(), off_scale.detach().reshape(-1).double()
    z_o, z_f = ours_zp.detach().reshape(-1).double(), off_zp.detach().reshape(-1).double().round()
    if s_o.shape != s_f.shape:
        raise ValueError(f"group counts differ: {s_o.numel()} vs {s_f.numel()}")
    rel = (s_o - s_f).abs() / s_f.abs().clamp(min=1e-30)
    same = (rel <= SCALE_RTOL) & (z_o == z_f)
    return {"groups": int(s_o.numel()), "same": int(same.sum()), "max_scale_rel_diff": float(rel.max()),
            "zero_points_differ": int((z_o != z_f).sum()),
            "differing_scale_rel_diffs": [float(f"{v:.3g}") for v in rel[~same].tolist()]}


def compare_quantizers(ours: nn.Module, official: nn.Module) -> dict:
    """Per quantizer of ours, the official one's agreement (same FQNs; see `_group_match`), and totals."""
    per: Dict[str, dict] = {}
    for name, m in ours.named_modules():
        if isinstance(m, (QuantLinear, QuantConv2d)):
            off = official.get_submodule(name)
            if m.weight_quantizer is not None:
                per[f"{name}.weight"] = _group_match(m.weight_quantizer.scale, m.weight_quantizer.zero_point,
                                                     off.w_quantizer.scale, off.w_quantizer.zero_point)
            if m.input_quantizer is not None:
                per[f"{name}.input"] = _group_match(m.input_quantizer.scale, m.input_quantizer.zero_point,
                                                    off.a_quantizer.scale, off.a_quantizer.zero_point)
        elif isinstance(m, QuantAttentionBase):
            pairs = {"q": ("matmul1", "A"), "k": ("matmul1", "B"), "attn": ("matmul2", "A"),
                     "v": ("matmul2", "B")}
            for op, (mm, side) in pairs.items():
                q = getattr(m, f"{op}_quant")
                oq = getattr(official.get_submodule(f"{name}.{mm}"), f"{side}_quantizer")
                per[f"{name}.{op}"] = _group_match(q.scale, q.zero_point, oq.scale, oq.zero_point)
    totals: Dict[str, dict] = {}
    for key, r in per.items():
        kind = "weight" if key.endswith(".weight") else "input" if key.endswith(".input") else "matmul"
        t = totals.setdefault(kind, {"quantizers": 0, "groups": 0, "same": 0, "max_scale_rel_diff": 0.0})
        t["quantizers"] += 1
        t["groups"] += r["groups"]
        t["same"] += r["same"]
        t["max_scale_rel_diff"] = max(t["max_scale_rel_diff"], r["max_scale_rel_diff"])
    return {"totals": totals, "per_quantizer": per}


def compare_folds(ours: nn.Module, official: nn.Module) -> Dict[str, float]:
    """Largest |difference| / max |official| of the folded LayerNorm affines (norm1 / norm2)."""
    out = {}
    for name, m in ours.named_modules():
        if isinstance(m, nn.LayerNorm) and (name.endswith("norm1") or name.endswith("norm2")):
            off = official.get_submodule(name)
            for p in ("weight", "bias"):
                a, b = getattr(m, p).detach(), getattr(off, p).detach()
                out[f"{name}.{p}"] = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
    return out


def _spread(steps: List[torch.Tensor]) -> Dict[str, float]:
    t = torch.cat([s.flatten() for s in steps]).double()
    return {"min": float(f"{t.min():.3g}"), "median": float(f"{t.median():.3g}"), "max": float(f"{t.max():.3g}")}


def _relative_steps(lo: torch.Tensor, hi: torch.Tensor, ref: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Relative change of the scale (hi - lo) between adjacent candidates [steps, groups]: when the pair
    moves (the first sweep) and when one bound moves (the refinements), against the range `ref`."""
    width = hi - lo
    return {"pair": (width[1:] - width[:-1]).abs() / width[:-1],
            "one_bound": torch.cat([(hi[1:] - hi[:-1]).abs(), (lo[1:] - lo[:-1]).abs()]) / ref}


@torch.no_grad()
def candidate_steps(fp_model: nn.Module, calib: torch.Tensor, matmul_pct=(0.99, 0.99999),
                    matmul_steps: int = 129, eq_n: int = 128) -> dict:
    """How far apart adjacent candidates of the official grids are on this model (relative scale steps):
    per-head matmul operands (q, k, softmax output, v of the float model on `calib`; relative steps do
    not depend on where q's 1/sqrt(d) is applied) and the stem's per-channel weights. A group whose
    scales differ by less than a step cannot be told from the same candidate; one that differs by about
    a step picked a neighbour."""
    from timm.models.vision_transformer import Attention

    operands: Dict[str, List[torch.Tensor]] = {}

    def tap(name: str, attn: Attention):
        def hook(_m, args, out):
            B, N, _ = args[0].shape
            q, k, v = out.reshape(B, N, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
            probs = (q @ k.transpose(-2, -1) * attn.scale).softmax(-1)
            for op, x in (("q", q), ("k", k), ("attn", probs), ("v", v)):
                operands.setdefault(f"{name}.{op}", []).append(x)
        return hook

    hooks = [m.qkv.register_forward_hook(tap(n, m)) for n, m in fp_model.named_modules()
             if isinstance(m, Attention)]
    try:
        predict(fp_model, calib, 32)
    finally:
        for h in hooks:
            h.remove()
    matmul: Dict[str, List[torch.Tensor]] = {"pair": [], "one_bound": []}
    for batches in operands.values():
        lo, hi = matmul_candidates(torch.cat(batches).float(), matmul_pct, matmul_steps)
        for kind, t in _relative_steps(lo, hi, hi[-2] - lo[-2]).items():  # the search starts at pair -2
            matmul[kind].append(t)
    w = fp_model.patch_embed.proj.weight.detach().flatten(1).double()
    ups, lows = official_levels(stem_levels(eq_n))
    qs = quantile(w, ups + lows, dim=1)
    hi, lo = qs[:len(ups)], qs[len(ups):]
    stem = _relative_steps(lo, hi, hi[-2] - lo[-2])
    return {"matmul_pair": _spread(matmul["pair"]), "matmul_one_bound": _spread(matmul["one_bound"]),
            "stem_pair": _spread([stem["pair"]]), "stem_one_bound": _spread([stem["one_bound"]])}


def stage_entry(preds: Dict[str, torch.Tensor], labels: torch.Tensor, seconds: Dict[str, float],
                errors: Dict[str, Dict[str, float]]) -> dict:
    """One stage's JSON: top-1 and seconds per implementation, pairwise agreement, unit errors."""
    names = list(preds)
    entry = {n: {"top1": round(top1(preds[n], labels), 3), "seconds": round(seconds[n], 1)} for n in names}
    entry["agreement"] = {f"{a}_vs_{b}": round(agreement(preds[a], preds[b]), 4)
                          for i, a in enumerate(names) for b in names[i + 1:]}
    entry["unit_rel_error"] = errors
    return entry


# -------------------------------------------------------------------------------------- official code
@contextlib.contextmanager
def official_environment(official: str) -> Iterator[dict]:
    """Import the official modules from `official` and apply adaptations 1, 2 and 5 while inside."""
    clash = [p for p in OFFICIAL_PACKAGES
             if p in sys.modules and not _imported_from(sys.modules[p], official)]
    if clash:
        raise UserError(f"modules {clash} are already imported from elsewhere; the official ones would clash")
    if official not in sys.path:
        sys.path.insert(0, official)
    mods = {name.split(".")[-1]: importlib.import_module(name) for name in OFFICIAL_MODULES}
    quant_layers = importlib.import_module("quant_layers")
    with contextlib.ExitStack() as undo:
        def patch(owner, name: str, value) -> None:
            undo.callback(setattr, owner, name, getattr(owner, name))
            setattr(owner, name, value)

        patch(torch.Tensor, "cuda", lambda self, *a, **k: self)  # adaptation 1
        patch(nn.Module, "cuda", lambda self, *a, **k: self)
        for cls in (quant_layers.PTQSLBatchingQuantLinear, quant_layers.PTQSLBatchingQuantConv2d,
                    quant_layers.PTQSLBatchingQuantMatMul):  # adaptation 2
            patch(cls, "_initialize_calib_parameters", _with_fake_device(cls._initialize_calib_parameters))
        wrap_net = mods["wrap_net"]
        patch(wrap_net, "vit_attn_forward", _without_mask_arguments(wrap_net.vit_attn_forward))  # adapt. 5
        yield mods


def _without_mask_arguments(forward):
    """timm 1.x's Block passes attn_mask / is_causal to the attention; the official forward takes x only."""
    def run(self, x, attn_mask=None, is_causal=False):
        if attn_mask is not None or is_causal:
            raise ValueError("the official attention forward has no attention mask")
        return forward(self, x)
    return run


def _imported_from(module, folder: str) -> bool:
    where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), "")
    return os.path.abspath(where).startswith(os.path.abspath(folder) + os.sep)


def _with_fake_device(original):
    props = type("FakeDeviceProperties", (), {"total_memory": FAKE_DEVICE_MEMORY})()

    def run(self):
        saved = torch.cuda.is_available, torch.cuda.get_device_properties
        torch.cuda.is_available, torch.cuda.get_device_properties = (lambda: True), (lambda *_: props)
        try:
            return original(self)
        finally:
            torch.cuda.is_available, torch.cuda.get_device_properties = saved
    return run


def load_official_config(path: str):
    spec = importlib.util.spec_from_file_location(f"aphq_official_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Config()


def batches(images: torch.Tensor, batch_size: int) -> list:
    """The official loaders' (images, labels) batches; labels are never used on this path."""
    return [(chunk, torch.zeros(len(chunk), dtype=torch.long)) for chunk in images.split(batch_size)]


def run_official(official: str, cfg_path: str, fp_model: nn.Module, calib: torch.Tensor,
                 images: torch.Tensor, iters: int, seed: int, on_calibrated) -> tuple:
    """test_quant.py --calibrate --optimize on our model and tensors; `on_calibrated(model, seconds)` sees
    the calibrated model before reconstruction. Returns (reconstructed model, reconstruction seconds)."""
    cfg = load_official_config(cfg_path)
    with official_environment(official) as mods:
        torch.manual_seed(seed)  # adaptation 6
        model, full_model = copy.deepcopy(fp_model).eval(), copy.deepcopy(fp_model).eval()
        start = time.perf_counter()
        model = mods["wrap_net"].wrap_modules_in_net(model, cfg, reparam=True, recon=False).eval()
        calibrator = mods["calibrator"].QuantCalibrator(model, batches(calib, cfg.calib_batch_size))
        calibrator.batching_quant_calib()
        model = mods["wrap_net"].wrap_reparamed_modules_in_net(model).eval()
        on_calibrated(model, time.perf_counter() - start)
        if iters == 0:
            return None, 0.0
        recon = mods["block_recon"].BlockReconstructor
        original = recon.reconstruct_single_block

        def single_block(self, *args, **kwargs):  # adaptation 4
            return original(self, *args, **{**kwargs, "iters": iters})

        recon.reconstruct_single_block = single_block
        try:
            start = time.perf_counter()
            recon(model, full_model, batches(images, cfg.optim_batch_size), metric=cfg.optim_metric,
                  temp=cfg.temp, use_mean_hessian=cfg.use_mean_hessian).reconstruct_model(
                quant_act=True, mode=cfg.optim_mode, drop_prob=cfg.drop_prob, keep_gpu=cfg.keep_gpu)
            seconds = time.perf_counter() - start
        finally:
            recon.reconstruct_single_block = original
        return model.eval(), seconds


# --------------------------------------------------------------------------------------------- ours
def run_ours(fp_model: nn.Module, options, bits: str, data: PipelineData, val: torch.Tensor,
             batch_size: int) -> tuple:
    """Our pipeline through evaluate.py's entry (evaluate_quantized); returns (model, seconds, preds), with
    the seconds of the stage the official timing covers: the search (`calibrate`) when nothing is
    reconstructed, else the reconstruction (`reconstruct`, its Hessians included, and the float logits
    the APH needs)."""
    kept = {}

    def eval_fn(model: nn.Module) -> dict:
        kept["model"], kept["preds"] = model, predict(model, val, batch_size)
        return {}

    entry = evaluate_quantized("aphq", fp_model, None, bits, eval_fn, options=options, data=data)
    stages = entry["report"]["seconds"]
    seconds = stages["calibrate"] if options.iters == 0 else stages["reconstruct"] + stages.get("fp_logits", 0.0)
    return kept["model"], seconds, kept["preds"]


def fixed_pipeline_data(images: torch.Tensor, seed: int) -> PipelineData:
    """PipelineData that hands our pipeline exactly `images` (the tensors the official run gets too)."""
    def train_images(count: int, data_seed: int, train_transform: bool) -> torch.Tensor:
        if data_seed != seed or not train_transform or count > len(images):
            raise ValueError(f"the cross-check fixed {len(images)} training-transform images of seed {seed}; "
                             f"the pipeline asked for {count} of seed {data_seed} (train={train_transform})")
        return images[:count]

    return PipelineData(train_images=train_images)


# --------------------------------------------------------------------------------------------- main
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = OneLineParser(description=first_line(__doc__))
    parser.add_argument("--checkpoint", required=True, help="best.pt written by train.py (a timm ViT)")
    parser.add_argument("--official", required=True, help="path of a GoatWu/APHQ-ViT checkout (read only)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--bits", nargs="+", default=["w4a4", "w3a3"], help="bit-widths, W = A (default: w4a4 w3a3)")
    parser.add_argument("--iters", type=at_least(0), default=500,
                        help="reconstruction iterations per unit in both (official: 20000); "
                             "0: calibration only (default: %(default)s)")
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch CPU threads (default: %(default)s)")
    parser.add_argument("--official-seed", type=int, default=3407,
                        help="torch seed of the official run (default: %(default)s)")
    parser.add_argument("--reference-seed", type=int, default=None,
                        help="also reconstruct ours with this quant.aphq.seed (sampling-noise reference)")
    parser.add_argument("--overwrite", action="store_true", help="replace a JSON this script wrote at --out")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides (e.g. data.root=...)")
    parser.epilog = passed_on_epilog(parser, evaluate.build_parser(), "evaluate.py")
    args = parser.parse_args(argv)
    move_overrides(args, "bits")  # `--bits w4a4 data.root=d`: data.root=d is an override, as in evaluate.py
    # values the flags refuse on their own: usage errors (status 2), as argparse's, before any model is read
    if not args.bits:
        parser.error("--bits needs at least one bit-width, e.g. --bits w4a4")
    for bits in args.bits:
        try:
            b = parse_bits(bits)
        except ValueError as e:
            parser.error(f"--bits: {e}")
        if b.w != b.a:
            parser.error(f"--bits {bits}: the official configs have equal weight and activation bits")
    args.official = os.path.abspath(args.official)
    return args


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse_args(argv)
    refuse_existing_outputs([args.out], args.overwrite)
    if args.overwrite:  # a file of another's at --out is not this script's to replace
        outputs.refuse_others_files([args.out], SOURCE, json_keys=RESULT_KEYS)
    check_official(args.official)
    configs = {bits: official_config(args.official, bits) for bits in args.bits}
    torch.set_num_threads(args.threads)
    # the pipeline it checks: evaluate.py reads (and accepts overrides of) the options of the pipelines it runs
    eargs = evaluate.parse_args(["--checkpoint", args.checkpoint, "--quant", "aphq", *args.overrides])
    cfg, payload = evaluate.resolve_config(eargs)
    fp_model = evaluate.load_float_model(cfg, payload, eargs).eval()
    check_model_fits_official(fp_model)
    img_size = input_size(fp_model)
    options = pipeline_options(cfg, "aphq")
    loader = build_eval_loader(cfg.data, img_size=img_size,
                               batch_size_per_gpu=cfg.train.eval_batch_size_per_gpu, rank=0, world_size=1,
                               num_classes=cfg.model.num_classes)
    val, labels = (torch.cat(t) for t in zip(*loader))
    images = evaluate.build_pipeline_data(cfg, img_size, 0, 1, None).train_images(
        options.recon_images, options.data_seed, True)
    setup = Setup(fp_model, options, images, images[:options.calib_images], val,
                  [u.name for u in find_units(fp_model)], fixed_pipeline_data(images, options.data_seed))
    result = {
        "checkpoint": os.path.abspath(args.checkpoint), "model": cfg.model.name,
        "fingerprint": weights_fingerprint(fp_model.state_dict()),
        "official": {"path": args.official, "files_sha256": official_digest(args.official),
                     "configs": {b: os.path.relpath(p, args.official) for b, p in configs.items()}},
        "settings": {"iters": args.iters, "threads": args.threads, "official_seed": args.official_seed,
                     "ours_seed": options.seed, "reference_seed": args.reference_seed,
                     "calib_images": options.calib_images, "recon_images": options.recon_images,
                     "val_images": len(val), "data_seed": options.data_seed, "overrides": args.overrides},
        "environment": {"torch": torch.__version__, "timm": importlib.import_module("timm").__version__,
                        "python": platform.python_version(), "machine": platform.machine()},
        "fp_top1": round(top1(predict(fp_model, val, options.batch_size), labels), 3), "bits": {}}
    log.info("FP top-1 %.2f on %d val images; %d / %d calibration / reconstruction images",
             result["fp_top1"], len(val), options.calib_images, options.recon_images)
    for i, bits in enumerate(args.bits):
        result["bits"][bits] = res = compare_bits(setup, bits, configs[bits], labels, args)
        # the first write never over a file another command wrote since this one started; later ones over its own
        if args.overwrite and i == 0:  # nor over another's that another command put there meanwhile
            outputs.refuse_others_files([args.out], SOURCE, json_keys=RESULT_KEYS)
        write_json(args.out, result, overwrite=args.overwrite or i > 0)
        for stage, r in res.items():
            if stage == "option_differences":
                continue
            log.info("%s %s: ours %.2f, official %.2f, agreement %.4f", bits, stage, r["ours"]["top1"],
                     r["official"]["top1"], r["agreement"]["ours_vs_official"])
    return result


@dataclasses.dataclass
class Setup:
    """What both implementations get: the float model, our options and the shared tensors."""

    fp_model: nn.Module
    options: object  # APHQOptions with the checkpoint config's quant.aphq settings
    images: torch.Tensor  # reconstruction set
    calib: torch.Tensor  # its first calib_images
    val: torch.Tensor
    units: List[str]
    data: PipelineData


def compare_bits(s: Setup, bits: str, config: str, labels: torch.Tensor, args: argparse.Namespace) -> dict:
    """Both stages at one bit-width (see the module docstring)."""
    bs = s.options.batch_size
    differences = option_differences(s.options, load_official_config(config), bits)
    for d in differences:
        log.warning("%s: option differs from the official run: %s", bits, d)

    def errors(model: nn.Module) -> Dict[str, float]:
        return unit_errors(s.fp_model, model, s.units, s.val, bs)

    # calibration stage: ours with iters=0 (calibration only), official mid-run
    ours_cal, ours_cal_s, ours_cal_p = run_ours(s.fp_model, dataclasses.replace(s.options, iters=0), bits, s.data,
                                                s.val, bs)
    kept: dict = {}

    def on_calibrated(model: nn.Module, seconds: float) -> None:
        kept.update(preds=predict(model, s.val, bs), seconds=seconds, errors=errors(model),
                    quantizers=compare_quantizers(ours_cal, model), folds=compare_folds(ours_cal, model))

    off_model, off_s = run_official(args.official, config, s.fp_model, s.calib, s.images, args.iters,
                                    args.official_seed, on_calibrated)
    res = {"calibration": stage_entry(
        {"ours": ours_cal_p, "official": kept["preds"]}, labels,
        {"ours": ours_cal_s, "official": kept["seconds"]},
        {"ours": errors(ours_cal), "official": kept["errors"]})}
    res["option_differences"] = differences
    res["calibration"]["quantizers"] = kept["quantizers"]
    res["calibration"]["folded_norm_max_rel_diff"] = max(kept["folds"].values(), default=0.0)
    res["calibration"]["candidate_steps"] = candidate_steps(
        s.fp_model, s.calib, s.options.matmul_pct, s.options.matmul_steps, s.options.eq_n)
    if args.iters == 0:
        return res
    ours, ours_s, ours_p = run_ours(s.fp_model, dataclasses.replace(s.options, iters=args.iters), bits,
                                    s.data, s.val, bs)
    preds = {"ours": ours_p, "official": predict(off_model, s.val, bs)}
    seconds = {"ours": ours_s, "official": off_s}
    errs = {"ours": errors(ours), "official": errors(off_model)}
    if args.reference_seed is not None:
        ref, seconds["ours_reference_seed"], preds["ours_reference_seed"] = run_ours(
            s.fp_model, dataclasses.replace(s.options, iters=args.iters, seed=args.reference_seed), bits,
            s.data, s.val, bs)
        errs["ours_reference_seed"] = errors(ref)
    res["reconstruction"] = stage_entry(preds, labels, seconds, errs)
    res["reconstruction"]["quantizers"] = compare_quantizers(ours, off_model)["totals"]
    return res


def write_json(path: str, result: dict, overwrite: bool) -> None:
    """`result` at `path`, whole or not at all (write_whole: the temporary is no user's file, and an interrupt
    removes it); without `overwrite` only where no file is (RunDirError)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    outputs.write_json(path, result, overwrite, indent=1)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    try:
        main()
    except (UserError, *evaluate.USER_ERRORS) as e:
        sys.exit(f"error: {e}")
