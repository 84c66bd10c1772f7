"""Every tensor is created on the device of the data it belongs to (the class of bug that crashed CUDA runs).

The trick (tests/device_utils.py): run the code on a CPU model with `meta` as the default device. A
tensor created without an explicit device becomes a meta tensor and the run fails, exactly where a CUDA
run would have mixed a CPU tensor with GPU data. Each test here fails on the code before the fix.
"""
import re

import pytest
import torch

from cd import TWEO, ColinearityDecay
from engine.loop import evaluate
from engine.act_max import ActivationProbe
from models.attention_sinks import use_sink_attention
from quant import PIPELINES, quantize_model
from quant.spec import QuantizerSpec
from quant.modes import named_quantizers
from quant.ptq.repq import RepQPipeline
from quant.quantizers import UniformQuantizer
from quant.spec import Bits
from device_utils import HostCopies, HostReads, OnCPU, cpu_pipeline_data, tensors_of
from quant_models import images, tiny_swin, tiny_vit
from tests.conftest import load_script

pytestmark = pytest.mark.usefixtures("one_thread", "adam_step_on_cpu")

FAST = {
    "percentile": None,
    "repq": None,
    # the fewest search candidates the options take (eq_n: 2 ranges per 4-bit zero point): the calibration
    # search, most of the run, takes the same path at any count
    "aphq": dict(iters=2, recon_images=32, calib_images=16, batch_size=16, matmul_steps=2, eq_n=32,
                 search_rounds=1, log_every=1),
    "gplq": dict(steps=2, batch_size_per_gpu=8, init_images=16, pca_images=16, stage2_images=16, log_every=1,
                 ckpt_every=0),
}


@pytest.mark.parametrize("pipeline", sorted(FAST))
@pytest.mark.parametrize("make_model", [tiny_vit, tiny_swin], ids=["vit", "swin"])
def test_pipelines_create_no_tensor_on_the_default_device(pipeline, make_model):
    model, calib, data = make_model(), images(16), cpu_pipeline_data()
    with torch.device("meta"):
        qmodel, _ = PIPELINES[pipeline](model, calib, "w4a4", FAST[pipeline], data=data)
        out = qmodel(calib)
    assert out.device.type == "cpu" and torch.isfinite(out).all()
    misplaced = [name for name, t in tensors_of(qmodel) if t.device.type != "cpu"]
    assert misplaced == []


def test_converted_quantizers_live_on_their_layers_device():
    """Quantizers are built on the device of the layer they belong to, from construction on."""
    with torch.device("meta"):
        model = tiny_vit()  # weights on meta
    with torch.device("cpu"):  # a default that differs from the layers' device
        qmodel = quantize_model(model, RepQPipeline().layout(Bits(4, 4), RepQPipeline.Options()))
    devices = {t.device.type for _, q in named_quantizers(qmodel) for _, t in tensors_of(q)}
    assert devices == {"meta"}


def test_lazily_sized_quantizer_takes_the_device_of_its_data():
    """A per-channel quantizer sized at calibration re-creates its buffers where the data is, not where the
    placeholder was (the old code kept them on the placeholder's device)."""
    q = UniformQuantizer(4, channel_dim=-1, device="meta")  # placeholder of 0 groups on another device
    q.calibrating = True
    x = torch.randn(8, 6)
    out = q(x)
    assert q.scale.device.type == "cpu" and q.zero_point.device.type == "cpu" and q.scale.numel() == 6
    assert torch.isfinite(out).all()


