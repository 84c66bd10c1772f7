"""Activation memory that TWEO's penalty adds to one training forward, on a timm model or a GPT of models/gpt.py.

The figure is the bytes of the distinct tensor storages that autograd keeps for the backward pass of one training
forward and its loss (`torch.autograd.graph.saved_tensors_hooks`), the parameters left out: without TWEO, with its
memory-saving form (`cd.tweo.tweo_penalty`, the default) and with `form='plain'`. The loss is the output's mean, which
keeps nothing: a task loss's own saved tensors are the same with and without TWEO. The memory-saving form keeps each
block's output only, which adds nothing where the layer after the block keeps that same tensor (the next block's
LayerNorm, the final norm: ViT, GPT); where that layer keeps a copy instead, the output is kept for TWEO alone, and the
script names those blocks (timm's Swin: the last block of each stage before a PatchMerging, which normalizes a
permuted copy of it). Under autocast the weights' low-precision copies count too (they are no parameters), the
same with and without TWEO.

    python scripts/tweo_memory.py                      # ViT-B/16 and Swin-T at 224 px, GPT-2 Small on 1024 tokens
    python scripts/tweo_memory.py --model swin_tiny_patch4_window7_224 --batch 8 --amp bf16
"""
from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cd import TWEO  # noqa: E402
from cd.pairs import residual_stream  # noqa: E402
from configs.cli import OneLineParser, at_least, first_line, refuse_repeats, torch_device  # noqa: E402
from models.gpt import GPT_SIZES, build_gpt  # noqa: E402

MODELS = ("vit_base_patch16_224", "swin_tiny_patch4_window7_224", "gpt2")
GPT_VOCAB = 50257  # GPT-2's; the vocabulary sizes only the embedding and the head, not a block output


@dataclass
class Saved:
    """What autograd keeps of one forward: storage pointer -> bytes, and each block's output storage."""
    storages: dict[int, int]
    outputs: dict[str, tuple[int, int]]  # block name -> (storage pointer, bytes)

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def outputs_not_kept(self) -> dict[str, int]:
        """The blocks whose output autograd does not keep (bytes): what the memory-saving form keeps in addition."""
        return {name: nbytes for name, (ptr, nbytes) in self.outputs.items() if ptr not in self.storages}


def saved_for_backward(model: nn.Module, inputs: torch.Tensor, form: Optional[str] = None,
                       amp: Optional[torch.dtype] = None) -> Saved:
    """Storages autograd saves in one training forward of `model` on `inputs` and the loss (the output's mean),
    parameters left out, with TWEO of `form` ('memory_saving' or 'plain') or, with None, without it."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}
    outputs: dict[str, tuple[int, int]] = {}
    alive = []  # every block output is held until the end, so that no later tensor reuses its memory

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    def record(name, module, args, kwargs, output):
        stream = residual_stream(name, module, args, output, kwargs)
        alive.append(stream)
        outputs[name] = (stream.untyped_storage().data_ptr(), stream.untyped_storage().nbytes())

    tweo = TWEO(model, lam=0.01, form=form or "memory_saving")
    if form is None:
        tweo.remove()  # its blocks only: they are the blocks whose outputs are recorded
    handles = [block.register_forward_hook(partial(record, name), with_kwargs=True) for name, block in tweo.blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                (torch.autocast(inputs.device.type, dtype=amp) if amp is not None else nullcontext()):
            loss = model(inputs).float().mean()
            if form is not None:
                loss = loss + tweo.aux_loss(loss)
    finally:
        for h in handles:
            h.remove()
        tweo.remove()
    return Saved(storages, outputs)


def create(name: str) -> nn.Module:
    """The model of `name`, a GPT size or a timm model name, with random weights (timm's RuntimeError for an
    unknown name); on the meta device under `torch.device("meta")`."""
    if name in GPT_SIZES:
        return build_gpt(name, vocab_size=GPT_VOCAB)
    import timm
    return timm.create_model(name)


def build(name: str, batch: int, tokens: Optional[int], device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    """The model (random weights, training mode) and a random input of `batch` samples, both on `device`."""
    model = create(name).to(device).train()
    if name in GPT_SIZES:
        inputs = torch.randint(GPT_VOCAB, (batch, tokens or model.context), device=device)
    else:
        inputs = torch.randn(batch, *model.pretrained_cfg["input_size"], device=device)
    return model, inputs


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=first_line(__doc__))
    parser.add_argument("--model", nargs="+", default=list(MODELS),
                        help=f"timm model names or GPT sizes ({', '.join(GPT_SIZES)}), random weights; default "
                             f"{' '.join(MODELS)}")
    parser.add_argument("--batch", type=at_least(1), default=2,
                        help="images or sequences per forward (default: %(default)s)")
    parser.add_argument("--tokens", type=at_least(1), default=None,
                        help="a GPT's sequence length, at most its context (default: its context); needs a GPT "
                             "among --model")
    parser.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none",
                        help="autocast dtype, none for fp32 (default: %(default)s)")
    parser.add_argument("--device", type=torch_device, default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    args = parser.parse_args(argv)
    refuse_repeats(parser, ("--model", args.model))  # measured again, its figures printed twice
    gpts = [name for name in args.model if name in GPT_SIZES]
    if args.tokens is not None:  # checked before any model is built: a timm model's input size is its own
        if not gpts:
            parser.error(f"--tokens {args.tokens}: sets a GPT's sequence length, and no --model is a GPT "
                         f"({', '.join(GPT_SIZES)}); drop --tokens, or add a GPT to --model")
        shortest = min(GPT_SIZES[name]["context"] for name in gpts)
        if args.tokens > shortest:  # the GPT's forward would raise a ValueError traceback
            name = next(n for n in gpts if GPT_SIZES[n]["context"] == shortest)
            parser.error(f"--tokens {args.tokens}: longer than {name}'s context of {shortest} tokens; give at most "
                         f"{shortest}")
    for name in args.model:  # every one before the first is measured (minutes for GPT-2): built on meta, no weights
        try:
            with torch.device("meta"):
                model = create(name)
        except RuntimeError as error:  # timm's unknown model: one line names the input
            parser.error(f"--model {name}: {error}")
        try:  # a model without Transformer blocks (a CNN): TWEO's one-line refusal, not a traceback
            TWEO(model).remove()
        except ValueError as error:
            parser.error(f"--model {name}: {error}")
    amp = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    print(f"torch {torch.__version__} on {args.device}, batch {args.batch}, amp {args.amp}; saved for backward, "
          f"parameters left out (MiB)")
    for name in args.model:
        model, inputs = build(name, args.batch, args.tokens, args.device)
        base = saved_for_backward(model, inputs, amp=amp)
        saving = saved_for_backward(model, inputs, "memory_saving", amp)
        plain = saved_for_backward(model, inputs, "plain", amp)
        kept = base.outputs_not_kept()
        mib = 2 ** 20
        print(f"{name} {tuple(inputs.shape)}: without TWEO {base.total / mib:.2f}; memory-saving form "
              f"+{(saving.total - base.total) / mib:.2f} ({(saving.total - base.total) / base.total:+.1%}); plain "
              f"form +{(plain.total - base.total) / mib:.2f} ({(plain.total - base.total) / base.total:+.1%})")
        print(f"  block outputs that only TWEO keeps: {len(kept)} of {len(base.outputs)}, "
              f"{sum(kept.values()) / mib:.2f}" + (f" ({', '.join(kept)})" if kept else ""))


if __name__ == "__main__":
    main()
