"""Running an MMEngine config in the framework tests as MMEngine's `tools/train.py` does (imported by the
tests that need mmengine only)."""
from __future__ import annotations

from mmengine.config import Config
from mmengine.runner import Runner


def run(cfg) -> Runner:
    """Write `cfg` to a config file and train from it, as `tools/train.py` does (custom_imports included)."""
    path = f"{cfg['work_dir']}.py"
    Config(cfg).dump(path)
    runner = Runner.from_cfg(Config.fromfile(path))
    runner.train()
    return runner


def hook_of(runner, kind):
    """The runner's hook of type name `kind`."""
    return next(h for h in runner.hooks if type(h).__name__ == kind)
