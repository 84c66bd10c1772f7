"""The hardware and software a benchmark ran on, as the same fields in every benchmark's JSON (bench_overhead.py,
bench_quant.py, bench_aphq_block.py, gpu_check.py; overhead_epochs.py's, whose runs train elsewhere, as its runs'
train.logs record them) and in bench_pair_check.py's printed line: a figure means little without the machine it was
measured on."""
from __future__ import annotations

if __name__ == "__main__":  # a library: its command line is that of the scripts built on it (before its imports,
    import sys              # which need the repository root on the path: a traceback run as a script)
    print("error: scripts/bench_env.py is a library used by "
          "bench_overhead.py, bench_quant.py, bench_aphq_block.py, bench_pair_check.py and gpu_check.py; run one of "
          "those (--help says how)", file=sys.stderr)
    sys.exit(2)

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root, for engine
from engine.runinfo import cpu_name  # noqa: E402


def environment(device) -> dict:
    """device ('cpu', 'cuda', 'cuda:1' or a torch.device): what it runs on and the versions that time it. hardware
    is the GPU's name on CUDA, the processor's model name on a CPU; cuda is the CUDA version torch was built
    with (None in a CPU build)."""
    import timm

    device = torch.device(device)
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {"device": str(device), "hardware": hardware, "torch": torch.__version__, "cuda": torch.version.cuda,
            "timm": timm.__version__}
