"""cd.find_pairs: counts on full-size models (meta device), names/roles/kinds, wrappers, the forward check,
refused blocks, errors, CLI."""
from __future__ import annotations

from types import SimpleNamespace

import timm
import torch
import pytest
from timm.models.vision_transformer import ResPostBlock
from torch import nn

from cd import ColinearityDecay, UnsupportedModelError, find_pairs, pair_energy_source
from cd.__main__ import main as pairs_main
from cd.verify import refuse_split_devices
from cd_models import tiny_swin, tiny_vit, vit_table_rows


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


class _Wrapper(nn.DataParallel):  # a DataParallel on no device: the model as `.module`
    def __init__(self, module):
        nn.Module.__init__(self)  # DataParallel's own would move the model to a GPU where there is one
        self.module, self.device_ids = module, []


def test_wrapped_models_give_unwrapped_names():
    model = tiny_vit()
    want = [p.name for p in find_pairs(model)]
    compiled = torch.compile(model)  # only wraps; nothing is compiled until it is called
    assert [p.name for p in find_pairs(_Wrapper(model))] == want
    assert [p.name for p in find_pairs(compiled)] == want
    assert [p.name for p in find_pairs(_Wrapper(compiled))] == want


class _Backbone(nn.Module):
    """A model whose only child is its backbone (as a detector or a task head around a ViT): no wrapper."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone

    def forward(self, x):
        return self.backbone(x)


def test_a_single_child_not_called_module_keeps_its_name_in_the_pairs():
    # the names are the model's own parameter names (what the optimizer and the state dict use), under DDP too
    model = _Backbone(tiny_vit())
    names = [n for n, _ in model.named_parameters()]
    want = [f"backbone.blocks.{i}.{w}.weight" for i in range(2)
            for w in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
    for wrapped in (model, _Wrapper(model), torch.compile(_Wrapper(model))):
        pairs = find_pairs(wrapped, example_input=torch.zeros(1, 3, 32, 32))
        assert [p.name for p in pairs] == want and set(want) <= set(names)
        assert [p.upstream_name for p in pairs][:2] == ["backbone.blocks.0.norm1.weight",
                                                        "backbone.blocks.0.attn.qkv.weight"]


def test_attention_with_extra_parameters_keeps_its_pairs():
    model = tiny_vit()
    model.blocks[0].attn.sink_bias = nn.Parameter(torch.zeros(2))  # attention-sink style extra parameter
    assert len(find_pairs(model)) == 8


def test_no_pairs_is_a_clear_error():
    with pytest.raises(ValueError, match="no matrix pair"):
        find_pairs(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))


def test_gated_mlp_is_refused_naming_the_block_type():
    model = tiny_vit()
    model.blocks[1].mlp.fc1 = nn.Linear(32, 256)  # fc1 twice as wide as fc2's input: a gated MLP shape
    with pytest.raises(UnsupportedModelError, match=r"'blocks.1' \(Block\).*gated MLP"):
        find_pairs(model)


@pytest.mark.parametrize("option,pair", [("scale_mlp_norm", "fc1 -> fc2"), ("scale_attn_norm", "V -> proj")])
def test_a_norm_between_a_functional_pairs_matrices_is_refused(option, pair):
    # timm's norm inside the MLP / attention rescales W1's output before W2 reads it: the product W2 W1 is
    # not the path, as for the gated MLP's scale_mlp
    with pytest.raises(UnsupportedModelError, match=rf"'blocks.0' \(Block\).*has a norm before .*{pair}"):
        find_pairs(_tiny("vit_tiny_patch16_224", depth=1, **{option: True}))
    assert len(find_pairs(_tiny("vit_tiny_patch16_224", depth=1, **{option: False}))) == 4  # Identity: no norm


@pytest.mark.parametrize("name,block", [("pvt_v2_b0", "stages.0.blocks.0"), ("twins_pcpvt_small", "blocks.0.0")])
def test_an_attention_with_k_and_v_fused_in_kv_is_refused_as_such_not_for_its_norm(name, block):
    # PVT-v2's and Twins' attention: q reads the tokens, kv (K and V in one Linear) reads norm(sr(tokens)), the
    # spatially reduced ones; its `norm` is on kv's input, not between V and proj. What CD lacks is qkv or a v.
    attn = _meta(name).get_submodule(block).attn
    assert isinstance(attn.norm, nn.LayerNorm) and hasattr(attn, "kv") and not hasattr(attn, "v")
    with pytest.raises(UnsupportedModelError) as info:
        find_pairs(_meta(name))
    assert f"'{block}'" in str(info.value) and "found no attn.qkv or attn.k, attn.v" in str(info.value)
    assert "has a norm before" not in str(info.value)


class _OnAnotherGpu:
    """Stands in for a parameter on a second GPU (this test runs on a CPU): the split-device check reads only
    `device` and `is_meta`. The meta device cannot stand in: a meta matrix is refused as unmaterialised instead."""

    device = torch.device("cuda", 1)
    is_meta = False


def test_a_pair_split_across_devices_is_refused_naming_both_devices():
    pairs = find_pairs(tiny_vit(), verify=False)
    split = [SimpleNamespace(**{**vars(p), "downstream": _OnAnotherGpu()}) if p.name == "blocks.1.mlp.fc1.weight"
             else p for p in pairs]
    with pytest.raises(UnsupportedModelError, match=r"'blocks.1' \(Block\).*fc1 pair has blocks.1.mlp.fc1.weight "
                                                    r"on cuda:1 and blocks.1.norm2.weight on cpu"):
        refuse_split_devices(split, {"blocks.1": "Block"})
    refuse_split_devices(pairs, {})  # every pair on one device: nothing to refuse


def _tiny(name: str, **kw) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, img_size=32, patch_size=8, embed_dim=32, num_heads=2, num_classes=3, **kw)


@pytest.mark.parametrize("build,block", [
    (lambda: _tiny("vit_tiny_patch16_224", depth=2, block_fn=ResPostBlock), "ResPostBlock"),
    (lambda: timm.create_model("swinv2_tiny_window8_256", img_size=32, patch_size=2, window_size=4, embed_dim=32,
                               depths=(2,), num_heads=(2,), num_classes=3), "SwinTransformerV2Block"),
])
def test_res_post_norm_blocks_are_refused_by_the_forward_check(build, block):
    # Same child names as a pre-norm block, so the structure matches; the forward pass shows that norm1
    # follows the attention instead of feeding qkv.
    with pytest.raises(UnsupportedModelError, match=rf"\({block}\): the qkv pair: the input of .*attn.qkv.weight "
                       r"is not the output of the norm"):
        find_pairs(build())


class _Unused(nn.Module):
    """A pre-norm-shaped block whose forward skips norm1 before qkv (a post-norm bug in a user's model)."""

    def __init__(self, block: nn.Module, skip: str) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = block.norm1, block.attn, block.norm2, block.mlp
        self.skip = skip

    def forward(self, x):
        h = x if self.skip == "norm1" else self.norm1(x)
        x = x + self.attn(h.mul_(2.0) if self.skip == "in_place" else h)
        h = self.norm2(x)
        return x + (self.mlp.fc2(h) if self.skip == "fc1" else self.mlp(h))


@pytest.mark.parametrize("skip,match", [
    ("norm1", r"'blocks.0' \(_Unused\): the qkv pair: the input of blocks.0.attn.qkv.weight is not the output"),
    ("fc1", r"'blocks.0' \(_Unused\): the fc1 pair: blocks.0.mlp.fc1.weight is not used"),
    ("in_place", r"'blocks.0' \(_Unused\): the qkv pair: the input of blocks.0.attn.qkv.weight depends on the output "
                 r"of the norm blocks.0.norm1, but the norm's scale reaches it through a computation other than"),
])
def test_forward_check_catches_a_block_that_does_not_compute_its_pairs(skip, match):
    model = _tiny("vit_tiny_patch16_224", depth=1, mlp_ratio=1.0)
    model.blocks[0] = _Unused(model.blocks[0], skip)
    with pytest.raises(UnsupportedModelError, match=match):
        find_pairs(model)
    assert len(find_pairs(model, verify=False)) == 4  # the structure alone would have matched


class _Bypass(nn.Module):
    """A pre-norm-shaped block whose fc2 reads norm2's output, fc1's only added beside it: fc1 runs, but does not
    feed fc2 (the functional pair's W1 is not upstream of its W2)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = block.norm1, block.attn, block.norm2, block.mlp

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        return x + self.mlp.fc2(h) + self.mlp.fc1(h)


def test_forward_check_names_a_functional_pair_whose_upstream_does_not_feed_it():
    model = _tiny("vit_tiny_patch16_224", depth=2, mlp_ratio=1.0)
    for i in (0, 1):
        model.blocks[i] = _Bypass(model.blocks[i])
    # the functional pair's own message, not the norm's (which is for composable pairs), then how many other pairs
    # fail: block 1's fc2 (the other pairs hold)
    with pytest.raises(UnsupportedModelError, match=r"'blocks.0' \(_Bypass\): the fc2 pair: the input of "
                       r"blocks.0.mlp.fc2.weight does not come from blocks.0.mlp.fc1.weight \(and 1 more\)$"):
        find_pairs(model)


def test_a_non_square_image_size_is_the_example_inputs_height_and_width():
    """timm's img_size=(H, W): the meta check's batch is (1, C, H, W), which the patch embedding takes (it
    checks the size), so the pairs of a non-square ViT are found with the check on."""
    from cd.verify import example_input

    model = timm.create_model("vit_tiny_patch16_224", img_size=(16, 32), patch_size=8, embed_dim=32, depth=1,
                              num_heads=2, num_classes=3)
    assert tuple(example_input(model).shape) == (1, 3, 16, 32)
    assert [p.role for p in find_pairs(model)] == ["qkv", "proj", "fc1", "fc2"]


def test_a_hiera_built_for_another_image_size_is_checked_on_that_size():
    """timm's Hiera keeps no img_size; the example was its pretrained_cfg's 224 px, whose forward fails on a Hiera
    built for 64 px (its position embedding is sized for the grid), so find_pairs refused it with a fix (example_input=
    or verify=False) that train.py's cd settings do not have. Its token grid times its patch stride is the image."""
    import warnings

    from cd.verify import example_input

    model = timm.create_model("hiera_tiny_224", img_size=(64, 96), embed_dim=16, num_heads=1, stages=(1, 1, 1, 1),
                              num_classes=3)
    assert tuple(example_input(model).shape) == (1, 3, 64, 96)
    model(torch.zeros(1, 3, 64, 96))  # the size it takes
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="CD leaves out ")  # its stage-transition proj (test above)
        assert [p.role for p in find_pairs(model)] == ["qkv", "proj", "fc1", "fc2"] * 4


