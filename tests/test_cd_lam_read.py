"""cd.lam is read by a pair whose role has no cd.lam_per_role entry, and by the budget rule (wd -> wd - lam): a
cd.lam that neither reads (every decayed role has its own strength, cd.budget=false) would be recorded in
config.yaml and change nothing, so the config path (`ColinearityDecay.from_config`, train.py) refuses it."""
from __future__ import annotations

import copy

import pytest
import torch

import train
from cd import ColinearityDecay
from cd_models import VIT_DEPTH, ref_w2, snapshot, tiny_vit
from configs import ConfigError, load_config

EVERY_ROLE = {"qkv": 0.01, "proj": 0.02, "fc1": 0.01, "fc2": 0.02}  # the roles of a ViT's pairs
PER_ROLE = [f"cd.lam_per_role.{role}={value}" for role, value in EVERY_ROLE.items()]
COVERED = ["cd.enabled=true", "cd.budget=false", *PER_ROLE]


def test_a_lam_that_no_pair_falls_back_to_changes_no_update():
    """The premise, against the float64 reference: with every role given its own strength, the update of each W2 is
    lr * lam_role whatever lam is."""
    model = tiny_vit()
    P = snapshot(model)
    results = []
    for lam in (0.5, 0.005):
        copy_ = copy.deepcopy(model)
        ColinearityDecay(copy_, lam=lam, lam_per_role=EVERY_ROLE).apply(lr=0.5)
        results.append(dict(copy_.named_parameters()))
    for i in range(VIT_DEPTH):
        b = f"blocks.{i}"
        qkv = P[f"{b}.attn.qkv.weight"]
        d = qkv.shape[0] // 3
        want = {f"{b}.attn.qkv.weight": ref_w2(qkv, torch.diag(P[f"{b}.norm1.weight"]), 0.5 * EVERY_ROLE["qkv"]),
                f"{b}.attn.proj.weight": ref_w2(P[f"{b}.attn.proj.weight"], qkv[2 * d:], 0.5 * EVERY_ROLE["proj"]),
                f"{b}.mlp.fc1.weight": ref_w2(P[f"{b}.mlp.fc1.weight"], torch.diag(P[f"{b}.norm2.weight"]),
                                              0.5 * EVERY_ROLE["fc1"]),
                f"{b}.mlp.fc2.weight": ref_w2(P[f"{b}.mlp.fc2.weight"], P[f"{b}.mlp.fc1.weight"],
                                              0.5 * EVERY_ROLE["fc2"])}
        for name, expected in want.items():
            for got in results:
                torch.testing.assert_close(got[name].detach().double(), expected, rtol=1e-5, atol=1e-6)


def test_a_lam_that_no_pair_falls_back_to_changes_no_loss_form_gradient():
    """Loss mode: the strengths weigh the penalty relative to lam, and the alignment to the task loss cancels the
    common factor: the gradients at lam 0.5 and 0.005 agree."""
    grads = []
    for lam in (0.5, 0.005):
        model = tiny_vit()
        decay = ColinearityDecay(model, lam=lam, lam_per_role=EVERY_ROLE, mode="loss")
        decay.aux_loss(torch.tensor(2.0)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("overrides, roles", [
    (COVERED, "qkv, proj, fc1, fc2"),
    ([*COVERED, "cd.mode=loss"], "qkv, proj, fc1, fc2"),
    # only the decayed roles count: targets B decays proj and fc2
    (["cd.enabled=true", "cd.budget=false", "cd.targets=B", "cd.lam_per_role={proj: 0.02, fc2: 0.02}"], "proj, fc2"),
])
def test_a_given_lam_that_nothing_reads_is_refused_naming_it(overrides, roles):
    cfg = load_config(None, [*overrides, "cd.lam=0.5"])
    with pytest.raises(ConfigError) as refused:  # as train.py builds it
        train.as_config_error("cd", ColinearityDecay.from_config, cfg.cd, tiny_vit())
    message = str(refused.value)
    assert message.startswith(f"cd.lam=0.5 would be ignored: cd.lam_per_role gives every role this model's CD "
                              f"decays ({roles}) its own strength, and with cd.budget=false")
    assert message.endswith("drop cd.lam (or give it its default 0.005), or drop a role's cd.lam_per_role entry to "
                            "give that role cd.lam") and "\n" not in message


@pytest.mark.parametrize("overrides, reads_lam", [
    (COVERED, False),  # cd.lam not given: its default is no one's choice
    (["cd.enabled=true", *PER_ROLE, "cd.lam=0.5"], False),  # the budget rule (cd.budget's default) reads it
    ([*COVERED[:-1], "cd.lam=0.5"], True),  # fc2 falls back to it
])
def test_a_lam_that_a_pair_or_the_budget_reads_is_taken(overrides, reads_lam):
    cfg = load_config(None, overrides)
    decay = ColinearityDecay.from_config(cfg.cd, tiny_vit())
    assert decay.lam == cfg.cd.lam and decay.reads_lam is reads_lam
