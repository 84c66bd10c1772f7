"""The GPU matrix: what only a CUDA device can show. The `cuda` cases are deselected by default;
`python -m pytest -m gpu` (or scripts/gpu_check.py, which also runs the GPU benchmarks).

Every quantization pipeline end to end on CUDA (equal to the CPU run within float tolerance, or, for the
pipelines that draw random numbers on the model's device, equally good), train.py with fp16 / bf16 /
compile / EMA / CD / TWEO (each shown to act), resume on CUDA, the fp16 step without host syncs through
the project's optimizer and loop, and evaluate.py under torchrun with two GPUs. Each test body takes the
device as a parameter: its `cpu` case runs in the default suite wherever a CPU can show the property, so
that the assertions are exercised (and seen to fail on a broken subject) without a GPU. The CPU stand-ins
for the device bugs these catch are in test_device_explicit.py.
"""
import contextlib
import json
import math
import os
import subprocess
import sys
from typing import Optional

import pytest
import torch

import evaluate
import train
from cd import ColinearityDecay, find_pairs
from cd.decay import energy_metrics
from configs import load_config
from configs.schema import OptimConfig
from engine import loop as loop_module
from engine.loop import TrainBatches, TrainLoop, TrainState
from engine.optim import build_optimizer
from engine.precision import grad_scaler
from models import build_model
from quant import PIPELINES
from device_utils import HostSyncsRaise, _FixedOrder, cpu_pipeline_data, tensors_of
from dist_utils import free_port
from quant_models import images, tiny_swin, tiny_vit
from test_train import checkpoint_tensors, read_metrics
from tests.conftest import DEMO_CONFIG, ROOT

CUDA = torch.device("cuda")
ON_CUDA = pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")
ON_CPU_AND_CUDA = [pytest.param("cpu", id="cpu"), ON_CUDA]


