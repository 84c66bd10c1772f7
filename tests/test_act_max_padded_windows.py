"""engine/act_max.py: Swin's window padding is no part of the activations measured.

A Swin stage whose token grid is not a multiple of its window zero-pads the grid to whole windows before the window
attention and crops the padded tokens off after it (timm's `SwinTransformerBlock._attn`, MMDetection's
`ShiftWindowMSA`). The attention module's output and those of the modules in it (qkv, softmax, proj) hold rows for
the padded tokens, which entered the maxima and the kurtosis: a padded query's attention output is not zero, and its
qkv row is the bias. The reference: the tests' own hooks keep each output, put its windows back into the padded grid
with the library's own window_reverse (and its roll), crop the grid to the real tokens as the block does, and take the
max |value| and the Pearson kurtosis of what is left.
"""
import pytest
import timm
import torch
from timm.models.swin_transformer import SwinTransformerBlock, window_reverse
from timm.models.swin_transformer_v2 import SwinTransformerV2Block
from torch import nn

from engine.act_max import ActivationProbe
from quant_models import perturb_norms


def kurtosis(x: torch.Tensor) -> float:
    x = x.double().flatten()
    centred = x - x.mean()
    return float(centred.pow(4).mean() / centred.square().mean() ** 2)


def tokens_first(output: torch.Tensor, softmax: bool) -> torch.Tensor:
    """[windows * B, N, ...] with the rows of the tokens (a softmax's [windows * B, heads, N, keys]: of the queries)."""
    return output.transpose(1, 2) if softmax else output


def uncropped_and_cropped(outputs, grids, unpad):
    """{name: (whole output, its real tokens only)} of the outputs of modules in the window attention."""
    kept = {}
    for name, output in outputs.items():
        owner = next((o for o in grids if name == o or name.startswith(o + ".")), None)
        if owner is None or ".cpb_mlp" in name:  # SwinV2's MLP of the window offsets holds no tokens
            continue
        rows = tokens_first(output, name.endswith("softmax"))
        kept[name] = (output, unpad(owner, rows.reshape(rows.shape[0], rows.shape[1], -1)))
    return kept


def check(probe, outputs, kept, maxima_changed=0):
    records = {r["name"]: r for r in probe.result().per_layer}
    changed = 0
    for name, record in records.items():
        whole, real = kept.get(name, (outputs[name], outputs[name]))
        assert record["max"] == pytest.approx(float(real.abs().max()), rel=1e-6), name
        if not name.endswith("softmax"):
            assert record["kurtosis"] == pytest.approx(kurtosis(real), rel=1e-6), name
            changed += kurtosis(real) != pytest.approx(kurtosis(whole), rel=1e-6)
    # the reference tells the padded tokens apart: leaving them in would change the kurtosis (and some maxima)
    assert changed >= 4
    assert sum(float(whole.abs().max()) != float(real.abs().max()) for whole, real in kept.values()) >= maxima_changed


def keep_outputs(model, names):
    outputs, handles = {}, []

    def keep(name):
        def hook(module, inputs, output):  # a tuple's (PatchEmbed's: tokens, grid) tensors as one
            tensors = [t for t in (output if isinstance(output, (tuple, list)) else (output,)) if torch.is_tensor(t)]
            if tensors:
                outputs[name] = tensors[0].detach().clone() if len(tensors) == 1 else torch.cat(
                    [t.flatten() for t in tensors])
        return hook

    for name in names:
        handles.append(model.get_submodule(name).register_forward_hook(keep(name)))
    return outputs, handles


@pytest.mark.parametrize("name, size, window, maxima_changed", [("swin_tiny_patch4_window7_224", 32, 3, 1),
                                                                ("swinv2_tiny_window8_256", 36, 4, 0)])
