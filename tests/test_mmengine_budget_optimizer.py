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




def budget_net():
    """Register a float64 MMEngine model (patch tokens, one timm pre-norm block as `backbone.blocks.0`, a linear
    head) and its data, as BudgetNet and BudgetData."""
    import torch.nn.functional as F
    from mmengine.model import BaseModel
    from mmengine.registry import DATASETS, MODELS
    from timm.models.vision_transformer import Block

    from cd_integration_refs import RandomImages

    class Backbone(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = torch.nn.Conv2d(3, 16, 8, stride=8)
            self.blocks = torch.nn.Sequential(Block(16, 2))

        def forward(self, x):
            return self.blocks(self.patch(x).flatten(2).transpose(1, 2))

    @MODELS.register_module(name="BudgetNet", force=True)
    class Net(BaseModel):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.backbone, self.head = Backbone(), torch.nn.Linear(16, 10)
            self.double()

        def forward(self, inputs, labels=None, mode="tensor"):
            logits = self.head(self.backbone(inputs).mean(dim=1))
            return {"loss": F.cross_entropy(logits, labels)} if mode == "loss" else logits

    DATASETS.register_module(name="BudgetData", force=True, module=RandomImages)


def runner_config(tmp_path, weight_decay, custom_keys, apply=True):
    """A one-iteration Runner config with cd_budget and a ColinearityDecayHook of lam 0.005 (the budget applied
    unless `apply` is False)."""
    from cd.integrations.mmengine import apply_weight_decay_budget
    budget_net()
    cfg = dict(
        model=dict(type="BudgetNet"), work_dir=str(tmp_path), experiment_name=f"budget_{tmp_path.name}",
        train_dataloader=dict(dataset=dict(type="BudgetData"), batch_size=2, num_workers=0,
                              sampler=dict(type="InfiniteSampler", shuffle=False),
                              collate_fn=dict(type="default_collate")),
        train_cfg=dict(by_epoch=False, max_iters=1),
        optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-3, weight_decay=weight_decay),
                           paramwise_cfg=dict(custom_keys=custom_keys)),
        custom_imports=dict(imports=["cd.integrations.mmengine"], allow_failed_imports=False),
        custom_hooks=[dict(type="ColinearityDecayHook", lam=0.005, input_shape=(1, 3, 32, 32))],
        cd_budget=True, default_hooks=dict(checkpoint=None, logger=None), randomness=dict(seed=0),
        log_level="WARNING")
    if apply:
        apply_weight_decay_budget(cfg)
    return cfg


SWIN_KEYS = {"absolute_pos_embed": dict(decay_mult=0.), "relative_position_bias_table": dict(decay_mult=0.),
             "norm": dict(decay_mult=0.)}  # MMDetection's Swin configs' paramwise_cfg


def test_the_budget_with_the_swin_configs_decay_mults_gives_each_group_its_closed_form(tmp_path):
    """decay_mult 0 on norms (not matrices CD decays) keeps working: every matrix at 0.05 - 0.005, the norms at
    0 * 0.05 (no decay, and no CD on them either)."""
    pytest.importorskip("timm")
    from mmengine_runs import run
    runner = run(runner_config(tmp_path, 0.05, SWIN_KEYS))
    names = {id(p): n for n, p in runner.model.named_parameters()}
    got = {names[id(p)]: g["weight_decay"] for g in runner.optim_wrapper.optimizer.param_groups for p in g["params"]}
    want = {n: 0.0 if "norm" in n else 0.045 for n in names.values()}
    assert got == pytest.approx(want, rel=1e-12, abs=0)


