"""The pipeline interface: `Pipeline` (parse bits and options, run), its result, and the helpers every
pipeline uses (stage timing, an isolated RNG, the report).

A pipeline is called as `PIPELINES[name](fp_model, calib_images, bits="w4a4", options=None, data=None)`
and returns `PTQResult(model, report)`: the quantized deep copy (the float model is untouched) and a small
JSON-able report (layout, stem/head bits, options, calibration size, seconds per stage). Its options are
a dataclass of configs/quant.py; pipelines that draw their own training images get them from `data`.

Under torchrun a pipeline runs once, on rank 0, and every rank receives its quantized model
(`engine.distributed.run_on_main`; the others wait with a timeout of their own, quant.main_rank_wait_hours).
A pipeline whose own steps use every rank sets `data_parallel` and hands rank 0 only its sequential
part (GPLQ: stage 1 trains data-parallel, stage 2 runs on rank 0).
"""
from __future__ import annotations

import dataclasses
import difflib
import time
import typing
from contextlib import contextmanager
from typing import Any, Collection, Dict, Iterator, Mapping, NamedTuple, Optional, Type, Union

import torch
from torch import nn

from configs.loader import check_options_read, coerce_value
from engine.distributed import run_on_main
from models import is_language_model

from .calibrate import Images, ModelFeed, calibrate, stack_images
from .convert import quantize_model, refuse_hooked_layers
from .modes import describe, summarize
from .pipeline_data import PipelineData
from .spec import FLOAT_BITS, Bits, QuantSpec, parse_bits


class PTQResult(NamedTuple):
    """What a pipeline returns: `model, report = PIPELINES["repq"](...)`."""

    model: nn.Module
    report: Dict[str, Any]


def parse_options(options_type: Type, options: Union[None, Mapping[str, Any], Any]) -> Any:
    """Build an options dataclass from a mapping; an unknown key is an error naming close matches, and a value of
    another type than the field's or outside its range (configs/quant.py) is one ValueError naming the option, the
    value and what the field expects (configs.loader.coerce_value, as for a config's values). An int counts for a
    float field, never a bool for an int one nor a string for a number. A key that the options leave unread
    (mlp_iters without mlp_reconstruct) is refused by the rules evaluate.py applies to its config
    (configs.loader.check_options_read)."""
    if options is None:
        return options_type()
    if isinstance(options, options_type):
        return options
    known = {f.name for f in dataclasses.fields(options_type)}
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(sorted(known))}"
            raise ValueError(f"unknown option {key!r} for {options_type.__qualname__}{hint}")
    # typed and range-checked by the rule the config loader applies for evaluate.py: a mapping handed over directly
    # would otherwise run act_order="false" as True (a non-empty string), alpha="0.5" into a traceback from
    # pow(), blocksize=0 into one from range(), and alpha=1.5 outside SmoothQuant's range with nothing said
    hints = typing.get_type_hints(options_type, include_extras=True)
    parsed = options_type(**{key: coerce_value(value, hints[key], key, options_type.__qualname__)
                             for key, value in options.items()})
    check_options_read(parsed, options)
    return parsed


