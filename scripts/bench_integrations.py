"""Step time of each CD integration with and without CD, on the same model, in one run.

    python scripts/bench_integrations.py                          # all frameworks, CPU (the dev extras)
    python scripts/bench_integrations.py --frameworks plain hf --steps 30 --threads 2
    python scripts/bench_integrations.py --norms-every 1 10 100   # CD's update norms on every n-th update

For each framework (a plain loop with `ColinearityDecay.attach` as the reference; transformers' Trainer with
`cd.integrations.hf`; Lightning; MMEngine's Runner with `ColinearityDecayHook`) it trains the same seeded timm
ViT (random data, AdamW) for 1 + `--warmup` + `--steps` optimizer steps, without CD and with CD, `--repeats` times
each in turn, and takes each step's time as the gap between two of the framework's own end-of-step events. So
the first step is never timed, in every runner alike: in the frameworks it holds their start and, with CD, CD's
one-time pair check (built at train start; the plain loop builds it before its loop). The `--warmup` steps after
it are untimed too. It prints the median over the `--steps` timed steps of the best repeat of each, their ratio,
and CD's cost per step (with - without): an integration whose hook placement cost anything beyond `attach` would
show a larger cost than the plain loop's. CD computes its update norms (a metric) on every `--norms-every`-th
update, by default the integrations' (`cd.integrations.NORMS_EVERY`), in the plain loop too; with several values
the runs with CD take each in turn, one row each, all against the same runs without CD. A framework whose
packages are not installed is refused before any run, with the `pip install ".[extra]"` that brings them.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from cd import ColinearityDecay  # noqa: E402
from cd.integrations import NORMS_EVERY  # noqa: E402
from configs.cli import OneLineParser, at_least, first_line, refuse_repeats  # noqa: E402

LAM = 0.005


def build_model(args) -> torch.nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, embed_dim=args.width,
                             depth=args.depth, num_heads=max(1, args.width // 64), num_classes=10)


def data(args, n_steps: int):
    g = torch.Generator().manual_seed(1)
    n = n_steps * args.batch
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def step_times(stamps: list[float], warmup: int) -> float:
    """Median seconds per step from end-of-step time stamps, one per step: the gaps between consecutive stamps,
    without the first `warmup`. The first step ends at the first stamp and has no gap, so what ran before it (the
    framework's start, CD's pair check) is in none; `len(stamps) - 1 - warmup` steps are timed."""
    gaps = [b - a for a, b in zip(stamps, stamps[1:])][warmup:]
    return statistics.median(gaps)


def cd_kwargs(args) -> dict:
    """CD's arguments in a run with CD; `norms_every` the integrations' default unless given, in the plain loop too
    (ColinearityDecay's own default is 1), so that every framework computes the same."""
    return {"lam": LAM, "norms_every": NORMS_EVERY if args.norms_every is None else args.norms_every}


def run_plain(args, with_cd: bool) -> float:
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.045)
    if with_cd:
        ColinearityDecay(model, **cd_kwargs(args)).attach(opt)
    x, y = data(args, args.total)
    stamps: list[float] = []  # at the end of each step only, as in the frameworks (step_times)
    for i in range(args.total):
        xb, yb = x[i * args.batch:(i + 1) * args.batch], y[i * args.batch:(i + 1) * args.batch]
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        stamps.append(time.perf_counter())
    return step_times(stamps, args.warmup)


def run_hf(args, with_cd: bool) -> float:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from cd.integrations.hf import ColinearityDecayCallback

    class Wrapped(torch.nn.Module):  # the timm model, with the loss in its forward as the Trainer expects
        def __init__(self, net):
            super().__init__()
            self.net = net
            self.example_input = lambda: torch.zeros(1, 3, 32, 32)

        def forward(self, pixel_values, labels=None):
            logits = self.net(pixel_values)
            return logits if labels is None else {"loss": F.cross_entropy(logits, labels)}

    stamps: list[float] = []

    class Stamp(TrainerCallback):  # no stamp at train begin: CD's pair check runs there (step_times)
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    x, y = data(args, args.total)
    ds = [{"pixel_values": a, "labels": b} for a, b in zip(x, y)]
    callbacks = [Stamp()] + ([ColinearityDecayCallback(**cd_kwargs(args))] if with_cd else [])
    with tempfile.TemporaryDirectory() as out:  # the Trainer's output_dir: nothing of it is kept
        targs = TrainingArguments(output_dir=out, max_steps=args.total, per_device_train_batch_size=args.batch,
                                  learning_rate=5e-4, weight_decay=0.045, report_to=[], use_cpu=True,
                                  save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                  dataloader_num_workers=0)
        trainer = Trainer(model=Wrapped(build_model(args)), args=targs, train_dataset=ds, callbacks=callbacks)
        trainer.remove_callback(PrinterCallback)  # no summary line
        trainer.train()
    return step_times(stamps, args.warmup)


