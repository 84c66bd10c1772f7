"""CD under FSDP: 2 gloo processes on CPU against one unsharded process on the same weights, lr and data.

FSDP2 (`fully_shard`, DTensor parameters sharded on dim 0, or on dim 1 by a shard_placement_fn): the CD update, its
update norms and the pair energies must be those of the unsharded model (the reference run here, without any wrapper),
also for target C (which writes the V rows of the fused qkv), for widths that do not split evenly over the ranks and
for a model whose pairs are partly sharded (parameters fully_shard ignores, held whole on every rank), and for bf16
products behind a fused optimizer's overflow gate (GradScaler's found_inf: a skipped step applies no CD). A submodule
of an FSDP2 model is no FSDP1 module; the functional `colinearity_decay_` refuses shards (DTensor math on them loses
target C's V rows without an error). FSDP1 (FullyShardedDataParallel) must be refused when CD is bound, with the way
out, never a silent no-op. A baseline (no CD) sharded by FSDP2 logs, through `pair_energy_source`, the pair energies of
the same baseline trained unsharded, on every rank. After an evaluation forward (FSDP2 holds the root unit's whole
parameters until the next backward) CD built then updates the shards and a source reads, not refuses; CD built before
it reshards the root's unit and updates (by apply() or in the step), and CD given a submodule, which cannot reshard the
root, refuses with that cause and fix (not "build after fully_shard").
"""
from __future__ import annotations

import math

import pytest
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F

import warnings

from cd import ColinearityDecay, UnsupportedModelError, find_pairs, pair_energy_source
from cd.integrations import bind_optimizers
from cd.decay import energy_metrics
from cd.sharded import block_plans
from cd.update import build_plan, colinearity_decay_
from cd_models import randomize_norms, tiny_vit
from dist_utils import free_port, init_gloo, leave_and_exit, spawn_ranks

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("no public fully_shard in this torch", allow_module_level=True)

STEPS = 2
OVERFLOW = (1.0, 0.0)  # the gated case's found_inf per step: the first step overflows, the second runs


def _odd_vit() -> torch.nn.Module:
    """Width 21 (qkv 63 rows, fc1 84, proj and fc2 21): the rows of most matrices split unevenly over 2 ranks."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=21, depth=2,
                              num_heads=3, num_classes=10)
    return randomize_norms(model, 0)


def _train(model: torch.nn.Module, decay: ColinearityDecay, split: bool, overflow: tuple = ()) -> dict[str, float]:
    """STEPS SGD steps with CD attached, the same batches on every rank (FSDP's mean gradient is then the
    single-process one); returns the CD metrics after them. `split`: the integrations' binding over two optimizers,
    fc2 in the second (the fc1 -> fc2 pairs are split between them: `SharedUpdate` keeps a copy of fc1).
    `overflow`: per step, the `found_inf` GradScaler hands a fused optimizer for the step (1.0: an overflow, the
    optimizer and CD's device gate skip it; 0.0: both run), with fused AdamW for SGD (DTensor has no fused SGD)."""
    named = list(model.named_parameters())

    def optimizer(params, lr: float) -> torch.optim.Optimizer:
        if overflow:
            return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
        return torch.optim.SGD(params, lr=lr)

    if split:
        opts = [optimizer([p for n, p in named if "fc2" not in n], 0.1),
                optimizer([p for n, p in named if "fc2" in n], 0.05)]
        bindings = bind_optimizers(decay, opts).values()
    else:
        opts, bindings = [optimizer(model.parameters(), 0.1)], []
        decay.attach(opts[0])
    gen = torch.Generator().manual_seed(5)
    for step in range(STEPS):
        x, y = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen)
        F.cross_entropy(model(x), y).backward()
        for binding in bindings:  # the framework's event: a real update comes
            binding.arm()
        for opt in opts:
            if overflow:  # as GradScaler.step sets it on an optimizer that supports AMP scaling
                opt.found_inf = torch.tensor(overflow[step])
            opt.step()
            opt.zero_grad()
        for binding in bindings:
            binding.disarm()
    return decay.metrics()


