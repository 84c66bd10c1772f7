"""Models: full-size parameter counts (meta device), small variants, local weights loading."""
import dataclasses

import pytest
import timm
import torch
from safetensors.torch import save_file

from configs import load_config
from models import VARIANTS, ModelError, build_model, input_size
from models.factory import own_img_size
from tests.conftest import DEBUG_CONFIG, run_entry


def model_cfg(*overrides):
    return load_config(None, list(overrides)).model


@pytest.mark.parametrize("name, millions", [
    ("vit_tiny_patch16_224", 5.72), ("vit_small_patch16_224", 22.05), ("vit_base_patch16_224", 86.57),
    ("swin_tiny_patch4_window7_224", 28.29), ("deit_base_patch16_224", 86.57),
])
def test_full_size_parameter_counts_on_meta_device(name, millions):
    with torch.device("meta"):
        model = build_model(model_cfg(f"model.name={name}"))
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 2) == millions
    assert input_size(model) == 224


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_forward_and_backward(name):
    model = build_model(model_cfg(f"model.name={name}", "model.num_classes=7"))
    x = torch.randn(3, 3, input_size(model), input_size(model))
    out = model(x)
    assert out.shape == (3, 7)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_kwargs_reach_timm():
    model = build_model(model_cfg("model.name=vit_micro", "model.kwargs.depth=2"))
    assert len(model.blocks) == 2


def test_drop_path_and_dropout_settings_reach_the_model():
    """model.drop_path is stochastic depth rising linearly from 0 at the first block to the rate at the last
    (DeiT / timm's rule), model.drop the dropout of the blocks (tests/test_model_dropout.py), model.num_classes the
    head's outputs."""
    model = build_model(model_cfg("model.name=vit_micro", "model.drop_path=0.1", "model.drop=0.2",
                                  "model.num_classes=7"))
    depth = len(model.blocks)
    for block, rate in zip(model.blocks, [0.1 * i / (depth - 1) for i in range(depth)]):
        for path in (block.drop_path1, block.drop_path2):
            assert getattr(path, "drop_prob", 0.0) == pytest.approx(rate)
    assert model.pos_drop.p == 0.2 and model.head_drop.p == 0.0 and model.head.out_features == 7


@pytest.mark.parametrize("key, own", [("drop_path_rate", "drop_path"),  # model.drop's: tests/test_model_dropout.py
                                       ("num_classes", "num_classes"), ("img_size", "img_size"),
                                       ("pretrained", "pretrained")])
def test_kwargs_that_shadow_a_model_key_are_refused(key, own):
    # before, model.drop_path won over model.kwargs.drop_path_rate and model.kwargs.img_size over model.img_size
    with pytest.raises(ModelError, match=rf"model.kwargs.{key}: set model.{own} instead"):
        build_model(model_cfg("model.name=vit_micro", f"model.kwargs.{key}=7"))


def test_values_timm_asserts_on_are_a_model_error():
    with pytest.raises(ModelError, match=r"model 'vit_micro' .* rejected its arguments .*embed_dim"):
        build_model(model_cfg("model.name=vit_micro", "model.kwargs.embed_dim=35"))


def test_an_argument_timm_does_not_take_is_a_model_error_naming_it():
    with pytest.raises(ModelError, match=r"model 'vit_nano' \(vit_tiny_patch16_224\) rejected its arguments .*"
                                         r"unexpected keyword argument 'depht'"):
        build_model(model_cfg("model.name=vit_nano", "model.kwargs.depht=3"))


def test_a_patch_size_of_zero_is_a_model_error():
    with pytest.raises(ModelError, match=r"model 'vit_nano' .* rejected its arguments .*division"):
        build_model(model_cfg("model.name=vit_nano", "model.kwargs.patch_size=0"))


def test_a_size_torch_cannot_allocate_is_a_model_error():
    with pytest.raises(ModelError, match=r"model 'vit_nano' .* rejected its arguments .*'embed_dim': -8.*negative "
                                         r"dimension"):
        build_model(model_cfg("model.name=vit_nano", "model.kwargs.embed_dim=-8"))


def test_a_start_refused_for_its_model_arguments_is_one_error_line_and_the_corrected_start_runs(tmp_path, capsys):
    """The model is built on the meta device before out_dir is claimed (train.check_model): the failed start leaves
    no folder (its build once the folder was claimed had left a train.log there), and the corrected start runs."""
    out_dir = tmp_path / "run"
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={out_dir}", "model.kwargs.embed_dim=-8"],
                             capsys)
    assert code == 1 and err.startswith("error: model 'vit_nano'") and err.count("\n") == 1, err
    assert not out_dir.exists()
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={out_dir}", "train.max_steps=1"], capsys)
    assert code == 0, err
    assert (out_dir / "checkpoint.pt").is_file() and not (out_dir / "archive").exists()


