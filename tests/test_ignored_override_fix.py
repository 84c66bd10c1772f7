"""A refused override (a key the config would ignore) names a fix that works: where the deciding key is set and the
key is read only at null (sched.per_step or sched.warmup_epochs beside sched.steps, optim.lr_base beside optim.lr),
the fix is to set the deciding key back to null; where it is null, to give it a value as well."""
import pytest
import yaml

from configs import ConfigError, load_config
from configs.loader import get_key
from tests.conftest import DEBUG_CONFIG

# (overrides, the last one refused; the fix the message offers; the overrides with that fix made)
CASES = [
    (["sched.steps=6", "sched.per_step=true"], "set sched.steps=null as well",
     ["sched.steps=null", "sched.per_step=true"]),
    (["sched.steps=6", "sched.warmup_epochs=0"], "set sched.steps=null as well",
     ["sched.steps=null", "sched.warmup_epochs=0"]),
    (["optim.lr=0.01", "optim.lr_base=0.002"], "set optim.lr=null as well", ["optim.lr=null", "optim.lr_base=0.002"]),
    # sched.steps is null here: it needs a value
    (["sched.warmup_steps=3"], "set sched.steps as well", ["sched.warmup_steps=3", "sched.steps=6"]),
]


@pytest.mark.parametrize("overrides, fix, fixed", CASES, ids=[c[0][-1] for c in CASES])
def test_the_fix_a_refused_override_names_makes_the_key_read(overrides, fix, fixed):
    """The message said "set sched.steps as well" where sched.steps was set already (to 6). Reference: the config
    loads with the fix made, holding the refused override's value."""
    key, value = overrides[-1].split("=")
    with pytest.raises(ConfigError) as refused:
        load_config([DEBUG_CONFIG], overrides)
    assert str(refused.value).startswith(f"{key}={value} would be ignored: ")
    assert str(refused.value).endswith(f"; drop it or {fix}")
    assert get_key(load_config([DEBUG_CONFIG], fixed), key) == yaml.safe_load(value)