@pytest.fixture(autouse=True)
def float32_settings_restored():
    """TF32 and deterministic-algorithm switches are process-wide (train.py turns TF32 on): each test
    leaves them as it found them, so that no test's outcome depends on the ones before it."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


# ----------------------------------------------------------------------------------- quantization pipelines
FAST = {
    "percentile": {},
    "repq": {},
    "aphq": dict(iters=20, recon_images=64, calib_images=32, batch_size=16, matmul_steps=9, search_rounds=1,
                 log_every=10),
    "gplq": dict(steps=4, batch_size_per_gpu=8, init_images=32, pca_images=32, stage2_images=32, log_every=2,
                 ckpt_every=0),
}
# APHQ (QDrop masks, batch draws, Hessian probes) and GPLQ (training) draw from generators on the model's
# device, and CUDA's draws are not CPU's: their CUDA run is a run with other random numbers.
DRAWS_ON_DEVICE = ("aphq", "gplq")


def _quantize(pipeline, make_model, device, seed=0):
    """(quantized model, its logits, the float model's logits) on 64 fixed images, fp32 matmuls."""
    torch.backends.cuda.matmul.allow_tf32 = False  # compare float32 with float32 (the fixture restores)
    torch.backends.cudnn.allow_tf32 = False
    model = make_model().to(device)
    x = images(64, seed=7).to(device)
    with torch.no_grad():
        fp = model(x).float().cpu()
    options = dict(FAST[pipeline], **({"seed": seed} if pipeline in DRAWS_ON_DEVICE else {}))
    qmodel, _ = PIPELINES[pipeline](model, images(32).to(device), "w4a4", options or None,
                                    data=cpu_pipeline_data(64))
    with torch.no_grad():
        return qmodel, qmodel(x).float().cpu(), fp


def quantization_error(logits, fp):
    """Mean absolute deviation of quantized logits from the float model's, in units of the float std."""
    return ((logits - fp).abs().mean() / fp.std()).item()


def assert_equally_good(got, reference, fp):
    """`got` is as close to the float model as `reference` is: the comparison of two runs whose random
    draws differ (the same algorithm on other numbers), by the quantization error and the top-1 agreement
    with the float model. Against seed 0, 29 to 59 other seeds (measured on the CPU) move the error by at most
    9 % (APHQ, ViT) and 10 % / 7 % (GPLQ, ViT / Swin), and the top-1 agreement by at most 0.094, none failing;
    activation scales off by 2x on one side raise the error by 75 %. A reconstruction that does nothing
    moves it by only 4 % at these 20 iterations: that it works is the CPU tests' concern."""
    err_got, err_ref = quantization_error(got, fp), quantization_error(reference, fp)
    assert abs(err_got - err_ref) <= 0.25 * err_ref, (err_got, err_ref)
    agree_got = (got.argmax(1) == fp.argmax(1)).float().mean().item()
    agree_ref = (reference.argmax(1) == fp.argmax(1)).float().mean().item()
    assert abs(agree_got - agree_ref) <= 0.15, (agree_got, agree_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", sorted(FAST))
@pytest.mark.parametrize("make_model", [tiny_vit, tiny_swin], ids=["vit", "swin"])
def test_pipeline_on_cuda_matches_the_cpu_run(pipeline, make_model):
    qmodel, on_gpu, fp_gpu = _quantize(pipeline, make_model, CUDA)
    assert all(t.device.type == "cuda" for _, t in tensors_of(qmodel))
    _, on_cpu, fp_cpu = _quantize(pipeline, make_model, torch.device("cpu"))
    assert torch.isfinite(on_gpu).all()
    assert torch.allclose(fp_gpu, fp_cpu, atol=1e-4, rtol=1e-4)  # the float models agree
    if pipeline in DRAWS_ON_DEVICE:
        assert_equally_good(on_gpu, on_cpu, fp_cpu)
    else:
        assert_same_up_to_rounding(on_gpu, on_cpu, fp_cpu)


def assert_same_up_to_rounding(got, reference, fp):
    """The comparison of two runs of a deterministic pipeline (percentile, RepQ) on devices whose kernels differ
    in summation order: a range search may then pick a neighbouring candidate for a value on the edge. Measured
    on the CPU with the float weights scaled by 1 + 1e-7 or 1e-6 noise (the size of CUDA's fp32 rounding against
    the CPU's), 15 draws each, ViT and Swin: one neighbouring range moves the logits by up to 0.24 of their std
    (a bound of 0.05 failed 1 to 7 draws in 20), while the quantization error changes by at most 5 % and the
    top-1 of the two runs agrees on >= 97 % of the images. So: equally good, and the same top-1 on >= 90 %."""
    assert_equally_good(got, reference, fp)
    assert (got.argmax(1) == reference.argmax(1)).float().mean().item() >= 0.9


@pytest.mark.gpu
def test_aphq_cache_on_the_cpu_quantizes_as_the_cache_on_the_gpu():
    """quant.aphq.cache_device places the cached unit inputs / targets only (evaluate.py does not count it as a
    setting of a result): the batch draws come from the model's device either way, so the two runs take the
    same samples and end in the same model (up to the float order of the copies: none, they are exact)."""
    _, default, _ = _quantize("aphq", tiny_vit, CUDA)
    FAST["aphq"]["cache_device"] = "cpu"
    try:
        _, cached_on_cpu, _ = _quantize("aphq", tiny_vit, CUDA)
    finally:
        del FAST["aphq"]["cache_device"]
    assert torch.equal(default, cached_on_cpu)


@pytest.mark.parametrize("pipeline", DRAWS_ON_DEVICE)
def test_runs_with_other_random_draws_pass_the_equally_good_comparison(pipeline):
    """The CPU check of the comparison the CUDA test makes for APHQ and GPLQ: another seed on the same
    device stands in for CUDA's draws and must pass it (it is not stricter than seed-to-seed spread)."""
    _, one, fp = _quantize(pipeline, tiny_vit, torch.device("cpu"), seed=0)
    _, other, _ = _quantize(pipeline, tiny_vit, torch.device("cpu"), seed=1)
    assert not torch.equal(one, other)  # the draws did differ
    assert_equally_good(other, one, fp)


def _tiny_vit_rounded_otherwise(seed: int):
    """tiny_vit with every weight scaled by 1 + 1e-6 noise: the float model as another device's rounding gives it."""
    def make():
        model = tiny_vit()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=g))
        return model
    return make


