"""An explicit matmul_precision='tf32' is refused where there is no TF32: CPUs have none, so the update's products
would run in fp32 while the setting (and a run's config) says tf32. Refused at the first update, not when CD is built
(a model may be moved to a GPU after that), by ColinearityDecay and so by an OptimizerBinding; the integrations refuse
it earlier, when they bind the framework's optimizers (the model is on its device by then), before any forward;
train.py makes the same check before a run starts, with its own setting's name (tests/test_train.py).

Also the check the GPU tests make of an update asked for in TF32 or bf16 (`assert_update_precision`, here and in
test_gpu.py and test_cd_integrations_tf32_bind.py): its error against float64 is below the precision's ceiling and
not below a tenth of what rounding the products' operands to that precision gives, so an update whose products ran
in fp32 (about 1/100 of TF32's error) fails it; its CPU cases show it refuse fp32 products and take real bf16 ones."""
from __future__ import annotations

import math

import pytest
import timm
import torch
import torch.nn.functional as F

from cd import ColinearityDecay
from cd.integrations import OptimizerBinding, bind_optimizers, check_cd_arguments
from cd_models import VIT_DEPTH, randomize_norms, ref_block_update, snapshot, tiny_vit

# ----------------------------------------------------------------------------------- the precision an update ran in
# the functional pairs, whose update is two matrix products; the composable ones (qkv, fc1: W1 is a norm's diagonal)
# are a column scaling, fp32 whatever the setting, so their error says nothing of the products' precision
PRODUCT_MATRICES = ("attn.proj.weight", "mlp.fc2.weight")
SIGNIFICAND_BITS = {"tf32": 10, "bf16": 7}  # explicit significand bits of the products' operands (fp32: 23)
# the largest relative error of an update against float64 taken for each precision (cd/README.md's measured errors
# are 3.8e-4 for tf32, 4.0e-3 for bf16)
CEILING = {"fp32": 1e-5, "tf32": 5e-3, "bf16": 2e-2}
# a tenth of the error of operands rounded to nearest: cuBLAS's TF32 may read the first 10 bits (truncation, about
# 4x that error, measured on a CPU), never fewer; an fp32 update's error is about 1/100 of TF32's (tiny_vit, 4e-7)
FLOOR_SHARE = 0.1


def vit_b_block(seed: int = 0) -> torch.nn.Module:
    """One ViT block at ViT-B/16's width (embed 768, MLP 3072, 12 heads; 32 px input, 10 classes), norms
    randomized: the GPU's TF32 and bf16 checks run on it. TF32 math mode lets cuBLAS use TF32 tensor cores, it does
    not make it use them: at tiny_vit's 32-wide matrices an exact fp32 kernel may be the fastest and be taken, and no
    update would then show TF32's error; ViT-B's products are the sizes TF32 is for (scripts/bench_overhead.py)."""
    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=768, depth=1,
                              num_heads=12, num_classes=10)
    return randomize_norms(model, seed)


