"""The V rows of a fused qkv: `find_pairs` refuses a qkv laid out per head or in another order (cd/values.py).

A toy attention block of one's own, in timm's names, whose qkv output is split as [Q; K; V] in thirds, per head
([q_h k_h v_h], GPT-NeoX / Bloom) or as [K; V; Q]. The reference is the layout the toy's forward actually reads,
written here independently of cd/: only the thirds layout has V at rows [2D:3D].
"""
from __future__ import annotations

import contextlib
import weakref

import pytest
import timm
import torch
from torch import nn
from torch.nn import functional as F

import cd_models  # noqa: F401  (one CPU thread for tiny models)
from cd import UnsupportedModelError, find_pairs
from models.attention_sinks import use_sink_attention

D, TOKENS = 12, 5


class _Attn(nn.Module):
    def __init__(self, layout: str, heads: int, call: str = "layer"):
        super().__init__()
        self.layout, self.heads, self.call = layout, heads, call
        self.masked_rows = 0  # the first queries that every key is masked for (their output: NaN)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h, hd = self.heads, D // self.heads
        if self.call == "matmul":  # the weight's transpose, as a hand-written attention may multiply
            y = x @ self.qkv.weight.T + self.qkv.bias
        elif self.call == "add_":  # the bias added in place: the caller reads y, not add_'s return value
            y = x @ self.qkv.weight.t()
            y.add_(self.qkv.bias)
        elif self.call == "iadd":
            y = x @ self.qkv.weight.t()
            y += self.qkv.bias
        elif self.call == "add_out":
            y = x @ self.qkv.weight.t()
            torch.add(y, self.qkv.bias, out=y)
        elif self.call == "left":  # the weight on the left: the product's last dim is the tokens, not qkv's rows
            y = (self.qkv.weight @ x.transpose(-1, -2)).transpose(-1, -2) + self.qkv.bias
        elif self.call == "addmm":  # bias first, as transformers' Conv1D (GPT-2) multiplies
            y = torch.addmm(self.qkv.bias, x.reshape(b * n, D), self.qkv.weight.t()).view(b, n, 3 * D)
        elif self.call == "einsum":
            y = torch.einsum("bnd,ed->bne", x, self.qkv.weight) + self.qkv.bias
        elif self.call == "cast":  # float32 master weights computed in bfloat16, bias cast too (not a Parameter)
            x = x.to(torch.bfloat16)
            y = F.linear(x, self.qkv.weight.to(x.dtype), self.qkv.bias.to(x.dtype))
        else:
            y = self.qkv(x)
        if self.layout == "thirds":  # timm: rows [Q; K; V]
            q, k, v = y.view(b, n, 3, h, hd).permute(2, 0, 3, 1, 4)
        elif self.layout == "per_head":  # GPT-NeoX / Bloom: rows [q_0 k_0 v_0 q_1 k_1 v_1]
            q, k, v = y.view(b, n, h, 3, hd).permute(3, 0, 2, 1, 4)
        else:  # rows [K; V; Q]
            k, v, q = y.view(b, n, 3, h, hd).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / hd ** 0.5
        scores[..., :self.masked_rows, :] = float("-inf")
        out = torch.softmax(scores, dim=-1) @ v
        out = out.transpose(1, 2).reshape(b, n, D)
        if self.call == "cast":
            return F.linear(out, self.proj.weight.to(out.dtype), self.proj.bias.to(out.dtype)).float()
        if self.call == "addmm":
            return torch.addmm(self.proj.bias, out.reshape(b * n, D), self.proj.weight.t()).view(b, n, D)
        return self.proj(out)


class _Block(nn.Module):
    def __init__(self, layout: str, heads: int, call: str = "layer"):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(D), _Attn(layout, heads, call)
        self.norm2, self.mlp = nn.LayerNorm(D), nn.Module()
        self.mlp.fc1, self.mlp.act, self.mlp.fc2 = nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.mlp.fc2(self.mlp.act(self.mlp.fc1(self.norm2(x))))


