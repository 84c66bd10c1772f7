"""The TWEO baseline on the detector's backbone (paper Sec. "COCO Detection", App. A.3), an MMEngine config
fragment to merge on top of an MMDetection config. Give it as a later --config of scripts/train_detection.py,
which adds its hook to those of the earlier files (engine/detection/config.py `merge_fragment`: e.g. with cd.py both
hooks run). Elsewhere `_base_ = ["<mmdet config>.py", "<this file>"]` works when the MMDetection config has no
custom_hooks of its own (MMEngine refuses a key two `_base_` files share, and `Config.merge_from_dict` would
replace the hook list).

The paper rescales TWEO's term to the task-loss magnitude for detection and tunes lambda in the 1e-4 range;
lam = 1e-4 is our choice within that range (the paper gives no exact value).
"""
custom_imports = dict(imports=["cd.integrations.mmengine"], allow_failed_imports=False)
custom_hooks = [dict(type="TweoHook", lam=1e-4, rescale=True)]