def rounded(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x in float64 with its significand rounded to `bits` explicit bits, to nearest (ties to even): TF32's 10,
    bf16's 7. frexp gives x = m * 2^e with 0.5 <= |m| < 1, so m's bits + 1 significant bits are m * 2^(bits + 1)."""
    m, e = torch.frexp(x.double())
    return torch.ldexp(torch.round(m * 2.0 ** (bits + 1)), e - (bits + 1))


def update_errors(model: torch.nn.Module, before: dict, step: float) -> dict[str, float]:
    """Per decayed matrix, ||delta_got - delta_want||_F / ||delta_want||_F: the update the model's weights moved by
    (from `before`) against ref_block_update's float64 one at `step` = lr * lam."""
    expected: dict = {}
    for i in range(len(model.blocks)):
        ref_block_update(before, f"blocks.{i}", step, expected)
    params = {n: p.detach().double().cpu() for n, p in model.named_parameters()}
    errors = {}
    for name, want in expected.items():
        start = before[name].double().cpu()
        errors[name] = float((params[name] - want).norm() / (want - start).norm())
    return errors


def emulated_errors(before: dict, step: float, bits: int) -> dict[str, float]:
    """update_errors' figure for each matrix of PRODUCT_MATRICES when both products' operands are rounded to `bits`
    significand bits, as CD forms them (P = W2 W1 scaled by c^2 = r / ||W1||_F^2, then P W1^T) and otherwise exact
    (float64): the least error products in that precision give."""
    errors = {}
    for b in sorted({n.split(".")[1] for n in before if n.startswith("blocks.")}):
        qkv = before[f"blocks.{b}.attn.qkv.weight"].double().cpu()
        d = qkv.shape[0] // 3
        upstream = {"attn.proj.weight": qkv[2 * d:], "mlp.fc2.weight": before[f"blocks.{b}.mlp.fc1.weight"]}
        for matrix, w1 in upstream.items():
            w2, w1 = before[f"blocks.{b}.{matrix}"].double().cpu(), w1.double().cpu()
            c2 = w1.shape[0] / w1.square().sum()
            want = -step * (w2 @ w1 * c2) @ w1.T
            got = -step * rounded(rounded(w2, bits) @ rounded(w1, bits) * c2, bits) @ rounded(w1, bits).T
            errors[f"blocks.{b}.{matrix}"] = float((got - want).norm() / want.norm())
    return errors


def assert_update_precision(model: torch.nn.Module, before: dict, step: float, precision: str) -> None:
    """The update from `before` at `step` ran in `precision`: every matrix's error against float64 is below
    CEILING[precision] and, for tf32 and bf16, each product matrix's is at least FLOOR_SHARE of emulated_errors'
    (an update whose products ran in fp32 is not taken for one in TF32 or bf16)."""
    errors = update_errors(model, before, step)
    for name, error in errors.items():
        assert error < CEILING[precision], f"{name}: error {error:.2e} over {precision}'s {CEILING[precision]:.0e}"
    if precision in SIGNIFICAND_BITS:
        bits = SIGNIFICAND_BITS[precision]
        for name, least in emulated_errors(before, step, bits).items():
            assert errors[name] >= FLOOR_SHARE * least, (
                f"{name}: error {errors[name]:.2e} against float64, under {FLOOR_SHARE:g} x the {least:.2e} of "
                f"operands rounded to {precision}'s {bits} bits: its products did not run in {precision} (fp32's?)")


def test_the_precision_check_refuses_an_update_whose_products_ran_in_fp32():
    """The case the bounds alone passed: fp32 products (error ~4e-7) under a tf32 or bf16 setting."""
    model = tiny_vit()
    before = snapshot(model)
    ColinearityDecay(model, lam=0.1, matmul_precision="fp32").apply(lr=0.5)
    assert_update_precision(model, before, 0.05, "fp32")
    for precision in ("tf32", "bf16"):
        with pytest.raises(AssertionError, match=rf"did not run in {precision} \(fp32's\?\)"):
            assert_update_precision(model, before, 0.05, precision)


@pytest.mark.slow
def test_the_precision_check_takes_real_bf16_products_at_vit_b_width():
    """bf16 products run on a CPU too: the floor is below what they give at the GPU tests' sizes (and the model
    there is wide enough for its product matrices to be what the floor is checked on)."""
    model = vit_b_block()
    before = snapshot(model)
    ColinearityDecay(model, lam=0.1, matmul_precision="bf16").apply(lr=0.5)
    assert_update_precision(model, before, 0.05, "bf16")
    least = emulated_errors(before, 0.05, SIGNIFICAND_BITS["bf16"])
    assert set(least) == {"blocks.0.attn.proj.weight", "blocks.0.mlp.fc2.weight"}
    assert all(2.0 ** -10 < e < 2.0 ** -7 for e in least.values())  # about bf16's unit roundoff, 2^-8


def test_rounded_keeps_the_given_significand_bits():
    x = torch.tensor([1 + 2.0 ** -10, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, -(1 + 2.0 ** -12), math.pi, 0.0],
                     dtype=torch.float64)
    want = torch.tensor([1 + 2.0 ** -10, 1.0, 1 + 2.0 ** -9, -1.0, 3.140625, 0.0], dtype=torch.float64)
    assert torch.equal(rounded(x, 10), want)  # ties to even: 1 + 2^-11 down, 1 + 3 * 2^-11 up

REFUSED = (r"^ColinearityDecay: matmul_precision=tf32 but the decayed matrices are on the cpu, which has no TF32 "
           r"\(the update would run in fp32\): pass matmul_precision='fp32', or 'auto'")


def _unchanged(model, before) -> bool:
    return all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_apply_with_tf32_on_a_cpu_model_is_refused_at_the_first_update_and_moves_nothing():
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.1, matmul_precision="tf32")  # built: the model may still move
    before = snapshot(model)
    decay.apply(lr=0.0)  # no update (lr 0): nothing to refuse yet
    with pytest.raises(ValueError, match=REFUSED):
        decay.apply(lr=0.5)
    assert _unchanged(model, before) and decay.num_updates == 0