@pytest.mark.parametrize("pipeline", ["percentile", "repq"])
def test_rounding_level_changes_pass_the_deterministic_pipelines_comparison(pipeline):
    """The CPU check of the comparison the CUDA test makes for percentile and RepQ: a float model changed at the
    level of rounding stands in for CUDA's kernels and must pass it. This draw moves a range search to its
    neighbouring candidate (the logits move by 0.2 of their std), which the comparison must allow."""
    cpu = torch.device("cpu")
    _, reference, fp = _quantize(pipeline, tiny_vit, cpu)
    _, got, _ = _quantize(pipeline, _tiny_vit_rounded_otherwise(seed=3), cpu)
    assert (got - reference).abs().mean().item() > 0.1 * reference.std().item()  # a neighbouring range was taken
    assert_same_up_to_rounding(got, reference, fp)


# ----------------------------------------------------------------------------------- train.py matrix
# An lr at which 8 updates visibly move the weights, no warm-up, and a CD strength (no budget rule, so
# that the run without CD differs only by CD) whose step lr * lam shrinks the decayed products by tens of
# percent in 8 updates; a TWEO strength whose term is a visible part of the loss.
VISIBLE = ("optim.lr=1e-3", "sched.warmup_epochs=0")
# each only with its switch: an override that the run would not read is refused (configs/loader.py)
VISIBLE_WHEN = {"cd.enabled=true": ("cd.lam=40", "cd.budget=false"), "tweo.enabled=true": ("tweo.lam=10",),
                "train.ema=true": ("train.ema_decay=0.9",)}
MATRIX = {
    "fp16": ("train.amp=fp16",),
    "fp16-foreach-cd-ema": ("train.amp=fp16", "optim.fused=false", "cd.enabled=true", "train.ema=true"),
    "bf16-cd-tweo": ("train.amp=bf16", "cd.enabled=true", "tweo.enabled=true"),
    "bf16-compile-cd-ema": ("train.amp=bf16", "train.compile=true", "cd.enabled=true", "train.ema=true"),
    "swin-fp16-cd-tweo-clip": ("train.amp=fp16", "model.name=swin_nano", "cd.enabled=true", "tweo.enabled=true",
                               "optim.clip_grad=5.0"),
}
CPU_TOO = ("fp16-foreach-cd-ema", "bf16-cd-tweo", "swin-fp16-cd-tweo-clip")  # compile on a CPU takes minutes


class TrainingProbe:
    """What train.py's training forward passes ran under, seen from inside the model: the loop train.py built
    (its model, compiled or not, and its GradScaler) and, from a forward hook on the first `fc1`, that layer's
    output dtype (autocast) and the TF32 switches during a training pass. The hook keeps the last training
    pass's in one attribute: under torch.compile a list it appended to would change size at every call, and
    dynamo, which guards on it, would recompile each time and fall back to eager after its recompile limit."""

    def __init__(self, monkeypatch) -> None:
        self.loop: Optional[TrainLoop] = None
        self.training_pass: Optional[tuple] = None
        build = train.build_loop

        def build_and_watch(run, *args, **kwargs):
            self.loop = build(run, *args, **kwargs)
            fc1 = next(m for name, m in run.model.named_modules() if name.endswith("fc1"))
            fc1.register_forward_hook(self._record)
            return self.loop

        monkeypatch.setattr(train, "build_loop", build_and_watch)

    def _record(self, module, inputs, output) -> None:
        if module.training and torch.is_grad_enabled():  # a training pass, not validation's
            self.training_pass = (output.dtype, torch.backends.cuda.matmul.allow_tf32,
                                  torch.backends.cudnn.allow_tf32)


