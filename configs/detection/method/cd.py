"""Colinearity Decay on the detector's backbone (paper Sec. "COCO Detection"), an MMEngine config fragment to merge
on top of an MMDetection config (Mask R-CNN + Swin; AdamW, weight decay 0.05).

lam = 0.005 and weight decay 0.05 - lam = 0.045 (the paper's regularization-budget rule, App. A.2) are our
choices: the paper gives no detection strengths, so these are its pre-training ones (one tenth of the weight
decay). Give it as a later --config of scripts/train_detection.py, which merges it over the earlier files and adds its
hook to theirs (engine/detection.py `merge_fragment`: with tweo.py or noise.py both hooks run). It shares
`optim_wrapper` with every MMDetection config, which MMEngine refuses between two `_base_` files: elsewhere merge
it with `engine.detection.merge_fragment(cfg, Config.fromfile("configs/detection/method/cd.py").to_dict())`, or
list the MMDetection config as `_base_` of a child that holds these lines.
"""
custom_imports = dict(imports=["cd.integrations.mmengine"], allow_failed_imports=False)
custom_hooks = [dict(type="ColinearityDecayHook", lam=0.005)]
optim_wrapper = dict(optimizer=dict(weight_decay=0.045))  # 0.05 - lam
