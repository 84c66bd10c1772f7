"""cd.integrations' shared part, torch alone: OptimizerBinding applies CD once per real step, where the step
really runs (armed before the step; inside a closure, once the closure returns), never without gradients, and the
integrations' arguments are ColinearityDecay's."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from cd import ColinearityDecay
from cd.integrations import OptimizerBinding, bind_optimizers, check_cd_arguments, holds_pairs
from cd.wrappers import torch_optimizer, unwrap_model
from cd_models import changed, snapshot, tiny_vit


def _setup(optimizer_cls=torch.optim.SGD, **kw):
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.5)
    opt = optimizer_cls(model.parameters(), lr=0.1, **kw)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    return model, decay, opt, lambda: F.cross_entropy(model(x), y)


def test_armed_before_the_step_it_runs_once_in_the_step_and_not_unarmed():
    model, decay, opt, loss = _setup()
    binding = OptimizerBinding(decay, opt)
    loss().backward()
    opt.step()  # not armed: no CD
    assert decay.num_updates == 0
    binding.arm()
    binding.arm()  # a second event before the same step: still once
    assert decay.num_updates == 0  # not before the step itself
    opt.step()
    opt.step()  # the next step is not armed
    assert decay.num_updates == 1


def test_a_step_without_the_event_is_an_error_with_strict_steps_and_missed_says_a_step_went_around():
    model, decay, opt, loss = _setup()
    binding = OptimizerBinding(decay, opt, strict_steps=True)
    opt.step()  # no gradient yet: the optimizer changes nothing, nor would CD
    binding.arm()
    assert binding.missed()  # armed, no step since
    loss().backward()
    opt.step()
    assert decay.num_updates == 1 and not binding.missed()
    with pytest.raises(RuntimeError, match="without the framework's step event"):
        opt.step()  # gradients, but no event: CD would not run
    binding.arm(until_disarmed=True)
    assert not binding.missed()  # MMEngine's iteration-long arming: its steps are counted by the hook, not here


def test_armed_inside_a_closure_it_runs_once_per_step_before_the_weights_are_read():
    model, decay, opt, loss = _setup(torch.optim.LBFGS, max_iter=3)
    binding = OptimizerBinding(decay, opt)
    calls = []

    def closure():  # as Lightning's: forward, backward, then the event
        opt.zero_grad()
        value = loss()
        value.backward()
        binding.arm()
        calls.append(1)
        return value

    opt.step(closure)
    assert len(calls) > 1 and decay.num_updates == 1


def test_armed_inside_a_closure_it_waits_for_the_rest_of_the_closure():
    """Lightning's closure arms CD in the callbacks' hook, then runs the LightningModule's own hook and the gradient
    clipping: what they do (here the step's lr set to 0) comes before the update, which ran at arm() before."""
    model, decay, opt, loss = _setup()
    binding = OptimizerBinding(decay, opt)
    before = snapshot(model)

    def closure():
        opt.zero_grad()
        value = loss()
        value.backward()
        binding.arm()
        for group in opt.param_groups:  # a warmup set after the callbacks' hook: this step's lr is 0
            group["lr"] = 0.0
        return value

    opt.step(closure)
    assert not changed(model, before) and decay.num_updates == 0  # a step with lr 0 is no update


def test_armed_during_a_step_without_a_closure_it_runs_then_once_before_the_weights_are_read():
    """The event coming inside a step that has no closure (here from a step pre-hook after the binding's): the
    update runs at once, once, on the weights of before the step, which the optimizer then reads (against CD by hand
    then SGD); deferred instead, the step would be taken without CD and the next one would get it."""
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    binding = OptimizerBinding(decay, opt)
    opt.register_step_pre_hook(lambda *_: (binding.arm(), binding.arm()) and None)  # twice: still one update
    want, grads = one_update_by_hand(model)
    opt.step()
    assert decay.num_updates == 1
    for name, p in model.named_parameters():
        assert torch.allclose(p.double(), want[name].double() - 0.05 * grads[name].double(), rtol=0, atol=1e-6), name


def test_no_gradient_no_update_and_a_removed_binding_does_nothing():
    model, decay, opt, loss = _setup()
    binding = OptimizerBinding(decay, opt)
    before = snapshot(model)
    binding.arm()
    opt.step()  # no backward: the optimizer leaves the weights alone, and so does CD
    assert decay.num_updates == 0 and all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    binding.remove()
    loss().backward()
    binding.arm()
    opt.step()
    assert decay.num_updates == 0


def test_bind_optimizers_binds_every_optimizer_and_refuses_when_none_holds_the_matrices():
    model, decay, opt, _ = _setup()
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert list(bind_optimizers(decay, [other, opt])) == [id(other), id(opt)]  # `other` may get some later
    with pytest.raises(ValueError, match="no optimizer holds"):
        bind_optimizers(decay, [other])
    half = torch.optim.SGD(list(model.blocks[0].parameters()), lr=0.1)
    with pytest.warns(UserWarning, match="not in the optimizer"):  # left alone, as attach leaves them
        bind_optimizers(decay, [half])


def test_matrices_split_over_several_optimizers_are_not_warned_about_as_left_alone():
    """Each optimizer of several (an OptimWrapperDict's, a LightningModule's) holds a part of the decayed matrices:
    CD decays all of them, each in its own optimizer's step, so no warning says any is left alone; a matrix
    that none of them holds is named, once."""
    model, decay, _, _ = _setup()
    first = list(model.blocks[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bind_optimizers(decay, [torch.optim.SGD(first, lr=0.1), torch.optim.SGD(rest, lr=0.1)])
    fc2 = model.blocks[1].mlp.fc2.weight
    without_fc2 = [p for p in rest if p is not fc2]
    with pytest.warns(UserWarning) as record:
        bind_optimizers(ColinearityDecay(model, lam=0.5),
                        [torch.optim.SGD(first, lr=0.1), torch.optim.SGD(without_fc2, lr=0.1)])
    assert [str(w.message).split(" (e.g.")[0] for w in record] == ["1 decayed matrices are not in the optimizer"]
    assert "blocks.1.mlp.fc2.weight" in str(record[0].message)


def test_target_c_upstream_matrices_outside_the_optimizer_are_named_like_attach_names_them():
    # target C decays W1 too: an optimizer holding every W2 but no W1 leaves the W1 alone (attach warns the same)
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.5, targets="C")
    upstream = {id(p.upstream) for p in decay.pairs}
    opt = torch.optim.SGD([p for p in model.parameters() if id(p) not in upstream], lr=0.1)
    with pytest.warns(UserWarning, match=rf"{len(upstream)} decayed matrices are not in the optimizer"):
        OptimizerBinding(decay, opt)


def test_arguments_are_colinearity_decays():
    assert check_cd_arguments({"lam": 0.01, "lam_per_role": {"fc2": 0.02}, "gated_mlp": True})
    with pytest.raises(TypeError, match="lamda"):
        check_cd_arguments({"lamda": 0.1})
    with pytest.raises(TypeError, match="decoupled update"):
        check_cd_arguments({"mode": "loss"})


def test_mode_decoupled_is_what_the_integrations_run_and_is_taken_the_loss_form_refused_naming_its_fix():
    """mode='decoupled' (ColinearityDecay's default, the update the integrations give; a config written out in full
    gives it, as configs/method/cd.yaml does) was refused as a loss-form argument, whose fix (aux_loss in the
    training step) is not what was asked; the loss form is refused naming the value given and how to run it."""
    assert check_cd_arguments({"lam": 0.01, "mode": "decoupled"}) == {"lam": 0.01, "mode": "decoupled",
                                                                     "norms_every": 50}
    for given, named in (({"mode": "loss"}, "mode='loss'"), ({"loss_coef": 0.005}, "loss_coef=0.005"),
                         ({"mode": "loss", "loss_coef": 0.005}, "mode='loss', loss_coef=0.005")):
        with pytest.raises(TypeError) as refused:
            check_cd_arguments(given)
        assert str(refused.value) == (
            f"{named}: the integrations apply CD's decoupled update (mode='decoupled', the default); the loss form "
            "is not run by them: drop mode= and loss_coef=, or train without the integration, with "
            "ColinearityDecay(model, mode='loss') and loss + cd.aux_loss(loss) in your training step")


def test_the_update_norms_are_computed_on_train_pys_default_log_interval_unless_norms_every_is_given():
    """They cost about as much again as the update (cd/README.md): the integrations compute them where train.py
    does by default, on every `train.log_every_steps`-th update; a given norms_every is honoured."""
    from cd.integrations import NORMS_EVERY
    from configs.schema import TrainConfig

    assert NORMS_EVERY == TrainConfig().log_every_steps == 50
    assert check_cd_arguments({"lam": 0.01}) == {"lam": 0.01, "norms_every": 50}
    assert check_cd_arguments({"lam": 0.01, "norms_every": 1}) == {"lam": 0.01, "norms_every": 1}


@pytest.mark.parametrize("kwargs, message", [
    ({"lam": float("nan")}, r"cd lam must be a finite number >= 0, got nan"),
    ({"lam": -0.1}, r"cd lam must be a finite number >= 0"),
    ({"lam_per_role": {"mlp": 0.1}}, r"unknown role\(s\) \['mlp'\]"),
    ({"lam_per_role": "{'fc2': 0.02}"}, r"lam_per_role must be a mapping of role to strength.*\(str\)"),
    ({"targets": "Z"}, r"cd targets must be one of"),
    ({"matmul_precision": "fp8"}, r"cd matmul_precision must be one of"),
    ({"norms_every": 0}, r"cd norms_every must be an integer >= 1"),
    ({"example_input": torch.zeros(1, 3, 32, 32), "verify": False}, r"example_input serves the pair checks only"),
])
def test_values_that_need_no_model_are_checked_when_the_callback_is_made(kwargs, message):
    """They were accepted here and refused only at the framework's train start (HF on_train_begin, Lightning
    setup, MMEngine before_train), after the Trainer / Runner had been built."""
    with pytest.raises(ValueError, match=message):
        check_cd_arguments(kwargs)


def test_a_binding_beside_an_attach_of_the_same_matrices_is_refused_both_ways():
    # e.g. Lightning's callback and an attach() in configure_optimizers: each step would decay twice
    model, decay, opt, _ = _setup()
    handle = ColinearityDecay(model, lam=0.5).attach(opt)
    with pytest.raises(RuntimeError, match=r"another CD update runs in this optimizer's step already"):
        OptimizerBinding(decay, opt)
    handle.remove()
    binding = OptimizerBinding(decay, opt)
    with pytest.raises(RuntimeError, match=r"another CD update runs in this optimizer's step already"):
        ColinearityDecay(model, lam=0.5).attach(opt)
    with pytest.raises(RuntimeError, match=r"another CD update"):
        OptimizerBinding(decay, opt)  # one binding of one decay: still twice
    binding.remove()
    OptimizerBinding(decay, opt)  # a removed binding is gone


def test_a_bind_refused_at_a_later_optimizer_leaves_no_hook_on_the_earlier_ones_and_a_retry_binds():
    """bind_optimizers over two optimizers, the second with an attach of the same matrices: refused, and the first
    optimizer (bound before the refusal) keeps no hook of it; once the attach is removed, as the refusal asks, a
    new bind (MMEngine's train() again, whose hook binds at before_train) is not refused by the failed one's."""
    model, decay, _, loss = _setup()
    first = list(model.blocks[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    a, b = torch.optim.SGD(first, lr=0.1), torch.optim.SGD(rest, lr=0.1)
    with pytest.warns(UserWarning, match="not in the optimizer"):  # block 0's matrices are a's
        handle = ColinearityDecay(model, lam=0.5).attach(b)
    with pytest.raises(RuntimeError, match=r"another CD update runs in this optimizer's step already"):
        bind_optimizers(decay, [a, b])
    assert not a._optimizer_step_pre_hooks and not a._optimizer_step_post_hooks
    assert len(b._optimizer_step_pre_hooks) == 1  # the attach's alone
    handle.remove()
    bindings = bind_optimizers(decay, [a, b])
    for binding in bindings.values():
        binding.arm()
    loss().backward()
    a.step()
    b.step()
    assert decay.num_updates == 1


def test_a_disarmed_binding_leaves_the_next_step_alone():
    """disarm() after an event whose step never came (a GradScaler skip, an iteration without an update): the
    next step of the optimizer, outside the framework's event, is the plain optimizer step of a copy."""
    model, decay, opt, loss = _setup()
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    binding = OptimizerBinding(decay, opt)
    binding.arm()
    binding.disarm()
    loss().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        q.grad = p.grad.clone()
    opt.step()
    plain_opt.step()
    assert decay.num_updates == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


class _Wrapper(torch.nn.DataParallel):
    """A DataParallel on no device (no GPU is used): the model as `.module`."""

    def __init__(self, module):
        torch.nn.Module.__init__(self)  # DataParallel's own would move the model to a GPU where there is one
        self.module, self.device_ids = module, []


class _WithAModuleChild(torch.nn.Module):
    """A model that happens to name one of its parts `module`: no wrapper."""

    def __init__(self):
        super().__init__()
        self.module, self.head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)


def test_unwrap_model_strips_wrappers_and_compile_in_any_order_and_nothing_else():
    net = tiny_vit()
    assert unwrap_model(net) is net
    assert unwrap_model(_Wrapper(_Wrapper(net))) is net
    assert unwrap_model(_Wrapper(torch.compile(_Wrapper(net)))) is net  # compile's _orig_mod, between wrappers
    model = _WithAModuleChild()
    assert unwrap_model(model) is model and unwrap_model(_Wrapper(model)) is model


def test_torch_optimizer_looks_through_framework_wrappers_and_refuses_a_scheduler():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)

    class Held:  # MMEngine's OptimWrapper, Lightning's LightningOptimizer: `.optimizer` / `._optimizer`
        def __init__(self, name, inner):
            setattr(self, name, inner)

    assert torch_optimizer(opt) is opt
    assert torch_optimizer(Held("optimizer", Held("_optimizer", opt))) is opt
    with pytest.raises(TypeError, match="an lr scheduler"):
        torch_optimizer(torch.optim.lr_scheduler.StepLR(opt, 1))
    with pytest.raises(TypeError, match="got Held"):
        torch_optimizer(Held("other", opt))


def w1s_apart(model: torch.nn.Module) -> tuple[list, list]:
    """(the W1s and the norms, the rest) of a tiny ViT: every functional pair split over two optimizers."""
    first = [p for n, p in model.named_parameters() if n.endswith(("qkv.weight", "fc1.weight", "norm1.weight",
                                                                   "norm2.weight"))]
    return first, [p for p in model.parameters() if all(p is not q for q in first)]


def armed_sgd_pair(decay: ColinearityDecay, first: list, rest: list, lr_a: float, lr_b: float) -> tuple:
    """SGD over `first` (`a`) and `rest` (`b`) bound to `decay`, every gradient zero (a step then changes only
    what CD does), armed for the iteration: (opt_a, opt_b, bindings)."""
    opt_a, opt_b = torch.optim.SGD(first, lr=lr_a), torch.optim.SGD(rest, lr=lr_b)
    bindings = bind_optimizers(decay, [opt_a, opt_b])
    for p in [*first, *rest]:
        p.grad = torch.zeros_like(p)
    arm_all(bindings)
    return opt_a, opt_b, bindings


def arm_all(bindings: dict) -> None:
    """The framework's iteration begins: every binding armed for all of its updates."""
    for binding in bindings.values():
        binding.arm(until_disarmed=True)


# the W1s of the functional pairs (qkv's V rows and fc1) with the norms in front of them: `a`'s part of a split
W1_SIDE = ("qkv.weight", "fc1.weight", "norm1.weight", "norm2.weight")


def one_update_by_hand(model, lr: float = 0.05, lam: float = 0.5) -> tuple[dict, dict]:
    """Random gradients set on every parameter of the tiny ViT, and the hand-written outcome of one update: CD of
    the weights of now (cd_models.ref_block_update), then SGD at `lr`. (want, grads): want[name] - lr *
    grads[name] is each weight after one SGD step."""
    from cd_models import ref_block_update

    named = dict(model.named_parameters())
    before = snapshot(model)
    want = dict(before)
    for b in ("blocks.0", "blocks.1"):
        ref_block_update(before, b, lr * lam, want)
    grads = {n: torch.randn_like(p) for n, p in named.items()}
    for name, p in named.items():
        p.grad = grads[name].clone()
    return want, grads


def test_a_pair_split_over_two_optimizers_is_decayed_from_the_weights_before_either_step():
    """Target C over two optimizers, each functional pair split (W1 in `a`, W2 in `b`), stepped `b` then `a` with
    gradients of zero (SGD then changes nothing): the weights are one CD update of the weights of before the
    steps, written out here (W2 <- W2 - s W2 W1n W1n^T, W1 <- W1 - s c^2 W2^T W2 W1), counted once."""
    from cd_models import ref_w2

    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=0.5, targets="C")
    first, rest = w1s_apart(model)
    before = snapshot(model)
    opt_a, opt_b, bindings = armed_sgd_pair(decay, first, rest, 0.1, 0.02)
    opt_b.step()
    opt_a.step()
    for binding in bindings.values():
        binding.disarm()

    def up(w2, w1, s):  # W1 <- W1 - s c^2 W2^T W2 W1, c = sqrt(r) / ||W1||_F
        return w1 - s * (w1.shape[0] / torch.linalg.matrix_norm(w1) ** 2) * w2.T @ w2 @ w1

    s_a, s_b, want = 0.1 * 0.5, 0.02 * 0.5, {}
    for b in ("blocks.0", "blocks.1"):
        qkv, fc1 = before[f"{b}.attn.qkv.weight"], before[f"{b}.mlp.fc1.weight"]
        proj, fc2 = before[f"{b}.attn.proj.weight"], before[f"{b}.mlp.fc2.weight"]
        v = slice(2 * qkv.shape[0] // 3, qkv.shape[0])
        want[f"{b}.attn.proj.weight"] = ref_w2(proj, qkv[v], s_b)
        want[f"{b}.mlp.fc2.weight"] = ref_w2(fc2, fc1, s_b)
        new_qkv = qkv.clone()  # target C leaves the composable pairs alone: only the V rows, as proj's W1
        new_qkv[v] = up(proj, qkv[v], s_a)
        want[f"{b}.attn.qkv.weight"] = new_qkv
        want[f"{b}.mlp.fc1.weight"] = up(fc2, fc1, s_a)
    for name, p in model.named_parameters():
        assert torch.allclose(p, want.get(name, before[name]), rtol=0, atol=1e-12), name
    assert decay.metrics()["cd/updates"] == 1


def test_the_update_norms_of_a_role_cover_its_matrices_in_every_optimizer():
    """Block 0 in `a`, block 1 in `b`: the logged update norm of a role is the Frobenius norm of its whole update
    (both blocks' changes of the weights, measured here), not of the part in the optimizer that stepped last."""
    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=0.5, norms_every=1)
    first = list(model.blocks[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    before = snapshot(model)
    opt_a, opt_b, _ = armed_sgd_pair(decay, first, rest, 0.1, 0.02)
    opt_a.step()
    opt_b.step()
    metrics = decay.metrics()
    for role, name in (("qkv", "attn.qkv"), ("proj", "attn.proj"), ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
        after = snapshot(model)
        change = [after[f"blocks.{i}.{name}.weight"] - before[f"blocks.{i}.{name}.weight"] for i in (0, 1)]
        assert all(float(c.abs().max()) > 0 for c in change)
        want = float(torch.sqrt(sum(c.square().sum() for c in change)))
        assert metrics[f"cd/update_norm/{role}"] == pytest.approx(want, rel=1e-9), role
    assert metrics["cd/updates"] == 1


def test_optimizers_that_step_twice_in_one_iteration_make_two_updates():
    """A train_step that steps `a`, `b`, `a`, `b` (two updates, e.g. an inner loop) with each functional pair split
    over them: two CD updates, the second from the weights after the first (the hand-written update applied
    twice), counted twice."""
    from cd_models import ref_block_update

    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=0.5)
    first, rest = w1s_apart(model)
    want = snapshot(model)
    for _ in range(2):
        new = dict(want)
        for b in ("blocks.0", "blocks.1"):
            ref_block_update(want, b, 0.05 * 0.5, new)
        want = new
    opt_a, opt_b, _ = armed_sgd_pair(decay, first, rest, 0.05, 0.05)
    for opt in (opt_a, opt_b, opt_a, opt_b):
        opt.step()
    got = snapshot(model)
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=0, atol=1e-12), name
    assert decay.metrics()["cd/updates"] == 2


def test_a_pair_split_by_a_param_group_added_later_reads_the_weights_of_before_the_steps():
    """Block 1's proj and fc2 join `b` after the binding (add_param_group, as when a stage is unfrozen), while their
    W1s (qkv V rows, fc1) are in `a`, which steps first: their update reads W1 as it was before `a`'s step, as the
    one update of the hand-written reference (CD of the weights before, then the SGD step), not W1 after it."""
    step_a_late_split(in_a=lambda n: n.endswith(W1_SIDE), in_b=lambda n: not n.endswith(W1_SIDE),
                      late=lambda n: n.startswith("blocks.1.") and not n.endswith(W1_SIDE), order="ab")


def step_a_late_split(in_a, in_b, late, order: str) -> None:
    """SGD `a` over the parameters `in_a` and `b` over `in_b` names, but those `late` names, which join `b` after
    CD is bound (add_param_group); one update in `order` matches the hand-written one (one_update_by_hand)."""
    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=0.5)
    named = dict(model.named_parameters())
    opts = {key: torch.optim.SGD([p for n, p in named.items() if chosen(n) and not late(n)], lr=0.05)
            for key, chosen in (("a", in_a), ("b", in_b))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the late matrices are in no optimizer yet
        bindings = bind_optimizers(decay, list(opts.values()))
    opts["b"].add_param_group({"params": [p for n, p in named.items() if late(n)]})
    want, grads = one_update_by_hand(model)
    arm_all(bindings)
    for key in order:
        opts[key].step()
    for name, p in named.items():
        assert torch.allclose(p, want[name] - 0.05 * grads[name], rtol=0, atol=1e-12), name
    assert decay.metrics()["cd/updates"] == 1


@pytest.mark.parametrize("inf_in", ["a", "b", "ab"])
def test_fused_steps_that_the_grad_scaler_skips_count_an_update_only_if_every_part_was_skipped(inf_in):
    """Fused AdamW under GradScaler steps even on inf gradients (its kernel skips them, and CD's part is gated on
    the device): an update of which one optimizer's part ran is counted once, whichever optimizer steps first, as
    when non-fused steps skip (the skipped step never runs); one whose every part was skipped is not counted."""
    for order in ("ab", "ba"):
        model = tiny_vit()
        decay = ColinearityDecay(model, lam=0.5)
        first = list(model.blocks[0].parameters())
        rest = [p for p in model.parameters() if all(p is not q for q in first)]
        opts = {"a": torch.optim.AdamW(first, lr=0.1, fused=True), "b": torch.optim.AdamW(rest, lr=0.1, fused=True)}
        bindings = bind_optimizers(decay, list(opts.values()))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
        scaler.scale(torch.ones(()))  # the scaler's scale, as scaling the loss makes it
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        for name in inf_in:
            next(iter(opts[name].param_groups[0]["params"])).grad.view(-1)[0] = float("inf")
        before = snapshot(model)
        arm_all(bindings)
        for name in order:
            scaler.step(opts[name])
        for binding in bindings.values():
            binding.disarm()
        ran = [name for name, opt in opts.items()
               if any(not torch.equal(p, before[n]) for n, p in model.named_parameters()
                      if any(p is q for q in opt.param_groups[0]["params"]))]
        assert ran == [name for name in "ab" if name not in inf_in]
        assert decay.metrics()["cd/updates"] == (1 if ran else 0), order


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_a_copy_is_kept_only_of_matrices_that_a_part_still_to_come_reads(order, monkeypatch):
    """Each functional pair split (W1s in `a`, W2s in `b`): `b`'s part reads the W1s of before `a`'s step, so `a`
    keeps a copy of each when it steps first (4: qkv and fc1 of two blocks), and none once `b` has stepped (its
    part has read them already); the update is the hand-written one either way (CD of the weights before, then
    the SGD step)."""
    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=0.5)
    named = dict(model.named_parameters())
    first = [n for n in named if n.endswith(W1_SIDE)]
    opts = {"a": torch.optim.SGD([named[n] for n in first], lr=0.05),
            "b": torch.optim.SGD([p for n, p in named.items() if n not in first], lr=0.05)}
    bindings = bind_optimizers(decay, list(opts.values()))
    want, grads = one_update_by_hand(model)
    copies = []
    clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: copies.append(t.shape) or clone(t, *a, **k))
    arm_all(bindings)
    for name in order:
        opts[name].step()
    monkeypatch.undo()
    assert len(copies) == (4 if order == "ab" else 0)
    for name, p in named.items():
        assert torch.allclose(p, want[name] - 0.05 * grads[name], rtol=0, atol=1e-12), name


