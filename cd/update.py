"""The CD math as pure functions over matrix pairs: the decoupled update, pair energies, loss-form penalty.

For a pair (W1, W2) with W1 of shape (r, i) and W2 of shape (o, r), the normalized objective is
(paper App. A.2 ("Normalized CD"), Eqs. (22)-(23); r is the paper's d_out(W1), W1's output width, which is
its row count in torch's (out x in) layout)

    l(W1, W2) = ||W2 W1n||_F^2,     W1n = W1 / (||W1||_F / sqrt(r)),

and the decoupled update of W2 (Sec. 3.3, Eq. (12) with App. A.2, Eq. (24), factor 2 absorbed) is

    W2 <- W2 - s * W2 W1n W1n^T,    s = lr * lam.

For a composable pair W1 = diag(g), so W1n W1n^T = diag(g^2 / mean(g^2)): the columns of W2 are scaled.
Target set C also decays the upstream matrix of functional pairs with the matching gradient of the same
objective, the normalization factor c = sqrt(r)/||W1||_F held constant (see `colinearity_decay_`; the paper
gives only Eq. (10)'s unnormalized dl/dW1 = 2 W2^T W2 W1, so normalizing it so is our reading):

    W1 <- W1 - s * c^2 W2^T W2 W1 = W1 - s * c * W2^T (W2 W1n).

Implementation notes (why the code looks like this):
- All updates of one call are computed from the weights as they were before the call: groups are ordered
  so that no group reads a matrix an earlier group already wrote, and a group's writes are deferred to
  the end otherwise (`build_plan`). Within a group every delta is computed before any write.
- Same-shaped pairs of one role form a group: their norms and step factors are computed together
  (`torch._foreach_norm`, one stacked tensor), and each pair's two products are then made with `torch.mm`
  in a loop over the group, the second accumulated into W2 in place (`addmm_`), so that no stacked copy
  of the weights is made. Math is fp32 for fp32, bf16 and fp16 parameters, its products in the precision
  `matmul_precision` names whatever the caller set (`_products_in`: 'fp32' runs IEEE even where the trainer
  enabled TF32; 'auto' is TF32 on CUDA); float64 parameters stay float64; results are written back in the
  parameter dtype.
- The product is always evaluated as (W2 W1n) W1n^T, two products of o r i multiply-adds each (4 o r i
  flops): W1 is r x i and W2 is o x r, and for the paper's pairs (r = i for V -> proj; r = 4i for fc1 -> fc2)
  it is not more than the other order, W2 (W1n W1n^T), at 2 r^2 (i + o) flops. For fc2 (o = i = D, r = 4D)
  that is 16 D^3 flops against 64 D^3, for proj (o = r = i = D) 4 D^3 either way.
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from .pairs import Pair

try:  # torch built without distributed has no DTensor: nothing can be sharded then
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()

Number = Union[float, Tensor]


def is_sharded(t: Tensor) -> bool:
    """Whether `t` is a DTensor (a parameter of a module that FSDP2's fully_shard wrapped: see `cd.sharded`)."""
    return isinstance(t, DTensor)

# Floor of the normalizer ||W1||_F / sqrt(r) (an RMS): an all-zero W1 gives W1n = 0 and no update.
_NORM_EPS = 1e-12


@dataclass(frozen=True)
class Plan:
    """Pairs grouped for batching, in a write-safe order.

    Attributes:
        groups: lists of pair indices; one group = one role, kind, shapes, dtypes and device.
        defer: per group, True if its writes must wait until every group has been computed
            (a later group reads a matrix this group writes).
    """

    groups: tuple[tuple[int, ...], ...]
    defer: tuple[bool, ...]


def _group_key(p: Pair) -> tuple:
    w1, w2 = p.w1(), p.w2()
    return (p.kind, p.role, tuple(w1.shape), tuple(w2.shape), w1.dtype, w2.dtype, w2.device)


def plan_key(pairs: Sequence[Pair]) -> tuple:
    """What of a cached `build_plan(pairs)`'s grouping can change in place: the devices and dtypes of the pairs'
    matrices (`module.to` keeps the parameter objects). A caller that caches a plan compares this at each use and
    builds the plan again when it changed: a group whose pairs moved to two devices (some blocks moved to another
    GPU after the plan was made) failed inside torch.stack. One attribute read per matrix, no sync."""
    return tuple((p.upstream.device, p.upstream.dtype, p.downstream.device, p.downstream.dtype) for p in pairs)


def build_plan(pairs: Sequence[Pair], upstream: Optional[Sequence[bool]] = None) -> Plan:
    """Group `pairs` by (kind, role, shapes, dtypes, device) and order the groups so that reads
    precede writes. The grouping holds while `plan_key(pairs)` does.

    Args:
        pairs: the pairs to update.
        upstream: per pair, whether its upstream matrix is written too (target set C). Default: none.

    Returns:
        Plan. Functional groups come first (they read qkv V rows and fc1, which composable groups write).
    """
    upstream = list(upstream) if upstream is not None else [False] * len(pairs)
    keyed: dict[tuple, list[int]] = {}
    for i, p in enumerate(pairs):
        keyed.setdefault(_group_key(p), []).append(i)
    groups = sorted(keyed.values(), key=lambda g: (pairs[g[0]].kind != "functional", g[0]))

    def reads(g):
        return {id(pairs[i].upstream) for i in g} | {id(pairs[i].downstream) for i in g}

    def writes(g):
        return {id(pairs[i].downstream) for i in g} | {id(pairs[i].upstream) for i in g if upstream[i]}

    defer = []
    for k, g in enumerate(groups):
        later_reads = set().union(*(reads(h) for h in groups[k + 1:])) if k + 1 < len(groups) else set()
        defer.append(bool(writes(g) & later_reads))
    return Plan(tuple(tuple(g) for g in groups), tuple(defer))


# what to do after materialising a meta model, for the pure functions: to_empty replaces the tensors a pair holds
_FIND_PAIRS_AGAIN = "call find_pairs after that (to_empty replaces the tensors these pairs hold)"


def refuse_meta(pairs: Sequence[Pair], who: str, then: Optional[str] = None) -> None:
    """Refuse pairs whose matrices lie on the `meta` device: they have shapes but no values, so there is nothing to
    update or measure (torch fails inside the update with an error that names neither the model nor the cause), and
    materialising them later (`to_empty`) replaces the tensors the pairs hold. `find_pairs` itself takes a meta model
    (its structure and the meta forward need no values: `python -m cd` lists a model's pairs so). `then` is what
    to do once the weights have values (default: build `who` after that).

    Raises:
        ValueError: naming the first matrix on the meta device and the fix.
    """
    named = [(p.name, p.downstream) for p in pairs] + [(p.upstream_name, p.upstream) for p in pairs]
    on_meta = next((name for name, t in named if t.is_meta), None)
    if on_meta is not None:
        raise ValueError(f"{who}: the model's parameters are on the meta device (no values, e.g. {on_meta}), so "
                         f"there is nothing to update or measure: materialise them first (model.to_empty(device=...), "
                         f"then initialise or load the weights) and {then or f'build {who} after that'}")


def _autocast_off(fn):
    """Run `fn(pairs, ...)` with autocast disabled on the pairs' devices: the CD math stays fp32 (or float64)
    even when called from inside an autocast region (e.g. `ColinearityDecay.apply` in a bf16 loop). Pairs on the
    `meta` device are refused first (`refuse_meta`), naming `fn`: an autocast on `meta` fails with torch's
    "unsupported scalarType", which names neither the cause nor the fix."""
    @functools.wraps(fn)
    def wrapper(pairs, *args, **kwargs):
        refuse_meta(pairs, fn.__name__, _FIND_PAIRS_AGAIN)
        # every device type the pairs lie on: a model split between the CPU and a GPU (an offloaded block) ran one
        # device's products under the caller's autocast
        types = dict.fromkeys(p.w2().device.type for p in pairs) or {"cpu": None}
        with contextlib.ExitStack() as stack:
            for device_type in types:
                stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
            return fn(pairs, *args, **kwargs)
    return wrapper


def align_to_task_loss(penalty: Tensor, task_loss: Tensor) -> Tensor:
    """The paper's "stabilized" scaling of an auxiliary loss: penalty * detach(|task_loss| / penalty).

    Its value equals the task loss's magnitude, its gradient is the penalty's times that constant, non-negative
    factor (used by CD's loss form and TWEO's rescaled variant, which then multiply it by a small coefficient).
    The magnitude, not the signed loss: the paper aligns the term to the task loss's scale, and a negative task loss
    (a Gaussian NLL, a negative ELBO or similarity) would otherwise flip the term into one that raises the penalty.
    A penalty of 0 (every decayed W2 zero, e.g. output projections initialised to zero) has nothing to lower: its
    term and gradient are 0.
    """
    penalty = onto(penalty, task_loss.device)  # a split model's penalty is on its first block's device (`onto`)
    # fp32 at least (an fp16 task loss), float64 for a float64 penalty (exact float64 references)
    detached = penalty.detach()
    ratio = task_loss.detach().abs().to(compute_dtype(penalty)) / detached.clamp_min(torch.finfo(torch.float32).tiny)
    # a penalty of 0 took the floor's ratio, inf in fp32 for |loss| > 4: a NaN term (0 * inf) and NaN gradients
    return penalty * torch.where(detached > 0, ratio, torch.zeros_like(ratio))


def onto(t: Tensor, device: torch.device) -> Tensor:
    """`t` on `device`, for a sum over blocks: a model split over devices (pipeline stages, transformers'
    device_map="auto": block 0 on cuda:0, block 1 on cuda:1) gives each block's norm, energy or penalty on its own
    device, and torch refuses to add 0-dim tensors of two CUDA devices. A 0-dim CPU tensor stays where it is: torch
    takes it into an op on any device as a scalar, with no copy (a CPU lr's, a CPU block's norm)."""
    if t.device == device or (t.dim() == 0 and t.device.type == "cpu"):
        return t
    return t.to(device)


def sum_device(pairs: Sequence[Pair]) -> torch.device:
    """Where the sums over blocks are made (`onto`): the first accelerator among the pairs' W2s, else the first
    pair's (the CPU for none). Not the CPU beside a GPU (a split model's first block offloaded): each GPU block's
    0-dim sum copied to the CPU would wait for the device, where a CPU one enters a GPU op as a scalar."""
    devices = [p.w2().device for p in pairs]
    return next((d for d in devices if d.type != "cpu"), devices[0] if devices else torch.device("cpu"))


def compute_dtype(t: Tensor) -> torch.dtype:
    """fp32 for fp16/bf16/fp32 parameters (float64 stays float64)."""
    return torch.promote_types(t.dtype, torch.float32)


def known_zero(x: Number) -> bool:
    """Whether a step (or lr) is zero as a Python number. A tensor is never known to be zero here: reading its value
    would wait for the device, so a 0-dim tensor step of 0 runs its products and writes zero deltas."""
    return not isinstance(x, Tensor) and x == 0


def _normalized_w1(w1: Tensor) -> tuple[Tensor, Tensor]:
    """W1n = W1 / (||W1||_F / sqrt(r)) per stacked matrix. w1: (n, r, i).

    Returns (W1n, norm (n, 1, 1)) with norm = ||W1||_F / sqrt(r) = sqrt(mean(W1^2) * i), floored at
    _NORM_EPS.
    """
    norm = w1.square().mean(dim=(1, 2), keepdim=True).mul(w1.shape[2]).sqrt().clamp_min(_NORM_EPS)
    return w1 / norm, norm


def _normalized_scale_sq(g: Tensor) -> Tensor:
    """Diagonal of W1n W1n^T for W1 = diag(g): g^2 / mean(g^2). g: (n, m). Returns (n, 1, m)."""
    g2 = g.square()
    return (g2 / g2.mean(dim=1, keepdim=True).clamp_min(_NORM_EPS ** 2)).unsqueeze(1)


PRECISIONS = ("fp32", "tf32", "bf16")


def resolve_precision(precision: str, device: Union[str, torch.device]) -> str:
    """The precision of the products that `precision` ('auto' or one of PRECISIONS) names for matrices on `device`:
    'auto' is 'tf32' on CUDA (the measured choice, cd/README.md) and 'fp32' elsewhere (no TF32 there); the others
    stay as given. `ColinearityDecay` asks at each update, from where its matrices are then."""
    if precision == "auto":
        return "tf32" if torch.device(device).type == "cuda" else "fp32"
    return precision


def check_tf32_device(precision: str, device_type: str, setting: str, where: str, fix: str) -> None:
    """Refuse TF32 products asked for on a device without TF32 (anything but CUDA: CPUs have none, and
    `_products_in` runs them in fp32 there) while the setting, and the config that records it, says tf32. One check
    for `ColinearityDecay`'s first update and train.py's before a run starts; each names its own setting (`setting`,
    e.g. 'cd.matmul_precision'), what is on the device (`where`, e.g. 'the run is') and the fix.

    Raises:
        ValueError: `precision` is 'tf32' and `device_type` is not 'cuda'.
    """
    if precision == "tf32" and device_type != "cuda":
        raise ValueError(f"{setting}=tf32 but {where} on the {device_type}, which has no TF32 (the update would run "
                         f"in fp32): {fix}")


def check_tf32_dtype(precision: str, named: Sequence[tuple[str, Tensor]], setting: str) -> None:
    """Refuse TF32 products asked for on float64 matrices (`named`: name, tensor): TF32 is a mode of fp32 products,
    and `_products_in`'s switch leaves a float64 product in float64 on any device, while the setting says tf32.
    Read before `check_tf32_device`: a float64 model is refused for this cause wherever it is.

    Raises:
        ValueError: `precision` is 'tf32' and a matrix is float64, naming the first and the fix.
    """
    wide = next((name for name, t in named if t.dtype == torch.float64), None)
    if precision == "tf32" and wide is not None:
        raise ValueError(f"{setting}=tf32 but the decayed matrices are float64 (e.g. {wide}), whose products TF32 "
                         f"does not touch (the update would run in float64): pass matmul_precision='auto' or 'fp32' "
                         f"(float64 products for float64 weights), or keep the weights in fp32")


@contextlib.contextmanager
def _products_in(precision: str):
    """Matmul precision of the CD products, whatever the caller set (train.py allows TF32 globally).

    fp32: exact fp32 products (the tests' path). tf32: TF32 tensor cores for fp32 operands on CUDA (a
    no-op elsewhere: CPUs have no TF32). bf16: operands rounded to bf16 in `_product` (any device).
    The caller's setting is restored afterwards in the API the caller used (`_cublas_tf32`).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"cd matmul precision must be one of {PRECISIONS}, got {precision!r}")
    restore = _cublas_tf32(precision == "tf32")
    try:
        yield
    finally:
        restore()


def _cublas_tf32(enabled: bool):
    """Set cuBLAS TF32 for fp32 matmuls; return a function restoring the caller's setting.

    torch >= 2.9 has two APIs for one setting: the legacy `torch.backends.cuda.matmul.allow_tf32` and
    `torch.backends.cuda.matmul.fp32_precision` ('ieee' | 'tf32' | 'none' = inherit). Reading the legacy
    flag raises RuntimeError once a caller has set 'tf32' through the new one, and writing the legacy
    flag turns 'none' into 'ieee'. So the new API is used where it exists, and the restore writes back
    only what reads differently from before: the new API's value first, then the legacy flag only if it
    still reads otherwise (and the new value again after it), so a caller's state reads as it did, through
    whichever API the caller used. A legacy write where the new value alone restores the state is not
    harmless: after torch.set_float32_matmul_precision('medium') it reads 'high' to the global getter, which
    then raises for a mix of the APIs (torch.get_float32_matmul_precision(), which inductor and Lightning call).
    """
    matmul = torch.backends.cuda.matmul
    before = getattr(matmul, "fp32_precision", None)  # None: torch < 2.9, the legacy flag only
    new_api = before is not None

    def read_legacy() -> Optional[bool]:
        try:
            return matmul.allow_tf32
        except RuntimeError:  # the caller set TF32 through the new API
            return None

    legacy = read_legacy()
    if new_api:
        matmul.fp32_precision = "tf32" if enabled else "ieee"
    else:
        matmul.allow_tf32 = enabled

    def restore() -> None:
        if not new_api:
            matmul.allow_tf32 = legacy
            return
        if matmul.fp32_precision != before:
            matmul.fp32_precision = before
        if legacy is not None and read_legacy() != legacy:
            matmul.allow_tf32 = legacy
            if matmul.fp32_precision != before:
                matmul.fp32_precision = before
    return restore


def _working(t: Tensor) -> Tensor:
    """The tensor to compute on: `t` itself when it is fp32/float64 (updated in place), else an fp32 copy."""
    return t if t.dtype == compute_dtype(t) else t.float()


def _commit(target: Tensor, work: Tensor) -> None:
    """Write a working copy back (nothing to do when the work was done in place)."""
    if work is not target:
        target.copy_(work)


def _add_into(target: Tensor, delta: Tensor) -> None:
    """target += delta, computed in at least fp32 and written back in target's dtype."""
    work = _working(target)
    _commit(target, work.add_(delta))


def _fold_steps(steps: Sequence[Number], gate: Optional[Tensor], factor: Tensor) -> list[float]:
    """Split per-pair steps into kernel `alpha`s and a device part folded into `factor` (n, ...) in place.

    Python-float steps become alpha = -s (no tensor is made for them: no host-to-device copy per step);
    0-dim tensor steps (capturable optimizers) and the fused-optimizer gate are multiplied into `factor`
    on the device (no host sync), with alpha = -1.
    """
    alphas = []
    for k, s in enumerate(steps):
        if isinstance(s, Tensor):
            factor[k].mul_(onto(s, factor.device).to(factor.dtype))  # a split model's lr: another device's
            alphas.append(-1.0)
        else:
            alphas.append(-float(s))
    if gate is not None:
        factor.mul_(onto(gate, factor.device).to(factor.dtype))  # GradScaler's verdict, on its own device
    return alphas


def _product(a: Tensor, b: Tensor, precision: str) -> Tensor:
    """a @ b with bf16 operands for precision 'bf16' (fp32 accumulation inside the kernel), else as is."""
    if precision == "bf16":
        return torch.mm(a.bfloat16(), b.bfloat16())
    return torch.mm(a, b)


@torch.no_grad()
@_autocast_off
def colinearity_decay_(
    pairs: Sequence[Pair],
    step_sizes: Sequence[Number],
    upstream_step_sizes: Optional[Sequence[Number]] = None,
    gate: Optional[Tensor] = None,
    plan: Optional[Plan] = None,
    precision: str = "fp32",
    norms: bool = False,
) -> dict[str, Tensor]:
    """Apply one decoupled, normalized CD update to every pair, in place (Sec. 3.3, Eq. (12); App. A.2,
    Eq. (24)).

    Args:
        pairs: matrix pairs (from `find_pairs`).
        step_sizes: per pair, s = lr * lam for W2 (float or 0-dim tensor); 0 skips the pair.
        upstream_step_sizes: per pair, step for the upstream matrix of a functional pair (target set C),
            W1 <- W1 - s1 * c^2 W2^T W2 W1 with c = sqrt(r)/||W1||_F treated as a constant (the gradient of
            the normalized objective w.r.t. W1 at fixed c, factor 2 absorbed). None or 0: W1 untouched.
            Ignored for composable pairs (norm scales are never decayed).
        gate: optional 0-dim tensor multiplying every step on device (0 skips the update without a host
            sync; used for fused optimizers under GradScaler).
        plan: a cached `build_plan(pairs, upstream)`; built here if None.
        precision: of the two products of a functional pair: 'fp32' (exact), 'tf32' (CUDA tensor cores)
            or 'bf16' (see `_products_in`; the error of each against float64 is in cd/README.md).
        norms: also return the update norms (costs a materialised delta per pair, and one more product for a
            pair updated in place: call on log steps); the weights are the same (bitwise) with or without.

    Returns:
        with `norms`, dict role -> 0-dim fp32 tensor: Frobenius norm of the role's whole update (root of
        the summed squared per-block norms), plus '<role>_upstream' for target set C; roles that were
        skipped are absent. Without `norms`, {}. On `sum_device(pairs)` (a split model's blocks' norms
        are moved there, `onto`).

    Raises:
        ValueError: step_sizes (or upstream_step_sizes) has another length than pairs, a matrix is an FSDP2
            shard (a DTensor: see `cd.sharded`), or one is on the meta device (`refuse_meta`: no values to
            update).
    """
    n_pairs = len(pairs)
    if len(step_sizes) != n_pairs:
        raise ValueError(f"step_sizes has {len(step_sizes)} entries for {n_pairs} pairs")
    if upstream_step_sizes is not None and len(upstream_step_sizes) != n_pairs:  # extra ones were ignored unread
        raise ValueError(f"upstream_step_sizes has {len(upstream_step_sizes)} entries for {n_pairs} pairs")
    # DTensor math on FSDP2 shards runs without an error but loses target C's update of the qkv V rows (a row slice
    # of a sharded matrix is a copy): cd.sharded gathers each block's matrices whole and calls this on them
    sharded = next((p for p in pairs if is_sharded(p.downstream) or is_sharded(p.upstream)), None)
    if sharded is not None:
        raise ValueError(f"colinearity_decay_: {sharded.name} is sharded by FSDP2 (a DTensor), and a pair's update "
                         "reads whole matrices that no rank holds; use ColinearityDecay(model, verify=False) or "
                         "cd.sharded.sharded_colinearity_decay_, which gather each block's matrices whole")
    up_steps = list(upstream_step_sizes) if upstream_step_sizes is not None else [0.0] * n_pairs
    if plan is None:
        plan = build_plan(pairs, [not known_zero(s) for s in up_steps])

    sq_norms: dict[str, Tensor] = {}
    out = sum_device(pairs)  # where the norms are summed (`onto`)
    pending: list[tuple[Tensor, Tensor]] = []  # (target, delta) of deferred groups, added at the end

    def record(key: str, delta: Tensor) -> None:
        """Add delta's squared norm to key's (with `norms`)."""
        if norms:
            sq = onto(delta.square().sum(), out)
            sq_norms[key] = sq_norms[key] + sq if key in sq_norms else sq

    def add(key: str, target: Tensor, delta: Tensor, deferred: bool) -> None:
        """target += delta (a materialised delta: deferred groups, bf16 products, target C's upstream), its norm
        recorded."""
        record(key, delta)
        if deferred:
            pending.append((target, delta))
        else:
            _add_into(target, delta)

    with _products_in(precision):
        for group, deferred in zip(plan.groups, plan.defer):
            idx2 = [i for i in group if not known_zero(step_sizes[i])]
            idx1 = [i for i in group if pairs[i].kind == "functional" and not known_zero(up_steps[i])]
            if not idx2 and not idx1:
                continue
            role = pairs[group[0]].role
            if pairs[group[0]].diagonal:
                _composable(pairs, idx2, step_sizes, gate, role, deferred, norms, add, record)
            else:
                _functional(pairs, idx2, idx1, step_sizes, up_steps, gate, role, deferred, norms, precision,
                            add, record)

    for target, delta in pending:
        _add_into(target, delta)
    return {k: v.sqrt() for k, v in sq_norms.items()}


def _composable(pairs, idx, steps, gate, role, deferred, norms, add, record) -> None:
    """W2 <- W2 - s W2 diag(g^2 / mean(g^2)): a per-column scaling, one read and write of W2 per pair. With
    `norms` the delta is made for its norm alone, the update committed as without: the same weights either way."""
    g = torch.stack([pairs[i].w1().detach().to(compute_dtype(pairs[i].w1())) for i in idx])  # (n, m)
    scale = _normalized_scale_sq(g).squeeze(1)  # (n, m)
    alphas = _fold_steps([steps[i] for i in idx], gate, scale)
    for k, i in enumerate(idx):
        target = pairs[i].w2()
        if deferred:
            add(role, target, _working(target) * scale[k] * alphas[k], deferred)
        else:
            if norms:
                record(role, _working(target) * scale[k] * alphas[k])
            work = _working(target)
            _commit(target, work.addcmul_(work, scale[k], value=alphas[k]))  # exact alias: elementwise


def _functional(pairs, idx2, idx1, steps, up_steps, gate, role, deferred, norms, precision, add, record) -> None:
    """W2 <- W2 - s c^2 (W2 W1) W1^T per pair, with c^2 = r / ||W1||_F^2 folded into the small product
    P = W2 W1 (o x i), so that W1 is never normalised into a copy; the second product is accumulated into
    W2 in place (`addmm_`, alpha = -s), which is the products plus one read and one write of W2. With `norms`
    the delta is made for its norm alone (one more product) and the update still committed by `addmm_`: a
    separate delta added rounds differently, and the weights would depend on `norms_every`, a metric setting."""
    idx = sorted(set(idx2) | set(idx1))
    w1s = [_working(pairs[i].w1().detach()) for i in idx]
    r = w1s[0].shape[0]
    sq = torch.stack(torch._foreach_norm(w1s)).square()  # ||W1||_F^2 per pair, in the compute dtype
    c2 = r / sq.clamp_min(r * _NORM_EPS ** 2)  # c^2 = 1 / (||W1||_F / sqrt(r))^2, (n,)
    f2 = c2.clone() if idx1 else c2  # target C needs c^2 twice, with different steps folded in
    alphas2 = _fold_steps([steps[i] if i in idx2 else 0.0 for i in idx], gate, f2)
    if idx1:
        alphas1 = _fold_steps([up_steps[i] if i in idx1 else 0.0 for i in idx], gate, c2)
        f1 = c2
    for k, i in enumerate(idx):
        target2, w1 = pairs[i].w2(), w1s[k]
        work2 = _working(target2)
        p = _product(work2, w1, precision)  # W2 W1, (o, i)
        if i in idx1:  # dl/dW1 at fixed c = 2 c^2 W2^T W2 W1 (factor 2 absorbed), from the pre-step W2
            d1 = _product(work2.t(), p, precision).mul_(f1[k].to(p.dtype)).to(work2.dtype).mul_(alphas1[k])
        if i in idx2:
            p.mul_(f2[k].to(p.dtype))
            if deferred or precision == "bf16":
                delta = _product(p, w1.t(), precision).to(work2.dtype).mul_(alphas2[k])
                add(role, target2, delta, deferred)
            else:
                if norms:  # freed before the addmm_: the peak is that of the delta, as when it was added
                    record(role, _product(p, w1.t(), precision).mul_(alphas2[k]))
                _commit(target2, work2.addmm_(p, w1.t(), alpha=alphas2[k]))
        if i in idx1:
            add(f"{role}_upstream", pairs[i].w1(), d1, deferred)


@torch.no_grad()
@_autocast_off
def pair_energy(pairs: Sequence[Pair], plan: Optional[Plan] = None) -> dict[str, Tensor]:
    """Normalized pair energy ||W2 W1n||_F^2 (Sec. 3.1, Eq. (2) with App. A.2, Eq. (23)), per role.

    A block's energy of a role is that of the stacked matrix its pairs decay: separate q, k, v layers (class
    attention, transformers' ViT) or a gated MLP's W_gate and W_up pair with one norm each, and
    ||[W_Q; W_K; W_V] D||_F^2 = ||W_Q D||_F^2 + ||W_K D||_F^2 + ||W_V D||_F^2, so the pairs sharing a block, role
    and upstream matrix are summed (`energy_units`) and a fused qkv logs the same number as split layers holding
    the same weights.

    Args:
        pairs: matrix pairs.
        plan: optional cached `build_plan(pairs)`.

    Returns:
        dict role -> 0-dim fp32 tensor: the MEAN over the role's blocks of the block's ||W2 W1n||_F^2, summed over
        the pairs of one upstream matrix. On `sum_device(pairs)` (`onto`).

    Raises:
        ValueError: a matrix is on the meta device (`refuse_meta`: no values to measure).
    """
    plan = plan or build_plan(pairs)
    sums: dict[str, Tensor] = {}
    out = sum_device(pairs)  # one device for the sums over blocks (`onto`)
    for group in plan.groups:
        e = onto(_group_energy([pairs[i] for i in group], grad=False, upstream_grad=False).sum(), out)
        role = pairs[group[0]].role
        sums[role] = sums[role] + e if role in sums else e
    units = energy_units(pairs)
    return {role: sums[role] / units[role] for role in sums}


def energy_unit(pair: Pair) -> tuple:
    """(block, role, upstream_name, upstream_rows): the one energy `pair` is a row block of; pairs of one unit (q, k
    and v of one norm; W_gate and W_up) are the row blocks of the one matrix Eq. (2) reads."""
    return pair.block, pair.role, pair.upstream_name, pair.upstream_rows


def energy_units(pairs: Sequence[Pair]) -> dict[str, int]:
    """role -> how many energies `pair_energy` averages: one per (block, role, upstream matrix), `energy_unit`,
    whose pairs (q, k and v of one norm; W_gate and W_up) are the row blocks of the one matrix Eq. (2) reads."""
    units = {energy_unit(p) for p in pairs}
    counts: dict[str, int] = {}
    for _, role, _, _ in units:
        counts[role] = counts.get(role, 0) + 1
    return counts


def _group_energy(group: Sequence[Pair], grad: bool, upstream_grad: bool) -> Tensor:
    """||W2 W1n||_F^2 for same-shaped pairs, (n,) in at least fp32. grad: keep W2 in the graph;
    upstream_grad: W1 too (functional pairs only), with the normalizer held constant."""
    def up(t: Tensor, keep_grad: bool) -> Tensor:
        return (t if keep_grad else t.detach()).to(compute_dtype(t))

    w2 = torch.stack([up(p.w2(), grad) for p in group])
    if group[0].diagonal:
        g = torch.stack([up(p.w1(), False) for p in group])
        return (w2.square() * _normalized_scale_sq(g)).sum(dim=(1, 2))
    w1 = torch.stack([up(p.w1(), grad and upstream_grad) for p in group])
    _, norm = _normalized_w1(w1.detach())
    return torch.bmm(w2, w1 / norm).square().sum(dim=(1, 2))


@_autocast_off
def pair_penalty(
    pairs: Sequence[Pair],
    weights: Sequence[float],
    upstream_grad: bool = False,
    plan: Optional[Plan] = None,
) -> Tensor:
    """Loss-form CD penalty sum_k weights[k] * ||W2_k W1n_k||_F^2 (App. A.2, Eq. (23)), with autograd.

    Gradients reach W2 only (W1 and norm scales detached), so that the loss form differs from the
    decoupled update only in form (the paper does not say what its loss form differentiates: our
    reading). With `upstream_grad` the upstream matrix of functional pairs also
    gets a gradient (target set C); the normalizer ||W1||_F / sqrt(r) is detached in every case.
    Computed in fp32 with autocast disabled.

    Args:
        pairs: matrix pairs.
        weights: per pair, a non-negative weight (0 leaves the pair out).
        upstream_grad: also differentiate w.r.t. W1 of functional pairs.
        plan: optional cached `build_plan(pairs)`.

    Returns:
        0-dim fp32 tensor on `sum_device(pairs)` (`onto`; zero without a graph if every weight is 0).

    Raises:
        ValueError: no pairs (a penalty of none has no device or dtype, and a loss form without one trains
            without CD); weights has another length than pairs, or one that is negative or not finite; a matrix is
            on the meta device (`refuse_meta`: no values to differentiate).
    """
    if not pairs:  # the zero's device and dtype are the first pair's: an IndexError from its end
        raise ValueError("pair_penalty: no pairs, so there is no penalty to add (a loss form of none trains without "
                         "CD); pass find_pairs(model)'s pairs, or a selection of them that keeps at least one")
    if len(weights) != len(pairs):  # a shorter list failed mid-sum, a longer one's extra weights went unread
        raise ValueError(f"weights has {len(weights)} entries for {len(pairs)} pairs")
    # a negative weight made the penalty one that grows the energy it penalises, and a negative total was aligned to
    # the task loss through its floor (`align_to_task_loss`): a term ~1e38 times the loss; a NaN made it NaN
    bad = next((k for k, w in enumerate(weights) if not (math.isfinite(float(w)) and float(w) >= 0)), None)
    if bad is not None:
        raise ValueError(f"pair_penalty: weights[{bad}] = {weights[bad]!r} (pair {pairs[bad].name}); every weight "
                         f"must be a finite number >= 0 (0 leaves the pair out)")
    plan = plan or build_plan(pairs)
    total: Optional[Tensor] = None
    device = sum_device(pairs)
    for group in plan.groups:
        idx = [i for i in group if weights[i] != 0]
        if not idx:
            continue
        e = _group_energy([pairs[i] for i in idx], grad=True, upstream_grad=upstream_grad)
        # the weights as fills on the device: torch.tensor(..., device=cuda) is a blocking copy, which made every
        # forward of a loss-mode run wait for the GPU once per group
        values = [float(weights[i]) for i in idx]
        w = (e.new_full((len(idx),), values[0], dtype=torch.float32) if len(set(values)) == 1
             else torch.stack([e.new_full((), v, dtype=torch.float32) for v in values]))
        term = onto((e * w).sum(), device)  # one device for the sum over blocks (`onto`)
        total = term if total is None else total + term
    return total if total is not None else torch.zeros((), dtype=compute_dtype(pairs[0].w2()), device=device)