@pytest.mark.parametrize("weight_decay, keys, named", [
    (0.05, {"fc2": dict(decay_mult=0.5)}, r"backbone\.blocks\.0\.mlp\.fc2\.weight, a matrix ColinearityDecayHook "
                                          r"decays, at weight decay 0\.0225 \(paramwise_cfg decay_mult=0\.5, whose "
                                          r"budget is 0\.5 \* 0\.05 - lam 0\.005, not 0\.5 \* \(0\.05 - lam\)"),
    (0.05, {"attn.qkv": dict(decay_mult=0.)}, r"backbone\.blocks\.0\.attn\.qkv\.weight, .* decay_mult=0\.0"),
    (0.005, {"fc1": dict(decay_mult=2.)},
     r"backbone\.blocks\.0\.mlp\.fc1\.weight, .* at weight decay 0\.0 \(paramwise_cfg decay_mult=2"),
    (0.05, {"proj": dict(weight_decay=0.1)},
     r"backbone\.blocks\.0\.attn\.proj\.weight, .* at weight decay 0\.1 \(not the lowered 0\.045")],
    ids=["half", "zero", "lowered_to_0", "own_weight_decay"])
def test_the_budget_refuses_a_decay_mult_or_own_weight_decay_on_a_matrix_cd_decays(tmp_path, weight_decay, keys,
                                                                                    named):
    """The budget of a matrix whose baseline weight decay is m * wd is m * wd - lam (App. A.2: lam_wd + lam_cd =
    the baseline's); the rule's one lowered weight decay times m gave m * (wd - lam) (0.5 * 0.045 = 0.0225, not
    0.02), silently, and -lam for m = 0 cannot be given at all: refused before any update, also where the lowered
    weight decay is 0 (wd = lam: every multiple of it reads 0) and for a group's own weight decay."""
    pytest.importorskip("timm")
    from mmengine_runs import run
    cfg = runner_config(tmp_path, weight_decay, {**SWIN_KEYS, **keys})
    with pytest.raises(ValueError, match=rf"^cd_budget \(applied: .*\) with {named}") as e:
        run(cfg)
    assert "\n" not in str(e.value) and str(e.value).endswith("or set cd_budget=False and every weight decay yourself")


def test_a_cd_budget_that_nothing_applied_is_refused_before_any_update(tmp_path):
    """A Runner built from a config with cd_budget=True as it is (MMEngine's tools/train.py, which reads it as an
    unused variable) trained at the unlowered weight decay with CD on top, silently; the hook refuses it, naming
    apply_weight_decay_budget and cd_budget=False. False trains at the weight decay given."""
    pytest.importorskip("timm")
    from mmengine_runs import run
    with pytest.raises(ValueError, match=r"^cd_budget=True, but the optimizer's weight decay was not lowered .*"
                                         r"apply_weight_decay_budget\(cfg\) before the Runner is built"):
        run(runner_config(tmp_path / "unapplied", 0.05, SWIN_KEYS, apply=False))
    cfg = dict(runner_config(tmp_path / "off", 0.05, SWIN_KEYS, apply=False), cd_budget=False)
    groups = run(cfg).optim_wrapper.optimizer.param_groups
    assert {g["weight_decay"] for g in groups} == {0.0, 0.05}


def test_the_budget_lowers_the_heads_weight_decay_too_and_a_decay_mult_on_the_head_keeps_its_own(tmp_path):
    """The rule lowers the optimizer's one weight decay, so the parts CD does not decay (a detector's neck and
    heads; here the head) train at 0.05 - lam as well (cd/README.md); a decay_mult of wd / (wd - lam) on them in
    paramwise_cfg.custom_keys gives them back 0.05, which the hook takes (it refuses a decay_mult only on the
    matrices it decays), while the backbone's matrices keep 0.045."""
    pytest.importorskip("timm")
    from mmengine_runs import run

    def weight_decays(runner):
        names = {id(p): n for n, p in runner.model.named_parameters()}
        return {names[id(p)]: g["weight_decay"] for g in runner.optim_wrapper.optimizer.param_groups
                for p in g["params"]}

    lowered = weight_decays(run(runner_config(tmp_path / "rule", 0.05, SWIN_KEYS)))
    assert lowered["head.weight"] == lowered["head.bias"] == pytest.approx(0.045, rel=1e-12, abs=0)
    kept = weight_decays(run(runner_config(tmp_path / "head", 0.05, {**SWIN_KEYS, "head": dict(
        decay_mult=0.05 / 0.045)})))
    want = {n: 0.05 if n.startswith("head.") else 0.0 if "norm" in n else 0.045 for n in kept}
    assert kept == pytest.approx(want, rel=1e-12, abs=0)
