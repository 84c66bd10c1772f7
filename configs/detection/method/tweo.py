"""The TWEO baseline on the detector's backbone (paper Sec. "COCO Detection", App. A.3), an MMEngine config
fragment to merge on top of an MMDetection config: `_base_ = ["<mmdet config>.py", "<this file>"]` (no key in
common unless the MMDetection config has its own custom_hooks; then merge with `Config.merge_from_dict`).

The paper rescales TWEO's term to the task-loss magnitude for detection and tunes lambda in the 1e-4 range;
lam = 1e-4 is our choice within that range (the paper gives no exact value).
"""
custom_imports = dict(imports=["cd.integrations.mmengine"], allow_failed_imports=False)
custom_hooks = [dict(type="TweoHook", lam=1e-4, rescale=True)]
