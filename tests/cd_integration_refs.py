"""The float64 reference of (task step + CD) for the framework integration tests, in a plain loop outside any
framework, and the wrong placements of CD that the tests must tell apart from the right one.

The reference replays the micro-batches that the framework fed (recorded by the test), with the same
optimizer and lr schedule on a copy of the initial weights, and applies the paper's update (Sec. 3.3,
App. A.2) written out here, independently of cd/: after backward and clipping, before the optimizer step, once
per update, with the lr of W2's param group, and not on a step that AMP skips.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from cd_models import ref_w2

# The wrong placements (each a plausible integration bug); "paper" is the right one.
VARIANTS = ("paper", "before_backward", "per_micro_batch", "after_step", "on_skipped_step", "first_group_lr")


@dataclass(frozen=True)
class RefPair:
    """A pair by parameter names: W2 and W1 ('diag': W1 = diag(w1)), W1's rows, and whether the matrices are
    stored (in, out) (transformers' Conv1D)."""

    w2: str
    w1: str
    diag: bool
    rows: Optional[tuple[int, int]] = None
    transposed: bool = False


def vit_pairs(blocks: Sequence[str], dim: int) -> list[RefPair]:
    """The pairs of timm-named pre-norm blocks (`blocks.N`: norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2)."""
    out = []
    for b in blocks:
        out += [RefPair(f"{b}.attn.qkv.weight", f"{b}.norm1.weight", True),
                RefPair(f"{b}.attn.proj.weight", f"{b}.attn.qkv.weight", False, (2 * dim, 3 * dim)),
                RefPair(f"{b}.mlp.fc1.weight", f"{b}.norm2.weight", True),
                RefPair(f"{b}.mlp.fc2.weight", f"{b}.mlp.fc1.weight", False)]
    return out


def gpt2_hf_pairs(layers: int, dim: int) -> list[RefPair]:
    """The pairs of transformers' GPT2LMHeadModel (Conv1D weights stored (in, out))."""
    out = []
    for i in range(layers):
        b = f"transformer.h.{i}"
        out += [RefPair(f"{b}.attn.c_attn.weight", f"{b}.ln_1.weight", True, transposed=True),
                RefPair(f"{b}.attn.c_proj.weight", f"{b}.attn.c_attn.weight", False, (2 * dim, 3 * dim), True),
                RefPair(f"{b}.mlp.c_fc.weight", f"{b}.ln_2.weight", True, transposed=True),
                RefPair(f"{b}.mlp.c_proj.weight", f"{b}.mlp.c_fc.weight", False, transposed=True)]
    return out


def vit_optimizer_and_schedule(net: nn.Module, steps: int):
    """AdamW with a timm ViT's qkv/fc1 matrices in a group of their own lr, and a linear decay of both lrs over
    twice `steps`: a CD that read another group's lr, or the lr after the scheduler's step, would be off."""
    own = [p for n, p in net.named_parameters() if n.endswith(("qkv.weight", "fc1.weight"))]
    rest = [p for p in net.parameters() if all(p is not q for q in own)]
    opt = torch.optim.AdamW([{"params": rest, "lr": 2e-2}, {"params": own, "lr": 5e-3}], weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * steps))


