"""Tensors of a weights file that timm's conversion (`checkpoint_filter_fn`) leaves out are named: logged when
fine-tuning, refused when strict. An old in21k ViT file's pre-logits layer vanished without a word, even strict;
renames, copies in another layout and the buffers a model rebuilds are no loss and are not named."""
import logging
import re

import pytest
import timm
import torch

from configs.schema import ModelConfig
from models import ModelError, build_model
from models.dropped_keys import dropped_by_filter

PRE_LOGITS = ("pre_logits.fc.weight", "pre_logits.fc.bias")


def with_pre_logits(tmp_path) -> tuple[str, dict]:
    """A vit_nano file (7 classes) with an in21k-style pre-logits layer, and its state dict."""
    torch.manual_seed(0)
    state = {k: torch.randn_like(v) if v.is_floating_point() else v
             for k, v in build_model(ModelConfig(name="vit_nano", num_classes=7)).state_dict().items()}
    state.update({PRE_LOGITS[0]: torch.randn(32, 32), PRE_LOGITS[1]: torch.randn(32)})
    path = str(tmp_path / "in21k_style.pth")
    torch.save(state, path)
    return path, state


def test_a_pre_logits_layer_is_named_when_fine_tuning_and_the_rest_loads(tmp_path, caplog):
    path, state = with_pre_logits(tmp_path)
    with caplog.at_level(logging.INFO, logger="models.pretrained"):
        model = build_model(ModelConfig(name="vit_nano", num_classes=7, pretrained=path))
    left_out = [r.getMessage() for r in caplog.records if "left out by timm's conversion" in r.getMessage()]
    assert len(left_out) == 1 and left_out[0].endswith(": " + ", ".join(PRE_LOGITS)), caplog.text
    for key, value in model.state_dict().items():  # every tensor the model has is the file's
        assert torch.equal(value, state[key]), key


def test_a_pre_logits_layer_is_refused_when_strict_with_one_line_naming_the_keys_and_the_fix(tmp_path):
    path, _ = with_pre_logits(tmp_path)
    with pytest.raises(ModelError) as refused:
        build_model(ModelConfig(name="vit_nano", num_classes=7, pretrained=path, pretrained_strict=True))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{path}: timm's conversion of these weights")
    assert f"({list(PRE_LOGITS)})" in message and "model.pretrained_strict=false" in message


def test_dropped_by_filter_counts_renames_views_copies_and_rebuilt_buffers_as_carried():
    """The diff on its own: a rename (same tensor), a view (a transpose), a copy in another layout (transposed
    and made contiguous) and the harmless buffers are carried; a tensor whose values are nowhere is dropped,
    also when another output has its size."""
    from models.dropped_keys import dropped_by_filter
    a, b, c, d, e = (torch.randn(3, 4) for _ in range(5))
    before = {"a": a, "renamed": b, "viewed": c, "copied": d, "gone": e, "blocks.0.attn.bias": torch.ones(1, 1),
              "mask_token": torch.zeros(1, 4), "layers.0.blocks.0.attn.relative_position_index": torch.arange(9),
              "layers.0.blocks.0.attn_mask": torch.zeros(2, 2)}
    after = {"a": a, "new_name": b, "c_t": c.t(), "d_t": d.t().contiguous(), "other": torch.randn(3, 4)}
    assert dropped_by_filter(before, after) == ["gone"]