@pytest.mark.parametrize("key", ["bogus_key", "depth"])
@pytest.mark.parametrize("name", ["vit_nano", "gpt2_nano"])
def test_a_model_kwarg_without_a_value_is_refused_naming_it(key, name):
    """timm's create_model drops None arguments: vit_nano's depth=null built timm's 12 blocks, an unknown key with
    null built the model without it, both recorded as set. load_config refuses the entry
    (tests/test_config_model_kwargs.py); build_model refuses it too in a ModelConfig that skipped that check."""
    cfg = dataclasses.replace(model_cfg(f"model.name={name}", "model.drop_path=0"), kwargs={key: None})
    with pytest.raises(ModelError, match=rf"^model.kwargs.{key} is null: give it a value, or leave the entry out"):
        build_model(cfg)


def test_a_yaml_mapping_without_a_space_after_the_colon_is_named_as_such_and_a_null_mapping_is_none(tmp_path):
    cfg = dataclasses.replace(model_cfg("model.name=vit_nano"), kwargs={"num_heads:4": None})
    with pytest.raises(ModelError, match=r"model.kwargs.num_heads:4 is null \(YAML reads 'num_heads:4' as one key "
                                         r"without a value: write a space after the colon, \{num_heads: 4\}\)"):
        build_model(cfg)
    layer = tmp_path / "deeper.yaml"
    layer.write_text("model:\n  name: vit_nano\n  kwargs: {depth: 1}\n")
    model = build_model(load_config([str(layer)], ["model.kwargs=null"]).model)  # the variant as defined
    arguments = {k: v for k, v in VARIANTS["vit_nano"].items() if k != "arch"}
    reference = timm.create_model(VARIANTS["vit_nano"]["arch"], num_classes=1000, **arguments)
    shapes = [{k: v.shape for k, v in m.state_dict().items()} for m in (model, reference)]
    assert shapes[0] == shapes[1] and len(model.blocks) == arguments["depth"]


@pytest.mark.parametrize("overrides, unseen", [(["model.name=vit_nano", "model.img_size=30"], "6 pixel"),
                                               (["model.name=vit_nano", "model.img_size=7"], "7 pixel.*all of them"),
                                               (["model.name=swin_nano", "model.img_size=34"], "2 pixel"),
                                               (["model.name=vit_nano", "model.kwargs.patch_size=[8, 6]"],
                                                "2 pixel.*multiple of 24$")])
def test_an_input_that_is_not_whole_patches_is_refused(overrides, unseen):
    """timm's patch embedding rounds the grid down: img_size 30 at patch 8 trained on 24 x 24 of every image
    without a word; one below the patch size failed in the first forward. Patches of two sides (8 x 6) are checked
    on each side, and the fix names a size both divide (model.img_size is one side for both: 24 = lcm(8, 6))."""
    with pytest.raises(ModelError, match=rf"not a whole number of patches .* would leave {unseen}"):
        build_model(model_cfg(*overrides))
    assert build_model(model_cfg("model.name=vit_nano", "model.img_size=40")).patch_embed.grid_size == (5, 5)
    assert build_model(model_cfg("model.name=vit_nano", "model.img_size=24",
                                 "model.kwargs.patch_size=[8, 6]")).patch_embed.grid_size == (3, 4)


def test_a_model_whose_patch_size_is_one_int_builds_and_has_its_own_input_size():
    """XCiT's patch embedding keeps its patch size as one int (timm's PatchEmbed a pair): the patch-grid check
    ended every XCiT start, and the resume's check of the model's own input size, in a TypeError traceback."""
    with torch.device("meta"):
        model = build_model(model_cfg("model.name=xcit_nano_12_p16_224", "model.img_size=32"))
        reference = timm.create_model("xcit_nano_12_p16_224")
    assert model.patch_embed.patch_size == 16 and model.patch_embed.img_size == (32, 32)
    assert own_img_size(model_cfg("model.name=xcit_nano_12_p16_224", "model.img_size=32")) == \
        reference.pretrained_cfg["input_size"][1] == 224


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ModelError, match="unknown model 'vit_bse_patch16_224'.*vit_base_patch16_224"):
        build_model(model_cfg("model.name=vit_bse_patch16_224"))