def test_a_step_of_an_optimizer_whose_decayed_matrices_have_no_gradient_is_no_update():
    """Block 0 in `a` (accumulating: it has gradients, and does not step), block 1 in `b` without gradients: `b`'s
    step changes no weight, so it is no CD update, as a step without gradients is none with one optimizer."""
    model = tiny_vit()
    decay = ColinearityDecay(model, lam=0.5)
    first = list(model.blocks[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    opt_a, opt_b = torch.optim.SGD(first, lr=0.1), torch.optim.SGD(rest, lr=0.1)
    bindings = bind_optimizers(decay, [opt_a, opt_b])
    for p in first:
        p.grad = torch.randn_like(p)
    before = snapshot(model)
    arm_all(bindings)
    opt_b.step()
    assert changed(model, before) == []
    assert decay.metrics()["cd/updates"] == 0


def test_apply_beside_a_live_binding_is_refused_as_beside_an_attach():
    """The bindings' steps make the update: apply() too would decay every matrix twice per step (it was taken)."""
    model, decay, opt, _ = _setup()
    bindings = bind_optimizers(decay, [opt])
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="would decay twice per step"):
        decay.apply(0.1)
    assert changed(model, before) == []
    for binding in bindings.values():
        binding.remove()
    decay.apply(0.1)  # unbound: the caller's own loop
    assert changed(model, before)


@pytest.mark.parametrize("where", ["added to b", "in b from the start", "in a from the start"])
def test_a_stage_unfrozen_into_an_optimizer_that_held_no_decayed_matrix_gets_cd_as_if_it_was_there_from_the_start(
        where):
    """Block 1 frozen for the first update, then unfrozen and added (add_param_group) to `b`, which held only the
    head when CD was bound (as a fine-tuning schedule unfreezes a stage), with real gradients and AdamW: after each
    of four updates the weights are the hand-written ones, float64, with no CD bound (cd_models.ref_block_update,
    paper Eq. (12), of the weights before the step for each block with gradients, then a plain AdamW step), as
    they are where block 1 was there from the start, in `b` or in `a` beside block 0 and its gradients (there `a`'s
    step runs CD while block 1 is frozen: CD must leave it alone, as the optimizer does)."""
    from cd_models import ref_block_update

    def run(where) -> list:  # where None: the hand-written reference
        model = tiny_vit().double()
        named = dict(model.named_parameters())
        block1, head = list(model.blocks[1].parameters()), list(model.head.parameters())
        rest = [p for p in model.parameters() if all(p is not q for q in block1 + head)]
        for p in block1:
            p.requires_grad_(False)
        start = snapshot(model)
        opt_a = torch.optim.AdamW(rest + block1 if where == "in a from the start" else rest, lr=0.01)
        opt_b = torch.optim.AdamW(head + block1 if where in ("in b from the start", None) else head, lr=0.01)
        bindings = {}
        if where is not None:
            decay = ColinearityDecay(model, lam=0.5)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # block 1 outside the optimizers, or all frozen there
                bindings = bind_optimizers(decay, [opt_a, opt_b])
        gen, after = torch.Generator().manual_seed(1), []
        for step in range(4):
            if step == 1:  # the stage is unfrozen
                for p in block1:
                    p.requires_grad_(True)
                if where == "added to b":
                    opt_b.add_param_group({"params": block1})
            x = torch.randn(4, 3, 32, 32, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 10, (4,), generator=gen)
            F.cross_entropy(model(x), y).backward()
            if where is None:  # CD of the blocks with gradients (both AdamW groups' lr 0.01), from the weights before
                before = snapshot(model)
                want = dict(before)
                for b in ("blocks.0", "blocks.1") if step else ("blocks.0",):
                    ref_block_update(before, b, 0.01 * 0.5, want)
                with torch.no_grad():
                    for name, p in named.items():
                        p.copy_(want[name])
            arm_all(bindings)
            opt_a.step()
            opt_b.step()
            for binding in bindings.values():
                binding.disarm()
            opt_a.zero_grad()
            opt_b.zero_grad()
            after.append(snapshot(model))
            if step == 0:  # frozen: neither AdamW nor CD moved block 1
                for name in start:
                    if name.startswith("blocks.1."):
                        assert torch.equal(after[0][name], start[name]), (where, name)
        if where is not None:
            assert decay.metrics()["cd/updates"] == 4
        return after

    want, got = run(None), run(where)
    assert not torch.equal(got[-1]["blocks.1.mlp.fc2.weight"], tiny_vit().double().blocks[1].mlp.fc2.weight)
    for step, (w, g) in enumerate(zip(want, got)):
        for name in w:
            torch.testing.assert_close(g[name], w[name], rtol=1e-10, atol=1e-12, msg=f"update {step}: {name}")


def test_matrices_exchanged_between_two_optimizers_are_decayed_from_the_weights_before_either_step():
    """`a` holds block 0's fc1 and block 1's fc2, `b` the other two (each MLP pair split), and after one update
    the two exchange them, which leaves every group's length as it was: the second update must still read the
    pre-step copy of what `a` holds now, as one optimizer holding all four does (SGD on zero gradients: only CD
    moves the weights)."""
    def run(split: bool) -> dict:
        model = tiny_vit().double()
        decay = ColinearityDecay(model, lam=0.5)
        fc = [(blk.mlp.fc1.weight, blk.mlp.fc2.weight) for blk in model.blocks]
        groups = [[fc[0][0], fc[1][1]], [fc[0][1], fc[1][0]]]
        opts = [torch.optim.SGD(g, lr=0.1) for g in groups] if split else [torch.optim.SGD(sum(groups, []), lr=0.1)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # qkv and proj are in no optimizer
            bindings = bind_optimizers(decay, opts)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for update in range(2):
            if update == 1 and split:
                opts[0].param_groups[0]["params"], opts[1].param_groups[0]["params"] = groups[1], groups[0]
            arm_all(bindings)
            for opt in opts:
                opt.step()
            for binding in bindings.values():
                binding.disarm()
        return snapshot(model)

    want, got = run(split=False), run(split=True)
    assert not torch.equal(want["blocks.0.mlp.fc1.weight"], tiny_vit().double().blocks[0].mlp.fc1.weight)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-14, msg=name)

def test_a_raw_step_of_an_optimizer_holding_no_decayed_matrix_is_not_refused_as_a_step_around_cd():
    """strict_steps refuses a step that ran without the framework's event where CD had a part in it; an optimizer
    of the head alone has none (bound all the same, for a stage that may join it later), so its step is allowed."""
    model, decay, _, loss = _setup()
    head = list(model.head.parameters())
    opt_a = torch.optim.SGD([p for p in model.parameters() if all(p is not q for q in head)], lr=0.1)
    opt_b = torch.optim.SGD(head, lr=0.1)
    bind_optimizers(decay, [opt_a, opt_b], strict_steps=True)
    loss().backward()
    opt_b.step()  # every decayed matrix has a gradient, none of them in `b`
    with pytest.raises(RuntimeError, match="without the framework's step event"):
        opt_a.step()


def test_a_second_step_of_an_optimizer_holding_no_decayed_matrix_does_not_start_the_next_update():
    """W1s in `a`, W2s in `b`, the head alone in `h`, stepped a, h, h, b (a head updated twice per iteration): `h`
    takes no part in the update, so its second step leaves the update whole, and `b`'s part reads the W1s of
    before `a`'s step, as the hand-written update (CD of the weights before, then the SGD step)."""
    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=0.5)
    named = dict(model.named_parameters())
    first = [n for n in named if n.endswith(W1_SIDE)]
    head = [n for n in named if n.startswith("head.")]
    opts = {"a": torch.optim.SGD([named[n] for n in first], lr=0.05),
            "b": torch.optim.SGD([p for n, p in named.items() if n not in first and n not in head], lr=0.05),
            "h": torch.optim.SGD([named[n] for n in head], lr=0.05)}
    bindings = bind_optimizers(decay, list(opts.values()))
    want, grads = one_update_by_hand(model)
    arm_all(bindings)
    for name in "ahhb":
        opts[name].step()
    for name, p in named.items():
        steps = 2 if name in head else 1
        assert torch.allclose(p, want[name] - steps * 0.05 * grads[name], rtol=0, atol=1e-12), name
    assert decay.metrics()["cd/updates"] == 1


