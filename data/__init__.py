"""Data: ImageNet-style folders with the DeiT/Swin augmentation (timm), the embedded real `digits`
set, synthetic data for benchmarks and tests, token streams for language models (nanoGPT's token files,
the embedded King James Bible), and samplers for exact distributed training and eval.
"""
from .folder import DataError
from .loader import (Loaders, build_dataset, build_eval_loader, build_loaders, build_mixup,
                     build_token_eval_loader, build_token_loaders, build_train_loader, calibration_images,
                     calibration_window_count, calibration_windows, check_data_settings, check_same_data_on_every_rank,
                     dataset_classes, val_fingerprint)
from .text import TOKEN_DATASETS

__all__ = ["DataError", "Loaders", "TOKEN_DATASETS", "build_dataset", "build_eval_loader", "build_loaders",
           "build_mixup", "build_token_eval_loader", "build_token_loaders", "build_train_loader",
           "calibration_images", "calibration_window_count", "calibration_windows", "check_data_settings",
           "check_same_data_on_every_rank", "dataset_classes", "val_fingerprint"]
