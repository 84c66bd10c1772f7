"""torch's ZeroRedundancyOptimizer with overlap_with_ddp=True steps each rank's shard inside DDP's backward (the
comm hook `hook_with_zero_step`, NCCL only), and its own `step()` returns before stepping: a CD update in that step
would never run (the loop torch documents calls no `step()`), or run on weights the backward has stepped already.
`ColinearityDecay.attach` and the integrations' binding refuse it, naming the fix; ZeRO without overlap is taken
(its multi-process run: tests/test_cd_integration_lightning.py)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from cd import ColinearityDecay
from cd.integrations import bind_optimizers
from cd_models import tiny_vit
from dist_utils import free_port

pytest.importorskip("torch.distributed.optim")
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402


@pytest.fixture
def one_process_group():
    """A gloo group of this process alone (ZeroRedundancyOptimizer needs one), left as it was found."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_zero_optimizer_that_steps_inside_ddps_backward_is_refused_where_cd_is_bound(one_process_group):
    net = tiny_vit()
    zero = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2,
                                   overlap_with_ddp=True)
    with pytest.raises(RuntimeError, match=r"ColinearityDecay.attach: ZeroRedundancyOptimizer\(overlap_with_ddp=True\)"
                                           r".*inside DDP's backward.*overlap_with_ddp=False"):
        ColinearityDecay(net, lam=0.5).attach(zero)
    with pytest.raises(RuntimeError, match=r"cd.integrations: ZeroRedundancyOptimizer\(overlap_with_ddp=True\)"):
        bind_optimizers(ColinearityDecay(net, lam=0.5), [zero])
    plain = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    ColinearityDecay(net, lam=0.5).attach(plain).remove()