def _shard(model: torch.nn.Module, mixed: bool = False, dim1: bool = False, norms: bool = False) -> None:
    """fully_shard each block, then the model. `mixed`: block 0's qkv and fc1 and all of block 1 are ignored
    (plain parameters on every rank), so block 0's pairs are half sharded and block 1's not at all. `dim1`: the
    blocks' matrices sharded on their columns (Shard(1)) instead of their rows (FSDP2 needs the columns to split
    evenly: the width-32 ViT). `norms`: every Linear is ignored, so only upstream matrices (the norm scales) are
    sharded."""
    ignored = {model.blocks[0].attn.qkv.weight, model.blocks[0].mlp.fc1.weight, *model.blocks[1].parameters()}
    if norms:
        linears = {p for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()}
        fsdp.fully_shard(model, ignored_params=linears)
        return
    from torch.distributed.tensor import Shard

    columns = dict(shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else Shard(0)) if dim1 else {}
    for block in model.blocks:
        if not mixed:
            fsdp.fully_shard(block, **columns)
    fsdp.fully_shard(model, ignored_params=ignored if mixed else None)


def _fsdp2_case(build, targets: str, split: bool = False, mixed: bool = False, dim1: bool = False,
                norms: bool = False, precision: str = "fp32", overflow: tuple = ()) -> dict:
    settings = dict(lam=0.5, targets=targets, matmul_precision=precision)
    reference = build()
    ref_metrics = _train(reference, ColinearityDecay(reference, **settings), split, overflow)
    model = build()
    _shard(model, mixed, dim1, norms)
    metrics = _train(model, ColinearityDecay(model, verify=False, **settings), split, overflow)
    weights = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in model.named_parameters()}
    try:
        ColinearityDecay(model, lam=0.5, mode="loss", verify=False)
        loss_mode = "bound"
    except ValueError as e:
        loss_mode = str(e)
    diff = max((weights[n] - q).abs().max().item() for n, q in reference.named_parameters())
    return {"loss_mode": loss_mode, "weight_diff": diff, "metrics": metrics, "ref_metrics": ref_metrics}


def _baseline_energies(build, mixed: bool = False, dim1: bool = False) -> dict:
    """A baseline (no CD) trained STEPS SGD steps sharded: `pair_energy_source` against `energy_metrics` of the same
    baseline trained unsharded (the reference), on every rank (all-gathered); and what the source does when
    `verify` is left on (the pair check cannot run on a sharded model)."""
    def train(model: torch.nn.Module) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(5)
        for _ in range(STEPS):
            x, y = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    reference = build()
    train(reference)
    model = build()
    _shard(model, mixed, dim1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unverified = pair_energy_source(model)()
    source = pair_energy_source(model, verify=False)  # built after fully_shard, read after the steps
    train(model)
    energies = [None] * dist.get_world_size()
    dist.all_gather_object(energies, source())
    return {"energies": energies, "ref": energy_metrics(find_pairs(reference)), "unverified": unverified,
            "warnings": [str(w.message) for w in caught]}


def _energies_after_an_evaluation() -> dict:
    """A baseline sharded by one fully_shard of the whole model (its matrices in the root's unit, which FSDP2 leaves
    gathered after a forward) read after an evaluation forward, against the same baseline trained unsharded."""
    def train(model: torch.nn.Module) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(5)), torch.arange(4)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    reference = tiny_vit()
    train(reference)
    model = tiny_vit()
    fsdp.fully_shard(model)
    source = pair_energy_source(model, verify=False)
    train(model)
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    try:
        energies = source()
    except ValueError as e:
        energies = str(e)
    return {"energies": energies, "ref": energy_metrics(find_pairs(reference))}


def _decay_built_after_an_evaluation() -> float:
    """CD built after an evaluation forward of a model sharded by one fully_shard (the root unit, which FSDP2 leaves
    gathered until the next backward), one apply(), then a training step: the weights against the same on an
    unsharded model."""
    def run(model: torch.nn.Module, sharded: bool) -> dict:
        if sharded:
            fsdp.fully_shard(model)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            model(torch.randn(2, 3, 32, 32, generator=gen))
        ColinearityDecay(model, lam=0.5, verify=not sharded).apply(0.1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        F.cross_entropy(model(torch.randn(4, 3, 32, 32, generator=gen)), torch.arange(4)).backward()
        opt.step()
        return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in model.named_parameters()}

    reference, weights = run(tiny_vit(), False), run(tiny_vit(), True)
    return max((weights[n] - q).abs().max().item() for n, q in reference.items())