def run_lightning(args, with_cd: bool) -> float:
    import lightning as L

    from cd.integrations.lightning import ColinearityDecayCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_model(args)
            self.example_input_array = torch.zeros(1, 3, 32, 32)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=5e-4, weight_decay=0.045)

    stamps: list[float] = []

    class Stamp(L.Callback):  # no stamp at train start: CD's pair check runs there (step_times)
        def on_train_batch_end(self, *a):
            stamps.append(time.perf_counter())

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data(args, args.total)), batch_size=args.batch)
    callbacks = [Stamp()] + ([ColinearityDecayCallback(**cd_kwargs(args))] if with_cd else [])
    L.Trainer(max_steps=args.total, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks).fit(Module(), loader)
    return step_times(stamps, args.warmup)


def run_mmengine(args, with_cd: bool) -> float:
    import mmengine.device.utils
    from mmengine.hooks import Hook
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    import cd.integrations.mmengine  # noqa: F401  (registers ColinearityDecayHook; binds the name `cd` here)

    class Model(BaseModel):
        def __init__(self):
            super().__init__()
            self.backbone = build_model(args)

        def init_weights(self):
            pass

        def forward(self, inputs, labels=None, mode="tensor"):
            logits = self.backbone(inputs)
            return {"loss": F.cross_entropy(logits, labels)} if mode == "loss" else logits

    stamps: list[float] = []

    class Stamp(Hook):  # no stamp before train: CD's pair check runs there (step_times)
        def after_train_iter(self, runner, *a, **k):
            stamps.append(time.perf_counter())

    x, y = data(args, args.total)
    # on the CPU, as every runner here: the Runner moves the model to the device mmengine found at its import
    # (get_device: cuda on a GPU machine), which no argument of the Runner's changes
    with tempfile.TemporaryDirectory() as work_dir, mock.patch.object(mmengine.device.utils, "DEVICE", "cpu"):
        runner = Runner(model=Model(), work_dir=work_dir, log_level="ERROR",
                        train_dataloader=dict(dataset=[{"inputs": a, "labels": b} for a, b in zip(x, y)],
                                              batch_size=args.batch,
                                              sampler=dict(type="DefaultSampler", shuffle=False),
                                              collate_fn=dict(type="default_collate")),
                        train_cfg=dict(by_epoch=False, max_iters=args.total),
                        optim_wrapper=dict(optimizer=dict(type="AdamW", lr=5e-4, weight_decay=0.045)),
                        default_hooks=dict(checkpoint=None, logger=None),
                        custom_hooks=[Stamp()] + ([dict(type="ColinearityDecayHook", **cd_kwargs(args))]
                                                  if with_cd else []))
        try:
            runner.train()
        finally:
            _close_log_files(runner)
    return step_times(stamps, args.warmup)


def _close_log_files(runner) -> None:
    """Close the file handlers of the Runner's logger, which write into its work_dir and would hold files open
    in a folder about to be removed (Windows refuses to remove an open file)."""
    for handler in list(runner.logger.handlers):
        if isinstance(handler, logging.FileHandler):
            handler.close()
            runner.logger.removeHandler(handler)


RUNS = {"plain": run_plain, "hf": run_hf, "lightning": run_lightning, "mmengine": run_mmengine}
# the packages each framework's run imports, and the extra of pyproject.toml that installs them
NEEDS = {"hf": (["transformers", "accelerate"], "hf"), "lightning": (["lightning"], "lightning"),
         "mmengine": (["mmengine"], "mmengine")}


