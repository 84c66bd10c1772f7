"""Write a small COCO-format instance-segmentation set (data/coco_sample.py) for smoke runs of the detection
configs and for the tests: images, boxes and polygon masks of two shape classes, from a seed.

    python scripts/make_coco_sample.py /tmp/coco_sample --train 16 --val 8 --size 64
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs.cli import OneLineParser, first_line  # noqa: E402
from data.coco_sample import write_coco_sample  # noqa: E402


def main(argv=None) -> int:
    parser = OneLineParser(description=first_line(__doc__))
    parser.add_argument("root", help="a new (or empty) folder")
    parser.add_argument("--train", type=int, default=16, help="training images (default: %(default)s)")
    parser.add_argument("--val", type=int, default=8, help="validation images (default: %(default)s)")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn images (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        counts = write_coco_sample(args.root, args.train, args.val, args.size, args.seed)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a root that cannot be created or written (under a file, read-only, full disk)
        print(f"error: {args.root}: {e.strerror or e}; give a writable new folder", file=sys.stderr)
        return 2
    print(f"{counts['train2017']} train and {counts['val2017']} val images, {counts['annotations']} objects "
          f"in {args.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