def assert_settings_acted(probe: TrainingProbe, overrides, ckpt: dict, compiled_frames: int) -> None:
    """The run's precision and compile settings took effect, not only that it finished: fc1 computed in the
    autocast dtype, TF32 was on (train.py turns it on for every run), fp16 came with an enabled GradScaler whose
    loss scale was applied (a disabled one's scale is 1.0) and bf16 with none, and under train.compile=true the
    loop trained a dynamo-compiled model that dynamo did compile (`compiled_frames`: its frame counter's rise)."""
    amp = next(o.split("=")[1] for o in overrides if o.startswith("train.amp="))
    assert probe.training_pass == ({"fp16": torch.float16, "bf16": torch.bfloat16}[amp], True, True), \
        probe.training_pass
    scaler = probe.loop.scaler
    if amp == "fp16":
        assert scaler is not None and scaler.is_enabled() and scaler.get_scale() != 1.0
        assert ckpt["scaler"]["scale"] == scaler.get_scale()
    else:
        assert scaler is None and "scaler" not in ckpt
    compiled = "train.compile=true" in overrides
    assert isinstance(probe.loop.model, torch._dynamo.eval_frame.OptimizedModule) == compiled
    assert (compiled_frames > 0) == compiled, compiled_frames


def compiled_frames_so_far() -> int:
    """Frames dynamo has compiled in this process (torch._dynamo.utils.counters)."""
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


@pytest.mark.parametrize("variant,device", [pytest.param(v, "cpu", id=f"{v}-cpu") for v in CPU_TOO]
                         + [pytest.param(v, "cuda", marks=pytest.mark.gpu, id=f"{v}-cuda") for v in MATRIX])
def test_train_matrix(debug_config, variant, device, monkeypatch):
    overrides = MATRIX[variant]
    fused = "optim.fused=false" not in overrides  # the default on CUDA; asked for explicitly on a CPU
    visible = [o for switch, keys in VISIBLE_WHEN.items() if switch in overrides for o in keys]
    common = (f"train.device={device}", *VISIBLE, *visible, *overrides, *(("optim.fused=true",) if fused else ()))
    cfg = debug_config(*common, name="run")
    probe = TrainingProbe(monkeypatch)
    frames = compiled_frames_so_far()
    result = train.main(cfg)
    frames = compiled_frames_so_far() - frames
    state = result.state
    assert state.step == 8 and 0 <= result.metrics["val/top1"] <= 100
    assert all(p.device.type == device and torch.isfinite(p).all() for p in result.model.parameters())
    ckpt = torch.load(os.path.join(cfg.out_dir, "checkpoint.pt"), weights_only=True, map_location="cpu")
    # the optimizer really runs the fused kernel (or not): torch records it in every param group
    assert [bool(g["fused"]) for g in ckpt["optimizer"]["param_groups"]] == \
        [fused] * len(ckpt["optimizer"]["param_groups"])
    assert_settings_acted(probe, overrides, ckpt, frames)

    if "cd.enabled=true" in overrides:
        # applied once per update that ran, never on a step the GradScaler skipped
        assert ckpt["cd"]["num_updates"] == state.step - state.skipped_steps
        # and it acted: every decayed product is far smaller than in the same run without CD
        without = train.main(debug_config(*[o for o in common if o != "cd.enabled=true"], "cd.enabled=false",
                                           name="no_cd"))
        with_cd, without_cd = energy_metrics(find_pairs(result.model)), energy_metrics(find_pairs(without.model))
        assert with_cd.keys() == without_cd.keys()
        for role in with_cd:
            assert with_cd[role] < 0.8 * without_cd[role], (role, with_cd[role], without_cd[role])

    if "tweo.enabled=true" in overrides:
        logged = [r for r in read_metrics(cfg.out_dir) if "tweo/penalty" in r]
        assert logged and all(r["tweo/penalty"] > 0 and r["tweo/lam"] == 10 for r in logged)
        # the term is in the loss: the first update (same weights, same data) differs by it
        without = train.main(debug_config(*[o for o in common if o != "tweo.enabled=true"], "tweo.enabled=false",
                                           name="no_tweo"))
        term = state.initial_loss - without.state.initial_loss
        assert term > 0.5 * 10 * min(r["tweo/penalty"] for r in logged), term

    if "train.ema=true" in overrides:
        torch.manual_seed(cfg.train.seed)  # train.py's initial weights
        initial = build_model(cfg.model).state_dict()
        ema = ckpt["model_ema"]
        moved = [k for k, v in ckpt["model"].items() if v.is_floating_point()
                 and not torch.equal(ema[k], v) and not torch.equal(ema[k], initial[k])]
        assert len(moved) >= len(ckpt["model"]) // 2  # EMA follows the model, lagging behind it
        assert "val_ema/top1" in result.metrics