def test_a_hybrid_vits_example_input_has_the_images_channels_not_those_its_proj_sees():
    """timm's hybrid ViTs (vit_*_r*): HybridEmbed's `proj` convolves the CNN backbone's feature maps (64 channels
    here), so the meta batch takes its channel count from the image's first convolution, the stem's 3; the pairs
    are then the ones an explicit image batch gives."""
    from cd.verify import example_input

    model = timm.create_model("vit_tiny_r_s16_p8_224", img_size=64, depth=2, num_classes=3)
    assert model.patch_embed.proj.in_channels != 3  # else this test checks nothing
    assert tuple(example_input(model).shape) == (1, 3, 64, 64)
    given = find_pairs(model, torch.randn(1, 3, 64, 64))
    assert [(p.role, p.block) for p in find_pairs(model)] == [(p.role, p.block) for p in given]
    assert len(given) == 8


class _Buffered(nn.Module):
    """A pre-norm block that copies norm1's output into a buffer of its own (`Tensor.copy_`, an in-place op that
    only moves values) before qkv reads it."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = block.norm1, block.attn, block.norm2, block.mlp

    def forward(self, x):
        h = torch.empty_like(x)
        h.copy_(self.norm1(x))
        x = x + self.attn(h)
        return x + self.mlp(self.norm2(x))


def test_a_norm_output_copied_in_place_into_a_buffer_still_feeds_its_composable_pair():
    model = _tiny("vit_tiny_patch16_224", depth=1)
    model.blocks[0] = _Buffered(model.blocks[0])
    assert [p.role for p in find_pairs(model)] == ["qkv", "proj", "fc1", "fc2"]  # the forward check passes


class _ItemForward(nn.Module):
    """A user's model whose forward cannot run on the meta device (data-dependent control flow)."""

    def __init__(self) -> None:
        super().__init__()
        self.vit = _tiny("vit_tiny_patch16_224", depth=1)

    def forward(self, x):
        return self.vit(x) if x.sum().item() < float("inf") else x