class _Net(nn.Module):
    def __init__(self, layout: str, noisy: bool = False, heads: int = 2, call: str = "layer"):
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.blocks = nn.Sequential(_Block("thirds", heads), _Block(layout, heads, call))
        self.noisy = noisy

    def example_input(self) -> torch.Tensor:
        return torch.empty(1, TOKENS, 3, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.noisy:  # noise in every mode, as an input augmentation inside the model would draw
            x = x + 0.01 * torch.randn_like(x)
        return self.blocks(self.embed(x))


@pytest.mark.parametrize("layout", ["per_head", "kvq"])
def test_a_fused_qkv_whose_rows_2d_3d_are_not_v_is_refused_naming_the_block(layout):
    torch.manual_seed(0)
    with pytest.raises(UnsupportedModelError, match=r"block 'blocks\.1' \(_Block\).*rows 24:36 of blocks\.1\.attn\."
                       r"qkv's output set to zero.*\[Q; K; V\].*separate q, k, v.*verify=False"):
        find_pairs(_Net(layout))


def test_a_qkv_weight_multiplied_by_hand_is_checked_too():
    torch.manual_seed(0)
    assert len(find_pairs(_Net("thirds", call="matmul"))) == 8
    with pytest.raises(UnsupportedModelError, match=r"block 'blocks\.1'.*rows 24:36 .*not zero"):
        find_pairs(_Net("per_head", call="matmul"))


@pytest.mark.parametrize("call", ["add_", "iadd", "add_out"])
def test_a_bias_added_in_place_to_the_product_is_followed(call):
    # y = x @ w.t(); y.add_(b): the tensor the model reads on is y itself, so its V columns must be zero there
    torch.manual_seed(0)
    assert len(find_pairs(_Net("thirds", call=call))) == 8
    with pytest.raises(UnsupportedModelError, match=r"block 'blocks\.1'.*rows 24:36 .*not zero"):
        find_pairs(_Net("per_head", call=call))


def test_addmms_bias_is_not_taken_for_projs_input():
    # addmm(bias, x, w): proj's bias (nonzero) is added, not multiplied; only x is proj's input
    torch.manual_seed(0)
    assert len(find_pairs(_Net("thirds", call="addmm"))) == 8
    with pytest.raises(UnsupportedModelError, match=r"block 'blocks\.1'.*rows 24:36 .*not zero"):
        find_pairs(_Net("per_head", call="addmm"))


def test_a_bias_cast_to_the_activations_dtype_is_not_taken_for_projs_input():
    # proj's bias, cast to bfloat16, is a plain tensor, not zero: only what multiplies proj's weight is its input
    torch.manual_seed(0)
    assert len(find_pairs(_Net("thirds", call="cast"))) == 8
    with pytest.raises(UnsupportedModelError, match=r"block 'blocks\.1'.*rows 24:36 .*not zero"):
        find_pairs(_Net("per_head", call="cast"))


@pytest.mark.parametrize("call", ["einsum", "left"])
def test_a_qkv_weight_multiplied_in_a_way_the_check_cannot_follow_is_refused_not_passed(call):
    # with the weight on the left (W @ x^T) the product's columns are tokens: no column is V, none is set to zero,
    # and a [Q; K; V] qkv is refused as not followed, not as laid out otherwise
    torch.manual_seed(0)
    with pytest.raises(UnsupportedModelError, match=r"block 'blocks\.1'.*multiplies by blocks\.1\.attn\.qkv\.weight "
                       r"in a way CD does not follow.*verify=False"):
        find_pairs(_Net("thirds" if call == "left" else "per_head", call=call))


def test_the_thirds_layout_passes_and_pairs_proj_with_rows_2d_3d():
    torch.manual_seed(0)
    model = _Net("thirds")
    proj = [p for p in find_pairs(model) if p.role == "proj"]
    assert [(p.block, p.upstream_rows) for p in proj] == [("blocks.0", (2 * D, 3 * D)), ("blocks.1", (2 * D, 3 * D))]


def test_a_per_head_qkv_with_one_head_is_the_thirds_layout_and_passes():
    torch.manual_seed(0)  # [q_0 k_0 v_0] of one head is [Q; K; V]
    assert len(find_pairs(_Net("per_head", heads=1))) == 8


@pytest.mark.parametrize("layout", ["thirds", "per_head"])
def test_weights_training_flags_and_random_state_are_unchanged(layout):
    torch.manual_seed(0)
    model = _Net(layout, noisy=True).train()
    model.blocks[0].eval()  # a mix of flags, which one model.train() at the end would not restore
    flags = [m.training for m in model.modules()]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    try:
        find_pairs(model)
    except UnsupportedModelError:
        assert layout == "per_head"
    assert [m.training for m in model.modules()] == flags
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


class _Tracker(nn.Module):
    """Keeps the running max |x| of its input in a buffer, in every mode (as an activation probe does)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("amax", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.amax.copy_(torch.maximum(self.amax, x.abs().max()))
        return x


def test_a_buffer_the_forward_updates_in_eval_mode_is_unchanged():
    torch.manual_seed(0)
    model = _Net("thirds")
    model.embed = nn.Sequential(model.embed, _Tracker())
    assert len(find_pairs(model)) == 8
    assert model.embed[1].amax.item() == 0.0  # its value before: no forward of the user's ran


class _Grower(nn.Module):
    """Appends the max |x| of each input to a buffer it grows in place (set_), as a cache of past steps may."""

    def __init__(self):
        super().__init__()
        self.register_buffer("history", torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.history.set_(torch.cat([self.history, x.abs().max().reshape(1)]))
        return x


def test_a_buffer_the_forward_resizes_in_place_is_given_back_its_shape_and_values():
    torch.manual_seed(0)
    model = _Net("thirds")
    model.embed = nn.Sequential(model.embed, _Grower())
    before = model.embed[1].history
    assert len(find_pairs(model)) == 8
    assert model.embed[1].history is before and before.shape == (0,)


class _LossNet(_Net):
    """Returns its loss when given labels: a 1-D tensor along the batch, next to the (batch, tokens, 3) input."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(super().forward(x).mean(dim=1), labels)


@pytest.mark.parametrize("layout", ["thirds", "per_head"])
def test_an_example_with_labels_along_the_batch_is_checked_whole(layout):
    # one sample of x against 8 labels fails in cross_entropy; the meta check runs the whole example and passes
    torch.manual_seed(0)
    example = (torch.randn(8, TOKENS, 3), torch.randint(0, D, (8,)))
    if layout == "thirds":
        assert len(find_pairs(_LossNet(layout), example_input=example)) == 8
    else:
        with pytest.raises(UnsupportedModelError, match=r"block 'blocks\.1'.*rows 24:36 .*not zero"):
            find_pairs(_LossNet(layout), example_input=example)


@pytest.mark.parametrize("layout", ["thirds", "per_head"])
def test_a_query_row_with_every_key_masked_is_nan_and_not_taken_for_v(layout):
    # softmax of a row of -inf is NaN, and NaN * 0 too: the other rows still tell the layouts apart
    torch.manual_seed(0)
    model = _Net(layout)
    model.blocks[1].attn.masked_rows = 1
    if layout == "thirds":
        assert len(find_pairs(model)) == 8
    else:
        with pytest.raises(UnsupportedModelError, match=r"block 'blocks\.1'.*rows 24:36 .*not zero"):
            find_pairs(model)


def test_a_proj_input_with_no_finite_value_is_refused_as_unchecked():
    torch.manual_seed(0)
    model = _Net("thirds")
    model.blocks[1].attn.masked_rows = TOKENS
    with pytest.raises(UnsupportedModelError, match=r"rows of blocks\.1\.attn\.qkv are V.*no finite value.*"
                       r"example_input=.*verify=False"):
        find_pairs(model)


def test_a_meta_example_of_floats_is_made_nonzero_so_that_a_model_without_biases_is_still_told_apart():
    # without biases a zero input gives zero everywhere, V or not: the probe's values for a meta example are not 0
    torch.manual_seed(0)
    model = _Net("per_head")
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.bias = None
    with pytest.raises(UnsupportedModelError, match=r"block 'blocks\.1'.*rows 24:36 .*not zero"):
        find_pairs(model)


def test_a_meta_boolean_mask_attends_every_key():
    # timm's explicit attention with a boolean mask (True: attend) that the probe made from a meta example
    class MaskNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(timm.models.vision_transformer.Block(D, 2) for _ in range(2))
            for block in self.blocks:
                block.attn.fused_attn = False

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x, attn_mask=mask)
            return x

    torch.manual_seed(0)
    example = (torch.empty(2, TOKENS, D, device="meta"), torch.empty(2, 1, TOKENS, TOKENS, dtype=torch.bool,
                                                                      device="meta"))
    assert len(find_pairs(MaskNet(), example_input=example)) == 8


