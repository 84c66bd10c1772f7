"""Training-step overhead of CD and TWEO against the baseline (paper Sec. 4.3, Fig. 2).

Two protocols.

`--protocol step` (default): two sweeps, all in one process: (a) per-GPU batch size on ViT-B/16 (32, 64, 128,
256) and (b) hidden size at batch 256 (ViT with embed dim 384 / 768 / 1024, depth 12, head dim 64). Each
step is an AMP forward + backward + AdamW step on synthetic data, the AdamW built as train.py builds it
(engine.optim: fused on CUDA, `fused` in every row):
    baseline    plain step
    cd          + ColinearityDecay(lam=0.005) attached as an optimizer step pre-hook (targets A+B), its update
                norms on every --norms-every-th update only, as in training (default train.py's,
                `train.log_every_steps`: at 50 and the default step counts only a warm-up step computes
                them, so the medians are the update without them; --norms-every 1 times every update with them)
    tweo        + TWEO(lam=0.01) auxiliary loss on every block output, our memory-saving form
    tweo_plain  the same loss as plain autograd ops (`tweo.form=plain`), the form we take the paper to have
                timed (its TWEO memory grows with the batch; it does not say how TWEO was written)
Reported per configuration: `ColinearityDecay.apply` alone and its floor, the same products as bare
batched matmuls on pre-stacked copies at the same precision (`product_floor`), with their ratio; the
median step time over the timed steps (warm-up excluded; on CPU the
four methods' steps are interleaved so that load from other processes hits all alike) and peak memory
(`torch.cuda.max_memory_allocated` over the timed steps, GPU only; on CPU the peak is reported as n/a,
since the process RSS cannot be attributed to one configuration), plus the CD/baseline and
TWEO/baseline ratios. Writes `overhead.json` and `overhead.png` to --out.

`--protocol epochs`: the paper's own protocol (Sec. 4.3: global batch 1024, five epochs, mean over three
runs): real train.py runs, see scripts/overhead_epochs.py.

Run:
    python scripts/bench_overhead.py --out results/overhead                 # GPU, the paper's settings
    python scripts/bench_overhead.py --device cpu --small --out /tmp/ovh    # CPU smoke run, about a minute
    python scripts/bench_overhead.py --device cpu --apply-only --threads 2 --out /tmp/ovh  # apply vs floor
    python scripts/bench_overhead.py --protocol epochs --launcher "torchrun --nproc_per_node=4" \
        --out results/overhead_epochs data.root=/datasets/imagenet     # the paper's (256 x 4 GPUs = 1024)
    (on a shared or busy CPU add --threads 1: OpenMP contention otherwise makes single steps 10x slower)
AMP: fp16 + GradScaler on CUDA, bf16 autocast on CPU (override with --amp).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from typing import Callable, Optional, Sequence

import timm
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root, for `cd`
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for bench_quant
from bench_env import environment  # noqa: E402
from bench_quant import timed, undivided_heads, vit_heads  # noqa: E402
from cd import TWEO, ColinearityDecay  # noqa: E402
from cd.update import _products_in  # noqa: E402
from engine.figures import new_figure  # noqa: E402
from engine.outputs import refuse_others_files, save_figure, source_mark, write_json  # noqa: E402
from engine.run_dir import RunDirError, refuse_existing_outputs  # noqa: E402
from configs.cli import OneLineParser, at_least, first_line, refuse_repeats  # noqa: E402
from configs.schema import OptimConfig, TrainConfig  # noqa: E402
from engine.optim import build_optimizer, use_fused  # noqa: E402

METHODS = ("baseline", "cd", "tweo", "tweo_plain")
# this script's flags that only --protocol step reads (--protocol epochs takes overhead_epochs.py's options, which
# share --batches, --width-batch, --out and --overwrite): refused there by name, not as "unrecognized arguments"
STEP_FLAGS = ("--device", "--small", "--widths", "--amp", "--warmup", "--steps", "--threads", "--precision",
              "--norms-every", "--apply-only")
_UNSET = object()
# CD's norms_every in train.py is its log interval (cfg.train.log_every_steps): timed at the schema's default, so that
# the CD arms run the update that training runs (the norms are a metric, off on the other updates)
NORMS_EVERY = TrainConfig().log_every_steps
# By these --overwrite knows its own outputs (engine.outputs.refuse_others_files): the PNG's text entry Source, and
# keys of each JSON that every version of it has written and another's JSON of that name is unlikely to hold
SOURCE = "scripts/bench_overhead.py"
OVERHEAD_KEYS = ("model", "warmup", "steps", "memory", "rows")
APPLY_KEYS = ("model", "warmup", "steps", "apply_only")


def cd_norms_every(args) -> int:
    """--norms-every; train.py's default for a caller whose options have none (gpu_check.py's overhead stage)."""
    return getattr(args, "norms_every", NORMS_EVERY)


def timed_ms(fn, device: str) -> float:
    """Wall time of fn() in ms: bench_quant.timed, which synchronizes `device` before and after on CUDA.

    The synchronize before the clock starts keeps kernels queued by the previous call (a warm-up, or the other
    side of an interleaved pair) out of this sample.
    """
    return timed(fn, torch.device(device))[1] * 1e3


def build_vit(embed_dim: int, depth: int, img_size: int, patch_size: int, num_classes: int, device: str):
    """A timm ViT with head dim 64 (ViT-S/B/L widths 384/768/1024 -> 6/12/16 heads)."""
    model = timm.create_model("vit_base_patch16_224", img_size=img_size, patch_size=patch_size,
                              embed_dim=embed_dim, depth=depth, num_heads=vit_heads(embed_dim),
                              num_classes=num_classes)
    return model.to(device)


def train_optimizer(model: torch.nn.Module, device: str) -> tuple[torch.optim.Optimizer, bool]:
    """AdamW (lr 1e-3, weight decay 0.05) built as train.py builds it (engine.optim: timm's parameter groups, the
    fused kernel on CUDA), and whether it is fused. A plain torch AdamW runs the foreach kernels on CUDA, where fp16's
    GradScaler then waits for the overflow verdict on the host every step: a path train.py does not run on GPUs."""
    cfg = OptimConfig()
    dev = torch.device(device)
    return build_optimizer(model, cfg, lr=1e-3, weight_decay=0.05, device=dev), use_fused(cfg, dev)


class Runner:
    """One method on one configuration: model, train.py's AdamW, AMP scaler, synthetic batch and the regularizer."""

    def __init__(self, method: str, model_kw: dict, batch: int, args, device: str) -> None:
        torch.manual_seed(0)
        self.method, self.device, self.model_kw, self.batch = method, device, model_kw, batch
        self.model = build_vit(device=device, **model_kw).train()
        self.opt, self.fused = train_optimizer(self.model, device)
        self.amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "none": None}[args.amp]
        self.scaler = torch.amp.GradScaler(device, enabled=(args.amp == "fp16"))
        self.decay = self.tweo = None
        if method == "cd":
            self.decay = ColinearityDecay(self.model, lam=0.005, matmul_precision=args.precision,
                                          norms_every=cd_norms_every(args))
            self.decay.attach(self.opt)
        elif method in ("tweo", "tweo_plain"):
            form = "plain" if method == "tweo_plain" else "memory_saving"
            self.tweo = TWEO(self.model, lam=0.01, form=form)
        self.x = torch.randn(batch, 3, model_kw["img_size"], model_kw["img_size"], device=device)
        self.y = torch.randint(0, model_kw["num_classes"], (batch,), device=device)
        self.n = 0

    def step(self) -> None:
        with torch.autocast(device_type=self.device, dtype=self.amp_dtype,
                            enabled=self.amp_dtype is not None):
            loss = F.cross_entropy(self.model(self.x), self.y)
            if self.tweo is not None:
                loss = loss + self.tweo.aux_loss(loss, self.n)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)  # the CD pre-hook runs in here
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        self.n += 1

    def timed(self, fn) -> float:
        return timed_ms(fn, self.device)

    def close(self) -> None:
        if self.tweo is not None:
            self.tweo.remove()
        self.model = self.opt = self.decay = self.tweo = self.x = self.y = None
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()


