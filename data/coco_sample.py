"""A small COCO-format instance-segmentation set drawn from a seed: images, boxes and polygon masks.

It stands in for COCO in tests and smoke runs of the detection configs (COCO itself is never downloaded
here). The layout is COCO's, so MMDetection's `CocoDataset` and pycocotools read it unchanged:

    <root>/train2017/000000000001.png ...      <root>/annotations/instances_train2017.json
    <root>/val2017/000000000101.png ...        <root>/annotations/instances_val2017.json

Each image is a textured background with 1-3 objects of two classes, "box" (a filled rectangle) and
"disc" (a filled 24-gon), in random colours; the mask of an object is its polygon, the box its bounds,
the area the polygon's. Objects do not overlap, and each is drawn as its mask up to the outline: PIL's fill also
paints pixels on the polygon's outline that pycocotools' rasterisation of it (`annToMask`) leaves out (and the
two round a few edge pixels apart). Every drawn pixel of an object lies within one pixel (its 3x3 neighbourhood)
of its mask, and every mask pixel within one pixel of a drawn one. The intersection over union of drawn pixels
and mask is lowest for the smallest boxes and grows with the side; measured over seeds 0-9 (50 images each), at
64-pixel images (the default) it is at least 0.765 (a 14-pixel square mask drawn 16 pixels wide), about 0.92 on
average; over seeds 0-4 at least 0.669 at 32 pixels and 0.918 at 256.

    python scripts/make_coco_sample.py /tmp/coco_sample --train 16 --val 8 --size 64
"""
from __future__ import annotations

import json
import math
import os
import random
from typing import Dict, List, Tuple

import numpy as np
from PIL import Image, ImageDraw

CLASSES = ("box", "disc")


def _polygon(kind: str, cx: float, cy: float, r: float) -> List[Tuple[float, float]]:
    if kind == "box":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    return [(cx + r * math.cos(2 * math.pi * i / 24), cy + r * math.sin(2 * math.pi * i / 24)) for i in range(24)]


def _area(poly: List[Tuple[float, float]]) -> float:
    """The shoelace area of a simple polygon."""
    return abs(sum(x0 * y1 - x1 * y0 for (x0, y0), (x1, y1) in zip(poly, poly[1:] + poly[:1]))) / 2


def _objects(rng: random.Random, size: int) -> List[Tuple[str, float, float, float]]:
    """1-3 non-overlapping (kind, cx, cy, r) inside the image (r: 8-20 % of the side, plus 2 px)."""
    placed: List[Tuple[str, float, float, float]] = []
    for _ in range(rng.randint(1, 3)):
        for _attempt in range(50):
            r = rng.uniform(0.08, 0.2) * size + 2  # half the side / the radius
            cx, cy = rng.uniform(r + 1, size - r - 1), rng.uniform(r + 1, size - r - 1)
            # boxes reach r * sqrt(2) from their centre at the corners
            if all(math.hypot(cx - x, cy - y) > (r + q) * 1.42 + 2 for _, x, y, q in placed):
                placed.append((rng.choice(CLASSES), cx, cy, r))
                break
    return placed


def _image(rng: random.Random, size: int, objects) -> Image.Image:
    noise = np.random.default_rng(rng.getrandbits(32)).integers(60, 140, (size, size, 3), dtype=np.uint8)
    img = Image.fromarray(noise)
    draw = ImageDraw.Draw(img)
    for kind, cx, cy, r in objects:
        # each channel far darker or brighter than the background (60-139), so every object stands out
        colour = tuple(rng.choice((rng.randint(0, 30), rng.randint(180, 255))) for _ in range(3))
        draw.polygon(_polygon(kind, cx, cy, r), fill=colour)
    return img


MAX_SIZE = 2048  # pixels per side
MAX_IMAGES = 100_000  # per split: val's ids start at 100_001


def write_coco_sample(root: str, train: int = 16, val: int = 8, size: int = 64, seed: int = 0) -> Dict[str, int]:
    """Write the set under `root` (created; it must not exist or be empty: nothing is overwritten), which holds it
    only once whole (engine/run_dir.write_folder_whole).

    Returns:
        {"train2017": images, "val2017": images, "annotations": objects in all}.
    """
    # val ids start at 100_001, so more train images would share their ids; val is held to the same count (a
    # smoke set's: without a bound any count was written, image by image); a side above MAX_SIZE is no smoke set
    # either (one image is size^2 * 3 bytes of noise in memory)
    if not (1 <= train <= MAX_IMAGES and 1 <= val <= MAX_IMAGES and 32 <= size <= MAX_SIZE):
        raise ValueError(f"need 1 <= train <= {MAX_IMAGES}, 1 <= val <= {MAX_IMAGES} and 32 <= size <= {MAX_SIZE} "
                         f"(got {train}, {val}, {size})")
    if seed < 0:  # random.Random seeds with abs(seed): -1 would write seed 1's set as if it were another
        raise ValueError(f"seed {seed}: give a seed >= 0 (a negative one draws the set of {-seed})")
    if not root:  # os.path.exists("") is False, and every path below would then lie in the current folder
        raise ValueError("the root folder is empty; give a new folder to write the set in")
    if os.path.exists(root) and os.listdir(root):
        raise FileExistsError(f"{root} exists and is not empty; give a new folder (nothing is overwritten)")
    from engine.run_dir import write_folder_whole  # the writer of outputs that appear whole
    rng = random.Random(seed)
    counts, ann_id = {}, 1

    def write(folder: str) -> None:
        nonlocal ann_id
        os.makedirs(os.path.join(folder, "annotations"))
        for split, n, first_id in (("train2017", train, 1), ("val2017", val, 100_001)):
            os.makedirs(os.path.join(folder, split))
            images, annotations = [], []
            for image_id in range(first_id, first_id + n):
                objects = _objects(rng, size)
                name = f"{image_id:012d}.png"
                _image(rng, size, objects).save(os.path.join(folder, split, name))
                images.append({"id": image_id, "file_name": name, "width": size, "height": size})
                for kind, cx, cy, r in objects:
                    poly = _polygon(kind, cx, cy, r)
                    xs, ys = [p[0] for p in poly], [p[1] for p in poly]
                    annotations.append({
                        "id": ann_id, "image_id": image_id, "category_id": CLASSES.index(kind) + 1, "iscrowd": 0,
                        "bbox": [min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys)], "area": _area(poly),
                        "segmentation": [[round(c, 2) for p in poly for c in p]]})
                    ann_id += 1
            categories = [{"id": i + 1, "name": c, "supercategory": "shape"} for i, c in enumerate(CLASSES)]
            with open(os.path.join(folder, "annotations", f"instances_{split}.json"), "w") as f:
                json.dump({"images": images, "annotations": annotations, "categories": categories}, f)
            counts[split] = n

    # whole or not at all: a set cut short (Ctrl-C, a full disk) was left at root, part of a split without its
    # annotations, and the same command refused root as not empty
    write_folder_whole(root, write)
    counts["annotations"] = ann_id - 1
    return counts
