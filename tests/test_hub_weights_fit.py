"""model.pretrained=hub against the model it is loaded into, where a local file of the same weights is checked
(models/pretrained.py): the same refusal, record and log line for another patch size or window size, a timm name
of an unknown tag refused in one line, and hub weights that do not fit the model's token layout named as such, not
as a failure to fetch them. The hub is a Hugging Face cache made here (offline: nothing is fetched)."""
import logging
import re

import pytest
import timm
import torch
from safetensors.torch import load_file
from timm.layers import resample_patch_embed

from conftest import run_entry
from hub_cache import make_hub_cache, serve_hub_cache
from configs import load_config
from models import ModelError, build_model
from models.variants import VARIANTS

VIT = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"  # 1000 classes at 224 pixels, patches of 16
SWIN = "swin_tiny_patch4_window7_224.ms_in1k"  # windows of 7


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache holding random weights of VIT and SWIN as timm's hub copies, and those files."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    return root, make_hub_cache(root, [VIT, SWIN])


@pytest.fixture
def files(hub_cache, monkeypatch):
    """{model name: a local file of its hub weights}, the hub served from the cache made here."""
    root, files = hub_cache
    serve_hub_cache(monkeypatch, root)
    return files


def model_cfg(name, *overrides):
    return load_config(None, [f"model.name={name}", *overrides]).model


def refusals(files, name, *overrides):
    """The error lines of the hub weights of `name` and of a local file of the same weights (`files`), each without
    its source."""
    said = []
    for source in ("hub", files[name]):
        with pytest.raises(ModelError) as refused:
            build_model(model_cfg(name, f"model.pretrained={source}", *overrides))
        said.append(str(refused.value))
    hub, file = said
    assert hub.startswith(f"model.pretrained=hub ({name}): "), hub
    assert file.startswith(f"{files[name]}: "), file
    return hub.partition(": ")[2], file.partition(": ")[2]


def test_strict_hub_weights_of_another_patch_size_are_refused_as_a_local_file_is(files):
    hub, file = refusals(files, VIT, "model.pretrained_strict=true", "model.kwargs.patch_size=8")
    assert hub == file and "its patch embedding has (16, 16) patches, the model (8, 8)" in hub, (hub, file)


def test_hub_swin_tables_of_another_window_size_are_recorded_and_logged_as_a_local_files(files, caplog):
    said = {}
    for source in ("hub", files[SWIN]):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            model = build_model(model_cfg(SWIN, f"model.pretrained={source}", "model.pretrained_strict=true",
                                          "model.kwargs.window_size=4"))
        lines = [r.getMessage() for r in caplog.records if "relative position bias" in r.getMessage()]
        assert len(lines) == 1, caplog.text
        said[source] = (model.pretrained_resampled, lines[0])
    # 7x7 windows: (2*7-1)^2 = 169 rows per table in the weights, (2*4-1)^2 = 49 in the model
    assert said["hub"][0] == said[files[SWIN]][0] == {"relative_position_bias_resampled": "7x7->4x4"}
    assert said["hub"][1] == said[files[SWIN]][1].replace(files[SWIN], f"model.pretrained=hub ({SWIN})")


@pytest.mark.parametrize("layout", [["model.kwargs.class_token=false", "model.kwargs.global_pool=avg"],
                                    ["model.kwargs.reg_tokens=4"]])
def test_cached_hub_weights_of_another_token_layout_are_named_as_a_local_file_is_not_as_unfetched(files, layout):
    hub, file = refusals(files, VIT, *layout)
    assert hub == file and "another token layout" in hub, (hub, file)


def test_hub_weights_not_in_the_cache_offline_are_still_a_failure_to_fetch(files):
    with pytest.raises(ModelError, match=r"^could not fetch hub weights for 'vit_tiny_patch16_224.augreg_in21k' "
                                         r"\(.*\); without internet, give a local file"):
        build_model(model_cfg("vit_tiny_patch16_224.augreg_in21k", "model.pretrained=hub"))


