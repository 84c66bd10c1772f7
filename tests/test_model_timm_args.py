"""model.kwargs entries that timm's create_model / build_model_with_cfg consume themselves are refused, each in one
line naming the entry (and ModelConfig's own key where there is one), before anything is built or trained."""
import inspect
import re

import pytest
import torch
from timm.models import _builder, _factory

from configs.schema import ModelConfig
from models import ModelError, build_model
from tests.conftest import DEBUG_CONFIG, run_entry

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
