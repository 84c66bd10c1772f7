"""Error of the CD update at each `cd.matmul_precision` against a float64 reference.

One CD update (targets A+B) of a freshly initialised ViT-B/16 (timm init) is computed in float64 (the
reference) and at each precision from the same fp32 weights. Two figures per precision:
    product error  ||dW_p - dW_64||_F / ||dW_64||_F with a step s = 1, where the update is far above
                   the fp32 rounding of the weights: the error of the products themselves
    weight error   ||W_p - W_64||_F / ||fl32(W_64) - W_64||_F after one update at the training step
                   s = lr * lam = 1e-3 * 0.005 (DeiT-B's peak lr): below 1, the precision moves the
                   weights less than storing them in fp32 does
Both are over the functional pairs alone (proj, fc2: W1 a weight matrix), whose update is a product of
matrices. A composable pair's W1 is a norm scale: its update scales W2's columns, with no product, so it is exact
at s = 1 (g = 1 at timm's init: dW = -W2) and rounded only as fp32 storage rounds at the training step; counted
in, such pairs would water the products' error down by the share of the update they carry (vit_tiny on a CPU,
bf16: 1.454 x fp32 rounding over all pairs, 1.916 over the functional ones). The output names the pairs counted.
On CUDA every precision runs for real; on a CPU 'tf32' (which CPUs lack) is emulated by rounding the
operands of every matrix product the update runs (`mm`, and the `addmm_` that commits the update into W2) to TF32's
10-bit mantissa before fp32 products, as TF32 tensor cores read them, and the output says so. Then, for weights
stored in fp32, bf16 and fp16 ("bf16-true" training), the share of the decayed matrices' entries that one
update at the training step changes at all (in half precision most of the step rounds away, which is why
ColinearityDecay warns about such weights).

    python scripts/cd_precision.py                  # cuda if available, else cpu
    python scripts/cd_precision.py --model vit_small_patch16_224 --device cpu
"""
from __future__ import annotations

import copy
import os
import sys
import warnings
from contextlib import nullcontext

import timm
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root, for `cd`
from cd import ColinearityDecay, UnsupportedModelError  # noqa: E402
from configs.cli import OneLineParser, first_line  # noqa: E402

TRAINING_STEP = 1e-3 * 0.005  # lr * lam


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest value with TF32's 10 explicit mantissa bits (ties away from zero)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


class EmulatedTF32(TorchDispatchMode):
    """Within it, every fp32 matrix product takes its matrix operands rounded to TF32 (`round_to_tf32`) and
    multiplies them in fp32, as TF32 tensor cores do; an accumulator (addmm's `self`) stays fp32, as cuBLAS's C
    does. Caught at the dispatcher, so the products CD commits in place (`addmm_`) are emulated as its `mm`s are,
    whichever path the update takes; another product (an aten op named for one: *mm*, *mv*, *dot*, addr) raises
    rather than run unemulated."""

    OPERANDS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "addmm_": (1, 2), "baddbmm": (1, 2),
                "baddbmm_": (1, 2), "addbmm": (1, 2), "addbmm_": (1, 2)}

    @staticmethod
    def unemulated(name: str) -> bool:
        """Whether the aten op `name` is a product this mode does not emulate (mv, dot, _addmm_activation, ...)."""
        return any(part in name for part in ("mm", "mv", "dot")) or name in ("addr", "addr_")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.OPERANDS and self.unemulated(name):
            raise NotImplementedError(f"EmulatedTF32: aten.{name} is a product it does not emulate")
        if name in self.OPERANDS:
            args = list(args)
            for i in self.OPERANDS[name]:
                if args[i].dtype == torch.float32:
                    args[i] = round_to_tf32(args[i])
        return func(*args, **(kwargs or {}))


def updated(model: torch.nn.Module, step: float, precision: str, emulate: bool) -> dict[str, torch.Tensor]:
    """The decayed matrices after one CD update (step lr * lam = `step`) of a copy of `model`."""
    model = copy.deepcopy(model)
    # emulated TF32 rounds the operands in `EmulatedTF32`, then multiplies in fp32: ColinearityDecay refuses 'tf32'
    # off CUDA (no TF32 there), and its 'fp32' update runs the products of the 'tf32' one (mm, then addmm_ into W2)
    decay = ColinearityDecay(model, lam=1.0, matmul_precision="fp32" if emulate else precision)
    with EmulatedTF32() if emulate else nullcontext():
        decay.apply(lr=step)
    return {p.name: p.w2().detach().clone() for p in decay.pairs}


