"""The GPU matrix: what only a CUDA device can show. Deselected by default; `python -m pytest -m gpu`.

Runs in a few minutes on one GPU: every quantization pipeline end to end on CUDA (equal to the CPU run
within float tolerance), train.py with fp16 / bf16 / compile / EMA / CD / TWEO, exact resume on CUDA,
the fp16 step without host syncs, and evaluate.py under torchrun. The CPU stand-ins for the device
bugs these catch are in test_device_explicit.py.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import evaluate
import train
from cd import ColinearityDecay
from configs import load_config
from engine.loop import TrainBatches, TrainLoop, TrainState
from quant import PIPELINES
from device_utils import cpu_pipeline_data, tensors_of
from dist_utils import free_port
from quant_models import images, tiny_swin, tiny_vit
from tests.conftest import DEMO_CONFIG, ROOT

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")

FAST = {
    "percentile": None,
    "repq": None,
    "aphq": dict(iters=20, recon_images=64, calib_images=32, batch_size=16, matmul_steps=9, search_rounds=1,
                 log_every=10),
    "gplq": dict(steps=4, batch_size_per_gpu=8, init_images=32, pca_images=32, stage2_images=32, log_every=2,
                 ckpt_every=0),
}


def _quantize(pipeline, make_model, device):
    torch.backends.cuda.matmul.allow_tf32 = False  # compare float32 with float32
    torch.backends.cudnn.allow_tf32 = False
    model = make_model().to(device)
    qmodel, _ = PIPELINES[pipeline](model, images(32).to(device), "w4a4", FAST[pipeline],
                                    data=cpu_pipeline_data(64))
    with torch.no_grad():
        return qmodel, qmodel(images(64, seed=7).to(device)).float().cpu()


@pytest.mark.parametrize("pipeline", sorted(FAST))
@pytest.mark.parametrize("make_model", [tiny_vit, tiny_swin], ids=["vit", "swin"])
def test_pipeline_on_cuda_matches_the_cpu_run(pipeline, make_model):
    qmodel, on_gpu = _quantize(pipeline, make_model, CUDA)
    assert all(t.device.type == "cuda" for _, t in tensors_of(qmodel))
    _, on_cpu = _quantize(pipeline, make_model, torch.device("cpu"))
    # Kernels differ in summation order, so a range search may pick a neighbouring candidate or AdaRound a
    # different side for a weight on the edge: the logits agree closely, not bit for bit.
    assert torch.isfinite(on_gpu).all()
    scale = on_cpu.std().item()
    assert (on_gpu - on_cpu).abs().mean().item() < 0.05 * scale
    assert (on_gpu.argmax(1) == on_cpu.argmax(1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("overrides", [
    ("train.amp=fp16",),
    ("train.amp=fp16", "optim.fused=false", "cd.enabled=true", "train.ema=true"),
    ("train.amp=bf16", "cd.enabled=true", "tweo.enabled=true"),
    ("train.amp=bf16", "train.compile=true", "cd.enabled=true", "train.ema=true"),
    ("train.amp=fp16", "model.name=swin_nano", "cd.enabled=true", "tweo.enabled=true", "optim.clip_grad=5.0"),
], ids=["fp16", "fp16-foreach-cd-ema", "bf16-cd-tweo", "bf16-compile-cd-ema", "swin-fp16-cd-tweo-clip"])
def test_train_on_cuda(debug_config, overrides):
    result = train.main(debug_config("train.device=cuda", *overrides))
    assert result.state.step == 8 and 0 <= result.metrics["val/top1"] <= 100
    assert all(p.device.type == "cuda" and torch.isfinite(p).all() for p in result.model.parameters())


def test_exact_resume_on_cuda(debug_config):
    common = ("train.device=cuda", "train.deterministic=true", "train.amp=fp16", "cd.enabled=true",
              "train.ema=true", "train.ema_decay=0.9")
    straight, split = debug_config(*common, name="straight"), debug_config(*common, name="split")
    try:
        train.main(straight)
        train.main(debug_config(*common, "train.max_steps=3", name="split"))
        train.main(split)
    finally:  # train.deterministic is process-wide: do not leave it on for the other tests
        torch.use_deterministic_algorithms(False)
    a = torch.load(os.path.join(straight.out_dir, "checkpoint.pt"), weights_only=True)
    b = torch.load(os.path.join(split.out_dir, "checkpoint.pt"), weights_only=True)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["state"] == b["state"]


def test_fp16_step_with_a_fused_optimizer_never_syncs_with_the_host():
    """An fp16 update with a fused optimizer and CD attached issues no synchronising CUDA call
    (engine/optim.py, use_fused; the CD gate and steps stay on the device, norms off this step)."""
    model = tiny_vit().to(CUDA).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ColinearityDecay(model, lam=0.005, norms_every=1000).attach(optimizer)
    batches = [(images(16, seed=s).pin_memory(), (torch.arange(16) % 10).pin_memory()) for s in range(6)]

    class Sampler:
        def set_epoch(self, epoch, start=0):
            pass

    loop = TrainLoop(model=model, optimizer=optimizer, device=CUDA, amp="fp16",
                     scaler=torch.amp.GradScaler("cuda"), log_every=1000,
                     compute_loss=lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y))
    state = TrainState()
    loop.run_epoch(TrainBatches(batches[:2], Sampler()), state, 16)  # warm-up: lazy initialisations may sync
    torch.cuda.set_sync_debug_mode("error")
    try:  # the body of one update as TrainLoop.run_epoch runs it (forward, scaled backward, optimizer step)
        for x, y in batches[2:]:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loop.compute_loss(model, x.to(CUDA, non_blocking=True), y.to(CUDA, non_blocking=True))
            loop.scaler.scale(loss).backward()
            loop._optimizer_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loop._settle_skipped_steps(state)
    assert state.skipped_steps >= 0


@pytest.mark.slow
def test_evaluate_under_torchrun_on_cuda(tmp_path):
    out = tmp_path / "run"
    cfg = load_config([DEMO_CONFIG], [f"out_dir={out}", "model.name=vit_nano", "train.max_steps=20",
                                      "sched.epochs=1", "sched.warmup_epochs=0", "train.device=cuda"])
    train.main(cfg)
    procs = min(2, torch.cuda.device_count())
    result = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", "--master_port",
           str(free_port()), "evaluate.py", "--checkpoint", str(out / "best.pt"), "--quant", "percentile",
           "repq", "aphq", "--out", str(result), "quant.aphq.iters=10", "quant.aphq.recon_images=64",
           "quant.aphq.calib_images=32", "quant.aphq.batch_size=16", "quant.aphq.matmul_steps=9"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads(result.read_text())
    assert saved["images"] == 360 and set(saved["quant"]) == {"percentile", "repq", "aphq"}
    single = evaluate.main(evaluate.parse_args(["--checkpoint", str(out / "best.pt"), "--quant", "repq",
                                                "--out", str(tmp_path / "single.json")]))
    assert abs(single["quant"]["repq"]["w4a4"]["top1"] - saved["quant"]["repq"]["w4a4"]["top1"]) <= 0.5


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("tf32", 5e-3), ("bf16", 2e-2)])
def test_cd_update_precisions_on_cuda_against_float64(precision, tol):
    """The real TF32 path (CPUs have none): the update's relative error against float64."""
    from cd_models import VIT_DEPTH, ref_block_update, snapshot
    from cd_models import tiny_vit as cd_tiny_vit

    model = cd_tiny_vit().to(CUDA)
    before = {k: v.cpu() for k, v in snapshot(model).items()}
    decay = ColinearityDecay(model, lam=0.1, matmul_precision=precision)
    assert ColinearityDecay(model).matmul_precision == "tf32"  # auto on CUDA
    decay.apply(lr=0.5)
    expected = {}
    for i in range(VIT_DEPTH):
        ref_block_update(before, f"blocks.{i}", 0.05, expected)
    params = {n: p.detach().double().cpu() for n, p in model.named_parameters()}
    for name, want in expected.items():
        delta_want, delta_got = want - before[name].double(), params[name] - before[name].double()
        assert (delta_got - delta_want).norm() / delta_want.norm() < tol, name


def test_the_weights_fingerprint_is_the_same_on_cuda_and_the_cpu():
    """A result JSON or a GPLQ stage-1 checkpoint written on one device type is accepted on the other."""
    from engine.checkpoint import weights_fingerprint

    state = tiny_vit().state_dict()
    assert weights_fingerprint({k: v.to(CUDA) for k, v in state.items()}) == weights_fingerprint(state)