def _decay_updated_after_an_evaluation(attached: bool):
    """CD built after fully_shard of the whole model (one unit, the root), then a training forward and backward, an
    evaluation forward (FSDP2 holds the root's whole parameters until the next backward) and the CD update: by
    apply() then a plain step, or (`attached`) in the step itself. The weights against the same on an unsharded
    model, or the refusal's message."""
    def run(model: torch.nn.Module, sharded: bool):
        if sharded:
            fsdp.fully_shard(model)
        decay = ColinearityDecay(model, lam=0.5, verify=not sharded)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if attached:
            decay.attach(opt)
        gen = torch.Generator().manual_seed(5)
        F.cross_entropy(model(torch.randn(4, 3, 32, 32, generator=gen)), torch.arange(4)).backward()
        with torch.no_grad():
            model(torch.randn(2, 3, 32, 32, generator=gen))
        if not attached:
            decay.apply(0.1)
        opt.step()
        with torch.no_grad():  # the next forward computes with the updated weights
            out = model(torch.randn(2, 3, 32, 32, generator=gen))
        return out, {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                     for n, p in model.named_parameters()}

    (ref_out, reference) = run(tiny_vit(), False)
    try:
        out, weights = run(tiny_vit(), True)
    except ValueError as e:
        return str(e)
    return max([(out - ref_out).abs().max().item()]
               + [(weights[n] - q).abs().max().item() for n, q in reference.items()])


def _submodule_decay_after_an_evaluation() -> dict:
    """CD given the blocks of a model whose one fully_shard unit is the root: after an evaluation forward the blocks
    hold the root's whole parameters, which CD cannot reshard (no FSDP2 module among the blocks): the refusal, then
    apply() once the root is resharded as it says."""
    model = tiny_vit()
    fsdp.fully_shard(model)
    decay = ColinearityDecay(model.blocks, lam=0.5, verify=False)
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    try:
        decay.apply(0.1)
        message = "applied"
    except ValueError as e:
        message = str(e)
    model.reshard()
    decay.apply(0.1)
    return {"message": message, "after reshard": "applied"}


def _source_made_before_sharding() -> str:
    """A baseline's energy source made before fully_shard (which replaces the parameters) and read after a step."""
    model = tiny_vit()
    source = pair_energy_source(model)
    _shard(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)  # the step: changes the shards, not the tensors the source was made on
    try:
        return f"logged {source()}"
    except ValueError as e:
        return str(e)


