"""The Noise baseline in MMEngine / MMDetection (paper Sec. "COCO Detection": uniform-noise injection in the
backbone's weights, UNIQ): `WeightNoiseHook`, enabled by configuration alone (`cd.integrations.mmengine` imports
this module):

    custom_imports = dict(imports=["cd.integrations.mmengine"], allow_failed_imports=False)
    custom_hooks = [dict(type="WeightNoiseHook", bits=4, seed=0)]

`cd.noise.WeightNoise` on the detector's `backbone` (`module=` as in ColinearityDecayHook) for the run: its hooks
go on at `before_train` and off at `after_train`; at `before_train_iter` the noise step is set to
`runner.iter`, so every micro-batch draws fresh noise, a given (seed, iteration) always draws the same, and a
resumed run (runner.iter restored from the checkpoint) continues with the noise of the uninterrupted run. The
optimizer, EMA hooks and checkpoints only see the clean weights; validation (eval mode) runs on them.

MMEngine calls no hook when training raises: the hooks of a failed run stay on its model's layers. The next
`before_train` of a WeightNoiseHook in another Runner on that model removes them (a run that is over), so a new run
on a reused model instance gets its own noise only. A run without the hook on such a model would still see the
failed run's noise: call the failed run's `hook.after_train(runner)` first, which removes it.
"""
from __future__ import annotations

import weakref
from typing import Optional, Sequence

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from ..noise import _NOISE_ON, WeightNoise, check_arguments
from ..wrappers import unwrap_model
from . import check_module_name, select_module


@HOOKS.register_module()
class WeightNoiseHook(Hook):
    """UNIQ weight noise (`cd.noise`) on a part of an MMEngine model during training forwards.

    Args:
        module: None (default) the `backbone` if the model has one, else the whole model; "" the whole model;
            or a dotted submodule name.
        bits: k = 2^bits levels of the emulated k-quantile quantizer; default 4 (the W4 target).
        layer_types: "Linear" (default) and/or "Conv2d".
        seed: the noise seed (an int >= 0), independent of MMEngine's `randomness.seed`.

    Attributes:
        noise: the `WeightNoise` object during training (`noise.layers`).
    """

    priority = "NORMAL"

    def __init__(self, module: Optional[str] = None, bits: int = 4, layer_types: Sequence[str] = ("Linear",),
                 seed: int = 0) -> None:
        check_arguments(bits, layer_types, seed)  # a bad argument fails when the Runner is built
        self.module = check_module_name(module, "WeightNoiseHook")
        self.bits, self.layer_types, self.seed = bits, tuple(layer_types), seed
        self.noise: Optional[WeightNoise] = None

    def before_train(self, runner) -> None:
        if self.noise is not None:
            self.noise.remove()
        part = select_module(runner.model, self.module)
        for layer in unwrap_model(part).modules():  # a failed run's noise (module doc)
            other = _NOISE_ON.get(layer)
            if other is not None and getattr(other, "runner", lambda: runner)() is not runner:
                other.remove()
        self.noise = WeightNoise(part, bits=self.bits, layer_types=self.layer_types, seed=self.seed)
        self.noise.runner = weakref.ref(runner)  # the run it serves

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        self.noise.step = runner.iter

    def after_train(self, runner) -> None:
        if self.noise is not None:
            self.noise.remove()
