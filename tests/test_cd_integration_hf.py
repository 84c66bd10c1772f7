"""cd.integrations.hf in transformers' real Trainer (CPU, float64): a tiny GPT-2 (Conv1D weights, stored
(in, out)) trained a few steps, its weights after every update compared with the float64 reference of
(task step + CD) in a plain loop (tests/cd_integration_refs.py), which the wrong placements of CD miss by far:
gradient accumulation, per-group lrs with a schedule, clipping, a step that a GradScaler skips, and resume."""
from __future__ import annotations

import copy
import inspect
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from cd.integrations.hf import COUNTER_KEY, ColinearityDecayCallback  # noqa: E402
from cd_integration_refs import assert_matches_reference, gpt2_hf_pairs, reference_run  # noqa: E402
from cd_models import randomize_norms  # noqa: E402

LAYERS, DIM, VOCAB, SEQ = 2, 32, 64, 8
LAM, TOL = 0.5, 1e-10


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=DIM, n_layer=LAYERS, n_head=2, vocab_size=VOCAB, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return randomize_norms(transformers.GPT2LMHeadModel(cfg)).double()


def data(n: int = 32) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


def optimizer_and_schedule(model: torch.nn.Module, steps: int, fused: bool = False, schedule=None):
    """AdamW with the qkv/fc1 matrices in a group of their own lr, and a linear decay: a CD that read another
    group's lr, or the lr after the scheduler's step, would be off. `schedule`: another lr factor of the step."""
    own = [p for n, p in model.named_parameters() if n.endswith(("c_attn.weight", "c_fc.weight"))]
    rest = [p for p in model.parameters() if all(p is not q for q in own)]
    opt = torch.optim.AdamW([{"params": rest, "lr": 2e-2}, {"params": own, "lr": 5e-3}], weight_decay=0.1,
                            fused=fused)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule or (lambda s: 1.0 - s / (2 * steps)))


class Recorder(TrainerCallback):
    """The micro-batches the model saw (a forward pre-hook) and the weights after each update."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.batches, self.after = [], []
        model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs):
        if "labels" in kwargs:  # a training forward (CD's pair check runs one on token ids alone)
            self.batches.append({"input_ids": kwargs["input_ids"].clone(), "labels": kwargs["labels"].clone()})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after.append({n: p.detach().clone() for n, p in model.named_parameters()})


class PoisonStep(TrainerCallback):
    """Makes the gradients of update `step` infinite (the loss times inf), as an fp16 overflow would."""

    def __init__(self, model: torch.nn.Module, step: int) -> None:
        self.step, self.on = step, False
        model.register_forward_hook(lambda m, a, out: out.__setitem__("loss", out["loss"] * float("inf"))
                                    if self.on else None)

    def on_step_begin(self, args, state, control, **kwargs):
        self.on = state.global_step == self.step


def train(tmp_path, steps: int, accum: int = 1, clip: float = 0.0, scaler: bool = False, poison: int = -1,
          resume: str | None = None, save_steps: int = 0, model=None, cd_kwargs=None, callback=None,
          fused: bool = False, schedule=None, more=()):
    model = model or tiny_gpt2()
    initial = copy.deepcopy(model)
    opt, sched = optimizer_and_schedule(model, steps, fused, schedule)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=accum,
                             max_steps=steps, max_grad_norm=clip, learning_rate=2e-2, logging_steps=1000,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                             report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
                             restore_callback_states_from_checkpoint=True)
    recorder = Recorder(model)
    callbacks = [callback or ColinearityDecayCallback(lam=LAM, **(cd_kwargs or {})), *more, recorder]
    if poison >= 0:
        callbacks.append(PoisonStep(model, poison))
    trainer = Trainer(model=model, args=args, train_dataset=data(), optimizers=(opt, sched), callbacks=callbacks)
    # the plain per-micro-batch mean loss / accumulation (not transformers' token count over the update), so
    # that the reference's loss is the model's own
    trainer.model_accepts_loss_kwargs = False
    if scaler:  # the CPU stand-in for fp16 AMP: accelerate steps through a real GradScaler, without autocast
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, initial, recorder


def check(initial, recorder, steps, accum, clip=None, skipped=(), variants=None, fused=False,
          scheduler_steps_on_skip=False):
    micro = [[recorder.batches[i * accum + k] for k in range(accum)] for i in range(steps)]

    def run(variant):
        model = copy.deepcopy(initial)
        opt, sched = optimizer_and_schedule(model, steps, fused)
        return reference_run(model, micro, lambda m, b: m(**b).loss, opt, sched, gpt2_hf_pairs(LAYERS, DIM), LAM,
                             clip=clip, skipped=skipped, scheduler_steps_on_skip=scheduler_steps_on_skip,
                             variant=variant)

    kw = {} if variants is None else {"variants": variants}
    assert_matches_reference(recorder.after, run, TOL, **kw)


def test_trainer_with_accumulation_clipping_and_group_lrs_matches_the_reference(tmp_path):
    trainer, initial, recorder = train(tmp_path, steps=3, accum=2, clip=0.5)
    assert len(recorder.batches) == 6
    check(initial, recorder, 3, 2, clip=0.5,
          variants=("before_backward", "per_micro_batch", "after_step", "first_group_lr"))
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ColinearityDecayCallback))
    assert cb.decay.num_updates == 3 and len(cb.decay.pairs) == 4 * LAYERS


def test_a_step_the_grad_scaler_skips_applies_no_cd(tmp_path):
    trainer, initial, recorder = train(tmp_path, steps=3, scaler=True, poison=1)
    assert trainer.accelerator.optimizer_step_was_skipped is False  # the last step ran
    assert all(torch.equal(recorder.after[0][n], recorder.after[1][n]) for n in recorder.after[0])
    check(initial, recorder, 3, 1, skipped=(1,), variants=("on_skipped_step", "after_step"))
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ColinearityDecayCallback))
    assert cb.decay.num_updates == 2


def test_a_step_the_grad_scaler_skips_in_a_fused_optimizer_applies_no_cd(tmp_path):
    """A fused AdamW is stepped on overflow too (GradScaler hands it `found_inf`, its kernel skips): CD is gated
    on the device the same way, so the skipped step leaves the weights as they were and is not counted in
    cd/updates. accelerate (1.15) decides "skipped" by whether GradScaler called the optimizer's step, which it
    always does for a fused optimizer: the Trainer then steps the lr schedule on the skipped step (a framework
    behaviour, cd/README.md), so the reference's schedule steps there too."""
    trainer, initial, recorder = train(tmp_path, steps=3, scaler=True, poison=1, fused=True)
    assert all(torch.equal(recorder.after[0][n], recorder.after[1][n]) for n in recorder.after[0])
    assert trainer.lr_scheduler.last_epoch == 3  # 3 steps of the schedule for 2 updates
    check(initial, recorder, 3, 1, skipped=(1,), variants=("on_skipped_step", "after_step"), fused=True,
          scheduler_steps_on_skip=True)
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ColinearityDecayCallback))
    assert cb.decay.metrics()["cd/updates"] == 2 and cb.decay.state_dict()["num_updates"] == 2