def _fsdp1_refusal(use_orig_params: bool, inner: bool) -> str:
    """Bind CD to the wrapper, or (`inner`) to the model inside it, as a trainer's callback may be given."""
    model = tiny_vit()
    wrapped = fsdp.FullyShardedDataParallel(model, use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    try:
        ColinearityDecay(model if inner else wrapped, lam=0.5)
    except UnsupportedModelError as e:
        return str(e)
    return "bound"


def _submodule_pairs() -> str:
    """The pairs of `model.blocks` when only the model is fully_shard-ed: the blocks hold DTensors and FSDP's marks
    but no FSDP module (a trainer's callback may be given such an inner model): FSDP2, not refused as FSDP1."""
    model = tiny_vit()
    fsdp.fully_shard(model)
    try:
        return f"{len(find_pairs(model.blocks, verify=False))} pairs"
    except UnsupportedModelError as e:
        return str(e)


def _functional_on_shards() -> str:
    model = tiny_vit()
    _shard(model)
    pairs = [p for p in find_pairs(model, verify=False) if p.kind == "functional"]
    try:
        colinearity_decay_(pairs, [0.5] * len(pairs), [0.5] * len(pairs))
    except ValueError as e:
        return str(e)
    return "ran"


def _worker(rank: int, world: int, port: int, out_path: str) -> None:
    init_gloo(rank, world, port, timeout_s=120)
    try:
        result = {f"fsdp2 {name} {targets}": _fsdp2_case(build, targets)
                  for name, build in (("vit", tiny_vit), ("odd", _odd_vit)) for targets in ("A+B", "C")}
        result["fsdp2 vit C two optimizers"] = _fsdp2_case(tiny_vit, "C", split=True)
        result["fsdp2 vit C mixed"] = _fsdp2_case(tiny_vit, "C", mixed=True)
        result["fsdp2 vit C columns"] = _fsdp2_case(tiny_vit, "C", dim1=True)
        result["fsdp2 vit C norms only"] = _fsdp2_case(tiny_vit, "C", norms=True)
        result["fsdp2 vit C bf16 gated"] = _fsdp2_case(tiny_vit, "C", precision="bf16", overflow=OVERFLOW)
        result.update({f"energy source {name}": _baseline_energies(build, **kw) for name, build, kw in (
            ("vit", tiny_vit, {}), ("odd", _odd_vit, {}), ("mixed", tiny_vit, {"mixed": True}),
            ("columns", tiny_vit, {"dim1": True}))})
        result["energy source before fully_shard"] = _source_made_before_sharding()
        result["energy source after an evaluation"] = _energies_after_an_evaluation()
        result["fsdp2 decay built after an evaluation"] = _decay_built_after_an_evaluation()
        result.update({f"fsdp2 decay {how} after an evaluation": _decay_updated_after_an_evaluation(how == "attached")
                       for how in ("applied", "attached")})
        result["fsdp2 submodule decay after an evaluation"] = _submodule_decay_after_an_evaluation()
        result["fsdp2 submodule"] = _submodule_pairs()
        result["functional on shards"] = _functional_on_shards()
        result.update({f"fsdp1 use_orig_params={orig} inner={inner}": _fsdp1_refusal(orig, inner)
                       for orig in (True, False) for inner in (False, True)})
        if rank == 0:
            torch.save(result, out_path)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_and_exit()


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp") / "result.pt")
    spawn_ranks(_worker, (2, free_port(), out), 2)
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp2 vit A+B", "fsdp2 vit C", "fsdp2 odd A+B", "fsdp2 odd C",
                                  "fsdp2 vit C two optimizers", "fsdp2 vit C mixed", "fsdp2 vit C columns",
                                  "fsdp2 vit C norms only", "fsdp2 vit C bf16 gated"])
def test_fsdp2_cd_matches_one_unsharded_process(fsdp_runs, case):
    run = fsdp_runs[case]
    # the same kernels on the same whole matrices (measured: bit-identical weights on torch 2.14, gloo; the
    # metrics sum the blocks in another order, within 2e-8)
    assert run["weight_diff"] <= 1e-6
    assert run["metrics"].keys() == run["ref_metrics"].keys()
    for key, value in run["ref_metrics"].items():
        assert run["metrics"][key] == pytest.approx(value, rel=1e-5), key
    assert run["metrics"]["cd/updates"] == STEPS - (OVERFLOW.count(1.0) if "gated" in case else 0)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["vit", "odd", "mixed", "columns"])
def test_a_baseline_sharded_by_fsdp2_logs_the_unsharded_pair_energies(fsdp_runs, case):
    run = fsdp_runs[f"energy source {case}"]
    assert set(run["ref"]) == {f"cd/pair_energy/{role}" for role in ("qkv", "proj", "fc1", "fc2")}
    for rank, energies in enumerate(run["energies"]):  # every rank calls the source (a collective), and gets them
        assert energies.keys() == run["ref"].keys(), rank
        for key, value in run["ref"].items():  # the blocks are summed in another order: float rounding only
            assert energies[key] == pytest.approx(value, rel=1e-6), (rank, key)


@pytest.mark.slow
def test_a_sharded_baselines_energy_source_with_the_check_on_says_how_to_turn_it_off(fsdp_runs):
    run = fsdp_runs["energy source vit"]
    assert run["unverified"] == {}  # the pair check cannot run on a sharded model: nothing logged, one warning
    assert len(run["warnings"]) == 1 and "sharded by FSDP2" in run["warnings"][0]
    assert "pass verify=False" in run["warnings"][0] and "\n" not in run["warnings"][0]