def test_two_bound_optimizers_keep_their_param_group_indexes_between_steps():
    """Each optimizer's index (id(param) -> group) is built once and kept while its groups stay: with one cache
    entry for all, two optimizers stepped in turn rebuilt it, and rechecked every group's lr, on every step."""
    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=0.5)
    first, rest = w1s_apart(model)
    built = []
    check = decay._check_group_lrs
    decay._check_group_lrs = lambda opt, index: (built.append(id(opt)), check(opt, index))
    opt_a, opt_b, bindings = armed_sgd_pair(decay, first, rest, 0.1, 0.02)
    for _ in range(3):
        arm_all(bindings)
        opt_a.step()
        opt_b.step()
        for binding in bindings.values():
            binding.disarm()
    assert sorted(built) == sorted([id(opt_a), id(opt_b)])
    opt_b.add_param_group({"params": [torch.zeros(1, requires_grad=True)], "lr": 0.5})
    arm_all(bindings)
    opt_b.step()
    assert built[2:] == [id(opt_b)]  # its groups changed: built again, the other's kept


def test_an_optimizer_holding_only_w1s_that_cd_never_writes_keeps_its_pre_step_copies():
    """`a` holds only the LayerNorm scales (the W1s of qkv and fc1, which CD reads and, at the default target, never
    writes) and steps first: `b`'s part must still read them as they were before `a`'s step, as the hand-written
    update (CD of the weights before, then the SGD step), not the stepped ones."""
    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=0.5)
    named = dict(model.named_parameters())
    norms = [n for n in named if n.endswith(("norm1.weight", "norm2.weight"))]
    opt_a = torch.optim.SGD([named[n] for n in norms], lr=0.05)
    opt_b = torch.optim.SGD([p for n, p in named.items() if n not in norms], lr=0.05)
    assert not holds_pairs(decay, opt_a)  # the case: `a` takes part in the update by what it holds for `b` alone
    bindings = bind_optimizers(decay, [opt_a, opt_b])
    want, grads = one_update_by_hand(model)
    arm_all(bindings)
    opt_a.step()
    opt_b.step()
    for name, p in named.items():
        assert torch.allclose(p, want[name] - 0.05 * grads[name], rtol=0, atol=1e-12), name
    assert decay.metrics()["cd/updates"] == 1