def test_an_unknown_pretrained_tag_is_one_error_line_with_the_known_tags(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_entry("train.py", ["model.name=vit_tiny_patch16_224.nosuchtag", "model.pretrained=hub",
                                          "model.pretrained_strict=true", "data.dataset=digits",
                                          "model.img_size=32", f"out_dir={tmp_path / 'run'}"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and not any("Traceback" in line for line in lines), err
    last = lines[-1]
    assert last.startswith("error: model.name=vit_tiny_patch16_224.nosuchtag: ") and "'nosuchtag'" in last, last
    known = [name.partition(".")[2] for name in timm.list_pretrained("vit_tiny_patch16_224.*")]
    assert known and all(tag in last for tag in known), (known, last)


def loaded_lines(caplog, cfg, *words):
    """build_model(`cfg`) and its log lines holding every one of `words`."""
    caplog.clear()
    with caplog.at_level(logging.INFO):
        model = build_model(cfg)
    return model, [r.getMessage() for r in caplog.records if all(w in r.getMessage() for w in words)]


def test_fine_tuned_hub_weights_of_another_patch_size_are_logged_and_recorded_as_a_local_files(files, caplog):
    said = {}
    for source in ("hub", files[VIT]):
        # 112 / 8 = 224 / 16: the position table's grid stays, the patch embedding alone is resampled
        model, lines = loaded_lines(caplog, model_cfg(VIT, f"model.pretrained={source}", "model.img_size=112",
                                                      "model.num_classes=10", "model.kwargs.patch_size=8"),
                                    "patch size")
        assert len(lines) == 1, caplog.text
        said[source] = (model.pretrained_resampled, lines[0].partition(": ")[2])
        # the weights are the hub's resized as timm's FlexiViT resize does (an independent reference)
        stored = load_file(files[VIT])["patch_embed.proj.weight"]
        assert torch.allclose(model.state_dict()["patch_embed.proj.weight"], resample_patch_embed(stored, [8, 8]),
                              atol=1e-6)
    assert said["hub"] == said[files[VIT]] == ({}, "patch size (16, 16) resampled to the model's (8, 8) (timm's "
                                                   "patch-embedding resize)"), said


def test_fine_tuned_hub_weights_name_the_sink_parameters_left_at_zero_as_a_local_file_does(files, caplog):
    counts = {}
    for source in ("hub", files[VIT]):
        model, lines = loaded_lines(caplog, model_cfg(VIT, f"model.pretrained={source}", "model.num_classes=10",
                                                      "model.attn=kv_bias"), "attention-sink parameters not in the")
        assert len(lines) == 1, caplog.text
        counts[source] = int(re.search(r"(\d+) attention-sink parameters not in the \w+ keep their zero init",
                                       lines[0])[1])
    # kv_bias adds a key and a value slot (sink_k, sink_v) to each of the 12 blocks' attentions
    assert counts["hub"] == counts[files[VIT]] == 12 * 2, counts
    assert all(not torch.any(p) for n, p in model.named_parameters() if ".sink_" in n)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hub_weights_for_a_small_variant_are_refused_before_any_lookup(variant, monkeypatch):
    def looked_up(*args, **kwargs):
        raise AssertionError("the hub weights were looked up")
    monkeypatch.setattr(timm, "create_model", looked_up)
    monkeypatch.setattr(timm.models, "get_pretrained_cfg", looked_up)
    with pytest.raises(ModelError) as refused:
        build_model(model_cfg(variant, "model.pretrained=hub", "model.pretrained_strict=true"))
    said = str(refused.value)
    assert said.startswith(f"model.pretrained=hub: model.name={variant} is one of models/variants.py's small "
                           f"variants, which have no hub weights"), said
    assert "model.pretrained=PATH" in said and "a timm model name" in said, said


def test_train_py_refuses_hub_weights_for_a_small_variant_in_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_entry("train.py", ["model.name=vit_nano", "model.pretrained=hub", "data.dataset=digits",
                                          f"out_dir={tmp_path / 'run'}"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and not any("Traceback" in line for line in lines), err
    assert lines[-1].startswith("error: model.pretrained=hub: model.name=vit_nano is one of models/variants.py"), err