def product_floor(decay: ColinearityDecay):
    """The bare products of one CD update, as a callable: per group of same-shaped pairs, the two batched
    matmuls W2 W1 and (W2 W1) W1^T of functional pairs and the column scaling of composable pairs, on
    stacked copies made once here, at the decay's matmul precision. What `apply` costs beyond this is
    its own overhead (reading the parameters, the steps, writing back, and on the updates that compute
    them, every --norms-every-th, the update norms)."""
    groups = []
    for group in decay._plan.groups:
        pairs = [decay.pairs[i] for i in group]
        w2 = torch.stack([p.w2().detach().float() for p in pairs])
        w1 = torch.stack([p.w1().detach().float() for p in pairs])
        if decay.matmul_precision == "bf16":
            w2, w1 = w2.bfloat16(), w1.bfloat16()
        groups.append((pairs[0].diagonal, w2, w1.unsqueeze(1) if pairs[0].diagonal else w1))

    def run() -> None:
        with _products_in(decay.matmul_precision):
            for diagonal, w2, w1 in groups:
                if diagonal:
                    w2 * w1
                else:
                    torch.bmm(torch.bmm(w2, w1), w1.transpose(1, 2))
    return run


def measure_apply(model_kw: dict, args, device: str) -> dict:
    """`ColinearityDecay.apply` alone against its bare-product floor, interleaved, medians in ms."""
    torch.manual_seed(0)
    model = build_vit(device=device, **model_kw)
    decay = ColinearityDecay(model, lam=0.005, matmul_precision=args.precision, norms_every=cd_norms_every(args))
    floor = product_floor(decay)
    for _ in range(args.warmup):
        decay.apply(lr=1e-3)
        floor()
    apply_ms, floor_ms = [], []
    for _ in range(args.steps):
        apply_ms.append(timed_ms(lambda: decay.apply(lr=1e-3), device))
        floor_ms.append(timed_ms(floor, device))
    return {"cd_apply_ms": statistics.median(apply_ms), "cd_floor_ms": statistics.median(floor_ms),
            "precision": decay.matmul_precision}


