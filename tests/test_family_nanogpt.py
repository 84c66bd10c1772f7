"""cd/family_nanogpt.py against transformers' GPT-2: with the same weights (Conv1D's (in, out) transposed into
nn.Linear's (out, in)) the nanoGPT-shaped model computes the same logits, so the family table's row is GPT-2's."""
import pytest
import torch

from cd.family_nanogpt import NanoGPTShaped

VOCAB, CONTEXT, DIM, DEPTH, HEADS = 64, 16, 32, 3, 4


def _from_gpt2(gpt2) -> NanoGPTShaped:
    """A NanoGPTShaped holding `gpt2`'s weights: the same names, Conv1D weights transposed."""
    model = NanoGPTShaped(vocab=VOCAB, context=CONTEXT, dim=DIM, depth=DEPTH, heads=HEADS).double()
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    state = {k: v.t() if k.endswith(conv1d) else v for k, v in gpt2.state_dict().items()
             if not k.endswith((".attn.bias", ".attn.masked_bias"))}  # older transformers' causal-mask buffers
    model.load_state_dict(state, strict=True)
    return model


def test_the_logits_are_gpt2s_with_the_same_weights():
    """Causal attention with q, k, v in c_attn's order, pre-norm residual blocks, exact GELU, position embeddings,
    the final LayerNorm and an lm_head tied to wte: all of it, in float64, against transformers' GPT2LMHeadModel."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=DIM, n_layer=DEPTH, n_head=HEADS,
                                     activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    gpt2 = transformers.GPT2LMHeadModel(config).double().eval()
    with torch.no_grad():  # GPT-2's init leaves LayerNorms at 1 / 0 and biases at 0: make every term count
        for p in gpt2.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model = _from_gpt2(gpt2)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as in nanoGPT's GPT
    ids = torch.randint(0, VOCAB, (2, CONTEXT))
    with torch.no_grad():
        want = gpt2(ids).logits
        got = model(ids)
    assert want.abs().max() > 1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # causal: the logits at a position do not depend on later tokens
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    with torch.no_grad():
        torch.testing.assert_close(model(changed)[:, :-1], got[:, :-1], rtol=0, atol=0)
