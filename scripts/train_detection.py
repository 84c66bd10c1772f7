"""Train an MMDetection detector (the paper's COCO study): MMDetection's own Runner on merged config files,
with this repository's guards (data root, backbone checkpoint, nothing overwritten).

    python scripts/train_detection.py --config configs/detection/mask_rcnn_swin_t_1x.py \
        --config configs/detection/method/cd.py --data-root /datasets/coco --work-dir runs/det_t1x_cd \
        model.backbone.init_cfg.checkpoint=/weights/swin_tiny_patch4_window7_224.pth
    torchrun --nproc_per_node=8 scripts/train_detection.py --launcher pytorch ...   # the paper's 8 GPUs
    python scripts/train_detection.py ... --resume                                 # continue the same run

A work dir that already holds checkpoints is refused unless --resume continues the run in it (MMEngine's
`last_checkpoint`), so no run overwrites another's epoch_N.pth. The batch per GPU is the config's (2 images,
16 in all on 8 GPUs, the official setting); with fewer GPUs add `auto_scale_lr.enable=True` to scale the lr.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True,
                        help="MMDetection config; repeat to merge fragments in order (a method: "
                             "configs/detection/method/*.py)")
    parser.add_argument("--work-dir", required=True, help="where checkpoints and logs go")
    parser.add_argument("--data-root", help="COCO folder (annotations/, train2017/, val2017/)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --work-dir from its last checkpoint")
    parser.add_argument("--launcher", choices=("none", "pytorch", "slurm"), default="none",
                        help="pytorch under torchrun, slurm under srun")
    parser.add_argument("--local-rank", "--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value (MMEngine's --cfg-options)")
    return parser.parse_args(argv)


def check_work_dir(work_dir: str, resume: bool) -> None:
    """Refuse to start a new run over an old one's checkpoints, and to resume where there is nothing."""
    from engine.detection import DetectionError
    if os.path.exists(work_dir) and not os.path.isdir(work_dir):
        raise DetectionError(f"--work-dir {work_dir} is a file: give a folder")
    checkpoints = glob.glob(os.path.join(work_dir, "*.pth")) + glob.glob(os.path.join(work_dir, "last_checkpoint"))
    if checkpoints and not resume:
        raise DetectionError(f"--work-dir {work_dir} holds checkpoints of an earlier run "
                             f"({os.path.basename(sorted(checkpoints)[0])}, ...): give --resume to continue it, "
                             "or a new --work-dir")
    if resume and not os.path.isfile(os.path.join(work_dir, "last_checkpoint")):
        raise DetectionError(f"--resume: --work-dir {work_dir} has no last_checkpoint to continue from")


def main(argv=None) -> int:
    args = parse_args(argv)
    from engine.detection import (annotation_files, check_annotation_files, check_backbone_init, load_config,
                                  parse_overrides, reading_annotations)
    from mmengine.runner import Runner

    cfg = load_config(args.config, parse_overrides(args.overrides), args.data_root)
    if args.data_root is None:  # the config's own paths (--data-root checked them otherwise)
        check_annotation_files(cfg)
    check_work_dir(args.work_dir, args.resume)
    if not args.resume:
        check_backbone_init(cfg)
    cfg.work_dir = args.work_dir
    cfg.launcher = args.launcher
    cfg.resume = args.resume
    if args.resume:
        # MMEngine 0.10 checkpoints hold numpy / python objects that torch >= 2.6's weights_only load refuses;
        # these are the run's own files (check_work_dir), so the full unpickler is safe here.
        os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    runner = Runner.from_cfg(cfg)
    # The loops read the annotation files when they are built, which runner.train() does unless the properties
    # did it first: here, so that an unreadable file is one error line naming it.
    with reading_annotations([path for _, path in annotation_files(cfg)]):
        runner.train_loop, runner.val_loop  # noqa: B018 - built for their side effect
    runner.train()
    return 0


def run(argv=None) -> None:
    """main() with bad input reported as one `error:` line and exit code 2."""
    try:
        sys.exit(main(argv))
    except ValueError as e:  # DetectionError (engine/detection.py), a bad override (parse_overrides)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run()