def test_resume_from_a_trainer_checkpoint_continues_exactly(tmp_path):
    full_trainer, initial, full = train(tmp_path / "full", steps=4)
    train(tmp_path / "cut", steps=4, save_steps=2, model=copy.deepcopy(initial))
    checkpoint = tmp_path / "cut" / "checkpoint-2"
    model = copy.deepcopy(initial)  # the weights come from the checkpoint
    given = ColinearityDecayCallback(lam=LAM)
    trainer, _, resumed = train(tmp_path / "cut", steps=4, resume=str(checkpoint), model=model, callback=given)
    assert len(resumed.after) == 2
    for got, want in zip(resumed.after, full.after[2:]):
        assert all(torch.allclose(got[n], want[n], rtol=0, atol=TOL) for n in want)
    # restore_callback_states_from_checkpoint=True (set in train) rebuilds the Trainer's stateful callbacks from
    # the checkpoint's arguments: this one is not among them, so the object given is the one that ran
    assert given in trainer.callback_handler.callbacks and given.decay is not None
    assert given.decay.num_updates == 4  # the counter starts at the restored global_step


def warmup(step: int) -> float:
    """A linear warmup over 2 steps, as TrainingArguments(warmup_steps=2) makes it: step 0 has lr 0."""
    return min(1.0, step / 2)


def test_a_resumed_run_after_a_warmup_from_lr_0_counts_and_computes_norms_as_an_uninterrupted_one(tmp_path):
    """Step 0 of the warmup has lr 0, which is no CD update: 4 steps make 3 (the steps of lr > 0), and a run resumed
    from the checkpoint of step 2 (1 update so far, not its global_step 2) counts 3 too. The update norms, computed
    on every 2nd update (lr-0 ones counted: the Trainer's global steps), then come from the same update (the one of
    step 4) as in the uninterrupted run."""
    steps, every = 4, 2
    nonzero = sum(warmup(s) > 0 for s in range(steps))  # the updates CD makes: 3
    full_trainer, initial, _ = train(tmp_path / "full", steps=steps, schedule=warmup, cd_kwargs={"norms_every": every})
    full = next(c for c in full_trainer.callback_handler.callbacks if isinstance(c, ColinearityDecayCallback))
    train(tmp_path / "cut", steps=steps, save_steps=2, model=copy.deepcopy(initial), schedule=warmup)
    given = ColinearityDecayCallback(lam=LAM, norms_every=every)
    train(tmp_path / "cut", steps=steps, resume=str(tmp_path / "cut" / "checkpoint-2"), model=copy.deepcopy(initial),
          callback=given, schedule=warmup)
    want, got = full.decay.metrics(), given.decay.metrics()
    assert want["cd/updates"] == got["cd/updates"] == nonzero
    norms = sorted(k for k in want if k.startswith("cd/update_norm/"))
    assert norms and norms == sorted(k for k in got if k.startswith("cd/update_norm/"))
    assert all(abs(got[k] - want[k]) <= 1e-9 * want[k] for k in norms), [(k, got[k], want[k]) for k in norms]


NO_COUNTER = (r"ColinearityDecayCallback: resuming at step 2 with no CD state under "
              r"'cd\.integrations\.hf\.ColinearityDecayCallback' in the checkpoint; it holds no CD state \(saved by a "
              r"run without CD, or by a version of this callback that saved none\)\. The update counter "
              r"\(cd/updates\) starts at the restored global_step, 2, ")