class _FrozenNet(_Net):
    """Freezes its embedding in train(), as MMDetection's Swin freezes its first stages (`frozen_stages`)."""

    def train(self, mode: bool = True):
        super().train(mode)
        self.embed.requires_grad_(False)
        return self


def test_a_train_override_is_not_called_by_the_check():
    torch.manual_seed(0)
    model = _FrozenNet("thirds")
    assert len(find_pairs(model)) == 8
    assert all(p.requires_grad for p in model.parameters())  # as built: train() was never called


def test_a_model_on_the_meta_device_is_checked_by_structure_and_meta_forward_only():
    with torch.device("meta"):
        model = _Net("thirds", noisy=True)
    assert len(find_pairs(model)) == 8
    with torch.device("meta"):
        assert len(find_pairs(_Net("per_head"))) == 8  # no values to tell rows apart: the known limit


def test_a_model_with_some_parameters_on_the_meta_device_is_not_run_on_real_values():
    # one block not yet materialized (deferred init): there are no values to compute with, the check is skipped,
    # not failed
    torch.manual_seed(0)
    model = _Net("thirds")
    model.blocks[0].to("meta")
    assert len(find_pairs(model)) == 8


def test_verify_false_skips_the_row_check():
    torch.manual_seed(0)
    assert len(find_pairs(_Net("kvq"), verify=False)) == 8


