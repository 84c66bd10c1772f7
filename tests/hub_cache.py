"""A Hugging Face cache made on disk for tests of model.pretrained=hub: random weights as timm's hub copies, served
offline (nothing is fetched)."""
from __future__ import annotations

import os

import huggingface_hub.constants
import timm
import torch
from safetensors.torch import save_file


def make_hub_cache(root: os.PathLike, names: list[str]) -> dict[str, str]:
    """Write under `root` (a HF_HUB_CACHE) each timm model of `names` as its hub copy: random weights (seed 0) in
    model.safetensors of the main revision. Returns {name: that file}."""
    files = {}
    for name in names:
        repo, revision = os.path.join(root, f"models--timm--{name}"), "0" * 40
        snapshot = os.path.join(repo, "snapshots", revision)
        os.makedirs(snapshot)
        os.makedirs(os.path.join(repo, "refs"))
        with open(os.path.join(repo, "refs", "main"), "w") as f:
            f.write(revision)
        torch.manual_seed(0)
        files[name] = os.path.join(snapshot, "model.safetensors")
        save_file(timm.create_model(name).state_dict(), files[name])
    return files


def serve_hub_cache(monkeypatch, root: os.PathLike) -> None:
    """Make huggingface_hub read `root` as its cache, offline."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
