"""A model on the `meta` device has shapes and no values: `find_pairs` lists its pairs, while `ColinearityDecay` and
`pair_energy_source`, which update or measure values, refuse it once, with its cause and fix (they failed later, in
apply, metrics or aux_loss, with torch's "unsupported scalarType" from inside an autocast on `meta`). A CPU model
under torch's default device `meta` is no meta model and is updated as any other. A model partly on `meta` (one
matrix of a pair not yet materialised) is refused with the same cause and fix, not as a block split across devices."""
from __future__ import annotations

import re

import pytest
import torch

from cd import ColinearityDecay, find_pairs, pair_energy_source
from cd.update import colinearity_decay_, pair_energy, pair_penalty
from cd_models import VIT_DEPTH, randomize_norms, ref_block_update, snapshot, tiny_vit

MESSAGE = r"the model's parameters are on the meta device \(no values, e.g. blocks\.0\..*materialise them first"


def _meta_vit() -> torch.nn.Module:
    with torch.device("meta"):
        return tiny_vit(randomize=False)


@pytest.mark.parametrize("kwargs", [{}, {"mode": "loss"}, {"verify": False}])
def test_a_meta_model_is_refused_by_colinearity_decay_with_its_cause(kwargs):
    with pytest.raises(ValueError, match=rf"^ColinearityDecay: {MESSAGE}.*build ColinearityDecay after that"):
        ColinearityDecay(_meta_vit(), lam=0.005, **kwargs)


def test_a_meta_model_is_refused_by_pair_energy_source():
    with pytest.raises(ValueError, match=rf"^pair_energy_source: {MESSAGE}"):
        pair_energy_source(_meta_vit())


def test_find_pairs_still_lists_a_meta_models_pairs():
    # a ViT has 4 pairs per block (qkv, proj, fc1, fc2: paper Sec. 3.2)
    assert len(find_pairs(_meta_vit())) == 4 * VIT_DEPTH


def test_the_model_materialised_with_to_empty_is_taken_and_updated_exactly():
    model = _meta_vit().to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    randomize_norms(model)
    P = snapshot(model)
    ColinearityDecay(model, lam=0.1, matmul_precision="fp32").apply(lr=0.5)
    expected: dict = {}
    for i in range(VIT_DEPTH):
        ref_block_update(P, f"blocks.{i}", 0.05, expected)  # the float64 reference, lr * lam = 0.05
    for name, want in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].double(), want, rtol=1e-5, atol=1e-6)


def test_a_cpu_model_under_the_default_device_meta_is_updated_and_measured():
    model, reference = tiny_vit(), tiny_vit()
    P = snapshot(reference)
    torch.set_default_device("meta")
    try:
        decay = ColinearityDecay(model, lam=0.1, matmul_precision="fp32")
        decay.apply(lr=0.5)
        energies = decay.metrics()
        source = pair_energy_source(model)()
        loss_form = ColinearityDecay(model, lam=0.1, mode="loss")
        term = loss_form.aux_loss(torch.tensor(2.0, device="cpu"))
    finally:
        torch.set_default_device(None)
    expected: dict = {}
    for i in range(VIT_DEPTH):
        ref_block_update(P, f"blocks.{i}", 0.05, expected)
    for name, want in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].double(), want, rtol=1e-5, atol=1e-6)
    assert energies["cd/updates"] == 1.0 and source.keys() <= energies.keys() and source
    # the loss form's term is loss_coef * |task loss| (cd/README.md): 0.01 * 2
    assert term.device.type == "cpu" and abs(float(term.detach()) - 0.02) < 1e-6


def _partly_meta_vit(module: str) -> torch.nn.Module:
    """tiny_vit with the weight of `module` alone on the meta device (a model partly materialised)."""
    model = tiny_vit()
    part = model.get_submodule(module)
    part.weight = torch.nn.Parameter(torch.empty_like(part.weight, device="meta"))
    return model


# fc2: the W2 of one pair; qkv: the W2 of one pair and the W1 of another; norm2: the W1 of one pair only
PARTS = ["blocks.1.mlp.fc2", "blocks.0.attn.qkv", "blocks.1.norm2"]


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("module", PARTS)
def test_a_partly_meta_model_is_refused_with_the_materialise_fix_not_as_split_across_devices(module, verify):
    partly = rf"the model's parameters are on the meta device \(no values, e.g. {re.escape(module)}\.weight\)"
    with pytest.raises(ValueError, match=rf"^ColinearityDecay: {partly}.*materialise them first") as refused:
        ColinearityDecay(_partly_meta_vit(module), lam=0.005, verify=verify)
    assert "one device" not in str(refused.value)  # the meta matrix has no device to move it to, only values to get
    with pytest.raises(ValueError, match=rf"^pair_energy_source: {partly}.*materialise them first"):
        pair_energy_source(_partly_meta_vit(module))


@pytest.mark.parametrize("module", PARTS)
def test_find_pairs_lists_a_partly_meta_models_pairs_as_a_whole_meta_models(module):
    assert len(find_pairs(_partly_meta_vit(module))) == 4 * VIT_DEPTH


FUNCTIONS = {
    "colinearity_decay_": lambda pairs: colinearity_decay_(pairs, [1e-5] * len(pairs)),
    "pair_energy": pair_energy,
    "pair_penalty": lambda pairs: pair_penalty(pairs, [1.0] * len(pairs)),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("module", [None, *PARTS])
def test_the_functional_form_refuses_meta_pairs_with_the_cause_and_fix(name, module):
    """cd/README.md's functional form (find_pairs, then colinearity_decay_) on a meta model failed in torch's autocast
    with "unsupported scalarType", naming neither the cause nor the fix; pair_energy and pair_penalty too."""
    model = _meta_vit() if module is None else _partly_meta_vit(module)
    example = r"blocks\.0\..*" if module is None else rf"{re.escape(module)}\.weight"
    pairs = find_pairs(model)
    with pytest.raises(ValueError, match=rf"^{name}: the model's parameters are on the meta device \(no values, "
                                         rf"e\.g\. {example}\).*materialise them first.*call find_pairs after that"):
        FUNCTIONS[name](pairs)