def test_a_forward_that_cannot_run_on_meta_is_a_clear_error_and_verify_false_trusts_the_structure():
    model = _ItemForward()
    x = torch.zeros(1, 3, 32, 32)
    with pytest.raises(UnsupportedModelError, match="forward pass on the meta device failed.*verify=False"):
        find_pairs(model, example_input=x)
    assert len(ColinearityDecay(model, verify=False).pairs) == 4


class _TwoInputs(nn.Module):
    """A forward of several arguments, whose example input is a tuple (Lightning's `example_input_array`)."""

    def __init__(self) -> None:
        super().__init__()
        self.vit = _tiny("vit_tiny_patch16_224", depth=1)

    def forward(self, x, scale):
        return self.vit(x) * scale


def test_a_tuple_example_input_is_the_forwards_positional_arguments():
    model = _TwoInputs()
    example = (torch.zeros(1, 3, 32, 32), torch.tensor(2.0))
    assert len(find_pairs(model, example_input=example)) == 4
    assert len(find_pairs(model, example_input=list(example))) == 4
    assert len(ColinearityDecay(model, example_input=example).pairs) == 4


def test_an_example_input_beside_verify_false_is_refused_not_ignored():
    model = _TwoInputs()
    example = (torch.zeros(1, 3, 32, 32), torch.tensor(2.0))
    for build in (find_pairs, ColinearityDecay):
        with pytest.raises(ValueError, match="example_input serves the pair checks only, and verify=False skips"):
            build(model, example_input=example, verify=False)
    assert len(find_pairs(model, verify=False)) == 4


