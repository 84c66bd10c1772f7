"""scripts/tweo_memory.py: the activation memory TWEO adds, against the block outputs' sizes taken by the test's own
hooks: nothing on a ViT (the next LayerNorm keeps each output anyway), the output of the block before a Swin
PatchMerging (which normalizes a permuted copy), and one fp32 copy of every block output for the plain form."""
import torch

from cd_models import tiny_swin, tiny_vit
from conftest import hooked_forward
from tweo_memory import main, saved_for_backward  # scripts/ is on pytest's path (pyproject.toml)


def output_bytes(model, x, names):
    """name -> bytes of each named block's output in a forward of `model` on `x` (fp32 here)."""
    sizes = {}
    hooked_forward(model, x, {n: model.get_submodule(n) for n in names},
                   lambda n, inputs, out: sizes.update({n: out.numel() * 4}))
    return sizes


def test_vit_outputs_are_kept_anyway_and_the_plain_form_adds_one_copy_of_each():
    model, x = tiny_vit().train(), torch.randn(3, 3, 32, 32)
    base = saved_for_backward(model, x)
    assert base.outputs_not_kept() == {}
    assert saved_for_backward(model, x, "memory_saving").total == base.total
    # (|a| / (tau + eps)) is kept for pow's backward: one fp32 copy per block
    sizes = output_bytes(model, x, ["blocks.0", "blocks.1"])
    assert saved_for_backward(model, x, "plain").total - base.total == sum(sizes.values())


def test_swin_keeps_the_output_of_the_block_before_the_patch_merging_for_tweo_alone():
    model, x = tiny_swin().train(), torch.randn(3, 3, 32, 32)
    assert type(model.layers[1].downsample).__name__ == "PatchMerging"  # stage 2 starts with it (timm)
    names = ["layers.0.blocks.0", "layers.0.blocks.1", "layers.1.blocks.0", "layers.1.blocks.1"]
    sizes = output_bytes(model, x, names)
    base = saved_for_backward(model, x)
    assert base.outputs_not_kept() == {"layers.0.blocks.1": sizes["layers.0.blocks.1"]}
    assert saved_for_backward(model, x, "memory_saving").total - base.total == sizes["layers.0.blocks.1"]
    assert saved_for_backward(model, x, "plain").total - base.total == sum(sizes.values()) + sizes["layers.0.blocks.1"]


def test_the_script_prints_a_gpt_s_figures(capsys):
    main(["--model", "gpt2_nano", "--tokens", "8"])
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("gpt2_nano (2, 8): without TWEO ") and "memory-saving form +0.00 (+0.0%)" in out[1]
    assert out[2] == "  block outputs that only TWEO keeps: 0 of 2, 0.00"


def test_tokens_without_a_gpt_or_past_a_gpt_s_context_are_refused_before_any_model_is_built(capsys, monkeypatch):
    """--tokens sizes a GPT's input only: with timm models alone it was ignored without a word, and past the
    GPT's context (models/gpt.py GPT_SIZES) it ended in the GPT's ValueError traceback."""
    import pytest

    import tweo_memory
    from models.gpt import GPT_SIZES

    monkeypatch.setattr(tweo_memory, "build", None)  # reached: a TypeError, not the refusal
    context = GPT_SIZES["gpt2_nano"]["context"]
    for argv, says in [(["--model", "vit_base_patch16_224", "--tokens", "8"], "--tokens 8: sets a GPT's sequence"),
                       (["--model", "gpt2_nano", "--tokens", str(context + 1)],
                        f"--tokens {context + 1}: longer than gpt2_nano's context of {context} tokens")]:
        with pytest.raises(SystemExit) as refused:
            main(argv)
        err = capsys.readouterr().err
        assert refused.value.code == 2 and err.startswith("error: ") and says in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_a_model_last_in_the_list_is_refused_before_the_first_is_measured(capsys):
    """Every --model is checked before any is measured: an unknown name, or a model without Transformer blocks,
    given after GPT-2 Small was refused only once GPT-2's three forwards had run."""
    import pytest

    for bad, says in [("no_such_model_x", "--model no_such_model_x: Unknown model"),
                      ("resnet18", "--model resnet18: TWEO: no pre-norm Transformer block")]:
        with pytest.raises(SystemExit) as refused:
            main(["--model", "gpt2_nano", bad, "--tokens", "8"])
        captured = capsys.readouterr()
        assert refused.value.code == 2 and captured.err.startswith("error: ") and says in captured.err, captured.err
        assert len(captured.err.strip().splitlines()) == 1, captured.err
        assert captured.out == "", captured.out  # nothing measured, not even the header printed


def test_a_model_given_twice_is_a_usage_error_before_any_is_measured(capsys):
    """--model gpt2_nano gpt2_nano measured the model twice and printed its figures twice."""
    import pytest

    with pytest.raises(SystemExit) as refused:
        main(["--model", "gpt2_nano", "vit_tiny_patch16_224", "gpt2_nano", "--tokens", "8"])
    captured = capsys.readouterr()
    assert refused.value.code == 2 and len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.err.startswith("error: ") and "argument --model: gpt2_nano given twice" in captured.err
    assert captured.out == "", captured.out


def test_the_random_inputs_are_made_on_the_device_of_the_model(monkeypatch):
    """The inputs had been drawn on the CPU and copied to --device (a host draw and copy per model, on a GPU). The
    trick of tests/test_device_explicit.py: a CPU model and `meta` as the default device, where an input drawn
    without an explicit device is a meta tensor (and cannot be copied to the CPU)."""
    import timm

    import tweo_memory

    models = {"gpt2_nano": tweo_memory.create("gpt2_nano"),
              "vit": timm.create_model("vit_tiny_patch16_224", depth=1)}  # its default input: 3 x 224 x 224
    monkeypatch.setattr(tweo_memory, "create", models.__getitem__)
    with torch.device("meta"):
        for name, shape in (("gpt2_nano", (2, 32)), ("vit", (2, 3, 224, 224))):
            model, inputs = tweo_memory.build(name, 2, None, torch.device("cpu"))
            assert inputs.device.type == "cpu" and tuple(inputs.shape) == shape and model is models[name]