# ----------------------------------------------------------------------------------- resume
RESUMED = ("train.amp=fp16", "cd.enabled=true", "train.ema=true", "train.ema_decay=0.9", "sched.per_step=true",
           "optim.lr=1e-3", "sched.warmup_epochs=0")


def without_best(state: dict) -> dict:
    """The counters without where the best validation was (its update, epoch and weights' fingerprint): the split
    run also validated at its stop (train.max_steps), so its best may sit at another update."""
    return {k: v for k, v in state.items() if k not in ("best_epoch", "best_step", "best_fingerprint")}


def assert_resumed_like_straight(straight_dir, split_dir, cfg, exact):
    """The checkpoints of the uninterrupted run and the stopped-and-resumed one hold the same model,
    EMA, optimizer state, scheduler, loss scaler and counters: bit for bit (`exact`), or else within 5 %
    per kind of tensor (the model's and the EMA's weights: of how far training moved them; each optimizer
    moment: of its size). A state restored wrongly (restarted moments, EMA or loss scale) makes tens of
    percent; nondeterministic kernels far less. Per kind, not per tensor: Adam turns the rounding noise
    of exactly-zero gradients (attention's K bias) into lr-sized steps that differ from run to run."""
    a, state_a, sched_a = checkpoint_tensors(os.path.join(straight_dir, "checkpoint.pt"))
    b, state_b, sched_b = checkpoint_tensors(os.path.join(split_dir, "checkpoint.pt"))
    assert a.keys() == b.keys()
    assert sched_a == sched_b
    scaler_a, scaler_b = (torch.load(os.path.join(d, "checkpoint.pt"), weights_only=True).get("scaler")
                          for d in (straight_dir, split_dir))
    assert scaler_a is not None and scaler_a == scaler_b  # fp16 (RESUMED): loss scale and its growth counter
    if exact:
        for key in a:
            assert torch.equal(a[key], b[key]), key
        assert without_best(state_a) == without_best(state_b)
        return
    torch.manual_seed(cfg.train.seed)  # train.py's initial weights (also the EMA's start)
    initial = {f"{kind}.{k}": v for k, v in build_model(cfg.model).state_dict().items()
               for kind in ("model", "ema")}
    differences, references = {}, {}
    for key in a:
        if not a[key].is_floating_point() or key.endswith(".step"):  # counters
            assert torch.equal(a[key], b[key]), key
            continue
        kind = key.split(".")[0] if key in initial else f"opt.{key.rsplit('.', 1)[1]}"  # opt.exp_avg, ...
        reference = (a[key] - initial[key].to(a[key].device)) if key in initial else a[key]
        differences[kind] = differences.get(kind, 0.0) + (a[key] - b[key]).double().square().sum().item()
        references[kind] = references.get(kind, 0.0) + reference.double().square().sum().item()
    assert set(differences) >= {"model", "ema", "opt.exp_avg", "opt.exp_avg_sq"}
    for kind in differences:
        assert differences[kind] ** 0.5 <= 0.05 * references[kind] ** 0.5, (kind, differences[kind] ** 0.5,
                                                                             references[kind] ** 0.5)
    approx = {"initial_loss": pytest.approx(state_a["initial_loss"], rel=1e-3),
              "best_value": pytest.approx(state_a["best_value"], abs=100 / 16 + 1e-6)}  # one of 16 images
    assert without_best(state_b) == without_best({**state_a, **approx})


