"""BatchNorm running statistics under DDP (engine/running_stats.py): averaged over the ranks before validation, so
that the logged val/* and val_ema/* are the scores of the weights checkpoint.pt and best.pt hold."""
import json
import os

import pytest
import torch
from torch import nn

import train
from configs import load_config
from data.loader import build_eval_loader
from dist_utils import as_torchrun_rank, free_port, init_gloo, leave_and_exit, spawn_ranks
from engine.ema import ModelEma
from engine.loop import evaluate
from engine.running_stats import average_running_stats
from models import build_model, input_size
from tests.conftest import DEBUG_CONFIG


def bn_model() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank, as DDP makes them
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))


def running_stats(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if "running_" in k}


def _averaging_worker(rank, world, port, out_file):
    init_gloo(rank, world, port)
    model = bn_model()
    torch.manual_seed(100 + rank)  # each rank its own batches: its own statistics
    ema = ModelEma(model, decay=0.5)
    for _ in range(2):
        model(torch.randn(5, 3, 8, 8) * (1 + rank))
        ema.update(model)
    before = {"model": model.state_dict(), "ema": ema.module.state_dict()}
    before = {k: {n: t.clone() for n, t in v.items()} for k, v in before.items()}
    vit = build_model(load_config([DEBUG_CONFIG]).model)  # no running statistics
    for p in vit.parameters():  # each rank other weights: a collective over them would change them
        p.data.add_(rank)
    vit_before = {k: v.clone() for k, v in vit.state_dict().items()}
    calls, all_reduce = [0], torch.distributed.all_reduce

    def counted(*args, **kwargs):
        calls[0] += 1
        return all_reduce(*args, **kwargs)

    torch.distributed.all_reduce = counted
    average_running_stats(vit, None)
    vit_calls = calls[0]
    torch.distributed.all_reduce = all_reduce
    average_running_stats(model, ema)
    torch.save({"before": before, "after": {"model": model.state_dict(), "ema": ema.module.state_dict()},
                "vit_before": vit_before, "vit_after": vit.state_dict(), "vit_calls": vit_calls},
               out_file.format(rank=rank))
    leave_and_exit()


@pytest.mark.slow
def test_two_ranks_hold_the_mean_of_their_running_stats_and_a_vit_is_left_alone(tmp_path):
    out = str(tmp_path / "rank{rank}.pt")
    spawn_ranks(_averaging_worker, (2, free_port(), out), 2)
    ranks = [torch.load(out.format(rank=r)) for r in range(2)]
    for which in ("model", "ema"):
        before = [r["before"][which] for r in ranks]
        stats = [k for k in before[0] if k.endswith(("running_mean", "running_var"))]
        assert stats and not torch.equal(before[0][stats[0]], before[1][stats[0]])  # the ranks did differ
        for key in before[0]:
            # the naive reference: the mean of the two ranks' statistics; everything else as it was on each rank
            expected = [(before[0][key] + before[1][key]) / 2] * 2 if key in stats else [b[key] for b in before]
            for r in range(2):
                assert torch.allclose(ranks[r]["after"][which][key], expected[r], rtol=1e-6, atol=1e-7), \
                    (which, key, r)
    for r in range(2):  # a ViT: no buffer is averaged, no collective made, nothing changed
        assert ranks[r]["vit_calls"] == 0
        assert ranks[r]["vit_before"].keys() == ranks[r]["vit_after"].keys()
        assert all(torch.equal(v, ranks[r]["vit_after"][k]) for k, v in ranks[r]["vit_before"].items())


def test_one_process_leaves_the_running_stats_as_they_are():
    model = bn_model()
    model(torch.randn(5, 3, 8, 8))
    before = running_stats(model)
    average_running_stats(model, ModelEma(model, decay=0.5))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


BN_RUN = ("model.name=resnet10t", "model.drop_path=0", "data.mixup=0", "data.cutmix=0", "train.ema=true",
          "train.ema_decay=0.5", "train.max_steps=4", "train.eval_every_steps=4")


def _train_worker(rank, world, port, overrides):
    as_torchrun_rank(rank, world, port)
    train.main(load_config([DEBUG_CONFIG], overrides))
    leave_and_exit()


@pytest.mark.slow  # a two-rank BatchNorm run of 4 updates, then the checkpoint scored in one process
def test_ddp_validation_scores_the_saved_weights_of_a_batchnorm_model(tmp_path):
    out_dir = tmp_path / "run"
    overrides = [*BN_RUN, f"out_dir={out_dir}"]
    spawn_ranks(_train_worker, (2, free_port(), overrides), 2)
    with open(out_dir / "metrics.jsonl") as f:
        logged = [r for r in map(json.loads, f) if "val/loss" in r][-1]
    cfg = load_config([DEBUG_CONFIG], overrides)
    loader = build_eval_loader(cfg.data, img_size=input_size(build_model(cfg.model)), batch_size_per_gpu=16,
                               rank=0, world_size=1, num_classes=cfg.model.num_classes)
    payload = torch.load(os.path.join(out_dir, "checkpoint.pt"), weights_only=False)
    assert payload["state"]["step"] == logged["step"] == 4
    best = torch.load(os.path.join(out_dir, "best.pt"), weights_only=False)
    for key, prefix in (("model", "val"), ("model_ema", "val_ema")):
        model = build_model(cfg.model)
        model.load_state_dict(payload[key])
        scored = evaluate(model.eval(), loader, torch.device("cpu"))
        # one process scoring the saved weights on the whole val split: what the two ranks logged for it, up to the
        # rounding of two partial sums (1e-7); ranks scoring with their own statistics logged 1e-4 away
        assert scored["loss"] == pytest.approx(logged[f"{prefix}/loss"], rel=1e-6), key
        assert scored["top1"] == pytest.approx(logged[f"{prefix}/top1"]), key
        # best.pt (this run's only validation) holds the same weights
        assert all(torch.equal(v, best[key][k]) for k, v in payload[key].items()), key