def test_a_checkpoint_without_the_saved_counter_resumes_it_at_the_global_step_with_a_warning(tmp_path):
    """A checkpoint saved before the counter was saved with it (no entry in trainer_state.json's
    stateful_callbacks): the counter starts at the restored global_step, as it did then. A run without CD leaves
    no entry either, and its resume set the counter to the steps it ran without CD without a word, where
    Lightning's callback and MMEngine's hook warn: it warns too (both cases read the same), naming both."""
    train(tmp_path / "old", steps=4, save_steps=2, schedule=warmup)
    path = tmp_path / "old" / "checkpoint-2" / "trainer_state.json"
    saved = json.loads(path.read_text())
    saved["stateful_callbacks"] = {k: v for k, v in saved["stateful_callbacks"].items() if "ColinearityDecay" not in k}
    path.write_text(json.dumps(saved))
    given = ColinearityDecayCallback(lam=LAM)
    with pytest.warns(UserWarning, match=NO_COUNTER):
        train(tmp_path / "old", steps=4, resume=str(tmp_path / "old" / "checkpoint-2"), callback=given,
              schedule=warmup)
    assert given.decay.num_updates == 2 + 2
    train(tmp_path / "plain", steps=4, save_steps=2, callback=TrainerCallback())  # no CD
    given = ColinearityDecayCallback(lam=LAM)
    with pytest.warns(UserWarning, match=NO_COUNTER):
        train(tmp_path / "plain", steps=4, resume=str(tmp_path / "plain" / "checkpoint-2"), callback=given)
    assert given.decay.num_updates == 2 + 2  # as the warning says


def test_a_resume_after_steps_run_without_the_callback_continues_the_saved_count_with_a_warning(tmp_path):
    """Steps 1-2 with CD, 3-4 resumed without the callback (the Trainer carries CD's entry of step 2 forward into
    checkpoint-4), 5-6 resumed with it: CD made 2 + 2 updates, but the counter became the restored global_step (4,
    then 6) without a word. It continues from the saved 2 and warns, naming steps 3 to 4."""
    train(tmp_path / "cd", steps=2, save_steps=2)
    train(tmp_path / "plain", steps=4, save_steps=2, resume=str(tmp_path / "cd" / "checkpoint-2"),
          callback=TrainerCallback())
    carried = json.loads((tmp_path / "plain" / "checkpoint-4" / "trainer_state.json").read_text())
    assert carried["stateful_callbacks"][COUNTER_KEY]["global_step"] == 2 and carried["global_step"] == 4
    given = ColinearityDecayCallback(lam=LAM)
    with pytest.warns(UserWarning, match=r"ColinearityDecayCallback: resuming at step 4 with the CD state under "
                                         r"'cd\.integrations\.hf\.ColinearityDecayCallback' saved at step 2: steps 3 "
                                         r"to 4 ran without this callback and made no CD update\. The update counter "
                                         r"\(cd/updates\) continues from the saved 2$"):
        train(tmp_path / "plain", steps=6, resume=str(tmp_path / "plain" / "checkpoint-4"), callback=given)
    assert given.decay.num_updates == 2 + 2


def cd_config(lam: float, lam_per_role: dict | None = None) -> dict:
    """ColinearityDecay's config as its state_dict (and so a Lightning or MMEngine checkpoint) records it, for the
    decoupled update with the default targets, loss_coef and matmul_precision (the names of the decayed matrices,
    also recorded, are left out: the warning summarises them, and they compare equal here)."""
    return {"lam": lam, "lam_per_role": lam_per_role or {}, "targets": "A+B", "mode": "decoupled", "loss_coef": 0.01,
            "matmul_precision": "auto"}


def test_a_resumed_trainer_runs_the_callback_as_given_not_as_saved_and_warns_as_lightning_and_mmengine_do(tmp_path):
    """Other CD settings in the resumed run: the ones given run (the Trainer rebuilds no callback from the
    checkpoint), with the warning that Lightning's callback and MMEngine's hook give, naming both configs."""
    train(tmp_path, steps=4, save_steps=2)
    saved = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert "ColinearityDecayCallback" not in saved
    given = ColinearityDecayCallback(lam=LAM, lam_per_role={"fc2": 2 * LAM})
    with pytest.warns(UserWarning) as caught:
        trainer, _, _ = train(tmp_path, steps=4, resume=str(tmp_path / "checkpoint-2"), callback=given)
    want = (f"ColinearityDecay: resuming with a different CD config: saved {cd_config(LAM)}, "
            f"now {cd_config(LAM, {'fc2': 2 * LAM})}")
    assert [str(w.message) for w in caught if "CD config" in str(w.message)] == [want]
    assert given in trainer.callback_handler.callbacks
    assert given.decay.lam_per_role == {"fc2": 2 * LAM} and given.decay.num_updates == 4


