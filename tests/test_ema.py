"""train.ema: every parameter and floating buffer of the EMA moves once per update, by the closed form
ema <- d * ema + (1 - d) * w, also the tied token embedding / LM head of GPT (timm's default walk of the state dict
averages it twice); integer buffers are copied, as timm's default does."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from cd_models import tiny_vit
from configs.schema import TrainConfig
from engine.ema import build_ema
from models.gpt import build_gpt


@pytest.mark.parametrize("build", [lambda: build_gpt("gpt2_nano", vocab_size=65), tiny_vit])
def test_each_parameter_moves_once_by_the_closed_form(build):
    model = build().double()
    decay = 0.75
    ema = build_ema(model, TrainConfig(ema=True, ema_decay=decay))
    before = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(1.0 + i)  # another shift per parameter
    ema.update(model, step=100)
    got = dict(ema.module.named_parameters(remove_duplicate=False))
    now = dict(model.named_parameters(remove_duplicate=False))
    assert len(got) == len(before)
    for name, old in before.items():
        want = decay * old + (1 - decay) * now[name]
        assert torch.allclose(got[name], want, rtol=0, atol=1e-12), name
    assert {n: b.dtype for n, b in ema.module.named_buffers()} == {n: b.dtype for n, b in model.named_buffers()}
    assert all(torch.equal(a, b) for a, b in zip(ema.module.buffers(), model.buffers()))


def test_the_gpt_head_is_tied_to_the_token_embedding_in_the_ema_too():
    model = build_gpt("gpt2_nano", vocab_size=65)
    ema = build_ema(model, TrainConfig(ema=True))
    assert ema.module.head.weight is ema.module.wte.weight
    assert build_ema(model, TrainConfig(ema=False)) is None


def test_batchnorm_statistics_are_averaged_and_the_batch_count_copied():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2)).double()
    model(torch.randn(2, 3, 6, 6, dtype=torch.float64))  # materialise the lazy layer before the EMA copies it
    decay = 0.9
    ema = build_ema(model, TrainConfig(ema=True, ema_decay=decay))
    naive = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2, 5):  # step 1 would start the EMA from the raw weights (decay 0)
        model.train()
        model(torch.randn(8, 3, 6, 6, dtype=torch.float64) * 5 + 3).square().mean().backward()
        optimizer.step()
        ema.update(model, step=step)
        for key, now in model.state_dict().items():
            naive[key] = decay * naive[key] + (1 - decay) * now if now.is_floating_point() else now.clone()
    got = ema.module.state_dict()
    assert got["1.num_batches_tracked"].item() == 4
    for key, want in naive.items():
        assert got[key].dtype == want.dtype, key
        assert torch.allclose(got[key], want, rtol=0, atol=1e-12), key


def test_the_update_runs_on_the_oldest_timm_the_requirements_admit(monkeypatch):
    """requirements.txt admits timm 1.0.15, whose ModelEmaV3 has no `_foreach_lerp_` helper (added after 1.0.28):
    the first update of a train.ema=true run must not need it. Closed form as above, one update at decay 0.5."""
    from timm.utils import ModelEmaV3

    monkeypatch.delattr(ModelEmaV3, "_foreach_lerp_", raising=False)
    model = nn.Linear(3, 2).double()
    ema = build_ema(model, TrainConfig(ema=True, ema_decay=0.5))
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(2.0)
    ema.update(model, step=100)
    for got, old, now in zip(ema.module.parameters(), before, model.parameters()):
        assert torch.allclose(got, 0.5 * old + 0.5 * now, rtol=0, atol=1e-12)
