r"""Config-driven ablation sweeps: expand a sweep file into train (and evaluate) commands, check every run's
config before anything starts, then print the commands or run them one after another.

    python scripts/sweep.py configs/sweeps/cd_lambda.yaml data.root=/datasets/imagenet          # print
    python scripts/sweep.py configs/sweeps/cd_lambda.yaml --run --evaluate \
        --launcher "torchrun --nproc_per_node=8" data.root=/datasets/imagenet                   # run
    python scripts/sweep.py configs/sweeps/digits_demo.yaml --run --evaluate                      # CPU demo

A sweep file (configs/sweeps/*.yaml):
    configs: [configs/pretrain/vit_b.yaml, configs/method/cd.yaml]   # layered under every run
    out_root: runs/sweeps/cd_lambda                                  # run <name> writes to out_root/<name>
    runs:
      baseline: [cd.enabled=false]              # items ending in .yaml are further --config layers,
      lam0.01: [cd.lam=0.01]                    # the others key=value overrides
    evaluate: ["quant.pipelines=[repq,aphq]"]   # optional: overrides for every evaluate.py command
    run_keys: [data.root]                       # optional: keys each run sets (a data-set preset), which
                                                # an override for the whole sweep may not replace
Overrides given on this command line apply to every run. Runs are plain train.py invocations, so a run
that stopped resumes when the sweep is started again.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configs import ConfigError, load_config  # noqa: E402
from configs.loader import read_yaml_file  # noqa: E402


def expand(sweep_path: str, extra_overrides: list[str]) -> list[dict]:
    """One dict per run: name, config files, overrides (out_dir included), all checked by the loader."""
    sweep = read_yaml_file(sweep_path)
    unknown = set(sweep) - {"configs", "out_root", "runs", "evaluate", "run_keys"}
    if unknown or not isinstance(sweep.get("runs"), dict) or not sweep["runs"]:
        raise ConfigError(f"{sweep_path}: a sweep has 'configs', 'out_root', a non-empty 'runs' mapping and "
                          f"optionally 'evaluate' and 'run_keys'"
                          + (f"; unknown keys {sorted(unknown)}" if unknown else ""))
    # e.g. data.root=/datasets/imagenet given to a multi-data-set sweep would train every run on ImageNet
    run_keys = {str(k) for k in sweep.get("run_keys") or []}
    clashing = [o for o in extra_overrides if o.split("=", 1)[0].strip() in run_keys]
    if clashing:
        raise ConfigError(f"{sweep_path}: {', '.join(clashing)} would replace a key that each run sets "
                          f"itself ({', '.join(sorted(run_keys))}); drop it from the command line (the sweep file's "
                          f"comments say where each run reads its data)")
    eval_overrides = [str(o) for o in sweep.get("evaluate") or []]
    runs = []
    for name, items in sweep["runs"].items():
        items = [str(i) for i in items or []]
        configs = list(sweep.get("configs") or []) + [i for i in items if i.endswith(".yaml")]
        overrides = [i for i in items if not i.endswith(".yaml")] + list(extra_overrides)
        overrides.append(f"out_dir={os.path.join(sweep.get('out_root', 'runs/sweep'), str(name))}")
        try:
            # strict, up front
            load_config([os.path.join(ROOT, c) for c in configs], overrides + eval_overrides)
        except ConfigError as e:
            raise ConfigError(f"sweep run '{name}': {e}") from e
        runs.append({"name": str(name), "configs": configs, "overrides": overrides,
                     "evaluate": eval_overrides})
    return runs


def commands(run: dict, launcher: str, evaluate: bool) -> list[list[str]]:
    prefix = shlex.split(launcher) if launcher else [sys.executable]
    config_args = [a for c in run["configs"] for a in ("--config", c)]
    cmds = [prefix + ["train.py", *config_args, *run["overrides"]]]
    if evaluate:
        out_dir = next(o.split("=", 1)[1] for o in run["overrides"] if o.startswith("out_dir="))
        data_overrides = [o for o in run["overrides"] if o.startswith(("data.", "quant."))]
        cmds.append(prefix + ["evaluate.py", "--checkpoint", os.path.join(out_dir, "best.pt"),
                              *data_overrides, *run["evaluate"]])
    return cmds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="sweep file, e.g. configs/sweeps/cd_lambda.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run (e.g. data.root=...)")
    p.add_argument("--run", action="store_true",
                   help="run the commands one after another (default: print them)")
    p.add_argument("--evaluate", action="store_true", help="also evaluate each run's best.pt (evaluate.py)")
    p.add_argument("--launcher", default="", help='e.g. "torchrun --nproc_per_node=8" (default: this python)')
    p.add_argument("--only", nargs="*", help="names of the runs to keep")
    args = p.parse_intermixed_args(argv)
    try:
        runs = expand(args.sweep, args.overrides)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if args.only:
        missing = sorted(set(args.only) - {r["name"] for r in runs})
        if missing:
            sys.exit(f"error: no run named {missing} in {args.sweep}")
        runs = [r for r in runs if r["name"] in args.only]
    for run in runs:
        for cmd in commands(run, args.launcher, args.evaluate):
            print(shlex.join(cmd), flush=True)
            if args.run:
                done = subprocess.run(cmd, cwd=ROOT)
                if done.returncode != 0:
                    print(f"sweep: run '{run['name']}' failed ({done.returncode}); stopping", file=sys.stderr)
                    return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