@pytest.mark.parametrize("deterministic,device", [
    pytest.param(False, "cpu", id="tolerance-cpu"),
    pytest.param(False, "cuda", marks=pytest.mark.gpu, id="tolerance-cuda"),
    pytest.param(True, "cuda", marks=pytest.mark.gpu, id="deterministic-cuda"),
])
def test_resume_on_device(debug_config, deterministic, device):
    common = (f"train.device={device}", f"train.deterministic={str(deterministic).lower()}", *RESUMED)
    straight, split = debug_config(*common, name="straight"), debug_config(*common, name="split")
    train.main(straight)
    first = train.main(debug_config(*common, "train.max_steps=3", name="split"))
    assert first.state.step == 3 and first.state.epoch_batches == 6  # stopped inside epoch 0
    train.main(split)
    assert_resumed_like_straight(straight.out_dir, split.out_dir, straight, exact=deterministic)


def test_the_cublas_workspace_is_set_before_any_test_runs():
    """PyTorch reads CUBLAS_WORKSPACE_CONFIG once per process, at its first cuBLAS call: the deterministic CUDA
    resume test above needs it from the start of `pytest -m gpu`, before earlier tests' matmuls, not from train.py
    (which sets it only when its own config asks). tests/conftest.py sets it when pytest loads it; a value of
    the user's is kept (the two deterministic ones PyTorch accepts)."""
    value = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    assert value in (":4096:8", ":16:8"), value


# ----------------------------------------------------------------------------------- the sync-free fp16 step
FORCED_OVERFLOW = 4  # the update (0-based) whose gradient is made infinite


@contextlib.contextmanager
def host_syncs_are_errors(device: torch.device):
    """A host sync raises inside: CUDA's sync debug mode, or on a CPU its stand-in (device_utils.HostSyncsRaise:
    host copies and reads, where CUDA would wait), so that the CPU case checks where the guard ends as well.
    Yields the function that allows syncs again (the guard stays in place until then)."""
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield lambda: torch.cuda.set_sync_debug_mode("default")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        with HostSyncsRaise() as mode:
            yield mode.disarm


@pytest.mark.parametrize("device", ON_CPU_AND_CUDA)
def test_fp16_updates_skip_on_overflow_without_host_syncs(device, monkeypatch):
    """Through the project's build_optimizer and TrainLoop with CD attached: the fused kernel is chosen
    (by default on CUDA), an update whose gradient overflows changes no weight (neither CD nor AdamW
    acts), every other update does (CD included), the skips are counted, and the updates issue no
    synchronising call (engine/optim.py use_fused; the CD gate and the skip count stay on the device): on CUDA
    by its sync debug mode, on a CPU by the stand-in that sees host copies and reads."""
    device = torch.device(device)
    model = tiny_vit().to(device).train()
    cfg = OptimConfig(fused=None if device.type == "cuda" else True)  # CUDA: the automatic choice
    optimizer = build_optimizer(model, cfg, lr=1e-3, weight_decay=0.05, device=device)
    assert optimizer.defaults["fused"] and optimizer._step_supports_amp_scaling

    def flat():
        return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()

    decay = ColinearityDecay(model, lam=0.5, norms_every=1000)
    decayed = [pair.downstream for pair in decay.pairs]
    before_cd, after_cd, after_step, found_inf = [], [], [], []  # per update, device tensors only

    def decayed_now():
        return torch.cat([w.detach().flatten() for w in decayed])

    # step pre-hooks run in the order registered: these two see the decayed matrices just before and
    # just after CD's update, inside the optimizer step
    optimizer.register_step_pre_hook(lambda *_: before_cd.append(decayed_now()))
    decay.attach(optimizer)
    optimizer.register_step_pre_hook(lambda *_: after_cd.append(decayed_now()))

    def record(opt, *_):
        after_step.append(flat())
        found_inf.append(opt.found_inf.detach().clone().reshape(()))

    optimizer.register_step_post_hook(record)
    dtypes = set()  # fc1's outputs: computed under the loop's fp16 autocast (a dtype is no host sync)
    model.blocks[0].mlp.fc1.register_forward_hook(lambda module, inputs, output: dtypes.add(output.dtype))
    model.head.weight.register_hook(lambda g: g * math.inf if len(after_step) == FORCED_OVERFLOW else g)

    pin = device.type == "cuda"
    batches = [(images(16, seed=s), torch.arange(16) % 10) for s in range(8)]
    batches = [(x.pin_memory(), y.pin_memory()) if pin else (x, y) for x, y in batches]
    loop = TrainLoop(model=model, optimizer=optimizer, device=device, amp="fp16",
                     scaler=grad_scaler("fp16", device), log_every=1000,
                     compute_loss=lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y))
    state = TrainState()
    initial = flat()
    loop.run_epoch(TrainBatches(batches[:2], _FixedOrder()), state, 16)  # warm-up: lazy initialisations
    # The updates of the next epoch run with synchronising calls made errors. The epoch's end is where the loop
    # syncs on purpose, and its first read is the window's sums (_Window._global_sums: the epoch's last log
    # line, then the loss check and the skip count); the guard ends there, after all the updates.
    global_sums = loop_module._Window._global_sums
    updates_when_allowed = []
    with host_syncs_are_errors(device) as allow_syncs:
        def end_of_updates(window):
            if not updates_when_allowed:
                updates_when_allowed.append(len(after_step))
                allow_syncs()
            return global_sums(window)

        monkeypatch.setattr(loop_module._Window, "_global_sums", end_of_updates)
        loop.run_epoch(TrainBatches(batches[2:], _FixedOrder()), state, 16)
    assert updates_when_allowed == [8]  # every update of the epoch ran under the guard
    assert dtypes == {torch.float16} and loop.scaler.is_enabled()

    skipped = [bool(f > 0) for f in found_inf]
    assert len(skipped) == state.step == 8
    assert skipped[FORCED_OVERFLOW]
    assert sum(not s for s in skipped) >= 5  # mostly real updates: the checks below are not vacuous
    assert state.skipped_steps == sum(skipped)
    assert decay.state_dict()["num_updates"] == state.step - state.skipped_steps
    previous = [initial] + after_step[:-1]
    for i, skip in enumerate(skipped):
        cd_delta = (after_cd[i] - before_cd[i]).abs().max().item()
        if skip:
            assert torch.equal(after_step[i], previous[i]), f"update {i} was skipped but changed weights"
            assert cd_delta == 0, f"CD acted on skipped update {i}"
        else:
            assert not torch.equal(after_step[i], previous[i]), f"update {i} changed nothing"
            assert cd_delta > 0, f"CD did not act on update {i}"