def test_a_pair_split_into_an_optimizer_that_held_no_decayed_matrix_reads_the_weights_of_before_its_step():
    """`b` holds only the head when CD is bound; block 1's W1 side (norms, qkv, fc1) joins it later
    (add_param_group), which splits block 1's pairs with `a`, and `b` steps first: `a`'s part reads those W1s as
    they were before `b`'s step, as the hand-written update (CD of the weights before, then the SGD step)."""
    head = lambda n: n.startswith("head.")  # noqa: E731
    step_a_late_split(in_a=lambda n: not head(n), in_b=head,
                      late=lambda n: n.startswith("blocks.1.") and n.endswith(W1_SIDE), order="ba")


class _LegacyScalingSGD(torch.optim.SGD):
    """An optimizer of the legacy custom AMP contract: GradScaler hands it `grad_scaler=` in step() and leaves
    the skip on inf/NaN to it, so CD cannot tell whether the step will change the weights."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        return super().step(closure)


@pytest.mark.parametrize("optimizers", [1, 2], ids=["one_optimizer", "shared_update"])
def test_a_legacy_grad_scaler_keyword_in_the_step_is_refused_through_a_binding(optimizers):
    """GradScaler.step passes itself as `grad_scaler=` to such an optimizer; a binding (alone, or a part of a
    SharedUpdate over several optimizers) hands the step's keywords to CD, which refuses it before the weights
    move, as attach does."""
    model, decay, _, loss = _setup()
    heads = [p for n, p in model.named_parameters() if n.startswith("head.")]
    body = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    opts = [_LegacyScalingSGD(body if optimizers == 2 else model.parameters(), lr=0.1)]
    opts += [_LegacyScalingSGD(heads, lr=0.1)] if optimizers == 2 else []
    bindings = bind_optimizers(decay, opts)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss()).backward()
    before = snapshot(model)
    for binding in bindings.values():
        binding.arm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation of that contract
        with pytest.raises(RuntimeError, match="`grad_scaler` in step"):
            scaler.step(opts[0])
    assert changed(model, before) == [] and decay.num_updates == 0


def test_an_iteration_where_one_optimizer_does_not_step_ends_its_update_at_disarm():
    """Two optimizers over split pairs (W1s in `a`, the rest in `b`), zero gradients: in the first iteration only
    `a` steps (CD writes its qkv and fc1), in the second only `b` (an n-critic loop steps them in turns). `b`'s
    part reads the W1s of before its own iteration's steps, i.e. after `a`'s step of the first, not a copy kept
    for an update that ended at the first iteration's disarm."""
    from cd_models import ref_w2

    model = tiny_vit().double()
    decay = ColinearityDecay(model, lam=0.5)
    first, rest = w1s_apart(model)
    opt_a, opt_b, bindings = armed_sgd_pair(decay, first, rest, 0.1, 0.02)
    opt_a.step()
    for binding in bindings.values():
        binding.disarm()
    between = snapshot(model)
    arm_all(bindings)
    opt_b.step()
    for binding in bindings.values():
        binding.disarm()
    for b in ("blocks.0", "blocks.1"):
        qkv, fc1 = between[f"{b}.attn.qkv.weight"], between[f"{b}.mlp.fc1.weight"]
        v = slice(2 * qkv.shape[0] // 3, qkv.shape[0])
        for w2, w1 in ((f"{b}.attn.proj.weight", qkv[v]), (f"{b}.mlp.fc2.weight", fc1)):
            got = model.get_parameter(w2)
            assert torch.allclose(got, ref_w2(between[w2], w1, 0.02 * 0.5), rtol=0, atol=1e-12), w2


def test_select_module_takes_a_backbone_submodule_only_and_names_a_missing_part():
    """module=None: the `backbone` submodule where the model has one, else the whole model, also where
    `backbone` is some other attribute (a name, a config); "" the whole model; a dotted name that submodule,
    wrappers looked through; a name of no submodule is an error naming the model's own submodules."""
    from cd.integrations import select_module

    net = tiny_vit()
    holder = torch.nn.Module()
    holder.backbone, holder.head = net, torch.nn.Linear(2, 2)
    assert select_module(holder, None) is net and select_module(holder, "") is holder
    assert select_module(torch.nn.parallel.DataParallel(holder), "backbone.blocks.0") is net.blocks[0]
    # None through a wrapper (MMEngine's runner.model in a distributed run, its MMDistributedDataParallel): the
    # wrapped model's backbone, not the whole model (a wrapper has no `backbone`), whose head CD would decay too
    assert select_module(_Wrapper(holder), None) is net and select_module(_Wrapper(holder), "") is holder
    net.backbone = "vit_tiny"  # an attribute, no submodule
    assert select_module(net, None) is net
    with pytest.raises(ValueError, match=r"module='neck' names no submodule of the Module .*\['backbone', 'head'\]"):
        select_module(holder, "neck")


def test_every_decayed_matrix_frozen_and_in_no_optimizer_is_a_warning_and_a_trainable_one_there_an_error():
    """A stage frozen and left out of the optimizers (Lightning's BaseFinetuning) is said, and CD follows it once
    it is added; one trainable decayed matrix in no optimizer while none holds any is refused (CD never acts)."""
    model, _, _, _ = _setup()
    head = list(model.head.parameters())
    model.blocks.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"all 8 matrices CD decays are frozen .* and in no optimizer"):
        bind_optimizers(ColinearityDecay(model, lam=0.5), [torch.optim.SGD(head, lr=0.1)])
    model.blocks[0].requires_grad_(True)  # half of them trainable, all outside the optimizer
    with pytest.raises(ValueError, match="no optimizer holds the 8 matrices CD decays"):
        bind_optimizers(ColinearityDecay(model, lam=0.5), [torch.optim.SGD(head, lr=0.1)])