@pytest.mark.parametrize("entry", ["as_saved", "without_config"])
def test_a_resume_with_the_same_config_or_an_entry_without_one_warns_nothing_and_keeps_the_counter(tmp_path, entry):
    """The same settings resume without the warning; a checkpoint whose counter entry has no config (saved by an
    earlier version of the callback) resumes too, its counter restored, with nothing to compare (another lam
    then runs as given)."""
    import warnings

    from cd.integrations.hf import COUNTER_KEY
    train(tmp_path, steps=4, save_steps=2, schedule=warmup)  # 1 update in the first 2 steps (step 0 has lr 0)
    path = tmp_path / "checkpoint-2" / "trainer_state.json"
    state = json.loads(path.read_text())
    recorded = state["stateful_callbacks"][COUNTER_KEY]["config"]
    assert {k: v for k, v in recorded.items() if k != "decayed"} == cd_config(LAM) and recorded["decayed"]
    lam = LAM
    if entry == "without_config":
        del state["stateful_callbacks"][COUNTER_KEY]["config"]
        path.write_text(json.dumps(state))
        lam = 2 * LAM
    given = ColinearityDecayCallback(lam=lam)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tmp_path, steps=4, resume=str(tmp_path / "checkpoint-2"), callback=given, schedule=warmup)
    assert not [w for w in caught if "CD config" in str(w.message) or "no CD state" in str(w.message)]
    assert given.decay.lam == lam and given.decay.num_updates == 1 + 2  # the saved count, not global_step 2


def test_a_resumed_callback_counts_the_restored_steps_as_updates_only_where_cd_updates():
    """The counter of a resumed run starts at the Trainer's global_step; with lam=0 no step makes a CD update (a
    fresh run's counter stays 0), so a resumed one's stays 0 too."""
    from transformers import TrainerState
    for lam, counted in ((LAM, 2), (0.0, 0)):
        model = tiny_gpt2()
        cb = ColinearityDecayCallback(lam=lam)
        with pytest.warns(UserWarning, match=f"no CD state under .*counter \\(cd/updates\\) starts (at the restored "
                                             f"global_step, {counted}|from 0 \\(lam=0)"):  # a checkpoint without it
            cb.on_train_begin(None, TrainerState(global_step=2), None, model=model,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        assert cb.decay.num_updates == counted and cb.decay.metrics()["cd/updates"] == counted, lam


def test_an_optimizer_without_any_decayed_matrix_is_an_error_not_a_silent_no_op():
    from transformers import TrainerState
    model = tiny_gpt2()
    head_only = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("transformer.h.")], lr=0.1)
    with pytest.raises(ValueError, match="no optimizer holds the .* matrices CD decays"):
        ColinearityDecayCallback(lam=LAM).on_train_begin(None, TrainerState(), None, model=model, optimizer=head_only)


