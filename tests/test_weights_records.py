"""What weights files record beside their tensors is honoured or refused: the architecture a run checkpoint or a
nanoGPT ckpt.pt was trained as (head counts the shapes cannot tell), the EMA flag only where there is an EMA copy,
a Swin window resize said as a ViT position-table resize is, a tied GPT head stored under either name, and the
repeated-augmentation epoch named when it leaves less than one batch."""
import argparse
import dataclasses
import json
import logging

import pytest
import safetensors.torch
import torch
from timm.layers import resize_rel_pos_bias_table

import evaluate
import train
from configs import ConfigError, config_to_dict, load_config
from configs.schema import ModelConfig
from data import DataError, build_train_loader
from models import ModelError, build_model
from tests.conftest import DEBUG_CONFIG, DEMO_CONFIG
from tests.test_lm import _nanogpt_names


def test_ema_is_refused_for_a_weights_file_which_is_read_as_its_plain_weights(tmp_path):
    """--ema with model.pretrained scored the file's plain weights and wrote "weights": "ema" in the result."""
    weights = tmp_path / "timm_train.pth.tar"
    state = build_model(ModelConfig(name="vit_nano", num_classes=4)).state_dict()
    torch.save({"state_dict": state, "state_dict_ema": state, "epoch": 3}, weights)
    given = ["--config", DEBUG_CONFIG, f"model.pretrained={weights}", "--quant", "rtn", "--bits", "w8a16"]
    with pytest.raises(ConfigError, match=r"^--ema: .*model.pretrained=.* drop --ema"):
        evaluate.resolve_config(evaluate.parse_args([*given, "--ema"]))
    evaluate.resolve_config(evaluate.parse_args(given))  # without it: scored as the weights it is


def test_swin_weights_of_another_window_size_load_resampled_and_said(tmp_path, caplog):
    torch.manual_seed(0)
    cfg = ModelConfig(name="swin_nano", num_classes=10)  # windows of 4
    source = build_model(cfg)
    torch.save({"model": source.state_dict()}, tmp_path / "w4.pth")
    at2 = dataclasses.replace(cfg, kwargs={"window_size": 2}, pretrained=str(tmp_path / "w4.pth"),
                              pretrained_strict=True)
    with caplog.at_level(logging.WARNING):
        model = build_model(at2)
    assert ("relative position bias tables of 2 attention layer(s) (e.g. "
            "'layers.0.blocks.0.attn.relative_position_bias_table') of 4x4 windows resampled to the model's 2x2"
            in caplog.text)
    key = "layers.1.blocks.0.attn.relative_position_bias_table"
    expected = resize_rel_pos_bias_table(source.state_dict()[key], new_window_size=(2, 2),
                                         new_bias_shape=(9, 4))  # timm's resize of the file's own table
    assert torch.allclose(model.state_dict()[key], expected)
    assert model.pretrained_resampled == {"relative_position_bias_resampled": "4x4->2x2"}  # evaluate.py records it
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        own = build_model(dataclasses.replace(at2, kwargs={}))  # the file's own window: no line
    assert "resampled" not in caplog.text and own.pretrained_resampled == {}


def test_an_evaluation_of_weights_at_another_img_size_records_their_resampled_position_table(tmp_path):
    """A weights file of a 32-pixel vit_nano (a 4x4 grid) scored at model.img_size=64 (8x8) is scored with timm's
    bicubic resample of its table: the result says so (it read as a score of the file's weights); at the file's own
    size it says nothing."""
    weights = tmp_path / "at32.pth"
    torch.save(build_model(ModelConfig(name="vit_nano", num_classes=4)).state_dict(), weights)
    given = ["--config", DEBUG_CONFIG, f"model.pretrained={weights}", "--quant"]
    result = evaluate.main(evaluate.parse_args([*given, "model.img_size=64", "--out", str(tmp_path / "r64.json")]))
    assert result["pos_embed_resampled"] == "4x4->8x8"
    # a result file of these weights written before the grids were recorded is this evaluation's (the weights'
    # fingerprint names them): the same command adds to it, and the file now records the grids
    older = json.loads((tmp_path / "r64.json").read_text())
    del older["pos_embed_resampled"]
    (tmp_path / "r64.json").write_text(json.dumps(older))
    result = evaluate.main(evaluate.parse_args([*given, "model.img_size=64", "--out", str(tmp_path / "r64.json")]))
    assert json.loads((tmp_path / "r64.json").read_text())["pos_embed_resampled"] == "4x4->8x8"
    result = evaluate.main(evaluate.parse_args([*given, "--out", str(tmp_path / "r32.json")]))
    assert not [key for key in result if "resampled" in key]


def nanogpt_checkpoint(path, model, **model_args) -> str:
    """nanoGPT's ckpt.pt of `model`: its weights in nanoGPT's names and the GPTConfig it records."""
    torch.save({"model": _nanogpt_names(model.state_dict()), "model_args": model_args, "iter_num": 10,
                "config": {"out_dir": "out"}}, path)
    return str(path)


