"""model.kwargs entries that timm's create_model / build_model_with_cfg consume themselves are refused, each in one
line naming the entry (and ModelConfig's own key where there is one), before anything is built or trained; the
arguments build_model itself passes fit the model: drop_path_rate (model.drop_path) where it has stochastic depth,
num_classes (model.num_classes) where timm's building does not drop it."""
import inspect
import re

import pytest
import timm
import torch
from timm.layers import DropPath
from timm.models import _builder, _factory

from configs.schema import ModelConfig
from models import ModelError, build_model
from tests.conftest import DEBUG_CONFIG, run_entry
from tests.hub_cache import serve_hub_cache

# named parameters of timm's building functions that are not the model's constructor arguments
_NOT_BUILD_ARGS = {"model_name", "model_cls", "variant", "pretrained", "kwargs"}
# what build_model_with_cfg pops from the constructor arguments (read off its source) and what create_model keeps
# out of the model's recorded arguments (a placement and a cast)
_POPPED = {"pruned", "features_only", "out_indices", "feature_cls", "device", "dtype"}


def timm_build_arguments() -> set:
    """The arguments timm's building consumes itself, read off the installed timm's signatures and source."""
    named = {name for fn in (_factory.create_model, _builder.build_model_with_cfg)
             for name in inspect.signature(fn).parameters} - _NOT_BUILD_ARGS
    popped = set(re.findall(r"kwargs\.pop\('(\w+)'", inspect.getsource(_builder.build_model_with_cfg)))
    assert popped <= _POPPED, popped  # a new one in another timm: it belongs in models/timm_build_args.py too
    return named | _POPPED


@pytest.mark.parametrize("key", sorted(timm_build_arguments()))
@pytest.mark.parametrize("name", ["vit_nano", "swin_nano"])
def test_every_argument_timm_consumes_itself_is_refused_in_one_line_naming_it(name, key):
    """pretrained_cfg_overlay={file: ...} trained from random init, cache_dir was ignored, device=meta ended in a
    traceback; pretrained_strict and checkpoint_path name ModelConfig's own key for them."""
    own = {"pretrained_strict": "model.pretrained_strict", "checkpoint_path": "model.pretrained"}
    with pytest.raises(ModelError) as refused:
        build_model(ModelConfig(name=name, num_classes=10, kwargs={key: True}))
    message = str(refused.value)
    assert message.startswith(f"model.kwargs.{key}: ") and "\n" not in message, message
    if key in own:
        assert f"set {own[key]} instead" in message, message


def test_a_train_checkpoint_as_checkpoint_path_is_refused_for_model_pretrained(tmp_path):
    """timm's load_checkpoint read a train.py checkpoint's EMA weights, past models/pretrained.py's checks."""
    model = build_model(ModelConfig(name="vit_nano", num_classes=10))
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "model_ema": model.state_dict()}, path)
    with pytest.raises(ModelError, match=r"^model.kwargs.checkpoint_path: set model.pretrained instead"):
        build_model(ModelConfig(name="vit_nano", num_classes=10, kwargs={"checkpoint_path": str(path)}))


def test_train_refuses_pretrained_strict_as_a_kwarg_in_one_line(tmp_path, capsys):
    """A 10-class file fine-tuned at 4 classes with model.kwargs.pretrained_strict=true trained a new classifier
    (timm's pretrained_strict is for hub weights); the run is refused, pointing at model.pretrained_strict."""
    weights = tmp_path / "ten.pth"
    torch.save(build_model(ModelConfig(name="vit_nano", num_classes=10)).state_dict(), weights)
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={tmp_path / 'run'}",
                                          f"model.pretrained={weights}", "model.kwargs.pretrained_strict=true"],
                             capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("error: model.kwargs.pretrained_strict: set model.pretrained_strict instead"), err
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def meta_build(name: str, **settings):
    with torch.device("meta"):  # shapes only: no memory or init time spent on the weights
        return build_model(ModelConfig(name=name, num_classes=10, **settings))


@pytest.mark.parametrize("name", ["vgg11", "densenet121", "hrnet_w18"])
def test_a_model_without_stochastic_depth_builds_at_drop_path_0_and_is_refused_above_it(name):
    """model.drop_path=0 was passed to timm as drop_path_rate=0, which VGG, DenseNet, HRNet (and 18 more timm
    families) do not take: none of them could be built. At 0 the model is timm's own; above 0 the refusal names
    the fix, and the schema's default (0.1, which a config that never names model.drop_path carries) as such."""
    with torch.device("meta"):
        reference = timm.create_model(name, num_classes=10)
    model = meta_build(name, drop_path=0.0)
    assert type(model) is type(reference)
    shapes = [{k: v.shape for k, v in m.state_dict().items()} for m in (model, reference)]
    assert shapes[0] == shapes[1]
    with pytest.raises(ModelError, match=rf"^model.drop_path=0.2: model '{name}' .*has no stochastic depth.*"
                                         r"set model.drop_path=0$"):
        meta_build(name, drop_path=0.2)
    with pytest.raises(ModelError, match=r"set model.drop_path=0; 0.1 is the schema's default") as refused:
        meta_build(name)
    assert "\n" not in str(refused.value)


def test_drop_path_0_is_passed_to_a_model_whose_entry_point_sets_a_rate_of_its_own():
    """Leaving drop_path_rate=0 out for every model would build timm's fasternet_t1 with its entry point's 0.02."""
    with torch.device("meta"):
        own = [m.drop_prob for m in timm.create_model("fasternet_t1").modules() if isinstance(m, DropPath)]
    assert own and max(own) > 0  # timm's default for it: stochastic depth
    built = meta_build("fasternet_t1", drop_path=0.0)
    assert not [m for m in built.modules() if isinstance(m, DropPath)]


@pytest.mark.parametrize("name", ["qwen3_vit_88m_enc", "gemma4_vit_167m_enc"])
def test_an_encoder_whose_building_drops_num_classes_is_refused_naming_model_num_classes(name):
    """timm's building of these encoders drops num_classes (kwargs_filter): the run trained on feature outputs
    of shape (B, tokens, width) as if they were 10 class scores."""
    with torch.device("meta"):
        assert timm.create_model(name, num_classes=10).num_classes != 10  # timm's building, independently
    with pytest.raises(ModelError, match=rf"^model.num_classes=10: model '{name}' .*num_classes=0 .*give a "
                                         r"model.name with a classifier"):
        meta_build(name, drop_path=0.0)
    assert meta_build(name.removesuffix("_enc"), drop_path=0.0).num_classes == 10  # the same encoder with a head


def test_the_num_classes_refusal_of_hub_weights_comes_before_their_download(tmp_path, monkeypatch):
    """model.pretrained=hub for such an encoder was refused only once timm had fetched its weights (hundreds of MB):
    offline, with nothing cached, the fetch failed first and its refusal hid the one that says what to change."""
    serve_hub_cache(monkeypatch, tmp_path)  # an empty cache, offline: any fetch fails
    fetched, create = [], timm.create_model

    def recording(name, *args, **kwargs):
        if kwargs.get("pretrained"):
            fetched.append(name)
        return create(name, *args, **kwargs)

    monkeypatch.setattr(timm, "create_model", recording)
    with pytest.raises(ModelError, match=r"^model.num_classes=10: model 'qwen3_vit_88m_enc' .*num_classes=0 "):
        build_model(ModelConfig(name="qwen3_vit_88m_enc", num_classes=10, pretrained="hub", drop_path=0.0))
    assert not fetched