@pytest.mark.parametrize("suffix", ["pth", "safetensors"])
def test_local_weights_load_and_replace_a_head_of_another_size(tmp_path, suffix):
    source = build_model(model_cfg("model.name=vit_nano", "model.num_classes=10"))
    path = tmp_path / f"w.{suffix}"
    if suffix == "safetensors":
        save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(path))
    else:  # a train.py-style checkpoint of a compiled model: nested under 'model', '_orig_mod.' prefixes
        torch.save({"model": {f"_orig_mod.{k}": v for k, v in source.state_dict().items()}}, path)
    target = build_model(model_cfg("model.name=vit_nano", "model.num_classes=3", f"model.pretrained={path}"))
    for name, tensor in source.state_dict().items():
        if not name.startswith("head."):
            assert torch.equal(target.state_dict()[name], tensor), name
    assert target.head.weight.shape == (3, 32)


def test_strict_loading_refuses_a_head_of_another_size(tmp_path):
    source = build_model(model_cfg("model.name=vit_nano", "model.num_classes=10"))
    torch.save(source.state_dict(), tmp_path / "w.pth")
    with pytest.raises(ModelError, match="head.weight"):
        build_model(model_cfg("model.name=vit_nano", "model.num_classes=3",
                              f"model.pretrained={tmp_path / 'w.pth'}", "model.pretrained_strict=true"))


def test_weights_of_another_model_are_refused(tmp_path):
    torch.save(build_model(model_cfg("model.name=vit_nano")).state_dict(), tmp_path / "w.pth")
    with pytest.raises(ModelError, match="another model|does not fit"):
        build_model(model_cfg("model.name=vit_micro", f"model.pretrained={tmp_path / 'w.pth'}"))
    with pytest.raises(ModelError, match="not found"):
        build_model(model_cfg("model.name=vit_micro", "model.pretrained=/no/such/file.pth"))


def test_a_backbone_file_without_classifier_is_logged_as_getting_a_new_one(tmp_path, caplog):
    """A backbone (no head.*) loaded for fine-tuning got a random classifier with only 'loaded <file>' in the
    log; a head of another size was named. Both are named now; strict loading still refuses the file."""
    state = {k: v for k, v in build_model(model_cfg("model.name=vit_nano")).state_dict().items()
             if not k.startswith("head.")}
    torch.save(state, tmp_path / "backbone.pth")
    with caplog.at_level("INFO", logger="models.pretrained"):
        build_model(model_cfg("model.name=vit_nano", f"model.pretrained={tmp_path / 'backbone.pth'}"))
    assert "(new classifier: head.weight, head.bias)" in caplog.text
    with pytest.raises(ModelError, match=r"does not fit VisionTransformer: missing \['head.weight', 'head.bias'\]"):
        build_model(model_cfg("model.name=vit_nano", f"model.pretrained={tmp_path / 'backbone.pth'}",
                              "model.pretrained_strict=true"))


def test_weights_of_another_token_layout_are_a_model_error_not_a_reshape_traceback(tmp_path):
    """A file of a ViT without a class token resampled its position table by timm's filter into a reshape
    RuntimeError; and a folder given as weights is named as a folder."""
    pooled = build_model(model_cfg("model.name=vit_nano", "model.kwargs.class_token=false",
                                   "model.kwargs.global_pool=avg"))
    torch.save(pooled.state_dict(), tmp_path / "pooled.pth")
    with pytest.raises(ModelError, match=r"pooled.pth: timm's conversion of these weights to VisionTransformer "
                                         r"failed .*another token layout"):
        build_model(model_cfg("model.name=vit_nano", f"model.pretrained={tmp_path / 'pooled.pth'}"))
    with pytest.raises(ModelError, match=r"not found: .* is a folder; give the weights file in it"):
        build_model(model_cfg("model.name=vit_nano", f"model.pretrained={tmp_path}"))