def check_installed(parser: argparse.ArgumentParser, frameworks: list[str], given: bool) -> None:
    """Refuse, before any run, a framework whose packages are not installed: found missing at its turn, it ended
    the command in a ModuleNotFoundError traceback after the frameworks before it had been timed."""
    for name in frameworks:
        packages, extra = NEEDS.get(name, ([], ""))
        absent = [p for p in packages if importlib.util.find_spec(p) is None]
        if absent:
            chosen = f"--frameworks {' '.join(frameworks)}" if given else "the default --frameworks (all)"
            parser.error(f"{chosen}: {name} needs {', '.join(absent)}, not installed; pip install \".[{extra}]\", "
                         f"or leave {name} out of --frameworks")


def main(argv=None) -> None:
    parser = OneLineParser(description=first_line(__doc__))
    parser.add_argument("--frameworks", nargs="+", choices=list(RUNS), help="default: all")
    parser.add_argument("--steps", type=at_least(1), default=15,
                        help="timed optimizer steps per run (default: %(default)s)")
    parser.add_argument("--warmup", type=at_least(0), default=3,
                        help="untimed steps before the timed ones, after the first step, which is never timed (it "
                             "holds the framework's start and CD's one-time pair check; default: %(default)s)")
    parser.add_argument("--repeats", type=at_least(1), default=3,
                        help="runs without and with CD, alternating (default: %(default)s)")
    parser.add_argument("--width", type=at_least(1), default=192,
                        help="embed dim; heads = width // 64 (at least 1), which must divide it (default: %(default)s)")
    parser.add_argument("--depth", type=at_least(1), default=4, help="ViT blocks (default: %(default)s)")
    parser.add_argument("--batch", type=at_least(1), default=8, help="images per step (default: %(default)s)")
    parser.add_argument("--norms-every", type=at_least(1), nargs="+", default=None, metavar="N",
                        help="CD's norms_every in the runs with CD, one row per value (default: the integrations' "
                             f"default, {NORMS_EVERY})")
    parser.add_argument("--threads", type=at_least(1), default=1,
                        help="torch threads (1: on a busy 2-core VM two OpenMP threads made step times swing 10x)")
    args = parser.parse_args(argv)
    # one row per value: a repeat timed it again and printed a second row for it
    refuse_repeats(parser, ("--frameworks", args.frameworks), ("--norms-every", args.norms_every))
    given = args.frameworks is not None
    args.frameworks = args.frameworks or list(RUNS)
    check_installed(parser, args.frameworks, given)
    heads = max(1, args.width // 64)  # build_model's
    if args.width % heads:  # timm's AssertionError traceback otherwise
        parser.error(f"--width {args.width}: its {heads} heads (width // 64) do not divide it; give a multiple of "
                     f"64, or less than 128")
    args.total = 1 + args.warmup + args.steps  # the first step only ends at the first time stamp (step_times)
    torch.set_num_threads(args.threads)
    quiet = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the frameworks' start-up messages
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _table(args)
    finally:
        logging.disable(quiet)


def _table(args) -> None:
    pairs = len(ColinearityDecay(build_model(args), lam=LAM).pairs)
    norms_every = args.norms_every or [None]
    print(f"timm ViT width {args.width}, depth {args.depth} ({pairs} pairs), 64 tokens, batch {args.batch}, "
          f"AdamW, CPU, {args.threads} threads; median of {args.steps} steps, best of {args.repeats} runs")
    print("| framework | without CD (ms/step) | with CD (ms/step) | ratio | CD cost (ms/step) |")
    print("|---|---|---|---|---|")
    for name in args.frameworks:
        off, on = [], {n: [] for n in norms_every}
        for _ in range(args.repeats):  # in turn, so that a busy spell of the machine falls on all of them
            off.append(RUNS[name](args, with_cd=False))
            for n in norms_every:
                on[n].append(RUNS[name](argparse.Namespace(**{**vars(args), "norms_every": n}), with_cd=True))
        a = min(off)
        for n in norms_every:
            b = min(on[n])
            label = name if n is None else f"{name}, norms_every {n}"
            print(f"| {label} | {1e3 * a:.1f} | {1e3 * b:.1f} | {b / a:.3f} | {1e3 * (b - a):.1f} |", flush=True)


if __name__ == "__main__":
    main()
