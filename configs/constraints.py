"""What each config value must be for the code that reads it: value ranges attached to the schema as
`typing.Annotated` metadata, and the checks of keys that must agree with each other (`check_together`).

    lr: Annotated[Optional[float], Positive] = None      # None passes, 0 or -1 is an error
    std: Annotated[tuple, Numbers(3, Positive)] = ...    # one positive number per RGB channel

The strict loader (loader.py) checks the ranges wherever a value is set (YAML file, `key=value`, a saved
config) and `check_together` on every config it loads from files, so `optim.lr=-1`, `data.std=[0.5, 0]`
or a warmup as long as the schedule stops before anything runs, with the key named, instead of a
traceback from inside a DataLoader worker or a run that never leaves its warmup.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Range:
    """low <= value <= high (`<` where open); None bounds are unbounded. None values are not checked."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def violation(self, value) -> Optional[str]:
        """A description of what `value` should be, or None when it is in range."""
        if value is None:
            return None
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        return self.describe() if too_low or too_high else None

    def describe(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_number(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {_number(self.high)}")
        return " and ".join(parts)


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"  # seeds' int64 bounds in full, not as 9.22e+18


def finite(value: float) -> bool:
    """math.isfinite, False for an integer beyond the float range (10**400), where math.isfinite raises."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class Numbers:
    """A list of `length` finite numbers, each in `each`, in increasing order when `ordered` (a (min, max)
    range such as RandomResizedCrop's scale); `why` says what the range stands for, where a value outside it is a
    known mistake (data.mean on the 0..255 scale)."""

    length: int
    each: Optional[Range] = None
    ordered: bool = False
    why: str = ""

    def violation(self, value: Any) -> Optional[str]:
        numbers = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool) and finite(v)]
        ok = (len(value) == self.length == len(numbers)
              and (self.each is None or all(self.each.violation(v) is None for v in numbers))
              and (not self.ordered or numbers == sorted(numbers)))
        return None if ok else self.describe()

    def describe(self) -> str:
        text = f"{self.length} finite numbers" + (f", each {self.each.describe()}" if self.each else "")
        text += ", the smaller first (min, max)" if self.ordered else ""
        return text + (f" ({self.why})" if self.why else "")


# A locale without UTF-8 (LC_ALL=C with PYTHONUTF8=0, a Latin-1 one) gives Python a file-system encoding in which
# some paths cannot be spelt, and a command line whose non-ASCII bytes it cannot decode
LOCALE_FIX = "run under a UTF-8 locale (LC_ALL=C.UTF-8) or with PYTHONUTF8=1"


def nameable(path: str) -> bool:
    """Whether the operating system can be given `path`: a config file may hold any character, but under a
    locale without UTF-8 os.makedirs('/data/\\u00fc') ends in a UnicodeEncodeError."""
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class UserPath:
    """A file or folder path whose leading `~` is the user's home folder: the shell expands `~` in `--out ~/x`
    but not in `out_dir=~/x` (a word that is no shell assignment), which would otherwise write to a folder
    named `~` in the working folder."""

    def violation(self, value: Any) -> Optional[str]:
        if isinstance(value, str) and not nameable(value):
            return (f"a path the file system's encoding ({sys.getfilesystemencoding()}, from the locale) can "
                    f"spell; {LOCALE_FIX}")
        return None

    def normalize(self, value: Any) -> Any:
        return os.path.expanduser(value) if isinstance(value, str) else value

    def describe(self) -> str:
        return "a path (~ is the home folder)"


Positive = Range(0, low_open=True)
# data.mean / data.std normalize the input tensors, whose pixels timm's ToTensor puts on the 0..1 scale: values on
# the 0..255 scale (MMDetection's and Caffe's mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375]) would
# train on near-constant inputs. A mean outside [0, 1] or a std above 1 is no normalization of such pixels
UNIT_SCALE = "the model's input tensors are on the 0..1 scale: divide values on the 0..255 scale by 255"
PixelMean = Numbers(3, Range(0, 1), why=UNIT_SCALE)
PixelStd = Numbers(3, Range(0, 1, low_open=True), why=UNIT_SCALE)
NonNegative = Range(0)
AtLeastOne = Range(1)
Probability = Range(0, 1)  # also fractions in [0, 1]
BelowOne = Range(0, 1, high_open=True)  # rates such as drop_path, label smoothing, EMA decay
Seed = Range(-2 ** 63, 2 ** 63 - 1)  # torch.manual_seed / torch.Generator take a 64-bit integer
# hours a rank waits for rank 0 (a gloo group's timeout): gloo keeps it in int64 nanoseconds, which overflow
# past about 2.5e6 hours (an "Invalid timeout" at the first wait), so 1e6 hours (114 years) is the most
WaitHours = Range(0, 1e6, low_open=True)


def check_together(cfg: Any) -> list[str]:
    """Problems of keys that must agree with each other, each one line naming the keys and the fix."""
    problems = []
    sched = cfg.sched
    if sched.steps is not None and sched.warmup_steps >= sched.steps:
        problems.append(f"sched.warmup_steps={sched.warmup_steps} is not below sched.steps={sched.steps}: the run "
                        f"would never leave its warmup; lower sched.warmup_steps or raise sched.steps")
    if sched.steps is None and sched.warmup_epochs >= sched.epochs:
        problems.append(f"sched.warmup_epochs={sched.warmup_epochs:g} is not shorter than sched.epochs="
                        f"{sched.epochs}: the run would train at warmup learning rates throughout; lower "
                        f"sched.warmup_epochs or raise sched.epochs")
    if sched.steps is None and not sched.per_step and sched.warmup_epochs != int(sched.warmup_epochs):
        # timm sets a per-epoch lr at epoch starts t = 0, 1, ...: warmup for every t < warmup_epochs, on the line
        # from warmup_lr that reaches the peak at warmup_epochs (0.5 is one whole epoch at warmup_lr)
        problems.append(f"sched.warmup_epochs={sched.warmup_epochs:g} is a fraction of an epoch, but the lr is set "
                        f"once per epoch (sched.per_step=false): the warmup would be "
                        f"{math.ceil(sched.warmup_epochs)} whole epoch(s) that never reach the peak lr; set "
                        f"sched.per_step=true (the lr changes every update) or a whole number of warmup epochs")
    if (problem := loader_timeout_problem(cfg.data)) is not None:
        problems.append(problem)
    if (problem := kwargs_without_value_problem(cfg.model)) is not None:
        problems.append(problem)
    if (problem := tag_without_weights_problem(cfg.model)) is not None:
        problems.append(problem)
    if (problem := batch_split_problem(cfg.train)) is not None:
        problems.append(problem)
    channels = cfg.model.kwargs.get("in_chans", 3)
    if channels != 3:  # every data set here gives RGB images (data/folder.py converts to RGB)
        problems.append(f"model.kwargs.in_chans={channels}: the data pipeline gives 3-channel RGB images "
                        f"(with data.mean / data.std of 3 values); drop model.kwargs.in_chans")
    return problems


def kwargs_without_value_problem(model: Any) -> Optional[str]:
    """The refusal of a model.kwargs entry without a value (`model`: a ModelConfig), or None. timm's create_model
    drops None arguments, so the model would be built with its default (a variant's depth=null: timm's 12 blocks)
    or without the entry at all, while the config and results record it as set. YAML reads `{num_heads:4}` (no
    space after the colon) as {'num_heads:4': None}. models/factory.py checks again for configs that skip
    `check_together` (a ModelConfig made in code, a checkpoint's config)."""
    empty = [key for key, value in model.kwargs.items() if value is None]
    if not empty:
        return None
    key = empty[0]
    spacing = (f" (YAML reads '{key}' as one key without a value: write a space after the colon, "
               f"{{{key.replace(':', ': ', 1)}}})" if ":" in key else "")
    return f"model.kwargs.{key} is null{spacing}: give it a value, or leave the entry out for the model's own default"


def tag_without_weights_problem(model: Any) -> Optional[str]:
    """The refusal of a pretrained tag in model.name (timm's NAME.TAG, e.g. vit_tiny_patch16_224.augreg_in21k)
    without model.pretrained (`model`: a ModelConfig), or None. The tag names hub weights, which only
    model.pretrained=hub loads: without it the run starts from random init, recorded under the weights' name. A
    local file of those weights (model.pretrained=FILE, configs/finetune/vit_b_in21k.yaml's fine-tuning) keeps its
    tag. Checked where a config is loaded, not where the model is built: a resumed run and an evaluated checkpoint
    build the model without model.pretrained, to load their own weights into it."""
    base, dot, tag = model.name.partition(".")
    if not dot or model.pretrained:
        return None
    return (f"model.name={model.name}: the tag '{tag}' selects hub weights, but model.pretrained is empty (the model "
            f"would start from random init): set model.pretrained=hub (or a local file of those weights), or drop "
            f"the tag (model.name={base})")


def loader_timeout_problem(data: Any) -> Optional[str]:
    """The refusal of a positive data.timeout with data.num_workers=0 (`data`: a DataConfig), or None. The
    timeout limits the wait for worker processes; with none, the main process reads the data itself, nothing
    limits that, and torch's DataLoader fails at its first batch (an AssertionError from inside it) rather
    than at construction. data/loader.py checks again for configs that skip `check_together` (a checkpoint's
    config layered by evaluate.py)."""
    if data.timeout and data.num_workers == 0:
        return (f"data.timeout={data.timeout:g} with data.num_workers=0: the timeout limits the wait for a batch "
                f"from loader worker processes, and with none the main process reads the data itself, which no "
                f"timeout limits; set data.num_workers to 1 or more, or data.timeout=0")
    return None


def batch_split_problem(train: Any) -> Optional[str]:
    """The refusal of a global batch that no number of processes can split into per-process batches (`train`: a
    TrainConfig), or None. train.py splits train.batch_size into processes x train.batch_size_per_gpu x accumulation
    steps, so it must be a multiple of train.batch_size_per_gpu whatever the world size; train.py checks the
    multiple of the world size itself once the processes are known."""
    per_gpu = train.batch_size_per_gpu
    if train.batch_size % per_gpu == 0:
        return None
    # the largest per-process batch below it that divides the global one, looked for among the next 10000 only (a
    # typo such as 100000000 is told at once, not after a count down from it)
    start = min(per_gpu, train.batch_size)
    fits = next((d for d in range(start, max(start - 10_000, 0), -1) if train.batch_size % d == 0), None)
    return (f"train.batch_size={train.batch_size} is not a multiple of train.batch_size_per_gpu={per_gpu}: every "
            f"process runs whole batches of train.batch_size_per_gpu; set train.batch_size to a multiple of {per_gpu} "
            f"(e.g. {max(per_gpu, train.batch_size // per_gpu * per_gpu)})"
            + (f", or train.batch_size_per_gpu={fits}" if fits else ""))

