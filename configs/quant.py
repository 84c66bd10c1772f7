"""Options of the quantization pipelines (quant/): the `quant.<pipeline>.*` config sections.

They live here, not in quant/, so that `import configs` needs no torch: `scripts/sweep.py` expands
YAML without loading a model library. Each pipeline reads its section (quant/ptq/, quant/aphq/,
quant/gplq/, quant/gptq/, quant/smoothquant/); quant/README.md explains every default and which ones are
our choices.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Dict, Literal, Optional, Tuple

from .constraints import AtLeastOne, NonNegative, Positive, Probability, Range, Seed


@dataclass
class FirstLastOptions:
    """Bit-widths of the patch embedding ("stem") and the classifier ("head").

    2..15 bits, None follows the main w/a bits, 0 keeps that operand in float (16, float in a bit-width such as
    w4a16, is refused here: one spelling of float per setting). Defaults are the official
    RepQ-ViT code: stem weights at w_bits, stem (image) input at 8 bits, head at w_bits / a_bits.
    `quant.first_last=w8a8` sets both to W8A8 for every pipeline (the QwT / RepQ-ViT lab's convention).
    """

    stem_w_bits: Optional[int] = None  # patch-embedding weights; None: the main w bits, 0: float
    stem_a_bits: Optional[int] = 8  # patch-embedding input (the image); None: the main a bits, 0: float
    head_w_bits: Optional[int] = None  # classifier weights; None: the main w bits, 0: float
    head_a_bits: Optional[int] = None  # classifier input; None: the main a bits, 0: float

    def resolved(self, bits) -> Dict[str, Dict[str, Optional[int]]]:
        """{"stem": {"w": .., "a": ..}, "head": {...}} with None meaning float; `bits` has `.w` and `.a`
        (quant.spec.Bits)."""
        def pick(value: Optional[int], default: int) -> Optional[int]:
            return default if value is None else (value or None)
        return {"stem": {"w": pick(self.stem_w_bits, bits.w), "a": pick(self.stem_a_bits, bits.a)},
                "head": {"w": pick(self.head_w_bits, bits.w), "a": pick(self.head_a_bits, bits.a)}}


FIRST_LAST_PRESETS = {
    "official": {},  # each pipeline's own FirstLastOptions (the official code of its method)
    # stem and head at W8A8 for every pipeline, as the QwT / RepQ-ViT lab's re-runs keep them
    "w8a8": dict(stem_w_bits=8, stem_a_bits=8, head_w_bits=8, head_a_bits=8),
}


def with_first_last(options: FirstLastOptions, preset: str) -> FirstLastOptions:
    """`options` with the stem / head bit-widths of `preset` (`quant.first_last`) applied."""
    return dataclasses.replace(options, **FIRST_LAST_PRESETS[preset])


@dataclass
class PercentileOptions(FirstLastOptions):
    """Percentile PTQ options: how activation and weight ranges are chosen (see quant/README.md)."""

    act_range: Literal["percentile_mse", "percentile", "minmax"] = "percentile_mse"  # activation range rule
    act_percentiles: Optional[Tuple[float, ...]] = None  # None: RepQ set for percentile_mse,
    #   (0.9999,) for percentile
    weight_range: Literal["percentile_mse", "percentile", "minmax"] = "percentile_mse"  # weight range rule
    weight_percentiles: Optional[Tuple[float, ...]] = None  # None: as for act_percentiles
    weight_symmetric: bool = False  # True: signed symmetric per-channel weights (GPLQ stage 2 style)
    softmax: Literal["uniform", "log_sqrt2"] = "uniform"  # softmax-output quantizer


@dataclass
class RepQOptions(FirstLastOptions):
    """RepQ-ViT options (defaults: the official code; see quant/README.md)."""

    round_zero_point: bool = False  # official code: unrounded mean zero point (see module docstring)
    reparam: bool = True  # False: keep the per-channel post-LayerNorm quantizers (ablation)


@dataclass
class APHQOptions(FirstLastOptions):
    """APHQ options (defaults: official 4-bit classification recipe; see quant/README.md)."""

    stem_a_bits: Optional[int] = 0  # patch-embed image input float (official qconv_a_bit=8 means bypass)
    # -- data (GoatWu/APHQ-ViT test_quant.py) --
    calib_images: Annotated[int, AtLeastOne] = 128  # scale-search set: the first N images of the recon set
    recon_images: Annotated[int, AtLeastOne] = 1024  # reconstruction set: train split, training transform, fixed aug.
    # seed choosing (and augmenting) the images, as np.random.seed(3407) officially
    data_seed: Annotated[int, Seed] = 3407
    batch_size: Annotated[int, AtLeastOne] = 32  # reconstruction batch; also the batch of captures and Hessian passes
    # -- calibration search (quant/aphq/calibration.py, search.py) --
    search_rounds: Annotated[int, NonNegative] = 3  # alternations of input and weight output-MSE searches
    weight_pct: Tuple[float, float] = (0.9, 1.0)  # weight candidate ranges span these percentiles
    act_pct: Tuple[float, float] = (0.9, 1.0)  # input candidate ranges (official, also per-channel post-LN)
    # candidates per grid: min(16, 2^b) absolute zero points x eq_n // that many scales (official eq_n)
    eq_n: Annotated[int, Positive] = 128
    matmul_pct: Tuple[float, float] = (0.99, 0.99999)  # per-head matmul operand percentile levels
    matmul_steps: Annotated[int, AtLeastOne] = 129  # candidates per bound, linear in value (official eq_n + 1)
    search_max_rows: Annotated[Optional[int], AtLeastOne] = None  # input rows for the output MSE; None: all (official)
    round_zero_point: bool = True  # LayerNorm fold: mean zero point rounded (APHQ) or not (RepQ-ViT)
    # -- reconstruction (quant/aphq/reconstruct.py) --
    iters: Annotated[int, NonNegative] = 20000  # iterations per unit
    weight_lr: Annotated[float, Positive] = 1e-3  # Adam lr of the AdaRound variables
    act_lr: Annotated[float, NonNegative] = 4e-5  # Adam lr of the activation scales (cosine to 0)
    round_weight: Annotated[float, NonNegative] = 0.01  # rounding regulariser weight (summed over the unit)
    beta_start: Annotated[float, Positive] = 20.0  # rounding regulariser exponent at the end of the warm-up
    beta_end: Annotated[float, Positive] = 2.0  # ... at the last iteration (linear decay)
    # fraction of iterations without the rounding regulariser; 1: none with it (round_weight, beta_* refused)
    warmup: Annotated[float, Probability] = 0.2
    # QDrop, as the official `drop_prob` means it (GoatWu/APHQ-ViT, QDrop: where(rand < drop_prob, quantized,
    # float)): the probability of an element's quantized value, the float one otherwise; 1: QDrop off
    drop_prob: Annotated[float, Probability] = 0.5  # inside activation quantizers
    input_mix_prob: Annotated[float, Probability] = 0.5  # at the unit input: P(quantized-prefix input element)
    # divide the reconstruction loss (a mean) by its first value and multiply by 2 (APHQ since 73e78a7); false: the
    # official loss before that commit, ((O^ - O)^2 * H).sum(1).mean() / 10 (quant/aphq/reconstruct.block_loss)
    normalize_loss: bool = True
    loss: Literal["aph", "mse"] = "aph"  # APH-weighted MSE (APHQ) or plain MSE (QDrop baseline ablation)
    hessian_probe: Literal["ones", "rademacher"] = "ones"  # official all-ones probe, or Hutchinson diagonal
    # None: 1e-6 (ones, official), 1e-4 (rademacher); on a detector the official detection +-1e-3 (aphq/detector.py)
    hessian_eps: Annotated[Optional[float], Positive] = None
    temperature: Annotated[float, Positive] = 20.0  # KL temperature of the APH
    # -- MLP reconstruction (quant/aphq/mlp_recon.py), off as in the CD paper --
    mlp_reconstruct: bool = False  # GELU -> ReLU and per-block tuning of fc1 / fc2 first
    # iterations per block; None: same as iters. 0 in effect is refused: the GELU -> ReLU model would go untuned
    mlp_iters: Annotated[Optional[int], NonNegative] = None
    mlp_lr: Annotated[float, NonNegative] = 4e-5  # Adam lr of MR (cosine to 0)
    mlp_clip_percentile: Annotated[float, Probability] = 0.98  # fc2-input clip (4-bit config; paper text: 0.99)
    mlp_clip_weight: Annotated[float, NonNegative] = 2.0  # weight of the clipped-branch term
    # -- run --
    log_every: Annotated[int, NonNegative] = 1000  # log loss and time every N iterations and at each unit end (0: not)
    # QDrop masks, batch draws, Rademacher probes, search_max_rows' row subsets (iters=0 without MR or
    # search_max_rows draws nothing: a seed given there is refused)
    seed: Annotated[int, Seed] = 0
    cache_device: Optional[str] = None  # where cached unit inputs/targets live; None: the model's device


# APHQ's detection recipe (GoatWu/APHQ-ViT Object-Detection/tools/quant_configs/4bit.py, quant_layers/*.py):
# the options that differ from the classification defaults above. evaluate_detection.py starts from these,
# with calib_images set from its --calib-images (officially 1); `aphq.<key>=value` overrides them.
APHQ_DETECTION = dict(
    recon_images=256,  # optim_size
    batch_size=1,  # optim_batch_size: one image per iteration
    weight_pct=(0.999, 1.0),  # calculate_percentile_weight_candidates(l=0.999) of the detection layers
    act_pct=(0.999, 1.0),  # ... activation candidates
    search_rounds=0,  # the output-MSE rounds are commented out in the detection Linear search
    data_seed=0,  # the official code takes the first images of its loader; ours are drawn with this seed
)


@dataclass
class GPLQOptions(FirstLastOptions):
    """GPLQ options (defaults: the paper's recipe where stated, else our documented choice)."""

    # -- stage 1: activation QAT (quant/gplq/qat.py) --
    # optimizer updates; None: one epoch of the training loader; 0: none (the LSQ initialisation alone: the options
    # below that only updates read, lr to ckpt_every and the PCA's, are then refused)
    steps: Annotated[Optional[int], NonNegative] = None
    batch_size_per_gpu: Annotated[int, AtLeastOne] = 16  # paper: 8 GPUs x 16 = global 128
    lr: Annotated[Optional[float], NonNegative] = None  # None: 5e-6 (global >= 128), 2.5e-6 (>= 64), else 1e-6
    scale_lr: Annotated[Optional[float], NonNegative] = None  # LSQ scales; None: lr (not stated in the paper)
    weight_decay: Annotated[float, NonNegative] = 0.0  # AdamW decay of the weights (not stated; negligible at lr 5e-6)
    pca_weight: Annotated[float, NonNegative] = 1.0  # weight of L_PCA next to CE (camera-ready: 1:1)
    pca_variance: Annotated[float, Range(0, 1, low_open=True)] = 0.6  # explained-variance target of the kept components
    pca_multiple: Annotated[int, AtLeastOne] = 32  # component count rounded up to a multiple of this
    # training images per rank for the teacher PCA, from one epoch of the training loader. The default is capped at
    # one epoch (fewer where the split is small); a count given (another value, or this one named by the caller) is
    # used as it is, so one above the full batches of a rank's epoch is refused
    pca_images: Annotated[int, AtLeastOne] = 10000
    init_images: Annotated[int, AtLeastOne] = 128  # training images of the LSQ initialisation pass
    act_granularity: Literal["channel", "tensor"] = "channel"  # Linear-input scales (per-tensor: ablation)
    matmul_operands: bool = True  # quantize q, k, v and softmax output per head (LSQ); False: float matmuls
    matmul_percentile: Annotated[float, Range(0.5, 1, low_open=True)] = 0.99  # initial range [q(1 - p), q(p)]
    amp: Literal["none", "fp16", "bf16"] = "none"  # autocast of stage 1 (fp16 adds a GradScaler)
    log_every: Annotated[int, AtLeastOne] = 50  # log stage-1 loss every N updates
    ckpt_every: Annotated[int, NonNegative] = 500  # stage-1 checkpoint every N updates (0: at the end)
    seed: Annotated[int, Seed] = 0  # data order / augmentation, init and stage-2 images, per-update reseeding
    # -- stage 2: weight PTQ + QwT (quant/gplq/qwt.py) --
    weight_symmetric: bool = True  # per-channel weights symmetric (paper) or asymmetric (RepQ-ViT)
    weight_range: Literal["percentile_mse", "percentile", "minmax"] = "percentile_mse"  # MSE-based (79.5) ...
    stage2_images: Annotated[int, AtLeastOne] = 512  # images for QwT's least-squares fits
    # training augmentation, as QwT draws them from its train loader (refused on synthetic images: no transform)
    stage2_train_transform: bool = True
    qwt: bool = True  # per-block linear compensation
    qwt_ridge: Annotated[float, NonNegative] = 0.0  # L2 penalty of the fit (0: plain least squares as QwT's script)
    # reference block: the stage-1 block fully float (QwT disables every quantizer of the block), the
    #   stage-1 block without weight quantization (w32a4), or the original float model's block (teacher)
    qwt_target: Literal["float", "w32a4", "teacher"] = "float"


# GPLQ's COCO setting (GPLQ paper, arXiv 2506.11784: one epoch at batch 1 per GPU, no PCA loss): the options that
# differ from the classification defaults above. evaluate_detection.py starts from these, with init_images set
# from its --calib-images (the LSQ initialisation pass is that batch); `gplq.<key>=value` overrides them.
GPLQ_DETECTION = dict(
    batch_size_per_gpu=1,
    pca_weight=0.0,
    stage2_train_transform=False,  # QwT images get the detector's test pipeline
)


def detection_recipe(pipeline: str, calib_images: int) -> dict:
    """The options `pipeline` starts from on a detector besides its defaults: APHQ's and GPLQ's detection recipes,
    with their calibration / initialisation images the `calib_images` batch (evaluate_detection.py --calib-images);
    {} for a pipeline that has none."""
    if pipeline == "aphq":
        return {**APHQ_DETECTION, "calib_images": calib_images}
    if pipeline == "gplq":
        return {**GPLQ_DETECTION, "init_images": calib_images}
    return {}


@dataclass
class FloatEndsOptions(FirstLastOptions):
    """Stem (patch embedding) and head in float: the only setting of rtn / gptq / smoothquant(_strict).

    The official GPTQ and SmoothQuant code quantize the Linears of the decoder layers and leave the
    embeddings and the LM head float; these pipelines do the same on every task (quant/README.md). The
    fields exist so that `quant.first_last` applies to every pipeline; any other value is refused.
    """

    stem_w_bits: Optional[int] = 0  # float (the only value these pipelines accept)
    stem_a_bits: Optional[int] = 0  # float
    head_w_bits: Optional[int] = 0  # float (GPT-2's head is tied to the token embedding)
    head_a_bits: Optional[int] = 0  # float


@dataclass
class RTNOptions(FloatEndsOptions):
    """Round-to-nearest weight-only quantization on GPTQ's grid (IST-DASLab/gptq `--nearest`)."""

    symmetric: bool = False  # GPTQ's --sym: range [-max|w|, max|w|] with the fixed zero point 2^(b-1)
    # None: one range per output channel (gptq's --groupsize -1); the official rtn (--nearest) has no other: it
    # ignores --groupsize
    group_size: Annotated[Optional[int], AtLeastOne] = None


@dataclass
class GPTQOptions(RTNOptions):
    """GPTQ (Frantar et al. 2023) as IST-DASLab/gptq `opt.py` / `llama.py` run it (defaults: theirs)."""

    percdamp: Annotated[float, Positive] = 0.01  # dampening: this fraction of the mean Hessian diagonal
    blocksize: Annotated[int, AtLeastOne] = 128  # columns per lazy batch update
    act_order: bool = False  # --act-order: quantize columns in order of decreasing Hessian diagonal
    static_groups: bool = False  # --static-groups: group ranges fixed from the weights before any update
    true_sequential: bool = False  # llama.py --true-sequential: one Hessian pass per Linear, in block order
    batch_size: Annotated[int, AtLeastOne] = 8  # calibration sequences per forward (official: 1; float sums)


@dataclass
class SmoothQuantOptions(FloatEndsOptions):
    """SmoothQuant (Xiao et al. 2023) as mit-han-lab/smoothquant `smooth.py` + `fake_quant.py` run it; the
    defaults are the paper's (and this repo's) non-strict W8A8: per-token dynamic activations."""

    alpha: Annotated[float, Probability] = 0.5  # migration strength s_j = max|X_j|^alpha / max|W_j|^(1-alpha)
    weight_granularity: Literal["channel", "tensor"] = "channel"  # symmetric max-abs weight ranges
    act_granularity: Literal["token", "tensor"] = "token"  # symmetric max-abs activation ranges
    # dynamic: ranges from each input at run time (fake_quant.py); static: per-tensor ranges fixed from the
    #   smoothed float model on the calibration set (get_static_decoder_layer_scales, the real-INT8 path)
    act_calibration: Literal["dynamic", "static"] = "dynamic"
    # attention matmuls: none (float), qkv (q, k, v quantized like the Linear inputs: fake_quant.py's
    #   quantize_bmm_input), all (also the softmax output, by the same activation quantizer: per token and
    #   dynamic, the default, each query token gets its own range from each input, its max over heads and keys;
    #   per tensor, static or dynamic, one range, whose max-abs a causal plain softmax makes 1 (the first token
    #   attends to itself alone), i.e. at 8 bits Int8OPTAttention's fixed grid 1/127)
    quantize_bmm: Literal["none", "qkv", "all"] = "none"
    batch_size: Annotated[int, AtLeastOne] = 8  # calibration sequences per forward of the statistics passes


@dataclass
class SmoothQuantStrictOptions(SmoothQuantOptions):
    """The paper's SmoothQuant-W8A8-strict: per-tensor static activations and quantized attention matmuls."""

    act_granularity: Literal["token", "tensor"] = "tensor"  # one activation range per tensor (dynamic: per sample)
    act_calibration: Literal["dynamic", "static"] = "static"  # fixed from the smoothed float model (calibration)
    quantize_bmm: Literal["none", "qkv", "all"] = "all"  # q, k, v and the softmax output quantized too