@pytest.mark.slow
def test_fsdp2_cd_built_after_an_evaluation_forward_updates_the_shards(fsdp_runs):
    # not the whole parameters FSDP2 held after the forward, which it frees at the reshard (the update lost)
    assert fsdp_runs["fsdp2 decay built after an evaluation"] <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("how", ["applied", "attached"])
def test_fsdp2_cd_updates_the_shards_after_an_evaluation_forward(fsdp_runs, how):
    # not refused as replaced parameters: the root's whole parameters are resharded first, and the update and the
    # step reach the next forward (both also match the unsharded run)
    diff = fsdp_runs[f"fsdp2 decay {how} after an evaluation"]
    assert isinstance(diff, float), diff
    assert diff <= 1e-5


@pytest.mark.slow
def test_cd_on_a_submodule_holding_fsdp2_whole_parameters_says_to_reshard(fsdp_runs):
    run = fsdp_runs["fsdp2 submodule decay after an evaluation"]
    message = run["message"]
    assert message.startswith("ColinearityDecay: the model's parameter 0."), message  # a block's matrix
    assert "is FSDP2's whole (unsharded) parameter for now" in message
    assert "Call reshard() on the fully_shard-ed module" in message and "Build ColinearityDecay after" not in message
    assert "\n" not in message
    assert run["after reshard"] == "applied"


@pytest.mark.slow
def test_a_sharded_baselines_energy_source_reads_after_an_evaluation_forward(fsdp_runs):
    run = fsdp_runs["energy source after an evaluation"]
    assert isinstance(run["energies"], dict), run["energies"]  # not refused as replaced parameters
    assert run["energies"].keys() == run["ref"].keys()
    for key, value in run["ref"].items():
        assert run["energies"][key] == pytest.approx(value, rel=1e-6), key


@pytest.mark.slow
def test_an_energy_source_made_before_fully_shard_is_refused_not_logging_the_replaced_tensors(fsdp_runs):
    message = fsdp_runs["energy source before fully_shard"]
    assert message.startswith("pair_energy_source: the model's parameter blocks.0.attn.qkv.weight (and ")
    assert "Build pair_energy_source after the model's parameters are final (after fully_shard" in message
    assert "\n" not in message


@pytest.mark.slow
def test_fsdp2_loss_mode_is_refused(fsdp_runs):
    message = fsdp_runs["fsdp2 vit A+B"]["loss_mode"]
    assert message.startswith("cd mode 'loss' with a model sharded by FSDP2") and "\n" not in message


@pytest.mark.slow
@pytest.mark.parametrize("orig", [True, False])
@pytest.mark.parametrize("inner", [False, True])
def test_fsdp1_is_refused_when_cd_is_bound(fsdp_runs, orig, inner):
    message = fsdp_runs[f"fsdp1 use_orig_params={orig} inner={inner}"]
    assert message.startswith("CD does not support FSDP1 (FullyShardedDataParallel), which holds ")
    assert "Use FSDP2" in message and "\n" not in message


@pytest.mark.slow
def test_a_submodule_of_an_fsdp2_model_is_not_refused_as_fsdp1(fsdp_runs):
    assert fsdp_runs["fsdp2 submodule"] == f"{len(find_pairs(tiny_vit().blocks, verify=False))} pairs"


@pytest.mark.slow
def test_the_functional_update_refuses_fsdp2_shards(fsdp_runs):
    message = fsdp_runs["functional on shards"]
    assert message.startswith("colinearity_decay_: blocks.0.attn.proj.weight is sharded by FSDP2")
    assert "\n" not in message