def test_official_layouts_that_timm_converts_load_strict_without_a_line(tmp_path, caplog):
    """DINOv2's layout with registers (register_tokens renamed, mask_token dropped, the class entry folded) and
    transformers' GPT-2 (Conv1D weights copied transposed, its causal-mask buffers dropped) lose nothing."""
    transformers = pytest.importorskip("transformers")
    kw = {"embed_dim": 32, "depth": 2, "num_heads": 2}
    reference = timm.create_model("vit_small_patch14_reg4_dinov2", img_size=28, num_classes=0, **kw).state_dict()
    cls_entry = torch.randn(1, 1, 32)
    official = {k: v for k, v in reference.items() if k not in ("reg_token", "pos_embed", "cls_token")}
    official.update(register_tokens=reference["reg_token"], mask_token=torch.zeros(1, 32),
                    pos_embed=torch.cat([cls_entry, reference["pos_embed"]], 1),
                    cls_token=reference["cls_token"] - cls_entry)
    torch.save(official, tmp_path / "dinov2.pth")
    config = transformers.GPT2Config(vocab_size=65, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    gpt2 = transformers.GPT2LMHeadModel(config).state_dict()
    gpt2.update({f"transformer.h.{i}.attn.bias": torch.ones(1, 1, 32, 32) for i in range(2)})  # older files' mask
    torch.save(gpt2, tmp_path / "gpt2.pt")
    with caplog.at_level(logging.WARNING):
        build_model(ModelConfig(name="vit_small_patch14_reg4_dinov2", img_size=28, num_classes=0, kwargs=kw,
                                pretrained=str(tmp_path / "dinov2.pth"), pretrained_strict=True))
        build_model(ModelConfig(name="gpt2_nano", num_classes=65, drop_path=0.0, kwargs={"gelu": "tanh"},
                                pretrained=str(tmp_path / "gpt2.pt"), pretrained_strict=True))
    assert not re.search("left out|no place", caplog.text), caplog.text


def naive_dropped(before: dict, after: dict, rebuilt=frozenset()) -> list[str]:
    """The reference: every comparison in full, each dropped candidate against every unused copy by its sorted
    values. A copy (an output that is no tensor of the file, nor a view of one) carries one tensor of the file;
    tied keys (one tensor) go together; the tensor itself under any name, or a view of it, carries it."""
    from models.dropped_keys import HARMLESS

    def memory(t):
        return t.data_ptr(), t.dtype, t.numel()

    new = [v for k, v in after.items() if k not in before or v is not before[k]]
    copies = [u for u in new if all(memory(u) != memory(v) for v in before.values())]
    used, by_copy, dropped = set(), [], []
    for key, value in before.items():
        if key in after or HARMLESS.search(key) or key in rebuilt:
            continue
        if any(memory(u) == memory(value) for u in after.values()) or any(value is v for v in by_copy):
            continue
        for i, u in enumerate(copies):
            if i not in used and u.numel() == value.numel() and u.dtype == value.dtype and torch.equal(
                    u.flatten().sort().values, value.flatten().sort().values):
                used.add(i)
                by_copy.append(value)
                break
        else:
            dropped.append(key)
    return dropped


@pytest.mark.parametrize("seed", range(12))
def test_dropped_by_filter_agrees_with_a_naive_matching_of_sorted_values(seed):
    """Random conversions of a file of few shapes and many equal tensors (renames, views, ties, copies as they
    are, transposed or permuted into another shape, outputs of the same size that are no copy, tensors left out):
    the same keys are named as by the reference, which sorts every pair."""
    from models.dropped_keys import dropped_by_filter
    g = torch.Generator().manual_seed(seed)
    pool = [torch.randint(-3, 4, (3, 4), generator=g).float() for _ in range(4)]  # few values: many equal tensors
    before, after = {}, {}
    for i in range(24):
        value = pool[int(torch.randint(len(pool), (1,), generator=g))].clone()
        if i % 7 == 3:
            value = before[f"k{i - 1}"]  # tied to the previous key
        before[f"k{i}"] = value
        kind = int(torch.randint(7, (1,), generator=g))
        if kind == 0:
            after[f"k{i}"] = value
        elif kind == 1:
            after[f"r{i}"] = value  # renamed
        elif kind == 2:
            after[f"v{i}"] = value.t()  # a view
        elif kind == 3:
            after[f"c{i}"] = value.t().contiguous()  # a transposed copy
        elif kind == 4:
            perm = torch.randperm(12, generator=g)
            after[f"p{i}"] = value.flatten()[perm].reshape(2, 6)  # a copy in another shape and order
        elif kind == 5:
            after[f"o{i}"] = pool[int(torch.randint(len(pool), (1,), generator=g))].clone().reshape(6, 2)
        # kind 6: left out
    assert dropped_by_filter(before, after) == naive_dropped(before, after)


def test_one_copy_carries_one_tensor_and_tied_keys_are_one_tensor():
    from models.dropped_keys import dropped_by_filter
    x = torch.randn(3, 4)
    copy = {"w": x.t().contiguous()}
    assert dropped_by_filter({"a": x, "b": x.clone()}, copy) == ["b"]  # two tensors of these values, one copy
    assert dropped_by_filter({"a": x, "b": x}, copy) == []  # one tensor under two keys (tied)
    assert dropped_by_filter({"a": x, "b": x}, {"a": x}) == []  # the filter kept one of the two names


def transformers_gpt2(depth: int, width: int = 64) -> dict:
    """A transformers GPT-2 state dict of random values (Conv1D weights, lm_head tied to wte, the causal-mask
    buffers of older files)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=65, n_positions=32, n_embd=width, n_layer=depth, n_head=2)
    state = {k: torch.randn_like(v) if v.is_floating_point() else v
             for k, v in transformers.GPT2LMHeadModel(config).state_dict().items()}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    for i in range(depth):
        state[f"transformer.h.{i}.attn.bias"] = torch.ones(1, 1, 32, 32)
        state[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return state


@pytest.mark.parametrize("depth", [2, 12])
def test_a_transformers_gpt2_file_costs_one_full_comparison_per_conv1d_copy_and_no_sort(depth, monkeypatch):
    """The diff of a file of transposed copies is linear in depth: its 4 Conv1D copies per layer are each found
    with one comparison of the whole tensor (not one per same-size tensor of the other layers) and nothing is
    sorted (a full copy per tensor); the cost is counted, not timed."""
    from models.dropped_keys import dropped_by_filter
    from models.gpt import checkpoint_filter_fn
    width = 64
    before = transformers_gpt2(depth, width)
    model = build_model(ModelConfig(name="gpt2_nano", num_classes=65, drop_path=0.0,
                                    kwargs={"depth": depth, "embed_dim": width}))
    after = checkpoint_filter_fn(dict(before), model)
    full, sorts = [], []
    equal = torch.equal

    def counted_equal(a, b):
        if a.numel() >= width * width:  # the smallest Conv1D weight (attn.c_proj); one line of it is `width`
            full.append(a.shape)
        return equal(a, b)

    def counted_sort(*a, **k):
        sorts.append(1)
        return sort(*a, **k)

    sort, tensor_sort = torch.sort, torch.Tensor.sort
    monkeypatch.setattr(torch, "equal", counted_equal)
    monkeypatch.setattr(torch, "sort", counted_sort)
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: (sorts.append(1), tensor_sort(self, *a, **k))[1])
    assert dropped_by_filter(before, after) == []
    assert sorts == [] and len(full) <= 4 * depth, (len(sorts), len(full))


def test_swinv2_files_with_the_buffers_the_model_rebuilds_load_strict_and_fine_tune_without_a_line(tmp_path, caplog):
    """Official SwinV2 files store each attention's relative_coords_table and relative_position_index, which timm's
    filter skips and the model rebuilds (non-persistent buffers): no loss, so neither refused nor named."""
    kw = {"embed_dim": 32, "depths": [1, 1, 1, 1], "num_heads": [1, 2, 4, 8]}
    model = build_model(ModelConfig(name="swinv2_tiny_window8_256", num_classes=5, kwargs=kw))
    state = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    rebuilt = ("relative_coords_table", "relative_position_index")
    buffers = {k: v for k, v in model.named_buffers() if k.endswith(rebuilt)}
    assert len(buffers) == 8 and not set(buffers) & set(state)  # 4 attentions, each buffer not saved by the model
    path = str(tmp_path / "swinv2_official.pth")
    torch.save({**state, **buffers}, path)
    with caplog.at_level(logging.WARNING):
        for strict in (True, False):
            loaded = build_model(ModelConfig(name="swinv2_tiny_window8_256", num_classes=5, kwargs=kw,
                                             pretrained=path, pretrained_strict=strict))
            for key, value in loaded.state_dict().items():
                assert torch.equal(value, state[key]), key
    assert not re.search("left out|no place", caplog.text), caplog.text


@pytest.mark.parametrize("before,copy", [
    (torch.triu(torch.full((4, 4), float("-inf")), 1), lambda t: t.reshape(2, 8).clone()),  # a -inf attention mask
    (torch.tensor([[[1.0, float("inf")], [2.0, 3.0]]]), lambda t: t.permute(2, 1, 0).contiguous()),
    (torch.tensor([1.0, float("inf")]), lambda t: t.flip(0).clone()),
])
def test_a_copy_of_a_tensor_holding_inf_is_carried(before, copy):
    """Its float64 sums are inf, which no tolerance compares (inf - inf is NaN): the values decide, sorted."""
    assert dropped_by_filter({"x": before}, {"y": copy(before)}) == []
    assert dropped_by_filter({"x": before}, {"y": copy(before) + 1}) == ["x"]  # other values: dropped