class _DeviceSpy(torch.nn.Module):
    """A model whose parameter lives on `meta` (where its inputs must go) and whose unit records the device of
    every input it is given; a CPU stand-in for a GPU model fed CPU images."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1, device="meta"))
        self.seen = []
        self.unit = torch.nn.Identity()
        self.unit.register_forward_pre_hook(lambda m, args: self.seen.append(args[0].device.type))

    def forward(self, x):
        return self.unit(x)


def test_calibration_and_unit_captures_move_cpu_inputs_to_the_models_device():
    """calibrate, capture_unit and model_logits move each batch of CPU inputs to the model's device (the model
    never moves), and capture_unit keeps its captures on `store_device` when one is given."""
    from quant.calibrate import calibrate
    from quant.units import capture_unit, model_logits
    x = images(4)
    spy = _DeviceSpy()
    calibrate(spy, x)
    capture_unit(spy, "unit", x, 2)
    model_logits(spy, x, 2)
    assert spy.seen == ["meta"] * 5  # one calibration pass, two batches of each capture
    on_cpu = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 2))
    got, out = capture_unit(on_cpu, "1", x, 2, outputs=True, store_device=torch.device("meta"))
    assert got.device.type == out.device.type == "meta" and got.shape == (4, 3 * 32 * 32)


def test_probe_and_evaluation_on_a_quantized_model():
    model, calib = tiny_swin(), images(8)
    qmodel, _ = PIPELINES["repq"](model, calib, "w4a4")
    loader = OnCPU([(images(4, seed=s), torch.arange(4) % 10) for s in range(2)])
    with torch.device("meta"):
        with ActivationProbe(qmodel) as probe:
            metrics = evaluate(qmodel, loader, torch.device("cpu"))
        result = probe.result(device=torch.device("cpu"))
    assert metrics["count"] == 8 and result.block > 0 and result.module > 0


def test_cd_and_tweo_training_step():
    model = tiny_vit().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    decay = ColinearityDecay(model, lam=0.01)
    decay.attach(opt)
    x, y = images(4), torch.arange(4) % 10
    with torch.device("meta"), TWEO(model, lam=0.01) as tweo:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        (loss + tweo.aux_loss(loss)).backward()
        opt.step()
        metrics = {**decay.metrics(), **tweo.metrics()}
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert metrics["cd/updates"] == 1 and metrics["tweo/penalty"] > 0


@pytest.mark.parametrize("attn", ["softmax1", "kv_bias", "attn_bias"])
@pytest.mark.parametrize("make_model", [tiny_vit, tiny_swin], ids=["vit", "swin"])
def test_attention_sink_variants_train_and_quantize(attn, make_model):
    """models/attention_sinks.py: the variants' forward / backward and their quantized copies."""
    model, calib = make_model(), images(8)
    use_sink_attention(model, attn)
    with torch.device("meta"):
        model.train()
        model(calib).sum().backward()
        model.eval()
        qmodel, _ = PIPELINES["repq"](model, calib, "w4a4")
        out = qmodel(calib)
    assert out.device.type == "cpu" and torch.isfinite(out).all()
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in model.parameters())


def test_every_quantizer_kind_is_built_on_the_requested_device():
    """`from_spec` with an explicit device ignores the default device (also for the learnable kinds)."""
    from quant.aphq.adaround import AdaRoundQuantizer
    from quant.gplq.lsq import LSQQuantizer
    from quant.quantizers import LogSqrt2Quantizer, UniformQuantizer

    with torch.device("meta"):
        for kind, dim in ((UniformQuantizer, None), (LSQQuantizer, -1), (AdaRoundQuantizer, 0),
                          (LogSqrt2Quantizer, None)):
            spec = QuantizerSpec(4, kind=kind)
            q = kind.from_spec(spec, dim, 3 if dim is not None else None, device="cpu")
            assert {t.device.type for _, t in tensors_of(q)} == {"cpu"}, kind.__name__


def test_training_windows_draw_their_offset_on_the_cpu():
    """A language model's training window draws its offset from the CPU generator that SeededDataset seeds,
    whatever the default device (the old code drew it there: a meta / CUDA tensor, unseeded on CUDA)."""
    import numpy as np

    from data.samplers import SeededDataset
    from data.text import TokenStream, TokenWindows

    windows = SeededDataset(TokenWindows(TokenStream(np.arange(200, dtype=np.uint16), None, "t"), 8, train=True))
    expected = windows[(3, 123)]
    with torch.device("meta"):
        x, y = windows[(3, 123)]
    assert x.device.type == "cpu" and torch.equal(x, expected[0]) and torch.equal(y, expected[1])


def test_calibration_sets_are_drawn_on_the_cpu(tmp_path):
    """The calibration windows (GPTQ / SmoothQuant) and images (RepQ-ViT, APHQ) are chosen by a CPU generator
    and built from CPU data, whatever the default device (the old code drew their order there: a meta tensor,
    and on a CUDA default a generator of another device)."""
    import numpy as np

    from configs import DataConfig
    from data.loader import calibration_images, calibration_windows

    (tmp_path / "t").mkdir()
    for split in ("train", "val"):
        np.arange(2_000, dtype=np.uint16).tofile(tmp_path / "t" / f"{split}.bin")
    tokens, images = DataConfig(dataset="tokens", root=str(tmp_path / "t")), DataConfig(dataset="synthetic")
    expected = calibration_windows(tokens, 16, 4, 0, vocab_size=2_000), calibration_images(images, 32, 10, 4, 0)
    with torch.device("meta"):
        got = calibration_windows(tokens, 16, 4, 0, vocab_size=2_000), calibration_images(images, 32, 10, 4, 0)
    assert all(g.device.type == "cpu" and torch.equal(g, e) for g, e in zip(got, expected))