def image_loader(n_batches: int, size: int = 2, dtype: torch.dtype = torch.float64) -> torch.utils.data.DataLoader:
    """`n_batches` seeded batches of `size` 32x32 images with labels of 10 classes, in a fixed order."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n_batches * size, 3, 32, 32, generator=g, dtype=dtype)
    y = torch.randint(0, 10, (n_batches * size,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=size, shuffle=False)


def reference_cd_(model: nn.Module, pairs: Sequence[RefPair], lam: float, lr_of: dict[str, float]) -> None:
    """W2 <- W2 - lr * lam * W2 W1n W1n^T for every pair, all from the weights before the call (float64)."""
    params = dict(model.named_parameters())
    new = {}
    for p in pairs:
        w2 = params[p.w2].detach().double()
        w2 = w2.T if p.transposed else w2
        if p.diag:
            w1 = torch.diag(params[p.w1].detach().double())
        else:
            w1 = params[p.w1].detach().double()
            w1 = w1.T if p.transposed else w1
            w1 = w1 if p.rows is None else w1[p.rows[0]:p.rows[1]]
        updated = ref_w2(w2, w1, lr_of[p.w2] * lam)
        new[p.w2] = updated.T if p.transposed else updated
    with torch.no_grad():
        for name, value in new.items():
            params[name].copy_(value)


def reference_run(model: nn.Module, updates: Sequence[Sequence], loss_fn: Callable, optimizer: torch.optim.Optimizer,
                  scheduler, pairs: Sequence[RefPair], lam: float, clip: Optional[float] = None,
                  skipped: Sequence[int] = (), scheduler_steps_on_skip: bool = False,
                  variant: str = "paper") -> list[dict[str, torch.Tensor]]:
    """Train `model` (float64) on `updates` (per optimizer update, its micro-batches) and return its parameters
    after each update.

    loss_fn(model, micro_batch) -> the micro-batch's mean loss; each micro-batch's loss is divided by their
    number, as the frameworks do. `skipped`: updates that AMP skips (their gradients would be inf): no step, no
    CD; the scheduler steps on them only with `scheduler_steps_on_skip`. `variant`: the placement of CD
    (`VARIANTS`; "paper" is the right one).
    """
    assert variant in VARIANTS, variant
    params = dict(model.named_parameters())
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}

    def cd(first_group: bool = False) -> None:
        lrs = {p.w2: (optimizer.param_groups[0] if first_group else group_of[id(params[p.w2])])["lr"] for p in pairs}
        reference_cd_(model, pairs, lam, lrs)

    out = []
    for t, micro in enumerate(updates):
        skip = t in skipped
        if variant == "before_backward" and not skip:
            cd()
        optimizer.zero_grad(set_to_none=True)
        for batch in micro:
            (loss_fn(model, batch) / len(micro)).backward()
            if variant == "per_micro_batch" and not skip:
                cd()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if skip:
            if variant == "on_skipped_step":
                cd()
        else:
            if variant in ("paper", "first_group_lr"):
                cd(first_group=variant == "first_group_lr")
            optimizer.step()
            if variant == "after_step":
                cd()
        if scheduler is not None and (not skip or scheduler_steps_on_skip):
            scheduler.step()
        out.append({n: p.detach().clone() for n, p in params.items()})
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two parameter snapshots (same names)."""
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


def assert_matches_reference(got: Sequence[dict], run: Callable[[str], list[dict]], tol: float,
                             variants: Sequence[str] = VARIANTS) -> None:
    """`got` (the framework's parameters after each update) equals the "paper" reference within `tol` at every
    update, and each wrong variant of `variants` differs from the reference by more than 100 x tol somewhere:
    so an integration with that bug would fail here. run(variant) -> the reference's snapshots."""
    want = run("paper")
    assert len(got) == len(want), (len(got), len(want))
    for t, (g, w) in enumerate(zip(got, want)):
        assert max_diff(g, w) < tol, f"update {t}: differs from the float64 reference by {max_diff(g, w):.3g}"
    for variant in variants:
        if variant == "paper":
            continue
        wrong = run(variant)
        gap = max(max_diff(g, w) for g, w in zip(got, wrong))
        assert gap > 100 * tol, f"the test cannot tell CD {variant!r} from the paper's placement ({gap:.3g})"


class RandomImages(torch.utils.data.Dataset):
    """The framework tests' training data: `n` seeded float64 32x32 images with labels of 10 classes, as the
    dicts MMEngine's models take (`inputs`, `labels`)."""

    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"inputs": self.x[i], "labels": self.y[i]}
