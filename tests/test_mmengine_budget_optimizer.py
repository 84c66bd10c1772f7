"""apply_weight_decay_budget (cd_budget=True in an MMEngine config) takes the rule beside an optimizer whose weight
decay is decoupled, W -= lr x wd x W per step (AdamW's, the form of CD's step), and refuses the torch optimizers
whose decay is L2 in the gradient in another form: checked against what each of them does to a matrix on zero
gradients, where decoupled decay alone leaves (1 - lr wd)^k W after k steps."""
import pytest
import torch

pytest.importorskip("mmengine")

LR, WD, STEPS = 0.1, 0.3, 3


def decays_decoupled(kind, **kwargs) -> bool:
    """Whether torch.optim.<kind> leaves (1 - lr wd)^STEPS W after STEPS steps on zero gradients (float64)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 5, dtype=torch.float64))
    start = w.detach().clone()
    opt = getattr(torch.optim, kind)([w], lr=LR, weight_decay=WD, **kwargs)
    for _ in range(STEPS):
        w.grad = torch.zeros_like(w)
        opt.step()
    return torch.allclose(w.detach(), (1 - LR * WD) ** STEPS * start, rtol=0, atol=1e-12)


def config(**optimizer):
    return {"cd_budget": True, "custom_hooks": [{"type": "ColinearityDecayHook", "lam": 0.005}],
            "optim_wrapper": {"optimizer": {"weight_decay": 0.05, **optimizer}}}


L2 = [("Adam", {}), ("Adamax", {}), ("Adagrad", {}), ("Adadelta", {}), ("ASGD", {}), ("NAdam", {}), ("RAdam", {}),
      ("RMSprop", {}), ("SGD", {"momentum": 0.9})]
DECOUPLED = [("AdamW", {}), ("Adam", {"decoupled_weight_decay": True}), ("NAdam", {"decoupled_weight_decay": True}),
             ("RAdam", {"decoupled_weight_decay": True}), ("SGD", {}), ("SGD", {"momentum": 0.0})]


@pytest.mark.parametrize("kind, kwargs", L2, ids=[k for k, _ in L2])
def test_an_optimizer_with_l2_decay_is_refused(kind, kwargs):
    from cd.integrations.mmengine import apply_weight_decay_budget

    assert not decays_decoupled(kind, **kwargs)  # the reference
    for given in (kind, getattr(torch.optim, kind), f"mmengine.{kind}"):  # a registry name, a class, a scoped name
        cfg = config(type=given, **kwargs)
        with pytest.raises(ValueError) as e:
            apply_weight_decay_budget(cfg)
        message, named = str(e.value), getattr(given, "__name__", given)
        assert message.startswith(f"cd_budget=True with optim_wrapper.optimizer.type={named}: ") and "\n" not in message
        assert "type='AdamW'" in message and "cd_budget=False and optim_wrapper.optimizer.weight_decay" in message
        assert cfg["optim_wrapper"]["optimizer"]["weight_decay"] == 0.05  # left as given


@pytest.mark.parametrize("kind, kwargs", DECOUPLED, ids=[f"{k}{''.join(f'-{a}' for a in kw)}" for k, kw in DECOUPLED])
def test_an_optimizer_with_decoupled_decay_takes_the_rule(kind, kwargs):
    from cd.integrations.mmengine import apply_weight_decay_budget

    assert decays_decoupled(kind, **kwargs)  # the reference
    cfg = config(type=kind, **kwargs)
    apply_weight_decay_budget(cfg)
    assert cfg["optim_wrapper"]["optimizer"]["weight_decay"] == 0.045


@pytest.mark.parametrize("kind", ["MyDecoupledAdam", None])
def test_an_optimizer_not_known_here_is_taken_as_given(kind):
    from cd.integrations.mmengine import apply_weight_decay_budget

    cfg = config(**({"type": kind} if kind else {}))
    apply_weight_decay_budget(cfg)
    assert cfg["optim_wrapper"]["optimizer"]["weight_decay"] == 0.045