def test_official_swin_layout_is_remapped_to_timm(tmp_path):
    """microsoft/Swin-Transformer checkpoints put patch merging at the end of stages and name the
    classifier `head`; timm's filter renames them, and persistent buffers of the old code are dropped."""
    import re

    source = build_model(model_cfg("model.name=swin_micro", "model.num_classes=10"))
    official = {}
    for key, value in source.state_dict().items():
        key = re.sub(r"layers\.(\d+)\.downsample", lambda m: f"layers.{int(m.group(1)) - 1}.downsample", key)
        official[key.replace("head.fc.", "head.")] = value
    official["layers.0.blocks.0.attn.relative_position_index"] = torch.zeros(16, 16, dtype=torch.long)
    assert "layers.0.downsample.reduction.weight" in official and "head.weight" in official
    torch.save({"model": official}, tmp_path / "official_swin.pth")
    target = build_model(model_cfg("model.name=swin_micro", "model.num_classes=10",
                                   f"model.pretrained={tmp_path / 'official_swin.pth'}",
                                   "model.pretrained_strict=true"))
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name


def test_a_file_of_another_patch_size_is_refused_when_strict_and_resampled_otherwise(tmp_path, caplog):
    import timm
    torch.save(timm.create_model("vit_tiny_patch16_224").state_dict(), tmp_path / "p16.pth")
    asked = ("model.name=vit_tiny_patch16_224", "model.kwargs.patch_size=32",
             f"model.pretrained={tmp_path / 'p16.pth'}")
    with pytest.raises(ModelError, match=r"its patch embedding has \(16, 16\) patches, the model \(32, 32\)"):
        build_model(model_cfg(*asked, "model.pretrained_strict=true"))
    with caplog.at_level("WARNING"):
        model = build_model(model_cfg(*asked))  # fine-tuning: timm's resize, said in the log
    assert model.patch_embed.proj.weight.shape[-2:] == (32, 32) and "resampled" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"), pytest.raises(ModelError, match="a checkpoint of another model"):
        build_model(model_cfg(*asked, "model.kwargs.embed_dim=96"))  # another width too: refused, nothing resampled
    assert "resampled" not in caplog.text


def test_official_deit3_layer_scale_names_load_into_the_same_outputs(tmp_path):
    import re
    import timm
    torch.manual_seed(0)
    source = timm.create_model("deit3_small_patch16_224", img_size=32, num_classes=5).eval()
    official = {re.sub(r"ls(\d)\.gamma", r"gamma_\1", k): v for k, v in source.state_dict().items()}
    assert any("gamma_1" in k for k in official)
    torch.save({"model": official}, tmp_path / "deit3.pth")
    model = build_model(model_cfg("model.name=deit3_small_patch16_224", "model.img_size=32", "model.num_classes=5",
                                  f"model.pretrained={tmp_path / 'deit3.pth'}", "model.pretrained_strict=true"))
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model.eval()(x), source(x), atol=0, rtol=0)


def test_weights_of_a_model_with_a_compiled_submodule_load(tmp_path):
    # torch.compile of one block leaves '_orig_mod.' inside the key, where timm's prefix cleaning does not look
    from models.pretrained import load_pretrained
    source = build_model(model_cfg("model.name=vit_nano", "model.num_classes=3"))
    state = {k.replace("blocks.0.", "blocks.0._orig_mod."): v for k, v in source.state_dict().items()}
    assert any("._orig_mod." in k for k in state)
    torch.save(state, tmp_path / "w.pth")
    target = build_model(model_cfg("model.name=vit_nano", "model.num_classes=3"))
    load_pretrained(target, str(tmp_path / "w.pth"), strict=True)
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name


def test_a_train_py_checkpoint_loads_its_model_entry_not_its_ema_weights(tmp_path):
    """train.py checkpoints hold the raw weights under 'model' and the EMA under 'model_ema'; timm's reader takes
    the EMA when asked to, so the raw ones must be what arrives."""
    from models.pretrained import load_pretrained
    raw = build_model(model_cfg("model.name=vit_nano", "model.num_classes=3")).state_dict()
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in raw.items()}
    torch.save({"model": raw, "model_ema": ema}, tmp_path / "ckpt.pt")
    target = build_model(model_cfg("model.name=vit_nano", "model.num_classes=3"))
    load_pretrained(target, str(tmp_path / "ckpt.pt"), strict=True)
    for name, tensor in raw.items():
        assert torch.equal(target.state_dict()[name], tensor), name