def test_unreadable_samples_are_replaced_with_indices_on_the_batch_device():
    """A training batch's unreadable samples are replaced by readable ones of the same batch, indexed on the
    batch's device (the old code built the index on the default device)."""
    from data.folder import unreadable_replacer

    class Files:
        def filename(self, index, absolute=False):
            return f"/data/{index}.png"

    images, targets = torch.arange(4.0).view(4, 1), torch.tensor([0, -2, 2, -4])
    with torch.device("meta"):
        images, targets, names = unreadable_replacer(Files())(images, targets)
    assert images.device.type == "cpu" and images.flatten().tolist() == [0.0, 0.0, 2.0, 2.0]
    assert targets.tolist() == [0, 0, 2, 2] and names == ["/data/1.png", "/data/3.png"]


def test_evaluations_copy_nothing_from_the_host_per_batch():
    """engine.loop.evaluate and the language-model evaluation add each batch's counts on the device: the old
    code made torch.tensor(count, device=device) per batch, a blocking copy (a host sync on CUDA)."""
    from engine.tasks import evaluate_language_model
    from models.gpt import build_gpt

    model = tiny_vit()
    batches = [(images(4, seed=s), torch.arange(4) % 10) for s in range(3)]
    with HostCopies() as copies:
        metrics = evaluate(model, batches, torch.device("cpu"))
    assert copies.count == 0 and metrics["count"] == 12
    torch.manual_seed(0)
    gpt = build_gpt("gpt2_nano", vocab_size=64)
    windows = [(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))) for _ in range(3)]
    with HostCopies() as copies:
        metrics = evaluate_language_model(gpt, windows, torch.device("cpu"))
    assert copies.count == 0 and metrics["count"] == 6 and metrics["tokens"] == 96


def test_probe_moments_copy_nothing_from_the_host_per_module():
    """ActivationProbe(moments=True) (evaluate.py, train.py's act_max validation) counts each output's values on
    the device: the old code made x.new_tensor(numel) in every hook, a blocking copy per module and batch."""
    model = tiny_vit()
    with HostCopies() as copies, ActivationProbe(model, moments=True) as probe:
        model(images(4))
    result = probe.result()
    assert copies.count == 0
    assert result.module > 0 and all(r["kurtosis"] > 0 for r in result.per_layer)



def test_a_probes_maxima_are_placed_on_the_device_asked():
    """A rank that saw no batch gives zeros on the device `result(device=...)` names (that of the collective),
    not on the default device; `maxima(device)` puts seen maxima there too (meta stands for the other device)."""
    model = tiny_vit(depth=1)
    probe = ActivationProbe(model)
    with torch.device("meta"):
        empty = probe.result(device=torch.device("cpu"))
    assert (empty.module, empty.block) == (0.0, 0.0)
    with torch.no_grad(), probe:
        model(images(2))
    assert probe.maxima(torch.device("meta")).device.type == "meta" and probe.maxima().device.type == "cpu"


def test_a_probe_measures_a_model_split_over_two_gpus():
    """Block 0 on cuda:0, block 1 on cuda:1 (transformers' device_map="auto", whose hooks move each block's input to
    its device; FakeTensors check devices as CUDA does): the running statistics lived on the device of the first
    output seen, and block 1's outputs were clamped into them across the devices, which torch refuses. Each device's
    outputs are kept on their device; maxima(), seen() and moment_sums() are joined on one device."""
    from cd_models import tiny_vit as two_block_vit
    from test_cd_update import _split_over_two_gpus

    model = two_block_vit().eval()
    mode = _split_over_two_gpus(model)
    model.blocks[1].register_forward_pre_hook(lambda m, args: tuple(a.to("cuda:1") for a in args))
    model.norm.register_forward_pre_hook(lambda m, args: tuple(a.to("cuda:0") for a in args))
    probe = ActivationProbe(model, moments=True)
    with mode, torch.no_grad(), probe:
        model(torch.randn(2, 3, 32, 32, device="cuda:0"))
        maxima, seen, sums = probe.maxima(), probe.seen(), probe.moment_sums()
        on_one = probe.maxima(torch.device("cuda:1"))
    assert {str(t.device) for t in (maxima, seen, sums)} == {"cuda:0"} and on_one.device == torch.device("cuda:1")
    assert maxima.shape == seen.shape == (len(probe.targets),) and sums.shape == (len(probe.targets), 5)

