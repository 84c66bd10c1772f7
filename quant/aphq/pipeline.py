"""APHQ-ViT (Wu et al., CVPR 2025) with MLP reconstruction off: RepQ-style layout, output-MSE search,
block reconstruction.

The Colinearity-Decay paper's APHQ column: "we disable MLP reconstruction and keep block reconstruction, in
order to reduce quantization time" (CD paper Sec. 4.1). Procedure, after GoatWu/APHQ-ViT `test_quant.py`:

1. Data: `recon_images` (1024) train-split images with the TRAINING transform, one fixed augmentation
   each, chosen with seed 3407; the first `calib_images` (128) are the calibration set. A run that trains
   nothing (`iters=0` without MLP reconstruction) draws the calibration set alone: the same images.
2. Layout: weights asymmetric per output channel (AdaRound kind); post-LayerNorm inputs (qkv, fc1,
   Swin reduction) per channel, folded into the LayerNorm (RepQ-ViT) and then per tensor (only when
   a_bits == w_bits, as officially; otherwise per tensor without a fold; a timm Swin whose windows are padded
   at its input size is then refused, as for RepQ-ViT: quant/fold_windows.py); proj, fc2 and
   head inputs asymmetric per tensor; q, k, attn, v asymmetric uniform PER HEAD (also the softmax
   output, no log quantizer); the image input of the patch embedding float (`stem_a_bits=0`).
3. Calibration (aphq_calibration.py): fold and output-MSE searches, layer by layer on float inputs.
4. Reconstruction (reconstruct.py), unit by unit in module order (patch embedding, blocks, Swin patch
   merging, head): AdaRound + activation scales, QDrop at the unit input and inside the quantizers,
   APH-weighted MSE (hessian.py; computed on the float model, T = 20, +-1e-6 on every output element,
   averaged over samples), KL for the head, loss normalised to 2 at the first iteration. A fully float stem or head
   (`stem_w_bits=0`; `head_w_bits=0` with `head_a_bits=0`) has nothing to learn: skipped, with 0 iterations.
5. Optional MLP reconstruction before step 2 (`mlp_reconstruct=True`, mlp_recon.py).

A detector (`PipelineData.detector_samples`) follows the official detection code instead: detector.py.

Defaults are the official classification recipe (configs/4bit/best.py): 128 / 1024 images, batch 32,
20k iterations per unit. `iters`, `calib_images`, `recon_images` make CPU tests and sweeps cheap; `iters=0` is
calibration only (steps 1-3, then every unit switched on: no float captures and no APH; without MLP reconstruction
no reconstruction set either, so `recon_images` is refused there: configs/loader.py).
Under torchrun the whole pipeline runs once, on rank 0; the other ranks receive its model (pipeline_base).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from configs.cli import device_problem
from configs.loader import check_options_read
from configs.quant import APHQOptions
from engine.metrics import duration

from ..calibrate import Images
from ..convert import quantize_model
from ..fold_windows import check_fold_windows
from ..layout import standard_layout
from ..modes import quant_state, set_quant_state
from ..pipeline_base import Pipeline, PTQResult, StageTimer, isolated_rng, parse_options, pipeline_report
from ..pipeline_data import PipelineData, require_data
from ..reparam import REPQ_FOLD_SITES, check_fold_sites
from ..spec import Bits, QuantizerSpec, QuantSpec, parse_bits
from ..units import capture_unit, check_unit_coverage, find_units, model_logits
from .adaround import AdaRoundQuantizer, RoundingSchedule
from .calibration import SearchSettings, calibrate_aphq
from .detector import quantize_detector
from .hessian import perturbation_hessian
from .mlp_recon import MLPReconSettings, reconstruct_mlps
from .reconstruct import ReconSettings, reconstruct_unit, reconstructs_anything, skipped_stats

log = logging.getLogger("quant.aphq")


def draws_reconstruction_set(options: APHQOptions) -> bool:
    """Whether a classifier's run draws the `recon_images` reconstruction set: only the block reconstruction
    (iters above 0) and the MLP reconstruction read it; a calibration-only run draws its calibration set alone
    (configs/loader.py APHQ_RECON_SET_READ refuses recon_images there)."""
    return options.iters != 0 or options.mlp_reconstruct


def mlp_iterations(options: APHQOptions) -> int:
    """The MLP reconstruction's iterations per block: mlp_iters, or iters where it is None."""
    return options.mlp_iters if options.mlp_iters is not None else options.iters


