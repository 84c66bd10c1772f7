"""The detection task on MMDetection 3.x: its configs, detectors, COCO loaders and metric, for
scripts/train_detection.py and evaluate_detection.py.

MMDetection does the detection work (models, data pipelines, training loop, pycocotools mAP); this package
only adds what this repository promises around it: configs merged from several files with `key=value`
overrides, one `--data-root` for every loader and evaluator, clear errors before any work (a missing data
set, an unset or remote backbone checkpoint, weights of another model), and an evaluation loop with
activation probes and the quantization seam (`DetectorFeed`, a `quant.calibrate.ModelFeed`).

    config.py       config files merged in order, `key=value` overrides and the checks that refuse ignored ones
    data_checks.py  the loaders' datasets, --data-root, annotation / image-folder / category / pipeline checks
    annotation_contents.py  one annotation file's images and categories against its image folder and classes
    model.py        backbone checkpoint and load_from checks, `build_detector` from an evaluation checkpoint,
                    training method
    rng_state.py    `RngStateHook` (with `RankRngStates`): every rank's random-number state in training checkpoints,
                    for an exact resume
    feeds.py        loaders, and the training images quantization calibrates on (`DetectorFeed`, ...)
    qat.py          GPLQ stage 1 (`train_activation_qat`) in MMEngine's runner, in a resumable work folder
    evaluation.py   `evaluate_detector`: COCO mAP and the backbone / head activation maxima
    errors.py       `DetectionError`, the one-line error every module raises

Every public function and class of these modules is re-exported here (`__all__`), so that importers use
`from engine.detection import X` whichever module defines X; constants are read from their module.

Importing this package imports mmdet (an optional dependency: requirements-detection.txt), which needs full
mmcv with its compiled ops (scripts/install_mmcv.sh).
"""
import importlib

try:
    importlib.import_module("mmdet")  # registers MMDetection's modules, transforms and metrics
    # the modules import MMEngine and MMDetection: a missing one is the same message as a missing mmdet
    from engine.detection.errors import DetectionError
    from engine.detection.config import (CommandReads, check_hooks, check_method_hooks, check_override_keys,
                                         load_config, loader_arguments, merge_fragment, parse_overrides, read_config,
                                         runner_keys)
    from engine.detection.annotation_contents import (category_problems, dropped_objects, images_with_objects,
                                                      label_names, scored_images, scored_objects,
                                                      unlisted_image_problem,
                                                      unusable_images)
    from engine.detection.data_checks import (annotation_files, annotation_paths, check_annotation_files,
                                              check_annotations, check_evaluator_annotations,
                                              check_evaluator_thresholds, check_head_classes,
                                              check_image_folders, check_pipeline, dataset_classes, image_folders,
                                              loader_datasets, reading_annotations, set_data_root)
    from engine.detection.model import (build_detector, check_backbone_checkpoint, check_backbone_init,
                                        check_checkpoint_classes, check_checkpoint_file, check_load_from, method_of,
                                        mismatch, read_state, training_config)
    from engine.detection.rng_state import RankRngStates, RngStateHook
    from engine.detection.feeds import (DetectorFeed, DetectorSamples, TrainingImages, build_loader,
                                        pipeline_of_test_split, train_images_with_test_pipeline)
    from engine.detection.qat import (check_stage1_amp, check_stage1_device, check_stage1_folder,
                                      checkpoint_iteration, train_activation_qat)
    from engine.detection.evaluation import activation_maxima, evaluate_detector
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(f"the detection task needs MMDetection and full mmcv ({e}): "
                      "pip install -r requirements-detection.txt && bash scripts/install_mmcv.sh") from e

__all__ = [
    "DetectionError",
    "CommandReads", "check_hooks", "check_method_hooks", "check_override_keys", "load_config", "loader_arguments",
    "merge_fragment", "parse_overrides", "read_config", "runner_keys",
    "category_problems", "dropped_objects", "images_with_objects", "label_names", "scored_images", "scored_objects",
    "unlisted_image_problem", "unusable_images",
    "annotation_files", "annotation_paths", "check_annotation_files", "check_annotations",
    "check_evaluator_annotations", "check_evaluator_thresholds", "check_head_classes", "check_image_folders",
    "check_pipeline", "dataset_classes", "image_folders", "loader_datasets", "reading_annotations", "set_data_root",
    "build_detector", "check_backbone_checkpoint", "check_backbone_init", "check_checkpoint_classes",
    "check_checkpoint_file", "check_load_from", "method_of", "mismatch", "read_state", "training_config",
    "RngStateHook", "RankRngStates",
    "DetectorFeed", "DetectorSamples", "TrainingImages", "build_loader", "pipeline_of_test_split",
    "train_images_with_test_pipeline",
    "check_stage1_amp", "check_stage1_device", "check_stage1_folder", "checkpoint_iteration", "train_activation_qat",
    "activation_maxima", "evaluate_detector",
]
