"""`model=` given to a cd.integrations object (as `ColinearityDecay(model, ...)` takes it): each takes the model
from its framework, so `model=` is refused naming that and the argument that names a part (`module=`), not with
Python's "multiple values for argument 'model'" (it was given once)."""
from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("where, cls, part", [("cd.integrations.hf", "ColinearityDecayCallback", True),
                                              ("cd.integrations.lightning", "ColinearityDecayCallback", True),
                                              ("cd.integrations.mmengine", "ColinearityDecayHook", True)])
def test_model_given_to_an_integration_is_refused_naming_where_the_model_comes_from(where, cls, part):
    framework = {"cd.integrations.hf": "transformers", "cd.integrations.lightning": "lightning"}.get(where, "mmengine")
    pytest.importorskip(framework)
    integration = getattr(importlib.import_module(where), cls)
    with pytest.raises(TypeError, match=r"^model= is not an argument of cd\.integrations: the model is the "
                                        r"framework's own") as refusal:
        integration(model="backbone", lam=0.005)
    assert ("module=" in str(refusal.value)) == part  # a part is named with module=, where the object takes it
    assert "multiple values" not in str(refusal.value)
