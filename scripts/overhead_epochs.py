r"""The paper's efficiency protocol (Sec. 4.3, Fig. 2) with real training runs: mean epoch time and peak
memory of baseline, CD and TWEO at a fixed global batch, (a) against the per-GPU batch on ViT-B and
(b) against the hidden size (ViT-S/B/L) at one per-GPU batch. The paper: global batch 1024, five epochs,
the mean over three runs, on Ampere GPUs; time in seconds, memory the peak max_allocated in MiB.

Each (method, model, per-GPU batch, run) is one train.py run of `--recipe` (default the DeiT ViT-B recipe; a
relative path starts at the working folder, as train.py's --config and --out, and the runs are given it absolute)
into <out>/runs/<model>_bs<b>_<method>_run<r>, with train.batch_size=<global batch>, validation only after
the last epoch, and the methods' own configs (a key=value override of one of these keys, or of cd.enabled /
tweo.enabled, is refused, and so is a --recipe that turns a method on: a row is timed as the method it names):
    baseline    the recipe
    cd          + configs/method/cd.yaml
    tweo        + configs/method/tweo.yaml (our memory-saving TWEO)
    tweo_plain  + configs/method/tweo.yaml tweo.form=plain (plain autograd; we take it to be the form the paper timed)
The loop logs epoch/train_seconds (the epoch's updates, no validation or checkpoint) and, on CUDA, epoch/max_mem_mib
(rank 0's peak) for every epoch it runs from its start (engine/loop.py); this script reads them from metrics.jsonl.
Reported per configuration: mean epoch seconds over all epochs and runs, the same without the first epoch each job
of a run trained in (cuDNN autotuning, data-loader start; a resumed run's job begins cold too:
epoch/first_in_process), peak memory (max over runs), and ratios to the baseline. Re-running the same command reuses
finished runs and resumes interrupted ones (an epoch cut by the interruption has no timing), whose reported times
are then those of the earlier jobs too: a run folder is reused only under a launcher of as many processes as the one
recorded beside it (runs/<folder>.launcher.json; one that does not state its count, e.g. srun: the same launcher;
without that record, as many as every job in the folder's train.log states) and with the settings its config.yaml
holds; any other is refused before the first run starts. A run that train.py refuses or that fails ends the protocol
with train.py's error; one stopped by a signal after its checkpoint (train.py's exit 75, or a launcher's other code
where the run's train.log records the stop: torchrun exits 1) ends it with exit 75, and the same command continues
it; one a signal ended without that record (a second Ctrl-C ends train.py at once, without a new checkpoint) ends it
with train.py's own exit status. Writes epochs.json (with the device, its hardware and the torch / CUDA / timm
versions, the fields of bench_overhead.py and bench_quant.py: scripts/bench_env.py; each as the runs' train.logs
record it, not this process's, which may run where they do not, e.g. srun from a head node without a GPU) and
epochs.png.

    python scripts/bench_overhead.py --protocol epochs --launcher "torchrun --nproc_per_node=4" \
        --out results/overhead_epochs data.root=/datasets/imagenet  # the paper's protocol (256 x 4 GPUs = 1024)
    python scripts/bench_overhead.py --protocol epochs --recipe configs/debug/tiny.yaml --global-batch 16 \
        --batches 8 16 --models vit_nano --width-batch 8 --epochs 2 --runs 1 --out /tmp/ep      # CPU smoke
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

sys.path.insert(0, ROOT)
from configs.cli import OneLineParser, at_least, move_overrides, refuse_repeats  # noqa: E402
from engine.exit_codes import EXIT_PREEMPTED  # noqa: E402
from engine.figures import new_figure  # noqa: E402
from engine.outputs import refuse_others_files, save_figure, source_mark, write_json  # noqa: E402
from launchers import (ForwardedSignals, launcher_world_size, log_mark,  # noqa: E402  (scripts/)
                       stopped_after_checkpoint)
METHODS = {"baseline": [], "cd": ["configs/method/cd.yaml"], "tweo": ["configs/method/tweo.yaml"],
           "tweo_plain": ["configs/method/tweo.yaml", "tweo.form=plain"]}
WIDTH_MODELS = ["vit_small_patch16_224", "vit_base_patch16_224", "vit_large_patch16_224"]  # D 384/768/1024
# By these --overwrite knows its own outputs (engine.outputs.refuse_others_files): epochs.png's text entry Source, and
# keys that every version of epochs.json has held and another's JSON of that name is unlikely to hold
SOURCE = "scripts/overhead_epochs.py"
REPORT_KEYS = ("protocol", "recipe", "launcher", "global_batch", "runs", "rows")


# the keys each timed run gets from the protocol (run_config): an override of one would time another run
# than the row names (every per-GPU batch at one, the report's epochs not the runs'); the methods' identity
# (cd.enabled, tweo.enabled, tweo.form: set or left off by METHODS) too, or cd.enabled=true times CD under "baseline"
PROTOCOL_KEYS = {"model.name": "--models", "train.batch_size": "--global-batch",
                 "train.batch_size_per_gpu": "--batches / --width-batch", "sched.epochs": "--epochs",
                 "sched.warmup_epochs": "", "train.eval_every_epochs": "", "train.seed": "--runs",
                 "out_dir": "--out", "cd.enabled": "--methods", "tweo.enabled": "--methods", "tweo.form": "--methods"}


# The environment line each job of a run writes at the top of its train.log (engine/runinfo.py describe_environment,
# after setup_logging's "time logger level" prefix; only rank 0 writes the file): its versions, and the device it
# trained on, a GPU's name or "cpu (<model name>, <n> threads)". A resumed run holds one such line per job.
RUN_ENVIRONMENT = re.compile(r"^\S+ \S+ INFO commit \S+, torch (\S+), timm (\S+), python \S+, \d+ process\(es\), "
                             r"rank \d+ on (.+)$")
CPU_DEVICE = re.compile(r"cpu \((.*), \d+ threads\)")


def run_environment(logs: list[str]) -> dict:
    """bench_env.environment's fields (device, hardware, torch, cuda, timm) of the runs whose train.logs are `logs`,
    as every job of theirs recorded them: not this process's, which may run where the runs do not (srun from a head
    node without a GPU, where asking CUDA for the device's name raises). A field is the one value the jobs state,
    their values joined by '; ' where they differ, None where no job states one (a log lost, or of another
    version). cuda, which the line lacks, is this process's CUDA build where every job ran this process's torch
    build (the same version string; the protocol's runs start from this installation), else None. Never raises:
    the report is written after all the runs."""
    import torch

    found: dict = {"device": [], "hardware": [], "torch": [], "timm": []}
    for log in logs:
        try:  # train.py writes UTF-8 (backslashreplace); a damaged byte elsewhere must not hide the lines
            with open(log, encoding="utf-8", errors="replace") as f:
                matches = [m for m in map(RUN_ENVIRONMENT.match, f) if m]
        except OSError:
            continue
        for m in matches:
            cpu = CPU_DEVICE.fullmatch(m.group(3))
            for key, value in (("device", "cpu" if cpu else "cuda"), ("hardware", cpu.group(1) if cpu else m.group(3)),
                               ("torch", m.group(1)), ("timm", m.group(2))):
                if value not in found[key]:
                    found[key].append(value)
    joined = {key: "; ".join(values) if values else None for key, values in found.items()}
    cuda = torch.version.cuda if found["torch"] == [torch.__version__] else None
    return {"device": joined["device"], "hardware": joined["hardware"], "torch": joined["torch"], "cuda": cuda,
            "timm": joined["timm"]}


def refuse_protocol_keys(overrides: list[str]) -> None:
    from configs.loader import overlapping_keys

    for item in overrides:
        for own in overlapping_keys(item, PROTOCOL_KEYS)[:1]:
            flag = f"; use {PROTOCOL_KEYS[own]}" if PROTOCOL_KEYS[own] else ""
            sys.exit(f"error: {item} would replace {own}, which the protocol sets for every timed run{flag}")


def run_config(args, method: str, model: str, batch: int, run: int, out_dir: str) -> tuple[list, list]:
    """(config files, overrides) of one timed run; out_dir quoted where YAML would read the folder otherwise."""
    from sweep import yaml_text  # scripts/: this folder, as this script or bench_overhead.py runs it
    configs = [args.recipe] + [c for c in METHODS[method] if c.endswith(".yaml")]
    overrides = [c for c in METHODS[method] if not c.endswith(".yaml")]
    return configs, [f"model.name={model}", f"train.batch_size={args.global_batch}",
                     f"train.batch_size_per_gpu={batch}", f"sched.epochs={args.epochs}",
                     # a few epochs of the recipe, timed: no warmup (a step costs the same at any lr, and
                     # a warmup as long as the run is refused)
                     "sched.warmup_epochs=0", f"train.eval_every_epochs={args.epochs}", f"train.seed={run}",
                     f"out_dir={yaml_text(out_dir)}", *overrides, *args.overrides]


def train_command(args, method: str, model: str, batch: int, run: int, out_dir: str) -> list[str]:
    from sweep import launcher_prefix  # scripts/: this folder, as this script or bench_overhead.py runs it
    prefix = launcher_prefix(args.launcher)
    configs, overrides = run_config(args, method, model, batch, run, out_dir)
    return prefix + [os.path.join(ROOT, "train.py"), *[a for c in configs for a in ("--config", c)], *overrides]


def check_plan(args, plan: list) -> None:
    """Every run's config, and its per-GPU batch against the global batch on the launcher's processes, before
    the first run starts (a run refused later would leave the report unwritten after hours of runs)."""
    from configs import ConfigError, load_config
    from sweep import check_model  # scripts/: this folder, as this script or bench_overhead.py runs it
    world = launcher_world_size(args.launcher)
    for _, model, batch in plan:
        if world is not None and args.global_batch % (batch * world):
            sys.exit(f"error: per-GPU batch {batch} on {world} process(es) does not divide --global-batch "
                     f"{args.global_batch} (train.batch_size must be a multiple of batch x processes): launch "
                     f"fewer processes (the paper's 256 per GPU at 1024: 4 GPUs), or change --batches / "
                     f"--width-batch")
        for method in args.methods:
            configs, overrides = run_config(args, method, model, batch, 0, os.path.join(args.out, "runs", "check"))
            try:
                cfg = load_config([os.path.join(ROOT, c) for c in configs], overrides)
                check_model(cfg.model)  # an unknown name in the last row: refused before the first run trains
            except ConfigError as e:
                sys.exit(f"error: the {method} run of {model} at batch {batch}: {e}")
            # a recipe that turns a method on (the overrides cannot: PROTOCOL_KEYS) would time it under this name
            for section, on in (("cd", method == "cd"), ("tweo", method.startswith("tweo"))):
                if getattr(cfg, section).enabled != on:
                    sys.exit(f"error: --recipe {args.recipe} sets {section}.enabled="
                             f"{str(not on).lower()}, so its {method} runs would not be {method}: give a recipe "
                             f"without a method (the protocol adds each method's config itself)")


def run_dir(args, model: str, batch: int, method: str, run: int) -> str:
    """The folder of one timed run: its settings but the launcher's (overhead_run_folders records that beside it)."""
    return os.path.join(args.out, "runs", f"{model}_bs{batch}_{method}_run{run}")


def check_run_folders(args, plan: list) -> None:
    """Every run folder that a run would continue, before the first run starts: one timed under a launcher of
    another number of processes, or of settings other than its run's, is refused (overhead_run_folders)."""
    from configs import config_to_dict, load_config
    from overhead_run_folders import reuse_problem  # scripts/: this folder, as this script or bench_overhead.py runs it
    for _, model, batch in plan:
        for method, run in ((m, r) for m in args.methods for r in range(args.runs)):
            out_dir = run_dir(args, model, batch, method, run)
            if not os.path.isfile(os.path.join(out_dir, "checkpoint.pt")):
                continue  # nothing to continue: the run starts afresh (or train.py refuses the folder itself)
            configs, overrides = run_config(args, method, model, batch, run, out_dir)
            config = config_to_dict(load_config([os.path.join(ROOT, c) for c in configs], overrides))
            problem = reuse_problem(out_dir, args.launcher, config, launcher_world_size)
            if problem:
                sys.exit(f"error: {problem}")


def failed_run_line(out_dir: str, returncode: int, stopped: bool = False,
                    interrupted: bool = False) -> tuple[int, str]:
    """(exit status, the line to end with) when train.py did not finish the run in `out_dir`. Its own error line is
    above when it exited 1 (a refusal at its start, or an error while it trained): this line only says which run,
    and claims no resume (the same command may be refused again). Stopped by a signal after its checkpoint
    (EXIT_PREEMPTED, or `stopped`: its train.log says so where the launcher reports another code, as torchrun's 1),
    killed, or `interrupted` (this script got a stop request, and train.py ended with another code and no record
    of the stop: a second Ctrl-C ends it without a new checkpoint), it printed none: the line is the error, and
    the same command continues the run; only a stop after its checkpoint exits 75."""
    from sweep import shell_status  # scripts/: this folder, as this script or bench_overhead.py runs it
    code, killed = shell_status(returncode)
    if code == EXIT_PREEMPTED or stopped:
        return EXIT_PREEMPTED, (f"error: the run in {out_dir} stopped on a signal after writing its checkpoint.pt; "
                                f"re-running the same command continues it")
    if killed:
        return code, (f"error: the run in {out_dir} was{killed[1:]}; re-running the same command continues it from "
                      f"its last checkpoint.pt (from its start if it wrote none)")
    if interrupted:
        return code, (f"error: the run in {out_dir} was interrupted by a signal and ended without writing a "
                      f"checkpoint.pt on the stop (train.py exit status {code}); re-running the same command continues "
                      f"it from its last checkpoint.pt (from its start if it wrote none)")
    return code, (f"overhead_epochs: the run in {out_dir} failed (train.py exit status {code}); its output above "
                  f"says why")


def epoch_costs(metrics_path: str) -> list[dict]:
    """The epoch/* records of one run's metrics.jsonl, in order."""
    rows = []
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            if "epoch/train_seconds" in record:
                rows.append(record)
    return rows


def summarise(runs: list[list[dict]]) -> dict:
    """Mean epoch seconds over all epochs of all runs, and without the epochs each job began cold in (the loop's
    epoch/first_in_process; a run's first epoch where its records predate that key); peak memory."""
    seconds = [e["epoch/train_seconds"] for r in runs for e in r]
    later = [e["epoch/train_seconds"] for r in runs for i, e in enumerate(r)
             if not e.get("epoch/first_in_process", i == 0)]
    memory = [e["epoch/max_mem_mib"] for r in runs for e in r if "epoch/max_mem_mib" in e]
    return {"epoch_s": statistics.mean(seconds) if seconds else None,
            "epoch_s_after_first": statistics.mean(later) if later else None,
            "peak_mib": max(memory) if memory else None, "epochs_timed": [len(r) for r in runs]}


def plot(rows: list[dict], path: str, title: str, overwrite: bool) -> None:
    fig = new_figure(10, 7)
    axes = fig.subplots(2, 2, squeeze=False)
    for col, (sweep, xkey, xlabel) in enumerate([("batch", "batch", "per-GPU batch size"),
                                                 ("width", "model", "model (hidden size)")]):
        for row, (ykey, ylabel) in enumerate([("epoch_s", "epoch time (s)"),
                                              ("peak_mib", "peak memory (MiB)")]):
            ax = axes[row][col]
            for method in METHODS:
                pts = [(r[xkey], r[ykey]) for r in rows
                       if r["sweep"] == sweep and r["method"] == method and r.get(ykey) is not None]
                if pts:
                    ax.plot([str(p[0]) for p in pts], [p[1] for p in pts], marker="o", label=method)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, overwrite, dpi=120, metadata=source_mark(SOURCE))  # refuse_others_files knows it