def test_a_learned_sink_value_and_beits_separate_value_bias_pass():
    # kv_bias appends a learned value to V, which stays when qkv's V rows are zero; BEiT adds its q and v biases
    # in F.linear, outside the qkv layer's own call
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    use_sink_attention(vit, "kv_bias")
    with torch.no_grad():
        for name, p in vit.named_parameters():
            if "sink" in name:
                p.normal_()
    beit = timm.create_model("beit_base_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1,
                             num_heads=2)
    with torch.no_grad():
        for name, p in beit.named_parameters():
            if name.endswith(("q_bias", "v_bias")):
                p.normal_()
    assert len(find_pairs(vit)) == 4 and len(find_pairs(beit)) == 4


@pytest.mark.parametrize("layout", ["thirds", "per_head"])
def test_the_probe_makes_its_input_on_the_device_of_the_models_parameters(layout):
    """With torch's default device set to `meta`, a tensor the check made without naming a device would be a
    meta tensor fed to a CPU model (a CUDA model's bug, on a CPU): the check still runs and still tells the
    layouts apart."""
    model = _Net(layout)
    torch.set_default_device("meta")
    try:
        if layout == "thirds":
            assert len(find_pairs(model)) == 8
        else:
            with pytest.raises(UnsupportedModelError, match="input of blocks\\.1\\.attn\\.proj is not zero"):
                find_pairs(model)
    finally:
        torch.set_default_device(None)