def test_a_nanogpt_checkpoint_loads_only_into_the_architecture_its_model_args_record(tmp_path):
    """n_head=4 weights have the shapes of a 2-head GPT of the same width: they loaded into it without a word."""
    torch.manual_seed(0)
    cfg = ModelConfig(name="gpt2_nano", num_classes=96, drop_path=0.0, kwargs={"num_heads": 4})
    trained = build_model(cfg)
    args = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, bias=True, vocab_size=96, dropout=0.1)
    path = nanogpt_checkpoint(tmp_path / "ckpt.pt", trained, **args)
    with pytest.raises(ModelError, match=r"model_args record n_head=4, the model has 2: set model.kwargs.num_heads=4"):
        build_model(dataclasses.replace(cfg, kwargs={}, pretrained=path))
    no_bias = nanogpt_checkpoint(tmp_path / "no_bias.pt", trained, **{**args, "bias": False})
    with pytest.raises(ModelError, match=r"record bias=False, the model has True: set model.kwargs.bias=false"):
        build_model(dataclasses.replace(cfg, pretrained=no_bias))
    loaded = build_model(dataclasses.replace(cfg, pretrained=path)).eval()  # dropout: a training setting
    ids = torch.randint(0, 96, (2, 16))
    torch.testing.assert_close(loaded(ids), trained.eval()(ids), atol=0, rtol=0)


def test_a_legacy_format_file_has_its_records_checked_as_a_zip_files_are(tmp_path, caplog):
    """torch.save(..., _use_new_zipfile_serialization=False) writes a file torch cannot memory-map: its weights loaded
    (timm reads it whole) while what it records beside them went unread, so a nanoGPT ckpt.pt of n_head=4 loaded into
    the 2-head GPT without a word, and a raw-weights file's EMA copy was not named."""
    torch.manual_seed(0)
    cfg = ModelConfig(name="gpt2_nano", num_classes=96, drop_path=0.0, kwargs={"num_heads": 4})
    args = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, bias=True, vocab_size=96, dropout=0.0)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": _nanogpt_names(build_model(cfg).state_dict()), "model_args": args, "iter_num": 10}, path,
               _use_new_zipfile_serialization=False)
    with pytest.raises(ModelError, match=r"model_args record n_head=4, the model has 2: set model.kwargs.num_heads=4"):
        build_model(dataclasses.replace(cfg, kwargs={}, pretrained=str(path)))
    build_model(dataclasses.replace(cfg, pretrained=str(path)))  # as recorded: loads
    state = build_model(ModelConfig(name="vit_nano", num_classes=4)).state_dict()
    ema = tmp_path / "ema.pth"
    torch.save({"model": state, "model_ema": state}, ema, _use_new_zipfile_serialization=False)
    with caplog.at_level(logging.INFO, logger="models.pretrained"):
        build_model(ModelConfig(name="vit_nano", num_classes=4, pretrained=str(ema)))
    assert "the file's EMA copy (model_ema) is not used" in caplog.text


def run_checkpoint(path, cfg) -> str:
    """A checkpoint of train.py's layout: the model's weights and the config it was trained with."""
    config = load_config([DEBUG_CONFIG], [])
    config.model = cfg
    torch.save({"model": build_model(cfg).state_dict(), "config": config_to_dict(config), "state": {},
                "optimizer": {}}, path)
    return str(path)


@pytest.mark.parametrize("name", ["vit_nano", "gpt2_nano"])
def test_a_checkpoint_is_evaluated_only_with_the_head_counts_it_was_trained_with(tmp_path, name):
    """`evaluate.py --checkpoint best.pt model.kwargs.num_heads=4` scored a 2-head run as a 4-head model (a Swin's
    bias tables have a column per head: its shapes tell it)."""
    trained = ModelConfig(name=name, num_classes=96 if name.startswith("gpt") else 4, drop_path=0.0)
    payload = torch.load(run_checkpoint(tmp_path / "best.pt", trained), weights_only=False)
    args = argparse.Namespace(ema=False, checkpoint=str(tmp_path / "best.pt"))
    cfg = load_config([DEBUG_CONFIG], [])
    cfg.model = dataclasses.replace(trained, kwargs={"num_heads": 4})
    with pytest.raises(ModelError, match=r"best.pt was trained with 2 attention heads in 'blocks.0.attn', the model "
                                         r"has 4 .*: set model.kwargs.num_heads=2 \(as trained\)"):
        evaluate.load_float_model(cfg, payload, args)
    cfg.model = dataclasses.replace(trained, drop=0.1)  # dropout: no architecture setting
    model = evaluate.load_float_model(cfg, payload, args)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in payload["model"].items())


