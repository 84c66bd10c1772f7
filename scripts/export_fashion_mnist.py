r"""Export Fashion-MNIST (Debian's dataset-fashion-mnist package) as ImageNet-style class folders.

    apt-get install -y dataset-fashion-mnist        # idx .gz files in /usr/share/datasets/fashion-mnist
    python scripts/export_fashion_mnist.py --out data_sets/fashion_mnist --train-per-class 200 \
        --val-per-class 50
    python train.py --config configs/finetune/fashion_mnist_dinov2_s14.yaml \
        data.root=data_sets/fashion_mnist model.pretrained=...

Writes OUT/train/<class>/<n>.png from the 60,000 training images and OUT/val/<class>/<n>.png from the
10,000 test images: 28x28 8-bit grayscale PNGs with the original pixel values (the data loader converts
them to RGB), named by their index in the idx file so that any image can be traced back. Class folders
are `<label>_<name>` (0_t-shirt_top ... 9_ankle_boot): timm's folder reader numbers classes in natural
sort order of the folder names, and the label prefix makes that order Fashion-MNIST's own labels.
`--train-per-class` / `--val-per-class` keep the first N images of each class in file order (the files
are already shuffled), a fixed subset for runs that must fit a CPU. The images appear at OUT only once all
are written (until then in a folder OUT.partial-<host>-<pid>-<random> beside it, or a hidden one in an empty OUT
given, which an interrupted export removes; a killed one leaves it behind, never a part of the set).
"""
from __future__ import annotations

import argparse
import gzip
import os
import sys
import zlib
from typing import Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from configs.cli import OneLineParser, at_least  # noqa: E402

DEFAULT_SOURCE = "/usr/share/datasets/fashion-mnist"
# (label order of the data set; README of zalandoresearch/fashion-mnist)
CLASSES = ["t-shirt_top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
           "ankle_boot"]
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
IDX_UBYTE = 0x08  # idx data-type code of unsigned bytes, the only one Fashion-MNIST uses


class ExportError(ValueError):
    """Missing or malformed input files, or an output folder that is in the way."""


def class_folder(label: int) -> str:
    return f"{label}_{CLASSES[label]}"


def read_idx(path: str) -> np.ndarray:
    """An idx file (optionally gzipped): 2 zero bytes, the type code, the number of dimensions, big-endian
    uint32 sizes, then the data (http://yann.lecun.com/exdb/mnist/)."""
    if not os.path.isfile(path):
        raise ExportError(f"{path} not found: apt-get install -y dataset-fashion-mnist, or give --source")
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:  # a non-gzip .gz, one cut short (EOFError), corrupt (zlib)
        raise ExportError(f"cannot read {path}: {e}") from None
    if len(data) < 4 or data[0] or data[1] or data[2] != IDX_UBYTE or not 1 <= data[3] <= 4:
        raise ExportError(f"{path} is not an idx file of unsigned bytes (header {data[:4].hex()})")
    ndim = data[3]
    if len(data) < 4 + 4 * ndim:  # the sizes themselves cut short
        raise ExportError(f"{path}: the header promises {ndim} sizes, the file ends after {len(data)} bytes")
    shape = tuple(int(s) for s in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    body = data[4 + 4 * ndim:]
    if len(body) != int(np.prod(shape)):
        raise ExportError(f"{path}: the header promises {shape} = {int(np.prod(shape))} bytes, the file "
                          f"holds {len(body)}")
    return np.frombuffer(body, dtype=np.uint8).reshape(shape)


def load_split(source: str, split: str) -> tuple:
    """(images [N, 28, 28] uint8, labels [N] uint8) of 'train' or 'val' (the idx test set)."""
    images, labels = (read_idx(os.path.join(source, name)) for name in FILES[split])
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ExportError(f"{source}: {split} images {images.shape} and labels {labels.shape} do not pair up")
    if images.shape[1:] != (28, 28) or not len(images):  # what a folder of 28x28 PNGs per class needs
        raise ExportError(f"{source}: {split} images {images.shape}: Fashion-MNIST holds 28x28 images, at least one")
    if labels.max(initial=0) >= len(CLASSES):
        raise ExportError(f"{source}: {split} labels go up to {labels.max()}; Fashion-MNIST has 10 classes")
    return images, labels


def select(labels: np.ndarray, per_class: Optional[int], split: str) -> np.ndarray:
    """Indices of the first `per_class` images of every class (all of them if None), in file order."""
    if per_class is None:
        return np.arange(len(labels))
    keep = []
    for label in range(len(CLASSES)):
        found = np.flatnonzero(labels == label)
        if len(found) < per_class:
            raise ExportError(f"the {split} split has {len(found)} images of class {class_folder(label)}, "
                              f"fewer than the {per_class} asked for")
        keep.append(found[:per_class])
    return np.sort(np.concatenate(keep))


def export(source: str, out: str, train_per_class: Optional[int] = None,
           val_per_class: Optional[int] = None) -> dict:
    """Write OUT/{train,val}/<class>/<index>.png; returns {split: images written}."""
    from PIL import Image
    if not out:  # os.path.exists("") is False, and every path below would then lie in the current folder
        raise ExportError("--out is empty; give the folder to write the images in")
    if os.path.isdir(out) and os.listdir(out):
        raise ExportError(f"{out} is not empty; remove it or give another --out")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"{out} exists and is not a folder; give another --out")
    splits = {split: load_split(source, split) for split in FILES}  # all read before anything is written
    chosen_of = {split: select(splits[split][1], per_class, split)  # and every selection made
                 for split, per_class in (("train", train_per_class), ("val", val_per_class))}
    from engine.run_dir import write_folder_whole  # here: it imports torch, which the reading above does not need
    counts = {}

    def write(folder: str) -> None:
        for split, chosen in chosen_of.items():
            images, labels = splits[split]
            for label in range(len(CLASSES)):
                os.makedirs(os.path.join(folder, split, class_folder(label)))
            for index in chosen:
                path = os.path.join(folder, split, class_folder(int(labels[index])), f"{index:05d}.png")
                Image.fromarray(images[index]).save(path)  # 2-D uint8: 8-bit grayscale
            counts[split] = len(chosen)

    try:
        # whole or not at all: an export cut short (Ctrl-C, a full disk) left a part of the set at --out, which
        # train.py took for the data set and the same command refused as not empty
        write_folder_whole(out, write)
    except OSError as e:  # under a file, read-only, a full disk
        raise ExportError(f"--out {out}: {e.strerror or e}; give a writable folder") from None
    return counts


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (must be empty or absent)")
    p.add_argument("--source", default=DEFAULT_SOURCE, help=f"folder of the idx .gz files ({DEFAULT_SOURCE})")
    p.add_argument("--train-per-class", type=at_least(1), default=None,
                   help="keep the first N training images of each class (default: all 6,000)")
    p.add_argument("--val-per-class", type=at_least(1), default=None,
                   help="keep the first N test images of each class (default: all 1,000)")
    args = p.parse_args(argv)
    try:
        counts = export(args.source, args.out, args.train_per_class, args.val_per_class)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {counts['train']} train and {counts['val']} val images in {len(CLASSES)} classes to "
          f"{args.out}; train with data.dataset=folder data.root={args.out} model.num_classes={len(CLASSES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
