"""Data: ImageNet-style folders with the DeiT/Swin augmentation (timm), the embedded real `digits`
set, synthetic data for benchmarks and tests, and samplers for exact distributed training and eval.
"""
from .folder import DataError
from .loader import (Loaders, build_dataset, build_eval_loader, build_loaders, build_mixup,
                     build_train_loader, calibration_images, dataset_classes)

__all__ = ["DataError", "Loaders", "build_dataset", "build_eval_loader", "build_loaders", "build_mixup",
           "build_train_loader", "calibration_images", "dataset_classes"]