class Pipeline:
    """Base class: parse bits and options, then `run` (which usually starts from `layout`)."""

    name: str = ""
    Options: Type = type(None)
    data_parallel: bool = False  # True: `run` is called on every rank and uses run_on_main itself
    tasks: tuple = ("classification",)  # the engine/tasks.py tasks whose models it quantizes
    default_bits: str = "w4a4"  # the bit-width evaluate.py runs when quant.bits is [] (the paper's setting)
    weight_only: bool = False  # True: activations stay float (only aN16 bit-widths); False: only quantized ones
    calibrated: bool = True  # False: the weights alone decide (RTN); its results record no calibration settings
    # True: on an image classifier it draws its own training-transform images from `data` and leaves the
    # calibration batch unread (APHQ, GPLQ): its results record the training transform, not the batch
    draws_training_images: bool = False
    # True: it trains the model in training mode (GPLQ's stage 1), so the model's dropout and stochastic depth
    # (model.drop, model.drop_path) act in it and its results record them
    trains_model: bool = False
    # True: it trains float32 state of its own on the model's weights (APHQ's AdaRound rounding variables and
    # activation scales, GPLQ's LSQ step sizes and weights under AdamW) and draws float32 images for it, so a model
    # whose weights are another dtype is refused (`check_model`); it may autocast, as the official code
    float32_weights: bool = False

    def __call__(self, fp_model: nn.Module, calib_images: Images, bits: Union[str, Bits] = "w4a4",
                 options: Optional[Mapping[str, Any]] = None,
                 data: Optional[PipelineData] = None) -> PTQResult:
        """Quantize a copy of `fp_model`.

        Args:
            fp_model: float timm ViT/DeiT/Swin or models.gpt.GPT, on the device to calibrate on (left
                untouched); its weights float32 for a `float32_weights` pipeline (APHQ, GPLQ: `check_model`).
            calib_images: the calibration inputs as a tensor or iterable of batches, passed to the model as
                they are: [N, 3, H, W] images (eval transform) or [N, T] token windows (a LongTensor);
                the entry point picks them.
            bits: "w4a4", "w6a6", "w8a8", "w4a16" (weights only), ... or Bits(w, a).
            options: pipeline-specific overrides of `Options` (unknown keys raise).
            data: training data for pipelines that draw their own images (APHQ, GPLQ); percentile and
                repq ignore it (see pipeline_data.py).

        Returns:
            PTQResult(model, report), the same on every rank of a distributed run.
        """
        detection = data is not None and data.detector_samples is not None
        bits, options = parse_bits(bits), parse_options(self.Options, options)
        # on every rank, before any work; a detector's data (PipelineData.detector_samples) has rules of its own
        self.validate(bits, options, detection=detection)
        self.check_task(fp_model, detection)
        calib_images = self.calibration_inputs(fp_model, calib_images, detection)
        self.check_model(fp_model)
        # a layer the layout replaces that has hooks: refused by path before any copy (convert.refuse_hooked_layers;
        # SmoothQuant, APHQ and GPLQ copy the model before they convert it, and a weight_norm layer cannot be copied)
        refuse_hooked_layers(fp_model, self.layout(bits, options))
        self.check_folds(fp_model, bits, options)
        self.check_input_size(fp_model, bits, options)
        self.check_model_options(fp_model, bits, options)
        if self.data_parallel:
            return self.run(fp_model, calib_images, bits, options, data)
        device = next(fp_model.parameters()).device
        return run_on_main(lambda: self.run(fp_model, calib_images, bits, options, data),
                           f"quantizing {self.name} {bits}", device)

    def check(self, bits: Bits, options: Any) -> None:
        """Raise ValueError (naming the option) for options that cannot go together at these bits: the
        entry points reach it through `validate`, for every pipeline and bit-width before any work. Overrides
        call this first: it refuses the bit-widths the pipeline cannot do (16 bits = float, see spec.Bits)."""
        if bits.float_weights:
            raise ValueError(f"{self.name} quantizes weights: {bits} keeps them float (16 bits); give w2..w15")
        if self.weight_only and not bits.float_activations:
            raise ValueError(f"{self.name} is weight-only: activations stay float, so the bit-width is "
                             f"w{bits.w}a16, not {bits}")
        if not self.weight_only and bits.float_activations:
            raise ValueError(f"{self.name} quantizes activations: {bits} keeps them float (16 bits); weight-only "
                             "quantization (wNa16) is rtn / gptq")

    def validate(self, bits: Bits, options: Any, detection: bool = False) -> None:
        """Everything a run will read, checked before any work (entry points call this for every pipeline and
        bit-width): `check`, the stem / head bit-widths, and the values its layout's quantizers and range
        rules take (building the layout raises ValueError for those they cannot use). `detection`: the run
        quantizes a detector (evaluate_detection.py, `PipelineData.detector_samples`), whose data a pipeline may
        draw otherwise than a classifier's (APHQ overrides this)."""
        self.check(bits, options)
        for key in ("stem_w_bits", "stem_a_bits", "head_w_bits", "head_a_bits"):
            value = getattr(options, key, None)
            # float is 0 here; 16, which means float in a bit-width (spec.Bits: w4a16), would build a real 16-bit grid
            # that the report's 16 then reads as float: refused, so that 16 has one meaning
            if value not in (None, 0) and not 2 <= value < FLOAT_BITS:
                raise ValueError(f"{key}={value}: give 2..{FLOAT_BITS - 1} bits, 0 (float, which a bit-width such as "
                                 "w4a16 spells 16) or null (the main bit-width)"
                                 + (self._recorded_float_hint(key, detection) if value == FLOAT_BITS else ""))
        self.layout(bits, options)

    def _recorded_float_hint(self, key: str, detection: bool) -> str:
        """The fix for a stem / head bit-width of 16, which was taken until it was refused: a run trained then records
        it in its config, the defaults of `evaluate.py --checkpoint` (and of a resumed train.py), so the user may meet
        it without having typed it, and needs the override of the full key (a detector's options come from
        evaluate_detection.py's --quant-options alone, which spells the key there)."""
        if detection:
            where = f"--quant-options {self.name}.{key}"
            return f"; give {where}=0 (float) or {where}={FLOAT_BITS - 1}"
        where = f"quant.{self.name}.{key}"
        return (f"; a run's recorded config (evaluate.py --checkpoint) may hold {FLOAT_BITS}, which that run's reports "
                f"read as float: override {where}=0 (float) or {where}={FLOAT_BITS - 1}")

    def check_task(self, fp_model: nn.Module, detection: bool) -> None:
        """Raise ValueError for a model of a task not in `tasks` (engine/tasks.py names; `detection`: the caller's
        data holds a detector's samples), before any work: the entry points refuse such a plan from the config
        (quant.plan.check_pipelines), and a caller of the Python API would otherwise see a copy made and data drawn
        before a traceback (APHQ's first unit on a GPT's token ids)."""
        task = "detection" if detection else "causal_lm" if is_language_model(fp_model) else "classification"
        if task not in self.tasks:
            from .registry import PIPELINES  # the registry imports the pipelines
            fitting = sorted(name for name, p in PIPELINES.items() if task in p.tasks)
            raise ValueError(f"{self.name} quantizes {' and '.join(self.tasks)} models, not a {task} model "
                             f"({type(fp_model).__name__}); the {task} pipelines are {', '.join(fitting)}")

    def calibration_inputs(self, fp_model: nn.Module, calib_images: Images, detection: bool) -> Images:
        """`calib_images` as `run` receives them, checked against the model before any work where this pipeline reads
        them (`check_calibration_inputs`): an iterable of batches is read here, once, and handed on as one tensor.
        As they are where it reads none (RTN; APHQ and GPLQ on an image classifier draw their own images, as
        quant.plan.reads_calibration_batch says) and for a detector (a `ModelFeed`, run by the detector itself)."""
        language = is_language_model(fp_model)
        if detection or isinstance(calib_images, ModelFeed) or not self.calibrated or (
                self.draws_training_images and not language):
            return calib_images
        x = stack_images(calib_images)
        check_calibration_inputs(fp_model, x)
        return x

    def check_model(self, fp_model: nn.Module) -> None:
        """Raise ValueError for a model this pipeline cannot quantize as it is, on every rank before any work: for a
        `float32_weights` pipeline, floating weights other than float32 (a bf16 model met its float32 images in a
        traceback from the first convolution; rounding variables, step sizes and optimizer state in bf16 would
        not train as the official code's, which keeps float32 weights and autocasts at most)."""
        if not self.float32_weights:
            return
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in fp_model.parameters()
                         if p.is_floating_point() and p.dtype != torch.float32})
        if dtypes:
            raise ValueError(f"the model's weights are {', '.join(dtypes)}: {self.name} trains float32 state on them "
                             "and feeds them float32 images; keep the weights float32 (model.float()) and autocast for "
                             "lower precision (evaluate.py --amp keeps the weights float32)")

    def check_folds(self, fp_model: nn.Module, bits: Bits, options: Any) -> None:
        """Raise ValueError for a model whose norms these steps fold into the Linears they feed where the fold would
        fail or change the float function (a norm that is no affine LayerNorm, a site outside the pre-norm blocks the
        sites are written for: reparam.check_fold_sites), on every rank before any work; the entry points also call
        it (quant.plan.check_model_converts). The default: nothing folded."""

    def check_input_size(self, fp_model: nn.Module, bits: Bits, options: Any) -> None:
        """Raise ValueError for a model whose input size these steps cannot take without changing its float function
        (RepQ-ViT's LayerNorm fold on a Swin whose windows are zero-padded: fold_windows.py), on every rank before
        any work; the entry points also call it (quant.plan.check_model_converts). The default: any size."""

    def check_model_options(self, fp_model: nn.Module, bits: Bits, options: Any) -> None:
        """Raise ValueError, naming the option as a config key, for an option that this model leaves without effect
        (GPLQ's pca_multiple or pca_variance on features no wider than pca_multiple), on every rank before any work;
        the entry points also call it (quant.plan.check_model_converts). The default: none."""

    def train_image_counts(self, options: Any) -> Dict[str, int]:
        """{option: images} this pipeline draws from the training split itself (`draws_training_images`), for
        the entry point to check against the split's size before any work."""
        return {}

    def train_batch_sizes(self, options: Any) -> Dict[str, int]:
        """{option: per-process batch} of the training loader this pipeline reads (`PipelineData.train_loader`),
        for the entry point to check against the split's size before any work; {} when it reads none."""
        return {}

    def train_loader_images(self, options: Any, given: Collection[str] = ()) -> Dict[str, int]:
        """{option: images} this pipeline reads from one epoch of each process's training loader (the one of
        `train_batch_sizes`), for the entry point to check against the full batches of a process's shard before any
        work; {} when it reads none, or reads at most what one epoch holds (a default that is capped there).
        `given`: the option names the user set (an evaluation's overrides and --config files), whose value counts
        as chosen even where it equals the default."""
        return {}

    def recorded_options(self, options: Any, ranks: Optional[int] = None) -> Any:
        """`options` as a result records them (engine/quant_settings.py, the report): an option whose null means a
        default the pipeline resolves (percentile's clipping levels, APHQ's hessian_eps, GPLQ's lr and scale_lr)
        holds the value used instead, so that a later change of that default cannot make an older result read as
        computed with the new one. `ranks`: the number of processes a data-parallel pipeline's default depends on
        (GPLQ's lr, by the global batch; None: this run's). The default: as given."""
        return options

    def scheme_settings(self, options: Any) -> Dict[str, Any]:
        """Settings of how this pipeline computes that no option names, where that changed while the options
        stayed: evaluate.py records them beside the options (engine/quant_settings.py), so that a result of the
        older scheme reads as computed with other settings. The default: none."""
        return {}

    def layout(self, bits: Bits, options: Any) -> QuantSpec:
        """The conversion spec this pipeline starts from (also used by tests and derived pipelines)."""
        raise NotImplementedError

    def run(self, fp_model: nn.Module, calib_images: Images, bits: Bits, options: Any,
            data: Optional[PipelineData] = None) -> PTQResult:
        raise NotImplementedError


