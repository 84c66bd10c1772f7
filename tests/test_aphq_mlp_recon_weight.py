"""APHQ's MLP reconstruction weights its loss with the APH of the block's MLP OUTPUT, as the official
utils/mlp_recon.py does (it adds +-1e-6 inside `block.mlp.forward` and hooks `block.mlp`'s gradient). The block
output's APH is the same quantity only where the MLP output reaches the block output unchanged: a timm LayerScale
(`init_values`) carries the +-eps there as gamma * eps per channel, so the block's weight is another one."""
import pytest
import torch
import torch.nn.functional as F

import quant.aphq.mlp_recon as mlp_recon
from quant import PIPELINES
from quant.aphq.hessian import perturbation_hessian
from quant.pipeline_data import PipelineData
from quant.units import model_logits
from quant_models import images, perturb_norms, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")


def layer_scale_vit(layer_scale):
    model = perturb_norms(tiny_vit(init_values=layer_scale))
    if layer_scale is not None:
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():  # a gamma that differs per channel: a constant one would only rescale the weight
            for block in model.blocks:
                block.ls2.gamma.copy_(torch.rand(block.ls2.gamma.shape, generator=g) * 0.9 + 0.1)
    return model


def naive_aph(model, module, x, batch_size, temperature=20.0, eps=1e-6):
    """The official APH written out: +-eps on every element of `module`'s output, the gradient of the batchmean
    KL to the float softmax at that perturbed output (kept with retain_grad), |J+ - J-| averaged over samples."""
    total = 0.0
    for xb in x.split(batch_size):
        with torch.no_grad():
            target = F.softmax(model(xb) / temperature, dim=-1)
        grads = []
        for sign in (1.0, -1.0):
            kept = []

            def hook(_m, _a, out):
                moved = out + sign * eps
                moved.retain_grad()
                kept.append(moved)
                return moved

            handle = model.get_submodule(module).register_forward_hook(hook)
            out = model(xb.clone().requires_grad_(True))  # frozen weights: the graph runs from the input
            F.kl_div(F.log_softmax(out / temperature, dim=-1), target, reduction="batchmean").backward()
            handle.remove()
            grads.append(kept[0].grad)
        total = total + (grads[0] - grads[1]).abs().sum(dim=0, keepdim=True)
    return total / x.shape[0]


@pytest.mark.parametrize("layer_scale", [None, 0.5])
def test_mlp_reconstruction_weights_its_loss_with_the_aph_of_the_mlp_output(monkeypatch, layer_scale):
    fp = layer_scale_vit(layer_scale)
    seen = []
    normalized = mlp_recon.normalized_weight
    monkeypatch.setattr(mlp_recon, "normalized_weight", lambda h: seen.append(h.detach().clone()) or normalized(h))
    pool = images(8, seed=7)
    PIPELINES["aphq"](fp, None, "w4a4", dict(iters=0, mlp_reconstruct=True, mlp_iters=1, recon_images=8,
                                             calib_images=4, batch_size=4, matmul_steps=5, search_rounds=0, eq_n=32,
                                             log_every=0),
                      data=PipelineData(train_images=lambda n, seed, train: pool[:n]))
    assert len(seen) == len(fp.blocks)
    fp.requires_grad_(False)
    for i, h in enumerate(seen):
        want = naive_aph(fp, f"blocks.{i}.mlp", pool, batch_size=4)
        torch.testing.assert_close(h / h.mean(), want / want.mean(), rtol=1e-4, atol=0)
        if layer_scale is not None:  # the block output's weight, which MR took before, is another one here
            block = naive_aph(fp, f"blocks.{i}", pool, batch_size=4)
            assert not torch.allclose(h / h.mean(), block / block.mean(), rtol=0.5, atol=0)


@pytest.mark.parametrize("layer_scale", [None, 0.5])
def test_the_mlp_output_aph_is_the_block_outputs_exactly_where_there_is_no_layer_scale(layer_scale):
    """Without LayerScale the MLP output is added to the block output as it is, so both APHs are one quantity: shown
    with the Hutchinson probe (the all-ones probe's APH is rounding noise in a pre-LN ViT, hessian.py), the same
    +-1 vectors at both places; with LayerScale the weights differ."""
    fp = layer_scale_vit(layer_scale).requires_grad_(False)
    x = images(8, seed=7)
    logits = model_logits(fp, x, 4)
    for i in range(len(fp.blocks)):
        at_mlp, at_block = (perturbation_hessian(fp, name, x, logits, 4, eps=1e-4, probe="rademacher",
                                                 generator=torch.Generator().manual_seed(5))
                            for name in (f"blocks.{i}.mlp", f"blocks.{i}"))
        close = torch.allclose(at_mlp, at_block, rtol=1e-2, atol=1e-3 * float(at_block.abs().max()))
        assert close == (layer_scale is None)