def build_parser(**kwargs) -> OneLineParser:
    """This script's command line; `kwargs` go to the parser (bench_overhead.py reads an epochs command line with
    these forms, its step flags beside them: parents, add_help)."""
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    # a relative --recipe starts at the working folder, as train.py's --config and --out do (it was read from the
    # repository root: ./my.yaml given from elsewhere was not found, or the root's file of that name was timed)
    p.add_argument("--recipe", default=os.path.join(ROOT, "configs", "pretrain", "vit_b.yaml"),
                   help="train.py config of every run, relative to the working folder as train.py's --config "
                        "(default: this checkout's configs/pretrain/vit_b.yaml)")
    p.add_argument("--launcher", default="", help='e.g. "torchrun --nproc_per_node=8" (default: this python)')
    p.add_argument("--global-batch", type=at_least(1), default=1024, help="train.batch_size (the paper: 1024)")
    p.add_argument("--batches", type=at_least(1), nargs="*", default=[32, 64, 128, 256],
                   help="sweep (a): per-GPU batches on the recipe's model (none: skip the sweep; default: 32 64 128 "
                        "256)")
    p.add_argument("--models", nargs="*", default=WIDTH_MODELS,
                   help=f"sweep (b): models of different hidden sizes at --width-batch (none: skip; default: "
                        f"{' '.join(WIDTH_MODELS)})")
    p.add_argument("--width-batch", type=at_least(1), default=256,  # 0: the plan's check divided by it
                   help="sweep (b) per-GPU batch (the paper: 256)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                   help=f"methods timed, each in its own runs (default: {' '.join(METHODS)})")
    p.add_argument("--epochs", type=at_least(1), default=5, help="epochs per run (the paper: 5; default: %(default)s)")
    p.add_argument("--runs", type=at_least(1), default=3,
                   help="runs per configuration, averaged (the paper: 3; default: %(default)s)")
    p.add_argument("--out", default="results/overhead_epochs",
                   help="folder for epochs.json / epochs.png and the runs (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace epochs.json / epochs.png in --out")
    p.add_argument("overrides", nargs="*", help="key=value for every run, e.g. data.root=/datasets/imagenet")
    return p


def main(argv: Optional[list[str]] = None, parents: tuple = ()) -> dict:
    """`parents`: parsers of flags this command line may hold besides its own (bench_overhead.py's --protocol)."""
    p = build_parser(parents=list(parents))
    args = p.parse_intermixed_args(argv)
    move_overrides(args, "models")  # `--models vit_small_patch16_224 data.root=/d`: data.root=/d is an override
    # the runs start in the repository root (their configs' paths are its), this script reads their folders from
    # here: a relative --out given elsewhere was trained into under the root and then looked for here (a traceback
    # after the first run)
    args.out = os.path.abspath(args.out)
    # the same runs (one folder each) taken again: their row twice in the table and epochs.json
    refuse_repeats(p, ("--batches", args.batches), ("--models", args.models), ("--methods", args.methods))
    if not args.batches and not args.models:  # a usage error (status 2), as argparse's: before any config is read
        p.error("--batches and --models are both empty: there is nothing to measure")
    refuse_protocol_keys(args.overrides)
    written = [os.path.join(args.out, n) for n in ("epochs.json", "epochs.png")]
    from configs import ConfigError, load_config
    from engine.run_dir import RunDirError, refuse_existing_outputs

    try:
        refuse_existing_outputs(written, args.overwrite)
        if args.overwrite:  # a JSON or figure of another's at these names is not this script's to replace
            refuse_others_files(written, SOURCE, json_keys=REPORT_KEYS)
        # read as given, from here: a missing relative one is train.py's own error (naming the checkout's file of
        # that name, if any)
        recipe_config = load_config([args.recipe], list(args.overrides))
    except (ConfigError, RunDirError) as e:
        sys.exit(f"error: {e}")
    # absolute from here on: the runs start in the repository root, and their commands and epochs.json record it
    args.recipe = os.path.abspath(args.recipe)
    plan = [("batch", recipe_config.model.name, b) for b in args.batches] + [("width", m, args.width_batch)
                                                                             for m in args.models]
    check_plan(args, plan)
    from sweep import unrunnable_launcher  # scripts/: this folder, as this script or bench_overhead.py runs it
    try:
        launcher_problem = unrunnable_launcher(args.launcher)
    except ValueError as e:  # e.g. an unclosed quote
        launcher_problem = str(e)
    if launcher_problem:  # now, not as a FileNotFoundError traceback when the first run would start
        sys.exit(f"error: --launcher {args.launcher!r}: {launcher_problem}")
    check_run_folders(args, plan)
    from overhead_run_folders import write_launcher  # scripts/, as for reuse_problem
    rows, logs = [], []
    # SIGINT / SIGTERM reach the running train.py, and this script waits while it writes its checkpoint
    # (subprocess.run killed it 0.25 s after Ctrl-C, mid-write, and the run's last epoch was lost)
    with ForwardedSignals(cwd=ROOT) as signals:
        for sweep, model, batch in plan:
            for method in args.methods:
                runs = []
                for run in range(args.runs):
                    out_dir = run_dir(args, model, batch, method, run)
                    if signals.received:  # the stop came between two runs: no further one starts
                        print(f"error: stopped on a signal before the run in {out_dir} started; re-running the "
                              f"same command continues the protocol", file=sys.stderr, flush=True)
                        sys.exit(EXIT_PREEMPTED)
                    cmd = train_command(args, method, model, batch, run, out_dir)
                    print(shlex.join(cmd), flush=True)
                    try:  # under the run folder's lock: never over the record of a job that trains the run now
                        write_launcher(out_dir, args.launcher, launcher_world_size(args.launcher))
                    except RunDirError as e:
                        sys.exit(f"error: {e}")
                    log = os.path.join(ROOT, out_dir, "train.log")  # (the command runs in ROOT)
                    mark = log_mark(log)
                    returncode = signals.run(cmd)
                    if returncode != 0:
                        # only the run's exit code or its train.log says its checkpoint was written: a second
                        # Ctrl-C ends train.py at once, without one
                        stopped = stopped_after_checkpoint(returncode, log, mark)
                        code, line = failed_run_line(out_dir, returncode, stopped, bool(signals.received))
                        print(line, file=sys.stderr, flush=True)
                        sys.exit(code)
                    runs.append(epoch_costs(os.path.join(out_dir, "metrics.jsonl")))
                    logs.append(log)
                rows.append({"sweep": sweep, "model": model, "batch": batch, "method": method,
                             **summarise(runs)})
    for row in rows:
        base = next(r for r in rows if (r["sweep"], r["model"], r["batch"], r["method"])
                    == (row["sweep"], row["model"], row["batch"], "baseline")) if "baseline" in args.methods \
            else None
        for key in ("epoch_s", "peak_mib"):
            ok = base and base[key] and row[key] is not None
            row[f"{key}_over_baseline"] = row[key] / base[key] if ok else None
    print(f"\n{'sweep':6s} {'model':24s} {'batch':>5s} {'method':10s} {'epoch s':>9s} {'w/o 1st':>9s} "
          f"{'x base':>7s} {'peak MiB':>9s} {'x base':>7s}")
    fmt = lambda v, spec: "n/a".rjust(int(spec.split(".")[0])) if v is None else format(v, spec)
    for r in rows:
        print(f"{r['sweep']:6s} {r['model']:24s} {r['batch']:5d} {r['method']:10s} "
              f"{fmt(r['epoch_s'], '9.2f')} {fmt(r['epoch_s_after_first'], '9.2f')} "
              f"{fmt(r['epoch_s_over_baseline'], '7.3f')} "
              f"{fmt(r['peak_mib'], '9.0f')} {fmt(r['peak_mib_over_baseline'], '7.3f')}")
    os.makedirs(args.out, exist_ok=True)
    # the machine the runs trained on, as their train.logs record it (the same fields as bench_overhead.py's JSON):
    # this process's train.device guess raised without a GPU here (srun from a head node) and lost the report, or
    # named the head node's processor
    report = {"protocol": "epochs", **run_environment(logs), "recipe": args.recipe,
              "launcher": args.launcher, "global_batch": args.global_batch, "epochs": args.epochs, "runs": args.runs,
              "overrides": args.overrides, "rows": rows}
    try:  # never over an output another command wrote since this one started
        if args.overwrite:  # nor over another's that another command put there meanwhile
            refuse_others_files(written, SOURCE, json_keys=REPORT_KEYS)
        write_json(written[0], report, args.overwrite, indent=1)
        plot(rows, written[1], f"global batch {args.global_batch}, {args.epochs} epochs x {args.runs} runs",
             args.overwrite)
    except RunDirError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {written[0]} and {written[1]}")
    return report


if __name__ == "__main__":
    main()