# ----------------------------------------------------------------------------------- evaluate.py, torchrun
@pytest.mark.gpu
@pytest.mark.slow
def test_evaluate_under_torchrun_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"{torch.cuda.device_count()} GPU visible: NCCL forms no process group of two ranks on "
                    "one GPU, so GPLQ's DDP stage cannot run distributed here; needs 2 GPUs")
    out = tmp_path / "run"
    cfg = load_config([DEMO_CONFIG], [f"out_dir={out}", "model.name=vit_nano", "train.max_steps=20",
                                      "sched.epochs=1", "sched.warmup_epochs=0", "train.device=cuda"])
    train.main(cfg)
    result = tmp_path / "eval.json"
    gplq = [f"quant.gplq.{k}={v}" for k, v in FAST["gplq"].items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
           str(free_port()), "evaluate.py", "--checkpoint", str(out / "best.pt"), "--quant", "percentile",
           "repq", "aphq", "gplq", "--out", str(result), "quant.aphq.iters=10", "quant.aphq.recon_images=64",
           "quant.aphq.calib_images=32", "quant.aphq.batch_size=16", "quant.aphq.matmul_steps=9", *gplq]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 process(es)" in run.stdout + run.stderr  # one NCCL group of two ranks
    saved = json.loads(result.read_text())
    assert saved["images"] == 360 and set(saved["quant"]) == {"percentile", "repq", "aphq", "gplq"}
    single = evaluate.main(evaluate.parse_args(["--checkpoint", str(out / "best.pt"), "--quant", "repq",
                                                "--out", str(tmp_path / "single.json")]))
    assert abs(single["quant"]["repq"]["w4a4"]["top1"] - saved["quant"]["repq"]["w4a4"]["top1"]) <= 0.5