def measure_config(model_kw: dict, batch: int, args, device: str,
                   on_row: Optional[Callable[[dict], None]] = None,
                   methods: Sequence[str] = METHODS) -> list[dict]:
    """`methods` on one configuration, one row each (CD's with its `apply` against the floor).

    CUDA: one method after the other, each alone on the device, so that its peak memory is its own.
    CPU: the models live together and their timed steps are interleaved (baseline, cd, tweo,
    baseline, ...), so that load from other processes on a shared CPU hits every method alike.
    on_row: called with each row as soon as it is complete (on CUDA after each method, on a CPU after the
    interleaved steps), so that a caller stopped midway (gpu_check.py's time budget) keeps the rows so far.
    """
    rows = []

    def finish(method: str, times: list[float], peak: Optional[float], fused: bool) -> None:
        row = {"method": method, "batch": batch, "embed_dim": model_kw["embed_dim"], "fused": fused,
               "step_ms": statistics.median(times), "step_ms_all": times, "peak_mib": peak}
        if method == "cd":
            row.update(measure_apply(model_kw, args, device))
        rows.append(row)
        if on_row is not None:
            on_row(row)

    if device == "cuda":
        for method in methods:
            r = Runner(method, model_kw, batch, args, device)
            for _ in range(args.warmup):
                r.step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = [r.timed(r.step) for _ in range(args.steps)]
            peak = torch.cuda.max_memory_allocated() / 2 ** 20
            fused = r.fused
            r.close()
            finish(method, times, peak, fused)
    else:
        runners = [Runner(m, model_kw, batch, args, device) for m in methods]
        for r in runners:
            for _ in range(args.warmup):
                r.step()
        interleaved: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(args.steps):
            for r in runners:
                interleaved[r.method].append(r.timed(r.step))
        fused = {r.method: r.fused for r in runners}
        for r in runners:
            r.close()
        for method in methods:  # no peak memory on a CPU (the module docstring)
            finish(method, interleaved[method], None, fused[method])
    return rows


def run_sweep(name: str, configs: list[tuple[dict, int]], args, device: str) -> list[dict]:
    rows = []
    for model_kw, batch in configs:
        new = []
        # on CUDA one method at a time (as measure_config runs them there): one that runs out of memory (TWEO's plain
        # form at a large batch) is marked so, and the others' rows stay measured; a CPU interleaves all four
        for methods in [(m,) for m in METHODS] if device == "cuda" else [METHODS]:
            try:
                new += measure_config(model_kw, batch, args, device, methods=methods)
                continue
            except torch.cuda.OutOfMemoryError:
                new += [{"method": m, "batch": batch, "embed_dim": model_kw["embed_dim"],
                         "fused": use_fused(OptimConfig(), torch.device(device)), "step_ms": None,
                         "peak_mib": None, "oom": True} for m in methods]
            gc.collect()  # out of the except block: the traceback no longer holds the failed runner's tensors
            torch.cuda.empty_cache()
        for r in new:
            r["sweep"] = name
            print(f"  {name}: dim {r['embed_dim']:5d} batch {batch:4d} {r['method']:8s} "
                  f"{'fused' if r['fused'] else 'foreach'} AdamW {_fmt(r['step_ms'], '.1f')} ms  "
                  f"peak {_fmt(r['peak_mib'], '.0f')} MiB", flush=True)
        rows += new
    return rows