def test_deepspeed_is_refused_before_cd_is_built_not_missed_after_its_engine_stepped():
    """Under DeepSpeed the Trainer's optimizer is accelerate's DeepSpeedOptimizerWrapper, whose step() does nothing:
    the engine stepped inside the backward, before on_pre_optimizer_step armed CD. The callback bound it without a
    word, the update ran without CD, and on_optimizer_step then blamed a Lookahead step saved before the binding.
    ZeRO-3's partitioned parameters (ds_id) are refused too. One RuntimeError at on_train_begin, naming the fix."""
    from accelerate import Accelerator
    from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper
    from transformers import TrainerState
    model = tiny_gpt2()
    Accelerator(cpu=True)  # the state accelerate's optimizer wrapper reads, as the Trainer makes it
    wrapped = DeepSpeedOptimizerWrapper(torch.optim.SGD(model.parameters(), lr=0.1))  # ZeRO stage 0, fp32
    callback = ColinearityDecayCallback(lam=LAM)
    with pytest.raises(RuntimeError, match=r"CD does not support DeepSpeed \(found DeepSpeedOptimizerWrapper\).*"
                                           r"train without DeepSpeed"):
        callback.on_train_begin(None, TrainerState(), None, model=model, optimizer=wrapped)
    assert callback.decay is None and callback._binding is None
    model.transformer.h[0].attn.c_attn.weight.ds_id = 0
    with pytest.raises(RuntimeError, match=r"found ZeRO-3 partitioned parameters"):
        callback.on_train_begin(None, TrainerState(), None, model=model,
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_deepspeeds_dummy_optim_and_the_layerwise_optimizer_are_refused_by_name_with_their_fix(tmp_path):
    """accelerate's DummyOptim (a DeepSpeed config's own optimizer) given in Trainer(optimizers=...) was refused at
    on_init_end as "CD needs a torch.optim.Optimizer, got DummyOptim", without a word of DeepSpeed; transformers'
    LayerWiseDummyOptimizer (optim="galore_adamw_layerwise"), whose step() does nothing while an optimizer per
    parameter steps it in a gradient hook inside the backward, passed on_init_end and was refused at on_train_begin
    as "no optimizer holds the matrices CD decays". Each is one RuntimeError naming what it is and the fix."""
    from accelerate.utils.deepspeed import DummyOptim
    from transformers import TrainerState
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer
    model = tiny_gpt2()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(RuntimeError, match=r"^ColinearityDecayCallback: CD does not support DeepSpeed \(found "
                                           r"DummyOptim\).*not accelerate's DummyOptim"):
        Trainer(model=model, args=args, train_dataset=data(4), optimizers=(DummyOptim(model.parameters()), None),
                callbacks=[ColinearityDecayCallback(lam=LAM)])
    layerwise = LayerWiseDummyOptimizer(optimizer_dict={p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()},
                                        lr=0.1)
    refusal = (r"^ColinearityDecayCallback: CD cannot run in transformers' layer-wise optimizer "
               r"\(LayerWiseDummyOptimizer, .*use the optim without '_layerwise'")
    with pytest.raises(RuntimeError, match=refusal):
        Trainer(model=model, args=args, train_dataset=data(4), optimizers=(layerwise, None),
                callbacks=[ColinearityDecayCallback(lam=LAM)])
    callback = ColinearityDecayCallback(lam=LAM)  # the Trainer builds it in train(): on_train_begin sees it first
    with pytest.raises(RuntimeError, match=refusal):
        callback.on_train_begin(None, TrainerState(), None, model=model, optimizer=layerwise)
    assert callback.decay is None and callback._binding is None


def test_a_lomo_optimizer_that_steps_inside_the_backward_is_refused_before_the_first_step_naming_it():
    """TrainingArguments(optim="lomo" / "adalomo") steps every weight in a gradient hook inside the backward
    (lomo_optim's fused_backward), so the update ran before on_pre_optimizer_step armed CD, without it;
    on_optimizer_step then blamed a step method saved before the binding and asked for Trainer(callbacks=[...]),
    which was given (seen with lomo-optim 0.1.1). A stand-in of the package's class (not installed here): refused
    at on_train_begin, naming it and the fix; ColinearityDecay.attach, for an accelerate loop of one's own, refuses
    it the same way."""
    from transformers import TrainerState

    from cd import ColinearityDecay
    lomo = type("Lomo", (torch.optim.SGD,), {"__module__": "lomo_optim.lomo"})
    model = tiny_gpt2()
    callback = ColinearityDecayCallback(lam=LAM)
    with pytest.raises(RuntimeError, match=r"^cd.integrations: Lomo \(lomo_optim\) steps the weights inside the "
                                           r"backward.*another optimizer"):
        callback.on_train_begin(None, TrainerState(), None, model=model, optimizer=lomo(model.parameters(), lr=0.1))
    assert callback._binding is None
    with pytest.raises(RuntimeError, match=r"^ColinearityDecay.attach: Lomo \(lomo_optim\) steps the weights"):
        ColinearityDecay(model, lam=LAM).attach(lomo(model.parameters(), lr=0.1))


def test_a_trainer_event_without_model_or_optimizer_is_refused_and_the_decay_has_the_given_settings():
    """on_train_begin without the model or the optimizer is one RuntimeError naming what is missing (not a failure
    inside ColinearityDecay); with them, the decay gets the callback's arguments: norms_every 50 unless given."""
    from transformers import TrainerState
    model = tiny_gpt2()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="passed no model or optimizer"):
        ColinearityDecayCallback(lam=LAM).on_train_begin(None, TrainerState(), None, model=model)
    for given, want in (({}, 50), ({"norms_every": 3}, 3)):
        callback = ColinearityDecayCallback(lam=LAM, **given)
        callback.on_train_begin(None, TrainerState(), None, model=model, optimizer=sgd)
        assert (callback.decay.lam, callback.decay.norms_every) == (LAM, want)
        callback.on_train_end(None, None, None)


def test_arguments_are_checked_when_the_callback_is_made():
    with pytest.raises(TypeError, match="lamda"):
        ColinearityDecayCallback(lamda=0.1)
    with pytest.raises(TypeError, match="decoupled update"):
        ColinearityDecayCallback(mode="loss")


@pytest.mark.parametrize("added_later", [False, True], ids=["in_callbacks", "add_callback"])
def test_lookahead_with_fp16_gets_cd_at_every_step_or_an_error(tmp_path, added_later):
    """accelerate keeps the bound `step` of an fp16 optimizer from `prepare` on; timm's Lookahead skips
    Optimizer.__init__, so before torch wraps its class's step that saved method calls no step hook."""
    from timm.optim import Lookahead

    class FreshLookahead(Lookahead):  # a class of its own: torch's wrapping of a step is per class, for good
        def step(self, closure=None):
            # Lookahead's own step unwrapped: once any Lookahead in this process has zeroed its gradients (another
            # test), torch has wrapped Lookahead.step itself, and super().step() would call the hooks anyway
            return inspect.unwrap(Lookahead.step)(self, closure)

    model = tiny_gpt2()
    opt = FreshLookahead(torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert not getattr(type(opt).step, "hooked", False)  # the case: hooks not yet called by its step
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, report_to=[],
                             use_cpu=True, disable_tqdm=True, save_strategy="no", max_grad_norm=0.0)
    callback = ColinearityDecayCallback(lam=LAM)
    trainer = Trainer(model=model, args=args, train_dataset=data(), optimizers=(opt, None),
                      callbacks=[] if added_later else [callback])
    if added_later:  # misses on_init_end: the step method accelerate saves is the unhooked one
        trainer.add_callback(callback)
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    if added_later:
        with pytest.raises(RuntimeError, match="CD's step hook did not run"):
            trainer.train()
    else:
        trainer.train()
        assert callback.decay.num_updates == 3