class _EinsumProj(nn.Module):
    """proj's weight multiplied by an einsum (a product the check cannot follow), bias added by hand."""

    def __init__(self, proj: nn.Linear):
        super().__init__()
        self.weight, self.bias = proj.weight, proj.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bnd,ed->bne", x, self.weight) + self.bias


def test_a_proj_weight_multiplied_in_a_way_the_check_cannot_follow_is_refused_naming_it():
    # the meta check follows the einsum; which rows of qkv are V cannot be told without proj's input
    torch.manual_seed(0)
    model = _Net("thirds")
    model.blocks[1].attn.proj = _EinsumProj(model.blocks[1].attn.proj)
    with pytest.raises(UnsupportedModelError, match=r"block 'blocks\.1'.*multiplies by blocks\.1\.attn\.proj\.weight "
                       r"in a way CD does not follow.*verify=False"):
        find_pairs(model)


class _Recorder(nn.Module):
    """Records (training flag, batch size) of every forward on real (non-meta) values."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[bool, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            self.seen.append((self.training, x.shape[0]))
        return x


def test_the_check_runs_its_forwards_on_one_sample_in_eval_mode_and_leaves_training_on():
    # a real example of 4 samples: the check's real forwards (V whole, then one per bit of the widest pair's channel
    # index: fc1's 2 * D = 24 outputs, 5 bits) see its first sample, with training off
    torch.manual_seed(0)
    model = _Net("thirds").train()
    model.embed = nn.Sequential(_Recorder(), model.embed)
    assert len(find_pairs(model, example_input=torch.randn(4, TOKENS, 3))) == 8
    assert model.embed[0].seen == [(False, 1)] * (1 + 5)
    assert model.training and model.embed[0].training


def test_the_check_holds_one_forwards_tensors_at_a_time():
    # the forwards are many (one per bit of the widest pair's channel index): a product output with V's columns set
    # to zero that the check kept from one forward (it follows tensors by id) must not live on through the others
    torch.manual_seed(0)
    model = _Net("thirds")
    outputs, alive = [], []
    model.blocks[1].attn.qkv.register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
    model.embed.register_forward_pre_hook(lambda module, args: alive.append(sum(r() is not None for r in outputs)))
    assert len(find_pairs(model)) == 8
    assert alive == [0] * (1 + 1 + 5)  # the meta forward, V whole, then fc1's 24 channels: 5 bits


class _Reassigner(nn.Module):
    """Keeps the running max |x| of its input in a buffer it reassigns (self.amax = ...), in every mode."""

    def __init__(self):
        super().__init__()
        self.register_buffer("amax", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.amax = torch.maximum(self.amax, x.abs().max())
        return x


def test_a_buffer_the_forward_reassigns_is_the_same_tensor_with_its_values_after():
    torch.manual_seed(0)
    model = _Net("thirds")
    model.embed = nn.Sequential(model.embed, _Reassigner())
    before = model.embed[1].amax
    assert len(find_pairs(model)) == 8
    assert model.embed[1].amax is before and before.item() == 0.0  # the tensor an optimizer or hook may hold


def test_the_random_streams_forked_are_the_cpus_and_those_of_every_device_the_parameters_lie_on(monkeypatch):
    # no accelerator is needed to see which streams are forked: stand-in parameters on cuda:1 and cuda:0 (a model
    # split across two GPUs) and fork_rng recorded, not run
    from types import SimpleNamespace

    from cd import values

    forked = []

    @contextlib.contextmanager
    def fork_rng(devices=None, device_type="cuda", **_):
        forked.append((device_type, list(devices)))
        yield

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    model = SimpleNamespace(parameters=lambda: [SimpleNamespace(device=torch.device(d))
                                                for d in ("cpu", "cuda:1", "cuda:0", "cuda:1")])
    with values._rng_forks(model):
        pass
    # devices=[]: the CPU's stream alone; then both GPUs' streams, each once
    assert forked == [("cuda", []), ("cuda", [0, 1])]