def hessian_eps(options: APHQOptions) -> float:
    """The APH perturbation of a classifier: hessian_eps, or where it is None the probe's default (1e-6 for the
    official all-ones probe, 1e-4 for Rademacher's; a detector's is detector.DETECTION_EPS)."""
    if options.hessian_eps is not None:
        return options.hessian_eps
    return 1e-6 if options.hessian_probe == "ones" else 1e-4


class APHQPipeline(Pipeline):
    name = "aphq"
    Options = APHQOptions
    tasks = ("classification", "detection")  # detection: detector.py (data.detector_samples)
    draws_training_images = True
    float32_weights = True  # AdaRound's rounding variables and the activation scales train in float32

    def recorded_options(self, options: APHQOptions, ranks: Optional[int] = None) -> APHQOptions:
        """`options` with the perturbation a classifier's APH runs with in place of a null hessian_eps
        (`hessian_eps`), and with the MLP reconstruction on, its iterations in place of a null mlp_iters
        (`mlp_iterations`: iters); a detector's report records its own (detector.py). Result files compare these
        (engine/eval_results.py reads an older entry's null as the default of then)."""
        return dataclasses.replace(options, hessian_eps=hessian_eps(options),
                                   mlp_iters=mlp_iterations(options) if options.mlp_reconstruct else options.mlp_iters)

    def layout(self, bits: Bits, options: APHQOptions) -> QuantSpec:
        """APHQ's converted layout before the fold (post-LN inputs still per channel).

        As in the official code, the RepQ reparameterisation happens only when a_bits == w_bits; otherwise
        the post-LN inputs are per-tensor from the start and searched like every other Linear input.
        """
        act = QuantizerSpec(bits.a)
        post_norm = QuantizerSpec(bits.a, granularity="channel") if bits.a == bits.w else act
        return standard_layout(
            weight=QuantizerSpec(bits.w, kind=AdaRoundQuantizer, granularity="channel"),
            post_norm_input=post_norm, block_input=act,
            q=QuantizerSpec(bits.a, granularity="head"), k=QuantizerSpec(bits.a, granularity="head"),
            attn=QuantizerSpec(bits.a, granularity="head"), v=QuantizerSpec(bits.a, granularity="head"),
            first_last=options.resolved(bits))

    def unread_at(self, bits: Bits) -> Dict[str, str]:
        """{option: why ("is read only ...")} for the options that a run at `bits` does not read, whatever their
        value: the zero point of the LayerNorm fold where there is no fold (a_bits != w_bits, as officially; see
        `layout`). The entry points refuse such an option where the user gave it and no run reads it (evaluate.py
        over every planned bit-width, `__call__` for its one)."""
        if bits.a == bits.w:
            return {}
        return {"round_zero_point": "is read only by the LayerNorm fold, which APHQ does only when a_bits == w_bits"}

    def __call__(self, fp_model: nn.Module, calib_images: Images, bits: Union[str, Bits] = "w4a4",
                 options: Optional[Mapping[str, Any]] = None, data: Optional[PipelineData] = None) -> PTQResult:
        """As `Pipeline.__call__`; an option given in the mapping that these bits leave unread is refused first.
        An `APHQOptions` dataclass is not judged so: it is what an entry point passes to every planned bit-width
        (evaluate.py's --bits w4a4 w4a8 reads round_zero_point at w4a4 alone), and the entry point has refused an
        option that no planned bit-width reads (evaluate.options_unread_at_planned_bits). On a classifier (no
        `data.detector_samples`) the mapping's act_lr at drop_prob=0 is refused too: every activation quantizer
        passes its float input there, where a detector's neck units train their activation scales at act_lr whatever
        drop_prob says (detector.py; configs/loader.py CLASSIFIER_ONLY)."""
        if isinstance(options, Mapping):
            parsed = parse_bits(bits)
            for key, why in self.unread_at(parsed).items():
                if key in options:
                    raise ValueError(f"{key}={options[key]} would be ignored at {parsed}: {key} {why}; drop it")
            if data is None or data.detector_samples is None:
                check_options_read(parse_options(self.Options, options), options, classifier=True)
        return super().__call__(fp_model, calib_images, bits, options, data)

    def scheme_settings(self, options: APHQOptions) -> Dict[str, Any]:
        """An APH over a reconstruction set that is no multiple of batch_size (a shorter last batch) weighs every
        sample alike (hessian.py); before, the last batch's samples weighed batch_size / its size as much, under the
        same options. Recorded where a classifier computes an APH with such a last batch; elsewhere (whole batches,
        no APH, a detector's per-image APH) the two schemes are the same: nothing."""
        aph = (options.iters != 0 and options.loss == "aph") or options.mlp_reconstruct
        if aph and options.recon_images % options.batch_size:
            return {"aph_sample_weights": "uniform"}
        return {}

    def check_folds(self, fp_model: nn.Module, bits: Bits, options: APHQOptions) -> None:
        """The RepQ-ViT fold (at a_bits == w_bits, `layout`) takes an affine LayerNorm in the pre-norm blocks its
        sites are written for (reparam.check_fold_sites); at other bit-widths nothing is folded."""
        if bits.a == bits.w:
            check_fold_sites(fp_model, REPQ_FOLD_SITES, self.name,
                             other_fix="a bit-width whose activations differ from its weights (w4a8: no fold there)")

    def check_input_size(self, fp_model: nn.Module, bits: Bits, options: APHQOptions) -> None:
        """The RepQ-ViT fold (at a_bits == w_bits, `layout`) keeps a Swin's float function only where its norm1
        output fills whole windows (quant/fold_windows.py); APHQ has no option that turns the fold off."""
        if bits.a == bits.w:
            check_fold_windows(fp_model, self.name)

    def train_image_counts(self, options: APHQOptions) -> dict:
        if draws_reconstruction_set(options):
            return {"recon_images": options.recon_images}  # calib_images are its first ones
        return {"calib_images": options.calib_images}  # calibration only: the set `run` draws

    def validate(self, bits: Bits, options: APHQOptions, detection: bool = False) -> None:
        """As `Pipeline.validate`, and on a classifier the calibration set within the reconstruction set: there it
        is that set's first `calib_images` images (`run`). A detector's calibration batch is the caller's
        (evaluate_detection.py --calib-images, --calib-seed), drawn apart from its reconstruction images
        (`recon_images`, `data_seed`: detector.py), so no count bounds the other."""
        super().validate(bits, options, detection)
        # without a reconstruction set (calibration only) recon_images is unread and bounds nothing
        if not detection and draws_reconstruction_set(options) and options.calib_images > options.recon_images:
            raise ValueError(f"calib_images={options.calib_images} exceeds recon_images={options.recon_images} "
                             f"(the calibration set is a prefix of the reconstruction set)")

    def check(self, bits: Bits, options: APHQOptions) -> None:
        super().check(bits, options)
        if options.mlp_reconstruct and mlp_iterations(options) == 0:
            # reconstruct_mlps swaps every GELU for a ReLU before its first iteration: with none, the model scored is
            # that swapped float model, never tuned back towards the GELU one
            given = ("mlp_iters=0" if options.mlp_iters is not None
                     else "iters=0 and mlp_iters=null (which follows iters)")
            raise ValueError(f"mlp_reconstruct=True with {given}: the MLP reconstruction would swap GELU for ReLU "
                             f"and tune nothing; give mlp_iters above 0, or mlp_reconstruct=False")
        # a batch draws distinct reconstruction samples: it would shrink silently (no such batch at calibration only)
        if draws_reconstruction_set(options) and options.batch_size > options.recon_images:
            raise ValueError(f"batch_size={options.batch_size} exceeds recon_images={options.recon_images} (each "
                             f"batch draws distinct reconstruction images): give batch_size <= recon_images")
        ends = options.resolved(bits)
        for end, given in ends.items():
            # the output-MSE search sets a layer's input range together with its weight grid (search.py): a
            # float weight beside a quantized input would leave that input unsearched (an error after the FP run)
            if given["w"] is None and given["a"] is not None:
                raise ValueError(f"{end}_w_bits=0 with the {end} input at {given['a']} bits: APHQ searches a "
                                 f"layer's input together with its quantized weight; give {end}_w_bits >= 2 or "
                                 f"{end}_a_bits=0")
        widest = max(b for b in (bits.w, bits.a, *ends["stem"].values(), *ends["head"].values()) if b)
        # every grid tries min(16, 2^b) zero points x eq_n // that many ranges (search.py); one range per
        # zero point is a degenerate search (only the narrowest range: W4A4 fell to 36% beside a 91% W3A3)
        zero_points = min(16, 2 ** widest)
        if options.eq_n < 2 * zero_points:
            raise ValueError(f"eq_n={options.eq_n} leaves the {widest}-bit grids at {bits} fewer than 2 ranges "
                             f"for each of their {zero_points} zero points (a degenerate search): give eq_n >= "
                             f"{2 * zero_points} (default 128)")
        if options.cache_device is not None:
            problem = device_problem(options.cache_device)  # else a traceback after the FP evaluation
            if problem:
                raise ValueError(f"cache_device={options.cache_device!r}: {problem}, or null (the model's device)")
        if options.matmul_steps < 2:
            raise ValueError(f"matmul_steps={options.matmul_steps}: the matmul search needs >= 2 candidates per "
                             f"bound (default 129)")
        for name in ("weight_pct", "act_pct", "matmul_pct"):
            low, high = getattr(options, name)
            if not 0.5 < low <= high <= 1.0:
                raise ValueError(f"{name}={[low, high]}: percentile levels 0.5 < low <= high <= 1 (default "
                                 f"{list(getattr(type(options)(), name))})")

    def run(self, fp_model: nn.Module, calib_images: Images, bits: Bits, options: APHQOptions,
            data: Optional[PipelineData] = None) -> PTQResult:
        data = require_data(self.name, data)
        if data.detector_samples is not None:
            return quantize_detector(self.layout(bits, options), fp_model, calib_images, bits, options, data)
        del calib_images  # APHQ draws its own training-transform calibration set from `data`
        if data.train_images is None:
            raise ValueError("the 'aphq' pipeline draws its classification images from PipelineData.train_images")
        timer = StageTimer()
        device = next(fp_model.parameters()).device
        cache = torch.device(options.cache_device) if options.cache_device else device
        bs = options.batch_size
        # the calibration set is the reconstruction set's first images (data/loader.py calibration_images: the first k
        # of a larger set are the k-image set), so a calibration-only run draws those alone, without augmenting the rest
        if draws_reconstruction_set(options):
            count = options.recon_images
            option = f"recon_images={count} (its first calib_images={options.calib_images} the calibration set)"
        else:
            count, option = options.calib_images, f"calib_images={options.calib_images}"
        with timer("data", device):
            images = data.draw_train_images(count, options.data_seed, True, option)
        calib = images[:options.calib_images]
        with isolated_rng(options.seed, device):
            gen = torch.Generator(device=device).manual_seed(options.seed)  # not the cache's: same draws anywhere
            model, report = self._quantize(fp_model, images, calib, bits, options, timer, device, cache,
                                           bs, gen)
        report["seconds"] = timer.seconds
        return PTQResult(model, report)

    def _quantize(self, fp_model: nn.Module, images: torch.Tensor, calib: torch.Tensor, bits: Bits,
                  options: APHQOptions, timer: StageTimer, device: torch.device, cache: torch.device, bs: int,
                  gen: torch.Generator) -> Tuple[nn.Module, dict]:
        frozen = copy.deepcopy(fp_model).eval().requires_grad_(False)  # the float reference; never modified
        # the APH needs the float logits; only MR and the APH-weighted reconstruction read it (configs/loader.py
        # APH_COMPUTED refuses its settings otherwise)
        if options.mlp_reconstruct or (options.iters > 0 and options.loss == "aph"):
            with timer("fp_logits", device):
                fp_logits = model_logits(frozen, images, bs)
        eps = hessian_eps(options)
        hessians: Dict[str, torch.Tensor] = {}
        hessian_seconds = StageTimer()
        # Rademacher probes (model device)
        probe_gen = torch.Generator(device=device).manual_seed(options.seed + 2)

        def hessian(name: str) -> torch.Tensor:  # a unit's output, or a block MLP's (MR: mlp_recon.py)
            if name not in hessians:
                with hessian_seconds(name, device):
                    hessians[name] = perturbation_hessian(frozen, name, images, fp_logits, bs,
                                                          options.temperature, eps, options.hessian_probe,
                                                          generator=probe_gen)
            return hessians[name]

        source, mr_stats = frozen, None
        if options.mlp_reconstruct:
            with timer("mlp_reconstruction", device):
                source = copy.deepcopy(frozen)
                mr_stats = reconstruct_mlps(
                    frozen, source, images, options.calib_images, hessian,
                    MLPReconSettings(
                        iters=mlp_iterations(options),
                        batch_size=bs, lr=options.mlp_lr, clip_percentile=options.mlp_clip_percentile,
                        clip_weight=options.mlp_clip_weight, log_every=options.log_every),
                    torch.Generator(device=device).manual_seed(options.seed + 1))
                source.eval().requires_grad_(False)

        with timer("convert", device):
            model = quantize_model(source, self.layout(bits, options)).eval().requires_grad_(False)
            units = find_units(model)
            check_unit_coverage(model, units)
        with timer("calibrate", device):
            calib_report = calibrate_aphq(model, units, calib, SearchSettings(
                rounds=options.search_rounds, weight_pct=tuple(options.weight_pct),
                act_pct=tuple(options.act_pct), eq_n=options.eq_n, matmul_pct=tuple(options.matmul_pct),
                matmul_steps=options.matmul_steps, max_rows=options.search_max_rows,
                round_zero_point=options.round_zero_point, batch_size=bs),
                generator=torch.Generator().manual_seed(options.seed))
        # every quantizer is float now; units are switched on as they are reconstructed
        if options.iters == 0:  # calibration only: 0 iterations would change nothing, so no captures, no APH
            for unit in units:
                set_quant_state(model.get_submodule(unit.name), weights=True, activations=True)
            unit_stats = [{"unit": unit.name, "kind": unit.kind, "iters": 0} for unit in units]
        else:
            unit_stats = self._reconstruct(model, frozen, units, images, options, timer, device, cache, bs, gen,
                                           hessian, hessian_seconds)
        model.eval()
        report = pipeline_report(
            self.name, model, bits, self.recorded_options(options),
            data={"calibration_images": int(calib.shape[0]),
                  # 0 where nothing was drawn for a reconstruction (calibration only), as on a detector
                  "reconstruction_images": int(images.shape[0]) if draws_reconstruction_set(options) else 0,
                  "seed": options.data_seed, "transform": "train"},
            calibration=calib_report, units=unit_stats, mlp_reconstruction=mr_stats)
        return model, report

    @staticmethod
    def _reconstruct(model: nn.Module, frozen: nn.Module, units: list, images: torch.Tensor, options: APHQOptions,
                     timer: StageTimer, device: torch.device, cache: torch.device, bs: int, gen: torch.Generator,
                     hessian, hessian_seconds: StageTimer) -> list:
        """Reconstruct the units of `model` in order, each switched on as it starts; their stats."""
        settings = ReconSettings(
            iters=options.iters, batch_size=bs, weight_lr=options.weight_lr, act_lr=options.act_lr,
            drop_prob=options.drop_prob, input_mix_prob=options.input_mix_prob,
            rounding=RoundingSchedule(options.iters, options.warmup, options.beta_start, options.beta_end,
                                      options.round_weight),
            normalize_loss=options.normalize_loss, log_every=options.log_every)
        unit_stats = []
        log.info("APHQ reconstruction: %d units x %d iterations (quant.aphq.iters); a time estimate follows "
                 "after the first iterations", len(units), options.iters)
        with timer("reconstruct", device):
            for i, unit in enumerate(units):
                module = model.get_submodule(unit.name)
                with quant_state(module, weights=True, activations=True):
                    float_unit = not reconstructs_anything(module)
                if float_unit:  # a float stem or head: no captures, no APH, nothing trained
                    set_quant_state(module, weights=True, activations=True)  # switched on as every unit (no-op)
                    log.info("unit %d/%d %s (%s): float, nothing to reconstruct: skipped", i + 1, len(units),
                             unit.name, unit.kind)
                    unit_stats.append({"unit": unit.name, "kind": unit.kind, **skipped_stats(),
                                       "hessian_seconds": 0.0})
                    continue
                fp_in, fp_out = capture_unit(frozen, unit.name, images, bs, inputs=True, outputs=True,
                                             store_device=cache)
                q_in, _ = capture_unit(model, unit.name, images, bs, store_device=cache)
                weight = None if unit.kind == "head" or options.loss == "mse" else hessian(unit.name)
                set_quant_state(module, weights=True, activations=True)
                log.info("unit %d/%d %s (%s): %d iterations",
                         i + 1, len(units), unit.name, unit.kind, options.iters)
                stats = reconstruct_unit(module, fp_in, q_in, fp_out, weight, "kl" if unit.kind == "head" else
                                         "weighted_mse", settings, gen, name=unit.name)
                stats = {"unit": unit.name, "kind": unit.kind, **stats,
                         "hessian_seconds": hessian_seconds.seconds.get(unit.name, 0.0)}
                log.info("unit %d/%d %s done: rec %.4g -> %.4g, round %.4g [%.1fs + %.1fs Hessian]", i + 1,
                         len(units), unit.name, stats["rec_first"], stats["rec_last"], stats["round_last"],
                         stats["seconds"], stats["hessian_seconds"])
                unit_stats.append(stats)
                left = len(units) - i - 1
                if left:
                    # from the units reconstructed: a skipped float unit's 0 s says nothing of the others' time
                    ran = [u["seconds"] + u["hessian_seconds"] for u in unit_stats if u["iters"]]
                    log.info("APHQ reconstruction: about %s left for the other %d units", duration(
                        sum(ran) / len(ran) * left), left)
                del fp_in, fp_out, q_in
        return unit_stats
