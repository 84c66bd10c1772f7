"""Peak transient memory of one CD update (`ColinearityDecay.apply`) on a timm model, on any device.

Every tensor storage that an op inside `apply` creates is counted from its creation until it is freed (a
TorchDispatchMode sees each op's outputs; views and in-place results share a storage already counted), and the
largest total that is alive at once is printed. The weights themselves, updated in place, are not counted: the
figure is what the update adds on top of the model, for each target, on an update that also computes the update
norms (`norms_every=1`, the library's default) and on one that does not (train.py passes its log interval,
`train.log_every_steps`, so 49 updates in 50 skip them at the default 50).

    python scripts/cd_update_memory.py                           # ViT-B/16 on the CPU
    python scripts/cd_update_memory.py --model swin_tiny_patch4_window7_224 --device cuda
"""
from __future__ import annotations

import sys
import warnings
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cd import ColinearityDecay, UnsupportedModelError, find_pairs  # noqa: E402
from configs.cli import OneLineParser, first_line, torch_device  # noqa: E402


class LiveStorage(TorchDispatchMode):
    """Bytes of the storages created inside the mode that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._counted: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                  if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if ptr in inputs or ptr in self._counted:  # in place or a view: no new memory
                continue
            self._counted.add(ptr)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._freed, ptr, nbytes)
        return out

    def _freed(self, ptr: int, nbytes: int) -> None:
        self.live -= nbytes
        self._counted.discard(ptr)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=first_line(__doc__))
    parser.add_argument("--model", default="vit_base_patch16_224",
                        help="a timm model name, random weights (default: %(default)s)")
    parser.add_argument("--device", type=torch_device, default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    args = parser.parse_args(argv)
    import timm
    try:
        model = timm.create_model(args.model)
    except RuntimeError as error:  # timm's unknown model: a usage error naming the input (status 2), as below
        parser.error(f"--model {args.model}: {error}")
    try:  # before any output: a model CD finds no pairs in (a CNN) is a usage error, not a traceback below
        find_pairs(model, verify=False)  # the pairs each ColinearityDecay below finds (it passes verify=False)
    except UnsupportedModelError as e:
        parser.error(f"--model {args.model}: {e}")
    model.to(args.device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
    print(f"{args.model} on {args.device} (torch {torch.__version__}), parameters {weights:.0f} MiB")
    for target in ("A+B", "C"):
        for norms_every in (1, 50):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the verify=False notice
                decay = ColinearityDecay(model, lam=0.005, targets=target, norms_every=norms_every, verify=False)
            with torch.no_grad():
                decay.apply(1e-3)  # update 1 always computes the norms; update 2 only with norms_every=1
                tracker = LiveStorage()
                with tracker:
                    decay.apply(1e-3)
            print(f"target {target:3s}  norms_every={norms_every:2d}  peak transient memory of one update: "
                  f"{tracker.peak / 2 ** 20:.1f} MiB")


if __name__ == "__main__":
    main()