def test_class_attention_blocks_pair_q_k_v_with_norm1_and_proj_with_v():
    model = timm.create_model("cait_xxs24_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                              num_classes=3)
    pairs = [p for p in find_pairs(model) if p.block == "blocks_token_only.0"]
    b = "blocks_token_only.0"
    assert [(p.name, p.role, p.kind, p.upstream_name) for p in pairs] == [
        (f"{b}.attn.q.weight", "qkv", "composable", f"{b}.norm1.weight"),
        (f"{b}.attn.k.weight", "qkv", "composable", f"{b}.norm1.weight"),
        (f"{b}.attn.v.weight", "qkv", "composable", f"{b}.norm1.weight"),
        (f"{b}.attn.proj.weight", "proj", "functional", f"{b}.attn.v.weight"),
        (f"{b}.mlp.fc1.weight", "fc1", "composable", f"{b}.norm2.weight"),
        (f"{b}.mlp.fc2.weight", "fc2", "functional", f"{b}.mlp.fc1.weight")]
    assert pairs[3].upstream_rows is None


def test_a_model_without_pairs_trains_with_cd_off_and_cd_on_is_a_clear_error():
    model = timm.create_model("convnext_atto", num_classes=3)
    with pytest.warns(UserWarning, match="no matrix pair found in ConvNeXt"):
        source = pair_energy_source(model)
    assert source() == {}  # what train.py logs for a CD-off run: nothing, and no crash
    with pytest.raises(UnsupportedModelError, match="no matrix pair found in ConvNeXt"):
        ColinearityDecay(model)


def test_cli_prints_the_table(capsys):
    pairs_main(["--model", "vit_base_patch16_224"])
    out = capsys.readouterr().out
    assert "48 pairs: qkv 12, proj 12, fc1 12, fc2 12" in out
    assert "blocks.11.attn.qkv.weight[1536:2304]" in out and "768x3072" in out


def test_cli_table_cells_for_vit_tiny_match_the_pairs_written_by_hand(capsys):
    """Every cell of every row of vit_tiny_patch16_224's table (dim 192, MLP 768): W2 and W1 names and shapes."""
    pairs_main(["--model", "vit_tiny_patch16_224"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[3:-1]]  # no cell holds a space; the header and rule come first
    assert rows == vit_table_rows(depth=12, dim=192, hidden=768)
    assert lines[-1] == "48 pairs: qkv 12, proj 12, fc1 12, fc2 12"


def test_cli_warns_of_crossvits_half_blocks_once(capsys):
    """crossvit_9_240's six fusion CrossAttentionBlocks (two per multi-scale block, written out by hand) are named in
    one warning per command (cd/README.md): was two, one from the meta model's find_pairs and one from a small CPU
    copy's (its img_size=128 copy, read before its forward fails there)."""
    import warnings

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pairs_main(["--model", "crossvit_9_240"])
    left_out = [str(w.message) for w in record if "CD and TWEO leave out" in str(w.message)]
    assert len(left_out) == 1
    fusion = [f"blocks.{i}.fusion.{j} (CrossAttentionBlock: " for i in range(3) for j in range(2)]
    assert left_out[0].startswith("CD and TWEO leave out 6 modules of CrossVit: ")
    assert all(name in left_out[0] for name in fusion)
    assert capsys.readouterr().out.splitlines()[-1].endswith(" pairs: qkv 12, proj 12, fc1 12, fc2 12")


def test_cli_refuses_swin_v2_with_one_error_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        pairs_main(["--model", "swinv2_tiny_window8_256"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    # the first block in model order, not the later patch merging (whose norm also follows its layer)
    assert err.startswith("error: swinv2_tiny_window8_256: SwinTransformerV2 is not supported by CD: block "
                          "'layers.0.blocks.0' (SwinTransformerV2Block): the qkv pair")


def test_cli_refuses_families_with_a_model_in_one_error_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        pairs_main(["--model", "swin_tiny_patch4_window7_224", "--families"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("error: --families lists every family, not --model swin_tiny_patch4_window7_224")


def test_cli_default_model_table_layout_and_a_typo_with_suggestions(capsys):
    pairs_main([])  # the documented default: vit_base_patch16_224
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "vit_base_patch16_224:"
    assert lines[1].split() == ["#", "role", "kind", "W2", "(downstream,", "decayed)", "W2", "shape", "W1",
                                "(upstream)", "W1", "shape"]
    assert set(lines[2]) == {"-", " "}  # the rule under the header
    assert lines[3].split()[:4] == ["0", "qkv", "composable", "blocks.0.attn.qkv.weight"]
    assert lines[-2].split()[:2] == ["47", "fc2"] and lines[-1] == "48 pairs: qkv 12, proj 12, fc1 12, fc2 12"
    with pytest.raises(SystemExit) as exit_info:
        pairs_main(["--model", "vit_base_patch_224"])  # a typo difflib rates 0.947 against the real name
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown timm model 'vit_base_patch_224'; did you mean ") and \
        "vit_base_patch16_224" in err


def test_cli_refuses_an_empty_model_name_instead_of_listing_the_defaults_pairs(capsys):
    """`--model ""` (e.g. from an unset shell variable) names no model: one error line, not vit_base_patch16_224's
    table under the default's name."""
    with pytest.raises(SystemExit) as exit_info:
        pairs_main(["--model", ""])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("error: unknown timm model ''")


def _cait() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("cait_xxs24_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                             num_classes=3)


@pytest.mark.parametrize("build,block,change,match", [
    (tiny_vit, "blocks.1", lambda b: setattr(b, "norm2", nn.LayerNorm(16)), "affine norm2 .* of mlp.fc1's input"),
    (tiny_vit, "blocks.1", lambda b: setattr(b.attn, "proj", nn.Linear(16, 32)), "attn.qkv is not 3x attn.proj"),
    # 49 rows: 49 // 3 is proj's input width 16, but 49 rows are not three thirds
    (tiny_vit, "blocks.1", lambda b: (setattr(b.attn, "qkv", nn.Linear(32, 49)),
                                      setattr(b.attn, "proj", nn.Linear(16, 32))), "attn.qkv is not 3x attn.proj"),
    (_cait, "blocks_token_only.0", lambda b: setattr(b.attn, "v", nn.Linear(32, 16)), "attn.v's output width"),
    # fc1 writes 128 channels, fc2 reads 96 (not 64 either, which would read as a packed gated MLP)
    (tiny_vit, "blocks.1", lambda b: setattr(b.mlp, "fc2", nn.Linear(96, 32)), "is not fc1 -> act -> fc2"),
])
def test_a_block_whose_widths_do_not_chain_is_refused_by_its_structure(build, block, change, match):
    """Without the forward check (verify=False trusts the structure) a pair whose matrices cannot be multiplied
    is refused by name when found, not left to fail as a shape error inside the first update."""
    model = build()
    change(model.get_submodule(block))
    with pytest.raises(UnsupportedModelError, match=rf"'{block}' .*{match}"):
        find_pairs(model, verify=False)


class _NamedBlocks(nn.Module):
    """Two blocks under names of which one extends the other ('enc', 'enc_late'), not numbered children."""

    def __init__(self) -> None:
        super().__init__()
        vit = _tiny("vit_tiny_patch16_224", depth=2)
        self.enc, self.enc_late = vit.blocks[0], vit.blocks[1]

    def forward(self, x):
        return self.enc_late(self.enc(x))


def test_a_block_whose_name_extends_an_earlier_blocks_name_keeps_its_pairs():
    model = _NamedBlocks()
    pairs = find_pairs(model, example_input=torch.zeros(1, 5, 32))
    assert [(p.block, p.role) for p in pairs] == [(b, r) for b in ("enc", "enc_late")
                                                  for r in ("qkv", "proj", "fc1", "fc2")]


def test_modules_inside_a_block_are_not_searched_for_blocks():
    """A block holding a module that is itself laid out as a block (here a whole timm Block kept under attn, as an
    adapter might be) gives its own four pairs only: matches are outermost, in model order (cd.find_blocks)."""
    from cd.pairs import find_blocks

    model = tiny_vit()
    model.blocks[0].attn.adapter = _tiny("vit_tiny_patch16_224", depth=1).blocks[0]
    assert [name for name, _ in find_blocks(model)] == ["blocks.0", "blocks.1"]
    assert [(p.block, p.role) for p in find_pairs(model, verify=False)] == [
        (b, r) for b in ("blocks.0", "blocks.1") for r in ("qkv", "proj", "fc1", "fc2")]


class _SquareMerge(nn.Module):
    """A pre-norm patch-merging-like layer whose reduction keeps the width: reduction(norm(x)), C -> C."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.reduction = nn.LayerNorm(16), nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.reduction(self.norm(x))


def test_a_pre_norm_merging_layer_of_equal_widths_is_paired_not_taken_for_post_norm():
    """Norm width == reduction output width is post-norm (Swin V2) only when the input width differs; with equal
    widths the layer is paired, and the forward check agrees."""
    pairs = find_pairs(nn.Sequential(_SquareMerge()), example_input=torch.zeros(1, 4, 16))
    assert [(p.name, p.role, p.upstream_name) for p in pairs] == [("0.reduction.weight", "reduction", "0.norm.weight")]


class _OwnBlock(nn.Module):
    """A pre-norm block of one's own: timm's attention and norms, the MLP under another name or as a Sequential."""

    def __init__(self, mlp_name: str, sequential: bool) -> None:
        super().__init__()
        block = _tiny("vit_tiny_patch16_224", depth=1).blocks[0]
        self.norm1, self.attn, self.norm2 = block.norm1, block.attn, block.norm2
        mlp = nn.Sequential(block.mlp.fc1, nn.GELU(), block.mlp.fc2) if sequential else block.mlp
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + getattr(self, self.mlp_name)(self.norm2(x))


@pytest.mark.parametrize("mlp_name,sequential,missing", [
    ("ffn", False, "attn.w_msa.proj"),   # children norm1, attn, norm2, ffn: MMDetection Swin's names
    ("ffn", True, "attn.w_msa.proj"),
    ("mlp", True, "mlp.fc1 and mlp.fc2"),
])
def test_a_block_of_ones_own_under_other_names_is_refused_naming_the_layers_looked_for(mlp_name, sequential,
                                                                                         missing):
    """The attention of these blocks is timm's (attn.qkv, attn.proj): the refusal names the layers CD looked for
    and the names it finds, not an attention without qkv or an MLP of mismatched widths."""
    model = nn.Sequential(_OwnBlock(mlp_name, sequential), _OwnBlock(mlp_name, sequential))
    with pytest.raises(UnsupportedModelError) as refusal:
        find_pairs(model, example_input=torch.zeros(1, 5, 32))
    message = str(refusal.value)
    assert f"found no {missing}" in message
    if mlp_name == "ffn":  # the names under which a block of one's own is found, and the children it was taken by
        assert "mlp.fc1" in message and "attn.qkv" in message
        assert "its children norm1, attn, norm2, ffn are those of the MMDetection Swin block layout" in message
    assert "has neither a fused qkv" not in message and "matching widths" not in message


class _LlamaNamedBlock(nn.Module):
    """A pre-norm block under transformers Llama's names whose MLP is plain (up_proj -> ReLU -> down_proj, no
    gate_proj) and whose attention may lack its v_proj (`without_v`: v is the input), or under timm's names with
    the MLP's output layer renamed (mlp.out)."""

    def __init__(self, timm_names: bool = False, without_v: bool = False, d: int = 8) -> None:
        super().__init__()
        if timm_names:
            block = _tiny("vit_tiny_patch16_224", depth=1).blocks[0]
            self.norm1, self.attn, self.norm2 = block.norm1, block.attn, block.norm2
            self.mlp = nn.Module()
            self.mlp.fc1, self.mlp.out = block.mlp.fc1, block.mlp.fc2
            self.parts = (self.norm1, self.attn, self.norm2, lambda x: self.mlp.out(torch.relu(self.mlp.fc1(x))))
            return
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "o_proj") + (() if without_v else ("v_proj",)):
            setattr(self.self_attn, name, nn.Linear(d, d))
        self.mlp = nn.Module()
        self.mlp.up_proj, self.mlp.down_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.parts = (self.input_layernorm, self._attention, self.post_attention_layernorm,
                      lambda x: self.mlp.down_proj(torch.relu(self.mlp.up_proj(x))))

    def _attention(self, x):
        a = self.self_attn
        weights = torch.softmax(a.q_proj(x) @ a.k_proj(x).transpose(-1, -2), -1)
        return a.o_proj(weights @ (a.v_proj(x) if hasattr(a, "v_proj") else x))

    def forward(self, x):
        norm1, attention, norm2, mlp = self.parts
        x = x + attention(norm1(x))
        return x + mlp(norm2(x))


@pytest.mark.parametrize("timm_names,without_v,missing,present", [
    (False, False, "found no mlp.gate_proj (", "mlp.down_proj"),  # the Llama layout has no plain fc1: its gate
    (True, False, "found no mlp.fc2 (", "mlp.fc1 and"),           # fc1 is there: only fc2 is named
    # q_proj and k_proj are there; the Llama layout has no fused qkv to name
    (False, True, "found no self_attn.v_proj (separate q, k, v Linear layers before self_attn.o_proj)",
     "self_attn.q_proj"),
])
def test_a_refused_block_names_only_the_layers_it_lacks(timm_names, without_v, missing, present):
    """The refusal of an MLP or attention without its layout's layers names the absent ones, never a layer the
    layout has no name for ('found no None and mlp.down_proj' for a Llama-named MLP without gate_proj) nor one
    that is there, nor a form the layout does not have (a fused qkv of transformers' Llama)."""
    model = nn.Sequential(_LlamaNamedBlock(timm_names, without_v), _LlamaNamedBlock(timm_names, without_v))
    width = 32 if timm_names else 8
    with pytest.raises(UnsupportedModelError) as refusal:
        find_pairs(model, example_input=torch.zeros(1, 5, width))
    message = str(refusal.value)
    assert missing in message
    assert "None" not in message and f"found no {present}" not in message and "fused" not in message
    if not timm_names and not without_v:  # the Llama layout's MLP is gated: that form is named, not fc2(act(fc1(x)))
        assert "the layout's gated MLP fc2(act(W_gate x) * W_up x)" in message


def test_hieras_stage_transition_projections_are_named_as_left_out_of_cd_once():
    """timm's Hiera applies, in each block that starts a stage, `proj` to norm1's output on the residual path, outside
    its attention and MLP; no pair holds it, and CD left it out without a word. The matrices expected are read off
    the model's blocks (those whose `proj` is a layer), not off cd."""
    import warnings

    model = timm.create_model("hiera_tiny_224", img_size=64, embed_dim=16, num_heads=1, stages=(1, 2, 1, 1),
                              num_classes=3)
    expected = [f"blocks.{i}.proj" for i, block in enumerate(model.blocks) if block.proj is not None]
    assert expected == ["blocks.1.proj", "blocks.3.proj", "blocks.4.proj"]  # three stage changes
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pairs = find_pairs(model, torch.zeros(1, 3, 64, 64))
        find_pairs(model, torch.zeros(1, 3, 64, 64))  # read again (CD, its metrics): not warned again
    assert not {f"{name}.weight" for name in expected} & {p.name for p in pairs}
    left_out = [str(w.message) for w in record if str(w.message).startswith("CD leaves out ")]
    assert len(left_out) == 1
    assert left_out[0].startswith("CD leaves out 3 matrices of Hiera that its blocks apply outside their attention "
                                  "and MLP: blocks.1.proj (32x16), blocks.3.proj (64x32), blocks.4.proj (128x64). ")


def test_vit_and_swin_are_not_warned_of_left_out_layers():
    """The timm ViT and Swin blocks have no matrix outside their attention and MLP: no left-out warning."""
    import warnings

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        find_pairs(tiny_vit())
        find_pairs(tiny_swin())
    assert not [w for w in record if "leaves out" in str(w.message)]