def test_an_attached_step_with_tf32_on_a_cpu_model_is_refused_before_the_optimizer_moves_anything():
    model = tiny_vit()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ColinearityDecay(model, lam=0.1, matmul_precision="tf32").attach(opt)
    F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2])).backward()
    before = snapshot(model)
    with pytest.raises(ValueError, match=REFUSED):
        opt.step()
    assert _unchanged(model, before)


def test_an_integrations_binding_with_tf32_on_a_cpu_model_is_refused_at_its_step():
    kwargs = check_cd_arguments({"lam": 0.1, "matmul_precision": "tf32"})  # taken when the callback is made
    model = tiny_vit()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    binding = OptimizerBinding(ColinearityDecay(model, **kwargs), opt)
    F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2])).backward()
    binding.arm()  # the framework's event: a real update comes
    before = snapshot(model)
    with pytest.raises(ValueError, match=REFUSED):
        opt.step()
    assert _unchanged(model, before)


@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_fp32_and_auto_on_a_cpu_model_update_as_the_float64_reference(precision):
    # auto is fp32 off CUDA: both run, exact fp32 products against the float64 reference at lr * lam = 0.05
    model = tiny_vit()
    P = snapshot(model)
    ColinearityDecay(model, lam=0.1, matmul_precision=precision).apply(lr=0.5)
    expected: dict = {}
    for i in range(VIT_DEPTH):
        ref_block_update(P, f"blocks.{i}", 0.05, expected)
    for name, want in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].double(), want, rtol=1e-5, atol=1e-6)



@pytest.mark.gpu
def test_a_model_moved_to_cuda_after_cd_is_built_takes_tf32():
    """Built on the CPU, moved with .cuda() (same Parameter objects) before the first update: the products run in
    TF32 there, as asked: the update is within TF32's error of the float64 reference and not within fp32's
    (assert_update_precision, on vit_b_block: matrices cuBLAS multiplies on TF32 tensor cores)."""
    model = vit_b_block()
    before = snapshot(model)
    decay = ColinearityDecay(model, lam=0.1, matmul_precision="tf32")
    model.cuda()
    assert decay.matmul_precision == "tf32"
    decay.apply(lr=0.5)
    assert_update_precision(model, before, 0.05, "tf32")


FLOAT64 = (r"matmul_precision=tf32 but the decayed matrices are float64 \(e\.g\. blocks\.0\.attn\.qkv\.weight\), "
           r"whose products TF32 does not touch \(the update would run in float64\): pass matmul_precision='auto' or "
           r"'fp32' \(float64 products for float64 weights\), or keep the weights in fp32")


def test_tf32_on_float64_weights_is_refused_as_float64_at_the_first_update_and_at_bind():
    """TF32 is a mode of fp32 products: cuBLAS runs a float64 product in float64 whatever the switch, so an explicit
    tf32 on float64 weights ran float64 products on CUDA while the setting said tf32, without a word. Refused for
    that cause (the dtype is read before the device, so the CPU shows it) by apply, an attached step and the
    integrations' bind, before anything moves; auto and fp32 run float64 products, as documented."""
    model = tiny_vit().double()
    before = snapshot(model)
    with pytest.raises(ValueError, match="^ColinearityDecay: " + FLOAT64):
        ColinearityDecay(model, lam=0.1, matmul_precision="tf32").apply(lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = ColinearityDecay(model, lam=0.1, matmul_precision="tf32").attach(opt)
    F.cross_entropy(model(torch.randn(2, 3, 32, 32, dtype=torch.float64)), torch.tensor([1, 2])).backward()
    with pytest.raises(ValueError, match="^ColinearityDecay: " + FLOAT64):
        opt.step()
    handle.remove()
    with pytest.raises(ValueError, match="^cd.integrations: " + FLOAT64):
        bind_optimizers(ColinearityDecay(model, lam=0.1, matmul_precision="tf32"), [opt])
    assert _unchanged(model, before) and not opt._optimizer_step_pre_hooks