class StopAt(TrainerCallback):
    """Raises in `event` at update `step` (a crash, an OOM, a KeyboardInterrupt in a notebook)."""

    def __init__(self, event: str, step: int) -> None:
        setattr(self, event, self.stop)
        self.step = step

    def stop(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError("stop")


@pytest.mark.parametrize("event", ["on_pre_optimizer_step", "on_step_end"])
def test_a_train_that_raised_leaves_no_cd_on_its_optimizer_for_the_next_train(tmp_path, event):
    """The Trainer calls no callback when train() raises: the failed run's binding stayed on the optimizer, so a
    new callback on it was refused as a second CD update, and a run stopped between on_pre_optimizer_step and
    the step applied the failed run's CD at the next step of that optimizer."""
    model = tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, report_to=[],
                             use_cpu=True, disable_tqdm=True, save_strategy="no", max_grad_norm=0.0)
    failed = ColinearityDecayCallback(lam=LAM)
    with pytest.raises(RuntimeError, match="stop"):
        Trainer(model=model, args=args, train_dataset=data(), optimizers=(opt, None),
                callbacks=[failed, StopAt(event, 1)]).train()
    done = failed.decay.num_updates
    again = ColinearityDecayCallback(lam=LAM)
    Trainer(model=model, args=args, train_dataset=data(), optimizers=(opt, None), callbacks=[again]).train()
    assert failed.decay.num_updates == done and again.decay.num_updates == 3  # once per step, the new one's
    with pytest.raises(RuntimeError, match="another CD update"):  # two in one Trainer: still refused
        Trainer(model=model, args=args, train_dataset=data(), optimizers=(opt, None),
                callbacks=[ColinearityDecayCallback(lam=LAM), ColinearityDecayCallback(lam=LAM)]).train()


def test_a_finished_train_leaves_no_cd_on_its_optimizer(tmp_path):
    """After train() the optimizer is the user's again: an attach of their own is not refused as a second CD
    update, and a step of theirs gets no CD from the callback."""
    from cd import ColinearityDecay
    from cd.wrappers import torch_optimizer

    trainer, _, _ = train(tmp_path, steps=1)
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ColinearityDecayCallback))
    opt, model = torch_optimizer(trainer.optimizer), trainer.model
    batch = data(2)[0]
    model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    opt.step()
    assert cb.decay.num_updates == 1
    ColinearityDecay(model, lam=LAM).attach(opt).remove()


def test_a_callback_reused_after_a_failed_train_leaves_the_failed_runs_optimizer_alone(tmp_path):
    """The failed train() stopped between on_pre_optimizer_step and the step (CD armed on its optimizer); the same
    callback object in a new Trainer with another optimizer takes its CD off the first one: a later step of that
    optimizer is a plain SGD step (w - lr * grad, by hand), with no pending CD update."""
    model = tiny_gpt2()
    first, second = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[],
                             use_cpu=True, disable_tqdm=True, save_strategy="no", max_grad_norm=0.0)
    callback = ColinearityDecayCallback(lam=LAM)
    with pytest.raises(RuntimeError, match="stop"):
        Trainer(model=model, args=args, train_dataset=data(), optimizers=(first, None),
                callbacks=[callback, StopAt("on_pre_optimizer_step", 0)]).train()
    Trainer(model=model, args=args, train_dataset=data(), optimizers=(second, None), callbacks=[callback]).train()
    batch = data(2)[0]
    first.zero_grad()
    model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    want = {n: (p - 0.1 * p.grad).detach() for n, p in model.named_parameters() if p.grad is not None}
    first.step()
    diff = max(float((p - want[n]).abs().max()) for n, p in model.named_parameters() if n in want)
    assert diff < 1e-12, diff


def test_the_pair_check_takes_a_trainer_batch_with_its_attention_mask():
    """A batch as the Trainer's collator gives it (ids, a padding mask, labels): transformers reads the mask's values,
    which the meta forward has none of; the pairs found are GPT-2's, as with the model's own example."""
    from transformers import TrainerState
    model = tiny_gpt2()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    callback = ColinearityDecayCallback(lam=LAM, example_input=batch)
    callback.on_train_begin(None, TrainerState(), None, model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1))
    want = gpt2_hf_pairs(LAYERS, DIM)
    assert [p.name for p in callback.decay.pairs] == [r.w2 for r in want]
    assert [p.upstream_rows for p in callback.decay.pairs] == [r.rows for r in want]


def test_one_sequence_of_token_ids_without_its_batch_dim_is_refused_naming_the_form_to_pass():
    from cd import UnsupportedModelError, find_pairs
    ids = torch.randint(0, VOCAB, (SEQ,))
    for example in (ids, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}):
        with pytest.raises(UnsupportedModelError, match=r"token ids of shape \(batch, sequence\), not a 1-D sequence: "
                           r"ids\[None\]"):
            find_pairs(tiny_gpt2(), example_input=example)
    assert len(find_pairs(tiny_gpt2(), example_input=ids[None])) == 4 * LAYERS


