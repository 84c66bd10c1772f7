"""RepQ-ViT (Li et al., ICCV 2023) as zkkli/RepQ-ViT `classification/test_quant.py` runs it.

1. Convert: weights asymmetric per output channel; inputs of qkv / fc1 / Swin reduction (LayerNorm
   outputs) asymmetric PER CHANNEL (last dim); all other Linear inputs and q, k, v per tensor;
   post-softmax attention with the log-sqrt2 quantizer. Every range: percentile candidates
   {0.999, 0.9999, 0.99999} (lower end 1 - p) with MSE selection; stem input 8 bit.
2. Calibrate: one sequential forward on the calibration set (calibrate.py).
3. Reparameterise every block LayerNorm (norm1, norm2) and Swin's PatchMerging norm: fold the
   per-channel scales into the LN affine and the next Linear; those inputs become per tensor.
4. Re-fit only the weight quantizers of the folded Linears on the rescaled weights; all activation
   quantizers keep their step-2 parameters. No reconstruction.

Every quantile is torch.quantile's, as the official quantizers call it (quant/quantile.py). The fold computes in
float64 where the official code computes in float32 (quant/README.md, "Fold arithmetic").

Zero point of the fold: the official code keeps the mean zero point z~ unrounded, which is our default
(`round_zero_point=False`) because the paper's RepQ-ViT column reproduces the official pipeline.
`round_zero_point=True` makes the per-tensor codes exactly equal to the per-channel ones
(tests/test_quant_reparam.py). `reparam=False` keeps per-channel post-LN activations (the not
hardware-friendly variant of zkkli/RepQ-ViT issue #11), for ablations; it reads no `round_zero_point`, and a
non-default one beside it is refused.

The fold is exact only where Swin's window attention pads nothing after norm1: a timm Swin whose stage grids are
not multiples of its windows at the model's input size is refused before any work (fold_windows.py, quant/README.md);
a detector's Swin pads at every image's own grid and is folded as the official detection code folds it.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from configs.quant import RepQOptions

from ..calibrate import Images, refit_weight_quantizers
from ..fold_windows import check_fold_windows
from ..layout import standard_layout
from ..pipeline_base import Pipeline, PTQResult, StageTimer, convert_and_calibrate, pipeline_report
from ..pipeline_data import PipelineData
from ..quantizers import LogSqrt2Quantizer
from ..ranges import REPQ_PERCENTILES, RangeSearch
from ..reparam import REPQ_FOLD_SITES, check_fold_sites, find_fold_sites, fold_layernorm
from ..spec import Bits, QuantizerSpec, QuantSpec


class RepQPipeline(Pipeline):
    name = "repq"
    Options = RepQOptions
    tasks = ("classification", "detection")  # detection: MMDetection detectors (evaluate_detection.py)

    def layout(self, bits: Bits, options: RepQOptions) -> QuantSpec:
        """The converted layout before calibration (post-LN inputs still per channel)."""
        search = RangeSearch("percentile_mse", REPQ_PERCENTILES)
        act = QuantizerSpec(bits.a, search=search)
        return standard_layout(
            weight=QuantizerSpec(bits.w, granularity="channel", search=search),
            post_norm_input=QuantizerSpec(bits.a, granularity="channel", search=search),
            block_input=act, q=act, k=act, v=act,
            attn=QuantizerSpec(bits.a, kind=LogSqrt2Quantizer, search=search),
            first_last=options.resolved(bits))

    def check(self, bits: Bits, options: RepQOptions) -> None:
        super().check(bits, options)
        # the mean zero point is computed by the fold alone (reparam.fold_layernorm): without it the per-channel
        # zero points stay as calibrated, and the result would record a setting that changed nothing
        if not options.reparam and options.round_zero_point != RepQOptions.round_zero_point:
            raise ValueError(f"round_zero_point={options.round_zero_point} is read only by the LayerNorm fold, and "
                             f"reparam=False turns the fold off: drop it, or set reparam=True")

    def check_folds(self, fp_model: nn.Module, bits: Bits, options: RepQOptions) -> None:
        """The fold takes an affine LayerNorm in the pre-norm blocks its sites are written for
        (reparam.check_fold_sites); without it (reparam=False) any norm."""
        if options.reparam:
            check_fold_sites(fp_model, REPQ_FOLD_SITES, self.name, other_fix="reparam=False (quant.repq.reparam=false: "
                             "no fold, the post-LayerNorm inputs stay per channel)")

    def check_input_size(self, fp_model: nn.Module, bits: Bits, options: RepQOptions) -> None:
        """The fold keeps a Swin's float function only where its norm1 output fills whole windows (fold_windows.py);
        without the fold (reparam=False) any input size."""
        if options.reparam:
            check_fold_windows(fp_model, self.name, "reparam=False (quant.repq.reparam=false: no fold, the "
                                                    "post-LayerNorm inputs stay per channel)")

    def run(self, fp_model: nn.Module, calib_images: Images, bits: Bits, options: RepQOptions,
            data: Optional[PipelineData] = None) -> PTQResult:
        del data  # calibration images only
        timer = StageTimer()
        device = next(fp_model.parameters()).device
        model, n_images = convert_and_calibrate(fp_model, self.layout(bits, options), calib_images,
                                                timer, device)
        folded = []
        if options.reparam:
            with timer("reparam", device):
                sites = find_fold_sites(model, REPQ_FOLD_SITES)
                for norm_name, norm, linear_name, linear in sites:
                    fold_layernorm(norm, linear, round_zero_point=options.round_zero_point)
                    folded.append(f"{norm_name} -> {linear_name}")
                refit_weight_quantizers((name, linear) for _, _, name, linear in sites)
        report = pipeline_report(self.name, model, bits, options, calibration_images=n_images, folded=folded,
                                 seconds=timer.seconds)
        return PTQResult(model, report)

