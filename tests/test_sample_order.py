"""The order of the training samples: each train.seed shuffles its epochs in orders of its own, seed 0 as torch's
DistributedSampler(seed=0), and a run begun under the earlier rule (seed + epoch) keeps it when resumed."""
import os

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

import train
from configs import load_config
from configs.schema import DataConfig
from data.loader import build_token_loaders, build_train_loader
from data.samplers import OLD_ORDER_RULE, ORDER_RULE, SeededSampler
from tests.conftest import DEMO_CONFIG


def orders(sampler, epochs):
    """The indices `sampler` (a loader's SeededSampler) deals in each of `epochs`."""
    dealt = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        dealt.append([index for index, _ in sampler])
    return dealt


def image_orders(seed, epochs):
    """The image indices of each of `epochs` of the digits demo (data.repeated_aug=0) under train.seed `seed`, one
    process."""
    cfg = load_config([DEMO_CONFIG], []).data
    batches = build_train_loader(cfg, img_size=32, batch_size_per_gpu=8, rank=0, world_size=1, seed=seed,
                                 num_classes=10)
    return orders(batches.sampler, epochs)


def window_orders(root, seed, epochs):
    """The window indices of each of `epochs` of the text loader over the token files in `root` under train.seed
    `seed`."""
    cfg = DataConfig(dataset="tokens", root=str(root), num_workers=0)
    loaders = build_token_loaders(cfg, context=10, batch_size_per_gpu=4, eval_batch_size_per_gpu=8, rank=0,
                                  world_size=1, seed=seed, vocab_size=50)
    return orders(loaders.train.sampler, epochs)


def torch_order(size, seed, epoch, start=0):
    """torch's own DistributedSampler(seed=`seed`) order of `epoch` over `size` samples (one process), from `start`."""
    sampler = DistributedSampler(range(size), num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    return list(sampler)[start:]


def test_no_seed_shares_another_seeds_order_one_epoch_apart(tmp_path):
    """Seed s epoch e and seed s + 1 epoch e - 1 were one order (torch's generator seed s + e); now the orders of
    four seeds over four epochs are sixteen distinct ones, through the image and the text loaders."""
    images = [image_orders(s, range(4)) for s in range(5)]
    for s in range(4):
        for e in range(1, 4):
            assert images[s][e] != images[s + 1][e - 1], (s, e)
    assert len({tuple(order) for seed in images for order in seed}) == 20
    for split in ("train", "val"):
        (np.arange(1000, dtype=np.uint16) % 50).tofile(tmp_path / f"{split}.bin")
    windows = [window_orders(tmp_path, s, range(3)) for s in range(3)]
    assert windows[2][0] != windows[1][1] and windows[1][0] != windows[0][1]
    assert len({tuple(order) for seed in windows for order in seed}) == 9


def test_seed_0_keeps_torchs_order_and_any_64_bit_seed_orders_its_epochs():
    """Seed 0's epochs are torch's DistributedSampler(seed=0) orders, as the demo figures and recorded results were
    trained on; the extreme seeds the schema allows give valid generator seeds (a permutation of the set)."""
    epochs = (0, 1, 2, 7, 29)
    assert image_orders(0, epochs) == [torch_order(1437, 0, epoch) for epoch in epochs]
    for seed in (2 ** 63 - 1, -2 ** 63, -1):
        first, last = image_orders(seed, (0, 2 ** 20))
        assert sorted(first) == sorted(last) == list(range(1437)) and first != last


def test_a_checkpoint_of_the_earlier_order_rule_resumes_mid_epoch_in_the_order_it_began_with(debug_config,
                                                                                            monkeypatch):
    """A checkpoint without `order_rule` (written before it was recorded) by a run of train.seed 3, stopped 48
    samples into epoch 0: the resumed run reads the rest of that epoch and the next as torch's
    DistributedSampler(seed=3) orders them, as the run began (not as a fresh run of seed 3 now does), says so in
    its log and records the rule, so that its own checkpoints resume the same way."""
    seen = []
    sampler_iter = SeededSampler.__iter__

    def recording_iter(self):
        for index, seed in sampler_iter(self):
            seen.append((self.epoch, index))
            yield index, seed

    monkeypatch.setattr(SeededSampler, "__iter__", recording_iter)
    cfg = debug_config("train.seed=3", "train.max_steps=3", name="old")  # 4 updates of 2 x 8 samples an epoch
    train.main(cfg)
    path = os.path.join(cfg.out_dir, "checkpoint.pt")
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["state"]["epoch_batches"] == 6 and ckpt["epoch_position"]["order_rule"] == ORDER_RULE
    del ckpt["epoch_position"]["order_rule"]
    torch.save(ckpt, path)
    seen.clear()
    assert train.main(debug_config("train.seed=3", name="old")).state.step == 8
    resumed = [[index for epoch, index in seen if epoch == e] for e in (0, 1)]
    assert resumed == [torch_order(64, 3, 0, start=48), torch_order(64, 3, 1)]
    fresh = SeededSampler(DistributedSampler(range(64), num_replicas=1, rank=0, seed=3, drop_last=True), 3, 0)
    assert orders(fresh, (1,)) != [resumed[1]]  # the current rule would have read another epoch 1
    assert torch.load(path, weights_only=True)["epoch_position"]["order_rule"] == OLD_ORDER_RULE
    with open(os.path.join(cfg.out_dir, "train.log")) as f:
        assert "continues a run begun before each train.seed had sample orders of its own" in f.read()


@pytest.mark.parametrize("seed", [0, 5])
def test_a_checkpoint_without_the_rule_takes_the_current_one_where_the_earlier_never_ordered_it(seed):
    """Seed 0 (the rules agree), repeated augmentation (timm's sampler follows neither) and a new train.seed (a
    fresh run of it) continue under the current rule; an unknown rule is refused."""
    from engine.checkpoint import CheckpointError
    from engine.resume import continue_sample_order

    cfg = load_config([DEMO_CONFIG], []).data
    sampler = build_train_loader(cfg, img_size=32, batch_size_per_gpu=8, rank=0, world_size=1, seed=seed,
                                 num_classes=10).sampler
    for saved in ({"seed": 0, "repeated_aug": 1}, {"seed": seed, "repeated_aug": 3}, {"seed": 7, "repeated_aug": 1}):
        position = {}
        continue_sample_order({"epoch_position": saved}, sampler, position, "c.pt")
        assert sampler.order_rule == position["order_rule"] == ORDER_RULE
    continue_sample_order({"epoch_position": {"seed": seed, "repeated_aug": 1}}, sampler, position, "c.pt")
    assert sampler.order_rule == (ORDER_RULE if seed == 0 else OLD_ORDER_RULE)
    # a checkpoint that records the earlier rule (a run begun under it, resumed once already) is read alike: it goes
    # on with its seed, and a new train.seed takes the current rule, as a fresh run of that seed
    recorded = {"seed": 7, "repeated_aug": 1, "order_rule": OLD_ORDER_RULE}
    continue_sample_order({"epoch_position": recorded}, sampler, position, "c.pt")
    assert sampler.order_rule == position["order_rule"] == ORDER_RULE
    continue_sample_order({"epoch_position": {**recorded, "seed": seed}}, sampler, position, "c.pt")
    assert sampler.order_rule == (ORDER_RULE if seed == 0 else OLD_ORDER_RULE)
    with pytest.raises(CheckpointError, match="c.pt orders its epochs by the rule 'shuffle', which this version"):
        continue_sample_order({"epoch_position": {"order_rule": "shuffle"}}, sampler, {}, "c.pt")