def test_a_file_with_a_key_too_many_or_a_backbone_key_too_few_is_refused_when_fine_tuning(tmp_path):
    """Only the classifier may be new when fine-tuning: a deeper model's extra block, or a backbone tensor the file
    lacks, would be dropped or left at its random init without a word."""
    deeper = build_model(model_cfg("model.name=vit_nano", "model.kwargs.depth=3")).state_dict()
    torch.save(deeper, tmp_path / "deeper.pth")
    with pytest.raises(ModelError, match=r"does not fit VisionTransformer: missing \[\], unexpected \['blocks.2."):
        build_model(model_cfg("model.name=vit_nano", f"model.pretrained={tmp_path / 'deeper.pth'}"))
    partial = build_model(model_cfg("model.name=vit_nano")).state_dict()
    del partial["pos_embed"], partial["blocks.0.attn.qkv.weight"]
    torch.save(partial, tmp_path / "partial.pth")
    with pytest.raises(ModelError, match=r"missing \['pos_embed', 'blocks.0.attn.qkv.weight'\], unexpected \[\]"):
        build_model(model_cfg("model.name=vit_nano", f"model.pretrained={tmp_path / 'partial.pth'}"))


def test_fine_tuning_a_distilled_deit_replaces_both_of_its_classifiers(tmp_path):
    """A distilled DeiT has two classifiers, `head` and `head_dist` (timm's pretrained_cfg names both): a new class
    count replaces both, the rest loads as it is, and strict loading refuses either."""
    arch = ("model.name=deit_tiny_distilled_patch16_224", "model.img_size=32", "model.kwargs.patch_size=8",
            "model.kwargs.embed_dim=32", "model.kwargs.depth=1", "model.kwargs.num_heads=2")
    source = build_model(model_cfg(*arch, "model.num_classes=10")).state_dict()
    torch.save(source, tmp_path / "w.pth")
    target = build_model(model_cfg(*arch, "model.num_classes=3", f"model.pretrained={tmp_path / 'w.pth'}"))
    assert target.head.weight.shape == target.head_dist.weight.shape == (3, 32)
    for name, tensor in source.items():
        if not name.startswith(("head.", "head_dist.")):
            assert torch.equal(target.state_dict()[name], tensor), name
    with pytest.raises(ModelError, match="classifier 'head"):
        build_model(model_cfg(*arch, "model.num_classes=3", f"model.pretrained={tmp_path / 'w.pth'}",
                              "model.pretrained_strict=true"))


def test_hub_weights_come_from_timm_and_no_local_file_is_read(monkeypatch):
    """model.pretrained=hub is timm's download (pretrained=True), never a local file named 'hub'."""
    import timm
    asked = []
    real = timm.create_model

    def offline(name, pretrained=False, **kwargs):  # no network in tests: record the flag, build without weights
        asked.append(pretrained)
        return real(name, pretrained=False, **kwargs)

    monkeypatch.setattr(timm, "create_model", offline)
    # a timm name: the small variants have no hub weights (refused before timm is asked: test_hub_weights_fit.py)
    model = build_model(model_cfg("model.name=vit_tiny_patch16_224", "model.img_size=32", "model.pretrained=hub"))
    # one download (beside the build on the meta device that checks the model's classes before it)
    assert asked.count(True) == 1 and isinstance(model, torch.nn.Module)


def test_an_input_of_part_patches_is_accepted_when_timm_pads_it_and_resizes_the_position_table():
    """timm's dynamic_img_pad pads the input up to whole patches (30 -> 32 at patch 8: a 4 x 4 grid), but the
    position table is built for the rounded-down 3 x 3 grid: without dynamic_img_size the first forward failed in
    a shape error; it is refused when built now (naming the grids, not pixels left unseen: the padding covers
    them), and accepted with dynamic_img_size."""
    padded = ("model.name=vit_nano", "model.img_size=30", "model.kwargs.dynamic_img_pad=true")
    with pytest.raises(ModelError, match=r"pads it to 4 patches, but the position table is built for 3; .*"
                                         r"or model\.kwargs\.dynamic_img_size=true") as refused:
        build_model(model_cfg(*padded))
    assert "unseen" not in str(refused.value)
    model = build_model(model_cfg(*padded, "model.kwargs.dynamic_img_size=true", "model.num_classes=3"))
    assert model(torch.randn(1, 3, 30, 30)).shape == (1, 3)



def test_an_input_of_part_patches_padded_by_timm_is_accepted_for_a_model_without_a_position_table():
    """With model.kwargs.pos_embed=none there is no table for the padded grid to miss: dynamic_img_pad alone runs
    (it was refused, naming pixels left unseen that the padding covers). Reference: the same weights at 32
    pixels, given the image zero-padded on the right and bottom by hand."""
    import torch.nn.functional as F
    common = ("model.name=vit_nano", "model.kwargs.pos_embed=none", "model.num_classes=3")
    model = build_model(model_cfg(*common, "model.img_size=30", "model.kwargs.dynamic_img_pad=true")).eval()
    whole = build_model(model_cfg(*common, "model.img_size=32")).eval()
    whole.load_state_dict(model.state_dict())
    image = torch.randn(2, 3, 30, 30)
    with torch.no_grad():
        torch.testing.assert_close(model(image), whole(F.pad(image, (0, 2, 0, 2))))