def test_a_data_folder_named_datasets_on_the_path_is_refused_with_the_folder_and_the_fix(tmp_path, monkeypatch):
    """A folder `datasets/` on sys.path (a project's data folder under the folder Python starts in: the reason this
    repository's data sets go to data_sets/) is imported as Hugging Face's `datasets` when that is not installed;
    the Trainer then failed inside train() with "module 'datasets' has no attribute 'Dataset'". The callback
    refuses it when made, naming the folder."""
    import importlib.util
    import sys

    real = importlib.util.find_spec("datasets")
    if real is not None and real.origin not in (None, "namespace"):
        pytest.skip("Hugging Face's datasets is installed: a folder cannot shadow it")
    (tmp_path / "datasets" / "fashion_mnist").mkdir(parents=True)
    monkeypatch.delitem(sys.modules, "datasets", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))  # also clears the import caches
    with pytest.raises(RuntimeError) as refused:
        ColinearityDecayCallback(lam=0.005)
    message = str(refused.value)
    assert f"the folder {tmp_path / 'datasets'} is importable as the package `datasets` ({tmp_path} is on " \
           f"sys.path, " in message
    assert message.endswith(f"rename or move {tmp_path / 'datasets'}, or pip install datasets"), message


PART = "transformer.h.0"  # a block: the model's other block, embeddings and head are outside it
PART_INPUT = torch.zeros(1, SEQ, DIM, dtype=torch.float64)  # the block's input (hidden states), for the pair check


def test_module_decays_that_part_alone_as_the_reference_on_its_pairs_does(tmp_path):
    """module= names the part of the Trainer's model that CD decays (a fine-tune that leaves a head or a decoder
    alone), as Lightning's callback and MMEngine's hook take it: the weights after every update are the reference's
    with the part's pairs alone (CD on the whole model is far from them), and after the first update the weights
    outside the part are bit for bit those of the task step alone."""
    trainer, initial, recorder = train(tmp_path, steps=3, accum=2, clip=0.5,
                                       cd_kwargs={"module": PART, "example_input": PART_INPUT})
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ColinearityDecayCallback))
    inside = {id(p) for p in initial.get_submodule(PART).parameters()}
    outside = [n for n, p in initial.named_parameters() if id(p) not in inside]
    part_pairs = [r for r in gpt2_hf_pairs(LAYERS, DIM) if r.w2.startswith(PART + ".")]
    assert [p.name for p in cb.decay.pairs] == [r.w2[len(PART) + 1:] for r in part_pairs]
    micro = [[recorder.batches[i * 2 + k] for k in range(2)] for i in range(3)]

    def run(pairs):
        model = copy.deepcopy(initial)
        opt, sched = optimizer_and_schedule(model, 3)
        return reference_run(model, micro, lambda m, b: m(**b).loss, opt, sched, pairs, LAM, clip=0.5)

    want, whole = run(part_pairs), run(gpt2_hf_pairs(LAYERS, DIM))
    for got, ref in zip(recorder.after, want):
        assert max(float((got[n] - ref[n]).abs().max()) for n in ref) < TOL
    assert all(torch.equal(recorder.after[0][n], want[0][n]) for n in outside)
    assert max(float((got[n] - ref[n]).abs().max()) for got, ref in zip(recorder.after, whole) for n in ref) > 1e3 * TOL


def test_module_is_checked_and_every_refusal_names_the_part(tmp_path):
    """The arguments as Lightning's callback checks them (None is not the whole model here, "" is), an unknown part
    named with the model's children, the refusals of the part by the pair check, by the optimizer and as a second CD
    update in one step naming it (they name its matrices relative to it), and a whole model with a copy its forward
    never runs refused naming module= and its children."""
    from transformers import TrainerState

    from cd import UnsupportedModelError
    with pytest.raises(TypeError, match=r"module must be \"\" \(the whole module\) or a dotted submodule name"):
        ColinearityDecayCallback(module=None, lam=LAM)
    with pytest.raises(TypeError, match="name the part of it to decay with module="):
        ColinearityDecayCallback(model=tiny_gpt2(), lam=LAM)
    model = tiny_gpt2()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"module='transformer\.h\.9' names no submodule of the GPT2LMHeadModel .*"
                                         r"\['transformer', 'lm_head'\]"):
        ColinearityDecayCallback(module="transformer.h.9", lam=LAM).on_train_begin(
            None, TrainerState(), None, model=model, optimizer=sgd)
    with pytest.raises(UnsupportedModelError, match=r"^ColinearityDecayCallback\(module='transformer\.h\.0'\): cannot "
                                                    r"tell the input size of GPT2Block.*give the part's own input as "
                                                    r"ColinearityDecayCallback\(module='transformer\.h\.0', "
                                                    r"example_input=\.\.\.\)"):
        ColinearityDecayCallback(module=PART, lam=LAM).on_train_begin(
            None, TrainerState(), None, model=model, optimizer=sgd)
    head = torch.optim.SGD(model.lm_head.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"^ColinearityDecayCallback\(module='transformer'\): no optimizer holds"):
        ColinearityDecayCallback(module="transformer", lam=LAM).on_train_begin(
            None, TrainerState(), None, model=model, optimizer=head)
    whole = ColinearityDecayCallback(lam=LAM)  # the whole model's update, in the same optimizer's step
    whole.on_train_begin(None, state := TrainerState(), None, model=model, optimizer=sgd)
    with pytest.raises(RuntimeError, match=r"^ColinearityDecayCallback\(module='transformer\.h\.0'\): "
                                           r"cd\.integrations: another CD update runs in this optimizer's step "
                                           r"already .* decays attn\.c_attn\.weight too"):
        ColinearityDecayCallback(module=PART, lam=LAM, example_input=PART_INPUT).on_train_begin(
            None, state, None, model=model, optimizer=sgd)
    whole.on_train_end(None, state, None)
    model.teacher = copy.deepcopy(model.transformer)  # a copy the forward never runs (distillation's teacher)
    with pytest.raises(UnsupportedModelError, match=r"teacher\.h\.0\.attn\.c_attn\.weight is not used in the forward "
                                                    r"pass.*name the part to decay with ColinearityDecayCallback\("
                                                    r"module=\.\.\.\) \(its children: \['transformer', 'lm_head', "
                                                    r"'teacher'\]\)"):
        ColinearityDecayCallback(lam=LAM).on_train_begin(None, TrainerState(), None, model=model, optimizer=sgd)