def test_fine_tuning_a_run_checkpoint_keeps_its_head_counts_and_may_change_its_dropout(tmp_path):
    """`train.py model.pretrained=<a train.py best.pt> model.kwargs.num_heads=4` fine-tuned a 2-head run's weights
    as a 4-head model without a word; dropout (or a new classifier) is fine-tuning's to change."""
    common = ["model.name=vit_nano", "sched.epochs=1", "sched.warmup_epochs=0", "log.tensorboard=false",
              "train.max_steps=1"]
    train.main(load_config([DEMO_CONFIG], common + [f"out_dir={tmp_path / 'a'}"]))
    ckpt = tmp_path / "a" / "checkpoint.pt"
    with pytest.raises(ModelError, match=r"model.pretrained=.*checkpoint.pt was trained with 2 attention heads in "
                                         r"'blocks.0.attn', the model has 4 .*set model.kwargs.num_heads=2"):
        train.main(load_config([DEMO_CONFIG], common + [f"out_dir={tmp_path / 'b'}", f"model.pretrained={ckpt}",
                                                        "model.kwargs.num_heads=4"]))
    train.main(load_config([DEMO_CONFIG], common + [f"out_dir={tmp_path / 'c'}", f"model.pretrained={ckpt}",
                                                    "model.drop=0.1"]))
    fine_tune = ModelConfig(name="vit_nano", num_classes=7, pretrained=str(ckpt))  # a new classifier
    train.check_pretrained_architecture(fine_tune, build_model(fine_tune), train.pretrained_run_config(fine_tune))


def test_a_gpt_saved_with_safetensors_save_model_loads_with_its_tied_head(tmp_path):
    """save_model stores the tied tensor once, as head.weight: loading failed with "missing ['wte.weight']"."""
    torch.manual_seed(0)
    cfg = ModelConfig(name="gpt2_nano", num_classes=64, drop_path=0.0)
    model = build_model(cfg)
    safetensors.torch.save_model(model, str(tmp_path / "gpt.safetensors"))
    assert "wte.weight" not in safetensors.torch.load_file(str(tmp_path / "gpt.safetensors"))
    loaded = build_model(dataclasses.replace(cfg, pretrained=str(tmp_path / "gpt.safetensors")))
    assert loaded.head.weight is loaded.wte.weight
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_too_few_images_for_a_batch_under_repeated_augmentation_names_the_setting():
    """timm's RepeatAugSampler gives each process the set rounded down to 256 images over the processes: the
    error named the batch size, processes and set size only."""
    def loader(repeated_aug, world_size=2):
        data = load_config(None, ["data.dataset=synthetic", "data.synthetic_train_size=300", "data.num_workers=0",
                                  f"data.repeated_aug={repeated_aug}"]).data
        return build_train_loader(data, img_size=8, batch_size_per_gpu=140, rank=0, world_size=world_size, seed=0,
                                  num_classes=3)
    with pytest.raises(DataError, match=r"300 training images give each of 2 processes 128 per epoch, fewer than one "
                                        r"batch of 140 \(data.repeated_aug=3: timm's RepeatAugSampler .* would give "
                                        r"each 150\): .*fewer processes, data.repeated_aug=0 or"):
        loader(3)
    assert len(loader(0).sampler) == 300 // 2  # the advice holds: one batch of 140 from 150 images


def test_a_run_recorded_with_dropout_this_code_places_otherwise_still_evaluates(tmp_path):
    """Dropout acts in training only: a checkpoint recorded with a model.kwargs rate of model.drop's own arguments
    beside model.drop (which one of them would set twice) is scored with its weights, not refused: the model is
    built without model.drop when no pipeline trains, and no command-line change could build it otherwise."""
    trained = ModelConfig(name="vit_nano", num_classes=4, drop_path=0.0, kwargs={"proj_drop_rate": 0.1})
    payload = torch.load(run_checkpoint(tmp_path / "best.pt", trained), weights_only=False)
    args = argparse.Namespace(ema=False, checkpoint=str(tmp_path / "best.pt"))
    cfg = load_config([DEBUG_CONFIG], [])
    cfg.model = dataclasses.replace(trained, drop=0.1)  # both, as a run of the earlier meaning could record
    model = evaluate.load_float_model(cfg, payload, args)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in payload["model"].items())


@pytest.mark.parametrize("file_bias, model_bias", [(False, True), (True, False)])
def test_a_gpt_file_differing_only_in_its_biases_names_model_kwargs_bias(tmp_path, file_bias, model_bias):
    """A raw GPT state dict of nanoGPT's other `bias` setting was refused with the key lists alone, which named no
    fix; the setting that loads it is named (and only the key lists where more than the biases differ)."""
    from models.pretrained import load_pretrained
    build = {"name": "gpt2_nano", "num_classes": 65, "drop_path": 0.0}
    weights = tmp_path / "gpt.pt"
    torch.save(build_model(ModelConfig(**build, kwargs={"bias": file_bias})).state_dict(), weights)
    model = build_model(ModelConfig(**build, kwargs={"bias": model_bias}))
    with pytest.raises(ModelError) as refused:
        load_pretrained(model, str(weights), strict=True)
    assert str(refused.value).endswith(f"give model.kwargs.bias={str(file_bias).lower()}"), refused.value
    other = build_model(ModelConfig(**build, kwargs={"bias": file_bias, "depth": 1})).state_dict()
    torch.save(other, weights)  # one block fewer as well: its missing weights are no bias
    with pytest.raises(ModelError) as refused:
        load_pretrained(build_model(ModelConfig(**build, kwargs={"bias": model_bias})), str(weights), strict=True)
    assert "model.kwargs.bias" not in str(refused.value)