def test_an_input_of_part_patches_padded_by_timm_is_refused_for_a_rotary_table_of_the_rounded_down_grid():
    """EVA without an absolute table (use_abs_pos_emb=false) still has a grid-sized table, its rotary one: timm's
    model with the same arguments fails in its first forward (the reference), so the build refuses it."""
    import timm
    arch = dict(img_size=30, patch_size=8, embed_dim=32, depth=1, num_heads=2, dynamic_img_pad=True,
                use_abs_pos_emb=False, num_classes=3)
    with pytest.raises(RuntimeError):
        timm.create_model("eva02_tiny_patch14_224", **arch)(torch.randn(1, 3, 30, 30))
    with pytest.raises(ModelError, match=r"pads it to 4 patches, but the position table is built for 3"):
        build_model(model_cfg("model.name=eva02_tiny_patch14_224", "model.img_size=30", "model.num_classes=3",
                              "model.kwargs={patch_size: 8, embed_dim: 32, depth: 1, num_heads: 2, "
                              "dynamic_img_pad: true, use_abs_pos_emb: false}"))


def test_fine_tuning_at_another_resolution_interpolates_the_position_grid_and_keeps_the_class_token(tmp_path):
    """32 -> 48 pixels at patch 8: the 4 x 4 position grid is resized bicubically to 6 x 6 (timm's filter: antialiased,
    PIL's kernel), the class token's entry stays first and as it is, every other tensor loads unchanged."""
    import torch.nn.functional as F
    source = build_model(model_cfg("model.name=vit_nano", "model.num_classes=3")).state_dict()
    torch.save(source, tmp_path / "w.pth")
    target = build_model(model_cfg("model.name=vit_nano", "model.num_classes=3", "model.img_size=48",
                                   f"model.pretrained={tmp_path / 'w.pth'}")).state_dict()
    pos, dim = source["pos_embed"], source["pos_embed"].shape[-1]
    grid = pos[:, 1:].reshape(1, 4, 4, dim).permute(0, 3, 1, 2)  # row-major patches -> (1, D, H, W)
    expected = F.interpolate(grid, size=(6, 6), mode="bicubic", antialias=True).permute(0, 2, 3, 1)
    assert target["pos_embed"].shape == (1, 1 + 36, dim)
    assert torch.equal(target["pos_embed"][:, :1], pos[:, :1])
    torch.testing.assert_close(target["pos_embed"][:, 1:], expected.reshape(1, 36, dim), atol=1e-6, rtol=1e-5)
    for name, tensor in source.items():
        if name != "pos_embed":
            assert torch.equal(target[name], tensor), name


def test_weights_of_another_input_channel_count_are_a_model_error(tmp_path):
    """A grayscale model's patch embedding differs from an RGB one's in its input channels only (dimension 1): the
    shape check covers every dimension, so this is a ModelError naming the tensor, not torch's size-mismatch
    traceback."""
    import timm
    nano = {k: v for k, v in VARIANTS["vit_nano"].items() if k != "arch"}
    torch.save(timm.create_model(VARIANTS["vit_nano"]["arch"], in_chans=1, **nano).state_dict(), tmp_path / "gray.pth")
    with pytest.raises(ModelError, match=r"'patch_embed.proj.weight' has shape \(32, 1, 8, 8\), the model expects "
                                         r"\(32, 3, 8, 8\): a checkpoint of another model"):
        build_model(model_cfg("model.name=vit_nano", f"model.pretrained={tmp_path / 'gray.pth'}"))