def test_timm_swin_maxima_and_kurtosis_leave_out_the_padded_tokens(name, size, window, maxima_changed):
    """Swin: windows of 3 over 16 x 16 and 8 x 8 token grids (padded to 18 x 18 and 9 x 9); SwinV2 (whose attention
    also holds an MLP of the window offsets, no tokens: measured whole): windows of 4 over 18 x 18 and 9 x 9 (padded to
    20 x 20 and 12 x 12); shifted in odd blocks."""
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=size, patch_size=2, window_size=window, embed_dim=32, depths=(2, 2),
                              num_heads=(2, 4), num_classes=10).eval()
    perturb_norms(model)
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = False  # the softmax module runs
    grids = {}

    def grid_of(name):
        def hook(module, args):
            grids[name] = (args[0].shape[1], args[0].shape[2], module.window_size)
        return hook

    blocks = {n: m for n, m in model.named_modules() if isinstance(m, (SwinTransformerBlock, SwinTransformerV2Block))}
    assert len(blocks) == 4 and all(m.input_resolution[0] % m.window_size[0] for m in blocks.values())  # all padded
    handles = [m.register_forward_pre_hook(grid_of(n + ".attn")) for n, m in blocks.items()]
    with torch.no_grad(), ActivationProbe(model, moments=True) as probe:
        outputs, more = keep_outputs(model, probe.names())
        model(torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(1)))
    for handle in handles + more:
        handle.remove()

    def unpad(owner, rows):  # timm rolls, then pads: the real tokens are the top-left H x W of the padded grid
        height, width, window = grids[owner]
        padded = [-(-size // w) * w for size, w in zip((height, width), window)]
        return window_reverse(rows.reshape(-1, *window, rows.shape[-1]), window, *padded)[:, :height, :width]

    check(probe, outputs, uncropped_and_cropped(outputs, grids, unpad), maxima_changed)


def tiny_mmdet_detector() -> nn.Module:
    """A model whose `backbone` is one tiny stage of MMDetection's Swin (embed 16, two blocks, windows of 4, the
    second shifted): what engine.detection.evaluation measures of a detector, without its neck and heads."""
    from mmdet.models.backbones import swin

    class Detector(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = swin.SwinTransformer(embed_dims=16, depths=(2,), num_heads=(2,), window_size=4,
                                                 strides=(2,), patch_size=2, out_indices=(0,))

        def forward(self, x):
            return self.backbone(x)

    return Detector()


@pytest.mark.detection  # MMDetection needs full mmcv (scripts/install_mmcv.sh): CI's detection step runs it
def test_mmdetection_swin_maxima_and_kurtosis_leave_out_the_padded_tokens():
    """MMDetection pads, then rolls: a 20 x 28 image's 10 x 14 grid in windows of 4, shifted in the second block."""
    from mmdet.models.backbones import swin
    torch.manual_seed(0)
    model = perturb_norms(tiny_mmdet_detector().eval())
    grids = {}

    def grid_of(name):
        def hook(module, args):
            grids[name] = (args[1], module)
        return hook

    owners = {n: m for n, m in model.named_modules() if isinstance(m, swin.ShiftWindowMSA)}
    assert len(owners) == 2 and {m.shift_size for m in owners.values()} == {0, 2}
    handles = [m.register_forward_pre_hook(grid_of(n + ".w_msa")) for n, m in owners.items()]
    with torch.no_grad(), ActivationProbe(model, blocks=("backbone",), moments=True) as probe:
        outputs, more = keep_outputs(model, probe.names())
        model(torch.randn(2, 3, 20, 28, generator=torch.Generator().manual_seed(1)))
    for handle in handles + more:
        handle.remove()
    assert {hw for hw, _ in grids.values()} == {(10, 14)}

    def unpad(owner, rows):  # MMDetection pads, then rolls by -shift: roll back, then crop
        (height, width), msa = grids[owner]
        size = msa.window_size
        padded = msa.window_reverse(rows.reshape(-1, size, size, rows.shape[-1]), -(-height // size) * size,
                                    -(-width // size) * size)
        if msa.shift_size:
            padded = padded.roll((msa.shift_size, msa.shift_size), dims=(1, 2))
        return padded[:, :height, :width]

    check(probe, outputs, uncropped_and_cropped(outputs, grids, unpad))