def test_callbacks_on_two_parts_each_decay_their_own_and_together_give_the_whole_models_update(tmp_path):
    """Two callbacks in one Trainer on the model's two blocks (module=), one optimizer: each binds it and decays its
    block's pairs in the step, so the weights are the reference's with every pair, each counts every update, and
    each saves its counter under its own key."""
    first, second = (ColinearityDecayCallback(module=f"transformer.h.{i}", lam=LAM, example_input=PART_INPUT)
                     for i in range(LAYERS))
    trainer, initial, recorder = train(tmp_path, steps=2, accum=2, clip=0.5, save_steps=2, callback=first,
                                       more=[second])
    check(initial, recorder, 2, 2, clip=0.5, variants=("before_backward", "after_step"))
    assert first.decay.num_updates == second.decay.num_updates == 2
    saved = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert {k for k in saved if k.startswith(COUNTER_KEY)} == {f"{COUNTER_KEY}:transformer.h.{i}" for i in range(2)}


def test_a_part_keeps_its_counter_under_a_key_of_its_own_and_a_resume_with_another_module_warns(tmp_path):
    """The counter of a callback given module= is saved under COUNTER_KEY:<module> and restored by a resume with
    the same module=; a resume with another module= (here none) finds no state under its key and warns, naming the
    key it holds and its module=, and counts from 0, as Lightning's callback and MMEngine's hook do."""
    part = {"module": PART, "example_input": PART_INPUT}
    train(tmp_path, steps=4, save_steps=2, schedule=warmup, cd_kwargs=part)  # 1 update in 2 steps: lr 0 at step 0
    key = f"{COUNTER_KEY}:{PART}"
    saved = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved[key]["num_updates"] == 1 and COUNTER_KEY not in saved
    given = ColinearityDecayCallback(lam=LAM, **part)
    train(tmp_path, steps=4, resume=str(tmp_path / "checkpoint-2"), callback=given, schedule=warmup)
    assert given.decay.num_updates == 1 + 2
    whole = ColinearityDecayCallback(lam=LAM)
    with pytest.warns(UserWarning, match=rf"no CD state under '{COUNTER_KEY}' in the checkpoint; it holds CD state "
                                         rf"under '{key}' \(module='{PART}'\) .*starts from 0"):
        train(tmp_path, steps=4, resume=str(tmp_path / "checkpoint-2"), callback=whole, schedule=warmup)
    assert whole.decay.num_updates == 2


def test_bf16_autocast_gets_the_papers_update_once_per_update(tmp_path):
    """TrainingArguments(bf16=True) on the CPU (autocast around the forward, float32 weights, no GradScaler): CD runs
    once per update, and its update inside the step is the paper's on the weights the step found (float64
    reference, cd_models.ref_w2), with the lr of W2's group, as under accelerate's bf16
    (test_cd_integration_accelerate.py)."""
    from cd.wrappers import torch_optimizer
    from cd_models import ref_w2

    model = tiny_gpt2().float()
    dtypes = []  # of an MLP's output at each forward (the first: CD's pair check, before the loop)
    model.transformer.h[0].mlp.c_proj.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    fc1, fc2 = model.transformer.h[1].mlp.c_fc.weight, model.transformer.h[1].mlp.c_proj.weight
    seen = []  # per update: fc2 and fc1 before CD, fc2's lr, fc2 after CD

    def before(opt, args, kwargs):
        lr = next(g["lr"] for g in opt.param_groups if any(p is fc2 for p in g["params"]))
        seen.append([fc2.detach().clone(), fc1.detach().clone(), lr])

    class Around(TrainerCallback):  # step pre-hooks run in the order made: one before CD's binding, one after
        def __init__(self, hook):
            self.hook = hook

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            torch_optimizer(optimizer).register_step_pre_hook(self.hook)

    callback = ColinearityDecayCallback(lam=LAM)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=3, max_grad_norm=0.5, learning_rate=1e-2, bf16=True, report_to=[], use_cpu=True,
                             disable_tqdm=True, save_strategy="no")
    Trainer(model=model, args=args, train_dataset=data(),
            callbacks=[Around(before), callback, Around(lambda o, a, k: seen[-1].append(fc2.detach().clone()))]).train()
    assert dtypes[-6:] == [torch.bfloat16] * 6  # the Trainer's forwards ran under autocast
    assert callback.decay.num_updates == len(seen) == 3
    for t, (w2, w1, lr, got) in enumerate(seen):  # Conv1D: stored (in, out)
        want = ref_w2(w2.T, w1.T, lr * LAM).T
        assert not torch.equal(got, w2)
        assert torch.allclose(got.double(), want, rtol=0, atol=1e-6), (t, float((got.double() - want).abs().max()))