def test_a_vision_file_into_a_language_model_and_a_file_mixing_tensors_with_other_values_are_model_errors(tmp_path):
    """A ViT file given to a GPT holds a patch embedding the GPT lacks; a file whose mapping holds a number beside
    its tensors (a training state saved flat) is no state dict: both are one ModelError, never a KeyError or a
    load of what happens to be a tensor. The ViT's 1000-class head.weight has the GPT's width, so the refusal
    advised model.num_classes=1000, under which the file fails again: it names the keys that differ instead."""
    from configs.schema import ModelConfig
    vit = build_model(model_cfg("model.name=vit_nano")).state_dict()
    torch.save(vit, tmp_path / "vit.pth")
    for strict in (False, True):
        with pytest.raises(ModelError, match=r"vit.pth: weights of another architecture than GPT \(the model's "
                                             r"\['wte.weight', 'wpe.weight'\] are not in it; its \['cls_token', "
                                             r"'pos_embed', 'patch_embed.proj.weight'") as refused:
            build_model(ModelConfig(name="gpt2_nano", num_classes=65, drop_path=0.0, pretrained_strict=strict,
                                    pretrained=str(tmp_path / "vit.pth")))
        assert "num_classes" not in str(refused.value)
        assert str(refused.value).endswith("a vision model's weights (a patch embedding); give a language model's "
                                           "instead (a train.py run of a GPT, or nanoGPT / transformers GPT-2 weights)")
    torch.save({**vit, "epoch": 3}, tmp_path / "flat.pth")
    with pytest.raises(ModelError, match=r"holds no state dict"):
        build_model(model_cfg("model.name=vit_nano", f"model.pretrained={tmp_path / 'flat.pth'}"))


def test_a_language_model_file_into_a_vision_model_names_the_keys_not_a_classifier_size(tmp_path):
    """The reverse: a GPT file's head.weight (65 characters) is a classifier of another size to a ViT, and the
    evaluation's refusal advised model.num_classes=65, under which the file fails again (no patch embedding):
    the keys that differ are named instead."""
    from configs.schema import ModelConfig
    gpt = build_model(ModelConfig(name="gpt2_nano", num_classes=65, drop_path=0.0)).state_dict()
    torch.save(gpt, tmp_path / "gpt.pth")
    with pytest.raises(ModelError, match=r"gpt.pth: weights of another architecture than VisionTransformer "
                                         r"\(the model's \['cls_token', 'pos_embed', 'patch_embed.proj.weight'"
                                         r".*its \['wte.weight', 'wpe.weight'\] are not in the model") as refused:
        build_model(model_cfg("model.name=vit_nano", "model.pretrained_strict=true",
                              f"model.pretrained={tmp_path / 'gpt.pth'}"))
    assert "num_classes" not in str(refused.value)



@pytest.mark.parametrize("overrides", [[], ["model.num_classes=65"], ["model.pretrained_strict=true"]])
def test_a_language_model_file_to_fine_tune_a_vision_model_is_named_with_the_weights_to_give(tmp_path, overrides):
    """Fine-tuning (train.py: model.pretrained_strict=false) drops the GPT file's head.weight as a classifier, or
    loads it where model.num_classes is the vocabulary's; what was left ended in 'does not fit VisionTransformer:
    missing [...], unexpected [...]' with no fix. The file is named as a language model's, with the fix, as an
    evaluation's (strict) refusal of it is."""
    from configs.schema import ModelConfig
    gpt = build_model(ModelConfig(name="gpt2_nano", num_classes=65, drop_path=0.0)).state_dict()
    torch.save(gpt, tmp_path / "gpt.pth")
    with pytest.raises(ModelError) as refused:
        build_model(model_cfg("model.name=vit_nano", f"model.pretrained={tmp_path / 'gpt.pth'}", *overrides))
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'gpt.pth'}: weights of another architecture than VisionTransformer ("), \
        message
    assert "['wte.weight', 'wpe.weight'] are not in the model" in message, message
    assert message.endswith("a language model's weights (models/gpt.py's token and position embeddings); give a "
                            "vision checkpoint instead (a train.py run of an image model, or timm weights of "
                            "model.name)"), message

def test_a_file_trained_at_another_img_size_loads_with_its_position_table_resized_and_said(tmp_path, caplog):
    import timm
    from timm.layers import resample_abs_pos_embed
    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=3)  # a 2x2 grid + class token
    torch.save(source.state_dict(), tmp_path / "at32.pth")
    asked = ("model.name=vit_tiny_patch16_224", "model.num_classes=3", "model.img_size=64",
             f"model.pretrained={tmp_path / 'at32.pth'}", "model.pretrained_strict=true")
    with caplog.at_level("WARNING"):
        model = build_model(model_cfg(*asked))  # evaluation at 64 px: taken, the resize said
    assert "position table of a 2x2 grid resampled to the model's 4x4" in caplog.text
    # the table is timm's bicubic resample of the file's (independent call), not the model's own init
    expected = resample_abs_pos_embed(source.pos_embed.detach(), (4, 4), num_prefix_tokens=1)
    assert torch.allclose(model.pos_embed, expected, atol=1e-6)
    assert model.pretrained_resampled == {"pos_embed_resampled": "2x2->4x4"}  # evaluate.py records it
    caplog.clear()
    with caplog.at_level("WARNING"):
        own = build_model(model_cfg(*asked[:2], "model.img_size=32", *asked[3:]))  # the file's own size: no line
    assert "resampled" not in caplog.text and own.pretrained_resampled == {}