def test_block_plans_group_each_blocks_pairs_in_model_order():
    """One block's matrices gathered at a time (the peak memory of `cd.sharded`): each group is exactly one block's
    pairs, in model order, with the plan of those pairs alone (target C's upstream writes included)."""
    pairs = find_pairs(tiny_vit())
    upstream = [p.kind == "functional" for p in pairs]
    plans = block_plans(pairs, upstream)
    blocks = list(dict.fromkeys(p.block for p in pairs))
    assert len(blocks) > 1
    assert [idx for idx, _ in plans] == [[i for i, p in enumerate(pairs) if p.block == b] for b in blocks]
    for idx, plan in plans:
        assert plan == build_plan([pairs[i] for i in idx], [upstream[i] for i in idx])
    # without `upstream`, no upstream matrix is written (build_plan's default): the read-only energies' plans
    for idx, plan in block_plans(pairs):
        assert plan == build_plan([pairs[i] for i in idx])


def test_sharded_pair_energy_is_the_mean_over_each_roles_blocks_when_blocks_hold_unequal_counts():
    """CaiT's class-attention blocks hold three qkv pairs (q, k, v) and its self-attention block one: the block-by-
    block energies (`cd.sharded`, run here on plain tensors, which it takes as they are) are the mean over a role's
    blocks of each block's energy, that of [W_Q; W_K; W_V] for separate layers (the sum of their pairs'), as the
    unsharded `pair_energy` logs it. Reference: ||W2 W1n||_F^2 (Sec. 3.1, Eq. (2); App. A.2, Eq. (23)) written out
    in float64, summed per block and role."""
    from cd.sharded import sharded_pair_energy
    from cd_models import normalized

    torch.manual_seed(0)
    model = randomize_norms(timm.create_model("cait_xxs24_224", img_size=32, patch_size=8, embed_dim=32, depth=1,
                                              num_heads=2, num_classes=3, depth_token_only=2), 0)
    pairs = find_pairs(model)
    assert len({sum(p.role == "qkv" for p in pairs if p.block == b) for b in {p.block for p in pairs}}) > 1
    want: dict[str, dict[str, float]] = {}
    for p in pairs:
        w2 = p.w2().detach().double()
        w1 = torch.diag(p.w1().detach().double()) if p.diagonal else p.w1().detach().double()
        per_block = want.setdefault(p.role, {})
        per_block[p.block] = per_block.get(p.block, 0.0) + (w2 @ normalized(w1)).square().sum().item()
    got = sharded_pair_energy(pairs, block_plans(pairs))
    assert got.keys() == want.keys()
    for role, energies in want.items():
        assert got[role].item() == pytest.approx(sum(energies.values()) / len(energies), rel=1e-5), role


def test_the_block_by_block_energy_sums_a_blocks_pairs_of_one_norm():
    """`sharded_pair_energy` on whole tensors (no process group needed): a SwiGLU block has two fc1 pairs (norm2 ->
    fc1_g, fc1_x), whose energies sum to the block's ||[W_gate; W_up] D||_F^2; the role's energy is the mean of
    those over blocks; by hand in float64."""
    from timm.layers import SwiGLU

    from cd.sharded import sharded_pair_energy
    from cd_models import normalized

    torch.manual_seed(0)
    model = randomize_norms(timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32,
                                              depth=2, num_heads=2, num_classes=10, mlp_layer=SwiGLU,
                                              act_layer=torch.nn.SiLU, mlp_ratio=2.0), 0).double()
    pairs = find_pairs(model, gated_mlp=True)
    got = sharded_pair_energy(pairs, block_plans(pairs))
    P = dict(model.named_parameters())
    want = {}
    for p in pairs:
        w1 = P[p.upstream_name].detach()
        w1 = torch.diag(w1) if w1.dim() == 1 else w1
        if p.role == "proj":  # the V rows of the fused qkv
            w1 = w1[2 * w1.shape[0] // 3:]
        want.setdefault(p.role, []).append(float((P[p.name].detach() @ normalized(w1)).square().sum()))
    assert len(want["fc1"]) == 4  # two pairs per block (fc1_g, fc1_x), in model order: summed per block
    want["fc1"] = [want["fc1"][0] + want["fc1"][1], want["fc1"][2] + want["fc1"][3]]
    for role, values in want.items():
        assert len(values) == 2, role
        assert math.isclose(float(got[role]), sum(values) / len(values), rel_tol=1e-10), role
