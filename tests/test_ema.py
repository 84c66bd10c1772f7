"""train.ema: every parameter of the EMA moves once per update, by the closed form ema <- d * ema + (1 - d) * w,
also the tied token embedding / LM head of GPT (timm's default walk of the state dict averaged it twice)."""
from __future__ import annotations

import pytest
import torch

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
