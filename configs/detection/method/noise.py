"""The Noise baseline on the detector's backbone (paper Sec. "COCO Detection": uniform-noise injection in weights,
UNIQ, Baskin et al. 2021), an MMEngine config fragment to merge on top of an MMDetection config. Give it as a later
--config of scripts/train_detection.py, which adds its hook to those of the earlier files (engine/detection/config.py
`merge_fragment`: e.g. with cd.py both hooks run). Elsewhere `_base_ = ["<mmdet config>.py", "<this file>"]`
works when the MMDetection config has no custom_hooks of its own (MMEngine refuses a key two `_base_` files
share, and `Config.merge_from_dict` would replace the hook list).

bits = 4 (the W4 target of the W4A4 evaluation), noise on the backbone's Linear layers, seed 0: our choices,
since the paper gives none (cd/README.md, "Noise baseline").
"""
custom_imports = dict(imports=["cd.integrations.mmengine"], allow_failed_imports=False)
custom_hooks = [dict(type="WeightNoiseHook", bits=4, layer_types=["Linear"], seed=0)]