def test_removing_directions_indexes_on_the_weights_device():
    """scripts/mechanism.py remove_directions (the `remove` command, on --device cuda) indexes the SVD factors
    with an index on their device. The old index was made on the default device: under this test's meta
    default, indexing CPU factors with a meta index gave garbage silently (the result is checked, not only
    its device)."""
    from mechanism import remove_directions

    w1 = tiny_vit().blocks[0].mlp.fc1.weight.detach()
    expected = remove_directions(w1, [0, 2])
    with torch.device("meta"):
        out = remove_directions(w1, [0, 2])
    assert out.device.type == "cpu" and torch.equal(out, expected)


@pytest.mark.parametrize("value, message", [
    ("meta", "cache_device='meta': give cpu, cuda or cuda:N, or null"),
    ("cuda", "cache_device='cuda': no CUDA device is visible"),
    ("cuda:3", "cache_device='cuda:3': 2 CUDA device(s) are visible (cuda:0 .. cuda:1)"),
])
def test_an_aphq_cache_device_this_machine_lacks_is_refused_before_any_work(monkeypatch, value, message):
    """quant.aphq.cache_device was checked only as a device name: cuda on a machine without a GPU, cuda:3 beside
    two GPUs, or meta ran the FP evaluation and then failed with a traceback where the first tensor was cached."""
    count = 2 if value == "cuda:3" else 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    with pytest.raises(ValueError, match=re.escape(message)):
        PIPELINES["aphq"](None, None, "w4a4", {"cache_device": value}, data=None)