def _fmt(v: Optional[float], spec: str) -> str:
    width = int(spec.split(".")[0] or 0)
    return "n/a".rjust(width) if v is None else format(v, spec)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def table(rows: list[dict]) -> str:
    """One line per (sweep, configuration): step time and peak memory of each method, their ratios to the
    baseline, and CD's `apply` against its floor."""
    others = METHODS[1:]
    lines = [f"{'sweep':6s} {'dim':>5s} {'batch':>5s} | " + " ".join(f"{m + ' ms':>13s}" for m in METHODS)
             + " | " + " ".join(f"{m + '/base':>15s}" for m in others) + " | "
             + " ".join(f"{m + ' MiB':>14s}" for m in METHODS) + " | "
             + " ".join(f"{m + '/base':>15s}" for m in others)
             + f" | {'apply ms':>8s} {'floor ms':>8s} {'apply/floor':>11s}"]
    keys = sorted({(r["sweep"], r["embed_dim"], r["batch"]) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    for sweep, dim, batch in keys:
        by = {r["method"]: r for r in rows if (r["sweep"], r["embed_dim"], r["batch"]) == (sweep, dim, batch)}
        t = {m: by[m]["step_ms"] for m in METHODS}
        mem = {m: by[m]["peak_mib"] for m in METHODS}
        cd = by["cd"]
        lines.append(f"{sweep:6s} {dim:5d} {batch:5d} | "
                     + " ".join(_fmt(t[m], "13.1f") for m in METHODS) + " | "
                     + " ".join(_fmt(_ratio(t[m], t["baseline"]), "15.3f") for m in others) + " | "
                     + " ".join(_fmt(mem[m], "14.0f") for m in METHODS) + " | "
                     + " ".join(_fmt(_ratio(mem[m], mem["baseline"]), "15.3f") for m in others) + " | "
                     + f"{_fmt(cd.get('cd_apply_ms'), '8.2f')} {_fmt(cd.get('cd_floor_ms'), '8.2f')} "
                     f"{_fmt(_ratio(cd.get('cd_apply_ms'), cd.get('cd_floor_ms')), '11.2f')}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, has_memory: bool, title: str, overwrite: bool) -> None:
    panels = [("batch", "batch", "per-device batch size"), ("width", "embed_dim", "hidden size")]
    metrics = [("step_ms", "step time (ms)")] + ([("peak_mib", "peak memory (MiB)")] if has_memory else [])
    fig = new_figure(10, 3.6 * len(metrics))
    axes = fig.subplots(len(metrics), 2, squeeze=False)
    for col, (sweep, xkey, xlabel) in enumerate(panels):
        for row, (ykey, ylabel) in enumerate(metrics):
            ax = axes[row][col]
            for method in METHODS:
                pts = sorted((r[xkey], r[ykey]) for r in rows
                             if r["sweep"] == sweep and r["method"] == method and r.get(ykey) is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, overwrite, dpi=120, metadata=source_mark(SOURCE))  # refuse_others_files knows it


def apply_only(base: dict, widths: list[int], args, device: str, env: dict) -> dict:
    """`apply` and its floor per width (the model's depth and token count do not matter to CD)."""
    rows = []
    for width in widths:
        row = {"embed_dim": width, **measure_apply(dict(base, embed_dim=width), args, device)}
        row["apply_over_floor"] = row["cd_apply_ms"] / row["cd_floor_ms"]
        rows.append(row)
        print(f"  dim {width:5d}  {row['precision']}  apply {row['cd_apply_ms']:8.2f} ms  floor "
              f"{row['cd_floor_ms']:8.2f} ms  apply/floor {row['apply_over_floor']:.2f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    report = {**env, "threads": torch.get_num_threads(), "warmup": args.warmup, "steps": args.steps,
              "norms_every": args.norms_every, "model": base, "apply_only": rows}
    path = os.path.join(args.out, "apply.json")
    try:  # never over an apply.json another command wrote since this one started
        if args.overwrite:  # nor over another's that another command put there meanwhile
            refuse_others_files([path], SOURCE, json_keys=APPLY_KEYS)
        write_json(path, report, args.overwrite, indent=1)
    except RunDirError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {path}")
    return report


def step_flags() -> OneLineParser:
    """The flags only --protocol step reads (STEP_FLAGS), as a parent parser: main's parser and the one that reads
    an epochs command line (epochs_protocol) take them from it."""
    parser = OneLineParser(add_help=False)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"], help="default: cuda if torch sees a CUDA device, else cpu")
    parser.add_argument("--small", action="store_true", help="small models and batches (CPU smoke run)")
    parser.add_argument("--widths", type=at_least(1), nargs="+", help="sweep (b) embed dims (default 384 768 1024)")
    parser.add_argument("--amp", choices=["fp16", "bf16", "none"], help="default: fp16 on CUDA, bf16 on CPU")
    parser.add_argument("--warmup", type=at_least(0), default=None, help="untimed steps per configuration")
    parser.add_argument("--steps", type=at_least(1), default=None,
                        help="timed steps per configuration (median reported)")
    parser.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "tf32", "bf16"],
                        help="cd.matmul_precision (auto: tf32 on CUDA, fp32 on CPU)")
    parser.add_argument("--norms-every", type=at_least(1), default=NORMS_EVERY, metavar="N",
                        help="CD's norms_every in both CD arms: the update norms (a metric) on every N-th update "
                             f"(default {NORMS_EVERY}, train.py's: train.log_every_steps; 1: on every update)")
    parser.add_argument("--apply-only", action="store_true",
                        help="only `apply` against its product floor per width (no training steps: "
                             "ViT-B-sized CD on a CPU in a minute)")
    return parser


def protocol_flag() -> OneLineParser:
    parser = OneLineParser(add_help=False)
    parser.add_argument("--protocol", choices=["step", "epochs"], default="step",
                        help="step: timed steps in one process (default); epochs: the paper's protocol, "
                             "train.py runs, with scripts/overhead_epochs.py's options")
    return parser


def epochs_protocol(argv: Optional[list[str]], step: OneLineParser, protocol: OneLineParser) -> dict:
    """--protocol epochs: overhead_epochs.py, whose parser reads the command line with its own forms (--batches with
    no value skips its sweep, which --protocol step's parser refused) and --protocol; a step flag is named as
    --protocol step's, not as 'unrecognized arguments'."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import overhead_epochs
    # the step flags start unset (argparse gives a default only to what the namespace lacks): given ones show
    reader = overhead_epochs.build_parser(add_help=False, parents=[protocol, step])  # -h: overhead_epochs.py's help
    given_flags, _ = reader.parse_known_args(argv, argparse.Namespace(**{
        flag[2:].replace("-", "_"): _UNSET for flag in STEP_FLAGS}))
    given = [flag for flag in STEP_FLAGS if getattr(given_flags, flag[2:].replace("-", "_")) is not _UNSET]
    if given:
        reader.error(f"{' '.join(given)}: {'a flag' if len(given) == 1 else 'flags'} of --protocol step (timed "
                     f"steps in one process); --protocol epochs times train.py runs with "
                     f"scripts/overhead_epochs.py's options: drop {' '.join(given)}, or use --protocol step")
    return overhead_epochs.main(argv, parents=[protocol])


def main(argv: Optional[list[str]] = None) -> dict:
    step, protocol = step_flags(), protocol_flag()
    # which protocol first, each command line then read by its own parser: --protocol epochs takes
    # overhead_epochs.py's options. The step flags beside --protocol: an abbreviation (--pr) means what it means to
    # both parsers (ambiguous with --precision), not --protocol alone.
    chosen, _ = OneLineParser(add_help=False, parents=[protocol, step]).parse_known_args(argv)
    if chosen.protocol == "epochs":
        return epochs_protocol(argv, step, protocol)
    parser = OneLineParser(description=first_line(__doc__), parents=[protocol, step])
    parser.add_argument("--batches", type=at_least(1), nargs="+",
                        help="sweep (a) batch sizes (default 32 64 128 256)")
    parser.add_argument("--width-batch", type=at_least(1),
                        help="sweep (b) batch size (default 256 as in the paper; ViT-L at 256 needs ~80 GB)")
    parser.add_argument("--out", default="results/overhead",
                        help="output folder for overhead.json / overhead.png (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace this script's files in --out")
    args = parser.parse_args(argv)
    if args.apply_only:  # no training step: a flag of the steps would be dropped without a word
        unused = [flag for flag, value in (("--amp", args.amp), ("--batches", args.batches),
                                           ("--width-batch", args.width_batch)) if value is not None]
        if unused:
            parser.error(f"{unused[0]}: --apply-only times CD's update alone, without training steps, so "
                         f"{unused[0]} would change nothing; drop it (or --apply-only)")
    # one configuration timed twice: two rows, of which the table printed the last alone
    refuse_repeats(parser, ("--widths", args.widths), ("--batches", args.batches))
    for width in args.widths or []:  # before the batch sweep's minutes: timm's AssertionError once built
        refusal = undivided_heads("--widths", width)
        if refusal:
            parser.error(refusal)
    written = [os.path.join(args.out, n) for n in
               (("apply.json",) if args.apply_only else ("overhead.json", "overhead.png"))]
    try:
        refuse_existing_outputs(written, args.overwrite)
        if args.overwrite:  # a JSON or figure of another's at these names is not this script's to replace
            refuse_others_files(written, SOURCE, json_keys=APPLY_KEYS if args.apply_only else OVERHEAD_KEYS)
    except RunDirError as e:
        sys.exit(f"error: {e}")
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device; use --device cpu --small")
    if device == "cpu" and args.precision == "tf32":  # the rows would say tf32 over fp32 timings
        parser.error("--precision tf32 on a CPU: CPUs have no TF32, CD's products run in fp32 there; give "
                     "--precision fp32 (or auto)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.amp = None if args.apply_only else args.amp or ("fp16" if device == "cuda" else "bf16")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as in training; CD's fp32 math may use TF32 too
        torch.backends.cudnn.allow_tf32 = True
    if args.small:  # a ViT with 64 tokens and 4 blocks: each step takes tens of ms on a laptop CPU
        base = dict(embed_dim=192, depth=4, img_size=64, patch_size=8, num_classes=100)
        batches, widths, width_batch = args.batches or [8, 16, 32], args.widths or [96, 192, 384], \
            args.width_batch or 16
        args.warmup = 3 if args.warmup is None else args.warmup
        args.steps = 7 if args.steps is None else args.steps
    else:  # ViT-B/16 at 224 px, as in the paper
        base = dict(embed_dim=768, depth=12, img_size=224, patch_size=16, num_classes=1000)
        batches, widths, width_batch = args.batches or [32, 64, 128, 256], args.widths or [384, 768, 1024], \
            args.width_batch or 256
        args.warmup = 5 if args.warmup is None else args.warmup
        args.steps = 20 if args.steps is None else args.steps

    env = environment(device)  # the same fields as bench_quant.py's and overhead_epochs.py's JSON
    hw = env["hardware"]
    print(f"device {device} ({hw}), torch {torch.__version__}, timm {timm.__version__}, "
          f"{'' if args.apply_only else f'amp {args.amp}, '}threads {torch.get_num_threads()}, "
          f"warmup {args.warmup}, timed steps {args.steps}, CD norms_every {args.norms_every}")
    if args.apply_only:
        return apply_only(base, widths, args, device, env)
    rows = run_sweep("batch", [(base, b) for b in batches], args, device)
    rows += run_sweep("width", [(dict(base, embed_dim=w), width_batch) for w in widths], args, device)
    print()
    print(table(rows))
    if device != "cuda":
        print("peak memory: n/a on CPU (torch.cuda.max_memory_allocated only; "
              "process RSS is not per configuration)")

    os.makedirs(args.out, exist_ok=True)
    report = {**env, "amp": args.amp, "threads": torch.get_num_threads(), "warmup": args.warmup, "steps": args.steps,
              "norms_every": args.norms_every, "small": args.small, "model": base,
              "memory": "torch.cuda.max_memory_allocated" if device == "cuda" else "n/a", "rows": rows}
    try:  # never over an output another command wrote since this one started
        if args.overwrite:  # nor over another's that another command put there meanwhile
            refuse_others_files(written, SOURCE, json_keys=OVERHEAD_KEYS)
        write_json(written[0], report, args.overwrite, indent=1)
        plot(rows, written[1], has_memory=device == "cuda",
             title=f"{hw}, AMP {args.amp}: baseline vs CD vs TWEO (memory-saving / plain)", overwrite=args.overwrite)
    except RunDirError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {os.path.join(args.out, 'overhead.json')} and overhead.png")
    return report


if __name__ == "__main__":
    main()