def test_removing_the_bindings_of_several_optimizers_leaves_none_of_their_step_hooks():
    """Each optimizer's step pre-hooks after every binding is removed are those it had before binding (the shared
    update's copies of W1s would otherwise go on being taken in every step)."""
    model, decay, _, _ = _setup()
    first, rest = w1s_apart(model)
    opts = [torch.optim.SGD(first, lr=0.1), torch.optim.SGD(rest, lr=0.1)]
    before = [(dict(o._optimizer_step_pre_hooks), dict(o._optimizer_step_post_hooks)) for o in opts]
    bindings = bind_optimizers(decay, opts)
    for binding in bindings.values():
        binding.remove()
    assert [(dict(o._optimizer_step_pre_hooks), dict(o._optimizer_step_post_hooks)) for o in opts] == before


def test_a_step_that_raised_after_its_update_leaves_nothing_armed_for_the_next_step():
    """One event, one update: a step that raises in the optimizer's own body after the pre-hook has run CD (a
    transient failure retried by the caller) leaves the binding disarmed, so the retried step takes no second update.
    Reference: one update by hand (SGD on zero gradients moves nothing, so every change is CD's)."""
    class FailsOnce(torch.optim.SGD):
        failed = False

        def step(self, closure=None):
            if not self.failed:  # after the step pre-hooks, before the post-hooks
                self.failed = True
                raise RuntimeError("transient")
            return super().step(closure)

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])  # wraps SGD.step in the hooks (torch does it at a class's
    # first construction), so super().step() runs them again inside the subclass's step, whatever test ran first
    model = tiny_vit().double()
    reference = copy.deepcopy(model)
    opt = FailsOnce(model.parameters(), lr=0.5)
    decay = ColinearityDecay(model, lam=0.1)
    binding = OptimizerBinding(decay, opt)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    binding.arm()
    with pytest.raises(RuntimeError, match="transient"):
        opt.step()
    opt.step()  # the retry: no event since the update
    ColinearityDecay(reference, lam=0.1).apply(lr=0.5)
    assert all(torch.allclose(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert decay.num_updates == 1 and not binding.missed()


def test_a_subclass_step_calling_its_parents_is_one_step_of_a_split_update():
    """W1s in `a`, an optimizer subclass whose `step` calls super().step() (the step hooks then run twice per step),
    W2s in `b`; `a` steps first. Its nested hooks are one step, not a second one starting the next update: `b`'s
    part still reads the W1s of before `a`'s step, and the update is counted once. Reference: one update of the
    whole model by hand at the same lr (SGD on zero gradients moves nothing, so every change is CD's)."""
    class CallsParent(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])  # wraps SGD.step in the hooks (torch does it at a class's
    # first construction), so super().step() runs them again inside the subclass's step, whatever test ran first
    model = tiny_vit().double()
    reference = copy.deepcopy(model)
    decay = ColinearityDecay(model, lam=0.5)
    first, rest = w1s_apart(model)
    opt_a, opt_b = CallsParent(first, lr=0.1), torch.optim.SGD(rest, lr=0.1)
    bindings = bind_optimizers(decay, [opt_a, opt_b])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    arm_all(bindings)
    opt_a.step()
    opt_b.step()
    ColinearityDecay(reference, lam=0.5).apply(lr=0.1)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-12), name
    assert decay.metrics()["cd/updates"] == 1


def test_a_w1_in_two_optimizers_is_read_as_it_was_before_the_first_ones_step():
    """blocks.0.norm1.weight (only ever a W1 under the default targets) is in `a` and in `b` (torch lets two
    optimizers share a parameter), its W2 qkv in `b` alone; `a` steps first and moves the norm. qkv's update
    still reads the norm of before the iteration's steps. Reference: one update of the whole model by hand at the
    same lr, then the norm's two SGD steps on a gradient of ones (every other gradient zero)."""
    model = tiny_vit().double()
    reference = copy.deepcopy(model)
    decay = ColinearityDecay(model, lam=0.5)
    norm = model.blocks[0].norm1.weight
    opt_a, opt_b = torch.optim.SGD([norm], lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    bindings = bind_optimizers(decay, [opt_a, opt_b])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    norm.grad = torch.ones_like(norm)
    arm_all(bindings)
    opt_a.step()
    opt_b.step()
    ColinearityDecay(reference, lam=0.5).apply(lr=0.1)
    with torch.no_grad():
        reference.blocks[0].norm1.weight -= 2 * 0.1  # one SGD step in each optimizer
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-12), name
    assert decay.metrics()["cd/updates"] == 1