def changed_share(model: torch.nn.Module, dtype: torch.dtype, step: float) -> float:
    """The share of the decayed matrices' entries that one CD update at `step` changes, weights in `dtype`."""
    model = copy.deepcopy(model).to(dtype)
    decay = ColinearityDecay(model, lam=1.0)
    before = [p.w2().detach().clone() for p in decay.pairs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the half-precision warning this measures
        decay.apply(lr=step)
    changed = sum(int((p.w2() != b).sum()) for p, b in zip(decay.pairs, before))
    return changed / sum(b.numel() for b in before)


def _ratio(num: list[torch.Tensor], den: list[torch.Tensor]) -> float:
    """||num||_F / ||den||_F over lists of matrices."""
    return (sum(float(t.norm() ** 2) for t in num) / sum(float(t.norm() ** 2) for t in den)) ** 0.5


def commit_rounding(inner: int, device: str) -> tuple[float, float]:
    """(fused, apart): the error of W - A B in fp32, in units of fp32 rounding of the exact result, for a 768 x 768
    W and a product of inner dimension `inner` about 1e-6 of W (a training step's size), committed as CD commits
    it (`W.addmm_(A, B, alpha=-1)`) and computed apart (`W - A @ B`). A BLAS that adds A B into W in blocks of
    the inner dimension rounds W once per block: the fused error grows with `inner` where the apart one stays 1."""
    g = torch.Generator(device="cpu").manual_seed(inner)
    w, a, b = (torch.randn(*shape, generator=g).to(device) for shape in ((768, 768), (768, inner), (inner, 768)))
    scale = (1e-6 / inner ** 0.5) ** 0.5  # entries of A B: inner ** 0.5 * scale ** 2 = 1e-6, W's are about 1
    a, b = a * scale, b * scale
    exact = w.double() - a.double() @ b.double()
    rounding = (exact.float().double() - exact).norm()
    fused, apart = w.clone().addmm_(a, b, alpha=-1.0), w - a @ b
    return float((fused.double() - exact).norm() / rounding), float((apart.double() - exact).norm() / rounding)


def main(argv=None) -> list[dict]:
    parser = OneLineParser(description=first_line(__doc__))
    parser.add_argument("--model", default="vit_base_patch16_224",
                        help="timm model name of a ViT or Swin, freshly initialised, whose CD pairs are measured "
                             "(default: vit_base_patch16_224)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"],
                        help="where the update runs: cuda runs every precision for real, cpu emulates tf32 "
                             "(default: cuda if torch sees a CUDA device, else cpu)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if not timm.is_model(args.model):
        parser.error(f"--model {args.model}: not a timm model name (timm.list_models('vit_*') lists some)")
    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=1000).to(args.device)
    try:
        pairs = ColinearityDecay(model).pairs
    except UnsupportedModelError as e:
        parser.error(f"--model {args.model}: {e}")
    # the pairs whose update is a matrix product (module docstring): the errors are theirs alone
    products = [p.name for p in pairs if p.kind == "functional"]
    if not products:
        parser.error(f"--model {args.model}: CD pairs no functional (matrix-product) pair of it, so there is no "
                     "product to measure; give a ViT or Swin, e.g. vit_small_patch16_224")
    before = {p.name: p.w2().detach().double() for p in pairs}
    reference = {step: updated(model.double(), step, "fp32", emulate=False) for step in (1.0, TRAINING_STEP)}
    model.float()
    rows = []
    roles = ", ".join(dict.fromkeys(p.role for p in pairs if p.kind == "functional"))
    print(f"{args.model} on {args.device}: one CD update against float64 (product error at s = 1, "
          f"weight error / fp32 rounding at s = {TRAINING_STEP:g}), over the {len(products)} functional pairs "
          f"({roles}) of {len(pairs)}")
    # the scale the weight errors are in: how far one update moves the weights, and fp32 rounding against it
    step_ref = reference[TRAINING_STEP]
    update = [step_ref[n] - before[n] for n in products]
    moved = _ratio(update, [before[n] for n in products])
    rounding_share = _ratio([step_ref[n].float().double() - step_ref[n] for n in products], update)
    rows.append({"update_over_weights": moved, "fp32_rounding_over_update": rounding_share})
    print(f"  one update at s = {TRAINING_STEP:g} moves these W2 by {moved:.2e} of their norm; fp32 rounding of the "
          f"result is {100 * rounding_share:.2f} % of the update")
    for precision in ("fp32", "tf32", "bf16"):
        emulate = precision == "tf32" and args.device != "cuda"
        got = updated(model, 1.0, precision, emulate)
        ref = reference[1.0]
        product_error = _ratio([got[n].double() - ref[n] for n in products], [ref[n] - before[n] for n in products])
        got = updated(model, TRAINING_STEP, precision, emulate)
        ref = reference[TRAINING_STEP]
        rounding = [ref[n].float().double() - ref[n] for n in products]
        weight_error = _ratio([got[n].double() - ref[n] for n in products], rounding)
        rows.append({"precision": precision, "emulated": emulate, "pairs": products, "product_error": product_error,
                     "weight_error_over_fp32_rounding": weight_error})
        label = precision + (" (emulated)" if emulate else "")
        print(f"  {label:16s} product error {product_error:.2e}  "
              f"weight error {weight_error:.3f} x fp32 rounding")
    # the fp32 weight error is that of the commit (W2.addmm_(P, W1^T, alpha=-s)) as much as the products': shown apart
    print("the fp32 commit W2.addmm_(P, W1^T, alpha=-s) against W2 - P W1^T computed apart, weight error / fp32 "
          "rounding by the product's inner dimension (a 768 x 768 W2, a product 1e-6 of it):")
    for inner in (64, 192, 193, 256, 768, 3072):
        fused, apart = commit_rounding(inner, args.device)
        rows.append({"commit_inner_dim": inner, "fused": fused, "apart": apart})
        print(f"  inner {inner:<10d} addmm_ {fused:.3f}  apart {apart:.3f}")
    print(f"entries of the decayed matrices one update at s = {TRAINING_STEP:g} changes, by storage dtype:")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        share = changed_share(model, dtype, TRAINING_STEP)
        rows.append({"storage": str(dtype).replace("torch.", ""), "changed_share": share})
        print(f"  {rows[-1]['storage']:16s} {100 * share:.2f} %")
    return rows


if __name__ == "__main__":
    main()
