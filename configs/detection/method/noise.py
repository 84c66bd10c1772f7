"""The Noise baseline on the detector's backbone (paper Sec. "COCO Detection": uniform-noise injection in weights,
UNIQ, Baskin et al. 2021), an MMEngine config fragment to merge on top of an MMDetection config:
`_base_ = ["<mmdet config>.py", "<this file>"]` (no key in common unless the MMDetection config has its own
custom_hooks; then merge with `Config.merge_from_dict`).

bits = 4 (the W4 target of the W4A4 evaluation), noise on the backbone's Linear layers, seed 0: our choices,
since the paper gives none (cd/README.md, "Noise baseline").
"""
custom_imports = dict(imports=["cd.integrations.mmengine"], allow_failed_imports=False)
custom_hooks = [dict(type="WeightNoiseHook", bits=4, layer_types=["Linear"], seed=0)]