@pytest.mark.parametrize("script", ["bench_quant", "bench_aphq_block"])
@pytest.mark.parametrize("device, message", [
    ("gpu", "argument --device: gpu: not a torch device; give cpu, cuda or cuda:N"),
    ("cuda", "argument --device: cuda: no CUDA device is visible; give cpu"),
    ("meta", "argument --device: meta: give cpu, cuda or cuda:N"),
])
def test_a_benchmark_device_this_machine_lacks_is_one_usage_error(monkeypatch, capsys, script, device, message):
    """scripts/bench_quant.py and bench_aphq_block.py took --device as any text: a name torch does not know, or
    cuda without a GPU, was a traceback after the model was built."""
    module = load_script(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--device", device, "--model", "vit_tiny_patch16_224", "--img-size", "32", "--depth", "1"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_gptq_with_static_groups_reads_the_column_order_once():
    """quant/gptq/solver.py with static groups read int(perm[j]) for every column (a host sync per column on
    CUDA); it reads the permutation once. The weights are those of the per-column reads."""
    from quant.gptq.quantizer import GPTQQuantizer
    from quant.gptq.solver import gptq_quantize

    reads, results = [], []
    for columns in (32, 64):
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(8, columns, generator=g), torch.randn(256, columns, generator=g)
        quantizer = GPTQQuantizer(4, group_size=8)
        with HostReads() as counter:
            q, _ = gptq_quantize(w, x.t() @ x, quantizer, blocksize=16, act_order=True, static_groups=True)
        reads.append(counter.count)
        groups = [quantizer.range_params(w[:, i:i + 8]) for i in range(0, columns, 8)]
        results.append(all(torch.allclose(q[:, j], torch.clamp(torch.round(q[:, j] / groups[j // 8][0])
                                          + groups[j // 8][1], 0, 15).sub(groups[j // 8][1])
                                          .mul(groups[j // 8][0]), atol=1e-5) for j in range(columns)))
    assert reads[0] == reads[1], reads  # not one more per column
    assert all(results)  # every column on the grid of its own (static) group


@pytest.mark.parametrize("pipeline, bits, options", [
    ("rtn", "w4a16", dict(group_size=16, symmetric=True)),
    ("gptq", "w4a16", dict(act_order=True, static_groups=True, group_size=16)),
    ("gptq", "w4a16", dict(true_sequential=True, blocksize=8)),
    ("smoothquant", "w8a8", dict(quantize_bmm="all", act_calibration="static", act_granularity="tensor")),
    ("smoothquant_strict", "w4a4", None),
], ids=["rtn", "gptq-static", "gptq-sequential", "smoothquant", "smoothquant_strict"])
@pytest.mark.parametrize("make_model", [tiny_vit, tiny_swin, "gpt"], ids=["vit", "swin", "gpt"])
def test_the_language_model_pipelines_create_no_tensor_on_the_default_device(pipeline, bits, options, make_model):
    """The paper's GPT-2 pipelines (which run on ViTs too) under the meta default, as the four vision ones above
    (they had no such test)."""
    if make_model == "gpt":
        from models.gpt import build_gpt

        torch.manual_seed(0)
        model = build_gpt("gpt2_nano", vocab_size=64).eval()
        calib = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(0))
    else:
        model, calib = make_model(), images(16)
    with torch.device("meta"):
        qmodel, _ = PIPELINES[pipeline](model, calib, bits, options)
        out = qmodel(calib)
    assert out.device.type == "cpu" and torch.isfinite(out).all()
    assert [name for name, t in tensors_of(qmodel) if t.device.type != "cpu"] == []


def test_the_training_loop_with_every_regularizer_creates_no_tensor_on_the_default_device():
    """engine.loop.TrainLoop as train.py builds it (CD attached, TWEO's loss, EMA, mixup / cutmix, bf16
    autocast, clipping, two accumulation steps, per-step schedule) under the meta default: the test above
    only made one hand-written step."""
    from timm.data import Mixup
    from timm.utils import ModelEmaV3

    from device_utils import _FixedOrder
    from engine.loop import TrainBatches, TrainLoop, TrainState

    model = tiny_vit().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    decay = ColinearityDecay(model, lam=0.01)
    decay.attach(opt)
    ema = ModelEmaV3(model, decay=0.9)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=10)
    batches = [(images(4, seed=s), torch.arange(4) % 10) for s in range(4)]
    with TWEO(model, lam=0.01) as tweo:
        def compute_loss(m, x, y):
            loss = torch.sum(-y * torch.log_softmax(m(x), dim=-1), dim=-1).mean()
            return loss + tweo.aux_loss(loss)

        loop = TrainLoop(model=model, optimizer=opt, compute_loss=compute_loss, device=torch.device("cpu"),
                         amp="bf16", accum_steps=2, clip_grad=1.0, ema=ema, mixup=mixup, log_every=1,
                         metric_sources=[decay.metrics, tweo.metrics])
        state = TrainState()
        with torch.device("meta"):
            reason = loop.run_epoch(TrainBatches(OnCPU(batches), _FixedOrder()), state, batch_size_per_gpu=4)
            metrics = evaluate(ema.module, OnCPU(batches), torch.device("cpu"), amp="bf16")
    assert reason == "epoch_end" and state.step == 2 and decay.metrics()["cd/updates"] == 2
    assert all(torch.isfinite(p).all() and p.device.type == "cpu" for p in model.parameters())
    assert all(t.device.type == "cpu" for _, t in tensors_of(ema.module)) and metrics["count"] == 16


@pytest.mark.parametrize("lam_per_role", [{}, {"fc2": 0.03}], ids=["one-strength", "per-role"])
def test_the_loss_form_of_cd_copies_nothing_from_the_host_per_forward(lam_per_role):
    """cd.mode=loss: the penalty's per-pair weights were torch.tensor(..., device=e.device) per group and forward,
    a blocking copy (a host sync on CUDA) inside every training forward. The value is the weighted sum."""
    from cd.update import pair_energy

    model = tiny_vit().train()
    decay = ColinearityDecay(model, lam=0.01, lam_per_role=lam_per_role, mode="loss")
    task_loss = torch.tensor(2.0)
    with HostCopies() as copies:
        term = decay.aux_loss(task_loss)
    assert copies.count == 0
    energy = pair_energy(decay.pairs)  # mean over each role's pairs
    counts = {role: sum(p.role == role for p in decay.pairs) for role in energy}
    expected = sum(energy[r] * counts[r] * lam_per_role.get(r, 0.01) / 0.01 for r in energy)
    assert torch.allclose(decay._last_penalty, expected, rtol=1e-5)
    assert torch.allclose(term, decay.loss_coef * task_loss)  # aligned to the task loss (its value)
