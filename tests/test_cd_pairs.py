"""cd.find_pairs: counts on full-size models (meta device), names/roles/kinds, wrappers, errors, CLI."""
from __future__ import annotations

import timm
import torch
import pytest
from torch import nn

from cd import find_pairs
from cd.__main__ import main as pairs_main
from cd_models import tiny_swin, tiny_vit


def _meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return timm.create_model(name)


@pytest.mark.parametrize("name,count", [("vit_tiny_patch16_224", 48), ("deit_small_patch16_224", 48),
                                        ("swin_tiny_patch4_window7_224", 51)])
def test_full_size_pair_counts(name, count):
    pairs = find_pairs(_meta(name))
    assert len(pairs) == count


def test_vit_pairs_names_roles_kinds_in_model_order():
    got = [(p.name, p.role, p.kind, p.upstream_name, p.upstream_rows) for p in find_pairs(tiny_vit())]
    want = []
    for i in range(2):
        b = f"blocks.{i}"
        want += [(f"{b}.attn.qkv.weight", "qkv", "composable", f"{b}.norm1.weight", None),
                 (f"{b}.attn.proj.weight", "proj", "functional", f"{b}.attn.qkv.weight", (64, 96)),
                 (f"{b}.mlp.fc1.weight", "fc1", "composable", f"{b}.norm2.weight", None),
                 (f"{b}.mlp.fc2.weight", "fc2", "functional", f"{b}.mlp.fc1.weight", None)]
    assert got == want


def test_swin_pairs_include_patch_merging_at_stage_start():
    model = tiny_swin()
    pairs = find_pairs(model)
    names = [p.name for p in pairs]
    assert len(pairs) == 4 * 4 + 1
    k = names.index("layers.1.downsample.reduction.weight")
    assert k == 8  # after the 2 blocks of stage 0, before the blocks of stage 1 (timm's placement)
    red = pairs[k]
    assert (red.role, red.kind, red.upstream_name) == ("reduction", "composable",
                                                       "layers.1.downsample.norm.weight")
    assert red.w2_shape == (64, 128) and red.w1_shape == (128, 128)
    params = dict(model.named_parameters())
    for p in pairs:  # the parameters are the model's own tensors, under the model's own names
        assert p.downstream is params[p.name] and p.upstream is params[p.upstream_name]


def test_proj_upstream_is_a_view_of_the_v_rows():
    model = tiny_vit()
    proj = [p for p in find_pairs(model) if p.role == "proj"][0]
    qkv = model.blocks[0].attn.qkv.weight
    assert proj.w1().data_ptr() == qkv[64:96].data_ptr() and torch.equal(proj.w1(), qkv[64:96])


class _Wrapper(nn.Module):  # what DDP / DataParallel look like structurally
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_wrapped_models_give_unwrapped_names():
    model = tiny_vit()
    want = [p.name for p in find_pairs(model)]
    compiled = torch.compile(model)  # only wraps; nothing is compiled until it is called
    assert [p.name for p in find_pairs(_Wrapper(model))] == want
    assert [p.name for p in find_pairs(compiled)] == want
    assert [p.name for p in find_pairs(_Wrapper(compiled))] == want


def test_attention_with_extra_parameters_keeps_its_pairs():
    model = tiny_vit()
    model.blocks[0].attn.sink_bias = nn.Parameter(torch.zeros(2))  # attention-sink style extra parameter
    assert len(find_pairs(model)) == 8


def test_no_pairs_is_a_clear_error():
    with pytest.raises(ValueError, match="no matrix pair"):
        find_pairs(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))


def test_gated_mlp_loses_only_its_fc2_pair():
    model = tiny_vit()
    model.blocks[1].mlp.fc1 = nn.Linear(32, 256)  # fc1 twice as wide as fc2's input: a gated MLP shape
    with pytest.warns(UserWarning, match="blocks.1"):
        pairs = find_pairs(model)
    assert [p.role for p in pairs if p.block == "blocks.1"] == ["qkv", "proj", "fc1"]


def test_cli_prints_the_table(capsys):
    pairs_main(["--model", "vit_base_patch16_224"])
    out = capsys.readouterr().out
    assert "48 pairs: qkv 12, proj 12, fc1 12, fc2 12" in out
    assert "blocks.11.attn.qkv.weight[1536:2304]" in out and "768x3072" in out
