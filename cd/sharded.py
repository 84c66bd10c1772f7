"""CD on parameters sharded by FSDP2 (`fully_shard`, which makes each parameter a DTensor sharded on dim 0).

A pair's update reads whole matrices (W2 W1n W1n^T, Sec. 3.3, Eq. (12)), which no rank holds. So, one block at a
time, every rank gathers the block's pair matrices whole (`full_tensor()`, the all-gather FSDP2 makes for each
forward anyway), runs the unsharded update (`cd.update`) on them, and writes its own shard of each updated matrix
back. All ranks then hold exactly the update of one unsharded process; the peak extra memory is one block's
matrices. Why not DTensor math on the shards: a row slice of a sharded matrix (the V rows of a fused qkv, written
by target C) is a copy, not a view, so an in-place update to it is lost without an error (measured, torch 2.14).

Every rank must call these in the same order (they are collectives): the optimizer-step hook does.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from .pairs import Pair
from .update import Plan, build_plan, colinearity_decay_, energy_units, is_sharded, onto, pair_energy


def register_shards(model: nn.Module) -> None:
    """Make every FSDP2 unit of `model` hold its shards (`FSDPModule.reshard()`, a no-op on a unit that does). Why:
    a unit holds its whole parameters from a forward until its reshard, the root's until the next backward (after
    an evaluation, too); pairs found then would hold tensors FSDP2 frees at that reshard, and an update of them
    (`ColinearityDecay.apply`) would be lost without an error. Local, no communication; the next forward gathers
    the whole parameters again."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # an older torch, or one built without distributed: nothing to reshard
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def any_sharded(pairs: Sequence[Pair]) -> bool:
    return any(is_sharded(p.downstream) or is_sharded(p.upstream) for p in pairs)


def block_plans(pairs: Sequence[Pair], upstream: Optional[Sequence[bool]] = None) -> list[tuple[list[int], Plan]]:
    """(pair indices, plan) per block, in model order. No matrix is in two blocks' pairs (`refuse_shared`; a W1
    is its own block's), so updating block by block reads the weights of before the update, as one call does."""
    upstream = list(upstream) if upstream is not None else [False] * len(pairs)
    blocks: dict[str, list[int]] = {}
    for i, p in enumerate(pairs):
        blocks.setdefault(p.block, []).append(i)
    return [(idx, build_plan([pairs[i] for i in idx], [upstream[i] for i in idx])) for idx in blocks.values()]


def _gathered(pairs: Sequence[Pair]) -> tuple[list[Pair], dict[int, tuple[Tensor, Tensor]]]:
    """The pairs on whole (plain) tensors, and id(sharded tensor) -> (it, its whole value)."""
    whole: dict[int, tuple[Tensor, Tensor]] = {}

    def full(t: Tensor) -> Tensor:
        if not is_sharded(t):
            return t
        if id(t) not in whole:
            whole[id(t)] = (t, t.full_tensor())
        return whole[id(t)][1]

    return [dataclasses.replace(p, upstream=full(p.upstream), downstream=full(p.downstream)) for p in pairs], whole


def _write_back(target: Tensor, value: Tensor) -> None:
    """Copy this rank's shard of the whole `value` into the sharded `target` (a local slice, no communication)."""
    from torch.distributed.tensor import DTensor, Replicate  # present: `target` is a DTensor

    mesh = target.device_mesh
    mine = DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(
        mesh, target.placements)
    target.to_local().copy_(mine.to_local())  # to_local() under no_grad is the parameter's own storage


@torch.no_grad()
def sharded_colinearity_decay_(pairs: Sequence[Pair], steps: Sequence, up_steps: Sequence,
                               plans: list[tuple[list[int], Plan]], gate: Optional[Tensor] = None,
                               precision: str = "fp32", norms: bool = False) -> dict[str, Tensor]:
    """`colinearity_decay_` for pairs whose matrices may be sharded: block by block on gathered whole matrices.
    Returns the same update norms (root of the summed squares over blocks)."""
    squares: dict[str, Tensor] = {}
    for idx, plan in plans:
        s2, s1 = [steps[i] for i in idx], [up_steps[i] for i in idx]
        if all(not isinstance(s, Tensor) and s == 0 for s in (*s2, *s1)):
            continue  # every rank skips the same blocks (the steps are the same everywhere)
        whole_pairs, whole = _gathered([pairs[i] for i in idx])
        result = colinearity_decay_(whole_pairs, s2, s1, gate=gate, plan=plan, precision=precision, norms=norms)
        written = {id(pairs[i].downstream) for i in idx}
        written |= {id(pairs[i].upstream) for k, i in enumerate(idx) if isinstance(s1[k], Tensor) or s1[k] != 0}
        for key in written & whole.keys():
            _write_back(*whole[key])
        for role, norm in result.items():  # summed on the first block's device (a split model's, `onto`)
            sq = norm.square() if role not in squares else onto(norm.square(), squares[role].device)
            squares[role] = squares[role] + sq if role in squares else sq
    return {role: sq.sqrt() for role, sq in squares.items()}


@torch.no_grad()  # a diagnostic: the gathers would otherwise record a graph nobody uses
def sharded_pair_energy(pairs: Sequence[Pair], plans: list[tuple[list[int], Plan]]) -> dict[str, Tensor]:
    """`pair_energy` (mean over each role's blocks, `energy_units`) of pairs whose matrices may be sharded, block by
    block."""
    sums: dict[str, Tensor] = {}
    counts: dict[str, int] = {}
    for idx, plan in plans:
        block = [pairs[i] for i in idx]
        units = energy_units(block)
        for role, mean in pair_energy(_gathered(block)[0], plan).items():
            n = units[role]  # summed on the first block's device (a split model's, `onto`)
            sums[role] = sums[role] + onto(mean * n, sums[role].device) if role in sums else mean * n
            counts[role] = counts.get(role, 0) + n
    return {role: sums[role] / counts[role] for role in sums}
