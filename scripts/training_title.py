"""The title of a sweep report's figure: what its runs trained, read from the runs' own saved configs.

A figure of runs of one sweep names their model (models.model_label), whether they fine-tuned a pretrained backbone
(model.pretrained set) or trained from scratch, their data set and the input size they trained at. A part in which
the runs differ names every value and says that they differ: one run's value would describe the others wrongly.
"""
from __future__ import annotations

if __name__ == "__main__":  # a library: its command line is that of the scripts built on it (before its imports,
    import sys              # which need the repository root on the path: a traceback run as a script)
    print("error: scripts/training_title.py is a library used by "
          "dose_report.py and lm_study.py; run one of those (--help says how)", file=sys.stderr)
    sys.exit(2)

import os
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from configs.schema import Config, DataConfig, ModelConfig  # noqa: E402
from models import model_label  # noqa: E402
from models.factory import own_img_size  # noqa: E402


def dataset_name(data: DataConfig) -> str:
    """The data set as a reader knows it: a folder's (or token files') own name, e.g. fashion_mnist_dose for
    data.root=data_sets/fashion_mnist_dose; the embedded and generated ones by data.dataset (digits, synthetic, kjv)."""
    if data.dataset in ("folder", "tokens") and data.root:
        return os.path.basename(os.path.normpath(data.root))
    return data.dataset


def input_size_text(model: ModelConfig) -> Optional[str]:
    """The input size the model trained at: model.img_size, or the variant's / timm's own where it is unset
    (vit_micro's 32); None for a language model, which has no image size."""
    size = model.img_size or own_img_size(model)
    return f"{size} px" if size else None


def one_or_all(values: Sequence[str], what: str) -> str:
    """The runs' common value, or every value (in the runs' order, each once) and that they differ."""
    distinct = list(dict.fromkeys(values))
    return distinct[0] if len(distinct) == 1 else f"{what} differ: {' / '.join(distinct)}"


def training_title(subject: str, configs: Sequence[Config]) -> str:
    """`subject` during what the runs of `configs` (one per run) trained, e.g. "Pair energy during fine-tuning
    (vit_small_patch14_dinov2, fashion_mnist_dose, 28 px)" or "... during training from scratch (vit_micro,
    fashion_mnist_scratch, 32 px)"."""
    phases = list(dict.fromkeys("fine-tuning" if c.model.pretrained else "training from scratch" for c in configs))
    phase = phases[0] if len(phases) == 1 else f"{' / '.join(phases)} (the runs differ)"
    parts = [one_or_all([model_label(c.model) for c in configs], "models"),
             one_or_all([dataset_name(c.data) for c in configs], "data sets")]
    sizes = [input_size_text(c.model) for c in configs]
    if any(sizes):
        parts.append(one_or_all([s or "no image size" for s in sizes], "input sizes"))
    return f"{subject} during {phase} ({', '.join(parts)})"