@pytest.mark.parametrize("name, blocks, width, heads, patch, grid", [("vit_micro", 6, 96, 3, 4, 8),
                                                                      ("vit_nano", 2, 32, 2, 8, 4)])
def test_vit_variants_are_the_documented_architectures(name, blocks, width, heads, patch, grid):
    """models/variants.py's comments (the demo's 6-block ViT of 8x8 patches of 4 pixels + cls; the 2-block test
    model), read off the built module rather than off the variant table."""
    from timm.models.vision_transformer import VisionTransformer
    model = build_model(model_cfg(f"model.name={name}"))
    assert type(model) is VisionTransformer and input_size(model) == 32
    assert len(model.blocks) == blocks and model.embed_dim == width
    assert [b.attn.num_heads for b in model.blocks] == [heads] * blocks
    assert model.patch_embed.proj.kernel_size == (patch, patch) and model.patch_embed.grid_size == (grid, grid)
    assert model.pos_embed.shape == (1, grid * grid + 1, width)  # the patches and the class token


@pytest.mark.parametrize("name, depths, heads, width, patch, grid", [("swin_micro", (2, 2, 2), (2, 4, 8), 48, 2, 16),
                                                                      ("swin_nano", (1, 1), (2, 4), 32, 4, 8)])
def test_swin_variants_are_the_documented_architectures(name, depths, heads, width, patch, grid):
    """Swin with windows of 4 on 32-pixel inputs: swin_micro's three stages on 16x16 tokens with two patch mergings,
    swin_nano's two stages on 8x8 tokens with one."""
    from timm.models.swin_transformer import PatchMerging, SwinTransformer
    model = build_model(model_cfg(f"model.name={name}"))
    assert type(model) is SwinTransformer and input_size(model) == 32 and model.embed_dim == width
    assert tuple(len(stage.blocks) for stage in model.layers) == depths
    assert tuple(stage.blocks[0].attn.num_heads for stage in model.layers) == heads
    assert all(b.attn.window_size == (4, 4) for stage in model.layers for b in stage.blocks)
    assert model.patch_embed.proj.kernel_size == (patch, patch) and model.patch_embed.grid_size == (grid, grid)
    assert sum(isinstance(stage.downsample, PatchMerging) for stage in model.layers) == len(depths) - 1


def test_the_input_size_of_a_model_without_a_patch_embedding_is_its_pretrained_cfgs():
    """A timm CNN has no patch_embed: its square input is the side of pretrained_cfg's (3, 224, 224)."""
    with torch.device("meta"):
        assert input_size(build_model(model_cfg("model.name=resnet18"))) == 224


@pytest.mark.parametrize("kwargs, prefix", [(["model.kwargs.reg_tokens=2"], 3),
                                            (["model.kwargs.no_embed_class=true"], 0)])
def test_a_position_table_with_register_tokens_or_no_class_entry_is_resized_on_its_grid(tmp_path, caplog, kwargs,
                                                                                         prefix):
    """The table's prefix entries (class and register tokens; none with no_embed_class) are not grid cells: the
    log names the file's 4x4 grid (32 pixels at patch 8) and the model's 6x6 (48 pixels), and the table is timm's
    resample of the file's, computed here by an independent call."""
    from timm.layers import resample_abs_pos_embed
    source = build_model(model_cfg("model.name=vit_nano", *kwargs))
    assert source.pos_embed.shape[1] == prefix + 16
    torch.save(source.state_dict(), tmp_path / "at32.pth")
    with caplog.at_level("WARNING"):
        model = build_model(model_cfg("model.name=vit_nano", *kwargs, "model.img_size=48",
                                      f"model.pretrained={tmp_path / 'at32.pth'}", "model.pretrained_strict=true"))
    assert "position table of a 4x4 grid resampled to the model's 6x6" in caplog.text
    expected = resample_abs_pos_embed(source.pos_embed.detach(), (6, 6), num_prefix_tokens=prefix)
    torch.testing.assert_close(model.pos_embed.detach(), expected, atol=1e-6, rtol=1e-5)
