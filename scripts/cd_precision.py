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
products' operands to TF32's 10-bit mantissa before fp32 products, and the output says so. Then, for weights
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
from unittest import mock

import timm
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root, for `cd`
import cd.update  # noqa: E402
from cd import ColinearityDecay, UnsupportedModelError  # noqa: E402
from configs.cli import OneLineParser, first_line  # noqa: E402

TRAINING_STEP = 1e-3 * 0.005  # lr * lam


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest value with TF32's 10 explicit mantissa bits (ties away from zero)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def emulated_tf32(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    return torch.mm(round_to_tf32(a), round_to_tf32(b))


def updated(model: torch.nn.Module, step: float, precision: str, emulate: bool) -> dict[str, torch.Tensor]:
    """The decayed matrices after one CD update (step lr * lam = `step`) of a copy of `model`."""
    model = copy.deepcopy(model)
    # emulated TF32 rounds the operands in `emulated_tf32`, then multiplies in fp32: ColinearityDecay refuses 'tf32'
    # off CUDA (no TF32 there), and its 'fp32' products are the exact fp32 ones the emulation needs
    decay = ColinearityDecay(model, lam=1.0, matmul_precision="fp32" if emulate else precision)
    patch = mock.patch.object(cd.update, "_product", emulated_tf32) if emulate else nullcontext()
    with patch:
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


def main(argv=None) -> list[dict]:
    parser = OneLineParser(description=first_line(__doc__))
    parser.add_argument("--model", default="vit_base_patch16_224")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
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
    print(f"entries of the decayed matrices one update at s = {TRAINING_STEP:g} changes, by storage dtype:")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        share = changed_share(model, dtype, TRAINING_STEP)
        rows.append({"storage": str(dtype).replace("torch.", ""), "changed_share": share})
        print(f"  {rows[-1]['storage']:16s} {100 * share:.2f} %")
    return rows


if __name__ == "__main__":
    main()