# ----------------------------------------------------------------------------------- CD's TF32 path
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_cd_update_precisions_on_cuda_against_float64(precision):
    """The real TF32 path (CPUs have none): the update's relative error against float64 is under the precision's
    ceiling and, for tf32 and bf16, not under a tenth of what rounding the products' operands to it gives, so that
    products run in fp32 fail (assert_update_precision, test_cd_tf32_device.py). tf32 and bf16 on vit_b_block
    (ViT-B's widths: cuBLAS need not use TF32 tensor cores on tiny_vit's 32-wide matrices)."""
    from cd_models import snapshot
    from cd_models import tiny_vit as cd_tiny_vit
    from test_cd_tf32_device import assert_update_precision, vit_b_block

    torch.backends.cuda.matmul.allow_tf32 = False  # CD sets the precision of its own products
    model = (cd_tiny_vit() if precision == "fp32" else vit_b_block()).to(CUDA)
    before = {k: v.cpu() for k, v in snapshot(model).items()}
    decay = ColinearityDecay(model, lam=0.1, matmul_precision=precision)
    assert ColinearityDecay(model).matmul_precision == "tf32"  # auto on CUDA
    decay.apply(lr=0.5)
    assert_update_precision(model, before, 0.05, precision)


@pytest.mark.gpu
def test_the_weights_fingerprint_is_the_same_on_cuda_and_the_cpu():
    """A result JSON or a GPLQ stage-1 checkpoint written on one device type is accepted on the other."""
    from engine.checkpoint import weights_fingerprint

    state = tiny_vit().state_dict()
    assert weights_fingerprint({k: v.to(CUDA) for k, v in state.items()}) == weights_fingerprint(state)


@pytest.mark.parametrize("device", ON_CPU_AND_CUDA)
def test_the_v_row_check_runs_on_the_models_device_and_moves_no_random_stream(device):
    """cd/values.py's real forward runs where the model is: a [Q; K; V] qkv passes and a per-head one is refused,
    and the random streams of the CPU and of the model's device (the toy draws noise in its forward) are where
    they were, as are the weights."""
    from cd import UnsupportedModelError
    from test_cd_qkv_rows import _Net

    for layout in ("thirds", "per_head"):
        model = _Net(layout, noisy=True).to(device)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        cpu_rng = torch.get_rng_state()
        device_rng = torch.cuda.get_rng_state(device) if device == "cuda" else None
        if layout == "thirds":
            assert len(find_pairs(model)) == 8
        else:
            with pytest.raises(UnsupportedModelError, match="is not zero: something other than V"):
                find_pairs(model)
        assert torch.equal(torch.get_rng_state(), cpu_rng)
        if device == "cuda":
            assert torch.equal(torch.cuda.get_rng_state(device), device_rng)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


@pytest.mark.gpu
def test_weight_noise_draws_on_the_weights_gpu_and_leaves_evaluation_clean():
    """UNIQ's noise (cd/noise.py, the detection study's Noise baseline) on a CUDA layer draws from a generator on
    the weight's device: a CPU generator there is refused by torch.rand, which no CPU test can see. The training
    forward is the layer's with uniq_noise's weight and bias of a CUDA generator seeded noise_seed(seed, step, 0);
    the same step draws the same noise again, another step other noise, evaluation the clean weights."""
    from cd.noise import WeightNoise, noise_seed, uniq_noise

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8)).to(CUDA).train()
    layer, x = model[0], torch.randn(4, 16, device=CUDA)
    noise = WeightNoise(model, bits=4, seed=3)
    noise.step = 5
    with torch.no_grad():
        trained = model(x)
        gen = torch.Generator(device=CUDA).manual_seed(noise_seed(3, 5, 0))  # weight's draws, then bias's
        weight, bias = uniq_noise(layer.weight, 4, gen), uniq_noise(layer.bias, 4, gen)
        assert torch.allclose(trained, x @ weight.T + bias, atol=1e-5)
        assert torch.equal(model(x), trained)  # one step, one noise
        noise.step = 6
        assert not torch.allclose(model(x), trained)
        clean = x @ layer.weight.T + layer.bias
        assert not torch.allclose(trained, clean)
        assert torch.allclose(model.eval()(x), clean, atol=1e-6)
    noise.remove()