def check_calibration_inputs(model: nn.Module, x: torch.Tensor) -> None:
    """Raise one ValueError naming `calib_images` where `model` cannot run on the calibration inputs `x`: a language
    model's are [N, T] int64 (or int32) token ids in 0..vocab_size-1, T within its context; an image classifier's
    [N, C, H, W] floating-point images of its input channels. Torch would otherwise refuse them from deep inside the
    forward of the copy (an IndexError of the embedding for an id past the vocabulary, a dtype error for float ids or
    images given to a GPT, timm's unpacking error for token ids given to a ViT). The ids are read by one min / max
    on their own device."""
    got = f"got {str(x.dtype).removeprefix('torch.')} {list(x.shape)}"
    if is_language_model(model):
        want = (f"calib_images: calibration inputs for a {type(model).__name__} are [N, T] int64 or int32 token ids "
                f"< vocab_size {model.vocab_size}, 1 <= T <= its context {model.context}")
        if x.dtype not in (torch.int64, torch.int32) or x.dim() != 2 or not 1 <= x.shape[1] <= model.context:
            raise ValueError(f"{want}; {got}")
        low, high = (int(v) for v in torch.aminmax(x))
        if low < 0 or high >= model.vocab_size:
            raise ValueError(f"{want}; got ids from {low} to {high}")
        return
    # the input layer: the first Conv2d in forward order, which for timm's ViT / DeiT / Swin is in patch_embed (its
    # proj; a hybrid ViT's HybridEmbed runs its CNN backbone first, whose stem conv takes the images), and for a model
    # without one the first Conv2d it holds (modules() lists them in the order they were built)
    embed = getattr(model, "patch_embed", None)
    first = next((m for m in (model if embed is None else embed).modules() if isinstance(m, nn.Conv2d)), None)
    channels, dtype = (first.in_channels, first.weight.dtype) if first is not None else (None, None)
    # the size the model fixes: timm's patch embedding asserts it (strict_img_size, which timm clears for
    # dynamic_img_size), a ViT's position table and a Swin's windows and masks are built for it; read as timm reads
    # it, (H, W) (models.input_size gives one side, for the square models the configs build)
    fixed = embed is not None and getattr(embed, "strict_img_size", False) and embed.img_size is not None
    size = tuple(int(side) for side in embed.img_size) if fixed else None
    shape = [channels if channels is not None else "C", *(size or ("H", "W"))]
    kind = f"{str(dtype).removeprefix('torch.')} (the dtype of its weights)" if dtype is not None else "floating-point"
    want = (f"calib_images: calibration inputs for a {type(model).__name__} are [N, {', '.join(map(str, shape))}] "
            f"{kind} images")
    if (not x.is_floating_point() or x.dim() != 4 or (channels is not None and x.shape[1] != channels)
            or (dtype is not None and x.dtype != dtype) or (size is not None and tuple(x.shape[2:]) != size)):
        raise ValueError(f"{want}; {got}")


