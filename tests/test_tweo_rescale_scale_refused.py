"""tau and eps beside rescale=True are refused by the public TWEO class as by train.py (configs/loader.py) and
TweoHook: the rescaled term's gradient lam * |L| * grad(P) / P does not depend on them (P's factor (tau + eps)^-p
cancels), so a run given them would train as without them."""
from __future__ import annotations

import pytest

from cd.tweo import TWEO
from cd_models import tiny_vit


@pytest.mark.parametrize("given, named", [(dict(tau=5.0), "tau=5.0 would be ignored: tau is read"),
                                         (dict(eps=1e-3), "eps=0.001 would be ignored: eps is read"),
                                         (dict(tau=3.0, eps=1e-6), "tau=3.0, eps=1e-06 would be ignored: tau and "
                                                                   "eps are read")])
def test_the_class_refuses_tau_and_eps_beside_rescale_as_the_hook_does(given, named):
    """Given, even at the default values, they are refused with TweoHook's message under the class's name; without
    rescale they are taken, and a rescaled TWEO given neither builds."""
    with pytest.raises(ValueError) as refused:
        TWEO(tiny_vit(), rescale=True, **given)
    message = str(refused.value)
    assert message.startswith(f"TWEO {named} only when rescale=False") and "give rescale=False" in message
    pytest.importorskip("mmengine")
    from cd.integrations.mmengine import TweoHook
    with pytest.raises(ValueError) as by_hook:
        TweoHook(rescale=True, **given)
    assert str(by_hook.value) == "TweoHook" + message[len("TWEO"):]
    with TWEO(tiny_vit(), rescale=False, **given) as tweo:
        assert (tweo.tau, tweo.eps) == (given.get("tau", 3.0), given.get("eps", 1e-6))
    with TWEO(tiny_vit(), rescale=True) as tweo:
        assert (tweo.rescale, tweo.tau, tweo.eps) == (True, 3.0, 1e-6)


def test_from_config_refuses_a_tau_the_loader_would_refuse_and_builds_the_rescaled_default():
    """load_config refuses tweo.tau beside tweo.rescale=true; a TWEOConfig made in code with both reaches the class,
    which refuses it too; the config's own fill-ins (tau 3, eps 1e-6) beside rescale are no setting."""
    from configs import load_config
    from configs.schema import TWEOConfig

    with pytest.raises(ValueError, match=r"tweo.tau=5 would be ignored: tweo.tau is read only when tweo.rescale"):
        load_config(None, ["tweo.enabled=true", "tweo.rescale=true", "tweo.tau=5"])
    with pytest.raises(ValueError, match=r"^TWEO tau=5.0 would be ignored"):
        TWEO.from_config(TWEOConfig(enabled=True, rescale=True, tau=5.0), tiny_vit())
    cfg = load_config(None, ["tweo.enabled=true", "tweo.rescale=true"])
    with TWEO.from_config(cfg.tweo, tiny_vit()) as tweo:
        assert (tweo.rescale, tweo.tau, tweo.eps) == (True, 3.0, 1e-6)