def check_float_ends(name: str, options: Any) -> None:
    """The LM pipelines keep the stem and head float (configs.quant.FloatEndsOptions): refuse anything else,
    null included (FirstLastOptions' "the main bit-width", which these layouts would leave float)."""
    for key in ("stem_w_bits", "stem_a_bits", "head_w_bits", "head_a_bits"):
        value = getattr(options, key)
        if value != 0:
            shown = "null" if value is None else value
            raise ValueError(f"{key}={shown}: {name} keeps the stem / embeddings and the head float (0), as the "
                             "official GPTQ and SmoothQuant code (quant.first_last=w8a8 does not apply to it)")


class StageTimer:
    """Wall time per named stage (device-synchronised so GPU work is attributed to its stage)."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str, device: torch.device) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds[name] = round(time.perf_counter() - start, 4)


@contextmanager
def isolated_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch's global RNG (and the device's) for a pipeline, restoring the caller's streams on exit."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def pipeline_report(pipeline: str, model: torch.nn.Module, bits: Bits, options, **extra) -> dict:
    """The fields every pipeline report has (layout, bits, options, per-layer rows and their summary),
    with the pipeline's own entries in `extra`."""
    layers = describe(model)
    return {"pipeline": pipeline, "bits": str(bits), **options.resolved(bits),
            "options": dataclasses.asdict(options), **extra, "summary": summarize(layers), "layers": layers}



def convert_and_calibrate(fp_model: torch.nn.Module, spec: QuantSpec, calib_images: Images, timer: StageTimer,
                          device: torch.device) -> tuple:
    """Convert a copy of `fp_model` by `spec` and calibrate it in one sequential pass (RepQ-ViT's order).

    Returns:
        (quantized model, number of calibration images).
    """
    with timer("convert", device):
        model = quantize_model(fp_model, spec)
    with timer("calibrate", device):
        calib = calibrate(model, calib_images)
    return model, calib["images"]
